/*
 * test_cgroup.c - the cgroup readers against fixture trees (tests/fixtures/cgroup/README.md):
 * which version a layout selects, and what cg_read() and the quota reader report for v2 and v1.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "test.h"
#include "vmm/cgroup.h"

static char root_v2[PATH_MAX], root_hybrid[PATH_MAX], root_hybrid_v2[PATH_MAX];

static void test_cgroup_detects_the_version(void)
{
	CHECK_INT(cg_detect(root_v2), CG_V2);
	CHECK_INT(cg_detect(root_hybrid), CG_V1);
	CHECK_INT(cg_detect(root_hybrid_v2), CG_V2);
	CHECK_INT(cg_detect("/nonexistent"), -ENOENT);
}

static void test_cgroup_v2_reads_usage(void)
{
	struct cg *cg = NULL;
	struct cg_usage u;
	long long quota, period;

	CHECK_INT(cg_open(root_v2, "n1", "vm1", &cg), 0);
	if (!cg)
		return;
	CHECK_INT(cg_version(cg), CG_V2);
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 1234567000LL);
	CHECK_INT(u.mem_bytes, 301989888);
	CHECK(u.has_peak);
	CHECK_INT(u.mem_peak_bytes, 335544320);
	CHECK_INT(cg_read_cpu_quota(cg, &quota, &period), 0);
	CHECK_INT(quota, 25000);
	CHECK_INT(period, 100000);
	CHECK(cg_has_pid(cg, 4243));
	CHECK(!cg_has_pid(cg, 424));
	cg_free(cg);
}

static void test_cgroup_v2_without_peak(void)
{
	struct cg *cg = NULL;
	struct cg_usage u;
	long long quota, period;

	CHECK_INT(cg_open(root_v2, "n1", "oldkernel", &cg), 0);
	if (!cg)
		return;
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 77000);
	CHECK_INT(u.mem_bytes, 4096);
	CHECK(!u.has_peak);
	CHECK_INT(cg_read_cpu_quota(cg, &quota, &period), 0);
	CHECK_INT(quota, -1);
	CHECK_INT(period, 100000);
	CHECK(!cg_has_pid(cg, 1));
	cg_free(cg);
}

static void test_cgroup_v1_reads_usage(void)
{
	struct cg *cg = NULL;
	struct cg_usage u;
	long long quota, period;

	CHECK_INT(cg_open(root_hybrid, "n1", "vm1", &cg), 0);
	if (!cg)
		return;
	CHECK_INT(cg_version(cg), CG_V1);
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 987654321);
	CHECK_INT(u.mem_bytes, 268435456);
	CHECK(u.has_peak);
	CHECK_INT(u.mem_peak_bytes, 270532608);
	CHECK_INT(cg_read_cpu_quota(cg, &quota, &period), 0);
	CHECK_INT(quota, 50000);
	CHECK_INT(period, 100000);
	CHECK(cg_has_pid(cg, 99));
	cg_free(cg);
}

static void test_cgroup_rejects_bad_names(void)
{
	struct cg *cg = NULL;

	CHECK_INT(cg_open(root_v2, "n1", "../n1", &cg), -EINVAL);
	CHECK_INT(cg_open(root_v2, "..", "vm1", &cg), -EINVAL);
	CHECK_INT(cg_open(root_v2, "n1", "absent", &cg), -ENOENT);
	CHECK(cg == NULL);
}

int main(void)
{
	const char *fx = getenv("KILN_FIXTURES");

	if (!fx) {
		fprintf(stderr, "KILN_FIXTURES must name tests/fixtures\n");
		return 1;
	}
	snprintf(root_v2, sizeof(root_v2), "%s/cgroup/v2", fx);
	snprintf(root_hybrid, sizeof(root_hybrid), "%s/cgroup/hybrid", fx);
	snprintf(root_hybrid_v2, sizeof(root_hybrid_v2), "%s/cgroup/hybrid-v2", fx);
	TEST(test_cgroup_detects_the_version);
	TEST(test_cgroup_v2_reads_usage);
	TEST(test_cgroup_v2_without_peak);
	TEST(test_cgroup_v1_reads_usage);
	TEST(test_cgroup_rejects_bad_names);
	return test_summary();
}
