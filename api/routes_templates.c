/*
 * routes_templates.c - the template routes of docs/openapi.yaml (docs/templates.md): a tenant's own
 * templates, each a name with numbered versions. POST /v1/templates adds a version (making the
 * template when the name is new); GET lists and gets them; DELETE removes a template with all its
 * versions. Every query is scoped by the caller's tenant: another tenant's template is 404.
 *
 * A version (?version=N, the newest when left out) is built from a Dockerfile and a build
 * context: PUT .../dockerfile stores the
 * Dockerfile once parsed (422 naming the line), PUT .../source streams the context (a tar) to the
 * node chosen for the build, which builds it (node/build.c); GET .../log follows the build's log
 * as server-sent events. A version without a Dockerfile takes an image instead: an archive
 * streamed the same way (?format=oci-archive), or a registry reference to pull (?format=registry,
 * a JSON body checked and its credentials sealed here; the node is sent no body).
 */
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "api/nodeclient.h"
#include "auth/crypto.h"
#include "auth/scopes.h"
#include "common/clock.h"
#include "common/dockerfile.h"
#include "common/imageref.h"
#include "common/netaddr.h"
#include "common/pump.h"

#define TEMPLATE_SOURCE_MAX ((size_t)1 << 42)	/* the route's bound; the setting is checked */
#define PULL_BODY_MAX 16384			/* bytes of a registry pull's JSON body */

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
	/*
	 * Its images and the cached layers its builds made go once no sandbox or image stands on them
	 * (node/lifecycle.c, snap_gc).
	 */
	rc = PGQ(c, &res, &err,
		 "WITH t AS (UPDATE templates SET deleted_at = now() WHERE tenant_id = $1 "
		 "AND id = $2 AND deleted_at IS NULL RETURNING id), "
		 "l AS (DELETE FROM template_layers WHERE tenant_id = $1 AND template_id IN "
		 "(SELECT id FROM t) RETURNING snapshot_id), "
		 "s AS (UPDATE snapshots SET deleted_at = now() WHERE kind = 'build' AND tenant_id = $1 "
		 "AND deleted_at IS NULL AND (id IN (SELECT v.snapshot_id FROM template_versions v "
		 "JOIN t ON t.id = v.template_id) OR id IN (SELECT snapshot_id FROM l))) "
		 "SELECT id FROM t",
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

/*
 * The version a version route names: ?version=N (1 to 1000000), or the template's newest when
 * absent, as text into `v`. KILN_E_INVALID for a malformed one, KILN_E_NOT_FOUND when the caller
 * has no such template (another tenant's included); `err` says it.
 */
static enum kiln_err version_resolve(struct http_req *req, struct pg_conn *c, char v[16],
				     struct kiln_error *err)
{
	const char *q = http_req_query(req, "version"), *id = http_req_param(req, "id");
	struct pg_res *res = NULL;
	enum kiln_err rc;

	/* The caller's template first: another tenant's is 404 whatever else the request holds. */
	rc = PGQ(c, &res, err,
		 "SELECT (SELECT max(v.version) FROM template_versions v WHERE v.template_id = t.id) "
		 "FROM templates t WHERE t.tenant_id = $1 AND t.id = $2 AND t.deleted_at IS NULL",
		 gw_principal(req)->tenant_id, id);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "no template \"%s\"", id);
	if (rc == KILN_OK && q) {
		char *end = NULL;
		long n = strtol(q, &end, 10);
		if (!*q || *end || n < 1 || n > 1000000)
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "version must be a number from 1 to 1000000");
		else
			snprintf(v, 16, "%ld", n);
	} else if (rc == KILN_OK) {
		snprintf(v, 16, "%s", pg_res_str(res, 0, 0));
	}
	pg_res_free(res);
	return rc;
}

/*
 * Why a version could not be changed (missing: 404; not pending or without its Dockerfile: 409)
 * into `err`; returns its code.
 */
