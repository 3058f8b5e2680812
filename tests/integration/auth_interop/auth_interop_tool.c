/*
 * auth_interop_tool.c - a small command-line face on auth/ for the interoperability test
 * (test_interop.py), which checks Kiln's tokens with an independent JWT implementation.
 *
 *   auth_interop_tool issue
 *       makes a fresh signing key and prints {"token","jwks","public_pem","kid"}: a kiln-api token
 *       issued now (the wall clock, read not set) for 300 s.
 *   auth_interop_tool verify <jwks-file> <aud>
 *       loads the JWKS as kiln-node would and verifies the token on stdin; prints
 *       "ok <sub> <tid> <scope>" (exit 0) or "refused <reason>" (exit 1); exit 2 on misuse.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "auth/jwks.h"
#include "auth/jwt.h"
#include "auth/keyring.h"
#include "auth/scopes.h"

#define ISSUER "https://kiln.test"

static int issue(void)
{
	struct auth_jwt_keypair kp;
	struct auth_keyring *kr = auth_keyring_new();
	struct auth_token_params p = {
		.iss = ISSUER, .aud = AUTH_AUD_API, .sub = "key_interop", .tid = "tn_interop",
		.scopes = AUTH_SCOPE_SANDBOX_READ | AUTH_SCOPE_KEYS_WRITE, .now = (int64_t)time(NULL),
		.ttl_s = 300,
	};
	struct kiln_error err = { 0 };
	char *token = NULL, *jwks = NULL, *out;
	int rc = 2;

	if (!kr || auth_jwt_keygen(&kp, &err) != KILN_OK)
		goto done;
	if (auth_keyring_add_private_pem(kr, kp.private_pem, strlen(kp.private_pem), NULL, &err) ||
	    auth_keyring_set_active(kr, kp.kid, &err) || auth_jwt_sign(kr, &p, &token, NULL, &err))
		goto release;
	jwks = auth_jwks_build(kr, &err);
	if (!jwks)
		goto release;
	out = NULL;
	{
		json_t *o = json_pack("{s:s, s:s, s:s, s:s}", "token", token, "jwks", jwks,
				      "public_pem", kp.public_pem, "kid", kp.kid);

		if (o)
			out = json_dumps(o, JSON_COMPACT);
		json_decref(o);
	}
	if (out) {
		puts(out);
		free(out);
		rc = 0;
	}
release:
	auth_jwt_keypair_release(&kp);
done:
	if (rc)
		fprintf(stderr, "issue failed: %s\n", err.msg);
	free(token);
	free(jwks);
	auth_keyring_free(kr);
	return rc;
}

static char *slurp(FILE *f, size_t max, size_t *len)
{
	char *buf = malloc(max + 1);
	size_t n;

	if (!buf)
		return NULL;
	n = fread(buf, 1, max + 1, f);
	if (n > max) {
		free(buf);
		return NULL;
	}
	while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
		n--;
	buf[n] = '\0';
	*len = n;
	return buf;
}

static int verify(const char *jwks_path, const char *aud)
{
	struct auth_keyring *kr = auth_keyring_new();
	struct auth_verify_opts o = { .aud = aud, .iss = NULL, .now = (int64_t)time(NULL),
				      .leeway_s = 30, .max_ttl_s = 900 };
	struct kiln_error err = { 0 };
	enum auth_jwt_reason why = AUTH_JWT_OK;
	struct auth_claims c;
	char scope[AUTH_SCOPES_STR_MAX];
	char *jwks = NULL, *token = NULL;
	size_t jl = 0, tl = 0;
	FILE *f = fopen(jwks_path, "r");
	int rc = 2;

	if (f) {
		jwks = slurp(f, AUTH_JWKS_MAX, &jl);
		fclose(f);
	}
	token = slurp(stdin, 2 * AUTH_JWT_MAX, &tl);
	if (!kr || !jwks || !token) {
		fprintf(stderr, "cannot read the jwks or the token\n");
		goto done;
	}
	if (auth_jwks_load(kr, jwks, jl, &err) != KILN_OK) {
		fprintf(stderr, "jwks refused: %s\n", err.msg);
		goto done;
	}
	switch (auth_jwt_verify(kr, token, tl, &o, &c, &why, &err)) {
	case KILN_OK:
		auth_scopes_format(c.scopes, scope, sizeof(scope));
		printf("ok %s %s %s\n", c.sub, c.tid, scope);
		rc = 0;
		break;
	case KILN_E_UNAUTHENTICATED:
		printf("refused %s\n", auth_jwt_reason_name(why));
		rc = 1;
		break;
	default:
		fprintf(stderr, "verify failed: %s\n", err.msg);
		break;
	}
done:
	free(jwks);
	free(token);
	auth_keyring_free(kr);
	return rc;
}

int main(int argc, char **argv)
{
	if (argc == 2 && strcmp(argv[1], "issue") == 0)
		return issue();
	if (argc == 4 && strcmp(argv[1], "verify") == 0)
		return verify(argv[2], argv[3]);
	fprintf(stderr, "usage: %s issue | verify <jwks-file> <aud> < token\n", argv[0]);
	return 2;
}
