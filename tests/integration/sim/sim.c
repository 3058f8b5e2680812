/*
 * sim.c - kiln-sim: a deterministic, seeded simulation of billing (issue 14). The real meter
 * engine (metering/meter.c), ledger (metering/ledger.c, the SQL of migrations/) and sandbox record
 * (record/record.c, the only writer of `sandboxes`) run in this process on an injected clock,
 * against the real Postgres and Redis of the ctest fixture "services" (a fresh database per seed),
 * driven by a schedule drawn from the seed over simulated time:
 *
 *   sandboxes of several tenants are created, paused, resumed, forked, moved to another node (a
 *   resume there: a new generation) and deleted, every change written through record/ at its
 *   simulated instant (the database's now() is the simulation's: schema `sim`, below); each
 *   running VM's CPU counter advances in a fake cgroup v2 tree the meters read as their
 *   cgroup_root; grants (some expiring) are posted through ledger_grant() as the gateway does;
 *   pauses the meters ask for are applied through record/ a bounded time later;
 *
 * and, each switchable with --faults, meter crashes (meter_free without a flush: memory and
 * connections gone, a fresh meter later), Redis losing this run's keys, a meter's Redis or
 * Postgres unreachable for a while (meter_set_backends() to a dead address), two meters for one
 * node, steps of the wall clock, moves between nodes, and tenants running out of credits.
 *
 * After the schedule every fault is cleared, every sandbox deleted and the meters tick until all
 * is flushed; then the invariants are checked from Postgres and Redis (check_run()). The expected
 * charges come from the schedule alone, with price.h's arithmetic: each sandbox's fine units over
 * the time it spent running (memory, disk, the CPU its cgroup counted) and paused (its snapshot),
 * whole µcr taken with the remainder carried across windows and generations. A failing seed
 * prints what broke and the command that replays it; a seed always runs the same schedule.
 *
 * Usage: see usage() or docs/testing.md ("The billing simulation").
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "metering/billing.h"
#include "metering/ledger.h"
#include "metering/meter.h"
#include "metering/price.h"
#include "record/record.h"
#include "test.h"
#include "testdb.h"

#define S PRICE_NS_PER_S
#define MS (S / 1000)
#define FINE ((unsigned __int128)PRICE_FINE_PER_UCR)
#define WINDOW 10
#define T0 ((int64_t)1700000000 * S)	/* the simulation's start, true time */
#define MONO0 ((int64_t)5000 * S)
#define MAXN 4				/* nodes */
#define MAXT 8				/* tenants */
#define MAXSB 4096
#define MAXM (MAXN + 1)			/* meters: one per node, plus a second for node 0 */
#define SIM_TTL_S 30			/* meter_live_ttl_s on the simulation's clock */
#define MIN_GAP (3 * S)			/* between two changes of one sandbox */
#define CG_GRACE (2 * S)		/* a VM's cgroup outlives its end this long */
#define PAUSE_DELAY_MAX_MS 2000		/* a requested pause lands within this */
#define ZERO_BOUND_S 4			/* running at zero: a tick + the pause's delay + 1 s */
#define MAX_PROBLEMS 200		/* kept; at most 4 of each invariant printed */

enum {
	F_CRASH = 1 << 0,
	F_REDIS = 1 << 1,	/* Redis loses the run's keys */
	F_REDIS_DOWN = 1 << 2,
	F_PG = 1 << 3,		/* Postgres unreachable for a meter */
	F_TWO = 1 << 4,		/* two meters for node 0 */
	F_CLOCK = 1 << 5,	/* wall-clock steps */
	F_MOVE = 1 << 6,	/* resumes on another node */
	F_ZERO = 1 << 7,	/* tenants run out of credits */
	F_EXPIRY = 1 << 8,	/* grants that expire */
	F_LATE = 1 << 9,	/* ticks that wake late */
	F_SNAP = 1 << 10,	/* pause snapshots smaller or larger than the guest's memory */
	F_GW_DELETE = 1 << 11,	/* paused sandboxes deleted by the gateway (no witness) */
};

static const struct {
	const char *name;
	unsigned bit;
	const char *what;
} fault_names[] = {
	{ "crash", F_CRASH, "a meter crashes (no flush) and a fresh one starts 0-90 s later" },
	{ "redis", F_REDIS, "Redis loses every key of the run" },
	{ "redis-down", F_REDIS_DOWN, "a meter's Redis refuses connections for 5-120 s" },
	{ "pg", F_PG, "a meter's Postgres refuses connections for 5-120 s" },
	{ "two-meters", F_TWO, "two meters bill node 0" },
	{ "clock", F_CLOCK, "the wall clock (database and meters) steps 5 s-1 h forward or back" },
	{ "move", F_MOVE, "paused sandboxes resume on another node (a new generation there)" },
	{ "zero", F_ZERO, "small grants: tenants reach zero, are paused, get topped up" },
	{ "expiry", F_EXPIRY, "grants expiring after 1-15 min" },
	{ "late", F_LATE, "ticks that wake late (a skipped second, billed by the next tick)" },
	{ "snapsize", F_SNAP, "pause snapshots of 30-110 % of the guest's memory (else equal)" },
	{ "gw-delete", F_GW_DELETE, "half the paused sandboxes' deletions by the gateway (unwitnessed)" },
};

/*
 * Which nodes witness the changes they record (--witness): every node (on, as kiln-node since
 * migrations/0051), none (off, as before it: every change placed by the frames), or the nodes of
 * even index only (mixed, a rolling upgrade: the others' changes placed by the frames). Chosen by
 * the node's index, never drawn: a seed runs the same schedule in every mode.
 */
enum witness_mode { WITNESS_ON, WITNESS_OFF, WITNESS_MIXED };

static const char *const witness_names[] = { "on", "off", "mixed" };

/* --- options --- */

static struct {
	long steps;
	unsigned faults;
	int tenants, nodes;
	int verbose;
	bool self_test;
	enum witness_mode witness;
} opt = { .steps = 900, .faults = F_EXPIRY, .tenants = 3, .nodes = 2, .witness = WITNESS_ON };

/* --- the seeded random source (splitmix64) --- */

static uint64_t rng;

static uint64_t rnd(void)
{
	uint64_t z = (rng += 0x9e3779b97f4a7c15ULL);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static int64_t rnd_in(int64_t lo, int64_t hi)	/* [lo, hi] */
{
	return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1));
}

static bool chance(unsigned per_100k)
{
	return rnd() % 100000 < per_100k;
}

/* --- the world --- */

enum sst { SB_CREATING, SB_RUNNING, SB_PAUSED, SB_GONE };

struct genrec {
	long long gen;
	int node;			/* the node it ran on */
	unsigned __int128 cum_end;	/* fine units of the sandbox up to this generation's end */
};

struct sbx {
	char id[48];
	int ten, node;
	long long gen;
	enum sst st;
	unsigned mem, disk, vcpu, cpu_milli;
	int net;
	char snap[48];
	uint64_t snap_mib;
	int64_t changed;	/* true ns of its last change */
	int64_t boot_at;	/* creating: when it runs */
	int64_t seg;		/* model: start of the open stretch */
	unsigned __int128 cum;	/* model: fine units so far (closed stretches and CPU counted) */
	struct genrec *g;
	size_t ng;
	/* its VM's cgroup */
	uint64_t cpu_acc_ns, cpu_us;
	int64_t cpu_t;
	int64_t cg_rm_at[MAXN];	/* a finished VM's group, removed then (0: none) */
	bool cg_live;		/* the running VM's group on `node` */
	int64_t pause_at;	/* a requested pause lands then (0: none) */
	long long pause_gen;
	int64_t zero_run_since;	/* running while its tenant is at zero since (0: not) */
	int64_t zero_down_s;	/* of which seconds with no meter on its node */
	bool zero_rds;		/* some of them with a meter of the tenant without Redis */
	bool zero_reported;
};

struct smeter {
	int node;
	struct meter *m;
	struct pg *pg;
	struct rds *rds;
	int64_t down_until;	/* crashed: a fresh meter starts then (0: up) */
	int64_t pg_down_until, rds_down_until;
};

struct tenant {
	char id[48];
	long long granted, expired_seen;
	int64_t zero_since;	/* model balance at or below zero since (0: above) */
	int ngrants;
};

static struct world {
	char tag[32];
	char db[64];
	char cg_root[256];
	char conninfo[512];
	int64_t t;		/* true time, ns */
	int64_t woff;		/* wall clock - true time */
	struct pg *pg;		/* the world's: record/, grants, checks */
	struct rds *rds;
	struct pg *dead_pg;
	struct rds *dead_rds;
	struct tenant ten[MAXT];
	char node_id[MAXN][48];
	char node_boot[MAXN][64];	/* each node's host's boot id (witness_as(), meter_up()) */
	int net_next[MAXN];
	struct sbx *sb[MAXSB];
	int nsb;
	struct smeter mt[MAXM];
	int nmt;
	int64_t alive_at[MAXN];	/* last tick of the node's meter with Redis up, true ns */
	int64_t late_at[MAXN];	/* the last second a meter of the node woke late (skipped it) */
	bool alive_dropped[MAXN];
	int64_t last_on[MAXN][MAXT];	/* the last second a sandbox of the tenant was on the node */
	int64_t billed_to[MAXN];	/* the last window end a meter of the node ran at (with Postgres) */
	int64_t fault_until;	/* some fault active or its effects settling until then */
	int snaps;
	/* results */
	char problems[MAX_PROBLEMS][240];
	int nproblems;
	long windows, grants, pauses_applied, crashes, faults_applied;
	bool sim_error;
} W;

static struct testdb tdb;	/* the template database, migrated once */
static char sockdir[600];

