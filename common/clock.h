/*
 * clock.h - time in milliseconds on a clock (clock_ms_of, clock_mono_ms for intervals and
 * deadlines), a condition waiting on a given clock (clock_cond_init), and the absolute time `ms`
 * milliseconds from now on a clock, for the deadlines of pthread_cond_timedwait (CLOCK_REALTIME,
 * or the condition's clock when it was set to another).
 */
#ifndef KILN_CLOCK_H
#define KILN_CLOCK_H

#include <pthread.h>
#include <time.h>

/* The time on `clock` in milliseconds (since the epoch for CLOCK_REALTIME). */
static inline long long clock_ms_of(clockid_t clock)
{
	struct timespec t;

	clock_gettime(clock, &t);
	return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/*
 * Milliseconds on CLOCK_MONOTONIC: what deadlines, timeouts and intervals are measured in, as a
 * step of the wall clock (NTP, an operator) moves none of them.
 */
static inline long long clock_mono_ms(void)
{
	return clock_ms_of(CLOCK_MONOTONIC);
}

/*
 * Makes `cond` a condition whose timed waits run on `clock` (CLOCK_MONOTONIC for intervals and
 * deadlines), their deadlines from clock_after_ms() on the same clock.
 */
static inline int clock_cond_init(pthread_cond_t *cond, clockid_t clock)
{
	pthread_condattr_t ca;
	int rc;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, clock);
	rc = pthread_cond_init(cond, &ca);
	pthread_condattr_destroy(&ca);
	return rc;
}

static inline struct timespec clock_after_ms(clockid_t clock, long long ms)
{
	struct timespec t;

	clock_gettime(clock, &t);
	t.tv_sec += (time_t)(ms / 1000);
	t.tv_nsec += (long)(ms % 1000) * 1000000L;
	if (t.tv_nsec >= 1000000000L) {
		t.tv_sec++;
		t.tv_nsec -= 1000000000L;
	}
	return t;
}

#endif
