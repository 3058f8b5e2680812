/*
 * test_debt.c - a tenant at or below zero is billed (its balance goes negative: debt), and grant
 * expiry never forgives debt. The meter's engine (metering/meter.h) driven tick by tick on an
 * injected clock against the real Postgres and Redis of the ctest fixture "services", as
 * test_meter.c does: running time after zero is charged until the pause lands, a paused
 * sandbox's snapshot keeps accruing at zero, a meter without a master key still bills, a grant
 * to a tenant in debt pays the debt first, and a grant expiring while the meter was down takes
 * away only its own unspent credits as of its expiry, never the charges of the windows after it.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "metering/billing.h"
#include "metering/ledger.h"
#include "metering/meter.h"
#include "migrations/migrate.h"
#include "test.h"
#include "testdb.h"

#define S PRICE_NS_PER_S
#define WINDOW 10
#define MIB_PRICE 1024	/* µcr per GiB-s: 1 µcr per MiB-second */

static struct pg *pg;

/* On the scratch database (testdb.h). */
#define conn() testdb_conn(pg)
#define sql(...) testdb_sql(pg, __VA_ARGS__)
#define sql_int(...) testdb_sql_int(pg, __VA_ARGS__)
static struct rds *rds;
static char node[32];
static int64_t fake_now;

#include "meterdb.h"

static char paused[64][64];
static int npaused;

static void on_pause(void *ctx, const char *sb, const char *t)
{
	(void)ctx;
	(void)t;
	if (npaused < 64)
		snprintf(paused[npaused++], sizeof(paused[0]), "%s", sb);
}

/* A meter of the current node on the fake wall clock; `pausing` false: no master key (no pauses). */
static struct meter *new_meter_pausing(bool pausing)
{
	struct kiln_error err = { 0 };
	struct meter_opts o = {
		.node_id = node,
		.cgroup_root = "/nonexistent-cgroup-root",
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 900,
		.now_ns = fake_clock,
		.pause = pausing ? on_pause : NULL,
	};
	struct meter *m;

	price_card_init(&o.card, 1000, MIB_PRICE, 1, 1024);
	m = meter_new(&o, pg, rds, &err);
	if (!m || meter_start(m, &err) != KILN_OK) {
		fprintf(stderr, "meter: %s\n", err.msg);
		exit(1);
	}
	return m;
}

/* The gateway's view of the balance of `t`. */
static struct billing_balance api_balance(const char *t)
{
	struct kiln_error err = { 0 };
	struct billing_balance b;
	struct pg_conn *c = conn();

	if (billing_balance(rds, c, t, &b, &err) != KILN_OK) {
		fprintf(stderr, "billing_balance: %s\n", err.msg);
		memset(&b, 0, sizeof(b));
	}
	pg_release(pg, c);
	return b;
}

/*
 * A running sandbox whose tenant reaches zero is asked to pause, and every second it goes on
 * running (the node has not paused it) is charged: the balance goes negative.
 */
static void test_running_at_zero_is_billed_as_debt(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000, 0, "a");	/* 3.9 seconds of a 257 µcr/s sandbox */
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter_pausing(true);
	tick_until(m, t0 + 25 * S);
	CHECK(npaused >= 1);
	CHECK_INT(used(t) + meter_pending(m, t), 25 * 257);
	CHECK_INT(used(t), 20 * 257);
	CHECK_INT(ledger_bal(t), 1000 - 20 * 257);
	CHECK_INT(redis_bal(t, &ok), 1000 - 25 * 257);
	CHECK(ok);
	{
		struct billing_balance b = api_balance(t);
		CHECK_INT(b.balance_ucr, 1000 - 25 * 257);
		CHECK_INT(b.debt_ucr, 25 * 257 - 1000);
		CHECK(b.has_debt_since);
	}
	/* The charges beyond the grant are the overdraft's. */
	CHECK_INT(sql_int("SELECT -balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'overdraft:%s'", t), 20 * 257 - 1000);
	meter_free(m);
}

