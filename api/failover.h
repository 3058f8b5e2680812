/*
 * failover.h - kiln-gateway's repair of Redis after a Sentinel failover.
 *
 * Redis replicates asynchronously: what the old primary wrote last may never have reached the
 * replica Sentinel promoted. Of what Kiln keeps in Redis only the ledger half of the live balances
 * (metering/billing.h) would stay wrong: rate-limit buckets refill, and every kiln-meter sets its
 * live fields whole on its next tick. So when the gateway's Redis client reaches a primary at a new
 * address (rds_set_switch_hook), a background thread reads every tenant's ledger balance from
 * Postgres again and writes it to Redis (billing_sync, which keeps a newer value Redis holds), in
 * batches, once at once and once more a few seconds later for writes that still reached the
 * demoted server meanwhile.
 */
#ifndef KILN_API_FAILOVER_H
#define KILN_API_FAILOVER_H

#include "api/gateway.h"

/* Registers the switch hook on gw->rds and starts the thread. */
enum kiln_err gw_failover_start(struct gateway *gw, struct kiln_error *err);
void gw_failover_stop(void);

/*
 * Writes the ledger balance of every tenant to Redis (billing_sync in batches). *tenants
 * receives how many. KILN_E_UNAVAILABLE when Postgres or Redis cannot be reached.
 */
enum kiln_err gw_balances_rebuild(struct gateway *gw, long long *tenants, struct kiln_error *err);

#endif
