/*
 * nodereq.c - kiln-node's request bodies, parsed and checked (see nodereq.h).
 */
#include "node/nodereq.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "netpolicy/policy.h"
#include "vmm/guest/agent_proto.h"

enum kiln_err nodereq_env(const json_t *obj, const char *field, char ***out,
			  struct kiln_error *err)
{
	size_t n = json_is_object(obj) ? json_object_size(obj) : 0, i = 0, bytes = 0;
	const char *k;
	json_t *v;
	char **arr, *p;

	*out = NULL;
	if (obj && !json_is_null(obj) && !json_is_object(obj))
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "field \"%s\" must be an object", field);
	if (n > NODEREQ_ENV_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "%s has more than %d variables", field,
				      NODEREQ_ENV_MAX);
	if (n) {
		json_object_foreach((json_t *)obj, k, v) {
			size_t kl = strlen(k);
			bool ok = kl > 0 && kl <= 256 && !(k[0] >= '0' && k[0] <= '9');
			for (size_t j = 0; ok && j < kl; j++)
				ok = (k[j] >= 'A' && k[j] <= 'Z') || (k[j] >= 'a' && k[j] <= 'z') ||
				     (k[j] >= '0' && k[j] <= '9') || k[j] == '_';
			if (!ok)
				return kiln_error_set(err, KILN_E_INVALID,
						      "%s: bad variable name \"%.64s\"", field, k);
			if (!json_is_string(v))
				return kiln_error_set(err, KILN_E_BAD_REQUEST,
						      "%s: the value of \"%s\" must be a string", field,
						      k);
			if (json_string_length(v) > NODEREQ_ENV_VALUE_MAX ||
			    strlen(json_string_value(v)) != json_string_length(v))
				return kiln_error_set(err, KILN_E_INVALID,
						      "%s: the value of \"%s\" is too long or holds NUL",
						      field, k);
			bytes += kl + json_string_length(v) + 2;
		}
	}
	arr = malloc((n + 1) * sizeof(char *) + bytes);
	if (!arr)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	p = (char *)(arr + n + 1);
	if (n) {
		json_object_foreach((json_t *)obj, k, v) {
			arr[i++] = p;
			p += sprintf(p, "%s=%s", k, json_string_value(v)) + 1;
		}
	}
	arr[i] = NULL;
	*out = arr;
	return KILN_OK;
}

enum kiln_err nodereq_egress(const json_t *obj, const struct kiln_cidr *deny, size_t ndeny,
			     struct kiln_ruleset *rs, struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "rules", JF_ARRAY, true, NODEREQ_EGRESS_RULES_MAX },
	};
	const char *texts[NODEREQ_EGRESS_RULES_MAX];
	json_t *rules;
	size_t n;
	enum kiln_err rc;

	memset(rs, 0, sizeof(*rs));
	rc = json_check_object(obj, fields, 1, "egress", err);
	if (rc != KILN_OK)
		return rc;
	rules = json_object_get(obj, "rules");
	n = json_array_size(rules);
	for (size_t i = 0; i < n; i++) {
		json_t *r = json_array_get(rules, i);
		if (!json_is_string(r))
			return kiln_error_set(err, KILN_E_BAD_REQUEST, "egress rules must be strings");
		texts[i] = json_string_value(r);
	}
	if (kiln_rules_parse(texts, n, rs, err) != KILN_OK)
		return err->code = KILN_E_INVALID;
	/* a rule inside the operator's denied ranges is refused before anything boots */
	if (kiln_rules_check_deny(rs, deny, ndeny, err) != KILN_OK)
		return err->code = err->code == KILN_E_INVALID ? KILN_E_INVALID : KILN_E_INTERNAL;
	return KILN_OK;
}

