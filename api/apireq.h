/*
 * apireq.h - the parsing and checking of kiln-gateway's request bodies (docs/openapi.yaml): a
 * sandbox's create and fork, API keys, tokens, tenants, grants and storage settings.
 *
 * Pure functions over the body's bytes: no request, no database, no I/O, so that the route
 * handlers and the fuzz target tests/fuzz/req_fuzz.c run the same code. Each returns KILN_OK or
 * the code the route replies with (400 shape, 413 size, 422 value) and `err` its message. What
 * needs the caller or the database (scopes against the caller's, a tenant that exists, a time in
 * the future) stays with the route.
 */
#ifndef KILN_API_APIREQ_H
#define KILN_API_APIREQ_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"

struct s3_target;

#define APIREQ_NAME_MAX 100		/* bytes of a display name (gateway.h NAME_MAX_LEN) */
#define APIREQ_METADATA_MAX 16384	/* bytes of a sandbox's metadata, as JSON */
#define APIREQ_FORK_MAX 16		/* children of one fork */
#define APIREQ_TOKEN_TTL_MAX 900	/* seconds: the longest user token (GW_TOKEN_TTL_MAX) */
#define APIREQ_GRANT_REASON_MAX 200	/* bytes of a grant's reason */

/* A display name: 1 to APIREQ_NAME_MAX bytes, no control character (422 naming `field`). */
enum kiln_err apireq_name(const char *field, const char *name, struct kiln_error *err);

/* Whether `s` is an RFC 3339 time Postgres accepts (YYYY-MM-DDTHH:MM:SS[.fff], Z or ±HH:MM). */
bool apireq_rfc3339(const char *s);

/*
 * POST /v1/sandboxes: template "base" (or its alias "python"; `template` NULL), the built-in
 * "code-interpreter-v1" (`builtin`; `template` NULL), or the name of a
 * tenant's template (apireq_template_name; 422 naming `template` otherwise, and with snapshot_id),
 * vcpus a multiple of 0.25 from 0.25 to 8 (default 1), memory_mib 256 to 16384 (512), disk_gib
 * 10 to 60 (10), timeout_s 1 to 86400 (300), metadata at most APIREQ_METADATA_MAX bytes as JSON
 * (413). env, egress and bandwidth are the node's to check. The caller frees it all with
 * apireq_create_free(), also after a failure.
 */
struct apireq_create {
	json_t *body;
	unsigned vcpu_milli, mem_mib, disk_gib;
	long long timeout_s;
	char *metadata;		/* owned: the metadata object's compact JSON text, "{}" */
	const char *snapshot_id;	/* NULL when absent; points into body */
	const char *template;	/* a tenant's template (apireq_template_name), NULL for the base */
	const char *builtin;	/* APIREQ_CODEINT when that built-in template is asked, else NULL */
};
enum kiln_err apireq_create(const char *text, size_t len, struct apireq_create *out,
			    struct kiln_error *err);
void apireq_create_free(struct apireq_create *c);

#define APIREQ_USER_MAX 32		/* bytes of a user name (vmm/guest/agent_proto.h AGENT_MAX_USER) */

/*
 * The `user` of an exec or a files request, the account in the sandbox it runs as: NULL (absent:
 * root) or 1 to APIREQ_USER_MAX bytes of [A-Za-z0-9_.-], the first a letter or '_' (422 naming
 * `user`); the node and the guest check the same rule.
 */
enum kiln_err apireq_user(const char *name, struct kiln_error *err);

/*
 * The `user` field of an exec body, checked (apireq_user; 400 when it is not a string). A body
 * that is not a JSON object passes: the node answers for its shape.
 */
enum kiln_err apireq_exec_user(const char *text, size_t len, struct kiln_error *err);

/* POST /v1/sandboxes/{id}/fork: count from 1 to APIREQ_FORK_MAX (default 1). */
enum kiln_err apireq_fork(const char *text, size_t len, unsigned *count, struct kiln_error *err);

