/*
 * connlog.c - kiln-node's connection-log collector (see connlog.h): a thread that every
 * connlog_interval_s reads each registered sandbox's eBPF connection log and writes the pass to
 * Postgres, sweeps old rows once an hour, and the flush of a sandbox whose pins are about to go.
 */
#include "node/connlog.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "common/log.h"
#include "node/node.h"

#define SWEEP_EVERY_S 3600
#define SWEEP_BATCH 10000
#define SEEN_SLACK_NS 2000000000ull	/* flows' last_ns moves once a second: read 2 s back */

/* A sandbox whose log the collector holds open. */
struct cl_sb {
	char id[48];
	char tenant_id[AUTH_CLAIM_MAX];
	struct kiln_connlog *log;
	uint64_t since_ns;		/* CLOCK_MONOTONIC of its last read */
	uint64_t ring_seen, cap_seen;	/* losses already written */
	bool live;			/* still registered at this pass */
	struct cl_sb *next;
};

/* The proxies' notes on one sandbox's flows, waiting for the next pass. */
struct cl_notes {
	char id[48];
	struct kiln_conn_note *v;
	size_t n, cap;
	uint64_t lost;			/* over the cap since the last pass */
	bool attached;			/* to a batch of this pass */
	struct cl_notes *next;
};

static struct {
	pthread_mutex_t nmu;		/* notes (taken by proxies' threads, never held long) */
	struct cl_notes *notes;
	pthread_mutex_t mu;		/* passes and flushes, one at a time */
	pthread_cond_t wake;		/* on CLOCK_MONOTONIC, made by each connlog_start() */
	pthread_t thread;
	bool started, stopping;
	struct node *n;
	struct cl_sb *list;
	long long last_sweep_ms;	/* CLOCK_MONOTONIC; 0: none yet */
} cl = { .nmu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER };

void connlog_note(void *arg, const char *sandbox_id, const struct kiln_conn_note *note)
{
	struct node *n = arg;
	size_t max = n && n->cfg.connlog_max_per_minute > 0 ? (size_t)n->cfg.connlog_max_per_minute
							    : 600;
	struct cl_notes *q;

	if (!note->family || strlen(sandbox_id) >= sizeof(q->id))
		return;
	pthread_mutex_lock(&cl.nmu);
	for (q = cl.notes; q && strcmp(q->id, sandbox_id); q = q->next)
		;
	if (!q && (q = calloc(1, sizeof(*q)))) {
		snprintf(q->id, sizeof(q->id), "%s", sandbox_id);
		q->next = cl.notes;
		cl.notes = q;
	}
	if (q && q->n == q->cap && q->cap < max) {
		size_t nc = q->cap ? 2 * q->cap : 16;
		struct kiln_conn_note *v = realloc(q->v, (nc < max ? nc : max) * sizeof(*v));
		if (v) {
			q->v = v;
			q->cap = nc < max ? nc : max;
		}
	}
	if (q && q->n < q->cap)
		q->v[q->n++] = *note;
	else if (q)
		q->lost++;
	pthread_mutex_unlock(&cl.nmu);
}

/* Takes the notes waiting for sandbox `id` (NULL: every sandbox's), as a list the caller frees. */
static struct cl_notes *notes_take(const char *id)
{
	struct cl_notes *got = NULL, **pp, *q;

	pthread_mutex_lock(&cl.nmu);
	for (pp = &cl.notes; (q = *pp);) {
		if (id && strcmp(q->id, id)) {
			pp = &q->next;
			continue;
		}
		*pp = q->next;
		q->next = got;
		got = q;
	}
	pthread_mutex_unlock(&cl.nmu);
	return got;
}

static void notes_free(struct cl_notes *q)
{
	while (q) {
		struct cl_notes *next = q->next;
		free(q->v);
		free(q);
		q = next;
	}
}

/* Puts the notes of batch b's sandbox (if any) into it. */
static void notes_attach(struct connlog_batch *b, struct cl_notes *list)
{
	for (struct cl_notes *q = list; q; q = q->next)
		if (!q->attached && !strcmp(q->id, b->sandbox_id)) {
			b->notes = q->v;
			b->nnotes = q->n;
			b->over_cap += q->lost;
			q->attached = true;
			return;
		}
}