enum kiln_err nodereq_bandwidth(const json_t *obj, struct kiln_bandwidth *bw,
				struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "quota_bytes", JF_INT, false, 0 },	  { "refill_bytes", JF_INT, false, 0 },
		{ "refill_interval_s", JF_INT, false, 0 }, { "one_time_burst_bytes", JF_INT, false, 0 },
		{ "unmetered", JF_BOOL, false, 0 },
	};
	const json_t *um;
	enum kiln_err rc;

	memset(bw, 0, sizeof(*bw));
	rc = json_check_object(obj, fields, sizeof(fields) / sizeof(fields[0]), "bandwidth", err);
	if (rc != KILN_OK)
		return rc;
	if (json_int(obj, "quota_bytes", 0) < 0 || json_int(obj, "refill_bytes", 0) < 0 ||
	    json_int(obj, "one_time_burst_bytes", 0) < 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "bandwidth: byte counts must not be negative");
	if (json_int(obj, "refill_interval_s", 1) < 1 || json_int(obj, "refill_interval_s", 1) > 86400)
		return kiln_error_set(err, KILN_E_INVALID, "refill_interval_s must be from 1 to 86400");
	bw->quota_bytes = (uint64_t)json_int(obj, "quota_bytes", 0);
	bw->refill_bytes = (uint64_t)json_int(obj, "refill_bytes", 0);
	bw->refill_interval_s = (uint32_t)json_int(obj, "refill_interval_s", 1);
	bw->one_time_burst_bytes = (uint64_t)json_int(obj, "one_time_burst_bytes", 0);
	um = json_object_get(obj, "unmetered");
	/* Settings without a quota mean no limit; a quota means metered unless said otherwise. */
	bw->unmetered = um && !json_is_null(um) ? json_is_true(um)
						: !json_object_get(obj, "quota_bytes");
	return KILN_OK;
}

/* The object member `name` of `body`, or NULL when absent or null. */
static const json_t *present(const json_t *body, const char *name)
{
	const json_t *v = json_object_get(body, name);

	return v && !json_is_null(v) ? v : NULL;
}

enum kiln_err nodereq_create(const char *text, size_t len, struct nodereq_create *out,
			     struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "template", JF_STRING, true, 64 },
		{ "vcpu_milli", JF_INT, true, 0 },
		{ "memory_mib", JF_INT, true, 0 },
		{ "disk_gib", JF_INT, true, 0 },
		{ "timeout_s", JF_INT, true, 0 },
		{ "env", JF_OBJECT, false, 0 },
		{ "metadata", JF_OBJECT, false, 0 },
		{ "egress", JF_OBJECT, false, 0 },
		{ "secrets", JF_ARRAY, false, 0 },
		{ "bandwidth", JF_OBJECT, false, 0 },
		{ "snapshot_id", JF_STRING, false, 64 },
	};
	long long v, m, d, t;
	enum kiln_err rc;
	json_t *body;

	memset(out, 0, sizeof(*out));
	rc = json_parse_body(text, len, fields, sizeof(fields) / sizeof(fields[0]), &out->body, err);
	if (rc != KILN_OK)
		return rc;
	body = out->body;
	/* The gateway checked these (api/apireq.c); a node takes no shape it would refuse. */
	v = json_int(body, "vcpu_milli", 0);
	m = json_int(body, "memory_mib", 0);
	d = json_int(body, "disk_gib", 0);
	t = json_int(body, "timeout_s", 300);
	if (v < 250 || v > 8000 || v % 250 != 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "vcpu_milli must be a multiple of 250 from 250 to 8000");
	if (m < 256 || m > 16384)
		return kiln_error_set(err, KILN_E_INVALID, "memory_mib must be from 256 to 16384");
	if (d < 10 || d > 60)
		return kiln_error_set(err, KILN_E_INVALID, "disk_gib must be from 10 to 60");
	if (t < 1 || t > 86400)
		return kiln_error_set(err, KILN_E_INVALID, "timeout_s must be from 1 to 86400");
	rc = nodereq_env(json_object_get(body, "env"), "env", &out->env, err);
	if (rc != KILN_OK)
		return rc;
	out->vcpu_milli = (unsigned)v;
	out->mem_mib = (unsigned)m;
	out->disk_gib = (unsigned)d;
	out->timeout_s = t;
	out->template_name = json_str(body, "template", "python");
	out->from_snap = json_str(body, "snapshot_id", NULL);
	out->egress = present(body, "egress");
	out->secrets = present(body, "secrets");
	out->bandwidth = present(body, "bandwidth");
	out->metadata = json_is_object(json_object_get(body, "metadata"))
				? json_dumps(json_object_get(body, "metadata"), JSON_COMPACT)
				: strdup("{}");
	if (!out->metadata)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	return KILN_OK;
}