static enum kiln_err version_not_pending(struct http_req *req, struct pg_conn *c, const char *v,
					 const char *what, struct kiln_error *err)
{
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id");
	struct pg_res *res = NULL;
	enum kiln_err rc;

	rc = PGQ(c, &res, err,
		 "SELECT v.status, v.dockerfile IS NOT NULL FROM template_versions v "
		 "JOIN templates t ON t.id = v.template_id WHERE t.tenant_id = $1 AND t.id = $2 "
		 "AND v.version = $3::int AND t.deleted_at IS NULL",
		 who->tenant_id, id, v);
	if (rc != KILN_OK)
		;
	else if (pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "no version %s of template \"%s\"", v, id);
	else if (strcmp(pg_res_str(res, 0, 0), "pending") != 0)
		rc = kiln_error_set(err, KILN_E_CONFLICT,
				    "version %s of template \"%s\" is %s: %s only a pending version",
				    v, id, pg_res_str(res, 0, 0), what);
	else
		rc = kiln_error_set(err, KILN_E_CONFLICT,
				    "version %s of template \"%s\" has no Dockerfile yet: PUT "
				    "/v1/templates/%s/dockerfile?version=%s first",
				    v, id, id, v);
	pg_res_free(res);
	return rc;
}

/*
 * PUT /v1/templates/{id}/dockerfile[?version=N]: the version's Dockerfile, parsed (422 naming
 * the line, 413 past DOCKERFILE_MAX_BYTES) and stored while the version is pending. 204.
 */
static void templates_dockerfile(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct dockerfile df = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	size_t len;
	const char *text = http_req_body(req, &len);
	char *copy, v[16];
	enum kiln_err rc;

	http_req_set_object(req, http_req_param(req, "id"));
	c = gw_db(req);
	if (!c)
		return;
	/* Whose template first (404), then the text (413, 422), then the version's state (409). */
	rc = version_resolve(req, c, v, &err);
	if (rc == KILN_OK) {
		rc = dockerfile_parse(text ? text : "", text ? len : 0, &df, &err);
		dockerfile_free(&df);
	}
	if (rc == KILN_OK && memchr(text, '\0', len))
		rc = kiln_error_set(&err, KILN_E_INVALID, "the Dockerfile holds a NUL byte");
	copy = rc == KILN_OK ? strndup(text, len) : NULL;
	if (rc == KILN_OK && !copy)
		rc = kiln_error_set(&err, KILN_E_NOMEM, "out of memory");
	if (rc == KILN_OK)
		rc = PGQ(c, &res, &err,
			 "UPDATE template_versions v SET dockerfile = $4 FROM templates t "
			 "WHERE t.id = v.template_id AND t.tenant_id = $1 AND t.id = $2 "
			 "AND v.version = $3::int AND t.deleted_at IS NULL AND v.status = 'pending' "
			 "RETURNING 1",
			 who->tenant_id, http_req_param(req, "id"), v, copy);
	free(copy);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = version_not_pending(req, c, v, "a Dockerfile is given to", &err);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else
		http_reply_empty(req, 204);
	pg_res_free(res);
	pg_release(gw->pg, c);
}

/* A build context streaming through to the node that builds it. */
struct source_up {
	struct node_stream *ns;
	int fd;
	long long bytes;
	bool started;		/* the version was moved to building */
	bool image;		/* ?format=oci-archive or registry: an image, not a build context */
	bool pull;		/* ?format=registry: the body is what to pull, as JSON */
	enum kiln_err refused;	/* why the upload was not taken, `err` saying it */
	struct kiln_error err;
	char v[16];		/* the version */
	/* a pull */
	char *body;		/* the JSON body, PULL_BODY_MAX bytes at most */
	size_t blen;
	struct imageref ref;
	char *creds;		/* "username:password", or NULL; wiped when freed */
	char *sealed;		/* creds sealed for the version's row */
	bool tls_verify;
};

/* Wipes and frees a string that may hold a secret. */
static void secret_str_free(char *s)
{
	if (s)
		OPENSSL_cleanse(s, strlen(s));
	free(s);
}

static void source_up_free(void *p)
{
	struct source_up *u = p;

	if (u->fd >= 0)
		close(u->fd);
	node_stream_abort(u->ns);
	if (u->body)
		OPENSSL_cleanse(u->body, u->blen);
	free(u->body);
	secret_str_free(u->creds);
	free(u->sealed);
	free(u);
}

/*
 * A pull's body, {"image": REF, "username"?, "password"?, "tls_verify"?}: the reference by
 * common/imageref, then every address of its registry's host by the storage endpoints' check
 * (netaddr_check_host with storage_allow). The body is wiped once read.
 */
