/*
 * test_state_log.c - billing follows every state change at its own time, fenced on the
 * generation (issue 14): kiln-meter's engine (metering/meter.h) on injected clocks, one or two
 * meter instances per case, against the real Postgres and Redis of the ctest fixture "services".
 * Sandboxes are rows changed the way record/ changes them (each change logged in
 * sandbox_state_log by the trigger of migrations/0014); their allocation is billed by time, so
 * every expected figure is exact to the µcr.
 *
 * - a meter down across pause, resume, pause bills each piece at its state's price;
 * - a sandbox moved to another node before any flush: the old node's meter bills the old
 *   generation up to the move;
 * - a sandbox moved away and back while its first node's meter was down: each generation billed
 *   once, by its own node's meter;
 * - a sandbox moved away from a node whose meter died for good: the new node's meter bills the
 *   old generation from the dead meter's last point to the move, once;
 * - two meters of one node, one of them stalled across a restore (a new generation without a
 *   state change): every second billed once;
 * - a pause billed from the stop of its vCPUs, the CPU of writing its snapshot left out (a cgroup
 *   v2 tree of files the meter reads, record_vcpus_stopped()); a generation paused and ended
 *   while the meter's Postgres was away billed at its snapshot's size; a stop logged after a tick passed
 *   its time applied from that tick; a pause that failed after the stop paused only until the
 *   vCPUs went on; a deletion logged with the group's counter billed to it, the group gone;
 * - the log's trim.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "metering/billing.h"
#include "metering/meter.h"
#include "migrations/migrate.h"
#include "record/record.h"
#include "test.h"
#include "testdb.h"

#define S PRICE_NS_PER_S
#define WINDOW 10
#define RUN_UCR 257LL		/* 256 MiB at 1024 µcr/GiB-s + 1 GiB at 1 µcr/GiB-s */
#define PAUSED_UCR 1024LL	/* 256 MiB of snapshot at 4096 µcr/GiB-s */

static struct pg *pg;
static struct rds *rds;
static int64_t fake_now;

#define sql(...) testdb_sql(pg, __VA_ARGS__)
#define sql_int(...) testdb_sql_int(pg, __VA_ARGS__)

static int64_t fake_clock(void *ctx)
{
	(void)ctx;
	return fake_now;
}

static void new_node(char *nd, size_t n)
{
	snprintf(nd, n, "sl%08x", (unsigned)rand());
	sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
	    "accelerator, image_hash) VALUES ('%s', 'unix:/nonexistent', 16000, 16384, 32, 'qemu', "
	    "'tcg', '')",
	    nd);
}

static void new_tenant(char *t, size_t n)
{
	snprintf(t, n, "tn_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'test');"
	    "INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:tx_%s', '%s', 'grant');"
	    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	    "amount_ucr, tenant_id, reason) VALUES ('tx_%s', 'g:%s', 'grant', 'system:issuance', "
	    "'grant:tx_%s', 1000000000, '%s', 'test')",
	    t, t, t, t, t, t, t);
}

/* A sandbox of 256 MiB and 1 GiB, running on `nd` since `since_ns`, generation 1. */
static void new_sandbox(const char *t, const char *nd, char *sb, size_t n, int64_t since_ns)
{
	snprintf(sb, n, "sb_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
	    "disk_gib, timeout_s, expires_at, state_changed_at, created_at) VALUES ('%s', '%s', '%s', "
	    "'running', 'python', 1000, 256, 1, 300, now() + interval '1 hour', "
	    "to_timestamp(%lld / 1e6), to_timestamp(%lld / 1e6))",
	    sb, t, nd, (long long)(since_ns / 1000), (long long)(since_ns / 1000));
}

/* Paused at `at_ns` (record_paused's change, at a chosen time). */
static void pause_at(const char *sb, int64_t at_ns)
{
	sql("UPDATE sandboxes SET state = 'paused', net_index = NULL, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)(at_ns / 1000), sb);
}

/* Resumed on `nd` at `at_ns`: a new generation (record_resumed's change). */
static void resume_at(const char *sb, const char *nd, int64_t at_ns)
{
	sql("UPDATE sandboxes SET state = 'running', generation = generation + 1, node_id = '%s', "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    nd, (long long)(at_ns / 1000), sb);
}

static void stop_at(const char *sb, int64_t at_ns)
{
	sql("UPDATE sandboxes SET state = 'stopped', state_changed_at = to_timestamp(%lld / 1e6) "
	    "WHERE id = '%s'",
	    (long long)(at_ns / 1000), sb);
}

static long long used(const char *t)
{
	return sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
		       "WHERE tenant_id = '%s' AND kind = 'usage'", t);
}

static long long used_gen(const char *sb, int gen)
{
	return sql_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows "
		       "WHERE sandbox_id = '%s' AND generation = %d", sb, gen);
}

static bool flush_thread;	/* new meters flush from their thread (as kiln-meter does) */

/* A meter of node `nd` on the fake clock; `cg_root` NULL for none. */
static struct meter *new_meter(const char *nd, const char *cg_root)
{
	struct kiln_error err = { 0 };
	struct meter_opts o = {
		.node_id = nd,
		.cgroup_root = cg_root ? cg_root : "/nonexistent-cgroup-root",
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 900,
		.now_ns = fake_clock,
		.flush_thread = flush_thread,
	};
	struct meter *m;

	price_card_init(&o.card, 1000, 1024, 1, 4096);
	m = meter_new(&o, pg, rds, &err);
	if (!m || meter_start(m, &err) != KILN_OK) {
		fprintf(stderr, "meter: %s\n", err.msg);
		exit(1);
	}
	return m;
}

/* Ticks each meter of `ms` (NULL ones skipped) once a fake second up to `until_ns`. */
static void tick(struct meter *const *ms, int n, int64_t until_ns)
{
	struct kiln_error err = { 0 };

	while (fake_now + S <= until_ns) {
		fake_now += S;
		for (int i = 0; i < n; i++)
			if (ms[i] && meter_tick(ms[i], &err) != KILN_OK) {
				fprintf(stderr, "tick failed: %s\n", err.msg);
				kiln_error_clear(&err);
			}
	}
}

