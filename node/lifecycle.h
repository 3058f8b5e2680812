/*
 * lifecycle.h - snapshots of sandboxes on a node: their directories, policy, manifest and
 * records, restores from them, and the removal of snapshot files nothing uses any more (see
 * lifecycle.c; the pause is pause.h, the resume resume.h, the fork fork.h).
 */
#ifndef KILN_NODE_LIFECYCLE_H
#define KILN_NODE_LIFECYCLE_H

#include "node/node.h"

#define NETPOLICY_FILE "netpolicy.json"	/* a snapshot's network policy */

/* <data_dir>/snaps/<node>/<snap id> */
void snap_dir(struct node *n, const char *snap_id, char *out, size_t len);

/* Starts the background upload of a snapshot when its tenant has a bucket (errors logged only). */
void snap_upload(struct node *n, const char *snap_id, const char *tenant_id);

/*
 * Makes sure the files of the tenant's snapshot `snap_id` (a template's image made on another
 * node) are here: KILN_OK when they are; else fetched from the tenant's bucket (snapstore_fetch,
 * verified; its errors) and recorded as this node's copy (snapshot_copies), kept for later creates
 * until snap_gc removes it with the snapshot. KILN_E_CONFLICT when this node has no store.
 */
enum kiln_err snap_fetch_copy(struct node *n, const char *snap_id, const char *tenant_id,
			      struct kiln_error *err);

/*
 * Verifies the snapshot `snap_id` and restores `sb` (reserved, not yet running) from it, with the
 * snapshot's network policy unless `override` gives one. `fresh`: a new sandbox's identity. With
 * `w`, on that warm VM begun on the snapshot (sb_restore_warm: `from` is then the begin's).
 */
enum kiln_err snap_restore_new(struct node *n, struct sandbox *sb, const char *snap_id,
			       enum vmm_mem_from from, const struct sb_init *override, bool fresh,
			       struct warm_vm *w, struct kiln_error *err);

/* Checks that a snapshot directory is complete and restorable on this node. */
enum kiln_err snap_verify(struct node *n, const char *dir, struct kiln_error *err);

/* Reads the rules and bandwidth saved in a snapshot. The caller frees `rs`. */
enum kiln_err snap_load_policy(const char *dir, struct kiln_ruleset *rs, struct kiln_bandwidth *bw,
			       struct kiln_error *err);

/* Saves the sandbox's rules and bandwidth into a snapshot directory (made if needed). */
enum kiln_err save_policy_public(struct sandbox *sb, const char *dir, struct kiln_error *err);

/* Writes the manifest of a snapshot of `sb` just saved into `dir`. */
enum kiln_err write_manifest_public(struct node *n, const struct sandbox *sb, const char *dir,
				    struct kiln_error *err);

/*
 * Records a snapshot of `sb` in Postgres on `c`: `kind` pause, fork or named (pause and fork
 * snapshots are internal: recorded as deleted, their files kept while a sandbox stands on them).
 */
enum kiln_err snap_record_public(struct node *n, struct pg_conn *c, const struct sandbox *sb,
				 const char *snap_id, const char *kind, const char *name,
				 const char *dir, struct kiln_error *err);

/* Removes a snapshot directory. */
void snap_remove_files(const char *dir);

/* Removes the files of deleted snapshots no live sandbox or snapshot stands on. */
void snap_gc(struct node *n);

#endif
