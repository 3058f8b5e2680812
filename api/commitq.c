/*
 * commitq.c - the group commit of audit rows and Idempotency-Key outcomes (see commitq.h).
 *
 * Requests queue a `struct pending` that lives on their own stack and sleep on `done` until the
 * writer marks it written or failed. The writer takes the whole queue (at most GROUP_MAX rows),
 * writes it with one statement whose parameters are arrays (unnest), marks every row with the
 * statement's result and wakes them all. A group holding an outcome commits synchronously, as the
 * outcome must be durable before its reply goes out; a group of audit rows alone commits without
 * waiting for the WAL flush, as audit rows did when written one by one.
 */
#include "api/commitq.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/buf.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/pg.h"

#define GROUP_MAX 256		/* rows in one statement; the rest wait for the next */
#define ARRAY_MAX (64u << 20)	/* bytes of one array parameter */
#define RETRY_MS 200		/* between attempts at a group while Postgres is unavailable */

struct pending {
	const struct commitq_row *row;
	char id[33];		/* the audit row's row_id (uuid, hex), chosen before its first attempt */
	struct pending *next;
	bool done;
	enum kiln_err rc;
	struct kiln_error err;
};

struct commitq {
	struct pg *pool;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t work;	/* the writer: rows queued, or stopping */
	pthread_cond_t done;	/* the requests: a group ended */
	struct pending *head, **tail;
	bool stopping;
	long long retry_ms;	/* how long a group is retried while Postgres is unavailable */
	unsigned long long groups, rows;
};

/* The audit rows' columns, then the outcomes', each an array parameter. */
enum { A_TENANT, A_KEY, A_METHOD, A_ROUTE, A_OBJECT, A_STATUS, A_REQUEST, A_ID,
       O_TENANT, O_KEY, O_METHOD, O_PATH, O_SHA, O_STATUS, O_RESPONSE, NCOLS };

/*
 * A row whose id is there already was written by an attempt whose answer was lost (a connection
 * cut after its commit): the group's next attempt skips it (migrations/0045_audit_row_id.sql).
 */
#define AUDIT_INSERT                                                                               \
	"INSERT INTO audit_log (tenant_id, key_id, method, route, object_id, status, request_id, "  \
	"row_id) SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], " \
	"$6::int[], $7::text[], $8::uuid[])"
#define AUDIT_SKIP_WRITTEN " ON CONFLICT (row_id) WHERE row_id IS NOT NULL DO NOTHING"

/* Audit rows and outcomes: one transaction, committed synchronously (the session's default). */
static const char both_sql[] =
	"WITH a AS (" AUDIT_INSERT AUDIT_SKIP_WRITTEN "), "
	"o AS (INSERT INTO idempotency (tenant_id, key, method, path, body_sha256, status, response) "
	"SELECT * FROM unnest($9::text[], $10::text[], $11::text[], $12::text[], $13::text[], "
	"$14::int[], $15::text[]) "
	"ON CONFLICT (tenant_id, key) DO UPDATE SET status = excluded.status, "
	"response = excluded.response WHERE idempotency.status IS NULL) "
	"SELECT 1";

/*
 * Audit rows alone: synchronous_commit off for this transaction (api/authn.c ASYNC_COMMIT).
 * Taken from a subquery run before the insert, as set_config must be before the commit.
 */
static const char audit_sql[] =
	"WITH s AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)) "
	AUDIT_INSERT " WHERE EXISTS (SELECT 1 FROM s)" AUDIT_SKIP_WRITTEN;

/*
 * Whether a failed statement was refused for its data (SQLSTATE class 22, data exception, such as
 * text that is not UTF-8; class 23, integrity constraint violation; or 21000, one key's outcome
 * twice in one statement) rather than for Postgres being unavailable: another row of the group
 * is then bad, and the rest can still be written without it. common/pg.c reports 23505 as
 * KILN_E_CONFLICT and every other SQL error as KILN_E_INTERNAL "database error <SQLSTATE>".
 */
static bool data_error(enum kiln_err rc, const struct kiln_error *err)
{
	static const char prefix[] = "database error ";
	const char *state = err->msg + sizeof(prefix) - 1;

	if (rc == KILN_E_CONFLICT)
		return true;
	if (rc != KILN_E_INTERNAL || strncmp(err->msg, prefix, sizeof(prefix) - 1) != 0)
		return false;
	return !strncmp(state, "22", 2) || !strncmp(state, "23", 2) || !strcmp(state, "21000");
}

