/*
 * routes_secrets.c - a sandbox's secrets (docs/network-policy.md, "Secrets"):
 * PUT /v1/sandboxes/{id}/secrets replaces the set, GET lists it by host and header name only.
 *
 * The gateway keeps nothing of a value: the PUT goes to the sandbox's node, which checks each host
 * against the sandbox's exact host rules (422 naming it), seals the values into Postgres and puts
 * them in force; the copy in the request body is wiped once forwarded. The GET reads Postgres,
 * which holds the values sealed and the names in clear. Another tenant's sandbox: 404.
 */
#include <stdio.h>
#include <string.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "api/nodeclient.h"
#include "auth/scopes.h"
#include "common/log.h"

/* The caller's live sandbox: its state and node; false after replying 404 or 503. */
static bool secrets_sandbox(struct http_req *req, char *state, size_t slen, char *address,
			    size_t alen)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	http_req_set_object(req, id);
	c = gw_db(req);
	if (!c)
		return false;
	rc = PGQ(c, &res, &err,
		 "SELECT s.state, coalesce(n.address, '') FROM sandboxes s "
		 "LEFT JOIN nodes n ON n.id = s.node_id "
		 "WHERE s.id = $1 AND s.tenant_id = $2 AND s.deleted_at IS NULL",
		 id, gw_principal(req)->tenant_id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return false;
	}
	if (pg_res_rows(res) != 1) {
		pg_res_free(res);
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		return false;
	}
	snprintf(state, slen, "%s", pg_res_str(res, 0, 0));
	snprintf(address, alen, "%s", pg_res_str(res, 0, 1));
	pg_res_free(res);
	return true;
}

static void secrets_put(struct http_req *req)
{
	char state[16], address[256], path[128];
	size_t len = 0;
	const char *body = http_req_body(req, &len);

	if (!secrets_sandbox(req, state, sizeof(state), address, sizeof(address)))
		goto out;
	if (strcmp(state, "running") != 0) {
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", state);
		goto out;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/secrets", http_req_param(req, "id"));
	node_proxy(req, &(struct node_call){ .address = address, .method = "PUT", .path = path,
					      .sandbox_id = http_req_param(req, "id"),
					      .who = gw_principal(req), .body = body, .body_len = len,
					      .upload_fd = -1, .content_type = "application/json" });
out:
	if (body && len)
		explicit_bzero((void *)body, len);	/* the values never stay in the gateway */
}

static void secrets_get(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	char state[16], address[256];
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;
	json_t *arr;

	if (!secrets_sandbox(req, state, sizeof(state), address, sizeof(address)))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT host, header FROM sandbox_secrets WHERE sandbox_id = $1 AND tenant_id = $2 "
		 "ORDER BY host, header",
		 http_req_param(req, "id"), gw_principal(req)->tenant_id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	arr = json_array();
	for (int i = 0; arr && i < pg_res_rows(res); i++)
		json_array_append_new(arr, json_pack("{s:s, s:s}", "host", pg_res_str(res, i, 0),
						     "header", pg_res_str(res, i, 1)));
	pg_res_free(res);
	http_reply_json(req, 200, json_pack("{s:o}", "secrets", arr));
}

static const struct http_route routes[] = {
	{ "PUT", "/v1/sandboxes/{id}/secrets", secrets_put, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/secrets", secrets_get, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0,
	  NULL, 0 },
};

const struct route_group routes_secrets = { routes, sizeof(routes) / sizeof(routes[0]) };
