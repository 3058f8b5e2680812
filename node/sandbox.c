/*
 * sandbox.c - the node's registry of sandboxes and their cold boot and teardown.
 *
 * A sandbox here is a microVM (vmm/), its network namespace with the guest's TAP (netpolicy/),
 * a leased unprivileged uid for its jailed VMM, and an agent connection (vmm/agent.c). Capacity
 * (sandboxes, vCPUs, memory) and network slots are reserved under the registry lock before any
 * of that is made, so a full node refuses at once.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "common/log.h"
#include "vmm/agent.h"
#include "vmm/hv.h"
#include "vmm/jail.h"
#include "vmm/orphan.h"
#include "netpolicy/dns.h"
#include "node/images.h"
#include "node/netsetup.h"
#include "node/inject.h"
#include "netpolicy/sniproxy.h"
#include "node/connlog.h"
#include "node/node.h"
#include "node/ports.h"
#include "node/warm.h"

#define SB_GROW_WAIT_MS 30000	/* for the guest to see its grown disk (agent_grow_root) */

static const char *const state_names[] = { "creating", "running", "paused", "stopped", "error" };

const char *sb_state_name(enum sb_state st)
{
	return state_names[st];
}

enum kiln_err node_error(struct kiln_error *err, enum kiln_err code, const char *fmt, ...)
{
	char msg[KILN_ERRMSG_MAX];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	kiln_error_clear(err);
	return kiln_error_set(err, code, "%s", msg);
}

struct sandbox *sb_get(struct node *n, const char *id)
{
	struct sandbox *sb;

	pthread_mutex_lock(&n->reg_lock);
	for (sb = n->sandboxes; sb; sb = sb->next)
		if (strcmp(sb->id, id) == 0)
			break;
	if (sb)
		sb->refs++;
	pthread_mutex_unlock(&n->reg_lock);
	return sb;
}

void sb_put(struct node *n, struct sandbox *sb)
{
	bool last;

	if (!sb)
		return;
	pthread_mutex_lock(&n->reg_lock);
	last = --sb->refs == 0;
	pthread_mutex_unlock(&n->reg_lock);
	if (last) {
		pthread_mutex_destroy(&sb->lock);
		free(sb);
	}
}

/* Lowest network slot no sandbox of this node uses; called with the registry lock held. */
static int free_net_index(struct node *n)
{
	for (int i = 0; i <= KILN_NET_INDEX_MAX; i++) {
		bool used = false;
		for (struct sandbox *sb = n->sandboxes; sb && !used; sb = sb->next)
			used = sb->net_index == i;
		if (!used)
			return i;
	}
	return -1;
}

enum kiln_err sb_reserve(struct node *n, const char *id, const char *tenant_id,
			 unsigned vcpu_milli, unsigned mem_mib, unsigned disk_gib,
			 struct sandbox **out, struct kiln_error *err)
{
	struct sandbox *sb = calloc(1, sizeof(*sb)), *it;
	enum kiln_err rc = KILN_OK;

	*out = NULL;
	if (!sb)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	snprintf(sb->id, sizeof(sb->id), "%s", id);
	snprintf(sb->tenant_id, sizeof(sb->tenant_id), "%s", tenant_id);
	/* The network id names the netns and the host veth (15 bytes): the id's random part. */
	snprintf(sb->net_id, sizeof(sb->net_id), "%s", strchr(id, '_') ? strchr(id, '_') + 1 : id);
	sb->vcpu_milli = vcpu_milli;
	sb->mem_mib = mem_mib;
	sb->disk_gib = disk_gib;
	sb->state = SB_CREATING;
	sb->refs = 2;	/* the registry's and the caller's */
	pthread_mutex_init(&sb->lock, NULL);

