/*
 * test_jwt_hash_fault.c - a token that cannot be hashed (OpenSSL out of memory) is not looked up in
 * the caches of verified tokens: it is verified in full, so a forged token sent after a good one
 * was cached is refused, never accepted with the good one's claims. OpenSSL's allocator is
 * replaced before its first allocation, which is why this is a binary of its own.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

#include "auth/jwt.h"
#include "auth/keyring.h"
#include "auth/scopes.h"
#include "test.h"

#define NOW 1700000000LL

/* While set, every OpenSSL allocation fails; jansson and the cache use malloc and go on. */
static volatile bool openssl_oom;

static void *fail_malloc(size_t n, const char *file, int line)
{
	(void)file;
	(void)line;
	return openssl_oom ? NULL : malloc(n);
}

static void *fail_realloc(void *p, size_t n, const char *file, int line)
{
	(void)file;
	(void)line;
	return openssl_oom ? NULL : realloc(p, n);
}

static void plain_free(void *p, const char *file, int line)
{
	(void)file;
	(void)line;
	free(p);
}

static const struct auth_verify_opts api_opts = {
	.aud = AUTH_AUD_API, .iss = "https://kiln.test", .now = NOW, .leeway_s = 30,
	.max_ttl_s = 900,
};

/* Verifies `tok` into `c`; the error, and the reason in *why. */
static enum kiln_err verify(const struct auth_keyring *kr, const char *tok, struct auth_claims *c,
			    enum auth_jwt_reason *why)
{
	return auth_jwt_verify(kr, tok, strlen(tok), &api_opts, c, why, NULL);
}

/* Verifies `tok` with every OpenSSL allocation failing. */
static enum kiln_err verify_oom(const struct auth_keyring *kr, const char *tok,
				struct auth_claims *c, enum auth_jwt_reason *why)
{
	enum kiln_err rc;

	openssl_oom = true;
	rc = verify(kr, tok, c, why);
	openssl_oom = false;
	return rc;
}

static void unhashed_token_is_verified_in_full(void)
{
	/* {"alg":"none"}.{"tid":"tn_evil"}: refused as soon as its header is read */
	static const char forged[] = "eyJhbGciOiJub25lIn0.eyJ0aWQiOiJ0bl9ldmlsIn0.AAAA";
	struct auth_token_params p = {
		.iss = "https://kiln.test", .aud = AUTH_AUD_API, .sub = "key_victim",
		.tid = "tn_victim", .scopes = AUTH_SCOPES_TENANT, .now = NOW, .ttl_s = 600,
	};
	struct auth_jwt_keypair kp = { 0 };
	struct auth_keyring *kr = auth_keyring_new();
	struct auth_jwt_cache_stats s;
	struct auth_claims c;
	enum auth_jwt_reason why;
	char *good = NULL, *other = NULL;

	CHECK(kr != NULL);
	CHECK_INT(auth_jwt_keygen(&kp, NULL), KILN_OK);
	CHECK_INT(auth_keyring_add_private_pem(kr, kp.private_pem, strlen(kp.private_pem), NULL,
					       NULL), KILN_OK);
	CHECK_INT(auth_keyring_set_active(kr, kp.kid, NULL), KILN_OK);
	CHECK_INT(auth_jwt_sign(kr, &p, &good, NULL, NULL), KILN_OK);
	p.tid = "tn_other";
	CHECK_INT(auth_jwt_sign(kr, &p, &other, NULL, NULL), KILN_OK);
	if (!good || !other)
		goto out;

	/* The victim's token, accepted and cached, then found in the cache. */
	CHECK_INT(verify(kr, good, &c, &why), KILN_OK);
	CHECK_INT(verify(kr, good, &c, &why), KILN_OK);
	CHECK_STR(c.tid, "tn_victim");
	auth_jwt_cache_stats(kr, &s);
	CHECK_INT(s.hits, 1);

	/* Forged bytes that cannot be hashed are read, and refused for what they are. */
	CHECK_INT(verify_oom(kr, forged, &c, &why), KILN_E_UNAUTHENTICATED);
	CHECK_INT(why, AUTH_JWT_BAD_ALG);
	CHECK_STR(c.tid, "");

	/* Another good token that cannot be hashed cannot be checked either: an error, no claims. */
	CHECK(verify_oom(kr, other, &c, &why) != KILN_OK);
	CHECK_STR(c.tid, "");

	/* Nothing was found in or added to the cache meanwhile, and it still works. */
	auth_jwt_cache_stats(kr, &s);
	CHECK_INT(s.hits, 1);
	CHECK_INT(s.entries, 1);
	CHECK_INT(verify(kr, other, &c, &why), KILN_OK);
	CHECK_STR(c.tid, "tn_other");
	CHECK_INT(verify(kr, good, &c, &why), KILN_OK);
	CHECK_STR(c.tid, "tn_victim");
out:
	free(good);
	free(other);
	auth_keyring_free(kr);
	auth_jwt_keypair_release(&kp);
}

int main(void)
{
	/* Before anything of OpenSSL's is allocated, or it refuses the change. */
	if (!CRYPTO_set_mem_functions(fail_malloc, fail_realloc, plain_free)) {
		fprintf(stderr, "cannot replace OpenSSL's allocator\n");
		return 1;
	}
	TEST(unhashed_token_is_verified_in_full);
	return test_summary();
}
