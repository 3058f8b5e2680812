/*
 * test_meter.c - kiln-meter's engine (metering/meter.h) driven tick by tick with an injected
 * clock, against the real Postgres and Redis of the ctest fixture "services" (each run makes its
 * own database). No cgroups: sandboxes are rows whose allocation is billed by time, which makes
 * every expected figure exact. Covers exact charges with carried remainders, one Redis round
 * trip per tick, the Lua debit and the balance it answers, the ledger/Redis agreement after a
 * flush, the rebuild after Redis loses a balance, a restarted meter catching up without charging
 * twice, earliest-expiry draws, expiry as a transfer, and the pause asked on the tick that
 * crosses zero (billing goes on into debt until it lands: test_debt.c).
 */
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "metering/billing.h"
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
static int64_t fake_now, fake_mono;
static const char *boot;	/* the meters' boot id (meter_opts.boot_id); NULL: none */
static long long snap_price = 1024;	/* the meters' snapshot price, µcr per GiB-s */
static int row_age_s;	/* told_gap_start_with()'s row: written this long ago (0: now) */
static int row_mono_age_s = -1;	/* and told this long ago on its boot's monotonic clock (-1: no boot) */

static int64_t fake_mono_clock(void *ctx)
{
	(void)ctx;
	return fake_mono;
}

#include "meterdb.h"

/* (fine units) of 257 µcr/s over `ns` ns, as price.c computes it */
static unsigned __int128 fine_of(int64_t ns)
{
	return (unsigned __int128)256 * (uint64_t)ns * MIB_PRICE +
	       (unsigned __int128)1 * 1024 * (uint64_t)ns * 1;
}

static char paused[64][64];
static int npaused;

static void on_pause(void *ctx, const char *sb, const char *t)
{
	(void)ctx;
	(void)t;
	if (npaused < 64)
		snprintf(paused[npaused++], sizeof(paused[0]), "%s", sb);
}

/*
 * A meter of the current node on the fake wall clock; with `mono`, on the fake monotonic clock
 * too (else the wall clock stands for both). `live_ttl_s` 0 for the default.
 */
static struct meter *new_meter_with(bool mono, int64_t live_ttl_s)
{
	struct kiln_error err = { 0 };
	struct meter_opts o = {
		.node_id = node,
		.cgroup_root = "/nonexistent-cgroup-root",
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 900,
		.now_ns = fake_clock,
		.mono_ns = mono ? fake_mono_clock : NULL,
		.boot_id = boot,
		.live_ttl_s = live_ttl_s,
		.pause = on_pause,
	};
	struct meter *m;

	price_card_init(&o.card, 1000, MIB_PRICE, 1, snap_price);
	m = meter_new(&o, pg, rds, &err);
	if (!m || meter_start(m, &err) != KILN_OK) {
		fprintf(stderr, "meter: %s\n", err.msg);
		exit(1);
	}
	return m;
}

static struct meter *new_meter(void)
{
	return new_meter_with(false, 0);
}

/* One fake second on both clocks, then a tick that must succeed. */
static void tick_both(struct meter *m)
{
	struct kiln_error err = { 0 };

	fake_now += S;
	fake_mono += S;
	CHECK_INT(meter_tick(m, &err), KILN_OK);
}

/* tick_both() of `m`, or with no meter (NULL: down) one fake second on both clocks. */
static void tick_if(struct meter *m)
{
	if (m) {
		tick_both(m);
		return;
	}
	fake_now += S;
	fake_mono += S;
}

/* The µcr the ledger holds for generation `gen` of `sb`, all its windows. */
static long long gen_ucr(const char *sb, int gen)
{
	return sql_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows WHERE sandbox_id = '%s' "
		       "AND generation = %d", sb, gen);
}

/* A tenant with credits and a running sandbox of it since t0, both clocks at t0. */
static void clock_case(char *t, size_t tn, char *sb, size_t sbn, int64_t t0)
{
	new_tenant(t, tn);
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb, sbn, t0);
	fake_now = t0;
	fake_mono = 5000 * S;
}

/*
 * The row of a pause snapshot `snap` of `sb` of `t`, `mib` MiB, made at `at` (ns) in the
 * sandbox's current generation, as node/lifecycle.c's snap_record_public() writes it.
 */
static void snap_row(const char *t, const char *sb, const char *snap, long long mib, int64_t at)
{
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, "
	    "vcpu_milli, memory_mib, disk_gib, created_at, generation) SELECT '%s_%s', '%s', s.id, "
	    "'%s', 'pause', %lld, 1000, 256, 1, to_timestamp(%lld / 1e6), s.generation "
	    "FROM sandboxes s WHERE s.id = '%s'",
	    snap, sb, t, node, mib << 20, (long long)(at / 1000), sb);
}

/* `sb` of `t` paused at the fake now into a pause snapshot `snap` of `mib` MiB made then. */
static void pause_into(const char *t, const char *sb, const char *snap, long long mib)
{
	snap_row(t, sb, snap, mib, fake_now);
	sql("UPDATE sandboxes SET state = 'paused', pause_snapshot = '%s_%s', "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    snap, sb, (long long)(fake_now / 1000), sb);
}

/* `sb` resumed from its pause at the fake now, in the same generation. */
static void resume(const char *sb)
{
	sql("UPDATE sandboxes SET state = 'running', pause_snapshot = NULL, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)(fake_now / 1000), sb);
}

/*
 * A case of a sandbox moved between two nodes: a tenant `t` with credits, its sandbox `sb` running
 * on node `na` since t0 (the fake wall clock at t0, the monotonic one at 5,000 s), the meter `a`
 * of `na` and `b` of a second node `nb`, both new_meter_with(mono, live_ttl_s); `node` is left at
 * `na`. The case frees the meters it still holds.
 */
struct two_nodes {
	char t[32], sb[32], na[32], nb[32];
	struct meter *a, *b;
};

static void two_nodes_start(struct two_nodes *c, int64_t t0, bool mono, int64_t live_ttl_s)
{
	new_tenant(c->t, sizeof(c->t));
	grant(c->t, 1000000000LL, 0, "a");
	new_sandbox(c->t, c->sb, sizeof(c->sb), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	snprintf(c->na, sizeof(c->na), "%s", node);
	c->a = new_meter_with(mono, live_ttl_s);
	(void)aligned_now();	/* node B */
	snprintf(c->nb, sizeof(c->nb), "%s", node);
	c->b = new_meter_with(mono, live_ttl_s);
	snprintf(node, sizeof(node), "%s", c->na);
}

/* `sb` moved to node `to` at `at` (ns): a new generation there, in the same UPDATE (0043). */
static void move_to(const char *sb, const char *to, int64_t at)
{
	sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    to, (long long)(at / 1000), sb);
}

/*
 * More changes in one tick than a tick bills pieces (PIECES_MAX, 64): the sandbox, running from
 * 0, is paused and resumed 40 times between the ticks at 10 and 11 s, 10 ms apart (80 changes,
 * each resume a new generation, each pause into a snapshot of 128 MiB), and stops at 20. The
 * tick bills the pieces it holds and leaves the rest to the next, from where it stopped: 19.6 s
 * running and 0.4 s paused, each once (20 pairs, under the limit: 5,114 µcr, 19.8 and 0.2 s).
 */
static void test_more_changes_than_a_ticks_pieces_are_billed_over_two_ticks(void)
{
	char t[32], sb[32], snap[16];
	int64_t t0 = aligned_now();
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter();
	tick_until(m, t0 + 10 * S);
	for (int k = 0; k < 40; k++) {
		fake_now = t0 + 10 * S + (int64_t)(2 * k) * (S / 100);
		snprintf(snap, sizeof(snap), "snap%d", k);
		pause_into(t, sb, snap, 128);
		fake_now += S / 100;
		sql("UPDATE sandboxes SET state = 'running', generation = generation + 1, "
		    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
		    (long long)(fake_now / 1000), sb);	/* resumed: a new generation */
	}
	fake_now = t0 + 10 * S;
	tick_until(m, t0 + 20 * S);
	stop_sandbox(sb, t0 + 20 * S);
	tick_until(m, t0 + 32 * S);
	/* 257 x 19.6 + 128 x 0.4 = 5,037.2 + 51.2 */
	CHECK_INT(used(t), 5088);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

static void test_charge_is_exact_over_injected_time(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	unsigned __int128 f = fine_of(20 * S + S / 4);
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0 + S / 4);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 20 * S);
	stop_sandbox(sb, t0 + 20 * S + S / 2);	/* ran 20.25 s */
	tick_until(m, t0 + 32 * S);
	CHECK_INT(used(t), (long long)(f / PRICE_FINE_PER_UCR));
	CHECK_INT(used(t), 5204);	/* 257 x 20.25 = 5204.25 */
	CHECK_INT(sql_int("SELECT remainder_fine FROM meter_sandboxes WHERE sandbox_id = '%s'", sb),
		  (long long)(f % PRICE_FINE_PER_UCR));
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none'", sb), 1);
	/* Windows aligned to 10 s, each with its own idempotency key. */
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s'", sb), 3);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE sandbox_id = '%s' AND "
			  "idem_key = 'usage:' || sandbox_id || ':1:' || "
			  "extract(epoch FROM period_start)::bigint / 10 * 10", sb), 3);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE sandbox_id = '%s' AND "
			  "rate_card = 'cpu1000-mem1024-disk1-snap1024'", sb), 3);
	meter_free(m);
}

static void test_paused_sandbox_pays_its_snapshot_only(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 5 * S);
	/* Paused half-way through a tick, into a snapshot of 512 MiB: 512 µcr/s from then on. */
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib) VALUES ('snap_%s', '%s', '%s', '%s', 'pause', %lld, 1000, 256, 1);"
	    "UPDATE sandboxes SET state = 'paused', pause_snapshot = 'snap_%s', "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    sb, t, sb, node, 512LL << 20, sb, (long long)((t0 + 5 * S + S / 2) / 1000), sb);
	tick_until(m, t0 + 20 * S);
	stop_sandbox(sb, t0 + 20 * S + S / 2);
	tick_until(m, t0 + 31 * S);
	/* 5.5 s running at 257, 15 s paused at 512 */
	CHECK_INT(used(t), 1413 + 7680);
	meter_free(m);
}

static void test_one_redis_round_trip_per_tick_for_many_sandboxes(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter_stats st;
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	for (int i = 0; i < 100; i++)
		new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 25 * S);
	meter_get_stats(m, &st);
	CHECK_INT(st.ticks, 25);
	CHECK_INT(st.redis_tick_calls, 25);
	/* + the start's reset, one rebuild of the new tenant's balance, one move per flush */
	CHECK(st.redis_calls <= st.ticks + st.flushes + 3);
	CHECK_INT(st.sandboxes, 100);
	CHECK_INT(used(t), 100LL * 257 * 20);
	meter_free(m);
}

static void test_ledger_redis_and_api_balance_agree_after_flush(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct billing_balance b;
	struct pg_conn *c;
	struct meter *m;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 20 * S);	/* the flush of [10, 20) just ran: nothing pending */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(ledger_bal(t), 1000000 - 20 * 257);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK(ok);
	c = conn();
	CHECK_INT(billing_balance(rds, c, t, &b, &err), KILN_OK);
	pg_release(pg, c);
	CHECK_INT(b.balance_ucr, ledger_bal(t));
	CHECK_INT(b.used_ucr, 20 * 257);
	CHECK_INT(b.granted_ucr, 1000000);
	/* Mid-window the live part carries what the ledger does not have yet. */
	tick_until(m, t0 + 24 * S);
	CHECK_INT(meter_pending(m, t), 4 * 257);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t) - 4 * 257);
	stop_sandbox(sb, t0 + 24 * S);
	tick_until(m, t0 + 31 * S);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(used(t), 24 * 257);
	meter_free(m);
}

static void test_balance_rebuilt_after_redis_loses_it(void)
{
	char t[32], sb[32], key[128];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *m;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 14 * S);
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", t);
	RDS(rds, NULL, &err, "DEL", key);	/* as after a restart without data */
	redis_bal(t, &ok);
	CHECK(!ok);
	tick_until(m, t0 + 15 * S);
	CHECK_INT(redis_bal(t, &ok), 1000000 - 15 * 257);
	CHECK(ok);
	tick_until(m, t0 + 20 * S);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(ledger_bal(t), 1000000 - 20 * 257);
	stop_sandbox(sb, t0 + 20 * S);
	tick_until(m, t0 + 31 * S);
	meter_free(m);
}

static void test_restarted_meter_catches_up_without_charging_twice(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now() - 200 * S;
	unsigned __int128 f = fine_of(178 * S + S / 2 - S / 4);
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0 + S / 4);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 15 * S);	/* [0, 10) flushed, 5 s pending */
	CHECK_INT(used(t) > 0, 1);
	meter_free(m);			/* dies: its pending charges are lost with it */
	fake_now = t0 + 90 * S;		/* down for 75 s */
	m = new_meter();
	tick_until(m, t0 + 178 * S);
	stop_sandbox(sb, t0 + 178 * S + S / 2);
	tick_until(m, t0 + 195 * S);
	CHECK_INT(used(t), (long long)(f / PRICE_FINE_PER_UCR));
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s'", sb), 18);
	/* A replay of a flushed window charges nothing: the same meter_flush() again. */
	{
		long long before = used(t);
		CHECK_INT(sql_int("SELECT meter_flush(jsonb_build_array(jsonb_build_object('sb', '%s', "
				  "'tenant', '%s', 'node', '%s', 'gen', 1, 'ws', %lld, 'we', %lld, "
				  "'ps', %lld, 'pe', %lld, 'ucr', 2570, 'cpu', 0, 'mem_bs', 0, 'rx', 0, "
				  "'tx', 0, 'state', 'running', 't', %lld, 'cpu_at', 0, 'rx_at', 0, "
				  "'tx_at', 0, 'rem', 0)), 'x')",
				  sb, t, node, (long long)(t0 / S + 20), (long long)(t0 / S + 30),
				  (long long)(t0 + 20 * S), (long long)(t0 + 30 * S),
				  (long long)(t0 + 30 * S)),
			  0);
		CHECK_INT(used(t), before);
	}
	meter_free(m);
}

static void test_usage_drawn_from_grants_earliest_expiry_first(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 100, t0 / S + 1000, "late");
	grant(t, 200, t0 / S + 500, "early");
	grant(t, 100000, 0, "never");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 2 * S);
	stop_sandbox(sb, t0 + 2 * S);
	tick_until(m, t0 + 11 * S);
	/* 514 µcr: 200 from the earliest expiry, 100 from the next, 214 from the one that never
	 * expires; one transfer each, keys usage:…, usage:…:2, usage:…:3. */
	CHECK_INT(sql_int("SELECT amount_ucr FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'usage' AND debit_account = 'grant:tx_%s_early'", t, t), 200);
	CHECK_INT(sql_int("SELECT amount_ucr FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'usage' AND debit_account = 'grant:tx_%s_late'", t, t), 100);
	CHECK_INT(sql_int("SELECT amount_ucr FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'usage' AND debit_account = 'grant:tx_%s_never'", t, t), 214);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "idem_key LIKE 'usage:%%:3'", t), 1);
	CHECK_INT(ledger_bal(t), 100300 - 514);
	meter_free(m);
}

static void test_grant_expiry_is_a_transfer(void)
{
	char t[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 700, t0 / S + 5, "soon");
	grant(t, 300, 0, "never");
	fake_now = t0;
	m = new_meter();
	/* Not before two windows have passed since its time (meter_expire()): 5 s + 20 s. */
	tick_until(m, t0 + 22 * S);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'expiry'", t), 0);
	tick_until(m, t0 + 32 * S);
	CHECK_INT(sql_int("SELECT amount_ucr FROM ledger_transfers WHERE tenant_id = '%s' AND "
			  "kind = 'expiry' AND idem_key = 'expiry:grant:tx_%s_soon'", t, t), 700);
	CHECK_INT(ledger_bal(t), 300);
	/* Redis follows (the balance was there from the first admit or tick). */
	(void)redis_bal(t, &ok);
	if (ok)
		CHECK_INT(redis_bal(t, &ok), 300);
	meter_free(m);
}

static void test_zero_balance_pauses_within_a_tick_and_overdraft_is_one_tick(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	int asked_at = 0;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000, 0, "a");	/* 3.9 seconds of a 257 µcr/s sandbox */
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter();
	for (int i = 1; i <= 12 && !asked_at; i++) {
		tick_until(m, t0 + i * S);
		if (npaused)
			asked_at = i;
	}
	CHECK_INT(asked_at, 4);	/* the tick that took the balance to 1000 - 1028 */
	CHECK(npaused >= 1 && !strcmp(paused[0], sb));
	/* It has not paused (no node here): it is charged on, into debt (test_debt.c). */
	tick_until(m, t0 + 25 * S);
	CHECK_INT(used(t) + meter_pending(m, t), 25 * 257);
	CHECK_INT(1000 - used(t) - meter_pending(m, t), 1000 - 25 * 257);
	CHECK(redis_bal(t, &ok) <= 0);
	/* Asked again after a while, never destroyed. */
	CHECK(npaused >= 2);
	meter_free(m);
}

/*
 * A sandbox paused at zero and resumed (a new generation) while its tenant is still at zero is
 * asked to pause again at once, not 10 s after the first request: the wait is for a pause that
 * did not happen (kiln-sim `pg,zero,...`, seed 883738573: a sandbox paused at 285 s, resumed at
 * 289 s, its tenant at zero from 290 s, was asked again at 295 s, 5 s at zero against 4).
 */
static void test_a_resumed_sandbox_at_zero_is_asked_to_pause_again_at_once(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000, 0, "a");	/* 3.9 seconds of a 257 µcr/s sandbox */
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	npaused = 0;
	m = new_meter();
	tick_until(m, t0 + 4 * S);
	CHECK_INT(npaused, 1);	/* at 4 */
	pause_into(t, sb, "snap_z", 256);	/* at 4 */
	tick_until(m, t0 + 6 * S);
	sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)((fake_now + S / 2) / 1000), sb);	/* resumed at 6.5 */
	tick_until(m, t0 + 7 * S);
	CHECK_INT(npaused, 2);	/* at 7, not 14 */
	stop_sandbox(sb, fake_now);
	tick_until(m, t0 + 21 * S);
	meter_free(m);
}

/*
 * The wall clock steps an hour ahead, then two hours back, while monotonic time goes on a second
 * a tick: what is charged is the monotonic time the sandbox ran (the tick that sees the forward
 * step a second behind, the next caught up), ticks go on after the backward step, and a grant
 * whose wall-clock date the forward step reached expires.
 */
static void test_clock_steps_bill_monotonic_time_only(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *m;
	int secs = 0;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	grant(t, 1000000LL, t0 / S + 1800, "halfhour");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	m = new_meter_with(true, 0);
	for (int phase = 0; phase < 3; phase++) {
		if (phase == 1)
			fake_now += 3600 * S;
		if (phase == 2)
			fake_now -= 7200 * S;
		for (int i = 0; i < (phase == 1 ? 32 : 12); i++) {
			fake_now += S;
			fake_mono += S;
			secs++;
			CHECK_INT(meter_tick(m, &err), KILN_OK);
			/* the tick that sees the forward step bills up to the second before it */
			CHECK_INT(used(t) + meter_pending(m, t), (secs - (phase == 1 && i == 0)) * 257LL);
		}
		if (phase == 1)	/* the forward step passed the grant's date: two windows on, it expired */
			CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' "
					  "AND kind = 'expiry'", t), 1);
	}
	stop_sandbox(sb, fake_now);	/* on the (stepped) wall clock, as the node records it */
	for (int i = 0; i < 12; i++)
		tick_both(m);
	CHECK_INT(used(t), 56 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A meter restarted on the same host after a backward step of the wall clock goes on in the frame
 * its node's last flush saved (meter_clocks: the label clock at a point of the monotonic clock),
 * so the node's timestamps keep their place (kiln-sim `clock`, seed 9102). Before, it started
 * at the ledger's newest billed-up-to point, 9 s behind, and read the sandbox's end 9 s early:
 * 16 s billed of 25.
 */
static void test_meter_restarted_after_a_backward_step_keeps_its_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 40; i++) {
		if (i == 13)
			fake_now -= 3600 * S;	/* the wall clock steps back an hour */
		if (i == 19) {			/* a crash at 18 ([0, 10) flushed) and a restart */
			meter_free(m);
			m = new_meter_with(true, 0);
		}
		if (i == 26)
			stop_sandbox(sb, fake_now);	/* at 25, on the stepped wall clock */
		tick_both(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 25 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A meter restarted across a forward step of the wall clock made while it was down (after a
 * backward one) places the changes logged before that step in the frame then in force (the
 * offset its node's last flush saved) and moves them on by the step, as it moves the ledger's
 * points (kiln-sim `clock`, seed 9119: a sandbox created while its node's meter was down, just
 * before a 2,918 s forward step, was billed from its creation read in the new frame, the step
 * with it, +2,194,336 µcr). Here the sandbox created during the outage would be billed from 900 s
 * before its creation (1,000 s more), or, without the saved offset, 100 s early.
 */
static void test_a_change_logged_before_a_forward_step_moves_on_with_it(void)
{
	char t[32], sb[32], sb1[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-fwd";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* the wall clock steps back 100 s */
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 31)
			new_sandbox(t, sb1, sizeof(sb1), fake_now);	/* at 30, no meter */
		if (i == 36)
			fake_now += 1000 * S;	/* at 35, the wall clock steps forward 1,000 s */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 */
		if (i == 51) {
			stop_sandbox(sb, fake_now);	/* both end at 50 */
			stop_sandbox(sb1, fake_now);
		}
		tick_if(m);
	}
	boot = NULL;
	/* sb 50 s (the outage's 20 s billed at the restart), sb1 20 s */
	CHECK_INT(used(t), (50 + 20) * 257);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

/*
 * A meter that starts in its node's clock frame saved after a forward step (another meter of the
 * node followed the step and flushed) keeps that step as one it followed: a point of the ledger
 * from before it moves on by it (meter_clocks.step_*, migrations/0042). Kiln-sim `clock`, seed
 * 150252085: a meter restarted a second after a 3,160 s step, in the frame after it, read a
 * paused sandbox's point from before it and billed the step as paused time, +588,657 µcr. Here
 * the meter flushes the window up to the step in the frame after it and crashes before its next
 * flush; the restarted one billed the step as running time before (1,034 s for 40).
 */
static void test_a_meter_started_in_the_frame_after_a_forward_step_does_not_bill_it(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-fwd-frame";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		if (i == 15)
			fake_now += 1000 * S;	/* at 14, the wall clock steps forward 1,000 s */
		if (i == 19) {			/* a crash at 18, a restart */
			meter_free(m);
			m = new_meter_with(true, 0);
		}
		if (i == 41)
			stop_sandbox(sb, fake_now);	/* at 40, on the stepped wall clock */
		tick_both(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 40 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A grant's expiry passed by a forward step of the wall clock waits two windows after the step
 * lands, as one not passed waits two windows after its time: the windows before the step, which
 * started before the expiry, are flushed by every meter after the step, and draw from the grant
 * (kiln-sim `clock`, seed 9143: the expiry ran at the step's first tick, and another node's window
 * before it, flushed a moment later, was drawn from the overdraft, the tenant's debt). Here two
 * meters of two nodes tick in turn, the first expires, and the second's window from before the
 * step was drawn from the overdraft.
 */
static void test_an_expiry_passed_by_a_forward_step_waits_for_the_windows_before_it(void)
{
	char t[32], sb[32], sb1[32], node0[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *m0, *m1;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, t0 / S + 30, "soon");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	m0 = new_meter_with(true, 0);
	snprintf(node0, sizeof(node0), "%s", node);
	(void)aligned_now();	/* a second node */
	new_sandbox(t, sb1, sizeof(sb1), t0);
	m1 = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == 26)
			fake_now += 1000 * S;	/* at 25, the wall clock steps 1,000 s ahead */
		if (i == 51) {
			stop_sandbox(sb, fake_now);
			stop_sandbox(sb1, fake_now);
		}
		fake_now += S;
		fake_mono += S;
		CHECK_INT(meter_tick(m0, &err), KILN_OK);
		CHECK_INT(meter_tick(m1, &err), KILN_OK);
	}
	/* both ran 25 s before the step, from the grant; the expiry took the rest */
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE tenant_id = '%s' AND kind = "
			  "'usage' AND period_start < to_timestamp(%lld) AND debit_account NOT LIKE "
			  "'grant:%%'", t, (long long)(t0 / S + 30)), 0);
	CHECK_INT(sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
			  "tenant_id = '%s' AND kind = 'expiry'", t), 1000000 - 2 * 25 * 257);
	CHECK_INT(used(t), 2 * 50 * 257);
	meter_free(m1);
	meter_free(m0);
	snprintf(node, sizeof(node), "%s", node0);
}

/*
 * A state change applied once is never applied again, whatever its time reads: after a backward
 * step of the wall clock, the changes logged before it carry times that, shifted by the step,
 * fall after the billed-up-to point (kiln-sim `clock`, seed 9108: a moved sandbox's first
 * generation's rows read again 156 s on, its second generation's paused time billed at nothing
 * from there, -5,891 µcr). Here the creation's `running` row would come back 100 s on and bill
 * the paused sandbox as running.
 */
static void test_changes_before_a_backward_step_are_not_applied_again(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 140; i++) {
		if (i == 11)
			fake_now -= 100 * S;	/* at 10, the wall clock steps back 100 s */
		if (i == 21)			/* at 20, paused into a snapshot of 512 MiB */
			sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, "
			    "size_bytes, vcpu_milli, memory_mib, disk_gib) VALUES ('snap_%s', '%s', "
			    "'%s', '%s', 'pause', %lld, 1000, 256, 1);"
			    "UPDATE sandboxes SET state = 'paused', pause_snapshot = 'snap_%s', "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    sb, t, sb, node, 512LL << 20, sb, (long long)(fake_now / 1000), sb);
		if (i == 121)
			stop_sandbox(sb, fake_now);	/* at 120 */
		tick_both(m);
	}
	/* 20 s running at 257, 100 s paused at 512 */
	CHECK_INT(used(t), 20 * 257 + 100 * 512);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

/*
 * A sandbox whose end is in the ledger is not billed again when a backward step of the wall
 * clock makes it read as changed lately: the meter tracks it again from the ledger's point (its
 * end), and every change of that generation is in it, whatever its time reads (kiln-sim
 * `clock`, seed 9110: sandboxes deleted before a 394 s backward step billed again from their
 * creation 394 s on, +21,070 to +60,317 µcr). Here the sandbox's 20 s would be billed twice.
 */
static void test_an_ended_sandbox_is_not_billed_again_after_a_backward_step(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 200; i++) {
		if (i == 21)
			stop_sandbox(sb, fake_now);	/* at 20 */
		if (i == 41)
			fake_now -= 100 * S;	/* at 40 ([10, 20) and its end flushed) */
		tick_both(m);
	}
	CHECK_INT(used(t), 20 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

/*
 * A change logged before a backward step of the wall clock and read after it is placed in the
 * frame in force when it was logged, not 100 s on in the new one (kiln-sim `clock`, seed 9110: a
 * boot logged just before a 394 s step was read 394 s on, the pause 14 s later came first, and
 * the running time between was billed as creating, -36,358 µcr). Here the pause would be
 * applied 100 s late: 100 s more running, 100 s less paused.
 */
static void test_a_change_logged_before_a_backward_step_keeps_its_time(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 200; i++) {
		if (i == 11) {	/* at 10, paused into 512 MiB; then the wall clock steps back 100 s */
			sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, "
			    "size_bytes, vcpu_milli, memory_mib, disk_gib) VALUES ('snap_%s', '%s', "
			    "'%s', '%s', 'pause', %lld, 1000, 256, 1);"
			    "UPDATE sandboxes SET state = 'paused', pause_snapshot = 'snap_%s', "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    sb, t, sb, node, 512LL << 20, sb, (long long)(fake_now / 1000), sb);
			fake_now -= 100 * S;
		}
		if (i == 151)
			stop_sandbox(sb, fake_now);	/* at 150 */
		tick_both(m);
	}
	/* 10 s running at 257, 140 s paused at 512 */
	CHECK_INT(used(t), 10 * 257 + 140 * 512);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

/* One fake second on both clocks, then a tick whose Postgres may be away (its outcome unchecked). */
static void tick_maybe(struct meter *m)
{
	struct kiln_error err = { 0 };

	fake_now += S;
	fake_mono += S;
	(void)meter_tick(m, &err);
}

/*
 * A sandbox's changes are applied in the order they were logged (`seq`), not by their times: a
 * change logged after a backward step of the wall clock reads earlier than those logged before
 * it (kiln-sim `clock`, seed 9120: two sandboxes that ran on a node whose meter had no Postgres,
 * moved, and ended after a 3,186 s backward step were read with their end first, and their
 * first generation was charged nothing of 43,077 and 54,835 µcr). Here the meter, without
 * Postgres across a sandbox's start, a 100 s backward step and its end, reads all three at once
 * (from the point of another sandbox it bills all along): by time the end came first and the
 * 20 s it ran were billed nothing.
 */
static void test_changes_across_a_backward_step_apply_in_log_order(void)
{
	char t[32], sb[32], sb0[32];
	int64_t t0 = aligned_now();
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb0, sizeof(sb0), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		if (i == 4)
			meter_set_backends(m, dead, rds);
		if (i == 6)
			new_sandbox(t, sb, sizeof(sb), fake_now);	/* at 5 */
		if (i == 16)
			fake_now -= 100 * S;	/* at 15, the wall clock steps back 100 s */
		if (i == 26)
			stop_sandbox(sb, fake_now);	/* at 25, on the stepped wall clock */
		if (i == 31)
			meter_set_backends(m, pg, rds);
		if (i == 41)
			stop_sandbox(sb0, fake_now);	/* at 40 */
		if (i < 31)
			tick_maybe(m);
		else
			tick_both(m);
	}
	CHECK_INT(used(t), (20 + 40) * 257);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
	pg_free(dead);
}

