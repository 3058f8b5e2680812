/*
 * secretsdb.c - a sandbox's secrets in Postgres (see secretsdb.h).
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "node/secretsdb.h"

static enum kiln_err no_key(struct kiln_error *err)
{
	return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED,
			      "secrets need a master key on the sandbox's node");
}

void secrets_set_free(struct secrets_set *set)
{
	if (!set)
		return;
	inject_secrets_wipe(set->s, set->n);
	free(set->s);
	set->s = NULL;
	set->n = 0;
}

static bool host_rule(const struct kiln_ruleset *rules, const char *host)
{
	for (size_t i = 0; rules && i < rules->n; i++)
		if (rules->rules[i].kind == KILN_RULE_HOST &&
		    (rules->rules[i].port == 0 || rules->rules[i].port == 443) &&
		    strcmp(rules->rules[i].host, host) == 0)
			return true;
	return false;
}

enum kiln_err secrets_parse(const struct kiln_config *cfg, const json_t *arr,
			    const struct kiln_ruleset *rules, struct secrets_set *out,
			    struct kiln_error *err)
{
	size_t n = json_is_array(arr) ? json_array_size(arr) : 0;
	enum kiln_err rc = KILN_OK;

	memset(out, 0, sizeof(*out));
	if (arr && !json_is_null(arr) && !json_is_array(arr))
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "secrets must be an array");
	if ((long long)n > cfg->secrets_max)
		return kiln_error_set(err, KILN_E_INVALID,
				      "a sandbox holds at most %lld secrets (secrets_max)",
				      cfg->secrets_max);
	if (!n)
		return KILN_OK;
	out->s = calloc(n, sizeof(*out->s));
	if (!out->s)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (size_t i = 0; i < n && rc == KILN_OK; i++) {
		json_t *o = json_array_get(arr, i), *h, *hd, *v;
		struct inject_secret *s = &out->s[i];
		const char *host, *header, *value;
		size_t vlen;

		if (!json_is_object(o) || json_object_size(o) != 3 ||
		    !json_is_string(h = json_object_get(o, "host")) ||
		    !json_is_string(hd = json_object_get(o, "header")) ||
		    !json_is_string(v = json_object_get(o, "value"))) {
			rc = kiln_error_set(err, KILN_E_BAD_REQUEST,
					    "secrets[%zu] must be {\"host\", \"header\", \"value\"} "
					    "strings and nothing else", i);
			break;
		}
		host = json_string_value(h);
		header = json_string_value(hd);
		value = json_string_value(v);
		vlen = json_string_length(v);
		if (strlen(host) > TENANTCA_HOST_MAX) {
			rc = kiln_error_set(err, KILN_E_INVALID, "secrets[%zu]: host too long", i);
			break;
		}
		for (size_t k = 0; k <= strlen(host); k++)
			s->host[k] = (char)tolower((unsigned char)host[k]);
		if (!host_rule(rules, s->host)) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "secrets[%zu]: host \"%.253s\" is not an exact host rule "
					    "of the sandbox's egress (for port 443)", i, s->host);
			break;
		}
		if (!inject_header_ok(header)) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "secrets[%zu]: header \"%.64s\" is not a header name a "
					    "secret may set (token characters; not Host, "
					    "Content-Length, Transfer-Encoding, Connection...)", i, header);
			break;
		}
		snprintf(s->header, sizeof(s->header), "%s", header);
		if (vlen == 0 || (long long)vlen > cfg->secret_value_max ||
		    memchr(value, '\r', vlen) || memchr(value, '\n', vlen) || memchr(value, '\0', vlen)) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "secrets[%zu]: the value must be 1 to %lld bytes "
					    "(secret_value_max) without CR, LF or NUL", i,
					    cfg->secret_value_max);
			break;
		}
		for (size_t j = 0; j < i; j++)
			if (strcmp(out->s[j].host, s->host) == 0 &&
			    strcasecmp(out->s[j].header, s->header) == 0) {
				rc = kiln_error_set(err, KILN_E_INVALID,
						    "secrets[%zu]: host \"%s\" has header \"%s\" twice",
						    i, s->host, s->header);
				break;
			}
		if (rc != KILN_OK)
			break;
		s->value = malloc(vlen + 1);
		if (!s->value) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			break;
		}
		memcpy(s->value, value, vlen + 1);
		s->value_len = vlen;
		out->n = i + 1;
	}
	if (rc != KILN_OK) {
		out->n = n;	/* every slot: the unfilled ones hold NULL values */
		secrets_set_free(out);
	}
	return rc;
}

/* The associated data of one sealed value. */
static int secret_ad(char *out, size_t len, const char *tenant, const char *sandbox,
		     const char *host, const char *header)
{
	int k = snprintf(out, len, "%s%s:%s:%s:%s", SECRETS_AD_PREFIX, tenant, sandbox, host, header);

	return k < 0 || (size_t)k >= len ? -1 : k;
}

