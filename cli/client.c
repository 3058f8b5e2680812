/* client.c - the kiln CLI's HTTP client (client.h). */
#include "cli/client.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

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

/* A handle for METHOD url+path with the key and `headers` set up; NULL when out of memory. */
static CURL *prepare(struct client *c, const char *method, const char *path, struct curl_slist **headers)
{
	CURL *curl = curl_easy_init();
	struct buf url, auth;

	if (!curl)
		return NULL;
	buf_init(&url, 8192);
	buf_init(&auth, 8192);
	if (buf_appendf(&url, "%s%s", c->url, path) < 0 || buf_appendf(&auth, "Authorization: Bearer %s", c->key ? c->key : "") < 0) {
		buf_release(&url);
		buf_release(&auth);
		curl_easy_cleanup(curl);
		return NULL;
	}
	if (c->key && *c->key)
		*headers = curl_slist_append(*headers, auth.data);
	curl_easy_setopt(curl, CURLOPT_URL, url.data);
	curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
	curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, 10L);
	curl_easy_setopt(curl, CURLOPT_USERAGENT, "kiln-cli");
	buf_release(&url);
	buf_release(&auth);
	return curl;
}

static int perform(struct client *c, CURL *curl, struct curl_slist *headers)
{
	char errbuf[CURL_ERROR_SIZE] = "";
	long status = 0;
	CURLcode rc;

	curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
	curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, errbuf);
	rc = curl_easy_perform(curl);
	if (rc == CURLE_OK)
		curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
	else
		snprintf(c->err, sizeof(c->err), "%s", errbuf[0] ? errbuf : curl_easy_strerror(rc));
	curl_slist_free_all(headers);
	curl_easy_cleanup(curl);
	return (int)status;
}

int client_call(struct client *c, const char *method, const char *path, const struct client_body *body,
		struct buf *out)
{
	struct curl_slist *headers = NULL;
	CURL *curl = prepare(c, method, path, &headers);

	if (!curl) {
		snprintf(c->err, sizeof(c->err), "out of memory");
		return 0;
	}
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
	curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, to_buf);
	curl_easy_setopt(curl, CURLOPT_WRITEDATA, out);
	return perform(c, curl, headers);
}

int client_stream(struct client *c, const char *path, const char *json, client_event_fn fn, void *ctx,
		  struct buf *out)
{
	struct curl_slist *headers = NULL;
	struct sse s = { .fn = fn, .ctx = ctx, .out = out };
	CURL *curl = prepare(c, "POST", path, &headers);
	int status;

	if (!curl) {
		snprintf(c->err, sizeof(c->err), "out of memory");
		return 0;
	}
	buf_init(&s.line, SSE_LINE_MAX);
	buf_init(&s.data, SSE_LINE_MAX);
	s.curl = curl;
	headers = curl_slist_append(headers, "Content-Type: application/json");
	headers = curl_slist_append(headers, "Accept: text/event-stream");
	curl_easy_setopt(curl, CURLOPT_POSTFIELDS, json);
	curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, to_sse);
	curl_easy_setopt(curl, CURLOPT_WRITEDATA, &s);
	status = perform(c, curl, headers);
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
