/*
 * http.h - the HTTP engine of kiln-gateway (and kiln-node's API), over libmicrohttpd.
 *
 * It knows routes, bodies, status codes and the error model of docs/errors.md; it knows nothing of
 * tenants or VMs. A server has a route table; each request gets an id (X-Request-Id on every
 * response), its body read under a cap, its path parameters extracted, then an optional `before`
 * hook (authentication, rate limits) and the route's handler. Handlers answer with exactly one of
 * the http_reply_* calls. Requests by route and status and a latency histogram are kept for
 * /metrics.
 */
#ifndef KILN_HTTP_H
#define KILN_HTTP_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

#include "common/buf.h"
#include "common/err.h"

#define HTTP_MAX_PARAMS 4
#define HTTP_PARAM_MAX 128	/* bytes of one path parameter, terminator included */

struct http_req;
struct http_server;

typedef void (*http_handler)(struct http_req *req);

/*
 * A streamed body's sink: called with each chunk as it arrives (after `before` accepted the
 * request) and once with len 0 at the end. Returns 0 to go on or a kiln_err to stop; the handler
 * still runs and should reply with the error it finds in http_req_stream_error().
 */
typedef enum kiln_err (*http_body_sink)(struct http_req *req, const char *data, size_t len);

enum http_body_mode {
	HTTP_BODY_BUFFER = 0,	/* read whole, at most the server's body cap */
	HTTP_BODY_STREAM,	/* passed to `sink` chunk by chunk, at most `stream_max` bytes */
};

struct http_route {
	const char *method;	/* "GET", "POST", ...; "*" any */
	const char *pattern;	/* "/v1/sandboxes/{id}/exec": {name} matches one segment; "*" any path */
	http_handler handler;
	unsigned scope;		/* passed to the before hook; 0 = public */
	enum http_body_mode body_mode;
	http_body_sink sink;	/* HTTP_BODY_STREAM only */
	size_t stream_max;	/* HTTP_BODY_STREAM only, bytes */
};

/*
 * Called before the handler (and before a streamed body is accepted). Returns true to go on;
 * false after it has replied (401, 403, 429...).
 */
typedef bool (*http_before_hook)(struct http_req *req, const struct http_route *route);

/*
 * Called as the reply is queued, on the request's thread, before the client can have it (an
 * audit record written here is there when the client reads the reply). Only for requests whose
 * before hook ran; a streamed reply is reported when its status and headers go out.
 */
typedef void (*http_reply_hook)(struct http_req *req, const struct http_route *route, int status);

/* Called when a request is finished, after its reply was queued (idempotency records, cleanup). */
typedef void (*http_done_hook)(struct http_req *req, const struct http_route *route, int status);

struct http_server_opts {
	const char *listen;		/* "host:port"; or NULL with unix_path */
	const char *unix_path;		/* listen on a Unix socket instead (kiln-node) */
	unsigned max_connections;
	size_t body_max;		/* bytes of a buffered body */
	unsigned timeout_s;
	const struct http_route *routes;
	size_t nroutes;
	http_before_hook before;
	http_reply_hook reply;
	http_done_hook done;
	void *app;			/* handed to handlers via http_req_app() */
	bool trust_request_id;		/* take a caller's X-Request-Id (kiln-node: the gateway's) */
	/*
	 * Errors as `{"code": <HTTP status>, "message": ...}` (E2B's shape, api/e2b.c) instead of
	 * docs/errors.md's, for every http_reply_error of this server, the engine's own included.
	 */
	bool flat_errors;
	/*
	 * Limits against hostile clients (0 = off). Only on a TCP listener, whose sockets the engine
	 * accepts itself before handing them to libmicrohttpd.
	 */
	unsigned max_per_addr;		/* concurrent connections per client address; over: 429 */
	unsigned header_timeout_s;	/* a request's headers must be in within this (keep-alive:
					 * counted from the previous reply) or the connection closes */
	unsigned body_min_rate;		/* bytes/s: a body may take header_timeout_s + len/rate
					 * seconds, else 408 and the connection closes */
	/*
	 * Comma-separated addresses or CIDRs (IPv4, IPv6) of proxies whose PROXY protocol header
	 * (v1 or v2, detected) or X-Forwarded-For names the client. NULL: none; a PROXY header from
	 * anyone else is answered 400 as a malformed request and XFF is ignored.
	 */
	const char *trusted_proxies;
};

/*
 * Starts serving. NULL with `err` set when the address cannot be bound or trusted_proxies does
 * not parse.
 */
struct http_server *http_server_start(const struct http_server_opts *opts, struct kiln_error *err);

/* The port actually bound (useful with port 0). */
unsigned http_server_port(const struct http_server *s);

