/*
 * np_tool.c - drives netpolicy/ from the integration tests and benchmarks, one command per run,
 * the way kiln-node would: each run is a fresh loader process, so a second `attach` is a restart.
 *
 *   np_tool [--netns NS] [--node ID] [--pin-root DIR] [--deny LIST] COMMAND ...
 *     (--deny: the operator's egress_deny for create/attach; NP_DNS_PENDING: the proxy's share)
 *     create ID INDEX [GUEST_NETNS]   netns + devices (stand-in veth into GUEST_NETNS) + attach
 *     attach ID INDEX                 load and attach again, reusing the pinned maps
 *     gated ID INDEX GUEST_NETNS      netns + devices (stand-in veth into GUEST_NETNS) + the gate
 *                                     (kiln_policy_gate) only, as kiln-node leaves them while a
 *                                     restored VM starts; `attach` then replaces the gate
 *     apply ID [RULE...]              replace the rules (none: reopen)
 *     force ID RULE                   write an address rule straight into the allow maps, past
 *                                     every check, and switch to allowlist mode (as a bug or an
 *                                     attacker with map access would): the program must still deny
 *     check-deny RULE...              the node's API check of a rule set against --deny (exit 2:
 *                                     refused, the reason on stderr)
 *     rules ID                        print the mode, then one rule per line
 *     bw ID QUOTA REFILL INTERVAL_S BURST UNMETERED
 *     bw-get ID
 *     bw-level ID QUOTA REFILL INTERVAL_S BURST TOKENS BURST_LEFT AGO_MS
 *                                     set a metered bucket from a saved level (as a restore
 *                                     does), the level taken AGO_MS before now
 *     bw-state ID                     the program's own bucket state, raw: tokens burst_left
 *                                     refill_frac last_ns (name=value)
 *     bw-poke ID TOKENS FRAC AGO_MS   write tokens and refill_frac straight into the map, last
 *                                     refill AGO_MS before now, so the program's next packet
 *                                     refills that long (as if the bucket sat idle that long)
 *     conn ID PER_SECOND BURST
 *     counters ID                     print name=value lines
 *     pins ID                         print the name-and-address pins: NAME ADDR SECONDS_LEFT
 *     pinned ID NAME ADDR             exit 0 when the DNS proxy answered NAME with ADDR (an
 *                                     unexpired name-and-address pin), 1 when not
 *     connlog ID MAX_PER_MINUTE       drain the connection log once (capped at MAX_PER_MINUTE
 *                                     events), print one JSON object per flow or refused
 *                                     attempt, then {"ring_lost":N,"over_cap":N}
 *     dns UPSTREAM ID:INDEX...        run the DNS proxy until SIGTERM or SIGINT; with NP_SNIPROXY=1
 *                                     the name-checking proxy too (caps: NP_SNI_CONNS_PER_SANDBOX,
 *                                     NP_SNI_CONNS, NP_SNI_HS_PER_SANDBOX, NP_SNI_HS); prints its
 *                                     counters ("sniproxy accepted=.. spliced=.. refused=..
 *                                     over_cap=.. cut=..") at the end, after its notes for
 *                                     the connection log, one a line ("note ID DECISION PORT
 *                                     GPORT NAME", NAME "-" when none)
 *     destroy ID                      devices, netns and pins
 *     testrun N                       ns per packet of np_from_guest (BPF_PROG_TEST_RUN)
 *     replace-time ID N REPEAT        time to replace N rules live
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>

#include "common/log.h"
#include "egress.skel.h"
#include "netpolicy/connlog.h"
#include "netpolicy/dns.h"
#include "netpolicy/netns.h"
#include "netpolicy/policy.h"
#include "netpolicy/rules.h"
#include "netpolicy/sniproxy.h"

static const char *node = "test";
static const char *pin_root = NULL;
static const char *deny = NULL;

static int fail(const struct kiln_error *err)
{
	fprintf(stderr, "error: %s: %s\n", kiln_err_name(err->code), err->msg);
	return err->code == KILN_E_INVALID ? 2 : 1;
}

static int open_pol(const char *id, uint32_t index, int attach, struct kiln_policy **p,
		    struct kiln_error *err)
{
	struct kiln_sbnet net;
	if (kiln_sbnet_describe(id, index, &net, err))
		return -1;
	struct kiln_policy_config c = {.pin_root = pin_root, .node_id = node, .sandbox_id = id,
				       .net = &net, .deny = deny};
	enum kiln_err e = attach ? kiln_policy_attach(&c, p, err) : kiln_policy_open(&c, p, err);
	return e ? -1 : 0;
}

static volatile sig_atomic_t stop;
static void on_sig(int s)
{
	(void)s;
	stop = 1;
}

static uint64_t mono(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Builds n rules like the benchmark's: n/2 CIDRs, n/2 address:port. */
static char **bench_rules(size_t n, unsigned salt)
{
	char **v = calloc(n, sizeof(*v));
	for (size_t i = 0; i < n; i++) {
		v[i] = malloc(40);
		unsigned x = (unsigned)i + salt * 7919u;
		if (i % 2)
			snprintf(v[i], 40, "198.18.%u.%u:443", (x >> 8) & 0xff, x & 0xff);
		else
			/* benchmarking space (198.19/16), outside every denied range */
			snprintf(v[i], 40, "198.19.%u.%u/30", (x >> 6) & 0xff, (x & 0x3f) * 4);
	}
	return v;
}

