/*
 * ratelimit.c - token buckets in Redis (one EVALSHA per request) with a local fallback.
 */
#include "ratelimit.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/*
 * KEYS[1] bucket; ARGV: rate, period_ms, burst, now_ms. Returns {allowed, retry_after_ms}.
 * Tokens are kept in thousandths so slow rates refill smoothly.
 */
static const char bucket_lua[] =
	"local rate, period, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])\n"
	"local cap = burst * 1000\n"
	"local s = redis.call('HMGET', KEYS[1], 't', 'ts')\n"
	"local tokens, ts = tonumber(s[1]), tonumber(s[2])\n"
	"if not tokens then tokens, ts = cap, now end\n"
	"if now > ts then tokens = math.min(cap, tokens + math.floor((now - ts) * rate * 1000 / period)); ts = now end\n"
	"local allowed, wait = 0, 0\n"
	"if tokens >= 1000 then tokens = tokens - 1000; allowed = 1\n"
	"else wait = math.ceil((1000 - tokens) * period / (rate * 1000)) end\n"
	"redis.call('HSET', KEYS[1], 't', tokens, 'ts', ts)\n"
	"redis.call('PEXPIRE', KEYS[1], math.ceil(burst * period / rate) + 1000)\n"
	"return {allowed, wait}\n";

#define LOCAL_SLOTS 1024

struct local_bucket {
	char name[160];
	long long tokens;	/* thousandths */
	long long ts;		/* ms */
};

struct ratelimit {
	struct rds *rds;
	char sha[48];
	pthread_mutex_t lock;
	struct local_bucket local[LOCAL_SLOTS];
};

struct ratelimit *ratelimit_new(struct rds *rds)
{
	struct ratelimit *rl = calloc(1, sizeof(*rl));

	if (!rl)
		return NULL;
	rl->rds = rds;
	pthread_mutex_init(&rl->lock, NULL);
	return rl;
}

void ratelimit_free(struct ratelimit *rl)
{
	if (!rl)
		return;
	pthread_mutex_destroy(&rl->lock);
	free(rl);
}

static unsigned long hash_str(const char *s)
{
	unsigned long h = 5381;

	while (*s)
		h = h * 33 + (unsigned char)*s++;
	return h;
}

/* The same bucket arithmetic in-process; collisions share a bucket, which only makes it stricter. */
static void local_take(struct ratelimit *rl, const char *bucket, long long rate, long long period,
		       long long burst, long long now, struct rl_result *out)
{
	struct local_bucket *b = &rl->local[hash_str(bucket) % LOCAL_SLOTS];
	long long cap = burst * 1000;

	pthread_mutex_lock(&rl->lock);
	if (strcmp(b->name, bucket) != 0) {
		snprintf(b->name, sizeof(b->name), "%s", bucket);
		b->tokens = cap;
		b->ts = now;
	}
	if (now > b->ts) {
		long long add = (now - b->ts) * rate * 1000 / period;
		b->tokens = b->tokens + add > cap ? cap : b->tokens + add;
		b->ts = now;
	}
	if (b->tokens >= 1000) {
		b->tokens -= 1000;
		out->allowed = true;
	} else {
		out->allowed = false;
		out->retry_after_ms = ((1000 - b->tokens) * period + rate * 1000 - 1) / (rate * 1000);
	}
	pthread_mutex_unlock(&rl->lock);
}

void ratelimit_take(struct ratelimit *rl, const char *bucket, long long rate, long long period_ms,
		    long long burst, long long now_ms, struct rl_result *out)
{
	char key[192], a1[24], a2[24], a3[24], a4[24];
	struct rds_reply rep;
	struct kiln_error err = { 0 };
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	snprintf(key, sizeof(key), "kiln:rl:%s", bucket);
	snprintf(a1, sizeof(a1), "%lld", rate);
	snprintf(a2, sizeof(a2), "%lld", period_ms);
	snprintf(a3, sizeof(a3), "%lld", burst);
	snprintf(a4, sizeof(a4), "%lld", now_ms);

	if (!rl->sha[0]) {
		rc = RDS(rl->rds, &rep, &err, "SCRIPT", "LOAD", bucket_lua);
		if (rc == KILN_OK && rep.type == RDS_STR) {
			pthread_mutex_lock(&rl->lock);
			snprintf(rl->sha, sizeof(rl->sha), "%s", rep.str);
			pthread_mutex_unlock(&rl->lock);
		}
		rds_reply_release(&rep);
		if (rc != KILN_OK)
			goto fallback;
	}
	rc = RDS(rl->rds, &rep, &err, "EVALSHA", rl->sha, "1", key, a1, a2, a3, a4);
	if (rc == KILN_E_INTERNAL && strstr(err.msg, "NOSCRIPT")) {
		/* Redis restarted and lost its script cache. */
		kiln_error_clear(&err);
		rc = RDS(rl->rds, &rep, &err, "EVAL", bucket_lua, "1", key, a1, a2, a3, a4);
	}
	if (rc != KILN_OK)
		goto fallback;
	if (rep.type == RDS_ARRAY && rep.n == 2 && rep.elem[0].type == RDS_INT) {
		out->allowed = rep.elem[0].integer == 1;
		out->retry_after_ms = rep.elem[1].integer;
		rds_reply_release(&rep);
		return;
	}
	rds_reply_release(&rep);
	log_warn("unexpected rate limit reply from redis");
fallback:
	out->redis_down = true;
	local_take(rl, bucket, rate, period_ms, burst, now_ms, out);
}
