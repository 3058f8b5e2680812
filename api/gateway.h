/*
 * gateway.h - kiln-gateway's shared state and its route groups.
 *
 * The gateway is stateless beside Postgres and Redis: every instance can serve every request.
 * Each routes_*.c file holds one group of routes of docs/openapi.yaml and exports its table.
 */
#ifndef KILN_GATEWAY_H
#define KILN_GATEWAY_H

#include <stddef.h>

#include "common/http.h"
#include "api/ratelimit.h"
#include "auth/signing.h"
#include "auth/crypto.h"
#include "common/config.h"
#include "common/json.h"
#include "common/netaddr.h"
#include <stdint.h>
#include "common/pg.h"
#include "common/redis.h"

#define GW_ISSUER "kiln"
#define GW_TOKEN_TTL_MAX 900	/* seconds: the longest user token */
#define GW_TOKEN_TTL_DEFAULT 900
#define GW_AUDIT_POOL 4	/* Postgres connections for the audit trail */

struct commitq;

struct gateway {
	struct kiln_config cfg;
	struct auth_master_key mk;
	struct pg *pg;
	struct pg *audit_pg;	/* the audit trail's own connections (gw_audit) */
	struct commitq *commitq;	/* group commit of audit rows and outcomes, on audit_pg */
	struct rds *rds;
	struct ratelimit *rl;
	struct signing *signing;
	struct http_server *http;
	struct netaddr_allow *storage_allow;	/* config storage_allow, parsed */
};

/* A group of routes: a table and its length. */
struct route_group {
	const struct http_route *routes;
	size_t n;
};

extern const struct route_group routes_ops;	/* /healthz, /metrics */
extern const struct route_group routes_dashboard;	/* /, /assets/{name} */
extern const struct route_group routes_keys;	/* /v1/api-keys, /v1/tokens, JWKS */
extern const struct route_group routes_tenants;	/* /v1/tenants */
extern const struct route_group routes_audit;	/* /v1/audit */
extern const struct route_group routes_connlog;	/* /v1/admin/sandboxes/{id}/connections */
extern const struct route_group routes_sandboxes;	/* /v1/sandboxes... */
extern const struct route_group routes_snapshots;	/* /v1/snapshots */
extern const struct route_group routes_billing;	/* /v1/billing/..., /v1/usage, sandbox usage */
extern const struct route_group routes_storage;	/* /v1/storage */
extern const struct route_group routes_templates;	/* /v1/templates... */
/*
 * The exec body `text` with the defaults of the template sandbox `sb_id` came from (its image's
 * WORKDIR as "cwd", its USER as "user") filled in where the caller left them out: *out is the new
 * body (free it), NULL when nothing is added. Fails only when Postgres or memory does.
 */
enum kiln_err templates_exec_defaults(struct pg_conn *c, const char *sb_id, const char *text,
				      size_t len, char **out, struct kiln_error *err);
/*
 * Fails the template builds still `building` TEMPLATE_BUILD_GRACE_S past template_build_max_s
 * (their node hung, or lost its database at the end), naming the cause, and releases what they
 * held (migrations/0034): the gateways' periodic work. *failed: how many.
 */
#define TEMPLATE_BUILD_GRACE_S 300
enum kiln_err templates_builds_sweep(struct gateway *gw, int *failed, struct kiln_error *err);
extern const struct route_group routes_secrets;	/* /v1/sandboxes/{id}/secrets */
extern const struct route_group routes_nodes;	/* /v1/admin/nodes (routes_nodes.c) */
extern const struct route_group routes_ports;	/* /v1/sandboxes/{id}/connect */

/*
 * Nodes (routes_nodes.c): GW_NODE_LIVE_SQL(alias, param) is the SQL condition of a node that
 * may be given work: its heartbeat younger than node_down_after_s (the query parameter `param`,
 * gw_node_down_after_s()'s text: this thread's buffer), not marked down, not draining, not
 * stopping or stopped cleanly (migrations/0029). gw_nodes_down() marks the nodes
 * whose heartbeat lapsed down (their running sandboxes lost), at most once a second.
 */
#define GW_NODE_FRESH_SQL(n, p) \
	"(" n ".heartbeat_at > now() - make_interval(secs => " p "::int) AND " n ".down_at IS NULL)"
