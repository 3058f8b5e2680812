/*
 * authn.c - authentication, scopes, rate limits, Idempotency-Key and the audit trail for every
 * request to kiln-gateway (see authn.h).
 *
 * API keys are checked against Postgres and kept in a small in-memory cache for at most
 * `key_cache_s` seconds (≤ 5), so a key revoked on another gateway stops working within that
 * bound; the gateway that revokes drops its entry at once. JWTs are verified locally. The ages of
 * both caches' entries, and the once-a-minute write of last_used_at, are measured on the
 * monotonic clock, so a step of the wall clock (NTP, an operator) neither stretches that bound by
 * its size nor shortens it; a key's expires_at is a date, compared with the wall clock.
 *
 * Whether the caller's tenant is suspended is read from Postgres and cached the same way (at most
 * `key_cache_s` seconds, dropped at once by the gateway that suspends or unsuspends), for API keys
 * and JWTs alike: a suspended tenant's credentials get 403 `suspended` on every route.
 *
 * Both caches are set-associative with a lock per set (api/credcache.h), so thousands of keys and
 * tenants in use stay cached together and requests of different sets never wait for each other.
 * When an entry is missing or expired, one request reads it and the others of the same set wait
 * for that read (the set's fetch lock) instead of each querying Postgres; past half its life one
 * request reads it again while the others go on using it. Under load hundreds of requests share a
 * key, and without this every expiry sent them all to the pool at once.
 *
 * Rate limits: every request takes a token from its key's bucket (rate_limit_rps/burst) and then
 * from its tenant's (tenant_rate_limit_rps/burst), which all the tenant's keys and tokens share, so
 * minting keys buys no extra rate; a sandbox creation also from the key's and the tenant's creation
 * buckets (create_limit_rpm, tenant_create_limit_rpm).
 *
 * In-flight bound: a tenant may have at most `tenant_max_in_flight` requests in progress at once on
 * one gateway (counted in a hash table under INFLIGHT_LOCKS striped locks, from authentication to
 * the reply, checked before the rate limits, so past
 * it a request costs no Redis round trip). Rate limits bound how many requests start, not how many
 * wait: tenants that each stay within their rates can together queue every thread on the Postgres
 * pool and on Redis, and everyone else's requests wait behind theirs. Past the bound the next
 * request is answered 429 at once, so one tenant holds at most that many places in any queue.
 *
 * Idempotency records live `idempotency_ttl_s` seconds: a key reused after that is a new request.
 * gw_idempotency_sweep() deletes the expired ones in bounded batches.
 */
#include "authn.h"

#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/commitq.h"
#include "api/credcache.h"
#include "api/gateway.h"
#include "auth/bearer.h"
#include "auth/jwt.h"
#include "auth/scopes.h"
#include "common/clock.h"
#include "common/fault.h"
#include "common/log.h"

unsigned char gw_pepper[32];
struct auth_apikey_pepper *gw_pepper_prepared;

#define LAST_USED_EVERY_S 60	/* last_used_at is written at most this often per key (monotonic) */
#define IDEM_KEY_MAX 255
#define IDEM_WAIT_MS 2000	/* how long a retry waits for the first request's response */
#define IDEM_POLL_MS 10
#define IDEM_CLAIMS_MAX 3	/* claims of a key whose record keeps vanishing (failed requests) */

/*
 * A relation to name in a statement's FROM so that its transaction commits without waiting for
 * its WAL to reach the disk (synchronous_commit off for that transaction alone). What it wrote is
 * visible to every reader at once; a crash of Postgres can lose it only while no later synchronous
 * commit has followed (the WAL is flushed in order). Used for the audit trail, last_used_at and
 * the idempotency claim, never for what moves credits (docs/auth.md, "Commits").
 */
#define ASYNC_COMMIT "(SELECT set_config('synchronous_commit', 'off', true)) async_commit"

/*
 * PGQ for a statement naming ASYNC_COMMIT. set_config(..., true) lasts until its transaction ends:
 * inside a transaction a caller opened, it would make that caller's COMMIT, and whatever else the
 * transaction wrote, asynchronous too. Such a statement is refused there (KILN_E_INTERNAL).
 */
#define PGQ_ASYNC(c, out, err, sql, ...)                                                           \
	(pg_in_transaction(c) ? async_refused(err) : PGQ((c), (out), (err), (sql), __VA_ARGS__))

static enum kiln_err async_refused(struct kiln_error *err)
{
	log_error("an asynchronous commit refused inside a transaction");
	return kiln_error_set(err, KILN_E_INTERNAL, "an asynchronous commit inside a transaction");
}

/* A key's row, cached under its id in key_cache. */
struct key_entry {
	char key_id[AUTH_ID_MAX];
	char hash[AUTH_APIKEY_HASH_LEN + 1];
	char tenant_id[AUTH_ID_MAX];
	uint32_t scopes;
	bool usable;		/* not revoked at fetch time (expiry: expires_ms) */
	long long expires_ms;	/* its expires_at, ms since the epoch (wall clock); 0: never */
	long long fetched_ms;	/* when its read began (mono_ms) */
	long long touched_ms;	/* when last_used_at was last written (mono_ms), if `touched` */
	bool touched;		/* last_used_at written by this gateway since the entry was made */
};

static struct credcache *key_cache;

#define SWEEP_BATCH 1000	/* idempotency records deleted per statement */
#define SWEEP_BATCHES_MAX 100	/* statements per sweep; the next sweep goes on */

/* Whether a tenant is suspended, cached under its id in tenant_cache. */
struct tenant_entry {
	bool suspended;
	long long fetched_ms;	/* when its read began (mono_ms) */
};

static struct credcache *tenant_cache;
/*
 * Tenants forgotten so far (gw_tenant_cache_forget; atomic): a read begun before one is not
 * cached. Bumped under the forgotten tenant's set lock, and compared under the set lock of the
 * tenant a read would cache.
 */
static unsigned long tenant_forgets;

struct req_state {
	struct principal who;
	bool has_principal;
	bool in_flight;		/* counted in its tenant's in-flight requests */
	char idem_key[IDEM_KEY_MAX + 1];	/* set while this request owns an idempotency row */
	char idem_sum[65];	/* its body's SHA-256, hex */
	struct gw_key_row key_row;	/* read by the claim (ROUTE_API_KEY_ONLY) */
};

#define INFLIGHT_BUCKETS 1024
#define INFLIGHT_LOCKS 64	/* bucket i is guarded by inflight_locks[i % INFLIGHT_LOCKS] */

/* A tenant's requests in progress on this gateway; freed when none is. */
struct inflight {
	char tenant_id[AUTH_CLAIM_MAX];
	unsigned n;
	struct inflight *next;
};

