/*
 * redis.c - hiredis behind a lock, with lazy reconnects and Sentinel discovery (see redis.h).
 */
#include "redis.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <poll.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"

#define RDS_SENTINELS_MAX 8

struct rds {
	char *host;		/* or the socket path when unix; with Sentinel, the primary's */
	int port;
	bool unix_socket;
	int timeout_ms;
	redisContext *ctx;
	time_t last_attempt;	/* of a failed connect, to space retries */
	pthread_mutex_t lock;

	/* Sentinel mode (rds_new_sentinel): the primary is asked of these, in turn. */
	char *master_name;
	size_t nsentinels;
	char *sentinel_host[RDS_SENTINELS_MAX];
	int sentinel_port[RDS_SENTINELS_MAX];
	atomic_bool stale;	/* a +switch-master was heard: rediscover before the next command */
	void (*hook)(void *);	/* rds_set_switch_hook */
	void *hook_arg;
	pthread_t watcher;	/* subscribed to +switch-master on a sentinel */
	bool watching;
	atomic_bool stopping;
};

struct rds *rds_new(const char *url, int timeout_ms)
{
	struct rds *r = calloc(1, sizeof(*r));
	const char *colon;

	if (!r)
		return NULL;
	r->timeout_ms = timeout_ms;
	if (strncmp(url, "unix:", 5) == 0) {
		r->unix_socket = true;
		r->host = strdup(url + 5);
	} else {
		colon = strrchr(url, ':');
		if (!colon || !colon[1]) {
			free(r);
			return NULL;
		}
		r->host = strndup(url, (size_t)(colon - url));
		r->port = atoi(colon + 1);
		if (r->port <= 0 || r->port > 65535) {
			free(r->host);
			free(r);
			return NULL;
		}
	}
	if (!r->host) {
		free(r);
		return NULL;
	}
	pthread_mutex_init(&r->lock, NULL);
	return r;
}

/* Splits "host:port" ("[v6]:port") into a copy of the host and the port; -1 when malformed. */
static int addr_split(const char *s, size_t n, char **host, int *port)
{
	const char *colon = memrchr(s, ':', n);
	char *end;
	long p;

	if (!colon || colon == s || colon + 1 == s + n)
		return -1;
	p = strtol(colon + 1, &end, 10);
	if (end != s + n || p <= 0 || p > 65535)
		return -1;
	if (s[0] == '[' && colon[-1] == ']' && colon - s > 2)	/* [v6 address]:port */
		*host = strndup(s + 1, (size_t)(colon - s - 2));
	else
		*host = strndup(s, (size_t)(colon - s));
	*port = (int)p;
	return *host ? 0 : -1;
}

static void *rds_watch(void *arg);

struct rds *rds_new_sentinel(const char *sentinels, const char *master_name, int timeout_ms)
{
	struct rds *r;
	const char *p = sentinels;

	if (!sentinels || !master_name || !*master_name || strlen(master_name) > 128)
		return NULL;
	r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	r->timeout_ms = timeout_ms;
	r->master_name = strdup(master_name);
	if (!r->master_name)
		goto fail;
	while (*p) {
		size_t n = strcspn(p, ", ");

		if (n) {
			if (r->nsentinels == RDS_SENTINELS_MAX ||
			    addr_split(p, n, &r->sentinel_host[r->nsentinels],
				       &r->sentinel_port[r->nsentinels]))
				goto fail;
			r->nsentinels++;
		}
		p += n;
		p += strspn(p, ", ");
	}
	if (r->nsentinels == 0)
		goto fail;
	pthread_mutex_init(&r->lock, NULL);
	r->watching = pthread_create(&r->watcher, NULL, rds_watch, r) == 0;
	if (!r->watching)
		log_warn("redis: cannot watch the sentinels for +switch-master; a failover is "
			 "noticed on the first failing command");
	return r;
fail:
	for (size_t i = 0; i < r->nsentinels; i++)
		free(r->sentinel_host[i]);
	free(r->master_name);
	free(r);
	return NULL;
}

