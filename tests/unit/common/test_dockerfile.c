/*
 * test_dockerfile.c - the Dockerfile and .dockerignore parsers (common/dockerfile.h): every
 * supported instruction and form, continuations, comments, quoting and substitution, the start
 * command from CMD and ENTRYPOINT, refusals naming the line, the limits, and Docker's
 * .dockerignore matching.
 */
#include <stdlib.h>
#include <string.h>

#include "common/dockerfile.h"
#include "tests/unit/test.h"

static struct dockerfile df;
static struct kiln_error err;

static enum kiln_err parse(const char *text)
{
	dockerfile_free(&df);
	memset(&err, 0, sizeof(err));
	return dockerfile_parse(text, strlen(text), &df, &err);
}

/* Parses `text`, which must fail with `code` and a message holding `want`. */
static void refused(const char *text, enum kiln_err code, const char *want)
{
	enum kiln_err rc = parse(text);

	CHECK_INT(rc, code);
	if (!strstr(err.msg, want)) {
		fprintf(stderr, "message \"%s\" lacks \"%s\" (for %s)\n", err.msg, want, text);
		test_case_failed = 1;
	}
	CHECK(df.nsteps == 0 && !df.from && !df.steps && !df.start_argv);
}

static void test_the_example_of_docs_templates(void)
{
	const char *text =
		"# syntax=docker/dockerfile:1\n"
		"FROM python\n"
		"ARG VERSION=1.2\n"
		"ENV APP_HOME=/srv/app \\\n"
		"    MODE=\"prod ready\"\n"
		"WORKDIR $APP_HOME\n"
		"COPY --chown=user:user pkg/ ./pkg/\n"
		"RUN curl -sf http://files.test/data.txt -o data.txt \\\n"
		"    # a comment inside a continuation vanishes\n"
		"    && pip install ./pkg\n"
		"USER user\n"
		"CMD [\"python3\", \"-m\", \"http.server\", \"8000\"]\n";

	CHECK_INT(parse(text), KILN_OK);
	CHECK_STR(df.from, "python");
	CHECK_INT(df.nsteps, 6);
	if (df.nsteps != 6)
		return;
	CHECK_INT(df.steps[0].kind, DF_ARG);
	CHECK_INT(df.steps[0].line, 3);
	CHECK_STR(df.steps[0].argv[0], "VERSION");
	CHECK_STR(df.steps[0].argv[1], "1.2");
	CHECK_INT(df.steps[1].kind, DF_ENV);
	CHECK_INT(df.steps[1].line, 4);
	CHECK_INT(df.steps[1].argc, 4);
	CHECK_STR(df.steps[1].argv[0], "APP_HOME");
	CHECK_STR(df.steps[1].argv[1], "/srv/app");
	CHECK_STR(df.steps[1].argv[2], "MODE");
	CHECK_STR(df.steps[1].argv[3], "prod ready");
	CHECK_INT(df.steps[2].kind, DF_WORKDIR);
	CHECK_STR(df.steps[2].argv[0], "/srv/app");
	CHECK_INT(df.steps[3].kind, DF_COPY);
	CHECK_INT(df.steps[3].line, 7);
	CHECK_STR(df.steps[3].chown, "user:user");
	CHECK_INT(df.steps[3].argc, 2);
	CHECK_STR(df.steps[3].argv[0], "pkg");
	CHECK_STR(df.steps[3].argv[1], "/srv/app/pkg/");
	CHECK_INT(df.steps[4].kind, DF_RUN);
	CHECK_INT(df.steps[4].line, 8);
	CHECK(df.steps[4].shell);
	CHECK_STR(df.steps[4].argv[0],
		  "curl -sf http://files.test/data.txt -o data.txt     && pip install ./pkg");
	CHECK_INT(df.steps[5].kind, DF_USER);
	CHECK_STR(df.steps[5].argv[0], "user");
	CHECK_STR(df.user, "user");
	CHECK_STR(df.workdir, "/srv/app");
	CHECK_INT(df.start_argc, 4);
	if (df.start_argc == 4) {
		CHECK_STR(df.start_argv[0], "python3");
		CHECK_STR(df.start_argv[3], "8000");
		CHECK(df.start_argv[4] == NULL);
	}
	CHECK_STR(dockerfile_kind_name(DF_COPY), "COPY");
}

