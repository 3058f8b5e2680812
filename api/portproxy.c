/*
 * portproxy.c - the gateway's port URL listener (config ports_listen; docs/ports.md): servers in
 * sandboxes at http://{port}-{id}.{ports_domain}, on origins of their own. This listener serves
 * nothing else (no API, no dashboard), and the API's listener serves no port.
 *
 * Each connection carries one request. Its head is read (at most HEAD_MAX bytes within
 * http_header_timeout_s), its Host names the sandbox and the port, and its access is checked:
 *   - a credential of the sandbox's tenant in Authorization or X-API-Key (another tenant's: 404);
 *   - else a public port (sandbox_ports, migration 0016) answers anyone;
 *   - else the cookie a signed URL set (kiln_port, bound to the origin by its MAC; expired or
 *     forged: 403); a request carrying the signature itself (?kiln_sig=) gets the cookie and a
 *     302 to the same URL without it;
 *   - else 401.
 * Then a stream to the guest's 127.0.0.1:port is opened through the sandbox's node (ports.c,
 * node/ports.c) and the request goes on with Kiln's credentials taken out (Authorization,
 * X-API-Key and the kiln_* cookies) and `Connection: close`; its body follows as it comes,
 * framed by Content-Length or chunked, and nothing past it (a pipelined request carries its own
 * credentials and is never forwarded). The guest's answer goes back byte for byte until the guest
 * closes, so chunked and streamed replies arrive as written. A request asking for an upgrade
 * (WebSocket) keeps its Connection and Upgrade headers, and after it the connection carries raw
 * bytes both ways until each side ended.
 *
 * Limits: ports_max_connections connections at once (more: 503), port_streams_max_per_tenant
 * streams per tenant (shared with the API's connect route; more: 429) and the node's
 * port_streams_max_per_sandbox. An idle connection (http_timeout_s without a byte either way) is
 * closed, except an upgraded one.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "api/ports.h"
#include "auth/crypto.h"
#include "auth/scopes.h"
#include "common/clock.h"
#include "common/log.h"

#define HEAD_MAX 16384		/* bytes of a request's head */
#define HEADERS_MAX 100		/* header lines of a request */
#define COPY_CHUNK 65536
#define LINGER_MS 2000		/* reading what a client still sends, after the reply */

struct pconn {
	struct pconn *next, *prev;
	int fd;			/* the client's socket */
	int node;		/* the node's stream once open, else -1 */
	char client[64];
};

static struct {
	struct gateway *gw;
	int lfd;
	unsigned port;
	pthread_t accept_thread;
	bool started, stopping;
	pthread_mutex_t lock;
	pthread_cond_t idle;	/* signalled when a connection ends */
	struct pconn *conns;
	long long n;
	unsigned char key[PORTURL_KEY_LEN];
} px = { .lfd = -1, .lock = PTHREAD_MUTEX_INITIALIZER, .idle = PTHREAD_COND_INITIALIZER };

const unsigned char *portproxy_key(void)
{
	return px.key;
}

void portproxy_url(const char *id, long port, char *out, size_t cap)
{
	const char *domain = px.gw ? px.gw->cfg.ports_domain : "localhost";
	size_t dl = strlen(domain);

	if (dl && domain[dl - 1] == '.')
		dl--;
	snprintf(out, cap, "http://%ld-%s.%.*s:%u", port, strncmp(id, "sb_", 3) ? id : id + 3,
		 (int)dl, domain, px.port);
}

static int write_all(int fd, const void *p, size_t len)
{
	const char *c = p;

	while (len > 0) {
		ssize_t k = send(fd, c, len, MSG_NOSIGNAL);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		c += k;
		len -= (size_t)k;
	}
	return 0;
}

