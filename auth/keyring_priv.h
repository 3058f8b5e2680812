/*
 * keyring_priv.h - the keyring's insides, shared by keyring.c, jwt.c and jwks.c only. Nothing
 * outside auth/ includes this file.
 */
#ifndef KILN_AUTH_KEYRING_PRIV_H
#define KILN_AUTH_KEYRING_PRIV_H

#include <stdint.h>

#include <openssl/evp.h>
#include <openssl/sha.h>

#include "auth/jwt.h"
#include "auth/keyring.h"

#define AUTH_EC_COORD_LEN 32	/* bytes of a P-256 coordinate */

/*
 * Each key's cache of tokens it verified (see auth_jwt_verify): up to
 * KEYRING_CACHE_SETS * KEYRING_CACHE_WAYS entries, each the SHA-256 of a whole token and the claims
 * that token was accepted with (its `exp` among them), so that a token sent again costs a lookup
 * and the checks against the caller's options and `now`, not a decoding. A token's hash picks its
 * set; a full set drops an expired entry, else its oldest. The sets share KEYRING_CACHE_LOCKS
 * mutexes, so the threads sharing a keyring can use it at once. It is 3.54 MiB and made only when
 * its key first checks a signature, so a keyring built only to read its kids costs none.
 */
#define KEYRING_CACHE_WAYS 4
#define KEYRING_CACHE_SETS 1024		/* a power of two */
#define KEYRING_CACHE_LOCKS 64		/* a power of two, at most KEYRING_CACHE_SETS */

struct keyring_cache;

/*
 * A key, parsed once when it is added. Signing and verifying never read a PEM again: each call
 * duplicates the ready context of its operation, which is cheaper than making one from the key
 * (that looks the algorithm up in the provider store again), and leaves the shared one untouched,
 * so many threads can use one key at once.
 */
struct auth_key {
	char kid[AUTH_KID_MAX];
	EVP_PKEY *pkey;
	EVP_PKEY_CTX *verify_ctx;	/* EVP_PKEY_verify_init done: duplicate it, never use it */
	EVP_PKEY_CTX *sign_ctx;		/* EVP_PKEY_sign_init done; NULL for a verify-only key */
	char *public_pem;	/* SubjectPublicKeyInfo, for auth_keyring_public_pem */
	size_t public_len;
	/*
	 * Tokens this key verified: NULL until the key first checks a signature, then set once
	 * (atomically, by whichever thread gets there first) and freed with the key.
	 */
	struct keyring_cache *verified;
};

struct auth_keyring {
	struct auth_key keys[AUTH_KEYRING_MAX];
	size_t n;
	int active;		/* index of the signer, -1 when none */
	uint64_t decoded;	/* verifications that decoded a token (atomic; auth_jwt_cache_stats) */
};

/* The key named `kid`, or NULL. */
const struct auth_key *keyring_find(const struct auth_keyring *kr, const char *kid);

/* Writes a P-256 key's affine coordinates. Returns 0, or -1 when `pkey` is not a P-256 key. */
int keyring_ec_xy(EVP_PKEY *pkey, unsigned char x[AUTH_EC_COORD_LEN],
		  unsigned char y[AUTH_EC_COORD_LEN]);

/* Writes the RFC 7638 thumbprint of a P-256 key to `kid`. Returns 0 or -1. */
int keyring_thumbprint(EVP_PKEY *pkey, char kid[AUTH_KID_MAX]);

/*
 * Adds `pkey` to the keyring, taking ownership of it whatever the outcome. `has_private` says
 * whether it holds the private half. Returns as auth_keyring_add_private_pem.
 */
enum kiln_err keyring_add_pkey(struct auth_keyring *kr, EVP_PKEY *pkey, bool has_private,
			       char kid[AUTH_KID_MAX], struct kiln_error *err);

/*
 * Whether `k` verified the token whose SHA-256 is `id` and whose `exp` is still after `now`; if so,
 * copies the claims it was accepted with to `out` and counts a hit. Counts nothing when it is not
 * there: the caller looks in every key of a keyring before it knows the token's kid, and counts
 * its miss with keyring_cache_miss once it checks the signature. Thread-safe.
 */
bool keyring_cache_get(const struct auth_key *k, const unsigned char id[SHA256_DIGEST_LENGTH],
		       int64_t now, struct auth_claims *out);

/*
 * Counts a verification by `k` that found nothing in its cache and checks the signature; makes the
 * cache when this is the key's first.
 */
void keyring_cache_miss(const struct auth_key *k, const unsigned char id[SHA256_DIGEST_LENGTH]);

/*
 * Records that `k` verified the token whose SHA-256 is `id`, with the claims `c` read from it
 * (kept until `c->exp`; `now` tells which entries have expired). Only a token that passed every
 * check may be recorded. Thread-safe.
 */
void keyring_cache_put(const struct auth_key *k, const unsigned char id[SHA256_DIGEST_LENGTH],
		       const struct auth_claims *c, int64_t now);

#endif
