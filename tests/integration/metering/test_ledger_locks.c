/*
 * test_ledger_locks.c - the per-tenant ledger lock under concurrency, against the real Postgres
 * and Redis of the ctest fixture "services" (a scratch database of its own):
 *
 *  - a grant waits for a flush that holds its tenant's lock, and its transfer comes after the
 *    flush's draws (so a read that sees the grant sees the draws: the `lseq` compare of the
 *    Redis balance holds);
 *  - grants made by several threads while kiln-meter's engine (metering/meter.h, an injected
 *    clock) ticks and flushes the same tenant: after every flush the Redis balance is the ledger
 *    exactly, and no grant is lost;
 *  - two flushes of the same two tenants with their items in opposite orders, at once, many
 *    times: both commit every time (no deadlock).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/buf.h"
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
#define POOL 12

static struct pg *pg;

/* On the scratch database (testdb.h). */
#define conn() testdb_conn(pg)
#define sql(...) testdb_sql(pg, __VA_ARGS__)
#define sql_int(...) testdb_sql_int(pg, __VA_ARGS__)
static struct rds *rds;
static char node[32];
static _Atomic int64_t fake_now;

static int64_t fake_clock(void *ctx)
{
	(void)ctx;
	return atomic_load(&fake_now);
}

static int64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void new_tenant(char *t, size_t n)
{
	snprintf(t, n, "tn_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'test')", t);
}

/* A node of its own for a case; returns a window-aligned fake time a little before now. */
static int64_t new_node(void)
{
	int64_t t = (int64_t)time(NULL) - 3 * WINDOW;

	snprintf(node, sizeof(node), "ul%08x", (unsigned)rand());
	sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
	    "accelerator, image_hash) VALUES ('%s', 'unix:/nonexistent', 16000, 16384, 32, 'qemu', "
	    "'tcg', '')",
	    node);
	return (t - t % WINDOW) * S;
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

static long long ledger_bal(const char *t)
{
	return sql_int("SELECT coalesce(sum(balance_ucr), 0) FROM ledger_account_balances "
		       "WHERE tenant_id = '%s'", t);
}

/* The `ledger` half of the Redis balance of `t` (-1 when missing) and the sum of its live fields. */
static long long redis_ledger(const char *t, long long *live)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[128];
	long long ledger = -1;

	*live = 0;
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", t);
	if (RDS(rds, &rep, &err, "HGETALL", key) == KILN_OK && rep.type == RDS_ARRAY) {
		for (size_t i = 0; i + 1 < rep.n; i += 2) {
			if (!strcmp(rep.elem[i].str, "ledger"))
				ledger = atoll(rep.elem[i + 1].str);
			else if (!strncmp(rep.elem[i].str, "live:", 5))
				*live += atoll(rep.elem[i + 1].str);
		}
	}
	rds_reply_release(&rep);
	return ledger;
}

/*
 * A grant as POST /v1/billing/grants makes it (api/routes_billing.c): a transaction around
 * ledger_grant_request(), then billing_sync() of the tenant. `hold_us` keeps the transaction
 * open that long after posting, as a slow gateway would. KILN_OK or the error.
 */
static enum kiln_err do_grant(const char *t, long long ucr, const char *key, unsigned hold_us,
			      long long *seq)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c = conn();
	struct pg_res *res = NULL;
	char tx[LEDGER_TX_ID_MAX];
	int replayed = 0;
	enum kiln_err rc;
	const char *tt[1] = { t };

	rc = pg_exec(c, "BEGIN", &err);
	if (rc == KILN_OK)
		rc = ledger_grant_request(c, t, ucr, NULL, key, NULL, "test", tx, &replayed, &err);
	if (rc == KILN_OK && hold_us)
		usleep(hold_us);
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", &err);
	if (rc == KILN_OK && seq && PGQ(c, &res, &err, "SELECT seq FROM ledger_transfers WHERE id = $1",
					tx) == KILN_OK)
		*seq = pg_res_int(res, 0, 0, -1);
	pg_res_free(res);
	if (rc == KILN_OK)
		rc = billing_sync(rds, c, 1, tt, NULL, NULL, &err);
	if (rc != KILN_OK) {
		struct kiln_error ignore = { 0 };
		pg_exec(c, "ROLLBACK", &ignore);
		fprintf(stderr, "grant %s: %s\n", key, err.msg);
	}
	pg_release(pg, c);
	return rc;
}

