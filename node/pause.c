/*
 * pause.c - the pause of a running sandbox (pause.h): room reserved for its snapshot first, on
 * this node's disk and against the tenant's snapshot-bytes plan limit; then the VMM saves its
 * state with the memory file moved into the snapshot and exits; the sandbox's VM, network and
 * capacity are released and it is recorded paused. Only files on disk remain.
 */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "auth/apikey.h"
#include "common/fault.h"
#include "common/log.h"
#include "metering/plan.h"
#include "vmm/hv.h"
#include "node/lifecycle.h"
#include "node/pause.h"
#include "node/warm.h"

/* Allocated bytes of a file (holes cost nothing); 0 when it is absent. */
static long long file_bytes(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 ? (long long)st.st_blocks * 512 : 0;
}

/*
 * Reserves room in the snapshot directory's file system for a pause of `sb`: its memory image
 * (copied there from /dev/shm; when the VM maps a snapshot's image privately, its memory goes
 * into the state stream instead, counted at the guest's full size) and its disk layer, with a
 * margin, on top of what pauses in progress have reserved. Checked before the VM is touched, so a
 * full disk refuses the pause and the sandbox runs on. Returns the bytes reserved (release them
 * with pause_release), or -1 with `err` set.
 */
static long long pause_reserve(struct node *n, const struct sandbox *sb, struct kiln_error *err)
{
	char mem[300], disk[700];
	struct statvfs vfs;
	long long need, have, busy;

	snprintf(mem, sizeof(mem), "/dev/shm/kiln-%s-%s.mem", n->cfg.node_id, sb->id);
	snprintf(disk, sizeof(disk), "%s/%s/disk.qcow2", n->vm_state_root, sb->id);
	need = (access(mem, F_OK) == 0 ? file_bytes(mem) : (long long)sb->mem_mib << 20) +
	       file_bytes(disk) + (64ll << 20);
	if (statvfs(n->snap_root, &vfs) != 0) {
		kiln_error_set(err, KILN_E_IO, "cannot read the free space of \"%s\"", n->snap_root);
		return -1;
	}
	have = (long long)vfs.f_bavail * (long long)vfs.f_frsize;
	pthread_mutex_lock(&n->reg_lock);
	busy = n->pause_reserved;
	if (have - busy >= need)
		n->pause_reserved += need;
	pthread_mutex_unlock(&n->reg_lock);
	if (have - busy >= need)
		return need;
	kiln_error_set(err, KILN_E_UNAVAILABLE,
		       "no room for the snapshot on this node (%lld MiB needed, %lld MiB free); "
		       "the sandbox runs on",
		       need >> 20, (have - busy) >> 20);
	return -1;
}

static void pause_release(struct node *n, long long bytes)
{
	pthread_mutex_lock(&n->reg_lock);
	n->pause_reserved -= bytes;
	pthread_mutex_unlock(&n->reg_lock);
}

/*
 * The snapshot bytes a pause of `sb` reserves against its tenant's plan: the guest's full memory
 * (what the snapshot's memory image can reach however much the guest touches before its VM
 * stops), its disk layer's allocated bytes now, and PAUSE_PLAN_MARGIN for the disk writes and the
 * device state that come until the VM stops. A snapshot larger than that (a guest that writes
 * more than the margin to its disk in that moment) is recorded at its real size: the documented
 * bound on how far a batch of pauses can pass the limit (docs/snapshots.md).
 */
#define PAUSE_PLAN_MARGIN (64ll << 20)
static long long pause_plan_bytes(const struct node *n, const struct sandbox *sb)
{
	char disk[700];

	snprintf(disk, sizeof(disk), "%s/%s/disk.qcow2", n->vm_state_root, sb->id);
	return ((long long)sb->mem_mib << 20) + file_bytes(disk) + PAUSE_PLAN_MARGIN;
}

/*
 * Reserves `bytes` for the snapshot `snap_id` of `sb` against its tenant's plan, in a transaction
 * of its own (plan_snapshot_reserve). A forced pause goes on when the database cannot be reached
 * (it is counted once it is recorded).
 */