static void tick1(struct meter *m, int64_t until_ns)
{
	tick(&m, 1, until_ns);
}

/*
 * With the flush thread: lets each meter's flushes in flight finish and be applied (a tick
 * applies a finished one, and hands the thread the next), at the same fake time, until the
 * ledger's usage of tenant `t` holds still for a few rounds (at most 20 s).
 */
static void drain(struct meter *const *ms, int n, const char *t)
{
	struct kiln_error err = { 0 };
	long long last = -1;
	int still = 0;

	for (int round = 0; flush_thread && round < 100 && still < 4; round++) {
		long long u;
		usleep(200 * 1000);
		for (int i = 0; i < n; i++)
			if (ms[i] && meter_tick(ms[i], &err) != KILN_OK)
				kiln_error_clear(&err);
		u = sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
			    "WHERE tenant_id = '%s' AND kind = 'usage'", t);
		still = u == last ? still + 1 : 0;
		last = u;
	}
}

/* A window-aligned fake time `back_s` seconds before the host's now. */
static int64_t aligned(int64_t back_s)
{
	int64_t t = (int64_t)time(NULL) - back_s;

	return (t - t % WINDOW) * S;
}

/*
 * A meter down across pause -> resume -> pause: its successor bills each piece at its own state's
 * price (before the log it saw only the last change: the first pause and the resume were billed
 * as running, under the old generation).
 */
static void test_meter_down_across_pause_resume_pause_bills_each_piece(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 11 * S);	/* window [0, 10) flushed */
	meter_free(m);		/* down */
	pause_at(sb, t0 + 13 * S);
	resume_at(sb, nd, t0 + 23 * S);
	pause_at(sb, t0 + 31 * S);
	fake_now = t0 + 45 * S;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 60 * S);
	stop_at(sb, t0 + 60 * S);
	tick1(m, t0 + 72 * S);
	/* generation 1: 13 s running, 10 s paused; generation 2: 8 s running, 29 s paused */
	CHECK_INT(used_gen(sb, 1), 13 * RUN_UCR + 10 * PAUSED_UCR);
	CHECK_INT(used_gen(sb, 2), 8 * RUN_UCR + 29 * PAUSED_UCR);
	CHECK_INT(used(t), 21 * RUN_UCR + 39 * PAUSED_UCR);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' "
			  "AND state = 'none' AND generation = 2", sb), 1);
	meter_free(m);
}

/*
 * A sandbox moved to another node (paused on A, resumed on B: generation 2) before A's meter
 * flushed any window of it, that meter restarted meanwhile: A's meter still bills generation 1
 * up to the move (before, nothing of it was billed), B's bills generation 2.
 */
