/*
 * test_dns.c - the DNS proxy's message parser against well-formed and hostile messages.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

#include "netpolicy/dns.h"
#include "test.h"

struct msg {
	uint8_t b[KILN_DNS_MAX_TCP_MSG + 16];
	size_t n;
};

static void put(struct msg *m, const void *p, size_t n)
{
	memcpy(m->b + m->n, p, n);
	m->n += n;
}

static void put16(struct msg *m, uint16_t v)
{
	uint8_t b[2] = {(uint8_t)(v >> 8), (uint8_t)v};
	put(m, b, 2);
}

static void put32(struct msg *m, uint32_t v)
{
	put16(m, (uint16_t)(v >> 16));
	put16(m, (uint16_t)v);
}

static void name(struct msg *m, const char *s)
{
	while (*s) {
		const char *dot = strchr(s, '.');
		size_t l = dot ? (size_t)(dot - s) : strlen(s);
		uint8_t lb = (uint8_t)l;
		put(m, &lb, 1);
		put(m, s, l);
		s += l + (dot ? 1 : 0);
	}
	uint8_t z = 0;
	put(m, &z, 1);
}

static void header(struct msg *m, uint16_t id, uint16_t flags, uint16_t qd, uint16_t an)
{
	m->n = 0;
	put16(m, id);
	put16(m, flags);
	put16(m, qd);
	put16(m, an);
	put16(m, 0);
	put16(m, 0);
}

static void question(struct msg *m, const char *n, uint16_t type)
{
	name(m, n);
	put16(m, type);
	put16(m, 1);
}

static void rr_a(struct msg *m, const char *owner, const char *ip, uint32_t ttl)
{
	uint8_t a[16];
	int v6 = strchr(ip, ':') != NULL;
	inet_pton(v6 ? AF_INET6 : AF_INET, ip, a);
	name(m, owner);
	put16(m, v6 ? KILN_DNS_TYPE_AAAA : KILN_DNS_TYPE_A);
	put16(m, 1);
	put32(m, ttl);
	put16(m, v6 ? 16 : 4);
	put(m, a, v6 ? 16 : 4);
}

static void rr_cname(struct msg *m, const char *owner, const char *target)
{
	struct msg t = {.n = 0};
	name(&t, target);
	name(m, owner);
	put16(m, KILN_DNS_TYPE_CNAME);
	put16(m, 1);
	put32(m, 60);
	put16(m, (uint16_t)t.n);
	put(m, t.b, t.n);
}

static void dns_query_parses(void)
{
	struct msg m;
	header(&m, 0x1234, 0x0100, 1, 0);
	question(&m, "Sub.Example.COM", KILN_DNS_TYPE_A);
	struct kiln_dns_question q;
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), 0);
	CHECK_STR(q.name, "sub.example.com");
	CHECK_INT(q.id, 0x1234);
	CHECK_INT(q.qtype, KILN_DNS_TYPE_A);
	CHECK_INT(q.end, m.n);
}

static void dns_query_rejects_hostile_input(void)
{
	struct msg m;
	struct kiln_dns_question q;
	header(&m, 1, 0x8100, 1, 0); /* a response */
	question(&m, "a.com", 1);
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), -1);
	header(&m, 1, 0x0100, 2, 0); /* two questions */
	question(&m, "a.com", 1);
	question(&m, "b.com", 1);
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), -1);
	header(&m, 1, 0x0100, 1, 0); /* a pointer to itself */
	put16(&m, 0xc00c);
	put16(&m, 1);
	put16(&m, 1);
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), -1);
	header(&m, 1, 0x0100, 1, 0); /* a label past the end */
	uint8_t l = 60;
	put(&m, &l, 1);
	put(&m, "abc", 3);
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), -1);
	header(&m, 1, 0x0100, 1, 0); /* a byte no host name has */
	question(&m, "a\x01.com", 1);
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), -1);
	CHECK_INT(kiln_dns_parse_query(m.b, 5, &q), -1);
	CHECK_INT(kiln_dns_parse_query(NULL, 0, &q), -1);
}

static int answer(struct msg *m, const char *qname, struct kiln_dns_addr *out, int *rcode)
{
	struct msg qm;
	header(&qm, 7, 0x0100, 1, 0);
	question(&qm, qname, KILN_DNS_TYPE_A);
	struct kiln_dns_question q;
	if (kiln_dns_parse_query(qm.b, qm.n, &q) < 0)
		return -2;
	return kiln_dns_parse_answer(m->b, m->n, &q, out, 16, rcode);
}

