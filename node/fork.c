/*
 * fork.c - the fork of a running sandbox into children (fork.h): one snapshot, then the
 * children restored from it with its memory image mapped privately (pages shared until written)
 * and the parent restored on a copy of its own (a private mapping would see later writes
 * through a shared one). All children or none, recorded under the tenant's plan. Each child's
 * bandwidth bucket starts at the parent's level at the snapshot (netpolicy.json), never full:
 * forking mints no bandwidth; the parent keeps its own maps and level.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "auth/apikey.h"
#include "common/log.h"
#include "metering/plan.h"
#include "vmm/agent.h"
#include "vmm/hv.h"
#include "node/secrets.h"
#include "node/create.h"
#include "node/fork.h"
#include "node/lifecycle.h"
#include "node/netsetup.h"

enum kiln_err fork_sandbox(struct node *n, struct sandbox *parent, const char *tenant,
			   const char *const *ids, size_t count, struct kiln_error *err)
{
	struct sandbox *kids[FORK_MAX] = { 0 };
	char snap[AUTH_ID_MAX], dir[600];
	struct pg_conn *c = NULL;
	enum kiln_err rc;
	size_t made = 0;

	if (count < 1 || count > FORK_MAX)
		return node_error(err, KILN_E_INVALID, "count must be from 1 to %d", FORK_MAX);
	/* All the children's capacity first: all or none. */
	rc = KILN_OK;
	for (made = 0; rc == KILN_OK && made < count; made++) {
		rc = sb_reserve(n, ids[made], tenant,
				parent->vcpu_milli, parent->mem_mib, parent->disk_gib, &kids[made], err);
		if (rc != KILN_OK)
			break;
	}
	if (rc != KILN_OK) {
		for (size_t i = 0; i < made; i++) {
			sb_teardown(n, kids[i]);
			sb_put(n, kids[i]);
		}
		return rc;
	}
	/* The children's programs load while the parent's snapshot is taken and the rows written. */
	for (size_t i = 0; i < count; i++) {
		pthread_mutex_lock(&kids[i]->lock);
		sb_net_prepare(n, kids[i]);
		pthread_mutex_unlock(&kids[i]->lock);
	}
	pthread_mutex_lock(&parent->lock);
	rc = parent->state == SB_RUNNING ? auth_new_id("snap_", snap, sizeof(snap)) : KILN_E_CONFLICT;
	if (rc == KILN_OK) {
		snap_dir(n, snap, dir, sizeof(dir));
		rc = save_policy_public(parent, dir, err);
	}
	if (rc == KILN_OK)
		rc = vmm_snapshot(parent->vm, dir, VMM_SNAP_SHARED, err);
	/* the parent's VM has stopped: the bucket's level the children start from is final */
	if (rc == KILN_OK)
		rc = save_policy_public(parent, dir, err);
	if (rc == KILN_OK)
		rc = write_manifest_public(n, parent, dir, err);
	if (rc == KILN_OK)
		rc = pg_acquire(n->pg, &c, err);
	if (rc == KILN_OK)
		rc = snap_record_public(n, c, parent, snap, "fork", NULL, dir, err);
	if (rc != KILN_OK) {
		struct kiln_error ignore = { 0 };
		struct vmm_status st = { 0 };
		if (parent->vm && vmm_status(parent->vm, &st, &ignore) == KILN_OK && st.alive)
			vmm_resume(parent->vm, &ignore);
		pthread_mutex_unlock(&parent->lock);
		for (size_t i = 0; i < count; i++) {
			pthread_mutex_lock(&kids[i]->lock);
			sb_teardown(n, kids[i]);
			pthread_mutex_unlock(&kids[i]->lock);
			sb_put(n, kids[i]);
		}
		if (c)
			pg_release(n->pg, c);
		return node_error(err, KILN_E_SANDBOX_FAILED, "the fork failed: %s", err->msg);
	}
	/* The parent's VMM ended with the snapshot: its handle goes, its network stays. */
	agent_free(parent->agent);
	parent->agent = NULL;
	{
		struct kiln_error ignore = { 0 };

		vmm_destroy(parent->vm, &ignore);
		parent->vm = NULL;
	}
	/* The children's rows at once, under the tenant's plan: all or none. */
	rc = pg_exec(c, "BEGIN", err);
	if (rc == KILN_OK)
		rc = plan_check(c, tenant, (unsigned)count, parent->vcpu_milli, parent->mem_mib, err);
	if (rc == KILN_OK)
		rc = create_disk_admit(n, c, (unsigned long long)count * parent->disk_gib, err);
	for (made = 0; rc == KILN_OK && made < count; made++) {
		struct record_fence pf = sb_fence(n, parent);
		rc = record_forked(n->pg, c, &pf, kids[made]->id, kids[made]->net_index, snap,
				   &kids[made]->generation, err);
	}
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	if (rc != KILN_OK) {
		pg_exec(c, "ROLLBACK", NULL);
		for (size_t i = 0; i < count; i++)
			kids[i]->generation = 0;	/* none of them is recorded */
	}
	/* The children, from the frozen image mapped privately. */
	for (made = 0; rc == KILN_OK && made < count; made++) {
		struct sandbox *k = kids[made];
		pthread_mutex_lock(&k->lock);
		rc = snap_restore_new(n, k, snap, VMM_MEM_PRIVATE, NULL, true, NULL, err);
		if (rc == KILN_OK)
			rc = secrets_inherit(n, parent->id, k, err);	/* forks inherit them */
		if (rc == KILN_OK) {
			struct record_fence kf = sb_fence(n, k);
			rc = record_running(n->pg, c, &kf, err);
		}
		if (rc == KILN_OK) {
			k->expires_at = parent->expires_at;
			k->state = SB_RUNNING;
		}
		pthread_mutex_unlock(&k->lock);
		if (rc != KILN_OK)
			break;
	}
	if (rc != KILN_OK) {
		char why[KILN_ERRMSG_MAX];
		snprintf(why, sizeof(why), "%s", err->msg);
		log_error("fork of \"%s\" failed: %s", parent->id, why);
		for (size_t i = 0; i < count; i++) {
			struct record_fence kf = sb_fence(n, kids[i]);
			struct kiln_error kerr = { 0 };

			pthread_mutex_lock(&kids[i]->lock);
			sb_teardown(n, kids[i]);
			pthread_mutex_unlock(&kids[i]->lock);
			secrets_forget(n, kids[i]->id);
			/* none recorded when their insert was rolled back: nothing to delete then */
			if (kids[i]->generation &&
			    record_deleted(n->pg, c, &kf, &kerr) != KILN_OK)
				log_error("the failed fork child \"%s\" not recorded deleted: %s",
					  kids[i]->id, kerr.msg);
		}
		kiln_error_clear(err);
		kiln_error_set(err, rc == KILN_E_QUOTA || rc == KILN_E_NO_CAPACITY ? rc : KILN_E_SANDBOX_FAILED,
			       "%s", why);
	}
	/* The parent, on a copy of the image: its children map the original. */
	{
		struct kiln_error perr = { 0 };
		if (snap_restore_new(n, parent, snap, VMM_MEM_COPY, NULL, false, NULL, &perr) == KILN_OK) {
			struct record_fence pf = sb_fence(n, parent);
			/* the generation moves on; the restored VM runs on either way */
			if (record_restored(n->pg, c, &pf, snap, &parent->generation, &perr) != KILN_OK)
				log_error("the restore of the parent \"%s\" not recorded: %s", parent->id,
					  perr.msg);
		} else {
			log_error("the parent \"%s\" did not come back after its fork: %s", parent->id,
				  perr.msg);
			sb_failed(n, parent, "the VM did not come back after a fork");
			if (rc == KILN_OK)
				rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED, "%s", perr.msg);
		}
	}
	pthread_mutex_unlock(&parent->lock);
	if (rc == KILN_OK)
		log_info("sandbox \"%s\" forked into %zu", parent->id, count);
	else if (rc != KILN_E_QUOTA && rc != KILN_E_NO_CAPACITY)
		rc = node_error(err, KILN_E_SANDBOX_FAILED, "the fork failed: %s", err->msg);
	pg_release(n->pg, c);
	for (size_t i = 0; i < count; i++)
		sb_put(n, kids[i]);
	return rc;
}
