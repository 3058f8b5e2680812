/*
 * Unit tests of api/porturl.h: the Host parser of the ports listener, the signature of signed
 * URLs (forged, expired, another origin's), Kiln's cookies taken out of a Cookie header, the
 * signature's query parameter taken out of a target, and the chunked framing that bounds what
 * reaches a guest.
 */
#include <stdlib.h>
#include <string.h>

#include "api/porturl.h"
#include "test.h"

static void host_names(void)
{
	char id[PORTURL_ID_MAX];
	long port = 0;

	CHECK(porturl_host_parse("8000-abc234.localhost", "localhost", &port, id, sizeof(id)));
	CHECK_INT(port, 8000);
	CHECK_STR(id, "sb_abc234");
	/* the listener's port, case and a trailing dot do not matter */
	CHECK(porturl_host_parse("1-ABC.LocalHost.:8081", "localhost", &port, id, sizeof(id)));
	CHECK_INT(port, 1);
	CHECK_STR(id, "sb_abc");
	CHECK(porturl_host_parse("65535-x.ports.example.com", "ports.example.com", &port, id,
				 sizeof(id)));
	CHECK_INT(port, 65535);
	/* not a port URL */
	CHECK(!porturl_host_parse("localhost:8081", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("127.0.0.1:8081", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-abc.evil.com", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-abc.xlocalhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-abc.localhost.evil", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("0-abc.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("08000-abc.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("65536-abc.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("999999-abc.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("-abc.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-a_b.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-a.b.localhost", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-abc.localhost:80x", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse("8000-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa.localhost",
				  "localhost", &port, id, sizeof(id)));	/* 41 characters */
	CHECK(!porturl_host_parse("", "localhost", &port, id, sizeof(id)));
	CHECK(!porturl_host_parse(NULL, "localhost", &port, id, sizeof(id)));
}

static void signatures(void)
{
	unsigned char key[PORTURL_KEY_LEN], other[PORTURL_KEY_LEN];
	char tok[PORTURL_TOKEN_MAX], bad[PORTURL_TOKEN_MAX];

	memset(key, 7, sizeof(key));
	memset(other, 8, sizeof(other));
	porturl_sign(key, "sb_abc", 8000, 2000, tok);
	CHECK_INT(strlen(tok), 4 + 1 + 64);
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, tok, strlen(tok), 1999), PORTURL_OK);
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, tok, strlen(tok), 2000), PORTURL_EXPIRED);
	/* another origin, another key */
	CHECK_INT(porturl_verify(key, "sb_abc", 8001, tok, strlen(tok), 1), PORTURL_FORGED);
	CHECK_INT(porturl_verify(key, "sb_abd", 8000, tok, strlen(tok), 1), PORTURL_FORGED);
	CHECK_INT(porturl_verify(other, "sb_abc", 8000, tok, strlen(tok), 1), PORTURL_FORGED);
	/* a later expiry with the old MAC; a changed MAC; truncated; junk */
	strcpy(bad, tok);
	bad[0] = '3';
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, bad, strlen(bad), 1), PORTURL_FORGED);
	strcpy(bad, tok);
	bad[strlen(bad) - 1] ^= 1;
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, bad, strlen(bad), 1), PORTURL_FORGED);
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, tok, strlen(tok) - 1, 1), PORTURL_FORGED);
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, "", 0, 1), PORTURL_FORGED);
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, ".", 1, 1), PORTURL_FORGED);
	CHECK_INT(porturl_verify(key, "sb_abc", 8000, "99999999999999999999999.x", 25, 1),
		  PORTURL_FORGED);
}

static void cookies(void)
{
	char out[256];

	CHECK(porturl_cookie_strip("a=1; kiln_port=xyz; b=2", out, sizeof(out)));
	CHECK_STR(out, "a=1; b=2");
	CHECK(porturl_cookie_strip("kiln_port=xyz;KILN_other=1", out, sizeof(out)));
	CHECK_STR(out, "");
	CHECK(porturl_cookie_strip("session=abc", out, sizeof(out)));
	CHECK_STR(out, "session=abc");
	CHECK(porturl_cookie_strip("  x=1 ;  ;y", out, sizeof(out)));
	CHECK_STR(out, "x=1; y");
	/* the result may be longer than the header: never written past its buffer (the heap
	 * overflow the fuzz target found, with a buffer of the header's length) */
	const char *grows = "x=1;y=2;z=3";
	char *tight = malloc(strlen(grows) + 1), *roomy = malloc(2 * strlen(grows) + 1);

	CHECK(!porturl_cookie_strip(grows, tight, strlen(grows) + 1));
	CHECK_STR(tight, "x=1; y=2");
	CHECK(porturl_cookie_strip(grows, roomy, 2 * strlen(grows) + 1));
	CHECK_STR(roomy, "x=1; y=2; z=3");
	free(tight);
	free(roomy);
}

/* The verdict of the kiln_port cookies in the Cookie headers `hdrs` (NULL-terminated). */
static enum porturl_verdict cookie_verdict(const unsigned char *key, const char *const *hdrs)
{
	enum porturl_verdict v = PORTURL_NONE;

	for (; *hdrs; hdrs++)
		porturl_cookie_verify(*hdrs, key, "sb_abc", 8000, 1500, &v);
	return v;
}