enum kiln_err secretsdb_store(struct pg *pg, const struct auth_master_key *mk, const char *sandbox_id,
			      const char *tenant_id, const struct secrets_set *set,
			      struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	enum kiln_err rc = mk ? KILN_OK : no_key(err);
	bool begun = false;

	if (rc == KILN_OK)
		rc = pg_acquire(pg, &c, err);
	if (rc == KILN_OK)
		rc = pg_exec(c, "BEGIN", err);
	begun = rc == KILN_OK;
	if (rc == KILN_OK)
		rc = PGQ(c, NULL, err, "DELETE FROM sandbox_secrets WHERE sandbox_id = $1", sandbox_id);
	for (size_t i = 0; rc == KILN_OK && i < set->n; i++) {
		char ad[700], *sealed = NULL;
		int adlen = secret_ad(ad, sizeof(ad), tenant_id, sandbox_id, set->s[i].host,
				      set->s[i].header);

		if (adlen < 0) {
			rc = kiln_error_set(err, KILN_E_INVALID, "id too long");
			break;
		}
		rc = auth_seal(mk, set->s[i].value, set->s[i].value_len, ad, (size_t)adlen,
			       &sealed, err);
		if (rc == KILN_OK)
			rc = PGQ(c, NULL, err,
				 "INSERT INTO sandbox_secrets (sandbox_id, tenant_id, host, header, "
				 "value_sealed) VALUES ($1, $2, $3, $4, $5)",
				 sandbox_id, tenant_id, set->s[i].host, set->s[i].header, sealed);
		free(sealed);
	}
	if (begun) {
		struct kiln_error e2 = { 0 };
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		else
			pg_exec(c, "ROLLBACK", &e2);
	}
	if (c)
		pg_release(pg, c);
	return rc;
}

enum kiln_err secretsdb_load(struct pg *pg, const struct auth_master_key *mk, const char *sandbox_id,
			     const char *tenant_id, struct secrets_set *out, struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	struct pg_res *res = NULL;
	enum kiln_err rc;
	int rows;

	memset(out, 0, sizeof(*out));
	rc = pg_acquire(pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT host, header, value_sealed FROM sandbox_secrets "
		 "WHERE sandbox_id = $1 AND tenant_id = $2 ORDER BY host, header",
		 sandbox_id, tenant_id);
	pg_release(pg, c);
	if (rc != KILN_OK)
		return rc;
	rows = pg_res_rows(res);
	if (rows > 0 && !mk) {
		pg_res_free(res);
		return no_key(err);
	}
	if (rows > 0 && !(out->s = calloc((size_t)rows, sizeof(*out->s)))) {
		pg_res_free(res);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	for (int i = 0; i < rows && rc == KILN_OK; i++) {
		struct inject_secret *s = &out->s[i];
		const char *sealed = pg_res_str(res, i, 2);
		unsigned char *pt = NULL;
		size_t ptlen = 0;
		char ad[700];
		int adlen;

		snprintf(s->host, sizeof(s->host), "%s", pg_res_str(res, i, 0));
		snprintf(s->header, sizeof(s->header), "%s", pg_res_str(res, i, 1));
		adlen = secret_ad(ad, sizeof(ad), tenant_id, sandbox_id, s->host, s->header);
		if (adlen < 0 ||
		    auth_open(mk, sealed, strlen(sealed), ad, (size_t)adlen, &pt, &ptlen, err) !=
			    KILN_OK) {
			rc = kiln_error_set(err, KILN_E_INTERNAL,
					    "a secret of sandbox \"%s\" does not open with this "
					    "master key", sandbox_id);
			break;
		}
		s->value = (char *)pt;
		s->value_len = ptlen;
		out->n = (size_t)i + 1;
	}
	pg_res_free(res);
	if (rc != KILN_OK)
		secrets_set_free(out);
	return rc;
}

enum kiln_err secretsdb_copy(struct pg *pg, const struct auth_master_key *mk, const char *parent_id,
			     const char *child_id, const char *tenant_id, struct kiln_error *err)
{
	struct secrets_set set;
	enum kiln_err rc = secretsdb_load(pg, mk, parent_id, tenant_id, &set, err);

	if (rc == KILN_OK && set.n)
		rc = secretsdb_store(pg, mk, child_id, tenant_id, &set, err);
	secrets_set_free(&set);
	return rc;
}

enum kiln_err secretsdb_forget(struct pg *pg, const char *sandbox_id, struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	enum kiln_err rc = pg_acquire(pg, &c, err);

	if (rc == KILN_OK) {
		rc = PGQ(c, NULL, err, "DELETE FROM sandbox_secrets WHERE sandbox_id = $1", sandbox_id);
		pg_release(pg, c);
	}
	return rc;
}

json_t *secretsdb_list_json(struct pg *pg, const char *sandbox_id, const char *tenant_id,
			    struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	struct pg_res *res = NULL;
	json_t *arr;

	if (pg_acquire(pg, &c, err) != KILN_OK)
		return NULL;
	if (PGQ(c, &res, err,
		"SELECT host, header FROM sandbox_secrets WHERE sandbox_id = $1 AND tenant_id = $2 "
		"ORDER BY host, header", sandbox_id, tenant_id) != KILN_OK) {
		pg_release(pg, c);
		return NULL;
	}
	pg_release(pg, c);
	arr = json_array();
	for (int i = 0; arr && i < pg_res_rows(res); i++)
		json_array_append_new(arr, json_pack("{s:s, s:s}", "host", pg_res_str(res, i, 0),
						     "header", pg_res_str(res, i, 1)));
	pg_res_free(res);
	return arr;
}