static void problem(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void problem(const char *fmt, ...)
{
	va_list ap;

	if (W.nproblems < MAX_PROBLEMS) {
		va_start(ap, fmt);
		vsnprintf(W.problems[W.nproblems], sizeof(W.problems[0]), fmt, ap);
		va_end(ap);
	}
	W.nproblems++;
}

static void sim_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sim_fail(const char *fmt, ...)
{
	char b[300];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(b, sizeof(b), fmt, ap);
	va_end(ap);
	problem("simulation error at t=%.3f s: %s", (double)(W.t - T0) / 1e9, b);
	W.sim_error = true;
}

static int64_t wall_of(int64_t t)
{
	return t + W.woff;
}

static int64_t clk_wall(void *ctx)
{
	(void)ctx;
	return wall_of(W.t);
}

static int64_t clk_mono(void *ctx)
{
	(void)ctx;
	return W.t - T0 + MONO0;
}

/*
 * The clock node `node` witnesses the changes it records with (record_witness_clock(), process-
 * wide: set before each write): its own host's boot, on the simulated monotonic clock. Each node
 * is a host of its own, as in production, so a meter places only its own node's changes by
 * their witness and another node's by the frames; with one boot for all, every cross-node row
 * took the witness path, which production never does. A node that witnesses nothing (--witness
 * off, or mixed for odd nodes) sets no clock: its changes are logged without a witness.
 */
static void witness_as(int node)
{
	bool witnessed = opt.witness == WITNESS_ON || (opt.witness == WITNESS_MIXED && node % 2 == 0);

	if (witnessed)
		record_witness_clock(W.node_boot[node], clk_mono, NULL);
	else
		record_witness_clock(NULL, NULL, NULL);	/* its changes logged without a witness */
}

/* Runs SQL on the world's pool; false (a simulation error) when it fails. */
static bool wsql(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool wsql(const char *fmt, ...)
{
	char q[2048];
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	va_list ap;
	bool ok;

	va_start(ap, fmt);
	vsnprintf(q, sizeof(q), fmt, ap);
	va_end(ap);
	if (pg_acquire(W.pg, &c, &err) != KILN_OK) {
		sim_fail("postgres: %s", err.msg);
		return false;
	}
	ok = pg_exec(c, q, &err) == KILN_OK;
	if (!ok)
		sim_fail("%s: %s", q, err.msg);
	pg_release(W.pg, c);
	return ok;
}

/* The database's clock (sim.now(), what record/ stamps changes with) to the wall clock at t. */
static void db_clock(int64_t t)
{
	wsql("UPDATE sim.clock SET t = 'epoch'::timestamptz + %lld * interval '1 microsecond'",
	     (long long)(wall_of(t) / 1000));
}

/* --- the fake cgroup tree (v2: cpu.stat usage_usec, memory.current) --- */

static void cg_path(char *out, size_t n, int node, const char *sb)
{
	snprintf(out, n, "%s/kiln/%s/%s", W.cg_root, W.node_id[node], sb);
}

static void cg_write(int node, struct sbx *s)
{
	char p[512], f[600], txt[160];
	int fd;

	cg_path(p, sizeof(p), node, s->id);
	snprintf(f, sizeof(f), "%s/cpu.stat", p);
	snprintf(txt, sizeof(txt), "usage_usec %" PRIu64 "\nuser_usec %" PRIu64
		 "\nsystem_usec 0\n", s->cpu_us, s->cpu_us);
	fd = open(f, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || write(fd, txt, strlen(txt)) < 0)
		sim_fail("cannot write %s: %s", f, strerror(errno));
	if (fd >= 0)
		close(fd);
}

static void cg_make(int node, struct sbx *s)
{
	char p[512], f[600];
	FILE *fp;

	cg_path(p, sizeof(p), node, s->id);
	mkdir(p, 0755);
	snprintf(f, sizeof(f), "%s/memory.current", p);
	fp = fopen(f, "w");
	if (fp) {
		fprintf(fp, "%llu\n", (unsigned long long)s->mem << 20);
		fclose(fp);
	}
	s->cpu_us = s->cpu_acc_ns = 0;
	s->cpu_t = W.t;
	s->cg_live = true;
	s->cg_rm_at[node] = 0;
	cg_write(node, s);
}

static void cg_remove(int node, struct sbx *s)
{
	char p[512], f[600];

	cg_path(p, sizeof(p), node, s->id);
	snprintf(f, sizeof(f), "%s/cpu.stat", p);
	unlink(f);
	snprintf(f, sizeof(f), "%s/memory.current", p);
	unlink(f);
	rmdir(p);
	s->cg_rm_at[node] = 0;
}

/* --- the model: what each sandbox must be charged --- */

static struct rate_card card;

/* The open stretch of `s` up to `te`, in fine units (not counted yet). */
static unsigned __int128 model_open(const struct sbx *s, int64_t te)
{
	struct price_usage u = { .mem_mib = s->mem, .disk_gib = s->disk, .snap_mib = s->snap_mib };

	if (te <= s->seg)
		return 0;
	if (s->st == SB_RUNNING)
		u.run_ns = (uint64_t)(te - s->seg);
	else if (s->st == SB_PAUSED)
		u.paused_ns = (uint64_t)(te - s->seg);
	else
		return 0;
	return price_fine(&card, &u);
}

static void model_close(struct sbx *s, int64_t te)
{
	s->cum += model_open(s, te);
	s->seg = te;
}

/* The CPU the running VM of `s` used up to t, into its cgroup and the model. */
static void cpu_advance(struct sbx *s, int64_t t)
{
	struct price_usage u = { 0 };
	uint64_t us;

	if (s->st != SB_RUNNING || !s->cg_live || t <= s->cpu_t)
		return;
	s->cpu_acc_ns += (uint64_t)(t - s->cpu_t) * s->cpu_milli / 1000;
	s->cpu_t = t;
	us = s->cpu_acc_ns / 1000;
	if (us == s->cpu_us)
		return;
	u.cpu_ns = (us - s->cpu_us) * 1000;
	s->cum += price_fine(&card, &u);
	s->cpu_us = us;
	cg_write(s->node, s);
}

static void gen_end(struct sbx *s)
{
	struct genrec *g = realloc(s->g, (s->ng + 1) * sizeof(*g));

	if (!g) {
		sim_fail("out of memory");
		return;
	}
	s->g = g;
	s->g[s->ng].gen = s->gen;
	s->g[s->ng].node = s->node;
	s->g[s->ng].cum_end = s->cum;
	s->ng++;
}

/* --- the schedule's operations, each through record/ at the current true time --- */

static struct record_fence fence_of(const struct sbx *s)
{
	struct record_fence f = { .id = s->id, .node_id = W.node_id[s->node], .generation = s->gen };

	return f;
}

/* May tenant `ti` start `n` sandboxes like `s` (as the gateway asks before create, resume, fork)? */
static bool admitted(int ti, unsigned vcpu, unsigned mem)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	enum kiln_err rc;

	if (pg_acquire(W.pg, &c, &err) != KILN_OK) {
		sim_fail("postgres: %s", err.msg);
		return false;
	}
	rc = billing_admit(W.rds, c, W.ten[ti].id, 1, vcpu, mem, &err);
	pg_release(W.pg, c);
	if (rc != KILN_OK && rc != KILN_E_CREDITS && rc != KILN_E_QUOTA)
		sim_fail("billing_admit: %s", err.msg);
	return rc == KILN_OK;
}

static struct sbx *sb_new(int ti, int node)
{
	struct sbx *s;

	if (W.nsb >= MAXSB)
		return NULL;
	s = calloc(1, sizeof(*s));
	if (!s) {
		sim_fail("out of memory");
		return NULL;
	}
	snprintf(s->id, sizeof(s->id), "sb_%s_%d", W.tag, W.nsb);
	s->ten = ti;
	s->node = node;
	s->gen = 1;
	s->st = SB_CREATING;
	s->net = W.net_next[node]++;
	s->changed = W.t;
	s->seg = W.t;
	s->boot_at = W.t + rnd_in(200, 1500) * MS;
	W.sb[W.nsb++] = s;
	return s;
}

static void op_create(int ti)
{
	struct kiln_error err = { 0 };
	static const unsigned mems[] = { 256, 512, 1024, 2048 };
	unsigned mem = mems[rnd() % 4], vcpu = (unsigned)rnd_in(1, 4) * 500;
	int node = (int)(rnd() % (uint64_t)opt.nodes);
	struct sbx *s;
	struct record_new nw = { 0 };
	long long gen;

	if (!admitted(ti, vcpu, mem))
		return;
	s = sb_new(ti, node);
	if (!s)
		return;
	s->mem = mem;
	s->vcpu = vcpu;
	s->disk = (unsigned)rnd_in(1, 20);
	s->cpu_milli = (unsigned)rnd_in(0, vcpu);
	nw.id = s->id;
	nw.tenant_id = W.ten[ti].id;
	nw.node_id = W.node_id[node];
	nw.template_name = "python";
	nw.vcpu_milli = vcpu;
	nw.mem_mib = mem;
	nw.disk_gib = s->disk;
	nw.timeout_s = 86400;
	nw.metadata = "{}";
	nw.net_index = s->net;
	db_clock(W.t);
	witness_as(node);
	if (record_created(W.pg, NULL, &nw, &gen, &err) != KILN_OK)
		sim_fail("record_created %s: %s", s->id, err.msg);
	if (opt.verbose > 1)
		fprintf(stderr, "t=%.3f create %s tenant %d node %d mem %u disk %u cpu %u\n",
			(double)(W.t - T0) / 1e9, s->id, ti, node, mem, s->disk, s->cpu_milli);
}

static void op_boot(struct sbx *s)
{
	struct kiln_error err = { 0 };
	struct record_fence f = fence_of(s);

	db_clock(W.t);
	witness_as(s->node);
	if (record_running(W.pg, NULL, &f, &err) != KILN_OK)
		sim_fail("record_running %s: %s", s->id, err.msg);
	model_close(s, W.t);
	s->st = SB_RUNNING;
	s->changed = W.t;
	s->boot_at = 0;
	cg_make(s->node, s);
}

static void op_fork(struct sbx *p)
{
	struct kiln_error err = { 0 };
	struct record_fence f = fence_of(p);
	struct sbx *c;
	char snap[48];
	long long gen;

	if (!admitted(p->ten, p->vcpu, p->mem))
		return;
	c = sb_new(p->ten, p->node);
	if (!c)
		return;
	c->mem = p->mem;
	c->vcpu = p->vcpu;
	c->disk = p->disk;
	c->cpu_milli = (unsigned)rnd_in(0, p->vcpu);
	snprintf(snap, sizeof(snap), "sn_%s_%d", W.tag, W.snaps++);
	db_clock(W.t);
	witness_as(p->node);
	if (record_forked(W.pg, NULL, &f, c->id, c->net, snap, &gen, &err) != KILN_OK)
		sim_fail("record_forked %s: %s", c->id, err.msg);
	if (opt.verbose > 1)
		fprintf(stderr, "t=%.3f fork of %s: %s cpu %u\n", (double)(W.t - T0) / 1e9, p->id, c->id,
			c->cpu_milli);
}

/*
 * As node/pause.c's pause_record(), after the snapshot is written: in one transaction its row
 * (as snap_record_public(), with the generation of the sandbox's row; created_at now(), the
 * simulated instant, where the column's default is the host's clock) and the pause itself.
 */
static void pause_record(struct sbx *s, const struct record_fence *f)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char q[1024];
	enum kiln_err rc;

	snprintf(q, sizeof(q),
		 "INSERT INTO snapshots (id, tenant_id, sandbox_id, node_id, kind, size_bytes, "
		 "vcpu_milli, memory_mib, disk_gib, created_at, generation) SELECT '%s', '%s', s.id, "
		 "'%s', 'pause', %llu, %u, %u, %u, now(), s.generation FROM sandboxes s "
		 "WHERE s.id = '%s'",
		 s->snap, W.ten[s->ten].id, W.node_id[s->node], (unsigned long long)s->snap_mib << 20,
		 s->vcpu, s->mem, s->disk, s->id);
	if (pg_acquire(W.pg, &c, &err) != KILN_OK) {
		sim_fail("postgres: %s", err.msg);
		return;
	}
	witness_as(s->node);
	rc = pg_exec(c, "BEGIN", &err);
	if (rc == KILN_OK)
		rc = pg_exec(c, q, &err);
	if (rc == KILN_OK)
		rc = record_paused(W.pg, c, f, s->snap, &err);
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", &err);
	else
		pg_exec(c, "ROLLBACK", NULL);
	pg_release(W.pg, c);
	if (rc != KILN_OK)
		sim_fail("the pause of %s: %s", s->id, err.msg);
}

