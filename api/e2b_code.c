/*
 * e2b_code.c - the E2B data plane's guest ports (docs/e2b.md, "Guest ports and the code
 * interpreter"): a request to E2B_SANDBOX_URL whose E2b-Sandbox-Port is not envd's (49983), or
 * whose Host is `{port}-{id}.{ports_domain}[:port]`, goes to that port of the sandbox's guest
 * through the same stream a port URL uses (api/ports.c port_node_open: the node, then the agent's
 * PORT_OPEN to the guest's 127.0.0.1:port). The code interpreter's `/execute` and `/contexts` (port
 * 49999, vmm/guest/codeint/server.py in the code-interpreter-v1 image) arrive this way.
 *
 * Guards: the sandbox exists and runs (502 otherwise, as E2B's proxy answers), and
 *   - port 49999: `POST /execute` (the only call that runs code, which the SDK sends with
 *     X-Access-Token) needs the sandbox's envdAccessToken; `/contexts` calls (sent without it)
 *     need none, but a token that is sent must be the sandbox's;
 *   - any other port: the envdAccessToken in X-Access-Token or E2B-Traffic-Access-Token.
 * A wrong or missing token is 401 before the sandbox is looked up. The stream counts in
 * port_streams_max_per_tenant of the sandbox's tenant (429 beyond), and the node applies
 * port_streams_max_per_sandbox. Right after a cold boot the code interpreter's worker may still
 * be importing: a closed port 49999 of a code-interpreter-v1 sandbox is retried for
 * E2B_CODE_WAIT_MS.
 *
 * The request (its method, path and query, body, Content-Type and Accept) is sent to the guest
 * as HTTP/1.0 over the node's stream, and the guest's status, Content-Type and body come back
 * as they are produced (a producer thread, common/pump.h), so /execute's NDJSON lines are
 * flushed one by one. WebSocket upgrades are not carried here (the ports listener carries them).
 */
#include <ctype.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "api/apireq.h"
#include "api/e2b.h"
#include "api/ports.h"
#include "auth/scopes.h"
#include "common/http.h"
#include "common/clock.h"
#include "common/buf.h"
#include "common/log.h"
#include "common/pg.h"
#include "common/pump.h"

#define E2B_ENVD_PORT 49983		/* envd's port: served by e2b.c's routes */
#define E2B_CODE_PORT 49999		/* the code interpreter's */
#define E2B_CODE_WAIT_MS 90000		/* a closed 49999 retried this long (a cold boot's imports) */
#define E2B_PORT_TIMEOUT_S 3600		/* a forwarded exchange's whole time */
#define E2B_FWD_ID_MAX 64		/* bytes of a sandbox id */
#define FWD_CHUNK 65536			/* bytes read from the guest at a time; its head at most */
#define FWD_HEAD_MAX 16384		/* bytes of the request's head */

struct fwd {
	struct pump *p;
	int fd;			/* the node's stream to the guest port */
	long port;
	char tenant[AUTH_CLAIM_MAX];	/* its port stream count, given back at the end */
	unsigned long long ticket;	/* that count's ticket (port_tenant_take) */
	char method[16];
	char *target;		/* path and query */
	char *body;
	size_t body_len;
	char ctype[256], accept[256];
	bool ready;		/* pump_ready called */
};

static void fwd_free(void *arg)
{
	struct fwd *f = arg;

	if (f->fd >= 0)
		close(f->fd);
	port_tenant_give(f->tenant, f->ticket);
	free(f->target);
	free(f->body);
	free(f);
}

