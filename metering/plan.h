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

#include "common/err.h"
#include "common/pg.h"

/*
 * KILN_OK when `count` more sandboxes of `vcpu_milli` and `mem_mib` each fit the tenant's plan;
 * KILN_E_QUOTA naming the limit they would pass; KILN_E_NOT_FOUND for no such tenant. Inside a
 * transaction on `c`, the tenant stays locked until it ends (pg_advisory_xact_lock).
 */
enum kiln_err plan_check(struct pg_conn *c, const char *tenant_id, unsigned count, unsigned vcpu_milli,
			 unsigned mem_mib, struct kiln_error *err);

/*
 * KILN_E_QUOTA when the tenant keeps its plan's snapshot bytes already (named snapshots, and the
 * pause and fork snapshots still on a node). Part of billing_admit; also checked before a named
 * snapshot is taken.
 */
enum kiln_err plan_snapshot_check(struct pg_conn *c, const char *tenant_id, struct kiln_error *err);

#endif
