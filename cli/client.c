/* client.c - the kiln CLI's HTTP client (client.h). */
#include "cli/client.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "common/httpc.h"

#define SSE_LINE_MAX (16u << 20)	/* bytes of one event's data */

struct sse {
	struct buf line, data;
	char event[64];
	client_event_fn fn;
	void *ctx;
	long status;
	CURL *curl;
	struct buf *out;	/* the body of an answer that is not a stream */
	int failed;
};

static size_t to_buf(char *p, size_t size, size_t n, void *arg)
{
	return buf_append(arg, p, size * n) == 0 ? size * n : 0;
}

/* One line of an event stream (without its newline). */
static void sse_line(struct sse *s, const char *line)
{
	if (!*line) {
		if (s->event[0] || s->data.len)
			s->fn(s->ctx, s->event[0] ? s->event : "message", s->data.data ? s->data.data : "");
		s->event[0] = '\0';
		buf_reset(&s->data);
	} else if (strncmp(line, "event:", 6) == 0) {
		snprintf(s->event, sizeof(s->event), "%s", line + 6 + (line[6] == ' '));
	} else if (strncmp(line, "data:", 5) == 0) {
		if (s->data.len)
			buf_append(&s->data, "\n", 1);
		if (buf_appends(&s->data, line + 5 + (line[5] == ' ')) < 0)
			s->failed = 1;
	}
}

static size_t to_sse(char *p, size_t size, size_t n, void *arg)
{
	struct sse *s = arg;
	size_t len = size * n;

	if (!s->status)
		curl_easy_getinfo(s->curl, CURLINFO_RESPONSE_CODE, &s->status);
	if (s->status != 200)
		return to_buf(p, 1, len, s->out);
	for (size_t i = 0; i < len; i++) {
		if (p[i] == '\n') {
			size_t l = s->line.len;

			if (l && s->line.data[l - 1] == '\r')
				s->line.data[--s->line.len] = '\0';
			sse_line(s, s->line.data ? s->line.data : "");
			buf_reset(&s->line);
		} else if (buf_append(&s->line, p + i, 1) < 0) {
			s->failed = 1;
			return 0;
		}
	}
	return s->failed ? 0 : len;
}

/*
 * Sets `h` up for METHOD url+path with the key in `headers` and the answer's body into `out`
 * (NULL: the caller sets its own writer). False, with c->err set, when out of memory.
 */
static bool prepare(struct client *c, struct httpc *h, const char *method, const char *path,
		    struct buf *out, struct curl_slist **headers)
{
	struct kiln_error err = { 0 };
	struct httpc_opts o = { .connect_timeout_ms = 10000, .body = out };
	struct buf url, auth;
	bool ok = false;

	buf_init(&url, 8192);
	buf_init(&auth, 8192);
	if (buf_appendf(&url, "%s%s", c->url, path) < 0 ||
	    buf_appendf(&auth, "Authorization: Bearer %s", c->key ? c->key : "") < 0)
		goto done;
	o.url = url.data;
	if (httpc_open(h, &o, &err) != KILN_OK)
		goto done;
	if (c->key && *c->key)
		*headers = curl_slist_append(*headers, auth.data);
	curl_easy_setopt(h->curl, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(h->curl, CURLOPT_USERAGENT, "kiln-cli");
	ok = true;
done:
	if (!ok)
		snprintf(c->err, sizeof(c->err), "out of memory");
	buf_release(&url);
	buf_release(&auth);
	return ok;
}

/* Performs the call, frees `headers` and the handle; the HTTP status, or 0 with c->err set. */
static int perform(struct client *c, struct httpc *h, struct curl_slist *headers)
{
	struct kiln_error err = { 0 };
	long status = 0;

	curl_easy_setopt(h->curl, CURLOPT_HTTPHEADER, headers);
	if (httpc_perform(h, &status, &err) != KILN_OK)
		snprintf(c->err, sizeof(c->err), "%s", h->errbuf[0] ? h->errbuf : err.msg);
	curl_slist_free_all(headers);
	httpc_close(h);
	return (int)status;
}

int client_call(struct client *c, const char *method, const char *path, const struct client_body *body,
		struct buf *out)
{
	struct curl_slist *headers = NULL;
	struct httpc h;
	CURL *curl;

	if (!prepare(c, &h, method, path, out, &headers))
		return 0;
	curl = h.curl;
	if (body && body->json) {
		headers = curl_slist_append(headers, "Content-Type: application/json");
		curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body->json);
	} else if (body && body->file) {
		headers = curl_slist_append(headers, "Content-Type: application/octet-stream");
		curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
		curl_easy_setopt(curl, CURLOPT_READDATA, body->file);
		curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, (curl_off_t)body->file_size);
		curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method);
	}
	return perform(c, &h, headers);
}

int client_stream(struct client *c, const char *path, const char *json, client_event_fn fn, void *ctx,
		  struct buf *out)
{
	struct curl_slist *headers = NULL;
	struct sse s = { .fn = fn, .ctx = ctx, .out = out };
	struct httpc h;
	CURL *curl;
	int status;

	if (!prepare(c, &h, json ? "POST" : "GET", path, NULL, &headers))
		return 0;
	curl = h.curl;
	buf_init(&s.line, SSE_LINE_MAX);
	buf_init(&s.data, SSE_LINE_MAX);
	s.curl = curl;
	if (json) {
		headers = curl_slist_append(headers, "Content-Type: application/json");
		curl_easy_setopt(curl, CURLOPT_POSTFIELDS, json);
	}
	headers = curl_slist_append(headers, "Accept: text/event-stream");
	curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, to_sse);
	curl_easy_setopt(curl, CURLOPT_WRITEDATA, &s);
	status = perform(c, &h, headers);
	if (status == 200 && s.line.len)
		sse_line(&s, s.line.data);	/* a last line without its newline */
	if (status == 200)
		sse_line(&s, "");		/* and an event without its blank line */
	buf_release(&s.line);
	buf_release(&s.data);
	return status;
}

void client_error_text(int status, const struct buf *body, char *msg, size_t len)
{
	json_t *doc = body->len ? json_loadb(body->data, body->len, 0, NULL) : NULL;
	json_t *e = json_object_get(doc, "error");
	const char *m = json_string_value(json_object_get(e, "message"));
	const char *code = json_string_value(json_object_get(e, "code"));

	if (m)
		snprintf(msg, len, "%s (%s, HTTP %d)", m, code ? code : "error", status);
	else
		snprintf(msg, len, "the server answered HTTP %d", status);
	json_decref(doc);
}
