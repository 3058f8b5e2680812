/*
 * bench_jwt_verify.c - the CPU time of auth_jwt_verify for tokens already in the keyring's cache,
 * as the gateway sees a client's token on every request after its first. Signs TOKENS user
 * tokens like the gateway's (15 minutes, every tenant scope), verifies each once, then verifies
 * them in turn ROUNDS times and prints the microseconds per verification, best of 5 passes.
 * Run by hand (docs/benchmarks.md): bench_jwt_verify [TOKENS] [ROUNDS]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth/jwt.h"
#include "auth/keyring.h"
#include "auth/scopes.h"

#define NOW 1700000000LL

static double seconds(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 1000, rounds = argc > 2 ? atoi(argv[2]) : 200;
	struct auth_verify_opts o = {
		.aud = AUTH_AUD_API, .iss = "https://kiln.example", .now = NOW, .leeway_s = 30,
		.max_ttl_s = 900,
	};
	struct auth_jwt_keypair kp = { 0 };
	struct auth_keyring *kr = auth_keyring_new();
	struct auth_claims c;
	char **t = calloc((size_t)(n > 0 ? n : 1), sizeof(*t));
	double best = 1e9;
	size_t len = 0;

	if (n < 1 || rounds < 1 || !kr || !t || auth_jwt_keygen(&kp, NULL) != KILN_OK ||
	    auth_keyring_add_private_pem(kr, kp.private_pem, strlen(kp.private_pem), NULL, NULL) ||
	    auth_keyring_set_active(kr, kp.kid, NULL) != KILN_OK) {
		fprintf(stderr, "usage: bench_jwt_verify [TOKENS] [ROUNDS] (setup failed)\n");
		return 1;
	}
	for (int i = 0; i < n; i++) {
		char sub[32], tid[32];
		struct auth_token_params p = {
			.iss = o.iss, .aud = AUTH_AUD_API, .sub = sub, .tid = tid,
			.scopes = AUTH_SCOPES_TENANT, .now = NOW, .ttl_s = 900,
		};

		snprintf(sub, sizeof(sub), "key_%026d", i);
		snprintf(tid, sizeof(tid), "tn_%027d", i);
		if (auth_jwt_sign(kr, &p, &t[i], NULL, NULL) != KILN_OK ||
		    auth_jwt_verify(kr, t[i], strlen(t[i]), &o, &c, NULL, NULL) != KILN_OK) {
			fprintf(stderr, "token %d failed\n", i);
			return 1;
		}
		len += strlen(t[i]);
	}
	for (int pass = 0; pass < 5; pass++) {
		double start = seconds(), us;

		for (int r = 0; r < rounds; r++)
			for (int i = 0; i < n; i++)
				if (auth_jwt_verify(kr, t[i], strlen(t[i]), &o, &c, NULL, NULL) != KILN_OK)
					return 1;
		us = (seconds() - start) * 1e6 / ((double)rounds * n);
		if (us < best)
			best = us;
	}
	printf("%d tokens of %zu bytes on average, %d rounds: %.2f us per cached verification "
	       "(best of 5)\n", n, len / (size_t)n, rounds, best);
	for (int i = 0; i < n; i++)
		free(t[i]);
	free(t);
	auth_keyring_free(kr);
	auth_jwt_keypair_release(&kp);
	return 0;
}
