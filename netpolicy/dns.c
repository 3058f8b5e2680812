/*
 * dns.c - a bounded parser for DNS messages (RFC 1035), for the DNS proxy (see dns.h).
 */
#include "netpolicy/dns.h"

#include <string.h>

#define HDR 12
#define MAX_JUMPS 32
#define MAX_RECORDS 256
#define MAX_CHAIN 16

static uint16_t rd16(const uint8_t *p)
{
	return (uint16_t)((p[0] << 8) | p[1]);
}

static uint32_t rd32(const uint8_t *p)
{
	return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/*
 * Reads the name at *off into out (lowercase, dotted, no final dot). strict: only
 * [A-Za-z0-9-_] in labels; otherwise other bytes become '?'. Advances *off past the name as
 * stored at its first position. Returns 0 or -1.
 */
static int read_name(const uint8_t *msg, size_t len, size_t *off, char *out, size_t cap,
		     int strict)
{
	size_t pos = *off, o = 0, after = 0;
	int jumps = 0;
	if (cap == 0)
		return -1;
	for (;;) {
		if (pos >= len)
			return -1;
		uint8_t l = msg[pos];
		if ((l & 0xc0) == 0xc0) {
			if (pos + 1 >= len)
				return -1;
			size_t target = ((size_t)(l & 0x3f) << 8) | msg[pos + 1];
			if (!jumps)
				after = pos + 2;
			if (target >= pos || ++jumps > MAX_JUMPS)
				return -1;	/* only backwards, bounded */
			pos = target;
			continue;
		}
		if (l & 0xc0)
			return -1;	/* 0x40 and 0x80 label types are not in use */
		if (l == 0) {
			if (!jumps)
				after = pos + 1;
			break;
		}
		if (pos + 1 + l > len)
			return -1;
		if (o + l + 1 >= cap)
			return -1;	/* longer than a name may be */
		if (o)
			out[o++] = '.';
		for (size_t i = 0; i < l; i++) {
			uint8_t c = msg[pos + 1 + i];
			int ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
				 c == '_' || (c >= 'A' && c <= 'Z');
			if (!ok && strict)
				return -1;
			if (c >= 'A' && c <= 'Z')
				c = (uint8_t)(c - 'A' + 'a');
			out[o++] = ok ? (char)c : '?';
		}
		pos += 1 + (size_t)l;
	}
	out[o] = '\0';
	*off = after;
	return 0;
}

int kiln_dns_parse_query(const uint8_t *msg, size_t len, struct kiln_dns_question *q)
{
	if (!msg || len < HDR || len > KILN_DNS_MAX_MSG)
		return -1;
	memset(q, 0, sizeof(*q));
	q->id = rd16(msg);
	q->flags = rd16(msg + 2);
	if (q->flags & 0x8000)
		return -1;	/* a response */
	if ((q->flags >> 11) & 0xf)
		return -1;	/* only standard queries */
	if (rd16(msg + 4) != 1 || rd16(msg + 6) != 0 || rd16(msg + 8) != 0)
		return -1;
	size_t off = HDR;
	if (read_name(msg, len, &off, q->name, sizeof(q->name), 1) < 0)
		return -1;
	if (off + 4 > len)
		return -1;
	q->qtype = rd16(msg + off);
	q->qclass = rd16(msg + off + 2);
	q->end = off + 4;
	return 0;
}

static int in_chain(char chain[][KILN_HOST_MAX + 2], size_t n, const char *name)
{
	for (size_t i = 0; i < n; i++)
		if (strcmp(chain[i], name) == 0)
			return 1;
	return 0;
}

struct rr {
	size_t owner_off;
	uint16_t type, cls;
	uint32_t ttl;
	size_t rdata, rdlen;
};

int kiln_dns_parse_answer(const uint8_t *msg, size_t len, const struct kiln_dns_question *q,
			  struct kiln_dns_addr *out, size_t max, int *rcode)
{
	if (!msg || len < HDR || len > KILN_DNS_MAX_TCP_MSG)
		return -1;
	uint16_t flags = rd16(msg + 2);
	if (!(flags & 0x8000))
		return -1;
	*rcode = flags & 0xf;
	if (rd16(msg + 4) != 1)
		return -1;
	size_t an = rd16(msg + 6);
	if (an > MAX_RECORDS)
		an = MAX_RECORDS;
	size_t off = HDR;
	char name[KILN_HOST_MAX + 2];
	if (read_name(msg, len, &off, name, sizeof(name), 0) < 0)
		return -1;
	if (off + 4 > len)
		return -1;
	if (strcmp(name, q->name) != 0 || rd16(msg + off) != q->qtype ||
	    rd16(msg + off + 2) != q->qclass)
		return -1;
	off += 4;

	struct rr rrs[MAX_RECORDS];
	size_t nrr = 0;
	for (size_t i = 0; i < an; i++) {
		struct rr r;
		r.owner_off = off;
		if (read_name(msg, len, &off, name, sizeof(name), 0) < 0)
			return -1;
		if (off + 10 > len)
			return -1;
		r.type = rd16(msg + off);
		r.cls = rd16(msg + off + 2);
		r.ttl = rd32(msg + off + 4);
		r.rdlen = rd16(msg + off + 8);
		r.rdata = off + 10;
		if (r.rdata + r.rdlen > len)
			return -1;
		off = r.rdata + r.rdlen;
		rrs[nrr++] = r;
	}

	/* the names the question reaches through CNAMEs, in the order they appear */
	static __thread char chain[MAX_CHAIN][KILN_HOST_MAX + 2];
	size_t nchain = 1;
	memcpy(chain[0], q->name, sizeof(chain[0]));
	for (int pass = 0; pass < MAX_CHAIN; pass++) {
		int grew = 0;
		for (size_t i = 0; i < nrr && nchain < MAX_CHAIN; i++) {
			if (rrs[i].type != KILN_DNS_TYPE_CNAME || rrs[i].cls != 1)
				continue;
			size_t o = rrs[i].owner_off;
			if (read_name(msg, len, &o, name, sizeof(name), 0) < 0 ||
			    !in_chain(chain, nchain, name))
				continue;
			char target[KILN_HOST_MAX + 2];
			o = rrs[i].rdata;
			if (read_name(msg, len, &o, target, sizeof(target), 0) < 0 ||
			    o > rrs[i].rdata + rrs[i].rdlen)
				continue;
			if (!in_chain(chain, nchain, target)) {
				memcpy(chain[nchain++], target, sizeof(chain[0]));
				grew = 1;
			}
		}
		if (!grew)
			break;
	}

	size_t n = 0;
	for (size_t i = 0; i < nrr && n < max; i++) {
		const struct rr *r = &rrs[i];
		if (r->cls != 1)
			continue;
		int fam = r->type == KILN_DNS_TYPE_A && r->rdlen == 4	   ? 4
			  : r->type == KILN_DNS_TYPE_AAAA && r->rdlen == 16 ? 6
									    : 0;
		if (!fam)
			continue;
		size_t o = r->owner_off;
		if (read_name(msg, len, &o, name, sizeof(name), 0) < 0 ||
		    !in_chain(chain, nchain, name))
			continue;
		memset(&out[n], 0, sizeof(out[n]));
		out[n].family = fam;
		memcpy(out[n].addr, msg + r->rdata, r->rdlen);
		out[n].ttl = r->ttl > 0x7fffffff ? 0 : r->ttl;
		n++;
	}
	return (int)n;
}

size_t kiln_dns_make_error(const uint8_t *msg, size_t qend, int rcode, uint8_t *out, size_t cap)
{
	if (qend < HDR || qend > cap || qend > KILN_DNS_MAX_MSG)
		return 0;
	memcpy(out, msg, qend);
	uint16_t flags = rd16(msg + 2);
	flags = (uint16_t)((flags & 0x7900) | 0x8000 | 0x0080 | (rcode & 0xf)); /* QR, opcode, RD, RA */
	out[2] = (uint8_t)(flags >> 8);
	out[3] = (uint8_t)flags;
	out[4] = 0;
	out[5] = 1;
	memset(out + 6, 0, 6);
	return qend;
}
