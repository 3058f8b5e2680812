// SPDX-License-Identifier: GPL-2.0
/*
 * egress.bpf.c - a sandbox's network policy, enforced in the host kernel with tc.
 *
 * Four programs share one set of maps per sandbox (bpf/policy.h):
 *   np_from_guest  tc ingress of the guest's TAP: anti-spoofing, allowlist, flow table, limits
 *   np_to_guest    tc egress of the guest's TAP: only replies to flows the guest opened
 *   np_snat        tc egress of the namespace's uplink veth: guest address -> per-sandbox address
 *   np_dnat        tc ingress of the same veth: per-sandbox address -> guest address
 * The guest sees the same fixed addresses in every sandbox; only the NAT addresses differ.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/icmpv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "policy.h"

/* linux/icmp.h pulls in libc's socket headers, which do not build for the BPF target. */
struct icmphdr {
	__u8 type;
	__u8 code;
	__u16 checksum;
	union {
		struct {
			__u16 id;
			__u16 sequence;
		} echo;
		__u32 gateway;
	} un;
};
#define ICMP_ECHOREPLY 0
#define ICMP_ECHO 8

#ifndef offsetof
#define offsetof(t, m) __builtin_offsetof(t, m)
#endif

char LICENSE[] SEC("license") = "GPL";

/* Load-time settings: identical in every sandbox except the NAT addresses. */
const volatile __u8 guest_mac[6] = {0x06, 0x00, 0xac, 0x10, 0x00, 0x02};
const volatile __u32 guest_ip4 = 0;	/* network order */
const volatile __u32 gw_ip4 = 0;
const volatile __u32 nat_ip4 = 0;
const volatile __u8 guest_ip6[16] = {};
const volatile __u8 guest_ll6[16] = {};
const volatile __u8 gw_ip6[16] = {};
const volatile __u8 nat_ip6[16] = {};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct np_cfg);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct np_limits);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} limits SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct np_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} counters SEC(".maps");

#define LPM_MAP(name, keytype, n)                                  \
	struct {                                                   \
		__uint(type, BPF_MAP_TYPE_LPM_TRIE);               \
		__uint(max_entries, n);                            \
		__uint(map_flags, BPF_F_NO_PREALLOC);              \
		__type(key, keytype);                              \
		__type(value, struct np_lpm_val);                  \
		__uint(pinning, LIBBPF_PIN_BY_NAME);               \
	} name SEC(".maps")

LPM_MAP(allow4, struct np_lpm4, NP_MAX_RULES);
LPM_MAP(allow4p, struct np_lpm4p, NP_MAX_RULES);
LPM_MAP(allow6, struct np_lpm6, NP_MAX_RULES);
LPM_MAP(allow6p, struct np_lpm6p, NP_MAX_RULES);
LPM_MAP(deny4, struct np_lpm4, NP_MAX_DENY);
LPM_MAP(deny6, struct np_lpm6, NP_MAX_DENY);

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, NP_MAX_DNS);
	__type(key, struct np_dns_key);
	__type(value, struct np_dns_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} dns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, NP_MAX_NAMES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct np_name_key);
	__type(value, struct np_name_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} names SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, NP_MAX_RULESET);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, struct np_rule_text);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, NP_MAX_FLOWS);
	__type(key, struct np_flow_key);
	__type(value, struct np_flow_val);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, NP_CONNLOG_RING);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} connlog SEC(".maps");

enum verdict { V_PASS, V_POLICY, V_QUOTA, V_SPOOF, V_RATE };

/* The parsed packet: what the policy looks at. */
struct pkt {
	__u8 family;
	__u8 proto;
	__u16 sport;	/* network order; the echo id for ICMP echo */
	__u16 dport;
	__u8 syn;	/* TCP: SYN without ACK (a new connection) */
	__u8 src[16];
	__u8 dst[16];
	__u32 len;
};

static __always_inline struct np_counters *ctrs(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&counters, &k);
}

