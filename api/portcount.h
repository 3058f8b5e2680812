/*
 * portcount.h - the port streams each tenant holds open, counted across gateways
 * (port_streams_max_per_tenant, docs/ports.md).
 *
 * Every stream a gateway lets through is a member of a sorted set in Redis per tenant
 * (kiln:port_streams:{tenant}), scored by the end of its lease: taking one drops the expired
 * members and adds the new one only while fewer than the cap remain, in one script, so gateways
 * sharing a Redis hold the cap in total. The holder renews its members' leases (a thread, every
 * third of a lease) and removes each one when its stream ends; a gateway that dies leaves its
 * members to expire within a lease. Each gateway also counts its own streams: while Redis cannot
 * be reached, that count against the same cap decides (the cap then holds per gateway), and the
 * renewal puts the streams admitted meanwhile back in Redis once it answers again.
 */
#ifndef KILN_PORTCOUNT_H
#define KILN_PORTCOUNT_H

#include <pthread.h>
#include <stdbool.h>

struct rds;
struct pc_tenant;

struct portcount {
	pthread_mutex_t lock;		/* tenants, rds, next */
	pthread_mutex_t order;		/* orders a renewal against removals, so none comes back */
	pthread_cond_t wake;		/* the renewal thread's sleep, cut short by detach */
	struct pc_tenant *tenants;	/* this gateway's streams, per tenant */
	struct rds *rds;		/* NULL: this gateway's own count alone */
	long long lease_ms;
	unsigned long long next;	/* the last stream's number */
	char instance[40];		/* this counter's name in the members */
	bool running, stopping;
	pthread_t thread;
};

/* A counter without Redis (its own count alone). Contexts in static storage may use PORTCOUNT_INIT. */
#define PORTCOUNT_INIT                                                                        \
	{ .lock = PTHREAD_MUTEX_INITIALIZER, .order = PTHREAD_MUTEX_INITIALIZER,              \
	  .wake = PTHREAD_COND_INITIALIZER }
void portcount_init(struct portcount *pc);

/*
 * Counts in Redis from now on (`rds` outlives the counter's use of it, until portcount_detach),
 * with leases of `lease_ms`, and starts the renewal thread. 0 or -errno.
 */
int portcount_attach(struct portcount *pc, struct rds *rds, long long lease_ms);

/* Stops the renewal thread and forgets Redis: the counter's own count decides from then on. */
void portcount_detach(struct portcount *pc);

/* Detaches and frees what the counter holds (streams not given back are dropped). */
void portcount_destroy(struct portcount *pc);

/*
 * Counts a stream in for `tenant` unless the tenant holds `max` already (across gateways when
 * Redis answers, else on this gateway): returns whether it was counted, with *ticket naming it
 * for portcount_give(). *redis_down (when not NULL) tells that Redis did not answer.
 */
bool portcount_take(struct portcount *pc, const char *tenant, long long max,
		    unsigned long long *ticket, bool *redis_down);

/* Gives back the stream `ticket` of `tenant`, counted by portcount_take(). */
void portcount_give(struct portcount *pc, const char *tenant, unsigned long long ticket);

/* Streams of `tenant` this counter holds (for tests and the log). */
long long portcount_held(struct portcount *pc, const char *tenant);

#endif
