/*
 * keyring.c - P-256 key generation, kids (RFC 7638 thumbprints), the keyring (see keyring.h) and
 * each key's cache of tokens it verified (see keyring_priv.h).
 */
#include "auth/keyring_priv.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/ec.h>
#include <openssl/pem.h>
#include <openssl/sha.h>

#include "auth/encode.h"
#include "auth/jwt.h"

struct cache_entry {
	unsigned char id[SHA256_DIGEST_LENGTH];	/* SHA-256 of the whole token */
	int64_t exp;		/* the token's exp; 0 for an empty entry */
	struct auth_claims claims;	/* what the token was accepted with */
};

struct cache_set {
	struct cache_entry e[KEYRING_CACHE_WAYS];	/* newest first */
};

/*
 * A mutex and the counts of lookups in its sets, a cache line each so that they do not bounce.
 * Hits are counted under the mutex a lookup holds anyway; a miss holds none (the signature check
 * comes next), so it is counted with one atomic add rather than a lock taken for the count alone.
 */
union cache_lock {
	struct {
		pthread_mutex_t mu;
		uint64_t hits;		/* under mu */
		atomic_uint_least64_t misses;
	} l;
	char line[64];
};

struct keyring_cache {
	union cache_lock locks[KEYRING_CACHE_LOCKS];
	struct cache_set sets[KEYRING_CACHE_SETS];
};

/*
 * A new empty cache, or NULL. calloc leaves pages fresh from the kernel untouched until entries
 * use them, but zero-fills reused heap whole: hence a cache only for a key that verifies.
 */
static struct keyring_cache *cache_new(void)
{
	struct keyring_cache *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	for (size_t i = 0; i < KEYRING_CACHE_LOCKS; i++) {
		if (pthread_mutex_init(&c->locks[i].l.mu, NULL) != 0) {
			while (i-- > 0)
				pthread_mutex_destroy(&c->locks[i].l.mu);
			free(c);
			return NULL;
		}
		atomic_init(&c->locks[i].l.misses, 0);
	}
	return c;
}

static void cache_free(struct keyring_cache *c)
{
	if (!c)
		return;
	for (size_t i = 0; i < KEYRING_CACHE_LOCKS; i++)
		pthread_mutex_destroy(&c->locks[i].l.mu);
	free(c);
}

/* The set of the token whose hash is `id`, and the lock that guards it. */
static struct cache_set *cache_slot(struct keyring_cache *c, const unsigned char *id,
				    union cache_lock **lock)
{
	uint32_t h = (uint32_t)id[0] | (uint32_t)id[1] << 8 | (uint32_t)id[2] << 16 |
		     (uint32_t)id[3] << 24;
	size_t set = h & (KEYRING_CACHE_SETS - 1);

	*lock = &c->locks[set & (KEYRING_CACHE_LOCKS - 1)];
	return &c->sets[set];
}

/* `k`'s cache as it is now (NULL until the key first checks a signature). */
static struct keyring_cache *cache_of(const struct auth_key *k)
{
	return __atomic_load_n(&k->verified, __ATOMIC_ACQUIRE);
}

/*
 * `k`'s cache, made on first use: a key that never checks a signature (in a keyring the gateway
 * built from changed rows, then freed because it held the same kids) never zero-fills one. Threads
 * racing here each make one; the first to install it wins and the others free theirs. NULL when
 * it cannot be allocated: the key then verifies everything in full, as a key with no cache does.
 */
static struct keyring_cache *cache_made(const struct auth_key *k)
{
	struct keyring_cache *c = cache_of(k), *mine, *expected = NULL;
	/* The pointer is the one member of a keyring's key that verifying may set. */
	struct keyring_cache **slot = (struct keyring_cache **)&k->verified;

	if (c)
		return c;
	mine = cache_new();
	if (!mine)
		return NULL;
	if (__atomic_compare_exchange_n(slot, &expected, mine, false, __ATOMIC_ACQ_REL,
					__ATOMIC_ACQUIRE))
		return mine;
	cache_free(mine);
	return expected;
}