static int fwd_write_all(int fd, const char *p, size_t n)
{
	while (n) {
		ssize_t k = write(fd, p, n);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

/* Reads what comes within the exchange's time: bytes, 0 at the end, -1 on an error or timeout. */
static ssize_t fwd_read(int fd, char *p, size_t n, long long deadline_ms)
{
	for (;;) {
		struct pollfd pfd = { fd, POLLIN, 0 };
		long long now = clock_mono_ms();
		ssize_t k;

		if (now >= deadline_ms || poll(&pfd, 1, (int)(deadline_ms - now > 60000 ? 60000
										     : deadline_ms - now)) < 0)
			return -1;
		if (!(pfd.revents & (POLLIN | POLLHUP | POLLERR)))
			continue;
		k = read(fd, p, n);
		if (k < 0 && errno == EINTR)
			continue;
		return k;
	}
}

/*
 * The producer: one HTTP/1.0 exchange with the guest's port over the node's stream (1.0, so the
 * answer is never chunked: it ends with the guest's close or its Content-Length), the answer's
 * status and Content-Type, then its body as it comes.
 */
static void fwd_produce(struct pump *p, void *arg)
{
	struct fwd *f = arg;
	struct buf head;
	char *buf = malloc(FWD_CHUNK + 1), *end = NULL;
	size_t have = 0;
	long long deadline, left = -1;
	const char *why = "no answer";
	int status = 0;

	f->p = p;
	deadline = clock_mono_ms() + E2B_PORT_TIMEOUT_S * 1000LL;
	buf_init(&head, FWD_HEAD_MAX);
	if (!buf || buf_appendf(&head, "%s %s HTTP/1.0\r\nHost: 127.0.0.1:%ld\r\nConnection: close\r\n"
				     "Content-Length: %zu\r\n", f->method, f->target, f->port,
			       f->body_len) != 0 ||
	    (f->ctype[0] && buf_appendf(&head, "Content-Type: %s\r\n", f->ctype) != 0) ||
	    (f->accept[0] && buf_appendf(&head, "Accept: %s\r\n", f->accept) != 0) ||
	    buf_append(&head, "\r\n", 2) != 0) {
		why = "out of memory";
		goto fail;
	}
	if (fwd_write_all(f->fd, head.data, head.len) != 0 ||
	    (f->body_len && fwd_write_all(f->fd, f->body, f->body_len) != 0)) {
		why = "the stream was cut";
		goto fail;
	}
	/* the answer's head */
	while (!end && have < FWD_CHUNK) {
		ssize_t k = fwd_read(f->fd, buf + have, FWD_CHUNK - have, deadline);

		if (k <= 0)
			break;
		have += (size_t)k;
		buf[have] = '\0';
		end = strstr(buf, "\r\n\r\n");
	}
	if (!end || sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || status < 100 || status > 599) {
		why = have ? "not an HTTP answer" : "no answer";
		goto fail;
	}
	{
		char type[128] = "application/octet-stream", clen[24];

		*end = '\0';
		port_head_value(buf, "Content-Type", type, sizeof(type));
		if (port_head_value(buf, "Content-Length", clen, sizeof(clen)))
			left = strtoll(clen, NULL, 10);
		f->ready = true;
		pump_ready(p, status, type);
	}
	{
		size_t off = (size_t)(end + 4 - buf), n = have - off;

		for (;;) {
			ssize_t k;

			if (left >= 0 && (long long)n > left)
				n = (size_t)left;
			if (n && pump_write(p, buf + off, n) != 0)
				break;
			if (left >= 0 && (left -= (long long)n) == 0)
				break;
			k = fwd_read(f->fd, buf, FWD_CHUNK, deadline);
			if (k <= 0)
				break;
			off = 0;
			n = (size_t)k;
		}
	}
	goto out;
fail:
	if (!f->ready) {
		char *text;
		json_t *j = json_pack("{s:i, s:s+}", "code", 502, "message",
				      "the guest port did not answer: ", why);

		f->ready = true;
		pump_ready(p, 502, "application/json");
		text = j ? json_dumps(j, JSON_COMPACT) : NULL;
		if (text)
			pump_write(p, text, strlen(text));
		free(text);
		json_decref(j);
	}
out:
	buf_release(&head);
	free(buf);
}

/* E2B's error shape with `status`. */
static void dp_error(struct http_req *req, int status, const char *msg)
{
	http_reply_json(req, status, json_pack("{s:i, s:s}", "code", status, "message", msg));
}

/*
 * The target of a request: E2b-Sandbox-Id and E2b-Sandbox-Port, or a Host `{port}-{id}.{domain}`
 * (the id with or without its "sb_"). False when the request names none (envd's routes answer).
 */
static bool dp_target(struct http_req *req, const char *domain, char *id, size_t idn, long *port)
{
	const char *hid = http_req_header(req, "E2b-Sandbox-Id");
	const char *hport = http_req_header(req, "E2b-Sandbox-Port");
	const char *host = http_req_header(req, "Host");

	if (hid || hport) {
		*port = hport ? http_port_value(hport) : E2B_ENVD_PORT;
		snprintf(id, idn, "%s", hid ? hid : "");
		return true;
	}
	if (host && domain && domain[0]) {
		char h[300];
		const char *sb = strstr(host, "-sb_");

		/* "49999-sb_abc.domain" (E2B's getHost of a Kiln id) as "49999-abc.domain" */
		if (sb && (size_t)(sb - host) <= 5 && strlen(host) < sizeof(h)) {
			snprintf(h, sizeof(h), "%.*s-%s", (int)(sb - host), host, sb + 4);
			host = h;
		}
		return porturl_host_parse(host, domain, port, id, idn);
	}
	return false;
}

bool e2b_port_before(struct http_req *req, const struct http_route *route)
{
	struct gateway *gw = http_req_app(req);
	char id[E2B_FWD_ID_MAX], want[E2B_TOKEN_HEX + 1], state[16] = "", address[256] = "";
	const char *tok = http_req_header(req, "X-Access-Token");
	struct principal who = { 0 };
	struct kiln_error err = { 0 };
	struct pg_conn *c = NULL;
	struct pg_res *r = NULL;
	struct port_node pn = { .fd = -1 };
	struct fwd *f = NULL;
	struct pump *p;
	bool taken = false, need_token, codeint = false;
	unsigned long long ticket = 0;	/* the count of port_streams_max_per_tenant taken */
	long port = -1;
	size_t n, blen = 0;
	const char *body;
	char *qs = NULL;

	(void)route;
	if (!dp_target(req, gw->cfg.ports_domain, id, sizeof(id), &port) || port == E2B_ENVD_PORT)
		return true;	/* envd's (e2b.c checks its headers) */
	n = strlen(id);
	if (n == 0 || n >= sizeof(id) || port < 1) {
		dp_error(req, 400, "missing or malformed E2b-Sandbox-Id or E2b-Sandbox-Port header");
		return false;
	}
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)id[i]) && id[i] != '_' && id[i] != '-') {
			dp_error(req, 400, "missing or malformed E2b-Sandbox-Id header");
			return false;
		}
	if (!tok)
		tok = http_req_header(req, "E2B-Traffic-Access-Token");
	need_token = port != E2B_CODE_PORT || !strcmp(http_req_path(req), "/execute");
	e2b_token_of(id, want);
	if ((tok || need_token) && (!tok || strlen(tok) != E2B_TOKEN_HEX || !want[0] ||
				    CRYPTO_memcmp(tok, want, E2B_TOKEN_HEX) != 0)) {
		dp_error(req, 401, "unauthorized access, please provide a valid access token or "
				   "method signing if supported");
		return false;
	}
	http_req_set_object(req, id);
	if (pg_acquire(gw->pg, &c, &err) != KILN_OK ||
	    PGQ(c, &r, &err,
		"SELECT s.tenant_id, s.state, coalesce(n.address, ''), s.template = $2 FROM sandboxes s "
		"LEFT JOIN nodes n ON n.id = s.node_id WHERE s.id = $1 AND s.deleted_at IS NULL",
		id, APIREQ_CODEINT) != KILN_OK) {
		log_warn("e2b: data plane: cannot read sandbox %s: %s", id, err.msg);
		dp_error(req, 503, "the service is unavailable; try again");
		goto out;
	}
	if (pg_res_rows(r) == 1) {
		/* the node's token for the stream: the sandbox's tenant, as the data plane */
		snprintf(who.tenant_id, sizeof(who.tenant_id), "%s", pg_res_str(r, 0, 0));
		snprintf(who.key_id, sizeof(who.key_id), "e2b-data-plane");
		who.scopes = AUTH_SCOPE_SANDBOX_WRITE;
		snprintf(state, sizeof(state), "%s", pg_res_str(r, 0, 1));
		snprintf(address, sizeof(address), "%s", pg_res_str(r, 0, 2));
		codeint = !strcmp(pg_res_str(r, 0, 3), "t");
	}
	pg_release(gw->pg, c);
	c = NULL;
	if (strcmp(state, "running") != 0) {
		dp_error(req, 502, "the sandbox is not running (it was killed, paused or never "
				   "existed)");
		goto out;
	}
	if (!port_tenant_take(who.tenant_id, gw->cfg.port_streams_max_per_tenant, &ticket)) {
		char msg[160];

		snprintf(msg, sizeof(msg), "too many port streams at once: "
					   "port_streams_max_per_tenant is %lld",
			 gw->cfg.port_streams_max_per_tenant);
		http_reply_header(req, "Retry-After", "1");
		dp_error(req, 429, msg);
		goto out;
	}
	taken = true;
	for (long long until = 0;;) {
		long long now;

		enum kiln_err orc = port_node_open(gw, &who, id, address, port, http_req_id(req), &pn);

		if (orc != KILN_OK) {
			dp_error(req, orc == KILN_E_UNAVAILABLE ? 502 : 500,
				 orc == KILN_E_UNAVAILABLE ? "the sandbox's node cannot be reached"
							   : "cannot open the stream");
			goto out;
		}
		if (pn.status == 101)
			break;
		now = clock_mono_ms();
		if (!until)
			until = now + E2B_CODE_WAIT_MS;
		if (port != E2B_CODE_PORT || !codeint || pn.status != 502 ||
		    !strstr(pn.buf + pn.head_len, "\"port_closed\"") || now >= until) {
			char msg[160];

			if (pn.status == 502 && strstr(pn.buf + pn.head_len, "\"port_closed\"")) {
				snprintf(msg, sizeof(msg), "nothing listens on port %ld of the sandbox",
					 port);
				dp_error(req, 502, msg);
			} else {
				http_reply_data(req, pn.status, "application/json",
						pn.buf + pn.head_len, pn.have - pn.head_len);
			}
			goto out;
		}
		port_node_free(&pn);
		usleep(500 * 1000);
	}
	f = calloc(1, sizeof(*f));
	if (f)
		f->fd = -1;
	body = http_req_body(req, &blen);
	qs = http_req_query_string(req);
	if (!f || !qs || !(f->target = malloc(strlen(http_req_path(req)) + strlen(qs) + 2)) ||
	    (blen && !(f->body = malloc(blen)))) {
		dp_error(req, 500, "out of memory");
		goto out;
	}
	sprintf(f->target, "%s%s%s", http_req_path(req), qs[0] ? "?" : "", qs);
	if (blen)
		memcpy(f->body, body, blen);
	f->body_len = blen;
	f->port = port;
	f->fd = pn.fd;
	pn.fd = -1;
	snprintf(f->method, sizeof(f->method), "%s", http_req_method(req));
	snprintf(f->tenant, sizeof(f->tenant), "%s", who.tenant_id);
	f->ticket = ticket;
	if (http_req_header(req, "Content-Type"))
		snprintf(f->ctype, sizeof(f->ctype), "%s", http_req_header(req, "Content-Type"));
	if (http_req_header(req, "Accept"))
		snprintf(f->accept, sizeof(f->accept), "%s", http_req_header(req, "Accept"));
	taken = false;	/* fwd_free gives it back */
	p = pump_start(fwd_produce, f, fwd_free);
	f = NULL;	/* the pump's now, freed even when it did not start */
	if (!p) {
		dp_error(req, 429, "too many streams at once; try again");
		goto out;
	}
	{
		char type[128] = "";
		int st = pump_wait_ready(p, type, sizeof(type));

		http_reply_stream(req, st ? st : 502, type[0] ? type : "application/json", pump_read,
				  p, pump_release);
	}
out:
	if (c)
		pg_release(gw->pg, c);
	pg_res_free(r);
	port_node_free(&pn);
	free(qs);
	if (f) {	/* not handed to a pump: its count is still `taken` */
		free(f->target);
		free(f->body);
		free(f);
	}
	if (taken)
		port_tenant_give(who.tenant_id, ticket);
	return false;
}
