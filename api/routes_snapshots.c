/*
 * routes_snapshots.c - GET /v1/snapshots and DELETE /v1/snapshots/{id}: the tenant's named
 * snapshots (pause and fork snapshots are internal). Their files go when nothing stands on them
 * any more: the node that holds them removes them (node/lifecycle.c, snap_gc).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "auth/scopes.h"

static void snapshots_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *sandbox = http_req_query(req, "sandbox_id");
	struct gw_page page;
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	if (!gw_page_parse(req, 50, 100, "snap_", &page))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT snapshot_json(s)::text, "
		 "(extract(epoch FROM s.created_at) * 1000000)::bigint || '.' || s.id "
		 "FROM snapshots s WHERE s.tenant_id = $1 AND s.kind = 'named' AND s.deleted_at IS NULL "
		 "AND ($2::text IS NULL OR s.sandbox_id = $2) "
		 "AND ($3::text IS NULL OR (s.created_at, s.id) < "
		 "     (to_timestamp($3::bigint / 1000000.0), $4::text)) "
		 "ORDER BY s.created_at DESC, s.id DESC LIMIT $5::int",
		 who->tenant_id, sandbox, page.t, page.id, page.lim);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	gw_reply_page(req, &page, res, "snapshots");
}

static void snapshots_delete(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = gw_db(req);
	enum kiln_err rc;

	if (!c)
		return;
	http_req_set_object(req, id);
	rc = PGQ(c, &res, &err,
		 "UPDATE snapshots SET deleted_at = now() WHERE id = $1 AND tenant_id = $2 "
		 "AND kind = 'named' AND deleted_at IS NULL AND status <> 'uploading' RETURNING id",
		 id, who->tenant_id);
	if (rc == KILN_OK && pg_res_rows(res) == 0) {
		pg_res_free(res);
		res = NULL;
		rc = PGQ(c, &res, &err,
			 "SELECT status FROM snapshots WHERE id = $1 AND tenant_id = $2 "
			 "AND kind = 'named' AND deleted_at IS NULL",
			 id, who->tenant_id);
		if (rc == KILN_OK && pg_res_rows(res) == 1)
			rc = kiln_error_set(&err, KILN_E_CONFLICT,
					    "the snapshot is uploading; retry once it is stored or failed");
		else if (rc == KILN_OK)
			rc = kiln_error_set(&err, KILN_E_NOT_FOUND, "no snapshot \"%s\"", id);
	}
	pg_release(gw->pg, c);
	pg_res_free(res);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else
		http_reply_empty(req, 204);
}

static const struct http_route routes[] = {
	{ "GET", "/v1/snapshots", snapshots_list, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "DELETE", "/v1/snapshots/{id}", snapshots_delete, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
};

const struct route_group routes_snapshots = { routes, sizeof(routes) / sizeof(routes[0]) };