static enum kiln_err pull_parse(struct gateway *gw, struct source_up *u, struct kiln_error *err)
{
	json_t *j = json_loadb(u->body ? u->body : "", u->blen, 0, NULL), *tls;
	const char *image, *user, *pass, *key;
	struct kiln_error why = { 0 };
	json_t *val;
	enum kiln_err rc = KILN_OK;

	if (u->body)
		OPENSSL_cleanse(u->body, u->blen);
	if (!json_is_object(j)) {
		json_decref(j);
		return kiln_error_set(err, KILN_E_BAD_REQUEST,
				      "a registry pull's body is a JSON object naming its image");
	}
	json_object_foreach(j, key, val) {
		if (strcmp(key, "image") && strcmp(key, "username") && strcmp(key, "password") &&
		    strcmp(key, "tls_verify")) {
			rc = kiln_error_set(err, KILN_E_BAD_REQUEST, "unknown field \"%.64s\"", key);
			break;
		}
	}
	image = json_string_value(json_object_get(j, "image"));
	user = json_string_value(json_object_get(j, "username"));
	pass = json_string_value(json_object_get(j, "password"));
	tls = json_object_get(j, "tls_verify");
	if (rc == KILN_OK && !image)
		rc = kiln_error_set(err, KILN_E_BAD_REQUEST, "image: a string is required");
	else if (rc == KILN_OK && (!user != !json_object_get(j, "username") ||
				   !pass != !json_object_get(j, "password")))
		rc = kiln_error_set(err, KILN_E_BAD_REQUEST, "username and password: strings");
	else if (rc == KILN_OK && !user != !pass)
		rc = kiln_error_set(err, KILN_E_INVALID, "username and password: both, or neither");
	else if (rc == KILN_OK && user && (!*user || strchr(user, ':') || strlen(user) > 256 ||
					   strlen(pass) > 4096))
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "username: 1 to 256 bytes without ':'; password: at most 4096 "
				    "bytes");
	else if (rc == KILN_OK && tls && !json_is_boolean(tls))
		rc = kiln_error_set(err, KILN_E_BAD_REQUEST, "tls_verify: true or false");
	if (rc == KILN_OK && imageref_parse(image, &u->ref, &why) != KILN_OK)
		rc = kiln_error_set(err, KILN_E_INVALID, "image: %s", why.msg);
	if (rc == KILN_OK && user && asprintf(&u->creds, "%s:%s", user, pass) < 0) {
		u->creds = NULL;
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	u->tls_verify = !tls || json_is_true(tls);
	if (pass)
		OPENSSL_cleanse((char *)pass, strlen(pass));
	json_decref(j);
	if (rc == KILN_OK && netaddr_check_host(gw->storage_allow, u->ref.host, &why) != KILN_OK)
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "image: the registry %s is refused: %s (the storage endpoints' "
				    "address check; an operator can allow it with storage_allow)",
				    u->ref.registry, why.msg);
	return rc;
}

/* Seals the pull's credentials bound to the tenant, the template and the version. */
static enum kiln_err pull_seal(struct gateway *gw, struct source_up *u, const char *tenant,
			       const char *id, struct kiln_error *err)
{
	char ad[AUTH_CLAIM_MAX + AUTH_ID_MAX + 48];

	if (!u->creds)
		return KILN_OK;
	snprintf(ad, sizeof(ad), "template-registry:%s:%s:%s", tenant, id, u->v);
	return auth_seal(&gw->mk, u->creds, strlen(u->creds), ad, strlen(ad), &u->sealed, err);
}

/*
 * Chooses the node (the one holding the FROM template's image; else, first among the live nodes
 * with room for the version's shape, one holding layers of the tenant's builds, then the one with
 * the most free memory), moves the version to building there under template_max_builds, and
 * starts the call that streams the context to it. Does not reply (the body is still coming): a refusal is
 * returned with its message in u->err.
 */
