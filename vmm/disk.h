/*
 * disk.h - a VM's disk: a qcow2 copy-on-write layer over a shared, read-only base image.
 *
 * A cold-booted VM gets an overlay over the base root filesystem (raw ext4), sized to the shape's
 * disk size (the guest's file system keeps the base size until it is grown inside the guest). At a
 * snapshot the VM's overlay is frozen into the snapshot and every VM restored from it gets a new,
 * empty overlay on top, so a fork costs only what each child changes. Chains are kept short: when a
 * frozen overlay would sit on more than DISK_CHAIN_MAX qcow2 layers, it is flattened into one layer
 * over the base (qemu-img convert -B). Images are handled with qemu-img, run without a shell.
 *
 * OS-facing: functions return 0 or a negative errno.
 */
#ifndef KILN_VMM_DISK_H
#define KILN_VMM_DISK_H

#include <stddef.h>
#include <stdint.h>

#define DISK_CHAIN_MAX 4	/* qcow2 layers above the base image */

/*
 * Creates `overlay` (qcow2) backed by `backing` of format `backing_fmt` ("raw" or "qcow2") with a
 * virtual size of `size_bytes`, or the backing's size when 0. A size below the backing's size is
 * -EINVAL. An existing `overlay` is replaced.
 */
int disk_overlay_create(const char *backing, const char *backing_fmt, const char *overlay,
			uint64_t size_bytes);

/*
 * Reads `image`'s virtual size and the number of qcow2 layers in its chain (the image itself
 * included; a raw image has depth 0). Either output may be NULL.
 */
int disk_info(const char *image, uint64_t *virtual_size, unsigned *depth);

/*
 * Makes `image` (a qcow2 chain ending in the raw `base`) a single qcow2 layer over `base`, keeping
 * its content: written to a temporary file, then renamed over `image`.
 */
int disk_flatten(const char *image, const char *base);

/*
 * Copies the regular file `src` to `dst` (created 0600, replaced if present), keeping holes: only
 * the data extents (SEEK_DATA/SEEK_HOLE) are copied, so an image of mostly untouched guest memory
 * costs what was touched. `dst` is fsync()ed.
 */
int disk_file_copy(const char *src, const char *dst);

/* Moves `src` to `dst`: rename(2), or copy and unlink across file systems. */
int disk_file_move(const char *src, const char *dst);

/*
 * Runs `argv` (argv[0] a program name looked up in PATH) without a shell, with stdout and stderr
 * captured into `out` (NUL-terminated, at most outlen - 1 bytes; NULL to discard). Returns 0 when
 * it exits with status 0, -EIO for another status, or a negative errno.
 */
int disk_run(char *const argv[], char *out, size_t outlen);

#endif
