/*
 * resume.c - the resume of a paused sandbox (resume.h): its snapshot verified (fetched from the
 * tenant's bucket when it was paused elsewhere), capacity reserved, the VM restored on a copy of
 * the memory image, then the record moved here at the next generation, fenced on the node and
 * generation it was paused at, under the tenant's plan. A failed resume leaves it paused.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "common/log.h"
#include "metering/plan.h"
#include "node/secrets.h"
#include "node/lifecycle.h"
#include "node/netsetup.h"
#include "node/resume.h"
#include "node/storage_sync.h"
#include "node/warm.h"

enum kiln_err resume_sandbox(struct node *n, const char *id, const char *tenant,
			     struct kiln_error *err)
{
	struct record r;
	struct sandbox *sb = sb_get(n, id);
	struct warm_vm *w;
	bool warm;
	struct pg_conn *c;
	char dir[600], mem[640];
	bool moved;
	enum kiln_err rc;

	if (sb) {
		/*
		 * Held here: it runs or starts, or its pause is recorded and its VM still being torn
		 * down (sb_pause); that one leaves the table shortly and is waited for (up to 10 s).
		 */
		sb_put(n, sb);
		if (record_read(n->pg, id, tenant, n->cfg.node_id, &r, err) == KILN_OK && r.found &&
		    !strcmp(r.state, "paused"))
			for (int i = 0; i < 100 && (sb = sb_get(n, id)); i++) {
				sb_put(n, sb);
				usleep(100 * 1000);
			}
		sb = sb_get(n, id);
		if (sb) {
			rc = node_error(err, KILN_E_CONFLICT, "the sandbox is %s",
					sb_state_name(sb->state));
			sb_put(n, sb);
			return rc;
		}
	}
	/* on any node: one paused elsewhere resumes here from the tenant's bucket */
	if (record_read(n->pg, id, tenant, NULL, &r, err) != KILN_OK)
		return node_error(err, KILN_E_UNAVAILABLE, "the database is unavailable");
	if (!r.found)
		return node_error(err, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
	if (r.delete_requested)
		return node_error(err, KILN_E_CONFLICT, "the sandbox is being deleted");
	if (strcmp(r.state, "paused") != 0 || !r.pause_snapshot[0])
		return node_error(err, KILN_E_CONFLICT, "the sandbox is %s, not paused", r.state);
	moved = strcmp(r.node_id, n->cfg.node_id) != 0;
	snap_dir(n, r.pause_snapshot, dir, sizeof(dir));
	if (moved || access(dir, F_OK) != 0) {
		/* Paused on another node: its snapshot comes from the tenant's bucket. */
		if (!n->store)
			return node_error(err, KILN_E_CONFLICT,
					 "the sandbox was paused on another node and this node has no "
					 "access to snapshot buckets");
		rc = snapstore_fetch(n->store, r.pause_snapshot, tenant, err);
		if (rc != KILN_OK) {
			return node_error(err, rc == KILN_E_UNAVAILABLE || rc == KILN_E_NOT_FOUND ||
						      rc == KILN_E_CONFLICT ? rc : KILN_E_SANDBOX_FAILED,
					 "the snapshot could not be fetched: %s; the sandbox stays paused",
					 err->msg);
		}
		moved = true;
	}
	rc = sb_reserve(n, id, tenant, r.vcpu_milli, r.mem_mib, r.disk_gib, &sb, err);
	if (rc != KILN_OK)
		return rc;
	pthread_mutex_lock(&sb->lock);
	sb_net_prepare(n, sb);	/* its programs load while its snapshot is verified */
	/*
	 * Its root file system grew to its disk before the pause, and the disk's size is the record's,
	 * which nothing changes: the guest is not asked to grow it again.
	 */
	sb->disk_filled = true;
	/*
	 * A copy of the memory image: if anything fails, the snapshot is still whole. On the VMM
	 * started ahead on this snapshot since its pause (warm.c), if one waits and the snapshot is
	 * still the one it was begun on.
	 */
	w = warm_take(n, r.pause_snapshot);
	if (w && moved) {
		warm_free(n, w);	/* its files were fetched anew: warm_take saw them replaced */
		w = NULL;
	}
	warm = w != NULL;
	rc = snap_restore_new(n, sb, r.pause_snapshot, VMM_MEM_COPY, NULL, false, w, err);
	warm_free(n, w);	/* its VMM, if not the sandbox's, before the sandbox's uid goes */
	/*
	 * Anew only if the guest never ran with its network open (its TAP gated until the policy is
	 * attached: no VM left, or no policy loaded yet); after that, the sandbox stays paused, as
	 * any resume that fails, rather than run from its snapshot once more what already reached
	 * the network.
	 */
	if (rc != KILN_OK && warm && (!sb->vm || !sb->pol)) {
		log_warn("resuming \"%s\" on a VMM started ahead failed (%s): restoring anew", id,
			 err->msg);
		sb_release(n, sb);
		kiln_error_clear(err);
		sb_net_prepare(n, sb);	/* the release dropped the first load */
		rc = snap_restore_new(n, sb, r.pause_snapshot, VMM_MEM_COPY, NULL, false, NULL, err);
	}
	if (rc == KILN_OK)
		rc = secrets_restore(n, sb, err);	/* its secrets, or it stays paused */
	if (rc == KILN_OK)
		rc = pg_acquire(n->pg, &c, err);
	if (rc == KILN_OK) {
		struct record_fence was = { .id = id, .node_id = r.node_id, .generation = r.generation };
		struct record_resume rr = { .snap = r.pause_snapshot, .node_id = n->cfg.node_id,
					    .net_index = sb->net_index, .timeout_s = r.timeout_s,
					    .moved = moved };
		/*
		 * Fenced: only the resume that finds it still paused on that snapshot, at the node
		 * and generation read above, wins. A snapshot fetched from the bucket has a
		 * standalone disk: the lineage starts again. Recorded under the tenant's plan,
		 * after any create or resume of the tenant before it.
		 */
		rc = pg_exec(c, "BEGIN", err);
		if (rc == KILN_OK)
			rc = plan_check(c, tenant, 1, r.vcpu_milli, r.mem_mib, err);
		if (rc == KILN_OK)
			rc = record_resumed(n->pg, c, &was, &rr, &sb->generation, err);
		if (rc == KILN_E_CONFLICT) {
			kiln_error_clear(err);
			kiln_error_set(err, KILN_E_CONFLICT, "the sandbox was resumed elsewhere");
		}
		if (rc == KILN_OK && moved)
			rc = PGQ(c, NULL, err, "UPDATE snapshots SET node_id = $2 WHERE id = $1",
				 r.pause_snapshot, n->cfg.node_id);
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		else
			pg_exec(c, "ROLLBACK", NULL);
		pg_release(n->pg, c);
	}
	if (rc != KILN_OK) {
		log_error("resume of \"%s\" failed: %s", id, err->msg);
		sb_teardown(n, sb);
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
		return node_error(err, rc == KILN_E_NO_CAPACITY || rc == KILN_E_UNAVAILABLE ||
					      rc == KILN_E_CONFLICT || rc == KILN_E_QUOTA ? rc : KILN_E_SANDBOX_FAILED,
				 "the sandbox could not resume: %s; it stays paused", err->msg);
	}
	sb->state = SB_RUNNING;
	sb->expires_at = time(NULL) + r.timeout_s;
	/*
	 * The memory image was copied into the VM: the snapshot keeps only what the disk needs. Its
	 * blocks are freed behind the reply.
	 */
	snap_dir(n, r.pause_snapshot, dir, sizeof(dir));
	snprintf(mem, sizeof(mem), "%s/mem", dir);
	fs_unlink_behind(mem);
	pthread_mutex_unlock(&sb->lock);
	log_info("sandbox \"%s\" resumed from \"%s\"", id, r.pause_snapshot);
	sb_put(n, sb);
	return KILN_OK;
}

