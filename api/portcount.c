/*
 * portcount.c - the port streams each tenant holds open, counted across gateways in Redis with
 * this gateway's own count as the fallback (portcount.h).
 */
#include "portcount.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/clock.h"
#include "common/err.h"
#include "common/log.h"
#include "common/redis.h"

/* This gateway's streams of one tenant. */
struct pc_tenant {
	struct pc_tenant *next;
	char tenant[128];
	unsigned long long *tickets;
	long long n, cap;
	long long pending;	/* takes asking Redis now: the entry stays while they do */
};

/*
 * KEYS[1] the tenant's set; ARGV: cap, member, lease_ms. Drops expired members, then adds the
 * member unless `cap` remain. Returns 1 when added, else 0. Redis's clock scores every member,
 * so gateways' clocks need not agree.
 */
static const char take_lua[] =
	"local t = redis.call('TIME')\n"
	"local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
	"redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)\n"
	"if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end\n"
	"redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])\n"
	"redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))\n"
	"return 1\n";

/* KEYS[1] the tenant's set; ARGV: lease_ms, members... Renews (or puts back) each member. */
static const char renew_lua[] =
	"local t = redis.call('TIME')\n"
	"local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])\n"
	"for i = 2, #ARGV do redis.call('ZADD', KEYS[1], due, ARGV[i]) end\n"
	"redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))\n"
	"return #ARGV - 1\n";

#define RENEW_BATCH 256	/* members per renewal script */

void portcount_init(struct portcount *pc)
{
	*pc = (struct portcount)PORTCOUNT_INIT;
}

static void key_of(const char *tenant, char *out, size_t cap)
{
	snprintf(out, cap, "kiln:port_streams:%s", tenant);
}

static void member_of(const struct portcount *pc, unsigned long long ticket, char *out, size_t cap)
{
	snprintf(out, cap, "%s:%llu", pc->instance, ticket);
}

/* The entry of `tenant`, made when absent and `make`; NULL otherwise (or ENOMEM). Under pc->lock. */
static struct pc_tenant *tenant_find(struct portcount *pc, const char *tenant, bool make)
{
	struct pc_tenant *t;

	for (t = pc->tenants; t; t = t->next)
		if (strcmp(t->tenant, tenant) == 0)
			return t;
	if (!make || strlen(tenant) >= sizeof(t->tenant) || !(t = calloc(1, sizeof(*t))))
		return NULL;
	snprintf(t->tenant, sizeof(t->tenant), "%s", tenant);
	t->next = pc->tenants;
	pc->tenants = t;
	return t;
}

/* Frees `t` when it holds nothing and nobody is asking for it. Under pc->lock. */
static void tenant_drop_empty(struct portcount *pc, struct pc_tenant *t)
{
	if (t->n > 0 || t->pending > 0)
		return;
	for (struct pc_tenant **pp = &pc->tenants; *pp; pp = &(*pp)->next) {
		if (*pp == t) {
			*pp = t->next;
			free(t->tickets);
			free(t);
			return;
		}
	}
}

/* Adds `ticket` to `t`: 0 or -ENOMEM. Under pc->lock. */
static int tenant_add(struct pc_tenant *t, unsigned long long ticket)
{
	if (t->n == t->cap) {
		long long cap = t->cap ? t->cap * 2 : 8;
		unsigned long long *nt = realloc(t->tickets, (size_t)cap * sizeof(*nt));

		if (!nt)
			return -ENOMEM;
		t->tickets = nt;
		t->cap = cap;
	}
	t->tickets[t->n++] = ticket;
	return 0;
}

/* Removes `ticket` from `t`: whether it held it. Under pc->lock. */
static bool tenant_remove(struct pc_tenant *t, unsigned long long ticket)
{
	for (long long i = 0; i < t->n; i++) {
		if (t->tickets[i] == ticket) {
			t->tickets[i] = t->tickets[--t->n];
			return true;
		}
	}
	return false;
}

/*
 * Runs `script` on KEYS[1] = `key` with `argc` arguments: the reply's integer into *out.
 * KILN_E_UNAVAILABLE when Redis does not answer, KILN_E_INTERNAL on an error reply.
 */
