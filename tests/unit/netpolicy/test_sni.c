/*
 * test_sni.c - the name-checking proxy's parser: ClientHello SNI (whole, split across records and
 * segments, hostile), HTTP/1.x request heads (Host, smuggling shapes, CONNECT, h2c) and request
 * body framing (Content-Length, chunked).
 */
#include <stdio.h>
#include <string.h>

#include "netpolicy/sni.h"
#include "test.h"

struct msg {
	uint8_t b[KILN_SNI_MAX_IN + 4096];
	size_t n;
};

static void put(struct msg *m, const void *p, size_t n)
{
	memcpy(m->b + m->n, p, n);
	m->n += n;
}

static void put8(struct msg *m, unsigned v)
{
	uint8_t b = (uint8_t)v;
	put(m, &b, 1);
}

static void put16(struct msg *m, unsigned v)
{
	put8(m, v >> 8);
	put8(m, v);
}

static void put24(struct msg *m, unsigned v)
{
	put8(m, v >> 16);
	put16(m, v);
}

/* A ClientHello handshake message (header included) naming `sni` (NULL: no SNI extension),
 * with `pad` bytes of padding extension and, if ech, an encrypted_client_hello extension. */
static void hello_n(struct msg *m, const char *sni, size_t l, size_t pad, int ech)
{
	struct msg ext = {.n = 0};
	if (sni) {
		put16(&ext, 0);
		put16(&ext, (unsigned)(l + 5));
		put16(&ext, (unsigned)(l + 3));
		put8(&ext, 0);
		put16(&ext, (unsigned)l);
		put(&ext, sni, l);
	}
	put16(&ext, 10);	/* supported_groups */
	put16(&ext, 4);
	put16(&ext, 2);
	put16(&ext, 29);
	if (ech) {
		put16(&ext, 0xfe0d);
		put16(&ext, 1);
		put8(&ext, 0);
	}
	if (pad) {
		put16(&ext, 21);
		put16(&ext, (unsigned)pad);
		memset(ext.b + ext.n, 0, pad);
		ext.n += pad;
	}
	struct msg body = {.n = 0};
	put16(&body, 0x0303);
	memset(body.b + body.n, 7, 32);
	body.n += 32;
	put8(&body, 32);	/* session id */
	memset(body.b + body.n, 9, 32);
	body.n += 32;
	put16(&body, 4);
	put16(&body, 0x1301);
	put16(&body, 0x1302);
	put8(&body, 1);
	put8(&body, 0);
	put16(&body, (unsigned)ext.n);
	put(&body, ext.b, ext.n);
	m->n = 0;
	put8(m, 1);
	put24(m, (unsigned)body.n);
	put(m, body.b, body.n);
}

static void hello(struct msg *m, const char *sni, size_t pad, int ech)
{
	hello_n(m, sni, sni ? strlen(sni) : 0, pad, ech);
}

/* Wraps handshake bytes into TLS records of at most `frag` bytes each. */
static void records(struct msg *out, const struct msg *hs, size_t frag)
{
	out->n = 0;
	for (size_t off = 0; off < hs->n; off += frag) {
		size_t l = hs->n - off < frag ? hs->n - off : frag;
		put8(out, 0x16);
		put16(out, 0x0301);
		put16(out, (unsigned)l);
		put(out, hs->b + off, l);
	}
}

static struct msg hs, rec;

static void test_tls_whole(void)
{
	struct kiln_sni s;
	hello(&hs, "API.Example.com", 0, 0);
	records(&rec, &hs, 16384);
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_OK);
	CHECK_INT(s.kind, KILN_SNI_TLS);
	CHECK_STR(s.host, "api.example.com");
	CHECK_INT(s.head_len, rec.n);
	/* Every strict prefix is "more". */
	for (size_t n = 0; n < rec.n; n++)
		if (kiln_sni_parse(rec.b, n, &s) != KILN_SNI_MORE) {
			CHECK(!"prefix not MORE");
			fprintf(stderr, "at %zu\n", n);
			break;
		}
	/* Bytes after the ClientHello (a second record) change nothing. */
	put(&rec, "\x17\x03\x03\x00\x01x", 6);
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_OK);
	CHECK_STR(s.host, "api.example.com");
}

static void test_tls_split_records(void)
{
	struct kiln_sni s;
	/* A big ClientHello (post-quantum key shares make them 1.5-2 KiB; padding to 12 KiB here)
	 * split into records of 1, 7, 100 and 4000 bytes. */
	hello(&hs, "www.example.org", 12000, 0);
	size_t frags[] = {(hs.n + 63) / 64 /* the most records allowed */, 1000, 4000, 16384};
	for (size_t f = 0; f < sizeof(frags) / sizeof(frags[0]); f++) {
		records(&rec, &hs, frags[f]);
		CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_OK);
		CHECK_STR(s.host, "www.example.org");
	}
	/* 65 records: too many. */
	records(&rec, &hs, (hs.n + 64) / 65);
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_TOOBIG);
	/* Over 16 KiB: too big, seen from the header alone. */
	hello(&hs, "www.example.org", 16384, 0);
	records(&rec, &hs, 16384);
	CHECK_INT(kiln_sni_parse(rec.b, 64, &s), KILN_SNI_TOOBIG);
}