#define GW_NODE_LIVE_SQL(n, p) \
	"(" GW_NODE_FRESH_SQL(n, p) " AND " n ".drain_at IS NULL AND " n ".stopped_at IS NULL)"
const char *gw_node_down_after_s(const struct gateway *gw);
void gw_nodes_down(struct gateway *gw);

/* Helpers shared by the route groups (routes_util.c). */

/*
 * Parses the body against `fields`; on failure replies (400/413) and returns NULL. The caller
 * json_decref()s the result.
 */
json_t *gw_body(struct http_req *req, const struct json_field *fields, size_t n);

/* Takes a Postgres connection or replies 503 and returns NULL. */
struct pg_conn *gw_db(struct http_req *req);

/* Replies with the error `rc` and `err`'s message (generic for 5xx). */
void gw_fail(struct http_req *req, enum kiln_err rc, const struct kiln_error *err);

/*
 * `?limit=` within 1..max (default `def`); replies 422 and returns -1 when malformed. Listings
 * paged by a cursor use gw_page_parse, which calls it.
 */
int gw_limit(struct http_req *req, int def, int max);

/*
 * One page of a listing, as asked by `?limit=` and `?cursor=`. Listings are paged newest first
 * either by a sequence number (the cursor is its decimal text) or by (created_at, id) (the cursor
 * is "<µs since the epoch>.<id>"); the query fetches LIMIT `lim` (limit + 1: a row past the
 * limit means there is another page).
 */
struct gw_page {
	int limit;		/* items per page */
	char lim[16];		/* limit + 1 in decimal, the query's LIMIT */
	const char *seq;	/* sequence paging: the cursor's number, NULL on the first page */
	const char *t, *id;	/* time paging: the cursor's µs and id, NULL on the first page */
	char t_buf[32], id_buf[64];	/* where t and id point */
};

/*
 * Parses `?limit=` (1..max, default `def`), then `?cursor=`: a sequence number when `id_prefix` is
 * NULL, else a (created_at, id) cursor whose id starts with `id_prefix`. Replies 422 and returns
 * false when either is malformed ("limit must be a whole number from 1 to <max>", "cursor is not
 * one this server gave").
 */
bool gw_page_parse(struct http_req *req, int def, int max, const char *id_prefix,
		   struct gw_page *p);

/* The number of rows of `res` that belong to this page (at most p->limit). */
int gw_page_rows(const struct gw_page *p, struct pg_res *res);

/*
 * Replies 200 with `{<name>: items, next_cursor}`, next_cursor being column `cursor_col` of the
 * page's last row when `res` holds a row past the limit, else null. Takes `items`; frees `res`.
 */
void gw_page_reply(struct http_req *req, const struct gw_page *p, struct pg_res *res,
		   int cursor_col, const char *name, json_t *items);

/*
 * gw_page_reply for a `res` whose column 0 is each item's JSON text and column 1 its cursor.
 */
void gw_reply_page(struct http_req *req, const struct gw_page *p, struct pg_res *res,
		   const char *name);

/* Makes an id with `prefix`; never fails in practice (replies 500 and returns false if it does). */
bool gw_new_id(struct http_req *req, const char *prefix, char *out, size_t n);

/* Whether `s` is an RFC 3339 UTC time Postgres accepts (YYYY-MM-DDTHH:MM:SS[.fff]Z). */
bool gw_is_rfc3339(const char *s);

#define NAME_MAX_LEN 100	/* bytes of a display name */

/* Checks a display name: 1..NAME_MAX_LEN bytes of printable text. Replies 422 when it is not. */
bool gw_valid_name(struct http_req *req, const char *field, const char *name);

/*
 * Makes an API key for `tenant_id` on connection `c` (inside the caller's transaction, if any)
 * and returns its JSON (with the key, shown once), or NULL with `err` set (routes_keys.c).
 */
json_t *gw_key_create(struct pg_conn *c, const char *tenant_id, const char *name, uint32_t scopes,
		      const char *expires_at, struct kiln_error *err);

/*
 * Makes the operator's tenant and its first admin key when the database has none, and writes the
 * key to `path` (mode 0600). Does nothing when the operator tenant exists (routes_tenants.c).
 */
enum kiln_err gw_bootstrap_admin(struct gateway *gw, const char *path, struct kiln_error *err);

/* Formats a Postgres timestamptz (as text in UTC) as RFC 3339; NULL stays JSON null. */
json_t *gw_time(const char *pg_text);

#endif
