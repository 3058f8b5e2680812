/*
 * netaddr.c - the address classes and the operator's allow list of netaddr.h.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/netaddr.h"

#define HOST_MAX 253

struct allow_entry {
	bool is_host;
	char host[HOST_MAX + 1];	/* lower case */
	int family;			/* AF_INET or AF_INET6 */
	uint8_t addr[16];		/* 4 bytes for AF_INET */
	unsigned prefix;		/* bits */
};

struct netaddr_allow {
	size_t n;
	struct allow_entry e[];
};

const char *netaddr_class_text(enum netaddr_class c)
{
	switch (c) {
	case NETADDR_PUBLIC: return "a public address";
	case NETADDR_UNSPECIFIED: return "an unspecified address";
	case NETADDR_LOOPBACK: return "a loopback address";
	case NETADDR_LINK_LOCAL: return "a link-local address";
	case NETADDR_PRIVATE: return "a private address";
	case NETADDR_SHARED: return "a shared (carrier-grade NAT) address";
	case NETADDR_MULTICAST: return "a multicast address";
	case NETADDR_RESERVED: return "a reserved address";
	case NETADDR_SELF: return "an address of this host";
	case NETADDR_UNKNOWN: break;
	}
	return "an address of an unknown family";
}

static bool in4(uint32_t ip, uint32_t net, unsigned bits)
{
	return (ip >> (32 - bits)) == (net >> (32 - bits));
}

static enum netaddr_class classify4(uint32_t ip)
{
	if (in4(ip, 0x00000000, 8))
		return NETADDR_UNSPECIFIED;
	if (in4(ip, 0x7f000000, 8))
		return NETADDR_LOOPBACK;
	if (in4(ip, 0xa9fe0000, 16))
		return NETADDR_LINK_LOCAL;
	if (in4(ip, 0x0a000000, 8) || in4(ip, 0xac100000, 12) || in4(ip, 0xc0a80000, 16))
		return NETADDR_PRIVATE;
	if (in4(ip, 0x64400000, 10))
		return NETADDR_SHARED;
	if (in4(ip, 0xe0000000, 4))
		return NETADDR_MULTICAST;
	if (in4(ip, 0xf0000000, 4) ||		/* 240/4 and 255.255.255.255 */
	    in4(ip, 0xc0000000, 24) ||		/* 192.0.0/24 protocol assignments */
	    in4(ip, 0xc0000200, 24) ||		/* 192.0.2/24 documentation */
	    in4(ip, 0xc0586300, 24) ||		/* 192.88.99/24 6to4 relays */
	    in4(ip, 0xc6120000, 15) ||		/* 198.18/15 benchmarking */
	    in4(ip, 0xc6336400, 24) ||		/* 198.51.100/24 documentation */
	    in4(ip, 0xcb007100, 24))		/* 203.0.113/24 documentation */
		return NETADDR_RESERVED;
	return NETADDR_PUBLIC;
}

static uint32_t be32(const uint8_t *b)
{
	return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
}

static bool all_zero(const uint8_t *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (b[i])
			return false;
	return true;
}

/* The IPv4 address an IPv6 address carries (mapped, compatible, SIIT, NAT64, 6to4), if any. */
static bool embedded4(const uint8_t *b, uint32_t *ip)
{
	static const uint8_t nat64[12] = { 0x00, 0x64, 0xff, 0x9b };

	if (all_zero(b, 10) && b[10] == 0xff && b[11] == 0xff) {	/* ::ffff:a.b.c.d */
		*ip = be32(b + 12);
		return true;
	}
	if (all_zero(b, 8) && b[8] == 0xff && b[9] == 0xff && b[10] == 0 && b[11] == 0) {
		*ip = be32(b + 12);				/* ::ffff:0:a.b.c.d */
		return true;
	}
	if (all_zero(b, 12) && be32(b + 12) > 1) {		/* ::a.b.c.d */
		*ip = be32(b + 12);
		return true;
	}
	if (memcmp(b, nat64, 12) == 0) {			/* 64:ff9b::a.b.c.d */
		*ip = be32(b + 12);
		return true;
	}
	if (b[0] == 0x20 && b[1] == 0x02) {			/* 2002:aabb:ccdd::/48 */
		*ip = be32(b + 2);
		return true;
	}
	return false;
}