static struct inflight *inflight_table[INFLIGHT_BUCKETS];
/* Each on a cache line of its own, so that tenants of different locks never share one. */
static union inflight_lock {
	pthread_mutex_t mu;
	char pad[64];
} inflight_locks[INFLIGHT_LOCKS] __attribute__((aligned(64)));

/* What the clocks read: clock_ms_of(), or a test's (gw_authn_set_clock_for_test). */
static long long (*clock_hook)(clockid_t clock, void *ctx);
static void *clock_hook_ctx;

static long long clock_read(clockid_t clock)
{
	return clock_hook ? clock_hook(clock, clock_hook_ctx) : clock_ms_of(clock);
}

/* ms since the epoch, for dates: an API key's expires_at (rate limits run on Redis's time) */
static long long now_ms(void)
{
	return clock_read(CLOCK_REALTIME);
}

/*
 * ms on the monotonic clock, for the caches' ages and last_used_at's cadence: on the wall
 * clock, a backward step of N seconds kept a key revoked (or a tenant suspended) on another
 * gateway working here for N + key_cache_s seconds.
 */
static long long mono_ms(void)
{
	return clock_read(CLOCK_MONOTONIC);
}

void gw_authn_set_clock_for_test(long long (*ms_of)(clockid_t clock, void *ctx), void *ctx)
{
	clock_hook_ctx = ctx;
	clock_hook = ms_of;
}

static unsigned hash_of(const char *s)
{
	unsigned h = 2166136261u;

	while (*s)
		h = (h ^ (unsigned char)*s++) * 16777619u;
	return h;
}

enum kiln_err gw_authn_init(struct kiln_error *err)
{
	for (int i = 0; i < INFLIGHT_LOCKS; i++)
		pthread_mutex_init(&inflight_locks[i].mu, NULL);
	key_cache = credcache_new(GW_KEY_CACHE_ENTRIES, sizeof(struct key_entry));
	tenant_cache = credcache_new(GW_TENANT_CACHE_ENTRIES, sizeof(struct tenant_entry));
	if (!key_cache || !tenant_cache) {
		gw_authn_exit();
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory for the credential caches");
	}
	return KILN_OK;
}

void gw_authn_exit(void)
{
	credcache_free(key_cache);
	credcache_free(tenant_cache);
	key_cache = tenant_cache = NULL;
}

void gw_authn_cache_stats(struct credcache_stats *keys, struct credcache_stats *tenants)
{
	credcache_stats(key_cache, keys);
	credcache_stats(tenant_cache, tenants);
}

void gw_tenant_cache_forget(const char *tenant_id)
{
	struct credcache_set *s = credcache_lock(tenant_cache, tenant_id);

	__atomic_add_fetch(&tenant_forgets, 1, __ATOMIC_SEQ_CST);
	credcache_drop(s, tenant_id);
	credcache_unlock(s);
}

/* The count of forgets, noted before a read whose answer tenant_cache_put may cache. */
static unsigned long tenant_cache_forgets(void)
{
	return __atomic_load_n(&tenant_forgets, __ATOMIC_SEQ_CST);
}

/*
 * Caches whether tenant `tenant_id` is suspended, as read from Postgres at `fetched_ms` by a read
 * begun when tenant_cache_forgets() was `forgets`. Not when a tenant was forgotten since: the
 * read may have seen the row from before a suspension that forget was for, and caching it would
 * let the tenant's keys in for up to key_cache_s.
 */
static void tenant_cache_put(const char *tenant_id, bool suspended, long long fetched_ms,
			     unsigned long forgets)
{
	struct credcache_set *s = credcache_lock(tenant_cache, tenant_id);
	struct tenant_entry *e;

	if (tenant_cache_forgets() == forgets && (e = credcache_slot(s, tenant_id))) {
		e->suspended = suspended;
		e->fetched_ms = fetched_ms;
	}
	credcache_unlock(s);
}

/*
 * Whether the tenant cache holds `tenant_id` fetched less than `ttl` ms before `now` (mono_ms):
 * then sets *suspended, and *age to the entry's age.
 */
static bool tenant_cache_get(const char *tenant_id, long long now, long long ttl, bool *suspended,
			     long long *age)
{
	struct credcache_set *s = credcache_lock(tenant_cache, tenant_id);
	const struct tenant_entry *e = credcache_find(s, tenant_id);
	bool hit = e && (*age = now - e->fetched_ms) < ttl;

	if (hit)
		*suspended = e->suspended;
	credcache_unlock(s);
	return hit;
}

/*
 * Whether tenant `tenant_id` is suspended, from the cache when fetched less than key_cache_s ago.
 * A tenant with no row (deleted under a live token) counts as suspended. KILN_E_UNAVAILABLE when
 * Postgres cannot answer.
 */
static enum kiln_err tenant_suspended(struct gateway *gw, const char *tenant_id, bool *suspended,
				      struct kiln_error *err)
{
	pthread_mutex_t *fetching = credcache_fetch_lock(tenant_cache, tenant_id);
	long long ttl = gw->cfg.key_cache_s * 1000, now = mono_ms(), age = 0;
	unsigned long forgets;
	bool hit;
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc;

	hit = tenant_cache_get(tenant_id, now, ttl, suspended, &age);
	/* Past half its life one request reads the entry again while the others still use it. */
	if (hit && (age < ttl / 2 || pthread_mutex_trylock(fetching) != 0))
		return KILN_OK;
	if (!hit) {	/* one reader per set; the others wait and find its answer */
		long long ignored;

		pthread_mutex_lock(fetching);
		hit = tenant_cache_get(tenant_id, mono_ms(), ttl, suspended, &ignored);
		if (hit) {
			pthread_mutex_unlock(fetching);
			return KILN_OK;
		}
	}
	now = mono_ms();
	forgets = tenant_cache_forgets();
	rc = pg_acquire(gw->pg, &c, err);
	if (rc == KILN_OK) {
		rc = PGQ(c, &res, err, "SELECT suspended_at IS NOT NULL FROM tenants WHERE id = $1",
			 tenant_id);
		pg_release(gw->pg, c);
	}
	if (rc == KILN_OK) {
		*suspended = pg_res_rows(res) != 1 || pg_res_bool(res, 0, 0);
		tenant_cache_put(tenant_id, *suspended, now, forgets);
	} else if (hit) {	/* an early read that failed: the entry is still valid */
		kiln_error_clear(err);
		rc = KILN_OK;
	}
	pthread_mutex_unlock(fetching);
	pg_res_free(res);
	return rc;
}

void gw_key_cache_forget(const char *key_id)
{
	struct credcache_set *s = credcache_lock(key_cache, key_id);

	credcache_drop(s, key_id);
	credcache_unlock(s);
}