static void test_moved_before_first_flush_bills_the_time_before_the_move(void)
{
	char t[32], a[32], b[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *ms[2];

	new_node(a, sizeof(a));
	new_node(b, sizeof(b));
	new_tenant(t, sizeof(t));
	new_sandbox(t, a, sb, sizeof(sb), t0);
	fake_now = t0;
	ms[0] = new_meter(a, NULL);
	tick1(ms[0], t0 + 5 * S);
	meter_free(ms[0]);	/* crashed: nothing of the sandbox in the ledger */
	pause_at(sb, t0 + 6 * S);
	resume_at(sb, b, t0 + 8 * S);
	fake_now = t0 + 9 * S;
	ms[0] = new_meter(a, NULL);
	ms[1] = new_meter(b, NULL);
	tick(ms, 2, t0 + 30 * S);
	stop_at(sb, t0 + 30 * S);
	tick(ms, 2, t0 + 42 * S);
	CHECK_INT(used_gen(sb, 1), 6 * RUN_UCR + 2 * PAUSED_UCR);
	CHECK_INT(used_gen(sb, 2), 22 * RUN_UCR);
	CHECK_INT(used(t), 28 * RUN_UCR + 2 * PAUSED_UCR);
	meter_free(ms[0]);
	meter_free(ms[1]);
}

/*
 * The same move, A's meter back only after B's flushed windows of generation 2: A's meter goes on
 * from its own generation's billed-up-to point (none here: from the creation), not from B's
 * newer one, and still bills generation 1 up to the move.
 */
static void test_moved_and_billed_there_first_still_bills_the_time_before_the_move(void)
{
	char t[32], a[32], b[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *ms[2];

	new_node(a, sizeof(a));
	new_node(b, sizeof(b));
	new_tenant(t, sizeof(t));
	new_sandbox(t, a, sb, sizeof(sb), t0);
	fake_now = t0;
	ms[0] = new_meter(a, NULL);
	tick1(ms[0], t0 + 5 * S);
	meter_free(ms[0]);
	ms[0] = NULL;
	pause_at(sb, t0 + 6 * S);
	resume_at(sb, b, t0 + 8 * S);
	fake_now = t0 + 9 * S;
	ms[1] = new_meter(b, NULL);
	tick(ms, 2, t0 + 25 * S);	/* generation 2 billed up to 20 s */
	CHECK_INT(used_gen(sb, 2), 12 * RUN_UCR);
	ms[0] = new_meter(a, NULL);
	tick(ms, 2, t0 + 30 * S);
	stop_at(sb, t0 + 30 * S);
	tick(ms, 2, t0 + 42 * S);
	CHECK_INT(used_gen(sb, 1), 6 * RUN_UCR + 2 * PAUSED_UCR);
	CHECK_INT(used_gen(sb, 2), 22 * RUN_UCR);
	CHECK_INT(used(t), 28 * RUN_UCR + 2 * PAUSED_UCR);
	meter_free(ms[0]);
	meter_free(ms[1]);
}

/*
 * Moved from A to B and back to A while A's meter was down: A's meter bills generations 1 and 3,
 * B's generation 2, each once (before, A billed generation 1 from its stale point over B's time,
 * as running, and B never billed generation 2).
 */
static void test_moved_away_and_back_bills_each_generation_once(void)
{
	char t[32], a[32], b[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *ms[2];

	new_node(a, sizeof(a));
	new_node(b, sizeof(b));
	new_tenant(t, sizeof(t));
	new_sandbox(t, a, sb, sizeof(sb), t0);
	fake_now = t0;
	ms[0] = new_meter(a, NULL);
	tick1(ms[0], t0 + 11 * S);	/* generation 1 billed up to 10 */
	meter_free(ms[0]);
	pause_at(sb, t0 + 12 * S);
	resume_at(sb, b, t0 + 14 * S);
	pause_at(sb, t0 + 30 * S);
	resume_at(sb, a, t0 + 32 * S);
	fake_now = t0 + 33 * S;
	ms[0] = new_meter(a, NULL);
	ms[1] = new_meter(b, NULL);
	tick(ms, 2, t0 + 50 * S);
	stop_at(sb, t0 + 50 * S);
	tick(ms, 2, t0 + 62 * S);
	CHECK_INT(used_gen(sb, 1), 12 * RUN_UCR + 2 * PAUSED_UCR);
	CHECK_INT(used_gen(sb, 2), 16 * RUN_UCR + 2 * PAUSED_UCR);
	CHECK_INT(used_gen(sb, 3), 18 * RUN_UCR);
	CHECK_INT(used(t), 46 * RUN_UCR + 4 * PAUSED_UCR);
	meter_free(ms[0]);
	meter_free(ms[1]);
}

/*
 * Moved from A to B after A's meter died for good (its alive key still there when B's meter first
 * saw the move, gone later): B's meter bills generation 1 from A's last flushed point to the move,
 * once; A's meter coming back afterwards bills nothing of it again (before, the stretch from A's
 * point to the move was never billed: B had passed it while A still looked alive).
 */
static void test_dead_meters_generation_billed_to_the_move_once(void)
{
	char t[32], a[32], b[32], sb[32], key[128];
	int64_t t0 = aligned(3 * 60);
	struct meter *ms[2];
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	const char *del[2] = { "DEL", key };

	new_node(a, sizeof(a));
	new_node(b, sizeof(b));
	new_tenant(t, sizeof(t));
	new_sandbox(t, a, sb, sizeof(sb), t0);
	fake_now = t0;
	ms[0] = new_meter(a, NULL);
	tick1(ms[0], t0 + 11 * S);	/* generation 1 billed up to 10 in the ledger */
	drain(ms, 1, t);
	CHECK_INT(used_gen(sb, 1), 10 * RUN_UCR);
	meter_free(ms[0]);	/* dead: its alive key lasts its TTL */
	ms[0] = NULL;
	sql("UPDATE sandboxes SET generation = generation + 1, node_id = '%s', "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    b, (long long)((t0 + 20 * S) / 1000), sb);
	fake_now = t0 + 21 * S;
	ms[1] = new_meter(b, NULL);
	tick1(ms[1], t0 + 30 * S);	/* A still looks alive: B bills generation 2 alone */
	snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, a);
	CHECK(rds_command(rds, 2, del, NULL, &rep, &err) == KILN_OK);
	rds_reply_release(&rep);
	tick1(ms[1], t0 + 40 * S);
	stop_at(sb, t0 + 40 * S);
	tick1(ms[1], t0 + 52 * S);
	drain(&ms[1], 1, t);
	CHECK_INT(used_gen(sb, 1), 20 * RUN_UCR);
	CHECK_INT(used_gen(sb, 2), 20 * RUN_UCR);
	/* A's meter back: nothing of generation 1 billed twice. */
	ms[0] = new_meter(a, NULL);
	tick(ms, 2, t0 + 64 * S);
	drain(ms, 2, t);
	CHECK_INT(used_gen(sb, 1), 20 * RUN_UCR);
	CHECK_INT(used(t), 40 * RUN_UCR);
	CHECK_INT(meter_pending(ms[0], t), 0);
	CHECK_INT(meter_pending(ms[1], t), 0);
	meter_free(ms[0]);
	meter_free(ms[1]);
}

/*
 * The same with the sandbox paused on A after A's meter's last flush (on a snapshot of 128 MiB),
 * then resumed on B: the stretch B's meter takes over is billed in its states, paused at the
 * snapshot's size.
 */
static void test_dead_meters_generation_paused_billed_at_its_snapshots_size(void)
{
	char t[32], a[32], b[32], sb[32], key[128];
	int64_t t0 = aligned(3 * 60);
	struct meter *ms[2];
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	const char *del[2] = { "DEL", key };

	new_node(a, sizeof(a));
	new_node(b, sizeof(b));
	new_tenant(t, sizeof(t));
	new_sandbox(t, a, sb, sizeof(sb), t0);
	fake_now = t0;
	ms[0] = new_meter(a, NULL);
	tick1(ms[0], t0 + 11 * S);
	drain(ms, 1, t);
	meter_free(ms[0]);
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib, created_at) VALUES ('sn_%s', '%s', '%s', '%s', 'pause', %lld, "
	    "1000, 256, 1, to_timestamp(%lld / 1e6))",
	    sb, t, sb, a, 128LL << 20, (long long)((t0 + 12 * S) / 1000));
	pause_at(sb, t0 + 12 * S);
	resume_at(sb, b, t0 + 20 * S);
	fake_now = t0 + 21 * S;
	ms[1] = new_meter(b, NULL);
	tick1(ms[1], t0 + 30 * S);
	snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, a);
	CHECK(rds_command(rds, 2, del, NULL, &rep, &err) == KILN_OK);
	rds_reply_release(&rep);
	tick1(ms[1], t0 + 40 * S);
	stop_at(sb, t0 + 40 * S);
	tick1(ms[1], t0 + 52 * S);
	drain(&ms[1], 1, t);
	CHECK_INT(used_gen(sb, 1), 12 * RUN_UCR + 8 * PAUSED_UCR / 2);
	CHECK_INT(used_gen(sb, 2), 20 * RUN_UCR);
	meter_free(ms[1]);
}

/*
 * Two meters of one node, the second stalled across a restore (record_restored: a new
 * generation, no new state time): both bill the generations split at the restore's own time, and
 * the windows the stalled one sends for time the other billed are refused, so every second is
 * billed once (before, the stalled one billed generation 1 on to where it woke, over generation
 * 2's windows: seconds billed twice).
 */