/* Appends one item of meter_flush() (migrations/0004_metering.sql): `ucr` for window `ws`. */
static void flush_item(struct buf *j, const char *sb, const char *t, long long ws, long long ucr)
{
	char item[1024];

	snprintf(item, sizeof(item),
		 "%s{\"sb\":\"%s\",\"tenant\":\"%s\",\"node\":\"%s\",\"gen\":1,\"ws\":%lld,"
		 "\"we\":%lld,\"ps\":%lld,\"pe\":%lld,\"ucr\":%lld,\"cpu\":0,\"mem_bs\":0,\"rx\":0,"
		 "\"tx\":0,\"state\":\"running\",\"t\":%lld,\"cpu_at\":0,\"rx_at\":0,\"tx_at\":0,"
		 "\"rem\":0}",
		 j->len > 1 ? "," : "", sb, t, node, ws, ws + WINDOW, ws * S, (ws + WINDOW) * S, ucr,
		 (ws + WINDOW) * S);
	buf_appends(j, item);
}

struct held_grant {
	const char *tenant;
	long long seq;
	int64_t done_ms;
	enum kiln_err rc;
};

static void *held_grant_run(void *arg)
{
	struct held_grant *g = arg;
	char key[64];

	snprintf(key, sizeof(key), "test:held:%s", g->tenant);
	g->rc = do_grant(g->tenant, 5000, key, 0, &g->seq);
	g->done_ms = mono_ms();
	return NULL;
}

static void test_grant_waits_for_a_flush_holding_its_tenant(void)
{
	char t[32], sb[32];
	int64_t t0 = new_node();
	long long ws = t0 / S, live;
	struct kiln_error err = { 0 };
	struct held_grant g = { 0 };
	struct pg_conn *c;
	struct buf j;
	pthread_t th;
	int64_t commit_ms;

	new_tenant(t, sizeof(t));
	new_sandbox(t, sb, sizeof(sb), t0);
	buf_init(&j, 1 << 20);
	buf_appends(&j, "[");
	flush_item(&j, sb, t, ws, 1234);
	buf_appends(&j, "]");
	/* A flush drawing from the tenant, its transaction held open. */
	c = conn();
	CHECK_INT(pg_exec(c, "BEGIN", &err), KILN_OK);
	CHECK_INT(PGQ(c, NULL, &err, "SELECT meter_flush($1::jsonb, 'test')", j.data), KILN_OK);
	g.tenant = t;
	pthread_create(&th, NULL, held_grant_run, &g);
	usleep(700 * 1000);
	commit_ms = mono_ms();
	CHECK_INT(pg_exec(c, "COMMIT", &err), KILN_OK);
	pg_release(pg, c);
	pthread_join(th, NULL);
	buf_release(&j);
	CHECK_INT(g.rc, KILN_OK);
	/* The grant waited for the flush, and its transfer is after the flush's draw. */
	CHECK(g.done_ms >= commit_ms);
	CHECK(g.seq > sql_int("SELECT max(seq) FROM ledger_transfers WHERE tenant_id = '%s' "
			      "AND kind = 'usage'", t));
	CHECK_INT(ledger_bal(t), 5000 - 1234);
	CHECK_INT(redis_ledger(t, &live), 5000 - 1234);
}

struct granter {
	const char *tenant;
	int id, round, n;
	long long granted;
	int failed;
};

static void *granter_run(void *arg)
{
	struct granter *g = arg;
	char key[96];

	for (int i = 0; i < g->n; i++) {
		long long ucr = 100 + rand() % 1000;
		snprintf(key, sizeof(key), "test:race:%s:%d:%d:%d", g->tenant, g->id, g->round, i);
		if (do_grant(g->tenant, ucr, key, (unsigned)(rand() % 3000), NULL) == KILN_OK)
			g->granted += ucr;
		else
			g->failed++;
	}
	return NULL;
}

