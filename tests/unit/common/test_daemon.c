/*
 * Unit tests of the stage runner (common/daemon.h): start order, stop order, a failing stage,
 * and a main loop that ends on a real SIGTERM.
 */
#include <signal.h>
#include <string.h>

#include "common/daemon.h"
#include "test.h"

static char trail[128];	/* what ran, in order */
static int loops;

static void note(const char *s)
{
	strncat(trail, s, sizeof(trail) - strlen(trail) - 1);
}

static int a_init(struct kiln_error *err) { (void)err; note("+a"); return KILN_OK; }
static void a_exit(void) { note("-a"); }
static int b_init(struct kiln_error *err) { (void)err; note("+b"); return KILN_OK; }
static void b_exit(void) { note("-b"); }
static int bad_init(struct kiln_error *err)
{
	note("+bad");
	return kiln_error_set(err, KILN_E_UNAVAILABLE, "not today");
}
static void bad_exit(void) { note("-bad"); }

static void main_loop(void)
{
	note(" loop");
	raise(SIGTERM);
	while (!daemon_stopping())
		loops++;
	note(" ");
}

static void test_a_failing_stage_stops_the_started_ones(void)
{
	const struct daemon_stage stages[] = {
		{ "a", a_init, a_exit }, { "bad", bad_init, bad_exit }, { "b", b_init, b_exit },
	};

	trail[0] = '\0';
	CHECK_INT(daemon_run_loop(stages, 3, main_loop), 1);
	CHECK_STR(trail, "+a+bad-a");
	CHECK(!daemon_stopping());
}

static void test_the_main_loop_runs_until_sigterm(void)
{
	const struct daemon_stage stages[] = { { "a", a_init, a_exit }, { "b", b_init, b_exit } };

	trail[0] = '\0';
	CHECK_INT(daemon_run_loop(stages, 2, main_loop), 0);
	CHECK_STR(trail, "+a+b loop -b-a");
	CHECK(daemon_stopping());
}

int main(void)
{
	TEST(test_a_failing_stage_stops_the_started_ones);
	TEST(test_the_main_loop_runs_until_sigterm);
	return test_summary();
}
