/*
 * test_jwt_cache.c - each key's cache of tokens whose signature it verified: a cached token is
 * still refused when expired, for the wrong audience or issuer, too early, too long-lived or
 * without a sandbox; a token one byte away from a cached one has its signature checked (and is
 * refused, every time: nothing refused is cached); a removed key takes its cache with it; the
 * cache stays within its size; four threads share one keyring's cache. A token found in the cache
 * is not decoded again: its claims come from the cache, the same as from the token, and are still
 * refused at exp, once their key has left the keyring, and for any other bytes. A key's cache is
 * allocated only when the key first checks a signature, and a returned kid is zero after its end.
 * (A token that cannot be hashed: test_jwt_hash_fault.c.)
 */
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth/jwt.h"
#include "auth/keyring.h"
#include "auth/scopes.h"
#include "test.h"

#if defined(__SANITIZE_ADDRESS__)
/* AddressSanitizer's (sanitizer/allocator_interface.h, which not every compiler install has). */
size_t __sanitizer_get_current_allocated_bytes(void);
#endif

#define NOW 1700000000LL
#define TTL 600
#define CACHE_ENTRIES 4096	/* per key: keyring_priv.h */

static struct auth_jwt_keypair kp1, kp2;

static const struct auth_verify_opts api_opts = {
	.aud = AUTH_AUD_API, .iss = "https://kiln.test", .now = NOW, .leeway_s = 30,
	.max_ttl_s = 900,
};

static struct auth_token_params user_params(void)
{
	struct auth_token_params p = {
		.iss = "https://kiln.test", .aud = AUTH_AUD_API, .sub = "key_abc", .tid = "tn_abc",
		.scopes = AUTH_SCOPE_SANDBOX_READ, .now = NOW, .ttl_s = TTL,
	};
	return p;
}

/* A keyring of kp1 (active), or of kp1 and kp2 with kp2 active. */
static struct auth_keyring *keyring(bool both)
{
	struct auth_keyring *k = auth_keyring_new();

	CHECK(k != NULL);
	CHECK_INT(auth_keyring_add_private_pem(k, kp1.private_pem, strlen(kp1.private_pem), NULL,
					       NULL), KILN_OK);
	CHECK_INT(auth_keyring_set_active(k, kp1.kid, NULL), KILN_OK);
	if (both) {
		CHECK_INT(auth_keyring_add_private_pem(k, kp2.private_pem, strlen(kp2.private_pem),
						       NULL, NULL), KILN_OK);
		CHECK_INT(auth_keyring_set_active(k, kp2.kid, NULL), KILN_OK);
	}
	return k;
}

static char *sign(const struct auth_keyring *k, const struct auth_token_params *p)
{
	char *t = NULL;
	struct kiln_error err = { 0 };

	if (auth_jwt_sign(k, p, &t, NULL, &err) != KILN_OK)
		fprintf(stderr, "sign failed: %s\n", err.msg);
	return t;
}

static enum auth_jwt_reason verify(const struct auth_keyring *k, const char *tok,
				   const struct auth_verify_opts *o)
{
	enum auth_jwt_reason why = AUTH_JWT_OK;
	struct auth_claims c;
	enum kiln_err rc = auth_jwt_verify(k, tok, strlen(tok), o, &c, &why, NULL);

	if ((why == AUTH_JWT_OK) != (rc == KILN_OK))
		return (enum auth_jwt_reason)-1;
	if (why != AUTH_JWT_OK && rc != KILN_E_UNAUTHENTICATED)
		return (enum auth_jwt_reason)-1;
	return why;
}

/* Verifies `tok` into `c`; the reason, as verify(). */
static enum auth_jwt_reason verify_claims(const struct auth_keyring *k, const char *tok,
					  const struct auth_verify_opts *o, struct auth_claims *c)
{
	enum auth_jwt_reason why = AUTH_JWT_OK;
	enum kiln_err rc = auth_jwt_verify(k, tok, strlen(tok), o, c, &why, NULL);

	return (why == AUTH_JWT_OK) == (rc == KILN_OK) ? why : (enum auth_jwt_reason)-1;
}

static struct auth_jwt_cache_stats stats(const struct auth_keyring *k)
{
	struct auth_jwt_cache_stats s;

	auth_jwt_cache_stats(k, &s);
	return s;
}

