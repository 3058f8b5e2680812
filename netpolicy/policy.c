/*
 * policy.c - loading, attaching and live updates of a sandbox's eBPF policy (see policy.h).
 */
#include "netpolicy/policy.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/pkt_cls.h>

#include "common/log.h"
#include "egress.skel.h"

enum {
	M_CFG, M_LIMITS, M_COUNTERS, M_ALLOW4, M_ALLOW4P, M_ALLOW6, M_ALLOW6P, M_DENY4, M_DENY6,
	M_DNS, M_FLOWS, M_RULES, M_CONNLOG, M_NAMES, M__COUNT
};
static const char *const map_names[M__COUNT] = {
	"cfg", "limits", "counters", "allow4", "allow4p", "allow6", "allow6p", "deny4", "deny6",
	"dns", "flows", "rules", "connlog", "names",
};

struct kiln_policy {
	pthread_mutex_t mu;
	int fd[M__COUNT];
	char dir[256];
	/* host-name rules as of cfg.gen == rules_gen */
	struct kiln_ruleset rules;
	uint32_t rules_gen;
	bool rules_loaded;
};

static uint64_t mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static bool valid_name(const char *s)
{
	size_t n = s ? strlen(s) : 0;
	if (n == 0 || n > 64 || s[0] == '.')
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = s[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '-' || c == '.'))
			return false;
	}
	return true;
}

static enum kiln_err pin_dir(const struct kiln_policy_config *cfg, char *out, size_t len,
			     struct kiln_error *err)
{
	if (!valid_name(cfg->node_id))
		return kiln_error_set(err, KILN_E_INVALID, "invalid node id");
	if (!valid_name(cfg->sandbox_id))
		return kiln_error_set(err, KILN_E_INVALID, "invalid sandbox id");
	const char *root = cfg->pin_root ? cfg->pin_root : KILN_PIN_ROOT;
	int w = snprintf(out, len, "%s/%s/%s", root, cfg->node_id, cfg->sandbox_id);
	if (w < 0 || (size_t)w >= len)
		return kiln_error_set(err, KILN_E_INVALID, "pin path too long");
	return KILN_OK;
}

static int mkdirs(const char *path)
{
	char tmp[256];
	snprintf(tmp, sizeof(tmp), "%s", path);
	for (char *p = tmp + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(tmp, 0700) < 0 && errno != EEXIST)
			return -errno;
		*p = '/';
	}
	if (mkdir(tmp, 0700) < 0 && errno != EEXIST)
		return -errno;
	return 0;
}

#define BPFFS_MAGIC 0xcafe4a11

