/*
 * netns.c - a sandbox's network namespace, TAP and veth (see netns.h).
 */
#include "netpolicy/netns.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/proc.h"
#include "netpolicy/rtnl.h"

enum kiln_err kiln_run(const char *const *argv, struct kiln_error *err)
{
	char msg[512];
	size_t len;
	int status, rc;

	rc = proc_run(argv, PROC_STDERR, msg, sizeof(msg), &status);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "cannot run \"%s\": %s", argv[0], strerror(-rc));
	len = strlen(msg);
	while (len && (msg[len - 1] == '\n' || msg[len - 1] == ' '))
		msg[--len] = '\0';
	if (status != 0) {
		char cmd[256];
		size_t c = 0;
		for (int i = 0; argv[i] && c < sizeof(cmd) - 1; i++)
			c += (size_t)snprintf(cmd + c, sizeof(cmd) - c, "%s%s", i ? " " : "", argv[i]);
		return kiln_error_set(err, KILN_E_IO, "\"%s\" failed: %s", cmd, msg);
	}
	return KILN_OK;
}

static bool valid_id(const char *id)
{
	size_t n = id ? strlen(id) : 0;
	if (n == 0 || n > KILN_NET_ID_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!((id[i] >= 'a' && id[i] <= 'z') || (id[i] >= '0' && id[i] <= '9')))
			return false;
	return true;
}

enum kiln_err kiln_sbnet_describe(const char *id, uint32_t index, struct kiln_sbnet *out,
				  struct kiln_error *err)
{
	memset(out, 0, sizeof(*out));
	if (!valid_id(id))
		return kiln_error_set(err, KILN_E_INVALID,
				      "sandbox network id must be 1..%d of [a-z0-9]", KILN_NET_ID_MAX);
	if (index > KILN_NET_INDEX_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "sandbox network index %u out of range",
				      index);
	snprintf(out->id, sizeof(out->id), "%s", id);
	out->index = index;
	snprintf(out->netns, sizeof(out->netns), "kiln-%s", id);
	snprintf(out->host_if, sizeof(out->host_if), "kv%s", id);
	uint32_t base = (10u << 24) | (200u << 16) | (index * 4);
	uint32_t h = htonl(base + 1), g = htonl(base + 2);
	memcpy(out->host_ip4, &h, 4);
	memcpy(out->nat_ip4, &g, 4);
	inet_pton(AF_INET6, "fd6b:696c:6e00::1", out->host_ip6);
	out->host_ip6[6] = (uint8_t)(index >> 8);
	out->host_ip6[7] = (uint8_t)index;
	memcpy(out->nat_ip6, out->host_ip6, 16);
	out->nat_ip6[15] = 2;
	return KILN_OK;
}

#define RUN(...)                                                         \
	do {                                                             \
		const char *argv_[] = {__VA_ARGS__, NULL};               \
		if ((e = kiln_run(argv_, err)) != KILN_OK)               \
			goto fail;                                       \
	} while (0)

static int write_sysctl(const char *path, const char *val)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	ssize_t w = write(fd, val, strlen(val));
	int e = w < 0 ? -errno : 0;
	close(fd);
	return e;
}

/* `name`'s index in the calling thread's namespace, or a negative errno. */
static int link_index(const char *name)
{
	unsigned i = if_nametoindex(name);
	return i ? (int)i : -ENODEV;
}

/*
 * The host's end of the veth (the other end, the uplink, goes into the netns `nsfd`): its
 * addresses, then up. On failure *step names what failed.
 */
