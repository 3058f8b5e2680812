/*
 * routes_sandboxes.c - the sandbox routes of docs/openapi.yaml: create, list, get, delete, exec, files,
 * timeout. Reads come from Postgres; everything that touches a VM goes to the sandbox's node.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "api/nodeclient.h"
#include "api/ports.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/log.h"
#include "metering/billing.h"
#include "metering/plan.h"
#include "record/record.h"

#define FILE_MAX (100u << 20)

static const char *const states[] = { "creating", "running", "paused", "stopped", "error", "lost", NULL };

/* The sandbox row a request names, when it is the caller's and not deleted. */
struct sb_row {
	char id[64];
	char state[16];
	char node_address[256];
	bool node_alive;	/* its node's heartbeat is fresh and it is not marked down */
	bool node_draining;	/* its node takes no new work (POST /v1/admin/nodes/{id}/drain, or
				   a clean stop: migrations/0029) */
	char node_id[64];
	char snap_status[16];	/* its pause snapshot's (local, uploading, stored, failed), or "" */
	char snap_image[128];	/* its pause snapshot's guest image (hash), or "" */
	unsigned vcpu_milli, mem_mib, disk_gib;
	long long generation;	/* the record's generation when read (fences the gateway's write) */
};

/*
 * Looks the sandbox up for the caller without replying: KILN_E_NOT_FOUND when it is absent,
 * deleted or another tenant's, KILN_E_UNAVAILABLE when Postgres is down.
 */
static enum kiln_err sandbox_find(struct http_req *req, struct sb_row *out)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char after[24];
	enum kiln_err rc;

	http_req_set_object(req, id);
	gw_nodes_down(gw);
	snprintf(after, sizeof(after), "%s", gw_node_down_after_s(gw));
	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return KILN_E_UNAVAILABLE;
	rc = PGQ(c, &res, &err,
		 "SELECT s.id, s.state, coalesce(n.address, ''), "
		 "coalesce(" GW_NODE_FRESH_SQL("n", "$3") ", false), "
		 "s.vcpu_milli, s.memory_mib, s.generation, s.disk_gib, "
		 "n.drain_at IS NOT NULL OR n.stopped_at IS NOT NULL, "
		 "coalesce(s.node_id, ''), coalesce((SELECT p.status FROM snapshots p "
		 "WHERE p.id = s.pause_snapshot), ''), coalesce((SELECT p.image_hash FROM snapshots p "
		 "WHERE p.id = s.pause_snapshot), '') FROM sandboxes s "
		 "LEFT JOIN nodes n ON n.id = s.node_id "
		 "WHERE s.id = $1 AND s.tenant_id = $2 AND s.deleted_at IS NULL",
		 id, who->tenant_id, after);
	pg_release(gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = KILN_E_NOT_FOUND;
	if (rc == KILN_OK) {
		snprintf(out->id, sizeof(out->id), "%s", pg_res_str(res, 0, 0));
		snprintf(out->state, sizeof(out->state), "%s", pg_res_str(res, 0, 1));
		snprintf(out->node_address, sizeof(out->node_address), "%s", pg_res_str(res, 0, 2));
		out->node_alive = pg_res_bool(res, 0, 3);
		out->vcpu_milli = (unsigned)pg_res_int(res, 0, 4, 0);
		out->mem_mib = (unsigned)pg_res_int(res, 0, 5, 0);
		out->generation = pg_res_int(res, 0, 6, 0);
		out->disk_gib = (unsigned)pg_res_int(res, 0, 7, 0);
		out->node_draining = pg_res_bool(res, 0, 8);
		snprintf(out->node_id, sizeof(out->node_id), "%s", pg_res_str(res, 0, 9));
		snprintf(out->snap_status, sizeof(out->snap_status), "%s", pg_res_str(res, 0, 10));
		snprintf(out->snap_image, sizeof(out->snap_image), "%s", pg_res_str(res, 0, 11));
	}
	pg_res_free(res);
	return rc == KILN_OK || rc == KILN_E_NOT_FOUND ? rc : KILN_E_UNAVAILABLE;
}

/* Replies for a failed sandbox_find(). */
static void sandbox_find_failed(struct http_req *req, enum kiln_err rc)
{
	if (rc == KILN_E_NOT_FOUND)
		http_reply_error(req, rc, "no sandbox \"%s\"", http_req_param(req, "id"));
	else
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
}

/* Looks the sandbox up for the caller; replies 404 (or 503) and returns false when absent. */
static bool sandbox_lookup(struct http_req *req, struct sb_row *out)
{
	enum kiln_err rc = sandbox_find(req, out);

	if (rc != KILN_OK)
		sandbox_find_failed(req, rc);
	return rc == KILN_OK;
}

/* Replies 409 unless the sandbox runs. */
static bool sandbox_running(struct http_req *req, const struct sb_row *sb)
{
	if (strcmp(sb->state, "running") == 0)
		return true;
	http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb->state);
	return false;
}

/* ---- POST /v1/sandboxes ---- */

/*
 * Credits and plan limits for `count` more of the caller's sandboxes of `vcpu_milli` and `mem_mib`
 * each: false after replying 402 (no credits), 403 (a plan limit) or 503 (Redis down: nothing
 * changed). The node checks the plan again as it records them (metering/plan.h).
 */