	pthread_mutex_lock(&n->reg_lock);
	for (it = n->sandboxes; it; it = it->next)
		if (!strcmp(it->id, id) || !strcmp(it->net_id, sb->net_id))
			rc = kiln_error_set(err, KILN_E_CONFLICT, "sandbox \"%s\" exists", id);
	if (rc == KILN_OK && (n->count + 1 > (unsigned)n->cfg.node_max_sandboxes ||
			      n->used_vcpu_milli + vcpu_milli > (unsigned)n->cfg.node_vcpu_milli ||
			      n->used_mem_mib + mem_mib > (unsigned)n->cfg.node_memory_mib))
		rc = kiln_error_set(err, KILN_E_NO_CAPACITY, "this node is full");
	if (rc == KILN_OK) {
		sb->net_index = free_net_index(n);
		if (sb->net_index < 0)
			rc = kiln_error_set(err, KILN_E_NO_CAPACITY, "no network slot left");
	}
	if (rc == KILN_OK) {
		n->count++;
		n->used_vcpu_milli += vcpu_milli;
		n->used_mem_mib += mem_mib;
		sb->next = n->sandboxes;
		n->sandboxes = sb;
	}
	pthread_mutex_unlock(&n->reg_lock);
	if (rc != KILN_OK) {
		pthread_mutex_destroy(&sb->lock);
		free(sb);
		return rc;
	}
	*out = sb;
	return KILN_OK;
}

/* Takes `sb` out of the registry and gives its capacity back. */
static void sb_unregister(struct node *n, struct sandbox *sb)
{
	struct sandbox **pp;
	bool found = false;

	pthread_mutex_lock(&n->reg_lock);
	for (pp = &n->sandboxes; *pp; pp = &(*pp)->next) {
		if (*pp == sb) {
			*pp = sb->next;
			found = true;
			break;
		}
	}
	if (found) {
		n->count--;
		n->used_vcpu_milli -= sb->vcpu_milli;
		n->used_mem_mib -= sb->mem_mib;
		sb->refs--;
	}
	pthread_mutex_unlock(&n->reg_lock);
	if (found && sb->refs == 0) {
		/* Cannot happen while the caller holds its reference; kept for safety. */
		pthread_mutex_destroy(&sb->lock);
		free(sb);
	}
}

void sb_failed(struct node *n, struct sandbox *sb, const char *why)
{
	struct record_fence f = sb_fence(n, sb);
	struct kiln_error err = { 0 };

	sb->state = SB_ERROR;
	if (record_failed(n->pg, NULL, &f, why, &err) != KILN_OK)
		log_error("the failure of \"%s\" not recorded: %s", sb->id, err.msg);
}


static void vm_dirs(struct node *n, const struct sandbox *sb, char *run_dir, size_t rlen,
		    char *state_dir, size_t slen)
{
	snprintf(run_dir, rlen, "%s/%s", n->vm_run_root, sb->id);
	snprintf(state_dir, slen, "%s/%s", n->vm_state_root, sb->id);
}

void sb_teardown(struct node *n, struct sandbox *sb)
{
	sb_release(n, sb);
	sb_unregister(n, sb);
}

static struct net_prep *prep_take(struct sandbox *sb);
static void prep_free(struct net_prep *p);

