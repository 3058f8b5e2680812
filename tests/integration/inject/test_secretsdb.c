/*
 * test_secretsdb.c - a sandbox's secrets and its tenant's CA in Postgres (node/secretsdb.c,
 * node/tenantca.c), against the real Postgres of the ctest fixture "services" with the real
 * migrations: the checks of a set (exact host rules, header names, limits; no message quotes a
 * value), values sealed at rest and bound to their row (moved to another sandbox, host, header or
 * tenant they do not open), a fork's copy sealed for the child, another tenant's rows never read,
 * a delete's rows gone; one CA per tenant, made once, path length 0, its key sealed.
 */
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "migrations/migrate.h"
#include "node/secretsdb.h"
#include "node/tenantca.h"
#include "test.h"
#include "testdb.h"

static struct pg *pg;
static struct auth_master_key mk, other_mk;

#define sql(...) testdb_sql(pg, __VA_ARGS__)
#define sql_int(...) testdb_sql_int(pg, __VA_ARGS__)

static struct kiln_rule rule(enum kiln_rule_kind kind, const char *host, uint16_t port)
{
	struct kiln_rule r = { .kind = kind, .port = port };

	snprintf(r.host, sizeof(r.host), "%s", host);
	return r;
}

static struct kiln_rule rules_arr[3];
static struct kiln_ruleset rules = { 3, rules_arr };
static struct kiln_config cfg;

/* Parses `json` against `rules`; the error's code (KILN_OK when it parsed) and its message. */
static enum kiln_err parse(const char *json, struct secrets_set *set, struct kiln_error *err)
{
	json_t *arr = json_loads(json, 0, NULL);
	enum kiln_err rc;

	memset(err, 0, sizeof(*err));
	rc = secrets_parse(&cfg, arr, &rules, set, err);
	json_decref(arr);
	return rc;
}

static void test_parse_checks_hosts_headers_and_limits(void)
{
	static const struct {
		const char *json;
		enum kiln_err code;
		const char *says;
	} bad[] = {
		{ "[{\"host\":\"nope.test\",\"header\":\"A\",\"value\":\"SECRETv\"}]", KILN_E_INVALID,
		  "nope.test" },
		{ "[{\"host\":\"x.wild.test\",\"header\":\"A\",\"value\":\"SECRETv\"}]", KILN_E_INVALID,
		  "x.wild.test" },
		{ "[{\"host\":\"alt.test\",\"header\":\"A\",\"value\":\"SECRETv\"}]", KILN_E_INVALID,
		  "alt.test" },
		{ "[{\"host\":\"api.test\",\"header\":\"Host\",\"value\":\"SECRETv\"}]", KILN_E_INVALID,
		  "Host" },
		{ "[{\"host\":\"api.test\",\"header\":\"transfer-encoding\",\"value\":\"SECRETv\"}]",
		  KILN_E_INVALID, "transfer-encoding" },
		{ "[{\"host\":\"api.test\",\"header\":\"A:B\",\"value\":\"SECRETv\"}]", KILN_E_INVALID,
		  "A:B" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\",\"value\":\"SECRET\\r\\nX: y\"}]",
		  KILN_E_INVALID, "CR" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\",\"value\":\"SECRET-far-too-long-value\"}]",
		  KILN_E_INVALID, "secret_value_max" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\",\"value\":\"\"}]", KILN_E_INVALID,
		  "secret_value_max" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\",\"value\":\"SECRETv\"},"
		  "{\"host\":\"api.test\",\"header\":\"a\",\"value\":\"SECRETw\"}]",
		  KILN_E_INVALID, "twice" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\",\"value\":\"SECRETv\"},"
		  "{\"host\":\"api.test\",\"header\":\"B\",\"value\":\"SECRETv\"},"
		  "{\"host\":\"api.test\",\"header\":\"C\",\"value\":\"SECRETv\"}]",
		  KILN_E_INVALID, "secrets_max" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\"}]", KILN_E_BAD_REQUEST, "secrets[0]" },
		{ "[{\"host\":\"api.test\",\"header\":\"A\",\"value\":\"v\",\"x\":1}]",
		  KILN_E_BAD_REQUEST, "secrets[0]" },
		{ "[\"api.test\"]", KILN_E_BAD_REQUEST, "secrets[0]" },
	};
	struct secrets_set set;
	struct kiln_error err;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		CHECK_INT(parse(bad[i].json, &set, &err), bad[i].code);
		if (!strstr(err.msg, bad[i].says))
			fprintf(stderr, "case %zu: \"%s\" does not say %s\n", i, err.msg, bad[i].says);
		CHECK(strstr(err.msg, bad[i].says) != NULL);
		CHECK(strstr(err.msg, "SECRET") == NULL);	/* never quotes a value */
		CHECK_INT(set.n, 0);
	}
	CHECK_INT(parse("[{\"host\":\"API.test\",\"header\":\"Authorization\",\"value\":\"SECRETv\"},"
			"{\"host\":\"api.test\",\"header\":\"X-Key\",\"value\":\"k2\"}]",
			&set, &err),
		  KILN_OK);
	CHECK_INT(set.n, 2);
	CHECK_STR(set.s[0].host, "api.test");
	CHECK_STR(set.s[0].value, "SECRETv");
	secrets_set_free(&set);
	CHECK_INT(parse("[]", &set, &err), KILN_OK);
	CHECK_INT(set.n, 0);
}

