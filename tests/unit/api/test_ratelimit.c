/*
 * test_ratelimit.c - rate-limit buckets taken locally and reconciled with the services fixture's
 * Redis (api/ratelimit.c). Several limiters on one Redis stand for several gateways; a simulated
 * clock (each gateway greedy every millisecond, reconciling every RATELIMIT_SYNC_MS) checks what
 * they admit together against one shared bucket and the bound ratelimit.h states. The last cases
 * run on the real clocks, Redis's TIME included, with the process's wall clock stepped (its
 * clock_gettime, time and gettimeofday wrapped at link time: wallstep.h).
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "test.h"
#include "testredis.h"
#include "wallstep.h"

#include "api/ratelimit.h"
#include "common/clock.h"
#include "common/redis.h"

#define GW_MAX 3
#define DEBT_GW 8		/* gateways that build a debt together */
#define RATE 100		/* tokens per second */
#define BURST 50

static char redis_url[512];

static void new_bucket(char *name, size_t n)
{
	snprintf(name, n, "test:%08x%08x", (unsigned)rand(), (unsigned)rand());
}

static long long wall_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * The simulated clock of the cases' gateways (gateway()): their CLOCK_MONOTONIC and the time
 * their scripts run at in place of Redis's TIME both read sim_ms, which each take and sync below
 * sets from its `t` first.
 */
static long long sim_ms;

static long long sim_clock_ms(clockid_t clock, void *ctx)
{
	(void)ctx;
	CHECK(clock == CLOCK_MONOTONIC);	/* the limiter reads no other */
	return sim_ms;
}

static long long sim_redis_ms(void *ctx)
{
	(void)ctx;
	return sim_ms;
}

/* A gateway's limiter, without its thread, on the simulated clock. */
static struct ratelimit *gateway(struct rds *r)
{
	struct ratelimit *rl = ratelimit_new(r, false);

	CHECK(rl != NULL);
	ratelimit_set_clock_for_test(rl, sim_clock_ms, sim_redis_ms, NULL);
	return rl;
}

static void take_at(struct ratelimit *rl, const char *bucket, long long rate, long long period,
		    long long burst, long long t, struct rl_result *out)
{
	sim_ms = t;
	ratelimit_take(rl, bucket, rate, period, burst, out);
}

static void take_local_at(struct ratelimit *rl, const char *bucket, long long rate,
			  long long period, long long burst, long long t, struct rl_result *out)
{
	sim_ms = t;
	ratelimit_take_local(rl, bucket, rate, period, burst, out);
}

static enum kiln_err sync_at(struct ratelimit *rl, long long t, struct kiln_error *err)
{
	sim_ms = t;
	return ratelimit_sync(rl, err);
}

/* Tokens (thousandths) Redis holds for `bucket`, or LLONG_MIN when it has none. */
static long long redis_tokens(struct rds *r, const char *bucket)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[192];
	long long t = LLONG_MIN;

	snprintf(key, sizeof(key), "kiln:rls:%s", bucket);
	if (RDS(r, &rep, &err, "GET", key) == KILN_OK && rep.type == RDS_STR)
		t = atoll(rep.str);	/* "<tokens> <ts>" (api/ratelimit.c) */
	rds_reply_release(&rep);
	return t;
}

/* Runs "<cmd> kiln:rls:<bucket> [arg]" on `r`; returns its integer reply, or LLONG_MIN. */
static long long redis_key_cmd(struct rds *r, const char *cmd, const char *bucket, const char *arg)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[192];
	long long v = LLONG_MIN;
	enum kiln_err rc;

	snprintf(key, sizeof(key), "kiln:rls:%s", bucket);
	rc = arg ? RDS(r, &rep, &err, cmd, key, arg) : RDS(r, &rep, &err, cmd, key);
	if (rc == KILN_OK && rep.type == RDS_INT)
		v = rep.integer;
	rds_reply_release(&rep);
	CHECK(rc == KILN_OK);
	return v;
}

/*
 * `g` gateways on one bucket for `ms` simulated milliseconds from the wall clock's now: every
 * millisecond each takes until refused, then gateway i reconciles when it is i * RATELIMIT_SYNC_MS
 * / g past a period. All of them read the full bucket before any sends what it took: the worst
 * case. Returns the requests admitted in total.
 */
