/*
 * lifecycle.c - snapshots of sandboxes on this node: their directories, policy and manifest,
 * their records, the restore of a new VM from one, and the removal of unused ones (snap_gc).
 * The pause is in pause.c, the resume in resume.c, the fork in fork.c, and what a restarted
 * node does with the snapshots of its earlier run in recovery.c.
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
#include "common/fsutil.h"
#include "common/log.h"
#include "vmm/agent.h"
#include "node/images.h"
#include "vmm/guest/agent_proto.h"
#include "vmm/hv.h"
#include "node/lifecycle.h"
#include "node/storage_sync.h"
#include "vmm/snapshot.h"

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

/* Drops this node's record of a copy of snapshot `id` (its files gone or never come). */
static void copy_forget(struct node *n, struct pg_conn *c, const char *id)
{
	struct kiln_error err = { 0 };

	if (PGQ(c, NULL, &err, "DELETE FROM snapshot_copies WHERE snapshot_id = $1 AND node_id = $2",
		id, n->cfg.node_id) != KILN_OK)
		log_warn("the record of the copy of snapshot \"%s\" stays: %s", id, err.msg);
}

/*
 * After the fetch of a copy into `dir` (`rc`): a failed fetch that left no files drops the record
 * (placement must not count on a copy this node lacks); a copy of a snapshot deleted meanwhile,
 * whose record snap_gc may have removed before the files came, is removed here (nothing else
 * would find its files).
 */
static enum kiln_err snap_copy_settle(struct node *n, struct pg_conn *c, const char *snap_id,
				      const char *dir, enum kiln_err rc, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	bool live;

	if (rc != KILN_OK) {
		if (access(dir, F_OK) != 0)
			copy_forget(n, c, snap_id);
		return rc;
	}
	if (PGQ(c, &res, NULL,
		"SELECT 1 FROM snapshot_copies k JOIN snapshots p ON p.id = k.snapshot_id "
		"WHERE k.snapshot_id = $1 AND k.node_id = $2 AND p.deleted_at IS NULL",
		snap_id, n->cfg.node_id) != KILN_OK)
		return KILN_OK;	/* the record stands; snap_gc settles it once the snapshot goes */
	live = pg_res_rows(res) > 0;
	pg_res_free(res);
	if (live)
		return KILN_OK;
	snap_remove_files(dir);
	copy_forget(n, c, snap_id);
	return node_error(err, KILN_E_NOT_FOUND, "snapshot \"%s\" was deleted while it was fetched",
			  snap_id);
}

enum kiln_err snap_fetch_copy(struct node *n, const char *snap_id, const char *tenant_id,
			      struct kiln_error *err)
{
	char dir[600];
	struct pg_conn *c;
	enum kiln_err rc;

	snap_dir(n, snap_id, dir, sizeof(dir));
	if (access(dir, F_OK) == 0)
		return KILN_OK;
	if (!n->store)
		return node_error(err, KILN_E_CONFLICT,
				  "snapshot \"%s\" is on another node and this node has no access to "
				  "snapshot buckets", snap_id);
	/* Recorded first, so that snap_gc finds the files whatever happens after the fetch. */
	rc = pg_acquire(n->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, NULL, err,
		 "INSERT INTO snapshot_copies (snapshot_id, node_id) SELECT id, $2 FROM snapshots "
		 "WHERE id = $1 AND tenant_id = $3 AND deleted_at IS NULL ON CONFLICT DO NOTHING",
		 snap_id, n->cfg.node_id, tenant_id);
	if (rc == KILN_OK) {
		pg_release(n->pg, c);
		rc = snapstore_fetch(n->store, snap_id, tenant_id, err);
		if (pg_acquire(n->pg, &c, NULL) != KILN_OK)
			return rc;	/* the record stands; snap_gc settles it once the snapshot goes */
		rc = snap_copy_settle(n, c, snap_id, dir, rc, err);
	}
	pg_release(n->pg, c);
	return rc;
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
	/* the bucket's level, so that a resume or a fork does not start it full */
	if (bw.has_level)
		json_object_set_new(json_object_get(doc, "bandwidth"), "level",
				    json_pack("{s:I, s:I, s:I, s:I}", "tokens", (json_int_t)bw.level_tokens,
					      "burst_left", (json_int_t)bw.level_burst_left, "frac",
					      (json_int_t)bw.level_frac, "at_ns", (json_int_t)bw.level_at_ns));
	if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
		json_decref(doc);
		return kiln_error_set(err, KILN_E_IO, "cannot create \"%s\"", dir);
	}
	/* whole or not at all: a pause writes it again after its VM has stopped */
	snprintf(path, sizeof(path), "%s/%s.tmp", dir, NETPOLICY_FILE);
	r = json_dump_file(doc, path, JSON_COMPACT);
	json_decref(doc);
	if (r == 0) {
		char final[700];

		snprintf(final, sizeof(final), "%s/%s", dir, NETPOLICY_FILE);
		r = rename(path, final);
	}
	if (r != 0)
		unlink(path);
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
		/* a snapshot written before levels were kept has none: its bucket starts full */
		const json_t *lv = json_object_get(b, "level");
		if (json_is_object(lv)) {
			bw->has_level = true;
			bw->level_tokens = (uint64_t)json_int(lv, "tokens", 0);
			bw->level_burst_left = (uint64_t)json_int(lv, "burst_left", 0);
			bw->level_frac = (uint64_t)json_int(lv, "frac", 0);
			bw->level_at_ns = json_int(lv, "at_ns", 0);
		}
	}
	json_decref(doc);
	return rc;
}