static void op_pause(struct sbx *s)
{
	struct kiln_error err = { 0 };
	struct record_fence f = fence_of(s);

	/* The snapshot: the guest's memory, or (snapsize) more or less what it touched. */
	s->snap_mib = s->mem;
	if (opt.faults & F_SNAP)
		s->snap_mib = (uint64_t)s->mem * (uint64_t)rnd_in(30, 110) / 100;
	snprintf(s->snap, sizeof(s->snap), "sn_%s_%d", W.tag, W.snaps++);
	db_clock(W.t);
	cpu_advance(s, W.t);
	/* As node/pause.c: the vCPUs stop first and the instant is logged with the group's CPU
	 * counter; writing the snapshot then burns the VMM's CPU (the counter moves, unbilled:
	 * not in the model). */
	witness_as(s->node);
	if (record_vcpus_stopped(W.pg, NULL, &f, wall_of(W.t), (unsigned long long)s->cpu_us * 1000,
				 &err) != KILN_OK)
		sim_fail("record_vcpus_stopped %s: %s", s->id, err.msg);
	s->cpu_us += (uint64_t)rnd_in(0, 300000);
	cg_write(s->node, s);
	pause_record(s, &f);
	model_close(s, W.t);
	s->st = SB_PAUSED;
	s->changed = W.t;
	s->cg_live = false;
	s->cg_rm_at[s->node] = W.t + CG_GRACE;
	s->pause_at = 0;
	s->zero_run_since = 0;
}

static void op_resume(struct sbx *s, bool move)
{
	struct kiln_error err = { 0 };
	struct record_fence f = fence_of(s);
	struct record_resume r = { 0 };
	int node = s->node;
	long long gen;

	if (move && opt.nodes > 1)
		node = (int)((s->node + 1 + rnd() % (uint64_t)(opt.nodes - 1)) % (uint64_t)opt.nodes);
	if (!admitted(s->ten, s->vcpu, s->mem))
		return;
	r.snap = s->snap;
	r.node_id = W.node_id[node];
	r.net_index = W.net_next[node]++;
	r.timeout_s = 86400;
	r.moved = node != s->node;
	db_clock(W.t);
	witness_as(node);	/* the node resuming it records the resume */
	if (record_resumed(W.pg, NULL, &f, &r, &gen, &err) != KILN_OK) {
		sim_fail("record_resumed %s: %s", s->id, err.msg);
		return;
	}
	model_close(s, W.t);
	gen_end(s);
	if (s->cg_rm_at[node])
		cg_remove(node, s);	/* the old VM's group, if still there, goes first */
	s->gen = gen;
	s->node = node;
	s->st = SB_RUNNING;
	s->changed = W.t;
	s->snap[0] = '\0';
	s->snap_mib = 0;
	cg_make(node, s);
}

static void op_delete(struct sbx *s)
{
	struct kiln_error err = { 0 };
	struct record_fence f = fence_of(s);

	db_clock(W.t);
	cpu_advance(s, W.t);
	/* As node/routes.c: a running VM's deletion is logged with its group's CPU counter. */
	witness_as(s->node);
	if (s->st == SB_RUNNING ? record_deleted_cpu(W.pg, NULL, &f,
						     (unsigned long long)s->cpu_us * 1000, &err) != KILN_OK
				: record_deleted(W.pg, NULL, &f, &err) != KILN_OK)
		sim_fail("record_deleted %s: %s", s->id, err.msg);
	model_close(s, W.t);
	gen_end(s);
	if (s->cg_live)
		s->cg_rm_at[s->node] = W.t + CG_GRACE;
	s->cg_live = false;
	s->st = SB_GONE;
	s->changed = W.t;
	s->pause_at = 0;
}

/*
 * gw-delete: a paused sandbox deleted by kiln-gateway, as when no node holds it
 * (api/routes_sandboxes.c, record_delete_unheld()): fenced on the generation alone and logged
 * with no witness, whatever --witness says, so its meter places it by the frames.
 */
static void op_delete_unheld(struct sbx *s)
{
	struct kiln_error err = { 0 };

	db_clock(W.t);
	if (record_delete_unheld(W.pg, NULL, s->id, s->gen, &err) != KILN_OK)
		sim_fail("record_delete_unheld %s: %s", s->id, err.msg);
	model_close(s, W.t);
	gen_end(s);
	s->st = SB_GONE;
	s->changed = W.t;
	s->pause_at = 0;
	W.faults_applied++;
}

static void op_grant(int ti, long long ucr, int64_t expires_in)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char tx[LEDGER_TX_ID_MAX], key[96], exp[40] = "";
	const char *t = W.ten[ti].id;
	int replayed = 0;
	enum kiln_err rc;

	if (expires_in) {
		time_t e = (time_t)((wall_of(W.t) + expires_in) / S);
		struct tm tm;
		gmtime_r(&e, &tm);
		strftime(exp, sizeof(exp), "%Y-%m-%dT%H:%M:%SZ", &tm);
	}
	snprintf(key, sizeof(key), "grant:%s:%d", t, W.ten[ti].ngrants++);
	db_clock(W.t);
	if (pg_acquire(W.pg, &c, &err) != KILN_OK) {
		sim_fail("postgres: %s", err.msg);
		return;
	}
	rc = pg_exec(c, "BEGIN", &err);
	if (rc == KILN_OK)
		rc = ledger_grant(c, t, ucr, exp[0] ? exp : NULL, key, "sim", tx, &replayed, &err);
	if (rc == KILN_OK)
		rc = pg_exec(c, "COMMIT", &err);
	if (rc == KILN_OK)	/* as POST /v1/billing/grants: Redis re-reads the ledger at once */
		rc = billing_sync(W.rds, c, 1, &t, NULL, NULL, &err);
	pg_release(W.pg, c);
	if (rc != KILN_OK)
		sim_fail("grant to %s: %s", t, err.msg);
	W.ten[ti].granted += ucr;
	W.grants++;
}

/* --- meters --- */

static void on_pause(void *ctx, const char *sandbox_id, const char *tenant_id)
{
	(void)ctx;
	(void)tenant_id;
	for (int i = 0; i < W.nsb; i++) {
		struct sbx *s = W.sb[i];
		if (strcmp(s->id, sandbox_id) != 0)
			continue;
		if (opt.verbose > 1)
			fprintf(stderr, "t=%.3f pause asked for %s (%s)\n", (double)(W.t - T0) / 1e9,
				s->id, s->st == SB_RUNNING ? "running" : "not running");
		if (s->st == SB_RUNNING && !s->pause_at) {
			s->pause_at = W.t + rnd_in(100, PAUSE_DELAY_MAX_MS) * MS;
			s->pause_gen = s->gen;
		}
		return;
	}
}

static void meter_up(struct smeter *sm)
{
	struct kiln_error err = { 0 };
	struct meter_opts o = {
		.node_id = W.node_id[sm->node],
		.cgroup_root = W.cg_root,
		.pin_root = "",
		.window_s = WINDOW,
		.series_s = 120,
		.now_ns = clk_wall,
		.mono_ns = clk_mono,
		/* Its node's host: the monotonic clock goes on across a meter's crash and
		 * restart. */
		.boot_id = W.node_boot[sm->node],
		/* Redis's own clock would expire the alive keys in real seconds: the simulation
		 * drops them itself after SIM_TTL_S of its time. */
		.live_ttl_s = 3600,
		.plan_max_sandboxes = 100000,
		.plan_max_vcpu_milli = 100000000,
		.plan_max_memory_mib = 100000000,
		.plan_max_snapshot_bytes = 1LL << 50,
		.pause = on_pause,
		.pause_ctx = sm,
		.card = card,
	};

	sm->m = meter_new(&o, sm->pg, sm->rds, &err);
	if (!sm->m) {
		sim_fail("meter_new: %s", err.msg);
		return;
	}
	meter_set_backends(sm->m, sm->pg_down_until ? W.dead_pg : sm->pg,
			   sm->rds_down_until ? W.dead_rds : sm->rds);
	/* meter_tick() starts it (and retries the start while Postgres or Redis is away). */
	sm->down_until = 0;
}

static void meter_crash(struct smeter *sm, int64_t down_ns)
{
	meter_free(sm->m);	/* no flush: its memory and pending charges are gone */
	sm->m = NULL;
	sm->down_until = W.t + (down_ns > 0 ? down_ns : 1);
	W.crashes++;
}

/* Whether a meter of `node` runs with its Postgres (without it no tick reads a balance's
 * sandboxes, so none can ask for a pause). */
static bool node_meter_running(int node)
{
	for (int i = 0; i < W.nmt; i++)
		if (W.mt[i].node == node && W.mt[i].m && !W.mt[i].pg_down_until)
			return true;
	return false;
}

/* Deletes every key of the run in Redis (what FLUSHALL does to it; other tests share Redis). */
static void redis_lose(void)
{
	struct kiln_error err = { 0 };
	struct rds_reply rep = { 0 };
	char pat[64];

	snprintf(pat, sizeof(pat), "*_%s_*", W.tag);
	if (RDS(W.rds, &rep, &err, "KEYS", pat) != KILN_OK || rep.type != RDS_ARRAY) {
		sim_fail("redis KEYS: %s", err.msg);
		rds_reply_release(&rep);
		return;
	}
	for (size_t i = 0; i < rep.n; i++) {
		struct rds_reply r2 = { 0 };
		RDS(W.rds, &r2, &err, "DEL", rep.elem[i].str);
		rds_reply_release(&r2);
	}
	rds_reply_release(&rep);
}

/* --- checks --- */

static long long q_int(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static long long q_int(const char *fmt, ...)
{
	char q[2048];
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	long long v = 0;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(q, sizeof(q), fmt, ap);
	va_end(ap);
	if (pg_acquire(W.pg, &c, &err) != KILN_OK) {
		sim_fail("postgres: %s", err.msg);
		return 0;
	}
	if (PGQ0(c, &res, &err, q) == KILN_OK)
		v = pg_res_int(res, 0, 0, 0);
	else
		sim_fail("%s: %s", q, err.msg);
	pg_res_free(res);
	pg_release(W.pg, c);
	return v;
}

static long long ledger_bal(int ti)
{
	return q_int("SELECT coalesce(sum(balance_ucr), 0) FROM ledger_account_balances "
		     "WHERE tenant_id = '%s'", W.ten[ti].id);
}

/* Redis's balance of tenant ti (ledger - Σ live); *ok false without a ledger half. */
static long long redis_bal(int ti, bool *ok)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[128];
	long long ledger = 0, live = 0;

	*ok = false;
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", W.ten[ti].id);
	if (RDS(W.rds, &rep, &err, "HGETALL", key) == KILN_OK && rep.type == RDS_ARRAY) {
		for (size_t i = 0; i + 1 < rep.n; i += 2) {
			if (!strcmp(rep.elem[i].str, "ledger")) {
				ledger = atoll(rep.elem[i + 1].str);
				*ok = true;
			} else if (!strncmp(rep.elem[i].str, "live:", 5)) {
				live += atoll(rep.elem[i + 1].str);
			}
		}
	}
	rds_reply_release(&rep);
	return ledger - live;
}