static void test_run_exec_form_and_keywords_in_any_case(void)
{
	CHECK_INT(parse("from base\nrun [\"/bin/echo\", \"a b\", \"$HOME\"]\nRuN echo hi\n"), KILN_OK);
	CHECK_STR(df.from, "base");
	CHECK_INT(df.nsteps, 2);
	if (df.nsteps != 2)
		return;
	CHECK(!df.steps[0].shell);
	CHECK_INT(df.steps[0].argc, 3);
	CHECK_STR(df.steps[0].argv[1], "a b");
	CHECK_STR(df.steps[0].argv[2], "$HOME");	/* RUN is not expanded: its shell does it */
	CHECK(df.steps[1].shell);
	CHECK_STR(df.steps[1].argv[0], "echo hi");
	/* A [ that is not a JSON array of strings is the shell form. */
	CHECK_INT(parse("FROM base\nRUN [ -f /etc/passwd ] && echo yes\n"), KILN_OK);
	CHECK(df.nsteps == 1 && df.steps[0].shell);
	CHECK_INT(parse("FROM base\nRUN [\"a\", 1]\n"), KILN_OK);
	CHECK(df.nsteps == 1 && df.steps[0].shell);
	/* Indented instructions. */
	CHECK_INT(parse("  FROM base\n\tRUN true\n"), KILN_OK);
	CHECK(df.nsteps == 1 && df.steps[0].kind == DF_RUN);
	/* CRLF line ends and trailing blanks after a continuation. */
	CHECK_INT(parse("FROM base\r\nRUN echo a \\  \r\n\r\n  b\r\n"), KILN_OK);
	CHECK(df.nsteps == 1);
	if (df.nsteps == 1)
		CHECK_STR(df.steps[0].argv[0], "echo a   b");
}

static void test_start_command_from_cmd_and_entrypoint(void)
{
	CHECK_INT(parse("FROM base\nCMD python3 app.py --port 80\n"), KILN_OK);
	CHECK_INT(df.start_argc, 3);
	if (df.start_argc == 3) {
		CHECK_STR(df.start_argv[0], "/bin/sh");
		CHECK_STR(df.start_argv[1], "-c");
		CHECK_STR(df.start_argv[2], "python3 app.py --port 80");
	}
	CHECK_INT(parse("FROM base\nENTRYPOINT [\"/app\"]\nCMD [\"--port\", \"80\"]\n"), KILN_OK);
	CHECK_INT(df.start_argc, 3);
	if (df.start_argc == 3) {
		CHECK_STR(df.start_argv[0], "/app");
		CHECK_STR(df.start_argv[2], "80");
	}
	/* A shell-form ENTRYPOINT ignores CMD; the last CMD wins. */
	CHECK_INT(parse("FROM base\nCMD [\"x\"]\nENTRYPOINT exec /app\nCMD [\"y\"]\n"), KILN_OK);
	CHECK_INT(df.start_argc, 3);
	if (df.start_argc == 3)
		CHECK_STR(df.start_argv[2], "exec /app");
	CHECK_INT(parse("FROM base\nCMD [\"x\"]\nCMD [\"y\", \"z\"]\n"), KILN_OK);
	CHECK_INT(df.start_argc, 2);
	if (df.start_argc == 2)
		CHECK_STR(df.start_argv[0], "y");
	CHECK_INT(parse("FROM base\nRUN true\n"), KILN_OK);
	CHECK(df.start_argv == NULL && df.start_argc == 0);
}

static void test_quoting_and_substitution(void)
{
	const char *text =
		"ARG BASE=py\n"
		"FROM ${BASE}thon\n"
		"ARG BASE\n"
		"ARG NAME\n"
		"ENV A=1 B=\"two words\"\n"
		"ENV A=2 C='$A literal' D=\\$A E=${A}x F=${NOPE:-dflt} G=${A:+set} "
		"H=${NOPE:+x} I=\"$B!\" J=${NAME:-${A}${A}}\n"
		"ENV LEGACY the rest  of \"the  $A\" line\n"
		"WORKDIR /a/$B/../c\n"
		"COPY [\"$A.txt\", \"dir/\"]\n";

	CHECK_INT(parse(text), KILN_OK);
	CHECK_STR(df.from, "python");
	CHECK_INT(df.nsteps, 7);
	if (df.nsteps != 7)
		return;
	/* An ARG after FROM sees the value of the same ARG before it. */
	CHECK_STR(df.steps[0].argv[0], "BASE");
	CHECK_STR(df.steps[0].argv[1], "py");
	CHECK_STR(df.steps[1].argv[0], "NAME");
	CHECK(df.steps[1].argv[1] == NULL);
	CHECK_INT(df.steps[2].argc, 4);
	/* Within one ENV, substitution sees the values from before it (A is still 1). */
	CHECK_INT(df.steps[3].argc, 18);
	if (df.steps[3].argc == 18) {
		const char *want[] = { "2", "$A literal", "$A", "1x", "dflt", "set", "",
				       "two words!", "11" };

		for (int i = 0; i < 9; i++)
			CHECK_STR(df.steps[3].argv[2 * i + 1], want[i]);
	}
	CHECK_STR(df.steps[4].argv[0], "LEGACY");
	CHECK_STR(df.steps[4].argv[1], "the rest  of the  2 line");
	CHECK_STR(df.steps[5].argv[0], "/a/c");
	CHECK_STR(df.steps[6].argv[0], "2.txt");
	CHECK_STR(df.steps[6].argv[1], "/a/c/dir/");
}

