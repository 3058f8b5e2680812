/*
 * qemu.h - the QEMU driver's command line, apart from the driver so it can be tested alone.
 * The driver itself is `hv_qemu_ops` (hv.h).
 */
#ifndef KILN_VMM_QEMU_H
#define KILN_VMM_QEMU_H

#include <stdbool.h>
#include <sys/types.h>

#include "vmm/accel.h"

#define QEMU_BINARY_DEFAULT "/usr/bin/qemu-system-x86_64"

/* Everything the command line is made of. Paths are as QEMU opens them (before its chroot). */
struct qemu_args {
	const char *binary;
	enum accel accel;
	unsigned tb_size_mib;	/* TCG only; 0 = ACCEL_TB_SIZE_DEFAULT */
	unsigned tsc_khz;	/* TCG only: the TSC rate the guest is told (accel_host_tsc_khz);
				 * 0 = ACCEL_TSC_KHZ_FALLBACK */
	const char *cpu;	/* -cpu model (accel_cpu_valid), or NULL for accel_cpu_model() */
	unsigned vcpus;		/* whole vCPUs */
	unsigned mem_mib;
	const char *mem_path;	/* memory-backend-file */
	bool mem_share;		/* share=on (own memory) or share=off (private copy-on-write map) */
	const char *kernel;
	const char *initrd;	/* or NULL */
	const char *cmdline_extra;	/* or NULL */
	const char *disk;	/* qcow2 overlay, or NULL */
	const char *tap;	/* TAP name in the VMM's netns, or NULL */
	bool balloon;		/* virtio-balloon with free page reporting (docs/vmm.md) */
	const char *qmp_sock;
	const char *agent_sock;
	const char *serial_sock;	/* the guest console (ttyS0): a socket kiln-node drains */
	unsigned disk_iops;	/* throttle group of the disk: ops/s, 0 = none */
	unsigned long long disk_bps;	/* bytes/s, 0 = none */
	const char *chroot;	/* QEMU chroots here once set up, or NULL */
	uid_t uid;		/* and drops to this uid/gid (-runas); 0 = stays */
	gid_t gid;
	bool incoming;		/* wait for migrate-incoming (-incoming defer, -S) */
};

/*
 * Builds the NULL-terminated argv for `a` into *argv; the caller frees it with qemu_argv_free().
 * Returns 0, -ENOMEM or -EINVAL (a path containing a comma, which QEMU's option syntax would split).
 */
int qemu_argv_build(const struct qemu_args *a, char ***argv);

/*
 * Writes to `dst` the head of the x86 bzImage `kernel`: its boot sector, setup header and setup
 * code and one page after them, all QEMU reads to accept it. A restore's QEMU loads that instead of
 * the whole kernel, which its guest (memory from the snapshot) never boots. Returns 0, -ENOEXEC if
 * `kernel` is not a bzImage, or -errno.
 */
int qemu_kernel_head(const char *kernel, const char *dst);

/* Frees an argv from qemu_argv_build. Accepts NULL. */
void qemu_argv_free(char **argv);

#endif