/* Without a master key nothing is paused: the sandbox runs on and is billed, in debt. */
static void test_no_master_key_bills_debt(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 40 * S);
	CHECK_INT(npaused, 0);
	CHECK_INT(used(t), 40 * 257);
	CHECK_INT(ledger_bal(t), 1000 - 40 * 257);
	meter_free(m);
}

/* A paused sandbox's snapshot keeps accruing at and below zero. */
static void test_paused_snapshot_accrues_at_zero(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 100, 0, "a");
	/* Paused from the start into a snapshot of 512 MiB: 512 µcr/s. */
	snprintf(sb, sizeof(sb), "sb_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
	    "disk_gib, timeout_s, expires_at, state_changed_at, created_at) VALUES ('%s', '%s', '%s', "
	    "'paused', 'python', 1000, 256, 1, 300, now() + interval '1 hour', "
	    "to_timestamp(%lld / 1e6), to_timestamp(%lld / 1e6));"
	    "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib) VALUES ('snap_%s', '%s', '%s', '%s', 'pause', %lld, 1000, 256, 1);"
	    "UPDATE sandboxes SET pause_snapshot = 'snap_%s' WHERE id = '%s'",
	    sb, t, node, (long long)(t0 / 1000), (long long)(t0 / 1000), sb, t, sb, node,
	    512LL << 20, sb, sb);
	fake_now = t0;
	npaused = 0;
	m = new_meter_pausing(true);
	tick_until(m, t0 + 30 * S);
	CHECK_INT(npaused, 0);
	CHECK_INT(used(t), 30 * 512);
	CHECK_INT(ledger_bal(t), 100 - 30 * 512);
	meter_free(m);
}

/* A grant to a tenant in debt pays the debt first: the balance is credits - charges. */
static void test_grant_pays_debt_first(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 20 * S);
	stop_sandbox(sb, t0 + 20 * S);
	tick_until(m, t0 + 31 * S);
	CHECK_INT(ledger_bal(t), 1000 - 20 * 257);
	grant(t, 10000, 0, "b");
	{
		/* as POST /v1/billing/grants does after its transfer */
		struct kiln_error err = { 0 };
		const char *ts[1] = { t };
		struct pg_conn *c = conn();
		CHECK_INT(billing_sync(rds, c, 1, ts, NULL, NULL, &err), KILN_OK);
		pg_release(pg, c);
	}
	CHECK_INT(ledger_bal(t), 11000 - 20 * 257);
	CHECK_INT(api_balance(t).balance_ucr, 11000 - 20 * 257);
	CHECK_INT(api_balance(t).debt_ucr, 0);
	CHECK(!api_balance(t).has_debt_since);
	tick_until(m, t0 + 32 * S);
	CHECK_INT(redis_bal(t, &ok), 11000 - 20 * 257);
	meter_free(m);
}

/*
 * A grant expires while no meter runs; the meter comes back and flushes the windows after the
 * expiry (drawn from the overdraft, the grant being expired for them) before the expiry runs.
 * The expiry takes away what the grant had left at its expiry time, and the debt of the windows
 * after it remains: before, the expiry took only the tenant's positive balance, so the expired
 * grant paid for the later windows.
 */
static void test_expiry_after_downtime_keeps_the_debt(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 10000, t0 / S + 5, "soon");
	new_sandbox(t, sb, sizeof(sb), t0);
	/* The meter is down from t0 to t0 + 40 s. */
	fake_now = t0 + 40 * S;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 41 * S);
	/* [t0, t0+10) from the grant (valid at its start), the three windows after from the
	 * overdraft; the grant had 10000 - 2570 left when it expired. */
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s'", sb), 4);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "tenant_id = '%s' AND kind = 'usage' AND debit_account LIKE 'grant:%%'", t),
		  2570);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "tenant_id = '%s' AND kind = 'expiry'", t), 10000 - 2570);
	CHECK_INT(ledger_bal(t), -3 * 2570);
	CHECK_INT(api_balance(t).debt_ucr, 3 * 2570 + 257);
	meter_free(m);
}

/*
 * A new tenant `t` in debt of one window: its sandbox ran 10 s from `t0` with no grant (2,570
 * µcr from the overdraft) and stopped; the meter (no master key) has ticked to `until_s`.
 */