/* Right after a flush, with no fault in effect: Redis = ledger - what the meters have pending. */
static void check_redis_vs_ledger(const char *when)
{
	for (int ti = 0; ti < opt.tenants; ti++) {
		long long pend = 0, led = ledger_bal(ti), rb;
		bool ok;

		for (int i = 0; i < W.nmt; i++)
			if (W.mt[i].m)
				pend += meter_pending(W.mt[i].m, W.ten[ti].id);
		rb = redis_bal(ti, &ok);
		if (!ok)
			continue;	/* not there yet: rebuilt on the next read */
		if (rb != led - pend)
			problem("redis=ledger: %s t=%.0f s: tenant %d redis balance %lld, ledger %lld "
				"less %lld pending = %lld",
				when, (double)(W.t - T0) / 1e9, ti, rb, led, pend, led - pend);
	}
}

/* The model's balance of tenant ti now: grants - expiries seen - what is due so far. */
static long long model_balance(int ti)
{
	unsigned __int128 due = 0;
	long long used = 0;

	for (int i = 0; i < W.nsb; i++) {
		const struct sbx *s = W.sb[i];
		if (s->ten != ti)
			continue;
		due = s->cum + (s->st != SB_GONE ? model_open(s, W.t) : 0);
		used += (long long)(due / FINE);
	}
	return W.ten[ti].granted - W.ten[ti].expired_seen - used;
}

/* Whether the tenant's charges on `node` may still be unflushed: it had a sandbox there within
 * the last window (a deleted or moved one's last window is flushed at the window's end), or since
 * the last window end a meter of the node ran at (one down since holds that time unbilled). */
static bool tenant_recent_on(int ti, int node)
{
	int64_t on = W.last_on[node][ti];

	return on && (W.t - on <= WINDOW * S || on >= W.billed_to[node]);
}

/*
 * Whether this second counts as one without enforcement for a running sandbox of tenant `ti` on
 * `node`: its node's meter is down (crash) or without Postgres (pg) or skipped the second (late),
 * or so is the meter of another node where the tenant has had a sandbox within the last window:
 * that node's usage reaches no other meter's balance until its meter bills again, so the
 * tenant's zero is not seen there either (docs/metering.md, "Overdraft bounds").
 */
static bool zero_unenforced(int ti, int node)
{
	for (int n = 0; n < opt.nodes; n++)
		if ((n == node || tenant_recent_on(ti, n)) &&
		    (!node_meter_running(n) || W.late_at[n] == W.t))
			return true;
	return false;
}

/*
 * Whether a meter of a node where tenant `ti` has had a sandbox within the last window runs
 * without Redis: its charges reach the other meters through the ledger only, at its next flush,
 * and it sees theirs the same way (docs/metering.md, "Overdraft bounds", Redis down: plus a
 * window and a flush).
 */
static bool zero_without_redis(int ti)
{
	for (int i = 0; i < W.nmt; i++) {
		const struct smeter *sm = &W.mt[i];
		if (sm->m && sm->rds_down_until && tenant_recent_on(ti, sm->node))
			return true;
	}
	return false;
}

/*
 * The overdraft bound (docs/metering.md): a sandbox runs at most ZERO_BOUND_S seconds while its
 * tenant is at or below zero, plus the seconds without enforcement (zero_unenforced()).
 */
static void check_zero_bound(void)
{
	for (int i = 0; i < W.nsb; i++)
		if (W.sb[i]->st != SB_GONE)
			W.last_on[W.sb[i]->node][W.sb[i]->ten] = W.t;
	if ((W.t / S) % WINDOW == 0)
		for (int n = 0; n < opt.nodes; n++)
			if (node_meter_running(n))
				W.billed_to[n] = W.t;
	for (int ti = 0; ti < opt.tenants; ti++) {
		long long b = model_balance(ti);
		struct tenant *t = &W.ten[ti];

		if (b > 0) {
			t->zero_since = 0;
			for (int i = 0; i < W.nsb; i++)
				if (W.sb[i]->ten == ti) {
					W.sb[i]->zero_run_since = 0;
					W.sb[i]->zero_reported = false;
				}
			continue;
		}
		if (!t->zero_since) {
			t->zero_since = W.t;
			if (opt.verbose > 1)
				fprintf(stderr, "t=%.3f tenant %d at zero: %lld\n",
					(double)(W.t - T0) / 1e9, ti, b);
		}
		for (int i = 0; i < W.nsb; i++) {
			struct sbx *s = W.sb[i];
			if (s->ten != ti || s->st != SB_RUNNING)
				continue;
			if (!s->zero_run_since) {
				s->zero_run_since = W.t;
				s->zero_reported = false;
				s->zero_down_s = 0;
				s->zero_rds = false;
				continue;
			}
			if (zero_unenforced(ti, s->node))
				s->zero_down_s++;
			if (zero_without_redis(ti))
				s->zero_rds = true;
			if (!s->zero_reported &&
			    W.t - s->zero_run_since > (ZERO_BOUND_S + s->zero_down_s +
						       (s->zero_rds ? WINDOW + 1 : 0)) * S) {
				s->zero_reported = true;
				problem("overdraft bound: t=%.0f s: %s of tenant %d (balance %lld µcr) "
					"ran %.0f s at or below zero (bound %d s + %lld s with a meter "
					"of the tenant down, without Postgres or late + %d s with one "
					"without Redis)",
					(double)(W.t - T0) / 1e9, s->id, ti, b,
					(double)(W.t - s->zero_run_since) / 1e9, ZERO_BOUND_S,
					(long long)s->zero_down_s, s->zero_rds ? WINDOW + 1 : 0);
			}
		}
	}
}

static void check_run(void)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;

	/* 1. charged = Σ price x time, per sandbox and generation, to the µcr; the sub-µcr
	 * remainder is carried from generation to generation by each node's meter (a node that
	 * never billed the sandbox starts it at zero: docs/metering.md, "Faults", limits) */
	for (int i = 0; i < W.nsb; i++) {
		const struct sbx *s = W.sb[i];
		unsigned __int128 prev = 0, rem[MAXN] = { 0 };
		for (size_t k = 0; k < s->ng; k++) {
			unsigned __int128 f = rem[s->g[k].node] + (s->g[k].cum_end - prev);
			long long want = (long long)(f / FINE);
			rem[s->g[k].node] = f % FINE;
			long long got = q_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows WHERE "
					      "sandbox_id = '%s' AND generation = %lld",
					      s->id, s->g[k].gen);
			if (got != want)
				problem("charged=expected: %s generation %lld (tenant %d, node %d at "
					"the end) charged %lld µcr, expected %lld (%+lld)",
					s->id, s->g[k].gen, s->ten, s->node, got, want, got - want);
			prev = s->g[k].cum_end;
		}
		if (s->ng && q_int("SELECT count(*) FROM usage_windows WHERE sandbox_id = '%s' AND "
				   "generation > %lld", s->id, s->g[s->ng - 1].gen))
			problem("charged=expected: %s has windows of a generation it never had", s->id);
	}
	/* 2. each window drawn exactly once: usage transfers = usage windows, per tenant */
	for (int ti = 0; ti < opt.tenants; ti++) {
		long long tr = q_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers WHERE "
				     "tenant_id = '%s' AND kind = 'usage'", W.ten[ti].id);
		long long uw = q_int("SELECT coalesce(sum(ucr), 0) FROM usage_windows WHERE "
				     "tenant_id = '%s'", W.ten[ti].id);
		if (tr != uw)
			problem("debits=credits: tenant %d usage transfers %lld µcr, windows %lld",
				ti, tr, uw);
	}
	/* 3. debits = credits: every account's kept balance is its transfers' sum */
	if (pg_acquire(W.pg, &c, &err) == KILN_OK) {
		if (PGQ0(c, &res, &err,
			 "SELECT b.account_id, b.balance_ucr, "
			 "coalesce((SELECT sum(amount_ucr) FROM ledger_transfers WHERE credit_account = "
			 "b.account_id), 0) - coalesce((SELECT sum(amount_ucr) FROM ledger_transfers "
			 "WHERE debit_account = b.account_id), 0) FROM ledger_account_balances b "
			 "WHERE b.balance_ucr <> coalesce((SELECT sum(amount_ucr) FROM ledger_transfers "
			 "WHERE credit_account = b.account_id), 0) - coalesce((SELECT sum(amount_ucr) "
			 "FROM ledger_transfers WHERE debit_account = b.account_id), 0)") == KILN_OK) {
			for (int r = 0; r < pg_res_rows(res); r++)
				problem("debits=credits: account %s keeps %s µcr, its transfers sum to %s",
					pg_res_str(res, r, 0), pg_res_str(res, r, 1),
					pg_res_str(res, r, 2));
		}
		pg_res_free(res);
		res = NULL;
		/* 4. an expired grant expired whole: none of it kept to pay later usage. A grant
		 * made while its tenant was in debt paid that debt first (docs/metering.md, "Debt"),
		 * so it may keep credits against the overdraft, but only while the tenant's balance as
		 * of its expiry (windows from the expiry on and grants made after it left out, later
		 * expiries added back), with the expiry taken, is not above zero. The debt it pays is
		 * the debt at its expiry, not at its making: seed 7002 kept 15,155 µcr against a debt
		 * of 10,682 when made, the other 4,473 µcr an earlier-expiring grant's credits spent
		 * after it was made. And an expiry never takes the balance as of it below zero: it runs
		 * two windows after its time (meter_expire()), once the windows that started before
		 * it have drawn from the grant (seed 9203 lost 121 µcr when it ran at its time).
		 * Grants made after the expiry ran are left out too, whatever their time reads: one
		 * made after a backward step of the wall clock is stamped before the expiry's time
		 * (`clock`, seed 9149: a 159,000 µcr grant made after the expiry counted as before
		 * it, the check's own error). After it is told by the tenant's newest transfer when
		 * the expiry ran (sim.expiry_seq), not by the expiry's transfer: an expiry that took
		 * nothing has none (`clock`, seed 404656909: grants of 86,000 and 291,000 µcr made
		 * after a 3,572 s backward step, past an expiry that took 0 µcr of a tenant in
		 * debt, counted as made before it). */
		if (PGQ0(c, &res, &err,
			 "SELECT a.id, a.tenant_id, b.balance_ucr, e.amount_ucr, x.asof FROM "
			 "ledger_accounts a JOIN ledger_account_balances b ON b.account_id = a.id "
			 "JOIN grant_expiries e ON e.account_id = a.id CROSS JOIN LATERAL (SELECT "
			 "(SELECT coalesce(sum(balance_ucr), 0) FROM ledger_account_balances WHERE "
			 "tenant_id = a.tenant_id) + (SELECT coalesce(sum(CASE WHEN t.kind = 'usage' "
			 "THEN t.amount_ucr ELSE -t.amount_ucr END), 0) FROM ledger_transfers t "
			 "WHERE t.tenant_id = a.tenant_id AND t.seq > (SELECT min(g.seq) FROM "
			 "ledger_transfers g WHERE g.credit_account = a.id) AND ((t.kind = 'usage' "
			 "AND t.period_start >= a.expires_at) OR (t.kind = 'grant' AND (t.created_at > "
			 "a.expires_at OR t.seq > (SELECT x.seq FROM sim.expiry_seq x WHERE "
			 "x.account_id = a.id))))) + (SELECT coalesce(sum(e2.amount_ucr), 0) "
			 "FROM grant_expiries e2 JOIN ledger_accounts a2 ON a2.id = e2.account_id "
			 "WHERE a2.tenant_id = "
			 "a.tenant_id AND (e2.done_at, a2.expires_at, a2.id) > (e.done_at, "
			 "a.expires_at, a.id)) AS asof) x "
			 "WHERE b.balance_ucr < 0 OR (b.balance_ucr > 0 AND x.asof > 0) "
			 "OR (e.amount_ucr > 0 AND x.asof < 0)") == KILN_OK) {
			for (int r = 0; r < pg_res_rows(res); r++)
				problem("expiry: grant %s of %s expired taking %s µcr and keeping %s, "
					"its tenant's balance as of the expiry %s µcr after it (credits "
					"left in an expired grant, or debt made by an expiry)",
					pg_res_str(res, r, 0), pg_res_str(res, r, 1),
					pg_res_str(res, r, 3), pg_res_str(res, r, 2),
					pg_res_str(res, r, 4));
		}
		pg_res_free(res);
		res = NULL;
		/* 5. every sandbox's end is in the ledger: its last generation's billed state is
		 * none (meter_sandboxes holds a point per generation; an earlier one on the same
		 * node keeps the state it had when the next began, and is billed to that instant,
		 * which check 1 covers) */
		if (PGQ0(c, &res, &err,
			 "SELECT m.sandbox_id, m.state FROM meter_sandboxes m JOIN sandboxes s ON "
			 "s.id = m.sandbox_id AND s.generation = m.generation WHERE m.state <> "
			 "'none'") == KILN_OK) {
			for (int r = 0; r < pg_res_rows(res); r++)
				problem("ended: %s is still billed as %s after its deletion",
					pg_res_str(res, r, 0), pg_res_str(res, r, 1));
		}
		pg_res_free(res);
		pg_release(W.pg, c);
	} else {
		sim_fail("postgres: %s", err.msg);
	}
	/* 6. Redis = ledger once everything is flushed, and nothing pending */
	for (int ti = 0; ti < opt.tenants; ti++) {
		bool ok;
		long long rb = redis_bal(ti, &ok), lb = ledger_bal(ti);
		for (int i = 0; i < W.nmt; i++)
			if (W.mt[i].m && meter_pending(W.mt[i].m, W.ten[ti].id))
				problem("flushed: meter %d still has %lld µcr of tenant %d pending", i,
					meter_pending(W.mt[i].m, W.ten[ti].id), ti);
		if (ok && rb != lb)
			problem("redis=ledger: at the end tenant %d redis %lld, ledger %lld", ti, rb, lb);
	}
}

