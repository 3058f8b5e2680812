/* Unit tests of the configuration table: defaults, file, environment, and precise errors. */
#include <stdlib.h>
#include <unistd.h>

#include "common/config.h"
#include "test.h"

static char *write_file(const char *text)
{
	static char path[64];
	int fd;

	snprintf(path, sizeof(path), "/tmp/kiln-cfg-XXXXXX");
	fd = mkstemp(path);
	if (fd < 0)
		return NULL;
	if (write(fd, text, strlen(text)) < 0)
		path[0] = '\0';
	close(fd);
	return path;
}

static void test_defaults_apply_without_file(void)
{
	struct kiln_config c;
	struct kiln_error e = { 0 };

	CHECK_INT(config_load(&c, NULL, false, &e), KILN_OK);
	CHECK_STR(c.listen, "127.0.0.1:8080");
	CHECK_INT(c.db_pool_size, 8);
	CHECK(!c.log_json);
	CHECK(c.master_key == NULL);
	config_release(&c);
}

static void test_file_then_environment_override(void)
{
	struct kiln_config c;
	struct kiln_error e = { 0 };
	char *p = write_file("# comment\n listen = 0.0.0.0:9000 \nlog_json=yes\ndb_pool_size = 3\n");

	setenv("KILN_DB_POOL_SIZE", "5", 1);
	CHECK_INT(config_load(&c, p, true, &e), KILN_OK);
	CHECK_STR(c.listen, "0.0.0.0:9000");
	CHECK(c.log_json);
	CHECK_INT(c.db_pool_size, 5);
	config_release(&c);
	unsetenv("KILN_DB_POOL_SIZE");
	unlink(p);
}

static void test_out_of_range_names_the_setting(void)
{
	struct kiln_config c;
	struct kiln_error e = { 0 };

	setenv("KILN_HTTP_TIMEOUT_S", "0", 1);
	CHECK_INT(config_load(&c, NULL, false, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "http_timeout_s") != NULL);
	CHECK(strstr(e.msg, "KILN_HTTP_TIMEOUT_S") != NULL);
	unsetenv("KILN_HTTP_TIMEOUT_S");
}

static void test_bad_values_are_refused(void)
{
	struct kiln_config c;
	struct kiln_error e = { 0 };
	char *p = write_file("log_level = loud\n");

	CHECK_INT(config_load(&c, p, true, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "log_level") && strstr(e.msg, "loud"));
	CHECK(strstr(e.msg, ":1") != NULL);	/* names the line */
	unlink(p);

	kiln_error_clear(&e);
	p = write_file("db_pool_size = 12abc\n");
	CHECK_INT(config_load(&c, p, true, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "db_pool_size") && strstr(e.msg, "whole number"));
	unlink(p);

	kiln_error_clear(&e);
	p = write_file("log_json = maybe\n");
	CHECK_INT(config_load(&c, p, true, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "log_json") != NULL);
	unlink(p);

	kiln_error_clear(&e);
	p = write_file("no_such_thing = 1\n");
	CHECK_INT(config_load(&c, p, true, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "unknown setting \"no_such_thing\"") != NULL);
	unlink(p);

	kiln_error_clear(&e);
	p = write_file("just words\n");
	CHECK_INT(config_load(&c, p, true, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "name = value") != NULL);
	unlink(p);
}

static void test_missing_file(void)
{
	struct kiln_config c;
	struct kiln_error e = { 0 };

	CHECK_INT(config_load(&c, "/nonexistent/kiln.conf", false, &e), KILN_OK);
	config_release(&c);
	CHECK_INT(config_load(&c, "/nonexistent/kiln.conf", true, &e), KILN_E_INVALID);
	CHECK(strstr(e.msg, "/nonexistent/kiln.conf") != NULL);
}

static void test_help_lists_every_setting(void)
{
	char *text = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&text, &len);

	config_help(f);
	fclose(f);
	for (size_t i = 0; i < config_table_len; i++)
		CHECK(strstr(text, config_table[i].name) != NULL);
	CHECK(strstr(text, "KILN_DATABASE_URL") != NULL);
	free(text);
}

int main(void)
{
	TEST(test_defaults_apply_without_file);
	TEST(test_file_then_environment_override);
	TEST(test_out_of_range_names_the_setting);
	TEST(test_bad_values_are_refused);
	TEST(test_missing_file);
	TEST(test_help_lists_every_setting);
	return test_summary();
}
