/*
 * test_enforce.c - kiln-meter's enforcement when its inputs fail (metering/meter.h), tick by tick
 * on an injected clock, against the real Postgres and Redis of the ctest fixture "services".
 * The meter under test reaches Postgres or Redis through a Unix-socket proxy the test cuts
 * (sockproxy.h), while the test keeps its own direct connections: Redis unreachable while a
 * tenant crosses zero, Postgres unreachable while it does, and a meter back after downtime
 * (Redis having lost the balance meanwhile) pausing on its first, catch-up tick. Each time the
 * sandbox is asked to pause on the tick its tenant's balance reaches zero. Also: an expiry run
 * while Redis is away reaches it later, and a balance key of another type fails no sync.
 */
#include <glob.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "metering/billing.h"
#include "metering/meter.h"
#include "migrations/migrate.h"
#include "test.h"
#include "testdb.h"
#include "sockproxy.h"

#define S PRICE_NS_PER_S
#define WINDOW 10
#define MIB_PRICE 1024	/* µcr per GiB-s: 1 µcr per MiB-second; a sandbox of 256 MiB, 1 GiB: 257 µcr/s */

static struct pg *pg;
#define sql(...) testdb_sql(pg, __VA_ARGS__)
#define sql_int(...) testdb_sql_int(pg, __VA_ARGS__)
static struct rds *rds;
static struct testdb db;
static char node[32], pg_sock[512], redis_sock[512], scratch[128];
static int64_t fake_now;
static char paused[64][64];
static int npaused;

static int64_t fake_clock(void *ctx)
{
	(void)ctx;
	return fake_now;
}

static void on_pause(void *ctx, const char *sb, const char *t)
{
	(void)ctx;
	(void)t;
	if (npaused < 64)
		snprintf(paused[npaused++], sizeof(paused[0]), "%s", sb);
}

static void new_tenant(char *t, size_t n, long long grant_ucr)
{
	snprintf(t, n, "tn_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'test');"
	    "INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:tx_%s', '%s', 'grant');"
	    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	    "amount_ucr, tenant_id, reason) VALUES ('tx_%s', 'g:%s', 'grant', 'system:issuance', "
	    "'grant:tx_%s', %lld, '%s', 'test')",
	    t, t, t, t, t, t, grant_ucr, t);
}

/* A running sandbox of 256 MiB and 1 GiB (257 µcr/s) since the fake time `since_ns`. */
static void new_sandbox(const char *t, char *sb, size_t n, int64_t since_ns)
{
	snprintf(sb, n, "sb_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
	    "disk_gib, timeout_s, expires_at, state_changed_at, created_at) VALUES ('%s', '%s', '%s', "
	    "'running', 'python', 1000, 256, 1, 300, now() + interval '1 hour', "
	    "to_timestamp(%lld / 1e6), to_timestamp(%lld / 1e6))",
	    sb, t, node, (long long)(since_ns / 1000), (long long)(since_ns / 1000));
}

/* A node of its own for the case, and a window-aligned fake time a little before now. */
static int64_t aligned_now(void)
{
	int64_t t = (int64_t)time(NULL) - 3 * WINDOW;

	snprintf(node, sizeof(node), "ue%08x", (unsigned)rand());
	sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
	    "accelerator, image_hash) VALUES ('%s', 'unix:/nonexistent', 16000, 16384, 32, 'qemu', "
	    "'tcg', '')",
	    node);
	return (t - t % WINDOW) * S;
}

static bool flush_thread;
static unsigned flush_hold_ms;

static struct meter *new_meter(struct pg *mpg, struct rds *mrds)
{
	struct kiln_error err = { 0 };
	struct meter_opts o = {
		.node_id = node,
		.cgroup_root = "/nonexistent-cgroup-root",
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 900,
		.now_ns = fake_clock,
		.pause = on_pause,
		.flush_thread = flush_thread,
		.test_flush_hold_ms = flush_hold_ms,
	};
	struct meter *m;

	price_card_init(&o.card, 1000, MIB_PRICE, 1, 1024);
	m = meter_new(&o, mpg, mrds, &err);
	if (!m || meter_start(m, &err) != KILN_OK) {
		fprintf(stderr, "meter: %s\n", err.msg);
		exit(1);
	}
	return m;
}

/* Ticks once a fake second up to `until_ns`; the tick (1-based from `t0`) that first asked a
 * pause of `sb`, or 0. */
