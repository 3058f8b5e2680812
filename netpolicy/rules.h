/*
 * rules.h - egress rules: parsing, validation, canonical text and host-name matching.
 *
 * A rule is one of
 *   host            pypi.org                      (lowercased; at least two labels)
 *   host:port       api.example.com:443
 *   *.domain[:port] *.github.com                  (any depth of subdomain, never the apex)
 *   IPv4[/len][:port]   203.0.113.7, 198.51.100.0/24:443
 *   IPv6[/len]          2001:db8::1, 2001:db8::/32
 *   [IPv6[/len]]:port   [2001:db8::1]:443
 * A rule without a port covers TCP, UDP and ICMP echo; with one, TCP and UDP to that port. A rule
 * set parses completely or not at all; the first bad rule is named in the error (KILN_E_INVALID).
 */
#ifndef KILN_NETPOLICY_RULES_H
#define KILN_NETPOLICY_RULES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#define KILN_RULE_TEXT_MAX 272	/* canonical text, terminator included */
#define KILN_HOST_MAX 253	/* a DNS name without its final dot */
#define KILN_RULESET_MAX 2048	/* rules in one set (bpf/policy.h NP_MAX_RULESET) */

enum kiln_rule_kind {
	KILN_RULE_HOST,		/* exact name */
	KILN_RULE_WILDCARD,	/* any name strictly below `host` */
	KILN_RULE_NET4,		/* IPv4 address (plen 32) or CIDR */
	KILN_RULE_NET6,		/* IPv6 address (plen 128) or CIDR */
};

struct kiln_rule {
	enum kiln_rule_kind kind;
	uint16_t port;			/* host order; 0 = every port */
	uint8_t plen;			/* NET4/NET6: prefix length */
	uint8_t addr[16];		/* NET4/NET6: network order, IPv4 in the first 4 bytes */
	char host[KILN_HOST_MAX + 1];	/* HOST/WILDCARD: lowercase; WILDCARD without "*." */
};

struct kiln_ruleset {
	size_t n;
	struct kiln_rule *rules;	/* malloc'd; NULL when n == 0 */
};

/* Parses one rule. On failure names it in `err` and returns KILN_E_INVALID. */
enum kiln_err kiln_rule_parse(const char *text, struct kiln_rule *out, struct kiln_error *err);

/*
 * Parses `n` rule texts into `out` (duplicates folded). All or nothing: on failure `out` is left
 * empty and `err` names the first bad rule. More than KILN_RULESET_MAX rules is KILN_E_TOO_LARGE.
 */
enum kiln_err kiln_rules_parse(const char *const *texts, size_t n, struct kiln_ruleset *out,
			       struct kiln_error *err);

void kiln_ruleset_free(struct kiln_ruleset *rs);

/* Writes the canonical text of `r` (what GET returns). Returns its length, or -1 if too long. */
int kiln_rule_format(const struct kiln_rule *r, char *buf, size_t len);

/* Whether two rules are the same rule. */
bool kiln_rule_equal(const struct kiln_rule *a, const struct kiln_rule *b);

/*
 * Normalises a DNS name for matching (lowercase, final dot dropped) into `out`
 * (KILN_HOST_MAX + 1 bytes). Returns false when it is not a valid host name.
 */
bool kiln_host_normalize(const char *name, char *out);

/*
 * Host-name rules of `rs` that `name` (normalised) matches: writes their ports (0 = any) into
 * ports[] (at most `max`, duplicates folded) and returns how many matched.
 */
size_t kiln_rules_match_host(const struct kiln_ruleset *rs, const char *name, uint16_t *ports,
			     size_t max);

/* ---- the operator's denied ranges ---- */

/*
 * An address range (network order, bits past plen zero). The operator's list (config
 * `egress_deny`) is comma- or space-separated CIDRs or addresses; the word "host" stands for every
 * address of the host's netns. Nothing a tenant's rule says opens a denied range: a rule inside
 * one is refused, and the eBPF program checks deny before allow.
 */
struct kiln_cidr {
	int family;		/* 4 or 6 */
	uint8_t plen;
	uint8_t addr[16];
};

#define KILN_DENY_MAX 240	/* ranges per family (bpf/policy.h NP_MAX_DENY), host's included */

/* Always denied, whatever the operator's list: host, unspecified, loopback, link-local, sandboxes. */
#define KILN_EGRESS_DENY_FLOOR                                                                  \
	"host 0.0.0.0/8 127.0.0.0/8 169.254.0.0/16 ::/128 ::1/128 fe80::/10 10.200.0.0/16 "      \
	"fd6b:696c:6e00::/48"
/* The default of `egress_deny`: private, shared, multicast, reserved, mapped and NAT64 ranges. */
#define KILN_EGRESS_DENY_DEFAULT                                                                \
	"host,127.0.0.0/8,169.254.0.0/16,0.0.0.0/8,10.0.0.0/8,100.64.0.0/10,172.16.0.0/12,"     \
	"192.168.0.0/16,224.0.0.0/4,240.0.0.0/4,::1/128,fe80::/10,::/128,::ffff:0:0/96,"         \
	"64:ff9b::/96,64:ff9b:1::/48,100::/64,fc00::/7,fec0::/10,ff00::/8"

/* Parses "addr[/len]" (IPv4 or IPv6). Returns 0, or -EINVAL. */
int kiln_cidr_parse(const char *text, struct kiln_cidr *out);

/* Zeroes the bits of c->addr past c->plen. */
void kiln_cidr_mask(struct kiln_cidr *c);

/* Writes "addr/len". Returns its length, or -1 if it does not fit. */
int kiln_cidr_format(const struct kiln_cidr *c, char *buf, size_t len);

/*
 * Parses an `egress_deny` list, appending to out[*n] (at most max in all, duplicates folded);
 * sets *host when the list names "host". On failure `err` names the bad entry (KILN_E_INVALID).
 */
enum kiln_err kiln_cidrs_parse(const char *list, struct kiln_cidr *out, size_t max, size_t *n,
			       bool *host, struct kiln_error *err);

/* The first range of v[] that contains all of family/addr/plen, or NULL. */
const struct kiln_cidr *kiln_cidrs_cover(const struct kiln_cidr *v, size_t n, int family,
					 const uint8_t *addr, unsigned plen);

/*
 * Refuses (KILN_E_INVALID, naming the rule and the range) a rule set with an address rule inside
 * one of the denied ranges v[]. Rules wider than a denied range (0.0.0.0/0) are accepted: the
 * range stays denied inside them.
 */
enum kiln_err kiln_rules_check_deny(const struct kiln_ruleset *rs, const struct kiln_cidr *v,
				    size_t n, struct kiln_error *err);

#endif
