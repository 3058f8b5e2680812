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
#include "common/fault.h"
#include "common/json.h"
#include "common/log.h"
#include "vmm/agent.h"
#include "vmm/guest/agent_proto.h"
#include "vmm/hv.h"
#include "node/lifecycle.h"
#include "node/storage_sync.h"
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
 * Saves `sb`'s running VM into the new snapshot `dir`: its network policy, the VMM's snapshot
 * (the VMM ends) and the manifest. On failure the snapshot is removed and the VM goes on if its
 * VMM still lives; if the VMM ended, the snapshot is finished from its files when it can be.
 */
static enum kiln_err pause_save(struct node *n, struct sandbox *sb, const char *dir,
				struct kiln_error *err)
{
	struct kiln_error ignore = { 0 };
	struct vmm_status st = { 0 };
	enum kiln_err rc = save_policy_public(sb, dir, err);

	if (rc == KILN_OK)
		rc = vmm_snapshot(sb->vm, dir, VMM_SNAP_SHARED, err);
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

		vmm_resume(sb->vm, &ignore);
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
static enum kiln_err pause_record(struct node *n, const struct sandbox *sb, const char *snap_id,
				 const char *dir, struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(n->pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = pg_exec(c, "BEGIN", err);
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

enum kiln_err sb_pause(struct node *n, struct sandbox *sb, struct kiln_error *err)
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
	kiln_fault("pause-space-reserved");
	snap_dir(n, id, dir, sizeof(dir));
	rc = pause_save(n, sb, dir, err);
	pause_release(n, reserved);
	if (rc != KILN_OK)
		return rc;
	rc = pause_record(n, sb, id, dir, err);
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

/* Whether snapshot `snap_id` is recorded in Postgres (errors count as recorded: hands off). */
static bool snap_known(struct pg_conn *c, const char *snap_id)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	bool known = PGQ(c, &res, &err, "SELECT 1 FROM snapshots WHERE id = $1", snap_id) != KILN_OK ||
		     pg_res_rows(res) > 0;

	pg_res_free(res);
	return known;
}

/*
 * Calls fn(dir, sandbox id, mtime, arg) for each snapshot directory no record names: snapshots
 * a node stopped inside of (a pause, a fork, a named snapshot or a template cut short).
 */
static void for_each_unrecorded(struct node *n, struct pg_conn *c,
				void (*fn)(const char *dir, const char *sandbox, time_t mtime, void *arg),
				void *arg)
{
	char pattern[640], dir[600];
	glob_t g;

	snprintf(pattern, sizeof(pattern), "%s/snap_*/", n->snap_root);
	if (glob(pattern, GLOB_ONLYDIR | GLOB_MARK, NULL, &g) != 0)
		return;
	for (size_t k = 0; k < g.gl_pathc; k++) {
		char policy[700];
		struct stat st;
		json_t *doc;

		snprintf(dir, sizeof(dir), "%.*s", (int)strlen(g.gl_pathv[k]) - 1, g.gl_pathv[k]);
		if (snap_known(c, strrchr(dir, '/') + 1))
			continue;
		snprintf(policy, sizeof(policy), "%s/" NETPOLICY_FILE, dir);
		doc = json_load_file(policy, 0, NULL);
		fn(dir, doc ? json_str(doc, "sandbox", "") : "", stat(policy, &st) == 0 ? st.st_mtime : 0, arg);
		json_decref(doc);
	}
	globfree(&g);
}

struct newest {
	const char *sandbox;
	char dir[600];
	time_t mtime;
};

static void pick_newest(const char *dir, const char *sandbox, time_t mtime, void *arg)
{
	struct newest *nw = arg;

	if (strcmp(sandbox, nw->sandbox) == 0 && (!nw->dir[0] || mtime >= nw->mtime)) {
		snprintf(nw->dir, sizeof(nw->dir), "%s", dir);
		nw->mtime = mtime;
	}
}

struct unrecorded {
	struct node *n;
	struct pg_conn *c;
};

/*
 * Removes an unrecorded snapshot directory that is not whole, or whose sandbox no longer runs
 * here. A whole one of a sandbox still shown running stays: its record failed (Postgres away),
 * and the next start records it as that sandbox's pause.
 */
static void remove_unrecorded(const char *dir, const char *sandbox, time_t mtime, void *arg)
{
	struct unrecorded *u = arg;
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	bool keep = snap_verify(u->n, dir, &err) == KILN_OK &&
		    (PGQ(u->c, &res, &err,
			 "SELECT 1 FROM sandboxes WHERE id = $1 AND node_id = $2 AND deleted_at IS NULL "
			 "AND state IN ('running', 'error')",
			 sandbox, u->n->cfg.node_id) != KILN_OK ||
		     pg_res_rows(res) > 0);

	pg_res_free(res);
	if (keep) {
		log_warn("keeping \"%s\": a whole snapshot of \"%s\" not recorded yet", dir, sandbox);
		return;
	}
	log_warn("removing \"%s\": a snapshot cut short that nothing records", dir);
	snap_remove_files(dir);
}

/* How far manifest.json in `dir` is written: none, the driver's part, or with the digests. */
enum manifest_stage { MANIFEST_NONE, MANIFEST_DRIVER, MANIFEST_DIGESTS };

static enum manifest_stage manifest_stage(const char *dir)
{
	char path[700];
	json_t *m;
	enum manifest_stage st;

	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	m = json_load_file(path, 0, NULL);
	st = !m ? MANIFEST_NONE : json_object_get(m, "files") ? MANIFEST_DIGESTS : MANIFEST_DRIVER;
	json_decref(m);
	return st;
}

/*
 * A pause of `sb` cut short once its VMM had ended: the newest snapshot of `sb` no record names
 * is finished from the files the VM left (`sb->vm`, an adopted handle, when its record is still
 * there), checked, and recorded as its pause.
 */
static enum kiln_err recover_cut_pause(struct node *n, struct pg_conn *c, struct sandbox *sb,
				       char *snap_id, struct kiln_error *err)
{
	struct newest nw = { .sandbox = sb->id };
	enum kiln_err rc = KILN_OK;

	for_each_unrecorded(n, c, pick_newest, &nw);
	if (!nw.dir[0])
		return kiln_error_set(err, KILN_E_NOT_FOUND, "no snapshot of it was begun");
	if (sb->vm)
		rc = vmm_snapshot_finish(sb->vm, nw.dir, err);
	if (rc == KILN_OK && snap_verify(n, nw.dir, err) != KILN_OK) {
		/* whole by the VMM's part (its manifest, written last), without the digests yet: add them */
		if (manifest_stage(nw.dir) != MANIFEST_DRIVER)
			return err->code;
		kiln_error_clear(err);
		rc = write_manifest_public(n, sb, nw.dir, err);
		if (rc == KILN_OK)
			rc = snap_verify(n, nw.dir, err);
	}
	snprintf(snap_id, AUTH_ID_MAX, "%s", strrchr(nw.dir, '/') + 1);
	return rc == KILN_OK ? pause_record(n, sb, snap_id, nw.dir, err) : rc;
}

/* A VM the earlier run left running: paused into a new snapshot, as a pause would. */
static enum kiln_err recover_running(struct node *n, struct sandbox *sb, char *snap_id,
				     struct kiln_error *err)
{
	struct kiln_policy_config pc = { .node_id = n->cfg.node_id, .sandbox_id = sb->id };
	char dir[600];
	enum kiln_err rc;

	/* its rules and bandwidth, from the pinned maps (never reopened wider than they were) */
	rc = kiln_policy_open(&pc, &sb->pol, err);
	if (rc == KILN_OK)
		rc = auth_new_id("snap_", snap_id, AUTH_ID_MAX);
	if (rc == KILN_OK) {
		snap_dir(n, snap_id, dir, sizeof(dir));
		sb->state = SB_RUNNING;
		rc = pause_save(n, sb, dir, err);
	}
	if (rc == KILN_OK)
		rc = pause_record(n, sb, snap_id, dir, err);
	kiln_policy_close(sb->pol);
	sb->pol = NULL;
	return rc;
}

int snap_recover(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	int found = 0;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return 0;
	if (PGQ(c, &res, &err,
		"SELECT id, tenant_id, vcpu_milli, memory_mib, disk_gib, generation FROM sandboxes "
		"WHERE node_id = $1 AND deleted_at IS NULL AND state IN ('running', 'error')",
		n->cfg.node_id) != KILN_OK) {
		pg_release(n->pg, c);
		return 0;
	}
	for (int i = 0; i < pg_res_rows(res); i++) {
		struct sandbox sb = { 0 };
		struct vmm_status st = { 0 };
		char state_dir[700], snap[AUTH_ID_MAX];
		enum kiln_err rc;

		snprintf(sb.id, sizeof(sb.id), "%s", pg_res_str(res, i, 0));
		snprintf(sb.tenant_id, sizeof(sb.tenant_id), "%s", pg_res_str(res, i, 1));
		sb.vcpu_milli = (unsigned)atoi(pg_res_str(res, i, 2));
		sb.mem_mib = (unsigned)atoi(pg_res_str(res, i, 3));
		sb.disk_gib = (unsigned)atoi(pg_res_str(res, i, 4));
		sb.generation = pg_res_int(res, i, 5, 0);
		snprintf(state_dir, sizeof(state_dir), "%s/%s", n->vm_state_root, sb.id);
		kiln_error_clear(&err);
		rc = vmm_adopt(n->cfg.hypervisor, state_dir, &sb.vm, &err);
		if (rc != KILN_OK && rc != KILN_E_NOT_FOUND)
			log_warn("the VM of \"%s\" cannot be taken over: %s", sb.id, err.msg);
		kiln_error_clear(&err);
		if (sb.vm && vmm_status(sb.vm, &st, &err) == KILN_OK && st.alive)
			rc = recover_running(n, &sb, snap, &err);
		else
			rc = recover_cut_pause(n, c, &sb, snap, &err);
		if (rc == KILN_OK) {
			log_warn("sandbox \"%s\" of an earlier run recorded as paused on \"%s\"", sb.id, snap);
			snap_upload(n, snap, sb.tenant_id);
			found++;
		} else if (rc != KILN_E_NOT_FOUND) {
			log_error("sandbox \"%s\" of an earlier run cannot be paused: %s", sb.id, err.msg);
		}
		kiln_error_clear(&err);
		vmm_destroy(sb.vm, &err);
	}
	pg_res_free(res);
	for_each_unrecorded(n, c, remove_unrecorded, &(struct unrecorded){ .n = n, .c = c });
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