static enum kiln_err source_start(struct http_req *req, struct source_up *u)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	const char *id = http_req_param(req, "id"), *v = u->v;
	struct kiln_error *err = &u->err;
	struct dockerfile df = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	char node[128] = "", address[256] = "", path[256], maxb[24], from_snap[64] = "";
	bool from_base = true;
	enum kiln_err rc;

	if (pg_acquire(gw->pg, &c, err) != KILN_OK)
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "the database is unavailable");
	rc = version_resolve(req, c, u->v, err);
	if (rc == KILN_OK && u->image)
		;	/* an image import: no Dockerfile, built on the node with the most memory */
	else if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
		 "SELECT v.dockerfile FROM template_versions v JOIN templates t "
		 "ON t.id = v.template_id WHERE t.tenant_id = $1 AND t.id = $2 "
		 "AND v.version = $3::int AND t.deleted_at IS NULL AND v.status = 'pending' "
		 "AND v.dockerfile IS NOT NULL",
		 who->tenant_id, id, v);
	if (rc == KILN_OK && u->image) {
		;
	} else if (rc == KILN_OK && pg_res_rows(res) == 1) {
		const char *text = pg_res_str(res, 0, 0);
		rc = dockerfile_parse(text, strlen(text), &df, err);
	} else if (rc == KILN_OK) {
		rc = version_not_pending(req, c, v, "a source is given to", err);
	}
	pg_res_free(res);
	res = NULL;
	if (rc == KILN_OK && !u->image)
		from_base = strcmp(df.from, "base") == 0 || strcmp(df.from, "python") == 0;
	/*
	 * FROM another template of the tenant: its image's snapshot, `from_snap`; the nodes holding
	 * it come first, and the others only when it is in the tenant's bucket (the node fetches it).
	 */
	if (rc == KILN_OK && !from_base) {
		rc = PGQ(c, &res, err,
			 "SELECT v.snapshot_id FROM templates t JOIN template_versions v "
			 "ON v.template_id = t.id JOIN snapshots s ON s.id = v.snapshot_id "
			 "AND s.deleted_at IS NULL WHERE t.tenant_id = $1 AND t.name = $2 "
			 "AND t.deleted_at IS NULL AND v.status = 'ready' "
			 "ORDER BY v.version DESC LIMIT 1",
			 who->tenant_id, df.from);
		if (rc == KILN_OK && pg_res_rows(res) == 1)
			snprintf(from_snap, sizeof(from_snap), "%s", pg_res_str(res, 0, 0));
		else if (rc == KILN_OK)
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "FROM %s: the tenant has no ready template of that name",
					    df.from);
		pg_res_free(res);
		res = NULL;
	}
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "SELECT n.id, n.address FROM nodes n LEFT JOIN LATERAL ("
			 "  SELECT count(*) FILTER (WHERE s.state <> 'paused') AS k, "
			 "  coalesce(sum(s.vcpu_milli) FILTER (WHERE s.state <> 'paused'), 0) AS v, "
			 "  coalesce(sum(s.memory_mib) FILTER (WHERE s.state <> 'paused'), 0) AS m, "
			 "  coalesce(sum(s.disk_gib), 0) AS d FROM sandboxes s WHERE s.node_id = n.id "
			 "  AND s.deleted_at IS NULL AND s.state IN ('creating', 'running', 'paused')"
			 ") u ON true, template_versions b WHERE b.template_id = $3 "
			 "AND b.version = $4::int AND " GW_NODE_LIVE_SQL("n", "$1")
			 " AND ($5 = '' OR snapshot_held($5, n.id) OR EXISTS (SELECT 1 FROM "
			 "snapshots p WHERE p.id = $5 AND p.status = 'stored')) "
			 /* and the guest image that image was made on, as for a create */
			 "AND ($5 = '' OR EXISTS (SELECT 1 FROM snapshots p WHERE p.id = $5 "
			 "AND (coalesce(p.image_hash, '') = '' OR EXISTS (SELECT 1 FROM node_images i "
			 "WHERE i.node_id = n.id AND i.image_hash = p.image_hash)))) "
			 "ORDER BY ($5 <> '' AND snapshot_held($5, n.id)) DESC, "
			 "(u.k < n.max_sandboxes AND u.v + b.vcpu_milli <= n.vcpu_milli "
			 "AND u.m + b.memory_mib <= n.memory_mib "
			 "AND (n.disk_gib IS NULL OR u.d + b.disk_gib <= n.disk_gib)) DESC, "
			 "EXISTS (SELECT 1 FROM template_layers l WHERE l.tenant_id = $2 "
			 "AND l.node_id = n.id) DESC, n.memory_mib - u.m DESC, n.id "
			 "LIMIT 1", gw_node_down_after_s(gw), who->tenant_id, id, v, from_snap);
	if (rc == KILN_OK && pg_res_rows(res) != 1) {
		rc = kiln_error_set(err, KILN_E_NO_CAPACITY, "no node can build now%s%s%s",
				    from_base ? "" : ": none holds the image of ",
				    from_base ? "" : df.from,
				    from_base ? "" : " and it is not in the tenant's bucket");
	} else if (rc == KILN_OK) {
		snprintf(node, sizeof(node), "%s", pg_res_str(res, 0, 0));
		snprintf(address, sizeof(address), "%s", pg_res_str(res, 0, 1));
	}
	dockerfile_free(&df);
	pg_res_free(res);
	res = NULL;
	snprintf(maxb, sizeof(maxb), "%lld", gw->cfg.template_max_builds);
	if (rc == KILN_OK && u->pull)
		rc = pull_seal(gw, u, who->tenant_id, id, err);
	if (rc == KILN_OK && u->pull)
		rc = PGQ(c, &res, err,
			 "SELECT state, quota, has_df FROM "
			 "template_pull_start($1, $2, $3::int, $4, $5::int, $6, $7, $8::boolean)",
			 who->tenant_id, id, v, node, maxb, u->ref.canonical, u->sealed,
			 u->tls_verify ? "true" : "false");
	else if (rc == KILN_OK && u->image)
		rc = PGQ(c, &res, err,
			 "SELECT state, quota, has_df FROM "
			 "template_image_start($1, $2, $3::int, $4, $5::int)",
			 who->tenant_id, id, v, node, maxb);
	else if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "SELECT state, quota FROM template_build_start($1, $2, $3::int, $4, $5::int)",
			 who->tenant_id, id, v, node, maxb);
	if (rc == KILN_OK && pg_res_get(res, 0, 1))
		rc = kiln_error_set(err, KILN_E_RATE_LIMITED, "%s", pg_res_str(res, 0, 1));
	else if (rc == KILN_OK && u->image && pg_res_get(res, 0, 2) &&
		 strcmp(pg_res_str(res, 0, 2), "t") == 0)
		rc = kiln_error_set(err, KILN_E_CONFLICT,
				    "version %s of template \"%s\" has a Dockerfile: an image is "
				    "imported into a version without one",
				    v, id);
	else if (rc == KILN_OK && (!pg_res_get(res, 0, 0) ||
				   strcmp(pg_res_str(res, 0, 0), "pending") != 0))
		rc = version_not_pending(req, c, v, "a source is given to", err);
	pg_res_free(res);
	pg_release(gw->pg, c);
	if (rc != KILN_OK)
		return rc;
	u->started = true;
	snprintf(path, sizeof(path), "/v1/builds/%s/source?version=%s%s", id, v,
		 u->pull ? "&format=registry" : u->image ? "&format=oci-archive" : "");
	u->ns = node_stream_start(req, &(struct node_call){ .address = address, .method = "PUT",
							     .path = path, .sandbox_id = id, .who = who,
							     .upload_fd = -1,
							     .content_type = "application/x-tar" },
				  &u->fd);
	if (!u->ns)
		return kiln_error_set(err, KILN_E_NOMEM, "the node cannot be called");
	return KILN_OK;
}

