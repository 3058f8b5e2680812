/*
 * accel.h - choosing QEMU's accelerator: KVM only where the CPU offers hardware virtualisation
 * (vmx or svm among /proc/cpuinfo's flags) and /dev/kvm opens; TCG software emulation otherwise.
 * A /dev/kvm that exists without vmx/svm (nested PVM) hangs ordinary guests, so it does not count.
 */
#ifndef KILN_VMM_ACCEL_H
#define KILN_VMM_ACCEL_H

#include <stdbool.h>
#include <stddef.h>

enum accel { ACCEL_TCG = 0, ACCEL_KVM };

#define ACCEL_TB_SIZE_DEFAULT 64	/* MiB of TCG translation cache (QEMU 7.2's default is 1 GiB) */

/* True when a "flags" line of `cpuinfo` (the text of /proc/cpuinfo) names vmx or svm. */
bool accel_cpuinfo_has_hwvirt(const char *cpuinfo);

/* Detects the accelerator of this host (reads /proc/cpuinfo, opens /dev/kvm). */
enum accel accel_detect(void);

/* "kvm" or "tcg". */
const char *accel_name(enum accel a);

/*
 * Writes the value of QEMU's -accel option into `out`: "kvm" or "tcg,tb-size=N" (N in MiB, 0 for
 * ACCEL_TB_SIZE_DEFAULT). Returns 0 or -ENOSPC.
 */
int accel_qemu_arg(enum accel a, unsigned tb_size_mib, char *out, size_t outlen);

#endif
