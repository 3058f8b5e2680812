/*
 * apireq.c - kiln-gateway's request bodies, parsed and checked (see apireq.h).
 */
#include "api/apireq.h"

#include <ctype.h>
#include <math.h>
#include <openssl/crypto.h>
#include <stdlib.h>
#include <string.h>

#include "auth/scopes.h"
#include "common/json.h"
#include "common/s3.h"

#define NFIELDS(f) (sizeof(f) / sizeof((f)[0]))

enum kiln_err apireq_name(const char *field, const char *name, struct kiln_error *err)
{
	size_t n = strlen(name);

	if (n == 0 || n > APIREQ_NAME_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "%s must be 1 to %d bytes", field,
				      APIREQ_NAME_MAX);
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
			return kiln_error_set(err, KILN_E_INVALID, "%s has a control character",
					      field);
	return KILN_OK;
}

bool apireq_rfc3339(const char *s)
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

enum kiln_err apireq_create(const char *text, size_t len, struct apireq_create *out,
			    struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "template", JF_STRING, false, 64 },	{ "vcpus", JF_NUMBER, false, 0 },
		{ "memory_mib", JF_INT, false, 0 },	{ "disk_gib", JF_INT, false, 0 },
		{ "timeout_s", JF_INT, false, 0 },	{ "env", JF_OBJECT, false, 0 },
		{ "metadata", JF_OBJECT, false, 0 },	{ "egress", JF_OBJECT, false, 0 },
		{ "bandwidth", JF_OBJECT, false, 0 },	{ "snapshot_id", JF_STRING, false, 64 },
		{ "secrets", JF_ARRAY, false, 0 },	{ "auto_resume", JF_BOOL, false, 0 },
	};
	json_t *body, *v;
	double vcpus;
	long long mem, disk, tmo, milli;
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	rc = json_parse_body(text, len, fields, NFIELDS(fields), &out->body, err);
	if (rc != KILN_OK)
		return rc;
	body = out->body;
	out->template = json_str(body, "template", "base");
	if (strcmp(out->template, "base") == 0 || strcmp(out->template, "python") == 0)
		out->template = NULL;
	else if (strcmp(out->template, APIREQ_CODEINT) == 0 && json_str(body, "snapshot_id", NULL))
		return kiln_error_set(err, KILN_E_INVALID,
				      "template and snapshot_id exclude each other");
	else if (strcmp(out->template, APIREQ_CODEINT) == 0)
		out->builtin = APIREQ_CODEINT, out->template = NULL;
	else if (apireq_template_name("template", out->template, err) != KILN_OK)
		return KILN_E_INVALID;
	else if (out->template && json_str(body, "snapshot_id", NULL))
		return kiln_error_set(err, KILN_E_INVALID,
				      "template and snapshot_id exclude each other");
	v = json_object_get(body, "vcpus");
	vcpus = json_is_number(v) ? json_number_value(v) : 1.0;
	mem = json_int(body, "memory_mib", 512);
	disk = json_int(body, "disk_gib", 10);
	tmo = json_int(body, "timeout_s", 300);
	if (!(vcpus >= 0.25 && vcpus <= 8) || (milli = llround(vcpus * 1000)) % 250 != 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "vcpus must be a multiple of 0.25 from 0.25 to 8");
	if (mem < 256 || mem > 16384)
		return kiln_error_set(err, KILN_E_INVALID, "memory_mib must be from 256 to 16384");
	if (disk < 10 || disk > 60)
		return kiln_error_set(err, KILN_E_INVALID, "disk_gib must be from 10 to 60");
	if (tmo < 1 || tmo > 86400)
		return kiln_error_set(err, KILN_E_INVALID, "timeout_s must be from 1 to 86400");
	out->metadata = json_is_object(json_object_get(body, "metadata"))
				? json_dumps(json_object_get(body, "metadata"), JSON_COMPACT)
				: strdup("{}");
	if (!out->metadata)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (strlen(out->metadata) > APIREQ_METADATA_MAX)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "metadata is larger than %d bytes",
				      APIREQ_METADATA_MAX);
	out->vcpu_milli = (unsigned)milli;
	out->mem_mib = (unsigned)mem;
	out->disk_gib = (unsigned)disk;
	out->timeout_s = tmo;
	out->snapshot_id = json_str(body, "snapshot_id", NULL);
	return KILN_OK;
}

void apireq_create_free(struct apireq_create *c)
{
	free(c->metadata);
	json_decref(c->body);
	memset(c, 0, sizeof(*c));
}

enum kiln_err apireq_user(const char *name, struct kiln_error *err)
{
	size_t n = name ? strlen(name) : 0;
	bool ok = n >= 1 && n <= APIREQ_USER_MAX &&
		  ((name[0] >= 'a' && name[0] <= 'z') || (name[0] >= 'A' && name[0] <= 'Z') ||
		   name[0] == '_');