static __always_inline int finish(struct __sk_buff *skb, enum verdict v, int tx)
{
	struct np_counters *c = ctrs();
	if (!c)
		return v == V_PASS ? TC_ACT_OK : TC_ACT_SHOT;
	switch (v) {
	case V_PASS:
		if (tx) {
			c->tx_bytes += skb->len;
			c->tx_packets++;
		} else {
			c->rx_bytes += skb->len;
			c->rx_packets++;
		}
		return TC_ACT_OK;
	case V_POLICY:
		c->drop_policy_bytes += skb->len;
		c->drop_policy_packets++;
		break;
	case V_QUOTA:
		c->drop_quota_bytes += skb->len;
		c->drop_quota_packets++;
		break;
	case V_SPOOF:
		c->drop_spoof_packets++;
		break;
	case V_RATE:
		c->drop_rate_packets++;
		break;
	}
	return TC_ACT_SHOT;
}

/* Logs a flow opened or a refused attempt; a full ring is counted, never waited on. */
static __always_inline void conn_event(const struct np_flow_key *k, __u64 ts, __u8 verdict)
{
	struct np_conn_event *e = bpf_ringbuf_reserve(&connlog, sizeof(*e), 0);
	if (!e) {
		struct np_counters *c = ctrs();
		if (c)
			c->connlog_lost++;
		return;
	}
	e->ts_ns = ts;
	__builtin_memcpy(&e->key, k, sizeof(*k));
	e->verdict = verdict;
	__builtin_memset(e->pad, 0, sizeof(e->pad));
	bpf_ringbuf_submit(e, 0);
}

static __always_inline int eq16(const __u8 *a, const volatile __u8 *b)
{
	const __u64 *x = (const __u64 *)a;
	const volatile __u64 *y = (const volatile __u64 *)b;
	return x[0] == y[0] && x[1] == y[1];
}

/* Parses Ethernet + IPv4/IPv6 + TCP/UDP/ICMP echo. Returns 0, or -1 for what the policy refuses
 * to reason about (fragments, IPv6 extension headers, other ICMP); ND and ARP set proto to 0. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p, struct ethhdr **ethp,
				 int *is_nd)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	void *l4;

	*is_nd = 0;
	if ((void *)(eth + 1) > end)
		return -1;
	*ethp = eth;
	p->len = skb->len;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return -1;
		if (ip->ihl < 5 || ip->version != 4)
			return -1;
		if (ip->frag_off & bpf_htons(0x3fff))	/* MF or an offset: a fragment */
			return -1;
		p->family = 4;
		p->proto = ip->protocol;
		__builtin_memset(p->src, 0, 16);
		__builtin_memset(p->dst, 0, 16);
		__builtin_memcpy(p->src, &ip->saddr, 4);
		__builtin_memcpy(p->dst, &ip->daddr, 4);
		l4 = (void *)ip + ip->ihl * 4;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return -1;
		p->family = 6;
		p->proto = ip6->nexthdr;
		__builtin_memcpy(p->src, &ip6->saddr, 16);
		__builtin_memcpy(p->dst, &ip6->daddr, 16);
		l4 = (void *)(ip6 + 1);
	} else {
		return -1;
	}
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *t = l4;
		if ((void *)(t + 1) > end)
			return -1;
		p->sport = t->source;
		p->dport = t->dest;
		p->syn = t->syn && !t->ack;
	} else if (p->proto == IPPROTO_UDP) {
		struct udphdr *u = l4;
		if ((void *)(u + 1) > end)
			return -1;
		p->sport = u->source;
		p->dport = u->dest;
	} else if (p->proto == IPPROTO_ICMP && p->family == 4) {
		struct icmphdr *ic = l4;
		if ((void *)(ic + 1) > end)
			return -1;
		if (ic->type != ICMP_ECHO && ic->type != ICMP_ECHOREPLY)
			return -1;
		p->sport = p->dport = ic->un.echo.id;
	} else if (p->proto == IPPROTO_ICMPV6 && p->family == 6) {
		struct icmp6hdr *ic = l4;
		if ((void *)(ic + 1) > end)
			return -1;
		__u8 t = ic->icmp6_type;
		if (t == ICMPV6_ECHO_REQUEST || t == ICMPV6_ECHO_REPLY) {
			p->sport = p->dport = ic->icmp6_dataun.u_echo.identifier;
		} else if (t == 133 || t == 134 || t == 135 || t == 136 || t == 143) {
			*is_nd = 1;	/* router/neighbour discovery, MLD: link scope */
			p->sport = p->dport = 0;
		} else {
			return -1;
		}
	} else {
		return -1;
	}
	return 0;
}