/* `tok` with the character at `i` changed to another base64url character. */
static char *one_char_off(const char *tok, size_t i)
{
	char *f = strdup(tok);

	f[i] = f[i] == 'A' ? 'B' : 'A';
	return f;
}

static void setup(void)
{
	if (auth_jwt_keygen(&kp1, NULL) != KILN_OK || auth_jwt_keygen(&kp2, NULL) != KILN_OK) {
		fprintf(stderr, "keygen failed\n");
		exit(1);
	}
}

static void second_verification_skips_only_the_signature(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *t = sign(kr, &p);
	struct auth_jwt_cache_stats s = stats(kr);
	struct auth_claims c1, c2;

	CHECK_INT(s.hits + s.misses + s.entries, 0);
	CHECK_INT(auth_jwt_verify(kr, t, strlen(t), &api_opts, &c1, NULL, NULL), KILN_OK);
	s = stats(kr);
	CHECK_INT(s.misses, 1);
	CHECK_INT(s.hits, 0);
	CHECK_INT(s.entries, 1);
	CHECK_INT(auth_jwt_verify(kr, t, strlen(t), &api_opts, &c2, NULL, NULL), KILN_OK);
	s = stats(kr);
	CHECK_INT(s.misses, 1);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.entries, 1);
	/* the claims come back whole either way */
	CHECK(memcmp(&c1, &c2, sizeof(c1)) == 0);
	CHECK_STR(c2.kid, kp1.kid);
	CHECK_STR(c2.jti, c1.jti);
	CHECK_INT(c2.exp, NOW + TTL);
	free(t);
	auth_keyring_free(kr);
}

static void cached_token_is_still_checked_in_full(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *t = sign(kr, &p);
	struct auth_verify_opts o;
	struct auth_jwt_cache_stats s;

	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).entries, 1);

	/* every refusal below comes from a cache hit: the signature is not checked again */
	o = api_opts;
	o.aud = AUTH_AUD_NODE;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_WRONG_AUD);
	o = api_opts;
	o.iss = "https://other.test";
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_WRONG_ISS);
	o = api_opts;
	o.now = NOW - 31;	/* before iat, beyond the leeway */
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_NOT_YET_VALID);
	o = api_opts;
	o.max_ttl_s = TTL - 1;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_TTL_TOO_LONG);
	o = api_opts;
	o.require_sbx = true;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_BAD_CLAIMS);
	o = api_opts;
	o.now = NOW + TTL - 1;	/* the last second it is valid */
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_OK);
	s = stats(kr);
	CHECK_INT(s.misses, 1);
	CHECK_INT(s.hits, 6);

	/* at exp the entry is gone too: the signature is checked, then the token is expired */
	o.now = NOW + TTL;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_EXPIRED);
	o.now = NOW + 100000;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_EXPIRED);
	s = stats(kr);
	CHECK_INT(s.misses, 3);
	CHECK_INT(s.hits, 6);

	/* and the right options still accept it, from the cache */
	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits, 7);
	free(t);
	auth_keyring_free(kr);
}

static void only_accepted_tokens_are_cached(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *t = sign(kr, &p);
	struct auth_verify_opts o = api_opts;
	struct auth_jwt_cache_stats s;

	/* a good signature on a token refused for its claims is not remembered */
	o.aud = AUTH_AUD_NODE;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_WRONG_AUD);
	o = api_opts;
	o.now = NOW + TTL;
	CHECK_INT(verify(kr, t, &o), AUTH_JWT_EXPIRED);
	s = stats(kr);
	CHECK_INT(s.entries, 0);
	CHECK_INT(s.misses, 2);
	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	s = stats(kr);
	CHECK_INT(s.entries, 1);
	CHECK_INT(s.misses, 3);
	CHECK_INT(s.hits, 0);
	free(t);
	auth_keyring_free(kr);
}