/* Sets how long a read may wait on `fd` (0: for ever). */
static void read_timeout(int fd, long long s)
{
	struct timeval tv = { .tv_sec = (time_t)s };

	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

static const char *reason(int status)
{
	switch (status) {
	case 400: return "Bad Request";
	case 401: return "Unauthorized";
	case 403: return "Forbidden";
	case 404: return "Not Found";
	case 409: return "Conflict";
	case 413: return "Content Too Large";
	case 422: return "Unprocessable Entity";
	case 429: return "Too Many Requests";
	case 501: return "Not Implemented";
	case 502: return "Bad Gateway";
	case 503: return "Service Unavailable";
	case 504: return "Gateway Timeout";
	default: return "Error";
	}
}

/* A reply of the listener's own: the error model of docs/errors.md, and the connection closes. */
static void reply_error(int fd, enum kiln_err code, const char *request_id, const char *extra,
			const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void reply_error(int fd, enum kiln_err code, const char *request_id, const char *extra,
			const char *fmt, ...)
{
	char msg[KILN_ERRMSG_MAX], head[1024];
	json_t *body;
	char *text;
	va_list ap;
	int status = kiln_err_status(code);

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	body = json_pack("{s:{s:s, s:s, s:s}}", "error", "code", kiln_err_api_code(code), "message",
			 msg, "request_id", request_id);
	text = body ? json_dumps(body, JSON_COMPACT) : NULL;
	json_decref(body);
	snprintf(head, sizeof(head),
		 "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
		 "X-Request-Id: %s\r\nCache-Control: no-store\r\nConnection: close\r\n%s\r\n",
		 status, reason(status), text ? strlen(text) : 0, request_id, extra ? extra : "");
	if (write_all(fd, head, strlen(head)) == 0 && text)
		write_all(fd, text, strlen(text));
	free(text);
}

/* A node's non-101 answer passed on: its status, Retry-After and JSON body. */
static void reply_node(int fd, const struct port_node *pn, const char *request_id)
{
	char head[512], retry[24], extra[64] = "";

	if (port_head_value(pn->buf, "Retry-After", retry, sizeof(retry)))
		snprintf(extra, sizeof(extra), "Retry-After: %s\r\n", retry);
	snprintf(head, sizeof(head),
		 "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
		 "X-Request-Id: %s\r\nCache-Control: no-store\r\nConnection: close\r\n%s\r\n",
		 pn->status, reason(pn->status),
		 pn->have - pn->head_len, request_id, extra);
	if (write_all(fd, head, strlen(head)) == 0)
		write_all(fd, pn->buf + pn->head_len, pn->have - pn->head_len);
}

struct header {
	const char *name, *value;
	size_t nlen, vlen;
};

/* The request's head, parsed in place. */
struct request {
	char *method, *target, *version;
	struct header h[HEADERS_MAX];
	int nh;
};

/* Splits the head (NUL-terminated, without its final CRLF CRLF) into `r`; false when malformed. */
static bool head_parse(char *head, struct request *r)
{
	char *line = head, *eol = strstr(head, "\r\n");

	if (eol)
		*eol = '\0';
	r->method = line;
	r->target = strchr(line, ' ');
	if (!r->target)
		return false;
	*r->target++ = '\0';
	r->version = strchr(r->target, ' ');
	if (!r->version)
		return false;
	*r->version++ = '\0';
	if ((strcmp(r->version, "HTTP/1.1") && strcmp(r->version, "HTTP/1.0")) || !*r->method ||
	    r->target[0] != '/')
		return false;
	for (const char *c = r->method; *c; c++)
		if (*c < 'A' || *c > 'Z')
			return false;
	for (const unsigned char *c = (const unsigned char *)r->target; *c; c++)
		if (*c <= ' ' || *c == 127)
			return false;	/* no control byte (a bare LF) ever reaches a reply or a guest */
	r->nh = 0;
	while (eol) {
		char *colon;

		line = eol + 2;
		eol = strstr(line, "\r\n");
		if (eol)
			*eol = '\0';
		if (!*line)
			continue;
		if (r->nh == HEADERS_MAX || *line == ' ' || *line == '\t')
			return false;	/* too many, or an obsolete folded line */
		colon = strchr(line, ':');
		if (!colon || colon == line)
			return false;
		for (const char *c = line; c < colon; c++)
			if (*c <= ' ' || *c >= 127)
				return false;
		struct header *h = &r->h[r->nh++];
		char *v = colon + 1, *e;

		h->name = line;
		h->nlen = (size_t)(colon - line);
		while (*v == ' ' || *v == '\t')
			v++;
		for (const unsigned char *c = (const unsigned char *)v; *c; c++)
			if ((*c < ' ' && *c != '\t') || *c == 127)
				return false;
		e = v + strlen(v);
		while (e > v && (e[-1] == ' ' || e[-1] == '\t'))
			e--;
		*e = '\0';
		h->value = v;
		h->vlen = (size_t)(e - v);
	}
	return true;
}

static bool is(const struct header *h, const char *name)
{
	return strlen(name) == h->nlen && strncasecmp(h->name, name, h->nlen) == 0;
}

/* The only header `name`: 1 and *out; 0 when absent; -1 when there are several. */
static int header_one(const struct request *r, const char *name, const char **out)
{
	int n = 0;

	for (int i = 0; i < r->nh; i++)
		if (is(&r->h[i], name)) {
			*out = r->h[i].value;
			n++;
		}
	return n > 1 ? -1 : n;
}

/* Whether a comma-separated header value holds `token` (case-insensitive). */
static bool has_token(const char *value, const char *token)
{
	size_t tl = strlen(token);

	for (const char *p = value; p && *p;) {
		while (*p == ' ' || *p == '\t' || *p == ',')
			p++;
		size_t n = strcspn(p, ",");
		size_t m = n;

		while (m > 0 && (p[m - 1] == ' ' || p[m - 1] == '\t'))
			m--;
		if (m == tl && strncasecmp(p, token, tl) == 0)
			return true;
		p += n;
	}
	return false;
}

/* What the sandbox row says. */
struct target {
	bool found;
	char tenant[AUTH_CLAIM_MAX];
	char state[16];
	char address[256];
	bool public;
	bool auto_resume;	/* a request resumes it while paused */
};

static enum kiln_err target_load(const char *id, long port, struct target *t)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char ptext[8];
	enum kiln_err rc;

	memset(t, 0, sizeof(*t));
	snprintf(ptext, sizeof(ptext), "%ld", port);
	if (pg_acquire(px.gw->pg, &c, &err) != KILN_OK)
		return KILN_E_UNAVAILABLE;
	rc = PGQ(c, &res, &err,
		 "SELECT s.tenant_id, s.state, coalesce(n.address, ''), EXISTS (SELECT 1 FROM "
		 "sandbox_ports p WHERE p.sandbox_id = s.id AND p.port = $2::int AND p.public), "
		 "coalesce((SELECT auto_resume FROM sandbox_settings WHERE sandbox_id = s.id), false) "
		 "FROM sandboxes s LEFT JOIN nodes n ON n.id = s.node_id "
		 "WHERE s.id = $1 AND s.deleted_at IS NULL",
		 id, ptext);
	pg_release(px.gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) == 1) {
		t->found = true;
		snprintf(t->tenant, sizeof(t->tenant), "%s", pg_res_str(res, 0, 0));
		snprintf(t->state, sizeof(t->state), "%s", pg_res_str(res, 0, 1));
		snprintf(t->address, sizeof(t->address), "%s", pg_res_str(res, 0, 2));
		t->public = pg_res_bool(res, 0, 3);
		t->auto_resume = pg_res_bool(res, 0, 4);
	}
	pg_res_free(res);
	return rc == KILN_OK ? KILN_OK : KILN_E_UNAVAILABLE;
}