static __always_inline int deny_plen(const struct pkt *p, const __u8 *addr)
{
	struct np_lpm_val *v;
	if (p->family == 4) {
		struct np_lpm4 k = {.prefixlen = 32};
		__builtin_memcpy(k.data, addr, 4);
		v = bpf_map_lookup_elem(&deny4, &k);
	} else {
		struct np_lpm6 k = {.prefixlen = 128};
		__builtin_memcpy(k.data, addr, 16);
		v = bpf_map_lookup_elem(&deny6, &k);
	}
	return v ? (int)v->plen : -1;
}

/* The longest allow-rule prefix that covers addr (and port, when given), or -1. */
static __always_inline int allow_plen(const struct pkt *p, const __u8 *addr, __u16 port,
				      int with_port)
{
	struct np_lpm_val *v;
	if (p->family == 4) {
		if (with_port) {
			struct np_lpm4p k = {.prefixlen = 48};
			__builtin_memcpy(k.data, &port, 2);
			__builtin_memcpy(k.data + 2, addr, 4);
			v = bpf_map_lookup_elem(&allow4p, &k);
		} else {
			struct np_lpm4 k = {.prefixlen = 32};
			__builtin_memcpy(k.data, addr, 4);
			v = bpf_map_lookup_elem(&allow4, &k);
		}
	} else {
		if (with_port) {
			struct np_lpm6p k = {.prefixlen = 144};
			__builtin_memcpy(k.data, &port, 2);
			__builtin_memcpy(k.data + 2, addr, 16);
			v = bpf_map_lookup_elem(&allow6p, &k);
		} else {
			struct np_lpm6 k = {.prefixlen = 128};
			__builtin_memcpy(k.data, addr, 16);
			v = bpf_map_lookup_elem(&allow6, &k);
		}
	}
	return v ? (int)v->plen : -1;
}

/* A learnt address: new flows need it unexpired; live flows keep it until user space removes it. */
static __always_inline int dns_ok(const struct pkt *p, const __u8 *addr, __u16 port, __u64 now,
				  int is_new)
{
	struct np_dns_key k = {.family = p->family, .port = port};
	__builtin_memcpy(k.addr, addr, 16);
	struct np_dns_val *v = bpf_map_lookup_elem(&dns, &k);
	return v && (!is_new || v->expires_ns > now);
}

/*
 * Whether the policy lets the guest talk to raddr:rport over p->proto. The denied ranges (the
 * operator's, bpf/policy.h `deny4`/`deny6`) are checked first and nothing opens them: whatever the
 * allow maps hold, a denied address is refused. SMTP and, with rules, DNS need a rule that names
 * the port.
 */
static __always_inline int allowed(const struct pkt *p, const __u8 *raddr, __u16 rport,
				   __u32 mode, __u64 now, int is_new)
{
	int icmp = p->proto == IPPROTO_ICMP || p->proto == IPPROTO_ICMPV6;
	int smtp = p->proto == IPPROTO_TCP && rport == bpf_htons(25);
	int dns53 = !icmp && rport == bpf_htons(53);

	if (deny_plen(p, raddr) >= 0)
		return 0;	/* deny before allow, whatever the allow maps hold */
	if (mode == NP_MODE_OPEN)
		return !smtp;

	int best = -1, plen;
	if (!icmp) {
		plen = allow_plen(p, raddr, rport, 1);
		if (plen > best)
			best = plen;
	}
	if (!smtp && !dns53) {
		plen = allow_plen(p, raddr, 0, 0);
		if (plen > best)
			best = plen;
	}
	if (best >= 0)
		return 1;
	if (!icmp && dns_ok(p, raddr, rport, now, is_new))
		return 2;
	if (!smtp && !dns53 && dns_ok(p, raddr, 0, now, is_new))
		return 2;
	return 0;
}

/*
 * Hands a SYN to the name-checking proxy: its listener in this netns (on the gateway's address,
 * NP_PROXY_PORT) takes the connection whatever its destination (bpf_sk_assign; the mark's policy
 * route makes the destination local). 0, or -1 when no proxy listens (the SYN is dropped).
 */
