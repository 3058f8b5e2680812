/*
 * test_jwks.c - the JWKS document: built from a keyring, loaded back as verify-only keys, and
 * strict refusal of anything else.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "auth/jwks.h"
#include "auth/jwt.h"
#include "auth/keyring.h"
#include "test.h"

#define NOW 1700000000LL

static struct auth_jwt_keypair kp1, kp2;
static struct auth_keyring *gw;	/* the gateway's: both private, kp2 active */
static char *doc;

static void setup(void)
{
	auth_jwt_keygen(&kp1, NULL);
	auth_jwt_keygen(&kp2, NULL);
	gw = auth_keyring_new();
	auth_keyring_add_private_pem(gw, kp1.private_pem, strlen(kp1.private_pem), NULL, NULL);
	auth_keyring_add_private_pem(gw, kp2.private_pem, strlen(kp2.private_pem), NULL, NULL);
	auth_keyring_set_active(gw, kp2.kid, NULL);
	doc = auth_jwks_build(gw, NULL);
}

static void built_jwks_lists_every_key_as_es256(void)
{
	json_t *j, *keys, *k;
	size_t i;

	CHECK(doc != NULL);
	j = json_loads(doc, 0, NULL);
	CHECK(j != NULL);
	keys = json_object_get(j, "keys");
	CHECK_INT(json_array_size(keys), 2);
	json_array_foreach(keys, i, k) {
		CHECK_STR(json_string_value(json_object_get(k, "kty")), "EC");
		CHECK_STR(json_string_value(json_object_get(k, "crv")), "P-256");
		CHECK_STR(json_string_value(json_object_get(k, "alg")), "ES256");
		CHECK_STR(json_string_value(json_object_get(k, "use")), "sig");
		CHECK_INT(strlen(json_string_value(json_object_get(k, "x"))), 43);
		CHECK_INT(strlen(json_string_value(json_object_get(k, "y"))), 43);
		CHECK(json_object_get(k, "d") == NULL);
	}
	CHECK_STR(json_string_value(json_object_get(json_array_get(keys, 0), "kid")), kp1.kid);
	CHECK_STR(json_string_value(json_object_get(json_array_get(keys, 1), "kid")), kp2.kid);
	json_decref(j);
	CHECK(strstr(doc, "PRIVATE") == NULL);
}

static void node_verifies_gateway_tokens_from_the_jwks(void)
{
	struct auth_keyring *node = auth_keyring_new();
	struct auth_token_params p = {
		.iss = "gw", .aud = AUTH_AUD_NODE, .sub = "key_a", .tid = "tn_a", .sbx = "sb_a",
		.scopes = 3, .now = NOW, .ttl_s = 30,
	};
	struct auth_verify_opts o = { .aud = AUTH_AUD_NODE, .now = NOW + 1, .require_sbx = true };
	struct auth_claims c;
	char *t = NULL, *again;

	CHECK_INT(auth_jwks_load(node, doc, strlen(doc), NULL), KILN_OK);
	CHECK_INT(auth_keyring_count(node), 2);
	CHECK(auth_keyring_has(node, kp1.kid) && auth_keyring_has(node, kp2.kid));
	CHECK_STR(auth_keyring_public_pem(node, kp1.kid), kp1.public_pem);
	CHECK_INT(auth_keyring_set_active(node, kp2.kid, NULL), KILN_E_INVALID);	/* verify-only */
	CHECK_INT(auth_jwt_sign(node, &p, &t, NULL, NULL), KILN_E_INTERNAL);
	CHECK_INT(auth_jwt_sign(gw, &p, &t, NULL, NULL), KILN_OK);
	CHECK_INT(auth_jwt_verify(node, t, strlen(t), &o, &c, NULL, NULL), KILN_OK);
	CHECK_STR(c.sbx, "sb_a");
	/* the node's JWKS equals the gateway's */
	again = auth_jwks_build(node, NULL);
	CHECK_STR(again, doc);
	free(again);
	free(t);
	/* loading again is a conflict and changes nothing */
	CHECK_INT(auth_jwks_load(node, doc, strlen(doc), NULL), KILN_E_CONFLICT);
	CHECK_INT(auth_keyring_count(node), 2);
	auth_keyring_free(node);
}

/* Replaces the first `from` in doc with `to` and loads the result into a fresh keyring. */
static enum kiln_err load_edited(const char *from, const char *to, struct kiln_error *err)
{
	struct auth_keyring *k = auth_keyring_new();
	const char *at = strstr(doc, from);
	char buf[8192];
	enum kiln_err rc;

	if (!at) {
		fprintf(stderr, "'%s' not in the jwks\n", from);
		auth_keyring_free(k);
		return KILN_E_INTERNAL;
	}
	snprintf(buf, sizeof(buf), "%.*s%s%s", (int)(at - doc), doc, to, at + strlen(from));
	rc = auth_jwks_load(k, buf, strlen(buf), err);
	if (rc != KILN_OK)
		CHECK_INT(auth_keyring_count(k), 0);	/* all or nothing */
	auth_keyring_free(k);
	return rc;
}

