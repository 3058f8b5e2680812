/*
 * warm.c - VMMs started ahead of the creates and resumes they serve (warm.h).
 *
 * A restore's VMM step is mostly QEMU's own start (docs/benchmarks.md): its process, jail,
 * cgroup, the template's memory mapped and its disk layer made, then QMP answering. None of that
 * depends on the sandbox it will become, so it is done before the create comes: a warm VM is a
 * restore begun (vmm_restore_begin) under a name of its own, "0" + 12 base32 letters (a sandbox's
 * net id never holds a "0"), with a uid leased under that name and a namespace "kiln-<name>"
 * holding only its TAP (kiln_sbnet_create_tap). A create from the template takes it: the
 * sandbox's network takes that namespace over, QEMU and its TAP in it, under the sandbox's name
 * (kiln_sbnet_config.netns_from), the sandbox adopts the uid (its lease relabelled), and
 * vmm_restore_end() renames the VM to the sandbox and loads the state.
 *
 * One thread per node begins them, one at a time, each a moment after the take it replaces
 * (`template_warm_refill_ms`, so as not to share the CPU with the create it serves); a take that
 * finds that refill waiting does not put it off, or creates closer together than that would
 * never see one again. A begin that
 * fails is not tried again until a create of that template finds none. The template's memory is
 * mapped privately, like an ordinary create's: a warm VM holds QEMU's own memory, not the guest's.
 *
 * A resume's VMM step is the same start, on the pause snapshot, whose disk chain and memory image
 * are the sandbox's own: so a warm VM is begun on the snapshot of each of the sandboxes paused last
 * (`paused_warm_vms`), right after its pause. Its memory file is made at the guest's length and
 * left empty (VMM_MEM_COPY_LATE): the pause gave the guest's memory back, and the warm VM does
 * not take it again while it waits; its resume copies the image in (some 40 ms per 100 MiB the
 * guest touched) before the state is loaded. It is used once: the take ends it. Every
 * WARM_CHECK_MS the thread removes those whose sandbox is no longer paused here on that snapshot
 * (deleted, resumed on another node, or resumed here without it) by its record, and those whose
 * snapshot's state file is gone or another (its files fetched anew); a take never hands out the
 * latter either. The VMs of the oldest, removed to make room, are ended on the thread too, not by
 * the pause that made room.
 */
#include "node/warm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "common/clock.h"
#include "common/fsutil.h"
#include "common/log.h"
#include "vmm/hv.h"
#include "vmm/jail.h"
#include "vmm/orphan.h"
#include "node/lifecycle.h"

#define WARM_TPL_MAX 32		/* templates kept warm (template.c keeps at most 16) */
#define WARM_VMS_MAX 64		/* warm VMs in all */
#define WARM_CHECK_MS 2000	/* pause snapshots: their records and files looked at */

/* A template kept warm, or a pause snapshot (`paused`: one warm VM, once). */
struct warm_tpl {
	char snap[AUTH_ID_MAX];	/* "" when the entry is free */
	unsigned vcpu_milli, mem_mib, disk_gib;
	bool codeint;
	bool paused;
	long long added_ms;	/* CLOCK_MONOTONIC: the oldest paused one goes first */
	bool failed;		/* its last begin failed: none until a take finds none */
	long long not_before_ms;	/* no begin before (CLOCK_MONOTONIC) */
};

static struct {
	pthread_mutex_t lock;
	pthread_cond_t wake;	/* on CLOCK_MONOTONIC once started */
	struct warm_tpl tpls[WARM_TPL_MAX];
	struct warm_vm *ready[WARM_VMS_MAX];
	int nready;
	struct warm_vm *dead[WARM_VMS_MAX];	/* out of the pool, for the thread to free */
	int ndead;
	bool started, stopping;
	pthread_t thread;
} pool = { .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER };

bool warm_is_id(const char *name)
{
	size_t len = strlen(name);

	if (len != KILN_NET_ID_MAX || name[0] != '0')
		return false;
	for (size_t i = 1; i < len; i++)
		if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= '2' && name[i] <= '7')))
			return false;
	return true;
}

