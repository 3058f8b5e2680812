/*
 * test_authn_cache.c - the gateway's caches of API key rows and of tenants' suspension
 * (api/authn.c) in the services fixture's Postgres, on clocks the test moves
 * (gw_authn_set_clock_for_test): with the wall clock stepped back an hour, a key revoked and a
 * tenant suspended by another gateway (a row written here) are refused within key_cache_s of the
 * monotonic clock; last_used_at is written once a minute of the monotonic clock across steps both
 * ways; a key's expires_at is still a date, compared with the wall clock.
 */
#include "test.h"
#include "testdb.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "auth/apikey.h"
#include "auth/scopes.h"
#include "auth/signing.h"
#include "common/clock.h"
#include "common/log.h"

#define KEY_CACHE_S 5	/* the gateway's default key_cache_s, and its ceiling */
#define TTL_MS (KEY_CACHE_S * 1000LL)
#define HOUR_MS (3600 * 1000LL)
#define LAST_USED_EVERY_MS (60 * 1000LL)	/* api/authn.c's LAST_USED_EVERY_S */

static struct testdb db;
static struct gateway gw;

/*
 * The clocks authn.c reads: the host's at install, then still, moved only by the case, so what
 * is fresh in the caches is the case's to say.
 */
struct test_clocks {
	long long wall_ms, mono_ms;
};

static struct test_clocks tc;

static long long test_clocks_ms_of(clockid_t clock, void *ctx)
{
	struct test_clocks *c = ctx;

	if (clock == CLOCK_MONOTONIC)
		return c->mono_ms;
	if (clock == CLOCK_REALTIME)
		return c->wall_ms;
	abort();	/* a clock this test does not move: it could not show which one is read */
}

static void clocks_install(void)
{
	tc.wall_ms = clock_ms_of(CLOCK_REALTIME);
	tc.mono_ms = clock_mono_ms();
	gw_authn_set_clock_for_test(test_clocks_ms_of, &tc);
}

/* Steps the wall clock by `wall_ms` and lets `mono_ms` pass on the monotonic one. */
static void clocks_move(long long wall_ms, long long mono_ms)
{
	tc.wall_ms += wall_ms;
	tc.mono_ms += mono_ms;
}

/* A new tenant's id to `tenant_id`. */
static void new_tenant(char tenant_id[AUTH_ID_MAX])
{
	CHECK_INT(auth_new_id("tn_", tenant_id, AUTH_ID_MAX), KILN_OK);
	testdb_sql(db.pg, "INSERT INTO tenants (id, name) VALUES ('%s', 'cache')", tenant_id);
}

/*
 * A new API key of a new tenant, stored as the gateway stores it; `expires_at` is SQL (NULL:
 * never). Its tenant's id to `tenant_id`.
 */
static struct auth_apikey_new new_key(char tenant_id[AUTH_ID_MAX], const char *expires_at)
{
	struct auth_apikey_new k;
	struct kiln_error err = { 0 };

	new_tenant(tenant_id);
	CHECK_INT(auth_apikey_generate(gw_pepper, sizeof(gw_pepper), &k, &err), KILN_OK);
	testdb_sql(db.pg,
		   "INSERT INTO api_keys (id, tenant_id, name, prefix, secret_hash, scopes, expires_at) "
		   "VALUES ('%s', '%s', 'cache', '%s', '%s', 'sandbox:read', %s)",
		   k.key_id, tenant_id, k.prefix, k.hash, expires_at);
	return k;
}

/* What the gateway answers to `credential` (an API key or a JWT); its message to `msg`. */
static enum kiln_err authenticate(const char *credential, char msg[KILN_ERRMSG_MAX])
{
	struct kiln_error err = { 0 };
	struct principal who;
	char header[4200];
	enum kiln_err rc;

	snprintf(header, sizeof(header), "Bearer %s", credential);
	rc = gw_authenticate(&gw, header, &who, &err);
	if (msg)
		snprintf(msg, KILN_ERRMSG_MAX, "%s", err.msg);
	return rc;
}

/* Whether the key's last_used_at is set. */
static bool last_used(const char *key_id)
{
	return testdb_sql_int(db.pg, "SELECT (last_used_at IS NOT NULL)::int FROM api_keys "
			      "WHERE id = '%s'", key_id) == 1;
}

/*
 * With the wall clock stepped back an hour, a key revoked on another gateway is refused here
 * once key_cache_s has passed on the monotonic clock. On the wall clock, its entry's age was an
 * hour less than nothing, and it kept working for the hour and key_cache_s.
 */
static void test_a_revoked_key_is_refused_within_key_cache_s_after_the_wall_clock_steps_back(void)
{
	char tenant_id[AUTH_ID_MAX], msg[KILN_ERRMSG_MAX];
	struct auth_apikey_new k = new_key(tenant_id, "NULL");

	clocks_install();
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	testdb_sql(db.pg, "UPDATE api_keys SET revoked_at = now() WHERE id = '%s'", k.key_id);
	clocks_move(-HOUR_MS, 0);
	/* from the cache: the revocation has not reached this gateway yet */
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	/* nor does a forward step of the wall clock make the entry old */
	clocks_move(2 * HOUR_MS, 1);
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	clocks_move(0, TTL_MS);
	CHECK_INT(authenticate(k.key, msg), KILN_E_UNAUTHENTICATED);
	CHECK_STR(msg, "the API key was revoked");
}