static uint64_t clock_ns(clockid_t id)
{
	struct timespec ts;
	clock_gettime(id, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sb_free(struct cl_sb *s)
{
	kiln_connlog_close(s->log);
	free(s);
}

/* The entry of sandbox `id`, opening its log when it has none; NULL when it has no pins. */
static struct cl_sb *entry(const char *id, const char *tenant_id)
{
	struct kiln_error err = { 0 };
	struct cl_sb *s;

	for (s = cl.list; s; s = s->next)
		if (!strcmp(s->id, id))
			return s;
	s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	snprintf(s->id, sizeof(s->id), "%s", id);
	snprintf(s->tenant_id, sizeof(s->tenant_id), "%s", tenant_id);
	if (kiln_connlog_open(NULL, cl.n->cfg.node_id, id,
			      (uint32_t)cl.n->cfg.connlog_max_per_minute, &s->log, &err) != KILN_OK) {
		if (err.code != KILN_E_NOT_FOUND)
			log_warn("connection log of \"%s\": %s", id, err.msg);
		free(s);
		return NULL;
	}
	s->next = cl.list;
	cl.list = s;
	return s;
}

/* Reads one sandbox's log into *b (b->conns owned by the caller). */
static void read_one(struct cl_sb *s, struct connlog_batch *b)
{
	struct kiln_error err = { 0 };
	struct kiln_conn *c = NULL;
	size_t n = 0;
	uint64_t now = clock_ns(CLOCK_MONOTONIC), ring, cap;
	uint64_t since = s->since_ns > SEEN_SLACK_NS ? s->since_ns - SEEN_SLACK_NS : 0;

	memset(b, 0, sizeof(*b));
	b->sandbox_id = s->id;
	b->tenant_id = s->tenant_id;
	if (kiln_connlog_read(s->log, since, &c, &n, &err) != KILN_OK) {
		log_warn("connection log of \"%s\": %s", s->id, err.msg);
		return;
	}
	s->since_ns = now;
	b->conns = c;
	b->n = n;
	kiln_connlog_lost(s->log, &ring, &cap);
	b->ring_full = ring > s->ring_seen ? ring - s->ring_seen : 0;
	b->over_cap = cap > s->cap_seen ? cap - s->cap_seen : 0;
	s->ring_seen = ring > s->ring_seen ? ring : s->ring_seen;
	s->cap_seen = cap;
}

static void write_pass(struct connlog_batch *b, size_t nb)
{
	struct kiln_error err = { 0 };
	int64_t off = (int64_t)(clock_ns(CLOCK_REALTIME) - clock_ns(CLOCK_MONOTONIC));
	size_t rows = 0;

	for (size_t i = 0; i < nb; i++)
		rows += b[i].n;
	if (connlog_store(cl.n->pg, cl.n->cfg.node_id, b, nb, off, &err) != KILN_OK)
		log_warn("connection log: %zu rows of %zu sandboxes not written: %s", rows, nb,
			 err.msg);
	for (size_t i = 0; i < nb; i++)
		free((void *)b[i].conns);
}

/* One pass over every registered sandbox (cl.mu held). */
static void pass(void)
{
	struct node *n = cl.n;
	struct cl_sb **pp, *s;
	struct connlog_batch *b = NULL;
	size_t cap = 0, nb = 0;
	char (*ids)[2][AUTH_CLAIM_MAX] = NULL;
	size_t nids = 0;
	/* before the rings: every flow a note is about is in its ring (or its table) by now */
	struct cl_notes *notes = notes_take(NULL);

	pthread_mutex_lock(&n->reg_lock);
	for (struct sandbox *sb = n->sandboxes; sb; sb = sb->next)
		nids++;
	ids = nids ? calloc(nids, sizeof(*ids)) : NULL;
	if (ids) {
		size_t i = 0;
		for (struct sandbox *sb = n->sandboxes; sb && i < nids; sb = sb->next, i++) {
			snprintf(ids[i][0], sizeof(ids[i][0]), "%s", sb->id);
			snprintf(ids[i][1], sizeof(ids[i][1]), "%s", sb->tenant_id);
		}
	} else {
		nids = 0;
	}
	pthread_mutex_unlock(&n->reg_lock);

	for (s = cl.list; s; s = s->next)
		s->live = false;
	for (size_t i = 0; i < nids; i++) {
		s = entry(ids[i][0], ids[i][1]);
		if (!s)
			continue;
		s->live = true;
		if (nb == cap) {
			size_t nc = cap ? 2 * cap : 16;
			struct connlog_batch *p = realloc(b, nc * sizeof(*p));
			if (!p)
				break;
			b = p;
			cap = nc;
		}
		read_one(s, &b[nb]);
		notes_attach(&b[nb++], notes);
	}
	/* notes of sandboxes not read in this pass (flushed meanwhile): their rows are there */
	for (struct cl_notes *q = notes; q; q = q->next) {
		if (q->attached)
			continue;
		if (nb == cap) {
			size_t nc = cap ? 2 * cap : 16;
			struct connlog_batch *p = realloc(b, nc * sizeof(*p));
			if (!p)
				break;
			b = p;
			cap = nc;
		}
		b[nb] = (struct connlog_batch){ .sandbox_id = q->id, .tenant_id = "" };
		notes_attach(&b[nb++], notes);
	}
	write_pass(b, nb);
	free(b);
	free(ids);
	notes_free(notes);
	/* sandboxes gone without a flush (the node lost them) */
	for (pp = &cl.list; (s = *pp);) {
		if (s->live) {
			pp = &s->next;
		} else {
			*pp = s->next;
			sb_free(s);
		}
	}
}

static void sweep(void)
{
	struct kiln_error err = { 0 };
	long long gone = 0;
	long long now = clock_mono_ms();

	if (cl.last_sweep_ms && now - cl.last_sweep_ms < SWEEP_EVERY_S * 1000LL)
		return;
	cl.last_sweep_ms = now;
	if (connlog_sweep(cl.n->pg, cl.n->cfg.connlog_retention_days, SWEEP_BATCH, &gone, &err) !=
	    KILN_OK)
		log_warn("connection log sweep: %s", err.msg);
	else if (gone)
		log_info("connection log: %lld rows older than %lld days deleted", gone,
			 cl.n->cfg.connlog_retention_days);
}

static void *collector(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&cl.mu);
	while (!cl.stopping) {
		struct timespec until;

		pass();
		sweep();
		until = clock_after_ms(CLOCK_MONOTONIC, cl.n->cfg.connlog_interval_s * 1000);
		while (!cl.stopping &&
		       pthread_cond_timedwait(&cl.wake, &cl.mu, &until) != ETIMEDOUT)
			;
	}
	pthread_mutex_unlock(&cl.mu);
	return NULL;
}

enum kiln_err connlog_start(struct node *n, struct kiln_error *err)
{
	cl.n = n;
	cl.stopping = false;
	/* The collector's interval, on the clock a wall-clock step does not move. */
	clock_cond_init(&cl.wake, CLOCK_MONOTONIC);
	if (pthread_create(&cl.thread, NULL, collector, NULL) != 0) {
		pthread_cond_destroy(&cl.wake);
		return kiln_error_set(err, KILN_E_NOMEM, "cannot start the connection-log collector");
	}
	cl.started = true;
	return KILN_OK;
}

void connlog_stop(struct node *n)
{
	(void)n;
	if (!cl.started)
		return;
	pthread_mutex_lock(&cl.mu);
	cl.stopping = true;
	pthread_cond_signal(&cl.wake);
	pthread_mutex_unlock(&cl.mu);
	pthread_join(cl.thread, NULL);
	pthread_cond_destroy(&cl.wake);
	cl.started = false;
	pthread_mutex_lock(&cl.mu);
	pass();		/* what the sandboxes still registered did since */
	while (cl.list) {
		struct cl_sb *s = cl.list;
		cl.list = s->next;
		sb_free(s);
	}
	pthread_mutex_unlock(&cl.mu);
	notes_free(notes_take(NULL));	/* of sandboxes the last pass no longer had */
}

void connlog_flush(struct node *n, struct sandbox *sb)
{
	struct connlog_batch b;
	struct cl_sb **pp, *s;

	if (!cl.n)
		cl.n = n;
	pthread_mutex_lock(&cl.mu);
	struct cl_notes *notes = notes_take(sb->id);
	s = entry(sb->id, sb->tenant_id);
	if (s) {
		read_one(s, &b);
		notes_attach(&b, notes);
		write_pass(&b, 1);
		for (pp = &cl.list; *pp; pp = &(*pp)->next)
			if (*pp == s) {
				*pp = s->next;
				break;
			}
		sb_free(s);
	}
	pthread_mutex_unlock(&cl.mu);
	notes_free(notes);
}