static int host_side(const struct kiln_sbnet *net, int nsfd, const char **step)
{
	struct rtnl r;
	int rc, ifi = 0;

	*step = "netlink socket";
	if ((rc = rtnl_open(&r)) < 0)
		return rc;
	*step = "veth";
	rc = rtnl_veth_add(&r, net->host_if, KILN_NET_UPLINK, nsfd);
	if (rc == 0 && (ifi = rc = link_index(net->host_if)) > 0)
		rc = 0;
	if (rc == 0 && (*step = "host address", 1))
		rc = rtnl_addr_add(&r, ifi, AF_INET, net->host_ip4, 30);
	if (rc == 0)
		rc = rtnl_addr_add(&r, ifi, AF_INET6, net->host_ip6, 64);
	if (rc == 0 && (*step = "host link up", 1))
		rc = rtnl_link_up(&r, ifi);
	rtnl_close(&r);
	return rc;
}

/* The TAP's fixed addresses, the same in every sandbox (netns.h). */
struct gateway {
	uint8_t mac[6], ip4[4], ip6[16];
};

static void gateway_of(struct gateway *g)
{
	unsigned m[6];

	sscanf(KILN_GATEWAY_MAC, "%x:%x:%x:%x:%x:%x", &m[0], &m[1], &m[2], &m[3], &m[4], &m[5]);
	for (int i = 0; i < 6; i++)
		g->mac[i] = (uint8_t)m[i];
	inet_pton(AF_INET, KILN_GATEWAY_IP4, g->ip4);
	inet_pton(AF_INET6, KILN_GATEWAY_IP6, g->ip6);
}

/*
 * Inside the sandbox's netns (the calling thread entered it): loopback and uplink up with their
 * addresses, the TAP made (unless a stand-in veth took its place) and addressed, the default
 * routes out through the uplink, forwarding on. On failure *step names what failed.
 */
static int ns_side(const struct kiln_sbnet *net, const struct kiln_sbnet_config *cfg,
		   const char **step)
{
	static const char *const on[][2] = {
		{"/proc/sys/net/ipv4/ip_forward", "1"},
		{"/proc/sys/net/ipv6/conf/all/forwarding", "1"},
		{"/proc/sys/net/ipv4/conf/all/rp_filter", "0"},
		{"/proc/sys/net/ipv4/conf/default/rp_filter", "0"},
		{"/proc/sys/net/ipv6/conf/all/accept_ra", "0"},
	};
	struct gateway g;
	struct rtnl r;
	int rc, up = 0, tap = 0;

	gateway_of(&g);
	*step = "netlink socket";
	if ((rc = rtnl_open(&r)) < 0)
		return rc;
	*step = "loopback up";
	if ((rc = link_index("lo")) > 0)
		rc = rtnl_link_up(&r, rc);
	if (rc == 0 && (*step = "uplink", 1) && (up = rc = link_index(KILN_NET_UPLINK)) > 0)
		rc = rtnl_addr_add(&r, up, AF_INET, net->nat_ip4, 30);
	if (rc == 0)
		rc = rtnl_addr_add(&r, up, AF_INET6, net->nat_ip6, 64);
	if (rc == 0)
		rc = rtnl_link_up(&r, up);
	if (rc == 0 && !cfg->standin_netns && !cfg->netns_from && (*step = "tap", 1))
		rc = rtnl_tap_add(KILN_NET_TAP, cfg->tap_uid >= 0 ? (uid_t)cfg->tap_uid : (uid_t)-1);
	if (rc == 0 && (*step = "tap address", 1) && (tap = rc = link_index(KILN_NET_TAP)) > 0)
		rc = rtnl_link_set_mac(&r, tap, g.mac);
	if (rc == 0)
		rc = rtnl_addr_add(&r, tap, AF_INET, g.ip4, 30);
	if (rc == 0)
		rc = rtnl_addr_add(&r, tap, AF_INET6, g.ip6, 64);
	if (rc == 0 && (*step = "tap up", 1))
		rc = rtnl_link_up(&r, tap);
	if (rc == 0 && (*step = "default routes", 1))
		rc = rtnl_route_default(&r, AF_INET, net->host_ip4, up);
	if (rc == 0)
		rc = rtnl_route_default(&r, AF_INET6, net->host_ip6, up);
	rtnl_close(&r);
	for (size_t i = 0; i < sizeof(on) / sizeof(on[0]) && rc == 0; i++)
		if ((rc = write_sysctl(on[i][0], on[i][1])) < 0)
			*step = on[i][0];
	return rc;
}

