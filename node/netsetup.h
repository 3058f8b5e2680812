/*
 * netsetup.h - the host's side of the sandboxes' network, set up by kiln-node at start: an
 * nftables table of the node's own, `inet kiln_<node id>`, that masquerades the sandbox ranges to
 * any interface but the sandboxes' own veths, accepts forwarding from them (and the replies) up
 * to a cap of tracked connections per sandbox (the masquerade's conntrack entries are the
 * host's), and drops what they send to the host's own input but neighbour discovery; IPv4 and IPv6
 * forwarding turned on (IPv6 only once the uplinks with a default route accept router
 * advertisements while forwarding, accept_ra=2). Forwarding is never turned off: other node ids,
 * test runs and other software share it. Config `node_network_setup` (default on) turns all of it
 * off. See docs/network-policy.md, "Host setup".
 *
 * Everything runs the `nft` tool (Debian's nftables) and writes /proc/sys of the calling
 * thread's network namespace.
 */
#ifndef KILN_NODE_NETSETUP_H
#define KILN_NODE_NETSETUP_H

#include <stddef.h>

#include "common/err.h"

#define NETSETUP_TABLE_MAX 48 /* "kiln_" + a node id of at most 32 characters, with room */

struct netsetup_config {
	const char *node_id;     /* a-z, 0-9, '-'; 1..32 characters */
	long long conntrack_max; /* connections one sandbox may have tracked at once */
	long long max_sandboxes; /* the node's node_max_sandboxes, for the host-wide check */
};

/*
 * The node's table name: "kiln_" + the node id with '-' as '_' (a-z, 0-9, '-' only; 1..32
 * characters, as config's node_id). KILN_E_INVALID for any other id.
 */
enum kiln_err netsetup_table_name(const char *node_id, char *out, size_t len,
                                  struct kiln_error *err);

/*
 * The nft script that installs `table` in one transaction, replacing any table of that name
 * (create if missing, delete, add: so installing twice leaves one table), with at most
 * `conntrack_max` tracked connections per sandbox address. Pure. Returns its length, or -ENOSPC
 * when `len` is too small.
 */
int netsetup_script(const char *table, long long conntrack_max, char *out, size_t len);

/*
 * Sets the host up for node cfg->node_id: the table (replaced atomically), accept_ra=2 on every
 * uplink with an IPv6 default route whose accept_ra is 1, then IPv4 and IPv6 forwarding on (each
 * left as it is when already on). Then logs a warning for each chain of another table that would
 * drop the sandboxes' traffic (netsetup_blockers), and one when max_sandboxes x conntrack_max is
 * more than the host's nf_conntrack_max. KILN_E_IO with `err` naming what failed (the table may be
 * in place then; netsetup_remove undoes it).
 */
enum kiln_err netsetup_apply(const struct netsetup_config *cfg, struct kiln_error *err);

/*
 * Chains of other tables (families ip, ip6, inet) hooked where the sandboxes' traffic passes that
 * drop it: a forward chain (or an input one, which carries the sandboxes' IPv6 neighbour
 * discovery) with policy drop, or with a rule that drops or rejects everything. Their
 * descriptions go into `out`, one a line (NUL-terminated, cut at `len`). Returns how many, or a
 * negative errno when the ruleset could not be read. `table` is the caller's own (skipped).
 */
int netsetup_blockers(const char *table, char *out, size_t len);

/* Removes the node's table; nothing when it is not there. Forwarding stays as it is. */
enum kiln_err netsetup_remove(const char *node_id, struct kiln_error *err);

/*
 * A sandbox's side (node/sandbox.c): its eBPF programs and maps loaded ahead, on a thread of
 * their own, right after `sb` has its network slot (sb_reserve) and while the create, resume or
 * fork does work that needs no network (and, for a restore, while its VMM starts behind a gated
 * TAP); the network's setup then only fills the maps and attaches the programs to the devices it
 * made. Optional: without it the setup loads them itself. Whatever happens next, sb_release drops a
 * load not taken (and its pins). The load is held in sb->net_prep: called with sb->lock held;
 * nothing when one is loading already or the sandbox's network is up.
 */
struct node;
struct sandbox;
void sb_net_prepare(struct node *n, struct sandbox *sb);

#endif
