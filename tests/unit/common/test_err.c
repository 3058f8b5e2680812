/* Unit tests of the error codes: every code has a name and text; the first error wins. */
#include "common/err.h"
#include "test.h"

static void test_every_code_has_a_distinct_name(void)
{
	for (int i = 0; i < KILN_E__COUNT; i++) {
		CHECK(kiln_err_name(i) && kiln_err_name(i)[0]);
		CHECK(kiln_strerror(i) && kiln_strerror(i)[0]);
		for (int j = 0; j < i; j++)
			CHECK(strcmp(kiln_err_name(i), kiln_err_name(j)) != 0);
	}
	CHECK_STR(kiln_err_name(KILN_E_NOT_FOUND), "not_found");
	CHECK_STR(kiln_err_name(KILN_E_CREDITS), "insufficient_credits");
	CHECK_STR(kiln_err_name(KILN_E_QUOTA), "quota_exceeded");
	CHECK_STR(kiln_strerror(KILN_E__COUNT + 5), "unknown error");
}

static void test_first_error_wins(void)
{
	struct kiln_error e = { 0 };

	CHECK_INT(kiln_error_set(&e, KILN_E_INVALID, "vcpus %d out of range", 9), KILN_E_INVALID);
	CHECK_INT(kiln_error_set(&e, KILN_E_INTERNAL, "later"), KILN_E_INTERNAL);
	CHECK_INT(e.code, KILN_E_INVALID);
	CHECK_STR(e.msg, "vcpus 9 out of range");
	kiln_error_clear(&e);
	CHECK_INT(e.code, KILN_OK);
	CHECK_INT(kiln_error_set(NULL, KILN_E_IO, "x"), KILN_E_IO);
}

static void test_long_messages_are_truncated(void)
{
	struct kiln_error e = { 0 };
	char big[1000];

	memset(big, 'a', sizeof(big) - 1);
	big[sizeof(big) - 1] = '\0';
	kiln_error_set(&e, KILN_E_INVALID, "%s", big);
	CHECK_INT(strlen(e.msg), KILN_ERRMSG_MAX - 1);
}

int main(void)
{
	TEST(test_every_code_has_a_distinct_name);
	TEST(test_first_error_wins);
	TEST(test_long_messages_are_truncated);
	return test_summary();
}
