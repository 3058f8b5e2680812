/*
 * clock.h - the absolute time `ms` milliseconds from now on a clock, for the deadlines of
 * pthread_cond_timedwait (CLOCK_REALTIME, or the condition's clock when it was set to another).
 */
#ifndef KILN_CLOCK_H
#define KILN_CLOCK_H

#include <time.h>

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
