/*
 * ledger.c - grants and balances over the append-only ledger (see ledger.h).
 */
#include "ledger.h"

#include <stdio.h>
#include <string.h>

#include "auth/apikey.h"

enum kiln_err ledger_lock_tenant(struct pg_conn *c, const char *tenant_id, struct kiln_error *err)
{
	return PGQ(c, NULL, err, "SELECT pg_advisory_xact_lock(hashtext('ledger:' || $1))",
		   tenant_id);
}

enum kiln_err ledger_grant(struct pg_conn *c, const char *tenant_id, long long amount_ucr,
			   const char *expires_at, const char *idem_key, const char *reason,
			   char tx_id[LEDGER_TX_ID_MAX], int *replayed, struct kiln_error *err)
{
	return ledger_grant_request(c, tenant_id, amount_ucr, expires_at, idem_key, NULL, reason,
				    tx_id, replayed, err);
}

enum kiln_err ledger_grant_request(struct pg_conn *c, const char *tenant_id, long long amount_ucr,
				   const char *expires_at, const char *idem_key,
				   const char *request_sha256, const char *reason,
				   char tx_id[LEDGER_TX_ID_MAX], int *replayed,
				   struct kiln_error *err)
{
	char amount[32], account[LEDGER_TX_ID_MAX + 8];
	struct pg_res *res = NULL;
	enum kiln_err rc;

	*replayed = 0;
	if (amount_ucr <= 0)
		return kiln_error_set(err, KILN_E_INVALID, "amount_ucr must be positive");
	/* The lock the draws hold: this tenant's transfers commit in the order of their seq. */
	rc = ledger_lock_tenant(c, tenant_id, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT id, request_sha256 FROM ledger_transfers WHERE idem_key = $1", idem_key);
	if (rc != KILN_OK)
		return rc;
	if (pg_res_rows(res) == 1) {
		const char *sum = pg_res_get(res, 0, 1);
		if (request_sha256 && sum && strcmp(sum, request_sha256) != 0) {
			pg_res_free(res);
			return kiln_error_set(err, KILN_E_INVALID,
					      "Idempotency-Key was used with a different request");
		}
		snprintf(tx_id, LEDGER_TX_ID_MAX, "%s", pg_res_str(res, 0, 0));
		pg_res_free(res);
		*replayed = 1;
		return KILN_OK;
	}
	pg_res_free(res);
	rc = auth_new_id("tx_", tx_id, LEDGER_TX_ID_MAX);
	if (rc != KILN_OK)
		return kiln_error_set(err, rc, "cannot make an id");
	snprintf(amount, sizeof(amount), "%lld", amount_ucr);
	snprintf(account, sizeof(account), "grant:%s", tx_id);
	rc = PGQ(c, NULL, err,
		 "INSERT INTO ledger_accounts (id, tenant_id, kind, expires_at) "
		 "VALUES ($1, $2, 'grant', $3::timestamptz)",
		 account, tenant_id, expires_at);
	if (rc == KILN_OK)
		rc = PGQ(c, NULL, err,
			 "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, "
			 "credit_account, amount_ucr, tenant_id, reason, request_sha256) "
			 "VALUES ($1, $2, 'grant', 'system:issuance', $3, $4::bigint, $5, $6, $7)",
			 tx_id, idem_key, account, amount, tenant_id, reason, request_sha256);
	return rc;
}

enum kiln_err ledger_balance(struct pg_conn *c, const char *tenant_id, struct ledger_balance *out,
			     struct kiln_error *err)
{
	struct pg_res *res = NULL;
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	rc = PGQ(c, &res, err,
		 "SELECT coalesce(sum(amount_ucr) FILTER (WHERE kind = 'grant'), 0),"
		 "       coalesce(sum(amount_ucr) FILTER (WHERE kind = 'usage'), 0),"
		 "       coalesce(sum(amount_ucr) FILTER (WHERE kind = 'expiry'), 0) - "
		 "       coalesce(sum(amount_ucr) FILTER (WHERE kind = 'expiry_reversal'), 0) "
		 "FROM ledger_transfers WHERE tenant_id = $1",
		 tenant_id);
	if (rc != KILN_OK)
		return rc;
	out->granted_ucr = pg_res_int(res, 0, 0, 0);
	out->used_ucr = pg_res_int(res, 0, 1, 0);
	out->expired_ucr = pg_res_int(res, 0, 2, 0);
	out->balance_ucr = out->granted_ucr - out->used_ucr - out->expired_ucr;
	pg_res_free(res);
	return KILN_OK;
}
