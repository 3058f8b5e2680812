/*
 * Unit tests of common/netaddr.h: the class of each kind of address (IPv4, IPv6 and the IPv6
 * forms that carry an IPv4 address), this host's own addresses, the allow list's parser and its
 * matching by address, network and host name, and the check of every address a host resolves to.
 */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>

#include "common/netaddr.h"
#include "test.h"

/* `text` (an IPv4 or IPv6 address) as a sockaddr in `ss`. */
static const struct sockaddr *sa_of(const char *text, struct sockaddr_storage *ss)
{
	memset(ss, 0, sizeof(*ss));
	if (inet_pton(AF_INET, text, &((struct sockaddr_in *)ss)->sin_addr) == 1) {
		ss->ss_family = AF_INET;
	} else {
		CHECK(inet_pton(AF_INET6, text, &((struct sockaddr_in6 *)ss)->sin6_addr) == 1);
		ss->ss_family = AF_INET6;
	}
	return (const struct sockaddr *)ss;
}

static enum netaddr_class cls(const char *text)
{
	struct sockaddr_storage ss;

	return netaddr_classify(sa_of(text, &ss));
}

#define CHECK_CLASS(text, want)                                                       \
	do {                                                                          \
		enum netaddr_class got_ = cls(text);                                  \
		if (got_ != (want))                                                   \
			fprintf(stderr, "%s:%d: %s is %s, expected %s\n", __FILE__, __LINE__, \
				text, netaddr_class_text(got_), netaddr_class_text(want)); \
		CHECK(got_ == (want));                                                \
	} while (0)

static void test_ipv4_classes(void)
{
	CHECK_CLASS("8.8.8.8", NETADDR_PUBLIC);
	CHECK_CLASS("52.95.110.1", NETADDR_PUBLIC);
	CHECK_CLASS("0.0.0.0", NETADDR_UNSPECIFIED);
	CHECK_CLASS("0.1.2.3", NETADDR_UNSPECIFIED);
	CHECK_CLASS("127.0.0.1", NETADDR_LOOPBACK);
	CHECK_CLASS("127.255.255.254", NETADDR_LOOPBACK);
	CHECK_CLASS("169.254.169.254", NETADDR_LINK_LOCAL);
	CHECK_CLASS("10.0.0.1", NETADDR_PRIVATE);
	CHECK_CLASS("172.16.0.1", NETADDR_PRIVATE);
	CHECK_CLASS("172.31.255.255", NETADDR_PRIVATE);
	CHECK_CLASS("172.32.0.1", NETADDR_PUBLIC);
	CHECK_CLASS("192.168.1.1", NETADDR_PRIVATE);
	CHECK_CLASS("100.64.0.1", NETADDR_SHARED);
	CHECK_CLASS("100.127.255.255", NETADDR_SHARED);
	CHECK_CLASS("100.128.0.1", NETADDR_PUBLIC);
	CHECK_CLASS("224.0.0.1", NETADDR_MULTICAST);
	CHECK_CLASS("239.255.255.250", NETADDR_MULTICAST);
	CHECK_CLASS("240.0.0.1", NETADDR_RESERVED);
	CHECK_CLASS("255.255.255.255", NETADDR_RESERVED);
	CHECK_CLASS("192.0.0.170", NETADDR_RESERVED);
	CHECK_CLASS("192.0.2.1", NETADDR_RESERVED);
	CHECK_CLASS("198.18.0.1", NETADDR_RESERVED);
	CHECK_CLASS("203.0.113.9", NETADDR_RESERVED);
}

static void test_ipv6_classes(void)
{
	CHECK_CLASS("2a05:d018::1", NETADDR_PUBLIC);
	CHECK_CLASS("::", NETADDR_UNSPECIFIED);
	CHECK_CLASS("::1", NETADDR_LOOPBACK);
	CHECK_CLASS("fe80::1", NETADDR_LINK_LOCAL);
	CHECK_CLASS("fd00:ec2::254", NETADDR_PRIVATE);
	CHECK_CLASS("fc00::1", NETADDR_PRIVATE);
	CHECK_CLASS("fec0::1", NETADDR_PRIVATE);
	CHECK_CLASS("ff02::1", NETADDR_MULTICAST);
	CHECK_CLASS("2001:db8::1", NETADDR_RESERVED);
	CHECK_CLASS("100::1", NETADDR_RESERVED);
	CHECK_CLASS("64:ff9b:1::a00:1", NETADDR_PRIVATE);
}

