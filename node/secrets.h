/*
 * secrets.h - a sandbox's secrets on kiln-node: checked against its rules, sealed into Postgres
 * (table sandbox_secrets, migrations/0017_secrets.sql), opened into the injector's memory
 * (inject.h) when the sandbox runs here, and the tenant's CA put into the guest's trust
 * (docs/network-policy.md, "Secrets").
 *
 * Who sees what: the gateway passes the values through to this node (PUT /secrets, create) and
 * keeps none; Postgres holds them sealed with the master key; this node holds them in clear only
 * in the injector's memory; the guest never gets them, only the CA's certificate.
 */
#ifndef KILN_NODE_SECRETS_H
#define KILN_NODE_SECRETS_H

#include <jansson.h>

#include "node/inject.h"
#include "node/node.h"
#include "node/secretsdb.h"

#define SECRETS_GUEST_CA "/usr/local/share/ca-certificates/kiln-tenant-ca.crt"
#define SECRETS_GUEST_BUNDLE "/etc/ssl/certs/ca-certificates.crt"

/* secretsdb_store with the node's pool and master key (501 without one). */
enum kiln_err secrets_store(struct node *n, const char *sandbox_id, const char *tenant_id,
			    const struct secrets_set *set, struct kiln_error *err);

/* secretsdb_load with the node's pool and master key. */
enum kiln_err secrets_load(struct node *n, const char *sandbox_id, const char *tenant_id,
			   struct secrets_set *out, struct kiln_error *err);

/*
 * Makes `set` the sandbox's live set in the injector (taking its values) and, when it is not
 * empty, gives the guest the tenant's CA (secrets_guest_trust). An empty set drops the sandbox's.
 */
enum kiln_err secrets_activate(struct node *n, struct sandbox *sb, struct secrets_set *set,
			       struct kiln_error *err);

/* secrets_load then secrets_activate: for a resumed sandbox (none stored: nothing to do). */
enum kiln_err secrets_restore(struct node *n, struct sandbox *sb, struct kiln_error *err);

/* A fork child inherits the parent's secrets: copied (secrets_copy) and put in force. */
enum kiln_err secrets_inherit(struct node *n, const char *parent_id, struct sandbox *child,
			      struct kiln_error *err);

/* Deletes the rows of a deleted sandbox (a failure is logged: they stay sealed). */
void secrets_forget(struct node *n, const char *sandbox_id);

/*
 * For an exec in a sandbox with secrets: puts SSL_CERT_FILE and REQUESTS_CA_BUNDLE (the guest's
 * bundle, which holds the tenant's CA) and NODE_EXTRA_CA_CERTS (the CA's own file) before the
 * request's own `*env` (a NULL-terminated array in one allocation, as nodereq_env makes it, or
 * NULL), which the request's entries override. Replaces `*env` (freeing the old one); false when
 * out of memory. Without secrets it changes nothing.
 */
bool secrets_exec_env(struct node *n, const char *sandbox_id, char ***env);

/* PUT /v1/sandboxes/{id}/secrets on the node (routes.c registers it). */
void secrets_put_route(struct http_req *req, struct sandbox *sb);

#endif
