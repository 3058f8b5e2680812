/*
 * err.h - the project's error codes.
 *
 * Module boundaries return an `enum kiln_err` and, where a caller needs the detail, fill a
 * `struct kiln_error` whose first message wins (as hiredis' errstr and jansson's json_error_t do).
 * OS-facing code below the boundaries returns 0 or a negative errno instead. KILN_ERR_TABLE below
 * gives every code its name, HTTP status and text; docs/errors.md lists the same rows.
 */
#ifndef KILN_ERR_H
#define KILN_ERR_H

#include <stdbool.h>
#include <stddef.h>

/*
 * The one table of the error codes: for each, in this order,
 *   its enum constant, its snake_case name (kiln_err_name: logs, and API replies that show it),
 *   the HTTP status API replies give it, whether a reply shows it (true) or says "internal" with a
 *   generic message and leaves the detail to the log (false), and its short description
 *   (kiln_strerror).
 * The enum below, err.c's lookups and http_reply_error() all read it; docs/errors.md and the error
 * table of docs/openapi.yaml must list the same (tests/unit/common/test_errdoc.c checks). Nothing
 * may depend on the order of the rows, except that KILN_OK comes first: zeroed memory, such as
 * `struct kiln_error err = { 0 }`, holds no error.
 */
#define KILN_ERR_TABLE(X)                                                                          \
	X(KILN_OK, "ok", 200, true, "success")                                                     \
	/* malformed input: bad JSON, wrong type, unknown field */                                 \
	X(KILN_E_BAD_REQUEST, "bad_request", 400, true, "malformed request")                       \
	/* no or bad credential */                                                                 \
	X(KILN_E_UNAUTHENTICATED, "unauthenticated", 401, true, "missing or invalid credential")   \
	/* credential lacks a scope */                                                             \
	X(KILN_E_FORBIDDEN, "forbidden", 403, true, "the credential lacks a required scope")       \
	/* the tenant is suspended by the operator */                                              \
	X(KILN_E_SUSPENDED, "suspended", 403, true, "the tenant is suspended")                     \
	/* a plan limit */                                                                         \
	X(KILN_E_QUOTA, "quota_exceeded", 403, true, "a plan limit was reached")                   \
	/* absent, deleted, or another tenant's */                                                 \
	X(KILN_E_NOT_FOUND, "not_found", 404, true, "no such object")                              \
	/* wrong state for the operation */                                                        \
	X(KILN_E_CONFLICT, "conflict", 409, true, "the object is in the wrong state")              \
	/* the tenant has no credits left */                                                       \
	X(KILN_E_CREDITS, "insufficient_credits", 402, true, "no credits left")                    \
	/* a body or field over its cap */                                                         \
	X(KILN_E_TOO_LARGE, "too_large", 413, true, "the request is too large")                    \
	/* a well-typed value out of range */                                                      \
	X(KILN_E_INVALID, "invalid", 422, true, "a value is out of range")                         \
	/* a request's headers or body came too slowly */                                         \
	X(KILN_E_TIMEOUT, "request_timeout", 408, true, "the request came too slowly")            \
	/* too many requests */                                                                    \
	X(KILN_E_RATE_LIMITED, "rate_limited", 429, true, "too many requests")                     \
	/* a route or field this server does not offer */                                          \
	X(KILN_E_NOT_IMPLEMENTED, "not_implemented", 501, true, "not offered by this server")      \
	/* the VM died or its agent stopped answering */                                           \
	X(KILN_E_SANDBOX_FAILED, "sandbox_failed", 502, true, "the sandbox stopped answering")     \
	/* nothing listens on a sandbox's port (port URLs, docs/ports.md) */                       \
	X(KILN_E_PORT_CLOSED, "port_closed", 502, true, "nothing listens on the sandbox's port")  \
	/* a sandbox's port did not answer in time */                                              \
	X(KILN_E_PORT_TIMEOUT, "port_timeout", 504, true, "the sandbox's port did not answer")    \
	/* no node can take the sandbox */                                                         \
	X(KILN_E_NO_CAPACITY, "no_capacity", 503, true, "no node has room for the sandbox")        \
	/* a dependency (Postgres, Redis, a node) is down */                                       \
	X(KILN_E_UNAVAILABLE, "unavailable", 503, true, "a dependency is unavailable")             \
	/* a local I/O error */                                                                    \
	X(KILN_E_IO, "io_error", 500, false, "input/output error")                                 \
	/* out of memory */                                                                        \
	X(KILN_E_NOMEM, "out_of_memory", 500, false, "out of memory")                              \
	/* a bug or an unexpected state */                                                         \
	X(KILN_E_INTERNAL, "internal", 500, false, "internal error")

enum kiln_err {
#define KILN_ERR_ENUM(id, name, status, shown, text) id,
	KILN_ERR_TABLE(KILN_ERR_ENUM)
#undef KILN_ERR_ENUM
	KILN_E__COUNT
};
_Static_assert(KILN_OK == 0, "zeroed memory must hold no error");

/* Maximum length of an error message, terminator included. */
#define KILN_ERRMSG_MAX 256

struct kiln_error {
	enum kiln_err code;
	char msg[KILN_ERRMSG_MAX];
};

/* A short human description of `e`; never NULL. */
const char *kiln_strerror(enum kiln_err e);

/* The snake_case name of `e` (e.g. "not_found"); "internal" for a value outside the enum. */
const char *kiln_err_name(enum kiln_err e);

/* The HTTP status an API reply gives `e` (e.g. 404); 500 for a value outside the enum. */
int kiln_err_status(enum kiln_err e);

/*
 * Whether an API reply may show `e`'s name and message: false for the codes whose detail stays in
 * the log (I/O, memory, internal errors) and for a value outside the enum.
 */
bool kiln_err_shown(enum kiln_err e);

/*
 * The `code` an API reply shows for `e`: its name when kiln_err_shown(e), else "internal".
 * Never NULL.
 */
const char *kiln_err_api_code(enum kiln_err e);

/*
 * Records `code` and a printf-style message in `err` unless an error is already recorded there
 * (the first error wins). `err` may be NULL. Returns `code`, so callers can write
 * `return kiln_error_set(err, KILN_E_INVALID, "vcpus out of range");`.
 */
enum kiln_err kiln_error_set(struct kiln_error *err, enum kiln_err code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Empties `err` so it can be reused. */
void kiln_error_clear(struct kiln_error *err);

#endif
