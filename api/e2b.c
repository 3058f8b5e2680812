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
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "auth/crypto.h"
#include "common/buf.h"
#include "common/httpc.h"
#include "common/log.h"

#define KEY_MAX 512			/* bytes of an X-API-Key we pass on */
#define ID_MAX 64			/* bytes of a sandbox or snapshot id */
#define ANSWER_MAX (8u << 20)		/* bytes of one answer of the API */
#define CALL_TIMEOUT_MS (900L * 1000)	/* a create may boot a VM: the API bounds it itself */
#define LIST_LEGACY_PAGES 100		/* pages of 100 the legacy list reads at most */
#define DEFAULT_TIMEOUT_S 300		/* E2B's default sandbox timeout */
#define DENY_ALL_RULE "deny-all.invalid"	/* an allow list that matches nothing (RFC 6761) */

static struct http_server *e2b_http;
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

static void e2b_not_found(struct http_req *req, const char *id)
{
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
 * Calls the API: `method` `path` with the JSON `body` (NULL: none) as the caller (its X-API-Key).
 * True with `a` filled once the API answered, whatever its status; false after replying (401 for
 * no key, 503 when the API could not be reached).
 */
static bool api_call(struct http_req *req, const char *method, const char *path, json_t *body,
		     struct answer *a)
{
	const char *key = http_req_header(req, "X-API-Key");
	char auth[KEY_MAX + 32], url[2048 + 16];
	struct curl_slist *h = NULL;
	struct kiln_error err = { 0 };
	struct httpc hc = { 0 };
	char *text = NULL;
	bool ok = false;
	enum kiln_err rc;

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
	snprintf(url, sizeof(url), "http://kiln%s", path);
	snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key);
	h = curl_slist_append(h, auth);
	if (h && body)
		h = curl_slist_append(h, "Content-Type: application/json");
	if (body)
		text = json_dumps(body, JSON_COMPACT);
	if (!h || (body && !text)) {
		e2b_error(req, 500, "out of memory");
		goto out;
	}
	rc = httpc_open(&hc,
			&(struct httpc_opts){ .url = url, .unix_socket = inner_sock,
					      .timeout_ms = CALL_TIMEOUT_MS,
					      .connect_timeout_ms = 5000, .body = &a->body,
					      .method = method, .post_data = text,
					      .post_len = text ? strlen(text) : 0, .headers = h,
					      .on_header = on_header, .header_arg = a },
			&err);
	if (rc == KILN_OK)
		curl_easy_setopt(hc.curl, CURLOPT_NOPROXY, "*");	/* our own socket, never a proxy */
	if (rc == KILN_OK && body && strcmp(method, "POST") != 0) {
		curl_easy_setopt(hc.curl, CURLOPT_POSTFIELDS, text);
		curl_easy_setopt(hc.curl, CURLOPT_POSTFIELDSIZE, (long)strlen(text));
	}
	if (rc == KILN_OK)
		rc = httpc_perform(&hc, &a->status, &err);
	if (rc != KILN_OK) {
		log_warn("e2b: the API did not answer %s %s: %s", method, path, err.msg);
		e2b_error(req, 503, "the service is unavailable; try again");
		goto out;
	}
	a->json = a->body.len ? json_loadb(a->body.data, a->body.len, 0, NULL) : NULL;
	ok = true;
out:
	httpc_close(&hc);
	curl_slist_free_all(h);
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

/* A path parameter that is an id of ours ([A-Za-z0-9_-], 1..ID_MAX-1 bytes), else NULL. */
static const char *param_id(struct http_req *req, const char *name)
{
	const char *id = http_req_param(req, name);
	size_t n = id ? strlen(id) : 0;

	if (n == 0 || n >= ID_MAX)
		return NULL;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)id[i]) && id[i] != '_' && id[i] != '-')
			return NULL;
	return id;
}

/* ---- shapes ---- */

