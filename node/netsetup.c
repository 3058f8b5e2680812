/*
 * netsetup.c - the node's nftables table, forwarding and router advertisements (see netsetup.h).
 */
#include "node/netsetup.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <net/if.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "common/proc.h"
#include "netpolicy/netns.h"

/* The host ends of the sandboxes' veths are "kv<net id>" (netpolicy/netns.c). */
#define SANDBOX_IFS "kv*"

/* Captured output of nft: the JSON ruleset of a busy host can be large. */
#define NFT_OUT_MAX (8u << 20)

enum kiln_err netsetup_table_name(const char *node_id, char *out, size_t len,
                                  struct kiln_error *err)
{
	size_t n = node_id ? strlen(node_id) : 0;

	if (n == 0 || n > 32 || len < n + 6)
		return kiln_error_set(err, KILN_E_INVALID,
		                      "node id for the nftables table: 1 to 32 characters");
	memcpy(out, "kiln_", 5);
	for (size_t i = 0; i < n; i++) {
		char c = node_id[i];
		if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'))
			return kiln_error_set(
			    err, KILN_E_INVALID,
			    "node id for the nftables table: only a-z, 0-9 and -");
		out[5 + i] = c == '-' ? '_' : c;
	}
	out[5 + n] = '\0';
	return KILN_OK;
}

int netsetup_script(const char *t, long long ct_max, char *out, size_t len)
{
	/*
	 * A sandbox's new connection past its cap of tracked ones is refused (TCP: a reset, at
	 * once), counted per address (the sandbox's, masqueraded) so one sandbox never takes the
	 * host's connection tracking from the others or the host. Connections closed (TIME_WAIT,
	 * CLOSE) are not counted.
	 */
	int n = snprintf(
	    out, len,
	    "table inet %s\n"
	    "delete table inet %s\n"
	    "table inet %s {\n"
	    "\tset sandboxes4 { type ipv4_addr; size 65536; flags dynamic; }\n"
	    "\tset sandboxes6 { type ipv6_addr; size 65536; flags dynamic; }\n"
	    "\tchain postrouting {\n"
	    "\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
	    "\t\tip saddr " KILN_SANDBOX_NET4 " oifname != \"" SANDBOX_IFS "\" masquerade\n"
	    "\t\tip6 saddr " KILN_SANDBOX_NET6 " oifname != \"" SANDBOX_IFS "\" masquerade\n"
	    "\t}\n"
	    "\tchain forward {\n"
	    "\t\ttype filter hook forward priority filter; policy accept;\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" oifname \"" SANDBOX_IFS "\" drop\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" ct state new meta l4proto tcp "
	    "add @sandboxes4 { ip saddr ct count over %lld } reject with tcp reset\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" ct state new meta l4proto != tcp "
	    "add @sandboxes4 { ip saddr ct count over %lld } drop\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" ct state new meta l4proto tcp "
	    "add @sandboxes6 { ip6 saddr ct count over %lld } reject with tcp reset\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" ct state new meta l4proto != tcp "
	    "add @sandboxes6 { ip6 saddr ct count over %lld } drop\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" accept\n"
	    "\t\toifname \"" SANDBOX_IFS "\" ct state established,related accept\n"
	    "\t\toifname \"" SANDBOX_IFS "\" drop\n"
	    "\t}\n"
	    "\tchain input {\n"
	    "\t\ttype filter hook input priority filter; policy accept;\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" ct state established,related accept\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" icmpv6 type { nd-neighbor-solicit, "
	    "nd-neighbor-advert } accept\n"
	    "\t\tiifname \"" SANDBOX_IFS "\" drop\n"
	    "\t}\n"
	    "}\n",
	    t, t, t, ct_max, ct_max, ct_max, ct_max);
	return n < 0 || (size_t)n >= len ? -ENOSPC : n;
}

/* Runs `nft <script>` (one transaction); its stderr, trimmed, into err on failure. */
static enum kiln_err nft_run(const char *script, const char *what, struct kiln_error *err)
{
	const char *argv[] = {"nft", script, NULL};
	char msg[512];
	int status, rc;

