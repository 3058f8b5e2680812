/*
 * lifecycle.c - pause, resume, fork and named snapshots of sandboxes on this node.
 *
 * A snapshot is a directory under <data_dir>/snaps/<node>/<snap id>: the VM's device state, its
 * memory image (pause, fork), its frozen disk layer, the sandbox's network policy
 * (netpolicy.json) and a manifest (vmm/snapshot.h) that a restore verifies first.
 *
 * - pause: the VMM saves its state with the memory file moved into the snapshot and exits; the
 *   sandbox's VM, network and capacity are released. Only files on disk remain.
 * - resume: a new VMM restores from the snapshot with a copy of its memory (so a failed resume
 *   loses nothing), behind a new network with the same policy; the generation is bumped.
 * - fork: one snapshot, then `count` children restored from it with its memory image mapped
 *   privately (pages shared until written) and the parent restored on a copy of its own (a
 *   private mapping would see later writes through a shared one). All children or none.
 * - named snapshot: the VM is stopped, saved whole, and continued.
 *
 * Restored VMs stand on the snapshot's frozen disk layer: every sandbox lists the snapshots under
 * it (sandboxes.lineage), and a snapshot's files go only when nothing lists it (snap_gc).
 */
#include <errno.h>
#include <glob.h>
#include <signal.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "auth/apikey.h"
#include "common/json.h"
#include "common/log.h"
#include "vmm/agent.h"
#include "vmm/guest/agent_proto.h"
#include "vmm/hv.h"
#include "vmm/node/lifecycle.h"
#include "vmm/node/storage_sync.h"
#include "vmm/snapshot.h"

#define NETPOLICY_FILE "netpolicy.json"

void snap_dir(struct node *n, const char *snap_id, char *out, size_t len)
{
	snprintf(out, len, "%s/%s", n->snap_root, snap_id);
}

void snap_upload(struct node *n, const char *snap_id, const char *tenant_id)
{
	struct kiln_error err = { 0 };

	/* The snapshot is durable here already: an upload that cannot start never undoes it. */
	if (n->store && snapstore_upload_start(n->store, snap_id, tenant_id, &err) != KILN_OK)
		log_error("upload of snapshot \"%s\" did not start: %s", snap_id, err.msg);
}

/* Writes the sandbox's rules and bandwidth into the snapshot, for the VMs restored from it. */
enum kiln_err save_policy_public(struct sandbox *sb, const char *dir, struct kiln_error *err)
{
	struct kiln_ruleset rs = { 0 };
	struct kiln_bandwidth bw;
	enum kiln_egress_mode mode;
	char path[700], text[KILN_RULE_TEXT_MAX];
	json_t *rules = json_array(), *doc;
	enum kiln_err rc;
	int r;

	rc = kiln_policy_rules(sb->pol, &rs, &mode, err);
	if (rc == KILN_OK)
		rc = kiln_policy_get_bandwidth(sb->pol, &bw, err);
	if (rc != KILN_OK) {
		json_decref(rules);
		kiln_ruleset_free(&rs);
		return rc;
	}
	for (size_t i = 0; i < rs.n; i++) {
		kiln_rule_format(&rs.rules[i], text, sizeof(text));
		json_array_append_new(rules, json_string(text));
	}
	kiln_ruleset_free(&rs);
	doc = json_pack("{s:s, s:o, s:{s:I, s:I, s:i, s:I, s:b}}", "sandbox", sb->id, "rules", rules,
			"bandwidth",
			"quota_bytes", (json_int_t)bw.quota_bytes, "refill_bytes",
			(json_int_t)bw.refill_bytes, "refill_interval_s", (int)bw.refill_interval_s,
			"one_time_burst_bytes", (json_int_t)bw.one_time_burst_bytes, "unmetered",
			bw.unmetered);
	if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
		json_decref(doc);
		return kiln_error_set(err, KILN_E_IO, "cannot create \"%s\"", dir);
	}
	snprintf(path, sizeof(path), "%s/%s", dir, NETPOLICY_FILE);
	r = json_dump_file(doc, path, JSON_COMPACT);
	json_decref(doc);
	return r == 0 ? KILN_OK : kiln_error_set(err, KILN_E_IO, "cannot write \"%s\"", path);
}

