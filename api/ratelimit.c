/*
 * ratelimit.c - token buckets in Redis: one script call per request (ratelimit_take), or a local
 * view reconciled with Redis every RATELIMIT_SYNC_MS (ratelimit_take_local). See ratelimit.h.
 */
#include "ratelimit.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"

/*
 * What both scripts start with: rl_read(key) returns a bucket's tokens and ts (nil when the key
 * is missing or its string has another shape: a full bucket), rl_write(key, tokens, ts, ttl_ms)
 * stores them. Both numbers are integers well below 2^53 (thousandths of a burst, a ms time),
 * which Lua's numbers and "%.0f" keep exact ("%d" casts to the server's C long, 32 bits on some
 * builds). rl_now(arg) is the time the script runs at: Redis's TIME in ms, so that every gateway
 * refills a bucket on the same clock (Redis 7 replicates a script's effects, not the script, so
 * it may read TIME before writing), or `arg` when a test gives one
 * (ratelimit_set_clock_for_test); gateways pass "". A ts ahead of that time is clamped to it (no
 * refill until then, and none for the distance): the primary's clock is not every writer's, as a
 * Sentinel failover moves the buckets to another host's clock and a gateway of the version before
 * wrote its own wall clock's ms, so a ts in the future would otherwise stop the bucket's refill
 * until that time came.
 */
#define RL_LUA_HELPERS \
	"local function rl_now(arg)\n" \
	"  if arg ~= '' then return tonumber(arg) end\n" \
	"  local t = redis.call('TIME')\n" \
	"  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n" \
	"end\n" \
	"local function rl_read(k)\n" \
	"  local s = redis.call('GET', k)\n" \
	"  if not s then return nil, nil end\n" \
	"  local t, ts = string.match(s, '^(-?%d+) (%d+)$')\n" \
	"  return tonumber(t), tonumber(ts)\n" \
	"end\n" \
	"local function rl_clamp(ts, now)\n" \
	"  if ts > now then return now end\n" \
	"  return ts\n" \
	"end\n" \
	"local function rl_write(k, tokens, ts, ttl)\n" \
	"  redis.call('SET', k, string.format('%.0f %.0f', tokens, ts), 'PX', ttl)\n" \
	"end\n"

/*
 * Both scripts keep a bucket as the string "<tokens> <ts>": its tokens in thousandths (so slow
 * rates refill smoothly) and the ms of its last refill, and agree on its arithmetic. The key
 * expires a second after the time its tokens take to refill to the burst, a debt included: a key
 * gone is a full bucket, so one that expired sooner would write a debt off. A bucket never holds
 * more than its burst, even read in the millisecond it was written (no refill): with the burst
 * cut live, tokens above the new one made that time negative, and SET ... PX refuses it. A
 * string is read with one GET and written with its expiry by one SET ... PX, where a hash took
 * HMGET, HSET and PEXPIRE: Redis's work per bucket is mostly those calls, and the reconciliation
 * sends every bucket used in the last RATELIMIT_SYNC_MS. The keys are named anew (kiln:rls:,
 * where the hashes {t, ts} of earlier gateways were kiln:rl:), so gateways of both versions in
 * one rolling upgrade never read each other's type: each limits with its own buckets until the
 * upgrade ends.
 * The ts is Redis's time; gateways of the version before it wrote their own wall clock's there,
 * the same epoch ms, so both versions share the keys through a rolling upgrade (each refilling
 * on the clock it has, as before; a ts one of them wrote ahead of Redis's is clamped, above).
 *
 * take: KEYS[1] bucket; ARGV: rate, period_ms, burst, now ("" for Redis's TIME). Returns
 * {allowed, retry_after_ms}.
 */
static const char take_lua[] =
	RL_LUA_HELPERS
	"local rate, period, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), rl_now(ARGV[4])\n"
	"local cap = burst * 1000\n"
	"local tokens, ts = rl_read(KEYS[1])\n"
	"if not tokens then tokens, ts = cap, now end\n"
	"ts = rl_clamp(ts, now)\n"
	"if now > ts then tokens = tokens + math.floor((now - ts) * rate * 1000 / period); ts = now end\n"
	"if tokens > cap then tokens = cap end\n"
	"local allowed, wait = 0, 0\n"
	"if tokens >= 1000 then tokens = tokens - 1000; allowed = 1\n"
	"else wait = math.ceil((1000 - tokens) * period / (rate * 1000)) end\n"
	"rl_write(KEYS[1], tokens, ts, math.ceil((cap - tokens) * period / (rate * 1000)) + 1000)\n"
	"return {allowed, wait}\n";