static bool admit(struct http_req *req, struct pg_conn *c, unsigned count, unsigned vcpu_milli,
		  unsigned mem_mib)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	enum kiln_err rc = billing_admit(gw->rds, c, gw_principal(req)->tenant_id, count, vcpu_milli,
					 mem_mib, &err);

	if (rc == KILN_OK)
		return true;
	if (rc == KILN_E_UNAVAILABLE)
		http_reply_error(req, rc, "billing is unavailable: nothing was changed");
	else
		gw_fail(req, rc, &err);
	return false;
}

/*
 * Picks the live node (fresh heartbeat, not down, not draining, not stopped) with the most free
 * capacity that has room for the sandbox, and has guest image `image` when it is not "" (the
 * pause snapshot's of a sandbox resumed elsewhere: node_images, migrations/0030): its count,
 * vCPUs and memory against what its running sandboxes hold, and `disk_gib` of disk against the disk it promises (nodes.disk_gib; paused sandboxes hold
 * theirs too). The most free capacity: the largest mean of the fractions of its vCPUs, memory
 * and disk left once the sandbox is there (a node that does not report its disk counts its disk
 * as free). One statement. False (replied 503 naming vCPUs, memory and disk) when there is
 * none. Two placements at once may both pick a node with room for one: the node admits each
 * again under its own lock as it reserves it (node/create.c), and the second gets 503.
 * `snap`, when not "", is a template's image: the nodes holding it come first (snapshot_held,
 * migrations/0040), and the others are taken only when it is stored in the tenant's bucket (the
 * node fetches it).
 */
static bool place(struct http_req *req, struct pg_conn *c, unsigned vcpu_milli, unsigned mem_mib,
		  unsigned disk_gib, const char *image, const char *snap, char *address,
		  size_t alen)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	char v[16], m[16], d[16], after[24];
	enum kiln_err rc;
	bool ok;

	gw_nodes_down(http_req_app(req));
	snprintf(after, sizeof(after), "%s", gw_node_down_after_s(http_req_app(req)));
	snprintf(v, sizeof(v), "%u", vcpu_milli);
	snprintf(m, sizeof(m), "%u", mem_mib);
	snprintf(d, sizeof(d), "%u", disk_gib);
	rc = PGQ(c, &res, &err,
		 "SELECT n.address FROM nodes n LEFT JOIN LATERAL ("
		 "  SELECT count(*) FILTER (WHERE s.state <> 'paused') AS k, "
		 "         coalesce(sum(vcpu_milli) FILTER (WHERE s.state <> 'paused'), 0) AS v, "
		 "         coalesce(sum(memory_mib) FILTER (WHERE s.state <> 'paused'), 0) AS m, "
		 "         coalesce(sum(disk_gib), 0) AS d FROM sandboxes s "
		 "  WHERE s.node_id = n.id AND s.deleted_at IS NULL "
		 "  AND s.state IN ('creating', 'running', 'paused')"
		 ") u ON true "
		 "WHERE " GW_NODE_LIVE_SQL("n", "$4") " "
		 "AND u.k < n.max_sandboxes AND u.v + $1::int <= n.vcpu_milli "
		 "AND u.m + $2::int <= n.memory_mib "
		 "AND (n.disk_gib IS NULL OR u.d + $3::int <= n.disk_gib) "
		 "AND ($5 = '' OR EXISTS (SELECT 1 FROM node_images i WHERE i.node_id = n.id "
		 "  AND i.image_hash = $5)) "
		 "AND ($6 = '' OR snapshot_held($6, n.id) OR EXISTS (SELECT 1 FROM snapshots p "
		 "  WHERE p.id = $6 AND p.status = 'stored')) "
		 "ORDER BY ($6 <> '' AND snapshot_held($6, n.id)) DESC, "
		 "  ((n.vcpu_milli - u.v - $1::int)::float8 / greatest(n.vcpu_milli, 1) "
		 "  + (n.memory_mib - u.m - $2::int)::float8 / greatest(n.memory_mib, 1) "
		 "  + CASE WHEN n.disk_gib IS NULL THEN 1 "
		 "    ELSE (n.disk_gib - u.d - $3::int)::float8 / greatest(n.disk_gib, 1) END) DESC, "
		 "n.id LIMIT 1",
		 v, m, d, after, image, snap);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return false;
	}
	ok = pg_res_rows(res) == 1;
	if (ok)
		snprintf(address, alen, "%s", pg_res_str(res, 0, 0));
	else
		http_reply_error(req, KILN_E_NO_CAPACITY,
				 "no node has room for this sandbox (%u.%03u vCPUs, %u MiB of memory, "
				 "%u GiB of disk)%s%s%s%s",
				 vcpu_milli / 1000, vcpu_milli % 1000, mem_mib, disk_gib,
				 image[0] ? " and its snapshot's guest image \"" : "", image,
				 image[0] ? "\"" : "",
				 snap[0] ? " that holds the template's image or can fetch it from the "
					   "tenant's bucket" : "");
	pg_res_free(res);
	return ok;
}

