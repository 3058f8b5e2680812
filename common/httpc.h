/*
 * httpc.h - the project's HTTP client setup over libcurl: an easy handle with no signals and the
 * caller's timeouts, an answer body capped by its `struct buf`, and failures as kiln errors.
 * Used by the small request/answer clients (node JWKS fetch, meter pauses, the CLI, Firecracker's
 * API); the streaming clients (common/s3.c, api/nodeclient.c) set up curl themselves.
 */
#ifndef KILN_HTTPC_H
#define KILN_HTTPC_H

#include <curl/curl.h>
#include <stdbool.h>

#include "common/buf.h"
#include "common/err.h"

struct httpc_opts {
	const char *url;
	const char *unix_socket;	/* connect through this socket (NULL: to the URL's host) */
	long timeout_ms;		/* the whole exchange; 0: no limit */
	long connect_timeout_ms;	/* 0: libcurl's default */
	struct buf *body;		/* receives the answer's body up to its cap; NULL: dropped */
};

struct httpc {
	CURL *curl;
	struct buf *body;
	bool over;			/* the body passed its buffer's cap: the exchange was cut */
	char errbuf[CURL_ERROR_SIZE];	/* libcurl's detailed text of the last failure, or "" */
};

/*
 * Makes the handle (initialising libcurl once per process if its main did not). KILN_OK, or
 * KILN_E_NOMEM with `err` set.
 */
enum kiln_err httpc_init(struct httpc *h, struct kiln_error *err);

/*
 * Resets the handle (a connection it holds stays open for reuse) and sets it up for one exchange
 * by `o`: GET of o->url unless the caller sets more options afterwards with curl_easy_setopt.
 */
void httpc_setup(struct httpc *h, const struct httpc_opts *o);

/* httpc_init then httpc_setup. */
enum kiln_err httpc_open(struct httpc *h, const struct httpc_opts *o, struct kiln_error *err);

/*
 * Performs the exchange. KILN_OK with *status the HTTP status (whatever it is) once an answer
 * came; else *status is 0 and `err` says why with libcurl's short text: KILN_E_TOO_LARGE when the
 * body passed its cap (h->over), KILN_E_NOMEM, or KILN_E_UNAVAILABLE for the other failures
 * (no connection, a timeout...).
 */
enum kiln_err httpc_perform(struct httpc *h, long *status, struct kiln_error *err);

/* Frees the handle; `h` may be zeroed or already closed. */
void httpc_close(struct httpc *h);

#endif