static long long simulate(int g, long long ms)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *rl[GW_MAX];
	struct kiln_error err = { 0 };
	char bucket[64];
	long long t0 = wall_ms(), admitted = 0;

	new_bucket(bucket, sizeof(bucket));
	for (int i = 0; i < g; i++)
		rl[i] = gateway(r);
	for (long long t = t0; t < t0 + ms; t++) {
		for (int i = 0; i < g; i++) {
			struct rl_result res = { .allowed = true };

			for (int n = 0; n < 1000 && res.allowed; n++) {
				take_local_at(rl[i], bucket, RATE, 1000, BURST, t, &res);
				CHECK(!res.redis_down);
				admitted += res.allowed;
			}
		}
		for (int i = 0; i < g; i++)
			if ((t - t0) % RATELIMIT_SYNC_MS == i * RATELIMIT_SYNC_MS / g)
				CHECK(sync_at(rl[i], t, &err) == KILN_OK);
	}
	for (int i = 0; i < g; i++)
		ratelimit_free(rl[i]);
	rds_free(r);
	return admitted;
}

/* One gateway is the shared bucket: its burst, then its rate. */
static void one_gateway_admits_burst_and_rate(void)
{
	long long n = simulate(1, 2000);

	fprintf(stderr, "  1 gateway, 2 s: %lld admitted (bucket: %d)\n", n, BURST + 2 * RATE);
	CHECK(n >= BURST + 2 * RATE - 1 && n <= BURST + 2 * RATE + 1);
}

/*
 * G gateways admit at most (G - 1) x (burst + rate x RATELIMIT_SYNC_MS) more than the shared
 * bucket, once: the excess is a debt in Redis that is repaid before the bucket serves again, so
 * over a longer run they admit what the one bucket would.
 */
static void gateways_overshoot_is_bounded_once(void)
{
	for (int g = 2; g <= GW_MAX; g++) {
		long long bound_over = (g - 1) * (BURST + RATE * RATELIMIT_SYNC_MS / 1000 + 1);

		for (int w = 0; w < 3; w++) {
			long long ms = (long long[]){ 100, 1000, 4000 }[w];
			long long ideal = BURST + RATE * ms / 1000, n = simulate(g, ms);

			fprintf(stderr, "  %d gateways, %lld ms: %lld admitted (bucket: %lld, bound: %lld)\n",
				g, ms, n, ideal, ideal + bound_over);
			CHECK(n <= ideal + bound_over);
			CHECK(n >= ideal - 1);
		}
	}
}

/*
 * A debt outlives the time a full bucket takes to refill: DEBT_GW gateways spend the bucket each
 * (a debt of DEBT_GW - 1 bursts), then the simulated clock stands still while the real time
 * Redis expires keys on runs past that refill time plus a second (the key's expiry before it
 * counted the debt). A gateway coming back finds the debt, not a new full bucket.
 */
static void a_debt_outlives_a_full_buckets_expiry(void)
{
	const long long rate = 1000, burst = 100;	/* a full refill in 100 ms */
	long long full_expiry = burst * 1000 / rate + 1000, debt = (DEBT_GW - 1) * burst * 1000;
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *rl[DEBT_GW];
	struct kiln_error err = { 0 };
	struct rl_result res;
	char bucket[64];
	long long t = wall_ms(), synced, pttl;
	int n = 0;

	new_bucket(bucket, sizeof(bucket));
	for (int i = 0; i < DEBT_GW; i++) {
		rl[i] = gateway(r);
		take_local_at(rl[i], bucket, rate, 1000, burst, t, &res);	/* reads the bucket */
		n += res.allowed;
	}
	for (int i = 0; i < DEBT_GW; i++)
		for (int k = 1; k < burst; k++) {
			take_local_at(rl[i], bucket, rate, 1000, burst, t, &res);
			n += res.allowed;
		}
	CHECK_INT(n, DEBT_GW * burst);
	for (int i = 0; i < DEBT_GW; i++)
		CHECK(sync_at(rl[i], t, &err) == KILN_OK);
	synced = wall_ms();
	CHECK_INT(redis_tokens(r, bucket), -debt);
	/* the time to refill the debt and the burst, plus a second */
	pttl = redis_key_cmd(r, "PTTL", bucket, NULL);
	CHECK(pttl > full_expiry && pttl <= (burst * 1000 + debt) / rate + 1000);
	while (wall_ms() < synced + full_expiry + 100)
		usleep(20000);
	for (int i = 0; i < DEBT_GW; i++)
		ratelimit_free(rl[i]);
	rl[0] = gateway(r);
	take_local_at(rl[0], bucket, rate, 1000, burst, t + 1, &res);
	CHECK(!res.allowed && !res.redis_down);
	CHECK(res.retry_after_ms >= (debt + 1000) / rate - 1);
	CHECK(redis_tokens(r, bucket) < 0);
	ratelimit_free(rl[0]);
	rds_free(r);
}

