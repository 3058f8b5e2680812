/*
 * ports.h - kiln-node's port streams: a byte stream from the node's API to 127.0.0.1:PORT inside
 * a sandbox, over the guest agent's channel (vmm/agent.h agent_port_*), never over the network.
 *
 * `GET /v1/sandboxes/{id}/ports/{port}/stream` with `Connection: Upgrade` and `Upgrade: kiln-port`,
 * authenticated as every node route, answers 101 once the guest connected and then carries raw
 * bytes both ways on the same connection; errors before that are the usual JSON errors: 502
 * port_closed (nothing listens), 504 port_timeout (no accept within port_connect_timeout_ms), 409
 * (not running), 429 (port_streams_max_per_sandbox). docs/ports.md.
 */
#ifndef KILN_NODE_PORTS_H
#define KILN_NODE_PORTS_H

#include "common/http.h"

struct node;
struct sandbox;

/* The route's handler. */
void ports_stream(struct http_req *req);

/*
 * Ends every port stream of `sb` and waits until none is left: called before its agent is freed
 * (sb_release), so no stream outlives the channel it runs on.
 */
void ports_drain(struct node *n, struct sandbox *sb);

#endif
