/*
 * gateway.c - kiln-gateway: the public HTTP API of docs/openapi.yaml.
 *
 * Start order is the table below, stop order its reverse. SIGTERM and SIGINT stop accepting new
 * connections and let requests in flight finish (for at most 30 s).
 */
#include "api/gateway.h"

#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "api/authn.h"
#include "api/commitq.h"
#include "api/debt.h"
#include "api/e2b.h"
#include "api/failover.h"
#include "api/ports.h"
#include "auth/masterkey.h"
#include "common/clock.h"
#include "common/daemon.h"
#include "common/log.h"
#include "migrations/migrate.h"

#define GRACE_S 30

static struct gateway gw;

static struct http_route *route_table;
static size_t route_count;

static int routes_init(struct kiln_error *err)
{
	const struct route_group *groups[] = { &routes_ops, &routes_dashboard, &routes_keys, &routes_tenants, &routes_connlog,
						&routes_audit, &routes_sandboxes, &routes_snapshots, &routes_storage, &routes_templates,
						&routes_secrets, &routes_ports, &routes_nodes, &routes_billing };
	size_t n = 0, k = 0;

	for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++)
		n += groups[g]->n;
	route_table = calloc(n, sizeof(*route_table));
	if (!route_table)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (size_t g = 0; g < sizeof(groups) / sizeof(groups[0]); g++)
		for (size_t i = 0; i < groups[g]->n; i++)
			route_table[k++] = groups[g]->routes[i];
	route_count = n;
	return KILN_OK;
}

static void routes_exit(void)
{
	free(route_table);
	route_table = NULL;
}

static int db_init(struct kiln_error *err)
{
	int applied = 0;
	enum kiln_err rc;

	gw.pg = pg_new(gw.cfg.database_url, (int)gw.cfg.db_pool_size);
	gw.audit_pg = pg_new(gw.cfg.database_url, GW_AUDIT_POOL);
	if (!gw.pg || !gw.audit_pg)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = migrate_apply(gw.pg, migrations, migrations_count, &applied, err);
	if (rc == KILN_OK && applied)
		log_info("applied %d migrations", applied);
	/* The schema is this version's now: each connection prepares what it runs. */
	pg_set_prepared(gw.pg, true);
	pg_set_prepared(gw.audit_pg, true);
	return rc;
}

static void db_exit(void)
{
	pg_free(gw.pg);
	pg_free(gw.audit_pg);
	gw.pg = NULL;
	gw.audit_pg = NULL;
}

/*
 * How long the commit queue's writer retries a group while Postgres is unavailable: a lost
 * connection or a quick switch of primaries, not a failover's whole length; past it the reply
 * goes out and an outcome is stored after it (gw_done), as for a 5xx.
 */
#define AUDIT_GROUP_RETRY_MS 2000

/* The writer that commits audit rows and Idempotency-Key outcomes in groups (api/commitq.h). */
static int commitq_init(struct kiln_error *err)
{
	gw.commitq = commitq_new(gw.audit_pg, AUDIT_GROUP_RETRY_MS, err);
	return gw.commitq ? KILN_OK : err->code;
}

static void commitq_exit(void)
{
	commitq_free(gw.commitq);
	gw.commitq = NULL;
}

/* Reads the master key, derives the API key pepper from it and prepares that for checks. */
static int master_key_init(struct kiln_error *err)
{
	if (masterkey_load(&gw.cfg, &gw.mk, err) != KILN_OK)
		return err->code;
	if (auth_master_derive(&gw.mk, "apikey-pepper", gw_pepper, sizeof(gw_pepper), err) !=
	    KILN_OK)
		return err->code;
	gw_pepper_prepared = auth_apikey_pepper_new(gw_pepper, sizeof(gw_pepper));
	if (!gw_pepper_prepared)
		return kiln_error_set(err, KILN_E_NOMEM, "cannot prepare the api key pepper");
	return KILN_OK;
}

static void master_key_exit(void)
{
	auth_master_key_wipe(&gw.mk);
	memset(gw_pepper, 0, sizeof(gw_pepper));
	auth_apikey_pepper_free(gw_pepper_prepared);
	gw_pepper_prepared = NULL;
}

static int signing_init(struct kiln_error *err)
{
	enum kiln_err rc;

	gw.signing = signing_new(gw.pg, &gw.mk, err);
	if (!gw.signing)
		return err->code ? err->code : KILN_E_INTERNAL;
	rc = signing_start_refresh(gw.signing, err);
	if (rc == KILN_OK && gw.cfg.admin_key_file)
		rc = gw_bootstrap_admin(&gw, gw.cfg.admin_key_file, err);
	if (rc != KILN_OK) {
		/* A failed stage's exit is not called: the reloader must not outlive gw.pg. */
		signing_free(gw.signing);
		gw.signing = NULL;
	}
	return rc;
}

