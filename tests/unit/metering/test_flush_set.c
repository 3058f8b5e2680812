/*
 * test_flush_set.c - meter_flush_set() (migrations/0015_flush_set.sql), the set-based flush,
 * against meter_flush() (0014, fenced on (sandbox, generation)), the loop it replaces, on the
 * fixture's Postgres: seeded random flushes (several tenants, grants of several expiries, some
 * expiring between the flush's windows, some spent, windows of several sandboxes and one or two
 * generations each, billed periods starting mid-window, zero charges and end markers of no
 * length, several nodes) go through both on two mirrored sets of tenants, twice: a first flush,
 * then one that overlaps it and itself (a window starting back in billed time, a window sent
 * twice, a window older than one sent before it in the flush). The pairs each refuses (and in
 * what order), every transfer (key, account, amount, period), every usage window with its
 * period and every billed-up-to point (per generation, with its node and gen_node) must be the
 * same. A replay of the second flush charges nothing and is refused alike. A failing seed prints
 * itself. Then the transfer ids kiln-meter sends with the windows (migrations/0044).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "common/log.h"
#include "migrations/migrate.h"
#include "test.h"
#include "testdb.h"

static struct pg *pg;
static const char *db_url;	/* the scratch database, for a connection of its own */
static int refusing_seeds;	/* seeds whose overlapping flush had windows refused */
#define sql(...) testdb_sql(pg, __VA_ARGS__)
#define sql_int(...) testdb_sql_int(pg, __VA_ARGS__)

#define NT 4		/* tenants per side */
#define NSB 3		/* sandboxes per tenant */
#define NWIN 6		/* windows per sandbox */
#define BASE_S 1700000000LL

/* The first column of the first row as text (a copy in `out`). */
static void sql_text(char *out, size_t n, const char *q)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);
	struct pg_res *res = NULL;

	out[0] = '\0';
	if (PGQ0(c, &res, &err, q) == KILN_OK && pg_res_rows(res) > 0) {
		const char *v = pg_res_str(res, 0, 0);
		snprintf(out, n, "%s", v ? v : "");
	} else if (err.code) {
		fprintf(stderr, "sql failed: %s: %s\n", q, err.msg);
		test_case_failed = 1;
	}
	pg_res_free(res);
	pg_release(pg, c);
}

/* The same grants for tenant `t` of either side, from the seed's draws. */
static void grants(const char *t, unsigned *seed)
{
	int ng = 1 + (int)(rand_r(seed) % 4);

	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'flush')", t);
	for (int k = 0; k < ng; k++) {
		long long amt = 1 + rand_r(seed) % 40000;
		int kind = (int)(rand_r(seed) % 3);
		char exp[64] = "NULL";
		/* never, after every window, or between the windows' starts */
		if (kind == 1)
			snprintf(exp, sizeof(exp), "to_timestamp(%lld)", BASE_S + 100000);
		else if (kind == 2)
			snprintf(exp, sizeof(exp), "to_timestamp(%lld)",
				 BASE_S + 5 + 10 * (long long)(rand_r(seed) % NWIN));
		sql("INSERT INTO ledger_accounts (id, tenant_id, kind, expires_at) VALUES "
		    "('grant:%s_%d', '%s', 'grant', %s);"
		    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
		    "amount_ucr, tenant_id, reason) VALUES ('tx_%s_%d', 'g:%s_%d', 'grant', "
		    "'system:issuance', 'grant:%s_%d', %lld, '%s', 'test')",
		    t, k, t, exp, t, k, t, k, t, k, amt, t);
	}
}

