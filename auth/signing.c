/*
 * signing.c - JWT signing keys in Postgres, sealed with the master key (see signing.h).
 */
#include "signing.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>
#include <openssl/sha.h>

#include "auth/jwks.h"
#include "common/clock.h"
#include "common/log.h"

/* Any constant shared by every gateway. */
#define SIGNING_LOCK_KEY "7310245602"
/*
 * The clock of the reloads' cadence: SIGNING_REFRESH_S, the refresher's tick and KID_RELOAD_MS.
 * Cadences, not times: a step of the wall clock (NTP, an operator) must neither stop the reloads
 * for its size, nor bring one early. Read only through cadence_ms() and the refresher's
 * condition, so a test's clocks (signing_set_clock_for_test) are asked for this very clock.
 */
#define SIGNING_CADENCE_CLOCK CLOCK_MONOTONIC
/* At most one reload a token naming an unknown kid asks for in this many ms. */
#define KID_RELOAD_MS 1000

struct signing {
	struct pg *pg;
	struct auth_master_key mk;
	struct auth_keyring *kr;	/* swapped whole under `lock` */
	pthread_rwlock_t lock;
	pthread_mutex_t reload_lock;
	/* SHA-256 of the rows `kr` was built from (rows_digest), when they could be hashed */
	unsigned char rows_md[SHA256_DIGEST_LENGTH];	/* under reload_lock */
	bool has_rows_md;	/* under reload_lock */
	uint64_t builds;	/* keyrings built from rows (atomic; signing_keyrings_built) */
	/*
	 * cadence_ms() of the last load (read without reload_lock: atomic) and of the last reload
	 * an unknown kid asked for (under reload_lock).
	 */
	long long last_reload_ms;
	long long last_kid_reload_ms;
	bool kid_reloaded;	/* last_kid_reload_ms was set (under reload_lock) */
	/* what the clocks read (clock_ms_of; signing_set_clock_for_test) */
	long long (*ms_of)(clockid_t clock, void *ctx);
	void *clock_ctx;
	pthread_t refresher;	/* signing_start_refresh(): reloads off the request path */
	bool has_refresher;	/* atomic */
	bool stop;		/* under stop_lock */
	pthread_mutex_t stop_lock;
	pthread_cond_t stop_cond;
};

/* SIGNING_CADENCE_CLOCK in ms, as `s` reads it: the same clock with a test's hook or without. */
static long long cadence_ms(const struct signing *s)
{
	return s->ms_of ? s->ms_of(SIGNING_CADENCE_CLOCK, s->clock_ctx)
			: clock_ms_of(SIGNING_CADENCE_CLOCK);
}

static void kid_ad(const char *kid, char *ad, size_t n)
{
	snprintf(ad, n, "signing_key:%s", kid);
}

/* Inserts a new sealed key; the caller holds the advisory lock or does not care about races. */
static enum kiln_err signing_insert_new(struct pg_conn *c, const struct auth_master_key *mk,
					char *kid_out, struct kiln_error *err)
{
	struct auth_jwt_keypair kp = { 0 };
	char *sealed = NULL, ad[96];
	enum kiln_err rc = auth_jwt_keygen(&kp, err);

	if (rc != KILN_OK)
		return rc;
	kid_ad(kp.kid, ad, sizeof(ad));
	rc = auth_seal(mk, kp.private_pem, strlen(kp.private_pem), ad, strlen(ad), &sealed, err);
	if (rc == KILN_OK)
		rc = PGQ(c, NULL, err,
			 "INSERT INTO signing_keys (kid, private_sealed, public_pem) VALUES ($1, $2, $3)",
			 kp.kid, sealed, kp.public_pem);
	if (rc == KILN_OK && kid_out)
		snprintf(kid_out, AUTH_KID_MAX, "%s", kp.kid);
	free(sealed);
	auth_jwt_keypair_release(&kp);
	return rc;
}

/*
 * The rows of signing_keys that still verify, newest first (kid last, so that keys made in the
 * same instant come in the same order on every read): kid, private_sealed, whether it is not
 * retired. *res is the caller's to free.
 */
