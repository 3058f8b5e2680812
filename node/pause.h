/*
 * pause.h - the pause of a running sandbox on this node: a snapshot, then its VM, network and
 * capacity released and its record paused (see pause.c).
 */
#ifndef KILN_NODE_PAUSE_H
#define KILN_NODE_PAUSE_H

#include <stdbool.h>
#include <string.h>

#include "node/node.h"

/* The token subject of kiln-meter's pauses (metering/pause.c): pauses that are never refused. */
#define PAUSE_METER_SUB "kiln-meter"
/* The token subject of the pauses of an operator's suspension of a tenant (api/routes_tenants.c):
 * never refused either. */
#define PAUSE_SUSPEND_SUB "kiln-suspend"

/* Whether a pause asked with a token of subject `sub` is forced: PAUSE_METER_SUB or PAUSE_SUSPEND_SUB. */
static inline bool pause_sub_forced(const char *sub)
{
	return strcmp(sub, PAUSE_METER_SUB) == 0 || strcmp(sub, PAUSE_SUSPEND_SUB) == 0;
}

/*
 * Pauses a running sandbox (called with sb->lock held): a snapshot, then the VM, its network and
 * its capacity are released and the state is paused. On failure the sandbox runs on as before.
 * The snapshot's expected size is reserved against the tenant's max_snapshot_bytes first
 * (plan_snapshot_reserve): KILN_E_QUOTA naming the limit when it does not fit, unless `forced`
 * (kiln-meter's pause of a tenant out of credits, an operator's suspension of the tenant, the
 * node's own pauses at a timeout or a stop):
 * those are never refused for the plan and may put the tenant over it. `ahead`: a resume is
 * likely, a VMM is begun on the snapshot for it (warm_add_paused); not for the meter's or a
 * suspension's pauses, nor at a stop.
 */
enum kiln_err sb_pause(struct node *n, struct sandbox *sb, bool forced, bool ahead,
		       struct kiln_error *err);

/*
 * Saves `sb`'s running VM into the new snapshot `dir`: its network policy, the VMM's snapshot
 * (the VMM ends) and the manifest. On failure the snapshot is removed and the VM goes on if its
 * VMM still lives; if the VMM ended, the snapshot is finished from its files when it can be.
 */
enum kiln_err pause_save(struct node *n, struct sandbox *sb, const char *dir,
			 struct kiln_error *err);

/*
 * Records `sb` paused on its complete snapshot `snap_id` (in `dir`) in one transaction: the
 * snapshot and the sandbox's state, fenced on its generation.
 */
enum kiln_err pause_record(struct node *n, const struct sandbox *sb, const char *snap_id,
			   const char *dir, struct kiln_error *err);

#endif
