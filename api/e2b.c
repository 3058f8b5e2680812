/*
 * e2b.c - E2B's control-plane REST API (the paths, bodies, status codes and error shape the `e2b`
 * SDKs use; docs/e2b.md) on kiln-gateway's second listener, mapped onto Kiln's sandboxes.
 *
 * Each handler turns E2B's request into calls of the gateway's own API (docs/openapi.yaml) on the
 * loopback address, with the caller's X-API-Key as its bearer key, and E2B's answer from theirs.
 * So an E2B request is a Kiln request in every respect that matters to a tenant or an operator:
 * the same key checks and scopes, rate limits and in-flight bound, audit records, plan limits,
 * credits and metering, egress rules; there is no second implementation of any of them here. What
 * this file owns is only the shapes: E2B's JSON, `{"code": <status>, "message": ...}` errors, 404
 * for another tenant's sandbox (the API's own answer), and the refusal of what Kiln cannot map.
 */
#include "api/e2b.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "api/apireq.h"
#include "auth/bearer.h"
#include "auth/crypto.h"
#include "auth/scopes.h"
#include "common/buf.h"
#include "common/clock.h"
#include "common/httpc.h"
#include "common/log.h"
#include "common/pg.h"
#include "common/pump.h"

#define KEY_MAX 512			/* bytes of an X-API-Key we pass on */
#define ID_MAX 64			/* bytes of a sandbox or snapshot id */
#define ANSWER_MAX (8u << 20)		/* bytes of one answer of the API */
#define CALL_TIMEOUT_MS (900L * 1000)	/* a create may boot a VM: the API bounds it itself */
#define LIST_LEGACY_PAGES 100		/* pages of 100 the legacy list reads at most */
#define DEFAULT_TIMEOUT_S 300		/* E2B's default sandbox timeout */
#define DENY_ALL_RULE "deny-all.invalid"	/* an allow list that matches nothing (RFC 6761) */

static struct http_server *e2b_http;
static struct http_server *envd_http;	/* the sandbox data plane (e2b_sandbox_listen) */
static char dp_domain[300];		/* `domain` of a Sandbox: "{ports_domain}:{its port}", or "" */
static struct http_server *inner_http;	/* the gateway's API on inner_sock, for the handlers */
static char inner_dir[64];		/* a 0700 directory of the process's own */
static char inner_sock[96];		/* inner_dir/api.sock */
static unsigned char token_key[32];	/* derived from the master key: envdAccessTokens */

/* ---- replies in E2B's shape ---- */

/* Replies `{"code": status, "message": ...}` with `status`. */
static void e2b_error(struct http_req *req, int status, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void e2b_error(struct http_req *req, int status, const char *fmt, ...)
{
	char msg[KILN_ERRMSG_MAX];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	http_reply_json(req, status, json_pack("{s:i, s:s}", "code", status, "message", msg));
}

/* Whether `id` could be an id of ours: [A-Za-z0-9_-], 1..ID_MAX-1 bytes. */
static bool id_shaped(const char *id)
{
	size_t n = id ? strlen(id) : 0;

	if (n == 0 || n >= ID_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)id[i]) && id[i] != '_' && id[i] != '-')
			return false;
	return true;
}

/* The id is echoed only when it could be one: any byte would do in a path, UTF-8 or not. */
static void e2b_not_found(struct http_req *req, const char *id)
{
	if (!id_shaped(id)) {
		e2b_error(req, 404, "the sandbox doesn't exist or you don't have access to it");
		return;
	}
	e2b_error(req, 404, "sandbox \"%s\" doesn't exist or you don't have access to it", id);
}

/* ---- calls of the gateway's API ---- */

/* One answer of the API. */
struct answer {
	long status;
	struct buf body;
	char retry_after[16];
	json_t *json;		/* the body parsed (NULL when it is not JSON) */
};

static size_t on_header(char *p, size_t size, size_t n, void *arg)
{
	struct answer *a = arg;
	size_t len = size * n;

	if (len > 12 && strncasecmp(p, "Retry-After:", 12) == 0) {
		size_t i = 12, k = 0;

		while (i < len && p[i] == ' ')
			i++;
		while (i < len && isdigit((unsigned char)p[i]) && k + 1 < sizeof(a->retry_after))
			a->retry_after[k++] = p[i++];
		a->retry_after[k] = '\0';
	}
	return len;
}

static void answer_free(struct answer *a)
{
	json_decref(a->json);
	buf_release(&a->body);
}

/*
 * Calls the API on the inner socket: `method` `path` with the `len` bytes of `data` (NULL: no
 * body) of type `ctype`, with `auth` as its Authorization header, reading at most `max` bytes of
 * answer. KILN_OK with `a` filled once the API answered, whatever its status.
 */
static enum kiln_err inner_call(const char *auth, const char *method, const char *path,
				const char *ctype, const char *data, size_t len, size_t max,
				struct answer *a, struct kiln_error *err)
{
	char url[2048 + 16], type[160];
	struct curl_slist *h = NULL;
	struct httpc hc = { 0 };
	enum kiln_err rc;

	memset(a, 0, sizeof(*a));
	buf_init(&a->body, max);
	if (strlen(path) >= 2048)
		return kiln_error_set(err, KILN_E_INVALID, "the request is too long");
	snprintf(url, sizeof(url), "http://kiln%s", path);
	snprintf(type, sizeof(type), "Content-Type: %s", ctype ? ctype : "application/json");
	h = curl_slist_append(h, auth);
	if (h && data)
		h = curl_slist_append(h, type);
	if (!h)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = httpc_open(&hc,
			&(struct httpc_opts){ .url = url, .unix_socket = inner_sock,
					      .timeout_ms = CALL_TIMEOUT_MS,
					      .connect_timeout_ms = 5000, .body = &a->body,
					      .method = method, .post_data = data,
					      .post_len = data ? len : 0, .headers = h,
					      .on_header = on_header, .header_arg = a },
			err);
	if (rc == KILN_OK)
		curl_easy_setopt(hc.curl, CURLOPT_NOPROXY, "*");	/* our own socket, never a proxy */
	if (rc == KILN_OK && data && strcmp(method, "POST") != 0) {
		curl_easy_setopt(hc.curl, CURLOPT_POSTFIELDS, data);
		curl_easy_setopt(hc.curl, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
	}
	if (rc == KILN_OK)
		rc = httpc_perform(&hc, &a->status, err);
	if (rc == KILN_OK)
		a->json = a->body.len ? json_loadb(a->body.data, a->body.len, 0, NULL) : NULL;
	httpc_close(&hc);
	curl_slist_free_all(h);
	return rc;
}

/*
 * Calls the API: `method` `path` with the JSON `body` (NULL: none) as the caller (its X-API-Key).
 * True with `a` filled once the API answered, whatever its status; false after replying (401 for
 * no key, 503 when the API could not be reached).
 */
static bool api_call(struct http_req *req, const char *method, const char *path, json_t *body,
		     struct answer *a)
{
	const char *key = http_req_header(req, "X-API-Key");
	char auth[KEY_MAX + 32];
	struct kiln_error err = { 0 };
	char *text = NULL;
	bool ok = false;

	memset(a, 0, sizeof(*a));
	buf_init(&a->body, ANSWER_MAX);
	if (!key || !key[0]) {
		e2b_error(req, 401, "missing X-API-Key header: set E2B_API_KEY to a Kiln API key");
		return false;
	}
	for (const char *p = key; *p; p++)
		if (p - key >= KEY_MAX || *p <= ' ' || *p > '~') {
			e2b_error(req, 401, "the X-API-Key header is not a valid key");
			return false;
		}
	if (strlen(path) >= 2048) {
		e2b_error(req, 400, "the request is too long");
		return false;
	}
	snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key);
	if (body)
		text = json_dumps(body, JSON_COMPACT);
	if (body && !text) {
		e2b_error(req, 500, "out of memory");
		goto out;
	}
	if (inner_call(auth, method, path, NULL, text, text ? strlen(text) : 0, ANSWER_MAX, a,
		       &err) != KILN_OK) {
		log_warn("e2b: the API did not answer %s %s: %s", method, path, err.msg);
		e2b_error(req, 503, "the service is unavailable; try again");
		goto out;
	}
	ok = true;
out:
	explicit_bzero(auth, sizeof(auth));
	if (text) {
		explicit_bzero(text, strlen(text));	/* env values may be secrets */
		free(text);
	}
	return ok;
}

/*
 * Replies with the API's error answer in E2B's shape: its status (422, a value Kiln refuses,
 * becomes E2B's 400) and its message; a 429's Retry-After goes along.
 */
static void reply_api_error(struct http_req *req, const struct answer *a)
{
	const char *msg = json_string_value(json_object_get(json_object_get(a->json, "error"),
							    "message"));
	int status = a->status == 422 ? 400 : (int)a->status;

	if (status < 400 || status > 599)
		status = 500;
	if (a->retry_after[0])
		http_reply_header(req, "Retry-After", a->retry_after);
	e2b_error(req, status, "%s", msg ? msg : "the request failed");
}

/* 204 when the API's call of sandbox `id` succeeded, E2B's 404 when it found no such sandbox,
 * else its error in E2B's shape. */
static void reply_sandbox_done(struct http_req *req, const char *id, const struct answer *a)
{
	if (a->status >= 200 && a->status < 300)
		http_reply_empty(req, 204);
	else if (a->status == 404)
		e2b_not_found(req, id);
	else
		reply_api_error(req, a);
}

/* A path parameter that is an id of ours ([A-Za-z0-9_-], 1..ID_MAX-1 bytes), else NULL. */
static const char *param_id(struct http_req *req, const char *name)
{
	const char *id = http_req_param(req, name);

	return id_shaped(id) ? id : NULL;
}

/* ---- shapes ---- */

/*
 * The envdAccessToken of sandbox `id`: E2B_TOKEN_HEX hex characters of HMAC-SHA-256 of the id
 * under a key derived from the master key ("e2b-envd-token"): the same across pause and resume,
 * and any process with the master key (the data plane) can check it without a lookup.
 */
void e2b_token_of(const char *id, char out[E2B_TOKEN_HEX + 1])
{
	unsigned char mac[EVP_MAX_MD_SIZE];
	unsigned int len = 0;

	out[0] = '\0';
	if (!HMAC(EVP_sha256(), token_key, sizeof(token_key), (const unsigned char *)id, strlen(id),
		  mac, &len) || len < E2B_TOKEN_HEX / 2)
		return;
	for (int i = 0; i < E2B_TOKEN_HEX / 2; i++)
		snprintf(out + 2 * i, 3, "%02x", mac[i]);
}

/* E2B's state of a Kiln sandbox: "running", "paused", or NULL (stopped, failed: gone for E2B). */
static const char *state_of(const json_t *sb)
{
	const char *s = json_str(sb, "state", "");

	if (!strcmp(s, "creating") || !strcmp(s, "running"))
		return "running";
	if (!strcmp(s, "paused"))
		return "paused";
	return NULL;
}

/* E2B's metadata (string to string) from Kiln's (any JSON values: others as their JSON text). */
static json_t *metadata_of(const json_t *sb)
{
	json_t *out = json_object(), *m = json_object_get(sb, "metadata"), *v;
	const char *k;

	json_object_foreach(m, k, v) {
		if (json_is_string(v)) {
			json_object_set(out, k, v);
		} else {
			char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
			if (t)
				json_object_set_new(out, k, json_string(t));
			free(t);
		}
	}
	return out;
}

/* The `Sandbox` E2B answers a create or a connect with. */
static json_t *sandbox_of(const json_t *sb)
{
	const char *id = json_str(sb, "id", "");
	char token[E2B_TOKEN_HEX + 1];

	e2b_token_of(id, token);
	return json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:n, s:s?}", "sandboxID", id, "templateID",
			 json_str(sb, "template", "python"), "alias", json_str(sb, "template", "python"),
			 "clientID", "kiln", "envdVersion", E2B_ENVD_VERSION, "envdAccessToken", token,
			 "trafficAccessToken", "domain", dp_domain[0] ? dp_domain : NULL);
}

/* `ListedSandbox` (detail false) or `SandboxDetail` (true). */
static json_t *detail_of(const json_t *sb, bool detail)
{
	const char *created = json_str(sb, "created_at", "");
	const char *end = json_str(sb, "expires_at", NULL);
	double vcpus = json_number_value(json_object_get(sb, "vcpus"));
	json_t *o = json_pack("{s:s, s:s, s:s, s:s, s:o, s:s, s:s, s:s, s:I, s:I, s:I, s:s}",
			      "sandboxID", json_str(sb, "id", ""),
			      "templateID", json_str(sb, "template", "python"),
			      "alias", json_str(sb, "template", "python"),
			      "clientID", "kiln",
			      "metadata", metadata_of(sb),
			      "startedAt", created,
			      "endAt", end ? end : created,
			      "state", state_of(sb) ? state_of(sb) : "paused",
			      "cpuCount", (json_int_t)(vcpus < 1 ? 1 : ceil(vcpus)),
			      "memoryMB", (json_int_t)json_int(sb, "memory_mib", 0),
			      "diskSizeMB", (json_int_t)json_int(sb, "disk_gib", 0) * 1024,
			      "envdVersion", E2B_ENVD_VERSION);

	if (o && detail) {
		json_object_set_new(o, "allowInternetAccess", json_null());
		json_object_set_new(o, "domain", json_null());
		json_object_set_new(o, "volumeMounts", json_array());
		json_object_set_new(o, "lifecycle", json_pack("{s:s, s:b}", "onTimeout", "kill",
							      "autoResume", 0));
	}
	return o;
}

/* ---- network (egress) ---- */

/* Whether `v` is a JSON array of strings whose only members are 0.0.0.0/0 or ::/0. */
static bool denies_all(const json_t *v)
{
	size_t i;
	json_t *e;

	if (!json_is_array(v) || json_array_size(v) == 0)
		return false;
	json_array_foreach(v, i, e)
		if (!json_is_string(e) || (strcmp(json_string_value(e), "0.0.0.0/0") != 0 &&
					   strcmp(json_string_value(e), "::/0") != 0))
			return false;
	return true;
}

/* Whether `host` is one of the strings of `allow` (case aside). */
static bool allowed_exactly(const json_t *allow, const char *host)
{
	size_t i;
	json_t *e;

	json_array_foreach(allow, i, e)
		if (json_is_string(e) && strcasecmp(json_string_value(e), host) == 0)
			return true;
	return false;
}

/*
 * Kiln's secrets for E2B's `network.rules` ({host: [{transform: {headers: {name: value}}}]}):
 * *secrets is a new array of {host, header, value}, or NULL when `rules` is absent. Kiln binds a
 * secret to an exact host rule, so a host with headers must be an entry of `allow` (NULL unless
 * the network denies everything else); wildcards, IAM placeholders and anything but headers are
 * refused (400 replied, false). Kiln's API checks the rest (header names, values, addresses).
 */