static void test_two_meters_of_one_node_bill_each_second_once(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(20), restore_ns, total_ns = 50 * S;
	struct meter *ms[2];
	unsigned __int128 fine;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	ms[0] = new_meter(nd, NULL);
	ms[1] = new_meter(nd, NULL);
	tick(ms, 2, t0 + 14 * S);
	/* Restored now (the host's time: between t0 + 20 and t0 + 30 s) */
	sql("UPDATE sandboxes SET generation = generation + 1 WHERE id = '%s'", sb);
	restore_ns = (int64_t)sql_int("SELECT (extract(epoch FROM at) * 1000000)::bigint FROM "
				      "sandbox_state_log WHERE sandbox_id = '%s' AND generation = 2",
				      sb) * 1000;
	CHECK(restore_ns > t0 + 14 * S && restore_ns < t0 + 40 * S);
	tick1(ms[0], t0 + 45 * S);	/* the second stalls */
	stop_at(sb, t0 + total_ns);
	tick(ms, 2, t0 + 62 * S);
	drain(ms, 2, t);
	/* 50 s running in all, split at the restore, each generation's charge exact */
	fine = (unsigned __int128)(restore_ns - t0) * (256 * 1024 + 1024);
	CHECK_INT(used_gen(sb, 1), (long long)(fine / PRICE_FINE_PER_UCR));
	CHECK_INT(used(t), 50 * RUN_UCR);
	CHECK_INT(sql_int("SELECT count(*) FROM ledger_transfers WHERE sandbox_id = '%s' "
			  "AND period_end > to_timestamp(%lld / 1e6)",
			  sb, (long long)((t0 + total_ns) / 1000)), 0);
	/* Nothing left unflushed: a refused meter dropped its charges of the sandbox with it. */
	CHECK_INT(meter_pending(ms[0], t), 0);
	CHECK_INT(meter_pending(ms[1], t), 0);
	meter_free(ms[0]);
	meter_free(ms[1]);
}

/*
 * The same with each meter flushing from its thread, as kiln-meter does: the stalled meter's
 * refused pairs come back from the thread and are applied by a later tick, which drops what it
 * holds of the sandbox before billing it on from the ledger.
 */
static void test_two_meters_with_flush_threads_bill_each_second_once(void)
{
	flush_thread = true;
	test_two_meters_of_one_node_bill_each_second_once();
	flush_thread = false;
}

/* Writes `usec` as the CPU counter of the v2 cgroup of `sb` under `root`. */
static void cg_write(const char *root, const char *nd, const char *sb, long long usec)
{
	char path[512];
	FILE *f;

	snprintf(path, sizeof(path), "%s/kiln/%s/%s/cpu.stat", root, nd, sb);
	f = fopen(path, "w");
	if (!f) {
		fprintf(stderr, "%s: %s\n", path, strerror(errno));
		exit(1);
	}
	fprintf(f, "usage_usec %lld\nuser_usec 0\nsystem_usec 0\n", usec);
	fclose(f);
	snprintf(path, sizeof(path), "%s/kiln/%s/%s/memory.current", root, nd, sb);
	f = fopen(path, "w");
	if (f) {
		fprintf(f, "268435456\n");
		fclose(f);
	}
}

/*
 * A pause billed from the stop of its vCPUs (record_vcpus_stopped, as node/pause.c logs it) with
 * the CPU counter read at the stop: the seconds spent writing the snapshot are paused time, and
 * the CPU the VMM burns writing it is not the guest's (before, both were billed as running).
 */
static void test_pause_billed_from_the_vcpu_stop_without_the_snapshot_cpu(void)
{
	char t[32], nd[32], sb[32], root[] = "/tmp/kiln-events-cg-XXXXXX", dir[512];
	int64_t t0 = aligned(3 * 60);
	struct record_fence f;
	struct kiln_error err = { 0 };
	struct meter *m;

	if (!mkdtemp(root)) {
		CHECK(!"mkdtemp");
		return;
	}
	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	/* A cgroup v2 tree of plain files, as the meter reads it (vmm/cgroup.h) */
	snprintf(dir, sizeof(dir), "%s/cgroup.controllers", root);
	{
		FILE *c = fopen(dir, "w");
		if (!c) {
			CHECK(!"cgroup.controllers");
			return;
		}
		fprintf(c, "cpu memory pids\n");
		fclose(c);
	}
	snprintf(dir, sizeof(dir), "%s/kiln", root);
	mkdir(dir, 0700);
	snprintf(dir, sizeof(dir), "%s/kiln/%s", root, nd);
	mkdir(dir, 0700);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s", root, nd, sb);
	mkdir(dir, 0700);
	cg_write(root, nd, sb, 0);
	fake_now = t0;
	m = new_meter(nd, root);
	/* 0.5 s of CPU a second while it runs */
	for (int i = 1; i <= 5; i++) {
		cg_write(root, nd, sb, 500000LL * i);
		tick1(m, t0 + i * S);
	}
	/* The vCPUs stop at 5.5 s, the counter at 2.75 s; the snapshot then takes 3 s and 4 s of
	 * the VMM's CPU, during which the row still says running. */
	f = (struct record_fence){ .id = sb, .node_id = nd, .generation = 1 };
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, t0 + 5 * S + S / 2, 2750000000ULL, &err),
		  KILN_OK);
	for (int i = 6; i <= 8; i++) {
		cg_write(root, nd, sb, 2750000LL + 1333333LL * (i - 5));
		tick1(m, t0 + i * S);
	}
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib) VALUES ('snap_%s', '%s', '%s', '%s', 'pause', %lld, 1000, 256, 1)",
	    sb, t, sb, nd, 256LL << 20);
	snprintf(dir, sizeof(dir), "snap_%s", sb);
	CHECK_INT(record_paused(pg, NULL, &f, dir, &err), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM sandboxes WHERE id = '%s' AND state_changed_at = "
			  "to_timestamp(%lld / 1e6)", sb, (long long)((t0 + 5 * S + S / 2) / 1000)), 1);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s/cpu.stat", root, nd, sb);
	unlink(dir);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s/memory.current", root, nd, sb);
	unlink(dir);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s", root, nd, sb);
	rmdir(dir);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	tick1(m, t0 + 32 * S);
	/* 5.5 s running (2.75 CPU-s at 1000 µcr), 14.5 s paused */
	CHECK_INT(sql_int("SELECT coalesce(sum(cpu_ns), 0) FROM usage_windows WHERE sandbox_id = '%s'",
			  sb), 2750000000LL);
	CHECK_INT(used(t), 2750 + (RUN_UCR * 11) / 2 + (PAUSED_UCR * 29) / 2);
	meter_free(m);
	snprintf(dir, sizeof(dir), "%s/kiln/%s", root, nd);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/kiln", root);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/cgroup.controllers", root);
	unlink(dir);
	rmdir(root);
}