/*
 * Stops accepting, lets in-flight requests finish for at most `grace_s` seconds, then stops and
 * frees the server. Accepts NULL.
 */
void http_server_stop(struct http_server *s, unsigned grace_s);

/* Appends the engine's Prometheus metrics (requests, latency histogram) to `out`. */
void http_server_metrics(struct http_server *s, struct buf *out);

/* --- inside a handler --- */
void *http_req_app(const struct http_req *req);
const char *http_req_method(const struct http_req *req);
const char *http_req_path(const struct http_req *req);
const char *http_req_id(const struct http_req *req);
/*
 * The client's address as text: the socket's peer, or the one a trusted proxy carried (PROXY
 * header or X-Forwarded-For). The address per-address limits count and logs show. "" on a Unix
 * socket.
 */
const char *http_req_client(const struct http_req *req);
/* The path parameter `name` of the route ({id}), or NULL. */
const char *http_req_param(const struct http_req *req, const char *name);

/* A TCP port given as a route parameter or query value: 1..65535 in digits only; -1 otherwise. */
long http_port_value(const char *s);
/* A request header or query argument, or NULL. */
const char *http_req_header(const struct http_req *req, const char *name);
const char *http_req_query(const struct http_req *req, const char *name);
/*
 * The request's query, its arguments percent-encoded again and joined by '&' (a form a proxy can
 * pass on), malloc'd; "" when it has none, NULL when out of memory.
 */
char *http_req_query_string(const struct http_req *req);
/* The buffered body (NUL-terminated) and its length. */
const char *http_req_body(const struct http_req *req, size_t *len);
/* What stopped a streamed body (KILN_OK when it was complete). */
enum kiln_err http_req_stream_error(const struct http_req *req, struct kiln_error *err);
/* Per-request slot for the before hook and handlers (e.g. the authenticated principal). */
void http_req_set_ctx(struct http_req *req, void *ctx, void (*free_ctx)(void *));
void *http_req_ctx(const struct http_req *req);
/* A second slot, for the route's handler and body sink (the first belongs to the before hook). */
void http_req_set_hctx(struct http_req *req, void *ctx, void (*free_ctx)(void *));
void *http_req_hctx(const struct http_req *req);
/* The object id the request acted on, recorded for the reply hook (audit). Copied. */
void http_req_set_object(struct http_req *req, const char *object_id);
const char *http_req_object(const struct http_req *req);

/*
 * Asks the engine to keep a copy of the reply's body (not of streamed replies) for the done hook,
 * e.g. to store it for Idempotency-Key replays.
 */
void http_req_keep_reply(struct http_req *req);
/* The kept reply body and its length, or NULL. Owned by the request. */
const char *http_req_reply_body(const struct http_req *req, size_t *len);

/* --- replies: exactly one per request --- */
/* Adds a header to the coming reply (e.g. Retry-After). Copied. */
void http_reply_header(struct http_req *req, const char *name, const char *value);
/* Sends `body` as application/json; steals the reference. */
void http_reply_json(struct http_req *req, int status, json_t *body);
/* Sends raw bytes (copied). */
void http_reply_data(struct http_req *req, int status, const char *content_type, const void *data,
		     size_t len);
/* Sends an empty body (204 and the like). */
void http_reply_empty(struct http_req *req, int status);
/* Sends the error model of docs/errors.md for `code`; the message must hold no internals. */
void http_reply_error(struct http_req *req, enum kiln_err code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/*
 * Streams a body produced by `read_cb`, called from the server's thread with a buffer to fill:
 * returns bytes written, 0 to wait (it will be called again), -1 at the end, -2 on error.
 * `free_cb` runs once when the response is done. Content-Length unknown (chunked).
 */
typedef ssize_t (*http_stream_cb)(void *cls, char *buf, size_t max);
void http_reply_stream(struct http_req *req, int status, const char *content_type,
		       http_stream_cb read_cb, void *cls, void (*free_cb)(void *));

/*
 * Switches the connection to another protocol: replies 101 with `Upgrade: protocol`, then runs
 * `run(cls, fd, extra, extra_len)` on a thread of its own with the connection's socket and the
 * bytes the client sent after the request already read (`extra`); the engine closes the socket
 * when `run` returns. If the reply cannot be made, `run` is called with fd -1 at once (to free
 * `cls`) and the client gets an error. The request must have asked for the upgrade (a client
 * sending `Connection: Upgrade`).
 */
typedef void (*http_upgrade_cb)(void *cls, int fd, const char *extra, size_t extra_len);
void http_reply_upgrade(struct http_req *req, const char *protocol, http_upgrade_cb run, void *cls);

/* The HTTP status API replies give `code`: kiln_err_status(), the error table's column. */
int http_status_of(enum kiln_err code);

#endif