/* --- one run --- */

static void ticks(void)
{
	struct kiln_error err = { 0 };

	for (int i = 0; i < W.nmt; i++) {
		struct smeter *sm = &W.mt[i];
		if (!sm->m)
			continue;
		if ((opt.faults & F_LATE) && chance(3000)) {
			if (opt.verbose > 1)
				fprintf(stderr, "t=%.0f meter %d wakes late\n", (double)(W.t - T0) / 1e9, i);
			W.late_at[sm->node] = W.t;
			continue;	/* woke late: the next tick bills the whole time */
		}
		kiln_error_clear(&err);
		if (meter_tick(sm->m, &err) == KILN_OK && !sm->rds_down_until && !sm->pg_down_until) {
			W.alive_at[sm->node] = W.t;
			W.alive_dropped[sm->node] = false;
		}
	}
	/* Redis's clock: a meter silent for SIM_TTL_S loses its alive key. */
	for (int n = 0; n < opt.nodes; n++) {
		if (W.alive_dropped[n] || W.t - W.alive_at[n] <= SIM_TTL_S * S)
			continue;
		char key[128];
		struct rds_reply rep = { 0 };
		snprintf(key, sizeof(key), BILLING_METER_PREFIX "%s" BILLING_ALIVE_SUFFIX, W.node_id[n]);
		RDS(W.rds, &rep, &err, "DEL", key);
		rds_reply_release(&rep);
		W.alive_dropped[n] = true;
	}
}

/* The faults of this second: started, or over. */
static void faults(bool drain)
{
	for (int i = 0; i < W.nmt; i++) {
		struct smeter *sm = &W.mt[i];
		if (sm->down_until && (drain || W.t >= sm->down_until))
			meter_up(sm);
		if (sm->pg_down_until && (drain || W.t >= sm->pg_down_until)) {
			sm->pg_down_until = 0;
			if (sm->m)
				meter_set_backends(sm->m, sm->pg, sm->rds_down_until ? W.dead_rds : sm->rds);
		}
		if (sm->rds_down_until && (drain || W.t >= sm->rds_down_until)) {
			sm->rds_down_until = 0;
			if (sm->m)
				meter_set_backends(sm->m, sm->pg_down_until ? W.dead_pg : sm->pg, sm->rds);
		}
		if (drain || !sm->m)
			continue;
		if ((opt.faults & F_CRASH) && chance(150)) {
			int64_t down = chance(30000) ? 0 : rnd_in(1, 90) * S;
			meter_crash(sm, down);
			W.fault_until = W.t + down + (SIM_TTL_S + 2 * WINDOW) * S;
			W.faults_applied++;
			if (opt.verbose)
				fprintf(stderr, "t=%.0f crash of meter %d for %.0f s\n",
					(double)(W.t - T0) / 1e9, i, (double)down / 1e9);
			continue;
		}
		if ((opt.faults & F_PG) && !sm->pg_down_until && chance(120)) {
			sm->pg_down_until = W.t + rnd_in(5, 120) * S;
			meter_set_backends(sm->m, W.dead_pg, sm->rds_down_until ? W.dead_rds : sm->rds);
			W.fault_until = sm->pg_down_until + (SIM_TTL_S + 2 * WINDOW) * S;
			W.faults_applied++;
			if (opt.verbose)
				fprintf(stderr, "t=%.0f postgres down for meter %d until %.0f\n",
					(double)(W.t - T0) / 1e9, i, (double)(sm->pg_down_until - T0) / 1e9);
		}
		if ((opt.faults & F_REDIS_DOWN) && !sm->rds_down_until && chance(120)) {
			sm->rds_down_until = W.t + rnd_in(5, 120) * S;
			meter_set_backends(sm->m, sm->pg_down_until ? W.dead_pg : sm->pg, W.dead_rds);
			W.fault_until = sm->rds_down_until + (SIM_TTL_S + 2 * WINDOW) * S;
			W.faults_applied++;
			if (opt.verbose)
				fprintf(stderr, "t=%.0f redis down for meter %d until %.0f\n",
					(double)(W.t - T0) / 1e9, i, (double)(sm->rds_down_until - T0) / 1e9);
		}
	}
	if (drain)
		return;
	if ((opt.faults & F_REDIS) && chance(100)) {
		redis_lose();
		W.fault_until = W.t + (SIM_TTL_S + 2 * WINDOW) * S;
		W.faults_applied++;
		if (opt.verbose)
			fprintf(stderr, "t=%.0f redis loses the run's keys\n", (double)(W.t - T0) / 1e9);
	}
	if ((opt.faults & F_CLOCK) && chance(100)) {
		int64_t step = chance(50000) ? rnd_in(5, 3600) * S : -rnd_in(5, 3600) * S;
		W.woff += step;
		W.fault_until = W.t + (SIM_TTL_S + 2 * WINDOW) * S;
		W.faults_applied++;
		if (opt.verbose)
			fprintf(stderr, "t=%.0f wall clock step %+.0f s\n", (double)(W.t - T0) / 1e9,
				(double)step / 1e9);
	}
}

enum ev_kind {
	EV_BOOT, EV_PAUSE_ASKED, EV_PAUSE, EV_RESUME, EV_DELETE, EV_FORK,	/* arg: a sandbox */
	EV_CREATE, EV_GRANT,						/* arg: a tenant */
};

static const char *const ev_names[] = { "boot", "pause (asked by a meter)", "pause", "resume",
					"delete", "fork" };

struct ev {
	int64_t at;
	enum ev_kind kind;
	int arg;
};

static int ev_cmp(const void *a, const void *b)
{
	const struct ev *x = a, *y = b;

	return x->at < y->at ? -1 : x->at > y->at;
}

/* The schedule's events in [W.t, W.t + 1 s). */
static int events(struct ev *ev, int max, bool drain)
{
	int n = 0, live = 0;

	for (int i = 0; i < W.nsb; i++)
		live += W.sb[i]->st != SB_GONE;
	for (int i = 0; i < W.nsb && n < max - 2; i++) {
		struct sbx *s = W.sb[i];
		int64_t off = rnd_in(1, 999999) * 1000;
		if (s->st == SB_GONE)
			continue;
		if (s->st == SB_CREATING) {
			if (s->boot_at < W.t + S)
				ev[n++] = (struct ev){ s->boot_at > W.t ? s->boot_at : W.t + off, EV_BOOT, i };
			continue;
		}
		if (s->pause_at && s->pause_at < W.t + S && s->st == SB_RUNNING) {
			ev[n++] = (struct ev){ s->pause_at > W.t ? s->pause_at : W.t + off, EV_PAUSE_ASKED, i };
			continue;
		}
		if (W.t + off < s->changed + MIN_GAP)
			continue;
		if (drain) {
			ev[n++] = (struct ev){ W.t + off, EV_DELETE, i };
			continue;
		}
		if (s->st == SB_RUNNING) {
			if (chance(800))
				ev[n++] = (struct ev){ W.t + off, EV_PAUSE, i };
			else if (chance(300))
				ev[n++] = (struct ev){ W.t + off, EV_DELETE, i };
			else if (chance(300) && live < 40)
				ev[n++] = (struct ev){ W.t + off, EV_FORK, i };
		} else if (s->st == SB_PAUSED) {
			if (chance(1500))
				ev[n++] = (struct ev){ W.t + off, EV_RESUME, i };
			else if (chance(300))
				ev[n++] = (struct ev){ W.t + off, EV_DELETE, i };
		}
	}
	if (drain)
		goto out;
	for (int ti = 0; ti < opt.tenants && n < max; ti++) {
		if (live < 30 && chance(live < 4 ? 3000 : 800))
			ev[n++] = (struct ev){ W.t + rnd_in(1, 999999) * 1000, EV_CREATE, ti };
		if (n < max && chance(opt.faults & F_ZERO ? 500 : 150))
			ev[n++] = (struct ev){ W.t + rnd_in(1, 999999) * 1000, EV_GRANT, ti };
	}
out:
	qsort(ev, (size_t)n, sizeof(*ev), ev_cmp);
	return n;
}