/* One window of sandbox `s` of tenant `t` (appended to `b`): window `w`, period [ps, pe) in s. */
static void item(struct buf *b, const char *t, int s, long long gen, int w, long long ps_ms,
		 long long pe_ms, unsigned *seed)
{
	static const char *const gnodes[] = { "", "n", "m" };
	long long ws = BASE_S + 10LL * w, ucr = rand_r(seed) % 5 ? rand_r(seed) % 9000 : 0;
	bool none = rand_r(seed) % 6 == 0;

	/* Half the windows in "none" mark their generation's end (sb_gen_end()). */
	buf_appendf(b,
		    "%s{\"sb\":\"%s_s%d\",\"tenant\":\"%s\",\"node\":\"%s\",\"gen\":%lld,"
		    "\"ws\":%lld,\"we\":%lld,\"ps\":%lld,\"pe\":%lld,\"ucr\":%lld,"
		    "\"cpu\":%d,\"mem_bs\":%d,\"rx\":0,\"tx\":0,\"state\":\"%s\",\"t\":%lld,"
		    "\"cpu_at\":%d,\"rx_at\":0,\"tx_at\":0,\"rem\":%d,\"gnode\":\"%s\","
		    "\"ended\":%s}",
		    b->len > 1 ? "," : "", t, s, t, rand_r(seed) % 4 ? "n" : "m", gen, ws, ws + 10,
		    ps_ms * 1000000LL, pe_ms * 1000000LL, ucr, w * 7, w * 11,
		    none ? "none" : "running", pe_ms * 1000000LL, (int)(rand_r(seed) % 100), w,
		    gnodes[rand_r(seed) % 3], none && w % 2 ? "true" : "false");
}

/*
 * The items of one flush for tenant `t` (appended to `b`), from the seed's draws: windows
 * [lo, hi) of each sandbox under one or two generations, each billed from its start or from a
 * point in it; with `overlap`, some start back in the window before (billed time, if that one
 * is in the ledger), some are sent twice, some are followed by an older one, some have no length.
 */
static void items(struct buf *b, const char *t, unsigned *seed, int lo, int hi, bool overlap)
{
	for (int s = 0; s < NSB; s++) {
		long long gen = 1 + rand_r(seed) % 2;
		int ngen = 1 + (int)(rand_r(seed) % 2);
		for (int g = 0; g < ngen; g++, gen++) {
			for (int w = lo; w < hi; w++) {
				long long ws_ms = (BASE_S + 10LL * w) * 1000, ps = ws_ms, pe = ws_ms + 10000;
				int mode = (int)(rand_r(seed) % 10);
				if (rand_r(seed) % 5 == 0)
					continue;	/* a window this sandbox has nothing in */
				if (mode == 0)
					ps = ws_ms + (long long)(rand_r(seed) % 10000);
				else if (mode == 1)
					pe = ps;	/* an end marker of no length */
				else if (mode == 2 && overlap)
					ps = ws_ms - 1 - (long long)(rand_r(seed) % 9000);
				item(b, t, s, gen, w, ps, pe, seed);
				if (overlap && mode == 3)	/* sent twice, from the same or a later point */
					item(b, t, s, gen, w,
					     rand_r(seed) % 2 ? ps : ps + (long long)(rand_r(seed) % 10000),
					     pe, seed);
				if (overlap && mode == 4 && w > 0)	/* then an older window */
					item(b, t, s, gen, w - 1, ws_ms - 10000 + (long long)(rand_r(seed) % 20000),
					     ws_ms, seed);
			}
		}
	}
}

/* The pairs one flush refused ("sb:gen;" in the order returned), tenant ids replaced by T. */
static void flush(char *out, size_t n, const char *fn, const char *items_json, const char *t0,
		  const char *t1, const char *t2, const char *t3)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);
	struct pg_res *res = NULL;
	size_t len = 0;

	out[0] = '\0';
	if (strcmp(fn, "meter_flush") == 0)
		CHECK(PGQ(c, &res, &err, "SELECT * FROM meter_flush($1::jsonb, 'card')", items_json) ==
		      KILN_OK);
	else
		CHECK(PGQ(c, &res, &err, "SELECT * FROM meter_flush_set($1::jsonb, 'card')",
			  items_json) == KILN_OK);
	if (err.code)
		fprintf(stderr, "%s: %s\n", fn, err.msg);
	for (int i = 0; res && i < pg_res_rows(res) && len + 64 < n; i++) {
		const char *sb = pg_res_str(res, i, 0), *ts[] = { t0, t1, t2, t3 };
		int k = 0;
		for (; k < 4; k++)
			if (strncmp(sb, ts[k], strlen(ts[k])) == 0)
				break;
		len += (size_t)snprintf(out + len, n - len, "%d%s:%lld;", k,
					k < 4 ? sb + strlen(ts[k]) : sb, pg_res_int(res, i, 1, -1));
	}
	pg_res_free(res);
	pg_release(pg, c);
}

