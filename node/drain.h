/*
 * drain.h - `kiln-node drain` (drain.c): this node drained through the gateway's admin route.
 */
#ifndef KILN_NODE_DRAIN_H
#define KILN_NODE_DRAIN_H

#include "common/config.h"

/*
 * Asks the gateway at cfg->gateway_url to drain node cfg->node_id and prints its answer.
 * Returns the exit status: 0 when drained (the answer lists what moved and what stayed, and
 * why), 1 when the gateway refused or could not be reached, 2 without an admin key.
 */
int drain_command(const struct kiln_config *cfg);

#endif
