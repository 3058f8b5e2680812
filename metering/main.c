/*
 * main.c - kiln-meter: one per host, bills the host's sandboxes every second (meter.h) and
 * pauses those whose tenant ran out of credits (pause.h).
 *
 * Start order is the table below, stop order its reverse. Ticks run on whole seconds of the
 * monotonic clock, so a step of the wall clock neither skips nor stops them; a tick that wakes
 * late counts the seconds it skipped as missed (its successor still bills them: billing is by
 * elapsed monotonic time and cumulative counters). SIGTERM and SIGINT stop
 * after the tick in progress; charges not yet flushed are billed again by the next run from the
 * ledger's billed-up-to points, so stopping loses nothing.
 *
 * Test hooks (never in production): --test-clock FILE adds the number of seconds written in
 * FILE (re-read every tick) to the host's clocks, wall and monotonic alike, so tests can move
 * the meter's time forward without stepping the host's; a second number on the line is added
 * to the wall clock alone (a step of it, which is not billed); --test-flush-hold-ms N holds each flush's transaction open.
 */
#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "auth/signing.h"
#include "auth/crypto.h"
#include "auth/masterkey.h"
#include "common/config.h"
#include "common/daemon.h"
#include "common/log.h"
#include "metering/meter.h"
#include "metering/pause.h"
#include "migrations/migrate.h"

static struct {
	struct kiln_config cfg;
	struct auth_master_key mk;
	bool has_mk;
	struct pg *pg;
	struct rds *rds;
	struct signing *signing;
	struct pauser *pauser;
	struct meter *meter;
	const char *clock_file;
	unsigned flush_hold_ms;
} km;

/*
 * The test clocks: the host's clock plus the offsets written in the file. The wall clock reads
 * the file; the monotonic clock takes the offset that read found (the meter reads the wall clock
 * first, then the monotonic one), so the two are read microseconds apart and a step written to
 * the file is measured as written, not less the time a second read of the file took.
 */
static struct {
	pthread_mutex_t lock;
	bool read;
	double off;
} tclk = { .lock = PTHREAD_MUTEX_INITIALIZER };

static void test_clock_read(const char *path, double *off, double *step)
{
	FILE *f = fopen(path, "r");

	*off = *step = 0;
	if (f) {
		int n = fscanf(f, "%lf %lf", off, step);
		if (n < 1)
			*off = 0;
		if (n < 2)
			*step = 0;
		fclose(f);
	}
}

static int64_t test_clock(void *ctx)
{
	struct timespec ts;
	double off, step;

	test_clock_read((const char *)ctx, &off, &step);
	pthread_mutex_lock(&tclk.lock);
	tclk.off = off;
	tclk.read = true;
	pthread_mutex_unlock(&tclk.lock);
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * PRICE_NS_PER_S + ts.tv_nsec + (int64_t)((off + step) * 1e9);
}

static int64_t test_clock_mono(void *ctx)
{
	struct timespec ts;
	double off, step;
	bool read;

	pthread_mutex_lock(&tclk.lock);
	read = tclk.read;
	off = tclk.off;
	pthread_mutex_unlock(&tclk.lock);
	if (!read)
		test_clock_read((const char *)ctx, &off, &step);
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * PRICE_NS_PER_S + ts.tv_nsec + (int64_t)(off * 1e9);
}

static int db_init(struct kiln_error *err)
{
	int applied = 0;
	enum kiln_err rc;

	km.pg = pg_new(km.cfg.database_url, 4);	/* the tick, the flush, the pauses, the signer */
	if (!km.pg || meter_pg_session(km.pg) < 0)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = migrate_apply(km.pg, migrations, migrations_count, &applied, err);
	if (rc == KILN_OK && applied)
		log_info("applied %d migrations", applied);
	return rc;
}

static void db_exit(void)
{
	pg_free(km.pg);
	km.pg = NULL;
}