/* Stores two secrets for `sb` of tenant `tn`. */
static enum kiln_err store(const char *sb, const char *tn, const char *v1)
{
	struct inject_secret s[2] = { 0 };
	struct secrets_set set = { s, 2 };
	struct kiln_error err = { 0 };

	snprintf(s[0].host, sizeof(s[0].host), "api.test");
	snprintf(s[0].header, sizeof(s[0].header), "Authorization");
	s[0].value = (char *)v1;
	s[0].value_len = strlen(v1);
	snprintf(s[1].host, sizeof(s[1].host), "api.test");
	snprintf(s[1].header, sizeof(s[1].header), "X-Key");
	s[1].value = (char *)"k2";
	s[1].value_len = 2;
	return secretsdb_store(pg, &mk, sb, tn, &set, &err);
}

static void test_sealed_at_rest_and_bound_to_the_row(void)
{
	struct secrets_set set;
	struct kiln_error err = { 0 };

	CHECK_INT(store("sb_a", "tn_a", "Bearer SECRET-a"), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_secrets WHERE sandbox_id = 'sb_a'"), 2);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_secrets WHERE value_sealed LIKE '%%SECRET%%' "
			  "OR value_sealed NOT LIKE 'k1.%%'"), 0);
	CHECK_INT(secretsdb_load(pg, &mk, "sb_a", "tn_a", &set, &err), KILN_OK);
	CHECK_INT(set.n, 2);
	if (set.n == 2) {
		CHECK_STR(set.s[0].header, "Authorization");
		CHECK_STR(set.s[0].value, "Bearer SECRET-a");
		CHECK_STR(set.s[1].value, "k2");
	}
	secrets_set_free(&set);
	/* another tenant reads none of it */
	CHECK_INT(secretsdb_load(pg, &mk, "sb_a", "tn_b", &set, &err), KILN_OK);
	CHECK_INT(set.n, 0);
	/* another master key opens nothing */
	CHECK_INT(secretsdb_load(pg, &other_mk, "sb_a", "tn_a", &set, &err), KILN_E_INTERNAL);
	CHECK(strstr(err.msg, "SECRET") == NULL);
	/* no master key: refused, not read in clear */
	CHECK_INT(secretsdb_load(pg, NULL, "sb_a", "tn_a", &set, &err), KILN_E_NOT_IMPLEMENTED);
	/* a value moved to another header, host, sandbox or tenant does not open */
	sql("INSERT INTO sandbox_secrets SELECT 'sb_moved', tenant_id, host, header, value_sealed "
	    "FROM sandbox_secrets WHERE sandbox_id = 'sb_a' AND header = 'Authorization'");
	CHECK_INT(secretsdb_load(pg, &mk, "sb_moved", "tn_a", &set, &err), KILN_E_INTERNAL);
	sql("UPDATE sandbox_secrets SET sandbox_id = 'sb_a2' WHERE sandbox_id = 'sb_moved'");
	sql("UPDATE sandbox_secrets SET header = 'X-Other' WHERE sandbox_id = 'sb_a2'");
	CHECK_INT(secretsdb_load(pg, &mk, "sb_a2", "tn_a", &set, &err), KILN_E_INTERNAL);
	sql("UPDATE sandbox_secrets SET sandbox_id = 'sb_a', header = 'Authorization', "
	    "host = 'evil.test' WHERE sandbox_id = 'sb_a2'");
	CHECK_INT(secretsdb_load(pg, &mk, "sb_a", "tn_a", &set, &err), KILN_E_INTERNAL);
	sql("DELETE FROM sandbox_secrets WHERE host = 'evil.test'");
	sql("UPDATE sandbox_secrets SET tenant_id = 'tn_b' WHERE sandbox_id = 'sb_a'");
	CHECK_INT(secretsdb_load(pg, &mk, "sb_a", "tn_b", &set, &err), KILN_E_INTERNAL);
	sql("UPDATE sandbox_secrets SET tenant_id = 'tn_a' WHERE sandbox_id = 'sb_a'");
	CHECK_INT(secretsdb_load(pg, &mk, "sb_a", "tn_a", &set, &err), KILN_OK);
	CHECK_INT(set.n, 2);
	secrets_set_free(&set);
	/* no master key: nothing stored */
	{
		struct secrets_set none = { 0 };
		CHECK_INT(secretsdb_store(pg, NULL, "sb_c", "tn_a", &none, &err),
			  KILN_E_NOT_IMPLEMENTED);
	}
}