static int cmd_testrun(int reps)
{
	struct kiln_error err = {0};
	char dir[] = "/sys/fs/bpf/kiln-bench-XXXXXX";
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return 1;
	}
	DECLARE_LIBBPF_OPTS(bpf_object_open_opts, oo, .pin_root_path = dir);
	struct egress_bpf *s = egress_bpf__open_opts(&oo);
	int rc = 1;
	if (!s)
		goto out;
	inet_pton(AF_INET, KILN_GUEST_IP4, (void *)&s->rodata->guest_ip4);
	inet_pton(AF_INET, KILN_GATEWAY_IP4, (void *)&s->rodata->gw_ip4);
	if (egress_bpf__load(s) < 0)
		goto out_skel;
	/* a policy with 1,000 rules, the destination allowed by the last */
	char **texts = bench_rules(999, 1);
	const char *all[1000];
	for (int i = 0; i < 999; i++)
		all[i] = texts[i];
	all[999] = "203.0.113.10:80";
	struct kiln_ruleset rs;
	enum kiln_err pe = kiln_rules_parse(all, 1000, &rs, &err);
	for (int i = 0; i < 999; i++)
		free(texts[i]);
	free(texts);
	if (pe)
		goto out_skel;
	/* apply through the maps directly (no netns for this one) */
	{
		uint32_t k = 0;
		struct np_cfg cf = {.mode = NP_MODE_ALLOWLIST, .gen = 1, .nrules = 0};
		bpf_map_update_elem(bpf_map__fd(s->maps.cfg), &k, &cf, BPF_ANY);
		struct np_limits l;
		memset(&l, 0, sizeof(l));
		l.unmetered = 1;
		bpf_map_update_elem(bpf_map__fd(s->maps.limits), &k, &l, BPF_F_LOCK);
		for (size_t i = 0; i < rs.n; i++) {
			const struct kiln_rule *r = &rs.rules[i];
			struct np_lpm_val v = {.plen = r->plen};
			if (r->port) {
				struct np_lpm4p key = {.prefixlen = 16u + r->plen};
				uint16_t pt = htons(r->port);
				memcpy(key.data, &pt, 2);
				memcpy(key.data + 2, r->addr, 4);
				bpf_map_update_elem(bpf_map__fd(s->maps.allow4p), &key, &v, BPF_ANY);
			} else {
				struct np_lpm4 key = {.prefixlen = r->plen};
				memcpy(key.data, r->addr, 4);
				bpf_map_update_elem(bpf_map__fd(s->maps.allow4), &key, &v, BPF_ANY);
			}
		}
	}
	kiln_ruleset_free(&rs);
	uint8_t pkt[ETH_HLEN + sizeof(struct iphdr) + sizeof(struct tcphdr)] = {0};
	struct ethhdr eth = {.h_source = {0x06, 0x00, 0xac, 0x10, 0x00, 0x02},
			     .h_proto = htons(ETH_P_IP)};
	struct iphdr ip = {.version = 4, .ihl = 5, .ttl = 64, .protocol = IPPROTO_TCP,
			   .tot_len = htons(sizeof(struct iphdr) + sizeof(struct tcphdr))};
	inet_pton(AF_INET, KILN_GUEST_IP4, &ip.saddr);
	inet_pton(AF_INET, "203.0.113.10", &ip.daddr);
	struct tcphdr tcp = {.source = htons(40000), .dest = htons(80), .doff = 5, .ack = 1};
	memcpy(pkt, &eth, sizeof(eth));
	memcpy(pkt + ETH_HLEN, &ip, sizeof(ip));
	memcpy(pkt + ETH_HLEN + sizeof(ip), &tcp, sizeof(tcp));
	const char *names[2] = {"established flow", "new flow each packet (policy lookups)"};
	for (int mode = 0; mode < 2; mode++) {
		if (mode == 1) {
			/* a generation bump before each run makes every packet re-check the policy */
			uint32_t k = 0;
			struct np_cfg cf = {.mode = NP_MODE_ALLOWLIST, .gen = 1000, .nrules = 0};
			bpf_map_update_elem(bpf_map__fd(s->maps.cfg), &k, &cf, BPF_ANY);
		}
		uint8_t out[sizeof(pkt)];
		DECLARE_LIBBPF_OPTS(bpf_test_run_opts, to, .data_in = pkt, .data_size_in = sizeof(pkt),
				    .data_out = out, .data_size_out = sizeof(out), .repeat = reps);
		/* warm the flow */
		DECLARE_LIBBPF_OPTS(bpf_test_run_opts, warm, .data_in = pkt,
				    .data_size_in = sizeof(pkt), .repeat = 1);
		bpf_prog_test_run_opts(bpf_program__fd(s->progs.np_from_guest), &warm);
		if (mode == 1) {
			/* alternate generations can't be done inside one run; measure the
			 * uncached path by deleting the flow table entry: use gen mismatch */
			uint32_t k = 0;
			struct np_cfg cf = {.mode = NP_MODE_ALLOWLIST, .gen = 2000, .nrules = 0};
			bpf_map_update_elem(bpf_map__fd(s->maps.cfg), &k, &cf, BPF_ANY);
			to.repeat = 1;
			uint64_t total = 0;
			int runs = reps / 10 > 0 ? reps / 10 : 1;
			for (int i = 0; i < runs; i++) {
				cf.gen = 3000 + (uint32_t)i;
				bpf_map_update_elem(bpf_map__fd(s->maps.cfg), &k, &cf, BPF_ANY);
				if (bpf_prog_test_run_opts(bpf_program__fd(s->progs.np_from_guest), &to) < 0)
					goto out_skel;
				total += to.duration;
			}
			printf("testrun %s: %.1f ns/packet (verdict %s)\n", names[mode],
			       (double)total / runs, to.retval == 0 ? "pass" : "drop");
			continue;
		}
		if (bpf_prog_test_run_opts(bpf_program__fd(s->progs.np_from_guest), &to) < 0) {
			perror("test_run");
			goto out_skel;
		}
		printf("testrun %s: %u ns/packet (verdict %s)\n", names[mode], to.duration,
		       to.retval == 0 ? "pass" : "drop");
	}
	rc = 0;
