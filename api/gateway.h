/*
 * gateway.h - kiln-gateway's shared state and its route groups.
 *
 * The gateway is stateless beside Postgres and Redis: every instance can serve every request.
 * Each routes_*.c file holds one group of routes of API.md and exports its table.
 */
#ifndef KILN_GATEWAY_H
#define KILN_GATEWAY_H

#include <stddef.h>

#include "api/http.h"
#include "common/config.h"
#include "common/pg.h"
#include "common/redis.h"

struct gateway {
	struct kiln_config cfg;
	struct pg *pg;
	struct rds *rds;
	struct http_server *http;
};

/* A group of routes: a table and its length. */
struct route_group {
	const struct http_route *routes;
	size_t n;
};

extern const struct route_group routes_ops;	/* /healthz, /metrics */

#endif
