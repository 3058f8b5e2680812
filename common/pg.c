/*
 * pg.c - a pool of libpq connections with reset on failure and primary switches (see pg.h).
 */
#include "pg.h"

#include <libpq-fe.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "common/buf.h"
#include "common/log.h"

/*
 * Statements prepared on one connection (pg_set_prepared); past this many, the rest run unprepared.
 * The first ones run keep their slots: no statement is evicted, since a set of statements wider
 * than the cap, run in turn, would then be prepared anew on every call.
 */
#define PG_STMT_MAX 128

struct pg_conn {
	PGconn *conn;
	bool busy;
	bool drop;	/* lost, read-only or shutting down: closed at release, reopened on acquire */
	bool stale;	/* a schema change altered a prepared statement: all are prepared anew */
	unsigned gen;	/* the pool's generation when it was opened */
	struct pg *pool;
	int nstmts;	/* prepared on `conn` as "k0".. in this order */
	char *stmts[PG_STMT_MAX];
	unsigned long stmt_hash[PG_STMT_MAX];
};

/* Set on this thread when a statement failed because the primary went away (pg_switch_seen). */
static __thread bool switch_seen;

struct pg {
	char *conninfo;
	int size;
	struct pg_conn *conns;
	pthread_mutex_t lock;
	pthread_cond_t freed;
	bool prepared;		/* pg_set_prepared() */
	char *on_connect;	/* pg_set_on_connect(); NULL: nothing */
	/* Bumped when a connection saw the primary go away: the others, opened before, are reopened
	 * on their next acquire instead of failing one more request each. */
	_Atomic unsigned gen;
};

struct pg_res {
	PGresult *res;
};

struct pg *pg_new(const char *conninfo, int size)
{
	struct pg *p = calloc(1, sizeof(*p));

	if (!p)
		return NULL;
	p->conninfo = strdup(conninfo);
	p->conns = calloc((size_t)size, sizeof(*p->conns));
	if (!p->conninfo || !p->conns) {
		free(p->conninfo);
		free(p->conns);
		free(p);
		return NULL;
	}
	p->size = size;
	for (int i = 0; i < size; i++)
		p->conns[i].pool = p;
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->freed, NULL);
	return p;
}

/* Forgets the statements prepared on `c`: its connection is closed or replaced. */
static void stmts_forget(struct pg_conn *c)
{
	for (int i = 0; i < c->nstmts; i++)
		free(c->stmts[i]);
	c->nstmts = 0;
	c->stale = false;
}

void pg_set_prepared(struct pg *p, bool on)
{
	p->prepared = on;
}

int pg_set_on_connect(struct pg *p, const char *sql)
{
	char *copy = NULL;

	if (sql && !(copy = strdup(sql)))
		return -1;
	free(p->on_connect);
	p->on_connect = copy;
	/* Connections opened before it lack its settings: they are reopened, as after a switch. */
	p->gen++;
	return 0;
}

void pg_free(struct pg *p)
{
	if (!p)
		return;
	for (int i = 0; i < p->size; i++) {
		if (p->conns[i].conn)
			PQfinish(p->conns[i].conn);
		stmts_forget(&p->conns[i]);
	}
	pthread_mutex_destroy(&p->lock);
	pthread_cond_destroy(&p->freed);
	free(p->conns);
	free(p->conninfo);
	free(p->on_connect);
	free(p);
}

/* Server notices (e.g. "relation already exists, skipping") are not errors: debug log only. */
static void pg_notice(void *arg, const char *message)
{
	log_debug("postgres: %s", message);
}

/* Runs the pool's on-connect statements on `conn`, just opened. -1 (warned) when they failed. */
static int on_connect_run(PGconn *conn, const char *sql)
{
	PGresult *res = PQexec(conn, sql);
	ExecStatusType st = PQresultStatus(res);

	PQclear(res);
	if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK)
		return 0;
	log_warn("postgres: the statements run on connect failed, the connection is closed: %s",
		 PQerrorMessage(conn));
	return -1;
}