out_skel:
	egress_bpf__destroy(s);
out:
	{
		char path[256];
		const char *maps[] = {"cfg", "limits", "counters", "allow4", "allow4p", "allow6",
				      "allow6p", "deny4", "deny6", "dns", "flows", "rules",
				      "connlog"};
		for (size_t i = 0; i < sizeof(maps) / sizeof(maps[0]); i++) {
			snprintf(path, sizeof(path), "%s/%s", dir, maps[i]);
			unlink(path);
		}
		rmdir(dir);
	}
	if (rc)
		fprintf(stderr, "testrun failed: %s\n", err.msg);
	return rc;
}

/* Drains a sandbox's connection log once and prints it as JSON lines. */
/* The name-checking proxy's notes, kept until the end (printing at once could block it). */
static pthread_mutex_t notes_mu = PTHREAD_MUTEX_INITIALIZER;
static char notes[1000][600];
static size_t nnotes;

static void keep_note(void *arg, const char *sb, const struct kiln_conn_note *n)
{
	(void)arg;
	pthread_mutex_lock(&notes_mu);
	if (nnotes < sizeof(notes) / sizeof(notes[0])) {
		char d[64];
		snprintf(d, sizeof(d), "%s%s%s", kiln_proxy_decision_name(n->decision),
			 n->detail[0] ? ":" : "", n->detail);
		snprintf(notes[nnotes++], sizeof(notes[0]), "note %s %s %u %u %s", sb, d, n->rport,
			 n->gport, n->name[0] ? n->name : "-");
	}
	pthread_mutex_unlock(&notes_mu);
}