static void test_tls_hostile(void)
{
	struct kiln_sni s;
	hello(&hs, NULL, 0, 0);
	records(&rec, &hs, 16384);
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_NONAME);
	hello(&hs, "a.example.com", 0, 1);
	records(&rec, &hs, 16384);
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_REFUSED);
	/* A name with a NUL, a space, a final dot, an empty name. */
	const char *bad[] = {"a.example.com\0.evil.org", "a b.example.com", "a.example.com.", ""};
	size_t badlen[] = {23, 15, 14, 0};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		hello_n(&hs, bad[i], badlen[i], 0, 0);
		records(&rec, &hs, 16384);
		CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_BAD);
	}
	/* Two server_name extensions. */
	hello(&hs, "a.example.com", 0, 0);
	struct msg two = hs;
	size_t extoff = 4 + 2 + 32 + 1 + 32 + 2 + 4 + 2;	/* the extensions' length */
	size_t elen = (size_t)two.b[extoff] << 8 | two.b[extoff + 1];
	size_t sn = 4 + 5 + 13;
	memmove(two.b + extoff + 2 + sn, two.b + extoff + 2, two.n - extoff - 2);
	memcpy(two.b + extoff + 2, hs.b + extoff + 2, sn);
	two.n += sn;
	two.b[extoff] = (uint8_t)((elen + sn) >> 8);
	two.b[extoff + 1] = (uint8_t)(elen + sn);
	size_t bl = two.n - 4;
	two.b[1] = (uint8_t)(bl >> 16);
	two.b[2] = (uint8_t)(bl >> 8);
	two.b[3] = (uint8_t)bl;
	records(&rec, &two, 16384);
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_BAD);
	/* Not a handshake record in the middle; not a ClientHello; lengths lying. */
	hello(&hs, "a.example.com", 0, 0);
	records(&rec, &hs, 50);
	rec.b[55] = 0x17;
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_BAD);
	records(&rec, &hs, 16384);
	rec.b[5] = 2;
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_BAD);
	records(&rec, &hs, 16384);
	rec.b[5 + 4 + 34] = 33;	/* session id longer than 32 */
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_BAD);
	records(&rec, &hs, 16384);
	rec.b[3] = 0;
	rec.b[4] = 0;	/* empty record */
	CHECK_INT(kiln_sni_parse(rec.b, rec.n, &s), KILN_SNI_BAD);
	CHECK_INT(kiln_sni_parse((const uint8_t *)"\x00\x01", 2, &s), KILN_SNI_BAD);
}

static enum kiln_sni_status http(const char *head, struct kiln_sni *s)
{
	return kiln_sni_parse((const uint8_t *)head, strlen(head), s);
}

static void test_http_host(void)
{
	struct kiln_sni s;
	const char *r = "GET /x HTTP/1.1\r\nUser-Agent: t\r\nHost:  Deb.Debian.ORG:8080 \r\n\r\nNEXT";
	CHECK_INT(http(r, &s), KILN_SNI_OK);
	CHECK_INT(s.kind, KILN_SNI_HTTP);
	CHECK_STR(s.host, "deb.debian.org");
	CHECK_INT(s.port, 8080);
	CHECK_INT(s.head_len, strlen(r) - 4);
	CHECK_INT(s.body, KILN_BODY_NONE);
	for (size_t n = 0; n < strlen(r) - 4; n++)
		if (kiln_sni_parse((const uint8_t *)r, n, &s) != KILN_SNI_MORE) {
			CHECK(!"prefix not MORE");
			fprintf(stderr, "at %zu\n", n);
			break;
		}
	CHECK_INT(http("GET http://a.example.com/x HTTP/1.1\r\nHost: a.example.com\r\n\r\n", &s),
		  KILN_SNI_OK);
	CHECK_INT(http("GET http://a.example.com/ HTTP/1.0\r\n\r\n", &s), KILN_SNI_OK);
	CHECK_STR(s.host, "a.example.com");
	CHECK_INT(http("GET / HTTP/1.0\r\n\r\n", &s), KILN_SNI_NONAME);
	CHECK_INT(http("POST / HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: 12\r\n\r\n", &s),
		  KILN_SNI_OK);
	CHECK_INT(s.body, KILN_BODY_LENGTH);
	CHECK_INT(s.content_length, 12);
	CHECK_INT(http("POST / HTTP/1.1\r\nHost: a.example.com\r\nTransfer-Encoding: Chunked\r\n\r\n",
		       &s), KILN_SNI_OK);
	CHECK_INT(s.body, KILN_BODY_CHUNKED);
	CHECK_INT(http("GET / HTTP/1.1\r\nHost: a.example.com\r\nUpgrade: websocket\r\n\r\n", &s),
		  KILN_SNI_OK);
	CHECK_INT(s.upgrade, 1);
}