/*
 * A sandbox deleted between two ticks while its VM's group is still there (the node removes it
 * after the record): the next tick reads the group's final counter, so the CPU used between the
 * last read and the deletion is billed (before, an ended sandbox's group was not read again and
 * up to a second of its CPU went unbilled).
 */
static void test_cpu_up_to_the_deletion_is_billed(void)
{
	char t[32], nd[32], sb[32], root[] = "/tmp/kiln-events-cg-XXXXXX", dir[512];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;
	FILE *c;

	if (!mkdtemp(root)) {
		CHECK(!"mkdtemp");
		return;
	}
	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	snprintf(dir, sizeof(dir), "%s/cgroup.controllers", root);
	c = fopen(dir, "w");
	if (!c) {
		CHECK(!"cgroup.controllers");
		return;
	}
	fprintf(c, "cpu memory pids\n");
	fclose(c);
	snprintf(dir, sizeof(dir), "%s/kiln", root);
	mkdir(dir, 0700);
	snprintf(dir, sizeof(dir), "%s/kiln/%s", root, nd);
	mkdir(dir, 0700);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s", root, nd, sb);
	mkdir(dir, 0700);
	cg_write(root, nd, sb, 0);
	fake_now = t0;
	m = new_meter(nd, root);
	/* 0.5 s of CPU a second while it runs; deleted at 5.6 s with the counter at 2.8 s */
	for (int i = 1; i <= 5; i++) {
		cg_write(root, nd, sb, 500000LL * i);
		tick1(m, t0 + i * S);
	}
	cg_write(root, nd, sb, 2800000LL);
	sql("UPDATE sandboxes SET state = 'stopped', deleted_at = to_timestamp(%lld / 1e6), "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)((t0 + 5 * S + 6 * S / 10) / 1000),
	    (long long)((t0 + 5 * S + 6 * S / 10) / 1000), sb);
	tick1(m, t0 + 6 * S);
	tick1(m, t0 + 22 * S);
	CHECK_INT(sql_int("SELECT coalesce(sum(cpu_ns), 0) FROM usage_windows WHERE sandbox_id = '%s'",
			  sb), 2800000000LL);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' AND "
			  "state <> 'none'", sb), 0);
	meter_free(m);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s/cpu.stat", root, nd, sb);
	unlink(dir);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s/memory.current", root, nd, sb);
	unlink(dir);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s", root, nd, sb);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/kiln/%s", root, nd);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/kiln", root);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/cgroup.controllers", root);
	unlink(dir);
	rmdir(root);
}

/* Removes the fake cgroup tree of `sb` made under `root` (as test_cpu_up_to_the_deletion_is_billed
 * makes it); with `all`, the tree's root too. */
static void cg_tree_remove(const char *root, const char *nd, const char *sb, bool all)
{
	static const char *const files[] = { "cpu.stat", "memory.current" };
	char dir[512];

	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
		snprintf(dir, sizeof(dir), "%s/kiln/%s/%s/%s", root, nd, sb, files[i]);
		unlink(dir);
	}
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s", root, nd, sb);
	rmdir(dir);
	if (!all)
		return;
	snprintf(dir, sizeof(dir), "%s/kiln/%s", root, nd);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/kiln", root);
	rmdir(dir);
	snprintf(dir, sizeof(dir), "%s/cgroup.controllers", root);
	unlink(dir);
	rmdir(root);
}

/*
 * A running sandbox deleted while its node's meter was down, its VM's group gone before a meter
 * read it again: the deletion logged with the group's counter (record_deleted_cpu, as kiln-node
 * deletes) bills its CPU up to the deletion (before, the CPU since the last read was lost).
 */
static void test_cpu_logged_at_the_deletion_is_billed_with_the_group_gone(void)
{
	char t[32], nd[32], sb[32], root[] = "/tmp/kiln-events-cg-XXXXXX", dir[512];
	int64_t t0 = aligned(3 * 60), del;
	struct meter *m;
	struct kiln_error err = { 0 };
	FILE *c;

	if (!mkdtemp(root)) {
		CHECK(!"mkdtemp");
		return;
	}
	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	snprintf(dir, sizeof(dir), "%s/cgroup.controllers", root);
	c = fopen(dir, "w");
	if (!c) {
		CHECK(!"cgroup.controllers");
		return;
	}
	fprintf(c, "cpu memory pids\n");
	fclose(c);
	snprintf(dir, sizeof(dir), "%s/kiln", root);
	mkdir(dir, 0700);
	snprintf(dir, sizeof(dir), "%s/kiln/%s", root, nd);
	mkdir(dir, 0700);
	snprintf(dir, sizeof(dir), "%s/kiln/%s/%s", root, nd, sb);
	mkdir(dir, 0700);
	cg_write(root, nd, sb, 0);
	fake_now = t0;
	m = new_meter(nd, root);
	for (int i = 1; i <= 5; i++) {
		cg_write(root, nd, sb, 500000LL * i);
		tick1(m, t0 + i * S);
	}
	meter_free(m);	/* down, nothing flushed */
	cg_write(root, nd, sb, 4000000LL);
	CHECK(record_deleted_cpu(pg, NULL, &(struct record_fence){ sb, nd, 1 }, 4000000000ULL,
				 &err) == KILN_OK);
	cg_tree_remove(root, nd, sb, false);	/* the group goes with the VM */
	del = (int64_t)sql_int("SELECT (extract(epoch FROM deleted_at) * 1000000)::bigint "
			       "FROM sandboxes WHERE id = '%s'", sb) * 1000;
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s' "
			  "AND state = 'deleted'", sb), 1);
	m = new_meter(nd, root);
	tick1(m, del + 2 * WINDOW * S + 2 * S);
	CHECK_INT(sql_int("SELECT coalesce(sum(cpu_ns), 0) FROM usage_windows WHERE sandbox_id = '%s'",
			  sb), 4000000000LL);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' AND "
			  "state <> 'none'", sb), 0);
	meter_free(m);
	cg_tree_remove(root, nd, sb, true);
}