static void test_paths_of_copy_and_workdir(void)
{
	CHECK_INT(parse("FROM base\nWORKDIR app\nWORKDIR ../../../x/./y/\nCOPY /a/../b/./c.txt .\n"
			"ADD src/*.py lib/ /opt/\nCOPY a b\n"),
		  KILN_OK);
	CHECK_INT(df.nsteps, 5);
	if (df.nsteps != 5)
		return;
	CHECK_STR(df.steps[0].argv[0], "/app");
	CHECK_STR(df.steps[1].argv[0], "/x/y");
	CHECK_STR(df.steps[2].argv[0], "b/c.txt");
	CHECK_STR(df.steps[2].argv[1], "/x/y/");
	CHECK_INT(df.steps[3].kind, DF_ADD);
	CHECK_INT(df.steps[3].argc, 3);
	CHECK_STR(df.steps[3].argv[0], "src/*.py");
	CHECK_STR(df.steps[3].argv[1], "lib");
	CHECK_STR(df.steps[3].argv[2], "/opt/");
	CHECK_STR(df.steps[4].argv[1], "/x/y/b");
	CHECK(df.steps[4].chown == NULL);
}

static void test_refusals_name_the_line(void)
{
	refused("FROM base\n\n# c\nEXPOSE 80\n", KILN_E_INVALID, "line 4: EXPOSE is not supported");
	refused("FROM base\nLABEL a=b\n", KILN_E_INVALID, "line 2: LABEL is not supported");
	refused("FROM base\nHEALTHCHECK CMD true\n", KILN_E_INVALID, "line 2: HEALTHCHECK");
	refused("FROM base\nFOO bar\n", KILN_E_INVALID, "line 2: unknown instruction FOO");
	refused("FROM base\nAVERYLONGKEYWORDINDEED x\n", KILN_E_INVALID, "line 2: unknown instruction");
	refused("RUN true\nFROM base\n", KILN_E_INVALID, "line 1: RUN before FROM");
	refused("# only a comment\n", KILN_E_INVALID, "no FROM");
	refused("", KILN_E_INVALID, "no FROM");
	refused("FROM base\nFROM python\n", KILN_E_INVALID, "line 2: a second FROM");
	refused("FROM base AS build\n", KILN_E_INVALID, "multi-stage");
	refused("FROM --platform=linux/amd64 base\n", KILN_E_INVALID, "--platform");
	refused("FROM debian:12\n", KILN_E_INVALID, "only `base`, `python`");
	refused("FROM docker.io/library/alpine\n", KILN_E_INVALID, "only `base`");
	refused("FROM base\nADD https://example.com/x.tgz /x\n", KILN_E_INVALID,
		"line 2: ADD from a URL");
	refused("FROM base\nCOPY --from=build /a /b\n", KILN_E_INVALID, "multi-stage");
	refused("FROM base\nCOPY --chmod=755 a /b\n", KILN_E_INVALID, "option --chmod=755");
	refused("FROM base\nCOPY --chown=a;b a /b\n", KILN_E_INVALID, "--chown");
	refused("FROM base\nCOPY ../secret /x\n", KILN_E_INVALID, "leaves the build context");
	refused("FROM base\nCOPY a/../../b /x\n", KILN_E_INVALID, "leaves the build context");
	refused("FROM base\nCOPY a b /x\n", KILN_E_INVALID, "ending in /");
	refused("FROM base\nCOPY onlyone\n", KILN_E_INVALID, "a source and a destination");
	refused("FROM base\nRUN --mount=type=cache,target=/x true\n", KILN_E_INVALID,
		"RUN options");
	refused("FROM base\nRUN\n", KILN_E_INVALID, "line 2: RUN needs a command");
	refused("FROM base\nRUN <<EOF\necho hi\nEOF\n", KILN_E_INVALID, "line 2: RUN heredocs");
	refused("FROM base\nCOPY <<EOF /x\nhi\nEOF\n", KILN_E_INVALID, "line 2: COPY heredocs");
	refused("FROM base\nRUN []\n", KILN_E_INVALID, "RUN needs a command");
	refused("FROM base\nCMD\n", KILN_E_INVALID, "CMD needs a command");
	refused("FROM base\nENV\n", KILN_E_INVALID, "ENV needs a name");
	refused("FROM base\nENV 1A=b\n", KILN_E_INVALID, "not a variable name");
	refused("FROM base\nENV A\n", KILN_E_INVALID, "needs a value");
	refused("FROM base\nENV A=1 B\n", KILN_E_INVALID, "needs a value");
	refused("FROM base\nENV A=\"open\n", KILN_E_INVALID, "quote is not closed");
	refused("FROM base\nENV A='open\n", KILN_E_INVALID, "quote is not closed");
	refused("FROM base\nENV A=${B\n", KILN_E_INVALID, "bad substitution");
	refused("FROM base\nENV A=${B?x}\n", KILN_E_INVALID, "bad substitution");
	refused("FROM base\nENV A=${}\n", KILN_E_INVALID, "bad substitution");
	refused("FROM base\nUSER a b\n", KILN_E_INVALID, "USER takes one");
	refused("FROM base\nUSER a;rm\n", KILN_E_INVALID, "not a user");
	refused("FROM base\nUSER a:\n", KILN_E_INVALID, "not a user");
	refused("FROM base\nWORKDIR \"\"\n", KILN_E_INVALID, "WORKDIR needs a path");
	refused("# escape=`\nFROM base\n", KILN_E_INVALID, "line 1: the escape directive");
	/* An error in a continued instruction names the line it starts on. */
	refused("FROM base\nENV A=\\\n  \"x\n", KILN_E_INVALID, "line 2: a \" quote is not closed");
	/* A NUL byte anywhere. */
	{
		const char t[] = "FROM base\nRUN a\0b\n";

		dockerfile_free(&df);
		memset(&err, 0, sizeof(err));
		CHECK_INT(dockerfile_parse(t, sizeof(t) - 1, &df, &err), KILN_E_INVALID);
		CHECK(strstr(err.msg, "NUL") != NULL);
	}
}