enum kiln_err kiln_sbnet_create_tap(const char *id, int tap_uid, struct kiln_error *err)
{
	struct kiln_sbnet d;
	enum kiln_err e = kiln_sbnet_describe(id, 0, &d, err);
	char path[64];
	int nsfd, saved, rc;

	if (e)
		return e;
	snprintf(path, sizeof(path), "/run/netns/%s", d.netns);
	if (access(path, F_OK) == 0)
		return kiln_error_set(err, KILN_E_CONFLICT, "network namespace \"%s\" exists", d.netns);
	nsfd = rtnl_netns_add(path);
	if (nsfd < 0)
		return kiln_error_set(err, KILN_E_IO, "network namespace \"%s\": %s", d.netns,
				      strerror(-nsfd));
	close(nsfd);
	if ((rc = kiln_sbnet_enter(&d, &saved)) == 0) {
		rc = rtnl_tap_add(KILN_NET_TAP, tap_uid >= 0 ? (uid_t)tap_uid : (uid_t)-1);
		if (kiln_sbnet_leave(saved) < 0) {
			log_error("cannot return from netns \"%s\"", d.netns);
			abort();
		}
	}
	if (rc < 0) {
		kiln_sbnet_destroy(id, NULL);
		return kiln_error_set(err, KILN_E_IO, "tap in \"%s\": %s", d.netns, strerror(-rc));
	}
	return KILN_OK;
}

/*
 * Made by netlink from this thread rather than by `ip`: one process per step was most of the
 * time a sandbox's network took on a loaded host (docs/network-policy.md, "Setup time"). Only
 * the tests' stand-in veth still runs `ip`.
 */
enum kiln_err kiln_sbnet_create(const struct kiln_sbnet_config *cfg, struct kiln_sbnet *out,
				struct kiln_error *err)
{
	enum kiln_err e = kiln_sbnet_describe(cfg->id, cfg->index, out, err);
	const char *step = "netns";
	int nsfd, saved, rc;
	char path[64];

	if (e)
		return e;
	snprintf(path, sizeof(path), "/run/netns/%s", out->netns);
	if (access(path, F_OK) == 0)
		return kiln_error_set(err, KILN_E_CONFLICT, "network namespace \"%s\" exists",
				      out->netns);
	if (cfg->netns_from) {
		/* the namespace made ahead, with its TAP and its VMM, under this name too */
		struct kiln_sbnet from;
		char from_path[64];

		if ((e = kiln_sbnet_describe(cfg->netns_from, 0, &from, err)) != KILN_OK)
			return e;
		snprintf(from_path, sizeof(from_path), "/run/netns/%s", from.netns);
		nsfd = rtnl_netns_bind(from_path, path);
	} else {
		nsfd = rtnl_netns_add(path);
	}
	if (nsfd < 0)
		return kiln_error_set(err, nsfd == -ENOENT && cfg->netns_from ? KILN_E_NOT_FOUND
									: KILN_E_IO,
				      "network namespace \"%s\": %s", out->netns, strerror(-nsfd));
	rc = host_side(out, nsfd, &step);
	if (rc < 0) {
		e = kiln_error_set(err, KILN_E_IO, "network of \"%s\", %s: %s", out->netns, step,
				   strerror(-rc));
		goto fail;
	}
	if (cfg->standin_netns) {
		const char *ns = out->netns, *g = cfg->standin_netns;
		RUN("ip", "-n", ns, "link", "add", KILN_NET_TAP, "type", "veth", "peer", "name",
		    "eth0", "netns", g);
		RUN("ip", "-n", g, "link", "set", "eth0", "address", KILN_GUEST_MAC);
		RUN("ip", "-n", g, "link", "set", "lo", "up");
		RUN("ip", "-n", g, "addr", "add", KILN_GUEST_IP4 "/30", "dev", "eth0");
		RUN("ip", "-n", g, "-6", "addr", "add", KILN_GUEST_IP6 "/64", "dev", "eth0", "nodad");
		RUN("ip", "-n", g, "link", "set", "eth0", "up");
		RUN("ip", "-n", g, "route", "add", "default", "via", KILN_GATEWAY_IP4);
		RUN("ip", "-n", g, "-6", "route", "add", "default", "via", KILN_GATEWAY_IP6);
	}
	if ((rc = kiln_sbnet_enter(out, &saved)) < 0) {
		e = kiln_error_set(err, KILN_E_IO, "enter \"%s\": %s", out->netns, strerror(-rc));
		goto fail;
	}
	rc = ns_side(out, cfg, &step);
	if (kiln_sbnet_leave(saved) < 0) {
		log_error("cannot return from netns \"%s\"", out->netns);
		abort();
	}
	if (rc < 0) {
		e = kiln_error_set(err, KILN_E_IO, "network of \"%s\", %s: %s", out->netns, step,
				   strerror(-rc));
		goto fail;
	}
	close(nsfd);
	log_debug("sandbox network \"%s\" created", out->netns);
	return KILN_OK;
fail:
	close(nsfd);
	kiln_sbnet_destroy(cfg->id, NULL);
	return e;
}

