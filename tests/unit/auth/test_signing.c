/*
 * test_signing.c - the gateway's signing keys in the services fixture's Postgres (auth/signing.c):
 * a reload opens and parses the stored keys only when their rows changed, and still picks up every
 * change: a rotation made by another process, new material under a kid, a retired key leaving
 * (by a row written or by its keep ending), the signer swapped between the same keys, and the
 * reloading thread within its period; the reloads' cadence on the monotonic clock, whatever steps
 * the wall clock takes, restarted by clocks set anew, and taken when a reload runs, not when it
 * was asked.
 */
#include "test.h"
#include "testdb.h"

#include <pthread.h>
#include <time.h>

#include "auth/scopes.h"
#include "auth/signing.h"
#include "common/clock.h"
#include "common/log.h"

static struct testdb db;
static struct auth_master_key mk;

/* A signing of an empty table: signing_new() makes the first key. */
static struct signing *fresh_signing(void)
{
	struct kiln_error err = { 0 };
	struct signing *s;

	testdb_sql(db.pg, "DELETE FROM signing_keys");
	s = signing_new(db.pg, &mk, &err);
	if (!s) {
		fprintf(stderr, "signing_new: %s\n", err.msg);
		exit(1);
	}
	return s;
}

/* A user token of `s`'s signer, its kid to `kid`; NULL (the case failed) when it cannot sign. */
static char *sign(struct signing *s, char kid[AUTH_KID_MAX])
{
	struct auth_token_params p = {
		.iss = "kiln",
		.aud = AUTH_AUD_API,
		.sub = "key_test",
		.tid = "ten_test",
		.scopes = AUTH_SCOPES_TENANT,
		.now = time(NULL),
		.ttl_s = 900,
	};
	struct auth_claims c;
	struct kiln_error err = { 0 };
	char *token = NULL;

	if (kid)
		kid[0] = '\0';
	if (signing_sign(s, &p, &token, &c, &err) != KILN_OK) {
		fprintf(stderr, "signing_sign: %s\n", err.msg);
		test_case_failed = 1;
		return NULL;
	}
	if (kid)
		snprintf(kid, AUTH_KID_MAX, "%s", c.kid);
	return token;
}

/* Why `s` refuses `token`: AUTH_JWT_OK when it verifies. */
static enum auth_jwt_reason verify(struct signing *s, const char *token)
{
	struct auth_verify_opts o = { .aud = AUTH_AUD_API, .iss = "kiln", .now = time(NULL) };
	enum auth_jwt_reason why = AUTH_JWT_OK;
	struct kiln_error err = { 0 };
	struct auth_claims c;

	if (!token)
		return AUTH_JWT_MALFORMED;
	signing_verify(s, token, strlen(token), &o, &c, &why, &err);
	return why;
}

static void reload(struct signing *s)
{
	struct kiln_error err = { 0 };

	if (signing_reload(s, false, &err) != KILN_OK) {
		fprintf(stderr, "signing_reload: %s\n", err.msg);
		test_case_failed = 1;
	}
}

/* Rotates as `kiln-gateway --rotate-signing-key` does; the new kid to `kid`. */
static void rotate(char kid[AUTH_KID_MAX])
{
	struct kiln_error err = { 0 };

	if (signing_rotate(db.pg, &mk, kid, &err) != KILN_OK) {
		fprintf(stderr, "signing_rotate: %s\n", err.msg);
		test_case_failed = 1;
	}
}

/*
 * Signs every 100 ms, on the host's monotonic clock, until `want` signs or `within_ms` have
 * passed; the last signer's kid in `kid`.
 */
static void sign_until(struct signing *s, const char *want, long long within_ms,
		       char kid[AUTH_KID_MAX])
{
	struct timespec tick = { 0, 100 * 1000 * 1000 };
	long long until = clock_mono_ms() + within_ms;

	do {
		free(sign(s, kid));
		if (strcmp(kid, want) == 0)
			return;
		nanosleep(&tick, NULL);
	} while (clock_mono_ms() < until);
}

