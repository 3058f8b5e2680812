/*
 * testdb.h - a scratch database for a test binary that needs Postgres: testdb_open() reads the
 * services fixture's settings (KILN_SERVICES_ENV), creates a database of a unique name and applies
 * every migration; testdb_close() drops it. A test without the fixture fails, never skips.
 */
#ifndef KILN_TESTDB_H
#define KILN_TESTDB_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/pg.h"
#include "migrations/migrate.h"

struct testdb {
	struct pg *admin;	/* on the `postgres` database, to create and drop */
	struct pg *pg;		/* on the scratch database, migrated */
	char name[48];
	char redis_url[512];	/* the fixture's Redis, for the tests that need it */
};

/* 0, or -1 after printing why. `prefix` names the database (t_<prefix>_<random>). */
static int testdb_open(struct testdb *db, const char *prefix)
{
	const char *envf = getenv("KILN_SERVICES_ENV");
	char line[512], sockdir[512] = "", url[600];
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	int applied;
	FILE *f;

	memset(db, 0, sizeof(*db));
	if (!envf || !(f = fopen(envf, "r"))) {
		fprintf(stderr, "KILN_SERVICES_ENV is not set: this test needs the services fixture\n");
		return -1;
	}
	while (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = '\0';
		if (!strncmp(line, "KILN_TEST_SOCKDIR=", 18))
			snprintf(sockdir, sizeof(sockdir), "%s", line + 18);
		else if (!strncmp(line, "KILN_REDIS_URL=", 15))
			snprintf(db->redis_url, sizeof(db->redis_url), "%s", line + 15);
	}
	fclose(f);
	srand((unsigned)time(NULL) ^ (unsigned)getpid());
	snprintf(db->name, sizeof(db->name), "t_%s_%08x", prefix, (unsigned)rand());
	snprintf(url, sizeof(url), "host=%s user=kiln dbname=postgres", sockdir);
	db->admin = pg_new(url, 1);
	if (pg_acquire(db->admin, &c, &err) != KILN_OK) {
		fprintf(stderr, "postgres: %s\n", err.msg);
		return -1;
	}
	snprintf(line, sizeof(line), "CREATE DATABASE %s", db->name);
	if (pg_exec(c, line, &err) != KILN_OK) {
		pg_release(db->admin, c);
		fprintf(stderr, "postgres: %s\n", err.msg);
		return -1;
	}
	pg_release(db->admin, c);
	snprintf(url, sizeof(url), "host=%s user=kiln dbname=%s", sockdir, db->name);
	db->pg = pg_new(url, 2);
	if (migrate_apply(db->pg, migrations, migrations_count, &applied, &err) != KILN_OK) {
		fprintf(stderr, "migrations: %s\n", err.msg);
		return -1;
	}
	return 0;
}

/* Drops the scratch database and frees both pools. */
static void testdb_close(struct testdb *db)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	char sql[128];

	if (db->pg)
		pg_free(db->pg);
	if (db->admin && pg_acquire(db->admin, &c, &err) == KILN_OK) {
		snprintf(sql, sizeof(sql), "DROP DATABASE IF EXISTS %s WITH (FORCE)", db->name);
		pg_exec(c, sql, &err);
		pg_release(db->admin, c);
	}
	if (db->admin)
		pg_free(db->admin);
	memset(db, 0, sizeof(*db));
}

#endif