static int tick_until_paused(struct meter *m, int64_t t0, int64_t until_ns, const char *sb)
{
	struct kiln_error err = { 0 };
	int at = 0;

	while (fake_now + S <= until_ns) {
		fake_now += S;
		kiln_error_clear(&err);
		meter_tick(m, &err);
		for (int i = 0; i < npaused && !at; i++)
			if (!strcmp(paused[i], sb))
				at = (int)((fake_now - t0) / S);
	}
	return at;
}

/* Redis unreachable for the meter from the 2nd second: the tenant's 3000 µcr last 11.67 s. */
static void test_redis_down_tenant_crossing_zero_is_paused(void)
{
	char t[32], sb[32], sock[160];
	int64_t t0 = aligned_now();
	struct sockproxy px;
	struct rds *mrds;
	struct meter *m;
	int at;

	snprintf(sock, sizeof(sock), "%s/redis.sock", scratch);
	CHECK(sockproxy_start(&px, sock, redis_sock) == 0);
	snprintf(sock, sizeof(sock), "unix:%s/redis.sock", scratch);
	mrds = rds_new(sock, 500);
	new_tenant(t, sizeof(t), 3000);
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter(pg, mrds);
	CHECK_INT(tick_until_paused(m, t0, t0 + 2 * S, sb), 0);
	sockproxy_cut(&px);
	at = tick_until_paused(m, t0, t0 + 20 * S, sb);
	/* 257 x 12 = 3084 >= 3000: the tick of the 12th second, from what the meter knows. */
	CHECK_INT(at, 12);
	/* Back: Redis gets the charges and agrees with the ledger after the next flush. */
	sockproxy_mend(&px);
	npaused = 0;
	tick_until_paused(m, t0, t0 + 31 * S, sb);
	CHECK(npaused >= 1);
	meter_free(m);
	rds_free(mrds);
	sockproxy_stop(&px);
}

/* A meter started while Redis is away (its start cannot finish): it bills and pauses all the same. */
static void test_meter_started_without_redis_still_pauses(void)
{
	char t[32], sb[32], sock[160];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct sockproxy px;
	struct meter_opts o = {
		.node_id = node,
		.cgroup_root = "/nonexistent-cgroup-root",
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 900,
		.now_ns = fake_clock,
		.pause = on_pause,
	};
	struct rds *mrds;
	struct meter *m;

	snprintf(sock, sizeof(sock), "%s/redis2.sock", scratch);
	CHECK(sockproxy_start(&px, sock, redis_sock) == 0);
	snprintf(sock, sizeof(sock), "unix:%s/redis2.sock", scratch);
	mrds = rds_new(sock, 500);
	sockproxy_cut(&px);
	new_tenant(t, sizeof(t), 3000);
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	price_card_init(&o.card, 1000, MIB_PRICE, 1, 1024);
	m = meter_new(&o, pg, mrds, &err);
	CHECK(m && meter_start(m, &err) != KILN_OK);
	CHECK_INT(tick_until_paused(m, t0, t0 + 20 * S, sb), 12);
	meter_free(m);
	rds_free(mrds);
	sockproxy_stop(&px);
}

/* Postgres unreachable for the meter from the 2nd second: no rows can be read, yet it pauses. */
static void test_postgres_down_tenant_crossing_zero_is_paused(void)
{
	char t[32], sb[32], sock[160], info[400];
	int64_t t0 = aligned_now();
	struct sockproxy px;
	struct pg *mpg;
	struct meter *m;
	const char *port = strrchr(pg_sock, '.');
	int at;

	snprintf(sock, sizeof(sock), "%s/.s.PGSQL%s", scratch, port);
	CHECK(sockproxy_start(&px, sock, pg_sock) == 0);
	snprintf(info, sizeof(info), "host=%s port=%s user=kiln dbname=%s connect_timeout=2", scratch,
		 port + 1, db.name);
	mpg = pg_new(info, 2);
	new_tenant(t, sizeof(t), 3000);
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter(mpg, rds);
	CHECK_INT(tick_until_paused(m, t0, t0 + 2 * S, sb), 0);
	sockproxy_cut(&px);
	at = tick_until_paused(m, t0, t0 + 20 * S, sb);
	CHECK_INT(at, 12);
	sockproxy_mend(&px);
	meter_free(m);
	pg_free(mpg);
	sockproxy_stop(&px);
}

/*
 * Redis and Postgres both unreachable for the meter from the 2nd second: it goes by the balance
 * Redis last answered less the burn rate since the last billed tick, and pauses on time.
 */
