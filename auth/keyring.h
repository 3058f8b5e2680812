/*
 * keyring.h - ES256 (ECDSA P-256) signing keys and the keyring that holds them.
 *
 * A key is named by its `kid`: the RFC 7638 JWK thumbprint (SHA-256, base64url, 43 characters) of
 * its public key, so the same key has the same kid on every gateway and node. A keyring holds up
 * to AUTH_KEYRING_MAX keys: at most one active signer, the others verify only (a rotated-out key
 * keeps verifying its tokens until they expire; then the caller removes it).
 *
 * The gateway loads the private keys it opened from Postgres (auth_open) and the node the public
 * keys of the JWKS (auth_jwks_load). A keyring is not locked: fill it, then share it read-only
 * between threads; to rotate, build a new one and swap the pointer.
 */
#ifndef KILN_AUTH_KEYRING_H
#define KILN_AUTH_KEYRING_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

#define AUTH_KID_LEN 43		/* characters of a kid */
#define AUTH_KID_MAX 64		/* bytes for a kid buffer, terminator included */
#define AUTH_KEYRING_MAX 16	/* keys in one keyring */
#define AUTH_PEM_MAX 8192	/* bytes of a PEM key accepted */

/* A new key pair. Both PEM strings are the caller's: release with auth_jwt_keypair_release. */
struct auth_jwt_keypair {
	char kid[AUTH_KID_MAX];
	char *private_pem;	/* PKCS#8; seal it (auth_seal) before it goes anywhere */
	char *public_pem;	/* SubjectPublicKeyInfo */
};

/* Makes a new P-256 key pair into `out`. Returns KILN_OK, KILN_E_NOMEM or KILN_E_INTERNAL. */
enum kiln_err auth_jwt_keygen(struct auth_jwt_keypair *out, struct kiln_error *err);

/* Wipes and frees the PEM strings of `kp` and empties it. Accepts NULL. */
void auth_jwt_keypair_release(struct auth_jwt_keypair *kp);

struct auth_keyring;

/* A new empty keyring, or NULL when out of memory. Free with auth_keyring_free. */
struct auth_keyring *auth_keyring_new(void);

/* Frees the keyring and wipes its private keys. Accepts NULL. */
void auth_keyring_free(struct auth_keyring *kr);

/*
 * Adds a key from a PEM private key (`len` bytes, unencrypted PKCS#8 or SEC1) or a PEM public key
 * (SubjectPublicKeyInfo). Only P-256 keys are accepted. The key's kid is written to `kid` when
 * not NULL. A private key can sign once made active; a public key only verifies.
 * Returns KILN_OK, KILN_E_INVALID for an unreadable or non-P-256 key, KILN_E_CONFLICT when the
 * kid is already in the keyring, KILN_E_QUOTA when the keyring is full, KILN_E_NOMEM.
 */
enum kiln_err auth_keyring_add_private_pem(struct auth_keyring *kr, const char *pem, size_t len,
					   char kid[AUTH_KID_MAX], struct kiln_error *err);
enum kiln_err auth_keyring_add_public_pem(struct auth_keyring *kr, const char *pem, size_t len,
					  char kid[AUTH_KID_MAX], struct kiln_error *err);

/*
 * Makes the key `kid` the signer (the previous one stays, verify-only). Returns KILN_OK,
 * KILN_E_NOT_FOUND, or KILN_E_INVALID when the keyring has only its public half.
 */
enum kiln_err auth_keyring_set_active(struct auth_keyring *kr, const char *kid,
				      struct kiln_error *err);

/* Removes the key `kid` (e.g. once its last token expired). Returns KILN_OK or KILN_E_NOT_FOUND. */
enum kiln_err auth_keyring_remove(struct auth_keyring *kr, const char *kid);

/* The active signer's kid, or NULL when there is none. Valid until the keyring changes. */
const char *auth_keyring_active_kid(const struct auth_keyring *kr);

/* The number of keys, and the kid of the i-th (NULL past the end). */
size_t auth_keyring_count(const struct auth_keyring *kr);
const char *auth_keyring_kid_at(const struct auth_keyring *kr, size_t i);

/* Whether the keyring holds `kid`. */
bool auth_keyring_has(const struct auth_keyring *kr, const char *kid);

/* The public PEM of `kid`, or NULL. Owned by the keyring, valid until the key is removed. */
const char *auth_keyring_public_pem(const struct auth_keyring *kr, const char *kid);

#endif
