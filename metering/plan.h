/*
 * plan.h - a tenant's plan limits (plan_limits, the "default" plan where a tenant's has no row): on
 * its live sandboxes (creating or running) — how many at once, their vCPUs, their memory — and on
 * the snapshot bytes it keeps.
 *
 * The gateway checks them before it asks a node (billing_admit); the node checks them again in
 * the transaction that records the new sandboxes (create, fork), where plan_check first takes a
 * per-tenant transaction lock: concurrent creates of one tenant, on any node, are then recorded
 * one after the other and cannot pass a limit together.
 */
#ifndef KILN_METERING_PLAN_H
#define KILN_METERING_PLAN_H

#include <stdbool.h>

#include "common/err.h"
#include "common/pg.h"

/*
 * KILN_OK when `count` more sandboxes of `vcpu_milli` and `mem_mib` each fit the tenant's plan;
 * KILN_E_QUOTA naming the limit they would pass; KILN_E_NOT_FOUND for no such tenant. Inside a
 * transaction on `c`, the tenant stays locked until it ends (pg_advisory_xact_lock).
 */
enum kiln_err plan_check(struct pg_conn *c, const char *tenant_id, unsigned count, unsigned vcpu_milli,
			 unsigned mem_mib, struct kiln_error *err);

/* The tenant's max_snapshot_bytes (its plan's, else the default plan's). */
enum kiln_err plan_snapshot_limit(struct pg_conn *c, const char *tenant_id, long long *max_b,
				  struct kiln_error *err);

/*
 * KILN_E_QUOTA when the tenant keeps its plan's snapshot bytes already (named snapshots, cached
 * layers and images of template builds, the pause and fork snapshots still on a node, and what
 * pauses in progress have reserved); the message says what of it cached layers take and how they
 * go. Part of billing_admit; also checked before a named snapshot is taken.
 */
enum kiln_err plan_snapshot_check(struct pg_conn *c, const char *tenant_id, struct kiln_error *err);

/*
 * Reserves `bytes` (the expected size of the snapshot `snap_id` about to be written) against the
 * tenant's max_snapshot_bytes: KILN_E_QUOTA naming the limit when what the tenant keeps, what other
 * pauses have reserved and `bytes` would pass it, unless `forced` (pauses that must never be
 * refused: they are reserved and counted, and may put the tenant over its limit). Inside a
 * transaction on `c`: takes the same per-tenant lock as plan_check, so concurrent reservations of
 * one tenant on any node are made one after the other and cannot pass the limit together. The
 * reservation lasts until plan_snapshot_unreserve (in the transaction that records the snapshot,
 * or when the pause fails), or an hour.
 */
enum kiln_err plan_snapshot_reserve(struct pg_conn *c, const char *tenant_id, const char *snap_id,
				    long long bytes, bool forced, struct kiln_error *err);

/* Drops the reservation of `snap_id` (none is fine). */
enum kiln_err plan_snapshot_unreserve(struct pg_conn *c, const char *snap_id, struct kiln_error *err);

#endif