/* Everything one side's tenant has in the ledger, its id replaced by T. */
static void digest(char *out, size_t n, const char *t)
{
	char q[2048];

	snprintf(q, sizeof(q),
		 "SELECT coalesce((SELECT string_agg(replace(idem_key || '|' || debit_account || '|' || "
		 "amount_ucr || '|' || period_start || '|' || period_end || '|' || sandbox_id, '%s', 'T'), "
		 "';' ORDER BY idem_key) FROM ledger_transfers WHERE tenant_id = '%s' AND kind = 'usage'), '') "
		 "|| '#' || coalesce((SELECT string_agg(replace(sandbox_id || ',' || generation || ',' || "
		 "window_start || ',' || ucr || ',' || ps_ns || ',' || pe_ns || ',' || cpu_ns, '%s', 'T'), "
		 "';' ORDER BY sandbox_id, generation, window_start) FROM usage_windows "
		 "WHERE tenant_id = '%s'), '') || '#' || coalesce((SELECT string_agg(replace(sandbox_id || "
		 "',' || generation || ',' || state || ',' || last_t_ns || ',' || cpu_ns || ',' || "
		 "remainder_fine || ',' || node_id || ',' || coalesce(gen_node, '-') || ',' || ended, "
		 "'%s', 'T'), ';' ORDER BY sandbox_id, generation) FROM meter_sandboxes "
		 "WHERE tenant_id = '%s'), '') || "
		 "'#' || (SELECT "
		 "coalesce(sum(balance_ucr), 0) FROM ledger_account_balances WHERE tenant_id = '%s')",
		 t, t, t, t, t, t, t);
	sql_text(out, n, q);
}

static void one_seed(unsigned seed0)
{
	struct buf ba, bb;
	char ta[NT][32], tb[NT][32];
	static char da[1 << 20], dbuf[1 << 20], ra[1 << 16], rb[1 << 16];
	unsigned s1 = seed0, s2;
	int failed_before = test_case_failed;

	buf_init(&ba, 64u << 20);
	buf_init(&bb, 64u << 20);
	for (int i = 0; i < NT; i++) {
		snprintf(ta[i], sizeof(ta[i]), "fa%08x%02d", seed0, i);
		snprintf(tb[i], sizeof(tb[i]), "fb%08x%02d", seed0, i);
		s2 = s1;
		grants(ta[i], &s1);
		grants(tb[i], &s2);
	}
	/* A first flush, a second that overlaps it and itself, and a replay of the second. */
	for (int round = 0; round < 3 && !test_case_failed; round++) {
		if (round < 2) {
			buf_reset(&ba);
			buf_reset(&bb);
			buf_appends(&ba, "[");
			buf_appends(&bb, "[");
			for (int i = 0; i < NT; i++) {
				s2 = s1;
				items(&ba, ta[i], &s1, round ? NWIN / 2 - 1 : 0,
				      round ? NWIN + 2 : NWIN / 2 + 1, round == 1);
				items(&bb, tb[i], &s2, round ? NWIN / 2 - 1 : 0,
				      round ? NWIN + 2 : NWIN / 2 + 1, round == 1);
			}
			buf_appends(&ba, "]");
			buf_appends(&bb, "]");
		}
		flush(ra, sizeof(ra), "meter_flush", ba.data, ta[0], ta[1], ta[2], ta[3]);
		flush(rb, sizeof(rb), "meter_flush_set", bb.data, tb[0], tb[1], tb[2], tb[3]);
		if (strcmp(ra, rb) != 0) {
			fprintf(stderr, "seed %u, flush %d refused:\n loop: %s\n set:  %s\n", seed0,
				round, ra, rb);
			test_case_failed = 1;
		}
		if (round == 1 && ra[0])
			refusing_seeds++;
	}
	for (int i = 0; i < NT && !test_case_failed; i++) {
		digest(da, sizeof(da), ta[i]);
		digest(dbuf, sizeof(dbuf), tb[i]);
		if (strcmp(da, dbuf) != 0) {
			fprintf(stderr, "seed %u, tenant %d:\n loop: %.2000s\n set:  %.2000s\n", seed0, i,
				da, dbuf);
			test_case_failed = 1;
			break;
		}
	}
	if (test_case_failed && !failed_before)
		fprintf(stderr, "failing seed: %u (KILN_FLUSH_SEED=%u replays it)\n", seed0, seed0);
	buf_release(&ba);
	buf_release(&bb);
}