/* Writes the `n` rows of `group` with one statement; returns its result. */
static enum kiln_err group_write(struct commitq *q, struct pending *group, int n,
				 struct kiln_error *err)
{
	struct buf col[NCOLS];
	const char *params[NCOLS];
	struct pg_conn *c;
	bool outcomes = false;
	enum kiln_err rc;
	int bad = 0;

	for (int i = 0; i < NCOLS; i++) {
		buf_init(&col[i], ARRAY_MAX);
		bad |= buf_appends(&col[i], "{");
	}
	for (struct pending *p = group; p && n-- > 0; p = p->next) {
		const struct commitq_row *r = p->row;
		char code[16];

		snprintf(code, sizeof(code), "%d", r->status);
		bad |= pg_array_add(&col[A_TENANT], r->tenant_id) |
		       pg_array_add(&col[A_KEY], r->key_id) |
		       pg_array_add(&col[A_METHOD], r->method) |
		       pg_array_add(&col[A_ROUTE], r->route) |
		       pg_array_add(&col[A_OBJECT], r->object_id) |
		       pg_array_add(&col[A_STATUS], code) |
		       pg_array_add(&col[A_REQUEST], r->request_id) |
		       pg_array_add(&col[A_ID], p->id);
		if (!r->idem_key)
			continue;
		outcomes = true;
		bad |= pg_array_add(&col[O_TENANT], r->tenant_id) |
		       pg_array_add(&col[O_KEY], r->idem_key) |
		       pg_array_add(&col[O_METHOD], r->idem_method) |
		       pg_array_add(&col[O_PATH], r->idem_path) |
		       pg_array_add(&col[O_SHA], r->idem_sha256) |
		       pg_array_add(&col[O_STATUS], code) |
		       pg_array_add(&col[O_RESPONSE], r->response ? r->response : "");
	}
	for (int i = 0; i < NCOLS; i++) {
		bad |= buf_appends(&col[i], "}");
		params[i] = col[i].data;
	}
	if (bad) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "a group of audit rows is too large");
		goto out;
	}
	rc = pg_acquire(q->pool, &c, err);
	if (rc != KILN_OK)
		goto out;
	rc = outcomes ? pg_query(c, NULL, err, both_sql, NCOLS, params)
		      : pg_query(c, NULL, err, audit_sql, O_TENANT, params);
	pg_release(q->pool, c);
out:
	for (int i = 0; i < NCOLS; i++)
		buf_release(&col[i]);
	return rc;
}

/*
 * Writes the `n` rows of `group`, again every RETRY_MS while Postgres is unavailable, for the
 * queue's `retry_ms` from the first failure: a lost connection or a quick switch of primaries is
 * reached on this thread's one connection, and the rows' requests wait for it instead of each
 * retrying alone. An attempt that committed but lost its answer is not told from one that did
 * not: the next inserts only the audit rows whose ids are not there yet (AUDIT_SKIP_WRITTEN).
 */
static enum kiln_err group_try(struct commitq *q, struct pending *group, int n,
			       struct kiln_error *err)
{
	long long deadline = 0;
	enum kiln_err rc;

	for (int attempt = 0;; attempt++) {
		kiln_error_clear(err);
		rc = group_write(q, group, n, err);
		if (rc != KILN_E_UNAVAILABLE)
			return rc;
		if (attempt == 0)
			deadline = clock_mono_ms() + q->retry_ms;
		if (clock_mono_ms() + RETRY_MS > deadline)
			return rc;
		if (attempt == 0)
			log_warn("a group of %d audit rows and outcomes: %s; retrying for up to %lld ms",
				 n, err->msg, q->retry_ms);
		nanosleep(&(struct timespec){ 0, RETRY_MS * 1000000L }, NULL);
	}
}

/*
 * Writes the `n` rows of `group` and sets each row's result. A group refused for its data is
 * split in two and each half written, down to the one row at fault: one bad row (any tenant can
 * send one) costs the others a few statements, not a write each of their own.
 */
static void group_commit(struct commitq *q, struct pending *group, int n)
{
	struct kiln_error err = { 0 };
	struct pending *p = group;
	enum kiln_err rc;

	rc = group_try(q, group, n, &err);
	if (rc != KILN_OK && n > 1 && data_error(rc, &err)) {
		int half = n / 2;

		for (int i = 0; i < half; i++)
			p = p->next;
		group_commit(q, group, half);
		group_commit(q, p, n - half);
		return;
	}
	if (rc != KILN_OK)
		log_warn("%d audit rows and outcomes not written: %s", n, err.msg);
	for (int i = 0; i < n; i++, p = p->next) {
		p->rc = rc;
		p->err = err;
	}
}

