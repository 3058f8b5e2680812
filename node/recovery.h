/*
 * recovery.h - what kiln-node does at start with what its earlier run left (see recovery.c).
 */
#ifndef KILN_NODE_RECOVERY_H
#define KILN_NODE_RECOVERY_H

#include "node/node.h"

/*
 * Takes over what an earlier run of this node left, before the node serves: deletes requested
 * meanwhile are carried out, its running sandboxes end paused with a complete snapshot, then its
 * VMs, networks, pins and disk layers are removed, and sandboxes whose state could not be had
 * are recorded as stopped. KILN_E_UNAVAILABLE, with nothing removed, when Postgres cannot be
 * read: what the earlier run's VMs hold is only known from it.
 */
enum kiln_err recovery_run(struct node *n, struct kiln_error *err);

/*
 * Carries out the deletes the gateway recorded as requested (sandboxes.delete_requested_at) for
 * sandboxes of this node while it was down: each is recorded deleted (fenced), then its VM, if
 * this run holds it, is torn down. Runs at start and then every few seconds.
 */
enum kiln_err recovery_deletes(struct node *n, struct kiln_error *err);

/*
 * Fences this node off the sandboxes that are no longer its own: each running VM whose record
 * moved to another node or a later generation, was marked lost (this node was marked down while
 * it was away: node_down), or was deleted has its vCPUs stopped and is then discarded with every
 * host resource it held; it never runs on. The record is not written (it is not this node's).
 * A sandbox busy in a lifecycle change is looked at again by the next call. Returns how many
 * were fenced, or -1 when Postgres could not be read (nothing done). Runs with every heartbeat.
 */
int recovery_fence(struct node *n);

#endif