/* Mounts bpffs on /sys/fs/bpf when it is not there (some hosts and containers lack it). */
static int ensure_bpffs(const char *root)
{
	struct statfs st;
	if (strncmp(root, "/sys/fs/bpf", 11) != 0)
		return 0;
	if (statfs("/sys/fs/bpf", &st) == 0 && (unsigned long)st.f_type == BPFFS_MAGIC)
		return 0;
	if (mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700") < 0)
		return -errno;
	log_info("mounted bpffs on /sys/fs/bpf");
	return 0;
}

/* libbpf's messages go to our log; "Exclusivity flag on" is the expected EEXIST of a second
 * clsact hook create and is not worth a line. */
static int libbpf_log(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	char line[512];
	vsnprintf(line, sizeof(line), fmt, ap);
	size_t n = strlen(line);
	while (n && line[n - 1] == '\n')
		line[--n] = '\0';
	if (strstr(line, "Exclusivity flag on"))
		return 0;
	if (level == LIBBPF_WARN)
		log_warn("libbpf: %s", line);
	else
		log_debug("libbpf: %s", line);
	return 0;
}

static pthread_once_t libbpf_once = PTHREAD_ONCE_INIT;
static void libbpf_setup(void)
{
	libbpf_set_print(libbpf_log);
}

static struct kiln_policy *policy_new(const char *dir)
{
	struct kiln_policy *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	pthread_mutex_init(&p->mu, NULL);
	for (int i = 0; i < M__COUNT; i++)
		p->fd[i] = -1;
	snprintf(p->dir, sizeof(p->dir), "%s", dir);
	return p;
}

void kiln_policy_close(struct kiln_policy *p)
{
	if (!p)
		return;
	for (int i = 0; i < M__COUNT; i++)
		if (p->fd[i] >= 0)
			close(p->fd[i]);
	kiln_ruleset_free(&p->rules);
	pthread_mutex_destroy(&p->mu);
	free(p);
}

const char *kiln_policy_pin_dir(const struct kiln_policy *p)
{
	return p->dir;
}

int kiln_policy_map_fd(const struct kiln_policy *p, const char *name)
{
	for (int i = 0; i < M__COUNT; i++)
		if (strcmp(map_names[i], name) == 0)
			return p->fd[i];
	return -1;
}

static int get_cfg(struct kiln_policy *p, struct np_cfg *c)
{
	uint32_t k = 0;
	return bpf_map_lookup_elem(p->fd[M_CFG], &k, c) < 0 ? -errno : 0;
}

static int put_cfg(struct kiln_policy *p, const struct np_cfg *c)
{
	uint32_t k = 0;
	return bpf_map_update_elem(p->fd[M_CFG], &k, c, BPF_ANY) < 0 ? -errno : 0;
}

/* ---- denied ranges ---- */

enum kiln_err kiln_policy_deny_ranges(const char *deny, struct kiln_cidr *out, size_t max,
				      size_t *n, struct kiln_error *err)
{
	bool host = false;
	enum kiln_err e;

	*n = 0;
	if ((e = kiln_cidrs_parse(KILN_EGRESS_DENY_FLOOR, out, max, n, &host, err)) != KILN_OK ||
	    (e = kiln_cidrs_parse(deny ? deny : KILN_EGRESS_DENY_DEFAULT, out, max, n, &host,
				  err)) != KILN_OK)
		return e;
	if (!host)
		return KILN_OK;
	struct ifaddrs *ifa = NULL;
	if (getifaddrs(&ifa) < 0)
		return kiln_error_set(err, KILN_E_IO, "the host's addresses: %s", strerror(errno));
	for (struct ifaddrs *i = ifa; i; i = i->ifa_next) {
		struct kiln_cidr c;
		memset(&c, 0, sizeof(c));
		if (!i->ifa_addr)
			continue;
		if (i->ifa_addr->sa_family == AF_INET) {
			c.family = 4;
			c.plen = 32;
			memcpy(c.addr, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, 4);
		} else if (i->ifa_addr->sa_family == AF_INET6) {
			c.family = 6;
			c.plen = 128;
			memcpy(c.addr, &((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr, 16);
		} else {
			continue;
		}
		if (kiln_cidrs_cover(out, *n, c.family, c.addr, c.plen))
			continue;	/* already inside a listed range */
		if (*n >= max) {
			freeifaddrs(ifa);
			return kiln_error_set(err, KILN_E_TOO_LARGE,
					      "egress_deny and the host's addresses: more than %zu "
					      "ranges", max);
		}
		out[(*n)++] = c;
	}
	freeifaddrs(ifa);
	return KILN_OK;
}

/* Replaces the content of an LPM map with keys[] (each `ksz` bytes), values = plen. */
static int sync_lpm(int fd, const void *keys, const uint32_t *vals, size_t n, size_t ksz)
{
	for (size_t i = 0; i < n; i++) {
		struct np_lpm_val v = {.plen = vals[i]};
		if (bpf_map_update_elem(fd, (const char *)keys + i * ksz, &v, BPF_ANY) < 0)
			return -errno;
	}
	uint8_t cur[32], next[32];
	void *prev = NULL;
	/* collect stale keys first: deleting while iterating an LPM trie restarts the walk */
	size_t cap = 64, ns = 0;
	uint8_t *stale = malloc(cap * ksz);
	if (!stale)
		return -ENOMEM;
	while (bpf_map_get_next_key(fd, prev, next) == 0) {
		bool keep = false;
		for (size_t i = 0; i < n && !keep; i++)
			keep = memcmp(next, (const char *)keys + i * ksz, ksz) == 0;
		if (!keep) {
			if (ns == cap) {
				uint8_t *s2 = realloc(stale, cap * 2 * ksz);
				if (!s2) {
					free(stale);
					return -ENOMEM;
				}
				stale = s2;
				cap *= 2;
			}
			memcpy(stale + ns * ksz, next, ksz);
			ns++;
		}
		memcpy(cur, next, ksz);
		prev = cur;
	}
	for (size_t i = 0; i < ns; i++)
		bpf_map_delete_elem(fd, stale + i * ksz);
	free(stale);
	return 0;
}

static enum kiln_err sync_deny(struct kiln_policy *p, const char *deny, struct kiln_error *err)
{
	struct kiln_cidr v[2 * KILN_DENY_MAX];
	struct np_lpm4 k4[KILN_DENY_MAX];
	struct np_lpm6 k6[KILN_DENY_MAX];
	uint32_t v4[KILN_DENY_MAX] = {0}, v6[KILN_DENY_MAX] = {0};	/* zeroed: -O3 cannot see n4, n6 bound the reads */
	size_t n = 0, n4 = 0, n6 = 0;
	enum kiln_err e = kiln_policy_deny_ranges(deny, v, 2 * KILN_DENY_MAX, &n, err);

	if (e != KILN_OK)
		return e;
	for (size_t i = 0; i < n; i++) {
		if (v[i].family == 4 && n4 < KILN_DENY_MAX) {
			memset(&k4[n4], 0, sizeof(k4[n4]));
			k4[n4].prefixlen = v[i].plen;
			memcpy(k4[n4].data, v[i].addr, 4);
			v4[n4++] = v[i].plen;
		} else if (v[i].family == 6 && n6 < KILN_DENY_MAX) {
			memset(&k6[n6], 0, sizeof(k6[n6]));
			k6[n6].prefixlen = v[i].plen;
			memcpy(k6[n6].data, v[i].addr, 16);
			v6[n6++] = v[i].plen;
		} else {
			return kiln_error_set(err, KILN_E_TOO_LARGE, "more than %d denied ranges of "
					      "one family", KILN_DENY_MAX);
		}
	}
	int rc = sync_lpm(p->fd[M_DENY4], k4, v4, n4, sizeof(k4[0]));
	if (rc == 0)
		rc = sync_lpm(p->fd[M_DENY6], k6, v6, n6, sizeof(k6[0]));
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "denied ranges: %s", strerror(-rc));
	return KILN_OK;
}

/*
 * The denied range (from the maps) that contains all of family/addr/plen, written as text into
 * `range`; false when there is none.
 */
static bool deny_cover(struct kiln_policy *p, int family, const uint8_t *addr, unsigned plen,
		       char *range, size_t len)
{
	struct np_lpm_val v;
	struct kiln_cidr c = {.family = family};
	int rc;
	if (family == 4) {
		struct np_lpm4 k = {.prefixlen = plen};
		memcpy(k.data, addr, 4);
		rc = bpf_map_lookup_elem(p->fd[M_DENY4], &k, &v);
	} else {
		struct np_lpm6 k = {.prefixlen = plen};
		memcpy(k.data, addr, 16);
		rc = bpf_map_lookup_elem(p->fd[M_DENY6], &k, &v);
	}
	if (rc < 0)
		return false;
	/* the trie only matches entries no longer than the key: v.plen <= plen */
	memcpy(c.addr, addr, family == 4 ? 4 : 16);
	c.plen = (uint8_t)v.plen;
	kiln_cidr_mask(&c);
	if (kiln_cidr_format(&c, range, len) < 0)
		snprintf(range, len, "?");
	return true;
}

bool kiln_policy_addr_denied(struct kiln_policy *p, int family, const uint8_t *addr)
{
	struct np_lpm_val v;
	if (family == 4) {
		struct np_lpm4 k = {.prefixlen = 32};
		memcpy(k.data, addr, 4);
		return bpf_map_lookup_elem(p->fd[M_DENY4], &k, &v) == 0;
	}
	struct np_lpm6 k = {.prefixlen = 128};
	memcpy(k.data, addr, 16);
	return bpf_map_lookup_elem(p->fd[M_DENY6], &k, &v) == 0;
}

/* ---- attach / open ---- */

static int tc_attach(int ifindex, enum bpf_tc_attach_point where, int prog_fd)
{
	DECLARE_LIBBPF_OPTS(bpf_tc_hook, hook, .ifindex = ifindex, .attach_point = where);
	int rc = bpf_tc_hook_create(&hook);
	if (rc < 0 && rc != -EEXIST)
		return rc;
	DECLARE_LIBBPF_OPTS(bpf_tc_opts, opts, .handle = 1, .priority = 1, .prog_fd = prog_fd,
			    .flags = BPF_TC_F_REPLACE);
	return bpf_tc_attach(&hook, &opts);
}

static enum kiln_err set_rodata(struct egress_bpf *s, const struct kiln_sbnet *net,
				struct kiln_error *err)
{
	uint32_t g4, gw4;
	inet_pton(AF_INET, KILN_GUEST_IP4, &g4);
	inet_pton(AF_INET, KILN_GATEWAY_IP4, &gw4);
	s->rodata->guest_ip4 = g4;
	s->rodata->gw_ip4 = gw4;
	uint32_t n4;
	memcpy(&n4, net->nat_ip4, 4);
	s->rodata->nat_ip4 = n4;
	uint8_t a[16];
	inet_pton(AF_INET6, KILN_GUEST_IP6, a);
	memcpy((void *)s->rodata->guest_ip6, a, 16);
	inet_pton(AF_INET6, KILN_GUEST_LL6, a);
	memcpy((void *)s->rodata->guest_ll6, a, 16);
	inet_pton(AF_INET6, KILN_GATEWAY_IP6, a);
	memcpy((void *)s->rodata->gw_ip6, a, 16);
	memcpy((void *)s->rodata->nat_ip6, net->nat_ip6, 16);
	unsigned mac[6];
	if (sscanf(KILN_GUEST_MAC, "%x:%x:%x:%x:%x:%x", &mac[0], &mac[1], &mac[2], &mac[3],
		   &mac[4], &mac[5]) != 6)
		return kiln_error_set(err, KILN_E_INTERNAL, "bad guest MAC");
	for (int i = 0; i < 6; i++)
		((uint8_t *)s->rodata->guest_mac)[i] = (uint8_t)mac[i];
	return KILN_OK;
}

static enum kiln_err init_state(struct kiln_policy *p, const struct kiln_policy_config *cfg,
				struct kiln_error *err)
{
	struct np_cfg c;
	if (get_cfg(p, &c) < 0)
		return kiln_error_set(err, KILN_E_IO, "read cfg: %s", strerror(errno));
	if (c.gen != 0)
		return KILN_OK;	/* reused maps: keep everything */
	uint32_t k = 0;
	struct np_limits l;
	memset(&l, 0, sizeof(l));
	l.unmetered = 1;
	l.conn_rate = cfg->conn_rate ? cfg->conn_rate : KILN_CONN_RATE_DEFAULT;
	l.conn_burst = cfg->conn_burst ? cfg->conn_burst
		       : (cfg->conn_rate ? cfg->conn_rate : KILN_CONN_BURST_DEFAULT);
	l.conn_tokens = (uint64_t)l.conn_burst * 1000;
	l.conn_last_ns = mono_ns();
	l.last_ns = l.conn_last_ns;
	if (bpf_map_update_elem(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK) < 0)
		return kiln_error_set(err, KILN_E_IO, "init limits: %s", strerror(errno));
	c.mode = NP_MODE_OPEN;
	c.nrules = 0;
	c.gen = 1;
	if (put_cfg(p, &c) < 0)
		return kiln_error_set(err, KILN_E_IO, "init cfg: %s", strerror(errno));
	return KILN_OK;
}

/* Programs loaded and maps made (pinned), not yet on any device: kiln_policy_load's result. */
struct kiln_policy_load {
	struct egress_bpf *s;
	struct kiln_policy *p;
	char sandbox_id[65];
};

void kiln_policy_load_free(struct kiln_policy_load *l)
{
	if (!l)
		return;
	kiln_policy_close(l->p);
	egress_bpf__destroy(l->s);
	free(l);
}

enum kiln_err kiln_policy_load(const struct kiln_policy_config *cfg, struct kiln_policy_load **out,
			       struct kiln_error *err)
{
	char dir[256];
	struct kiln_policy_load *l;
	enum kiln_err e = pin_dir(cfg, dir, sizeof(dir), err);
	int rc;

	*out = NULL;
	if (e)
		return e;
	if (!cfg->net)
		return kiln_error_set(err, KILN_E_INVALID, "attach needs the sandbox network");
	pthread_once(&libbpf_once, libbpf_setup);
	rc = ensure_bpffs(dir);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "mount bpffs: %s", strerror(-rc));
	rc = mkdirs(dir);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "mkdir \"%s\": %s", dir, strerror(-rc));
	l = calloc(1, sizeof(*l));
	if (!l)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	snprintf(l->sandbox_id, sizeof(l->sandbox_id), "%s", cfg->sandbox_id);

	DECLARE_LIBBPF_OPTS(bpf_object_open_opts, oo, .pin_root_path = dir);
	l->s = egress_bpf__open_opts(&oo);
	if (!l->s) {
		e = kiln_error_set(err, KILN_E_INTERNAL, "open BPF object: %s", strerror(errno));
		goto fail;
	}
	if ((e = set_rodata(l->s, cfg->net, err)) != KILN_OK)
		goto fail;
	if ((rc = egress_bpf__load(l->s)) < 0) {
		e = kiln_error_set(err, KILN_E_INTERNAL,
				   "load BPF programs for \"%s\": %s (pinned maps of another "
				   "layout must be removed first)", cfg->sandbox_id, strerror(-rc));
		goto fail;
	}
	l->p = policy_new(dir);
	if (!l->p) {
		e = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto fail;
	}
	struct egress_bpf *s = l->s;
	struct bpf_map *maps[M__COUNT] = {
		s->maps.cfg, s->maps.limits, s->maps.counters, s->maps.allow4, s->maps.allow4p,
		s->maps.allow6, s->maps.allow6p, s->maps.deny4, s->maps.deny6, s->maps.dns,
		s->maps.flows, s->maps.rules, s->maps.connlog, s->maps.names,
	};
	for (int i = 0; i < M__COUNT; i++)
		l->p->fd[i] = dup(bpf_map__fd(maps[i]));
	if ((e = init_state(l->p, cfg, err)) != KILN_OK)
		goto fail;
	if ((e = sync_deny(l->p, cfg->deny, err)) != KILN_OK)
		goto fail;
	/* the denied ranges may have changed: every live flow re-checks at its next packet */
	struct np_cfg gc;
	if ((rc = get_cfg(l->p, &gc)) == 0) {
		gc.gen++;
		rc = put_cfg(l->p, &gc);
	}
	if (rc < 0) {
		e = kiln_error_set(err, KILN_E_IO, "bump generation: %s", strerror(-rc));
		goto fail;
	}
	*out = l;
	return KILN_OK;
fail:
	kiln_policy_load_free(l);
	return e;
}

