/*
 * http.c - the HTTP engine over libmicrohttpd (see http.h).
 *
 * One thread per connection (MHD_USE_THREAD_PER_CONNECTION), capped by max_connections: handlers
 * may block on Postgres or on a VM for as long as an exec runs without stalling other clients.
 */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/json.h"
#include "common/log.h"

/* Statuses counted per route in /metrics; anything else counts as "other". */
static const int metric_statuses[] = { 200, 201, 204, 400, 401, 402, 403, 404, 409,
				       413, 422, 429, 500, 501, 502, 503 };
#define NSTATUS (sizeof(metric_statuses) / sizeof(metric_statuses[0]) + 1)
/* Latency histogram bucket bounds, seconds. */
static const double metric_buckets[] = { 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
					 0.1,	0.25,	0.5,   1,    2.5,   10 };
#define NBUCKET (sizeof(metric_buckets) / sizeof(metric_buckets[0]) + 1)

struct route_metrics {
	atomic_ullong by_status[NSTATUS];
	atomic_ullong buckets[NBUCKET];	/* not cumulative; summed when printed */
	atomic_ullong sum_us;
};

struct http_server {
	struct MHD_Daemon *mhd;
	struct http_server_opts opts;
	struct route_metrics *metrics;	/* nroutes + 1: the last is "unmatched" */
	atomic_int in_flight;
	unsigned port;
	int unix_fd;
};

struct header {
	char *name, *value;
	struct header *next;
};

struct http_req {
	struct http_server *srv;
	struct MHD_Connection *conn;
	const struct http_route *route;
	int route_idx;
	char method[16];
	char *path;
	char id[24];
	char param_names[HTTP_MAX_PARAMS][32];
	char params[HTTP_MAX_PARAMS][HTTP_PARAM_MAX];
	int nparams;
	struct buf body;
	bool started;		/* before hook ran and accepted */
	bool before_ran;	/* before hook ran (the done hook then runs too) */
	bool replied;
	bool stream_done;
	bool too_large;		/* a buffered body passed the cap: discard the rest, then 413 */
	size_t discarded;	/* bytes of such a body thrown away */
	struct kiln_error stream_err;
	int status;
	struct header *headers;	/* for the reply */
	struct timespec t0;
	void *ctx;
	void (*free_ctx)(void *);
	void *hctx;
	void (*free_hctx)(void *);
	char *object_id;
	bool keep_reply;
	char *reply_copy;	/* when keep_reply */
	size_t reply_len;
};

/* ---- small helpers ---- */

int http_status_of(enum kiln_err code)
{
	return kiln_err_status(code);
}

static double elapsed_s(const struct timespec *t0)
{
	struct timespec t1;

	clock_gettime(CLOCK_MONOTONIC, &t1);
	return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) / 1e9;
}

static void new_request_id(char out[24])
{
	static const char hex[] = "0123456789abcdef";
	unsigned char rnd[8] = { 0 };

	if (getrandom(rnd, sizeof(rnd), 0) != sizeof(rnd)) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		memcpy(rnd, &ts.tv_nsec, sizeof(rnd) < sizeof(ts.tv_nsec) ? sizeof(rnd) : 8);
	}
	memcpy(out, "req_", 4);
	for (int i = 0; i < 8; i++) {
		out[4 + 2 * i] = hex[rnd[i] >> 4];
		out[5 + 2 * i] = hex[rnd[i] & 15];
	}
	out[20] = '\0';
}

/*
 * Matches `path` against `pattern`, filling the request's parameters. Segments are compared
 * exactly; {name} takes one non-empty segment of at most HTTP_PARAM_MAX - 1 bytes.
 */
static bool route_match(const char *pattern, const char *path, struct http_req *req)
{
	const char *p = pattern, *s = path;

	req->nparams = 0;
	while (*p && *s) {
		if (*p == '{') {
			const char *pe = strchr(p, '}');
			size_t n = strcspn(s, "/");

			if (!pe || n == 0 || n >= HTTP_PARAM_MAX || req->nparams == HTTP_MAX_PARAMS)
				return false;
			snprintf(req->param_names[req->nparams], sizeof(req->param_names[0]), "%.*s",
				 (int)(pe - p - 1), p + 1);
			memcpy(req->params[req->nparams], s, n);
			req->params[req->nparams][n] = '\0';
			req->nparams++;
			p = pe + 1;
			s += n;
			continue;
		}
		if (*p != *s)
			return false;
		p++;
		s++;
	}
	return !*p && !*s;
}

