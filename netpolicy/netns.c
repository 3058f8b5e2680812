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

enum kiln_err kiln_sbnet_create(const struct kiln_sbnet_config *cfg, struct kiln_sbnet *out,
				struct kiln_error *err)
{
	enum kiln_err e = kiln_sbnet_describe(cfg->id, cfg->index, out, err);
	if (e)
		return e;
	char path[64];
	snprintf(path, sizeof(path), "/run/netns/%s", out->netns);
	if (access(path, F_OK) == 0)
		return kiln_error_set(err, KILN_E_CONFLICT, "network namespace \"%s\" exists",
				      out->netns);

	char h4[32], n4[32], h6[64], n6[64], hop4[INET_ADDRSTRLEN], hop6[INET6_ADDRSTRLEN];
	inet_ntop(AF_INET, out->host_ip4, hop4, sizeof(hop4));
	inet_ntop(AF_INET6, out->host_ip6, hop6, sizeof(hop6));
	snprintf(h4, sizeof(h4), "%s/30", hop4);
	inet_ntop(AF_INET, out->nat_ip4, n4, sizeof(n4));
	strcat(n4, "/30");
	snprintf(h6, sizeof(h6), "%s/64", hop6);
	inet_ntop(AF_INET6, out->nat_ip6, n6, sizeof(n6) - 4);
	strcat(n6, "/64");
	const char *ns = out->netns, *hif = out->host_if;

	RUN("ip", "netns", "add", ns);
	RUN("ip", "link", "add", hif, "type", "veth", "peer", "name", KILN_NET_UPLINK, "netns", ns);
	RUN("ip", "addr", "add", h4, "dev", hif);
	RUN("ip", "-6", "addr", "add", h6, "dev", hif, "nodad");
	RUN("ip", "link", "set", hif, "up");
	RUN("ip", "-n", ns, "link", "set", "lo", "up");
	RUN("ip", "-n", ns, "addr", "add", n4, "dev", KILN_NET_UPLINK);
	RUN("ip", "-n", ns, "-6", "addr", "add", n6, "dev", KILN_NET_UPLINK, "nodad");
	RUN("ip", "-n", ns, "link", "set", KILN_NET_UPLINK, "up");
	if (cfg->standin_netns) {
		RUN("ip", "-n", ns, "link", "add", KILN_NET_TAP, "type", "veth", "peer", "name",
		    "eth0", "netns", cfg->standin_netns);
		const char *g = cfg->standin_netns;
		RUN("ip", "-n", g, "link", "set", "eth0", "address", KILN_GUEST_MAC);
		RUN("ip", "-n", g, "link", "set", "lo", "up");
		RUN("ip", "-n", g, "addr", "add", KILN_GUEST_IP4 "/30", "dev", "eth0");
		RUN("ip", "-n", g, "-6", "addr", "add", KILN_GUEST_IP6 "/64", "dev", "eth0", "nodad");
		RUN("ip", "-n", g, "link", "set", "eth0", "up");
		RUN("ip", "-n", g, "route", "add", "default", "via", KILN_GATEWAY_IP4);
		RUN("ip", "-n", g, "-6", "route", "add", "default", "via", KILN_GATEWAY_IP6);
	} else if (cfg->tap_uid >= 0) {
		char uid[16];
		snprintf(uid, sizeof(uid), "%d", cfg->tap_uid);
		RUN("ip", "-n", ns, "tuntap", "add", KILN_NET_TAP, "mode", "tap", "user", uid);
	} else {
		RUN("ip", "-n", ns, "tuntap", "add", KILN_NET_TAP, "mode", "tap");
	}
	RUN("ip", "-n", ns, "link", "set", KILN_NET_TAP, "address", KILN_GATEWAY_MAC);
	RUN("ip", "-n", ns, "addr", "add", KILN_GATEWAY_IP4 "/30", "dev", KILN_NET_TAP);
	RUN("ip", "-n", ns, "-6", "addr", "add", KILN_GATEWAY_IP6 "/64", "dev", KILN_NET_TAP,
	    "nodad");
	RUN("ip", "-n", ns, "link", "set", KILN_NET_TAP, "up");
	RUN("ip", "-n", ns, "route", "add", "default", "via", hop4, "dev", KILN_NET_UPLINK);
	RUN("ip", "-n", ns, "-6", "route", "add", "default", "via", hop6, "dev", KILN_NET_UPLINK);

	int saved;
	int rc = kiln_sbnet_enter(out, &saved);
	if (rc < 0) {
		e = kiln_error_set(err, KILN_E_IO, "enter \"%s\": %s", ns, strerror(-rc));
		goto fail;
	}
	static const char *const on[][2] = {
		{"/proc/sys/net/ipv4/ip_forward", "1"},
		{"/proc/sys/net/ipv6/conf/all/forwarding", "1"},
		{"/proc/sys/net/ipv4/conf/all/rp_filter", "0"},
		{"/proc/sys/net/ipv4/conf/default/rp_filter", "0"},
		{"/proc/sys/net/ipv6/conf/all/accept_ra", "0"},
	};
	for (size_t i = 0; i < sizeof(on) / sizeof(on[0]) && rc == 0; i++)
		if ((rc = write_sysctl(on[i][0], on[i][1])) < 0)
			e = kiln_error_set(err, KILN_E_IO, "sysctl %s: %s", on[i][0], strerror(-rc));
	kiln_sbnet_leave(saved);
	if (rc < 0)
		goto fail;
	log_debug("sandbox network \"%s\" created", ns);
	return KILN_OK;
fail:
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
		const char *argv[] = {"ip", "netns", "del", d.netns, NULL};
		e = kiln_run(argv, err);
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
