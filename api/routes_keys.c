/*
 * routes_keys.c - API keys and tokens: POST/GET /v1/api-keys, DELETE /v1/api-keys/{id},
 * POST /v1/tokens, GET /v1/.well-known/jwks.json.
 */
#include <openssl/crypto.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/log.h"

bool gw_valid_name(struct http_req *req, const char *field, const char *name)
{
	struct kiln_error err = { 0 };

	if (apireq_name(field, name, &err) == KILN_OK)
		return true;
	http_reply_error(req, err.code, "%s", err.msg);
	return false;
}

/* Checks that `expires_at` is a valid time in the future (Postgres decides). */
static bool valid_expiry(struct http_req *req, struct pg_conn *c, const char *expires_at)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	bool ok;

	if (!gw_is_rfc3339(expires_at)) {
		http_reply_error(req, KILN_E_INVALID, "expires_at must be an RFC 3339 time");
		return false;
	}
	if (PGQ(c, &res, &err, "SELECT $1::timestamptz > now()", expires_at) != KILN_OK) {
		http_reply_error(req, KILN_E_INVALID, "expires_at is not a valid time");
		return false;
	}
	ok = pg_res_bool(res, 0, 0);
	pg_res_free(res);
	if (!ok)
		http_reply_error(req, KILN_E_INVALID, "expires_at must be in the future");
	return ok;
}

json_t *gw_key_create(struct pg_conn *c, const char *tenant_id, const char *name, uint32_t scopes,
		      const char *expires_at, struct kiln_error *err)
{
	struct auth_apikey_new k;
	struct pg_res *res = NULL;
	char scope_text[AUTH_SCOPES_STR_MAX];
	json_t *out = NULL, *arr;

	if (auth_apikey_generate(gw_pepper, sizeof(gw_pepper), &k, err) != KILN_OK)
		return NULL;
	auth_scopes_format(scopes, scope_text, sizeof(scope_text));
	if (PGQ(c, &res, err,
		"INSERT INTO api_keys (id, tenant_id, name, prefix, secret_hash, scopes, expires_at) "
		"VALUES ($1, $2, $3, $4, $5, $6, $7::timestamptz) RETURNING rfc3339(created_at)",
		k.key_id, tenant_id, name, k.prefix, k.hash, scope_text, expires_at) == KILN_OK) {
		arr = json_array();
		for (unsigned i = 0; i < AUTH_SCOPE_COUNT; i++)
			if (scopes & (1u << i))
				json_array_append_new(arr, json_string(auth_scope_name(i)));
		out = json_pack("{s:s, s:s, s:s, s:s, s:o, s:s, s:o}", "id", k.key_id, "key", k.key,
				"name", name, "prefix", k.prefix, "scopes", arr, "created_at",
				pg_res_str(res, 0, 0), "expires_at",
				expires_at ? json_string(expires_at) : json_null());
	}
	pg_res_free(res);
	OPENSSL_cleanse(&k, sizeof(k));
	return out;
}

static json_t *scopes_json(const char *text)
{
	json_t *arr = json_array();
	const char *p = text;

	while (*p) {
		size_t n = strcspn(p, " ");
		if (n)
			json_array_append_new(arr, json_stringn(p, n));
		p += n;
		while (*p == ' ')
			p++;
	}
	return arr;
}