static int cmd_connlog(const char *id, uint32_t max)
{
	struct kiln_error err = {0};
	struct kiln_connlog *l = NULL;
	struct kiln_conn *c = NULL;
	size_t n = 0;
	uint64_t ring, over;

	if (kiln_connlog_open(pin_root, node, id, max, &l, &err) ||
	    kiln_connlog_read(l, 0, &c, &n, &err)) {
		kiln_connlog_close(l);
		return fail(&err);
	}
	for (size_t i = 0; i < n; i++) {
		char addr[INET6_ADDRSTRLEN], pb[8], key[65];
		inet_ntop(c[i].family == 4 ? AF_INET : AF_INET6, c[i].raddr, addr, sizeof(addr));
		kiln_conn_key(&c[i], key);
		printf("{\"key\":\"%s\",\"new\":%s,\"verdict\":\"%s\",\"family\":%u,"
		       "\"proto\":\"%s\",\"dst\":\"%s\",\"dst_port\":%u,\"src_port\":%u,"
		       "\"opened_ns\":%llu,\"last_ns\":%llu,\"bytes_out\":%llu,\"bytes_in\":%llu,"
		       "\"packets_out\":%llu,\"packets_in\":%llu}\n",
		       key, c[i].is_new ? "true" : "false",
		       c[i].verdict == KILN_CONN_DENIED ? "denied" : "allowed", c[i].family,
		       kiln_conn_proto(c[i].proto, pb), addr, c[i].rport, c[i].gport,
		       (unsigned long long)c[i].opened_ns, (unsigned long long)c[i].last_ns,
		       (unsigned long long)c[i].bytes_out, (unsigned long long)c[i].bytes_in,
		       (unsigned long long)c[i].packets_out, (unsigned long long)c[i].packets_in);
	}
	kiln_connlog_lost(l, &ring, &over);
	printf("{\"ring_lost\":%llu,\"over_cap\":%llu}\n", (unsigned long long)ring,
	       (unsigned long long)over);
	free(c);
	kiln_connlog_close(l);
	return 0;
}