static bool secrets_of(struct http_req *req, const json_t *rules, const json_t *allow,
		       json_t **secrets)
{
	const char *host, *name;
	json_t *list, *rule, *t, *h, *v;
	size_t i;

	if (!rules || json_is_null(rules))
		return true;
	if (!json_is_object(rules)) {
		e2b_error(req, 400, "network.rules must be an object of hosts to lists of rules");
		return false;
	}
	*secrets = json_array();
	json_object_foreach((json_t *)rules, host, list) {
		if (!json_is_array(list)) {
			e2b_error(req, 400, "network.rules[\"%s\"] must be a list of rules", host);
			goto bad;
		}
		json_array_foreach(list, i, rule) {
			t = json_object_get(rule, "transform");
			h = json_object_get(t, "headers");
			if (!json_is_object(rule) || json_object_size(rule) > (t ? 1u : 0u) ||
			    (t && !json_is_null(t) && (!json_is_object(t) ||
			    json_object_size(t) > (h ? 1u : 0u) || (h && !json_is_object(h))))) {
				e2b_error(req, 400, "network.rules[\"%s\"]: this server maps only "
						    "transform.headers (docs/e2b.md)", host);
				goto bad;
			}
			if (json_object_size(h) && strchr(host, '*')) {
				e2b_error(req, 400, "network.rules[\"%s\"]: headers bind to one exact host "
						    "on this server, not a wildcard", host);
				goto bad;
			}
			if (json_object_size(h) && !allowed_exactly(allow, host)) {
				e2b_error(req, 400, "network.rules[\"%s\"]: headers need the host in "
						    "allowOut, with denyOut 0.0.0.0/0 (docs/e2b.md)", host);
				goto bad;
			}
			json_object_foreach(h, name, v) {
				if (!json_is_string(v) || strstr(json_string_value(v), "${e2b.")) {
					e2b_error(req, 400, "network.rules[\"%s\"]: header \"%s\" must be a "
							    "plain string (no IAM placeholders)", host, name);
					goto bad;
				}
				json_array_append_new(*secrets, json_pack("{s:s, s:s, s:O}", "host", host,
									   "header", name, "value", v));
			}
		}
	}
	return true;
bad:
	json_decref(*secrets);
	*secrets = NULL;
	return false;
}

/*
 * Kiln's egress rules for E2B's `allow_internet_access` and `network` (either NULL): *rules is
 * a new array (empty: open) or NULL when neither names egress. Kiln's rules are an allow list, so
 * `denyOut` maps only as "everything" (0.0.0.0/0, ::/0) with `allowOut` the exceptions; what has
 * no Kiln equivalent is refused (400 replied, false).
 */
static bool egress_of(struct http_req *req, const json_t *internet, const json_t *net,
		      json_t **rules, json_t **secrets)
{
	const json_t *allow = json_object_get(net, "allowOut"), *deny = json_object_get(net, "denyOut");
	static const char *const unmapped[] = { "egressProxy", "maskRequestHost", "httpsPorts", NULL };
	bool closed;
	size_t i;
	json_t *e;

	*rules = NULL;
	*secrets = NULL;
	if (internet && !json_is_boolean(internet)) {
		e2b_error(req, 400, "allow_internet_access must be true or false");
		return false;
	}
	if (net && !json_is_object(net)) {
		e2b_error(req, 400, "network must be an object");
		return false;
	}
	for (int k = 0; unmapped[k]; k++)
		if (json_object_get(net, unmapped[k]) && !json_is_null(json_object_get(net, unmapped[k]))) {
			e2b_error(req, 400, "network.%s is not supported by this server (docs/e2b.md)",
				  unmapped[k]);
			return false;
		}
	if (json_is_false(json_object_get(net, "allowPublicTraffic"))) {
		e2b_error(req, 400, "network.allowPublicTraffic false is not supported by this server");
		return false;
	}
	if (deny && !json_is_null(deny) && json_array_size(deny) && !denies_all(deny)) {
		e2b_error(req, 400, "network.denyOut may only be 0.0.0.0/0 (everything): this server's "
				    "egress rules are an allow list, so name what to allow in allowOut");
		return false;
	}
	if (allow && !json_is_null(allow) && !json_is_array(allow)) {
		e2b_error(req, 400, "network.allowOut must be an array of strings");
		return false;
	}
	json_array_foreach(allow, i, e)
		if (!json_is_string(e)) {
			e2b_error(req, 400, "network.allowOut must be an array of strings");
			return false;
		}
	closed = json_is_false(internet) || denies_all(deny);
	if (!secrets_of(req, json_object_get(net, "rules"), closed ? allow : NULL, secrets))
		return false;
	if (!internet && !net)
		return true;
	*rules = json_array();
	if (closed) {
		json_array_foreach(allow, i, e)
			json_array_append(*rules, e);
		if (json_array_size(*rules) == 0)
			json_array_append_new(*rules, json_string(DENY_ALL_RULE));
	}
	return true;
}

/* ---- routes ---- */

/* The E2B body as a JSON object ({} when empty); replies 400 and returns NULL otherwise. */
static json_t *e2b_body(struct http_req *req)
{
	size_t len = 0;
	const char *text = http_req_body(req, &len);
	json_t *b;

	if (len == 0)
		return json_object();
	b = json_loadb(text, len, 0, NULL);
	if (!json_is_object(b)) {
		json_decref(b);
		e2b_error(req, 400, "the body must be a JSON object");
		return NULL;
	}
	return b;
}

/* Wipes the request's body: it may carry secrets' values (network.rules' headers, envVars). */
static void wipe_body(struct http_req *req)
{
	size_t len = 0;
	const char *text = http_req_body(req, &len);

	if (text && len)
		explicit_bzero((void *)text, len);
}

/* A `timeout` field: seconds, 1..86400; *out `def` when absent. Replies 400 when malformed. */
static bool timeout_field(struct http_req *req, const json_t *b, long long def, long long *out)
{
	const json_t *t = json_object_get(b, "timeout");

	*out = def;
	if (!t || json_is_null(t))
		return true;
	if (!json_is_integer(t) || json_integer_value(t) < 1 || json_integer_value(t) > 86400) {
		e2b_error(req, 400, "timeout must be a whole number of seconds from 1 to 86400");
		return false;
	}
	*out = json_integer_value(t);
	return true;
}

/* Whether a field that asks for something Kiln does not do is set; replies 400 naming it. */
static bool refuse_unmapped(struct http_req *req, const json_t *b)
{
	const json_t *v;

	if (json_is_true(json_object_get(b, "autoPause"))) {
		e2b_error(req, 400, "autoPause (lifecycle onTimeout \"pause\") is not supported by this "
				    "server yet: a sandbox is stopped when its timeout runs out");
		return true;
	}
	if (json_is_true(json_object_get(json_object_get(b, "autoResume"), "enabled"))) {
		e2b_error(req, 400, "autoResume is not supported by this server yet");
		return true;
	}
	v = json_object_get(b, "mcp");
	if (v && !json_is_null(v)) {
		e2b_error(req, 400, "mcp is not supported by this server");
		return true;
	}
	v = json_object_get(b, "iam");
	if (v && !json_is_null(v)) {
		e2b_error(req, 400, "iam (workload identity tokens) is not supported by this server");
		return true;
	}
	v = json_object_get(b, "volumeMounts");
	if (json_array_size(v) > 0) {
		e2b_error(req, 400, "volumeMounts are not supported by this server");
		return true;
	}
	return false;
}

/* POST /v2/sandboxes, POST /sandboxes */
static void e2b_create(struct http_req *req)
{
	json_t *b = e2b_body(req), *kb = NULL, *rules = NULL, *secrets = NULL, *v;
	const char *tmpl;
	long long timeout;
	struct answer a = { 0 };

	if (!b)
		return;
	tmpl = json_str(b, "templateID", "base");
	if (!json_is_string(json_object_get(b, "templateID")) && json_object_get(b, "templateID")) {
		e2b_error(req, 400, "templateID must be a string");
		goto out;
	}
	if (refuse_unmapped(req, b) || !timeout_field(req, b, DEFAULT_TIMEOUT_S, &timeout) ||
	    !egress_of(req, json_object_get(b, "allow_internet_access"), json_object_get(b, "network"),
		       &rules, &secrets))
		goto out;
	kb = json_pack("{s:I}", "timeout_s", (json_int_t)timeout);
	if (!strcmp(tmpl, "base") || !strcmp(tmpl, "python")) {
		json_object_set_new(kb, "template", json_string("python"));
	} else if (!strncmp(tmpl, "snap_", 5)) {
		json_object_set_new(kb, "snapshot_id", json_string(tmpl));
	} else if (!strcmp(tmpl, APIREQ_CODEINT)) {
		json_object_set_new(kb, "template", json_string(APIREQ_CODEINT));
	} else {
		e2b_error(req, 404, "template \"%s\" not found: this server has \"base\", "
				    "\"code-interpreter-v1\" and the tenant's snapshots", tmpl);
		goto out;
	}
	if ((v = json_object_get(b, "metadata")) && !json_is_null(v))
		json_object_set(kb, "metadata", v);
	if ((v = json_object_get(b, "envVars")) && !json_is_null(v))
		json_object_set(kb, "env", v);
	if (rules && json_array_size(rules))
		json_object_set_new(kb, "egress", json_pack("{s:O}", "rules", rules));
	if (json_array_size(secrets))
		json_object_set(kb, "secrets", secrets);
	if (!api_call(req, "POST", "/v1/sandboxes", kb, &a))
		goto out;
	if (a.status != 201 || !json_is_object(a.json)) {
		if (a.status == 404 && !strncmp(tmpl, "snap_", 5))
			e2b_error(req, 404, "snapshot \"%s\" not found", tmpl);
		else
			reply_api_error(req, &a);
		goto out;
	}
	http_req_set_object(req, json_str(a.json, "id", ""));
	http_reply_json(req, 201, sandbox_of(a.json));
out:
	answer_free(&a);
	json_decref(rules);
	json_decref(secrets);
	json_decref(kb);
	json_decref(b);
	wipe_body(req);
}

/*
 * Reads sandbox `id` of the caller. True with its Kiln JSON in a->json when it exists for E2B
 * (running or paused); false after replying (404 also for another tenant's or a stopped one).
 */