static void test_set_flush_draws_as_the_loop_did(void)
{
	const char *one = getenv("KILN_FLUSH_SEED");

	if (one) {
		one_seed((unsigned)strtoul(one, NULL, 10));
		return;
	}
	for (unsigned seed = 1; seed <= 60 && !test_case_failed; seed++)
		one_seed(seed * 2654435761u);
	/* The generator does reach the fence: most overlapping flushes have a refused pair. */
	CHECK(refusing_seeds >= 30);
}

/* One window of sandbox "<t>_s" (generation 1) starting at BASE_S + ws, of `ucr`, with `id` (a JSON
 * value: a string, or null). */
static void id_item(struct buf *b, const char *t, int ws, int ucr, const char *id)
{
	long long s = BASE_S + ws;

	buf_appendf(b,
		    "%s{\"sb\":\"%s_s\",\"tenant\":\"%s\",\"node\":\"n\",\"gen\":1,\"ws\":%lld,"
		    "\"we\":%lld,\"ps\":%lld,\"pe\":%lld,\"ucr\":%d,\"cpu\":0,\"mem_bs\":0,"
		    "\"rx\":0,\"tx\":0,\"state\":\"running\",\"t\":%lld,\"cpu_at\":0,\"rx_at\":0,"
		    "\"tx_at\":0,\"rem\":0,\"gnode\":\"\",\"id\":%s}",
		    b->len > 1 ? "," : "", t, t, s, s + 10, s * 1000000000LL, (s + 10) * 1000000000LL,
		    ucr, (s + 10) * 1000000000LL, id);
}

/* Whether meter_flush_set($1::<type>) of `items` succeeded; the refused pairs' count in *nref. */
static bool flush_as(const char *type, const char *items_json, int *nref)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);
	struct pg_res *res = NULL;
	char q[128];
	bool ok;

	snprintf(q, sizeof(q), "SELECT * FROM meter_flush_set($1::%s, 'card')", type);
	ok = PGQ(c, &res, &err, q, items_json) == KILN_OK;
	*nref = ok ? pg_res_rows(res) : -1;
	if (!ok)
		fprintf(stderr, "(expected for the bad id) meter_flush_set: %s\n", err.msg);
	pg_res_free(res);
	pg_release(pg, c);
	return ok;
}

/*
 * The meter's transfer ids (migrations/0044): a window's first transfer takes the id sent with
 * it, its further ones (the overdraft past its grant) and a window sent without one get an id
 * of the same form from Postgres; a replay with the same ids is refused and charges nothing; a
 * flush with an id not of that form fails whole, writing nothing; the flush runs without JIT.
 */
