/*
 * pump.h - a producer thread feeding a streamed HTTP reply through a pipe.
 *
 * A handler that streams (exec output as server-sent events, a file read from a guest, a reply
 * proxied from a node) starts a pump: `produce` runs on its own thread, announces the status and
 * content type with pump_ready(), then writes the body with pump_write(). The handler waits for
 * pump_wait_ready() and, unless it answers with an error instead, hands the pump to
 * http_reply_stream(req, status, type, pump_read, pump, pump_release). A client that goes away
 * makes pump_write() fail, so the producer can stop early. Writes block while the client is slow:
 * between producer and client nothing is buffered but the pipe (its capacity, 64 KiB by default),
 * so a streamed reply's memory is bounded by what the producer holds per write.
 */
#ifndef KILN_PUMP_H
#define KILN_PUMP_H

#include <stddef.h>
#include <sys/types.h>

struct pump;

typedef void (*pump_fn)(struct pump *p, void *ctx);

/*
 * Starts `produce(p, ctx)` on a new thread. `free_ctx` (may be NULL) runs on `ctx` after both
 * sides are done. Returns NULL when out of memory or threads (free_ctx has then run).
 */
struct pump *pump_start(pump_fn produce, void *ctx, void (*free_ctx)(void *));

/* Producer: the reply's status and content type; call once, before any pump_write(). */
void pump_ready(struct pump *p, int status, const char *content_type);

/*
 * Producer, before pump_ready(): a Retry-After value the handler's reply carries on (a node's 429
 * or 503 passed through the gateway). At most 15 characters are kept.
 */
void pump_set_retry_after(struct pump *p, const char *value);

/* Handler, after pump_wait_ready(): that value, or "" (valid until pump_release()). */
const char *pump_retry_after(struct pump *p);

/* Producer: writes all of `data`. Returns 0, or -1 when the reader is gone (stop producing). */
int pump_write(struct pump *p, const void *data, size_t len);

/*
 * Handler: waits until the producer called pump_ready() (or ended without it: status 0).
 * Returns the status; the content type is copied into `type` (at least 128 bytes).
 */
int pump_wait_ready(struct pump *p, char *type, size_t type_len);

/* For http_reply_stream(): reads what the producer wrote; -1 at the end. */
ssize_t pump_read(void *cls, char *buf, size_t max);

/* Drops the handler's side (as http_reply_stream's free callback, or when not streaming). */
void pump_release(void *cls);

#endif
