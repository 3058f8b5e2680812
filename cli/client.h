/*
 * client.h - the kiln CLI's HTTP client: one call to the Kiln API over libcurl, with the API key
 * as a bearer credential, and the API's error model turned into a message.
 *
 * A call returns the HTTP status (0 when no answer came: `err` says why). Bodies received are
 * capped (CLIENT_BODY_MAX); a streamed exec hands each server-sent event to a callback instead.
 */
#ifndef KILN_CLI_CLIENT_H
#define KILN_CLI_CLIENT_H

#include <stdio.h>

#include "common/buf.h"

#define CLIENT_BODY_MAX (128u << 20)	/* bytes of a reply body kept (files are ≤ 100 MiB) */

struct client {
	const char *url;	/* "http://127.0.0.1:8080", no trailing slash */
	const char *key;	/* API key or token */
	char err[256];		/* why the last call got no answer */
};

/* What to send: a JSON text, the bytes of a file, or nothing. */
struct client_body {
	const char *json;	/* or NULL */
	FILE *file;		/* or NULL: sent as application/octet-stream, `file_size` bytes */
	long long file_size;
};

/*
 * Calls METHOD `path` (query included) and keeps the reply body in `out` (initialised by the
 * caller with buf_init). Returns the HTTP status, or 0 with c->err set.
 */
int client_call(struct client *c, const char *method, const char *path, const struct client_body *body,
		struct buf *out);

/* Called for each server-sent event: `event` its name, `data` its data line(s). */
typedef void (*client_event_fn)(void *ctx, const char *event, const char *data);

/*
 * POSTs the JSON `json` to `path` (GETs it when `json` is NULL) asking for text/event-stream and
 * hands each event to `fn` as it comes. An answer that is not a stream (an error) is kept in `out`. Returns the status or 0.
 */
int client_stream(struct client *c, const char *path, const char *json, client_event_fn fn, void *ctx,
		  struct buf *out);

/*
 * The message of an API error body ("message (code)"), or a description of a body that is not
 * one, into `msg`.
 */
void client_error_text(int status, const struct buf *body, char *msg, size_t len);

#endif