static void test_limits(void)
{
	size_t n = DOCKERFILE_MAX_BYTES + 1, i;
	char *big = malloc(n + 1), *p;

	CHECK(big != NULL);
	if (!big)
		return;
	memset(big, '#', n);
	big[n] = '\0';
	refused(big, KILN_E_TOO_LARGE, "larger than");
	/* Too many instructions. */
	p = big;
	p += sprintf(p, "FROM base\n");
	for (i = 0; i < DOCKERFILE_MAX_STEPS + 1; i++)
		p += sprintf(p, "RUN true\n");
	refused(big, KILN_E_INVALID, "line 1002: more than 1000 instructions");
	/* An instruction longer than the line limit. */
	p = big;
	p += sprintf(p, "FROM base\nRUN ");
	memset(p, 'x', DOCKERFILE_MAX_LINE);
	p[DOCKERFILE_MAX_LINE] = '\0';
	refused(big, KILN_E_INVALID, "line 2: an argument is longer than");
	/* Doubling a variable runs into the expansion limits, never into memory. */
	p = big;
	p += sprintf(p, "FROM base\nENV A=0123456789abcdef\n");
	for (i = 0; i < 40; i++)
		p += sprintf(p, "ENV A=$A$A\n");
	refused(big, KILN_E_INVALID, "longer than");
	p = big;
	p += sprintf(p, "FROM base\nENV A=");
	for (i = 0; i < 40; i++)
		p += sprintf(p, "${A:-");
	for (i = 0; i < 40; i++)
		p += sprintf(p, "}");
	sprintf(p, "\n");
	refused(big, KILN_E_INVALID, "nested deeper");
	p = big;
	p += sprintf(p, "FROM base\nENV");
	for (i = 0; i < 1001; i++)
		p += sprintf(p, " V%zu=1", i);
	sprintf(p, "\n");
	refused(big, KILN_E_INVALID, "more than 1000 variables");
	free(big);
}

static struct dockerignore di;

static bool excluded(const char *ignore, const char *path)
{
	struct kiln_error e = { 0 };
	bool r;

	dockerignore_free(&di);
	if (dockerignore_parse(ignore, strlen(ignore), &di, &e) != KILN_OK) {
		fprintf(stderr, "dockerignore_parse: %s\n", e.msg);
		test_case_failed = 1;
		return false;
	}
	r = dockerignore_excluded(&di, path);
	return r;
}