bool keyring_cache_get(const struct auth_key *k, const unsigned char id[SHA256_DIGEST_LENGTH],
		       int64_t now, struct auth_claims *out)
{
	struct keyring_cache *c = cache_of(k);
	union cache_lock *lock;
	struct cache_set *s;
	bool hit = false;

	if (!c)
		return false;
	s = cache_slot(c, id, &lock);
	pthread_mutex_lock(&lock->l.mu);
	for (size_t i = 0; i < KEYRING_CACHE_WAYS; i++) {
		if (s->e[i].exp > now && CRYPTO_memcmp(s->e[i].id, id, SHA256_DIGEST_LENGTH) == 0) {
			*out = s->e[i].claims;
			hit = true;
			break;
		}
	}
	if (hit)
		lock->l.hits++;
	pthread_mutex_unlock(&lock->l.mu);
	return hit;
}

void keyring_cache_miss(const struct auth_key *k, const unsigned char id[SHA256_DIGEST_LENGTH])
{
	struct keyring_cache *c = cache_made(k);
	union cache_lock *lock;

	if (!c)
		return;
	cache_slot(c, id, &lock);
	atomic_fetch_add_explicit(&lock->l.misses, 1, memory_order_relaxed);
}

void keyring_cache_put(const struct auth_key *k, const unsigned char id[SHA256_DIGEST_LENGTH],
		       const struct auth_claims *c, int64_t now)
{
	int64_t exp = c->exp;
	struct keyring_cache *cache;
	union cache_lock *lock;
	struct cache_set *s;
	size_t victim = KEYRING_CACHE_WAYS;

	if (exp <= now || !(cache = cache_made(k)))
		return;
	s = cache_slot(cache, id, &lock);
	pthread_mutex_lock(&lock->l.mu);
	/*
	 * The entry itself when it is there (another thread verified the token too), else an empty
	 * or expired one, else the oldest.
	 */
	for (size_t i = 0; i < KEYRING_CACHE_WAYS && victim == KEYRING_CACHE_WAYS; i++)
		if (s->e[i].exp != 0 && memcmp(s->e[i].id, id, SHA256_DIGEST_LENGTH) == 0)
			victim = i;
	for (size_t i = 0; i < KEYRING_CACHE_WAYS && victim == KEYRING_CACHE_WAYS; i++)
		if (s->e[i].exp <= now)
			victim = i;
	if (victim == KEYRING_CACHE_WAYS)
		victim = KEYRING_CACHE_WAYS - 1;
	/* The newest goes first; those before the one dropped move down by one. */
	memmove(&s->e[1], &s->e[0], victim * sizeof(s->e[0]));
	memcpy(s->e[0].id, id, SHA256_DIGEST_LENGTH);
	s->e[0].exp = exp;
	s->e[0].claims = *c;
	pthread_mutex_unlock(&lock->l.mu);
}

void auth_jwt_cache_stats(const struct auth_keyring *kr, struct auth_jwt_cache_stats *out)
{
	memset(out, 0, sizeof(*out));
	if (kr)
		out->decoded = __atomic_load_n(&kr->decoded, __ATOMIC_RELAXED);
	for (size_t i = 0; kr && i < kr->n; i++) {
		struct keyring_cache *c = cache_of(&kr->keys[i]);

		if (!c)
			continue;
		for (size_t l = 0; l < KEYRING_CACHE_LOCKS; l++) {
			pthread_mutex_lock(&c->locks[l].l.mu);
			out->hits += c->locks[l].l.hits;
			out->misses += atomic_load_explicit(&c->locks[l].l.misses,
							    memory_order_relaxed);
			for (size_t set = l; set < KEYRING_CACHE_SETS; set += KEYRING_CACHE_LOCKS)
				for (size_t w = 0; w < KEYRING_CACHE_WAYS; w++)
					out->entries += c->sets[set].e[w].exp != 0;
			pthread_mutex_unlock(&c->locks[l].l.mu);
		}
	}
}

/* PEM callbacks return no password: an encrypted key fails instead of prompting on a terminal. */
static int no_password(char *buf, int size, int rwflag, void *u)
{
	(void)buf;
	(void)size;
	(void)rwflag;
	(void)u;
	return -1;
}

