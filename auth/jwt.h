/*
 * jwt.h - issuing and verifying Kiln's ES256 JWTs.
 *
 * User tokens (POST /v1/tokens) carry `aud: kiln-api`; the gateway's per-request tokens to a node
 * carry `aud: kiln-node` and the sandbox id in `sbx`. Claims: `iss`, `aud`, `sub` (key id), `tid`
 * (tenant), `scope` (space-separated), `iat`, `exp`, `jti`, optional `nbf` and `sbx`; header
 * `alg: ES256`, `typ: JWT`, `kid`.
 *
 * Verification never lets the token choose how it is checked: the header is parsed here first and
 * anything but `alg: ES256` with a `kid` is refused before the signature is looked at; the key is
 * the keyring's key for that kid (see docs/auth.md for every rule). Each key remembers the tokens
 * it accepted, with their claims (by SHA-256 of the whole token, until the token's `exp`, at most
 * 4096), and does not decode the same bytes or check their signature again; what depends on the
 * caller's options and `now` (audience, issuer, exp, iat/nbf, lifetime, sandbox) is checked on
 * every call. Time is always the caller's `now` (seconds since the epoch), never the clock. Claims
 * come back as a plain struct.
 */
#ifndef KILN_AUTH_JWT_H
#define KILN_AUTH_JWT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth/keyring.h"
#include "common/err.h"

#define AUTH_AUD_API "kiln-api"
#define AUTH_AUD_NODE "kiln-node"
#define AUTH_JWT_MAX 4096		/* bytes of a whole token */
#define AUTH_CLAIM_MAX 128		/* bytes of a string claim, terminator included */
#define AUTH_JWT_TTL_MAX 86400		/* seconds: the longest lifetime auth_jwt_sign accepts */

struct auth_claims {
	char iss[AUTH_CLAIM_MAX];
	char aud[AUTH_CLAIM_MAX];
	char sub[AUTH_CLAIM_MAX];	/* the API key id the token was made from */
	char tid[AUTH_CLAIM_MAX];	/* tenant id */
	char jti[AUTH_CLAIM_MAX];	/* the token's unique id */
	char sbx[AUTH_CLAIM_MAX];	/* sandbox id for node tokens; "" when absent */
	char kid[AUTH_KID_MAX];		/* the key that signed it */
	uint32_t scopes;		/* AUTH_SCOPE_* bits */
	int64_t iat;			/* seconds since the epoch */
	int64_t exp;			/* seconds since the epoch */
	int64_t nbf;			/* seconds since the epoch; 0 when absent */
};

struct auth_token_params {
	const char *iss;		/* issuer, e.g. the public base URL */
	const char *aud;		/* AUTH_AUD_API or AUTH_AUD_NODE */
	const char *sub;
	const char *tid;
	const char *sbx;		/* NULL for user tokens; required for AUTH_AUD_NODE */
	uint32_t scopes;
	int64_t now;			/* seconds since the epoch: becomes `iat` */
	int64_t ttl_s;			/* seconds, 1 .. AUTH_JWT_TTL_MAX: `exp` = now + ttl_s */
};

/*
 * Signs a token with the keyring's active key. String parameters must be 1 .. AUTH_CLAIM_MAX-1
 * printable ASCII characters without spaces. On KILN_OK `*token` is a NUL-terminated string the
 * caller frees with free(), and `claims` (if not NULL) receives what was signed (`jti` included).
 * Returns KILN_E_INVALID for bad parameters, KILN_E_INTERNAL when there is no active key or
 * signing fails, KILN_E_NOMEM.
 */
enum kiln_err auth_jwt_sign(const struct auth_keyring *kr, const struct auth_token_params *p,
			    char **token, struct auth_claims *claims, struct kiln_error *err);

/* Why a token was refused: every reason but OK makes auth_jwt_verify return KILN_E_UNAUTHENTICATED. */
enum auth_jwt_reason {
	AUTH_JWT_OK = 0,
	AUTH_JWT_TOO_LARGE,		/* the token or one of its parts is over its cap */
	AUTH_JWT_MALFORMED,		/* not three base64url parts of JSON objects */
	AUTH_JWT_BAD_ALG,		/* alg is not ES256 (none, HS256, ...) or header not allowed */
	AUTH_JWT_UNKNOWN_KID,		/* no key with that kid: refetch the JWKS, then retry once */
	AUTH_JWT_BAD_SIGNATURE,
	AUTH_JWT_BAD_CLAIMS,		/* a required claim missing, of the wrong type or malformed */
	AUTH_JWT_WRONG_AUD,
	AUTH_JWT_WRONG_ISS,
	AUTH_JWT_EXPIRED,		/* now >= exp */
	AUTH_JWT_NOT_YET_VALID,		/* iat or nbf later than now + leeway */
	AUTH_JWT_TTL_TOO_LONG,		/* exp - iat over the caller's max_ttl_s */
};

/* A short snake_case name for `r` ("unknown_kid"), for logs and tests; never NULL. */
const char *auth_jwt_reason_name(enum auth_jwt_reason r);

struct auth_verify_opts {
	const char *aud;		/* required audience: AUTH_AUD_API or AUTH_AUD_NODE */
	const char *iss;		/* required issuer, or NULL to accept any */
	int64_t now;			/* seconds since the epoch */
	int64_t leeway_s;		/* seconds of clock skew allowed for iat and nbf (not exp) */
	int64_t max_ttl_s;		/* refuse exp - iat above this; 0 for no limit */
	bool require_sbx;		/* the token must name a sandbox (node tokens) */
};

/*
 * Verifies `token` (`len` bytes) against the keyring. On KILN_OK fills `out` and sets `*why` to
 * AUTH_JWT_OK. A refused token returns KILN_E_UNAUTHENTICATED with `*why` saying why and a
 * message in `err` fit for logs (never the token itself); KILN_E_NOMEM and KILN_E_INTERNAL mean
 * the check could not run. `why` and `err` may be NULL. Safe to call from many threads at once on
 * one keyring.
 */
enum kiln_err auth_jwt_verify(const struct auth_keyring *kr, const char *token, size_t len,
			      const struct auth_verify_opts *opts, struct auth_claims *out,
			      enum auth_jwt_reason *why, struct kiln_error *err);

/* What the keys' caches of verified tokens did (see above), summed over the keyring's keys. */
struct auth_jwt_cache_stats {
	uint64_t hits;			/* verifications that found the token accepted before */
	uint64_t misses;		/* verifications that checked the signature */
	uint64_t decoded;		/* verifications that decoded the token's header (none of the hits) */
	size_t entries;			/* tokens held now, expired ones included until replaced */
};

/* Fills `out` for `kr` (zeros for NULL). Safe to call while other threads verify. */
void auth_jwt_cache_stats(const struct auth_keyring *kr, struct auth_jwt_cache_stats *out);

#endif