/*
 * Writes the request's head as the guest gets it: Kiln's credentials out, `Connection: close`
 * unless it is an upgrade. Returns 0 or -1.
 */
static int head_forward(int node, const struct request *r, bool upgrade)
{
	struct buf b;
	int rc = 0;

	buf_init(&b, HEAD_MAX * 3);	/* a Cookie may double ("a;b" becomes "a; b") */
	rc |= buf_appendf(&b, "%s %s %s\r\n", r->method, r->target, r->version);
	for (int i = 0; i < r->nh; i++) {
		const struct header *h = &r->h[i];

		if (is(h, "Authorization") || is(h, "X-API-Key"))
			continue;
		if (!upgrade && (is(h, "Connection") || is(h, "Keep-Alive") ||
				 is(h, "Proxy-Connection") || is(h, "Upgrade")))
			continue;
		if (is(h, "Cookie")) {
			char *kept = malloc(2 * h->vlen + 1);	/* "a;b" becomes "a; b" */

			if (!kept || !porturl_cookie_strip(h->value, kept, 2 * h->vlen + 1)) {
				free(kept);
				rc = -1;
				break;
			}
			if (*kept)
				rc |= buf_appendf(&b, "Cookie: %s\r\n", kept);
			free(kept);
			continue;
		}
		rc |= buf_appendf(&b, "%.*s: %.*s\r\n", (int)h->nlen, h->name, (int)h->vlen,
				  h->value);
	}
	if (!upgrade)
		rc |= buf_appends(&b, "Connection: close\r\n");
	rc |= buf_appends(&b, "\r\n");
	if (rc == 0)
		rc = write_all(node, b.data, b.len);
	buf_release(&b);
	return rc ? -1 : 0;
}

struct downstream {
	int node, client;
	bool upgrade;
	volatile bool body_done;	/* the request's body went whole to the guest */
};

/*
 * The guest's answer to the client, byte for byte until the guest closes (or, unless upgraded, an
 * idle read times out); then the client's side ends.
 */
static void *downstream_main(void *arg)
{
	struct downstream *d = arg;
	char *buf = malloc(COPY_CHUNK);
	ssize_t k = -1;

	while (buf) {
		k = read(d->node, buf, COPY_CHUNK);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0 || write_all(d->client, buf, (size_t)k) < 0)
			break;
	}
	free(buf);
	if (k == 0 && d->upgrade) {
		shutdown(d->client, SHUT_WR);
	} else {
		/*
		 * The reply is whole (or broken): no more of the request is wanted either. A body
		 * still coming is cut (its reader woken); after a whole one the client gets a moment
		 * to read the reply before the close (linger_close).
		 */
		shutdown(d->client, SHUT_WR);
		if (!d->body_done)
			shutdown(d->client, SHUT_RD);
		shutdown(d->node, SHUT_RDWR);
	}
	return NULL;
}

/*
 * Forwards the request's body from the client to the node: `early` (bytes read past the head)
 * first, then what the client sends, up to the end of the body (`length` bytes, or the chunked
 * framing's end; everything for an upgrade). Returns 0 at the body's end, -1 when either side
 * failed or the framing is malformed.
 */
