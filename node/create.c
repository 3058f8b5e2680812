/*
 * create.c - the create of a sandbox on this node (create.h): the shape of a named snapshot it
 * is made from, capacity reserved, the record made under the tenant's plan and within the node's
 * disk, then the VM restored from the snapshot or a template (falling back to a cold boot) or
 * booted cold.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "auth/apikey.h"
#include "common/log.h"
#include "metering/plan.h"
#include "vmm/hv.h"
#include "vmm/jail.h"
#include "node/create.h"
#include "node/netsetup.h"
#include "node/lifecycle.h"
#include "node/template.h"
#include "node/warm.h"

/*
 * The shape of the tenant's named snapshot `snap` on this node, or of a template's image (kind
 * `build`) here or in the tenant's bucket: one that is not here yet is fetched (snap_fetch_copy).
 */
static enum kiln_err snapshot_shape(struct node *n, const char *snap, const char *tenant,
				    unsigned *vcpu_milli, unsigned *mem_mib, unsigned *disk_gib,
				    bool *build, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(n->pg, &c, err);

	if (rc == KILN_OK) {
		rc = PGQ(c, &res, err,
			 "SELECT vcpu_milli, memory_mib, disk_gib, kind = 'build' FROM snapshots "
			 "WHERE id = $1 AND tenant_id = $2 AND kind IN ('named', 'build') "
			 "AND (node_id = $3 OR (kind = 'build' AND status = 'stored')) "
			 "AND deleted_at IS NULL",
			 snap, tenant, n->cfg.node_id);
		pg_release(n->pg, c);
	}
	if (rc == KILN_OK && pg_res_rows(res) == 1) {
		*vcpu_milli = (unsigned)pg_res_int(res, 0, 0, 0);
		*mem_mib = (unsigned)pg_res_int(res, 0, 1, 0);
		*disk_gib = (unsigned)pg_res_int(res, 0, 2, 0);
		*build = strcmp(pg_res_str(res, 0, 3), "t") == 0;
	} else if (rc == KILN_OK) {
		rc = KILN_E_NOT_FOUND;
	}
	pg_res_free(res);
	if (rc != KILN_OK)
		return node_error(err, rc, rc == KILN_E_NOT_FOUND ? "no snapshot \"%s\""
								: "the database is unavailable (%s)",
			       snap);
	if (*build) {
		rc = snap_fetch_copy(n, snap, tenant, err);
		if (rc != KILN_OK)
			return node_error(err, rc == KILN_E_UNAVAILABLE || rc == KILN_E_NOT_FOUND ||
						       rc == KILN_E_CONFLICT ? rc : KILN_E_SANDBOX_FAILED,
					  "the template's image could not be fetched from the tenant's "
					  "bucket: %s", err->msg);
	}
	return KILN_OK;
}

enum kiln_err create_disk_admit(struct node *n, struct pg_conn *c, unsigned long long disk_gib,
				struct kiln_error *err)
{
	struct pg_res *res = NULL;
	long long used;
	enum kiln_err rc;

	rc = PGQ(c, NULL, err,
		 "SELECT pg_advisory_xact_lock(hashtextextended('kiln-node-disk:' || $1, 0))",
		 n->cfg.node_id);
	if (rc == KILN_OK)
		rc = PGQ(c, &res, err,
			 "SELECT coalesce(sum(disk_gib), 0) FROM sandboxes WHERE node_id = $1 "
			 "AND deleted_at IS NULL AND state IN ('creating', 'running', 'paused')",
			 n->cfg.node_id);
	if (rc != KILN_OK)
		return rc;
	used = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	if ((unsigned long long)used + disk_gib > (unsigned long long)n->disk_gib)
		return kiln_error_set(err, KILN_E_NO_CAPACITY,
				      "no room for %llu GiB of disk on this node: it promises %lld GiB "
				      "to sandboxes and %lld GiB are taken",
				      disk_gib, n->disk_gib, used);
	return KILN_OK;
}