void sb_release(struct node *n, struct sandbox *sb)
{
	struct kiln_error err = { 0 };
	struct net_prep *prep;
	char run_dir[256], state_dir[640];

	inject_drop(n->inject, sb->id);	/* its secrets leave memory with its VM */
	if (sb->agent) {
		ports_drain(n, sb);	/* no port stream outlives the channel it runs on */
		agent_free(sb->agent);
		sb->agent = NULL;
	}
	if (sb->vm) {
		if (vmm_destroy(sb->vm, &err) != KILN_OK)
			log_warn("destroying the VM of \"%s\": %s", sb->id, err.msg);
		sb->vm = NULL;
	}
	if (sb->has_net)
		connlog_flush(n, sb);	/* the VM is gone: its last flows, before the pins go */
	/* The proxies' sockets keep the netns alive: they go first (netpolicy/netns.h). */
	if (sb->sni_added) {
		kiln_sniproxy_remove(n->sni, sb->net_id);
		sb->sni_added = false;
	}
	if (sb->dns_added) {
		kiln_dns_proxy_remove(n->dns, sb->net_id);
		sb->dns_added = false;
	}
	kiln_policy_close(sb->pol);
	sb->pol = NULL;
	prep = prep_take(sb);
	if (prep && !sb->has_net) {
		/* loaded ahead for a network never made: its pins go here */
		kiln_error_clear(&err);
		if (kiln_policy_unpin(NULL, n->cfg.node_id, sb->id, &err) != KILN_OK)
			log_warn("removing the policy pins of \"%s\": %s", sb->id, err.msg);
	}
	prep_free(prep);
	if (sb->has_net) {
		kiln_error_clear(&err);
		if (kiln_sbnet_destroy(sb->net_id, &err) != KILN_OK)
			log_warn("removing the network of \"%s\": %s", sb->id, err.msg);
		sb->has_net = false;
		kiln_error_clear(&err);
		if (kiln_policy_unpin(NULL, n->cfg.node_id, sb->id, &err) != KILN_OK)
			log_warn("removing the policy pins of \"%s\": %s", sb->id, err.msg);
	}
	if (sb->has_uid) {
		jail_uid_release(JAIL_LEASE_DIR, sb->uid);
		sb->has_uid = false;
	}
	vm_dirs(n, sb, run_dir, sizeof(run_dir), state_dir, sizeof(state_dir));
	fs_remove_tree_or_warn(run_dir);
	fs_remove_tree_or_warn(state_dir);
}

/*
 * Where a sandbox's network setup spends its time, ms (monotonic clock marks turned into
 * lengths), logged at info so that a slow create or resume can be read off the node's log.
 */
enum net_phase {
	NP_UID, NP_NETNS, NP_GATE, NP_POLICY, NP_RULES, NP_DNS, NP_SNI, NP_ATTACH, NP__COUNT
};

struct net_times {
	long long mark;
	long long ms[NP__COUNT];
	long long loaded_ahead;	/* the programs' load before (sb_net_prepare), -1: none */
};

static void net_time(struct net_times *t, enum net_phase ph)
{
	long long now = sb_mono_ms();

	t->ms[ph] = now - t->mark;
	t->mark = now;
}

/* The policy of `sb` as this node configures it; `net` may be only described. */
static struct kiln_policy_config sb_policy_config(struct node *n, const struct sandbox *sb,
						  const struct kiln_sbnet *net)
{
	return (struct kiln_policy_config){
		.node_id = n->cfg.node_id,
		.sandbox_id = sb->id,
		.net = net,
		.conn_rate = (uint32_t)n->cfg.conn_rate,
		.conn_burst = (uint32_t)n->cfg.conn_burst,
		.deny = n->cfg.egress_deny,
	};
}

/*
 * A sandbox's eBPF programs loaded ahead (sb_net_prepare) on a thread of their own, while its
 * create or resume does what needs no network (its record, its snapshot's verification): the
 * load is most of the network's setup. Held in the sandbox's net_prep until sb_net_up hooks it
 * to the devices or sb_release drops it; either waits for the thread first.
 */
struct net_prep {
	pthread_t thread;
	struct kiln_policy_config pc;
	struct kiln_sbnet net;		/* described only: names and addresses */
	char node_id[64], sandbox_id[48];
	struct kiln_policy_load *load;	/* on success */
	enum kiln_err rc;
	struct kiln_error err;
	long long ms;			/* the load's own length */
};

static void *prep_run(void *arg)
{
	struct net_prep *p = arg;
	long long t0 = sb_mono_ms();

	p->rc = kiln_policy_load(&p->pc, &p->load, &p->err);
	p->ms = sb_mono_ms() - t0;
	return NULL;
}

