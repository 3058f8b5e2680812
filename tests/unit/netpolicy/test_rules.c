/*
 * test_rules.c - the egress rule parser: accepted forms, canonical text, strict rejection,
 * all-or-nothing sets, host-name matching, and the operator's denied ranges (`egress_deny`): a
 * rule inside one is refused naming it, wider rules are accepted, the default is the config's.
 */
#include <stdlib.h>
#include <string.h>

#include "common/config.h"

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

/* The denied ranges of `list` (with the floor, "host" not expanded: no netns here). */
static size_t deny_of(const char *list, struct kiln_cidr *v, size_t max)
{
	struct kiln_error err = {0};
	size_t n = 0;
	bool host = false;
	CHECK(kiln_cidrs_parse(KILN_EGRESS_DENY_FLOOR, v, max, &n, &host, &err) == KILN_OK);
	CHECK(kiln_cidrs_parse(list, v, max, &n, &host, &err) == KILN_OK);
	CHECK(host);
	return n;
}

/* Whether the one-rule set `rule` is refused, and the message names `range`. */
static bool refused(const struct kiln_cidr *v, size_t n, const char *rule, const char *range)
{
	struct kiln_error err = {0};
	struct kiln_ruleset rs;
	const char *texts[] = {"203.0.113.7", rule};
	CHECK(kiln_rules_parse(texts, 2, &rs, &err) == KILN_OK);
	enum kiln_err e = kiln_rules_check_deny(&rs, v, n, &err);
	kiln_ruleset_free(&rs);
	if (e == KILN_OK)
		return false;
	CHECK_INT(e, KILN_E_INVALID);
	if (!strstr(err.msg, range) || !strstr(err.msg, rule)) {
		fprintf(stderr, "message \"%s\" should name %s and %s\n", err.msg, rule, range);
		return false;
	}
	return true;
}

static void deny_refuses_rules_inside_a_denied_range(void)
{
	struct kiln_cidr v[2 * KILN_DENY_MAX];
	size_t n = deny_of(KILN_EGRESS_DENY_DEFAULT, v, 2 * KILN_DENY_MAX);
	CHECK(refused(v, n, "169.254.169.254", "169.254.0.0/16"));
	CHECK(refused(v, n, "169.254.169.254:80", "169.254.0.0/16"));
	CHECK(refused(v, n, "127.0.0.1", "127.0.0.0/8"));
	CHECK(refused(v, n, "10.200.0.5", "10.200.0.0/16"));
	CHECK(refused(v, n, "10.0.0.0/8", "10.0.0.0/8"));
	CHECK(refused(v, n, "::1", "::1/128"));
	CHECK(refused(v, n, "[64:ff9b::a9fe:a9fe]:80", "64:ff9b::/96"));
	CHECK(refused(v, n, "64:ff9b::/96", "64:ff9b::/96"));
	CHECK(refused(v, n, "fe80::1", "fe80::/10"));
	CHECK(refused(v, n, "fd6b:696c:6e00:1::1", "fd6b:696c:6e00::/48"));
	/* wider than a denied range, or outside every one: accepted (the range stays denied) */
	CHECK(!refused(v, n, "0.0.0.0/0", ""));
	CHECK(!refused(v, n, "::/0", ""));
	CHECK(!refused(v, n, "10.0.0.0/7", ""));
	CHECK(!refused(v, n, "64:ff9b::/95", ""));
	CHECK(!refused(v, n, "198.51.100.0/24:443", ""));
	CHECK(!refused(v, n, "2001:db8::1", ""));
}

static void deny_operator_list_and_floor(void)
{
	struct kiln_cidr v[2 * KILN_DENY_MAX];
	/* an operator's own range; the floor stays even when the list leaves it out */
	size_t n = deny_of("198.51.100.0/25 2001:db8:5::/48", v, 2 * KILN_DENY_MAX);
	CHECK(refused(v, n, "198.51.100.7", "198.51.100.0/25"));
	CHECK(refused(v, n, "[2001:db8:5::1]:443", "2001:db8:5::/48"));
	CHECK(!refused(v, n, "198.51.100.128", ""));
	CHECK(refused(v, n, "169.254.169.254", "169.254.0.0/16"));
	CHECK(refused(v, n, "127.0.0.1", "127.0.0.0/8"));
	CHECK(refused(v, n, "10.200.1.1", "10.200.0.0/16"));
	CHECK(!refused(v, n, "10.1.2.3", ""));	/* 10/8 only by the default list */

	struct kiln_error err = {0};
	size_t m = 0;
	CHECK(kiln_cidrs_parse("10.0.0.0/8,bogus", v, 8, &m, NULL, &err) == KILN_E_INVALID);
	CHECK(strstr(err.msg, "bogus") != NULL);
	m = 0;
	CHECK(kiln_cidrs_parse("10.0.0.0/33", v, 8, &m, NULL, &err) == KILN_E_INVALID);
	m = 0;
	CHECK(kiln_cidrs_parse("1.0.0.0/8 2.0.0.0/8 3.0.0.0/8", v, 2, &m, NULL, &err) ==
	      KILN_E_TOO_LARGE);
	/* host bits are cleared, duplicates folded */
	m = 0;
	CHECK(kiln_cidrs_parse("192.0.2.77/24,192.0.2.0/24", v, 8, &m, NULL, &err) == KILN_OK);
	CHECK_INT(m, 1);
	char t[64];
	kiln_cidr_format(&v[0], t, sizeof(t));
	CHECK_STR(t, "192.0.2.0/24");
}

static void deny_default_is_the_configs(void)
{
	const char *def = NULL;
	for (size_t i = 0; i < config_table_len; i++)
		if (!strcmp(config_table[i].name, "egress_deny"))
			def = config_table[i].def;
	CHECK(def != NULL);
	CHECK_STR(def ? def : "", KILN_EGRESS_DENY_DEFAULT);
	CHECK(strstr(KILN_EGRESS_DENY_DEFAULT, "64:ff9b::/96") != NULL);
	CHECK(strstr(KILN_EGRESS_DENY_DEFAULT, "169.254.0.0/16") != NULL);
}

int main(void)
{
	TEST(rules_accepts_every_documented_form);
	TEST(rules_rejects_malformed_input);
	TEST(rules_error_names_the_bad_rule);
	TEST(rules_set_folds_duplicates);
	TEST(rules_set_has_a_cap);
	TEST(wildcard_matches_subdomains_not_apex);
	TEST(deny_refuses_rules_inside_a_denied_range);
	TEST(deny_operator_list_and_floor);
	TEST(deny_default_is_the_configs);
	return test_summary();
}
