/* Unit tests of strict body parsing: unknown fields, wrong types, required, caps, malformed. */
#include <stdlib.h>

#include "common/json.h"
#include "test.h"

static const struct json_field fields[] = {
	{ "name", JF_STRING, true, 8 },
	{ "count", JF_INT, false, 0 },
	{ "scopes", JF_ARRAY, false, 3 },
	{ "meta", JF_OBJECT, false, 0 },
};
#define NF (sizeof(fields) / sizeof(fields[0]))

static enum kiln_err parse(const char *text, struct kiln_error *e)
{
	json_t *o = NULL;
	enum kiln_err rc = json_parse_body(text, strlen(text), fields, NF, &o, e);

	CHECK((rc == KILN_OK) == (o != NULL));
	json_decref(o);
	return rc;
}

static void test_valid_body_parses(void)
{
	struct kiln_error e = { 0 };
	json_t *o = NULL;
	const char *t = "{\"name\":\"a\",\"count\":3,\"scopes\":[\"x\"],\"meta\":{}}";

	CHECK_INT(json_parse_body(t, strlen(t), fields, NF, &o, &e), KILN_OK);
	CHECK_STR(json_str(o, "name", NULL), "a");
	CHECK_INT(json_int(o, "count", -1), 3);
	CHECK_INT(json_int(o, "absent", -1), -1);
	json_decref(o);
	CHECK_INT(parse("{\"name\":\"a\",\"count\":null}", &e), KILN_OK);
}

static void test_each_bad_input_names_the_field(void)
{
	struct kiln_error e = { 0 };

	CHECK_INT(parse("{\"name\":\"a\",\"colour\":1}", &e), KILN_E_BAD_REQUEST);
	CHECK(strstr(e.msg, "colour") != NULL);
	kiln_error_clear(&e);
	CHECK_INT(parse("{\"name\":\"a\",\"count\":\"3\"}", &e), KILN_E_BAD_REQUEST);
	CHECK(strstr(e.msg, "count") && strstr(e.msg, "integer"));
	kiln_error_clear(&e);
	CHECK_INT(parse("{\"count\":3}", &e), KILN_E_BAD_REQUEST);
	CHECK(strstr(e.msg, "name") && strstr(e.msg, "required"));
	kiln_error_clear(&e);
	CHECK_INT(parse("{\"name\":\"abcdefghi\"}", &e), KILN_E_TOO_LARGE);
	kiln_error_clear(&e);
	CHECK_INT(parse("{\"name\":\"a\",\"scopes\":[1,2,3,4]}", &e), KILN_E_TOO_LARGE);
	kiln_error_clear(&e);
	CHECK_INT(parse("{\"name\":\"a\"", &e), KILN_E_BAD_REQUEST);
	CHECK(strstr(e.msg, "malformed JSON") != NULL);
	kiln_error_clear(&e);
	CHECK_INT(parse("[1]", &e), KILN_E_BAD_REQUEST);
	kiln_error_clear(&e);
	CHECK_INT(parse("{\"name\":\"a\",\"name\":\"b\"}", &e), KILN_E_BAD_REQUEST);
}

static void test_empty_body_is_an_empty_object(void)
{
	static const struct json_field none[] = { { "x", JF_INT, false, 0 } };
	struct kiln_error e = { 0 };
	json_t *o = NULL;

	CHECK_INT(json_parse_body("", 0, none, 1, &o, &e), KILN_OK);
	CHECK(json_is_object(o) && json_object_size(o) == 0);
	json_decref(o);
}

int main(void)
{
	TEST(test_valid_body_parses);
	TEST(test_each_bad_input_names_the_field);
	TEST(test_empty_body_is_an_empty_object);
	return test_summary();
}
