/*
 * auth_fuzz.c - libFuzzer target for auth/'s parsers of outside input: the Authorization header,
 * API keys, JWTs (raw, and payloads signed with a real key so the claim checks are reached),
 * scope strings and arrays, JWKS documents, and sealed values.
 *
 * The first byte picks the mode; the rest is the input. Built and run briefly by
 * tests/fuzz/CMakeLists.txt (ctest -R auth_fuzz); make fuzz runs it at length (docs/testing.md).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jwt.h>

#include "auth/apikey.h"
#include "auth/bearer.h"
#include "auth/crypto.h"
#include "auth/jwks.h"
#include "auth/jwt.h"
#include "auth/keyring.h"
#include "auth/scopes.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct auth_jwt_keypair kp;
static struct auth_keyring *kr;
static struct auth_master_key mk;
static const unsigned char pepper[32] = "fuzz-pepper-fuzz-pepper-fuzz-pe";

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	if (auth_jwt_keygen(&kp, NULL) != KILN_OK)
		abort();
	kr = auth_keyring_new();
	if (!kr || auth_keyring_add_private_pem(kr, kp.private_pem, strlen(kp.private_pem), NULL,
						NULL) != KILN_OK ||
	    auth_keyring_set_active(kr, kp.kid, NULL) != KILN_OK)
		abort();
	auth_master_key_generate(&mk, NULL);
	return 0;
}

static void verify_both(const char *tok, size_t n)
{
	struct auth_verify_opts api = { .aud = AUTH_AUD_API, .now = 1700000000, .leeway_s = 30,
					.max_ttl_s = 900 };
	struct auth_verify_opts node = { .aud = AUTH_AUD_NODE, .now = 1700000000,
					 .require_sbx = true };
	enum auth_jwt_reason why;
	struct auth_claims c;

	auth_jwt_verify(kr, tok, n, &api, &c, &why, NULL);
	auth_jwt_verify(kr, tok, n, &node, &c, &why, NULL);
}

/* Signs the input as a JWT payload with the real key, so the claim checks see arbitrary JSON. */
static void sign_then_verify(const char *payload)
{
	jwt_t *j = NULL;
	char *tok = NULL;

	if (jwt_new(&j) == 0 && jwt_add_header(j, "kid", kp.kid) == 0 &&
	    jwt_add_grants_json(j, payload) == 0 &&
	    jwt_set_alg(j, JWT_ALG_ES256, (const unsigned char *)kp.private_pem,
			(int)strlen(kp.private_pem)) == 0)
		tok = jwt_encode_str(j);
	jwt_free(j);
	if (tok)
		verify_both(tok, strlen(tok));
	free(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct auth_credential cred;
	struct auth_apikey key;
	struct auth_keyring *tmp;
	unsigned char *pt = NULL;
	size_t ptlen = 0;
	uint32_t scopes;
	char *s;

	if (size < 1 || size > 70000)
		return 0;
	/* A private copy of exactly the input, so reading past it is caught. */
	s = malloc(size);
	if (!s)
		return 0;
	memcpy(s, data + 1, size - 1);
	switch (data[0] % 6) {
	case 0:
		if (auth_bearer_parse(s, size - 1, &cred, NULL) == KILN_OK) {
			if (cred.kind == AUTH_CRED_API_KEY &&
			    auth_apikey_parse(cred.value, cred.len, &key, NULL) == KILN_OK)
				auth_apikey_verify(&key, pepper, sizeof(pepper),
						   "00000000000000000000000000000000"
						   "00000000000000000000000000000000");
			else if (cred.kind == AUTH_CRED_JWT)
				verify_both(cred.value, cred.len);
		}
		break;
	case 1:
		verify_both(s, size - 1);
		break;
	case 2:
		auth_scopes_parse(s, size - 1, &scopes, NULL);
		auth_scopes_parse_json(s, size - 1, &scopes, NULL);
		break;
	case 3:
		tmp = auth_keyring_new();
		auth_jwks_load(tmp, s, size - 1, NULL);
		auth_keyring_free(tmp);
		break;
	case 4:
		if (auth_open(&mk, s, size - 1, "ad", 2, &pt, &ptlen, NULL) == KILN_OK)
			auth_secret_free(pt, ptlen);
		auth_master_key_load(&(struct auth_master_key){ { 0 } }, s, size - 1, NULL);
		break;
	case 5: {
		char *z = malloc(size);

		if (z) {
			memcpy(z, data + 1, size - 1);
			z[size - 1] = '\0';
			sign_then_verify(z);
			free(z);
		}
		break;
	}
	}
	free(s);
	return 0;
}
