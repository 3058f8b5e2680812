/*
 * req_fuzz.c - libFuzzer target for every request body kiln-gateway and kiln-node parse: the
 * functions the route handlers call (api/apireq.c, node/nodereq.c) on the body's bytes.
 *
 * Input: a selector byte choosing the parser, then the body. Oracle: no crash, leak or UB; a
 * refusal is one of the codes a body can get (400, 413, 422, or out of memory) with a message;
 * and a body that is accepted yields values inside the documented ranges (docs/openapi.yaml,
 * docs/sandboxes.md): vcpus 0.25 to 8 in steps of 0.25, memory 256 MiB to 16 GiB, disk 10 to 60
 * GiB, timeouts, counts, names, env, egress rules and bandwidth within theirs.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/apireq.h"
#include "auth/scopes.h"
#include "common/s3.h"
#include "netpolicy/policy.h"
#include "node/nodereq.h"
#include "vmm/guest/agent_proto.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                             \
	do {                                                                                    \
		if (!(cond)) {                                                                  \
			fprintf(stderr, "req_fuzz: %s:%d: %s\n", __FILE__, __LINE__, #cond);    \
			abort();                                                                \
		}                                                                               \
	} while (0)

/* The node's default denied ranges (without the host's own addresses). */
static struct kiln_cidr deny[2 * KILN_DENY_MAX];
static size_t ndeny;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	struct kiln_error err = { 0 };
	bool host = false;

	(void)argc;
	(void)argv;
	if (kiln_cidrs_parse(KILN_EGRESS_DENY_FLOOR, deny, 2 * KILN_DENY_MAX, &ndeny, &host,
			     &err) != KILN_OK ||
	    kiln_cidrs_parse(KILN_EGRESS_DENY_DEFAULT, deny, 2 * KILN_DENY_MAX, &ndeny, &host,
			     &err) != KILN_OK)
		abort();
	return 0;
}

/* A refusal: a body's codes only, the message set, and err.code the one returned. */
static void refused(enum kiln_err rc, const struct kiln_error *err)
{
	CHECK(rc == KILN_E_BAD_REQUEST || rc == KILN_E_TOO_LARGE || rc == KILN_E_INVALID ||
	      rc == KILN_E_NOMEM);
	CHECK(err->code == rc);
	CHECK(err->msg[0] != '\0');
}

static void check_name(const char *s, size_t max)
{
	size_t n = strlen(s);

	CHECK(n >= 1 && n <= max);
	for (size_t i = 0; i < n; i++)
		CHECK((unsigned char)s[i] >= 0x20 && s[i] != 0x7f);
}

/* An env array: at most NODEREQ_ENV_MAX "NAME=value" of a valid name, NULL-terminated. */
static void check_env(char **env)
{
	size_t n = 0;

	CHECK(env);
	for (; env[n]; n++) {
		const char *eq = strchr(env[n], '=');
		CHECK(eq && eq > env[n] && eq - env[n] <= 256);
		CHECK(!(env[n][0] >= '0' && env[n][0] <= '9'));
		for (const char *k = env[n]; k < eq; k++)
			CHECK((*k >= 'A' && *k <= 'Z') || (*k >= 'a' && *k <= 'z') ||
			      (*k >= '0' && *k <= '9') || *k == '_');
		CHECK(strlen(eq + 1) <= NODEREQ_ENV_VALUE_MAX);
	}
	CHECK(n <= NODEREQ_ENV_MAX);
}

static void check_ruleset(const struct kiln_ruleset *rs)
{
	struct kiln_error err = { 0 };

	CHECK(rs->n <= NODEREQ_EGRESS_RULES_MAX);
	CHECK(kiln_rules_check_deny(rs, deny, ndeny, &err) == KILN_OK);
}

static void check_bandwidth(const struct kiln_bandwidth *bw)
{
	CHECK(bw->quota_bytes <= INT64_MAX && bw->refill_bytes <= INT64_MAX &&
	      bw->one_time_burst_bytes <= INT64_MAX);
	CHECK(bw->refill_interval_s >= 1 && bw->refill_interval_s <= 86400);
}

/* Parses `body` as JSON, or NULL. */
static json_t *as_json(const char *text, size_t len)
{
	return json_loadb(text, len, JSON_REJECT_DUPLICATES, NULL);
}

static void gw_create(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct apireq_create c;
	enum kiln_err rc = apireq_create(t, n, &c, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
	} else {
		json_t *meta = json_loads(c.metadata, 0, NULL);

		CHECK(c.vcpu_milli >= 250 && c.vcpu_milli <= 8000 && c.vcpu_milli % 250 == 0);
		CHECK(c.mem_mib >= 256 && c.mem_mib <= 16384);
		CHECK(c.disk_gib >= 10 && c.disk_gib <= 60);
		CHECK(c.timeout_s >= 1 && c.timeout_s <= 86400);
		CHECK(strlen(c.metadata) <= APIREQ_METADATA_MAX);
		CHECK(json_is_object(meta));
		CHECK(!c.snapshot_id || strlen(c.snapshot_id) <= 64);
		json_decref(meta);
	}
	apireq_create_free(&c);
}

