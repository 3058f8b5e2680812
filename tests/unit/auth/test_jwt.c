/*
 * test_jwt.c - the keyring and ES256 tokens: issuing, verifying, every refusal (alg none, HS256
 * keyed with the public key, unknown kid, bad signature, DER and non-canonical signatures, wrong
 * audience, expiry, missing claims, oversized and garbled tokens), rotation, tokens exchanged with
 * libjwt both ways, and many threads on one keyring.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jwt.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include "auth/encode.h"
#include "auth/jwt.h"
#include "auth/keyring.h"
#include "auth/scopes.h"
#include "test.h"

#define NOW 1700000000LL

static struct auth_jwt_keypair kp1, kp2;
static struct auth_keyring *kr;	/* kp1 active */

static const struct auth_verify_opts api_opts = {
	.aud = AUTH_AUD_API, .iss = "https://kiln.test", .now = NOW, .leeway_s = 30,
	.max_ttl_s = 900,
};

static struct auth_token_params user_params(void)
{
	struct auth_token_params p = {
		.iss = "https://kiln.test", .aud = AUTH_AUD_API, .sub = "key_abc", .tid = "tn_abc",
		.scopes = AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_BILLING_READ, .now = NOW, .ttl_s = 600,
	};
	return p;
}

static char *sign_or_null(const struct auth_keyring *k, const struct auth_token_params *p)
{
	char *t = NULL;
	struct kiln_error err = { 0 };

	if (auth_jwt_sign(k, p, &t, NULL, &err) != KILN_OK)
		fprintf(stderr, "sign failed: %s\n", err.msg);
	return t;
}

static enum auth_jwt_reason verify_reason(const struct auth_keyring *k, const char *tok,
					  const struct auth_verify_opts *o)
{
	enum auth_jwt_reason why = AUTH_JWT_OK;
	struct auth_claims c;
	enum kiln_err rc;

	rc = auth_jwt_verify(k, tok, tok ? strlen(tok) : 0, o, &c, &why, NULL);
	if (why != AUTH_JWT_OK && rc != KILN_E_UNAUTHENTICATED)
		return (enum auth_jwt_reason)-1;
	if (why == AUTH_JWT_OK && rc != KILN_OK)
		return (enum auth_jwt_reason)-1;
	return why;
}

/* base64url(header) "." base64url(payload) "." sig, as an attacker would write it. */
static char *forge(const char *header, const char *payload, const char *sig)
{
	char h[1024], p[4096];
	char *out = malloc(8192);

	auth_b64url_encode(header, strlen(header), h, sizeof(h));
	auth_b64url_encode(payload, strlen(payload), p, sizeof(p));
	snprintf(out, 8192, "%s.%s.%s", h, p, sig);
	return out;
}

/* An ES256 token made by libjwt directly with any payload, signed by `pem` under header `kid`. */
static char *sign_custom(const char *pem, const char *kid, const char *payload)
{
	jwt_t *j = NULL;
	char *out = NULL;

	if (jwt_new(&j) == 0 && (!kid || jwt_add_header(j, "kid", kid) == 0) &&
	    jwt_add_grants_json(j, payload) == 0 &&
	    jwt_set_alg(j, JWT_ALG_ES256, (const unsigned char *)pem, (int)strlen(pem)) == 0)
		out = jwt_encode_str(j);
	jwt_free(j);
	return out;
}

static const char *good_payload =
	"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"tn_abc\","
	"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"jti_x\"}";

static void setup(void)
{
	CHECK_INT(auth_jwt_keygen(&kp1, NULL), KILN_OK);
	CHECK_INT(auth_jwt_keygen(&kp2, NULL), KILN_OK);
	kr = auth_keyring_new();
	CHECK(kr != NULL);
	CHECK_INT(auth_keyring_add_private_pem(kr, kp1.private_pem, strlen(kp1.private_pem), NULL,
					       NULL), KILN_OK);
	CHECK_INT(auth_keyring_set_active(kr, kp1.kid, NULL), KILN_OK);
}

