/*
 * routes_templates.c - the template routes of docs/openapi.yaml (docs/templates.md): a tenant's own
 * templates, each a name with numbered versions. POST /v1/templates adds a version (making the
 * template when the name is new); GET lists and gets them; DELETE removes a template with all its
 * versions. Every query is scoped by the caller's tenant: another tenant's template is 404.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "auth/scopes.h"

/* POST /v1/templates: 201 {id, name, version}, or 403 naming the limit reached. */
static void templates_create(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct apireq_template t;
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = NULL;
	char v[16], m[16], d[16], maxt[24], maxv[24];
	size_t blen;
	const char *body = http_req_body(req, &blen);
	enum kiln_err rc;

	rc = apireq_template(body, blen, &t, &err);
	if (rc != KILN_OK) {
		http_reply_error(req, rc, "%s", err.msg);
		goto out;
	}
	c = gw_db(req);
	if (!c)
		goto out;
	snprintf(v, sizeof(v), "%u", t.vcpu_milli);
	snprintf(m, sizeof(m), "%u", t.mem_mib);
	snprintf(d, sizeof(d), "%u", t.disk_gib);
	snprintf(maxt, sizeof(maxt), "%lld", gw->cfg.template_max_per_tenant);
	snprintf(maxv, sizeof(maxv), "%lld", gw->cfg.template_max_versions);
	rc = PGQ(c, &res, &err,
		 "SELECT template_id, version, quota FROM template_version_add($1, $2, $3::int, "
		 "$4::int, $5::int, $6, $7, $8::jsonb, $9::int, $10::int)",
		 who->tenant_id, t.name, v, m, d, t.start_cmd, t.ready_cmd, t.egress, maxt, maxv);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		goto out;
	}
	if (pg_res_get(res, 0, 2)) {
		http_reply_error(req, KILN_E_QUOTA, "%s", pg_res_str(res, 0, 2));
		goto out;
	}
	http_req_set_object(req, pg_res_str(res, 0, 0));
	http_reply_json(req, 201,
			json_pack("{s:s, s:s, s:I}", "id", pg_res_str(res, 0, 0), "name", t.name,
				  "version", (json_int_t)pg_res_int(res, 0, 1, 0)));
out:
	if (c)
		pg_release(gw->pg, c);
	pg_res_free(res);
	apireq_template_free(&t);
}

/* GET /v1/templates: the caller's templates, newest first, paged, each with its newest version. */
static void templates_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct gw_page page;
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	if (!gw_page_parse(req, 50, 100, "tmpl_", &page))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT template_summary_json(t)::text, "
		 "(extract(epoch FROM t.created_at) * 1000000)::bigint || '.' || t.id "
		 "FROM templates t WHERE t.tenant_id = $1 AND t.deleted_at IS NULL "
		 "AND ($2::text IS NULL OR (t.created_at, t.id) < "
		 "     (to_timestamp($2::bigint / 1000000.0), $3::text)) "
		 "ORDER BY t.created_at DESC, t.id DESC LIMIT $4::int",
		 who->tenant_id, page.t, page.id, page.lim);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	gw_reply_page(req, &page, res, "templates");
}

/* GET /v1/templates/{id}: one of the caller's templates with its versions. */
static void templates_get(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = gw_db(req);
	json_error_t jerr;
	json_t *j;
	enum kiln_err rc;

	if (!c)
		return;
	http_req_set_object(req, id);
	rc = PGQ(c, &res, &err,
		 "SELECT template_json(t)::text FROM templates t WHERE t.tenant_id = $1 "
		 "AND t.id = $2 AND t.deleted_at IS NULL",
		 who->tenant_id, id);
	pg_release(gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(&err, KILN_E_NOT_FOUND, "no template \"%s\"", id);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		pg_res_free(res);
		return;
	}
	j = json_loads(pg_res_str(res, 0, 0), 0, &jerr);
	pg_res_free(res);
	if (!j)
		http_reply_error(req, KILN_E_INTERNAL, "internal error");
	else
		http_reply_json(req, 200, j);
}

/* DELETE /v1/templates/{id}: 204; the template and its versions are gone for the API at once. */
static void templates_delete(struct http_req *req)
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
		 "UPDATE templates SET deleted_at = now() WHERE tenant_id = $1 "
		 "AND id = $2 AND deleted_at IS NULL RETURNING id",
		 who->tenant_id, id);
	pg_release(gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) == 0)
		rc = kiln_error_set(&err, KILN_E_NOT_FOUND, "no template \"%s\"", id);
	pg_res_free(res);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else
		http_reply_empty(req, 204);
}

static const struct http_route routes[] = {
	{ "POST", "/v1/templates", templates_create, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL,
	  0 },
	{ "GET", "/v1/templates", templates_list, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "GET", "/v1/templates/{id}", templates_get, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL,
	  0 },
	{ "DELETE", "/v1/templates/{id}", templates_delete, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
};

const struct route_group routes_templates = { routes, sizeof(routes) / sizeof(routes[0]) };