void sb_net_prepare(struct node *n, struct sandbox *sb)
{
	struct net_prep *p;
	struct kiln_error err = { 0 };

	if (sb->net_prep || sb->has_net)
		return;	/* loading already, or hooked */
	p = calloc(1, sizeof(*p));
	if (!p)
		return;	/* sb_net_up loads them itself */
	snprintf(p->node_id, sizeof(p->node_id), "%s", n->cfg.node_id);
	snprintf(p->sandbox_id, sizeof(p->sandbox_id), "%s", sb->id);
	if (kiln_sbnet_describe(sb->net_id, (uint32_t)sb->net_index, &p->net, &err) != KILN_OK) {
		free(p);
		return;
	}
	p->pc = sb_policy_config(n, sb, &p->net);
	p->pc.node_id = p->node_id;
	p->pc.sandbox_id = p->sandbox_id;
	if (pthread_create(&p->thread, NULL, prep_run, p) != 0) {
		free(p);
		return;
	}
	sb->net_prep = p;
}

/* The load prepared for `sb`, its thread ended, taken out of it; NULL when none. */
static struct net_prep *prep_take(struct sandbox *sb)
{
	struct net_prep *p = sb->net_prep;

	sb->net_prep = NULL;
	if (p)
		pthread_join(p->thread, NULL);
	return p;
}

static void prep_free(struct net_prep *p)
{
	if (!p)
		return;
	kiln_policy_load_free(p->load);
	free(p);
}

/*
 * The sandbox's eBPF policy: its programs' load taken (waited for) or made here, its maps given
 * the first rules and bandwidth and its DNS and name-checking proxies, and only then the
 * programs attached to its devices (replacing the gate, if any: the guest's traffic meets the
 * whole policy from its first packet). Logs where the network's setup spent its time.
 */
static enum kiln_err sb_net_policy(struct node *n, struct sandbox *sb, const struct sb_init *init,
				   struct net_times *t, struct kiln_error *err)
{
	struct kiln_policy_config pc = sb_policy_config(n, sb, &sb->net);
	struct net_prep *prep = prep_take(sb);
	struct kiln_policy_load *load = NULL;
	enum kiln_err rc = KILN_OK;
	long long total = 0;

	t->mark = sb_mono_ms();
	if (prep && prep->rc != KILN_OK) {
		/* what failed there fails here the same: said once, as any setup failure */
		kiln_error_clear(err);
		rc = kiln_error_set(err, prep->rc, "%s", prep->err.msg);
	} else if (prep) {
		load = prep->load;
		prep->load = NULL;
		t->loaded_ahead = prep->ms;
	} else {
		rc = kiln_policy_load(&pc, &load, err);
	}
	prep_free(prep);
	if (rc == KILN_OK)
		sb->pol = kiln_policy_load_take(load);	/* closed by sb_release */
	net_time(t, NP_POLICY);
	if (rc == KILN_OK && init && init->egress && init->egress->n)
		rc = kiln_policy_apply_held(sb->pol, init->egress, err);
	if (rc == KILN_OK && init && init->bandwidth)
		rc = kiln_policy_set_bandwidth(sb->pol, init->bandwidth, err);
	net_time(t, NP_RULES);
	if (rc == KILN_OK) {
		rc = kiln_dns_proxy_add(n->dns, &sb->net, sb->pol, err);
		sb->dns_added = rc == KILN_OK;
	}
	net_time(t, NP_DNS);
	if (rc == KILN_OK) {
		rc = kiln_sniproxy_add(n->sni, &sb->net, sb->pol, err);
		sb->sni_added = rc == KILN_OK;
	}
	net_time(t, NP_SNI);
	if (rc == KILN_OK)
		rc = kiln_policy_hook(load, &sb->net, NULL, err);
	else
		kiln_policy_load_free(load);
	net_time(t, NP_ATTACH);
	for (int i = 0; i < NP__COUNT; i++)
		total += t->ms[i];
	if (rc == KILN_OK)
		log_info("sandbox \"%s\": network up in %lld ms: uid %lld, netns %lld, gate %lld, "
			 "policy %lld, rules %lld, dns %lld, sni %lld, attach %lld (programs loaded "
			 "ahead in %lld)", sb->id, total, t->ms[NP_UID], t->ms[NP_NETNS],
			 t->ms[NP_GATE], t->ms[NP_POLICY], t->ms[NP_RULES], t->ms[NP_DNS],
			 t->ms[NP_SNI], t->ms[NP_ATTACH], t->loaded_ahead);
	return rc;
}

