/*
 * routes_tenants.c - POST /v1/tenants (admin) and the operator's first admin key.
 *
 * A tenant is created with its first API key (every tenant scope) and the free tier's grant,
 * posted to the ledger, all in one transaction: either all three exist or none does.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/log.h"
#include "metering/ledger.h"

#define OPERATOR_TENANT "tn_operator"

/*
 * Creates tenant `id` named `name` with a first key of `scopes`, and (unless operator) the free
 * tier's grant. Runs its own transaction on `c`. Returns the key's JSON or NULL with `err` set.
 */
static json_t *tenant_create(struct pg_conn *c, const char *id, const char *name, bool op,
			     uint32_t scopes, char *created_at, size_t created_len,
			     struct kiln_error *err)
{
	struct pg_res *res = NULL;
	json_t *key = NULL;
	char tx[LEDGER_TX_ID_MAX], idem[96];
	int replayed;
	enum kiln_err rc = pg_exec(c, "BEGIN", err);

	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "INSERT INTO tenants (id, name, operator) VALUES ($1, $2, $3::boolean) "
			 "RETURNING rfc3339(created_at)",
			 id, name, op ? "true" : "false");
	if (rc == KILN_OK)
		snprintf(created_at, created_len, "%s", pg_res_str(res, 0, 0));
	pg_res_free(res);
	if (rc == KILN_OK && !op) {
		snprintf(idem, sizeof(idem), "signup:%s", id);
		rc = ledger_grant(c, id, LEDGER_FREE_TIER_UCR, NULL, idem, "free tier", tx, &replayed,
				  err);
	}
	if (rc == KILN_OK) {
		key = gw_key_create(c, id, op ? "operator admin" : "default", scopes, NULL, err);
		if (!key)
			rc = err->code ? err->code : KILN_E_INTERNAL;
	}
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	if (rc != KILN_OK) {
		json_decref(key);
		return NULL;	/* pg_release rolls back */
	}
	return key;
}

static void tenants_create(struct http_req *req)
{
	static const struct json_field fields[] = { { "name", JF_STRING, true, 0 } };
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	json_t *body = gw_body(req, fields, 1), *key;
	struct pg_conn *c = NULL;
	char id[AUTH_ID_MAX], created[40];
	const char *name;

	if (!body)
		return;
	name = json_str(body, "name", "");
	if (!gw_valid_name(req, "name", name) || !gw_new_id(req, "tn_", id, sizeof(id)))
		goto out;
	c = gw_db(req);
	if (!c)
		goto out;
	key = tenant_create(c, id, name, false, AUTH_SCOPES_TENANT, created, sizeof(created), &err);
	if (!key) {
		gw_fail(req, err.code ? err.code : KILN_E_INTERNAL, &err);
		goto out;
	}
	http_req_set_object(req, id);
	json_object_del(key, "name");
	json_object_del(key, "prefix");
	json_object_del(key, "created_at");
	json_object_del(key, "expires_at");
	http_reply_json(req, 201,
			json_pack("{s:{s:s, s:s, s:s}, s:o}", "tenant", "id", id, "name", name,
				  "created_at", created, "api_key", key));
out:
	if (c)
		pg_release(gw->pg, c);
	json_decref(body);
}

enum kiln_err gw_bootstrap_admin(struct gateway *gw, const char *path, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	json_t *key = NULL;
	char created[40];
	enum kiln_err rc = pg_acquire(gw->pg, &c, err);
	const char *text;
	int fd;

	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err, "SELECT 1 FROM tenants WHERE id = $1", OPERATOR_TENANT);
	if (rc != KILN_OK || pg_res_rows(res) == 1)
		goto out;
	/* Write the file first (empty), so a key is never made that nobody can read. */
	fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0) {
		rc = kiln_error_set(err, KILN_E_IO, "cannot create \"%s\": %s", path, strerror(errno));
		goto out;
	}
	key = tenant_create(c, OPERATOR_TENANT, "operator", true, AUTH_SCOPES_ALL, created,
			    sizeof(created), err);
	if (!key) {
		close(fd);
		unlink(path);
		rc = err->code == KILN_E_CONFLICT ? KILN_OK : (err->code ? err->code : KILN_E_INTERNAL);
		if (rc == KILN_OK)
			kiln_error_clear(err);	/* another gateway made it first */
		goto out;
	}
	text = json_str(key, "key", "");
	if (write(fd, text, strlen(text)) != (ssize_t)strlen(text) || write(fd, "\n", 1) != 1 ||
	    fsync(fd) != 0)
		rc = kiln_error_set(err, KILN_E_IO, "cannot write \"%s\"", path);
	close(fd);
	if (rc == KILN_OK)
		log_info("made the operator's admin key \"%s\" in \"%s\"", json_str(key, "id", ""),
			 path);
out:
	json_decref(key);
	pg_res_free(res);
	pg_release(gw->pg, c);
	return rc;
}

static const struct http_route routes[] = {
	{ "POST", "/v1/tenants", tenants_create, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0, NULL, 0 },
};

const struct route_group routes_tenants = { routes, sizeof(routes) / sizeof(routes[0]) };
