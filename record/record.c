/*
 * record.c - a sandbox's record in Postgres: the only writer of the `sandboxes` table in the code
 * base (kiln-node and kiln-gateway both write through it), every state write fenced on the node
 * and generation, or for the gateway's delete on the generation alone (record.h).
 */
#include <stdio.h>
#include <string.h>

#include "record/record.h"

/* The clock this process witnesses its state changes with (record_witness_clock()): set before
 * the writes it witnesses (kiln-node once at start, kiln-sim, single-threaded, before each). */
static struct {
	char boot[64];
	int64_t (*mono_ns)(void *ctx);
	void *ctx;
} witness_clock;

void record_witness_clock(const char *boot_id, int64_t (*mono_ns)(void *ctx), void *ctx)
{
	snprintf(witness_clock.boot, sizeof(witness_clock.boot), "%s",
		 boot_id && mono_ns ? boot_id : "");
	witness_clock.mono_ns = mono_ns;
	witness_clock.ctx = ctx;
}

/* A change's witness as statement parameters: the boot id and the monotonic time now, both NULL
 * when this process set no clock (the change is logged without one). Read just before the
 * statement is sent, while a change whose `at` is now() gets its transaction's start: recorded
 * in a caller's transaction, its witness stands later than its wall-clock time by how long that
 * transaction had run; on a connection of its own, earlier by the time to reach Postgres. */
struct witness {
	const char *boot, *mono;
	char mono_buf[24];
};

static void witness_now(struct witness *w)
{
	w->boot = NULL;
	w->mono = NULL;
	if (!witness_clock.boot[0])
		return;
	snprintf(w->mono_buf, sizeof(w->mono_buf), "%lld",
		 (long long)witness_clock.mono_ns(witness_clock.ctx));
	w->boot = witness_clock.boot;
	w->mono = w->mono_buf;
}

/* The fence every state write carries: $1 id, $2 node, $3 generation. */
#define FENCE "id = $1 AND node_id = $2 AND generation = $3::bigint AND deleted_at IS NULL"

#define NPARAMS(...) ((int)(sizeof((const char *[]){ NULL, __VA_ARGS__ }) / sizeof(const char *)) - 1)
#define PARAMS(...) (((const char *[]){ NULL, __VA_ARGS__ }) + 1)

/* A fenced write: fenced(pg, tx, what, id, &generation or NULL, err, sql, params...). */
#define FENCED(pg, tx, what, id, gen, err, sql, ...)                                              \
	fenced((pg), (tx), (what), (id), (gen), (err), (sql), NPARAMS(__VA_ARGS__), PARAMS(__VA_ARGS__))

/*
 * Runs a fenced write on `tx` or a connection of its own: KILN_E_CONFLICT (changing nothing)
 * when the fence refuses, i.e. when the statement, which must end in RETURNING, returns no row,
 * or when an insert finds the id taken. *generation (when not NULL) gets the first column of the
 * row returned.
 */
