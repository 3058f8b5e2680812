/*
 * fault.h - named fault points for the crash tests (docs/snapshots.md, "Crash safety").
 *
 * A fault point does nothing unless the process was started with it named:
 *   KILN_FAULT=<name>[,<name>...]      the process kills itself (SIGKILL) when it reaches <name>
 *   KILN_FAULT_HOLD=<name>             on reaching <name> it creates KILN_FAULT_HOLD_FILE and
 *   KILN_FAULT_HOLD_FILE=<path>        waits (at most 120 s) until that file is removed, so a
 *                                      test can change the world at that exact moment
 */
#ifndef KILN_COMMON_FAULT_H
#define KILN_COMMON_FAULT_H

void kiln_fault(const char *name);

#endif
