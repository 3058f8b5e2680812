/*
 * crypto.h - the master key and what it protects.
 *
 * The master key (KILN_MASTER_KEY: 32 bytes as 64 hex characters or base64/base64url) seals what
 * Postgres keeps that must stay secret: JWT signing keys, tenants' storage credentials, per-tenant
 * data keys. Sealing is AES-256-GCM with a random 96-bit nonce; the output is text,
 * `k1.<base64url(nonce || ciphertext || tag)>`, whose version is authenticated with the caller's
 * associated data (e.g. the row's id, so a sealed value cannot be moved to another row).
 * The library reads no environment: the caller passes the variable's value.
 */
#ifndef KILN_AUTH_CRYPTO_H
#define KILN_AUTH_CRYPTO_H

#include <stddef.h>

#include "common/err.h"

#define AUTH_MASTER_KEY_LEN 32				/* bytes */
#define AUTH_MASTER_KEY_HEX_LEN 64			/* characters */
#define AUTH_DATA_KEY_LEN 32				/* bytes */
#define AUTH_SEALED_MAX (1024 * 1024)			/* bytes of sealed text accepted */
#define AUTH_SEAL_PLAINTEXT_MAX (AUTH_SEALED_MAX / 4 * 3 - 64) /* bytes */

struct auth_master_key {
	unsigned char key[AUTH_MASTER_KEY_LEN];
};

/*
 * Loads the master key from `text` (`len` bytes): 64 hex characters (either case), or 43/44
 * characters of base64 or base64url (padding optional). Surrounding whitespace (a trailing
 * newline from a key file) is ignored. Returns KILN_OK or KILN_E_INVALID; the message never
 * quotes the key.
 */
enum kiln_err auth_master_key_load(struct auth_master_key *mk, const char *text, size_t len,
				   struct kiln_error *err);

/* Fills `mk` with a new random key. Returns KILN_OK or KILN_E_INTERNAL. */
enum kiln_err auth_master_key_generate(struct auth_master_key *mk, struct kiln_error *err);

/* Writes `mk` as 64 lowercase hex characters and a terminator; `out` must hold 65 bytes. */
void auth_master_key_format(const struct auth_master_key *mk,
			    char out[AUTH_MASTER_KEY_HEX_LEN + 1]);

/* Overwrites the key in memory. Accepts NULL. */
void auth_master_key_wipe(struct auth_master_key *mk);

/*
 * Derives `outlen` bytes (at most 255 * 32) for one purpose from the master key with HKDF-SHA-256,
 * `label` naming the purpose (e.g. "apikey-pepper"). Returns KILN_OK or KILN_E_INTERNAL.
 */
enum kiln_err auth_master_derive(const struct auth_master_key *mk, const char *label,
				 unsigned char *out, size_t outlen, struct kiln_error *err);

/*
 * Seals `ptlen` bytes of `pt` (at most AUTH_SEAL_PLAINTEXT_MAX) with associated data `ad`
 * (`adlen` bytes, may be NULL/0; the same must be given to auth_open). On KILN_OK `*out` is a
 * NUL-terminated string the caller frees with free().
 */
enum kiln_err auth_seal(const struct auth_master_key *mk, const void *pt, size_t ptlen,
			const void *ad, size_t adlen, char **out, struct kiln_error *err);

/*
 * Opens `sealed` (`len` bytes of auth_seal's output). On KILN_OK `*pt` holds `*ptlen` bytes plus a
 * NUL terminator (not counted), which the caller releases with auth_secret_free(*pt, *ptlen).
 * Returns KILN_E_INVALID for a malformed or tampered value, a wrong key or wrong associated data
 * (indistinguishably).
 */
enum kiln_err auth_open(const struct auth_master_key *mk, const char *sealed, size_t len,
			const void *ad, size_t adlen, unsigned char **pt, size_t *ptlen,
			struct kiln_error *err);

/* Wipes and frees a secret that auth_open or auth_data_key_unwrap handed out. Accepts NULL. */
void auth_secret_free(void *p, size_t len);

/*
 * Makes a new random per-tenant data key into `key` and returns it sealed (bound to `ad`, e.g. the
 * tenant id) in `*wrapped`, which the caller stores and frees with free().
 */
enum kiln_err auth_data_key_new(const struct auth_master_key *mk, const void *ad, size_t adlen,
				unsigned char key[AUTH_DATA_KEY_LEN], char **wrapped,
				struct kiln_error *err);

/* Recovers a data key that auth_data_key_new wrapped. Returns KILN_OK or KILN_E_INVALID. */
enum kiln_err auth_data_key_unwrap(const struct auth_master_key *mk, const char *wrapped,
				   size_t len, const void *ad, size_t adlen,
				   unsigned char key[AUTH_DATA_KEY_LEN], struct kiln_error *err);

#endif
