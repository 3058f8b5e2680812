/*
 * policy.h - the layout of the network-policy maps, shared by the tc programs (egress.bpf.c) and
 * user space (netpolicy/). Every map is pinned by name under
 * /sys/fs/bpf/kiln/<node id>/<sandbox id>/ (see docs/network-policy.md); kiln-meter reads
 * `counters` there. Changing a struct here changes the pinned ABI: a node upgraded across such a
 * change must recreate its sandboxes' maps.
 *
 * All addresses and ports are in network byte order. IPv4 addresses in the 16-byte address fields
 * sit in the first four bytes, the rest zero.
 */
#ifndef KILN_BPF_POLICY_H
#define KILN_BPF_POLICY_H

#include <linux/bpf.h>
#include <linux/types.h>

/* Map sizes. */
#define NP_MAX_RULES 4096	/* entries per allow trie: two rule sets during a replacement */
#define NP_MAX_RULESET 2048	/* rules in one set */
#define NP_MAX_DENY 256		/* entries per always-denied trie */
#define NP_MAX_DNS 8192		/* addresses learnt from DNS answers */
#define NP_MAX_NAMES 8192	/* name-and-address pins (user space only) */
#define NP_MAX_FLOWS 65536	/* guest-initiated flows tracked (LRU) */
#define NP_CONNLOG_RING (256 * 1024)	/* bytes of the `connlog` ring buffer (a power of 2) */

/* np_cfg.mode */
#define NP_MODE_OPEN 0		/* no rules: the public internet is open */
#define NP_MODE_ALLOWLIST 1	/* rules exist: only what they name */

/* Live settings, map `cfg` (array, one element). */
struct np_cfg {
	__u32 mode;		/* NP_MODE_* */
	__u32 gen;		/* bumped after every rule change; flows re-check policy on a mismatch */
	__u32 nrules;		/* entries in `rules` */
	__u32 flags;		/* NP_CFG_* */
};

/*
 * NP_CFG_NAMECHECK: the node's name-checking proxy listens in this sandbox's netns (on the
 * gateway's addresses, port NP_PROXY_PORT, IP_TRANSPARENT). In allowlist mode a new TCP flow to
 * port 80 or 443 that only a learnt (DNS) address allows is handed to it: its SYN with
 * bpf_sk_assign, every packet of it marked NP_PROXY_MARK (a policy route in the netns, table
 * NP_PROXY_TABLE, makes every address local for that mark), and UDP to port 443 (QUIC) to such an
 * address is refused. The node sets it when its proxy first serves the sandbox and never clears
 * it: while no proxy listens (a node restarting) those SYNs are dropped. Without the flag (a
 * loader without the proxy) learnt addresses are plain address rules.
 */
#define NP_CFG_NAMECHECK 1u
#define NP_PROXY_PORT 15001
#define NP_PROXY_MARK 0x4b4e
#define NP_PROXY_TABLE 19278
#define NP_FLOW_PROXIED 1u	/* np_flow_val.flags: the flow goes to the name-checking proxy */

/*
 * Live limits, map `limits` (array, one element). User space writes the settings with BPF_F_LOCK;
 * the program keeps the bucket state. Bandwidth is one bucket for both directions.
 */
struct np_limits {
	struct bpf_spin_lock lock;
	/* settings */
	__u32 unmetered;	/* 1: no bandwidth quota */
	__u32 conn_rate;	/* new flows per second (0: unlimited) */
	__u32 conn_burst;	/* new flows allowed at once */
	__u32 pad0;
	__u64 capacity;		/* bucket size, bytes */
	__u64 unused_q16;	/* was a per-millisecond rate that lost small rates; kept for the layout */
	/* state */
	__u64 tokens;		/* bytes in the bucket */
	__u64 burst_left;	/* one-time burst bytes left, spent before the bucket */
	__u64 last_ns;		/* last refill (bpf_ktime_get_ns, CLOCK_MONOTONIC), whole ms steps */
	__u64 conn_tokens;	/* new-flow tokens, in thousandths */
	__u64 conn_last_ns;
	__u64 refill_frac;	/* refill remainder, in 1/(set_interval_s * 1000) of a byte */
	/* the rate as set: the program refills from these (np_bucket_refill) */
	__u64 set_refill_bytes;	/* bytes per set_interval_s */
	__u64 set_burst;	/* user space only */
	__u32 set_interval_s;
	__u32 pad1;
};

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

/*
 * Adds to the bandwidth bucket what `ms` milliseconds earn at set_refill_bytes every
 * set_interval_s, exactly: the remainder below one byte stays in refill_frac (in
 * 1/(set_interval_s * 1000) of a byte), so every rate refills, 1 byte a day included, and the
 * bytes earned over any run of calls are those of their total time. Caps at capacity (where the
 * remainder is dropped). No product can overflow while capacity <= 2^62 and set_refill_bytes <=
 * 2^46 (kiln_policy_set_bandwidth's bounds) and set_interval_s <= 2^32. Shared by the program and
 * user space (remaining_bytes, restores), which therefore agree to the byte.
 */
static __always_inline void np_bucket_add_ms(struct np_limits *l, __u64 ms)
{
	__u64 ims = (__u64)l->set_interval_s * 1000, rb = l->set_refill_bytes, add, v;

	if (!ms || !ims || !rb || l->tokens >= l->capacity)
		return;
	if (ms / ims > l->capacity / rb) {
		l->tokens = l->capacity;
		l->refill_frac = 0;
		return;
	}
	/* ms = whole intervals + part; rb = q * ims + r: each product stays below 2^63 */
	add = (ms / ims) * rb + (ms % ims) * (rb / ims);
	v = (ms % ims) * (rb % ims) + (l->refill_frac < ims ? l->refill_frac : 0);
	add += v / ims;
	l->refill_frac = v % ims;
	if (add >= l->capacity - l->tokens) {
		l->tokens = l->capacity;
		l->refill_frac = 0;
	} else {
		l->tokens += add;
	}
}

