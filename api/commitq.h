/*
 * commitq.h - kiln-gateway's group commit of the audit trail and of Idempotency-Key outcomes.
 *
 * A mutating request's audit row and, when it claimed an Idempotency-Key, its stored outcome are
 * written before its reply goes out (gw_audit, api/authn.c). Written one by one, each is a round
 * trip and a transaction of its own, and the outcome a WAL flush of its own. Here one writer
 * thread takes every row that is waiting and writes them all with one statement, one transaction
 * and (when an outcome is among them) one WAL flush; the rows that arrive meanwhile wait for the
 * next group. No row waits for a timer: a group is whatever queued while the previous one
 * committed, so a lone request pays one round trip, and under load the flush is shared.
 */
#ifndef KILN_API_COMMITQ_H
#define KILN_API_COMMITQ_H

#include "common/err.h"

struct pg;
struct commitq;

/* One request's rows. Strings are the caller's and must live until commitq_write() returns. */
struct commitq_row {
	/* the audit row (audit_log) */
	const char *tenant_id, *key_id, *method, *route, *request_id;
	const char *object_id;	/* NULL: none */
	int status;
	/*
	 * The stored outcome of the request's Idempotency-Key (idempotency), written with the
	 * claim's method, path and body hash when the claim is gone; idem_key NULL: none.
	 */
	const char *idem_key, *idem_method, *idem_path, *idem_sha256;
	const char *response;	/* sealed reply body, "" for none */
};

/*
 * Starts the writer on connections of `pool` (the pool must outlive the queue); a group is
 * retried for `retry_ms` from its first failure while Postgres is unavailable. NULL with `err`
 * set when the thread cannot start or memory runs out.
 */
struct commitq *commitq_new(struct pg *pool, long long retry_ms, struct kiln_error *err);

/*
 * Writes what is queued, stops the writer, logs how many groups and rows it wrote (info) and
 * frees the queue. Accepts NULL.
 */
void commitq_free(struct commitq *q);

/*
 * Queues `row` and waits until its group has committed. KILN_OK: the audit row is visible to
 * every reader, and an outcome is durable (its group committed synchronously; a group of audit
 * rows alone commits without waiting for the WAL flush, docs/auth.md "Commits").
 * A group attempted again after a lost answer records the row once: its id, chosen here before
 * the first attempt, is skipped when that attempt had committed it.
 * KILN_E_UNAVAILABLE: Postgres stayed unavailable while the writer retried the group, for the
 * queue's `retry_ms` from its first failure (or a connection lost its COMMIT's answer at the last
 * attempt): the row is not written as far as the writer knows, and writing it alone would find
 * Postgres no better. Any other error: the row itself was refused (a group
 * refused for its data is split until only the rows at fault fail), or the queue is being freed
 * (at once): the caller may write the row alone.
 */
enum kiln_err commitq_write(struct commitq *q, const struct commitq_row *row,
			    struct kiln_error *err);

#endif