static bool sandbox_read(struct http_req *req, const char *id, struct answer *a)
{
	char path[128];

	memset(a, 0, sizeof(*a));
	if (!id) {
		e2b_not_found(req, http_req_param(req, "sandboxID"));
		return false;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s", id);
	if (!api_call(req, "GET", path, NULL, a))
		return false;
	if (a->status == 200 && json_is_object(a->json) && state_of(a->json))
		return true;
	if (a->status == 200 || a->status == 404)
		e2b_not_found(req, id);
	else
		reply_api_error(req, a);
	return false;
}

/* GET /sandboxes/{sandboxID} */
static void e2b_get(struct http_req *req)
{
	struct answer a;

	if (sandbox_read(req, param_id(req, "sandboxID"), &a))
		http_reply_json(req, 200, detail_of(a.json, true));
	answer_free(&a);
}

/* DELETE /sandboxes/{sandboxID}: 204; 404 when there is no such sandbox of the caller. */
static void e2b_kill(struct http_req *req)
{
	const char *id = param_id(req, "sandboxID");
	struct answer a;
	char path[128];

	if (!id) {
		e2b_not_found(req, http_req_param(req, "sandboxID"));
		return;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s", id);
	if (!api_call(req, "DELETE", path, NULL, &a))
		goto out;
	reply_sandbox_done(req, id, &a);
out:
	answer_free(&a);
}

/* Sets the timeout of running sandbox `id` to `s` seconds from now (the API's PUT .../timeout). */
static bool set_timeout(struct http_req *req, const char *id, long long s)
{
	char path[128];
	json_t *kb = json_pack("{s:I}", "timeout_s", (json_int_t)s);
	struct answer a;
	bool ok = false;

	snprintf(path, sizeof(path), "/v1/sandboxes/%s/timeout", id);
	if (api_call(req, "PUT", path, kb, &a)) {
		ok = a.status == 200 || a.status == 204;
		if (a.status == 404)
			e2b_not_found(req, id);
		else if (!ok)
			reply_api_error(req, &a);
	}
	answer_free(&a);
	json_decref(kb);
	return ok;
}

/* POST /sandboxes/{sandboxID}/timeout {"timeout": s}: 204 */
static void e2b_timeout(struct http_req *req)
{
	const char *id = param_id(req, "sandboxID");
	json_t *b = e2b_body(req);
	long long s;

	if (!b)
		return;
	if (!json_object_get(b, "timeout"))
		e2b_error(req, 400, "timeout is required");
	else if (!id)
		e2b_not_found(req, http_req_param(req, "sandboxID"));
	else if (timeout_field(req, b, DEFAULT_TIMEOUT_S, &s) && set_timeout(req, id, s))
		http_reply_empty(req, 204);
	json_decref(b);
}

/* POST /sandboxes/{sandboxID}/pause: 204; 409 when it is not running (the SDK: false). */
static void e2b_pause(struct http_req *req)
{
	json_t *b = e2b_body(req);
	struct answer a = { 0 }, p = { 0 };
	const char *id = param_id(req, "sandboxID");
	char path[128];

	if (!b)
		return;
	if (json_is_false(json_object_get(b, "memory"))) {
		e2b_error(req, 400, "memory false (a file-system-only pause) is not supported by this "
				    "server: a pause keeps the memory");
		goto out;
	}
	if (!sandbox_read(req, id, &a))
		goto out;
	if (strcmp(state_of(a.json), "paused") == 0) {
		e2b_error(req, 409, "sandbox \"%s\" is already paused", id);
		goto out;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/pause", id);
	if (!api_call(req, "POST", path, NULL, &p))
		goto out;
	reply_sandbox_done(req, id, &p);
out:
	answer_free(&p);
	answer_free(&a);
	json_decref(b);
}

/* Seconds from now to the RFC 3339 UTC time `t` (-1 when it does not parse). */
static long long seconds_until(const char *t)
{
	struct tm tm = { 0 };

	if (!t || !strptime(t, "%Y-%m-%dT%H:%M:%S", &tm))
		return -1;
	return (long long)timegm(&tm) - (long long)time(NULL);
}

/*
 * POST /v2/sandboxes/{sandboxID}/connect, POST /sandboxes/{sandboxID}/connect: a paused sandbox
 * is resumed (201) with `timeout` (default 300 s); a running one answers 200, its deadline moved
 * to now + `timeout` only when that is later. POST /sandboxes/{sandboxID}/resume (deprecated):
 * the same, but 409 for a running sandbox.
 */
static void connect_or_resume(struct http_req *req, bool resume_only)
{
	const char *id = param_id(req, "sandboxID");
	json_t *b = e2b_body(req);
	struct answer a = { 0 }, r = { 0 };
	long long s;
	char path[128];

	if (!b)
		return;
	if (json_is_false(json_object_get(b, "memory"))) {
		e2b_error(req, 400, "memory false (resume by a reboot) is not supported by this server");
		goto out;
	}
	if (!timeout_field(req, b, DEFAULT_TIMEOUT_S, &s) || !sandbox_read(req, id, &a))
		goto out;
	if (strcmp(state_of(a.json), "running") == 0) {
		if (resume_only) {
			e2b_error(req, 409, "sandbox \"%s\" is already running", id);
			goto out;
		}
		if (seconds_until(json_str(a.json, "expires_at", NULL)) < s && !set_timeout(req, id, s))
			goto out;
		http_reply_json(req, 200, sandbox_of(a.json));
		goto out;
	}
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/resume", id);
	if (!api_call(req, "POST", path, NULL, &r))
		goto out;
	if (r.status < 200 || r.status >= 300) {
		if (r.status == 404)
			e2b_not_found(req, id);
		else
			reply_api_error(req, &r);
		goto out;
	}
	if (!set_timeout(req, id, s))
		goto out;
	http_reply_json(req, 201, sandbox_of(a.json));
out:
	answer_free(&r);
	answer_free(&a);
	json_decref(b);
}

static void e2b_connect(struct http_req *req)
{
	connect_or_resume(req, false);
}

static void e2b_resume(struct http_req *req)
{
	connect_or_resume(req, true);
}

/*
 * E2B's `metadata` query value ("k=v&k2=v2", form-encoded, each key and value percent-encoded
 * once more by the SDK) as a JSON object; NULL when it does not decode.
 */
static char *form_decode(const char *s, size_t n, bool plus)
{
	char *out = malloc(n + 1);
	size_t k = 0;

	if (!out)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		if (s[i] == '%' && i + 2 < n && isxdigit((unsigned char)s[i + 1]) &&
		    isxdigit((unsigned char)s[i + 2])) {
			char hex[3] = { s[i + 1], s[i + 2], 0 };
			out[k++] = (char)strtol(hex, NULL, 16);
			i += 2;
		} else if (s[i] == '%') {
			free(out);
			return NULL;
		} else {
			out[k++] = plus && s[i] == '+' ? ' ' : s[i];
		}
	}
	out[k] = '\0';
	if (strlen(out) != k) {	/* a NUL byte */
		free(out);
		return NULL;
	}
	return out;
}

static json_t *metadata_filter(const char *q)
{
	json_t *o = json_object();
	const char *p = q;

	while (o && *p) {
		size_t n = strcspn(p, "&"), eq = strcspn(p, "=");
		char *k1 = NULL, *v1 = NULL, *k2 = NULL, *v2 = NULL;
		bool ok;

		if (eq >= n) {
			json_decref(o);
			return NULL;
		}
		k1 = form_decode(p, eq, true);
		v1 = form_decode(p + eq + 1, n - eq - 1, true);
		k2 = k1 ? form_decode(k1, strlen(k1), false) : NULL;
		v2 = v1 ? form_decode(v1, strlen(v1), false) : NULL;
		ok = k2 && v2 && k2[0] && json_object_set_new(o, k2, json_string(v2)) == 0;
		free(k1), free(v1), free(k2), free(v2);
		if (!ok) {
			json_decref(o);
			return NULL;
		}
		p += n;
		if (*p == '&')
			p++;
	}
	return o;
}

/*
 * The API's `state` list for E2B's `state` query value ("running", "paused" or both,
 * comma-separated; absent: both). False after replying 400.
 */
static bool states_of(struct http_req *req, const char *q, char *out, size_t n)
{
	bool running = !q, paused = !q;
	const char *p = q;

	while (p && *p) {
		size_t len = strcspn(p, ",");

		if (len == 7 && !strncmp(p, "running", 7))
			running = true;
		else if (len == 6 && !strncmp(p, "paused", 6))
			paused = true;
		else {
			e2b_error(req, 400, "state must be running, paused or both (comma-separated)");
			return false;
		}
		p += len + (p[len] == ',');
		if (p[-1] == ',' && !*p) {
			e2b_error(req, 400, "state must not end with a comma");
			return false;
		}
	}
	snprintf(out, n, "%s%s%s", running ? "creating,running" : "", running && paused ? "," : "",
		 paused ? "paused" : "");
	return true;
}

/* Appends `&name=<value escaped>` to `path`. */
static bool query_add(char *path, size_t n, const char *name, const char *value)
{
	char *esc = curl_easy_escape(NULL, value, 0);
	size_t used = strlen(path);
	int w;

	if (!esc)
		return false;
	w = snprintf(path + used, n - used, "%s%s=%s", strchr(path, '?') ? "&" : "?", name, esc);
	curl_free(esc);
	return w >= 0 && (size_t)w < n - used;
}

/*
 * One page of the API's listing: `state` (the API's states), `meta` (a JSON object filter, or
 * NULL), `limit`, `cursor` (or NULL). True with the answer; false after replying.
 */
static bool list_page(struct http_req *req, const char *state, const json_t *meta,
		      const char *tmpl, int limit, const char *cursor, struct answer *a)
{
	char path[4096] = "/v1/sandboxes", lim[16], *mt = NULL;
	bool ok;

	snprintf(lim, sizeof(lim), "%d", limit);
	mt = meta && json_object_size(meta) ? json_dumps(meta, JSON_COMPACT) : NULL;
	ok = query_add(path, sizeof(path), "state", state) &&
	     query_add(path, sizeof(path), "limit", lim) &&
	     (!cursor || query_add(path, sizeof(path), "cursor", cursor)) &&
	     (!mt || query_add(path, sizeof(path), "metadata", mt)) &&
	     (!tmpl || query_add(path, sizeof(path), "template", tmpl));
	free(mt);
	memset(a, 0, sizeof(*a));
	if (!ok) {
		e2b_error(req, 400, "the filter is too long");
		return false;
	}
	if (!api_call(req, "GET", path, NULL, a))
		return false;
	if (a->status != 200 || !json_is_array(json_object_get(a->json, "sandboxes"))) {
		reply_api_error(req, a);
		return false;
	}
	return true;
}

/* The `limit` query (1-100, default 100) into *limit; false after answering 400. */
static bool page_limit(struct http_req *req, long *limit)
{
	const char *lq = http_req_query(req, "limit");
	char *end = NULL;

	*limit = 100;
	if (!lq)
		return true;
	*limit = strtol(lq, &end, 10);
	if (!lq[0] || *end || *limit < 1 || *limit > 100) {
		e2b_error(req, 400, "limit must be a whole number from 1 to 100");
		return false;
	}
	return true;
}

/* GET /v2/sandboxes?state=&metadata=&limit=&nextToken= (X-Next-Token when there is more) */
static void e2b_list(struct http_req *req)
{
	const char *mq = http_req_query(req, "metadata");
	const char *tmpl = http_req_query(req, "template"), *next;
	json_t *meta = NULL, *out = json_array(), *e;
	struct answer a = { 0 };
	char states[64];
	long limit = 100;
	size_t i;

	if (!page_limit(req, &limit))
		goto out;
	if (http_req_query(req, "startedAfter")) {
		e2b_error(req, 400, "startedAfter is not supported by this server");
		goto out;
	}
	if (http_req_query(req, "order") && strcmp(http_req_query(req, "order"), "desc") != 0) {
		e2b_error(req, 400, "order may only be desc (newest first) on this server");
		goto out;
	}
	if (mq && !(meta = metadata_filter(mq))) {
		e2b_error(req, 400, "metadata must be a form-encoded list of key=value pairs");
		goto out;
	}
	if (!states_of(req, http_req_query(req, "state"), states, sizeof(states)))
		goto out;
	/* E2B's base is Kiln's python; any other name is the template's own */
	if (tmpl && !strcmp(tmpl, "base"))
		tmpl = "python";
	if (!list_page(req, states, meta, tmpl, (int)limit, http_req_query(req, "nextToken"), &a))
		goto out;
	json_array_foreach(json_object_get(a.json, "sandboxes"), i, e)
		json_array_append_new(out, detail_of(e, false));
	next = json_string_value(json_object_get(a.json, "next_cursor"));
	if (next && next[0])
		http_reply_header(req, "X-Next-Token", next);
	http_reply_json(req, 200, out);
	out = NULL;
out:
	answer_free(&a);
	json_decref(out);
	json_decref(meta);
}

/* GET /sandboxes?metadata= (the older SDKs): every running sandbox of the caller, unpaged. */
static void e2b_list_legacy(struct http_req *req)
{
	const char *mq = http_req_query(req, "metadata");
	json_t *meta = NULL, *out = json_array(), *e;
	char *cursor = NULL;
	size_t i;

	if (mq && !(meta = metadata_filter(mq))) {
		e2b_error(req, 400, "metadata must be a form-encoded list of key=value pairs");
		goto out;
	}
	for (int page = 0; page < LIST_LEGACY_PAGES; page++) {
		struct answer a;
		const char *next;

		if (!list_page(req, "creating,running", meta, NULL, 100, cursor, &a)) {
			answer_free(&a);
			goto out;
		}
		json_array_foreach(json_object_get(a.json, "sandboxes"), i, e)
			json_array_append_new(out, detail_of(e, false));
		next = json_string_value(json_object_get(a.json, "next_cursor"));
		free(cursor);
		cursor = next ? strdup(next) : NULL;
		answer_free(&a);
		if (!cursor)
			break;
	}
	http_reply_json(req, 200, out);
	out = NULL;
out:
	free(cursor);
	json_decref(out);
	json_decref(meta);
}

/* A unix time in seconds (E2B's start and end), else -1. */
static long long unix_param(const char *q)
{
	char *end = NULL;
	long long v;

	if (!q)
		return -2;	/* absent */
	v = strtoll(q, &end, 10);
	return q[0] && !*end && v >= 0 && v < 253402300800LL ? v : -1;
}

static void rfc3339_of(long long t, char *out, size_t n)
{
	time_t tt = (time_t)t;
	struct tm tm;

	gmtime_r(&tt, &tm);
	strftime(out, n, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

/*
 * GET /sandboxes/{sandboxID}/metrics?start=&end= (unix seconds; default the last 15 minutes):
 * the sandbox's usage series (GET /v1/sandboxes/{id}/usage, what the meter recorded), one sample
 * per bucket of at least 5 s: cpuUsedPct from its CPU time over the bucket and its vCPUs, memUsed
 * the bucket's peak, memTotal and diskTotal its size. Kiln samples no disk use or page cache:
 * diskUsed and memCache are 0. 404 as everywhere for a sandbox that is not the caller's.
 */
static void e2b_metrics(struct http_req *req)
{
	long long start = unix_param(http_req_query(req, "start"));
	long long end = unix_param(http_req_query(req, "end")), step;
	struct answer a, u = { 0 };
	char path[256], from[32], to[32];
	json_t *out = NULL, *p;
	double vcpus;
	size_t i;

	memset(&a, 0, sizeof(a));
	if (start == -1 || end == -1) {
		e2b_error(req, 400, "start and end must be unix times in seconds");
		return;
	}
	if (end == -2)
		end = (long long)time(NULL);
	if (start == -2)
		start = end - 900;
	if (start >= end) {
		e2b_error(req, 400, "start must be before end");
		return;
	}
	if (!sandbox_read(req, param_id(req, "sandboxID"), &a))
		goto out;
	step = (end - start + 3599) / 3600;
	if (step < 5)
		step = 5;
	rfc3339_of(start, from, sizeof(from));
	rfc3339_of(end, to, sizeof(to));
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/usage?from=%s&to=%s&step=%llds",
		 json_str(a.json, "id", ""), from, to, step);
	if (!api_call(req, "GET", path, NULL, &u))
		goto out;
	if (u.status != 200 || !json_is_array(json_object_get(u.json, "points"))) {
		reply_api_error(req, &u);
		goto out;
	}
	vcpus = json_number_value(json_object_get(a.json, "vcpus"));
	out = json_array();
	json_array_foreach(json_object_get(u.json, "points"), i, p) {
		const char *t = json_str(p, "t", "");
		struct tm tm = { 0 };
		double pct = vcpus > 0 ? (double)json_int(p, "cpu_ms", 0) / ((double)step * 10.0 * vcpus)
				       : 0;

		if (!strptime(t, "%Y-%m-%dT%H:%M:%S", &tm))
			continue;
		json_array_append_new(
			out, json_pack("{s:s, s:I, s:I, s:f, s:I, s:I, s:I, s:I, s:I}", "timestamp", t,
				       "timestampUnix", (json_int_t)timegm(&tm), "cpuCount",
				       (json_int_t)(vcpus < 1 ? 1 : ceil(vcpus)), "cpuUsedPct",
				       pct > 100 ? 100.0 : pct, "memUsed",
				       (json_int_t)json_int(p, "mem_bytes", 0), "memTotal",
				       (json_int_t)json_int(a.json, "memory_mib", 0) << 20, "memCache",
				       (json_int_t)0, "diskUsed", (json_int_t)0, "diskTotal",
				       (json_int_t)json_int(a.json, "disk_gib", 0) << 30));
	}
	http_reply_json(req, 200, out);
out:
	answer_free(&u);
	answer_free(&a);
}

/*
 * PUT /sandboxes/{sandboxID}/network: replaces the egress rules (the API's PUT .../egress), then
 * the secrets when `rules` is given or the sandbox has some (E2B: an omitted field is cleared).
 * A refused secrets set puts the earlier rules back, so a refusal changes nothing.
 */
static void e2b_network(struct http_req *req)
{
	const char *id = param_id(req, "sandboxID");
	json_t *b = e2b_body(req), *rules = NULL, *secrets = NULL, *kb = NULL;
	struct answer a = { 0 }, old = { 0 }, s = { 0 };
	char path[128], spath[128];

	if (!b)
		return;
	if (!id) {
		e2b_not_found(req, http_req_param(req, "sandboxID"));
		goto out;
	}
	if (!egress_of(req, json_object_get(b, "allow_internet_access"), b, &rules, &secrets))
		goto out;
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/egress", id);
	snprintf(spath, sizeof(spath), "/v1/sandboxes/%s/secrets", id);
	if (!secrets) {
		if (!api_call(req, "GET", spath, NULL, &s))
			goto out;
		if (s.status != 200) {
			reply_sandbox_done(req, id, &s);
			goto out;
		}
		if (json_array_size(json_object_get(s.json, "secrets")))
			secrets = json_array();
		answer_free(&s);
		memset(&s, 0, sizeof(s));
	}
	if (secrets && !api_call(req, "GET", path, NULL, &old))
		goto out;
	if (secrets && old.status != 200) {
		reply_sandbox_done(req, id, &old);
		goto out;
	}
	kb = json_pack("{s:o}", "rules", rules ? rules : json_array());
	rules = NULL;
	if (!api_call(req, "PUT", path, kb, &a))
		goto out;
	if (!secrets || a.status < 200 || a.status > 299) {
		reply_sandbox_done(req, id, &a);
		goto out;
	}
	json_decref(kb);
	kb = json_pack("{s:O}", "secrets", secrets);
	if (!api_call(req, "PUT", spath, kb, &s))
		goto out;
	if (s.status < 200 || s.status > 299) {
		struct answer back = { 0 };

		json_decref(kb);
		kb = json_pack("{s:O}", "rules", json_object_get(old.json, "rules"));
		if (!api_call(req, "PUT", path, kb, &back)) {
			answer_free(&back);
			goto out;
		}
		if (back.status < 200 || back.status > 299)
			log_warn("e2b: sandbox %s: the secrets were refused (%ld) and its earlier egress "
				 "rules could not be put back (%ld)", id, s.status, back.status);
		answer_free(&back);
	}
	reply_sandbox_done(req, id, &s);
out:
	answer_free(&a);
	answer_free(&old);
	answer_free(&s);
	json_decref(kb);
	json_decref(rules);
	json_decref(secrets);
	json_decref(b);
	wipe_body(req);
}

/* E2B's SnapshotInfo of a Kiln snapshot. */
static json_t *snapshot_of(const json_t *s)
{
	const char *name = json_str(s, "name", NULL);
	json_t *names = json_array();

	if (name)
		json_array_append_new(names, json_string(name));
	return json_pack("{s:s, s:o}", "snapshotID", json_str(s, "id", ""), "names", names);
}

/* POST /sandboxes/{sandboxID}/snapshots {"name"?}: 201 {snapshotID, names} */
static void e2b_snapshot_create(struct http_req *req)
{
	const char *id = param_id(req, "sandboxID");
	json_t *b = e2b_body(req), *kb = NULL;
	struct answer a = { 0 };
	char path[128];

	if (!b)
		return;
	if (!id) {
		e2b_not_found(req, http_req_param(req, "sandboxID"));
		goto out;
	}
	kb = json_object();
	if (json_object_get(b, "name"))
		json_object_set(kb, "name", json_object_get(b, "name"));
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/snapshots", id);
	if (!api_call(req, "POST", path, kb, &a))
		goto out;
	if (a.status >= 200 && a.status < 300 && json_is_object(a.json))
		http_reply_json(req, 201, snapshot_of(a.json));
	else if (a.status == 404)
		e2b_not_found(req, id);
	else
		reply_api_error(req, &a);
out:
	answer_free(&a);
	json_decref(kb);
	json_decref(b);
}

/* GET /snapshots?sandboxID=&limit=&nextToken=: the caller's snapshots (X-Next-Token). */
static void e2b_snapshot_list(struct http_req *req)
{
	const char *sid = http_req_query(req, "sandboxID");
	const char *cursor = http_req_query(req, "nextToken"), *next;
	char path[1024] = "/v1/snapshots";
	json_t *out = json_array(), *e, *items;
	struct answer a = { 0 };
	long limit = 100;
	size_t i;

	if (!page_limit(req, &limit))
		goto out;
	if (http_req_query(req, "name")) {
		e2b_error(req, 400, "name is not supported by this server's snapshot listing");
		goto out;
	}
	snprintf(path + strlen(path), sizeof(path) - strlen(path), "?limit=%ld", limit);
	if (cursor && !query_add(path, sizeof(path), "cursor", cursor)) {
		e2b_error(req, 400, "nextToken is not one this server gave");
		goto out;
	}
	if (!api_call(req, "GET", path, NULL, &a))
		goto out;
	items = json_object_get(a.json, "snapshots");
	if (a.status != 200 || !json_is_array(items)) {
		reply_api_error(req, &a);
		goto out;
	}
	json_array_foreach(items, i, e)
		if (!sid || !strcmp(json_str(e, "sandbox_id", ""), sid))
			json_array_append_new(out, snapshot_of(e));
	next = json_string_value(json_object_get(a.json, "next_cursor"));
	if (next && next[0])
		http_reply_header(req, "X-Next-Token", next);
	http_reply_json(req, 200, out);
	out = NULL;
out:
	answer_free(&a);
	json_decref(out);
}

/* DELETE /templates/{templateID}: a snapshot's delete (204; 404 the SDK reads as false). */
static void e2b_snapshot_delete(struct http_req *req)
{
	const char *id = param_id(req, "templateID");
	struct answer a = { 0 };
	char path[128];

	if (!id || strncmp(id, "snap_", 5) != 0) {
		e2b_error(req, 404, "snapshot \"%s\" not found", http_req_param(req, "templateID"));
		return;
	}
	snprintf(path, sizeof(path), "/v1/snapshots/%s", id);
	if (!api_call(req, "DELETE", path, NULL, &a))
		goto out;
	if (a.status >= 200 && a.status < 300)
		http_reply_empty(req, 204);
	else if (a.status == 404)
		e2b_error(req, 404, "snapshot \"%s\" not found", id);
	else
		reply_api_error(req, &a);
out:
	answer_free(&a);
}

/* What E2B has and Kiln does not map yet (docs/e2b.md): 501 in E2B's shape. */
/* ---- the sandbox data plane: envd (port 49983) on e2b_sandbox_listen ---- */

#define ENVD_PORT 49983			/* E2b-Sandbox-Port of envd */
#define ENVD_TOKEN_TTL_S 120		/* seconds of the token a data-plane request calls the API with */
#define ENVD_FILE_MAX (100u << 20)	/* bytes of a file read: the API's own cap */
#define ENVD_FS_TIMEOUT_S 60		/* seconds a filesystem RPC may take in the guest */
#define ENVD_USER_MAX 33		/* bytes of a user name */
#define ENVD_DEFAULT_USER "user"	/* E2B's default user */

/* A data-plane request: its sandbox, the user it acts as, and the API credential for it. */
struct envd {
	char id[ID_MAX];
	char tid[64];				/* its tenant */
	char user[ENVD_USER_MAX];
	char auth[AUTH_HEADER_MAX + 32];	/* "Authorization: Bearer <token of the owner>" */
};

/* envd's token refusal, E2B's words. */
static void envd_unauthorized(struct http_req *req)
{
	e2b_error(req, 401, "unauthorized access, please provide a valid access token or method "
			    "signing if supported");
}

/* Replies a Connect error: `code` (Connect's name) with its HTTP status, JSON. */
static void rpc_error(struct http_req *req, const char *code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void rpc_error(struct http_req *req, const char *code, const char *fmt, ...)
{
	static const struct { const char *code; int status; } map[] = {
		{ "not_found", 404 }, { "already_exists", 409 }, { "invalid_argument", 400 },
		{ "failed_precondition", 400 }, { "unauthenticated", 401 },
		{ "permission_denied", 403 }, { "resource_exhausted", 429 },
		{ "unavailable", 503 }, { "deadline_exceeded", 504 }, { "unimplemented", 501 },
	};
	char msg[KILN_ERRMSG_MAX];
	int status = 500;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
		if (!strcmp(map[i].code, code))
			status = map[i].status;
	http_reply_json(req, status, json_pack("{s:s, s:s}", "code", code, "message", msg));
}

/* Whether `s` is a user name the guest could have ([a-z_][a-z0-9_-]*, < ENVD_USER_MAX). */
static bool user_ok(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n >= ENVD_USER_MAX || !(islower((unsigned char)s[0]) || s[0] == '_'))
		return false;
	for (size_t i = 0; i < n; i++)
		if (!islower((unsigned char)s[i]) && !isdigit((unsigned char)s[i]) && s[i] != '_' &&
		    s[i] != '-')
			return false;
	return true;
}

/* The user of an RPC: `Authorization: Basic base64("<user>:")`, else the default; false if bad. */
static bool rpc_user(struct http_req *req, char out[ENVD_USER_MAX])
{
	const char *h = http_req_header(req, "Authorization");
	unsigned char dec[96];
	int n;

	snprintf(out, ENVD_USER_MAX, "%s", ENVD_DEFAULT_USER);
	if (!h || !h[0])
		return true;
	if (strncasecmp(h, "Basic ", 6) != 0 || strlen(h + 6) > 4 * (sizeof(dec) / 3) - 4)
		return false;
	n = EVP_DecodeBlock(dec, (const unsigned char *)h + 6, (int)strlen(h + 6));
	if (n <= 0)
		return false;
	while (n > 0 && dec[n - 1] == '\0')	/* EVP_DecodeBlock counts padding as zeros */
		n--;
	dec[n] = '\0';
	if (!strchr((char *)dec, ':'))
		return false;
	*strchr((char *)dec, ':') = '\0';
	if (!user_ok((char *)dec))
		return false;
	memcpy(out, dec, strlen((char *)dec) + 1);	/* user_ok: shorter than ENVD_USER_MAX */
	return true;
}

/* Signs `auth` (n bytes) anew: a token of ENVD_TOKEN_TTL_S of tenant `tid`. False (logged) on
 * failure. */
static bool envd_sign(struct gateway *gw, const char *tid, char *auth, size_t n)
{
	struct kiln_error err = { 0 };
	char *jwt = NULL;

	if (signing_sign(gw->signing,
			 &(struct auth_token_params){ .iss = GW_ISSUER, .aud = AUTH_AUD_API,
						      .sub = "e2b-envd", .tid = tid,
						      .scopes = AUTH_SCOPE_SANDBOX_READ |
								AUTH_SCOPE_SANDBOX_WRITE,
						      .now = time(NULL), .ttl_s = ENVD_TOKEN_TTL_S },
			 &jwt, NULL, &err) != KILN_OK) {
		log_warn("e2b: data plane: cannot sign a token: %s", err.msg);
		return false;
	}
	snprintf(auth, n, "Authorization: Bearer %s", jwt);
	explicit_bzero(jwt, strlen(jwt));
	free(jwt);
	return true;
}

/*
 * Opens a data-plane request: the sandbox of E2b-Sandbox-Id on E2b-Sandbox-Port 49983, its
 * X-Access-Token checked (401 otherwise: the token is the only credential here), the sandbox
 * running (502 otherwise, as E2B's proxy answers for a sandbox that is gone or paused), and a
 * short token of its owner's signed for the API calls. True with `e` filled; false after replying.
 */
static bool envd_open(struct http_req *req, struct envd *e)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_header(req, "E2b-Sandbox-Id");
	const char *port = http_req_header(req, "E2b-Sandbox-Port");
	const char *tok = http_req_header(req, "X-Access-Token");
	char want[E2B_TOKEN_HEX + 1];
	struct kiln_error err = { 0 };
	struct pg_conn *c = NULL;
	struct pg_res *r = NULL;
	bool ok = false, running;
	size_t n = id ? strlen(id) : 0;

	memset(e, 0, sizeof(*e));
	if (n == 0 || n >= ID_MAX) {
		e2b_error(req, 400, "missing or malformed E2b-Sandbox-Id header");
		return false;
	}
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)id[i]) && id[i] != '_' && id[i] != '-') {
			e2b_error(req, 400, "missing or malformed E2b-Sandbox-Id header");
			return false;
		}
	if (!port || http_port_value(port) != ENVD_PORT) {
		e2b_error(req, 502, "port %.8s of sandbox \"%s\" is not served on this URL: only %d "
				    "(envd) is (docs/e2b.md)", port ? port : "(none)", id, ENVD_PORT);
		return false;
	}
	e2b_token_of(id, want);
	if (!tok || strlen(tok) != E2B_TOKEN_HEX || !want[0] ||
	    CRYPTO_memcmp(tok, want, E2B_TOKEN_HEX) != 0) {
		envd_unauthorized(req);
		return false;
	}
	snprintf(e->id, sizeof(e->id), "%s", id);
	if (pg_acquire(gw->pg, &c, &err) != KILN_OK ||
	    PGQ(c, &r, &err, "SELECT tenant_id, state FROM sandboxes WHERE id = $1", id) != KILN_OK) {
		log_warn("e2b: data plane: cannot read sandbox %s: %s", id, err.msg);
		e2b_error(req, 503, "the service is unavailable; try again");
		goto out;
	}
	running = pg_res_rows(r) == 1 && (!strcmp(pg_res_str(r, 0, 1), "running") ||
					 !strcmp(pg_res_str(r, 0, 1), "creating"));
	if (!running) {
		e2b_error(req, 502, "sandbox \"%s\" is not running (it was killed, paused or never "
				    "existed)", id);
		goto out;
	}
	snprintf(e->tid, sizeof(e->tid), "%s", pg_res_str(r, 0, 0));
	if (!envd_sign(gw, e->tid, e->auth, sizeof(e->auth))) {
		e2b_error(req, 500, "internal error");
		goto out;
	}
	ok = true;
