/*
 * porturl_fuzz.c - libFuzzer target for the pure parts of port URLs (api/porturl.c), whose input
 * is any client of the gateway's port URL listener: Host names, signature tokens, Cookie headers,
 * request targets and chunked bodies.
 *
 * Input: a selector byte, then (selector % 4) 0: a Host header, parsed against the domain
 * "localhost"; 1: a chunked body, scanned whole and again in pieces cut where the following byte
 * says; 2: a Cookie header, stripped of Kiln's cookies, and a target, stripped of the signature
 * parameter; 3: a token, verified for a fixed sandbox and port. Oracle: no crash, leak or UB; a
 * parsed Host gives a port 1..65535 and an id "sb_" + [a-z0-9]; the chunked framing gives the
 * same answer however the body is cut, and never counts more bytes than it was given; a stripped
 * Cookie keeps no kiln_ cookie and is never longer than its input; a stripped target keeps no
 * kiln_sig parameter; no token but the one signed is accepted.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "api/porturl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                             \
	do {                                                                                    \
		if (!(cond)) {                                                                  \
			fprintf(stderr, "porturl_fuzz: %s:%d: %s\n", __FILE__, __LINE__, #cond);    \
			abort();                                                                \
		}                                                                               \
	} while (0)

static void host(const char *s)
{
	char id[PORTURL_ID_MAX];
	long port = 0;

	if (!porturl_host_parse(s, "localhost", &port, id, sizeof(id)))
		return;
	CHECK(port >= 1 && port <= 65535);
	CHECK(strncmp(id, "sb_", 3) == 0 && id[3]);
	for (const char *c = id + 3; *c; c++)
		CHECK((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9'));
}

/* The scan of `s` in pieces: the body's length, -1 malformed, -2 not ended. */
static long scan(const uint8_t *s, size_t len, size_t step)
{
	struct porturl_chunked c = { 0 };
	size_t at = 0;

	while (at < len && !c.done) {
		size_t n = len - at < step ? len - at : step;
		ssize_t k = porturl_chunked_scan(&c, (const char *)s + at, n);

		if (k < 0)
			return -1;
		CHECK((size_t)k <= n);
		at += (size_t)k;
		if ((size_t)k < n)
			CHECK(c.done);
	}
	return c.done ? (long)at : -2;
}

static void chunked(const uint8_t *s, size_t len)
{
	if (len == 0)
		return;
	size_t step = 1 + s[0] % 17;
	long whole = scan(s + 1, len - 1, len);

	CHECK(whole == scan(s + 1, len - 1, step));
	CHECK(whole == scan(s + 1, len - 1, 1));
	CHECK(whole <= (long)(len - 1));
}

static void strip(const char *s, size_t len)
{
	char *out = malloc(2 * len + 1), *val = malloc(len + 1), *tight = malloc(len + 1);
	const char *p;

	if (!out || !val || !tight)
		goto out;
	CHECK(porturl_cookie_strip(s, out, 2 * len + 1));	/* the documented bound always holds */
	CHECK(strlen(out) <= 2 * len);
	porturl_cookie_strip(s, tight, len + 1);	/* too small at times: never written past */
	CHECK(strlen(tight) <= len);
	/* no kept cookie's name starts with kiln_ (pairs end at ';'; a name starts after spaces) */
	for (p = out; p; p = strchr(p, ';') ? strchr(p, ';') + 1 : NULL) {
		p += strspn(p, " \t");
		CHECK(strncasecmp(p, "kiln_", 5) != 0);
	}
	if (s[0] == '/') {
		porturl_query_take(s, PORTURL_QUERY, out, val, len + 1);
		CHECK(strlen(out) <= len);
		const char *q = strchr(out, '?');

		for (p = q; p && *p; p = strchr(p + 1, '&'))
			CHECK(strncmp(p + 1, PORTURL_QUERY "=", strlen(PORTURL_QUERY) + 1) != 0);
	}
out:
	free(out);
	free(val);
	free(tight);
}

static void token(const char *s, size_t len)
{
	unsigned char key[PORTURL_KEY_LEN];
	char good[PORTURL_TOKEN_MAX];

	memset(key, 0x5a, sizeof(key));
	porturl_sign(key, "sb_fuzz", 8000, 4102444800LL, good);
	enum porturl_verdict v = porturl_verify(key, "sb_fuzz", 8000, s, len, 1000);

	if (v == PORTURL_OK)
		CHECK(len == strlen(good) && memcmp(s, good, len) == 0);
	CHECK(porturl_verify(key, "sb_fuzz", 8000, good, strlen(good), 1000) == PORTURL_OK);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char *s;

	if (size < 1)
		return 0;
	s = malloc(size);
	if (!s)
		return 0;
	memcpy(s, data + 1, size - 1);
	s[size - 1] = '\0';	/* the rest as text up to its first NUL */
	switch (data[0] % 4) {
	case 0:
		host(s);
		break;
	case 1:
		chunked(data + 1, size - 1);
		break;
	case 2:
		strip(s, strlen(s));
		break;
	case 3:
		token(s, strlen(s));
		break;
	}
	free(s);
	return 0;
}
