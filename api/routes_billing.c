/*
 * routes_billing.c - usage and billing: GET /v1/billing/balance, GET /v1/billing/ledger,
 * POST /v1/billing/grants (admin), GET /v1/sandboxes/{id}/usage, GET /v1/usage.
 *
 * The ledger (Postgres) is the truth; the live part of a balance and the per-second series
 * come from Redis, where kiln-meter writes them (metering/billing.h).
 */
#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "auth/scopes.h"
#include "common/log.h"
#include "metering/billing.h"
#include "metering/ledger.h"

#define USAGE_POINTS_MAX 3600
#define USAGE_DEFAULT_RANGE_S 900
#define USAGE_DAYS_DEFAULT 30
#define GRANT_REASON_MAX 200

/* Seconds since the epoch of an RFC 3339 time (gw_is_rfc3339 shape); false when it is not one. */
static bool parse_time(const char *s, int64_t *out)
{
	struct tm tm = { 0 };
	const char *p;
	int64_t t;

	if (!s || !gw_is_rfc3339(s))
		return false;
	p = strptime(s, "%Y-%m-%dT%H:%M:%S", &tm);
	if (!p)
		return false;
	t = (int64_t)timegm(&tm);
	if (*p == '.')
		for (p++; isdigit((unsigned char)*p); p++)
			;
	if (*p == '+' || *p == '-') {
		int off = ((p[1] - '0') * 10 + (p[2] - '0')) * 3600 + ((p[4] - '0') * 10 + (p[5] - '0')) * 60;
		t += *p == '+' ? -off : off;
	}
	*out = t;
	return true;
}

static void format_time(int64_t t, char *out, size_t n)
{
	time_t tt = (time_t)t;
	struct tm tm;

	gmtime_r(&tt, &tm);
	strftime(out, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

/* `YYYY-MM-DD` */
static bool is_date(const char *s)
{
	static const char shape[] = "dddd-dd-dd";
	struct tm tm = { 0 };
	const char *end;

	for (size_t i = 0; i < sizeof(shape); i++) {
		if (!shape[i])
			return s[i] == '\0';
		if (shape[i] == 'd' ? !isdigit((unsigned char)s[i]) : s[i] != shape[i])
			return false;
	}
	end = strptime(s, "%Y-%m-%d", &tm);
	return end && !*end;
}

static void balance_get(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct billing_balance b;
	struct pg_conn *c = gw_db(req);
	char since[32], del_at[32];
	enum kiln_err rc;

	if (!c)
		return;
	rc = billing_balance(gw->rds, c, who->tenant_id, &b, &err);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	/* Below zero the tenant owes: debt_ucr, and since when the ledger has been at/below zero;
	 * with snapshot_delete_after_zero_days, when its paused sandboxes will be deleted. */
	if (b.has_debt_since) {
		format_time(b.debt_since, since, sizeof(since));
		format_time(b.debt_since + gw->cfg.snapshot_delete_after_zero_days * 86400, del_at,
			    sizeof(del_at));
	}
	http_reply_json(req, 200,
			json_pack("{s:I, s:I, s:I, s:I, s:I, s:o, s:o}", "balance_ucr",
				  (json_int_t)b.balance_ucr, "granted_ucr", (json_int_t)b.granted_ucr,
				  "used_ucr", (json_int_t)b.used_ucr, "burn_rate_ucr_s",
				  (json_int_t)b.burn_rate_ucr_s, "debt_ucr", (json_int_t)b.debt_ucr,
				  "debt_since", b.has_debt_since ? json_string(since) : json_null(),
				  "snapshots_delete_at",
				  b.has_debt_since && gw->cfg.snapshot_delete_after_zero_days > 0
					  ? json_string(del_at)
					  : json_null()));
}

/* Whether a ledger entry of `kind` adds to the tenant's balance (its amount shown positive). */
static bool credits_tenant(const char *kind)
{
	return strcmp(kind, "grant") == 0 || strcmp(kind, "expiry_reversal") == 0;
}

static void ledger_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct gw_page page;
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	json_t *arr;
	int rows;
	enum kiln_err rc;

	if (!gw_page_parse(req, 50, 100, NULL, &page))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT seq, id, kind, amount_ucr, sandbox_id, rfc3339(period_start), "
		 "rfc3339(period_end), rfc3339(created_at) FROM ledger_transfers "
		 "WHERE tenant_id = $1 AND kind IN ('grant', 'usage', 'expiry', 'expiry_reversal') "
		 "AND ($2::bigint IS NULL OR seq < $2::bigint) ORDER BY seq DESC LIMIT $3::int",
		 who->tenant_id, page.seq, page.lim);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	arr = json_array();
	rows = gw_page_rows(&page, res);
	for (int i = 0; i < rows; i++) {
		const char *kind = pg_res_str(res, i, 2);
		long long amount = pg_res_int(res, i, 3, 0);
		json_t *e = json_pack("{s:s, s:s, s:I, s:s}", "id", pg_res_str(res, i, 1), "kind", kind,
				      "amount_ucr",
				      (json_int_t)(credits_tenant(kind) ? amount : -amount),
				      "created_at", pg_res_str(res, i, 7));
		if (strcmp(kind, "usage") == 0) {
			if (pg_res_get(res, i, 4))
				json_object_set_new(e, "sandbox_id", json_string(pg_res_get(res, i, 4)));
			if (pg_res_get(res, i, 5) && pg_res_get(res, i, 6))
				json_object_set_new(e, "period",
						    json_pack("{s:s, s:s}", "start", pg_res_get(res, i, 5),
							      "end", pg_res_get(res, i, 6)));
		}
		json_array_append_new(arr, e);
	}
	gw_page_reply(req, &page, res, 0, "entries", arr);
}