void nodereq_create_free(struct nodereq_create *c)
{
	free(c->env);
	free(c->metadata);
	json_decref(c->body);
	memset(c, 0, sizeof(*c));
}

void exec_req_free(struct exec_req *e)
{
	if (!e)
		return;
	if (e->argv)
		for (char **a = e->argv; *a; a++)
			free(*a);
	free(e->argv);
	free(e->env);
	free(e->cwd);
	free(e->code);
	free(e->stdin_data);
	free(e->user);
	free(e);
}

enum kiln_err nodereq_exec(const char *text, size_t len, struct exec_req **out,
			   struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "cmd", JF_ARRAY, false, 4096 },  { "code", JF_STRING, false, 1 << 20 },
		{ "language", JF_STRING, false, 16 }, { "stdin", JF_STRING, false, 1 << 20 },
		{ "env", JF_OBJECT, false, 0 },	   { "cwd", JF_STRING, false, 4096 },
		{ "timeout_s", JF_INT, false, 0 },  { "user", JF_STRING, false, 256 },
	};
	size_t n;
	const char *lang, *code, *user;
	json_t *body = NULL, *cmd, *v;
	struct exec_req *e = NULL;
	enum kiln_err rc;
	long long t;

	*out = NULL;
	rc = json_parse_body(text, len, fields, sizeof(fields) / sizeof(fields[0]), &body, err);
	if (rc != KILN_OK)
		return rc;
	e = calloc(1, sizeof(*e));
	if (!e)
		goto nomem;
	cmd = json_object_get(body, "cmd");
	code = json_str(body, "code", NULL);
	lang = json_str(body, "language", "python");
	if (!!cmd == !!code || (cmd && json_is_null(cmd))) {
		rc = kiln_error_set(err, KILN_E_INVALID, "give exactly one of cmd and code");
		goto bad;
	}
	if (cmd) {
		n = json_array_size(cmd);
		if (n == 0) {
			rc = kiln_error_set(err, KILN_E_INVALID, "cmd must not be empty");
			goto bad;
		}
		e->argv = calloc(n + 1, sizeof(char *));
		if (!e->argv)
			goto nomem;
		for (size_t i = 0; i < n; i++) {
			v = json_array_get(cmd, i);
			if (!json_is_string(v) || strlen(json_string_value(v)) != json_string_length(v)) {
				rc = kiln_error_set(err, KILN_E_BAD_REQUEST,
						    "cmd must be an array of strings");
				goto bad;
			}
			e->argv[i] = strdup(json_string_value(v));
			if (!e->argv[i])
				goto nomem;
		}
		if (!e->argv[0][0]) {
			rc = kiln_error_set(err, KILN_E_INVALID, "cmd[0] must not be empty");
			goto bad;
		}
	} else {
		const char *interp;
		if (!strcmp(lang, "python"))
			interp = "python3";
		else if (!strcmp(lang, "bash"))
			interp = "bash";
		else {
			rc = kiln_error_set(err, KILN_E_INVALID, "language must be python or bash");
			goto bad;
		}
		e->argv = calloc(4, sizeof(char *));
		if (!e->argv || !(e->argv[0] = strdup(interp)) || !(e->argv[1] = strdup("-c")) ||
		    !(e->argv[2] = strdup(code)))
			goto nomem;
	}
	rc = nodereq_env(json_object_get(body, "env"), "env", &e->env, err);
	if (rc != KILN_OK)
		goto bad;
	if (json_str(body, "cwd", NULL)) {
		if (json_str(body, "cwd", "")[0] != '/') {
			rc = kiln_error_set(err, KILN_E_INVALID, "cwd must be an absolute path");
			goto bad;
		}
		e->cwd = strdup(json_str(body, "cwd", ""));
		if (!e->cwd)
			goto nomem;
	}
	if (json_str(body, "stdin", NULL)) {
		v = json_object_get(body, "stdin");
		e->stdin_len = json_string_length(v);
		e->stdin_data = malloc(e->stdin_len + 1);
		if (!e->stdin_data)
			goto nomem;
		memcpy(e->stdin_data, json_string_value(v), e->stdin_len);
	}
	t = json_int(body, "timeout_s", NODEREQ_EXEC_TIMEOUT_DEFAULT_S);
	if (t < 1 || t > NODEREQ_EXEC_TIMEOUT_MAX_S) {
		rc = kiln_error_set(err, KILN_E_INVALID, "timeout_s must be from 1 to %d",
				    NODEREQ_EXEC_TIMEOUT_MAX_S);
		goto bad;
	}
	e->timeout_ms = (uint32_t)(t * 1000);
	v = json_object_get(body, "user");
	rc = nodereq_user(v && json_is_string(v) && strlen(json_string_value(v)) == json_string_length(v)
				  ? json_string_value(v) : v && !json_is_null(v) ? "" : NULL,
			  &user, err);
	if (rc != KILN_OK)
		goto bad;
	if (user && !(e->user = strdup(user)))
		goto nomem;
	json_decref(body);
	*out = e;
	return KILN_OK;