static void test_redis_and_postgres_down_tenant_crossing_zero_is_paused(void)
{
	char t[32], sb[32], sock[160], info[400];
	int64_t t0 = aligned_now();
	struct sockproxy ppx, rpx;
	struct pg *mpg;
	struct rds *mrds;
	struct meter *m;
	const char *port = strrchr(pg_sock, '.');

	snprintf(sock, sizeof(sock), "%s/.s.PGSQL%s", scratch, port);
	CHECK(sockproxy_start(&ppx, sock, pg_sock) == 0);
	snprintf(info, sizeof(info), "host=%s port=%s user=kiln dbname=%s connect_timeout=2", scratch,
		 port + 1, db.name);
	mpg = pg_new(info, 2);
	snprintf(sock, sizeof(sock), "%s/redis3.sock", scratch);
	CHECK(sockproxy_start(&rpx, sock, redis_sock) == 0);
	snprintf(sock, sizeof(sock), "unix:%s/redis3.sock", scratch);
	mrds = rds_new(sock, 500);
	new_tenant(t, sizeof(t), 3000);
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter(mpg, mrds);
	CHECK_INT(tick_until_paused(m, t0, t0 + 2 * S, sb), 0);
	sockproxy_cut(&ppx);
	sockproxy_cut(&rpx);
	CHECK_INT(tick_until_paused(m, t0, t0 + 20 * S, sb), 12);
	sockproxy_mend(&ppx);
	sockproxy_mend(&rpx);
	meter_free(m);
	pg_free(mpg);
	rds_free(mrds);
	sockproxy_stop(&ppx);
	sockproxy_stop(&rpx);
}

/*
 * A meter down for a minute while its tenant's credits ran out, Redis restarted without data
 * meanwhile: the next run's first tick bills the minute and asks the pause on that same tick.
 */
static void test_catch_up_tick_enforces_at_once(void)
{
	char t[32], sb[32], key[128];
	int64_t t0 = aligned_now();
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	struct meter *m;

	new_tenant(t, sizeof(t), 10000);	/* 38.9 s */
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter(pg, rds);
	CHECK_INT(tick_until_paused(m, t0, t0 + 3 * S, sb), 0);
	meter_free(m);	/* down: nothing flushed */
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", t);
	CHECK(RDS(rds, &rep, &err, "DEL", key) == KILN_OK);
	rds_reply_release(&rep);
	fake_now = t0 + 60 * S;
	m = new_meter(pg, rds);
	CHECK_INT(tick_until_paused(m, t0, t0 + 61 * S, sb), 61);
	meter_free(m);
}

static double mono_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Ticks to `until_ns` (a fake second each); returns the longest tick, real seconds. */
static double tick_timed(struct meter *m, int64_t until_ns)
{
	struct kiln_error err = { 0 };
	double worst = 0;

	while (fake_now + S <= until_ns) {
		double t0 = mono_s(), d;
		fake_now += S;
		kiln_error_clear(&err);
		meter_tick(m, &err);
		d = mono_s() - t0;
		worst = d > worst ? d : worst;
	}
	return worst;
}

static long long used(const char *t)
{
	return sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
		       "WHERE tenant_id = '%s' AND kind = 'usage'", t);
}

/*
 * The flush on its own thread: with each flush's transaction held open 2.5 s, no tick lasts more
 * than half a second (KILN_TEST_FLUSH_INLINE=1 runs the same with the flush in the tick, and
 * fails); the windows reach the ledger once committed; a flush cut off with Postgres mid
 * transaction is sent again and the ledger ends exact, each window once.
 */