static void keygen_kid_is_the_thumbprint_of_both_halves(void)
{
	struct auth_keyring *k = auth_keyring_new();
	char kid[AUTH_KID_MAX];
	struct kiln_error err = { 0 };

	CHECK_INT(strlen(kp1.kid), AUTH_KID_LEN);
	CHECK(strcmp(kp1.kid, kp2.kid) != 0);
	CHECK(strstr(kp1.private_pem, "BEGIN PRIVATE KEY") != NULL);
	CHECK(strstr(kp1.public_pem, "BEGIN PUBLIC KEY") != NULL);
	CHECK_INT(auth_keyring_add_public_pem(k, kp1.public_pem, strlen(kp1.public_pem), kid, NULL),
		  KILN_OK);
	CHECK_STR(kid, kp1.kid);
	CHECK_INT(auth_keyring_add_private_pem(k, kp1.private_pem, strlen(kp1.private_pem), kid,
					       &err), KILN_E_CONFLICT);
	CHECK_INT(auth_keyring_set_active(k, kp1.kid, NULL), KILN_E_INVALID);	/* public only */
	CHECK_INT(auth_keyring_set_active(k, "nope", NULL), KILN_E_NOT_FOUND);
	CHECK(auth_keyring_active_kid(k) == NULL);
	CHECK_INT(auth_keyring_count(k), 1);
	CHECK(auth_keyring_has(k, kp1.kid));
	CHECK_STR(auth_keyring_public_pem(k, kp1.kid), kp1.public_pem);
	auth_keyring_free(k);
}

static void keyring_refuses_bad_pems(void)
{
	struct auth_keyring *k = auth_keyring_new();
	const char *rsa_or_junk = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n";
	char big[AUTH_PEM_MAX + 2];

	CHECK_INT(auth_keyring_add_public_pem(k, rsa_or_junk, strlen(rsa_or_junk), NULL, NULL),
		  KILN_E_INVALID);
	CHECK_INT(auth_keyring_add_private_pem(k, kp1.public_pem, strlen(kp1.public_pem), NULL,
					       NULL), KILN_E_INVALID);
	CHECK_INT(auth_keyring_add_private_pem(k, "", 0, NULL, NULL), KILN_E_INVALID);
	memset(big, 'A', sizeof(big));
	CHECK_INT(auth_keyring_add_public_pem(k, big, sizeof(big), NULL, NULL), KILN_E_INVALID);
	/* A P-384 key is not an ES256 key. */
	{
		EVP_PKEY *p384 = EVP_EC_gen("secp384r1");
		BIO *bio = BIO_new(BIO_s_mem());
		char *data = NULL;
		long n;

		PEM_write_bio_PUBKEY(bio, p384);
		n = BIO_get_mem_data(bio, &data);
		CHECK_INT(auth_keyring_add_public_pem(k, data, (size_t)n, NULL, NULL), KILN_E_INVALID);
		BIO_free(bio);
		EVP_PKEY_free(p384);
	}
	CHECK_INT(auth_keyring_count(k), 0);
	auth_keyring_free(k);
}

static void user_token_round_trips(void)
{
	struct auth_token_params p = user_params();
	struct auth_claims signed_c, c;
	enum auth_jwt_reason why;
	char *t = NULL;

	CHECK_INT(auth_jwt_sign(kr, &p, &t, &signed_c, NULL), KILN_OK);
	if (!t)
		return;
	CHECK(strlen(t) < 1024);
	CHECK_INT(auth_jwt_verify(kr, t, strlen(t), &api_opts, &c, &why, NULL), KILN_OK);
	CHECK_INT(why, AUTH_JWT_OK);
	CHECK_STR(c.iss, "https://kiln.test");
	CHECK_STR(c.aud, "kiln-api");
	CHECK_STR(c.sub, "key_abc");
	CHECK_STR(c.tid, "tn_abc");
	CHECK_STR(c.sbx, "");
	CHECK_STR(c.kid, kp1.kid);
	CHECK_STR(c.jti, signed_c.jti);
	CHECK(strncmp(c.jti, "jti_", 4) == 0);
	CHECK_INT(c.scopes, AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_BILLING_READ);
	CHECK_INT(c.iat, NOW);
	CHECK_INT(c.exp, NOW + 600);
	CHECK_INT(c.nbf, 0);
	free(t);
}