static void *writer_main(void *arg)
{
	struct commitq *q = arg;

	pthread_mutex_lock(&q->lock);
	for (;;) {
		struct pending *group, *p;
		int n = 0;

		while (!q->head && !q->stopping)
			pthread_cond_wait(&q->work, &q->lock);
		if (!q->head)
			break;
		/* Everything queued, up to GROUP_MAX rows; later arrivals make the next group. */
		group = q->head;
		for (p = group; p && n < GROUP_MAX; p = p->next)
			n++;
		q->head = p;
		if (!q->head)
			q->tail = &q->head;
		pthread_mutex_unlock(&q->lock);

		group_commit(q, group, n);
		pg_switch_seen(true);	/* the requests' threads report a failover, not this one */

		pthread_mutex_lock(&q->lock);
		q->groups++;
		for (p = group; n-- > 0; p = p->next) {
			q->rows += p->rc == KILN_OK;
			p->done = true;
		}
		pthread_cond_broadcast(&q->done);
	}
	pthread_mutex_unlock(&q->lock);
	return NULL;
}

/*
 * A new audit row id, as a uuid to Postgres: the wall clock in ms (48 bits, so ids of one
 * gateway come in order and their index entries go to its right edge) and 80 random bits. Two
 * rows with the same id would lose one, so when the kernel gives no random bytes (it blocks
 * rather than fail once seeded) the process id and a counter of this process stand in for them.
 */
static void row_id_new(char out[33])
{
	static const char hex[] = "0123456789abcdef";
	static unsigned long long counter;
	unsigned char id[16];
	unsigned long long ms = (unsigned long long)clock_ms_of(CLOCK_REALTIME);

	for (int i = 0; i < 6; i++)
		id[i] = (unsigned char)(ms >> (40 - 8 * i));
	if (getrandom(id + 6, 10, 0) != 10) {
		unsigned long long n = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
		unsigned pid = (unsigned)getpid();

		memcpy(id + 6, &n, 6);
		memcpy(id + 12, &pid, 4);
	}
	for (int i = 0; i < 16; i++) {
		out[2 * i] = hex[id[i] >> 4];
		out[2 * i + 1] = hex[id[i] & 15];
	}
	out[32] = '\0';
}

struct commitq *commitq_new(struct pg *pool, long long retry_ms, struct kiln_error *err)
{
	struct commitq *q = calloc(1, sizeof(*q));

	if (!q) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	q->pool = pool;
	q->retry_ms = retry_ms;
	q->tail = &q->head;
	pthread_mutex_init(&q->lock, NULL);
	pthread_cond_init(&q->work, NULL);
	pthread_cond_init(&q->done, NULL);
	if (pthread_create(&q->thread, NULL, writer_main, q) != 0) {
		kiln_error_set(err, KILN_E_INTERNAL, "cannot start the audit writer");
		pthread_cond_destroy(&q->done);
		pthread_cond_destroy(&q->work);
		pthread_mutex_destroy(&q->lock);
		free(q);
		return NULL;
	}
	return q;
}

void commitq_free(struct commitq *q)
{
	if (!q)
		return;
	pthread_mutex_lock(&q->lock);
	q->stopping = true;
	pthread_cond_signal(&q->work);
	pthread_mutex_unlock(&q->lock);
	pthread_join(q->thread, NULL);
	log_info("audit writer: %llu groups, %llu rows", q->groups, q->rows);
	pthread_cond_destroy(&q->done);
	pthread_cond_destroy(&q->work);
	pthread_mutex_destroy(&q->lock);
	free(q);
}

enum kiln_err commitq_write(struct commitq *q, const struct commitq_row *row,
			    struct kiln_error *err)
{
	struct pending p = { .row = row };

	if (!q)
		return kiln_error_set(err, KILN_E_INTERNAL, "no audit writer");
	row_id_new(p.id);	/* the same in every attempt at its group */
	pthread_mutex_lock(&q->lock);
	if (q->stopping) {
		pthread_mutex_unlock(&q->lock);
		return kiln_error_set(err, KILN_E_INTERNAL, "the audit writer is stopping");
	}
	*q->tail = &p;
	q->tail = &p.next;
	pthread_cond_signal(&q->work);
	while (!p.done)
		pthread_cond_wait(&q->done, &q->lock);
	pthread_mutex_unlock(&q->lock);
	if (p.rc != KILN_OK)
		*err = p.err;
	return p.rc;
}
