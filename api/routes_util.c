/*
 * routes_util.c - small helpers the route groups share (see gateway.h).
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "api/gateway.h"
#include "auth/apikey.h"

json_t *gw_body(struct http_req *req, const struct json_field *fields, size_t n)
{
	struct kiln_error err = { 0 };
	size_t len;
	const char *body = http_req_body(req, &len);
	json_t *obj = NULL;

	if (json_parse_body(body, len, fields, n, &obj, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return NULL;
	}
	return obj;
}

struct pg_conn *gw_db(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	struct pg_conn *c;

	if (pg_acquire(gw->pg, &c, &err) != KILN_OK) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
		return NULL;
	}
	return c;
}

void gw_fail(struct http_req *req, enum kiln_err rc, const struct kiln_error *err)
{
	if (rc == KILN_E_UNAVAILABLE)
		http_reply_error(req, rc, "the database is unavailable");
	else
		http_reply_error(req, rc, "%s", err && err->msg[0] ? err->msg : kiln_strerror(rc));
}

int gw_limit(struct http_req *req, int def, int max)
{
	const char *s = http_req_query(req, "limit");
	char *end;
	long v;

	if (!s)
		return def;
	v = strtol(s, &end, 10);
	if (!*s || *end || v < 1 || v > max) {
		http_reply_error(req, KILN_E_INVALID, "limit must be a whole number from 1 to %d", max);
		return -1;
	}
	return (int)v;
}

bool gw_new_id(struct http_req *req, const char *prefix, char *out, size_t n)
{
	if (auth_new_id(prefix, out, n) != KILN_OK) {
		http_reply_error(req, KILN_E_INTERNAL, "cannot make an id");
		return false;
	}
	return true;
}

bool gw_is_rfc3339(const char *s)
{
	/* YYYY-MM-DDTHH:MM:SS, optional .fraction, then Z or ±HH:MM. */
	static const char shape[] = "dddd-dd-ddTdd:dd:dd";
	size_t i;

	for (i = 0; shape[i]; i++) {
		if (!s[i])
			return false;
		if (shape[i] == 'd' ? !isdigit((unsigned char)s[i]) : s[i] != shape[i])
			return false;
	}
	s += i;
	if (*s == '.') {
		s++;
		if (!isdigit((unsigned char)*s))
			return false;
		while (isdigit((unsigned char)*s))
			s++;
	}
	if (*s == 'Z')
		return s[1] == '\0';
	return (s[0] == '+' || s[0] == '-') && isdigit((unsigned char)s[1]) &&
	       isdigit((unsigned char)s[2]) && s[3] == ':' && isdigit((unsigned char)s[4]) &&
	       isdigit((unsigned char)s[5]) && s[6] == '\0';
}

json_t *gw_time(const char *pg_text)
{
	return pg_text ? json_string(pg_text) : json_null();
}

bool gw_seq_cursor(struct http_req *req, const char **out)
{
	const char *c = http_req_query(req, "cursor");

	*out = NULL;
	if (!c)
		return true;
	if (!*c || strlen(c) > 19 || strspn(c, "0123456789") != strlen(c)) {
		http_reply_error(req, KILN_E_INVALID, "cursor is not one this server gave");
		return false;
	}
	*out = c;
	return true;
}

bool gw_time_cursor(struct http_req *req, const char *id_prefix, bool *given, char t[32],
		    char id[64])
{
	const char *c = http_req_query(req, "cursor"), *dot;

	*given = false;
	if (!c)
		return true;
	dot = strchr(c, '.');
	if (!dot || dot == c || dot - c >= 32 || strspn(c, "0123456789") != (size_t)(dot - c) ||
	    strlen(dot + 1) >= 64 || strncmp(dot + 1, id_prefix, strlen(id_prefix)) != 0) {
		http_reply_error(req, KILN_E_INVALID, "cursor is not one this server gave");
		return false;
	}
	snprintf(t, 32, "%.*s", (int)(dot - c), c);
	snprintf(id, 64, "%s", dot + 1);
	*given = true;
	return true;
}

void gw_reply_page(struct http_req *req, struct pg_res *res, int limit, const char *name)
{
	json_t *arr = json_array();
	int rows = pg_res_rows(res);

	for (int i = 0; i < rows && i < limit; i++)
		json_array_append_new(arr, json_loads(pg_res_str(res, i, 0), 0, NULL));
	http_reply_json(req, 200,
			json_pack("{s:o, s:o}", name, arr, "next_cursor",
				  rows > limit ? json_string(pg_res_str(res, limit - 1, 1))
					       : json_null()));
	pg_res_free(res);
}
