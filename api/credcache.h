/*
 * credcache.h - a set-associative cache of fixed-size entries named by a string id, with a lock
 * per set: the gateway's caches of API key rows and of tenants' suspension (api/authn.c).
 *
 * An id's hash picks its set of CREDCACHE_WAYS entries; a full set drops its least recently used
 * entry. Each set has its own lock, held only while its entries are compared or copied, and its
 * own fetch lock, which the caller holds while it reads an entry of that set from Postgres (so one
 * request reads a missing entry and the others wait for its answer). Entries carry no age rule of
 * their own: the caller keeps its fetch time in the entry and decides what is fresh.
 *
 * Use: s = credcache_lock(c, id); then credcache_find / credcache_slot / credcache_drop on s;
 * then credcache_unlock(s). Nothing found through s may be used after the unlock (copy it out).
 */
#ifndef KILN_CREDCACHE_H
#define KILN_CREDCACHE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

#ifndef CREDCACHE_WAYS	/* a test builds it direct-mapped (1) to compare */
#define CREDCACHE_WAYS 16
#endif
#define CREDCACHE_ID_MAX 128	/* bytes of an id, terminator included; longer ids (and "") are never cached */

struct credcache;
struct credcache_set;

struct credcache_stats {
	unsigned long long hits;	/* credcache_find found the id */
	unsigned long long misses;	/* credcache_find did not */
	unsigned long long evictions;	/* credcache_slot dropped another id's entry for this one */
	unsigned long long entries;	/* entries held now */
};

/*
 * A cache of at least `entries` entries (rounded up to a power of two of sets of CREDCACHE_WAYS)
 * of `value_size` bytes each, all empty; NULL when out of memory. credcache_free() frees it.
 */
struct credcache *credcache_new(size_t entries, size_t value_size);
void credcache_free(struct credcache *c);	/* accepts NULL */

/* Locks the set of `id` and returns it; credcache_unlock() releases it. */
struct credcache_set *credcache_lock(struct credcache *c, const char *id);
void credcache_unlock(struct credcache_set *s);

/*
 * The fetch lock of the set of `id`: the caller holds it (lock or trylock) while it reads an entry
 * of that set from its source, never while it holds the set's lock.
 */
pthread_mutex_t *credcache_fetch_lock(struct credcache *c, const char *id);

/* In the locked set: the value of `id`, marked as just used, or NULL (a hit or a miss counted). */
void *credcache_find(struct credcache_set *s, const char *id);
/* The same, neither marked nor counted: for a second look by one who already found or filled it. */
void *credcache_peek(struct credcache_set *s, const char *id);

/*
 * In the locked set: the value for `id` to fill in: its own entry when there is one (as it is),
 * else an empty one, else the least recently used one (an eviction, counted), each zeroed and
 * named `id`; marked as just used. NULL only when `id` is too long to cache, or empty.
 */
void *credcache_slot(struct credcache_set *s, const char *id);

/* In the locked set: empties the entry of `id`, if any, and counts a drop either way. */
void credcache_drop(struct credcache_set *s, const char *id);
/*
 * In the locked set: its drops so far. A caller that read a value from its source notes this
 * before the read and fills the value in only if it is unchanged, so that a drop (a revocation)
 * made while it read is never undone by an answer from before it.
 */
unsigned long credcache_drops(const struct credcache_set *s);

/* Sums the counters over every set (taking each set's lock in turn). */
void credcache_stats(struct credcache *c, struct credcache_stats *out);

#endif