static struct meter *debt_of_one_window(char *t, size_t n, int64_t t0, int until_s)
{
	char sb[32];
	struct meter *m;

	new_tenant(t, n);
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 10 * S);
	stop_sandbox(sb, t0 + 10 * S);
	tick_until(m, t0 + until_s * S);
	CHECK_INT(ledger_bal(t), -2570);
	return m;
}

/*
 * A grant made to a tenant already in debt pays that debt first; when it expires, only what is
 * left of it after the debt goes.
 */
static void test_expiry_of_a_grant_that_paid_a_debt(void)
{
	char t[32];
	int64_t t0 = aligned_now();
	struct meter *m = debt_of_one_window(t, sizeof(t), t0, 20);

	grant(t, 3000, t0 / S + 25, "b");
	tick_until(m, t0 + 51 * S);	/* the expiry runs two windows after its time */
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "tenant_id = '%s' AND kind = 'expiry'", t), 3000 - 2570);
	CHECK_INT(ledger_bal(t), 0);
	meter_free(m);
}

/* A grant as grant() makes it, made at the fake second `made_s`. */
static void grant_made_at(const char *t, long long ucr, int64_t exp_s, const char *tag,
			  int64_t made_s)
{
	grant(t, ucr, exp_s, tag);
	/* (a test's set-up only: the ledger is append-only for the service) */
	sql("ALTER TABLE ledger_transfers DISABLE TRIGGER ledger_transfers_append_only;"
	    "UPDATE ledger_transfers SET created_at = to_timestamp(%lld) WHERE id = 'tx_%s_%s';"
	    "ALTER TABLE ledger_transfers ENABLE TRIGGER ledger_transfers_append_only",
	    (long long)made_s, t, tag);
}

/*
 * A grant made after another's expiry, before that expiry ran, does not count in what the
 * expired grant had left: the expired grant had paid a debt first, so only the rest of it goes,
 * and the later grant is the tenant's whole.
 */
static void test_expiry_ignores_grants_made_after_it(void)
{
	char t[32];
	int64_t t0 = aligned_now();
	struct meter *m = debt_of_one_window(t, sizeof(t), t0, 21);

	grant_made_at(t, 3000, t0 / S + 25, "g", t0 / S + 21);	/* pays the debt: 430 left */
	tick_until(m, t0 + 28 * S);
	grant_made_at(t, 5000, 0, "h", t0 / S + 28);	/* after g's expiry, before it runs */
	tick_until(m, t0 + 51 * S);	/* the expiry runs two windows after its time */
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "tenant_id = '%s' AND kind = 'expiry'", t), 430);
	CHECK_INT(ledger_bal(t), 5000);
	meter_free(m);
}

/*
 * What an expiring grant keeps against the overdraft is the debt as it stands at its expiry, not
 * at its making: a grant that expires sooner nets part of the debt when the later grant is made,
 * then is spent on usage first (earliest expiry first), so the debt the later grant pays grows by
 * it. The tenant ends at zero: no credit lost or invented. (kiln-sim's expiry check wanted no more
 * kept than the debt at the making, and seed 7002 failed it with a ledger like this one.)
 */
static void test_expiry_keeps_the_debt_at_its_expiry(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 11 * S);
	CHECK_INT(ledger_bal(t), -2570);
	grant(t, 1000, t0 / S + 30, "a");
	grant(t, 10000, t0 / S + 45, "b");	/* made at a debt of 1570 */
	tick_until(m, t0 + 20 * S);
	stop_sandbox(sb, t0 + 20 * S);
	tick_until(m, t0 + 31 * S);
	/* [t0+10, t0+20): 1000 from a, 1570 from b; a expires empty */
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "debit_account = 'grant:tx_%s_a' AND kind = 'usage'", t), 1000);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'expiry'", t), 0);
	tick_until(m, t0 + 71 * S);	/* b's expiry runs two windows after its time */
	/* b had 8430 left, the tenant 5860: b keeps 2570, the whole debt at its expiry */
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "tenant_id = '%s' AND kind = 'expiry'", t), 5860);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'grant:tx_%s_b'", t), 2570);
	CHECK_INT(ledger_bal(t), 0);
	meter_free(m);
}

