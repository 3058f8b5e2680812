/*
 * testredis.h - the services fixture's Redis URL (KILN_SERVICES_ENV) for a unit test that needs
 * Redis. Include it after test.h.
 */
#ifndef KILN_TESTREDIS_H
#define KILN_TESTREDIS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Writes the fixture's KILN_REDIS_URL to `url`: 0, or -1 after printing why. */
static int testredis_url(char *url, size_t n)
{
	const char *envf = getenv("KILN_SERVICES_ENV");
	char line[512];
	FILE *f;

	url[0] = '\0';
	if (!envf || !(f = fopen(envf, "r"))) {
		fprintf(stderr, "KILN_SERVICES_ENV is not set: this test needs the services fixture\n");
		return -1;
	}
	while (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = '\0';
		if (!strncmp(line, "KILN_REDIS_URL=", 15))
			snprintf(url, n, "%s", line + 15);
	}
	fclose(f);
	return url[0] ? 0 : -1;
}

#endif
