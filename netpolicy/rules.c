/*
 * rules.c - the egress rule parser (see rules.h). Input is hostile: every length is checked
 * before it is used, and nothing is trimmed or guessed.
 */
#include "netpolicy/rules.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the error message quotes of a bad rule. */
static void quote(const char *text, char *out, size_t len)
{
	size_t j = 0;
	for (size_t i = 0; text[i] && j + 5 < len; i++) {
		unsigned char c = (unsigned char)text[i];
		if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
			out[j++] = (char)c;
		else
			j += (size_t)snprintf(out + j, len - j, "\\x%02x", c);
		if (i >= 64) {
			j += (size_t)snprintf(out + j, len - j, "...");
			break;
		}
	}
	out[j < len ? j : len - 1] = '\0';
}

static enum kiln_err bad(struct kiln_error *err, const char *text, const char *why)
{
	char q[96];
	quote(text, q, sizeof(q));
	return kiln_error_set(err, KILN_E_INVALID, "invalid egress rule \"%s\": %s", q, why);
}

/* Decimal 1..65535, no sign, no leading zero. Returns 0 on failure. */
static uint16_t parse_port(const char *s, size_t n)
{
	if (n == 0 || n > 5 || s[0] == '0')
		return 0;
	unsigned v = 0;
	for (size_t i = 0; i < n; i++) {
		if (s[i] < '0' || s[i] > '9')
			return 0;
		v = v * 10 + (unsigned)(s[i] - '0');
	}
	return v <= 65535 ? (uint16_t)v : 0;
}

/* Decimal 0..max, no sign, no leading zero. Returns -1 on failure. */
static int parse_plen(const char *s, size_t n, int max)
{
	if (n == 0 || n > 3 || (s[0] == '0' && n > 1))
		return -1;
	int v = 0;
	for (size_t i = 0; i < n; i++) {
		if (s[i] < '0' || s[i] > '9')
			return -1;
		v = v * 10 + (s[i] - '0');
	}
	return v <= max ? v : -1;
}

/* Strict dotted quad: four decimal octets, no leading zeros. */
static bool parse_ip4(const char *s, size_t n, uint8_t out[4])
{
	char tmp[16];
	if (n == 0 || n >= sizeof(tmp))
		return false;
	memcpy(tmp, s, n);
	tmp[n] = '\0';
	int part = 0;
	size_t start = 0;
	for (size_t i = 0; i <= n; i++) {
		if (i == n || tmp[i] == '.') {
			size_t len = i - start;
			if (part > 3 || len == 0 || len > 3 || (len > 1 && tmp[start] == '0'))
				return false;
			int v = 0;
			for (size_t k = start; k < i; k++) {
				if (!isdigit((unsigned char)tmp[k]))
					return false;
				v = v * 10 + (tmp[k] - '0');
			}
			if (v > 255)
				return false;
			out[part++] = (uint8_t)v;
			start = i + 1;
		}
	}
	return part == 4;
}

static bool parse_ip6(const char *s, size_t n, uint8_t out[16])
{
	char tmp[INET6_ADDRSTRLEN + 1];
	if (n == 0 || n >= sizeof(tmp))
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isxdigit((unsigned char)s[i]) && s[i] != ':' && s[i] != '.')
			return false;
	memcpy(tmp, s, n);
	tmp[n] = '\0';
	return inet_pton(AF_INET6, tmp, out) == 1;
}

/* Whether bits past plen are all zero. */
static bool host_bits_zero(const uint8_t *a, int bytes, int plen)
{
	for (int i = 0; i < bytes; i++) {
		int bit0 = i * 8;
		uint8_t mask;
		if (bit0 + 8 <= plen)
			continue;
		if (bit0 >= plen)
			mask = 0xff;
		else
			mask = (uint8_t)(0xff >> (plen - bit0));
		if (a[i] & mask)
			return false;
	}
	return true;
}

/* Label rules of RFC 1123: letters, digits, hyphens inside; 1..63 bytes. */
static bool valid_host(const char *s, size_t n, bool need_two_labels)
{
	if (n == 0 || n > KILN_HOST_MAX)
		return false;
	size_t labels = 0, start = 0;
	bool last_all_digits = false;
	for (size_t i = 0; i <= n; i++) {
		if (i == n || s[i] == '.') {
			size_t len = i - start;
			if (len == 0 || len > 63 || s[start] == '-' || s[i - 1] == '-')
				return false;
			last_all_digits = true;
			for (size_t k = start; k < i; k++)
				if (!isdigit((unsigned char)s[k]))
					last_all_digits = false;
			labels++;
			start = i + 1;
			continue;
		}
		unsigned char c = (unsigned char)s[i];
		if (!isalnum(c) && c != '-')
			return false;
	}
	if (last_all_digits)
		return false;	/* "1.2.3" is neither a name nor an address */
	return !need_two_labels || labels >= 2;
}

