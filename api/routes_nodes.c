/*
 * routes_nodes.c - the nodes of a deployment for the operator (admin scope): GET /v1/admin/nodes
 * lists them with their state, capacity and use; POST /v1/admin/nodes/{id}/drain stops placement
 * on one and moves its sandboxes to the others through their tenants' buckets. Also the marking
 * of nodes whose heartbeat lapsed as down (gw_nodes_down), which every placement and read of a
 * sandbox does first (docs/operations.md, Many hosts).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "api/nodeclient.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/clock.h"
#include "common/log.h"
#include "record/record.h"

#define DRAIN_SUBJECT "kiln-gateway:drain"	/* the node tokens' subject of a drain's calls */

const char *gw_node_down_after_s(const struct gateway *gw)
{
	static _Thread_local char text[24];

	snprintf(text, sizeof(text), "%lld", gw->cfg.node_down_after_s);
	return text;
}

static void nodes_down_now(struct gateway *gw)
{
	struct kiln_error err = { 0 };
	int marked = 0;

	if (record_nodes_down(gw->pg, NULL, gw->cfg.node_down_after_s, &marked, &err) != KILN_OK)
		log_warn("cannot mark the nodes whose heartbeat lapsed as down: %s", err.msg);
	else if (marked)
		log_warn("%d nodes marked down: no heartbeat for %lld s", marked,
			 gw->cfg.node_down_after_s);
}

void gw_nodes_down(struct gateway *gw)
{
	static _Atomic long long last;
	long long ms = clock_mono_ms(), was;

	was = atomic_load(&last);
	if (was && ms - was < 1000)
		return;	/* at most once a second per gateway: the nodes mark each other too */
	if (atomic_compare_exchange_strong(&last, &was, ms))
		nodes_down_now(gw);
}

/* ---- GET /v1/admin/nodes ---- */