static void node_token_needs_node_audience_and_sandbox(void)
{
	struct auth_token_params p = user_params();
	struct auth_verify_opts node = { .aud = AUTH_AUD_NODE, .now = NOW, .leeway_s = 5,
					 .max_ttl_s = 60, .require_sbx = true };
	struct auth_claims c;
	char *user, *nt;

	user = sign_or_null(kr, &p);
	p.aud = AUTH_AUD_NODE;
	p.ttl_s = 30;
	CHECK_INT(auth_jwt_sign(kr, &p, &nt, NULL, NULL), KILN_E_INVALID);	/* no sbx */
	p.sbx = "sb_xyz";
	nt = sign_or_null(kr, &p);
	CHECK_INT(verify_reason(kr, nt, &node), AUTH_JWT_OK);
	CHECK_INT(auth_jwt_verify(kr, nt, strlen(nt), &node, &c, NULL, NULL), KILN_OK);
	CHECK_STR(c.sbx, "sb_xyz");
	CHECK_STR(c.aud, "kiln-node");
	/* A node never accepts a user's kiln-api token, and the API never a node token. */
	CHECK_INT(verify_reason(kr, user, &node), AUTH_JWT_WRONG_AUD);
	CHECK_INT(verify_reason(kr, nt, &api_opts), AUTH_JWT_WRONG_AUD);
	free(user);
	free(nt);
}

static void expiry_and_not_yet_valid_use_injected_time(void)
{
	struct auth_token_params p = user_params();
	struct auth_verify_opts o = api_opts;
	char *t = sign_or_null(kr, &p);

	o.now = NOW + 599;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_OK);
	o.now = NOW + 600;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_EXPIRED);
	o.now = NOW + 100000;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_EXPIRED);
	o.now = NOW - 30;	/* within leeway */
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_OK);
	o.now = NOW - 31;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_NOT_YET_VALID);
	o.now = NOW;
	o.max_ttl_s = 300;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_TTL_TOO_LONG);
	o.max_ttl_s = 0;
	o.iss = "https://other.test";
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_WRONG_ISS);
	o.iss = NULL;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_OK);
	free(t);

	/* nbf in the future */
	t = sign_custom(kp1.private_pem, kp1.kid,
			"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\","
			"\"tid\":\"tn_abc\",\"scope\":\"\",\"iat\":1700000000,\"exp\":1700000600,"
			"\"nbf\":1700000100,\"jti\":\"jti_x\"}");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_NOT_YET_VALID);
	o = api_opts;
	o.now = NOW + 100;
	CHECK_INT(verify_reason(kr, t, &o), AUTH_JWT_OK);
	free(t);
}

static void unknown_kid_is_reported_distinctly(void)
{
	struct auth_keyring *other = auth_keyring_new();
	struct auth_token_params p = user_params();
	struct kiln_error err = { 0 };
	enum auth_jwt_reason why;
	struct auth_claims c;
	char *t;

	auth_keyring_add_private_pem(other, kp2.private_pem, strlen(kp2.private_pem), NULL, NULL);
	auth_keyring_set_active(other, kp2.kid, NULL);
	t = sign_or_null(other, &p);
	CHECK_INT(auth_jwt_verify(kr, t, strlen(t), &api_opts, &c, &why, &err),
		  KILN_E_UNAUTHENTICATED);
	CHECK_INT(why, AUTH_JWT_UNKNOWN_KID);
	CHECK_STR(auth_jwt_reason_name(why), "unknown_kid");
	CHECK(strstr(err.msg, "unknown kid") != NULL);
	CHECK_STR(c.sub, "");	/* nothing leaks out of a refused token */
	free(t);
	auth_keyring_free(other);
}

