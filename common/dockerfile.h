/*
 * dockerfile.h - the Dockerfile and .dockerignore parsers of template builds (docs/templates.md).
 *
 * Pure functions over text: no I/O, no process, so that kiln-node's builder, the CLI (which tars a
 * build context honouring .dockerignore) and the fuzz target tests/fuzz/dockerfile_fuzz.c run the
 * same code. A Dockerfile is parsed into the steps a builder runs, in order; what Kiln does not
 * build is refused with KILN_E_INVALID (422) and a message naming the line, never skipped.
 *
 * Supported: one FROM (a template name: `base`, `python` or one of the tenant's; ARGs may come
 * before it), RUN, COPY and ADD from the build context (no URL, no --from, no path leaving the
 * context), ENV, ARG, WORKDIR, USER, CMD and ENTRYPOINT (exec and shell forms), which make the
 * start command. Line continuations (a trailing backslash), comments, blank lines, quoting in
 * ENV/ARG values and $VAR, ${VAR}, ${VAR:-word}, ${VAR:+word} substitution of ENV and ARG values
 * in FROM, COPY, ADD, ENV, ARG, WORKDIR and USER follow Docker's rules. RUN is passed unchanged:
 * its shell expands variables from the environment the builder gives it (ENV and ARG values).
 */
#ifndef KILN_DOCKERFILE_H
#define KILN_DOCKERFILE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/err.h"

#define DOCKERFILE_MAX_BYTES (1u << 20)	/* bytes of a Dockerfile (413 past it) */
#define DOCKERFILE_MAX_STEPS 1000	/* instructions of a Dockerfile (422 past it) */
#define DOCKERFILE_MAX_LINE 65536	/* bytes of one instruction, continuations joined */
#define DOCKERIGNORE_MAX_RULES 10000	/* patterns of a .dockerignore (422 past it) */

enum df_kind { DF_RUN, DF_COPY, DF_ADD, DF_ENV, DF_ARG, DF_WORKDIR, DF_USER };

/*
 * One step a builder runs. RUN: argv (exec form) or argv[0] the shell command line (`shell`, run
 * with `/bin/sh -c`). COPY/ADD: argv the sources (relative to the context's root, normalised,
 * wildcards kept) then the destination (absolute, resolved against WORKDIR; a trailing '/' kept),
 * `chown` when given. ENV: argv key, value pairs (argc even). ARG: argv name, value pairs, the value
 * NULL for an ARG without a default that no earlier ARG set. WORKDIR: argv[0] the absolute path.
 * USER: argv[0] the user, [":" group].
 */
struct df_step {
	enum df_kind kind;
	unsigned line;		/* 1-based line where the instruction starts */
	char **argv;
	size_t argc;
	bool shell;
	char *chown;		/* COPY/ADD --chown, or NULL */
};

struct dockerfile {
	char *from;		/* the template built upon */
	struct df_step *steps;
	size_t nsteps;
	char **start_argv;	/* the start command (ENTRYPOINT + CMD), NULL-terminated; NULL: none */
	size_t start_argc;
	char *workdir;		/* the final WORKDIR ("/" when none) */
	char *user;		/* the final USER, NULL when none (root) */
};

/*
 * Parses `len` bytes of `text`. On success fills *out (release with dockerfile_free()). On failure
 * returns KILN_E_INVALID with `err` naming the line ("Dockerfile line 7: EXPOSE is not
 * supported"), KILN_E_TOO_LARGE past DOCKERFILE_MAX_BYTES, or KILN_E_NOMEM; *out is then empty
 * and needs no free (dockerfile_free() is harmless on it).
 */
enum kiln_err dockerfile_parse(const char *text, size_t len, struct dockerfile *out,
			       struct kiln_error *err);
void dockerfile_free(struct dockerfile *df);

/* The name of a step's kind as written in a Dockerfile ("RUN", "COPY", ...). */
const char *dockerfile_kind_name(enum df_kind kind);

struct dockerignore_rule {
	char *pattern;		/* cleaned: no leading '/', no "./", no trailing '/' */
	bool negate;		/* a "!" rule: matching paths are kept */
};

struct dockerignore {
	struct dockerignore_rule *rules;
	size_t n;
};

/*
 * Parses a .dockerignore: one pattern a line, `#` comments, blank lines ignored, surrounding
 * whitespace trimmed, `!` negating, patterns cleaned as paths. KILN_E_INVALID naming the line past
 * DOCKERIGNORE_MAX_RULES or for a pattern that leaves the context; release with
 * dockerignore_free().
 */
enum kiln_err dockerignore_parse(const char *text, size_t len, struct dockerignore *out,
				 struct kiln_error *err);
void dockerignore_free(struct dockerignore *di);

/*
 * Whether the context path `path` (relative to the context's root, '/'-separated) is excluded:
 * the last rule matching it or one of its parent directories decides. Patterns use `*` and `?`
 * (not matching '/'), `[...]` classes (`[^...]` negated), `\` escapes and `**` (any number of
 * directories).
 */
bool dockerignore_excluded(const struct dockerignore *di, const char *path);

/*
 * Matches `name` against the glob `pattern` with dockerignore's rules (above); exposed for tests.
 */
bool dockerignore_glob(const char *pattern, const char *name);

#endif
