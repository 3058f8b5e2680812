/*
 * test_record.c - the fenced writes of a sandbox's record (record/record.h) against the real
 * Postgres of the ctest fixture "services", migrated with the real migrations (each run makes its
 * own database). A write with a stale generation, or from another node, is refused with
 * KILN_E_CONFLICT and changes nothing; the right one succeeds. So is the gateway's delete of a
 * sandbox no node holds, fenced on the generation it read.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "migrations/migrate.h"
#include "record/record.h"
#include "test.h"
#include "testdb.h"

static struct pg *pg;

/* On the scratch database (testdb.h). */
#define sql(...) testdb_sql(pg, __VA_ARGS__)
static int seq;

/* The row of sandbox `id` as one text: state|node|generation|deleted|pause_snapshot|net_index. */
static void row_of(const char *id, char *out, size_t len)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	snprintf(out, len, "(none)");
	if (pg_acquire(pg, &c, &err) != KILN_OK)
		return;
	if (PGQ(c, &res, &err,
		"SELECT state || '|' || node_id || '|' || generation || '|' || (deleted_at IS NOT NULL) "
		"|| '|' || coalesce(pause_snapshot, '-') || '|' || coalesce(net_index::text, '-') "
		"|| '|' || timeout_s FROM sandboxes WHERE id = $1",
		id) == KILN_OK &&
	    pg_res_rows(res) == 1)
		snprintf(out, len, "%s", pg_res_str(res, 0, 0));
	pg_res_free(res);
	pg_release(pg, c);
}

/* A new sandbox on node-a, recorded created and then running; its generation is returned. */
static long long new_sandbox(char *id, size_t len)
{
	struct kiln_error err = { 0 };
	long long gen = 0;
	struct record_new nw = {
		.tenant_id = "tn_rec", .node_id = "node-a", .template_name = "python",
		.vcpu_milli = 1000, .mem_mib = 256, .disk_gib = 1, .timeout_s = 300,
		.metadata = "{}", .net_index = 0,
	};

	snprintf(id, len, "sb_rec%d", ++seq);
	nw.id = id;
	nw.net_index = seq;
	CHECK_INT(record_created(pg, NULL, &nw, &gen, &err), KILN_OK);
	CHECK_INT(gen, 1);
	return gen;
}

static void test_created_twice_is_refused(void)
{
	struct kiln_error err = { 0 };
	char id[32], before[256], after[256];
	long long gen = 0;
	struct record_new nw = {
		.tenant_id = "tn_rec", .node_id = "node-b", .template_name = "other",
		.vcpu_milli = 2000, .mem_mib = 512, .disk_gib = 2, .timeout_s = 60, .net_index = 99,
	};

	new_sandbox(id, sizeof(id));
	row_of(id, before, sizeof(before));
	nw.id = id;
	CHECK_INT(record_created(pg, NULL, &nw, &gen, &err), KILN_E_CONFLICT);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, before);
}

static void test_stale_generation_is_refused_and_changes_nothing(void)
{
	struct kiln_error err = { 0 };
	char id[32], before[256], after[256], want[256];
	long long gen = new_sandbox(id, sizeof(id));
	struct record_fence stale = { .id = id, .node_id = "node-a", .generation = gen - 1 };
	struct record_fence ahead = { .id = id, .node_id = "node-a", .generation = gen + 1 };
	struct record_fence right = { .id = id, .node_id = "node-a", .generation = gen };

	CHECK_INT(record_running(pg, NULL, &right, &err), KILN_OK);
	row_of(id, before, sizeof(before));
	snprintf(want, sizeof(want), "running|node-a|1|false|-|%d|300", seq);
	CHECK_STR(before, want);
	/* every kind of write, stale or from the future: refused, nothing changed */
	CHECK_INT(record_paused(pg, NULL, &stale, "snap_x", &err), KILN_E_CONFLICT);
	CHECK_INT(record_deleted(pg, NULL, &stale, &err), KILN_E_CONFLICT);
	CHECK_INT(record_stopped(pg, NULL, &ahead, "why", &err), KILN_E_CONFLICT);
	CHECK_INT(record_failed(pg, NULL, &stale, "why", &err), KILN_E_CONFLICT);
	CHECK_INT(record_timeout(pg, NULL, &stale, 99, &err), KILN_E_CONFLICT);
	CHECK_INT(record_restored(pg, NULL, &stale, "snap_x", NULL, &err), KILN_E_CONFLICT);
	CHECK_INT(record_lineage_reset(pg, NULL, &ahead, &err), KILN_E_CONFLICT);
	CHECK_INT(record_create_failed(pg, NULL, &stale, "why", &err), KILN_E_CONFLICT);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, before);
	/* the right one succeeds */
	CHECK_INT(record_timeout(pg, NULL, &right, 99, &err), KILN_OK);
	CHECK_INT(record_paused(pg, NULL, &right, "snap_x", &err), KILN_OK);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, "paused|node-a|1|false|snap_x|-|99");
}

