/*
 * nodeclient.c - calls from the gateway to kiln-node over libcurl, set up by common/httpc.h (see
 * nodeclient.h).
 *
 * A call runs on a pump thread (common/pump.c): curl's header callback announces the node's status
 * and content type, its write callback feeds the client's reply, so a long exec streams through
 * and a client that leaves ends the call.
 */
#include "nodeclient.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "api/gateway.h"
#include "common/pump.h"
#include "common/buf.h"
#include "common/httpc.h"
#include "common/log.h"

#define NODE_TOKEN_TTL_S 300
#define NODE_SYNC_MAX (4 << 20)	/* bytes of an answer read into memory */

struct job {
	char *address, *method, *path, *content_type, *accept, *token;
	char request_id[24];
	void *body;
	size_t body_len, body_off;
	int upload_fd;
	volatile bool aborted;	/* a streamed body was refused: fail the upload */
	struct pump *p;		/* NULL for a call answered into memory */
	struct buf *mem;
	long status;
	char type[128];
	bool ready;
	long timeout_ms;	/* of the whole call; 0: none (streams may run long) */
	CURL *curl;		/* while job_run runs */
};

static void job_free(void *ctx)
{
	struct job *j = ctx;

	if (j->upload_fd >= 0)
		close(j->upload_fd);
	free(j->address);
	free(j->method);
	free(j->path);
	free(j->content_type);
	free(j->accept);
	free(j->token);
	free(j->body);
	free(j);
}

/*
 * Copies the call and signs the node token, under `request_id`; NULL on failure, with *why
 * KILN_E_INTERNAL (cannot sign) or KILN_E_NOMEM. Closes c->upload_fd on failure.
 */
static struct job *job_make(struct gateway *gw, const char *request_id, const struct node_call *c,
			    enum kiln_err *why)
{
	struct auth_token_params tp = {
		.iss = GW_ISSUER,
		.aud = AUTH_AUD_NODE,
		.sub = c->who->key_id,
		.tid = c->who->tenant_id,
		.sbx = c->sandbox_id,
		.scopes = c->who->scopes,
		.now = time(NULL),
		.ttl_s = NODE_TOKEN_TTL_S,
	};
	struct kiln_error err = { 0 };
	struct auth_claims claims;
	struct job *j = calloc(1, sizeof(*j));

	if (!j)
		goto nomem;
	j->upload_fd = c->upload_fd;
	j->address = strdup(c->address);
	j->method = strdup(c->method);
	j->path = strdup(c->path);
	j->content_type = c->content_type ? strdup(c->content_type) : NULL;
	j->accept = c->accept ? strdup(c->accept) : NULL;
	snprintf(j->request_id, sizeof(j->request_id), "%s", request_id);
	if (!j->address || !j->method || !j->path)
		goto nomem;
	if (c->body && c->body_len) {
		j->body = malloc(c->body_len);
		if (!j->body)
			goto nomem;
		memcpy(j->body, c->body, c->body_len);
		j->body_len = c->body_len;
	}
	if (signing_sign(gw->signing, &tp, &j->token, &claims, &err) != KILN_OK) {
		job_free(j);
		*why = KILN_E_INTERNAL;
		return NULL;
	}
	return j;
nomem:
	if (j)
		job_free(j);
	else if (c->upload_fd >= 0)
		close(c->upload_fd);
	*why = KILN_E_NOMEM;
	return NULL;
}

/* job_make() for a request; NULL (replied) on failure. */
static struct job *job_new(struct http_req *req, const struct node_call *c)
{
	enum kiln_err why = KILN_OK;
	struct job *j = job_make(http_req_app(req), http_req_id(req), c, &why);

	if (!j)
		http_reply_error(req, why, why == KILN_E_NOMEM ? "out of memory" : "cannot sign");
	return j;
}

static void job_ready(struct job *j)
{
	if (j->ready)
		return;
	j->ready = true;
	if (j->p)
		pump_ready(j->p, (int)j->status, j->type[0] ? j->type : "application/json");
}

/* When `line` is the header `name` ("Name:"), copies its trimmed value into out and returns true. */
static bool header_value(const char *line, size_t len, const char *name, char *out, size_t out_len)
{
	size_t k = strlen(name), e = len;

	if (len < k || strncasecmp(line, name, k) != 0)
		return false;
	while (k < len && line[k] == ' ')
		k++;
	while (e > k && (line[e - 1] == '\r' || line[e - 1] == '\n'))
		e--;
	snprintf(out, out_len, "%.*s", (int)(e - k), line + k);
	return true;
}