/*
 * The manifest of a snapshot of `sb` just written into `dir`, naming the image its VM runs on: the
 * one it was booted or restored on, or for a VM an earlier run left, the image whose kernel the
 * VMM's part of the manifest names.
 */
enum kiln_err write_manifest_public(struct node *n, const struct sandbox *sb, const char *dir,
				    struct kiln_error *err)
{
	struct snapshot_meta m = { 0 };

	m.format = SNAPSHOT_FORMAT;
	snprintf(m.hypervisor, sizeof(m.hypervisor), "%s", n->cfg.hypervisor);
	snprintf(m.machine, sizeof(m.machine), "microvm");
	snprintf(m.accel, sizeof(m.accel), "%s", n->accel);
	if (sb->image_hash[0]) {
		snprintf(m.image_hash, sizeof(m.image_hash), "%s", sb->image_hash);
	} else {
		json_t *vm = images_manifest(dir);

		images_hash_of_kernel(n->pg, n->cfg.node_id,
				      json_string_value(json_object_get(vm, "kernel")),
				      node_image_hash(n), m.image_hash, sizeof(m.image_hash));
		json_decref(vm);
	}
	m.vcpu_milli = sb->vcpu_milli;
	m.mem_mib = sb->mem_mib;
	m.disk_gib = sb->disk_gib;
	m.agent_protocol = AGENT_PROTO_VERSION;
	return snapshot_manifest_write(dir, &m, err);
}

/*
 * Any guest image: a snapshot restores on the one it was taken from (images.h), which sb_restore
 * checks. The agent inside may speak this release's protocol or the one before.
 */
enum kiln_err snap_verify(struct node *n, const char *dir, struct kiln_error *err)
{
	struct snapshot_expect e = {
		.hypervisor = n->cfg.hypervisor,
		.machine = "microvm",
		.accel = n->accel,
	};
	struct snapshot_meta meta;
	enum kiln_err rc = snapshot_verify(dir, &e, &meta, err);

	if (rc == KILN_OK && (meta.agent_protocol > AGENT_PROTO_VERSION ||
			      meta.agent_protocol + 1 < AGENT_PROTO_VERSION))
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "snapshot \"%s\": agent protocol %u, this node speaks %u and %u",
				    dir, meta.agent_protocol,
				    AGENT_PROTO_VERSION > 1 ? AGENT_PROTO_VERSION - 1 : 1,
				    AGENT_PROTO_VERSION);
	return rc;
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

void snap_remove_files(const char *dir)
{
	fs_remove_tree_or_warn(dir);
}

/*
 * Records a snapshot taken of `sb` (on connection `c`, inside the caller's transaction or not),
 * with the image its manifest names and the generation of `sb` it was taken in (its row's: a
 * pause records its snapshot in the transaction of record_paused(), which is fenced on that
 * generation). kiln-meter finds an ended generation's pause snapshot by it (migrations/0041).
 */
enum kiln_err snap_record_public(struct node *n, struct pg_conn *c, const struct sandbox *sb,
				 const char *snap_id, const char *kind, const char *name,
				 const char *dir, struct kiln_error *err)
{
	char size[24], v[16], m[16], d[16], image[IMAGE_HASH_MAX];
	json_t *man = images_manifest(dir);

	snprintf(image, sizeof(image), "%s",
		 json_string_value(json_object_get(man, "image_hash")) ?: node_image_hash(n));
	json_decref(man);

	snprintf(size, sizeof(size), "%lld", snapshot_size(dir));
	snprintf(v, sizeof(v), "%u", sb->vcpu_milli);
	snprintf(m, sizeof(m), "%u", sb->mem_mib);
	snprintf(d, sizeof(d), "%u", sb->disk_gib);
	return PGQ(c, NULL, err,
		   "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, name, size_bytes, "
		   "vcpu_milli, memory_mib, disk_gib, lineage, deleted_at, image_hash, generation) "
		   "SELECT $1, $2, $3, $4, $5, $6, $7::bigint, $8::int, $9::int, $10::int, s.lineage, "
		   "CASE WHEN $5 = 'named' THEN NULL ELSE now() END, $11, s.generation "
		   "FROM sandboxes s WHERE s.id = $3",
		   snap_id, sb->tenant_id, sb->id, n->cfg.node_id, kind, name, size, v, m, d, image);
}

