/*
 * secretsdb.h - a sandbox's secrets as Postgres keeps them (table sandbox_secrets, migration
 * 0017): parsed and checked (secrets_parse), each value sealed with the master key bound to its
 * row (associated data SECRETS_AD_PREFIX "<tenant>:<sandbox>:<host>:<header>": a sealed value
 * moved to another tenant, sandbox, host or header does not open), opened back into memory.
 * A library of its own (kiln_node_secrets) so that its test needs no VM; node/secrets.h puts the
 * sets in force on kiln-node.
 */
#ifndef KILN_NODE_SECRETSDB_H
#define KILN_NODE_SECRETSDB_H

#include <jansson.h>

#include "auth/crypto.h"
#include "common/config.h"
#include "common/pg.h"
#include "netpolicy/rules.h"
#include "node/inject.h"

#define SECRETS_AD_PREFIX "secret:"

/* A parsed set, as inject_set takes it. */
struct secrets_set {
	struct inject_secret *s;
	size_t n;
};

/* Wipes the values and frees the set. Accepts a zeroed one. */
void secrets_set_free(struct secrets_set *set);

/*
 * Parses `arr` (a JSON array of {"host", "header", "value"}; NULL or null: none) against the
 * sandbox's rules `rules`: every host an exact host rule for port 443 (KILN_E_INVALID naming it
 * otherwise), header names inject_header_ok() and distinct per host, at most cfg->secrets_max
 * entries and cfg->secret_value_max bytes per value without CR, LF or NUL (KILN_E_INVALID naming
 * the limit); KILN_E_BAD_REQUEST for a wrong shape. No message quotes a value.
 */
enum kiln_err secrets_parse(const struct kiln_config *cfg, const json_t *arr,
			    const struct kiln_ruleset *rules, struct secrets_set *out,
			    struct kiln_error *err);

/*
 * Replaces the sandbox's rows with `set`, each value sealed with `mk`, in one transaction.
 * KILN_E_NOT_IMPLEMENTED when `mk` is NULL (a node without a master key).
 */
enum kiln_err secretsdb_store(struct pg *pg, const struct auth_master_key *mk, const char *sandbox_id,
			      const char *tenant_id, const struct secrets_set *set,
			      struct kiln_error *err);

/*
 * Reads and opens the sandbox's rows (those of `tenant_id` only) into `out` (none: an empty set).
 * KILN_E_INTERNAL when a value does not open (another master key, a moved or altered row);
 * KILN_E_NOT_IMPLEMENTED when there are rows and `mk` is NULL.
 */
enum kiln_err secretsdb_load(struct pg *pg, const struct auth_master_key *mk, const char *sandbox_id,
			     const char *tenant_id, struct secrets_set *out, struct kiln_error *err);

/* Copies the parent's rows to a child (fork), each value sealed again for the child. */
enum kiln_err secretsdb_copy(struct pg *pg, const struct auth_master_key *mk, const char *parent_id,
			     const char *child_id, const char *tenant_id, struct kiln_error *err);

/* Deletes the sandbox's rows. */
enum kiln_err secretsdb_forget(struct pg *pg, const char *sandbox_id, struct kiln_error *err);

/* The sandbox's secrets as the API lists them: [{"host", "header"}]; NULL on a failure. */
json_t *secretsdb_list_json(struct pg *pg, const char *sandbox_id, const char *tenant_id,
			    struct kiln_error *err);

#endif