static enum kiln_err run_script(struct rds *rds, const char *script, const char *key, int argc,
				const char **args, long long *out)
{
	const char *argv[RENEW_BATCH + 8];
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	enum kiln_err rc;
	int n = 0;

	argv[n++] = "EVAL";
	argv[n++] = script;
	argv[n++] = "1";
	argv[n++] = key;
	for (int i = 0; i < argc; i++)
		argv[n++] = args[i];
	rc = rds_command(rds, n, argv, NULL, &rep, &err);
	if (rc == KILN_OK && rep.type != RDS_INT)
		rc = KILN_E_INTERNAL;
	if (rc == KILN_OK)
		*out = rep.integer;
	else if (rc != KILN_E_UNAVAILABLE)
		log_warn("port stream count: redis: %s", err.msg[0] ? err.msg : "unexpected reply");
	rds_reply_release(&rep);
	return rc;
}

bool portcount_take(struct portcount *pc, const char *tenant, long long max,
		    unsigned long long *ticket, bool *redis_down)
{
	char key[192], member[80], smax[24], slease[24];
	struct pc_tenant *t;
	struct rds *rds;
	long long added = 0, lease;
	enum kiln_err rc = KILN_E_UNAVAILABLE;
	bool ok = false;

	if (redis_down)
		*redis_down = false;
	pthread_mutex_lock(&pc->lock);
	t = tenant_find(pc, tenant, true);
	if (!t) {
		pthread_mutex_unlock(&pc->lock);
		return false;
	}
	*ticket = ++pc->next;
	rds = pc->rds;
	lease = pc->lease_ms;
	t->pending++;
	pthread_mutex_unlock(&pc->lock);

	if (rds) {
		const char *args[] = { smax, member, slease };

		key_of(tenant, key, sizeof(key));
		member_of(pc, *ticket, member, sizeof(member));
		snprintf(smax, sizeof(smax), "%lld", max);
		snprintf(slease, sizeof(slease), "%lld", lease);
		rc = run_script(rds, take_lua, key, 3, args, &added);
	}

	pthread_mutex_lock(&pc->lock);
	t->pending--;
	if (rc == KILN_OK)
		ok = added == 1;	/* across gateways */
	else
		ok = t->n < max;	/* this gateway's own count */
	if (ok && tenant_add(t, *ticket) != 0)
		ok = false;	/* (a member added in Redis expires with its lease) */
	tenant_drop_empty(pc, t);
	pthread_mutex_unlock(&pc->lock);
	if (rc != KILN_OK && redis_down)
		*redis_down = true;
	return ok;
}

void portcount_give(struct portcount *pc, const char *tenant, unsigned long long ticket)
{
	char key[192], member[80];
	struct pc_tenant *t;
	struct rds *rds;
	bool held = false;

	/* under `order`: a renewal running now put the member back before it goes, never after */
	pthread_mutex_lock(&pc->order);
	pthread_mutex_lock(&pc->lock);
	t = tenant_find(pc, tenant, false);
	if (t) {
		held = tenant_remove(t, ticket);
		tenant_drop_empty(pc, t);
	}
	rds = pc->rds;
	pthread_mutex_unlock(&pc->lock);
	if (held && rds) {
		struct kiln_error err = { 0 };

		key_of(tenant, key, sizeof(key));
		member_of(pc, ticket, member, sizeof(member));
		/* when Redis does not answer, the member expires with its lease */
		RDS(rds, NULL, &err, "ZREM", key, member);
	}
	pthread_mutex_unlock(&pc->order);
}

long long portcount_held(struct portcount *pc, const char *tenant)
{
	struct pc_tenant *t;
	long long n;

	pthread_mutex_lock(&pc->lock);
	t = tenant_find(pc, tenant, false);
	n = t ? t->n : 0;
	pthread_mutex_unlock(&pc->lock);
	return n;
}

/* One tenant's members, copied out of the lock for a renewal. */
struct renewal {
	char key[192];
	long long n;
	char (*members)[80];
};