static void grants_create(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *key = http_req_header(req, "Idempotency-Key");
	struct kiln_error err = { 0 };
	struct pg_conn *c = NULL;
	struct pg_res *res = NULL;
	struct apireq_grant g = { 0 };
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	const char *tenant, *expires, *reason;
	char tx[LEDGER_TX_ID_MAX], idem[400], sum[65];
	unsigned char md[32];
	unsigned int mdlen = 0;
	long long amount;
	int replayed = 0;
	enum kiln_err rc;

	if (!key || !*key) {
		http_reply_error(req, KILN_E_BAD_REQUEST, "Idempotency-Key is required for grants");
		return;
	}
	if (apireq_grant(btext, blen, &g, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		goto out;
	}
	tenant = g.tenant_id;
	expires = g.expires_at;
	reason = g.reason;
	amount = g.amount_ucr;
	snprintf(idem, sizeof(idem), "grant:%s:%s", who->tenant_id, key);
	EVP_Digest(btext, blen, md, &mdlen, EVP_sha256(), NULL);
	for (unsigned i = 0; i < 32; i++)
		snprintf(sum + 2 * i, 3, "%02x", md[i]);
	c = gw_db(req);
	if (!c)
		goto out;
	/* A grant already made with this key is answered as it was, whatever the time now. */
	rc = PGQ(c, &res, &err,
		 "SELECT (SELECT count(*) FROM tenants WHERE id = $1), "
		 "coalesce($2::timestamptz > now(), true), "
		 "EXISTS (SELECT 1 FROM ledger_transfers WHERE idem_key = $3)",
		 tenant, expires, idem);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		goto out;
	}
	if (!pg_res_bool(res, 0, 2) && pg_res_int(res, 0, 0, 0) != 1) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no tenant \"%s\"", tenant);
		goto out;
	}
	if (!pg_res_bool(res, 0, 2) && !pg_res_bool(res, 0, 1)) {
		http_reply_error(req, KILN_E_INVALID, "expires_at must be in the future");
		goto out;
	}
	pg_res_free(res);
	res = NULL;
	rc = pg_exec(c, "BEGIN", &err);
	if (rc == KILN_OK)
		rc = ledger_grant_request(c, tenant, amount, expires, idem, sum, reason, tx,
					  &replayed, &err);
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", &err);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, &err,
			 "SELECT t.id, t.tenant_id, t.amount_ucr, rfc3339(a.expires_at), t.reason, "
			 "rfc3339(t.created_at) FROM ledger_transfers t "
			 "JOIN ledger_accounts a ON a.id = t.credit_account WHERE t.id = $1",
			 tx);
	if (rc != KILN_OK) {
		struct kiln_error ignore = { 0 };
		pg_exec(c, "ROLLBACK", &ignore);
		if (rc == KILN_E_INVALID)
			http_reply_error(req, rc, "%s", err.msg);
		else
			gw_fail(req, rc, &err);
		goto out;
	}
	{
		/* The live balance follows at once (a tenant at zero can resume right away). */
		struct kiln_error rerr = { 0 };
		const char *t[1] = { tenant };
		if (billing_sync(gw->rds, c, 1, t, NULL, NULL, &rerr) != KILN_OK)
			log_warn("grant \"%s\" not yet in redis: %s", tx, rerr.msg);
	}
	if (!replayed)
		log_info("granted %lld µcr to tenant \"%s\" (\"%s\")", amount, tenant, tx);
	else
		http_reply_header(req, "Idempotent-Replayed", "true");
	http_req_set_object(req, tx);
	http_reply_json(req, 201,
			json_pack("{s:s, s:s, s:I, s:o, s:s, s:s}", "id", pg_res_str(res, 0, 0),
				  "tenant_id", pg_res_str(res, 0, 1), "amount_ucr",
				  (json_int_t)pg_res_int(res, 0, 2, 0), "expires_at",
				  gw_time(pg_res_get(res, 0, 3)), "reason", pg_res_str(res, 0, 4),
				  "created_at", pg_res_str(res, 0, 5)));