static int upstream(int client, int node, const char *early, size_t early_len, bool chunked,
		    unsigned long long length, bool upgrade)
{
	struct porturl_chunked ch = { 0 };
	char *buf = malloc(COPY_CHUNK);
	const char *data = early;
	size_t len = early_len;
	int rc = -1;

	if (!buf)
		return -1;
	for (;;) {
		if (len > 0) {
			size_t take = len;

			if (upgrade) {
				;
			} else if (chunked) {
				ssize_t k = porturl_chunked_scan(&ch, data, len);

				if (k < 0)
					break;
				take = (size_t)k;
			} else if (take > length) {
				take = (size_t)length;
			}
			if (take && write_all(node, data, take) < 0)
				break;
			if (!upgrade && !chunked)
				length -= take;
		}
		if (!upgrade && (chunked ? ch.done : length == 0)) {
			rc = 0;
			break;
		}
		ssize_t k = read(client, buf, COPY_CHUNK);

		if (k < 0 && errno == EINTR) {
			len = 0;
			continue;
		}
		if (k <= 0) {
			if (k == 0 && upgrade) {
				shutdown(node, SHUT_WR);	/* the client's end, passed on */
				rc = 0;
			}
			break;
		}
		data = buf;
		len = (size_t)k;
	}
	free(buf);
	return rc;
}

/*
 * Ends our side and reads and drops what the client still sends for a moment (LINGER_MS at most,
 * less when it closes), so that closing does not reset a reply it has not read yet.
 */
static void linger_close(int fd)
{
	char buf[4096];
	long long until = clock_mono_ms() + LINGER_MS;

	shutdown(fd, SHUT_WR);
	for (;;) {
		struct pollfd p = { fd, POLLIN, 0 };
		long long left = until - clock_mono_ms();

		if (left <= 0 || poll(&p, 1, (int)left) != 1 || read(fd, buf, sizeof(buf)) <= 0)
			break;
	}
}

#define WAKE_BODY_MAX 4096
#define WAKE_RUNNING_MS 120000	/* how long a resumed sandbox may take to show as running */
#define WAKE_LISTEN_RETRY_MS 200

struct wake_body {
	char data[WAKE_BODY_MAX + 1];
	size_t len;
};

static size_t wake_write(char *p, size_t size, size_t n, void *arg)
{
	struct wake_body *b = arg;
	size_t k = size * n, room = WAKE_BODY_MAX - b->len;

	memcpy(b->data + b->len, p, k < room ? k : room);
	b->len += k < room ? k : room;
	b->data[b->len] = '\0';
	return k;
}

/*
 * Resumes the paused sandbox `id` for `who` through this gateway's own API (POST
 * /v1/sandboxes/{id}/resume under a one-minute token of the tenant's): the same admission (402
 * at zero credits, plan limits), placement and audit as the tenant's own call. Returns true when
 * it was resumed (or is being resumed by another request: 409); otherwise replies with the API's
 * answer and returns false.
 */
