/*
 * test_clock.c - kiln-node's timers against steps of the wall clock. The process's wall clock is
 * stepped an hour forward and back around each timer (wallstep.h: every CLOCK_REALTIME, time and
 * gettimeofday read in this binary's objects and static libraries, the node's code included,
 * moves; those in shared libraries such as libpq and libcurl, and CLOCK_MONOTONIC, do not), and
 * each timer must fire when its monotonic time says: a 1 s wait ends in about 1 s, not at once
 * and not an hour later, and nothing idle is retired early by a forward step.
 *
 * The node's own code runs (kiln_node_core), on the services fixture's Postgres. Templates are
 * built by a stand-in instead of a VM (tpl_set_make_for_test): what is under test is the slot's
 * bookkeeping, the waits on it and the retirement, not the boot. Snapshot uploads go to a bucket
 * on a port of this host that refuses connections: what is under test is the wait between tries
 * and the wait for the uploads to end, not the transfer.
 */
#include <curl/curl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "testdb.h"
#include "wallstep.h"

#include "auth/apikey.h"
#include "auth/crypto.h"
#include "auth/storage.h"
#include "common/clock.h"
#include "common/fsutil.h"
#include "common/netaddr.h"
#include "node/connlog.h"
#include "node/node.h"
#include "node/storage_sync.h"
#include "node/template.h"

#define HOUR_MS 3600000LL
#define WAIT_MS 1000		/* the timers' waits in these cases */
#define SLACK_MS 1500		/* how late a wait may end on a loaded 2-core host: the faults
				 * end at once, or MAKE_MAX_MS or an hour late */
#define MAKE_MAX_MS 5000	/* a stand-in build that is never let through ends by itself */

static struct node node;

/* Steps the process's wall clock to `step_ms` off the real one, and checks that it moved. */
static void set_wall_step(long long step_ms)
{
	long long off;

	wallstep_set(step_ms);
	off = wallstep_offset_ms();
	CHECK(off >= step_ms && off <= step_ms + 100);
}

/* ---- templates ---- */

static bool make_release;	/* atomic: lets the slow stand-in's build end */

/* A template built at once. */
static enum kiln_err make_fast(struct node *n, unsigned vcpu_milli, unsigned mem_mib,
			       unsigned disk_gib, bool codeint, char *snap, struct kiln_error *err)
{
	(void)n, (void)mem_mib, (void)disk_gib, (void)codeint, (void)err;
	snprintf(snap, AUTH_ID_MAX, "snap_clock_%u", vcpu_milli);
	return KILN_OK;
}

/*
 * A template whose build runs until the case lets it end (make_release), or fails after
 * MAKE_MAX_MS of the monotonic clock: a wait that the wall clock stretched ends then, not never.
 */
static enum kiln_err make_slow(struct node *n, unsigned vcpu_milli, unsigned mem_mib,
			       unsigned disk_gib, bool codeint, char *snap, struct kiln_error *err)
{
	long long until = clock_mono_ms() + MAKE_MAX_MS;

	while (!__atomic_load_n(&make_release, __ATOMIC_RELAXED)) {
		if (clock_mono_ms() >= until)
			return kiln_error_set(err, KILN_E_INTERNAL, "not let through");
		usleep(10000);
	}
	return make_fast(n, vcpu_milli, mem_mib, disk_gib, codeint, snap, err);
}

/* Milliseconds (monotonic) a tpl_wait() of WAIT_MS took; *ready: what it returned. */
static long long timed_tpl_wait(unsigned vcpu_milli, bool *ready)
{
	long long t0 = clock_mono_ms();

	*ready = tpl_wait(&node, vcpu_milli, 512, 10, WAIT_MS);
	return clock_mono_ms() - t0;
}

/*
 * A builder's wait for its template while the template's build runs on: with the wall clock an
 * hour behind, and then an hour ahead, the wait ends after WAIT_MS of monotonic time each time,
 * neither at once (a deadline on the wall clock, already passed) nor when the build ends
 * (MAKE_MAX_MS, a deadline an hour away).
 */
