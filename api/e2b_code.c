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
 * with libcurl over the node's stream, and the guest's status, Content-Type and body come back
 * as they are produced (a producer thread, common/pump.h), so /execute's NDJSON lines are
 * flushed one by one. WebSocket upgrades are not carried here (the ports listener carries them).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <openssl/crypto.h>

#include "api/apireq.h"
#include "api/e2b.h"
#include "api/ports.h"
#include "common/http.h"
#include "common/httpc.h"
#include "common/log.h"
#include "common/pg.h"
#include "common/pump.h"

#define E2B_ENVD_PORT 49983		/* envd's port: served by e2b.c's routes */
#define E2B_CODE_PORT 49999		/* the code interpreter's */
#define E2B_CODE_WAIT_MS 90000		/* a closed 49999 retried this long (a cold boot's imports) */
#define E2B_PORT_TIMEOUT_S 3600		/* a forwarded exchange's whole time */
#define E2B_FWD_ID_MAX 64		/* bytes of a sandbox id */

struct fwd {
	struct pump *p;
	int fd;			/* the node's stream to the guest port, until libcurl takes it */
	long port;
	char tenant[AUTH_CLAIM_MAX];	/* its port stream count, given back at the end */
	char method[16];
	char *target;		/* path and query */
	char *body;
	size_t body_len;
	char ctype[256], accept[256];
	long status;		/* the guest's, from its status line */
	char reply_type[128];
	bool ready;		/* pump_ready called */
};

static void fwd_free(void *arg)
{
	struct fwd *f = arg;

	if (f->fd >= 0)
		close(f->fd);
	port_tenant_give(f->tenant);
	free(f->target);
	free(f->body);
	free(f);
}

/* libcurl: the connection is the node's stream, already open to the guest's port. */
static curl_socket_t fwd_socket(void *arg, curlsocktype purpose, struct curl_sockaddr *addr)
{
	struct fwd *f = arg;
	int fd = f->fd;

	(void)purpose;
	(void)addr;
	f->fd = -1;	/* libcurl's now: it closes it */
	return fd >= 0 ? fd : CURL_SOCKET_BAD;
}

static int fwd_sockopt(void *arg, curl_socket_t fd, curlsocktype purpose)
{
	(void)arg;
	(void)fd;
	(void)purpose;
	return CURL_SOCKOPT_ALREADY_CONNECTED;
}

/* libcurl: the guest's header lines; at their end the reply's status and type go out. */
static size_t fwd_header(char *p, size_t size, size_t n, void *arg)
{
	struct fwd *f = arg;
	size_t len = size * n;
	long st;

	if (len > 9 && !strncmp(p, "HTTP/", 5) && strchr(p, ' ') &&
	    sscanf(strchr(p, ' '), " %ld", &st) == 1) {
		f->status = st;
		f->reply_type[0] = '\0';
	} else if (len > 13 && !strncasecmp(p, "Content-Type:", 13)) {
		const char *v = p + 13;
		size_t k;

		while (v < p + len && (*v == ' ' || *v == '\t'))
			v++;
		k = (size_t)(p + len - v);
		while (k && (v[k - 1] == '\r' || v[k - 1] == '\n' || v[k - 1] == ' '))
			k--;
		snprintf(f->reply_type, sizeof(f->reply_type), "%.*s", (int)k, v);
	} else if (((len == 2 && p[0] == '\r') || (len == 1 && p[0] == '\n')) && f->status >= 200 &&
		   !f->ready) {
		f->ready = true;
		pump_ready(f->p, (int)f->status,
			   f->reply_type[0] ? f->reply_type : "application/octet-stream");
	}
	return len;
}

/* libcurl: the guest's body as it comes, straight to the client. */
static size_t fwd_write(char *p, size_t size, size_t n, void *arg)
{
	struct fwd *f = arg;
	size_t len = size * n;

	if (!f->ready) {
		f->ready = true;
		pump_ready(f->p, f->status >= 200 ? (int)f->status : 502, "application/octet-stream");
	}
	return pump_write(f->p, p, len) == 0 ? len : 0;
}

/* The producer: one exchange with the guest's port over the node's stream. */
static void fwd_produce(struct pump *p, void *arg)
{
	struct fwd *f = arg;
	struct curl_slist *h = NULL;
	struct httpc hc = { 0 };
	struct kiln_error err = { 0 };
	char url[4200], line[300];
	long status = 0;
	enum kiln_err rc;

	f->p = p;
	snprintf(url, sizeof(url), "http://127.0.0.1:%ld%s", f->port, f->target);
	h = curl_slist_append(h, "Expect:");
	if (h && f->ctype[0]) {
		snprintf(line, sizeof(line), "Content-Type: %s", f->ctype);
		h = curl_slist_append(h, line);
	}
	if (h && f->accept[0]) {
		snprintf(line, sizeof(line), "Accept: %s", f->accept);
		h = curl_slist_append(h, line);
	}
	rc = h ? httpc_open(&hc,
			    &(struct httpc_opts){ .url = url, .timeout_ms = E2B_PORT_TIMEOUT_S * 1000L,
						  .connect_timeout_ms = 5000,
						  .method = f->body_len ? "POST" : f->method,
						  .post_data = f->body, .post_len = f->body_len,
						  .headers = h, .on_write = fwd_write, .write_arg = f,
						  .on_header = fwd_header, .header_arg = f,
						  .open_socket = fwd_socket, .open_socket_arg = f },
			    &err)
		   : KILN_E_NOMEM;
	if (rc == KILN_OK) {
		if (f->body_len && strcmp(f->method, "POST") != 0)
			curl_easy_setopt(hc.curl, CURLOPT_CUSTOMREQUEST, f->method);
		curl_easy_setopt(hc.curl, CURLOPT_NOPROXY, "*");
		curl_easy_setopt(hc.curl, CURLOPT_SOCKOPTFUNCTION, fwd_sockopt);
		curl_easy_setopt(hc.curl, CURLOPT_FORBID_REUSE, 1L);
		curl_easy_setopt(hc.curl, CURLOPT_HTTP_CONTENT_DECODING, 0L);
		rc = httpc_perform(&hc, &status, &err);
	}
	httpc_close(&hc);
	curl_slist_free_all(h);
	if (!f->ready) {
		char msg[160];
		int k;

		f->ready = true;
		pump_ready(p, 502, "application/json");
		k = snprintf(msg, sizeof(msg),
			     "{\"code\":502,\"message\":\"port %ld of the sandbox did not answer\"}",
			     f->port);
		pump_write(p, msg, (size_t)k);
	}
	if (rc != KILN_OK)
		log_debug("e2b: port %ld: the exchange ended: %s", f->port, err.msg);
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
		snprintf(who.tenant_id, sizeof(who.tenant_id), "%s", pg_res_str(r, 0, 0));
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
	if (!port_tenant_take(who.tenant_id, gw->cfg.port_streams_max_per_tenant)) {
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
		struct timespec ts;
		long long now;

		if (port_node_open(gw, &who, id, address, port, http_req_id(req), &pn) != KILN_OK) {
			dp_error(req, 502, "the sandbox's node cannot be reached");
			goto out;
		}
		if (pn.status == 101)
			break;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		now = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
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
		port_tenant_give(who.tenant_id);
	return false;
}