	rc = proc_run(argv, PROC_STDERR, msg, sizeof(msg), &status);
	if (rc == -ENOENT)
		return kiln_error_set(err, KILN_E_IO,
		                      "%s: no \"nft\" tool (install nftables, or set "
		                      "node_network_setup = false on a host set up otherwise)",
		                      what);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "%s: cannot run \"nft\": %s", what,
		                      strerror(-rc));
	if (status != 0) {
		size_t n = strlen(msg);
		while (n && (msg[n - 1] == '\n' || msg[n - 1] == ' '))
			msg[--n] = '\0';
		return kiln_error_set(err, KILN_E_IO, "%s: nft failed (status %d): %s", what,
		                      status, msg);
	}
	return KILN_OK;
}

static int sysctl_read(const char *path, char *out, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	if (fd < 0)
		return -errno;
	n = read(fd, out, len - 1);
	if (n < 0) {
		int e = -errno;
		close(fd);
		return e;
	}
	close(fd);
	while (n > 0 && (out[n - 1] == '\n' || out[n - 1] == ' '))
		n--;
	out[n] = '\0';
	return 0;
}

/* Writes `val` unless the setting already reads so. */
static int sysctl_ensure(const char *path, const char *val)
{
	char cur[32];
	int fd, e = 0;

	if (sysctl_read(path, cur, sizeof(cur)) == 0 && strcmp(cur, val) == 0)
		return 0;
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (write(fd, val, strlen(val)) < 0)
		e = -errno;
	close(fd);
	return e;
}

/*
 * accept_ra=2 on each interface with an IPv6 default route whose accept_ra is 1, so that turning
 * forwarding on does not make the host drop its router advertisements (and the default route they
 * give). An interface at 0 (no advertisements wanted) or already at 2 is left alone.
 */
static enum kiln_err keep_router_advertisements(struct kiln_error *err)
{
	char line[512];
	enum kiln_err e = KILN_OK;
	FILE *f = fopen("/proc/net/ipv6_route", "re");

	if (!f)
		return KILN_OK; /* no IPv6 */
	while (e == KILN_OK && fgets(line, sizeof(line), f)) {
		char dst[33], dlen[3], dev[IFNAMSIZ], path[96], cur[32];
		int rc;

		/* destination, its length, source, its length, next hop, metric, refs, use, flags,
		 * dev */
		if (sscanf(line, "%32s %2s %*s %*s %*s %*s %*s %*s %*s %15s", dst, dlen, dev) != 3)
			continue;
		if (strcmp(dst, "00000000000000000000000000000000") != 0 ||
		    strcmp(dlen, "00") != 0 || strcmp(dev, "lo") == 0)
			continue;
		snprintf(path, sizeof(path), "/proc/sys/net/ipv6/conf/%s/accept_ra", dev);
		if (sysctl_read(path, cur, sizeof(cur)) != 0 || strcmp(cur, "1") != 0)
			continue; /* 0: takes none; 2: keeps them already (or a second default
			             route) */
		rc = sysctl_ensure(path, "2");
		if (rc < 0)
			e = kiln_error_set(err, KILN_E_IO,
			                   "setting \"node_network_setup\": %s = 2: %s", path,
			                   strerror(-rc));
		else
			log_info("uplink \"%s\" keeps its router advertisements while forwarding "
			         "(accept_ra = 2)",
			         dev);
	}
	fclose(f);
	return e;
}

/* Warns when the node's sandboxes together may hold more tracked connections than the host has. */
static void check_conntrack_max(const struct netsetup_config *cfg)
{
	char v[32];
	long long host_max;

	if (sysctl_read("/proc/sys/net/netfilter/nf_conntrack_max", v, sizeof(v)) != 0)
		return;
	host_max = atoll(v);
	if (host_max > 0 && cfg->max_sandboxes * cfg->conntrack_max > host_max)
		log_warn(
		    "node_max_sandboxes %lld x conntrack_max_per_sandbox %lld is more than the "
		    "host's net.netfilter.nf_conntrack_max %lld: sandboxes together can fill it, "
		    "and the host drops new connections then",
		    cfg->max_sandboxes, cfg->conntrack_max, host_max);
}

