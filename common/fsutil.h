/*
 * fsutil.h - small file-system helpers the VMM drivers and the node share: path formatting,
 * recursive mkdir and removal, fsync, bounded reads of small files.
 *
 * OS-facing: the int functions return 0 (or a length) or a negative errno; fs_err turns such an
 * errno into the project's error with the subject named.
 */
#ifndef KILN_COMMON_FSUTIL_H
#define KILN_COMMON_FSUTIL_H

#include <stdbool.h>
#include <sys/types.h>

#include "common/err.h"

/* Formats into `out` (PATH_MAX bytes); false when the result does not fit. */
bool fs_path(char *out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Creates `dir` and its missing parents (parents 0755, `dir` itself `mode`). 0 or -errno. */
int fs_mkdir_p(const char *dir, mode_t mode);

/*
 * Records "<what> '<subject>': <strerror>" in `err` for the negative errno `neg`: KILN_E_NOMEM
 * for -ENOMEM, KILN_E_IO otherwise. Returns that code.
 */
enum kiln_err fs_err(struct kiln_error *err, int neg, const char *what, const char *subject);

/*
 * Removes the file `path` (or, fs_remove_dir, the empty directory) when `path` is not empty; a
 * missing one is fine. The first failure is recorded in `err` and *rc, later ones are ignored,
 * so a teardown removes all it can and reports what it could not.
 */
void fs_remove(const char *path, struct kiln_error *err, enum kiln_err *rc);
void fs_remove_dir(const char *path, struct kiln_error *err, enum kiln_err *rc);

/*
 * Removes `path` and everything below it: a file or symbolic link is unlinked, a directory
 * emptied depth first and removed. Links are never followed and the walk stays on the file system
 * of `path` (a mount below it is not entered, so its parent cannot be removed). A missing `path`
 * is fine. Stops at the first entry it cannot remove: 0 or that -errno.
 */
int fs_remove_tree(const char *path);

/* fs_remove_tree(), logging a warning that names `path` when it fails (for cleanups that go on). */
void fs_remove_tree_or_warn(const char *path);

/*
 * Unlinks the file `path` on a thread of its own, so that the caller does not wait while the
 * kernel frees a large file's blocks and page cache (some 40 ms for 100 MiB here); on the
 * caller's thread when no thread can be made. A failure is logged unless the file was gone.
 */
void fs_unlink_behind(const char *path);

/* fsync(2) of the file or directory `path` (opened read-only, links followed). 0 or -errno. */
int fs_fsync_path(const char *path);

/* fsync(2) of the directory `dir`; -ENOTDIR when it is not one. 0 or -errno. */
int fs_fsync_dir(const char *dir);

/*
 * Reads the start of the small file `path` into `out`: at most `cap` - 1 bytes (the rest of a
 * longer file is not read), NUL-terminated. A final symbolic link is refused (-ELOOP). Returns the
 * number of bytes read, or -errno (-EINVAL for `cap` 0).
 */
ssize_t fs_read_small(const char *path, char *out, size_t cap);

#endif