static void test_flush_thread_keeps_ticks_short_and_retries(void)
{
	char t[32], sb[32], sock[160], info[400];
	int64_t t0 = aligned_now();
	const char *port = strrchr(pg_sock, '.');
	struct sockproxy px;
	struct pg *mpg;
	struct meter *m;
	double worst;

	snprintf(sock, sizeof(sock), "%s/.s.PGSQL%s", scratch, port);
	CHECK(sockproxy_start(&px, sock, pg_sock) == 0);
	snprintf(info, sizeof(info), "host=%s port=%s user=kiln dbname=%s connect_timeout=2", scratch,
		 port + 1, db.name);
	mpg = pg_new(info, 4);
	new_tenant(t, sizeof(t), 1000000000LL);
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	flush_thread = !getenv("KILN_TEST_FLUSH_INLINE");
	flush_hold_ms = 2500;
	m = new_meter(mpg, rds);
	worst = tick_timed(m, t0 + 12 * S);	/* the first window is handed over at 10 s */
	fprintf(stderr, "longest tick while a flush is held: %.3f s\n", worst);
	CHECK(worst < 0.5);
	usleep(3500 * 1000);
	tick_timed(m, t0 + 13 * S);	/* applies the committed flush */
	CHECK_INT(used(t), 10 * 257);
	/* The next flush (at 20 s) loses Postgres while it holds its transaction. */
	tick_timed(m, t0 + 20 * S);
	usleep(500 * 1000);
	sockproxy_cut(&px);
	usleep(3000 * 1000);
	tick_timed(m, t0 + 21 * S);	/* learns it failed */
	sockproxy_mend(&px);
	CHECK_INT(used(t), 10 * 257);
	flush_hold_ms = 0;
	sql("UPDATE sandboxes SET state = 'stopped', state_changed_at = to_timestamp(%lld) "
	    "WHERE id = '%s'", (long long)(t0 / S + 30), sb);
	for (int i = 0; i < 40 && sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = "
					   "'%s' AND state = 'none'", sb) == 0; i++) {
		tick_timed(m, fake_now + S);
		usleep(300 * 1000);
	}
	CHECK_INT(used(t), 30 * 257);
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s'", sb), 3);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE sandbox_id = '%s'", sb), 3);
	meter_free(m);
	pg_free(mpg);
	sockproxy_stop(&px);
	flush_thread = false;
	flush_hold_ms = 0;
}

/* The ledger half Redis holds for `t` (as the test's own connection reads it), or -1: none. */
static long long redis_ledger(const char *t)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[128];
	long long v = -1;

	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", t);
	if (RDS(rds, &rep, &err, "HGET", key, "ledger") == KILN_OK && rep.type == RDS_STR && rep.str)
		v = atoll(rep.str);
	rds_reply_release(&rep);
	return v;
}

/*
 * A grant expires while the meter that runs the expiry cannot reach Redis: Redis gets the
 * tenant's balance after the expiry once it is back, from that meter, or, when that meter is gone
 * before then (its memory with it), from the next one. The tenant has nothing running, so no
 * flush gives Redis its balance; before (migrations/0059), Redis kept the 8000 µcr from before
 * the expiry for good.
 */
static void test_an_expiry_run_while_redis_is_away_reaches_redis(void)
{
	for (int restart = 0; restart <= 1; restart++) {
		struct kiln_error err = { 0 };
		char t[32], sock[160];
		int64_t t0 = aligned_now();
		const char *tl[1];
		struct sockproxy px;
		struct pg_conn *c;
		struct rds *mrds;
		struct meter *m;

		snprintf(sock, sizeof(sock), "%s/redis-x%d.sock", scratch, restart);
		CHECK(sockproxy_start(&px, sock, redis_sock) == 0);
		snprintf(sock, sizeof(sock), "unix:%s/redis-x%d.sock", scratch, restart);
		mrds = rds_new(sock, 500);
		new_tenant(t, sizeof(t), 3000);
		/* 5000 more, expiring 5 s in */
		sql("INSERT INTO ledger_accounts (id, tenant_id, kind, expires_at) VALUES "
		    "('grant:tx_%s_x', '%s', 'grant', to_timestamp(%lld));"
		    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
		    "amount_ucr, tenant_id, reason) VALUES ('tx_%s_x', 'g:%s:x', 'grant', "
		    "'system:issuance', 'grant:tx_%s_x', 5000, '%s', 'test')",
		    t, t, (long long)(t0 / S + 5), t, t, t, t);
		tl[0] = t;
		c = testdb_conn(pg);
		CHECK(billing_sync(rds, c, 1, tl, NULL, NULL, &err) == KILN_OK);
		pg_release(pg, c);
		CHECK_INT(redis_ledger(t), 8000);
		fake_now = t0;
		m = new_meter(pg, mrds);
		sockproxy_cut(&px);
		/* the expiry runs two windows after its time, by this meter, Redis away */
		tick_until_paused(m, t0, t0 + 40 * S, "none");
		CHECK_INT(sql_int("SELECT coalesce(sum(balance_ucr), 0) FROM ledger_account_balances "
				  "WHERE tenant_id = '%s'", t), 3000);
		CHECK_INT(redis_ledger(t), 8000);
		if (restart) {
			meter_free(m);
			sockproxy_mend(&px);
			m = new_meter(pg, mrds);
		} else {
			sockproxy_mend(&px);
		}
		tick_until_paused(m, t0, t0 + 42 * S, "none");
		CHECK_INT(redis_ledger(t), 3000);
		CHECK_INT(sql_int("SELECT count(*) FROM grant_expiries WHERE account_id = "
				  "'grant:tx_%s_x' AND redis_synced", t), 1);
		meter_free(m);
		rds_free(mrds);
		sockproxy_stop(&px);
	}
}