enum kiln_err kiln_rule_parse(const char *text, struct kiln_rule *out, struct kiln_error *err)
{
	if (!text)
		return kiln_error_set(err, KILN_E_INVALID, "invalid egress rule: null");
	size_t n = strnlen(text, KILN_RULE_TEXT_MAX);
	memset(out, 0, sizeof(*out));
	if (n == 0)
		return bad(err, text, "empty");
	if (n >= KILN_RULE_TEXT_MAX)
		return bad(err, text, "too long");

	const char *addr = text;
	size_t alen = n;
	const char *port = NULL;
	size_t plen_port = 0;

	if (text[0] == '[') {
		const char *close = memchr(text, ']', n);
		if (!close)
			return bad(err, text, "missing ']'");
		addr = text + 1;
		alen = (size_t)(close - addr);
		size_t rest = n - (size_t)(close + 1 - text);
		if (rest) {
			if (close[1] != ':' || rest < 2)
				return bad(err, text, "expected ':port' after ']'");
			port = close + 2;
			plen_port = rest - 1;
		}
		const char *slash = memchr(addr, '/', alen);
		size_t a6 = slash ? (size_t)(slash - addr) : alen;
		if (!parse_ip6(addr, a6, out->addr))
			return bad(err, text, "not an IPv6 address");
		out->kind = KILN_RULE_NET6;
		out->plen = 128;
		if (slash) {
			int p = parse_plen(slash + 1, alen - a6 - 1, 128);
			if (p < 0)
				return bad(err, text, "prefix length must be 0..128");
			out->plen = (uint8_t)p;
		}
	} else {
		size_t colons = 0;
		for (size_t i = 0; i < n; i++)
			colons += text[i] == ':';
		if (colons > 1) {
			/* bare IPv6, no port possible */
			const char *slash = memchr(text, '/', n);
			size_t a6 = slash ? (size_t)(slash - text) : n;
			if (!parse_ip6(text, a6, out->addr))
				return bad(err, text, "not an IPv6 address (write a port as [addr]:port)");
			out->kind = KILN_RULE_NET6;
			out->plen = 128;
			if (slash) {
				int p = parse_plen(slash + 1, n - a6 - 1, 128);
				if (p < 0)
					return bad(err, text, "prefix length must be 0..128");
				out->plen = (uint8_t)p;
			}
		} else {
			if (colons == 1) {
				const char *c = memchr(text, ':', n);
				alen = (size_t)(c - text);
				port = c + 1;
				plen_port = n - alen - 1;
			}
			const char *slash = memchr(addr, '/', alen);
			size_t a4 = slash ? (size_t)(slash - addr) : alen;
			bool numeric = a4 > 0;
			for (size_t i = 0; i < a4; i++)
				if (!isdigit((unsigned char)addr[i]) && addr[i] != '.')
					numeric = false;
			if (numeric || slash) {
				if (!parse_ip4(addr, a4, out->addr))
					return bad(err, text, "not an IPv4 address");
				out->kind = KILN_RULE_NET4;
				out->plen = 32;
				if (slash) {
					int p = parse_plen(slash + 1, alen - a4 - 1, 32);
					if (p < 0)
						return bad(err, text, "prefix length must be 0..32");
					out->plen = (uint8_t)p;
				}
			} else {
				bool wild = alen >= 2 && addr[0] == '*' && addr[1] == '.';
				const char *h = wild ? addr + 2 : addr;
				size_t hl = wild ? alen - 2 : alen;
				if (!valid_host(h, hl, !wild))
					return bad(err, text,
						   wild ? "not a valid '*.domain'"
							: "not a valid host name, address or CIDR");
				out->kind = wild ? KILN_RULE_WILDCARD : KILN_RULE_HOST;
				for (size_t i = 0; i < hl; i++)
					out->host[i] = (char)tolower((unsigned char)h[i]);
				out->host[hl] = '\0';
			}
		}
	}
	if (port) {
		out->port = parse_port(port, plen_port);
		if (!out->port)
			return bad(err, text, "port must be 1..65535");
	}
	if (out->kind == KILN_RULE_NET4 && !host_bits_zero(out->addr, 4, out->plen))
		return bad(err, text, "address has bits set past the prefix length");
	if (out->kind == KILN_RULE_NET6 && !host_bits_zero(out->addr, 16, out->plen))
		return bad(err, text, "address has bits set past the prefix length");
	return KILN_OK;
}

