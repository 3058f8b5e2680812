/*
 * bearer.h - reading an `Authorization` header value.
 *
 * The only accepted form is `Bearer <credential>`: the scheme (case-insensitive, as RFC 7235
 * says), exactly one space, and a credential of visible ASCII with nothing after it. The
 * credential is an API key when it starts with `kiln_sk_`, a JWT when it is three base64url parts;
 * anything else is refused. The caller then checks it with auth_apikey_parse or auth_jwt_verify.
 */
#ifndef KILN_AUTH_BEARER_H
#define KILN_AUTH_BEARER_H

#include <stddef.h>

#include "auth/jwt.h"
#include "common/err.h"

#define AUTH_HEADER_MAX (7 + AUTH_JWT_MAX)	/* bytes of an Authorization value */

enum auth_cred_kind {
	AUTH_CRED_API_KEY = 1,
	AUTH_CRED_JWT,
};

struct auth_credential {
	enum auth_cred_kind kind;
	const char *value;	/* points into the header passed in; not NUL-terminated */
	size_t len;		/* bytes */
};

/*
 * Parses `header` (`len` bytes; NULL when the request had none). Returns KILN_OK, or
 * KILN_E_UNAUTHENTICATED for a missing, oversized or malformed value (the message never quotes it).
 */
enum kiln_err auth_bearer_parse(const char *header, size_t len, struct auth_credential *out,
				struct kiln_error *err);

#endif