/*
 * sync: KEYS buckets; ARGV[1] now ("" for Redis's TIME), then per bucket rate, period_ms, burst,
 * taken (tokens a gateway already admitted: subtracted even below zero, a debt that refills
 * before the next token). Returns the tokens (thousandths) each bucket holds afterwards.
 */
static const char sync_lua[] =
	RL_LUA_HELPERS
	"local now, out = rl_now(ARGV[1]), {}\n"
	"for i, k in ipairs(KEYS) do\n"
	"  local a = 2 + (i - 1) * 4\n"
	"  local rate, period, burst, taken = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])\n"
	"  local cap = burst * 1000\n"
	"  local tokens, ts = rl_read(k)\n"
	"  if not tokens then tokens, ts = cap, now end\n"
	"  ts = rl_clamp(ts, now)\n"
	"  if now > ts then tokens = tokens + math.floor((now - ts) * rate * 1000 / period); ts = now end\n"
	"  if tokens > cap then tokens = cap end\n"
	"  tokens = tokens - taken * 1000\n"
	"  rl_write(k, tokens, ts, math.ceil((cap - tokens) * period / (rate * 1000)) + 1000)\n"
	"  out[i] = tokens\n"
	"end\n"
	"return out\n";

#define LB_SLOTS 4096
#define LB_NAME_MAX 160
#define SYNC_BATCH 128		/* buckets per script call */
#define ACTIVE_MS 1000		/* after an outage, a bucket used this recently is read back */
#define IDLE_DROP_MS 60000	/* a bucket unused this long is dropped (read again at its next use) */

/* The gateway's view of a bucket: Redis's tokens at the last sync, less what it took since. */
struct local_bucket {
	char name[LB_NAME_MAX];
	long long rate, period, burst;
	long long tokens;	/* thousandths; below zero while a debt refills */
	long long ts;		/* gateway_ms() the tokens were refilled to */
	long long unsent;	/* tokens taken here since the last sync, Redis up */
	bool refused;		/* a take was refused since the last sync */
	long long used_ms;	/* gateway_ms() of the last use: a wall-clock step drops nothing */
	bool known;		/* read from Redis once (or Redis was down then) */
	struct local_bucket *next;
};

struct sync_item {
	struct local_bucket *b;
	char name[LB_NAME_MAX];
	long long rate, period, burst, taken;
};

/* One script call's arguments: EVALSHA, sha, numkeys, the keys, now, 4 numbers per key. */
struct sync_args {
	const char *argv[4 + SYNC_BATCH * 5];
	char keys[SYNC_BATCH][LB_NAME_MAX + 16];
	char nums[2 + SYNC_BATCH * 4][24];
};

struct ratelimit {
	struct rds *rds;
	pthread_mutex_t lock;	/* the table and the script hashes */
	pthread_mutex_t sync_lock;	/* one reconciliation at a time; taken before `lock` */
	char take_sha[48], sync_sha[48];
	bool redis_ok;		/* the last sync reached Redis (atomic) */
	/* Tests' clocks (ratelimit_set_clock_for_test); set before use, then only read. */
	long long (*ms_of)(clockid_t clock, void *ctx);
	long long (*redis_ms)(void *ctx);
	void *clock_ctx;
	struct local_bucket *table[LB_SLOTS];
	/*
	 * Under sync_lock: a sync's items (grown as needed, kept) and a script call's arguments,
	 * made once rather than allocated (about 40 KB, and the items' 200 bytes each) every
	 * RATELIMIT_SYNC_MS.
	 */
	struct sync_item *items;
	size_t items_cap;
	struct sync_args *args;
	pthread_t thread;
	bool has_thread, stop;	/* stop: atomic */
};

