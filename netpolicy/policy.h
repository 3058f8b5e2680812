/*
 * policy.h - a sandbox's eBPF network policy: load and attach the tc programs, keep their maps
 * pinned under <pin root>/<node id>/<sandbox id>/, and change rules and limits live.
 *
 * Lifecycle, as kiln-node drives it per sandbox:
 *   kiln_sbnet_create()            netns kiln-<id>, TAP "tap0" for the VMM, veth kv<id>
 *   kiln_policy_gate()             (optional) tap0 drops everything until the attach
 *   kiln_policy_attach()           programs on tap0 and kn0; maps pinned; egress open
 *   kiln_policy_apply()            rules from the create request (or later PUTs)
 *   kiln_dns_proxy_add()           the sandbox's resolver on 172.16.0.1:53
 *   ... VM runs; kiln-node may restart: kiln_policy_attach() again reuses the pinned maps and
 *       replaces the programs in place, with no gap in enforcement ...
 *   kiln_dns_proxy_remove(), kiln_policy_close(), kiln_sbnet_destroy(), kiln_policy_unpin()
 *
 * A `struct kiln_policy` is safe to share between threads.
 */
#ifndef KILN_NETPOLICY_POLICY_H
#define KILN_NETPOLICY_POLICY_H

#include <stdbool.h>
#include <stdint.h>

#include "bpf/policy.h"
#include "common/err.h"
#include "netpolicy/netns.h"
#include "netpolicy/rules.h"

#define KILN_PIN_ROOT "/sys/fs/bpf/kiln"
#define KILN_CONN_RATE_DEFAULT 50	/* new flows per second */
#define KILN_CONN_BURST_DEFAULT 100

struct kiln_policy;

struct kiln_policy_config {
	const char *pin_root;	/* NULL: KILN_PIN_ROOT */
	const char *node_id;	/* [A-Za-z0-9_.-]{1,64} */
	const char *sandbox_id;	/* [A-Za-z0-9_.-]{1,64} */
	const struct kiln_sbnet *net;	/* attach only: the sandbox's devices and NAT addresses */
	uint32_t conn_rate;	/* set when the maps are first created; 0: the defaults */
	uint32_t conn_burst;
	const char *deny;	/* attach: the operator's egress_deny list; NULL: the default */
};

enum kiln_egress_mode { KILN_EGRESS_OPEN = NP_MODE_OPEN, KILN_EGRESS_ALLOWLIST = NP_MODE_ALLOWLIST };

struct kiln_bandwidth {
	uint64_t quota_bytes;		/* bucket size */
	uint64_t refill_bytes;		/* added every refill_interval_s (spread evenly) */
	uint32_t refill_interval_s;
	uint64_t one_time_burst_bytes;	/* spent first, never refilled */
	bool unmetered;			/* no quota at all (the default) */
	uint64_t remaining_bytes;	/* get only: burst left + bucket */
	/*
	 * The bucket's level, for snapshots: get fills it (has_level when metered); set starts the
	 * bucket from it, plus what the rate earns from level_at_ns to now, instead of full.
	 */
	bool has_level;
	uint64_t level_tokens;		/* bytes in the bucket at level_at_ns */
	uint64_t level_burst_left;	/* one-time burst bytes left (never recharged) */
	uint64_t level_frac;		/* remainder below a byte, 1/(refill_interval_s * 1000) */
	int64_t level_at_ns;		/* CLOCK_REALTIME of the level */
};

struct kiln_counters {
	uint64_t tx_bytes, tx_packets;		/* guest to outside */
	uint64_t rx_bytes, rx_packets;		/* outside to guest */
	uint64_t drop_policy_bytes, drop_policy_packets;
	uint64_t drop_quota_bytes, drop_quota_packets;
	uint64_t drop_spoof_packets;
	uint64_t drop_rate_packets;
};

/*
 * The denied ranges: KILN_EGRESS_DENY_FLOOR plus the operator's list `deny` (NULL:
 * KILN_EGRESS_DENY_DEFAULT), "host" expanded to every address of the calling thread's netns.
 * Writes at most `max` into out[] and their number into *n. KILN_E_INVALID names a bad entry.
 */
enum kiln_err kiln_policy_deny_ranges(const char *deny, struct kiln_cidr *out, size_t max,
				      size_t *n, struct kiln_error *err);