static __always_inline int steer_syn(struct __sk_buff *skb, const struct pkt *p)
{
	struct bpf_sock_tuple t = {};
	__u32 tlen;
	if (p->family == 4) {
		t.ipv4.daddr = gw_ip4;
		t.ipv4.dport = bpf_htons(NP_PROXY_PORT);
		tlen = sizeof(t.ipv4);
	} else {
		/* read through volatile: a plain copy of this const would fold to its zero initialiser */
		const volatile __u32 *g = (const volatile __u32 *)gw_ip6;
		t.ipv6.daddr[0] = g[0];
		t.ipv6.daddr[1] = g[1];
		t.ipv6.daddr[2] = g[2];
		t.ipv6.daddr[3] = g[3];
		t.ipv6.dport = bpf_htons(NP_PROXY_PORT);
		tlen = sizeof(t.ipv6);
	}
	struct bpf_sock *sk = bpf_skc_lookup_tcp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return -1;
	long r = -1;
	if (sk->state == BPF_TCP_LISTEN)
		r = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	return r == 0 ? 0 : -1;
}

static __always_inline __u64 flow_timeout(__u8 proto)
{
	if (proto == IPPROTO_TCP)
		return NP_FLOW_TCP_NS;
	if (proto == IPPROTO_UDP)
		return NP_FLOW_UDP_NS;
	return NP_FLOW_ICMP_NS;
}

/* Takes one new-flow token; 0 when the per-second bound is reached. */
static __always_inline int take_conn(__u64 now)
{
	__u32 k = 0;
	struct np_limits *l = bpf_map_lookup_elem(&limits, &k);
	int ok = 1;
	if (!l || !l->conn_rate)
		return 1;
	bpf_spin_lock(&l->lock);
	if (l->conn_rate) {
		__u64 cap = (__u64)(l->conn_burst ? l->conn_burst : l->conn_rate) * 1000;
		__u64 ms = (now - l->conn_last_ns) / 1000000;
		if (now < l->conn_last_ns || ms > 3600000)
			ms = 3600000;
		__u64 t = l->conn_tokens + ms * l->conn_rate;
		if (ms)
			l->conn_last_ns = now;
		if (t > cap)
			t = cap;
		if (t >= 1000)
			t -= 1000;
		else
			ok = 0;
		l->conn_tokens = t;
	}
	bpf_spin_unlock(&l->lock);
	return ok;
}

/* Charges len bytes to the bandwidth bucket; 0 when it is empty. */
static __always_inline int take_bytes(__u32 len, __u64 now)
{
	__u32 k = 0;
	struct np_limits *l = bpf_map_lookup_elem(&limits, &k);
	int ok = 1;
	if (!l || l->unmetered)
		return 1;	/* the common case takes no lock */
	bpf_spin_lock(&l->lock);
	if (!l->unmetered) {
		np_bucket_refill(l, now);
		if (l->burst_left >= len) {
			l->burst_left -= len;
		} else if (l->tokens + l->burst_left >= len) {
			l->tokens -= len - l->burst_left;
			l->burst_left = 0;
		} else {
			ok = 0;
		}
	}
	bpf_spin_unlock(&l->lock);
	return ok;
}

static __always_inline struct np_cfg *get_cfg(void)
{
	__u32 k = 0;
	return bpf_map_lookup_elem(&cfg, &k);
}