/*
 * Whether the key cache holds `key_id` fetched less than `ttl` ms before `now` (mono_ms): then
 * copies it into *e, and its age into *age. *drops is its set's count of drops (revocations) so
 * far: what is read after this may go into the cache only while it is the same.
 */
static bool key_cache_get(const char *key_id, long long now, long long ttl, struct key_entry *e,
			  long long *age, unsigned long *drops)
{
	struct credcache_set *s = credcache_lock(key_cache, key_id);
	const struct key_entry *p = credcache_find(s, key_id);
	bool hit = p && (*age = now - p->fetched_ms) < ttl;

	if (hit)
		*e = *p;
	*drops = credcache_drops(s);
	credcache_unlock(s);
	return hit;
}

const struct principal *gw_principal(const struct http_req *req)
{
	const struct req_state *st = http_req_ctx(req);

	return st && st->has_principal ? &st->who : NULL;
}

const struct gw_key_row *gw_key_row(const struct http_req *req)
{
	const struct req_state *st = http_req_ctx(req);

	return st && st->key_row.read ? &st->key_row : NULL;
}

/*
 * Reads the key row into `e`, and in the same statement whether its tenant is suspended, into
 * the tenant cache: the request goes on to ask that, and its entry expires about when the key's
 * does, so one round trip serves both. KILN_E_NOT_FOUND when there is no such key.
 */
static enum kiln_err key_fetch(struct gateway *gw, const char *key_id, struct key_entry *e,
			       struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	long long now = mono_ms();
	unsigned long forgets = tenant_cache_forgets();
	enum kiln_err rc = pg_acquire(gw->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT k.secret_hash, k.tenant_id, k.scopes, k.revoked_at IS NULL, "
		 "coalesce(floor(extract(epoch FROM k.expires_at) * 1000)::bigint, 0), "
		 "t.suspended_at IS NOT NULL OR t.id IS NULL "
		 "FROM api_keys k LEFT JOIN tenants t ON t.id = k.tenant_id WHERE k.id = $1",
		 key_id);
	if (rc == KILN_OK && pg_res_rows(res) == 0)
		rc = KILN_E_NOT_FOUND;
	if (rc == KILN_OK) {
		struct kiln_error ignore = { 0 };
		const char *scopes = pg_res_str(res, 0, 2);

		memset(e, 0, sizeof(*e));
		snprintf(e->key_id, sizeof(e->key_id), "%s", key_id);
		snprintf(e->hash, sizeof(e->hash), "%s", pg_res_str(res, 0, 0));
		snprintf(e->tenant_id, sizeof(e->tenant_id), "%s", pg_res_str(res, 0, 1));
		if (auth_scopes_parse(scopes, strlen(scopes), &e->scopes, &ignore) != KILN_OK)
			e->scopes = 0;
		e->usable = pg_res_bool(res, 0, 3);
		e->expires_ms = pg_res_int(res, 0, 4, 0);
		e->fetched_ms = now;
		kiln_fault("gw-key-read");	/* a test suspends the tenant here */
		tenant_cache_put(e->tenant_id, pg_res_bool(res, 0, 5), now, forgets);
	}
	pg_res_free(res);
	pg_release(gw->pg, c);
	return rc;
}

/* Writes last_used_at now and then; a failure only costs the timestamp. */
static void key_touch(struct gateway *gw, const char *key_id)
{
	struct pg_conn *c;
	struct kiln_error err = { 0 };

	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return;
	PGQ_ASYNC(c, NULL, &err,
		  "UPDATE api_keys SET last_used_at = now() FROM " ASYNC_COMMIT " WHERE id = $1", key_id);
	pg_release(gw->pg, c);
}

static enum kiln_err auth_api_key(struct gateway *gw, const char *value, size_t len,
				  struct principal *who, struct kiln_error *err)
{
	struct auth_apikey key;
	struct key_entry e, f, *p;
	struct credcache_set *s;
	pthread_mutex_t *fetching;
	long long ttl = gw->cfg.key_cache_s * 1000, now = mono_ms(), age = 0;
	bool cached = false, touch = false;
	unsigned long drops;
	enum kiln_err rc;

	if (auth_apikey_parse(value, len, &key, err) != KILN_OK)
		return KILN_E_UNAUTHENTICATED;
	fetching = credcache_fetch_lock(key_cache, key.key_id);
	cached = key_cache_get(key.key_id, now, ttl, &e, &age, &drops);
	/*
	 * A missing or expired entry: one request per set reads it and the others wait and find its
	 * answer. Past half its life one request reads it again while the others still use it.
	 */
	if (!cached || (age >= ttl / 2 && pthread_mutex_trylock(fetching) == 0)) {
		bool fresh = false;

		if (!cached) {
			long long ignored;

			pthread_mutex_lock(fetching);
			cached = fresh = key_cache_get(key.key_id, mono_ms(), ttl, &e, &ignored,
						       &drops);
		}
		rc = fresh ? KILN_OK : key_fetch(gw, key.key_id, &f, err);
		if (!fresh && rc == KILN_OK) {
			/* not when the key was revoked here since: the row may be from before */
			s = credcache_lock(key_cache, f.key_id);
			if (credcache_drops(s) == drops && (p = credcache_slot(s, f.key_id))) {
				/* the cadence of the entry it refreshes (one just made: untouched) */
				f.touched_ms = p->touched_ms;
				f.touched = p->touched;
				*p = f;
			}
			credcache_unlock(s);
			e = f;
			cached = true;
		} else if (rc != KILN_OK && rc != KILN_E_NOT_FOUND && cached) {
			kiln_error_clear(err);	/* an early read that failed: still valid */
			rc = KILN_OK;
		}
		pthread_mutex_unlock(fetching);
		if (rc == KILN_E_NOT_FOUND)
			return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "unknown API key");
		if (rc != KILN_OK)
			return rc;
	}
	if (!(gw_pepper_prepared ? auth_apikey_verify_prepared(&key, gw_pepper_prepared, e.hash)
				 : auth_apikey_verify(&key, gw_pepper, sizeof(gw_pepper), e.hash)))
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "invalid API key");
	if (!e.usable)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "the API key was revoked");
	if (e.expires_ms && now_ms() >= e.expires_ms)	/* a date: the wall clock */
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "the API key has expired");

	/* Back into the cache if another key took its place meanwhile, unless it was revoked here. */
	s = credcache_lock(key_cache, e.key_id);
	if (!(p = credcache_peek(s, e.key_id)) && credcache_drops(s) == drops &&
	    (p = credcache_slot(s, e.key_id)))
		*p = e;
	if (p && (!p->touched || now - p->touched_ms >= LAST_USED_EVERY_S * 1000)) {
		p->touched_ms = now;
		p->touched = true;
		touch = true;
	}
	credcache_unlock(s);
	if (touch)
		key_touch(gw, e.key_id);

	snprintf(who->tenant_id, sizeof(who->tenant_id), "%s", e.tenant_id);
	snprintf(who->key_id, sizeof(who->key_id), "%s", e.key_id);
	who->scopes = e.scopes;
	who->via_jwt = false;
	return KILN_OK;
}

