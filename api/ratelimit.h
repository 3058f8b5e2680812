/*
 * ratelimit.h - named token buckets in Redis, with a local fallback.
 *
 * The gateway (api/authn.c) keeps, for each API key and for each tenant (all its keys and tokens
 * together), a bucket for all requests (rate per second, burst) and one for sandbox creation (per
 * minute). One Redis round trip (a Lua script) takes a token. When Redis cannot be reached the
 * gateway falls back to an in-process bucket of the same name, so reads keep being served with a
 * limit.
 */
#ifndef KILN_RATELIMIT_H
#define KILN_RATELIMIT_H

#include <stdbool.h>

#include "common/err.h"
#include "common/redis.h"

struct ratelimit;

struct ratelimit *ratelimit_new(struct rds *rds);
void ratelimit_free(struct ratelimit *rl);

struct rl_result {
	bool allowed;
	bool redis_down;	/* the local fallback decided */
	long long retry_after_ms;	/* when refused */
};

/*
 * Takes one token from the bucket `bucket` (e.g. "req:<key id>") refilled at `rate` tokens per
 * `period_ms` with at most `burst` tokens. `now_ms` is the caller's clock (injectable in tests).
 */
void ratelimit_take(struct ratelimit *rl, const char *bucket, long long rate, long long period_ms,
		    long long burst, long long now_ms, struct rl_result *out);

#endif