/* A bucket new to a gateway is read from Redis first: what another gateway took counts. */
static void a_new_bucket_is_read_from_redis(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *a = gateway(r), *b = gateway(r);
	struct kiln_error err = { 0 };
	struct rl_result res;
	char bucket[64];
	long long t = wall_ms();
	int n = 0;

	new_bucket(bucket, sizeof(bucket));
	for (int i = 0; i < BURST + 5; i++) {
		take_local_at(a, bucket, RATE, 1000, BURST, t, &res);
		n += res.allowed;
	}
	CHECK_INT(n, BURST);
	CHECK(!res.allowed && res.retry_after_ms >= 1 && res.retry_after_ms <= 1000 / RATE);
	CHECK(sync_at(a, t, &err) == KILN_OK);
	CHECK_INT(redis_tokens(r, bucket), 0);
	take_local_at(b, bucket, RATE, 1000, BURST, t, &res);
	CHECK(!res.allowed && !res.redis_down);
	take_local_at(b, bucket, RATE, 1000, BURST, t + 1000 / RATE, &res);
	CHECK(res.allowed);
	ratelimit_free(a);
	ratelimit_free(b);
	rds_free(r);
}

/*
 * The limiter's own thread sends what was taken within a few periods, and at its end (on the real
 * clocks, Redis's TIME included).
 */
static void the_thread_reconciles_on_its_own(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *a = ratelimit_new(r, true);
	struct rl_result res;
	char bucket[64], other[64];
	long long deadline;
	int n = 0;

	new_bucket(bucket, sizeof(bucket));
	new_bucket(other, sizeof(other));
	CHECK(a != NULL);
	/* one token a minute: what Redis holds afterwards is what was taken, not a refill */
	for (int i = 0; i < 5; i++) {
		ratelimit_take_local(a, bucket, 1, 60000, 3, &res);
		n += res.allowed;
	}
	CHECK_INT(n, 3);
	deadline = wall_ms() + 5000;
	while (redis_tokens(r, bucket) >= 1000 && wall_ms() < deadline)
		usleep(5000);
	CHECK(redis_tokens(r, bucket) < 1000);
	ratelimit_take_local(a, other, 1, 60000, 3, &res);
	ratelimit_take_local(a, other, 1, 60000, 3, &res);
	ratelimit_free(a);	/* its last reconciliation sends these two at once */
	CHECK(redis_tokens(r, other) < 2000);
	rds_free(r);
}

/* Without Redis a gateway's own bucket holds the limit, both ways of taking. */
static void without_redis_the_local_bucket_limits(void)
{
	char url[128], bucket[64];
	struct rds *r;
	struct ratelimit *a;
	struct rl_result res;
	long long t = wall_ms();
	int n = 0, m = 0;

	snprintf(url, sizeof(url), "unix:/nonexistent/kiln-ratelimit-%d.sock", (int)getpid());
	r = rds_new(url, 500);
	a = gateway(r);
	new_bucket(bucket, sizeof(bucket));
	for (int i = 0; i < 6; i++) {
		take_local_at(a, bucket, 1, 1000, 3, t, &res);
		CHECK(res.redis_down);
		n += res.allowed;
	}
	CHECK_INT(n, 3);
	CHECK(!res.allowed && res.retry_after_ms == 1000);
	new_bucket(bucket, sizeof(bucket));
	for (int i = 0; i < 6; i++) {
		take_at(a, bucket, 1, 1000, 2, t, &res);
		CHECK(res.redis_down);
		m += res.allowed;
	}
	CHECK_INT(m, 2);
	ratelimit_free(a);
	rds_free(r);
}

/*
 * Takes decided while Redis could not answer are not sent afterwards, both ways of taking. Redis
 * fails here on a key of the wrong type, a list (a script error, as a lost connection is for the
 * caller), then answers again once it is deleted: the buckets it then holds are full.
 */
