/*
 * debt.c - snapshot_delete_after_zero_days: notice, then deletion of a tenant's paused sandboxes
 * after that many days with its ledger balance at or below zero (see debt.h, docs/metering.md).
 */
#include "api/debt.h"

#include <stdio.h>
#include <string.h>

#include "api/authn.h"
#include "api/nodeclient.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/log.h"
#include "record/record.h"

#define DEBT_SUBJECT "kiln-gateway:debt"	/* the node token's subject for these deletes */

/* Writes the audit event of every period at or below zero not noticed yet (once: the update). */
static enum kiln_err debt_notice(struct pg_conn *c, const char *days, struct kiln_error *err)
{
	return PGQ(c, NULL, err,
		   "WITH n AS (UPDATE billing_debts SET noticed_at = now() WHERE noticed_at IS NULL "
		   "  RETURNING tenant_id, since) "
		   "INSERT INTO audit_log (tenant_id, method, route, object_id, status, request_id) "
		   "SELECT n.tenant_id, 'SYSTEM', 'billing: balance at or below zero since ' || "
		   "  rfc3339(n.since) || '; paused sandboxes and their snapshots will be deleted at ' || "
		   "  rfc3339(n.since + make_interval(days => $1::int)) || "
		   "  ' unless a grant takes the balance above zero', n.tenant_id, 402, "
		   "  kiln_new_id('req_') FROM n",
		   days);
}

/*
 * Decides the delete of paused sandbox `id` under its tenant's ledger lock, when Postgres still
 * says the tenant has been at or below zero for `days`: records it as requested and audits it,
 * in one transaction. *go: whether the sandbox is to be deleted (decided now or earlier), with
 * its node's address (empty: none), whether that node is live, and its generation.
 */
static enum kiln_err debt_decide(struct pg_conn *c, const char *id, const char *tenant,
				 const char *days, const char *down_after, bool *go, char *addr, size_t addr_len,
				 bool *alive, long long *gen, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	struct kiln_error ignore = { 0 };
	bool decided;
	enum kiln_err rc;

	*go = false;
	rc = pg_exec(c, "BEGIN", err);
	if (rc == KILN_OK)
		rc = PGQ(c, NULL, err, "SELECT pg_advisory_xact_lock(hashtext('ledger:' || $1))", tenant);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "SELECT s.delete_requested_at IS NOT NULL, coalesce(n.address, ''), "
			 "coalesce(" GW_NODE_FRESH_SQL("n", "$4") ", false), s.generation "
			 "FROM sandboxes s "
			 "LEFT JOIN nodes n ON n.id = s.node_id "
			 "WHERE s.id = $1 AND s.tenant_id = $2 AND s.state = 'paused' "
			 "AND s.deleted_at IS NULL AND (s.delete_requested_at IS NOT NULL OR ("
			 "  EXISTS (SELECT 1 FROM billing_debts d WHERE d.tenant_id = s.tenant_id "
			 "          AND d.since <= now() - make_interval(days => $3::int)) "
			 "  AND (SELECT coalesce(sum(b.balance_ucr), 0) FROM ledger_account_balances b "
			 "       WHERE b.tenant_id = s.tenant_id) <= 0))",
			 id, tenant, days, down_after);
	if (rc != KILN_OK || pg_res_rows(res) != 1)
		goto out;
	decided = pg_res_bool(res, 0, 0);
	snprintf(addr, addr_len, "%s", pg_res_str(res, 0, 1));
	*alive = pg_res_bool(res, 0, 2);
	*gen = pg_res_int(res, 0, 3, 0);
	if (!decided) {
		rc = record_delete_requested(NULL, c, id, err);
		if (rc == KILN_OK)
			rc = PGQ(c, NULL, err,
				 "INSERT INTO audit_log (tenant_id, method, route, object_id, status, "
				 "request_id) VALUES ($1, 'SYSTEM', 'billing: paused sandbox and its "
				 "snapshot deleted after ' || $2 || ' days at or below zero', $3, 402, "
				 "kiln_new_id('req_'))",
				 tenant, days, id);
	}
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	if (rc == KILN_OK) {
		*go = true;
		if (!decided)
			log_warn("tenant \"%s\" at or below zero for %s days: deleting its paused sandbox "
				 "\"%s\" and its snapshot", tenant, days, id);
	}