static enum kiln_err fenced(struct pg *pg, struct pg_conn *tx, const char *what, const char *id,
			    long long *generation, struct kiln_error *err, const char *sql,
			    int nparams, const char *const *params)
{
	struct pg_conn *c = tx;
	struct pg_res *res = NULL;
	enum kiln_err rc = KILN_OK;

	if (!c)
		rc = pg_acquire(pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = pg_query(c, &res, err, sql, nparams, params);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = kiln_error_set(err, KILN_E_CONFLICT,
				    "%s of \"%s\" refused: another node or generation holds it", what, id);
	if (rc == KILN_OK && generation)
		*generation = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	if (!tx)
		pg_release(pg, c);
	return rc;
}

static void fmt_ll(char *out, size_t len, long long v)
{
	snprintf(out, len, "%lld", v);
}

enum kiln_err record_created(struct pg *pg, struct pg_conn *tx, const struct record_new *nw,
			     long long *generation, struct kiln_error *err)
{
	char v[16], m[16], d[16], t[24], idx[16];
	struct witness w;

	witness_now(&w);
	snprintf(v, sizeof(v), "%u", nw->vcpu_milli);
	snprintf(m, sizeof(m), "%u", nw->mem_mib);
	snprintf(d, sizeof(d), "%u", nw->disk_gib);
	fmt_ll(t, sizeof(t), nw->timeout_s);
	snprintf(idx, sizeof(idx), "%d", nw->net_index);
	return FENCED(pg, tx, "the create", nw->id, generation, err,
		      "INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, "
		      "memory_mib, disk_gib, timeout_s, metadata, net_index, expires_at, lineage, "
		      "log_boot_id, log_mono_ns) "
		      "VALUES ($1, $2, $3, 'creating', $4, $5::int, $6::int, $7::int, $8::int, "
		      "$9::jsonb, $10::int, now() + make_interval(secs => $8::int), "
		      "coalesce((SELECT lineage || id FROM snapshots WHERE id = $11), '{}'), $12, "
		      "$13::bigint) ON CONFLICT (id) DO NOTHING RETURNING generation",
		      nw->id, nw->tenant_id, nw->node_id, nw->template_name, v, m, d, t,
		      nw->metadata ? nw->metadata : "{}", idx, nw->lineage_of, w.boot, w.mono);
}

enum kiln_err record_forked(struct pg *pg, struct pg_conn *tx, const struct record_fence *parent,
			    const char *child_id, int net_index, const char *snap,
			    long long *generation, struct kiln_error *err)
{
	char g[24], idx[16];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), parent->generation);
	snprintf(idx, sizeof(idx), "%d", net_index);
	return FENCED(pg, tx, "the fork", parent->id, generation, err,
		      "INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, "
		      "memory_mib, disk_gib, timeout_s, metadata, parent_id, net_index, lineage, "
		      "expires_at, log_boot_id, log_mono_ns) SELECT $4, tenant_id, node_id, "
		      "'creating', template, vcpu_milli, memory_mib, disk_gib, timeout_s, metadata, "
		      "id, $5::int, lineage || $6::text, now() + make_interval(secs => timeout_s), $7, "
		      "$8::bigint FROM sandboxes WHERE " FENCE " "
		      "ON CONFLICT (id) DO NOTHING RETURNING generation",
		      parent->id, parent->node_id, g, child_id, idx, snap, w.boot, w.mono);
}

enum kiln_err record_running(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the start", f->id, NULL, err,
		      "UPDATE sandboxes SET log_boot_id = $4, log_mono_ns = $5::bigint, "
		      "state = 'running', error = NULL, state_changed_at = now() "
		      "WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, w.boot, w.mono);
}

enum kiln_err record_failed(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			    const char *why, struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the failure", f->id, NULL, err,
		      "UPDATE sandboxes SET log_boot_id = $5, log_mono_ns = $6::bigint, "
		      "state = 'error', error = $4, state_changed_at = now() "
		      "WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, why, w.boot, w.mono);
}

enum kiln_err record_create_failed(struct pg *pg, struct pg_conn *tx,
				   const struct record_fence *f, const char *why,
				   struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the failed create", f->id, NULL, err,
		      "UPDATE sandboxes SET log_boot_id = $5, log_mono_ns = $6::bigint, "
		      "state = 'error', error = $4, deleted_at = now(), "
		      "net_index = NULL, state_changed_at = now() WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, why, w.boot, w.mono);
}

