/*
 * routes_util.c - small helpers the route groups share (see gateway.h).
 */
#include <ctype.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/apireq.h"
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
	return apireq_rfc3339(s);
}

json_t *gw_time(const char *pg_text)
{
	return pg_text ? json_string(pg_text) : json_null();
}

/* The `?cursor=` of a listing paged by a sequence number (at most 19 digits). */
static bool seq_cursor(const char *c, struct gw_page *p)
{
	if (!*c || strlen(c) > 19 || strspn(c, "0123456789") != strlen(c))
		return false;
	p->seq = c;
	return true;
}

/* The `?cursor=` of a listing paged by (created_at, id): "<µs since the epoch>.<id_prefix...>". */
static bool time_cursor(const char *c, const char *id_prefix, struct gw_page *p)
{
	const char *dot = strchr(c, '.');

	if (!dot || dot == c || dot - c >= (ptrdiff_t)sizeof(p->t_buf) ||
	    strspn(c, "0123456789") != (size_t)(dot - c) || strlen(dot + 1) >= sizeof(p->id_buf) ||
	    strncmp(dot + 1, id_prefix, strlen(id_prefix)) != 0)
		return false;
	snprintf(p->t_buf, sizeof(p->t_buf), "%.*s", (int)(dot - c), c);
	snprintf(p->id_buf, sizeof(p->id_buf), "%s", dot + 1);
	p->t = p->t_buf;
	p->id = p->id_buf;
	return true;
}

bool gw_page_parse(struct http_req *req, int def, int max, const char *id_prefix,
		   struct gw_page *p)
{
	const char *c;

	memset(p, 0, sizeof(*p));
	p->limit = gw_limit(req, def, max);
	if (p->limit < 0)
		return false;
	snprintf(p->lim, sizeof(p->lim), "%d", p->limit + 1);
	c = http_req_query(req, "cursor");
	if (c && !(id_prefix ? time_cursor(c, id_prefix, p) : seq_cursor(c, p))) {
		http_reply_error(req, KILN_E_INVALID, "cursor is not one this server gave");
		return false;
	}
	return true;
}

int gw_page_rows(const struct gw_page *p, struct pg_res *res)
{
	int rows = pg_res_rows(res);

	return rows < p->limit ? rows : p->limit;
}

void gw_page_reply(struct http_req *req, const struct gw_page *p, struct pg_res *res,
		   int cursor_col, const char *name, json_t *items)
{
	json_t *next = pg_res_rows(res) > p->limit
			       ? json_string(pg_res_str(res, p->limit - 1, cursor_col))
			       : json_null();

	http_reply_json(req, 200, json_pack("{s:o, s:o}", name, items, "next_cursor", next));
	pg_res_free(res);
}

void gw_reply_page(struct http_req *req, const struct gw_page *p, struct pg_res *res,
		   const char *name)
{
	json_t *arr = json_array();
	int rows = gw_page_rows(p, res);

	for (int i = 0; i < rows; i++)
		json_array_append_new(arr, json_loads(pg_res_str(res, i, 0), 0, NULL));
	gw_page_reply(req, p, res, 1, name, arr);
}
