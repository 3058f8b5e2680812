/*
 * node.h - kiln-node: one per host; runs the sandboxes' microVMs for the gateways.
 *
 * The node never trusts its caller: every request carries a JWT the gateway signed for it
 * (aud kiln-node, the tenant, the scopes and the sandbox), which the node verifies against the
 * gateways' JWKS. It records every sandbox state change in Postgres (record/record.h: fenced on
 * the node and the sandbox's generation) and registers itself in
 * `nodes` with its capacity and a heartbeat.
 */
#ifndef KILN_NODE_H
#define KILN_NODE_H

#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <time.h>

#include "common/http.h"
#include "auth/crypto.h"
#include "auth/jwt.h"
#include "common/config.h"
#include "common/pg.h"
#include "common/s3.h"
#include "netpolicy/netns.h"
#include "netpolicy/policy.h"
#include "netpolicy/rules.h"
#include "record/record.h"
#include "vmm/hv.h"

struct jwks_cache;
struct vmm_vm;
struct agent;
struct kiln_dns_proxy;
struct kiln_sniproxy;
struct snapstore;
struct inject;
struct net_prep;
struct warm_vm;

enum sb_state { SB_CREATING, SB_RUNNING, SB_PAUSED, SB_STOPPED, SB_ERROR };

/* A sandbox this node holds. Fields after `lock` change only under it. */
struct sandbox {
	char id[48];
	char tenant_id[AUTH_CLAIM_MAX];
	char net_id[KILN_NET_ID_MAX + 1];
	unsigned vcpu_milli, mem_mib, disk_gib;
	int net_index;
	long long generation;	/* of its record: every write of it is fenced on it (record.h) */
	int refs;		/* under the registry lock */
	unsigned execs;		/* execs running (exec_max_per_sandbox), under the registry lock */
	pthread_mutex_t lock;	/* serialises lifecycle changes (create, delete, pause...) */
	enum sb_state state;
	time_t expires_at;	/* seconds since the epoch */
	struct vmm_vm *vm;
	struct agent *agent;
	struct kiln_sbnet net;
	bool has_net;
	struct kiln_policy *pol;	/* the eBPF policy on its devices */
	bool dns_added;
	bool sni_added;		/* the name-checking proxy serves it */
	struct net_prep *net_prep;	/* its eBPF programs loading ahead (sb_net_prepare), taken
					 * by its network's setup or dropped by sb_release; or NULL */
	uid_t uid;
	bool has_uid;
	bool codeint;		/* booted from the code interpreter's image (code-interpreter-v1) */
	bool disk_filled;	/* its root file system fills disk_gib already: a restore does not
				 * ask the guest to grow it (the resume of its own pause, a create
				 * from the template of its shape) */
	char image_hash[128];	/* the guest image its VM runs on (images.h); "" when not known */
	struct sandbox *next;
};

struct node {
	struct kiln_config cfg;
	struct pg *pg;
	struct http_server *http;
	struct jwks_cache *keys;
	struct kiln_dns_proxy *dns;	/* serves every sandbox's 172.16.0.1:53 */
	struct kiln_sniproxy *sni;	/* checks names on TCP 80/443 (netpolicy/sniproxy.h) */
	struct auth_master_key mk;	/* seals snapshots that leave the node */
	struct snapstore *store;	/* tenants' buckets; NULL without a master key */
	struct inject *inject;		/* secrets' injecting proxy (inject.h); NULL without a master key */
	struct netaddr_allow *storage_allow;	/* config storage_allow, parsed */
	struct s3_opts s3;		/* the buckets' client settings (its allow list above) */
	char listen_path[108];		/* the Unix socket, when listening on one */
	char vm_run_root[128];		/* /run/kiln/<node>: per-VM sockets and jails (vmm/orphan.h) */
	char vm_state_root[512];	/* <data_dir>/vms/<node>: per-VM disk layers */
	char snap_root[512];		/* <data_dir>/snaps/<node>: snapshots */
	const char *accel;		/* "kvm" or "tcg" */
	long long disk_gib;		/* guest disk it may promise: node_disk_gib (or the size of
					 * vm_state_root's file system) times node_disk_overcommit_pct */

	/*
	 * VMM starts (vmm_create, vmm_restore) in progress at once: at most the host's CPUs. A start
	 * is CPU work; twenty at once on two loaded CPUs missed QEMU's 10 s start-up deadline and
	 * failed (docs/benchmarks.md, "Concurrent creates"; sandbox.c, vm_start_take).
	 */
	sem_t vm_starts;
	pthread_mutex_t reg_lock;	/* the registry below and the capacity in use */
	struct sandbox *sandboxes;
	unsigned used_vcpu_milli, used_mem_mib, count;
	long long pause_reserved;	/* bytes of snapshot space pauses in progress have claimed */
	/* bytes execs' output buffers hold or have claimed, at most node_exec_memory_max (routes.c) */
	_Atomic unsigned long long exec_mem_used;
	volatile bool stopping;		/* a clean stop began: the ticker ends, the heartbeat renews
					 * only its time */
	pthread_t ticker;		/* fencing, expiries, deletes, pins (main.c) */
	struct pg *beat_pg;		/* the heartbeat's own connection (main.c) */
};

/* --- the registry (sandbox.c) --- */

/* Finds a sandbox and takes a reference; NULL when this node does not hold it. */
struct sandbox *sb_get(struct node *n, const char *id);
void sb_put(struct node *n, struct sandbox *sb);