static void nodes_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	char after[24];
	enum kiln_err rc;

	gw_nodes_down(gw);
	snprintf(after, sizeof(after), "%s", gw_node_down_after_s(gw));
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT coalesce(jsonb_agg(jsonb_build_object("
		 "  'id', n.id, 'address', n.address, "
		 "  'state', CASE WHEN n.down_at IS NOT NULL THEN 'down' "
		 "    WHEN n.stopped_at IS NOT NULL THEN 'stopped' "
		 "    WHEN n.heartbeat_at <= now() - make_interval(secs => $1::int) THEN 'stale' "
		 "    WHEN n.drain_at IS NOT NULL THEN 'draining' ELSE 'up' END, "
		 "  'heartbeat_at', rfc3339(n.heartbeat_at), 'down_at', rfc3339(n.down_at), "
		 "  'drain_at', rfc3339(n.drain_at), 'stopped_at', rfc3339(n.stopped_at), "
		 "  'image_hash', n.image_hash, "
		 "  'capacity', jsonb_build_object('vcpus', n.vcpu_milli::float8 / 1000, "
		 "    'memory_mib', n.memory_mib, 'disk_gib', n.disk_gib, "
		 "    'max_sandboxes', n.max_sandboxes), "
		 "  'used', jsonb_build_object('vcpus', u.v::float8 / 1000, 'memory_mib', u.m, "
		 "    'disk_gib', u.d, 'running', u.r, 'paused', u.p, 'lost', u.l)) ORDER BY n.id), "
		 "  '[]')::text FROM nodes n LEFT JOIN LATERAL ("
		 "  SELECT count(*) FILTER (WHERE s.state IN ('creating', 'running')) AS r, "
		 "         count(*) FILTER (WHERE s.state = 'paused') AS p, "
		 "         count(*) FILTER (WHERE s.state = 'lost') AS l, "
		 "         coalesce(sum(vcpu_milli) FILTER (WHERE s.state IN ('creating', 'running')), 0) AS v, "
		 "         coalesce(sum(memory_mib) FILTER (WHERE s.state IN ('creating', 'running')), 0) AS m, "
		 "         coalesce(sum(disk_gib) FILTER (WHERE s.state IN ('creating', 'running', 'paused')), 0) AS d "
		 "  FROM sandboxes s WHERE s.node_id = n.id AND s.deleted_at IS NULL) u ON true",
		 after);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	http_reply_json(req, 200,
			json_pack("{s:o}", "nodes", json_loads(pg_res_str(res, 0, 0), 0, NULL)));
	pg_res_free(res);
}

/* ---- POST /v1/admin/nodes/{id}/drain ---- */

/* What one sandbox of a drained node became. */
struct drained {
	json_t *moved;	/* running, resumed on another node: [{id, node}] */
	json_t *kept;	/* left where it is, with why: [{id, state, reason}] */
};

static void drain_keep(struct drained *d, const char *id, const char *state, const char *why)
{
	json_array_append_new(d->kept, json_pack("{s:s, s:s, s:s}", "id", id, "state", state,
						 "reason", why));
}

/*
 * Calls the node at `address` for sandbox `id` of `tenant` (POST `suffix`) as the gateway itself,
 * with time for a pause or a restore under load; the node's status, 0 when it did not answer.
 */
static long drain_call(struct http_req *req, const char *address, const char *id,
		       const char *tenant, const char *suffix)
{
	struct gateway *gw = http_req_app(req);
	struct principal who = { .scopes = AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_SANDBOX_WRITE };
	char path[160], *body = NULL;
	long status = 0;
	size_t len = 0;
	bool replied = false;

	snprintf(who.tenant_id, sizeof(who.tenant_id), "%s", tenant);
	snprintf(who.key_id, sizeof(who.key_id), "%s", DRAIN_SUBJECT);
	snprintf(path, sizeof(path), "/v1/sandboxes/%s%s", id, suffix);
	node_call_sync(req, &(struct node_call){ .address = address, .method = "POST", .path = path,
						 .sandbox_id = id, .who = &who, .upload_fd = -1,
						 .timeout_ms = gw->cfg.node_drain_wait_s * 1000L },
		       &status, &body, &len, &replied);
	if (status && status != 200)
		log_warn("drain: %s of \"%s\" answered %ld: %.*s", suffix, id, status, (int)len,
			 body ? body : "");
	free(body);
	return replied ? 0 : status;
}

/*
 * Waits until the pause snapshot of `id` is stored in its tenant's bucket: "stored", or its
 * status when it cannot be (local: no bucket; failed), or "timeout" after node_drain_wait_s.
 */
static void drain_wait_stored(struct gateway *gw, const char *id, char *out, size_t len)
{
	long long until = clock_mono_ms() + gw->cfg.node_drain_wait_s * 1000;

	snprintf(out, len, "timeout");
	while (clock_mono_ms() < until) {
		struct kiln_error err = { 0 };
		struct pg_res *res = NULL;
		struct pg_conn *c;
		bool bucket = false;

		if (pg_acquire(gw->pg, &c, &err) == KILN_OK) {
			if (PGQ(c, &res, &err,
				"SELECT p.status, EXISTS (SELECT 1 FROM tenant_storage t "
				"WHERE t.tenant_id = s.tenant_id) FROM sandboxes s "
				"JOIN snapshots p ON p.id = s.pause_snapshot WHERE s.id = $1",
				id) == KILN_OK && pg_res_rows(res) == 1) {
				snprintf(out, len, "%s", pg_res_str(res, 0, 0));
				bucket = pg_res_bool(res, 0, 1);
			}
			pg_res_free(res);
			pg_release(gw->pg, c);
		}
		if (!strcmp(out, "stored") || !strcmp(out, "failed") ||
		    (!bucket && !strcmp(out, "local")))
			return;
		sleep(1);
	}
}

/*
 * The live node other than `except` with the most free capacity for the shape of sandbox `id`
 * (as a create's placement) that has the guest image of its pause snapshot (node_images), into
 * `address`; false when none has room.
 */
static bool drain_target(struct gateway *gw, const char *id, const char *except, char *address,
			 size_t alen, char *node, size_t nlen)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	char after[24];
	bool ok = false;

	snprintf(after, sizeof(after), "%s", gw_node_down_after_s(gw));
	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return false;
	if (PGQ(c, &res, &err,
		"SELECT n.address, n.id FROM sandboxes x, nodes n LEFT JOIN LATERAL ("
		"  SELECT count(*) FILTER (WHERE s.state <> 'paused') AS k, "
		"         coalesce(sum(vcpu_milli) FILTER (WHERE s.state <> 'paused'), 0) AS v, "
		"         coalesce(sum(memory_mib) FILTER (WHERE s.state <> 'paused'), 0) AS m, "
		"         coalesce(sum(disk_gib), 0) AS d FROM sandboxes s "
		"  WHERE s.node_id = n.id AND s.deleted_at IS NULL "
		"  AND s.state IN ('creating', 'running', 'paused')) u ON true "
		"WHERE x.id = $1 AND n.id <> $2 AND " GW_NODE_LIVE_SQL("n", "$3") " "
		"AND u.k < n.max_sandboxes AND u.v + x.vcpu_milli <= n.vcpu_milli "
		"AND u.m + x.memory_mib <= n.memory_mib "
		"AND (n.disk_gib IS NULL OR u.d + x.disk_gib <= n.disk_gib) "
		"AND NOT EXISTS (SELECT 1 FROM snapshots p WHERE p.id = x.pause_snapshot "
		"  AND p.image_hash IS NOT NULL AND NOT EXISTS (SELECT 1 FROM node_images i "
		"    WHERE i.node_id = n.id AND i.image_hash = p.image_hash)) "
		"ORDER BY n.memory_mib - u.m DESC, n.id LIMIT 1",
		id, except, after) == KILN_OK && pg_res_rows(res) == 1) {
		snprintf(address, alen, "%s", pg_res_str(res, 0, 0));
		snprintf(node, nlen, "%s", pg_res_str(res, 0, 1));
		ok = true;
	}
	pg_res_free(res);
	pg_release(gw->pg, c);
	return ok;
}