out:
	pg_res_free(r);
	if (c)
		pg_release(gw->pg, c);
	return ok;
}

static void envd_close(struct envd *e)
{
	explicit_bzero(e->auth, sizeof(e->auth));
}

/*
 * The absolute path envd would use for `p` as user `user`: `~` and `~/...` under the home
 * directory, a relative path under it too. False when it does not fit or is empty.
 */
static bool envd_path(const char *p, const char *user, char *out, size_t n)
{
	char home[64];
	int w;

	snprintf(home, sizeof(home), strcmp(user, "root") ? "/home/%s" : "/root", user);
	if (!p || !p[0])
		w = snprintf(out, n, "%s", home);
	else if (p[0] == '/')
		w = snprintf(out, n, "%s", p);
	else if (p[0] == '~' && (p[1] == '\0' || p[1] == '/'))
		w = snprintf(out, n, "%s%s", home, p + 1);
	else
		w = snprintf(out, n, "%s/%s", home, p);
	return w > 0 && (size_t)w < n && !memchr(out, '\0', (size_t)w);
}

/* `s` percent-encoded for a query value into `out` (n bytes); false when it does not fit. */
static bool query_escape(const char *s, char *out, size_t n)
{
	size_t k = 0;

	for (; *s; s++) {
		if (k + 4 >= n)
			return false;
		if (isalnum((unsigned char)*s) || strchr("-._~/", *s))
			out[k++] = *s;
		else
			k += (size_t)snprintf(out + k, n - k, "%%%02X", (unsigned char)*s);
	}
	out[k] = '\0';
	return true;
}

/* The user of a /files request: `username`, else the default; replies 401 and false if bad. */
static bool files_user(struct http_req *req, struct envd *e)
{
	const char *u = http_req_query(req, "username");

	snprintf(e->user, sizeof(e->user), "%s", u && u[0] ? u : ENVD_DEFAULT_USER);
	if (!user_ok(e->user)) {
		e2b_error(req, 401, "invalid user \"%.40s\"", u);
		return false;
	}
	return true;
}

/* Replies a files error of the API in envd's REST shape. */
static void files_error(struct http_req *req, const struct envd *e, const char *path,
			const struct answer *a)
{
	const char *msg = json_string_value(json_object_get(json_object_get(a->json, "error"),
							    "message"));

	switch (a->status) {
	case 404:
		e2b_error(req, 404, "path '%s' does not exist", path);
		break;
	case 409:
		e2b_error(req, 502, "sandbox \"%s\" is not running", e->id);
		break;
	case 422:
		e2b_error(req, 400, "%s", msg ? msg : "invalid path or user");
		break;
	case 413:
		e2b_error(req, 413, "the file is too large");
		break;
	default:
		reply_api_error(req, a);
	}
}

/* GET /files?path=&username=: the file's bytes. */
static void envd_files_get(struct http_req *req)
{
	char path[4096], q[3 * 4096 + 64], url[sizeof(q) + 128];
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	struct envd e;

	if (!envd_open(req, &e))
		return;
	if (!files_user(req, &e))
		goto out;
	if (!envd_path(http_req_query(req, "path"), e.user, path, sizeof(path)) ||
	    !query_escape(path, q, sizeof(q))) {
		e2b_error(req, 400, "invalid path");
		goto out;
	}
	snprintf(url, sizeof(url), "/v1/sandboxes/%s/files?path=%s&user=%s", e.id, q, e.user);
	if (inner_call(e.auth, "GET", url, NULL, NULL, 0, ENVD_FILE_MAX, &a, &err) != KILN_OK) {
		e2b_error(req, 503, "the service is unavailable; try again");
		goto out;
	}
	if (a.status == 200)
		http_reply_data(req, 200, "application/octet-stream", a.body.data, a.body.len);
	else
		files_error(req, &e, path, &a);
out:
	answer_free(&a);
	envd_close(&e);
}

