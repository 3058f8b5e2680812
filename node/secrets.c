/*
 * secrets.c - a sandbox's secrets on kiln-node (see secrets.h).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/http.h"
#include "common/log.h"
#include "node/secrets.h"
#include "vmm/agent.h"

/* The node's master key, when it offers secrets. */
static const struct auth_master_key *node_key(struct node *n)
{
	return n->inject ? &n->mk : NULL;
}

static enum kiln_err need_key(struct node *n, struct kiln_error *err)
{
	if (!n->inject)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED,
				      "secrets need a master key on the sandbox's node");
	return KILN_OK;
}

enum kiln_err secrets_store(struct node *n, const char *sandbox_id, const char *tenant_id,
			    const struct secrets_set *set, struct kiln_error *err)
{
	return secretsdb_store(n->pg, node_key(n), sandbox_id, tenant_id, set, err);
}

enum kiln_err secrets_load(struct node *n, const char *sandbox_id, const char *tenant_id,
			   struct secrets_set *out, struct kiln_error *err)
{
	return secretsdb_load(n->pg, node_key(n), sandbox_id, tenant_id, out, err);
}

void secrets_forget(struct node *n, const char *sandbox_id)
{
	struct kiln_error err = { 0 };

	if (secretsdb_forget(n->pg, sandbox_id, &err) != KILN_OK)
		log_warn("the secrets of deleted sandbox \"%s\" stay (sealed): %s", sandbox_id,
			 err.msg);
}

/* The bytes of one text for agent_file_write. */
struct text_src {
	const char *p;
	size_t left;
};

static long text_source(void *ctx, uint8_t *buf, size_t len)
{
	struct text_src *t = ctx;
	size_t k = t->left < len ? t->left : len;

	memcpy(buf, t->p, k);
	t->p += k;
	t->left -= k;
	return (long)k;
}

/* Collects a file the guest sends (its CA bundle), up to 4 MiB. */
struct grow_buf {
	char *p;
	size_t len;
};

static int grow_sink(void *ctx, const uint8_t *data, size_t len)
{
	struct grow_buf *b = ctx;
	char *np = realloc(b->p, b->len + len + 1);

	if (!np)
		return -ENOMEM;
	memcpy(np + b->len, data, len);
	b->p = np;
	b->len += len;
	b->p[b->len] = '\0';
	return 0;
}

/*
 * Puts the tenant's CA into the guest's trust: its own file (NODE_EXTRA_CA_CERTS) and appended to
 * the system bundle, unless the bundle has it already (a resume, a fork).
 */
static enum kiln_err guest_trust(struct sandbox *sb, const char *pem, struct kiln_error *err)
{
	struct text_src src = { pem, strlen(pem) };
	struct grow_buf b = { NULL, 0 };
	enum kiln_err rc;

	if (!sb->agent)
		return kiln_error_set(err, KILN_E_CONFLICT, "the sandbox is not running");
	rc = agent_file_write(sb->agent, SECRETS_GUEST_CA, 0644, text_source, &src, 65536, err);
	if (rc == KILN_OK)
		rc = agent_file_read(sb->agent, SECRETS_GUEST_BUNDLE, grow_sink, &b, 4u << 20, NULL,
				     err);
	if (rc == KILN_E_NOT_FOUND) {
		kiln_error_clear(err);
		rc = KILN_OK;
	}
	if (rc == KILN_OK && !(b.p && strstr(b.p, pem))) {
		size_t plen = strlen(pem);
		bool nl = b.len && b.p[b.len - 1] != '\n';
		char *all = malloc(b.len + plen + 2);

		if (!all) {
			free(b.p);
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		}
		if (b.len)
			memcpy(all, b.p, b.len);
		if (nl)
			all[b.len] = '\n';
		memcpy(all + b.len + nl, pem, plen);
		src = (struct text_src){ all, b.len + nl + plen };
		rc = agent_file_write(sb->agent, SECRETS_GUEST_BUNDLE, 0644, text_source, &src,
				      8u << 20, err);
		free(all);
	}
	free(b.p);
	return rc;
}

/* The tenant's CA (a reference in *ca), put into the guest's trust. */
static enum kiln_err trust_prepare(struct node *n, struct sandbox *sb, struct tenant_ca **ca,
				   struct kiln_error *err)
{
	struct pg_conn *c = NULL;
	enum kiln_err rc;

	*ca = NULL;
	rc = need_key(n, err);
	if (rc == KILN_OK)
		rc = pg_acquire(n->pg, &c, err);
	if (rc == KILN_OK) {
		rc = tenantca_load(c, &n->mk, sb->tenant_id, ca, err);
		pg_release(n->pg, c);
	}
	if (rc == KILN_OK)
		rc = guest_trust(sb, tenantca_cert_pem(*ca), err);
	if (rc != KILN_OK) {
		tenantca_put(*ca);
		*ca = NULL;
	}
	return rc;
}

enum kiln_err secrets_activate(struct node *n, struct sandbox *sb, struct secrets_set *set,
			       struct kiln_error *err)
{
	struct tenant_ca *ca = NULL;
	enum kiln_err rc;

