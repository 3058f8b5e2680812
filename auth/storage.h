/*
 * storage.h - a tenant's snapshot bucket as Postgres keeps it (table tenant_storage).
 *
 * The gateway writes the setting (PUT /v1/storage, routes_storage.c); kiln-node reads it with
 * storage_load() before it uploads or downloads a snapshot. Built as the library kiln_storage
 * (api/CMakeLists.txt), which needs only kiln_common and kiln_auth, so the node links it without
 * the gateway. The secret access key is sealed with the master key, its associated data binding it
 * to the tenant (STORAGE_AD_PREFIX + tenant id): a sealed value copied to another tenant's row
 * does not open.
 */
#ifndef KILN_STORAGE_H
#define KILN_STORAGE_H

#include "auth/crypto.h"
#include "common/err.h"
#include "common/pg.h"
#include "common/s3.h"

#define STORAGE_AD_PREFIX "storage:"

/*
 * Reads and opens the tenant's setting into `out` (the caller wipes it with s3_target_wipe when
 * done). KILN_E_NOT_FOUND when the tenant has no bucket (its snapshots stay on the node's disk);
 * KILN_E_UNAVAILABLE when Postgres is down; KILN_E_INTERNAL when the sealed secret does not open
 * (another master key) or the row is malformed.
 */
enum kiln_err storage_load(struct pg_conn *c, const struct auth_master_key *mk,
			   const char *tenant_id, struct s3_target *out, struct kiln_error *err);

/*
 * Seals `t`'s secret and stores `t` as the tenant's setting (insert or replace), on `c`.
 * The caller has checked `t` (s3_target_check) and tried the bucket.
 */
enum kiln_err storage_save(struct pg_conn *c, const struct auth_master_key *mk,
			   const char *tenant_id, const struct s3_target *t,
			   struct kiln_error *err);

#endif
