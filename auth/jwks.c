/*
 * jwks.c - building and loading JWKS documents (see jwks.h).
 */
#include "auth/jwks.h"

#include <string.h>

#include <jansson.h>
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/param_build.h>

#include "auth/encode.h"
#include "auth/keyring_priv.h"

char *auth_jwks_build(const struct auth_keyring *kr, struct kiln_error *err)
{
	unsigned char x[AUTH_EC_COORD_LEN], y[AUTH_EC_COORD_LEN];
	char xs[AUTH_B64URL_LEN(AUTH_EC_COORD_LEN) + 1], ys[sizeof(xs)];
	json_t *doc, *keys;
	char *out = NULL;

	doc = json_object();
	keys = json_array();
	if (!doc || !keys || json_object_set_new(doc, "keys", keys) != 0) {
		if (!doc || !keys)
			json_decref(keys);
		json_decref(doc);
		kiln_error_set(err, KILN_E_NOMEM, "out of memory building the jwks");
		return NULL;
	}
	for (size_t i = 0; kr && i < kr->n; i++) {
		const struct auth_key *k = &kr->keys[i];
		json_t *jwk;

		if (keyring_ec_xy(k->pkey, x, y) != 0) {
			kiln_error_set(err, KILN_E_INTERNAL, "key '%s' is not p-256", k->kid);
			goto cleanup;
		}
		auth_b64url_encode(x, sizeof(x), xs, sizeof(xs));
		auth_b64url_encode(y, sizeof(y), ys, sizeof(ys));
		jwk = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:s}", "kty", "EC", "crv", "P-256",
				"x", xs, "y", ys, "kid", k->kid, "use", "sig", "alg", "ES256");
		if (!jwk || json_array_append_new(keys, jwk) != 0) {
			kiln_error_set(err, KILN_E_NOMEM, "out of memory building the jwks");
			goto cleanup;
		}
	}
	out = json_dumps(doc, JSON_COMPACT);
	if (!out)
		kiln_error_set(err, KILN_E_NOMEM, "out of memory building the jwks");
cleanup:
	json_decref(doc);
	return out;
}

/* A P-256 public key from its coordinates, checked to lie on the curve; NULL otherwise. */
static EVP_PKEY *pkey_from_xy(const unsigned char x[AUTH_EC_COORD_LEN],
			      const unsigned char y[AUTH_EC_COORD_LEN])
{
	unsigned char point[1 + 2 * AUTH_EC_COORD_LEN];
	OSSL_PARAM_BLD *bld = OSSL_PARAM_BLD_new();
	OSSL_PARAM *params = NULL;
	EVP_PKEY_CTX *ctx = NULL, *chk = NULL;
	EVP_PKEY *pkey = NULL;

	point[0] = 0x04;	/* uncompressed */
	memcpy(point + 1, x, AUTH_EC_COORD_LEN);
	memcpy(point + 1 + AUTH_EC_COORD_LEN, y, AUTH_EC_COORD_LEN);
	if (!bld ||
	    OSSL_PARAM_BLD_push_utf8_string(bld, OSSL_PKEY_PARAM_GROUP_NAME, "prime256v1", 0) != 1 ||
	    OSSL_PARAM_BLD_push_octet_string(bld, OSSL_PKEY_PARAM_PUB_KEY, point, sizeof(point)) != 1)
		goto cleanup;
	params = OSSL_PARAM_BLD_to_param(bld);
	ctx = EVP_PKEY_CTX_new_from_name(NULL, "EC", NULL);
	if (!params || !ctx || EVP_PKEY_fromdata_init(ctx) != 1 ||
	    EVP_PKEY_fromdata(ctx, &pkey, EVP_PKEY_PUBLIC_KEY, params) != 1) {
		pkey = NULL;
		goto cleanup;
	}
	chk = EVP_PKEY_CTX_new(pkey, NULL);
	if (!chk || EVP_PKEY_public_check(chk) != 1) {
		EVP_PKEY_free(pkey);
		pkey = NULL;
	}
cleanup:
	EVP_PKEY_CTX_free(chk);
	EVP_PKEY_CTX_free(ctx);
	OSSL_PARAM_free(params);
	OSSL_PARAM_BLD_free(bld);
	return pkey;
}

static bool member_is(json_t *o, const char *name, const char *want, bool required)
{
	json_t *v = json_object_get(o, name);

	if (!v)
		return !required;
	return json_is_string(v) && strcmp(json_string_value(v), want) == 0 &&
	       json_string_length(v) == strlen(want);
}

static bool coord(json_t *o, const char *name, unsigned char out[AUTH_EC_COORD_LEN])
{
	json_t *v = json_object_get(o, name);

	return json_is_string(v) &&
	       json_string_length(v) == AUTH_B64URL_LEN(AUTH_EC_COORD_LEN) &&
	       auth_b64url_decode(json_string_value(v), json_string_length(v), out,
				  AUTH_EC_COORD_LEN) == AUTH_EC_COORD_LEN;
}

