/*
 * json.h - strict request-body parsing and small helpers over jansson.
 *
 * Bodies are objects whose allowed fields are described by a table: an unknown field, a field of
 * the wrong type, a missing required field or malformed JSON each fail with KILN_E_BAD_REQUEST and
 * a message naming the field. Range checks stay with the caller (KILN_E_INVALID).
 */
#ifndef KILN_JSON_H
#define KILN_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

enum jf_type { JF_STRING, JF_INT, JF_NUMBER, JF_BOOL, JF_OBJECT, JF_ARRAY, JF_ANY };

struct json_field {
	const char *name;
	enum jf_type type;
	bool required;
	size_t max_len;	/* JF_STRING: longest value in bytes (0: no cap); JF_ARRAY: most items */
};

/*
 * Parses `len` bytes of `text` as one JSON object and checks it against `fields`. An empty body
 * counts as `{}`. On success *out is a new reference the caller must json_decref(). On failure
 * returns KILN_E_BAD_REQUEST (or KILN_E_TOO_LARGE for an over-long value) with `err` naming the
 * problem, and *out is NULL.
 */
enum kiln_err json_parse_body(const char *text, size_t len, const struct json_field *fields,
			      size_t nfields, json_t **out, struct kiln_error *err);

/* Checks an already parsed object against `fields` (same rules as json_parse_body). */
enum kiln_err json_check_object(const json_t *obj, const struct json_field *fields, size_t nfields,
				const char *where, struct kiln_error *err);

/* The string field `name` of `obj`, or `def` when absent or null. The result is owned by `obj`. */
const char *json_str(const json_t *obj, const char *name, const char *def);

/* The integer field `name` of `obj`, or `def` when absent or null. */
long long json_int(const json_t *obj, const char *name, long long def);

#endif
