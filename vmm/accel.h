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

/*
 * QEMU's CPU model (-cpu) for new VMs: "host" under KVM; under TCG "Nehalem-v1", an Intel CPU
 * whose features TCG executes whole (QEMU runs it with `enforce`). QEMU's default under TCG,
 * "qemu64", is an AMD family 15 that libraries read as an Opteron with 3DNow!: Debian's OpenBLAS
 * (numpy's BLAS) then runs its Opteron kernels, whose `femms` TCG refuses as the model does not
 * offer 3DNow! (SIGILL; OpenBLAS #5831).
 */
#define ACCEL_CPU_TCG "Nehalem-v1"
#define ACCEL_CPU_TCG_LEGACY "qemu64"	/* VMs started before the model was chosen (no -cpu) */

const char *accel_cpu_model(enum accel a);

/*
 * The model of a VM recorded without one (a snapshot or record of an earlier release): what QEMU
 * ran it under then, "host" under KVM and "qemu64" under TCG.
 */
const char *accel_cpu_legacy(enum accel a);

/* True when a VM of accelerator `a` may run under model `cpu` (one of the two above). */
bool accel_cpu_valid(enum accel a, const char *cpu);

/*
 * The rate of this host's TSC in kHz, measured once per process against CLOCK_MONOTONIC (about
 * 0.15 s, at the first call). Under TCG a guest's TSC is the host's own counter, so a guest told
 * another rate keeps time at the ratio (told 2 GHz on a 2.6 GHz host, its clock ran 30 % fast):
 * the guest's kernel gets this figure (qemu_args.tsc_khz). ACCEL_TSC_KHZ_FALLBACK where it cannot
 * be measured (not x86, or a counter that does not move with time).
 */
#define ACCEL_TSC_KHZ_FALLBACK 2000000u
unsigned accel_host_tsc_khz(void);

#endif