	if (!name)
		return KILN_OK;
	for (size_t i = 1; ok && i < n; i++)
		ok = (name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
		     (name[i] >= '0' && name[i] <= '9') || name[i] == '_' || name[i] == '.' ||
		     name[i] == '-';
	if (!ok)
		return kiln_error_set(err, KILN_E_INVALID,
				      "user must be a user name: 1 to %d of A-Z a-z 0-9 _ . -, the first "
				      "a letter or _", APIREQ_USER_MAX);
	return KILN_OK;
}

enum kiln_err apireq_exec_user(const char *text, size_t len, struct kiln_error *err)
{
	json_t *body = text ? json_loadb(text, len, JSON_REJECT_DUPLICATES, NULL) : NULL;
	json_t *v = json_object_get(body, "user");
	enum kiln_err rc = KILN_OK;

	if (v && !json_is_null(v)) {
		if (!json_is_string(v))
			rc = kiln_error_set(err, KILN_E_BAD_REQUEST, "field \"user\" must be a string");
		else if (strlen(json_string_value(v)) != json_string_length(v))
			rc = kiln_error_set(err, KILN_E_INVALID, "user must not hold NUL");
		else
			rc = apireq_user(json_string_value(v), err);
	}
	json_decref(body);
	return rc;
}

enum kiln_err apireq_fork(const char *text, size_t len, unsigned *count, struct kiln_error *err)
{
	static const struct json_field fields[] = { { "count", JF_INT, false, 0 } };
	json_t *body = NULL;
	enum kiln_err rc = json_parse_body(text, len, fields, 1, &body, err);
	long long n;

	*count = 0;
	if (rc != KILN_OK)
		return rc;
	n = json_int(body, "count", 1);
	json_decref(body);
	if (n < 1 || n > APIREQ_FORK_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "count must be from 1 to %d",
				      APIREQ_FORK_MAX);
	*count = (unsigned)n;
	return KILN_OK;
}

enum kiln_err apireq_key(const char *text, size_t len, struct apireq_key *out,
			 struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "name", JF_STRING, true, 0 },
		{ "scopes", JF_ARRAY, true, 16 },
		{ "expires_at", JF_STRING, false, 64 },
	};
	char *scopes_text;
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	rc = json_parse_body(text, len, fields, NFIELDS(fields), &out->body, err);
	if (rc != KILN_OK)
		return rc;
	out->name = json_str(out->body, "name", "");
	out->expires_at = json_str(out->body, "expires_at", NULL);
	rc = apireq_name("name", out->name, err);
	if (rc != KILN_OK)
		return rc;
	scopes_text = json_dumps(json_object_get(out->body, "scopes"), JSON_COMPACT);
	if (!scopes_text)
		return kiln_error_set(err, KILN_E_NOMEM, "scopes: out of memory");
	rc = auth_scopes_parse_json(scopes_text, strlen(scopes_text), &out->scopes, err);
	free(scopes_text);
	if (rc != KILN_OK) {
		struct kiln_error inner = *err;

		kiln_error_clear(err);	/* kiln_error_set keeps a first error */
		return kiln_error_set(err, inner.code, "scopes: %s", inner.msg);
	}
	if (!out->scopes)
		return kiln_error_set(err, KILN_E_INVALID, "scopes must name at least one scope");
	return KILN_OK;
}

enum kiln_err apireq_token(const char *text, size_t len, long long *ttl_s, uint32_t *scopes,
			   bool *has_scopes, struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "scopes", JF_ARRAY, false, 16 },
		{ "ttl_s", JF_INT, false, 0 },
	};
	json_t *body = NULL, *arr;
	char *scopes_text = NULL;
	enum kiln_err rc = json_parse_body(text, len, fields, NFIELDS(fields), &body, err);

	*has_scopes = false;
	if (rc != KILN_OK)
		return rc;
	*ttl_s = json_int(body, "ttl_s", APIREQ_TOKEN_TTL_MAX);
	if (*ttl_s < 1 || *ttl_s > APIREQ_TOKEN_TTL_MAX) {
		rc = kiln_error_set(err, KILN_E_INVALID, "ttl_s must be from 1 to %d",
				    APIREQ_TOKEN_TTL_MAX);
		goto out;
	}
	arr = json_object_get(body, "scopes");
	if (arr && !json_is_null(arr)) {
		scopes_text = json_dumps(arr, JSON_COMPACT);
		if (!scopes_text) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			goto out;
		}
		/* The message names the field already ("scopes: must be an array of strings",
		 * "unknown scope 'x'"). */
		rc = auth_scopes_parse_json(scopes_text, strlen(scopes_text), scopes, err);
		*has_scopes = rc == KILN_OK;
	}