enum kiln_err record_paused(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			    const char *snap, struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	/* At the vCPU stop's instant, the pause takes that stop's witness too (its own, read
	 * after the snapshot was written, would stand that much late). */
	return FENCED(pg, tx, "the pause", f->id, NULL, err,
		      "UPDATE sandboxes SET state = 'paused', pause_snapshot = $4, net_index = NULL, "
		      "error = NULL, state_changed_at = coalesce(stop.at, now()), "
		      "log_boot_id = CASE WHEN stop.at IS NULL THEN $5 ELSE stop.boot_id END, "
		      "log_mono_ns = CASE WHEN stop.at IS NULL THEN $6::bigint ELSE stop.mono_ns END "
		      "FROM (SELECT 1) one LEFT JOIN (SELECT l.state, l.at, l.boot_id, l.mono_ns "
		      "FROM sandbox_state_log l WHERE l.sandbox_id = $1 AND l.generation = $3::bigint "
		      "ORDER BY l.at DESC, l.seq DESC LIMIT 1) stop ON stop.state = 'paused' "
		      "WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, snap, w.boot, w.mono);
}

enum kiln_err record_vcpus_stopped(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
				   long long at_ns, unsigned long long cpu_ns,
				   struct kiln_error *err)
{
	char g[24], at[24], cpu[24];
	struct witness w;

	/* The witness is read here, just after the caller read `at_ns`: the stop's instant on
	 * the monotonic clock, to the time between the two reads. */
	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	snprintf(at, sizeof(at), "%lld", at_ns / 1000);
	snprintf(cpu, sizeof(cpu), "%llu", cpu_ns);
	return FENCED(pg, tx, "the vCPU stop", f->id, NULL, err,
		      "INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id, "
		      "cpu_ns, boot_id, mono_ns) SELECT id, generation, 'paused', "
		      "to_timestamp($4::bigint / 1e6), node_id, $5::bigint, $6, $7::bigint "
		      "FROM sandboxes WHERE " FENCE " AND state = 'running' RETURNING seq",
		      f->id, f->node_id, g, at, cpu, w.boot, w.mono);
}

enum kiln_err record_vcpus_resumed(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
				   long long at_ns, struct kiln_error *err)
{
	char g[24], at[24];
	struct witness w;

	witness_now(&w);	/* as record_vcpus_stopped()'s */
	fmt_ll(g, sizeof(g), f->generation);
	snprintf(at, sizeof(at), "%lld", at_ns / 1000);
	return FENCED(pg, tx, "the vCPU restart", f->id, NULL, err,
		      "INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id, "
		      "boot_id, mono_ns) SELECT id, generation, 'running', "
		      "to_timestamp($4::bigint / 1e6), node_id, $5, $6::bigint "
		      "FROM sandboxes WHERE " FENCE " AND state = 'running' RETURNING seq",
		      f->id, f->node_id, g, at, w.boot, w.mono);
}

enum kiln_err record_resumed(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     const struct record_resume *r, long long *generation,
			     struct kiln_error *err)
{
	char g[24], idx[16], tmo[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	snprintf(idx, sizeof(idx), "%d", r->net_index);
	fmt_ll(tmo, sizeof(tmo), r->timeout_s);
	return FENCED(pg, tx, "the resume", f->id, generation, err,
		      "UPDATE sandboxes SET log_boot_id = $9, log_mono_ns = $10::bigint, "
		      "state = 'running', generation = generation + 1, "
		      "lineage = CASE WHEN $8::boolean THEN ARRAY[pause_snapshot] "
		      "ELSE lineage || pause_snapshot END, pause_snapshot = NULL, node_id = $5, "
		      "net_index = $6::int, expires_at = now() + make_interval(secs => $7::int), "
		      "error = NULL, state_changed_at = now() "
		      "WHERE " FENCE " AND state = 'paused' AND pause_snapshot = $4 "
		      "RETURNING generation",
		      f->id, f->node_id, g, r->snap, r->node_id, idx, tmo, r->moved ? "true" : "false",
		      w.boot, w.mono);
}

enum kiln_err record_restored(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			      const char *snap, long long *generation, struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the restore", f->id, generation, err,
		      "UPDATE sandboxes SET log_boot_id = $5, log_mono_ns = $6::bigint, "
		      "generation = generation + 1, lineage = lineage || $4::text "
		      "WHERE " FENCE " RETURNING generation",
		      f->id, f->node_id, g, snap, w.boot, w.mono);
}

enum kiln_err record_stopped(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     const char *why, struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the stop", f->id, NULL, err,
		      "UPDATE sandboxes SET log_boot_id = $5, log_mono_ns = $6::bigint, "
		      "state = 'stopped', error = $4, net_index = NULL, "
		      "state_changed_at = now() WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, why, w.boot, w.mono);
}

enum kiln_err record_deleted(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     struct kiln_error *err)
{
	char g[24];
	struct witness w;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the delete", f->id, NULL, err,
		      "UPDATE sandboxes SET log_boot_id = $4, log_mono_ns = $5::bigint, "
		      "state = 'stopped', deleted_at = now(), net_index = NULL, "
		      "state_changed_at = now() WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, w.boot, w.mono);
}

enum kiln_err record_deleted_cpu(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
				 unsigned long long cpu_ns, struct kiln_error *err)
{
	struct kiln_error ignore = { 0 };
	struct pg_conn *c = tx;
	char g[24], cpu[24];
	struct witness w;
	enum kiln_err rc = KILN_OK;

	witness_now(&w);
	fmt_ll(g, sizeof(g), f->generation);
	snprintf(cpu, sizeof(cpu), "%llu", cpu_ns);
	if (!c)
		rc = pg_acquire(pg, &c, err);
	if (rc == KILN_OK && !tx)
		rc = pg_exec(c, "BEGIN", err);
	/* The deletion's own row of the log, with the counter: the trigger then finds it logged
	 * (same generation, state and instant) and adds none. */
	if (rc == KILN_OK)
		rc = FENCED(pg, c, "the deletion's CPU counter", f->id, NULL, err,
			    "INSERT INTO sandbox_state_log (sandbox_id, generation, state, at, node_id, "
			    "cpu_ns, boot_id, mono_ns) SELECT id, generation, 'deleted', now(), "
			    "node_id, $4::bigint, $5, $6::bigint FROM sandboxes WHERE " FENCE " "
			    "RETURNING seq",
			    f->id, f->node_id, g, cpu, w.boot, w.mono);
	if (rc == KILN_OK)
		rc = record_deleted(pg, c, f, err);
	if (!tx && c) {
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		else
			pg_exec(c, "ROLLBACK", &ignore);
		pg_release(pg, c);
	}
	return rc;
}

enum kiln_err record_timeout(struct pg *pg, struct pg_conn *tx, const struct record_fence *f,
			     long long timeout_s, struct kiln_error *err)
{
	char g[24], t[24];

	fmt_ll(g, sizeof(g), f->generation);
	fmt_ll(t, sizeof(t), timeout_s);
	return FENCED(pg, tx, "the timeout", f->id, NULL, err,
		      "UPDATE sandboxes SET timeout_s = $4::int, "
		      "expires_at = now() + make_interval(secs => $4::int) WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g, t);
}

enum kiln_err record_lineage_reset(struct pg *pg, struct pg_conn *tx,
				   const struct record_fence *f, struct kiln_error *err)
{
	char g[24];

	fmt_ll(g, sizeof(g), f->generation);
	return FENCED(pg, tx, "the lineage", f->id, NULL, err,
		      "UPDATE sandboxes SET lineage = '{}' WHERE " FENCE " RETURNING id",
		      f->id, f->node_id, g);
}

enum kiln_err record_delete_unheld(struct pg *pg, struct pg_conn *tx, const char *id,
				   long long generation, struct kiln_error *err)
{
	char g[24];

	fmt_ll(g, sizeof(g), generation);
	/* state_changed_at too, as record_deleted(): a meter reading the row takes a stopped
	 * sandbox's last change as its end (row_end()); left at the pause, the paused time from
	 * the meter's last point to this delete went unbilled (kiln-sim `gw-delete`). */
	return FENCED(pg, tx, "the delete", id, NULL, err,
		      "UPDATE sandboxes SET deleted_at = now(), state = 'stopped', net_index = NULL, "
		      "state_changed_at = now() "
		      "WHERE id = $1 AND deleted_at IS NULL AND generation = $2::bigint RETURNING id",
		      id, g);
}

enum kiln_err record_delete_requested(struct pg *pg, struct pg_conn *tx, const char *id,
				      struct kiln_error *err)
{
	struct pg_conn *c = tx;
	enum kiln_err rc = KILN_OK;

	if (!c)
		rc = pg_acquire(pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, NULL, err,
		 "UPDATE sandboxes SET delete_requested_at = coalesce(delete_requested_at, now()) "
		 "WHERE id = $1 AND deleted_at IS NULL",
		 id);
	if (!tx)
		pg_release(pg, c);
	return rc;
}

enum kiln_err record_nodes_down(struct pg *pg, struct pg_conn *tx, long long after_s, int *marked,
				struct kiln_error *err)
{
	struct pg_conn *c = tx;
	struct pg_res *res = NULL;
	char after[24];
	enum kiln_err rc = KILN_OK;

	snprintf(after, sizeof(after), "%lld", after_s);
	if (!c)
		rc = pg_acquire(pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err, "SELECT * FROM nodes_mark_down($1::int)", after);
	if (rc == KILN_OK && marked)
		*marked = pg_res_rows(res);
	pg_res_free(res);
	if (!tx)
		pg_release(pg, c);
	return rc;
}

#define RECORD_COLUMNS                                                                            \
	"id, tenant_id, coalesce(node_id, ''), state, coalesce(pause_snapshot, ''), vcpu_milli, "  \
	"memory_mib, disk_gib, timeout_s, generation, delete_requested_at IS NOT NULL"

static void record_of_row(const struct pg_res *res, int i, struct record *out)
{
	memset(out, 0, sizeof(*out));
	out->found = true;
	snprintf(out->id, sizeof(out->id), "%s", pg_res_str(res, i, 0));
	snprintf(out->tenant_id, sizeof(out->tenant_id), "%s", pg_res_str(res, i, 1));
	snprintf(out->node_id, sizeof(out->node_id), "%s", pg_res_str(res, i, 2));
	snprintf(out->state, sizeof(out->state), "%s", pg_res_str(res, i, 3));
	snprintf(out->pause_snapshot, sizeof(out->pause_snapshot), "%s", pg_res_str(res, i, 4));
	out->vcpu_milli = (unsigned)pg_res_int(res, i, 5, 0);
	out->mem_mib = (unsigned)pg_res_int(res, i, 6, 0);
	out->disk_gib = (unsigned)pg_res_int(res, i, 7, 0);
	out->timeout_s = pg_res_int(res, i, 8, 300);
	out->generation = pg_res_int(res, i, 9, 0);
	out->delete_requested = pg_res_bool(res, i, 10);
}

enum kiln_err record_read(struct pg *pg, const char *id, const char *tenant, const char *node_id,
			  struct record *out, struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc = pg_acquire(pg, &c, err);

	memset(out, 0, sizeof(*out));
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT " RECORD_COLUMNS " FROM sandboxes WHERE id = $1 "
		 "AND ($2::text IS NULL OR tenant_id = $2) AND ($3::text IS NULL OR node_id = $3) "
		 "AND deleted_at IS NULL",
		 id, tenant, node_id);
	if (rc == KILN_OK && pg_res_rows(res) == 1)
		record_of_row(res, 0, out);
	pg_res_free(res);
	pg_release(pg, c);
	return rc;
}

enum kiln_err record_each(struct pg *pg, const char *node_id, const char *states,
			  bool delete_requested,
			  enum kiln_err (*fn)(const struct record *r, void *arg), void *arg,
			  struct kiln_error *err)
{
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc = pg_acquire(pg, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, &res, err,
		 "SELECT " RECORD_COLUMNS " FROM sandboxes WHERE node_id = $1 AND deleted_at IS NULL "
		 "AND (CASE WHEN $3::boolean THEN delete_requested_at IS NOT NULL "
		 "ELSE state = ANY ($2::text[]) END) ORDER BY created_at",
		 node_id, states ? states : "{}", delete_requested ? "true" : "false");
	/* the connection goes back first: fn writes records of its own */
	pg_release(pg, c);
	for (int i = 0; rc == KILN_OK && i < pg_res_rows(res); i++) {
		struct record r;

		record_of_row(res, i, &r);
		rc = fn(&r, arg);
	}
	pg_res_free(res);
	return rc;
}
