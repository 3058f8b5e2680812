/*
 * routes_storage.c - PUT /v1/storage: the tenant's own snapshot bucket.
 *
 * The setting is checked field by field; then the endpoint's host is resolved and every address
 * checked (s3_client_resolve: no loopback, private, link-local… address, nor this host's, unless
 * the operator's storage_allow names it), and the bucket is tried through those pinned addresses:
 * a small object is written under the prefix, read back (HEAD) and deleted, so a bucket the
 * credentials cannot write is refused now rather than at the first pause. A failure is 422 with
 * one of the client's fixed messages (nothing of the target's answer), and one that could not
 * reach the bucket is answered no sooner than the connect timeout, so that a closed port and a
 * silent one look alike. Only then is the secret sealed and stored (storage.c). The secret is
 * never returned or logged; the copy in the request body is wiped once stored.
 */
#include <openssl/crypto.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "api/apireq.h"
#include "api/authn.h"
#include "api/gateway.h"
#include "auth/storage.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/s3.h"

#define STORAGE_PROBE_KEY ".kiln-write-check-"	/* + a fresh id */
#define STORAGE_CONNECT_MS 5000	/* connect timeout of the test write, and the least time an
				   unreachable bucket takes to answer */

/* Writes, reads back and deletes a small object with `t`. Replies 422 and returns false if not. */
static bool storage_try(struct http_req *req, const struct s3_target *t, const char *tenant_id)
{
	struct gateway *gw = http_req_app(req);
	struct s3_opts o = { .connect_timeout_ms = STORAGE_CONNECT_MS, .request_timeout_s = 15,
			     .retries = 0, .allow = gw->storage_allow };
	struct kiln_error err = { 0 };
	int64_t start = clock_mono_ms();
	struct s3_object_info info;
	char id[AUTH_ID_MAX], key[sizeof(STORAGE_PROBE_KEY) + AUTH_ID_MAX], body[160];
	struct s3_client *c;
	enum kiln_err rc;

	if (auth_new_id("chk_", id, sizeof(id)) != KILN_OK) {
		http_reply_error(req, KILN_E_INTERNAL, "cannot make an id");
		return false;
	}
	snprintf(key, sizeof(key), "%s%s", STORAGE_PROBE_KEY, id);
	snprintf(body, sizeof(body), "kiln storage check for %s at %lld\n", tenant_id,
		 (long long)time(NULL));
	c = s3_client_new(t, &o, &err);
	if (!c) {
		http_reply_error(req, err.code == KILN_E_NOMEM ? KILN_E_INTERNAL : KILN_E_INVALID,
				 "%s", err.msg);
		return false;
	}
	if (s3_client_resolve(c, &err) == KILN_E_INVALID) {
		log_info("storage endpoint of bucket \"%s\" refused: %s", t->bucket, err.msg);
		http_reply_error(req, KILN_E_INVALID, "endpoint: %s (an operator can allow it with "
				 "storage_allow)", err.msg);
		s3_client_free(c);
		return false;
	}
	kiln_error_clear(&err);
	rc = s3_put_data(c, key, body, strlen(body), &err);
	if (rc == KILN_OK)
		rc = s3_head(c, key, &info, &err);
	if (rc == KILN_OK && info.size != strlen(body))
		rc = kiln_error_set(&err, KILN_E_INVALID,
				    "the bucket kept %llu bytes of a %zu-byte test object",
				    (unsigned long long)info.size, strlen(body));
	if (rc == KILN_OK) {
		struct kiln_error derr = { 0 };
		if (s3_delete(c, key, &derr) != KILN_OK)
			log_warn("storage check: cannot delete \"%s\": %s", key, derr.msg);
	}
	s3_client_free(c);
	if (rc == KILN_E_UNAVAILABLE) {
		/* As slow as a silent port, whatever answered (a closed port answers at once). */
		int64_t left = STORAGE_CONNECT_MS - (clock_mono_ms() - start);

		if (left > 0) {
			struct timespec ts = { left / 1000, (long)(left % 1000) * 1000000L };
			nanosleep(&ts, NULL);
		}
	}
	if (rc != KILN_OK) {
		log_info("storage check of bucket \"%s\" at \"%s\" failed: %s", t->bucket, t->endpoint,
			 err.msg);
		http_reply_error(req, KILN_E_INVALID, "the bucket cannot be written: %s", err.msg);
		return false;
	}
	return true;
}

static void storage_put(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	size_t blen;
	const char *btext = http_req_body(req, &blen);
	json_t *body = NULL;
	struct pg_conn *c = NULL;
	struct s3_target t;
	enum kiln_err rc;

	if (apireq_storage(btext, blen, &body, &t, &err) != KILN_OK) {
		http_reply_error(req, err.code, "%s", err.msg);
		goto out;
	}
	if (!storage_try(req, &t, who->tenant_id))
		goto out;
	c = gw_db(req);
	if (!c)
		goto out;
	rc = storage_save(c, &gw->mk, who->tenant_id, &t, &err);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		goto out;
	}
	log_info("storage set to bucket \"%s\" at \"%s\"", t.bucket, t.endpoint);
	http_reply_json(req, 200,
			json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "kind", "s3", "endpoint",
				  t.endpoint, "bucket", t.bucket, "region", t.region, "prefix",
				  t.prefix, "access_key_id", t.access_key_id));
out:
	if (c)
		pg_release(gw->pg, c);
	s3_target_wipe(&t);
	apireq_storage_free(body);
}

static const struct http_route routes[] = {
	{ "PUT", "/v1/storage", storage_put, ROUTE_AUTH | AUTH_SCOPE_KEYS_WRITE, 0, NULL, 0 },
};

const struct route_group routes_storage = { routes, sizeof(routes) / sizeof(routes[0]) };
