/*
 * routes_tenants.c - POST /v1/tenants, POST /v1/tenants/{id}/suspend and .../unsuspend (admin),
 * and the operator's first admin key.
 *
 * A tenant is created with its first API key (every tenant scope) and the free tier's grant,
 * posted to the ledger, all in one transaction: either all three exist or none does.
 *
 * Suspending a tenant sets tenants.suspended_at: from then on every key and token of it gets 403
 * `suspended` (api/authn.c; other gateways within key_cache_s), and its running sandboxes are
 * paused through their nodes, as kiln-meter pauses them (metering/pause.c). Nothing is deleted.
 * Unsuspending clears it; the sandboxes stay paused until the tenant resumes them.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/httpc.h"
#include "common/log.h"
#include "metering/ledger.h"

#define OPERATOR_TENANT "tn_operator"
#define PAUSE_TOKEN_TTL_S 60
#define PAUSE_TIMEOUT_MS 120000L	/* a pause writes a snapshot: give it time */
/*
 * The token subject of a suspension's pauses: kiln-node never refuses those for the tenant's
 * plan (node/pause.h PAUSE_SUSPEND_SUB, the same text), as it never refuses kiln-meter's. No API
 * key can have it (their ids are generated, "key_..."), so no tenant's call is forced.
 */
#define SUSPEND_PAUSE_SUB "kiln-suspend"

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
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	json_t *body = NULL, *key;
	struct pg_conn *c = NULL;
	char id[AUTH_ID_MAX], created[40];
	const char *name;

	if (apireq_tenant(btext, blen, &body, &name, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		goto out;
	}
	if (!gw_new_id(req, "tn_", id, sizeof(id)))
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

/*
 * Asks the node at `address` to pause sandbox `sandbox_id` of `tenant_id`, with a node token
 * signed for it whose subject is SUSPEND_PAUSE_SUB: a forced pause, never refused for the
 * tenant's snapshot quota (the operator who asked, `by`, is logged here). Returns the node's HTTP
 * status, or 0 when it could not be asked or did not answer.
 */
static long sandbox_pause_on_node(struct gateway *gw, const char *address, const char *tenant_id,
				  const char *sandbox_id, const char *by)
{
	struct auth_token_params tp = {
		.iss = GW_ISSUER,
		.aud = AUTH_AUD_NODE,
		.sub = SUSPEND_PAUSE_SUB,
		.tid = tenant_id,
		.sbx = sandbox_id,
		.scopes = AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_SANDBOX_WRITE,
		.now = time(NULL),
		.ttl_s = PAUSE_TOKEN_TTL_S,
	};
	struct kiln_error err = { 0 };
	struct curl_slist *h = NULL;
	char url[1024], *auth = NULL, *token = NULL;
	const char *base = address;
	struct httpc_opts o = { .url = url, .timeout_ms = PAUSE_TIMEOUT_MS, .connect_timeout_ms = 3000 };
	struct httpc hc = { 0 };
	long status = 0;

	if (signing_sign(gw->signing, &tp, &token, NULL, &err) != KILN_OK) {
		log_error("cannot sign a node token: %s", err.msg);
		goto out;
	}
	if (strncmp(base, "unix:", 5) == 0) {
		o.unix_socket = base + 5;
		base = "http://node";
	}
	snprintf(url, sizeof(url), "%s/v1/sandboxes/%s/pause", base, sandbox_id);
	if (asprintf(&auth, "Authorization: Bearer %s", token) < 0) {
		auth = NULL;
		goto out;
	}
	h = curl_slist_append(h, auth);
	h = curl_slist_append(h, "Content-Type: application/json");
	o.method = "POST";
	o.post_data = "{}";
	o.post_len = 2;
	o.headers = h;
	if (httpc_open(&hc, &o, &err) != KILN_OK)
		goto out;
	log_info("pausing \"%s\" of suspended tenant \"%s\" (forced), as asked by \"%s\"",
		 sandbox_id, tenant_id, by);
	if (httpc_perform(&hc, &status, &err) != KILN_OK)
		log_warn("cannot reach node at \"%s\" to pause \"%s\": %s", address, sandbox_id,
			 err.msg);
out:
	curl_slist_free_all(h);
	httpc_close(&hc);
	free(auth);
	free(token);
	return status;
}

/*
 * Reads tenant `id` into a JSON object {id, name, created_at, suspended_at}. Replies 404 (and
 * returns NULL) when there is none, 409 when it is the operator's own tenant.
 */
static json_t *tenant_row(struct http_req *req, struct pg_conn *c, const char *id)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	json_t *t = NULL;

	if (PGQ(c, &res, &err,
		"SELECT name, rfc3339(created_at), operator, rfc3339(suspended_at) FROM tenants "
		"WHERE id = $1",
		id) != KILN_OK)
		gw_fail(req, err.code, &err);
	else if (pg_res_rows(res) != 1)
		http_reply_error(req, KILN_E_NOT_FOUND, "no such tenant");
	else if (pg_res_bool(res, 0, 2))
		http_reply_error(req, KILN_E_CONFLICT, "the operator's own tenant cannot be suspended");
	else
		t = json_pack("{s:s, s:s, s:s, s:o}", "id", id, "name", pg_res_str(res, 0, 0),
			      "created_at", pg_res_str(res, 0, 1), "suspended_at",
			      pg_res_get(res, 0, 3) ? json_string(pg_res_str(res, 0, 3))
						    : json_null());
	pg_res_free(res);
	return t;
}

