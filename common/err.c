/*
 * err.c - lookups in the table of the project's error codes (KILN_ERR_TABLE in err.h): names,
 * HTTP statuses, descriptions. docs/errors.md lists the same rows.
 */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* KILN_ERR_TABLE by code; the designated indexes keep it independent of the order of the codes. */
static const struct {
	const char *name;
	int status;
	bool shown;
	const char *text;
} err_table[KILN_E__COUNT] = {
#define ERR_ROW(id, name_, status_, shown_, text_) \
	[id] = { .name = name_, .status = status_, .shown = shown_, .text = text_ },
	KILN_ERR_TABLE(ERR_ROW)
#undef ERR_ROW
};

/* Whether `e` is a value of the enum (an out-of-range int cast to it is not). */
static bool err_known(enum kiln_err e)
{
	return (unsigned)e < KILN_E__COUNT;
}

const char *kiln_strerror(enum kiln_err e)
{
	return err_known(e) ? err_table[e].text : "unknown error";
}

const char *kiln_err_name(enum kiln_err e)
{
	return err_known(e) ? err_table[e].name : err_table[KILN_E_INTERNAL].name;
}

int kiln_err_status(enum kiln_err e)
{
	return err_known(e) ? err_table[e].status : err_table[KILN_E_INTERNAL].status;
}

bool kiln_err_shown(enum kiln_err e)
{
	return err_known(e) && err_table[e].shown;
}

const char *kiln_err_api_code(enum kiln_err e)
{
	return kiln_err_name(kiln_err_shown(e) ? e : KILN_E_INTERNAL);
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