static bool is_p256(EVP_PKEY *pkey)
{
	char group[32];
	size_t n = 0;

	if (!pkey || EVP_PKEY_get_base_id(pkey) != EVP_PKEY_EC)
		return false;
	if (EVP_PKEY_get_group_name(pkey, group, sizeof(group), &n) != 1)
		return false;
	return strcmp(group, SN_X9_62_prime256v1) == 0;
}

int keyring_ec_xy(EVP_PKEY *pkey, unsigned char x[AUTH_EC_COORD_LEN],
		  unsigned char y[AUTH_EC_COORD_LEN])
{
	BIGNUM *bx = NULL, *by = NULL;
	int rc = -1;

	if (!is_p256(pkey))
		return -1;
	if (EVP_PKEY_get_bn_param(pkey, OSSL_PKEY_PARAM_EC_PUB_X, &bx) == 1 &&
	    EVP_PKEY_get_bn_param(pkey, OSSL_PKEY_PARAM_EC_PUB_Y, &by) == 1 &&
	    BN_bn2binpad(bx, x, AUTH_EC_COORD_LEN) == AUTH_EC_COORD_LEN &&
	    BN_bn2binpad(by, y, AUTH_EC_COORD_LEN) == AUTH_EC_COORD_LEN)
		rc = 0;
	BN_free(bx);
	BN_free(by);
	return rc;
}

int keyring_thumbprint(EVP_PKEY *pkey, char kid[AUTH_KID_MAX])
{
	unsigned char x[AUTH_EC_COORD_LEN], y[AUTH_EC_COORD_LEN], md[SHA256_DIGEST_LENGTH];
	char xs[AUTH_B64URL_LEN(AUTH_EC_COORD_LEN) + 1], ys[sizeof(xs)], canon[160];
	int n;

	kid[0] = '\0';
	if (keyring_ec_xy(pkey, x, y) != 0)
		return -1;
	auth_b64url_encode(x, sizeof(x), xs, sizeof(xs));
	auth_b64url_encode(y, sizeof(y), ys, sizeof(ys));
	/* RFC 7638: the required members, sorted, no whitespace. */
	n = snprintf(canon, sizeof(canon), "{\"crv\":\"P-256\",\"kty\":\"EC\",\"x\":\"%s\",\"y\":\"%s\"}",
		     xs, ys);
	if (n < 0 || (size_t)n >= sizeof(canon))
		return -1;
	SHA256((const unsigned char *)canon, (size_t)n, md);
	return auth_b64url_encode(md, sizeof(md), kid, AUTH_KID_MAX) == AUTH_KID_LEN ? 0 : -1;
}

/* Writes `pkey` as PEM (public or private half) into a new NUL-terminated string. */
static char *pem_out(EVP_PKEY *pkey, bool private_half, size_t *len)
{
	BIO *bio = BIO_new(BIO_s_mem());
	char *data = NULL, *out = NULL;
	long n;
	int ok;

	if (!bio)
		return NULL;
	if (private_half)
		ok = PEM_write_bio_PrivateKey(bio, pkey, NULL, NULL, 0, NULL, NULL);
	else
		ok = PEM_write_bio_PUBKEY(bio, pkey);
	n = BIO_get_mem_data(bio, &data);
	if (ok == 1 && n > 0 && (out = malloc((size_t)n + 1))) {
		memcpy(out, data, (size_t)n);
		out[n] = '\0';
		*len = (size_t)n;
	}
	if (private_half && data && n > 0)
		OPENSSL_cleanse(data, (size_t)n);
	BIO_free(bio);
	return out;
}

static void pem_free(char *pem, size_t len)
{
	if (!pem)
		return;
	OPENSSL_cleanse(pem, len);
	free(pem);
}

enum kiln_err auth_jwt_keygen(struct auth_jwt_keypair *out, struct kiln_error *err)
{
	EVP_PKEY *pkey;
	size_t plen = 0, qlen = 0;