/*
 * Reserves capacity and a network slot and adds a new sandbox (state creating, one reference
 * for the caller). KILN_E_NO_CAPACITY when the node is full; KILN_E_CONFLICT when the id exists.
 */
enum kiln_err sb_reserve(struct node *n, const char *id, const char *tenant_id,
			 unsigned vcpu_milli, unsigned mem_mib, unsigned disk_gib,
			 struct sandbox **out, struct kiln_error *err);

/* What a new sandbox starts with besides its shape. */
struct sb_init {
	const char *const *env;			/* NULL-terminated "NAME=value", or NULL */
	const struct kiln_ruleset *egress;	/* rules in force before the guest runs, or NULL */
	const struct kiln_bandwidth *bandwidth;	/* or NULL: unmetered */
};

/*
 * Boots the sandbox's VM (cold) behind its network and policy and waits for its agent. On
 * failure the caller tears down what was made (sb_teardown).
 */
enum kiln_err sb_boot(struct node *n, struct sandbox *sb, const struct sb_init *init,
		      struct kiln_error *err);

/*
 * Restores the sandbox's VM from `snap_dir` (memory taken as `from` says), bringing its network up
 * first when it has none, and waits for its agent. Every restore sets the guest's clock to now and
 * reseeds its RNG; `fresh` gives it the new identity of a new sandbox (id, host name, env).
 */
enum kiln_err sb_restore(struct node *n, struct sandbox *sb, const char *snap_dir,
			 enum vmm_mem_from from, const struct sb_init *init, bool fresh,
			 struct kiln_error *err);

/*
 * sb_restore() from the template or pause snapshot in `snap_dir` on the warm VM `w` begun on it
 * (warm.h; its memory as the begin prepared it): the sandbox takes over its uid, its TAP
 * and its VMM, which loads the state under the sandbox's names. On success `w`'s VMM is the
 * sandbox's; on failure it may still be `w`'s (a failure before the state's load). Either way the
 * caller warm_free()s what is left of `w`, before it releases the sandbox (its uid, once
 * adopted, is the warm VMM's too).
 */
enum kiln_err sb_restore_warm(struct node *n, struct sandbox *sb, const char *snap_dir,
			      struct warm_vm *w, const struct sb_init *init, bool fresh,
			      struct kiln_error *err);

/*
 * The VMM of warm VM `w` (its uid leased and namespace made) begun on the snapshot in `snap_dir`
 * (vmm_restore_begin), as a sandbox of its shape would restore it: into w->vm. A template's
 * memory is mapped privately; a pause snapshot's is copied in by the take (VMM_MEM_COPY_LATE).
 */
enum kiln_err sb_warm_begin(struct node *n, struct warm_vm *w, const char *snap_dir,
			    struct kiln_error *err);

/* Milliseconds of CLOCK_MONOTONIC, for the phase timings the node logs. */
long long sb_mono_ms(void);

/* Sets the guest's clock and entropy, and with `fresh` its id, host name and env defaults. */
enum kiln_err sb_identity(struct node *n, struct sandbox *sb, bool fresh, const char *const *env,
			  struct kiln_error *err);

/*
 * Stops the VM and frees every host resource (VM, TAP, netns, cgroup, disk layer, uid), then
 * removes the sandbox from the registry (the caller's reference stays valid until sb_put).
 * Called with sb->lock held.
 */
void sb_teardown(struct node *n, struct sandbox *sb);

/* Like sb_teardown, but the sandbox stays registered with its capacity (to try again). */
void sb_release(struct node *n, struct sandbox *sb);

/* The fence of `sb`'s record: this node, at the generation `sb` holds. */
static inline struct record_fence sb_fence(const struct node *n, const struct sandbox *sb)
{
	return (struct record_fence){ .id = sb->id, .node_id = n->cfg.node_id,
				      .generation = sb->generation };
}

/*
 * A running sandbox whose VM ended or stopped answering: state error in memory, and recorded
 * with `why` (a refused or failed record is logged; the sandbox stays in error here).
 */
void sb_failed(struct node *n, struct sandbox *sb, const char *why);

const char *sb_state_name(enum sb_state st);

/* The hash of the node's configured guest image (guest_image_hash), "unknown" when unset. */
static inline const char *node_image_hash(const struct node *n)
{
	return n->cfg.guest_image_hash[0] ? n->cfg.guest_image_hash : "unknown";
}

/* Replaces whatever error `err` holds with `code` and a new message; returns `code`. */
enum kiln_err node_error(struct kiln_error *err, enum kiln_err code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* --- the JWKS (keys.c) --- */

struct jwks_cache *jwks_new(const char *gateway_url);
void jwks_free(struct jwks_cache *k);
/* Verifies a node token for sandbox `sandbox_id`; refetches the JWKS once on an unknown kid. */
enum kiln_err jwks_verify(struct jwks_cache *k, const char *token, size_t len,
			  const char *sandbox_id, struct auth_claims *out, struct kiln_error *err);

/* --- the HTTP API (routes.c) --- */

extern const struct http_route node_routes[];
extern const size_t node_routes_len;
bool node_before(struct http_req *req, const struct http_route *route);
/*
 * The sandbox a request names, if this node holds it for the token's tenant (a reference the
 * caller sb_put()s); otherwise replies 404 and returns NULL.
 */
struct sandbox *node_request_sandbox(struct http_req *req);

#endif
