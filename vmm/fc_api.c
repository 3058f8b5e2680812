/*
 * fc_api.c - Firecracker's REST API over its Unix socket, through libcurl (common/httpc.h;
 * fc_api.h).
 */
#include "vmm/fc_api.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/httpc.h"

#define FC_API_SOCK_MAX 107	/* bytes of a Unix socket path (sun_path less the terminator) */
#define FC_API_RETRY_MS 5
#define FC_API_REFILL_MS 1000	/* a token bucket refills its size in one second */

struct fc_api {
	char sock[FC_API_SOCK_MAX + 1];
	struct httpc http;	/* one handle, so its connection is reused */
};

struct fc_api *fc_api_new(const char *sock_path)
{
	struct fc_api *api;

	if (!sock_path || strlen(sock_path) > FC_API_SOCK_MAX)
		return NULL;
	api = calloc(1, sizeof(*api));
	if (!api)
		return NULL;
	memcpy(api->sock, sock_path, strlen(sock_path) + 1);
	if (httpc_init(&api->http, NULL) != KILN_OK) {
		free(api);
		return NULL;
	}
	return api;
}

void fc_api_free(struct fc_api *api)
{
	if (!api)
		return;
	httpc_close(&api->http);
	free(api);
}

/* Copies the fault message of an Error body into `out`, printable ASCII only, or "" when none. */
static void fault_of(const char *body, char *out, size_t outlen)
{
	json_t *j = body ? json_loads(body, JSON_DISABLE_EOF_CHECK, NULL) : NULL;
	const char *msg = json_string_value(json_object_get(j, "fault_message"));
	size_t n = 0;

	for (; msg && *msg && n + 1 < outlen; msg++)
		out[n++] = (*msg >= 0x20 && *msg < 0x7f) ? *msg : '?';
	out[n] = '\0';
	json_decref(j);
}

enum kiln_err fc_api_call(struct fc_api *api, const char *what, const char *method, const char *path,
			  json_t *body, int timeout_ms, long *status, json_t **resp, struct kiln_error *err)
{
	struct curl_slist *hdrs = NULL, *h;
	char url[256], fault[FC_API_FAULT_MAX + 1];
	struct buf rb;
	struct httpc_opts o = {
		.url = url,
		.unix_socket = api->sock,
		.timeout_ms = timeout_ms,
		.connect_timeout_ms = timeout_ms < 2000 ? timeout_ms : 2000,
		.body = &rb,
	};
	struct kiln_error herr = { 0 };
	char *req = NULL;
	enum kiln_err rc = KILN_OK;
	long code = 0;
	CURL *c = api->http.curl;

	if (status)
		*status = 0;
	if (resp)
		*resp = NULL;
	buf_init(&rb, FC_API_BODY_MAX);
	if (snprintf(url, sizeof(url), "http://localhost%s", path) >= (int)sizeof(url))
		return kiln_error_set(err, KILN_E_INTERNAL, "firecracker api path '%.64s' too long", path);
	if (body && !(req = json_dumps(body, JSON_COMPACT)))
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (!(h = curl_slist_append(hdrs, "Accept: application/json")) || !(hdrs = h) ||
	    !(h = curl_slist_append(hdrs, "Expect:")) || !(hdrs = h) ||
	    (req && (!(h = curl_slist_append(hdrs, "Content-Type: application/json")) || !(hdrs = h)))) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto out;
	}

	httpc_setup(&api->http, &o);
	curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
	curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
	curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http");
	if (req) {
		curl_easy_setopt(c, CURLOPT_POSTFIELDS, req);
		curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(req));
	}

	rc = httpc_perform(&api->http, &code, &herr);
	if (rc != KILN_OK) {
		if (rc == KILN_E_TOO_LARGE)
			rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED,
					    "vm '%s': firecracker %s %s: answer over %d bytes", what, method, path,
					    FC_API_BODY_MAX);
		else
			rc = kiln_error_set(err, rc == KILN_E_NOMEM ? KILN_E_NOMEM : KILN_E_SANDBOX_FAILED,
					    "vm '%s': firecracker %s %s: %s", what, method, path, herr.msg);
		goto out;
	}
	if (status)
		*status = code;
	if (code == 200 || code == 204) {
		json_t *j = NULL;
		json_error_t jerr;

		if (rb.len > 0 && !(j = json_loadb(rb.data, rb.len, 0, &jerr))) {
			rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED,
					    "vm '%s': firecracker %s %s: answer is not json (%s)", what, method,
					    path, jerr.text);
			goto out;
		}
		if (resp)
			*resp = j;
		else
			json_decref(j);
		goto out;
	}
	fault_of(rb.data, fault, sizeof(fault));
	rc = kiln_error_set(err, code >= 400 && code < 500 ? KILN_E_INTERNAL : KILN_E_SANDBOX_FAILED,
			    "vm '%s': firecracker %s %s: %ld %s", what, method, path, code,
			    fault[0] ? fault : "(no fault message)");
out:
	curl_slist_free_all(hdrs);
	free(req);
	buf_release(&rb);
	return rc;
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

enum kiln_err fc_api_wait(struct fc_api *api, const char *what, int timeout_ms, json_t **resp,
			  struct kiln_error *err)
{
	long long deadline = now_ms() + timeout_ms;
	struct timespec tick = { .tv_nsec = FC_API_RETRY_MS * 1000000L };
	struct kiln_error last = { 0 };

	for (;;) {
		long long left = deadline - now_ms();
		enum kiln_err rc;

		kiln_error_clear(&last);
		rc = fc_api_call(api, what, "GET", "/", NULL, left > 1000 ? 1000 : (left > 1 ? (int)left : 1),
				 NULL, resp, &last);
		/* a refusal is an answer: the socket is up */
		if (rc == KILN_OK || rc == KILN_E_INTERNAL || rc == KILN_E_NOMEM || now_ms() >= deadline)
			return rc == KILN_OK ? KILN_OK : kiln_error_set(err, rc, "%s", last.msg);
		nanosleep(&tick, NULL);
	}
}

/* One TokenBucket of `per_s` tokens a second, or NULL (out of memory). */
static json_t *token_bucket(unsigned long long per_s)
{
	if (!per_s)
		return json_pack("{s:I, s:I}", "size", (json_int_t)0, "refill_time", (json_int_t)0);
	return json_pack("{s:I, s:I, s:I}", "size", (json_int_t)per_s, "refill_time", (json_int_t)FC_API_REFILL_MS,
			 "one_time_burst", (json_int_t)0);
}

json_t *fc_api_rate_limiter(unsigned long long ops_per_s, unsigned long long bytes_per_s, bool explicit_none)
{
	json_t *rl = json_object();
	const struct {
		const char *name;
		unsigned long long per_s;
	} b[] = { { "bandwidth", bytes_per_s }, { "ops", ops_per_s } };

	if (!rl)
		return NULL;
	for (size_t i = 0; i < sizeof(b) / sizeof(b[0]); i++) {
		if (!b[i].per_s && !explicit_none)
			continue;
		if (json_object_set_new(rl, b[i].name, token_bucket(b[i].per_s)) < 0) {
			json_decref(rl);
			return NULL;
		}
	}
	return rl;
}