/*
 * A sandbox of a tenant of its own, running from now, and a meter with no Postgres from its
 * fourth tick to its `pg_back`th: `at(i, ...)` runs before each of its 60 ticks (a second each),
 * the sandbox stops at 40; the tenant must have used `want` µcr, nothing left pending.
 */
static void run_without_pg(int pg_back, void (*at)(int i, const char *t, const char *sb),
			   long long want)
{
	char t[32], sb[32];
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), aligned_now());
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		if (i == 4)
			meter_set_backends(m, dead, rds);
		at(i, t, sb);
		if (i == pg_back)
			meter_set_backends(m, pg, rds);
		if (i == 41)
			stop_sandbox(sb, fake_now);	/* at 40 */
		if (i < pg_back)
			tick_maybe(m);
		else
			tick_both(m);
	}
	CHECK_INT(used(t), want);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
	pg_free(dead);
}

/*
 * A generation that paused and was resumed while its meter had no Postgres is billed at its own
 * pause snapshot's size, the newest made before the next generation's first change in the log's
 * order, not before the earliest time a later change reads: after a backward step of the wall
 * clock, the next generation's pause reads earlier than the snapshot (kiln-sim `clock`, seed
 * 9120: a moved generation's paused time billed at the guest's memory, +1,683 µcr, and another's
 * at the next generation's snapshot, -1,106). Here the 5 s paused into 512 MiB were billed at
 * the guest's 256.
 */
static void snapshot_across_a_backward_step(int i, const char *t, const char *sb)
{
	if (i == 6)
		pause_into(t, sb, "snap_a", 512);	/* at 5 */
	if (i == 11)	/* at 10, resumed: a new generation */
		sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
		    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
		    (long long)(fake_now / 1000), sb);
	if (i == 16)
		fake_now -= 100 * S;	/* at 15, the wall clock steps back 100 s */
	if (i == 21)
		pause_into(t, sb, "snap_b", 128);	/* at 20 */
}

static void test_a_paused_generation_keeps_its_snapshot_across_a_backward_step(void)
{
	/* 5 s running, 5 s paused at 512, 10 s running, 20 s paused at 128 */
	run_without_pg(31, snapshot_across_a_backward_step, 15 * 257 + 5 * 512 + 20 * 128);
}

/*
 * An ended generation's pause snapshot is the one recorded with that generation, not the newest
 * made before the next generation's first change: after a backward step of the wall clock
 * between the pause and the resume, the resume reads earlier than the snapshot (kiln-sim
 * `clock`, seed 627238415: a generation paused into a smaller snapshot, resumed on another node
 * after a 3,407 s backward step while its meter was down, had its tail billed at the guest's
 * memory, +553 µcr). Here a meter restarted after the resume billed 5 s paused into 512 MiB at
 * the guest's 256.
 */
static void test_an_ended_generations_snapshot_is_found_across_a_backward_step(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-snap";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 45; i++) {
		if (i == 6)
			pause_into(t, sb, "snap_a", 512);	/* at 5 */
		if (i == 11)
			fake_now -= 100 * S;	/* at 10, the wall clock steps back 100 s */
		if (i == 13)
			meter_free(m);	/* a crash at 12, [0, 10) flushed */
		if (i == 16)	/* at 15, resumed: a new generation */
			sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), sb);
		if (i == 21)
			m = new_meter_with(true, 0);	/* restarted at 20 */
		if (i == 31)
			stop_sandbox(sb, fake_now);	/* at 30 */
		if (i >= 13 && i < 21) {
			fake_now += S;
			fake_mono += S;
		} else {
			tick_both(m);
		}
	}
	boot = NULL;
	/* 5 s running, 10 s paused at 512, 15 s running */
	CHECK_INT(used(t), 20 * 257 + 10 * 512);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

/*
 * A pause as kiln-node records it: the vCPUs' stop logged first (record_vcpus_stopped()), the
 * snapshot's row half a second later, with the pause itself at the stop's time (pause_record()).
 * The sandbox runs from 0, is paused at 5 into 512 MiB and resumed at 15 on node `other`, where
 * it stops at 30; this node's meter, `crash` true, crashes at 12 and is restarted at 20, else has
 * no Postgres from 3 to 20. Its generation here must be billed 5 s running and 10 s paused at
 * the snapshot's size: its snapshot found by the time of its pause row (earlier than the
 * snapshot's) would be none, the paused time after the meter's last look at the row billed at
 * the guest's 256 MiB.
 */
static void snapshot_after_its_pause_row(bool crash)
{
	char t[32], sb[32], other[32];
	int64_t t0 = aligned_now();
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;

	snprintf(other, sizeof(other), "%s", node);
	t0 = aligned_now();	/* this node */
	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 45; i++) {
		if (i == 4 && !crash)
			meter_set_backends(m, dead, rds);
		if (i == 6) {	/* at 5, the vCPUs stop; the snapshot is written by 5.5 */
			sql("INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id, "
			    "cpu_ns) SELECT id, generation, 'paused', to_timestamp(%lld / 1e6), node_id, 0 "
			    "FROM sandboxes WHERE id = '%s'",
			    (long long)(fake_now / 1000), sb);
			snap_row(t, sb, "snap_a", 512, fake_now + S / 2);
			sql("UPDATE sandboxes SET state = 'paused', pause_snapshot = 'snap_a_%s', "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    sb, (long long)(fake_now / 1000), sb);
		}
		if (i == 13 && crash)
			meter_free(m);	/* at 12, [0, 10) flushed */
		if (i == 16)	/* at 15, resumed on the other node: a new generation */
			sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
			    "node_id = '%s', state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    other, (long long)(fake_now / 1000), sb);
		if (i == 21 && crash)
			m = new_meter_with(true, 0);
		if (i == 21 && !crash)
			meter_set_backends(m, pg, rds);
		if (i == 31)
			stop_sandbox(sb, fake_now);
		if (crash && i >= 13 && i < 21) {
			fake_now += S;
			fake_mono += S;
		} else if (!crash && i >= 4 && i < 21) {
			tick_maybe(m);
		} else {
			tick_both(m);
		}
	}
	CHECK_INT(used(t), 5 * 257 + 10 * 512);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
	pg_free(dead);
}

static void test_a_snapshot_recorded_after_its_pause_row_is_found_after_a_restart(void)
{
	snapshot_after_its_pause_row(true);
}

static void test_a_snapshot_recorded_after_its_pause_row_is_found_without_postgres(void)
{
	snapshot_after_its_pause_row(false);
}

/*
 * A forward step of the wall clock smaller than the lead a backward step left (the label clock
 * stays ahead) changes the offset of the node's times: a change logged before it and read after
 * it keeps the offset then in force (kiln-sim `clock`, seed 9192: after steps back of 2,902 and
 * 184 s, a boot logged just before a 1,255 s forward step was read 1,255 s early, and a sandbox
 * that ran a minute was charged nothing of 73,026 µcr). Here a pause logged before a 60 s step,
 * 100 s back, read after it by a meter without Postgres across both, was applied 12 s early.
 */
static void forward_step_within_the_lead(int i, const char *t, const char *sb)
{
	if (i == 11)
		fake_now -= 100 * S;	/* at 10, the wall clock steps back 100 s */
	if (i == 16)
		pause_into(t, sb, "snap_a", 512);	/* at 15 */
	if (i == 21)
		fake_now += 60 * S;	/* at 20, 60 s forward: still 40 s behind */
}

static void test_a_change_logged_before_a_forward_step_within_the_lead_keeps_its_time(void)
{
	/* 15 s running, 25 s paused at 512 */
	run_without_pg(26, forward_step_within_the_lead, 15 * 257 + 25 * 512);
}

/*
 * A meter that starts tracking a sandbox from the ledger's point (restarted, or re-reading after
 * a refused window) reads the changes logged from a minute before that point, by wall-clock time:
 * after a backward step of the wall clock, a change of an earlier generation logged before the
 * step reads that much later, past the point, while the rows of the point's own generation,
 * logged after the step, read earlier and are not read at all. Every change of an earlier
 * generation is in the point (kiln-sim `clock`, seed 9259: a sandbox's boot, logged before a 254 s
 * backward step, was read 85 s after its second generation's point, paused; its first generation
 * was billed again as running from there, +20,637 µcr). Here 20 s of the paused second
 * generation were billed as the first one running.
 */
static void test_an_earlier_generations_change_read_after_the_point_is_not_applied(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0 + S / 2);
	fake_now = t0;
	fake_mono = 5000 * S;
	boot = "test-boot-gen";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 135; i++) {
		if (i == 11)
			fake_now -= 90 * S;	/* at 10, the wall clock steps back 90 s */
		if (i == 13)	/* at 12, restored: generation 2 */
			sql("UPDATE sandboxes SET generation = 2, state_changed_at = "
			    "to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), sb);
		if (i == 16)
			pause_into(t, sb, "snap_a", 512);	/* at 15 */
		if (i == 91) {	/* a restart at 90: the start, at 0.5, reads 90.5 */
			meter_free(m);
			m = new_meter_with(true, 0);
		}
		if (i == 121)
			stop_sandbox(sb, fake_now);	/* at 120 */
		tick_both(m);
	}
	boot = NULL;
	/* 11.5 s running in generation 1; 3 s running, 105 s paused at 512 in generation 2 */
	CHECK_INT(gen_ucr(sb, 1), 2955);
	CHECK_INT(used(t), 3726 + 105 * 512);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
}

/*
 * Two meters of one node write one live field; one without Postgres (a blind tick) has only its
 * charges as of its last billed tick, and must not hide those of the other, which reads Postgres
 * and bills the node's sandboxes on (kiln-sim `two-meters,zero`, seeds 9170 and 9248: the other
 * node's meter read the stale charges, and a sandbox ran 5 s at zero against 4). Here Redis
 * answered the blind meter's 3 s of charges, flushed long since, for the other's 5 s.
 */
static void test_a_meter_without_postgres_keeps_the_other_meters_live_field(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	a = new_meter();
	b = new_meter();
	for (int i = 1; i <= 25; i++) {
		if (i == 4)
			meter_set_backends(b, dead, rds);
		fake_now += S;
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		(void)meter_tick(b, &err);
	}
	CHECK_INT(meter_pending(a, t), 5 * 257);
	CHECK_INT(meter_pending(b, t), 3 * 257);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t) - 5 * 257);
	CHECK_INT(used(t), 20 * 257);
	meter_free(b);
	meter_free(a);
	pg_free(dead);
}

/*
 * A meter that starts tracking a sandbox from the ledger (restarted, or re-reading after a refused
 * window) starts from an earlier generation of its node billed short of its end before the newest
 * one billed there: the stretch between was never billed (kiln-sim `clock`, seed 532512775: a
 * pause and a resume while both meters of node 0 were without Postgres, -1,630 µcr). Here meter
 * a flushes [0, 10) and crashes at 12; the sandbox pauses at 15 into 512 MiB and is resumed at 20
 * (generation 2); meter b, without Postgres from 3 to 35, has its first generation's windows
 * refused (a's [0, 10)) and its second's taken, and re-read from generation 2's point it left
 * [10, 20) unbilled.
 */
static void test_an_earlier_generation_billed_short_of_its_end_is_billed_on(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	a = new_meter();
	b = new_meter();
	for (int i = 1; i <= 50; i++) {
		if (i == 4)
			meter_set_backends(b, dead, rds);
		if (i == 13) {
			meter_free(a);	/* a crash at 12, [0, 10) flushed */
			a = NULL;
		}
		if (i == 16)
			pause_into(t, sb, "snap_a", 512);	/* at 15 */
		if (i == 21)	/* at 20, resumed: a new generation */
			sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), sb);
		if (i == 36)
			meter_set_backends(b, pg, rds);
		if (i == 41)
			stop_sandbox(sb, fake_now);	/* at 40 */
		fake_now += S;
		if (a)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (i < 36)
			(void)meter_tick(b, &err);
		else
			CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	/* 15 s running and 5 s paused at 512 in generation 1, 20 s running in generation 2 */
	CHECK_INT(gen_ucr(sb, 1), 15 * 257 + 5 * 512);
	CHECK_INT(used(t), 35 * 257 + 5 * 512);
	CHECK_INT(meter_pending(b, t), 0);
	meter_free(b);
	pg_free(dead);
}

/*
 * An earlier generation of a node is short of its end only when the next generation after it is
 * this node's too: when the sandbox moved to another node in between, that generation ended at
 * the move, and its point there is its end however far the next generation billed here starts
 * (kiln-sim seed 322486188, make test's kinds: generation 1 paused on node 0 was moved to node 1
 * and came back as generation 3 while both meters of node 0 were without Postgres; a meter of
 * node 0 that tracked the sandbox from the ledger again took generation 1 as short, billed
 * generation 3 from its start, had it refused and read it again from generation 1, tick after
 * tick: generations 3 and 4 charged 2,656 and 4,928 µcr short). Here the sandbox runs 10.5 s on
 * A, 10 s on B and 19.5 s on A again; A's meter is without Postgres from 3 to 25, so it bills
 * generation 1 up to the move and generation 3 from the return in one tick, and crashes at 30;
 * the meter started after it must bill generation 3 on: 40 s, every second once.
 */
static void test_a_generation_that_moved_away_is_not_short_of_its_end(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);

	two_nodes_start(&c, t0, false, 0);
	for (int i = 1; i <= 55; i++) {
		const char *to = i == 11 ? c.nb : i == 21 ? c.na : NULL;
		if (to)	/* at 10.5 to B, at 20.5 back to A: a new generation each */
			move_to(c.sb, to, fake_now + S / 2);
		if (i == 4)
			meter_set_backends(c.a, dead, rds);
		if (i == 26)
			meter_set_backends(c.a, pg, rds);
		if (i == 31) {	/* a crash at 30; a fresh meter of A starts */
			meter_free(c.a);
			c.a = new_meter();
		}
		if (i == 41)
			stop_sandbox(c.sb, fake_now);	/* at 40 */
		fake_now += S;
		if (i >= 4 && i < 26)
			(void)meter_tick(c.a, &err);
		else
			CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	/* generation 3 billed to its end, at 40 */
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 3 AND state = 'none' AND last_t_ns = %lld", c.sb,
			  (long long)(t0 + 40 * S)), 1);
	CHECK_INT(used(c.t), 40 * 257);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
	pg_free(dead);
}

/*
 * A sandbox moved to another node at the instant of that node's tick, the first tick of its
 * meter that sees it, is billed there from the move: its new generation's first piece is of no
 * length at that tick, and the meter went on from the sandbox's creation (where it starts a
 * sandbox never billed here) as if the move were then, billing the time node A's meter billed
 * already again, under the new generation, which no window of A's overlaps. Here the sandbox
 * runs 20 s on A, moves to B at 20 exactly (B's tick), and stops at 40: 40 s, each once.
 */
static void test_a_sandbox_moved_at_the_new_nodes_tick_is_billed_from_the_move(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };

	two_nodes_start(&c, t0, false, 0);
	for (int i = 1; i <= 55; i++) {
		if (i == 20)	/* at 20, the time of this tick: to B, a new generation */
			move_to(c.sb, c.nb, fake_now + S);
		if (i == 41)
			stop_sandbox(c.sb, fake_now);	/* at 40 */
		fake_now += S;
		CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	CHECK_INT(gen_ucr(c.sb, 2), 20 * 257);
	CHECK_INT(used(c.t), 40 * 257);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	CHECK_INT(meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
}

/*
 * The same back on a node whose meter billed an earlier generation: moved back at the instant of
 * its meter's tick, the sandbox is billed there from the return, not from the point where that
 * meter's earlier generation ended (the other node's time billed again). Here it runs on A from
 * 0, moves to B at 10.5, back to A at 30 exactly (A's tick), and stops at 45: 45 s, each once
 * (8,867 µcr for generation 3's 15 s before, 16,576 in all).
 */
static void test_a_sandbox_moved_back_at_the_nodes_tick_is_billed_from_the_return(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };

	two_nodes_start(&c, t0, false, 0);
	for (int i = 1; i <= 60; i++) {
		if (i == 11 || i == 30)	/* at 10.5 to B; at 30, A's tick, back to A */
			move_to(c.sb, i == 11 ? c.nb : c.na, fake_now + (i == 11 ? S / 2 : S));
		if (i == 46)
			stop_sandbox(c.sb, fake_now);	/* at 45 */
		fake_now += S;
		CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	CHECK_INT(gen_ucr(c.sb, 3), 15 * 257);
	/* 45 s less the half µcr each node's remainder keeps (10.5 s on A, 19.5 s on B) */
	CHECK_INT(used(c.t), 45 * 257 - 1);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	CHECK_INT(meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
}

/*
 * A sandbox back on a node whose meter restarted after a backward step of the wall clock (in the
 * frame its node's last flush saved, so without the step's offset before it) is tracked from the
 * ledger's point of its earlier generation there, that generation's end: every change of that
 * generation is in it. Read with the offset after the step, its changes stood the step's length
 * later, past its end, and its running time was billed again (kiln-sim seed 31012: a generation
 * of node 1 paused 3 s before a 422 s backward step and moved to node 0; node 1's meter,
 * restarted since, billed its 10.97 s running again when the sandbox came back, +36,212 µcr).
 * Here the sandbox runs on A from 0, moves to B at 10.5 (generation 2), the wall clock steps 30 s
 * back at 40, A's meter restarts at 55, the sandbox is back on A at 70 (generation 3) and stops
 * at 90; a second sandbox runs on A throughout (A flushes its frame after the step). Before, A
 * read generation 1's changes at 30 and 40.5, past its end at 10.5, and billed its running
 * time again from 30 to 40.5: generation 1 charged 5,397 µcr for 2,698.
 */
static void test_an_earlier_generations_end_is_kept_by_a_meter_restarted_after_a_backward_step(void)
{
	struct two_nodes c;
	char sb2[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	bool ok;

	boot = "test-boot";
	two_nodes_start(&c, t0, true, 0);
	new_sandbox(c.t, sb2, sizeof(sb2), t0);
	for (int i = 1; i <= 120; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 10)	/* at 10.5 to B */
			move_to(c.sb, c.nb, fake_now + S / 2);
		if (i == 40)	/* the wall clock steps 30 s back; both meters follow it */
			fake_now -= 30 * S;
		if (i == 55) {	/* A's meter restarts, in the frame of its last flush */
			meter_free(c.a);
			c.a = new_meter_with(true, 0);
		}
		if (i == 70)	/* back on A */
			move_to(c.sb, c.na, fake_now);
		if (i == 90) {
			stop_sandbox(c.sb, fake_now);
			stop_sandbox(sb2, fake_now);
		}
		CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	/* 10.5 s and 20 s on A (one remainder), 59.5 s on B: every second once */
	CHECK_INT(gen_ucr(c.sb, 1), 10.5 * 257);
	CHECK_INT(sql_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows WHERE sandbox_id = '%s' "
			  "AND generation IN (1, 3)", c.sb), 30.5 * 257);
	CHECK_INT(gen_ucr(c.sb, 2), 59.5 * 257);
	CHECK_INT(used(c.t), (long long)(30.5 * 257) + (long long)(59.5 * 257) + 90 * 257);
	CHECK_INT(meter_pending(c.a, c.t) + meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
	boot = NULL;
	CHECK_INT(redis_bal(c.t, &ok), ledger_bal(c.t));
}

/*
 * A generation that ends within a tick in which the next one of the sandbox is billed here has
 * its end recorded (billed state "none" at its end), as a generation that ends with nothing
 * after it here does: else its point stays in its last state, and the stretch on this node that
 * went on on another node without its end in the ledger is read again by every tick, for ever,
 * and taken as a dead meter's tail to bill. Here the sandbox runs on A from 0, is moved to B at
 * 10.2 and back to A at 10.6 (generations 2 and 3, both within A's tick at 11), and stops at 30.
 */
static void test_a_generation_ended_in_the_tick_of_the_next_has_its_end_recorded(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };

	two_nodes_start(&c, t0, false, 0);
	for (int i = 1; i <= 45; i++) {
		if (i == 11) {	/* at 10.2 to B, at 10.6 back to A */
			move_to(c.sb, c.nb, fake_now + S / 5);
			move_to(c.sb, c.na, fake_now + 3 * S / 5);
		}
		if (i == 31)
			stop_sandbox(c.sb, fake_now);	/* at 30 */
		fake_now += S;
		CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 1 AND state = 'none' AND last_t_ns = %lld", c.sb,
			  (long long)(t0 + 10 * S + S / 5)), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", c.sb), 0);
	/* 10.2 s and 19.4 s on A (one remainder), 0.4 s on B: every second once */
	CHECK_INT(sql_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows WHERE sandbox_id = '%s' "
			  "AND generation IN (1, 3)", c.sb), 29.6 * 257);
	CHECK_INT(gen_ucr(c.sb, 2), 102);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	CHECK_INT(meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
}

/* Runs `q` on the scratch database: 0 when it succeeds, else 1 with its message in `err`. */
static int sql_try(struct kiln_error *err, const char *q)
{
	struct pg_conn *c = conn();
	int rc = pg_exec(c, q, err) == KILN_OK ? 0 : 1;

	pg_release(pg, c);
	return rc;
}

/*
 * A sandbox creating, running or paused does not change node without a new, higher generation
 * in the same UPDATE (migrations/0043): two nodes' meters would bill one generation. The refused
 * update changes nothing (node, generation, state log); a move with a new generation is taken.
 */
static void test_a_move_without_a_new_generation_is_refused(void)
{
	char t[32], sb[32], na[32], nb[32], q[512];
	struct kiln_error err = { 0 };
	long long logged;
	int64_t t0 = aligned_now();

	snprintf(na, sizeof(na), "%s", node);
	(void)aligned_now();	/* node B */
	snprintf(nb, sizeof(nb), "%s", node);
	snprintf(node, sizeof(node), "%s", na);
	new_tenant(t, sizeof(t));
	new_sandbox(t, sb, sizeof(sb), t0);
	sql("UPDATE sandboxes SET node_id = '%s' WHERE id = '%s'", na, sb);	/* same node */
	logged = sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s'", sb);
	snprintf(q, sizeof(q), "UPDATE sandboxes SET node_id = '%s' WHERE id = '%s'", nb, sb);
	CHECK_INT(sql_try(&err, q), 1);
	CHECK(strstr(err.msg, "23514") != NULL);	/* check_violation */
	/* From creating too, and to running from paused (a resume without its generation) */
	sql("UPDATE sandboxes SET state = 'creating' WHERE id = '%s'", sb);
	CHECK_INT(sql_try(&err, q), 1);
	sql("UPDATE sandboxes SET state = 'paused' WHERE id = '%s'", sb);
	snprintf(q, sizeof(q), "UPDATE sandboxes SET node_id = '%s', state = 'running' WHERE id = '%s'",
		 nb, sb);
	CHECK_INT(sql_try(&err, q), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM sandboxes WHERE id = '%s' AND node_id = '%s' "
			  "AND generation = 1 AND state = 'paused'", sb, na), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s' "
			  "AND node_id = '%s'", sb, nb), 0);
	/* Paused too (its node's meter bills its paused time), and never to a lower generation */
	snprintf(q, sizeof(q), "UPDATE sandboxes SET node_id = '%s' WHERE id = '%s'", nb, sb);
	CHECK_INT(sql_try(&err, q), 1);
	snprintf(q, sizeof(q), "UPDATE sandboxes SET node_id = '%s', generation = generation - 1 "
		 "WHERE id = '%s'", nb, sb);
	CHECK_INT(sql_try(&err, q), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM sandboxes WHERE id = '%s' AND node_id = '%s' "
			  "AND generation = 1", sb, na), 1);
	/* A move: a new generation in the same UPDATE, as record_resumed() writes it */
	snprintf(q, sizeof(q), "UPDATE sandboxes SET node_id = '%s', state = 'running', "
		 "generation = generation + 1 WHERE id = '%s'", nb, sb);
	CHECK_INT(sql_try(&err, q), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM sandboxes WHERE id = '%s' AND node_id = '%s' "
			  "AND generation = 2 AND state = 'running'", sb, nb), 1);
	CHECK(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s'", sb) > logged);
}

/*
 * A point in the ledger in billed state "none" is a generation's end only when something of it
 * was billed: a sandbox still creating (billed nothing, in no state) has such a point too, at the
 * end of its first window. A meter that tracked it from there after it ended took every change of
 * the generation as in the point and billed its whole life in no state (kiln-sim seed 793780264,
 * make test's kinds: a sandbox created at 559 s, its meter crashed at 565 s for the rest of the
 * run, its 41 s charged 0 of 45,951 µcr). Here the sandbox is created at 5 and boots at 12; the
 * meter flushes [0, 10) (creating) and crashes at 13; the sandbox pauses at 20 into 512 MiB and
 * is deleted at 25; a meter started at 30 bills 8 s running and 5 s paused.
 */
static void test_a_point_while_creating_is_not_the_generations_end(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *a;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	new_sandbox_at(t, sb, sizeof(sb), node, "creating", t0 + 5 * S, NULL, 0);
	fake_now = t0;
	a = new_meter();
	for (int i = 1; i <= 45; i++) {
		if (i == 13)	/* booted at 12 */
			sql("UPDATE sandboxes SET state = 'running', state_changed_at = "
			    "to_timestamp(%lld / 1e6) WHERE id = '%s'", (long long)(fake_now / 1000), sb);
		if (i == 14) {	/* a crash at 13, [0, 10) flushed */
			meter_free(a);
			a = NULL;
		}
		if (i == 21)
			pause_into(t, sb, "snap_c", 512);	/* at 20 */
		if (i == 26)	/* deleted at 25 */
			sql("UPDATE sandboxes SET state = 'stopped', deleted_at = to_timestamp(%lld / 1e6), "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), (long long)(fake_now / 1000), sb);
		if (i == 31)
			a = new_meter();
		fake_now += S;
		if (a)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
	}
	CHECK_INT(used(t), 8 * 257 + 5 * 512);
	CHECK_INT(meter_pending(a, t), 0);
	meter_free(a);
}

/*
 * Two meters a and b of one node bill a sandbox running from 0 to 25 s while the wall clock steps
 * 600 s on at 12 s; a skips its tick at `a_skips` s and b at `b_skips` (0: none), a ticking
 * first in each second. Returns what the tenant was charged.
 */
static long long two_meters_over_a_forward_step(int a_skips, int b_skips)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *a, *b;
	long long u;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 40; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 12)
			fake_now += 600 * S;
		if (i == 26)
			stop_sandbox(sb, fake_now - S);	/* at 25 s, on the stepped wall clock */
		if (i != a_skips)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (i != b_skips)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	u = used(t);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(b);
	meter_free(a);
	return u;
}

/*
 * Two meters of one node, one of which skipped the tick before a forward step, label the time
 * before the step alike: each bills up to the step in the frame before it and follows at the
 * next tick (kiln-sim `clock`, seed 351001013). Here meter a skips the tick at 11 s, b bills
 * [10, 11]. Before, a moved its point (10 s, a window's start) by the step and billed [610, 612],
 * b's [10, 11] in a window a never wrote: 26 s billed of 25.
 */
static void test_two_meters_label_the_time_before_a_forward_step_alike(void)
{
	CHECK_INT(two_meters_over_a_forward_step(11, 0), 25 * 257);
}

/*
 * Two meters of one node, both late around a forward step, label the time before it alike: the
 * first held tick tells where it begins the step's gap, and the later one takes it (kiln-sim
 * seed 77465: one meter skipped the tick before the step, the other the tick of the step; each
 * began its gap at the second before its own held tick, a second apart, and the ledger, which
 * writes a window's start once, kept the window of each that left that second out: -210 and
 * -107 µcr on two paused sandboxes). Here b skips the tick at 11 s, a the tick at 12. Before:
 * b's window of [10, 20) (to 11) and a's of [610, 620) (from 612), 24 s billed of 25.
 */
static void test_two_late_meters_label_the_time_before_a_forward_step_alike(void)
{
	CHECK_INT(two_meters_over_a_forward_step(12, 11), 25 * 257);
}

/*
 * A generation of a node whose meter is gone, taken over by the meter of the node the sandbox is
 * on now, carries the remainder of that node's newest point, as that node's meter would have
 * (kiln-sim `clock`, seed 9244: a generation taken over from zero was charged 1 µcr less). Here
 * the sandbox runs 10.5 s on node A (a remainder of half a µcr), 10 s on B, 10.5 s on A again
 * while A's meter is gone, and B's meter takes those over: 2,699 µcr, not 2,698.
 */
static void test_a_taken_over_generation_carries_its_nodes_remainder(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };

	two_nodes_start(&c, t0, false, 2);
	for (int i = 1; i <= 55; i++) {
		const char *to = i == 11 || i == 32 ? c.nb : i == 21 ? c.na : NULL;
		if (to)	/* at 10.5 to B, at 20.5 back to A, at 31 to B: a new generation each */
			move_to(c.sb, to, fake_now + (i == 32 ? 0 : S / 2));
		if (i == 21) {	/* A's meter killed for good at 20, its windows flushed */
			meter_free(c.a);
			c.a = NULL;
			sleep(3);	/* its alive key past the bound */
		}
		if (i == 41)
			stop_sandbox(c.sb, fake_now);	/* at 40 */
		fake_now += S;
		if (c.a)
			CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	CHECK_INT(gen_ucr(c.sb, 3), 2699);
	CHECK_INT(used(c.t), 40 * 257);
	meter_free(c.b);
}

