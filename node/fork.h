/*
 * fork.h - the fork of a running sandbox into up to FORK_MAX children on this node.
 */
#ifndef KILN_NODE_FORK_H
#define KILN_NODE_FORK_H

#include <stddef.h>

#include "node/node.h"

#define FORK_MAX 16	/* children of one fork */

/*
 * Forks the running `parent` (a reference the caller keeps) into new sandboxes `ids` of
 * `tenant`, all or none. KILN_OK: every child runs, recorded running, and the parent runs on at
 * its next generation. Otherwise the code to reply with and `err` the message; no child is left.
 */
enum kiln_err fork_sandbox(struct node *n, struct sandbox *parent, const char *tenant,
			   const char *const *ids, size_t count, struct kiln_error *err);

#endif
