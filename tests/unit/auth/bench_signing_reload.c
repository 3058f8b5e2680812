/*
 * bench_signing_reload.c - what a reload of the gateway's signing keys costs when the stored keys
 * have not changed (every periodic reload but the few after a rotation): makes KEYS keys in a
 * scratch database of the services fixture (KEYS - 1 rotations: one signer, the others retired),
 * then times RELOADS calls of signing_reload() and prints the CPU time (this process: the query's
 * client side, the hash, any key opened and parsed) and the wall time per reload, three passes.
 * Run by hand (docs/benchmarks.md): KILN_SERVICES_ENV=... bench_signing_reload [RELOADS] [KEYS]
 */
#include "test.h"
#include "testdb.h"

#include <time.h>

#include "auth/signing.h"
#include "common/log.h"

static double seconds(clockid_t clock)
{
	struct timespec ts;

	clock_gettime(clock, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 200, keys = argc > 2 ? atoi(argv[2]) : 1;
	struct kiln_error err = { 0 };
	struct auth_master_key mk;
	struct signing *s = NULL;
	struct testdb db;
	int rc = 1;

	log_init("bench_signing_reload", KLOG_ERROR, false);
	if (n < 1 || testdb_open(&db, "reloadbench") != 0)
		return 1;
	if (auth_master_key_generate(&mk, &err) != KILN_OK || !(s = signing_new(db.pg, &mk, &err)))
		goto out;
	for (int i = 1; i < keys; i++) {
		char kid[AUTH_KID_MAX];

		if (signing_rotate(db.pg, &mk, kid, &err) != KILN_OK)
			goto out;
	}
	if (signing_reload(s, false, &err) != KILN_OK)	/* the rotations' keys, built once */
		goto out;
	for (int pass = 0; pass < 3; pass++) {
		double cpu = seconds(CLOCK_PROCESS_CPUTIME_ID), wall = seconds(CLOCK_MONOTONIC);

		for (int i = 0; i < n; i++)
			if (signing_reload(s, false, &err) != KILN_OK)
				goto out;
		cpu = seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu;
		wall = seconds(CLOCK_MONOTONIC) - wall;
		printf("%d keys: %.1f us of CPU, %.1f us of wall time per reload (%d reloads)\n", keys,
		       cpu / n * 1e6, wall / n * 1e6, n);
	}
	rc = 0;
out:
	if (rc)
		fprintf(stderr, "bench_signing_reload: %s\n", err.msg);
	signing_free(s);
	auth_master_key_wipe(&mk);
	testdb_close(&db);
	return rc;
}