/*
 * The envdAccessToken of sandbox `id`: E2B_TOKEN_HEX hex characters of HMAC-SHA-256 of the id
 * under a key derived from the master key ("e2b-envd-token"): the same across pause and resume,
 * and any process with the master key (the data plane) can check it without a lookup.
 */
static void token_of(const char *id, char out[E2B_TOKEN_HEX + 1])
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

	token_of(id, token);
	return json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:n, s:n}", "sandboxID", id, "templateID",
			 json_str(sb, "template", "python"), "alias", json_str(sb, "template", "python"),
			 "clientID", "kiln", "envdVersion", E2B_ENVD_VERSION, "envdAccessToken", token,
			 "trafficAccessToken", "domain");
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

/*
 * Kiln's egress rules for E2B's `allow_internet_access` and `network` (either NULL): *rules is
 * a new array (empty: open) or NULL when neither names egress. Kiln's rules are an allow list, so
 * `denyOut` maps only as "everything" (0.0.0.0/0, ::/0) with `allowOut` the exceptions; what has
 * no Kiln equivalent is refused (400 replied, false).
 */
static bool egress_of(struct http_req *req, const json_t *internet, const json_t *net,
		      json_t **rules)
{
	const json_t *allow = json_object_get(net, "allowOut"), *deny = json_object_get(net, "denyOut");
	static const char *const unmapped[] = { "rules", "egressProxy", "maskRequestHost",
						"httpsPorts", NULL };
	bool closed;
	size_t i;
	json_t *e;

	*rules = NULL;
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
	json_t *b = e2b_body(req), *kb = NULL, *rules = NULL, *v;
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
		       &rules))
		goto out;
	kb = json_pack("{s:I}", "timeout_s", (json_int_t)timeout);
	if (!strcmp(tmpl, "base") || !strcmp(tmpl, "python")) {
		json_object_set_new(kb, "template", json_string("python"));
	} else if (!strncmp(tmpl, "snap_", 5)) {
		json_object_set_new(kb, "snapshot_id", json_string(tmpl));
	} else if (!strcmp(tmpl, "code-interpreter-v1")) {
		e2b_error(req, 400, "template \"code-interpreter-v1\" (E2B's code interpreter) is not "
				    "available on this server yet; use \"base\"");
		goto out;
	} else {
		e2b_error(req, 404, "template \"%s\" not found: this server has \"base\" and the "
				    "tenant's snapshots", tmpl);
		goto out;
	}
	if ((v = json_object_get(b, "metadata")) && !json_is_null(v))
		json_object_set(kb, "metadata", v);
	if ((v = json_object_get(b, "envVars")) && !json_is_null(v))
		json_object_set(kb, "env", v);
	if (rules && json_array_size(rules))
		json_object_set_new(kb, "egress", json_pack("{s:O}", "rules", rules));
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
	json_decref(kb);
	json_decref(b);
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
	if (a.status == 204 || a.status == 200)
		http_reply_empty(req, 204);
	else if (a.status == 404)
		e2b_not_found(req, id);
	else
		reply_api_error(req, &a);
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
	if (p.status >= 200 && p.status < 300)
		http_reply_empty(req, 204);
	else if (p.status == 404)
		e2b_not_found(req, id);
	else
		reply_api_error(req, &p);
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
static bool list_page(struct http_req *req, const char *state, const json_t *meta, int limit,
		      const char *cursor, struct answer *a)
{
	char path[4096] = "/v1/sandboxes", lim[16], *mt = NULL;
	bool ok;

	snprintf(lim, sizeof(lim), "%d", limit);
	mt = meta && json_object_size(meta) ? json_dumps(meta, JSON_COMPACT) : NULL;
	ok = query_add(path, sizeof(path), "state", state) &&
	     query_add(path, sizeof(path), "limit", lim) &&
	     (!cursor || query_add(path, sizeof(path), "cursor", cursor)) &&
	     (!mt || query_add(path, sizeof(path), "metadata", mt));
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

/* GET /v2/sandboxes?state=&metadata=&limit=&nextToken= (X-Next-Token when there is more) */
static void e2b_list(struct http_req *req)
{
	const char *lq = http_req_query(req, "limit"), *mq = http_req_query(req, "metadata");
	const char *tmpl = http_req_query(req, "template"), *next;
	json_t *meta = NULL, *out = json_array(), *e;
	struct answer a = { 0 };
	char states[64], *end = NULL;
	long limit = 100;
	size_t i;

	if (lq) {
		limit = strtol(lq, &end, 10);
		if (!lq[0] || *end || limit < 1 || limit > 100) {
			e2b_error(req, 400, "limit must be a whole number from 1 to 100");
			goto out;
		}
	}
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
	if (tmpl && strcmp(tmpl, "base") != 0 && strcmp(tmpl, "python") != 0) {
		http_reply_json(req, 200, out);	/* no sandbox of another template exists */
		out = NULL;
		goto out;
	}
	if (!list_page(req, states, meta, (int)limit, http_req_query(req, "nextToken"), &a))
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

		if (!list_page(req, "creating,running", meta, 100, cursor, &a)) {
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

/* PUT /sandboxes/{sandboxID}/network: replaces the egress rules (the API's PUT .../egress). */
static void e2b_network(struct http_req *req)
{
	const char *id = param_id(req, "sandboxID");
	json_t *b = e2b_body(req), *rules = NULL, *kb = NULL;
	struct answer a = { 0 };
	char path[128];

	if (!b)
		return;
	if (!id) {
		e2b_not_found(req, http_req_param(req, "sandboxID"));
		goto out;
	}
	if (!egress_of(req, json_object_get(b, "allow_internet_access"), b, &rules))
		goto out;
	kb = json_pack("{s:o}", "rules", rules ? rules : json_array());
	rules = NULL;
	snprintf(path, sizeof(path), "/v1/sandboxes/%s/egress", id);
	if (!api_call(req, "PUT", path, kb, &a))
		goto out;
	if (a.status >= 200 && a.status < 300)
		http_reply_empty(req, 204);
	else if (a.status == 404)
		e2b_not_found(req, id);
	else
		reply_api_error(req, &a);
out:
	answer_free(&a);
	json_decref(kb);
	json_decref(rules);
	json_decref(b);
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
	const char *sid = http_req_query(req, "sandboxID"), *lq = http_req_query(req, "limit");
	const char *cursor = http_req_query(req, "nextToken"), *next;
	char path[1024] = "/v1/snapshots", *end = NULL;
	json_t *out = json_array(), *e, *items;
	struct answer a = { 0 };
	long limit = 100;
	size_t i;

	if (lq) {
		limit = strtol(lq, &end, 10);
		if (!lq[0] || *end || limit < 1 || limit > 100) {
			e2b_error(req, 400, "limit must be a whole number from 1 to 100");
			goto out;
		}
	}
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

enum kiln_err e2b_start(struct gateway *gw, const struct http_server_opts *api,
			struct kiln_error *err)
{
	const char *listen = gw->cfg.e2b_listen;
	struct http_server_opts inner = *api;
	enum kiln_err rc;

	if (!listen || !listen[0])
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
	e2b_http = http_server_start(
		&(struct http_server_opts){
			.listen = listen,
			.max_connections = api->max_connections,
			.body_max = api->body_max,
			.timeout_s = api->timeout_s,
			.max_per_addr = api->max_per_addr,
			.header_timeout_s = api->header_timeout_s,
			.body_min_rate = api->body_min_rate,
			.trusted_proxies = api->trusted_proxies,
			.routes = routes,
			.nroutes = sizeof(routes) / sizeof(routes[0]),
			.app = gw,
			.flat_errors = true,
		},
		err);
	if (!e2b_http)
		goto fail;
	log_info("E2B API listening on \"%s\"", listen);
	return KILN_OK;
fail:
	e2b_stop(0);
	return err->code ? err->code : KILN_E_INTERNAL;
}

void e2b_stop(unsigned grace_s)
{
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