enum kiln_err netsetup_apply(const struct netsetup_config *cfg, struct kiln_error *err)
{
	char table[NETSETUP_TABLE_MAX], script[4096], blockers[4096];
	enum kiln_err e;
	int rc, n;

	if ((e = netsetup_table_name(cfg->node_id, table, sizeof(table), err)) != KILN_OK)
		return e;
	if (netsetup_script(table, cfg->conntrack_max, script, sizeof(script)) < 0)
		return kiln_error_set(err, KILN_E_INTERNAL, "nftables script too long");
	if ((e = nft_run(script, "setting \"node_network_setup\"", err)) != KILN_OK)
		return e;
	rc = sysctl_ensure("/proc/sys/net/ipv4/ip_forward", "1");
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO,
		                      "setting \"node_network_setup\": net.ipv4.ip_forward = 1: %s",
		                      strerror(-rc));
	if (access("/proc/sys/net/ipv6/conf/all/forwarding", F_OK) == 0) {
		if ((e = keep_router_advertisements(err)) != KILN_OK)
			return e;
		rc = sysctl_ensure("/proc/sys/net/ipv6/conf/all/forwarding", "1");
		if (rc < 0)
			return kiln_error_set(err, KILN_E_IO,
			                      "setting \"node_network_setup\": "
			                      "net.ipv6.conf.all.forwarding = 1: %s",
			                      strerror(-rc));
	}
	log_info("host network set up: nftables table \"inet %s\", forwarding on", table);
	check_conntrack_max(cfg);
	n = netsetup_blockers(table, blockers, sizeof(blockers));
	if (n < 0) {
		log_warn("cannot read the host's nftables ruleset to check it lets the sandboxes' "
		         "traffic through: %s",
		         strerror(-n));
	} else if (n > 0) {
		char *save = NULL;
		for (char *l = strtok_r(blockers, "\n", &save); l; l = strtok_r(NULL, "\n", &save))
			log_warn("%s", l);
	}
	return KILN_OK;
}

enum kiln_err netsetup_remove(const char *node_id, struct kiln_error *err)
{
	char table[NETSETUP_TABLE_MAX], script[160];
	enum kiln_err e;

	if ((e = netsetup_table_name(node_id, table, sizeof(table), err)) != KILN_OK)
		return e;
	/* created if missing, then deleted: one transaction that succeeds either way */
	snprintf(script, sizeof(script), "table inet %s\ndelete table inet %s\n", table, table);
	return nft_run(script, "removing the node's nftables table", err);
}

/* Whether a rule drops or rejects every packet (nothing but counters, logs, limits, a verdict). */
static bool rule_drops_all(json_t *expr)
{
	size_t i;
	json_t *st;
	bool drops = false;

	if (!json_is_array(expr))
		return false;
	json_array_foreach(expr, i, st)
	{
		const char *k;
		json_t *v;
		json_object_foreach(st, k, v)
		{
			if (!strcmp(k, "drop") || !strcmp(k, "reject"))
				drops = true;
			else if (strcmp(k, "counter") != 0 && strcmp(k, "log") != 0 &&
			         strcmp(k, "limit") != 0)
				return false; /* a match or anything else: not every packet */
		}
	}
	return drops;
}

/* The string member `k` of `o`, or "" (never NULL). */
static const char *jstr(const json_t *o, const char *k)
{
	const char *s = json_string_value(json_object_get(o, k));
	return s ? s : "";
}

static bool watched_family(const char *f)
{
	return f && (!strcmp(f, "ip") || !strcmp(f, "ip6") || !strcmp(f, "inet"));
}

static bool watched_hook(const char *h)
{
	return h && (!strcmp(h, "forward") || !strcmp(h, "input"));
}