/* Finds the route for the request; sets *method_mismatch when only the method differs. */
static const struct http_route *route_find(struct http_server *srv, struct http_req *req,
					   bool *method_mismatch)
{
	*method_mismatch = false;
	for (size_t i = 0; i < srv->opts.nroutes; i++) {
		const struct http_route *r = &srv->opts.routes[i];

		if (!route_match(r->pattern, req->path, req))
			continue;
		if (strcmp(r->method, req->method) != 0) {
			*method_mismatch = true;
			continue;
		}
		req->route_idx = (int)i;
		return r;
	}
	req->nparams = 0;
	req->route_idx = (int)srv->opts.nroutes;
	return NULL;
}

/* ---- replies ---- */

static void reply_queue(struct http_req *req, int status, struct MHD_Response *resp)
{
	if (req->replied) {
		log_error("second reply to one request ignored");
		MHD_destroy_response(resp);
		return;
	}
	req->replied = true;
	req->status = status;
	if (req->srv->opts.reply && req->route && req->before_ran)
		req->srv->opts.reply(req, req->route, status);
	MHD_add_response_header(resp, "X-Request-Id", req->id);
	for (struct header *h = req->headers; h; h = h->next)
		MHD_add_response_header(resp, h->name, h->value);
	if (MHD_queue_response(req->conn, (unsigned)status, resp) != MHD_YES)
		log_warn("could not queue a %d reply", status);
	MHD_destroy_response(resp);
}

void http_reply_header(struct http_req *req, const char *name, const char *value)
{
	struct header *h = calloc(1, sizeof(*h));

	if (!h)
		return;
	h->name = strdup(name);
	h->value = strdup(value);
	if (!h->name || !h->value) {
		free(h->name);
		free(h->value);
		free(h);
		return;
	}
	h->next = req->headers;
	req->headers = h;
}

void http_req_keep_reply(struct http_req *req)
{
	req->keep_reply = true;
}

const char *http_req_reply_body(const struct http_req *req, size_t *len)
{
	if (len)
		*len = req->reply_len;
	return req->reply_copy;
}

void http_reply_data(struct http_req *req, int status, const char *content_type, const void *data,
		     size_t len)
{
	struct MHD_Response *resp;

	if (req->keep_reply && !req->replied && !req->reply_copy) {
		req->reply_copy = malloc(len + 1);
		if (req->reply_copy) {
			memcpy(req->reply_copy, data, len);
			req->reply_copy[len] = '\0';
			req->reply_len = len;
		}
	}
	resp =
		MHD_create_response_from_buffer(len, (void *)data, MHD_RESPMEM_MUST_COPY);

	if (!resp)
		return;
	if (content_type)
		MHD_add_response_header(resp, "Content-Type", content_type);
	reply_queue(req, status, resp);
}

void http_reply_empty(struct http_req *req, int status)
{
	http_reply_data(req, status, NULL, "", 0);
}

void http_reply_json(struct http_req *req, int status, json_t *body)
{
	char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;

	json_decref(body);
	if (!text) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	http_reply_data(req, status, "application/json", text, strlen(text));
	free(text);
}

void http_reply_error(struct http_req *req, enum kiln_err code, const char *fmt, ...)
{
	char msg[KILN_ERRMSG_MAX];
	json_t *body;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	/* A code whose detail stays in the log shows as "internal" with only the generic text. */
	if (!kiln_err_shown(code))
		snprintf(msg, sizeof(msg), "%s", kiln_strerror(KILN_E_INTERNAL));
	body = json_pack("{s:{s:s, s:s, s:s}}", "error", "code", kiln_err_api_code(code), "message",
			 msg, "request_id", req->id);
	http_reply_json(req, kiln_err_status(code), body);
}

