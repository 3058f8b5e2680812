/*
 * testdb.h - a scratch database for a test binary that needs Postgres: testdb_open() reads the
 * services fixture's settings (KILN_SERVICES_ENV), creates a database of a unique name and applies
 * every migration; testdb_close() drops it. A test without the fixture fails, never skips.
 * testdb_sql() and testdb_sql_int() run a statement on a pool for a test's set-up and checks.
 * Include it after test.h.
 */
#ifndef KILN_TESTDB_H
#define KILN_TESTDB_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/pg.h"
#include "migrations/migrate.h"
#include "test.h"

struct testdb {
	struct pg *admin;	/* on the `postgres` database, to create and drop */
	struct pg *pg;		/* on the scratch database, migrated */
	char name[48];
	char url[600];		/* the scratch database's connection string */
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
	test_seed();
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
	snprintf(db->url, sizeof(db->url), "host=%s user=kiln dbname=%s", sockdir, db->name);
	db->pg = pg_new(db->url, 2);
	if (migrate_apply(db->pg, migrations, migrations_count, &applied, &err) != KILN_OK) {
		fprintf(stderr, "migrations: %s\n", err.msg);
		return -1;
	}
	return 0;
}

/* A connection of `pg`; the test ends (exit 1) when Postgres cannot give one. */
static __attribute__((unused)) struct pg_conn *testdb_conn(struct pg *pg)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c = NULL;

	if (pg_acquire(pg, &c, &err) != KILN_OK) {
		fprintf(stderr, "postgres: %s\n", err.msg);
		exit(1);
	}
	return c;
}

/* Runs the statement(s) `fmt` makes; a failure is printed and fails the current case (test.h). */
static void testdb_sql(struct pg *pg, const char *fmt, ...) __attribute__((format(printf, 2, 3), unused));
static void testdb_sql(struct pg *pg, const char *fmt, ...)
{
	char q[4096];
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(q, sizeof(q), fmt, ap);
	va_end(ap);
	if (pg_exec(c, q, &err) != KILN_OK) {
		fprintf(stderr, "sql failed: %s: %s\n", q, err.msg);
		test_case_failed = 1;
	}
	pg_release(pg, c);
}

/* The first column of the first row `fmt` selects as an integer; -1 (printed, the case failed) when
 * the query fails. */
static long long testdb_sql_int(struct pg *pg, const char *fmt, ...)
	__attribute__((format(printf, 2, 3), unused));
static long long testdb_sql_int(struct pg *pg, const char *fmt, ...)
{
	char q[4096];
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);
	struct pg_res *res = NULL;
	long long v = -1;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(q, sizeof(q), fmt, ap);
	va_end(ap);
	if (PGQ0(c, &res, &err, q) == KILN_OK) {
		v = pg_res_int(res, 0, 0, -1);
	} else {
		fprintf(stderr, "sql failed: %s: %s\n", q, err.msg);
		test_case_failed = 1;
	}
	pg_res_free(res);
	pg_release(pg, c);
	return v;
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