static void gw_fork(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	unsigned count;
	enum kiln_err rc = apireq_fork(t, n, &count, &err);

	if (rc != KILN_OK)
		refused(rc, &err);
	else
		CHECK(count >= 1 && count <= APIREQ_FORK_MAX);
}

static void gw_key(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct apireq_key k;
	enum kiln_err rc = apireq_key(t, n, &k, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
	} else {
		check_name(k.name, APIREQ_NAME_MAX);
		CHECK(k.scopes != 0 && (k.scopes & ~AUTH_SCOPES_ALL) == 0);
		CHECK(!k.expires_at || strlen(k.expires_at) <= 64);
	}
	json_decref(k.body);
}

static void gw_token(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	long long ttl = 0;
	uint32_t scopes = 0;
	bool has;
	enum kiln_err rc = apireq_token(t, n, &ttl, &scopes, &has, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
		CHECK(!has);
	} else {
		CHECK(ttl >= 1 && ttl <= APIREQ_TOKEN_TTL_MAX);
		CHECK(!has || (scopes & ~AUTH_SCOPES_ALL) == 0);
	}
}

static void gw_tenant(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	json_t *body = NULL;
	const char *name;
	enum kiln_err rc = apireq_tenant(t, n, &body, &name, &err);

	if (rc != KILN_OK)
		refused(rc, &err);
	else
		check_name(name, APIREQ_NAME_MAX);
	json_decref(body);
}

static void gw_grant(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct apireq_grant g;
	enum kiln_err rc = apireq_grant(t, n, &g, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
	} else {
		CHECK(g.amount_ucr >= 1);
		check_name(g.reason, APIREQ_GRANT_REASON_MAX);
		CHECK(strlen(g.tenant_id) <= 64);
		CHECK(!g.expires_at || apireq_rfc3339(g.expires_at));
	}
	json_decref(g.body);
}

static void gw_storage(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct s3_target tgt;
	json_t *body = NULL;
	enum kiln_err rc = apireq_storage(t, n, &body, &tgt, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
	} else {
		struct kiln_error again = { 0 };
		CHECK(strlen(tgt.endpoint) <= S3_ENDPOINT_MAX && strlen(tgt.bucket) <= S3_BUCKET_MAX &&
		      strlen(tgt.region) <= S3_REGION_MAX && strlen(tgt.prefix) <= S3_PREFIX_MAX &&
		      strlen(tgt.access_key_id) <= S3_KEY_ID_MAX &&
		      strlen(tgt.secret_access_key) <= S3_SECRET_MAX);
		CHECK(s3_target_check(&tgt, &again) == KILN_OK);
	}
	s3_target_wipe(&tgt);
	apireq_storage_free(body);
}

/* The node's create as routes.c runs it: the body, then egress, then bandwidth. */
static void node_create(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct nodereq_create c;
	enum kiln_err rc = nodereq_create(t, n, &c, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
		nodereq_create_free(&c);
		return;
	}
	CHECK(c.vcpu_milli >= 250 && c.vcpu_milli <= 8000 && c.vcpu_milli % 250 == 0);
	CHECK(c.mem_mib >= 256 && c.mem_mib <= 16384);
	CHECK(c.disk_gib >= 10 && c.disk_gib <= 60);
	CHECK(c.timeout_s >= 1 && c.timeout_s <= 86400);
	CHECK(c.template_name && strlen(c.template_name) <= 64);
	{
		json_t *meta = json_loads(c.metadata, 0, NULL);
		CHECK(json_is_object(meta));
		json_decref(meta);
	}
	check_env(c.env);
	if (c.egress) {
		struct kiln_ruleset rs;
		rc = nodereq_egress(c.egress, deny, ndeny, &rs, &err);
		if (rc != KILN_OK)
			refused(rc, &err);
		else
			check_ruleset(&rs);
		kiln_ruleset_free(&rs);
	}
	if (c.bandwidth && rc == KILN_OK) {	/* the route stops at a bad egress */
		struct kiln_bandwidth bw;
		rc = nodereq_bandwidth(c.bandwidth, &bw, &err);
		if (rc != KILN_OK)
			refused(rc, &err);
		else
			check_bandwidth(&bw);
	}
	nodereq_create_free(&c);
}

