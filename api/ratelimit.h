/*
 * ratelimit.h - named token buckets shared through Redis.
 *
 * The gateway (api/authn.c) keeps, for each API key and for each tenant (all its keys and tokens
 * together), a bucket for all requests (rate per second, burst) and one for sandbox creation (per
 * minute), and kiln-gateway's port URLs one per port (api/portproxy.c).
 *
 * Two ways to take a token:
 * - ratelimit_take() asks Redis (one Lua script, one round trip): exact across gateways. Used where
 *   a token is worth a round trip (creations, port URLs).
 * - ratelimit_take_local() decides in-process from the gateway's view of the shared bucket, which a
 *   thread of its own reconciles with Redis every RATELIMIT_SYNC_MS (one script call carrying every
 *   bucket that took or refused a token since the last call: the tokens it took, and back the
 *   tokens Redis holds after everyone's; an idle bucket is not sent).
 *   A bucket seen for the first time is read from Redis before its first decision. With one
 *   gateway this is the shared bucket exactly; with G gateways they can together admit at most
 *   (G - 1) x (burst + rate x RATELIMIT_SYNC_MS) more than one shared bucket would, and that excess
 *   is kept in Redis as a debt (tokens below zero) that refills before anyone is served again, so
 *   over time the rate holds. The key expires only a second after the debt and the burst have
 *   refilled (a key gone is a full bucket).
 * When Redis cannot be reached both fall back to the in-process bucket of the same name, so reads
 * keep being served with a limit; what a gateway took during the outage is not sent afterwards.
 * Creations refuse what the fallback decides (their caller answers 503), so their takes would be
 * debts for nothing; and for the others, Redis refills a bucket by at most its burst over the
 * outage, so one gateway's takes within the rate would come back as a debt.
 *
 * The buckets in Redis refill on one clock, the current primary's (the scripts read its TIME),
 * never on a gateway's wall clock: on the gateways' wall clocks, as they were, a gateway whose
 * clock stepped back stopped refilling every bucket it wrote until its clock caught up, one
 * stepped forward refilled them at once to the burst, and gateways with skewed clocks refilled a
 * shared bucket wrongly. A bucket last refilled ahead of the primary's clock (a Sentinel failover
 * to a host whose clock is behind, or a gateway of the version before, which wrote its wall
 * clock's ms) is taken as refilled now: no tokens for that distance, no wait for it either.
 * A gateway's view (its local buckets, the fallback's included) refills on its CLOCK_MONOTONIC
 * alone: its times are only compared with each other, a reconciliation's reading counting from
 * when it was sent, so no step of the gateway's wall clock moves it either.
 */
#ifndef KILN_RATELIMIT_H
#define KILN_RATELIMIT_H

#include <stdbool.h>
#include <time.h>

#include "common/err.h"
#include "common/redis.h"

#define RATELIMIT_SYNC_MS 25

struct ratelimit;

/* A limiter on `rds`; with `sync_thread` it starts the thread that reconciles local buckets. */
struct ratelimit *ratelimit_new(struct rds *rds, bool sync_thread);
/* Stops the thread (after one last reconciliation) and frees. Accepts NULL. */
void ratelimit_free(struct ratelimit *rl);

struct rl_result {
	bool allowed;
	bool redis_down;	/* the local fallback decided */
	long long retry_after_ms;	/* when refused */
};

/*
 * Takes one token from the bucket `bucket` (e.g. "req:<key id>") refilled at `rate` tokens per
 * `period_ms` with at most `burst` tokens.
 */
void ratelimit_take(struct ratelimit *rl, const char *bucket, long long rate, long long period_ms,
		    long long burst, struct rl_result *out);

/* The same from the local view of the bucket (see above). */
void ratelimit_take_local(struct ratelimit *rl, const char *bucket, long long rate,
			  long long period_ms, long long burst, struct rl_result *out);

/*
 * One reconciliation of the local buckets with Redis (what the thread does every
 * RATELIMIT_SYNC_MS): sends the buckets that took or refused a token since the last one (and,
 * after a round that did not reach Redis, those used within a second). Returns KILN_OK or the
 * Redis error; buckets idle for a minute are dropped.
 */
enum kiln_err ratelimit_sync(struct ratelimit *rl, struct kiln_error *err);

/*
 * Tests: what the limiter's clock reads, `ms_of(clock, ctx)` in place of clock_ms_of() (it asks
 * for CLOCK_MONOTONIC only), and, when `redis_ms` is not NULL, the time the scripts run at in
 * place of Redis's TIME (a simulated clock can then run faster than Redis's). NULLs restore both.
 * Set before the limiter is used.
 */
void ratelimit_set_clock_for_test(struct ratelimit *rl,
				  long long (*ms_of)(clockid_t clock, void *ctx),
				  long long (*redis_ms)(void *ctx), void *ctx);

#endif