/* Renews every lease this counter holds (puts back what Redis lost). */
static void renew_all(struct portcount *pc)
{
	struct renewal *r = NULL;
	struct rds *rds;
	long long lease;
	size_t nr = 0, i = 0;
	char slease[24];

	pthread_mutex_lock(&pc->order);
	pthread_mutex_lock(&pc->lock);
	rds = pc->rds;
	lease = pc->lease_ms;
	for (struct pc_tenant *t = pc->tenants; t; t = t->next)
		nr++;
	if (rds && nr && (r = calloc(nr, sizeof(*r)))) {
		for (struct pc_tenant *t = pc->tenants; t; t = t->next, i++) {
			key_of(t->tenant, r[i].key, sizeof(r[i].key));
			if (!t->n || !(r[i].members = calloc((size_t)t->n, sizeof(*r[i].members))))
				continue;
			r[i].n = t->n;
			for (long long j = 0; j < t->n; j++)
				member_of(pc, t->tickets[j], r[i].members[j], sizeof(r[i].members[j]));
		}
	}
	pthread_mutex_unlock(&pc->lock);
	snprintf(slease, sizeof(slease), "%lld", lease);
	for (i = 0; r && i < nr; i++) {
		for (long long j = 0; j < r[i].n; j += RENEW_BATCH) {
			const char *args[RENEW_BATCH + 1];
			long long k, done;

			args[0] = slease;
			for (k = 0; k < RENEW_BATCH && j + k < r[i].n; k++)
				args[k + 1] = r[i].members[j + k];
			if (run_script(rds, renew_lua, r[i].key, (int)k + 1, args, &done) ==
			    KILN_E_UNAVAILABLE)
				goto out;	/* again at the next round */
		}
	}
out:
	for (i = 0; r && i < nr; i++)
		free(r[i].members);
	free(r);
	pthread_mutex_unlock(&pc->order);
}

static void *renew_main(void *arg)
{
	struct portcount *pc = arg;

	pthread_mutex_lock(&pc->lock);
	while (!pc->stopping) {
		struct timespec due;
		long long step = pc->lease_ms / 3 > 0 ? pc->lease_ms / 3 : 1;

		due = clock_after_ms(CLOCK_MONOTONIC, step);
		while (!pc->stopping &&
		       pthread_cond_timedwait(&pc->wake, &pc->lock, &due) != ETIMEDOUT)
			;
		if (pc->stopping)
			break;
		pthread_mutex_unlock(&pc->lock);
		renew_all(pc);
		pthread_mutex_lock(&pc->lock);
	}
	pthread_mutex_unlock(&pc->lock);
	return NULL;
}

int portcount_attach(struct portcount *pc, struct rds *rds, long long lease_ms)
{
	unsigned char raw[12];
	int rc;

	if (!rds || lease_ms <= 0)
		return -EINVAL;
	if (getrandom(raw, sizeof(raw), 0) != (ssize_t)sizeof(raw))
		return -errno;
	pthread_mutex_lock(&pc->lock);
	if (pc->running) {
		pthread_mutex_unlock(&pc->lock);
		return -EBUSY;
	}
	pthread_cond_destroy(&pc->wake);
	clock_cond_init(&pc->wake, CLOCK_MONOTONIC);
	for (size_t i = 0; i < sizeof(raw); i++)
		snprintf(pc->instance + 2 * i, sizeof(pc->instance) - 2 * i, "%02x", raw[i]);
	pc->rds = rds;
	pc->lease_ms = lease_ms;
	pc->stopping = false;
	rc = pthread_create(&pc->thread, NULL, renew_main, pc);
	if (rc != 0)
		pc->rds = NULL;
	else
		pc->running = true;
	pthread_mutex_unlock(&pc->lock);
	return -rc;
}

void portcount_detach(struct portcount *pc)
{
	bool join;

	pthread_mutex_lock(&pc->lock);
	join = pc->running;
	pc->stopping = true;
	pthread_cond_broadcast(&pc->wake);
	pthread_mutex_unlock(&pc->lock);
	if (join)
		pthread_join(pc->thread, NULL);
	pthread_mutex_lock(&pc->order);	/* a give's ZREM under way ends first */
	pthread_mutex_lock(&pc->lock);
	pc->rds = NULL;
	pc->running = false;
	pthread_mutex_unlock(&pc->lock);
	pthread_mutex_unlock(&pc->order);
}

void portcount_destroy(struct portcount *pc)
{
	portcount_detach(pc);
	pthread_mutex_lock(&pc->lock);
	while (pc->tenants) {
		struct pc_tenant *t = pc->tenants;

		pc->tenants = t->next;
		free(t->tickets);
		free(t);
	}
	pthread_mutex_unlock(&pc->lock);
}
