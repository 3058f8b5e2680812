/*
 * routes.c - kiln-node's HTTP API, called by gateways only (docs/node-api.md).
 *
 * Paths mirror the public API (/v1/sandboxes/{id}/...). Every route but /healthz needs a node
 * token for exactly that sandbox; the sandbox must belong to the token's tenant, or it is 404.
 * The handlers parse, check and reply; the create, fork, resume and pause themselves are in
 * create.c, fork.c, resume.c and pause.c, and every write of a sandbox's record in record.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/pump.h"
#include "auth/bearer.h"
#include "common/buf.h"
#include "common/json.h"
#include "common/log.h"
#include "vmm/agent.h"
#include "vmm/disk.h"
#include "vmm/hv.h"
#include "vmm/jail.h"
#include "auth/apikey.h"
#include "metering/plan.h"
#include "node/secrets.h"
#include "node/create.h"
#include "node/fork.h"
#include "node/lifecycle.h"
#include "node/pause.h"
#include "node/ports.h"
#include "node/resume.h"
#include "node/node.h"
#include "node/nodereq.h"
#include "node/template.h"
#include "node/build.h"
#include "node/storage_sync.h"

#define FILE_MAX (100ull << 20)		/* bytes of one file, each way */

struct node_auth {
	struct auth_claims claims;
};

static void free_ptr(void *p)
{
	free(p);
}

bool node_before(struct http_req *req, const struct http_route *route)
{
	struct node *n = http_req_app(req);
	const char *hdr = http_req_header(req, "Authorization");
	const char *id = http_req_param(req, "id");
	struct auth_credential cred;
	struct kiln_error err = { 0 };
	struct node_auth *a;

	if (!route->scope)
		return true;
	if (!hdr || auth_bearer_parse(hdr, strlen(hdr), &cred, &err) != KILN_OK ||
	    cred.kind != AUTH_CRED_JWT) {
		http_reply_error(req, KILN_E_UNAUTHENTICATED, "a node token is required");
		return false;
	}
	a = calloc(1, sizeof(*a));
	if (!a) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return false;
	}
	http_req_set_ctx(req, a, free_ptr);
	if (jwks_verify(n->keys, cred.value, cred.len, id ? id : "", &a->claims, &err) != KILN_OK) {
		http_reply_error(req, KILN_E_UNAUTHENTICATED, "%s", err.msg);
		return false;
	}
	log_ctx_set(http_req_id(req), a->claims.tid, id);
	return true;
}

static const struct auth_claims *claims_of(struct http_req *req)
{
	return &((struct node_auth *)http_req_ctx(req))->claims;
}

/*
 * The sandbox of the request, if this node holds it for the token's tenant; replies 404 and
 * returns NULL otherwise. The caller sb_put()s it.
 */
static struct sandbox *request_sandbox(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct sandbox *sb = sb_get(n, id);

	if (sb && strcmp(sb->tenant_id, claims_of(req)->tid) != 0) {
		sb_put(n, sb);
		sb = NULL;
	}
	if (!sb)
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
	return sb;
}

struct sandbox *node_request_sandbox(struct http_req *req)
{
	return request_sandbox(req);
}

/* The sandbox as Postgres has it (sandbox_json), or NULL when it cannot be read. */
static json_t *sandbox_json_of(struct node *n, const char *id)
{
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	json_t *obj = NULL;

	if (pg_acquire(n->pg, &c, &err) != KILN_OK)
		return NULL;
	if (PGQ(c, &res, &err, "SELECT sandbox_json(s)::text FROM sandboxes s WHERE id = $1", id) ==
		    KILN_OK &&
	    pg_res_rows(res) == 1)
		obj = json_loads(pg_res_str(res, 0, 0), 0, NULL);
	pg_res_free(res);
	pg_release(n->pg, c);
	return obj;
}

/* Replies with the sandbox as Postgres has it. */
static void reply_sandbox(struct http_req *req, int status, const char *id)
{
	json_t *obj = sandbox_json_of(http_req_app(req), id);

	if (!obj)
		http_reply_error(req, KILN_E_INTERNAL, "cannot read the sandbox");
	else
		http_reply_json(req, status, obj);
}

/* ---- egress rules and bandwidth ---- */

/*
 * Parses `{rules:[...]}` into `rs` against this node's denied ranges (nodereq_egress). Returns
 * false after replying: 400 for a wrong shape, 422 naming the first bad rule (nothing is applied
 * then).
 */
static bool parse_egress(struct http_req *req, const json_t *obj, struct kiln_ruleset *rs)
{
	struct node *nd = http_req_app(req);
	struct kiln_cidr deny[2 * KILN_DENY_MAX];
	struct kiln_error err = { 0 };
	size_t ndeny;

	memset(rs, 0, sizeof(*rs));
	if (kiln_policy_deny_ranges(nd->cfg.egress_deny, deny, 2 * KILN_DENY_MAX, &ndeny, &err) !=
		    KILN_OK) {
		http_reply_error(req, err.code == KILN_E_INVALID ? KILN_E_INVALID : KILN_E_INTERNAL,
				 "%s", err.msg);
		return false;
	}
	if (nodereq_egress(obj, deny, ndeny, rs, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		kiln_ruleset_free(rs);
		return false;
	}
	return true;
}

/* Parses bandwidth settings (nodereq_bandwidth). Replies on failure. */
static bool parse_bandwidth(struct http_req *req, const json_t *obj, struct kiln_bandwidth *bw)
{
	struct kiln_error err = { 0 };

	if (nodereq_bandwidth(obj, bw, &err) == KILN_OK)
		return true;
	http_reply_error(req, err.code, "%s", err.msg);
	return false;
}

static json_t *egress_json(struct kiln_policy *pol, struct kiln_error *err)
{
	struct kiln_ruleset rs = { 0 };
	enum kiln_egress_mode mode;
	json_t *arr;
	char text[KILN_RULE_TEXT_MAX];

	if (kiln_policy_rules(pol, &rs, &mode, err) != KILN_OK)
		return NULL;
	arr = json_array();
	for (size_t i = 0; i < rs.n; i++) {
		kiln_rule_format(&rs.rules[i], text, sizeof(text));
		json_array_append_new(arr, json_string(text));
	}
	kiln_ruleset_free(&rs);
	return json_pack("{s:o, s:s}", "rules", arr, "mode",
			 mode == KILN_EGRESS_ALLOWLIST ? "allowlist" : "open");
}

static json_t *bandwidth_json(struct kiln_policy *pol, struct kiln_error *err)
{
	struct kiln_bandwidth bw;

	if (kiln_policy_get_bandwidth(pol, &bw, err) != KILN_OK)
		return NULL;
	return json_pack("{s:I, s:I, s:i, s:I, s:b, s:o}", "quota_bytes", (json_int_t)bw.quota_bytes,
			 "refill_bytes", (json_int_t)bw.refill_bytes, "refill_interval_s",
			 (int)bw.refill_interval_s, "one_time_burst_bytes",
			 (json_int_t)bw.one_time_burst_bytes, "unmetered", bw.unmetered,
			 "remaining_bytes",
			 bw.unmetered ? json_null() : json_integer((json_int_t)bw.remaining_bytes));
}

/* GET and PUT of /egress and /bandwidth: read or replace live, no restart. */
static void sandbox_netcfg(struct http_req *req, bool egress)
{
	struct node *n = http_req_app(req);
	bool put = strcmp(http_req_method(req), "PUT") == 0;
	struct kiln_error err = { 0 };
	struct kiln_ruleset rs = { 0 };
	struct kiln_bandwidth bw;
	struct sandbox *sb;
	json_t *body = NULL, *out = NULL;
	size_t len;
	const char *text = http_req_body(req, &len);

	if (put) {
		json_error_t jerr;
		body = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
		if (!body) {
			http_reply_error(req, KILN_E_BAD_REQUEST, "malformed JSON: %s", jerr.text);
			return;
		}
		if (egress ? !parse_egress(req, body, &rs) : !parse_bandwidth(req, body, &bw)) {
			json_decref(body);
			return;
		}
		json_decref(body);
	}
	sb = request_sandbox(req);
	if (!sb) {
		kiln_ruleset_free(&rs);
		return;
	}
	pthread_mutex_lock(&sb->lock);
	if (!sb->pol) {
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb_state_name(sb->state));
	} else if (put && (egress ? kiln_policy_apply(sb->pol, &rs, &err)
				  : kiln_policy_set_bandwidth(sb->pol, &bw, &err)) != KILN_OK) {
		http_reply_error(req, err.code == KILN_E_INVALID ? KILN_E_INVALID : KILN_E_INTERNAL,
				 "%s", err.msg);
	} else {
		out = egress ? egress_json(sb->pol, &err) : bandwidth_json(sb->pol, &err);
		if (out)
			http_reply_json(req, 200, out);
		else
			http_reply_error(req, KILN_E_INTERNAL, "cannot read the policy");
	}
	pthread_mutex_unlock(&sb->lock);
	kiln_ruleset_free(&rs);
	sb_put(n, sb);
}

static void sandbox_egress(struct http_req *req)
{
	sandbox_netcfg(req, true);
}

static void sandbox_bandwidth(struct http_req *req)
{
	sandbox_netcfg(req, false);
}

/* PUT /secrets: replaces the set (node/secrets.c). */
static void sandbox_secrets(struct http_req *req)
{
	struct sandbox *sb = request_sandbox(req);

	if (sb) {
		secrets_put_route(req, sb);
		sb_put(http_req_app(req), sb);
	}
}

/* ---- POST /v1/sandboxes/{id} ---- */

