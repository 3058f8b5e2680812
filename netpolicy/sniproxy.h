/*
 * sniproxy.h - the name-checking transparent proxy: while a sandbox has host rules, its TCP
 * connections to ports 80 and 443 that only a learnt (DNS) address allows end here, never visible
 * to the guest as a proxy (same destination address and port, no CONNECT).
 *
 * np_from_guest hands each such SYN to this proxy's listener in the sandbox's netns
 * (bpf_sk_assign; bpf/policy.h NP_CFG_NAMECHECK). For each connection one thread reads the TLS
 * ClientHello's SNI or the HTTP request head's Host (netpolicy/sni.h) within 5 s, and connects
 * upstream, from the host's netns, to the address the guest dialled only when
 *   - the name matches a host rule for that port,
 *   - the sandbox's DNS proxy answered that very name with that address (kiln_policy_name_pinned),
 *   - the address is in no always-denied range (checked again here);
 * otherwise the guest's connection is reset and counted as a policy drop. It then splices bytes
 * both ways (TLS is never terminated here); on HTTP every request of the connection is checked
 * the same way; every second each connection checks its name again against the rules in force,
 * and a rule change that no longer allows it cuts it (both sides reset).
 *
 * Capacity is shared: at most max_conns_per_sandbox connections of one sandbox and max_conns of
 * the node at once, and at most handshakes_per_sandbox / handshakes new connections a second;
 * past them a new connection is reset at once (and counted), others are unaffected.
 */
#ifndef KILN_NETPOLICY_SNIPROXY_H
#define KILN_NETPOLICY_SNIPROXY_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "common/err.h"
#include "netpolicy/netns.h"
#include "netpolicy/policy.h"

#define KILN_SNIPROXY_CONNS_PER_SANDBOX_DEFAULT 256
#define KILN_SNIPROXY_CONNS_DEFAULT 4096
#define KILN_SNIPROXY_HANDSHAKES_PER_SANDBOX_DEFAULT 50
#define KILN_SNIPROXY_HANDSHAKES_DEFAULT 1000
#define KILN_SNIPROXY_NAME_TIMEOUT_MS 5000

/*
 * The hand-off point for a proxy that does more with a checked connection (the secrets'
 * injecting proxy, node/inject.c): called from the connection's thread after the name was read
 * and checked (it matches an allow rule and the dialled address was answered for it), before
 * anything is sent upstream. `pre` holds the bytes read from the guest so far (the ClientHello or
 * the first request head, and whatever followed); `upstream` is the checked address and port;
 * `sandbox_id` is the id the sandbox was added with (kiln_sbnet's network id).
 * Returns 1 when it took the connection (it now owns guest_fd and must close it), 0 to let the
 * proxy connect and splice as usual. NULL (the default): always splice.
 */
typedef int (*kiln_sniproxy_handoff_fn)(void *arg, const char *sandbox_id, int guest_fd,
					const void *pre, size_t pre_len, const char *host,
					const struct sockaddr_storage *upstream);

struct kiln_sniproxy_config {
	uint32_t max_conns_per_sandbox;	/* 0: the default */
	uint32_t max_conns;		/* the node's; 0: the default */
	uint32_t handshakes_per_sandbox;	/* new connections a second; 0: the default */
	uint32_t handshakes;		/* the node's; 0: the default */
	uint32_t name_timeout_ms;	/* 0: KILN_SNIPROXY_NAME_TIMEOUT_MS */
	kiln_sniproxy_handoff_fn handoff;
	void *handoff_arg;
};

struct kiln_sniproxy_stats {
	uint64_t accepted;	/* connections handed to the proxy */
	uint64_t spliced;	/* connected upstream after the check */
	uint64_t refused;	/* reset: bad name, no rule, address not answered for it, denied */
	uint64_t over_cap;	/* reset: over a connection or handshake cap */
	uint64_t cut;		/* live connections cut by a rule change */
	uint32_t live;		/* connections now */
};

struct kiln_sniproxy;

/* Starts the proxy (its accepting thread). Upstream sockets live in the calling thread's netns. */
enum kiln_err kiln_sniproxy_start(const struct kiln_sniproxy_config *cfg,
				  struct kiln_sniproxy **out, struct kiln_error *err);

/*
 * Serves the sandbox: the listeners (IPv4 and IPv6, IP_TRANSPARENT, on the gateway's addresses,
 * port NP_PROXY_PORT) in its netns, the policy route there (fwmark NP_PROXY_MARK: every address
 * local, table NP_PROXY_TABLE), then NP_CFG_NAMECHECK on. `pol` must outlive the registration.
 * Idempotent for the route (a restarted node adds it again).
 */
enum kiln_err kiln_sniproxy_add(struct kiln_sniproxy *px, const struct kiln_sbnet *net,
				struct kiln_policy *pol, struct kiln_error *err);

/*
 * Stops serving the sandbox: listeners closed, its live connections cut; returns once none of
 * its connection threads is left. Idempotent. NP_CFG_NAMECHECK stays on: until a proxy serves
 * the sandbox again (a restarted node), its name-checked SYNs are dropped, never let through.
 */
void kiln_sniproxy_remove(struct kiln_sniproxy *px, const char *sandbox_net_id);

/* Counters of one sandbox (NULL: the node's). Returns -1 for an unknown sandbox. */
int kiln_sniproxy_stats(struct kiln_sniproxy *px, const char *sandbox_net_id,
			struct kiln_sniproxy_stats *out);

/* Stops everything (every sandbox removed first). Accepts NULL. */
void kiln_sniproxy_stop(struct kiln_sniproxy *px);

#endif
