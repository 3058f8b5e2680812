/*
 * failover.c - the live balances rebuilt from the ledger after a Redis failover (see failover.h).
 */
#include "api/failover.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "metering/billing.h"

#define REBUILD_BATCH 500	/* tenants per Postgres query and Redis round trip */
#define REBUILD_PASSES 2	/* the second catches writes that reached the demoted server */
#define REBUILD_AGAIN_S 3	/* seconds between the passes, and between tries while down */

static struct gateway *fo_gw;
static pthread_t fo_thread;
static pthread_mutex_t fo_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fo_cond;
static int fo_passes;		/* passes still owed */
static bool fo_stopping, fo_started;

enum kiln_err gw_balances_rebuild(struct gateway *gw, long long *tenants, struct kiln_error *err)
{
	char after[256] = "", batch[16];
	enum kiln_err rc = KILN_OK;
	struct pg_conn *c;

	*tenants = 0;
	snprintf(batch, sizeof(batch), "%d", REBUILD_BATCH);
	rc = pg_acquire(gw->pg, &c, err);
	if (rc != KILN_OK)
		return rc;
	for (;;) {
		struct pg_res *res = NULL;
		const char *ids[REBUILD_BATCH];
		int n;

		rc = PGQ(c, &res, err, "SELECT id FROM tenants WHERE id > $1 ORDER BY id LIMIT $2::int",
			 after, batch);
		if (rc != KILN_OK)
			break;
		n = pg_res_rows(res);
		for (int i = 0; i < n; i++)
			ids[i] = pg_res_str(res, i, 0);
		if (n)
			rc = billing_sync(gw->rds, c, (size_t)n, ids, NULL, NULL, err);
		if (n)
			snprintf(after, sizeof(after), "%s", ids[n - 1]);
		pg_res_free(res);
		if (rc != KILN_OK)
			break;
		*tenants += n;
		if (n < REBUILD_BATCH)
			break;
	}
	pg_release(gw->pg, c);
	return rc;
}

/* The client reached a new primary: owe the passes (on the thread of a Redis command). */
static void fo_switched(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&fo_lock);
	fo_passes = REBUILD_PASSES;
	pthread_cond_signal(&fo_cond);
	pthread_mutex_unlock(&fo_lock);
}

static void *fo_main(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&fo_lock);
	while (!fo_stopping) {
		struct kiln_error err = { 0 };
		struct timespec until;
		long long n = 0;
		enum kiln_err rc;

		while (!fo_stopping && fo_passes == 0)
			pthread_cond_wait(&fo_cond, &fo_lock);
		if (fo_stopping)
			break;
		pthread_mutex_unlock(&fo_lock);
		log_warn("redis failover: rebuilding the live balances from the ledger");
		rc = gw_balances_rebuild(fo_gw, &n, &err);
		if (rc == KILN_OK)
			log_info("redis failover: the live balances of %lld tenants rebuilt", n);
		else
			log_warn("redis failover: rebuilding the live balances: %s (again in %d s)",
				 err.msg, REBUILD_AGAIN_S);
		pthread_mutex_lock(&fo_lock);
		if (rc == KILN_OK && fo_passes > 0)
			fo_passes--;
		clock_gettime(CLOCK_MONOTONIC, &until);
		until.tv_sec += REBUILD_AGAIN_S;
		while (!fo_stopping && fo_passes > 0 &&
		       pthread_cond_timedwait(&fo_cond, &fo_lock, &until) == 0)
			;
	}
	pthread_mutex_unlock(&fo_lock);
	return NULL;
}

enum kiln_err gw_failover_start(struct gateway *gw, struct kiln_error *err)
{
	fo_gw = gw;
	clock_cond_init(&fo_cond, CLOCK_MONOTONIC);
	fo_stopping = false;
	fo_passes = 0;
	if (pthread_create(&fo_thread, NULL, fo_main, NULL) != 0) {
		pthread_cond_destroy(&fo_cond);
		return kiln_error_set(err, KILN_E_INTERNAL, "cannot start the failover thread");
	}
	fo_started = true;
	rds_set_switch_hook(gw->rds, fo_switched, NULL);
	return KILN_OK;
}

void gw_failover_stop(void)
{
	if (!fo_started)
		return;
	rds_set_switch_hook(fo_gw->rds, NULL, NULL);
	pthread_mutex_lock(&fo_lock);
	fo_stopping = true;
	pthread_cond_signal(&fo_cond);
	pthread_mutex_unlock(&fo_lock);
	pthread_join(fo_thread, NULL);
	pthread_cond_destroy(&fo_cond);
	fo_started = false;
}
