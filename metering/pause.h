/*
 * pause.h - kiln-meter's requests to pause sandboxes whose tenant ran out of credits.
 *
 * Each request is POST <node address>/v1/sandboxes/{id}/pause with a node token signed as the
 * gateway signs them (auth/signing.h, aud kiln-node, the tenant and the sandbox), sent from a few
 * worker threads so a slow pause (it writes a snapshot) never holds up the meter's tick. A
 * sandbox is only ever paused, never destroyed.
 */
#ifndef KILN_METERING_PAUSE_H
#define KILN_METERING_PAUSE_H

#include "common/err.h"
#include "common/pg.h"

struct signing;
struct pauser;

/* Workers for node `node_id`, whose address is read from `nodes`. NULL when out of memory. */
struct pauser *pauser_new(struct pg *pg, struct signing *signing, const char *node_id);

/* Stops the workers (requests in flight finish) and frees. Accepts NULL. */
void pauser_free(struct pauser *p);

/* Queues a pause of `sandbox_id` for `tenant_id`; drops it when the queue is full. */
void pauser_ask(void *p, const char *sandbox_id, const char *tenant_id);

#endif
