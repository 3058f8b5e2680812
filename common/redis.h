/*
 * redis.h - a thread-safe Redis client over hiredis with reconnects.
 *
 * One connection guarded by a lock; a broken connection is reopened on the next command (at most
 * once per second, so a down Redis costs a request nothing but a quick KILN_E_UNAVAILABLE). The
 * server is one address, or the primary Redis Sentinel names (rds_new_sentinel). A -READONLY reply
 * (a demoted primary) drops the connection and is KILN_E_UNAVAILABLE.
 * Replies are converted to `struct rds_reply`: redisReply never leaves this module.
 */
#ifndef KILN_REDIS_H
#define KILN_REDIS_H

#include <stddef.h>

#include "common/err.h"

enum rds_type { RDS_NIL, RDS_INT, RDS_STR, RDS_STATUS, RDS_ARRAY, RDS_ERROR };

struct rds_reply {
	enum rds_type type;
	long long integer;	/* RDS_INT */
	char *str;		/* RDS_STR, RDS_STATUS, RDS_ERROR; NUL-terminated */
	size_t len;
	size_t n;		/* RDS_ARRAY */
	struct rds_reply *elem;
};

struct rds;

/* A client for `url` ("host:port" or "unix:/path"); connects lazily. NULL on bad url or ENOMEM. */
struct rds *rds_new(const char *url, int timeout_ms);
/*
 * A client of the primary that Redis Sentinel names `master_name`: `sentinels` is a list of
 * host:port, comma- or space-separated (at most 8). The primary is asked of each sentinel in turn
 * (SENTINEL get-master-addr-by-name) on every new connection and checked with ROLE; a -READONLY
 * reply, a lost connection or a +switch-master the client hears from a sentinel (a watcher thread
 * subscribes to it) makes the next command look it up again. NULL on a bad list or ENOMEM.
 */
struct rds *rds_new_sentinel(const char *sentinels, const char *master_name, int timeout_ms);

/*
 * Calls fn(arg) (on the thread of the command that noticed it, without the client's lock) each
 * time the client connected to a primary at another address than before: a failover happened, and
 * what the old primary had not passed on to its replica is lost (the caller rebuilds what it
 * derives from elsewhere). Only Sentinel clients see a switch.
 */
void rds_set_switch_hook(struct rds *r, void (*fn)(void *), void *arg);

/*
 * The client `cfg` configures: rds_new_sentinel(redis_sentinels, redis_master_name) when
 * redis_sentinels is set, else rds_new(redis_url). NULL on a bad setting or ENOMEM.
 */
struct kiln_config;
struct rds *rds_open(const struct kiln_config *cfg, int timeout_ms);

void rds_free(struct rds *r);

/*
 * Sends one command given as argv (binary-safe with `argvlen`, or NULL for C strings). On success
 * *out (when not NULL) holds the reply: free it with rds_reply_release(). A Redis error reply is
 * KILN_E_INTERNAL with its text in `err`; an unreachable server is KILN_E_UNAVAILABLE.
 */
enum kiln_err rds_command(struct rds *r, int argc, const char **argv, const size_t *argvlen,
			  struct rds_reply *out, struct kiln_error *err);

/* rds_command with the arguments inline: RDS(r, &reply, err, "SET", key, value). */
#define RDS(r, out, err, ...)                                                                 \
	rds_command((r),                                                                      \
		    (int)(sizeof((const char *[]){ __VA_ARGS__ }) / sizeof(const char *)),    \
		    (const char *[]){ __VA_ARGS__ }, NULL, (out), (err))

/* Frees what a reply holds (not the struct itself). Accepts NULL. */
void rds_reply_release(struct rds_reply *rep);

/* Checks that Redis answers PING. */
enum kiln_err rds_ping(struct rds *r, struct kiln_error *err);

#endif