/*
 * The tenant's template cr->template: its latest ready version's warm image (`snap`), that
 * image's guest image hash (`image`, "" when unknown), its shape into *milli and *mem (a create
 * asking another is 422 naming the template's), its disk into *disk unless a larger one is asked
 * (a smaller one is 422), its ENV into *env (a new object). Replies and returns false when it
 * cannot be used.
 */
static bool template_source(struct http_req *req, struct pg_conn *c, const struct apireq_create *cr,
			    long long *milli, long long *mem, long long *disk, char *snap,
			    size_t slen, char *image, size_t ilen, json_t **env)
{
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	bool ok = false;
	long long tv, tm, td;
	enum kiln_err rc;

	rc = PGQ(c, &res, &err,
		 "SELECT v.snapshot_id, coalesce(s.image_hash, ''), v.vcpu_milli, v.memory_mib, "
		 "v.disk_gib, coalesce(v.env, '{}'::jsonb)::text FROM templates t "
		 "JOIN template_versions v ON v.template_id = t.id "
		 "JOIN snapshots s ON s.id = v.snapshot_id AND s.deleted_at IS NULL "
		 "WHERE t.tenant_id = $1 AND t.name = $2 AND t.deleted_at IS NULL "
		 "AND v.status = 'ready' ORDER BY v.version DESC LIMIT 1",
		 who->tenant_id, cr->template);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return false;
	}
	if (pg_res_rows(res) != 1) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no template \"%s\" with a ready version",
				 cr->template);
		goto out;
	}
	tv = pg_res_int(res, 0, 2, 0);
	tm = pg_res_int(res, 0, 3, 0);
	td = pg_res_int(res, 0, 4, 0);
	if ((json_object_get(cr->body, "vcpus") && *milli != tv) ||
	    (json_object_get(cr->body, "memory_mib") && *mem != tm)) {
		http_reply_error(req, KILN_E_INVALID,
				 "template \"%s\" has %lld.%03lld vCPUs and %lld MiB of memory: "
				 "leave vcpus and memory_mib out or ask for those",
				 cr->template, tv / 1000, tv % 1000, tm);
		goto out;
	}
	if (json_object_get(cr->body, "disk_gib") && *disk < td) {
		http_reply_error(req, KILN_E_INVALID,
				 "disk_gib must be at least %lld, the size of template \"%s\"", td,
				 cr->template);
		goto out;
	}
	if (!json_object_get(cr->body, "disk_gib"))
		*disk = td;
	*milli = tv;
	*mem = tm;
	snprintf(snap, slen, "%s", pg_res_str(res, 0, 0));
	snprintf(image, ilen, "%s", pg_res_str(res, 0, 1));
	*env = json_loads(pg_res_str(res, 0, 5), 0, NULL);
	ok = *env != NULL;
	if (!ok)
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
out:
	pg_res_free(res);
	return ok;
}

