/*
 * billing.h - tenants' live balances and plan limits, for the gateway and kiln-meter.
 *
 * A tenant's balance is the ledger's sum (Postgres, the truth) less the charges kiln-meter has
 * made but not flushed yet. Redis keeps both halves in the hash kiln:bal:<tenant>: `ledger` (the
 * ledger balance, with `lseq`, the newest transfer it counts, so an older read never overwrites a
 * newer one) and one `live:<node>` field per meter (that meter's unflushed charges, which it sets
 * whole every tick). Balance = ledger - sum(live). When Redis loses its data, `ledger` is read
 * again from Postgres and every meter sets its `live` field again on its next tick.
 *
 * Each meter's tick also sets kiln:meter:<node>:alive with a lifetime of `meter_live_ttl_s`
 * (Redis's clock, so no host's clock matters). A `live:<node>` field whose key is gone belongs
 * to a meter that stopped ticking: its charges were never flushed, and whichever meter bills its
 * sandboxes next bills that time again from the ledger's billed-up-to points. Every meter's tick
 * and every balance read here drop such a field, so it cannot count against the balance twice.
 */
#ifndef KILN_METERING_BILLING_H
#define KILN_METERING_BILLING_H

#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"
#include "common/err.h"
#include "common/pg.h"
#include "common/redis.h"

#define BILLING_BAL_PREFIX "kiln:bal:"		/* + tenant: the balance hash */
#define BILLING_BURN_PREFIX "kiln:burn:"	/* + tenant: node -> "µcr/s:epoch s" */
#define BILLING_BW_PREFIX "kiln:bw:"		/* + tenant: rx, tx byte totals */
#define BILLING_USAGE_PREFIX "kiln:usage:"	/* + sandbox: the per-second series */
#define BILLING_METERS_KEY "kiln:meters"	/* set of node ids running a meter */
#define BILLING_METER_PREFIX "kiln:meter:"	/* + node: the meter's figures */
#define BILLING_ALIVE_SUFFIX ":alive"		/* prefix + node + this: set while its meter ticks */
#define BILLING_BURN_FRESH_S 5			/* a burn rate older than this is ignored */

/*
 * May `tenant_id` start (create, resume, fork) `count` sandboxes of `vcpu_milli` and `mem_mib`
 * each?
 * KILN_OK if so; KILN_E_CREDITS when its balance is at or below zero; KILN_E_QUOTA when a limit
 * of its plan (sandboxes creating or running, their vCPUs, their memory) would be passed, with a
 * message naming it; KILN_E_UNAVAILABLE when Redis (or Postgres) cannot be reached. Changes
 * nothing. `c` is a connection the caller holds.
 */
enum kiln_err billing_admit(struct rds *rds, struct pg_conn *c, const char *tenant_id,
			    unsigned count, unsigned vcpu_milli, unsigned mem_mib, struct kiln_error *err);

struct billing_balance {
	long long balance_ucr;		/* granted - used */
	long long granted_ucr;		/* grants less what expired */
	long long used_ucr;		/* usage in the ledger and not flushed yet */
	long long burn_rate_ucr_s;	/* what running sandboxes cost now, per second */
	bool live;			/* false: Redis was down, the figures are the ledger's alone */
	long long debt_ucr;		/* what the tenant owes: -balance when below zero, else 0 */
	/* since when the ledger balance has been at or below zero without a break (billing_debts,
	 * migrations/0013_debt.sql), seconds since the epoch */
	bool has_debt_since;
	long long debt_since;
};

/* The balance as GET /v1/billing/balance shows it: the ledger (Postgres) and the live part. */
enum kiln_err billing_balance(struct rds *rds, struct pg_conn *c, const char *tenant_id,
			      struct billing_balance *out, struct kiln_error *err);

/*
 * Reads the ledger balance of `n` tenants from Postgres and writes it to Redis (unless Redis has
 * a newer one). With `live_field` ("live:<node>"), also sets that field of each to live[i] (0
 * deletes it) in the same atomic step: kiln-meter does so after a flush, so the charges move from
 * the live part to the ledger part at once. One Postgres query and one Redis round trip.
 */
enum kiln_err billing_sync(struct rds *rds, struct pg_conn *c, size_t n,
			   const char *const *tenants, const char *live_field, const long long *live,
			   struct kiln_error *err);

/* Appends every meter's figures (lag, ticks missed...) from Redis in Prometheus text. */
void billing_metrics(struct rds *rds, struct buf *out);

#endif
