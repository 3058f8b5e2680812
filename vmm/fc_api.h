/*
 * fc_api.h - a client for Firecracker's REST API over its Unix socket (HTTP/1.1 through libcurl's
 * CURLOPT_UNIX_SOCKET_PATH), as Firecracker's API specification describes it (vendored in
 * tests/fixtures/firecracker/firecracker-openapi.yaml).
 *
 * Every request carries a JSON body or none; Firecracker answers 204 (no body) or 200 (a JSON
 * body) on success, 400 with {"fault_message": "..."} when it refuses the request, and other
 * statuses with the same Error body for internal failures. Bodies from the VMM are semi-trusted:
 * each is capped at FC_API_BODY_MAX bytes, must be JSON when present, and the fault message is
 * trimmed to printable ASCII before it reaches an error message. Every call has a deadline.
 *
 * Internal to vmm/: json_t does not leave this module's callers in vmm/. A client is not
 * thread-safe; the driver serializes the calls of one VM.
 *
 * Errors (enum kiln_err, message in `err`, first wins):
 *   KILN_E_INTERNAL        Firecracker refused the request (400 and other 4xx): the message
 *                          quotes its fault_message
 *   KILN_E_SANDBOX_FAILED  no answer (socket absent, refused, closed), deadline passed, 5xx, an
 *                          answer over the cap or not JSON
 *   KILN_E_NOMEM           out of memory
 */
#ifndef KILN_VMM_FC_API_H
#define KILN_VMM_FC_API_H

#include <jansson.h>
#include <stdbool.h>

#include "common/err.h"

#define FC_API_BODY_MAX (64 * 1024)	/* bytes of one response body */
#define FC_API_FAULT_MAX 160		/* bytes of a fault_message quoted in an error */

struct fc_api;

/*
 * A client for the API socket at `sock_path` (at most 107 bytes; a symlink to the socket is
 * fine). Does not connect yet. Returns NULL when out of memory or the path is too long; the
 * caller frees the client with fc_api_free().
 */
struct fc_api *fc_api_new(const char *sock_path);

/* Frees the client. Accepts NULL. */
void fc_api_free(struct fc_api *api);

/*
 * Sends `method` ("GET", "PUT", "PATCH") on `path` (e.g. "/machine-config") with `body` (borrowed;
 * NULL for none) and waits up to `timeout_ms` for the answer. On success *status (when not NULL)
 * is the HTTP status (200 or 204) and *resp (when not NULL) the answer's JSON body, or NULL for an
 * empty one; the caller frees it with json_decref(). `what` names the VM in error messages.
 */
enum kiln_err fc_api_call(struct fc_api *api, const char *what, const char *method, const char *path,
			  json_t *body, int timeout_ms, long *status, json_t **resp, struct kiln_error *err);

/*
 * Waits until the API answers `GET /` (Firecracker binds its socket shortly after it starts),
 * retrying every few milliseconds for up to `timeout_ms`. On success *resp (when not NULL) is the
 * InstanceInfo body, freed by the caller with json_decref().
 */
enum kiln_err fc_api_wait(struct fc_api *api, const char *what, int timeout_ms, json_t **resp,
			  struct kiln_error *err);

/*
 * Firecracker's RateLimiter object for a device doing at most `ops_per_s` operations and
 * `bytes_per_s` bytes per second: a TokenBucket each, {size: the per-second figure, refill_time:
 * 1000 ms, one_time_burst: 0} (a full bucket is one second of tokens; no credit beyond it). A 0
 * figure means no limit on that bucket: it is left out, or, with `explicit_none` (for a PATCH,
 * where a left-out bucket means "unchanged"), sent as {size: 0, refill_time: 0}, which Firecracker
 * takes as "disable this bucket". Returns a new object the caller json_decref()s, or NULL when out
 * of memory.
 */
json_t *fc_api_rate_limiter(unsigned long long ops_per_s, unsigned long long bytes_per_s, bool explicit_none);

#endif