/* Opens (or reopens) `c`'s connection. Returns 0 when it is usable. */
static int pg_conn_open(struct pg *p, struct pg_conn *c)
{
	/* The configured string (key=value or URI, one host or several) is expanded as dbname;
	 * the later connect_timeout bounds each host's connect so a down database fails fast. */
	const char *const keys[] = { "dbname", "connect_timeout", NULL };
	const char *const vals[] = { p->conninfo, "3", NULL };

	unsigned gen = p->gen;

	if (c->conn && !c->drop && c->gen == gen && PQstatus(c->conn) == CONNECTION_OK)
		return 0;
	if (c->conn) {
		PQfinish(c->conn);
		c->conn = NULL;
	}
	stmts_forget(c);
	c->drop = false;
	c->gen = gen;
	c->conn = PQconnectdbParams(keys, vals, 1);
	if (PQstatus(c->conn) != CONNECTION_OK) {
		log_warn("postgres connect failed: %s", PQerrorMessage(c->conn));
		PQfinish(c->conn);
		c->conn = NULL;
		return -1;
	}
	PQsetNoticeProcessor(c->conn, pg_notice, NULL);
	if (p->on_connect && on_connect_run(c->conn, p->on_connect) < 0) {
		PQfinish(c->conn);
		c->conn = NULL;
		return -1;
	}
	return 0;
}

enum kiln_err pg_acquire(struct pg *p, struct pg_conn **out, struct kiln_error *err)
{
	struct pg_conn *c = NULL;

	*out = NULL;
	pthread_mutex_lock(&p->lock);
	for (;;) {
		for (int i = 0; i < p->size && !c; i++)
			if (!p->conns[i].busy)
				c = &p->conns[i];
		if (c)
			break;
		pthread_cond_wait(&p->freed, &p->lock);
	}
	c->busy = true;
	pthread_mutex_unlock(&p->lock);

	if (pg_conn_open(p, c)) {
		pg_release(p, c);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "postgres is unavailable");
	}
	*out = c;
	return KILN_OK;
}

void pg_release(struct pg *p, struct pg_conn *c)
{
	if (!c)
		return;
	/*
	 * A connection returned mid-transaction (an error path) must not leak its transaction. One
	 * to drop is closed now, not on the slot's next acquire: its server may not answer a
	 * ROLLBACK, and one that does (a read-only error, 25006) would otherwise keep the session
	 * "idle in transaction (aborted)" until then.
	 */
	if (c->conn && c->drop) {
		PQfinish(c->conn);
		c->conn = NULL;
		stmts_forget(c);
	} else if (c->conn && PQstatus(c->conn) == CONNECTION_OK &&
		   PQtransactionStatus(c->conn) != PQTRANS_IDLE) {
		PGresult *r = PQexec(c->conn, "ROLLBACK");
		PQclear(r);
	}
	pthread_mutex_lock(&p->lock);
	c->busy = false;
	pthread_cond_signal(&p->freed);
	pthread_mutex_unlock(&p->lock);
}

bool pg_sqlstate_switch(const char *state)
{
	/* 08: connection exceptions; 57P01-57P03: admin shutdown, crash shutdown, cannot connect
	 * now; 25006: read-only transaction (a standby, or a demoted primary). */
	return strncmp(state, "08", 2) == 0 || strcmp(state, "57P01") == 0 ||
	       strcmp(state, "57P02") == 0 || strcmp(state, "57P03") == 0 ||
	       strcmp(state, "25006") == 0;
}

bool pg_switch_seen(bool clear)
{
	bool seen = switch_seen;

	if (clear)
		switch_seen = false;
	return seen;
}

static enum kiln_err pg_check(struct pg_conn *c, PGresult *res, struct kiln_error *err)
{
	ExecStatusType st = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
	const char *state;

	if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK)
		return KILN_OK;
	state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
	if (PQstatus(c->conn) != CONNECTION_OK || !state || pg_sqlstate_switch(state)) {
		/* The server this connection reached is gone or no longer the primary: close it so
		 * the next acquire asks the connection string's hosts for the one that is. */
		c->drop = true;
		c->pool->gen++;
		switch_seen = true;
		log_warn("postgres: %s; the connection is dropped and reopened on the primary",
			 state ? state : "connection lost");
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "postgres is unavailable");
	}
	if (strcmp(state, "23505") == 0)
		return kiln_error_set(err, KILN_E_CONFLICT, "unique violation");
	log_error("postgres error %s: %s", state, PQresultErrorMessage(res));
	return kiln_error_set(err, KILN_E_INTERNAL, "database error %s", state);
}

static unsigned long sql_hash(const char *s)
{
	unsigned long h = 5381;

	while (*s)
		h = h * 33 + (unsigned char)*s++;
	return h;
}

/*
 * The index of `sql` among the statements prepared on `c`, preparing it when it is new and there
 * is room; -1 to run it unprepared (no room, or it did not prepare: running it reports why).
 */
