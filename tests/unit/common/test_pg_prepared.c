/*
 * test_pg_prepared.c - statements prepared per pooled connection (pg_set_prepared, common/pg.c)
 * on a scratch database of the services fixture: a statement is prepared once and run by name
 * with other parameters, not inside a transaction, a bad one reports its own error, a connection
 * reopened prepares again, past the cap statements still run; a schema change under one is run
 * again prepared anew outside a transaction and fails cleanly inside one; a connection dropped in
 * a transaction is closed at release; pg_in_transaction. Statements run on each connection the
 * pool opens (pg_set_on_connect): on every connection, again after a reconnect, on connections
 * already open once set, and a failing one fails the acquire cleanly. pg_array_add: an array
 * literal Postgres reads back element for element, quotes, backslashes, commas, braces, spaces,
 * the empty string and NULL included.
 */
#include "test.h"
#include "testdb.h"

#include "common/buf.h"

static struct testdb db;

/* Runs `sql` with one parameter on `c` and returns its first column (-1 on an error). */
static long long one(struct pg_conn *c, const char *sql, const char *arg)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	long long v = -1;

	if (PGQ(c, &res, &err, sql, arg) == KILN_OK)
		v = pg_res_int(res, 0, 0, -1);
	pg_res_free(res);
	return v;
}

/* How many statements of text `sql` are prepared on `c`'s session. */
static long long prepared(struct pg_conn *c, const char *sql)
{
	return one(c, "SELECT count(*) FROM pg_prepared_statements WHERE statement = $1", sql);
}

static void a_statement_is_prepared_once_and_reused(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct pg_conn *c;

	pg_set_prepared(pg, true);
	c = testdb_conn(pg);
	CHECK_INT(one(c, "SELECT $1::int + 1", "1"), 2);
	CHECK_INT(one(c, "SELECT $1::int + 1", "41"), 42);
	CHECK_INT(prepared(c, "SELECT $1::int + 1"), 1);
	pg_release(pg, c);
	pg_free(pg);
}

static void not_prepared_inside_a_transaction(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	pg_set_prepared(pg, true);
	c = testdb_conn(pg);
	CHECK(pg_exec(c, "BEGIN", &err) == KILN_OK);
	CHECK_INT(one(c, "SELECT $1::int * 2", "21"), 42);
	/* a statement that does not prepare fails with its own error, not a prepare's */
	CHECK(PGQ(c, NULL, &err, "SELEC $1", "x") == KILN_E_INTERNAL);
	CHECK(pg_exec(c, "ROLLBACK", &err) == KILN_OK);
	CHECK_INT(prepared(c, "SELECT $1::int * 2"), 0);
	CHECK_INT(one(c, "SELECT $1::int * 2", "4"), 8);
	CHECK_INT(prepared(c, "SELECT $1::int * 2"), 1);
	kiln_error_clear(&err);
	CHECK(PGQ(c, NULL, &err, "SELEC $1", "x") == KILN_E_INTERNAL);
	CHECK(strstr(err.msg, "42601") != NULL);	/* syntax_error */
	CHECK_INT(one(c, "SELECT $1::int * 2", "5"), 10);	/* the connection goes on */
	pg_release(pg, c);
	pg_free(pg);
}

static void a_reopened_connection_prepares_again(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct pg_conn *c;
	long long pid;

	pg_set_prepared(pg, true);
	c = testdb_conn(pg);
	CHECK_INT(one(c, "SELECT $1::int - 1", "1"), 0);
	pid = one(c, "SELECT pg_backend_pid() + $1::int", "0");
	pg_release(pg, c);
	CHECK(testdb_sql_int(db.admin, "SELECT count(*) FROM pg_terminate_backend(%lld)", pid) == 1);
	c = testdb_conn(pg);
	CHECK_INT(one(c, "SELECT $1::int - 1", "1"), -1);	/* the lost connection, dropped */
	pg_release(pg, c);
	c = testdb_conn(pg);
	CHECK(one(c, "SELECT pg_backend_pid() + $1::int", "0") != pid);
	CHECK_INT(one(c, "SELECT $1::int - 1", "3"), 2);
	CHECK_INT(prepared(c, "SELECT $1::int - 1"), 1);
	pg_release(pg, c);
	pg_free(pg);
}