static enum kiln_err signing_rows(struct pg *pg, struct pg_res **res, struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	char keep[16];
	enum kiln_err rc;

	*res = NULL;
	snprintf(keep, sizeof(keep), "%d", SIGNING_RETIRED_KEEP_S);
	rc = pg_acquire(pg, &c, err);
	if (rc == KILN_OK)
		rc = PGQ(c, res, err,
			 "SELECT kid, private_sealed, retired_at IS NULL FROM signing_keys "
			 "WHERE retired_at IS NULL OR retired_at > now() - make_interval(secs => $1::int) "
			 "ORDER BY created_at DESC, kid LIMIT 16",
			 keep);
	pg_release(pg, c);
	return rc;
}

/* Feeds one field to `ctx`, its length first, so that no two row sets hash as one. */
static int digest_field(EVP_MD_CTX *ctx, const char *v)
{
	uint64_t n = strlen(v);

	return EVP_DigestUpdate(ctx, &n, sizeof(n)) == 1 && EVP_DigestUpdate(ctx, v, n) == 1 ? 0 : -1;
}

/*
 * The SHA-256 of every field of the rows signing_rows() read, in order. Two reads that hash alike
 * read the same keys, sealed alike, with the same signer: what the gateway's periodic reload
 * compares before opening or parsing anything. Returns 0, or -1 when OpenSSL cannot hash.
 */
static int rows_digest(struct pg_res *res, unsigned char md[SHA256_DIGEST_LENGTH])
{
	EVP_MD_CTX *ctx = EVP_MD_CTX_new();
	int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1;

	for (int i = 0; ok && i < pg_res_rows(res); i++)
		ok = digest_field(ctx, pg_res_str(res, i, 0)) == 0 &&
		     digest_field(ctx, pg_res_str(res, i, 1)) == 0 &&
		     digest_field(ctx, pg_res_bool(res, i, 2) ? "t" : "f") == 0;
	ok = ok && EVP_DigestFinal_ex(ctx, md, NULL) == 1;
	EVP_MD_CTX_free(ctx);
	return ok ? 0 : -1;
}

/* Builds a keyring from the rows signing_rows() read: opens each key and parses it. */
static enum kiln_err keyring_of_rows(struct pg_res *res, const struct auth_master_key *mk,
				     struct auth_keyring **out, struct kiln_error *err)
{
	struct auth_keyring *kr = auth_keyring_new();
	const char *active = NULL;
	enum kiln_err rc = KILN_OK;

	*out = NULL;
	if (!kr)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (int i = 0; rc == KILN_OK && i < pg_res_rows(res); i++) {
		const char *kid = pg_res_str(res, i, 0), *sealed = pg_res_str(res, i, 1);
		unsigned char *pem = NULL;
		size_t pemlen = 0;
		char ad[96], got[AUTH_KID_MAX];

		kid_ad(kid, ad, sizeof(ad));
		rc = auth_open(mk, sealed, strlen(sealed), ad, strlen(ad), &pem, &pemlen, err);
		if (rc != KILN_OK) {
			kiln_error_clear(err);
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "signing key \"%s\" does not open with this master key",
					    kid);
			break;
		}
		rc = auth_keyring_add_private_pem(kr, (const char *)pem, pemlen, got, err);
		auth_secret_free(pem, pemlen);
		if (rc == KILN_OK && !active && pg_res_bool(res, i, 2))
			active = kid;
		if (rc == KILN_OK && active == kid)
			rc = auth_keyring_set_active(kr, got, err);
	}
	if (rc == KILN_OK && !active)
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "no active signing key");
	if (rc != KILN_OK) {
		auth_keyring_free(kr);
		return rc;
	}
	*out = kr;
	return KILN_OK;
}

/* Builds a keyring from the rows of signing_keys that still verify. */
static enum kiln_err signing_load(struct pg *pg, const struct auth_master_key *mk,
				  struct auth_keyring **out, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	enum kiln_err rc = signing_rows(pg, &res, err);

	*out = NULL;
	if (rc == KILN_OK)
		rc = keyring_of_rows(res, mk, out, err);
	pg_res_free(res);
	return rc;
}

