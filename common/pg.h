/*
 * pg.h - a small pool of Postgres connections over libpq.
 *
 * A connection is taken with pg_acquire() and handed back with pg_release(). A connection that
 * broke is reset on the next acquire, so a restarted Postgres is picked up without restarting the
 * process. The connection string may name several hosts (libpq's `host=a,b port=x,y
 * target_session_attrs=read-write`, or a postgresql:// URI with a host list): a connection whose
 * statement failed because its server went away, shut down or turned read-only (SQLSTATE 08*,
 * 57P01-57P03, 25006) is closed, and the next acquire connects to whichever host is the primary
 * now (docs/operations.md, "Postgres: primary and standby"). Results are `struct pg_res`, a thin owner of libpq's result: PGresult never leaves this
 * module. Every call that reaches Postgres returns an enum kiln_err: KILN_E_UNAVAILABLE when it
 * cannot be reached, KILN_E_CONFLICT on a unique violation, KILN_E_INTERNAL on any other SQL error.
 */
#ifndef KILN_PG_H
#define KILN_PG_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

struct pg;
struct pg_conn;
struct pg_res;

/* A pool of at most `size` connections to `conninfo`. Connects lazily; NULL when out of memory. */
struct pg *pg_new(const char *conninfo, int size);
void pg_free(struct pg *pool);

/*
 * With `on`, each statement pg_query() runs is prepared on its connection the first time that
 * connection runs it outside a transaction (at most 128 a connection; a connection reopened
 * starts with none), and run by name afterwards: Postgres parses it once per connection instead
 * of every time (the first 128 keep their slots; later ones run unprepared). For a pool whose
 * statements are fixed strings; set it after migrations. A prepared statement whose result columns
 * a schema change altered (a newer gateway migrated) makes the connection prepare all of its
 * statements anew: outside a transaction the call is run again and succeeds; inside one it fails
 * (the transaction is aborted) and the statements run unprepared until it ends.
 */
void pg_set_prepared(struct pg *pool, bool on);

/*
 * Runs `sql` (one statement or several, as PQexec takes them: "SET jit = off") on each connection
 * the pool opens, right after it connects and before anything else runs on it. Settings made so
 * hold whatever the connection string's options= or PGOPTIONS say, and need no startup option,
 * which a connection pooler may refuse (the pooler must keep sessions: one pooling by transaction
 * would not keep them). A connection on which it fails is closed, with a warning, and the acquire
 * that opened it fails (KILN_E_UNAVAILABLE). Connections already open are reopened on their next
 * acquire; NULL runs nothing. Set it before threads share the pool. Returns 0, or -1 when out of
 * memory (the previous setting stays).
 */
int pg_set_on_connect(struct pg *pool, const char *sql);

/* Takes a live connection, waiting while all are in use. KILN_E_UNAVAILABLE if none can connect. */
enum kiln_err pg_acquire(struct pg *pool, struct pg_conn **out, struct kiln_error *err);
void pg_release(struct pg *pool, struct pg_conn *c);

/*
 * Runs `sql` with `nparams` text parameters ($1..; a NULL entry is SQL NULL). When `out` is not
 * NULL it receives the result, which the caller frees with pg_res_free(). SQLSTATE of a failure is
 * copied into `sqlstate` (6 bytes) when not NULL.
 */
enum kiln_err pg_query(struct pg_conn *c, struct pg_res **out, struct kiln_error *err,
		       const char *sql, int nparams, const char *const *params);

/* pg_query with the parameters written inline: PGQ(c, &res, err, "select $1", a). */
#define PGQ(c, out, err, sql, ...)                                                               \
	pg_query((c), (out), (err), (sql),                                                       \
		 (int)(sizeof((const char *[]){ NULL, __VA_ARGS__ }) / sizeof(const char *)) - 1, \
		 ((const char *[]){ NULL, __VA_ARGS__ }) + 1)
#define PGQ0(c, out, err, sql) pg_query((c), (out), (err), (sql), 0, NULL)

/*
 * Runs a statement that returns no rows (BEGIN, COMMIT, DDL); same errors as pg_query. A COMMIT
 * whose answer is lost because the server went away (a failover) is not reported as failed when
 * it did commit: its transaction's fate is asked of the primary the pool reaches then
 * (txid_status, for up to 10 s), and KILN_OK returned when it committed; `c` is a fresh
 * connection afterwards either way.
 */
enum kiln_err pg_exec(struct pg_conn *c, const char *sql, struct kiln_error *err);

/* Whether `c` is inside a transaction (BEGIN ran, no COMMIT or ROLLBACK yet; or one failed). */
bool pg_in_transaction(const struct pg_conn *c);

int pg_res_rows(const struct pg_res *r);
/* The text of row `row`, column `col`, owned by `r`; NULL for SQL NULL or out of range. */
const char *pg_res_get(const struct pg_res *r, int row, int col);
/* Like pg_res_get, with "" for NULL. */
const char *pg_res_str(const struct pg_res *r, int row, int col);
long long pg_res_int(const struct pg_res *r, int row, int col, long long def);
bool pg_res_bool(const struct pg_res *r, int row, int col);
void pg_res_free(struct pg_res *r);

/* Whether SQLSTATE `state` says the server is gone or not the primary (the pool reconnects). */
bool pg_sqlstate_switch(const char *state);

/*
 * Whether a statement on this thread failed because the primary went away (a lost connection, a
 * shutdown, a read-only server) since the flag was last cleared; `clear` clears it. The HTTP engine
 * reads it to answer such a request 503 `database_switch` (common/err.h).
 */
bool pg_switch_seen(bool clear);

/* Checks that Postgres answers (select 1) within the pool's connect timeout. */
enum kiln_err pg_ping(struct pg *pool, struct kiln_error *err);

struct buf;
/*
 * Appends `v` to the array literal in `b` (begun with "{", so a comma goes before any element
 * but the first) as one element: double-quoted with '"' and '\\' escaped, or NULL when `v` is.
 * 0, or the buffer's error.
 */
int pg_array_add(struct buf *b, const char *v);

#endif