static void alg_none_is_refused(void)
{
	char hdr[256], *t;
	jwt_t *j = NULL;

	snprintf(hdr, sizeof(hdr), "{\"alg\":\"none\",\"typ\":\"JWT\",\"kid\":\"%s\"}", kp1.kid);
	t = forge(hdr, good_payload, "");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
	snprintf(hdr, sizeof(hdr), "{\"alg\":\"None\",\"kid\":\"%s\"}", kp1.kid);
	t = forge(hdr, good_payload, "");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
	/* libjwt's own alg-none token */
	CHECK(jwt_new(&j) == 0);
	jwt_add_header(j, "kid", kp1.kid);
	jwt_add_grants_json(j, good_payload);
	t = jwt_encode_str(j);
	jwt_free(j);
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
	/* no alg at all */
	snprintf(hdr, sizeof(hdr), "{\"kid\":\"%s\"}", kp1.kid);
	t = forge(hdr, good_payload, "AAAA");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
}

static void hs256_keyed_with_the_public_pem_is_refused(void)
{
	const char *pem = auth_keyring_public_pem(kr, kp1.kid);
	jwt_t *j = NULL, *dec = NULL;
	char *t = NULL;

	/* The attack: HMAC the token with the public key the verifier holds. */
	CHECK(jwt_new(&j) == 0);
	jwt_add_header(j, "kid", kp1.kid);
	jwt_add_grants_json(j, good_payload);
	CHECK(jwt_set_alg(j, JWT_ALG_HS256, (const unsigned char *)pem, (int)strlen(pem)) == 0);
	t = jwt_encode_str(j);
	jwt_free(j);
	if (!t)
		return;
	/* libjwt alone would take it: that is the hole this module closes. */
	CHECK_INT(jwt_decode(&dec, t, (const unsigned char *)pem, (int)strlen(pem)), 0);
	jwt_free(dec);
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
}

static void other_header_members_and_missing_kid_are_refused(void)
{
	char hdr[512], *t;

	snprintf(hdr, sizeof(hdr), "{\"alg\":\"ES256\",\"kid\":\"%s\",\"jku\":\"http://x\"}",
		 kp1.kid);
	t = forge(hdr, good_payload, "AAAA");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
	snprintf(hdr, sizeof(hdr), "{\"alg\":\"ES256\",\"kid\":\"%s\",\"typ\":\"at+jwt\"}", kp1.kid);
	t = forge(hdr, good_payload, "AAAA");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_ALG);
	free(t);
	t = sign_custom(kp1.private_pem, NULL, good_payload);
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_MALFORMED);
	free(t);
	snprintf(hdr, sizeof(hdr), "{\"alg\":\"ES256\",\"kid\":\"%s\",\"kid\":\"x\"}", kp1.kid);
	t = forge(hdr, good_payload, "AAAA");
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_MALFORMED);	/* duplicate member */
	free(t);
}

static void bad_signatures_are_refused(void)
{
	struct auth_keyring *other = auth_keyring_new();
	struct auth_token_params p = user_params();
	char *t = sign_or_null(kr, &p), *t2, *dot, forged[AUTH_JWT_MAX + 1];
	size_t n;

	/* flip one signature character */
	n = strlen(t);
	t[n - 5] = t[n - 5] == 'A' ? 'B' : 'A';
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	free(t);

	/* a signature by another key under this keyring's kid */
	auth_keyring_add_private_pem(other, kp2.private_pem, strlen(kp2.private_pem), NULL, NULL);
	auth_keyring_set_active(other, kp2.kid, NULL);
	t = sign_custom(kp1.private_pem, kp1.kid, good_payload);
	t2 = sign_custom(kp2.private_pem, kp1.kid, good_payload);
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_OK);
	CHECK_INT(verify_reason(kr, t2, &api_opts), AUTH_JWT_BAD_SIGNATURE);

	/* someone else's payload with a genuine signature */
	dot = strrchr(t, '.');
	snprintf(forged, sizeof(forged), "%.*s%s", (int)(strrchr(t2, '.') - t2), t2, dot);
	CHECK_INT(verify_reason(kr, forged, &api_opts), AUTH_JWT_OK);	/* same header+payload */
	free(t2);
	t2 = sign_custom(kp1.private_pem, kp1.kid,
			 "{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_evil\","
			 "\"tid\":\"tn_evil\",\"scope\":\"admin\",\"iat\":1700000000,"
			 "\"exp\":1700000600,\"jti\":\"jti_y\"}");
	snprintf(forged, sizeof(forged), "%.*s%s", (int)(strrchr(t2, '.') - t2), t2, dot);
	CHECK_INT(verify_reason(kr, forged, &api_opts), AUTH_JWT_BAD_SIGNATURE);

	/* truncated signature */
	n = strlen(t);
	t[n - 1] = '\0';
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	/* a DER signature is not a JOSE one */
	free(t);
	free(t2);
	auth_keyring_free(other);
}

