/*
 * s3_tool.c - drives common/s3.c from the storage integration tests: one operation per run on the
 * target the environment names (S3_ENDPOINT, S3_BUCKET, S3_REGION, S3_PREFIX, S3_ACCESS_KEY_ID,
 * S3_SECRET_ACCESS_KEY; S3_PART_SIZE, S3_RETRIES optional; KILN_STORAGE_ALLOW the allow list of
 * common/netaddr.h, as the daemons' storage_allow), one JSON line on stdout:
 * {"rc": "<kiln_err_name>", "message": "...", ...}. Exit status 0 when the call succeeded.
 *
 *   s3_tool put KEY FILE [PAUSE_AFTER]   PAUSE_AFTER: after that part, print "paused" and wait
 *                                        for a line on stdin (the test kills the server meanwhile)
 *   s3_tool putdata KEY TEXT | get KEY FILE | head KEY | delete KEY | list PREFIX
 */
#include <curl/curl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/s3.h"

static unsigned pause_after;

static enum kiln_err on_part(void *arg, unsigned part, unsigned nparts, bool sent)
{
	char line[16];

	(void)arg;
	fprintf(stderr, "part %u/%u %s\n", part, nparts, sent ? "sent" : "skipped");
	if (part == pause_after) {
		printf("paused\n");
		fflush(stdout);
		if (!fgets(line, sizeof(line), stdin))
			return KILN_E_UNAVAILABLE;
	}
	return KILN_OK;
}

static enum kiln_err on_key(void *arg, const char *key, uint64_t size)
{
	json_array_append_new(arg, json_pack("{s:s, s:I}", "key", key, "size", (json_int_t)size));
	return KILN_OK;
}

static void env(char *dst, size_t n, const char *name)
{
	const char *v = getenv(name);
	snprintf(dst, n, "%s", v ? v : "");
}

int main(int argc, char **argv)
{
	struct s3_target t;
	struct s3_opts o = { 0 };
	struct kiln_error err = { 0 };
	struct s3_client *c = NULL;
	struct netaddr_allow *allow = NULL;
	enum kiln_err rc = KILN_E_BAD_REQUEST;
	json_t *out = json_object();
	char *text;

	if (argc < 3) {
		fprintf(stderr, "usage: s3_tool put|putdata|get|head|delete|list ARGS\n");
		return 2;
	}
	curl_global_init(CURL_GLOBAL_DEFAULT);
	memset(&t, 0, sizeof(t));
	env(t.endpoint, sizeof(t.endpoint), "S3_ENDPOINT");
	env(t.bucket, sizeof(t.bucket), "S3_BUCKET");
	env(t.region, sizeof(t.region), "S3_REGION");
	env(t.prefix, sizeof(t.prefix), "S3_PREFIX");
	env(t.access_key_id, sizeof(t.access_key_id), "S3_ACCESS_KEY_ID");
	env(t.secret_access_key, sizeof(t.secret_access_key), "S3_SECRET_ACCESS_KEY");
	o.part_size = getenv("S3_PART_SIZE") ? strtoull(getenv("S3_PART_SIZE"), NULL, 10) : 0;
	o.retries = getenv("S3_RETRIES") ? (unsigned)atoi(getenv("S3_RETRIES")) : 0;
	o.connect_timeout_ms = 2000;
	if (netaddr_allow_parse(getenv("KILN_STORAGE_ALLOW"), &allow, &err) == KILN_OK) {
		o.allow = allow;
		c = s3_client_new(&t, &o, &err);
	}
	s3_target_wipe(&t);
	if (!c) {
		rc = err.code;
	} else if (strcmp(argv[1], "put") == 0 && argc >= 4) {
		struct s3_put_stats st;
		pause_after = argc >= 5 ? (unsigned)atoi(argv[4]) : 0;
		rc = s3_put_file(c, argv[2], argv[3], on_part, NULL, &st, &err);
		json_object_set_new(out, "parts", json_integer(st.parts));
		json_object_set_new(out, "parts_sent", json_integer(st.parts_sent));
		json_object_set_new(out, "parts_skipped", json_integer(st.parts_skipped));
		json_object_set_new(out, "resumed", json_boolean(st.resumed));
		json_object_set_new(out, "multipart", json_boolean(st.multipart));
	} else if (strcmp(argv[1], "putdata") == 0 && argc >= 4) {
		rc = s3_put_data(c, argv[2], argv[3], strlen(argv[3]), &err);
	} else if (strcmp(argv[1], "get") == 0 && argc >= 4) {
		rc = s3_get_file(c, argv[2], argv[3], &err);
	} else if (strcmp(argv[1], "head") == 0) {
		struct s3_object_info info = { 0 };
		rc = s3_head(c, argv[2], &info, &err);
		json_object_set_new(out, "size", json_integer((json_int_t)info.size));
		json_object_set_new(out, "etag", json_string(info.etag));
	} else if (strcmp(argv[1], "delete") == 0) {
		rc = s3_delete(c, argv[2], &err);
	} else if (strcmp(argv[1], "list") == 0) {
		json_t *keys = json_array();
		rc = s3_list(c, argv[2], on_key, keys, &err);
		json_object_set_new(out, "keys", keys);
	} else {
		kiln_error_set(&err, KILN_E_BAD_REQUEST, "unknown operation \"%s\"", argv[1]);
	}
	s3_client_free(c);
	netaddr_allow_free(allow);
	json_object_set_new(out, "rc", json_string(kiln_err_name(rc)));
	json_object_set_new(out, "message", json_string(rc == KILN_OK ? "" : err.msg));
	text = json_dumps(out, JSON_COMPACT);
	printf("%s\n", text);
	free(text);
	json_decref(out);
	curl_global_cleanup();
	return rc == KILN_OK ? 0 : 1;
}