out:
	pg_res_free(res);
	if (c)
		pg_release(gw->pg, c);
	json_decref(g.body);
}

struct bucket {
	int64_t t;
	uint64_t cpu_us, mem, rx, tx;
	long long ucr;
};

static int bucket_cmp(const void *a, const void *b)
{
	int64_t x = ((const struct bucket *)a)->t, y = ((const struct bucket *)b)->t;

	return x < y ? -1 : x > y;
}

static void sandbox_usage(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	const char *qfrom = http_req_query(req, "from"), *qto = http_req_query(req, "to");
	const char *qstep = http_req_query(req, "step");
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct bucket *b = NULL;
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char key[160], lo[24], hi[24];
	int64_t from, to, step = 1;
	size_t nb = 0;
	json_t *points;
	enum kiln_err rc;

	to = (int64_t)time(NULL);
	if (qto && !parse_time(qto, &to)) {
		http_reply_error(req, KILN_E_INVALID, "to must be an RFC 3339 time");
		return;
	}
	from = to - USAGE_DEFAULT_RANGE_S;
	if (qfrom && !parse_time(qfrom, &from)) {
		http_reply_error(req, KILN_E_INVALID, "from must be an RFC 3339 time");
		return;
	}
	if (qstep) {
		size_t n = strlen(qstep);
		char unit = n ? qstep[n - 1] : 0;
		bool ok = n >= 2 && n <= 6 && qstep[0] >= '1' && qstep[0] <= '9' &&
			  (unit == 's' || unit == 'm' || unit == 'h');
		for (size_t i = 0; ok && i + 1 < n; i++)
			ok = isdigit((unsigned char)qstep[i]);
		if (!ok) {
			http_reply_error(req, KILN_E_INVALID,
					 "step must be a whole number of s, m or h (e.g. 1s, 5m)");
			return;
		}
		step = strtoll(qstep, NULL, 10) * (unit == 'h' ? 3600 : unit == 'm' ? 60 : 1);
	}
	if (from > to) {
		http_reply_error(req, KILN_E_INVALID, "from must not be after to");
		return;
	}
	if (to > from && (to - 1) / step - from / step + 1 > USAGE_POINTS_MAX) {
		http_reply_error(req, KILN_E_INVALID, "at most %d points: widen step or narrow the range",
				 USAGE_POINTS_MAX);
		return;
	}
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT 1 FROM sandboxes WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL", id,
		 who->tenant_id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	if (pg_res_rows(res) != 1) {
		pg_res_free(res);
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		return;
	}
	pg_res_free(res);
	http_req_set_object(req, id);
	snprintf(key, sizeof(key), BILLING_USAGE_PREFIX "%s", id);
	snprintf(lo, sizeof(lo), "%" PRId64, from);
	snprintf(hi, sizeof(hi), "(%" PRId64, to);
	rc = RDS(gw->rds, &rep, &err, "ZRANGEBYSCORE", key, lo, hi);
	if (rc != KILN_OK) {
		rds_reply_release(&rep);
		http_reply_error(req, KILN_E_UNAVAILABLE, "usage series are unavailable");
		return;
	}
	if (rep.type == RDS_ARRAY && rep.n)
		b = calloc(rep.n, sizeof(*b));
	for (size_t i = 0; b && i < rep.n; i++) {
		long long t, ucr;
		unsigned long long cpu, mem, rx, tx;
		int64_t bt;
		size_t k;

		if (!rep.elem[i].str || sscanf(rep.elem[i].str, "%lld:%llu:%llu:%llu:%llu:%lld", &t, &cpu,
					       &mem, &rx, &tx, &ucr) != 6)
			continue;
		bt = t - ((t % step) + step) % step;
		for (k = nb; k > 0 && b[k - 1].t != bt; k--)
			;
		if (k == 0) {
			k = ++nb;
			b[k - 1].t = bt;
		}
		b[k - 1].cpu_us += cpu;
		b[k - 1].mem = mem > b[k - 1].mem ? mem : b[k - 1].mem;
		b[k - 1].rx += rx;
		b[k - 1].tx += tx;
		b[k - 1].ucr += ucr;
	}
	rds_reply_release(&rep);
	if (nb)
		qsort(b, nb, sizeof(*b), bucket_cmp);
	points = json_array();
	for (size_t i = 0; i < nb; i++) {
		char t[32];
		format_time(b[i].t, t, sizeof(t));
		json_array_append_new(points,
				      json_pack("{s:s, s:I, s:I, s:I, s:I, s:I}", "t", t, "cpu_ms",
						(json_int_t)(b[i].cpu_us / 1000), "mem_bytes",
						(json_int_t)b[i].mem, "rx_bytes", (json_int_t)b[i].rx,
						"tx_bytes", (json_int_t)b[i].tx, "ucr",
						(json_int_t)b[i].ucr));
	}
	free(b);
	http_reply_json(req, 200, json_pack("{s:o}", "points", points));
}

