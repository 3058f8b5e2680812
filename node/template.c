/*
 * template.c - pre-booted templates of the guest image, one per shape in use.
 *
 * A template is built by booting a VM of the shape (cold), waiting for its agent, warming Python
 * (its files into the page cache: the first import is the slow part of a cold start), and saving
 * it as a snapshot whose memory image stays frozen. A create of that shape then restores the
 * template with the image mapped privately, so every sandbox made from it shares the pages it has
 * not written, and gives it a fresh identity (id, host name, reseeded RNG, clock, env) exactly as
 * a fork child gets one. No interpreter is kept running in the template: a parked Python would
 * carry one `random` state into every sandbox.
 *
 * The code interpreter's image (guest_codeint_rootfs, template code-interpreter-v1) has templates
 * of its own, built the same way, except that its worker (vmm/guest/codeint/server.py, started by
 * the image's init) must answer on guest port 49999 before the snapshot: it is kept running in
 * the template with numpy, pandas and matplotlib imported, and reseeds each context it forks.
 *
 * Templates are node-local rows of `snapshots` (kind template) keyed by the image hash and the
 * shape; a node that starts with another image (a changed recipe) retires the old ones and builds
 * new ones. Sandboxes made from a template list it in their lineage, so its files stay while they
 * live. Unused templates are retired after a while (tpl_evict_idle).
 */
#include "node/template.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth/apikey.h"
#include "common/clock.h"
#include "common/log.h"
#include "vmm/agent.h"
#include "vmm/hv.h"
#include "node/lifecycle.h"
#include "node/warm.h"

#define TPL_MAX 16
#define TPL_DEFAULT_VCPU 1000
#define TPL_DEFAULT_MEM 512
#define TPL_DEFAULT_DISK 10

struct tpl {
	unsigned vcpu_milli, mem_mib, disk_gib;
	bool codeint;		/* of the code interpreter's image */
	char snap_id[AUTH_ID_MAX];	/* when ready */
	bool ready, building;
	long long last_used_ms;	/* CLOCK_MONOTONIC: a wall-clock step evicts nothing */
	pthread_t thread;
	bool joinable;
	struct node *n;
};

static struct tpl templates[TPL_MAX];
static pthread_mutex_t tpl_lock = PTHREAD_MUTEX_INITIALIZER;
/* A build ended (tpl_wait); made anew on CLOCK_MONOTONIC by tpl_init(), before any wait. */
static pthread_cond_t tpl_done = PTHREAD_COND_INITIALIZER;

/*
 * Boots, warms and snapshots one template of a shape: its snapshot's id into `snap` (of
 * AUTH_ID_MAX bytes) and its row in `snapshots`.
 */
static enum kiln_err tpl_make(struct node *n, unsigned vcpu_milli, unsigned mem_mib,
			      unsigned disk_gib, bool codeint, char *snap, struct kiln_error *err)
{
	struct sandbox *sb = NULL;
	char vm_id[AUTH_ID_MAX], dir[600], v[16], m[16], d[16];
	struct pg_conn *c;
	enum kiln_err rc;

	rc = auth_new_id("tpl_", vm_id, sizeof(vm_id));
	if (rc == KILN_OK)
		rc = auth_new_id("snap_", snap, AUTH_ID_MAX);
	if (rc == KILN_OK)
		rc = sb_reserve(n, vm_id, "", vcpu_milli, mem_mib, disk_gib, &sb, err);
	if (rc != KILN_OK)
		goto out;
	sb->codeint = codeint;
	pthread_mutex_lock(&sb->lock);
	rc = sb_boot(n, sb, NULL, err);
	if (rc == KILN_OK && !n->stopping) {
		/* Python's files into the page cache; nothing keeps running. */
		static const char *const argv[] = { "python3", "-c",
			"import json, hashlib, os, re, subprocess, random, ssl, socket, urllib.request",
			NULL };
		struct agent_exec_req x = { .argv = argv, .timeout_ms = 120000 };
		struct agent_exec_result res = { 0 };
		rc = agent_exec(sb->agent, &x, NULL, NULL, &res, err);
		if (rc == KILN_OK && res.exit_code != 0)
			rc = kiln_error_set(err, KILN_E_INTERNAL, "warming Python failed");
	}
	if (rc == KILN_OK && codeint && !n->stopping) {
		/* The code interpreter's worker answers (its imports done) before the snapshot. */
		static const char *const argv[] = { "python3", "-c",
			"import time, urllib.request\n"
			"for i in range(600):\n"
			"    try:\n"
			"        urllib.request.urlopen('http://127.0.0.1:49999/health', timeout=5)\n"
			"        break\n"
			"    except OSError:\n"
			"        time.sleep(0.5)\n"
			"else:\n"
			"    raise SystemExit(1)\n",
			NULL };
		struct agent_exec_req x = { .argv = argv, .timeout_ms = 600000 };
		struct agent_exec_result res = { 0 };
		rc = agent_exec(sb->agent, &x, NULL, NULL, &res, err);
		if (rc == KILN_OK && res.exit_code != 0)
			rc = kiln_error_set(err, KILN_E_INTERNAL,
					    "the code interpreter did not answer on port 49999");
	}
	if (rc == KILN_OK && n->stopping)
		rc = kiln_error_set(err, KILN_E_UNAVAILABLE, "the node is stopping");
	snap_dir(n, snap, dir, sizeof(dir));
	if (rc == KILN_OK)
		rc = save_policy_public(sb, dir, err);
	if (rc == KILN_OK)
		rc = vmm_snapshot(sb->vm, dir, VMM_SNAP_SHARED, err);
	if (rc == KILN_OK)
		rc = write_manifest_public(n, sb, dir, err);
	if (rc == KILN_OK)
		rc = pg_acquire(n->pg, &c, err);
	if (rc == KILN_OK) {
		snprintf(v, sizeof(v), "%u", vcpu_milli);
		snprintf(m, sizeof(m), "%u", mem_mib);
		snprintf(d, sizeof(d), "%u", disk_gib);
		rc = PGQ(c, NULL, err,
			 "INSERT INTO snapshots (id, sandbox_id, node_id, kind, vcpu_milli, memory_mib, "
			 "disk_gib, image_hash) VALUES ($1, $2, $3, 'template', $4::int, $5::int, "
			 "$6::int, $7)",
			 snap, vm_id, n->cfg.node_id, v, m, d, n->cfg.guest_image_hash);
		pg_release(n->pg, c);
	}
	sb_teardown(n, sb);
	pthread_mutex_unlock(&sb->lock);
	if (rc != KILN_OK)
		snap_remove_files(dir);
out:
	sb_put(n, sb);
	return rc;
}