struct kiln_policy *kiln_policy_load_take(struct kiln_policy_load *l)
{
	struct kiln_policy *p = l->p;

	l->p = NULL;
	return p;
}

enum kiln_err kiln_policy_hook(struct kiln_policy_load *l, const struct kiln_sbnet *net,
			       struct kiln_policy **out, struct kiln_error *err)
{
	struct egress_bpf *s = l->s;
	enum kiln_err e = KILN_OK;
	int saved, rc;

	if (out)
		*out = NULL;
	if ((rc = kiln_sbnet_enter(net, &saved)) < 0) {
		e = kiln_error_set(err, KILN_E_IO, "enter \"%s\": %s", net->netns, strerror(-rc));
		goto out;
	}
	/*
	 * The uplink's NAT first, the TAP's two programs last: a TAP gated by kiln_policy_gate
	 * passes nothing until its own program replaces the gate, and then finds the NAT in place.
	 */
	int tap = (int)if_nametoindex(KILN_NET_TAP), up = (int)if_nametoindex(KILN_NET_UPLINK);
	if (!tap || !up) {
		e = kiln_error_set(err, KILN_E_NOT_FOUND, "devices of \"%s\" missing", net->netns);
	} else if ((rc = tc_attach(up, BPF_TC_EGRESS, bpf_program__fd(s->progs.np_snat))) < 0 ||
		   (rc = tc_attach(up, BPF_TC_INGRESS, bpf_program__fd(s->progs.np_dnat))) < 0 ||
		   (rc = tc_attach(tap, BPF_TC_EGRESS, bpf_program__fd(s->progs.np_to_guest))) < 0 ||
		   (rc = tc_attach(tap, BPF_TC_INGRESS, bpf_program__fd(s->progs.np_from_guest))) < 0) {
		e = kiln_error_set(err, KILN_E_IO, "tc attach in \"%s\": %s", net->netns,
				   strerror(-rc));
	}
	if (kiln_sbnet_leave(saved) < 0) {
		log_error("cannot return from netns \"%s\"", net->netns);
		abort();
	}
	if (e == KILN_OK) {
		log_info("network policy of \"%s\" attached", l->sandbox_id);
		if (out) {
			*out = l->p;	/* tc keeps the programs; the policy's dups keep the maps */
			l->p = NULL;
		}
	}
out:
	kiln_policy_load_free(l);
	return e;
}