static void warm_dirs(struct node *n, const char *id, char *run_dir, size_t rlen,
		      char *state_dir, size_t slen)
{
	snprintf(run_dir, rlen, "%s/%s", n->vm_run_root, id);
	snprintf(state_dir, slen, "%s/%s", n->vm_state_root, id);
}

void warm_free(struct node *n, struct warm_vm *w)
{
	struct kiln_error err = { 0 };
	char run_dir[256], state_dir[640];

	if (!w)
		return;
	/* its namespace's name first: the state directory that names it for recovery goes next */
	if (w->has_net && kiln_sbnet_destroy(w->id, &err) != KILN_OK)
		log_warn("removing the namespace of warm VM \"%s\": %s", w->id, err.msg);
	kiln_error_clear(&err);
	if (w->vm && vmm_destroy(w->vm, &err) != KILN_OK)
		log_warn("destroying warm VM \"%s\": %s", w->id, err.msg);
	w->vm = NULL;
	if (w->has_uid)
		jail_uid_release(JAIL_LEASE_DIR, w->uid);
	warm_dirs(n, w->id, run_dir, sizeof(run_dir), state_dir, sizeof(state_dir));
	fs_remove_tree_or_warn(run_dir);
	fs_remove_tree_or_warn(state_dir);
	free(w);
}

/* The device and inode of the state file of the snapshot in `dir`; false when it has none. */
static bool state_of(const char *dir, dev_t *dev, ino_t *ino)
{
	char path[700];
	struct stat st;

	snprintf(path, sizeof(path), "%s/state", dir);
	if (stat(path, &st) != 0)
		return false;
	*dev = st.st_dev;
	*ino = st.st_ino;
	return true;
}

/* Whether `snap`'s state file is still the one warm VM `w` was begun on. */
static bool snap_same(struct node *n, const char *snap, const struct warm_vm *w)
{
	char dir[600];
	dev_t dev;
	ino_t ino;

	snap_dir(n, snap, dir, sizeof(dir));
	return state_of(dir, &dev, &ino) && dev == w->state_dev && ino == w->state_ino;
}

/* A warm VM of `t` begun: its name, uid, namespace and VMM. */
static enum kiln_err warm_make(struct node *n, const struct warm_tpl *t, struct warm_vm **out,
			       struct kiln_error *err)
{
	char rid[AUTH_ID_MAX], owner[128], run_dir[256], state_dir[640], dir[600];
	struct warm_vm *w = calloc(1, sizeof(*w));
	enum kiln_err rc = KILN_OK;
	int r;

	*out = NULL;
	if (!w)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	/* the random part of an id of the project's kind (base32), behind a "0" */
	if (auth_new_id("w_", rid, sizeof(rid)) != KILN_OK) {
		free(w);
		return kiln_error_set(err, KILN_E_INTERNAL, "no entropy");
	}
	snprintf(w->id, sizeof(w->id), "0%.*s", KILN_NET_ID_MAX - 1, rid + 2);
	snprintf(w->tpl, sizeof(w->tpl), "%s", t->snap);
	w->vcpu_milli = t->vcpu_milli;
	w->mem_mib = t->mem_mib;
	w->disk_gib = t->disk_gib;
	w->codeint = t->codeint;
	w->paused = t->paused;
	w->begun_ms = clock_mono_ms();
	/* its state directory first: what a node that dies now finds it by (recovery.c) */
	warm_dirs(n, w->id, run_dir, sizeof(run_dir), state_dir, sizeof(state_dir));
	if ((r = fs_mkdir_p(state_dir, 0700)) < 0) {
		free(w);
		return kiln_error_set(err, KILN_E_IO, "cannot create \"%s\": %s", state_dir,
				      strerror(-r));
	}
	vmm_lease_owner(n->cfg.node_id, w->id, owner, sizeof(owner));
	if ((r = jail_uid_alloc(JAIL_LEASE_DIR, JAIL_UID_MIN, JAIL_UID_MAX, owner, &w->uid)) < 0)
		rc = kiln_error_set(err, KILN_E_NO_CAPACITY, "no free uid for the jail: %s",
				    strerror(-r));
	w->has_uid = rc == KILN_OK;
	if (rc == KILN_OK)
		rc = kiln_sbnet_create_tap(w->id, (int)w->uid, err);
	w->has_net = rc == KILN_OK;
	snap_dir(n, t->snap, dir, sizeof(dir));
	if (rc == KILN_OK && !state_of(dir, &w->state_dev, &w->state_ino))
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "snapshot \"%s\" has no state file",
				    t->snap);
	if (rc == KILN_OK)
		rc = sb_warm_begin(n, w, dir, err);
	if (rc != KILN_OK) {
		warm_free(n, w);
		return rc;
	}
	*out = w;
	return KILN_OK;
}

