/*
 * qemu_memro_blob.c - the bytes of the QEMU preload built from qemu_memro.c (vmm/CMakeLists.txt
 * builds it and names it in KILN_MEMRO_SO), carried in kiln-node so that no file of the build
 * needs to be found or installed beside it.
 */
#include "vmm/qemu_memro.h"

__asm__(".section .rodata.kiln_memro,\"a\",@progbits\n"
	".balign 16\n"
	".global kiln_memro_so\n"
	".type kiln_memro_so, @object\n"
	"kiln_memro_so:\n"
	".incbin \"" KILN_MEMRO_SO "\"\n"
	".global kiln_memro_so_end\n"
	"kiln_memro_so_end:\n"
	".previous\n");