/*
 * A case of a generation taken over from a meter on another clock frame (the three below): A's
 * meter starts at 0; at 6 s the wall clock steps 100 s back, B's meter starts after it and the
 * sandbox is created on A; it moves to B at 11 s and back to A at 36 s (a new generation each)
 * and stops at 46 s; from 35 s B's meter bills on without its alive key, so A's meter takes B's
 * generation over. `at(i, &a)` runs at each of the 60 ticks (a second each) before the moves, on
 * A's meter. Generation 2 must be billed its 25 s and the sandbox 40 s, each once, nothing
 * pending, and Redis's balance the ledger's.
 */
static void taken_over_across_frames(void (*at)(int i, struct meter **a))
{
	char t[32], sb[32], na[32], nb[32], key[96];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct meter *a, *b = NULL;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	fake_now = t0;
	fake_mono = 5000 * S;
	snprintf(na, sizeof(na), "%s", node);
	boot = "test-boot";
	a = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		const char *to = i == 11 ? nb : i == 36 ? na : NULL;
		fake_now += S;
		fake_mono += S;
		if (i == 6) {	/* the wall clock steps back 100 s; B's meter starts after it */
			fake_now -= 100 * S;
			(void)aligned_now();
			snprintf(nb, sizeof(nb), "%s", node);
			snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, nb);
			b = new_meter_with(true, 0);
			snprintf(node, sizeof(node), "%s", na);
			new_sandbox(t, sb, sizeof(sb), fake_now);
		}
		at(i, &a);
		if (to)	/* at 11 s to B, at 36 s back to A: a new generation each */
			move_to(sb, to, fake_now);
		if (i == 46)
			stop_sandbox(sb, fake_now);
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (b)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
		if (i >= 35) {	/* B's meter bills on without Redis: its alive key gone */
			CHECK_INT(RDS(rds, &rep, &err, "DEL", key), KILN_OK);
			rds_reply_release(&rep);
		}
	}
	CHECK_INT(gen_ucr(sb, 2), 25 * 257);
	CHECK_INT(used(t), 40 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	meter_free(b);
	meter_free(a);
	boot = NULL;
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	snprintf(node, sizeof(node), "%s", na);
}

/*
 * A generation taken over from a node whose meter is taken as gone (its alive key lost with its
 * Redis) while that meter still billed it, the two meters' label clocks in different frames: the
 * taker's meter followed a backward step of the wall clock (100 s ahead of it), the other started
 * after it (on the wall clock). The taker goes on from that generation's point in the ledger,
 * placed on its own clock (kiln-sim `clock`, seed 524333160: billed from the generation's start
 * under labels 281 s from the other meter's, which the ledger's fence, comparing labels, took:
 * +106,769 µcr). Here the sandbox, created after the step, runs 5 s on A, 25 s on B and 10 s on
 * A again; A's meter, restarted in its frame while the sandbox was on B, takes B's generation
 * over at its end, 19 s of it flushed by B's meter: 40 s billed, not 59.
 */
static void a_restarts_at_30(int i, struct meter **a)
{
	if (i == 30) {	/* A's meter restarts, in its node's frame */
		meter_free(*a);
		*a = new_meter_with(true, 0);
	}
}

static void test_a_taken_over_generation_goes_on_from_its_point_in_another_frame(void)
{
	taken_over_across_frames(a_restarts_at_30);
}

/*
 * A generation taken over across a forward step of the wall clock that both meters followed, A
 * by less than B (A's label clock kept the lead a backward step left). What is billed of it is
 * its windows' billed time, placed from its start across the steps the taker followed
 * (gen_point()). Before, it was the point less its first window's start on B's labels, which
 * jumped by B's step, and the taker moved the start on by its own step too: the step counted
 * twice (kiln-sim `clock`, seed 796674514: a generation taken over across steps of +3,247 and
 * +1,184 s read as billed 4,429 s past its end, and the next one was charged nothing of 105,506
 * µcr). As in the case above, the sandbox runs 5 s on A, 25 s on B (across the step) and 10 s on
 * A again, B's meter without its alive key from 35 s: 40 s billed, not 70.
 */
static void forward_step_at_20(int i, struct meter **a)
{
	(void)a;
	if (i == 20)	/* 1,000 s forward: A follows 900 s of it (its lead), B all */
		fake_now += 1000 * S;
}

static void test_a_taken_over_generation_across_a_forward_step_is_placed_once(void)
{
	taken_over_across_frames(forward_step_at_20);
}

/*
 * A generation taken over whose start was logged before a backward step of the wall clock the
 * taker followed: its start is placed in the frame in force when it was logged, as a change read
 * late is (gen_point()). Placed with the offset after the step, it stood the step's length late,
 * and so did the generation's point: the next generation, billed from there, was charged nothing
 * (kiln-sim `clock`, seed 997291951: a generation of node 1 started 44 s before a 2,921 s
 * backward step, taken over by node 0's meter when node 1's lost Redis, its next two generations
 * on node 0 charged nothing of 67,499 and 34,352 µcr). As above, but the wall clock steps 200 s
 * back at 20 s (the sandbox on B since 11 s): 40 s billed, not 70.
 */
static void backward_step_at_20(int i, struct meter **a)
{
	(void)a;
	if (i == 20)	/* 200 s back: both meters keep going */
		fake_now -= 200 * S;
}

static void test_a_taken_over_generation_started_before_a_backward_step_keeps_its_start(void)
{
	taken_over_across_frames(backward_step_at_20);
}

/*
 * A meter killed for good leaves its live field; its sandbox is recovered on another node, whose
 * meter bills it again from the ledger's billed-up-to point. Once the dead meter's field is
 * older than the bound, the other meter's tick drops it: Redis's balance is the ledger's less
 * the living meter's unflushed charges, and equals the ledger after its flush.
 */
static void test_dead_meter_live_field_dropped_after_bound(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct billing_balance b;
	struct pg_conn *c;
	struct meter *a, *m;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	a = new_meter_with(false, 2);
	tick_until(a, t0 + 15 * S);	/* [0, 10) flushed, 5 s live */
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t) - 5 * 257);
	meter_free(a);			/* killed for good: its field stays */
	(void)aligned_now();		/* another node */
	sql("UPDATE sandboxes SET node_id = '%s', generation = 2, state_changed_at = "
	    "to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    node, (long long)((t0 + 15 * S) / 1000), sb);
	sleep(3);			/* the dead meter's field and alive key are past the bound */
	m = new_meter_with(false, 2);
	/* Generation 1's [10, 15) on the dead meter's node, unflushed: billed here from the ledger
	 * once that meter is known dead, and flushed at once with its end (win_done()); generation
	 * 2's [15, 16) is this node's, pending. */
	tick_until(m, t0 + 16 * S);
	CHECK_INT(meter_pending(m, t), 257);
	tick_until(m, t0 + 17 * S);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t) - meter_pending(m, t));
	c = conn();
	CHECK_INT(billing_balance(rds, c, t, &b, &err), KILN_OK);
	pg_release(pg, c);
	CHECK_INT(b.balance_ucr, ledger_bal(t) - meter_pending(m, t));
	tick_until(m, t0 + 20 * S);	/* the flush of generation 2's [15, 20) */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(used(t), 20 * 257);
	stop_sandbox(sb, t0 + 20 * S);
	tick_until(m, t0 + 31 * S);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(used(t), 20 * 257);
	meter_free(m);
}

/*
 * A sandbox that ends exactly on a window boundary, after that window was flushed: its end is
 * still recorded (billed state "none"), so it is not read and tracked again on every tick.
 */
static void test_end_on_a_window_boundary_is_recorded(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 20 * S);	/* [10, 20) flushed: billed up to 20 s */
	stop_sandbox(sb, t0 + 20 * S);
	tick_until(m, t0 + 45 * S);
	CHECK_INT(used(t), 20 * 257);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none'", sb), 1);
	meter_free(m);
}

/*
 * A sandbox whose end time is ahead of the meter's clock (the clocks of two hosts differ): billed
 * up to the clock, and ended when the clock passes its end, at that end.
 */
static void test_end_time_ahead_of_the_clock_is_waited_for(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;

	new_tenant(t, sizeof(t));
	grant(t, 1000000LL, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter();
	tick_until(m, t0 + 5 * S);
	stop_sandbox(sb, t0 + 8 * S + S / 2);	/* 3.5 s ahead of the meter's clock */
	tick_until(m, t0 + 7 * S);
	CHECK_INT(used(t) + meter_pending(m, t), 7 * 257);
	tick_until(m, t0 + 21 * S);
	CHECK_INT(used(t), (long long)(fine_of(8 * S + S / 2) / PRICE_FINE_PER_UCR));
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none'", sb), 1);
	meter_free(m);
}

/*
 * A generation of another node wholly in the ledger, taken over when a later one of this node
 * follows, is left to its own node's meter: this meter billed none of it and records no end of
 * it. Before 1a83a29 it ended it at its own stale point (where it stood before that generation):
 * a window overlapping that node's windows, which the ledger refused, and the sandbox was tracked
 * again from the ledger (4 windows sent, 3 written). Here the sandbox runs on A from 0, on B from
 * 10.5 (generation 2) and on A again from 20.5 (generation 3) to 45; A's meter crashes at 25 (its
 * point is generation 1's end, nothing of generation 3 flushed); B's flushes generation 2 to its
 * end by 30 and is killed for good at 31; A's meter, restarted at 35, reads generation 2 as taken
 * over, after the point it starts from (10.5): 45 s billed, each once, nothing refused.
 */
static void test_a_taken_over_generation_in_the_ledger_is_not_ended_here(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter_stats st;

	two_nodes_start(&c, t0, false, 2);
	for (int i = 1; i <= 60; i++) {
		if (i == 11 || i == 21)	/* at 10.5 to B, at 20.5 back to A */
			move_to(c.sb, i == 11 ? c.nb : c.na, fake_now + S / 2);
		if (i == 26) {	/* A's meter crashes at 25 */
			meter_free(c.a);
			c.a = NULL;
		}
		if (i == 32) {	/* B's killed for good at 31, generation 2 flushed to its end */
			CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
					  "AND generation = 2 AND node_id = '%s' AND state = 'none' "
					  "AND last_t_ns = %lld", c.sb, c.nb,
					  (long long)(t0 + 20 * S + S / 2)), 1);
			meter_free(c.b);
			c.b = NULL;
			sleep(3);	/* its alive key past the bound */
		}
		if (i == 36)	/* A's meter restarted at 35 */
			c.a = new_meter_with(false, 2);
		if (i == 46)
			stop_sandbox(c.sb, fake_now);	/* at 45 */
		fake_now += S;
		if (c.a)
			CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		if (c.b)
			CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	/* generation 2 as B billed it, nothing of it written by A */
	CHECK_INT(gen_ucr(c.sb, 2), 10 * 257);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 2 AND node_id <> '%s'", c.sb, c.nb), 0);
	/* 10.5 s and 24.5 s on A, one remainder */
	CHECK_INT(sql_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows WHERE sandbox_id = '%s' "
			  "AND generation IN (1, 3)", c.sb), 35 * 257);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 3 AND state = 'none' AND last_t_ns = %lld", c.sb,
			  (long long)(t0 + 45 * S)), 1);
	CHECK_INT(used(c.t), 45 * 257);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	/* every window A's restarted meter sent is in the ledger: none refused */
	meter_get_stats(c.a, &st);
	CHECK_INT(st.windows_flushed, sql_int("SELECT count(*) FROM usage_windows WHERE "
					      "sandbox_id = '%s' AND generation = 3", c.sb));
	meter_free(c.a);
}

/*
 * A generation taken over whose start was logged before a forward step of the wall clock that a
 * larger backward step then followed, both followed by the taker: the wall clock's times repeat
 * after the backward step, and the start read with the offset after it stood the difference of
 * the two steps late, its point past the generation's end (gen_point()). The next generation,
 * billed from there, was charged nothing (kiln-sim seed 31014, one hour of make test's kinds: a
 * generation of node 1 started before steps of +2,070 and -2,267 s, taken over by node 0's meter
 * when node 1's crashed, its point placed 134.6 s past its end; the second generation charged
 * nothing of 90,397 µcr and the sandbox 21 s at zero against a bound of 20). Here the sandbox
 * runs 30 s on B, then 10 s on A (generation 2), which never billed it before; the wall clock
 * steps 300 s forward at 15 s and 320 s back at 20 s, B's meter without its alive key from 35 s:
 * 40 s billed, not 30.
 */
static void test_a_taken_over_generation_started_before_a_forward_then_a_backward_step(void)
{
	char t[32], sb[32], na[32], nb[32], key[96];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct meter *a, *b = NULL;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	fake_now = t0;
	fake_mono = 5000 * S;
	snprintf(na, sizeof(na), "%s", node);
	boot = "test-boot";
	a = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 6) {	/* B's meter starts; the sandbox is created on B */
			(void)aligned_now();
			snprintf(nb, sizeof(nb), "%s", node);
			snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, nb);
			b = new_meter_with(true, 0);
			new_sandbox(t, sb, sizeof(sb), fake_now);
			snprintf(node, sizeof(node), "%s", na);
		}
		if (i == 15)	/* 300 s forward: both meters follow it */
			fake_now += 300 * S;
		if (i == 20)	/* 320 s back: both meters keep going */
			fake_now -= 320 * S;
		if (i == 36)	/* to A: generation 2 */
			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    na, (long long)(fake_now / 1000), sb);
		if (i == 46)
			stop_sandbox(sb, fake_now);
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (b)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
		if (i >= 35) {	/* B's meter bills on without Redis: its alive key gone */
			CHECK_INT(RDS(rds, &rep, &err, "DEL", key), KILN_OK);
			rds_reply_release(&rep);
		}
	}
	CHECK_INT(gen_ucr(sb, 1), 30 * 257);
	CHECK_INT(gen_ucr(sb, 2), 10 * 257);
	CHECK_INT(used(t), 40 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	meter_free(b);
	meter_free(a);
	boot = NULL;
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	snprintf(node, sizeof(node), "%s", na);
}

/*
 * kiln-meter's connections run without JIT (meter_pg_session(), on its pool at its start): each
 * connection of the pool reports jit off even when the database URL asks for it on
 * (options=-c jit=on, which takes precedence over PGOPTIONS), while the URL's other options hold.
 */
static const char *meter_db_url;
static void test_meter_connections_run_without_jit(void)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c[2] = { NULL, NULL };
	struct pg_res *res = NULL;
	struct pg *own;
	char url[700];

	snprintf(url, sizeof(url), "%s options='-c jit=on -c statement_timeout=600000'",
		 meter_db_url);
	own = pg_new(url, 2);
	CHECK(own && meter_pg_session(own) == 0);
	for (int i = 0; i < 2; i++)	/* both at once: two connections */
		CHECK(own && pg_acquire(own, &c[i], &err) == KILN_OK);
	for (int i = 0; i < 2; i++) {
		if (!c[i])
			continue;
		CHECK(PGQ0(c[i], &res, &err, "SELECT current_setting('jit') || ' ' || "
					     "current_setting('statement_timeout')") == KILN_OK);
		CHECK_STR(pg_res_str(res, 0, 0), "off 10min");
		pg_res_free(res);
		res = NULL;
		pg_release(own, c[i]);
	}
	pg_free(own);
}

/*
 * The shape of the cases below: A's meter runs from 0 and B's from 6 s (`b_start` when set), when
 * the sandbox is created on B, for 60 ticks (`ticks` when set); the wall clock steps 320 s back at `step_at` (A's meter follows it); the sandbox
 * moves to A (generation 2) at `move_at`, logged `late_ns` before that tick, before the ticks of
 * that second or, with `move_after_ticks`, after them; B's meter ticks last at `b_last` and its
 * alive key is gone from `key_gone_from`; the sandbox stops at `stop_at`. Generation 1 must be
 * billed `gen1` µcr, generation 2 `gen2`, each once.
 */
struct late_end_shape {
	int step_at, move_at, b_last, key_gone_from, stop_at, b_start, ticks;
	int64_t late_ns;
	bool move_after_ticks;
	bool witnessed;		/* the move logged with its witness (the meters' boot, now) */
	int pause_at;		/* a pause witnessed on B before the move (0: none) */
	const char *b_boot;	/* B's host's boot, its meter's and its pause's (NULL: A's) */
	long long gen1, gen2;
};

static void move_logged(const char *sb, const char *to, int64_t at)
{
	sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'", to,
	    (long long)(at / 1000), sb);
}

static void pause_witnessed(const char *t, const char *sb, const char *snap, long long mib,
			    const char *wboot);

static void taken_over_with_a_late_end(const struct late_end_shape *x)
{
	char t[32], sb[32], na[32], nb[32], key[96];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct meter *a, *b = NULL;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	fake_now = t0;
	fake_mono = 5000 * S;
	snprintf(na, sizeof(na), "%s", node);
	boot = "test-boot";
	a = new_meter_with(true, 0);
	for (int i = 1; i <= (x->ticks ? x->ticks : 60); i++) {
		fake_now += S;
		fake_mono += S;
		if (i == x->step_at)	/* 320 s back: A's meter follows it */
			fake_now -= 320 * S;
		if (i == (x->b_start ? x->b_start : 6)) {	/* B's meter starts, the sandbox on B */
			(void)aligned_now();
			snprintf(nb, sizeof(nb), "%s", node);
			snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, nb);
			boot = x->b_boot ? x->b_boot : "test-boot";
			b = new_meter_with(true, 0);
			boot = "test-boot";
			new_sandbox(t, sb, sizeof(sb), fake_now);
			snprintf(node, sizeof(node), "%s", na);
		}
		if (i == x->move_at && !x->move_after_ticks && x->witnessed)
			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state = 'running', pause_snapshot = NULL, "
			    "state_changed_at = to_timestamp(%lld / 1e6), log_boot_id = '%s', "
			    "log_mono_ns = %lld WHERE id = '%s'", na,
			    (long long)((fake_now - x->late_ns) / 1000), boot, (long long)fake_mono, sb);
		else if (i == x->move_at && !x->move_after_ticks)
			move_logged(sb, na, fake_now - x->late_ns);
		if (i == x->pause_at)
			pause_witnessed(t, sb, "snap_tail", 128, x->b_boot ? x->b_boot : boot);
		if (i == x->stop_at)
			stop_sandbox(sb, fake_now);
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (b && i <= x->b_last)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
		if (i == x->move_at && x->move_after_ticks)
			move_logged(sb, na, fake_now - x->late_ns);
		if (i >= x->key_gone_from) {
			CHECK_INT(RDS(rds, &rep, &err, "DEL", key), KILN_OK);
			rds_reply_release(&rep);
		}
	}
	CHECK_INT(gen_ucr(sb, 1), x->gen1);
	CHECK_INT(gen_ucr(sb, 2), x->gen2);
	CHECK_INT(used(t), x->gen1 + x->gen2);
	CHECK_INT(meter_pending(a, t), 0);
	meter_free(b);
	meter_free(a);
	boot = NULL;
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	snprintf(node, sizeof(node), "%s", na);
}

/*
 * A generation taken over whose end (the first change of the next generation) was logged before a
 * backward step of the wall clock, its tail billed while the clock is still behind that end: the
 * end and the changes are read in the frame they were logged in, as gen_point() reads them, not
 * with the offset after the step, which put the end the step's size late and billed the tail that
 * much longer. Here the sandbox runs 30 s on B, whose meter stops at 30 s, then 10 s on A
 * (generation 2); the wall clock steps 320 s back at 38 s and B's alive key is gone from 40 s:
 * 40 s billed, not 360.
 */
static void test_a_tail_ended_before_a_backward_step_ends_there(void)
{
	const struct late_end_shape x = { .step_at = 38, .move_at = 36, .b_last = 30,
					  .key_gone_from = 40, .stop_at = 46,
					  .gen1 = 30 * 257, .gen2 = 10 * 257 };

	taken_over_with_a_late_end(&x);
}

/*
 * A generation taken over whose point passes its end for another reason than a start read in the
 * wrong frame: its end (the move) logged 4 s late, after its node's meter had flushed the running
 * time up to 40 s. Its start, logged after a backward step the taker followed and less than the
 * step's size after it, also reads as before the step in the frame before it, and
 * node_time_before() moves the point there, the step's size early. That point is not billed from
 * again: no tail is taken of a generation billed past its end (tails_sql compares the point with
 * the end on the wall clock), and the next generation is billed from its own start. Here A's
 * meter follows a 320 s backward step at 3 s; the sandbox runs on B from 6 s, whose meter stops
 * at 41 s, moves to A at 42 s logged as at 38 s, and stops at 52 s; B's alive key is gone from
 * 44 s. Billed: what B flushed (34 s) and A's 14 s from the logged move, not 320 s more.
 */
static void test_a_tail_billed_past_a_late_end_after_a_backward_step_is_not_billed_again(void)
{
	const struct late_end_shape x = { .step_at = 3, .move_at = 42, .late_ns = 4 * S,
					  .b_last = 41, .key_gone_from = 44, .stop_at = 52,
					  .gen1 = 34 * 257, .gen2 = 14 * 257 };

	taken_over_with_a_late_end(&x);
}

/*
 * A generation taken over whose point passes its end by less than a step's tolerance, not because
 * its start was read in the wrong frame: its end (the move) logged 0.4 s before its node's meter's
 * last tick, which had flushed the running time to that tick and never saw the move. Its start,
 * logged after a backward step the taker followed and less than the step's size after it, also
 * reads as before the step in the frame before it; node_time_before() moved the point there, the
 * step's size early, and the taker billed the generation again from there (the writer's labels
 * in another frame, so the ledger's fence took it). Here A's meter follows a 320 s backward step
 * at 3 s; the sandbox runs on B from 6 s, whose meter ticks last at 40 s; the move to A is logged
 * as at 39.6 s right after that tick, when B's alive key goes, and the sandbox stops at
 * 52 s.
 */
static void test_a_point_past_its_end_by_less_than_a_step_is_the_end(void)
{
	const struct late_end_shape x = { .step_at = 3, .move_at = 40, .late_ns = 4 * S / 10,
					  .move_after_ticks = true, .b_last = 40,
					  .key_gone_from = 40, .stop_at = 52,
					  .gen1 = 34 * 257, .gen2 = 3186 };	/* 12.4 s from the logged move */

	taken_over_with_a_late_end(&x);
}

/*
 * The case above with the end logged 2 s before the writer's last flushed tick, more than a
 * step's tolerance, and the sandbox created on B 67 s after the backward step A's meter followed:
 * its start, read as before the step in the frame before it, was logged more than LOG_LATE_NS
 * after the step (its log sequence past the one A's meter read then), so its time is after it
 * and the point is not moved there (node_time_before()). Before, the point stood the step's
 * size early and generation 1 was billed again from there (92,006 µcr for 10,280). B's meter bills 40 s to its last tick at 110 s, a window's end, the move is
 * logged as at 108 s, the sandbox stops at 122 s: 14 s on A.
 */
static void test_a_point_past_a_late_end_is_not_moved_before_a_step_long_gone(void)
{
	const struct late_end_shape x = { .step_at = 3, .b_start = 70, .move_at = 110,
					  .late_ns = 2 * S, .move_after_ticks = true,
					  .b_last = 110, .key_gone_from = 110, .stop_at = 122,
					  .ticks = 130, .gen1 = 40 * 257, .gen2 = 14 * 257 };

	taken_over_with_a_late_end(&x);
}

/*
 * A meter restarted in its node's frame after a forward step of the wall clock made while it was
 * down, smaller than the lead a backward step left (the label clock still ahead), keeps that step
 * as one within the lead: a change logged before it, while the meter was down, keeps the offset
 * the frame saved (meter_clocks.off_ns), not the one after the step. Kiln-sim seed 31049: a paused
 * sandbox of node 1 deleted 22 s after a 2,019 s backward step and 2 s after its meter crashed,
 * then a 257 s forward step; the restarted meter read the deletion 257 s early, before the
 * ledger's point, and ended the generation there, a window's start: 11 s of paused time unbilled
 * (7,072 µcr for 8,425). Here a 100 s step back at 12 s, a crash at 24 s ([10, 20) flushed), the
 * sandbox stopped at 30 s, a step of `step_s` at 35 s (forward here; back below), the restart at
 * 40 s, the case's time starting at `t0` (aligned_now()): with 60 s forward, 20 s were billed for
 * 30 before.
 */
static void stopped_while_down_then_stepped(int64_t step_s, int64_t t0, char sb[32])
{
	char t[32];
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, 32, t0);
	boot = "test-boot-lead-down";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 120; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 31)
			stop_sandbox(sb, fake_now);	/* at 30, no meter */
		if (i == 36)
			fake_now += step_s * S;	/* at 35, forward or back */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 30 * 257);	/* to the stop, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

static void test_a_change_logged_before_a_forward_step_within_the_lead_while_down_keeps_its_time(void)
{
	char sb[32];

	stopped_while_down_then_stepped(60, aligned_now(), sb);
}

/*
 * The same with a forward step that takes the whole lead back (a mistaken step back that a time
 * server corrected while no meter ran): the restarted meter's first tick finds the wall clock at
 * its label clock, no step to see, and read the stop with no offset, 100 s early: 20 s billed for
 * 30 before (5,140 µcr for 7,710).
 */
static void test_a_forward_step_taking_the_whole_lead_back_while_down_keeps_the_frame(void)
{
	char sb[32];

	stopped_while_down_then_stepped(100, aligned_now(), sb);
}

/*
 * A meter restarted in its node's frame after a backward step of the wall clock made while it was
 * down reads a change logged before that step, while it was down, with the frame's offset
 * (meter_clocks.off_ns), both from the log and from the row (state_changed_at, deleted_at).
 * Kiln-sim seed 31120: a running sandbox of node 1 deleted 10 s after its only meter crashed, 19 s
 * before a 2,196 s backward step (offset 2,807 s before it), the meter restarted 60 s after the
 * step: it kept offset 0 as the one before the step, read the deletion's log row 2,807 s early,
 * before the ledger's point, and took it as in the point, while the row's deleted_at, read with
 * the offset after the step, stood 2,196 s ahead: the generation was billed as running to the
 * run's end, its point left running (+4,348,463 µcr). Here a 100 s step back at 12 s, a crash at
 * 24 s ([10, 20) flushed), the sandbox stopped at 30 s, 50 s more back at 35 s, the restart at
 * 40 s: before, the stop was read at 80 s and billed running to there (20,560 µcr for 7,710);
 * with the frame's offset for the log only, the stop was applied at 30 s but the generation
 * ended at 80 s, where the row's time read, after five windows in no state.
 */
static void test_a_change_logged_before_a_backward_step_while_down_keeps_its_time(void)
{
	int64_t t0 = aligned_now();
	char sb[32];

	stopped_while_down_then_stepped(-50, t0, sb);
	/* Its generation ended at the stop, not where the row's time read. */
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none' AND last_t_ns = %lld", sb,
			  (long long)(t0 + 30 * S)), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", sb), 0);
}

/*
 * A sandbox whose end's log row is in its billed-up-to point, a point that says it still runs,
 * while the row's own end reads ahead of the clock, ends at the point: never billed on while
 * the end is waited for. The log's row of an end carries the row's own time, so the two disagree
 * only when read in different frames (kiln-sim seed 31120, before both were read in the frame
 * they were logged in: the log's 2,807 s early, the row's 2,196 s late); here the log row is moved
 * before the point. Running from 0, a crash at 24 s ([10, 20) flushed), stopped at 30 s with its
 * time 1,000 s ahead and its log row at 15 s, the restart at 40 s: before, billed as running to
 * the last tick (30,840 µcr for 5,140).
 */
static void test_an_end_in_a_running_point_with_the_rows_end_ahead_ends_at_the_point(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 120; i++) {
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 31) {			/* at 30, no meter */
			stop_sandbox(sb, t0 + 1000 * S);
			sql("UPDATE sandbox_state_log SET at = to_timestamp(%lld / 1e6) "
			    "WHERE sandbox_id = '%s' AND state = 'stopped'",
			    (long long)((t0 + 15 * S) / 1000), sb);
		}
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 */
		tick_if(m);
	}
	CHECK_INT(used(t), 20 * 257);	/* to the point */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none' AND last_t_ns = %lld", sb,
			  (long long)(t0 + 20 * S)), 1);
	meter_free(m);
}

/*
 * A meter that would begin tracking a sandbox from the ledger's point at the tick that holds a
 * forward step (billed to the second before it) leaves it to the next tick: that tick places no
 * change in the frame before a backward step, so a change of the point's generation logged
 * before one read past the point, was not taken as in it, and was applied again after the step.
 * One of node 0's two meters, its windows refused, read a paused sandbox from the ledger at such a
 * tick; its boot, logged before a 1,414 s backward step, read 1,414 s late, and 4.42 s of paused
 * time were billed as running (kiln-sim seed 31145, +1,217 µcr). Here the sandbox runs from 0,
 * the wall clock steps back 100 s at 5, the sandbox pauses at 8 (128 MiB), the node's meter A
 * bills it to 70 and stops at 75, the wall clock steps 300 s forward at 75, and the node's meter
 * B, without Postgres until then, reads it at the tick that sees the step; the sandbox stops at
 * 100. Before, B billed 75 to 100 as running: 17,057 µcr for 13,832.
 */