/* Brings the bucket up to `now` (CLOCK_MONOTONIC ns) in whole milliseconds. Caller holds the lock. */
static __always_inline void np_bucket_refill(struct np_limits *l, __u64 now)
{
	__u64 ms;

	if (now <= l->last_ns)
		return;
	ms = (now - l->last_ns) / 1000000;
	if (!ms)
		return;
	np_bucket_add_ms(l, ms);
	l->last_ns += ms * 1000000;
}

/* Map `counters` (per-CPU array, one element): sum over CPUs. */
struct np_counters {
	__u64 tx_bytes;		/* guest to outside, let through */
	__u64 tx_packets;
	__u64 rx_bytes;		/* outside to guest, let through */
	__u64 rx_packets;
	__u64 drop_policy_bytes;	/* dropped by rules, closed ingress, denied ranges */
	__u64 drop_policy_packets;
	__u64 drop_quota_bytes;		/* dropped because the bandwidth bucket was empty */
	__u64 drop_quota_packets;
	__u64 drop_spoof_packets;	/* source MAC or IP not the guest's */
	__u64 drop_rate_packets;	/* new flows over the per-second bound */
	__u64 connlog_lost;		/* `connlog` events lost: the ring buffer was full */
};

/* Allow tries: key prefixlen counts bits of data[]. Without a port, data is the address. */
struct np_lpm4 {
	__u32 prefixlen;
	__u8 data[4];
};
struct np_lpm6 {
	__u32 prefixlen;
	__u8 data[16];
};
/* With a port: data is the port (2 bytes, network order) then the address; prefixlen = 16 + bits. */
struct np_lpm4p {
	__u32 prefixlen;
	__u8 data[6];
};
struct np_lpm6p {
	__u32 prefixlen;
	__u8 data[18];
};

/* Value of the allow and deny tries: the prefix length of the entry's address range (0..128). */
struct np_lpm_val {
	__u32 plen;
};

/* Map `dns` (hash): addresses the DNS proxy learnt for host-name rules. port 0 = any port. */
struct np_dns_key {
	__u8 family;		/* 4 or 6 */
	__u8 pad;
	__u16 port;
	__u8 addr[16];
};
struct np_dns_val {
	__u64 expires_ns;	/* CLOCK_MONOTONIC; new flows need it in the future, live flows not */
	char name[256];		/* the name it answered, for purging when rules change */
};

/*
 * Map `names` (hash, user space only): what the sandbox's DNS proxy answered for each name, one
 * entry per (name, address), for the name-checking proxy: a connection naming N to address A is
 * let through only while (N, A) is here. Kept beside `dns` (same TTL floor, cap and expiry), so it
 * survives a kiln-node restart; `dns` keeps one name per address, this keeps every name.
 */
struct np_name_key {
	__u8 family;		/* 4 or 6 */
	__u8 pad[3];
	__u8 addr[16];
	char name[256];		/* normalised (lowercase, no final dot), zero-padded */
};
struct np_name_val {
	__u64 expires_ns;	/* CLOCK_MONOTONIC, as np_dns_val */
};

/* Map `rules` (hash, user space only): rule i's canonical text, i < np_cfg.nrules. */
#define NP_RULE_TEXT 272
struct np_rule_text {
	char text[NP_RULE_TEXT];
};

/* Map `flows` (LRU hash): flows the guest opened. For ICMP echo both ports hold the echo id. */
struct np_flow_key {
	__u8 family;		/* 4 or 6 */
	__u8 proto;		/* IPPROTO_TCP, IPPROTO_UDP, IPPROTO_ICMP or IPPROTO_ICMPV6 */
	__u16 gport;		/* the guest's port */
	__u16 rport;		/* the remote port */
	__u16 pad;
	__u8 raddr[16];		/* the remote address */
};
struct np_flow_val {
	__u32 gen;		/* np_cfg.gen when policy last allowed it */
	__u32 flags;		/* NP_FLOW_* */
	__u64 last_ns;		/* last packet either way, refreshed at most once a second */
	__u64 opened_ns;	/* when the flow was recorded (CLOCK_MONOTONIC): its identity */
	__u64 bytes_out;	/* guest to remote, let through (frame lengths) */
	__u64 bytes_in;		/* remote to guest, let through */
	__u64 packets_out;
	__u64 packets_in;
};

/*
 * Map `connlog` (ring buffer, NP_CONNLOG_RING bytes): one event per flow the guest opens (the
 * moment its `flows` entry is made, so a flow the LRU evicts before user space reads the table
 * is still logged) and per packet the policy refuses to a remote address (a denied attempt).
 * When the ring is full the event is counted in np_counters.connlog_lost instead.
 */
#define NP_CONN_OPENED 1
#define NP_CONN_DENIED 2
struct np_conn_event {
	__u64 ts_ns;		/* CLOCK_MONOTONIC: the flow's opened_ns, or the refused packet's time */
	struct np_flow_key key;
	__u8 verdict;		/* NP_CONN_* */
	__u8 pad[7];
};

/* Idle timeouts of flows. */
#define NP_FLOW_TCP_NS (3600ULL * 1000000000ULL)
#define NP_FLOW_UDP_NS (120ULL * 1000000000ULL)
#define NP_FLOW_ICMP_NS (30ULL * 1000000000ULL)

#endif