static void test_ipv6_forms_of_ipv4_are_judged_by_the_ipv4_address(void)
{
	CHECK_CLASS("::ffff:127.0.0.1", NETADDR_LOOPBACK);
	CHECK_CLASS("::ffff:7f00:1", NETADDR_LOOPBACK);
	CHECK_CLASS("::ffff:169.254.169.254", NETADDR_LINK_LOCAL);
	CHECK_CLASS("::ffff:10.1.2.3", NETADDR_PRIVATE);
	CHECK_CLASS("::ffff:0:10.1.2.3", NETADDR_PRIVATE);
	CHECK_CLASS("::ffff:0.0.0.0", NETADDR_UNSPECIFIED);
	CHECK_CLASS("::ffff:8.8.8.8", NETADDR_PUBLIC);
	CHECK_CLASS("::127.0.0.1", NETADDR_LOOPBACK);
	CHECK_CLASS("::10.0.0.1", NETADDR_PRIVATE);
	CHECK_CLASS("64:ff9b::7f00:1", NETADDR_LOOPBACK);
	CHECK_CLASS("64:ff9b::10.0.0.1", NETADDR_PRIVATE);
	CHECK_CLASS("64:ff9b::169.254.169.254", NETADDR_LINK_LOCAL);
	CHECK_CLASS("64:ff9b::8.8.8.8", NETADDR_PUBLIC);
	CHECK_CLASS("2002:7f00:1::1", NETADDR_LOOPBACK);
	CHECK_CLASS("2002:c0a8:101::1", NETADDR_PRIVATE);
	CHECK_CLASS("2002:808:808::1", NETADDR_PUBLIC);
}

/* Every address of this host's interfaces is itself; a public address it does not have is not. */
static void test_this_hosts_addresses(void)
{
	struct ifaddrs *ifs = NULL, *i;
	struct sockaddr_storage ss;
	struct kiln_error err = { 0 };
	int seen = 0;

	CHECK_INT(getifaddrs(&ifs), 0);
	for (i = ifs; i; i = i->ifa_next) {
		if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET &&
				     i->ifa_addr->sa_family != AF_INET6))
			continue;
		CHECK(netaddr_is_self(i->ifa_addr));
		CHECK_INT(netaddr_check(NULL, "example.com", i->ifa_addr, &err), KILN_E_INVALID);
		seen++;
	}
	freeifaddrs(ifs);
	CHECK(seen >= 1);	/* loopback at least */
	CHECK(netaddr_is_self(sa_of("127.0.0.1", &ss)));
	CHECK(netaddr_is_self(sa_of("::ffff:127.0.0.1", &ss)));
	CHECK(!netaddr_is_self(sa_of("198.51.100.77", &ss)));
	CHECK_INT(netaddr_check(NULL, "s3.example.com", sa_of("52.95.110.1", &ss), NULL), KILN_OK);
}

static void test_check_names_the_class_never_the_address(void)
{
	struct sockaddr_storage ss;
	struct kiln_error err = { 0 };

	CHECK_INT(netaddr_check(NULL, "x.internal", sa_of("10.9.8.7", &ss), &err), KILN_E_INVALID);
	CHECK_STR(err.msg, "the endpoint's host resolves to a private address, which is refused");
	kiln_error_clear(&err);
	CHECK_INT(netaddr_check(NULL, "x", sa_of("169.254.169.254", &ss), &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "link-local") != NULL);
	CHECK(strstr(err.msg, "169.254") == NULL);
}