static void test_a_sandbox_first_read_at_a_forward_steps_tick_keeps_its_points_state(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	meter_set_backends(b, dead, rds);
	for (int i = 1; i <= 110; i++) {
		if (i == 6)
			fake_now -= 100 * S;	/* at 5, the wall clock steps back 100 s */
		if (i == 9)
			pause_into(t, sb, "snap_h", 128);	/* at 8 */
		if (i == 76) {	/* at 75: meter A stops, the wall clock steps forward */
			meter_free(a);
			a = NULL;
			fake_now += 300 * S;
			meter_set_backends(b, pg, rds);
		}
		if (i == 101)
			stop_sandbox(sb, fake_now);	/* at 100 */
		fake_now += S;
		fake_mono += S;
		if (a)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (i < 76)
			(void)meter_tick(b, &err);
		else
			CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	/* 8 s running, 92 s paused at 128 MiB */
	CHECK_INT(used(t), 8 * 257 + 92 * 128);
	CHECK_INT(meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", sb), 0);
	meter_free(b);
	pg_free(dead);
}

/*
 * A sandbox's changes logged before a backward step and read after it are placed no later than
 * the changes logged after it: the offset after the step put them before the tick, so they were
 * read in the frame after the step, late by the step. Node 1's meter, down across a sandbox's
 * move to node 1 and restarted 176 s after a 601 s backward step, read a resume on node 0 logged
 * 434 s before the step at 30.5 s past the move, and billed the moved generation from there
 * (kiln-sim seed 31140, -13,657 µcr). Here the sandbox runs on A from 0 and pauses at 40 (128
 * MiB), the wall clock steps back 50 s at 50, B's meter has no Postgres from 55 to 95, the
 * sandbox resumes on B at 60 and stops at 110. B read the creation at 50 and the pause at 90,
 * and billed generation 2 from 90: 20 s of 50 (5,140 µcr for 12,850).
 */
static void test_a_change_logged_before_a_backward_step_reads_before_the_later_ones(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);

	two_nodes_start(&c, t0, true, 0);
	for (int i = 1; i <= 125; i++) {
		if (i == 41)
			pause_into(c.t, c.sb, "snap_p", 128);	/* at 40, on A */
		if (i == 51)
			fake_now -= 50 * S;	/* at 50, the wall clock steps back 50 s */
		if (i == 56)
			meter_set_backends(c.b, dead, rds);	/* B without Postgres at 55 */
		if (i == 61)	/* at 60, resumed on B: a new generation there */
			sql("UPDATE sandboxes SET state = 'running', generation = 2, "
			    "pause_snapshot = NULL, node_id = '%s', "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    c.nb, (long long)(fake_now / 1000), c.sb);
		if (i == 96)
			meter_set_backends(c.b, pg, rds);	/* back at 95 */
		if (i == 111)
			stop_sandbox(c.sb, fake_now);	/* at 110 */
		fake_now += S;
		fake_mono += S;
		CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		if (i >= 56 && i < 96)
			(void)meter_tick(c.b, &err);
		else
			CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	CHECK_INT(gen_ucr(c.sb, 2), 50 * 257);
	/* 40 s running and 20 s paused at 128 MiB on A, 50 s running on B */
	CHECK_INT(used(c.t), 90 * 257 + 20 * 128);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	CHECK_INT(meter_pending(c.b, c.t), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", c.sb), 0);
	meter_free(c.b);
	meter_free(c.a);
	pg_free(dead);
}

/*
 * The one meter of a sandbox's node, without Postgres from `down` to `up` s, bills it running
 * from 0; the wall clock steps back 100 s at 5, the sandbox pauses at `pause` s (128 MiB) and
 * stops, the stop logged after the pause but stamped `early` s before it (the log's times are
 * not monotone in its sequence: a lost row takes its node's last heartbeat, a vCPU stop the
 * node's own clock). Returns what the tenant was charged.
 */
static long long stop_stamped_before_its_pause(int down, int up, int pause, int early)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;
	long long charged;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= up + 20; i++) {
		if (i == 6)
			fake_now -= 100 * S;	/* at 5, the wall clock steps back 100 s */
		if (i == down + 1)
			meter_set_backends(m, dead, rds);
		if (i == pause + 1)
			pause_into(t, sb, "snap_o", 128);
		if (i == pause + 2)	/* logged after the pause, stamped before it */
			stop_sandbox(sb, fake_now - (early + 1) * S);
		if (i == up + 1)
			meter_set_backends(m, pg, rds);
		fake_now += S;
		fake_mono += S;
		if (i > down && i <= up)
			(void)meter_tick(m, &err);
		else
			CHECK_INT(meter_tick(m, &err), KILN_OK);
	}
	charged = used(t);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", sb), 0);
	meter_free(m);
	pg_free(dead);
	return charged;
}

/*
 * A change that reads past a change of its sandbox logged after it by a few seconds stays where
 * it reads: the log's times are not monotone in its sequence. With the step's tolerance (0.5 s)
 * in place of LOG_ORDER_TOLERANCE_NS, a pause at 30 that a stop stamped 2 s before it followed
 * was moved into the frame before a backward step at 5 (100 s early) and raised to the point at
 * 20: 6,164 µcr, 8 s of running time billed as paused. Not moved, the stop ends the generation
 * where it reads, at 28, as it did before log_place(): 7,196 µcr.
 */
static void test_a_change_stamped_a_little_after_a_later_one_keeps_its_frame(void)
{
	CHECK_INT(stop_stamped_before_its_pause(20, 50, 30, 2), 28 * 257);
}

/*
 * Nor is a change moved into the frame before a backward step when it was logged LOG_LATE_NS or
 * more after that step (its sequence past the one read then), however much earlier a later change
 * is stamped: without that bound, a pause at 120 that a stop stamped 30 s before it followed
 * (the tolerance is 20 s) moved into the frame before the step at 5, 100 s early, raised to the
 * point at 70: 20 s of running time billed as paused (20,550 µcr for 23,130).
 */
static void test_a_change_logged_long_after_a_backward_step_is_not_moved_before_it(void)
{
	CHECK_INT(stop_stamped_before_its_pause(70, 130, 120, 30), 90 * 257);
}

/*
 * A change read between the tick's billing end (its label less the wait for a transaction still
 * open, m->lag) and its label stays where it reads: it was logged in this frame, not before a
 * backward step. Placed by that billing end, such a change that the offset after a backward step
 * put just past it was moved into the frame before the step, the step's size early. Here the
 * sandbox runs from 0, the wall clock steps back 100 s at 5, a transaction stays open 3 s (real
 * time) from 15 to 25, the sandbox pauses at 20 (128 MiB) and stops at 40. Before, the pause
 * read 100 s early and was raised to the sandbox's point, about 3 s before it: 7,306 µcr for
 * 7,700.
 */
static void test_a_change_read_within_the_commit_lag_keeps_its_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *own = pg_new(meter_db_url, 1);
	struct pg_conn *open_tx = NULL;
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 50; i++) {
		if (i == 6)
			fake_now -= 100 * S;	/* at 5, the wall clock steps back 100 s */
		if (i == 16) {	/* at 15: billing waits for a transaction open 3 s */
			CHECK(pg_acquire(own, &open_tx, &err) == KILN_OK);
			CHECK(open_tx && pg_exec(open_tx, "BEGIN; SELECT 1", &err) == KILN_OK);
			nanosleep(&(struct timespec){ .tv_sec = 3 }, NULL);
		}
		if (i == 21)
			pause_into(t, sb, "snap_l", 128);	/* at 20 */
		if (i == 26 && open_tx) {
			CHECK(pg_exec(open_tx, "ROLLBACK", &err) == KILN_OK);
			pg_release(own, open_tx);
			open_tx = NULL;
		}
		if (i == 41)
			stop_sandbox(sb, fake_now);	/* at 40 */
		fake_now += S;
		fake_mono += S;
		CHECK_INT(meter_tick(m, &err), KILN_OK);
	}
	/* 20 s running, 20 s paused at 128 MiB */
	CHECK_INT(used(t), 20 * 257 + 20 * 128);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
	pg_free(own);
}

/*
 * A generation left short of its end in the ledger, read again by a live meter of its node long
 * after a backward step it followed, has the changes it logged before the step placed no later
 * than the sandbox's later ones: the offset after the step put them before the tick, past the
 * ledger's point, and they were applied again. A meter of node 0 that tracked a sandbox again from
 * its generation 1's point, short of its end, 395 s after a 443 s backward step read that
 * generation's pause, logged 107 s before the step, 443 s late, and billed generation 1 a second
 * time, paused from the point to its "creation" and running to its "pause" (kiln-sim seed 31121,
 * +161,538 µcr). Here meter a flushes [0, 10) and crashes at 12; the sandbox pauses at 15 into
 * 512 MiB and is resumed at 40 (generation 2); the wall clock steps back 60 s at 50; meter b,
 * without Postgres from 3 to 85, has its first generation's windows refused (a's [0, 10)) and
 * reads the sandbox from generation 1's point at 10 (its tick at 85), the creation at 60, the
 * pause at 75 and the resume at 40 (the offset after the step put it past the tick). The
 * sandbox stops at 110. Before, b billed generation 1 running from 10 to 75 and generation 2
 * from 75: 28,270 µcr for 34,645.
 */
static void test_a_short_generations_changes_read_long_after_a_backward_step_keep_their_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 125; i++) {
		if (i == 4)
			meter_set_backends(b, dead, rds);
		if (i == 13) {
			meter_free(a);	/* a crash at 12, [0, 10) flushed */
			a = NULL;
		}
		if (i == 16)
			pause_into(t, sb, "snap_s", 512);	/* at 15 */
		if (i == 41)	/* at 40, resumed: a new generation */
			sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), sb);
		if (i == 51)
			fake_now -= 60 * S;	/* at 50, the wall clock steps back 60 s */
		if (i == 86)
			meter_set_backends(b, pg, rds);
		if (i == 111)
			stop_sandbox(sb, fake_now);	/* at 110 */
		fake_now += S;
		fake_mono += S;
		if (a)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (i < 86)
			(void)meter_tick(b, &err);
		else
			CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	/* 15 s running and 25 s paused at 512 MiB in generation 1, 70 s running in generation 2 */
	CHECK_INT(gen_ucr(sb, 1), 15 * 257 + 25 * 512);
	CHECK_INT(used(t), 85 * 257 + 25 * 512);
	CHECK_INT(meter_pending(b, t), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", sb), 0);
	meter_free(b);
	pg_free(dead);
}

/*
 * The sequence bound is read only at a tick that reaches Postgres LOG_LATE_NS or more after the
 * step; a meter without Postgres across the step reads it when Postgres is back, so a change
 * logged in between has no bound, and only the step's own instant keeps it from the frame before
 * the step: the meter down from 3 to 130 across the step at 5, a pause at 120 that a stop
 * stamped 30 s before it followed (past the 20 s tolerance) was moved into the frame before the
 * step, although its time after the step's offset is past the step, 100 s early and raised to
 * the point at 3: 14,100 µcr for 23,130.
 */
static void test_a_change_logged_after_a_backward_step_while_down_is_not_moved_before_it(void)
{
	CHECK_INT(stop_stamped_before_its_pause(3, 130, 120, 30), 90 * 257);
}

/*
 * After a backward step of the wall clock (100 s at 12 s), a sandbox created at the tick's label
 * while a transaction held open 3 s makes the tick bill up to 3 s behind its label (the commit
 * high-water mark): its times read at the label, in the frame in force. Before, read against the
 * high-water mark, its creation (ahead of that by more than a step's tolerance) was read in the
 * frame before the step, 100 s early, and billed from there: 38,550 µcr for 12,850.
 */
static void test_a_change_between_the_high_water_mark_and_the_label_reads_in_the_frame_in_force(void)
{
	char t[32], sb[32], t2[32], sb2[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg_conn *hold = NULL;
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	new_tenant(t2, sizeof(t2));
	grant(t2, 1000000000LL, 0, "a");
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 31) {			/* at 30 */
			hold = conn();
			CHECK_INT(pg_exec(hold, "BEGIN; SELECT 1", &err), KILN_OK);
			sleep(3);
			new_sandbox(t2, sb2, sizeof(sb2), fake_now);
		}
		if (i == 34) {
			CHECK_INT(pg_exec(hold, "ROLLBACK", &err), KILN_OK);
			pg_release(pg, hold);
		}
		tick_both(m);
	}
	CHECK_INT(used(t2), 50 * 257);	/* from 30 to 80 */
	CHECK_INT(meter_pending(m, t2), 0);
	CHECK_INT(redis_bal(t2, &ok), ledger_bal(t2));
	meter_free(m);
}

/*
 * A sandbox paused at 5 s, before a 100 s backward step at 12 s, its meter crashed at 24 s ([10,
 * 20) flushed: the ledger's point paused at 20 s), 50 s more back at 35 s with no meter, the
 * restart at `restart` in the node's frame. Its pause was logged before the frame's own backward
 * step, in the frame before it (its log sequence not above meter_clocks.log_seq): read in the
 * saved frame, it stood 100 s late, past the point and before the restart, was not taken as in
 * the point and was applied again.
 */
static void paused_before_the_frames_step_then_stepped_back_while_down(int restart)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-old-frame";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 200; i++) {
		if (i == 6)
			pause_into(t, sb, "snap", 64);	/* at 5 */
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 36)
			fake_now -= 50 * S;	/* at 35, 50 s more back, no meter */
		if (i == restart + 1)
			m = new_meter_with(true, 0);	/* restarted in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 5 * 257 + 195 * 64);	/* running to 5, its snapshot after, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/* Before, 14,730 µcr for 13,765 whether restarted at 110 or 130 s: 5 s more of the pause's running
 * memory (257 - 64 µcr/s) from the point at 20 s. */
static void test_a_change_logged_before_the_frames_own_step_keeps_its_older_frame(void)
{
	paused_before_the_frames_step_then_stepped_back_while_down(110);
	paused_before_the_frames_step_then_stepped_back_while_down(130);
}

/*
 * A change logged in the frame, after its own backward step but before the frame's last flush,
 * keeps the frame's offset at a restart after a backward step made while no meter ran: the
 * frame's log sequence is the one when its offset began (the step seen), not at each flush.
 * Running from 0, 100 s back at 12 s, the meter without Postgres from 19 s to 23 s (the window
 * [10, 20) flushed late, at 23 s), the sandbox stopped at 22 s (after the ledger's point at 20 s,
 * logged before that flush), a crash at 24 s, 50 s more back at 35 s, the restart at 40 s. With
 * the sequence taken at every flush, the stop lost the frame's offset, read 100 s early, before
 * the point, and was taken as in it: 20 s billed for 22 (5,140 µcr for 5,654).
 */
static void test_a_change_logged_in_the_frame_before_its_last_flush_keeps_the_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-frame-flushed";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 120; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 20)
			meter_set_backends(m, dead, rds);	/* no Postgres from 19 */
		if (i == 23)
			stop_sandbox(sb, fake_now);	/* at 22, in the frame */
		if (i == 24)
			meter_set_backends(m, pg, rds);	/* back at 23: [10, 20) flushed */
		if (i == 25) {			/* a crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 36)
			fake_now -= 50 * S;	/* at 35, 50 s more back, no meter */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40, in the frame */
		if (m && i >= 20 && i < 24) {
			tick_maybe(m);
		} else if (m) {
			tick_both(m);
		} else {
			fake_now += S;
			fake_mono += S;
		}
	}
	boot = NULL;
	CHECK_INT(used(t), 22 * 257);	/* to the stop, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none' AND last_t_ns = %lld", sb,
			  (long long)(t0 + 22 * S)), 1);
	meter_free(m);
	pg_free(dead);
}

/*
 * As test_a_change_logged_in_the_frame_before_its_last_flush_keeps_the_frame, the backward step
 * made in the outage (100 s back at 20 s, no Postgres from 19 s to 23 s), the stop logged at 22 s
 * before the meter reached Postgres again: the frame's sequence is the one read at the last tick
 * before the step, not at the first after it that reached Postgres. Read there, the stop was
 * logged below it, lost the frame's offset at the restart, read 100 s early, before the ledger's
 * point at 20 s, and was taken as in it: 5,140 µcr for 5,654.
 */
static void test_a_change_logged_before_the_first_tick_to_reach_postgres_after_a_step_keeps_the_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-step-in-outage";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 120; i++) {
		if (i == 20)
			meter_set_backends(m, dead, rds);	/* no Postgres from 19 */
		if (i == 21)
			fake_now -= 100 * S;	/* at 20, the wall clock steps back 100 s */
		if (i == 23)
			stop_sandbox(sb, fake_now);	/* at 22, in the frame */
		if (i == 24)
			meter_set_backends(m, pg, rds);	/* back at 23: [10, 20) flushed */
		if (i == 25) {			/* a crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 36)
			fake_now -= 50 * S;	/* at 35, 50 s more back, no meter */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40, in the frame */
		if (m && i >= 20 && i < 24) {
			tick_maybe(m);
		} else if (m) {
			tick_both(m);
		} else {
			fake_now += S;
			fake_mono += S;
		}
	}
	boot = NULL;
	CHECK_INT(used(t), 22 * 257);	/* to the stop, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
	pg_free(dead);
}

/*
 * A forward step within the lead a backward step left keeps the frame the backward step began:
 * the node's saved frame keeps its log sequence (meter_clocks.log_seq). Begun again at the
 * forward step, a change logged between the two steps, read at a restart after a backward step
 * made while no meter ran, lost the frame's offset and read at offset 0, the whole lead early,
 * not only the forward step's size.
 */
static void test_a_forward_step_within_the_lead_keeps_the_frames_log_seq(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	long long at_back = -1;
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-fwd-in-lead";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 40; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 23)
			stop_sandbox(sb, fake_now);	/* at 22, in the frame */
		if (i == 26)
			at_back = sql_int("SELECT log_seq FROM meter_clocks WHERE node_id = '%s'", node);
		if (i == 28)
			fake_now += 30 * S;	/* at 27, 30 s forward, within the lead */
		tick_both(m);
	}
	boot = NULL;
	CHECK(at_back > 0);
	CHECK_INT(sql_int("SELECT log_seq FROM meter_clocks WHERE node_id = '%s'", node), at_back);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s' "
			  "AND seq > %lld", sb, at_back), 1);	/* the stop, in the frame */
	meter_free(m);
}

/* A sandbox of a node whose changes are not witnessed, running from 0 and stopped at `stop` s; the
 * wall clock steps back `back1` s at `back1_at` s and `back2` s more at `back2_at` s (the tick then
 * follows it and saves the node's frame), the meter crashes at back2_at + 1 s and restarts in that
 * frame at `restart` s. The sandbox must be billed to its stop, once. */
struct back_restart {
	int stop, back1_at, back1, back2_at, back2, restart;
};

static void stopped_before_a_step_the_restarted_meters_frame_began_at(const struct back_restart *x)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-frame-back-step";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= x->restart + 30; i++) {
		if (i == x->stop + 1)
			stop_sandbox(sb, fake_now);
		if (i == x->back1_at + 1)
			fake_now -= x->back1 * S;
		if (i == x->back2_at + 1)
			fake_now -= x->back2 * S;
		if (i == x->back2_at + 2) {	/* a crash */
			meter_free(m);
			m = NULL;
		}
		if (i == x->restart + 1)
			m = new_meter_with(true, 0);	/* restarted in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), x->stop * 257);	/* to the stop, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * 100 s back at 12 s, the stop at 52 or 55 s, 30 s more back at 56 s (the frame's offset 130 s),
 * the restart at 58 or 90 s. The stop, logged before the frame's step, after the ledger's point at
 * 50 s, is read in the frame before that step, at offset 100 s. Read at offset 0, the offset
 * before any step the restarted meter knew of, it stood 100 s early, before the point, and was
 * taken as in it: the sandbox ended at 50 s, 12,850 µcr for 13,364 and 14,135 (kiln-sim seed
 * 77018: a running sandbox's start a second before a -270 s step, 3,097 s early, its running time
 * billed in no state, -45,367 µcr). At 52 s it was logged no later than the sequence read before
 * the tick that last read the wall clock before the step (the frame's saved `pre`): read in the
 * frame before it even when the frame's own offset puts it before the restart (at 90 s: 82 s,
 * 30 s late, 21,074 µcr without the bound).
 */
static void test_a_change_logged_before_the_frames_step_keeps_the_frame_before_it_at_a_restart(void)
{
	stopped_before_a_step_the_restarted_meters_frame_began_at(&(struct back_restart){
		.stop = 52, .back1_at = 12, .back1 = 100, .back2_at = 56, .back2 = 30,
		.restart = 58 });
	stopped_before_a_step_the_restarted_meters_frame_began_at(&(struct back_restart){
		.stop = 55, .back1_at = 12, .back1 = 100, .back2_at = 56, .back2 = 30,
		.restart = 58 });
	stopped_before_a_step_the_restarted_meters_frame_began_at(&(struct back_restart){
		.stop = 52, .back1_at = 12, .back1 = 100, .back2_at = 56, .back2 = 30,
		.restart = 90 });
}

/*
 * The stop at 51 s, before both steps (100 s back at 52 s, 50 s more at 54 s), the restart at
 * 160 s: logged before the frame before the frame's own step began, it is not read in that frame
 * (its offset 100 s) but at offset 0. Read there, it stood 100 s late, before the restart, and the
 * sandbox was billed 100 s past its stop (38,807 µcr for 13,107).
 */
static void test_a_change_logged_before_the_frame_before_the_frames_step_keeps_its_own(void)
{
	stopped_before_a_step_the_restarted_meters_frame_began_at(&(struct back_restart){
		.stop = 51, .back1_at = 52, .back1 = 100, .back2_at = 54, .back2 = 50,
		.restart = 160 });
}

/*
 * A frame begun by a backward step made while no meter of the node ran carries that step too: a
 * sandbox of a node whose changes are not witnessed runs from 0; 100 s back at 12 s (followed);
 * the meter crashes at 21 s ([10, 20) flushed); the sandbox stops at 24 s; 50 s more back at
 * 26 s; the meter restarts at 28 s, reads the stop in the frame before the step (at 24 s) and
 * saves its frame (offset 150 s) before its first flush; it crashes at 29 s and restarts at 31 s
 * in that frame. The stop, after the ledger's point at 20 s, must read at 24 s there too: with no
 * step saved by the first restart, the second read it at offset 0, 100 s early, before the point,
 * and ended the sandbox there (5,140 µcr for 6,168).
 */
