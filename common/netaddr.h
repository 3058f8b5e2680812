/*
 * netaddr.h - classification of IP addresses for outbound connections to endpoints tenants name
 * (their storage buckets), and the operator's list of what is allowed anyway.
 *
 * An address is refused unless it is an ordinary public unicast address: loopback, link-local
 * (169.254.0.0/16 with the cloud metadata services, fe80::/10), private (RFC 1918, fc00::/7,
 * fec0::/10), shared (100.64.0.0/10), unspecified (0.0.0.0/8, ::), multicast, reserved and
 * documentation ranges, broadcast, and any address of this host's own interfaces. IPv6 forms that
 * carry an IPv4 address (IPv4-mapped ::ffff:a.b.c.d, IPv4-compatible ::a.b.c.d, NAT64
 * 64:ff9b::/96, 6to4 2002::/16) are judged by the IPv4 address inside; the local-use NAT64 prefix
 * 64:ff9b:1::/48 is private.
 *
 * The operator's allow list (config `storage_allow`) names hosts and networks that are reached
 * although refused by the rules above, e.g. a MinIO on the LAN: comma- or space-separated entries,
 * each an address ("10.0.5.7", "::1"), a network ("10.0.5.0/24", "fd00::/8") or a host name
 * ("minio.lan", matched without regard to case against the endpoint's host as written).
 */
#ifndef KILN_NETADDR_H
#define KILN_NETADDR_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

#include "common/err.h"

enum netaddr_class {
	NETADDR_PUBLIC = 0,
	NETADDR_UNSPECIFIED,
	NETADDR_LOOPBACK,
	NETADDR_LINK_LOCAL,
	NETADDR_PRIVATE,
	NETADDR_SHARED,		/* 100.64.0.0/10, carrier-grade NAT */
	NETADDR_MULTICAST,
	NETADDR_RESERVED,	/* reserved, documentation, benchmarking, broadcast */
	NETADDR_SELF,		/* an address of this host's interfaces */
	NETADDR_UNKNOWN,	/* not IPv4 or IPv6 */
};

/* A phrase for `c`: "a loopback address", "a private address", … */
const char *netaddr_class_text(enum netaddr_class c);

/*
 * The class of `sa` (AF_INET or AF_INET6) by its number alone (never NETADDR_SELF). IPv6 forms
 * embedding an IPv4 address are classified by that address.
 */
enum netaddr_class netaddr_classify(const struct sockaddr *sa);

/* Whether `sa` is an address of one of this host's interfaces (getifaddrs, read on each call). */
bool netaddr_is_self(const struct sockaddr *sa);

/* The operator's allow list, parsed. */
struct netaddr_allow;

/*
 * Parses `list` (NULL or "" gives an empty list). Returns KILN_OK with *out set (free with
 * netaddr_allow_free), or KILN_E_INVALID naming the bad entry, or KILN_E_NOMEM.
 */
enum kiln_err netaddr_allow_parse(const char *list, struct netaddr_allow **out,
				  struct kiln_error *err);
void netaddr_allow_free(struct netaddr_allow *a);

/* Whether `a` (may be NULL) allows host name `host` (may be NULL) or address `sa` (may be NULL). */
bool netaddr_allowed(const struct netaddr_allow *a, const char *host, const struct sockaddr *sa);

/*
 * The whole check of one address `sa` reached for endpoint host `host`: KILN_OK when it is public
 * and not this host's, or allowed by `a`; else KILN_E_INVALID with the message "the endpoint's
 * host resolves to <class text>, which is refused" (the address itself is never named: it would
 * tell a tenant what internal names resolve to).
 */
enum kiln_err netaddr_check(const struct netaddr_allow *a, const char *host,
			    const struct sockaddr *sa, struct kiln_error *err);

/*
 * netaddr_check() of every IPv4 and IPv6 address `host` (a name or an address literal) resolves
 * to: KILN_OK when all pass, netaddr_check's KILN_E_INVALID at the first refused, or
 * KILN_E_UNAVAILABLE ("the host cannot be resolved") when it resolves to none.
 */
enum kiln_err netaddr_check_host(const struct netaddr_allow *a, const char *host,
				 struct kiln_error *err);

#endif
