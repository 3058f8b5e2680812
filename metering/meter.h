/*
 * meter.h - kiln-meter's engine: one tick a second, one flush to the ledger per window.
 *
 * A tick reads this node's sandboxes from Postgres (state running or paused, and those that just
 * stopped), the CPU time and memory of each VM's cgroup (vmm/cgroup.h) and its bytes from the
 * pinned eBPF counters (netpolicy/policy.h); turns the deltas of those cumulative counters and the
 * time each sandbox spent running or paused into µcr with the exact arithmetic of price.h; and
 * sends, in one Redis round trip for the whole host, each tenant's unflushed charges (the live
 * part of its balance), the per-second usage series and bandwidth totals. Every `window_s`
 * seconds the charges of each finished, aligned window go to the Postgres ledger in one
 * transaction (meter_flush_set() in migrations/0015_flush_set.sql; from a thread of its own
 * with opts.flush_thread, so the tick never waits for Postgres) together with each sandbox's
 * billed-up-to point, so a meter that crashes, or stays down for a while, picks up exactly where
 * the ledger ends: nothing charged twice, nothing lost but what the counters cannot tell.
 *
 * Two clocks, both injectable so tests can move them (the host clock is never stepped): elapsed
 * time, what is billed, is measured on the monotonic clock (`opts.mono_ns`); the wall clock
 * (`opts.now_ns`) only labels it. The meter's label clock starts at the wall clock (or at the
 * newest billed-up-to point of its node, if later; or, on the host its node's last flush ran on,
 * where that flush's label clock stands now on the monotonic clock) and advances by monotonic
 * time; it follows a
 * forward step of the wall clock by moving every tracked sandbox's billed-up-to point with it
 * (nothing is billed for the step) and stays ahead after a backward step (ticks go on; the
 * node's timestamps are read shifted by the difference). Grant expiry is a wall-clock date: it
 * is reached on the wall clock, steps included.
 */
#ifndef KILN_METERING_METER_H
#define KILN_METERING_METER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "common/pg.h"
#include "common/redis.h"
#include "metering/price.h"

struct meter;

struct meter_opts {
	const char *node_id;
	const char *cgroup_root;	/* NULL: /sys/fs/cgroup */
	const char *pin_root;		/* NULL: the default pin root; "": no byte counters */
	int64_t window_s;		/* ledger window, seconds */
	int64_t series_s;		/* seconds of per-second series kept in Redis */
	struct rate_card card;
	/* plan limits for plans without a row of their own (written as plan 'default') */
	long long plan_max_sandboxes, plan_max_vcpu_milli, plan_max_memory_mib;
	long long plan_max_snapshot_bytes;
	/* the wall clock: ns since the epoch; NULL for CLOCK_REALTIME */
	int64_t (*now_ns)(void *ctx);
	/* the monotonic clock, ns; NULL: CLOCK_MONOTONIC, or now_ns when only that is injected */
	int64_t (*mono_ns)(void *ctx);
	void *clock_ctx;
	/*
	 * The epoch of the monotonic clock (the host's boot): a meter that starts where the same
	 * epoch's label clock was saved by its node's last flush (meter_clocks) goes on in that
	 * frame, so a wall-clock step made before it started (a meter restarted after a backward
	 * step) moves none of its node's timestamps. NULL: /proc/sys/kernel/random/boot_id, or,
	 * with mono_ns injected, no such frame (it starts at the wall clock).
	 */
	const char *boot_id;
	/* seconds a live field outlives its meter's last tick in Redis; 0: 30 */
	int64_t live_ttl_s;
	/* seconds the state changes of sandboxes (sandbox_state_log) are kept once billed; 0: a day */
	int64_t log_keep_s;
	/*
	 * ms a tick's billing may stay behind its clock for a transaction still open in the
	 * database, whose state change (an end) would carry its start as its time: billing stops
	 * at the oldest such start, never past an end committed late. 0: 10 s; < 0: never waits
	 * (a change committed after a tick passed its time is applied from that tick on).
	 */
	int64_t commit_wait_ms;
	/* asks for a sandbox to be paused (its tenant is out of credits); NULL: nobody is paused */
	void (*pause)(void *ctx, const char *sandbox_id, const char *tenant_id);
	void *pause_ctx;
	unsigned test_flush_hold_ms;	/* test hook: hold each flush's transaction open this long */
	/* flush from a thread of its own (the tick hands it the windows and never waits for
	 * Postgres); false: each tick flushes before it returns */
	bool flush_thread;
};

