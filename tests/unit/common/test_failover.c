/*
 * Unit tests of the failover plumbing of common/: which SQLSTATEs make the Postgres pool drop a
 * connection and look for the primary again, the Sentinel client's parsing of its settings, and
 * that a Sentinel client with no sentinel reachable answers "unavailable" at once and is freed
 * cleanly (its watcher thread joined).
 */
#include <string.h>
#include <time.h>

#include "common/config.h"
#include "common/pg.h"
#include "common/redis.h"
#include "test.h"

static void test_switch_sqlstates(void)
{
	const char *yes[] = { "08000", "08003", "08006", "08001", "57P01", "57P02", "57P03", "25006" };
	const char *no[] = { "23505", "40001", "42P01", "25001", "57014", "22P02", "00000" };

	for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++)
		CHECK(pg_sqlstate_switch(yes[i]));
	for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++)
		CHECK(!pg_sqlstate_switch(no[i]));
}

static void test_sentinel_settings(void)
{
	const char *bad[] = { "", " , ", "host", "host:", ":26379", "h:0", "h:65536", "h:12x",
			      "a:1,b:2,c:3,d:4,e:5,f:6,g:7,h:8,i:9" };
	struct rds *r;

	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		r = rds_new_sentinel(bad[i], "kiln", 100);
		CHECK(r == NULL);
		rds_free(r);
	}
	CHECK(rds_new_sentinel("127.0.0.1:1", "", 100) == NULL);
	r = rds_new_sentinel("127.0.0.1:1, [::1]:2,localhost:3", "kiln", 100);
	CHECK(r != NULL);
	rds_free(r);
}

static void test_no_sentinel_is_unavailable_at_once(void)
{
	struct kiln_config cfg = { 0 };
	struct kiln_error err = { 0 };
	struct timespec a, b;
	struct rds *r;

	cfg.redis_url = "127.0.0.1:6379";
	cfg.redis_sentinels = "127.0.0.1:1,127.0.0.1:2";
	cfg.redis_master_name = "kiln";
	r = rds_open(&cfg, 200);
	CHECK(r != NULL);
	if (!r)
		return;
	clock_gettime(CLOCK_MONOTONIC, &a);
	CHECK_INT(rds_ping(r, &err), KILN_E_UNAVAILABLE);
	clock_gettime(CLOCK_MONOTONIC, &b);
	CHECK(b.tv_sec - a.tv_sec < 5);
	rds_free(r);
}

int main(void)
{
	TEST(test_switch_sqlstates);
	TEST(test_sentinel_settings);
	TEST(test_no_sentinel_is_unavailable_at_once);
	return test_summary();
}
