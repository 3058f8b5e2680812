/*
 * Unit tests of common/clock.h: clock_mono_ms() is CLOCK_MONOTONIC in milliseconds, and the
 * gateway's sources (argv[1], api/) keep no millisecond helper of their own beside it (they had
 * several copies of one).
 */
#include <dirent.h>
#include <stdlib.h>
#include <time.h>

#include "common/clock.h"
#include "test.h"

static const char *api_dir;

static long long mono_ref_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void test_mono_ms_is_monotonic_clock_in_ms(void)
{
	long long before = mono_ref_ms(), got = clock_mono_ms(), after = mono_ref_ms();

	CHECK(before <= got && got <= after);
	nanosleep(&(struct timespec){ 0, 30 * 1000000L }, NULL);
	CHECK(clock_mono_ms() - got >= 30);
	CHECK(clock_mono_ms() - got < 30000);
}

static void test_ms_of_realtime_is_the_epoch_in_ms(void)
{
	long long ms = clock_ms_of(CLOCK_REALTIME);
	time_t now = time(NULL);

	CHECK(ms / 1000 >= (long long)now - 1 && ms / 1000 <= (long long)now + 1);
}

/*
 * No file of api/ converts a clock to milliseconds itself: a clock_gettime() followed within four
 * lines by "/ 1000000" is a copy of clock_mono_ms() or clock_ms_of().
 */
static void test_api_has_no_private_copy(void)
{
	DIR *d = opendir(api_dir);
	struct dirent *de;
	int files = 0;

	CHECK(d != NULL);
	while (d && (de = readdir(d))) {
		char path[4096], line[1024];
		size_t n = strlen(de->d_name);
		int since = -1, lineno = 0;
		FILE *f;

		if (n < 3 || strcmp(de->d_name + n - 2, ".c") != 0)
			continue;
		snprintf(path, sizeof(path), "%s/%s", api_dir, de->d_name);
		f = fopen(path, "r");
		CHECK(f != NULL);
		if (!f)
			continue;
		files++;
		while (fgets(line, sizeof(line), f)) {
			lineno++;
			if (strstr(line, "clock_gettime("))
				since = 0;
			else if (since >= 0 && ++since > 4)
				since = -1;
			if (since >= 0 && strstr(line, "/ 1000000")) {
				fprintf(stderr, "%s:%d: milliseconds of a clock computed here; use "
					"clock_mono_ms() or clock_ms_of() (common/clock.h)\n", path, lineno);
				test_case_failed = 1;
				since = -1;
			}
		}
		fclose(f);
	}
	if (d)
		closedir(d);
	CHECK(files > 10);
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: test_clock API_SOURCE_DIR\n");
		return 2;
	}
	api_dir = argv[1];
	TEST(test_mono_ms_is_monotonic_clock_in_ms);
	TEST(test_ms_of_realtime_is_the_epoch_in_ms);
	TEST(test_api_has_no_private_copy);
	return test_summary();
}