/*
 * Starts a pull whose body has been read: the caller's template first (another tenant's is 404
 * whatever the body holds), then the body (pull_parse), then source_start. A refusal is
 * returned with its message in u->err.
 */
static enum kiln_err pull_start(struct http_req *req, struct source_up *u)
{
	struct gateway *gw = http_req_app(req);
	struct pg_conn *c;
	enum kiln_err rc;

	if (pg_acquire(gw->pg, &c, &u->err) != KILN_OK)
		return kiln_error_set(&u->err, KILN_E_UNAVAILABLE, "the database is unavailable");
	rc = version_resolve(req, c, u->v, &u->err);
	pg_release(gw->pg, c);
	if (rc == KILN_OK)
		rc = pull_parse(gw, u, &u->err);
	return rc == KILN_OK ? source_start(req, u) : rc;
}

static enum kiln_err source_sink(struct http_req *req, const char *data, size_t len)
{
	struct gateway *gw = http_req_app(req);
	struct source_up *u = http_req_hctx(req);
	const char *fmt;

	if (!u) {
		u = calloc(1, sizeof(*u));
		if (!u)
			return KILN_E_NOMEM;
		u->fd = -1;
		http_req_set_hctx(req, u, source_up_free);
		fmt = http_req_query(req, "format");
		u->pull = fmt && strcmp(fmt, "registry") == 0;
		u->image = u->pull || (fmt && strcmp(fmt, "oci-archive") == 0);
		if (fmt && !u->image && strcmp(fmt, "context") != 0)
			u->refused = kiln_error_set(&u->err, KILN_E_INVALID,
						    "format must be context, oci-archive or "
						    "registry");
		else if (!u->pull)
			u->refused = source_start(req, u);
	}
	if (u->refused)
		return u->refused;
	if (u->pull) {
		/* kept until the body's end: the pull starts once it is read and checked */
		char *nb;

		if (u->blen + len > PULL_BODY_MAX)
			return u->refused = kiln_error_set(&u->err, KILN_E_INVALID,
							   "a registry pull's body is at most %d "
							   "bytes",
							   PULL_BODY_MAX);
		nb = realloc(u->body, u->blen + len + 1);
		if (!nb)
			return u->refused = kiln_error_set(&u->err, KILN_E_NOMEM, "out of memory");
		u->body = nb;
		if (len)
			memcpy(u->body + u->blen, data, len);
		u->blen += len;
		return KILN_OK;
	}
	if (u->bytes + (long long)len > gw->cfg.template_source_max_bytes)
		return u->refused = KILN_E_TOO_LARGE;
	u->bytes += (long long)len;
	while (len) {
		ssize_t w = write(u->fd, data, len);
		if (w < 0)
			return KILN_E_UNAVAILABLE;	/* the node hung up: its answer says why */
		data += w;
		len -= (size_t)w;
	}
	return KILN_OK;
}

