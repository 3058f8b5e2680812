/*
 * bench_meter.c - kiln-meter's cost per tick for 1, 100 and 1,000 VMs, and ledger flush
 * throughput against a plain INSERT loop, in the same run.
 *
 * Real cgroups (vmm/cgroup.h, v1 or v2 as the host has them) each holding an idle `sleep` stand
 * in for VMs; rows in `sandboxes` put them on a node of their own (one tenant per ten VMs). The
 * meter runs in this process with an injected clock that moves one second per tick, so ticks run
 * back to back; CPU time is this process's (getrusage) and Redis's own (INFO cpu), per tick.
 * Usage: bench-meter DATABASE_URL REDIS_URL [TICKS]. Needs root; removes its cgroups at the end.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "metering/meter.h"
#include "migrations/migrate.h"
#include "vmm/cgroup.h"

#define S PRICE_NS_PER_S
#define WINDOW 10

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
	double cpu = 0, wall = 0, rcpu0, worst = 0, flush_s = 0;
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
		made++;
	}
	fake_now = ((int64_t)time(NULL) + 5) * S;
	fake_now -= fake_now % (WINDOW * S);
	o.node_id = node;
	o.pin_root = NULL;	/* the real pin root: no pins there, a failed open per VM */
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
	printf("| %d | %.2f | %.2f | %.1f | %.2f | %.2f | %.1f |\n", made, cpu / ticks * 1e3,
	       (redis_cpu(rds) - rcpu0) / ticks * 1e3, wall / ticks * 1e3, worst * 1e3,
	       (double)(st1.redis_calls - st0.redis_calls) / ticks,
	       flush_s > 0 ? (double)flush_w / flush_s : 0.0);
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
		kill(vms[i].pid, SIGKILL);
		waitpid(vms[i].pid, NULL, 0);
		cg_destroy(vms[i].cg);
	}
	for (size_t k = 0; k < 4; k++)
		if (node_dirs[k][0])
			rmdir(node_dirs[k]);
	free(vms);
	snprintf(q, sizeof(q), "UPDATE sandboxes SET state = 'stopped' WHERE node_id = '%s'", node);
	sql(pg, q);
}

/* `n` single-row INSERTs into ledger_transfers in one transaction: transfers per second. */
static double insert_loop(struct pg *pg, int n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char id[64], amount[16] = "1";
	double t0;

	sql(pg, "INSERT INTO tenants (id, name) VALUES ('tn_insert_loop', 'bench') "
		"ON CONFLICT DO NOTHING;"
		"INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES "
		"('grant:insert_loop', 'tn_insert_loop', 'grant') ON CONFLICT DO NOTHING");
	if (pg_acquire(pg, &c, &err) != KILN_OK)
		exit(1);
	t0 = mono_s();
	pg_exec(c, "BEGIN", &err);
	for (int i = 0; i < n; i++) {
		snprintf(id, sizeof(id), "tx_loop_%d_%d", (int)getpid(), i);
		PGQ(c, NULL, &err,
		    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
		    "amount_ucr, tenant_id) VALUES ($1, $1, 'usage', 'grant:insert_loop', "
		    "'system:revenue', $2::bigint, 'tn_insert_loop')",
		    id, amount);
	}
	pg_exec(c, "COMMIT", &err);
	t0 = mono_s() - t0;
	pg_release(pg, c);
	return n / t0;
}

int main(int argc, char **argv)
{
	const int sizes[] = { 1, 100, 1000 };
	struct kiln_error err = { 0 };
	struct pg *pg;
	struct rds *rds;
	int applied, ticks = argc > 3 ? atoi(argv[3]) : 30;

	if (argc < 3) {
		fprintf(stderr, "usage: bench-meter DATABASE_URL REDIS_URL [TICKS]\n");
		return 2;
	}
	log_init("bench-meter", KLOG_WARN, false);
	pg = pg_new(argv[1], 2);
	rds = rds_new(argv[2], 5000);
	if (migrate_apply(pg, migrations, migrations_count, &applied, &err) != KILN_OK) {
		fprintf(stderr, "migrations: %s\n", err.msg);
		return 1;
	}
	printf("%d ticks per size, window %d s (a flush every %d ticks)\n\n", ticks, WINDOW, WINDOW);
	printf("| VMs | meter CPU ms/tick | Redis CPU ms/tick | wall ms/tick | worst tick ms | "
	       "Redis round trips/tick | flush transfers/s |\n|---|---|---|---|---|---|---|\n");
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		run_size(pg, rds, sizes[i], ticks);
	printf("\nplain INSERT loop, 1000 single-row INSERTs in one transaction: %.0f transfers/s\n",
	       insert_loop(pg, 1000));
	pg_free(pg);
	rds_free(rds);
	return 0;
}
