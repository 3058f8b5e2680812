/*
 * keys.c - the JWKS that verifies gateway tokens: fetched from a gateway (common/httpc.h), kept in
 * memory, fetched again (at most once a second) when a token names a kid it does not hold.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth/jwks.h"
#include "common/buf.h"
#include "common/httpc.h"
#include "common/log.h"
#include "node/node.h"

#define JWKS_MAX (256 * 1024)

struct jwks_cache {
	char url[512];
	struct auth_keyring *kr;
	pthread_rwlock_t lock;
	pthread_mutex_t fetch_lock;
	time_t last_fetch;
};

static enum kiln_err jwks_fetch(struct jwks_cache *k, struct kiln_error *err)
{
	struct auth_keyring *kr = NULL, *old;
	struct buf b;
	struct httpc_opts o = { .url = k->url, .timeout_ms = 5000, .body = &b };
	struct httpc h;
	struct kiln_error herr = { 0 };
	long code = 0;
	enum kiln_err rc;

	buf_init(&b, JWKS_MAX);
	if (httpc_open(&h, &o, err) != KILN_OK)
		return err->code;
	rc = httpc_perform(&h, &code, &herr);
	httpc_close(&h);
	if (rc != KILN_OK || code != 200) {
		buf_release(&b);
		return kiln_error_set(err, KILN_E_UNAVAILABLE, "cannot fetch the JWKS from \"%s\"",
				      k->url);
	}
	kr = auth_keyring_new();
	rc = kr ? auth_jwks_load(kr, b.data ? b.data : "", b.len, err) : KILN_E_NOMEM;
	buf_release(&b);
	if (rc != KILN_OK) {
		auth_keyring_free(kr);
		return rc;
	}
	pthread_rwlock_wrlock(&k->lock);
	old = k->kr;
	k->kr = kr;
	pthread_rwlock_unlock(&k->lock);
	auth_keyring_free(old);
	return KILN_OK;
}

struct jwks_cache *jwks_new(const char *gateway_url)
{
	struct jwks_cache *k = calloc(1, sizeof(*k));

	if (!k)
		return NULL;
	snprintf(k->url, sizeof(k->url), "%s/v1/.well-known/jwks.json", gateway_url);
	pthread_rwlock_init(&k->lock, NULL);
	pthread_mutex_init(&k->fetch_lock, NULL);
	return k;
}

void jwks_free(struct jwks_cache *k)
{
	if (!k)
		return;
	auth_keyring_free(k->kr);
	pthread_rwlock_destroy(&k->lock);
	pthread_mutex_destroy(&k->fetch_lock);
	free(k);
}

static enum kiln_err verify_once(struct jwks_cache *k, const char *token, size_t len,
				 const struct auth_verify_opts *o, struct auth_claims *out,
				 enum auth_jwt_reason *why, struct kiln_error *err)
{
	enum kiln_err rc;

	pthread_rwlock_rdlock(&k->lock);
	if (!k->kr) {
		*why = AUTH_JWT_UNKNOWN_KID;
		rc = kiln_error_set(err, KILN_E_UNAUTHENTICATED, "no keys yet");
	} else {
		rc = auth_jwt_verify(k->kr, token, len, o, out, why, err);
	}
	pthread_rwlock_unlock(&k->lock);
	return rc;
}

enum kiln_err jwks_verify(struct jwks_cache *k, const char *token, size_t len,
			  const char *sandbox_id, struct auth_claims *out, struct kiln_error *err)
{
	struct auth_verify_opts o = {
		.aud = AUTH_AUD_NODE,
		.iss = "kiln",
		.now = time(NULL),
		.leeway_s = 30,
		.max_ttl_s = 3600,
		.require_sbx = true,
	};
	struct kiln_error first = { 0 };
	enum auth_jwt_reason why = AUTH_JWT_OK;
	enum kiln_err rc = verify_once(k, token, len, &o, out, &why, &first);

	if (rc != KILN_OK && why == AUTH_JWT_UNKNOWN_KID) {
		struct kiln_error ferr = { 0 };
		time_t now = time(NULL);

		pthread_mutex_lock(&k->fetch_lock);
		if (k->last_fetch != now) {
			k->last_fetch = now;
			if (jwks_fetch(k, &ferr) != KILN_OK)
				log_warn("%s", ferr.msg);
		}
		pthread_mutex_unlock(&k->fetch_lock);
		/*
		 * Verified again whoever fetched: requests that waited on the lock while another
		 * fetched the new key must see it too (several creates at once on a fresh node).
		 */
		kiln_error_clear(&first);
		rc = verify_once(k, token, len, &o, out, &why, &first);
	}
	if (rc != KILN_OK)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "invalid node token: %s",
				      auth_jwt_reason_name(why));
	if (strcmp(out->sbx, sandbox_id) != 0)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED,
				      "the token is for another sandbox");
	return KILN_OK;
}