static void test_a_frame_begun_by_a_step_while_down_keeps_the_frame_before_it(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-frame-while-down";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* at 12 */
		if (i == 22 || i == 30) {	/* crashes at 21 and 29 */
			meter_free(m);
			m = NULL;
		}
		if (i == 25)
			stop_sandbox(sb, fake_now);	/* at 24, no meter */
		if (i == 27)
			fake_now -= 50 * S;	/* at 26, no meter */
		if (i == 29 || i == 32)
			m = new_meter_with(true, 0);	/* restarted at 28 and 31, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 24 * 257);	/* to the stop, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A forward step that takes the whole lead back ends the frame its backward steps began: 100 s
 * back at 10 s, 50 s more at 20 s, 150 s forward at 30 s (offset 0 again); the sandbox, of a
 * node whose changes are not witnessed, stops at 35 s; the meter crashes at 36 s ([20, 30)
 * flushed); 200 s back at 40 s, no meter; the restart at 150 s. The frame saved after the
 * forward step carries no backward step: kept, the first tick in it read the stop with that
 * step's offset (100 s), as logged before the step, and billed to 135 s (34,695 µcr for 8,995).
 */
static void test_a_forward_step_taking_the_lead_back_drops_the_frames_backward_step(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-lead-back";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 180; i++) {
		if (i == 11)
			fake_now -= 100 * S;	/* at 10 */
		if (i == 21)
			fake_now -= 50 * S;	/* at 20 */
		if (i == 31)
			fake_now += 150 * S;	/* at 30, the whole lead back */
		if (i == 36)
			stop_sandbox(sb, fake_now);	/* at 35 */
		if (i == 37) {			/* a crash at 36 */
			meter_free(m);
			m = NULL;
		}
		if (i == 41)
			fake_now -= 200 * S;	/* at 40, no meter */
		if (i == 151)
			m = new_meter_with(true, 0);	/* restarted at 150, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 35 * 257);	/* to the stop, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A sandbox's changes from before its node's point, first read by a later tick of a restarted
 * meter, are in that point: the sandbox runs from 0, the wall clock steps 168 s back at 34 s, it
 * pauses at 73 s into 64 MiB (logged 95 s before its start on the wall clock); the meter crashes
 * at 303 s ([290, 300) flushed: the ledger's point paused at 300 s) and restarts at 304 s in its
 * node's frame, whose first tick reads the log from 72 s on the wall clock, neither change. At
 * 340 s another tenant's sandbox, made at 220 s on another node, moves here: the read goes down
 * to its creation, and reaches the running change (0 s on the wall clock), not the pause. That
 * change, logged before the frame's last flush and placed before the point, is in it. Before, it
 * passed as new, clamped to the point's time: the paused sandbox billed as running from there to
 * its stop at 380 s (kiln-sim seed 77085: 388 s, +793,895 µcr; 46,129 µcr for 38,409).
 */
static void test_a_change_before_the_point_read_late_by_a_restarted_meter_is_in_it(void)
{
	char t[32], sb[32], t2[32], sb2[32], here[32], there[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	snprintf(here, sizeof(here), "%s", node);
	(void)aligned_now();	/* another node */
	snprintf(there, sizeof(there), "%s", node);
	snprintf(node, sizeof(node), "%s", here);
	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	new_tenant(t2, sizeof(t2));
	grant(t2, 1000000000LL, 0, "a");
	boot = "test-boot-point-read-late";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 400; i++) {
		if (i == 35)
			fake_now -= 168 * S;	/* at 34 */
		if (i == 74)
			pause_into(t, sb, "snap", 64);	/* at 73 */
		if (i == 221)	/* at 220, on another node */
			new_sandbox_at(t2, sb2, sizeof(sb2), there, "running", fake_now, NULL, 0);
		if (i == 304) {			/* a crash at 303 */
			meter_free(m);
			m = NULL;
		}
		if (i == 305)
			m = new_meter_with(true, 0);	/* restarted at 304, in the frame */
		if (i == 341)
			move_to(sb2, node, fake_now);	/* at 340, here */
		if (i == 381)
			stop_sandbox(sb, fake_now);	/* at 380 */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 73 * 257 + 307 * 64);	/* running to 73, paused to 380 */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * paused_before_the_frames_step_then_stepped_back_while_down()'s case with a forward step within
 * the lead while down (30 s at 35 s) in place of the backward one: the pause, logged before the
 * frame's own backward step, is not read in the saved frame's offset the forward step keeps, but
 * at offset 0. Read there, it stood 100 s late, past the ledger's point, and was applied again:
 * 14,730 µcr for 13,765.
 */
static void test_a_change_logged_before_the_frames_own_step_keeps_it_after_a_forward_step_while_down(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-old-frame-fwd";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 200; i++) {
		if (i == 6)
			pause_into(t, sb, "snap", 64);	/* at 5 */
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 36)
			fake_now += 30 * S;	/* at 35, 30 s forward, within the lead, no meter */
		if (i == 111)
			m = new_meter_with(true, 0);	/* restarted at 110, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 5 * 257 + 195 * 64);	/* running to 5, its snapshot after, once */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A running sandbox deleted while no meter of the node ran (its meter crashed at 24 s, after a
 * 100 s backward step at 12 s), one update setting its state time to 28 s and its deletion to
 * 30 s: the log row says deleted at 28 s, the earlier; no log row has the row's deletion time.
 * 50 s more back at 35 s, the restart at 40 s in the frame. The deletion time, its log sequence
 * unknown, reads in the saved frame as any change does, at 30 s.
 */
static void test_a_row_time_without_its_log_row_reads_in_the_saved_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-row-time";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 31)			/* at 30, deleted, its state time 28 */
			sql("UPDATE sandboxes SET state_changed_at = to_timestamp(%lld / 1e6), "
			    "deleted_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)((fake_now - 2 * S) / 1000), (long long)(fake_now / 1000), sb);
		if (i == 36)
			fake_now -= 50 * S;	/* at 35, 50 s more back, no meter */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 28 * 257);	/* to the deletion's log time */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A generation of a node left short of its end in the ledger, the sandbox gone to another node,
 * is found by the node's meter however far its windows' labels run ahead of the log's wall-clock
 * times: found when its end is not recorded, not when "no window reaches the next change" (a
 * label against a wall-clock time; kiln-sim `clock`, seed 31121: labels 3,467 s ahead after
 * backward steps, a paused tail of 18.8 s never billed). Here the wall clock steps back 60 s at
 * 2, every meter following it (labels 60 s ahead from there). Meters a1 and a2 of node A, b of
 * node B; on labels: a2 without Postgres from 3 to 35; a1 flushes [0, 10) and crashes at 12;
 * the sandbox pauses at 15 into 512 MiB, resumes at 20 (generation 2) and moves to B at 25
 * (generation 3); a2, back at 36, has generation 1 refused (a1's [0, 10)) and generation 2
 * taken, and re-reads from the ledger: generation 1's point, running at 10, is short. Before,
 * a1's window ending at 10 (a label) stood past the pause's wall-clock time, the stretch read as
 * covered, and [10, 20) was never billed.
 */
static void test_a_short_generation_gone_from_its_node_after_a_backward_step_is_billed_on(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a2;

	two_nodes_start(&c, t0, true, 0);
	a2 = new_meter_with(true, 0);	/* node A's second meter */
	for (int i = 1; i <= 60; i++) {
		if (i == 3)
			fake_now -= 60 * S;	/* at 2, the wall clock steps back 60 s */
		if (i == 4)
			meter_set_backends(a2, dead, rds);
		if (i == 13) {
			meter_free(c.a);	/* a crash at 12, [0, 10) flushed */
			c.a = NULL;
		}
		if (i == 16)
			pause_into(c.t, c.sb, "snap_a", 512);	/* at 15 */
		if (i == 21)	/* at 20, resumed on A: a new generation */
			sql("UPDATE sandboxes SET state = 'running', generation = 2, pause_snapshot = NULL, "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), c.sb);
		if (i == 26)
			move_to(c.sb, c.nb, fake_now);	/* at 25 */
		if (i == 37)
			meter_set_backends(a2, pg, rds);
		if (i == 46)
			stop_sandbox(c.sb, fake_now);	/* at 45, on B */
		fake_now += S;
		fake_mono += S;
		if (c.a)
			CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		if (i >= 4 && i < 37)
			(void)meter_tick(a2, &err);
		else
			CHECK_INT(meter_tick(a2, &err), KILN_OK);
		CHECK_INT(meter_tick(c.b, &err), KILN_OK);
	}
	/* generation 1: 15 s running, 5 s paused at 512, and its end recorded; generation 2: 5 s */
	CHECK_INT(gen_ucr(c.sb, 1), 15 * 257 + 5 * 512);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 1 AND state = 'none'", c.sb), 1);
	CHECK_INT(gen_ucr(c.sb, 2), 5 * 257);
	CHECK_INT(used(c.t), 40 * 257 + 5 * 512);
	CHECK_INT(meter_pending(a2, c.t), 0);
	meter_free(a2);
	meter_free(c.b);
	pg_free(dead);
}

/*
 * A change logged before the saved frame's own backward step (its log sequence not above
 * meter_clocks.log_seq) is not moved into that frame by a later change it reads past: it goes to
 * the offset-0 frame. Paused at 5 s (64 MiB), 100 s back at 12 s, a crash at 24 s ([10, 20)
 * flushed: the ledger's point paused at 20 s), 50 s more back at 35 s with no meter, stopped at
 * 110 s (in the current frame), the restart at 160 s in the saved frame: the pause, read with the
 * offset in force, stands at 155 s, more than LOG_ORDER_TOLERANCE_NS past the stop at 110 s, and
 * is placed at 5 s, in the ledger's point. Moved into the saved frame instead, it stood at 105 s,
 * past the point, and was applied again: 8,970 µcr for 8,005.
 */
static void test_an_older_change_read_past_a_later_one_is_not_moved_into_the_saved_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-old-frame-later";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 200; i++) {
		if (i == 6)
			pause_into(t, sb, "snap", 64);	/* at 5 */
		if (i == 13)
			fake_now -= 100 * S;	/* at 12, the wall clock steps back 100 s */
		if (i == 25) {			/* a crash at 24 ([10, 20) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 36)
			fake_now -= 50 * S;	/* at 35, 50 s more back, no meter */
		if (i == 111)
			stop_sandbox(sb, fake_now);	/* at 110, no meter */
		if (i == 161)
			m = new_meter_with(true, 0);	/* restarted at 160, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 5 * 257 + 105 * 64);	/* running to 5, its snapshot to the stop */
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A row's time that is the time of a log row log_place() moved reads where that log row is
 * placed: the row's end agrees with the log's. Running from 0, its one meter without Postgres
 * from 35 s to 105 s, stopped at 40 s, 50 s back at 50 s, deleted at 60 s (deleted_at only, its
 * state time still the stop's). At 105 s the stop reads with the offset in force at 90 s, more
 * than LOG_ORDER_TOLERANCE_NS past the deletion at 60 s, and is placed at 40 s, in the frame
 * before the step; the row's end (its state time, the stop's) reads there too. Read with the stop's
 * sequence alone, the row's end stood at 90 s, behind the deletion at 60 s: the generation was
 * billed alike (10,280 µcr) but ended at 60 s, after 20 s in no state, not at the stop.
 */
static void test_a_rows_time_reads_where_its_moved_log_row_is_placed(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 130; i++) {
		if (i == 36)
			meter_set_backends(m, dead, rds);	/* without Postgres at 35 */
		if (i == 41)
			stop_sandbox(sb, fake_now);	/* at 40 */
		if (i == 51)
			fake_now -= 50 * S;	/* at 50, the wall clock steps back 50 s */
		if (i == 61)			/* at 60, deleted: deleted_at only */
			sql("UPDATE sandboxes SET deleted_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    (long long)(fake_now / 1000), sb);
		if (i == 106)
			meter_set_backends(m, pg, rds);	/* back at 105 */
		fake_now += S;
		fake_mono += S;
		if (i > 35 && i <= 105)
			(void)meter_tick(m, &err);
		else
			CHECK_INT(meter_tick(m, &err), KILN_OK);
	}
	CHECK_INT(used(t), 40 * 257);	/* to the stop */
	/* Its generation ended at the stop's placed time, not at the deletion. */
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none' AND last_t_ns = %lld", sb,
			  (long long)(t0 + 40 * S)), 1);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
	pg_free(dead);
}

/*
 * A meter restarted in its node's frame after a backward step of the wall clock made while it was
 * down reads a change logged before its node's last flush in the frame before that step, even
 * when the frame after it puts the change no later than the tick: that flush's tick read the log's
 * sequence (meter_clocks.tick_seq), and every change logged no later came before the step.
 * Kiln-sim seed 31150: a sandbox of node 0 created, booted and paused 440 s before a -433 s step,
 * made while one meter of the node was down and the other without Postgres; the restarted meter,
 * tracking it from the ledger's point (paused), read its creation, boot and pause 433 s late,
 * past the point and before its first tick, and billed 4.1 s of running time again (+9,974 µcr).
 * Here running from 0, paused at 5 (128 MiB), a crash at 44 ([30, 40) flushed: the point paused at
 * 40), the wall clock 45 s back at 50, stopped at 55 (logged while down, after the step), the
 * restart at 60: by the tick alone, its start read at 45 and its pause at 50, and [45, 50) was
 * billed as running again (8,330 µcr for 7,685). The stop, logged after the saved flush's tick,
 * reads in the frame after the step, at 55: with a bound read later than that tick (this
 * restart's own first tick), it read at 10, before the point, taken as in it, and [40, 55) went
 * unbilled (5,765 µcr).
 */
static void test_a_change_logged_before_the_last_flush_keeps_its_frame_after_a_step_while_down(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-flush-seq";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 130; i++) {
		if (i == 6)
			pause_into(t, sb, "snap_f", 128);	/* at 5 */
		if (i == 45) {			/* a crash at 44 ([30, 40) flushed) */
			meter_free(m);
			m = NULL;
		}
		if (i == 51)
			fake_now -= 45 * S;	/* at 50, the wall clock steps back 45 s, no meter */
		if (i == 56)
			stop_sandbox(sb, fake_now);	/* at 55 (wall 10), while down */
		if (i == 61)
			m = new_meter_with(true, 0);	/* restarted at 60, in the frame */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 5 * 257 + 50 * 128);	/* 5 s running, 50 s paused, once */
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", sb), 0);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * Two restarts, each after a backward step of the wall clock made while the meter was down, and a
 * change logged between the first step and the first restart: the frame begun at that restart
 * takes the sequence read at its first tick (meter_clocks.log_seq), so the change is at or below
 * it, and at the second restart it is read in the frame before the first step (node_time_logged()),
 * the first step's size early: in the point the first restart's flush saved with that frame, as
 * it was. By the tick alone, the second restart read it, and the changes after it, the second
 * step's size late, past the point. Here running from 0, a crash at 44 ([30, 40) flushed), 45 s
 * back at 50, paused at 55 (wall 10), the restart at 60, resumed at 70 and paused again at 75, a
 * crash at 84 ([70, 80) flushed: the point paused at 80), 30 s back at 90, the restart at 120,
 * stopped at 140: by the tick alone, the resume read at 100 and the pause at 105, and [100, 105)
 * was billed running again (26,305 µcr for 25,660).
 */
static void test_a_change_logged_between_a_step_while_down_and_the_restart_keeps_its_time(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-two-restarts";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 160; i++) {
		if (i == 45 || i == 85) {	/* crashes at 44 and 84 */
			meter_free(m);
			m = NULL;
		}
		if (i == 51)
			fake_now -= 45 * S;	/* at 50, no meter */
		if (i == 56)
			pause_into(t, sb, "snap_f", 128);	/* at 55 (wall 10), while down */
		if (i == 61 || i == 121)
			m = new_meter_with(true, 0);	/* restarted at 60 and 120 */
		if (i == 71)
			resume(sb);			/* at 70 */
		if (i == 76)
			pause_into(t, sb, "snap_g", 128);	/* at 75 */
		if (i == 91)
			fake_now -= 30 * S;	/* at 90, no meter */
		if (i == 141)
			stop_sandbox(sb, fake_now);	/* at 140 */
		tick_if(m);
	}
	boot = NULL;
	/* running, paused, running, paused: each once */
	CHECK_INT(used(t), 55 * 257 + 15 * 128 + 5 * 257 + 65 * 128);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state <> 'none'", sb), 0);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * Ticks A and B over fake seconds `from` to `to` (both clocks), `at(i)` first in each; returns
 * how many sandboxes A still held an entry for after the last tick (meter_tracked_for_test).
 */
static size_t ticks_tracked(struct two_nodes *c, int from, int to,
			    void (*at)(struct two_nodes *c, int i))
{
	struct kiln_error err = { 0 };

	for (int i = from; i <= to; i++) {
		if (at)
			at(c, i);
		fake_now += S;
		fake_mono += S;
		CHECK_INT(meter_tick(c->a, &err), KILN_OK);
		CHECK_INT(meter_tick(c->b, &err), KILN_OK);
	}
	return meter_tracked_for_test(c->a);
}

/* At 10, restored on A (generation 2); the wall clock then steps 2 s back and the sandbox is
 * moved to B (generation 3), its change logged at or before generation 2's start. */
static void no_length_after_a_backward_step(struct two_nodes *c, int i)
{
	if (i != 11)
		return;
	sql("UPDATE sandboxes SET generation = 2, state_changed_at = to_timestamp(%lld / 1e6) "
	    "WHERE id = '%s'", (long long)(fake_now / 1000), c->sb);
	fake_now -= 2 * S;
	move_to(c->sb, c->nb, fake_now);
}

/*
 * A generation of no length on the label clock (its next change read at or before its start
 * after a backward step of the wall clock) is ended by its node's meter like any other: its end
 * is recorded as its point's mark (meter_sandboxes.ended, migrations/0049), and once flushed the
 * stretch is no longer read by that meter's ticks. Before, the tick's query took a generation as
 * ended only when its point in "none" billed something, so this one was read again on every
 * tick for as long as the sandbox lived (on B here), its entry never freed: A held 1 at 60 s.
 */
static void test_a_generation_of_no_length_is_not_read_after_its_end_is_flushed(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();

	two_nodes_start(&c, t0, true, 0);
	CHECK_INT(ticks_tracked(&c, 1, 60, no_length_after_a_backward_step), 0);
	CHECK_INT(gen_ucr(c.sb, 2), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 2 AND state = 'none' AND ended", c.sb), 1);
	/* and it stays so: no tick of A reads it again while the sandbox runs on B */
	CHECK_INT(ticks_tracked(&c, 61, 70, NULL), 0);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
}

/* Paused at 5 into 64 MiB on A; at 10 restored there, paused (generation 2); at 20 resumed on B
 * (generation 3). */
static void paused_only_generation(struct two_nodes *c, int i)
{
	if (i == 6)
		pause_into(c->t, c->sb, "snap", 64);
	if (i == 11)
		sql("UPDATE sandboxes SET generation = 2, state_changed_at = to_timestamp(%lld / 1e6) "
		    "WHERE id = '%s'", (long long)(fake_now / 1000), c->sb);
	if (i == 21)
		sql("UPDATE sandboxes SET state = 'running', generation = 3, node_id = '%s', "
		    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
		    c->nb, (long long)(fake_now / 1000), c->sb);
}

/*
 * A generation paused only, its snapshot priced 0, bills nothing; its end is recorded all the
 * same, and once flushed its node's meter no longer reads it. Before, its point in "none" billed
 * nothing and it was read on every tick while the sandbox ran on B: A held 1 at 60 s.
 */
static void test_a_paused_only_generation_priced_0_is_not_read_after_its_end_is_flushed(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();

	snap_price = 0;
	two_nodes_start(&c, t0, true, 0);
	CHECK_INT(ticks_tracked(&c, 1, 60, paused_only_generation), 0);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 2 AND state = 'none' AND ended", c.sb), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s' "
			  "AND generation = 2 AND ucr = 0 AND mem_byte_s = 0", c.sb),
		  sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s' "
			  "AND generation = 2", c.sb));
	/* 5 s running on A (its paused time free), 40 s running on B */
	CHECK_INT(used(c.t), 5 * 257 + 40 * 257);
	CHECK_INT(meter_pending(c.a, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
	snap_price = 1024;
}

/* To B at 10.5 (generation 2); back on A at 21 (generation 3), right after A flushed generation
 * 1's end (its window [10, 20) at 20); stopped at 40. */
static void away_and_back(struct two_nodes *c, int i)
{
	if (i == 11)
		move_to(c->sb, c->nb, fake_now + S / 2);
	if (i == 22)
		move_to(c->sb, c->na, fake_now);
	if (i == 41)
		stop_sandbox(c->sb, fake_now);
}

/*
 * A generation's end marked in the ledger is that generation's alone: the sandbox moved away and
 * back under a new generation right after the mark is billed on its node from the return, and
 * that generation's own end is marked when it stops.
 */
static void test_a_sandbox_moved_back_after_its_end_mark_is_billed_on(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();

	two_nodes_start(&c, t0, true, 0);
	CHECK_INT(ticks_tracked(&c, 1, 21, away_and_back), 0);	/* on B, its end flushed */
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND generation = 1 AND state = 'none' AND ended AND last_t_ns = %lld", c.sb,
			  (long long)(t0 + 10 * S + S / 2)), 1);
	(void)ticks_tracked(&c, 22, 60, away_and_back);
	CHECK_INT(gen_ucr(c.sb, 3), 19 * 257);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' AND ended",
			  c.sb), 3);
	/* 10.5 s and 19 s on A (one remainder), 10.5 s on B: every second once */
	CHECK_INT(used(c.t), (long long)(29.5 * 257) + (long long)(10.5 * 257));
	CHECK_INT(meter_pending(c.a, c.t) + meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
}

/* To B at 10 (generation 2); back on A at 15 (generation 3) and, after a 2 s backward step of
 * the wall clock, to B again logged at 13 (generation 4: 3 of no length); stopped at 60. */
static void back_and_away_within_a_window(struct two_nodes *c, int i)
{
	if (i == 11)
		move_to(c->sb, c->nb, fake_now);
	if (i == 16) {
		move_to(c->sb, c->na, fake_now);
		fake_now -= 2 * S;
		move_to(c->sb, c->nb, fake_now);
	}
	if (i == 61)
		stop_sandbox(c->sb, fake_now);
}

/*
 * A generation whose end the mark misses (generation 1 here: its point moved on to 15 s by a
 * window of no charge for the time the sandbox spent on B, so not the window sb_gen_end()
 * marked) still counts as ended when its point in "none" billed something, the rule before the
 * mark: its node's meter frees the sandbox once it stops. With the mark alone it held the entry
 * for good, after the stop too (main read it each tick while the sandbox lived, then freed it).
 */
static void test_a_generation_ended_before_the_mark_is_freed_when_its_sandbox_stops(void)
{
	struct two_nodes c;
	int64_t t0 = aligned_now();

	two_nodes_start(&c, t0, true, 0);
	(void)ticks_tracked(&c, 1, 70, back_and_away_within_a_window);
	CHECK_INT(ticks_tracked(&c, 71, 90, NULL), 0);
	CHECK_INT(gen_ucr(c.sb, 1), 10 * 257);
	CHECK_INT(gen_ucr(c.sb, 3), 0);
	CHECK_INT(meter_pending(c.a, c.t) + meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
}

/* One point of `sb` generation 1 in billed state `st` with remainder `rem`, and when `ucr` or
 * `mem_bs` is not -1 a window of it with them, on the database of `own`. */
static void old_point(struct pg *own, const char *sb, const char *st, long long rem, long long ucr,
		      long long mem_bs)
{
	testdb_sql(own, "INSERT INTO meter_sandboxes (sandbox_id, tenant_id, node_id, generation, "
		   "state, last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine) VALUES ('%s', 'tn', "
		   "'nd', 1, '%s', 0, 0, 0, 0, %lld)", sb, st, rem);
	if (ucr >= 0)
		testdb_sql(own, "INSERT INTO usage_windows (sandbox_id, generation, window_start, "
			   "window_end, tenant_id, cpu_ns, mem_byte_s, rx_bytes, tx_bytes, ucr, "
			   "rate_card) VALUES ('%s', 1, to_timestamp(0), to_timestamp(10), 'tn', 0, "
			   "%lld, 0, 0, %lld, 'card')", sb, mem_bs, ucr);
}

/*
 * Migration 0049 marks the points already in the ledger as their generation's end where the
 * tick's stretch clause before it counted them so (in "none", something of the generation billed:
 * a charge, memory's byte-seconds at a price of 0, or a remainder), and no other: a point in
 * "none" that billed nothing (written while the sandbox was creating) or one still running stays
 * open. Migrated on a database of its own, up to 0048 with the points in it, then to the end.
 */
static void test_the_end_mark_migration_marks_the_points_the_old_clause_took_as_ended(void)
{
	char url[700], name[48], *dbn;
	struct kiln_error err = { 0 };
	struct pg *own;
	size_t upto = 0;
	int applied;

	while (upto < migrations_count &&
	       strcmp(migrations[upto].name, "0049_generation_end_mark.sql") != 0)
		upto++;
	CHECK(upto < migrations_count);
	snprintf(name, sizeof(name), "t_endmark_%08x", (unsigned)rand());
	sql("CREATE DATABASE %s", name);
	dbn = strstr(meter_db_url, "dbname=");
	CHECK(dbn != NULL);
	if (!dbn)
		return;
	snprintf(url, sizeof(url), "%.*sdbname=%s", (int)(dbn - meter_db_url), meter_db_url, name);
	own = pg_new(url, 1);
	CHECK_INT(migrate_apply(own, migrations, upto, &applied, &err), KILN_OK);
	old_point(own, "sb_charged", "none", 0, 257, 0);
	old_point(own, "sb_mem_only", "none", 0, 0, 2560);
	old_point(own, "sb_rem_only", "none", 7, -1, -1);
	old_point(own, "sb_creating", "none", 0, 0, 0);
	old_point(own, "sb_no_window", "none", 0, -1, -1);
	old_point(own, "sb_running", "running", 3, 257, 2560);
	CHECK_INT(migrate_apply(own, migrations, migrations_count, &applied, &err), KILN_OK);
	CHECK_INT(testdb_sql_int(own, "SELECT (string_agg(sandbox_id, ',' ORDER BY sandbox_id) "
				 "= 'sb_charged,sb_mem_only,sb_rem_only')::int FROM meter_sandboxes "
				 "WHERE ended"), 1);
	pg_free(own);
	sql("DROP DATABASE %s WITH (FORCE)", name);
}

/*
 * Changes witnessed by their node's clocks (migrations/0051), as record/record.c logs them: the
 * statement that makes the change sets the sandbox's log_boot_id and log_mono_ns, here the boot
 * `wboot` and the fake monotonic clock now (for the stop, `mono`: another host's clock).
 */
static void stop_witnessed(const char *sb, const char *wboot, int64_t mono)
{
	sql("UPDATE sandboxes SET state = 'stopped', state_changed_at = to_timestamp(%lld / 1e6), "
	    "log_boot_id = '%s', log_mono_ns = %lld WHERE id = '%s'",
	    (long long)(fake_now / 1000), wboot, (long long)mono, sb);
}

static void pause_witnessed(const char *t, const char *sb, const char *snap, long long mib,
			    const char *wboot)
{
	snap_row(t, sb, snap, mib, fake_now);
	sql("UPDATE sandboxes SET state = 'paused', pause_snapshot = '%s_%s', "
	    "state_changed_at = to_timestamp(%lld / 1e6), log_boot_id = '%s', log_mono_ns = %lld "
	    "WHERE id = '%s'",
	    snap, sb, (long long)(fake_now / 1000), wboot, (long long)fake_mono, sb);
}

/* Resumed on this node: a new generation, as record_resumed() writes it. */
static void resume_witnessed(const char *sb, const char *wboot)
{
	sql("UPDATE sandboxes SET state = 'running', generation = generation + 1, "
	    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6), "
	    "log_boot_id = '%s', log_mono_ns = %lld WHERE id = '%s'",
	    (long long)(fake_now / 1000), wboot, (long long)fake_mono, sb);
}

static long long used_gen(const char *sb, int gen)
{
	return sql_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows "
		       "WHERE sandbox_id = '%s' AND generation = %d", sb, gen);
}

/*
 * Kiln-sim seed 31117: node 1's only meter crashed; the wall clock stepped back 2,134 s and then
 * forward 123 s (within the lead) while no meter of the node ran; a running sandbox deleted
 * between the two steps was read with the offset after both, 123 s early, before the ledger's
 * point, and its generation ended there (-14,198 µcr; a resume logged between them was dropped
 * the same way, -36,412 µcr of running). Its witness places it exactly. Here: 100 s back at 12,
 * a crash at 24 ([10, 20) flushed), `back_s` back at 27, stopped at 30, `fwd_s` forward at 35,
 * the restart at 40. Returns the tenant's use.
 */
static long long stopped_between_back_and_forward_steps_while_down(int64_t back_s, int64_t fwd_s)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	long long u;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-back-fwd-down";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		if (i == 13)
			fake_now -= 100 * S;		/* at 12: back 100 s (offset 100) */
		if (i == 25) {				/* crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 28)
			fake_now -= back_s * S;		/* at 27: back more, no meter */
		if (i == 31)
			stop_witnessed(sb, boot, fake_mono);	/* at 30 */
		if (i == 36)
			fake_now += fwd_s * S;		/* at 35: forward, within the lead */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 in the frame (100) */
		tick_if(m);
	}
	boot = NULL;
	u = used(t);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
	return u;
}

static void test_a_change_logged_between_two_steps_while_down_keeps_its_time(void)
{
	/* back 50 s, forward 20 s: 5,140 µcr for 7,710 without the witness (ended at the
	 * point, 20) */
	CHECK_INT(stopped_between_back_and_forward_steps_while_down(50, 20), 30 * 257);
}

/*
 * Kiln-sim seed 31169: a node's only meter, down across two backward steps (-3,410 s, then
 * -3,128 s, 6 s apart), restarted in its node's saved frame (offset 2,694), saw one step of
 * 6,538 s; a resume logged between the two steps, in an offset no meter of the node ran in,
 * read in the saved frame 3,410 s early, before the ledger's point, and was taken as in it with
 * the pause logged before it: generation 2 billed as running to generation 3's pause, generation
 * 3's running time and CPU with it (+63,819 / -50,806 µcr). Both are witnessed: each generation
 * to its own change. Here: running from 0 (generation 1); back 100 s at 12 (followed: the
 * frame's offset 100); a crash at 24 ([10, 20) flushed: the point running at 20); paused at 26
 * (offset 100); back 50 s at 28 (no meter); resumed at 30 (generation 2, offset 150); back 50 s
 * at 35 (no meter); restarted at 40 in the frame; paused at 60 (offset 200), stopped at 80.
 * Pause snapshots of 128 MiB. Without the witness: generation 1 15,420 µcr (running to 60),
 * generation 2 2,560.
 */
static void test_a_resume_logged_between_two_backward_steps_while_down_keeps_its_generation(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-back-back-resume";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 120; i++) {
		if (i == 13)
			fake_now -= 100 * S;		/* at 12: back 100 s (offset 100) */
		if (i == 25) {				/* crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 27)
			pause_witnessed(t, sb, "snap_a", 128, boot);	/* at 26, offset 100 */
		if (i == 29)
			fake_now -= 50 * S;		/* at 28: back 50 s, no meter (150) */
		if (i == 31)
			resume_witnessed(sb, boot);	/* at 30: generation 2, offset 150 */
		if (i == 36)
			fake_now -= 50 * S;		/* at 35: back 50 s, no meter (200) */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 in the frame (100) */
		if (i == 61)
			pause_witnessed(t, sb, "snap_b", 128, boot);	/* at 60 */
		if (i == 81)
			stop_witnessed(sb, boot, fake_mono);	/* at 80 */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used_gen(sb, 1), 26 * 257 + 4 * 128);
	CHECK_INT(used_gen(sb, 2), 30 * 257 + 20 * 128);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * Kiln-sim seed 31167: a node's only meter, down across two backward steps (-2,334 s, then
 * -3,006 s, 24 s apart), restarted in its node's saved frame, saw one step; a running sandbox's
 * deletion logged between the two steps read in the saved frame 2,334 s early, before the
 * ledger's point, and its generation ended there: 70 s of running time and its CPU unbilled
 * (-58,776 µcr). Witnessed, it ends where it was stopped. Here `wboot` witnesses the stop, at
 * `mono_by` from the meters' monotonic clock (0 on their boot):
 * running from 0; back 100 s at 12 (followed: the frame's offset 100); a crash at 24 ([10, 20)
 * flushed); back 50 s at 26 (no meter); stopped at 30 (offset 150); back `back2_s` at 35 (no
 * meter); restarted at 40 in the frame. Ticks to 120. Returns the tenant's use.
 */
static long long stopped_between_backward_steps_while_down(const char *wboot, int64_t mono_by,
							    int64_t back2_s)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	long long u;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-back-back-stop";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 120; i++) {
		if (i == 13)
			fake_now -= 100 * S;		/* at 12: back 100 s (offset 100) */
		if (i == 25) {				/* crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 27)
			fake_now -= 50 * S;		/* at 26: back 50 s, no meter (150) */
		if (i == 31)
			stop_witnessed(sb, wboot, fake_mono + mono_by);	/* at 30, offset 150 */
		if (i == 36)
			fake_now -= back2_s * S;	/* at 35, no meter */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 in the frame (100) */
		tick_if(m);
	}
	boot = NULL;
	u = used(t);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
	return u;
}

static void test_an_end_logged_between_two_backward_steps_while_down_keeps_its_time(void)
{
	/* to the stop, once (5,140 without the witness: ended at the point, 20) */
	CHECK_INT(stopped_between_backward_steps_while_down("test-boot-back-back-stop", 0, 50),
		  30 * 257);
}

/*
 * A change witnessed on another boot (another host, or this one before a reboot) is on another
 * monotonic clock: the frames place it, as they did every change before the witness. Here its
 * monotonic time, read on this meter's clock, stands 1,000 s before the stop (before the
 * ledger's point: the generation would end there, 20 s billed), and one backward step (50 s at
 * 26) was made while the meter was down, which the saved frame places exactly (seed 31120).
 */
static void test_a_change_witnessed_on_another_boot_is_placed_by_the_frames(void)
{
	CHECK_INT(stopped_between_backward_steps_while_down("another-host-boot", -1000 * S, 0),
		  30 * 257);
}

/*
 * A taken-over generation's end and the next generation's start witnessed on the meters' boot are
 * placed by the witness, not by their wall-clock time: test_a_tail_billed_past_a_late_end_after_a_
 * backward_step_is_not_billed_again's shape with the move witnessed at 42 s and stamped 4 s late
 * (the database's clock, which stamps a change's time, ahead of the node's): tail_bill() ends
 * the tail of generation 1 (gen_point() its point), and log_place() starts generation 2, at
 * 42 s. Billed: generation 1 from 6 s to the move, 36 s, generation 2 the 10 s from it to the
 * stop.
 */
static void test_a_taken_over_generations_witnessed_end_is_placed_by_its_witness(void)
{
	const struct late_end_shape x = { .step_at = 3, .move_at = 42, .late_ns = -4 * S,
					  .b_last = 41, .key_gone_from = 44, .stop_at = 52,
					  .witnessed = true, .gen1 = 36 * 257, .gen2 = 10 * 257 };

	taken_over_with_a_late_end(&x);
}

/*
 * The same with steps of 100 s back and 80 s forward while down: the restarted meter reads the
 * log by wall-clock time from its point in the frame after the net step, 20 s back, so a change
 * logged in the first 80 s - 60 s after the point (at the offset of the step back, 100 s more)
 * fell below the read and was never seen: the stop at 30, 10 s after the point (20), lost and
 * the generation ended at the point. A change witnessed on the meter's boot is read from the
 * monotonic time of the point (log_sql). 5,140 µcr for 7,710 before.
 */
static void test_a_change_witnessed_below_the_logs_wall_clock_read_is_read(void)
{
	CHECK_INT(stopped_between_back_and_forward_steps_while_down(100, 80), 30 * 257);
}

/*
 * A taken-over generation's change logged after a backward step its node's meter never saw: its
 * wall-clock time stands before the ledger's point, where tails_sql reads no change, so the tail
 * is billed in the state before it. The change carries its own host's witness (B's boot; one
 * meter per host), which A's meter cannot read: this case is open (docs/metering.md, Clocks),
 * and the figures here are what the frames give, not the truth. Here B's meter bills the
 * sandbox from 6 and stops at 30; the wall clock steps 320 s back at 33 (A's meter follows
 * it); paused on B at 36 (128 MiB); resumed on A at 42, stamped 400 s late (the database's clock
 * ahead of the node's, so the tail is taken), B's key gone from 44; stopped at 52. Generation 1
 * is billed running to the move, 36 s (9,252 µcr; the truth: running to the pause, paused from
 * it to the move, 8,478), generation 2 running to the stop. It records the open case and
 * protects nothing the witness added: the tail's changes are placed by the frames, so it
 * passes the same with or without the witness code (9,252 either way), and a fix of the case
 * changes its figures.
 */