/*
 * Loads the programs, creates the maps or reuses the pinned ones, and attaches (or atomically
 * replaces) the programs on the sandbox's devices. New maps start in open mode, unmetered, with
 * the connection-rate bound of `cfg`. Reused maps keep their rules, limits, counters and flows.
 * Recomputes the denied ranges (kiln_policy_deny_ranges of cfg->deny, in the calling thread's
 * netns: the host). Idempotent.
 */
enum kiln_err kiln_policy_attach(const struct kiln_policy_config *cfg, struct kiln_policy **out,
				 struct kiln_error *err);

/*
 * kiln_policy_attach in two steps, so that the first can run before the sandbox's devices exist
 * (beside other work of a create or resume): kiln_policy_load loads the programs and makes (or
 * reuses) and pins the maps, exactly as kiln_policy_attach, but attaches nothing; cfg->net need
 * only be described (kiln_sbnet_describe). kiln_policy_hook then attaches the programs to
 * net's devices and gives the policy; it frees `l` whatever it returns. kiln_policy_load_free
 * frees a load never hooked (the pins stay: kiln_policy_unpin). Accepts NULL.
 */
struct kiln_policy_load;
enum kiln_err kiln_policy_load(const struct kiln_policy_config *cfg, struct kiln_policy_load **out,
			       struct kiln_error *err);
enum kiln_err kiln_policy_hook(struct kiln_policy_load *l, const struct kiln_sbnet *net,
			       struct kiln_policy **out, struct kiln_error *err);
void kiln_policy_load_free(struct kiln_policy_load *l);

/*
 * The policy of load `l` before its programs are on any device, given to the caller (who closes
 * it, kiln_policy_close): its maps take the rules, the bandwidth and the proxies' entries first,
 * and kiln_policy_hook(l, net, NULL, err) then only attaches. NULL when already taken or hooked.
 */
struct kiln_policy *kiln_policy_load_take(struct kiln_policy_load *l);

/*
 * Closes the sandbox's TAP both ways before its VMM starts: a program that drops every packet
 * on the TAP's ingress (from the guest) and egress (to the guest), at the place its own programs
 * take (kiln_policy_hook replaces it atomically: no packet ever passes unchecked). So the VM can
 * start while the programs still load; the guest's network works from the hook on. Needs the
 * devices (kiln_sbnet_create); the gate goes with them.
 */
enum kiln_err kiln_policy_gate(const struct kiln_sbnet *net, struct kiln_error *err);

/* Opens the pinned maps of an attached sandbox without loading anything (readers, tools). */
enum kiln_err kiln_policy_open(const struct kiln_policy_config *cfg, struct kiln_policy **out,
			       struct kiln_error *err);

/* Frees the handle; the programs and pinned maps stay in force. Accepts NULL. */
void kiln_policy_close(struct kiln_policy *p);

/*
 * Removes exactly this sandbox's pins (and its node directory when empty). The programs stay
 * attached until their devices go (kiln_sbnet_destroy). Idempotent.
 */
enum kiln_err kiln_policy_unpin(const char *pin_root, const char *node_id, const char *sandbox_id,
				struct kiln_error *err);

/*
 * Replaces the rule set live. A set with an address rule inside a denied range is refused
 * (KILN_E_INVALID naming the rule and the range; nothing changes). An empty set reopens egress. While it runs, traffic is allowed only
 * if the old or the new set allows it; when it returns, flows (established ones too) that the new
 * set denies are cut at their next packet, and addresses learnt for host names no longer covered
 * are forgotten.
 */
enum kiln_err kiln_policy_apply(struct kiln_policy *p, const struct kiln_ruleset *rs,
				struct kiln_error *err);

/*
 * kiln_policy_apply() for a rule set kiln-node already holds (a create's rules, checked at its
 * request, or the rules a snapshot was taken with): an address rule that now lies inside a denied
 * range (the operator widened egress_deny since) is kept but opens nothing — the programs check
 * the denied ranges first — and is logged, so a restore never fails, and never turns an allowlist
 * into open egress, over a rule the operator has since closed.
 */
enum kiln_err kiln_policy_apply_held(struct kiln_policy *p, const struct kiln_ruleset *rs,
				     struct kiln_error *err);

/* The rules in force (canonical) and the mode. The caller frees `out` (kiln_ruleset_free). */
enum kiln_err kiln_policy_rules(struct kiln_policy *p, struct kiln_ruleset *out,
				enum kiln_egress_mode *mode, struct kiln_error *err);

