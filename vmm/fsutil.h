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

#endif