static struct warm_tpl *tpl_find(const char *snap)
{
	for (int i = 0; i < WARM_TPL_MAX; i++)
		if (pool.tpls[i].snap[0] && strcmp(pool.tpls[i].snap, snap) == 0)
			return &pool.tpls[i];
	return NULL;
}

static int ready_of(const char *snap)
{
	int k = 0;

	for (int i = 0; i < pool.nready; i++)
		k += strcmp(pool.ready[i]->tpl, snap) == 0;
	return k;
}

/*
 * The template the next warm VM is for: one with fewer than it wants whose wait is over; else
 * NULL and in `*wait_ms` how long until one's wait is over (-1: none waits). Under pool.lock.
 */
static struct warm_tpl *tpl_due(struct node *n, long long *wait_ms)
{
	long long now = clock_mono_ms();

	*wait_ms = -1;
	if (pool.nready >= WARM_VMS_MAX)
		return NULL;
	for (int i = 0; i < WARM_TPL_MAX; i++) {
		struct warm_tpl *t = &pool.tpls[i];

		if (!t->snap[0] || t->failed ||
		    ready_of(t->snap) >= (t->paused ? 1 : n->cfg.template_warm_vms))
			continue;
		if (now >= t->not_before_ms)
			return t;
		if (*wait_ms < 0 || t->not_before_ms - now < *wait_ms)
			*wait_ms = t->not_before_ms - now;
	}
	return NULL;
}

/* Takes the ready warm VMs of `snap` (all when NULL) out of the pool into `out`; under the lock. */
static int take_all(const char *snap, struct warm_vm **out)
{
	int k = 0, kept = 0;

	for (int i = 0; i < pool.nready; i++) {
		if (!snap || strcmp(pool.ready[i]->tpl, snap) == 0)
			out[k++] = pool.ready[i];
		else
			pool.ready[kept++] = pool.ready[i];
	}
	pool.nready = kept;
	return k;
}

/*
 * Takes out of the pool the pause snapshots among `snaps` (`nsnaps` of them) whose records are
 * gone, and those whose state file is gone or another than their warm VM was begun on, with their
 * warm VMs (into `out`); under the lock.
 */
static int stale_take(struct node *n, char (*snaps)[AUTH_ID_MAX], int nsnaps, struct warm_vm **out)
{
	char dir[600];
	dev_t dev;
	ino_t ino;
	int k = 0, kept = 0;

	for (int i = 0; i < nsnaps; i++) {
		struct warm_tpl *t = tpl_find(snaps[i]);

		if (t && t->paused) {
			k += take_all(t->snap, out + k);
			t->snap[0] = '\0';
		}
	}

	for (int i = 0; i < pool.nready; i++) {
		struct warm_vm *w = pool.ready[i];
		struct warm_tpl *t;

		if (!w->paused || snap_same(n, w->tpl, w)) {
			pool.ready[kept++] = w;
			continue;
		}
		if ((t = tpl_find(w->tpl)) != NULL)
			t->snap[0] = '\0';
		out[k++] = w;
	}
	pool.nready = kept;
	/* one whose begin failed has no VM: its entry goes with its files */
	for (int i = 0; i < WARM_TPL_MAX; i++) {
		struct warm_tpl *t = &pool.tpls[i];

		if (!t->snap[0] || !t->paused || ready_of(t->snap) > 0)
			continue;
		snap_dir(n, t->snap, dir, sizeof(dir));
		if (!state_of(dir, &dev, &ino))
			t->snap[0] = '\0';
	}
	return k;
}