static void sandbox_create(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct apireq_create cr;
	struct kiln_error perr = { 0 };
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	json_t *body, *nb = NULL;
	struct pg_conn *c = NULL;
	char id[AUTH_ID_MAX], address[256] = "", path[128], *text = NULL, *meta;
	char snap_of[AUTH_ID_MAX] = "", snap_image[128] = "";
	json_t *tenv = NULL;
	long long mem, disk, tmo, milli;

	if (apireq_create(btext, blen, &cr, &perr) != KILN_OK) {
		http_reply_error(req, perr.code, "%s", perr.msg);
		goto out;
	}
	body = cr.body;
	meta = cr.metadata;
	milli = cr.vcpu_milli;
	mem = cr.mem_mib;
	disk = cr.disk_gib;
	tmo = cr.timeout_s;
	c = gw_db(req);
	if (c && cr.template &&
	    !template_source(req, c, &cr, &milli, &mem, &disk, snap_of, sizeof(snap_of), snap_image,
			     sizeof(snap_image), &tenv))
		goto out;
	if (!c || !admit(req, c, 1, (unsigned)milli, (unsigned)mem))
		goto out;
	if (cr.template) {
		/* from the template's warm image: on a node holding it, else one that fetches it */
		if (!place(req, c, (unsigned)milli, (unsigned)mem, (unsigned)disk, snap_image, snap_of,
			   address, sizeof(address)))
			goto out;
	} else if (json_str(body, "snapshot_id", NULL)) {
		/*
		 * From a snapshot: on the node that holds it, in the snapshot's shape, with its disk
		 * or a larger one when disk_gib asks (never a smaller one).
		 */
		struct kiln_error err = { 0 };
		struct pg_res *res = NULL;
		enum kiln_err rc = PGQ(c, &res, &err,
				       "SELECT n.address, s.disk_gib FROM snapshots s JOIN nodes n "
				       "ON n.id = s.node_id "
				       "WHERE s.id = $1 AND s.tenant_id = $2 AND s.kind = 'named' "
				       "AND s.deleted_at IS NULL",
				       json_str(body, "snapshot_id", ""), who->tenant_id);
		bool found = rc == KILN_OK && pg_res_rows(res) == 1;
		bool asked = json_is_integer(json_object_get(body, "disk_gib"));
		long long snap_disk = found ? pg_res_int(res, 0, 1, 0) : 0;

		if (found && asked && disk < snap_disk)
			http_reply_error(req, KILN_E_INVALID,
					 "disk_gib must be at least %lld, the size of snapshot \"%s\"",
					 snap_disk, json_str(body, "snapshot_id", ""));
		else if (found)
			snprintf(address, sizeof(address), "%s", pg_res_str(res, 0, 0));
		else if (rc == KILN_OK)
			http_reply_error(req, KILN_E_NOT_FOUND, "no snapshot \"%s\"",
					 json_str(body, "snapshot_id", ""));
		else
			gw_fail(req, rc, &err);
		pg_res_free(res);
		if (rc != KILN_OK || !address[0])
			goto out;
		if (!asked)
			disk = snap_disk;
	} else if (!place(req, c, (unsigned)milli, (unsigned)mem, (unsigned)disk, "", "", address,
			  sizeof(address))) {
		goto out;
	}
	pg_release(gw->pg, c);
	c = NULL;
	if (!gw_new_id(req, "sb_", id, sizeof(id)))
		goto out;
	http_req_set_object(req, id);
	if (json_is_true(json_object_get(body, "auto_resume")) && !port_settings_create(req, id))
		goto out;	/* its setting first (api/ports.c): the node then makes the sandbox */
	/* The node validates env, egress and bandwidth (422 naming the bad one) before it boots. */
	if (tenv && json_is_object(json_object_get(body, "env")))
		json_object_update(tenv, json_object_get(body, "env"));	/* the caller's win */
	nb = json_pack("{s:s, s:I, s:I, s:I, s:I, s:O?, s:o, s:O?, s:O?, s:o?, s:O?}", "template",
		       cr.template ? cr.template : cr.builtin ? cr.builtin : "python",
		       "vcpu_milli", (json_int_t)milli, "memory_mib", (json_int_t)mem, "disk_gib",
		       (json_int_t)disk, "timeout_s", (json_int_t)tmo, "env",
		       tenv ? tenv : json_object_get(body, "env"), "metadata",
		       json_loads(meta ? meta : "{}", 0, NULL),
		       "egress", json_object_get(body, "egress"), "bandwidth",
		       json_object_get(body, "bandwidth"), "snapshot_id",
		       snap_of[0] ? json_string(snap_of)
				  : json_incref(json_object_get(body, "snapshot_id")),
		       "secrets", json_object_get(body, "secrets"));
	text = nb ? json_dumps(nb, JSON_COMPACT) : NULL;
	if (!text) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s", id);
	log_info("placing sandbox \"%s\" on \"%s\"", id, address);
	node_proxy(req, &(struct node_call){ .address = address, .method = "POST", .path = path,
					      .sandbox_id = id, .who = who, .body = text,
					      .body_len = strlen(text), .upload_fd = -1,
					      .content_type = "application/json" });
out:
	if (c)
		pg_release(gw->pg, c);
	if (text)
		explicit_bzero(text, strlen(text));	/* it may carry secrets' values */
	free(text);
	json_decref(nb);
	json_decref(tenv);
	apireq_create_free(&cr);
}

/* ---- GET /v1/sandboxes, GET /v1/sandboxes/{id} ---- */

/*
 * `?state=`: one state or several, comma-separated (at most one of each); writes a Postgres text
 * array literal of them to `out`. Replies 422 and returns false when one is not a state.
 */
static bool list_states(struct http_req *req, const char *state, char *out, size_t n)
{
	const char *p = state;
	size_t used = 0;

	out[used++] = '{';
	if (!*p) {
		http_reply_error(req, KILN_E_INVALID, "state must not be empty");
		return false;
	}
	while (*p) {
		size_t len = strcspn(p, ",");
		bool ok = false;

		for (int i = 0; states[i]; i++)
			ok = ok || (strlen(states[i]) == len && strncmp(states[i], p, len) == 0);
		if (!ok || used + len + 2 >= n) {
			http_reply_error(req, KILN_E_INVALID, "state must be one or more of creating, "
							      "running, paused, stopped, error (comma-separated)");
			return false;
		}
		if (used > 1)
			out[used++] = ',';
		memcpy(out + used, p, len);
		used += len;
		p += len;
		if (*p == ',' && *++p == '\0') {
			http_reply_error(req, KILN_E_INVALID, "state must not end with a comma");
			return false;
		}
	}
	out[used++] = '}';
	out[used] = '\0';
	return true;
}


/*
 * A sandbox's JSON as the API shows it, over a row `s` of sandboxes: sandbox_json() (migrations;
 * since 0024 it carries the gateway's own settings of it, `auto_resume`, docs/ports.md).
 */
#define SANDBOX_JSON_SQL "sandbox_json(s)::text"