	memset(out, 0, sizeof(*out));
	pkey = EVP_EC_gen(SN_X9_62_prime256v1);
	if (!pkey)
		return kiln_error_set(err, KILN_E_INTERNAL, "p-256 key generation failed");
	out->private_pem = pem_out(pkey, true, &plen);
	out->public_pem = pem_out(pkey, false, &qlen);
	if (!out->private_pem || !out->public_pem || keyring_thumbprint(pkey, out->kid) != 0) {
		EVP_PKEY_free(pkey);
		auth_jwt_keypair_release(out);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory exporting a key");
	}
	EVP_PKEY_free(pkey);
	return KILN_OK;
}

void auth_jwt_keypair_release(struct auth_jwt_keypair *kp)
{
	if (!kp)
		return;
	if (kp->private_pem)
		pem_free(kp->private_pem, strlen(kp->private_pem));
	free(kp->public_pem);
	memset(kp, 0, sizeof(*kp));
}

struct auth_keyring *auth_keyring_new(void)
{
	struct auth_keyring *kr = calloc(1, sizeof(*kr));

	if (kr)
		kr->active = -1;
	return kr;
}

static void key_release(struct auth_key *k)
{
	cache_free(k->verified);
	EVP_PKEY_CTX_free(k->sign_ctx);
	EVP_PKEY_CTX_free(k->verify_ctx);
	EVP_PKEY_free(k->pkey);
	free(k->public_pem);
	memset(k, 0, sizeof(*k));
}

/* The contexts signing and verifying duplicate: see keyring_priv.h. Returns 0 or -1. */
static int key_contexts(struct auth_key *k, bool has_private)
{
	k->verify_ctx = EVP_PKEY_CTX_new_from_pkey(NULL, k->pkey, NULL);
	if (!k->verify_ctx || EVP_PKEY_verify_init(k->verify_ctx) != 1)
		return -1;
	if (!has_private)
		return 0;
	k->sign_ctx = EVP_PKEY_CTX_new_from_pkey(NULL, k->pkey, NULL);
	if (!k->sign_ctx || EVP_PKEY_sign_init(k->sign_ctx) != 1)
		return -1;
	return 0;
}

void auth_keyring_free(struct auth_keyring *kr)
{
	if (!kr)
		return;
	for (size_t i = 0; i < kr->n; i++)
		key_release(&kr->keys[i]);
	free(kr);
}

static int find_index(const struct auth_keyring *kr, const char *kid)
{
	if (!kr || !kid)
		return -1;
	for (size_t i = 0; i < kr->n; i++)
		if (strcmp(kr->keys[i].kid, kid) == 0)
			return (int)i;
	return -1;
}

const struct auth_key *keyring_find(const struct auth_keyring *kr, const char *kid)
{
	int i = find_index(kr, kid);

	return i < 0 ? NULL : &kr->keys[i];
}

enum kiln_err keyring_add_pkey(struct auth_keyring *kr, EVP_PKEY *pkey, bool has_private,
			       char kid[AUTH_KID_MAX], struct kiln_error *err)
{
	struct auth_key k;

	memset(&k, 0, sizeof(k));
	k.pkey = pkey;
	if (kid)
		kid[0] = '\0';
	if (!is_p256(pkey)) {
		key_release(&k);
		return kiln_error_set(err, KILN_E_INVALID, "signing keys must be ec p-256");
	}
	if (keyring_thumbprint(pkey, k.kid) != 0) {
		key_release(&k);
		return kiln_error_set(err, KILN_E_INVALID, "cannot read the ec public key");
	}
	if (find_index(kr, k.kid) >= 0) {
		kiln_error_set(err, KILN_E_CONFLICT, "key '%s' is already in the keyring", k.kid);
		key_release(&k);
		return KILN_E_CONFLICT;
	}
	if (kr->n >= AUTH_KEYRING_MAX) {
		key_release(&k);
		return kiln_error_set(err, KILN_E_QUOTA, "keyring full (%d keys)", AUTH_KEYRING_MAX);
	}
	/* k.verified stays NULL until the key first checks a signature (see cache_made). */
	k.public_pem = pem_out(pkey, false, &k.public_len);
	if (!k.public_pem || key_contexts(&k, has_private) != 0) {
		key_release(&k);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory adding a key");
	}
	if (kid)
		memcpy(kid, k.kid, AUTH_KID_MAX);
	kr->keys[kr->n++] = k;
	return KILN_OK;
}

