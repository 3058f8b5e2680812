/*
 * http.c - the HTTP engine over libmicrohttpd (see http.h).
 *
 * One thread per connection (MHD_USE_THREAD_PER_CONNECTION), capped by max_connections: handlers
 * may block on Postgres or on a VM for as long as an exec runs without stalling other clients.
 *
 * On a TCP listener the engine accepts sockets itself (accept_main) and hands them to MHD with
 * MHD_add_connection: there it knows the client (the peer, or the address a trusted proxy's PROXY
 * header carries), counts connections per client address and refuses those over the cap with a
 * 429 before MHD spends a thread on them. A watchdog thread (watch_main) enforces the header
 * deadline and the minimum body rate, which MHD's idle timeout alone does not.
 */
#include "http.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/json.h"
#include "common/pg.h"
#include "common/log.h"

/*
 * The stack of each connection's thread on a TCP listener. glibc's default (8 MiB, from
 * RLIMIT_STACK) made starting the threads the slowest part of taking 1,000 connections at once
 * (under AddressSanitizer each stack's shadow is set up too); 512 KiB holds every handler many
 * times over (none keeps more than a few KiB on the stack) and took the time until 1,000 were
 * held from about 11 s to 5 s there.
 */
#define HTTP_THREAD_STACK (512u << 10)

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

struct addr_count;
struct conn;
struct cidr;

struct http_server {
	struct MHD_Daemon *mhd;
	struct http_server_opts opts;
	struct route_metrics *metrics;	/* nroutes + 1: the last is "unmatched" */
	atomic_int in_flight;
	unsigned port;
	int unix_fd;
	int listen_fd;			/* TCP: accepted by accept_main, -1 otherwise */
	int wake[2];			/* stops accept_main */
	pthread_t accept_thread, watch_thread;
	bool accepting, watching;
	atomic_bool stopping;
	atomic_int handshakes;		/* handshake_main threads running */
	struct cidr *proxies;
	size_t nproxies;
	pthread_mutex_t lock;		/* guards what follows */
	struct addr_count **addrs;	/* connections per client address, ADDR_BUCKETS chains */
	struct conn *conns;		/* every connection MHD holds */
	struct conn *pending;		/* handed to MHD_add_connection, not yet STARTED (by fd) */
	unsigned nconns;		/* connections open, MHD's and those being admitted */
	atomic_ullong refused_addr, refused_full, timed_out_headers, timed_out_body;
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
	char client[INET6_ADDRSTRLEN];	/* see http_req_client() */
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