static enum kiln_err auth_jwt(struct gateway *gw, const char *value, size_t len,
			      struct principal *who, struct kiln_error *err)
{
	struct auth_verify_opts o = {
		.aud = AUTH_AUD_API,
		.iss = GW_ISSUER,
		.now = time(NULL),
		.leeway_s = 30,
		.max_ttl_s = GW_TOKEN_TTL_MAX,
	};
	struct auth_claims cl;
	enum auth_jwt_reason why = AUTH_JWT_OK;

	if (signing_verify(gw->signing, value, len, &o, &cl, &why, err) != KILN_OK) {
		kiln_error_clear(err);
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "invalid token: %s",
				      auth_jwt_reason_name(why));
	}
	snprintf(who->tenant_id, sizeof(who->tenant_id), "%s", cl.tid);
	snprintf(who->key_id, sizeof(who->key_id), "%s", cl.sub);
	who->scopes = cl.scopes;
	who->via_jwt = true;
	return KILN_OK;
}

static void body_sha256(struct http_req *req, char out[65])
{
	unsigned char md[32];
	unsigned int n = 0;
	size_t len;
	const char *body = http_req_body(req, &len);

	EVP_Digest(body, len, md, &n, EVP_sha256(), NULL);
	for (unsigned i = 0; i < 32; i++)
		snprintf(out + 2 * i, 3, "%02x", md[i]);
}

/*
 * A stored response can hold a secret (the `key` of a new API key, a token), so it is kept
 * sealed with the master key and bound to its tenant and Idempotency-Key.
 */
static void idempotency_ad(const struct req_state *st, const char *key, char *ad, size_t n)
{
	snprintf(ad, n, "idempotency:%s:%s", st->who.tenant_id, key);
}

static void idempotency_replay(struct gateway *gw, struct http_req *req,
			       const struct req_state *st, int status, const char *sealed)
{
	struct kiln_error err = { 0 };
	unsigned char *body = NULL;
	size_t len = 0;
	char ad[IDEM_KEY_MAX + AUTH_CLAIM_MAX + 32];

	idempotency_ad(st, http_req_header(req, "Idempotency-Key"), ad, sizeof(ad));
	if (*sealed && auth_open(&gw->mk, sealed, strlen(sealed), ad, strlen(ad), &body, &len,
				 &err) != KILN_OK) {
		log_warn("stored response of an Idempotency-Key does not open: %s", err.msg);
		http_reply_error(req, KILN_E_INTERNAL, "internal error");
		return;
	}
	http_reply_header(req, "Idempotent-Replayed", "true");
	http_reply_data(req, status, len ? "application/json" : NULL, body ? (char *)body : "", len);
	auth_secret_free(body, len);
}

/*
 * Answers a request whose Idempotency-Key is taken: 422 for another request, the stored
 * response for the same one, 409 while the first is still running. The first request stores
 * its response before its reply goes out (gw_audit), so a retry of a reply the client saw finds
 * it; a retry sent before the first reply arrived (a client that timed out) may find the record
 * still open: wait up to IDEM_WAIT_MS for it (without holding a connection the first request
 * needs) before answering 409. A 5xx or a 429, or an outcome whose group Postgres did not take
 * in time, frees or stores its key in the done hook, just after its reply went out, and is
 * waited for the same way. Returns false after
 * replying; true, without replying, when the record went away meanwhile (the first request
 * failed with a 5xx and freed the key, as it does when a failover cut it short): the caller
 * claims the key again and this request runs.
 */
static bool idempotency_existing(struct gateway *gw, struct http_req *req, struct req_state *st,
				 const char *key, const char *sum)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc;
	bool same = false, done = false;

	for (int waited = 0;; waited += IDEM_POLL_MS) {
		rc = pg_acquire(gw->pg, &c, &err);
		if (rc != KILN_OK)
			break;
		pg_res_free(res);
		res = NULL;
		rc = PGQ(c, &res, &err,
			 "SELECT method, path, body_sha256, status, response FROM idempotency "
			 "WHERE tenant_id = $1 AND key = $2",
			 st->who.tenant_id, key);
		pg_release(gw->pg, c);
		if (rc != KILN_OK || pg_res_rows(res) != 1)
			break;
		same = !strcmp(pg_res_str(res, 0, 0), http_req_method(req)) &&
		       !strcmp(pg_res_str(res, 0, 1), http_req_path(req)) &&
		       !strcmp(pg_res_str(res, 0, 2), sum);
		done = pg_res_get(res, 0, 3) != NULL;
		if (!same || done || waited >= IDEM_WAIT_MS)
			break;
		nanosleep(&(struct timespec){ 0, IDEM_POLL_MS * 1000000L }, NULL);
	}
	if (rc == KILN_OK && pg_res_rows(res) != 1) {
		pg_res_free(res);
		return true;
	}
	if (rc != KILN_OK)
		http_reply_error(req, rc, "the database is unavailable");
	else if (!same)
		http_reply_error(req, KILN_E_INVALID, "Idempotency-Key was used with a different request");
	else if (!done)
		http_reply_error(req, KILN_E_CONFLICT,
				 "a request with this Idempotency-Key is in progress");
	else
		idempotency_replay(gw, req, st, (int)pg_res_int(res, 0, 3, 200), pg_res_str(res, 0, 4));
	pg_res_free(res);
	return false;
}

/*
 * Claims the Idempotency-Key of a mutating POST. Returns true when the request should run (a
 * first use; st->idem_key is then set); false after replying (a replay, a mismatch, a request
 * with the same key still running, or a database error). With `key_row` (a route of
 * ROUTE_API_KEY_ONLY) the same statement reads the caller's key's row into st->key_row: the
 * route needs it fresh, and it rides on the claim's round trip instead of one of its own.
 */