	if (!set->n) {
		inject_drop(n->inject, sb->id);
		return KILN_OK;
	}
	rc = trust_prepare(n, sb, &ca, err);
	if (rc == KILN_OK)
		rc = inject_set(n->inject, sb->id, ca, set->s, set->n, err);
	tenantca_put(ca);
	return rc;
}

enum kiln_err secrets_restore(struct node *n, struct sandbox *sb, struct kiln_error *err)
{
	struct secrets_set set;
	enum kiln_err rc = secrets_load(n, sb->id, sb->tenant_id, &set, err);

	if (rc == KILN_OK)
		rc = secrets_activate(n, sb, &set, err);
	secrets_set_free(&set);
	if (rc != KILN_OK)
		log_error("the secrets of sandbox \"%s\" cannot be put in force: %s", sb->id,
			  err->msg);
	return rc;
}

enum kiln_err secrets_inherit(struct node *n, const char *parent_id, struct sandbox *child,
			      struct kiln_error *err)
{
	enum kiln_err rc = secretsdb_copy(n->pg, node_key(n), parent_id, child->id,
					  child->tenant_id, err);

	return rc == KILN_OK ? secrets_restore(n, child, err) : rc;
}

void secrets_put_route(struct http_req *req, struct sandbox *sb)
{
	struct node *n = http_req_app(req);
	struct kiln_error err = { 0 };
	struct kiln_ruleset rs = { 0 };
	enum kiln_egress_mode mode;
	struct secrets_set set = { 0 };
	struct tenant_ca *ca = NULL;
	json_error_t jerr;
	json_t *body = NULL, *list;
	size_t len;
	const char *text = http_req_body(req, &len);
	enum kiln_err rc;

	body = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!body || !json_is_object(body) || json_object_size(body) != 1 ||
	    !json_is_array(json_object_get(body, "secrets"))) {
		http_reply_error(req, KILN_E_BAD_REQUEST,
				 "the body must be {\"secrets\": [{\"host\", \"header\", \"value\"}...]}");
		goto out;
	}
	pthread_mutex_lock(&sb->lock);
	if (!sb->pol || sb->state != SB_RUNNING) {
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb_state_name(sb->state));
		goto unlock;
	}
	rc = kiln_policy_rules(sb->pol, &rs, &mode, &err);
	if (rc == KILN_OK)
		rc = need_key(n, &err);
	if (rc == KILN_OK)
		rc = secrets_parse(&n->cfg, json_object_get(body, "secrets"), &rs, &set, &err);
	/* what can fail (the CA, the guest) before the store: a refused PUT changes nothing */
	if (rc == KILN_OK && set.n)
		rc = trust_prepare(n, sb, &ca, &err);
	if (rc == KILN_OK)
		rc = secrets_store(n, sb->id, sb->tenant_id, &set, &err);
	if (rc == KILN_OK && set.n)
		rc = inject_set(n->inject, sb->id, ca, set.s, set.n, &err);
	else if (rc == KILN_OK)
		inject_drop(n->inject, sb->id);
	if (rc != KILN_OK) {
		http_reply_error(req, rc, "%s", err.msg);
		goto unlock;
	}
	log_info("sandbox \"%s\": secrets replaced (%zu)", sb->id, set.n);
	list = secretsdb_list_json(n->pg, sb->id, sb->tenant_id, &err);
	if (list)
		http_reply_json(req, 200, json_pack("{s:o}", "secrets", list));
	else
		http_reply_error(req, KILN_E_UNAVAILABLE, "the database is unavailable");
unlock:
	pthread_mutex_unlock(&sb->lock);
out:
	tenantca_put(ca);
	secrets_set_free(&set);
	kiln_ruleset_free(&rs);
	json_decref(body);
	explicit_bzero((void *)text, len);	/* the values' copy in the request body */
}

bool secrets_exec_env(struct node *n, const char *sandbox_id, char ***env)
{
	static const char *const trust[] = { "SSL_CERT_FILE=" SECRETS_GUEST_BUNDLE,
					     "REQUESTS_CA_BUNDLE=" SECRETS_GUEST_BUNDLE,
					     "NODE_EXTRA_CA_CERTS=" SECRETS_GUEST_CA };
	size_t k = sizeof(trust) / sizeof(trust[0]), m = 0, bytes = 0;
	char **arr, *p;

	if (!inject_has(n->inject, sandbox_id))
		return true;
	for (size_t i = 0; i < k; i++)
		bytes += strlen(trust[i]) + 1;
	for (; *env && (*env)[m]; m++)
		bytes += strlen((*env)[m]) + 1;
	arr = malloc((k + m + 1) * sizeof(char *) + bytes);
	if (!arr)
		return false;
	p = (char *)(arr + k + m + 1);
	for (size_t i = 0; i < k + m; i++) {
		const char *s = i < k ? trust[i] : (*env)[i - k];
		size_t l = strlen(s) + 1;

		memcpy(p, s, l);
		arr[i] = p;
		p += l;
	}
	arr[k + m] = NULL;
	free(*env);
	*env = arr;
	return true;
}

int inject_handoff(struct node *n, const char *sandbox_id, int guest_fd, const void *pre,
		   size_t pre_len, const char *host, const struct sockaddr_storage *upstream)
{
	return n->inject ? inject_connection(n->inject, sandbox_id, guest_fd, pre, pre_len, host,
					     upstream)
			 : 0;
}
