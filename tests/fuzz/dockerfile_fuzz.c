/*
 * dockerfile_fuzz.c - libFuzzer target for the Dockerfile and .dockerignore parsers
 * (common/dockerfile.c), whose input is a tenant's build context.
 *
 * Input: a selector byte, then (selector % 3) 0: a Dockerfile; 1: a .dockerignore and a path
 * separated by the first NUL; 2: a glob pattern and a name separated by a NUL, whose match must
 * agree with a plain backtracking reference of Docker's rules. Oracle: no crash, leak or UB, linear-ish time (the
 * -timeout of the run); a refusal is 413, 422 or out of memory with a message; an accepted
 * Dockerfile has a FROM that is a template name, steps of known kinds with their documented
 * shapes (COPY/ADD sources inside the context, absolute destinations, ENV pairs), an absolute
 * WORKDIR and a NULL-terminated start command.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/dockerfile.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                                             \
	do {                                                                                    \
		if (!(cond)) {                                                                  \
			fprintf(stderr, "dockerfile_fuzz: %s:%d: %s\n", __FILE__, __LINE__, #cond); \
			abort();                                                                \
		}                                                                               \
	} while (0)

static void check_dockerfile(const struct dockerfile *df)
{
	size_t i, j;

	CHECK(df->from && df->from[0] && strlen(df->from) <= 63);
	CHECK(!strchr(df->from, '/') && !strchr(df->from, ':'));
	CHECK(df->workdir && df->workdir[0] == '/');
	CHECK(df->nsteps <= DOCKERFILE_MAX_STEPS);
	for (i = 0; i < df->nsteps; i++) {
		const struct df_step *s = &df->steps[i];

		CHECK(s->line >= 1);
		CHECK(s->argv && s->argv[s->argc] == NULL);
		switch (s->kind) {
		case DF_RUN:
			CHECK(s->argc >= 1);
			CHECK(!s->shell || s->argc == 1);
			break;
		case DF_COPY:
		case DF_ADD:
			CHECK(s->argc >= 2);
			for (j = 0; j + 1 < s->argc; j++) {
				const char *p = s->argv[j];

				CHECK(p[0] && p[0] != '/');
				CHECK(strcmp(p, "..") && strncmp(p, "../", 3) && !strstr(p, "/../"));
				CHECK(!strstr(p, "://"));
			}
			CHECK(s->argv[s->argc - 1][0] == '/');
			break;
		case DF_ENV:
		case DF_ARG:
			CHECK(s->argc >= 2 && s->argc % 2 == 0);
			for (j = 0; j < s->argc; j += 2)
				CHECK(s->argv[j] && s->argv[j][0]);
			if (s->kind == DF_ENV)
				for (j = 1; j < s->argc; j += 2)
					CHECK(s->argv[j] != NULL);
			break;
		case DF_WORKDIR:
			CHECK(s->argc == 1 && s->argv[0][0] == '/');
			break;
		case DF_USER:
			CHECK(s->argc == 1 && s->argv[0][0]);
			break;
		default:
			CHECK(!"a step of an unknown kind");
		}
	}
	CHECK((df->start_argv == NULL) == (df->start_argc == 0));
	if (df->start_argv)
		CHECK(df->start_argv[df->start_argc] == NULL);
}

/*
 * A reference for dockerignore_glob(): Docker's translation of a pattern into a regular expression
 * (`**` then an optional '/' is (.*\/)?, or .* at the end; `*` is [^/]*; `?` is [^/]; `\c` is c),
 * matched by plain backtracking. Exponential, so only run on short inputs; no classes.
 */
static bool ref_glob(const char *p, const char *n)
{
	if (*p == '\0')
		return *n == '\0';
	if (p[0] == '*' && p[1] == '*') {
		p += 2;
		if (*p == '/')
			p++;
		if (*p == '\0')
			return true;
		if (ref_glob(p, n))
			return true;
		for (const char *k = n; *k; k++)
			if (*k == '/' && ref_glob(p, k + 1))
				return true;
		return false;
	}
	if (*p == '*') {
		for (const char *k = n;; k++) {
			if (ref_glob(p + 1, k))
				return true;
			if (*k == '\0' || *k == '/')
				return false;
		}
	}
	if (*p == '?')
		return *n && *n != '/' && ref_glob(p + 1, n + 1);
	if (*p == '\\' && p[1])
		p++;
	return *n == *p && ref_glob(p + 1, n + 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kiln_error err = { 0 };
	enum kiln_err rc;

	if (size < 1)
		return 0;
	if (data[0] % 3 == 2) {
		/* pattern NUL name, short and without classes: the same answer as the reference. */
		const char *text = (const char *)data + 1;
		const char *nul = memchr(text, '\0', size - 1);
		char pat[24], name[24];
		size_t pl, nl;

		if (!nul)
			return 0;
		pl = (size_t)(nul - text);
		nl = size - 1 - pl - 1;
		if (pl >= sizeof(pat) || nl >= sizeof(name) || memchr(text, '[', pl) ||
		    memchr(nul + 1, '\0', nl))
			return 0;
		memcpy(pat, text, pl);
		pat[pl] = '\0';
		memcpy(name, nul + 1, nl);
		name[nl] = '\0';
		if (pl > 0 && pat[pl - 1] == '\\')
			return 0;	/* a trailing lone backslash: Docker refuses the pattern */
		CHECK(dockerignore_glob(pat, name) == ref_glob(pat, name));
	} else if (data[0] % 3 == 0) {
		struct dockerfile df;

		rc = dockerfile_parse((const char *)data + 1, size - 1, &df, &err);
		if (rc == KILN_OK)
			check_dockerfile(&df);
		else
			CHECK((rc == KILN_E_INVALID || rc == KILN_E_TOO_LARGE || rc == KILN_E_NOMEM) &&
			      err.msg[0]);
		dockerfile_free(&df);
	} else {
		const char *text = (const char *)data + 1;
		const char *nul = memchr(text, '\0', size - 1);
		size_t tlen = nul ? (size_t)(nul - text) : size - 1;
		struct dockerignore di;
		char *path;

		rc = dockerignore_parse(text, tlen, &di, &err);
		if (rc != KILN_OK) {
			CHECK(err.msg[0]);
			return 0;
		}
		path = nul ? strndup(nul + 1, size - 1 - tlen - 1) : strdup("a/b");
		if (path) {
			bool ex = dockerignore_excluded(&di, path);

			/* A path is decided the same way twice, and nothing excludes with no rule. */
			CHECK(ex == dockerignore_excluded(&di, path));
			if (di.n == 0)
				CHECK(!ex);
			if (di.n > 0)
				(void)dockerignore_glob(di.rules[0].pattern, path);
		}
		free(path);
		dockerignore_free(&di);
	}
	return 0;
}