enum kiln_err snap_load_policy(const char *dir, struct kiln_ruleset *rs, struct kiln_bandwidth *bw,
			       struct kiln_error *err)
{
	char path[700];
	const char *texts[KILN_RULESET_MAX];
	json_t *doc, *rules, *b;
	enum kiln_err rc;
	size_t n;

	memset(rs, 0, sizeof(*rs));
	memset(bw, 0, sizeof(*bw));
	bw->unmetered = true;
	bw->refill_interval_s = 1;
	snprintf(path, sizeof(path), "%s/%s", dir, NETPOLICY_FILE);
	doc = json_load_file(path, 0, NULL);
	if (!doc)
		return kiln_error_set(err, KILN_E_INVALID, "the snapshot has no network policy");
	rules = json_object_get(doc, "rules");
	n = json_array_size(rules);
	if (n > KILN_RULESET_MAX)
		n = KILN_RULESET_MAX;
	for (size_t i = 0; i < n; i++)
		texts[i] = json_is_string(json_array_get(rules, i)) ? json_string_value(json_array_get(rules, i)) : "";
	rc = kiln_rules_parse(texts, n, rs, err);
	b = json_object_get(doc, "bandwidth");
	if (rc == KILN_OK && json_is_object(b)) {
		bw->quota_bytes = (uint64_t)json_int(b, "quota_bytes", 0);
		bw->refill_bytes = (uint64_t)json_int(b, "refill_bytes", 0);
		bw->refill_interval_s = (uint32_t)json_int(b, "refill_interval_s", 1);
		bw->one_time_burst_bytes = (uint64_t)json_int(b, "one_time_burst_bytes", 0);
		bw->unmetered = json_is_true(json_object_get(b, "unmetered"));
	}
	json_decref(doc);
	return rc;
}

/* The manifest of a snapshot of `sb` just written into `dir`. */
enum kiln_err write_manifest_public(struct node *n, const struct sandbox *sb, const char *dir,
				    struct kiln_error *err)
{
	struct snapshot_meta m = { 0 };

	m.format = SNAPSHOT_FORMAT;
	snprintf(m.hypervisor, sizeof(m.hypervisor), "%s", n->cfg.hypervisor);
	snprintf(m.machine, sizeof(m.machine), "microvm");
	snprintf(m.accel, sizeof(m.accel), "%s", n->accel);
	snprintf(m.image_hash, sizeof(m.image_hash), "%s",
		 n->cfg.guest_image_hash[0] ? n->cfg.guest_image_hash : "unknown");
	m.vcpu_milli = sb->vcpu_milli;
	m.mem_mib = sb->mem_mib;
	m.disk_gib = sb->disk_gib;
	m.agent_protocol = AGENT_PROTO_VERSION;
	return snapshot_manifest_write(dir, &m, err);
}

enum kiln_err snap_verify(struct node *n, const char *dir, struct kiln_error *err)
{
	struct snapshot_expect e = {
		.hypervisor = n->cfg.hypervisor,
		.machine = "microvm",
		.accel = n->accel,
		.image_hash = n->cfg.guest_image_hash[0] ? n->cfg.guest_image_hash : "unknown",
		.agent_protocol = AGENT_PROTO_VERSION,
	};

	return snapshot_verify(dir, &e, NULL, err);
}

static long long dir_bytes;

static int add_size(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	if (flag == FTW_F)
		dir_bytes += (long long)st->st_blocks * 512;
	return 0;
}

