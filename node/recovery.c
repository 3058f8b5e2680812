/*
 * recovery.c - what a restarted kiln-node does before it serves (recovery.h): the sandboxes its
 * earlier run left running are taken over and paused (their VMs outlive the node), pauses cut
 * short are finished from their files, then every host resource of that run is freed; a sandbox
 * whose state could not be had is recorded as stopped. At every heartbeat, the VMs of sandboxes
 * that are no longer this node's (moved on, or lost while it was marked down) are fenced off.
 */
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "auth/apikey.h"
#include "common/json.h"
#include "common/log.h"
#include "netpolicy/policy.h"
#include "vmm/hv.h"
#include "vmm/orphan.h"
#include "node/warm.h"
#include "node/lifecycle.h"
#include "node/pause.h"
#include "node/recovery.h"

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
			 "AND state IN ('running', 'error', 'lost')",
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

/*
 * After a restart, before anything of the earlier run is cleaned up: every sandbox the database
 * still shows running (or failed, or lost: this node was marked down while it was away, and a lost
 * sandbox never runs anywhere else) on this node at its generation ends paused with a complete
 * snapshot where its state can be had (one still being created is not: its create failed). A VM still running (VMMs
 * outlive their node) is taken over and paused; a pause cut short after its VMM ended is finished
 * from its files. Snapshot directories nothing records are then removed. Returns how many
 * sandboxes were recorded as paused, or -1 when Postgres could not be read (nothing done).
 */