static void test_a_reload_of_unchanged_keys_builds_no_keyring(void)
{
	struct kiln_error err = { 0 };
	struct signing *s = fresh_signing();
	char *token = sign(s, NULL);

	CHECK_INT(signing_keyrings_built(s), 1);
	for (int i = 0; i < 3; i++)
		reload(s);
	/* The reload a token of an unknown kid asks for reads the same rows. */
	CHECK_INT(signing_reload(s, true, &err), KILN_OK);
	CHECK_INT(signing_keyrings_built(s), 1);
	CHECK_INT(verify(s, token), AUTH_JWT_OK);
	free(token);
	signing_free(s);
}

static void test_a_key_rotated_elsewhere_signs_after_the_next_reload(void)
{
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX];
	char *before = sign(s, old_kid), *after;

	rotate(new_kid);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 2);
	after = sign(s, kid);
	CHECK_STR(kid, new_kid);
	CHECK(strcmp(old_kid, new_kid) != 0);
	/* The retired key keeps verifying its tokens. */
	CHECK_INT(verify(s, before), AUTH_JWT_OK);
	CHECK_INT(verify(s, after), AUTH_JWT_OK);
	free(before);
	free(after);
	signing_free(s);
}

/* Seals `kp`'s private key in the row of `kid`, as if that row's material had changed. */
static void reseal(const char *kid, const struct auth_jwt_keypair *kp)
{
	struct kiln_error err = { 0 };
	char ad[96], *sealed = NULL;

	snprintf(ad, sizeof(ad), "signing_key:%s", kid);
	if (auth_seal(&mk, kp->private_pem, strlen(kp->private_pem), ad, strlen(ad), &sealed,
		      &err) != KILN_OK) {
		fprintf(stderr, "auth_seal: %s\n", err.msg);
		test_case_failed = 1;
		return;
	}
	testdb_sql(db.pg, "UPDATE signing_keys SET private_sealed = '%s' WHERE kid = '%s'", sealed,
		   kid);
	free(sealed);
}

static void test_new_material_under_a_kid_is_built_at_the_next_reload(void)
{
	struct auth_jwt_keypair kp;
	struct kiln_error err = { 0 };
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], kid[AUTH_KID_MAX] = "";
	char *before = sign(s, old_kid), *after;

	CHECK_INT(auth_jwt_keygen(&kp, &err), KILN_OK);
	reseal(old_kid, &kp);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 2);
	after = sign(s, kid);
	CHECK_STR(kid, kp.kid);
	CHECK_INT(verify(s, after), AUTH_JWT_OK);
	/* The key that signed `before` is in no row any more. */
	CHECK_INT(verify(s, before), AUTH_JWT_UNKNOWN_KID);
	auth_jwt_keypair_release(&kp);
	free(before);
	free(after);
	signing_free(s);
}

static void test_a_key_retired_past_its_keep_stops_verifying_at_the_next_reload(void)
{
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "";
	char *before = sign(s, old_kid);

	rotate(new_kid);
	reload(s);
	CHECK_INT(verify(s, before), AUTH_JWT_OK);
	testdb_sql(db.pg,
		   "UPDATE signing_keys SET retired_at = now() - make_interval(secs => %d) "
		   "WHERE kid = '%s'",
		   SIGNING_RETIRED_KEEP_S + 1, old_kid);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 3);
	CHECK_INT(verify(s, before), AUTH_JWT_UNKNOWN_KID);
	free(before);
	signing_free(s);
}

/* The reloading thread alone (no reload asked for) picks a rotation up within its period. */
static void test_the_refresher_picks_up_a_rotation_within_its_period(void)
{
	struct kiln_error err = { 0 };
	struct signing *s = fresh_signing();
	char new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX] = "";

	CHECK_INT(signing_start_refresh(s, &err), KILN_OK);
	rotate(new_kid);
	/* the period, 5 s, and the thread's 1 s tick, with a margin */
	sign_until(s, new_kid, 7000, kid);
	CHECK_STR(kid, new_kid);
	CHECK_INT(signing_keyrings_built(s), 2);
	signing_free(s);
}

/*
 * A retired key leaves when its keep ends, with no row written: the rows read change by the
 * database's clock alone. Moving retired_at within the keep changes nothing read, so nothing is
 * built.
 */