static enum kiln_err pause_plan_reserve(struct node *n, const struct sandbox *sb, const char *snap_id,
					long long bytes, bool forced, struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(n->pg, &c, err);

	if (rc == KILN_OK) {
		rc = pg_exec(c, "BEGIN", err);
		if (rc == KILN_OK)
			rc = plan_snapshot_reserve(c, sb->tenant_id, snap_id, bytes, forced, err);
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		else
			pg_exec(c, "ROLLBACK", NULL);
		pg_release(n->pg, c);
	}
	if (rc == KILN_OK || rc == KILN_E_QUOTA)
		return rc;
	if (forced) {
		log_warn("pause of \"%s\": snapshot bytes not reserved (%s); it goes on", sb->id, err->msg);
		kiln_error_clear(err);
		return KILN_OK;
	}
	return node_error(err, KILN_E_UNAVAILABLE,
			  "the snapshot could not be reserved (%s); the sandbox runs on", err->msg);
}

/* Drops the plan reservation of a pause that did not happen (a leftover expires in an hour). */
static void pause_plan_unreserve(struct node *n, const char *snap_id)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(n->pg, &c, &err) == KILN_OK) {
		plan_snapshot_unreserve(c, snap_id, &err);
		pg_release(n->pg, c);
	}
	if (err.code != KILN_OK)
		log_warn("the reservation of snapshot \"%s\" not dropped: %s", snap_id, err.msg);
}

/*
 * Stops the vCPUs of `sb` and logs the instant with its cgroup CPU counter (record_vcpus_stopped),
 * so the pause is billed from the stop and the CPU of writing the snapshot is not billed as the
 * guest's (docs/metering.md). A stop or a log that fails only costs that exactness: the
 * snapshot stops the VM itself and the pause is then billed from its record.
 */