static size_t on_header(char *line, size_t size, size_t n, void *ud)
{
	struct job *j = ud;
	size_t len = size * n;
	char retry[16];

	if (header_value(line, len, "Content-Type:", j->type, sizeof(j->type))) {
		/* kept for the reply */
	} else if (header_value(line, len, "Retry-After:", retry, sizeof(retry))) {
		if (j->p)
			pump_set_retry_after(j->p, retry);
	} else if (len <= 2 && (line[0] == '\r' || line[0] == '\n')) {
		/* The end of a header block; 1xx blocks come before the real one. */
		long code = 0;
		curl_easy_getinfo(j->curl, CURLINFO_RESPONSE_CODE, &code);
		if (code >= 200) {
			j->status = code;
			job_ready(j);
		}
	}
	return len;
}

static size_t on_body(char *data, size_t size, size_t n, void *ud)
{
	struct job *j = ud;
	size_t len = size * n;

	if (j->p)
		return pump_write(j->p, data, len) == 0 ? len : 0;
	return buf_append(j->mem, data, len) == 0 ? len : 0;
}

static size_t on_read(char *out, size_t size, size_t n, void *ud)
{
	struct job *j = ud;
	size_t max = size * n;
	ssize_t r;

	if (j->upload_fd < 0) {
		size_t left = j->body_len - j->body_off;
		if (left > max)
			left = max;
		memcpy(out, (char *)j->body + j->body_off, left);
		j->body_off += left;
		return left;
	}
	do
		r = read(j->upload_fd, out, max);
	while (r < 0 && errno == EINTR);
	if (r < 0 || (r == 0 && j->aborted))
		return CURL_READFUNC_ABORT;
	return (size_t)r;
}

/* Performs the call; the status (0 when the node could not be reached) ends up in j->status. */
static void job_run(struct job *j)
{
	struct httpc hc;
	struct kiln_error err = { 0 };
	struct curl_slist *h = NULL;
	char url[4352], line[4096 + 32];
	const char *base = j->address;
	struct httpc_opts o = {
		.url = url,
		.method = j->method,
		.connect_timeout_ms = 3000,
		.timeout_ms = j->timeout_ms,
		.on_header = on_header,
		.header_arg = j,
		.on_write = on_body,
		.write_arg = j,
		.upload_len = -1,
	};
	long code = 0;

	if (httpc_init(&hc, &err) != KILN_OK)
		return;
	j->curl = hc.curl;
	if (strncmp(base, "unix:", 5) == 0) {
		o.unix_socket = base + 5;
		base = "http://node";
	}
	snprintf(url, sizeof(url), "%s%s", base, j->path);
	snprintf(line, sizeof(line), "Authorization: Bearer %s", j->token);
	h = curl_slist_append(h, line);
	snprintf(line, sizeof(line), "X-Request-Id: %s", j->request_id);
	h = curl_slist_append(h, line);
	h = curl_slist_append(h, "Expect:");
	if (j->accept) {
		snprintf(line, sizeof(line), "Accept: %.4000s", j->accept);
		h = curl_slist_append(h, line);
	}
	if (j->content_type) {
		snprintf(line, sizeof(line), "Content-Type: %.4000s", j->content_type);
		h = curl_slist_append(h, line);
	}
	if (j->upload_fd >= 0 || j->body_len) {
		o.on_read = on_read;
		o.read_arg = j;
		if (j->upload_fd < 0)
			o.upload_len = (long long)j->body_len;
		else
			h = curl_slist_append(h, "Transfer-Encoding: chunked");
	}
	o.headers = h;
	httpc_setup(&hc, &o);
	httpc_perform(&hc, &code, &err);
	if (!j->ready && hc.result == CURLE_OK && code >= 200) {
		j->status = code;
		job_ready(j);	/* an answer without a body */
	}
	if (hc.result != CURLE_OK && hc.result != CURLE_WRITE_ERROR && !j->ready)
		log_warn("node \"%s\" did not answer %s: %s", j->address, j->method,
			 curl_easy_strerror(hc.result));
	curl_slist_free_all(h);
	j->curl = NULL;
	httpc_close(&hc);
}

static void job_produce(struct pump *p, void *ctx)
{
	struct job *j = ctx;

	j->p = p;
	job_run(j);
}

