/*
 * storage_tool.c - calls storage_load() (auth/storage.c, as kiln-node does) for the storage tests:
 *
 *   KILN_MASTER_KEY=... EXPECT_SECRET=... storage_tool CONNINFO TENANT_ID
 *
 * prints {"rc": "...", "message": "...", "endpoint", "bucket", "region", "prefix",
 * "access_key_id", "secret_matches": bool} - never the secret itself.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth/storage.h"

int main(int argc, char **argv)
{
	struct auth_master_key mk;
	struct kiln_error err = { 0 };
	struct s3_target t;
	struct pg *pool;
	struct pg_conn *c = NULL;
	const char *mkt = getenv("KILN_MASTER_KEY"), *want = getenv("EXPECT_SECRET");
	enum kiln_err rc;
	json_t *out;
	char *text;

	if (argc != 3 || !mkt) {
		fprintf(stderr, "usage: KILN_MASTER_KEY=... storage_tool CONNINFO TENANT_ID\n");
		return 2;
	}
	rc = auth_master_key_load(&mk, mkt, strlen(mkt), &err);
	pool = pg_new(argv[1], 1);
	if (rc == KILN_OK)
		rc = pg_acquire(pool, &c, &err);
	if (rc == KILN_OK)
		rc = storage_load(c, &mk, argv[2], &t, &err);
	out = json_pack("{s:s, s:s}", "rc", kiln_err_name(rc), "message", rc ? err.msg : "");
	if (rc == KILN_OK) {
		json_object_set_new(out, "endpoint", json_string(t.endpoint));
		json_object_set_new(out, "bucket", json_string(t.bucket));
		json_object_set_new(out, "region", json_string(t.region));
		json_object_set_new(out, "prefix", json_string(t.prefix));
		json_object_set_new(out, "access_key_id", json_string(t.access_key_id));
		json_object_set_new(out, "secret_matches",
				    json_boolean(want && strcmp(want, t.secret_access_key) == 0));
		s3_target_wipe(&t);
	}
	if (c)
		pg_release(pool, c);
	pg_free(pool);
	auth_master_key_wipe(&mk);
	text = json_dumps(out, JSON_COMPACT);
	printf("%s\n", text);
	free(text);
	json_decref(out);
	return rc == KILN_OK ? 0 : 1;
}
