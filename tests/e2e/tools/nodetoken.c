/*
 * nodetoken.c - prints a kiln-node token as a gateway would sign it (aud kiln-node, a tenant, a
 * sandbox, every tenant scope, 60 s), for the end-to-end tests that speak to kiln-node's own
 * routes directly (test_ports.py). Reads the gateway's signing key from Postgres, sealed by the
 * master key, as kiln-gateway does: KILN_DATABASE_URL and KILN_MASTER_KEY in the environment.
 *
 * usage: kiln-test-nodetoken TENANT_ID SANDBOX_ID
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "auth/jwt.h"
#include "auth/masterkey.h"
#include "auth/scopes.h"
#include "auth/signing.h"
#include "common/config.h"
#include "common/pg.h"

int main(int argc, char **argv)
{
	struct kiln_config cfg;
	struct kiln_error err = { 0 };
	struct auth_master_key mk;
	struct signing *s = NULL;
	struct pg *pg = NULL;
	char *token = NULL;
	int rc = 1;

	if (argc != 3) {
		fprintf(stderr, "usage: kiln-test-nodetoken TENANT_ID SANDBOX_ID\n");
		return 2;
	}
	if (config_load(&cfg, NULL, false, &err) != KILN_OK) {
		fprintf(stderr, "config: %s\n", err.msg);
		return 1;
	}
	if (masterkey_load(&cfg, &mk, &err) != KILN_OK)
		goto out;
	pg = pg_new(cfg.database_url, 1);
	s = pg ? signing_new(pg, &mk, &err) : NULL;
	if (!s)
		goto out;
	struct auth_token_params tp = {
		.iss = "kiln",
		.aud = AUTH_AUD_NODE,
		.sub = "key_test",
		.tid = argv[1],
		.sbx = argv[2],
		.scopes = AUTH_SCOPES_TENANT,
		.now = time(NULL),
		.ttl_s = 60,
	};

	if (signing_sign(s, &tp, &token, NULL, &err) != KILN_OK)
		goto out;
	printf("%s\n", token);
	rc = 0;
out:
	if (rc)
		fprintf(stderr, "kiln-test-nodetoken: %s\n", err.msg[0] ? err.msg : "cannot sign");
	free(token);
	signing_free(s);
	pg_free(pg);
	config_release(&cfg);
	return rc;
}