static void takes_while_redis_fails_are_not_sent(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *a = gateway(r);
	struct kiln_error err = { 0 };
	struct rl_result res;
	char shared[64], local[64];
	long long t = wall_ms();

	new_bucket(shared, sizeof(shared));
	new_bucket(local, sizeof(local));
	redis_key_cmd(r, "RPUSH", shared, "x");
	redis_key_cmd(r, "RPUSH", local, "x");
	for (int i = 0; i < 2; i++) {
		take_at(a, shared, 1, 60000, 3, t, &res);
		CHECK(res.allowed && res.redis_down);
		take_local_at(a, local, 1, 60000, 3, t, &res);
		CHECK(res.allowed && res.redis_down);
	}
	CHECK_INT(redis_key_cmd(r, "DEL", shared, NULL), 1);
	CHECK_INT(redis_key_cmd(r, "DEL", local, NULL), 1);
	CHECK(sync_at(a, t, &err) == KILN_OK);
	CHECK_INT(redis_tokens(r, shared), 3000);
	CHECK_INT(redis_tokens(r, local), 3000);
	take_local_at(a, local, 1, 60000, 3, t, &res);
	CHECK(res.allowed && !res.redis_down);
	ratelimit_free(a);
	rds_free(r);
}

/*
 * A sync of api/ratelimit.c before 63d38a3 sent every bucket used within ACTIVE_MS (its
 * CLOCK_MONOTONIC ms), taken from or not: a bucket idle for less than that was written again.
 */
#define OLD_ACTIVE_MS 1000
#define IDLE_RUNS 5		/* runs of an_idle_bucket_is_not_sent before it gives up as too slow */

/*
 * One run of an_idle_bucket_is_not_sent on buckets and a limiter of its own. Returns the
 * CLOCK_MONOTONIC ms from just before the idle bucket's take to the end of the last sync that must
 * not send it: each sync reads that clock itself, so only a run shorter than OLD_ACTIVE_MS has
 * every sync where the old code sent the idle bucket.
 */
static long long idle_bucket_run(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *a = gateway(r);
	struct kiln_error err = { 0 };
	struct rl_result res;
	char idle[64], busy[64];
	long long t = wall_ms(), used, span;

	new_bucket(idle, sizeof(idle));
	new_bucket(busy, sizeof(busy));
	used = clock_mono_ms();
	take_local_at(a, idle, 1, 60000, 3, t, &res);
	CHECK(res.allowed && !res.redis_down);
	take_local_at(a, busy, 1, 60000, 3, t, &res);
	CHECK(res.allowed && !res.redis_down);
	CHECK(sync_at(a, t, &err) == KILN_OK);
	CHECK_INT(redis_tokens(r, idle), 2000);
	CHECK_INT(redis_key_cmd(r, "DEL", idle, NULL), 1);
	for (int round = 1; round <= 3; round++) {
		take_local_at(a, busy, 1, 60000, 3, t, &res);
		CHECK(res.allowed == (round < 3) && !res.redis_down);
		CHECK(sync_at(a, t, &err) == KILN_OK);
		CHECK_INT(redis_key_cmd(r, "EXISTS", idle, NULL), 0);
	}
	span = clock_mono_ms() - used;
	CHECK_INT(redis_tokens(r, busy), 0);
	/* its next take is sent, against what Redis holds now (a key gone is a full bucket) */
	take_local_at(a, idle, 1, 60000, 3, t, &res);
	CHECK(res.allowed);
	CHECK(sync_at(a, t, &err) == KILN_OK);
	CHECK_INT(redis_tokens(r, idle), 2000);
	ratelimit_free(a);
	rds_free(r);
	return span;
}

/*
 * A reconciliation sends only the buckets that took a token since the one before: a bucket used
 * a moment ago but idle since costs Redis nothing. Its key, deleted behind the gateway's back, is
 * not written again until the bucket takes a token; the bucket that did take is sent. A run tells
 * this from the old code only when its syncs come within OLD_ACTIVE_MS of the idle bucket's take
 * (idle_bucket_run()); a slower one is run again, and the case fails, saying so, when none of
 * IDLE_RUNS is fast enough.
 */
static void an_idle_bucket_is_not_sent(void)
{
	long long span = 0;
	int run;

	for (run = 1; run <= IDLE_RUNS; run++) {
		span = idle_bucket_run();
		if (span < OLD_ACTIVE_MS)
			break;
		fprintf(stderr, "  run %d: %lld ms from the idle bucket's take to its last sync, not "
			"under %d ms: it tells nothing%s\n", run, span, OLD_ACTIVE_MS,
			run < IDLE_RUNS ? "; run again" : "");
	}
	if (span >= OLD_ACTIVE_MS)
		fprintf(stderr, "  no run of %d came under %d ms: this machine is too slow for this "
			"case to tell an idle bucket from one used a moment ago\n", IDLE_RUNS,
			OLD_ACTIVE_MS);
	CHECK(span < OLD_ACTIVE_MS);
}