static void test_a_taken_over_generations_change_before_its_point_is_open(void)
{
	const struct late_end_shape x = { .step_at = 33, .move_at = 42, .late_ns = -400 * S,
					  .b_last = 30, .key_gone_from = 44, .stop_at = 52,
					  .witnessed = true, .pause_at = 36,
					  .b_boot = "test-boot-b",
					  .gen1 = 36 * 257, .gen2 = 10 * 257 };

	taken_over_with_a_late_end(&x);
}

/*
 * A change without a witness logged after a witnessed one is placed no earlier than it. Here a
 * paused sandbox is deleted by kiln-gateway (record_delete_unheld(): no witness) between two
 * backward steps made while no meter of its node ran, its pause witnessed: running from 0; back
 * 100 s at 12 (followed: the frame's offset 100); a crash at 24 ([10, 20) flushed); back 50 s
 * at 26 (no meter); paused at 28 (witnessed, 128 MiB); deleted at 32 (offset 150); back 50 s at
 * 35 (no meter); restarted at 40 in the frame. The deletion, read in the saved frame 50 s early
 * (-18), stood before the pause (28), which the witness keeps where it was, and before the
 * ledger's point: the generation ended at the point, 20 (5,140 µcr). Kept at the pause: 28 s
 * running (7,196), the 4 s paused before the deletion not known (it has no witness).
 */
static void test_a_change_without_a_witness_stays_after_the_witnessed_one_before_it(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-unwitnessed-after";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == 13)
			fake_now -= 100 * S;		/* at 12: back 100 s (offset 100) */
		if (i == 25) {				/* crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 27)
			fake_now -= 50 * S;		/* at 26: back 50 s, no meter (150) */
		if (i == 29)
			pause_witnessed(t, sb, "snap_d", 128, boot);	/* at 28 */
		if (i == 33)				/* at 32: deleted, no witness */
			sql("UPDATE sandboxes SET deleted_at = to_timestamp(%lld / 1e6), "
			    "state = 'stopped' WHERE id = '%s'", (long long)(fake_now / 1000), sb);
		if (i == 36)
			fake_now -= 50 * S;		/* at 35: back 50 s, no meter (200) */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 in the frame (100) */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used(t), 28 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A change without a witness logged before a witnessed one is not moved into an earlier frame by
 * a change without a witness logged after it and placed a step early: log_place() keeps the
 * later one at the witnessed change before it first. The shape of the case above with the pause
 * at 22 unwitnessed (10 s after the followed step, before the step's log sequence is read: it
 * may read in the frame before it) and the sandbox resumed at 28 (generation 2, witnessed):
 * the deletion at 32, read 50 s early (-18), moved the pause into the frame before the step at
 * 12 (-78, before the ledger's point at 20), and generation 1 was billed running to the resume,
 * 28 s (7,196 µcr). Kept: running to 22, paused 6 s (5,654 + 768 = 6,422). Generation 2 ends at
 * its resume (the deletion kept there: nothing records when it happened).
 */
static void test_a_change_without_a_witness_before_a_witnessed_one_keeps_its_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-unwitnessed-before";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == 13)
			fake_now -= 100 * S;		/* at 12: back 100 s (offset 100) */
		if (i == 23)
			pause_into(t, sb, "snap_e", 128);	/* at 22: paused, no witness */
		if (i == 25) {				/* crash at 24 */
			meter_free(m);
			m = NULL;
		}
		if (i == 27)
			fake_now -= 50 * S;		/* at 26: back 50 s, no meter (150) */
		if (i == 29)
			resume_witnessed(sb, boot);	/* at 28: generation 2, witnessed */
		if (i == 33)				/* at 32: deleted, no witness */
			sql("UPDATE sandboxes SET deleted_at = to_timestamp(%lld / 1e6), "
			    "state = 'stopped' WHERE id = '%s'", (long long)(fake_now / 1000), sb);
		if (i == 36)
			fake_now -= 50 * S;		/* at 35: back 50 s, no meter (200) */
		if (i == 41)
			m = new_meter_with(true, 0);	/* restarted at 40 in the frame (100) */
		tick_if(m);
	}
	boot = NULL;
	CHECK_INT(used_gen(sb, 1), 22 * 257 + 6 * 128);
	CHECK_INT(used_gen(sb, 2), 0);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * Another node's change without a witness this meter can read, which no kept frame puts before a
 * witnessed change of its sandbox logged after it, stands no later than that change
 * (log_time_before()). Kiln-sim seed 31460: node 1's meter placed generation 2's pause, a change
 * of node 0, 3,403 s late, past every tick's billing end; the pieces stop at the first change
 * past the end, and the sandbox's start on node 1, witnessed and logged after the pause, was
 * never billed (-85,901 µcr). Here the sandbox runs on B from 0 (generation 1, B's changes
 * witnessed on B's boot); the wall clock steps 600 s forward at 5 and 600 s back at 12, both
 * followed by B's meter; paused on B at 10 (128 MiB), logged 600 s ahead; A's meter starts at
 * 15 on a node with no saved frame, at the wall clock, with no frame of either step, so it reads
 * the pause 600 s late; resumed on A at 20 (generation 2, witnessed on A's boot) and stopped
 * there at 40. Generation 1 is B's, 10 s running and 10 s paused (3,850 µcr), generation 2 A's,
 * its 20 s (5,140). Left where the frames read it, the pause kept A's pieces from the resume:
 * 0 µcr for 5,140 before.
 */
static void test_another_nodes_change_without_a_witness_stands_no_later_than_a_witnessed_one_logged_after_it(void)
{
	char t[32], sb[32], na[32], nb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *a = NULL, *b;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	fake_now = t0;
	fake_mono = 5000 * S;
	snprintf(na, sizeof(na), "%s", node);
	(void)aligned_now();	/* node B */
	snprintf(nb, sizeof(nb), "%s", node);
	boot = "test-boot-b";
	b = new_meter_with(true, 0);
	new_sandbox_at(t, sb, sizeof(sb), nb, "running", t0, boot, fake_mono);	/* on B at 0 */
	for (int i = 1; i <= 60; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 5)
			fake_now += 600 * S;		/* at 5: forward 600 s, B's meter follows */
		if (i == 10)				/* at 10: paused on B, logged at 610 */
			pause_witnessed(t, sb, "snap_o", 128, "test-boot-b");
		if (i == 12)
			fake_now -= 600 * S;		/* at 12: back 600 s, B's meter follows */
		if (i == 15) {				/* A's meter, no frame: at the wall clock */
			snprintf(node, sizeof(node), "%s", na);
			boot = "test-boot-a";
			a = new_meter_with(true, 0);
		}
		if (i == 20)				/* resumed on A: generation 2, witnessed */
			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state = 'running', pause_snapshot = NULL, "
			    "state_changed_at = to_timestamp(%lld / 1e6), "
			    "log_boot_id = 'test-boot-a', log_mono_ns = %lld WHERE id = '%s'",
			    na, (long long)(fake_now / 1000), (long long)fake_mono, sb);
		if (i == 40)
			stop_witnessed(sb, "test-boot-a", fake_mono);	/* at 40, on A */
		CHECK_INT(meter_tick(b, &err), KILN_OK);
		if (a)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
	}
	boot = NULL;
	CHECK_INT(used_gen(sb, 1), 10 * 257 + 10 * 128);
	CHECK_INT(used_gen(sb, 2), 20 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(a);
	meter_free(b);
}

/*
 * A meter that bills a stretch late must give it the labels the node's other meter gave it live.
 * Kiln-sim seed 31174: one of node 0's two meters, without Postgres across a 2,086 s forward
 * step, moved its point of a sandbox on by the step and read the resume and the deletion logged
 * before the step moved on by it too: it billed the generation between them, which the node's
 * other meter had billed live, a second time 2,086 s later on the label clock, where no window
 * of the other's starts, and the ledger took both (+37,700 µcr). A forward step is a gap of
 * labels now: nothing before it moves. Here one node, meters a and b, the sandbox running from
 * 0; b without Postgres from 5 (its window [0, 10) pending to 5); paused at 8 (128 MiB), resumed
 * at 12 (generation 2), stopped at 25, all billed live by a; the wall clock 600 s forward at 40;
 * b's Postgres back at 50. `witnessed`: the changes carry the meters' boot and monotonic time
 * (the seed's), else the frames place them. Before: generation 2 charged 6,682 µcr for 3,341,
 * its windows from 612 s, in the step's gap. `then`: a second step of the wall clock at 45 s
 * while b is still without Postgres, that many seconds forward (> 0) or back (< 0), 0: none.
 */
static void forward_step_without_postgres_case(bool witnessed, int then)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;
	bool ok;

	if (witnessed)
		boot = "test-boot-gap";
	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 70; i++) {
		if (i == 6)
			meter_set_backends(b, dead, rds);	/* b without Postgres from 5 */
		if (i == 9 && witnessed)
			pause_witnessed(t, sb, "snap_f", 128, boot);	/* at 8 */
		else if (i == 9)
			pause_into(t, sb, "snap_f", 128);
		if (i == 13 && witnessed)	/* at 12, resumed: generation 2 */
			resume_witnessed(sb, boot);
		else if (i == 13)
			sql("UPDATE sandboxes SET state = 'running', generation = 2, "
			    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6) "
			    "WHERE id = '%s'", (long long)(fake_now / 1000), sb);
		if (i == 26 && witnessed)
			stop_witnessed(sb, boot, fake_mono);	/* at 25 */
		else if (i == 26)
			stop_sandbox(sb, fake_now);
		if (i == 41)
			fake_now += 600 * S;	/* at 40, the wall clock steps 600 s forward */
		if (i == 46)
			fake_now += then * S;	/* at 45, a second step */
		if (i == 51)
			meter_set_backends(b, pg, rds);	/* b's Postgres back at 50 */
		fake_now += S;
		fake_mono += S;
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (i < 51)
			(void)meter_tick(b, &err);
		else
			CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	/* generation 1: 8 s running and 4 s paused at 128 MiB; generation 2: 13 s running */
	CHECK_INT(used_gen(sb, 2), 13 * 257);
	CHECK_INT(used(t), 21 * 257 + 4 * 128);
	/* no window in the step's gap of labels, [40, 640), where no time passed, nor any later:
	 * the sandbox stopped at 25 */
	CHECK_INT(sql_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s' "
			  "AND window_start >= to_timestamp(%lld / 1e6)", sb,
			  (long long)((t0 + 30 * S) / 1000)), 0);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(b);
	meter_free(a);
	pg_free(dead);
	boot = NULL;
}

static void test_a_meter_without_postgres_across_a_forward_step_does_not_bill_the_time_before_it_again(void)
{
	forward_step_without_postgres_case(false, 0);
}

static void test_a_meter_without_postgres_across_a_forward_step_reads_witnessed_changes_at_their_labels(void)
{
	forward_step_without_postgres_case(true, 0);
}

/* Two forward steps while b is without Postgres (600 s at 40, 300 s at 45): it keeps a gap for
 * each, and nothing before either moves. */
static void test_a_meter_without_postgres_across_two_forward_steps_does_not_bill_the_time_before_them_again(void)
{
	forward_step_without_postgres_case(false, 300);
}

/* A backward step (200 s at 45) after the forward one, while b is still without Postgres: the
 * gap stays a past stretch of labels, and the changes logged before the forward step keep
 * their labels. */
static void test_a_backward_step_after_a_forward_one_without_postgres_does_not_bill_the_time_before_them_again(void)
{
	forward_step_without_postgres_case(false, -200);
}

/*
 * The same generation running through a forward step, one of the node's two meters without
 * Postgres from `dead_from` to 42 s: the sandbox runs from 0 to 60 s (monotonic), the wall clock
 * steps 600 s forward at 40. The meter back from its outage bills its stretch under the labels
 * the live one gave it, and across the step's gap bills the time on either side of it only:
 * 60 s running, 15,420 µcr (as before the gap, where its relabelled stretch was refused behind
 * its pending window from before the outage).
 */
static void same_generation_through_a_forward_step_case(int dead_from)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 80; i++) {
		if (i == dead_from)
			meter_set_backends(b, dead, rds);
		if (i == 41)
			fake_now += 600 * S;	/* at 40 */
		if (i == 43)
			meter_set_backends(b, pg, rds);	/* back at 42 */
		if (i == 61)
			stop_sandbox(sb, fake_now);	/* at 60 */
		fake_now += S;
		fake_mono += S;
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (i < dead_from || i >= 43)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
		else
			(void)meter_tick(b, &err);
	}
	CHECK_INT(used(t), 60 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(b);
	meter_free(a);
	pg_free(dead);
}

static void test_a_generation_running_through_a_forward_step_without_postgres_from_10_is_billed_once(void)
{
	same_generation_through_a_forward_step_case(11);
}

static void test_a_generation_running_through_a_forward_step_without_postgres_from_30_is_billed_once(void)
{
	same_generation_through_a_forward_step_case(31);
}

/*
 * Kiln-sim seed 31282: one of a node's two meters, resynced after its late window was refused,
 * took its sandboxes back from the ledger's point two seconds before a forward step, a second
 * short of where the node's other meter had billed, and moved that point on by the step: the
 * second between was billed twice, once at its label before the step and once past it (+220,
 * +15, +76 µcr on three paused sandboxes). Here meters a and b tick in that order, a skips its
 * ticks at 26 and 30, the wall clock steps 600 s forward at 32 and the sandbox stops at 40 (real
 * time). Before the gap design, 10,537 µcr for 10,280.
 */
static void test_a_meter_taking_its_sandbox_back_before_a_forward_step_bills_each_second_once(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *a, *b;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 50; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 32)
			fake_now += 600 * S;	/* the wall clock steps 600 s forward */
		if (i == 41)
			stop_sandbox(sb, fake_now - S);	/* at 40 s of real time */
		if (i != 26 && i != 30)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	CHECK_INT(used(t), 40 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(b);
	meter_free(a);
}

/*
 * A meter started in a frame saved with STEPS_KEPT gaps keeps them all: the saved step's gap is
 * kept once, where the saving meter's held tick began it. Before, it was kept at the step's label
 * too, which dropped the oldest gap (16 kept), and then taken off: 15 kept and saved back, the
 * oldest lost (a point from before it billed it). Here one meter follows 16 forward steps of
 * 100 s (at 3, 6, ..., 48 s), crashes at 59 and restarts in its node's frame; the sandbox stops
 * at 70.
 */
static void test_a_meter_started_in_a_frame_with_all_its_gaps_keeps_them_all(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	long long oldest = 0;
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-all-gaps";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 90; i++) {
		if (i % 3 == 0 && i <= 48)
			fake_now += 100 * S;	/* a forward step of 100 s */
		if (i == 60) {			/* a crash at 59, a restart in the frame */
			CHECK_INT(sql_int("SELECT array_length(gaps_ns, 1) FROM meter_clocks "
					  "WHERE node_id = '%s'", node), 32);
			oldest = sql_int("SELECT gaps_ns[1] FROM meter_clocks WHERE node_id = '%s'",
					 node);
			meter_free(m);
			m = new_meter_with(true, 0);
		}
		if (i == 71)
			stop_sandbox(sb, fake_now);	/* at 70 */
		tick_both(m);
	}
	boot = NULL;
	/* the frame the restarted meter saved: the same 16 gaps, the oldest first */
	CHECK_INT(sql_int("SELECT array_length(gaps_ns, 1) FROM meter_clocks WHERE node_id = '%s'",
			  node), 32);
	CHECK_INT(sql_int("SELECT gaps_ns[1] FROM meter_clocks WHERE node_id = '%s'", node), oldest);
	CHECK_INT(used(t), 70 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * A saved frame whose gaps overlap (a bad row: no clock makes them) is kept without the gap that
 * overlaps the one before it: across overlapping gaps, label_out_of_gap() lands inside the next
 * one, where bill_span() bills labels no time passed under and shares more CPU than it measured.
 * Here a meter's frame, saved at 10 s, is given gaps [2, 5) and [4, 8) s before it restarts at
 * 10; the frame it saves at its next flush keeps the first only (both before).
 */
static void test_a_frame_with_overlapping_gaps_keeps_the_first(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct meter *m;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-overlap";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 40; i++) {
		if (i == 11) {	/* a crash at 10, its frame's gaps overlapping, a restart */
			meter_free(m);
			sql("UPDATE meter_clocks SET gaps_ns = '{%lld,%lld,%lld,%lld}' "
			    "WHERE node_id = '%s'", (long long)(t0 + 2 * S), (long long)(3 * S),
			    (long long)(t0 + 4 * S), (long long)(4 * S), node);
			m = new_meter_with(true, 0);
		}
		if (i == 31)
			stop_sandbox(sb, fake_now);	/* at 30 */
		tick_both(m);
	}
	boot = NULL;
	CHECK_INT(sql_int("SELECT array_length(gaps_ns, 1) FROM meter_clocks WHERE node_id = '%s'",
			  node), 2);
	CHECK_INT(sql_int("SELECT gaps_ns[1] FROM meter_clocks WHERE node_id = '%s'", node),
		  t0 + 2 * S);
	CHECK_INT(used(t), 30 * 257);
	CHECK_INT(meter_pending(m, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(m);
}

/*
 * The sandbox of the two cases below: created on B at 15 s, just before a 300 s forward step, it
 * runs 21 s there (the wall clock 320 s back at 20 s), then 10 s on A. B's meter is killed for
 * good at `kill_b_at` s, its windows flushed; with 0 it bills on without its alive key from 35 s.
 */
static void held_tick_creation_case(int kill_b_at)
{
	char t[32], sb[32], na[32], nb[32], key[96];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct meter *a, *b = NULL;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	fake_now = t0;
	fake_mono = 5000 * S;
	snprintf(na, sizeof(na), "%s", node);
	boot = "test-boot";
	a = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 6) {	/* B's meter starts */
			(void)aligned_now();
			snprintf(nb, sizeof(nb), "%s", node);
			snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, nb);
			b = new_meter_with(true, 0);
			snprintf(node, sizeof(node), "%s", na);
		}
		if (i == 15) {	/* created on B at 15, then 300 s forward: both meters follow it */
			snprintf(node, sizeof(node), "%s", nb);
			new_sandbox(t, sb, sizeof(sb), fake_now);
			snprintf(node, sizeof(node), "%s", na);
			fake_now += 300 * S;
		}
		if (i == 20)	/* 320 s back: both meters keep going */
			fake_now -= 320 * S;
		if (i == 36)	/* to A: generation 2 */
			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
			    na, (long long)(fake_now / 1000), sb);
		if (i == 46)
			stop_sandbox(sb, fake_now);
		CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (b)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
		if (kill_b_at ? i == kill_b_at : i >= 35) {	/* B's alive key gone */
			if (kill_b_at) {
				meter_free(b);
				b = NULL;
			}
			CHECK_INT(RDS(rds, &rep, &err, "DEL", key), KILN_OK);
			rds_reply_release(&rep);
		}
	}
	CHECK_INT(gen_ucr(sb, 1), 21 * 257);
	CHECK_INT(gen_ucr(sb, 2), 10 * 257);
	CHECK_INT(used(t), 31 * 257);
	CHECK_INT(meter_pending(a, t) + (b ? meter_pending(b, t) : 0), 0);
	meter_free(b);
	meter_free(a);
	boot = NULL;
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	snprintf(node, sizeof(node), "%s", na);
}

/*
 * A sandbox created in the held tick's time of a forward step (the second before the step, after
 * the label the held tick billed to, where the step's gap begins) and read after it: the log is
 * read by wall-clock time from the creation's label less LOG_LATE_NS, in the frame after the step
 * (node_wall_from()), so its creation, logged before the step, is not read, and the row stands
 * where it is now. Before, that stand-in change had no node, and tracking the sandbox crashed the
 * meter (a NULL node read, sb_track()). Here the sandbox is created on B at 15 s, just before a
 * 300 s forward step, runs 21 s there (the wall clock 320 s back at 20 s), then 10 s on A, B's
 * meter without its alive key from 35 s: 31 s billed.
 */
static void test_a_sandbox_created_in_the_held_ticks_time_is_tracked(void)
{
	held_tick_creation_case(0);
}

/*
 * A taken-over generation whose start was logged in the held tick's time of a forward step (the
 * second before the step, after the label the held tick billed to, where the step's gap begins)
 * and whose point reads past its end (the start read with the offset after a backward step, the
 * wall clock's times repeating): placed in the frame before the step (node_time_before()), the
 * start is labelled past the gap, as node_time_seq() reads it. Left at its label before the gap,
 * inside it, label_add() began it at the gap's end, a second early: the taker's tail from that
 * point was refused behind B's windows, and the generation's last 6 s were never billed (3,855
 * µcr for 5,397). As above, but B's meter is killed for good at 33 s, its windows flushed.
 */
static void test_a_taken_over_generation_started_in_the_held_ticks_time_keeps_its_start(void)
{
	held_tick_creation_case(33);
}

/*
 * Two meters of one node, a and b, tick each second in that order (b first with `b_first`); the
 * wall clock steps 600 s forward just before the tick at `step_at` s; a skips its ticks at
 * `skip_a` and `skip_a2`, b at `skip_b` (0: none); the sandbox runs from 0 to 25 s. A meter
 * whose held tick comes late (it skipped the tick before) cannot tell from its own two ticks in
 * which second the step came: it takes the gap's start the node's other meter told before its
 * held tick (step_told()), else the second before its held tick, so both begin the gap at the
 * same label and the ledger's fence refuses the second billed twice. Before, the late meter
 * billed to the second before its held tick: with the step early in the time it skipped, one
 * real second was labelled twice, the step's length apart (25 s billed and one more, or one
 * less when the late meter's copy came first and each was refused behind the other's).
 */
static void late_held_tick_case(int step_at, int skip_a, int skip_a2, int skip_b, bool b_first)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *a, *b;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 40; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == step_at)
			fake_now += 600 * S;
		if (i == 26)
			stop_sandbox(sb, fake_now - S);	/* at 25 s, on the stepped wall clock */
		if (b_first && i != skip_b)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
		if (i != skip_a && i != skip_a2)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		if (!b_first && i != skip_b)
			CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	CHECK_INT(used(t), 25 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(b);
	meter_free(a);
}

/* The step between 20 and 21 s, b skipping 21: 6,682 µcr for 6,425 before. */
static void test_a_late_held_tick_after_the_step_takes_the_gap_the_other_meter_began(void)
{
	late_held_tick_case(21, 0, 0, 21, false);
}

/* The same, roles swapped (b ticking first, a skipping 21): 6,682 µcr for 6,425 before. */
static void test_a_late_held_tick_ticking_second_takes_the_gap_the_other_meter_began(void)
{
	late_held_tick_case(21, 21, 0, 0, true);
}

/* The step between 11 and 12 s, a (ticking first) skipping 12: 6,168 µcr for 6,425 before. */
static void test_a_late_held_tick_a_second_after_the_step_takes_the_gap_the_other_meter_began(void)
{
	late_held_tick_case(12, 12, 0, 0, false);
}

/* The same, a skipping 12 and 13: 5,911 µcr for 6,425 before. */
static void test_a_held_tick_two_ticks_late_takes_the_gap_the_other_meter_began(void)
{
	late_held_tick_case(12, 12, 13, 0, false);
}

/* Seed 351001013's shape, the mirror's guard: the step between 11 and 12 s, a skipping 11 (the
 * tick before the step). a is told nothing at its held tick (b ticks after it, and then tells 11,
 * its own last tick before the step): a bills [10, 11) before the step, to the second before its
 * held tick, where b begins the gap. Billing only to its last tick (10), a began the gap a second
 * before b: +257 µcr. */
static void test_a_late_held_tick_before_the_other_meters_takes_the_second_before_it(void)
{
	late_held_tick_case(12, 11, 0, 0, false);
}

/*
 * One meter (a node's usual deployment: no other meter to tell it the gap's start), its tenant at
 * zero at 20.39 s, skips its tick at 20; the wall clock steps 600 s forward just before the tick
 * at 21. Its late held tick takes the second before it (20) at once, and the next tick follows the
 * step and bills up to 22: the pause is asked at 22, as by a meter that skipped no tick. Before,
 * told nothing, it held to its last tick (19) for 2 s, billing and enforcing nothing meanwhile,
 * and the pause was asked at 24.
 */
static void test_a_lone_late_held_tick_enforces_without_waiting(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *m;
	int asked_at = 0;

	new_tenant(t, sizeof(t));
	grant(t, 5240, 0, "a");	/* 20.39 s of a 257 µcr/s sandbox */
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	npaused = 0;
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 30 && !asked_at; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 21)
			fake_now += 600 * S;	/* just before the tick at 21 */
		if (i != 20)
			CHECK_INT(meter_tick(m, &err), KILN_OK);
		if (npaused)
			asked_at = i;
	}
	CHECK_INT(asked_at, 22);
	CHECK(npaused >= 1 && !strcmp(paused[0], sb));
	meter_free(m);
}

/*
 * A tick without Postgres projects the tenant's burn over the real time since the last billed
 * tick, not over its labels: after a forward step they include the step's gap. Here one meter,
 * credits for 100 s of a 257 µcr/s sandbox, has no Postgres from its tick at 10 to 30; the wall
 * clock steps 600 s forward just before 15. Before, the tick at 16 projected 607 s of burn and
 * asked the pause after 16 s of use; the pause comes at 100, when the credits run out.
 */
static void test_a_tick_without_postgres_projects_no_burn_over_a_forward_steps_gap(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct kiln_error err = { 0 };
	struct meter *m;
	int asked_at = 0;

	new_tenant(t, sizeof(t));
	grant(t, 100 * 257, 0, "a");
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	npaused = 0;
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 110 && !asked_at; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 10)
			meter_set_backends(m, dead, rds);
		if (i == 15)
			fake_now += 600 * S;	/* just before the tick at 15 */
		if (i == 31)
			meter_set_backends(m, pg, rds);
		if (i >= 10 && i <= 30)
			(void)meter_tick(m, &err);
		else
			CHECK_INT(meter_tick(m, &err), KILN_OK);
		if (npaused)
			asked_at = i;
	}
	CHECK_INT(asked_at, 100);
	CHECK(npaused >= 1 && !strcmp(paused[0], sb));
	meter_free(m);
	pg_free(dead);
}

/*
 * One meter, a, skips its tick at 11; the wall clock steps 600 s forward just before 12, a's late
 * held tick. Just before it, the node's step key (step_tell()) is given `pre`, the gap start
 * t0 + `at_ms` ms in ns (none when `at_ms` < 0), then `post`, as another meter of the node would
 * tell it ("<length> <start>"); no key when `pre` is NULL. With `row_by_s` > 0, the node's row of
 * meter_step_told (step_tell_pg()) is given the length `row_by_s` s and the start t0 +
 * `row_at_ms` ms, written `row_age_s` s ago on the database's clock (and `row_mono_age_s` s ago
 * on the meter's monotonic clock, told on its boot, when not -1). Returns the start of the gap a saved in its frame
 * (meter_clocks.gaps_ns) less t0, in ms. The sandbox runs from 0 to 25 s: billed once whatever
 * the start.
 */
