/*
 * storage_sync.h - a node's snapshots in the tenants' own buckets (docs/storage.md, "Snapshots in
 * the bucket").
 *
 * A snapshot is taken on the node's disk (lifecycle.c) and is durable there first. When its tenant
 * has configured a bucket (storage_load), snapstore_upload_start() marks it `uploading` and a
 * background worker makes a portable copy of it, packs that into one encrypted object for the
 * tenant (snapshot_pack) and uploads it to `<prefix>snapshots/<snap id>.kiln`; the snapshot then
 * becomes `stored`, or `failed` with a reason. On another node reading the same bucket,
 * snapstore_fetch() brings the snapshot back into that node's snapshot directory, ready for the
 * usual snap_verify() and restore.
 *
 * Portable copy. A snapshot's `disk.qcow2` is a frozen layer whose backing files are earlier
 * snapshots' layers on this node (manifest `disk_chain`: host paths, base image first). The upload
 * flattens that chain into a single layer directly over the base image (a copy of the layer rebased
 * with `qemu-img rebase -b base -F raw`, safe mode: every cluster where the old chain differs from
 * the base is written into it), so the object needs no lineage from the node that took it; the
 * base image is the
 * guest image, which every node has (its identity is the manifest's `image_hash`, checked by
 * snap_verify). The copy's manifest is rewritten for it (snapshot_manifest_write). A fetch rewrites
 * `disk_chain` to this node's paths: [its base image, the snapshot's own disk.qcow2].
 *
 * Work happens beside the snapshot directories, under the node's snapshot root, in dot names the
 * rest of the node ignores: `.up-<snap id>/` for an upload (hard links of the snapshot's files,
 * taken at once so that a resume that removes the memory image cannot pull it from under the upload;
 * then the portable copy; then the packed object, kept until the upload is complete so that a
 * multipart upload resumes after a failure or a restart) and `.fetch-<snap id>.<random>/` for a
 * fetch. snapstore_resume_pending() removes the ones nothing needs any more.
 *
 * Thread safety: every function may be called from any thread, concurrently, between
 * snapstore_open() and snapstore_shutdown().
 */
#ifndef KILN_NODE_STORAGE_SYNC_H
#define KILN_NODE_STORAGE_SYNC_H

#include <stdbool.h>

#include "auth/crypto.h"
#include "common/err.h"
#include "common/pg.h"
#include "common/s3.h"

#define SNAPSTORE_KEY_DIR "snapshots/"	/* object key: <prefix>snapshots/<snap id>.kiln */
#define SNAPSTORE_KEY_SUFFIX ".kiln"

/*
 * Told after each part of a multipart upload is stored (`sent` false for a part an earlier,
 * interrupted upload had already stored): progress for logs and metrics. Runs on a worker thread;
 * it must not call back into the store.
 */
typedef void (*snapstore_part_cb)(void *arg, const char *snap_id, unsigned part, unsigned nparts,
				  bool sent);

struct snapstore_config {
	struct pg *pg;				/* the node's pool; outlives the store */
	const struct auth_master_key *mk;	/* wraps the objects' data keys and opens the tenants'
						   storage secrets; kept alive by the caller */
	const char *node_id;			/* snapshots.node_id of this node's snapshots */
	const char *snap_root;			/* <data_dir>/snaps/<node>: <snap_root>/<snap id>/ */
	const char *base_image;			/* this node's raw guest image (guest_rootfs): the base
						   of a fetched snapshot's disk */
	const char *codeint_image;		/* the code interpreter's image (guest_codeint_rootfs),
						   or NULL/"": kept as a fetched snapshot's base when
						   its layer was made on it */
	const char *image_hash;			/* this node's image (guest_image_hash), its kernel and
						   initramfs: a fetched snapshot of another image is
						   put on this node's files of that image (node_images,
						   images.h), or refused; NULL: every snapshot is
						   taken for this node's image */
	const char *kernel, *initrd;
	unsigned workers;			/* uploads at once; 0: 2 */
	unsigned upload_tries;			/* tries of an upload that finds the bucket unreachable,
						   before it is `failed`; 0: 5 */
	unsigned retry_delay_ms;		/* before the second try, doubled after each; 0: 2000 */
	const struct s3_opts *s3;		/* client settings (timeouts, part size, per-request
						   retries); NULL: s3_client_new's defaults */
	snapstore_part_cb on_part;		/* may be NULL */
	void *on_part_arg;
};

struct snapstore;

/*
 * Starts the store's workers. The strings of `cfg` are copied; `pg` and `mk` are used as they are.
 * NULL with `err` set (KILN_E_INVALID for a missing field, KILN_E_NOMEM, KILN_E_INTERNAL when a
 * thread cannot start). curl_global_init() must have run.
 */