static void keys_create(struct http_req *req)
{
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct apireq_key k;
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	json_t *out;
	struct pg_conn *c = NULL;
	const char *name, *expires;
	uint32_t scopes;

	if (apireq_key(btext, blen, &k, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		goto out;
	}
	name = k.name;
	expires = k.expires_at;
	scopes = k.scopes;
	if (!auth_scopes_subset(scopes, who->scopes)) {
		http_reply_error(req, KILN_E_FORBIDDEN,
				 "a key cannot have scopes its creator does not have");
		goto out;
	}
	c = gw_db(req);
	if (!c)
		goto out;
	if (expires && !valid_expiry(req, c, expires))
		goto out;
	/* In a transaction of its own, though one statement: a COMMIT whose answer a Postgres
	 * switch loses is resolved on the new primary (pg_exec), where a lone statement's lost
	 * answer would read as a failure and the client's retry would make a second key. */
	out = pg_exec(c, "BEGIN", &err) == KILN_OK ?
		      gw_key_create(c, who->tenant_id, name, scopes, expires, &err) : NULL;
	if (out && pg_exec(c, "COMMIT", &err) != KILN_OK) {
		json_decref(out);
		out = NULL;	/* pg_release rolls back */
	}
	if (!out) {
		gw_fail(req, err.code ? err.code : KILN_E_INTERNAL, &err);
		goto out;
	}
	http_req_set_object(req, json_str(out, "id", NULL));
	json_object_del(out, "name");
	http_reply_json(req, 201, out);
out:
	if (c)
		pg_release(((struct gateway *)http_req_app(req))->pg, c);
	json_decref(k.body);
}

static void keys_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct pg_conn *c = gw_db(req);
	struct pg_res *res = NULL;
	json_t *arr;
	enum kiln_err rc;

	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT id, name, prefix, scopes, rfc3339(created_at), rfc3339(last_used_at), "
		 "rfc3339(revoked_at), rfc3339(expires_at) FROM api_keys WHERE tenant_id = $1 "
		 "ORDER BY created_at DESC, id LIMIT 1000",
		 who->tenant_id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	arr = json_array();
	for (int i = 0; i < pg_res_rows(res); i++)
		json_array_append_new(
			arr, json_pack("{s:s, s:s, s:s, s:o, s:o, s:o, s:o, s:o}", "id",
				       pg_res_str(res, i, 0), "name", pg_res_str(res, i, 1), "prefix",
				       pg_res_str(res, i, 2), "scopes", scopes_json(pg_res_str(res, i, 3)),
				       "created_at", gw_time(pg_res_get(res, i, 4)), "last_used_at",
				       gw_time(pg_res_get(res, i, 5)), "revoked_at",
				       gw_time(pg_res_get(res, i, 6)), "expires_at",
				       gw_time(pg_res_get(res, i, 7))));
	pg_res_free(res);
	http_reply_json(req, 200, json_pack("{s:o}", "api_keys", arr));
}

static void keys_delete(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_conn *c = gw_db(req);
	struct pg_res *res = NULL;
	enum kiln_err rc;

	if (!c)
		return;
	http_req_set_object(req, id);
	rc = PGQ(c, &res, &err,
		 "UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) "
		 "WHERE id = $1 AND tenant_id = $2 RETURNING id",
		 id, who->tenant_id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
	} else if (pg_res_rows(res) == 0) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no API key \"%s\"", id);
	} else {
		gw_key_cache_forget(id);
		log_info("revoked API key \"%s\"", id);
		http_reply_empty(req, 204);
	}
	pg_res_free(res);
}

