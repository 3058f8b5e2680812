/*
 * bench_meter.c - kiln-meter's cost per tick for 1, 100 and 1,000 VMs, and ledger flush
 * throughput against bare multi-row INSERTs into the same table, in the same run.
 *
 * Real cgroups (vmm/cgroup.h, v1 or v2 as the host has them) each holding an idle `sleep` stand
 * in for VMs, each with a real pinned eBPF counters map (a per-CPU array as kiln-node pins it,
 * under a pin root of the bench's own); rows in `sandboxes` put them on a node of their own (one
 * tenant per ten VMs). The meter runs in this process with its flush thread, as kiln-meter does,
 * and an injected clock that moves one second per tick, so ticks run back to back; CPU time is
 * this process's (getrusage: the tick and the flush thread), Redis's own (INFO cpu) and
 * Postgres's (every process of its postmaster, /proc), per tick. The flush figures: one
 * meter_flush_set() of 1,000 and 10,000 windows (one transfer each, its id made here as kiln-meter
 * makes it), the meter_flush() loop it replaced, and the same number of rows as bare INSERTs of
 * 1,000 rows each, in one transaction; each size FLUSH_ROUNDS + 1 times, the three interleaved, on
 * the one connection a single-threaded caller gets from the pool: the first round (the first
 * flush of its size on that connection) apart, the median of the rest (a warm connection, as
 * kiln-meter's flush thread keeps its own).
 * Usage: bench-meter DATABASE_URL REDIS_URL [TICKS]; KILN_TEST_PGDATA names the Postgres data
 * directory (its CPU is not counted without it). Needs root; removes its cgroups and pins.
 */
#include <bpf/bpf.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "auth/apikey.h"
#include "bpf/policy.h"
#include "common/buf.h"
#include "common/log.h"
#include "metering/meter.h"
#include "migrations/migrate.h"
#include "vmm/cgroup.h"

#define S PRICE_NS_PER_S
#define WINDOW 10
#define FLUSH_ROUNDS 5	/* timed rounds of each flush size after the first */

static int64_t fake_now;

static int64_t fake_clock(void *ctx)
{
	(void)ctx;
	return fake_now;
}

static double cpu_s(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
	       (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
}

static double mono_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Redis's own CPU seconds (used_cpu_sys + used_cpu_user). */
static double redis_cpu(struct rds *r)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	double sys = 0, user = 0;

	if (RDS(r, &rep, &err, "INFO", "cpu") == KILN_OK && rep.str) {
		const char *p = strstr(rep.str, "used_cpu_sys:"), *q = strstr(rep.str, "used_cpu_user:");
		if (p)
			sys = atof(p + 13);
		if (q)
			user = atof(q + 14);
	}
	rds_reply_release(&rep);
	return sys + user;
}

/* CPU seconds of the Postgres postmaster of KILN_TEST_PGDATA and all its children; 0 without. */
static double pg_cpu(void)
{
	const char *data = getenv("KILN_TEST_PGDATA");
	char path[600], buf[1024];
	long pm = 0, hz = sysconf(_SC_CLK_TCK);
	double total = 0;
	DIR *d;
	struct dirent *e;
	FILE *f;

	if (!data)
		return 0;
	snprintf(path, sizeof(path), "%s/postmaster.pid", data);
	if (!(f = fopen(path, "r")))
		return 0;
	if (fscanf(f, "%ld", &pm) != 1)
		pm = 0;
	fclose(f);
	if (pm <= 0 || !(d = opendir("/proc")))
		return 0;
	while ((e = readdir(d))) {
		long pid = atol(e->d_name), ppid;
		unsigned long ut, st;
		char *p;
		if (pid <= 0)
			continue;
		snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
		if (!(f = fopen(path, "r")))
			continue;
		p = fgets(buf, sizeof(buf), f);
		fclose(f);
		if (!p || !(p = strrchr(buf, ')')))
			continue;
		/* after ") ": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
		if (sscanf(p + 2, "%*c %ld %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ppid, &ut,
			   &st) != 3)
			continue;
		if (pid == pm || ppid == pm)
			total += (double)(ut + st) / (double)hz;
	}
	closedir(d);
	return total;
}

/* A real pinned counters map for sandbox `sb` of `node` under `root` (as kiln-node pins it). */
static int pin_counters(const char *root, const char *node, const char *sb)
{
	char path[512];
	int fd;

	snprintf(path, sizeof(path), "%s/%s", root, node);
	mkdir(path, 0700);
	snprintf(path, sizeof(path), "%s/%s/%s", root, node, sb);
	mkdir(path, 0700);
	snprintf(path, sizeof(path), "%s/%s/%s/counters", root, node, sb);
	fd = bpf_map_create(BPF_MAP_TYPE_PERCPU_ARRAY, "counters", sizeof(uint32_t),
			    sizeof(struct np_counters), 1, NULL);
	if (fd < 0)
		return -errno;
	if (bpf_obj_pin(fd, path) < 0) {
		int e = -errno;
		close(fd);
		return e;
	}
	close(fd);
	return 0;
}

static void unpin_counters(const char *root, const char *node, const char *sb)
{
	char path[512];

	snprintf(path, sizeof(path), "%s/%s/%s/counters", root, node, sb);
	unlink(path);
	snprintf(path, sizeof(path), "%s/%s/%s", root, node, sb);
	rmdir(path);
	snprintf(path, sizeof(path), "%s/%s", root, node);
	rmdir(path);
}

static char pin_root[128];
static int history;	/* deleted sandboxes made beside each size's, a fifth of them on its node */
static char other_node[32];

static void sql(struct pg *pg, const char *q)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(pg, &c, &err) != KILN_OK || pg_exec(c, q, &err) != KILN_OK) {
		fprintf(stderr, "sql: %s\n", err.msg);
		exit(1);
	}
	pg_release(pg, c);
}