nomem:
	rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
bad:
	exec_req_free(e);
	json_decref(body);
	return rc;
}

enum kiln_err nodereq_proc(const char *text, size_t len, struct proc_req **out,
			   struct kiln_error *err)
{
	json_error_t jerr;
	json_t *body = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr), *pty, *v;
	struct proc_req *p = NULL;
	enum kiln_err rc;
	char *rest = NULL;
	bool timed;

	*out = NULL;
	if (!body || !json_is_object(body)) {
		json_decref(body);
		return kiln_error_set(err, KILN_E_BAD_REQUEST, "the body must be a JSON object");
	}
	if (!(p = calloc(1, sizeof(*p))))
		goto nomem;
	v = json_object_get(body, "tag");
	if (v && !json_is_null(v)) {
		if (!json_is_string(v) || json_string_length(v) > AGENT_MAX_TAG ||
		    strlen(json_string_value(v)) != json_string_length(v)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "tag must be a string of at most %d bytes",
					    AGENT_MAX_TAG);
			goto bad;
		}
		if (!(p->tag = strdup(json_string_value(v))))
			goto nomem;
	}
	pty = json_object_get(body, "pty");
	if (pty && !json_is_null(pty)) {
		json_int_t r = json_integer_value(json_object_get(pty, "rows"));
		json_int_t c = json_integer_value(json_object_get(pty, "cols"));

		if (!json_is_object(pty) || r < 1 || r > AGENT_MAX_PTY_DIM || c < 1 ||
		    c > AGENT_MAX_PTY_DIM) {
			rc = kiln_error_set(err, KILN_E_INVALID, "pty must be {\"rows\", \"cols\"}, each 1..%d",
					    AGENT_MAX_PTY_DIM);
			goto bad;
		}
		p->rows = (unsigned)r;
		p->cols = (unsigned)c;
	}
	if ((v = json_object_get(body, "argv"))) {
		if (json_object_get(body, "cmd")) {
			rc = kiln_error_set(err, KILN_E_INVALID, "give one of cmd and argv");
			goto bad;
		}
		json_incref(v);
		json_object_set_new(body, "cmd", v);
	}
	json_object_del(body, "argv");
	json_object_del(body, "tag");
	json_object_del(body, "pty");
	timed = json_object_get(body, "timeout_s") && !json_is_null(json_object_get(body, "timeout_s"));
	if (!(rest = json_dumps(body, JSON_COMPACT)))
		goto nomem;
	rc = nodereq_exec(rest, strlen(rest), &p->e, err);
	if (rc != KILN_OK)
		goto bad;
	if (!timed)
		p->e->timeout_ms = 0;
	free(rest);
	json_decref(body);
	*out = p;
	return KILN_OK;