static void test_tpl_wait_ends_on_the_monotonic_clock(void)
{
	long long took;
	bool ready = true;

	tpl_set_make_for_test(make_slow);
	__atomic_store_n(&make_release, false, __ATOMIC_RELAXED);

	set_wall_step(-HOUR_MS);
	took = timed_tpl_wait(2000, &ready);
	CHECK(!ready);
	CHECK(took >= WAIT_MS - 50);
	CHECK(took < WAIT_MS + SLACK_MS);

	set_wall_step(HOUR_MS);
	took = timed_tpl_wait(2000, &ready);
	CHECK(!ready);
	CHECK(took >= WAIT_MS - 50);
	CHECK(took < WAIT_MS + SLACK_MS);

	/* Once let through, the build ends the wait at once, ready. */
	set_wall_step(0);
	__atomic_store_n(&make_release, true, __ATOMIC_RELAXED);
	took = timed_tpl_wait(2000, &ready);
	CHECK(ready);
	CHECK(took < WAIT_MS);
	tpl_set_make_for_test(NULL);
}

/* Polls tpl_lookup() for the template of `vcpu_milli` until it is ready, for at most 2 s. */
static bool tpl_ready_soon(unsigned vcpu_milli)
{
	char snap[AUTH_ID_MAX];

	for (int i = 0; i < 200; i++) {
		if (tpl_lookup(&node, vcpu_milli, 512, 10, false, snap, sizeof(snap)))
			return true;
		usleep(10000);
	}
	return false;
}

/*
 * A template used a moment ago is not retired as idle for 1 s when the wall clock steps an hour
 * forward, and is retired once 1 s has passed on the monotonic clock even though the wall clock
 * stepped back an hour meanwhile.
 */
static void test_tpl_idle_retirement_on_the_monotonic_clock(void)
{
	char snap[AUTH_ID_MAX] = "";

	tpl_set_make_for_test(make_fast);
	CHECK(tpl_ready_soon(3000));	/* used now: its last use is now */

	set_wall_step(HOUR_MS);
	tpl_evict_idle(&node, 1);
	CHECK(tpl_lookup(&node, 3000, 512, 10, false, snap, sizeof(snap)));	/* kept, used again */
	CHECK_STR(snap, "snap_clock_3000");

	set_wall_step(-HOUR_MS);
	usleep((WAIT_MS + 200) * 1000);
	tpl_evict_idle(&node, 1);
	CHECK(!tpl_lookup(&node, 3000, 512, 10, false, snap, sizeof(snap)));	/* retired */

	set_wall_step(0);
	CHECK(tpl_ready_soon(3000));	/* the lookup above built it anew */
	tpl_set_make_for_test(NULL);
}

/* ---- the connection log's sweep ---- */

/* Adds a row of the connection log opened three days ago (past connlog_retention_days 1). */
static void old_connection(const char *flow_key)
{
	testdb_sql(node.pg,
		   "INSERT INTO sandbox_connections (sandbox_id, node_id, flow_key, opened_at, "
		   "last_seen_at, verdict, family, proto, dst, dst_port, src_port) VALUES "
		   "('sb_clock', 'node-clock', '%s', now() - interval '3 days', "
		   "now() - interval '3 days', 'allowed', 4, 'tcp', '10.0.0.1', 80, 40000)",
		   flow_key);
}

static long long connections(const char *flow_key)
{
	return testdb_sql_int(node.pg,
			      "SELECT count(*) FROM sandbox_connections WHERE flow_key = '%s'",
			      flow_key);
}

/*
 * The collector sweeps at its start and then once an hour of monotonic time: an old row added
 * after the first sweep is still there after passes with the wall clock an hour behind and then
 * an hour ahead (on the wall clock, the forward step would have been the hour).
 */