/* Records the reserved `sb` under the tenant's plan, after any create of the tenant before it. */
static enum kiln_err create_record(struct node *n, struct sandbox *sb, const struct create_req *r,
				   const char *tpl, struct kiln_error *err)
{
	struct record_new nw = {
		.id = r->id, .tenant_id = r->tenant_id, .node_id = n->cfg.node_id,
		.template_name = r->template_name,
		.vcpu_milli = sb->vcpu_milli, .mem_mib = sb->mem_mib, .disk_gib = sb->disk_gib,
		.timeout_s = r->timeout_s, .metadata = r->metadata ? r->metadata : "{}",
		.net_index = sb->net_index,
		.lineage_of = r->from_snap ? r->from_snap : tpl[0] ? tpl : NULL,
	};
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(n->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = pg_exec(c, "BEGIN", err);
	if (rc == KILN_OK)
		rc = plan_check(c, r->tenant_id, 1, sb->vcpu_milli, sb->mem_mib, err);
	if (rc == KILN_OK)
		rc = create_disk_admit(n, c, sb->disk_gib, err);
	if (rc == KILN_OK)
		rc = record_created(n->pg, c, &nw, &sb->generation, err);
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	else
		pg_exec(c, "ROLLBACK", NULL);
	pg_release(n->pg, c);
	return rc;
}

/*
 * Whether a failed restore of `sb` from a template (`rc`) was the busy host's, not the template's:
 * KILN_E_UNAVAILABLE before any VM of it ran (its VMM did not answer within its start-up deadline,
 * before it read any of the template's state, or the network's setup met a dependency away). Such
 * a restore is tried once more, then the sandbox boots cold and the template stays for the
 * creates after it. Any other failure (its files, QEMU refusing its state, a VM that ran but whose
 * guest did not answer or whose agent's socket could not be reached) discards the template: it
 * is rebuilt.
 */
static bool tpl_failure_busy(enum kiln_err rc, const struct sandbox *sb)
{
	return rc == KILN_E_UNAVAILABLE && !sb->vm;
}

/* Starts the recorded `sb`'s VM: from the snapshot, the template `tpl`, or cold. */
static enum kiln_err create_vm(struct node *n, struct sandbox *sb, const struct create_req *r,
			       const char *tpl, bool build, struct kiln_error *err)
{
	struct warm_vm *w;
	enum kiln_err rc;
	char dir[600];

	/*
	 * A template version's warm image is shared by its sandboxes, like a base template's. A
	 * template's builder owns a copy instead: a VM whose memory is a private map can only be
	 * saved with all its memory in the state stream, which every create from its image would
	 * then read whole.
	 */
	if (r->from_snap)
		return snap_restore_new(n, sb, r->from_snap,
					build && !r->own_memory ? VMM_MEM_PRIVATE : VMM_MEM_COPY,
					&r->init, true, NULL, err);
	if (!tpl[0])
		return sb_boot(n, sb, &r->init, err);
	/*
	 * The fast path: the template's memory mapped privately, a fresh identity. Templates are
	 * keyed by shape: the template grew its root file system to this very disk_gib at its boot.
	 */
	snap_dir(n, tpl, dir, sizeof(dir));
	sb->disk_filled = true;
	/* Its VMM started ahead (warm.c), if one waits; any failure there restores anew. */
	if (!r->own_memory && (w = warm_take(n, tpl)) != NULL) {
		rc = sb_restore_warm(n, sb, dir, w, &r->init, true, err);
		warm_free(n, w);	/* its VMM, if not the sandbox's, before the sandbox's uid goes */
		if (rc == KILN_OK)
			return KILN_OK;
		log_warn("restoring template \"%s\" on a VMM started ahead failed (%s): restoring "
			 "anew", tpl, err->msg);
		sb_release(n, sb);
		kiln_error_clear(err);
		sb_net_prepare(n, sb);	/* the release dropped the first load */
	}
	for (int tries = 1;; tries++) {
		rc = sb_restore(n, sb, dir, r->own_memory ? VMM_MEM_COPY : VMM_MEM_PRIVATE, &r->init,
				true, err);
		if (rc == KILN_OK)
			return KILN_OK;
		if (!tpl_failure_busy(rc, sb) || tries == 2)
			break;
		log_warn("restoring template \"%s\" failed (%s): trying again", tpl, err->msg);
		sb_release(n, sb);
		kiln_error_clear(err);
		sb_net_prepare(n, sb);	/* the release dropped the first load */
	}
	/* Never fail a create for its template: boot it cold instead. */
	if (tpl_failure_busy(rc, sb)) {
		log_warn("restoring template \"%s\" failed again (%s): booting cold, the template "
			 "stays", tpl, err->msg);
	} else {
		log_warn("restoring template \"%s\" failed (%s): booting cold", tpl, err->msg);
		tpl_discard(n, tpl);
	}
	sb_release(n, sb);
	kiln_error_clear(err);
	rc = record_lineage_reset(n->pg, NULL,
				  &(struct record_fence){ r->id, n->cfg.node_id, sb->generation }, err);
	if (rc == KILN_OK)
		rc = sb_boot(n, sb, &r->init, err);
	return rc;
}

enum kiln_err create_sandbox(struct node *n, const struct create_req *r, struct kiln_error *err)
{
	unsigned vcpu_milli = r->vcpu_milli, mem_mib = r->mem_mib, disk_gib = r->disk_gib;
	char tpl[AUTH_ID_MAX] = "";
	struct sandbox *sb = NULL;
	bool build = false;
	enum kiln_err rc;

	/*
	 * A sandbox made from a snapshot has the snapshot's vCPUs and memory, and a disk of the size
	 * asked for: the snapshot's or larger (its file system grows into it), never smaller.
	 */
	if (r->from_snap) {
		unsigned snap_disk = 0;

		rc = snapshot_shape(n, r->from_snap, r->tenant_id, &vcpu_milli, &mem_mib, &snap_disk,
				    &build, err);
		if (rc != KILN_OK)
			return rc;
		if (disk_gib < snap_disk)
			return node_error(err, KILN_E_INVALID,
					  "disk_gib must be at least %u, the size of snapshot \"%s\"",
					  snap_disk, r->from_snap);
	}
	{
		const struct vmm_spec probe = {
			.id = r->id, .node = n->cfg.node_id,
			.vcpu_milli = vcpu_milli,
			.mem_mib = mem_mib,
			.disk_gib = disk_gib,
			.kernel = n->cfg.guest_kernel, .run_dir = "/", .state_dir = "/",
			.uid = JAIL_UID_MIN, .gid = JAIL_UID_MIN,	/* checked for real at boot */
		};
		if (vmm_spec_check(&probe, err) != KILN_OK)
			return node_error(err, KILN_E_INVALID, "%s", err->msg);
	}
	/* code-interpreter-v1: the code interpreter's image (vmm/guest/codeint/), built in. */
	bool codeint = !r->from_snap && r->template_name &&
		       strcmp(r->template_name, "code-interpreter-v1") == 0;

	if (codeint && !(n->cfg.guest_codeint_rootfs && n->cfg.guest_codeint_rootfs[0]))
		return node_error(err, KILN_E_UNAVAILABLE,
				  "this node has no code interpreter image (guest_codeint_rootfs)");
	rc = sb_reserve(n, r->id, r->tenant_id, vcpu_milli, mem_mib, disk_gib, &sb, err);
	if (rc != KILN_OK)
		return rc;
	sb->codeint = codeint;
	if (!r->from_snap)
		tpl_lookup(n, vcpu_milli, mem_mib, disk_gib, codeint, tpl, sizeof(tpl));
	pthread_mutex_lock(&sb->lock);
	sb_net_prepare(n, sb);	/* its programs load while its record is written */
	rc = create_record(n, sb, r, tpl, err);
	if (rc != KILN_OK) {
		sb_teardown(n, sb);
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
		if (rc == KILN_E_CONFLICT)
			return node_error(err, rc, "the sandbox exists");
		return rc == KILN_E_QUOTA || rc == KILN_E_NO_CAPACITY
			       ? rc
			       : node_error(err, rc, "the database is unavailable");
	}
	sb->expires_at = time(NULL) + r->timeout_s;
	rc = create_vm(n, sb, r, tpl, build, err);
	if (rc == KILN_OK && r->secrets && r->secrets->n) {
		rc = secrets_store(n, r->id, r->tenant_id, r->secrets, err);
		if (rc == KILN_OK)
			rc = secrets_activate(n, sb, r->secrets, err);
		if (rc != KILN_OK)
			secrets_forget(n, r->id);
	}
	if (rc != KILN_OK) {
		char why[KILN_ERRMSG_MAX];
		struct kiln_error rerr = { 0 };

		log_error("sandbox \"%s\" failed to start: %s", r->id, err->msg);
		snprintf(why, sizeof(why), "%s", err->msg);
		sb_teardown(n, sb);
		sb->state = SB_ERROR;
		/* The create failed: the sandbox never existed for the user. */
		if (record_create_failed(n->pg, NULL, &(struct record_fence){ r->id, n->cfg.node_id,
									      sb->generation },
					 why, &rerr) != KILN_OK)
			log_error("the failed create of \"%s\" not recorded: %s", r->id, rerr.msg);
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
		return node_error(err, rc == KILN_E_NO_CAPACITY ? rc : KILN_E_SANDBOX_FAILED,
			       "the sandbox could not start");
	}
	rc = record_running(n->pg, NULL,
			    &(struct record_fence){ r->id, n->cfg.node_id, sb->generation }, err);
	if (rc != KILN_OK) {
		/* A sandbox its record does not show running is not handed out: the create failed. */
		struct kiln_error ignore = { 0 };

		log_error("sandbox \"%s\" started but its record failed: %s", r->id, err->msg);
		sb_teardown(n, sb);
		sb->state = SB_ERROR;
		record_create_failed(n->pg, NULL, &(struct record_fence){ r->id, n->cfg.node_id,
									  sb->generation },
				     "its record failed", &ignore);
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
		return node_error(err, rc == KILN_E_UNAVAILABLE ? rc : KILN_E_SANDBOX_FAILED,
			       "the sandbox could not be recorded: %s", err->msg);
	}
	sb->state = SB_RUNNING;
	pthread_mutex_unlock(&sb->lock);
	sb_put(n, sb);
	return KILN_OK;
}