struct rds *rds_open(const struct kiln_config *cfg, int timeout_ms)
{
	if (cfg->redis_sentinels && *cfg->redis_sentinels)
		return rds_new_sentinel(cfg->redis_sentinels, cfg->redis_master_name, timeout_ms);
	return rds_new(cfg->redis_url, timeout_ms);
}

void rds_set_switch_hook(struct rds *r, void (*fn)(void *), void *arg)
{
	pthread_mutex_lock(&r->lock);
	r->hook = fn;
	r->hook_arg = arg;
	pthread_mutex_unlock(&r->lock);
}

void rds_free(struct rds *r)
{
	if (!r)
		return;
	if (r->watching) {
		atomic_store(&r->stopping, true);
		pthread_join(r->watcher, NULL);
	}
	if (r->ctx)
		redisFree(r->ctx);
	pthread_mutex_destroy(&r->lock);
	for (size_t i = 0; i < r->nsentinels; i++)
		free(r->sentinel_host[i]);
	free(r->master_name);
	free(r->host);
	free(r);
}

/*
 * Asks the sentinels, in turn, for the primary of r->master_name and stores it in r->host and
 * r->port. Returns 1 when the address changed (a failover since the last discovery; not on the
 * first one), 0 when it did not, -1 when no sentinel answered with an address.
 */
static int sentinel_discover(struct rds *r)
{
	struct timeval tv = { r->timeout_ms / 1000, (r->timeout_ms % 1000) * 1000 };

	for (size_t i = 0; i < r->nsentinels; i++) {
		redisContext *sc = redisConnectWithTimeout(r->sentinel_host[i], r->sentinel_port[i], tv);
		redisReply *rep = NULL;
		char *host = NULL;
		int port = 0, changed;

		if (sc && !sc->err) {
			redisSetTimeout(sc, tv);
			rep = redisCommand(sc, "SENTINEL get-master-addr-by-name %s", r->master_name);
		}
		if (rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
		    rep->element[0]->type == REDIS_REPLY_STRING &&
		    rep->element[1]->type == REDIS_REPLY_STRING) {
			host = strdup(rep->element[0]->str);
			port = atoi(rep->element[1]->str);
		}
		if (rep)
			freeReplyObject(rep);
		if (sc)
			redisFree(sc);
		if (!host || port <= 0 || port > 65535) {
			free(host);
			log_warn("redis: sentinel %s:%d does not name a primary of \"%s\"",
				 r->sentinel_host[i], r->sentinel_port[i], r->master_name);
			continue;
		}
		changed = r->host && (strcmp(r->host, host) != 0 || r->port != port);
		if (changed || !r->host)
			log_info("redis: sentinel %s:%d names %s:%d the primary of \"%s\"",
				 r->sentinel_host[i], r->sentinel_port[i], host, port, r->master_name);
		free(r->host);
		r->host = host;
		r->port = port;
		return changed;
	}
	return -1;
}

/* Whether `ctx` reaches a primary (ROLE's first element is "master"). */
static bool rds_is_primary(redisContext *ctx)
{
	redisReply *rep = redisCommand(ctx, "ROLE");
	bool ok = rep && rep->type == REDIS_REPLY_ARRAY && rep->elements > 0 &&
		  rep->element[0]->type == REDIS_REPLY_STRING &&
		  strcmp(rep->element[0]->str, "master") == 0;

	if (rep)
		freeReplyObject(rep);
	return ok;
}

/*
 * Called with the lock held. Returns 0 when r->ctx is usable. With Sentinel, the primary is
 * looked up again on every new connection and checked with ROLE (a sentinel mid-failover may
 * still name the old one); *switched is set when the primary's address changed.
 */