enum kiln_err kiln_policy_gate(const struct kiln_sbnet *net, struct kiln_error *err)
{
	/* r0 = TC_ACT_SHOT; exit: every packet dropped, verified in microseconds */
	const struct bpf_insn drop[] = {
		{ .code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = BPF_REG_0, .imm = TC_ACT_SHOT },
		{ .code = BPF_JMP | BPF_EXIT },
	};
	enum kiln_err e = KILN_OK;
	int fd, saved, rc;

	pthread_once(&libbpf_once, libbpf_setup);
	fd = bpf_prog_load(BPF_PROG_TYPE_SCHED_CLS, "kiln_gate", "GPL", drop,
			   sizeof(drop) / sizeof(drop[0]), NULL);
	if (fd < 0)
		return kiln_error_set(err, KILN_E_INTERNAL, "load the gate program: %s",
				      strerror(-fd));
	if ((rc = kiln_sbnet_enter(net, &saved)) < 0) {
		close(fd);
		return kiln_error_set(err, KILN_E_IO, "enter \"%s\": %s", net->netns, strerror(-rc));
	}
	int tap = (int)if_nametoindex(KILN_NET_TAP);
	if (!tap)
		e = kiln_error_set(err, KILN_E_NOT_FOUND, "no %s in \"%s\"", KILN_NET_TAP, net->netns);
	else if ((rc = tc_attach(tap, BPF_TC_INGRESS, fd)) < 0 ||
		 (rc = tc_attach(tap, BPF_TC_EGRESS, fd)) < 0)
		e = kiln_error_set(err, KILN_E_IO, "tc attach of the gate in \"%s\": %s",
				   net->netns, strerror(-rc));
	if (kiln_sbnet_leave(saved) < 0) {
		log_error("cannot return from netns \"%s\"", net->netns);
		abort();
	}
	close(fd);	/* tc holds the program */
	return e;
}

enum kiln_err kiln_policy_attach(const struct kiln_policy_config *cfg, struct kiln_policy **out,
				 struct kiln_error *err)
{
	struct kiln_policy_load *l;
	enum kiln_err e = kiln_policy_load(cfg, &l, err);

	*out = NULL;
	return e == KILN_OK ? kiln_policy_hook(l, cfg->net, out, err) : e;
}

enum kiln_err kiln_policy_open(const struct kiln_policy_config *cfg, struct kiln_policy **out,
			       struct kiln_error *err)
{
	char dir[256];
	enum kiln_err e = pin_dir(cfg, dir, sizeof(dir), err);
	if (e)
		return e;
	struct kiln_policy *p = policy_new(dir);
	if (!p)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (int i = 0; i < M__COUNT; i++) {
		char path[320];
		snprintf(path, sizeof(path), "%s/%s", dir, map_names[i]);
		p->fd[i] = bpf_obj_get(path);
		if (p->fd[i] < 0) {
			e = kiln_error_set(err, errno == ENOENT ? KILN_E_NOT_FOUND : KILN_E_IO,
					   "open \"%s\": %s", path, strerror(errno));
			kiln_policy_close(p);
			return e;
		}
	}
	*out = p;
	return KILN_OK;
}

enum kiln_err kiln_policy_unpin(const char *pin_root, const char *node_id, const char *sandbox_id,
				struct kiln_error *err)
{
	char dir[256];
	struct kiln_policy_config c = {.pin_root = pin_root, .node_id = node_id,
				       .sandbox_id = sandbox_id};
	enum kiln_err e = pin_dir(&c, dir, sizeof(dir), err);
	if (e)
		return e;
	for (int i = 0; i < M__COUNT; i++) {
		char path[320];
		snprintf(path, sizeof(path), "%s/%s", dir, map_names[i]);
		if (unlink(path) < 0 && errno != ENOENT)
			e = kiln_error_set(err, KILN_E_IO, "unlink \"%s\": %s", path, strerror(errno));
	}
	if (rmdir(dir) < 0 && errno != ENOENT)
		e = kiln_error_set(err, KILN_E_IO, "rmdir \"%s\": %s", dir, strerror(errno));
	char *slash = strrchr(dir, '/');
	if (slash) {
		*slash = '\0';
		rmdir(dir);	/* the node's directory, when it was the last sandbox */
	}
	return e;
}

/* ---- rules ---- */

struct keys {
	struct np_lpm4 *k4;
	struct np_lpm4p *k4p;
	struct np_lpm6 *k6;
	struct np_lpm6p *k6p;
	uint32_t *v4, *v4p, *v6, *v6p;
	size_t n4, n4p, n6, n6p;
};

static void keys_free(struct keys *k)
{
	free(k->k4);
	free(k->k4p);
	free(k->k6);
	free(k->k6p);
	free(k->v4);
	free(k->v4p);
	free(k->v6);
	free(k->v6p);
}

static int keys_build(const struct kiln_ruleset *rs, struct keys *k)
{
	memset(k, 0, sizeof(*k));
	size_t n = rs->n ? rs->n : 1;
	k->k4 = calloc(n, sizeof(*k->k4));
	k->k4p = calloc(n, sizeof(*k->k4p));
	k->k6 = calloc(n, sizeof(*k->k6));
	k->k6p = calloc(n, sizeof(*k->k6p));
	k->v4 = calloc(n, 4);
	k->v4p = calloc(n, 4);
	k->v6 = calloc(n, 4);
	k->v6p = calloc(n, 4);
	if (!k->k4 || !k->k4p || !k->k6 || !k->k6p || !k->v4 || !k->v4p || !k->v6 || !k->v6p)
		return -ENOMEM;
	for (size_t i = 0; i < rs->n; i++) {
		const struct kiln_rule *r = &rs->rules[i];
		uint16_t port = htons(r->port);
		if (r->kind == KILN_RULE_NET4 && !r->port) {
			k->k4[k->n4].prefixlen = r->plen;
			memcpy(k->k4[k->n4].data, r->addr, 4);
			k->v4[k->n4++] = r->plen;
		} else if (r->kind == KILN_RULE_NET4) {
			k->k4p[k->n4p].prefixlen = 16u + r->plen;
			memcpy(k->k4p[k->n4p].data, &port, 2);
			memcpy(k->k4p[k->n4p].data + 2, r->addr, 4);
			k->v4p[k->n4p++] = r->plen;
		} else if (r->kind == KILN_RULE_NET6 && !r->port) {
			k->k6[k->n6].prefixlen = r->plen;
			memcpy(k->k6[k->n6].data, r->addr, 16);
			k->v6[k->n6++] = r->plen;
		} else if (r->kind == KILN_RULE_NET6) {
			k->k6p[k->n6p].prefixlen = 16u + r->plen;
			memcpy(k->k6p[k->n6p].data, &port, 2);
			memcpy(k->k6p[k->n6p].data + 2, r->addr, 16);
			k->v6p[k->n6p++] = r->plen;
		}
	}
	return 0;
}