static bool wake(int fd, const struct principal *who, const char *id, const char *rid)
{
	struct gateway *gw = px.gw;
	char sub[AUTH_CLAIM_MAX], url[512], host[256], hdr[1200], hrid[64];
	struct auth_token_params tp = {
		.iss = GW_ISSUER, .aud = AUTH_AUD_API, .sub = sub, .tid = who->tenant_id,
		.scopes = AUTH_SCOPE_SANDBOX_WRITE, .now = time(NULL), .ttl_s = 60,
	};
	struct kiln_error err = { 0 };
	struct wake_body *b = calloc(1, sizeof(*b));
	struct curl_slist *h = NULL;
	char *token = NULL, *colon;
	long status = 0;
	CURL *cu = NULL;
	bool ok = false;

	/* the caller's own key, or for a public or signed request one of the sandbox's own */
	if (strncmp(who->key_id, "key_", 4) == 0)
		snprintf(sub, sizeof(sub), "%s", who->key_id);
	else
		snprintf(sub, sizeof(sub), "port_url_%s", id);
	if (!b || signing_sign(gw->signing, &tp, &token, NULL, &err) != KILN_OK) {
		reply_error(fd, KILN_E_INTERNAL, rid, NULL, "cannot resume the sandbox");
		goto out;
	}
	snprintf(host, sizeof(host), "%s", gw->cfg.listen);
	colon = strrchr(host, ':');
	if (colon)
		*colon = '\0';
	if (!host[0] || !strcmp(host, "0.0.0.0"))
		snprintf(host, sizeof(host), "127.0.0.1");
	else if (!strcmp(host, "[::]") || !strcmp(host, "::"))
		snprintf(host, sizeof(host), "[::1]");
	snprintf(url, sizeof(url), "http://%s:%u/v1/sandboxes/%s/resume", host,
		 http_server_port(gw->http), id);
	snprintf(hdr, sizeof(hdr), "Authorization: Bearer %s", token);
	snprintf(hrid, sizeof(hrid), "X-Request-Id: %s", rid);
	cu = curl_easy_init();
	if (cu)
		h = curl_slist_append(curl_slist_append(h, hdr), hrid);
	if (!cu || !h) {
		reply_error(fd, KILN_E_NOMEM, rid, NULL, "out of memory");
		goto out;
	}
	curl_easy_setopt(cu, CURLOPT_URL, url);
	curl_easy_setopt(cu, CURLOPT_POST, 1L);
	curl_easy_setopt(cu, CURLOPT_POSTFIELDS, "");
	curl_easy_setopt(cu, CURLOPT_HTTPHEADER, h);
	curl_easy_setopt(cu, CURLOPT_WRITEFUNCTION, wake_write);
	curl_easy_setopt(cu, CURLOPT_WRITEDATA, b);
	curl_easy_setopt(cu, CURLOPT_TIMEOUT, 600L);
	curl_easy_setopt(cu, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(cu, CURLOPT_PROTOCOLS_STR, "http");
	if (curl_easy_perform(cu) != CURLE_OK ||
	    curl_easy_getinfo(cu, CURLINFO_RESPONSE_CODE, &status) != CURLE_OK || !status) {
		reply_error(fd, KILN_E_UNAVAILABLE, rid, NULL, "the sandbox could not be resumed");
		goto out;
	}
	if (status == 200 || status == 409) {
		ok = true;
	} else {
		/* the API's answer as it came: 402 insufficient_credits, 403 quota_exceeded, 503... */
		struct port_node pn = { .fd = -1, .status = (int)status, .buf = b->data,
					.have = b->len, .head_len = 0 };

		log_info("port URL: resuming \"%s\" was answered %ld", id, status);
		reply_node(fd, &pn, rid);
	}
out:
	curl_slist_free_all(h);
	if (cu)
		curl_easy_cleanup(cu);
	if (token) {
		explicit_bzero(token, strlen(token));
		free(token);
	}
	free(b);
	return ok;
}

/* Whether a request without a credential may resume sandbox `id` now (port_public_wakes_per_hour). */
static bool wake_take(const char *id)
{
	struct rl_result rl;
	char bucket[128];
	long long per = px.gw->cfg.port_public_wakes_per_hour;

	snprintf(bucket, sizeof(bucket), "portwake:%s", id);
	ratelimit_take(px.gw->rl, bucket, per, 3600000, per, &rl);
	return rl.allowed;
}

/* Serves the one request of connection `pc`. */
static void serve(struct pconn *pc)
{
	struct gateway *gw = px.gw;
	char *head = malloc(HEAD_MAX + 1), *end = NULL, rid[48], id[PORTURL_ID_MAX];
	char *target2 = NULL, sig[PORTURL_TOKEN_MAX + 1];
	struct request *r = calloc(1, sizeof(*r));
	struct port_node pn = { .fd = -1 };
	struct principal who = { 0 };
	struct target t;
	struct kiln_error err = { 0 };
	const char *host = NULL, *te = NULL, *cl = NULL, *authz = NULL, *xkey = NULL, *up = NULL,
		   *conn = NULL;
	size_t have = 0;
	long port = 0;
	long long hto = gw->cfg.http_header_timeout_s ? gw->cfg.http_header_timeout_s : 10;
	long long deadline = clock_mono_ms() + hto * 1000;
	unsigned long long length = 0;
	bool taken = false, upgrade = false, chunked = false;
	unsigned long long ticket = 0;	/* the count of port_streams_max_per_tenant taken */
	unsigned char rnd[8];

	if (getrandom(rnd, sizeof(rnd), 0) != sizeof(rnd))
		memset(rnd, 0, sizeof(rnd));
	snprintf(rid, sizeof(rid), "req_p%02x%02x%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2],
		 rnd[3], rnd[4], rnd[5], rnd[6], rnd[7]);
	if (!head || !r)
		goto out;
	/* The head, within the header timeout. */
	while (!end) {
		struct pollfd p = { pc->fd, POLLIN, 0 };
		long long left = deadline - clock_mono_ms();
		ssize_t k;

		if (have == HEAD_MAX) {
			reply_error(pc->fd, KILN_E_TOO_LARGE, rid, NULL,
				    "the request's head is over %d bytes", HEAD_MAX);
			goto out;
		}
		if (left <= 0 || poll(&p, 1, (int)left) != 1)
			goto out;	/* too slow: closed without a word, as the API's listener does */
		k = read(pc->fd, head + have, HEAD_MAX - have);
		if (k <= 0)
			goto out;
		have += (size_t)k;
		head[have] = '\0';
		end = strstr(head, "\r\n\r\n");
	}
	size_t head_len = (size_t)(end + 4 - head);

	*end = '\0';
	if (memchr(head, '\0', (size_t)(end - head)) || !head_parse(head, r)) {
		reply_error(pc->fd, KILN_E_BAD_REQUEST, rid, NULL, "malformed request");
		goto out;
	}
	if (header_one(r, "Host", &host) != 1 || header_one(r, "Content-Length", &cl) < 0 ||
	    header_one(r, "Transfer-Encoding", &te) < 0 || header_one(r, "Authorization", &authz) < 0 ||
	    header_one(r, "X-API-Key", &xkey) < 0 || header_one(r, "Upgrade", &up) < 0 ||
	    header_one(r, "Connection", &conn) < 0) {
		reply_error(pc->fd, KILN_E_BAD_REQUEST, rid, NULL,
			    "a request needs one Host and at most one of each of Content-Length, "
			    "Transfer-Encoding, Authorization, X-API-Key, Upgrade and Connection");
		goto out;
	}
	if (te && cl) {
		reply_error(pc->fd, KILN_E_BAD_REQUEST, rid, NULL,
			    "Content-Length and Transfer-Encoding together");
		goto out;
	}
	if (te) {
		if (strcasecmp(te, "chunked") != 0) {
			reply_error(pc->fd, KILN_E_BAD_REQUEST, rid, NULL,
				    "Transfer-Encoding must be chunked");
			goto out;
		}
		chunked = true;
	}
	if (cl) {
		char *e;

		errno = 0;
		length = strtoull(cl, &e, 10);
		if (!*cl || *e || errno || cl[0] == '-' || cl[0] == '+') {
			reply_error(pc->fd, KILN_E_BAD_REQUEST, rid, NULL, "malformed Content-Length");
			goto out;
		}
	}
	upgrade = up && conn && has_token(conn, "upgrade");
	if (!porturl_host_parse(host, gw->cfg.ports_domain, &port, id, sizeof(id))) {
		reply_error(pc->fd, KILN_E_NOT_FOUND, rid, NULL,
			    "this listener serves port URLs {port}-{sandbox id}.%s only",
			    gw->cfg.ports_domain);
		goto out;
	}
	/* A signed URL: its cookie for this origin, and the same URL without the signature. */
	target2 = malloc(strlen(r->target) + 1);
	if (!target2)
		goto out;
	if (porturl_query_take(r->target, PORTURL_QUERY, target2, sig, sizeof(sig))) {
		enum porturl_verdict v = porturl_verify(px.key, id, port, sig, strlen(sig),
							(long long)time(NULL));

		if (v != PORTURL_OK) {
			reply_error(pc->fd, KILN_E_FORBIDDEN, rid, NULL, "%s",
				    v == PORTURL_EXPIRED ? "the signed URL has expired"
							 : "the signed URL is not valid");
			goto out;
		}
		long long age = atoll(sig) - (long long)time(NULL);

		char *reply = NULL;
		int n = asprintf(&reply,
				 "HTTP/1.1 302 Found\r\nX-Request-Id: %s\r\nLocation: %s\r\n"
				 "Set-Cookie: %s=%s; Path=/; Max-Age=%lld; HttpOnly; SameSite=Lax\r\n"
				 "Content-Length: 0\r\nCache-Control: no-store\r\n"
				 "Referrer-Policy: no-referrer\r\nConnection: close\r\n\r\n",
				 rid, target2, PORTURL_COOKIE, sig, age);

		if (n > 0)
			write_all(pc->fd, reply, (size_t)n);
		free(reply);
		goto out;
	}
	if (target_load(id, port, &t) != KILN_OK) {
		reply_error(pc->fd, KILN_E_UNAVAILABLE, rid, NULL, "the database is unavailable");
		goto out;
	}
	if (authz || xkey) {
		char *value = NULL;
		enum kiln_err rc;

		if (!authz && asprintf(&value, "Bearer %s", xkey) < 0)
			goto out;
		rc = gw_authenticate(gw, authz ? authz : value, &who, &err);
		free(value);
		if (rc != KILN_OK) {
			reply_error(pc->fd, rc, rid,
				    rc == KILN_E_UNAUTHENTICATED ? "WWW-Authenticate: Bearer\r\n" : NULL,
				    "%s", rc == KILN_E_UNAVAILABLE ? "the database is unavailable" : err.msg);
			goto out;
		}
		if (!t.found || strcmp(t.tenant, who.tenant_id) != 0) {
			reply_error(pc->fd, KILN_E_NOT_FOUND, rid, NULL, "no sandbox \"%s\"", id);
			goto out;
		}
		if (!auth_scopes_has(who.scopes, AUTH_SCOPE_SANDBOX_WRITE)) {
			reply_error(pc->fd, KILN_E_FORBIDDEN, rid, NULL,
				    "a port URL needs the scope \"sandbox:write\"");
			goto out;
		}
	} else if (t.found && t.public) {
		snprintf(who.tenant_id, sizeof(who.tenant_id), "%s", t.tenant);
		snprintf(who.key_id, sizeof(who.key_id), "public");
		who.scopes = AUTH_SCOPE_SANDBOX_WRITE;
	} else {
		enum porturl_verdict v = PORTURL_NONE;
		long long now = (long long)time(NULL);

		for (int i = 0; i < r->nh; i++)
			if (is(&r->h[i], "Cookie"))
				porturl_cookie_verify(r->h[i].value, px.key, id, port, now, &v);
		if (v == PORTURL_NONE) {
			reply_error(pc->fd, KILN_E_UNAUTHENTICATED, rid, "WWW-Authenticate: Bearer\r\n",
				    "a port URL needs the tenant's API key or token (Authorization or "
				    "X-API-Key), a signed URL's cookie, or a public port");
			goto out;
		}
		if (v != PORTURL_OK) {
			reply_error(pc->fd, KILN_E_FORBIDDEN, rid, NULL, "%s",
				    v == PORTURL_EXPIRED ? "the signed URL's cookie has expired"
							 : "the signed URL's cookie is not valid");
			goto out;
		}
		if (!t.found) {
			reply_error(pc->fd, KILN_E_NOT_FOUND, rid, NULL, "no sandbox \"%s\"", id);
			goto out;
		}
		snprintf(who.tenant_id, sizeof(who.tenant_id), "%s", t.tenant);
		snprintf(who.key_id, sizeof(who.key_id), "signed_url");
		who.scopes = AUTH_SCOPE_SANDBOX_WRITE;
	}
	bool woke = false;

	if (!strcmp(t.state, "paused") && t.auto_resume) {
		/* auto_resume: the request resumes it and waits for it (docs/ports.md) */
		if (!strcmp(who.key_id, "public") && !wake_take(id)) {
			reply_error(pc->fd, KILN_E_RATE_LIMITED, rid, "Retry-After: 60\r\n",
				    "requests without a credential resumed this sandbox too often: "
				    "port_public_wakes_per_hour is %lld",
				    gw->cfg.port_public_wakes_per_hour);
			goto out;
		}
		if (!wake(pc->fd, &who, id, rid))
			goto out;
		woke = true;
		for (long long until = clock_mono_ms() + WAKE_RUNNING_MS;
		     strcmp(t.state, "running") != 0 && clock_mono_ms() < until;) {
			usleep(250000);
			if (target_load(id, port, &t) != KILN_OK || !t.found)
				break;
		}
	}
	if (strcmp(t.state, "running") != 0) {
		reply_error(pc->fd, KILN_E_CONFLICT, rid, NULL, "the sandbox is %s", t.state);
		goto out;
	}
	if (!port_tenant_take(who.tenant_id, gw->cfg.port_streams_max_per_tenant, &ticket)) {
		reply_error(pc->fd, KILN_E_RATE_LIMITED, rid, "Retry-After: 1\r\n",
			    "too many port streams at once: port_streams_max_per_tenant is %lld",
			    gw->cfg.port_streams_max_per_tenant);
		goto out;
	}
	taken = true;
	enum kiln_err rc = port_node_open(gw, &who, id, t.address, port, rid, &pn);

	/* Just resumed: the request waits for the guest's server to listen again. */
	for (long long until = clock_mono_ms() + gw->cfg.port_connect_timeout_ms;
	     woke && rc == KILN_OK && pn.status == 502 && clock_mono_ms() < until &&
	     strstr(pn.buf + pn.head_len, "\"port_closed\"");) {
		port_node_free(&pn);
		usleep(WAKE_LISTEN_RETRY_MS * 1000);
		rc = port_node_open(gw, &who, id, t.address, port, rid, &pn);
	}

	if (rc != KILN_OK) {
		reply_error(pc->fd, rc, rid, NULL, "%s",
			    rc == KILN_E_UNAVAILABLE ? "the sandbox's node cannot be reached"
						     : "cannot open the stream");
		goto out;
	}
	if (pn.status != 101) {
		reply_node(pc->fd, &pn, rid);
		goto out;
	}
	pthread_mutex_lock(&px.lock);
	pc->node = pn.fd;
	bool stopping = px.stopping;
	pthread_mutex_unlock(&px.lock);
	if (stopping)
		goto out;
	/* The stream is open: the request as the guest gets it, then its body and the answer. */
	struct downstream d = { pn.fd, pc->fd, upgrade, false };
	pthread_t down;

	if (head_forward(pn.fd, r, upgrade) < 0)
		goto out;
	if (pn.have > pn.head_len && write_all(pc->fd, pn.buf + pn.head_len,
					       pn.have - pn.head_len) < 0)
		goto out;
	read_timeout(pc->fd, upgrade ? 0 : gw->cfg.http_timeout_s);
	read_timeout(pn.fd, upgrade ? 0 : gw->cfg.http_timeout_s);
	if (pthread_create(&down, NULL, downstream_main, &d) != 0)
		goto out;
	if (upstream(pc->fd, pn.fd, head + head_len, have - head_len, chunked, length, upgrade) == 0)
		d.body_done = true;
	else if (!upgrade)
		shutdown(pn.fd, SHUT_RDWR);	/* a broken body: the guest sees the stream reset */
	pthread_join(down, NULL);
out:
	if (taken)
		port_tenant_give(who.tenant_id, ticket);
	pthread_mutex_lock(&px.lock);
	pc->node = -1;
	pthread_mutex_unlock(&px.lock);
	port_node_free(&pn);
	free(target2);
	free(head);
	free(r);
}

static void *conn_main(void *arg)
{
	struct pconn *pc = arg;

	serve(pc);
	/* after the stream and the tenant's count were given back: the client's moment to read */
	linger_close(pc->fd);
	pthread_mutex_lock(&px.lock);
	if (pc->prev)
		pc->prev->next = pc->next;
	else
		px.conns = pc->next;
	if (pc->next)
		pc->next->prev = pc->prev;
	px.n--;
	pthread_cond_broadcast(&px.idle);
	pthread_mutex_unlock(&px.lock);
	close(pc->fd);
	free(pc);
	return NULL;
}

static void *accept_main(void *arg)
{
	(void)arg;
	for (;;) {
		int fd = accept4(px.lfd, NULL, NULL, SOCK_CLOEXEC);
		struct pconn *pc;
		pthread_t t;
		pthread_attr_t a;

		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
				usleep(100000);
				continue;
			}
			break;	/* the listener was shut down */
		}
		pthread_mutex_lock(&px.lock);
		bool full = px.n >= px.gw->cfg.ports_max_connections || px.stopping;

		if (!full)
			px.n++;
		pthread_mutex_unlock(&px.lock);
		if (full) {
			reply_error(fd, KILN_E_UNAVAILABLE, "-", "Retry-After: 1\r\n",
				    "the port URL listener holds ports_max_connections (%lld) "
				    "connections",
				    px.gw->cfg.ports_max_connections);
			close(fd);
			continue;
		}
		read_timeout(fd, px.gw->cfg.http_timeout_s);
		pc = calloc(1, sizeof(*pc));
		if (pc) {
			pc->fd = fd;
			pc->node = -1;
			pthread_mutex_lock(&px.lock);
			pc->next = px.conns;
			if (px.conns)
				px.conns->prev = pc;
			px.conns = pc;
			pthread_mutex_unlock(&px.lock);
			pthread_attr_init(&a);
			pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
			if (pthread_create(&t, &a, conn_main, pc) == 0) {
				pthread_attr_destroy(&a);
				continue;
			}
			pthread_attr_destroy(&a);
			pthread_mutex_lock(&px.lock);
			px.conns = pc->next;
			if (pc->next)
				pc->next->prev = NULL;
			pthread_mutex_unlock(&px.lock);
			free(pc);
		}
		pthread_mutex_lock(&px.lock);
		px.n--;
		pthread_mutex_unlock(&px.lock);
		close(fd);
	}
	return NULL;
}