static void apply(const struct ev *e)
{
	struct sbx *s = e->kind <= EV_FORK ? W.sb[e->arg] : NULL;

	W.t = e->at;
	if (s && opt.verbose > 1)
		fprintf(stderr, "t=%.3f %s %s gen %lld node %d\n", (double)(W.t - T0) / 1e9,
			ev_names[e->kind], s->id, s->gen, s->node);
	if (s)
		cpu_advance(s, W.t);	/* the CPU this VM used up to the change */
	switch (e->kind) {
	case EV_BOOT:
		if (s->st == SB_CREATING)
			op_boot(s);
		break;
	case EV_PAUSE_ASKED:
		if (s->st == SB_RUNNING && s->gen == s->pause_gen) {
			op_pause(s);
			W.pauses_applied++;
		} else {
			s->pause_at = 0;
		}
		break;
	case EV_PAUSE:
		if (s->st == SB_RUNNING)
			op_pause(s);
		break;
	case EV_RESUME:
		if (s->st == SB_PAUSED)
			op_resume(s, (opt.faults & F_MOVE) && chance(50000));
		break;
	case EV_DELETE:
		/* gw-delete draws only when given: other seeds' schedules stay as they were */
		if (s->st == SB_PAUSED && (opt.faults & F_GW_DELETE) && chance(50000))
			op_delete_unheld(s);
		else if (s->st != SB_GONE)
			op_delete(s);
		break;
	case EV_FORK:
		if (s->st == SB_RUNNING)
			op_fork(s);
		break;
	case EV_CREATE:
		op_create(e->arg);
		break;
	case EV_GRANT: {
		long long amt = opt.faults & F_ZERO ? rnd_in(20, 400) * 1000 : rnd_in(1, 50) * 1000000000LL;
		int64_t exp = (opt.faults & F_EXPIRY) && chance(40000) ? rnd_in(60, 900) * S : 0;
		op_grant(e->arg, amt, exp);
		break;
	}
	}
}

/* One simulated second from W.t: its events, the CPU counters, the cgroups that go, the ticks. */
static void second(bool drain)
{
	struct ev ev[256];
	int64_t start = W.t;
	int n = events(ev, 256, drain);

	for (int i = 0; i < n && !W.sim_error; i++)
		apply(&ev[i]);
	W.t = start + S;
	for (int i = 0; i < W.nsb; i++) {
		struct sbx *s = W.sb[i];
		cpu_advance(s, W.t);
		for (int k = 0; k < opt.nodes; k++)
			if (s->cg_rm_at[k] && s->cg_rm_at[k] <= W.t)
				cg_remove(k, s);
	}
	faults(drain);
	ticks();
}

static void world_free(void)
{
	for (int i = 0; i < W.nmt; i++) {
		meter_free(W.mt[i].m);
		pg_free(W.mt[i].pg);
		rds_free(W.mt[i].rds);
	}
	for (int i = 0; i < W.nsb; i++) {
		free(W.sb[i]->g);
		free(W.sb[i]);
	}
	if (W.pg)
		pg_free(W.pg);
	rds_free(W.rds);
	pg_free(W.dead_pg);
	rds_free(W.dead_rds);
}

static void rm_tree(const char *path)
{
	DIR *d = opendir(path);
	struct dirent *e;
	char p[1024];

	if (!d) {
		unlink(path);
		return;
	}
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		snprintf(p, sizeof(p), "%s/%s", path, e->d_name);
		rm_tree(p);
	}
	closedir(d);
	rmdir(path);
}

static bool admin_sql(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static bool admin_sql(const char *fmt, ...)
{
	char q[1024];
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	va_list ap;
	bool ok;

	va_start(ap, fmt);
	vsnprintf(q, sizeof(q), fmt, ap);
	va_end(ap);
	if (pg_acquire(tdb.admin, &c, &err) != KILN_OK) {
		fprintf(stderr, "postgres: %s\n", err.msg);
		return false;
	}
	ok = pg_exec(c, q, &err) == KILN_OK;
	if (!ok)
		fprintf(stderr, "postgres: %s: %s\n", q, err.msg);
	pg_release(tdb.admin, c);
	return ok;
}

static const char *faults_str(unsigned f, char *out, size_t n)
{
	size_t len = 0;

	out[0] = '\0';
	for (size_t i = 0; i < sizeof(fault_names) / sizeof(fault_names[0]); i++)
		if (f & fault_names[i].bit)
			len += (size_t)snprintf(out + len, n - len, "%s%s", len ? "," : "",
						fault_names[i].name);
	if (!len)
		snprintf(out, n, "none");
	return out;
}

/* Whether check_run() now reports a problem starting with `prefix`; forgets the problems. */
static bool caught(const char *prefix)
{
	bool found = false;

	W.nproblems = 0;
	check_run();
	for (int i = 0; i < W.nproblems && i < MAX_PROBLEMS; i++)
		found |= strncmp(W.problems[i], prefix, strlen(prefix)) == 0;
	if (!found)
		printf("  self-test: a planted fault went unseen by \"%s\"\n", prefix);
	W.nproblems = 0;
	return found;
}

/* Whether check_run() now reports a problem naming `what`; forgets the problems. */
static bool reported(const char *what)
{
	bool found = false;

	W.nproblems = 0;
	check_run();
	for (int i = 0; i < W.nproblems && i < MAX_PROBLEMS; i++)
		found |= strstr(W.problems[i], what) != NULL;
	W.nproblems = 0;
	return found;
}

/*
 * --self-test: after a seed that kept every invariant, plants one fault at a time in the
 * database or Redis and requires check_run() to report it under the right invariant (a check
 * that cannot fail proves nothing). Returns the number of plants that went unseen.
 */
static int self_test(void)
{
	struct sbx *s = NULL;
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[128];
	int missed = 0;
	long long ended;

	for (int i = 0; i < W.nsb && !s; i++)
		if (W.sb[i]->ng)
			s = W.sb[i];
	if (!s) {
		printf("  self-test: the seed made no sandbox\n");
		return 1;
	}
	/* a window of a generation charged twice over: 1 µcr more in a window never billed (after
	 * its billed time: meter_flush() refuses one that overlaps it, and one of a generation
	 * whose end is in the ledger, so the end mark is lifted for it and put back) */
	ended = q_int("SELECT count(*) FROM meter_sandboxes WHERE sandbox_id = '%s' AND "
		      "generation = %lld AND ended", s->id, s->g[0].gen);
	wsql("UPDATE meter_sandboxes SET ended = false WHERE sandbox_id = '%s' AND generation = %lld",
	     s->id, s->g[0].gen);
	wsql("SELECT meter_flush(jsonb_build_array(jsonb_build_object('sb', '%s', 'tenant', '%s', "
	     "'node', '%s', 'gen', %lld, 'ws', %lld, 'we', %lld, 'ps', %lld, 'pe', %lld, 'ucr', 1, "
	     "'cpu', 0, 'mem_bs', 0, 'rx', 0, 'tx', 0, 'state', 'none', 't', 0, 'cpu_at', 0, "
	     "'rx_at', 0, 'tx_at', 0, 'rem', 0)), '%s')",
	     s->id, W.ten[s->ten].id, W.node_id[s->node], s->g[0].gen, (long long)(T0 / S + 1000000),
	     (long long)(T0 / S + 1000010), (long long)(T0 + 1000000 * S),
	     (long long)(T0 + 1000010 * S), card.version);
	wsql("UPDATE meter_sandboxes SET ended = %s WHERE sandbox_id = '%s' AND generation = %lld",
	     ended ? "true" : "ended", s->id, s->g[0].gen);
	missed += !caught("charged=expected");
	/* Redis's ledger half off by one µcr */
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", W.ten[s->ten].id);
	RDS(W.rds, &rep, &err, "HINCRBY", key, "ledger", "1");
	rds_reply_release(&rep);
	missed += !caught("redis=ledger");
	/* an account's kept balance off its transfers */
	wsql("UPDATE ledger_account_balances SET balance_ucr = balance_ucr + 1 WHERE account_id = "
	     "(SELECT min(account_id) FROM ledger_account_balances WHERE tenant_id = '%s')",
	     W.ten[s->ten].id);
	missed += !caught("debits=credits");
	/* a usage transfer without its window */
	wsql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	     "amount_ucr, tenant_id, sandbox_id) SELECT 'tx_selftest', 'selftest', 'usage', "
	     "min(account_id), 'system:revenue', 1, '%s', '%s' FROM ledger_account_balances "
	     "WHERE tenant_id = '%s'",
	     W.ten[s->ten].id, s->id, W.ten[s->ten].id);
	missed += !caught("debits=credits: tenant");
	/* a deleted sandbox still billed as running */
	wsql("UPDATE meter_sandboxes SET state = 'running' WHERE sandbox_id = '%s'", s->id);
	missed += !caught("ended");
	/* what is left in an expired grant (5 µcr more than any debt it could have paid) */
	wsql("INSERT INTO ledger_accounts (id, tenant_id, kind, expires_at) VALUES ('grant:tx_st', "
	     "'%s', 'grant', now());"
	     "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	     "amount_ucr, tenant_id) SELECT 'tx_st', 'selftest:grant', 'grant', 'system:issuance', "
	     "'grant:tx_st', 5 + greatest(0, -coalesce(sum(balance_ucr), 0)), '%s' "
	     "FROM ledger_account_balances WHERE tenant_id = '%s';"
	     "INSERT INTO grant_expiries (account_id, amount_ucr) VALUES ('grant:tx_st', 0)",
	     W.ten[s->ten].id, W.ten[s->ten].id, W.ten[s->ten].id);
	missed += !caught("expiry");
	/* and not what is right: a tenant 20 µcr in debt as of an expiry that took nothing of the
	 * 10 µcr left in its grant, then a grant stamped before that expiry's time but made after
	 * it ran (as after a backward step of the wall clock: seed 404656909) */
	wsql("INSERT INTO tenants (id, name) VALUES ('tn_st3', 'selftest');"
	     "INSERT INTO ledger_accounts (id, tenant_id, kind, expires_at) VALUES "
	     "('grant:tx_st3', 'tn_st3', 'grant', now() + interval '1 hour'), "
	     "('grant:tx_st4', 'tn_st3', 'grant', NULL), "
	     "('overdraft:tn_st3', 'tn_st3', 'overdraft', NULL);"
	     "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	     "amount_ucr, tenant_id) VALUES ('tx_st3', 'selftest:st3', 'grant', 'system:issuance', "
	     "'grant:tx_st3', 10, 'tn_st3');"
	     "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	     "amount_ucr, tenant_id) VALUES ('tx_st3u', 'selftest:st3u', 'usage', "
	     "'overdraft:tn_st3', 'system:revenue', 30, 'tn_st3');"
	     "INSERT INTO grant_expiries (account_id, amount_ucr) VALUES ('grant:tx_st3', 0);"
	     "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	     "amount_ucr, tenant_id) VALUES ('tx_st4', 'selftest:st4', 'grant', 'system:issuance', "
	     "'grant:tx_st4', 100, 'tn_st3')");
	if (reported("grant:tx_st3 ")) {
		printf("  self-test: an expiry that took nothing of a tenant in debt reported, a grant "
		       "made after it counted as before\n");
		missed++;
	}
	return missed;
}