static void test_flush_takes_the_meters_transfer_ids(void)
{
	const char *t = "fid", *u = "fidbad";
	const char *a = "\"tx_aaaaaaaaaaaaaaaaaaaaaaaaa2\"", *b = "\"tx_bbbbbbbbbbbbbbbbbbbbbbbbb7\"";
	struct buf j;
	int nref;

	buf_init(&j, 1u << 20);
	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'flush'), ('%s', 'flush');"
	    "INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:%s', '%s', 'grant'),"
	    " ('grant:%s', '%s', 'grant');"
	    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	    "amount_ucr, tenant_id, reason) VALUES ('tx_fid', 'g:fid', 'grant', 'system:issuance', "
	    "'grant:%s', 1500, '%s', 'test'), ('tx_fidbad', 'g:fidbad', 'grant', 'system:issuance', "
	    "'grant:%s', 1500, '%s', 'test')",
	    t, u, t, t, u, u, t, t, u, u);
	/* 1,000 from the grant; 500 from it and 500 from the overdraft; no id sent. */
	buf_appends(&j, "[");
	id_item(&j, t, 0, 1000, a);
	id_item(&j, t, 10, 1000, b);
	id_item(&j, t, 20, 300, "null");
	buf_appends(&j, "]");
	CHECK(flush_as("json", j.data, &nref));
	CHECK_INT(nref, 0);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE idem_key = 'usage:fid_s:1:%lld' "
			  "AND id = 'tx_aaaaaaaaaaaaaaaaaaaaaaaaa2' AND amount_ucr = 1000",
			  BASE_S), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE idem_key = 'usage:fid_s:1:%lld' "
			  "AND id = 'tx_bbbbbbbbbbbbbbbbbbbbbbbbb7' AND debit_account = 'grant:fid' "
			  "AND amount_ucr = 500", BASE_S + 10), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE idem_key = 'usage:fid_s:1:%lld:2' "
			  "AND id ~ '^tx_[a-z2-7]{26}$' AND id <> 'tx_bbbbbbbbbbbbbbbbbbbbbbbbb7' "
			  "AND debit_account = 'overdraft:fid' AND amount_ucr = 500", BASE_S + 10), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE idem_key = 'usage:fid_s:1:%lld' "
			  "AND id ~ '^tx_[a-z2-7]{26}$' AND amount_ucr = 300", BASE_S + 20), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = 'fid'"), 5);

	/* The same flush again, through 0037's signature (jsonb): refused, nothing charged. */
	CHECK(flush_as("jsonb", j.data, &nref));
	CHECK_INT(nref, 1);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = 'fid'"), 5);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'overdraft:fid'"), -800);

	/* A bad id after a good window: the flush fails, and nothing of it is in the ledger. */
	buf_reset(&j);
	buf_appends(&j, "[");
	id_item(&j, u, 0, 1000, "\"tx_cccccccccccccccccccccccccc\"");
	id_item(&j, u, 10, 1000, "\"tx_1; DROP TABLE tenants\"");
	buf_appends(&j, "]");
	CHECK(!flush_as("json", j.data, &nref));
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = 'fidbad'"), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE tenant_id = 'fidbad'"), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE tenant_id = 'fidbad'"), 0);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'grant:fidbad'"), 1500);

	/* JIT stays off in the flush's statements whatever the server's setting. */
	CHECK_INT(sql_int("SELECT count(*) FROM pg_proc WHERE proname = 'meter_flush_set' "
			  "AND 'jit=off' = ANY(proconfig)"), 1);
	buf_release(&j);
}

/*
 * Migration 0046: a flush makes no temporary table (0044 made five per flush, and the session's
 * temporary schema at its first). On a connection of its own, a flush of two tenants' windows,
 * one of them an overdraft, then the same flush again (refused): the session never had a
 * temporary schema, and the first flush charged what it should.
 */
static void test_flush_makes_no_temporary_tables(void)
{
	struct kiln_error err = { 0 };
	struct pg *own = pg_new(db_url, 1);
	struct pg_conn *c = NULL;
	struct pg_res *res = NULL;
	const char *t = "ftmp", *u = "ftmp2";
	struct buf j;

	buf_init(&j, 1u << 20);
	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'flush'), ('%s', 'flush');"
	    "INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:%s', '%s', 'grant');"
	    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	    "amount_ucr, tenant_id, reason) VALUES ('tx_ftmp', 'g:ftmp', 'grant', 'system:issuance', "
	    "'grant:%s', 1500, '%s', 'test')",
	    t, u, t, t, t, t);
	buf_appends(&j, "[");
	id_item(&j, t, 0, 1000, "null");
	id_item(&j, t, 10, 1000, "null");
	id_item(&j, u, 0, 200, "null");
	buf_appends(&j, "]");
	CHECK(own && pg_acquire(own, &c, &err) == KILN_OK);
	if (!c) {
		buf_release(&j);
		pg_free(own);
		return;
	}
	for (int k = 0; k < 2; k++) {
		CHECK(PGQ(c, &res, &err, "SELECT * FROM meter_flush_set($1::json, 'card')", j.data) ==
		      KILN_OK);
		CHECK_INT(pg_res_rows(res), k == 0 ? 0 : 2);	/* the replay: both pairs refused */
		pg_res_free(res);
		res = NULL;
	}
	CHECK(PGQ0(c, &res, &err, "SELECT pg_my_temp_schema()::oid::bigint") == KILN_OK);
	CHECK_INT(pg_res_int(res, 0, 0, -1), 0);
	pg_res_free(res);
	pg_release(own, c);
	pg_free(own);
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE tenant_id IN ('%s', '%s')", t, u),
		  3);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'grant:%s'", t), 0);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'overdraft:%s'", t), -500);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'overdraft:%s'", u), -200);
	buf_release(&j);
}