static void test_other_node_is_refused_and_changes_nothing(void)
{
	struct kiln_error err = { 0 };
	char id[32], child[40], before[256], after[256];
	long long gen = new_sandbox(id, sizeof(id)), cg = 0;
	struct record_fence other = { .id = id, .node_id = "node-b", .generation = gen };
	struct record_fence right = { .id = id, .node_id = "node-a", .generation = gen };

	CHECK_INT(record_running(pg, NULL, &right, &err), KILN_OK);
	row_of(id, before, sizeof(before));
	CHECK_INT(record_running(pg, NULL, &other, &err), KILN_E_CONFLICT);
	CHECK_INT(record_paused(pg, NULL, &other, "snap_y", &err), KILN_E_CONFLICT);
	CHECK_INT(record_deleted(pg, NULL, &other, &err), KILN_E_CONFLICT);
	CHECK_INT(record_stopped(pg, NULL, &other, NULL, &err), KILN_E_CONFLICT);
	snprintf(child, sizeof(child), "%s_kid", id);
	CHECK_INT(record_forked(pg, NULL, &other, child, 77, "snap_f", &cg, &err), KILN_E_CONFLICT);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, before);
	row_of(child, after, sizeof(after));
	CHECK_STR(after, "(none)");
	/* the holder forks and is restored: the generation moves on, the old one is stale */
	CHECK_INT(record_forked(pg, NULL, &right, child, 77, "snap_f", &cg, &err), KILN_OK);
	CHECK_INT(cg, 1);
	row_of(child, after, sizeof(after));
	CHECK_STR(after, "creating|node-a|1|false|-|77|300");
	CHECK_INT(record_restored(pg, NULL, &right, "snap_f", &gen, &err), KILN_OK);
	CHECK_INT(gen, 2);
	CHECK_INT(record_deleted(pg, NULL, &right, &err), KILN_E_CONFLICT);
	right.generation = gen;
	CHECK_INT(record_deleted(pg, NULL, &right, &err), KILN_OK);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, "stopped|node-a|2|true|-|-|300");
	/* a deleted record is never written again */
	CHECK_INT(record_running(pg, NULL, &right, &err), KILN_E_CONFLICT);
}

static void test_resume_is_fenced_on_the_pause(void)
{
	struct kiln_error err = { 0 };
	char id[32], before[256], after[256];
	long long gen = new_sandbox(id, sizeof(id)), g2 = 0;
	struct record_fence at_a = { .id = id, .node_id = "node-a", .generation = gen };
	struct record_resume r = { .snap = "snap_p", .node_id = "node-b", .net_index = 5,
				   .timeout_s = 120, .moved = true };
	struct record rec;

	CHECK_INT(record_running(pg, NULL, &at_a, &err), KILN_OK);
	CHECK_INT(record_paused(pg, NULL, &at_a, "snap_p", &err), KILN_OK);
	row_of(id, before, sizeof(before));
	/* wrong snapshot, stale generation, wrong previous node: refused */
	r.snap = "snap_other";
	CHECK_INT(record_resumed(pg, NULL, &at_a, &r, &g2, &err), KILN_E_CONFLICT);
	r.snap = "snap_p";
	CHECK_INT(record_resumed(pg, NULL, &(struct record_fence){ id, "node-a", gen + 1 }, &r, &g2,
				 &err), KILN_E_CONFLICT);
	CHECK_INT(record_resumed(pg, NULL, &(struct record_fence){ id, "node-b", gen }, &r, &g2, &err),
		  KILN_E_CONFLICT);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, before);
	/* the right one moves it to node-b at the next generation */
	CHECK_INT(record_resumed(pg, NULL, &at_a, &r, &g2, &err), KILN_OK);
	CHECK_INT(g2, gen + 1);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, "running|node-b|2|false|-|5|300");
	/* a second resume of the same pause loses; node-a's old fence is stale everywhere */
	CHECK_INT(record_resumed(pg, NULL, &at_a, &r, &g2, &err), KILN_E_CONFLICT);
	CHECK_INT(record_stopped(pg, NULL, &at_a, NULL, &err), KILN_E_CONFLICT);
	CHECK_INT(record_read(pg, id, "tn_rec", "node-b", &rec, &err), KILN_OK);
	CHECK(rec.found);
	CHECK_INT(rec.generation, 2);
	CHECK_STR(rec.state, "running");
	CHECK_INT(record_read(pg, id, "tn_rec", "node-a", &rec, &err), KILN_OK);
	CHECK(!rec.found);
}

