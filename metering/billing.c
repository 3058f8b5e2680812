/*
 * billing.c - live balances in Redis over the ledger, and plan limits (see billing.h).
 */
#include "billing.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "metering/plan.h"

#define BILLING_KEY_MAX 192

/*
 * Sets the ledger half of each balance (unless Redis holds a newer one) and, optionally, a live
 * field. A key of another type than a hash (none is written so; an operator's mistake, a restore
 * gone wrong) is dropped first and made again from the ledger: left, its error would fail the
 * call for every tenant in it. The meter's tick (tick_lua) and a read of the balance (read_lua)
 * drop such a key too and take the balance as missing, which makes it again from the ledger.
 */
static const char sync_lua[] =
	"local f = ARGV[1]\n"
	"for i = 1, #KEYS do\n"
	"  local b = 2 + (i - 1) * 3\n"
	"  local ty = redis.call('TYPE', KEYS[i])['ok']\n"
	"  if ty ~= 'hash' and ty ~= 'none' then redis.call('DEL', KEYS[i]) end\n"
	"  local cur = redis.call('HGET', KEYS[i], 'lseq')\n"
	"  if (not cur) or tonumber(ARGV[b + 1]) >= tonumber(cur) then\n"
	"    redis.call('HSET', KEYS[i], 'ledger', ARGV[b], 'lseq', ARGV[b + 1])\n"
	"  end\n"
	"  if f ~= '' then\n"
	"    if ARGV[b + 2] == '0' then redis.call('HDEL', KEYS[i], f)\n"
	"    else redis.call('HSET', KEYS[i], f, ARGV[b + 2]) end\n"
	"  end\n"
	"end\n"
	"return #KEYS\n";

enum kiln_err billing_sync(struct rds *rds, struct pg_conn *c, size_t n,
			   const char *const *tenants, const char *live_field, const long long *live,
			   struct kiln_error *err)
{
	struct buf arr;
	struct pg_res *res = NULL;
	const char **argv = NULL;
	char (*nums)[24] = NULL;
	size_t argc = 0, rows;
	enum kiln_err rc;

	if (n == 0)
		return KILN_OK;
	buf_init(&arr, 64u << 20);
	if (buf_appends(&arr, "{"))
		goto nomem;
	for (size_t i = 0; i < n; i++)
		if (pg_array_add(&arr, tenants[i]))
			goto nomem;
	if (buf_appends(&arr, "}"))
		goto nomem;
	rc = PGQ(c, &res, err,
		 "SELECT t, coalesce((SELECT sum(balance_ucr) FROM ledger_account_balances b "
		 "WHERE b.tenant_id = t), 0), coalesce((SELECT max(seq) FROM ledger_transfers x "
		 "WHERE x.tenant_id = t), 0) FROM unnest($1::text[]) WITH ORDINALITY AS u(t, o) "
		 "ORDER BY o",
		 arr.data);
	buf_release(&arr);
	if (rc != KILN_OK)
		return rc;
	rows = (size_t)pg_res_rows(res);
	argv = calloc(4 + rows * 4, sizeof(*argv));
	nums = calloc(rows * 3 + 1, sizeof(*nums));
	if (!argv || !nums)
		goto nomem_res;
	argv[argc++] = "EVAL";
	argv[argc++] = sync_lua;
	snprintf(nums[rows * 3], sizeof(nums[0]), "%zu", rows);
	argv[argc++] = nums[rows * 3];
	for (size_t i = 0; i < rows; i++) {
		char *k = malloc(BILLING_KEY_MAX);
		if (!k)
			goto nomem_res;
		snprintf(k, BILLING_KEY_MAX, BILLING_BAL_PREFIX "%s", pg_res_str(res, (int)i, 0));
		argv[argc++] = k;
	}
	argv[argc++] = live_field ? live_field : "";
	for (size_t i = 0; i < rows; i++) {
		snprintf(nums[i * 3], sizeof(nums[0]), "%s", pg_res_str(res, (int)i, 1));
		snprintf(nums[i * 3 + 1], sizeof(nums[0]), "%s", pg_res_str(res, (int)i, 2));
		snprintf(nums[i * 3 + 2], sizeof(nums[0]), "%lld", live ? live[i] : 0LL);
		argv[argc++] = nums[i * 3];
		argv[argc++] = nums[i * 3 + 1];
		argv[argc++] = nums[i * 3 + 2];
	}
	rc = rds_command(rds, (int)argc, argv, NULL, NULL, err);
	for (size_t i = 0; i < rows; i++)
		free((char *)argv[3 + i]);
	free(argv);
	free(nums);
	pg_res_free(res);
	return rc;
nomem_res:
	if (argv)
		for (size_t i = 3; i < argc; i++)
			free((char *)argv[i]);
	free(argv);
	free(nums);
	pg_res_free(res);
	return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
nomem:
	buf_release(&arr);
	return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
}

/*
 * The balance hash, less the live fields of meters no longer ticking (dropped: billing.h). A key
 * of another type is dropped and read as none (sync_lua).
 */
