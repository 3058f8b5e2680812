/*
 * routes_connlog.c - GET /v1/admin/sandboxes/{id}/connections: a sandbox's connection log (the
 * flows its guest opened and the attempts the policy refused, as its nodes wrote them, with the
 * name-checking proxy's name and decision and the injecting proxy's requests; see
 * docs/network-policy.md), for the operator answering an abuse report. Admin scope only: tenants
 * get 403. Newest first, paged by the row's sequence number.
 */
#include <stdio.h>
#include <string.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "auth/scopes.h"

/* `?since=` / `?until=`: an RFC 3339 time, or absent. Replies 422 and returns false when bad. */
static bool time_param(struct http_req *req, const char *name, const char **out)
{
	*out = http_req_query(req, name);
	if (*out && !gw_is_rfc3339(*out)) {
		http_reply_error(req, KILN_E_INVALID, "%s must be an RFC 3339 UTC time", name);
		return false;
	}
	return true;
}

static void connections_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	const char *since, *until;
	struct gw_page page;
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL, *lost = NULL;
	enum kiln_err rc;
	json_t *arr, *next;
	int rows;

	if (!gw_page_parse(req, 100, 1000, NULL, &page) || !time_param(req, "since", &since) ||
	    !time_param(req, "until", &until))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &lost, &err,
		 "SELECT EXISTS (SELECT 1 FROM sandboxes WHERE id = $1) OR EXISTS (SELECT 1 FROM "
		 "sandbox_connections WHERE sandbox_id = $1), coalesce(sum(ring_full), 0), "
		 "coalesce(sum(over_cap), 0) FROM sandbox_connlog_lost WHERE sandbox_id = $1",
		 id);
	if (rc == KILN_OK && !pg_res_bool(lost, 0, 0)) {
		pg_release(gw->pg, c);
		pg_res_free(lost);
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		return;
	}
	if (rc == KILN_OK)
		rc = PGQ(c, &res, &err,
			 "SELECT id, tenant_id, node_id, rfc3339(opened_at), rfc3339(last_seen_at), "
			 "verdict, family, proto, host(dst), dst_port, src_port, dns_name, bytes_out, "
			 "bytes_in, packets_out, packets_in, proxy_decision, requests::text "
			 "FROM sandbox_connections "
			 "WHERE sandbox_id = $1 AND ($2::bigint IS NULL OR id < $2::bigint) "
			 "AND ($3::timestamptz IS NULL OR opened_at >= $3::timestamptz) "
			 "AND ($4::timestamptz IS NULL OR opened_at < $4::timestamptz) "
			 "ORDER BY id DESC LIMIT $5::int",
			 id, page.seq, since, until, page.lim);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		pg_res_free(lost);
		gw_fail(req, rc, &err);
		return;
	}
	arr = json_array();
	rows = gw_page_rows(&page, res);
	for (int i = 0; i < rows; i++) {
		const char *tenant = pg_res_get(res, i, 1), *dns = pg_res_get(res, i, 11);
		const char *dec = pg_res_get(res, i, 16), *rq = pg_res_get(res, i, 17);
		json_t *reqs = rq ? json_loads(rq, 0, NULL) : NULL;
		json_array_append_new(
			arr, json_pack("{s:s, s:o, s:s, s:s, s:s, s:s, s:I, s:s, s:s, s:I, s:I, s:o, "
				       "s:I, s:I, s:I, s:I, s:o, s:o}",
				       "id", pg_res_str(res, i, 0),
				       "tenant_id", tenant ? json_string(tenant) : json_null(),
				       "node_id", pg_res_str(res, i, 2),
				       "opened_at", pg_res_str(res, i, 3),
				       "last_seen_at", pg_res_str(res, i, 4),
				       "verdict", pg_res_str(res, i, 5),
				       "family", (json_int_t)pg_res_int(res, i, 6, 0),
				       "proto", pg_res_str(res, i, 7),
				       "dst", pg_res_str(res, i, 8),
				       "dst_port", (json_int_t)pg_res_int(res, i, 9, 0),
				       "src_port", (json_int_t)pg_res_int(res, i, 10, 0),
				       "dns_name", dns ? json_string(dns) : json_null(),
				       "bytes_out", (json_int_t)pg_res_int(res, i, 12, 0),
				       "bytes_in", (json_int_t)pg_res_int(res, i, 13, 0),
				       "packets_out", (json_int_t)pg_res_int(res, i, 14, 0),
				       "packets_in", (json_int_t)pg_res_int(res, i, 15, 0),
				       "proxy_decision", dec ? json_string(dec) : json_null(),
				       "requests", reqs ? reqs : json_null()));
	}
	next = pg_res_rows(res) > page.limit ? json_string(pg_res_str(res, page.limit - 1, 0))
					     : json_null();
	http_reply_json(req, 200,
			json_pack("{s:s, s:o, s:o, s:{s:I, s:I}}", "sandbox_id", id, "connections",
				  arr, "next_cursor", next, "lost", "ring_full",
				  (json_int_t)pg_res_int(lost, 0, 1, 0), "over_cap",
				  (json_int_t)pg_res_int(lost, 0, 2, 0)));
	pg_res_free(res);
	pg_res_free(lost);
}

static const struct http_route routes[] = {
	{ "GET", "/v1/admin/sandboxes/{id}/connections", connections_list,
	  ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0, NULL, 0 },
};

const struct route_group routes_connlog = { routes, sizeof(routes) / sizeof(routes[0]) };