static enum netaddr_class classify6(const uint8_t *b)
{
	uint32_t ip;

	if (all_zero(b, 16))
		return NETADDR_UNSPECIFIED;
	if (all_zero(b, 15) && b[15] == 1)
		return NETADDR_LOOPBACK;
	if (embedded4(b, &ip)) {
		enum netaddr_class c = classify4(ip);
		/* a 6to4 or NAT64 form of a public address is itself public */
		return c;
	}
	if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && b[4] == 0 && b[5] == 1)
		return NETADDR_PRIVATE;				/* 64:ff9b:1::/48 local NAT64 */
	if (b[0] == 0xff)
		return NETADDR_MULTICAST;
	if (b[0] == 0xfe && (b[1] & 0xc0) == 0x80)
		return NETADDR_LINK_LOCAL;
	if ((b[0] & 0xfe) == 0xfc || (b[0] == 0xfe && (b[1] & 0xc0) == 0xc0))
		return NETADDR_PRIVATE;				/* fc00::/7, fec0::/10 */
	if ((b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x0d && b[3] == 0xb8) ||	/* 2001:db8::/32 */
	    (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x00 && b[3] == 0x00) ||	/* Teredo */
	    (b[0] == 0x3f && b[1] == 0xff && (b[2] & 0xf0) == 0))		/* 3fff::/20 */
		return NETADDR_RESERVED;
	if ((b[0] & 0xe0) != 0x20)			/* outside 2000::/3, global unicast */
		return NETADDR_RESERVED;
	return NETADDR_PUBLIC;
}

enum netaddr_class netaddr_classify(const struct sockaddr *sa)
{
	if (sa->sa_family == AF_INET)
		return classify4(ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr));
	if (sa->sa_family == AF_INET6)
		return classify6(((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr);
	return NETADDR_UNKNOWN;
}

/*
 * The address bytes of `sa` as the allow list and the self check compare them: IPv4 (4 bytes,
 * also for an IPv4-mapped IPv6 address) or IPv6 (16). Returns the family, 0 for another.
 */
static int addr_bytes(const struct sockaddr *sa, uint8_t out[16])
{
	if (sa->sa_family == AF_INET) {
		memcpy(out, &((const struct sockaddr_in *)sa)->sin_addr, 4);
		return AF_INET;
	}
	if (sa->sa_family == AF_INET6) {
		const uint8_t *b = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;

		if (all_zero(b, 10) && b[10] == 0xff && b[11] == 0xff) {
			memcpy(out, b + 12, 4);
			return AF_INET;
		}
		memcpy(out, b, 16);
		return AF_INET6;
	}
	return 0;
}

bool netaddr_is_self(const struct sockaddr *sa)
{
	struct ifaddrs *ifs = NULL;
	uint8_t want[16], have[16];
	int fam = addr_bytes(sa, want);
	bool found = false;

	if (!fam || getifaddrs(&ifs) != 0)
		return false;
	for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
		if (!i->ifa_addr || addr_bytes(i->ifa_addr, have) != fam)
			continue;
		found = memcmp(want, have, fam == AF_INET ? 4 : 16) == 0;
	}
	freeifaddrs(ifs);
	return found;
}

static bool valid_host(const char *h, size_t n)
{
	if (n == 0 || n > HOST_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)h[i]) && h[i] != '-' && h[i] != '.')
			return false;
	return true;
}

