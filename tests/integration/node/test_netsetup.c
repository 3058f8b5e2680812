/*
 * test_netsetup.c - kiln-node's host network setup (node/netsetup.h) with the real `nft` tool and
 * kernel, in a network namespace of the test's own (unshare at start: the host's tables and
 * sysctls are never touched; the namespace goes with the process). Checks: the table's name,
 * installing twice leaves one table with the rules, forwarding turned on and never off, accept_ra
 * set to 2 only on uplinks with an IPv6 default route that accepted advertisements, other tables'
 * dropping chains reported (and harmless ones not), removal idempotent. What the rules do to real
 * traffic is tests/e2e/test_nodenet.py's.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/proc.h"
#include "node/netsetup.h"
#include "test.h"

#define NODE  "tnet-a1"
#define TABLE "kiln_tnet_a1"

static const struct netsetup_config cfg = {
    .node_id = NODE, .conntrack_max = 4096, .max_sandboxes = 32};

/* Runs argv; returns its exit status (stdout and stderr into `out` when given). */
static int run(const char *const *argv, char *out, size_t len)
{
	int status;

	if (proc_run(argv, PROC_STDOUT | PROC_STDERR, out, len, &status) < 0)
		return -1;
	return status;
}

#define RUN(...)                                                                                   \
	do {                                                                                       \
		const char *a_[] = {__VA_ARGS__, NULL};                                            \
		char o_[512];                                                                      \
		int s_ = run(a_, o_, sizeof(o_));                                                  \
		if (s_ != 0)                                                                       \
			fprintf(stderr, "%s failed (%d): %s\n", a_[0], s_, o_);                    \
		CHECK(s_ == 0);                                                                    \
	} while (0)

static void read_file(const char *path, char *out, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n = fd < 0 ? -1 : read(fd, out, len - 1);

	if (fd >= 0)
		close(fd);
	if (n < 0)
		n = 0;
	while (n > 0 && out[n - 1] == '\n')
		n--;
	out[n] = '\0';
}

static void write_file(const char *path, const char *val)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);

	CHECK(fd >= 0);
	if (fd >= 0) {
		CHECK(write(fd, val, strlen(val)) == (ssize_t)strlen(val));
		close(fd);
	}
}