/* Sets the balance key of `t` in Redis to a string. */
static void balance_key_not_a_hash(const char *t)
{
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	char key[128];

	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", t);
	CHECK(RDS(rds, &rep, &err, "SET", key, "not a hash") == KILN_OK);
	rds_reply_release(&rep);
}

/*
 * A tenant's balance key of another type than a hash fails no sync (the other tenant of the same
 * call is synced), no read of the balance and no tick of the meter: each makes it again from the
 * ledger.
 */
static void test_a_balance_key_of_another_type_fails_no_sync(void)
{
	struct kiln_error err = { 0 };
	char t1[32], t2[32], t3[32], t4[32], sb[32];
	int64_t t0 = aligned_now();
	const char *tl[2];
	struct pg_conn *c;
	struct meter *m;

	new_tenant(t1, sizeof(t1), 3000);
	new_tenant(t2, sizeof(t2), 4000);
	balance_key_not_a_hash(t1);
	tl[0] = t1;
	tl[1] = t2;
	c = testdb_conn(pg);
	CHECK(billing_sync(rds, c, 2, tl, NULL, NULL, &err) == KILN_OK);
	CHECK_INT(redis_ledger(t1), 3000);
	CHECK_INT(redis_ledger(t2), 4000);
	/* a create's admission reads the balance */
	new_tenant(t3, sizeof(t3), 5000);
	balance_key_not_a_hash(t3);
	CHECK_INT(billing_admit(rds, c, t3, 1, 1000, 256, &err), KILN_OK);
	CHECK_INT(redis_ledger(t3), 5000);
	pg_release(pg, c);
	/* the meter's tick, a window before any flush */
	new_tenant(t4, sizeof(t4), 6000);
	new_sandbox(t4, sb, sizeof(sb), t0);
	balance_key_not_a_hash(t4);
	fake_now = t0;
	npaused = 0;
	m = new_meter(pg, rds);
	CHECK_INT(tick_until_paused(m, t0, t0 + 2 * S, sb), 0);
	CHECK_INT(redis_ledger(t4), 6000);
	meter_free(m);
}

int main(void)
{
	const char *envf = getenv("KILN_SERVICES_ENV");
	char line[512], sockdir[512] = "", pattern[600];
	FILE *f;
	glob_t g;
	int rc;

	log_init("test_enforce", KLOG_WARN, false);
	signal(SIGPIPE, SIG_IGN);	/* as the daemons: a cut connection is an error, not a signal */
	if (testdb_open(&db, "enforce") != 0)
		return 1;
	pg = db.pg;
	rds = rds_new(db.redis_url, 2000);
	if (envf && (f = fopen(envf, "r"))) {
		while (fgets(line, sizeof(line), f)) {
			line[strcspn(line, "\n")] = '\0';
			if (!strncmp(line, "KILN_TEST_SOCKDIR=", 18))
				snprintf(sockdir, sizeof(sockdir), "%s", line + 18);
		}
		fclose(f);
	}
	snprintf(redis_sock, sizeof(redis_sock), "%s", db.redis_url + 5);
	snprintf(pattern, sizeof(pattern), "%s/.s.PGSQL.[0-9]*[0-9]", sockdir);
	if (glob(pattern, 0, NULL, &g) != 0 || g.gl_pathc < 1) {
		fprintf(stderr, "no Postgres socket in \"%s\"\n", sockdir);
		return 1;
	}
	snprintf(pg_sock, sizeof(pg_sock), "%s", g.gl_pathv[0]);
	globfree(&g);
	snprintf(scratch, sizeof(scratch), "/tmp/kiln-enforce-XXXXXX");
	if (!mkdtemp(scratch)) {
		perror("mkdtemp");
		return 1;
	}

	TEST(test_redis_down_tenant_crossing_zero_is_paused);
	TEST(test_postgres_down_tenant_crossing_zero_is_paused);
	TEST(test_redis_and_postgres_down_tenant_crossing_zero_is_paused);
	TEST(test_meter_started_without_redis_still_pauses);
	TEST(test_catch_up_tick_enforces_at_once);
	TEST(test_flush_thread_keeps_ticks_short_and_retries);
	TEST(test_an_expiry_run_while_redis_is_away_reaches_redis);
	TEST(test_a_balance_key_of_another_type_fails_no_sync);

	rc = test_summary();
	rmdir(scratch);
	rds_free(rds);
	testdb_close(&db);
	return rc;
}
