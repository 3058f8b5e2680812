/*
 * ports.h - what the gateway's port routes (api/ports.c) and its port URL listener
 * (api/portproxy.c) share: the per-tenant stream count, opening a stream on a sandbox's node, and
 * the listener's address and signing key (docs/ports.md).
 */
#ifndef KILN_PORTS_H
#define KILN_PORTS_H

#include <stdbool.h>
#include <stddef.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "api/porturl.h"

/*
 * Counts a stream in for `tenant` unless it holds `max` already (port_streams_max_per_tenant,
 * across the gateways sharing a Redis; api/portcount.h): returns whether it was counted, with
 * *ticket naming it; each true is undone by port_tenant_give() with that ticket.
 */
bool port_tenant_take(const char *tenant, long long max, unsigned long long *ticket);
void port_tenant_give(const char *tenant, unsigned long long ticket);

/* Counts in the gateway's Redis from now on (0 or -errno); until the detach, at the stop. */
struct rds;
int port_counts_attach(struct rds *rds);
void port_counts_detach(void);

/* A node's answer to a stream's upgrade. */
struct port_node {
	int fd;			/* the node's socket: after a 101 the stream, else -1 */
	int status;		/* the node's status */
	char *buf;		/* its head and what followed (malloc'd; port_node_free) */
	size_t have, head_len;	/* bytes in buf; of them, the head's */
};

/*
 * Asks the node at `address` for a stream to `port` of sandbox `id` for `who`. KILN_OK when the
 * node answered (pn->status; for 101 pn->fd is the stream and buf[head_len..have) its first
 * bytes; for anything else buf holds its JSON error body after the head); KILN_E_UNAVAILABLE
 * when the node cannot be reached or does not answer in time; KILN_E_INTERNAL or KILN_E_NOMEM.
 */
enum kiln_err port_node_open(struct gateway *gw, const struct principal *who, const char *id,
			     const char *address, long port, const char *request_id,
			     struct port_node *pn);
void port_node_free(struct port_node *pn);

/* A header's value in a head (lines "Name: value\r\n") into `out`; false when absent. */
bool port_head_value(const char *head, const char *name, char *out, size_t cap);

/*
 * Records auto_resume for the sandbox `id` a create request is making (before its node makes
 * it): true, or false after replying 503.
 */
bool port_settings_create(struct http_req *req, const char *id);

/*
 * The port URL listener (config ports_listen), started after the API's (portproxy.c). The
 * stop waits for its connections, which it ends, before the gateway's pools go away.
 */
enum kiln_err portproxy_start(struct gateway *gw, struct kiln_error *err);
void portproxy_stop(void);

/* The URL of `port` of sandbox `id` ("sb_..."), into `out`: http://{port}-{label}.{domain}:{p}. */
void portproxy_url(const char *id, long port, char *out, size_t cap);

/* The key signed port URLs are made with (derived from the master key at start). */
const unsigned char *portproxy_key(void);

#endif