nomem:
	rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
bad:
	free(rest);
	proc_req_free(p);
	json_decref(body);
	return rc;
}

void proc_req_free(struct proc_req *p)
{
	if (!p)
		return;
	exec_req_free(p->e);
	free(p->tag);
	free(p);
}

enum kiln_err nodereq_user(const char *name, const char **out, struct kiln_error *err)
{
	*out = NULL;
	if (!name || !strcmp(name, "root"))
		return KILN_OK;
	if (!agent_user_ok(name, strlen(name)))
		return kiln_error_set(err, KILN_E_INVALID,
				      "user must be a user name: 1 to %d of A-Z a-z 0-9 _ . -, the first a "
				      "letter or _", AGENT_MAX_USER);
	*out = name;
	return KILN_OK;
}

enum kiln_err nodereq_timeout(const char *text, size_t len, long long *timeout_s,
			      struct kiln_error *err)
{
	static const struct json_field fields[] = { { "timeout_s", JF_INT, true, 0 } };
	json_t *body = NULL;
	enum kiln_err rc = json_parse_body(text, len, fields, 1, &body, err);

	if (rc != KILN_OK)
		return rc;
	*timeout_s = json_int(body, "timeout_s", 0);
	json_decref(body);
	if (*timeout_s < 1 || *timeout_s > 86400)
		return kiln_error_set(err, KILN_E_INVALID, "timeout_s must be from 1 to 86400");
	return KILN_OK;
}

enum kiln_err nodereq_fork(const char *text, size_t len, json_t **body,
			   const char *ids[NODEREQ_FORK_MAX], size_t *count, struct kiln_error *err)
{
	static const struct json_field fields[] = { { "ids", JF_ARRAY, true, NODEREQ_FORK_MAX } };
	enum kiln_err rc = json_parse_body(text, len, fields, 1, body, err);
	json_t *arr;

	*count = 0;
	if (rc != KILN_OK)
		return rc;
	arr = json_object_get(*body, "ids");
	for (size_t i = 0; i < json_array_size(arr); i++) {
		if (!json_is_string(json_array_get(arr, i)) ||
		    strncmp(json_string_value(json_array_get(arr, i)), "sb_", 3) != 0)
			return kiln_error_set(err, KILN_E_BAD_REQUEST, "ids must be sandbox ids");
		ids[i] = json_string_value(json_array_get(arr, i));
	}
	if (json_array_size(arr) < 1)
		return kiln_error_set(err, KILN_E_INVALID, "count must be from 1 to 16");
	*count = json_array_size(arr);
	return KILN_OK;
}

enum kiln_err nodereq_snapshot(const char *text, size_t len, char **name, struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "name", JF_STRING, false, NODEREQ_SNAPSHOT_NAME_MAX },
	};
	json_t *body = NULL;
	enum kiln_err rc = json_parse_body(text, len, fields, 1, &body, err);

	*name = NULL;
	if (rc != KILN_OK)
		return rc;
	if (json_str(body, "name", NULL)) {
		*name = strdup(json_str(body, "name", ""));
		if (!*name)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	json_decref(body);
	return rc;
}
