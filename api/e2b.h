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
 * Starts the E2B listener on gw->cfg.e2b_listen (nothing when it is empty). Its handlers call
 * the gateway's own API at `api_port` on the loopback address with the caller's key, so every
 * request meets the same authentication, scopes, rate limits, audit, plan limits and metering as
 * a Kiln request. KILN_OK, or the error that kept it from listening.
 */
enum kiln_err e2b_start(struct gateway *gw, unsigned api_port, struct kiln_error *err);

/* Stops the listener (letting requests finish for at most `grace_s` seconds); safe to repeat. */
void e2b_stop(unsigned grace_s);

#endif