/*
 * The local view's clock: CLOCK_MONOTONIC ms (or a test's). Never the wall clock, which NTP or an
 * operator may step. The view's times are only compared with each other; Redis's buckets run on
 * Redis's time (see ratelimit.h).
 */
static long long gateway_ms(struct ratelimit *rl)
{
	return rl->ms_of ? rl->ms_of(CLOCK_MONOTONIC, rl->clock_ctx) : clock_mono_ms();
}

/* The scripts' time argument: "" for Redis's TIME, or a test's clock. */
static void script_now(struct ratelimit *rl, char *buf, size_t n)
{
	if (rl->redis_ms)
		snprintf(buf, n, "%lld", rl->redis_ms(rl->clock_ctx));
	else
		buf[0] = '\0';
}

void ratelimit_set_clock_for_test(struct ratelimit *rl,
				  long long (*ms_of)(clockid_t clock, void *ctx),
				  long long (*redis_ms)(void *ctx), void *ctx)
{
	rl->ms_of = ms_of;
	rl->redis_ms = redis_ms;
	rl->clock_ctx = ctx;
}

static void *sync_main(void *arg)
{
	struct ratelimit *rl = arg;
	struct timespec tick = { 0, RATELIMIT_SYNC_MS * 1000000L };

	while (!__atomic_load_n(&rl->stop, __ATOMIC_ACQUIRE)) {
		struct kiln_error err = { 0 };

		nanosleep(&tick, NULL);
		ratelimit_sync(rl, &err);
	}
	return NULL;
}

struct ratelimit *ratelimit_new(struct rds *rds, bool sync_thread)
{
	struct ratelimit *rl = calloc(1, sizeof(*rl));

	if (!rl)
		return NULL;
	rl->rds = rds;
	rl->redis_ok = true;
	rl->args = malloc(sizeof(*rl->args));
	if (!rl->args) {
		free(rl);
		return NULL;
	}
	pthread_mutex_init(&rl->lock, NULL);
	pthread_mutex_init(&rl->sync_lock, NULL);
	if (sync_thread) {
		if (pthread_create(&rl->thread, NULL, sync_main, rl) != 0) {
			ratelimit_free(rl);
			return NULL;
		}
		rl->has_thread = true;
	}
	return rl;
}

void ratelimit_free(struct ratelimit *rl)
{
	if (!rl)
		return;
	if (rl->has_thread) {
		struct kiln_error err = { 0 };

		__atomic_store_n(&rl->stop, true, __ATOMIC_RELEASE);
		pthread_join(rl->thread, NULL);
		ratelimit_sync(rl, &err);	/* what was taken since reaches Redis */
	}
	for (int i = 0; i < LB_SLOTS; i++) {
		struct local_bucket *b = rl->table[i], *next;

		for (; b; b = next) {
			next = b->next;
			free(b);
		}
	}
	pthread_mutex_destroy(&rl->sync_lock);
	pthread_mutex_destroy(&rl->lock);
	free(rl->items);
	free(rl->args);
	free(rl);
}

static unsigned long hash_str(const char *s)
{
	unsigned long h = 5381;

	while (*s)
		h = h * 33 + (unsigned char)*s++;
	return h;
}

/*
 * The bucket named `name`, made (full at gateway_ms() `now`, with these settings, not yet known)
 * when missing; NULL when out of memory. The caller holds rl->lock.
 */
static struct local_bucket *lb_get(struct ratelimit *rl, const char *name, long long rate,
				   long long period, long long burst, long long now)
{
	struct local_bucket **head = &rl->table[hash_str(name) % LB_SLOTS], *b;

	for (b = *head; b; b = b->next)
		if (strcmp(b->name, name) == 0)
			return b;
	b = calloc(1, sizeof(*b));
	if (!b)
		return NULL;
	snprintf(b->name, sizeof(b->name), "%s", name);
	b->rate = rate;
	b->period = period;
	b->burst = burst;
	b->tokens = burst * 1000;
	b->ts = now;
	b->used_ms = now;
	b->next = *head;
	*head = b;
	return b;
}

/*
 * Refills `b` to gateway_ms() `now` and takes a token when it has one; with `send`, the token goes
 * to Redis at the next sync. The caller holds rl->lock.
 */