out:
	pg_res_free(res);
	if (!*go)
		pg_exec(c, "ROLLBACK", &ignore);
	return rc;
}

/* Carries out a decided delete by the normal path; a failure is retried by the next pass. */
static void debt_delete(struct gateway *gw, const char *id, const char *tenant, const char *addr,
			bool alive, long long gen)
{
	struct kiln_error err = { 0 };
	struct principal who = { .scopes = AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_SANDBOX_WRITE };
	char path[128], rid[AUTH_ID_MAX];
	long status = 0;

	if (addr[0] && !alive)
		return;	/* recorded as requested: the node carries it out when it is back */
	if (addr[0]) {
		snprintf(who.tenant_id, sizeof(who.tenant_id), "%s", tenant);
		snprintf(who.key_id, sizeof(who.key_id), "%s", DEBT_SUBJECT);
		snprintf(path, sizeof(path), "/v1/sandboxes/%s", id);
		if (auth_new_id("req_", rid, sizeof(rid)) != KILN_OK)
			snprintf(rid, sizeof(rid), "req_debt");
		if (node_call_bg(gw, rid,
				 &(struct node_call){ .address = addr, .method = "DELETE", .path = path,
						      .sandbox_id = id, .who = &who, .upload_fd = -1 },
				 &status) != KILN_OK) {
			log_warn("debt: the node of sandbox \"%s\" did not answer its delete; retried",
				 id);
			return;
		}
		if (status == 204)
			return;
		if (status != 404) {
			log_warn("debt: the node answered %ld to the delete of sandbox \"%s\"; retried",
				 status, id);
			return;
		}
	}
	/* No node holds it: the record goes (fenced on the generation read). */
	if (record_delete_unheld(gw->pg, NULL, id, gen, &err) != KILN_OK && err.code != KILN_E_CONFLICT)
		log_warn("debt: cannot delete the record of sandbox \"%s\": %s", id, err.msg);
}

enum kiln_err gw_debt_sweep(struct gateway *gw, long long *deleted, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char days[24], lim[24];
	enum kiln_err rc;
	int rows;

	*deleted = 0;
	if (gw->cfg.snapshot_delete_after_zero_days <= 0)
		return KILN_OK;
	snprintf(days, sizeof(days), "%lld", gw->cfg.snapshot_delete_after_zero_days);
	snprintf(lim, sizeof(lim), "%d", GW_DEBT_BATCH);
	rc = pg_acquire(gw->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = debt_notice(c, days, err);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "SELECT s.id, s.tenant_id FROM sandboxes s "
			 "JOIN billing_debts d ON d.tenant_id = s.tenant_id "
			 "WHERE s.state = 'paused' AND s.deleted_at IS NULL "
			 "AND d.since <= now() - make_interval(days => $1::int) "
			 "ORDER BY s.delete_requested_at NULLS FIRST, s.id LIMIT $2::int",
			 days, lim);
	rows = rc == KILN_OK ? pg_res_rows(res) : 0;
	for (int i = 0; i < rows && rc == KILN_OK; i++) {
		const char *id = pg_res_str(res, i, 0), *tenant = pg_res_str(res, i, 1);
		char addr[256] = "";
		bool go = false, alive = false;
		long long gen = 0;

		rc = debt_decide(c, id, tenant, days, gw_node_down_after_s(gw), &go, addr, sizeof(addr), &alive, &gen, err);
		if (rc == KILN_OK && go) {
			(*deleted)++;
			debt_delete(gw, id, tenant, addr, alive, gen);
		}
	}
	pg_res_free(res);
	pg_release(gw->pg, c);
	return rc;
}
