/*
 * e2b.h - kiln-gateway's E2B-compatible control plane (docs/e2b.md): E2B's REST API on a listener
 * of its own (config e2b_listen), mapped onto Kiln's sandboxes.
 */
#ifndef KILN_API_E2B_H
#define KILN_API_E2B_H

#include "api/gateway.h"
#include "common/err.h"

#define E2B_ENVD_VERSION "0.4.0"	/* the envd version the sandboxes advertise (valid semver) */
#define E2B_TOKEN_HEX 32		/* characters of an envdAccessToken */

/*
 * Starts the E2B listener on gw->cfg.e2b_listen (nothing when it is empty), and for its handlers
 * an inner API server: the gateway's own routes and hooks (`api`, the API server's settings) on
 * a Unix socket of its own, which the handlers call with the caller's key. So every E2B request
 * meets the same authentication, scopes, rate limits, in-flight bound, audit, plan limits and
 * metering as a Kiln request, and the per-address limits count the E2B client's address (at the
 * E2B listener) rather than the gateway's own. KILN_OK, or the error that kept it from listening.
 */
enum kiln_err e2b_start(struct gateway *gw, const struct http_server_opts *api,
			struct kiln_error *err);

/* The envdAccessToken of sandbox `id` (E2B_TOKEN_HEX hex digits; "" before e2b_start). */
void e2b_token_of(const char *id, char out[E2B_TOKEN_HEX + 1]);

/*
 * The data plane's before hook (e2b_code.c): a request for a guest port other than envd's
 * (E2b-Sandbox-Port, or a Host `{port}-{id}.{ports_domain}`) is forwarded to that port of the
 * sandbox and answered here (false); envd's requests go on to their routes (true).
 */
bool e2b_port_before(struct http_req *req, const struct http_route *route);

/* Stops the listener (letting requests finish for at most `grace_s` seconds); safe to repeat. */
void e2b_stop(unsigned grace_s);

#endif
