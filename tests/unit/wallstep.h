/*
 * wallstep.h - a test binary's own wall clock, stepped without touching the host's: a binary that
 * links kiln_wallstep (tests/CMakeLists.txt) has its reads of the wall clock (clock_gettime of
 * CLOCK_REALTIME and CLOCK_REALTIME_COARSE, time, gettimeofday) wrapped at link time and moved by
 * the step set here. Only the calls in the binary's own objects and the static libraries it links
 * are wrapped (its own code's and the code under test's alike); the shared libraries' own reads
 * (libc's, libpq's, libcurl's, libssl's, hiredis's) are not, and see the real clock.
 * CLOCK_MONOTONIC and the other clocks are left alone, so a timer on them must not notice a step;
 * one on the wall clock does, as it would under NTP or an operator's date(1).
 */
#ifndef KILN_WALLSTEP_H
#define KILN_WALLSTEP_H

/* Sets the process's wall clock to `step_ms` off the real one (0: the real one again). */
void wallstep_set(long long step_ms);

/*
 * The stepped wall clock less the real one, in ms: the step set, plus at most the time between
 * the two reads (the real one is read first, so never less than the step).
 */
long long wallstep_offset_ms(void);

#endif