enum kiln_err kiln_sbnet_destroy(const char *id, struct kiln_error *err)
{
	struct kiln_sbnet d;
	enum kiln_err e = kiln_sbnet_describe(id, 0, &d, err);
	if (e)
		return e;
	/*
	 * The host's end first: deleting a veth removes both ends before `ip` returns, whereas a
	 * deleted netns takes its end (and with it the pair) down later, from the kernel's cleanup
	 * work, so the host's end would outlive the destroy for a while. if_nametoindex asks this
	 * thread's netns (/sys/class/net shows the one /sys was mounted in).
	 */
	if (if_nametoindex(d.host_if) != 0) {
		const char *argv[] = {"ip", "link", "del", d.host_if, NULL};
		kiln_run(argv, NULL);
	}
	char path[64];
	snprintf(path, sizeof(path), "/run/netns/%s", d.netns);
	if (access(path, F_OK) == 0) {
		int r = rtnl_netns_unbind(path);

		if (r < 0 && r != -ENOENT)
			e = kiln_error_set(err, KILN_E_IO, "cannot remove network namespace \"%s\": %s",
					   d.netns, strerror(-r));
	}
	return e;
}

int kiln_sbnet_enter(const struct kiln_sbnet *net, int *saved)
{
	char path[64];
	snprintf(path, sizeof(path), "/run/netns/%s", net->netns);
	int cur = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
	if (cur < 0)
		return -errno;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		int e = -errno;
		close(cur);
		return e;
	}
	if (setns(fd, CLONE_NEWNET) < 0) {
		int e = -errno;
		close(fd);
		close(cur);
		return e;
	}
	close(fd);
	*saved = cur;
	return 0;
}

int kiln_sbnet_leave(int saved)
{
	int rc = setns(saved, CLONE_NEWNET) < 0 ? -errno : 0;
	close(saved);
	return rc;
}

int kiln_sbnet_socket(const struct kiln_sbnet *net, int domain, int type, int protocol)
{
	int saved, rc = kiln_sbnet_enter(net, &saved);
	if (rc < 0)
		return rc;
	int fd = socket(domain, type | SOCK_CLOEXEC, protocol);
	int e = fd < 0 ? -errno : 0;
	if (kiln_sbnet_leave(saved) < 0) {
		/* stuck in the wrong netns: nothing sane to go on with */
		log_error("cannot return from netns \"%s\"", net->netns);
		abort();
	}
	return fd < 0 ? e : fd;
}
