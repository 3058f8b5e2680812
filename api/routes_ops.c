/*
 * routes_ops.c - operations routes: GET /healthz and GET /metrics (no credential needed).
 */
#include <string.h>

#include "api/authn.h"
#include "api/credcache.h"
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
	if (PGQ(c, &res, &err,
		 "SELECT 1 FROM nodes n WHERE " GW_NODE_FRESH_SQL("n", "$1") " LIMIT 1",
		 gw_node_down_after_s(gw)) ==
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

	http_reply_json(req, kiln_err_status(ok ? KILN_OK : KILN_E_UNAVAILABLE),
			json_pack("{s:s, s:{s:s, s:s, s:s}}", "status", ok ? "ok" : "unavailable",
				  "checks", "postgres", pg_ok ? "ok" : "unavailable", "redis",
				  redis_ok ? "ok" : "unavailable", "nodes",
				  nodes_ok ? "ok" : "unavailable"));
}

/*
 * Sandboxes by state, and each node's capacity and what its live sandboxes hold, from Postgres.
 * Left out (not an error) when Postgres does not answer.
 */
static void fleet_metrics(struct gateway *gw, struct buf *out)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return;
	if (PGQ0(c, &res, &err,
		 "SELECT s.state, count(x.id) FROM unnest(ARRAY['creating','running','paused',"
		 "'stopped','error']) AS s(state) LEFT JOIN sandboxes x ON x.state = s.state "
		 "AND x.deleted_at IS NULL GROUP BY s.state ORDER BY s.state") == KILN_OK) {
		buf_appends(out, "# HELP kiln_sandboxes Sandboxes by state (deleted ones left out).\n"
				 "# TYPE kiln_sandboxes gauge\n");
		for (int i = 0; i < pg_res_rows(res); i++)
			buf_appendf(out, "kiln_sandboxes{state=\"%s\"} %s\n", pg_res_str(res, i, 0),
				    pg_res_str(res, i, 1));
	}
	pg_res_free(res);
	res = NULL;
	if (PGQ(c, &res, &err,
		 "SELECT n.id, n.max_sandboxes, n.vcpu_milli, n.memory_mib, count(s.id), "
		 "coalesce(sum(s.vcpu_milli), 0), coalesce(sum(s.memory_mib), 0), "
		 "(" GW_NODE_FRESH_SQL("n", "$1") ")::int FROM nodes n "
		 "LEFT JOIN sandboxes s ON s.node_id = n.id AND s.deleted_at IS NULL "
		 "AND s.state IN ('creating', 'running') GROUP BY n.id ORDER BY n.id",
		 gw_node_down_after_s(gw)) == KILN_OK) {
		buf_appends(out, "# HELP kiln_node_capacity What a node hands out: sandboxes, "
				 "thousandths of vCPUs, MiB.\n# TYPE kiln_node_capacity gauge\n"
				 "# HELP kiln_node_used What the node's live sandboxes hold.\n"
				 "# TYPE kiln_node_used gauge\n"
				 "# HELP kiln_node_up 1 when the node's heartbeat is fresh.\n"
				 "# TYPE kiln_node_up gauge\n");
		for (int i = 0; i < pg_res_rows(res); i++) {
			const char *id = pg_res_str(res, i, 0);
			buf_appendf(out,
				    "kiln_node_capacity{node=\"%s\",resource=\"sandboxes\"} %s\n"
				    "kiln_node_capacity{node=\"%s\",resource=\"vcpu_milli\"} %s\n"
				    "kiln_node_capacity{node=\"%s\",resource=\"memory_mib\"} %s\n"
				    "kiln_node_used{node=\"%s\",resource=\"sandboxes\"} %s\n"
				    "kiln_node_used{node=\"%s\",resource=\"vcpu_milli\"} %s\n"
				    "kiln_node_used{node=\"%s\",resource=\"memory_mib\"} %s\n"
				    "kiln_node_up{node=\"%s\"} %s\n",
				    id, pg_res_str(res, i, 1), id, pg_res_str(res, i, 2), id,
				    pg_res_str(res, i, 3), id, pg_res_str(res, i, 4), id,
				    pg_res_str(res, i, 5), id, pg_res_str(res, i, 6), id,
				    pg_res_str(res, i, 7));
		}
	}
	pg_res_free(res);
	pg_release(gw->pg, c);
}

/* The key and tenant caches' counters (api/authn.c, api/credcache.h). */
static void auth_cache_metrics(struct buf *out)
{
	struct credcache_stats st[2];
	static const char *const names[2] = { "key", "tenant" };

	gw_authn_cache_stats(&st[0], &st[1]);
	buf_appends(out, "# HELP kiln_auth_cache_lookups_total Lookups of the API key and tenant "
			 "caches, by whether the entry was there (expired or not).\n"
			 "# TYPE kiln_auth_cache_lookups_total counter\n");
	for (int i = 0; i < 2; i++)
		buf_appendf(out, "kiln_auth_cache_lookups_total{cache=\"%s\",found=\"yes\"} %llu\n"
				 "kiln_auth_cache_lookups_total{cache=\"%s\",found=\"no\"} %llu\n",
			    names[i], st[i].hits, names[i], st[i].misses);
	buf_appends(out, "# HELP kiln_auth_cache_evictions_total Entries dropped from a full set for "
			 "another id.\n# TYPE kiln_auth_cache_evictions_total counter\n");
	for (int i = 0; i < 2; i++)
		buf_appendf(out, "kiln_auth_cache_evictions_total{cache=\"%s\"} %llu\n", names[i],
			    st[i].evictions);
	buf_appends(out, "# HELP kiln_auth_cache_entries Entries held.\n"
			 "# TYPE kiln_auth_cache_entries gauge\n");
	for (int i = 0; i < 2; i++)
		buf_appendf(out, "kiln_auth_cache_entries{cache=\"%s\"} %llu\n", names[i],
			    st[i].entries);
}

static void metrics(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct buf out;

	buf_init(&out, 4 << 20);
	http_server_metrics(gw->http, &out);
	fleet_metrics(gw, &out);
	billing_metrics(gw->rds, &out);	/* kiln-meter's lag and missed ticks, from Redis */
	auth_cache_metrics(&out);
	http_reply_data(req, 200, "text/plain; version=0.0.4", out.data ? out.data : "", out.len);
	buf_release(&out);
}

static const struct http_route routes[] = {
	{ "GET", "/healthz", healthz, 0, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/metrics", metrics, 0, HTTP_BODY_BUFFER, NULL, 0 },
};

const struct route_group routes_ops = { routes, sizeof(routes) / sizeof(routes[0]) };
