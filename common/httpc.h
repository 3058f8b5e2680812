/*
 * httpc.h - the project's one HTTP client setup over libcurl: an easy handle with no signals and
 * the caller's timeouts, an answer body capped by its `struct buf` or streamed to the caller's
 * callbacks, a request body from memory or streamed, headers, and for connections to addresses a
 * tenant chose, pinned addresses (CURLOPT_RESOLVE) and a check of every socket before it
 * connects. Failures are kiln errors. Every HTTP client of the project uses it: the node's JWKS
 * fetch, the meter's and the suspension's pauses, the CLI, Firecracker's API, the S3 client
 * (common/s3.c) and the gateway's calls to its nodes (api/nodeclient.c).
 */
#ifndef KILN_HTTPC_H
#define KILN_HTTPC_H

#include <curl/curl.h>
#include <stdbool.h>

#include "common/buf.h"
#include "common/err.h"

/* libcurl's data callbacks: the answer's body or header lines, or the request's body. */
typedef size_t (*httpc_data_fn)(char *p, size_t size, size_t n, void *arg);

struct httpc_opts {
	const char *url;
	const char *unix_socket;	/* connect through this socket (NULL: to the URL's host) */
	long timeout_ms;		/* the whole exchange; 0: no limit */
	long connect_timeout_ms;	/* 0: libcurl's default */
	struct buf *body;		/* receives the answer's body up to its cap; NULL: dropped */

	/* Everything below is optional (zero: not used). */

	/*
	 * The method. NULL or "GET": a GET; "HEAD": no body is asked for; "POST" with post_data:
	 * that body (CURLOPT_POSTFIELDS); "PUT" with on_read: an upload; any other (or POST or PUT
	 * without those bodies, or another verb with on_read): sent as given (CURLOPT_CUSTOMREQUEST).
	 */
	const char *method;
	const char *post_data;		/* with "POST": the body, post_len bytes (not copied) */
	size_t post_len;
	httpc_data_fn on_read;		/* a streamed request body (CURLOPT_UPLOAD), read_arg */
	void *read_arg;
	curl_seek_callback on_seek;	/* with on_read: rewinds the body for a retry; NULL: cannot */
	long long upload_len;		/* with on_read: the body's length; < 0: unknown */
	struct curl_slist *headers;	/* request headers; the caller frees them after the exchange */
	httpc_data_fn on_write;		/* the answer's body goes here (write_arg) instead of `body` */
	void *write_arg;
	httpc_data_fn on_header;	/* each header line of the answer, header_arg */
	void *header_arg;
	/* a body transfer: it fails below low_speed_bytes per second for low_speed_s seconds */
	long low_speed_bytes, low_speed_s;
	/* credentials: AWS Signature V4 ("aws:amz:<region>:s3") with username and password */
	const char *aws_sigv4;
	const char *username, *password;

	/*
	 * Where it may connect, for a URL a tenant chose (SSRF): `strict` allows http and https
	 * only, follows no redirect and uses no proxy from the environment; `resolve` pins the
	 * host's addresses (CURLOPT_RESOLVE "host:port:addr,..."), and `open_socket` (with
	 * open_socket_arg) makes every socket, so it can refuse an address before it connects.
	 */
	bool strict;
	struct curl_slist *resolve;
	curl_opensocket_callback open_socket;
	void *open_socket_arg;
};

struct httpc {
	CURL *curl;
	struct buf *body;
	bool over;			/* the body passed its buffer's cap: the exchange was cut */
	CURLcode result;		/* libcurl's result of the last httpc_perform */
	char errbuf[CURL_ERROR_SIZE];	/* libcurl's detailed text of the last failure, or "" */
};

/*
 * Makes the handle (initialising libcurl once per process if its main did not). KILN_OK, or
 * KILN_E_NOMEM with `err` set.
 */
enum kiln_err httpc_init(struct httpc *h, struct kiln_error *err);

/*
 * Resets the handle (a connection it holds stays open for reuse) and sets it up for one exchange
 * by `o` (the callers may still set more options afterwards with curl_easy_setopt). Everything
 * `o` points to must live until the exchange ends.
 */
void httpc_setup(struct httpc *h, const struct httpc_opts *o);

/* httpc_init then httpc_setup. */
enum kiln_err httpc_open(struct httpc *h, const struct httpc_opts *o, struct kiln_error *err);

/*
 * Performs the exchange. KILN_OK with *status the HTTP status (whatever it is) once an answer
 * came; else *status is 0 and `err` says why with libcurl's short text: KILN_E_TOO_LARGE when the body passed its cap (h->over),
 * KILN_E_NOMEM, or KILN_E_UNAVAILABLE for the other failures (no connection, a timeout, a
 * callback that aborted...). h->result keeps libcurl's own result, and CURLINFO_RESPONSE_CODE
 * the status of an answer that began.
 */
enum kiln_err httpc_perform(struct httpc *h, long *status, struct kiln_error *err);

/* Frees the handle; `h` may be zeroed or already closed. */
void httpc_close(struct httpc *h);

#endif
