/*
 * apikey.h - API keys and opaque ids.
 *
 * An API key reads `kiln_sk_<key id>_<secret>`: the key id is the key's public id
 * (`key_` + 26 base32 characters, 128 random bits) and the secret is 256 random bits in 52
 * lowercase base32 characters, so a whole key is 91 characters of [a-z2-7_] and selects with one
 * double click. The key is shown once; the database keeps the key id, a display prefix and the
 * HMAC-SHA-256 of the secret under a server pepper (see docs/auth.md). The library never touches
 * the database: the caller stores what auth_apikey_generate() returns and looks the row up by the
 * key id that auth_apikey_parse() returns.
 */
#ifndef KILN_AUTH_APIKEY_H
#define KILN_AUTH_APIKEY_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

#define AUTH_APIKEY_PREFIX "kiln_sk_"
#define AUTH_ID_RANDOM_LEN 26				/* base32 characters after an id's prefix */
#define AUTH_ID_MAX 48					/* bytes, terminator included, any prefix */
#define AUTH_KEY_ID_LEN (4 + AUTH_ID_RANDOM_LEN)	/* "key_" + 26 */
#define AUTH_APIKEY_SECRET_LEN 52			/* base32 characters: 256 bits */
#define AUTH_APIKEY_LEN (8 + AUTH_KEY_ID_LEN + 1 + AUTH_APIKEY_SECRET_LEN) /* 91 */
#define AUTH_APIKEY_DISPLAY_LEN 20			/* "kiln_sk_key_" + 8 characters */
#define AUTH_APIKEY_HASH_LEN 64				/* hex characters of HMAC-SHA-256 */

/* A freshly made key: everything the caller stores, plus the key shown once. */
struct auth_apikey_new {
	char key[AUTH_APIKEY_LEN + 1];			/* shown once, never stored or logged */
	char key_id[AUTH_KEY_ID_LEN + 1];		/* public id, primary key of the row */
	char prefix[AUTH_APIKEY_DISPLAY_LEN + 1];	/* shown in listings */
	char hash[AUTH_APIKEY_HASH_LEN + 1];		/* stored; verifies the secret */
};

/* A presented key split into its parts. */
struct auth_apikey {
	char key_id[AUTH_KEY_ID_LEN + 1];
	char secret[AUTH_APIKEY_SECRET_LEN + 1];
};

/*
 * Writes a new id `<prefix><26 base32 chars>` (128 random bits) to `out`. `prefix` is one of the
 * API's type prefixes (`tn_`, `key_`, `sb_`, `snap_`, `tx_`, `req_`, ...): 1 to 8 characters of
 * [a-z] ending in '_'. Returns KILN_OK, KILN_E_INVALID for a bad prefix or short `out`
 * (AUTH_ID_MAX always fits), KILN_E_INTERNAL when the random generator fails.
 */
enum kiln_err auth_new_id(const char *prefix, char *out, size_t outlen);

/*
 * Makes a new API key. `pepper` (`pepper_len` bytes, at least 16) is the server's secret for
 * hashing keys (auth_master_derive(mk, "apikey-pepper", ...) gives one). Fills `out`; the caller
 * should wipe out->key (OPENSSL_cleanse) once it has been returned to the user.
 */
enum kiln_err auth_apikey_generate(const unsigned char *pepper, size_t pepper_len,
				   struct auth_apikey_new *out, struct kiln_error *err);

/*
 * Parses a presented key of `len` bytes strictly: exact length, the `kiln_sk_key_` prefix, the
 * base32 alphabet and the separator. Returns KILN_OK or KILN_E_UNAUTHENTICATED (with a message
 * that never repeats the key).
 */
enum kiln_err auth_apikey_parse(const char *s, size_t len, struct auth_apikey *out,
				struct kiln_error *err);

/*
 * Computes the stored hash of a key's secret into `hash` (AUTH_APIKEY_HASH_LEN + 1 bytes):
 * hex HMAC-SHA-256 keyed with the pepper over "kiln-apikey-v1", the key id and the secret, so a
 * hash verifies only for its own key id.
 */
enum kiln_err auth_apikey_hash(const struct auth_apikey *key, const unsigned char *pepper,
			       size_t pepper_len, char hash[AUTH_APIKEY_HASH_LEN + 1],
			       struct kiln_error *err);

/*
 * Whether `key` matches `stored_hash` (as auth_apikey_hash wrote it), compared in constant time.
 * A stored hash of the wrong length, or any failure, is a mismatch.
 */
bool auth_apikey_verify(const struct auth_apikey *key, const unsigned char *pepper,
			size_t pepper_len, const char *stored_hash);

/*
 * A pepper made ready for many checks: the states of HMAC-SHA-256 after its padded key, computed
 * once. auth_apikey_verify() pays OpenSSL's HMAC() set-up on every call (it looks its algorithms
 * up anew, about ten times the cost of the hashing); a check against a prepared pepper costs
 * the two SHA-256 runs over the message alone. Returns NULL when the pepper is out of bounds
 * (16 to 1024 bytes) or memory runs out; the caller frees it with auth_apikey_pepper_free(),
 * which wipes it (it is key material).
 */
struct auth_apikey_pepper;

struct auth_apikey_pepper *auth_apikey_pepper_new(const unsigned char *pepper, size_t pepper_len);
void auth_apikey_pepper_free(struct auth_apikey_pepper *p);

/* auth_apikey_verify() with a prepared pepper: the same answer for the same pepper. */
bool auth_apikey_verify_prepared(const struct auth_apikey *key,
				 const struct auth_apikey_pepper *pepper, const char *stored_hash);

#endif