static const char read_lua[] =
	"local ty = redis.call('TYPE', KEYS[1])['ok']\n"
	"if ty ~= 'hash' and ty ~= 'none' then redis.call('DEL', KEYS[1]); return {} end\n"
	"local v = redis.call('HGETALL', KEYS[1])\n"
	"local out = {}\n"
	"for j = 1, #v, 2 do\n"
	"  local f = v[j]\n"
	"  if string.sub(f, 1, 5) == 'live:' and redis.call('EXISTS', '" BILLING_METER_PREFIX "' .. "
	"string.sub(f, 6) .. '" BILLING_ALIVE_SUFFIX "') == 0 then\n"
	"    redis.call('HDEL', KEYS[1], f)\n"
	"  else\n"
	"    out[#out + 1] = f; out[#out + 1] = v[j + 1]\n"
	"  end\n"
	"end\n"
	"return out\n";

/*
 * Reads the balance hash of `tenant_id`: *ledger (when *has_ledger) and the sum of the live
 * fields of meters still ticking (the others are dropped). KILN_E_UNAVAILABLE when Redis is down.
 */
static enum kiln_err bal_read(struct rds *rds, const char *tenant_id, long long *ledger,
			      bool *has_ledger, long long *live, struct kiln_error *err)
{
	struct rds_reply rep = { 0 };
	char key[BILLING_KEY_MAX];
	enum kiln_err rc;

	*ledger = *live = 0;
	*has_ledger = false;
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", tenant_id);
	rc = RDS(rds, &rep, err, "EVAL", read_lua, "1", key);
	if (rc != KILN_OK)
		return rc;
	if (rep.type == RDS_ARRAY) {
		for (size_t i = 0; i + 1 < rep.n; i += 2) {
			const char *f = rep.elem[i].str ? rep.elem[i].str : "";
			long long v = rep.elem[i + 1].str ? strtoll(rep.elem[i + 1].str, NULL, 10) : 0;
			if (strcmp(f, "ledger") == 0) {
				*ledger = v;
				*has_ledger = true;
			} else if (strncmp(f, "live:", 5) == 0) {
				*live += v;
			}
		}
	}
	rds_reply_release(&rep);
	return KILN_OK;
}

/* The summed burn rate of `tenant_id` over the meters that reported it lately. */
static long long burn_read(struct rds *rds, const char *tenant_id)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[BILLING_KEY_MAX];
	long long sum = 0, now = (long long)time(NULL);

	snprintf(key, sizeof(key), BILLING_BURN_PREFIX "%s", tenant_id);
	if (RDS(rds, &rep, &err, "HGETALL", key) != KILN_OK)
		return 0;
	if (rep.type == RDS_ARRAY) {
		for (size_t i = 0; i + 1 < rep.n; i += 2) {
			long long rate = 0, at = 0;
			if (rep.elem[i + 1].str && sscanf(rep.elem[i + 1].str, "%lld:%lld", &rate, &at) == 2 &&
			    now - at <= BILLING_BURN_FRESH_S && at - now <= BILLING_BURN_FRESH_S)
				sum += rate;
		}
	}
	rds_reply_release(&rep);
	return sum;
}

enum kiln_err billing_admit(struct rds *rds, struct pg_conn *c, const char *tenant_id,
			    unsigned count, unsigned vcpu_milli, unsigned mem_mib, struct kiln_error *err)
{
	long long ledger, live;
	bool has;
	enum kiln_err rc;

	rc = bal_read(rds, tenant_id, &ledger, &has, &live, err);
	if (rc == KILN_E_UNAVAILABLE) {
		kiln_error_clear(err);
		return kiln_error_set(err, rc, "billing is unavailable");
	}
	if (rc != KILN_OK)
		return rc;
	if (!has) {
		const char *t[1] = { tenant_id };
		rc = billing_sync(rds, c, 1, t, NULL, NULL, err);
		if (rc == KILN_OK)
			rc = bal_read(rds, tenant_id, &ledger, &has, &live, err);
		if (rc != KILN_OK)
			return rc;
	}
	if (ledger - live <= 0) {
		/* A grant may have reached the ledger while Redis was unreachable: read it again. */
		const char *t[1] = { tenant_id };
		if (billing_sync(rds, c, 1, t, NULL, NULL, err) == KILN_OK)
			bal_read(rds, tenant_id, &ledger, &has, &live, err);
		kiln_error_clear(err);
	}
	if (ledger - live <= 0)
		return kiln_error_set(err, KILN_E_CREDITS,
				      "the tenant has no credits left: add credits to go on");
	rc = plan_check(c, tenant_id, count, vcpu_milli, mem_mib, err);
	if (rc != KILN_OK)
		return rc;
	return plan_snapshot_check(c, tenant_id, err);
}