static void sandbox_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *state = http_req_query(req, "state"), *meta = http_req_query(req, "metadata");
	const char *tmpl = http_req_query(req, "template");
	char state_set[128];
	struct gw_page page;
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	if (!gw_page_parse(req, 50, 100, "sb_", &page))
		return;
	if (state && !list_states(req, state, state_set, sizeof(state_set)))
		return;
	if (meta) {
		/* Only the sandboxes whose metadata holds every key of this object with its value. */
		json_t *m = strlen(meta) <= APIREQ_METADATA_MAX ? json_loads(meta, 0, NULL) : NULL;
		bool ok = json_is_object(m);

		json_decref(m);
		if (!ok) {
			http_reply_error(req, KILN_E_INVALID, "metadata must be a JSON object (at most "
							      "%d bytes)", APIREQ_METADATA_MAX);
			return;
		}
	}
	if (tmpl && strlen(tmpl) > 256) {
		http_reply_error(req, KILN_E_INVALID, "template is at most 256 bytes");
		return;
	}
	gw_nodes_down(gw);
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT " SANDBOX_JSON_SQL ", "
		 "(extract(epoch FROM s.created_at) * 1000000)::bigint || '.' || s.id "
		 "FROM sandboxes s WHERE s.tenant_id = $1 AND s.deleted_at IS NULL "
		 "AND ($2::text[] IS NULL OR s.state = ANY ($2::text[])) "
		 "AND ($3::text IS NULL OR (s.created_at, s.id) < "
		 "     (to_timestamp($3::bigint / 1000000.0), $4::text)) "
		 "AND ($6::jsonb IS NULL OR s.metadata @> $6::jsonb) "
		 "AND ($7::text IS NULL OR s.template = $7) "
		 "ORDER BY s.created_at DESC, s.id DESC LIMIT $5::int",
		 who->tenant_id, state ? state_set : NULL, page.t, page.id, page.lim, meta, tmpl);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	gw_reply_page(req, &page, res, "sandboxes");
}

static void sandbox_get(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc;

	gw_nodes_down(gw);	/* a sandbox of a node whose heartbeat lapsed shows lost */
	c = gw_db(req);
	if (!c)
		return;
	rc = PGQ(c, &res, &err,
		 "SELECT " SANDBOX_JSON_SQL " FROM sandboxes s "
		 "WHERE s.id = $1 AND s.tenant_id = $2 AND s.deleted_at IS NULL",
		 id, who->tenant_id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else if (pg_res_rows(res) == 0)
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
	else
		http_reply_data(req, 200, "application/json", pg_res_str(res, 0, 0),
				strlen(pg_res_str(res, 0, 0)));
	pg_res_free(res);
}

/* ---- DELETE, timeout, exec: forwarded ---- */

static void forward_body(struct http_req *req, const struct sb_row *sb, const char *suffix,
			 bool with_body, const char *body, size_t len);

static void forward(struct http_req *req, const struct sb_row *sb, const char *suffix,
		    bool with_body)
{
	size_t len = 0;
	const char *body = with_body ? http_req_body(req, &len) : NULL;

	forward_body(req, sb, suffix, with_body, body, len);
}

/* forward() with `body` in place of the request's. */
static void forward_body(struct http_req *req, const struct sb_row *sb, const char *suffix,
			 bool with_body, const char *body, size_t len)
{
	char path[4352];
	const char *q = http_req_query(req, "path"), *user = http_req_query(req, "user");

	snprintf(path, sizeof(path), "/v1/sandboxes/%s%s", sb->id, suffix);
	if (q) {
		char *esc = node_escape(q);
		if (!esc) {
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
			return;
		}
		snprintf(path + strlen(path), sizeof(path) - strlen(path), "?path=%s", esc);
		free(esc);
		if (user) {
			esc = node_escape(user);
			if (!esc) {
				http_reply_error(req, KILN_E_NOMEM, "out of memory");
				return;
			}
			snprintf(path + strlen(path), sizeof(path) - strlen(path), "&user=%s", esc);
			free(esc);
		}
	}
	node_proxy(req, &(struct node_call){ .address = sb->node_address,
					      .method = http_req_method(req), .path = path,
					      .sandbox_id = sb->id, .who = gw_principal(req),
					      .body = body, .body_len = len, .upload_fd = -1,
					      .content_type = with_body ? "application/json" : NULL,
					      .accept = http_req_header(req, "Accept") });
}

/*
 * Records the delete of `sb`, whose node is down, as requested (record_delete_requested): the
 * node carries it out when it comes back (node/recovery.c). The gateway writes a sandbox's row
 * only through record/record.h.
 */
static void sandbox_delete_request(struct http_req *req, const struct sb_row *sb)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	enum kiln_err rc = record_delete_requested(gw->pg, NULL, sb->id, &err);

	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	http_reply_empty(req, 204);	/* accepted for good: the sandbox is shown as deleting */
}

/*
 * DELETE /v1/sandboxes/{id}: the sandbox's node deletes it (204). A node that is live (fresh
 * heartbeat) but does not answer: 503, nothing changed. A node marked down: the delete is
 * recorded as requested (204, shown as deleting until the node carries it out). A node that no
 * longer holds the sandbox (404): the record goes.
 */
