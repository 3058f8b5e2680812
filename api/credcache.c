/*
 * credcache.c - a set-associative cache with a lock per set (see credcache.h).
 *
 * A set is its two locks, its counters and its ways' hashes and use stamps; the ids and the
 * values of a set's ways sit together in two arrays beside the sets. Finding an id compares the
 * set's hashes (one cache line) and the id only on a match.
 */
#include "credcache.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct credcache_set {
	pthread_mutex_t lock;		/* the ways, their values and the counters */
	pthread_mutex_t fetching;	/* held by the one reading an entry of this set */
	struct credcache *c;
	unsigned char *values;		/* CREDCACHE_WAYS values of the cache's value_size */
	char (*ids)[CREDCACHE_ID_MAX];	/* CREDCACHE_WAYS ids; "" for an empty way */
	unsigned long long stamp;	/* the last use stamp given out */
	unsigned long long hits, misses, evictions;
	unsigned long drops;		/* credcache_drop calls, found or not */
	uint32_t hash[CREDCACHE_WAYS];	/* of each way's id */
	unsigned long long used[CREDCACHE_WAYS];	/* the stamp of its last find or fill */
} __attribute__((aligned(64)));

struct credcache {
	size_t nsets;			/* a power of two */
	size_t value_size;
	struct credcache_set *sets;
	unsigned char *values;
	char (*ids)[CREDCACHE_ID_MAX];
};

static uint32_t hash_of(const char *s)
{
	uint32_t h = 2166136261u;

	while (*s)
		h = (h ^ (unsigned char)*s++) * 16777619u;
	return h;
}

struct credcache *credcache_new(size_t entries, size_t value_size)
{
	struct credcache *c = calloc(1, sizeof(*c));
	size_t n = 1;

	if (!c)
		return NULL;
	while (n * CREDCACHE_WAYS < entries)
		n *= 2;
	c->nsets = n;
	c->value_size = value_size;
	c->sets = aligned_alloc(64, n * sizeof(*c->sets));
	c->values = calloc(n * CREDCACHE_WAYS, value_size ? value_size : 1);
	c->ids = calloc(n * CREDCACHE_WAYS, sizeof(*c->ids));
	if (!c->sets || !c->values || !c->ids) {
		free(c->sets);
		free(c->values);
		free(c->ids);
		free(c);
		return NULL;
	}
	memset(c->sets, 0, n * sizeof(*c->sets));
	for (size_t i = 0; i < n; i++) {
		pthread_mutex_init(&c->sets[i].lock, NULL);
		pthread_mutex_init(&c->sets[i].fetching, NULL);
		c->sets[i].c = c;
		c->sets[i].values = c->values + i * CREDCACHE_WAYS * value_size;
		c->sets[i].ids = c->ids + i * CREDCACHE_WAYS;
	}
	return c;
}

void credcache_free(struct credcache *c)
{
	if (!c)
		return;
	for (size_t i = 0; i < c->nsets; i++) {
		pthread_mutex_destroy(&c->sets[i].lock);
		pthread_mutex_destroy(&c->sets[i].fetching);
	}
	free(c->sets);
	free(c->values);
	free(c->ids);
	free(c);
}

/* The set of hash `h`: the hash's high bits after a multiply, so every bit of it counts. */
static struct credcache_set *set_of(struct credcache *c, uint32_t h)
{
	return &c->sets[(((uint64_t)h * 0x9e3779b97f4a7c15ull) >> 32) & (c->nsets - 1)];
}

struct credcache_set *credcache_lock(struct credcache *c, const char *id)
{
	struct credcache_set *s = set_of(c, hash_of(id));

	pthread_mutex_lock(&s->lock);
	return s;
}

void credcache_unlock(struct credcache_set *s)
{
	pthread_mutex_unlock(&s->lock);
}

pthread_mutex_t *credcache_fetch_lock(struct credcache *c, const char *id)
{
	return &set_of(c, hash_of(id))->fetching;
}

static void *value_of(struct credcache_set *s, size_t i)
{
	return s->values + i * s->c->value_size;
}

/* The way holding `id` (hash `h`), or CREDCACHE_WAYS. */
static size_t way_of(const struct credcache_set *s, const char *id, uint32_t h)
{
	for (size_t i = 0; i < CREDCACHE_WAYS; i++)
		if (s->hash[i] == h && s->ids[i][0] && strcmp(s->ids[i], id) == 0)
			return i;
	return CREDCACHE_WAYS;
}

void *credcache_peek(struct credcache_set *s, const char *id)
{
	size_t i = way_of(s, id, hash_of(id));

	return i == CREDCACHE_WAYS ? NULL : value_of(s, i);
}

void *credcache_find(struct credcache_set *s, const char *id)
{
	size_t i = way_of(s, id, hash_of(id));

	if (i == CREDCACHE_WAYS) {
		s->misses++;
		return NULL;
	}
	s->hits++;
	s->used[i] = ++s->stamp;
	return value_of(s, i);
}

void *credcache_slot(struct credcache_set *s, const char *id)
{
	uint32_t h = hash_of(id);
	size_t i = way_of(s, id, h), len = strlen(id);

	if (len >= CREDCACHE_ID_MAX || len == 0)
		return NULL;
	if (i == CREDCACHE_WAYS) {
		size_t oldest = 0;

		for (i = 0; i < CREDCACHE_WAYS && s->ids[i][0]; i++)
			if (s->used[i] < s->used[oldest])
				oldest = i;
		if (i == CREDCACHE_WAYS) {	/* full: the least recently used goes */
			i = oldest;
			s->evictions++;
		}
		s->hash[i] = h;
		memcpy(s->ids[i], id, len + 1);
		memset(value_of(s, i), 0, s->c->value_size);
	}
	s->used[i] = ++s->stamp;
	return value_of(s, i);
}

void credcache_drop(struct credcache_set *s, const char *id)
{
	size_t i = way_of(s, id, hash_of(id));

	s->drops++;
	if (i == CREDCACHE_WAYS)
		return;
	s->ids[i][0] = '\0';
	s->hash[i] = 0;
	s->used[i] = 0;
	memset(value_of(s, i), 0, s->c->value_size);
}

unsigned long credcache_drops(const struct credcache_set *s)
{
	return s->drops;
}

void credcache_stats(struct credcache *c, struct credcache_stats *out)
{
	memset(out, 0, sizeof(*out));
	for (size_t i = 0; i < c->nsets; i++) {
		struct credcache_set *s = &c->sets[i];

		pthread_mutex_lock(&s->lock);
		out->hits += s->hits;
		out->misses += s->misses;
		out->evictions += s->evictions;
		for (size_t w = 0; w < CREDCACHE_WAYS; w++)
			out->entries += s->ids[w][0] != '\0';
		pthread_mutex_unlock(&s->lock);
	}
}