struct seen {
	int n;
	char ids[8][64];
};

static enum kiln_err collect(const struct record *r, void *arg)
{
	struct seen *s = arg;

	if (s->n < 8)
		snprintf(s->ids[s->n++], sizeof(s->ids[0]), "%s", r->id);
	return KILN_OK;
}

static void test_delete_requests_are_listed_for_their_node(void)
{
	struct kiln_error err = { 0 };
	char id[32];
	long long gen = new_sandbox(id, sizeof(id));
	struct record_fence f = { .id = id, .node_id = "node-a", .generation = gen };
	struct seen s = { 0 };

	CHECK_INT(record_running(pg, NULL, &f, &err), KILN_OK);
	CHECK_INT(record_delete_requested(pg, NULL, id, &err), KILN_OK);
	CHECK_INT(record_each(pg, "node-a", NULL, true, collect, &s, &err), KILN_OK);
	CHECK_INT(s.n, 1);
	CHECK_STR(s.ids[0], id);
	memset(&s, 0, sizeof(s));
	CHECK_INT(record_each(pg, "node-b", NULL, true, collect, &s, &err), KILN_OK);
	CHECK_INT(s.n, 0);
	CHECK_INT(record_deleted(pg, NULL, &f, &err), KILN_OK);
	memset(&s, 0, sizeof(s));
	CHECK_INT(record_each(pg, "node-a", NULL, true, collect, &s, &err), KILN_OK);
	CHECK_INT(s.n, 0);
}

/*
 * The gateway's delete of a sandbox no node holds (record_delete_unheld, as sandbox_delete in
 * api/routes_sandboxes.c calls it with the generation it read): read at one generation, resumed
 * elsewhere since, the delete is refused and changes nothing; at the generation it is, it goes.
 */
static void test_gateway_delete_with_stale_generation_changes_nothing(void)
{
	struct kiln_error err = { 0 };
	char id[32], before[256], after[256], want[256];
	long long gen = new_sandbox(id, sizeof(id)), read_gen = gen, now_gen = 0;
	struct record_fence f = { .id = id, .node_id = "node-a", .generation = gen };
	struct record_resume r = { .snap = "snap_u", .node_id = "node-b", .net_index = 77,
				   .timeout_s = 300 };

	CHECK_INT(record_running(pg, NULL, &f, &err), KILN_OK);
	CHECK_INT(record_paused(pg, NULL, &f, "snap_u", &err), KILN_OK);
	/* the gateway read it at read_gen; node-b resumes it meanwhile */
	CHECK_INT(record_resumed(pg, NULL, &f, &r, &now_gen, &err), KILN_OK);
	CHECK_INT(now_gen, read_gen + 1);
	row_of(id, before, sizeof(before));
	snprintf(want, sizeof(want), "running|node-b|%lld|false|-|77|300", now_gen);
	CHECK_STR(before, want);
	CHECK_INT(record_delete_unheld(pg, NULL, id, read_gen, &err), KILN_E_CONFLICT);
	CHECK_INT(record_delete_unheld(pg, NULL, id, now_gen + 1, &err), KILN_E_CONFLICT);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, before);
	/* at the generation it is now: deleted, stopped, its network slot given back */
	CHECK_INT(record_delete_unheld(pg, NULL, id, now_gen, &err), KILN_OK);
	row_of(id, after, sizeof(after));
	snprintf(want, sizeof(want), "stopped|node-b|%lld|true|-|-|300", now_gen);
	CHECK_STR(after, want);
	/* once deleted, deleting again is refused too (nothing to delete) */
	CHECK_INT(record_delete_unheld(pg, NULL, id, now_gen, &err), KILN_E_CONFLICT);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, want);
}

