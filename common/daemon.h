/*
 * daemon.h - how every Kiln daemon starts and stops: an explicit table of stages, started in
 * order and stopped in reverse, until SIGTERM or SIGINT (SIGPIPE ignored).
 */
#ifndef KILN_DAEMON_H
#define KILN_DAEMON_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

struct daemon_stage {
	const char *name;
	int (*init)(struct kiln_error *err);	/* KILN_OK, or a code with `err` set */
	void (*exit)(void);			/* undoes init; runs only for stages that started */
};

/*
 * Starts the stages; once all are up, waits for SIGTERM or SIGINT; then stops the started ones in
 * reverse order. Returns the process's exit status: 0 after a clean stop, 1 when a stage failed
 * (logged with the stage's name and the error).
 */
int daemon_run(const struct daemon_stage *stages, size_t n);

/*
 * As daemon_run, but once all stages are up runs `main_loop` on the calling thread instead of
 * waiting idle; `main_loop` returns when daemon_stopping() turns true (a blocking call in it
 * returns EINTR on the signal). The stages are stopped after it returns.
 */
int daemon_run_loop(const struct daemon_stage *stages, size_t n, void (*main_loop)(void));

/* Whether SIGTERM or SIGINT has arrived since daemon_run or daemon_run_loop began. */
bool daemon_stopping(void);

#endif
