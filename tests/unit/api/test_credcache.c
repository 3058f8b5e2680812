/*
 * Unit tests of api/credcache.h, the set-associative cache of the gateway's API key rows and
 * tenants: 1,000 keys (and 1,000 tenants) used in turn, at the sizes api/authn.c makes, all stay
 * cached with no entry evicted; a full set drops its least recently used entry; a dropped entry
 * is gone and its way reused; the fetch lock of an id is its set's; ids too long are not cached;
 * threads on many sets at once lose no entry and no count.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/authn.h"
#include "api/credcache.h"
#include "auth/apikey.h"
#include "test.h"

#define KEYS 1000

struct val {
	char id[CREDCACHE_ID_MAX];
	long n;
};

static char ids[KEYS][AUTH_ID_MAX];

static void make_ids(const char *prefix)
{
	for (int i = 0; i < KEYS; i++)
		CHECK(auth_new_id(prefix, ids[i], sizeof(ids[i])) == KILN_OK);
}

/* Puts each id in turn, then looks each up `rounds` times in turn: every one is found as put. */
static void all_stay(size_t entries, const char *prefix)
{
	struct credcache *c = credcache_new(entries, sizeof(struct val));
	struct credcache_stats st;
	int found = 0;

	CHECK(c != NULL);
	make_ids(prefix);
	for (int i = 0; i < KEYS; i++) {
		struct credcache_set *s = credcache_lock(c, ids[i]);
		struct val *v = credcache_find(s, ids[i]);

		if (!v && (v = credcache_slot(s, ids[i]))) {
			snprintf(v->id, sizeof(v->id), "%s", ids[i]);
			v->n = i;
		}
		credcache_unlock(s);
	}
	for (int round = 0; round < 3; round++)
		for (int i = 0; i < KEYS; i++) {
			struct credcache_set *s = credcache_lock(c, ids[i]);
			const struct val *v = credcache_find(s, ids[i]);

			found += v && v->n == i && strcmp(v->id, ids[i]) == 0;
			credcache_unlock(s);
		}
	credcache_stats(c, &st);
	printf("%zu entries, %d ways, ids \"%s...\": %d of %d lookups found, %llu evictions\n",
	       entries, CREDCACHE_WAYS, prefix, found, 3 * KEYS, st.evictions);
	CHECK_INT(found, 3 * KEYS);
	CHECK_INT((long long)st.evictions, 0);
	CHECK_INT((long long)st.entries, KEYS);
	CHECK_INT((long long)st.hits, 3 * KEYS);
	CHECK_INT((long long)st.misses, KEYS);
	credcache_free(c);
}

static void thousand_keys_stay_cached(void)
{
	all_stay(GW_KEY_CACHE_ENTRIES, "key_");
}

static void thousand_tenants_stay_cached(void)
{
	all_stay(GW_TENANT_CACHE_ENTRIES, "ten_");
}

/* The ids of one set: found by the fetch lock they share. */
static int same_set(struct credcache *c, const char *first, char out[][32], int want)
{
	int n = 0;

	for (int i = 0; n < want && i < 1000000; i++) {
		char id[32];

		snprintf(id, sizeof(id), "id%d", i);
		if (strcmp(id, first) != 0 &&
		    credcache_fetch_lock(c, id) == credcache_fetch_lock(c, first))
			snprintf(out[n++], 32, "%s", id);
	}
	return n;
}

static void full_set_drops_least_recently_used(void)
{
	struct credcache *c = credcache_new(64, sizeof(struct val));
	char set[CREDCACHE_WAYS + 1][32];
	struct credcache_set *s;
	struct credcache_stats st;

	CHECK(c != NULL);
	snprintf(set[0], 32, "first");
	CHECK_INT(same_set(c, set[0], set + 1, CREDCACHE_WAYS), CREDCACHE_WAYS);
	/* fill the set with ways of them; the first is used again, so the second is the oldest */
	for (int i = 0; i < CREDCACHE_WAYS; i++) {
		s = credcache_lock(c, set[i]);
		((struct val *)credcache_slot(s, set[i]))->n = i + 1;
		credcache_unlock(s);
	}
	s = credcache_lock(c, set[0]);
	CHECK(credcache_find(s, set[0]) != NULL);
	/* one more: the least recently used (set[1]) goes, counted; the new entry starts zeroed */
	CHECK_INT(((struct val *)credcache_slot(s, set[CREDCACHE_WAYS]))->n, 0);
	CHECK(credcache_find(s, set[1]) == NULL || CREDCACHE_WAYS == 1);
	CHECK(credcache_find(s, set[0]) != NULL || CREDCACHE_WAYS == 1);
	CHECK(credcache_find(s, set[CREDCACHE_WAYS]) != NULL);
	/* a slot for an id already there is its entry, as it is */
	if (CREDCACHE_WAYS > 1)
		CHECK_INT(((struct val *)credcache_slot(s, set[0]))->n, 1);
	/* dropped: gone, and its way is taken before any other is evicted */
	credcache_drop(s, set[0]);
	CHECK(credcache_find(s, set[0]) == NULL);
	credcache_slot(s, set[1]);
	credcache_unlock(s);
	credcache_stats(c, &st);
	CHECK_INT((long long)st.evictions, 1);
	CHECK_INT((long long)st.entries, CREDCACHE_WAYS);
	credcache_free(c);
}