static void lb_take(struct local_bucket *b, long long rate, long long period, long long burst,
		    long long now, bool send, struct rl_result *out)
{
	long long cap = burst * 1000;

	b->rate = rate;
	b->period = period;
	b->burst = burst;
	b->used_ms = now;
	if (now > b->ts) {
		long long add = (now - b->ts) * rate * 1000 / period;

		b->tokens = b->tokens + add > cap ? cap : b->tokens + add;
		b->ts = now;
	}
	if (b->tokens > cap)	/* a smaller burst than before */
		b->tokens = cap;
	if (b->tokens >= 1000) {
		b->tokens -= 1000;
		b->unsent += send;
		out->allowed = true;
	} else {
		out->allowed = false;
		b->refused = true;
		out->retry_after_ms = ((1000 - b->tokens) * period + rate * 1000 - 1) / (rate * 1000);
	}
}

/*
 * Runs the script `lua` (its hash cached in `sha`) as "EVALSHA <sha> argv[2..argc)": argv[0] and
 * argv[1] are the caller's two free slots for them. Loads the script once, and again after Redis
 * lost its script cache (a restart).
 */
static enum kiln_err run_script(struct ratelimit *rl, char sha[48], const char *lua, int argc,
				const char **argv, struct rds_reply *rep, struct kiln_error *err)
{
	char cur[48];
	enum kiln_err rc;

	pthread_mutex_lock(&rl->lock);
	snprintf(cur, sizeof(cur), "%s", sha);
	pthread_mutex_unlock(&rl->lock);
	if (!cur[0]) {
		rc = RDS(rl->rds, rep, err, "SCRIPT", "LOAD", lua);
		if (rc == KILN_OK && rep->type == RDS_STR)
			snprintf(cur, sizeof(cur), "%s", rep->str);
		rds_reply_release(rep);
		if (rc != KILN_OK)
			return rc;
		pthread_mutex_lock(&rl->lock);
		snprintf(sha, 48, "%s", cur);
		pthread_mutex_unlock(&rl->lock);
	}
	argv[0] = "EVALSHA";
	argv[1] = cur;
	rc = rds_command(rl->rds, argc, argv, NULL, rep, err);
	if (rc == KILN_E_INTERNAL && strstr(err->msg, "NOSCRIPT")) {
		kiln_error_clear(err);
		argv[0] = "EVAL";
		argv[1] = lua;
		rc = rds_command(rl->rds, argc, argv, NULL, rep, err);
	}
	return rc;
}

/*
 * Takes from the in-process bucket alone: Redis could not decide. The take is not sent afterwards
 * (see ratelimit.h); the bucket is known, so syncs bring Redis's tokens back into it once Redis
 * answers again, and it is dropped when idle.
 */
static void fallback_take(struct ratelimit *rl, const char *bucket, long long rate,
			  long long period, long long burst, struct rl_result *out)
{
	struct local_bucket *b;
	long long now;

	out->redis_down = true;
	pthread_mutex_lock(&rl->lock);
	now = gateway_ms(rl);
	b = lb_get(rl, bucket, rate, period, burst, now);
	if (b) {
		b->known = true;
		lb_take(b, rate, period, burst, now, false, out);
	} else {
		out->allowed = false;	/* out of memory: refuse rather than admit unlimited */
		out->retry_after_ms = 1000;
	}
	pthread_mutex_unlock(&rl->lock);
}

void ratelimit_take(struct ratelimit *rl, const char *bucket, long long rate, long long period_ms,
		    long long burst, struct rl_result *out)
{
	char key[192], a1[24], a2[24], a3[24], a4[24];
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	snprintf(key, sizeof(key), "kiln:rls:%s", bucket);
	snprintf(a1, sizeof(a1), "%lld", rate);
	snprintf(a2, sizeof(a2), "%lld", period_ms);
	snprintf(a3, sizeof(a3), "%lld", burst);
	script_now(rl, a4, sizeof(a4));
	rc = run_script(rl, rl->take_sha, take_lua, 8,
			(const char *[]){ NULL, NULL, "1", key, a1, a2, a3, a4 }, &rep, &err);
	if (rc == KILN_OK && rep.type == RDS_ARRAY && rep.n == 2 && rep.elem[0].type == RDS_INT) {
		out->allowed = rep.elem[0].integer == 1;
		out->retry_after_ms = rep.elem[1].integer;
		rds_reply_release(&rep);
		return;
	}
	if (rc == KILN_OK)
		log_warn("unexpected rate limit reply from redis");
	rds_reply_release(&rep);
	fallback_take(rl, bucket, rate, period_ms, burst, out);
}