/* The master key signs node tokens for pauses; without one the meter bills but pauses nothing. */
static int master_key_init(struct kiln_error *err)
{
	if (!masterkey_configured(&km.cfg)) {
		log_error("no master key: sandboxes of tenants out of credits will not be paused; "
			  "they run on, billed into debt, with no bound");
		return KILN_OK;
	}
	if (masterkey_load(&km.cfg, &km.mk, err) != KILN_OK)
		return err->code;
	km.has_mk = true;
	return KILN_OK;
}

static void master_key_exit(void)
{
	auth_master_key_wipe(&km.mk);
	km.has_mk = false;
}

static int signing_init(struct kiln_error *err)
{
	if (!km.has_mk)
		return KILN_OK;
	km.signing = signing_new(km.pg, &km.mk, err);
	if (!km.signing)
		return err->code ? err->code : KILN_E_INTERNAL;
	/*
	 * The keys reload on a thread of their own (a connection of km.pg's is counted for it),
	 * not inline in a pause worker's signing, on the path of a pause.
	 */
	if (signing_start_refresh(km.signing, err) != KILN_OK)
		goto fail;
	km.pauser = pauser_new(km.pg, km.signing, km.cfg.node_id);
	if (!km.pauser) {
		kiln_error_set(err, KILN_E_NOMEM, "cannot start the pause workers");
		goto fail;
	}
	return KILN_OK;
fail:
	/* A failed stage's exit is not called: the reloading thread must not outlive km.pg. */
	signing_free(km.signing);
	km.signing = NULL;
	return err->code;
}

static void signing_exit(void)
{
	pauser_free(km.pauser);
	km.pauser = NULL;
	signing_free(km.signing);
	km.signing = NULL;
}

static int redis_init(struct kiln_error *err)
{
	km.rds = rds_open(&km.cfg, 1000);
	if (!km.rds)
		return kiln_error_set(err, KILN_E_INVALID,
				      "setting \"redis_url\" or \"redis_sentinels\": bad address \"%s\"",
				      *km.cfg.redis_sentinels ? km.cfg.redis_sentinels : km.cfg.redis_url);
	return KILN_OK;
}

static void redis_exit(void)
{
	rds_free(km.rds);
	km.rds = NULL;
}

static int meter_init(struct kiln_error *err)
{
	struct meter_opts o = {
		.node_id = km.cfg.node_id,
		.cgroup_root = km.cfg.meter_cgroup_root,
		.pin_root = km.cfg.meter_pin_root,
		.window_s = km.cfg.meter_window_s,
		.series_s = km.cfg.meter_series_s,
		.plan_max_sandboxes = km.cfg.plan_max_sandboxes,
		.plan_max_vcpu_milli = km.cfg.plan_max_vcpu_milli,
		.plan_max_memory_mib = km.cfg.plan_max_memory_mib,
		.plan_max_snapshot_bytes = km.cfg.plan_max_snapshot_gib << 30,
		.now_ns = km.clock_file ? test_clock : NULL,
		.mono_ns = km.clock_file ? test_clock_mono : NULL,
		.clock_ctx = (void *)km.clock_file,
		.live_ttl_s = km.cfg.meter_live_ttl_s,
		.log_keep_s = km.cfg.meter_log_keep_s,
		.commit_wait_ms = km.cfg.meter_commit_wait_ms ? km.cfg.meter_commit_wait_ms : -1,
		.pause = km.pauser ? pauser_ask : NULL,
		.pause_ctx = km.pauser,
		.test_flush_hold_ms = km.flush_hold_ms,
		.flush_thread = true,
	};
	enum kiln_err rc;

	price_card_init(&o.card, km.cfg.price_cpu_ucr_per_cpu_s, km.cfg.price_mem_ucr_per_gib_s,
			km.cfg.price_disk_ucr_per_gib_s, km.cfg.price_snapshot_ucr_per_gib_s);
	km.meter = meter_new(&o, km.pg, km.rds, err);
	if (!km.meter)
		return err->code;
	rc = meter_start(km.meter, err);
	if (rc == KILN_E_UNAVAILABLE) {
		/* Redis or Postgres not up yet: the first ticks try again. */
		log_warn("meter start deferred: %s", err->msg);
		kiln_error_clear(err);
		return KILN_OK;
	}
	return rc;
}

