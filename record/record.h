/*
 * record.h - a sandbox's record in Postgres (the `sandboxes` row): the only code in the whole
 * code base that writes that table (unit_layout holds every other source file to it).
 *
 * kiln-node writes a sandbox's state through it, and so does kiln-gateway for the two things it
 * records itself (a delete requested while the node is down, and the delete of a sandbox no node
 * holds). It is a library of its own (kiln_record: common and libpq only), so that the gateway
 * links it without kiln-node. Every write of kiln-node's is fenced: it changes the row only while
 * the row is this node's (`node_id`), at the generation the writer holds, and not deleted;
 * otherwise it changes nothing and returns KILN_E_CONFLICT (another node or a later generation
 * owns the sandbox now). The gateway's delete is fenced on the generation it read. The inserts are fenced by the id (a row of that id
 * exists: KILN_E_CONFLICT), and a resume, which moves the sandbox to this node, by the node and
 * generation it was paused at. Callers must handle every result: a write that did not happen is
 * never a success.
 *
 * Each function takes the pool and, optionally, a connection `tx` inside the caller's transaction
 * (NULL: the write takes a connection of its own). KILN_E_UNAVAILABLE when Postgres cannot be
 * reached.
 */
#ifndef KILN_RECORD_H
#define KILN_RECORD_H

#include <stdbool.h>
#include <stdint.h>

#include "common/err.h"
#include "common/pg.h"

/*
 * The clock this process witnesses the state changes it records with: its host's boot id (the
 * epoch of its CLOCK_MONOTONIC) and `mono_ns`, that clock's time (ns). Each change is logged
 * with both, read when it is recorded, next to its wall-clock time (sandbox_state_log,
 * migrations/0051), so a meter on the same boot places it on its own clock exactly, whatever
 * steps the wall clock took (docs/metering.md, Clocks). Set before the writes it witnesses:
 * kiln-node its host's, once at start; kiln-sim, before each write, the simulated host's of the
 * node writing (the boot id is copied). A process that sets none (kiln-gateway:
 * not the node's clock) records its changes with no witness, and so do record_delete_unheld()
 * and every writer outside this file.
 */
void record_witness_clock(const char *boot_id, int64_t (*mono_ns)(void *ctx), void *ctx);

/* Who writes: sandbox `id`, held by node `node_id` at `generation`. */
struct record_fence {
	const char *id;
	const char *node_id;
	long long generation;
};

/* A new sandbox's row (state creating, generation 1). */
struct record_new {
	const char *id;
	const char *tenant_id;
	const char *node_id;
	const char *template_name;
	unsigned vcpu_milli, mem_mib, disk_gib;
	long long timeout_s;
	const char *metadata;		/* JSON object text */
	int net_index;
	const char *lineage_of;		/* a snapshot whose lineage (and itself) it stands on, or NULL */
};

/* Records a new sandbox, state creating; *generation gets its generation (1). */
enum kiln_err record_created(struct pg *pg, struct pg_conn *tx, const struct record_new *nw,
			     long long *generation, struct kiln_error *err);

/*
 * Records `child_id`, a fork of the parent `parent` (fenced on the parent) taken at snapshot
 * `snap`: the parent's shape, tenant and settings, state creating, network slot `net_index`.
 */
enum kiln_err record_forked(struct pg *pg, struct pg_conn *tx, const struct record_fence *parent,
			    const char *child_id, int net_index, const char *snap,
			    long long *generation, struct kiln_error *err);

/* State running (the error text cleared). */
enum kiln_err record_running(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     struct kiln_error *err);

/* State error, with `why` kept for the API. */
enum kiln_err record_failed(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			    const char *why, struct kiln_error *err);

/* A create that failed: state error with `why`, and deleted (it never existed for the user). */
enum kiln_err record_create_failed(struct pg *pg, struct pg_conn *tx,
				   const struct record_fence *f, const char *why,
				   struct kiln_error *err);

/*
 * State paused on its complete snapshot `snap`; the network slot is given back. Its time is the
 * stop of its vCPUs when record_vcpus_stopped() logged one for this generation (and nothing
 * since), else now.
 */
enum kiln_err record_paused(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			    const char *snap, struct kiln_error *err);

/*
 * The vCPUs of running sandbox `f` stopped at `at_ns` (ns since the epoch, the node's wall clock)
 * for a pause, with its generation's cgroup CPU counter at `cpu_ns`: logged as its change to
 * paused at that instant (sandbox_state_log, migrations/0014), so the meter bills the pause from
 * the stop and leaves the CPU of writing the snapshot out. The row keeps state running until
 * record_paused(), which takes this instant as the pause's time; a pause that fails logs the
 * vCPUs going on with record_vcpus_resumed().
 */
enum kiln_err record_vcpus_stopped(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
				   long long at_ns, unsigned long long cpu_ns,
				   struct kiln_error *err);

