/*
 * rtnl.h - the few route netlink requests a sandbox's network is made of (netns.c), sent from
 * the node's own thread instead of one `ip` process each: on a loaded host every process started
 * waits its turn for a core, and a sandbox's network took about twenty of them.
 *
 * A struct rtnl is a route netlink socket of the network namespace the calling thread was in
 * when it was opened; it keeps talking to that namespace wherever the thread goes afterwards.
 * Every function returns 0 or a negative errno (the kernel's answer to the request).
 */
#ifndef KILN_NETPOLICY_RTNL_H
#define KILN_NETPOLICY_RTNL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

struct rtnl {
	int fd;
	uint32_t seq;
};

/* Opens a socket of the calling thread's network namespace; rtnl_close closes it. */
int rtnl_open(struct rtnl *r);
void rtnl_close(struct rtnl *r);

/*
 * A veth pair: `name` here, `peer` in the network namespace `peer_netns_fd` (a descriptor of
 * /run/netns/... or /proc/.../ns/net). Both ends down, no address.
 */
int rtnl_veth_add(struct rtnl *r, const char *name, const char *peer, int peer_netns_fd);

/* Sets link `ifindex` up. */
int rtnl_link_up(struct rtnl *r, int ifindex);

/* Sets the hardware address of link `ifindex`. */
int rtnl_link_set_mac(struct rtnl *r, int ifindex, const uint8_t mac[6]);

/*
 * Adds address `addr`/`plen` (AF_INET: 4 bytes, AF_INET6: 16, the latter without duplicate
 * address detection, as `ip addr add ... nodad`) to link `ifindex`.
 */
int rtnl_addr_add(struct rtnl *r, int ifindex, int family, const uint8_t *addr, unsigned plen);

/* The default route of `family` in the main table, via `gw` on link `oif`. */
int rtnl_route_default(struct rtnl *r, int family, const uint8_t *gw, int oif);

/*
 * The policy rule "fwmark `mark` lookup `table`" of `family` (as `ip rule add`, the kernel
 * choosing its priority), added, or deleted when `add` is false (-ENOENT when there is none).
 */
int rtnl_rule_fwmark(struct rtnl *r, int family, uint32_t mark, uint32_t table, bool add);

/*
 * In `table`, every address of `family` local, on link `oif` (as `ip route replace local
 * 0.0.0.0/0 dev lo table T`): replaces such a route when there is one.
 */
int rtnl_route_local_all(struct rtnl *r, int family, uint32_t table, int oif);

/*
 * A persistent TAP device `name` (no packet information, as `ip tuntap add mode tap`) in the
 * calling thread's network namespace, usable by `owner` (the jailed VMM's uid), or by root only
 * when `owner` is (uid_t)-1.
 */
int rtnl_tap_add(const char *name, uid_t owner);

/*
 * A new network namespace bound at `path` (a new file under /run/netns, as `ip netns add`
 * makes it; /run/netns made a shared mount point first, so other mount namespaces see it). The
 * calling thread's own namespace is unchanged on return. Returns a descriptor of the new
 * namespace (the caller closes it), or a negative errno with nothing left behind.
 */
int rtnl_netns_add(const char *path);

/*
 * The network namespace bound at `from` (a file under /run/netns) bound at `path` too (a new
 * file there): one namespace under two names, either removable alone. Returns a descriptor of
 * it, or a negative errno (-ENOENT: `from` is not there; -EINVAL: it is no network namespace)
 * with nothing left behind.
 */
int rtnl_netns_bind(const char *from, const char *path);

/*
 * The name `path` of a network namespace removed, as `ip netns del` does it (a lazy unmount, then
 * the file unlinked), without a process: the namespace itself goes once nothing else holds it
 * (another name, a process in it, a descriptor). 0 or a negative errno.
 */
int rtnl_netns_unbind(const char *path);

#endif
