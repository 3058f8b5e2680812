/* Unit tests of proc_run: which streams are captured, the bound, exit statuses, spawn errors. */
#include <errno.h>
#include <string.h>

#include "common/proc.h"
#include "test.h"

static const char *const both[] = { "sh", "-c", "echo out; echo err >&2", NULL };

static void test_captures_only_the_streams_asked(void)
{
	char out[64];
	int st = -2;

	CHECK_INT(proc_run(both, PROC_STDOUT, out, sizeof(out), &st), 0);
	CHECK_INT(st, 0);
	CHECK_STR(out, "out\n");
	CHECK_INT(proc_run(both, PROC_STDERR, out, sizeof(out), &st), 0);
	CHECK_STR(out, "err\n");
	CHECK_INT(proc_run(both, PROC_STDOUT | PROC_STDERR, out, sizeof(out), &st), 0);
	CHECK_STR(out, "out\nerr\n");
	CHECK_INT(proc_run(both, 0, out, sizeof(out), &st), 0);
	CHECK_STR(out, "");
}

static void test_capture_is_bounded_and_drained(void)
{
	/* far more than a pipe holds: the child must still run to its end */
	const char *const argv[] = { "sh", "-c", "head -c 1000000 /dev/zero | tr '\\000' a; echo end >&2",
				     NULL };
	char out[16];
	int st = -2;

	CHECK_INT(proc_run(argv, PROC_STDOUT | PROC_STDERR, out, sizeof(out), &st), 0);
	CHECK_INT(st, 0);
	CHECK_INT(strlen(out), sizeof(out) - 1);
	CHECK_STR(out, "aaaaaaaaaaaaaaa");
	CHECK_INT(proc_run(argv, PROC_STDOUT, NULL, 0, &st), 0);
	CHECK_INT(st, 0);
}

static void test_stdin_is_empty(void)
{
	const char *const argv[] = { "sh", "-c", "wc -c", NULL };
	char out[32];
	int st = -2;

	CHECK_INT(proc_run(argv, PROC_STDOUT, out, sizeof(out), &st), 0);
	CHECK_STR(out, "0\n");
}

static void test_exit_statuses(void)
{
	const char *const fails[] = { "sh", "-c", "echo no >&2; exit 3", NULL };
	const char *const killed[] = { "sh", "-c", "kill -KILL $$", NULL };
	char out[32];
	int st = -2;

	CHECK_INT(proc_run(fails, PROC_STDERR, out, sizeof(out), &st), 0);
	CHECK_INT(st, 3);
	CHECK_STR(out, "no\n");
	CHECK_INT(proc_run(killed, PROC_STDERR, out, sizeof(out), &st), 0);
	CHECK_INT(st, 128 + 9);
}

static void test_spawn_errors(void)
{
	const char *const missing[] = { "kiln-no-such-program", NULL };
	const char *const empty[] = { NULL };
	char out[8] = "x";
	int st = -2;

	CHECK_INT(proc_run(missing, PROC_STDERR, out, sizeof(out), &st), -ENOENT);
	CHECK_STR(out, "");
	CHECK_INT(st, -1);
	CHECK_INT(proc_run(empty, PROC_STDERR, out, sizeof(out), &st), -EINVAL);
}

int main(void)
{
	TEST(test_captures_only_the_streams_asked);
	TEST(test_capture_is_bounded_and_drained);
	TEST(test_stdin_is_empty);
	TEST(test_exit_statuses);
	TEST(test_spawn_errors);
	return test_summary();
}