static int add_keys(int fd, const void *keys, const uint32_t *vals, size_t n, size_t ksz)
{
	for (size_t i = 0; i < n; i++) {
		struct np_lpm_val v = {.plen = vals[i]};
		if (bpf_map_update_elem(fd, (const char *)keys + i * ksz, &v, BPF_ANY) < 0)
			return -errno;
	}
	return 0;
}

/* Loads the rule texts of the pinned `rules` map. */
static int load_rules(struct kiln_policy *p, uint32_t nrules, struct kiln_ruleset *out)
{
	out->n = 0;
	out->rules = NULL;
	if (nrules == 0)
		return 0;
	if (nrules > KILN_RULESET_MAX)
		return -EINVAL;
	out->rules = calloc(nrules, sizeof(*out->rules));
	if (!out->rules)
		return -ENOMEM;
	for (uint32_t i = 0; i < nrules; i++) {
		struct np_rule_text t;
		if (bpf_map_lookup_elem(p->fd[M_RULES], &i, &t) < 0)
			continue;
		t.text[sizeof(t.text) - 1] = '\0';
		if (kiln_rule_parse(t.text, &out->rules[out->n], NULL) == KILN_OK)
			out->n++;
	}
	return 0;
}

/* Keeps p->rules in step with cfg.gen. Called with p->mu held. */
static void refresh_rules(struct kiln_policy *p, const struct np_cfg *c)
{
	if (p->rules_loaded && p->rules_gen == c->gen)
		return;
	struct kiln_ruleset rs;
	if (load_rules(p, c->nrules, &rs) < 0)
		return;
	kiln_ruleset_free(&p->rules);
	p->rules = rs;
	p->rules_gen = c->gen;
	p->rules_loaded = true;
}

/*
 * Deletes the name pins that match `drop` (rs: names no rule of rs covers; NULL: expired ones no
 * live flow uses, now = mono time). Returns how many went.
 */
static int names_sweep(struct kiln_policy *p, const struct kiln_ruleset *rs, uint64_t now);

static void purge_names(struct kiln_policy *p, const struct kiln_ruleset *rs)
{
	names_sweep(p, rs, 0);
}

/* Deletes learnt addresses whose name no rule of rs covers any more (on that port). */
static void purge_dns(struct kiln_policy *p, const struct kiln_ruleset *rs)
{
	struct np_dns_key cur, next;
	void *prev = NULL;
	size_t cap = 64, n = 0;
	struct np_dns_key *gone = malloc(cap * sizeof(*gone));
	if (!gone)
		return;
	while (bpf_map_get_next_key(p->fd[M_DNS], prev, &next) == 0) {
		struct np_dns_val v;
		bool keep = false;
		if (bpf_map_lookup_elem(p->fd[M_DNS], &next, &v) == 0) {
			v.name[sizeof(v.name) - 1] = '\0';
			uint16_t ports[16];
			size_t m = kiln_rules_match_host(rs, v.name, ports, 16);
			for (size_t i = 0; i < m && !keep; i++)
				keep = htons(ports[i]) == next.port;
		}
		if (!keep) {
			if (n == cap) {
				struct np_dns_key *g2 = realloc(gone, cap * 2 * sizeof(*gone));
				if (!g2)
					break;
				gone = g2;
				cap *= 2;
			}
			gone[n++] = next;
		}
		cur = next;
		prev = &cur;
	}
	for (size_t i = 0; i < n; i++)
		bpf_map_delete_elem(p->fd[M_DNS], &gone[i]);
	free(gone);
	purge_names(p, rs);
}

static enum kiln_err policy_apply(struct kiln_policy *p, const struct kiln_ruleset *rs,
				  bool refuse_denied, struct kiln_error *err);

enum kiln_err kiln_policy_apply(struct kiln_policy *p, const struct kiln_ruleset *rs,
				struct kiln_error *err)
{
	return policy_apply(p, rs, true, err);
}

enum kiln_err kiln_policy_apply_held(struct kiln_policy *p, const struct kiln_ruleset *rs,
				     struct kiln_error *err)
{
	return policy_apply(p, rs, false, err);
}

static enum kiln_err policy_apply(struct kiln_policy *p, const struct kiln_ruleset *rs,
				  bool refuse_denied, struct kiln_error *err)
{
	if (rs->n > KILN_RULESET_MAX)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "at most %d egress rules",
				      KILN_RULESET_MAX);
	for (size_t i = 0; i < rs->n; i++) {
		const struct kiln_rule *r = &rs->rules[i];
		char range[64], text[KILN_RULE_TEXT_MAX];
		if ((r->kind != KILN_RULE_NET4 && r->kind != KILN_RULE_NET6) ||
		    !deny_cover(p, r->kind == KILN_RULE_NET4 ? 4 : 6, r->addr, r->plen, range,
				sizeof(range)))
			continue;
		if (kiln_rule_format(r, text, sizeof(text)) < 0)
			snprintf(text, sizeof(text), "?");
		if (!refuse_denied) {
			log_warn("egress rule \"%s\" (pins \"%s\") is inside the denied range %s: "
				 "kept, but it opens nothing", text, p->dir, range);
			continue;
		}
		return kiln_error_set(err, KILN_E_INVALID,
				      "egress rule \"%s\" is inside the denied range %s (the "
				      "operator's egress_deny): no rule can open it", text, range);
	}
	struct keys k;
	if (keys_build(rs, &k) < 0) {
		keys_free(&k);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	enum kiln_err e = KILN_OK;
	int rc;
	pthread_mutex_lock(&p->mu);
	struct np_cfg c;
	if ((rc = get_cfg(p, &c)) < 0) {
		e = kiln_error_set(err, KILN_E_IO, "read cfg: %s", strerror(-rc));
		goto out;
	}
	if (rs->n == 0) {
		/* reopening: the mode goes first, so nothing the new (open) policy allows drops */
		c.mode = NP_MODE_OPEN;
		c.nrules = 0;
		c.gen++;
		if ((rc = put_cfg(p, &c)) < 0) {
			e = kiln_error_set(err, KILN_E_IO, "write cfg: %s", strerror(-rc));
			goto out;
		}
	}
	/* 1. add the new entries: for a while, old and new rules both allow */
	if ((rc = add_keys(p->fd[M_ALLOW4], k.k4, k.v4, k.n4, sizeof(*k.k4))) < 0 ||
	    (rc = add_keys(p->fd[M_ALLOW4P], k.k4p, k.v4p, k.n4p, sizeof(*k.k4p))) < 0 ||
	    (rc = add_keys(p->fd[M_ALLOW6], k.k6, k.v6, k.n6, sizeof(*k.k6))) < 0 ||
	    (rc = add_keys(p->fd[M_ALLOW6P], k.k6p, k.v6p, k.n6p, sizeof(*k.k6p))) < 0) {
		e = kiln_error_set(err, KILN_E_IO, "add rules: %s", strerror(-rc));
		goto out;
	}
	/* 2. remove what the new set does not have, and addresses learnt for dropped names */
	if ((rc = sync_lpm(p->fd[M_ALLOW4], k.k4, k.v4, k.n4, sizeof(*k.k4))) < 0 ||
	    (rc = sync_lpm(p->fd[M_ALLOW4P], k.k4p, k.v4p, k.n4p, sizeof(*k.k4p))) < 0 ||
	    (rc = sync_lpm(p->fd[M_ALLOW6], k.k6, k.v6, k.n6, sizeof(*k.k6))) < 0 ||
	    (rc = sync_lpm(p->fd[M_ALLOW6P], k.k6p, k.v6p, k.n6p, sizeof(*k.k6p))) < 0) {
		e = kiln_error_set(err, KILN_E_IO, "remove rules: %s", strerror(-rc));
		goto out;
	}
	purge_dns(p, rs);
	/* 3. the texts, for reading back and for the DNS proxy */
	for (uint32_t i = 0; i < rs->n; i++) {
		struct np_rule_text t;
		memset(&t, 0, sizeof(t));
		kiln_rule_format(&rs->rules[i], t.text, sizeof(t.text));
		if (bpf_map_update_elem(p->fd[M_RULES], &i, &t, BPF_ANY) < 0) {
			e = kiln_error_set(err, KILN_E_IO, "store rule text: %s", strerror(errno));
			goto out;
		}
	}
	for (uint32_t i = (uint32_t)rs->n; i < KILN_RULESET_MAX; i++)
		if (bpf_map_delete_elem(p->fd[M_RULES], &i) < 0 && i >= c.nrules)
			break;
	/* 4. switch: every flow re-checks the policy at its next packet */
	c.mode = rs->n ? NP_MODE_ALLOWLIST : NP_MODE_OPEN;
	c.nrules = (uint32_t)rs->n;
	c.gen++;
	if ((rc = put_cfg(p, &c)) < 0)
		e = kiln_error_set(err, KILN_E_IO, "write cfg: %s", strerror(-rc));
out:
	pthread_mutex_unlock(&p->mu);
	keys_free(&k);
	return e;
}