static void pause_stop_vcpus(struct node *n, struct sandbox *sb)
{
	struct kiln_error err = { 0 };
	struct record_fence f = sb_fence(n, sb);
	struct cg_usage u = { 0 };
	struct timespec ts;

	if (vmm_pause(sb->vm, &err) != KILN_OK || vmm_usage(sb->vm, &u, &err) != KILN_OK) {
		log_warn("pause of \"%s\": the vCPUs' stop not logged: %s", sb->id, err.msg);
		return;
	}
	clock_gettime(CLOCK_REALTIME, &ts);
	if (record_vcpus_stopped(n->pg, NULL, &f, (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec,
				 u.cpu_ns, &err) != KILN_OK)
		log_warn("pause of \"%s\": the vCPUs' stop not logged: %s", sb->id, err.msg);
}

/*
 * Saves `sb`'s running VM into the new snapshot `dir`: its network policy, the VMM's snapshot
 * (the VMM ends), the policy again with the bandwidth bucket's final level, and the manifest.
 * On failure the snapshot is removed and the VM goes on if its VMM still lives; if the VMM
 * ended, the snapshot is finished from its files when it can be.
 */
enum kiln_err pause_save(struct node *n, struct sandbox *sb, const char *dir,
				struct kiln_error *err)
{
	struct kiln_error ignore = { 0 };
	struct vmm_status st = { 0 };
	enum kiln_err rc = save_policy_public(sb, dir, err);

	if (rc == KILN_OK)
		pause_stop_vcpus(n, sb);
	if (rc == KILN_OK)
		rc = vmm_snapshot(sb->vm, dir, VMM_SNAP_SHARED, err);
	/*
	 * Again now that the VM has stopped: the bandwidth bucket's level is final (the first write
	 * checked the policy could be saved before the VM was touched).
	 */
	if (rc == KILN_OK)
		rc = save_policy_public(sb, dir, err);
	if (rc != KILN_OK && vmm_status(sb->vm, &st, &ignore) == KILN_OK && !st.alive &&
	    vmm_snapshot_finish(sb->vm, dir, &ignore) == KILN_OK) {
		log_warn("pause of \"%s\": finished its snapshot after \"%s\"", sb->id, err->msg);
		kiln_error_clear(err);
		rc = KILN_OK;
	}
	if (rc == KILN_OK) {
		kiln_fault("pause-before-manifest");
		rc = write_manifest_public(n, sb, dir, err);
	}
	if (rc == KILN_OK) {
		kiln_fault("pause-after-snapshot");
		return KILN_OK;
	}
	/* Nothing is lost: the VM goes on if it still can (else it failed). */
	kiln_error_clear(&ignore);
	if (vmm_status(sb->vm, &st, &ignore) == KILN_OK && st.alive) {
		struct kiln_error why = *err;

		struct record_fence f = sb_fence(n, sb);
		struct timespec ts;

		vmm_resume(sb->vm, &ignore);
		clock_gettime(CLOCK_REALTIME, &ts);
		record_vcpus_resumed(n->pg, NULL, &f, (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec,
				     &ignore);
		snap_remove_files(dir);
		log_warn("pause of \"%s\" failed, the sandbox runs on: %s", sb->id, why.msg);
		kiln_error_clear(err);
		kiln_error_set(err, KILN_E_UNAVAILABLE, "the snapshot could not be written (%s); the sandbox runs on",
			       why.msg);
		return err->code;
	} else {
		sb_failed(n, sb, "the VM ended while it was paused");
		log_error("pause of \"%s\" failed after its VMM ended; \"%s\" kept", sb->id, dir);
	}
	return rc;
}

/* Records `sb` paused on its complete snapshot `snap_id` (in `dir`) in one transaction. */
enum kiln_err pause_record(struct node *n, const struct sandbox *sb, const char *snap_id,
				 const char *dir, struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(n->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = pg_exec(c, "BEGIN", err);
	/* The snapshot's reservation ends as the snapshot itself is counted. */
	if (rc == KILN_OK)
		rc = plan_snapshot_unreserve(c, snap_id, err);
	if (rc == KILN_OK)
		rc = snap_record_public(n, c, sb, snap_id, "pause", NULL, dir, err);
	if (rc == KILN_OK) {
		struct record_fence f = sb_fence(n, sb);
		rc = record_paused(n->pg, c, &f, snap_id, err);
	}
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", err);
	else
		pg_exec(c, "ROLLBACK", NULL);
	pg_release(n->pg, c);
	return rc;
}

enum kiln_err sb_pause(struct node *n, struct sandbox *sb, bool forced, bool ahead,
		       struct kiln_error *err)
{
	char id[AUTH_ID_MAX], dir[600];
	long long reserved;
	enum kiln_err rc;

	if (sb->state != SB_RUNNING || !sb->vm)
		return kiln_error_set(err, KILN_E_CONFLICT, "the sandbox is %s",
				      sb_state_name(sb->state));
	rc = auth_new_id("snap_", id, sizeof(id));
	if (rc != KILN_OK)
		return kiln_error_set(err, rc, "cannot make an id");
	if ((reserved = pause_reserve(n, sb, err)) < 0)
		return err->code;
	rc = pause_plan_reserve(n, sb, id, pause_plan_bytes(n, sb), forced, err);
	if (rc != KILN_OK) {
		pause_release(n, reserved);
		return rc;
	}
	kiln_fault("pause-space-reserved");
	snap_dir(n, id, dir, sizeof(dir));
	rc = pause_save(n, sb, dir, err);
	pause_release(n, reserved);
	if (rc != KILN_OK) {
		pause_plan_unreserve(n, id);
		return rc;
	}
	rc = pause_record(n, sb, id, dir, err);
	if (rc != KILN_OK) {
		/* The snapshot is complete; a restart finds it (node recovery) even if this failed. */
		log_error("pause of \"%s\" not recorded: %s", sb->id, err->msg);
	} else {
		snap_upload(n, id, sb->tenant_id);
	}
	/*
	 * Its resume, if it comes soon, on a VMM started ahead (warm.c); kept before the sandbox
	 * leaves the table, which a resume waits for, so that no resume comes before it.
	 */
	if (rc == KILN_OK && ahead)
		warm_add_paused(n, id, sb->vcpu_milli, sb->mem_mib, sb->disk_gib);
	sb_teardown(n, sb);
	sb->state = SB_PAUSED;
	log_info("sandbox \"%s\" paused into \"%s\"", sb->id, id);
	return KILN_OK;
}