/*
 * A window that started before a grant's expiry, flushed after the expiry ran (its meter's
 * Postgres down, a meter restarted, a clock step the meters followed at different ticks), is
 * drawn from that grant as it would have been before the expiry: the expiry is taken back and
 * runs again at once with what the grant has left. Before, the window was drawn from the
 * tenant's other grant while the expiry kept the credits that should have paid it (kiln-sim seed
 * 31035: a 262 µcr window, the tenant's balance as of the expiry -262 µcr).
 */
static void test_a_window_flushed_after_an_expiry_is_drawn_from_its_grant(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	struct ledger_balance lb;
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 10000, t0 / S + 15, "g");
	grant(t, 100000, 0, "o");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 9 * S);	/* [t0, t0+10) not flushed yet */
	/* another meter runs g's expiry before this one flushes: all of g goes */
	sql("SELECT ledger_expire_grants(to_timestamp(%lld))", (long long)(t0 / S + 15));
	CHECK_INT(ledger_bal(t), 100000);
	tick_until(m, t0 + 11 * S);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "debit_account = 'grant:tx_%s_g' AND kind = 'usage'", t), 2570);
	CHECK_INT(ledger_bal(t), 100000);
	CHECK_INT(redis_bal(t, &ok), 100000 - meter_pending(m, t));
	CHECK(ok);
	/* [t0+10, t0+20) started before the expiry too; [t0+20, t0+30) after it, from o */
	tick_until(m, t0 + 31 * S);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "debit_account = 'grant:tx_%s_g' AND kind = 'usage'", t), 2 * 2570);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "debit_account = 'grant:tx_%s_o' AND kind = 'usage'", t), 2570);
	CHECK_INT(sql_int("SELECT amount_ucr FROM grant_expiries WHERE account_id = "
			  "'grant:tx_%s_g'", t), 10000 - 2 * 2570);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'expiry_reversal'", t), 2);
	CHECK_INT(sql_int("SELECT balance_ucr FROM ledger_account_balances WHERE account_id = "
			  "'grant:tx_%s_g'", t), 0);
	CHECK_INT(ledger_bal(t), 100000 - 2570);
	CHECK_INT(redis_bal(t, &ok), 100000 - 2570 - meter_pending(m, t));
	c = conn();
	CHECK(ledger_balance(c, t, &lb, &err) == KILN_OK);
	pg_release(pg, c);
	CHECK_INT(lb.expired_ucr, 10000 - 2 * 2570);
	CHECK_INT(lb.balance_ucr, 100000 - 2570);
	CHECK_INT(api_balance(t).granted_ucr, 110000 - (10000 - 2 * 2570));
	/* the meter's own expiry run later leaves it be */
	tick_until(m, t0 + 51 * S);
	CHECK_INT(sql_int("SELECT coalesce(sum(CASE kind WHEN 'expiry' THEN amount_ucr ELSE "
			  "-amount_ucr END), 0) FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind IN ('expiry', 'expiry_reversal')", t), 10000 - 2 * 2570);
	meter_free(m);
}

/*
 * A reopened expiry keeps the tenant's period at or below zero: the reversal lifted the balance
 * for a moment, which ended the period, and the expiry run again began another, since now
 * (debt_since, the snapshot deletion's countdown and its notice started over). And a replayed
 * window, already in the ledger, draws nothing and reopens nothing: before, each replay posted a
 * reversal and an expiry again.
 */