SEC("tc")
int np_from_guest(struct __sk_buff *skb)
{
	struct ethhdr *eth = 0;
	struct pkt p = {};
	int is_nd;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;

	eth = data;
	if ((void *)(eth + 1) > end)
		return finish(skb, V_POLICY, 1);
	for (int i = 0; i < 6; i++)
		if (eth->h_source[i] != guest_mac[i])
			return finish(skb, V_SPOOF, 1);

	if (eth->h_proto == bpf_htons(ETH_P_ARP)) {
		/* ARP for IPv4 over Ethernet: 8 bytes of header, sender MAC, sender IP */
		__u8 *a = (void *)(eth + 1);
		if ((void *)(a + 28) > end)
			return finish(skb, V_POLICY, 1);
		for (int i = 0; i < 6; i++)
			if (a[8 + i] != guest_mac[i])
				return finish(skb, V_SPOOF, 1);
		__u32 spa;
		__builtin_memcpy(&spa, a + 14, 4);
		if (spa != guest_ip4 && spa != 0)
			return finish(skb, V_SPOOF, 1);
		return finish(skb, V_PASS, 1);
	}

	if (parse(skb, &p, &eth, &is_nd) < 0) {
		/* a frame we do not reason about: still a spoof if its source is not the guest */
		return finish(skb, V_POLICY, 1);
	}
	if (p.family == 4) {
		__u32 s;
		__builtin_memcpy(&s, p.src, 4);
		if (s != guest_ip4)
			return finish(skb, V_SPOOF, 1);
	} else {
		const __u64 *s64 = (const __u64 *)p.src;
		int own = eq16(p.src, guest_ip6) || eq16(p.src, guest_ll6);
		if (!own && !(is_nd && s64[0] == 0 && s64[1] == 0))
			return finish(skb, V_SPOOF, 1);
	}
	if (is_nd) {
		/* link scope only: multicast ff02::/16 or link-local fe80::/10 */
		if ((p.dst[0] == 0xff && p.dst[1] == 0x02) ||
		    (p.dst[0] == 0xfe && (p.dst[1] & 0xc0) == 0x80))
			return finish(skb, V_PASS, 1);
		return finish(skb, V_POLICY, 1);
	}

	__u64 now = bpf_ktime_get_ns();

	/*
	 * The gateway is the DNS proxy and nothing else. Every UDP query and every new TCP
	 * connection to it takes a new-flow token, and its bytes are charged to the bandwidth
	 * bucket, like any other traffic: a guest over its rate cannot flood the node's proxy.
	 */
	if (p.family == 4) {
		__u32 d;
		__builtin_memcpy(&d, p.dst, 4);
		if (d == gw_ip4) {
			if ((p.proto != IPPROTO_UDP && p.proto != IPPROTO_TCP) ||
			    p.dport != bpf_htons(53))
				return finish(skb, V_POLICY, 1);
			if ((p.proto == IPPROTO_UDP || p.syn) && !take_conn(now))
				return finish(skb, V_RATE, 1);
			if (!take_bytes(skb->len, now))
				return finish(skb, V_QUOTA, 1);
			return finish(skb, V_PASS, 1);
		}
	}

	struct np_cfg *c = get_cfg();
	if (!c)
		return finish(skb, V_POLICY, 1);
	__u32 gen = c->gen, mode = c->mode;

	struct np_flow_key fk = {.family = p.family, .proto = p.proto, .gport = p.sport,
				 .rport = p.dport};
	__builtin_memcpy(fk.raddr, p.dst, 16);
	struct np_flow_val *fv = bpf_map_lookup_elem(&flows, &fk);
	int live = fv && now - fv->last_ns < flow_timeout(p.proto);

	/* Names are checked on the wire (NP_CFG_NAMECHECK) for TCP 80 and 443 to learnt addresses. */
	int names = (c->flags & NP_CFG_NAMECHECK) && mode == NP_MODE_ALLOWLIST;
	int web = p.dport == bpf_htons(80) || p.dport == bpf_htons(443);
	__u32 proxied = live ? fv->flags & NP_FLOW_PROXIED : 0;

	if (!(live && fv->gen == gen)) {
		int a = allowed(&p, p.dst, p.dport, mode, now, !live);
		/* QUIC to a name-checked address: refused, so that clients fall back to TCP */
		if (a == 2 && names && p.proto == IPPROTO_UDP && p.dport == bpf_htons(443))
			a = 0;
		if (!a) {
			if (fv)
				bpf_map_delete_elem(&flows, &fk);
			else
				conn_event(&fk, now, NP_CONN_DENIED);
			return finish(skb, V_POLICY, 1);
		}
		if (!live) {
			proxied = a == 2 && names && p.proto == IPPROTO_TCP && web ? NP_FLOW_PROXIED : 0;
			if (proxied && !p.syn)
				return finish(skb, V_POLICY, 1);	/* no connection to hand over */
		}
		if (!live && !take_conn(now))
			return finish(skb, V_RATE, 1);
		if (live) {
			fv->gen = gen;
		} else {
			if (proxied && steer_syn(skb, &p) < 0)
				return finish(skb, V_POLICY, 1);
			/* the first packet is counted here: the entry is made with it */
			struct np_flow_val nv = {.gen = gen, .flags = proxied, .last_ns = now,
						 .opened_ns = now, .bytes_out = skb->len,
						 .packets_out = 1};
			bpf_map_update_elem(&flows, &fk, &nv, BPF_ANY);
			conn_event(&fk, now, NP_CONN_OPENED);
			fv = 0;
			if (proxied) {
				skb->mark = NP_PROXY_MARK;
				return finish(skb, take_bytes(skb->len, now) ? V_PASS : V_QUOTA, 1);
			}
		}
	}
	if (proxied) {
		/* every packet of a proxied flow is delivered to the proxy's socket */
		if (p.syn && steer_syn(skb, &p) < 0)
			return finish(skb, V_POLICY, 1);
		skb->mark = NP_PROXY_MARK;
	}
	if (fv && now - fv->last_ns > 1000000000ULL)
		fv->last_ns = now;
	if (!take_bytes(skb->len, now))
		return finish(skb, V_QUOTA, 1);
	if (fv) {
		__sync_fetch_and_add(&fv->bytes_out, skb->len);
		__sync_fetch_and_add(&fv->packets_out, 1);
	}
	return finish(skb, V_PASS, 1);
}