static void cookie_verdicts(void)
{
	unsigned char key[PORTURL_KEY_LEN];
	char tok[PORTURL_TOKEN_MAX], old[PORTURL_TOKEN_MAX], other[PORTURL_TOKEN_MAX];
	char good[256], stale[256], tossed[256], tossed2[256], two[256];

	memset(key, 7, sizeof(key));
	porturl_sign(key, "sb_abc", 8000, 2000, tok);
	porturl_sign(key, "sb_abc", 8000, 1000, old);
	porturl_sign(key, "sb_evil", 8000, 2000, other);
	snprintf(good, sizeof(good), "a=1; kiln_port=%s ; b=2", tok);
	snprintf(stale, sizeof(stale), "kiln_port=%s", old);
	/* a cookie another sandbox's page set for the parent domain comes first: the genuine
	   one of this origin after it still counts, whichever order the browser sends them in */
	snprintf(tossed, sizeof(tossed), "kiln_port=%s; kiln_port=%s", other, tok);
	snprintf(tossed2, sizeof(tossed2), "kiln_port=junk; kiln_port=%s; kiln_port=%s", old, tok);
	snprintf(two, sizeof(two), "kiln_port=%s; kiln_port=junk", old);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ good, NULL }), PORTURL_OK);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ tossed, NULL }), PORTURL_OK);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ tossed2, NULL }), PORTURL_OK);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ "kiln_port=junk", good, NULL }), PORTURL_OK);
	/* expired over forged; forged alone; none */
	CHECK_INT(cookie_verdict(key, (const char *const[]){ stale, NULL }), PORTURL_EXPIRED);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ two, NULL }), PORTURL_EXPIRED);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ "kiln_port=junk; kiln_port=", NULL }),
		  PORTURL_FORGED);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ "a=1; xkiln_port=1; kiln_portx=2", NULL }),
		  PORTURL_NONE);
	CHECK_INT(cookie_verdict(key, (const char *const[]){ NULL }), PORTURL_NONE);
}

static void query(void)
{
	char out[256], v[128];

	CHECK(porturl_query_take("/a?kiln_sig=t.1&x=2", PORTURL_QUERY, out, v, sizeof(v)));
	CHECK_STR(out, "/a?x=2");
	CHECK_STR(v, "t.1");
	CHECK(porturl_query_take("/?x=1&kiln_sig=s&y=2&kiln_sig=u", PORTURL_QUERY, out, v, sizeof(v)));
	CHECK_STR(out, "/?x=1&y=2");
	CHECK_STR(v, "s");
	CHECK(porturl_query_take("/p?kiln_sig=s", PORTURL_QUERY, out, v, sizeof(v)));
	CHECK_STR(out, "/p");
	CHECK(!porturl_query_take("/p?kiln_sigx=1", PORTURL_QUERY, out, v, sizeof(v)));
	CHECK_STR(out, "/p?kiln_sigx=1");
	CHECK(!porturl_query_take("/p", PORTURL_QUERY, out, v, sizeof(v)));
	CHECK_STR(out, "/p");
}

/* Scans `s` in pieces of `step` bytes: the bytes that belong to the body, or -1. */
static long scan(const char *s, size_t step)
{
	struct porturl_chunked c = { 0 };
	size_t len = strlen(s), at = 0;

	while (at < len && !c.done) {
		size_t n = len - at < step ? len - at : step;
		ssize_t k = porturl_chunked_scan(&c, s + at, n);

		if (k < 0)
			return -1;
		at += (size_t)k;
		if ((size_t)k < n && !c.done)
			return -2;	/* stopped early without an end */
	}
	return c.done ? (long)at : -3;
}

static void chunked(void)
{
	const char *body = "5\r\nhello\r\n1a;ext=1\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\n\r\n";

	for (size_t step = 1; step <= 64; step++)
		CHECK_INT(scan(body, step), (long)strlen(body));
	/* a pipelined request after the end is not the body's */
	char two[256];

	snprintf(two, sizeof(two), "%sGET / HTTP/1.1\r\nAuthorization: Bearer x\r\n\r\n", body);
	CHECK_INT(scan(two, 1000), (long)strlen(body));
	CHECK_INT(scan("0\r\nX-Trailer: 1\r\n\r\nGET", 1000), 19);
	CHECK_INT(scan("3\nabc\n0\n\n", 1000), 9);	/* bare LFs */
	CHECK_INT(scan("z\r\n", 1000), -1);
	CHECK_INT(scan("\r\n", 1000), -1);
	CHECK_INT(scan("3\r\nabcd\r\n", 1000), -1);	/* data longer than its size */
	CHECK_INT(scan("fffffffffffffffffff\r\n", 1000), -1);	/* overflows */
	CHECK_INT(scan("5\r\nhel", 1000), -3);	/* not ended yet */
	char longline[5000];

	memset(longline, ' ', sizeof(longline));
	longline[0] = '1';
	longline[1] = ';';
	longline[sizeof(longline) - 1] = '\0';
	CHECK_INT(scan(longline, 1000), -1);
}

int main(void)
{
	TEST(host_names);
	TEST(signatures);
	TEST(cookies);
	TEST(cookie_verdicts);
	TEST(query);
	TEST(chunked);
	return test_summary();
}
