/*
 * jwks.h - the JSON Web Key Set (RFC 7517) of a keyring's public keys.
 *
 * The gateway serves auth_jwks_build()'s document at GET /v1/.well-known/jwks.json; kiln-node
 * fetches it and loads it into a keyring of verify-only keys, refetching when a token names an
 * unknown kid. Each key reads
 * `{"kty":"EC","crv":"P-256","x":..,"y":..,"kid":..,"use":"sig","alg":"ES256"}`.
 */
#ifndef KILN_AUTH_JWKS_H
#define KILN_AUTH_JWKS_H

#include <stddef.h>

#include "auth/keyring.h"
#include "common/err.h"

#define AUTH_JWKS_MAX 65536	/* bytes of a JWKS document accepted */

/*
 * The JWKS of every key in `kr` (signer and verify-only), compact JSON. Returns a NUL-terminated
 * string the caller frees with free(), or NULL (with `err` set) when out of memory.
 */
char *auth_jwks_build(const struct auth_keyring *kr, struct kiln_error *err);

/*
 * Adds the keys of a JWKS document (`len` bytes) to `kr` as verify-only keys, all or none. Strict:
 * the document is `{"keys":[...]}` with 1 to AUTH_KEYRING_MAX keys, each an EC P-256 public key
 * with base64url `x` and `y` of 32 bytes on the curve, a `kid` equal to its RFC 7638 thumbprint,
 * `use` "sig" and `alg` "ES256" when present, and no private member `d`.
 * Returns KILN_OK, KILN_E_INVALID naming what is wrong, KILN_E_TOO_LARGE, KILN_E_CONFLICT for a
 * kid already in `kr`, KILN_E_QUOTA when `kr` would overflow, KILN_E_NOMEM.
 */
enum kiln_err auth_jwks_load(struct auth_keyring *kr, const char *json, size_t len,
			     struct kiln_error *err);

#endif
