/*
 * snapstore_tool.c - drives node/storage_sync.c for test_snapstore.py, one operation per run,
 * as kiln-node would (its own pool, master key and snapshot root):
 *
 *   snapstore_tool set-storage TENANT              storage_save() of S3_* (the gateway's writer)
 *   snapstore_tool upload SNAP TENANT [PAUSE_AT]   snapstore_upload_start, then waits until idle;
 *                                                  with PAUSE_AT, prints "paused" after that part
 *                                                  and waits for a line on stdin ("stop": shut the
 *                                                  store down there, as a node stopping does)
 *   snapstore_tool resume                          snapstore_resume_pending, then waits until idle
 *   snapstore_tool fetch SNAP TENANT               snapstore_fetch
 *   snapstore_tool delete SNAP TENANT              snapstore_delete
 *   snapstore_tool manifest DIR                    snapshot_manifest_write over the driver's fields
 *                                                  the test wrote (as write_manifest_public does)
 *   snapstore_tool verify DIR                      snapshot_verify
 *
 * Settings from the environment: KILN_DATABASE_URL, KILN_MASTER_KEY (hex), NODE_ID, SNAP_ROOT,
 * BASE_IMAGE, S3_PART_SIZE, UPLOAD_TRIES, RETRY_DELAY_MS; for set-storage S3_ENDPOINT, S3_BUCKET,
 * S3_REGION, S3_PREFIX, S3_ACCESS_KEY_ID, S3_SECRET_ACCESS_KEY. Prints one JSON line:
 * {"rc": "<kiln_err name>", "message": "...", "queued": N, "parts": [[part, nparts, sent], ...]}.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth/storage.h"
#include "common/log.h"
#include "node/storage_sync.h"
#include "vmm/snapshot.h"

static unsigned pause_at;
static json_t *parts;
static pthread_mutex_t parts_lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int stop_requested;

static void on_part(void *arg, const char *snap_id, unsigned part, unsigned nparts, bool sent)
{
	(void)arg;
	(void)snap_id;
	pthread_mutex_lock(&parts_lock);
	json_array_append_new(parts, json_pack("[i, i, b]", (int)part, (int)nparts, sent));
	pthread_mutex_unlock(&parts_lock);
	if (pause_at && part == pause_at) {
		char line[64] = "";

		printf("paused\n");
		fflush(stdout);
		if (!fgets(line, sizeof(line), stdin) || strncmp(line, "stop", 4) == 0)
			stop_requested = 1;
	}
}

static const char *env(const char *name, const char *def)
{
	const char *v = getenv(name);

	return v && v[0] ? v : def;
}

static void print(enum kiln_err rc, const struct kiln_error *err, int queued)
{
	json_t *out = json_pack("{s:s, s:s, s:i, s:O}", "rc", kiln_err_name(rc), "message",
				rc ? err->msg : "", "queued", queued, "parts", parts);
	char *text = json_dumps(out, JSON_COMPACT);

	printf("%s\n", text);
	free(text);
	json_decref(out);
}

int main(int argc, char **argv)
{
	struct auth_master_key mk;
	struct kiln_error err = { 0 };
	struct snapstore_config cfg = { 0 };
	struct s3_opts o = { 0 };
	struct netaddr_allow *allow = NULL;
	struct snapstore *s = NULL;
	struct pg *pool;
	const char *mkt = getenv("KILN_MASTER_KEY");
	enum kiln_err rc;
	int queued = 0;

	if (argc < 2 || !mkt) {
		fprintf(stderr, "usage: snapstore_tool set-storage|upload|resume|fetch ...\n");
		return 2;
	}
	log_init("snapstore_tool", KLOG_DEBUG, false);
	curl_global_init(CURL_GLOBAL_DEFAULT);
	parts = json_array();
	rc = auth_master_key_load(&mk, mkt, strlen(mkt), &err);
	pool = pg_new(env("KILN_DATABASE_URL", ""), 4);
	if (rc == KILN_OK && strcmp(argv[1], "set-storage") == 0 && argc == 3) {
		struct s3_target t = { 0 };
		struct pg_conn *c;

		snprintf(t.endpoint, sizeof(t.endpoint), "%s", env("S3_ENDPOINT", ""));
		snprintf(t.bucket, sizeof(t.bucket), "%s", env("S3_BUCKET", ""));
		snprintf(t.region, sizeof(t.region), "%s", env("S3_REGION", ""));
		snprintf(t.prefix, sizeof(t.prefix), "%s", getenv("S3_PREFIX") ? getenv("S3_PREFIX") : "");
		snprintf(t.access_key_id, sizeof(t.access_key_id), "%s", env("S3_ACCESS_KEY_ID", ""));
		snprintf(t.secret_access_key, sizeof(t.secret_access_key), "%s",
			 env("S3_SECRET_ACCESS_KEY", ""));
		rc = s3_target_check(&t, &err);
		if (rc == KILN_OK && (rc = pg_acquire(pool, &c, &err)) == KILN_OK) {
			rc = storage_save(c, &mk, argv[2], &t, &err);
			pg_release(pool, c);
		}
		s3_target_wipe(&t);
		goto done;
	}
	if (rc == KILN_OK && strcmp(argv[1], "manifest") == 0 && argc == 3) {
		struct snapshot_meta m = { 0 };

		snprintf(m.hypervisor, sizeof(m.hypervisor), "qemu");
		snprintf(m.machine, sizeof(m.machine), "microvm");
		snprintf(m.accel, sizeof(m.accel), "tcg");
		snprintf(m.image_hash, sizeof(m.image_hash), "sha256:snapstore-test");
		m.vcpu_milli = 1000;
		m.mem_mib = 64;
		m.disk_gib = 1;
		m.agent_protocol = 1;
		rc = snapshot_manifest_write(argv[2], &m, &err);
		goto done;
	}
	if (rc == KILN_OK && strcmp(argv[1], "verify") == 0 && argc == 3) {
		rc = snapshot_verify(argv[2], NULL, NULL, &err);
		goto done;
	}
	o.part_size = strtoull(env("S3_PART_SIZE", "0"), NULL, 10);
	o.retries = 0;
	o.retry_delay_ms = 50;
	o.connect_timeout_ms = 2000;
	if (rc == KILN_OK)	/* as kiln-node's storage_allow */
		rc = netaddr_allow_parse(getenv("KILN_STORAGE_ALLOW"), &allow, &err);
	o.allow = allow;
	cfg.pg = pool;
	cfg.mk = &mk;
	cfg.node_id = env("NODE_ID", "");
	cfg.snap_root = env("SNAP_ROOT", "");
	cfg.base_image = env("BASE_IMAGE", "");
	cfg.upload_tries = (unsigned)atoi(env("UPLOAD_TRIES", "3"));
	cfg.retry_delay_ms = (unsigned)atoi(env("RETRY_DELAY_MS", "100"));
	cfg.s3 = &o;
	cfg.on_part = on_part;
	if (rc == KILN_OK && !(s = snapstore_open(&cfg, &err)))
		rc = err.code;
	if (rc != KILN_OK)
		goto done;
	if (strcmp(argv[1], "upload") == 0 && argc >= 4) {
		pause_at = argc > 4 ? (unsigned)atoi(argv[4]) : 0;
		rc = snapstore_upload_start(s, argv[2], argv[3], &err);
		/* stopped at PAUSE_AT: shut down there, as a node does, with the upload mid-way */
		while (rc == KILN_OK && !snapstore_wait_idle(s, 50) && !stop_requested)
			;
	} else if (strcmp(argv[1], "resume") == 0) {
		queued = (int)snapstore_resume_pending(s);
		snapstore_wait_idle(s, 0);
	} else if (strcmp(argv[1], "fetch") == 0 && argc == 4) {
		rc = snapstore_fetch(s, argv[2], argv[3], &err);
	} else if (strcmp(argv[1], "delete") == 0 && argc == 4) {
		rc = snapstore_delete(s, argv[2], argv[3], &err);
	} else {
		rc = kiln_error_set(&err, KILN_E_BAD_REQUEST, "bad arguments");
	}
done:
	snapstore_shutdown(s);
	netaddr_allow_free(allow);
	print(rc, &err, queued);
	pg_free(pool);
	auth_master_key_wipe(&mk);
	json_decref(parts);
	curl_global_cleanup();
	return rc == KILN_OK ? 0 : 1;
}