static void signing_exit(void)
{
	signing_free(gw.signing);
	gw.signing = NULL;
}

static int redis_init(struct kiln_error *err)
{
	gw.rds = rds_open(&gw.cfg, 500);
	if (!gw.rds)
		return kiln_error_set(err, KILN_E_INVALID,
				      "setting \"redis_url\" or \"redis_sentinels\": bad address \"%s\"",
				      *gw.cfg.redis_sentinels ? gw.cfg.redis_sentinels : gw.cfg.redis_url);
	gw.rl = ratelimit_new(gw.rds, true);
	if (!gw.rl)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	return KILN_OK;
}

static void redis_exit(void)
{
	ratelimit_free(gw.rl);
	gw.rl = NULL;
	rds_free(gw.rds);
	gw.rds = NULL;
}

/* The API server's settings (the E2B listener's inner API server takes the same). */
static void http_opts(struct http_server_opts *o)
{
	*o = (struct http_server_opts){
		.listen = gw.cfg.listen,
		.max_connections = (unsigned)gw.cfg.http_max_connections,
		.body_max = (size_t)gw.cfg.http_body_max,
		.timeout_s = (unsigned)gw.cfg.http_timeout_s,
		.max_per_addr = (unsigned)gw.cfg.http_max_connections_per_addr,
		.header_timeout_s = (unsigned)gw.cfg.http_header_timeout_s,
		.body_min_rate = (unsigned)gw.cfg.http_body_min_rate,
		.trusted_proxies = gw.cfg.http_trusted_proxies,
		.routes = route_table,
		.nroutes = route_count,
		.before = gw_before,
		.reply = gw_audit,
		.done = gw_done,
		.app = &gw,
	};
}

static int http_init(struct kiln_error *err)
{
	struct http_server_opts o;

	http_opts(&o);
	gw.http = http_server_start(&o, err);
	if (!gw.http)
		return err->code;
	log_info("listening on \"%s\"", gw.cfg.listen);
	return KILN_OK;
}

static void http_exit(void)
{
	http_server_stop(gw.http, GRACE_S);
	gw.http = NULL;
}

/* E2B's API on its own listener (config e2b_listen; api/e2b.h), calling this gateway's API. */
static int e2b_init(struct kiln_error *err)
{
	struct http_server_opts o;

	http_opts(&o);
	return e2b_start(&gw, &o, err);
}

static void e2b_exit(void)
{
	e2b_stop(GRACE_S);
}

/* The port URL listener (config ports_listen, api/portproxy.c), beside the API's. */
static int ports_init(struct kiln_error *err)
{
	return portproxy_start(&gw, err);
}

static void ports_exit(void)
{
	portproxy_stop();
}

/* The operator's allow list of storage endpoints (config storage_allow, common/netaddr.h). */
static int storage_allow_init(struct kiln_error *err)
{
	return netaddr_allow_parse(gw.cfg.storage_allow, &gw.storage_allow, err);
}

static void storage_allow_exit(void)
{
	netaddr_allow_free(gw.storage_allow);
	gw.storage_allow = NULL;
}

/*
 * The sweep of expired Idempotency-Key records: every idempotency_sweep_s seconds, in bounded
 * batches (gw_idempotency_sweep). Every gateway sweeps; the deletes are the same on each.
 * The same pass does the work on tenants in debt (gw_debt_sweep, api/debt.h).
 */
static pthread_t sweep_thread;
static pthread_mutex_t sweep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sweep_cond;
static bool sweep_stopping, sweep_started;

static void *sweep_main(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&sweep_lock);
	while (!sweep_stopping) {
		struct timespec until;
		struct kiln_error err = { 0 };
		long long deleted = 0;

		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += gw.cfg.idempotency_sweep_s;
		while (!sweep_stopping &&
		       pthread_cond_timedwait(&sweep_cond, &sweep_lock, &until) == 0)
			;
		if (sweep_stopping)
			break;
		pthread_mutex_unlock(&sweep_lock);
		if (gw_idempotency_sweep(&gw, &deleted, &err) != KILN_OK)
			log_warn("idempotency sweep: %s", err.msg);
		else if (deleted)
			log_info("idempotency sweep: deleted %lld expired records", deleted);
		kiln_error_clear(&err);
		if (gw_debt_sweep(&gw, &deleted, &err) != KILN_OK)
			log_warn("debt sweep: %s", err.msg);
		kiln_error_clear(&err);
		{
			int failed = 0;
			if (templates_builds_sweep(&gw, &failed, &err) != KILN_OK)
				log_warn("template builds sweep: %s", err.msg);
			else if (failed)
				log_warn("template builds sweep: %d builds failed as hung", failed);
		}
		pthread_mutex_lock(&sweep_lock);
	}
	pthread_mutex_unlock(&sweep_lock);
	return NULL;
}