static void sandbox_create(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_ruleset rules = { 0 };
	struct kiln_bandwidth bw;
	struct secrets_set secrets = { 0 };
	struct create_req r = { .id = http_req_param(req, "id"), .tenant_id = claims_of(req)->tid };
	struct nodereq_create c;
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	enum kiln_err rc;

	if (nodereq_create(text, len, &c, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		goto out;
	}
	r.init.env = (const char *const *)c.env;
	if (c.egress) {
		if (!parse_egress(req, c.egress, &rules))
			goto out;
		r.init.egress = &rules;
	}
	if (c.bandwidth) {
		if (!parse_bandwidth(req, c.bandwidth, &bw))
			goto out;
		r.init.bandwidth = &bw;
	}
	/* secrets: bound to exact host rules of this very request's egress */
	if (c.secrets && json_array_size(c.secrets)) {
		if (secrets_parse(&n->cfg, c.secrets, &rules, &secrets, &err) != KILN_OK) {
			http_reply_error(req, err.code, "%s", err.msg);
			goto out;
		}
		r.secrets = &secrets;
	}
	r.vcpu_milli = c.vcpu_milli;
	r.mem_mib = c.mem_mib;
	r.disk_gib = c.disk_gib;
	r.timeout_s = c.timeout_s;
	r.template_name = c.template_name;
	r.from_snap = c.from_snap;
	r.metadata = c.metadata;
	rc = create_sandbox(n, &r, &err);
	if (rc != KILN_OK)
		http_reply_error(req, rc, "%s", err.msg);
	else
		reply_sandbox(req, 201, r.id);
out:
	secrets_set_free(&secrets);
	kiln_ruleset_free(&rules);
	nodereq_create_free(&c);
}

/* ---- DELETE /v1/sandboxes/{id} ---- */

/* The live record of sandbox `id` of `tenant` on this node. */
static enum kiln_err record_of(struct node *n, const char *id, const char *tenant,
			       struct record *out, struct kiln_error *err)
{
	return record_read(n->pg, id, tenant, n->cfg.node_id, out, err);
}

/* Deletes a sandbox this node does not run but whose record is here (a paused one). */
static void delete_record_only(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct record r;
	enum kiln_err rc = record_of(n, id, claims_of(req)->tid, &r, &err);

	if (rc != KILN_OK) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
		return;
	}
	if (!r.found) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		return;
	}
	rc = record_deleted(n->pg, NULL,
			    &(struct record_fence){ id, n->cfg.node_id, r.generation }, &err);
	if (rc != KILN_OK) {
		http_reply_error(req, rc, "the deletion could not be recorded: %s", err.msg);
		return;
	}
	secrets_forget(n, id);
	/* its pause snapshot's files go with the next snap_gc */
	log_info("sandbox \"%s\" (%s) deleted", id, r.state);
	http_reply_empty(req, 204);
}

static void sandbox_delete(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct sandbox *sb = sb_get(n, http_req_param(req, "id"));
	struct kiln_error err = { 0 };
	struct record_fence f;
	enum kiln_err rc;

	if (sb && strcmp(sb->tenant_id, claims_of(req)->tid) != 0) {
		sb_put(n, sb);
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", http_req_param(req, "id"));
		return;
	}
	if (!sb) {
		delete_record_only(req);
		return;
	}
	/* Recorded first: a delete that cannot be recorded changes nothing, the VM included. With
	 * the group's CPU counter when the VM runs, so the meter bills its CPU up to the deletion
	 * even if the group is gone before it reads it. */
	pthread_mutex_lock(&sb->lock);
	f = sb_fence(n, sb);
	{
		struct cg_usage u = { 0 };
		struct kiln_error uerr = { 0 };
		if (sb->vm && vmm_usage(sb->vm, &u, &uerr) == KILN_OK)
			rc = record_deleted_cpu(n->pg, NULL, &f, u.cpu_ns, &err);
		else
			rc = record_deleted(n->pg, NULL, &f, &err);
	}
	if (rc == KILN_OK) {
		sb_teardown(n, sb);
		sb->state = SB_STOPPED;
		secrets_forget(n, sb->id);
	}
	pthread_mutex_unlock(&sb->lock);
	if (rc != KILN_OK) {
		log_error("deletion of \"%s\" not recorded, nothing changed: %s", sb->id, err.msg);
		http_reply_error(req, rc, "the deletion could not be recorded: %s", err.msg);
	} else {
		log_info("sandbox \"%s\" deleted", sb->id);
		http_reply_empty(req, 204);
	}
	sb_put(n, sb);
}

/* ---- PUT /v1/sandboxes/{id}/timeout ---- */