bool kiln_rule_equal(const struct kiln_rule *a, const struct kiln_rule *b)
{
	if (a->kind != b->kind || a->port != b->port)
		return false;
	if (a->kind == KILN_RULE_HOST || a->kind == KILN_RULE_WILDCARD)
		return strcmp(a->host, b->host) == 0;
	return a->plen == b->plen && memcmp(a->addr, b->addr, 16) == 0;
}

enum kiln_err kiln_rules_parse(const char *const *texts, size_t n, struct kiln_ruleset *out,
			       struct kiln_error *err)
{
	out->n = 0;
	out->rules = NULL;
	if (n > KILN_RULESET_MAX)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "at most %d egress rules",
				      KILN_RULESET_MAX);
	if (n == 0)
		return KILN_OK;
	struct kiln_rule *rs = calloc(n, sizeof(*rs));
	if (!rs)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		enum kiln_err e = kiln_rule_parse(texts[i], &rs[k], err);
		if (e) {
			free(rs);
			return e;
		}
		bool dup = false;
		for (size_t j = 0; j < k && !dup; j++)
			dup = kiln_rule_equal(&rs[j], &rs[k]);
		if (!dup)
			k++;
	}
	out->n = k;
	out->rules = rs;
	return KILN_OK;
}

void kiln_ruleset_free(struct kiln_ruleset *rs)
{
	if (!rs)
		return;
	free(rs->rules);
	rs->rules = NULL;
	rs->n = 0;
}

int kiln_rule_format(const struct kiln_rule *r, char *buf, size_t len)
{
	char a[INET6_ADDRSTRLEN], net[INET6_ADDRSTRLEN + 8];
	int w;
	switch (r->kind) {
	case KILN_RULE_HOST:
	case KILN_RULE_WILDCARD:
		if (r->port)
			w = snprintf(buf, len, "%s%s:%u", r->kind == KILN_RULE_WILDCARD ? "*." : "",
				     r->host, r->port);
		else
			w = snprintf(buf, len, "%s%s", r->kind == KILN_RULE_WILDCARD ? "*." : "",
				     r->host);
		break;
	case KILN_RULE_NET4:
		inet_ntop(AF_INET, r->addr, a, sizeof(a));
		if (r->plen == 32)
			snprintf(net, sizeof(net), "%s", a);
		else
			snprintf(net, sizeof(net), "%s/%u", a, r->plen);
		w = r->port ? snprintf(buf, len, "%s:%u", net, r->port) : snprintf(buf, len, "%s", net);
		break;
	case KILN_RULE_NET6:
		inet_ntop(AF_INET6, r->addr, a, sizeof(a));
		if (r->plen == 128)
			snprintf(net, sizeof(net), "%s", a);
		else
			snprintf(net, sizeof(net), "%s/%u", a, r->plen);
		w = r->port ? snprintf(buf, len, "[%s]:%u", net, r->port)
			    : snprintf(buf, len, "%s", net);
		break;
	default:
		return -1;
	}
	return (w < 0 || (size_t)w >= len) ? -1 : w;
}

bool kiln_host_normalize(const char *name, char *out)
{
	size_t n = strnlen(name, KILN_HOST_MAX + 2);
	if (n > 0 && name[n - 1] == '.')
		n--;
	if (n == 0 || n > KILN_HOST_MAX)
		return false;
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)name[i];
		if (!isalnum(c) && c != '-' && c != '.' && c != '_')
			return false;
		out[i] = (char)tolower(c);
	}
	out[n] = '\0';
	return true;
}

size_t kiln_rules_match_host(const struct kiln_ruleset *rs, const char *name, uint16_t *ports,
			     size_t max)
{
	size_t nn = strlen(name), k = 0;
	for (size_t i = 0; i < rs->n; i++) {
		const struct kiln_rule *r = &rs->rules[i];
		bool m = false;
		if (r->kind == KILN_RULE_HOST) {
			m = strcmp(r->host, name) == 0;
		} else if (r->kind == KILN_RULE_WILDCARD) {
			size_t hl = strlen(r->host);
			m = nn > hl + 1 && name[nn - hl - 1] == '.' &&
			    memcmp(name + nn - hl, r->host, hl) == 0;
		}
		if (!m)
			continue;
		bool dup = false;
		for (size_t j = 0; j < k; j++)
			dup |= ports[j] == r->port;
		if (!dup && k < max)
			ports[k++] = r->port;
	}
	return k;
}

/* ---- the operator's denied ranges ---- */

void kiln_cidr_mask(struct kiln_cidr *c)
{
	unsigned bytes = c->family == 4 ? 4 : 16;
	for (unsigned i = 0; i < 16; i++) {
		unsigned lo = i * 8;
		if (i >= bytes || lo >= c->plen)
			c->addr[i] = 0;
		else if (c->plen - lo < 8)
			c->addr[i] &= (uint8_t)(0xffu << (8 - (c->plen - lo)));
	}
}