static int stmt_lookup(struct pg_conn *c, const char *sql, int nparams)
{
	unsigned long h = sql_hash(sql);
	char name[16];
	PGresult *res;
	bool ok;

	if (c->stale) {
		/* Until outside a transaction (DEALLOCATE fails in an aborted one), all run unprepared. */
		if (PQtransactionStatus(c->conn) != PQTRANS_IDLE)
			return -1;
		res = PQexec(c->conn, "DEALLOCATE ALL");
		PQclear(res);
		stmts_forget(c);
	}
	for (int i = 0; i < c->nstmts; i++)
		if (c->stmt_hash[i] == h && strcmp(c->stmts[i], sql) == 0)
			return i;
	/* Inside a transaction a statement that fails to prepare would abort it: not there. */
	if (c->nstmts == PG_STMT_MAX || PQtransactionStatus(c->conn) != PQTRANS_IDLE)
		return -1;
	snprintf(name, sizeof(name), "k%d", c->nstmts);
	res = PQprepare(c->conn, name, sql, nparams, NULL);
	ok = res && PQresultStatus(res) == PGRES_COMMAND_OK;
	PQclear(res);
	if (!ok || !(c->stmts[c->nstmts] = strdup(sql)))
		return -1;
	c->stmt_hash[c->nstmts] = h;
	return c->nstmts++;
}

/* Runs `sql`, by name when it is prepared on `c` (`*named`), else unprepared. */
static PGresult *stmt_exec(struct pg_conn *c, const char *sql, int nparams,
			   const char *const *params, bool *named)
{
	int stmt = c->pool->prepared ? stmt_lookup(c, sql, nparams) : -1;
	char name[16];

	*named = stmt >= 0;
	if (stmt < 0)
		return PQexecParams(c->conn, sql, nparams, NULL, params, NULL, NULL, 0);
	snprintf(name, sizeof(name), "k%d", stmt);
	return PQexecPrepared(c->conn, name, nparams, params, NULL, NULL, 0);
}

/*
 * Whether `res` is a prepared statement's failure because a schema change altered its result
 * columns (0A000 is any feature_not_supported: the message, or the plan cache raising it when
 * the server's messages are translated, tells this one).
 */
static bool plan_changed(const PGresult *res)
{
	const char *state, *msg, *file;

	if (!res || PQresultStatus(res) != PGRES_FATAL_ERROR)
		return false;
	state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
	msg = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);
	file = PQresultErrorField(res, PG_DIAG_SOURCE_FILE);
	return state && strcmp(state, "0A000") == 0 &&
	       ((msg && strcmp(msg, "cached plan must not change result type") == 0) ||
		(file && strcmp(file, "plancache.c") == 0));
}

enum kiln_err pg_query(struct pg_conn *c, struct pg_res **out, struct kiln_error *err,
		       const char *sql, int nparams, const char *const *params)
{
	PGresult *res;
	enum kiln_err rc;
	bool named;

	if (out)
		*out = NULL;
	res = stmt_exec(c, sql, nparams, params, &named);
	if (named && plan_changed(res)) {
		/*
		 * Every statement of `c` is prepared anew (a migration may have altered several).
		 * Outside a transaction the failed statement ran in one of its own, rolled back
		 * before it did anything: it runs again, prepared anew. Inside one, the caller's
		 * transaction is aborted and the error is the caller's.
		 */
		c->stale = true;
		if (PQtransactionStatus(c->conn) == PQTRANS_IDLE) {
			log_info("postgres: a schema change altered a prepared statement; prepared anew");
			PQclear(res);
			res = stmt_exec(c, sql, nparams, params, &named);
		}
	}
	rc = pg_check(c, res, err);
	if (rc != KILN_OK || !out) {
		PQclear(res);
		return rc;
	}
	*out = malloc(sizeof(**out));
	if (!*out) {
		PQclear(res);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	(*out)->res = res;
	return KILN_OK;
}

#define COMMIT_RESOLVE_MS 10000	/* how long an unanswered COMMIT's fate is asked after */

/*
 * The fate of transaction `xid` whose COMMIT went unanswered (its server went away): asked of
 * the primary the pool reaches now, on `c` reopened (txid_status: the standby that took over has
 * the same transaction ids). 1 committed, 0 not, -1 unknown (no primary within the bound).
 */
static int commit_resolve(struct pg_conn *c, const char *xid)
{
	struct timespec start, now;

	clock_gettime(CLOCK_MONOTONIC, &start);
	for (;;) {
		if (pg_conn_open(c->pool, c) == 0) {
			const char *params[1] = { xid };
			PGresult *res = PQexecParams(c->conn, "SELECT txid_status($1::bigint)", 1, NULL,
						     params, NULL, NULL, 0);
			int fate = -1;

			if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1)
				fate = strcmp(PQgetvalue(res, 0, 0), "committed") == 0 ? 1 : 0;
			else
				c->drop = true;
			PQclear(res);
			if (fate >= 0)
				return fate;
		}
		clock_gettime(CLOCK_MONOTONIC, &now);
		if ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 >=
		    COMMIT_RESOLVE_MS)
			return -1;
		nanosleep(&(struct timespec){ 0, 200 * 1000000L }, NULL);
	}
}

