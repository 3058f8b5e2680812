/*
 * debt.h - the gateway's periodic work on tenants in debt: with the operator's setting
 * snapshot_delete_after_zero_days (0: off), notice of the period at or below zero, then the
 * deletion of the tenant's paused sandboxes and their snapshots once it has lasted that long.
 */
#ifndef KILN_API_DEBT_H
#define KILN_API_DEBT_H

#include "api/gateway.h"
#include "common/err.h"

/*
 * One pass (off when snapshot_delete_after_zero_days is 0). For every period at or below zero
 * not yet noticed (billing_debts, migrations/0013_debt.sql): an audit event naming when the
 * paused sandboxes will be deleted. For every paused sandbox of a tenant whose ledger balance has
 * been at or below zero for the whole setting, as Postgres says under the tenant's ledger lock
 * (so a grant commits either before, and cancels it, or after): the delete is recorded as
 * requested and audited in one transaction, then carried out by the normal delete path (the
 * node's DELETE; a node that is down does it when it is back; no node holding it: the record
 * goes). At most `GW_DEBT_BATCH` sandboxes a pass; the next pass goes on. *deleted: how many
 * deletes were decided. KILN_E_UNAVAILABLE when Postgres cannot be reached.
 */
#define GW_DEBT_BATCH 100
enum kiln_err gw_debt_sweep(struct gateway *gw, long long *deleted, struct kiln_error *err);

#endif
