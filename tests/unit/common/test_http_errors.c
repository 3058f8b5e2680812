/*
 * test_http_errors.c - the error replies of the HTTP engine (common/http.c), over a real server on
 * 127.0.0.1 and libcurl: each code answers with the status, API `code` and message it has always
 * had (the expectations below are written out, not read from the table), a code whose detail
 * stays in the log shows "internal" and the generic text, and a value outside the enum is a 500.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <stdlib.h>

#include "common/err.h"
#include "common/http.h"
#include "test.h"

/* What a reply for each code must be. */
static const struct {
	enum kiln_err code;
	int status;
	const char *api_code;
	bool shows_message;
} expected[] = {
	{ KILN_E_BAD_REQUEST, 400, "bad_request", true },
	{ KILN_E_UNAUTHENTICATED, 401, "unauthenticated", true },
	{ KILN_E_FORBIDDEN, 403, "forbidden", true },
	{ KILN_E_SUSPENDED, 403, "suspended", true },
	{ KILN_E_QUOTA, 403, "quota_exceeded", true },
	{ KILN_E_NOT_FOUND, 404, "not_found", true },
	{ KILN_E_CONFLICT, 409, "conflict", true },
	{ KILN_E_CREDITS, 402, "insufficient_credits", true },
	{ KILN_E_TOO_LARGE, 413, "too_large", true },
	{ KILN_E_INVALID, 422, "invalid", true },
	{ KILN_E_TIMEOUT, 408, "request_timeout", true },
	{ KILN_E_RATE_LIMITED, 429, "rate_limited", true },
	{ KILN_E_NOT_IMPLEMENTED, 501, "not_implemented", true },
	{ KILN_E_SANDBOX_FAILED, 502, "sandbox_failed", true },
	{ KILN_E_PORT_CLOSED, 502, "port_closed", true },
	{ KILN_E_PORT_TIMEOUT, 504, "port_timeout", true },
	{ KILN_E_NO_CAPACITY, 503, "no_capacity", true },
	{ KILN_E_UNAVAILABLE, 503, "unavailable", true },
	{ KILN_E_IO, 500, "internal", false },
	{ KILN_E_NOMEM, 500, "internal", false },
	{ KILN_E_INTERNAL, 500, "internal", false },
	{ (enum kiln_err)(KILN_E__COUNT + 7), 500, "internal", false },
};
#define NEXPECTED (sizeof(expected) / sizeof(expected[0]))

/* GET /e/{n}: replies the error `n` with a detail naming it. */
static void reply_code(struct http_req *req)
{
	int n = atoi(http_req_param(req, "n"));

	http_reply_error(req, (enum kiln_err)n, "detail of %d", n);
}

static const struct http_route routes[] = {
	{ .method = "GET", .pattern = "/e/{n}", .handler = reply_code },
};

static size_t collect(char *data, size_t size, size_t n, void *cls)
{
	return buf_append(cls, data, size * n) == 0 ? size * n : 0;
}

/* GETs `url`; the status (0 when unreachable) and the body in `body`. */
static long get(const char *url, struct buf *body)
{
	CURL *c = curl_easy_init();
	long status = 0;

	if (!c)
		return 0;
	curl_easy_setopt(c, CURLOPT_URL, url);
	curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
	curl_easy_setopt(c, CURLOPT_WRITEDATA, body);
	curl_easy_setopt(c, CURLOPT_TIMEOUT, 10L);
	curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
	if (curl_easy_perform(c) == CURLE_OK)
		curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
	curl_easy_cleanup(c);
	return status;
}

static struct http_server *srv;

static void test_every_code_replies_as_it_always_did(void)
{
	CHECK_INT(NEXPECTED, KILN_E__COUNT); /* every code but KILN_OK, and one outside the enum */
	for (size_t i = 0; i < NEXPECTED; i++) {
		char url[128], detail[64];
		struct buf body;
		json_t *doc, *e;
		const char *id;
		long status;
		int failed_before = test_case_failed;

		snprintf(url, sizeof(url), "http://127.0.0.1:%u/e/%d", http_server_port(srv),
			 (int)expected[i].code);
		snprintf(detail, sizeof(detail), "detail of %d", (int)expected[i].code);
		test_case_failed = 0;
		buf_init(&body, 1 << 16);
		status = get(url, &body);
		CHECK_INT(status, expected[i].status);
		CHECK_INT(kiln_err_status(expected[i].code), expected[i].status);
		doc = json_loadb(body.data ? body.data : "", body.len, 0, NULL);
		e = json_object_get(doc, "error");
		CHECK(e != NULL);
		CHECK_STR(json_string_value(json_object_get(e, "code")), expected[i].api_code);
		CHECK_STR(json_string_value(json_object_get(e, "message")),
			  expected[i].shows_message ? detail : "internal error");
		id = json_string_value(json_object_get(e, "request_id"));
		CHECK(id && strncmp(id, "req_", 4) == 0);
		if (test_case_failed)
			fprintf(stderr, "  for code %d: %.*s\n", (int)expected[i].code,
				(int)body.len, body.data ? body.data : "");
		test_case_failed |= failed_before;
		json_decref(doc);
		buf_release(&body);
	}
}

/* Ports in routes and queries: 1..65535 in plain digits, nothing else. */
static void test_port_values(void)
{
	CHECK(http_port_value("1") == 1);
	CHECK(http_port_value("8080") == 8080);
	CHECK(http_port_value("65535") == 65535);
	CHECK(http_port_value("0") == -1);
	CHECK(http_port_value("65536") == -1);
	CHECK(http_port_value("008080") == -1);
	CHECK(http_port_value("+80") == -1);
	CHECK(http_port_value("80 ") == -1);
	CHECK(http_port_value("") == -1);
	CHECK(http_port_value(NULL) == -1);
}

int main(void)
{
	struct http_server_opts opts = {
		.listen = "127.0.0.1:0",
		.max_connections = 8,
		.body_max = 4096,
		.timeout_s = 10,
		.routes = routes,
		.nroutes = sizeof(routes) / sizeof(routes[0]),
	};
	struct kiln_error err = { 0 };
	int rc;

	curl_global_init(CURL_GLOBAL_DEFAULT);
	srv = http_server_start(&opts, &err);
	if (!srv) {
		fprintf(stderr, "cannot start the server: %s\n", err.msg);
		return 1;
	}
	TEST(test_every_code_replies_as_it_always_did);
	TEST(test_port_values);
	rc = test_summary();
	http_server_stop(srv, 2);
	curl_global_cleanup();
	return rc;
}