/*
 * Connects `pool` once, trying for up to 20 s (a loaded machine can take longer than libpq's
 * connect_timeout to start a backend). Every pool of the simulation uses one connection at a
 * time and keeps it, so none connects again unless the simulation breaks it.
 */
static bool pg_warm(struct pg *pool)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	for (int i = 0; i < 20; i++) {
		if (pg_acquire(pool, &c, &err) == KILN_OK) {
			pg_release(pool, c);
			return true;
		}
		sleep(1);
	}
	fprintf(stderr, "kiln-sim: postgres: %s\n", err.msg);
	return false;
}

/* Runs seed `seed`: 0 when every invariant held, 1 when one broke, 2 on a simulation error. */
static int run_seed(uint64_t seed)
{
	static int runs;
	char url[800], fs[200], path[700];
	struct timespec a, b;
	int rc;

	memset(&W, 0, sizeof(W));
	rng = seed * 0x2545f4914f6cdd1dULL + 1;
	/* Named by seed, process and run (a seed may come twice: --seeds 9119,9119:480). */
	runs++;
	snprintf(W.tag, sizeof(W.tag), "%" PRIu64 "p%dr%d", seed, (int)getpid(), runs);
	snprintf(W.db, sizeof(W.db), "t_sim_%" PRIu64 "_%d_%d", seed, (int)getpid(), runs);
	clock_gettime(CLOCK_MONOTONIC, &a);
	if (!admin_sql("DROP DATABASE IF EXISTS %s WITH (FORCE)", W.db) ||
	    !admin_sql("CREATE DATABASE %s TEMPLATE %s", W.db, tdb.name) ||
	    !admin_sql("ALTER DATABASE %s SET search_path = sim, pg_catalog, public", W.db) ||
	    /* a scratch database: commits need not wait for the disk */
	    !admin_sql("ALTER DATABASE %s SET synchronous_commit = off", W.db))
		return 2;
	snprintf(W.cg_root, sizeof(W.cg_root), "/tmp/kiln-sim-cg-%s", W.tag);
	rm_tree(W.cg_root);
	mkdir(W.cg_root, 0755);
	snprintf(path, sizeof(path), "%s/cgroup.controllers", W.cg_root);
	{
		FILE *f = fopen(path, "w");
		if (!f)
			return 2;
		fputs("cpuset cpu io memory pids\n", f);
		fclose(f);
	}
	snprintf(path, sizeof(path), "%s/kiln", W.cg_root);
	mkdir(path, 0755);
	snprintf(url, sizeof(url), "host=%s user=kiln dbname=%s", sockdir, W.db);
	W.pg = pg_new(url, 2);
	W.rds = rds_new(tdb.redis_url, 2000);
	W.dead_pg = pg_new("host=/nonexistent-kiln-sim user=kiln dbname=none", 1);
	W.dead_rds = rds_new("unix:/nonexistent-kiln-sim/redis.sock", 200);
	if (!pg_warm(W.pg)) {
		world_free();
		rm_tree(W.cg_root);
		admin_sql("DROP DATABASE IF EXISTS %s WITH (FORCE)", W.db);
		return 2;
	}
	W.t = T0;
	db_clock(W.t);
	for (int ti = 0; ti < opt.tenants; ti++) {
		snprintf(W.ten[ti].id, sizeof(W.ten[ti].id), "tn_%s_%d", W.tag, ti);
		wsql("INSERT INTO tenants (id, name) VALUES ('%s', 'sim')", W.ten[ti].id);
	}
	for (int n = 0; n < opt.nodes; n++) {
		snprintf(W.node_id[n], sizeof(W.node_id[n]), "nd_%s_%d", W.tag, n);
		snprintf(W.node_boot[n], sizeof(W.node_boot[n]), "boot_%s_%d", W.tag, n);
		wsql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, "
		     "hypervisor, accelerator, image_hash) VALUES ('%s', 'unix:/nonexistent', "
		     "64000, 262144, 256, 'qemu', 'tcg', '')",
		     W.node_id[n]);
		snprintf(path, sizeof(path), "%s/kiln/%s", W.cg_root, W.node_id[n]);
		mkdir(path, 0755);
		W.alive_at[n] = W.t;
	}
	for (int n = 0; n < opt.nodes + ((opt.faults & F_TWO) ? 1 : 0); n++) {
		struct smeter *sm = &W.mt[W.nmt++];
		sm->node = n < opt.nodes ? n : 0;
		sm->pg = pg_new(url, 2);
		if (sm->pg)
			meter_pg_session(sm->pg);	/* as kiln-meter's: prepared, no JIT */
		sm->rds = rds_new(tdb.redis_url, 2000);
		if (!pg_warm(sm->pg))
			sim_fail("a meter's pool cannot connect");
		meter_up(sm);
	}
	/* every tenant starts with credits (the free tier, or little under `zero`) */
	for (int ti = 0; ti < opt.tenants; ti++)
		op_grant(ti, opt.faults & F_ZERO ? 200000 : 500000000000LL, 0);
	for (long k = 0; k < opt.steps && !W.sim_error; k++) {
		second(false);
		if ((opt.faults & F_ZERO) && !W.sim_error)
			check_zero_bound();
		if ((W.t / S) % WINDOW == 0) {
			for (int ti = 0; ti < opt.tenants; ti++)
				W.ten[ti].expired_seen = q_int(
					"SELECT coalesce(sum(CASE kind WHEN 'expiry' THEN amount_ucr "
					"ELSE -amount_ucr END), 0) FROM ledger_transfers WHERE "
					"tenant_id = '%s' AND kind IN ('expiry', 'expiry_reversal')",
					W.ten[ti].id);
		}
		if ((W.t / S) % WINDOW == 1 && W.t > W.fault_until && !(opt.faults & F_TWO) &&
		    !W.sim_error)
			check_redis_vs_ledger("after a flush");
	}
	/* drain: faults off, every sandbox deleted, the meters tick until everything is flushed */
	for (long k = 0; k < 60 + 3 * WINDOW && !W.sim_error; k++)
		second(true);
	if (!W.sim_error)
		check_run();
	if (opt.self_test && !W.sim_error && !W.nproblems) {
		int missed = self_test();
		if (missed)
			problem("self-test: %d planted faults went unseen", missed);
		else
			printf("seed %" PRIu64 ": self-test: every planted fault was caught\n", seed);
	}
	W.windows = W.sim_error ? 0 : q_int("SELECT count(*) FROM usage_windows");
	clock_gettime(CLOCK_MONOTONIC, &b);
	rc = W.sim_error ? 2 : W.nproblems ? 1 : 0;
	faults_str(opt.faults, fs, sizeof(fs));
	if (rc || opt.verbose)
		printf("seed %" PRIu64 ": %s: %ld s simulated (%d sandboxes, %ld windows, %ld grants, "
		       "%ld faults, %ld pauses at zero) in %.1f s\n",
		       seed, rc ? "FAIL" : "ok", opt.steps, W.nsb, W.windows, W.grants,
		       W.faults_applied, W.pauses_applied,
		       (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9);
	if (rc) {
		int shown = 0;
		for (int i = 0; i < W.nproblems && i < MAX_PROBLEMS; i++) {
			size_t k = strcspn(W.problems[i], ":");
			int same = 0;
			for (int j = 0; j < i; j++)
				same += strncmp(W.problems[j], W.problems[i], k + 1) == 0;
			if (same < 4) {
				printf("  %s\n", W.problems[i]);
				shown++;
			}
		}
		if (W.nproblems > shown)
			printf("  ... and %d more\n", W.nproblems - shown);
		printf("  replay: kiln-sim --seed %" PRIu64 " --steps %ld --tenants %d --nodes %d "
		       "--faults=%s --witness=%s\n",
		       seed, opt.steps, opt.tenants, opt.nodes, fs, witness_names[opt.witness]);
	}
	fflush(stdout);
	world_free();
	rm_tree(W.cg_root);
	if (rc && getenv("KILN_SIM_KEEP"))	/* a failing seed's database, kept to look at */
		printf("  kept: database %s\n", W.db);
	else
		admin_sql("DROP DATABASE IF EXISTS %s WITH (FORCE)", W.db);
	return rc;
}

/* --- the template database: migrated once, with the simulation's clock --- */

static const char sim_schema[] =
	"CREATE SCHEMA sim;"
	"CREATE TABLE sim.clock (t timestamptz NOT NULL);"
	"INSERT INTO sim.clock VALUES (now());"
	/* What record/ and the ledger stamp with: the simulation's clock (search_path puts sim
	 * first, before pg_catalog, for every connection of a seed's database). */
	"CREATE FUNCTION sim.now() RETURNS timestamptz LANGUAGE sql STABLE AS "
	"  'SELECT t FROM sim.clock';"
	"CREATE FUNCTION sim.clock_timestamp() RETURNS timestamptz LANGUAGE sql STABLE AS "
	"  'SELECT t FROM sim.clock';"
	"CREATE FUNCTION sim.statement_timestamp() RETURNS timestamptz LANGUAGE sql STABLE AS "
	"  'SELECT t FROM sim.clock';"
	"CREATE FUNCTION sim.transaction_timestamp() RETURNS timestamptz LANGUAGE sql STABLE AS "
	"  'SELECT t FROM sim.clock';"
	/* Column defaults were bound to pg_catalog.now() when the tables were made. */
	"CREATE FUNCTION sim.stamp() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
	"  NEW.created_at := sim.now(); NEW.state_changed_at := sim.now(); RETURN NEW; END $$;"
	"CREATE TRIGGER sim_stamp BEFORE INSERT ON public.sandboxes FOR EACH ROW "
	"  EXECUTE FUNCTION sim.stamp();"
	/* Grants and accounts too: an expiry counts the grants made after it by created_at (on the
	 * host's clock, every later grant counted as made after any simulated expiry). */
	"CREATE FUNCTION sim.stamp_created() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
	"  NEW.created_at := sim.now(); RETURN NEW; END $$;"
	"CREATE TRIGGER sim_stamp BEFORE INSERT ON public.ledger_transfers FOR EACH ROW "
	"  EXECUTE FUNCTION sim.stamp_created();"
	"CREATE TRIGGER sim_stamp BEFORE INSERT ON public.ledger_accounts FOR EACH ROW "
	"  EXECUTE FUNCTION sim.stamp_created();"
	/* Where each expiry ran in its tenant's ledger: the newest transfer of the tenant then
	 * (ledger_expire_grants() holds the tenant's ledger lock; its own transfer, when it takes
	 * something, comes after). Check 4 tells the grants made after it by this, not by time. */
	"CREATE TABLE sim.expiry_seq (account_id text PRIMARY KEY, seq bigint NOT NULL);"
	"CREATE FUNCTION sim.expiry_seq() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
	"  INSERT INTO sim.expiry_seq SELECT NEW.account_id, coalesce(max(t.seq), 0) "
	"  FROM public.ledger_transfers t JOIN public.ledger_accounts a ON a.tenant_id = t.tenant_id "
	"  WHERE a.id = NEW.account_id "
	/* an expiry reopened by a late window runs again: where it ran first (grant_expiries.
	 * run_seq: the grants made after that count as after it then too) */
	"  ON CONFLICT (account_id) DO NOTHING; RETURN NULL; END $$;"
	"CREATE TRIGGER sim_expiry_seq AFTER INSERT ON public.grant_expiries FOR EACH ROW "
	"  EXECUTE FUNCTION sim.expiry_seq();";