static int rds_connect(struct rds *r, bool *switched)
{
	struct timeval tv = { r->timeout_ms / 1000, (r->timeout_ms % 1000) * 1000 };
	time_t now = time(NULL);

	if (r->master_name && atomic_exchange(&r->stale, false) && r->ctx) {
		redisFree(r->ctx);
		r->ctx = NULL;
		r->last_attempt = 0;
	}
	if (r->ctx && !r->ctx->err)
		return 0;
	if (r->ctx) {
		redisFree(r->ctx);
		r->ctx = NULL;
	}
	if (r->last_attempt == now)
		return -1;
	if (r->master_name) {
		int d = sentinel_discover(r);

		if (d < 0) {
			r->last_attempt = now;
			return -1;
		}
		if (d > 0)
			*switched = true;
	}
	r->ctx = r->unix_socket ? redisConnectUnixWithTimeout(r->host, tv)
				: redisConnectWithTimeout(r->host, r->port, tv);
	if (r->ctx && !r->ctx->err && r->master_name) {
		redisSetTimeout(r->ctx, tv);
		if (!rds_is_primary(r->ctx)) {
			log_warn("redis: %s:%d is not a primary yet", r->host, r->port);
			redisFree(r->ctx);
			r->ctx = NULL;
			r->last_attempt = now;
			return -1;
		}
	}
	if (!r->ctx || r->ctx->err) {
		log_warn("redis connect failed: %s", r->ctx ? r->ctx->errstr : "out of memory");
		if (r->ctx)
			redisFree(r->ctx);
		r->ctx = NULL;
		r->last_attempt = now;
		return -1;
	}
	redisSetTimeout(r->ctx, tv);
	r->last_attempt = 0;
	return 0;
}

static int rds_convert(const redisReply *in, struct rds_reply *out)
{
	memset(out, 0, sizeof(*out));
	switch (in->type) {
	case REDIS_REPLY_INTEGER:
		out->type = RDS_INT;
		out->integer = in->integer;
		return 0;
	case REDIS_REPLY_NIL:
		out->type = RDS_NIL;
		return 0;
	case REDIS_REPLY_STRING:
	case REDIS_REPLY_STATUS:
	case REDIS_REPLY_ERROR:
		out->type = in->type == REDIS_REPLY_STRING   ? RDS_STR
			    : in->type == REDIS_REPLY_STATUS ? RDS_STATUS
							     : RDS_ERROR;
		out->str = malloc(in->len + 1);
		if (!out->str)
			return -1;
		memcpy(out->str, in->str, in->len);
		out->str[in->len] = '\0';
		out->len = in->len;
		return 0;
	case REDIS_REPLY_ARRAY:
		out->type = RDS_ARRAY;
		if (in->elements == 0)
			return 0;
		out->elem = calloc(in->elements, sizeof(*out->elem));
		if (!out->elem)
			return -1;
		out->n = in->elements;
		for (size_t i = 0; i < in->elements; i++)
			if (rds_convert(in->element[i], &out->elem[i]))
				return -1;
		return 0;
	default:
		out->type = RDS_NIL;
		return 0;
	}
}

void rds_reply_release(struct rds_reply *rep)
{
	if (!rep)
		return;
	for (size_t i = 0; i < rep->n; i++)
		rds_reply_release(&rep->elem[i]);
	free(rep->elem);
	free(rep->str);
	memset(rep, 0, sizeof(*rep));
}

enum kiln_err rds_command(struct rds *r, int argc, const char **argv, const size_t *argvlen,
			  struct rds_reply *out, struct kiln_error *err)
{
	redisReply *rep;
	struct rds_reply tmp;
	enum kiln_err rc = KILN_OK;
	bool switched = false;
	void (*hook)(void *);
	void *hook_arg;