static enum kiln_err add_pem(struct auth_keyring *kr, const char *pem, size_t len, bool priv,
			     char kid[AUTH_KID_MAX], struct kiln_error *err)
{
	EVP_PKEY *pkey;
	BIO *bio;

	if (kid)
		kid[0] = '\0';
	if (!kr || !pem || len == 0 || len > AUTH_PEM_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "pem key missing or too long");
	bio = BIO_new_mem_buf(pem, (int)len);
	if (!bio)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory reading a key");
	if (priv)
		pkey = PEM_read_bio_PrivateKey(bio, NULL, no_password, NULL);
	else
		pkey = PEM_read_bio_PUBKEY(bio, NULL, no_password, NULL);
	BIO_free(bio);
	if (!pkey)
		return kiln_error_set(err, KILN_E_INVALID, "unreadable pem %s key",
				      priv ? "private" : "public");
	if (priv) {
		EVP_PKEY_CTX *ctx = EVP_PKEY_CTX_new(pkey, NULL);
		int ok = ctx && EVP_PKEY_pairwise_check(ctx) == 1;

		EVP_PKEY_CTX_free(ctx);
		if (!ok) {
			EVP_PKEY_free(pkey);
			return kiln_error_set(err, KILN_E_INVALID, "inconsistent ec private key");
		}
	}
	return keyring_add_pkey(kr, pkey, priv, kid, err);
}

enum kiln_err auth_keyring_add_private_pem(struct auth_keyring *kr, const char *pem, size_t len,
					   char kid[AUTH_KID_MAX], struct kiln_error *err)
{
	return add_pem(kr, pem, len, true, kid, err);
}

enum kiln_err auth_keyring_add_public_pem(struct auth_keyring *kr, const char *pem, size_t len,
					  char kid[AUTH_KID_MAX], struct kiln_error *err)
{
	return add_pem(kr, pem, len, false, kid, err);
}

enum kiln_err auth_keyring_set_active(struct auth_keyring *kr, const char *kid,
				      struct kiln_error *err)
{
	int i = find_index(kr, kid);

	if (i < 0)
		return kiln_error_set(err, KILN_E_NOT_FOUND, "no key '%.64s' in the keyring",
				      kid ? kid : "");
	if (!kr->keys[i].sign_ctx)
		return kiln_error_set(err, KILN_E_INVALID, "key '%s' can only verify",
				      kr->keys[i].kid);
	kr->active = i;
	return KILN_OK;
}

enum kiln_err auth_keyring_remove(struct auth_keyring *kr, const char *kid)
{
	int i = find_index(kr, kid);

	if (i < 0)
		return KILN_E_NOT_FOUND;
	key_release(&kr->keys[i]);
	memmove(&kr->keys[i], &kr->keys[i + 1], (kr->n - (size_t)i - 1) * sizeof(kr->keys[0]));
	kr->n--;
	memset(&kr->keys[kr->n], 0, sizeof(kr->keys[0]));
	if (kr->active == i)
		kr->active = -1;
	else if (kr->active > i)
		kr->active--;
	return KILN_OK;
}

const char *auth_keyring_active_kid(const struct auth_keyring *kr)
{
	return kr && kr->active >= 0 ? kr->keys[kr->active].kid : NULL;
}

size_t auth_keyring_count(const struct auth_keyring *kr)
{
	return kr ? kr->n : 0;
}

const char *auth_keyring_kid_at(const struct auth_keyring *kr, size_t i)
{
	return kr && i < kr->n ? kr->keys[i].kid : NULL;
}

bool auth_keyring_has(const struct auth_keyring *kr, const char *kid)
{
	return find_index(kr, kid) >= 0;
}

const char *auth_keyring_public_pem(const struct auth_keyring *kr, const char *kid)
{
	const struct auth_key *k = keyring_find(kr, kid);

	return k ? k->public_pem : NULL;
}