/* Writes `len` bytes at `path` (absolute) as e->user; replies an error and false if it failed. */
static bool file_put(struct http_req *req, const struct envd *e, const char *path,
		     const char *data, size_t len)
{
	char q[3 * 4096 + 64], url[sizeof(q) + 128];
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	bool ok = false;

	if (!query_escape(path, q, sizeof(q))) {
		e2b_error(req, 400, "invalid path");
		return false;
	}
	snprintf(url, sizeof(url), "/v1/sandboxes/%s/files?path=%s&user=%s", e->id, q, e->user);
	if (inner_call(e->auth, "PUT", url, "application/octet-stream", data ? data : "", len,
		       ANSWER_MAX, &a, &err) != KILN_OK)
		e2b_error(req, 503, "the service is unavailable; try again");
	else if (a.status != 204 && a.status != 200)
		files_error(req, e, path, &a);
	else
		ok = true;
	answer_free(&a);
	return ok;
}

/* `[{"path","name","type":"file"}]`'s entry for `path`. */
static json_t *written_of(const char *path)
{
	const char *slash = strrchr(path, '/');

	return json_pack("{s:s, s:s, s:s}", "path", path, "name", slash ? slash + 1 : path, "type",
			 "file");
}

/* memmem for the multipart reader. */
static const char *find(const char *h, size_t hn, const char *n, size_t nn)
{
	for (size_t i = 0; nn && i + nn <= hn; i++)
		if (h[i] == n[0] && !memcmp(h + i, n, nn))
			return h + i;
	return NULL;
}

/*
 * A part's filename from its headers (`hdr`, `n` bytes): undici's escapes %22, %0A, %0D decoded
 * (and only those). False when there is none or it does not fit `out`.
 */
static bool part_filename(const char *hdr, size_t n, char *out, size_t size)
{
	const char *p = find(hdr, n, "filename=\"", 10), *end;
	size_t k = 0;

	if (!p)
		return false;
	p += 10;
	end = memchr(p, '"', n - (size_t)(p - hdr));
	if (!end)
		return false;
	while (p < end) {
		char c = *p++;

		if (c == '%' && end - p >= 2 && (!strncasecmp(p, "22", 2) || !strncasecmp(p, "0A", 2) ||
						 !strncasecmp(p, "0D", 2))) {
			c = !strncasecmp(p, "22", 2) ? '"' : !strncasecmp(p, "0A", 2) ? '\n' : '\r';
			p += 2;
		}
		if (k + 1 >= size)
			return false;
		out[k++] = c;
	}
	out[k] = '\0';
	return k > 0;
}

/*
 * POST /files[?path=&username=]: multipart/form-data, one part `file` per file, the target in the
 * part's filename (the `path` parameter wins for a single part), or application/octet-stream with
 * `path`. Parents are made, files replaced whole, owned by the user. Answers the written entries.
 */
static void envd_files_post(struct http_req *req)
{
	const char *ctype = http_req_header(req, "Content-Type"), *qpath = http_req_query(req, "path");
	char boundary[128], name[4096], path[4096];
	size_t len = 0, blen;
	const char *body = http_req_body(req, &len), *p, *end, *b;
	json_t *out = json_array();
	struct envd e;

	if (!envd_open(req, &e)) {
		json_decref(out);
		return;
	}
	if (!files_user(req, &e))
		goto out;
	if (ctype && !strncasecmp(ctype, "application/octet-stream", 24)) {
		if (!qpath || !envd_path(qpath, e.user, path, sizeof(path))) {
			e2b_error(req, 400, "an application/octet-stream upload needs a path");
			goto out;
		}
		if (file_put(req, &e, path, body, len)) {
			json_array_append_new(out, written_of(path));
			http_reply_json(req, 200, json_incref(out));
		}
		goto out;
	}
	b = ctype && !strncasecmp(ctype, "multipart/form-data", 19) ? strstr(ctype, "boundary=") : NULL;
	if (!b || snprintf(boundary, sizeof(boundary), "\r\n--%s", b + 9) >= (int)sizeof(boundary) ||
	    strlen(boundary) < 5) {
		e2b_error(req, 400, "the upload must be multipart/form-data with a boundary or "
				    "application/octet-stream");
		goto out;
	}
	blen = strlen(boundary);
	/* The body starts with the first delimiter (no CRLF before it). */
	if (len < blen - 2 || memcmp(body, boundary + 2, blen - 2) != 0) {
		e2b_error(req, 400, "malformed multipart body");
		goto out;
	}
	p = body + blen - 2;
	for (;;) {
		const char *hend, *data;

		if (end = body + len, end - p >= 2 && !memcmp(p, "--", 2))
			break;	/* the closing delimiter */
		if (end - p < 2 || memcmp(p, "\r\n", 2) != 0) {
			e2b_error(req, 400, "malformed multipart body");
			goto out;
		}
		p += 2;
		hend = find(p, (size_t)(end - p), "\r\n\r\n", 4);
		if (!hend) {
			e2b_error(req, 400, "malformed multipart body");
			goto out;
		}
		data = hend + 4;
		end = find(data, (size_t)(body + len - data), boundary, blen);
		if (!end) {
			e2b_error(req, 400, "malformed multipart body: no closing boundary");
			goto out;
		}
		if (!part_filename(p, (size_t)(hend - p), name, sizeof(name))) {
			e2b_error(req, 400, "a multipart part has no filename");
			goto out;
		}
		if (!envd_path(qpath && qpath[0] ? qpath : name, e.user, path, sizeof(path))) {
			e2b_error(req, 400, "invalid path");
			goto out;
		}
		if (!file_put(req, &e, path, data, (size_t)(end - data)))
			goto out;
		json_array_append_new(out, written_of(path));
		p = end + blen;
	}
	if (json_array_size(out) == 0) {
		e2b_error(req, 400, "the upload holds no file");
		goto out;
	}
	http_reply_json(req, 200, json_incref(out));
out:
	json_decref(out);
	envd_close(&e);
}

/* GET /health: 204 while the sandbox runs (502 when it does not, as E2B's proxy answers). */
static void envd_health(struct http_req *req)
{
	struct envd e;

	if (!envd_open(req, &e))
		return;
	http_reply_empty(req, 204);
	envd_close(&e);
}

/*
 * The filesystem RPCs, run in the guest as the user by Python (argv: op, path[, path2 | depth]).
 * It prints one JSON object: the RPC's answer, or {"error": <Connect code>, "message": ...}.
 */
static const char FS_PY[] =
	"import datetime,grp,json,os,pwd,shutil,stat,sys\n"
	"def nm(f,i):\n"
	" try: return f(i)[0]\n"
	" except KeyError: return str(i)\n"
	"def perm(m):\n"
	" t='d' if stat.S_ISDIR(m) else 'L' if stat.S_ISLNK(m) else '-'\n"
	" return t+''.join(c if m&(256>>i) else '-' for i,c in enumerate('rwxrwxrwx'))\n"
	"def ent(p):\n"
	" s=os.lstat(p);m=s.st_mode\n"
	" t=2 if stat.S_ISDIR(m) else 3 if stat.S_ISLNK(m) else 1\n"
	" e={'name':os.path.basename(p) or '/','type':['','FILE_TYPE_FILE','FILE_TYPE_DIRECTORY',"
	"'FILE_TYPE_SYMLINK'][t],'path':p,'size':str(s.st_size),'mode':m&0o777,'permissions':perm(m),"
	"'owner':nm(pwd.getpwuid,s.st_uid),'group':nm(grp.getgrgid,s.st_gid),'modifiedTime':"
	"datetime.datetime.fromtimestamp(s.st_mtime,datetime.timezone.utc).strftime("
	"'%Y-%m-%dT%H:%M:%S.%fZ')}\n"
	" if t==3: e['symlinkTarget']=os.path.realpath(p)\n"
	" return e\n"
	"def walk(p,d,out):\n"
	" for n in sorted(os.listdir(p)):\n"
	"  c=os.path.join(p,n);e=ent(c);out.append(e)\n"
	"  if d>1 and e['type']=='FILE_TYPE_DIRECTORY': walk(c,d-1,out)\n"
	"def run(a):\n"
	" op,p=a[0],os.path.normpath(a[1])\n"
	" if op=='stat': return {'entry':ent(p)}\n"
	" if op=='list':\n"
	"  if not os.path.isdir(p):\n"
	"   os.lstat(p); return {'error':'invalid_argument','message':'path %s is not a directory'%p}\n"
	"  out=[];walk(p,int(a[2]),out);return {'entries':out}\n"
	" if op=='mkdir':\n"
	"  if os.path.lexists(p):\n"
	"   if os.path.isdir(p): return {'error':'already_exists','message':'directory %s already exists'%p}\n"
	"   return {'error':'invalid_argument','message':'path %s exists and is not a directory'%p}\n"
	"  os.makedirs(p);return {'entry':ent(p)}\n"
	" if op=='move':\n"
	"  d=os.path.normpath(a[2]);os.lstat(p);os.makedirs(os.path.dirname(d),exist_ok=True)\n"
	"  os.rename(p,d);return {'entry':ent(d)}\n"
	" if op=='remove':\n"
	"  if os.path.isdir(p) and not os.path.islink(p): shutil.rmtree(p)\n"
	"  else: os.remove(p)\n"
	"  return {}\n"
	"try: r=run(sys.argv[1:])\n"
	"except FileNotFoundError as x: r={'error':'not_found','message':'path %s does not exist'%"
	"(x.filename or sys.argv[2])}\n"
	"except PermissionError as x: r={'error':'permission_denied','message':str(x)}\n"
	"except (NotADirectoryError,IsADirectoryError,FileExistsError,ValueError) as x: "
	"r={'error':'invalid_argument','message':str(x)}\n"
	"except OSError as x: r={'error':'internal','message':str(x)}\n"
	"print(json.dumps(r))\n";

/*
 * Opens a unary RPC: the data plane's checks (envd_open), the RPC's user and its JSON object in
 * *b. False after replying (`e` closed).
 */
static bool unary_open(struct http_req *req, struct envd *e, json_t **b)
{
	size_t len = 0;
	const char *text = http_req_body(req, &len);

	*b = NULL;
	if (!envd_open(req, e))
		return false;
	if (!rpc_user(req, e->user)) {
		rpc_error(req, "unauthenticated", "invalid user in the Authorization header");
	} else {
		*b = json_loadb(text ? text : "", len, 0, NULL);
		if (json_is_object(*b))
			return true;
		rpc_error(req, "invalid_argument", "the request must be a JSON object");
	}
	json_decref(*b);
	*b = NULL;
	envd_close(e);
	return false;
}

/*
 * Runs the filesystem operation `op` on `path` (and `arg`: a second path or a depth; NULL: none)
 * as the RPC's user and replies its answer (unary JSON) or its Connect error.
 */
static void fs_rpc(struct http_req *req, const char *op, const char *field, const char *field2)
{
	const char *out, *code;
	char path[4096], path2[4096], depth[16], url[128];
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	json_t *b = NULL, *call = NULL, *res = NULL;
	char *call_text = NULL;
	struct envd e;

	if (!unary_open(req, &e, &b))
		return;
	if (!json_is_string(json_object_get(b, field)) ||
	    !envd_path(json_string_value(json_object_get(b, field)), e.user, path, sizeof(path))) {
		rpc_error(req, "invalid_argument", "%s must be a path", field);
		goto out;
	}
	call = json_pack("{s:[s, s, s, s, s], s:s, s:i}", "cmd", "python3", "-c", FS_PY, op, path,
			 "user", e.user, "timeout_s", ENVD_FS_TIMEOUT_S);
	if (field2 && !strcmp(field2, "depth")) {
		json_int_t d = json_is_integer(json_object_get(b, "depth")) ?
				       json_integer_value(json_object_get(b, "depth")) : 1;

		if (d < 1 || d > 64) {
			rpc_error(req, "invalid_argument", "depth must be from 1 to 64");
			goto out;
		}
		snprintf(depth, sizeof(depth), "%lld", (long long)d);
		json_array_append_new(json_object_get(call, "cmd"), json_string(depth));
	} else if (field2) {
		if (!json_is_string(json_object_get(b, field2)) ||
		    !envd_path(json_string_value(json_object_get(b, field2)), e.user, path2,
			       sizeof(path2))) {
			rpc_error(req, "invalid_argument", "%s must be a path", field2);
			goto out;
		}
		json_array_append_new(json_object_get(call, "cmd"), json_string(path2));
	}
	call_text = call ? json_dumps(call, JSON_COMPACT) : NULL;
	if (!call_text) {
		rpc_error(req, "internal", "out of memory");
		goto out;
	}
	snprintf(url, sizeof(url), "/v1/sandboxes/%s/exec", e.id);
	if (inner_call(e.auth, "POST", url, NULL, call_text, strlen(call_text), ANSWER_MAX, &a,
		       &err) != KILN_OK) {
		rpc_error(req, "unavailable", "the service is unavailable; try again");
		goto out;
	}
	if (a.status == 409 || a.status == 502) {
		rpc_error(req, "unavailable", "sandbox \"%s\" is not running", e.id);
		goto out;
	}
	if (a.status == 422) {
		rpc_error(req, "unauthenticated", "user \"%s\" is not in the sandbox", e.user);
		goto out;
	}
	if (a.status != 200) {
		rpc_error(req, a.status == 429 ? "resource_exhausted" : "internal",
			  "the operation failed (status %ld)", a.status);
		goto out;
	}
	out = json_str(a.json, "stdout", "");
	res = json_loads(out, 0, NULL);
	if (!json_is_object(res) || json_int(a.json, "exit_code", 1) != 0) {
		log_warn("e2b: data plane: %s in %s failed: %.200s", op, e.id,
			 json_str(a.json, "stderr", ""));
		rpc_error(req, "internal", "the operation failed in the sandbox");
		goto out;
	}
	code = json_string_value(json_object_get(res, "error"));
	if (code)
		rpc_error(req, code, "%s", json_str(res, "message", code));
	else
		http_reply_json(req, 200, json_incref(res));
out:
	json_decref(b);
	json_decref(call);
	json_decref(res);
	free(call_text);
	answer_free(&a);
	envd_close(&e);
}

static void fs_stat(struct http_req *req) { fs_rpc(req, "stat", "path", NULL); }
static void fs_list(struct http_req *req) { fs_rpc(req, "list", "path", "depth"); }
static void fs_mkdir(struct http_req *req) { fs_rpc(req, "mkdir", "path", NULL); }
static void fs_move(struct http_req *req) { fs_rpc(req, "move", "source", "destination"); }
static void fs_remove(struct http_req *req) { fs_rpc(req, "remove", "path", NULL); }