static void test_a_retired_key_leaves_when_its_keep_ends_with_no_row_written(void)
{
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "";
	char *before = sign(s, old_kid);
	struct timespec wait = { 3, 0 };

	rotate(new_kid);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 2);
	testdb_sql(db.pg,
		   "UPDATE signing_keys SET retired_at = now() - make_interval(secs => %d) "
		   "WHERE kid = '%s'",
		   SIGNING_RETIRED_KEEP_S - 2, old_kid);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 2);
	CHECK_INT(verify(s, before), AUTH_JWT_OK);
	nanosleep(&wait, NULL);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 3);
	CHECK_INT(verify(s, before), AUTH_JWT_UNKNOWN_KID);
	free(before);
	signing_free(s);
}

/* The same keys with the signer swapped (which row is not retired): built, the other signs. */
static void test_a_signer_swapped_between_the_same_keys_signs_at_the_next_reload(void)
{
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX] = "";
	char *before = sign(s, old_kid), *after;

	rotate(new_kid);
	reload(s);
	testdb_sql(db.pg,
		   "UPDATE signing_keys SET retired_at = CASE WHEN kid = '%s' THEN NULL ELSE now() "
		   "END",
		   old_kid);
	reload(s);
	CHECK_INT(signing_keyrings_built(s), 3);
	after = sign(s, kid);
	CHECK_STR(kid, old_kid);
	CHECK_INT(verify(s, before), AUTH_JWT_OK);
	CHECK_INT(verify(s, after), AUTH_JWT_OK);
	free(before);
	free(after);
	signing_free(s);
}

/*
 * The clocks a signing reads in the cases below (signing_set_clock_for_test): the host's at
 * install, then still, moved only by the case, so what is due is the case's to say. Atomic: the
 * refresher reads them.
 */
struct test_clocks {
	long long wall_ms, mono_ms;
};

static long long test_clocks_ms_of(clockid_t clock, void *ctx)
{
	struct test_clocks *tc = ctx;

	if (clock == CLOCK_MONOTONIC)
		return __atomic_load_n(&tc->mono_ms, __ATOMIC_RELAXED);
	if (clock == CLOCK_REALTIME)
		return __atomic_load_n(&tc->wall_ms, __ATOMIC_RELAXED);
	abort();	/* a clock these cases do not move: they could not show which one is read */
}

/* Installs `tc` in `s`, and reloads: the period starts at the clocks' start. */
static void clocks_install(struct signing *s, struct test_clocks *tc)
{
	tc->wall_ms = clock_ms_of(CLOCK_REALTIME);
	tc->mono_ms = clock_mono_ms();
	signing_set_clock_for_test(s, test_clocks_ms_of, tc);
	reload(s);
}

/* Steps the wall clock by `wall_ms` and lets `mono_ms` pass on the monotonic one. */
static void clocks_move(struct test_clocks *tc, long long wall_ms, long long mono_ms)
{
	__atomic_add_fetch(&tc->wall_ms, wall_ms, __ATOMIC_RELAXED);
	__atomic_add_fetch(&tc->mono_ms, mono_ms, __ATOMIC_RELAXED);
}

#define HOUR_MS (3600 * 1000LL)
#define PERIOD_MS (SIGNING_REFRESH_S * 1000LL)

/*
 * With the wall clock stepped back an hour, a key rotated in by another process signs here once
 * the period has passed on the monotonic clock, and not before. On the wall clock, the reloads
 * stopped for the hour.
 */
static void test_a_rotation_signs_within_the_period_after_the_wall_clock_steps_back(void)
{
	struct test_clocks tc;
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX];

	clocks_install(s, &tc);
	free(sign(s, old_kid));
	clocks_move(&tc, -HOUR_MS, 0);
	rotate(new_kid);
	clocks_move(&tc, 0, PERIOD_MS - 1);
	free(sign(s, kid));
	CHECK_STR(kid, old_kid);
	clocks_move(&tc, 0, 1);
	free(sign(s, kid));
	CHECK_STR(kid, new_kid);
	CHECK_INT(signing_keyrings_built(s), 2);
	signing_free(s);
}

/*
 * The same with the reloading thread: it picks the rotation up at its first tick past the
 * period.
 */
