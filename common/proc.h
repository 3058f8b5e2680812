/*
 * proc.h - running a helper program (ip, qemu-img...) to completion and keeping what it printed:
 * the one spawn-and-capture of the project.
 */
#ifndef KILN_PROC_H
#define KILN_PROC_H

#include <stddef.h>

/* Which of the child's streams go into the capture; the others go to /dev/null. */
#define PROC_STDOUT 1u
#define PROC_STDERR 2u

/*
 * Runs argv[0] (looked up in PATH) with `argv`, stdin from /dev/null, and waits for it. What it
 * writes to the streams named in `capture` goes into `out`, NUL-terminated, at most `outlen` - 1
 * bytes (the rest is read and dropped, so the child never blocks on a full pipe); `out` may be
 * NULL (then everything is dropped). *exit_status is the exit code, 128 + the signal number
 * when a signal ended the child, or -1 when it did not run. Returns 0 once the child ran and ended (whatever its status),
 * or -errno when it could not be started or waited for (-ENOENT: no such program).
 */
int proc_run(const char *const argv[], unsigned capture, char *out, size_t outlen,
	     int *exit_status);

#endif
