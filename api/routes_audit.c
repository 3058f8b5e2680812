/*
 * routes_audit.c - GET /v1/audit: the tenant's own audit trail, newest first, with cursor paging.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "auth/scopes.h"

static void audit_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct gw_page page;
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	json_t *arr;
	int rows;
	enum kiln_err rc;

	if (!gw_page_parse(req, 50, 500, NULL, &page))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT seq, key_id, method, route, object_id, status, request_id, "
		 "rfc3339(created_at) FROM audit_log WHERE tenant_id = $1 "
		 "AND ($2::bigint IS NULL OR seq < $2::bigint) ORDER BY seq DESC LIMIT $3::int",
		 who->tenant_id, page.seq, page.lim);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	arr = json_array();
	rows = gw_page_rows(&page, res);
	for (int i = 0; i < rows; i++)
		json_array_append_new(
			arr, json_pack("{s:s, s:o, s:s, s:s, s:o, s:i, s:s, s:s}", "id",
				       pg_res_str(res, i, 0), "key_id",
				       pg_res_get(res, i, 1) ? json_string(pg_res_get(res, i, 1)) : json_null(),
				       "method", pg_res_str(res, i, 2), "route", pg_res_str(res, i, 3),
				       "object_id",
				       pg_res_get(res, i, 4) ? json_string(pg_res_get(res, i, 4)) : json_null(),
				       "status", (int)pg_res_int(res, i, 5, 0), "request_id",
				       pg_res_str(res, i, 6), "created_at", pg_res_str(res, i, 7)));
	gw_page_reply(req, &page, res, 0, "entries", arr);
}

static const struct http_route routes[] = {
	{ "GET", "/v1/audit", audit_list, ROUTE_AUTH | AUTH_SCOPE_BILLING_READ, 0, NULL, 0 },
};

const struct route_group routes_audit = { routes, sizeof(routes) / sizeof(routes[0]) };
