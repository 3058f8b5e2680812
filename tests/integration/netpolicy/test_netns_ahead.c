/*
 * test_netns_ahead.c - a namespace made ahead with its TAP (kiln_sbnet_create_tap), the TAP
 * opened there as a VMM opens it, then taken over by a sandbox's network
 * (kiln_sbnet_config.netns_from): the sandbox's name and the old one are one namespace; with the
 * old name removed, the descriptor opened before reaches the sandbox's network (an ARP request
 * written into it as the guest is answered by the gateway address there); a namespace to take
 * over that does not exist fails the create whole, and a take-over that fails after the bind
 * leaves the namespace made ahead as it was. Real namespaces, TAPs and netlink; needs root.
 */
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "netpolicy/netns.h"
#include "test.h"

static char ida[16], idb[16], idc[16], idd[16], ide[16];

/* A descriptor on the TAP of namespace `id`, opened inside it as QEMU opens it; or -errno. */
static int tap_open_in(const char *id)
{
	struct kiln_sbnet net;
	struct ifreq ifr = { .ifr_flags = IFF_TAP | IFF_NO_PI };
	int saved, fd, e = 0;

	if (kiln_sbnet_describe(id, 0, &net, NULL) != KILN_OK || kiln_sbnet_enter(&net, &saved) < 0)
		return -EINVAL;
	fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", KILN_NET_TAP);
	if (fd < 0 || ioctl(fd, TUNSETIFF, &ifr) < 0)
		e = -errno;
	if (kiln_sbnet_leave(saved) < 0)
		abort();
	if (e < 0 && fd >= 0)
		close(fd);
	return e < 0 ? e : fd;
}

/* Whether namespace `id` has a link called `name`. */
static bool has_link(const char *id, const char *name)
{
	struct kiln_sbnet net;
	int saved;
	bool has;

	if (kiln_sbnet_describe(id, 0, &net, NULL) != KILN_OK || kiln_sbnet_enter(&net, &saved) < 0)
		return false;
	has = if_nametoindex(name) != 0;
	if (kiln_sbnet_leave(saved) < 0)
		abort();
	return has;
}

/* The inode of namespace `id` (a namespace's, through its bind mount), or 0. */
static ino_t netns_ino(const char *id)
{
	char path[64];
	struct stat st;

	snprintf(path, sizeof(path), "/run/netns/kiln-%s", id);
	return stat(path, &st) == 0 ? st.st_ino : 0;
}

static bool netns_exists(const char *id)
{
	char path[64];

	snprintf(path, sizeof(path), "/run/netns/kiln-%s", id);
	return access(path, F_OK) == 0;
}

/* Writes the guest's ARP request for the gateway into `fd`; true when the reply comes back. */
static bool arp_answered(int fd)
{
	static const unsigned char guest_mac[6] = { 0x06, 0x00, 0xac, 0x10, 0x00, 0x02 };
	unsigned char req[42] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff }, buf[2048];
	struct timespec t0, t;

	memcpy(req + 6, guest_mac, 6);
	req[12] = 0x08, req[13] = 0x06;			/* ARP */
	req[14] = 0, req[15] = 1, req[16] = 0x08, req[17] = 0;	/* Ethernet, IPv4 */
	req[18] = 6, req[19] = 4, req[20] = 0, req[21] = 1;	/* request */
	memcpy(req + 22, guest_mac, 6);
	memcpy(req + 28, (unsigned char[]){ 172, 16, 0, 2 }, 4);
	memcpy(req + 38, (unsigned char[]){ 172, 16, 0, 1 }, 4);
	if (write(fd, req, sizeof(req)) != (ssize_t)sizeof(req))
		return false;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		ssize_t n;

		clock_gettime(CLOCK_MONOTONIC, &t);
		if (t.tv_sec - t0.tv_sec > 3 || poll(&p, 1, 500) < 0)
			return false;
		if (!(p.revents & POLLIN))
			continue;
		n = read(fd, buf, sizeof(buf));
		/* other frames (IPv6 neighbour discovery) pass by */
		if (n >= 42 && buf[12] == 0x08 && buf[13] == 0x06 && buf[21] == 2 &&
		    memcmp(buf + 28, (unsigned char[]){ 172, 16, 0, 1 }, 4) == 0 &&
		    memcmp(buf, guest_mac, 6) == 0)
			return true;
	}
}

