/*
 * err.c - names and descriptions of the project's error codes (see err.h and docs/errors.md).
 */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const struct {
	const char *name;
	const char *text;
} err_table[KILN_E__COUNT] = {
	[KILN_OK] = { "ok", "success" },
	[KILN_E_BAD_REQUEST] = { "bad_request", "malformed request" },
	[KILN_E_UNAUTHENTICATED] = { "unauthenticated", "missing or invalid credential" },
	[KILN_E_FORBIDDEN] = { "forbidden", "the credential lacks a required scope" },
	[KILN_E_QUOTA] = { "quota_exceeded", "a plan limit was reached" },
	[KILN_E_NOT_FOUND] = { "not_found", "no such object" },
	[KILN_E_CONFLICT] = { "conflict", "the object is in the wrong state" },
	[KILN_E_CREDITS] = { "insufficient_credits", "no credits left" },
	[KILN_E_TOO_LARGE] = { "too_large", "the request is too large" },
	[KILN_E_INVALID] = { "invalid", "a value is out of range" },
	[KILN_E_RATE_LIMITED] = { "rate_limited", "too many requests" },
	[KILN_E_NOT_IMPLEMENTED] = { "not_implemented", "not offered by this server" },
	[KILN_E_SANDBOX_FAILED] = { "sandbox_failed", "the sandbox stopped answering" },
	[KILN_E_NO_CAPACITY] = { "no_capacity", "no node has room for the sandbox" },
	[KILN_E_UNAVAILABLE] = { "unavailable", "a dependency is unavailable" },
	[KILN_E_IO] = { "io_error", "input/output error" },
	[KILN_E_NOMEM] = { "out_of_memory", "out of memory" },
	[KILN_E_INTERNAL] = { "internal", "internal error" },
};

const char *kiln_strerror(enum kiln_err e)
{
	if ((unsigned)e >= KILN_E__COUNT)
		return "unknown error";
	return err_table[e].text;
}

const char *kiln_err_name(enum kiln_err e)
{
	if ((unsigned)e >= KILN_E__COUNT)
		return "internal";
	return err_table[e].name;
}

enum kiln_err kiln_error_set(struct kiln_error *err, enum kiln_err code, const char *fmt, ...)
{
	va_list ap;

	if (!err || err->code != KILN_OK)
		return code;
	err->code = code;
	va_start(ap, fmt);
	vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
	va_end(ap);
	return code;
}

void kiln_error_clear(struct kiln_error *err)
{
	if (!err)
		return;
	err->code = KILN_OK;
	err->msg[0] = '\0';
}
