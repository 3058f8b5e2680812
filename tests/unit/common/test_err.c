/*
 * Unit tests of the error codes: every code has a name, text and status; values outside the enum
 * read as internal errors; the HTTP engine's statuses are the table's; the first error wins.
 */
#include "common/err.h"
#include "common/http.h"
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

static void test_statuses_and_visibility(void)
{
	for (int i = 0; i < KILN_E__COUNT; i++) {
		CHECK(kiln_err_status(i) >= 200 && kiln_err_status(i) <= 599);
		CHECK_INT(http_status_of(i), kiln_err_status(i));
		/* a reply shows a code's own name, or "internal" and nothing of the detail */
		CHECK_STR(kiln_err_api_code(i), kiln_err_shown(i) ? kiln_err_name(i) : "internal");
		/* 4xx detail is the client's; what stays in the log is a 500 */
		if (kiln_err_status(i) < 500)
			CHECK(kiln_err_shown(i));
		if (!kiln_err_shown(i))
			CHECK_INT(kiln_err_status(i), 500);
	}
	CHECK_INT(kiln_err_status(KILN_OK), 200);
	CHECK_INT(kiln_err_status(KILN_E_CREDITS), 402);
	CHECK_INT(kiln_err_status(KILN_E_QUOTA), 403);
	CHECK_INT(kiln_err_status(KILN_E_NO_CAPACITY), 503);
	CHECK_STR(kiln_err_api_code(KILN_E_IO), "internal");
	CHECK_STR(kiln_err_name(KILN_E_IO), "io_error");
	CHECK_STR(kiln_err_api_code(KILN_E_SANDBOX_FAILED), "sandbox_failed");
	CHECK(!kiln_err_shown(KILN_E_INTERNAL));
	/* a value outside the enum is an internal error */
	CHECK_INT(kiln_err_status((enum kiln_err)(KILN_E__COUNT + 5)), 500);
	CHECK_INT(kiln_err_status((enum kiln_err)-1), 500);
	CHECK(!kiln_err_shown((enum kiln_err)(KILN_E__COUNT + 5)));
	CHECK_STR(kiln_err_name((enum kiln_err)-1), "internal");
	CHECK_STR(kiln_err_api_code((enum kiln_err)(KILN_E__COUNT)), "internal");
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
	TEST(test_statuses_and_visibility);
	TEST(test_first_error_wins);
	TEST(test_long_messages_are_truncated);
	return test_summary();
}