/* The pause snapshots kept warm, copied into `out`; under the lock. */
static int paused_list(char (*out)[AUTH_ID_MAX])
{
	int k = 0;

	for (int i = 0; i < WARM_TPL_MAX; i++)
		if (pool.tpls[i].snap[0] && pool.tpls[i].paused)
			snprintf(out[k++], AUTH_ID_MAX, "%s", pool.tpls[i].snap);
	return k;
}

/*
 * Keeps in `snaps` (and returns how many) those of its `k` pause snapshots whose sandbox's record
 * no longer holds it paused on this node: deleted, resumed here or elsewhere. None when the
 * database cannot say (they are looked at again next time).
 */
static int records_gone(struct node *n, char (*snaps)[AUTH_ID_MAX], int k)
{
	char list[WARM_TPL_MAX * (AUTH_ID_MAX + 1) + 3] = "{";
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	int gone = 0;

	for (int i = 0; i < k; i++)
		snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s", i ? "," : "", snaps[i]);
	strcat(list, "}");
	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return 0;
	if (PGQ(c, &res, &err,
		"SELECT pause_snapshot FROM sandboxes WHERE pause_snapshot = ANY ($1::text[]) "
		"AND node_id = $2 AND state = 'paused' AND deleted_at IS NULL "
		"AND delete_requested_at IS NULL",
		list, n->cfg.node_id) != KILN_OK) {
		pg_release(n->pg, c);
		return 0;
	}
	pg_release(n->pg, c);
	for (int i = 0; i < k; i++) {
		bool held = false;

		for (int j = 0; j < pg_res_rows(res) && !held; j++)
			held = strcmp(pg_res_str(res, j, 0), snaps[i]) == 0;
		if (!held)
			memmove(snaps[gone++], snaps[i], AUTH_ID_MAX);
	}
	pg_res_free(res);
	return gone;
}

/* Frees `k` warm VMs of `gone` with the pool unlocked, saying why when `why`; under the lock. */
static void free_unlocked(struct node *n, struct warm_vm **gone, int k, const char *why)
{
	pthread_mutex_unlock(&pool.lock);
	for (int i = 0; i < k; i++) {
		if (why)
			log_info("paused snapshot \"%s\" %s: its VMM started ahead \"%s\" removed",
				 gone[i]->tpl, why, gone[i]->id);
		warm_free(n, gone[i]);
	}
	pthread_mutex_lock(&pool.lock);
}