static void tenant_usage(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *qfrom = http_req_query(req, "from"), *qto = http_req_query(req, "to");
	const char *cursor = http_req_query(req, "cursor");
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char cday[16] = "", csb[80] = "", lim[16], today[16], from[16];
	int limit = gw_limit(req, 50, 100), rows;
	time_t now = time(NULL);
	struct tm tm;
	json_t *arr;
	enum kiln_err rc;

	if (limit < 0)
		return;
	if ((qto && !is_date(qto)) || (qfrom && !is_date(qfrom))) {
		http_reply_error(req, KILN_E_INVALID, "from and to must be days: YYYY-MM-DD");
		return;
	}
	if (cursor) {
		const char *slash = strchr(cursor, '/');
		if (!slash || slash - cursor != 10 || strlen(slash + 1) == 0 ||
		    strlen(slash + 1) >= sizeof(csb)) {
			http_reply_error(req, KILN_E_INVALID, "cursor is not one this server gave");
			return;
		}
		memcpy(cday, cursor, 10);
		cday[10] = '\0';
		snprintf(csb, sizeof(csb), "%s", slash + 1);
		if (!is_date(cday)) {
			http_reply_error(req, KILN_E_INVALID, "cursor is not one this server gave");
			return;
		}
	}
	gmtime_r(&now, &tm);
	strftime(today, sizeof(today), "%Y-%m-%d", &tm);
	if (!qto)
		qto = today;
	c = gw_db(req);
	if (!c)
		return;
	if (!qfrom) {
		struct pg_res *r2 = NULL;
		char days[8];
		snprintf(days, sizeof(days), "%d", USAGE_DAYS_DEFAULT);
		rc = PGQ(c, &r2, &err, "SELECT to_char($1::date - $2::int, 'YYYY-MM-DD')", qto, days);
		if (rc != KILN_OK) {
			pg_release(gw->pg, c);
			gw_fail(req, rc, &err);
			return;
		}
		snprintf(from, sizeof(from), "%s", pg_res_str(r2, 0, 0));
		pg_res_free(r2);
		qfrom = from;
	}
	snprintf(lim, sizeof(lim), "%d", limit + 1);
	rc = PGQ(c, &res, &err,
		 /* a kept snapshot's storage is billed under the snapshot's id (migrations/0033) */
		 "SELECT to_char(day, 'YYYY-MM-DD'), sandbox_id, cpu / 1000000, mem, rx, tx, ucr, "
		 "CASE WHEN EXISTS (SELECT 1 FROM snapshots sn WHERE sn.id = d.sandbox_id "
		 "AND sn.kept_since IS NOT NULL) THEN 'storage' ELSE 'sandbox' END FROM ("
		 "  SELECT (window_start AT TIME ZONE 'UTC')::date AS day, sandbox_id, "
		 "  sum(cpu_ns) AS cpu, sum(mem_byte_s) AS mem, sum(rx_bytes) AS rx, "
		 "  sum(tx_bytes) AS tx, sum(ucr) AS ucr FROM usage_windows "
		 "  WHERE tenant_id = $1 AND window_start >= ($2::date)::timestamp AT TIME ZONE 'UTC' "
		 "  AND window_start < ($3::date + 1)::timestamp AT TIME ZONE 'UTC' "
		 "  GROUP BY 1, 2) d "
		 "WHERE $4::date IS NULL OR day < $4::date OR (day = $4::date AND sandbox_id > $5) "
		 "ORDER BY day DESC, sandbox_id LIMIT $6::int",
		 who->tenant_id, qfrom, qto, cday[0] ? cday : NULL, csb, lim);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		if (rc == KILN_E_INTERNAL)
			http_reply_error(req, KILN_E_INVALID, "from and to must be valid days");
		else
			gw_fail(req, rc, &err);
		return;
	}
	arr = json_array();
	rows = pg_res_rows(res);
	for (int i = 0; i < rows && i < limit; i++)
		json_array_append_new(
			arr, json_pack("{s:s, s:s, s:s, s:I, s:I, s:I, s:I, s:I}", "day",
				       pg_res_str(res, i, 0), "sandbox_id", pg_res_str(res, i, 1),
				       "kind", pg_res_str(res, i, 7),
				       "cpu_ms", (json_int_t)pg_res_int(res, i, 2, 0), "mem_byte_s",
				       (json_int_t)pg_res_int(res, i, 3, 0), "rx_bytes",
				       (json_int_t)pg_res_int(res, i, 4, 0), "tx_bytes",
				       (json_int_t)pg_res_int(res, i, 5, 0), "ucr",
				       (json_int_t)pg_res_int(res, i, 6, 0)));
	if (rows > limit) {
		char next[128];
		snprintf(next, sizeof(next), "%s/%s", pg_res_str(res, limit - 1, 0),
			 pg_res_str(res, limit - 1, 1));
		http_reply_json(req, 200, json_pack("{s:o, s:s}", "totals", arr, "next_cursor", next));
	} else {
		http_reply_json(req, 200, json_pack("{s:o, s:n}", "totals", arr, "next_cursor"));
	}
	pg_res_free(res);
}

static const struct http_route routes[] = {
	{ "GET", "/v1/billing/balance", balance_get, ROUTE_AUTH | AUTH_SCOPE_BILLING_READ, 0, NULL,
	  0 },
	{ "GET", "/v1/billing/ledger", ledger_list, ROUTE_AUTH | AUTH_SCOPE_BILLING_READ, 0, NULL, 0 },
	{ "POST", "/v1/billing/grants", grants_create, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/usage", sandbox_usage, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0,
	  NULL, 0 },
	{ "GET", "/v1/usage", tenant_usage, ROUTE_AUTH | AUTH_SCOPE_BILLING_READ, 0, NULL, 0 },
};

const struct route_group routes_billing = { routes, sizeof(routes) / sizeof(routes[0]) };