static long long told_gap_start_with(const char *pre, long long at_ms, const char *post,
				     long long row_by_s, long long row_at_ms)
{
	char t[32], sb[32], key[96], v[128];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	struct meter *a;
	long long start;
	bool ok;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	boot = "test-boot-told";
	a = new_meter_with(true, 0);
	snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s:step", node);
	for (int i = 1; i <= 40; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 12) {
			fake_now += 600 * S;
			if (pre && at_ms >= 0)
				snprintf(v, sizeof(v), "%s%lld%s", pre,
					 (long long)(t0 + at_ms * 1000000), post);
			else if (pre)
				snprintf(v, sizeof(v), "%s%s", pre, post);
			if (pre) {
				CHECK_INT(RDS(rds, &rep, &err, "SET", key, v, "EX", "60"), KILN_OK);
				rds_reply_release(&rep);
			}
			if (row_by_s > 0 && row_mono_age_s >= 0)
				sql("INSERT INTO meter_step_told (node_id, by_ns, from_ns, updated_at, "
				    "boot_id, mono_ns) VALUES ('%s', %lld, %lld, now() - interval "
				    "'%d seconds', '%s', %lld)",
				    node, row_by_s * S, (long long)(t0 + row_at_ms * 1000000),
				    row_age_s, boot, (long long)(fake_mono - row_mono_age_s * S));
			else if (row_by_s > 0)
				sql("INSERT INTO meter_step_told (node_id, by_ns, from_ns, updated_at) "
				    "VALUES ('%s', %lld, %lld, now() - interval '%d seconds')",
				    node, row_by_s * S, (long long)(t0 + row_at_ms * 1000000),
				    row_age_s);
		}
		if (i == 26)
			stop_sandbox(sb, fake_now - S);	/* at 25 s, on the stepped wall clock */
		if (i != 11)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
	}
	boot = NULL;
	start = sql_int("SELECT gaps_ns[1] FROM meter_clocks WHERE node_id = '%s'", node);
	CHECK_INT(sql_int("SELECT gaps_ns[2] FROM meter_clocks WHERE node_id = '%s'", node), 600 * S);
	CHECK_INT(used(t), 25 * 257);
	CHECK_INT(meter_pending(a, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(a);
	return (start - t0) / 1000000;
}

/* told_gap_start_with() with the step key only. */
static long long told_gap_start_ms(const char *pre, long long at_ms, const char *post)
{
	return told_gap_start_with(pre, at_ms, post, 0, 0);
}

/*
 * The start told by a meter whose held tick came up to STEP_TOLERANCE_NS late in its second (it
 * tells the second before that tick) is taken: before, only one no later than the second before
 * the late meter's held tick was, and a start told 0.3 s past it was refused for that second
 * (11.3 s told, 11 s taken: the two meters' gaps 0.3 s apart). One told just before the late
 * meter's last tick (from a tick of the other meter a little before it) is taken as that tick,
 * where the late meter's billing stands: before, refused, 11 s for 9.8 s told.
 */
static void test_a_late_held_tick_takes_a_told_start_within_the_tolerance(void)
{
	CHECK_INT(told_gap_start_ms("600000000000 ", 11300, ""), 11300);
	CHECK_INT(told_gap_start_ms("600000000000 ", 9800, ""), 10000);
	CHECK_INT(told_gap_start_ms("600000000000 ", 10500, ""), 10500);	/* as before */
	/* past the tolerance either side: the second before the held tick */
	CHECK_INT(told_gap_start_ms("600000000000 ", 11600, ""), 11000);
	CHECK_INT(told_gap_start_ms("600000000000 ", 9400, ""), 11000);
}

/*
 * A step key whose value is not the two numbers step_tell() writes, or whose numbers overflow, is
 * ignored: the late held tick takes the second before it (11 s). Before, "<length> <start>" with
 * text after it was taken (sscanf() stops at the second number): 10.5 s.
 */
static void test_a_late_held_tick_ignores_a_malformed_told_start(void)
{
	CHECK_INT(told_gap_start_ms("600000000000 ", 10500, " 7"), 11000);
	CHECK_INT(told_gap_start_ms("600000000000 ", 10500, "x"), 11000);
	CHECK_INT(told_gap_start_ms("99999999999999999999 ", 10500, ""), 11000);
	CHECK_INT(told_gap_start_ms("-9223372036854775808 ", 10500, ""), 11000);
	CHECK_INT(told_gap_start_ms("600000000000 ", -1, "99999999999999999999"), 11000);
	CHECK_INT(told_gap_start_ms("600000000000", -1, ""), 11000);
	CHECK_INT(told_gap_start_ms("", -1, ""), 11000);
	CHECK_INT(told_gap_start_ms("x ", 10500, ""), 11000);
}

/*
 * A pause that did not happen is asked again after 10 s of real time, not of labels: across a
 * forward step the labels take in the step's gap. Here one meter, a tenant at zero from 3.9 s, a
 * pause never honoured; the wall clock steps 600 s forward just before the tick at 8. The pause
 * is asked at 4, 14 and 24; before, at 4, 9, 19 (the re-ask 5 real seconds after the first).
 */
static void test_a_pause_is_asked_again_after_ten_real_seconds_across_a_forward_step(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *m;
	int asked[3] = { 0 }, n = 0;

	new_tenant(t, sizeof(t));
	grant(t, 1000, 0, "a");	/* 3.9 s of a 257 µcr/s sandbox */
	new_sandbox(t, sb, sizeof(sb), t0);
	fake_now = t0;
	fake_mono = 5000 * S;
	npaused = 0;
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 30 && n < 3; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 8)
			fake_now += 600 * S;	/* just before the tick at 8 */
		CHECK_INT(meter_tick(m, &err), KILN_OK);
		if (npaused > n)
			asked[n++] = i;
	}
	CHECK_INT(asked[0], 4);
	CHECK_INT(asked[1], 14);
	CHECK_INT(asked[2], 24);
	stop_sandbox(sb, fake_now);
	meter_free(m);
}

/*
 * The tick's billing end is the real time a transaction open longer than commit_wait allows has
 * been open, taken off its label over a forward step's gap: the label less the lag fell inside
 * the gap, and billing ran to the gap's start, past the time a change committed later carries.
 * Here one meter; a transaction is opened 3 s (real) before the tick at 13 and stays open to
 * 17; the wall clock steps 600 s forward just before the tick at 15 (its gap from 14); the
 * sandbox's pause, stamped at 13.5 in the frame before the step, commits after the tick at 16;
 * it stops at 30. Before, the tick at 16 billed running to 14 (its label 616 less 3 s is 613,
 * in the gap) and the pause at 13.5 came after that point: 13.5 s running billed as 14 (+128
 * µcr less the half-second paused).
 */
static void test_a_ticks_billing_end_behind_an_open_transaction_skips_a_forward_steps_gap(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *own = pg_new(meter_db_url, 1);
	struct pg_conn *open_tx = NULL;
	struct meter *m;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 40; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 13) {	/* a transaction open 3 s when the tick at 13 looks */
			CHECK(pg_acquire(own, &open_tx, &err) == KILN_OK);
			CHECK(open_tx && pg_exec(open_tx, "BEGIN; SELECT 1", &err) == KILN_OK);
			nanosleep(&(struct timespec){ .tv_sec = 3 }, NULL);
		}
		if (i == 15)
			fake_now += 600 * S;	/* just before the tick at 15 */
		if (i == 17) {	/* the pause, at 13.5 before the step, commits now */
			int64_t at = fake_now;

			fake_now = t0 + 13 * S + S / 2;
			pause_into(t, sb, "snap_hw", 128);
			fake_now = at;
			CHECK(pg_exec(open_tx, "ROLLBACK", &err) == KILN_OK);
			pg_release(own, open_tx);
			open_tx = NULL;
		}
		if (i == 30)
			stop_sandbox(sb, fake_now);	/* at 30, 600 s on the wall clock past it */
		CHECK_INT(meter_tick(m, &err), KILN_OK);
	}
	/* 13.5 s running, 16.5 s paused at 128 MiB */
	CHECK_INT(used(t), 13 * 257 + 257 / 2 + 16 * 128 + 128 / 2);
	CHECK_INT(meter_pending(m, t), 0);
	meter_free(m);
	pg_free(own);
}

/* At second `i` of a schedule: A's meter crashes at `at`, its alive key gone a second later. */
static void two_nodes_a_crash(struct two_nodes *c, int i, int at)
{
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	char key[96];

	if (i == at) {
		meter_free(c->a);
		c->a = NULL;
	}
	if (i == at + 1) {
		snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, c->na);
		CHECK_INT(RDS(rds, &rep, &err, "DEL", key), KILN_OK);
		rds_reply_release(&rep);
	}
}

/*
 * Node A's only meter down across a 600 s forward step, node B's meter following it live: B's gap
 * begins at its held tick's label (20), A's restarted meter keeps the step at its own first tick
 * (24, gap [24, 624)). The sandbox runs on A from 0; A's meter crashes at 11 after flushing
 * [0, 10), its alive key gone at 12; the wall clock steps at 21; the sandbox moves to B at 23
 * (generation 2) and stops at 35; A's meter restarts in its node's frame at 24. With `a_first`,
 * A's meter ticks before B's from its restart and B's skips its tick at 23 (a late wake), so A's
 * first tick writes its alive key before B's meter could take generation 1 over. Generation 1
 * must be billed its 23 s once, the sandbox 35 s, nothing pending, Redis's balance the ledger's.
 */
static void taken_over_across_a_step_its_meter_missed(bool a_first)
{
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct two_nodes c;
	bool ok;

	boot = "test-boot";
	two_nodes_start(&c, t0, true, 0);
	for (int i = 1; i <= 50; i++) {
		fake_now += S;
		fake_mono += S;
		two_nodes_a_crash(&c, i, 11);	/* [0, 10) flushed */
		if (i == 21)	/* 600 s forward: B's meter holds this tick, A's is down */
			fake_now += 600 * S;
		if (i == 23)	/* to B: generation 2 */
			move_to(c.sb, c.nb, fake_now);
		if (i == 24)	/* A's meter restarts, in its node's frame */
			c.a = new_meter_with(true, 0);
		if (i == 35)
			stop_sandbox(c.sb, fake_now);
		if (a_first && c.a)
			CHECK_INT(meter_tick(c.a, &err), KILN_OK);
		if (!(a_first && i == 23))
			CHECK_INT(meter_tick(c.b, &err), KILN_OK);
		if (!a_first && c.a)
			CHECK_INT(meter_tick(c.a, &err), KILN_OK);
	}
	CHECK_INT(gen_ucr(c.sb, 1), 23 * 257);
	CHECK_INT(used(c.t), 35 * 257);
	CHECK_INT(meter_pending(c.a, c.t) + meter_pending(c.b, c.t), 0);
	meter_free(c.b);
	meter_free(c.a);
	boot = NULL;
	CHECK_INT(redis_bal(c.t, &ok), ledger_bal(c.t));
}

/*
 * Kiln-sim seed 31218: node 1's only meter was down across a +653 s step, node 0's meters followed
 * it live (gap from 1,697; node 1's restarted meter's from its first tick, 1,702). Node 0's meter
 * took a paused generation of node 1 over, ended by a move to node 0 after the step, and flushed
 * its complete windows, its end window [2,350, 2,360) not yet; node 1's meter then found no end,
 * tracked the generation from that point and billed [1,700, 1,702) under labels no window of the
 * taker's overlapped: +62 µcr. Here B's meter ticks first, as node 0's did, and takes generation 1
 * over at 23 (to the move: [10, 20) and [620, 623)): before, A's meter billed [20, 24) again
 * (6,939 µcr for 5,911).
 */
static void test_a_generation_taken_over_across_a_step_its_meter_missed_is_billed_once(void)
{
	taken_over_across_a_step_its_meter_missed(false);
}

/*
 * The same, A's meter ticking first from its restart and B's skipping its tick at 23, so nothing
 * is taken over: A's meter reads the move, logged after the step and before its first tick (24),
 * with no witness of its boot, at the wall clock's label 623, in its own gap [24, 624). Before,
 * it billed generation 1 as running up to the gap's start, a second past the move (6,168 µcr for
 * 5,911); kiln-sim seed 31218's returning meter billed a paused generation so 0.777 s past its
 * move.
 */
static void test_a_change_logged_before_a_restarted_meters_first_tick_after_a_step_ends_there(void)
{
	taken_over_across_a_step_its_meter_missed(true);
}

/*
 * A generation of node A taken over by node B's meter while A's only meter is down, and A's
 * meter back before B billed it whole. A's meter flushes a sandbox of its own at 10 (its node's
 * frame) and crashes at 11, its alive key gone at 12; with `step`, the wall clock steps 600 s
 * forward at 21, B's meter following it live (its gap from 20) and A's, down, keeping it at its
 * first tick after it (a gap from there): the same real time reads a step apart on the two. A
 * transaction is open from 22 to `tx_end`, so every meter's billing end lags the label by its age
 * (8 s and more). The sandbox is made on A at 23 (generation 1, witnessed), paused there at
 * `pause_at` (0: never; a pause snapshot of 128 MiB), and moves to B at 30 (generation 2,
 * witnessed, running), and stops at 45. B's meter takes generation 1 over, its end read ahead of
 * B's billing end. A's meter is back at `a_back`, without Redis up to `a_redis` (it cannot see
 * the take-over), ticking first. Generation 1 must be billed once, the sandbox's 15 s on B and
 * A's own sandbox's 45 s too, nothing pending, Redis's balances the ledger's.
 */
struct tk_back {
	bool step;
	int tx_end, a_back, a_redis, pause_at;
	bool b_first;			/* B's meter ticks before A's */
	int b_blind_from, b_blind_to;	/* B's meter without Redis over [from, to) (0: never) */
	int a_dies_again;		/* A's meter, back, crashes again then (its key gone after) */
	int b_restart;			/* B's meter crashes and restarts then, before its tick */
	bool creating;			/* made at 5 (being made until 23): A flushes a point of it */
	/* Made on A at 0.5 (generation 1, 4.5 s: A's meter flushes its point with half a µcr
	 * left over), moved to B at 5 (generation 2) and back to A at 23 (generation 3, the one
	 * taken over), paused at `pause_at` + 0.5 (4.5 s running: half a µcr of its own). */
	bool carried;
};

static void taken_over_while_its_meter_comes_back(const struct tk_back *x)
{
	const bool step = x->step;
	const int tx_end = x->tx_end, a_back = x->a_back, a_redis = x->a_redis;
	const int pause_at = x->pause_at;
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct rds *dead = rds_new("unix:/nonexistent-kiln-test/redis.sock", 200);
	struct pg *own = pg_new(meter_db_url, 1);
	struct pg_conn *open_tx = NULL;
	struct two_nodes n2;
	const int g = x->carried ? 3 : 1;	/* the generation taken over */
	long long gen1;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	boot = "test-boot";
	two_nodes_start(&n2, t0, true, 0);	/* n2.sb: A's own sandbox */
	for (int i = 1; i <= 60; i++) {
		fake_now += S;
		fake_mono += S;
		two_nodes_a_crash(&n2, i, 11);
		if (x->a_dies_again)
			two_nodes_a_crash(&n2, i, x->a_dies_again);
		if (i == 21 && step)	/* B's meter holds this tick, A's is down */
			fake_now += 600 * S;
		if (i == 22) {	/* a transaction open 8 s (real) when B's next tick looks */
			CHECK(pg_acquire(own, &open_tx, &err) == KILN_OK);
			CHECK(open_tx && pg_exec(open_tx, "BEGIN; SELECT 1", &err) == KILN_OK);
			nanosleep(&(struct timespec){ .tv_sec = 8 }, NULL);
		}
		if (i == (x->creating ? 5 : 23) && !x->carried)	/* made on A: generation 1 */
			new_sandbox_at(t, sb, sizeof(sb), n2.na, x->creating ? "creating" : "running",
				       fake_now, boot, fake_mono);
		if (i == 1 && x->carried)	/* made on A at 0.5: generation 1, witnessed */
			new_sandbox_at(t, sb, sizeof(sb), n2.na, "running", fake_now - S / 2, boot,
				       fake_mono - S / 2);
		if (x->carried && (i == 5 || i == 23))	/* to B, back to A: generations 2 and 3 */
			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state_changed_at = to_timestamp(%lld / 1e6), log_boot_id = '%s', "
			    "log_mono_ns = %lld WHERE id = '%s'", i == 5 ? n2.nb : n2.na,
			    (long long)(fake_now / 1000), boot, (long long)fake_mono, sb);
		if (i == 23 && x->creating)	/* running on A, witnessed */
			sql("UPDATE sandboxes SET state = 'running', state_changed_at = "
			    "to_timestamp(%lld / 1e6), log_boot_id = '%s', log_mono_ns = %lld "
			    "WHERE id = '%s'", (long long)(fake_now / 1000), boot,
			    (long long)fake_mono, sb);
		if (i == pause_at) {	/* paused on A, witnessed (carried: half a second on) */
			fake_now += x->carried ? S / 2 : 0;
			fake_mono += x->carried ? S / 2 : 0;
			pause_witnessed(t, sb, "snap_tk", 128, boot);
			fake_now -= x->carried ? S / 2 : 0;
			fake_mono -= x->carried ? S / 2 : 0;
		}
		if (i == 30)	/* to B: generation 2 (carried: 4), witnessed */
			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state = 'running', pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6), log_boot_id = '%s', "
			    "log_mono_ns = %lld WHERE id = '%s'", n2.nb, (long long)(fake_now / 1000), boot,
			    (long long)fake_mono, sb);
		if (i == tx_end) {
			CHECK(pg_exec(open_tx, "ROLLBACK", &err) == KILN_OK);
			pg_release(own, open_tx);
			open_tx = NULL;
		}
		if (i == a_back) {
			n2.a = new_meter_with(true, 0);
			if (a_redis > a_back)
				meter_set_backends(n2.a, pg, dead);
		}
		if (i == a_redis && a_redis > a_back)
			meter_set_backends(n2.a, pg, rds);
		if (i == 45) {
			stop_sandbox(sb, fake_now);
			stop_sandbox(n2.sb, fake_now);
		}
		if (i == x->b_restart) {
			meter_free(n2.b);
			snprintf(node, sizeof(node), "%s", n2.nb);
			n2.b = new_meter_with(true, 0);
			snprintf(node, sizeof(node), "%s", n2.na);
		}
		if (x->b_blind_from && i == x->b_blind_from)
			meter_set_backends(n2.b, pg, dead);
		if (x->b_blind_from && i == x->b_blind_to)
			meter_set_backends(n2.b, pg, rds);
		if (x->b_first)
			CHECK_INT(meter_tick(n2.b, &err), KILN_OK);
		if (n2.a)
			CHECK_INT(meter_tick(n2.a, &err), KILN_OK);
		if (!x->b_first)
			CHECK_INT(meter_tick(n2.b, &err), KILN_OK);
	}
	gen1 = pause_at ? (pause_at - 23) * 257 + (30 - pause_at) * 128 : 7 * 257;
	if (x->carried)	/* 4.5 s running (1,156.5 µcr), 2.5 s paused (320), half a µcr carried */
		gen1 = 1477;
	CHECK_INT(gen_ucr(sb, g), gen1);
	if (x->carried) {	/* generation 1 4.5 s (1,156.5 µcr), generation 2 on B 18 s */
		CHECK_INT(gen_ucr(sb, 1), 1156);
		CHECK_INT(sql_int("SELECT remainder_fine FROM meter_sandboxes WHERE "
				  "sandbox_id = '%s' AND generation = 1", sb),
			  (long long)(fine_of(9 * S / 2) % PRICE_FINE_PER_UCR));
		CHECK_INT(gen_ucr(sb, 2), 18 * 257);
	}
	CHECK_INT(used(t), gen1 + 15 * 257 + (x->carried ? 1156 + 18 * 257 : 0));
	CHECK_INT(meter_pending(n2.b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	if (x->a_dies_again)	/* B's watch of generation 1 ended, its row gone */
		CHECK_INT(sql_int("SELECT count(*) FROM meter_cut_watch WHERE node_id = '%s'", n2.nb),
			  0);
	if (n2.a) {	/* A's own sandbox: billed by A's meter, when back */
		CHECK_INT(used(n2.t), 45 * 257);
		CHECK_INT(meter_pending(n2.a, t), 0);
		CHECK_INT(redis_bal(n2.t, &ok), ledger_bal(n2.t));
	} else {	/* what A's meter flushed before it went: [0, 10), and [10, 20) when back */
		CHECK_INT(used(n2.t), (x->a_dies_again ? 20 : 10) * 257);
	}
	meter_free(n2.b);
	meter_free(n2.a);
	boot = NULL;
	rds_free(dead);
	pg_free(own);
}

/*
 * Across the step, B's copy waiting for its end, A's meter back at 36 without Redis bills
 * generation 1 from its start (its witness) under labels a step before B's and flushes first
 * with the end: the copies overlapped nowhere on the labels and the ledger took both (3,598 µcr
 * for 1,799 before migration 0055's fence).
 */
static void test_a_taken_over_generation_its_own_meter_bills_first_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .step = true, .tx_end = 36,
								 .a_back = 36, .a_redis = 50 });
}

/* The other order: the transaction ended at 33, B's copy, whole with its end, is flushed first
 * and A's comes after it (held before the fence too: A's meter reads the end B recorded). */
static void test_a_taken_over_generation_its_own_meter_bills_second_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .step = true, .tx_end = 33,
								 .a_back = 36, .a_redis = 50 });
}

/*
 * No step; A's meter back at 33 with Redis, its alive key written. B took generation 1 over at
 * 30 and bills it up to its lagging billing end; the pause A logs at 27, read by B's meter at 35
 * with A's meter alive, is A's to bill from there. Before, B billed the pieces after the pause
 * with those before it (one group) and, its last piece not its own, recorded the generation's end
 * where it stopped (27.9 s); A's copy overlapped B's and was refused, and A's meter, billing on
 * from the ledger, took that mark for the end: the paused time to the move never billed (1,140
 * µcr for 1,412). Now B bills up to the change that is not its own, records no end there and
 * drops its window holding that point (sb_cut()).
 */
static void test_a_taken_over_generation_its_meter_takes_back_part_way_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27 });
}

/*
 * The same with B's meter ticking first, so B's window [20, 30) of generation 1 would reach the
 * ledger before A's: kept, it held [23, 27.9) and the rest of that window, A's after it
 * resynced, was dropped by the flush (a window's start is written once): 1,028 µcr for 1,412
 * with the cut but no drop.
 */
static void test_a_taken_over_generation_cut_with_the_taker_flushing_first_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27,
								 .b_first = true });
}

/*
 * A's meter never back; B's meter without Redis from 34 to 37, so at the tick that first reads
 * A's pause (35) it cannot tell whether A's meter lives: B goes on billing the generation it took
 * over, to its end.
 */
static void test_a_taken_over_generation_billed_on_while_redis_is_away(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 99,
								 .a_redis = 99, .pause_at = 27,
								 .b_blind_from = 34,
								 .b_blind_to = 37 });
}

/*
 * As ..._its_meter_takes_back_part_way_..., A's meter crashing again at 36, its key gone at 37,
 * before it flushed anything of generation 1: B's meter dropped its window at the cut (35), the
 * only part of the generation it billed, so the ledger has no point of it for the tails path to
 * bill the rest from.
 */
static void test_a_cut_generation_whose_meter_dies_again_unflushed_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27,
								 .a_dies_again = 36 });
}

/*
 * The same, A's meter crashing again at 39 (its key gone at 40), still before its first flush of
 * generation 1, and B's meter restarted at 38, after its cut and while A's meter still lived, so
 * the restarted meter takes nothing over: the watch is kept in meter_cut_watch and read at its
 * start. In its memory alone, the restart ended it and nobody billed generation 1 (0 µcr for
 * 1,412).
 */
static void test_a_cut_generation_watched_across_its_takers_restart_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27,
								 .a_dies_again = 39, .b_restart = 38 });
}

/*
 * The same, B's meter restarted at 36, before its cut, and A's meter crashing again then (its key
 * gone at 37) before it flushed anything of generation 1: what B had taken over (generation 1 up
 * to its billing end) was in its memory alone, and the restarted meter, reading generation 1's
 * changes while A's key was still there, left it to A's meter. Now it watches the generation it
 * left as it watches a cut one; before, nobody billed it (0 µcr for 1,412).
 */
static void test_a_generation_left_to_its_meter_after_the_takers_restart_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27,
								 .a_dies_again = 36, .b_restart = 36 });
}

/*
 * The same, the sandbox made at 5 and running from 23: A's meter flushed a point of generation 1
 * in no state ([0, 10), while it was being made) before it crashed at 11. The tails path takes
 * no such point, so the watch bills from it.
 */
static void test_a_cut_generation_with_a_point_while_made_is_billed_once(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27,
								 .a_dies_again = 36,
								 .creating = true });
}

/*
 * As ..._whose_meter_dies_again_unflushed_..., the sandbox made on A at 0.5 s and moved to B at 5
 * and back to A at 23 (generation 3, taken over by B, cut and watched), paused at 27.5: A's meter
 * flushed generation 1's point with half a µcr left over, which A's generations carry from one to
 * the next (gen_rem_switch()), so generation 3's 1,476.5 µcr are 1,477. Billed by B's watch from
 * its start, the ledger having no point of it (cut_tails_sql), from a remainder of zero: 1,476
 * µcr for 1,477 before (kiln-sim seed 77197).
 */
static void test_a_cut_generation_billed_from_its_start_carries_its_nodes_remainder(void)
{
	taken_over_while_its_meter_comes_back(&(struct tk_back){ .tx_end = 40, .a_back = 33,
								 .a_redis = 33, .pause_at = 27,
								 .a_dies_again = 36,
								 .carried = true });
}

/*
 * A point-less generation of a node whose meter is gone goes on from the remainder its node's
 * earlier generation ended with, when this meter billed that generation's end in the same tick and
 * has not flushed it yet (meter_take_tails(): the tails first, then the watch in the generations'
 * order; tail_rem_find()). The sandbox runs on A from 0.5 (generation 1), is resumed on A at
 * `resume_at` (generation 2) and moves to B at `move_at` (generation 3), where B's meter leaves
 * generations 1 and 2 to A's meter, alive without Postgres (from `dead_at`), and watches what has no
 * point in the ledger; A's meter gone at 25 (its key at 26): B bills both in one tick; stopped at
 * 40. `want1`, `want2` and `want3` µcr for the three generations.
 */
static void point_less_after_a_tail(int dead_at, int64_t resume_at, int64_t move_at, long long want1,
				    long long want2, long long want3)
{
	char sb[32];
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct two_nodes n2;
	int64_t t0 = aligned_now();

	boot = "test-boot";
	two_nodes_start(&n2, t0, true, 0);
	for (int i = 1; i <= 45; i++) {
		fake_now += S;
		fake_mono += S;
		two_nodes_a_crash(&n2, i, 25);
		if (i == dead_at)	/* A's meter without Postgres, alive */
			meter_set_backends(n2.a, dead, rds);
		if (i == 1)	/* made on A at 0.5: generation 1, witnessed */
			new_sandbox_at(n2.t, sb, sizeof(sb), n2.na, "running", fake_now - S / 2, boot,
				       fake_mono - S / 2);
		if (fake_now - t0 == (resume_at + S - 1) / S * S) {	/* generation 2, on A */
			int64_t back = (resume_at + S - 1) / S * S - resume_at;

			fake_now -= back;
			fake_mono -= back;
			resume_witnessed(sb, boot);
			fake_now += back;
			fake_mono += back;
		}
		if (fake_now - t0 == (move_at + S - 1) / S * S) {	/* to B: generation 3 */
			int64_t back = (move_at + S - 1) / S * S - move_at;

			sql("UPDATE sandboxes SET node_id = '%s', generation = generation + 1, "
			    "state_changed_at = to_timestamp(%lld / 1e6), log_boot_id = '%s', "
			    "log_mono_ns = %lld WHERE id = '%s'", n2.nb,
			    (long long)((fake_now - back) / 1000), boot,
			    (long long)(fake_mono - back), sb);
		}
		if (i == 40)
			stop_witnessed(sb, boot, fake_mono);
		if (n2.a)
			(void)meter_tick(n2.a, &err);
		CHECK_INT(meter_tick(n2.b, &err), KILN_OK);
	}
	CHECK_INT(gen_ucr(sb, 1), want1);
	CHECK_INT(gen_ucr(sb, 2), want2);
	CHECK_INT(gen_ucr(sb, 3), want3);
	CHECK_INT(meter_pending(n2.b, n2.t), 0);
	meter_free(n2.b);
	meter_free(n2.a);
	boot = NULL;
	pg_free(dead);
}

/*
 * Kiln-sim seed 31672 (two nodes, the hour): the watch billed a point-less generation before the
 * tail of its node's earlier generation, from that generation's point as it stood before its tail
 * (its node's meter crashed part-way through it), and one µcr moved between two generations. Here
 * A's meter flushes generation 1's [0.5, 10) (2,441.5 µcr: half a µcr left over) and loses
 * Postgres at 11; the resume at 13.5 ends generation 1 (13 s, 3,341 µcr: its tail's 899.5 and the
 * half µcr before, none left over); generation 2 runs 6.5 s to the move at 20 (1,670.5 µcr: 1,670
 * from no remainder), generation 3 20 s on B. Before, generation 2 went on from the half µcr of
 * generation 1's point at 10: 1,671 µcr for 1,670.
 */
static void test_a_point_less_generation_goes_on_from_the_remainder_of_a_tail_billed_with_it(void)
{
	point_less_after_a_tail(11, 13 * S + S / 2, 20 * S, 13 * 257, 1670, 20 * 257);
}

/*
 * Both generations point-less (A's meter without Postgres from before the sandbox is made), billed
 * by the watch in one tick, in their order: generation 1 12.5 s from 0.5 to 13 (3,212.5 µcr: 3,212,
 * half a µcr left over), generation 2 7.5 s to the move at 20.5 (1,927.5 µcr and that half: 1,928),
 * generation 3 19.5 s on B (5,011.5: 5,011). Before, generation 2 went on from zero: 1,927.
 */
static void test_two_point_less_generations_of_a_node_carry_one_remainder(void)
{
	point_less_after_a_tail(1, 13 * S, 20 * S + S / 2, 3212, 1928, 5011);
}

/*
 * A meter with nothing to bill saves its frame (frame_keep()): at its first tick, and at the
 * tick it follows a backward step, with the step's offset; a tick that changes nothing saves
 * nothing (the row's monotonic time stays). Saved with flushes only, a node with nothing to
 * flush had no row.
 */
static void test_a_meter_with_nothing_to_bill_saves_its_frame(void)
{
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct meter *m;

	fake_now = t0;
	fake_mono = 5000 * S;
	boot = "test-boot";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 6; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 4)
			fake_now -= 300 * S;
		CHECK_INT(meter_tick(m, &err), KILN_OK);
		if (i == 1 || i == 3)	/* saved at the first tick, then unchanged */
			CHECK_INT(sql_int("SELECT mono_ns FROM meter_clocks WHERE node_id = '%s' "
					  "AND off_ns = 0", node), 5001 * S);
	}
	CHECK_INT(sql_int("SELECT off_ns FROM meter_clocks WHERE node_id = '%s'", node), 300 * S);
	CHECK_INT(sql_int("SELECT mono_ns FROM meter_clocks WHERE node_id = '%s'", node), 5004 * S);
	meter_free(m);
	boot = NULL;
}

/* The node's saved frame, one column (a bigint) of meter_clocks. */
static long long frame_col(const char *col)
{
	return sql_int("SELECT %s FROM meter_clocks WHERE node_id = '%s'", col, node);
}