static void *warm_run(void *arg)
{
	struct node *n = arg;
	long long next_check_ms = 0;

	pthread_mutex_lock(&pool.lock);
	while (!pool.stopping) {
		struct kiln_error err = { 0 };
		struct warm_vm *w = NULL, *gone[WARM_VMS_MAX];
		char snaps[WARM_TPL_MAX][AUTH_ID_MAX];
		struct warm_tpl job, *t;
		long long wait_ms, now = clock_mono_ms();
		enum kiln_err rc;
		int k, nsnaps;

		if (pool.ndead > 0) {
			k = pool.ndead;
			memcpy(gone, pool.dead, (size_t)k * sizeof(gone[0]));
			pool.ndead = 0;
			free_unlocked(n, gone, k, "gave way to a newer pause");
			continue;
		}
		if (now >= next_check_ms) {
			next_check_ms = now + WARM_CHECK_MS;
			if ((nsnaps = paused_list(snaps)) > 0) {
				pthread_mutex_unlock(&pool.lock);
				nsnaps = records_gone(n, snaps, nsnaps);
				pthread_mutex_lock(&pool.lock);
			}
			if ((k = stale_take(n, snaps, nsnaps, gone)) > 0) {
				free_unlocked(n, gone, k, "is no longer its sandbox's, or its files changed");
				continue;
			}
		}
		t = tpl_due(n, &wait_ms);
		if (!t) {
			if (paused_list(snaps) > 0 && (wait_ms < 0 || wait_ms > next_check_ms - now))
				wait_ms = next_check_ms - now;
			if (wait_ms < 0) {
				pthread_cond_wait(&pool.wake, &pool.lock);
			} else {
				struct timespec until = clock_after_ms(CLOCK_MONOTONIC, wait_ms);

				pthread_cond_timedwait(&pool.wake, &pool.lock, &until);
			}
			continue;
		}
		job = *t;
		pthread_mutex_unlock(&pool.lock);
		rc = warm_make(n, &job, &w, &err);
		pthread_mutex_lock(&pool.lock);
		t = tpl_find(job.snap);
		if (rc != KILN_OK) {
			if (t)
				t->failed = true;
			log_warn("%s \"%s\": a VMM could not be started ahead: %s",
				 job.paused ? "paused snapshot" : "template", job.snap, err.msg);
			continue;
		}
		if (!t || pool.stopping || pool.nready >= WARM_VMS_MAX) {
			/* dropped meanwhile: never handed out */
			pthread_mutex_unlock(&pool.lock);
			warm_free(n, w);
			pthread_mutex_lock(&pool.lock);
			continue;
		}
		pool.ready[pool.nready++] = w;
		log_info("%s \"%s\": VMM \"%s\" started ahead in %lld ms",
			 job.paused ? "paused snapshot" : "template", job.snap, w->id,
			 clock_mono_ms() - w->begun_ms);
	}
	pthread_mutex_unlock(&pool.lock);
	return NULL;
}

/* Starts the thread that begins warm VMs, once; false when it cannot run. Under the lock. */
static bool pool_start(struct node *n)
{
	if (pool.started)
		return true;
	/* waits on the clock a wall-clock step does not move; no one waits yet */
	clock_cond_init(&pool.wake, CLOCK_MONOTONIC);
	if (pthread_create(&pool.thread, NULL, warm_run, n) != 0) {
		log_warn("no VMMs started ahead: cannot start their thread");
		return false;
	}
	pool.started = true;
	return true;
}

/* A free entry, or NULL; under the lock. */
static struct warm_tpl *tpl_free(void)
{
	for (int i = 0; i < WARM_TPL_MAX; i++)
		if (!pool.tpls[i].snap[0])
			return &pool.tpls[i];
	return NULL;
}

/* Entry `t` kept warm from now on, the thread woken to begin its VMs; under the lock. */
static void tpl_set(struct warm_tpl *t, const char *snap, unsigned vcpu_milli, unsigned mem_mib,
		    unsigned disk_gib, bool codeint, bool paused)
{
	memset(t, 0, sizeof(*t));
	snprintf(t->snap, sizeof(t->snap), "%s", snap);
	t->vcpu_milli = vcpu_milli;
	t->mem_mib = mem_mib;
	t->disk_gib = disk_gib;
	t->codeint = codeint;
	t->paused = paused;
	t->added_ms = clock_mono_ms();
	pthread_cond_broadcast(&pool.wake);
}

void warm_add(struct node *n, const char *snap, unsigned vcpu_milli, unsigned mem_mib,
	      unsigned disk_gib, bool codeint)
{
	const struct hv_ops *hv = hv_find(n->cfg.hypervisor);
	struct warm_tpl *t = NULL;

	/* None where nothing would take them (templates off), or where the driver cannot begin a
	 * restore. */
	if (n->cfg.template_warm_vms <= 0 || !n->cfg.templates || !hv || !hv->restore_begin)
		return;
	pthread_mutex_lock(&pool.lock);
	if (pool.stopping || n->stopping || tpl_find(snap) || !pool_start(n) ||
	    !(t = tpl_free()))
		goto out;
	tpl_set(t, snap, vcpu_milli, mem_mib, disk_gib, codeint, false);
out:
	pthread_mutex_unlock(&pool.lock);
}