/*
 * A bucket refused a token is not idle: its reconciliation reads what the other gateways took
 * meanwhile, so it keeps refusing while their debt lasts instead of admitting from its own
 * refill. Two gateways read a full bucket and spend it each (a debt of one burst); the first,
 * refused and reconciled, still refuses once its own view would have refilled a token.
 */
static void a_refused_bucket_reads_the_others_takes(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *a = gateway(r), *b = gateway(r);
	struct kiln_error err = { 0 };
	struct rl_result res;
	char bucket[64];
	long long t = wall_ms();
	int n = 0;

	new_bucket(bucket, sizeof(bucket));
	take_local_at(a, bucket, RATE, 1000, BURST, t, &res);	/* both read it full */
	n += res.allowed;
	take_local_at(b, bucket, RATE, 1000, BURST, t, &res);
	n += res.allowed;
	for (int i = 1; i < BURST; i++) {
		take_local_at(a, bucket, RATE, 1000, BURST, t, &res);
		n += res.allowed;
		take_local_at(b, bucket, RATE, 1000, BURST, t, &res);
		n += res.allowed;
	}
	CHECK_INT(n, 2 * BURST);
	CHECK(sync_at(a, t, &err) == KILN_OK);
	CHECK(sync_at(b, t, &err) == KILN_OK);
	CHECK_INT(redis_tokens(r, bucket), -BURST * 1000);
	take_local_at(a, bucket, RATE, 1000, BURST, t + 1, &res);
	CHECK(!res.allowed);
	CHECK(sync_at(a, t + 1, &err) == KILN_OK);
	take_local_at(a, bucket, RATE, 1000, BURST, t + 1000 / RATE, &res);
	CHECK(!res.allowed);
	CHECK(res.retry_after_ms >= BURST * 1000 / RATE - 1000 / RATE);
	ratelimit_free(a);
	ratelimit_free(b);
	rds_free(r);
}

/*
 * An earlier gateway's bucket, the hash {t, ts} at kiln:rl:<bucket>, in debt by a burst at `t`,
 * with a minute to live.
 */
static void hash_bucket_in_debt(struct rds *r, const char *key, long long t)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char debt[24], ts[24];

	snprintf(debt, sizeof(debt), "%d", -BURST * 1000);
	snprintf(ts, sizeof(ts), "%lld", t);
	CHECK(RDS(r, &rep, &err, "HSET", key, "t", debt, "ts", ts) == KILN_OK);
	rds_reply_release(&rep);
	CHECK(RDS(r, &rep, &err, "PEXPIRE", key, "60000") == KILN_OK && rep.integer == 1);
	rds_reply_release(&rep);
}

/* The string or status reply of "<cmd> <key> [arg]" on `r` into `out` ("" when none). */
static void key_str(struct rds *r, const char *cmd, const char *key, const char *arg, char *out,
		    size_t n)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	enum kiln_err rc = arg ? RDS(r, &rep, &err, cmd, key, arg) : RDS(r, &rep, &err, cmd, key);
	bool text = rc == KILN_OK && (rep.type == RDS_STR || rep.type == RDS_STATUS) && rep.str;

	snprintf(out, n, "%s", text ? rep.str : "");
	rds_reply_release(&rep);
}

/*
 * The buckets of earlier gateways (hashes at kiln:rl:) are neither read nor written by either
 * script: during a rolling upgrade a gateway of the earlier version reading a string where it
 * wants a hash would fail its whole call, as if Redis were down, and refuse creations (503). The
 * new buckets start full under their own keys; each version limits with its own.
 */