static void test_the_refresher_picks_up_a_rotation_after_the_wall_clock_steps_back(void)
{
	struct kiln_error err = { 0 };
	struct test_clocks tc;
	struct signing *s = fresh_signing();
	char new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX] = "";

	clocks_install(s, &tc);
	CHECK_INT(signing_start_refresh(s, &err), KILN_OK);
	clocks_move(&tc, -HOUR_MS, 0);
	rotate(new_kid);
	clocks_move(&tc, 0, PERIOD_MS);
	/* the thread's 1 s tick, on the host's monotonic clock, with a margin */
	sign_until(s, new_kid, 3000, kid);
	CHECK_STR(kid, new_kid);
	CHECK_INT(signing_keyrings_built(s), 2);
	signing_free(s);
}

/*
 * Steps of the wall clock forward bring no reload: the keys are read once a period of the
 * monotonic clock, whatever the wall clock does meanwhile. On the wall clock, each step reloaded
 * at once.
 */
static void test_a_forward_step_of_the_wall_clock_reloads_no_more_than_once_a_period(void)
{
	struct test_clocks tc;
	struct signing *s = fresh_signing();
	char first_kid[AUTH_KID_MAX], second_kid[AUTH_KID_MAX] = "", third_kid[AUTH_KID_MAX] = "";
	char kid[AUTH_KID_MAX];

	clocks_install(s, &tc);
	free(sign(s, first_kid));
	rotate(second_kid);
	for (int i = 0; i < 3; i++) {
		clocks_move(&tc, HOUR_MS, 1000);
		free(sign(s, kid));
		CHECK_STR(kid, first_kid);
	}
	clocks_move(&tc, 0, PERIOD_MS - 3000);
	free(sign(s, kid));
	CHECK_STR(kid, second_kid);
	CHECK_INT(signing_keyrings_built(s), 2);
	/* The period starts again at that reload, steps or not. */
	rotate(third_kid);
	clocks_move(&tc, HOUR_MS, PERIOD_MS - 1);
	free(sign(s, kid));
	CHECK_STR(kid, second_kid);
	clocks_move(&tc, 0, 1);
	free(sign(s, kid));
	CHECK_STR(kid, third_kid);
	CHECK_INT(signing_keyrings_built(s), 3);
	signing_free(s);
}

/* The reloads tokens of unknown kids ask for stay once a second across a wall-clock step. */
static void test_unknown_kid_reloads_stay_once_a_second_across_a_wall_clock_step(void)
{
	struct kiln_error err = { 0 };
	struct test_clocks tc;
	struct signing *s = fresh_signing();
	char kid[AUTH_KID_MAX] = "";

	clocks_install(s, &tc);
	rotate(kid);
	CHECK_INT(signing_reload(s, true, &err), KILN_OK);
	CHECK_INT(signing_keyrings_built(s), 2);
	rotate(kid);
	clocks_move(&tc, HOUR_MS, 999);
	CHECK_INT(signing_reload(s, true, &err), KILN_OK);
	CHECK_INT(signing_keyrings_built(s), 2);
	clocks_move(&tc, -2 * HOUR_MS, 0);
	CHECK_INT(signing_reload(s, true, &err), KILN_OK);
	CHECK_INT(signing_keyrings_built(s), 2);
	clocks_move(&tc, 0, 1);
	CHECK_INT(signing_reload(s, true, &err), KILN_OK);
	CHECK_INT(signing_keyrings_built(s), 3);
	signing_free(s);
}

/*
 * Clocks set anew start the period at their own now: the time of the last load, read on the
 * clocks replaced (an hour ahead here), does not hold the reloads back for that hour.
 */
static void test_clocks_set_anew_start_the_period_at_their_now(void)
{
	struct test_clocks ahead, tc;
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX];

	clocks_install(s, &ahead);
	clocks_move(&ahead, 0, HOUR_MS);
	reload(s);
	free(sign(s, old_kid));
	/* the host's clocks again, with no reload asked */
	tc.wall_ms = clock_ms_of(CLOCK_REALTIME);
	tc.mono_ms = clock_mono_ms();
	signing_set_clock_for_test(s, test_clocks_ms_of, &tc);
	rotate(new_kid);
	clocks_move(&tc, 0, PERIOD_MS - 1);
	free(sign(s, kid));
	CHECK_STR(kid, old_kid);
	clocks_move(&tc, 0, 1);
	free(sign(s, kid));
	CHECK_STR(kid, new_kid);
	CHECK_INT(signing_keyrings_built(s), 2);
	signing_free(s);
}

