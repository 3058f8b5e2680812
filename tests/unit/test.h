/*
 * test.h - the unit tests' few assertions. A test binary is a main() that calls TEST(fn) for each
 * case and returns test_summary(); each failing CHECK prints where and what, and the case goes on.
 */
#ifndef KILN_TEST_H
#define KILN_TEST_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

static int test_failures, test_cases, test_case_failed;

/*
 * Seeds rand() for the ids a test makes up (tenants, sandboxes, databases) from the kernel's
 * random source. Postgres and Redis are shared by every test of a run, and Redis keeps keys
 * across runs: a seed of time and pid repeats (two binaries, or two runs, whose time XOR pid
 * agree), and a tenant id met again found the balance its namesake left in Redis.
 */
static __attribute__((unused)) void test_seed(void)
{
	unsigned s;

	if (getrandom(&s, sizeof(s), 0) != (ssize_t)sizeof(s))
		s = (unsigned)time(NULL) ^ ((unsigned)getpid() << 16);
	srand(s);
}

#define CHECK(cond)                                                                  \
	do {                                                                         \
		if (!(cond)) {                                                       \
			fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
			test_case_failed = 1;                                        \
		}                                                                    \
	} while (0)

#define CHECK_STR(a, b)                                                              \
	do {                                                                         \
		const char *a_ = (a), *b_ = (b);                                     \
		if (!a_ || !b_ || strcmp(a_, b_) != 0) {                             \
			fprintf(stderr, "%s:%d: %s is \"%s\", expected \"%s\"\n", __FILE__, \
				__LINE__, #a, a_ ? a_ : "(null)", b_ ? b_ : "(null)");      \
			test_case_failed = 1;                                        \
		}                                                                    \
	} while (0)

#define CHECK_INT(a, b)                                                              \
	do {                                                                         \
		long long a_ = (long long)(a), b_ = (long long)(b);                  \
		if (a_ != b_) {                                                      \
			fprintf(stderr, "%s:%d: %s is %lld, expected %lld\n", __FILE__,      \
				__LINE__, #a, a_, b_);                               \
			test_case_failed = 1;                                        \
		}                                                                    \
	} while (0)

/* KILN_TEST_ONLY=<part of a name>: only the cases whose names hold it (a run by hand). */
#define TEST(fn)                                                                     \
	do {                                                                         \
		const char *only_ = getenv("KILN_TEST_ONLY");                        \
		if (only_ && *only_ && !strstr(#fn, only_))                          \
			break;                                                       \
		test_case_failed = 0;                                                \
		test_cases++;                                                        \
		fn();                                                                \
		if (test_case_failed) {                                              \
			test_failures++;                                             \
			fprintf(stderr, "FAIL %s\n", #fn);                           \
		} else {                                                             \
			fprintf(stderr, "ok   %s\n", #fn);                           \
		}                                                                    \
	} while (0)

static inline int test_summary(void)
{
	fprintf(stderr, "%d passed, %d failed\n", test_cases - test_failures, test_failures);
	return test_failures ? 1 : 0;
}

#endif