/* Reads one JWK into a public key whose thumbprint matches its kid. */
static EVP_PKEY *read_jwk(json_t *jwk, size_t i, struct kiln_error *err)
{
	static const char *const allowed[] = { "kty", "crv", "x", "y", "kid", "use", "alg" };
	unsigned char x[AUTH_EC_COORD_LEN], y[AUTH_EC_COORD_LEN];
	char kid[AUTH_KID_MAX];
	const char *name;
	EVP_PKEY *pkey;
	json_t *v;

	if (!json_is_object(jwk)) {
		kiln_error_set(err, KILN_E_INVALID, "jwks key %zu is not an object", i);
		return NULL;
	}
	json_object_foreach(jwk, name, v) {
		bool ok = false;

		for (size_t a = 0; a < sizeof(allowed) / sizeof(allowed[0]); a++)
			ok = ok || strcmp(name, allowed[a]) == 0;
		if (!ok) {
			kiln_error_set(err, KILN_E_INVALID, "jwks key %zu has member '%.32s'", i,
				       name);
			return NULL;
		}
	}
	if (!member_is(jwk, "kty", "EC", true) || !member_is(jwk, "crv", "P-256", true) ||
	    !member_is(jwk, "use", "sig", false) || !member_is(jwk, "alg", "ES256", false)) {
		kiln_error_set(err, KILN_E_INVALID, "jwks key %zu is not an ES256 P-256 key", i);
		return NULL;
	}
	if (!coord(jwk, "x", x) || !coord(jwk, "y", y)) {
		kiln_error_set(err, KILN_E_INVALID, "jwks key %zu has malformed coordinates", i);
		return NULL;
	}
	pkey = pkey_from_xy(x, y);
	if (!pkey) {
		kiln_error_set(err, KILN_E_INVALID, "jwks key %zu is not a point on P-256", i);
		return NULL;
	}
	v = json_object_get(jwk, "kid");
	if (keyring_thumbprint(pkey, kid) != 0 || !json_is_string(v) ||
	    strcmp(json_string_value(v), kid) != 0 || json_string_length(v) != AUTH_KID_LEN) {
		EVP_PKEY_free(pkey);
		kiln_error_set(err, KILN_E_INVALID, "jwks key %zu: kid is not its thumbprint", i);
		return NULL;
	}
	return pkey;
}

enum kiln_err auth_jwks_load(struct auth_keyring *kr, const char *json, size_t len,
			     struct kiln_error *err)
{
	EVP_PKEY *pkeys[AUTH_KEYRING_MAX] = { 0 };
	char kids[AUTH_KEYRING_MAX][AUTH_KID_MAX];
	enum kiln_err rc = KILN_OK;
	size_t n = 0, added = 0;
	json_error_t jerr;
	json_t *doc, *keys, *jwk;
	size_t i;

	if (!kr || !json)
		return kiln_error_set(err, KILN_E_INVALID, "jwks missing");
	if (len > AUTH_JWKS_MAX)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "jwks over %d bytes", AUTH_JWKS_MAX);
	doc = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!doc)
		return kiln_error_set(err, KILN_E_INVALID, "jwks is not JSON");
	keys = json_object_get(doc, "keys");
	if (!json_is_object(doc) || json_object_size(doc) != 1 || !json_is_array(keys) ||
	    json_array_size(keys) == 0) {
		rc = kiln_error_set(err, KILN_E_INVALID, "jwks must be {\"keys\":[...]} with keys");
		goto cleanup;
	}
	if (json_array_size(keys) > AUTH_KEYRING_MAX ||
	    kr->n + json_array_size(keys) > AUTH_KEYRING_MAX) {
		rc = kiln_error_set(err, KILN_E_QUOTA, "jwks has too many keys");
		goto cleanup;
	}
	json_array_foreach(keys, i, jwk) {
		pkeys[n] = read_jwk(jwk, i, err);
		if (!pkeys[n]) {
			rc = KILN_E_INVALID;
			goto cleanup;
		}
		n++;
	}
	for (i = 0; i < n; i++) {
		rc = keyring_add_pkey(kr, pkeys[i], false, kids[i], err);
		pkeys[i] = NULL;	/* owned by the keyring now, or freed */
		if (rc != KILN_OK)
			break;
		added++;
	}
	if (rc != KILN_OK)
		for (i = 0; i < added; i++)
			auth_keyring_remove(kr, kids[i]);
cleanup:
	for (i = 0; i < n; i++)
		EVP_PKEY_free(pkeys[i]);
	json_decref(doc);
	return rc;
}