enum kiln_err billing_balance(struct rds *rds, struct pg_conn *c, const char *tenant_id,
			      struct billing_balance *out, struct kiln_error *err)
{
	struct kiln_error rerr = { 0 };
	struct pg_res *res = NULL;
	long long granted, expired, bal, ledger = 0, live = 0;
	bool has = false;
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	rc = PGQ(c, &res, err,
		 "SELECT coalesce((SELECT sum(amount_ucr) FROM ledger_transfers "
		 "  WHERE tenant_id = $1 AND kind = 'grant'), 0), "
		 "coalesce((SELECT sum(CASE kind WHEN 'expiry' THEN amount_ucr ELSE -amount_ucr END) "
		 "  FROM ledger_transfers "
		 "  WHERE tenant_id = $1 AND kind IN ('expiry', 'expiry_reversal')), 0), "
		 "coalesce((SELECT sum(balance_ucr) FROM ledger_account_balances "
		 "  WHERE tenant_id = $1), 0), "
		 "(SELECT floor(extract(epoch FROM since))::bigint FROM billing_debts WHERE tenant_id = $1)",
		 tenant_id);
	if (rc != KILN_OK)
		return rc;
	granted = pg_res_int(res, 0, 0, 0);
	expired = pg_res_int(res, 0, 1, 0);
	bal = pg_res_int(res, 0, 2, 0);
	out->has_debt_since = pg_res_get(res, 0, 3) != NULL;
	out->debt_since = pg_res_int(res, 0, 3, 0);
	pg_res_free(res);
	out->live = bal_read(rds, tenant_id, &ledger, &has, &live, &rerr) == KILN_OK;
	if (!out->live)
		live = 0;
	out->granted_ucr = granted - expired;
	out->used_ucr = granted - expired - bal + live;
	out->balance_ucr = bal - live;
	out->debt_ucr = out->balance_ucr < 0 ? -out->balance_ucr : 0;
	out->burn_rate_ucr_s = out->live ? burn_read(rds, tenant_id) : 0;
	return KILN_OK;
}

void billing_metrics(struct rds *rds, struct buf *out)
{
	static const struct {
		const char *field, *name, *type, *help;
	} figures[] = {
		{ "lag_s", "kiln_meter_lag_seconds", "gauge",
		  "seconds from a counter read to its ledger flush, at the last flush" },
		{ "ticks_missed", "kiln_meter_ticks_missed_total", "counter",
		  "ticks that did not run on time or could not read the sandboxes" },
		{ "ticks", "kiln_meter_ticks_total", "counter", "ticks run" },
		{ "windows_flushed", "kiln_meter_windows_flushed_total", "counter",
		  "sandbox billing windows written to the ledger" },
		{ "sandboxes", "kiln_meter_sandboxes", "gauge", "sandboxes the meter tracks" },
		{ "last_tick", "kiln_meter_last_tick_seconds", "gauge",
		  "time of the meter's last tick, seconds since the epoch" },
	};
	struct rds_reply nodes = { 0 }, *vals = NULL;
	struct kiln_error err = { 0 };

	if (RDS(rds, &nodes, &err, "SMEMBERS", BILLING_METERS_KEY) != KILN_OK)
		return;
	if (nodes.type != RDS_ARRAY || nodes.n == 0 || nodes.n > 4096)
		goto out;
	vals = calloc(nodes.n, sizeof(*vals));
	if (!vals)
		goto out;
	for (size_t i = 0; i < nodes.n; i++) {
		char key[BILLING_KEY_MAX];
		snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s", nodes.elem[i].str ? nodes.elem[i].str : "");
		if (RDS(rds, &vals[i], &err, "HGETALL", key) != KILN_OK)
			memset(&vals[i], 0, sizeof(vals[i]));
		else if (vals[i].type == RDS_ARRAY && vals[i].n == 0 && nodes.elem[i].str)
			/* That meter has not ticked for minutes: forget it. */
			RDS(rds, NULL, &err, "SREM", BILLING_METERS_KEY, nodes.elem[i].str);
	}
	for (size_t f = 0; f < sizeof(figures) / sizeof(figures[0]); f++) {
		buf_appendf(out, "# HELP %s %s\n# TYPE %s %s\n", figures[f].name, figures[f].help,
			    figures[f].name, figures[f].type);
		for (size_t i = 0; i < nodes.n; i++) {
			const char *node = nodes.elem[i].str ? nodes.elem[i].str : "";
			bool safe = true;
			for (const char *p = node; *p; p++)
				safe = safe && *p != '"' && *p != '\\' && *p != '\n';
			if (!safe || vals[i].type != RDS_ARRAY)
				continue;
			for (size_t j = 0; j + 1 < vals[i].n; j += 2)
				if (vals[i].elem[j].str && strcmp(vals[i].elem[j].str, figures[f].field) == 0)
					buf_appendf(out, "%s{node=\"%s\"} %s\n", figures[f].name, node,
						    vals[i].elem[j + 1].str ? vals[i].elem[j + 1].str : "0");
		}
	}
out:
	if (vals)
		for (size_t i = 0; i < nodes.n; i++)
			rds_reply_release(&vals[i]);
	free(vals);
	rds_reply_release(&nodes);
}