static void test_http_refused(void)
{
	struct kiln_sni s;
	const char *refused[] = {
		"CONNECT b.example.com:443 HTTP/1.1\r\nHost: b.example.com:443\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nConnection: Upgrade, HTTP2-Settings\r\n"
		"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nUpgrade: websocket, H2C\r\n\r\n",
	};
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
		if (http(refused[i], &s) != KILN_SNI_REFUSED) {
			CHECK(!"not refused");
			fprintf(stderr, "%s\n", refused[i]);
		}
	const char *bad[] = {
		"GET / HTTP/1.1\r\n\r\n",				/* 1.1 without Host */
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nHost: b.example.com\r\n\r\n",
		"GET / HTTP/1.1\nHost: a.example.com\r\n\r\n",		/* bare LF */
		"GET / HTTP/1.1\r\nHost: a.example.com\r\n\rX\r\n\r\n",	/* bare CR */
		"GET / HTTP/1.1\r\nX: y\r\n Host: b.example.com\r\nHost: a.example.com\r\n\r\n",
		"GET / HTTP/1.1\r\nHost : b.example.com\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: 1\r\n"
		"Transfer-Encoding: chunked\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: -1\r\n\r\n",
		"GET http://b.example.com/ HTTP/1.1\r\nHost: a.example.com\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: user@a.example.com\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a.example.com:99999\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: [2001:db8::1]\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a\x01.example.com\r\n\r\n",
		"GET / HTTP/2\r\nHost: a.example.com\r\n\r\n",
		"GET  / HTTP/1.1\r\nHost: a.example.com\r\n\r\n",
		"G(T / HTTP/1.1\r\nHost: a.example.com\r\n\r\n",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		if (http(bad[i], &s) != KILN_SNI_BAD) {
			CHECK(!"not bad");
			fprintf(stderr, "%zu: %s\n", i, bad[i]);
		}
	/* A head over 16 KiB. */
	static struct msg big;
	big.n = 0;
	put(&big, "GET / HTTP/1.1\r\nHost: a.example.com\r\nX: ", 40);
	memset(big.b + big.n, 'a', KILN_SNI_MAX_HEAD);
	big.n += KILN_SNI_MAX_HEAD;
	CHECK_INT(kiln_sni_parse(big.b, big.n, &s), KILN_SNI_TOOBIG);
	CHECK_INT(kiln_sni_parse(big.b, KILN_SNI_MAX_HEAD - 1, &s), KILN_SNI_MORE);
}

static long feed(struct kiln_body *b, const char *p, int *done)
{
	return kiln_body_feed(b, (const uint8_t *)p, strlen(p), done);
}

static void test_body(void)
{
	struct kiln_sni s;
	struct kiln_body b;
	int done;
	CHECK_INT(http("POST / HTTP/1.1\r\nHost: a.example.com\r\nContent-Length: 5\r\n\r\n", &s),
		  KILN_SNI_OK);
	kiln_body_start(&b, &s);
	CHECK_INT(feed(&b, "ab", &done), 2);
	CHECK_INT(done, 0);
	CHECK_INT(feed(&b, "cdeGET /", &done), 3);
	CHECK_INT(done, 1);

	CHECK_INT(http("POST / HTTP/1.1\r\nHost: a.example.com\r\nTransfer-Encoding: chunked\r\n\r\n",
		       &s), KILN_SNI_OK);
	const char *chunked = "5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-T: 1\r\n\r\nGET / HTTP/1.1";
	kiln_body_start(&b, &s);
	CHECK_INT(feed(&b, chunked, &done), strlen(chunked) - 14);
	CHECK_INT(done, 1);
	/* The same one byte at a time. */
	kiln_body_start(&b, &s);
	size_t total = 0;
	for (size_t i = 0; i < strlen(chunked) - 14; i++) {
		long n = kiln_body_feed(&b, (const uint8_t *)chunked + i, 1, &done);
		CHECK_INT(n, 1);
		total += (size_t)n;
		CHECK_INT(done, i == strlen(chunked) - 15);
	}
	CHECK_INT(total, strlen(chunked) - 14);
	const char *bad[] = {"x\r\n", "5\r\nhelloXX", "5\n", "\r\n", "fffffffffffffffff\r\n",
			     "0\r\nX\n"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		kiln_body_start(&b, &s);
		if (feed(&b, bad[i], &done) != -1) {
			CHECK(!"bad chunking accepted");
			fprintf(stderr, "%s\n", bad[i]);
		}
	}
	/* No body. */
	CHECK_INT(http("GET / HTTP/1.1\r\nHost: a.example.com\r\n\r\n", &s), KILN_SNI_OK);
	kiln_body_start(&b, &s);
	CHECK_INT(feed(&b, "GET", &done), 0);
	CHECK_INT(done, 1);
}

int main(void)
{
	TEST(test_tls_whole);
	TEST(test_tls_split_records);
	TEST(test_tls_hostile);
	TEST(test_http_host);
	TEST(test_http_refused);
	TEST(test_body);
	return test_summary();
}