static void past_the_cap_statements_still_run(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct pg_conn *c;
	char sql[64];
	int right = 0;

	pg_set_prepared(pg, true);
	c = testdb_conn(pg);
	for (int i = 0; i < 200; i++) {
		snprintf(sql, sizeof(sql), "SELECT $1::int + %d", i);
		right += one(c, sql, "1") == i + 1;
	}
	CHECK_INT(right, 200);
	CHECK(one(c, "SELECT count(*) + $1::int FROM pg_prepared_statements", "0") <= 128);
	pg_release(pg, c);
	pg_free(pg);
}

/* The backend of `c`. */
static long long backend(struct pg_conn *c)
{
	return one(c, "SELECT pg_backend_pid() + $1::int", "0");
}

/* Outside a transaction, a statement whose result columns a schema change altered runs again. */
static void a_schema_change_is_run_again_outside_a_transaction(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct pg_conn *c;
	const char *sql = "SELECT * FROM pgprep_t WHERE a = $1::int";
	long long pid;

	testdb_sql(db.pg, "CREATE TABLE pgprep_t (a int); INSERT INTO pgprep_t VALUES (7)");
	pg_set_prepared(pg, true);
	c = testdb_conn(pg);
	CHECK_INT(one(c, sql, "7"), 7);
	pid = backend(c);
	pg_release(pg, c);
	testdb_sql(db.pg, "ALTER TABLE pgprep_t ADD COLUMN b int");
	c = testdb_conn(pg);
	CHECK_INT(one(c, sql, "7"), 7);
	CHECK_INT(backend(c), pid);		/* the same connection */
	CHECK_INT(prepared(c, sql), 1);		/* prepared anew */
	CHECK_INT(one(c, sql, "7"), 7);
	pg_release(pg, c);
	pg_free(pg);
}

/* Inside one, it fails (the caller's transaction is aborted); it is prepared anew once it ends. */
static void a_schema_change_fails_inside_a_transaction(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	const char *sql = "SELECT * FROM pgprep_u WHERE a = $1::int";
	long long pid;

	testdb_sql(db.pg, "CREATE TABLE pgprep_u (a int); INSERT INTO pgprep_u VALUES (7)");
	pg_set_prepared(pg, true);
	c = testdb_conn(pg);
	CHECK_INT(one(c, sql, "7"), 7);
	pid = backend(c);
	testdb_sql(db.pg, "ALTER TABLE pgprep_u ADD COLUMN b int");
	CHECK(pg_exec(c, "BEGIN", &err) == KILN_OK);
	CHECK(PGQ(c, NULL, &err, sql, "7") == KILN_E_INTERNAL);
	CHECK(strstr(err.msg, "0A000") != NULL);
	CHECK(pg_in_transaction(c));
	CHECK(pg_exec(c, "ROLLBACK", &err) == KILN_OK);
	/* in the next transaction it runs unprepared; then outside one it is prepared anew */
	CHECK(pg_exec(c, "BEGIN", &err) == KILN_OK);
	CHECK_INT(one(c, sql, "7"), 7);
	CHECK(pg_exec(c, "COMMIT", &err) == KILN_OK);
	CHECK_INT(one(c, sql, "7"), 7);
	CHECK_INT(prepared(c, sql), 1);
	CHECK_INT(backend(c), pid);
	pg_release(pg, c);
	pg_free(pg);
}

/* A read-only error (25006) in a transaction drops the connection: it is closed at release, not
 * left "idle in transaction (aborted)" until the slot is taken again. */
