/*
 * warm.c - VMMs started ahead of the creates they serve (warm.h).
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
 * (WARM_REFILL_DELAY_MS, so as not to share the CPU with the create it serves). A begin that
 * fails is not tried again until a create of that template finds none. The template's memory is
 * mapped privately, like an ordinary create's: a warm VM holds QEMU's own memory, not the guest's.
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
#define WARM_REFILL_DELAY_MS 1500

/* A template kept warm. */
struct warm_tpl {
	char snap[AUTH_ID_MAX];	/* "" when the entry is free */
	unsigned vcpu_milli, mem_mib, disk_gib;
	bool codeint;
	bool failed;		/* its last begin failed: none until a take finds none */
	long long not_before_ms;	/* no begin before (CLOCK_MONOTONIC) */
};

static struct {
	pthread_mutex_t lock;
	pthread_cond_t wake;	/* on CLOCK_MONOTONIC once started */
	struct warm_tpl tpls[WARM_TPL_MAX];
	struct warm_vm *ready[WARM_VMS_MAX];
	int nready;
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

		if (!t->snap[0] || t->failed || ready_of(t->snap) >= n->cfg.template_warm_vms)
			continue;
		if (now >= t->not_before_ms)
			return t;
		if (*wait_ms < 0 || t->not_before_ms - now < *wait_ms)
			*wait_ms = t->not_before_ms - now;
	}
	return NULL;
}

static void *warm_run(void *arg)
{
	struct node *n = arg;

	pthread_mutex_lock(&pool.lock);
	while (!pool.stopping) {
		struct kiln_error err = { 0 };
		struct warm_vm *w = NULL;
		struct warm_tpl job, *t;
		long long wait_ms;
		enum kiln_err rc;

		t = tpl_due(n, &wait_ms);
		if (!t) {
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
			log_warn("template \"%s\": a VMM could not be started ahead: %s", job.snap,
				 err.msg);
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
		log_info("template \"%s\": VMM \"%s\" started ahead in %lld ms", job.snap, w->id,
			 clock_mono_ms() - w->begun_ms);
	}
	pthread_mutex_unlock(&pool.lock);
	return NULL;
}

void warm_add(struct node *n, const char *snap, unsigned vcpu_milli, unsigned mem_mib,
	      unsigned disk_gib, bool codeint)
{
	const struct hv_ops *hv = hv_find(n->cfg.hypervisor);
	struct warm_tpl *t = NULL;

	/*
	 * None where nothing would take them (templates off), where the driver cannot begin a
	 * restore, or where the guests have the balloon: its VMs copy the template's memory at the
	 * begin (docs/vmm.md), which a warm VM would then hold, counted nowhere, while it waits.
	 */
	if (n->cfg.template_warm_vms <= 0 || !n->cfg.templates || n->cfg.free_page_reporting ||
	    !hv || !hv->restore_begin)
		return;
	pthread_mutex_lock(&pool.lock);
	if (pool.stopping || n->stopping || tpl_find(snap))
		goto out;
	if (!pool.started) {
		/* waits on the clock a wall-clock step does not move; no one waits yet */
		clock_cond_init(&pool.wake, CLOCK_MONOTONIC);
		if (pthread_create(&pool.thread, NULL, warm_run, n) != 0) {
			log_warn("no VMMs started ahead: cannot start their thread");
			goto out;
		}
		pool.started = true;
	}
	for (int i = 0; i < WARM_TPL_MAX && !t; i++)
		if (!pool.tpls[i].snap[0])
			t = &pool.tpls[i];
	if (!t)
		goto out;
	memset(t, 0, sizeof(*t));
	snprintf(t->snap, sizeof(t->snap), "%s", snap);
	t->vcpu_milli = vcpu_milli;
	t->mem_mib = mem_mib;
	t->disk_gib = disk_gib;
	t->codeint = codeint;
	pthread_cond_broadcast(&pool.wake);
out:
	pthread_mutex_unlock(&pool.lock);
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
	if (t) {
		t->failed = false;
		t->not_before_ms = clock_mono_ms() + WARM_REFILL_DELAY_MS;
		pthread_cond_broadcast(&pool.wake);
	}
	pthread_mutex_unlock(&pool.lock);
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
	pthread_mutex_unlock(&pool.lock);
	for (int i = 0; i < k; i++)
		warm_free(n, gone[i]);
}