struct vm {
	struct cg *cg;
	pid_t pid;
};

static void run_size(struct pg *pg, struct rds *rds, int n, int ticks)
{
	char node[32], q[1024], node_dirs[4][512] = { "" };
	struct vm *vms = calloc((size_t)n, sizeof(*vms));
	struct meter_opts o = { 0 };
	struct kiln_error err = { 0 };
	struct meter_stats st0, st1;
	struct meter *m;
	double cpu = 0, wall = 0, rcpu0, pcpu0, worst = 0, flush_s = 0;
	uint64_t flush_w = 0, flushes = 0;
	int made = 0;

	snprintf(node, sizeof(node), "bench%d-%d", n, (int)getpid());
	snprintf(q, sizeof(q),
		 "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
		 "accelerator, image_hash) VALUES ('%s', 'unix:/none', 1000000, 1000000, 100000, "
		 "'qemu', 'tcg', '')",
		 node);
	sql(pg, q);
	for (int t = 0; t < (n + 9) / 10; t++) {
		snprintf(q, sizeof(q),
			 "INSERT INTO tenants (id, name) VALUES ('tn_%s_%d', 'bench');"
			 "INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES "
			 "('grant:%s_%d', 'tn_%s_%d', 'grant');"
			 "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
			 "amount_ucr, tenant_id) VALUES ('tx_%s_%d', 'g:%s_%d', 'grant', "
			 "'system:issuance', 'grant:%s_%d', 1000000000000, 'tn_%s_%d')",
			 node, t, node, t, node, t, node, t, node, t, node, t, node, t);
		sql(pg, q);
	}
	snprintf(q, sizeof(q),
		 "INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, "
		 "memory_mib, disk_gib, timeout_s, expires_at, state_changed_at) "
		 "SELECT 'sb_%s_' || i, 'tn_%s_' || (i / 10), '%s', 'running', 'python', 1000, 256, 10, "
		 "300, now() + interval '1 day', now() FROM generate_series(0, %d) i",
		 node, node, node, n - 1);
	sql(pg, q);
	for (int i = 0; i < n; i++) {
		struct cg_limits lim = { 0 };
		char name[64];
		pid_t pid;
		int r;

		snprintf(name, sizeof(name), "sb_%s_%d", node, i);
		if ((r = cg_create(NULL, node, name, &lim, &vms[i].cg)) < 0) {
			fprintf(stderr, "cgroup %s: %s\n", name, strerror(-r));
			break;
		}
		pid = fork();
		if (pid == 0) {
			execlp("sleep", "sleep", "3600", (char *)NULL);
			_exit(127);
		}
		vms[i].pid = pid;
		cg_attach(vms[i].cg, pid);
		if ((r = pin_counters(pin_root, node, name)) < 0)
			fprintf(stderr, "pin %s: %s\n", name, strerror(-r));
		made++;
	}
	if (history > 0) {
		/* Sandboxes deleted 20 days ago, billed to their end: a deployment's history, which the
		 * tick must not read. Their rows of the state log are removed, as a running system's
		 * trim removed them long ago (sandbox_state_log_trim(): a deleted sandbox's, once
		 * billed to its end and older than the bound); left, the measured ticks' first trim
		 * deletes them all. */
		snprintf(q, sizeof(q),
			 "INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, "
			 "memory_mib, disk_gib, timeout_s, expires_at, state_changed_at, deleted_at) "
			 "SELECT 'sb_%s_old_' || i, 'tn_%s_0', CASE WHEN i %% 5 = 0 THEN '%s' ELSE '%s' "
			 "END, 'stopped', 'python', 1000, 256, 10, 300, now() - interval '19 days', "
			 "now() - interval '20 days', now() - interval '20 days' "
			 "FROM generate_series(1, %d) i",
			 node, node, node, other_node, history);
		sql(pg, q);
		snprintf(q, sizeof(q),
			 "INSERT INTO meter_sandboxes (sandbox_id, tenant_id, node_id, generation, "
			 "state, last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine) "
			 "SELECT id, tenant_id, node_id, generation, 'none', 0, 0, 0, 0, 0 FROM sandboxes "
			 "WHERE id LIKE 'sb\\_%s\\_old\\_%%';"
			 "DELETE FROM sandbox_state_log WHERE sandbox_id LIKE 'sb\\_%s\\_old\\_%%'",
			 node, node);
		sql(pg, q);
	}
	/* Statistics of the tables just filled, as autovacuum's analyze has them within a minute of
	 * such a change on a running system: planned on an empty table's, the tick's query of the
	 * node's sandboxes is another plan. */
	sql(pg, "ANALYZE");
	fake_now = ((int64_t)time(NULL) + 5) * S;
	fake_now -= fake_now % (WINDOW * S);
	o.node_id = node;
	o.pin_root = pin_root;	/* a real pinned map per VM */
	o.flush_thread = true;
	o.window_s = WINDOW;
	o.series_s = 900;
	o.now_ns = fake_clock;
	price_card_init(&o.card, 100, 50, 2, 1);
	m = meter_new(&o, pg, rds, &err);
	if (!m || meter_start(m, &err) != KILN_OK) {
		fprintf(stderr, "meter: %s\n", err.msg);
		exit(1);
	}
	/* The first tick opens every cgroup and learns every sandbox: not counted. */
	fake_now += S;
	meter_tick(m, &err);
	meter_get_stats(m, &st0);
	rcpu0 = redis_cpu(rds);
	pcpu0 = pg_cpu();
	for (int i = 0; i < ticks; i++) {
		double c0, w0, dw;

		fake_now += S;
		c0 = cpu_s();
		w0 = mono_s();
		if (meter_tick(m, &err) != KILN_OK)
			fprintf(stderr, "tick: %s\n", err.msg);
		dw = mono_s() - w0;
		cpu += cpu_s() - c0;
		wall += dw;
		if (dw > worst)
			worst = dw;
		meter_get_stats(m, &st1);
		if (st1.flushes > flushes + st0.flushes) {
			flushes = st1.flushes - st0.flushes;
			flush_s += st1.flush_s;
			flush_w += st1.flush_windows;
		}
	}
	meter_get_stats(m, &st1);
	{
		double rc = (redis_cpu(rds) - rcpu0) / ticks, pc = (pg_cpu() - pcpu0) / ticks;
		printf("| %d | %.2f | %.2f | %.2f | %.1f %% | %.1f | %.2f | %.2f | %.1f |\n", made,
		       cpu / ticks * 1e3, rc * 1e3, pc * 1e3, (cpu / ticks + rc + pc) * 100,
		       wall / ticks * 1e3, worst * 1e3,
		       (double)(st1.redis_calls - st0.redis_calls) / ticks,
		       flush_s > 0 ? (double)flush_w / flush_s : 0.0);
	}
	fflush(stdout);
	meter_free(m);
	{
		/* The node's own directory under each controller goes once its VMs are gone. */
		static const char *const ctl[] = { "cpu", "cpuacct", "memory", "pids" };
		for (size_t k = 0; made && k < sizeof(ctl) / sizeof(ctl[0]); k++) {
			const char *d = cg_dir(vms[0].cg, ctl[k]);
			char *slash;
			if (!d)
				continue;
			snprintf(node_dirs[k], sizeof(node_dirs[k]), "%s", d);
			slash = strrchr(node_dirs[k], '/');
			if (slash)
				*slash = '\0';
		}
	}
	for (int i = 0; i < made; i++) {
		char name[64];
		kill(vms[i].pid, SIGKILL);
		waitpid(vms[i].pid, NULL, 0);
		cg_destroy(vms[i].cg);
		snprintf(name, sizeof(name), "sb_%s_%d", node, i);
		unpin_counters(pin_root, node, name);
	}
	for (size_t k = 0; k < 4; k++)
		if (node_dirs[k][0])
			rmdir(node_dirs[k]);
	free(vms);
	/* Gone and billed to their end, as the next size's meter finds them on a running system:
	 * left open, their points are points of live sandboxes no meter bills. */
	snprintf(q, sizeof(q),
		 "UPDATE sandboxes SET state = 'stopped', deleted_at = now() WHERE node_id = '%s';"
		 "UPDATE meter_sandboxes SET state = 'none' WHERE node_id = '%s'",
		 node, node);
	sql(pg, q);
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

/* The median of the `n` values at `v` (sorts them in place). */
static double median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Tenants of the flush bench: one per ten sandboxes, each with a grant that covers everything. */
static void flush_tenants(struct pg *pg, const char *tag, int ntenants)
{
	char q[1024];

	snprintf(q, sizeof(q),
		 "INSERT INTO tenants (id, name) SELECT 'tn_%s_' || i, 'bench' FROM generate_series(0, %d) i;"
		 "INSERT INTO ledger_accounts (id, tenant_id, kind) SELECT 'grant:%s_' || i, 'tn_%s_' || i, "
		 "'grant' FROM generate_series(0, %d) i;"
		 "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
		 "amount_ucr, tenant_id) SELECT 'tx_%s_' || i, 'g:%s_' || i, 'grant', 'system:issuance', "
		 "'grant:%s_' || i, 1000000000000, 'tn_%s_' || i FROM generate_series(0, %d) i",
		 tag, ntenants - 1, tag, tag, ntenants - 1, tag, tag, tag, tag, ntenants - 1);
	sql(pg, q);
}

/*
 * One flush of `n` windows (1,000 sandboxes, n / 1,000 windows each, one tenant per ten; sandboxes
 * and tenants of their own for each `round`) through `fn` (meter_flush_set or meter_flush) in one
 * transaction: transfers per second.
 */
static double flush_rate(struct pg *pg, const char *fn, int n, int round)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	struct buf j;
	char tag[48], q[128];
	int per = n / 1000 > 0 ? n / 1000 : 1, nsb = n / per;
	long long before, after;
	double t0;

	snprintf(tag, sizeof(tag), "f%s%d_%d_%d", fn + 6, n, round, (int)getpid());
	flush_tenants(pg, tag, (nsb + 9) / 10);
	/* Statistics of the tables current, as autovacuum keeps them on a running system (it
	 * analyzes a table once 50 rows and a tenth of it have changed; above). Planned
	 * while the accounts were a handful of rows, a connection's foreign-key checks keep a
	 * sequential scan of ledger_accounts until the table's statistics change, and each
	 * transfer's checks then read every account the earlier rounds made (a flush of 1,000
	 * windows against 3,000 accounts never analyzed: 2,034 sequential scans, 3.2 million rows
	 * read; index scans once analyzed). */
	sql(pg, "ANALYZE tenants, ledger_accounts, ledger_account_balances, ledger_transfers, "
		"usage_windows, meter_sandboxes");
	buf_init(&j, 256u << 20);
	buf_appends(&j, "[");
	for (int s = 0; s < nsb; s++)
		for (int w = 0; w < per; w++) {
			long long ws = 1700000000LL + 10LL * w;
			char id[AUTH_ID_MAX];

			auth_new_id("tx_", id, sizeof(id));	/* as kiln-meter's json_item() */
			buf_appendf(&j,
				    "%s{\"sb\":\"sb_%s_%d\",\"tenant\":\"tn_%s_%d\",\"node\":\"%s\","
				    "\"gen\":1,\"ws\":%lld,\"we\":%lld,\"ps\":%lld,\"pe\":%lld,"
				    "\"ucr\":%d,\"cpu\":1000,\"mem_bs\":2684354560,\"rx\":0,\"tx\":0,"
				    "\"state\":\"running\",\"t\":%lld,\"cpu_at\":%d,\"rx_at\":0,"
				    "\"tx_at\":0,\"rem\":7,\"id\":\"%s\"}",
				    j.len > 1 ? "," : "", tag, s, tag, s / 10, tag, ws, ws + 10,
				    ws * 1000000000LL, (ws + 10) * 1000000000LL, 1000 + s % 100,
				    (ws + 10) * 1000000000LL, 1000 * (w + 1), id);
		}
	buf_appends(&j, "]");
	if (pg_acquire(pg, &c, &err) != KILN_OK)
		exit(1);
	PGQ0(c, &res, &err, "SELECT count(*) FROM ledger_transfers");
	before = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	/* kiln-meter sends meter_flush_set() its items as json (migrations/0044); the loop takes jsonb */
	snprintf(q, sizeof(q), "SELECT %s($1::%s, 'bench')", fn,
		 strcmp(fn, "meter_flush_set") == 0 ? "json" : "jsonb");
	t0 = mono_s();
	if (pg_exec(c, "BEGIN", &err) != KILN_OK || PGQ(c, NULL, &err, q, j.data) != KILN_OK ||
	    pg_exec(c, "COMMIT", &err) != KILN_OK) {
		fprintf(stderr, "%s: %s\n", fn, err.msg);
		exit(1);
	}
	t0 = mono_s() - t0;
	res = NULL;
	PGQ0(c, &res, &err, "SELECT count(*) FROM ledger_transfers");
	after = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	pg_release(pg, c);
	buf_release(&j);
	if (after - before != n) {	/* a round that wrote less is no figure (medians hide it) */
		fprintf(stderr, "%s: %lld transfers written of %d\n", fn, after - before, n);
		exit(1);
	}
	return (double)(after - before) / t0;
}

