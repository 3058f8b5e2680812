/*
 * ledger.h - postings to the Postgres ledger, the source of truth of every credit.
 *
 * The ledger is append-only transfers between accounts (migrations/0001_init.sql). A tenant's
 * credits sit in grant accounts, one per grant with its optional expiry; usage is drawn from them
 * earliest expiry first. Every transfer has a public id (tx_…) and a unique idempotency key naming
 * what it is for, so a replay never posts twice. Functions here run inside the caller's
 * transaction on the caller's connection.
 */
#ifndef KILN_LEDGER_H
#define KILN_LEDGER_H

#include "common/err.h"
#include "common/pg.h"

#define LEDGER_TX_ID_MAX 48
#define LEDGER_FREE_TIER_UCR 500000000LL	/* 500 credits */

/*
 * Takes the ledger lock of `tenant_id` for the rest of the caller's transaction: the
 * pg_advisory_xact_lock every posting to that tenant's ledger holds (usage draws and expiries in
 * migrations/0004_metering.sql and 0012_ledger_locks.sql, grants here), so the tenant's
 * transfers commit in the order of their seq. A transaction posting for several tenants takes
 * their locks with ledger_lock_tenants() (SQL), in one global order, never one by one.
 */
enum kiln_err ledger_lock_tenant(struct pg_conn *c, const char *tenant_id, struct kiln_error *err);

/*
 * Grants `amount_ucr` (> 0) to `tenant_id`, expiring at `expires_at` (RFC 3339, or NULL for
 * never), holding the tenant's ledger lock (ledger_lock_tenant). `idem_key` names the grant
 * uniquely ("signup:<tenant>", "grant:<caller>:<Idempotency-Key>") for as long as it exists: a
 * second call with the same key posts nothing and returns the first transfer's id with
 * *replayed set, at any age. Returns KILN_OK and the transfer id in `tx_id`.
 */
enum kiln_err ledger_grant(struct pg_conn *c, const char *tenant_id, long long amount_ucr,
			   const char *expires_at, const char *idem_key, const char *reason,
			   char tx_id[LEDGER_TX_ID_MAX], int *replayed, struct kiln_error *err);

/*
 * ledger_grant() for a request: `request_sha256` (or NULL) is the SHA-256 of the request body
 * that asks for the grant, kept with it; a second call with the same `idem_key` and another
 * hash is KILN_E_INVALID ("used with a different request") and posts nothing.
 */
enum kiln_err ledger_grant_request(struct pg_conn *c, const char *tenant_id, long long amount_ucr,
				   const char *expires_at, const char *idem_key,
				   const char *request_sha256, const char *reason,
				   char tx_id[LEDGER_TX_ID_MAX], int *replayed,
				   struct kiln_error *err);

struct ledger_balance {
	long long balance_ucr;	/* what the tenant can still spend */
	long long granted_ucr;	/* every grant ever */
	long long used_ucr;	/* usage charged */
	long long expired_ucr;	/* grants that lapsed unspent (expiries less their reversals) */
};

/* Sums the ledger for `tenant_id`. */
enum kiln_err ledger_balance(struct pg_conn *c, const char *tenant_id, struct ledger_balance *out,
			     struct kiln_error *err);

#endif
