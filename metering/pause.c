/*
 * pause.c - pause requests to kiln-node over HTTP (common/httpc.h; see pause.h).
 */
#include "pause.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth/signing.h"
#include "auth/scopes.h"
#include "common/err.h"
#include "common/httpc.h"
#include "common/log.h"

#define PAUSE_QUEUE_MAX 1024
#define PAUSE_WORKERS_MAX 256	/* pauses in flight at once */
#define PAUSE_WORKER_STACK (512u << 10)
#define PAUSE_TOKEN_TTL_S 60
#define PAUSE_TIMEOUT_S 120	/* a pause writes a snapshot: give it time */

struct pause_job {
	char sandbox[64], tenant[64];
};

struct pauser {
	struct pg *pg;
	struct signing *signing;
	char node[64];
	char addr[512];		/* the node's address as last read (under `lock`) */
	pthread_mutex_t lock;
	pthread_cond_t cond, done;
	struct pause_job q[PAUSE_QUEUE_MAX];
	size_t head, n;
	bool stopping;
	int nworkers, idle;	/* workers running; of which waiting for a job */
};

/*
 * The node's address from `nodes`, into `out`; the last one read when Postgres cannot be reached
 * (enforcement goes on while it is away); false when never known.
 */
static bool node_address(struct pauser *p, char *out, size_t n)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	bool ok = false;

	if (pg_acquire(p->pg, &c, &err) == KILN_OK) {
		if (PGQ(c, &res, &err, "SELECT address FROM nodes WHERE id = $1", p->node) == KILN_OK &&
		    pg_res_rows(res) == 1) {
			pthread_mutex_lock(&p->lock);
			snprintf(p->addr, sizeof(p->addr), "%s", pg_res_str(res, 0, 0));
			pthread_mutex_unlock(&p->lock);
		}
		pg_res_free(res);
		pg_release(p->pg, c);
	}
	pthread_mutex_lock(&p->lock);
	if (p->addr[0]) {
		snprintf(out, n, "%s", p->addr);
		ok = true;
	}
	pthread_mutex_unlock(&p->lock);
	return ok;
}

static void pause_one(struct pauser *p, const struct pause_job *j)
{
	struct auth_token_params tp = {
		.iss = "kiln",
		.aud = AUTH_AUD_NODE,
		.sub = "kiln-meter",
		.tid = j->tenant,
		.sbx = j->sandbox,
		.scopes = AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_SANDBOX_WRITE,
		.now = time(NULL),
		.ttl_s = PAUSE_TOKEN_TTL_S,
	};
	struct kiln_error err = { 0 };
	struct curl_slist *h = NULL;
	char addr[512], url[1024], auth[8192];
	const char *base = addr;
	struct httpc_opts o = {
		.url = url,
		.timeout_ms = PAUSE_TIMEOUT_S * 1000L,
		.connect_timeout_ms = 3000,
	};
	struct httpc hc;
	char *token = NULL;
	long status = 0;
	enum kiln_err rc;

	log_ctx_set(NULL, j->tenant, j->sandbox);
	if (!node_address(p, addr, sizeof(addr))) {
		log_warn("cannot pause: node \"%s\" has no address", p->node);
		goto out;
	}
	if (signing_sign(p->signing, &tp, &token, NULL, &err) != KILN_OK) {
		log_error("cannot sign a node token: %s", err.msg);
		goto out;
	}
	if (strncmp(base, "unix:", 5) == 0) {
		o.unix_socket = base + 5;
		base = "http://node";
	}
	snprintf(url, sizeof(url), "%s/v1/sandboxes/%s/pause", base, j->sandbox);
	if (httpc_open(&hc, &o, &err) != KILN_OK)
		goto out;
	snprintf(auth, sizeof(auth), "Authorization: Bearer %s", token);
	h = curl_slist_append(h, auth);
	h = curl_slist_append(h, "Content-Type: application/json");
	curl_easy_setopt(hc.curl, CURLOPT_POST, 1L);
	curl_easy_setopt(hc.curl, CURLOPT_POSTFIELDS, "{}");
	curl_easy_setopt(hc.curl, CURLOPT_HTTPHEADER, h);
	rc = httpc_perform(&hc, &status, &err);
	curl_slist_free_all(h);
	httpc_close(&hc);
	if (rc != KILN_OK)
		log_warn("cannot reach node \"%s\" to pause: %s", p->node, err.msg);
	else if (status == 200)
		log_info("paused: the tenant is out of credits");
	else if (status == kiln_err_status(KILN_E_CONFLICT))
		log_info("not paused: the sandbox is not running");
	else
		log_warn("node \"%s\" answered %ld to a pause", p->node, status);
out:
	free(token);
	log_ctx_clear();
}

