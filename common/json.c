/*
 * json.c - strict body parsing over jansson (see json.h).
 */
#include "json.h"

#include <string.h>

static const char *const jf_names[] = {
	[JF_STRING] = "a string", [JF_INT] = "an integer", [JF_NUMBER] = "a number",
	[JF_BOOL] = "a boolean",  [JF_OBJECT] = "an object", [JF_ARRAY] = "an array",
	[JF_ANY] = "a value",
};

static bool jf_matches(const json_t *v, enum jf_type t)
{
	switch (t) {
	case JF_STRING:
		return json_is_string(v);
	case JF_INT:
		return json_is_integer(v);
	case JF_NUMBER:
		return json_is_number(v);
	case JF_BOOL:
		return json_is_boolean(v);
	case JF_OBJECT:
		return json_is_object(v);
	case JF_ARRAY:
		return json_is_array(v);
	case JF_ANY:
		return true;
	}
	return false;
}

enum kiln_err json_check_object(const json_t *obj, const struct json_field *fields, size_t nfields,
				const char *where, struct kiln_error *err)
{
	const char *key;
	json_t *val;

	if (!json_is_object(obj))
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "%s must be a JSON object", where);
	json_object_foreach((json_t *)obj, key, val) {
		const struct json_field *f = NULL;

		for (size_t i = 0; i < nfields; i++)
			if (strcmp(fields[i].name, key) == 0)
				f = &fields[i];
		if (!f)
			return kiln_error_set(err, KILN_E_BAD_REQUEST, "unknown field \"%.64s\" in %s",
					      key, where);
		if (json_is_null(val) && !f->required)
			continue;
		if (!jf_matches(val, f->type))
			return kiln_error_set(err, KILN_E_BAD_REQUEST, "field \"%s\" must be %s",
					      f->name, jf_names[f->type]);
		if (f->max_len && f->type == JF_STRING && json_string_length(val) > f->max_len)
			return kiln_error_set(err, KILN_E_TOO_LARGE,
					      "field \"%s\" is longer than %zu bytes", f->name,
					      f->max_len);
		if (f->max_len && f->type == JF_ARRAY && json_array_size(val) > f->max_len)
			return kiln_error_set(err, KILN_E_TOO_LARGE,
					      "field \"%s\" has more than %zu items", f->name,
					      f->max_len);
	}
	for (size_t i = 0; i < nfields; i++)
		if (fields[i].required && !json_object_get(obj, fields[i].name))
			return kiln_error_set(err, KILN_E_BAD_REQUEST, "field \"%s\" is required",
					      fields[i].name);
	return KILN_OK;
}

enum kiln_err json_parse_body(const char *text, size_t len, const struct json_field *fields,
			      size_t nfields, json_t **out, struct kiln_error *err)
{
	json_error_t jerr;
	json_t *obj;
	enum kiln_err rc;

	*out = NULL;
	if (len == 0)
		obj = json_object();
	else
		obj = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!obj)
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "malformed JSON at line %d column %d: %s",
				      jerr.line, jerr.column, jerr.text);
	rc = json_check_object(obj, fields, nfields, "the request body", err);
	if (rc != KILN_OK) {
		json_decref(obj);
		return rc;
	}
	*out = obj;
	return KILN_OK;
}

const char *json_str(const json_t *obj, const char *name, const char *def)
{
	const json_t *v = json_object_get(obj, name);

	return json_is_string(v) ? json_string_value(v) : def;
}

long long json_int(const json_t *obj, const char *name, long long def)
{
	const json_t *v = json_object_get(obj, name);

	return json_is_integer(v) ? (long long)json_integer_value(v) : def;
}