static void *reload_thread(void *arg)
{
	reload(arg);
	return NULL;
}

/*
 * A reload that waited for a slow one stores the time it ran at, not the time it was asked: the
 * period starts at the later of the two. A first reload is held in its query by a lock on
 * signing_keys while a second one waits for it, and the clock moves on meanwhile.
 */
static void test_a_reload_that_waited_for_another_starts_the_period_when_it_runs(void)
{
	struct kiln_error err = { 0 };
	struct test_clocks tc;
	struct signing *s = fresh_signing();
	char old_kid[AUTH_KID_MAX], new_kid[AUTH_KID_MAX] = "", kid[AUTH_KID_MAX];
	struct timespec settle = { 0, 300 * 1000 * 1000 };
	pthread_t first, second;
	struct pg_conn *c;

	clocks_install(s, &tc);
	free(sign(s, old_kid));
	CHECK_INT(pg_acquire(db.pg, &c, &err), KILN_OK);
	CHECK_INT(pg_exec(c, "BEGIN", &err), KILN_OK);
	CHECK_INT(pg_exec(c, "LOCK TABLE signing_keys IN ACCESS EXCLUSIVE MODE", &err), KILN_OK);
	pthread_create(&first, NULL, reload_thread, s);
	nanosleep(&settle, NULL);	/* the first one in its query, holding the reload */
	pthread_create(&second, NULL, reload_thread, s);
	nanosleep(&settle, NULL);	/* the second one waiting for it */
	clocks_move(&tc, 0, 3000);
	CHECK_INT(pg_exec(c, "ROLLBACK", &err), KILN_OK);
	pg_release(db.pg, c);
	pthread_join(first, NULL);
	pthread_join(second, NULL);
	rotate(new_kid);
	/* a period from the first reload's time: not yet due from the second's */
	clocks_move(&tc, 0, PERIOD_MS - 3000);
	free(sign(s, kid));
	CHECK_STR(kid, old_kid);
	clocks_move(&tc, 0, 3000);
	free(sign(s, kid));
	CHECK_STR(kid, new_kid);
	signing_free(s);
}

int main(void)
{
	struct kiln_error err = { 0 };
	int rc;

	log_init("test_signing", KLOG_ERROR, false);
	if (testdb_open(&db, "signing") != 0)
		return 1;
	if (auth_master_key_generate(&mk, &err) != KILN_OK) {
		fprintf(stderr, "master key: %s\n", err.msg);
		return 1;
	}
	TEST(test_a_reload_of_unchanged_keys_builds_no_keyring);
	TEST(test_a_key_rotated_elsewhere_signs_after_the_next_reload);
	TEST(test_new_material_under_a_kid_is_built_at_the_next_reload);
	TEST(test_a_key_retired_past_its_keep_stops_verifying_at_the_next_reload);
	TEST(test_the_refresher_picks_up_a_rotation_within_its_period);
	TEST(test_a_retired_key_leaves_when_its_keep_ends_with_no_row_written);
	TEST(test_a_signer_swapped_between_the_same_keys_signs_at_the_next_reload);
	TEST(test_a_rotation_signs_within_the_period_after_the_wall_clock_steps_back);
	TEST(test_the_refresher_picks_up_a_rotation_after_the_wall_clock_steps_back);
	TEST(test_a_forward_step_of_the_wall_clock_reloads_no_more_than_once_a_period);
	TEST(test_unknown_kid_reloads_stay_once_a_second_across_a_wall_clock_step);
	TEST(test_clocks_set_anew_start_the_period_at_their_now);
	TEST(test_a_reload_that_waited_for_another_starts_the_period_when_it_runs);
	rc = test_summary();
	auth_master_key_wipe(&mk);
	testdb_close(&db);
	return rc;
}