struct snapstore *snapstore_open(const struct snapstore_config *cfg, struct kiln_error *err);

/*
 * Called once the snapshot `snap_id` of `tenant_id` is complete in its directory (manifest
 * written) and recorded in `snapshots` (the UPDATE below needs its row). When the tenant has no
 * bucket: KILN_OK, nothing changes (status `local`). When it has one: hard-links the snapshot's
 * files (and the disk layers under it) into `.up-<snap id>/`, sets the row's status `uploading`
 * and storage `s3`, queues the upload and returns KILN_OK; it never waits for the network. The
 * worker then sets `stored`, or `failed` with the reason (a corrupt snapshot, credentials or bucket
 * refused, the bucket unreachable through every try). Errors: KILN_E_INVALID (a bad id),
 * KILN_E_NOT_FOUND (no such snapshot directory or row of that tenant), KILN_E_UNAVAILABLE (Postgres
 * down), KILN_E_INTERNAL (the tenant's storage secret does not open under this master key: the
 * row is set `failed` with that reason), KILN_E_IO; the snapshot on disk is never touched, so a
 * caller that has paused a sandbox logs the error and keeps the pause.
 */
enum kiln_err snapstore_upload_start(struct snapstore *s, const char *snap_id,
				     const char *tenant_id, struct kiln_error *err);

/*
 * Queues again the uploads an earlier run of this node left `uploading` (a restart), and removes
 * work directories nothing needs (an upload whose row is no longer `uploading`, a fetch that was
 * interrupted). An upload whose packed object survived resumes its multipart upload where it
 * stopped; one without restarts from its hard links or, failing those, from the snapshot directory.
 * Call once at start, before the node serves requests. Returns the number of uploads queued.
 */
unsigned snapstore_resume_pending(struct snapstore *s);

/*
 * Brings the snapshot `snap_id` of `tenant_id` from the tenant's bucket into <snap_root>/<snap id>/
 * when that directory does not exist (a resume on another node than the one that paused). The
 * object is downloaded into a work directory, unpacked (snapshot_unpack: authenticated for this
 * tenant), verified (snapshot_verify) and its disk_chain rewritten for this node, then renamed into
 * place: the directory appears whole or not at all. The row of `snapshots` must be the tenant's
 * (else KILN_E_NOT_FOUND, even when the directory is here); KILN_OK when the directory exists
 * (already there, or fetched). The caller then restores as for a local snapshot (snap_verify included).
 * Errors, each with a message for the user, and nothing left behind:
 *   KILN_E_UNAVAILABLE  the bucket cannot be reached ("the snapshot's bucket cannot be reached:
 *                       ..."), or the snapshot is still `uploading` from its node; or Postgres down
 *   KILN_E_NOT_FOUND    no such snapshot of this tenant, or its object is missing from the bucket
 *   KILN_E_CONFLICT     the snapshot is not in the bucket (status `local` or `failed`: its files
 *                       are only on the node that took it), or the tenant has no bucket any more
 *   KILN_E_FORBIDDEN    the bucket refuses the tenant's credentials
 *   KILN_E_INVALID      the object is corrupt, truncated, altered, or not this tenant's
 *   KILN_E_INTERNAL     the storage secret does not open under this master key
 *   KILN_E_IO           local disk (full, unwritable)
 * A caller resuming a sandbox keeps it paused on any error.
 */
enum kiln_err snapstore_fetch(struct snapstore *s, const char *snap_id, const char *tenant_id,
			      struct kiln_error *err);

/*
 * Removes the object of snapshot `snap_id` from the tenant's bucket, for when its files are purged
 * (snap_gc) or a named snapshot is deleted. KILN_OK when it is gone (or was never there, or the
 * tenant has no bucket). KILN_E_CONFLICT while an upload of it is queued or running: try again at
 * the next collection. Other errors as s3_delete's (KILN_E_UNAVAILABLE, KILN_E_FORBIDDEN, ...).
 * The row of `snapshots` is not changed.
 */
enum kiln_err snapstore_delete(struct snapstore *s, const char *snap_id, const char *tenant_id,
			       struct kiln_error *err);

/*
 * Waits until no upload is queued or running, at most `timeout_ms` (0: no limit). Returns true
 * when idle. For draining before a planned stop, and for tests.
 */
bool snapstore_wait_idle(struct snapstore *s, unsigned timeout_ms);

/*
 * Stops the workers and frees the store (accepts NULL). A running upload stops at its next step
 * (after the current part, or at once when it is waiting to retry): flattening and packing, which
 * cannot be interrupted, are waited for. Uploads stopped or still queued stay `uploading`, their
 * work kept, for snapstore_resume_pending() at the next start. Call before the pool is freed.
 */
void snapstore_shutdown(struct snapstore *s);

#endif