static void test_connlog_sweep_on_the_monotonic_clock(void)
{
	struct kiln_error err = { 0 };

	old_connection("first");
	CHECK(connlog_start(&node, &err) == KILN_OK);
	for (int i = 0; i < 500 && connections("first") != 0; i++)
		usleep(10000);
	CHECK_INT(connections("first"), 0);	/* the sweep at the start */

	old_connection("second");
	set_wall_step(-HOUR_MS);
	usleep(2 * node.cfg.connlog_interval_s * 1000000 + 300000);	/* two passes at least */
	set_wall_step(HOUR_MS);
	usleep(2 * node.cfg.connlog_interval_s * 1000000 + 300000);
	CHECK_INT(connections("second"), 1);	/* not swept again within the hour */

	set_wall_step(0);
	connlog_stop(&node);
}

/* ---- the snapshot store's waits ---- */

#define TENANT "ten_clock"
#define TRY_DELAY_MS 1000	/* between an upload's two tries */
#define IDLE_WAIT_MS 300	/* a snapstore_wait_idle() that must time out */

/*
 * A port of 127.0.0.1 that refuses connections: bound by the kernel's choice and kept bound, not
 * listening, until the caller closes *fd, so a connect gets ECONNREFUSED and no other process can
 * take the port meanwhile (closed at once, it could). 0 if none could be had.
 */
static int refusing_port(int *fd)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);

	*fd = socket(AF_INET, SOCK_STREAM, 0);
	if (*fd < 0 || bind(*fd, (struct sockaddr *)&a, sizeof(a)) != 0 ||
	    getsockname(*fd, (struct sockaddr *)&a, &len) != 0)
		return 0;
	return ntohs(a.sin_port);
}

/*
 * A snapshot of TENANT left `uploading` with its packed object staged (`.up-<id>/object.kiln`), as
 * a restart finds one: snapstore_resume_pending() queues it and its upload goes straight to the
 * bucket.
 */
static void staged_upload(const char *snap_root, const char *snap_id)
{
	char path[600];
	FILE *f;

	testdb_sql(node.pg,
		   "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, storage, status, "
		   "vcpu_milli, memory_mib, disk_gib) VALUES ('%s', '" TENANT "', 'sb_clock', "
		   "'node-clock', 'pause', 's3', 'uploading', 1000, 512, 10)",
		   snap_id);
	snprintf(path, sizeof(path), "%s/.up-%s", snap_root, snap_id);
	CHECK(mkdir(path, 0700) == 0);
	snprintf(path, sizeof(path), "%s/.up-%s/object.kiln", snap_root, snap_id);
	f = fopen(path, "w");
	CHECK(f != NULL);
	if (f) {
		fputs("a packed snapshot's bytes", f);
		fclose(f);
	}
}

/*
 * An upload that finds the bucket unreachable tries again TRY_DELAY_MS later (wait_retry), and a
 * wait for the uploads to end gives up after its own time (snapstore_wait_idle): with the wall
 * clock an hour behind, and then an hour ahead, each wait lasts its monotonic time, neither none
 * nor an hour. Two tries, then the snapshot is `failed`.
 */
