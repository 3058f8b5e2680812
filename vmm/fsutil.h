/*
 * fsutil.h - small file-system helpers the VMM drivers and the node share.
 *
 * OS-facing: fs_mkdir_p returns 0 or a negative errno; fs_err turns such an errno into the
 * project's error with the subject named.
 */
#ifndef KILN_VMM_FSUTIL_H
#define KILN_VMM_FSUTIL_H

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

#endif
