/*
 * routes_ops.c - operations routes: GET /healthz and GET /metrics (no credential needed).
 */
#include <string.h>

#include "api/gateway.h"
#include "common/buf.h"
#include "metering/billing.h"

/* Whether at least one node's heartbeat is fresh. */
static bool nodes_alive(struct gateway *gw)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	bool ok = false;

	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return false;
	if (PGQ0(c, &res, &err,
		 "SELECT 1 FROM nodes WHERE heartbeat_at > now() - interval '10 seconds' LIMIT 1") ==
	    KILN_OK)
		ok = pg_res_rows(res) == 1;
	pg_res_free(res);
	pg_release(gw->pg, c);
	return ok;
}

/* 200 when every dependency answers, else 503; the body says which does not. */
static void healthz(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	bool pg_ok = pg_ping(gw->pg, &err) == KILN_OK;
	bool redis_ok = rds_ping(gw->rds, &err) == KILN_OK;
	bool nodes_ok = pg_ok && nodes_alive(gw);
	bool ok = pg_ok && redis_ok && nodes_ok;

	http_reply_json(req, ok ? 200 : 503,
			json_pack("{s:s, s:{s:s, s:s, s:s}}", "status", ok ? "ok" : "unavailable",
				  "checks", "postgres", pg_ok ? "ok" : "unavailable", "redis",
				  redis_ok ? "ok" : "unavailable", "nodes",
				  nodes_ok ? "ok" : "unavailable"));
}

static void metrics(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct buf out;

	buf_init(&out, 4 << 20);
	http_server_metrics(gw->http, &out);
	billing_metrics(gw->rds, &out);	/* kiln-meter's lag and missed ticks, from Redis */
	http_reply_data(req, 200, "text/plain; version=0.0.4", out.data ? out.data : "", out.len);
	buf_release(&out);
}

static const struct http_route routes[] = {
	{ "GET", "/healthz", healthz, 0, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/metrics", metrics, 0, HTTP_BODY_BUFFER, NULL, 0 },
};

const struct route_group routes_ops = { routes, sizeof(routes) / sizeof(routes[0]) };
