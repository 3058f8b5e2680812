/* Unit tests of bounded buffers: growth, the hard cap, formatting, detaching. */
#include <errno.h>
#include <stdlib.h>

#include "common/buf.h"
#include "test.h"

static void test_append_grows_and_terminates(void)
{
	struct buf b;

	buf_init(&b, 1 << 20);
	for (int i = 0; i < 1000; i++)
		CHECK_INT(buf_append(&b, "abc", 3), 0);
	CHECK_INT(b.len, 3000);
	CHECK_INT(b.data[b.len], '\0');
	CHECK(memcmp(b.data + 2997, "abc", 3) == 0);
	buf_release(&b);
	CHECK(b.data == NULL);
}

static void test_cap_refuses_without_appending(void)
{
	struct buf b;

	buf_init(&b, 10);
	CHECK_INT(buf_append(&b, "0123456789", 10), 0);
	CHECK_INT(buf_append(&b, "x", 1), -E2BIG);
	CHECK_INT(b.len, 10);
	CHECK_STR(b.data, "0123456789");
	CHECK_INT(buf_appendf(&b, "%d", 5), -E2BIG);
	buf_reset(&b);
	CHECK_INT(b.len, 0);
	CHECK_INT(buf_append(&b, "0123456789A", 11), -E2BIG);
	buf_release(&b);
}

static void test_appendf_and_detach(void)
{
	struct buf b;
	size_t len;
	char *s;

	buf_init(&b, 100);
	CHECK_INT(buf_appendf(&b, "%s=%d", "n", 42), 0);
	CHECK_INT(buf_appends(&b, ";"), 0);
	s = buf_detach(&b, &len);
	CHECK_STR(s, "n=42;");
	CHECK_INT(len, 5);
	CHECK(b.data == NULL && b.len == 0);
	free(s);
	s = buf_detach(&b, &len);	/* empty: an allocated empty string */
	CHECK(s && s[0] == '\0' && len == 0);
	free(s);
	buf_release(NULL);
}

int main(void)
{
	TEST(test_append_grows_and_terminates);
	TEST(test_cap_refuses_without_appending);
	TEST(test_appendf_and_detach);
	return test_summary();
}
