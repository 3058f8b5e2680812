/*
 * err.h - the project's error codes.
 *
 * Module boundaries return an `enum kiln_err` and, where a caller needs the detail, fill a
 * `struct kiln_error` whose first message wins (as hiredis' errstr and jansson's json_error_t do).
 * OS-facing code below the boundaries returns 0 or a negative errno instead. Only api/ maps these
 * codes to HTTP statuses. docs/errors.md lists every code.
 */
#ifndef KILN_ERR_H
#define KILN_ERR_H

#include <stddef.h>

enum kiln_err {
	KILN_OK = 0,
	KILN_E_BAD_REQUEST,	/* malformed input: bad JSON, wrong type, unknown field */
	KILN_E_UNAUTHENTICATED,	/* no or bad credential */
	KILN_E_FORBIDDEN,	/* credential lacks a scope */
	KILN_E_QUOTA,		/* a plan limit */
	KILN_E_NOT_FOUND,	/* absent, deleted, or another tenant's */
	KILN_E_CONFLICT,	/* wrong state for the operation */
	KILN_E_CREDITS,		/* the tenant has no credits left */
	KILN_E_TOO_LARGE,	/* a body or field over its cap */
	KILN_E_INVALID,		/* a well-typed value out of range */
	KILN_E_RATE_LIMITED,	/* too many requests */
	KILN_E_NOT_IMPLEMENTED,	/* a route or field this server does not offer */
	KILN_E_SANDBOX_FAILED,	/* the VM died or its agent stopped answering */
	KILN_E_NO_CAPACITY,	/* no node can take the sandbox */
	KILN_E_UNAVAILABLE,	/* a dependency (Postgres, Redis, a node) is down */
	KILN_E_IO,		/* a local I/O error */
	KILN_E_NOMEM,		/* out of memory */
	KILN_E_INTERNAL,	/* a bug or an unexpected state */
	KILN_E__COUNT
};

/* Maximum length of an error message, terminator included. */
#define KILN_ERRMSG_MAX 256

struct kiln_error {
	enum kiln_err code;
	char msg[KILN_ERRMSG_MAX];
};

/* A short human description of `e`; never NULL. */
const char *kiln_strerror(enum kiln_err e);

/* The snake_case code the public API uses for `e` (e.g. "not_found"); never NULL. */
const char *kiln_err_name(enum kiln_err e);

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
