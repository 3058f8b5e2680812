/*
 * gateway.c - kiln-gateway: the public HTTP API of API.md.
 *
 * Start order is the table below, stop order its reverse. SIGTERM and SIGINT stop accepting new
 * connections and let requests in flight finish (for at most 30 s).
 */
#include "api/gateway.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "migrations/migrate.h"

#define GRACE_S 30

static struct gateway gw;
static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
	stop_requested = sig;
}

static struct http_route *route_table;
static size_t route_count;

static int routes_init(struct kiln_error *err)
{
	const struct route_group *groups[] = { &routes_ops };
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
	if (!gw.pg)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = migrate_apply(gw.pg, migrations, migrations_count, &applied, err);
	if (rc == KILN_OK && applied)
		log_info("applied %d migrations", applied);
	return rc;
}

static void db_exit(void)
{
	pg_free(gw.pg);
	gw.pg = NULL;
}

static int redis_init(struct kiln_error *err)
{
	gw.rds = rds_new(gw.cfg.redis_url, 500);
	if (!gw.rds)
		return kiln_error_set(err, KILN_E_INVALID, "setting \"redis_url\": bad address \"%s\"",
				      gw.cfg.redis_url);
	return KILN_OK;
}

static void redis_exit(void)
{
	rds_free(gw.rds);
	gw.rds = NULL;
}

static int http_init(struct kiln_error *err)
{
	struct http_server_opts o = {
		.listen = gw.cfg.listen,
		.max_connections = (unsigned)gw.cfg.http_max_connections,
		.body_max = (size_t)gw.cfg.http_body_max,
		.timeout_s = (unsigned)gw.cfg.http_timeout_s,
		.routes = route_table,
		.nroutes = route_count,
		.app = &gw,
	};

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

static const struct {
	const char *name;
	int (*init)(struct kiln_error *err);
	void (*exit)(void);
} stages[] = {
	{ "routes", routes_init, routes_exit },
	{ "postgres", db_init, db_exit },
	{ "redis", redis_init, redis_exit },
	{ "http", http_init, http_exit },
};
#define NSTAGES (sizeof(stages) / sizeof(stages[0]))

static void usage(FILE *out)
{
	fprintf(out, "usage: kiln-gateway [--config FILE]\n\n");
	config_help(out);
}

int main(int argc, char **argv)
{
	struct kiln_error err = { 0 };
	const char *config_path = NULL;
	size_t started = 0;
	int status = 0;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
			usage(stdout);
			return 0;
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
	signal(SIGPIPE, SIG_IGN);
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);

	for (; started < NSTAGES; started++) {
		if (stages[started].init(&err) != KILN_OK) {
			log_error("start failed at \"%s\": %s", stages[started].name, err.msg);
			status = 1;
			break;
		}
	}
	while (!status && !stop_requested)
		pause();
	if (stop_requested)
		log_info("stopping on signal %d", (int)stop_requested);
	while (started > 0)
		stages[--started].exit();
	config_release(&gw.cfg);
	return status;
}