/* Creates the first key unless one is active; concurrent starts make exactly one. */
static enum kiln_err signing_ensure(struct pg *pg, const struct auth_master_key *mk,
				    struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc = pg_acquire(pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = PGQ0(c, NULL, err, "SELECT pg_advisory_lock(" SIGNING_LOCK_KEY ")");
	if (rc == KILN_OK)
		rc = PGQ0(c, &res, err, "SELECT 1 FROM signing_keys WHERE retired_at IS NULL LIMIT 1");
	if (rc == KILN_OK && pg_res_rows(res) == 0) {
		rc = signing_insert_new(c, mk, NULL, err);
		if (rc == KILN_OK)
			log_info("made the first signing key");
	}
	pg_res_free(res);
	{
		struct kiln_error ignore = { 0 };
		PGQ0(c, NULL, &ignore, "SELECT pg_advisory_unlock(" SIGNING_LOCK_KEY ")");
	}
	pg_release(pg, c);
	return rc;
}

/* Whether two keyrings hold the same keys with the same signer. */
static bool same_keys(const struct auth_keyring *a, const struct auth_keyring *b)
{
	const char *sa = auth_keyring_active_kid(a), *sb = auth_keyring_active_kid(b);

	if (auth_keyring_count(a) != auth_keyring_count(b) || !sa || !sb || strcmp(sa, sb) != 0)
		return false;
	for (size_t i = 0; i < auth_keyring_count(a); i++)
		if (!auth_keyring_has(b, auth_keyring_kid_at(a, i)))
			return false;
	return true;
}

/*
 * Makes `kr` the keyring unless it holds the same keys as the one in use; frees the other. The
 * caller holds reload_lock (so `kr`, once in, stays until this returns).
 */
static void swap_in(struct signing *s, struct auth_keyring *kr)
{
	struct auth_keyring *old;
	const char *was, *now;
	bool same;

	/* Unchanged keys keep their keyring, and with it the cache of tokens already verified. */
	pthread_rwlock_rdlock(&s->lock);
	same = same_keys(s->kr, kr);
	pthread_rwlock_unlock(&s->lock);
	if (same) {
		auth_keyring_free(kr);
		return;
	}
	pthread_rwlock_wrlock(&s->lock);
	old = s->kr;
	s->kr = kr;
	pthread_rwlock_unlock(&s->lock);
	/* A new signer is logged: when a rotation reached this process (at start, the first). */
	was = auth_keyring_active_kid(old);
	now = auth_keyring_active_kid(kr);
	if (now && (!was || strcmp(was, now) != 0))
		log_info("signing key %s signs", now);
	auth_keyring_free(old);
}

/*
 * Reads the stored keys and, when their rows differ from those the keyring was built from, builds
 * a keyring of them and swaps it in. The rows are compared by their hash first: opening each key
 * with the master key and parsing it (a pairwise check and the contexts of keyring.c) is the cost
 * of a reload, and the keys seldom change. Any change to a row (a key added, retired, removed, or
 * sealed anew) or a retired key passing SIGNING_RETIRED_KEEP_S changes the rows read, so it is
 * still built at this reload. The caller holds reload_lock.
 */
static enum kiln_err reload_locked(struct signing *s, long long now_ms, struct kiln_error *err)
{
	unsigned char md[SHA256_DIGEST_LENGTH];
	struct auth_keyring *kr = NULL;
	struct pg_res *res = NULL;
	bool hashed;
	enum kiln_err rc;

	__atomic_store_n(&s->last_reload_ms, now_ms, __ATOMIC_RELAXED);
	rc = signing_rows(s->pg, &res, err);
	if (rc != KILN_OK)
		return rc;
	hashed = rows_digest(res, md) == 0;
	if (hashed && s->has_rows_md && memcmp(md, s->rows_md, sizeof(md)) == 0) {
		pg_res_free(res);
		return KILN_OK;
	}
	rc = keyring_of_rows(res, &s->mk, &kr, err);
	pg_res_free(res);
	if (rc != KILN_OK)
		return rc;	/* the rows stay unmatched: the next reload tries them again */
	__atomic_fetch_add(&s->builds, 1, __ATOMIC_RELAXED);
	/* Rows that could not be hashed match nothing: the next reload builds again. */
	s->has_rows_md = hashed;
	if (hashed)
		memcpy(s->rows_md, md, sizeof(md));
	swap_in(s, kr);
	return KILN_OK;
}

uint64_t signing_keyrings_built(struct signing *s)
{
	return __atomic_load_n(&s->builds, __ATOMIC_RELAXED);
}

struct signing *signing_new(struct pg *pg, const struct auth_master_key *mk, struct kiln_error *err)
{
	struct signing *s;

	if (signing_ensure(pg, mk, err) != KILN_OK)
		return NULL;
	s = calloc(1, sizeof(*s));
	if (!s) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	s->pg = pg;
	s->mk = *mk;
	pthread_rwlock_init(&s->lock, NULL);
	pthread_mutex_init(&s->reload_lock, NULL);
	pthread_mutex_init(&s->stop_lock, NULL);
	/* The refresher's tick, on the clock a wall-clock step does not move. */
	clock_cond_init(&s->stop_cond, SIGNING_CADENCE_CLOCK);
	/* No thread shares `s` yet: reload_lock need not be held. */
	if (reload_locked(s, cadence_ms(s), err) != KILN_OK) {
		signing_free(s);
		return NULL;
	}
	return s;
}

void signing_free(struct signing *s)
{
	if (!s)
		return;
	if (s->has_refresher) {
		pthread_mutex_lock(&s->stop_lock);
		s->stop = true;
		pthread_cond_signal(&s->stop_cond);
		pthread_mutex_unlock(&s->stop_lock);
		pthread_join(s->refresher, NULL);
	}
	pthread_cond_destroy(&s->stop_cond);
	pthread_mutex_destroy(&s->stop_lock);
	auth_keyring_free(s->kr);
	auth_master_key_wipe(&s->mk);
	pthread_rwlock_destroy(&s->lock);
	pthread_mutex_destroy(&s->reload_lock);
	free(s);
}

enum kiln_err signing_reload(struct signing *s, bool on_unknown_kid, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;
	long long now;

	pthread_mutex_lock(&s->reload_lock);
	/*
	 * Read once the lock is held: waiting for a slow reload must not make this one store a
	 * time older than that one's.
	 */
	now = cadence_ms(s);
	/*
	 * Only reloads for unknown kids count against the once-a-second bound: a key made just
	 * after a load at start or a periodic one must still be found at its first token.
	 */
	if (!on_unknown_kid || !s->kid_reloaded || now - s->last_kid_reload_ms >= KID_RELOAD_MS) {
		if (on_unknown_kid) {
			s->last_kid_reload_ms = now;
			s->kid_reloaded = true;
		}
		rc = reload_locked(s, now, err);
	}
	pthread_mutex_unlock(&s->reload_lock);
	return rc;
}

/*
 * Reloads the keys when the last load is SIGNING_REFRESH_S old on the monotonic clock, so a key
 * rotated in by another process signs here too. One caller does it; the others go on with the
 * keys they have. A failure keeps the old keys and is tried again a period later.
 */
static void reload_if_due(struct signing *s)
{
	struct kiln_error err = { 0 };
	long long now = cadence_ms(s);

	if (now - __atomic_load_n(&s->last_reload_ms, __ATOMIC_RELAXED) < SIGNING_REFRESH_S * 1000LL)
		return;
	if (pthread_mutex_trylock(&s->reload_lock) != 0)
		return;
	now = cadence_ms(s);	/* again, under the lock: the time this reload stores */
	if (now - s->last_reload_ms >= SIGNING_REFRESH_S * 1000LL &&
	    reload_locked(s, now, &err) != KILN_OK)
		log_warn("cannot reload the signing keys: %s", err.msg);
	pthread_mutex_unlock(&s->reload_lock);
}

/* On a request: the reload when no thread does it (signing_start_refresh). */
static void refresh(struct signing *s)
{
	if (!__atomic_load_n(&s->has_refresher, __ATOMIC_ACQUIRE))
		reload_if_due(s);
}

static void *refresh_main(void *arg)
{
	struct signing *s = arg;

	pthread_mutex_lock(&s->stop_lock);
	while (!s->stop) {
		struct timespec until = clock_after_ms(SIGNING_CADENCE_CLOCK, 1000);

		pthread_cond_timedwait(&s->stop_cond, &s->stop_lock, &until);
		if (s->stop)
			break;
		pthread_mutex_unlock(&s->stop_lock);
		reload_if_due(s);
		pthread_mutex_lock(&s->stop_lock);
	}
	pthread_mutex_unlock(&s->stop_lock);
	return NULL;
}

enum kiln_err signing_start_refresh(struct signing *s, struct kiln_error *err)
{
	if (s->has_refresher)
		return KILN_OK;
	if (pthread_create(&s->refresher, NULL, refresh_main, s) != 0)
		return kiln_error_set(err, KILN_E_INTERNAL, "cannot start the signing key reloader");
	__atomic_store_n(&s->has_refresher, true, __ATOMIC_RELEASE);
	return KILN_OK;
}

void signing_set_clock_for_test(struct signing *s, long long (*ms_of)(clockid_t clock, void *ctx),
				void *ctx)
{
	pthread_mutex_lock(&s->reload_lock);
	s->clock_ctx = ctx;
	s->ms_of = ms_of;
	/*
	 * The times kept were read on the clocks replaced: the period, and the bound of unknown
	 * kids' reloads, start again at the new clocks' now.
	 */
	__atomic_store_n(&s->last_reload_ms, cadence_ms(s), __ATOMIC_RELAXED);
	s->kid_reloaded = false;
	pthread_mutex_unlock(&s->reload_lock);
}

enum kiln_err signing_sign(struct signing *s, const struct auth_token_params *p, char **token,
			   struct auth_claims *claims, struct kiln_error *err)
{
	enum kiln_err rc;

	refresh(s);
	pthread_rwlock_rdlock(&s->lock);
	rc = auth_jwt_sign(s->kr, p, token, claims, err);
	pthread_rwlock_unlock(&s->lock);
	return rc;
}

enum kiln_err signing_verify(struct signing *s, const char *token, size_t len,
			     const struct auth_verify_opts *opts, struct auth_claims *out,
			     enum auth_jwt_reason *why, struct kiln_error *err)
{
	enum kiln_err rc;
	struct kiln_error first = { 0 };

	refresh(s);
	pthread_rwlock_rdlock(&s->lock);
	rc = auth_jwt_verify(s->kr, token, len, opts, out, why, &first);
	pthread_rwlock_unlock(&s->lock);
	if (rc != KILN_OK && *why == AUTH_JWT_UNKNOWN_KID) {
		struct kiln_error ignore = { 0 };
		if (signing_reload(s, true, &ignore) == KILN_OK) {
			kiln_error_clear(&first);
			pthread_rwlock_rdlock(&s->lock);
			rc = auth_jwt_verify(s->kr, token, len, opts, out, why, &first);
			pthread_rwlock_unlock(&s->lock);
		}
	}
	if (rc != KILN_OK)
		kiln_error_set(err, rc, "%s", first.msg);
	return rc;
}

char *signing_jwks(struct signing *s, struct kiln_error *err)
{
	char *doc;

	refresh(s);
	pthread_rwlock_rdlock(&s->lock);
	doc = auth_jwks_build(s->kr, err);
	pthread_rwlock_unlock(&s->lock);
	return doc;
}

enum kiln_err signing_rotate(struct pg *pg, const struct auth_master_key *mk, char *new_kid,
			     struct kiln_error *err)
{
	struct auth_keyring *kr = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	/*
	 * The keys in use must open with this master key: a key sealed with another one would
	 * stop every gateway from loading the keys (and from starting).
	 */
	rc = signing_load(pg, mk, &kr, err);
	auth_keyring_free(kr);
	if (rc == KILN_E_NOT_FOUND) {	/* no active key yet */
		kiln_error_clear(err);
		rc = KILN_OK;
	}
	if (rc != KILN_OK)
		return rc;
	rc = pg_acquire(pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = pg_exec(c, "BEGIN", err);
	if (rc == KILN_OK)
		rc = PGQ0(c, NULL, err,
			  "UPDATE signing_keys SET retired_at = now() WHERE retired_at IS NULL");
	if (rc == KILN_OK)
		rc = signing_insert_new(c, mk, new_kid, err);
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	pg_release(pg, c);	/* rolls back on error */
	return rc;
}