/*
 * process.Process/Start and Connect: server-streaming Connect RPCs mapped onto the API's processes
 * (docs/sandboxes.md). Start starts a detached process (POST .../processes: its real pid, and it
 * outlives the stream: only its timeout or a signal ends it) and closes its stdin unless the call
 * asked for one; both then read its NDJSON stream (GET .../processes/{pid}/stream) from the inner
 * socket as it comes and write each line as a Connect envelope: the start event, data events (the
 * output base64, as protobuf JSON carries bytes; `pty` for a PTY), one end event, then the
 * end-of-stream envelope. Nothing is held but the line being read.
 */
#define PROC_TIMEOUT_MAX_S 3600		/* the processes API's cap on timeout_s */
#define PROC_LINE_MAX (256u << 10)	/* bytes of one NDJSON line (16 KiB of output, escaped) */
#define PROC_ERR_MAX (64u << 10)	/* bytes of an error answer of the API */

struct proc_run {
	struct pump *p;
	char auth[AUTH_HEADER_MAX + 32];
	char id[ID_MAX];
	char *call;		/* Start: the process's request, JSON; NULL for Connect */
	bool close_stdin;	/* Start without stdin: EOF at once, as envd's /dev/null */
	bool pty;		/* its output is `pty` data */
	bool replay;		/* Start: from its first output; Connect: only what comes next */
	unsigned pid;
	long status;		/* the stream's status */
	bool closed;		/* the end-of-stream envelope is written */
	bool gone;		/* the client went away */
	struct buf line;	/* the line being read */
	struct buf err;		/* a non-200 answer */
	/* WatchDir */
	struct gateway *gw;
	char tid[64];		/* the tenant its calls are signed for */
	long long deadline_ms;	/* Connect-Timeout-Ms on the monotonic clock; 0: none */
};

static void proc_free(void *arg)
{
	struct proc_run *r = arg;

	explicit_bzero(r->auth, sizeof(r->auth));
	if (r->call) {
		explicit_bzero(r->call, strlen(r->call));	/* envs may be secrets */
		free(r->call);
	}
	buf_release(&r->line);
	buf_release(&r->err);
	free(r);
}

/* The envelope of `msg` (stolen) with `flags` (0 a message, 2 the end of the stream) in `out`. */
static int envelope_of(struct buf *out, unsigned flags, json_t *msg)
{
	char *text = msg ? json_dumps(msg, JSON_COMPACT) : NULL;
	size_t n = text ? strlen(text) : 0;
	unsigned char head[5] = { (unsigned char)flags, (unsigned char)(n >> 24),
				  (unsigned char)(n >> 16), (unsigned char)(n >> 8), (unsigned char)n };
	int rc = text ? 0 : -ENOMEM;

	if (!rc)
		rc = buf_append(out, head, sizeof(head));
	if (!rc)
		rc = buf_append(out, text, n);
	json_decref(msg);
	free(text);
	return rc;
}

/* Writes the envelope of `msg` (stolen) to the stream. 0, or -1 when the client is gone. */
static int proc_frame(struct proc_run *r, unsigned flags, json_t *msg)
{
	struct buf b;
	int rc;

	buf_init(&b, PROC_LINE_MAX * 2);
	rc = envelope_of(&b, flags, msg);
	if (!rc && !r->gone && pump_write(r->p, b.data, b.len) != 0)
		r->gone = true;
	buf_release(&b);
	return rc || r->gone ? -1 : 0;
}

/* Ends the stream with Connect's error `code`. */
static void proc_fail(struct proc_run *r, const char *code, const char *msg)
{
	if (r->closed)
		return;
	r->closed = true;
	proc_frame(r, 2, json_pack("{s:{s:s, s:s}}", "error", "code", code, "message", msg));
}

/* Connect's code for an error answer of the processes API. */
static const char *proc_code(long status)
{
	return status == 422 || status == 400 ? "invalid_argument" :
	       status == 404 ? "not_found" :
	       status == 429 ? "resource_exhausted" :
	       status == 403 ? "permission_denied" :
	       status == 501 ? "unimplemented" :
	       status == 409 || status == 502 || status == 503 ? "unavailable" : "internal";
}

/* One NDJSON line of the process's stream. 0, or -1 to stop reading. */
static int proc_line(struct proc_run *r, const char *text, size_t len)
{
	json_t *d = json_loadb(text, len, 0, NULL);
	const char *type = json_str(d, "type", "");
	int rc = 0;

	if (!strcmp(type, "stdout") || !strcmp(type, "stderr")) {
		const char *s = json_string_value(json_object_get(d, "data"));
		size_t n = json_string_length(json_object_get(d, "data"));
		unsigned char *b64 = s ? malloc(4 * ((n + 2) / 3) + 1) : NULL;

		if (!b64) {
			rc = -1;
		} else {
			EVP_EncodeBlock(b64, (const unsigned char *)s, (int)n);
			rc = proc_frame(r, 0, json_pack("{s:{s:{s:s}}}", "event", "data",
						       r->pty ? "pty" : type, (char *)b64));
			free(b64);
		}
	} else if (!strcmp(type, "exit")) {
		long long code = json_int(d, "exit_code", -1), sig = json_int(d, "signal", 0);
		char status[48];
		json_t *end;

		/* envd's words (Go's ProcessState): a signal's end is exit code -1, not exited */
		if (sig)
			snprintf(status, sizeof(status), "signal: %s",
				 sig == 9 ? "killed" : sig == 15 ? "terminated" : sig == 2 ? "interrupt" : "other");
		else
			snprintf(status, sizeof(status), "exit status %lld", code);
		end = json_pack("{s:I, s:b, s:s}", "exitCode", sig ? -1LL : code, "exited", !sig,
				"status", status);
		if (end && (sig || code != 0))
			json_object_set_new(end, "error", json_string(status));
		rc = proc_frame(r, 0, json_pack("{s:{s:o}}", "event", "end", end));
		if (!rc)
			r->closed = true, rc = proc_frame(r, 2, json_object());
	} else if (!strcmp(type, "keepalive")) {
		rc = proc_frame(r, 0, json_pack("{s:{s:{}}}", "event", "keepalive"));
	} else if (!strcmp(type, "error")) {
		const json_t *e = json_object_get(d, "error");
		const char *code = json_str(e, "code", "");

		proc_fail(r, !strcmp(code, "not_found") ? "not_found" :
			     !strcmp(code, "conflict") ? "aborted" : "unavailable",
			  json_str(e, "message", "the sandbox failed"));
		rc = -1;
	}
	json_decref(d);
	return rc;
}

/* libcurl: the stream's status line. */
static size_t proc_header(char *p, size_t size, size_t n, void *arg)
{
	struct proc_run *r = arg;
	size_t len = size * n;
	long st;

	if (len > 9 && !strncmp(p, "HTTP/", 5) && strchr(p, ' ') &&
	    sscanf(strchr(p, ' '), " %ld", &st) == 1)
		r->status = st;
	return len;
}

/* libcurl: the stream as it comes, read line by line. */
static size_t proc_write(char *p, size_t size, size_t n, void *arg)
{
	struct proc_run *r = arg;
	size_t len = size * n;

	if (r->status != 200) {
		buf_append(&r->err, p, len < PROC_ERR_MAX - r->err.len ? len : 0);
		return len;
	}
	for (size_t i = 0; i < len; i++) {
		if (p[i] != '\n') {
			if (buf_append(&r->line, p + i, 1) != 0)
				return 0;	/* a line past PROC_LINE_MAX: not the API's */
			continue;
		}
		if (r->line.len && !r->closed && proc_line(r, r->line.data, r->line.len) != 0)
			return 0;
		buf_reset(&r->line);
	}
	return len;
}

/* Ends the stream after an error answer `a` of the API (its message when it says one). */
static void proc_fail_answer(struct proc_run *r, long status, const json_t *j)
{
	const char *msg = json_str(json_object_get(j, "error"), "message", "the call failed");

	proc_fail(r, proc_code(status),
		  status == 409 || status == 502 ? "the sandbox is not running" : msg);
}

/* The producer: starts the process (Start), then relays its stream, always ending the stream. */
static void proc_produce(struct pump *p, void *arg)
{
	struct proc_run *r = arg;
	struct curl_slist *h = NULL;
	struct httpc hc = { 0 };
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	char url[256];
	long status = 0;
	enum kiln_err rc;

	r->p = p;
	pump_ready(p, 200, "application/connect+json");
	if (r->call) {
		snprintf(url, sizeof(url), "/v1/sandboxes/%s/processes", r->id);
		if (inner_call(r->auth, "POST", url, NULL, r->call, strlen(r->call), PROC_ERR_MAX, &a,
			       &err) != KILN_OK) {
			proc_fail(r, "unavailable", "the service is unavailable; try again");
			goto out;
		}
		if (a.status != 201 || !json_is_integer(json_object_get(a.json, "pid"))) {
			const char *m = json_str(json_object_get(a.json, "error"), "message", "");

			/* what the guest refused (a cwd that is not a directory): envd's spawn failure */
			if (a.status == 404 && !strncmp(m, "guest:", 6))
				proc_fail(r, "invalid_argument", m);
			else
				proc_fail_answer(r, a.status == 404 ? 409 : a.status, a.json);
			goto out;
		}
		r->pid = (unsigned)json_integer_value(json_object_get(a.json, "pid"));
		answer_free(&a);
		memset(&a, 0, sizeof(a));
		if (r->close_stdin) {
			snprintf(url, sizeof(url), "/v1/sandboxes/%s/processes/%u/stdin?eof=1", r->id,
				 r->pid);
			inner_call(r->auth, "POST", url, "application/octet-stream", "", 0, PROC_ERR_MAX,
				   &a, &err);	/* a process that ended already: nothing to close */
			answer_free(&a);
			memset(&a, 0, sizeof(a));
		}
	}
	if (proc_frame(r, 0, json_pack("{s:{s:{s:I}}}", "event", "start", "pid",
				       (json_int_t)r->pid)) != 0)
		goto out;
	snprintf(url, sizeof(url), "http://kiln/v1/sandboxes/%s/processes/%u/stream?replay=%d", r->id,
		 r->pid, r->replay ? 1 : 0);
	h = curl_slist_append(h, r->auth);
	if (!h) {
		proc_fail(r, "internal", "out of memory");
		goto out;
	}
	rc = httpc_open(&hc,
			&(struct httpc_opts){ .url = url, .unix_socket = inner_sock, .timeout_ms = 0,
					      .connect_timeout_ms = 5000, .method = "GET",
					      .headers = h, .on_write = proc_write, .write_arg = r,
					      .on_header = proc_header, .header_arg = r },
			&err);
	if (rc == KILN_OK) {
		curl_easy_setopt(hc.curl, CURLOPT_NOPROXY, "*");
		rc = httpc_perform(&hc, &status, &err);
	}
	httpc_close(&hc);
	curl_slist_free_all(h);
	if (r->closed || r->gone)
		goto out;
	if (r->status == 200 || rc != KILN_OK) {
		proc_fail(r, "unavailable", r->status == 200 ? "the process's stream was cut"
							     : "the service is unavailable; try again");
	} else {
		json_t *j = json_loadb(r->err.data ? r->err.data : "", r->err.len, 0, NULL);

		proc_fail_answer(r, r->status, j);
		json_decref(j);
	}
out:
	answer_free(&a);
}

/* A stream that is only its end-of-stream envelope with Connect's error `code`. */
static void proc_refuse(struct http_req *req, const char *code, const char *msg)
{
	struct buf b;

	buf_init(&b, 64 << 10);
	if (envelope_of(&b, 2, json_pack("{s:{s:s, s:s}}", "error", "code", code, "message", msg)))
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
	else
		http_reply_data(req, 200, "application/connect+json", b.data, b.len);
	buf_release(&b);
}

/* The JSON object of a request of one uncompressed Connect envelope, or NULL. */
static json_t *envelope_body(struct http_req *req)
{
	size_t len = 0;
	const unsigned char *body = (const unsigned char *)http_req_body(req, &len);

	if (!body || len < 5 || body[0] != 0 ||
	    ((size_t)body[1] << 24 | (size_t)body[2] << 16 | (size_t)body[3] << 8 | body[4]) != len - 5)
		return NULL;
	json_t *b = json_loadb((const char *)body + 5, len - 5, 0, NULL);

	if (!json_is_object(b)) {
		json_decref(b);
		return NULL;
	}
	return b;
}

/* Starts `produce` on `r` (taken, also on failure) and streams its answer. */
static void proc_stream(struct http_req *req, struct proc_run *r, pump_fn produce)
{
	struct pump *p;

	buf_init(&r->line, PROC_LINE_MAX);
	buf_init(&r->err, PROC_ERR_MAX);
	p = pump_start(produce, r, proc_free);	/* frees r even when it did not start */
	if (!p) {
		proc_refuse(req, "resource_exhausted", "too many streams at once; try again");
		return;
	}
	pump_wait_ready(p, NULL, 0);
	http_reply_stream(req, 200, "application/connect+json", pump_read, p, pump_release);
}

/*
 * Opens a server-streaming RPC: the data plane's checks (envd_open), the RPC's user and its one
 * envelope in *b, with Connect-Timeout-Ms in *ms (0: none). False after replying (`e` closed).
 */
static bool stream_open(struct http_req *req, struct envd *e, json_t **b, long long *ms)
{
	const char *tms = http_req_header(req, "Connect-Timeout-Ms");
	char *end = NULL;

	*b = NULL;
	*ms = 0;
	if (!envd_open(req, e))
		return false;
	if (!rpc_user(req, e->user))
		proc_refuse(req, "unauthenticated", "invalid user in the Authorization header");
	else if (!(*b = envelope_body(req)))
		proc_refuse(req, "invalid_argument",
			    "the request must be one uncompressed Connect envelope of a JSON object");
	else if (tms && ((*ms = strtoll(tms, &end, 10)) <= 0 || end == tms || *end))
		proc_refuse(req, "invalid_argument", "Connect-Timeout-Ms must be a number");
	else
		return true;
	json_decref(*b);
	*b = NULL;
	envd_close(e);
	return false;
}

/*
 * POST /process.Process/Start: one envelope {process: {cmd, args, envs, cwd}, stdin, pty, tag}
 * run as the RPC's user until Connect-Timeout-Ms (at most PROC_TIMEOUT_MAX_S; none without it),
 * streamed as it runs; it outlives the stream.
 */
