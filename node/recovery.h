/*
 * recovery.h - what kiln-node does at start with what its earlier run left (see recovery.c).
 */
#ifndef KILN_NODE_RECOVERY_H
#define KILN_NODE_RECOVERY_H

#include "node/node.h"

/*
 * Takes over what an earlier run of this node left, before the node serves: its running
 * sandboxes end paused with a complete snapshot, then its VMs, networks, pins and disk layers are
 * removed, and sandboxes whose state could not be had are recorded as stopped.
 */
enum kiln_err recovery_run(struct node *n, struct kiln_error *err);

#endif
