/*
 * scopes.h - the API's scopes as a bitmask.
 *
 * `sandbox:read`, `sandbox:write`, `billing:read`, `keys:write` and `admin` (see docs/openapi.yaml,
 * "Conventions"). No scope implies another: `admin` is the operator's scope for /v1/tenants and
 * /v1/billing/grants only. A key carries a subset of a tenant's scopes; a token at most its key's.
 * Parsers are strict: an unknown or repeated scope is KILN_E_INVALID naming it.
 */
#ifndef KILN_AUTH_SCOPES_H
#define KILN_AUTH_SCOPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

#define AUTH_SCOPE_SANDBOX_READ (1u << 0)
#define AUTH_SCOPE_SANDBOX_WRITE (1u << 1)
#define AUTH_SCOPE_BILLING_READ (1u << 2)
#define AUTH_SCOPE_KEYS_WRITE (1u << 3)
#define AUTH_SCOPE_ADMIN (1u << 4)
#define AUTH_SCOPE_COUNT 5

/* Every scope a tenant's own keys may hold (a new tenant's first key gets these). */
#define AUTH_SCOPES_TENANT                                                              \
	(AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_SANDBOX_WRITE | AUTH_SCOPE_BILLING_READ |  \
	 AUTH_SCOPE_KEYS_WRITE)
#define AUTH_SCOPES_ALL (AUTH_SCOPES_TENANT | AUTH_SCOPE_ADMIN)

/* Longest formatted scope string ("sandbox:read sandbox:write ... admin"), terminator included. */
#define AUTH_SCOPES_STR_MAX 64

/* The name of the scope at index `i` (0 .. AUTH_SCOPE_COUNT-1, bit 1u << i), or NULL. */
const char *auth_scope_name(unsigned i);

/*
 * Looks one scope name up (`len` bytes, not NUL-terminated). Returns its bit, or 0 when unknown.
 */
uint32_t auth_scope_lookup(const char *name, size_t len);

/*
 * Parses a space-separated scope string (`len` bytes) such as a JWT's `scope` claim: names
 * separated by exactly one space, no leading or trailing space; "" is the empty set.
 * Returns KILN_OK, or KILN_E_INVALID naming an unknown or repeated scope or a stray space.
 */
enum kiln_err auth_scopes_parse(const char *s, size_t len, uint32_t *out,
				struct kiln_error *err);

/*
 * Parses `n` scope names (e.g. a request body's `scopes` array, converted at the HTTP edge).
 * Returns KILN_OK, or KILN_E_INVALID naming an unknown or repeated scope.
 */
enum kiln_err auth_scopes_from_names(const char *const *names, size_t n, uint32_t *out,
				     struct kiln_error *err);

/*
 * Parses a JSON document (`len` bytes) that must be an array of strings, e.g. `["sandbox:read"]`.
 * Returns KILN_OK, KILN_E_BAD_REQUEST for malformed JSON or a non-string element, or
 * KILN_E_INVALID naming an unknown or repeated scope.
 */
enum kiln_err auth_scopes_parse_json(const char *json, size_t len, uint32_t *out,
				     struct kiln_error *err);

/*
 * Writes the scopes of `mask` space-separated in the canonical order to `out`. Returns the length,
 * or -1 when `out` is too small (AUTH_SCOPES_STR_MAX always fits) or `mask` has unknown bits.
 */
int auth_scopes_format(uint32_t mask, char *out, size_t outlen);

/* Whether `have` holds every scope in `need`. */
static inline bool auth_scopes_has(uint32_t have, uint32_t need)
{
	return (have & need) == need;
}

/* Whether `sub` asks for nothing beyond `super` (a token's scopes within its key's). */
static inline bool auth_scopes_subset(uint32_t sub, uint32_t super)
{
	return (sub & ~super) == 0;
}

#endif