static void test_snapstore_waits_on_the_monotonic_clock(void)
{
	static const long long steps[] = { -HOUR_MS, HOUR_MS };
	struct kiln_error err = { 0 };
	struct auth_master_key mk;
	struct s3_opts o = { .connect_timeout_ms = 2000 };
	struct snapstore_config cfg = { 0 };
	struct netaddr_allow *allow = NULL;
	struct s3_target t = { 0 };
	struct snapstore *s;
	struct pg_conn *c;
	char root[] = "/tmp/kiln-nodeclock-XXXXXX";
	int port_fd, port = refusing_port(&port_fd);

	CHECK(port > 0);
	CHECK(mkdtemp(root) != NULL);
	CHECK(auth_master_key_load(&mk, "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
				   64, &err) == KILN_OK);
	CHECK(netaddr_allow_parse("127.0.0.1", &allow, &err) == KILN_OK);
	testdb_sql(node.pg, "INSERT INTO tenants (id, name) VALUES ('" TENANT "', 'clock')");
	snprintf(t.endpoint, sizeof(t.endpoint), "http://127.0.0.1:%d", port);
	snprintf(t.bucket, sizeof(t.bucket), "clock");
	snprintf(t.region, sizeof(t.region), "us-east-1");
	snprintf(t.access_key_id, sizeof(t.access_key_id), "AKIDCLOCK");
	snprintf(t.secret_access_key, sizeof(t.secret_access_key), "secretclock");
	c = testdb_conn(node.pg);
	CHECK(storage_save(c, &mk, TENANT, &t, &err) == KILN_OK);
	pg_release(node.pg, c);

	o.allow = allow;
	cfg.pg = node.pg;
	cfg.mk = &mk;
	cfg.node_id = "node-clock";
	cfg.snap_root = root;
	cfg.base_image = "/nonexistent";
	cfg.workers = 1;
	cfg.upload_tries = 2;
	cfg.retry_delay_ms = TRY_DELAY_MS;
	cfg.s3 = &o;
	s = snapstore_open(&cfg, &err);
	CHECK(s != NULL);
	for (size_t i = 0; s && i < sizeof(steps) / sizeof(steps[0]); i++) {
		char snap_id[32];
		long long t0, took;

		snprintf(snap_id, sizeof(snap_id), "snap_clock_up%zu", i);
		staged_upload(root, snap_id);
		set_wall_step(steps[i]);
		t0 = clock_mono_ms();
		CHECK_INT(snapstore_resume_pending(s), 1);
		CHECK(!snapstore_wait_idle(s, IDLE_WAIT_MS));	/* the retry is still to come */
		took = clock_mono_ms() - t0;
		CHECK(took >= IDLE_WAIT_MS - 50);
		CHECK(took < IDLE_WAIT_MS + SLACK_MS);
		CHECK(snapstore_wait_idle(s, MAKE_MAX_MS));
		took = clock_mono_ms() - t0;
		CHECK(took >= TRY_DELAY_MS - 50);
		CHECK(took < TRY_DELAY_MS + SLACK_MS);
		set_wall_step(0);
		CHECK_INT(testdb_sql_int(node.pg, "SELECT count(*) FROM snapshots WHERE id = '%s' "
					 "AND status = 'failed'", snap_id), 1);
	}
	snapstore_shutdown(s);
	netaddr_allow_free(allow);
	s3_target_wipe(&t);
	auth_master_key_wipe(&mk);
	fs_remove_tree_or_warn(root);
	if (port_fd >= 0)
		close(port_fd);
}

int main(void)
{
	struct testdb db;

	if (testdb_open(&db, "nodeclock") != 0)
		return 1;
	node.pg = db.pg;
	node.cfg.node_id = "node-clock";
	node.cfg.templates = true;
	node.cfg.template_default = false;
	node.cfg.connlog_interval_s = 1;
	node.cfg.connlog_retention_days = 1;
	pthread_mutex_init(&node.reg_lock, NULL);
	curl_global_init(CURL_GLOBAL_DEFAULT);
	testdb_sql(node.pg, "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, "
		   "hypervisor, accelerator, image_hash) VALUES ('node-clock', 'unix:/nonexistent', "
		   "8000, 8192, 10, 'qemu', 'tcg', '')");
	tpl_init(&node);

	TEST(test_tpl_wait_ends_on_the_monotonic_clock);
	TEST(test_tpl_idle_retirement_on_the_monotonic_clock);
	TEST(test_connlog_sweep_on_the_monotonic_clock);
	TEST(test_snapstore_waits_on_the_monotonic_clock);

	set_wall_step(0);
	node.stopping = true;
	tpl_exit(&node);
	testdb_close(&db);
	return test_summary();
}