/*
 * POST /v1/api-keys: name (apireq_name), scopes (a non-empty array of known scopes), expires_at
 * (a string; the database decides whether it is a future time). Strings point into *body, which
 * the caller json_decref()s, also after a failure.
 */
struct apireq_key {
	json_t *body;
	const char *name, *expires_at;	/* expires_at NULL when absent */
	uint32_t scopes;
};
enum kiln_err apireq_key(const char *text, size_t len, struct apireq_key *out,
			 struct kiln_error *err);

/*
 * POST /v1/tokens: ttl_s from 1 to APIREQ_TOKEN_TTL_MAX (default APIREQ_TOKEN_TTL_MAX); scopes,
 * when given, parsed into *scopes and *has_scopes set (whether they are the key's to give is the
 * route's check).
 */
enum kiln_err apireq_token(const char *text, size_t len, long long *ttl_s, uint32_t *scopes,
			   bool *has_scopes, struct kiln_error *err);

/* POST /v1/tenants: name (apireq_name). *body as apireq_key's; *name points into it. */
enum kiln_err apireq_tenant(const char *text, size_t len, json_t **body, const char **name,
			    struct kiln_error *err);

/*
 * POST /v1/billing/grants: tenant_id, amount_ucr at least 1, reason 1 to
 * APIREQ_GRANT_REASON_MAX bytes of printable text, expires_at an RFC 3339 time when given.
 * Strings point into out->body, which the caller json_decref()s, also after a failure.
 */
struct apireq_grant {
	json_t *body;
	const char *tenant_id, *reason, *expires_at;	/* expires_at NULL when absent */
	long long amount_ucr;
};
enum kiln_err apireq_grant(const char *text, size_t len, struct apireq_grant *out,
			   struct kiln_error *err);

/*
 * PUT /v1/storage: kind "s3" and the S3 target's fields, each within its size and passing
 * s3_target_check (422). The caller s3_target_wipe()s `t` and, through apireq_storage_free(),
 * wipes and frees *body (it holds the secret), also after a failure.
 */
enum kiln_err apireq_storage(const char *text, size_t len, json_t **body, struct s3_target *t,
			     struct kiln_error *err);
void apireq_storage_free(json_t *body);

#define APIREQ_CODEINT "code-interpreter-v1"	/* the code interpreter's built-in template */
#define APIREQ_TEMPLATE_NAME_MAX 63	/* bytes of a template's name */
#define APIREQ_TEMPLATE_CMD_MAX 4096	/* bytes of a template's start_cmd or ready_cmd */
#define APIREQ_TEMPLATE_EGRESS_MAX 16384	/* bytes of a template's egress rules, as JSON */

/*
 * A template's name: 1 to APIREQ_TEMPLATE_NAME_MAX bytes of [a-z0-9._-], the first a letter or a
 * digit, not starting with "tmpl_" (ids do) and not "base" or "python" (the base image's names);
 * 422 naming `field` otherwise.
 */
enum kiln_err apireq_template_name(const char *field, const char *name, struct kiln_error *err);

/*
 * POST /v1/templates: name (apireq_template_name), vcpus, memory_mib and disk_gib (required, the
 * ranges of a sandbox's), start_cmd and ready_cmd (shell command lines of 1 to
 * APIREQ_TEMPLATE_CMD_MAX bytes, no NUL), egress (an object; the node checks its rules, 413 past
 * APIREQ_TEMPLATE_EGRESS_MAX bytes). Strings point into out->body; out->egress is owned (compact
 * JSON, NULL when absent). The caller frees it all with apireq_template_free(), also after a
 * failure.
 */
struct apireq_template {
	json_t *body;
	const char *name, *start_cmd, *ready_cmd;	/* the commands NULL when absent */
	char *egress;
	unsigned vcpu_milli, mem_mib, disk_gib;
};
enum kiln_err apireq_template(const char *text, size_t len, struct apireq_template *out,
			      struct kiln_error *err);
void apireq_template_free(struct apireq_template *t);

#endif
