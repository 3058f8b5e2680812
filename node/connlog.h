/*
 * connlog.h - the node's connection-log collector: every connlog_interval_s it drains each of its
 * sandboxes' eBPF connection logs (netpolicy/connlog.h) into Postgres `sandbox_connections`
 * (one multi-row insert of the flows opened and attempts refused, one update of the live flows'
 * byte counts, per pass), and once an hour deletes rows older than connlog_retention_days.
 * See docs/network-policy.md ("Connection log").
 */
#ifndef KILN_NODE_CONNLOG_H
#define KILN_NODE_CONNLOG_H

#include <stdint.h>

#include "common/pg.h"
#include "netpolicy/connlog.h"

struct node;
struct sandbox;

/* --- the collector (connlog.c, in kiln-node) --- */

/* Starts the collector thread. */
enum kiln_err connlog_start(struct node *n, struct kiln_error *err);

/* Runs a last pass and stops the thread (after the node's sandboxes were paused). Idempotent. */
void connlog_stop(struct node *n);

/*
 * Writes what is left of `sb`'s log (its last flows and their counts) and forgets it. Called
 * once its VM is gone and before its pins are removed (pause, delete, stop). Errors are logged.
 */
void connlog_flush(struct node *n, struct sandbox *sb);

/*
 * Queues a proxy's note on a flow of sandbox `sandbox_id` (its id, not its network id) for the
 * next pass (kiln_conn_note_fn; `arg` is the node). At most connlog_max_per_minute notes of one
 * sandbox wait at once; the rest are counted as lost (over_cap). Never blocks on Postgres.
 */
void connlog_note(void *arg, const char *sandbox_id, const struct kiln_conn_note *note);

/* --- the rows (connlog_store.c, a library of its own so tests link it alone) --- */

/* One sandbox's share of a pass. */
struct connlog_batch {
	const char *sandbox_id;
	const char *tenant_id;		/* may be "" */
	const struct kiln_conn *conns;	/* is_new: inserted; else an update of a logged flow */
	size_t n;
	uint64_t ring_full, over_cap;	/* events lost since the last pass */
	const struct kiln_conn_note *notes;	/* the proxies' notes on its flows, oldest first */
	size_t nnotes;
};

/*
 * Writes one pass to Postgres: one multi-row insert of the new rows (a row already there keeps the
 * larger counts), one update of the live flows' counts and last packet, one update of the rows the
 * proxies' notes are about (the sandbox's latest TCP row of that guest port, address and port
 * opened before the note: the checked name in dns_name, the decision in proxy_decision, a refusal
 * turning the verdict to denied, the injector's requests appended to requests), one upsert of the
 * losses. A note whose flow has no row (the row was over the cap) changes nothing.
 * `real_minus_mono_ns` turns the programs' CLOCK_MONOTONIC times into wall-clock times.
 */
enum kiln_err connlog_store(struct pg *pg, const char *node_id, const struct connlog_batch *b,
			    size_t nb, int64_t real_minus_mono_ns, struct kiln_error *err);

/*
 * Deletes rows opened more than `days` days ago, at most `batch` per statement until none are
 * left; *deleted (may be NULL) receives how many went.
 */
enum kiln_err connlog_sweep(struct pg *pg, long long days, long long batch, long long *deleted,
			    struct kiln_error *err);

#endif
