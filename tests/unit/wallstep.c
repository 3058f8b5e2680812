/*
 * wallstep.c - the wrapped readers of the wall clock (wallstep.h). The binary links with
 * -Wl,--wrap=clock_gettime,--wrap=time,--wrap=gettimeofday (kiln_wallstep's link options), so
 * each call to them in its objects and static libraries lands here and __real_* is libc's.
 */
#include "wallstep.h"

#include <stddef.h>
#include <sys/time.h>
#include <time.h>

static long long wall_step_ms;	/* atomic: read by every thread of the code under test */

int __real_clock_gettime(clockid_t clock, struct timespec *ts);
time_t __real_time(time_t *t);
int __real_gettimeofday(struct timeval *tv, void *tz);
int __wrap_clock_gettime(clockid_t clock, struct timespec *ts);
time_t __wrap_time(time_t *t);
int __wrap_gettimeofday(struct timeval *tv, void *tz);

int __wrap_clock_gettime(clockid_t clock, struct timespec *ts)
{
	long long step = __atomic_load_n(&wall_step_ms, __ATOMIC_RELAXED);
	int rc = __real_clock_gettime(clock, ts);
	long long ns;

	if (rc != 0 || (clock != CLOCK_REALTIME && clock != CLOCK_REALTIME_COARSE))
		return rc;
	ns = (long long)ts->tv_sec * 1000000000 + ts->tv_nsec + step * 1000000;
	ts->tv_sec = ns / 1000000000;
	ts->tv_nsec = ns % 1000000000;
	return rc;
}

time_t __wrap_time(time_t *t)
{
	time_t now = __real_time(NULL) + __atomic_load_n(&wall_step_ms, __ATOMIC_RELAXED) / 1000;

	if (t)
		*t = now;
	return now;
}

int __wrap_gettimeofday(struct timeval *tv, void *tz)
{
	long long step = __atomic_load_n(&wall_step_ms, __ATOMIC_RELAXED);
	int rc = __real_gettimeofday(tv, tz);
	long long us;

	if (rc != 0 || !tv)
		return rc;
	us = (long long)tv->tv_sec * 1000000 + tv->tv_usec + step * 1000;
	tv->tv_sec = us / 1000000;
	tv->tv_usec = us % 1000000;
	return rc;
}

void wallstep_set(long long step_ms)
{
	__atomic_store_n(&wall_step_ms, step_ms, __ATOMIC_RELAXED);
}

static long long ms_of(const struct timespec *ts)
{
	return (long long)ts->tv_sec * 1000 + ts->tv_nsec / 1000000;
}

long long wallstep_offset_ms(void)
{
	struct timespec real, stepped;

	/*
	 * The real clock first, in its own statement: read second, a millisecond turning between
	 * the two reads would make the offset one short of the step.
	 */
	__real_clock_gettime(CLOCK_REALTIME, &real);
	__wrap_clock_gettime(CLOCK_REALTIME, &stepped);
	return ms_of(&stepped) - ms_of(&real);
}
