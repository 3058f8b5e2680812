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
 * Grants `amount_ucr` (> 0) to `tenant_id`, expiring at `expires_at` (RFC 3339, or NULL for
 * never). `idem_key` names the grant uniquely ("signup:<tenant>", "grant:<Idempotency-Key>"): a
 * second call with the same key posts nothing and returns the first transfer's id with
 * *replayed set. Returns KILN_OK and the transfer id in `tx_id`.
 */
enum kiln_err ledger_grant(struct pg_conn *c, const char *tenant_id, long long amount_ucr,
			   const char *expires_at, const char *idem_key, const char *reason,
			   char tx_id[LEDGER_TX_ID_MAX], int *replayed, struct kiln_error *err);

struct ledger_balance {
	long long balance_ucr;	/* what the tenant can still spend */
	long long granted_ucr;	/* every grant ever */
	long long used_ucr;	/* usage charged */
	long long expired_ucr;	/* grants that lapsed unspent */
};

/* Sums the ledger for `tenant_id`. */
enum kiln_err ledger_balance(struct pg_conn *c, const char *tenant_id, struct ledger_balance *out,
			     struct kiln_error *err);

#endif