		if (strcmp(r->pattern, "*") == 0)
			req->nparams = 0;
		else if (!route_match(r->pattern, req->path, req))
			continue;
		if (strcmp(r->method, "*") != 0 && strcmp(r->method, req->method) != 0) {
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

/* Whether the coming reply has a header `name` already. */
static bool reply_has_header(const struct http_req *req, const char *name)
{
	for (const struct header *h = req->headers; h; h = h->next)
		if (strcasecmp(h->name, name) == 0)
			return true;
	return false;
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
	/* Postgres unreachable because its primary went away during this request (pg.h): say so,
	 * so the client knows to retry with the same Idempotency-Key. */
	if (code == KILN_E_UNAVAILABLE && pg_switch_seen(true)) {
		code = KILN_E_DB_SWITCH;
		snprintf(msg, sizeof(msg),
			 "the database's primary changed while the request ran (a failover): retry it "
			 "with the same Idempotency-Key");
	}
	/* Every 503 says when to come back, unless its caller said it already. */
	if (kiln_err_status(code) == 503 && !reply_has_header(req, "Retry-After"))
		http_reply_header(req, "Retry-After", "1");
	/* A code whose detail stays in the log shows as "internal" with only the generic text. */
	if (!kiln_err_shown(code))
		snprintf(msg, sizeof(msg), "%s", kiln_strerror(KILN_E_INTERNAL));
	if (req->srv->opts.flat_errors)
		body = json_pack("{s:i, s:s}", "code", kiln_err_status(code), "message", msg);
	else
		body = json_pack("{s:{s:s, s:s, s:s}}", "error", "code", kiln_err_api_code(code),
				 "message", msg, "request_id", req->id);
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

static void conn_mark_upgraded(struct http_req *req);

struct upgrade_ctx {
	http_upgrade_cb run;
	void *cls;
	int fd;
	char *extra;
	size_t extra_len;
	struct MHD_UpgradeResponseHandle *urh;
};

static void *upgrade_main(void *arg)
{
	struct upgrade_ctx *u = arg;

	u->run(u->cls, u->fd, u->extra, u->extra_len);
	MHD_upgrade_action(u->urh, MHD_UPGRADE_ACTION_CLOSE);
	free(u->extra);
	free(u);
	return NULL;
}

static void upgrade_handler(void *cls, struct MHD_Connection *connection, void *req_cls,
			    const char *extra_in, size_t extra_in_size, MHD_socket sock,
			    struct MHD_UpgradeResponseHandle *urh)
{
	struct upgrade_ctx *u = cls;
	pthread_attr_t attr;
	pthread_t t;
	int rc;

	(void)connection;
	(void)req_cls;
	u->fd = sock;
	u->urh = urh;
	u->extra = extra_in_size ? malloc(extra_in_size) : NULL;
	if (u->extra) {
		memcpy(u->extra, extra_in, extra_in_size);
		u->extra_len = extra_in_size;
	}
	if (extra_in_size && !u->extra) {
		rc = -1;
	} else {
		pthread_attr_init(&attr);
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		pthread_attr_setstacksize(&attr, HTTP_THREAD_STACK);
		rc = pthread_create(&t, &attr, upgrade_main, u);
		pthread_attr_destroy(&attr);
	}
	if (rc != 0) {
		u->run(u->cls, -1, NULL, 0);
		MHD_upgrade_action(urh, MHD_UPGRADE_ACTION_CLOSE);
		free(u->extra);
		free(u);
	}
}

void http_reply_upgrade(struct http_req *req, const char *protocol, http_upgrade_cb run, void *cls)
{
	struct upgrade_ctx *u = calloc(1, sizeof(*u));
	struct MHD_Response *resp = u ? MHD_create_response_for_upgrade(upgrade_handler, u) : NULL;

	if (!resp) {
		free(u);
		run(cls, -1, NULL, 0);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	u->run = run;
	u->cls = cls;
	u->fd = -1;
	MHD_add_response_header(resp, "Upgrade", protocol);
	conn_mark_upgraded(req);
	reply_queue(req, 101, resp);
}

/* ---- accessors ---- */

void *http_req_app(const struct http_req *req) { return req->srv->opts.app; }
const char *http_req_method(const struct http_req *req) { return req->method; }
const char *http_req_path(const struct http_req *req) { return req->path; }
const char *http_req_id(const struct http_req *req) { return req->id; }
const char *http_req_client(const struct http_req *req) { return req->client; }
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

static void query_escape_into(struct buf *b, const char *s)
{
	static const char hex[] = "0123456789ABCDEF";

	for (; s && *s; s++) {
		unsigned char ch = (unsigned char)*s;

		if (isalnum(ch) || ch == '-' || ch == '_' || ch == '.' || ch == '~') {
			buf_append(b, s, 1);
		} else {
			char e[3] = { '%', hex[ch >> 4], hex[ch & 15] };

			buf_append(b, e, 3);
		}
	}
}

static enum MHD_Result query_arg(void *cls, enum MHD_ValueKind kind, const char *key,
				 const char *value)
{
	struct buf *b = cls;

	(void)kind;
	if (b->len)
		buf_append(b, "&", 1);
	query_escape_into(b, key);
	if (value) {
		buf_append(b, "=", 1);
		query_escape_into(b, value);
	}
	return MHD_YES;
}

char *http_req_query_string(const struct http_req *req)
{
	struct buf b;
	char *s;

	buf_init(&b, 1 << 20);
	MHD_get_connection_values(req->conn, MHD_GET_ARGUMENT_KIND, query_arg, &b);
	s = malloc(b.len + 1);
	if (s) {
		memcpy(s, b.data ? b.data : "", b.len);
		s[b.len] = '\0';
	}
	buf_release(&b);
	return s;
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

/* ---- connections: per-address caps, deadlines, trusted proxies ---- */

#define ADDR_BUCKETS 1024
#define PROXY_V1_MAX 107	/* the longest v1 line, CRLF included */
#define PROXY_V2_MAX 1024	/* the longest v2 header we take */
#define WATCH_TICK_MS 200

/* PH_UPGRADED: the connection left HTTP (http_reply_upgrade); no deadline applies any more. */
enum conn_phase { PH_HEADERS, PH_BODY, PH_HANDLING, PH_UPGRADED };

/* One accepted socket (the socket_context of libmicrohttpd). */
struct conn {
	struct conn *prev, *next;	/* in srv->conns, under srv->lock */
	int fd;
	char addr[INET6_ADDRSTRLEN];	/* the client: counted in srv->addrs when `counted` */
	char peer[INET6_ADDRSTRLEN];	/* the socket's peer */
	bool counted;
	bool trusted;			/* the peer is a trusted proxy */
	bool carried;			/* `addr` came from a PROXY header */
	bool killed;			/* closed by the watchdog: refuse what MHD still reads */
	enum conn_phase phase;
	struct timespec t;		/* when the phase began */
	unsigned long long body_bytes;
};

struct addr_count {
	struct addr_count *next;
	unsigned n;
	char addr[INET6_ADDRSTRLEN];
};

struct cidr {
	int family;
	unsigned char a[16];
	unsigned bits;
};


static unsigned addr_hash(const char *s)
{
	unsigned h = 2166136261u;

	for (; *s; s++)
		h = (h ^ (unsigned char)*s) * 16777619u;
	return h % ADDR_BUCKETS;
}

/*
 * What a client address counts under: an IPv4 address itself, an IPv6 address its /64 (one
 * subscriber's usual allocation: its 2^64 addresses are one client).
 */
static void addr_key(const char *addr, char out[INET6_ADDRSTRLEN])
{
	unsigned char a[16];

	if (strchr(addr, ':') && inet_pton(AF_INET6, addr, a) == 1) {
		memset(a + 8, 0, 8);
		inet_ntop(AF_INET6, a, out, INET6_ADDRSTRLEN);
		return;
	}
	snprintf(out, INET6_ADDRSTRLEN, "%s", addr);
}

/* Counts one more connection of `client`; false (nothing counted) when it has `max` already. */
static bool addr_take(struct http_server *srv, const char *client, unsigned max)
{
	char addr[INET6_ADDRSTRLEN];
	struct addr_count **pp, *a;

	addr_key(client, addr);
	pp = &srv->addrs[addr_hash(addr)];

	for (a = *pp; a && strcmp(a->addr, addr) != 0; a = a->next)
		;
	if (a && max && a->n >= max)
		return false;
	if (!a) {
		a = calloc(1, sizeof(*a));
		if (!a)
			return false;
		snprintf(a->addr, sizeof(a->addr), "%s", addr);
		a->next = *pp;
		*pp = a;
	}
	a->n++;
	return true;
}

static void addr_drop(struct http_server *srv, const char *client)
{
	char addr[INET6_ADDRSTRLEN];
	struct addr_count **pp, *a;

	addr_key(client, addr);
	pp = &srv->addrs[addr_hash(addr)];

	for (; (a = *pp) && strcmp(a->addr, addr) != 0; pp = &a->next)
		;
	if (a && --a->n == 0) {
		*pp = a->next;
		free(a);
	}
}

/* Parses "a.b.c.d", "a.b.c.d/n", "v6", "v6/n" into `c`; -EINVAL when it is none of them. */
static int cidr_parse(const char *s, struct cidr *c)
{
	char text[INET6_ADDRSTRLEN + 4];
	char *slash, *end;
	long bits;

	if (strlen(s) >= sizeof(text))
		return -EINVAL;
	strcpy(text, s);
	slash = strchr(text, '/');
	if (slash)
		*slash = '\0';
	memset(c, 0, sizeof(*c));
	if (inet_pton(AF_INET, text, c->a) == 1)
		c->family = AF_INET, c->bits = 32;
	else if (inet_pton(AF_INET6, text, c->a) == 1)
		c->family = AF_INET6, c->bits = 128;
	else
		return -EINVAL;
	if (slash) {
		bits = strtol(slash + 1, &end, 10);
		if (!slash[1] || *end || bits < 0 || bits > (long)c->bits)
			return -EINVAL;
		c->bits = (unsigned)bits;
	}
	return 0;
}

/* Parses the comma- or space-separated list `list` into srv->proxies. */
static int proxies_parse(struct http_server *srv, const char *list)
{
	char *copy, *tok, *save = NULL;
	int rc = 0;

	if (!list || !*list)
		return 0;
	copy = strdup(list);
	if (!copy)
		return -ENOMEM;
	for (tok = strtok_r(copy, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save)) {
		struct cidr *n = realloc(srv->proxies, (srv->nproxies + 1) * sizeof(*n));

		if (!n) {
			rc = -ENOMEM;
			break;
		}
		srv->proxies = n;
		if (cidr_parse(tok, &srv->proxies[srv->nproxies]) != 0) {
			rc = -EINVAL;
			break;
		}
		srv->nproxies++;
	}
	free(copy);
	return rc;
}

/* Whether the textual address `addr` is one of the trusted proxies. */
static bool proxy_trusted(const struct http_server *srv, const char *addr)
{
	struct cidr a;

	if (!srv->nproxies || cidr_parse(addr, &a) != 0)
		return false;
	for (size_t i = 0; i < srv->nproxies; i++) {
		const struct cidr *c = &srv->proxies[i];
		unsigned full = c->bits / 8, rest = c->bits % 8;

		if (c->family != a.family || memcmp(c->a, a.a, full) != 0)
			continue;
		if (rest && ((c->a[full] ^ a.a[full]) & (0xff00u >> rest) & 0xff))
			continue;
		return true;
	}
	return false;
}

/* The textual form of a socket address (IPv4-mapped IPv6 shown as IPv4); "" for others. */
static void sockaddr_text(const struct sockaddr_storage *ss, char out[INET6_ADDRSTRLEN])
{
	out[0] = '\0';
	if (ss->ss_family == AF_INET) {
		inet_ntop(AF_INET, &((const struct sockaddr_in *)ss)->sin_addr, out, INET6_ADDRSTRLEN);
	} else if (ss->ss_family == AF_INET6) {
		const struct in6_addr *a = &((const struct sockaddr_in6 *)ss)->sin6_addr;

		if (IN6_IS_ADDR_V4MAPPED(a))
			inet_ntop(AF_INET, &a->s6_addr[12], out, INET6_ADDRSTRLEN);
		else
			inet_ntop(AF_INET6, a, out, INET6_ADDRSTRLEN);
	}
}

/* Writes a whole reply of the error model to a socket MHD is not writing to, without blocking. */
static void conn_raw_error(int fd, enum kiln_err code, const char *msg)
{
	char id[24], body[512], head[256];
	int blen, hlen;

	new_request_id(id);
	blen = snprintf(body, sizeof(body),
			"{\"error\":{\"code\":\"%s\",\"message\":\"%s\",\"request_id\":\"%s\"}}",
			kiln_err_api_code(code), msg, id);
	hlen = snprintf(head, sizeof(head),
			"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
			"X-Request-Id: %s\r\nConnection: close\r\n%s\r\n",
			kiln_err_status(code), kiln_err_status(code) == 408 ? "Request Timeout"
					       : kiln_err_status(code) == 429 ? "Too Many Requests"
					       : kiln_err_status(code) == 400 ? "Bad Request"
					       : "Service Unavailable",
			blen, id,
			kiln_err_status(code) == 429 || kiln_err_status(code) == 503 ? "Retry-After: 1\r\n"
										     : "");
	if (send(fd, head, (size_t)hlen, MSG_DONTWAIT | MSG_NOSIGNAL) == hlen)
		send(fd, body, (size_t)blen, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* Answers and closes a socket MHD never saw; what the client sent is drained first (no RST). */
static void conn_refuse(int fd, enum kiln_err code, const char *msg)
{
	char sink[4096];

	if (code != KILN_OK)
		conn_raw_error(fd, code, msg);
	shutdown(fd, SHUT_WR);
	while (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0)
		;
	close(fd);
}

static void conn_free_uncounted(struct http_server *srv, struct conn *cc)
{
	pthread_mutex_lock(&srv->lock);
	if (cc->counted)
		addr_drop(srv, cc->addr);
	srv->nconns--;
	pthread_mutex_unlock(&srv->lock);
	free(cc);
}

/*
 * Counts `cc` under `addr` and hands its socket to MHD; over a cap, answers 429/503 and closes
 * it. `sa` is the client's address as MHD will report it. Frees `cc` when it does not go to MHD.
 */
static void conn_admit(struct http_server *srv, struct conn *cc, const struct sockaddr *sa,
		       socklen_t salen, bool count)
{
	char msg[160];
	bool ok;

	pthread_mutex_lock(&srv->lock);
	ok = !count || addr_take(srv, cc->addr, srv->opts.max_per_addr);
	cc->counted = count && ok;
	pthread_mutex_unlock(&srv->lock);
	if (!ok) {
		snprintf(msg, sizeof(msg),
			 "too many connections from %s: the limit "
			 "(http_max_connections_per_addr) is %u",
			 cc->addr, srv->opts.max_per_addr);
		atomic_fetch_add(&srv->refused_addr, 1);
		log_warn("refused a connection from %s: %u connections already", cc->addr,
			 srv->opts.max_per_addr);
		conn_refuse(cc->fd, KILN_E_RATE_LIMITED, msg);
		conn_free_uncounted(srv, cc);
		return;
	}
	/*
	 * MHD's own thread runs notify STARTED for it (MHD_add_connection only queues the socket):
	 * it finds `cc` in srv->pending by its fd. An entry left there with the same fd is stale (MHD
	 * dropped that socket without telling) and is freed.
	 */
	pthread_mutex_lock(&srv->lock);
	for (struct conn **pp = &srv->pending; *pp;) {
		struct conn *old = *pp;

		if (old->fd != cc->fd) {
			pp = &old->next;
			continue;
		}
		*pp = old->next;
		if (old->counted)
			addr_drop(srv, old->addr);
		srv->nconns--;
		free(old);
	}
	cc->next = srv->pending;
	srv->pending = cc;
	pthread_mutex_unlock(&srv->lock);
	if (MHD_add_connection(srv->mhd, cc->fd, sa, salen) != MHD_YES) {
		/* MHD closed the socket; unless STARTED ran, it is still ours to free. */
		bool found = false;

		pthread_mutex_lock(&srv->lock);
		for (struct conn **pp = &srv->pending; *pp; pp = &(*pp)->next)
			if (*pp == cc) {
				*pp = cc->next;
				found = true;
				break;
			}
		pthread_mutex_unlock(&srv->lock);
		if (found)
			conn_free_uncounted(srv, cc);
	}
}

/* Takes the pending connection of socket `fd` off srv->pending; NULL when none (under lock). */
static struct conn *pending_take(struct http_server *srv, int fd)
{
	for (struct conn **pp = &srv->pending; *pp; pp = &(*pp)->next)
		if ((*pp)->fd == fd) {
			struct conn *cc = *pp;

			*pp = cc->next;
			cc->next = NULL;
			return cc;
		}
	return NULL;
}

/* Reads exactly `n` bytes before `deadline` (CLOCK_MONOTONIC); 0 or -errno. */
static int read_full(int fd, void *buf, size_t n, const struct timespec *deadline)
{
	size_t got = 0;

	while (got < n) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		struct timespec now;
		long ms;
		ssize_t r;

		clock_gettime(CLOCK_MONOTONIC, &now);
		ms = (deadline->tv_sec - now.tv_sec) * 1000 + (deadline->tv_nsec - now.tv_nsec) / 1000000;
		if (ms <= 0)
			return -ETIMEDOUT;
		if (poll(&p, 1, (int)ms) <= 0)
			continue;
		r = recv(fd, (char *)buf + got, n - got, 0);
		if (r == 0)
			return -ECONNRESET;
		if (r < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			return -errno;
		}
		got += (size_t)r;
	}
	return 0;
}

/*
 * Peeks at up to `want` bytes until `enough` says they decide (or `want` are waiting, or the
 * deadline passed); returns how many are waiting, or -errno.
 */
static ssize_t peek_some(int fd, char *buf, size_t want, const struct timespec *deadline,
			 bool (*enough)(const char *buf, size_t n))
{
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		struct timespec now;
		ssize_t r;
		long ms;

		r = recv(fd, buf, want, MSG_PEEK | MSG_DONTWAIT);
		if (r == 0)
			return -ECONNRESET;
		if (r < 0 && errno != EAGAIN && errno != EINTR)
			return -errno;
		if (r == (ssize_t)want || (r > 0 && enough(buf, (size_t)r)))
			return r;
		clock_gettime(CLOCK_MONOTONIC, &now);
		ms = (deadline->tv_sec - now.tv_sec) * 1000 + (deadline->tv_nsec - now.tv_nsec) / 1000000;
		if (ms <= 0)
			return r > 0 ? r : -ETIMEDOUT;
		if (r > 0)
			usleep(10 * 1000);	/* part of it: wait for the rest */
		else
			poll(&p, 1, (int)(ms < 1000 ? ms : 1000));
	}
}

static const char proxy_v2_sig[12] = "\r\n\r\n\0\r\nQUIT\n";

/* Whether the first `n` bytes tell a PROXY v1 or v2 header from an HTTP request. */
static bool proxy_decided(const char *b, size_t n)
{
	if (b[0] == 'P')
		return n >= 6;
	if (b[0] == '\r')
		return n >= 12;
	return true;
}

/* Whether a v1 line is complete. */
static bool proxy_v1_done(const char *b, size_t n)
{
	return memmem(b, n, "\r\n", 2) != NULL;
}

/*
 * Reads a PROXY protocol header (v1 or v2) if the socket starts with one. Fills `ss` with the
 * client address it carries; 1 when it carried one, 0 when there was no header (or a LOCAL or
 * UNKNOWN one: the peer is the client), -EPROTO when malformed, -errno on a socket error.
 */
static int proxy_read(int fd, struct sockaddr_storage *ss, const struct timespec *deadline)
{
	char b[PROXY_V2_MAX];
	ssize_t n = peek_some(fd, b, 16, deadline, proxy_decided);

	if (n < 0)
		return (int)n;
	if (n >= 6 && memcmp(b, "PROXY ", 6) == 0) {
		char *crlf, *f[6], *save = NULL;
		int nf = 0, port;

		n = peek_some(fd, b, PROXY_V1_MAX, deadline, proxy_v1_done);
		if (n < 0)
			return (int)n;
		crlf = memmem(b, (size_t)n, "\r\n", 2);
		if (!crlf)
			return -EPROTO;
		if (read_full(fd, b, (size_t)(crlf - b) + 2, deadline))
			return -EPROTO;
		*crlf = '\0';
		for (char *t = strtok_r(b, " ", &save); t && nf < 6; t = strtok_r(NULL, " ", &save))
			f[nf++] = t;
		if (nf >= 2 && strcmp(f[1], "UNKNOWN") == 0)
			return 0;
		if (nf != 6 || strtok_r(NULL, " ", &save))
			return -EPROTO;
		port = atoi(f[4]);
		memset(ss, 0, sizeof(*ss));
		if (strcmp(f[1], "TCP4") == 0) {
			struct sockaddr_in *in = (struct sockaddr_in *)ss;
			in->sin_family = AF_INET;
			in->sin_port = htons((uint16_t)port);
			if (inet_pton(AF_INET, f[2], &in->sin_addr) != 1)
				return -EPROTO;
		} else if (strcmp(f[1], "TCP6") == 0) {
			struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
			in6->sin6_family = AF_INET6;
			in6->sin6_port = htons((uint16_t)port);
			if (inet_pton(AF_INET6, f[2], &in6->sin6_addr) != 1)
				return -EPROTO;
		} else {
			return -EPROTO;
		}
		return 1;
	}
	if (n >= 12 && memcmp(b, proxy_v2_sig, 12) == 0) {
		unsigned char *u = (unsigned char *)b;
		size_t len;

		if (read_full(fd, b, 16, deadline))
			return -EPROTO;
		len = ((size_t)u[14] << 8) | u[15];
		if ((u[12] & 0xf0) != 0x20 || 16 + len > sizeof(b) ||
		    read_full(fd, b + 16, len, deadline))
			return -EPROTO;
		if ((u[12] & 0x0f) == 0)	/* LOCAL: the proxy's own connection */
			return 0;
		if ((u[12] & 0x0f) != 1)
			return -EPROTO;
		memset(ss, 0, sizeof(*ss));
		if (u[13] == 0x11 && len >= 12) {	/* TCP over IPv4 */
			struct sockaddr_in *in = (struct sockaddr_in *)ss;
			in->sin_family = AF_INET;
			memcpy(&in->sin_addr, b + 16, 4);
			memcpy(&in->sin_port, b + 24, 2);
			return 1;
		}
		if (u[13] == 0x21 && len >= 36) {	/* TCP over IPv6 */
			struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
			in6->sin6_family = AF_INET6;
			memcpy(&in6->sin6_addr, b + 16, 16);
			memcpy(&in6->sin6_port, b + 48, 2);
			return 1;
		}
		if (u[13] == 0x00)	/* UNSPEC */
			return 0;
		return -EPROTO;
	}
	return 0;
}

struct handshake {
	struct http_server *srv;
	struct conn *cc;
	struct sockaddr_storage ss;
	socklen_t sslen;
};

/* A trusted proxy's socket: reads its PROXY header (if any) off the accept thread, then admits. */
static void *handshake_main(void *arg)
{
	struct handshake *h = arg;
	struct http_server *srv = h->srv;
	struct conn *cc = h->cc;
	struct sockaddr_storage carried;
	struct timespec deadline;
	int rc;

	clock_gettime(CLOCK_MONOTONIC, &deadline);
	deadline.tv_sec += srv->opts.header_timeout_s ? srv->opts.header_timeout_s : 10;
	rc = proxy_read(cc->fd, &carried, &deadline);
	if (rc < 0) {
		log_warn("closed a connection from proxy %s: %s", cc->peer,
			 rc == -EPROTO ? "malformed PROXY header" : strerror(-rc));
		conn_refuse(cc->fd, rc == -EPROTO ? KILN_E_BAD_REQUEST : KILN_OK,
			    "malformed PROXY protocol header");
		conn_free_uncounted(srv, cc);
	} else if (rc == 1) {
		cc->carried = true;
		sockaddr_text(&carried, cc->addr);
		conn_admit(srv, cc, (struct sockaddr *)&carried,
			   carried.ss_family == AF_INET ? sizeof(struct sockaddr_in)
							: sizeof(struct sockaddr_in6),
			   true);
	} else {
		/* No header: X-Forwarded-For may name the client, request by request. */
		conn_admit(srv, cc, (struct sockaddr *)&h->ss, h->sslen, false);
	}
	free(h);
	atomic_fetch_sub(&srv->handshakes, 1);
	return NULL;
}

/* The accept loop of a TCP listener. */
static void *accept_main(void *arg)
{
	struct http_server *srv = arg;

	for (;;) {
		struct pollfd p[2] = { { .fd = srv->listen_fd, .events = POLLIN },
				       { .fd = srv->wake[0], .events = POLLIN } };
		struct sockaddr_storage ss;
		socklen_t sslen = sizeof(ss);
		struct conn *cc;
		int fd;

		if (poll(p, 2, -1) < 0 && errno != EINTR)
			break;
		if (p[1].revents)
			break;
		if (!(p[0].revents & POLLIN))
			continue;
		fd = accept4(srv->listen_fd, (struct sockaddr *)&ss, &sslen, SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
				usleep(50 * 1000);
			continue;
		}
		cc = calloc(1, sizeof(*cc));
		if (!cc) {
			close(fd);
			continue;
		}
		cc->fd = fd;
		sockaddr_text(&ss, cc->peer);
		memcpy(cc->addr, cc->peer, sizeof(cc->addr));
		cc->trusted = proxy_trusted(srv, cc->peer);
		pthread_mutex_lock(&srv->lock);
		if (srv->nconns >= srv->opts.max_connections) {
			pthread_mutex_unlock(&srv->lock);
			atomic_fetch_add(&srv->refused_full, 1);
			log_warn("refused a connection from %s: %u connections already open", cc->peer,
				 srv->opts.max_connections);
			conn_refuse(fd, KILN_E_UNAVAILABLE,
				    "the server has too many connections open "
				    "(http_max_connections); try again");
			free(cc);
			continue;
		}
		srv->nconns++;
		pthread_mutex_unlock(&srv->lock);
		if (cc->trusted) {
			struct handshake *h = calloc(1, sizeof(*h));
			pthread_attr_t attr;
			pthread_t t;

			if (h) {
				h->srv = srv;
				h->cc = cc;
				h->ss = ss;
				h->sslen = sslen;
				pthread_attr_init(&attr);
				pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
				atomic_fetch_add(&srv->handshakes, 1);
				if (pthread_create(&t, &attr, handshake_main, h) == 0) {
					pthread_attr_destroy(&attr);
					continue;
				}
				atomic_fetch_sub(&srv->handshakes, 1);
				pthread_attr_destroy(&attr);
				free(h);
			}
			conn_refuse(fd, KILN_E_UNAVAILABLE, "the server is out of resources");
			conn_free_uncounted(srv, cc);
			continue;
		}
		conn_admit(srv, cc, (struct sockaddr *)&ss, sslen, srv->opts.max_per_addr > 0);
	}
	return NULL;
}

static void on_connection(void *cls, struct MHD_Connection *mc, void **socket_context,
			  enum MHD_ConnectionNotificationCode toe)
{
	struct http_server *srv = cls;
	struct conn *cc;

	if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
		const union MHD_ConnectionInfo *ci =
			MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);

		pthread_mutex_lock(&srv->lock);
		cc = ci ? pending_take(srv, ci->connect_fd) : NULL;
		if (!cc) {	/* accepted by MHD itself (Unix socket): counted nowhere */
			cc = calloc(1, sizeof(*cc));
			if (!cc) {
				pthread_mutex_unlock(&srv->lock);
				return;
			}
			cc->fd = ci ? ci->connect_fd : -1;
			srv->nconns++;
		}
		cc->phase = PH_HEADERS;
		clock_gettime(CLOCK_MONOTONIC, &cc->t);
		cc->prev = NULL;
		cc->next = srv->conns;
		if (srv->conns)
			srv->conns->prev = cc;
		srv->conns = cc;
		pthread_mutex_unlock(&srv->lock);
		*socket_context = cc;
		return;
	}
	cc = *socket_context;
	if (!cc)
		return;
	pthread_mutex_lock(&srv->lock);
	if (cc->prev)
		cc->prev->next = cc->next;
	else
		srv->conns = cc->next;
	if (cc->next)
		cc->next->prev = cc->prev;
	pthread_mutex_unlock(&srv->lock);
	*socket_context = NULL;
	conn_free_uncounted(srv, cc);
}

/* The connection context of a request's socket, or NULL. */
static struct conn *conn_of(struct MHD_Connection *mc)
{
	const union MHD_ConnectionInfo *ci =
		MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);

	return ci ? ci->socket_context : NULL;
}

/*
 * The client X-Forwarded-For names: walking from the right, the first address that is not a
 * trusted proxy (the last trusted one when an entry left of it is not an address; the leftmost
 * when all are trusted). At most the last 64 entries are looked at. False when the rightmost entry
 * is not an address.
 */
static bool xff_client(const struct http_server *srv, const char *xff, char out[INET6_ADDRSTRLEN])
{
	char *copy = strdup(xff), *tok[64], *save = NULL;
	int n = 0;
	bool found = false;

	out[0] = '\0';
	if (!copy)
		return false;
	for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
		if (n == (int)(sizeof(tok) / sizeof(tok[0])))
			memmove(tok, tok + 1, sizeof(tok) - sizeof(tok[0])), n--;	/* keep the last */
		tok[n++] = t;
	}
	for (int i = n - 1; i >= 0; i--) {
		char *t = tok[i], *e;
		struct cidr c;

		t += strspn(t, " \t");
		for (e = t + strlen(t); e > t && (e[-1] == ' ' || e[-1] == '\t'); e--)
			;
		*e = '\0';
		if (strlen(t) >= INET6_ADDRSTRLEN || cidr_parse(t, &c) != 0 ||
		    c.bits != (c.family == AF_INET ? 32u : 128u))
			break;
		snprintf(out, INET6_ADDRSTRLEN, "%s", t);
		found = true;
		if (!proxy_trusted(srv, t))
			break;
	}
	free(copy);
	return found;
}

/*
 * Sets the client of a new request on `cc` (X-Forwarded-For from a trusted proxy without a
 * PROXY header) and counts it. False when that address is over its cap.
 */
static bool conn_request_client(struct http_server *srv, struct conn *cc, struct http_req *req)
{
	char client[INET6_ADDRSTRLEN];
	bool ok = true;
	const char *xff;

	if (!cc->trusted || cc->carried) {
		snprintf(req->client, sizeof(req->client), "%s", cc->addr);
		return true;
	}
	xff = MHD_lookup_connection_value(req->conn, MHD_HEADER_KIND, "X-Forwarded-For");
	if (!xff || !xff_client(srv, xff, client))
		snprintf(client, sizeof(client), "%s", cc->peer);
	pthread_mutex_lock(&srv->lock);
	if (!cc->counted || strcmp(client, cc->addr) != 0) {
		if (cc->counted)
			addr_drop(srv, cc->addr);
		cc->counted = false;
		snprintf(cc->addr, sizeof(cc->addr), "%s", client);
		/* The proxy's own requests (no XFF) are not capped by address. */
		if (strcmp(client, cc->peer) != 0 && srv->opts.max_per_addr) {
			ok = addr_take(srv, client, srv->opts.max_per_addr);
			cc->counted = ok;
		}
	}
	pthread_mutex_unlock(&srv->lock);
	snprintf(req->client, sizeof(req->client), "%s", client);
	return ok;
}

/* Moves `cc` to `phase` now. */
static void conn_phase(struct http_server *srv, struct conn *cc, enum conn_phase phase)
{
	if (!cc)
		return;
	pthread_mutex_lock(&srv->lock);
	if (cc->phase == PH_UPGRADED) {	/* never back to HTTP */
		pthread_mutex_unlock(&srv->lock);
		return;
	}
	cc->phase = phase;
	cc->body_bytes = 0;
	clock_gettime(CLOCK_MONOTONIC, &cc->t);
	pthread_mutex_unlock(&srv->lock);
}

/* Exempts the request's connection from the deadlines: it leaves HTTP with this reply. */
static void conn_mark_upgraded(struct http_req *req)
{
	conn_phase(req->srv, conn_of(req->conn), PH_UPGRADED);
}

/*
 * Closes connections past their deadlines: headers (or the next request's on a kept-alive
 * connection) not in within header_timeout_s; a body slower than body_min_rate (408).
 */
static void *watch_main(void *arg)
{
	struct http_server *srv = arg;

	while (!atomic_load(&srv->stopping)) {
		struct timespec now;

		usleep(WATCH_TICK_MS * 1000);
		clock_gettime(CLOCK_MONOTONIC, &now);
		pthread_mutex_lock(&srv->lock);
		for (struct conn *cc = srv->conns; cc; cc = cc->next) {
			double age = (double)(now.tv_sec - cc->t.tv_sec) +
				     (double)(now.tv_nsec - cc->t.tv_nsec) / 1e9;
			double allowed = srv->opts.header_timeout_s;

			if (cc->killed || cc->fd < 0)
				continue;
			if (cc->phase == PH_HEADERS && srv->opts.header_timeout_s && age > allowed) {
				cc->killed = true;
				shutdown(cc->fd, SHUT_RDWR);
				atomic_fetch_add(&srv->timed_out_headers, 1);
				log_info("closed a connection from %s: no complete request in %u s",
					 cc->addr, srv->opts.header_timeout_s);
			} else if (cc->phase == PH_BODY && srv->opts.body_min_rate &&
				   age > allowed + (double)cc->body_bytes / srv->opts.body_min_rate) {
				char msg[160];

				cc->killed = true;
				snprintf(msg, sizeof(msg),
					 "the request body came slower than %u bytes/s "
					 "(http_body_min_rate)",
					 srv->opts.body_min_rate);
				conn_raw_error(cc->fd, KILN_E_TIMEOUT, msg);
				shutdown(cc->fd, SHUT_RDWR);
				atomic_fetch_add(&srv->timed_out_body, 1);
				log_info("closed a connection from %s: body slower than %u bytes/s",
					 cc->addr, srv->opts.body_min_rate);
			}
		}
		pthread_mutex_unlock(&srv->lock);
	}
	return NULL;
}

/* Whether the watchdog closed `cc` (what MHD still reads of it is refused). */
static bool conn_killed(struct http_server *srv, struct conn *cc)
{
	bool k;

	if (!cc)
		return false;
	pthread_mutex_lock(&srv->lock);
	k = cc->killed;
	pthread_mutex_unlock(&srv->lock);
	return k;
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
	struct conn *cc = conn_of(conn);

	if (conn_killed(srv, cc))
		return MHD_NO;	/* past a deadline: the watchdog answered and shut it */
	if (!req) {
		bool mismatch, client_ok;

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
		pg_switch_seen(true);	/* a flag left by this thread's previous request */
		*con_cls = req;
		conn_phase(srv, cc, PH_BODY);
		client_ok = !cc || conn_request_client(srv, cc, req);
		if (!client_ok) {
			req->route_idx = (int)srv->opts.nroutes;
			atomic_fetch_add(&srv->refused_addr, 1);
			log_warn("refused a request from %s: %u connections already", req->client,
				 srv->opts.max_per_addr);
			http_reply_header(req, "Connection", "close");
			http_reply_header(req, "Retry-After", "1");
			http_reply_error(req, KILN_E_RATE_LIMITED,
					 "too many connections from %s: the limit "
					 "(http_max_connections_per_addr) is %u",
					 req->client, srv->opts.max_per_addr);
			return MHD_YES;
		}
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
	if (*upload_size && cc) {
		pthread_mutex_lock(&srv->lock);
		cc->body_bytes += *upload_size;
		pthread_mutex_unlock(&srv->lock);
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
	conn_phase(srv, cc, PH_HANDLING);
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
	conn_phase(srv, conn_of(conn), PH_HEADERS);	/* the next request's deadline starts */
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

long http_port_value(const char *s)
{
	long v = 0;

	if (!s || !*s || strlen(s) > 5)
		return -1;
	for (; *s; s++) {
		if (*s < '0' || *s > '9')
			return -1;
		v = v * 10 + (*s - '0');
	}
	return v >= 1 && v <= 65535 ? v : -1;
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

/* Binds and listens on `sa` (non-blocking); the socket or -errno. */
static int tcp_listen(const struct sockaddr_in *sa)
{
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), one = 1;

	if (fd < 0)
		return -errno;
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (const struct sockaddr *)sa, sizeof(*sa)) || listen(fd, 1024)) {
		int e = -errno;
		close(fd);
		return e;
	}
	return fd;
}

/* Frees what http_server_start made; the threads must be stopped. */
static void server_free(struct http_server *srv)
{
	if (srv->listen_fd >= 0)
		close(srv->listen_fd);
	if (srv->unix_fd >= 0)
		close(srv->unix_fd);
	for (int i = 0; i < 2; i++)
		if (srv->wake[i] >= 0)
			close(srv->wake[i]);
	for (size_t i = 0; srv->addrs && i < ADDR_BUCKETS; i++)
		while (srv->addrs[i]) {
			struct addr_count *a = srv->addrs[i];
			srv->addrs[i] = a->next;
			free(a);
		}
	free(srv->addrs);
	while (srv->pending) {
		struct conn *cc = srv->pending;
		srv->pending = cc->next;
		free(cc);
	}
	free(srv->proxies);
	free(srv->metrics);
	pthread_mutex_destroy(&srv->lock);
	free(srv);
}

struct http_server *http_server_start(const struct http_server_opts *opts, struct kiln_error *err)
{
	struct http_server *srv = calloc(1, sizeof(*srv));
	struct sockaddr_in sa;
	unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
			 MHD_USE_POLL | MHD_USE_ERROR_LOG | MHD_ALLOW_UPGRADE;
	int rc;

	if (!srv) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	srv->opts = *opts;
	srv->unix_fd = -1;
	srv->listen_fd = -1;
	srv->wake[0] = srv->wake[1] = -1;
	pthread_mutex_init(&srv->lock, NULL);
	srv->metrics = calloc(opts->nroutes + 1, sizeof(*srv->metrics));
	srv->addrs = calloc(ADDR_BUCKETS, sizeof(*srv->addrs));
	if (!srv->metrics || !srv->addrs) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto fail;
	}
	rc = proxies_parse(srv, opts->trusted_proxies);
	if (rc) {
		kiln_error_set(err, rc == -ENOMEM ? KILN_E_NOMEM : KILN_E_INVALID,
			       "setting \"http_trusted_proxies\" is \"%s\": each entry must be an "
			       "address or a CIDR",
			       opts->trusted_proxies);
		goto fail;
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
					    MHD_OPTION_NOTIFY_CONNECTION, on_connection, srv,
					    MHD_OPTION_END);
	} else {
		if (parse_listen(opts->listen, &sa)) {
			kiln_error_set(err, KILN_E_INVALID, "bad listen address \"%s\"", opts->listen);
			goto fail;
		}
		srv->listen_fd = tcp_listen(&sa);
		if (srv->listen_fd < 0) {
			kiln_error_set(err, KILN_E_IO, "cannot listen on \"%s\": %s", opts->listen,
				       strerror(-srv->listen_fd));
			goto fail;
		}
		if (pipe2(srv->wake, O_CLOEXEC)) {
			kiln_error_set(err, KILN_E_IO, "pipe: %s", strerror(errno));
			goto fail;
		}
		/* The engine counts connections itself; MHD's own limit is only a backstop. */
		srv->mhd = MHD_start_daemon(flags | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC, 0, NULL,
					    NULL, on_request, srv,
					    MHD_OPTION_CONNECTION_LIMIT, opts->max_connections + 64,
					    MHD_OPTION_CONNECTION_TIMEOUT, opts->timeout_s,
					    MHD_OPTION_THREAD_STACK_SIZE, (size_t)HTTP_THREAD_STACK,
					    MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv,
					    MHD_OPTION_NOTIFY_CONNECTION, on_connection, srv,
					    MHD_OPTION_END);
	}
	if (!srv->mhd) {
		kiln_error_set(err, KILN_E_IO, "cannot listen on \"%s\"",
			       opts->unix_path ? opts->unix_path : opts->listen);
		goto fail;
	}
	if (srv->listen_fd >= 0) {
		struct sockaddr_in bound;
		socklen_t blen = sizeof(bound);

		if (getsockname(srv->listen_fd, (struct sockaddr *)&bound, &blen) == 0)
			srv->port = ntohs(bound.sin_port);
		if (pthread_create(&srv->accept_thread, NULL, accept_main, srv) != 0) {
			kiln_error_set(err, KILN_E_NOMEM, "cannot start the accept thread");
			goto fail;
		}
		srv->accepting = true;
	} else {
		const union MHD_DaemonInfo *di = MHD_get_daemon_info(srv->mhd, MHD_DAEMON_INFO_BIND_PORT);
		srv->port = di ? di->port : 0;
	}
	if ((opts->header_timeout_s || opts->body_min_rate) &&
	    pthread_create(&srv->watch_thread, NULL, watch_main, srv) == 0)
		srv->watching = true;
	return srv;
fail:
	http_server_stop(srv, 0);
	return NULL;
}