static bool idempotency_claim(struct gateway *gw, struct http_req *req, struct req_state *st,
			      bool key_row)
{
	const char *key = http_req_header(req, "Idempotency-Key");
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char sum[65], ttl[24];
	enum kiln_err rc;
	bool run = false;
	int claims = 0;

	if (!key || strcmp(http_req_method(req), "POST") != 0)
		return true;
	if (!key[0] || strlen(key) > IDEM_KEY_MAX) {
		http_reply_error(req, KILN_E_BAD_REQUEST,
				 "Idempotency-Key must be 1 to %d characters", IDEM_KEY_MAX);
		return false;
	}
	body_sha256(req, sum);
again:
	rc = pg_acquire(gw->pg, &c, &err);
	if (rc != KILN_OK) {
		http_reply_error(req, rc, "the database is unavailable");
		return false;
	}
	/*
	 * One upsert: a new key, or one whose record is older than idempotency_ttl_s (it no longer
	 * counts: the key is new again), is claimed; a live record returns no row. The claim commits
	 * asynchronously: a route's own synchronous commit (every change of credits is one) flushes
	 * it before its work is durable, so a crash of Postgres cannot keep the work and lose the
	 * claim; the outcome (gw_audit, through the commit queue) commits synchronously.
	 */
	snprintf(ttl, sizeof(ttl), "%lld", gw->cfg.idempotency_ttl_s);
#define CLAIM_SQL								\
	"INSERT INTO idempotency (tenant_id, key, method, path, body_sha256) "		\
	"SELECT $1, $2, $3, $4, $5 FROM " ASYNC_COMMIT " "				\
	"ON CONFLICT (tenant_id, key) DO UPDATE SET method = excluded.method, "		\
	"path = excluded.path, body_sha256 = excluded.body_sha256, status = NULL, "	\
	"response = NULL, created_at = now() "						\
	"WHERE idempotency.created_at < now() - make_interval(secs => $6::bigint) "
	if (key_row)	/* the key's row as of this statement's snapshot, as the route would read it */
		rc = PGQ_ASYNC(c, &res, &err,
			       "WITH k AS (SELECT revoked_at IS NULL AS live, "
			       "floor(extract(epoch FROM expires_at))::bigint AS exp FROM api_keys "
			       "WHERE id = $7 AND tenant_id = $1) " CLAIM_SQL
			       "RETURNING 1, EXISTS (SELECT 1 FROM k), (SELECT live FROM k), "
			       "(SELECT exp FROM k)",
			       st->who.tenant_id, key, http_req_method(req), http_req_path(req), sum, ttl,
			       st->who.key_id);
	else
		rc = PGQ_ASYNC(c, &res, &err, CLAIM_SQL "RETURNING 1",
			       st->who.tenant_id, key, http_req_method(req), http_req_path(req), sum, ttl);
#undef CLAIM_SQL
	if (rc == KILN_OK && pg_res_rows(res) == 1) {
		if (key_row) {
			st->key_row.read = true;
			st->key_row.exists = pg_res_bool(res, 0, 1);
			st->key_row.live = st->key_row.exists && pg_res_bool(res, 0, 2);
			st->key_row.expires = pg_res_get(res, 0, 3) != NULL;
			st->key_row.expires_s = pg_res_int(res, 0, 3, 0);
		}
		snprintf(st->idem_key, sizeof(st->idem_key), "%s", key);
		memcpy(st->idem_sum, sum, sizeof(st->idem_sum));
		http_req_keep_reply(req);
		run = true;
	} else if (rc == KILN_OK) {
		pg_res_free(res);
		res = NULL;
		pg_release(gw->pg, c);
		if (!idempotency_existing(gw, req, st, key, sum))
			return false;
		if (++claims < IDEM_CLAIMS_MAX)
			goto again;
		http_reply_error(req, KILN_E_CONFLICT,
				 "a request with this Idempotency-Key keeps failing: retry it");
		return false;
	}
	if (rc != KILN_OK)
		http_reply_error(req, rc, "the database is unavailable");
	pg_res_free(res);
	pg_release(gw->pg, c);
	return run;
}

/*
 * The reply of a request that owns an Idempotency-Key, sealed for its record: *sealed is NULL
 * for an empty reply, else the caller frees it. Fails (logged) only when sealing does.
 */
static enum kiln_err idempotency_seal(struct gateway *gw, struct http_req *req,
				      const struct req_state *st, char **sealed)
{
	struct kiln_error err = { 0 };
	char ad[IDEM_KEY_MAX + AUTH_CLAIM_MAX + 32];
	size_t len = 0;
	const char *body = http_req_reply_body(req, &len);

	*sealed = NULL;
	if (!body || !len)
		return KILN_OK;
	idempotency_ad(st, st->idem_key, ad, sizeof(ad));
	if (auth_seal(&gw->mk, body, len, ad, strlen(ad), sealed, &err) != KILN_OK) {
		log_warn("cannot seal the response of an Idempotency-Key: %s", err.msg);
		return err.code ? err.code : KILN_E_INTERNAL;
	}
	return KILN_OK;
}

/*
 * Stores the reply of a request that owned an idempotency row (or frees the key on a 5xx), on a
 * connection of `pool`, by itself: the reply hook's way when the commit queue failed (the reply
 * waits for it), and the done hook's for a 5xx or a 429.
 *
 * Across a Postgres failover this must still happen, or the key stays "in progress" and a retry
 * gets 409 until idempotency_ttl_s: the claim may have reached the standby while this request's
 * own work failed (5xx: the row must go), or its work committed (the reply must be stored, or a
 * retry runs it twice). So a failure to reach Postgres is retried for up to idempotency_finish_s
 * seconds; past that the reply goes out with its record left open. The outcome is written with
 * an upsert: a claim the old primary took but never shipped to the standby is recreated with the
 * outcome, since the work itself ran on the new primary.
 */
static void idempotency_finish(struct gateway *gw, struct pg *pool, struct http_req *req,
			       struct req_state *st, int status)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char code[12], *sealed = NULL;
	long long deadline = clock_mono_ms() + gw->cfg.idempotency_finish_s * 1000;
	enum kiln_err rc;

	if (status < 500 && idempotency_seal(gw, req, st, &sealed) != KILN_OK)
		status = 500;	/* forget the key: the client's retry runs again */
	snprintf(code, sizeof(code), "%d", status);
	for (int attempt = 0;; attempt++) {
		kiln_error_clear(&err);
		rc = pg_acquire(pool, &c, &err);
		if (rc == KILN_OK) {
			if (status >= 500)
				rc = PGQ(c, NULL, &err,
					 "DELETE FROM idempotency WHERE tenant_id = $1 AND key = $2 "
					 "AND status IS NULL",
					 st->who.tenant_id, st->idem_key);
			else
				rc = PGQ(c, NULL, &err,
					 "INSERT INTO idempotency (tenant_id, key, method, path, "
					 "body_sha256, status, response) "
					 "VALUES ($1, $2, $5, $6, $7, $3::int, $4) "
					 "ON CONFLICT (tenant_id, key) DO UPDATE SET status = $3::int, "
					 "response = $4 WHERE idempotency.status IS NULL",
					 st->who.tenant_id, st->idem_key, code, sealed ? sealed : "",
					 http_req_method(req), http_req_path(req), st->idem_sum);
			pg_release(pool, c);
		}
		if (rc != KILN_E_UNAVAILABLE || clock_mono_ms() >= deadline)
			break;
		if (attempt == 0)
			log_warn("idempotency record of \"%s\": postgres is unavailable; retrying for up "
				 "to %lld s", http_req_path(req), gw->cfg.idempotency_finish_s);
		nanosleep(&(struct timespec){ 0, 200 * 1000000L }, NULL);
	}
	if (rc != KILN_OK)
		log_warn("idempotency record of \"%s\" left open: %s", http_req_path(req), err.msg);
	free(sealed);
}