/*
 * A worker: takes queued pauses one at a time and blocks on each for its whole exchange. Workers
 * are started on demand (pauser_ask) so every queued pause has one: a pause writing its snapshot
 * never holds up another. It ends when the pauser stops.
 */
static void *worker(void *arg)
{
	struct pauser *p = arg;

	for (;;) {
		struct pause_job j;

		pthread_mutex_lock(&p->lock);
		while (!p->n && !p->stopping) {
			p->idle++;
			pthread_cond_wait(&p->cond, &p->lock);
			p->idle--;
		}
		if (!p->n) {
			if (--p->nworkers == 0)
				pthread_cond_broadcast(&p->done);
			pthread_mutex_unlock(&p->lock);
			return NULL;
		}
		j = p->q[p->head];
		p->head = (p->head + 1) % PAUSE_QUEUE_MAX;
		p->n--;
		pthread_mutex_unlock(&p->lock);
		pause_one(p, &j);
	}
}

/* Starts one more (detached) worker; called with p->lock held. False when it cannot. */
static bool worker_start(struct pauser *p)
{
	pthread_attr_t attr;
	pthread_t t;
	bool ok;

	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&attr, PAUSE_WORKER_STACK);
	ok = pthread_create(&t, &attr, worker, p) == 0;
	pthread_attr_destroy(&attr);
	if (ok)
		p->nworkers++;
	return ok;
}

struct pauser *pauser_new(struct pg *pg, struct signing *signing, const char *node_id)
{
	struct pauser *p = calloc(1, sizeof(*p));
	bool ok;

	if (!p)
		return NULL;
	p->pg = pg;
	p->signing = signing;
	snprintf(p->node, sizeof(p->node), "%s", node_id);
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->cond, NULL);
	pthread_cond_init(&p->done, NULL);
	pthread_mutex_lock(&p->lock);
	ok = worker_start(p);
	pthread_mutex_unlock(&p->lock);
	if (!ok) {
		pauser_free(p);
		return NULL;
	}
	return p;
}

void pauser_free(struct pauser *p)
{
	if (!p)
		return;
	pthread_mutex_lock(&p->lock);
	p->stopping = true;
	p->n = 0;
	pthread_cond_broadcast(&p->cond);
	while (p->nworkers > 0)
		pthread_cond_wait(&p->done, &p->lock);
	pthread_mutex_unlock(&p->lock);
	pthread_mutex_destroy(&p->lock);
	pthread_cond_destroy(&p->cond);
	pthread_cond_destroy(&p->done);
	free(p);
}

void pauser_ask(void *ctx, const char *sandbox_id, const char *tenant_id)
{
	struct pauser *p = ctx;

	pthread_mutex_lock(&p->lock);
	if (p->n < PAUSE_QUEUE_MAX && !p->stopping) {
		struct pause_job *j = &p->q[(p->head + p->n) % PAUSE_QUEUE_MAX];
		snprintf(j->sandbox, sizeof(j->sandbox), "%s", sandbox_id);
		snprintf(j->tenant, sizeof(j->tenant), "%s", tenant_id);
		p->n++;
		/* Every queued pause has a worker of its own, so they all go at once. */
		if (p->n > (size_t)p->idle && p->nworkers < PAUSE_WORKERS_MAX && !worker_start(p))
			log_warn("cannot start a pause worker: \"%s\" waits for one", sandbox_id);
		pthread_cond_signal(&p->cond);
	} else {
		log_warn("pause queue full: sandbox \"%s\" not paused this time", sandbox_id);
	}
	pthread_mutex_unlock(&p->lock);
}