/* Puts a version whose upload never reached its node back to pending. */
static void source_undo(struct http_req *req, const char *v)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return;
	PGQ(c, NULL, &err,
	    "UPDATE template_versions v SET status = 'pending', node_id = NULL, started_at = NULL, "
	    "source_format = 'context' FROM templates t WHERE t.id = v.template_id "
	    "AND t.tenant_id = $1 AND t.id = $2 "
	    "AND v.version = $3::int AND v.status = 'building' AND v.builder_id IS NULL",
	    gw_principal(req)->tenant_id, http_req_param(req, "id"), v);
	pg_release(gw->pg, c);
}

/*
 * PUT /v1/templates/{id}/source[?version=N][&format=oci-archive|registry]: the build context
 * (a tar holding what the Dockerfile COPYs), or with format=oci-archive an image archive to
 * import into a version without a Dockerfile (`oci-archive`: a tar of an OCI image layout, or a
 * `docker save` archive), at most template_source_max_bytes, or with format=registry a JSON
 * object naming an image to pull (pull_parse); 202 and the build runs.
 */
static void templates_source(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct source_up *u = http_req_hctx(req);
	struct kiln_error err = { 0 };
	enum kiln_err src = http_req_stream_error(req, &err);

	http_req_set_object(req, http_req_param(req, "id"));
	if (!u && src == KILN_OK) {
		source_sink(req, NULL, 0);	/* an empty body: start it to get the node's answer */
		u = http_req_hctx(req);
	}
	if (!u) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	if (u->pull && !u->refused && src == KILN_OK)
		u->refused = pull_start(req, u);	/* the body read: the node gets an empty one */
	if (src == KILN_E_TOO_LARGE || u->refused == KILN_E_TOO_LARGE) {
		if (u->started)
			source_undo(req, u->v);
		http_reply_error(req, KILN_E_TOO_LARGE,
				 "the build context is larger than template_source_max_bytes (%lld "
				 "bytes)",
				 gw->cfg.template_source_max_bytes);
		return;
	}
	if (u->refused) {
		if (u->started)
			source_undo(req, u->v);
		if (u->refused == KILN_E_RATE_LIMITED)
			http_reply_header(req, "Retry-After", "30");
		gw_fail(req, u->refused, &u->err);
		return;
	}
	if (src != KILN_OK && src != KILN_E_UNAVAILABLE) {
		if (u->started)
			source_undo(req, u->v);
		http_reply_error(req, src, "the upload failed");
		return;
	}
	close(u->fd);
	u->fd = -1;
	node_stream_finish(req, u->ns);	/* the node's answer; it undoes a failed upload itself */
	u->ns = NULL;
}