out:
	free(scopes_text);
	json_decref(body);
	return rc;
}

enum kiln_err apireq_tenant(const char *text, size_t len, json_t **body, const char **name,
			    struct kiln_error *err)
{
	static const struct json_field fields[] = { { "name", JF_STRING, true, 0 } };
	enum kiln_err rc = json_parse_body(text, len, fields, 1, body, err);

	*name = NULL;
	if (rc != KILN_OK)
		return rc;
	*name = json_str(*body, "name", "");
	return apireq_name("name", *name, err);
}

enum kiln_err apireq_grant(const char *text, size_t len, struct apireq_grant *out,
			   struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "tenant_id", JF_STRING, true, 64 },
		{ "amount_ucr", JF_INT, true, 0 },
		{ "expires_at", JF_STRING, false, 64 },
		{ "reason", JF_STRING, true, 0 },
	};
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	rc = json_parse_body(text, len, fields, NFIELDS(fields), &out->body, err);
	if (rc != KILN_OK)
		return rc;
	out->tenant_id = json_str(out->body, "tenant_id", "");
	out->expires_at = json_str(out->body, "expires_at", NULL);
	out->reason = json_str(out->body, "reason", "");
	out->amount_ucr = json_int(out->body, "amount_ucr", 0);
	if (out->amount_ucr < 1)
		return kiln_error_set(err, KILN_E_INVALID, "amount_ucr must be at least 1");
	if (strlen(out->reason) < 1 || strlen(out->reason) > APIREQ_GRANT_REASON_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "reason must be 1 to %d bytes",
				      APIREQ_GRANT_REASON_MAX);
	rc = apireq_name("reason", out->reason, err);
	if (rc != KILN_OK)
		return rc;
	if (out->expires_at && !apireq_rfc3339(out->expires_at))
		return kiln_error_set(err, KILN_E_INVALID, "expires_at must be an RFC 3339 time");
	return KILN_OK;
}

/* Copies `src` into `dst` (`n` bytes) or refuses it as too long. */
static enum kiln_err set_field(const char *field, char *dst, size_t n, const char *src,
			       struct kiln_error *err)
{
	if (strlen(src) >= n)
		return kiln_error_set(err, KILN_E_INVALID, "%s must be at most %zu bytes", field,
				      n - 1);
	memcpy(dst, src, strlen(src) + 1);
	return KILN_OK;
}

enum kiln_err apireq_storage(const char *text, size_t len, json_t **body, struct s3_target *t,
			     struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "kind", JF_STRING, true, 16 },
		{ "endpoint", JF_STRING, true, S3_ENDPOINT_MAX },
		{ "bucket", JF_STRING, true, S3_BUCKET_MAX },
		{ "region", JF_STRING, true, S3_REGION_MAX },
		{ "prefix", JF_STRING, false, S3_PREFIX_MAX },
		{ "access_key_id", JF_STRING, true, S3_KEY_ID_MAX },
		{ "secret_access_key", JF_STRING, true, S3_SECRET_MAX },
	};
	enum kiln_err rc;
	json_t *b;

	memset(t, 0, sizeof(*t));
	rc = json_parse_body(text, len, fields, NFIELDS(fields), body, err);
	if (rc != KILN_OK)
		return rc;
	b = *body;
	if (strcmp(json_str(b, "kind", ""), "s3") != 0)
		return kiln_error_set(err, KILN_E_INVALID, "kind must be \"s3\"");
	if ((rc = set_field("endpoint", t->endpoint, sizeof(t->endpoint),
			    json_str(b, "endpoint", ""), err)) != KILN_OK ||
	    (rc = set_field("bucket", t->bucket, sizeof(t->bucket), json_str(b, "bucket", ""),
			    err)) != KILN_OK ||
	    (rc = set_field("region", t->region, sizeof(t->region), json_str(b, "region", ""),
			    err)) != KILN_OK ||
	    (rc = set_field("prefix", t->prefix, sizeof(t->prefix), json_str(b, "prefix", ""),
			    err)) != KILN_OK ||
	    (rc = set_field("access_key_id", t->access_key_id, sizeof(t->access_key_id),
			    json_str(b, "access_key_id", ""), err)) != KILN_OK ||
	    (rc = set_field("secret_access_key", t->secret_access_key,
			    sizeof(t->secret_access_key), json_str(b, "secret_access_key", ""),
			    err)) != KILN_OK)
		return rc;
	if (s3_target_check(t, err) != KILN_OK)
		return err->code = KILN_E_INVALID;
	return KILN_OK;
}