/* A delete requested for a sandbox already deleted changes nothing (and is not an error). */
static void test_delete_request_of_a_deleted_sandbox_changes_nothing(void)
{
	struct kiln_error err = { 0 };
	char id[32], before[256], after[256];
	long long gen = new_sandbox(id, sizeof(id));
	struct record_fence f = { .id = id, .node_id = "node-a", .generation = gen };
	struct seen s = { 0 };

	CHECK_INT(record_deleted(pg, NULL, &f, &err), KILN_OK);
	row_of(id, before, sizeof(before));
	CHECK_INT(record_delete_requested(pg, NULL, id, &err), KILN_OK);
	row_of(id, after, sizeof(after));
	CHECK_STR(after, before);
	CHECK_INT(record_each(pg, "node-a", NULL, true, collect, &s, &err), KILN_OK);
	for (int i = 0; i < s.n; i++)
		CHECK(strcmp(s.ids[i], id) != 0);
}

static int64_t witness_mono;	/* the witness clock of the case below, ns */

static int64_t witness_mono_ns(void *ctx)
{
	(void)ctx;
	return witness_mono += 1000;
}

/* The sandbox's state log, each row as the SQL expression `row` gives it, in order, comma-separated,
 * into `out` ("(none)" when it cannot be read). */
static void state_log_of(const char *id, const char *row, char *out, size_t n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	char q[512];

	snprintf(out, n, "(none)");
	snprintf(q, sizeof(q), "SELECT string_agg(%s, ',' ORDER BY seq) FROM sandbox_state_log "
		 "WHERE sandbox_id = $1", row);
	CHECK_INT(pg_acquire(pg, &c, &err), KILN_OK);
	if (PGQ(c, &res, &err, q, id) == KILN_OK && pg_res_rows(res) == 1)
		snprintf(out, n, "%s", pg_res_str(res, 0, 0));
	pg_res_free(res);
	pg_release(pg, c);
}

/*
 * The state changes recorded by a process that set its witness clock (kiln-node) are logged with
 * its boot id and monotonic time (migrations/0051), the log rows record/ writes itself too (the
 * vCPU stop); a later change by a process with none (the gateway's delete) is logged with none,
 * not with the witness the node's last change left on the row.
 */
static void test_changes_are_logged_with_their_writers_witness_only(void)
{
	struct kiln_error err = { 0 };
	char id[32], log[512];
	long long gen, now_gen = 0;
	struct record_fence f = { .node_id = "node-a" };
	struct record_resume r = { .snap = "snap_w", .node_id = "node-b", .net_index = 78,
				   .timeout_s = 300 };

	record_witness_clock("boot-rec", witness_mono_ns, NULL);
	gen = new_sandbox(id, sizeof(id));				/* 1000 */
	f.id = id;
	f.generation = gen;
	CHECK_INT(record_running(pg, NULL, &f, &err), KILN_OK);		/* 2000 */
	/* stopped after the start's instant (Postgres's now()) */
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, ((long long)time(NULL) + 1) * 1000000000LL, 5,
				       &err), KILN_OK);			/* 3000 */
	CHECK_INT(record_paused(pg, NULL, &f, "snap_w", &err), KILN_OK);	/* the stop's row */
	CHECK_INT(record_resumed(pg, NULL, &f, &r, &now_gen, &err), KILN_OK);	/* 5000 */
	record_witness_clock(NULL, NULL, NULL);			/* the gateway: no clock */
	CHECK_INT(record_delete_unheld(pg, NULL, id, now_gen, &err), KILN_OK);
	state_log_of(id, "state || ':' || coalesce(boot_id, '-') || ':' || "
			 "coalesce(mono_ns::text, '-')", log, sizeof(log));
	CHECK_STR(log, "creating:boot-rec:1000,running:boot-rec:2000,paused:boot-rec:3000,"
		       "running:boot-rec:5000,deleted:-:-");
}

/*
 * A pause recorded at its vCPU stop's instant takes the stop's witness, not its own, read after
 * the snapshot was written. Its own row is logged when a row of an earlier generation stands
 * later than the stop (here generation 1's stop, stamped 10 s ahead: the node's wall clock
 * ahead of the database's, which stamps the resume).
 */