static int snap_recover(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	int found = 0;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return -1;
	if (PGQ(c, &res, &err,
		"SELECT id, tenant_id, vcpu_milli, memory_mib, disk_gib, generation FROM sandboxes "
		"WHERE node_id = $1 AND deleted_at IS NULL AND state IN ('running', 'error', 'lost')",
		n->cfg.node_id) != KILN_OK) {
		pg_release(n->pg, c);
		return -1;
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

/* The VMs of an earlier run that snap_recover did not pause are removed, none kept. */
static bool keep_none(void *ctx, const char *id)
{
	return false;
}

/*
 * Removes the networks and policy pins an earlier run of this node left: every sandbox pinned
 * under /sys/fs/bpf/kiln/<node>/ names its netns (kiln-<net id>).
 */
static void cleanup_networks(struct node *n)
{
	char pattern[192];
	glob_t g;

	snprintf(pattern, sizeof(pattern), "%s/%s/*", KILN_PIN_ROOT, n->cfg.node_id);
	if (glob(pattern, GLOB_ONLYDIR, NULL, &g) != 0)
		return;
	for (size_t i = 0; i < g.gl_pathc; i++) {
		const char *id = strrchr(g.gl_pathv[i], '/') + 1;
		const char *rand = strchr(id, '_');
		char net_id[KILN_NET_ID_MAX + 1];
		struct kiln_error err = { 0 };

		snprintf(net_id, sizeof(net_id), "%s", rand ? rand + 1 : id);
		kiln_sbnet_destroy(net_id, &err);
		kiln_error_clear(&err);
		if (kiln_policy_unpin(NULL, n->cfg.node_id, id, &err) != KILN_OK)
			log_warn("cannot remove the pins of \"%s\": %s", id, err.msg);
		else
			log_warn("removed the network an earlier run left for \"%s\"", id);
	}
	globfree(&g);
}

/* Records a sandbox of an earlier run whose state could not be had as stopped. */
struct leftovers {
	struct node *n;
	int stopped;
};

static enum kiln_err stop_leftover(const struct record *r, void *arg)
{
	struct leftovers *l = arg;
	struct node *n = l->n;
	struct record_fence f = { .id = r->id, .node_id = n->cfg.node_id,
				  .generation = r->generation };
	struct kiln_error err = { 0 };
	enum kiln_err rc = record_stopped(n->pg, NULL, &f, "the node restarted", &err);

	if (rc == KILN_OK)
		l->stopped++;
	else if (rc == KILN_E_CONFLICT)
		log_warn("sandbox \"%s\" is no longer this node's: %s", r->id, err.msg);
	return rc == KILN_E_CONFLICT ? KILN_OK : rc;
}

enum kiln_err recovery_run(struct node *n, struct kiln_error *err)
{
	struct kiln_error cerr = { 0 };
	enum kiln_err rc;
	char pattern[600];
	glob_t g;
	struct leftovers l = { .n = n };
	int cleaned;

	/* Deletes the gateway asked for while this node was down are carried out, not paused. */
	rc = recovery_deletes(n, err);
	if (rc != KILN_OK)
		return rc;
	/* First, while their VMs and pins are still there: running sandboxes end paused, not lost. */
	if (snap_recover(n) < 0 || pg_ping(n->pg, err) != KILN_OK)
		/* Nothing is cleaned up on doubt: the next start takes it over again. */
		return node_error(err, KILN_E_UNAVAILABLE,
				  "postgres went away during recovery; the earlier run's VMs are kept");
	cleaned = vmm_orphans_cleanup(n->cfg.node_id, NULL, NULL, keep_none, NULL, &cerr);
	if (cleaned > 0)
		log_warn("cleaned up %d VMs an earlier run of this node left", cleaned);
	cleanup_networks(n);
	if (cerr.code != KILN_OK)
		log_error("cleanup of an earlier run: %s", cerr.msg);
	/* the disk layers of VMs that are gone: no VM of this node runs yet */
	snprintf(pattern, sizeof(pattern), "%s/*", n->vm_state_root);
	if (glob(pattern, GLOB_ONLYDIR, NULL, &g) == 0) {
		for (size_t i = 0; i < g.gl_pathc; i++) {
			const char *name = strrchr(g.gl_pathv[i], '/') + 1;

			if (warm_is_id(name)) {
				/* a warm VM's (warm.c): its namespace too */
				kiln_error_clear(&cerr);
				if (kiln_sbnet_destroy(name, &cerr) != KILN_OK)
					log_warn("removing the namespace of warm VM \"%s\": %s", name,
						 cerr.msg);
			}
			snap_remove_files(g.gl_pathv[i]);
		}
		globfree(&g);
	}
	rc = record_each(n->pg, n->cfg.node_id, "{creating,running,error}", false, stop_leftover,
			 &l, err);
	if (l.stopped > 0)
		log_warn("%d sandboxes of an earlier run recorded as stopped", l.stopped);
	return rc;
}


/* Carries out the requested delete of `r`: its VM, if this run holds it, goes after the record. */
static enum kiln_err delete_requested(const struct record *r, void *arg)
{
	struct node *n = arg;
	struct record_fence f = { .id = r->id, .node_id = n->cfg.node_id,
				  .generation = r->generation };
	struct kiln_error err = { 0 };
	struct sandbox *sb = sb_get(n, r->id);
	enum kiln_err rc;

	if (sb)
		pthread_mutex_lock(&sb->lock);
	if (sb && sb->generation != r->generation) {
		/* the request was for an earlier generation: a later resume wins */
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
		return KILN_OK;
	}
	rc = record_deleted(n->pg, NULL, &f, &err);
	if (rc == KILN_OK && sb) {
		sb_teardown(n, sb);
		sb->state = SB_STOPPED;
	}
	if (sb) {
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
	}
	if (rc == KILN_OK)
		log_warn("sandbox \"%s\" deleted as the gateway asked while this node was down", r->id);
	else if (rc == KILN_E_CONFLICT)
		log_warn("requested delete of \"%s\" not carried out: %s", r->id, err.msg);
	return rc == KILN_E_CONFLICT ? KILN_OK : rc;
}

enum kiln_err recovery_deletes(struct node *n, struct kiln_error *err)
{
	return record_each(n->pg, n->cfg.node_id, NULL, true, delete_requested, n, err);
}

/* The running sandboxes of the registry as Postgres arrays: "{id,...}" and "{generation,...}". */
static bool fence_arrays(struct node *n, char **ids, char **gens)
{
	size_t cap = 64, il = 0, gl = 0;
	bool ok = true;

	*ids = malloc(cap);
	*gens = malloc(cap);
	if (!*ids || !*gens)
		ok = false;
	pthread_mutex_lock(&n->reg_lock);
	for (struct sandbox *sb = n->sandboxes; sb && ok; sb = sb->next) {
		if (sb->state != SB_RUNNING)
			continue;
		if (il + sizeof(sb->id) + 2 > cap || gl + 24 > cap) {
			char *a = realloc(*ids, cap * 2), *b = a ? realloc(*gens, cap * 2) : NULL;

			if (a)
				*ids = a;
			if (b)
				*gens = b;
			ok = a && b;
			cap *= 2;
			if (!ok)
				break;
		}
		il += (size_t)snprintf(*ids + il, cap - il, "%s%s", il ? "," : "{", sb->id);
		gl += (size_t)snprintf(*gens + gl, cap - gl, "%s%lld", gl ? "," : "{", sb->generation);
	}
	pthread_mutex_unlock(&n->reg_lock);
	if (ok) {
		snprintf(*ids + il, cap - il, "%s}", il ? "" : "{");
		snprintf(*gens + gl, cap - gl, "%s}", gl ? "" : "{");
	}
	return ok;
}

int recovery_fence(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	char *ids = NULL, *gens = NULL;
	int fenced = 0;
	enum kiln_err rc;

	if (!fence_arrays(n, &ids, &gens) || !strcmp(ids, "{}")) {
		free(ids);
		free(gens);
		return 0;
	}
	/* Held at this generation, here, live and not lost: anything else is no longer ours. */
	rc = pg_acquire(n->pg, &c, &err);
	if (rc == KILN_OK) {
		rc = PGQ(c, &res, &err,
			 "SELECT h.id, h.gen FROM unnest($1::text[], $2::bigint[]) AS h(id, gen) "
			 "WHERE NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.id = h.id "
			 "AND s.node_id = $3 AND s.generation = h.gen AND s.deleted_at IS NULL "
			 "AND s.state IN ('creating', 'running', 'paused', 'error'))",
			 ids, gens, n->cfg.node_id);
		pg_release(n->pg, c);
	}
	if (rc != KILN_OK) {
		log_warn("cannot check which sandboxes are still this node's: %s", err.msg);
		free(ids);
		free(gens);
		return -1;
	}
	free(ids);
	free(gens);
	for (int i = 0; i < pg_res_rows(res); i++) {
		struct sandbox *sb = sb_get(n, pg_res_str(res, i, 0));

		if (!sb)
			continue;
		if (pthread_mutex_trylock(&sb->lock) != 0) {
			sb_put(n, sb);	/* in a lifecycle change: looked at again next time */
			continue;
		}
		if (sb->state == SB_RUNNING && sb->generation == pg_res_int(res, i, 1, -1)) {
			log_warn("sandbox \"%s\" (generation %lld) is no longer this node's (moved on, "
				 "lost or deleted while it was away): its VM is stopped and discarded",
				 sb->id, sb->generation);
			/* The VMM killed first (sb_release), without a word to it: no QMP round trip
			 * stands between the fence and the last instruction of the guest. */
			sb_teardown(n, sb);
			sb->state = SB_STOPPED;
			fenced++;
		}
		pthread_mutex_unlock(&sb->lock);
		sb_put(n, sb);
	}
	pg_res_free(res);
	return fenced;
}