struct stream_ctx {
	http_stream_cb read_cb;
	void *cls;
	void (*free_cb)(void *);
};

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
	struct stream_ctx *sc = cls;
	ssize_t n = sc->read_cb(sc->cls, buf, max);

	if (n == -1)
		return MHD_CONTENT_READER_END_OF_STREAM;
	if (n < -1)
		return MHD_CONTENT_READER_END_WITH_ERROR;
	return n;
}

static void stream_free(void *cls)
{
	struct stream_ctx *sc = cls;

	if (sc->free_cb)
		sc->free_cb(sc->cls);
	free(sc);
}

void http_reply_stream(struct http_req *req, int status, const char *content_type,
		       http_stream_cb read_cb, void *cls, void (*free_cb)(void *))
{
	struct stream_ctx *sc = calloc(1, sizeof(*sc));
	struct MHD_Response *resp;

	if (!sc) {
		if (free_cb)
			free_cb(cls);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	sc->read_cb = read_cb;
	sc->cls = cls;
	sc->free_cb = free_cb;
	resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, stream_reader, sc,
						 stream_free);
	if (!resp) {
		stream_free(sc);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	MHD_add_response_header(resp, "Content-Type", content_type);
	MHD_add_response_header(resp, "Cache-Control", "no-cache");
	reply_queue(req, status, resp);
}

/* ---- accessors ---- */

void *http_req_app(const struct http_req *req) { return req->srv->opts.app; }
const char *http_req_method(const struct http_req *req) { return req->method; }
const char *http_req_path(const struct http_req *req) { return req->path; }
const char *http_req_id(const struct http_req *req) { return req->id; }
void *http_req_ctx(const struct http_req *req) { return req->ctx; }
const char *http_req_object(const struct http_req *req) { return req->object_id; }

const char *http_req_param(const struct http_req *req, const char *name)
{
	for (int i = 0; i < req->nparams; i++)
		if (strcmp(req->param_names[i], name) == 0)
			return req->params[i];
	return NULL;
}

const char *http_req_header(const struct http_req *req, const char *name)
{
	return MHD_lookup_connection_value(req->conn, MHD_HEADER_KIND, name);
}

const char *http_req_query(const struct http_req *req, const char *name)
{
	return MHD_lookup_connection_value(req->conn, MHD_GET_ARGUMENT_KIND, name);
}

const char *http_req_body(const struct http_req *req, size_t *len)
{
	if (len)
		*len = req->body.len;
	return req->body.data ? req->body.data : "";
}

enum kiln_err http_req_stream_error(const struct http_req *req, struct kiln_error *err)
{
	if (req->stream_err.code != KILN_OK)
		kiln_error_set(err, req->stream_err.code, "%s", req->stream_err.msg);
	return req->stream_err.code;
}

void http_req_set_ctx(struct http_req *req, void *ctx, void (*free_ctx)(void *))
{
	if (req->free_ctx && req->ctx)
		req->free_ctx(req->ctx);
	req->ctx = ctx;
	req->free_ctx = free_ctx;
}

void http_req_set_hctx(struct http_req *req, void *ctx, void (*free_ctx)(void *))
{
	if (req->free_hctx && req->hctx)
		req->free_hctx(req->hctx);
	req->hctx = ctx;
	req->free_hctx = free_ctx;
}

void *http_req_hctx(const struct http_req *req)
{
	return req->hctx;
}

void http_req_set_object(struct http_req *req, const char *object_id)
{
	free(req->object_id);
	req->object_id = object_id ? strdup(object_id) : NULL;
}

/* ---- the MHD callbacks ---- */

static void req_free(struct http_req *req)
{
	struct header *h, *next;

	if (req->free_hctx && req->hctx)
		req->free_hctx(req->hctx);
	if (req->free_ctx && req->ctx)
		req->free_ctx(req->ctx);
	for (h = req->headers; h; h = next) {
		next = h->next;
		free(h->name);
		free(h->value);
		free(h);
	}
	buf_release(&req->body);
	free(req->object_id);
	free(req->reply_copy);
	free(req->path);
	free(req);
}

/* Runs the before hook once; returns true when the request may proceed. */
static bool req_start(struct http_req *req)
{
	if (req->started)
		return true;
	req->before_ran = true;
	if (req->srv->opts.before && !req->srv->opts.before(req, req->route))
		return false;
	req->started = true;
	return true;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
				  const char *method, const char *version, const char *upload_data,
				  size_t *upload_size, void **con_cls)
{
	struct http_server *srv = cls;
	struct http_req *req = *con_cls;

	if (!req) {
		bool mismatch;

		req = calloc(1, sizeof(*req));
		if (!req)
			return MHD_NO;
		req->srv = srv;
		req->conn = conn;
		req->path = strdup(url);
		if (!req->path) {
			free(req);
			return MHD_NO;
		}
		snprintf(req->method, sizeof(req->method), "%s", method);
		clock_gettime(CLOCK_MONOTONIC, &req->t0);
		new_request_id(req->id);
		if (srv->opts.trust_request_id) {
			const char *given = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
									"X-Request-Id");
			if (given && strlen(given) == 20 && strncmp(given, "req_", 4) == 0 &&
			    strspn(given + 4, "0123456789abcdef") == 16)
				memcpy(req->id, given, 21);
		}
		atomic_fetch_add(&srv->in_flight, 1);
		*con_cls = req;
		req->route = route_find(srv, req, &mismatch);
		buf_init(&req->body, req->route && req->route->body_mode == HTTP_BODY_STREAM
					     ? req->route->stream_max
					     : srv->opts.body_max);
		if (!req->route) {
			if (mismatch)
				http_reply_error(req, KILN_E_NOT_FOUND, "no %s route for this path",
						 req->method);
			else
				http_reply_error(req, KILN_E_NOT_FOUND, "no such route");
			return MHD_YES;
		}
		/* Streamed bodies are authorised before the first byte is accepted. */
		if (req->route->body_mode == HTTP_BODY_STREAM)
			req_start(req);
		return MHD_YES;
	}
	if (req->replied) {
		*upload_size = 0;	/* discard what is left of a refused body */
		return MHD_YES;
	}

	if (*upload_size) {
		/*
		 * MHD cannot queue a reply while a body is still arriving: a refused body is read
		 * and thrown away, and the reply goes out once it ended. One that goes on far past
		 * its cap is cut off by closing the connection.
		 */
		if (req->route->body_mode == HTTP_BODY_STREAM) {
			if (req->stream_err.code == KILN_OK && req->body.len + *upload_size > req->body.max)
				kiln_error_set(&req->stream_err, KILN_E_TOO_LARGE,
					       "the body is larger than %zu bytes", req->body.max);
			else if (req->stream_err.code == KILN_OK) {
				enum kiln_err rc = req->route->sink(req, upload_data, *upload_size);
				if (rc != KILN_OK)
					kiln_error_set(&req->stream_err, rc, "the upload failed");
			}
			req->body.len += *upload_size;	/* counted, not kept */
			if (req->body.len > 2 * req->body.max)
				return MHD_NO;
		} else if (req->too_large || buf_append(&req->body, upload_data, *upload_size) != 0) {
			req->too_large = true;
			req->discarded += *upload_size;
			if (req->discarded > 16 * req->body.max)
				return MHD_NO;
		}
		*upload_size = 0;
		return MHD_YES;
	}
	if (req->too_large) {
		http_reply_error(req, KILN_E_TOO_LARGE, "the body is larger than %zu bytes",
				 req->body.max);
		return MHD_YES;
	}

	/* The whole request is in. */
	if (req->route->body_mode == HTTP_BODY_STREAM && !req->stream_done &&
	    req->stream_err.code == KILN_OK) {
		enum kiln_err rc = req->route->sink(req, NULL, 0);
		if (rc != KILN_OK)
			kiln_error_set(&req->stream_err, rc, "the upload failed");
	}
	req->stream_done = true;
	if (!req_start(req))
		return MHD_YES;
	log_ctx_set(req->id, NULL, NULL);
	req->route->handler(req);
	if (!req->replied) {
		log_error("handler of \"%s %s\" did not reply", req->route->method,
			  req->route->pattern);
		http_reply_error(req, KILN_E_INTERNAL, "no reply");
	}
	log_ctx_clear();
	return MHD_YES;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
			 enum MHD_RequestTerminationCode toe)
{
	struct http_server *srv = cls;
	struct http_req *req = *con_cls;
	struct route_metrics *m;
	double secs;
	size_t si, bi;