static void a_dropped_connection_is_closed_at_release(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	long long pid, left = -1;

	testdb_sql(db.pg, "CREATE TABLE pgprep_ro (a int)");
	c = testdb_conn(pg);
	pid = backend(c);
	CHECK(pg_exec(c, "BEGIN", &err) == KILN_OK);
	CHECK(pg_exec(c, "SET TRANSACTION READ ONLY", &err) == KILN_OK);
	CHECK(pg_exec(c, "INSERT INTO pgprep_ro VALUES (1)", &err) == KILN_E_UNAVAILABLE);
	pg_switch_seen(true);
	pg_release(pg, c);
	for (int i = 0; i < 50 && left != 0; i++) {
		if (i)
			nanosleep(&(struct timespec){ 0, 100 * 1000000L }, NULL);
		left = testdb_sql_int(db.admin, "SELECT count(*) FROM pg_stat_activity WHERE pid = %lld",
				      pid);
	}
	CHECK_INT(left, 0);
	c = testdb_conn(pg);
	CHECK(backend(c) != pid);
	pg_release(pg, c);
	pg_free(pg);
}

static void in_transaction_is_told(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct kiln_error err = { 0 };
	struct pg_conn *c = testdb_conn(pg);

	CHECK(!pg_in_transaction(c));
	CHECK(pg_exec(c, "BEGIN", &err) == KILN_OK);
	CHECK(pg_in_transaction(c));
	CHECK(pg_exec(c, "SELEC", &err) == KILN_E_INTERNAL);
	CHECK(pg_in_transaction(c));	/* aborted, still in it */
	pg_release(pg, c);		/* rolled back */
	c = testdb_conn(pg);
	CHECK(!pg_in_transaction(c));
	pg_release(pg, c);
	pg_free(pg);
}

/* The value of setting `name` in `c`'s session ("" on an error). */
static void setting(struct pg_conn *c, const char *name, char *out, size_t size)
{
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;

	PGQ(c, &res, &err, "SELECT current_setting($1)", name);
	snprintf(out, size, "%s", pg_res_str(res, 0, 0));
	pg_res_free(res);
}

#define CHECK_SETTING(c, name, want)                        \
	do {                                                \
		char v_[64];                                \
		setting((c), (name), v_, sizeof(v_));       \
		CHECK_STR(v_, (want));                      \
	} while (0)

/* pg_set_on_connect's statements run on each connection the pool opens, and again on one reopened
 * after its backend was terminated. */
static void on_connect_runs_on_each_connection_and_after_a_reconnect(void)
{
	struct pg *pg = pg_new(db.url, 2);
	struct pg_conn *c[2] = { NULL, NULL };
	long long pid;

	CHECK_INT(pg_set_on_connect(pg, "SET work_mem = '7MB'; SET application_name = 'pgprep_oc'"),
		  0);
	c[0] = testdb_conn(pg);
	c[1] = testdb_conn(pg);
	CHECK(backend(c[0]) != backend(c[1]));
	for (int i = 0; i < 2; i++) {
		CHECK_SETTING(c[i], "work_mem", "7MB");
		CHECK_SETTING(c[i], "application_name", "pgprep_oc");
	}
	pid = backend(c[0]);
	pg_release(pg, c[1]);
	pg_release(pg, c[0]);
	CHECK(testdb_sql_int(db.admin, "SELECT count(*) FROM pg_terminate_backend(%lld)", pid) == 1);
	c[0] = testdb_conn(pg);
	CHECK_INT(backend(c[0]), -1);	/* the terminated connection, dropped */
	pg_release(pg, c[0]);
	c[0] = testdb_conn(pg);
	CHECK(backend(c[0]) != pid && backend(c[0]) > 0);
	CHECK_SETTING(c[0], "work_mem", "7MB");
	CHECK_SETTING(c[0], "application_name", "pgprep_oc");
	pg_release(pg, c[0]);
	pg_free(pg);
}

/* Set on a pool whose connection is open, it reopens that connection with its settings. */
static void on_connect_set_later_reopens_open_connections(void)
{
	struct pg *pg = pg_new(db.url, 1);
	struct pg_conn *c = testdb_conn(pg);
	long long pid = backend(c);
	char server[64];

	setting(c, "work_mem", server, sizeof(server));	/* the server's own */
	CHECK(server[0] && strcmp(server, "7MB") != 0);
	pg_release(pg, c);
	CHECK_INT(pg_set_on_connect(pg, "SET work_mem = '7MB'"), 0);
	c = testdb_conn(pg);
	CHECK(backend(c) != pid);
	CHECK_SETTING(c, "work_mem", "7MB");
	pg_release(pg, c);
	CHECK_INT(pg_set_on_connect(pg, NULL), 0);	/* none again: the server's own */
	c = testdb_conn(pg);
	CHECK_SETTING(c, "work_mem", server);
	pg_release(pg, c);
	pg_free(pg);
}

