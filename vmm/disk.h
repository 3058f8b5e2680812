/*
 * disk.h - a VM's disk: a qcow2 copy-on-write layer over a shared, read-only base image.
 *
 * A cold-booted VM gets an overlay over the base root filesystem (raw ext4), sized to the shape's
 * disk size (the guest's file system keeps the base size until it is grown inside the guest). At a
 * snapshot the VM's overlay is frozen into the snapshot and every VM restored from it gets a new,
 * empty overlay on top, so a fork costs only what each child changes. Chains are kept short: when a
 * frozen overlay would sit on more than DISK_CHAIN_MAX qcow2 layers, it is flattened into one layer
 * over the base (a copy of the top layer rebased onto the base in safe mode, so what the middle
 * layers hold is kept). Images are handled with qemu-img, run without a shell.
 *
 * An overlay's virtual size is a hard bound on the guest (writes past it are ENOSPC in the
 * guest), and on the host: with 64 KiB clusters, no compression, no internal snapshots and no
 * preallocation, a layer of virtual size V takes at most V of data, an 8-byte L2 entry and a
 * 2-byte refcount per cluster (V/6554) and a few MiB of header and tables: V + V/6554 + 4 MiB
 * (docs/sandboxes.md, "Disk").
 *
 * OS-facing: functions return 0 or a negative errno.
 */
#ifndef KILN_VMM_DISK_H
#define KILN_VMM_DISK_H

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define DISK_CHAIN_MAX 4	/* qcow2 layers above the base image */

/*
 * Inside the VMM's jail a chain is seen under fixed names: "base" (the raw image), "layer1" ..
 * "layerN" (frozen qcow2 layers, layer1 directly over base) and "disk" (the VM's own top layer).
 * Each layer records its backing by that name, relative, so the chain resolves in any directory
 * holding those names: the jail root, or a directory of symlinks (disk_flatten).
 */

/* Writes the jail name of the layer at `depth` (0 = "base") into out (>= 16 bytes). */
void disk_layer_name(unsigned depth, char *out, size_t outlen);

/*
 * Creates `overlay` (qcow2) over the chain element at `depth` whose file on the host is
 * `backing_host` (raw at depth 0, qcow2 above), with a virtual size of `size_bytes`, or the
 * backing's size when 0. A size below the backing's size is -EINVAL. An existing `overlay` is
 * replaced. The first overlay of each depth and size is qemu-img's; the process keeps its bytes
 * and writes the next ones of that depth and size itself (an empty layer names no path and no
 * time: the same bytes).
 */
int disk_overlay_create(const char *backing_host, unsigned depth, const char *overlay,
			uint64_t size_bytes);

/* Reads `image`'s virtual size (without opening its backing chain): a qcow2 image's from its
 * header, any other regular file's as a raw image's (its length). */
int disk_info(const char *image, uint64_t *virtual_size);

/*
 * Rewrites `top`, the layer over chain[0..n-1] (host paths: chain[0] the raw base, chain[k] the
 * layer at depth k), as a single qcow2 layer directly over the base with the same content; `tmp_dir`
 * (created and removed here) holds the symlinks that resolve the chain's names.
 */
int disk_flatten(const char *top, const char *const *chain, unsigned n, const char *tmp_dir);

/*
 * Copies the regular file `src` to `dst` (created 0600, replaced if present), keeping holes: only
 * the data extents (SEEK_DATA/SEEK_HOLE) are copied, so an image of mostly untouched guest memory
 * costs what was touched. `dst` is fsync()ed.
 */
int disk_file_copy(const char *src, const char *dst);

/*
 * The same copy on a thread of its own: disk_copy_start() creates `dst` at `src`'s length before
 * it returns (so the file can be opened and mapped at once) and copies the data behind it;
 * disk_copy_wait() waits for the end and gives its result (`dst` removed when it failed). Every
 * started copy is waited for, or dropped, exactly once. A restore starts its VMM while its memory
 * image is copied, and waits before the VMM reads any of it.
 *
 * disk_copy_prepare() makes `dst` the same way but copies nothing yet: the data is copied by
 * disk_copy_wait(), on the caller's thread. A VMM begun ahead maps an empty file of the guest's
 * length while it waits, and the image is copied in only once it is taken.
 * disk_copy_drop() ends a copy without waiting for its result: a started one is joined, a
 * prepared one never runs; `dst` is left to the caller.
 */
struct disk_copy {
	pthread_t thread;
	int in, out, result;
	off_t size;
	bool started, done, threaded;
	char dst[PATH_MAX];
};

int disk_copy_start(struct disk_copy *c, const char *src, const char *dst);
int disk_copy_prepare(struct disk_copy *c, const char *src, const char *dst);
int disk_copy_wait(struct disk_copy *c);
void disk_copy_drop(struct disk_copy *c);

/* Moves `src` to `dst`: rename(2), or copy and unlink across file systems. */
int disk_file_move(const char *src, const char *dst);

/*
 * Runs `argv` (argv[0] a program name looked up in PATH) without a shell, with stdout and stderr
 * captured into `out` (NUL-terminated, at most outlen - 1 bytes; NULL to discard). Returns 0 when
 * it exits with status 0, -EIO for another status, or a negative errno.
 */
int disk_run(char *const argv[], char *out, size_t outlen);

#endif
