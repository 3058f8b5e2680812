/*
 * redis.h - a thread-safe Redis client over hiredis with reconnects.
 *
 * One connection guarded by a lock; a broken connection is reopened on the next command (at most
 * once per second, so a down Redis costs a request nothing but a quick KILN_E_UNAVAILABLE).
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