enum kiln_err kiln_policy_rules(struct kiln_policy *p, struct kiln_ruleset *out,
				enum kiln_egress_mode *mode, struct kiln_error *err)
{
	struct np_cfg c;
	out->n = 0;
	out->rules = NULL;
	pthread_mutex_lock(&p->mu);
	int rc = get_cfg(p, &c);
	if (rc == 0)
		rc = load_rules(p, c.nrules, out);
	pthread_mutex_unlock(&p->mu);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "read rules: %s", strerror(-rc));
	if (mode)
		*mode = c.mode == NP_MODE_ALLOWLIST ? KILN_EGRESS_ALLOWLIST : KILN_EGRESS_OPEN;
	return KILN_OK;
}

/* ---- limits and counters ---- */

static int64_t real_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/*
 * Starts `l` (settings already in it) at the saved level of `bw`, plus the refill of the time
 * since bw->level_at_ns, as of `now` (CLOCK_MONOTONIC).
 */
static void bucket_restore(struct np_limits *l, const struct kiln_bandwidth *bw, uint64_t now)
{
	int64_t gone = real_ns() - bw->level_at_ns;
	uint64_t ims = (uint64_t)l->set_interval_s * 1000;

	l->tokens = bw->level_tokens < l->capacity ? bw->level_tokens : l->capacity;
	l->burst_left = bw->level_burst_left < bw->one_time_burst_bytes ? bw->level_burst_left
									  : bw->one_time_burst_bytes;
	l->refill_frac = ims && bw->level_frac < ims ? bw->level_frac : 0;
	l->last_ns = now;
	if (gone > 0) {
		/* the sub-millisecond rest is earned at the program's next whole millisecond */
		np_bucket_add_ms(l, (uint64_t)gone / 1000000);
		if (now > (uint64_t)gone % 1000000)
			l->last_ns = now - (uint64_t)gone % 1000000;
	}
}

enum kiln_err kiln_policy_set_bandwidth(struct kiln_policy *p, const struct kiln_bandwidth *bw,
					struct kiln_error *err)
{
	if (!bw->unmetered && bw->refill_bytes && !bw->refill_interval_s)
		return kiln_error_set(err, KILN_E_INVALID, "refill_interval_s must be at least 1");
	if (bw->refill_bytes > (1ull << 46) || bw->quota_bytes > (1ull << 62) ||
	    bw->one_time_burst_bytes > (1ull << 62))
		return kiln_error_set(err, KILN_E_INVALID, "bandwidth value too large");
	uint32_t k = 0;
	struct np_limits l;
	pthread_mutex_lock(&p->mu);
	if (bpf_map_lookup_elem_flags(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK) < 0) {
		pthread_mutex_unlock(&p->mu);
		return kiln_error_set(err, KILN_E_IO, "read limits: %s", strerror(errno));
	}
	uint64_t now = mono_ns();
	bool was_unmetered = l.unmetered;
	uint64_t old_ims = (uint64_t)l.set_interval_s * 1000;
	/* what the old rate earned up to now is the tenant's; the new rate counts from now */
	if (!was_unmetered)
		np_bucket_refill(&l, now);
	l.unmetered = bw->unmetered;
	l.capacity = bw->quota_bytes;
	l.unused_q16 = 0;
	l.set_refill_bytes = bw->refill_interval_s ? bw->refill_bytes : 0;
	l.set_interval_s = bw->refill_interval_s;
	if (was_unmetered) {
		l.tokens = l.capacity;
		l.last_ns = now;
		l.refill_frac = 0;
		l.burst_left = bw->one_time_burst_bytes;
	} else {
		/* the remainder below a byte, in the new interval's units */
		uint64_t ims = (uint64_t)l.set_interval_s * 1000;
		l.refill_frac = ims && old_ims && l.refill_frac < old_ims
					? l.refill_frac * ims / old_ims : 0;
		if (l.tokens > l.capacity)
			l.tokens = l.capacity;
		if (bw->one_time_burst_bytes != l.set_burst)
			l.burst_left = bw->one_time_burst_bytes;
	}
	if (bw->has_level && !bw->unmetered)
		bucket_restore(&l, bw, now);
	l.set_burst = bw->one_time_burst_bytes;
	int rc = bpf_map_update_elem(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK);
	pthread_mutex_unlock(&p->mu);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "write limits: %s", strerror(errno));
	return KILN_OK;
}

enum kiln_err kiln_policy_get_bandwidth(struct kiln_policy *p, struct kiln_bandwidth *out,
					struct kiln_error *err)
{
	uint32_t k = 0;
	struct np_limits l;
	if (bpf_map_lookup_elem_flags(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK) < 0)
		return kiln_error_set(err, KILN_E_IO, "read limits: %s", strerror(errno));
	memset(out, 0, sizeof(*out));
	out->unmetered = l.unmetered;
	out->quota_bytes = l.capacity;
	out->refill_bytes = l.set_refill_bytes;
	out->refill_interval_s = l.set_interval_s;
	out->one_time_burst_bytes = l.set_burst;
	if (l.unmetered)
		return KILN_OK;
	/* the program refills lazily: what it will add at its next packet counts already */
	uint64_t now = mono_ns();
	int64_t real = real_ns();
	np_bucket_refill(&l, now);
	out->remaining_bytes = l.tokens + l.burst_left;
	out->has_level = true;
	out->level_tokens = l.tokens;
	out->level_burst_left = l.burst_left;
	out->level_frac = l.refill_frac;
	/* the level is that of l.last_ns (whole milliseconds): the same instant on the real clock */
	out->level_at_ns = real - (int64_t)(now > l.last_ns ? now - l.last_ns : 0);
	return KILN_OK;
}