/* Parses one entry (`len` bytes of `s`) into `e`. */
static bool parse_entry(const char *s, size_t len, struct allow_entry *e)
{
	char text[HOST_MAX + 1], *slash;
	unsigned max;

	if (len > HOST_MAX)
		return false;
	memcpy(text, s, len);
	text[len] = '\0';
	memset(e, 0, sizeof(*e));
	slash = strchr(text, '/');
	if (slash)
		*slash = '\0';
	if (inet_pton(AF_INET, text, e->addr) == 1) {
		e->family = AF_INET;
		max = 32;
	} else if (inet_pton(AF_INET6, text, e->addr) == 1) {
		e->family = AF_INET6;
		max = 128;
		if (all_zero(e->addr, 10) && e->addr[10] == 0xff && e->addr[11] == 0xff && !slash) {
			memmove(e->addr, e->addr + 12, 4);	/* ::ffff:a.b.c.d is a.b.c.d */
			e->family = AF_INET;
			max = 32;
		}
	} else {
		struct in_addr odd;

		/* "2130706433" or "0x7f.1" are IPv4 addresses to inet_aton: no names, no addresses */
		if (slash || !valid_host(text, len) || inet_aton(text, &odd))
			return false;
		e->is_host = true;
		for (size_t i = 0; i < len; i++)
			e->host[i] = (char)tolower((unsigned char)text[i]);
		return true;
	}
	e->prefix = max;
	if (slash) {
		char *end;
		unsigned long p = strtoul(slash + 1, &end, 10);

		if (!isdigit((unsigned char)slash[1]) || *end || p > max)
			return false;
		e->prefix = (unsigned)p;
	}
	return true;
}

enum kiln_err netaddr_allow_parse(const char *list, struct netaddr_allow **out,
				  struct kiln_error *err)
{
	struct netaddr_allow *a;
	size_t n = 0;
	const char *p;

	*out = NULL;
	list = list ? list : "";
	for (p = list; *p; p++)
		n += *p == ',' || *p == ' ';
	a = calloc(1, sizeof(*a) + (n + 1) * sizeof(a->e[0]));
	if (!a)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (p = list; *p;) {
		size_t len = strcspn(p, ", \t");

		if (len && !parse_entry(p, len, &a->e[a->n])) {
			kiln_error_set(err, KILN_E_INVALID,
				       "storage_allow: \"%.*s\" is not an address, a network or a host name",
				       (int)(len > 64 ? 64 : len), p);
			free(a);
			return KILN_E_INVALID;
		}
		a->n += len != 0;
		p += len;
		p += strspn(p, ", \t");
	}
	*out = a;
	return KILN_OK;
}

void netaddr_allow_free(struct netaddr_allow *a)
{
	free(a);
}

static bool prefix_match(const uint8_t *a, const uint8_t *b, unsigned bits)
{
	size_t whole = bits / 8;
	unsigned rest = bits % 8;

	if (memcmp(a, b, whole) != 0)
		return false;
	return rest == 0 || ((a[whole] ^ b[whole]) & (uint8_t)(0xff << (8 - rest))) == 0;
}

bool netaddr_allowed(const struct netaddr_allow *a, const char *host, const struct sockaddr *sa)
{
	uint8_t b[16];
	int fam = sa ? addr_bytes(sa, b) : 0;

	for (size_t i = 0; a && i < a->n; i++) {
		const struct allow_entry *e = &a->e[i];

		if (e->is_host) {
			if (host && strcasecmp(host, e->host) == 0)
				return true;
		} else if (fam == e->family && prefix_match(b, e->addr, e->prefix)) {
			return true;
		}
	}
	return false;
}

enum kiln_err netaddr_check(const struct netaddr_allow *a, const char *host,
			    const struct sockaddr *sa, struct kiln_error *err)
{
	enum netaddr_class c = netaddr_classify(sa);

	if (c == NETADDR_PUBLIC && netaddr_is_self(sa))
		c = NETADDR_SELF;
	if (c == NETADDR_PUBLIC || netaddr_allowed(a, host, sa))
		return KILN_OK;
	return kiln_error_set(err, KILN_E_INVALID,
			      "the endpoint's host resolves to %s, which is refused",
			      netaddr_class_text(c));
}

enum kiln_err netaddr_check_host(const struct netaddr_allow *a, const char *host,
				 struct kiln_error *err)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
	struct addrinfo *res = NULL;
	enum kiln_err rc = KILN_OK;
	int n = 0;

	if (getaddrinfo(host, NULL, &hints, &res) != 0)
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "the host cannot be resolved");
	for (struct addrinfo *ai = res; ai && rc == KILN_OK; ai = ai->ai_next) {
		if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6)
			continue;
		rc = netaddr_check(a, host, ai->ai_addr, err);
		n++;
	}
	freeaddrinfo(res);
	if (rc == KILN_OK && n == 0)
		rc = kiln_error_set(err, KILN_E_UNAVAILABLE, "the host cannot be resolved");
	return rc;
}