void warm_add_paused(struct node *n, const char *snap, unsigned vcpu_milli, unsigned mem_mib,
		     unsigned disk_gib)
{
	const struct hv_ops *hv = hv_find(n->cfg.hypervisor);
	struct warm_vm *gone[WARM_VMS_MAX];
	struct warm_tpl *t = NULL;
	int k = 0, have;

	if (n->cfg.paused_warm_vms <= 0 || !hv || !hv->restore_begin)
		return;
	pthread_mutex_lock(&pool.lock);
	if (pool.stopping || n->stopping || tpl_find(snap) || !pool_start(n))
		goto out;
	/* the oldest paused ones make room */
	for (;;) {
		struct warm_tpl *oldest = NULL;

		have = 0;
		for (int i = 0; i < WARM_TPL_MAX; i++) {
			struct warm_tpl *o = &pool.tpls[i];

			if (!o->snap[0] || !o->paused)
				continue;
			have++;
			if (!oldest || o->added_ms < oldest->added_ms)
				oldest = o;
		}
		if (have < n->cfg.paused_warm_vms || !oldest)
			break;
		k += take_all(oldest->snap, gone + k);
		oldest->snap[0] = '\0';
	}
	/* ended on the thread, not by this pause (the caller holds its sandbox) */
	while (k > 0 && pool.ndead < WARM_VMS_MAX)
		pool.dead[pool.ndead++] = gone[--k];
	pthread_cond_broadcast(&pool.wake);
	if (!(t = tpl_free()))
		goto out;
	tpl_set(t, snap, vcpu_milli, mem_mib, disk_gib, false, true);
out:
	pthread_mutex_unlock(&pool.lock);
	for (int i = 0; i < k; i++)
		warm_free(n, gone[i]);
}

void warm_drop(struct node *n, const char *snap)
{
	struct warm_vm *gone[WARM_VMS_MAX];
	struct warm_tpl *t;
	int k;

	pthread_mutex_lock(&pool.lock);
	t = tpl_find(snap);
	if (t)
		t->snap[0] = '\0';
	k = take_all(snap, gone);
	pthread_mutex_unlock(&pool.lock);
	for (int i = 0; i < k; i++)
		warm_free(n, gone[i]);
}

struct warm_vm *warm_take(struct node *n, const char *snap)
{
	struct warm_vm *w = NULL;
	struct warm_tpl *t;

	pthread_mutex_lock(&pool.lock);
	t = tpl_find(snap);
	for (int i = 0; t && i < pool.nready && !w; i++) {
		if (strcmp(pool.ready[i]->tpl, snap) == 0) {
			w = pool.ready[i];
			pool.ready[i] = pool.ready[--pool.nready];
		}
	}
	if (t && t->paused) {
		t->snap[0] = '\0';	/* used once: a begin still running is dropped at its end */
	} else if (t) {
		long long now = clock_mono_ms();

		t->failed = false;
		if (t->not_before_ms <= now)
			t->not_before_ms = now + n->cfg.template_warm_refill_ms;
		pthread_cond_broadcast(&pool.wake);
	}
	pthread_mutex_unlock(&pool.lock);
	if (w && !snap_same(n, snap, w)) {
		log_warn("snapshot \"%s\" is gone or replaced: its VMM started ahead \"%s\" not used",
			 snap, w->id);
		warm_free(n, w);
		w = NULL;
	}
	return w;
}

void warm_exit(struct node *n)
{
	struct warm_vm *gone[WARM_VMS_MAX];
	bool join;
	int k;

	pthread_mutex_lock(&pool.lock);
	pool.stopping = true;
	join = pool.started;
	pool.started = false;
	pthread_cond_broadcast(&pool.wake);
	pthread_mutex_unlock(&pool.lock);
	if (join)
		pthread_join(pool.thread, NULL);
	pthread_mutex_lock(&pool.lock);
	k = take_all(NULL, gone);
	memset(pool.tpls, 0, sizeof(pool.tpls));
	free_unlocked(n, pool.dead, pool.ndead, NULL);
	pool.ndead = 0;
	pthread_mutex_unlock(&pool.lock);
	for (int i = 0; i < k; i++)
		warm_free(n, gone[i]);
}