static void meter_exit(void)
{
	meter_free(km.meter);
	km.meter = NULL;
}

static const struct daemon_stage stages[] = {
	{ "master key", master_key_init, master_key_exit },
	{ "postgres", db_init, db_exit },
	{ "signing keys", signing_init, signing_exit },
	{ "redis", redis_init, redis_exit },
	{ "meter", meter_init, meter_exit },
};
#define NSTAGES (sizeof(stages) / sizeof(stages[0]))

static void usage(FILE *out)
{
	fprintf(out, "usage: kiln-meter [--config FILE]\n\n"
		     "Bills this node's sandboxes every second and writes the ledger every\n"
		     "meter_window_s seconds.\n\n");
	config_help(out);
}

static int64_t mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * PRICE_NS_PER_S + ts.tv_nsec;
}

/*
 * Ticks on whole seconds of the monotonic clock until asked to stop (daemon_run_loop's main
 * loop): a step of the wall clock moves no tick.
 */
static void run(void)
{
	struct kiln_error err = { 0 };
	int64_t prev = 0;
	unsigned quiet = 0;

	while (!daemon_stopping()) {
		int64_t now = mono_ns(), next = (now / PRICE_NS_PER_S + 1) * PRICE_NS_PER_S;
		struct timespec ts = { .tv_sec = next / PRICE_NS_PER_S, .tv_nsec = 0 };

		/* until the next whole second; a finished flush is applied as soon as it ends */
		for (int64_t t = mono_ns(); !daemon_stopping() && t < next; t = mono_ns()) {
			struct pollfd p = { .fd = meter_flush_fd(km.meter), .events = POLLIN };
			int ms = (int)((next - t + 999999) / 1000000);

			if (p.fd < 0) {
				if (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != EINTR)
					break;
				continue;
			}
			if (poll(&p, 1, ms) > 0)
				meter_flush_settle(km.meter);
		}
		if (daemon_stopping())
			break;
		now = mono_ns();
		if (prev && now - prev > PRICE_NS_PER_S * 3 / 2)
			meter_note_missed(km.meter,
					  (uint64_t)((now - prev + PRICE_NS_PER_S / 2) / PRICE_NS_PER_S) - 1);
		prev = now;
		kiln_error_clear(&err);
		if (meter_tick(km.meter, &err) != KILN_OK) {
			/* Say it once, then every minute while it lasts. */
			if (quiet++ % 60 == 0)
				log_warn("tick failed (the next one bills this time): %s", err.msg);
		} else if (quiet) {
			log_info("ticks work again after %u failures", quiet);
			quiet = 0;
		}
	}
}

/* The soft descriptor limit raised to the hard one: cg_read() keeps the three files it reads of
 * each VM's cgroup open, up to half the soft limit, and reads by path past it. */
static void raise_nofile(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			log_warn("cannot raise the descriptor limit: %s", strerror(errno));
	}
}

int main(int argc, char **argv)
{
	struct kiln_error err = { 0 };
	const char *config_path = NULL;
	int status;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(argv[i], "--config") && i + 1 < argc) {
			config_path = argv[++i];
		} else if (!strcmp(argv[i], "--test-clock") && i + 1 < argc) {
			km.clock_file = argv[++i];
		} else if (!strcmp(argv[i], "--test-flush-hold-ms") && i + 1 < argc) {
			km.flush_hold_ms = (unsigned)atoi(argv[++i]);
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (config_load(&km.cfg, config_path, config_path != NULL, &err) != KILN_OK) {
		fprintf(stderr, "kiln-meter: %s\n", err.msg);
		return 2;
	}
	log_init("kiln-meter", (enum log_level)log_level_parse(km.cfg.log_level), km.cfg.log_json);
	raise_nofile();
	curl_global_init(CURL_GLOBAL_DEFAULT);
	status = daemon_run_loop(stages, NSTAGES, run);
	config_release(&km.cfg);
	curl_global_cleanup();
	return status;
}