/* Moves sandbox `id` (running on the drained node at `address`) to another node, or says why not. */
static void drain_one(struct http_req *req, const char *node_id, const char *address,
		      const char *id, const char *tenant, const char *state, struct drained *d)
{
	struct gateway *gw = http_req_app(req);
	char status[16], to[256], to_node[64];
	long st;

	if (!strcmp(state, "running")) {
		st = drain_call(req, address, id, tenant, "/pause");
		if (st != 200) {
			drain_keep(d, id, state, st ? "the node refused its pause"
						    : "the node did not answer its pause");
			return;
		}
	}
	drain_wait_stored(gw, id, status, sizeof(status));
	if (strcmp(status, "stored") != 0) {
		drain_keep(d, id, "paused",
			   !strcmp(status, "local") ? "its tenant has no bucket: its snapshot stays on "
						      "this node"
			   : !strcmp(status, "failed") ? "its snapshot could not be stored in its bucket"
						       : "its snapshot was not stored in time");
		return;
	}
	if (strcmp(state, "running") != 0) {
		drain_keep(d, id, "paused", "paused, stored in its bucket: it resumes on another node");
		return;
	}
	if (!drain_target(gw, id, node_id, to, sizeof(to), to_node, sizeof(to_node))) {
		drain_keep(d, id, "paused", "no other node has room and its guest image: it stays "
					    "paused, in its bucket");
		return;
	}
	st = drain_call(req, to, id, tenant, "/resume");
	if (st != 200) {
		drain_keep(d, id, "paused", "its resume on another node failed: it stays paused");
		return;
	}
	json_array_append_new(d->moved, json_pack("{s:s, s:s}", "id", id, "node", to_node));
}

static void node_drain(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL, *sbs = NULL;
	struct drained d = { json_array(), json_array() };
	struct pg_conn *c;
	char address[256];
	enum kiln_err rc;

	http_req_set_object(req, id);
	nodes_down_now(gw);	/* a drain acts on whether the node is down: asked now, not within 1 s */
	c = gw_db(req);
	if (!c)
		goto out;
	/* No new placement on it from now on; then what it holds now. */
	rc = PGQ(c, &res, &err,
		 "UPDATE nodes SET drain_at = coalesce(drain_at, now()) WHERE id = $1 "
		 "RETURNING address, down_at IS NOT NULL",
		 id);
	if (rc == KILN_OK && pg_res_rows(res) == 1)
		rc = PGQ(c, &sbs, &err,
			 "SELECT s.id, s.tenant_id, s.state, coalesce(p.status, '') FROM sandboxes s "
			 "LEFT JOIN snapshots p ON p.id = s.pause_snapshot WHERE s.node_id = $1 "
			 "AND s.deleted_at IS NULL AND s.state IN ('running', 'paused') "
			 "AND s.delete_requested_at IS NULL ORDER BY s.created_at, s.id",
			 id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		goto out;
	}
	if (pg_res_rows(res) != 1) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no node \"%s\"", id);
		goto out;
	}
	snprintf(address, sizeof(address), "%s", pg_res_str(res, 0, 0));
	log_info("draining node \"%s\": %d sandboxes", id, pg_res_rows(sbs));
	for (int i = 0; i < pg_res_rows(sbs); i++) {
		if (!pg_res_bool(res, 0, 1)) {
			drain_one(req, id, address, pg_res_str(sbs, i, 0), pg_res_str(sbs, i, 1),
				  pg_res_str(sbs, i, 2), &d);
			continue;
		}
		/* Down: nothing to call; its running sandboxes were lost, its paused ones wait. */
		drain_keep(&d, pg_res_str(sbs, i, 0), pg_res_str(sbs, i, 2),
			   !strcmp(pg_res_str(sbs, i, 3), "stored")
				   ? "the node is down; paused, stored in its bucket: it resumes on "
				     "another node"
				   : "the node is down and its snapshot is only there: it resumes once "
				     "the node is back");
	}
	http_reply_json(req, 200, json_pack("{s:s, s:O, s:O}", "node", id, "moved", d.moved,
					    "kept", d.kept));
out:
	json_decref(d.moved);
	json_decref(d.kept);
	pg_res_free(res);
	pg_res_free(sbs);
}

/* POST /v1/admin/nodes/{id}/undrain: placement on the node again. */
static void node_undrain(struct http_req *req)
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
		return;
	rc = PGQ(c, &res, &err, "UPDATE nodes SET drain_at = NULL WHERE id = $1 RETURNING id", id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else if (pg_res_rows(res) != 1)
		http_reply_error(req, KILN_E_NOT_FOUND, "no node \"%s\"", id);
	else
		http_reply_json(req, 200, json_pack("{s:s, s:s}", "node", id, "state", "up"));
	pg_res_free(res);
}

static const struct http_route routes[] = {
	{ "GET", "/v1/admin/nodes", nodes_list, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0, NULL, 0 },
	{ "POST", "/v1/admin/nodes/{id}/drain", node_drain, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0, NULL,
	  0 },
	{ "POST", "/v1/admin/nodes/{id}/undrain", node_undrain, ROUTE_AUTH | AUTH_SCOPE_ADMIN, 0,
	  NULL, 0 },
};

const struct route_group routes_nodes = { routes, sizeof(routes) / sizeof(routes[0]) };