	if (!req)
		return;
	*con_cls = NULL;
	secs = elapsed_s(&req->t0);
	m = &srv->metrics[req->route_idx];
	for (si = 0; si < NSTATUS - 1 && metric_statuses[si] != req->status; si++)
		;
	for (bi = 0; bi < NBUCKET - 1 && secs > metric_buckets[bi]; bi++)
		;
	atomic_fetch_add(&m->by_status[si], 1);
	atomic_fetch_add(&m->buckets[bi], 1);
	atomic_fetch_add(&m->sum_us, (unsigned long long)(secs * 1e6));
	if (srv->opts.done && req->route && req->before_ran)
		srv->opts.done(req, req->route, req->status);
	req_free(req);
	atomic_fetch_sub(&srv->in_flight, 1);
}

/* ---- start and stop ---- */

static int parse_listen(const char *listen, struct sockaddr_in *sa)
{
	char host[64];
	const char *colon = strrchr(listen, ':');
	long port;
	char *end;

	if (!colon || (size_t)(colon - listen) >= sizeof(host))
		return -EINVAL;
	memcpy(host, listen, (size_t)(colon - listen));
	host[colon - listen] = '\0';
	port = strtol(colon + 1, &end, 10);
	if (*end || port < 0 || port > 65535)
		return -EINVAL;
	memset(sa, 0, sizeof(*sa));
	sa->sin_family = AF_INET;
	sa->sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, strcmp(host, "localhost") == 0 ? "127.0.0.1" : host,
		      &sa->sin_addr) != 1)
		return -EINVAL;
	return 0;
}