static void missing_and_ill_typed_claims_are_refused(void)
{
	static const char *const bad[] = {
		/* missing tid */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"j\"}",
		/* missing exp */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"jti\":\"j\"}",
		/* missing jti */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1700000600}",
		/* missing scope */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"j\"}",
		/* exp as a string */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":\"1700000600\",\"jti\":\"j\"}",
		/* iat as a real */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000.5,\"exp\":1700000600,\"jti\":\"j\"}",
		/* aud as an array */
		"{\"iss\":\"https://kiln.test\",\"aud\":[\"kiln-api\"],\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"j\"}",
		/* unknown scope */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"root\",\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"j\"}",
		/* empty sub */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"j\"}",
		/* exp before iat */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1699999000,\"jti\":\"j\"}",
		/* negative iat */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":-1,\"exp\":1700000600,\"jti\":\"j\"}",
		/* sbx of the wrong type */
		"{\"iss\":\"https://kiln.test\",\"aud\":\"kiln-api\",\"sub\":\"key_abc\",\"tid\":\"t\","
		"\"scope\":\"sandbox:read\",\"iat\":1700000000,\"exp\":1700000600,\"jti\":\"j\","
		"\"sbx\":7}",
	};

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		char *t = sign_custom(kp1.private_pem, kp1.kid, bad[i]);

		CHECK(t != NULL);
		if (verify_reason(kr, t, &api_opts) != AUTH_JWT_BAD_CLAIMS)
			fprintf(stderr, "case %zu: %s\n", i,
				auth_jwt_reason_name(verify_reason(kr, t, &api_opts)));
		CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_BAD_CLAIMS);
		free(t);
	}
	{
		struct auth_verify_opts node = { .aud = AUTH_AUD_NODE, .now = NOW,
						 .require_sbx = true };
		char *t = sign_custom(kp1.private_pem, kp1.kid,
				      "{\"iss\":\"i\",\"aud\":\"kiln-node\",\"sub\":\"key_abc\","
				      "\"tid\":\"t\",\"scope\":\"sandbox:read\",\"iat\":1700000000,"
				      "\"exp\":1700000060,\"jti\":\"j\"}");

		CHECK_INT(verify_reason(kr, t, &node), AUTH_JWT_BAD_CLAIMS);	/* no sbx */
		free(t);
	}
}

static void garbled_and_oversized_tokens_are_refused(void)
{
	static const char *const garbled[] = {
		"", "abc", "a.b", "a.b.c.d", "..", "a..c", "ab$c.def.ghi", "eyJ.e30.AAAA",
		"W10.e30.AAAA", /* header is [] */
	};
	struct auth_token_params p = user_params();
	char *t = sign_or_null(kr, &p), big[AUTH_JWT_MAX + 64], *f;
	char hdr[1024];

	for (size_t i = 0; i < sizeof(garbled) / sizeof(garbled[0]); i++)
		CHECK_INT(verify_reason(kr, garbled[i], &api_opts), AUTH_JWT_MALFORMED);
	CHECK_INT(verify_reason(kr, NULL, &api_opts), AUTH_JWT_MALFORMED);

	memset(big, 'A', sizeof(big));
	big[100] = '.';
	big[200] = '.';
	big[AUTH_JWT_MAX + 1] = '\0';
	CHECK_INT(verify_reason(kr, big, &api_opts), AUTH_JWT_TOO_LARGE);
	/* each part has its cap too */
	memset(hdr, 'x', sizeof(hdr));
	snprintf(hdr, sizeof(hdr), "{\"alg\":\"ES256\",\"kid\":\"%s\",\"pad\":\"%0600d\"}",
		 kp1.kid, 0);
	f = forge(hdr, good_payload, "AAAA");
	CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_TOO_LARGE);
	free(f);
	/* a NUL inside the token */
	{
		size_t n = strlen(t);
		char *copy = malloc(n + 1);
		enum auth_jwt_reason why;

		memcpy(copy, t, n + 1);
		copy[10] = '\0';
		CHECK_INT(auth_jwt_verify(kr, copy, n, &api_opts, NULL, &why, NULL),
			  KILN_E_UNAUTHENTICATED);
		CHECK_INT(why, AUTH_JWT_MALFORMED);
		free(copy);
	}
	free(t);
}