/* The vCPUs of `f` went on at `at_ns` after a pause that failed: logged as running again. */
enum kiln_err record_vcpus_resumed(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
				   long long at_ns, struct kiln_error *err);

/* What a resume records. */
struct record_resume {
	const char *snap;	/* the pause snapshot it resumes from (fenced too) */
	const char *node_id;	/* the node it runs on now (this one) */
	int net_index;
	long long timeout_s;
	bool moved;		/* restored from the tenant's bucket: the disk lineage starts again */
};

/*
 * State running on `r->node_id` again, the generation bumped (*generation gets the new one).
 * Fenced on the node and generation it was paused at (`f`), and on still being paused on
 * `r->snap`: of two resumes, one wins.
 */
enum kiln_err record_resumed(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     const struct record_resume *r, long long *generation,
			     struct kiln_error *err);

/* A running sandbox restored on this node from its own snapshot `snap` (a fork's parent): the
 * generation bumped (*generation gets it) and `snap` added to its lineage. */
enum kiln_err record_restored(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			      const char *snap, long long *generation, struct kiln_error *err);

/* State stopped with `why` (may be NULL); the network slot is given back. */
enum kiln_err record_stopped(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     const char *why, struct kiln_error *err);

/* Deleted: state stopped, gone for the API, the network slot given back. */
enum kiln_err record_deleted(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     struct kiln_error *err);

/*
 * record_deleted() of a running sandbox with its generation's cgroup CPU counter at the deletion
 * (`cpu_ns`, read just before), logged with the deletion's row of sandbox_state_log in one
 * transaction (its own when `tx` is NULL): the meter bills the CPU up to the deletion from the
 * log, even when the VM's group is gone before it reads it again (a meter down, docs/metering.md).
 */
enum kiln_err record_deleted_cpu(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
				 unsigned long long cpu_ns, struct kiln_error *err);

/* A new timeout: `timeout_s`, expiring that long from now. */
enum kiln_err record_timeout(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     long long timeout_s, struct kiln_error *err);

/* The disk lineage emptied (a create that fell back from its template to a cold boot). */
enum kiln_err record_lineage_reset(struct pg *pg, struct pg_conn *tx,
				   const struct record_fence *f, struct kiln_error *err);

/*
 * The gateway's delete of a sandbox no node holds (its node answered 404, or it was never
 * placed): state stopped, gone for the API, the network slot given back. Fenced on the
 * generation the gateway read (`generation`) instead of a node: a sandbox resumed or moved since
 * is left as it is (KILN_E_CONFLICT).
 */
enum kiln_err record_delete_unheld(struct pg *pg, struct pg_conn *tx, const char *id,
				   long long generation, struct kiln_error *err);

/*
 * The gateway's request that the node of sandbox `id`, which is down, delete it when it comes
 * back (`delete_requested_at`, kept from the first request). Changes no state; a sandbox already
 * deleted is left as it is and the request is still KILN_OK (there is nothing left to delete).
 */
enum kiln_err record_delete_requested(struct pg *pg, struct pg_conn *tx, const char *id,
				      struct kiln_error *err);

/* A sandbox's row as the node reads it. */
struct record {
	char id[64];
	char tenant_id[64];
	char node_id[64];
	char state[16];
	char pause_snapshot[64];
	unsigned vcpu_milli, mem_mib, disk_gib;
	long long timeout_s;
	long long generation;
	bool delete_requested;	/* the gateway asked for its deletion while its node was down */
	bool found;
};

/*
 * Reads the live (not deleted) row of sandbox `id` of `tenant` (any tenant when NULL) on node
 * `node_id` (any node when NULL). out->found says whether there is one.
 */
enum kiln_err record_read(struct pg *pg, const char *id, const char *tenant, const char *node_id,
			  struct record *out, struct kiln_error *err);

/*
 * Calls fn for each live row on node `node_id` whose state is one of `states` (a Postgres array
 * text, e.g. "{running,error}"), or, with `delete_requested`, each one whose deletion the gateway
 * requested. fn's non-OK return stops the walk (and is returned).
 */
enum kiln_err record_each(struct pg *pg, const char *node_id, const char *states,
			  bool delete_requested,
			  enum kiln_err (*fn)(const struct record *r, void *arg), void *arg,
			  struct kiln_error *err);

/*
 * Marks every node whose heartbeat is older than `after_s` seconds down, and the sandboxes it
 * was running (or creating) lost with the reason node_down, billed up to its last heartbeat
 * (nodes_mark_down(), migrations/0019): one statement with row locks, so of two callers that see
 * a lapse at once one marks it. *marked (may be NULL) gets how many nodes this call marked.
 */
enum kiln_err record_nodes_down(struct pg *pg, struct pg_conn *tx, long long after_s, int *marked,
				struct kiln_error *err);

#endif