/* What builds a template: tpl_make(), or a test's stand-in (tpl_set_make_for_test). */
static tpl_make_fn *tpl_maker = tpl_make;

void tpl_set_make_for_test(tpl_make_fn *make)
{
	tpl_maker = make ? make : tpl_make;
}

/* Builds one template (tpl_maker) and marks its slot ready or not; runs on its own thread. */
static void *tpl_build(void *arg)
{
	struct tpl *t = arg;
	struct kiln_error err = { 0 };
	char snap[AUTH_ID_MAX];
	enum kiln_err rc;
	struct timespec t0, t1;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	rc = tpl_maker(t->n, t->vcpu_milli, t->mem_mib, t->disk_gib, t->codeint, snap, &err);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	pthread_mutex_lock(&tpl_lock);
	t->building = false;
	if (rc == KILN_OK) {
		snprintf(t->snap_id, sizeof(t->snap_id), "%s", snap);
		t->ready = true;
		t->last_used_ms = clock_mono_ms();
		/* under the lock: a discard of it (warm_drop) comes after, never before; a test's
		 * stand-in template has no files to begin a VMM on */
		if (tpl_maker == tpl_make)
			warm_add(t->n, snap, t->vcpu_milli, t->mem_mib, t->disk_gib, t->codeint);
	}
	pthread_cond_broadcast(&tpl_done);
	pthread_mutex_unlock(&tpl_lock);
	if (rc == KILN_OK)
		log_info("template \"%s\"%s of %u mvCPU, %u MiB ready in %.1f s", snap,
			 t->codeint ? " (code interpreter)" : "", t->vcpu_milli, t->mem_mib, (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
	else
		log_warn("template of %u mvCPU, %u MiB not built: %s", t->vcpu_milli, t->mem_mib,
			 err.msg);
	return NULL;
}

/* Finds or makes the slot of a shape; called with tpl_lock held. NULL when all are taken. */
static struct tpl *tpl_slot(struct node *n, unsigned vcpu, unsigned mem, unsigned disk,
			    bool codeint)
{
	struct tpl *free_slot = NULL;

	for (int i = 0; i < TPL_MAX; i++) {
		struct tpl *t = &templates[i];
		if (t->n && t->vcpu_milli == vcpu && t->mem_mib == mem && t->disk_gib == disk &&
		    t->codeint == codeint)
			return t;
		if (!t->n && !free_slot)
			free_slot = t;
	}
	if (free_slot) {
		memset(free_slot, 0, sizeof(*free_slot));
		free_slot->n = n;
		free_slot->vcpu_milli = vcpu;
		free_slot->mem_mib = mem;
		free_slot->disk_gib = disk;
		free_slot->codeint = codeint;
	}
	return free_slot;
}

/* Starts building `t` unless it is ready or building; called with tpl_lock held. */
static void tpl_start(struct tpl *t)
{
	if (t->ready || t->building || t->n->stopping)
		return;
	if (t->joinable) {
		pthread_join(t->thread, NULL);
		t->joinable = false;
	}
	t->building = true;
	if (pthread_create(&t->thread, NULL, tpl_build, t) != 0) {
		t->building = false;
		return;
	}
	t->joinable = true;
}

void tpl_init(struct node *n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	/*
	 * A builder's wait for its template (tpl_wait), on the clock a wall-clock step does not
	 * move: a backward step must not stretch a template build past template_build_max_s. No one
	 * waits yet (builds start with build_init()); broadcasts are made under tpl_lock.
	 */
	pthread_mutex_lock(&tpl_lock);
	clock_cond_init(&tpl_done, CLOCK_MONOTONIC);
	pthread_mutex_unlock(&tpl_lock);
	/* Templates of an earlier run (perhaps of another image) are retired. */
	if (pg_acquire(n->pg, &c, &err) == KILN_OK) {
		PGQ(c, NULL, &err,
		    "UPDATE snapshots SET deleted_at = now() WHERE node_id = $1 AND kind = 'template' "
		    "AND deleted_at IS NULL",
		    n->cfg.node_id);
		pg_release(n->pg, c);
	}
	if (!n->cfg.template_default)
		return;
	pthread_mutex_lock(&tpl_lock);
	tpl_start(tpl_slot(n, TPL_DEFAULT_VCPU, TPL_DEFAULT_MEM, TPL_DEFAULT_DISK, false));
	if (n->cfg.guest_codeint_rootfs && n->cfg.guest_codeint_rootfs[0])
		tpl_start(tpl_slot(n, TPL_DEFAULT_VCPU, TPL_DEFAULT_MEM, TPL_DEFAULT_DISK, true));
	pthread_mutex_unlock(&tpl_lock);
}

void tpl_exit(struct node *n)
{
	for (int i = 0; i < TPL_MAX; i++) {
		pthread_mutex_lock(&tpl_lock);
		bool join = templates[i].n == n && templates[i].joinable;
		pthread_t th = templates[i].thread;
		templates[i].joinable = false;
		pthread_mutex_unlock(&tpl_lock);
		if (join)
			pthread_join(th, NULL);
	}
}

bool tpl_lookup(struct node *n, unsigned vcpu_milli, unsigned mem_mib, unsigned disk_gib,
		bool codeint, char *out, size_t len)
{
	struct tpl *t;
	bool ready = false;

	if (!n->cfg.templates)
		return false;
	pthread_mutex_lock(&tpl_lock);
	t = tpl_slot(n, vcpu_milli, mem_mib, disk_gib, codeint);
	if (t && t->ready) {
		snprintf(out, len, "%s", t->snap_id);
		t->last_used_ms = clock_mono_ms();
		ready = true;
	} else if (t) {
		tpl_start(t);
	}
	pthread_mutex_unlock(&tpl_lock);
	return ready;
}

bool tpl_wait(struct node *n, unsigned vcpu_milli, unsigned mem_mib, unsigned disk_gib,
	      unsigned timeout_ms)
{
	struct timespec until;
	struct tpl *t;
	bool ready = false;

	if (!n->cfg.templates)
		return false;
	until = clock_after_ms(CLOCK_MONOTONIC, timeout_ms);
	pthread_mutex_lock(&tpl_lock);
	t = tpl_slot(n, vcpu_milli, mem_mib, disk_gib, false);
	if (t)
		tpl_start(t);
	while (t && t->building && !n->stopping &&
	       pthread_cond_timedwait(&tpl_done, &tpl_lock, &until) == 0)
		;
	ready = t && t->ready;
	pthread_mutex_unlock(&tpl_lock);
	return ready;
}

/* Marks the row deleted: its files go once no sandbox stands on it (snap_gc). */
static void tpl_retire(struct node *n, const char *snap_id)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return;
	PGQ(c, NULL, &err, "UPDATE snapshots SET deleted_at = now() WHERE id = $1", snap_id);
	pg_release(n->pg, c);
}

void tpl_discard(struct node *n, const char *snap_id)
{
	pthread_mutex_lock(&tpl_lock);
	for (int i = 0; i < TPL_MAX; i++)
		if (templates[i].n == n && templates[i].ready &&
		    strcmp(templates[i].snap_id, snap_id) == 0)
			templates[i].ready = false;
	pthread_mutex_unlock(&tpl_lock);
	warm_drop(n, snap_id);
	tpl_retire(n, snap_id);
}

void tpl_evict_idle(struct node *n, long idle_s)
{
	long long now = clock_mono_ms();
	char gone[TPL_MAX][AUTH_ID_MAX];
	int k = 0;

	pthread_mutex_lock(&tpl_lock);
	for (int i = 0; i < TPL_MAX; i++) {
		struct tpl *t = &templates[i];
		bool is_default = t->vcpu_milli == TPL_DEFAULT_VCPU && t->mem_mib == TPL_DEFAULT_MEM &&
				  t->disk_gib == TPL_DEFAULT_DISK && n->cfg.template_default;
		if (t->n == n && t->ready && !is_default &&
		    now - t->last_used_ms > idle_s * 1000LL) {
			snprintf(gone[k++], AUTH_ID_MAX, "%s", t->snap_id);
			t->ready = false;
			t->n = t->joinable ? t->n : NULL;
		}
	}
	pthread_mutex_unlock(&tpl_lock);
	for (int i = 0; i < k; i++) {
		log_info("template \"%s\" retired: unused", gone[i]);
		warm_drop(n, gone[i]);
		tpl_retire(n, gone[i]);
	}
}