enum kiln_err portproxy_start(struct gateway *gw, struct kiln_error *err)
{
	char host[256], *colon;
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, *ai = NULL;
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	int one = 1;

	px.gw = gw;
	px.stopping = false;
	if (auth_master_derive(&gw->mk, "port-url-signing", px.key, sizeof(px.key), err) != KILN_OK)
		return err->code;
	snprintf(host, sizeof(host), "%s", gw->cfg.ports_listen);
	colon = strrchr(host, ':');
	if (!colon)
		return kiln_error_set(err, KILN_E_INVALID,
				      "setting \"ports_listen\": \"%s\" is not host:port",
				      gw->cfg.ports_listen);
	*colon = '\0';
	if (host[0] == '[' && colon[-1] == ']') {
		colon[-1] = '\0';
		memmove(host, host + 1, strlen(host));
	}
	if (getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &ai) != 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "setting \"ports_listen\": cannot resolve \"%s\"",
				      gw->cfg.ports_listen);
	px.lfd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (px.lfd >= 0)
		setsockopt(px.lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (px.lfd < 0 || bind(px.lfd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(px.lfd, 512) < 0 ||
	    getsockname(px.lfd, (struct sockaddr *)&ss, &sl) < 0) {
		int e = errno;

		freeaddrinfo(ai);
		if (px.lfd >= 0)
			close(px.lfd);
		px.lfd = -1;
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "cannot listen on \"%s\": %s",
				      gw->cfg.ports_listen, strerror(e));
	}
	freeaddrinfo(ai);
	px.port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
						  : ((struct sockaddr_in *)&ss)->sin_port);
	if (pthread_create(&px.accept_thread, NULL, accept_main, NULL) != 0) {
		close(px.lfd);
		px.lfd = -1;
		return kiln_error_set(err, KILN_E_INTERNAL, "cannot start the port URL listener");
	}
	px.started = true;
	int rc = port_counts_attach(gw->rds);

	if (rc != 0)	/* the streams are counted on this gateway alone */
		log_warn("port streams: cannot count them in redis: %s", strerror(-rc));
	log_info("port URLs: listening on \"%s\" for {port}-{id}.%s", gw->cfg.ports_listen,
		 gw->cfg.ports_domain);
	return KILN_OK;
}

void portproxy_stop(void)
{
	port_counts_detach();	/* the API's streams still ending are given back here alone */
	if (!px.started)
		return;
	shutdown(px.lfd, SHUT_RDWR);
	pthread_join(px.accept_thread, NULL);
	close(px.lfd);
	px.lfd = -1;
	/* Ends every connection and waits for their threads: they use the gateway's pools. */
	pthread_mutex_lock(&px.lock);
	px.stopping = true;
	for (struct pconn *pc = px.conns; pc; pc = pc->next) {
		shutdown(pc->fd, SHUT_RDWR);
		if (pc->node >= 0)
			shutdown(pc->node, SHUT_RDWR);
	}
	while (px.n > 0)
		pthread_cond_wait(&px.idle, &px.lock);
	pthread_mutex_unlock(&px.lock);
	px.started = false;
	OPENSSL_cleanse(px.key, sizeof(px.key));
}