static void buckets_of_earlier_gateways_are_left_alone(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *rl = gateway(r);
	struct kiln_error err = { 0 };
	struct rl_result res;
	char local[64], shared[64], old_local[192], old_shared[192], v[64];
	long long t = wall_ms();

	new_bucket(local, sizeof(local));
	new_bucket(shared, sizeof(shared));
	snprintf(old_local, sizeof(old_local), "kiln:rl:%s", local);
	snprintf(old_shared, sizeof(old_shared), "kiln:rl:%s", shared);
	hash_bucket_in_debt(r, old_local, t);
	hash_bucket_in_debt(r, old_shared, t);
	take_local_at(rl, local, RATE, 1000, BURST, t, &res);
	CHECK(res.allowed && !res.redis_down);
	CHECK_INT(sync_at(rl, t, &err), KILN_OK);	/* the sync script */
	take_at(rl, shared, RATE, 1000, BURST, t, &res);	/* the take script */
	CHECK(res.allowed && !res.redis_down);
	CHECK_INT(redis_tokens(r, local), (BURST - 1) * 1000);
	CHECK_INT(redis_tokens(r, shared), (BURST - 1) * 1000);
	key_str(r, "TYPE", old_local, NULL, v, sizeof(v));
	CHECK_STR(v, "hash");
	key_str(r, "TYPE", old_shared, NULL, v, sizeof(v));
	CHECK_STR(v, "hash");
	key_str(r, "HGET", old_local, "t", v, sizeof(v));
	CHECK_INT(atoll(v), -BURST * 1000);
	key_str(r, "HGET", old_shared, "t", v, sizeof(v));
	CHECK_INT(atoll(v), -BURST * 1000);
	ratelimit_free(rl);
	rds_free(r);
}

/*
 * A burst cut live (rate_limit_burst is a live setting) while a bucket holds more than the new
 * one, read in the millisecond it was written (no refill, so no cap before): both scripts keep
 * the bucket within the new burst and answer. Before, its expiry came out negative and SET ... PX
 * failed the script: the take read as Redis down, the sync's batch dropped.
 */
static void a_burst_cut_live_within_the_millisecond_is_kept(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct ratelimit *rl = gateway(r);
	struct kiln_error err = { 0 };
	struct rl_result res;
	char shared[64], local[64], key[192], want[64], got[64];
	long long t = wall_ms();

	new_bucket(shared, sizeof(shared));
	new_bucket(local, sizeof(local));
	take_at(rl, shared, RATE, 1000, 10 * BURST, t, &res);	/* the take script */
	CHECK(res.allowed && !res.redis_down);
	take_at(rl, shared, RATE, 1000, BURST, t, &res);
	CHECK(res.allowed && !res.redis_down);
	CHECK_INT(redis_tokens(r, shared), (BURST - 1) * 1000);
	/* the whole string, its time to the ms */
	snprintf(key, sizeof(key), "kiln:rls:%s", shared);
	snprintf(want, sizeof(want), "%d %lld", (BURST - 1) * 1000, t);
	key_str(r, "GET", key, NULL, got, sizeof(got));
	CHECK_STR(got, want);
	take_local_at(rl, local, RATE, 1000, 10 * BURST, t, &res);	/* the sync script */
	CHECK(res.allowed && !res.redis_down);
	CHECK_INT(sync_at(rl, t, &err), KILN_OK);
	take_local_at(rl, local, RATE, 1000, BURST, t, &res);
	CHECK(res.allowed && !res.redis_down);
	CHECK_INT(sync_at(rl, t, &err), KILN_OK);
	CHECK(redis_tokens(r, local) <= (BURST - 1) * 1000);
	ratelimit_free(rl);
	rds_free(r);
}

/*
 * The last cases run on the real clocks: Redis's TIME for the buckets, CLOCK_MONOTONIC for the
 * gateways' views, and this process's wall clock stepped by set_wall_step(). SLOW_RATE tokens a
 * second up to SLOW_BURST (a full refill in a second), and a STEP_WAIT_MS wait a quarter of that.
 */
#define SLOW_RATE 20
#define SLOW_BURST 20
#define STEP_WAIT_MS 250
#define HOUR_MS 3600000LL

/* Steps the process's wall clock to `step_ms` off the real one, and checks that it moved. */
static void set_wall_step(long long step_ms)
{
	long long off;

	wallstep_set(step_ms);
	off = wallstep_offset_ms();
	CHECK(off >= step_ms && off <= step_ms + 100);
}

/* Redis's TIME in ms. */
static long long redis_time_ms(struct rds *r)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	long long ms = LLONG_MIN;

	if (RDS(r, &rep, &err, "TIME") == KILN_OK && rep.type == RDS_ARRAY && rep.n == 2 &&
	    rep.elem[0].type == RDS_STR && rep.elem[1].type == RDS_STR)
		ms = atoll(rep.elem[0].str) * 1000 + atoll(rep.elem[1].str) / 1000;
	rds_reply_release(&rep);
	CHECK(ms != LLONG_MIN);
	return ms;
}