unsigned http_server_port(const struct http_server *s)
{
	return s->port;
}

void http_server_stop(struct http_server *s, unsigned grace_s)
{
	struct timespec t0;
	MHD_socket fd = MHD_INVALID_SOCKET;

	if (!s)
		return;
	if (s->accepting) {
		if (write(s->wake[1], "x", 1) < 0)
			log_warn("cannot wake the accept thread: %s", strerror(errno));
		pthread_join(s->accept_thread, NULL);
		s->accepting = false;
		close(s->listen_fd);
		s->listen_fd = -1;
	} else if (s->mhd && s->unix_fd >= 0) {
		fd = MHD_quiesce_daemon(s->mhd);
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	while ((atomic_load(&s->in_flight) > 0 || atomic_load(&s->handshakes) > 0) &&
	       elapsed_s(&t0) < grace_s)
		usleep(20 * 1000);
	while (atomic_load(&s->handshakes) > 0)	/* bounded by their header deadline */
		usleep(20 * 1000);
	if (s->mhd)
		MHD_stop_daemon(s->mhd);
	atomic_store(&s->stopping, true);
	if (s->watching)
		pthread_join(s->watch_thread, NULL);
	if (fd != MHD_INVALID_SOCKET) {
		close(fd);
		s->unix_fd = -1;
	}
	if (s->opts.unix_path && s->mhd)
		unlink(s->opts.unix_path);
	server_free(s);
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
	pthread_mutex_lock(&s->lock);
	buf_appendf(out, "# TYPE kiln_http_connections gauge\nkiln_http_connections %u\n", s->nconns);
	pthread_mutex_unlock(&s->lock);
	buf_appends(out, "# HELP kiln_http_connections_refused_total Connections refused, by limit.\n"
			 "# TYPE kiln_http_connections_refused_total counter\n");
	buf_appendf(out, "kiln_http_connections_refused_total{limit=\"per_addr\"} %llu\n",
		    atomic_load(&s->refused_addr));
	buf_appendf(out, "kiln_http_connections_refused_total{limit=\"total\"} %llu\n",
		    atomic_load(&s->refused_full));
	buf_appends(out, "# HELP kiln_http_timeouts_total Connections closed past a deadline.\n"
			 "# TYPE kiln_http_timeouts_total counter\n");
	buf_appendf(out, "kiln_http_timeouts_total{phase=\"headers\"} %llu\n",
		    atomic_load(&s->timed_out_headers));
	buf_appendf(out, "kiln_http_timeouts_total{phase=\"body\"} %llu\n",
		    atomic_load(&s->timed_out_body));
}