/*
 * Sends items[0..n) (at most SYNC_BATCH) with their takes and sets each bucket to what Redis
 * holds less what was taken here meanwhile, as of the gateway_ms() the call was sent at (Redis's
 * refill after that is the view's to make). The caller holds sync_lock.
 */
static enum kiln_err sync_batch(struct ratelimit *rl, struct sync_item *items, int n,
				struct kiln_error *err)
{
	struct sync_args *a = rl->args;
	struct rds_reply rep = { 0 };
	int argc = 2;
	enum kiln_err rc;
	long long sent = gateway_ms(rl);

	snprintf(a->nums[0], sizeof(a->nums[0]), "%d", n);
	a->argv[argc++] = a->nums[0];
	for (int i = 0; i < n; i++) {
		snprintf(a->keys[i], sizeof(a->keys[i]), "kiln:rls:%s", items[i].name);
		a->argv[argc++] = a->keys[i];
	}
	script_now(rl, a->nums[1], sizeof(a->nums[1]));
	a->argv[argc++] = a->nums[1];
	for (int i = 0; i < n; i++) {
		long long v[4] = { items[i].rate, items[i].period, items[i].burst, items[i].taken };

		for (int j = 0; j < 4; j++) {
			char *num = a->nums[2 + i * 4 + j];

			snprintf(num, sizeof(a->nums[0]), "%lld", v[j]);
			a->argv[argc++] = num;
		}
	}
	rc = run_script(rl, rl->sync_sha, sync_lua, argc, a->argv, &rep, err);
	if (rc == KILN_OK && (rep.type != RDS_ARRAY || rep.n != (size_t)n))
		rc = kiln_error_set(err, KILN_E_INTERNAL, "unexpected rate limit reply from redis");
	if (rc == KILN_OK) {
		pthread_mutex_lock(&rl->lock);
		for (int i = 0; i < n; i++) {
			struct local_bucket *b = items[i].b;

			if (rep.elem[i].type != RDS_INT)
				continue;
			b->tokens = rep.elem[i].integer - b->unsent * 1000;
			b->ts = sent;
			b->known = true;
		}
		pthread_mutex_unlock(&rl->lock);
	}
	rds_reply_release(&rep);
	__atomic_store_n(&rl->redis_ok, rc == KILN_OK, __ATOMIC_RELAXED);
	return rc;
}

/* Moves what `b` took into `it` for a sync. The caller holds rl->lock. */
static void item_take(struct sync_item *it, struct local_bucket *b)
{
	it->b = b;
	snprintf(it->name, sizeof(it->name), "%s", b->name);
	it->rate = b->rate;
	it->period = b->period;
	it->burst = b->burst;
	it->taken = b->unsent;
	b->unsent = 0;
	b->refused = false;
}

/* Whether `b` can be sent: the scripts divide by its rate. */
static bool lb_sendable(const struct local_bucket *b)
{
	return b->rate > 0 && b->period > 0 && b->burst >= 0;
}

/*
 * Whether a sync sends `b`: when it took a token or refused one since the last sync, so that idle
 * buckets cost Redis nothing. An idle bucket's view is its last reading refilled at the rate, and
 * its next take is followed within a period by a reading of what all gateways took, as before. A
 * refusal is read too: a bucket in debt learns the other gateways' takes while its callers wait,
 * rather than admitting from its own refill (what it admits is then what it was before idle
 * buckets were left out). After a round that did not reach Redis (`down`), also a bucket used
 * within ACTIVE_MS with nothing to send: its reading tells the gateway that Redis answers again
 * and brings back Redis's tokens in place of the outage's local takes. The caller holds rl->lock.
 */