static void node_exec(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct exec_req *e = NULL;
	enum kiln_err rc = nodereq_exec(t, n, &e, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
		CHECK(!e);
		return;
	}
	CHECK(e->argv && e->argv[0] && e->argv[0][0]);
	CHECK(e->timeout_ms >= 1000 && e->timeout_ms <= NODEREQ_EXEC_TIMEOUT_MAX_S * 1000u);
	CHECK(!e->cwd || e->cwd[0] == '/');
	CHECK(e->stdin_len <= (1u << 20));
	CHECK(!e->user || (strcmp(e->user, "root") != 0 && agent_user_ok(e->user, strlen(e->user))));
	/* the gateway lets through no user the node refuses */
	CHECK(apireq_exec_user(t, n, &err) == KILN_OK);
	check_env(e->env);
	exec_req_free(e);
}

static void node_timeout(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	long long s = 0;
	enum kiln_err rc = nodereq_timeout(t, n, &s, &err);

	if (rc != KILN_OK)
		refused(rc, &err);
	else
		CHECK(s >= 1 && s <= 86400);
}

static void node_fork(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	const char *ids[NODEREQ_FORK_MAX];
	size_t count = 99;
	json_t *body = NULL;
	enum kiln_err rc = nodereq_fork(t, n, &body, ids, &count, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
		CHECK(count == 0);
	} else {
		CHECK(count >= 1 && count <= NODEREQ_FORK_MAX);
		for (size_t i = 0; i < count; i++)
			CHECK(strncmp(ids[i], "sb_", 3) == 0);
	}
	json_decref(body);
}

static void node_snapshot(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	char *name = NULL;
	enum kiln_err rc = nodereq_snapshot(t, n, &name, &err);

	if (rc != KILN_OK)
		refused(rc, &err);
	else
		CHECK(!name || strlen(name) <= NODEREQ_SNAPSHOT_NAME_MAX);
	free(name);
}

/* PUT /egress and PUT /bandwidth: the node loads the body, then the parser checks it. */
static void node_netcfg(const char *t, size_t n, bool egress)
{
	struct kiln_error err = { 0 };
	json_t *body = as_json(t, n);
	enum kiln_err rc;

	if (!body)
		return;
	if (egress) {
		struct kiln_ruleset rs;
		rc = nodereq_egress(body, deny, ndeny, &rs, &err);
		if (rc == KILN_OK)
			check_ruleset(&rs);
		kiln_ruleset_free(&rs);
	} else {
		struct kiln_bandwidth bw;
		rc = nodereq_bandwidth(body, &bw, &err);
		if (rc == KILN_OK)
			check_bandwidth(&bw);
	}
	if (rc != KILN_OK)
		refused(rc, &err);
	json_decref(body);
}

/* POST /v1/templates: a valid name, a sandbox's shape, bounded commands and egress. */
static void gw_template(const char *t, size_t n)
{
	struct kiln_error err = { 0 };
	struct apireq_template x;
	enum kiln_err rc = apireq_template(t, n, &x, &err);

	if (rc != KILN_OK) {
		refused(rc, &err);
	} else {
		CHECK(apireq_template_name("name", x.name, &err) == KILN_OK);
		CHECK(x.vcpu_milli >= 250 && x.vcpu_milli <= 8000 && x.vcpu_milli % 250 == 0);
		CHECK(x.mem_mib >= 256 && x.mem_mib <= 16384);
		CHECK(x.disk_gib >= 10 && x.disk_gib <= 60);
		CHECK(!x.start_cmd || (x.start_cmd[0] && strlen(x.start_cmd) <= APIREQ_TEMPLATE_CMD_MAX));
		CHECK(!x.ready_cmd || (x.ready_cmd[0] && strlen(x.ready_cmd) <= APIREQ_TEMPLATE_CMD_MAX));
		CHECK(!x.egress || strlen(x.egress) <= APIREQ_TEMPLATE_EGRESS_MAX);
	}
	apireq_template_free(&x);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *t;
	size_t n;

	if (size < 1 || size > 65536)
		return 0;
	t = (const char *)data + 1;
	n = size - 1;
	switch (data[0] % 15) {
	case 0: gw_create(t, n); break;
	case 1: gw_fork(t, n); break;
	case 2: gw_key(t, n); break;
	case 3: gw_token(t, n); break;
	case 4: gw_tenant(t, n); break;
	case 5: gw_grant(t, n); break;
	case 6: gw_storage(t, n); break;
	case 7: node_create(t, n); break;
	case 8: node_exec(t, n); break;
	case 9: node_timeout(t, n); break;
	case 10: node_fork(t, n); break;
	case 11: node_snapshot(t, n); break;
	case 12: node_netcfg(t, n, true); break;
	case 14: gw_template(t, n); break;
	default: node_netcfg(t, n, false); break;
	}
	return 0;
}
