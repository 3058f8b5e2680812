/*
 * nodeclient.h - the gateway's calls to kiln-node: every request carries a JWT signed for it
 * (aud kiln-node, the tenant, the scopes, the sandbox, a short expiry), and the node's reply is
 * streamed back to the client as it comes (exec events, file bytes).
 */
#ifndef KILN_NODECLIENT_H
#define KILN_NODECLIENT_H

#include <stdbool.h>
#include <stddef.h>

#include "api/authn.h"
#include "common/http.h"

struct node_call {
	const char *address;	/* "unix:/path" or "http://host:port" */
	const char *method;
	const char *path;	/* with the query, e.g. "/v1/sandboxes/sb_x/files?path=%2Fa" */
	const char *sandbox_id;
	const struct principal *who;
	const void *body;	/* a buffered body, or NULL */
	size_t body_len;
	int upload_fd;		/* or a streamed body read from this descriptor until its end; -1 */
	const char *content_type;	/* of the body */
	const char *accept;	/* passed on, or NULL */
	long timeout_ms;	/* of a call answered into memory; 0: NODE_SYNC_TIMEOUT_MS */
};

/*
 * Sends the call and replies to `req` with the node's answer, streamed. When the node cannot be
 * reached, replies 503 unavailable. Takes ownership of call->upload_fd.
 */
void node_proxy(struct http_req *req, const struct node_call *call);

/* How long a call answered into memory may take, in all. */
#define NODE_SYNC_TIMEOUT_MS 15000L

/*
 * The same call, answered into memory: *status and a malloc'd body (the caller frees it), for
 * calls whose answer the gateway reads itself. Returns KILN_E_UNAVAILABLE when the node cannot
 * be reached or does not answer within NODE_SYNC_TIMEOUT_MS (*status 0). When the call could not
 * even be made (no token could be signed, out of memory), *replied is set: `req` was answered
 * already and the caller must not reply again.
 */
enum kiln_err node_call_sync(struct http_req *req, const struct node_call *call, long *status,
			     char **body, size_t *len, bool *replied);

/*
 * The same call made by the gateway itself, outside any request (its periodic work: api/debt.c),
 * under `request_id`: *status is the node's answer (its body is dropped). KILN_E_UNAVAILABLE
 * when the node cannot be reached or does not answer in time (*status 0); KILN_E_INTERNAL or
 * KILN_E_NOMEM when the call could not be made.
 */
struct gateway;
enum kiln_err node_call_bg(struct gateway *gw, const char *request_id, const struct node_call *call,
			   long *status);

/*
 * Starts a call whose body the caller streams: returns a descriptor to write the body to (close
 * it at the end), or -1. The answer is collected by node_proxy_finish().
 */
struct node_stream;
struct node_stream *node_stream_start(struct http_req *req, const struct node_call *call,
				      int *body_fd);
/* Waits for the node's answer to a streamed call and replies with it. Frees `ns`. */
void node_stream_finish(struct http_req *req, struct node_stream *ns);
/*
 * A node token for the request's caller and `sandbox_id`, as every call carries (the caller
 * frees it), for connections the caller makes itself (api/ports.c); NULL when it cannot be signed.
 */
char *node_token(struct http_req *req, const char *sandbox_id);
struct gateway;

/* The same for `who`, outside any request (the ports listener, api/portproxy.c). */
char *node_token_for(struct gateway *gw, const struct principal *who, const char *sandbox_id);

/* `s` escaped for a URL's query; the caller frees it with free(). NULL when out of memory. */
char *node_escape(const char *s);

/* Abandons a streamed call (the body was refused); frees `ns`. Accepts NULL. */
void node_stream_abort(struct node_stream *ns);

#endif
