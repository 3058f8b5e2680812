/*
 * netns.h - a sandbox's network topology.
 *
 *   guest (VM)  eth0 172.16.0.2/30, fdff:6b69:6c6e::2/64, MAC 06:00:ac:10:00:02 (same in every VM)
 *      |
 *   netns "kiln-<id>":  tap0  172.16.0.1/30, fdff:6b69:6c6e::1/64, MAC 06:00:ac:10:00:01
 *                               (the VMM attaches here; eBPF policy on its tc ingress/egress;
 *                                the DNS proxy listens on 172.16.0.1:53)
 *                       kn0   10.200.B.(4i+2)/30, fd6b:696c:6e00:<i>::2/64  (uplink; eBPF 1:1
 *                               NAT guest <-> these addresses on its tc egress/ingress)
 *      | veth
 *   caller's netns:     kv<id> 10.200.B.(4i+1)/30, fd6b:696c:6e00:<i>::1/64
 *
 * `i` is a per-node sandbox index (0..KILN_NET_INDEX_MAX) the caller allocates; it picks the
 * per-sandbox addresses. The caller's netns must forward (and, to reach a real network, masquerade
 * 10.200.0.0/16 and fd6b:696c:6e00::/48); see docs/network-policy.md.
 *
 * Functions run `ip` (iproute2) and enter namespaces on the calling thread only.
 */
#ifndef KILN_NETPOLICY_NETNS_H
#define KILN_NETPOLICY_NETNS_H

#include <stdint.h>

#include "common/err.h"

#define KILN_NET_ID_MAX 13		/* sandbox short id: [a-z0-9]{1,13} -> "kv<id>" fits IFNAMSIZ */
#define KILN_NET_INDEX_MAX 16383	/* 10.200.0.0/16 in /30 blocks */
#define KILN_NET_TAP "tap0"		/* the guest's device, inside the sandbox netns */
#define KILN_NET_UPLINK "kn0"		/* the netns end of the veth */

#define KILN_GUEST_IP4 "172.16.0.2"
#define KILN_GATEWAY_IP4 "172.16.0.1"
#define KILN_GUEST_IP6 "fdff:6b69:6c6e::2"
#define KILN_GATEWAY_IP6 "fdff:6b69:6c6e::1"
#define KILN_GUEST_LL6 "fe80::400:acff:fe10:2"	/* EUI-64 of the guest MAC */
#define KILN_GUEST_MAC "06:00:ac:10:00:02"
#define KILN_GATEWAY_MAC "06:00:ac:10:00:01"
#define KILN_SANDBOX_NET4 "10.200.0.0/16"	/* every sandbox's host side */
#define KILN_SANDBOX_NET6 "fd6b:696c:6e00::/48"

struct kiln_sbnet_config {
	const char *id;		/* [a-z0-9]{1,13}, unique on the host */
	uint32_t index;		/* 0..KILN_NET_INDEX_MAX, unique on the node */
	int tap_uid;		/* owner of the TAP (the jailed VMM's uid), -1 for none */
	/*
	 * Tests only: instead of a TAP, a veth whose far end ("eth0", with the guest's addresses,
	 * MAC and routes) goes into this existing named netns and stands in for the VM.
	 */
	const char *standin_netns;
	/*
	 * Or the id of a namespace kiln_sbnet_create_tap() made: that namespace, its TAP and
	 * whatever runs in it or opened the TAP (a VMM started before its sandbox), becomes the
	 * sandbox's, bound under the sandbox's name too, instead of a new one made;
	 * kiln_sbnet_destroy(netns_from) then removes the old name only. (No device moves between
	 * namespaces: moving the TAP cost 20-40 ms on this host.)
	 */
	const char *netns_from;
};

struct kiln_sbnet {
	char id[KILN_NET_ID_MAX + 1];
	uint32_t index;
	char netns[24];		/* "kiln-<id>", under /run/netns */
	char host_if[16];	/* "kv<id>", in the caller's netns */
	uint8_t host_ip4[4];	/* host end of the veth */
	uint8_t nat_ip4[4];	/* the guest's address as the outside sees it */
	uint8_t host_ip6[16];
	uint8_t nat_ip6[16];
};

/* Fills `out` (names, addresses) for id/index without touching the system. */
enum kiln_err kiln_sbnet_describe(const char *id, uint32_t index, struct kiln_sbnet *out,
				  struct kiln_error *err);

/*
 * Creates the netns, TAP (or stand-in veth), veth pair, addresses, routes and forwarding sysctls.
 * If the netns already exists it is an error (KILN_E_CONFLICT); on any failure everything created
 * is removed again.
 */
enum kiln_err kiln_sbnet_create(const struct kiln_sbnet_config *cfg, struct kiln_sbnet *out,
				struct kiln_error *err);

/*
 * A namespace "kiln-<id>" holding only a TAP (KILN_NET_TAP, owned by `tap_uid`, down, no
 * address), for a VMM started before the sandbox it will serve exists: the sandbox's network,
 * made with `netns_from` = id, takes the namespace over with the VMM in it. The id is of the
 * sandboxes' kind and space; kiln_sbnet_destroy(id) removes it (its name, once taken over).
 * KILN_E_CONFLICT if it exists.
 */
enum kiln_err kiln_sbnet_create_tap(const char *id, int tap_uid, struct kiln_error *err);

/*
 * Removes the sandbox's netns (and with it the TAP and both veth ends). Idempotent. Close every
 * descriptor into the netns first (DNS proxy sockets), or the kernel keeps it alive.
 */
enum kiln_err kiln_sbnet_destroy(const char *id, struct kiln_error *err);

/*
 * Moves the calling thread into the sandbox netns; *saved receives a descriptor of the thread's
 * previous netns, for kiln_sbnet_leave(). Returns 0 or a negative errno.
 */
int kiln_sbnet_enter(const struct kiln_sbnet *net, int *saved);
int kiln_sbnet_leave(int saved);

/* A socket created inside the sandbox netns (it stays there). Returns the fd or a negative errno. */
int kiln_sbnet_socket(const struct kiln_sbnet *net, int domain, int type, int protocol);

/* Runs argv (argv[0] searched in PATH) and waits; stderr is captured into err. Internal use. */
enum kiln_err kiln_run(const char *const *argv, struct kiln_error *err);

#endif