/*
 * Takes a token from the bucket "<kind>:<id>" (`rate` per `period_ms`, at most `burst`). Returns
 * true when the request may go on; false after replying 429 naming `limit` (with Retry-After), or
 * 503 when `need_redis` and Redis could not decide (the local fallback is not shared between
 * gateways, so a creation is not admitted on it). Without `need_redis` the token comes from the
 * gateway's view of the bucket, reconciled with Redis every RATELIMIT_SYNC_MS (api/ratelimit.h);
 * with it, from Redis itself.
 */
static bool limit_take(struct http_req *req, struct gateway *gw, const char *kind, const char *id,
		       long long rate, long long period_ms, long long burst, const char *limit,
		       bool need_redis)
{
	struct rl_result rl;
	char bucket[160], retry[24];

	snprintf(bucket, sizeof(bucket), "%s:%s", kind, id);
	if (need_redis)
		ratelimit_take(gw->rl, bucket, rate, period_ms, burst, &rl);
	else
		ratelimit_take_local(gw->rl, bucket, rate, period_ms, burst, &rl);
	if (need_redis && rl.redis_down) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "redis is unavailable: nothing was changed");
		return false;
	}
	if (rl.allowed)
		return true;
	snprintf(retry, sizeof(retry), "%lld", (rl.retry_after_ms + 999) / 1000);
	http_reply_header(req, "Retry-After", retry);
	http_reply_error(req, KILN_E_RATE_LIMITED, "too many requests (limit %s); retry in %s s",
			 limit, retry);
	return false;
}

enum kiln_err gw_idempotency_sweep(struct gateway *gw, long long *deleted, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char ttl[24], batch[24];
	enum kiln_err rc;
	int n = SWEEP_BATCH;

	*deleted = 0;
	snprintf(ttl, sizeof(ttl), "%lld", gw->cfg.idempotency_ttl_s);
	snprintf(batch, sizeof(batch), "%d", SWEEP_BATCH);
	rc = pg_acquire(gw->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	for (int i = 0; i < SWEEP_BATCHES_MAX && n == SWEEP_BATCH && rc == KILN_OK; i++) {
		rc = PGQ(c, &res, err,
			 "WITH gone AS (DELETE FROM idempotency WHERE ctid = ANY(ARRAY("
			 "SELECT ctid FROM idempotency "
			 "WHERE created_at < now() - make_interval(secs => $1::bigint) "
			 "LIMIT $2::int)) RETURNING 1) SELECT count(*) FROM gone",
			 ttl, batch);
		n = rc == KILN_OK ? (int)pg_res_int(res, 0, 0, 0) : 0;
		*deleted += n;
		pg_res_free(res);
		res = NULL;
	}
	pg_release(gw->pg, c);
	return rc;
}

static void req_state_free(void *p)
{
	free(p);
}

/*
 * Counts one more request of `tenant_id` in progress unless it has `max` already (or memory ran
 * out): returns whether it was counted. Each true is undone by inflight_drop().
 */
static bool inflight_take(const char *tenant_id, unsigned max)
{
	unsigned n = hash_of(tenant_id) % INFLIGHT_BUCKETS;
	struct inflight **head = &inflight_table[n], *e;
	pthread_mutex_t *lock = &inflight_locks[n % INFLIGHT_LOCKS].mu;
	bool ok = false;

	pthread_mutex_lock(lock);
	for (e = *head; e && strcmp(e->tenant_id, tenant_id) != 0; e = e->next)
		;
	if (!e && (e = calloc(1, sizeof(*e)))) {
		snprintf(e->tenant_id, sizeof(e->tenant_id), "%s", tenant_id);
		e->next = *head;
		*head = e;
	}
	if (e && e->n < max) {
		e->n++;
		ok = true;
	}
	pthread_mutex_unlock(lock);
	return ok;
}

/* Undoes one inflight_take() of `tenant_id`. */
static void inflight_drop(const char *tenant_id)
{
	unsigned n = hash_of(tenant_id) % INFLIGHT_BUCKETS;
	struct inflight **pp = &inflight_table[n], *e;
	pthread_mutex_t *lock = &inflight_locks[n % INFLIGHT_LOCKS].mu;

	pthread_mutex_lock(lock);
	for (; (e = *pp) && strcmp(e->tenant_id, tenant_id) != 0; pp = &e->next)
		;
	if (e && --e->n == 0) {
		*pp = e->next;
		free(e);
	}
	pthread_mutex_unlock(lock);
}

/*
 * The length of the valid UTF-8 sequence at `s` (1 to 4), or 0 when its first byte starts none:
 * the rules Postgres applies to text (no overlong forms, no surrogates, nothing past U+10FFFF).
 */
static int utf8_len(const unsigned char *s)
{
	unsigned char lo = 0x80, hi = 0xbf;
	int n;

	if (s[0] < 0x80)
		return 1;
	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		n = 2;
	else if (s[0] >= 0xe0 && s[0] <= 0xef)
		n = 3;
	else if (s[0] >= 0xf0 && s[0] <= 0xf4)
		n = 4;
	else
		return 0;
	if (s[0] == 0xe0)
		lo = 0xa0;
	else if (s[0] == 0xed)
		hi = 0x9f;
	else if (s[0] == 0xf0)
		lo = 0x90;
	else if (s[0] == 0xf4)
		hi = 0x8f;
	if (s[1] < lo || s[1] > hi)
		return 0;
	for (int i = 2; i < n; i++)
		if (s[i] < 0x80 || s[i] > 0xbf)
			return 0;
	return n;
}

/* Whether `s` is valid UTF-8 throughout (utf8_len's rules). */
static bool utf8_valid(const char *s)
{
	const unsigned char *u = (const unsigned char *)s;

	for (size_t i = 0; u[i]; ) {
		int n = utf8_len(u + i);

		if (!n)
			return false;
		i += (size_t)n;
	}
	return true;
}

/*
 * Answers 404 when a path parameter of `route` ({id}, {wid}, ...) is not valid UTF-8 and returns
 * false; true when every one is. The engine decodes %XX, so a parameter can hold any byte, while
 * every id the API hands out is ASCII: such a parameter names nothing, and as a statement's text
 * Postgres would refuse it (a 500). Checked before the Idempotency-Key is claimed, so such a
 * request stores nothing but its audit row, with the parameter as its object (escaped).
 */
static bool params_utf8(struct http_req *req, const struct http_route *route)
{
	char name[HTTP_PARAM_MAX];

	for (const char *p = strchr(route->pattern, '{'); p; p = strchr(p, '{')) {
		size_t n = strcspn(++p, "}");
		const char *v;

		if (n >= sizeof(name))
			continue;
		memcpy(name, p, n);
		name[n] = '\0';
		v = http_req_param(req, name);
		if (v && !utf8_valid(v)) {
			http_req_set_object(req, v);	/* audited as it came, escaped */
			http_reply_error(req, KILN_E_NOT_FOUND,
					 "not found: the path parameter \"%s\" is not UTF-8", name);
			return false;
		}
	}
	return true;
}

enum kiln_err gw_authenticate(struct gateway *gw, const char *header, struct principal *who,
			      struct kiln_error *err)
{
	struct auth_credential cred;
	bool suspended = false;
	enum kiln_err rc = auth_bearer_parse(header, strlen(header), &cred, err);

	if (rc == KILN_OK)
		rc = cred.kind == AUTH_CRED_API_KEY ? auth_api_key(gw, cred.value, cred.len, who, err)
						    : auth_jwt(gw, cred.value, cred.len, who, err);
	if (rc != KILN_OK) {
		if (rc == KILN_E_UNAVAILABLE)
			return rc;
		if (rc != KILN_E_UNAUTHENTICATED) {
			kiln_error_clear(err);
			kiln_error_set(err, KILN_E_UNAUTHENTICATED, "invalid credential");
		}
		return KILN_E_UNAUTHENTICATED;
	}
	kiln_error_clear(err);
	if (tenant_suspended(gw, who->tenant_id, &suspended, err) != KILN_OK)
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "the database is unavailable");
	if (suspended)
		return kiln_error_set(err, KILN_E_SUSPENDED, "the tenant is suspended by the operator");
	return KILN_OK;
}

