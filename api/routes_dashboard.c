/*
 * routes_dashboard.c - the usage dashboard: GET / (the page) and GET /assets/{name} (its script
 * and style), public like /healthz. The page holds no data: it asks the API with the key the user
 * types in (docs/dashboard.md). Served with a content security policy that allows only this
 * origin's script, style and API, and no framing.
 */
#include <string.h>

#include "api/dashboard.h"
#include "api/gateway.h"

#define CSP "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; " \
	    "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

static void serve(struct http_req *req, const char *name)
{
	for (size_t i = 0; i < dashboard_assets_count; i++) {
		const struct dashboard_asset *a = &dashboard_assets[i];

		if (strcmp(a->name, name) != 0)
			continue;
		http_reply_header(req, "Content-Security-Policy", CSP);
		http_reply_header(req, "X-Content-Type-Options", "nosniff");
		http_reply_header(req, "Referrer-Policy", "no-referrer");
		http_reply_header(req, "Cache-Control", "no-cache");
		http_reply_data(req, 200, a->content_type, a->data, a->len);
		return;
	}
	http_reply_error(req, KILN_E_NOT_FOUND, "no such file");
}

static void page(struct http_req *req)
{
	serve(req, "index.html");
}

static void asset(struct http_req *req)
{
	const char *name = http_req_param(req, "name");

	/* only the script and the style sheet: the page itself is "/" */
	serve(req, name && strcmp(name, "index.html") != 0 ? name : "");
}

static const struct http_route routes[] = {
	{ "GET", "/", page, 0, 0, NULL, 0 },
	{ "GET", "/assets/{name}", asset, 0, 0, NULL, 0 },
};

const struct route_group routes_dashboard = { routes, sizeof(routes) / sizeof(routes[0]) };