/*
 * A pause snapshot smaller than the guest's memory, resumed mid-second: the paused time up to the
 * resume is billed at the snapshot's size, also its last sliver, billed by the tick after the
 * resume (before, the row no longer named the snapshot then and the sliver was billed at the
 * guest's memory).
 */
static void test_paused_until_the_resume_billed_at_the_snapshots_size(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 5 * S);
	/* Paused at 5 s into a snapshot of 64 MiB (the guest has 256) */
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib) VALUES ('snap_%s', '%s', '%s', '%s', 'pause', %lld, 1000, 256, 1);"
	    "UPDATE sandboxes SET state = 'paused', pause_snapshot = 'snap_%s', net_index = NULL, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    sb, t, sb, nd, 64LL << 20, sb, (long long)((t0 + 5 * S) / 1000), sb);
	tick1(m, t0 + 12 * S);
	/* Resumed at 12.5 s: the row names no snapshot any more */
	sql("UPDATE sandboxes SET state = 'running', generation = generation + 1, "
	    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)((t0 + 12 * S + S / 2) / 1000), sb);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	tick1(m, t0 + 32 * S);
	/* 12.5 s running at 257 µcr/s, 7.5 s paused at 256 (64 MiB at 4096 µcr/GiB-s) */
	CHECK_INT(used(t), (RUN_UCR * 25) / 2 + (PAUSED_UCR / 4 * 15) / 2);
	CHECK_INT(used_gen(sb, 1), RUN_UCR * 5 + (PAUSED_UCR / 4 * 15) / 2);
	meter_free(m);
}

/*
 * A meter that crashed while a sandbox was paused into a snapshot smaller than the guest, and
 * came back after its resume: the fresh meter bills the paused time from the ledger's point to
 * the resume at the snapshot's size, though the row names no snapshot any more (before, it had
 * never seen the size and billed that stretch at the guest's memory).
 */
static void test_crashed_meter_bills_paused_time_to_the_resume_at_the_snapshots_size(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 5 * S);
	/* Paused at 5 s into a snapshot of 64 MiB (the guest has 256) */
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib, created_at) VALUES ('snap_%s', '%s', '%s', '%s', 'pause', %lld, "
	    "1000, 256, 1, to_timestamp(%lld / 1e6));"
	    "UPDATE sandboxes SET state = 'paused', pause_snapshot = 'snap_%s', net_index = NULL, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    sb, t, sb, nd, 64LL << 20, (long long)((t0 + 5 * S) / 1000), sb,
	    (long long)((t0 + 5 * S) / 1000), sb);
	/* The ledger holds up to 10 s; the meter dies at 12 s with 10 to 12 s unflushed */
	tick1(m, t0 + 12 * S);
	meter_free(m);
	/* Resumed at 12.5 s while no meter ran: the row names no snapshot any more */
	sql("UPDATE sandboxes SET state = 'running', generation = generation + 1, "
	    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)((t0 + 12 * S + S / 2) / 1000), sb);
	fake_now = t0 + 15 * S;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	tick1(m, t0 + 32 * S);
	/* 12.5 s running at 257 µcr/s, 7.5 s paused at 256 (64 MiB at 4096 µcr/GiB-s) */
	CHECK_INT(used_gen(sb, 1), RUN_UCR * 5 + (PAUSED_UCR / 4 * 15) / 2);
	CHECK_INT(used(t), (RUN_UCR * 25) / 2 + (PAUSED_UCR / 4 * 15) / 2);
	meter_free(m);
}

/* Paused at `at_ns` into a new pause snapshot of `mib` MiB made then. */
static void pause_into(const char *t, const char *nd, const char *sb, const char *snap, int mib,
		       int64_t at_ns)
{
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib, created_at) VALUES ('%s_%s', '%s', '%s', '%s', 'pause', %lld, "
	    "1000, 256, 1, to_timestamp(%lld / 1e6));"
	    "UPDATE sandboxes SET state = 'paused', pause_snapshot = '%s_%s', net_index = NULL, "
	    "state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    snap, sb, t, sb, nd, (long long)mib << 20, (long long)(at_ns / 1000), snap, sb,
	    (long long)(at_ns / 1000), sb);
}

/* Resumed at `at_ns` on its node: a new generation; the row names no snapshot any more. */
static void resume_here(const char *sb, int64_t at_ns)
{
	sql("UPDATE sandboxes SET state = 'running', generation = generation + 1, "
	    "pause_snapshot = NULL, state_changed_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)(at_ns / 1000), sb);
}

/*
 * A meter down across pause -> resume -> pause -> resume, each pause into a snapshot smaller than
 * the guest: the generation in between, which the fresh meter never saw at all, has its paused
 * time billed at its own snapshot's size (before, at the guest's memory).
 */
static void test_crashed_meter_bills_a_generation_in_between_at_its_snapshots_size(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 5 * S);
	pause_into(t, nd, sb, "sa", 64, t0 + 5 * S);
	tick1(m, t0 + 12 * S);
	meter_free(m);
	resume_here(sb, t0 + 13 * S);
	pause_into(t, nd, sb, "sb", 64, t0 + 15 * S);
	resume_here(sb, t0 + 18 * S);
	fake_now = t0 + 19 * S;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	tick1(m, t0 + 32 * S);
	/* paused 8 s, then 3 s, each at 256 µcr/s (64 MiB at 4096 µcr/GiB-s) */
	CHECK_INT(used_gen(sb, 1), RUN_UCR * 5 + PAUSED_UCR / 4 * 8);
	CHECK_INT(used_gen(sb, 2), RUN_UCR * 2 + PAUSED_UCR / 4 * 3);
	CHECK_INT(used_gen(sb, 3), RUN_UCR * 2);
	CHECK_INT(used(t), RUN_UCR * 9 + PAUSED_UCR / 4 * 11);
	meter_free(m);
}