static int unix_listen(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	strcpy(sa.sun_path, path);
	unlink(path);
	if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) || listen(fd, 128)) {
		int e = -errno;
		close(fd);
		return e;
	}
	return fd;
}

struct http_server *http_server_start(const struct http_server_opts *opts, struct kiln_error *err)
{
	struct http_server *srv = calloc(1, sizeof(*srv));
	struct sockaddr_in sa;
	unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
			 MHD_USE_POLL | MHD_USE_ERROR_LOG;

	if (!srv) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	srv->opts = *opts;
	srv->unix_fd = -1;
	srv->metrics = calloc(opts->nroutes + 1, sizeof(*srv->metrics));
	if (!srv->metrics) {
		free(srv);
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	if (opts->unix_path) {
		srv->unix_fd = unix_listen(opts->unix_path);
		if (srv->unix_fd < 0) {
			kiln_error_set(err, KILN_E_IO, "cannot listen on \"%s\": %s", opts->unix_path,
				       strerror(-srv->unix_fd));
			goto fail;
		}
		srv->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_request, srv,
					    MHD_OPTION_LISTEN_SOCKET, srv->unix_fd,
					    MHD_OPTION_CONNECTION_LIMIT, opts->max_connections,
					    MHD_OPTION_CONNECTION_TIMEOUT, opts->timeout_s,
					    MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
					    MHD_OPTION_END);
	} else {
		if (parse_listen(opts->listen, &sa)) {
			kiln_error_set(err, KILN_E_INVALID, "bad listen address \"%s\"", opts->listen);
			goto fail;
		}
		srv->mhd = MHD_start_daemon(flags, ntohs(sa.sin_port), NULL, NULL, on_request, srv,
					    MHD_OPTION_SOCK_ADDR, &sa,
					    MHD_OPTION_CONNECTION_LIMIT, opts->max_connections,
					    MHD_OPTION_CONNECTION_TIMEOUT, opts->timeout_s,
					    MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
					    MHD_OPTION_LISTENING_ADDRESS_REUSE, 1, MHD_OPTION_END);
	}
	if (!srv->mhd) {
		kiln_error_set(err, KILN_E_IO, "cannot listen on \"%s\"",
			       opts->unix_path ? opts->unix_path : opts->listen);
		goto fail;
	}
	{
		const union MHD_DaemonInfo *di = MHD_get_daemon_info(srv->mhd, MHD_DAEMON_INFO_BIND_PORT);
		srv->port = di ? di->port : 0;
	}
	return srv;
fail:
	if (srv->unix_fd >= 0)
		close(srv->unix_fd);
	free(srv->metrics);
	free(srv);
	return NULL;
}