#define GRANTERS 4
#define RACE_ROUNDS 40

static void test_redis_is_the_ledger_after_every_flush_with_grants_racing(void)
{
	char t[32], sb[32], sb2[32];
	int64_t t0 = new_node();
	struct kiln_error err = { 0 };
	struct meter_opts o = {
		.node_id = node,
		.cgroup_root = "/nonexistent-cgroup-root",
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 900,
		.now_ns = fake_clock,
	};
	struct meter *m;
	long long granted = 0, live;
	int failed = 0, bad = 0;

	new_tenant(t, sizeof(t));
	if (do_grant(t, 10000000, "test:race:first", 0, NULL) != KILN_OK)
		test_case_failed = 1;
	granted = 10000000;
	new_sandbox(t, sb, sizeof(sb), t0);
	new_sandbox(t, sb2, sizeof(sb2), t0);
	price_card_init(&o.card, 1000, MIB_PRICE, 1, 1024);
	atomic_store(&fake_now, t0);
	m = meter_new(&o, pg, rds, &err);
	if (!m || meter_start(m, &err) != KILN_OK) {
		fprintf(stderr, "meter: %s\n", err.msg);
		test_case_failed = 1;
		return;
	}
	for (int round = 0; round < RACE_ROUNDS; round++) {
		struct granter gs[GRANTERS];
		pthread_t th[GRANTERS];

		for (int i = 0; i < GRANTERS; i++) {
			gs[i] = (struct granter){ .tenant = t, .id = i, .round = round, .n = 6 };
			pthread_create(&th[i], NULL, granter_run, &gs[i]);
		}
		/* One window of ticks, its flush among the grants. */
		for (int k = 0; k < WINDOW; k++) {
			atomic_fetch_add(&fake_now, S);
			if (meter_tick(m, &err) != KILN_OK)
				fprintf(stderr, "tick failed: %s\n", err.msg);
			usleep((useconds_t)(rand() % 2000));
		}
		for (int i = 0; i < GRANTERS; i++) {
			pthread_join(th[i], NULL);
			granted += gs[i].granted;
			failed += gs[i].failed;
		}
		/* Everything settled: Redis holds the ledger and the unflushed charges, exactly. */
		long long l = ledger_bal(t), r = redis_ledger(t, &live);
		if (r != l || live != meter_pending(m, t)) {
			fprintf(stderr, "round %d: redis ledger %lld live %lld, postgres %lld pending %lld\n",
				round, r, live, l, meter_pending(m, t));
			bad++;
		}
	}
	CHECK_INT(bad, 0);
	CHECK_INT(failed, 0);
	/* No grant lost: every one is in the ledger, and the balance is grants - usage. */
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
			  "WHERE tenant_id = '%s' AND kind = 'grant'", t), granted);
	CHECK_INT(ledger_bal(t), granted - sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM "
						   "ledger_transfers WHERE tenant_id = '%s' AND "
						   "kind = 'usage'", t));
	meter_free(m);
}

struct flusher {
	const char *items;
	pthread_barrier_t *go;
	enum kiln_err rc;
	char msg[256];
};

static void *flusher_run(void *arg)
{
	struct flusher *f = arg;
	struct kiln_error err = { 0 };
	struct pg_conn *c = conn();

	pthread_barrier_wait(f->go);
	f->rc = pg_exec(c, "BEGIN", &err);
	if (f->rc == KILN_OK)
		f->rc = PGQ(c, NULL, &err, "SELECT meter_flush($1::jsonb, 'test')", f->items);
	if (f->rc == KILN_OK)
		f->rc = pg_exec(c, "COMMIT", &err);
	if (f->rc != KILN_OK) {
		struct kiln_error ignore = { 0 };
		snprintf(f->msg, sizeof(f->msg), "%s", err.msg);
		pg_exec(c, "ROLLBACK", &ignore);
	}
	pg_release(pg, c);
	return NULL;
}