/* How many sessions named `app` are connected. */
static long long sessions(const char *app)
{
	return testdb_sql_int(db.admin, "SELECT count(*) FROM pg_stat_activity "
					"WHERE application_name = '%s'", app);
}

/* A failing on-connect statement fails the acquire (no connection handed out, none left open,
 * the slot free); with a statement that runs, the same pool connects. */
static void a_failing_on_connect_statement_fails_the_acquire(void)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c = NULL;
	char url[700];
	struct pg *pg;
	long long left = -1;

	snprintf(url, sizeof(url), "%s application_name=pgprep_ocfail", db.url);
	pg = pg_new(url, 1);
	CHECK_INT(pg_set_on_connect(pg, "SET work_mem = '7MB'; SET no_such_setting = 1"), 0);
	for (int i = 0; i < 2; i++) {	/* twice: the slot was handed back */
		CHECK_INT(pg_acquire(pg, &c, &err), KILN_E_UNAVAILABLE);
		CHECK(c == NULL);
		pg_release(pg, c);	/* one wrongly handed out, so the next acquire cannot hang */
		c = NULL;
	}
	for (int i = 0; i < 50 && left != 0; i++) {
		if (i)
			nanosleep(&(struct timespec){ 0, 100 * 1000000L }, NULL);
		left = sessions("pgprep_ocfail");
	}
	CHECK_INT(left, 0);
	CHECK_INT(pg_set_on_connect(pg, "SET work_mem = '7MB'"), 0);
	kiln_error_clear(&err);
	CHECK_INT(pg_acquire(pg, &c, &err), KILN_OK);
	if (c) {
		CHECK_SETTING(c, "work_mem", "7MB");
		pg_release(pg, c);
	}
	pg_free(pg);
}

static void an_array_literal_reads_back_element_for_element(void)
{
	static const char *const v[] = { "a", "quo\"te", "back\\slash", "com,ma", "{brace}", "",
					 NULL, "sp ace", "NULL", "\\\"" };
	const int n = (int)(sizeof(v) / sizeof(v[0]));
	struct pg *pg = pg_new(db.url, 1);
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	struct buf b;

	buf_init(&b, 1u << 20);
	CHECK(buf_appends(&b, "{") == 0);
	for (int i = 0; i < n; i++)
		CHECK(pg_array_add(&b, v[i]) == 0);
	CHECK(buf_appends(&b, "}") == 0);
	c = testdb_conn(pg);
	CHECK(PGQ(c, &res, &err, "SELECT u.v FROM unnest($1::text[]) WITH ORDINALITY AS u(v, o) "
		  "ORDER BY u.o", b.data) == KILN_OK);
	CHECK_INT(pg_res_rows(res), n);
	for (int i = 0; i < n && i < pg_res_rows(res); i++) {
		const char *got = pg_res_get(res, i, 0);

		if (!v[i])
			CHECK(got == NULL);
		else
			CHECK_STR(got ? got : "(null)", v[i]);
	}
	pg_res_free(res);
	pg_release(pg, c);
	pg_free(pg);
	buf_release(&b);
}

int main(void)
{
	if (testdb_open(&db, "pgprep") != 0)
		return 1;
	TEST(a_statement_is_prepared_once_and_reused);
	TEST(not_prepared_inside_a_transaction);
	TEST(a_reopened_connection_prepares_again);
	TEST(past_the_cap_statements_still_run);
	TEST(a_schema_change_is_run_again_outside_a_transaction);
	TEST(a_schema_change_fails_inside_a_transaction);
	TEST(a_dropped_connection_is_closed_at_release);
	TEST(in_transaction_is_told);
	TEST(on_connect_runs_on_each_connection_and_after_a_reconnect);
	TEST(on_connect_set_later_reopens_open_connections);
	TEST(a_failing_on_connect_statement_fails_the_acquire);
	TEST(an_array_literal_reads_back_element_for_element);
	testdb_close(&db);
	return test_summary();
}