SEC("tc")
int np_to_guest(struct __sk_buff *skb)
{
	struct ethhdr *eth = 0;
	struct pkt p = {};
	int is_nd;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;

	eth = data;
	if ((void *)(eth + 1) > end)
		return finish(skb, V_POLICY, 0);
	if (eth->h_proto == bpf_htons(ETH_P_ARP))
		return finish(skb, V_PASS, 0);
	if (parse(skb, &p, &eth, &is_nd) < 0)
		return finish(skb, V_POLICY, 0);
	if (is_nd)
		return finish(skb, V_PASS, 0);
	if (p.family == 4) {
		__u32 s, d;
		__builtin_memcpy(&s, p.src, 4);
		__builtin_memcpy(&d, p.dst, 4);
		if (d != guest_ip4)
			return finish(skb, V_POLICY, 0);
		if (s == gw_ip4) {
			if ((p.proto != IPPROTO_UDP && p.proto != IPPROTO_TCP) ||
			    p.sport != bpf_htons(53))
				return finish(skb, V_POLICY, 0);
			if (!take_bytes(skb->len, bpf_ktime_get_ns()))
				return finish(skb, V_QUOTA, 0);
			return finish(skb, V_PASS, 0);
		}
	} else if (!eq16(p.dst, guest_ip6)) {
		return finish(skb, V_POLICY, 0);
	}

	struct np_cfg *c = get_cfg();
	if (!c)
		return finish(skb, V_POLICY, 0);
	__u64 now = bpf_ktime_get_ns();
	struct np_flow_key fk = {.family = p.family, .proto = p.proto, .gport = p.dport,
				 .rport = p.sport};
	__builtin_memcpy(fk.raddr, p.src, 16);
	struct np_flow_val *fv = bpf_map_lookup_elem(&flows, &fk);
	if (!fv || now - fv->last_ns >= flow_timeout(p.proto))
		return finish(skb, V_POLICY, 0);
	if (fv->gen != c->gen) {
		if (!allowed(&p, p.src, p.sport, c->mode, now, 0)) {
			bpf_map_delete_elem(&flows, &fk);
			return finish(skb, V_POLICY, 0);
		}
		fv->gen = c->gen;
	}
	if (now - fv->last_ns > 1000000000ULL)
		fv->last_ns = now;
	if (!take_bytes(skb->len, now))
		return finish(skb, V_QUOTA, 0);
	__sync_fetch_and_add(&fv->bytes_in, skb->len);
	__sync_fetch_and_add(&fv->packets_in, 1);
	return finish(skb, V_PASS, 0);
}