static void sandbox_delete(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct sb_row sb;
	struct kiln_error err = { 0 };
	char path[128], *body = NULL;
	long status = 0;
	size_t len = 0;
	bool replied = false;
	enum kiln_err rc = KILN_OK;

	if (!sandbox_lookup(req, &sb))
		return;
	snprintf(path, sizeof(path), "/v1/sandboxes/%s", sb.id);
	/* A lost sandbox: no node runs it (a node that comes back discards its VM, fenced). */
	if (sb.node_address[0] && strcmp(sb.state, "lost") != 0) {
		rc = node_call_sync(req, &(struct node_call){ .address = sb.node_address,
							      .method = "DELETE", .path = path,
							      .sandbox_id = sb.id, .who = gw_principal(req),
							      .upload_fd = -1 },
				    &status, &body, &len, &replied);
		if (replied)
			return;
	}
	if (rc == KILN_E_UNAVAILABLE) {
		free(body);
		if (sb.node_alive)
			http_reply_error(req, KILN_E_UNAVAILABLE,
					 "the sandbox's node did not answer; try again");
		else
			sandbox_delete_request(req, &sb);
		return;
	}
	if (status == 204) {
		free(body);
		http_reply_empty(req, 204);
		return;
	}
	if (sb.node_address[0] && strcmp(sb.state, "lost") != 0 && status != 404) {
		/* The node refused or failed (its record could not be written): its answer, as is. */
		http_reply_data(req, (int)status, "application/json", body ? body : "", len);
		free(body);
		return;
	}
	free(body);
	/*
	 * No node holds it (paused on a node that restarted, or never placed): the record goes; a
	 * node cleans up what it finds of it when it starts. Fenced on the generation read above
	 * (record_delete_unheld): a sandbox resumed or moved since is left as it is.
	 */
	rc = record_delete_unheld(gw->pg, NULL, sb.id, sb.generation, &err);
	if (rc == KILN_E_CONFLICT) {
		http_reply_error(req, KILN_E_CONFLICT,
				 "the sandbox changed while it was being deleted; try again");
		return;
	}
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	http_reply_empty(req, 204);
}

static void sandbox_timeout(struct http_req *req)
{
	struct sb_row sb;

	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, "/timeout", true);
}

static void sandbox_exec(struct http_req *req)
{
	struct sb_row sb;
	struct kiln_error err = { 0 };
	size_t len = 0;
	const char *body = http_req_body(req, &len);

	if (apireq_exec_user(body, len, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb)) {
		/* its template's WORKDIR and USER where the caller gives none (routes_templates.c) */
		struct gateway *gw = http_req_app(req);
		struct pg_conn *c = gw_db(req);
		char *nb = NULL;
		enum kiln_err rc;

		if (!c)
			return;
		rc = templates_exec_defaults(c, sb.id, body, len, &nb, &err);
		pg_release(gw->pg, c);
		if (rc != KILN_OK)
			gw_fail(req, rc, &err);
		else
			forward_body(req, &sb, "/exec", true, nb ? nb : body, nb ? strlen(nb) : len);
		free(nb);
	}
}

/* ---- processes: forwarded to the node (docs/sandboxes.md) ---- */

/* True when `s` is 1 to `max` decimal digits. */
static bool digits(const char *s, size_t max)
{
	return s[0] && strlen(s) <= max && strspn(s, "0123456789") == strlen(s);
}

/*
 * Forwards a processes request of a running sandbox to its node: `what` after the {pid} (NULL
 * for the collection), with ?replay and ?eof passed on. A {pid} that is not a number is 404 here.
 */
static void processes_forward(struct http_req *req, const char *what, bool with_body)
{
	const char *pid = http_req_param(req, "pid");
	const char *replay = http_req_query(req, "replay"), *eof = http_req_query(req, "eof");
	char suffix[128];
	struct sb_row sb;

	if (pid && !digits(pid, 10)) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no process \"%.32s\"", pid);
		return;
	}
	if ((replay && strcmp(replay, "0") && strcmp(replay, "1")) ||
	    (eof && strcmp(eof, "0") && strcmp(eof, "1"))) {
		http_reply_error(req, KILN_E_INVALID, "replay and eof are 0 or 1");
		return;
	}
	if (!pid)
		snprintf(suffix, sizeof(suffix), "/processes");
	else
		snprintf(suffix, sizeof(suffix), "/processes/%s/%s%s%s%s", pid, what,
			 replay ? (strcmp(replay, "0") ? "?replay=1" : "?replay=0") : "",
			 eof ? (replay ? "&" : "?") : "",
			 eof ? (strcmp(eof, "0") ? "eof=1" : "eof=0") : "");
	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, suffix, with_body);
}

static void processes_start(struct http_req *req)
{
	processes_forward(req, NULL, true);
}

static void processes_list(struct http_req *req)
{
	processes_forward(req, NULL, false);
}

static void processes_stream(struct http_req *req)
{
	processes_forward(req, "stream", false);
}

static void processes_stdin(struct http_req *req)
{
	processes_forward(req, "stdin", true);
}

static void processes_signal(struct http_req *req)
{
	processes_forward(req, "signal", true);
}

static void processes_resize(struct http_req *req)
{
	processes_forward(req, "resize", true);
}

/* ---- directory watches: forwarded to the node (docs/sandboxes.md) ---- */

/* Forwards a watches request of a running sandbox; {wid} a number (404 otherwise), ?wait_ms kept. */
static void watches_forward(struct http_req *req, bool with_body)
{
	const char *wid = http_req_param(req, "wid"), *wait = http_req_query(req, "wait_ms");
	char suffix[96];
	struct sb_row sb;

	if (wid && !digits(wid, 10)) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no watch \"%.32s\"", wid);
		return;
	}
	if (wait && !digits(wait, 5)) {
		http_reply_error(req, KILN_E_INVALID, "wait_ms must be from 0 to 30000");
		return;
	}
	snprintf(suffix, sizeof(suffix), "/watches%s%s%s%s", wid ? "/" : "", wid ? wid : "",
		 wait ? "?wait_ms=" : "", wait ? wait : "");
	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, suffix, with_body);
}

