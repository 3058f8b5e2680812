/*
 * test_price.c - the exact arithmetic of metering/price.h: prices in fine units, remainders that
 * are carried and never rounded away, counter deltas across resets, window alignment, shares.
 */
#include "metering/price.h"

#include "test.h"

static struct rate_card card(long long cpu, long long mem, long long disk, long long snap)
{
	struct rate_card c;

	price_card_init(&c, cpu, mem, disk, snap);
	return c;
}

static void test_card_version_names_the_prices(void)
{
	struct rate_card c = card(100, 50, 2, 1);

	CHECK_STR(c.version, "cpu100-mem50-disk2-snap1");
}

static void test_one_second_of_allocation_is_exact(void)
{
	/* 256 MiB at 1024 µcr/GiB-s = 256 µcr/s; 1 GiB disk at 1 µcr/GiB-s = 1 µcr/s. */
	struct rate_card c = card(0, 1024, 1, 0);
	struct price_usage u = { .run_ns = 1000000000, .mem_mib = 256, .disk_gib = 1 };
	uint64_t rem = 0;

	CHECK_INT(price_take(&rem, price_fine(&c, &u)), 257);
	CHECK_INT(rem, 0);
}

static void test_cpu_by_measured_use(void)
{
	/* 1.5 CPU-seconds at 1000 µcr per CPU-second. */
	struct rate_card c = card(1000, 0, 0, 0);
	struct price_usage u = { .run_ns = 1000000000, .cpu_ns = 1500000000, .mem_mib = 512 };
	uint64_t rem = 0;

	CHECK_INT(price_take(&rem, price_fine(&c, &u)), 1500);
	CHECK_INT(rem, 0);
}

static void test_paused_pays_snapshot_storage_only(void)
{
	struct rate_card c = card(1000, 1024, 1, 2048);
	struct price_usage u = { .paused_ns = 1000000000, .mem_mib = 512, .disk_gib = 10,
				 .snap_mib = 512, .cpu_ns = 0 };
	uint64_t rem = 0;

	/* 0.5 GiB at 2048 µcr/GiB-s; no memory, disk or CPU charge. */
	CHECK_INT(price_take(&rem, price_fine(&c, &u)), 1024);
}

static void test_remainders_carry_and_sum_exactly(void)
{
	/* 1 MiB at 1 µcr/GiB-s is 1/1024 µcr per second: nothing for 1023 seconds, 1 µcr at the
	 * 1024th, and nothing is lost on the way. */
	struct rate_card c = card(0, 1, 0, 0);
	struct price_usage u = { .run_ns = 1000000000, .mem_mib = 1 };
	uint64_t rem = 0;
	long long total = 0;

	for (int i = 0; i < 1023; i++)
		total += price_take(&rem, price_fine(&c, &u));
	CHECK_INT(total, 0);
	CHECK(rem > 0 && rem < PRICE_FINE_PER_UCR);
	total += price_take(&rem, price_fine(&c, &u));
	CHECK_INT(total, 1);
	CHECK_INT(rem, 0);
}

static void test_split_ticks_equal_one_charge(void)
{
	/* Charging 10 s in 7 uneven pieces with a carried remainder equals charging it at once. */
	struct rate_card c = card(333, 77, 3, 5);
	const uint64_t pieces[] = { 1, 999999999, 123456789, 876543211, 3000000000ULL,
				    2500000000ULL, 2500000000ULL };
	struct price_usage whole = { .run_ns = 10000000000ULL, .mem_mib = 300, .disk_gib = 7,
				     .cpu_ns = 0 };
	uint64_t rem = 0, rem1 = 0;
	long long sum = 0, once;

	for (size_t i = 0; i < sizeof(pieces) / sizeof(pieces[0]); i++) {
		struct price_usage u = { .run_ns = pieces[i], .mem_mib = 300, .disk_gib = 7 };
		sum += price_take(&rem, price_fine(&c, &u));
	}
	once = price_take(&rem1, price_fine(&c, &whole));
	CHECK_INT(sum, once);
	CHECK_INT(rem, rem1);
}

static void test_large_values_do_not_overflow(void)
{
	/* A day of a 16 GiB, 60 GiB-disk sandbox on 8 busy vCPUs at high prices. */
	struct rate_card c = card(1000000000LL, 1000000000LL, 1000000000LL, 0);
	struct price_usage u = { .run_ns = 86400ULL * 1000000000ULL, .mem_mib = 16384,
				 .disk_gib = 60, .cpu_ns = 8ULL * 86400ULL * 1000000000ULL };
	uint64_t rem = 0;
	long long want = 8LL * 86400 * 1000000000LL + 16LL * 86400 * 1000000000LL +
			 60LL * 86400 * 1000000000LL;

	CHECK_INT(price_take(&rem, price_fine(&c, &u)), want);
	CHECK_INT(rem, 0);
}

static void test_delta_of_cumulative_counters(void)
{
	CHECK_INT(price_delta(100, 250, false), 150);
	CHECK_INT(price_delta(100, 100, false), 0);
	/* The counter went down: the VM was restored or restarted, it counts from zero again. */
	CHECK_INT(price_delta(1000, 40, false), 40);
	/* A new generation resets even if the new counter happens to be larger. */
	CHECK_INT(price_delta(100, 250, true), 250);
}

static void test_windows_are_aligned_to_the_epoch(void)
{
	const int64_t s = PRICE_NS_PER_S;

	CHECK_INT(price_window_start(0, 10), 0);
	CHECK_INT(price_window_start(9 * s + s - 1, 10), 0);
	CHECK_INT(price_window_start(10 * s, 10), 10);
	CHECK_INT(price_window_start(1796030898LL * s + 833056000, 10), 1796030890);
	CHECK_INT(price_window_start(1796030898LL * s, 60), 1796030880);
	CHECK_INT(price_window_start(-1, 10), -10);
}

static void test_shares_sum_to_the_total(void)
{
	uint64_t total = 1000003, a = price_share(total, 1, 3), b = price_share(total, 1, 3);

	CHECK_INT(a, 333334);
	CHECK_INT(total - a - b, 333335);
	CHECK_INT(price_share(7, 10, 10), 7);
	CHECK_INT(price_share(UINT64_MAX, 1, 2), UINT64_MAX / 2);
}

int main(void)
{
	TEST(test_card_version_names_the_prices);
	TEST(test_one_second_of_allocation_is_exact);
	TEST(test_cpu_by_measured_use);
	TEST(test_paused_pays_snapshot_storage_only);
	TEST(test_remainders_carry_and_sum_exactly);
	TEST(test_split_ticks_equal_one_charge);
	TEST(test_large_values_do_not_overflow);
	TEST(test_delta_of_cumulative_counters);
	TEST(test_windows_are_aligned_to_the_epoch);
	TEST(test_shares_sum_to_the_total);
	return test_summary();
}