enum kiln_err templates_builds_sweep(struct gateway *gw, int *failed, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char max[24], grace[24];
	enum kiln_err rc;

	*failed = 0;
	snprintf(max, sizeof(max), "%lld", gw->cfg.template_build_max_s);
	snprintf(grace, sizeof(grace), "%d", TEMPLATE_BUILD_GRACE_S);
	rc = pg_acquire(gw->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err, "SELECT template_builds_fail_hung($1::bigint, $2::bigint)", max,
		 grace);
	if (rc == KILN_OK)
		*failed = (int)pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	pg_release(gw->pg, c);
	return rc;
}

enum kiln_err templates_exec_defaults(struct pg_conn *c, const char *sb_id, const char *text,
				      size_t len, char **out, struct kiln_error *err)
{
	json_t *body = json_loadb(text ? text : "", len, 0, NULL);
	bool cwd, user;
	struct pg_res *res = NULL;
	enum kiln_err rc = KILN_OK;

	*out = NULL;
	if (!json_is_object(body)) {
		json_decref(body);
		return KILN_OK;	/* the node says what is wrong with it */
	}
	cwd = json_object_get(body, "cwd") != NULL;
	user = json_object_get(body, "user") != NULL;
	if (!cwd || !user)
		/* the newest template version in the sandbox's lineage: the one it was made from */
		rc = PGQ(c, &res, err,
			 "SELECT v.workdir, v.run_user FROM sandboxes s JOIN template_versions v "
			 "ON v.snapshot_id = ANY (s.lineage) WHERE s.id = $1 AND v.status = 'ready' "
			 "ORDER BY v.finished_at DESC LIMIT 1",
			 sb_id);
	if (rc == KILN_OK && pg_res_rows(res) == 1) {
		bool changed = false;

		if (!cwd && pg_res_get(res, 0, 0)) {
			json_object_set_new(body, "cwd", json_string(pg_res_str(res, 0, 0)));
			changed = true;
		}
		if (!user && pg_res_get(res, 0, 1)) {
			/* the account part: a ":group" of USER is not applied (docs/templates.md) */
			const char *u = pg_res_str(res, 0, 1);
			json_object_set_new(body, "user", json_stringn(u, strcspn(u, ":")));
			changed = true;
		}
		if (changed) {
			*out = json_dumps(body, JSON_COMPACT);
			if (!*out)
				rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		}
	}
	pg_res_free(res);
	json_decref(body);
	return rc;
}

/* The build log followed as server-sent events. */
struct log_follow {
	struct gateway *gw;
	char tenant[AUTH_CLAIM_MAX], id[AUTH_ID_MAX], v[16];
};

static void log_follow_free(void *p)
{
	free(p);
}

/* Writes one SSE event of JSON `j` (consumed). -1 when the client left. */
static int sse_event(struct pump *p, const char *event, json_t *j)
{
	char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
	char head[64];
	int rc = -1;

	json_decref(j);
	if (!text)
		return -1;
	snprintf(head, sizeof(head), "event: %s\ndata: ", event);
	if (pump_write(p, head, strlen(head)) == 0 && pump_write(p, text, strlen(text)) == 0 &&
	    pump_write(p, "\n\n", 2) == 0)
		rc = 0;
	free(text);
	return rc;
}

