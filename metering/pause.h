/*
 * pause.h - kiln-meter's requests to pause sandboxes whose tenant ran out of credits.
 *
 * Each request is POST <node address>/v1/sandboxes/{id}/pause with a node token signed as the
 * gateway signs them (auth/signing.h, aud kiln-node, the tenant and the sandbox), each from a
 * worker thread of its own (started on demand, up to 256 in flight), so neither the meter's tick
 * nor another pause waits for a pause writing its snapshot: any number of sandboxes at zero on a
 * node are asked at once. A sandbox is only ever paused, never destroyed.
 */
#ifndef KILN_METERING_PAUSE_H
#define KILN_METERING_PAUSE_H

#include "common/err.h"
#include "common/pg.h"

struct signing;
struct pauser;

/* Workers for node `node_id`, whose address is read from `nodes` (the last one read is used while
 * Postgres is away). NULL when out of memory. */
struct pauser *pauser_new(struct pg *pg, struct signing *signing, const char *node_id);

/* Stops the workers (requests in flight finish) and frees. Accepts NULL. */
void pauser_free(struct pauser *p);

/* Queues a pause of `sandbox_id` for `tenant_id`; drops it when the queue is full. */
void pauser_ask(void *p, const char *sandbox_id, const char *tenant_id);

#endif
