/*
 * redis.c - hiredis behind a lock, with lazy reconnects (see redis.h).
 */
#include "redis.h"

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

struct rds {
	char *host;		/* or the socket path when unix */
	int port;
	bool unix_socket;
	int timeout_ms;
	redisContext *ctx;
	time_t last_attempt;	/* of a failed connect, to space retries */
	pthread_mutex_t lock;
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

void rds_free(struct rds *r)
{
	if (!r)
		return;
	if (r->ctx)
		redisFree(r->ctx);
	pthread_mutex_destroy(&r->lock);
	free(r->host);
	free(r);
}

/* Called with the lock held. Returns 0 when r->ctx is usable. */
static int rds_connect(struct rds *r)
{
	struct timeval tv = { r->timeout_ms / 1000, (r->timeout_ms % 1000) * 1000 };
	time_t now = time(NULL);

	if (r->ctx && !r->ctx->err)
		return 0;
	if (r->ctx) {
		redisFree(r->ctx);
		r->ctx = NULL;
	}
	if (r->last_attempt == now)
		return -1;
	r->ctx = r->unix_socket ? redisConnectUnixWithTimeout(r->host, tv)
				: redisConnectWithTimeout(r->host, r->port, tv);
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

	if (out)
		memset(out, 0, sizeof(*out));
	pthread_mutex_lock(&r->lock);
	if (rds_connect(r)) {
		pthread_mutex_unlock(&r->lock);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "redis is unavailable");
	}
	rep = redisCommandArgv(r->ctx, argc, argv, argvlen);
	if (!rep) {
		log_warn("redis command failed: %s", r->ctx->errstr);
		redisFree(r->ctx);
		r->ctx = NULL;
		pthread_mutex_unlock(&r->lock);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "redis is unavailable");
	}
	pthread_mutex_unlock(&r->lock);

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