static void test_a_reopened_expiry_keeps_the_debt_period_and_a_replay_reopens_nothing(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 10000, t0 / S + 15, "g");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter_pausing(false);
	tick_until(m, t0 + 9 * S);
	sql("SELECT ledger_expire_grants(to_timestamp(%lld))", (long long)(t0 / S + 15));
	CHECK_INT(ledger_bal(t), 0);
	sql("UPDATE billing_debts SET since = now() - interval '3 days', "
	    "noticed_at = now() - interval '3 days' WHERE tenant_id = '%s'", t);
	tick_until(m, t0 + 11 * S);
	CHECK_INT(sql_int("SELECT amount_ucr FROM grant_expiries WHERE account_id = "
			  "'grant:tx_%s_g'", t), 10000 - 2570);
	CHECK_INT(ledger_bal(t), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM billing_debts WHERE tenant_id = '%s' AND "
			  "since < now() - interval '2 days' AND noticed_at < now() - interval '2 days'",
			  t), 1);
	/* the first window sent again, as a flush whose commit's reply was lost would */
	sql("SELECT * FROM meter_flush_set((SELECT json_agg(json_build_object('sb', u.sandbox_id, "
	    "'tenant', u.tenant_id, 'node', '%s', 'gen', u.generation, 'ws', "
	    "extract(epoch FROM u.window_start)::bigint, 'we', "
	    "extract(epoch FROM u.window_end)::bigint, 'ps', u.ps_ns, 'pe', u.pe_ns, 'ucr', u.ucr, "
	    "'cpu', 0, 'mem_bs', 0, 'rx', 0, 'tx', 0, 'state', 'running', 't', u.pe_ns, 'cpu_at', 0, "
	    "'rx_at', 0, 'tx_at', 0, 'rem', 0, 'gnode', '', 'id', NULL)) FROM usage_windows u "
	    "WHERE u.sandbox_id = '%s'), 'test')", node, sb);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind IN ('expiry', 'expiry_reversal')", t), 3);
	CHECK_INT(used(t), 2570);
	CHECK_INT(ledger_bal(t), 0);
	meter_free(m);
}

/*
 * An expiry run again counts the grants made since its first run as made after it, whatever
 * their time reads (one stamped before the expiry: a backward step of the wall clock, Postgres's
 * clock behind the meter's), as its first run did by not seeing them. The grant here paid a debt
 * of 2,570 µcr first and its first run took the 7,430 left; a grant of 50,000 made after that run
 * is stamped before the expiry; a late window of 2,570 reopens it. Before, that grant counted as
 * the expired one's to take, and the expiry took 7,430 again for 4,860: the window cost 5,140 of
 * the later grant's credits.
 */
static void test_a_reopened_expiry_counts_grants_made_after_its_first_run(void)
{
	char t[32], sb2[32];
	int64_t t0 = aligned_now();
	struct meter *m = debt_of_one_window(t, sizeof(t), t0, 19);

	grant(t, 10000, t0 / S + 35, "g");
	new_sandbox(t, sb2, sizeof(sb2), t0 + 20 * S);
	tick_until(m, t0 + 29 * S);
	sql("SELECT ledger_expire_grants(to_timestamp(%lld))", (long long)(t0 / S + 35));
	CHECK_INT(sql_int("SELECT amount_ucr FROM grant_expiries WHERE account_id = "
			  "'grant:tx_%s_g'", t), 7430);
	grant_made_at(t, 50000, 0, "late", t0 / S + 30);
	tick_until(m, t0 + 31 * S);
	CHECK_INT(sql_int("SELECT amount_ucr FROM grant_expiries WHERE account_id = "
			  "'grant:tx_%s_g'", t), 4860);
	CHECK_INT(used(t), 2 * 2570);
	CHECK_INT(ledger_bal(t), 60000 - 2 * 2570 - 4860);
	meter_free(m);
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_debt", KLOG_WARN, false);
	if (testdb_open(&db, "debt") != 0)
		return 1;
	pg = db.pg;
	rds = rds_new(db.redis_url, 2000);

	TEST(test_running_at_zero_is_billed_as_debt);
	TEST(test_no_master_key_bills_debt);
	TEST(test_paused_snapshot_accrues_at_zero);
	TEST(test_grant_pays_debt_first);
	TEST(test_expiry_after_downtime_keeps_the_debt);
	TEST(test_expiry_of_a_grant_that_paid_a_debt);
	TEST(test_expiry_ignores_grants_made_after_it);
	TEST(test_expiry_keeps_the_debt_at_its_expiry);
	TEST(test_a_window_flushed_after_an_expiry_is_drawn_from_its_grant);
	TEST(test_a_reopened_expiry_keeps_the_debt_period_and_a_replay_reopens_nothing);
	TEST(test_a_reopened_expiry_counts_grants_made_after_its_first_run);

	rc = test_summary();
	rds_free(rds);
	testdb_close(&db);
	return rc;
}