/* What a dropping chain on `hook` drops of the sandboxes', and what that costs them. */
static const char *dropped(const char *hook)
{
	return !strcmp(hook, "forward") ? "the sandboxes' forwarded traffic"
	                                : "the sandboxes' IPv6 neighbour discovery with the host";
}

static const char *consequence(const char *hook)
{
	return !strcmp(hook, "forward") ? "they may reach nothing" : "they may have no IPv6";
}

/* The hook of base chain fam/tbl/name when it is one the sandboxes' traffic passes, or NULL. */
static const char *chain_hook(json_t *items, const char *fam, const char *tbl, const char *name)
{
	size_t i;
	json_t *it;

	json_array_foreach(items, i, it)
	{
		json_t *c = json_object_get(it, "chain");
		const char *h = json_string_value(json_object_get(c, "hook"));

		if (c && watched_hook(h) && !strcmp(jstr(c, "family"), fam) &&
		    !strcmp(jstr(c, "table"), tbl) && !strcmp(jstr(c, "name"), name))
			return h;
	}
	return NULL;
}

/*
 * Whether item `it` (a chain or a rule of the ruleset) drops the sandboxes' traffic: a base chain
 * on a watched hook with policy drop, or a rule of one that drops everything. *hook and *why say
 * how.
 */
static bool item_blocks(json_t *items, json_t *it, const char *table, const char **hook,
                        const char **why)
{
	json_t *chain = json_object_get(it, "chain"), *rule = json_object_get(it, "rule");
	json_t *o = chain ? chain : rule;
	const char *fam = jstr(o, "family"), *tbl = jstr(o, "table");

	if (!o || !watched_family(fam) || (!strcmp(fam, "inet") && !strcmp(tbl, table)))
		return false;
	if (chain) {
		*hook = json_string_value(json_object_get(chain, "hook"));
		*why = "policy drop";
		return watched_hook(*hook) && !strcmp(jstr(chain, "policy"), "drop");
	}
	*hook = chain_hook(items, fam, tbl, jstr(rule, "chain"));
	*why = "a rule that drops everything";
	return *hook && rule_drops_all(json_object_get(rule, "expr"));
}

int netsetup_blockers(const char *table, char *out, size_t len)
{
	const char *argv[] = {"nft", "-j", "list", "ruleset", NULL};
	char *buf = malloc(NFT_OUT_MAX);
	json_t *root = NULL, *items, *it;
	size_t used = 0, i;
	int status, rc, count = 0;

	if (len)
		out[0] = '\0';
	if (!buf)
		return -ENOMEM;
	rc = proc_run(argv, PROC_STDOUT, buf, NFT_OUT_MAX, &status);
	if (rc == 0 && status != 0)
		rc = -EIO;
	if (rc == 0 && !(root = json_loads(buf, 0, NULL)))
		rc = -EBADMSG; /* also a ruleset larger than NFT_OUT_MAX */
	free(buf);
	if (rc < 0)
		return rc;
	items = json_object_get(root, "nftables");
	json_array_foreach(items, i, it)
	{
		json_t *o = json_object_get(it, "chain");
		const char *hook = NULL, *why = NULL;
		int n;

		if (!item_blocks(items, it, table, &hook, &why))
			continue;
		if (!o)
			o = json_object_get(it, "rule");
		count++;
		if (used >= len)
			continue;
		n = snprintf(out + used, len - used,
		             "nftables table \"%s %s\", chain \"%s\" (hook %s, %s) drops %s unless "
		             "one of its rules accepts their ranges (%s, %s) first: %s\n",
		             jstr(o, "family"), jstr(o, "table"),
		             jstr(o, json_object_get(o, "name") ? "name" : "chain"), hook, why,
		             dropped(hook), KILN_SANDBOX_NET4, KILN_SANDBOX_NET6,
		             consequence(hook));
		used += n > 0 ? (size_t)n : 0;
	}
	json_decref(root);
	return count;
}