#define DEADLOCK_ROUNDS 20
#define ITEMS_PER_TENANT 300

static void test_opposite_order_flushes_never_deadlock(void)
{
	char a[32], b[32], sa1[32], sb1[32], sa2[32], sb2[32];
	int64_t t0 = new_node();
	long long ws0 = t0 / S - 100000, total = 0;
	int failed = 0;

	new_tenant(a, sizeof(a));
	new_tenant(b, sizeof(b));
	new_sandbox(a, sa1, sizeof(sa1), t0);
	new_sandbox(b, sb1, sizeof(sb1), t0);
	new_sandbox(a, sa2, sizeof(sa2), t0);
	new_sandbox(b, sb2, sizeof(sb2), t0);
	for (int round = 0; round < DEADLOCK_ROUNDS; round++) {
		struct buf j1, j2;
		struct flusher f1 = { 0 }, f2 = { 0 };
		pthread_barrier_t go;
		pthread_t th1, th2;

		/* Meter 1 sends a's windows then b's; meter 2 b's then a's. */
		buf_init(&j1, 1 << 20);
		buf_init(&j2, 1 << 20);
		buf_appends(&j1, "[");
		buf_appends(&j2, "[");
		for (int k = 0; k < ITEMS_PER_TENANT; k++) {
			long long ws = ws0 + (long long)(round * ITEMS_PER_TENANT + k) * WINDOW;
			flush_item(&j1, sa1, a, ws, 7);
			flush_item(&j2, sb2, b, ws, 11);
		}
		for (int k = 0; k < ITEMS_PER_TENANT; k++) {
			long long ws = ws0 + (long long)(round * ITEMS_PER_TENANT + k) * WINDOW;
			flush_item(&j1, sb1, b, ws, 13);
			flush_item(&j2, sa2, a, ws, 17);
		}
		buf_appends(&j1, "]");
		buf_appends(&j2, "]");
		total += ITEMS_PER_TENANT * (7 + 11 + 13 + 17);
		pthread_barrier_init(&go, NULL, 2);
		f1.items = j1.data;
		f2.items = j2.data;
		f1.go = f2.go = &go;
		pthread_create(&th1, NULL, flusher_run, &f1);
		pthread_create(&th2, NULL, flusher_run, &f2);
		pthread_join(th1, NULL);
		pthread_join(th2, NULL);
		pthread_barrier_destroy(&go);
		buf_release(&j1);
		buf_release(&j2);
		if (f1.rc != KILN_OK || f2.rc != KILN_OK) {
			fprintf(stderr, "round %d: %s / %s\n", round, f1.msg, f2.msg);
			failed++;
		}
	}
	CHECK_INT(failed, 0);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
			  "WHERE tenant_id IN ('%s', '%s') AND kind = 'usage'", a, b),
		  total);
}

/* The fixture's socket directory, to open a pool on the scratch database. */
static int pool_open(const struct testdb *db)
{
	const char *envf = getenv("KILN_SERVICES_ENV");
	char line[512], sockdir[512] = "", url[700];
	FILE *f = envf ? fopen(envf, "r") : NULL;

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = '\0';
		if (!strncmp(line, "KILN_TEST_SOCKDIR=", 18))
			snprintf(sockdir, sizeof(sockdir), "%s", line + 18);
	}
	fclose(f);
	snprintf(url, sizeof(url), "host=%s user=kiln dbname=%s", sockdir, db->name);
	pg = pg_new(url, POOL);
	return pg ? 0 : -1;
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_ledger_locks", KLOG_WARN, false);
	if (testdb_open(&db, "locks") != 0 || pool_open(&db) != 0)
		return 1;
	rds = rds_new(db.redis_url, 2000);

	TEST(test_grant_waits_for_a_flush_holding_its_tenant);
	TEST(test_redis_is_the_ledger_after_every_flush_with_grants_racing);
	TEST(test_opposite_order_flushes_never_deadlock);

	rc = test_summary();
	rds_free(rds);
	pg_free(pg);
	testdb_close(&db);
	return rc;
}