unsigned http_server_port(const struct http_server *s)
{
	return s->port;
}

void http_server_stop(struct http_server *s, unsigned grace_s)
{
	struct timespec t0;
	MHD_socket fd;

	if (!s)
		return;
	fd = MHD_quiesce_daemon(s->mhd);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while (atomic_load(&s->in_flight) > 0 && elapsed_s(&t0) < grace_s)
		usleep(20 * 1000);
	MHD_stop_daemon(s->mhd);
	if (fd != MHD_INVALID_SOCKET)
		close(fd);
	else if (s->unix_fd >= 0)
		close(s->unix_fd);
	if (s->opts.unix_path)
		unlink(s->opts.unix_path);
	free(s->metrics);
	free(s);
}

void http_server_metrics(struct http_server *s, struct buf *out)
{
	buf_appends(out, "# HELP kiln_http_requests_total HTTP requests by route and status.\n"
			 "# TYPE kiln_http_requests_total counter\n");
	for (size_t r = 0; r <= s->opts.nroutes; r++) {
		const char *m = r < s->opts.nroutes ? s->opts.routes[r].method : "";
		const char *p = r < s->opts.nroutes ? s->opts.routes[r].pattern : "unmatched";

		for (size_t i = 0; i < NSTATUS; i++) {
			unsigned long long n = atomic_load(&s->metrics[r].by_status[i]);
			char st[8];

			if (!n)
				continue;
			if (i < NSTATUS - 1)
				snprintf(st, sizeof(st), "%d", metric_statuses[i]);
			else
				snprintf(st, sizeof(st), "other");
			buf_appendf(out,
				    "kiln_http_requests_total{method=\"%s\",route=\"%s\",status=\"%s\"} %llu\n",
				    m, p, st, n);
		}
	}
	buf_appends(out, "# HELP kiln_http_request_seconds HTTP request latency by route.\n"
			 "# TYPE kiln_http_request_seconds histogram\n");
	for (size_t r = 0; r <= s->opts.nroutes; r++) {
		const char *m = r < s->opts.nroutes ? s->opts.routes[r].method : "";
		const char *p = r < s->opts.nroutes ? s->opts.routes[r].pattern : "unmatched";
		unsigned long long cum = 0;

		for (size_t i = 0; i < NBUCKET; i++)
			cum += atomic_load(&s->metrics[r].buckets[i]);
		if (!cum)
			continue;
		cum = 0;
		for (size_t i = 0; i < NBUCKET; i++) {
			cum += atomic_load(&s->metrics[r].buckets[i]);
			if (i < NBUCKET - 1)
				buf_appendf(out,
					    "kiln_http_request_seconds_bucket{method=\"%s\",route=\"%s\",le=\"%g\"} %llu\n",
					    m, p, metric_buckets[i], cum);
			else
				buf_appendf(out,
					    "kiln_http_request_seconds_bucket{method=\"%s\",route=\"%s\",le=\"+Inf\"} %llu\n",
					    m, p, cum);
		}
		buf_appendf(out, "kiln_http_request_seconds_sum{method=\"%s\",route=\"%s\"} %.6f\n",
			    m, p, (double)atomic_load(&s->metrics[r].sum_us) / 1e6);
		buf_appendf(out, "kiln_http_request_seconds_count{method=\"%s\",route=\"%s\"} %llu\n",
			    m, p, cum);
	}
	buf_appendf(out, "# TYPE kiln_http_in_flight gauge\nkiln_http_in_flight %d\n",
		    atomic_load(&s->in_flight));
}