/* One window of sandbox "<t>_s" (generation 1, its meter's point in "none") starting at
 * BASE_S + ws, of 100 µcr, marking the generation's end or not. */
static void end_item(struct buf *b, const char *t, int ws, bool ended)
{
	long long s = BASE_S + ws;

	buf_appendf(b,
		    "%s{\"sb\":\"%s_s\",\"tenant\":\"%s\",\"node\":\"n\",\"gen\":1,\"ws\":%lld,"
		    "\"we\":%lld,\"ps\":%lld,\"pe\":%lld,\"ucr\":100,\"cpu\":0,\"mem_bs\":0,"
		    "\"rx\":0,\"tx\":0,\"state\":\"none\",\"t\":%lld,\"cpu_at\":0,\"rx_at\":0,"
		    "\"tx_at\":0,\"rem\":0,\"gnode\":\"\",\"ended\":%s}",
		    b->len > 1 ? "," : "", t, t, s, s + 10, s * 1000000000LL, (s + 10) * 1000000000LL,
		    (s + 10) * 1000000000LL, ended ? "true" : "false");
}

/*
 * A generation's end mark, once written, stands (migrations/0049: ended = m.ended OR
 * EXCLUDED.ended), and a later window of the marked pair is refused, in both forms of the flush
 * (migrations/0055): every second of the generation is in the ledger once its end is, so such a
 * window (a second meter's copy under other labels, or a replay) is time billed already. The
 * pair is reported refused, nothing is drawn, the point stays where the end put it. Before 0055
 * the window was written and the point moved on with it.
 */
static void test_a_window_after_the_end_mark_is_refused(void)
{
	static const char *const fns[] = { "meter_flush", "meter_flush_set" };
	char out[256];

	for (int k = 0; k < 2; k++) {
		char t[16];
		struct buf j;

		snprintf(t, sizeof(t), "fend%d", k);
		sql("INSERT INTO tenants (id, name) VALUES ('%s', 'flush')", t);
		buf_init(&j, 4096);
		buf_appends(&j, "[");
		end_item(&j, t, 0, true);
		buf_appends(&j, "]");
		flush(out, sizeof(out), fns[k], j.data, t, t, t, t);
		CHECK_STR(out, "");
		CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s_s' "
				  "AND ended", t), 1);
		buf_reset(&j);
		buf_appends(&j, "[");
		end_item(&j, t, 10, false);
		buf_appends(&j, "]");
		flush(out, sizeof(out), fns[k], j.data, t, t, t, t);
		CHECK_STR(out, "0_s:1;");	/* "<t>_s", generation 1 */
		CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s_s' "
				  "AND ended AND last_t_ns = %lld", t,
				  (BASE_S + 10) * 1000000000LL), 1);
		CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s_s'", t), 1);
		CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
				  "WHERE tenant_id = '%s' AND kind = 'usage'", t), 100);
		buf_release(&j);
	}
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_flush_set", KLOG_WARN, false);
	if (testdb_open(&db, "flushset") != 0)
		return 1;
	pg = db.pg;
	db_url = db.url;
	sql("INSERT INTO rate_cards (version, cpu_ucr_per_cpu_s, mem_ucr_per_gib_s, disk_ucr_per_gib_s, "
	    "snapshot_ucr_per_gib_s) VALUES ('card', 1, 1, 1, 1)");
	TEST(test_set_flush_draws_as_the_loop_did);
	TEST(test_flush_takes_the_meters_transfer_ids);
	TEST(test_flush_makes_no_temporary_tables);
	TEST(test_a_window_after_the_end_mark_is_refused);
	rc = test_summary();
	testdb_close(&db);
	return rc;
}