static void one_byte_off_is_verified_for_real(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *t = sign(kr, &p), *f;
	size_t n = strlen(t), sig = (size_t)(strrchr(t, '.') - t) + 1;
	struct auth_jwt_cache_stats s;

	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	s = stats(kr);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.misses, 1);

	/* one character of the signature, at its start, middle and end: refused, and again */
	for (size_t i = sig; i < n; i += (n - sig) / 2 - 1) {
		f = one_char_off(t, i);
		CHECK_INT(verify(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
		CHECK_INT(verify(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
		free(f);
	}
	s = stats(kr);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.misses, 7);	/* 1 + 3 places x 2 tries: no refusal is remembered */
	CHECK_INT(s.entries, 1);

	/* one character of the payload, under the cached token's signature */
	f = one_char_off(t, sig - 3);
	CHECK(verify(kr, f, &api_opts) != AUTH_JWT_OK);
	free(f);
	/* the cached token's bytes followed by one more */
	f = malloc(n + 2);
	snprintf(f, n + 2, "%sA", t);
	CHECK(verify(kr, f, &api_opts) != AUTH_JWT_OK);
	free(f);
	s = stats(kr);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.entries, 1);

	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits, 2);
	free(t);
	auth_keyring_free(kr);
}

static void removed_key_drops_its_cache(void)
{
	struct auth_keyring *kr = keyring(true);	/* kp2 signs */
	struct auth_token_params p = user_params();
	char *t2 = sign(kr, &p), *t1;
	struct auth_jwt_cache_stats s;

	CHECK_INT(auth_keyring_set_active(kr, kp1.kid, NULL), KILN_OK);
	t1 = sign(kr, &p);
	CHECK_INT(verify(kr, t1, &api_opts), AUTH_JWT_OK);
	CHECK_INT(verify(kr, t2, &api_opts), AUTH_JWT_OK);
	CHECK_INT(verify(kr, t2, &api_opts), AUTH_JWT_OK);
	s = stats(kr);
	CHECK_INT(s.entries, 2);
	CHECK_INT(s.hits, 1);

	CHECK_INT(auth_keyring_remove(kr, kp2.kid), KILN_OK);
	CHECK_INT(verify(kr, t2, &api_opts), AUTH_JWT_UNKNOWN_KID);
	s = stats(kr);
	CHECK_INT(s.entries, 1);	/* kp1's token only */
	CHECK_INT(verify(kr, t1, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits - s.hits, 1);

	/* the same key back (its public half): a new, empty cache, so the signature is checked */
	CHECK_INT(auth_keyring_add_public_pem(kr, kp2.public_pem, strlen(kp2.public_pem), NULL,
					      NULL), KILN_OK);
	s = stats(kr);
	CHECK_INT(s.entries, 1);
	CHECK_INT(verify(kr, t2, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).misses - s.misses, 1);
	CHECK_INT(stats(kr).hits - s.hits, 0);
	CHECK_INT(verify(kr, t2, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits - s.hits, 1);

	/* another keyring holding the same key shares nothing */
	{
		struct auth_keyring *node = auth_keyring_new();

		CHECK_INT(auth_keyring_add_public_pem(node, kp2.public_pem, strlen(kp2.public_pem),
						      NULL, NULL), KILN_OK);
		CHECK_INT(verify(node, t2, &api_opts), AUTH_JWT_OK);
		s = stats(node);
		CHECK_INT(s.misses, 1);
		CHECK_INT(s.hits, 0);
		auth_keyring_free(node);
	}
	free(t1);
	free(t2);
	auth_keyring_free(kr);
}

/* More distinct tokens than the cache holds: it stays within its size, and all still verify. */
static void cache_is_bounded(void)
{
	enum { N = CACHE_ENTRIES + 512 };
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	struct auth_jwt_cache_stats s;
	char **t = calloc(N, sizeof(*t));
	int ok = 0, signed_n = 0;

	for (int i = 0; i < N; i++) {
		t[i] = sign(kr, &p);
		signed_n += t[i] != NULL;
	}
	CHECK_INT(signed_n, N);
	for (int i = 0; i < N && t[i]; i++)
		ok += verify(kr, t[i], &api_opts) == AUTH_JWT_OK;
	CHECK_INT(ok, N);
	s = stats(kr);
	CHECK_INT(s.misses, N);
	CHECK(s.entries <= CACHE_ENTRIES);
	CHECK(s.entries >= CACHE_ENTRIES / 2);
	/* the newest is in; every one of them still verifies, from the cache or not */
	CHECK_INT(verify(kr, t[N - 1], &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits, 1);
	ok = 0;
	for (int i = 0; i < N && t[i]; i++)
		ok += verify(kr, t[i], &api_opts) == AUTH_JWT_OK;
	CHECK_INT(ok, N);
	s = stats(kr);
	CHECK(s.entries <= CACHE_ENTRIES);
	CHECK(s.hits > 1);
	CHECK_INT(s.hits + s.misses, 2 * N + 1);
	for (int i = 0; i < N; i++)
		free(t[i]);
	free(t);
	auth_keyring_free(kr);
}

#define THREADS 4
#define ROUNDS 200
#define TOKENS 16

struct worker {
	const struct auth_keyring *kr;
	char **good, **bad;
	int ok, refused, expired, wrong_aud, other;
	int wrong_tid;		/* accepted with claims that are not the token's own */
};

static void *work(void *arg)
{
	struct worker *w = arg;
	struct auth_verify_opts late = api_opts, node = api_opts;

	late.now = NOW + TTL;
	node.aud = AUTH_AUD_NODE;
	for (int i = 0; i < ROUNDS; i++) {
		const char *g = w->good[i % TOKENS], *b = w->bad[i % TOKENS];
		enum auth_jwt_reason r;
		struct auth_claims c;
		char tid[16];

		/* Each token has its own tid: a torn or another token's entry would show here. */
		snprintf(tid, sizeof(tid), "tn_%d", i % TOKENS);
		if ((r = verify_claims(w->kr, g, &api_opts, &c)) == AUTH_JWT_OK)
			w->ok++;
		else
			w->other++;
		if (r == AUTH_JWT_OK && strcmp(c.tid, tid) != 0)
			w->wrong_tid++;
		if ((r = verify(w->kr, b, &api_opts)) == AUTH_JWT_BAD_SIGNATURE)
			w->refused++;
		else
			w->other++;
		if ((r = verify(w->kr, g, &late)) == AUTH_JWT_EXPIRED)
			w->expired++;
		else
			w->other++;
		if ((r = verify(w->kr, g, &node)) == AUTH_JWT_WRONG_AUD)
			w->wrong_aud++;
		else
			w->other++;
	}
	return NULL;
}

static void four_threads_share_the_cache(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *good[TOKENS], *bad[TOKENS];
	struct worker w[THREADS];
	pthread_t th[THREADS];
	struct auth_jwt_cache_stats s;
	char tid[TOKENS][16];

	for (int i = 0; i < TOKENS; i++) {
		snprintf(tid[i], sizeof(tid[i]), "tn_%d", i);
		p.tid = tid[i];
		good[i] = sign(kr, &p);
		bad[i] = good[i] ? one_char_off(good[i], strlen(good[i]) - 10) : NULL;
		if (!good[i])
			return;
	}
	memset(w, 0, sizeof(w));
	for (int i = 0; i < THREADS; i++) {
		w[i].kr = kr;
		w[i].good = good;
		w[i].bad = bad;
		CHECK_INT(pthread_create(&th[i], NULL, work, &w[i]), 0);
	}
	for (int i = 0; i < THREADS; i++) {
		pthread_join(th[i], NULL);
		CHECK_INT(w[i].ok, ROUNDS);
		CHECK_INT(w[i].refused, ROUNDS);
		CHECK_INT(w[i].expired, ROUNDS);
		CHECK_INT(w[i].wrong_aud, ROUNDS);
		CHECK_INT(w[i].other, 0);
		CHECK_INT(w[i].wrong_tid, 0);
	}
	s = stats(kr);
	CHECK_INT(s.entries, TOKENS);
	CHECK_INT(s.hits + s.misses, THREADS * ROUNDS * 4);
	/* at least every good token in time but its first check per thread came from the cache */
	CHECK(s.hits >= (uint64_t)THREADS * (ROUNDS - TOKENS));
	for (int i = 0; i < TOKENS; i++) {
		free(good[i]);
		free(bad[i]);
	}
	auth_keyring_free(kr);
}

static void stats_of_nothing_are_zero(void)
{
	struct auth_jwt_cache_stats s;

	memset(&s, 0xff, sizeof(s));
	auth_jwt_cache_stats(NULL, &s);
	CHECK_INT(s.hits + s.misses + s.entries, 0);
}

/* Every claim of `a` equals `b`'s. */
static bool same_claims(const struct auth_claims *a, const struct auth_claims *b)
{
	return strcmp(a->iss, b->iss) == 0 && strcmp(a->aud, b->aud) == 0 &&
	       strcmp(a->sub, b->sub) == 0 && strcmp(a->tid, b->tid) == 0 &&
	       strcmp(a->jti, b->jti) == 0 && strcmp(a->sbx, b->sbx) == 0 &&
	       strcmp(a->kid, b->kid) == 0 && a->scopes == b->scopes && a->iat == b->iat &&
	       a->exp == b->exp && a->nbf == b->nbf;
}

static bool claims_empty(const struct auth_claims *c)
{
	static const struct auth_claims none;

	return same_claims(c, &none);
}

/* The claims from the cache are the claims from the token, for a user and a node token. */
static void cached_claims_are_the_tokens_claims(void)
{
	struct auth_keyring *kr = keyring(false), *fresh = keyring(false);
	struct auth_token_params p = user_params(), np = user_params();
	struct auth_verify_opts no = api_opts;
	struct auth_claims signed_c, first, cached, other;
	char *t = NULL, *nt;

	CHECK_INT(auth_jwt_sign(kr, &p, &t, &signed_c, NULL), KILN_OK);
	CHECK_INT(verify_claims(kr, t, &api_opts, &first), AUTH_JWT_OK);
	CHECK_INT(stats(kr).decoded, 1);
	CHECK_INT(verify_claims(kr, t, &api_opts, &cached), AUTH_JWT_OK);
	CHECK_INT(stats(kr).decoded, 1);	/* from the cache: nothing decoded */
	CHECK_INT(stats(kr).hits, 1);
	CHECK(same_claims(&first, &cached));
	CHECK(same_claims(&signed_c, &cached));
	/* and what another keyring of the same key reads from the token itself */
	CHECK_INT(verify_claims(fresh, t, &api_opts, &other), AUTH_JWT_OK);
	CHECK_INT(stats(fresh).decoded, 1);
	CHECK(same_claims(&other, &cached));
	CHECK_STR(cached.tid, "tn_abc");
	CHECK_STR(cached.sub, "key_abc");
	CHECK_STR(cached.kid, kp1.kid);
	CHECK_INT(cached.scopes, AUTH_SCOPE_SANDBOX_READ);

	np.aud = AUTH_AUD_NODE;
	np.sbx = "sbx_123";
	np.ttl_s = 60;
	no.aud = AUTH_AUD_NODE;
	no.require_sbx = true;
	nt = sign(kr, &np);
	CHECK_INT(verify_claims(kr, nt, &no, &first), AUTH_JWT_OK);
	CHECK_INT(verify_claims(kr, nt, &no, &cached), AUTH_JWT_OK);
	CHECK_INT(stats(kr).decoded, 2);
	CHECK(same_claims(&first, &cached));
	CHECK_STR(cached.sbx, "sbx_123");
	CHECK_STR(cached.aud, AUTH_AUD_NODE);
	free(t);
	free(nt);
	auth_keyring_free(kr);
	auth_keyring_free(fresh);
}

/* exp has no leeway, from the cache too; iat and nbf have it. */
static void cached_token_refused_once_expired(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *t = sign(kr, &p);
	struct auth_verify_opts o = api_opts;
	struct auth_claims c;

	CHECK_INT(verify_claims(kr, t, &o, &c), AUTH_JWT_OK);
	o.now = NOW + TTL - 1;
	CHECK_INT(verify_claims(kr, t, &o, &c), AUTH_JWT_OK);
	o.now = NOW - o.leeway_s;	/* iat within the leeway */
	CHECK_INT(verify_claims(kr, t, &o, &c), AUTH_JWT_OK);
	CHECK_INT(stats(kr).decoded, 1);
	CHECK_INT(stats(kr).hits, 2);
	o.now = NOW - o.leeway_s - 1;
	CHECK_INT(verify_claims(kr, t, &o, &c), AUTH_JWT_NOT_YET_VALID);
	CHECK(claims_empty(&c));
	for (int64_t after = 0; after <= api_opts.leeway_s + 1; after += api_opts.leeway_s / 2) {
		o.now = NOW + TTL + after;
		CHECK_INT(verify_claims(kr, t, &o, &c), AUTH_JWT_EXPIRED);
		CHECK(claims_empty(&c));
	}
	/* still in the cache for a caller whose clock is earlier */
	CHECK_INT(verify_claims(kr, t, &api_opts, &c), AUTH_JWT_OK);
	CHECK_STR(c.tid, "tn_abc");
	free(t);
	auth_keyring_free(kr);
}

/* A token whose key left the keyring is refused, though its claims were cached; others stay. */
static void cached_token_refused_once_its_key_is_gone(void)
{
	struct auth_keyring *kr = keyring(true);	/* kp2 signs */
	struct auth_token_params p = user_params();
	char *t2 = sign(kr, &p), *t1;
	struct auth_jwt_cache_stats s;
	struct auth_claims c;

	CHECK_INT(auth_keyring_set_active(kr, kp1.kid, NULL), KILN_OK);
	t1 = sign(kr, &p);
	for (int i = 0; i < 2; i++) {
		CHECK_INT(verify_claims(kr, t1, &api_opts, &c), AUTH_JWT_OK);
		CHECK_INT(verify_claims(kr, t2, &api_opts, &c), AUTH_JWT_OK);
		CHECK_STR(c.kid, kp2.kid);
	}
	s = stats(kr);
	CHECK_INT(s.decoded, 2);
	CHECK_INT(s.hits, 2);

	CHECK_INT(auth_keyring_remove(kr, kp2.kid), KILN_OK);
	CHECK_INT(verify_claims(kr, t2, &api_opts, &c), AUTH_JWT_UNKNOWN_KID);
	CHECK(claims_empty(&c));
	CHECK_INT(verify_claims(kr, t2, &api_opts, &c), AUTH_JWT_UNKNOWN_KID);
	CHECK_INT(stats(kr).decoded, 4);
	/* kp1's token is still found */
	CHECK_INT(verify_claims(kr, t1, &api_opts, &c), AUTH_JWT_OK);
	CHECK_INT(stats(kr).decoded, 4);
	CHECK_STR(c.kid, kp1.kid);
	free(t1);
	free(t2);
	auth_keyring_free(kr);
}

/* Bytes that share the cached token's beginning are decoded and checked, and refused. */
static void tampered_token_with_the_cached_prefix_is_not_found(void)
{
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	char *t = sign(kr, &p), *f;
	size_t n = strlen(t), sig = (size_t)(strrchr(t, '.') - t) + 1;
	struct auth_jwt_cache_stats s;
	struct auth_claims c;

	CHECK_INT(verify_claims(kr, t, &api_opts, &c), AUTH_JWT_OK);
	CHECK_INT(verify_claims(kr, t, &api_opts, &c), AUTH_JWT_OK);
	s = stats(kr);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.decoded, 1);

	f = one_char_off(t, n - 1);	/* the last character of the signature */
	CHECK_INT(verify_claims(kr, f, &api_opts, &c), AUTH_JWT_BAD_SIGNATURE);
	CHECK(claims_empty(&c));
	free(f);
	f = one_char_off(t, sig - 2);	/* the payload's last character, signature unchanged */
	CHECK(verify_claims(kr, f, &api_opts, &c) != AUTH_JWT_OK);
	CHECK(claims_empty(&c));
	free(f);
	f = strndup(t, n - 1);		/* the cached token but its last character */
	CHECK(verify_claims(kr, f, &api_opts, &c) != AUTH_JWT_OK);
	CHECK(claims_empty(&c));
	free(f);
	s = stats(kr);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.decoded, 4);
	CHECK_INT(s.entries, 1);
	CHECK_INT(verify_claims(kr, t, &api_opts, &c), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits, 2);
	CHECK_INT(stats(kr).decoded, 4);
	free(t);
	auth_keyring_free(kr);
}

/*
 * More distinct tokens than the cache holds: old ones are dropped, verified again in full with
 * their own claims when they come back, and the cache keeps its size.
 */
static void evicted_tokens_are_decoded_again(void)
{
	enum { N = CACHE_ENTRIES + 1024 };
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	struct auth_claims c;
	char **t = calloc(N, sizeof(*t)), tid[32];
	uint64_t before;
	int ok = 0, right = 0;

	for (int i = 0; i < N; i++) {
		snprintf(tid, sizeof(tid), "tn_%d", i);
		p.tid = tid;
		t[i] = sign(kr, &p);
		ok += t[i] && verify(kr, t[i], &api_opts) == AUTH_JWT_OK;
	}
	CHECK_INT(ok, N);
	CHECK_INT(stats(kr).decoded, N);
	CHECK(stats(kr).entries <= CACHE_ENTRIES);
	/* the newest is in the cache */
	CHECK_INT(verify_claims(kr, t[N - 1], &api_opts, &c), AUTH_JWT_OK);
	CHECK_INT(stats(kr).decoded, N);
	/*
	 * Each again: at most CACHE_ENTRIES can have stayed, so the others are decoded anew, and
	 * every one comes back with its own claims.
	 */
	before = stats(kr).decoded;
	ok = 0;
	for (int i = 0; i < N; i++) {
		snprintf(tid, sizeof(tid), "tn_%d", i);
		ok += verify_claims(kr, t[i], &api_opts, &c) == AUTH_JWT_OK;
		right += strcmp(c.tid, tid) == 0;
	}
	CHECK_INT(ok, N);
	CHECK_INT(right, N);
	CHECK(stats(kr).decoded - before >= N - CACHE_ENTRIES);
	CHECK(stats(kr).entries <= CACHE_ENTRIES);
	for (int i = 0; i < N; i++)
		free(t[i]);
	free(t);
	auth_keyring_free(kr);
}

/* Bytes of heap in use (AddressSanitizer keeps its own heap, which mallinfo2 does not see). */
static size_t heap_in_use(void)
{
#if defined(__SANITIZE_ADDRESS__)
	return __sanitizer_get_current_allocated_bytes();
#else
	struct mallinfo2 m = mallinfo2();

	return m.uordblks + m.hblkhd;
#endif
}

/*
 * A key's cache (some 3.5 MiB) is made when the key first checks a signature, not when it joins a
 * keyring: the gateway builds a whole keyring on each reload only to compare its kids.
 */
static void cache_made_on_first_signature_check(void)
{
	const size_t cache_min = (size_t)CACHE_ENTRIES * 512;	/* bytes: far below an entry's size */
	struct auth_token_params p = user_params();
	struct auth_keyring *kr, *signer = keyring(false);
	size_t before, added;
	char *t = sign(signer, &p);

	CHECK(t != NULL);
	before = heap_in_use();
	kr = keyring(true);
	added = heap_in_use() - before;
	CHECK(added < cache_min);	/* two keys, no cache */
	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK(heap_in_use() - before >= added + cache_min);	/* kp1's cache, for its first token */
	CHECK_INT(stats(kr).misses, 1);
	CHECK_INT(verify(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK_INT(stats(kr).hits, 1);
	CHECK_INT(stats(kr).entries, 1);
	auth_keyring_free(kr);
	auth_keyring_free(signer);
	free(t);
}

/* Leaves `fill` in stack the next call's locals will occupy. */
static __attribute__((noinline)) void dirty_stack(unsigned char fill)
{
	volatile unsigned char junk[16384];

	for (size_t i = 0; i < sizeof(junk); i++)
		junk[i] = fill;
}

/* The claims' kid is the key's kid and zeros after it, not what the stack held before. */
static void claims_kid_is_zero_padded(void)
{
	static const char zeros[AUTH_KID_MAX];
	struct auth_keyring *kr = keyring(false);
	struct auth_token_params p = user_params();
	struct auth_claims c;
	char *t = sign(kr, &p);
	size_t n = strlen(kp1.kid);

	CHECK(t != NULL);
	for (int i = 0; t && i < 2; i++) {	/* decoded, then from the cache */
		dirty_stack(0xa5);
		CHECK_INT(verify_claims(kr, t, &api_opts, &c), AUTH_JWT_OK);
		CHECK_STR(c.kid, kp1.kid);
		CHECK(memcmp(c.kid + n, zeros, sizeof(c.kid) - n) == 0);
	}
	free(t);
	auth_keyring_free(kr);
}

int main(void)
{
	setup();
	TEST(second_verification_skips_only_the_signature);
	TEST(cached_token_is_still_checked_in_full);
	TEST(only_accepted_tokens_are_cached);
	TEST(one_byte_off_is_verified_for_real);
	TEST(removed_key_drops_its_cache);
	TEST(cache_is_bounded);
	TEST(four_threads_share_the_cache);
	TEST(stats_of_nothing_are_zero);
	TEST(cached_claims_are_the_tokens_claims);
	TEST(cached_token_refused_once_expired);
	TEST(cached_token_refused_once_its_key_is_gone);
	TEST(tampered_token_with_the_cached_prefix_is_not_found);
	TEST(evicted_tokens_are_decoded_again);
	TEST(cache_made_on_first_signature_check);
	TEST(claims_kid_is_zero_padded);
	auth_jwt_keypair_release(&kp1);
	auth_jwt_keypair_release(&kp2);
	return test_summary();
}
