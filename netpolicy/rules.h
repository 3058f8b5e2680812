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

#endif
