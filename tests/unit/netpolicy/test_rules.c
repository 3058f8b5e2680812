/*
 * test_rules.c - the egress rule parser: accepted forms, canonical text, strict rejection,
 * all-or-nothing sets and host-name matching.
 */
#include <stdlib.h>

#include "netpolicy/rules.h"
#include "test.h"

static const char *fmt(const char *text)
{
	static char buf[KILN_RULE_TEXT_MAX];
	struct kiln_rule r;
	struct kiln_error err = {0};
	if (kiln_rule_parse(text, &r, &err) != KILN_OK)
		return "(invalid)";
	kiln_rule_format(&r, buf, sizeof(buf));
	return buf;
}

static void rules_accepts_every_documented_form(void)
{
	CHECK_STR(fmt("pypi.org"), "pypi.org");
	CHECK_STR(fmt("API.Example.com:443"), "api.example.com:443");
	CHECK_STR(fmt("*.github.com"), "*.github.com");
	CHECK_STR(fmt("*.github.com:22"), "*.github.com:22");
	CHECK_STR(fmt("203.0.113.7"), "203.0.113.7");
	CHECK_STR(fmt("203.0.113.7:8080"), "203.0.113.7:8080");
	CHECK_STR(fmt("198.51.100.0/24"), "198.51.100.0/24");
	CHECK_STR(fmt("198.51.100.0/24:443"), "198.51.100.0/24:443");
	CHECK_STR(fmt("0.0.0.0/0"), "0.0.0.0/0");
	CHECK_STR(fmt("2001:db8::/32"), "2001:db8::/32");
	CHECK_STR(fmt("2001:DB8:0::1"), "2001:db8::1");
	CHECK_STR(fmt("[2001:db8::1]:443"), "[2001:db8::1]:443");
	CHECK_STR(fmt("[2001:db8::/48]:443"), "[2001:db8::/48]:443");
	CHECK_STR(fmt("::/0"), "::/0");
	CHECK_STR(fmt("[2001:db8::1]"), "2001:db8::1");
}

static void rules_rejects_malformed_input(void)
{
	const char *bad[] = {
		"", " pypi.org", "pypi.org ", "pypi", "bad..rule", "-a.com", "a-.com", "a_b.com",
		"*.", "*", "*.*.com", "a*.b.com", "**.b.com", "example.com:0", "example.com:65536",
		"example.com:080", "example.com:", "example.com:+1", "1.2.3", "1.2.3.4.5",
		"256.1.1.1", "01.2.3.4", "1.2.3.4/33", "1.2.3.4/24", "10.0.0.0/08", "1.2.3.4:1:2",
		"[2001:db8::1]443", "[2001:db8::1", "[1.2.3.4]:80",
		"2001:db8::/129", "2001:db8::1/64", "[::]:", "exa mple.com", "example.com/24",
		"http://example.com", "1.2.3.4/", "/8", ":80", "a.com\n",
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		struct kiln_rule r;
		struct kiln_error err = {0};
		enum kiln_err e = kiln_rule_parse(bad[i], &r, &err);
		if (e != KILN_E_INVALID)
			fprintf(stderr, "accepted: \"%s\"\n", bad[i]);
		CHECK_INT(e, KILN_E_INVALID);
	}
	char longname[400];
	memset(longname, 'a', sizeof(longname) - 1);
	longname[sizeof(longname) - 1] = '\0';
	struct kiln_rule r;
	CHECK_INT(kiln_rule_parse(longname, &r, NULL), KILN_E_INVALID);
	CHECK_INT(kiln_rule_parse(NULL, &r, NULL), KILN_E_INVALID);
}

static void rules_error_names_the_bad_rule(void)
{
	const char *set[] = {"pypi.org", "bad..rule", "also bad"};
	struct kiln_ruleset rs = {0};
	struct kiln_error err = {0};
	CHECK_INT(kiln_rules_parse(set, 3, &rs, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "\"bad..rule\"") != NULL);
	CHECK_INT(rs.n, 0);
	CHECK(rs.rules == NULL);
}

static void rules_set_folds_duplicates(void)
{
	const char *set[] = {"pypi.org", "PyPI.org", "203.0.113.7", "203.0.113.7/32"};
	struct kiln_ruleset rs = {0};
	CHECK_INT(kiln_rules_parse(set, 4, &rs, NULL), KILN_OK);
	CHECK_INT(rs.n, 2);
	kiln_ruleset_free(&rs);
	CHECK_INT(kiln_rules_parse(NULL, 0, &rs, NULL), KILN_OK);
	CHECK_INT(rs.n, 0);
}

static void rules_set_has_a_cap(void)
{
	size_t n = KILN_RULESET_MAX + 1;
	const char **set = calloc(n, sizeof(*set));
	for (size_t i = 0; i < n; i++)
		set[i] = "pypi.org";
	struct kiln_ruleset rs = {0};
	CHECK_INT(kiln_rules_parse(set, n, &rs, NULL), KILN_E_TOO_LARGE);
	free(set);
}

static void wildcard_matches_subdomains_not_apex(void)
{
	const char *set[] = {"*.example.com", "api.test:8443", "api.test"};
	struct kiln_ruleset rs = {0};
	CHECK_INT(kiln_rules_parse(set, 3, &rs, NULL), KILN_OK);
	uint16_t ports[8];
	CHECK_INT(kiln_rules_match_host(&rs, "example.com", ports, 8), 0);
	CHECK_INT(kiln_rules_match_host(&rs, "a.example.com", ports, 8), 1);
	CHECK_INT(ports[0], 0);
	CHECK_INT(kiln_rules_match_host(&rs, "x.y.z.example.com", ports, 8), 1);
	CHECK_INT(kiln_rules_match_host(&rs, "badexample.com", ports, 8), 0);
	CHECK_INT(kiln_rules_match_host(&rs, "example.com.evil.test", ports, 8), 0);
	CHECK_INT(kiln_rules_match_host(&rs, "api.test", ports, 8), 2);
	CHECK_INT(kiln_rules_match_host(&rs, "x.api.test", ports, 8), 0);
	char norm[KILN_HOST_MAX + 1];
	CHECK(kiln_host_normalize("A.Example.COM.", norm));
	CHECK_STR(norm, "a.example.com");
	CHECK(!kiln_host_normalize("a b.com", norm));
	kiln_ruleset_free(&rs);
}

int main(void)
{
	TEST(rules_accepts_every_documented_form);
	TEST(rules_rejects_malformed_input);
	TEST(rules_error_names_the_bad_rule);
	TEST(rules_set_folds_duplicates);
	TEST(rules_set_has_a_cap);
	TEST(wildcard_matches_subdomains_not_apex);
	return test_summary();
}
