/*
 * test_scopes.c - scope sets: strict parsing of strings and JSON arrays, formatting, subsets.
 */
#include <string.h>

#include "auth/scopes.h"
#include "test.h"

static void parses_space_separated_scopes(void)
{
	uint32_t m = 99;
	char out[AUTH_SCOPES_STR_MAX];
	const char *s = "sandbox:write sandbox:read";

	CHECK_INT(auth_scopes_parse(s, strlen(s), &m, NULL), KILN_OK);
	CHECK_INT(m, AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_SANDBOX_WRITE);
	CHECK_INT(auth_scopes_format(m, out, sizeof(out)), strlen("sandbox:read sandbox:write"));
	CHECK_STR(out, "sandbox:read sandbox:write");
	CHECK_INT(auth_scopes_parse("", 0, &m, NULL), KILN_OK);
	CHECK_INT(m, 0);
	s = "admin";
	CHECK_INT(auth_scopes_parse(s, strlen(s), &m, NULL), KILN_OK);
	CHECK_INT(m, AUTH_SCOPE_ADMIN);
}

static void refuses_unknown_duplicate_and_stray_spaces(void)
{
	static const char *const bad[] = {
		"sandbox:delete", "Admin", "sandbox:read sandbox:read", " admin", "admin ",
		"admin  billing:read", "admin\tbilling:read", "sandbox:", " ",
	};
	struct kiln_error err = { 0 };
	uint32_t m = 0;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		m = 7;
		CHECK_INT(auth_scopes_parse(bad[i], strlen(bad[i]), &m, NULL), KILN_E_INVALID);
		CHECK_INT(m, 0);
	}
	CHECK_INT(auth_scopes_parse("keys:write sandbox:delete", 25, &m, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "unknown scope 'sandbox:delete'") != NULL);
	kiln_error_clear(&err);
	CHECK_INT(auth_scopes_parse("admin admin", 11, &m, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "duplicate scope 'admin'") != NULL);
}

static void parses_json_arrays_strictly(void)
{
	struct kiln_error err = { 0 };
	uint32_t m = 0;
	const char *j;

	j = "[\"billing:read\", \"keys:write\"]";
	CHECK_INT(auth_scopes_parse_json(j, strlen(j), &m, NULL), KILN_OK);
	CHECK_INT(m, AUTH_SCOPE_BILLING_READ | AUTH_SCOPE_KEYS_WRITE);
	CHECK_INT(auth_scopes_parse_json("[]", 2, &m, NULL), KILN_OK);
	CHECK_INT(m, 0);
	CHECK_INT(auth_scopes_parse_json("\"admin\"", 7, &m, NULL), KILN_E_BAD_REQUEST);
	CHECK_INT(auth_scopes_parse_json("[1]", 3, &m, NULL), KILN_E_BAD_REQUEST);
	CHECK_INT(auth_scopes_parse_json("[null]", 6, &m, NULL), KILN_E_BAD_REQUEST);
	CHECK_INT(auth_scopes_parse_json("[\"admin\"", 8, &m, NULL), KILN_E_BAD_REQUEST);
	CHECK_INT(auth_scopes_parse_json("{}", 2, &m, NULL), KILN_E_BAD_REQUEST);
	j = "[\"admin\",\"admin\"]";
	CHECK_INT(auth_scopes_parse_json(j, strlen(j), &m, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "duplicate scope 'admin'") != NULL);
	j = "[\"sandbox:read\",\"root\"]";
	kiln_error_clear(&err);
	CHECK_INT(auth_scopes_parse_json(j, strlen(j), &m, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "unknown scope 'root'") != NULL);
	j = "[\"admin\\u0000x\"]";
	CHECK(auth_scopes_parse_json(j, strlen(j), &m, NULL) != KILN_OK);
}

static void from_names_checks_each(void)
{
	const char *good[] = { "keys:write", "sandbox:read" };
	const char *dup[] = { "keys:write", "keys:write" };
	const char *unk[] = { "keys:read" };
	uint32_t m = 0;

	CHECK_INT(auth_scopes_from_names(good, 2, &m, NULL), KILN_OK);
	CHECK_INT(m, AUTH_SCOPE_KEYS_WRITE | AUTH_SCOPE_SANDBOX_READ);
	CHECK_INT(auth_scopes_from_names(dup, 2, &m, NULL), KILN_E_INVALID);
	CHECK_INT(auth_scopes_from_names(unk, 1, &m, NULL), KILN_E_INVALID);
	CHECK_INT(auth_scopes_from_names(NULL, 0, &m, NULL), KILN_OK);
	CHECK_INT(m, 0);
}

static void formats_canonically_and_checks_bounds(void)
{
	char out[AUTH_SCOPES_STR_MAX];
	uint32_t m = 0;

	CHECK(auth_scopes_format(AUTH_SCOPES_ALL, out, sizeof(out)) > 0);
	CHECK_STR(out, "sandbox:read sandbox:write billing:read keys:write admin");
	CHECK_INT(auth_scopes_parse(out, strlen(out), &m, NULL), KILN_OK);
	CHECK_INT(m, AUTH_SCOPES_ALL);
	CHECK_INT(auth_scopes_format(0, out, sizeof(out)), 0);
	CHECK_STR(out, "");
	CHECK_INT(auth_scopes_format(1u << 9, out, sizeof(out)), -1);
	CHECK_INT(auth_scopes_format(AUTH_SCOPES_ALL, out, 10), -1);
	CHECK_STR(auth_scope_name(4), "admin");
	CHECK(auth_scope_name(AUTH_SCOPE_COUNT) == NULL);
}

static void subset_and_has(void)
{
	CHECK(auth_scopes_has(AUTH_SCOPES_TENANT, AUTH_SCOPE_SANDBOX_WRITE));
	CHECK(!auth_scopes_has(AUTH_SCOPES_TENANT, AUTH_SCOPE_ADMIN));
	CHECK(!auth_scopes_has(AUTH_SCOPE_SANDBOX_READ, AUTH_SCOPE_SANDBOX_READ |
							 AUTH_SCOPE_SANDBOX_WRITE));
	CHECK(auth_scopes_subset(AUTH_SCOPE_SANDBOX_READ, AUTH_SCOPES_TENANT));
	CHECK(auth_scopes_subset(0, 0));
	CHECK(!auth_scopes_subset(AUTH_SCOPE_ADMIN, AUTH_SCOPES_TENANT));
}

int main(void)
{
	TEST(parses_space_separated_scopes);
	TEST(refuses_unknown_duplicate_and_stray_spaces);
	TEST(parses_json_arrays_strictly);
	TEST(from_names_checks_each);
	TEST(formats_canonically_and_checks_bounds);
	TEST(subset_and_has);
	return test_summary();
}