static void test_replace_copy_and_forget(void)
{
	struct secrets_set set, empty = { 0 };
	struct kiln_error err = { 0 };

	CHECK_INT(store("sb_p", "tn_a", "Bearer SECRET-p"), KILN_OK);
	CHECK_INT(secretsdb_copy(pg, &mk, "sb_p", "sb_kid", "tn_a", &err), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_secrets p JOIN sandbox_secrets k "
			  "ON k.sandbox_id = 'sb_kid' AND k.header = p.header "
			  "WHERE p.sandbox_id = 'sb_p' AND k.value_sealed <> p.value_sealed"), 2);
	CHECK_INT(secretsdb_load(pg, &mk, "sb_kid", "tn_a", &set, &err), KILN_OK);
	CHECK_INT(set.n, 2);
	if (set.n)
		CHECK_STR(set.s[0].value, "Bearer SECRET-p");
	secrets_set_free(&set);
	/* a copy of nothing is nothing */
	CHECK_INT(secretsdb_copy(pg, &mk, "sb_none", "sb_kid2", "tn_a", &err), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_secrets WHERE sandbox_id = 'sb_kid2'"), 0);
	/* a store replaces the whole set */
	CHECK_INT(secretsdb_store(pg, &mk, "sb_p", "tn_a", &empty, &err), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_secrets WHERE sandbox_id = 'sb_p'"), 0);
	CHECK_INT(secretsdb_forget(pg, "sb_kid", &err), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM sandbox_secrets WHERE sandbox_id = 'sb_kid'"), 0);
	{
		json_t *l = secretsdb_list_json(pg, "sb_a", "tn_a", &err);
		char *t = l ? json_dumps(l, JSON_COMPACT) : NULL;

		CHECK_STR(t, "[{\"host\":\"api.test\",\"header\":\"Authorization\"},"
			     "{\"host\":\"api.test\",\"header\":\"X-Key\"}]");
		free(t);
		json_decref(l);
	}
}

static void test_one_ca_per_tenant_path_length_zero(void)
{
	struct tenant_ca *a = NULL, *a2 = NULL, *b = NULL, *x = NULL;
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);

	CHECK_INT(tenantca_load(c, &mk, "tn_a", &a, &err), KILN_OK);
	CHECK_INT(tenantca_load(c, &mk, "tn_a", &a2, &err), KILN_OK);
	CHECK_INT(tenantca_load(c, &mk, "tn_b", &b, &err), KILN_OK);
	CHECK_INT(sql_int("SELECT count(*) FROM tenant_ca"), 2);
	CHECK_INT(sql_int("SELECT count(*) FROM tenant_ca WHERE key_sealed NOT LIKE 'k1.%%' "
			  "OR key_sealed LIKE '%%PRIVATE%%'"), 0);
	if (a && a2 && b) {
		BIO *bio = BIO_new_mem_buf(tenantca_cert_pem(a), -1);
		X509 *cert = PEM_read_bio_X509(bio, NULL, NULL, NULL);

		CHECK_STR(tenantca_cert_pem(a), tenantca_cert_pem(a2));
		CHECK(strcmp(tenantca_cert_pem(a), tenantca_cert_pem(b)) != 0);
		CHECK(strstr(tenantca_cert_pem(a), "PRIVATE") == NULL);
		CHECK(cert != NULL);
		if (cert) {
			CHECK_INT(X509_check_ca(cert), 1);
			CHECK_INT(X509_get_pathlen(cert), 0);
			CHECK(X509_get_key_usage(cert) == (KU_KEY_CERT_SIGN | KU_CRL_SIGN));
		}
		X509_free(cert);
		BIO_free(bio);
		{	/* leaves: one per host, cached */
			SSL_CTX *l1 = tenantca_leaf_ctx(a, "api.test", &err);
			SSL_CTX *l2 = tenantca_leaf_ctx(a, "api.test", &err);
			SSL_CTX *bad = tenantca_leaf_ctx(a, "a.test,DNS:b.test", &err);

			CHECK(l1 != NULL && l1 == l2);
			CHECK(bad == NULL);
			SSL_CTX_free(l1);
			SSL_CTX_free(l2);
		}
	}
	/* another master key does not open the stored key */
	CHECK_INT(tenantca_load(c, &other_mk, "tn_a", &x, &err), KILN_E_INTERNAL);
	CHECK(x == NULL);
	pg_release(pg, c);
	tenantca_put(a);
	tenantca_put(a2);
	tenantca_put(b);
}

int main(void)
{
	struct testdb db;
	struct kiln_error err = { 0 };
	int rc;

	log_init("test_secretsdb", KLOG_WARN, false);
	if (testdb_open(&db, "secrets") != 0)
		return 1;
	pg = db.pg;
	if (auth_master_key_generate(&mk, &err) != KILN_OK ||
	    auth_master_key_generate(&other_mk, &err) != KILN_OK)
		return 1;
	rules_arr[0] = rule(KILN_RULE_HOST, "api.test", 0);
	rules_arr[1] = rule(KILN_RULE_WILDCARD, "wild.test", 0);
	rules_arr[2] = rule(KILN_RULE_HOST, "alt.test", 8443);
	cfg.secrets_max = 2;
	cfg.secret_value_max = 16;
	sql("INSERT INTO tenants (id, name) VALUES ('tn_a', 'a'), ('tn_b', 'b')");

	TEST(test_parse_checks_hosts_headers_and_limits);
	TEST(test_sealed_at_rest_and_bound_to_the_row);
	TEST(test_replace_copy_and_forget);
	TEST(test_one_ca_per_tenant_path_length_zero);
	rc = test_summary();
	testdb_close(&db);
	return rc;
}