int kiln_cidr_parse(const char *text, struct kiln_cidr *out)
{
	char a[64];
	char *slash, *end;
	long plen;

	if (!text || strlen(text) >= sizeof(a) || !*text)
		return -EINVAL;
	snprintf(a, sizeof(a), "%s", text);
	memset(out, 0, sizeof(*out));
	slash = strchr(a, '/');
	if (slash)
		*slash = '\0';
	if (inet_pton(AF_INET, a, out->addr) == 1)
		out->family = 4;
	else if (inet_pton(AF_INET6, a, out->addr) == 1)
		out->family = 6;
	else
		return -EINVAL;
	plen = out->family == 4 ? 32 : 128;
	if (slash) {
		if (!isdigit((unsigned char)slash[1]))
			return -EINVAL;
		errno = 0;
		plen = strtol(slash + 1, &end, 10);
		if (errno || *end || plen < 0 || plen > (out->family == 4 ? 32 : 128))
			return -EINVAL;
	}
	out->plen = (uint8_t)plen;
	kiln_cidr_mask(out);
	return 0;
}

int kiln_cidr_format(const struct kiln_cidr *c, char *buf, size_t len)
{
	char a[INET6_ADDRSTRLEN];
	if (!inet_ntop(c->family == 4 ? AF_INET : AF_INET6, c->addr, a, sizeof(a)))
		return -1;
	int n = snprintf(buf, len, "%s/%u", a, (unsigned)c->plen);
	return n < 0 || (size_t)n >= len ? -1 : n;
}

enum kiln_err kiln_cidrs_parse(const char *list, struct kiln_cidr *out, size_t max, size_t *n,
			       bool *host, struct kiln_error *err)
{
	const char *s = list ? list : "";

	while (*s) {
		size_t len = strcspn(s, ", \t\n");
		if (len == 0) {
			s++;
			continue;
		}
		char tok[64];
		if (len >= sizeof(tok))
			return kiln_error_set(err, KILN_E_INVALID, "egress_deny: \"%.*s\" is not a "
					      "CIDR", 40, s);
		memcpy(tok, s, len);
		tok[len] = '\0';
		s += len;
		if (!strcmp(tok, "host")) {
			if (host)
				*host = true;
			continue;
		}
		struct kiln_cidr c;
		if (kiln_cidr_parse(tok, &c) < 0)
			return kiln_error_set(err, KILN_E_INVALID, "egress_deny: \"%s\" is not a CIDR",
					      tok);
		bool dup = false;
		for (size_t i = 0; i < *n && !dup; i++)
			dup = out[i].family == c.family && out[i].plen == c.plen &&
			      !memcmp(out[i].addr, c.addr, 16);
		if (dup)
			continue;
		if (*n >= max)
			return kiln_error_set(err, KILN_E_TOO_LARGE, "egress_deny: more than %zu ranges",
					      max);
		out[(*n)++] = c;
	}
	return KILN_OK;
}

const struct kiln_cidr *kiln_cidrs_cover(const struct kiln_cidr *v, size_t n, int family,
					 const uint8_t *addr, unsigned plen)
{
	for (size_t i = 0; i < n; i++) {
		if (v[i].family != family || v[i].plen > plen)
			continue;
		struct kiln_cidr c = {.family = family, .plen = v[i].plen};
		memcpy(c.addr, addr, family == 4 ? 4 : 16);
		kiln_cidr_mask(&c);
		if (!memcmp(c.addr, v[i].addr, 16))
			return &v[i];
	}
	return NULL;
}

enum kiln_err kiln_rules_check_deny(const struct kiln_ruleset *rs, const struct kiln_cidr *v,
				    size_t n, struct kiln_error *err)
{
	for (size_t i = 0; i < rs->n; i++) {
		const struct kiln_rule *r = &rs->rules[i];
		if (r->kind != KILN_RULE_NET4 && r->kind != KILN_RULE_NET6)
			continue;
		const struct kiln_cidr *d =
			kiln_cidrs_cover(v, n, r->kind == KILN_RULE_NET4 ? 4 : 6, r->addr, r->plen);
		if (!d)
			continue;
		char text[KILN_RULE_TEXT_MAX], range[64];
		if (kiln_rule_format(r, text, sizeof(text)) < 0)
			snprintf(text, sizeof(text), "?");
		if (kiln_cidr_format(d, range, sizeof(range)) < 0)
			snprintf(range, sizeof(range), "?");
		return kiln_error_set(err, KILN_E_INVALID,
				      "egress rule \"%s\" is inside the denied range %s "
				      "(the operator's egress_deny): no rule can open it", text, range);
	}
	return KILN_OK;
}