static int sweep_init(struct kiln_error *err)
{
	clock_cond_init(&sweep_cond, CLOCK_MONOTONIC);
	sweep_stopping = false;
	if (pthread_create(&sweep_thread, NULL, sweep_main, NULL) != 0) {
		pthread_cond_destroy(&sweep_cond);
		return kiln_error_set(err, KILN_E_INTERNAL, "cannot start the idempotency sweep");
	}
	sweep_started = true;
	return KILN_OK;
}

static void sweep_exit(void)
{
	if (!sweep_started)
		return;
	pthread_mutex_lock(&sweep_lock);
	sweep_stopping = true;
	pthread_cond_signal(&sweep_cond);
	pthread_mutex_unlock(&sweep_lock);
	pthread_join(sweep_thread, NULL);
	pthread_cond_destroy(&sweep_cond);
	sweep_started = false;
}

/* The live balances rebuilt after a Redis failover (api/failover.h). */
static int failover_init(struct kiln_error *err)
{
	return gw_failover_start(&gw, err);
}

/* The API key and tenant caches (api/authn.h). */
static int authn_init(struct kiln_error *err)
{
	return gw_authn_init(err);
}

static const struct daemon_stage stages[] = {
	{ "routes", routes_init, routes_exit },
	{ "storage allow list", storage_allow_init, storage_allow_exit },
	{ "master key", master_key_init, master_key_exit },
	{ "postgres", db_init, db_exit },
	{ "audit writer", commitq_init, commitq_exit },
	{ "signing keys", signing_init, signing_exit },
	{ "redis", redis_init, redis_exit },
	{ "idempotency sweep", sweep_init, sweep_exit },
	{ "redis failover", failover_init, gw_failover_stop },
	{ "credential caches", authn_init, gw_authn_exit },
	{ "http", http_init, http_exit },
	{ "e2b", e2b_init, e2b_exit },
	{ "port URLs", ports_init, ports_exit },
};
#define NSTAGES (sizeof(stages) / sizeof(stages[0]))

static void usage(FILE *out)
{
	fprintf(out, "usage: kiln-gateway [--config FILE] [--rotate-signing-key]\n\n"
		     "  --rotate-signing-key  make a new JWT signing key, retire the old ones (they\n"
		     "                        verify for another hour), and exit\n\n");
	config_help(out);
}

int main(int argc, char **argv)
{
	struct kiln_error err = { 0 };
	const char *config_path = NULL;
	int status = 0;
	bool rotate = false;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			usage(stdout);
			return 0;
		} else if (!strcmp(argv[i], "--rotate-signing-key")) {
			rotate = true;
		} else if (!strcmp(argv[i], "--config") && i + 1 < argc) {
			config_path = argv[++i];
		} else {
			usage(stderr);
			return 2;
		}
	}
	if (config_load(&gw.cfg, config_path, config_path != NULL, &err) != KILN_OK) {
		fprintf(stderr, "kiln-gateway: %s\n", err.msg);
		return 2;
	}
	log_init("kiln-gateway", (enum log_level)log_level_parse(gw.cfg.log_level),
		 gw.cfg.log_json);
#ifdef KILN_BENCH_NO_AUTH
	if (!gw_bench_no_auth_allowed(&err)) {
		fprintf(stderr, "kiln-gateway: %s\n", err.msg);
		return 2;
	}
#endif
	curl_global_init(CURL_GLOBAL_DEFAULT);
	if (rotate) {
		char kid[AUTH_KID_MAX] = "";
		if (master_key_init(&err) == KILN_OK && db_init(&err) == KILN_OK &&
		    signing_rotate(gw.pg, &gw.mk, kid, &err) == KILN_OK)
			printf("new signing key %s\n", kid);
		else
			status = 1, fprintf(stderr, "kiln-gateway: %s\n", err.msg);
		db_exit();
		master_key_exit();
		config_release(&gw.cfg);
		return status;
	}
	status = daemon_run(stages, NSTAGES);
	config_release(&gw.cfg);
	curl_global_cleanup();
	return status;
}