static enum kiln_err load_str(const char *s)
{
	struct auth_keyring *k = auth_keyring_new();
	enum kiln_err rc = auth_jwks_load(k, s, strlen(s), NULL);

	auth_keyring_free(k);
	return rc;
}

static void jwks_refuses_anything_but_p256_es256_keys(void)
{
	struct kiln_error err = { 0 };
	char coord[64], kidfield[80];
	json_t *j = json_loads(doc, 0, NULL);
	const char *x = json_string_value(json_object_get(json_array_get(json_object_get(j, "keys"), 1), "x"));

	CHECK_INT(load_str("not json"), KILN_E_INVALID);
	CHECK_INT(load_str("[]"), KILN_E_INVALID);
	CHECK_INT(load_str("{}"), KILN_E_INVALID);
	CHECK_INT(load_str("{\"keys\":[]}"), KILN_E_INVALID);
	CHECK_INT(load_str("{\"keys\":{}}"), KILN_E_INVALID);
	CHECK_INT(load_str("{\"keys\":[1]}"), KILN_E_INVALID);
	CHECK_INT(load_edited("\"kty\":\"EC\"", "\"kty\":\"RSA\"", NULL), KILN_E_INVALID);
	CHECK_INT(load_edited("\"crv\":\"P-256\"", "\"crv\":\"P-384\"", NULL), KILN_E_INVALID);
	CHECK_INT(load_edited("\"alg\":\"ES256\"", "\"alg\":\"HS256\"", NULL), KILN_E_INVALID);
	CHECK_INT(load_edited("\"use\":\"sig\"", "\"use\":\"enc\"", NULL), KILN_E_INVALID);
	CHECK_INT(load_edited("\"kty\":\"EC\"", "\"kty\":\"EC\",\"d\":\"AAAA\"", NULL),
		  KILN_E_INVALID);
	CHECK_INT(load_edited("\"kty\":\"EC\"", "\"kty\":\"EC\",\"kty\":\"EC\"", NULL),
		  KILN_E_INVALID);	/* duplicate member */
	CHECK_INT(load_edited("{\"keys\"", "{\"extra\":1,\"keys\"", NULL), KILN_E_INVALID);
	/* a kid that is not the key's thumbprint */
	snprintf(kidfield, sizeof(kidfield), "\"kid\":\"%s\"", kp1.kid);
	CHECK_INT(load_edited(kidfield, "\"kid\":\"mykey\"", &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "thumbprint") != NULL);
	/* coordinates: wrong length, not base64url, not on the curve */
	snprintf(coord, sizeof(coord), "\"x\":\"%s\"", x);
	CHECK_INT(load_edited(coord, "\"x\":\"AAAA\"", NULL), KILN_E_INVALID);
	CHECK_INT(load_edited(coord, "\"x\":\"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA+\"", NULL),
		  KILN_E_INVALID);
	CHECK_INT(load_edited(coord, "\"x\":\"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA\"", &err),
		  KILN_E_INVALID);
	CHECK_INT(load_edited(coord, "\"x\":1", NULL), KILN_E_INVALID);
	json_decref(j);
	/* the second key is bad: the first is not kept either */
	CHECK_INT(load_edited("\"alg\":\"ES256\"}]", "\"alg\":\"ES384\"}]", NULL), KILN_E_INVALID);
}

static void jwks_caps_size_and_key_count(void)
{
	size_t n = AUTH_JWKS_MAX + 10;
	char *big = malloc(n + 1);
	struct auth_keyring *k = auth_keyring_new();

	memset(big, ' ', n);
	big[n] = '\0';
	CHECK_INT(auth_jwks_load(k, big, n, NULL), KILN_E_TOO_LARGE);
	free(big);
	/* 17 keys */
	{
		char many[20000];
		size_t o = 0;
		const char *inner = strchr(doc, '[') + 1;
		size_t il = (size_t)(strchr(doc, ']') - inner);

		o += (size_t)snprintf(many + o, sizeof(many) - o, "{\"keys\":[");
		for (int i = 0; i < 9; i++)
			o += (size_t)snprintf(many + o, sizeof(many) - o, "%s%.*s", i ? "," : "",
					      (int)il, inner);
		snprintf(many + o, sizeof(many) - o, "]}");
		CHECK_INT(auth_jwks_load(k, many, strlen(many), NULL), KILN_E_QUOTA);
	}
	CHECK_INT(auth_keyring_count(k), 0);
	auth_keyring_free(k);
}

int main(void)
{
	setup();
	TEST(built_jwks_lists_every_key_as_es256);
	TEST(node_verifies_gateway_tokens_from_the_jwks);
	TEST(jwks_refuses_anything_but_p256_es256_keys);
	TEST(jwks_caps_size_and_key_count);
	free(doc);
	auth_keyring_free(gw);
	auth_jwt_keypair_release(&kp1);
	auth_jwt_keypair_release(&kp2);
	return test_summary();
}