static void test_allow_list(void)
{
	struct netaddr_allow *a = NULL;
	struct sockaddr_storage ss;
	struct kiln_error err = { 0 };

	CHECK_INT(netaddr_allow_parse("127.0.0.1, 10.0.5.0/24 fd00::/8,MinIO.lan ::1", &a, &err),
		  KILN_OK);
	CHECK(netaddr_allowed(a, NULL, sa_of("127.0.0.1", &ss)));
	CHECK(netaddr_allowed(a, NULL, sa_of("::ffff:127.0.0.1", &ss)));
	CHECK(!netaddr_allowed(a, NULL, sa_of("127.0.0.2", &ss)));
	CHECK(netaddr_allowed(a, NULL, sa_of("10.0.5.200", &ss)));
	CHECK(!netaddr_allowed(a, NULL, sa_of("10.0.6.1", &ss)));
	CHECK(netaddr_allowed(a, NULL, sa_of("fd12::1", &ss)));
	CHECK(!netaddr_allowed(a, NULL, sa_of("fc00::1", &ss)));
	CHECK(netaddr_allowed(a, NULL, sa_of("::1", &ss)));
	CHECK(netaddr_allowed(a, "minio.LAN", sa_of("192.168.7.7", &ss)));
	CHECK(!netaddr_allowed(a, "minio.lan.evil.com", sa_of("192.168.7.7", &ss)));
	CHECK_INT(netaddr_check(a, "minio.lan", sa_of("192.168.7.7", &ss), &err), KILN_OK);
	CHECK_INT(netaddr_check(a, "other", sa_of("192.168.7.7", &ss), &err), KILN_E_INVALID);
	CHECK_INT(netaddr_check(a, "other", sa_of("10.0.5.1", &ss), &err), KILN_OK);
	netaddr_allow_free(a);

	/* /0 allows everything of its family */
	CHECK_INT(netaddr_allow_parse("0.0.0.0/0", &a, &err), KILN_OK);
	CHECK(netaddr_allowed(a, NULL, sa_of("169.254.169.254", &ss)));
	CHECK(!netaddr_allowed(a, NULL, sa_of("::1", &ss)));
	netaddr_allow_free(a);

	/* empty lists allow nothing */
	CHECK_INT(netaddr_allow_parse("", &a, &err), KILN_OK);
	CHECK(!netaddr_allowed(a, "localhost", sa_of("127.0.0.1", &ss)));
	netaddr_allow_free(a);
	CHECK_INT(netaddr_allow_parse(NULL, &a, &err), KILN_OK);
	netaddr_allow_free(a);
	CHECK(!netaddr_allowed(NULL, "localhost", sa_of("127.0.0.1", &ss)));

	/* malformed entries name themselves */
	static const char *const bad[] = { "10.0.0.0/33", "::1/129", "10.0.0.0/", "10.0.0.0/x",
					   "2130706433", "0x7f.1", "under_score", "host/8",
					   "1.2.3.4/-1" };
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		a = (struct netaddr_allow *)1;
		kiln_error_clear(&err);
		CHECK_INT(netaddr_allow_parse(bad[i], &a, &err), KILN_E_INVALID);
		CHECK(a == NULL);
		CHECK(strstr(err.msg, bad[i]) != NULL);
	}
}

/* Every address a host resolves to is checked: literals and `localhost` from /etc/hosts. */
static void test_check_host_checks_each_address_it_resolves_to(void)
{
	struct netaddr_allow *a = NULL;
	struct kiln_error err = { 0 };

	CHECK_INT(netaddr_check_host(NULL, "127.0.0.1", &err), KILN_E_INVALID);
	CHECK_STR(err.msg, "the endpoint's host resolves to a loopback address, which is refused");
	kiln_error_clear(&err);
	CHECK_INT(netaddr_check_host(NULL, "localhost", &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "loopback") != NULL);
	kiln_error_clear(&err);
	CHECK_INT(netaddr_check_host(NULL, "198.51.100.22", &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "reserved") != NULL);
	kiln_error_clear(&err);
	CHECK_INT(netaddr_check_host(NULL, "not a host!", &err), KILN_E_UNAVAILABLE);
	CHECK_INT(netaddr_allow_parse("198.51.100.22", &a, &err), KILN_OK);
	CHECK_INT(netaddr_check_host(a, "198.51.100.22", &err), KILN_OK);
	CHECK_INT(netaddr_check_host(a, "127.0.0.1", &err), KILN_E_INVALID);
	netaddr_allow_free(a);
}

int main(void)
{
	TEST(test_ipv4_classes);
	TEST(test_ipv6_classes);
	TEST(test_ipv6_forms_of_ipv4_are_judged_by_the_ipv4_address);
	TEST(test_this_hosts_addresses);
	TEST(test_check_names_the_class_never_the_address);
	TEST(test_allow_list);
	TEST(test_check_host_checks_each_address_it_resolves_to);
	return test_summary();
}