/*
 * A meter whose Postgres went away while a sandbox paused into a snapshot smaller than the guest
 * and resumed (a new generation): once Postgres answers, the row names the new generation only,
 * and the ended one's paused time is billed at its own snapshot's size, which its pause row names
 * (before, at the guest's memory: the meter had seen the generation running only; kiln-sim `pg`,
 * seed 2, -25 µcr).
 */
static void test_meter_without_postgres_bills_a_paused_generation_at_its_snapshots_size(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct pg *dead = pg_new("host=/nonexistent-kiln-test user=kiln dbname=none", 1);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 4 * S);
	meter_set_backends(m, dead, rds);
	pause_into(t, nd, sb, "sa", 64, t0 + 5 * S);
	resume_here(sb, t0 + 13 * S);
	tick1(m, t0 + 18 * S);
	meter_set_backends(m, pg, rds);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	tick1(m, t0 + 32 * S);
	/* paused 8 s at 256 µcr/s (64 MiB at 4096 µcr/GiB-s), then 7 s running */
	CHECK_INT(used_gen(sb, 1), RUN_UCR * 5 + PAUSED_UCR / 4 * 8);
	CHECK_INT(used_gen(sb, 2), RUN_UCR * 7);
	meter_free(m);
	pg_free(dead);
}

/*
 * A vCPU stop logged after a tick already billed past its time (the tick fell between the stop
 * and its log): the pause is applied from that tick on, not lost (before, the change's time was
 * behind the billed-up-to point and the sandbox stayed billed as running through its pause).
 */
static void test_stop_logged_after_a_tick_passed_it_applies_from_the_tick(void)
{
	char t[32], nd[32], sb[32], snap[48];
	int64_t t0 = aligned(3 * 60);
	struct record_fence f;
	struct kiln_error err = { 0 };
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 6 * S);
	f = (struct record_fence){ .id = sb, .node_id = nd, .generation = 1 };
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, t0 + 5 * S + S / 2, 0, &err), KILN_OK);
	tick1(m, t0 + 8 * S);
	snprintf(snap, sizeof(snap), "snap_%s", sb);
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, vcpu_milli, "
	    "memory_mib, disk_gib) VALUES ('%s', '%s', '%s', '%s', 'pause', %lld, 1000, 256, 1)",
	    snap, t, sb, nd, 256LL << 20);
	CHECK_INT(record_paused(pg, NULL, &f, snap, &err), KILN_OK);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	tick1(m, t0 + 32 * S);
	/* running up to the tick at 6 s, paused from it */
	CHECK_INT(used(t), 6 * RUN_UCR + 14 * PAUSED_UCR);
	meter_free(m);
}

/*
 * A pause that failed after its vCPUs stopped (the snapshot could not be written; the VM goes
 * on): paused between the stop and the restart only. The stop of a sandbox that is not running,
 * or at another generation, is refused and logs nothing.
 */
static void test_failed_pause_is_paused_only_while_its_vcpus_were_stopped(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct record_fence f, stale;
	struct kiln_error err = { 0 };
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 3 * S);
	f = (struct record_fence){ .id = sb, .node_id = nd, .generation = 1 };
	stale = (struct record_fence){ .id = sb, .node_id = nd, .generation = 2 };
	CHECK_INT(record_vcpus_stopped(pg, NULL, &stale, t0 + 3 * S, 0, &err), KILN_E_CONFLICT);
	kiln_error_clear(&err);
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, t0 + 3 * S + S / 2, 0, &err), KILN_OK);
	tick1(m, t0 + 5 * S);
	CHECK_INT(record_vcpus_resumed(pg, NULL, &f, t0 + 5 * S + S / 2, &err), KILN_OK);
	tick1(m, t0 + 20 * S);
	stop_at(sb, t0 + 20 * S);
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, t0 + 21 * S, 0, &err), KILN_E_CONFLICT);
	kiln_error_clear(&err);
	tick1(m, t0 + 32 * S);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s'", sb), 4);
	CHECK_INT(used(t), 18 * RUN_UCR + 2 * PAUSED_UCR);
	meter_free(m);
}

/* The log is trimmed once billed and older than the bound; what a meter still needs stays. */
static void test_log_trimmed_once_billed(void)
{
	char t[32], nd[32], sb[32];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	new_sandbox(t, nd, sb, sizeof(sb), t0);
	fake_now = t0;
	m = new_meter(nd, NULL);
	pause_at(sb, t0 + 3 * S);
	resume_at(sb, nd, t0 + 5 * S);
	pause_at(sb, t0 + 7 * S);
	tick1(m, t0 + 21 * S);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s'", sb), 4);
	/* Generation 1 billed up to 5 s, 2 up to 20 s: with no margin, the rows of each before its
	 * newest one before its point go (and those of the earlier cases' sandboxes). */
	CHECK(sql_int("SELECT sandbox_state_log_trim(interval '0 s')") >= 2);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s'", sb), 2);
	tick1(m, t0 + 40 * S);
	CHECK_INT(used(t), 5 * RUN_UCR + 35 * PAUSED_UCR);
	meter_free(m);
}

/* Snapshot `id` of tenant `t` on `nd`, `mib` MiB, of `kind`, made at `at_ns`, deleted at once
 * when `deleted` (as node/build.c records a build's snapshot before it keeps it). */
static void new_snapshot(const char *id, const char *t, const char *nd, const char *kind, int mib,
			 int64_t at_ns, bool deleted)
{
	sql("INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, "
	    "vcpu_milli, memory_mib, disk_gib, created_at, deleted_at) VALUES ('%s', '%s', "
	    "'sb_none', '%s', '%s', %lld, 1000, 256, 1, to_timestamp(%lld / 1e6), %s)",
	    id, t, nd, kind, (long long)mib << 20, (long long)(at_ns / 1000),
	    deleted ? "now()" : "NULL");
}