/*
 * The baseline: `n` transfers into ledger_transfers (its balance trigger included) as bare
 * INSERTs of 1,000 rows each, in one transaction (ids of their own for each `round`): transfers
 * per second.
 */
static double insert_rows(struct pg *pg, int n, int round)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct buf q;
	double t0, total = 0;

	sql(pg, "INSERT INTO tenants (id, name) VALUES ('tn_insert_rows', 'bench') "
		"ON CONFLICT DO NOTHING;"
		"INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES "
		"('grant:insert_rows', 'tn_insert_rows', 'grant') ON CONFLICT DO NOTHING");
	if (pg_acquire(pg, &c, &err) != KILN_OK)
		exit(1);
	buf_init(&q, 64u << 20);
	if (pg_exec(c, "BEGIN", &err) != KILN_OK) {
		fprintf(stderr, "insert: %s\n", err.msg);
		exit(1);
	}
	for (int i = 0; i < n; i += 1000) {
		q.len = 0;
		buf_appends(&q, "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, "
				"credit_account, amount_ucr, tenant_id, sandbox_id, period_start, "
				"period_end, rate_card) VALUES ");
		for (int k = i; k < i + 1000 && k < n; k++)
			buf_appendf(&q, "%s('tx_rows_%d_%d_%d_%d', 'usage:rows_%d_%d_%d_%d', 'usage', "
					"'grant:insert_rows', 'system:revenue', %d, 'tn_insert_rows', "
					"'sb_rows', to_timestamp(1700000000), to_timestamp(1700000010), "
					"'bench')",
				    k > i ? "," : "", (int)getpid(), n, round, k, (int)getpid(), n,
				    round, k, 1000 + k % 100);
		t0 = mono_s();
		if (pg_exec(c, q.data, &err) != KILN_OK) {
			fprintf(stderr, "insert: %s\n", err.msg);
			exit(1);
		}
		total += mono_s() - t0;
	}
	t0 = mono_s();
	if (pg_exec(c, "COMMIT", &err) != KILN_OK) {
		fprintf(stderr, "insert: %s\n", err.msg);
		exit(1);
	}
	total += mono_s() - t0;
	pg_release(pg, c);
	buf_release(&q);
	return n / total;
}