/*
 * The uid lease and the network namespace with its TAP. With `gate` the TAP passes nothing
 * either way (kiln_policy_gate) until sb_net_policy attaches the programs, so that the VM may
 * start before them. With a warm VM `w` (warm.c), its uid and namespace (its TAP and QEMU in it)
 * are taken over instead.
 */
static enum kiln_err sb_net_base(struct node *n, struct sandbox *sb, bool gate,
				 struct warm_vm *w, struct net_times *t, struct kiln_error *err)
{
	struct kiln_sbnet_config netcfg = { 0 };
	char owner[128];
	enum kiln_err rc;
	int r;

	t->mark = sb_mono_ms();
	t->loaded_ahead = -1;
	vmm_lease_owner(n->cfg.node_id, sb->id, owner, sizeof(owner));
	if (w) {
		/* the warm VM's uid, its QEMU's: the lease names the sandbox from here */
		if ((r = jail_uid_relabel(JAIL_LEASE_DIR, w->uid, owner)) < 0)
			return kiln_error_set(err, KILN_E_IO, "cannot relabel the lease of uid %u: %s",
					      (unsigned)w->uid, strerror(-r));
		sb->uid = w->uid;
		w->has_uid = false;
	} else if ((r = jail_uid_alloc(JAIL_LEASE_DIR, JAIL_UID_MIN, JAIL_UID_MAX, owner,
				       &sb->uid)) < 0) {
		return kiln_error_set(err, KILN_E_NO_CAPACITY, "no free uid for the jail: %s",
				      strerror(-r));
	}
	sb->has_uid = true;
	net_time(t, NP_UID);
	netcfg.id = sb->net_id;
	netcfg.index = (uint32_t)sb->net_index;
	netcfg.tap_uid = (int)sb->uid;
	netcfg.netns_from = w ? w->id : NULL;	/* its namespace: QEMU and its TAP in it */
	rc = kiln_sbnet_create(&netcfg, &sb->net, err);
	if (rc != KILN_OK)
		return rc;
	sb->has_net = true;
	if (w) {
		/* the namespace is the sandbox's alone: no other name to enter or remove it by */
		struct kiln_error ignore = { 0 };

		if (kiln_sbnet_destroy(w->id, &ignore) != KILN_OK)
			log_warn("removing the name of warm VM \"%s\"'s namespace: %s", w->id,
				 ignore.msg);
		else
			w->has_net = false;
	}
	net_time(t, NP_NETNS);
	if (gate)
		rc = kiln_policy_gate(&sb->net, err);
	net_time(t, NP_GATE);
	return rc;
}

/* The uid lease, network namespace with its TAP, eBPF policy and DNS service of a sandbox. */
static enum kiln_err sb_net_up(struct node *n, struct sandbox *sb, const struct sb_init *init,
			       struct kiln_error *err)
{
	struct net_times t = { 0 };
	enum kiln_err rc = sb_net_base(n, sb, false, NULL, &t, err);

	return rc == KILN_OK ? sb_net_policy(n, sb, init, &t, err) : rc;
}

/* The VM spec of `sb` on this node; the strings point into `bufs`, which must outlive `spec`. */
struct spec_bufs {
	char run_dir[256], state_dir[640], netns_path[64];
};