/* Whether `sql` is a COMMIT (what pg_exec callers write: "COMMIT", any case, maybe a ';'). */
static bool is_commit(const char *sql)
{
	return strncasecmp(sql, "COMMIT", 6) == 0 && (sql[6] == '\0' || sql[6] == ';');
}

enum kiln_err pg_exec(struct pg_conn *c, const char *sql, struct kiln_error *err)
{
	char xid[24] = "";
	PGresult *res;
	enum kiln_err rc;

	/* A COMMIT whose answer is lost in a failover may or may not have committed: note the
	 * transaction's id first, so its fate can be asked of the new primary. */
	if (is_commit(sql) && PQtransactionStatus(c->conn) == PQTRANS_INTRANS) {
		res = PQexec(c->conn, "SELECT txid_current_if_assigned()");
		if (PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) == 1 &&
		    !PQgetisnull(res, 0, 0))
			snprintf(xid, sizeof(xid), "%s", PQgetvalue(res, 0, 0));
		PQclear(res);
	}
	res = PQexec(c->conn, sql);
	rc = pg_check(c, res, err);
	PQclear(res);
	if (rc == KILN_E_UNAVAILABLE && xid[0] && c->drop) {
		int fate = commit_resolve(c, xid);

		log_warn("postgres: the COMMIT of transaction %s went unanswered; it %s", xid,
			 fate > 0 ? "committed" : fate == 0 ? "did not commit" : "is unknown");
		if (fate > 0) {
			kiln_error_clear(err);
			return KILN_OK;
		}
	}
	return rc;
}

bool pg_in_transaction(const struct pg_conn *c)
{
	PGTransactionStatusType st = PQtransactionStatus(c->conn);

	return st == PQTRANS_INTRANS || st == PQTRANS_INERROR || st == PQTRANS_ACTIVE;
}

int pg_res_rows(const struct pg_res *r)
{
	return r ? PQntuples(r->res) : 0;
}

const char *pg_res_get(const struct pg_res *r, int row, int col)
{
	if (!r || row < 0 || row >= PQntuples(r->res) || col < 0 || col >= PQnfields(r->res) ||
	    PQgetisnull(r->res, row, col))
		return NULL;
	return PQgetvalue(r->res, row, col);
}

const char *pg_res_str(const struct pg_res *r, int row, int col)
{
	const char *v = pg_res_get(r, row, col);

	return v ? v : "";
}

long long pg_res_int(const struct pg_res *r, int row, int col, long long def)
{
	const char *v = pg_res_get(r, row, col);

	return v ? strtoll(v, NULL, 10) : def;
}

bool pg_res_bool(const struct pg_res *r, int row, int col)
{
	const char *v = pg_res_get(r, row, col);

	return v && v[0] == 't';
}

void pg_res_free(struct pg_res *r)
{
	if (!r)
		return;
	PQclear(r->res);
	free(r);
}

enum kiln_err pg_ping(struct pg *p, struct kiln_error *err)
{
	struct pg_conn *c;
	enum kiln_err rc = pg_acquire(p, &c, err);

	if (rc != KILN_OK)
		return rc;
	rc = pg_exec(c, "SELECT 1", err);
	pg_release(p, c);
	return rc;
}

int pg_array_add(struct buf *b, const char *v)
{
	int rc = buf_appends(b, b->len > 1 ? "," : "");

	if (rc == 0 && !v)
		return buf_appends(b, "NULL");
	rc = rc ? rc : buf_appends(b, "\"");
	for (const char *s = v; rc == 0 && *s; s++) {
		const char *run = s;

		while (*s && *s != '"' && *s != '\\')
			s++;
		rc = buf_append(b, run, (size_t)(s - run));
		if (rc == 0 && *s)
			rc = buf_appendf(b, "\\%c", *s);
		if (!*s)
			break;
	}
	return rc ? rc : buf_appends(b, "\"");
}