/*
 * Sets the bandwidth bucket live. From unmetered, the bucket starts full with the whole one-time
 * burst, unless bw->has_level: then it starts at that level (tokens capped at the quota, burst
 * left at the burst) plus the refill earned from level_at_ns to now (none if the clock went
 * back) — a restored snapshot's bucket. On a metered bucket the refill earned so far is added at
 * the old rate first; the level is kept (capped at the new quota) unless has_level.
 */
enum kiln_err kiln_policy_set_bandwidth(struct kiln_policy *p, const struct kiln_bandwidth *bw,
					struct kiln_error *err);
/* The settings, remaining_bytes and (metered) the level, all as of now. */
enum kiln_err kiln_policy_get_bandwidth(struct kiln_policy *p, struct kiln_bandwidth *out,
					struct kiln_error *err);

/* The bound on new flows per second (0 = none) and how many may start at once. Live. */
enum kiln_err kiln_policy_set_conn_limit(struct kiln_policy *p, uint32_t per_second,
					 uint32_t burst, struct kiln_error *err);

/* Counts one packet dropped by policy (the name-checking proxy's refusals). */
void kiln_policy_count_drop(struct kiln_policy *p);

/*
 * Bytes the node carries for the sandbox past its devices (port streams, node/ports.c), charged
 * like its own traffic: takes up to `want` bytes from the bandwidth bucket (all of them when
 * unmetered; the one-time burst first) and counts what it took in `counters` as tx (guest to
 * outside) or rx, one packet per call. Returns the bytes taken, 0 when the bucket is empty
 * (nothing counted). The bucket is read and written back under the map's lock, not held in
 * between: a packet the program charges in that gap is not charged (as for the other settings'
 * writes); the counters go to CPU 0's slot (kiln_policy_count_drop()).
 */
uint64_t kiln_policy_charge(struct kiln_policy *p, bool tx, uint64_t want);

/* For kiln-meter: reads a sandbox's counters from its pin, with no handle. */
enum kiln_err kiln_counters_read_pinned(const char *pin_root, const char *node_id,
					const char *sandbox_id, struct kiln_counters *out,
					struct kiln_error *err);

/* --- for the DNS proxy --- */

/*
 * Which ports (0 = any) the host-name rules open for `name` (normalised); returns how many,
 * and the current mode in *mode. Follows rule changes made by any process.
 */
size_t kiln_policy_host_ports(struct kiln_policy *p, const char *name, uint16_t *ports,
			      size_t max, enum kiln_egress_mode *mode);

/* Allows addr (4 or 16 bytes by family) on port for ttl_s seconds, learnt from `name`. */
enum kiln_err kiln_policy_dns_learn(struct kiln_policy *p, const char *name, int family,
				    const uint8_t *addr, uint16_t port, uint32_t ttl_s,
				    struct kiln_error *err);

/* Removes an entry learnt for `name` (only if it is still that name's). */
void kiln_policy_dns_forget(struct kiln_policy *p, const char *name, int family,
			    const uint8_t *addr, uint16_t port);

/*
 * Turns the hand-over of name-checked flows to the node's proxy on or off (NP_CFG_NAMECHECK in
 * bpf/policy.h). The proxy turns it on when it first serves the sandbox and leaves it on: while
 * no proxy listens (a node restarting), such SYNs are dropped rather than let through. Live.
 */
enum kiln_err kiln_policy_set_namecheck(struct kiln_policy *p, bool on, struct kiln_error *err);

/*
 * Whether the DNS proxy answered `name` (normalised) with addr (4 or 16 bytes by family): its
 * name-and-address pin (map `names`), kept as long as the learnt address (the same TTL floor and
 * cap), through kiln-node restarts, until a rule change leaves the name uncovered. expired_ok:
 * an expired pin counts too (a live connection checked again after a rule change).
 */
bool kiln_policy_name_pinned(struct kiln_policy *p, const char *name, int family,
			     const uint8_t *addr, bool expired_ok);

/* Deletes expired learnt addresses, and expired name pins, that no live flow uses. Returns how
 * many addresses went. */
int kiln_policy_dns_gc(struct kiln_policy *p);

/* Whether an address must never be learnt from DNS (private, host, metadata, sandbox ranges). */
bool kiln_policy_addr_denied(struct kiln_policy *p, int family, const uint8_t *addr);

/* The pinned directory of this sandbox. */
const char *kiln_policy_pin_dir(const struct kiln_policy *p);

/* A map's descriptor by its name in bpf/policy.h ("flows", "counters", ...), or -1. */
int kiln_policy_map_fd(const struct kiln_policy *p, const char *name);

#endif