/* The ms of the last refill Redis holds for `bucket` ("<tokens> <ts>"), or LLONG_MIN. */
static long long redis_ts(struct rds *r, const char *bucket)
{
	char key[192], v[64];
	long long tokens, ts;

	snprintf(key, sizeof(key), "kiln:rls:%s", bucket);
	key_str(r, "GET", key, NULL, v, sizeof(v));
	return sscanf(v, "%lld %lld", &tokens, &ts) == 2 ? ts : LLONG_MIN;
}

/* A gateway on the real clocks whose wall clock is step_ms off the real one while it runs. */
struct stepped_gateway {
	struct ratelimit *rl;
	struct rds *r;
	long long step_ms;
};

static struct stepped_gateway stepped_gateway(struct rds *r, long long step_ms)
{
	struct stepped_gateway g = { ratelimit_new(r, false), r, step_ms };

	CHECK(g.rl != NULL);
	return g;
}

/*
 * The tokens `g` takes from `bucket` until one is refused, its wall clock stepped meanwhile: from
 * Redis (ratelimit_take) or, with `local`, from its view, then reconciled as its thread would.
 * The bucket's last refill in Redis is then Redis's time of the last script, between two TIMEs
 * read around the drain, whatever the gateway's wall clock read.
 */
static int drain(const struct stepped_gateway *g, const char *bucket, bool local)
{
	struct kiln_error err = { 0 };
	struct rl_result res = { .allowed = true };
	long long before = redis_time_ms(g->r), ts;
	int n = 0;

	set_wall_step(g->step_ms);
	while (res.allowed && n <= SLOW_BURST * 10) {
		if (local)
			ratelimit_take_local(g->rl, bucket, SLOW_RATE, 1000, SLOW_BURST, &res);
		else
			ratelimit_take(g->rl, bucket, SLOW_RATE, 1000, SLOW_BURST, &res);
		CHECK(!res.redis_down);
		n += res.allowed;
	}
	if (local)
		CHECK(ratelimit_sync(g->rl, &err) == KILN_OK);
	set_wall_step(0);
	ts = redis_ts(g->r, bucket);
	CHECK(ts >= before && ts <= redis_time_ms(g->r));
	return n;
}

/* The tokens a bucket refills in `ms` at SLOW_RATE, at most SLOW_BURST. */
static long long refill_in(long long ms)
{
	long long n = ms * SLOW_RATE / 1000;

	return n < SLOW_BURST ? n : SLOW_BURST;
}

/*
 * Waits STEP_WAIT_MS after an empty bucket's last drain, which ran from CLOCK_MONOTONIC `*from` to
 * `*to`, then drains it with `g` and checks that it refilled at its rate over that time, within a
 * token each side: not stopped, not filled at once. Sets `*from` and `*to` to this drain's.
 */
static void refilled_at_its_rate(const struct stepped_gateway *g, const char *bucket, bool local,
				 long long *from, long long *to, const char *what)
{
	long long start, end;
	int n;

	usleep(STEP_WAIT_MS * 1000);
	start = clock_mono_ms();
	n = drain(g, bucket, local);
	end = clock_mono_ms();
	fprintf(stderr, "  %s (%s): %d tokens in %lld-%lld ms (rate %d/s, burst %d)\n", what,
		local ? "local" : "shared", n, start - *to, end - *from, SLOW_RATE, SLOW_BURST);
	CHECK(n >= refill_in(start - *to) - 1);
	CHECK(n <= refill_in(end - *from) + 1);
	*from = start;
	*to = end;
}

/*
 * The process's wall clock stepped back an hour, then forward an hour (NTP, an operator), while a
 * gateway drains a bucket: it refills at its rate through both, from Redis and in the gateway's
 * view, and Redis stores its own time as the bucket's last refill. Before, the scripts and the
 * view ran on that clock: stepped back, every bucket the gateway wrote stopped refilling until its
 * clock caught up; stepped forward, each refilled at once to its burst.
 */
static void a_wall_clock_step_neither_stops_nor_fills_a_bucket(void)
{
	struct rds *r = rds_new(redis_url, 2000);

	for (int local = 0; local <= 1; local++) {
		struct stepped_gateway g = stepped_gateway(r, 0);
		char bucket[64];
		long long from, to;
		int n;

		new_bucket(bucket, sizeof(bucket));
		from = clock_mono_ms();
		n = drain(&g, bucket, local);
		to = clock_mono_ms();
		CHECK(n >= SLOW_BURST && n <= SLOW_BURST + refill_in(to - from) + 1);
		g.step_ms = -HOUR_MS;
		refilled_at_its_rate(&g, bucket, local, &from, &to, "wall clock back 1 h");
		g.step_ms = HOUR_MS;
		refilled_at_its_rate(&g, bucket, local, &from, &to, "then forward 1 h");
		ratelimit_free(g.rl);
	}
	rds_free(r);
}