void apireq_storage_free(json_t *body)
{
	/* Wipe the body's copy of the secret before jansson frees it. */
	const char *secret = json_str(body, "secret_access_key", NULL);

	if (secret)
		OPENSSL_cleanse((char *)secret, strlen(secret));
	json_decref(body);
}

enum kiln_err apireq_template_name(const char *field, const char *name, struct kiln_error *err)
{
	size_t i, n = strlen(name);

	if (n == 0 || n > APIREQ_TEMPLATE_NAME_MAX || !isalnum((unsigned char)name[0]) ||
	    isupper((unsigned char)name[0]))
		goto bad;
	for (i = 0; i < n; i++)
		if (!(islower((unsigned char)name[i]) || isdigit((unsigned char)name[i]) ||
		      name[i] == '.' || name[i] == '_' || name[i] == '-'))
			goto bad;
	if (strncmp(name, "tmpl_", 5) == 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "%s may not start with \"tmpl_\" (templates' ids do)", field);
	if (strcmp(name, "base") == 0 || strcmp(name, "python") == 0 ||
	    strcmp(name, APIREQ_CODEINT) == 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "%s: \"%s\" is a built-in image's name; choose another", field,
				      name);
	return KILN_OK;
bad:
	return kiln_error_set(err, KILN_E_INVALID,
			      "%s must be 1 to %d characters of a-z, 0-9, '.', '_' and '-', "
			      "starting with a letter or a digit",
			      field, APIREQ_TEMPLATE_NAME_MAX);
}

enum kiln_err apireq_template(const char *text, size_t len, struct apireq_template *out,
			      struct kiln_error *err)
{
	static const struct json_field fields[] = {
		{ "name", JF_STRING, true, 0 },
		{ "vcpus", JF_NUMBER, true, 0 },
		{ "memory_mib", JF_INT, true, 0 },
		{ "disk_gib", JF_INT, true, 0 },
		{ "start_cmd", JF_STRING, false, APIREQ_TEMPLATE_CMD_MAX },
		{ "ready_cmd", JF_STRING, false, APIREQ_TEMPLATE_CMD_MAX },
		{ "egress", JF_OBJECT, false, 0 },
	};
	const char *cmds[] = { "start_cmd", "ready_cmd" };
	json_t *body, *eg;
	double vcpus;
	long long mem, disk, milli;
	enum kiln_err rc;
	size_t i;

	memset(out, 0, sizeof(*out));
	rc = json_parse_body(text, len, fields, NFIELDS(fields), &out->body, err);
	if (rc != KILN_OK)
		return rc;
	body = out->body;
	out->name = json_str(body, "name", "");
	rc = apireq_template_name("name", out->name, err);
	if (rc != KILN_OK)
		return rc;
	vcpus = json_number_value(json_object_get(body, "vcpus"));
	mem = json_int(body, "memory_mib", 0);
	disk = json_int(body, "disk_gib", 0);
	if (!(vcpus >= 0.25 && vcpus <= 8) || (milli = llround(vcpus * 1000)) % 250 != 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "vcpus must be a multiple of 0.25 from 0.25 to 8");
	if (mem < 256 || mem > 16384)
		return kiln_error_set(err, KILN_E_INVALID, "memory_mib must be from 256 to 16384");
	if (disk < 10 || disk > 60)
		return kiln_error_set(err, KILN_E_INVALID, "disk_gib must be from 10 to 60");
	for (i = 0; i < 2; i++) {
		json_t *v = json_object_get(body, cmds[i]);

		if (!v || json_is_null(v))
			continue;
		if (json_string_length(v) == 0 || strlen(json_string_value(v)) != json_string_length(v))
			return kiln_error_set(err, KILN_E_INVALID,
					      "%s must be a non-empty command line without NUL",
					      cmds[i]);
	}
	out->start_cmd = json_str(body, "start_cmd", NULL);
	out->ready_cmd = json_str(body, "ready_cmd", NULL);
	eg = json_object_get(body, "egress");
	if (json_is_object(eg)) {
		out->egress = json_dumps(eg, JSON_COMPACT);
		if (!out->egress)
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		if (strlen(out->egress) > APIREQ_TEMPLATE_EGRESS_MAX)
			return kiln_error_set(err, KILN_E_TOO_LARGE,
					      "egress is larger than %d bytes",
					      APIREQ_TEMPLATE_EGRESS_MAX);
	}
	out->vcpu_milli = (unsigned)milli;
	out->mem_mib = (unsigned)mem;
	out->disk_gib = (unsigned)disk;
	return KILN_OK;
}

void apireq_template_free(struct apireq_template *t)
{
	free(t->egress);
	json_decref(t->body);
	memset(t, 0, sizeof(*t));
}