static void sb_spec(struct node *n, const struct sandbox *sb, struct vmm_spec *spec,
		    struct spec_bufs *b)
{
	vm_dirs(n, sb, b->run_dir, sizeof(b->run_dir), b->state_dir, sizeof(b->state_dir));
	snprintf(b->netns_path, sizeof(b->netns_path), "/run/netns/%s", sb->net.netns);
	memset(spec, 0, sizeof(*spec));
	spec->id = sb->id;
	spec->node = n->cfg.node_id;
	spec->vcpu_milli = sb->vcpu_milli;
	spec->mem_mib = sb->mem_mib;
	spec->disk_gib = sb->disk_gib;
	spec->kernel = n->cfg.guest_kernel;
	spec->initrd = n->cfg.guest_initrd;
	spec->rootfs = sb->codeint ? n->cfg.guest_codeint_rootfs : n->cfg.guest_rootfs;
	spec->cmdline_extra = n->cfg.guest_cmdline;
	spec->netns_path = b->netns_path;
	spec->tap = KILN_NET_TAP;
	spec->run_dir = b->run_dir;
	spec->state_dir = b->state_dir;
	spec->uid = sb->uid;
	spec->gid = sb->uid;
	spec->tb_size_mib = (unsigned)n->cfg.tcg_tb_size_mib;
	spec->free_page_reporting = n->cfg.free_page_reporting;
	spec->hv_binary = n->cfg.hypervisor_binary && *n->cfg.hypervisor_binary ?
			  n->cfg.hypervisor_binary : NULL;
	spec->console_max = (unsigned long long)n->cfg.console_max_bytes;
	/* disk throttle scaled from the whole vCPUs the guest sees */
	spec->disk_iops = (unsigned)n->cfg.disk_iops_per_vcpu * vmm_vcpus_whole(sb->vcpu_milli);
	spec->disk_bps = ((unsigned long long)n->cfg.disk_mibps_per_vcpu << 20) * vmm_vcpus_whole(sb->vcpu_milli);
}

enum kiln_err sb_identity(struct node *n, struct sandbox *sb, bool fresh, const char *const *env,
			  struct kiln_error *err)
{
	char hostname[64];
	unsigned char entropy[64];
	struct agent_identity ident = { 0 };
	struct timespec now;
	enum kiln_err rc;

	if (getrandom(entropy, sizeof(entropy), 0) != (ssize_t)sizeof(entropy))
		return kiln_error_set(err, KILN_E_INTERNAL, "no entropy");
	clock_gettime(CLOCK_REALTIME, &now);
	ident.wall_clock_ns = (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
	ident.entropy = entropy;
	ident.entropy_len = sizeof(entropy);
	if (fresh) {
		snprintf(hostname, sizeof(hostname), "%s", sb->id);
		for (char *p = hostname; *p; p++)
			if (*p == '_')
				*p = '-';
		ident.hostname = hostname;
		ident.sandbox_id = sb->id;
		ident.env = env;
	}
	rc = agent_set_identity(sb->agent, &ident, err);
	explicit_bzero(entropy, sizeof(entropy));
	if (rc != KILN_OK)
		return rc == KILN_E_INVALID ? rc : kiln_error_set(err, KILN_E_SANDBOX_FAILED,
								   "the guest refused its identity");
	return KILN_OK;
}

/* Connects to the new VM's agent and waits until it answers (a boot or a restore). */
static enum kiln_err sb_agent_up(struct node *n, struct sandbox *sb, int timeout_ms,
				 struct agent_hello_info *hello, struct kiln_error *err)
{
	sb->agent = agent_connect(vmm_agent_socket(sb->vm), 10000, err);
	if (!sb->agent)
		return err->code ? err->code : KILN_E_SANDBOX_FAILED;
	if (agent_hello(sb->agent, timeout_ms, hello, err) != KILN_OK) {
		kiln_error_clear(err);
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "the guest did not answer");
	}
	return KILN_OK;
}

/*
 * Grows the guest's root file system to fill its disk of disk_gib, which the VMM has just made
 * that large (a new layer at a boot, a resize after a restore): a sandbox gets the disk it asked
 * for, or it does not start.
 */