static void long_ids_not_cached(void)
{
	struct credcache *c = credcache_new(64, sizeof(struct val));
	char id[CREDCACHE_ID_MAX + 1];
	struct credcache_set *s;

	memset(id, 'a', sizeof(id) - 1);
	id[sizeof(id) - 1] = '\0';
	s = credcache_lock(c, id);
	CHECK(credcache_slot(s, id) == NULL);
	CHECK(credcache_find(s, id) == NULL);
	credcache_unlock(s);
	credcache_free(c);
	credcache_free(NULL);
}

/*
 * Every drop in a set counts, found or not (a revocation of a key some request is reading from
 * Postgres right now, not yet cached), and only in that set; a peek finds without counting.
 */
static void drops_count_per_set(void)
{
	struct credcache *c = credcache_new(64, sizeof(struct val));
	char other[1][32];
	struct credcache_set *s, *o;
	struct credcache_stats st;
	unsigned long before;

	CHECK(c != NULL);
	/* an id of another set: the fetch lock is its set's */
	for (int i = 0; i < 10000; i++) {
		snprintf(other[0], sizeof(other[0]), "other-%d", i);
		if (credcache_fetch_lock(c, other[0]) != credcache_fetch_lock(c, "a-key"))
			break;
	}
	s = credcache_lock(c, "a-key");
	before = credcache_drops(s);
	credcache_drop(s, "a-key");	/* not cached yet */
	CHECK_INT((long long)(credcache_drops(s) - before), 1);
	((struct val *)credcache_slot(s, "a-key"))->n = 7;
	CHECK(credcache_peek(s, "a-key") != NULL);
	CHECK(credcache_peek(s, "b-key") == NULL);
	credcache_drop(s, "a-key");
	CHECK_INT((long long)(credcache_drops(s) - before), 2);
	CHECK(credcache_peek(s, "a-key") == NULL);
	credcache_unlock(s);
	o = credcache_lock(c, other[0]);
	CHECK_INT((long long)credcache_drops(o), 0);
	credcache_unlock(o);
	credcache_stats(c, &st);
	CHECK_INT((long long)(st.hits + st.misses), 0);	/* peeks count nothing */
	credcache_free(c);
}

#define THREADS 4
#define PER_THREAD 200000

struct worker {
	struct credcache *c;
	int t;
	long found;
};

/* Each thread its own 100 ids, put once and then looked up and counted up many times. */
static void *worker_main(void *arg)
{
	struct worker *w = arg;
	char id[32];

	for (int i = 0; i < PER_THREAD; i++) {
		struct credcache_set *s;
		struct val *v;

		snprintf(id, sizeof(id), "t%d-%d", w->t, i % 100);
		s = credcache_lock(w->c, id);
		if ((v = credcache_find(s, id))) {
			v->n++;
			w->found++;
		} else if ((v = credcache_slot(s, id))) {
			v->n = 1;
		}
		credcache_unlock(s);
	}
	return NULL;
}

static void threads_lose_nothing(void)
{
	struct credcache *c = credcache_new(GW_KEY_CACHE_ENTRIES, sizeof(struct val));
	struct worker w[THREADS];
	pthread_t th[THREADS];
	struct credcache_stats st;
	long total = 0;

	for (int t = 0; t < THREADS; t++) {
		w[t] = (struct worker){ .c = c, .t = t };
		CHECK(pthread_create(&th[t], NULL, worker_main, &w[t]) == 0);
	}
	for (int t = 0; t < THREADS; t++) {
		pthread_join(th[t], NULL);
		CHECK_INT(w[t].found, PER_THREAD - 100);
	}
	for (int t = 0; t < THREADS; t++)
		for (int i = 0; i < 100; i++) {
			char id[32];
			struct credcache_set *s;
			struct val *v;

			snprintf(id, sizeof(id), "t%d-%d", t, i);
			s = credcache_lock(c, id);
			v = credcache_find(s, id);
			total += v ? v->n : 0;
			credcache_unlock(s);
		}
	CHECK_INT(total, (long)THREADS * PER_THREAD);
	credcache_stats(c, &st);
	CHECK_INT((long long)st.evictions, 0);
	credcache_free(c);
}

int main(void)
{
	test_seed();
	TEST(thousand_keys_stay_cached);
	TEST(thousand_tenants_stay_cached);
	TEST(full_set_drops_least_recently_used);
	TEST(long_ids_not_cached);
	TEST(drops_count_per_set);
	TEST(threads_lose_nothing);
	return test_summary();
}