/* Writes rule `text` (an address rule) into the allow maps directly and bumps the generation. */
static int cmd_force(struct kiln_policy *p, const char *text)
{
	struct kiln_error err = {0};
	struct kiln_rule r;
	struct np_lpm_val v;
	int rc;
	if (kiln_rule_parse(text, &r, &err))
		return fail(&err);
	if (r.kind != KILN_RULE_NET4 && r.kind != KILN_RULE_NET6) {
		fprintf(stderr, "force: an address rule\n");
		return 64;
	}
	uint16_t port = htons(r.port);
	v.plen = r.plen;
	if (r.kind == KILN_RULE_NET4 && r.port) {
		struct np_lpm4p k = {.prefixlen = 16u + r.plen};
		memcpy(k.data, &port, 2);
		memcpy(k.data + 2, r.addr, 4);
		rc = bpf_map_update_elem(kiln_policy_map_fd(p, "allow4p"), &k, &v, BPF_ANY);
	} else if (r.kind == KILN_RULE_NET4) {
		struct np_lpm4 k = {.prefixlen = r.plen};
		memcpy(k.data, r.addr, 4);
		rc = bpf_map_update_elem(kiln_policy_map_fd(p, "allow4"), &k, &v, BPF_ANY);
	} else if (r.port) {
		struct np_lpm6p k = {.prefixlen = 16u + r.plen};
		memcpy(k.data, &port, 2);
		memcpy(k.data + 2, r.addr, 16);
		rc = bpf_map_update_elem(kiln_policy_map_fd(p, "allow6p"), &k, &v, BPF_ANY);
	} else {
		struct np_lpm6 k = {.prefixlen = r.plen};
		memcpy(k.data, r.addr, 16);
		rc = bpf_map_update_elem(kiln_policy_map_fd(p, "allow6"), &k, &v, BPF_ANY);
	}
	uint32_t zero = 0;
	struct np_cfg c;
	if (rc == 0)
		rc = bpf_map_lookup_elem(kiln_policy_map_fd(p, "cfg"), &zero, &c);
	if (rc == 0) {
		c.mode = NP_MODE_ALLOWLIST;
		c.gen++;
		rc = bpf_map_update_elem(kiln_policy_map_fd(p, "cfg"), &zero, &c, BPF_ANY);
	}
	if (rc < 0) {
		fprintf(stderr, "force: %s\n", strerror(errno));
		return 1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	log_init("np_tool", KLOG_WARN, false);
	const char *ns = NULL;
	int i = 1;
	for (; i + 1 < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
		if (!strcmp(argv[i], "--netns"))
			ns = argv[i + 1];
		else if (!strcmp(argv[i], "--node"))
			node = argv[i + 1];
		else if (!strcmp(argv[i], "--pin-root"))
			pin_root = argv[i + 1];
		else if (!strcmp(argv[i], "--deny"))
			deny = argv[i + 1];
		else
			break;
	}
	if (i >= argc) {
		fprintf(stderr, "usage: see np_tool.c\n");
		return 64;
	}
	if (ns) {
		char path[128];
		snprintf(path, sizeof(path), "/run/netns/%s", ns);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) {
			fprintf(stderr, "netns %s: %s\n", ns, strerror(errno));
			return 1;
		}
		close(fd);
	}
	const char *cmd = argv[i++];
	int n = argc - i;
	char **a = argv + i;
	struct kiln_error err = {0};
	struct kiln_policy *p = NULL;

	if ((!strcmp(cmd, "create") && n >= 2) || (!strcmp(cmd, "gated") && n == 3)) {
		struct kiln_sbnet net;
		struct kiln_sbnet_config c = {.id = a[0], .index = (uint32_t)atoi(a[1]), .tap_uid = -1,
					      .standin_netns = n >= 3 ? a[2] : NULL};
		bool gated = !strcmp(cmd, "gated");
		if (kiln_sbnet_create(&c, &net, &err))
			return fail(&err);
		int rc = gated ? (int)kiln_policy_gate(&net, &err)
			       : open_pol(a[0], c.index, 1, &p, &err);
		if (rc) {
			kiln_sbnet_destroy(a[0], NULL);
			return fail(&err);
		}
		char nat[INET_ADDRSTRLEN], nat6[INET6_ADDRSTRLEN];
		inet_ntop(AF_INET, net.nat_ip4, nat, sizeof(nat));
		inet_ntop(AF_INET6, net.nat_ip6, nat6, sizeof(nat6));
		printf("netns=%s host_if=%s nat4=%s nat6=%s pins=%s\n", net.netns, net.host_if, nat,
		       nat6, p ? kiln_policy_pin_dir(p) : "");
		kiln_policy_close(p);
		return 0;
	}
	if (!strcmp(cmd, "attach") && n == 2) {
		if (open_pol(a[0], (uint32_t)atoi(a[1]), 1, &p, &err))
			return fail(&err);
		kiln_policy_close(p);
		return 0;
	}
	if (!strcmp(cmd, "destroy") && n == 1) {
		enum kiln_err e1 = kiln_sbnet_destroy(a[0], &err);
		enum kiln_err e2 = kiln_policy_unpin(pin_root, node, a[0], &err);
		return (e1 || e2) ? fail(&err) : 0;
	}
	if (!strcmp(cmd, "testrun") && n == 1)
		return cmd_testrun(atoi(a[0]));
	if (!strcmp(cmd, "connlog") && n == 2)
		return cmd_connlog(a[0], (uint32_t)atoi(a[1]));
	if (!strcmp(cmd, "dns") && n >= 2) {
		struct kiln_dns_config dc = {.upstream = a[0], .min_ttl_s = 5};
		const char *mt = getenv("NP_DNS_MIN_TTL");
		if (mt)
			dc.min_ttl_s = (uint32_t)atoi(mt);
		const char *mp = getenv("NP_DNS_PENDING");
		if (mp)
			dc.max_pending = (uint32_t)atoi(mp);
		struct kiln_dns_proxy *px;
		if (kiln_dns_proxy_start(&dc, &px, &err))
			return fail(&err);
		struct kiln_sniproxy *sp = NULL;
		if (getenv("NP_SNIPROXY")) {
			struct kiln_sniproxy_config sc = {0};
			const char *v;
			if ((v = getenv("NP_SNI_CONNS_PER_SANDBOX")))
				sc.max_conns_per_sandbox = (uint32_t)atoi(v);
			if ((v = getenv("NP_SNI_CONNS")))
				sc.max_conns = (uint32_t)atoi(v);
			if ((v = getenv("NP_SNI_HS_PER_SANDBOX")))
				sc.handshakes_per_sandbox = (uint32_t)atoi(v);
			if ((v = getenv("NP_SNI_HS")))
				sc.handshakes = (uint32_t)atoi(v);
			sc.note = keep_note;
			if (kiln_sniproxy_start(&sc, &sp, &err))
				return fail(&err);
		}
		struct kiln_policy *pols[64];
		char ids[64][16];
		int k = 0;
		for (int j = 1; j < n && k < 64; j++, k++) {
			char *colon = strchr(a[j], ':');
			if (!colon)
				return 64;
			*colon = '\0';
			snprintf(ids[k], sizeof(ids[k]), "%s", a[j]);
			struct kiln_sbnet net;
			if (kiln_sbnet_describe(a[j], (uint32_t)atoi(colon + 1), &net, &err) ||
			    open_pol(a[j], net.index, 0, &pols[k], &err) ||
			    kiln_dns_proxy_add(px, &net, pols[k], &err) ||
			    (sp && kiln_sniproxy_add(sp, &net, pols[k], &err)))
				return fail(&err);
		}
		signal(SIGTERM, on_sig);
		signal(SIGINT, on_sig);
		printf("ready\n");
		fflush(stdout);
		while (!stop)
			pause();
		if (sp) {
			struct kiln_sniproxy_stats st;
			kiln_sniproxy_stats(sp, NULL, &st);
			pthread_mutex_lock(&notes_mu);
			for (size_t j = 0; j < nnotes; j++)
				printf("%s\n", notes[j]);
			pthread_mutex_unlock(&notes_mu);
			printf("sniproxy accepted=%llu spliced=%llu refused=%llu over_cap=%llu cut=%llu\n",
			       (unsigned long long)st.accepted, (unsigned long long)st.spliced,
			       (unsigned long long)st.refused, (unsigned long long)st.over_cap,
			       (unsigned long long)st.cut);
			fflush(stdout);
		}
		for (int j = 0; j < k; j++) {
			if (sp)
				kiln_sniproxy_remove(sp, ids[j]);
			kiln_dns_proxy_remove(px, ids[j]);
			kiln_policy_close(pols[j]);
		}
		kiln_sniproxy_stop(sp);
		kiln_dns_proxy_stop(px);
		return 0;
	}

	if (!strcmp(cmd, "check-deny")) {
		struct kiln_cidr v[2 * KILN_DENY_MAX];
		size_t nv;
		struct kiln_ruleset rs;
		int rc = 0;
		if (kiln_policy_deny_ranges(deny, v, 2 * KILN_DENY_MAX, &nv, &err) ||
		    kiln_rules_parse((const char *const *)a, (size_t)n, &rs, &err))
			return fail(&err);
		if (kiln_rules_check_deny(&rs, v, nv, &err))
			rc = fail(&err);
		kiln_ruleset_free(&rs);
		return rc;
	}

	if (n < 1) {
		fprintf(stderr, "usage: see np_tool.c\n");
		return 64;
	}
	if (open_pol(a[0], 0, 0, &p, &err))
		return fail(&err);
	int rc = 0;
	if (!strcmp(cmd, "apply") || !strcmp(cmd, "apply-held")) {
		struct kiln_ruleset rs;
		bool held = !strcmp(cmd, "apply-held");
		if (kiln_rules_parse((const char *const *)(a + 1), (size_t)(n - 1), &rs, &err) ||
		    (held ? kiln_policy_apply_held(p, &rs, &err) : kiln_policy_apply(p, &rs, &err)))
			rc = fail(&err);
		kiln_ruleset_free(&rs);
	} else if (!strcmp(cmd, "force") && n == 2) {
		rc = cmd_force(p, a[1]);
	} else if (!strcmp(cmd, "rules")) {
		struct kiln_ruleset rs;
		enum kiln_egress_mode mode;
		if (kiln_policy_rules(p, &rs, &mode, &err)) {
			rc = fail(&err);
		} else {
			printf("%s\n", mode == KILN_EGRESS_OPEN ? "open" : "allowlist");
			for (size_t j = 0; j < rs.n; j++) {
				char t[KILN_RULE_TEXT_MAX];
				kiln_rule_format(&rs.rules[j], t, sizeof(t));
				printf("%s\n", t);
			}
			kiln_ruleset_free(&rs);
		}
	} else if (!strcmp(cmd, "bw") && n == 6) {
		struct kiln_bandwidth bw = {.quota_bytes = strtoull(a[1], NULL, 10),
					    .refill_bytes = strtoull(a[2], NULL, 10),
					    .refill_interval_s = (uint32_t)atoi(a[3]),
					    .one_time_burst_bytes = strtoull(a[4], NULL, 10),
					    .unmetered = atoi(a[5]) != 0};
		if (kiln_policy_set_bandwidth(p, &bw, &err))
			rc = fail(&err);
	} else if (!strcmp(cmd, "bw-get")) {
		struct kiln_bandwidth bw;
		if (kiln_policy_get_bandwidth(p, &bw, &err))
			rc = fail(&err);
		else
			printf("quota_bytes=%llu refill_bytes=%llu refill_interval_s=%u "
			       "one_time_burst_bytes=%llu unmetered=%d remaining_bytes=%llu\n",
			       (unsigned long long)bw.quota_bytes, (unsigned long long)bw.refill_bytes,
			       bw.refill_interval_s, (unsigned long long)bw.one_time_burst_bytes,
			       bw.unmetered, (unsigned long long)bw.remaining_bytes);
	} else if (!strcmp(cmd, "bw-level") && n == 8) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		struct kiln_bandwidth bw = {.quota_bytes = strtoull(a[1], NULL, 10),
					    .refill_bytes = strtoull(a[2], NULL, 10),
					    .refill_interval_s = (uint32_t)atoi(a[3]),
					    .one_time_burst_bytes = strtoull(a[4], NULL, 10),
					    .has_level = true,
					    .level_tokens = strtoull(a[5], NULL, 10),
					    .level_burst_left = strtoull(a[6], NULL, 10),
					    .level_at_ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec -
							   strtoll(a[7], NULL, 10) * 1000000};
		if (kiln_policy_set_bandwidth(p, &bw, &err))
			rc = fail(&err);
	} else if ((!strcmp(cmd, "bw-state") && n == 1) || (!strcmp(cmd, "bw-poke") && n == 4)) {
		uint32_t k = 0;
		struct np_limits l;
		int fd = kiln_policy_map_fd(p, "limits");
		if (bpf_map_lookup_elem_flags(fd, &k, &l, BPF_F_LOCK) < 0) {
			perror("limits");
			rc = 1;
		} else if (n == 4) {
			struct timespec ts;
			clock_gettime(CLOCK_MONOTONIC, &ts);
			l.tokens = strtoull(a[1], NULL, 10);
			l.refill_frac = strtoull(a[2], NULL, 10);
			l.last_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec -
				    strtoull(a[3], NULL, 10) * 1000000ull;
			if (bpf_map_update_elem(fd, &k, &l, BPF_F_LOCK) < 0) {
				perror("limits");
				rc = 1;
			}
		} else {
			printf("tokens=%llu burst_left=%llu refill_frac=%llu last_ns=%llu\n",
			       (unsigned long long)l.tokens, (unsigned long long)l.burst_left,
			       (unsigned long long)l.refill_frac, (unsigned long long)l.last_ns);
		}
	} else if (!strcmp(cmd, "pins") && n == 1) {
		int fd = kiln_policy_map_fd(p, "names");
		struct np_name_key k, cur;
		void *prev = NULL;
		struct timespec ts;
		clock_gettime(CLOCK_MONOTONIC, &ts);
		uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
		while (bpf_map_get_next_key(fd, prev, &k) == 0) {
			struct np_name_val v;
			if (bpf_map_lookup_elem(fd, &k, &v) == 0) {
				char t[INET6_ADDRSTRLEN];
				inet_ntop(k.family == 4 ? AF_INET : AF_INET6, k.addr, t, sizeof(t));
				k.name[sizeof(k.name) - 1] = '\0';
				printf("%s %s %lld\n", k.name, t,
				       (long long)((int64_t)(v.expires_ns - now) / 1000000000));
			}
			cur = k;
			prev = &cur;
		}
	} else if (!strcmp(cmd, "pinned") && n == 3) {
		uint8_t addr[16];
		int fam = strchr(a[2], ':') ? 6 : 4;
		if (inet_pton(fam == 4 ? AF_INET : AF_INET6, a[2], addr) != 1) {
			fprintf(stderr, "bad address \"%s\"\n", a[2]);
			rc = 64;
		} else {
			rc = kiln_policy_name_pinned(p, a[1], fam, addr, false) ? 0 : 1;
		}
	} else if (!strcmp(cmd, "conn") && n == 3) {
		if (kiln_policy_set_conn_limit(p, (uint32_t)atoi(a[1]), (uint32_t)atoi(a[2]), &err))
			rc = fail(&err);
	} else if (!strcmp(cmd, "counters")) {
		struct kiln_counters c;
		if (kiln_counters_read_pinned(pin_root, node, a[0], &c, &err)) {
			rc = fail(&err);
		} else {
			printf("tx_bytes=%llu\ntx_packets=%llu\nrx_bytes=%llu\nrx_packets=%llu\n"
			       "drop_policy_bytes=%llu\ndrop_policy_packets=%llu\n"
			       "drop_quota_bytes=%llu\ndrop_quota_packets=%llu\n"
			       "drop_spoof_packets=%llu\ndrop_rate_packets=%llu\n",
			       (unsigned long long)c.tx_bytes, (unsigned long long)c.tx_packets,
			       (unsigned long long)c.rx_bytes, (unsigned long long)c.rx_packets,
			       (unsigned long long)c.drop_policy_bytes,
			       (unsigned long long)c.drop_policy_packets,
			       (unsigned long long)c.drop_quota_bytes,
			       (unsigned long long)c.drop_quota_packets,
			       (unsigned long long)c.drop_spoof_packets,
			       (unsigned long long)c.drop_rate_packets);
		}
	} else if (!strcmp(cmd, "replace-time") && n == 3) {
		size_t nr = (size_t)atoi(a[1]);
		int reps = atoi(a[2]);
		uint64_t total = 0, worst = 0;
		for (int r = 0; r < reps && !rc; r++) {
			char **t = bench_rules(nr, (unsigned)r + 1);
			struct kiln_ruleset rs;
			uint64_t t0 = mono();
			if (kiln_rules_parse((const char *const *)t, nr, &rs, &err) ||
			    kiln_policy_apply(p, &rs, &err))
				rc = fail(&err);
			uint64_t d = mono() - t0;
			total += d;
			worst = d > worst ? d : worst;
			kiln_ruleset_free(&rs);
			for (size_t j = 0; j < nr; j++)
				free(t[j]);
			free(t);
		}
		if (!rc)
			printf("replace %zu rules live: mean %.2f ms, worst %.2f ms over %d runs\n", nr,
			       (double)total / reps / 1e6, (double)worst / 1e6, reps);
	} else {
		fprintf(stderr, "unknown command %s\n", cmd);
		rc = 64;
	}
	kiln_policy_close(p);
	return rc;
}