int main(int argc, char **argv)
{
	const int sizes[] = { 1, 100, 1000 };
	struct kiln_error err = { 0 };
	struct pg *pg;
	struct rds *rds;
	int applied, ticks = argc > 3 ? atoi(argv[3]) : 30;
	char q[512];

	history = argc > 4 ? atoi(argv[4]) : 0;
	if (argc < 3) {
		fprintf(stderr, "usage: bench-meter DATABASE_URL REDIS_URL [TICKS [HISTORY]]\n");
		return 2;
	}
	log_init("bench-meter", KLOG_WARN, false);
	pg = pg_new(argv[1], 4);
	meter_pg_session(pg);	/* as kiln-meter's start does */
	rds = rds_new(argv[2], 5000);
	if (migrate_apply(pg, migrations, migrations_count, &applied, &err) != KILN_OK) {
		fprintf(stderr, "migrations: %s\n", err.msg);
		return 1;
	}
	sql(pg, "INSERT INTO rate_cards (version, cpu_ucr_per_cpu_s, mem_ucr_per_gib_s, "
		"disk_ucr_per_gib_s, snapshot_ucr_per_gib_s) VALUES ('bench', 100, 50, 2, 1) "
		"ON CONFLICT DO NOTHING");
	printf("flush: one transaction of N windows (one transfer each) against bare INSERTs of 1,000 "
	       "rows each into ledger_transfers, same run; the three interleaved, %d rounds after a "
	       "first: their medians (set / bare: the median of each round's ratio), then the first "
	       "round's\n\n"
	       "| windows | meter_flush_set transfers/s | meter_flush (loop) transfers/s | bare INSERTs "
	       "transfers/s | set / bare | first round: set, bare, set / bare |\n"
	       "|---|---|---|---|---|---|\n", FLUSH_ROUNDS);
	for (int n = 1000; n <= 10000; n *= 10) {
		double set[FLUSH_ROUNDS + 1], loop[FLUSH_ROUNDS + 1], bare[FLUSH_ROUNDS + 1],
		       ratio[FLUSH_ROUNDS + 1];

		for (int r = 0; r <= FLUSH_ROUNDS; r++) {
			set[r] = flush_rate(pg, "meter_flush_set", n, r);
			loop[r] = flush_rate(pg, "meter_flush", n, r);
			bare[r] = insert_rows(pg, n, r);
			ratio[r] = set[r] / bare[r];
		}
		printf("| %d | %.0f | %.0f | %.0f | %.2f | %.0f, %.0f, %.2f |\n", n,
		       median(set + 1, FLUSH_ROUNDS), median(loop + 1, FLUSH_ROUNDS),
		       median(bare + 1, FLUSH_ROUNDS), median(ratio + 1, FLUSH_ROUNDS), set[0], bare[0],
		       ratio[0]);
		fflush(stdout);
	}
	/* The flush bench's points are of sandboxes that do not exist: closed, as billed ends. */
	sql(pg, "UPDATE meter_sandboxes SET state = 'none' WHERE sandbox_id LIKE 'sb\\_f%'");
	snprintf(pin_root, sizeof(pin_root), "/sys/fs/bpf/kiln-bench-%d", (int)getpid());
	if (mkdir(pin_root, 0700) < 0) {
		fprintf(stderr, "%s: %s\n", pin_root, strerror(errno));
		return 1;
	}
	snprintf(other_node, sizeof(other_node), "bench-other-%d", (int)getpid());
	snprintf(q, sizeof(q),
		 "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
		 "accelerator, image_hash) VALUES ('%s', 'unix:/none', 1, 1, 1, 'qemu', 'tcg', '')",
		 other_node);
	sql(pg, q);
	printf("\n%d ticks per size, window %d s (a flush every %d ticks, on the flush thread)",
	       ticks, WINDOW, WINDOW);
	if (history > 0)
		printf("; beside each size's VMs, %d sandboxes deleted 20 days ago and billed to their "
		       "end (a fifth on its node, the rest on another)",
		       history);
	printf("\n\n");
	printf("| VMs | meter CPU ms/tick | Redis CPU ms/tick | Postgres CPU ms/tick | of a core | "
	       "wall ms/tick | worst tick ms | Redis round trips/tick | flush transfers/s |\n"
	       "|---|---|---|---|---|---|---|---|---|\n");
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		run_size(pg, rds, sizes[i], ticks);
	rmdir(pin_root);
	pg_free(pg);
	rds_free(rds);
	return 0;
}
