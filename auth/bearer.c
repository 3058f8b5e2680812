/*
 * bearer.c - strict parsing of `Authorization: Bearer <credential>` (see bearer.h).
 */
#include "auth/bearer.h"

#include <string.h>
#include <strings.h>

#include "auth/apikey.h"
#include "auth/encode.h"

static bool looks_like_jwt(const char *s, size_t n)
{
	int dots = 0;
	size_t start = 0;

	for (size_t i = 0; i <= n; i++) {
		if (i < n && s[i] != '.')
			continue;
		if (i == start || !auth_is_b64url(s + start, i - start))
			return false;
		if (i < n)
			dots++;
		start = i + 1;
	}
	return dots == 2;
}

enum kiln_err auth_bearer_parse(const char *header, size_t len, struct auth_credential *out,
				struct kiln_error *err)
{
	static const char scheme[] = "Bearer ";
	const size_t sl = sizeof(scheme) - 1;
	const char *cred;
	size_t n;

	out->kind = 0;
	out->value = NULL;
	out->len = 0;
	if (!header || len == 0)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "missing credential");
	if (len > AUTH_HEADER_MAX)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "authorization header too long");
	if (len <= sl || strncasecmp(header, scheme, sl - 1) != 0 || header[sl - 1] != ' ')
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED,
				      "authorization must be 'Bearer <credential>'");
	cred = header + sl;
	n = len - sl;
	for (size_t i = 0; i < n; i++)
		if (cred[i] <= 0x20 || cred[i] >= 0x7f)
			return kiln_error_set(err, KILN_E_UNAUTHENTICATED,
					      "malformed credential in authorization header");
	if (n >= 8 && memcmp(cred, AUTH_APIKEY_PREFIX, 8) == 0) {
		if (n != AUTH_APIKEY_LEN)
			return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "malformed api key");
		out->kind = AUTH_CRED_API_KEY;
	} else if (looks_like_jwt(cred, n)) {
		out->kind = AUTH_CRED_JWT;
	} else {
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "unrecognized credential");
	}
	out->value = cred;
	out->len = n;
	return KILN_OK;
}