/* Bytes a snapshot takes on disk (allocated blocks: holes cost nothing). Not thread-safe. */
static long long snapshot_size(const char *dir)
{
	static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
	long long v;

	pthread_mutex_lock(&lock);
	dir_bytes = 0;
	nftw(dir, add_size, 8, FTW_PHYS);
	v = dir_bytes;
	pthread_mutex_unlock(&lock);
	return v;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

void snap_remove_files(const char *dir)
{
	if (access(dir, F_OK) == 0)
		nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* Records a snapshot taken of `sb` (on connection `c`, inside the caller's transaction or not). */
enum kiln_err snap_record_public(struct node *n, struct pg_conn *c, const struct sandbox *sb,
				 const char *snap_id, const char *kind, const char *name,
				 const char *dir, struct kiln_error *err)
{
	char size[24], v[16], m[16], d[16];

	snprintf(size, sizeof(size), "%lld", snapshot_size(dir));
	snprintf(v, sizeof(v), "%u", sb->vcpu_milli);
	snprintf(m, sizeof(m), "%u", sb->mem_mib);
	snprintf(d, sizeof(d), "%u", sb->disk_gib);
	return PGQ(c, NULL, err,
		   "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, name, size_bytes, "
		   "vcpu_milli, memory_mib, disk_gib, lineage, deleted_at) "
		   "SELECT $1, $2, $3, $4, $5, $6, $7::bigint, $8::int, $9::int, $10::int, s.lineage, "
		   "CASE WHEN $5 = 'named' THEN NULL ELSE now() END FROM sandboxes s WHERE s.id = $3",
		   snap_id, sb->tenant_id, sb->id, n->cfg.node_id, kind, name, size, v, m, d);
}

/* Allocated bytes of a file (holes cost nothing); 0 when it is absent. */
static long long file_bytes(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 ? (long long)st.st_blocks * 512 : 0;
}

/*
 * Whether the snapshot directory's file system has room for a pause of `sb`: its memory image
 * (moved there from /dev/shm, which copies across file systems) and its disk layer, with a
 * margin. Checked before the VM is touched, so a full disk refuses the pause and the sandbox
 * runs on; the VMM is ended only once the state file is safely written.
 */
static bool pause_has_room(struct node *n, const struct sandbox *sb, struct kiln_error *err)
{
	char mem[300], disk[700];
	struct statvfs vfs;
	long long need, have;

	snprintf(mem, sizeof(mem), "/dev/shm/kiln-%s-%s.mem", n->cfg.node_id, sb->id);
	snprintf(disk, sizeof(disk), "%s/%s/disk.qcow2", n->vm_state_root, sb->id);
	need = file_bytes(mem) + file_bytes(disk) + (64ll << 20);
	if (statvfs(n->snap_root, &vfs) != 0)
		return kiln_error_set(err, KILN_E_IO, "cannot read the free space of \"%s\"",
				      n->snap_root) == KILN_OK;
	have = (long long)vfs.f_bavail * (long long)vfs.f_frsize;
	if (have >= need)
		return true;
	kiln_error_set(err, KILN_E_UNAVAILABLE,
		       "no room for the snapshot on this node (%lld MiB needed, %lld MiB free); "
		       "the sandbox runs on",
		       need >> 20, have >> 20);
	return false;
}

enum kiln_err sb_pause(struct node *n, struct sandbox *sb, struct kiln_error *err)
{
	char id[AUTH_ID_MAX], dir[600];
	struct pg_conn *c;
	enum kiln_err rc;

	if (sb->state != SB_RUNNING || !sb->vm)
		return kiln_error_set(err, KILN_E_CONFLICT, "the sandbox is %s",
				      sb_state_name(sb->state));
	if (!pause_has_room(n, sb, err))
		return err->code;
	rc = auth_new_id("snap_", id, sizeof(id));
	if (rc != KILN_OK)
		return kiln_error_set(err, rc, "cannot make an id");
	snap_dir(n, id, dir, sizeof(dir));
	rc = save_policy_public(sb, dir, err);
	if (rc == KILN_OK)
		rc = vmm_snapshot(sb->vm, dir, VMM_SNAP_SHARED, err);
	if (rc == KILN_OK)
		rc = write_manifest_public(n, sb, dir, err);
	/* Fault injection for the tests of a node killed between the snapshot and its record. */
	if (rc == KILN_OK && getenv("KILN_FAULT") && !strcmp(getenv("KILN_FAULT"), "pause-after-snapshot"))
		raise(SIGKILL);
	if (rc != KILN_OK) {
		/* Nothing is lost: the VM goes on if it still can (else it failed). */
		struct kiln_error ignore = { 0 };
		struct vmm_status st = { 0 };
		if (vmm_status(sb->vm, &st, &ignore) == KILN_OK && st.alive)
			vmm_resume(sb->vm, &ignore);
		else
			sb_set_state(n, sb, SB_ERROR, "the VM ended while it was paused");
		snap_remove_files(dir);
		return rc;
	}
	rc = pg_acquire(n->pg, &c, err);
	if (rc == KILN_OK) {
		rc = pg_exec(c, "BEGIN", err);
		if (rc == KILN_OK)
			rc = snap_record_public(n, c, sb, id, "pause", NULL, dir, err);
		if (rc == KILN_OK)
			rc = PGQ(c, NULL, err,
				 "UPDATE sandboxes SET state = 'paused', pause_snapshot = $2, "
				 "net_index = NULL, state_changed_at = now() WHERE id = $1",
				 sb->id, id);
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		pg_release(n->pg, c);
	}
	if (rc != KILN_OK) {
		/* The snapshot is complete; a restart finds it (node recovery) even if this failed. */
		log_error("pause of \"%s\" not recorded: %s", sb->id, err->msg);
	} else {
		snap_upload(n, id, sb->tenant_id);
	}
	sb_teardown(n, sb);
	sb->state = SB_PAUSED;
	log_info("sandbox \"%s\" paused into \"%s\"", sb->id, id);
	return KILN_OK;
}

enum kiln_err snap_restore_new(struct node *n, struct sandbox *sb, const char *snap_id,
			       enum vmm_mem_from from, const struct sb_init *override, bool fresh,
			       struct kiln_error *err)
{
	char dir[600];
	struct kiln_ruleset rs;
	struct kiln_bandwidth bw;
	struct sb_init init = { 0 };
	enum kiln_err rc;

	snap_dir(n, snap_id, dir, sizeof(dir));
	rc = snap_verify(n, dir, err);
	if (rc != KILN_OK)
		return rc;
	rc = snap_load_policy(dir, &rs, &bw, err);
	if (rc != KILN_OK)
		return rc;
	init.egress = &rs;
	init.bandwidth = &bw;
	if (override) {
		init.env = override->env;
		if (override->egress)
			init.egress = override->egress;
		if (override->bandwidth)
			init.bandwidth = override->bandwidth;
	}
	rc = sb_restore(n, sb, dir, from, &init, fresh, err);
	kiln_ruleset_free(&rs);
	return rc;
}

int snap_recover_pauses(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	int found = 0;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return 0;
	if (PGQ(c, &res, &err,
		"SELECT id, tenant_id FROM sandboxes WHERE node_id = $1 AND deleted_at IS NULL "
		"AND state IN ('creating', 'running', 'error')",
		n->cfg.node_id) != KILN_OK) {
		pg_release(n->pg, c);
		return 0;
	}
	for (int i = 0; i < pg_res_rows(res); i++) {
		const char *id = pg_res_str(res, i, 0);
		char pattern[640], best[600] = "", snap[AUTH_ID_MAX];
		time_t best_t = 0;
		glob_t g;

		/* Its newest complete snapshot not yet recorded: a pause cut short after the save. */
		snprintf(pattern, sizeof(pattern), "%s/snap_*/" NETPOLICY_FILE, n->snap_root);
		if (glob(pattern, 0, NULL, &g) != 0)
			continue;
		for (size_t k = 0; k < g.gl_pathc; k++) {
			json_t *doc = json_load_file(g.gl_pathv[k], 0, NULL);
			struct stat st;
			char dir[600];

			if (doc && !strcmp(json_str(doc, "sandbox", ""), id) && stat(g.gl_pathv[k], &st) == 0 &&
			    st.st_mtime >= best_t) {
				snprintf(dir, sizeof(dir), "%.*s", (int)(strrchr(g.gl_pathv[k], '/') - g.gl_pathv[k]),
					 g.gl_pathv[k]);
				if (snap_verify(n, dir, &err) == KILN_OK) {
					snprintf(best, sizeof(best), "%s", dir);
					best_t = st.st_mtime;
				} else {
					log_warn("snapshot \"%s\" of \"%s\" is not whole: %s", dir, id,
						 err.msg);
				}
				kiln_error_clear(&err);
			}
			json_decref(doc);
		}
		globfree(&g);
		if (!best[0])
			continue;
		snprintf(snap, sizeof(snap), "%s", strrchr(best, '/') + 1);
		{
			struct pg_res *known = NULL;
			char size[24];
			snprintf(size, sizeof(size), "%lld", snapshot_size(best));
			if (PGQ(c, &known, &err, "SELECT 1 FROM snapshots WHERE id = $1", snap) == KILN_OK &&
			    pg_res_rows(known) == 0)
				PGQ(c, NULL, &err,
				    "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, "
				    "vcpu_milli, memory_mib, disk_gib, lineage, deleted_at) SELECT $1, tenant_id, "
				    "id, node_id, 'pause', $3::bigint, vcpu_milli, memory_mib, disk_gib, lineage, "
				    "now() FROM sandboxes WHERE id = $2",
				    snap, id, size);
			pg_res_free(known);
		}
		if (PGQ(c, NULL, &err,
			"UPDATE sandboxes SET state = 'paused', pause_snapshot = $2, net_index = NULL, "
			"error = NULL, state_changed_at = now() WHERE id = $1",
			id, snap) == KILN_OK) {
			log_warn("sandbox \"%s\" recorded as paused: its snapshot \"%s\" is complete", id,
				 snap);
			found++;
		}
	}
	pg_res_free(res);
	pg_release(n->pg, c);
	return found;
}

void snap_gc(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return;
	if (PGQ(c, &res, &err,
		"SELECT p.id, p.storage, coalesce(p.tenant_id, '') FROM snapshots p WHERE p.node_id = $1 AND p.deleted_at IS NOT NULL "
		"AND p.purged_at IS NULL "
		"AND NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.deleted_at IS NULL "
		"  AND (p.id = ANY (s.lineage) OR s.pause_snapshot = p.id)) "
		"AND NOT EXISTS (SELECT 1 FROM snapshots q WHERE q.deleted_at IS NULL "
		"  AND p.id = ANY (q.lineage))",
		n->cfg.node_id) == KILN_OK) {
		for (int i = 0; i < pg_res_rows(res); i++) {
			char dir[600];
			const char *id = pg_res_str(res, i, 0);

			if (n->store && strcmp(pg_res_str(res, i, 1), "s3") == 0) {
				struct kiln_error serr = { 0 };
				/* Its object in the bucket goes too; retried at the next round if not. */
				if (snapstore_delete(n->store, id, pg_res_str(res, i, 2), &serr) != KILN_OK) {
					log_warn("snapshot \"%s\" stays in its bucket for now: %s", id,
						 serr.msg);
					continue;
				}
			}
			snap_dir(n, id, dir, sizeof(dir));
			snap_remove_files(dir);
			PGQ(c, NULL, &err, "UPDATE snapshots SET purged_at = now() WHERE id = $1", id);
			log_info("removed the files of snapshot \"%s\"", id);
		}
	}
	pg_res_free(res);
	pg_release(n->pg, c);
}