static void test_a_namespace_made_ahead_is_taken_over_with_its_tap_and_descriptor(void)
{
	struct kiln_sbnet net;
	struct kiln_error err = { 0 };
	struct kiln_sbnet_config cfg = { .id = idb, .index = 12000 + (uint32_t)(getpid() % 4000),
					 .tap_uid = -1, .netns_from = ida };
	int fd;

	CHECK_INT(kiln_sbnet_create_tap(ida, -1, &err), KILN_OK);
	CHECK_INT(kiln_sbnet_create_tap(ida, -1, NULL), KILN_E_CONFLICT);
	CHECK(has_link(ida, KILN_NET_TAP));
	fd = tap_open_in(ida);
	CHECK(fd >= 0);
	CHECK(netns_ino(ida) != 0);
	CHECK_INT(kiln_sbnet_create(&cfg, &net, &err), KILN_OK);
	if (err.code)
		fprintf(stderr, "create: %s\n", err.msg);
	CHECK(netns_ino(idb) == netns_ino(ida));
	/* the old name goes; the namespace, its TAP and the descriptor on it stay the sandbox's */
	CHECK_INT(kiln_sbnet_destroy(ida, NULL), KILN_OK);
	CHECK(!netns_exists(ida));
	CHECK(has_link(idb, KILN_NET_TAP) && has_link(idb, KILN_NET_UPLINK));
	CHECK(fd >= 0 && arp_answered(fd));
	if (fd >= 0)
		close(fd);
	CHECK_INT(kiln_sbnet_destroy(idb, NULL), KILN_OK);
	CHECK(!netns_exists(ida) && !netns_exists(idb));
}

static void test_a_namespace_to_take_over_that_is_not_there_fails_the_create_whole(void)
{
	struct kiln_sbnet net;
	struct kiln_error err = { 0 };
	struct kiln_sbnet_config cfg = { .id = idc, .index = 12000 + (uint32_t)(getpid() % 4000),
					 .tap_uid = -1, .netns_from = ida };

	CHECK_INT(kiln_sbnet_create(&cfg, &net, &err), KILN_E_NOT_FOUND);
	CHECK(!netns_exists(idc));
}

/* A take-over that fails after the bind (its veth's name taken) leaves the namespace made ahead. */
static void test_a_take_over_that_fails_leaves_the_namespace_made_ahead_whole(void)
{
	struct kiln_sbnet net;
	struct kiln_error err = { 0 };
	struct kiln_sbnet_config cfg = { .id = idd, .index = 12000 + (uint32_t)(getpid() % 4000),
					 .tap_uid = -1, .netns_from = ide };
	char cmd[96];
	int fd;

	CHECK_INT(kiln_sbnet_create_tap(ide, -1, &err), KILN_OK);
	fd = tap_open_in(ide);
	CHECK(fd >= 0);
	snprintf(cmd, sizeof(cmd), "ip link add kv%s type veth peer name kp%s", idd, idd);
	CHECK(system(cmd) == 0);
	CHECK(kiln_sbnet_create(&cfg, &net, &err) != KILN_OK);
	CHECK(!netns_exists(idd));
	CHECK(netns_exists(ide) && has_link(ide, KILN_NET_TAP));
	CHECK(!has_link(ide, KILN_NET_UPLINK));
	if (fd >= 0)
		close(fd);
	snprintf(cmd, sizeof(cmd), "ip link del kv%s 2>/dev/null", idd);
	if (system(cmd) != 0) {
		/* removed by the failed create's cleanup already */
	}
	CHECK_INT(kiln_sbnet_destroy(ide, NULL), KILN_OK);
	CHECK(!netns_exists(ide));
}

int main(void)
{
	if (geteuid() != 0) {
		fprintf(stderr, "test_netns_ahead: needs root\n");
		return 1;
	}
	snprintf(ida, sizeof(ida), "tma%d", (int)getpid());
	snprintf(idb, sizeof(idb), "tmb%d", (int)getpid());
	snprintf(idc, sizeof(idc), "tmc%d", (int)getpid());
	snprintf(idd, sizeof(idd), "tmd%d", (int)getpid());
	snprintf(ide, sizeof(ide), "tme%d", (int)getpid());
	TEST(test_a_namespace_made_ahead_is_taken_over_with_its_tap_and_descriptor);
	TEST(test_a_namespace_to_take_over_that_is_not_there_fails_the_create_whole);
	TEST(test_a_take_over_that_fails_leaves_the_namespace_made_ahead_whole);
	kiln_sbnet_destroy(ida, NULL);
	kiln_sbnet_destroy(idb, NULL);
	kiln_sbnet_destroy(idc, NULL);
	kiln_sbnet_destroy(idd, NULL);
	kiln_sbnet_destroy(ide, NULL);
	return test_summary();
}