static void snapshot_deleted_at(const char *id, int64_t at_ns)
{
	sql("UPDATE snapshots SET deleted_at = to_timestamp(%lld / 1e6) WHERE id = '%s'",
	    (long long)(at_ns / 1000), id);
}

/*
 * What a tenant keeps is billed as storage at the snapshot price, per second, from its keeping to
 * its deletion, on the path of a paused sandbox's snapshot: a named snapshot, a template's image
 * and a cached layer (kind build), one kept and deleted while the meter was down (billed when it
 * is back, once); a build snapshot never kept, a pause snapshot (billed with its paused sandbox)
 * and a fork snapshot are not. Before, none of them was billed.
 */
static void test_kept_snapshots_billed_as_storage(void)
{
	char t[32], nd[32], named[40], image[40], down[40], never[40], pause[40], fork[40];
	int64_t t0 = aligned(3 * 60);
	struct meter *m;

	new_node(nd, sizeof(nd));
	new_tenant(t, sizeof(t));
	snprintf(named, sizeof(named), "snap_n%s", t);
	snprintf(image, sizeof(image), "snap_i%s", t);
	snprintf(down, sizeof(down), "snap_d%s", t);
	snprintf(never, sizeof(never), "snap_x%s", t);
	snprintf(pause, sizeof(pause), "snap_p%s", t);
	snprintf(fork, sizeof(fork), "snap_f%s", t);
	fake_now = t0;
	m = new_meter(nd, NULL);
	new_snapshot(named, t, nd, "named", 512, t0 + 2 * S, false);
	new_snapshot(image, t, nd, "build", 256, t0 + 4 * S, false);
	new_snapshot(never, t, nd, "build", 4096, t0 + 4 * S, true);
	new_snapshot(pause, t, nd, "pause", 4096, t0 + 4 * S, false);
	new_snapshot(fork, t, nd, "fork", 4096, t0 + 4 * S, false);
	tick1(m, t0 + 16 * S);
	snapshot_deleted_at(named, t0 + 17 * S);
	tick1(m, t0 + 31 * S);
	drain(&m, 1, t);
	meter_free(m);		/* down across the keeping and the deletion of `down` */
	new_snapshot(down, t, nd, "named", 256, t0 + 33 * S, false);
	snapshot_deleted_at(down, t0 + 38 * S);
	fake_now = t0 + 45 * S;
	m = new_meter(nd, NULL);
	tick1(m, t0 + 51 * S);
	snapshot_deleted_at(image, t0 + 52 * S);
	tick1(m, t0 + 72 * S);
	drain(&m, 1, t);
	/* 512 MiB for 15 s, 256 MiB for 48 s and for 5 s; 4 µcr per MiB-second */
	CHECK_INT(used_gen(named, 1), 15 * 2 * PAUSED_UCR);
	CHECK_INT(used_gen(image, 1), 48 * PAUSED_UCR);
	CHECK_INT(used_gen(down, 1), 5 * PAUSED_UCR);
	CHECK_INT(used_gen(never, 1) + used_gen(pause, 1) + used_gen(fork, 1), 0);
	CHECK_INT(used(t), (30 + 48 + 5) * PAUSED_UCR);
	CHECK_INT(sql_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id IN ('%s', '%s', "
			  "'%s') AND state = 'none'", named, image, down), 3);
	/* Billed to their deletions, their log rows go with the trim, as an ended sandbox's. */
	CHECK(sql_int("SELECT sandbox_state_log_trim(interval '0 s')") >= 5);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id IN ('%s', '%s', "
			  "'%s')", named, image, down), 0);
	/* A build snapshot recorded deleted and kept (its deletion cleared) is kept from then. */
	sql("UPDATE snapshots SET deleted_at = NULL WHERE id = '%s'", never);
	CHECK_INT(sql_int("SELECT count(*) FROM snapshots WHERE id = '%s' "
			  "AND kept_since > now() - interval '1 minute'", never), 1);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_state_log WHERE sandbox_id = '%s' "
			  "AND state = 'paused'", never), 1);
	snapshot_deleted_at(never, t0 + 90 * S);
	meter_free(m);
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_state_log", KLOG_WARN, false);
	if (testdb_open(&db, "statelog") != 0)
		return 1;
	pg = db.pg;
	rds = rds_new(db.redis_url, 2000);

	TEST(test_meter_down_across_pause_resume_pause_bills_each_piece);
	TEST(test_moved_before_first_flush_bills_the_time_before_the_move);
	TEST(test_moved_and_billed_there_first_still_bills_the_time_before_the_move);
	TEST(test_moved_away_and_back_bills_each_generation_once);
	TEST(test_dead_meters_generation_billed_to_the_move_once);
	TEST(test_dead_meters_generation_paused_billed_at_its_snapshots_size);
	TEST(test_two_meters_of_one_node_bill_each_second_once);
	TEST(test_two_meters_with_flush_threads_bill_each_second_once);
	TEST(test_pause_billed_from_the_vcpu_stop_without_the_snapshot_cpu);
	TEST(test_cpu_up_to_the_deletion_is_billed);
	TEST(test_cpu_logged_at_the_deletion_is_billed_with_the_group_gone);
	TEST(test_paused_until_the_resume_billed_at_the_snapshots_size);
	TEST(test_crashed_meter_bills_paused_time_to_the_resume_at_the_snapshots_size);
	TEST(test_crashed_meter_bills_a_generation_in_between_at_its_snapshots_size);
	TEST(test_meter_without_postgres_bills_a_paused_generation_at_its_snapshots_size);
	TEST(test_stop_logged_after_a_tick_passed_it_applies_from_the_tick);
	TEST(test_failed_pause_is_paused_only_while_its_vcpus_were_stopped);
	TEST(test_log_trimmed_once_billed);
	TEST(test_kept_snapshots_billed_as_storage);

	rc = test_summary();
	rds_free(rds);
	testdb_close(&db);
	return rc;
}