/*
 * The same across forward steps. A 300 s backward step at 2 is seen without Postgres (ticks 2 and
 * 3 fail), so the frame changed unsaved when the wall clock steps 600 s forward at 4, Postgres
 * back: the tick that holds the step (it bills up to the step's gap start and follows it at the
 * next) saves nothing, the frame having no record of the step yet (saved there, a meter started
 * in it would place the step's gap at its own first tick); the tick after it saves the frame with
 * the step and its gap. Of more steps than a frame keeps (STEPS_KEPT), the newest are saved, and
 * the label clock goes on across all of them. Without frame_keep()'s test of the held tick, the
 * frame was saved at 4 with the backward step's offset and no forward step (mono 5,003 s).
 */
static void test_a_meter_with_nothing_to_bill_saves_its_frame_after_a_forward_step(void)
{
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;

	fake_now = t0;
	fake_mono = 5000 * S;
	boot = "test-boot";
	m = new_meter_with(true, 0);
	for (int i = 1; i <= 5; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 2) {	/* 300 s back, seen without Postgres: not saved */
			fake_now -= 300 * S;
			meter_set_backends(m, dead, rds);
		}
		if (i == 4) {	/* 600 s forward: tick 4 holds it */
			fake_now += 600 * S;
			meter_set_backends(m, pg, rds);
		}
		CHECK_INT(meter_tick(m, &err), i == 2 || i == 3 ? KILN_E_UNAVAILABLE : KILN_OK);
		kiln_error_clear(&err);
		if (i <= 4)	/* saved at the first tick only: not at the held one */
			CHECK_INT(frame_col("mono_ns"), 5001 * S);
	}
	/* the step took the backward step's lead back: a gap of 300 s, labels on the wall clock */
	CHECK_INT(frame_col("mono_ns"), 5005 * S);
	CHECK_INT(frame_col("label_ns"), t0 + 305 * S);
	CHECK_INT(frame_col("off_ns"), 0);
	CHECK_INT(frame_col("step_by_ns"), 300 * S);
	/* the gap begins where the held tick billed to: the second before it (held_to()) */
	CHECK_INT(frame_col("cardinality(gaps_ns)"), 2);
	CHECK_INT(frame_col("gaps_ns[1]"), t0 + 3 * S);
	CHECK_INT(frame_col("gaps_ns[2]"), 300 * S);
	/* 20 more steps of 100 s, three ticks apart: 16 kept, the newest last */
	for (int k = 0; k < 20; k++)
		for (int i = 0; i < 3; i++) {
			fake_now += S;
			fake_mono += S;
			if (i == 0)
				fake_now += 100 * S;
			CHECK_INT(meter_tick(m, &err), KILN_OK);
		}
	CHECK_INT(frame_col("cardinality(gaps_ns)"), 2 * 16);
	CHECK_INT(frame_col("step_by_ns"), 100 * S);
	CHECK_INT(frame_col("mono_ns"), (5005 + 20 * 3 - 1) * S);
	CHECK_INT(frame_col("label_ns"), t0 + (305 + 20 * 103 - 1) * S);	/* saved at k = 19, i = 1 */
	CHECK_INT(frame_col("gaps_ns[32]"), 100 * S);
	meter_free(m);
	pg_free(dead);
	boot = NULL;
}

/*
 * Kiln-sim seed 31569: two meters of one node, a and b, and nothing of the node billed yet. a
 * crashes at 3; the wall clock steps 700 s back at 5, b following it live (its labels 700 s
 * ahead); a restarts at 8; b is without Postgres from 10 to 40. A sandbox runs from 12 to 30; a
 * flushes [12, 20) and crashes again at 25; b, back, bills on from a's point. The node's frame
 * was saved with a flush only: none was, a restarted at the wall clock, 700 s behind b's labels,
 * and b billed from a's point to the end read in its own frame (718 s for 18 before). Now the
 * frame is saved alone (frame_keep()).
 */
static void test_a_meter_restarted_before_its_node_billed_anything_keeps_the_nodes_frame(void)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct kiln_error err = { 0 };
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *a, *b;
	bool ok;

	new_tenant(t, sizeof(t));
	grant(t, 1000000000LL, 0, "a");
	fake_now = t0;
	fake_mono = 5000 * S;
	boot = "test-boot";
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	for (int i = 1; i <= 60; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 3) {
			meter_free(a);
			a = NULL;
		}
		if (i == 5)
			fake_now -= 700 * S;
		if (i == 8)
			a = new_meter_with(true, 0);
		if (i == 10)
			meter_set_backends(b, dead, rds);
		if (i == 40)
			meter_set_backends(b, pg, rds);
		if (i == 12)
			new_sandbox(t, sb, sizeof(sb), fake_now);
		if (i == 25) {
			meter_free(a);
			a = NULL;
		}
		if (i == 30)
			stop_sandbox(sb, fake_now);
		if (a)
			meter_tick(a, &err);
		meter_tick(b, &err);
		kiln_error_clear(&err);
	}
	CHECK_INT(used(t), 18 * 257);
	CHECK_INT(meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
	meter_free(a);
	meter_free(b);
	pg_free(dead);
	boot = NULL;
}

/*
 * Two meters of one node, a and b, tick each second from 1 to 40 s, a first, on tenant t's
 * sandbox sb, running from 0 to 25 s: the wall clock steps 600 s forward just before 12 s and a
 * skips its tick at 12; `away` (a or b) uses the Redis `away_rds` from `from` to `to` s. Each
 * second billed once: 25 s used, nothing pending, Redis's balance the ledger's.
 */
static void held_step_pair_run(const char *t, const char *sb, struct meter *a, struct meter *b,
			       struct meter *away, struct rds *away_rds, int from, int to)
{
	struct kiln_error err = { 0 };
	bool ok;

	for (int i = 1; i <= 40; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == from)
			meter_set_backends(away, pg, away_rds);
		if (i == to)
			meter_set_backends(away, pg, rds);
		if (i == 12)
			fake_now += 600 * S;
		if (i == 26)
			stop_sandbox(sb, fake_now - S);	/* at 25 s, on the stepped wall clock */
		if (i != 12)
			CHECK_INT(meter_tick(a, &err), KILN_OK);
		CHECK_INT(meter_tick(b, &err), KILN_OK);
	}
	CHECK_INT(used(t), 25 * 257);
	CHECK_INT(meter_pending(a, t) + meter_pending(b, t), 0);
	CHECK_INT(redis_bal(t, &ok), ledger_bal(t));
}

/*
 * Kiln-sim seed 31233's shape: two meters of one node, a and b, tick each second, a first; one of
 * them (b, the one that tells, or a, the late one, with `late_without`) has no Redis from 5 to
 * 30 s; the wall clock steps 600 s forward just before 12 s and a skips its tick at 12. b's held
 * tick (12) begins the gap at 11 and a's (13, late) takes that start through Postgres
 * (meter_step_told, step_tell_pg()), Redis telling it nothing, so the sandbox, running from 0 to
 * 25 s, is billed each second once. Before, told nothing, a began its gap at 12, a second after
 * b's, and each one's copy of real second [11, 12) was refused behind the other's: 6,168 µcr for
 * 6,425 (the seed: one paused second lost on two sandboxes, -22 and -36 µcr).
 */
static void late_held_tick_without_redis_case(bool late_without)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct rds *dead = rds_new("unix:/nonexistent-kiln-test/redis.sock", 200);
	struct meter *a, *b, *without;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	without = late_without ? a : b;
	held_step_pair_run(t, sb, a, b, without, dead, 5, 31);
	meter_free(b);
	meter_free(a);
	rds_free(dead);
}

/* The telling meter without Redis at the step (the seed's): 6,168 µcr for 6,425 before. */
static void test_a_late_held_tick_takes_the_gap_start_told_through_postgres(void)
{
	late_held_tick_without_redis_case(false);
}

/* The late meter without Redis at its held tick: 6,168 µcr for 6,425 before. */
static void test_a_late_held_tick_without_redis_reads_the_gap_start_from_postgres(void)
{
	late_held_tick_without_redis_case(true);
}

/*
 * told_gap_start_with()'s lone late meter (its held tick at 12 s, its last at 10) told through
 * Postgres alone (meter_step_told): a start in its range is taken (10.5 s; before, 11 s), and
 * the step key, when in range too, comes first. A row in neither channel's range, like a stale
 * key, is ignored and the late held tick falls back to the second before it (11 s), as with
 * neither channel telling anything: a row of another length, or of an earlier step of the same
 * length (its start a step's length before the late meter's last tick).
 */
static void test_a_late_held_tick_reads_postgres_when_redis_tells_nothing(void)
{
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 10500), 10500);
	CHECK_INT(told_gap_start_with("600000000000 ", 10300, "", 600, 10500), 10300);
	CHECK_INT(told_gap_start_with("300000000000 ", 10300, "", 600, 10500), 10500);
	/* neither channel tells this step: the second before the held tick, as before */
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 0, 0), 11000);
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 300, 10500), 11000);
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 10500 - 600000), 11000);
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 11600), 11000);
}

/*
 * A Redis that accepts and never answers (a partition, a stopped host: nothing refuses), on a Unix
 * socket of its own, served by a thread. When a command naming `watch` (a node's step key) comes
 * in, the client waiting for its reply, the test's own connection counts the node's rows of
 * meter_step_told into `rows` (-1 until then): what a late meter reading now would find.
 */
#define HUNG_CONNS 16

struct hung_redis {
	char path[108], watch[96], node[32];
	int lfd, fd[HUNG_CONNS];
	char tail[HUNG_CONNS][96];	/* each connection's last bytes: a key split across reads */
	size_t ntail[HUNG_CONNS];
	atomic_bool stop;
	atomic_int rows;
	pthread_t thr;
};

/* Takes what connection `i` sent; false when it closed. */
static bool hung_read(struct hung_redis *h, int i)
{
	char buf[4096 + sizeof(h->tail[0])];
	size_t keep = strlen(h->watch), n0 = h->ntail[i], n;
	ssize_t r;

	memcpy(buf, h->tail[i], n0);
	r = read(h->fd[i], buf + n0, sizeof(buf) - n0);
	if (r <= 0)
		return false;
	n = n0 + (size_t)r;
	if (atomic_load(&h->rows) < 0 && memmem(buf, n, h->watch, keep))
		atomic_store(&h->rows, (int)sql_int("SELECT count(*) FROM meter_step_told "
						    "WHERE node_id = '%s'", h->node));
	keep = n < keep ? n : keep;
	memcpy(h->tail[i], buf + n - keep, keep);
	h->ntail[i] = keep;
	return true;
}

static void *hung_run(void *arg)
{
	struct hung_redis *h = arg;

	while (!atomic_load(&h->stop)) {
		struct pollfd p[1 + HUNG_CONNS] = { { .fd = h->lfd, .events = POLLIN } };

		for (int i = 0; i < HUNG_CONNS; i++)
			p[1 + i] = (struct pollfd){ .fd = h->fd[i], .events = POLLIN };
		if (poll(p, 1 + HUNG_CONNS, 50) <= 0)
			continue;
		for (int i = 0; i < HUNG_CONNS; i++)
			if (h->fd[i] >= 0 && p[1 + i].revents && !hung_read(h, i)) {
				close(h->fd[i]);
				h->fd[i] = -1;
			}
		if (p[0].revents & POLLIN) {
			int fd = accept(h->lfd, NULL, NULL), i = 0;

			while (i < HUNG_CONNS && h->fd[i] >= 0)
				i++;
			if (fd >= 0 && i < HUNG_CONNS) {
				h->fd[i] = fd;
				h->ntail[i] = 0;
			} else if (fd >= 0) {
				close(fd);
			}
		}
	}
	return NULL;
}

/* Starts `h` watching the current node's step key; its Redis URL into url. */
static void hung_start(struct hung_redis *h, char *url, size_t n)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	memset(h, 0, sizeof(*h));
	snprintf(h->path, sizeof(h->path), "/tmp/kiln-test-hung-%d.sock", (int)getpid());
	snprintf(h->node, sizeof(h->node), "%s", node);
	snprintf(h->watch, sizeof(h->watch), BILLING_METER_PREFIX "%s:step", node);
	for (int i = 0; i < HUNG_CONNS; i++)
		h->fd[i] = -1;
	atomic_store(&h->rows, -1);
	unlink(h->path);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", h->path);
	h->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (h->lfd < 0 || bind(h->lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
	    listen(h->lfd, 16) < 0 || pthread_create(&h->thr, NULL, hung_run, h) != 0) {
		perror("hung redis");
		exit(1);
	}
	snprintf(url, n, "unix:%s", h->path);
}

static void hung_stop(struct hung_redis *h)
{
	atomic_store(&h->stop, true);
	pthread_join(h->thr, NULL);
	for (int i = 0; i < HUNG_CONNS; i++)
		if (h->fd[i] >= 0)
			close(h->fd[i]);
	close(h->lfd);
	unlink(h->path);
}

/*
 * late_held_tick_without_redis_case()'s telling meter, b, with a Redis that hangs from 10 to 13 s
 * instead of refusing: each call waits out the client's timeout (200 ms here, 1 s in kiln-meter).
 * Its held tick (12) must have told Postgres when its Redis tell is sent. Before, the Redis tell
 * came first and the row was written after the timeout (no row when the step key was sent); the
 * sandbox was billed 6,425 µcr all the same, as the meters tick one after the other here. A unit
 * case of the order only: in kiln-meter a tick whose Redis hangs runs past the next second (the
 * timeout is the tick's period), so its next held tick is late and tells nothing; there the order
 * acts after a Redis that failed fast (refused, or answered an error).
 */
static void test_a_held_tick_tells_postgres_first_when_its_redis_failed_at_the_last_tick(void)
{
	char t[32], sb[32], url[128];
	int64_t t0 = aligned_now();
	struct hung_redis h;
	struct rds *hung;
	struct meter *a, *b;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	hung_start(&h, url, sizeof(url));
	hung = rds_new(url, 200);
	a = new_meter_with(true, 0);
	b = new_meter_with(true, 0);
	held_step_pair_run(t, sb, a, b, b, hung, 10, 14);
	CHECK_INT(atomic_load(&h.rows), 1);
	meter_free(b);
	meter_free(a);
	rds_free(hung);
	hung_stop(&h);
}

/*
 * The Postgres round trips a lone meter's held tick at 12 s makes (its tick a second after its
 * last, or, `late`, two: it skips 11) when its ticks from 10 s could not reach Postgres (a pool
 * on a socket that is not there), a 600 s forward step just before 12.
 */
static uint64_t held_tick_pg_calls_without_postgres(bool late)
{
	char t[32], sb[32];
	int64_t t0 = aligned_now();
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=kiln", 1);
	struct kiln_error err = { 0 };
	struct meter_stats before, after;
	struct meter *a;

	clock_case(t, sizeof(t), sb, sizeof(sb), t0);
	a = new_meter_with(true, 0);
	for (int i = 1; i <= 12; i++) {
		fake_now += S;
		fake_mono += S;
		if (i == 10)
			meter_set_backends(a, dead, rds);
		if (i == 12)
			fake_now += 600 * S;
		meter_get_stats(a, &before);
		if (!(late && i == 11))
			CHECK_INT(meter_tick(a, &err) == KILN_OK, i < 10);
		kiln_error_clear(&err);
	}
	meter_get_stats(a, &after);
	meter_set_backends(a, pg, rds);
	meter_free(a);
	pg_free(dead);
	return after.pg_calls - before.pg_calls;
}

/*
 * A held tick after a tick that could not reach Postgres asks it nothing, telling or late: each
 * statement was a new connection attempt (up to connect_timeout, 3 s a host) before the tick's
 * own. Before, one round trip counted either way.
 */
static void test_a_held_tick_asks_postgres_nothing_when_the_last_tick_could_not_reach_it(void)
{
	CHECK_INT(held_tick_pg_calls_without_postgres(false), 0);
	CHECK_INT(held_tick_pg_calls_without_postgres(true), 0);
}

/*
 * told_gap_start_with()'s lone late meter with a row in range written more than 60 s ago, as the
 * step key's TTL: ignored, the second before the held tick (11 s); before, taken (10.5 s). One
 * written 50 s ago is taken. Told on the meter's boot, its age on that boot's monotonic clock
 * decides (migrations/0058): 1 s, taken though the database's clock says 1,148 s (before, ignored:
 * 11 s); 61 s, ignored though it says 0.
 */
static void test_a_late_held_tick_ignores_a_told_row_older_than_the_step_keys_ttl(void)
{
	row_age_s = 61;
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 10500), 11000);
	row_age_s = 50;
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 10500), 10500);
	/* kiln-sim seed 77044: a database clock that stood still across the step read a row told a
	 * second before as 1,148 s old, and the late meter's gap began a second after the other's. */
	row_age_s = 1148;
	row_mono_age_s = 1;
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 10500), 10500);
	row_age_s = 0;
	row_mono_age_s = 61;
	CHECK_INT(told_gap_start_with(NULL, -1, NULL, 600, 10500), 11000);
	row_mono_age_s = -1;
	row_age_s = 0;
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_meter", KLOG_WARN, false);
	if (testdb_open(&db, "meter") != 0)
		return 1;
	pg = db.pg;
	meter_pg_session(pg);	/* the engine's pool, as kiln-meter's */
	rds = rds_new(db.redis_url, 2000);
	meter_db_url = db.url;

	TEST(test_meter_connections_run_without_jit);
	TEST(test_charge_is_exact_over_injected_time);
	TEST(test_more_changes_than_a_ticks_pieces_are_billed_over_two_ticks);
	TEST(test_paused_sandbox_pays_its_snapshot_only);
	TEST(test_one_redis_round_trip_per_tick_for_many_sandboxes);
	TEST(test_ledger_redis_and_api_balance_agree_after_flush);
	TEST(test_balance_rebuilt_after_redis_loses_it);
	TEST(test_restarted_meter_catches_up_without_charging_twice);
	TEST(test_usage_drawn_from_grants_earliest_expiry_first);
	TEST(test_grant_expiry_is_a_transfer);
	TEST(test_zero_balance_pauses_within_a_tick_and_overdraft_is_one_tick);
	TEST(test_a_resumed_sandbox_at_zero_is_asked_to_pause_again_at_once);
	TEST(test_clock_steps_bill_monotonic_time_only);
	TEST(test_meter_restarted_after_a_backward_step_keeps_its_frame);
	TEST(test_a_change_logged_before_a_forward_step_moves_on_with_it);
	TEST(test_a_meter_started_in_the_frame_after_a_forward_step_does_not_bill_it);
	TEST(test_an_expiry_passed_by_a_forward_step_waits_for_the_windows_before_it);
	TEST(test_a_change_logged_before_a_forward_step_within_the_lead_keeps_its_time);
	TEST(test_changes_before_a_backward_step_are_not_applied_again);
	TEST(test_an_ended_sandbox_is_not_billed_again_after_a_backward_step);
	TEST(test_a_change_logged_before_a_backward_step_keeps_its_time);
	TEST(test_changes_across_a_backward_step_apply_in_log_order);
	TEST(test_a_paused_generation_keeps_its_snapshot_across_a_backward_step);
	TEST(test_an_earlier_generations_change_read_after_the_point_is_not_applied);
	TEST(test_an_ended_generations_snapshot_is_found_across_a_backward_step);
	TEST(test_a_snapshot_recorded_after_its_pause_row_is_found_after_a_restart);
	TEST(test_a_snapshot_recorded_after_its_pause_row_is_found_without_postgres);
	TEST(test_a_meter_without_postgres_keeps_the_other_meters_live_field);
	TEST(test_a_taken_over_generation_carries_its_nodes_remainder);
	TEST(test_a_taken_over_generation_goes_on_from_its_point_in_another_frame);
	TEST(test_a_taken_over_generation_across_a_forward_step_is_placed_once);
	TEST(test_a_taken_over_generation_started_before_a_backward_step_keeps_its_start);
	TEST(test_an_earlier_generation_billed_short_of_its_end_is_billed_on);
	TEST(test_a_generation_that_moved_away_is_not_short_of_its_end);
	TEST(test_a_point_while_creating_is_not_the_generations_end);
	TEST(test_a_sandbox_moved_at_the_new_nodes_tick_is_billed_from_the_move);
	TEST(test_a_sandbox_moved_back_at_the_nodes_tick_is_billed_from_the_return);
	TEST(test_an_earlier_generations_end_is_kept_by_a_meter_restarted_after_a_backward_step);
	TEST(test_a_generation_ended_in_the_tick_of_the_next_has_its_end_recorded);
	TEST(test_a_move_without_a_new_generation_is_refused);
	TEST(test_two_meters_label_the_time_before_a_forward_step_alike);
	TEST(test_two_late_meters_label_the_time_before_a_forward_step_alike);
	TEST(test_dead_meter_live_field_dropped_after_bound);
	TEST(test_end_on_a_window_boundary_is_recorded);
	TEST(test_end_time_ahead_of_the_clock_is_waited_for);
	TEST(test_a_taken_over_generation_in_the_ledger_is_not_ended_here);
	TEST(test_a_taken_over_generation_started_before_a_forward_then_a_backward_step);
	TEST(test_a_tail_ended_before_a_backward_step_ends_there);
	TEST(test_a_tail_billed_past_a_late_end_after_a_backward_step_is_not_billed_again);
	TEST(test_a_point_past_its_end_by_less_than_a_step_is_the_end);
	TEST(test_a_point_past_a_late_end_is_not_moved_before_a_step_long_gone);
	TEST(test_a_change_logged_before_a_forward_step_within_the_lead_while_down_keeps_its_time);
	TEST(test_a_forward_step_taking_the_whole_lead_back_while_down_keeps_the_frame);
	TEST(test_a_change_logged_before_a_backward_step_while_down_keeps_its_time);
	TEST(test_an_end_in_a_running_point_with_the_rows_end_ahead_ends_at_the_point);
	TEST(test_a_sandbox_first_read_at_a_forward_steps_tick_keeps_its_points_state);
	TEST(test_a_change_logged_before_a_backward_step_reads_before_the_later_ones);
	TEST(test_a_change_stamped_a_little_after_a_later_one_keeps_its_frame);
	TEST(test_a_change_logged_long_after_a_backward_step_is_not_moved_before_it);
	TEST(test_a_change_read_within_the_commit_lag_keeps_its_frame);
	TEST(test_a_short_generations_changes_read_long_after_a_backward_step_keep_their_frame);
	TEST(test_a_change_logged_after_a_backward_step_while_down_is_not_moved_before_it);
	TEST(test_a_change_between_the_high_water_mark_and_the_label_reads_in_the_frame_in_force);
	TEST(test_a_change_logged_before_the_frames_own_step_keeps_its_older_frame);
	TEST(test_a_change_logged_in_the_frame_before_its_last_flush_keeps_the_frame);
	TEST(test_a_change_logged_before_the_first_tick_to_reach_postgres_after_a_step_keeps_the_frame);
	TEST(test_a_forward_step_within_the_lead_keeps_the_frames_log_seq);
	TEST(test_a_change_logged_before_the_frames_step_keeps_the_frame_before_it_at_a_restart);
	TEST(test_a_change_logged_before_the_frame_before_the_frames_step_keeps_its_own);
	TEST(test_a_frame_begun_by_a_step_while_down_keeps_the_frame_before_it);
	TEST(test_a_forward_step_taking_the_lead_back_drops_the_frames_backward_step);
	TEST(test_a_change_before_the_point_read_late_by_a_restarted_meter_is_in_it);
	TEST(test_a_change_logged_before_the_frames_own_step_keeps_it_after_a_forward_step_while_down);
	TEST(test_a_row_time_without_its_log_row_reads_in_the_saved_frame);
	TEST(test_a_short_generation_gone_from_its_node_after_a_backward_step_is_billed_on);
	TEST(test_an_older_change_read_past_a_later_one_is_not_moved_into_the_saved_frame);
	TEST(test_a_rows_time_reads_where_its_moved_log_row_is_placed);
	TEST(test_a_change_logged_before_the_last_flush_keeps_its_frame_after_a_step_while_down);
	TEST(test_a_change_logged_between_a_step_while_down_and_the_restart_keeps_its_time);
	TEST(test_a_generation_of_no_length_is_not_read_after_its_end_is_flushed);
	TEST(test_a_paused_only_generation_priced_0_is_not_read_after_its_end_is_flushed);
	TEST(test_a_sandbox_moved_back_after_its_end_mark_is_billed_on);
	TEST(test_the_end_mark_migration_marks_the_points_the_old_clause_took_as_ended);
	TEST(test_a_generation_ended_before_the_mark_is_freed_when_its_sandbox_stops);
	TEST(test_a_change_logged_between_two_steps_while_down_keeps_its_time);
	TEST(test_a_resume_logged_between_two_backward_steps_while_down_keeps_its_generation);
	TEST(test_an_end_logged_between_two_backward_steps_while_down_keeps_its_time);
	TEST(test_a_change_witnessed_on_another_boot_is_placed_by_the_frames);
	TEST(test_a_taken_over_generations_witnessed_end_is_placed_by_its_witness);
	TEST(test_a_change_witnessed_below_the_logs_wall_clock_read_is_read);
	TEST(test_a_taken_over_generations_change_before_its_point_is_open);
	TEST(test_a_change_without_a_witness_stays_after_the_witnessed_one_before_it);
	TEST(test_a_change_without_a_witness_before_a_witnessed_one_keeps_its_frame);
	TEST(test_another_nodes_change_without_a_witness_stands_no_later_than_a_witnessed_one_logged_after_it);
	TEST(test_a_meter_without_postgres_across_a_forward_step_does_not_bill_the_time_before_it_again);
	TEST(test_a_meter_without_postgres_across_a_forward_step_reads_witnessed_changes_at_their_labels);
	TEST(test_a_generation_running_through_a_forward_step_without_postgres_from_10_is_billed_once);
	TEST(test_a_generation_running_through_a_forward_step_without_postgres_from_30_is_billed_once);
	TEST(test_a_meter_without_postgres_across_two_forward_steps_does_not_bill_the_time_before_them_again);
	TEST(test_a_backward_step_after_a_forward_one_without_postgres_does_not_bill_the_time_before_them_again);
	TEST(test_a_meter_taking_its_sandbox_back_before_a_forward_step_bills_each_second_once);
	TEST(test_a_meter_started_in_a_frame_with_all_its_gaps_keeps_them_all);
	TEST(test_a_frame_with_overlapping_gaps_keeps_the_first);
	TEST(test_a_sandbox_created_in_the_held_ticks_time_is_tracked);
	TEST(test_a_taken_over_generation_started_in_the_held_ticks_time_keeps_its_start);
	TEST(test_a_late_held_tick_after_the_step_takes_the_gap_the_other_meter_began);
	TEST(test_a_late_held_tick_ticking_second_takes_the_gap_the_other_meter_began);
	TEST(test_a_late_held_tick_a_second_after_the_step_takes_the_gap_the_other_meter_began);
	TEST(test_a_held_tick_two_ticks_late_takes_the_gap_the_other_meter_began);
	TEST(test_a_late_held_tick_before_the_other_meters_takes_the_second_before_it);
	TEST(test_a_lone_late_held_tick_enforces_without_waiting);
	TEST(test_a_tick_without_postgres_projects_no_burn_over_a_forward_steps_gap);
	TEST(test_a_late_held_tick_takes_a_told_start_within_the_tolerance);
	TEST(test_a_late_held_tick_ignores_a_malformed_told_start);
	TEST(test_a_pause_is_asked_again_after_ten_real_seconds_across_a_forward_step);
	TEST(test_a_ticks_billing_end_behind_an_open_transaction_skips_a_forward_steps_gap);
	TEST(test_a_generation_taken_over_across_a_step_its_meter_missed_is_billed_once);
	TEST(test_a_change_logged_before_a_restarted_meters_first_tick_after_a_step_ends_there);
	TEST(test_a_taken_over_generation_its_own_meter_bills_first_is_billed_once);
	TEST(test_a_taken_over_generation_its_own_meter_bills_second_is_billed_once);
	TEST(test_a_taken_over_generation_its_meter_takes_back_part_way_is_billed_once);
	TEST(test_a_taken_over_generation_cut_with_the_taker_flushing_first_is_billed_once);
	TEST(test_a_taken_over_generation_billed_on_while_redis_is_away);
	TEST(test_a_cut_generation_whose_meter_dies_again_unflushed_is_billed_once);
	TEST(test_a_cut_generation_watched_across_its_takers_restart_is_billed_once);
	TEST(test_a_cut_generation_with_a_point_while_made_is_billed_once);
	TEST(test_a_generation_left_to_its_meter_after_the_takers_restart_is_billed_once);
	TEST(test_a_cut_generation_billed_from_its_start_carries_its_nodes_remainder);
	TEST(test_a_point_less_generation_goes_on_from_the_remainder_of_a_tail_billed_with_it);
	TEST(test_two_point_less_generations_of_a_node_carry_one_remainder);
	TEST(test_a_meter_with_nothing_to_bill_saves_its_frame);
	TEST(test_a_meter_with_nothing_to_bill_saves_its_frame_after_a_forward_step);
	TEST(test_a_meter_restarted_before_its_node_billed_anything_keeps_the_nodes_frame);
	TEST(test_a_late_held_tick_takes_the_gap_start_told_through_postgres);
	TEST(test_a_late_held_tick_without_redis_reads_the_gap_start_from_postgres);
	TEST(test_a_late_held_tick_reads_postgres_when_redis_tells_nothing);
	TEST(test_a_held_tick_tells_postgres_first_when_its_redis_failed_at_the_last_tick);
	TEST(test_a_held_tick_asks_postgres_nothing_when_the_last_tick_could_not_reach_it);
	TEST(test_a_late_held_tick_ignores_a_told_row_older_than_the_step_keys_ttl);

	rc = test_summary();
	rds_free(rds);
	testdb_close(&db);
	return rc;
}