#define SUSPEND_PASSES 3
#define RUNNING_SQL                                                                          \
	"SELECT s.id, n.address FROM sandboxes s JOIN nodes n ON n.id = s.node_id "          \
	"WHERE s.tenant_id = $1 AND s.state = 'running' AND s.deleted_at IS NULL "           \
	"ORDER BY s.created_at"

/* Whether the JSON array `a` holds the string `s`. */
static bool json_listed(const json_t *a, const char *s)
{
	size_t i;
	json_t *v;

	json_array_foreach(a, i, v)
		if (!strcmp(json_string_value(v), s))
			return true;
	return false;
}

/*
 * POST /v1/tenants/{id}/suspend: marks the tenant suspended (keeping the first time when it
 * already is), then pauses each of its running sandboxes through its node, one after another,
 * looking again (up to SUSPEND_PASSES times) for sandboxes whose creation ended meanwhile. The
 * pauses are forced (SUSPEND_PAUSE_SUB): the tenant's snapshot quota never keeps one running.
 * Replies 200 with the tenant and the sandboxes paused and not paused (their node did not answer
 * or failed); suspending again retries those.
 */
static void tenants_suspend(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = gw_db(req);
	json_t *t = NULL, *paused = NULL, *not_paused = NULL;
	enum kiln_err rc;

	if (!c)
		return;
	http_req_set_object(req, id);
	if (PGQ(c, NULL, &err,
		"UPDATE tenants SET suspended_at = coalesce(suspended_at, now()) "
		"WHERE id = $1 AND NOT operator",
		id) != KILN_OK) {
		gw_fail(req, err.code, &err);
		goto out;
	}
	gw_tenant_cache_forget(id);
	t = tenant_row(req, c, id);
	if (!t)
		goto out;
	if (PGQ(c, &res, &err, RUNNING_SQL, id) != KILN_OK) {
		gw_fail(req, err.code, &err);
		goto out;
	}
	/* Pausing takes a while (a snapshot each): give the connection back meanwhile. */
	pg_release(gw->pg, c);
	c = NULL;
	log_info("tenant \"%s\" suspended; pausing %d running sandboxes", id, pg_res_rows(res));
	paused = json_array();
	not_paused = json_array();
	/*
	 * A creation admitted before the suspension can end during the pauses: its sandbox shows up
	 * as running in the next pass. A few passes catch those.
	 */
	for (int pass = 0; pass < SUSPEND_PASSES; pass++) {
		int fresh = 0;

		for (int i = 0; i < pg_res_rows(res); i++) {
			const char *sb = pg_res_str(res, i, 0);
			long status;

			if (json_listed(paused, sb) || json_listed(not_paused, sb))
				continue;
			fresh++;
			status = sandbox_pause_on_node(gw, pg_res_str(res, i, 1), id, sb, who->key_id);
			/* 409: it stopped or was paused meanwhile, which is as good. */
			json_array_append_new(status == 200 || status == 409 ? paused : not_paused,
					      json_string(sb));
			if (status != 200 && status != 409)
				log_warn("sandbox \"%s\" of suspended tenant \"%s\" not paused (node "
					 "answered %ld)", sb, id, status);
		}
		pg_res_free(res);
		res = NULL;
		if (!fresh || pass + 1 == SUSPEND_PASSES)
			break;
		if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
			break;
		rc = PGQ(c, &res, &err, RUNNING_SQL, id);
		pg_release(gw->pg, c);
		c = NULL;
		if (rc != KILN_OK) {
			log_warn("tenant \"%s\": cannot look for more running sandboxes: %s", id,
				 err.msg);
			break;
		}
	}
	http_reply_json(req, 200,
			json_pack("{s:o, s:o, s:o}", "tenant", t, "paused", paused, "not_paused",
				  not_paused));
	t = NULL;
out:
	json_decref(t);
	pg_res_free(res);
	if (c)
		pg_release(gw->pg, c);
}

/* POST /v1/tenants/{id}/unsuspend: the tenant's keys and tokens work again; nothing is resumed. */
static void tenants_unsuspend(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_conn *c = gw_db(req);
	json_t *t;

	if (!c)
		return;
	http_req_set_object(req, id);
	if (PGQ(c, NULL, &err, "UPDATE tenants SET suspended_at = NULL WHERE id = $1", id) !=
	    KILN_OK) {
		gw_fail(req, err.code, &err);
		pg_release(gw->pg, c);
		return;
	}
	gw_tenant_cache_forget(id);
	t = tenant_row(req, c, id);
	pg_release(gw->pg, c);
	if (t)
		http_reply_json(req, 200, json_pack("{s:o}", "tenant", t));
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
	{ "POST", "/v1/tenants/{id}/suspend", tenants_suspend, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0,
	  NULL, 0 },
	{ "POST", "/v1/tenants/{id}/unsuspend", tenants_unsuspend, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0,
	  NULL, 0 },
};

const struct route_group routes_tenants = { routes, sizeof(routes) / sizeof(routes[0]) };