static enum kiln_err sb_fill_disk(struct sandbox *sb, struct kiln_error *err)
{
	uint64_t want = (uint64_t)sb->disk_gib << 30, fs = 0;
	enum kiln_err rc = agent_grow_root(sb->agent, want, SB_GROW_WAIT_MS, &fs, err);

	if (rc != KILN_OK) {
		char why[KILN_ERRMSG_MAX];

		snprintf(why, sizeof(why), "%s", err->msg);
		return node_error(err, KILN_E_SANDBOX_FAILED,
				  "the root file system could not grow to %u GiB: %s", sb->disk_gib, why);
	}
	log_debug("sandbox \"%s\": root file system of %llu MiB on %u GiB", sb->id,
		  (unsigned long long)(fs >> 20), sb->disk_gib);
	return KILN_OK;
}

/*
 * Takes one of the node's VMM starts (node.h), waiting until one is free; vm_start_give gives
 * it back.
 */
static void vm_start_take(struct node *n)
{
	while (sem_wait(&n->vm_starts) != 0 && errno == EINTR)
		;
}

static void vm_start_give(struct node *n)
{
	sem_post(&n->vm_starts);
}

enum kiln_err sb_boot(struct node *n, struct sandbox *sb, const struct sb_init *init,
		      struct kiln_error *err)
{
	struct agent_hello_info hello;
	struct vmm_spec spec;
	struct spec_bufs b;
	enum kiln_err rc = sb_net_up(n, sb, init, err);

	if (rc != KILN_OK)
		return rc;
	sb_spec(n, sb, &spec, &b);
	snprintf(sb->image_hash, sizeof(sb->image_hash), "%s", node_image_hash(n));
	vm_start_take(n);
	rc = vmm_create(n->cfg.hypervisor, &spec, &sb->vm, err);
	vm_start_give(n);
	if (rc == KILN_OK)
		rc = sb_agent_up(n, sb, (int)n->cfg.boot_timeout_s * 1000, &hello, err);
	if (rc == KILN_OK)
		rc = sb_fill_disk(sb, err);
	/* A fresh identity: host name, id, clock, entropy from the host, the requested env. */
	if (rc == KILN_OK)
		rc = sb_identity(n, sb, true, init ? init->env : NULL, err);
	if (rc == KILN_OK)
		log_info("sandbox \"%s\" booted (kernel %s)", sb->id, hello.kernel_release);
	return rc;
}

long long sb_mono_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

enum kiln_err sb_warm_begin(struct node *n, struct warm_vm *w, const char *snap_dir,
			    struct kiln_error *err)
{
	struct sandbox *like = calloc(1, sizeof(*like));	/* what sb_spec reads */
	struct vmm_spec spec;
	struct spec_bufs b;
	enum kiln_err rc;

	if (!like)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	snprintf(like->id, sizeof(like->id), "%s", w->id);
	like->vcpu_milli = w->vcpu_milli;
	like->mem_mib = w->mem_mib;
	like->disk_gib = w->disk_gib;
	like->codeint = w->codeint;
	like->uid = w->uid;
	rc = kiln_sbnet_describe(w->id, 0, &like->net, err);
	if (rc == KILN_OK) {
		sb_spec(n, like, &spec, &b);
		vm_start_take(n);
		/* a template's memory mapped as a create's; a pause snapshot's copied in at the take */
		rc = vmm_restore_begin(n->cfg.hypervisor, &spec, snap_dir,
				       w->paused ? VMM_MEM_COPY_LATE : VMM_MEM_PRIVATE, &w->vm, err);
		vm_start_give(n);
	}
	free(like);
	return rc;
}

