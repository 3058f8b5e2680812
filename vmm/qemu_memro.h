/*
 * qemu_memro.h - the QEMU preload of qemu_memro.c, carried as bytes (qemu_memro_blob.c).
 */
#ifndef KILN_VMM_QEMU_MEMRO_H
#define KILN_VMM_QEMU_MEMRO_H

extern const unsigned char kiln_memro_so[];
extern const unsigned char kiln_memro_so_end[];

#endif