static void proc_start(struct http_req *req)
{
	char cwd[4096];
	struct proc_run *r = NULL;
	json_t *b = NULL, *pr, *call = NULL, *cmd, *env, *v, *pty;
	long long timeout_s = 0, ms;
	struct envd e;
	size_t i;

	if (!stream_open(req, &e, &b, &ms))
		return;
	pr = json_object_get(b, "process");
	cmd = json_array();
	json_array_append(cmd, json_object_get(pr, "cmd"));
	json_array_foreach(json_object_get(pr, "args"), i, v)
		json_array_append(cmd, v);
	env = json_object_get(pr, "envs");
	pty = json_object_get(json_object_get(b, "pty"), "size");
	if (!json_is_string(json_object_get(pr, "cmd")) || !json_string_length(json_object_get(pr, "cmd")) ||
	    (json_object_get(pr, "args") && !json_is_array(json_object_get(pr, "args"))) ||
	    (env && !json_is_object(env)) ||
	    (json_object_get(b, "pty") && !json_is_object(pty))) {
		json_decref(cmd);
		proc_refuse(req, "invalid_argument", "process.cmd must be a command, args a list, "
						     "envs an object of strings and pty {size}");
		goto out;
	}
	if (ms) {
		timeout_s = ms / 1000 + (ms % 1000 != 0);
		if (timeout_s > PROC_TIMEOUT_MAX_S)
			timeout_s = PROC_TIMEOUT_MAX_S;
	}
	call = json_pack("{s:o, s:s}", "cmd", cmd, "user", e.user);
	if (call && timeout_s)
		json_object_set_new(call, "timeout_s", json_integer(timeout_s));
	if (call && env)
		json_object_set(call, "env", env);
	if (call && json_is_string(json_object_get(b, "tag")))
		json_object_set(call, "tag", json_object_get(b, "tag"));
	if (call && pty)
		json_object_set_new(call, "pty", json_pack("{s:I, s:I}",
				    "rows", json_integer_value(json_object_get(pty, "rows")),
				    "cols", json_integer_value(json_object_get(pty, "cols"))));
	if (call && json_is_string(json_object_get(pr, "cwd"))) {
		if (!envd_path(json_string_value(json_object_get(pr, "cwd")), e.user, cwd,
			       sizeof(cwd))) {
			proc_refuse(req, "invalid_argument", "cwd must be a path");
			goto out;
		}
		json_object_set_new(call, "cwd", json_string(cwd));
	}
	r = calloc(1, sizeof(*r));
	if (!call || !r || !(r->call = json_dumps(call, JSON_COMPACT))) {
		proc_refuse(req, "internal", "out of memory");
		goto out;
	}
	memcpy(r->auth, e.auth, sizeof(r->auth));
	snprintf(r->id, sizeof(r->id), "%s", e.id);
	r->pty = pty != NULL;
	r->close_stdin = !pty && !json_is_true(json_object_get(b, "stdin"));
	r->replay = true;
	proc_stream(req, r, proc_produce);
	r = NULL;
out:
	if (r)
		proc_free(r);
	json_decref(b);
	json_decref(call);
	envd_close(&e);
}

/* The pid of a request's `process` selector; 0 (after replying `code`'s error) when it has none. */
static unsigned proc_selected(struct http_req *req, const json_t *b, bool stream)
{
	const json_t *sel = json_object_get(b, "process"), *pid = json_object_get(sel, "pid");
	const char *msg = json_object_get(sel, "tag") ? "selecting a process by tag is not supported "
							"by this server (docs/e2b.md)"
						      : "process.pid must be a pid";
	const char *code = json_object_get(sel, "tag") ? "unimplemented" : "invalid_argument";

	if (json_is_integer(pid) && json_integer_value(pid) >= 1 && json_integer_value(pid) <= 0x7fffffff)
		return (unsigned)json_integer_value(pid);
	if (stream)
		proc_refuse(req, code, msg);
	else
		rpc_error(req, code, "%s", msg);
	return 0;
}

/* POST /process.Process/Connect: {process: {pid}}: the process's output from now on, then its end. */
static void proc_connect(struct http_req *req)
{
	struct proc_run *r = NULL;
	json_t *b = NULL;
	struct envd e;
	unsigned pid;

	if (!envd_open(req, &e))
		return;
	if (!(b = envelope_body(req))) {
		proc_refuse(req, "invalid_argument",
			    "the request must be one uncompressed Connect envelope of a JSON object");
		goto out;
	}
	if (!(pid = proc_selected(req, b, true)))
		goto out;
	if (!(r = calloc(1, sizeof(*r)))) {
		proc_refuse(req, "internal", "out of memory");
		goto out;
	}
	memcpy(r->auth, e.auth, sizeof(r->auth));
	snprintf(r->id, sizeof(r->id), "%s", e.id);
	r->pid = pid;
	proc_stream(req, r, proc_produce);
out:
	json_decref(b);
	envd_close(&e);
}

/*
 * A unary process RPC: `method` `what` of process {pid} with `data` (`len` bytes of `ctype`);
 * replies {} on success, else Connect's error.
 */
static void proc_unary(struct http_req *req, const struct envd *e, unsigned pid, const char *what,
		       const char *query, const char *ctype, const char *data, size_t len)
{
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	char url[256];

	snprintf(url, sizeof(url), "/v1/sandboxes/%s/processes/%u/%s%s", e->id, pid, what, query);
	if (inner_call(e->auth, "POST", url, ctype, data, len, PROC_ERR_MAX, &a, &err) != KILN_OK)
		rpc_error(req, "unavailable", "the service is unavailable; try again");
	else if (a.status == 204)
		http_reply_json(req, 200, json_object());
	else if (a.status == 409 && strcmp(what, "resize") != 0)
		rpc_error(req, "not_found", "process %u has ended", pid);	/* kill(): false */
	else
		rpc_error(req, proc_code(a.status), "%s",
			  a.status == 404 ? "process not found" :
			  json_str(json_object_get(a.json, "error"), "message", "the call failed"));
	answer_free(&a);
}

/* The JSON body of a unary RPC, or NULL after replying invalid_argument. */
static json_t *unary_body(struct http_req *req)
{
	size_t len = 0;
	const char *text = http_req_body(req, &len);
	json_t *b = json_loadb(text ? text : "", len, 0, NULL);

	if (!json_is_object(b)) {
		json_decref(b);
		rpc_error(req, "invalid_argument", "the request must be a JSON object");
		return NULL;
	}
	return b;
}

/* POST /process.Process/SendInput {process: {pid}, input: {stdin|pty: base64}}. */
static void proc_input(struct http_req *req)
{
	json_t *b = NULL, *in;
	const char *s;
	unsigned char *dec = NULL;
	struct envd e;
	unsigned pid;
	int n;

	if (!envd_open(req, &e))
		return;
	if (!(b = unary_body(req)) || !(pid = proc_selected(req, b, false)))
		goto out;
	in = json_object_get(b, "input");
	s = json_string_value(json_object_get(in, "stdin"));
	if (!s)
		s = json_string_value(json_object_get(in, "pty"));
	if (!s || strlen(s) % 4 || strlen(s) > 4 * ((1u << 20) / 3)) {
		rpc_error(req, "invalid_argument", "input must be {stdin} or {pty}: base64, at most 1 MiB");
		goto out;
	}
	if (!(dec = malloc(strlen(s) / 4 * 3 + 1))) {
		rpc_error(req, "internal", "out of memory");
		goto out;
	}
	n = EVP_DecodeBlock(dec, (const unsigned char *)s, (int)strlen(s));
	if (n < 0) {
		rpc_error(req, "invalid_argument", "input is not base64");
		goto out;
	}
	for (size_t k = strlen(s); k > 0 && s[k - 1] == '=' && n > 0; k--)
		n--;	/* EVP_DecodeBlock counts padding as bytes */
	proc_unary(req, &e, pid, "stdin", "", "application/octet-stream", (const char *)dec,
		   (size_t)n);
out:
	free(dec);
	json_decref(b);
	envd_close(&e);
}

/* POST /process.Process/CloseStdin {process: {pid}}. */
static void proc_close_stdin(struct http_req *req)
{
	json_t *b = NULL;
	struct envd e;
	unsigned pid;

	if (!envd_open(req, &e))
		return;
	if ((b = unary_body(req)) && (pid = proc_selected(req, b, false)))
		proc_unary(req, &e, pid, "stdin", "?eof=1", "application/octet-stream", "", 0);
	json_decref(b);
	envd_close(&e);
}

/* POST /process.Process/SendSignal {process: {pid}, signal: "SIGNAL_SIGKILL"|"SIGNAL_SIGTERM"}. */
static void proc_signal(struct http_req *req)
{
	json_t *b = NULL;
	const char *sig;
	char body[32];
	struct envd e;
	unsigned pid;

	if (!envd_open(req, &e))
		return;
	if (!(b = unary_body(req)) || !(pid = proc_selected(req, b, false)))
		goto out;
	sig = json_str(b, "signal", "");
	if (strcmp(sig, "SIGNAL_SIGKILL") && strcmp(sig, "SIGNAL_SIGTERM") && strcmp(sig, "9") &&
	    strcmp(sig, "15") && json_integer_value(json_object_get(b, "signal")) != 9 &&
	    json_integer_value(json_object_get(b, "signal")) != 15) {
		rpc_error(req, "invalid_argument", "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM");
		goto out;
	}
	snprintf(body, sizeof(body), "{\"signal\":%d}",
		 strstr(sig, "KILL") || !strcmp(sig, "9") ||
				 json_integer_value(json_object_get(b, "signal")) == 9 ? 9 : 15);
	proc_unary(req, &e, pid, "signal", "", NULL, body, strlen(body));
out:
	json_decref(b);
	envd_close(&e);
}

/* POST /process.Process/Update {process: {pid}, pty: {size: {cols, rows}}}: a PTY's resize. */
static void proc_update(struct http_req *req)
{
	json_t *b = NULL, *size;
	char body[64];
	struct envd e;
	unsigned pid;

	if (!envd_open(req, &e))
		return;
	if (!(b = unary_body(req)) || !(pid = proc_selected(req, b, false)))
		goto out;
	size = json_object_get(json_object_get(b, "pty"), "size");
	if (!json_is_integer(json_object_get(size, "rows")) || !json_is_integer(json_object_get(size, "cols"))) {
		rpc_error(req, "invalid_argument", "pty.size must be {cols, rows}");
		goto out;
	}
	snprintf(body, sizeof(body), "{\"rows\":%lld,\"cols\":%lld}",
		 (long long)json_integer_value(json_object_get(size, "rows")),
		 (long long)json_integer_value(json_object_get(size, "cols")));
	proc_unary(req, &e, pid, "resize", "", NULL, body, strlen(body));
out:
	json_decref(b);
	envd_close(&e);
}

/* POST /process.Process/List {}: the running processes, E2B's ProcessInfo (config always set). */
static void proc_list(struct http_req *req)
{
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	json_t *out = NULL, *arr, *pr;
	char url[160];
	struct envd e;
	size_t i;

	if (!envd_open(req, &e))
		return;
	snprintf(url, sizeof(url), "/v1/sandboxes/%s/processes", e.id);
	if (inner_call(e.auth, "GET", url, NULL, NULL, 0, ANSWER_MAX, &a, &err) != KILN_OK) {
		rpc_error(req, "unavailable", "the service is unavailable; try again");
		goto out;
	}
	if (a.status != 200) {
		rpc_error(req, proc_code(a.status), "%s",
			  json_str(json_object_get(a.json, "error"), "message", "the call failed"));
		goto out;
	}
	arr = json_array();
	json_array_foreach(json_object_get(a.json, "processes"), i, pr) {
		const json_t *argv = json_object_get(pr, "argv");
		json_t *args = json_array(), *envs = json_object(), *v, *info;
		size_t k;

		if (!json_is_true(json_object_get(pr, "running")) || !json_is_string(json_array_get(argv, 0)) ||
		    !json_is_string(json_object_get(pr, "cwd")))
			continue;
		json_array_foreach(argv, k, v)
			if (k > 0)
				json_array_append(args, v);
		/* the guest keeps only the names of a process's env: E2B's envs show them empty */
		json_array_foreach(json_object_get(pr, "env"), k, v)
			if (json_is_string(v))
				json_object_set_new(envs, json_string_value(v), json_string(""));
		info = json_pack("{s:{s:O, s:o, s:o, s:O}, s:O}", "config", "cmd",
				 json_array_get(argv, 0), "args", args, "envs", envs, "cwd",
				 json_object_get(pr, "cwd"),
				 "pid", json_object_get(pr, "pid"));
		if (info && json_string_length(json_object_get(pr, "tag")))
			json_object_set(info, "tag", json_object_get(pr, "tag"));
		if (info)
			json_array_append_new(arr, info);
	}
	out = json_pack("{s:o}", "processes", arr);
	http_reply_json(req, 200, out);
out:
	answer_free(&a);
	envd_close(&e);
}

/*
 * filesystem.Filesystem/WatchDir (server-streaming) and the polling watchers (CreateWatcher,
 * GetWatcherEvents, RemoveWatcher), on the API's directory watches (docs/sandboxes.md: inotify in
 * the guest, as the user). WatchDir adds a watch, sends the start event, then reads the watch with
 * waits of WATCH_POLL_MS, writing each event as it comes (a keepalive after an empty wait, which
 * finds a client gone) until the client leaves, Connect-Timeout-Ms passes, the directory goes
 * away or events were lost; the watch is removed at the end. The calls are signed anew each time,
 * as a stream may outlive one token.
 */
#define WATCH_POLL_MS 10000		/* the wait of one read of a watch */
#define WATCH_ANSWER_MAX (4u << 20)	/* bytes of a read's answer (256 events of 4 KiB names) */

/* envd's EventType of the API's event type. */
static const char *watch_type(const char *t)
{
	return !strcmp(t, "create") ? "EVENT_TYPE_CREATE" : !strcmp(t, "write") ? "EVENT_TYPE_WRITE" :
	       !strcmp(t, "remove") ? "EVENT_TYPE_REMOVE" : !strcmp(t, "rename") ? "EVENT_TYPE_RENAME" :
	       !strcmp(t, "chmod") ? "EVENT_TYPE_CHMOD" : "EVENT_TYPE_UNSPECIFIED";
}

/* Connect's code and message for an error answer `a` of the watches API. */
static const char *watch_code(const struct answer *a, const char **msg)
{
	const char *m = json_str(json_object_get(a->json, "error"), "message", "the call failed");

	*msg = m;
	/* a node of the previous release (a rolling upgrade) has no watches route */
	if (a->status == 404 && !strcmp(m, "no such route")) {
		*msg = "the sandbox's node predates directory watches";
		return "unimplemented";
	}
	/* a 404 the guest said (a missing directory, a watch that ended) is the watch's; any other
	   404 is the sandbox's: gone */
	if (a->status == 404 && strncmp(m, "guest:", 6)) {
		*msg = "the sandbox is not running";
		return "unavailable";
	}
	if (a->status == 409 || a->status == 502)
		*msg = "the sandbox is not running";
	return proc_code(a->status);
}