static void rotation_new_key_signs_old_key_still_verifies(void)
{
	struct auth_keyring *k = auth_keyring_new();
	struct auth_token_params p = user_params();
	struct auth_claims c;
	char *old_t, *new_t;

	auth_keyring_add_private_pem(k, kp1.private_pem, strlen(kp1.private_pem), NULL, NULL);
	auth_keyring_set_active(k, kp1.kid, NULL);
	old_t = sign_or_null(k, &p);
	CHECK_INT(auth_keyring_add_private_pem(k, kp2.private_pem, strlen(kp2.private_pem), NULL,
					       NULL), KILN_OK);
	CHECK_INT(auth_keyring_set_active(k, kp2.kid, NULL), KILN_OK);
	CHECK_STR(auth_keyring_active_kid(k), kp2.kid);
	new_t = sign_or_null(k, &p);
	CHECK_INT(auth_jwt_verify(k, new_t, strlen(new_t), &api_opts, &c, NULL, NULL), KILN_OK);
	CHECK_STR(c.kid, kp2.kid);
	CHECK_INT(auth_jwt_verify(k, old_t, strlen(old_t), &api_opts, &c, NULL, NULL), KILN_OK);
	CHECK_STR(c.kid, kp1.kid);
	/* once the old key is retired its tokens stop verifying */
	CHECK_INT(auth_keyring_remove(k, kp1.kid), KILN_OK);
	CHECK_INT(auth_keyring_remove(k, kp1.kid), KILN_E_NOT_FOUND);
	CHECK_INT(verify_reason(k, old_t, &api_opts), AUTH_JWT_UNKNOWN_KID);
	CHECK_INT(verify_reason(k, new_t, &api_opts), AUTH_JWT_OK);
	CHECK_STR(auth_keyring_active_kid(k), kp2.kid);
	CHECK_INT(auth_keyring_remove(k, kp2.kid), KILN_OK);
	CHECK(auth_keyring_active_kid(k) == NULL);
	free(old_t);
	free(new_t);
	auth_keyring_free(k);
}

static void sign_refuses_bad_parameters(void)
{
	struct auth_keyring *empty = auth_keyring_new();
	struct auth_token_params p = user_params();
	char *t = NULL;

	CHECK_INT(auth_jwt_sign(empty, &p, &t, NULL, NULL), KILN_E_INTERNAL);
	p.sub = "key abc";
	CHECK_INT(auth_jwt_sign(kr, &p, &t, NULL, NULL), KILN_E_INVALID);
	p = user_params();
	p.tid = "";
	CHECK_INT(auth_jwt_sign(kr, &p, &t, NULL, NULL), KILN_E_INVALID);
	p = user_params();
	p.ttl_s = 0;
	CHECK_INT(auth_jwt_sign(kr, &p, &t, NULL, NULL), KILN_E_INVALID);
	p.ttl_s = AUTH_JWT_TTL_MAX + 1;
	CHECK_INT(auth_jwt_sign(kr, &p, &t, NULL, NULL), KILN_E_INVALID);
	p = user_params();
	p.scopes = 1u << 20;
	CHECK_INT(auth_jwt_sign(kr, &p, &t, NULL, NULL), KILN_E_INVALID);
	CHECK(t == NULL);
	auth_keyring_free(empty);
}