static void reply_from_pump(struct http_req *req, struct pump *p)
{
	char type[128];
	int status = pump_wait_ready(p, type, sizeof(type));

	if (status == 0) {
		pump_release(p);
		http_reply_error(req, KILN_E_UNAVAILABLE, "the sandbox's node is unavailable");
		return;
	}
	if (pump_retry_after(p)[0])
		http_reply_header(req, "Retry-After", pump_retry_after(p));
	http_reply_stream(req, status, type[0] ? type : "application/json", pump_read, p,
			  pump_release);
}

void node_proxy(struct http_req *req, const struct node_call *call)
{
	struct job *j = job_new(req, call);
	struct pump *p;

	if (!j)
		return;
	p = pump_start(job_produce, j, job_free);
	if (!p) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	reply_from_pump(req, p);
}

enum kiln_err node_call_sync(struct http_req *req, const struct node_call *call, long *status,
			     char **body, size_t *len, bool *replied)
{
	struct job *j = job_new(req, call);
	struct buf b;

	*body = NULL;
	*status = 0;
	*replied = !j;
	if (!j)
		return KILN_E_INTERNAL;	/* job_new replied */
	buf_init(&b, NODE_SYNC_MAX);
	j->mem = &b;
	j->timeout_ms = call->timeout_ms ? call->timeout_ms : NODE_SYNC_TIMEOUT_MS;
	job_run(j);
	*status = j->status;
	job_free(j);
	if (!*status) {
		buf_release(&b);
		return KILN_E_UNAVAILABLE;
	}
	*body = buf_detach(&b, len);
	return KILN_OK;
}

enum kiln_err node_call_bg(struct gateway *gw, const char *request_id, const struct node_call *call,
			   long *status)
{
	enum kiln_err why = KILN_OK;
	struct job *j = job_make(gw, request_id, call, &why);
	struct buf b;

	*status = 0;
	if (!j)
		return why;
	buf_init(&b, NODE_SYNC_MAX);
	j->mem = &b;
	j->timeout_ms = call->timeout_ms ? call->timeout_ms : NODE_SYNC_TIMEOUT_MS;
	job_run(j);
	*status = j->status;
	job_free(j);
	buf_release(&b);
	return *status ? KILN_OK : KILN_E_UNAVAILABLE;
}

struct node_stream {
	struct job *j;
	struct pump *p;
	int wfd;
};

struct node_stream *node_stream_start(struct http_req *req, const struct node_call *call,
				      int *body_fd)
{
	struct node_stream *ns = calloc(1, sizeof(*ns));
	struct node_call c = *call;
	int fds[2];

	*body_fd = -1;
	if (!ns || pipe2(fds, O_CLOEXEC) != 0) {
		free(ns);
		return NULL;
	}
	c.upload_fd = fds[0];
	ns->j = job_new(req, &c);
	if (!ns->j) {
		close(fds[1]);
		free(ns);
		return NULL;
	}
	ns->p = pump_start(job_produce, ns->j, job_free);
	if (!ns->p) {
		close(fds[1]);
		free(ns);
		return NULL;
	}
	ns->wfd = fds[1];
	*body_fd = fds[1];
	return ns;
}

void node_stream_finish(struct http_req *req, struct node_stream *ns)
{
	reply_from_pump(req, ns->p);
	free(ns);
}

void node_stream_abort(struct node_stream *ns)
{
	if (!ns)
		return;
	ns->j->aborted = true;
	pump_release(ns->p);
	free(ns);
}

char *node_escape(const char *s)
{
	char *e = curl_easy_escape(NULL, s, 0), *copy;

	if (!e)
		return NULL;
	copy = strdup(e);
	curl_free(e);
	return copy;
}

char *node_token(struct http_req *req, const char *sandbox_id)
{
	return node_token_for(http_req_app(req), gw_principal(req), sandbox_id);
}

char *node_token_for(struct gateway *gw, const struct principal *who, const char *sandbox_id)
{
	struct auth_token_params tp = {
		.iss = GW_ISSUER,
		.aud = AUTH_AUD_NODE,
		.sub = who->key_id,
		.tid = who->tenant_id,
		.sbx = sandbox_id,
		.scopes = who->scopes,
		.now = time(NULL),
		.ttl_s = NODE_TOKEN_TTL_S,
	};
	struct kiln_error err = { 0 };
	char *token = NULL;

	if (signing_sign(gw->signing, &tp, &token, NULL, &err) != KILN_OK)
		return NULL;
	return token;
}