static int template_open(void)
{
	const char *envf = getenv("KILN_SERVICES_ENV");
	char line[600];
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	FILE *f;

	/* Two kiln-sim processes migrating their templates at once (scripts/sim.sh's jobs) can
	 * collide in a shared catalog (a unique violation): the later one tries again. */
	for (int tries = 0; testdb_open(&tdb, "simtpl") != 0; tries++) {
		if (tries == 4)
			return -1;
		fprintf(stderr, "the template database: trying again\n");
		sleep(2 + (unsigned)tries * 3);
	}
	f = envf ? fopen(envf, "r") : NULL;
	while (f && fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = '\0';
		if (!strncmp(line, "KILN_TEST_SOCKDIR=", 18))
			snprintf(sockdir, sizeof(sockdir), "%s", line + 18);
	}
	if (f)
		fclose(f);
	if (pg_acquire(tdb.pg, &c, &err) != KILN_OK || pg_exec(c, sim_schema, &err) != KILN_OK) {
		fprintf(stderr, "the simulation's schema: %s\n", err.msg);
		return -1;
	}
	pg_release(tdb.pg, c);
	pg_free(tdb.pg);	/* a template has no connections */
	tdb.pg = NULL;
	return 0;
}

static int parse_faults(const char *s, unsigned *out)
{
	char buf[512], *tok, *save = NULL;

	*out = 0;
	snprintf(buf, sizeof(buf), "%s", s);
	for (tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		bool found = false;
		if (!strcmp(tok, "none"))
			continue;
		if (!strcmp(tok, "all")) {
			for (size_t i = 0; i < sizeof(fault_names) / sizeof(fault_names[0]); i++)
				*out |= fault_names[i].bit;
			continue;
		}
		for (size_t i = 0; i < sizeof(fault_names) / sizeof(fault_names[0]); i++)
			if (!strcmp(tok, fault_names[i].name)) {
				*out |= fault_names[i].bit;
				found = true;
			}
		if (!found) {
			fprintf(stderr, "kiln-sim: unknown fault \"%s\"\n", tok);
			return -1;
		}
	}
	return 0;
}

static int parse_witness(const char *s, enum witness_mode *out)
{
	for (size_t i = 0; i < sizeof(witness_names) / sizeof(witness_names[0]); i++)
		if (!strcmp(s, witness_names[i])) {
			*out = (enum witness_mode)i;
			return 0;
		}
	fprintf(stderr, "kiln-sim: --witness: \"%s\" is not on, off or mixed\n", s);
	return -1;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kiln-sim [--seed N | --seeds N[:S],N[:S],...] [--count K] [--random K] [--steps S]\n"
		"                [--tenants T] [--nodes N] [--faults=KIND,...] [--budget SECONDS]\n"
		"                [--witness=on|off|mixed] [--self-test] [-v [-v]]\n"
		"\n"
		"Runs the billing simulation for each seed (--seed N --count K: N..N+K-1; --random K:\n"
		"K seeds drawn from the time, printed) over S simulated seconds (default 900), on the\n"
		"services fixture's Postgres and Redis (KILN_SERVICES_ENV). --budget stops starting\n"
		"seeds after that many seconds. Exit 0 when every seed kept every invariant.\n"
		"--seeds N:S runs seed N over S simulated seconds (its prefix), whatever --steps says.\n"
		"--self-test: after each seed, plant faults in the ledger and Redis one at a time; each\n"
		"must be reported by its invariant.\n"
		"--witness: which nodes log their changes with a witness: on (every node, default), off\n"
		"(none: every change placed by the frames, as before migrations/0051) or mixed (nodes\n"
		"of even index only, as in a rolling upgrade). A seed runs the same schedule in each.\n"
		"Fault kinds (--faults=a,b; 'all'; 'none'; default expiry):\n");
	for (size_t i = 0; i < sizeof(fault_names) / sizeof(fault_names[0]); i++)
		fprintf(f, "  %-11s %s\n", fault_names[i].name, fault_names[i].what);
}

int main(int argc, char **argv)
{
	uint64_t seeds[4096];
	long steps_of[4096] = { 0 };	/* --seeds N:S: that seed's steps (0: --steps) */
	int nseeds = 0, count = 1, nrandom = 0, failed = 0, ran = 0;
	double budget = 0, hours = 0;
	long steps_all;
	bool have_seed = false;
	struct timespec a, b;
	char fs[200];

	for (int i = 1; i < argc; i++) {
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(argv[i], "-v")) {
			opt.verbose++;
		} else if (!strcmp(argv[i], "--self-test")) {
			opt.self_test = true;
		} else if (!strncmp(argv[i], "--faults=", 9)) {
			if (parse_faults(argv[i] + 9, &opt.faults))
				return 2;
		} else if (!strncmp(argv[i], "--witness=", 10)) {
			if (parse_witness(argv[i] + 10, &opt.witness))
				return 2;
		} else if (!v) {
			usage(stderr);
			return 2;
		} else if (!strcmp(argv[i], "--faults")) {
			if (parse_faults(v, &opt.faults))
				return 2;
			i++;
		} else if (!strcmp(argv[i], "--seed")) {
			seeds[nseeds++ % 4096] = strtoull(v, NULL, 10);
			have_seed = true;
			i++;
		} else if (!strcmp(argv[i], "--seeds")) {
			char buf[4096], *tok, *save = NULL;
			snprintf(buf, sizeof(buf), "%s", v);
			for (tok = strtok_r(buf, ",", &save); tok && nseeds < 4096;
			     tok = strtok_r(NULL, ",", &save)) {
				char *end;
				seeds[nseeds] = strtoull(tok, &end, 10);
				if (*end == ':') {
					steps_of[nseeds] = strtol(end + 1, &end, 10);
					if (steps_of[nseeds] < 1)
						*end = ':';	/* refused below */
				}
				if (*end || end == tok) {
					fprintf(stderr, "kiln-sim: --seeds: \"%s\" is not N or N:S "
						"(S >= 1)\n", tok);
					return 2;
				}
				nseeds++;
			}
			have_seed = true;
			i++;
		} else if (!strcmp(argv[i], "--count")) {
			count = atoi(v);
			i++;
		} else if (!strcmp(argv[i], "--random")) {
			nrandom = atoi(v);
			i++;
		} else if (!strcmp(argv[i], "--steps")) {
			opt.steps = atol(v);
			i++;
		} else if (!strcmp(argv[i], "--tenants")) {
			opt.tenants = atoi(v);
			i++;
		} else if (!strcmp(argv[i], "--nodes")) {
			opt.nodes = atoi(v);
			i++;
		} else if (!strcmp(argv[i], "--budget")) {
			budget = atof(v);
			i++;
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (opt.tenants < 1 || opt.tenants > MAXT || opt.nodes < 1 || opt.nodes > MAXN ||
	    opt.steps < 1 || count < 1 || nrandom < 0) {
		fprintf(stderr, "kiln-sim: 1-%d tenants, 1-%d nodes, steps and count >= 1\n", MAXT, MAXN);
		return 2;
	}
	if (!have_seed && !nrandom)
		seeds[nseeds++] = 1;
	if (nseeds == 1 && count > 1) {
		for (int k = 1; k < count && nseeds < 4096; k++)
			seeds[nseeds++] = seeds[0] + (uint64_t)k;
	}
	if (nrandom) {
		/* drawn from the time, and run between the fixed ones (so a budget that ends the
		 * list early still runs some of each) */
		uint64_t base = (uint64_t)time(NULL) * 1000003ULL ^ (uint64_t)getpid(), fixed[4096];
		long fixed_steps[4096];
		int nfixed = nseeds;
		memcpy(fixed, seeds, sizeof(fixed[0]) * (size_t)nfixed);
		memcpy(fixed_steps, steps_of, sizeof(fixed_steps[0]) * (size_t)nfixed);
		nseeds = 0;
		printf("seeds drawn from the time:");
		for (int k = 0; (k < nrandom || k < nfixed) && nseeds < 4095; k++) {
			if (k < nfixed) {
				steps_of[nseeds] = fixed_steps[k];
				seeds[nseeds++] = fixed[k];
			}
			if (k < nrandom) {
				steps_of[nseeds] = 0;
				rng = base + (uint64_t)k;
				seeds[nseeds] = rnd() % 1000000000ULL;
				printf(" %" PRIu64, seeds[nseeds++]);
			}
		}
		printf("\n");
	}
	log_init("kiln-sim", opt.verbose > 2 ? KLOG_INFO : KLOG_ERROR, false);
	price_card_init(&card, 1000, 1024, 16, 128);
	if (template_open() != 0)
		return 2;
	clock_gettime(CLOCK_MONOTONIC, &a);
	steps_all = opt.steps;
	for (int i = 0; i < nseeds; i++) {
		int rc;
		clock_gettime(CLOCK_MONOTONIC, &b);
		if (budget > 0 && (double)(b.tv_sec - a.tv_sec) > budget) {
			printf("budget of %.0f s spent: %d of %d seeds run\n", budget, ran, nseeds);
			break;
		}
		opt.steps = steps_of[i] ? steps_of[i] : steps_all;
		rc = run_seed(seeds[i]);
		ran++;
		hours += (double)opt.steps / 3600.0;
		if (rc)
			failed++;
		if (rc == 2)
			break;
	}
	clock_gettime(CLOCK_MONOTONIC, &b);
	printf("kiln-sim: %d of %d seeds failed, %.2f simulated hours, faults %s, witness %s, "
	       "%.0f s\n", failed, ran, hours, faults_str(opt.faults, fs, sizeof(fs)),
	       witness_names[opt.witness],
	       (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9);
	testdb_close(&tdb);
	return failed ? 1 : 0;
}