#ifdef KILN_BENCH_NO_AUTH
static const char *bench_tenant;

bool gw_bench_no_auth_allowed(struct kiln_error *err)
{
	const char *yes = getenv("KILN_BENCH_NO_AUTH");

	bench_tenant = getenv("KILN_BENCH_TENANT");
	if (!yes || strcmp(yes, "accept-anyone") != 0 || !bench_tenant || !*bench_tenant) {
		kiln_error_set(err, KILN_E_INVALID,
			       "this is a bench-only build without authentication (KILN_BENCH_NO_AUTH): "
			       "it starts only with KILN_BENCH_NO_AUTH=accept-anyone and "
			       "KILN_BENCH_TENANT=<tenant id>");
		return false;
	}
	log_warn("bench-only build: authentication is off, every request is tenant \"%s\"'s",
		 bench_tenant);
	return true;
}
#endif

bool gw_before(struct http_req *req, const struct http_route *route)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	struct auth_credential cred;
	struct req_state *st;
	uint32_t need = route->scope & ROUTE_SCOPE_MASK;
	const char *hdr;
	bool suspended = false;
	enum kiln_err rc;

	if (route->scope == 0)
		return params_utf8(req, route);
	st = calloc(1, sizeof(*st));
	if (!st) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return false;
	}
	http_req_set_ctx(req, st, req_state_free);
#ifdef KILN_BENCH_NO_AUTH
	if (bench_tenant) {	/* always, in this build (main() checked it) */
		snprintf(st->who.tenant_id, sizeof(st->who.tenant_id), "%s", bench_tenant);
		snprintf(st->who.key_id, sizeof(st->who.key_id), "key_bench");
		st->who.scopes = AUTH_SCOPES_TENANT;
		st->has_principal = true;
		if (!auth_scopes_has(st->who.scopes, need)) {	/* admin routes stay closed */
			http_reply_error(req, KILN_E_FORBIDDEN, "a bench-only build without "
					 "authentication serves no admin route");
			return false;
		}
		return params_utf8(req, route) && idempotency_claim(gw, req, st, false);
	}
#endif

	hdr = http_req_header(req, "Authorization");
	if (!hdr) {
		http_reply_header(req, "WWW-Authenticate", "Bearer");
		http_reply_error(req, KILN_E_UNAUTHENTICATED, "missing Authorization header");
		return false;
	}
	rc = auth_bearer_parse(hdr, strlen(hdr), &cred, &err);
	if (rc == KILN_OK)
		rc = cred.kind == AUTH_CRED_API_KEY ? auth_api_key(gw, cred.value, cred.len, &st->who, &err)
						    : auth_jwt(gw, cred.value, cred.len, &st->who, &err);
	if (rc != KILN_OK) {
		if (rc != KILN_E_UNAVAILABLE)
			rc = KILN_E_UNAUTHENTICATED;
		if (rc == KILN_E_UNAUTHENTICATED)
			http_reply_header(req, "WWW-Authenticate", "Bearer");
		http_reply_error(req, rc, "%s", rc == KILN_E_UNAVAILABLE ? "the database is unavailable"
									 : err.msg);
		return false;
	}
	st->has_principal = true;
	log_ctx_set(http_req_id(req), st->who.tenant_id, NULL);

	rc = tenant_suspended(gw, st->who.tenant_id, &suspended, &err);
	if (rc != KILN_OK) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
		return false;
	}
	if (suspended) {
		http_reply_error(req, KILN_E_SUSPENDED,
				 "the tenant is suspended by the operator: every key and token of it "
				 "is refused until it is unsuspended");
		return false;
	}

	if ((route->scope & ROUTE_API_KEY_ONLY) && st->who.via_jwt) {
		http_reply_error(req, KILN_E_FORBIDDEN, "this route needs an API key, not a token");
		return false;
	}
	if (!auth_scopes_has(st->who.scopes, need)) {
		char names[AUTH_SCOPES_STR_MAX];
		auth_scopes_format(need, names, sizeof(names));
		http_reply_error(req, KILN_E_FORBIDDEN, "this route needs the scope \"%s\"", names);
		return false;
	}

	/* Before the rate limits: past its bound a tenant's requests cost no Redis round trip. */
	if (!inflight_take(st->who.tenant_id, (unsigned)gw->cfg.tenant_max_in_flight)) {
		http_reply_header(req, "Retry-After", "1");
		http_reply_error(req, KILN_E_RATE_LIMITED,
				 "too many requests of this tenant in progress at once (limit "
				 "tenant_max_in_flight, %lld); retry in 1 s",
				 gw->cfg.tenant_max_in_flight);
		return false;
	}
	st->in_flight = true;
	if (!limit_take(req, gw, "req", st->who.key_id, gw->cfg.rate_limit_rps, 1000,
			gw->cfg.rate_limit_burst, "rate_limit_rps", false) ||
	    !limit_take(req, gw, "treq", st->who.tenant_id, gw->cfg.tenant_rate_limit_rps, 1000,
			gw->cfg.tenant_rate_limit_burst, "tenant_rate_limit_rps", false))
		return false;
	if ((route->scope & ROUTE_CREATES) &&
	    (!limit_take(req, gw, "create", st->who.key_id, gw->cfg.create_limit_rpm, 60000,
			 gw->cfg.create_limit_rpm, "create_limit_rpm", true) ||
	     !limit_take(req, gw, "tcreate", st->who.tenant_id, gw->cfg.tenant_create_limit_rpm,
			 60000, gw->cfg.tenant_create_limit_rpm, "tenant_create_limit_rpm", true)))
		return false;
	/* After the limits: a refused parameter's request is audited, so it takes its tokens. */
	if (!params_utf8(req, route))
		return false;
	return idempotency_claim(gw, req, st, route->scope & ROUTE_API_KEY_ONLY);
}