static bool lb_due(const struct local_bucket *b, bool down, long long mono)
{
	if (!b->known || !lb_sendable(b))
		return false;
	return b->unsent > 0 || b->refused || (down && mono - b->used_ms < ACTIVE_MS);
}

enum kiln_err ratelimit_sync(struct ratelimit *rl, struct kiln_error *err)
{
	struct sync_item *items;
	size_t n = 0;
	enum kiln_err rc = KILN_OK;
	long long mono;
	bool down = !__atomic_load_n(&rl->redis_ok, __ATOMIC_RELAXED);

	pthread_mutex_lock(&rl->sync_lock);
	pthread_mutex_lock(&rl->lock);
	mono = gateway_ms(rl);
	items = rl->items;
	for (int i = 0; i < LB_SLOTS; i++) {
		struct local_bucket **pp = &rl->table[i], *b;

		while ((b = *pp)) {
			if (b->known && !b->unsent && mono - b->used_ms >= IDLE_DROP_MS) {
				*pp = b->next;
				free(b);
				continue;
			}
			pp = &b->next;
			if (!lb_due(b, down, mono))
				continue;
			if (n == rl->items_cap) {
				size_t cap = rl->items_cap ? rl->items_cap * 2 : 64;
				struct sync_item *more = realloc(items, cap * sizeof(*items));

				if (!more)
					break;
				rl->items = items = more;
				rl->items_cap = cap;
			}
			item_take(&items[n++], b);
		}
	}
	pthread_mutex_unlock(&rl->lock);
	/* Takes of a batch Redis did not get are dropped: the gateway's own buckets limited them. */
	for (size_t at = 0; at < n && rc == KILN_OK; at += SYNC_BATCH)
		rc = sync_batch(rl, items + at, (int)(n - at < SYNC_BATCH ? n - at : SYNC_BATCH), err);
	pthread_mutex_unlock(&rl->sync_lock);
	return rc;
}

/*
 * Reads a bucket not known yet from Redis (or, with Redis down or no rate to send, takes it as
 * full). A bucket missing again is made with these settings.
 */
static void lb_learn(struct ratelimit *rl, const char *bucket, long long rate, long long period,
		     long long burst)
{
	struct kiln_error err = { 0 };
	struct sync_item it;
	struct local_bucket *b;

	pthread_mutex_lock(&rl->sync_lock);
	pthread_mutex_lock(&rl->lock);
	b = lb_get(rl, bucket, rate, period, burst, gateway_ms(rl));
	if (!b || b->known || !lb_sendable(b)) {
		if (b)
			b->known = true;
		pthread_mutex_unlock(&rl->lock);
		pthread_mutex_unlock(&rl->sync_lock);
		return;
	}
	item_take(&it, b);
	pthread_mutex_unlock(&rl->lock);
	if (sync_batch(rl, &it, 1, &err) != KILN_OK) {
		pthread_mutex_lock(&rl->lock);
		b->known = true;	/* the full bucket it was made with */
		pthread_mutex_unlock(&rl->lock);
	}
	pthread_mutex_unlock(&rl->sync_lock);
}

void ratelimit_take_local(struct ratelimit *rl, const char *bucket, long long rate,
			  long long period_ms, long long burst, struct rl_result *out)
{
	struct local_bucket *b;
	bool down;

	memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&rl->lock);
	b = lb_get(rl, bucket, rate, period_ms, burst, gateway_ms(rl));
	if (b && !b->known) {
		pthread_mutex_unlock(&rl->lock);
		lb_learn(rl, bucket, rate, period_ms, burst);
		pthread_mutex_lock(&rl->lock);
		/* without the lock a sync may have dropped `b`: look it up again */
		b = lb_get(rl, bucket, rate, period_ms, burst, gateway_ms(rl));
	}
	/* a take the local bucket decided alone, Redis down, is not sent afterwards (ratelimit.h) */
	down = !__atomic_load_n(&rl->redis_ok, __ATOMIC_RELAXED);
	if (b) {
		lb_take(b, rate, period_ms, burst, gateway_ms(rl), !down, out);
	} else {
		out->allowed = false;
		out->retry_after_ms = 1000;
	}
	pthread_mutex_unlock(&rl->lock);
	out->redis_down = down;
}
