/*
 * Unit tests of common/imageref.c: registry references accepted with their parts, and refusals
 * naming the part that is wrong.
 */
#include <string.h>

#include "common/imageref.h"
#include "test.h"

static void ok(const char *s, const char *host, unsigned port, const char *name, const char *tag,
	       const char *digest, const char *canonical)
{
	struct imageref r;
	struct kiln_error err = { 0 };

	CHECK_INT(imageref_parse(s, &r, &err), KILN_OK);
	if (err.code)
		fprintf(stderr, "  %s: %s\n", s, err.msg);
	CHECK_STR(r.host, host);
	CHECK_INT(r.port, port);
	CHECK_STR(r.name, name);
	CHECK_STR(r.tag, tag);
	CHECK_STR(r.digest, digest);
	CHECK_STR(r.canonical, canonical);
}

static void bad(const char *s, const char *part)
{
	struct imageref r;
	struct kiln_error err = { 0 };

	CHECK_INT(imageref_parse(s, &r, &err), KILN_E_INVALID);
	if (!strstr(err.msg, part))
		fprintf(stderr, "  %s: \"%s\" lacks \"%s\"\n", s ? s : "(null)", err.msg, part);
	CHECK(strstr(err.msg, part) != NULL);
}

static void test_accepted(void)
{
	const char *d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
	char with_digest[200];

	ok("docker.io/library/alpine:3.20", "docker.io", 0, "library/alpine", "3.20", "",
	   "docker.io/library/alpine:3.20");
	ok("198.51.100.22:5000/kiln/mini", "198.51.100.22", 5000, "kiln/mini", "latest", "",
	   "198.51.100.22:5000/kiln/mini:latest");
	ok("localhost/a", "localhost", 0, "a", "latest", "", "localhost/a:latest");
	ok("[2001:db8::1]:443/x/y_z__w-q.r:v_1.0-rc", "2001:db8::1", 443, "x/y_z__w-q.r", "v_1.0-rc",
	   "", "[2001:db8::1]:443/x/y_z__w-q.r:v_1.0-rc");
	snprintf(with_digest, sizeof(with_digest), "ghcr.io/o/i@%s", d);
	ok(with_digest, "ghcr.io", 0, "o/i", "", d, with_digest);
	snprintf(with_digest, sizeof(with_digest), "ghcr.io/o/i:t@%s", d);
	ok(with_digest, "ghcr.io", 0, "o/i", "t", d, with_digest);
	ok("Reg-1.Example.COM/a---b", "Reg-1.Example.COM", 0, "a---b", "latest", "",
	   "Reg-1.Example.COM/a---b:latest");
}

static void test_refused(void)
{
	char longname[600];

	bad(NULL, "required");
	bad("", "required");
	bad("alpine:3.20", "must name its registry");
	bad("library/alpine", "must name its registry");
	bad("-bad.example/x", "host");
	bad("bad-.example/x", "host");
	bad("a..b/x", "host");
	bad("ex_ample.com/x", "host");
	bad("[::g]:5000/x", "IPv6");
	bad("[::1]x/y", "IPv6");
	bad("r.example:0/x", "port");
	bad("r.example:65536/x", "port");
	bad("r.example:/x", "port");
	bad("r.example:50a/x", "port");
	bad("r.example/Upper", "name");
	bad("r.example/a..b", "name");
	bad("r.example/a___b", "name");
	bad("r.example/a//b", "name");
	bad("r.example/", "name");
	bad("r.example/-a", "name");
	bad("r.example/a;rm -rf", "name");
	bad("r.example/a:.bad", "tag");
	bad("r.example/a:", "tag");
	bad("r.example/a:t$x", "tag");
	bad("r.example/a@sha256:12", "digest");
	bad("r.example/a@md5:0123456789abcdef0123456789abcdef", "digest");
	bad("r.example/a@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef",
	    "digest");
	memset(longname, 'a', sizeof(longname) - 1);
	longname[sizeof(longname) - 1] = '\0';
	memcpy(longname, "r.example/", 10);
	bad(longname, "longer than");
	memset(longname, 'a', 300);
	memcpy(longname, "r.example/", 10);
	longname[300] = '\0';
	bad(longname, "name is longer");
}

int main(void)
{
	TEST(test_accepted);
	TEST(test_refused);
	return test_summary();
}