static void tokens_create(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	struct auth_token_params p = { 0 };
	struct auth_claims claims;
	char *token = NULL, exp[32];
	uint32_t scopes = who ? who->scopes : 0, asked = 0;
	bool has_scopes;
	const struct gw_key_row *row;
	struct gw_key_row kr = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	long long ttl;
	time_t e, now;
	struct tm tm;
	enum kiln_err rc;

	if (apireq_token(btext, blen, &ttl, &asked, &has_scopes, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		goto out;
	}
	if (has_scopes) {
		scopes = asked;
		if (!auth_scopes_subset(scopes, who->scopes)) {
			http_reply_error(req, KILN_E_FORBIDDEN,
					 "a token cannot carry scopes its key does not have");
			goto out;
		}
		/* docs/auth.md: a token with narrower scopes than its key's takes keys:write. */
		if (scopes != who->scopes && !auth_scopes_has(who->scopes, AUTH_SCOPE_KEYS_WRITE)) {
			http_reply_error(req, KILN_E_FORBIDDEN,
					 "a token with narrower scopes needs the scope \"keys:write\"");
			goto out;
		}
	}
	/*
	 * A token must not outlive its key: exp is capped at the key's expires_at, rounded down to
	 * the second. The row is read from Postgres rather than trusted from the key cache (up to
	 * 5 s old), so a key revoked or expired on another gateway mints nothing either: by the
	 * claim of the request's Idempotency-Key, in the same statement (gw_key_row), or here.
	 */
	if ((row = gw_key_row(req))) {
		kr = *row;
	} else {
		c = gw_db(req);
		if (!c)
			goto out;
		rc = PGQ(c, &res, &err,
			 "SELECT revoked_at IS NULL, floor(extract(epoch FROM expires_at))::bigint "
			 "FROM api_keys WHERE id = $1 AND tenant_id = $2",
			 who->key_id, who->tenant_id);
		pg_release(gw->pg, c);
		if (rc != KILN_OK) {
			gw_fail(req, rc, &err);
			goto out;
		}
		kr.exists = pg_res_rows(res) == 1;
		kr.live = kr.exists && pg_res_bool(res, 0, 0);
		kr.expires = kr.exists && pg_res_get(res, 0, 1) != NULL;
		kr.expires_s = kr.exists ? pg_res_int(res, 0, 1, 0) : 0;
	}
	now = time(NULL);
	if (!kr.live) {
		http_reply_error(req, KILN_E_UNAUTHENTICATED, "the API key was revoked");
		goto out;
	}
	if (kr.expires && kr.expires_s - (long long)now < ttl)
		ttl = kr.expires_s - (long long)now;
	if (ttl < 1) {
		http_reply_error(req, KILN_E_UNAUTHENTICATED, "the API key has expired");
		goto out;
	}
	p.iss = GW_ISSUER;
	p.aud = AUTH_AUD_API;
	p.sub = who->key_id;
	p.tid = who->tenant_id;
	p.scopes = scopes;
	p.now = now;
	p.ttl_s = ttl;
	if (signing_sign(gw->signing, &p, &token, &claims, &err) != KILN_OK) {
		gw_fail(req, KILN_E_INTERNAL, &err);
		goto out;
	}
	e = (time_t)claims.exp;
	gmtime_r(&e, &tm);
	strftime(exp, sizeof(exp), "%Y-%m-%dT%H:%M:%SZ", &tm);
	http_req_set_object(req, claims.jti);
	http_reply_json(req, 201, json_pack("{s:s, s:s}", "token", token, "expires_at", exp));
out:
	pg_res_free(res);
	free(token);
}

static void jwks(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	char *doc = signing_jwks(gw->signing, &err);

	if (!doc) {
		gw_fail(req, KILN_E_INTERNAL, &err);
		return;
	}
	http_reply_header(req, "Cache-Control", "max-age=60");
	http_reply_data(req, 200, "application/json", doc, strlen(doc));
	free(doc);
}

static const struct http_route routes[] = {
	{ "POST", "/v1/api-keys", keys_create, ROUTE_AUTH | AUTH_SCOPE_KEYS_WRITE, 0, NULL, 0 },
	{ "GET", "/v1/api-keys", keys_list, ROUTE_AUTH | AUTH_SCOPE_KEYS_WRITE, 0, NULL, 0 },
	{ "DELETE", "/v1/api-keys/{id}", keys_delete, ROUTE_AUTH | AUTH_SCOPE_KEYS_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/tokens", tokens_create, ROUTE_AUTH | ROUTE_API_KEY_ONLY, 0, NULL, 0 },
	{ "GET", "/v1/.well-known/jwks.json", jwks, 0, 0, NULL, 0 },
};

const struct route_group routes_keys = { routes, sizeof(routes) / sizeof(routes[0]) };
