/*
 * kiln-migrate - applies the embedded migrations to KILN_DATABASE_URL and exits.
 * Used by `make run` and the tests; every daemon also migrates at start.
 */
#include <stdio.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"
#include "migrations/migrate.h"

int main(int argc, char **argv)
{
	struct kiln_config cfg;
	struct kiln_error err = { 0 };
	struct pg *pool;
	int applied = 0;
	enum kiln_err rc;

	if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
		printf("usage: kiln-migrate [--config FILE]\n\n");
		config_help(stdout);
		return 0;
	}
	if (config_load(&cfg, argc > 2 && !strcmp(argv[1], "--config") ? argv[2] : NULL,
			argc > 2, &err) != KILN_OK) {
		fprintf(stderr, "kiln-migrate: %s\n", err.msg);
		return 2;
	}
	log_init("kiln-migrate", KLOG_INFO, cfg.log_json);
	pool = pg_new(cfg.database_url, 1);
	rc = pool ? migrate_apply(pool, migrations, migrations_count, &applied, &err)
		  : KILN_E_NOMEM;
	pg_free(pool);
	config_release(&cfg);
	if (rc != KILN_OK) {
		fprintf(stderr, "kiln-migrate: %s\n", err.msg[0] ? err.msg : kiln_strerror(rc));
		return 1;
	}
	printf("kiln-migrate: %d applied, %zu known\n", applied, migrations_count);
	return 0;
}