/*
 * Two gateways whose wall clocks are an hour apart (the process's clock stepped by an hour while
 * the second one runs) share a bucket as one: the one ahead finds what the other spent (not a
 * bucket its clock refilled to the burst), and the one behind then gets the refill of the time
 * that passed (not nothing, as when the bucket's last refill was an hour ahead of its clock).
 */
static void gateways_an_hour_apart_share_a_bucket(void)
{
	struct rds *r = rds_new(redis_url, 2000);

	for (int local = 0; local <= 1; local++) {
		struct stepped_gateway a = stepped_gateway(r, 0), b = stepped_gateway(r, HOUR_MS);
		char bucket[64];
		long long from, to;
		int n;

		new_bucket(bucket, sizeof(bucket));
		from = clock_mono_ms();
		n = drain(&a, bucket, local);
		CHECK(n >= SLOW_BURST);
		n = drain(&b, bucket, local);
		to = clock_mono_ms();
		fprintf(stderr, "  %s: the gateway an hour ahead took %d of a spent bucket\n",
			local ? "local" : "shared", n);
		CHECK(n <= refill_in(to - from) + 1);
		for (int round = 0; round < 2; round++) {
			refilled_at_its_rate(&a, bucket, local, &from, &to, "the gateway behind");
			if (local)	/* b's view admits its own refill until it reads a's takes */
				continue;
			n = drain(&b, bucket, local);
			to = clock_mono_ms();
			CHECK(n <= refill_in(to - from) + 1);
		}
		ratelimit_free(a.rl);
		ratelimit_free(b.rl);
	}
	rds_free(r);
}

/*
 * A bucket whose last refill Redis holds as an hour ahead of its clock (written before a Sentinel
 * failover to a host whose clock is behind, or by a gateway of the version before with its wall
 * clock ahead) still refills at its rate, from Redis and in a gateway's view: the scripts take
 * that time as now. Without the clamp the bucket refilled nothing for the hour.
 */
static void a_bucket_last_refilled_ahead_of_redis_refills_at_its_rate(void)
{
	struct rds *r = rds_new(redis_url, 2000);

	for (int local = 0; local <= 1; local++) {
		struct stepped_gateway g = stepped_gateway(r, 0);
		struct rds_reply rep = { 0 };
		struct kiln_error err = { 0 };
		char bucket[64], key[192], v[64];
		long long from, to;
		int n;

		new_bucket(bucket, sizeof(bucket));
		snprintf(key, sizeof(key), "kiln:rls:%s", bucket);
		snprintf(v, sizeof(v), "0 %lld", redis_time_ms(r) + HOUR_MS);
		CHECK(RDS(r, &rep, &err, "SET", key, v, "PX", "60000") == KILN_OK);
		rds_reply_release(&rep);
		from = clock_mono_ms();
		n = drain(&g, bucket, local);
		to = clock_mono_ms();
		CHECK(n <= refill_in(to - from) + 1);
		refilled_at_its_rate(&g, bucket, local, &from, &to, "last refill 1 h ahead");
		refilled_at_its_rate(&g, bucket, local, &from, &to, "then");
		ratelimit_free(g.rl);
	}
	rds_free(r);
}

int main(void)
{
	test_seed();
	if (testredis_url(redis_url, sizeof(redis_url)) != 0)
		return 1;
	TEST(one_gateway_admits_burst_and_rate);
	TEST(gateways_overshoot_is_bounded_once);
	TEST(a_debt_outlives_a_full_buckets_expiry);
	TEST(a_new_bucket_is_read_from_redis);
	TEST(the_thread_reconciles_on_its_own);
	TEST(without_redis_the_local_bucket_limits);
	TEST(takes_while_redis_fails_are_not_sent);
	TEST(an_idle_bucket_is_not_sent);
	TEST(a_refused_bucket_reads_the_others_takes);
	TEST(buckets_of_earlier_gateways_are_left_alone);
	TEST(a_burst_cut_live_within_the_millisecond_is_kept);
	TEST(a_wall_clock_step_neither_stops_nor_fills_a_bucket);
	TEST(gateways_an_hour_apart_share_a_bucket);
	TEST(a_bucket_last_refilled_ahead_of_redis_refills_at_its_rate);
	return test_summary();
}