enum kiln_err kiln_policy_set_conn_limit(struct kiln_policy *p, uint32_t per_second,
					 uint32_t burst, struct kiln_error *err)
{
	uint32_t k = 0;
	struct np_limits l;
	pthread_mutex_lock(&p->mu);
	int rc = bpf_map_lookup_elem_flags(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK);
	if (rc == 0) {
		l.conn_rate = per_second;
		l.conn_burst = burst ? burst : per_second;
		if (l.conn_tokens > (uint64_t)l.conn_burst * 1000)
			l.conn_tokens = (uint64_t)l.conn_burst * 1000;
		rc = bpf_map_update_elem(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK);
	}
	pthread_mutex_unlock(&p->mu);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "write limits: %s", strerror(errno));
	return KILN_OK;
}

static enum kiln_err read_counters(int fd, struct kiln_counters *out, struct kiln_error *err)
{
	int ncpu = libbpf_num_possible_cpus();
	if (ncpu <= 0)
		return kiln_error_set(err, KILN_E_IO, "cannot count CPUs");
	struct np_counters *v = calloc((size_t)ncpu, sizeof(*v));
	if (!v)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	uint32_t k = 0;
	if (bpf_map_lookup_elem(fd, &k, v) < 0) {
		free(v);
		return kiln_error_set(err, KILN_E_IO, "read counters: %s", strerror(errno));
	}
	memset(out, 0, sizeof(*out));
	for (int i = 0; i < ncpu; i++) {
		out->tx_bytes += v[i].tx_bytes;
		out->tx_packets += v[i].tx_packets;
		out->rx_bytes += v[i].rx_bytes;
		out->rx_packets += v[i].rx_packets;
		out->drop_policy_bytes += v[i].drop_policy_bytes;
		out->drop_policy_packets += v[i].drop_policy_packets;
		out->drop_quota_bytes += v[i].drop_quota_bytes;
		out->drop_quota_packets += v[i].drop_quota_packets;
		out->drop_spoof_packets += v[i].drop_spoof_packets;
		out->drop_rate_packets += v[i].drop_rate_packets;
	}
	free(v);
	return KILN_OK;
}

void kiln_policy_count_drop(struct kiln_policy *p)
{
	int ncpu = libbpf_num_possible_cpus();
	struct np_counters *v = ncpu > 0 ? calloc((size_t)ncpu, sizeof(*v)) : NULL;
	uint32_t k = 0;
	pthread_mutex_lock(&p->mu);
	if (v && bpf_map_lookup_elem(p->fd[M_COUNTERS], &k, v) == 0) {
		/* CPU 0's slot: the programs add without atomics, so a packet counted on CPU 0 at
		 * this very moment may be lost; the count stays a lower bound */
		v[0].drop_policy_packets++;
		bpf_map_update_elem(p->fd[M_COUNTERS], &k, v, BPF_ANY);
	}
	pthread_mutex_unlock(&p->mu);
	free(v);
}

uint64_t kiln_policy_charge(struct kiln_policy *p, bool tx, uint64_t want)
{
	int ncpu = libbpf_num_possible_cpus();
	struct np_counters *v = ncpu > 0 ? calloc((size_t)ncpu, sizeof(*v)) : NULL;
	uint64_t take = 0;
	uint32_t k = 0;
	struct np_limits l;

	if (!v || !want)
		goto out;
	pthread_mutex_lock(&p->mu);
	if (bpf_map_lookup_elem_flags(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK) < 0)
		goto unlock;
	if (l.unmetered) {
		take = want;
	} else {
		/* as the program's take_bytes(), but a part of `want` when less is left */
		np_bucket_refill(&l, mono_ns());
		take = want < l.burst_left + l.tokens ? want : l.burst_left + l.tokens;
		if (take <= l.burst_left) {
			l.burst_left -= take;
		} else {
			l.tokens -= take - l.burst_left;
			l.burst_left = 0;
		}
		if (bpf_map_update_elem(p->fd[M_LIMITS], &k, &l, BPF_F_LOCK) < 0) {
			take = 0;
			goto unlock;
		}
	}
	if (take && bpf_map_lookup_elem(p->fd[M_COUNTERS], &k, v) == 0) {
		/* CPU 0's slot, as kiln_policy_count_drop() */
		if (tx) {
			v[0].tx_bytes += take;
			v[0].tx_packets++;
		} else {
			v[0].rx_bytes += take;
			v[0].rx_packets++;
		}
		bpf_map_update_elem(p->fd[M_COUNTERS], &k, v, BPF_ANY);
	}
unlock:
	pthread_mutex_unlock(&p->mu);
out:
	free(v);
	return take;
}

enum kiln_err kiln_counters_read_pinned(const char *pin_root, const char *node_id,
					const char *sandbox_id, struct kiln_counters *out,
					struct kiln_error *err)
{
	char dir[256], path[320];
	struct kiln_policy_config c = {.pin_root = pin_root, .node_id = node_id,
				       .sandbox_id = sandbox_id};
	enum kiln_err e = pin_dir(&c, dir, sizeof(dir), err);
	if (e)
		return e;
	snprintf(path, sizeof(path), "%s/counters", dir);
	int fd = bpf_obj_get(path);
	if (fd < 0)
		return kiln_error_set(err, errno == ENOENT ? KILN_E_NOT_FOUND : KILN_E_IO,
				      "open \"%s\": %s", path, strerror(errno));
	e = read_counters(fd, out, err);
	close(fd);
	return e;
}

/* ---- DNS ---- */

size_t kiln_policy_host_ports(struct kiln_policy *p, const char *name, uint16_t *ports,
			      size_t max, enum kiln_egress_mode *mode)
{
	struct np_cfg c;
	size_t n = 0;
	pthread_mutex_lock(&p->mu);
	if (get_cfg(p, &c) < 0) {
		/* cannot tell: treat as allowlist with nothing allowed */
		pthread_mutex_unlock(&p->mu);
		*mode = KILN_EGRESS_ALLOWLIST;
		return 0;
	}
	refresh_rules(p, &c);
	*mode = c.mode == NP_MODE_ALLOWLIST ? KILN_EGRESS_ALLOWLIST : KILN_EGRESS_OPEN;
	n = kiln_rules_match_host(&p->rules, name, ports, max);
	pthread_mutex_unlock(&p->mu);
	return n;
}

static int name_key(struct np_name_key *k, const char *name, int family, const uint8_t *addr)
{
	memset(k, 0, sizeof(*k));
	size_t n = strlen(name);
	if ((family != 4 && family != 6) || n == 0 || n >= sizeof(k->name))
		return -1;
	k->family = (uint8_t)family;
	memcpy(k->addr, addr, family == 4 ? 4 : 16);
	memcpy(k->name, name, n);
	return 0;
}

static void dns_key(struct np_dns_key *k, int family, const uint8_t *addr, uint16_t port)
{
	memset(k, 0, sizeof(*k));
	k->family = (uint8_t)family;
	k->port = htons(port);
	memcpy(k->addr, addr, family == 4 ? 4 : 16);
}