static void watch_produce(struct pump *p, void *arg)
{
	struct proc_run *r = arg;
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	const char *msg;
	char url[256];
	json_int_t wid = 0;

	r->p = p;
	pump_ready(p, 200, "application/connect+json");
	snprintf(url, sizeof(url), "/v1/sandboxes/%s/watches", r->id);
	if (inner_call(r->auth, "POST", url, NULL, r->call, strlen(r->call), PROC_ERR_MAX, &a,
		       &err) != KILN_OK) {
		proc_fail(r, "unavailable", "the service is unavailable; try again");
		goto out;
	}
	if (a.status != 201 || (wid = json_int(a.json, "id", 0)) <= 0) {
		const char *code = watch_code(&a, &msg);

		proc_fail(r, code, msg);
		goto out;
	}
	/* WatchDirResponse's oneof is its own: {"start":{}}, not under an `event` field */
	if (proc_frame(r, 0, json_pack("{s:{}}", "start")) != 0)
		goto out;
	while (!r->closed && !r->gone) {
		long long left = r->deadline_ms ? r->deadline_ms - clock_mono_ms() : WATCH_POLL_MS;
		const json_t *ev;
		size_t i;

		if (left <= 0) {
			proc_fail(r, "deadline_exceeded", "the watch's Connect-Timeout-Ms passed");
			break;
		}
		answer_free(&a);
		memset(&a, 0, sizeof(a));
		snprintf(url, sizeof(url), "/v1/sandboxes/%s/watches/%lld?wait_ms=%lld", r->id,
			 (long long)wid, left < WATCH_POLL_MS ? left : WATCH_POLL_MS);
		if (!envd_sign(r->gw, r->tid, r->auth, sizeof(r->auth)) ||
		    inner_call(r->auth, "GET", url, NULL, NULL, 0, WATCH_ANSWER_MAX, &a, &err) != KILN_OK) {
			proc_fail(r, "unavailable", "the service is unavailable; try again");
			break;
		}
		if (a.status != 200) {
			const char *code = watch_code(&a, &msg);

			proc_fail(r, code, msg);
			break;
		}
		json_array_foreach(json_object_get(a.json, "events"), i, ev)
			if (proc_frame(r, 0, json_pack("{s:{s:s, s:s}}", "filesystem", "name",
						       json_str(ev, "name", ""), "type",
						       watch_type(json_str(ev, "type", "")))) != 0)
				break;
		if (!json_array_size(json_object_get(a.json, "events")) &&
		    proc_frame(r, 0, json_pack("{s:{}}", "keepalive")) != 0)
			break;
		if (json_is_true(json_object_get(a.json, "dropped")))
			proc_fail(r, "resource_exhausted", "the sandbox queued more events than it "
							   "keeps (4096) and dropped some: watch again");
		else if (json_is_true(json_object_get(a.json, "ended")) && !r->gone)
			r->closed = true, proc_frame(r, 2, json_object());	/* the directory is gone */
	}
	if (wid > 0 && envd_sign(r->gw, r->tid, r->auth, sizeof(r->auth))) {
		answer_free(&a);
		memset(&a, 0, sizeof(a));
		snprintf(url, sizeof(url), "/v1/sandboxes/%s/watches/%lld", r->id, (long long)wid);
		inner_call(r->auth, "DELETE", url, NULL, NULL, 0, PROC_ERR_MAX, &a, &err);
	}
out:
	answer_free(&a);
}

/* The API's request for a watch of the RPC's {path, recursive}; NULL after replying. */
static char *watch_call(struct http_req *req, const struct envd *e, const json_t *b, bool stream)
{
	char path[4096], *text = NULL;
	json_t *call;

	if (!json_is_string(json_object_get(b, "path")) ||
	    !envd_path(json_string_value(json_object_get(b, "path")), e->user, path, sizeof(path))) {
		if (stream)
			proc_refuse(req, "invalid_argument", "path must be a path");
		else
			rpc_error(req, "invalid_argument", "path must be a path");
		return NULL;
	}
	call = json_pack("{s:s, s:b, s:s}", "path", path, "recursive",
			 json_is_true(json_object_get(b, "recursive")), "user", e->user);
	if (!call || !(text = json_dumps(call, JSON_COMPACT))) {
		if (stream)
			proc_refuse(req, "internal", "out of memory");
		else
			rpc_error(req, "internal", "out of memory");
	}
	json_decref(call);
	return text;
}

/* POST /filesystem.Filesystem/WatchDir: {path, recursive} as the RPC's user, streamed. */
static void fs_watch(struct http_req *req)
{
	struct proc_run *r = NULL;
	json_t *b = NULL;
	struct envd e;
	long long ms;

	if (!stream_open(req, &e, &b, &ms))
		return;
	if (!(r = calloc(1, sizeof(*r)))) {
		proc_refuse(req, "internal", "out of memory");
		goto out;
	}
	if (!(r->call = watch_call(req, &e, b, true))) {
		free(r);
		goto out;
	}
	memcpy(r->auth, e.auth, sizeof(r->auth));
	snprintf(r->id, sizeof(r->id), "%s", e.id);
	snprintf(r->tid, sizeof(r->tid), "%s", e.tid);
	r->gw = http_req_app(req);
	r->deadline_ms = ms ? clock_mono_ms() + ms : 0;
	proc_stream(req, r, watch_produce);
out:
	json_decref(b);
	envd_close(&e);
}

/* The watch of a polling RPC's {watcherId}; 0 after replying. */
static long long watcher_of(struct http_req *req, const json_t *b)
{
	const char *s = json_string_value(json_object_get(b, "watcherId"));
	char *end = NULL;
	long long v = s && s[0] >= '1' && s[0] <= '9' && strlen(s) <= 10 ? strtoll(s, &end, 10) : 0;

	if (v <= 0 || *end || v > 0xffffffffLL) {
		rpc_error(req, "invalid_argument", "watcherId must be a watcher's id");
		return 0;
	}
	return v;
}

/*
 * CreateWatcher {path, recursive}, GetWatcherEvents {watcherId}, RemoveWatcher {watcherId}: a
 * watch the client polls (the guest ends it after a minute without a poll).
 */
static void fs_watcher(struct http_req *req, const char *op)
{
	const char *msg;
	struct kiln_error err = { 0 };
	struct answer a = { 0 };
	json_t *b = NULL, *events = NULL, *ev;
	char url[256], *call = NULL;
	long long wid = 0;
	struct envd e;
	size_t i;

	if (!unary_open(req, &e, &b))
		return;
	if (!strcmp(op, "create") ? !(call = watch_call(req, &e, b, false)) : !(wid = watcher_of(req, b)))
		goto out;
	if (call)
		snprintf(url, sizeof(url), "/v1/sandboxes/%s/watches", e.id);
	else
		snprintf(url, sizeof(url), "/v1/sandboxes/%s/watches/%lld%s", e.id, wid,
			 !strcmp(op, "read") ? "?wait_ms=0" : "");
	if (inner_call(e.auth, call ? "POST" : !strcmp(op, "read") ? "GET" : "DELETE", url, NULL, call,
		       call ? strlen(call) : 0, WATCH_ANSWER_MAX, &a, &err) != KILN_OK) {
		rpc_error(req, "unavailable", "the service is unavailable; try again");
		goto out;
	}
	if (a.status >= 300) {
		const char *code = watch_code(&a, &msg);

		rpc_error(req, code, "%s", msg);
	} else if (call) {
		char id[24];

		snprintf(id, sizeof(id), "%lld", (long long)json_int(a.json, "id", 0));
		http_reply_json(req, 200, json_pack("{s:s}", "watcherId", id));
	} else if (!strcmp(op, "read")) {
		if (json_is_true(json_object_get(a.json, "dropped"))) {
			rpc_error(req, "resource_exhausted", "the sandbox queued more events than it "
							     "keeps (4096) and dropped some: watch again");
			goto out;
		}
		events = json_array();
		json_array_foreach(json_object_get(a.json, "events"), i, ev)
			json_array_append_new(events, json_pack("{s:s, s:s}", "name",
								json_str(ev, "name", ""), "type",
								watch_type(json_str(ev, "type", ""))));
		http_reply_json(req, 200, json_pack("{s:o}", "events", events));
	} else {
		http_reply_json(req, 200, json_object());
	}
out:
	free(call);
	json_decref(b);
	answer_free(&a);
	envd_close(&e);
}

static void fs_watcher_create(struct http_req *req) { fs_watcher(req, "create"); }
static void fs_watcher_events(struct http_req *req) { fs_watcher(req, "read"); }
static void fs_watcher_remove(struct http_req *req) { fs_watcher(req, "remove"); }

/* An RPC of envd's this server does not serve yet: Connect's `unimplemented`. */
static void envd_unimplemented(struct http_req *req)
{
	struct envd e;

	if (!envd_open(req, &e))
		return;
	rpc_error(req, "unimplemented", "%s is not supported by this server yet (docs/e2b.md)",
		  http_req_path(req));
	envd_close(&e);
}

/* A path envd does not serve, on port 49983. */
static void envd_no_route(struct http_req *req)
{
	e2b_error(req, 404, "no route %s %s on envd (port 49983)", http_req_method(req),
		  http_req_path(req));
}

static const struct http_route envd_routes[] = {
	{ "GET", "/health", envd_health, 0, 0, NULL, 0 },
	{ "GET", "/files", envd_files_get, 0, 0, NULL, 0 },
	{ "POST", "/files", envd_files_post, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/Stat", fs_stat, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/ListDir", fs_list, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/MakeDir", fs_mkdir, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/Move", fs_move, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/Remove", fs_remove, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/WatchDir", fs_watch, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/CreateWatcher", fs_watcher_create, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/GetWatcherEvents", fs_watcher_events, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/RemoveWatcher", fs_watcher_remove, 0, 0, NULL, 0 },
	{ "POST", "/filesystem.Filesystem/{method}", envd_unimplemented, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/Start", proc_start, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/Connect", proc_connect, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/List", proc_list, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/SendInput", proc_input, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/SendSignal", proc_signal, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/CloseStdin", proc_close_stdin, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/Update", proc_update, 0, 0, NULL, 0 },
	{ "POST", "/process.Process/{method}", envd_unimplemented, 0, 0, NULL, 0 },
	/* any other path or method: a guest port's (e2b_port_before), else no such envd route */
	{ "*", "*", envd_no_route, 0, 0, NULL, 0 },
};

static void e2b_unmapped(struct http_req *req)
{
	e2b_error(req, 501, "%s %s is not supported by this server yet (docs/e2b.md)",
		  http_req_method(req), http_req_path(req));
}

static const struct http_route routes[] = {
	{ "POST", "/v2/sandboxes", e2b_create, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes", e2b_create, 0, 0, NULL, 0 },
	{ "GET", "/v2/sandboxes", e2b_list, 0, 0, NULL, 0 },
	{ "GET", "/sandboxes", e2b_list_legacy, 0, 0, NULL, 0 },
	{ "GET", "/sandboxes/{sandboxID}", e2b_get, 0, 0, NULL, 0 },
	{ "DELETE", "/sandboxes/{sandboxID}", e2b_kill, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/timeout", e2b_timeout, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/pause", e2b_pause, 0, 0, NULL, 0 },
	{ "POST", "/v2/sandboxes/{sandboxID}/connect", e2b_connect, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/connect", e2b_connect, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/resume", e2b_resume, 0, 0, NULL, 0 },
	{ "GET", "/sandboxes/{sandboxID}/metrics", e2b_metrics, 0, 0, NULL, 0 },
	{ "PUT", "/sandboxes/{sandboxID}/network", e2b_network, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/snapshots", e2b_snapshot_create, 0, 0, NULL, 0 },
	{ "GET", "/snapshots", e2b_snapshot_list, 0, 0, NULL, 0 },
	{ "DELETE", "/templates/{templateID}", e2b_snapshot_delete, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/fork", e2b_unmapped, 0, 0, NULL, 0 },
	{ "POST", "/sandboxes/{sandboxID}/refreshes", e2b_unmapped, 0, 0, NULL, 0 },
	{ "GET", "/v2/sandboxes/{sandboxID}/logs", e2b_unmapped, 0, 0, NULL, 0 },
	{ "GET", "/sandboxes/{sandboxID}/logs", e2b_unmapped, 0, 0, NULL, 0 },
	{ "GET", "/sandboxes/metrics", e2b_unmapped, 0, 0, NULL, 0 },
};

/* One of the facade's public listeners at `listen`: the API's limits (`api`), E2B's error shape. */
static struct http_server *facade_start(const struct http_server_opts *api, const char *listen,
					const struct http_route *table, size_t nroutes,
					http_before_hook before, struct gateway *gw,
					struct kiln_error *err)
{
	return http_server_start(
		&(struct http_server_opts){
			.listen = listen,
			.max_connections = api->max_connections,
			.body_max = api->body_max,
			.timeout_s = api->timeout_s,
			.max_per_addr = api->max_per_addr,
			.header_timeout_s = api->header_timeout_s,
			.body_min_rate = api->body_min_rate,
			.trusted_proxies = api->trusted_proxies,
			.routes = table,
			.nroutes = nroutes,
			.before = before,
			.app = gw,
			.flat_errors = true,
		},
		err);
}

enum kiln_err e2b_start(struct gateway *gw, const struct http_server_opts *api,
			struct kiln_error *err)
{
	const char *listen = gw->cfg.e2b_listen, *dp = gw->cfg.e2b_sandbox_listen;
	struct http_server_opts inner = *api;
	enum kiln_err rc;

	if ((!listen || !listen[0]) && (!dp || !dp[0]))
		return KILN_OK;
	rc = auth_master_derive(&gw->mk, "e2b-envd-token", token_key, sizeof(token_key), err);
	if (rc != KILN_OK)
		return rc;
	snprintf(inner_dir, sizeof(inner_dir), "/tmp/kiln-gateway-e2b.XXXXXX");
	if (!mkdtemp(inner_dir)) {
		inner_dir[0] = '\0';
		return kiln_error_set(err, KILN_E_IO, "cannot make a directory in /tmp: %s",
				      strerror(errno));
	}
	snprintf(inner_sock, sizeof(inner_sock), "%s/api.sock", inner_dir);
	/* Only this process can reach it (the directory is 0700); no address to count by. */
	inner.listen = NULL;
	inner.unix_path = inner_sock;
	inner.max_per_addr = 0;
	inner.header_timeout_s = 0;
	inner.body_min_rate = 0;
	inner.trusted_proxies = NULL;
	inner_http = http_server_start(&inner, err);
	if (!inner_http)
		goto fail;
	if (listen && listen[0]) {
		e2b_http = facade_start(api, listen, routes, sizeof(routes) / sizeof(routes[0]), NULL,
					gw, err);
		if (!e2b_http)
			goto fail;
		log_info("E2B API listening on \"%s\"", listen);
	}
	if (dp && dp[0]) {
		envd_http = facade_start(api, dp, envd_routes,
					 sizeof(envd_routes) / sizeof(envd_routes[0]),
					 e2b_port_before, gw, err);
		if (!envd_http)
			goto fail;
		log_info("E2B sandbox data plane listening on \"%s\"", dp);
		/* getHost(port) of the SDK: {port}-{id}.{domain}, which the data plane routes too */
		if (gw->cfg.ports_domain && gw->cfg.ports_domain[0])
			snprintf(dp_domain, sizeof(dp_domain), "%s:%u", gw->cfg.ports_domain,
				 http_server_port(envd_http));
	}
	return KILN_OK;
fail:
	e2b_stop(0);
	return err->code ? err->code : KILN_E_INTERNAL;
}

void e2b_stop(unsigned grace_s)
{
	http_server_stop(envd_http, grace_s);
	envd_http = NULL;
	dp_domain[0] = '\0';
	http_server_stop(e2b_http, grace_s);
	e2b_http = NULL;
	http_server_stop(inner_http, grace_s);
	inner_http = NULL;
	if (inner_dir[0]) {
		unlink(inner_sock);
		rmdir(inner_dir);
		inner_dir[0] = '\0';
	}
	explicit_bzero(token_key, sizeof(token_key));
}