static void watches_add(struct http_req *req)
{
	watches_forward(req, true);
}

static void watches_read(struct http_req *req)
{
	watches_forward(req, false);
}

/* ---- pause, resume, fork ---- */

static void sandbox_pause(struct http_req *req)
{
	struct sb_row sb;

	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, "/pause", false);
}

static void sandbox_resume(struct http_req *req)
{
	struct sb_row sb;

	if (!sandbox_lookup(req, &sb))
		return;
	if (!strcmp(sb.state, "lost")) {
		http_reply_error(req, KILN_E_CONFLICT,
				 "the sandbox is lost: node \"%s\" went down while it ran (node_down); "
				 "only its delete is left",
				 sb.node_id);
		return;
	}
	if (strcmp(sb.state, "paused") != 0) {
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s, not paused", sb.state);
		return;
	}
	if (!sb.node_alive && strcmp(sb.snap_status, "stored") != 0) {
		/* Its node is down and its snapshot is on that node's disk alone. */
		http_reply_error(req, KILN_E_UNAVAILABLE,
				 "the sandbox's snapshot is only on node \"%s\", which is down (its "
				 "tenant's bucket does not hold it): it resumes once that node is back",
				 sb.node_id);
		return;
	}
	{
		struct gateway *gw = http_req_app(req);
		struct pg_conn *c = gw_db(req);
		bool ok;

		if (!c)
			return;
		ok = admit(req, c, 1, sb.vcpu_milli, sb.mem_mib);
		/* Its node is gone or drained: another one resumes it from the tenant's bucket. */
		if (ok && (!sb.node_alive || (sb.node_draining && !strcmp(sb.snap_status, "stored"))))
			ok = place(req, c, sb.vcpu_milli, sb.mem_mib, sb.disk_gib, sb.snap_image, "",
				   sb.node_address, sizeof(sb.node_address));
		pg_release(gw->pg, c);
		if (!ok)
			return;
	}
	forward(req, &sb, "/resume", false);
}

static void sandbox_fork(struct http_req *req)
{
	struct kiln_error perr = { 0 };
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	json_t *body, *ids;
	struct sb_row sb;
	unsigned count;
	char *text = NULL, path[128];

	if (apireq_fork(btext, blen, &count, &perr) != KILN_OK) {
		http_reply_error(req, perr.code, "%s", perr.msg);
		return;
	}
	if (!sandbox_lookup(req, &sb) || !sandbox_running(req, &sb))
		return;
	{
		struct gateway *gw = http_req_app(req);
		struct pg_conn *c = gw_db(req);
		bool ok;

		if (!c)
			return;
		ok = admit(req, c, (unsigned)count, sb.vcpu_milli, sb.mem_mib);
		pg_release(gw->pg, c);
		if (!ok)
			return;
	}
	ids = json_array();
	for (unsigned i = 0; i < count; i++) {
		char id[AUTH_ID_MAX];
		if (!gw_new_id(req, "sb_", id, sizeof(id))) {
			json_decref(ids);
			return;
		}
		json_array_append_new(ids, json_string(id));
	}
	body = json_pack("{s:o}", "ids", ids);
	text = body ? json_dumps(body, JSON_COMPACT) : NULL;
	json_decref(body);
	if (!text) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/fork", sb.id);
	node_proxy(req, &(struct node_call){ .address = sb.node_address, .method = "POST",
					      .path = path, .sandbox_id = sb.id, .who = gw_principal(req),
					      .body = text, .body_len = strlen(text), .upload_fd = -1,
					      .content_type = "application/json" });
	free(text);
}

static void sandbox_snapshot(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct sb_row sb;
	enum kiln_err rc;

	if (!sandbox_lookup(req, &sb))
		return;
	c = gw_db(req);
	if (!c)
		return;
	rc = plan_snapshot_check(c, gw_principal(req)->tenant_id, &err);
	pg_release(gw->pg, c);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	if (strcmp(sb.state, "running") != 0 && strcmp(sb.state, "paused") != 0) {
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb.state);
		return;
	}
	forward(req, &sb, "/snapshots", true);
}

/* GET and PUT of /egress and /bandwidth: forwarded; the node applies them live. */
static void sandbox_egress(struct http_req *req)
{
	struct sb_row sb;

	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, "/egress", strcmp(http_req_method(req), "PUT") == 0);
}

static void sandbox_bandwidth(struct http_req *req)
{
	struct sb_row sb;

	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, "/bandwidth", strcmp(http_req_method(req), "PUT") == 0);
}