enum kiln_err kiln_policy_dns_learn(struct kiln_policy *p, const char *name, int family,
				    const uint8_t *addr, uint16_t port, uint32_t ttl_s,
				    struct kiln_error *err)
{
	if (family != 4 && family != 6)
		return kiln_error_set(err, KILN_E_INVALID, "bad address family");
	if (kiln_policy_addr_denied(p, family, addr))
		return kiln_error_set(err, KILN_E_FORBIDDEN, "address in an always-denied range");
	struct np_dns_key k;
	struct np_dns_val v;
	dns_key(&k, family, addr, port);
	memset(&v, 0, sizeof(v));
	v.expires_ns = mono_ns() + (uint64_t)ttl_s * 1000000000ull;
	snprintf(v.name, sizeof(v.name), "%s", name);
	/* The pin first: an address the allow map has is always one a name check can find. */
	struct np_name_key nk;
	struct np_name_val nv = {.expires_ns = v.expires_ns};
	if (name_key(&nk, name, family, addr) < 0)
		return kiln_error_set(err, KILN_E_INVALID, "bad name");
	if (bpf_map_update_elem(p->fd[M_NAMES], &nk, &nv, BPF_ANY) < 0)
		return kiln_error_set(err, KILN_E_IO, "pin name: %s", strerror(errno));
	if (bpf_map_update_elem(p->fd[M_DNS], &k, &v, BPF_ANY) < 0)
		return kiln_error_set(err, KILN_E_IO, "learn address: %s", strerror(errno));
	return KILN_OK;
}

void kiln_policy_dns_forget(struct kiln_policy *p, const char *name, int family,
			    const uint8_t *addr, uint16_t port)
{
	struct np_dns_key k;
	struct np_dns_val v;
	dns_key(&k, family, addr, port);
	if (bpf_map_lookup_elem(p->fd[M_DNS], &k, &v) == 0) {
		v.name[sizeof(v.name) - 1] = '\0';
		if (strcmp(v.name, name) == 0)
			bpf_map_delete_elem(p->fd[M_DNS], &k);
	}
	struct np_name_key nk;
	if (name_key(&nk, name, family, addr) == 0)
		bpf_map_delete_elem(p->fd[M_NAMES], &nk);
}


enum kiln_err kiln_policy_set_namecheck(struct kiln_policy *p, bool on, struct kiln_error *err)
{
	pthread_mutex_lock(&p->mu);
	struct np_cfg c;
	int rc = get_cfg(p, &c);
	if (rc == 0) {
		c.flags = on ? c.flags | NP_CFG_NAMECHECK : c.flags & ~NP_CFG_NAMECHECK;
		rc = put_cfg(p, &c);
	}
	pthread_mutex_unlock(&p->mu);
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "set name check: %s", strerror(-rc));
	return KILN_OK;
}

bool kiln_policy_name_pinned(struct kiln_policy *p, const char *name, int family,
			     const uint8_t *addr, bool expired_ok)
{
	struct np_name_key k;
	struct np_name_val v;
	if (name_key(&k, name, family, addr) < 0 ||
	    bpf_map_lookup_elem(p->fd[M_NAMES], &k, &v) < 0)
		return false;
	return expired_ok || v.expires_ns > mono_ns();
}

static uint64_t timeout_of(uint8_t proto)
{
	return proto == 6 ? NP_FLOW_TCP_NS : proto == 17 ? NP_FLOW_UDP_NS : NP_FLOW_ICMP_NS;
}

static int names_sweep(struct kiln_policy *p, const struct kiln_ruleset *rs, uint64_t now)
{
	struct np_name_key cur, next;
	void *prev = NULL;
	size_t cap = 64, n = 0;
	struct np_name_key *gone = malloc(cap * sizeof(*gone));
	if (!gone)
		return 0;
	while (bpf_map_get_next_key(p->fd[M_NAMES], prev, &next) == 0) {
		struct np_name_val v;
		bool drop = false;
		if (rs) {
			uint16_t ports[16];
			next.name[sizeof(next.name) - 1] = '\0';
			drop = kiln_rules_match_host(rs, next.name, ports, 16) == 0;
		} else if (bpf_map_lookup_elem(p->fd[M_NAMES], &next, &v) == 0) {
			drop = v.expires_ns <= now;
		}
		if (drop) {
			if (n == cap) {
				struct np_name_key *g2 = realloc(gone, cap * 2 * sizeof(*gone));
				if (!g2)
					break;
				gone = g2;
				cap *= 2;
			}
			gone[n++] = next;
		}
		cur = next;
		prev = &cur;
	}
	if (!rs && n) {
		/* keep those a live flow still uses: its connection was checked against them */
		struct np_flow_key fc, fn;
		void *fp = NULL;
		while (bpf_map_get_next_key(p->fd[M_FLOWS], fp, &fn) == 0) {
			struct np_flow_val fv;
			if (bpf_map_lookup_elem(p->fd[M_FLOWS], &fn, &fv) == 0 &&
			    now - fv.last_ns < timeout_of(fn.proto)) {
				for (size_t i = 0; i < n; i++)
					if (gone[i].family == fn.family &&
					    memcmp(gone[i].addr, fn.raddr, 16) == 0)
						gone[i].family = 0;	/* kept */
			}
			fc = fn;
			fp = &fc;
		}
	}
	int deleted = 0;
	for (size_t i = 0; i < n; i++)
		if (gone[i].family && bpf_map_delete_elem(p->fd[M_NAMES], &gone[i]) == 0)
			deleted++;
	free(gone);
	return deleted;
}


int kiln_policy_dns_gc(struct kiln_policy *p)
{
	uint64_t now = mono_ns();
	names_sweep(p, NULL, now);
	struct np_dns_key cur, next;
	void *prev = NULL;
	struct np_dns_key expired[256];
	size_t n = 0;
	while (n < 256 && bpf_map_get_next_key(p->fd[M_DNS], prev, &next) == 0) {
		struct np_dns_val v;
		if (bpf_map_lookup_elem(p->fd[M_DNS], &next, &v) == 0 && v.expires_ns <= now)
			expired[n++] = next;
		cur = next;
		prev = &cur;
	}
	if (n == 0)
		return 0;
	/* keep those a live flow still uses */
	bool *live = calloc(n, sizeof(*live));
	if (!live)
		return 0;
	struct np_flow_key fc, fn;
	void *fp = NULL;
	while (bpf_map_get_next_key(p->fd[M_FLOWS], fp, &fn) == 0) {
		struct np_flow_val fv;
		if (bpf_map_lookup_elem(p->fd[M_FLOWS], &fn, &fv) == 0 &&
		    now - fv.last_ns < timeout_of(fn.proto)) {
			for (size_t i = 0; i < n; i++)
				if (expired[i].family == fn.family &&
				    memcmp(expired[i].addr, fn.raddr, 16) == 0 &&
				    (expired[i].port == 0 || expired[i].port == fn.rport))
					live[i] = true;
		}
		fc = fn;
		fp = &fc;
	}
	int gone = 0;
	for (size_t i = 0; i < n; i++)
		if (!live[i] && bpf_map_delete_elem(p->fd[M_DNS], &expired[i]) == 0)
			gone++;
	free(live);
	return gone;
}
