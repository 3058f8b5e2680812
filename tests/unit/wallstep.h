/*
 * wallstep.h - a test binary's own wall clock, stepped without touching the host's: a binary that
 * links kiln_wallstep (tests/CMakeLists.txt) has every read of the wall clock in it (clock_gettime
 * of CLOCK_REALTIME and CLOCK_REALTIME_COARSE, time, gettimeofday; its own code's and the code
 * under test's alike) wrapped at link time and moved by the step set here. CLOCK_MONOTONIC and
 * the other clocks are left alone, so a timer on them must not notice a step; one on the wall
 * clock does, as it would under NTP or an operator's date(1).
 */
#ifndef KILN_WALLSTEP_H
#define KILN_WALLSTEP_H

/* Sets the process's wall clock to `step_ms` off the real one (0: the real one again). */
void wallstep_set(long long step_ms);

/* The real wall clock in ms since the epoch, whatever the step. */
long long wallstep_real_ms(void);

#endif