static void dns_answer_collects_question_and_cname_chain(void)
{
	struct msg m;
	header(&m, 7, 0x8180, 1, 5);
	question(&m, "alias.example.com", KILN_DNS_TYPE_A);
	rr_cname(&m, "alias.example.com", "real.cdn.test");
	rr_a(&m, "real.cdn.test", "203.0.113.17", 30);
	rr_a(&m, "unrelated.test", "203.0.113.99", 30); /* not reached from the question */
	rr_a(&m, "alias.example.com", "2001:db8::17", 90);
	rr_a(&m, "ALIAS.example.com", "198.51.100.1", 0x80000000u);
	struct kiln_dns_addr out[16];
	int rcode = -1;
	CHECK_INT(answer(&m, "alias.example.com", out, &rcode), 3);
	CHECK_INT(rcode, 0);
	CHECK_INT(out[0].family, 4);
	CHECK_INT(out[0].addr[3], 17);
	CHECK_INT(out[0].ttl, 30);
	CHECK_INT(out[1].family, 6);
	CHECK_INT(out[1].ttl, 90);
	CHECK_INT(out[2].ttl, 0);
}

static void dns_answer_rejects_mismatch_and_overruns(void)
{
	struct msg m;
	struct kiln_dns_addr out[16];
	int rcode;
	header(&m, 7, 0x8180, 1, 1);
	question(&m, "other.test", KILN_DNS_TYPE_A);
	rr_a(&m, "other.test", "203.0.113.1", 30);
	CHECK_INT(answer(&m, "asked.test", out, &rcode), -1);

	header(&m, 7, 0x8180, 1, 1);
	question(&m, "asked.test", KILN_DNS_TYPE_A);
	rr_a(&m, "asked.test", "203.0.113.1", 30);
	m.b[m.n - 5] = 0x40; /* rdlength far past the end */
	CHECK_INT(answer(&m, "asked.test", out, &rcode), -1);

	header(&m, 7, 0x8180, 1, 1);
	question(&m, "asked.test", KILN_DNS_TYPE_A);
	put16(&m, 0xc000 | (uint16_t)(m.n + 2)); /* a forward pointer */
	CHECK_INT(answer(&m, "asked.test", out, &rcode), -1);

	header(&m, 7, 0x0100, 1, 0); /* not a response */
	question(&m, "asked.test", KILN_DNS_TYPE_A);
	CHECK_INT(answer(&m, "asked.test", out, &rcode), -1);

	header(&m, 7, 0x8183, 1, 0);
	question(&m, "asked.test", KILN_DNS_TYPE_A);
	CHECK_INT(answer(&m, "asked.test", out, &rcode), 0);
	CHECK_INT(rcode, 3);
}

static void dns_error_reply_keeps_id_and_question(void)
{
	struct msg m;
	header(&m, 0xbeef, 0x0100, 1, 0);
	question(&m, "nope.test", KILN_DNS_TYPE_AAAA);
	struct kiln_dns_question q;
	CHECK_INT(kiln_dns_parse_query(m.b, m.n, &q), 0);
	uint8_t out[512];
	size_t n = kiln_dns_make_error(m.b, q.end, KILN_DNS_RCODE_NXDOMAIN, out, sizeof(out));
	CHECK_INT(n, m.n);
	CHECK_INT(out[0], 0xbe);
	CHECK_INT(out[1], 0xef);
	CHECK(out[2] & 0x80);
	CHECK_INT(out[3] & 0xf, 3);
	CHECK(memcmp(out + 12, m.b + 12, m.n - 12) == 0);
	struct kiln_dns_addr a[4];
	int rcode;
	CHECK_INT(kiln_dns_parse_answer(out, n, &q, a, 4, &rcode), 0);
	CHECK_INT(rcode, 3);
}

/* An answer too large for UDP (TCP carries up to 65535 bytes) parses; a larger one does not. */
static void dns_answer_large_over_tcp(void)
{
	static struct msg m;
	struct kiln_dns_addr a[16];
	int rcode = -1;

	header(&m, 7, 0x8180, 1, 400);
	question(&m, "big.test", KILN_DNS_TYPE_A);
	for (int i = 0; i < 400; i++) {
		char ip[32];
		snprintf(ip, sizeof(ip), "203.0.%d.%d", 113 + i / 250, 1 + i % 250);
		rr_a(&m, "big.test", ip, 60);
	}
	CHECK(m.n > KILN_DNS_MAX_MSG);
	CHECK_INT(answer(&m, "big.test", a, &rcode), 16);
	CHECK_INT(rcode, 0);
	CHECK_INT(a[15].addr[3], 16);
	m.n = KILN_DNS_MAX_TCP_MSG + 1;
	CHECK_INT(answer(&m, "big.test", a, &rcode), -1);
}

int main(void)
{
	TEST(dns_query_parses);
	TEST(dns_query_rejects_hostile_input);
	TEST(dns_answer_collects_question_and_cname_chain);
	TEST(dns_answer_rejects_mismatch_and_overruns);
	TEST(dns_error_reply_keeps_id_and_question);
	TEST(dns_answer_large_over_tcp);
	return test_summary();
}