/* Tokens Kiln signs are plain ES256 JWTs: libjwt verifies them with the public PEM alone. */
static void signed_tokens_verify_in_libjwt(void)
{
	struct auth_token_params p = user_params();
	char *t = sign_or_null(kr, &p), hdr[256], *dot;
	jwt_t *dec = NULL;
	int n;

	if (!t)
		return;
	CHECK_INT(jwt_decode(&dec, t, (const unsigned char *)kp1.public_pem,
			     (int)strlen(kp1.public_pem)), 0);
	if (dec) {
		CHECK_INT(jwt_get_alg(dec), JWT_ALG_ES256);
		CHECK_STR(jwt_get_header(dec, "kid"), kp1.kid);
		CHECK_STR(jwt_get_grant(dec, "sub"), "key_abc");
		CHECK_STR(jwt_get_grant(dec, "scope"), "sandbox:read billing:read");
		CHECK_INT(jwt_get_grant_int(dec, "exp"), NOW + 600);
		jwt_free(dec);
	}
	/* exactly the three header members the verifier allows */
	dot = strchr(t, '.');
	n = auth_b64url_decode(t, (size_t)(dot - t), hdr, sizeof(hdr) - 1);
	CHECK(n > 0);
	hdr[n > 0 ? n : 0] = '\0';
	{
		char want[128];

		snprintf(want, sizeof(want), "{\"alg\":\"ES256\",\"kid\":\"%s\",\"typ\":\"JWT\"}",
			 kp1.kid);
		CHECK_STR(hdr, want);
	}
	/* the signature part is 86 characters: raw r||s */
	CHECK_INT(strlen(strrchr(t, '.') + 1), 86);
	free(t);
}

/* Replaces the signature of `tok` (header.payload.sig) by `sig`; returns a new string. */
static char *with_signature(const char *tok, const char *sig)
{
	const char *dot = strrchr(tok, '.');
	size_t n = (size_t)(dot - tok) + 1;
	char *out = malloc(n + strlen(sig) + 1);

	memcpy(out, tok, n);
	strcpy(out + n, sig);
	return out;
}

/* The DER form of `tok`'s own signature, base64url: what a careless signer would send. */
static char *der_signature_of(const char *tok)
{
	const char *s = strrchr(tok, '.') + 1;
	unsigned char raw[64], *der = NULL;
	ECDSA_SIG *sig = ECDSA_SIG_new();
	char *out = malloc(256);
	int n;

	CHECK_INT(auth_b64url_decode(s, strlen(s), raw, sizeof(raw)), 64);
	ECDSA_SIG_set0(sig, BN_bin2bn(raw, 32, NULL), BN_bin2bn(raw + 32, 32, NULL));
	n = i2d_ECDSA_SIG(sig, &der);
	CHECK(n > 64);
	auth_b64url_encode(der, (size_t)n, out, 256);
	OPENSSL_free(der);
	ECDSA_SIG_free(sig);
	return out;
}

static void odd_signatures_are_refused(void)
{
	struct auth_token_params p = user_params();
	char *t = sign_or_null(kr, &p), *f, *der, sig[128];
	unsigned char raw[64];
	const char *good;
	size_t n;

	if (!t)
		return;
	good = strrchr(t, '.') + 1;
	CHECK_INT(verify_reason(kr, t, &api_opts), AUTH_JWT_OK);

	/* the same signature in DER */
	der = der_signature_of(t);
	f = with_signature(t, der);
	CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	free(f);
	free(der);

	/* the same 64 bytes spelt with non-zero padding bits in the last character */
	snprintf(sig, sizeof(sig), "%s", good);
	n = strlen(sig);
	{
		static const char alpha[] =
			"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
		int v = (int)(strchr(alpha, sig[n - 1]) - alpha);

		sig[n - 1] = alpha[v ^ 1];	/* a padding bit: the bytes decode alike */
	}
	f = with_signature(t, sig);
	CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	free(f);

	/* r or s zero, and r = s = 2^256 - 1 (above the group order) */
	CHECK_INT(auth_b64url_decode(good, strlen(good), raw, sizeof(raw)), 64);
	memset(raw, 0, 32);
	auth_b64url_encode(raw, sizeof(raw), sig, sizeof(sig));
	f = with_signature(t, sig);
	CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	free(f);
	CHECK_INT(auth_b64url_decode(good, strlen(good), raw, sizeof(raw)), 64);
	memset(raw + 32, 0, 32);
	auth_b64url_encode(raw, sizeof(raw), sig, sizeof(sig));
	f = with_signature(t, sig);
	CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	free(f);
	memset(raw, 0xff, sizeof(raw));
	auth_b64url_encode(raw, sizeof(raw), sig, sizeof(sig));
	f = with_signature(t, sig);
	CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
	free(f);

	/* a signature by the right key, over another payload */
	{
		struct auth_token_params q = user_params();
		char *other;

		q.sub = "key_abcd";
		other = sign_or_null(kr, &q);
		f = with_signature(t, strrchr(other, '.') + 1);
		CHECK_INT(verify_reason(kr, f, &api_opts), AUTH_JWT_BAD_SIGNATURE);
		free(f);
		free(other);
	}
	/* a verify-only keyring (a node's, from the public PEM) accepts the same token */
	{
		struct auth_keyring *node = auth_keyring_new();

		CHECK_INT(auth_keyring_add_public_pem(node, kp1.public_pem, strlen(kp1.public_pem),
						      NULL, NULL), KILN_OK);
		CHECK_INT(verify_reason(node, t, &api_opts), AUTH_JWT_OK);
		auth_keyring_free(node);
	}
	free(t);
}