static void test_dockerignore(void)
{
	const char *ig = "# comment\n"
			 "\n"
			 "  *.pyc  \n"
			 "/build\n"
			 "secrets/**\n"
			 "!secrets/public.txt\n"
			 "docs/*.md\n"
			 "**/node_modules\n"
			 "./tmp/\n"
			 "data?.csv\n"
			 "[ab]x\n"
			 "\\!lit\n";

	CHECK(excluded(ig, "x.pyc"));
	CHECK(!excluded(ig, "pkg/x.pyc"));	/* '*' does not cross '/' */
	CHECK(excluded(ig, "build"));
	CHECK(excluded(ig, "build/out/a.o"));	/* under an excluded directory */
	CHECK(!excluded(ig, "src/build"));
	CHECK(excluded(ig, "secrets/key.pem"));
	CHECK(excluded(ig, "secrets/deep/er/key.pem"));
	CHECK(!excluded(ig, "secrets/public.txt"));	/* the later ! wins */
	CHECK(excluded(ig, "docs/readme.md"));
	CHECK(!excluded(ig, "docs/sub/readme.md"));
	CHECK(excluded(ig, "node_modules/x"));
	CHECK(excluded(ig, "a/b/node_modules/c/d"));
	CHECK(excluded(ig, "tmp/x"));
	CHECK(excluded(ig, "./tmp"));
	CHECK(excluded(ig, "data1.csv"));
	CHECK(!excluded(ig, "data12.csv"));
	CHECK(excluded(ig, "ax"));
	CHECK(excluded(ig, "bx"));
	CHECK(!excluded(ig, "cx"));
	CHECK(excluded(ig, "!lit"));
	CHECK(!excluded(ig, "Dockerfile"));
	CHECK(!excluded(ig, "app.py"));
	/* Docker's ** forms: "**" at the end is everything, elsewhere (.*\/)?. */
	CHECK(dockerignore_glob("**", "a/b/c"));
	CHECK(dockerignore_glob("**/a*", "x/ay/az"));
	CHECK(dockerignore_glob("**/*.go", "a.go"));
	CHECK(dockerignore_glob("**/*.go", "x/y/a.go"));
	CHECK(!dockerignore_glob("**/a", "xa"));
	CHECK(dockerignore_glob("a/**/b", "a/b"));
	CHECK(dockerignore_glob("a/**/b", "a/x/y/b"));
	CHECK(!dockerignore_glob("a/**/b", "a/xb"));
	CHECK(dockerignore_glob("*", "abc"));
	CHECK(!dockerignore_glob("*", "a/b"));
	CHECK(dockerignore_glob("[^a]", "b"));
	CHECK(!dockerignore_glob("[^a]", "a"));
	CHECK(dockerignore_glob("[!a]", "!"));	/* Go's classes: '!' is a member, not a negation */
	CHECK(!dockerignore_glob("[!a]", "b"));
	CHECK(dockerignore_glob("***x", "a/bx"));	/* "**" then "*": (.*\/)?[^/]*x */
	CHECK(!dockerignore_glob("***x", "a/b/"));
	CHECK(dockerignore_glob("[a-c]z", "bz"));
	CHECK(dockerignore_glob("[", "["));	/* an unclosed class is literal */
	CHECK(!dockerignore_glob("?", "/"));
	/* Patterns above the context match nothing there; a very long one is refused. */
	CHECK(!excluded("../x\n", "x"));
	{
		struct kiln_error e = { 0 };
		char *longpat = malloc(5000);

		CHECK(longpat != NULL);
		if (longpat) {
			memset(longpat, 'a', 4999);
			longpat[4999] = '\0';
			dockerignore_free(&di);
			CHECK_INT(dockerignore_parse(longpat, 4999, &di, &e), KILN_E_INVALID);
			CHECK(strstr(e.msg, "line 1") != NULL);
			free(longpat);
		}
	}
	dockerignore_free(&di);
}

int main(void)
{
	TEST(test_the_example_of_docs_templates);
	TEST(test_run_exec_form_and_keywords_in_any_case);
	TEST(test_start_command_from_cmd_and_entrypoint);
	TEST(test_quoting_and_substitution);
	TEST(test_paths_of_copy_and_workdir);
	TEST(test_refusals_name_the_line);
	TEST(test_limits);
	TEST(test_dockerignore);
	dockerfile_free(&df);
	return test_summary();
}