struct meter_stats {
	uint64_t ticks;			/* ticks run */
	uint64_t ticks_failed;		/* ticks that could not read the sandboxes */
	uint64_t redis_calls;		/* Redis round trips, all of them */
	uint64_t redis_tick_calls;	/* of which the per-tick debit */
	uint64_t pg_calls;		/* Postgres round trips */
	uint64_t windows_flushed;	/* sandbox windows written to the ledger */
	uint64_t flushes;
	double flush_lag_s;		/* last flush: seconds from its oldest counter read to commit */
	double flush_s;			/* last flush: seconds it took (Postgres and Redis) */
	uint64_t flush_windows;		/* last flush: windows it wrote */
	unsigned sandboxes;		/* sandboxes tracked */
	uint64_t pauses_asked;
};

/*
 * Makes each connection `pool` opens run with JIT off (`SET jit = off` on connect,
 * pg_set_on_connect), whatever the database URL's options= or PGOPTIONS say, and prepares the
 * statements run on it (pg_set_prepared: planning the tick's query of the node's sandboxes cost
 * as much as running it, every tick). Call it right after
 * pg_new(), before the pool is shared (kiln-meter's start, bench/metering). The tick's query of
 * the node's sandboxes is costed far above jit_above_cost while the planner's statistics lag a
 * bulk change (thousands of windows and billed-up-to points flushed before autovacuum analyzed
 * them): compiled, it took seconds of Postgres CPU for a query that runs in milliseconds
 * (docs/benchmarks.md). Returns 0, or -1 when out of memory.
 */
int meter_pg_session(struct pg *pool);

/* A meter over `pg` and `rds` (both owned by the caller). NULL with `err` set on bad options. */
struct meter *meter_new(const struct meter_opts *opts, struct pg *pg, struct rds *rds,
			struct kiln_error *err);
void meter_free(struct meter *m);

/*
 * Prepares Postgres and Redis: records the rate card and the default plan limits, and drops this
 * node's live charges left in Redis by an earlier run (its unflushed charges died with it; the
 * next ticks bill that time again from the ledger's billed-up-to point). Call once before ticks;
 * ticks call it again until it succeeds, and tick (bill, and enforce from the ledger) once its
 * Postgres part is done even while Redis is away.
 */
enum kiln_err meter_start(struct meter *m, struct kiln_error *err);

/*
 * One tick at the clock's now: bills every sandbox of the node since its last tick, debits Redis,
 * asks for pauses of sandboxes whose tenant is at zero, flushes the finished windows (or hands
 * them to the flush thread and applies the outcome of the one before) and expires the grants
 * whose time came. KILN_E_UNAVAILABLE when Postgres could not be read (nothing was billed: the
 * next tick covers the time; the tracked sandboxes are still enforced on, from the balance Redis
 * answers less the burn rate since the last billed tick); Redis or flush failures are retried by
 * later ticks, and enforcement goes on from what the meter knows (docs/metering.md).
 */
enum kiln_err meter_tick(struct meter *m, struct kiln_error *err);

/*
 * The flush thread's wake-up: a descriptor that becomes readable when a flush it committed (or
 * failed) waits to be applied; -1 without the flush thread. meter_flush_settle() applies it at
 * once, on the ticking thread, so the ledger and Redis's live field count a committed flush twice
 * only for the moment between its commit and that call, not until the next tick.
 */
int meter_flush_fd(const struct meter *m);
void meter_flush_settle(struct meter *m);

/* Counts `n` ticks that never ran (the loop woke up late), for the metrics. */
void meter_note_missed(struct meter *m, uint64_t n);

void meter_get_stats(const struct meter *m, struct meter_stats *out);

/* µcr charged but not yet in the ledger, for `tenant_id` (0 when unknown). For tests. */
long long meter_pending(const struct meter *m, const char *tenant_id);

/* Sandboxes the meter holds an entry for, those that ended and are still read by its ticks too
 * (meter_get_stats() counts those not ended). For tests. */
size_t meter_tracked_for_test(const struct meter *m);

/* Test hook (the simulation, tests/integration/sim): the Postgres pool and Redis client the meter
 * uses from its next call on, so a test points a running meter at a dead address and back. */
void meter_set_backends(struct meter *m, struct pg *pg, struct rds *rds);

#endif