enum kiln_err snap_restore_new(struct node *n, struct sandbox *sb, const char *snap_id,
			       enum vmm_mem_from from, const struct sb_init *override, bool fresh,
			       struct warm_vm *w, struct kiln_error *err)
{
	char dir[600];
	struct kiln_ruleset rs;
	struct kiln_bandwidth bw;
	struct sb_init init = { 0 };
	enum kiln_err rc;

	long long t0 = sb_mono_ms();

	snap_dir(n, snap_id, dir, sizeof(dir));
	rc = snap_verify(n, dir, err);
	if (rc != KILN_OK)
		return rc;
	log_info("snapshot \"%s\" verified in %lld ms", snap_id, sb_mono_ms() - t0);
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
		bw.has_level = false;	/* a new sandbox from a snapshot: a full bucket, as any create */
	}
	rc = w ? sb_restore_warm(n, sb, dir, w, &init, fresh, err) :
		 sb_restore(n, sb, dir, from, &init, fresh, err);
	kiln_ruleset_free(&rs);
	return rc;
}

/* Snapshot `p` is deleted and nothing stands on it: no live sandbox, no live snapshot. */
#define SNAP_UNUSED_SQL                                                                       \
	"p.deleted_at IS NOT NULL "                                                           \
	"AND NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.deleted_at IS NULL "               \
	"  AND (p.id = ANY (s.lineage) OR s.pause_snapshot = p.id)) "                         \
	"AND NOT EXISTS (SELECT 1 FROM snapshots q WHERE q.deleted_at IS NULL "               \
	"  AND p.id = ANY (q.lineage))"

/*
 * The objects in their tenants' buckets of deleted template images (kind build) whose node is
 * gone (stopped, marked down, or its row removed): that node, which deletes them otherwise, may
 * never come back. Any live node with access to buckets deletes such an object once nothing
 * stands on its image; the image is then recorded as kept on its node only (storage and status
 * `local`), so that its node, should it come back, removes the files as a local snapshot's. An
 * image still `uploading` is left to its node, whose restart finishes or fails that upload.
 */
static void snap_gc_gone_objects(struct node *n, struct pg_conn *c)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;

	if (!n->store)
		return;
	if (PGQ0(c, &res, &err,
		 "SELECT p.id, p.tenant_id, p.node_id FROM snapshots p WHERE p.kind = 'build' "
		 "AND p.storage = 's3' AND p.status = 'stored' AND p.purged_at IS NULL "
		 "AND p.tenant_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM nodes o WHERE "
		 "o.id = p.node_id AND o.down_at IS NULL AND o.stopped_at IS NULL) AND "
		 SNAP_UNUSED_SQL) != KILN_OK) {
		log_warn("the images of gone nodes were not looked up: %s", err.msg);
		return;
	}
	for (int i = 0; i < pg_res_rows(res); i++) {
		struct kiln_error serr = { 0 };
		const char *id = pg_res_str(res, i, 0);

		if (snapstore_delete(n->store, id, pg_res_str(res, i, 1), &serr) != KILN_OK) {
			log_warn("snapshot \"%s\" stays in its bucket for now: %s", id, serr.msg);
			continue;
		}
		if (PGQ(c, NULL, &serr, "UPDATE snapshots SET storage = 'local', status = 'local' "
			"WHERE id = $1 AND storage = 's3'", id) != KILN_OK)
			log_warn("snapshot \"%s\" left its bucket but its row says not: %s", id, serr.msg);
		log_info("deleted the object of snapshot \"%s\" from its bucket (its node \"%s\" is gone)",
			 id, pg_res_str(res, i, 2));
	}
	pg_res_free(res);
}

void snap_gc(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return;
	if (PGQ(c, &res, &err,
		"SELECT p.id, p.storage, coalesce(p.tenant_id, '') FROM snapshots p WHERE p.node_id = $1 "
		"AND p.purged_at IS NULL AND " SNAP_UNUSED_SQL,
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
	res = NULL;
	/* The copies fetched here of other nodes' snapshots (template images) go the same way. */
	if (PGQ(c, &res, &err,
		"SELECT p.id FROM snapshot_copies k JOIN snapshots p ON p.id = k.snapshot_id "
		"WHERE k.node_id = $1 AND " SNAP_UNUSED_SQL,
		n->cfg.node_id) == KILN_OK) {
		for (int i = 0; i < pg_res_rows(res); i++) {
			char dir[600];
			const char *id = pg_res_str(res, i, 0);

			snap_dir(n, id, dir, sizeof(dir));
			snap_remove_files(dir);
			copy_forget(n, c, id);
			log_info("removed the fetched copy of snapshot \"%s\"", id);
		}
	}
	pg_res_free(res);
	snap_gc_gone_objects(n, c);
	pg_release(n->pg, c);
}