void gw_done(struct http_req *req, const struct http_route *route, int status)
{
	struct gateway *gw = http_req_app(req);
	struct req_state *st = http_req_ctx(req);

	if (!st || !st->has_principal)
		return;
	if (st->idem_key[0])
		idempotency_finish(gw, gw->pg, req, st, status);
	if (st->in_flight) {
		st->in_flight = false;
		inflight_drop(st->who.tenant_id);
	}
}

/*
 * `s` as valid UTF-8, for a column of the audit row: each byte that starts no valid sequence
 * becomes the four characters \xNN (hex, upper case). A request can carry any byte (a path's
 * %FF is decoded into the object id), and Postgres refuses a text that is not UTF-8, which would
 * refuse the whole group of rows with it. Returns NULL when `s` is valid (or NULL) and needs no
 * copy, or when memory runs out (`s` is then written as it is, and refused alone); otherwise a
 * copy the caller frees.
 */
static char *utf8_escape(const char *s)
{
	const unsigned char *u = (const unsigned char *)s;
	size_t len, bad = 0;
	char *out, *o;

	if (!s)
		return NULL;
	for (size_t i = 0; u[i]; ) {
		int n = utf8_len(u + i);

		bad += n == 0;
		i += n ? (size_t)n : 1;
	}
	if (!bad)
		return NULL;
	len = strlen(s);
	out = malloc(len + 3 * bad + 1);
	if (!out)
		return NULL;
	o = out;
	for (size_t i = 0; u[i]; ) {
		int n = utf8_len(u + i);

		if (n) {
			memcpy(o, u + i, (size_t)n);
			o += n;
			i += (size_t)n;
		} else {
			o += sprintf(o, "\\x%02X", u[i++]);
		}
	}
	*o = '\0';
	return out;
}

/* Writes the audit row of `row` alone (without the commit queue); a failure loses it (logged). */
static void audit_write_one(struct gateway *gw, const struct commitq_row *row)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char code[8];

	snprintf(code, sizeof(code), "%d", row->status);
	if (pg_acquire(gw->audit_pg, &c, &err) != KILN_OK) {
		log_warn("audit record lost: postgres is unavailable (%s %s %d)", row->method,
			 row->route, row->status);
		return;
	}
	if (PGQ_ASYNC(c, NULL, &err,
		"INSERT INTO audit_log (tenant_id, key_id, method, route, object_id, status, request_id) "
		"SELECT $1, $2, $3, $4, $5, $6::int, $7 FROM " ASYNC_COMMIT,
		row->tenant_id, row->key_id, row->method, row->route, row->object_id, code,
		row->request_id) != KILN_OK)
		log_warn("audit record lost: %s", err.msg);
	pg_release(gw->audit_pg, c);
}

void gw_audit(struct http_req *req, const struct http_route *route, int status)
{
	struct gateway *gw = http_req_app(req);
	struct req_state *st = http_req_ctx(req);
	const char *method = http_req_method(req);
	struct kiln_error err = { 0 };
	struct commitq_row row;
	enum kiln_err rc;
	char *sealed = NULL, *object = NULL;

	/*
	 * Rate-limited refusals (429) are not recorded (/metrics counts them): nothing was done, and
	 * an insert for each would let a tenant hammering the limits queue every thread on this pool.
	 * A 429 that owns an Idempotency-Key stores it in the done hook.
	 */
	if (!st || !st->has_principal || !strcmp(method, "GET") || !strcmp(method, "HEAD") ||
	    status == 429)
		return;
	/*
	 * Who did what to which object, and how it ended; and, for a request that owns an
	 * Idempotency-Key and did not fail with a 5xx, its reply, stored before the client can see
	 * it: a retry can then never be answered otherwise, even after a crash of Postgres, and
	 * finds the record complete at once. Both go to the commit queue (api/commitq.h), on
	 * connections of their own: the handler may hold connections of the main pool while it
	 * replies. A 5xx frees its key in the done hook.
	 */
	/*
	 * The object id is the only column a request can fill with any bytes: the others are the
	 * principal's ids, the route's method and pattern, and a request id of the server's format.
	 */
	object = utf8_escape(http_req_object(req));
	row = (struct commitq_row){
		.tenant_id = st->who.tenant_id,
		.key_id = st->who.key_id,
		.method = method,
		.route = route->pattern,
		.object_id = object ? object : http_req_object(req),
		.status = status,
		.request_id = http_req_id(req),
	};
	if (st->idem_key[0] && status < 500 && idempotency_seal(gw, req, st, &sealed) == KILN_OK) {
		row.idem_key = st->idem_key;
		row.idem_method = method;
		row.idem_path = http_req_path(req);
		row.idem_sha256 = st->idem_sum;
		row.response = sealed ? sealed : "";
	}
	rc = commitq_write(gw->commitq, &row, &err);
	if (rc == KILN_E_UNAVAILABLE) {
		/*
		 * The writer retried the group (AUDIT_GROUP_RETRY_MS): the reply goes out, its
		 * audit row lost (as one insert's failure loses it); an outcome is stored by the done
		 * hook after the reply, retried for idempotency_finish_s on its own thread, so that
		 * no reply waits out a failover and a retry of the key later finds its reply.
		 */
		log_warn("audit record lost: %s (%s %s %d)", err.msg, method, route->pattern,
			 status);
		row.idem_key = NULL;	/* the key stays the done hook's */
	} else if (rc != KILN_OK) {
		/*
		 * This row was refused (its group split down to it), or the writer is stopping:
		 * each written alone instead, the outcome still before the reply, retried while
		 * Postgres is unreachable for up to idempotency_finish_s (idempotency_finish).
		 */
		audit_write_one(gw, &row);
		if (row.idem_key)
			idempotency_finish(gw, gw->audit_pg, req, st, status);
	}
	if (row.idem_key)
		st->idem_key[0] = '\0';	/* stored (or given up): nothing left for the done hook */
	free(sealed);
	free(object);
}