#define THREADS 4
#define ROUNDS 100

struct worker {
	const char *good, *bad;
	int ok, refused, signed_ok;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	struct auth_token_params p = user_params();

	for (int i = 0; i < ROUNDS; i++) {
		char *t = NULL;

		if (verify_reason(kr, w->good, &api_opts) == AUTH_JWT_OK)
			w->ok++;
		if (verify_reason(kr, w->bad, &api_opts) == AUTH_JWT_BAD_SIGNATURE)
			w->refused++;
		if (auth_jwt_sign(kr, &p, &t, NULL, NULL) == KILN_OK &&
		    verify_reason(kr, t, &api_opts) == AUTH_JWT_OK)
			w->signed_ok++;
		free(t);
	}
	return NULL;
}

/* One keyring, shared read-only: signing and verifying from many threads at once. */
static void many_threads_share_one_keyring(void)
{
	struct auth_token_params p = user_params();
	char *good = sign_or_null(kr, &p), *bad = sign_or_null(kr, &p);
	struct worker w[THREADS];
	pthread_t th[THREADS];
	size_t n;

	if (!good || !bad)
		return;
	n = strlen(bad);
	bad[n - 3] = bad[n - 3] == 'A' ? 'B' : 'A';
	memset(w, 0, sizeof(w));
	for (int i = 0; i < THREADS; i++) {
		w[i].good = good;
		w[i].bad = bad;
		CHECK_INT(pthread_create(&th[i], NULL, work, &w[i]), 0);
	}
	for (int i = 0; i < THREADS; i++) {
		pthread_join(th[i], NULL);
		CHECK_INT(w[i].ok, ROUNDS);
		CHECK_INT(w[i].refused, ROUNDS);
		CHECK_INT(w[i].signed_ok, ROUNDS);
	}
	free(good);
	free(bad);
}

int main(void)
{
	setup();
	TEST(keygen_kid_is_the_thumbprint_of_both_halves);
	TEST(keyring_refuses_bad_pems);
	TEST(user_token_round_trips);
	TEST(node_token_needs_node_audience_and_sandbox);
	TEST(expiry_and_not_yet_valid_use_injected_time);
	TEST(unknown_kid_is_reported_distinctly);
	TEST(alg_none_is_refused);
	TEST(hs256_keyed_with_the_public_pem_is_refused);
	TEST(other_header_members_and_missing_kid_are_refused);
	TEST(bad_signatures_are_refused);
	TEST(missing_and_ill_typed_claims_are_refused);
	TEST(garbled_and_oversized_tokens_are_refused);
	TEST(rotation_new_key_signs_old_key_still_verifies);
	TEST(sign_refuses_bad_parameters);
	TEST(signed_tokens_verify_in_libjwt);
	TEST(odd_signatures_are_refused);
	TEST(many_threads_share_one_keyring);
	auth_keyring_free(kr);
	auth_jwt_keypair_release(&kp1);
	auth_jwt_keypair_release(&kp2);
	return test_summary();
}