static void sandbox_timeout(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	struct sandbox *sb;
	struct pg_conn *c;
	long long t;

	if (nodereq_timeout(text, len, &t, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	sb = request_sandbox(req);
	if (!sb)
		return;
	if (pg_acquire(n->pg, &c, &err) != KILN_OK) {
		sb_put(n, sb);
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
		return;
	}
	pthread_mutex_lock(&sb->lock);
	if (record_timeout(n->pg, c, &(struct record_fence){ sb->id, n->cfg.node_id, sb->generation },
			   t, &err) == KILN_OK)
		sb->expires_at = time(NULL) + t;
	pthread_mutex_unlock(&sb->lock);
	pg_release(n->pg, c);
	if (err.code) {
		http_reply_error(req, err.code, "the timeout could not be recorded: %s", err.msg);
	} else {
		reply_sandbox(req, 200, sb->id);
	}
	sb_put(n, sb);
}

/* ---- exec ---- */

/*
 * The text of a JSON string (without its quotes) built from a guest's output as it arrives, never
 * longer than `limit` bytes of that text: the cap holds in node memory whatever the bytes are (a
 * control byte becomes six). Valid UTF-8 is kept, NUL and invalid bytes become U+FFFD; a sequence
 * split across chunks is held (at most 3 bytes) until the next one.
 */
struct jtext {
	struct buf b;
	size_t base;		/* bytes of b before the text (a reply's head) */
	size_t limit;		/* bytes of text at most */
	unsigned char pend[4];
	size_t npend;
	bool cut;		/* output was dropped at the cap */
	struct node *mem;	/* the node whose exec memory budget b grows in, or NULL */
	unsigned long long charged;	/* bytes of that budget taken for b: EXEC_MEM_COPIES x b.cap */
};

/*
 * The node's exec memory budget (node_exec_memory_max): bytes held by exec output buffers. A
 * non-streamed exec takes EXEC_MEM_COPIES x the capacity of its two texts' buffers as they grow
 * (the second copy covers the reply body built from them and the HTTP server's copy of it, so the
 * figure is a bound, not an estimate); a streamed exec takes its fixed window (SSE_WINDOW) at the
 * start. Buffers grow by doubling from EXEC_MEM_FIRST to EXEC_MEM_STEP, then EXEC_MEM_STEP at a
 * time, each step taken from the budget before it is allocated. A new exec is admitted only while
 * EXEC_MEM_ADMIT is left (more than any one step takes): once a running exec's step was refused, so
 * is the next exec, until memory comes back.
 */
#define EXEC_MEM_COPIES 2ull
#define EXEC_MEM_FIRST 4096u		/* bytes of a text's first buffer */
#define EXEC_MEM_STEP (1u << 20)	/* growth past 1 MiB, bytes */
#define EXEC_MEM_ADMIT (EXEC_MEM_COPIES * EXEC_MEM_STEP)
#define EXEC_MEM_SLACK 4096u		/* the reply's frame around the two texts */

/*
 * Takes `bytes` of the budget when at least `keep` more stay free after; false (nothing taken)
 * otherwise.
 */
static bool exec_mem_take(struct node *n, unsigned long long bytes, unsigned long long keep)
{
	unsigned long long max = (unsigned long long)n->cfg.node_exec_memory_max;
	unsigned long long used = atomic_load(&n->exec_mem_used);

	do {
		if (used > max || bytes > max - used || keep > max - used - bytes)
			return false;
	} while (!atomic_compare_exchange_weak(&n->exec_mem_used, &used, used + bytes));
	return true;
}

static void exec_mem_give(struct node *n, unsigned long long bytes)
{
	if (bytes)
		atomic_fetch_sub(&n->exec_mem_used, bytes);
}

/*
 * Prepares a text of at most `limit` bytes after `head` (or none). With `mem`, the buffer is
 * allocated now (EXEC_MEM_FIRST bytes, whose charge the caller took) and grows in that node's
 * budget; returns false when out of memory (nothing to free).
 */
static bool jtext_init(struct jtext *t, size_t limit, const char *head, struct node *mem)
{
	memset(t, 0, sizeof(*t));
	t->base = head ? strlen(head) : 0;
	t->limit = limit;
	buf_init(&t->b, t->base + limit + 1);
	if (mem) {
		t->b.cap = t->b.max + 1 < EXEC_MEM_FIRST ? t->b.max + 1 : EXEC_MEM_FIRST;
		if (!(t->b.data = malloc(t->b.cap))) {
			t->b.cap = 0;
			return false;
		}
		t->b.data[0] = '\0';
		t->mem = mem;
		t->charged = EXEC_MEM_COPIES * EXEC_MEM_FIRST;
	}
	if (head)
		buf_appends(&t->b, head);
	return true;
}

/* Frees the text's buffer and gives its charge back. */
static void jtext_release(struct jtext *t)
{
	buf_release(&t->b);
	if (t->mem)
		exec_mem_give(t->mem, t->charged);
	t->charged = 0;
}

/*
 * Whether `n` more bytes of text fit: under the limit and, for a budgeted text, in a buffer whose
 * next step the budget gave (the buffer is grown here, so buf_append does not reallocate). When
 * not, the text is cut from here on.
 */
static bool jtext_room(struct jtext *t, size_t n)
{
	size_t need = t->b.len + n + 1, ncap;
	unsigned long long extra;
	char *p;

	if (t->b.len - t->base + n > t->limit) {
		t->cut = true;
		return false;
	}
	if (!t->mem || need <= t->b.cap)
		return true;
	if (t->b.cap < EXEC_MEM_STEP) {
		for (ncap = t->b.cap > EXEC_MEM_FIRST ? t->b.cap : EXEC_MEM_FIRST; ncap < need; ncap *= 2)
			;
	} else {
		ncap = (need + EXEC_MEM_STEP - 1) / EXEC_MEM_STEP * EXEC_MEM_STEP;
	}
	if (ncap > t->b.max + 1)
		ncap = t->b.max + 1;
	extra = EXEC_MEM_COPIES * ncap - t->charged;
	if (!exec_mem_take(t->mem, extra, 0)) {
		t->cut = true;	/* node_exec_memory_max: marked as the cap marks it */
		return false;
	}
	if (!(p = realloc(t->b.data, ncap))) {
		exec_mem_give(t->mem, extra);
		t->cut = true;
		return false;
	}
	t->b.data = p;
	t->b.cap = ncap;
	t->charged += extra;
	return true;
}

/* UTF-8 length of the sequence that begins with `c`, 0 for a byte that cannot begin one. */
static size_t utf8_need(unsigned char c)
{
	return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
}

/* Whether the `n` bytes at `s` (n <= need) can begin a valid sequence of `need` bytes. */
static bool utf8_prefix_ok(const unsigned char *s, size_t n, size_t need)
{
	unsigned char c = s[0];

	for (size_t k = 1; k < n; k++)
		if ((s[k] & 0xc0) != 0x80)
			return false;
	if (need == 2 && c < 0xc2)
		return false;	/* overlong */
	if (need == 3 && n > 1 && ((c == 0xe0 && s[1] < 0xa0) || (c == 0xed && s[1] >= 0xa0)))
		return false;	/* overlong or surrogate */
	if (need == 4 && (c > 0xf4 || (n > 1 && ((c == 0xf0 && s[1] < 0x90) || (c == 0xf4 && s[1] >= 0x90)))))
		return false;
	return true;
}

/* Appends `len` bytes of output; `final` flushes a held incomplete sequence (as U+FFFD). */
static void jtext_add(struct jtext *t, const unsigned char *data, size_t len, bool final)
{
	unsigned char win[8];
	size_t i = 0;

	if (t->cut)
		return;
	/* a held sequence first (a valid prefix), completed from the new bytes */
	if (t->npend > 0) {
		size_t held = t->npend, need = utf8_need(t->pend[0]), take = need - held, n;

		take = take < len ? take : len;
		memcpy(win, t->pend, held);
		memcpy(win + held, data, take);
		n = held + take;
		t->npend = 0;
		if (n < need && !final && utf8_prefix_ok(win, n, need)) {
			memcpy(t->pend, win, n);	/* still incomplete */
			t->npend = n;
			return;
		}
		if (n == need && utf8_prefix_ok(win, need, need)) {
			if (!jtext_room(t, need))
				return;
			buf_append(&t->b, win, need);
			i = take;
		} else {
			/* broken: each held byte (a lead, then continuations) becomes U+FFFD */
			for (size_t k = 0; k < held; k++) {
				if (!jtext_room(t, 3))
					return;
				buf_append(&t->b, "\xef\xbf\xbd", 3);
			}
		}
	}
	while (i < len) {
		unsigned char c = data[i];
		size_t need = utf8_need(c), n;
		char esc[8];
		const char *out = esc;

		if (need > 1 && i + need > len && utf8_prefix_ok(data + i, len - i, need) && !final) {
			memcpy(t->pend, data + i, len - i);
			t->npend = len - i;
			return;
		}
		if (need == 0 || c == 0 || (need > 1 && (i + need > len || !utf8_prefix_ok(data + i, need, need)))) {
			out = "\xef\xbf\xbd";
			n = 3;
			need = 1;
		} else if (need > 1) {
			out = (const char *)data + i;
			n = need;
		} else if (c == '"' || c == '\\') {
			esc[0] = '\\';
			esc[1] = (char)c;
			n = 2;
		} else if (c < 0x20) {
			n = (size_t)snprintf(esc, sizeof(esc), "\\u%04x", c);
			if (c == '\n' || c == '\t' || c == '\r') {
				esc[1] = c == '\n' ? 'n' : c == '\t' ? 't' : 'r';
				n = 2;
			}
		} else {
			esc[0] = (char)c;
			n = 1;
		}
		if (!jtext_room(t, n))
			return;
		buf_append(&t->b, out, n);
		i += need;
	}
}

/* Parses the exec body (nodereq_exec); replies and returns NULL when it is bad. */
static struct exec_req *exec_parse(struct http_req *req)
{
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	struct exec_req *e = NULL;

	if (nodereq_exec(text, len, &e, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return NULL;
	}
	return e;
}

static void agent_req_of(const struct exec_req *e, struct agent_exec_req *a)
{
	memset(a, 0, sizeof(*a));
	a->argv = (const char *const *)e->argv;
	a->env = (const char *const *)e->env;
	a->cwd = e->cwd;
	a->stdin_data = e->stdin_data;
	a->stdin_len = e->stdin_len;
	a->timeout_ms = e->timeout_ms;
	a->user = e->user;
}

/*
 * A VM that stopped answering: state error, and the error kept for the API. Called without
 * sb->lock.
 */
static void sandbox_failed(struct node *n, struct sandbox *sb)
{
	struct vmm_status st = { 0 };
	struct kiln_error err = { 0 };

	pthread_mutex_lock(&sb->lock);
	if (sb->state == SB_RUNNING && (!sb->vm || vmm_status(sb->vm, &st, &err) != KILN_OK ||
					!st.alive || !agent_alive(sb->agent))) {
		log_error("sandbox \"%s\" stopped answering", sb->id);
		sb_failed(n, sb, "the VM stopped or its agent stopped answering");
	}
	pthread_mutex_unlock(&sb->lock);
}

/* Checks the sandbox runs; replies 409 (or 502 for state error) when it does not. */
static bool require_running(struct http_req *req, struct sandbox *sb)
{
	if (sb->state == SB_RUNNING && sb->agent)
		return true;
	if (sb->state == SB_ERROR)
		http_reply_error(req, KILN_E_SANDBOX_FAILED, "the sandbox has failed");
	else
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb_state_name(sb->state));
	return false;
}

/*
 * A non-streamed exec's output, JSON-encoded as it arrives: `out` starts the reply's body and
 * becomes it. Node memory per exec is at most about 4 x exec_output_max (both texts, then the
 * body and the server's copy of it), all of it inside the budget the texts charged (twice their
 * buffers, plus EXEC_MEM_SLACK), plus the agent client's bounded queue (vmm/agent.c).
 */
struct capture {
	struct jtext out, err;
};

/* The budget a replied exec still holds (the server's copy of its body) until its request ends. */
struct exec_hold {
	struct node *n;
	unsigned long long bytes;
};

static void exec_hold_free(void *ctx)
{
	struct exec_hold *h = ctx;

	exec_mem_give(h->n, h->bytes);
	free(h);
}

/*
 * Takes `bytes` of the node's exec memory budget for a new exec, leaving EXEC_MEM_ADMIT free;
 * when it cannot, replies 429 naming node_exec_memory_max and returns false.
 */
static bool exec_mem_admit(struct http_req *req, struct node *n, unsigned long long bytes)
{
	if (exec_mem_take(n, bytes, EXEC_MEM_ADMIT))
		return true;
	http_reply_header(req, "Retry-After", "1");
	http_reply_error(req, KILN_E_RATE_LIMITED,
			 "too much exec output held at once: node_exec_memory_max is %lld bytes for this "
			 "node", n->cfg.node_exec_memory_max);
	return false;
}

#define EXEC_REPLY_HEAD "{\"stdout\":\""

static int capture_output(void *ctx, enum agent_stream s, const uint8_t *data, size_t len)
{
	struct capture *c = ctx;

	jtext_add(s == AGENT_STDOUT ? &c->out : &c->err, data, len, false);
	return 0;
}

/*
 * Counts an exec in against exec_max_per_sandbox and exec_max_per_tenant (this node's execs of
 * the sandbox's tenant); at either, replies 429 naming it and returns false.
 */
static bool exec_enter(struct http_req *req, struct node *n, struct sandbox *sb)
{
	const char *limit = NULL;
	long long max = 0, tenant = 0;

	pthread_mutex_lock(&n->reg_lock);
	for (struct sandbox *o = n->sandboxes; o; o = o->next)
		if (strcmp(o->tenant_id, sb->tenant_id) == 0)
			tenant += o->execs;
	if (sb->execs >= n->cfg.exec_max_per_sandbox) {
		limit = "exec_max_per_sandbox";
		max = n->cfg.exec_max_per_sandbox;
	} else if (tenant >= n->cfg.exec_max_per_tenant) {
		limit = "exec_max_per_tenant";
		max = n->cfg.exec_max_per_tenant;
	} else {
		sb->execs++;
	}
	pthread_mutex_unlock(&n->reg_lock);
	if (!limit)
		return true;
	http_reply_header(req, "Retry-After", "1");
	http_reply_error(req, KILN_E_RATE_LIMITED, "too many execs at once: %s is %lld %s", limit, max,
			 strcmp(limit, "exec_max_per_sandbox") ? "for the tenant on this node" : "for this sandbox");
	return false;
}

static void exec_leave(struct node *n, struct sandbox *sb)
{
	pthread_mutex_lock(&n->reg_lock);
	sb->execs--;
	pthread_mutex_unlock(&n->reg_lock);
}

struct sse_job {
	char request_id[24];
	struct node *n;
	struct sandbox *sb;	/* a reference */
	struct exec_req *e;
	struct pump *p;
	struct jtext out, err;	/* one event's text each (SSE_CHUNK of output), sequences split
				   across events held */
};

#define SSE_CHUNK 16384	/* output bytes per event: an event is at most 6 x this plus its frame */
#define SSE_EVENT_MAX (SSE_CHUNK * 6 + 128)	/* bytes of one event's buffer, with its frame */
/*
 * What a streamed exec holds, taken from the budget at its start: the two event buffers, the
 * pump's pipe (its default capacity; the producer blocks on it while the client is slow, so
 * nothing else piles up: common/pump.h) and the HTTP server's block it reads the pipe into.
 */
#define SSE_WINDOW (2ull * (SSE_EVENT_MAX + 1) + (64u << 10) + (64u << 10))

/*
 * Writes `n` bytes of a stream's output to `p` as one JSON string in `t`'s buffer, after `head`,
 * the stream's name and `mid`, and before `tail`; nothing when all of it is held back (a split
 * UTF-8 sequence: `final` flushes it). Returns pump_write()'s result, or 0.
 */
static int jtext_frame(struct pump *p, struct jtext *t, enum agent_stream s, const char *head,
		       const char *mid, const char *tail, const uint8_t *data, size_t n, bool final)
{
	buf_reset(&t->b);
	buf_appends(&t->b, head);
	buf_appends(&t->b, s == AGENT_STDOUT ? "stdout" : "stderr");
	buf_appends(&t->b, mid);
	t->base = t->b.len;
	jtext_add(t, data, n, final);
	if (t->b.len == t->base)
		return 0;
	buf_appends(&t->b, tail);
	return pump_write(p, t->b.data, t->b.len);
}

/* Sends `n` bytes of output (n <= SSE_CHUNK) as one event; `final` flushes a held sequence. */
static int sse_event(struct sse_job *j, enum agent_stream s, const uint8_t *data, size_t n, bool final)
{
	return jtext_frame(j->p, s == AGENT_STDOUT ? &j->out : &j->err, s,
			   "event: ", "\ndata: {\"data\":\"", "\"}\n\n", data, n, final);
}

static int sse_output(void *ctx, enum agent_stream s, const uint8_t *data, size_t len)
{
	struct sse_job *j = ctx;

	while (len > 0) {
		size_t n = len < SSE_CHUNK ? len : SSE_CHUNK;

		if (sse_event(j, s, data, n, false) < 0)
			return -1;	/* the client left; the agent stops streaming to us */
		data += n;
		len -= n;
	}
	return 0;
}

static void sse_produce(struct pump *p, void *ctx)
{
	struct sse_job *j = ctx;
	struct agent_exec_req a;
	struct agent_exec_result r = { 0 };
	struct kiln_error err = { 0 };
	enum kiln_err rc;
	char line[2048];	/* the guest's message, sanitised and JSON-escaped, fits */

	j->p = p;
	pump_ready(p, 200, "text/event-stream");
	secrets_exec_env(j->n, j->sb->id, &j->e->env);	/* out of memory: as asked */
	agent_req_of(j->e, &a);
	rc = agent_exec(j->sb->agent, &a, sse_output, j, &r, &err);
	if (rc == KILN_OK) {
		/* output that ended inside a UTF-8 sequence */
		sse_event(j, AGENT_STDOUT, (const uint8_t *)"", 0, true);
		sse_event(j, AGENT_STDERR, (const uint8_t *)"", 0, true);
		snprintf(line, sizeof(line),
			 "event: exit\ndata: {\"exit_code\":%d,\"timed_out\":%s,\"duration_ms\":%llu}\n\n",
			 r.exit_code, r.timed_out ? "true" : "false", (unsigned long long)r.duration_ms);
	} else {
		/* what the guest refused (an unknown user, a bad cwd) it says; anything else is generic */
		bool told = rc == KILN_E_INVALID || rc == KILN_E_NOT_FOUND || rc == KILN_E_FORBIDDEN;
		json_t *msg = json_string(told ? err.msg : "the exec failed");
		char *m = msg ? json_dumps(msg, JSON_ENCODE_ANY) : NULL;

		if (rc == KILN_E_SANDBOX_FAILED)
			sandbox_failed(j->n, j->sb);
		snprintf(line, sizeof(line),
			 "event: error\ndata: {\"error\":{\"code\":\"%s\",\"message\":%s,"
			 "\"request_id\":\"%s\"}}\n\n",
			 kiln_err_name(http_status_of(rc) == 500 ? KILN_E_INTERNAL : rc),
			 m ? m : "\"the exec failed\"", j->request_id);
		free(m);
		json_decref(msg);
	}
	pump_write(p, line, strlen(line));
}

static void sse_free(void *ctx)
{
	struct sse_job *j = ctx;

	exec_leave(j->n, j->sb);
	exec_mem_give(j->n, SSE_WINDOW);
	exec_req_free(j->e);
	buf_release(&j->out.b);
	buf_release(&j->err.b);
	sb_put(j->n, j->sb);
	free(j);
}

static void sandbox_exec(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *accept = http_req_header(req, "Accept");
	struct exec_req *e = exec_parse(req);
	struct sandbox *sb;
	struct agent_exec_req a;
	struct agent_exec_result r = { 0 };
	struct kiln_error err = { 0 };
	struct capture cap;
	struct exec_hold *hold;
	unsigned long long charged;
	enum kiln_err rc;
	bool sse = accept && strstr(accept, "text/event-stream");

	if (!e)
		return;
	sb = request_sandbox(req);
	if (!sb || !require_running(req, sb) || !exec_enter(req, n, sb)) {
		exec_req_free(e);
		sb_put(n, sb);
		return;
	}
	if (!exec_mem_admit(req, n, sse ? SSE_WINDOW : 2 * EXEC_MEM_COPIES * EXEC_MEM_FIRST + EXEC_MEM_SLACK)) {
		exec_leave(n, sb);
		exec_req_free(e);
		sb_put(n, sb);
		return;
	}
	if (sse) {
		struct sse_job *j = calloc(1, sizeof(*j));
		struct pump *p;

		if (!j) {
			exec_mem_give(n, SSE_WINDOW);
			exec_leave(n, sb);
			exec_req_free(e);
			sb_put(n, sb);
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
			return;
		}
		snprintf(j->request_id, sizeof(j->request_id), "%s", http_req_id(req));
		j->n = n;
		j->sb = sb;
		j->e = e;
		jtext_init(&j->out, SSE_CHUNK * 6 + 16, NULL, NULL);
		jtext_init(&j->err, SSE_CHUNK * 6 + 16, NULL, NULL);
		j->out.b.max = j->err.b.max = SSE_EVENT_MAX;	/* with the event's frame */
		p = pump_start(sse_produce, j, sse_free);
		if (!p) {
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
			return;
		}
		pump_wait_ready(p, NULL, 0);
		http_reply_stream(req, 200, "text/event-stream", pump_read, p, pump_release);
		return;
	}
	/* the admission took both texts' first buffers and the reply's frame */
	if (!jtext_init(&cap.out, (size_t)n->cfg.exec_output_max, EXEC_REPLY_HEAD, n) ||
	    !jtext_init(&cap.err, (size_t)n->cfg.exec_output_max, NULL, n)) {
		buf_release(&cap.out.b);
		exec_mem_give(n, 2 * EXEC_MEM_COPIES * EXEC_MEM_FIRST + EXEC_MEM_SLACK);
		exec_leave(n, sb);
		exec_req_free(e);
		sb_put(n, sb);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	charged = EXEC_MEM_SLACK;	/* the texts' charges are theirs until they are freed */
	secrets_exec_env(n, sb->id, &e->env);	/* out of memory: as asked */
	agent_req_of(e, &a);
	rc = agent_exec(sb->agent, &a, capture_output, &cap, &r, &err);
	exec_leave(n, sb);
	if (rc == KILN_OK) {
		/*
		 * The body grows from stdout's text: no second copy of it. What this and the server's
		 * copy hold stays inside the two texts' charges (twice their buffers) and the slack.
		 */
		struct buf *body = &cap.out.b;

		jtext_add(&cap.out, (const unsigned char *)"", 0, true);
		jtext_add(&cap.err, (const unsigned char *)"", 0, true);
		body->max = body->len + cap.err.b.len + 256;
		buf_appends(body, "\",\"stderr\":\"");
		if (cap.err.b.len)
			buf_append(body, cap.err.b.data, cap.err.b.len);
		charged += cap.out.charged + cap.err.charged;
		cap.out.charged = cap.err.charged = 0;
		buf_release(&cap.err.b);
		if (buf_appendf(body, "\",\"exit_code\":%d,\"duration_ms\":%llu,\"timed_out\":%s,"
				"\"stdout_truncated\":%s,\"stderr_truncated\":%s}", r.exit_code,
				(unsigned long long)r.duration_ms, r.timed_out ? "true" : "false",
				cap.out.cut ? "true" : "false", cap.err.cut ? "true" : "false") < 0) {
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
		} else {
			http_reply_data(req, 200, "application/json", body->data, body->len);
			/* the server's copy stays until the request ends: keep its bytes till then */
			if ((hold = malloc(sizeof(*hold)))) {
				hold->n = n;
				hold->bytes = body->len + EXEC_MEM_SLACK < charged ? body->len + EXEC_MEM_SLACK : charged;
				charged -= hold->bytes;
				http_req_set_hctx(req, hold, exec_hold_free);
			}
		}
	} else if (rc == KILN_E_INVALID || rc == KILN_E_TOO_LARGE || rc == KILN_E_RATE_LIMITED ||
		   rc == KILN_E_NOT_FOUND || rc == KILN_E_FORBIDDEN) {
		http_reply_error(req, rc, "%s", err.msg);
	} else {
		sandbox_failed(n, sb);
		http_reply_error(req, KILN_E_SANDBOX_FAILED, "the sandbox stopped answering");
	}
	jtext_release(&cap.out);
	jtext_release(&cap.err);
	exec_mem_give(n, charged);
	exec_req_free(e);
	sb_put(n, sb);
}

/* ---- processes: detached execs, by pid (docs/sandboxes.md) ---- */

/* Replies for a failed agent_proc_* call: what the guest refused it says; a dead guest is 502. */
static void proc_fail(struct http_req *req, struct node *n, struct sandbox *sb, enum kiln_err rc,
		      const struct kiln_error *err)
{
	/* the guest keeps an ended process (list, stream): it exists, but takes no signal, resize or
	   stdin (nor does a closed stdin) */
	if ((rc == KILN_E_NOT_FOUND && strstr(err->msg, "has ended")) ||
	    (rc == KILN_E_INVALID && strstr(err->msg, "is closed"))) {
		http_reply_error(req, KILN_E_CONFLICT, "%s", err->msg);
		return;
	}
	if (rc == KILN_E_RATE_LIMITED)
		http_reply_header(req, "Retry-After", "1");
	if (rc == KILN_E_INVALID || rc == KILN_E_TOO_LARGE || rc == KILN_E_RATE_LIMITED ||
	    rc == KILN_E_NOT_FOUND || rc == KILN_E_FORBIDDEN || rc == KILN_E_CONFLICT ||
	    rc == KILN_E_NOT_IMPLEMENTED || rc == KILN_E_NOMEM) {
		http_reply_error(req, rc, "%s", err->msg);
	} else {
		sandbox_failed(n, sb);
		http_reply_error(req, KILN_E_SANDBOX_FAILED, "the sandbox stopped answering");
	}
}

/* The running sandbox of a processes request and its {pid}; replies and returns NULL otherwise. */
static struct sandbox *proc_sandbox(struct http_req *req, uint32_t *pid)
{
	struct node *n = http_req_app(req);
	const char *p = http_req_param(req, "pid");
	struct sandbox *sb;
	char *end;
	unsigned long v = 0;

	if (pid) {
		errno = 0;
		v = p && p[0] >= '1' && p[0] <= '9' ? strtoul(p, &end, 10) : 0;
		if (!v || errno || *end || v > 0x7fffffffUL) {
			http_reply_error(req, KILN_E_NOT_FOUND, "no process \"%s\"", p ? p : "");
			return NULL;
		}
		*pid = (uint32_t)v;
	}
	sb = request_sandbox(req);
	if (sb && !require_running(req, sb)) {
		sb_put(n, sb);
		return NULL;
	}
	return sb;
}

/* POST /v1/sandboxes/{id}/processes: starts a detached process; 201 {"pid"}. */
static void processes_start(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	struct proc_req *pr = NULL;
	struct agent_proc_req a;
	struct sandbox *sb;
	uint32_t pid = 0;
	enum kiln_err rc;
	char body[64];

	if (nodereq_proc(text, len, &pr, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	if (!(sb = proc_sandbox(req, NULL))) {
		proc_req_free(pr);
		return;
	}
	secrets_exec_env(n, sb->id, &pr->e->env);	/* out of memory: as asked */
	memset(&a, 0, sizeof(a));
	agent_req_of(pr->e, &a.exec);
	a.tag = pr->tag;
	a.rows = (uint16_t)pr->rows;
	a.cols = (uint16_t)pr->cols;
	rc = agent_proc_start(sb->agent, &a, &pid, &err);
	if (rc == KILN_OK) {
		snprintf(body, sizeof(body), "{\"pid\":%u}", pid);
		http_reply_data(req, 201, "application/json", body, strlen(body));
	} else {
		proc_fail(req, n, sb, rc, &err);
	}
	proc_req_free(pr);
	sb_put(n, sb);
}

/* Appends a JSON array of the strings of `v` to `arr`; false when out of memory. */
static bool json_strv(json_t *arr, char **v)
{
	for (size_t i = 0; v && v[i]; i++) {
		/* guest bytes: invalid UTF-8 cannot be a JSON string, so it is shown as \ufffd */
		json_t *s = json_stringn(v[i], strlen(v[i]));

		if (!s)
			s = json_string("\xef\xbf\xbd");
		if (!s || json_array_append_new(arr, s) < 0)
			return false;
	}
	return true;
}

static int list_entry(void *ctx, const struct agent_proc_info *p)
{
	json_t *arr = ctx, *o = json_object(), *argv = json_array(), *env = json_array();

	if (!o || !argv || !env || !json_strv(argv, p->argv) || !json_strv(env, p->env_names)) {
		json_decref(o);
		json_decref(argv);
		json_decref(env);
		return -1;
	}
	json_object_set_new(o, "pid", json_integer(p->pid));
	json_object_set_new(o, "tag", json_stringn(p->tag, strlen(p->tag)) ? json_stringn(p->tag, strlen(p->tag)) : json_string(""));
	json_object_set_new(o, "argv", argv);
	json_object_set_new(o, "env", env);
	json_object_set_new(o, "cwd", json_stringn(p->cwd, strlen(p->cwd)) ? json_stringn(p->cwd, strlen(p->cwd)) : json_string(""));
	json_object_set_new(o, "pty", json_boolean(p->pty));
	json_object_set_new(o, "running", json_boolean(p->running));
	json_object_set_new(o, "exit_code", p->running ? json_null() : json_integer(p->exit_code));
	return json_array_append_new(arr, o) < 0 ? -1 : 0;
}

/* GET /v1/sandboxes/{id}/processes: the processes the guest keeps, running and ended. */
static void processes_list(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	struct sandbox *sb = proc_sandbox(req, NULL);
	json_t *arr, *o;
	enum kiln_err rc;
	char *text;

	if (!sb)
		return;
	arr = json_array();
	rc = arr ? agent_proc_list(sb->agent, list_entry, arr, &err)
		 : kiln_error_set(&err, KILN_E_NOMEM, "out of memory");
	if (rc == KILN_OK) {
		o = json_object();
		if (o && json_object_set(o, "processes", arr) == 0 &&
		    (text = json_dumps(o, JSON_COMPACT))) {
			http_reply_data(req, 200, "application/json", text, strlen(text));
			free(text);
		} else {
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
		}
		json_decref(o);
	} else {
		proc_fail(req, n, sb, rc, &err);
	}
	json_decref(arr);
	sb_put(n, sb);
}

struct attach_job {
	char request_id[24];
	struct node *n;
	struct sandbox *sb;	/* a reference */
	uint32_t pid;
	bool replay;
	struct pump *p;
	struct jtext out, err;
	int idle;		/* seconds of silence since the last line */
};

#define ATTACH_KEEPALIVE_S 10	/* a keepalive line after this much silence finds a client gone */

/* Sends `n` bytes of output (n <= SSE_CHUNK) as one NDJSON line; `final` flushes a held sequence. */
static int attach_line(struct attach_job *j, enum agent_stream s, const uint8_t *data, size_t n,
		       bool final)
{
	return jtext_frame(j->p, s == AGENT_STDOUT ? &j->out : &j->err, s,
			   "{\"type\":\"", "\",\"data\":\"", "\"}\n", data, n, final);
}

static int attach_output(void *ctx, enum agent_stream s, const uint8_t *data, size_t len)
{
	struct attach_job *j = ctx;

	if (!len) {
		if (++j->idle < ATTACH_KEEPALIVE_S)
			return 0;
		j->idle = 0;
		return pump_write(j->p, "{\"type\":\"keepalive\"}\n", 21) < 0 ? -1 : 0;
	}
	j->idle = 0;
	while (len > 0) {
		size_t n = len < SSE_CHUNK ? len : SSE_CHUNK;

		if (attach_line(j, s, data, n, false) < 0)
			return -1;	/* the client left: the process goes on */
		data += n;
		len -= n;
	}
	return 0;
}

static void attach_produce(struct pump *p, void *ctx)
{
	struct attach_job *j = ctx;
	struct agent_exec_result r = { 0 };
	struct kiln_error err = { 0 };
	uint64_t dropped = 0;
	enum kiln_err rc;
	char line[2048];

	j->p = p;
	pump_ready(p, 200, "application/x-ndjson");
	snprintf(line, sizeof(line), "{\"type\":\"start\",\"pid\":%u}\n", j->pid);
	if (pump_write(p, line, strlen(line)) < 0)
		return;
	rc = agent_proc_attach(j->sb->agent, j->pid, j->replay, attach_output, j, &dropped, &r, &err);
	if (rc == KILN_OK) {
		attach_line(j, AGENT_STDOUT, (const uint8_t *)"", 0, true);
		attach_line(j, AGENT_STDERR, (const uint8_t *)"", 0, true);
		snprintf(line, sizeof(line),
			 "{\"type\":\"exit\",\"exit_code\":%d,\"signal\":%d,\"timed_out\":%s,"
			 "\"duration_ms\":%llu,\"dropped_bytes\":%llu}\n",
			 r.exit_code, r.signal, r.timed_out ? "true" : "false",
			 (unsigned long long)r.duration_ms, (unsigned long long)dropped);
	} else if (rc == KILN_E_IO) {
		return;	/* the client left */
	} else {
		bool told = rc == KILN_E_NOT_FOUND || rc == KILN_E_CONFLICT || rc == KILN_E_NOT_IMPLEMENTED;
		json_t *msg = json_string(told ? err.msg : "the attach failed");
		char *m = msg ? json_dumps(msg, JSON_ENCODE_ANY) : NULL;

		if (rc == KILN_E_SANDBOX_FAILED)
			sandbox_failed(j->n, j->sb);
		snprintf(line, sizeof(line),
			 "{\"type\":\"error\",\"error\":{\"code\":\"%s\",\"message\":%s,\"request_id\":\"%s\"}}\n",
			 kiln_err_name(http_status_of(rc) == 500 ? KILN_E_INTERNAL : rc),
			 m ? m : "\"the attach failed\"", j->request_id);
		free(m);
		json_decref(msg);
	}
	pump_write(p, line, strlen(line));
}

static void attach_free(void *ctx)
{
	struct attach_job *j = ctx;

	exec_leave(j->n, j->sb);
	exec_mem_give(j->n, SSE_WINDOW);
	buf_release(&j->out.b);
	buf_release(&j->err.b);
	sb_put(j->n, j->sb);
	free(j);
}

/*
 * GET /v1/sandboxes/{id}/processes/{pid}/stream[?replay=0]: NDJSON of the process's output (the
 * buffered tail first, unless replay=0) and its exit. Counted as an exec (exec_max_per_*) and in
 * the node's exec memory while it streams. A client that leaves only detaches.
 */
static void processes_stream(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *replay = http_req_query(req, "replay");
	struct attach_job *j;
	struct sandbox *sb;
	struct pump *p;
	uint32_t pid;

	if (replay && strcmp(replay, "0") && strcmp(replay, "1")) {
		http_reply_error(req, KILN_E_INVALID, "replay must be 0 or 1");
		return;
	}
	if (!(sb = proc_sandbox(req, &pid)))
		return;
	if (!exec_enter(req, n, sb)) {
		sb_put(n, sb);
		return;
	}
	if (!exec_mem_admit(req, n, SSE_WINDOW)) {
		exec_leave(n, sb);
		sb_put(n, sb);
		return;
	}
	if (!(j = calloc(1, sizeof(*j)))) {
		exec_mem_give(n, SSE_WINDOW);
		exec_leave(n, sb);
		sb_put(n, sb);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	snprintf(j->request_id, sizeof(j->request_id), "%s", http_req_id(req));
	j->n = n;
	j->sb = sb;
	j->pid = pid;
	j->replay = !replay || strcmp(replay, "0") != 0;
	jtext_init(&j->out, SSE_CHUNK * 6 + 16, NULL, NULL);
	jtext_init(&j->err, SSE_CHUNK * 6 + 16, NULL, NULL);
	j->out.b.max = j->err.b.max = SSE_EVENT_MAX;
	p = pump_start(attach_produce, j, attach_free);
	if (!p) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	pump_wait_ready(p, NULL, 0);
	http_reply_stream(req, 200, "application/x-ndjson", pump_read, p, pump_release);
}

#define PROC_STDIN_BODY_MAX (1u << 20)	/* bytes of one stdin request */

/* POST /v1/sandboxes/{id}/processes/{pid}/stdin[?eof=1]: the body's bytes to its stdin; 204. */
static void processes_stdin(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	const char *eof = http_req_query(req, "eof");
	size_t len, off = 0;
	const char *body = http_req_body(req, &len);
	enum kiln_err rc = KILN_OK;
	struct sandbox *sb;
	uint32_t pid;

	if (eof && strcmp(eof, "0") && strcmp(eof, "1")) {
		http_reply_error(req, KILN_E_INVALID, "eof must be 0 or 1");
		return;
	}
	if (len > PROC_STDIN_BODY_MAX) {
		http_reply_error(req, KILN_E_TOO_LARGE, "stdin of at most %u bytes at once",
				 PROC_STDIN_BODY_MAX);
		return;
	}
	if (!(sb = proc_sandbox(req, &pid)))
		return;
	bool end = eof && !strcmp(eof, "1");

	do {
		size_t k = len - off < AGENT_PROC_STDIN_CHUNK ? len - off : AGENT_PROC_STDIN_CHUNK;

		rc = agent_proc_stdin(sb->agent, pid, body + off, k, end && off + k == len, &err);
		off += k;
	} while (rc == KILN_OK && off < len);
	if (rc == KILN_OK)
		http_reply_empty(req, 204);
	else
		proc_fail(req, n, sb, rc, &err);
	sb_put(n, sb);
}

/* A signal's name (SIGTERM or TERM) or number; 0 when unknown. */
static int signal_of(const json_t *v)
{
	static const struct {
		const char *name;
		int no;
	} sigs[] = { { "HUP", 1 }, { "INT", 2 },	{ "QUIT", 3 },	{ "KILL", 9 }, { "USR1", 10 },
		     { "USR2", 12 }, { "TERM", 15 }, { "CONT", 18 }, { "STOP", 19 }, { "WINCH", 28 } };
	const char *s;

	if (json_is_integer(v))
		return json_integer_value(v) >= 1 && json_integer_value(v) <= 64 ? (int)json_integer_value(v) : 0;
	if (!json_is_string(v))
		return 0;
	s = json_string_value(v);
	if (!strncmp(s, "SIG", 3))
		s += 3;
	for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
		if (!strcmp(s, sigs[i].name))
			return sigs[i].no;
	return 0;
}

/* POST /v1/sandboxes/{id}/processes/{pid}/signal {"signal"}: 204. */
static void processes_signal(struct http_req *req)
{
	static const struct json_field fields[] = { { "signal", JF_ANY, true, 0 } };
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	json_t *body = NULL;
	struct sandbox *sb;
	enum kiln_err rc;
	uint32_t pid;
	int sig;

	if (json_parse_body(text, len, fields, 1, &body, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	sig = signal_of(json_object_get(body, "signal"));
	json_decref(body);
	if (!sig) {
		http_reply_error(req, KILN_E_INVALID, "signal must be a signal's name (SIGTERM, SIGKILL, "
				 "SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCONT, SIGSTOP, SIGWINCH) or "
				 "number 1..64");
		return;
	}
	if (!(sb = proc_sandbox(req, &pid)))
		return;
	rc = agent_proc_signal(sb->agent, pid, sig, &err);
	if (rc == KILN_OK)
		http_reply_empty(req, 204);
	else
		proc_fail(req, n, sb, rc, &err);
	sb_put(n, sb);
}

/* POST /v1/sandboxes/{id}/processes/{pid}/resize {"rows", "cols"}: a PTY's new size; 204. */
static void processes_resize(struct http_req *req)
{
	static const struct json_field fields[] = { { "rows", JF_INT, true, 0 },
						    { "cols", JF_INT, true, 0 } };
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	json_t *body = NULL;
	struct sandbox *sb;
	enum kiln_err rc;
	long long rows, cols;
	uint32_t pid;

	if (json_parse_body(text, len, fields, 2, &body, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	rows = json_int(body, "rows", 0);
	cols = json_int(body, "cols", 0);
	json_decref(body);
	if (rows < 1 || rows > AGENT_PROC_PTY_MAX || cols < 1 || cols > AGENT_PROC_PTY_MAX) {
		http_reply_error(req, KILN_E_INVALID, "rows and cols must be from 1 to %d",
				 AGENT_PROC_PTY_MAX);
		return;
	}
	if (!(sb = proc_sandbox(req, &pid)))
		return;
	rc = agent_proc_resize(sb->agent, pid, (uint16_t)rows, (uint16_t)cols, &err);
	if (rc == KILN_OK)
		http_reply_empty(req, 204);
	else
		proc_fail(req, n, sb, rc, &err);
	sb_put(n, sb);
}

/* ---- directory watches (docs/sandboxes.md) ---- */

#define WATCH_WAIT_DEFAULT_MS 0

/* proc_fail() for a watch: an I/O error in the guest (inotify's limits) is the guest's, not a
 * failed sandbox. */
static void watch_fail(struct http_req *req, struct node *n, struct sandbox *sb, enum kiln_err rc,
		       const struct kiln_error *err)
{
	if (rc == KILN_E_IO)
		http_reply_error(req, KILN_E_INTERNAL, "%s", err->msg);
	else
		proc_fail(req, n, sb, rc, err);
}

/* The {wid} of a watches request; 0 after replying 404. */
static uint32_t watch_id(struct http_req *req)
{
	const char *p = http_req_param(req, "wid");
	unsigned long v = 0;
	char *end = NULL;

	errno = 0;
	if (p && p[0] >= '1' && p[0] <= '9')
		v = strtoul(p, &end, 10);
	if (!v || errno || *end || v > UINT32_MAX) {
		http_reply_error(req, KILN_E_NOT_FOUND, "no watch \"%.32s\"", p ? p : "");
		return 0;
	}
	return (uint32_t)v;
}

/* POST /v1/sandboxes/{id}/watches {"path", "recursive"?, "user"?}: 201 {"id"}. */
static void watches_add(struct http_req *req)
{
	static const struct json_field fields[] = { { "path", JF_STRING, true, 4095 },
						    { "recursive", JF_BOOL, false, 0 },
						    { "user", JF_STRING, false, 64 } };
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len), *user = NULL, *path;
	json_t *body = NULL;
	struct sandbox *sb;
	enum kiln_err rc;
	uint32_t wid = 0;
	char out[64];

	if (json_parse_body(text, len, fields, 3, &body, &err) != KILN_OK ||
	    nodereq_user(json_string_value(json_object_get(body, "user")), &user, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		json_decref(body);
		return;
	}
	path = json_string_value(json_object_get(body, "path"));
	if (path[0] != '/') {
		http_reply_error(req, KILN_E_INVALID, "path must be an absolute path inside the sandbox");
		json_decref(body);
		return;
	}
	if ((sb = proc_sandbox(req, NULL))) {
		rc = agent_watch_add(sb->agent, path, json_is_true(json_object_get(body, "recursive")),
				     user, &wid, &err);
		if (rc == KILN_OK) {
			snprintf(out, sizeof(out), "{\"id\":%u}", wid);
			http_reply_data(req, 201, "application/json", out, strlen(out));
		} else {
			watch_fail(req, n, sb, rc, &err);
		}
		sb_put(n, sb);
	}
	json_decref(body);
}

static int watch_event(void *ctx, int type, const char *name)
{
	static const char *const names[] = { "", "create", "write", "remove", "rename", "chmod" };
	json_t *o = json_pack("{s:s, s:s%}", "type", names[type], "name", name, strlen(name));

	/* guest bytes: a name that is not UTF-8 is shown as \ufffd */
	if (!o)
		o = json_pack("{s:s, s:s}", "type", names[type], "name", "\xef\xbf\xbd");
	return !o || json_array_append_new(ctx, o) < 0 ? -1 : 0;
}

/*
 * GET /v1/sandboxes/{id}/watches/{wid}[?wait_ms=N]: the events queued, waiting up to N ms
 * (<= 30000) for the first; 200 {"events", "dropped", "ended"}.
 */
static void watches_read(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	const char *q = http_req_query(req, "wait_ms");
	unsigned long wait = WATCH_WAIT_DEFAULT_MS;
	json_t *events = NULL, *o = NULL;
	struct sandbox *sb;
	bool dropped = false, ended = false;
	enum kiln_err rc;
	uint32_t wid;
	char *end = NULL;

	if (q) {
		errno = 0;
		wait = strtoul(q, &end, 10);
		if (!q[0] || *end || errno || wait > AGENT_WATCH_WAIT_MS_MAX || q[0] == '-') {
			http_reply_error(req, KILN_E_INVALID, "wait_ms must be from 0 to %d",
					 AGENT_WATCH_WAIT_MS_MAX);
			return;
		}
	}
	if (!(wid = watch_id(req)) || !(sb = proc_sandbox(req, NULL)))
		return;
	events = json_array();
	rc = events ? agent_watch_read(sb->agent, wid, (uint32_t)wait, watch_event, events, &dropped,
				       &ended, &err)
		    : kiln_error_set(&err, KILN_E_NOMEM, "out of memory");
	if (rc == KILN_OK &&
	    (o = json_pack("{s:O, s:b, s:b}", "events", events, "dropped", dropped, "ended", ended)))
		http_reply_json(req, 200, o);
	else if (rc == KILN_OK)
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
	else
		watch_fail(req, n, sb, rc, &err);
	json_decref(events);
	sb_put(n, sb);
}

/* DELETE /v1/sandboxes/{id}/watches/{wid}: 204. */
static void watches_remove(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	struct sandbox *sb;
	enum kiln_err rc;
	uint32_t wid;

	if (!(wid = watch_id(req)) || !(sb = proc_sandbox(req, NULL)))
		return;
	rc = agent_watch_remove(sb->agent, wid, &err);
	if (rc == KILN_OK)
		http_reply_empty(req, 204);
	else
		watch_fail(req, n, sb, rc, &err);
	sb_put(n, sb);
}

/* ---- files ---- */

/*
 * The ?path= and ?user= of a files request, checked: *user is NULL for root (nodereq_user).
 * Replies 422 and returns NULL when bad.
 */
static const char *file_path(struct http_req *req, const char **user)
{
	const char *path = http_req_query(req, "path");
	struct kiln_error err = { 0 };

	if (!path || path[0] != '/' || strlen(path) > 4095) {
		http_reply_error(req, KILN_E_INVALID,
				 "path must be an absolute path inside the sandbox");
		return NULL;
	}
	if (nodereq_user(http_req_query(req, "user"), user, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return NULL;
	}
	return path;
}

struct upload {
	struct node *n;
	struct sandbox *sb;
	char path[4096];
	char user[64];		/* empty: root */
	int wfd;		/* the sink writes the body here */
	int rfd;		/* the writer thread reads it from here */
	pthread_t thread;
	bool started;
	volatile bool complete;	/* the whole body arrived: the end of the pipe is the file's */
	enum kiln_err rc;
	struct kiln_error err;
};

/*
 * The writer's source: the pipe. Its end is the end of the file only when the whole body
 * arrived; otherwise the write is abandoned, and the guest keeps the file as it was.
 */
static long upload_source(void *ctx, uint8_t *buf, size_t cap)
{
	struct upload *u = ctx;
	ssize_t n;

	do
		n = read(u->rfd, buf, cap);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	if (n == 0 && !u->complete)
		return -ECANCELED;
	return n;
}

static void *upload_thread(void *arg)
{
	struct upload *u = arg;

	u->rc = agent_file_write_as(u->sb->agent, u->path, 0644, u->user[0] ? u->user : NULL,
				    upload_source, u, FILE_MAX, &u->err);
	return NULL;
}

/* Ends the writer: `complete` says whether the body arrived whole. Idempotent. */
static void upload_finish(struct upload *u, bool complete)
{
	if (!u->started)
		return;
	u->complete = complete;
	close(u->wfd);
	u->wfd = -1;
	pthread_join(u->thread, NULL);
	u->started = false;
}

static void upload_free(void *p)
{
	struct upload *u = p;

	upload_finish(u, false);
	if (u->wfd >= 0)
		close(u->wfd);
	if (u->rfd >= 0)
		close(u->rfd);
	sb_put(u->n, u->sb);
	free(u);
}

/* Starts the writer on the first piece of the body (or at its end, for an empty one). */
static enum kiln_err upload_begin(struct http_req *req, struct upload **out)
{
	struct node *n = http_req_app(req);
	const char *path = http_req_query(req, "path"), *id = http_req_param(req, "id"), *user;
	struct upload *u;
	int fds[2];

	*out = http_req_hctx(req);
	if (*out)
		return KILN_OK;
	if (!path || path[0] != '/' || strlen(path) > 4095 ||
	    nodereq_user(http_req_query(req, "user"), &user, NULL) != KILN_OK)
		return KILN_E_INVALID;
	u = calloc(1, sizeof(*u));
	if (!u)
		return KILN_E_NOMEM;
	u->n = n;
	u->wfd = u->rfd = -1;
	http_req_set_hctx(req, u, upload_free);
	*out = u;
	u->sb = sb_get(n, id);
	if (!u->sb || strcmp(u->sb->tenant_id, claims_of(req)->tid) != 0)
		return KILN_E_NOT_FOUND;
	if (u->sb->state != SB_RUNNING || !u->sb->agent)
		return KILN_E_CONFLICT;
	snprintf(u->path, sizeof(u->path), "%s", path);
	snprintf(u->user, sizeof(u->user), "%s", user ? user : "");
	if (pipe2(fds, O_CLOEXEC) != 0)
		return KILN_E_IO;
	u->rfd = fds[0];
	u->wfd = fds[1];
	if (pthread_create(&u->thread, NULL, upload_thread, u) != 0)
		return KILN_E_NOMEM;
	u->started = true;
	return KILN_OK;
}

static enum kiln_err upload_sink(struct http_req *req, const char *data, size_t len)
{
	struct upload *u;
	enum kiln_err rc = upload_begin(req, &u);

	if (rc != KILN_OK)
		return rc;
	while (len) {
		ssize_t w = write(u->wfd, data, len);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return KILN_E_SANDBOX_FAILED;	/* the writer stopped: its result says why */
		data += w;
		len -= (size_t)w;
	}
	return KILN_OK;
}

static void files_put(struct http_req *req)
{
	struct kiln_error serr = { 0 };
	enum kiln_err src = http_req_stream_error(req, &serr);
	struct upload *u = http_req_hctx(req);
	bool ran = u && u->started;

	if (ran)
		upload_finish(u, src == KILN_OK);
	if (src == KILN_E_TOO_LARGE)
		http_reply_error(req, src, "a file is at most 100 MiB");
	else if (ran && u->rc != KILN_OK && u->rc != KILN_E_IO) {
		if (u->rc == KILN_E_SANDBOX_FAILED)
			sandbox_failed(u->n, u->sb);
		http_reply_error(req, u->rc, "%s", u->err.msg);
	} else if (src == KILN_E_NOT_FOUND)
		http_reply_error(req, src, "no sandbox \"%s\"", http_req_param(req, "id"));
	else if (src == KILN_E_CONFLICT)
		http_reply_error(req, src, "the sandbox is not running");
	else if (src == KILN_E_INVALID)
		http_reply_error(req, src, "path must be an absolute path inside the sandbox, user a "
				 "user name");
	else if (src != KILN_OK || (ran && u->rc != KILN_OK))
		http_reply_error(req, KILN_E_SANDBOX_FAILED, "the upload failed");
	else
		http_reply_empty(req, 204);
}

struct download {
	struct node *n;
	struct sandbox *sb;
	char request_id[24];
	char path[4096];
	char user[64];		/* empty: root */
	struct pump *p;
	bool sent;
};

static int download_sink(void *ctx, const uint8_t *data, size_t len)
{
	struct download *d = ctx;

	if (!d->sent) {
		pump_ready(d->p, 200, "application/octet-stream");
		d->sent = true;
	}
	return pump_write(d->p, data, len);
}

static void download_produce(struct pump *p, void *ctx)
{
	struct download *d = ctx;
	struct kiln_error err = { 0 };
	uint64_t size = 0;
	enum kiln_err rc;

	d->p = p;
	rc = agent_file_read_as(d->sb->agent, d->path, d->user[0] ? d->user : NULL, download_sink, d,
				FILE_MAX, &size, &err);
	if (rc == KILN_OK && !d->sent)
		pump_ready(p, 200, "application/octet-stream");
	else if (rc != KILN_OK && !d->sent) {
		char body[512];
		json_t *msg = json_string(rc == KILN_E_NOT_FOUND ? "no such file" : err.msg);
		char *m = json_dumps(msg, JSON_ENCODE_ANY);
		/* what the guest said of the file, else the sandbox failed */
		enum kiln_err code = rc == KILN_E_NOT_FOUND || rc == KILN_E_INVALID ||
					     rc == KILN_E_TOO_LARGE || rc == KILN_E_FORBIDDEN
				     ? rc : KILN_E_SANDBOX_FAILED;

		if (rc == KILN_E_SANDBOX_FAILED)
			sandbox_failed(d->n, d->sb);
		pump_ready(p, http_status_of(code), "application/json");
		snprintf(body, sizeof(body),
			 "{\"error\":{\"code\":\"%s\",\"message\":%s,\"request_id\":\"%s\"}}",
			 kiln_err_name(code), m ? m : "\"\"", d->request_id);
		free(m);
		json_decref(msg);
		pump_write(p, body, strlen(body));
	}
	/* An error after bytes were sent can only cut the stream short. */
}

static void download_free(void *ctx)
{
	struct download *d = ctx;

	sb_put(d->n, d->sb);
	free(d);
}

static void files_get(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *user, *path = file_path(req, &user);
	struct download *d;
	struct sandbox *sb;
	struct pump *p;
	char type[128];
	int status;

	if (!path)
		return;
	sb = request_sandbox(req);
	if (!sb || !require_running(req, sb)) {
		sb_put(n, sb);
		return;
	}
	d = calloc(1, sizeof(*d));
	if (!d) {
		sb_put(n, sb);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	d->n = n;
	d->sb = sb;
	snprintf(d->request_id, sizeof(d->request_id), "%s", http_req_id(req));
	snprintf(d->path, sizeof(d->path), "%s", path);
	snprintf(d->user, sizeof(d->user), "%s", user ? user : "");
	p = pump_start(download_produce, d, download_free);
	if (!p) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	status = pump_wait_ready(p, type, sizeof(type));
	http_reply_stream(req, status ? status : http_status_of(KILN_E_SANDBOX_FAILED),
			  type[0] ? type : "application/json", pump_read, p, pump_release);
}

static void healthz(struct http_req *req)
{
	struct node *n = http_req_app(req);

	pthread_mutex_lock(&n->reg_lock);
	http_reply_json(req, 200,
			json_pack("{s:s, s:s, s:i, s:i, s:i}", "status", "ok", "node", n->cfg.node_id,
				  "sandboxes", (int)n->count, "vcpu_milli_used",
				  (int)n->used_vcpu_milli, "memory_mib_used", (int)n->used_mem_mib));
	pthread_mutex_unlock(&n->reg_lock);
}

/* ---- pause, resume, fork, snapshots ---- */

/* Replies for a sandbox this node does not run: 409 naming its state, or 404. */
static void reply_not_running(struct http_req *req, const char *want)
{
	struct node *n = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct record r;

	if (record_of(n, id, claims_of(req)->tid, &r, &err) != KILN_OK)
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
	else if (!r.found)
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
	else
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s, not %s", r.state, want);
}

/* The running sandbox of the request (a reference), or NULL after replying. */
static struct sandbox *running_sandbox(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct sandbox *sb = sb_get(n, http_req_param(req, "id"));

	if (sb && strcmp(sb->tenant_id, claims_of(req)->tid) != 0) {
		sb_put(n, sb);
		sb = NULL;
	}
	if (sb && sb->state == SB_RUNNING)
		return sb;
	if (sb && sb->state == SB_ERROR)
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox has failed");
	else if (sb)
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb_state_name(sb->state));
	else
		reply_not_running(req, "running");
	sb_put(n, sb);
	return NULL;
}

static void sandbox_pause(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct sandbox *sb = running_sandbox(req);
	struct kiln_error err = { 0 };
	enum kiln_err rc;
	bool forced;

	if (!sb)
		return;
	pthread_mutex_lock(&sb->lock);
	/*
	 * kiln-meter's pause of a tenant out of credits, and a suspension's, are never refused for
	 * the plan; no resume is near for them, so no VMM is started ahead.
	 */
	forced = pause_sub_forced(claims_of(req)->sub);
	rc = sb_pause(n, sb, forced, !forced, &err);
	pthread_mutex_unlock(&sb->lock);
	if (rc != KILN_OK)
		http_reply_error(req, rc == KILN_E_CONFLICT || rc == KILN_E_UNAVAILABLE || rc == KILN_E_QUOTA ? rc
										 : KILN_E_SANDBOX_FAILED,
				 "the sandbox could not be paused: %s", err.msg);
	else
		reply_sandbox(req, 200, sb->id);
	sb_put(n, sb);
}

static void sandbox_resume(struct http_req *req)
{
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	enum kiln_err rc = resume_sandbox(http_req_app(req), id, claims_of(req)->tid, &err);

	if (rc != KILN_OK)
		http_reply_error(req, rc, "%s", err.msg);
	else
		reply_sandbox(req, 200, id);
}

static void sandbox_fork(struct http_req *req)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	size_t len, count;
	const char *text = http_req_body(req, &len);
	const char *idv[NODEREQ_FORK_MAX];
	json_t *body = NULL, *out;
	struct sandbox *parent;
	enum kiln_err rc;

	if (nodereq_fork(text, len, &body, idv, &count, &err) != KILN_OK) {
		json_decref(body);
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	parent = running_sandbox(req);
	if (!parent) {
		json_decref(body);
		return;
	}
	rc = fork_sandbox(n, parent, claims_of(req)->tid, idv, count, &err);
	sb_put(n, parent);
	if (rc != KILN_OK) {
		http_reply_error(req, rc, "%s", err.msg);
		json_decref(body);
		return;
	}
	out = json_array();
	for (size_t i = 0; i < count; i++) {
		json_t *sb = sandbox_json_of(n, idv[i]);
		if (sb)
			json_array_append_new(out, sb);
	}
	json_decref(body);
	http_reply_json(req, 201, json_pack("{s:o}", "sandboxes", out));
}

/* Copies a paused sandbox's snapshot files into a new snapshot directory (holes kept). */
static enum kiln_err copy_snapshot(const char *from, const char *to, struct kiln_error *err)
{
	static const char *const files[] = { "state", "mem", "disk.qcow2", "netpolicy.json" };
	char a[700], b[700];
	int r;

	if (mkdir(to, 0700) != 0)
		return kiln_error_set(err, KILN_E_IO, "cannot create \"%s\"", to);
	for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
		snprintf(a, sizeof(a), "%s/%s", from, files[i]);
		snprintf(b, sizeof(b), "%s/%s", to, files[i]);
		if (access(a, F_OK) != 0)
			continue;
		r = disk_file_copy(a, b);
		if (r < 0)
			return kiln_error_set(err, KILN_E_IO, "cannot copy \"%s\": %s", a, strerror(-r));
	}
	/* The driver's part of the manifest describes these files: keep it, hashes are redone. */
	snprintf(a, sizeof(a), "%s/manifest.json", from);
	snprintf(b, sizeof(b), "%s/manifest.json", to);
	r = disk_file_copy(a, b);
	return r < 0 ? kiln_error_set(err, KILN_E_IO, "cannot copy the manifest") : KILN_OK;
}

/* POST /v1/sandboxes/{id}/snapshots: a named snapshot of a running or paused sandbox. */
static void sandbox_snapshot(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	size_t len;
	const char *text = http_req_body(req, &len);
	struct sandbox *sb = NULL, paused = { 0 };
	struct record r;
	char snap[AUTH_ID_MAX], dir[600], from[600], *name = NULL;
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc;

	if (nodereq_snapshot(text, len, &name, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		return;
	}
	if (auth_new_id("snap_", snap, sizeof(snap)) != KILN_OK) {
		free(name);
		http_reply_error(req, KILN_E_INTERNAL, "cannot make an id");
		return;
	}
	snap_dir(n, snap, dir, sizeof(dir));
	sb = sb_get(n, id);
	if (sb && strcmp(sb->tenant_id, claims_of(req)->tid) != 0) {
		sb_put(n, sb);
		sb = NULL;
	}
	if (sb) {
		pthread_mutex_lock(&sb->lock);
		if (sb->state != SB_RUNNING || !sb->vm) {
			rc = kiln_error_set(&err, KILN_E_CONFLICT, "the sandbox is %s",
					    sb_state_name(sb->state));
		} else {
			/* The VM stops for the save and goes on: memory and disk copied whole. */
			rc = save_policy_public(sb, dir, &err);
			if (rc == KILN_OK)
				rc = vmm_snapshot(sb->vm, dir, VMM_SNAP_FULL, &err);
			if (sb->vm) {
				struct kiln_error ignore = { 0 };
				vmm_resume(sb->vm, &ignore);
			}
			if (rc == KILN_OK)
				rc = write_manifest_public(n, sb, dir, &err);
		}
	} else {
		if (record_of(n, id, claims_of(req)->tid, &r, &err) != KILN_OK)
			rc = KILN_E_UNAVAILABLE;
		else if (!r.found)
			rc = kiln_error_set(&err, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		else if (strcmp(r.state, "paused") != 0 || !r.pause_snapshot[0])
			rc = kiln_error_set(&err, KILN_E_CONFLICT, "the sandbox is %s", r.state);
		else {
			snap_dir(n, r.pause_snapshot, from, sizeof(from));
			rc = copy_snapshot(from, dir, &err);
			snprintf(paused.id, sizeof(paused.id), "%s", id);
			snprintf(paused.tenant_id, sizeof(paused.tenant_id), "%s", claims_of(req)->tid);
			paused.vcpu_milli = r.vcpu_milli;
			paused.mem_mib = r.mem_mib;
			paused.disk_gib = r.disk_gib;
			if (rc == KILN_OK)
				rc = write_manifest_public(n, &paused, dir, &err);
		}
	}
	if (rc == KILN_OK)
		rc = pg_acquire(n->pg, &c, &err);
	if (rc == KILN_OK) {
		rc = snap_record_public(n, c, sb ? sb : &paused, snap, "named", name, dir, &err);
		/* A paused sandbox's snapshot also stands on its pause snapshot's disk chain. */
		if (rc == KILN_OK && !sb)
			rc = PGQ(c, NULL, &err,
				 "UPDATE snapshots SET lineage = lineage || $2::text WHERE id = $1", snap,
				 r.pause_snapshot);
		if (rc == KILN_OK)
			rc = PGQ(c, &res, &err, "SELECT snapshot_json(s)::text FROM snapshots s WHERE id = $1",
				 snap);
		if (rc == KILN_OK && pg_res_rows(res) == 1) {
			const char *j = pg_res_str(res, 0, 0);
			http_req_set_object(req, snap);
			http_reply_data(req, 201, "application/json", j, strlen(j));
		}
		pg_res_free(res);
		pg_release(n->pg, c);
	}
	if (sb)
		pthread_mutex_unlock(&sb->lock);
	if (rc != KILN_OK) {
		snap_remove_files(dir);
		http_reply_error(req, rc == KILN_E_CONFLICT || rc == KILN_E_NOT_FOUND ||
					      rc == KILN_E_UNAVAILABLE ? rc : KILN_E_SANDBOX_FAILED,
				 "%s", err.msg);
	} else {
		log_info("snapshot \"%s\" of \"%s\" taken", snap, id);
		snap_upload(n, snap, claims_of(req)->tid);
	}
	sb_put(n, sb);
	free(name);
}

/* ---- PUT /v1/builds/{id}/source: a template version's build context (build.c) ---- */

static enum kiln_err build_sink(struct http_req *req, const char *data, size_t len)
{
	return build_source_sink(req, claims_of(req)->tid, data, len);
}

static void build_source(struct http_req *req)
{
	build_source_done(req, claims_of(req)->tid);
}

#define TOKEN 1u	/* the route needs a node token */

const struct http_route node_routes[] = {
	{ "GET", "/healthz", healthz, 0, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}", sandbox_create, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "DELETE", "/v1/sandboxes/{id}", sandbox_delete, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/timeout", sandbox_timeout, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/exec", sandbox_exec, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes", processes_start, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/processes", processes_list, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/processes/{pid}/stream", processes_stream, TOKEN, HTTP_BODY_BUFFER,
	  NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes/{pid}/stdin", processes_stdin, TOKEN, HTTP_BODY_BUFFER,
	  NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/processes/{pid}/signal", processes_signal, TOKEN,
	  HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/watches", watches_add, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/watches/{wid}", watches_read, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "DELETE", "/v1/sandboxes/{id}/watches/{wid}", watches_remove, TOKEN, HTTP_BODY_BUFFER, NULL,
	  0 },
	{ "POST", "/v1/sandboxes/{id}/processes/{pid}/resize", processes_resize, TOKEN,
	  HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/ports/{port}/stream", ports_stream, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/files", files_put, TOKEN, HTTP_BODY_STREAM, upload_sink,
	  FILE_MAX },
	{ "GET", "/v1/sandboxes/{id}/files", files_get, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/egress", sandbox_egress, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/egress", sandbox_egress, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/bandwidth", sandbox_bandwidth, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/bandwidth", sandbox_bandwidth, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/secrets", sandbox_secrets, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/pause", sandbox_pause, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/resume", sandbox_resume, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/fork", sandbox_fork, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/snapshots", sandbox_snapshot, TOKEN, HTTP_BODY_BUFFER, NULL, 0 },
	{ "PUT", "/v1/builds/{id}/source", build_source, TOKEN, HTTP_BODY_STREAM, build_sink,
	  (size_t)1 << 42 },
};
const size_t node_routes_len = sizeof(node_routes) / sizeof(node_routes[0]);
