/*
 * qmp.h - a client for QEMU's machine protocol (QMP) over a Unix stream socket.
 *
 * QMP is newline-delimited JSON: a greeting ({"QMP": ...}), then, after the client sends
 * qmp_capabilities, one response ({"return": ...} or {"error": ...}) per command, interleaved with
 * asynchronous events ({"event": ...}). The peer's bytes are semi-trusted: each message is capped at
 * QMP_MSG_MAX bytes, events are kept in a bounded queue, and every wait has a deadline.
 *
 * Internal to vmm/: json_t does not leave this module's callers in vmm/.
 * Functions return 0 or a negative errno:
 *   -ETIMEDOUT    no (complete) answer before the deadline
 *   -ECONNRESET   the peer closed the socket (QEMU exited)
 *   -EPROTO       the peer sent something that is not a QMP message
 *   -E2BIG        a message longer than QMP_MSG_MAX
 *   -EREMOTEIO    QEMU answered the command with an error (the message says which)
 */
#ifndef KILN_VMM_QMP_H
#define KILN_VMM_QMP_H

#include <jansson.h>
#include <stddef.h>

#define QMP_MSG_MAX (1024 * 1024)	/* bytes in one message, newline included */
#define QMP_EVENTS_MAX 64		/* queued events; the oldest are dropped beyond */
#define QMP_ERRMSG_MAX 256

struct qmp;

/*
 * Connects to the QMP socket at `path`, retrying until it accepts or `timeout_ms` passes (QEMU
 * creates the socket shortly after it starts), reads the greeting and negotiates capabilities.
 * On success *out is a client the caller frees with qmp_close().
 */
int qmp_connect(const char *path, int timeout_ms, struct qmp **out);

/* As qmp_connect on an already connected stream socket; takes ownership of `fd` in every case. */
int qmp_open_fd(int fd, int timeout_ms, struct qmp **out);

/* Closes the socket and frees queued events. Accepts NULL. */
void qmp_close(struct qmp *q);

/*
 * Runs command `cmd` with `args` (borrowed; NULL for none) and waits up to `timeout_ms` for its
 * response, queueing events that arrive meanwhile. When `fd` >= 0 it travels with the command as
 * SCM_RIGHTS ancillary data (QEMU's getfd and add-fd read it from there). On success, when `ret` is
 * not NULL, *ret is a new reference to the "return" value the caller json_decref()s. On -EREMOTEIO
 * and -EPROTO, `errmsg` (if not NULL) holds "Class: description".
 */
int qmp_execute(struct qmp *q, const char *cmd, json_t *args, int fd, int timeout_ms, json_t **ret,
		char errmsg[QMP_ERRMSG_MAX]);

/* Hands `fd` to QEMU under `name` (QMP getfd), e.g. for `migrate fd:NAME`. The caller keeps `fd`. */
int qmp_getfd(struct qmp *q, const char *name, int fd, int timeout_ms, char errmsg[QMP_ERRMSG_MAX]);

/*
 * Waits for an event named `name` (queued or new) for up to `timeout_ms`, removing it and the
 * events queued before it. When `data` is not NULL, *data is a new reference to its "data" member
 * (or NULL if it had none).
 */
int qmp_wait_event(struct qmp *q, const char *name, int timeout_ms, json_t **data);

/* QEMU's version from the greeting, "major.minor.micro"; "" before the greeting. */
const char *qmp_version(const struct qmp *q);

#endif
