/*
 * scopes.c - parsing and formatting scope sets (see scopes.h).
 */
#include "auth/scopes.h"

#include <string.h>

#include <jansson.h>

#define SCOPES_JSON_MAX 4096	/* bytes of a JSON scope array */
#define SCOPE_NAME_SHOW 32	/* bytes of a bad name quoted in an error */

static const char *const scope_names[AUTH_SCOPE_COUNT] = {
	"sandbox:read", "sandbox:write", "billing:read", "keys:write", "admin",
};

const char *auth_scope_name(unsigned i)
{
	return i < AUTH_SCOPE_COUNT ? scope_names[i] : NULL;
}

uint32_t auth_scope_lookup(const char *name, size_t len)
{
	for (unsigned i = 0; i < AUTH_SCOPE_COUNT; i++)
		if (strlen(scope_names[i]) == len && memcmp(scope_names[i], name, len) == 0)
			return 1u << i;
	return 0;
}

/* Quotes at most SCOPE_NAME_SHOW printable bytes of a rejected name into the error. */
static enum kiln_err bad_name(struct kiln_error *err, const char *what, const char *name,
			      size_t len)
{
	char shown[SCOPE_NAME_SHOW + 1];
	size_t n = len < SCOPE_NAME_SHOW ? len : SCOPE_NAME_SHOW;

	for (size_t i = 0; i < n; i++)
		shown[i] = (name[i] >= 0x20 && name[i] < 0x7f) ? name[i] : '?';
	shown[n] = '\0';
	return kiln_error_set(err, KILN_E_INVALID, "%s scope '%s%s'", what, shown,
			      len > n ? "..." : "");
}

static enum kiln_err add_one(uint32_t *mask, const char *name, size_t len,
			     struct kiln_error *err)
{
	uint32_t bit = auth_scope_lookup(name, len);

	if (!bit)
		return bad_name(err, "unknown", name, len);
	if (*mask & bit)
		return bad_name(err, "duplicate", name, len);
	*mask |= bit;
	return KILN_OK;
}

enum kiln_err auth_scopes_parse(const char *s, size_t len, uint32_t *out,
				struct kiln_error *err)
{
	uint32_t mask = 0;
	size_t start = 0;

	*out = 0;
	if (len == 0)
		return KILN_OK;
	if (!s || len >= SCOPES_JSON_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "scope string too long");
	for (size_t i = 0; i <= len; i++) {
		if (i < len && s[i] != ' ')
			continue;
		if (i == start)
			return kiln_error_set(err, KILN_E_INVALID, "stray space in scopes");
		if (add_one(&mask, s + start, i - start, err) != KILN_OK)
			return KILN_E_INVALID;
		start = i + 1;
	}
	*out = mask;
	return KILN_OK;
}

enum kiln_err auth_scopes_from_names(const char *const *names, size_t n, uint32_t *out,
				     struct kiln_error *err)
{
	uint32_t mask = 0;

	*out = 0;
	for (size_t i = 0; i < n; i++) {
		if (!names[i])
			return kiln_error_set(err, KILN_E_INVALID, "missing scope name");
		if (add_one(&mask, names[i], strnlen(names[i], SCOPES_JSON_MAX), err) != KILN_OK)
			return KILN_E_INVALID;
	}
	*out = mask;
	return KILN_OK;
}

enum kiln_err auth_scopes_parse_json(const char *json, size_t len, uint32_t *out,
				     struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;
	uint32_t mask = 0;
	json_error_t jerr;
	json_t *arr, *v;
	size_t i;

	*out = 0;
	if (!json || len > SCOPES_JSON_MAX)
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "scopes: too long");
	arr = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!arr)
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "scopes: malformed JSON");
	if (!json_is_array(arr)) {
		rc = kiln_error_set(err, KILN_E_BAD_REQUEST, "scopes: must be an array of strings");
		goto cleanup;
	}
	json_array_foreach(arr, i, v) {
		if (!json_is_string(v)) {
			rc = kiln_error_set(err, KILN_E_BAD_REQUEST,
					    "scopes: element %zu is not a string", i);
			goto cleanup;
		}
		rc = add_one(&mask, json_string_value(v), json_string_length(v), err);
		if (rc != KILN_OK)
			goto cleanup;
	}
	*out = mask;
cleanup:
	json_decref(arr);
	return rc;
}

int auth_scopes_format(uint32_t mask, char *out, size_t outlen)
{
	size_t o = 0;

	if (outlen == 0)
		return -1;
	out[0] = '\0';
	if (mask & ~AUTH_SCOPES_ALL)
		return -1;
	for (unsigned i = 0; i < AUTH_SCOPE_COUNT; i++) {
		size_t n = strlen(scope_names[i]);

		if (!(mask & (1u << i)))
			continue;
		if (o + (o ? 1 : 0) + n + 1 > outlen) {
			out[0] = '\0';
			return -1;
		}
		if (o)
			out[o++] = ' ';
		memcpy(out + o, scope_names[i], n);
		o += n;
		out[o] = '\0';
	}
	return (int)o;
}
