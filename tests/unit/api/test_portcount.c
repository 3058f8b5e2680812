/*
 * test_portcount.c - the per-tenant port stream cap counted across gateways (api/portcount.c):
 * two counters on the services fixture's one Redis stand for two gateways. The cap holds in total;
 * a counter that dies leaves its streams to expire within a lease while a live one's are renewed;
 * with Redis unreachable a counter's own count holds the cap.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "test.h"
#include "testredis.h"

#include "api/portcount.h"
#include "common/redis.h"

static char redis_url[512];
static char tenant[64];

/* Members of the tenant's set in Redis, expired or not (-1 when Redis does not answer). */
static long long members(struct rds *r)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[160];
	long long n = -1;

	snprintf(key, sizeof(key), "kiln:port_streams:%s", tenant);
	if (RDS(r, &rep, &err, "ZCARD", key) == KILN_OK && rep.type == RDS_INT)
		n = rep.integer;
	rds_reply_release(&rep);
	return n;
}

static void new_tenant(void)
{
	snprintf(tenant, sizeof(tenant), "tn_pc%08x", (unsigned)rand());
}

/* Two gateways on one Redis: the tenant's cap of 4 holds in total, not 4 on each. */
static void cap_holds_across_gateways(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct portcount a, b;
	unsigned long long ta[3], tb[3];
	bool down = true;

	new_tenant();
	portcount_init(&a);
	portcount_init(&b);
	CHECK(r && portcount_attach(&a, r, 30000) == 0 && portcount_attach(&b, r, 30000) == 0);
	CHECK(portcount_take(&a, tenant, 4, &ta[0], &down) && !down);
	CHECK(portcount_take(&a, tenant, 4, &ta[1], &down) && !down);
	CHECK(portcount_take(&b, tenant, 4, &tb[0], NULL));
	CHECK(portcount_take(&b, tenant, 4, &tb[1], NULL));
	CHECK(!portcount_take(&a, tenant, 4, &ta[2], &down) && !down);	/* 4 in total */
	CHECK(!portcount_take(&b, tenant, 4, &tb[2], NULL));
	CHECK_INT(members(r), 4);
	/* a stream that ends on one gateway makes room on the other */
	portcount_give(&a, tenant, ta[0]);
	CHECK_INT(members(r), 3);
	CHECK(portcount_take(&b, tenant, 4, &tb[2], NULL));
	CHECK(!portcount_take(&a, tenant, 4, &ta[0], NULL));
	CHECK_INT(portcount_held(&a, tenant), 1);
	CHECK_INT(portcount_held(&b, tenant), 3);
	/* another tenant is not held back by this one */
	{
		unsigned long long t;
		char other[80];

		snprintf(other, sizeof(other), "%s_other", tenant);
		CHECK(portcount_take(&a, other, 4, &t, NULL));
		portcount_give(&a, other, t);
	}
	portcount_give(&a, tenant, ta[1]);
	for (int i = 0; i < 3; i++)
		portcount_give(&b, tenant, tb[i]);
	CHECK_INT(members(r), 0);
	CHECK_INT(portcount_held(&a, tenant) + portcount_held(&b, tenant), 0);
	portcount_destroy(&a);
	portcount_destroy(&b);
	rds_free(r);
}

/*
 * A gateway that dies holding streams: they stop counting once their lease runs out, while the
 * live gateway's streams, renewed every third of a lease, go on counting.
 */
static void dead_gateway_streams_expire_live_ones_are_renewed(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct portcount a, b;
	unsigned long long ta[4], tb;
	const long long lease = 3000;

	new_tenant();
	portcount_init(&a);
	portcount_init(&b);
	CHECK(r && portcount_attach(&a, r, lease) == 0 && portcount_attach(&b, r, lease) == 0);
	CHECK(portcount_take(&a, tenant, 3, &ta[0], NULL));
	CHECK(portcount_take(&a, tenant, 3, &ta[1], NULL));
	CHECK(portcount_take(&b, tenant, 3, &tb, NULL));
	CHECK(!portcount_take(&a, tenant, 3, &ta[2], NULL));
	portcount_detach(&b);	/* b dies: no renewal, no removal */
	usleep((useconds_t)(lease * 3 / 2) * 1000);
	/* b's stream expired; a's two were renewed and still count */
	CHECK(portcount_take(&a, tenant, 3, &ta[2], NULL));
	CHECK(!portcount_take(&a, tenant, 3, &ta[3], NULL));
	for (int i = 0; i < 3; i++)
		portcount_give(&a, tenant, ta[i]);
	CHECK_INT(members(r), 0);
	portcount_destroy(&a);
	portcount_destroy(&b);
	rds_free(r);
}

/* Redis unreachable: a gateway's own count holds the cap, and says Redis is down. */
static void without_redis_a_gateway_holds_the_cap_itself(void)
{
	char url[128];
	struct rds *r;
	struct portcount a;
	unsigned long long t[3];
	bool down = false;

	new_tenant();
	snprintf(url, sizeof(url), "unix:/nonexistent/kiln-portcount-%d.sock", (int)getpid());
	r = rds_new(url, 200);
	portcount_init(&a);
	CHECK(r && portcount_attach(&a, r, 30000) == 0);
	CHECK(portcount_take(&a, tenant, 2, &t[0], &down) && down);
	CHECK(portcount_take(&a, tenant, 2, &t[1], &down) && down);
	CHECK(!portcount_take(&a, tenant, 2, &t[2], &down) && down);
	portcount_give(&a, tenant, t[0]);
	CHECK(portcount_take(&a, tenant, 2, &t[0], NULL));
	portcount_give(&a, tenant, t[0]);
	portcount_give(&a, tenant, t[1]);
	CHECK_INT(portcount_held(&a, tenant), 0);
	portcount_destroy(&a);
	rds_free(r);
}

/* Streams let through while Redis was down are counted there again by the renewal once it answers. */
static void streams_admitted_while_down_count_again(void)
{
	struct rds *r = rds_new(redis_url, 2000);
	struct portcount a, b;
	unsigned long long ta[2], tb;
	const long long lease = 3000;

	new_tenant();
	portcount_init(&a);
	portcount_init(&b);
	/* a counts on its own (as if Redis had been down), then reaches Redis */
	CHECK(portcount_take(&a, tenant, 2, &ta[0], NULL));
	CHECK(portcount_take(&a, tenant, 2, &ta[1], NULL));
	CHECK_INT(members(r), 0);
	CHECK(r && portcount_attach(&a, r, lease) == 0 && portcount_attach(&b, r, lease) == 0);
	for (int i = 0; i < 100 && members(r) < 2; i++)
		usleep(100 * 1000);	/* the renewal comes within a third of a lease */
	CHECK_INT(members(r), 2);
	CHECK(!portcount_take(&b, tenant, 2, &tb, NULL));
	portcount_give(&a, tenant, ta[0]);
	portcount_give(&a, tenant, ta[1]);
	CHECK(portcount_take(&b, tenant, 2, &tb, NULL));
	portcount_give(&b, tenant, tb);
	CHECK_INT(members(r), 0);
	portcount_destroy(&a);
	portcount_destroy(&b);
	rds_free(r);
}

int main(void)
{
	test_seed();
	if (testredis_url(redis_url, sizeof(redis_url)) != 0)
		return 1;
	TEST(cap_holds_across_gateways);
	TEST(dead_gateway_streams_expire_live_ones_are_renewed);
	TEST(without_redis_a_gateway_holds_the_cap_itself);
	TEST(streams_admitted_while_down_count_again);
	return test_summary();
}