static void files_get(struct http_req *req)
{
	struct sb_row sb;
	const char *path = http_req_query(req, "path");
	struct kiln_error err = { 0 };

	if (!path || path[0] != '/') {
		http_reply_error(req, KILN_E_INVALID, "path must be an absolute path inside the sandbox");
		return;
	}
	if (apireq_user(http_req_query(req, "user"), &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	if (sandbox_lookup(req, &sb) && sandbox_running(req, &sb))
		forward(req, &sb, "/files", false);
}

/*
 * A file upload streams through: the body goes to the node as it arrives. The sink cannot
 * reply (the body is still coming); what it refuses is answered by files_put at the end.
 */
struct upload {
	struct node_stream *ns;
	int fd;
	enum kiln_err refused;	/* why the upload never started */
	struct kiln_error err;	/* its message, for a refused user */
	char state[16];		/* of a sandbox that does not run */
};

static void upload_free(void *p)
{
	struct upload *u = p;

	if (u->fd >= 0)
		close(u->fd);
	node_stream_abort(u->ns);
	free(u);
}

static enum kiln_err upload_start(struct http_req *req, struct upload *u)
{
	const char *q = http_req_query(req, "path"), *user = http_req_query(req, "user");
	struct sb_row sb;
	char path[4352], *esc;
	enum kiln_err rc;

	if (!q || q[0] != '/')
		return KILN_E_INVALID;
	if (apireq_user(user, &u->err) != KILN_OK)
		return KILN_E_BAD_REQUEST;	/* files_put tells it from a bad path */
	rc = sandbox_find(req, &sb);
	if (rc != KILN_OK)
		return rc;
	if (strcmp(sb.state, "running") != 0) {
		snprintf(u->state, sizeof(u->state), "%s", sb.state);
		return KILN_E_CONFLICT;
	}
	esc = node_escape(q);
	if (!esc)
		return KILN_E_NOMEM;
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/files?path=%s%s%s", sb.id, esc,
		 user ? "&user=" : "", user ? user : "");
	free(esc);
	u->ns = node_stream_start(req, &(struct node_call){ .address = sb.node_address,
							     .method = "PUT", .path = path,
							     .sandbox_id = sb.id, .who = gw_principal(req),
							     .upload_fd = -1,
							     .content_type = "application/octet-stream" },
				  &u->fd);
	return u->ns ? KILN_OK : KILN_E_NOMEM;
}

static enum kiln_err upload_sink(struct http_req *req, const char *data, size_t len)
{
	struct upload *u = http_req_hctx(req);

	if (!u) {
		u = calloc(1, sizeof(*u));
		if (!u)
			return KILN_E_NOMEM;
		u->fd = -1;
		http_req_set_hctx(req, u, upload_free);
		u->refused = upload_start(req, u);
	}
	if (u->refused)
		return u->refused;
	while (len) {
		ssize_t w = write(u->fd, data, len);
		if (w < 0)
			return KILN_E_UNAVAILABLE;	/* the node hung up: its answer says why */
		data += w;
		len -= (size_t)w;
	}
	return KILN_OK;
}

static void files_put(struct http_req *req)
{
	struct upload *u = http_req_hctx(req);
	struct kiln_error err = { 0 };
	enum kiln_err src = http_req_stream_error(req, &err);

	if (src == KILN_E_TOO_LARGE) {
		http_reply_error(req, src, "a file is at most 100 MiB");
		return;	/* upload_free abandons the node's side: the file stays as it was */
	}
	if (!u) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	switch (u->refused) {
	case KILN_OK:
		break;
	case KILN_E_INVALID:
		http_reply_error(req, KILN_E_INVALID, "path must be an absolute path inside the sandbox");
		return;
	case KILN_E_BAD_REQUEST:
		http_reply_error(req, KILN_E_INVALID, "%s", u->err.msg);
		return;
	case KILN_E_CONFLICT:
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", u->state);
		return;
	case KILN_E_NOT_FOUND:
	case KILN_E_UNAVAILABLE:
		sandbox_find_failed(req, u->refused);
		return;
	default:
		http_reply_error(req, u->refused, "the upload could not start");
		return;
	}
	close(u->fd);
	u->fd = -1;
	node_stream_finish(req, u->ns);
	u->ns = NULL;
}

static const struct http_route routes[] = {
	{ "POST", "/v1/sandboxes", sandbox_create,
	  ROUTE_AUTH | ROUTE_CREATES | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes", sandbox_list, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}", sandbox_get, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "DELETE", "/v1/sandboxes/{id}", sandbox_delete, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/timeout", sandbox_timeout,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/exec", sandbox_exec, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes", processes_start,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/processes", processes_list, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ,
	  0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/processes/{pid}/stream", processes_stream,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes/{pid}/stdin", processes_stdin,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes/{pid}/signal", processes_signal,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes/{pid}/resize", processes_resize,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/watches", watches_add, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/watches/{wid}", watches_read,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "DELETE", "/v1/sandboxes/{id}/watches/{wid}", watches_read,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/files", files_get, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL,
	  0 },
	{ "PUT", "/v1/sandboxes/{id}/files", files_put, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE,
	  HTTP_BODY_STREAM, upload_sink, FILE_MAX },
	{ "POST", "/v1/sandboxes/{id}/pause", sandbox_pause, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/resume", sandbox_resume,
	  ROUTE_AUTH | ROUTE_CREATES | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/fork", sandbox_fork,
	  ROUTE_AUTH | ROUTE_CREATES | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/snapshots", sandbox_snapshot,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/egress", sandbox_egress, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0,
	  NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/egress", sandbox_egress, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/bandwidth", sandbox_bandwidth,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/bandwidth", sandbox_bandwidth,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
};

const struct route_group routes_sandboxes = { routes, sizeof(routes) / sizeof(routes[0]) };