static void log_produce(struct pump *p, void *ctx)
{
	struct log_follow *f = ctx;
	struct kiln_error err = { 0 };
	char seq[24] = "0";
	long long give_up = clock_mono_ms() +
			    (f->gw->cfg.template_build_max_s + TEMPLATE_BUILD_GRACE_S) * 1000;

	pump_ready(p, 200, "text/event-stream");
	for (;;) {
		struct pg_res *res = NULL, *st = NULL;
		struct pg_conn *c;
		bool building = false;
		size_t rows = 0;

		if (pg_acquire(f->gw->pg, &c, &err) != KILN_OK) {
			sse_event(p, "error", json_pack("{s:s}", "message", "the database is unavailable"));
			return;
		}
		/*
		 * The status is read before the log: the node writes a failed build's lines, its
		 * reason last, before it marks the build failed, so a status read as ended means the
		 * log read after it holds them all (of a ready build, all but its "# ready in" line).
		 */
		if (PGQ(c, &st, &err,
			"SELECT status, reason FROM template_versions WHERE template_id = $1 "
			"AND version = $2::int",
			f->id, f->v) == KILN_OK &&
		    pg_res_rows(st) == 1)
			building = strcmp(pg_res_str(st, 0, 0), "building") == 0;
		if (PGQ(c, &res, &err,
			"SELECT seq, chunk FROM template_build_log WHERE template_id = $1 "
			"AND version = $2::int AND seq > $3::bigint ORDER BY seq LIMIT 200",
			f->id, f->v, seq) == KILN_OK)
			rows = pg_res_rows(res);
		for (size_t i = 0; i < rows; i++) {
			snprintf(seq, sizeof(seq), "%s", pg_res_str(res, i, 0));
			if (sse_event(p, "log", json_pack("{s:s}", "text", pg_res_str(res, i, 1))) != 0) {
				pg_res_free(res);
				pg_res_free(st);
				pg_release(f->gw->pg, c);
				return;
			}
		}
		pg_res_free(res);
		if (rows == 0 && st && pg_res_rows(st) == 1 &&
		    (!building || clock_mono_ms() > give_up)) {
			sse_event(p, "end", json_pack("{s:s, s:s?}", "status", pg_res_str(st, 0, 0),
						      "reason", pg_res_get(st, 0, 1) ? pg_res_str(st, 0, 1)
										: NULL));
			pg_res_free(st);
			pg_release(f->gw->pg, c);
			return;
		}
		pg_res_free(st);
		pg_release(f->gw->pg, c);
		if (rows == 0) {
			/* a comment keeps the connection alive and tells when the client left */
			if (pump_write(p, ":\n\n", 3) != 0)
				return;
			usleep(500 * 1000);
		}
	}
}

/* GET /v1/templates/{id}/log[?version=N]: the build's log, followed while it runs. */
static void templates_log(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct log_follow *f;
	struct pg_conn *c;
	struct pump *p;
	char v[16];
	enum kiln_err rc;

	c = gw_db(req);
	if (!c)
		return;
	rc = version_resolve(req, c, v, &err);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, &err,
		 "SELECT 1 FROM template_versions v JOIN templates t ON t.id = v.template_id "
		 "WHERE t.tenant_id = $1 AND t.id = $2 AND v.version = $3::int "
		 "AND t.deleted_at IS NULL",
		 who->tenant_id, http_req_param(req, "id"), v);
	pg_release(gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(&err, KILN_E_NOT_FOUND, "no version %s of template \"%s\"", v,
				    http_req_param(req, "id"));
	pg_res_free(res);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return;
	}
	f = calloc(1, sizeof(*f));
	if (!f) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	f->gw = gw;
	snprintf(f->tenant, sizeof(f->tenant), "%s", who->tenant_id);
	snprintf(f->id, sizeof(f->id), "%s", http_req_param(req, "id"));
	snprintf(f->v, sizeof(f->v), "%s", v);
	p = pump_start(log_produce, f, log_follow_free);
	if (!p) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	pump_wait_ready(p, NULL, 0);
	http_reply_stream(req, 200, "text/event-stream", pump_read, p, pump_release);
}

static const struct http_route routes[] = {
	{ "POST", "/v1/templates", templates_create, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL,
	  0 },
	{ "GET", "/v1/templates", templates_list, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "GET", "/v1/templates/{id}", templates_get, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL,
	  0 },
	{ "DELETE", "/v1/templates/{id}", templates_delete, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "PUT", "/v1/templates/{id}/dockerfile", templates_dockerfile,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "PUT", "/v1/templates/{id}/source", templates_source,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, HTTP_BODY_STREAM, source_sink, TEMPLATE_SOURCE_MAX },
	{ "GET", "/v1/templates/{id}/log", templates_log,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
};

const struct route_group routes_templates = { routes, sizeof(routes) / sizeof(routes[0]) };