/* sb_restore(), or with a warm VM `w` sb_restore_warm(). */
static enum kiln_err restore(struct node *n, struct sandbox *sb, const char *snap_dir,
			     enum vmm_mem_from from, struct warm_vm *w, const struct sb_init *init,
			     bool fresh, struct kiln_error *err)
{
	struct agent_hello_info hello;
	struct vmm_spec spec;
	struct spec_bufs b;
	struct net_times nt = { 0 };
	bool net_due = !sb->has_net;
	enum kiln_err rc;
	/* phase timings, logged: images, network, VMM restore, agent, policy, disk, identity */
	long long t[7] = { sb_mono_ms() }, images;

	/* On the image it was taken from (its kernel, initramfs and disk base), or not at all. */
	rc = images_of_snapshot(n->cfg.node_id, snap_dir, node_image_hash(n), sb->image_hash,
				sizeof(sb->image_hash), err);
	images = sb_mono_ms() - t[0];
	/*
	 * The namespace and a gated TAP before the VMM, the policy after it: its programs finish
	 * loading (sb_net_prepare) while QEMU starts and the guest answers, and the guest's packets
	 * are dropped until they are attached.
	 */
	if (rc == KILN_OK && net_due)
		rc = sb_net_base(n, sb, true, w, &nt, err);
	if (rc != KILN_OK)
		return rc;
	t[1] = sb_mono_ms();
	sb_spec(n, sb, &spec, &b);
	if (w) {
		/* QEMU started already: renamed to the sandbox, its state loaded and run */
		rc = vmm_restore_end(w->vm, &spec, err);
		sb->vm = rc == KILN_OK ? w->vm : NULL;
		w->vm = NULL;	/* the sandbox's, or destroyed by the end */
	} else {
		vm_start_take(n);
		rc = vmm_restore(n->cfg.hypervisor, &spec, snap_dir, from, &sb->vm, err);
		vm_start_give(n);
	}
	t[2] = sb_mono_ms();
	if (rc == KILN_OK)
		rc = sb_agent_up(n, sb, 30000, &hello, err);
	t[3] = sb_mono_ms();
	if (rc == KILN_OK && net_due) {
		rc = sb_net_policy(n, sb, init, &nt, err);
		if (rc != KILN_OK) {
			/* a setup failure, as before the VMM: none of it ran for the caller */
			struct kiln_error ignore = { 0 };

			agent_free(sb->agent);
			sb->agent = NULL;
			vmm_destroy(sb->vm, &ignore);
			sb->vm = NULL;
		}
	}
	t[4] = sb_mono_ms();
	if (rc == KILN_OK && !sb->disk_filled)
		rc = sb_fill_disk(sb, err);
	t[5] = sb_mono_ms();
	/* Every restore: the clock set to now and the RNG reseeded; a new sandbox a new identity. */
	if (rc == KILN_OK)
		rc = sb_identity(n, sb, fresh, init ? init->env : NULL, err);
	t[6] = sb_mono_ms();
	if (rc == KILN_OK)
		/* policy, between agent and disk in time, last: the benches read the others */
		log_info("sandbox \"%s\" restored from %s in %lld ms: network %lld, vmm %lld, "
			 "agent %lld, disk %lld, identity %lld, policy %lld (after the agent; images "
			 "checked in %lld of the network's)%s", sb->id, snap_dir, t[6] - t[0],
			 t[1] - t[0], t[2] - t[1], t[3] - t[2], t[5] - t[4], t[6] - t[5], t[4] - t[3],
			 images, w ? ", its VMM started ahead" : "");
	return rc;
}

enum kiln_err sb_restore(struct node *n, struct sandbox *sb, const char *snap_dir,
			 enum vmm_mem_from from, const struct sb_init *init, bool fresh,
			 struct kiln_error *err)
{
	return restore(n, sb, snap_dir, from, NULL, init, fresh, err);
}

enum kiln_err sb_restore_warm(struct node *n, struct sandbox *sb, const char *snap_dir,
			      struct warm_vm *w, const struct sb_init *init, bool fresh,
			      struct kiln_error *err)
{
	/* the memory as the warm VM's begin prepared it */
	return restore(n, sb, snap_dir, VMM_MEM_PRIVATE, w, init, fresh, err);
}