/* How many times `needle` occurs in `hay`. */
static int count(const char *hay, const char *needle)
{
	int n = 0;

	for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

static void tables(char *out, size_t len)
{
	const char *argv[] = {"nft", "list", "tables", NULL};
	CHECK(run(argv, out, len) == 0);
}

static void test_table_name(void)
{
	struct kiln_error err = {0};
	char t[NETSETUP_TABLE_MAX];

	CHECK(netsetup_table_name("node-3f2a9c1d", t, sizeof(t), &err) == KILN_OK);
	CHECK_STR(t, "kiln_node_3f2a9c1d");
	CHECK(netsetup_table_name("abcdefghijklmnopqrstuvwxyz-12345", t, sizeof(t), &err) ==
	      KILN_OK);
	CHECK_STR(t, "kiln_abcdefghijklmnopqrstuvwxyz_12345");
	CHECK(netsetup_table_name("", t, sizeof(t), &err) == KILN_E_INVALID);
	CHECK(netsetup_table_name("a;flush ruleset", t, sizeof(t), &err) == KILN_E_INVALID);
	CHECK(netsetup_table_name("Node", t, sizeof(t), &err) == KILN_E_INVALID);
	CHECK(netsetup_table_name("abcdefghijklmnopqrstuvwxyz-123456", t, sizeof(t), &err) ==
	      KILN_E_INVALID);
	CHECK(netsetup_script("kiln_x", 4096, t, sizeof(t)) == -ENOSPC);
}

/*
 * Two uplinks with an IPv6 default route (accept_ra 1 and 0) and one without (accept_ra 1); veths,
 * as not every kernel has dummy devices.
 */
static void uplinks(void)
{
	const char *names[] = {"up1", "up2", "up3"};

	for (int i = 0; i < 3; i++) {
		char path[96];
		char peer[16];
		snprintf(peer, sizeof(peer), "%sp", names[i]);
		RUN("ip", "link", "add", names[i], "type", "veth", "peer", "name", peer);
		RUN("ip", "link", "set", names[i], "up");
		RUN("ip", "link", "set", peer, "up");
		snprintf(path, sizeof(path), "/proc/sys/net/ipv6/conf/%s/accept_ra", names[i]);
		write_file(path, i == 1 ? "0" : "1");
	}
	RUN("ip", "-6", "addr", "add", "2001:db8:71::2/64", "dev", "up1", "nodad");
	RUN("ip", "-6", "addr", "add", "2001:db8:72::2/64", "dev", "up2", "nodad");
	RUN("ip", "-6", "route", "add", "default", "via", "2001:db8:71::1", "dev", "up1", "metric",
	    "100");
	RUN("ip", "-6", "route", "add", "default", "via", "2001:db8:72::1", "dev", "up2", "metric",
	    "200");
}

static void test_apply_twice_is_one_table_and_forwarding_stays_on(void)
{
	struct kiln_error err = {0};
	char out[16384], v[32];

	/* off in this namespace (a new one inherits IPv4's from the host's): the setup turns it on
	 */
	write_file("/proc/sys/net/ipv4/ip_forward", "0");
	write_file("/proc/sys/net/ipv6/conf/all/forwarding", "0");
	uplinks();
	CHECK(netsetup_apply(&cfg, &err) == KILN_OK);
	if (err.code)
		fprintf(stderr, "apply: %s\n", err.msg);
	CHECK(netsetup_apply(&cfg, &err) == KILN_OK);
	tables(out, sizeof(out));
	CHECK_INT(count(out, "table inet " TABLE "\n"), 1);
	{
		const char *argv[] = {"nft", "list", "table", "inet", TABLE, NULL};
		CHECK(run(argv, out, sizeof(out)) == 0);
	}
	CHECK_INT(count(out, "ip saddr 10.200.0.0/16 oifname != \"kv*\" masquerade"), 1);
	CHECK_INT(count(out, "ip6 saddr fd6b:696c:6e00::/48 oifname != \"kv*\" masquerade"), 1);
	CHECK_INT(count(out, "type filter hook forward priority filter; policy accept;"), 1);
	CHECK_INT(count(out, "iifname \"kv*\" accept"), 1);
	CHECK_INT(count(out, "add @sandboxes4 { ip saddr ct count over 4096 }"), 2);
	CHECK_INT(count(out, "add @sandboxes6 { ip6 saddr ct count over 4096 }"), 2);
	CHECK_INT(count(out, "reject with tcp reset"), 2);
	CHECK_INT(count(out, "meta l4proto != tcp"), 2); /* one counting rule per packet */
	CHECK_INT(count(out, "iifname \"kv*\" drop"), 1);
	CHECK_INT(count(out, "nd-neighbor-solicit"), 1);
	read_file("/proc/sys/net/ipv4/ip_forward", v, sizeof(v));
	CHECK_STR(v, "1");
	read_file("/proc/sys/net/ipv6/conf/all/forwarding", v, sizeof(v));
	CHECK_STR(v, "1");
	read_file("/proc/sys/net/ipv6/conf/up1/accept_ra", v, sizeof(v));
	CHECK_STR(v, "2"); /* had a default route and took advertisements: keeps them */
	read_file("/proc/sys/net/ipv6/conf/up2/accept_ra", v, sizeof(v));
	CHECK_STR(v, "0"); /* took none: left so */
	read_file("/proc/sys/net/ipv6/conf/up3/accept_ra", v, sizeof(v));
	CHECK_STR(v, "1"); /* no default route: not an uplink */

	CHECK(netsetup_remove(NODE, &err) == KILN_OK);
	tables(out, sizeof(out));
	CHECK_INT(count(out, TABLE), 0);
	CHECK(netsetup_remove(NODE, &err) == KILN_OK); /* nothing there: still fine */
	read_file("/proc/sys/net/ipv4/ip_forward", v, sizeof(v));
	CHECK_STR(v, "1"); /* never turned off */
	read_file("/proc/sys/net/ipv6/conf/all/forwarding", v, sizeof(v));
	CHECK_STR(v, "1");
}

static void test_other_tables_dropping_sandbox_traffic_are_reported(void)
{
	struct kiln_error err = {0};
	char out[4096];

	CHECK(netsetup_apply(&cfg, &err) == KILN_OK);
	CHECK_INT(netsetup_blockers(TABLE, out, sizeof(out)),
	          0); /* its own table drops nothing for all */
	/* harmless: an accepting forward chain with a conditional drop, a drop policy on output */
	RUN("nft",
	    "table ip calm { chain pass { type filter hook forward priority 0; policy accept; "
	    "tcp dport 23 drop; }; chain out { type filter hook output priority 0; policy drop; }; "
	    "}");
	CHECK_INT(netsetup_blockers(TABLE, out, sizeof(out)), 0);
	/* as iptables-nft's FORWARD DROP, and an input chain dropping all by a rule */
	RUN("nft", "table ip filter { chain FORWARD { type filter hook forward priority 0; "
	           "policy drop; }; }");
	RUN("nft", "table inet fw { chain in { type filter hook input priority 10; policy accept; "
	           "counter drop; }; }");
	CHECK_INT(netsetup_blockers(TABLE, out, sizeof(out)), 2);
	CHECK(strstr(out, "\"ip filter\", chain \"FORWARD\" (hook forward, policy drop)") != NULL);
	CHECK(strstr(out, "\"inet fw\", chain \"in\" (hook input, a rule that drops everything)") !=
	      NULL);
	CHECK(strstr(out, "calm") == NULL);
	fprintf(stderr, "%s", out);
	/* a node started with them there still starts, and warns (seen in the output above) */
	CHECK(netsetup_apply(&cfg, &err) == KILN_OK);
	RUN("nft", "delete table ip filter; delete table inet fw; delete table ip calm");
	CHECK(netsetup_remove(NODE, &err) == KILN_OK);
}

int main(void)
{
	if (geteuid() != 0) {
		fprintf(stderr, "test_netsetup: needs root (it makes a network namespace)\n");
		return 1;
	}
	if (unshare(CLONE_NEWNET) != 0) {
		fprintf(stderr, "unshare(CLONE_NEWNET): %s\n", strerror(errno));
		return 1;
	}
	{
		const char *lo[] = {"ip", "link", "set", "lo", "up", NULL};
		run(lo, NULL, 0);
	}
	TEST(test_table_name);
	TEST(test_apply_twice_is_one_table_and_forwarding_stays_on);
	TEST(test_other_tables_dropping_sandbox_traffic_are_reported);
	return test_summary();
}