/*
 * The same for a tenant suspended on another gateway, with a token (whose tenant is read on its
 * own, not with a key's row): refused `suspended` once key_cache_s has passed on the monotonic
 * clock, the wall clock stepped back an hour.
 */
static void test_a_suspended_tenant_is_refused_within_key_cache_s_after_the_wall_clock_steps_back(void)
{
	struct auth_token_params p = {
		.iss = GW_ISSUER,
		.aud = AUTH_AUD_API,
		.sub = "key_cache",
		.scopes = AUTH_SCOPE_SANDBOX_READ,
		.now = time(NULL),
		.ttl_s = GW_TOKEN_TTL_MAX,
	};
	struct kiln_error err = { 0 };
	char tenant_id[AUTH_ID_MAX], *token = NULL;

	new_tenant(tenant_id);
	p.tid = tenant_id;
	CHECK_INT(signing_sign(gw.signing, &p, &token, NULL, &err), KILN_OK);
	if (!token)
		return;
	clocks_install();
	CHECK_INT(authenticate(token, NULL), KILN_OK);
	testdb_sql(db.pg, "UPDATE tenants SET suspended_at = now() WHERE id = '%s'", tenant_id);
	clocks_move(-HOUR_MS, 0);
	CHECK_INT(authenticate(token, NULL), KILN_OK);
	clocks_move(0, TTL_MS);
	CHECK_INT(authenticate(token, NULL), KILN_E_SUSPENDED);
	free(token);
}

/*
 * last_used_at is written at a key's first use, even on a host up for a second, then once a
 * minute of the monotonic clock: a backward step of the wall clock does not hold the next write
 * back for its size, and a forward one brings none early.
 */
static void test_last_used_at_is_written_once_a_minute_of_the_monotonic_clock(void)
{
	char tenant_id[AUTH_ID_MAX];
	struct auth_apikey_new k = new_key(tenant_id, "NULL");

	clocks_install();
	tc.mono_ms = 1000;
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	CHECK(last_used(k.key_id));
	testdb_sql(db.pg, "UPDATE api_keys SET last_used_at = NULL WHERE id = '%s'", k.key_id);
	clocks_move(-HOUR_MS, LAST_USED_EVERY_MS - 1);
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	CHECK(!last_used(k.key_id));
	clocks_move(0, 1);
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	CHECK(last_used(k.key_id));
	testdb_sql(db.pg, "UPDATE api_keys SET last_used_at = NULL WHERE id = '%s'", k.key_id);
	clocks_move(2 * HOUR_MS, 1000);
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	CHECK(!last_used(k.key_id));
	clocks_move(0, LAST_USED_EVERY_MS - 1000);
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	CHECK(last_used(k.key_id));
}

/*
 * A key's expires_at is a date: a key served from the cache is refused as expired as soon as the
 * wall clock passes it, however young its entry on the monotonic clock.
 */
static void test_a_cached_key_expires_on_the_wall_clock(void)
{
	char tenant_id[AUTH_ID_MAX], msg[KILN_ERRMSG_MAX];
	struct auth_apikey_new k = new_key(tenant_id, "now() + interval '30 minutes'");

	clocks_install();
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
	clocks_move(HOUR_MS, 1);
	CHECK_INT(authenticate(k.key, msg), KILN_E_UNAUTHENTICATED);
	CHECK_STR(msg, "the API key has expired");
	clocks_move(-HOUR_MS, 1);
	CHECK_INT(authenticate(k.key, NULL), KILN_OK);
}

int main(void)
{
	struct kiln_error err = { 0 };
	struct auth_master_key mk;
	int rc;

	log_init("test_authn_cache", KLOG_ERROR, false);
	if (testdb_open(&db, "authn") != 0)
		return 1;
	if (auth_master_key_generate(&mk, &err) != KILN_OK ||
	    auth_master_derive(&mk, "apikey-pepper", gw_pepper, sizeof(gw_pepper), &err) != KILN_OK ||
	    gw_authn_init(&err) != KILN_OK) {
		fprintf(stderr, "set-up: %s\n", err.msg);
		return 1;
	}
	gw.cfg.key_cache_s = KEY_CACHE_S;
	gw.pg = pg_new(db.url, 2);
	gw.signing = signing_new(gw.pg, &mk, &err);
	if (!gw.pg || !gw.signing) {
		fprintf(stderr, "set-up: %s\n", err.msg);
		return 1;
	}
	TEST(test_a_revoked_key_is_refused_within_key_cache_s_after_the_wall_clock_steps_back);
	TEST(test_a_suspended_tenant_is_refused_within_key_cache_s_after_the_wall_clock_steps_back);
	TEST(test_last_used_at_is_written_once_a_minute_of_the_monotonic_clock);
	TEST(test_a_cached_key_expires_on_the_wall_clock);
	rc = test_summary();
	gw_authn_set_clock_for_test(NULL, NULL);
	signing_free(gw.signing);
	pg_free(gw.pg);
	gw_authn_exit();
	auth_master_key_wipe(&mk);
	testdb_close(&db);
	return rc;
}
