/*
 * nodereq.h - the parsing and checking of kiln-node's request bodies (docs/openapi.yaml's bodies
 * as the gateway forwards them): create, exec, timeout, egress, bandwidth, fork, snapshot.
 *
 * Pure functions over the body's bytes: no node, no request, no I/O, so that the route handlers
 * of routes.c and the fuzz target tests/fuzz/req_fuzz.c run the same code. Each returns KILN_OK or
 * the code the route replies with (400 shape, 413 size, 422 value) and `err` its message.
 */
#ifndef KILN_NODE_NODEREQ_H
#define KILN_NODE_NODEREQ_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/err.h"
#include "netpolicy/rules.h"

struct kiln_bandwidth;

#define NODEREQ_ENV_MAX 128		/* variables in one env object */
#define NODEREQ_ENV_VALUE_MAX 32768	/* bytes of one value */
#define NODEREQ_EGRESS_RULES_MAX 256	/* rules in one egress object */
#define NODEREQ_EXEC_TIMEOUT_DEFAULT_S 60
#define NODEREQ_EXEC_TIMEOUT_MAX_S 3600
#define NODEREQ_FORK_MAX 16		/* children of one fork (node/fork.h FORK_MAX) */
#define NODEREQ_SNAPSHOT_NAME_MAX 100	/* bytes of a snapshot's name */

/*
 * A NULL-terminated "NAME=value" array (one allocation, the caller free()s *out) from a JSON object
 * of strings named `field`; an absent or null object gives an empty array. Names are
 * [A-Za-z_][A-Za-z0-9_]{0,255}, at most NODEREQ_ENV_MAX of them, values at most
 * NODEREQ_ENV_VALUE_MAX bytes without NUL (422); a non-object or non-string value is 400.
 */
enum kiln_err nodereq_env(const json_t *obj, const char *field, char ***out,
			  struct kiln_error *err);

/*
 * `{rules:[...]}` into `rs` (the caller kiln_ruleset_free()s it, also on failure): 400 for a wrong
 * shape, 422 naming the first bad rule or a rule inside one of the denied ranges deny[0, ndeny).
 */
enum kiln_err nodereq_egress(const json_t *obj, const struct kiln_cidr *deny, size_t ndeny,
			     struct kiln_ruleset *rs, struct kiln_error *err);

/*
 * Bandwidth settings into `bw` (absent fields: unmetered): byte counts not negative,
 * refill_interval_s from 1 to 86400 (422); unknown fields or wrong types 400.
 */
enum kiln_err nodereq_bandwidth(const json_t *obj, struct kiln_bandwidth *bw,
				struct kiln_error *err);

/*
 * The body of a create (POST /v1/sandboxes/{id}), as far as it is checked without the node: the
 * shape in the public API's ranges (vcpu_milli a multiple of 250 from 250 to 8000, memory_mib 256
 * to 16384, disk_gib 10 to 60, timeout_s 1 to 86400, 422), then env. Egress and bandwidth are
 * left to nodereq_egress (which needs the node's denied ranges) and nodereq_bandwidth, in that
 * order, on `egress` and `bandwidth` (NULL when absent or null). Strings point into `body`; the
 * caller frees it all with nodereq_create_free(), also after a failure.
 */
struct nodereq_create {
	json_t *body;
	const char *template_name;
	const char *from_snap;		/* NULL when absent */
	unsigned vcpu_milli, mem_mib, disk_gib;
	long long timeout_s;
	char **env;			/* owned (nodereq_env) */
	char *metadata;			/* owned: the metadata object's compact JSON text, "{}" */
	const json_t *egress, *bandwidth;	/* borrowed from body */
	const json_t *secrets;			/* borrowed; checked by secrets_parse */
};
enum kiln_err nodereq_create(const char *text, size_t len, struct nodereq_create *out,
			     struct kiln_error *err);

/* Frees what nodereq_create() filled in (also after a failure); leaves *c zeroed. */
void nodereq_create_free(struct nodereq_create *c);

/* An exec's request (POST /v1/sandboxes/{id}/exec), parsed. */
struct exec_req {
	char **argv;		/* owned */
	char **env;		/* owned (nodereq_env) */
	char *cwd, *code;	/* owned */
	unsigned char *stdin_data;
	size_t stdin_len;
	uint32_t timeout_ms;
	char *user;		/* owned; NULL for root */
};

/*
 * Parses an exec body into *out (the caller exec_req_free()s it): exactly one of cmd (a non-empty
 * array of strings, cmd[0] not empty) and code (with language python or bash), env as
 * nodereq_env, cwd absolute, stdin, timeout_s from 1 to NODEREQ_EXEC_TIMEOUT_MAX_S (default 60),
 * user a user name (nodereq_user; "root" and absent both leave e->user NULL).
 */
enum kiln_err nodereq_exec(const char *text, size_t len, struct exec_req **out,
			   struct kiln_error *err);

/*
 * The `user` of an exec or a files request: NULL or "root" give *out NULL (root); a name passing
 * agent_user_ok (1 to 32 bytes of [A-Za-z0-9_.-], the first a letter or '_') gives *out = name;
 * anything else is 422 naming `user`.
 */
enum kiln_err nodereq_user(const char *name, const char **out, struct kiln_error *err);

/* A process's start (POST /v1/sandboxes/{id}/processes), parsed. */
struct proc_req {
	struct exec_req *e;	/* as nodereq_exec; timeout_ms 0 (none) when timeout_s is absent */
	char *tag;		/* owned; NULL when none */
	unsigned rows, cols;	/* a PTY's size, 0 for pipes */
};

/*
 * Parses a process start: an exec body (nodereq_exec; `argv` is another name for `cmd`) with tag
 * (at most 64 bytes), pty {rows, cols} (each 1..1000) and a timeout_s that is none when absent.
 * The caller frees *out with proc_req_free().
 */
enum kiln_err nodereq_proc(const char *text, size_t len, struct proc_req **out,
			   struct kiln_error *err);
void proc_req_free(struct proc_req *p);

/* Frees an exec_req. Accepts NULL. */
void exec_req_free(struct exec_req *e);

/* PUT /timeout's body: timeout_s from 1 to 86400. */
enum kiln_err nodereq_timeout(const char *text, size_t len, long long *timeout_s,
			      struct kiln_error *err);

/*
 * A fork's body: `ids`, 1 to NODEREQ_FORK_MAX sandbox ids ("sb_..."). *body is the parsed body
 * (the caller json_decref()s it, also on failure) into which ids[0, *count) point.
 */
enum kiln_err nodereq_fork(const char *text, size_t len, json_t **body,
			   const char *ids[NODEREQ_FORK_MAX], size_t *count, struct kiln_error *err);

/* A named snapshot's body: an optional name of at most 100 bytes; *name is NULL or the caller's. */
enum kiln_err nodereq_snapshot(const char *text, size_t len, char **name, struct kiln_error *err);

#endif