static void test_a_pause_at_its_vcpu_stop_takes_the_stops_witness(void)
{
	struct kiln_error err = { 0 };
	char id[32], log[512];
	struct record_fence f = { .node_id = "node-a" };
	struct record_resume r = { .snap = "snap_p", .node_id = "node-a", .net_index = 79,
				   .timeout_s = 300 };
	long long now_s = (long long)time(NULL), gen2 = 0;

	witness_mono = 0;
	record_witness_clock("boot-rec", witness_mono_ns, NULL);
	f.generation = new_sandbox(id, sizeof(id));			/* 1000 */
	f.id = id;
	CHECK_INT(record_running(pg, NULL, &f, &err), KILN_OK);		/* 2000 */
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, (now_s + 10) * 1000000000LL, 5, &err),
		  KILN_OK);						/* 3000 */
	CHECK_INT(record_paused(pg, NULL, &f, "snap_p", &err), KILN_OK);	/* the stop's row */
	CHECK_INT(record_resumed(pg, NULL, &f, &r, &gen2, &err), KILN_OK);	/* 5000 */
	f.generation = gen2;
	CHECK_INT(record_vcpus_stopped(pg, NULL, &f, (now_s + 2) * 1000000000LL, 6, &err),
		  KILN_OK);						/* 6000 */
	CHECK_INT(record_paused(pg, NULL, &f, "snap_q", &err), KILN_OK);	/* 7000: not taken */
	record_witness_clock(NULL, NULL, NULL);
	state_log_of(id, "state || ':' || coalesce(mono_ns::text, '-')", log, sizeof(log));
	CHECK_STR(log, "creating:1000,running:2000,paused:3000,running:5000,paused:6000,"
		       "paused:6000");
}

/*
 * The gateway's delete of a paused sandbox stamps the row's last change with the delete, as a
 * node's delete does: a meter reading the row takes a stopped sandbox's state_changed_at as its
 * end, and with the pause's time there it billed the snapshot only to its last point before the
 * delete (kiln-sim `gw-delete`: seeds 1 to 3 failed, seed 2 by -5,054 µcr on a sandbox paused
 * 119 s).
 */
static void test_gateway_delete_stamps_the_rows_last_change(void)
{
	struct kiln_error err = { 0 };
	char id[32];
	struct record_fence f = { .node_id = "node-a" };

	f.generation = new_sandbox(id, sizeof(id));
	f.id = id;
	CHECK_INT(record_running(pg, NULL, &f, &err), KILN_OK);
	CHECK_INT(record_paused(pg, NULL, &f, "snap_g", &err), KILN_OK);
	/* paused an hour before the delete */
	sql("UPDATE sandboxes SET state_changed_at = now() - interval '1 hour' WHERE id = '%s'", id);
	CHECK_INT(record_delete_unheld(pg, NULL, id, f.generation, &err), KILN_OK);
	CHECK_INT(testdb_sql_int(pg, "SELECT count(*) FROM sandboxes WHERE id = '%s' AND "
				 "state = 'stopped' AND state_changed_at = deleted_at", id), 1);
}

int main(void)
{
	struct testdb db;
	int rc;

	log_init("test_node_record", KLOG_WARN, false);
	if (testdb_open(&db, "record") != 0)
		return 1;
	pg = db.pg;
	sql("INSERT INTO tenants (id, name) VALUES ('tn_rec', 'test')");
	sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
	    "accelerator, image_hash) VALUES ('node-a', 'unix:/a', 8000, 8192, 10, 'qemu', 'tcg', 'x'), "
	    "('node-b', 'unix:/b', 8000, 8192, 10, 'qemu', 'tcg', 'x')");

	TEST(test_created_twice_is_refused);
	TEST(test_stale_generation_is_refused_and_changes_nothing);
	TEST(test_other_node_is_refused_and_changes_nothing);
	TEST(test_resume_is_fenced_on_the_pause);
	TEST(test_delete_requests_are_listed_for_their_node);
	TEST(test_gateway_delete_with_stale_generation_changes_nothing);
	TEST(test_delete_request_of_a_deleted_sandbox_changes_nothing);
	TEST(test_changes_are_logged_with_their_writers_witness_only);
	TEST(test_a_pause_at_its_vcpu_stop_takes_the_stops_witness);
	TEST(test_gateway_delete_stamps_the_rows_last_change);

	rc = test_summary();
	testdb_close(&db);
	return rc;
}
