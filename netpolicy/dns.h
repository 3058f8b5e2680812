/*
 * dns.h - the per-sandbox DNS proxy and its message parser.
 *
 * The parser is pure (no I/O, no allocation) and treats every message as hostile: each read is
 * bounds-checked, compression pointers must point backwards and are followed a bounded number of
 * times, and counts are capped. The proxy runs one thread that serves every sandbox's socket
 * (172.16.0.1:53 inside each sandbox netns, UDP and TCP) and forwards to one upstream resolver:
 *   - egress open: every name is forwarded and answered;
 *   - rules exist: names no host rule covers get NXDOMAIN; for covered names, the A/AAAA answers
 *     (following CNAMEs of the question) are learnt into the sandbox's allow map, for
 *     max(TTL, min_ttl) and at most max_addrs_per_name addresses per name, before the answer is
 *     released; private, host, metadata and sandbox addresses are never learnt (DNS rebinding).
 */
#ifndef KILN_NETPOLICY_DNS_H
#define KILN_NETPOLICY_DNS_H

#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "netpolicy/netns.h"
#include "netpolicy/policy.h"

#define KILN_DNS_MAX_MSG 4096	/* largest query, and UDP answer, handled (larger ones are dropped) */
#define KILN_DNS_MAX_TCP_MSG 65535	/* largest answer over TCP (the protocol's own limit) */
#define KILN_DNS_TYPE_A 1
#define KILN_DNS_TYPE_CNAME 5
#define KILN_DNS_TYPE_AAAA 28
#define KILN_DNS_RCODE_NXDOMAIN 3
#define KILN_DNS_RCODE_REFUSED 5

struct kiln_dns_question {
	uint16_t id;
	uint16_t flags;
	char name[KILN_HOST_MAX + 2];	/* lowercase, no final dot; "" for the root */
	uint16_t qtype;
	uint16_t qclass;
	size_t end;			/* offset just past the question */
};

struct kiln_dns_addr {
	int family;		/* 4 or 6 */
	uint8_t addr[16];
	uint32_t ttl;
};

/*
 * Parses a query: a header with QR=0, opcode 0, exactly one question. Names with bytes outside
 * [A-Za-z0-9-_] are refused. Returns 0 or -1.
 */
int kiln_dns_parse_query(const uint8_t *msg, size_t len, struct kiln_dns_question *q);

/*
 * Parses an answer to `q` (at most KILN_DNS_MAX_TCP_MSG bytes): QR=1, the same single question
 * (name case-insensitive, type, class).
 * Collects into out[] (at most max) the A and AAAA records whose owner is the question's name or
 * a name a CNAME chain from it reaches. Sets *rcode. Returns the number collected, or -1.
 */
int kiln_dns_parse_answer(const uint8_t *msg, size_t len, const struct kiln_dns_question *q,
			  struct kiln_dns_addr *out, size_t max, int *rcode);

/* Builds a reply with `rcode` and no records to the query msg[0..qend). Returns its length or 0. */
size_t kiln_dns_make_error(const uint8_t *msg, size_t qend, int rcode, uint8_t *out, size_t cap);

/* ---- the proxy ---- */

struct kiln_dns_config {
	const char *upstream;		/* "203.0.113.53", "203.0.113.53:5353" or "[2001:db8::53]:53" */
	uint32_t min_ttl_s;		/* 0: 30 */
	uint32_t max_ttl_s;		/* 0: 3600 */
	uint32_t max_addrs_per_name;	/* 0: 16 */
	uint32_t timeout_ms;		/* upstream; 0: 3000 */
	uint32_t max_pending;		/* UDP queries one sandbox may have upstream at once; 0: 64.
					 * A query over it is answered REFUSED; other sandboxes'
					 * slots are their own, so one guest's flood never takes
					 * them. */
};

#define KILN_DNS_PENDING_DEFAULT 64
#define KILN_DNS_PENDING_MAX 4096

struct kiln_dns_proxy;

/* Starts the proxy thread. The upstream socket lives in the calling thread's netns. */
enum kiln_err kiln_dns_proxy_start(const struct kiln_dns_config *cfg, struct kiln_dns_proxy **out,
				   struct kiln_error *err);

/*
 * Serves the sandbox: binds 172.16.0.1:53 (UDP and TCP) inside its netns. `pol` must outlive the
 * registration (until kiln_dns_proxy_remove returns).
 */
enum kiln_err kiln_dns_proxy_add(struct kiln_dns_proxy *px, const struct kiln_sbnet *net,
				 struct kiln_policy *pol, struct kiln_error *err);

/* Stops serving the sandbox; when it returns, its sockets are closed. Idempotent. */
void kiln_dns_proxy_remove(struct kiln_dns_proxy *px, const char *sandbox_net_id);

/* Stops the thread and closes everything. Accepts NULL. */
void kiln_dns_proxy_stop(struct kiln_dns_proxy *px);

#endif
