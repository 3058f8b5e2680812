/*
 * httpc.c - one libcurl easy-handle setup for every HTTP client of the project (see httpc.h).
 */
#include "httpc.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>

static pthread_once_t global_once = PTHREAD_ONCE_INIT;
static CURLcode global_rc = CURLE_FAILED_INIT;

static void global_init(void)
{
	global_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

/* Appends to the caller's buffer; a byte past its cap aborts the exchange (CURLE_WRITE_ERROR). */
static size_t on_body(char *p, size_t size, size_t n, void *ud)
{
	struct httpc *h = ud;
	int r;

	if (!h->body)
		return size * n;
	r = buf_append(h->body, p, size * n);
	if (r == -E2BIG)
		h->over = true;
	return r == 0 ? size * n : 0;
}

/* The method and the request's body (httpc_opts.method). */
static void set_method(CURL *c, const struct httpc_opts *o)
{
	const char *m = o->method;

	if (o->on_read) {
		curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
		curl_easy_setopt(c, CURLOPT_READFUNCTION, o->on_read);
		curl_easy_setopt(c, CURLOPT_READDATA, o->read_arg);
		if (o->on_seek) {
			curl_easy_setopt(c, CURLOPT_SEEKFUNCTION, o->on_seek);
			curl_easy_setopt(c, CURLOPT_SEEKDATA, o->read_arg);
		}
		if (o->upload_len >= 0)
			curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, (curl_off_t)o->upload_len);
		if (m && strcmp(m, "PUT") != 0)
			curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, m);
		return;
	}
	if (!m || strcmp(m, "GET") == 0)
		return;
	if (strcmp(m, "HEAD") == 0) {
		curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
	} else if (strcmp(m, "POST") == 0 && o->post_data) {
		curl_easy_setopt(c, CURLOPT_POST, 1L);
		curl_easy_setopt(c, CURLOPT_POSTFIELDS, o->post_data);
		curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)o->post_len);
	} else {
		curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, m);
	}
}

enum kiln_err httpc_init(struct httpc *h, struct kiln_error *err)
{
	memset(h, 0, sizeof(*h));
	pthread_once(&global_once, global_init);
	if (global_rc != CURLE_OK)
		return kiln_error_set(err, KILN_E_NOMEM, "cannot initialise libcurl: %s",
				      curl_easy_strerror(global_rc));
	h->curl = curl_easy_init();
	if (!h->curl)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	return KILN_OK;
}

void httpc_setup(struct httpc *h, const struct httpc_opts *o)
{
	CURL *c = h->curl;

	curl_easy_reset(c);
	h->body = o->body;
	h->over = false;
	h->errbuf[0] = '\0';
	curl_easy_setopt(c, CURLOPT_URL, o->url);
	if (o->unix_socket)
		curl_easy_setopt(c, CURLOPT_UNIX_SOCKET_PATH, o->unix_socket);
	curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
	if (o->timeout_ms)
		curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, o->timeout_ms);
	if (o->connect_timeout_ms)
		curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, o->connect_timeout_ms);
	if (o->on_write) {
		curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, o->on_write);
		curl_easy_setopt(c, CURLOPT_WRITEDATA, o->write_arg);
	} else {
		curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
		curl_easy_setopt(c, CURLOPT_WRITEDATA, h);
	}
	curl_easy_setopt(c, CURLOPT_ERRORBUFFER, h->errbuf);
	if (o->on_header) {
		curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, o->on_header);
		curl_easy_setopt(c, CURLOPT_HEADERDATA, o->header_arg);
	}
	if (o->strict) {
		curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
		curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
		curl_easy_setopt(c, CURLOPT_PROXY, "");	/* no proxy from the environment */
	}
	if (o->resolve)
		curl_easy_setopt(c, CURLOPT_RESOLVE, o->resolve);
	if (o->open_socket) {
		curl_easy_setopt(c, CURLOPT_OPENSOCKETFUNCTION, o->open_socket);
		curl_easy_setopt(c, CURLOPT_OPENSOCKETDATA, o->open_socket_arg);
	}
	if (o->aws_sigv4)
		curl_easy_setopt(c, CURLOPT_AWS_SIGV4, o->aws_sigv4);
	if (o->username)
		curl_easy_setopt(c, CURLOPT_USERNAME, o->username);
	if (o->password)
		curl_easy_setopt(c, CURLOPT_PASSWORD, o->password);
	if (o->low_speed_s) {
		curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, o->low_speed_bytes);
		curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, o->low_speed_s);
	}
	set_method(c, o);
	if (o->headers)
		curl_easy_setopt(c, CURLOPT_HTTPHEADER, o->headers);
}

enum kiln_err httpc_open(struct httpc *h, const struct httpc_opts *o, struct kiln_error *err)
{
	enum kiln_err rc = httpc_init(h, err);

	if (rc == KILN_OK)
		httpc_setup(h, o);
	return rc;
}

enum kiln_err httpc_perform(struct httpc *h, long *status, struct kiln_error *err)
{
	CURLcode cc = curl_easy_perform(h->curl);

	*status = 0;
	h->result = cc;
	if (cc == CURLE_OK) {
		curl_easy_getinfo(h->curl, CURLINFO_RESPONSE_CODE, status);
		return KILN_OK;
	}
	if (h->over)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "the answer is over %zu bytes",
				      h->body->max);
	return kiln_error_set(err, cc == CURLE_OUT_OF_MEMORY ? KILN_E_NOMEM : KILN_E_UNAVAILABLE,
			      "%s", curl_easy_strerror(cc));
}

void httpc_close(struct httpc *h)
{
	if (h->curl)
		curl_easy_cleanup(h->curl);
	h->curl = NULL;
	h->body = NULL;
}