	if (out)
		memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&r->lock);
	hook = r->hook;
	hook_arg = r->hook_arg;
	if (rds_connect(r, &switched)) {
		pthread_mutex_unlock(&r->lock);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "redis is unavailable");
	}
	rep = redisCommandArgv(r->ctx, argc, argv, argvlen);
	if (!rep) {
		log_warn("redis command failed: %s", r->ctx->errstr);
		redisFree(r->ctx);
		r->ctx = NULL;
		pthread_mutex_unlock(&r->lock);
		if (switched && hook)
			hook(hook_arg);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "redis is unavailable");
	}
	if (rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, "READONLY", 8) == 0) {
		/* The server was demoted to a replica (a failover): find the primary again. */
		log_warn("redis: %s:%d is read-only now; reconnecting to the primary", r->host,
			 r->port);
		redisFree(r->ctx);
		r->ctx = NULL;
		pthread_mutex_unlock(&r->lock);
		freeReplyObject(rep);
		if (switched && hook)
			hook(hook_arg);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "redis is unavailable (failover)");
	}
	pthread_mutex_unlock(&r->lock);
	if (switched && hook)
		hook(hook_arg);

	if (rds_convert(rep, &tmp)) {
		rds_reply_release(&tmp);
		freeReplyObject(rep);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	freeReplyObject(rep);
	if (tmp.type == RDS_ERROR) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "redis error: %.200s", tmp.str);
		rds_reply_release(&tmp);
		return rc;
	}
	if (out)
		*out = tmp;
	else
		rds_reply_release(&tmp);
	return KILN_OK;
}

enum kiln_err rds_ping(struct rds *r, struct kiln_error *err)
{
	return RDS(r, NULL, err, "PING");
}

/* A pub/sub message ["message", "+switch-master", "<name> <old ip> <old port> <ip> <port>"]. */
static void watch_message(struct rds *r, const redisReply *rep)
{
	size_t n = strlen(r->master_name);

	if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 3 &&
	    rep->element[2]->type == REDIS_REPLY_STRING &&
	    strncmp(rep->element[2]->str, r->master_name, n) == 0 && rep->element[2]->str[n] == ' ') {
		log_info("redis: sentinel says +switch-master %s", rep->element[2]->str);
		atomic_store(&r->stale, true);
	}
}

/*
 * The watcher of a Sentinel client: subscribed to +switch-master on one sentinel after another
 * (the next when one stops answering), it marks the client stale on a switch of its primary, so
 * the next command reconnects at once instead of writing to a demoted server. It polls with a
 * one-second bound to notice rds_free().
 */
static void *rds_watch(void *arg)
{
	struct rds *r = arg;
	struct timeval tv = { 1, 0 };
	size_t i = 0;

	while (!atomic_load(&r->stopping)) {
		redisContext *sc = redisConnectWithTimeout(r->sentinel_host[i], r->sentinel_port[i], tv);
		redisReply *rep = NULL;

		if (sc && !sc->err) {
			redisSetTimeout(sc, tv);
			rep = redisCommand(sc, "SUBSCRIBE +switch-master");
		}
		if (rep && rep->type != REDIS_REPLY_ERROR) {
			freeReplyObject(rep);
			rep = NULL;
			while (!atomic_load(&r->stopping)) {
				struct pollfd pfd = { .fd = sc->fd, .events = POLLIN };
				int n = poll(&pfd, 1, 1000);

				if (n == 0 || (n < 0 && errno == EINTR))
					continue;
				if (n < 0 || redisBufferRead(sc) != REDIS_OK) {
					i = (i + 1) % r->nsentinels;	/* it went away: the next */
					break;
				}
				while (redisGetReplyFromReader(sc, (void **)&rep) == REDIS_OK && rep) {
					watch_message(r, rep);
					freeReplyObject(rep);
					rep = NULL;
				}
			}
		} else {
			if (rep)
				freeReplyObject(rep);
			i = (i + 1) % r->nsentinels;
		}
		if (sc)
			redisFree(sc);
		if (!atomic_load(&r->stopping))
			usleep(100 * 1000);
	}
	return NULL;
}