/* Rewrites one address (at addr_off) of an IPv4 or IPv6 packet and fixes the checksums. */
static __always_inline int nat_rewrite(struct __sk_buff *skb, int v6, __u32 addr_off,
				       const __u8 *newaddr)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 l4_off, csum_off = 0, flags = BPF_F_PSEUDO_HDR;
	__u8 proto;
	int first = 1;

	if (!v6) {
		struct iphdr *ip = data + ETH_HLEN;
		if ((void *)(ip + 1) > end)
			return TC_ACT_OK;
		proto = ip->protocol;
		l4_off = ETH_HLEN + ip->ihl * 4;
		first = !(ip->frag_off & bpf_htons(0x1fff));
	} else {
		struct ipv6hdr *ip6 = data + ETH_HLEN;
		if ((void *)(ip6 + 1) > end)
			return TC_ACT_OK;
		proto = ip6->nexthdr;
		l4_off = ETH_HLEN + sizeof(struct ipv6hdr);
	}
	if (proto == IPPROTO_TCP)
		csum_off = l4_off + offsetof(struct tcphdr, check);
	else if (proto == IPPROTO_UDP) {
		csum_off = l4_off + offsetof(struct udphdr, check);
		flags |= BPF_F_MARK_MANGLED_0;
	} else if (proto == IPPROTO_ICMPV6)
		csum_off = l4_off + offsetof(struct icmp6hdr, icmp6_cksum);

	if (!v6) {
		__u32 oldv, newv;
		if (bpf_skb_load_bytes(skb, addr_off, &oldv, 4) < 0)
			return TC_ACT_SHOT;
		__builtin_memcpy(&newv, newaddr, 4);
		if (csum_off && first)
			bpf_l4_csum_replace(skb, csum_off, oldv, newv, flags | 4);
		bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), oldv, newv, 4);
		bpf_skb_store_bytes(skb, addr_off, &newv, 4, 0);
	} else {
		__u8 oldv[16], newv[16];
		if (bpf_skb_load_bytes(skb, addr_off, oldv, 16) < 0)
			return TC_ACT_SHOT;
		__builtin_memcpy(newv, newaddr, 16);
		__s64 diff = bpf_csum_diff((__be32 *)oldv, 16, (__be32 *)newv, 16, 0);
		if (csum_off)
			bpf_l4_csum_replace(skb, csum_off, 0, diff, flags);
		bpf_skb_store_bytes(skb, addr_off, newv, 16, 0);
	}
	return TC_ACT_OK;
}

SEC("tc")
int np_snat(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return TC_ACT_OK;
		if (ip->saddr == guest_ip4) {
			__u32 n = nat_ip4;
			return nat_rewrite(skb, 0, ETH_HLEN + offsetof(struct iphdr, saddr),
					   (__u8 *)&n);
		}
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return TC_ACT_OK;
		__u8 s[16];
		__builtin_memcpy(s, &ip6->saddr, 16);
		if (eq16(s, guest_ip6)) {
			__u8 n[16];
			for (int i = 0; i < 16; i++)
				n[i] = nat_ip6[i];
			return nat_rewrite(skb, 1, ETH_HLEN + offsetof(struct ipv6hdr, saddr), n);
		}
	}
	return TC_ACT_OK;
}

SEC("tc")
int np_dnat(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return TC_ACT_OK;
		if (ip->daddr == nat_ip4) {
			__u32 g = guest_ip4;
			return nat_rewrite(skb, 0, ETH_HLEN + offsetof(struct iphdr, daddr),
					   (__u8 *)&g);
		}
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return TC_ACT_OK;
		__u8 d[16];
		__builtin_memcpy(d, &ip6->daddr, 16);
		if (ip6->nexthdr == IPPROTO_ICMPV6) {
			struct icmp6hdr *ic = (void *)(ip6 + 1);
			if ((void *)(ic + 1) > end)
				return TC_ACT_OK;
			if (ic->icmp6_type >= 133 && ic->icmp6_type <= 137)
				return TC_ACT_OK;	/* neighbour discovery for the veth itself */
		}
		if (eq16(d, nat_ip6)) {
			__u8 g[16];
			for (int i = 0; i < 16; i++)
				g[i] = guest_ip6[i];
			return nat_rewrite(skb, 1, ETH_HLEN + offsetof(struct ipv6hdr, daddr), g);
		}
	}
	return TC_ACT_OK;
}
