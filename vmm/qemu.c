/*
 * qemu.c - the QEMU driver: `qemu-system-x86_64 -M microvm` in the jail, driven over QMP.
 *
 * Files of one VM (docs/vmm.md):
 *   <run_dir>/qmp.sock, agent.sock,   Unix sockets, created by QEMU as root before it drops to the
 *   serial.sock                       VM's uid; reached by kiln-node from outside the chroot
 *   <run_dir>/qemu.log                QEMU's own stderr
 *   <state_dir>/serial.log(.old)      guest console, drained from serial.sock, capped (hv.h)
 *   <run_dir>/jail/                   QEMU's chroot and working directory; mount points kernel,
 *                                     initrd, mem, disk and the disk chain (base, layer1..N),
 *                                     which QEMU names relative to it (jail.h says why)
 *   <state_dir>/disk.qcow2            the VM's disk layer
 *   <state_dir>/vm.json               what a later run of the node needs to take the VM over
 *                                     (qemu_adopt): paths, disk chain, memory file, pid
 *   <mem_dir>/kiln-<node>-<id>.mem    guest RAM (memory-backend-file, share=on) unless the VM maps
 *                                     a snapshot's image privately
 * A snapshot directory holds: manifest.json, state (migration stream), mem (memory image, shared
 * mode), disk.qcow2 (the frozen disk layer). docs/vmm.md explains the life of memory files.
 */
#include "common/fsutil.h"
#include "vmm/qemu.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/fault.h"
#include "common/log.h"
#include "vmm/accel.h"
#include "vmm/cgroup.h"
#include "vmm/disk.h"
#include "vmm/hv.h"
#include "vmm/hv_base.h"
#include "vmm/jail.h"
#include "vmm/qemu_memro.h"
#include "vmm/qmp.h"

#define QMP_CONNECT_MS 10000	/* QEMU start to QMP greeting (TCG, loaded host) */
#define QMP_CMD_MS 5000
#define MIGRATE_MS 120000	/* a full snapshot of a large guest */
#define SNAP_FORMAT 1
#define QEMU_PIDS_MAX 256	/* threads of one QEMU: vCPUs, I/O, RCU, workers */
#define RECORD_NAME "vm.json"

/* ---- command line ---- */

struct argv_b {
	char **v;
	size_t n, cap;
	int err;
};

static void arg_add(struct argv_b *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void arg_add(struct argv_b *b, const char *fmt, ...)
{
	va_list ap;
	char *s;

	if (b->err)
		return;
	if (b->n + 2 > b->cap) {
		size_t cap = b->cap ? b->cap * 2 : 64;
		char **v = realloc(b->v, cap * sizeof(*v));

		if (!v) {
			b->err = -ENOMEM;
			return;
		}
		b->v = v;
		b->cap = cap;
	}
	va_start(ap, fmt);
	if (vasprintf(&s, fmt, ap) < 0) {
		b->err = -ENOMEM;
		s = NULL;
	}
	va_end(ap);
	if (s) {
		b->v[b->n++] = s;
		b->v[b->n] = NULL;
	}
}

static bool has_comma(const char *s)
{
	return s && strchr(s, ',');
}

int qemu_argv_build(const struct qemu_args *a, char ***argv)
{
	struct argv_b b = { 0 };
	char accel[64], tcg[128] = "";
	const char *paths[] = { a->mem_path, a->kernel, a->initrd, a->disk, a->qmp_sock, a->agent_sock,
				a->serial_sock, a->chroot, a->tap };

	*argv = NULL;
	for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++)
		if (has_comma(paths[i]))
			return -EINVAL;
	if (accel_qemu_arg(a->accel, a->tb_size_mib, accel, sizeof(accel)) < 0 ||
	    (a->cpu && !accel_cpu_valid(a->accel, a->cpu)))
		return -EINVAL;

	arg_add(&b, "%s", a->binary ? a->binary : QEMU_BINARY_DEFAULT);
	arg_add(&b, "-M");
	arg_add(&b, "microvm,memory-backend=mem");
	arg_add(&b, "-accel");
	arg_add(&b, "%s", accel);
	/* under TCG, `enforce`: QEMU refuses to start rather than offer a feature TCG lacks */
	arg_add(&b, "-cpu");
	arg_add(&b, "%s%s", a->cpu ? a->cpu : accel_cpu_model(a->accel), a->accel == ACCEL_TCG ? ",enforce" : "");
	arg_add(&b, "-smp");
	arg_add(&b, "%u", a->vcpus);
	arg_add(&b, "-m");
	arg_add(&b, "%uM", a->mem_mib);
	arg_add(&b, "-object");
	arg_add(&b, "memory-backend-file,id=mem,size=%uM,mem-path=%s,share=%s", a->mem_mib, a->mem_path,
		a->mem_share ? "on" : "off");
	arg_add(&b, "-nodefaults");
	arg_add(&b, "-no-user-config");
	arg_add(&b, "-display");
	arg_add(&b, "none");
	arg_add(&b, "-no-reboot");
	/*
	 * The console is a socket the node drains into a capped file (hv_console_start): a chardev
	 * file would let the guest grow host storage without end. Unread, QEMU drops the bytes.
	 */
	arg_add(&b, "-chardev");
	arg_add(&b, "socket,id=serial,path=%s,server=on,wait=off", a->serial_sock);
	arg_add(&b, "-serial");
	arg_add(&b, "chardev:serial");
	arg_add(&b, "-kernel");
	arg_add(&b, "%s", a->kernel);
	if (a->initrd) {
		arg_add(&b, "-initrd");
		arg_add(&b, "%s", a->initrd);
	}
	arg_add(&b, "-append");
	/*
	 * Under TCG the kernel may fail to calibrate the TSC against the PIT and hang: give it numbers,
	 * the host's TSC rate (the guest's TSC is the host's counter under TCG: told another rate,
	 * its clock keeps time at the ratio).
	 * And no speculation mitigations: on an Intel model the kernel would isolate its page tables
	 * (PTI), and each CR3 switch flushes TCG's software TLB (boot and fork-heavy work twice as
	 * slow). They guard a CPU's hardware user/kernel boundary, which TCG's guest does not run on
	 * (QEMU's software MMU checks every access), inside a guest whose user is root anyway.
	 */
	if (a->accel == ACCEL_TCG)
		snprintf(tcg, sizeof(tcg), " lpj=4000000 tsc_early_khz=%u tsc=reliable mitigations=off",
			 a->tsc_khz ? a->tsc_khz : ACCEL_TSC_KHZ_FALLBACK);
	arg_add(&b, "console=ttyS0 reboot=t panic=-1 quiet%s%s%s", tcg,
		a->cmdline_extra ? " " : "", a->cmdline_extra ? a->cmdline_extra : "");
	arg_add(&b, "-chardev");
	arg_add(&b, "socket,id=qmp,path=%s,server=on,wait=off", a->qmp_sock);
	arg_add(&b, "-mon");
	arg_add(&b, "chardev=qmp,mode=control");
	arg_add(&b, "-device");
	arg_add(&b, "virtio-serial-device");
	arg_add(&b, "-chardev");
	arg_add(&b, "socket,id=agent,path=%s,server=on,wait=off", a->agent_sock);
	arg_add(&b, "-device");
	arg_add(&b, "virtserialport,chardev=agent,name=kiln.agent");
	if (a->disk && (a->disk_iops || a->disk_bps)) {
		/*
		 * QEMU's block layer throttles what cgroup v1 blkio cannot: its buffered writeback. A
		 * -drive joins its group only when it names limits of its own too (blockdev_init), so
		 * the drive carries the same limits as the group.
		 */
		char iops[40] = "", bps[48] = "", d_iops[48] = "", d_bps[56] = "";

		if (a->disk_iops) {
			snprintf(iops, sizeof(iops), ",x-iops-total=%u", a->disk_iops);
			snprintf(d_iops, sizeof(d_iops), ",throttling.iops-total=%u", a->disk_iops);
		}
		if (a->disk_bps) {
			snprintf(bps, sizeof(bps), ",x-bps-total=%llu", a->disk_bps);
			snprintf(d_bps, sizeof(d_bps), ",throttling.bps-total=%llu", a->disk_bps);
		}
		arg_add(&b, "-object");
		arg_add(&b, "throttle-group,id=io0%s%s", iops, bps);
		arg_add(&b, "-drive");
		arg_add(&b, "id=root,file=%s,format=qcow2,if=none,discard=unmap,throttling.group=io0%s%s",
			a->disk, d_iops, d_bps);
	} else if (a->disk) {
		arg_add(&b, "-drive");
		arg_add(&b, "id=root,file=%s,format=qcow2,if=none,discard=unmap", a->disk);
	}
	if (a->disk) {
		arg_add(&b, "-device");
		arg_add(&b, "virtio-blk-device,drive=root");
	}
	if (a->tap) {
		arg_add(&b, "-netdev");
		arg_add(&b, "tap,id=n0,ifname=%s,script=no,downscript=no", a->tap);
		arg_add(&b, "-device");
		arg_add(&b, "virtio-net-device,netdev=n0,mac=%s", VMM_GUEST_MAC);
	}
	/* last on the bus: the devices before it keep their places with or without it */
	if (a->balloon) {
		arg_add(&b, "-device");
		arg_add(&b, "virtio-balloon-device,free-page-reporting=on");
	}
	/* elevateprivileges=deny would kill QEMU: -runas changes uid after the filter is in place */
	arg_add(&b, "-sandbox");
	arg_add(&b, "on,obsolete=deny,spawn=deny,resourcecontrol=deny");
	if (a->uid) {
		arg_add(&b, "-runas");
		arg_add(&b, "%u:%u", (unsigned)a->uid, (unsigned)a->gid);
	}
	if (a->chroot) {
		arg_add(&b, "-chroot");
		arg_add(&b, "%s", a->chroot);
	}
	if (a->incoming) {
		arg_add(&b, "-S");
		arg_add(&b, "-incoming");
		arg_add(&b, "defer");
	}
	if (b.err) {
		qemu_argv_free(b.v);
		return b.err;
	}
	*argv = b.v;
	return 0;
}

void qemu_argv_free(char **argv)
{
	if (!argv)
		return;
	for (char **p = argv; *p; p++)
		free(*p);
	free(argv);
}

/*
 * Linux's x86 boot protocol: the setup header's signature "HdrS" at 0x202, the number of 512-byte
 * setup sectors at 0x1f1 (0 meaning 4) after the boot sector. QEMU reads the first 8 KiB and the
 * setup; one page of the kernel proper follows them in the head.
 */
#define BOOT_SIG_OFF 0x202
#define BOOT_SETUP_SECTS_OFF 0x1f1
#define KERNEL_HEAD_TAIL 4096

int qemu_kernel_head(const char *kernel, const char *dst)
{
	unsigned char hdr[BOOT_SIG_OFF + 4];
	unsigned char *buf = NULL;
	size_t len = 0;
	ssize_t n;
	int in, out = -1, r = 0;

	unlink(dst);
	in = open(kernel, O_RDONLY | O_CLOEXEC);
	if (in < 0)
		return -errno;
	n = pread(in, hdr, sizeof(hdr), 0);
	if (n != (ssize_t)sizeof(hdr) || memcmp(hdr + BOOT_SIG_OFF, "HdrS", 4) != 0) {
		r = n < 0 ? -errno : -ENOEXEC;
		goto out;
	}
	len = ((size_t)(hdr[BOOT_SETUP_SECTS_OFF] ? hdr[BOOT_SETUP_SECTS_OFF] : 4) + 1) * 512 + KERNEL_HEAD_TAIL;
	len = len < 8192 ? 8192 : len;
	buf = malloc(len);
	if (!buf) {
		r = -ENOMEM;
		goto out;
	}
	n = pread(in, buf, len, 0);
	if (n != (ssize_t)len) {	/* shorter than its own setup: not a kernel to cut */
		r = n < 0 ? -errno : -ENOEXEC;
		goto out;
	}
	out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
	if (out < 0 || (n = write(out, buf, len)) < 0)
		r = -errno;
	else if (n != (ssize_t)len)
		r = -ENOSPC;
	if (out >= 0 && close(out) < 0 && r == 0)
		r = -errno;
	if (r < 0)
		unlink(dst);
out:
	free(buf);
	close(in);
	return r;
}

/* ---- the driver ---- */

struct hv_vm {
	char id[VMM_ID_MAX + 1];
	char node[VMM_ID_MAX + 1];
	unsigned vcpus, vcpu_milli, mem_mib;
	enum accel accel;
	char cpu[16];		/* QEMU's CPU model: accel_cpu_model(), or a snapshot's or record's */
	char run_dir[PATH_MAX], state_dir[PATH_MAX];
	char qmp_path[PATH_MAX], agent_path[PATH_MAX], serial_path[PATH_MAX], log_path[PATH_MAX];
	char serial_sock[PATH_MAX], serial_old[PATH_MAX];
	unsigned long long console_max;	/* bytes of console kept (hv_console_start) */
	struct hv_console *console;	/* the drain of the running VMM's console, or NULL */
	char jail_root[PATH_MAX];
	char mp_kernel[PATH_MAX], mp_initrd[PATH_MAX], mp_disk[PATH_MAX], mp_mem[PATH_MAX];
	char kernel[PATH_MAX], initrd[PATH_MAX];	/* host paths ("" for no initrd) */
	char kernel_head[PATH_MAX];	/* <run_dir>/kernel.head: what a restore's QEMU loads instead */
	char disk_path[PATH_MAX];	/* "" for no disk */
	char chain[DISK_CHAIN_MAX + 1][PATH_MAX];	/* frozen layers under disk, host paths:
							   [0] the raw base, [k] "layer<k>" */
	char mp_chain[DISK_CHAIN_MAX + 1][PATH_MAX];	/* their mount points in the jail */
	unsigned depth;		/* frozen qcow2 layers between base and disk */
	char mem_path[PATH_MAX];	/* memory file this VM maps */
	bool mem_owned;		/* mem_path is this VM's own (share=on), removed on destroy */
	bool balloon;		/* has the free page reporting balloon (a restore: as its snapshot) */
	bool has_net;
	struct jail jail;
	struct cg *cg;
	struct qmp *qmp;
	struct hv_proc proc;	/* the QEMU process: our child, or (taken over from an earlier run
				   of the node) a process held by its pidfd */
	unsigned long long start_ticks;	/* the process's start time, against a reused pid */
	char hv_version[32];
	char record_path[PATH_MAX];
	/* a restore begun and not ended (qemu_restore_begin): QEMU waits for the state */
	struct {
		bool on;
		int fd;			/* the snapshot's state */
		struct disk_copy copy;	/* the memory image's copy, when one runs */
		char mem_src[PATH_MAX];
		uint64_t snap_disk;	/* the snapshot's disk size, bytes */
		unsigned disk_gib;	/* the spec's */
		uid_t uid;		/* the spec's: QEMU's and its files' */
	} pend;
};

/* Fills the handle's names and paths from the spec. */
static enum kiln_err vm_init(struct hv_vm *vm, const struct vmm_spec *s, struct kiln_error *err)
{
	const char *mem_dir = s->mem_dir ? s->mem_dir : "/dev/shm";
	bool ok = true;

	snprintf(vm->id, sizeof(vm->id), "%s", s->id);
	snprintf(vm->node, sizeof(vm->node), "%s", s->node);
	vm->vcpu_milli = s->vcpu_milli;
	vm->vcpus = vmm_vcpus_whole(s->vcpu_milli);
	vm->mem_mib = s->mem_mib;
	vm->accel = accel_detect();
	snprintf(vm->cpu, sizeof(vm->cpu), "%s", accel_cpu_model(vm->accel));
	hv_proc_init(&vm->proc);
	vm->has_net = s->netns_path != NULL;
	vm->balloon = s->free_page_reporting;
	ok &= fs_path(vm->run_dir, "%s", s->run_dir);
	ok &= fs_path(vm->state_dir, "%s", s->state_dir);
	ok &= fs_path(vm->qmp_path, "%s/qmp.sock", s->run_dir);
	ok &= fs_path(vm->agent_path, "%s/agent.sock", s->run_dir);
	ok &= fs_path(vm->serial_sock, "%s/serial.sock", s->run_dir);
	ok &= fs_path(vm->serial_path, "%s/serial.log", s->state_dir);
	ok &= fs_path(vm->serial_old, "%s/serial.log.old", s->state_dir);
	vm->console_max = s->console_max ? s->console_max : VMM_CONSOLE_MAX_DEFAULT;
	ok &= fs_path(vm->log_path, "%s/qemu.log", s->run_dir);
	ok &= fs_path(vm->kernel_head, "%s/kernel.head", s->run_dir);
	ok &= fs_path(vm->record_path, "%s/" RECORD_NAME, s->state_dir);
	ok &= fs_path(vm->jail_root, "%s/jail", s->run_dir);
	ok &= fs_path(vm->mp_kernel, "%s/jail/kernel", s->run_dir);
	ok &= fs_path(vm->mp_initrd, "%s/jail/initrd", s->run_dir);
	ok &= fs_path(vm->mp_disk, "%s/jail/disk", s->run_dir);
	ok &= fs_path(vm->mp_mem, "%s/jail/mem", s->run_dir);
	for (unsigned k = 0; k <= DISK_CHAIN_MAX; k++) {
		char name[16];

		disk_layer_name(k, name, sizeof(name));
		ok &= fs_path(vm->mp_chain[k], "%s/jail/%s", s->run_dir, name);
	}
	ok &= fs_path(vm->kernel, "%s", s->kernel);
	ok &= fs_path(vm->initrd, "%s", s->initrd ? s->initrd : "");
	ok &= fs_path(vm->mem_path, "%s/kiln-%s-%s.mem", mem_dir, s->node, s->id);
	if (s->rootfs) {
		ok &= fs_path(vm->disk_path, "%s/disk.qcow2", s->state_dir);
		ok &= fs_path(vm->chain[0], "%s", s->rootfs);
	}
	if (!ok)
		return kiln_error_set(err, KILN_E_INVALID, "a path of vm '%s' is too long", s->id);
	if (strlen(vm->agent_path) > 107 || strlen(vm->qmp_path) > 107 || strlen(vm->serial_sock) > 107)
		return kiln_error_set(err, KILN_E_INVALID, "run_dir '%s' too long for a unix socket", s->run_dir);
	return KILN_OK;
}

/* Creates the VM's own memory file, `mem_mib` MiB of holes. */
static int mem_file_create(const char *path, unsigned mem_mib)
{
	int fd, r = 0;

	unlink(path);
	fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)mem_mib << 20) < 0)
		r = -errno;
	close(fd);
	return r;
}

/* The last line QEMU wrote to its log (its error messages go there), or "" (per-thread buffer). */
static const char *qemu_log_tail(const struct hv_vm *vm)
{
	return hv_base_log_tail(vm->log_path);
}

#ifndef MFD_EXEC
#define MFD_EXEC 0x0010U	/* executable memfd (Linux 6.3), for a host whose default is not */
#endif

static pthread_mutex_t memro_lock = PTHREAD_MUTEX_INITIALIZER;
static int memro_fd = -1;

/* The preload of qemu_memro.c in a sealed memfd above stdio (close-on-exec: jail keep_fd). */
static int memro_make(void)
{
	const unsigned char *p = kiln_memro_so;
	int fd, fd3, r;

	fd = memfd_create("kiln-qemu-memro", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_EXEC);
	if (fd < 0 && errno == EINVAL)	/* a kernel before 6.3: every memfd is executable */
		fd = memfd_create("kiln-qemu-memro", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -errno;
	/* never 0 to 2, which the jail gives the VMM's stdio (a node started with one closed) */
	if ((fd3 = fcntl(fd, F_DUPFD_CLOEXEC, 3)) < 0) {
		r = -errno;
		close(fd);
		return r;
	}
	close(fd);
	fd = fd3;
	while (p < kiln_memro_so_end) {
		ssize_t n = write(fd, p, (size_t)(kiln_memro_so_end - p));

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			r = n < 0 ? -errno : -EIO;
			close(fd);
			return r;
		}
		p += n;
	}
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) < 0) {
		r = -errno;
		close(fd);
		return r;
	}
	return fd;
}

/*
 * The descriptor of the preload a QEMU that maps a shared memory image privately is started
 * with (qemu_memro.c: the image opened read-only, the balloon's discards kept out of it), made
 * once per process and kept; a failure is tried again at the next call. KILN_E_UNAVAILABLE when
 * it cannot be made: a create from a template then boots cold and keeps the template.
 */
static enum kiln_err memro_get(int *fd, struct kiln_error *err)
{
	int r = -EIO;

	pthread_mutex_lock(&memro_lock);
	if (memro_fd < 0 && (r = memro_make()) >= 0)
		memro_fd = r;
	*fd = memro_fd;
	pthread_mutex_unlock(&memro_lock);
	if (*fd >= 0)
		return KILN_OK;
	/* vm.memfd_noexec = 2 refuses an executable memfd, which ld.so must map */
	return kiln_error_set(err, KILN_E_UNAVAILABLE, "the QEMU preload's memfd: %s%s", strerror(-r),
			      r == -EACCES ? " (the host's vm.memfd_noexec must be 0 or 1)" : "");
}

/*
 * The VM's jail: its root and the files bound into it. `kernel` is the file bound as the kernel:
 * vm->kernel, or for a restore its head (qemu_kernel_head), with no initramfs. A memory image the
 * VM maps privately is shared with every other VM mapping it: bound read-only.
 */
static void jail_layout(struct hv_vm *vm, const char *kernel)
{
	struct jail *j = &vm->jail;

	memset(j, 0, sizeof(*j));
	j->root = vm->jail_root;
	j->netns_fd = -1;
	j->out_fd = -1;
	j->keep_fd = -1;
	j->cg = vm->cg;
	j->mounts[j->n_mounts++] = (struct jail_mount){ kernel, vm->mp_kernel, true };
	if (vm->initrd[0] && kernel == vm->kernel)
		j->mounts[j->n_mounts++] = (struct jail_mount){ vm->initrd, vm->mp_initrd, true };
	if (vm->disk_path[0]) {
		j->mounts[j->n_mounts++] = (struct jail_mount){ vm->disk_path, vm->mp_disk, false };
		for (unsigned k = 0; k <= vm->depth; k++)
			j->mounts[j->n_mounts++] = (struct jail_mount){ vm->chain[k], vm->mp_chain[k], true };
	}
	j->mounts[j->n_mounts++] = (struct jail_mount){ vm->mem_path, vm->mp_mem, !vm->mem_owned };
}

/* The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks); 0 if unknown. */
static unsigned long long proc_start_ticks(pid_t pid)
{
	char path[64], buf[1024], *p;
	unsigned long long v = 0;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	if (fs_read_small(path, buf, sizeof(buf)) <= 0)
		return 0;
	p = strrchr(buf, ')');
	/* after the command name: the state is field 3, the start time field 22 */
	for (int field = 2; p && field < 22; field++)
		p = strchr(p + 1, ' ');
	if (p)
		v = strtoull(p + 1, NULL, 10);
	return v;
}

/*
 * Writes vm.json: everything qemu_adopt needs to take this VM over, as it was started. It stays as
 * it is during a snapshot, so a snapshot cut short still finds where its files came from.
 */
static int record_write(const struct hv_vm *vm)
{
	json_t *m, *chain = json_array();
	int r;

	for (unsigned k = 0; chain && vm->disk_path[0] && k <= vm->depth; k++)
		json_array_append_new(chain, json_string(vm->chain[k]));
	m = json_pack("{s:s, s:s, s:i, s:i, s:s, s:s, s:s, s:s, s:o?, s:s, s:b, s:b, s:b, s:i, s:I, s:s, s:I, s:s}",
		      "id", vm->id, "node", vm->node, "vcpu_milli", (int)vm->vcpu_milli,
		      "mem_mib", (int)vm->mem_mib, "run_dir", vm->run_dir, "kernel", vm->kernel,
		      "initrd", vm->initrd, "disk", vm->disk_path, "chain", chain,
		      "mem_path", vm->mem_path, "mem_owned", vm->mem_owned, "net", vm->has_net,
		      "balloon", vm->balloon,
		      "pid", (int)vm->proc.pid, "start_ticks", (json_int_t)vm->start_ticks,
		      "hypervisor_version", vm->hv_version, "console_max", (json_int_t)vm->console_max,
		      "cpu", vm->cpu);
	if (!m)
		return -ENOMEM;
	r = hv_base_json_write(vm->record_path, m, JSON_COMPACT);
	json_decref(m);
	return r;
}

static void vm_kill(struct hv_vm *vm, bool graceful);

/*
 * Connects to the console socket of the VM's QEMU (created with its QMP socket, so it is there
 * once QMP answers) and starts draining it into the capped log. A console that cannot be drained
 * is logged and left unread: QEMU then drops the guest's output, the VM runs on.
 */
static void console_attach(struct hv_vm *vm)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd, r;

	hv_console_stop(vm->console);
	vm->console = NULL;
	memcpy(sa.sun_path, vm->serial_sock, strnlen(vm->serial_sock, sizeof(sa.sun_path) - 1));	/* vm_init */
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		r = -errno;
		if (fd >= 0)
			close(fd);
	} else {
		r = hv_console_start(fd, vm->serial_path, vm->console_max, &vm->console);
	}
	if (r < 0)
		log_warn("vm '%s': console not drained (%s): its output is dropped", vm->id, strerror(-r));
}

/* Milliseconds on CLOCK_MONOTONIC. */
static long long mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/*
 * Starts QEMU in the jail and connects QMP. `incoming` waits for a migration stream instead of
 * booting. On failure everything this call started is undone (the process is killed and reaped):
 * KILN_E_UNAVAILABLE when QEMU was still alive but had not answered QMP within QMP_CONNECT_MS of
 * its start (a busy host), KILN_E_SANDBOX_FAILED when it exited or QMP failed otherwise.
 */
static enum kiln_err vm_start(struct hv_vm *vm, const struct vmm_spec *s, bool incoming,
			      struct kiln_error *err)
{
	struct qemu_args a = {
		.binary = s->hv_binary,
		.accel = vm->accel,
		.tb_size_mib = s->tb_size_mib,
		/* a restore keeps the rate its guest was booted with */
		.tsc_khz = vm->accel == ACCEL_TCG && !incoming ? accel_host_tsc_khz() : 0,
		.cpu = vm->cpu,
		.vcpus = vm->vcpus,
		.mem_mib = vm->mem_mib,
		/* names relative to the jail root, QEMU's working directory (jail.h) */
		.mem_path = "mem",
		.mem_share = vm->mem_owned,
		.kernel = "kernel",
		.initrd = vm->initrd[0] ? "initrd" : NULL,
		.cmdline_extra = s->cmdline_extra,
		.disk = vm->disk_path[0] ? "disk" : NULL,
		.tap = s->netns_path ? s->tap : NULL,
		.balloon = vm->balloon,
		.qmp_sock = vm->qmp_path,
		.agent_sock = vm->agent_path,
		.serial_sock = vm->serial_sock,
		.disk_iops = s->disk_iops,
		.disk_bps = s->disk_bps,
		.chroot = vm->jail_root,
		.uid = s->uid,
		.gid = s->gid,
		.incoming = incoming,
	};
	char preload[48], memro[48];
	char *envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL, NULL, NULL };
	char **argv = NULL;
	const char *kernel = vm->kernel;
	struct jail *j = &vm->jail;
	enum kiln_err rc = KILN_OK;
	int r, left, log_fd = -1;
	long long spawned;

	/*
	 * A restore's guest memory comes whole from its snapshot: QEMU reads the kernel and the
	 * initramfs only to offer them through fw_cfg to a boot that never happens. The kernel's
	 * head (its boot header and setup) is all QEMU checks, and reading 14 MiB of kernel costs
	 * a restore tens of ms (docs/vmm.md).
	 */
	if (incoming && (r = qemu_kernel_head(vm->kernel, vm->kernel_head)) == 0) {
		kernel = vm->kernel_head;
		a.initrd = NULL;
	} else if (incoming) {
		log_debug("vm '%s': restored with its whole kernel (head: %s)", vm->id, strerror(-r));
	}
	jail_layout(vm, kernel);
	/*
	 * A shared image mapped privately: QEMU 7.2 would open it for writing and punch the pages
	 * the balloon discards out of it (qemu_memro.c). The preload opens it read-only; without
	 * it, QEMU cannot open the read-only bind and does not start.
	 */
	if (!vm->mem_owned) {
		if ((rc = memro_get(&j->keep_fd, err)) != KILN_OK)
			goto out;
		snprintf(preload, sizeof(preload), "LD_PRELOAD=/proc/self/fd/%d", j->keep_fd);
		snprintf(memro, sizeof(memro), "KILN_QEMU_MEM_RO=%s", a.mem_path);
		envp[1] = preload;
		envp[2] = memro;
	}
	if ((r = jail_prepare(j)) < 0) {
		rc = fs_err(err, r, "cannot prepare jail", vm->jail_root);
		goto out;
	}
	if (s->netns_path) {
		j->netns_fd = open(s->netns_path, O_RDONLY | O_CLOEXEC);
		if (j->netns_fd < 0) {
			rc = fs_err(err, -errno, "cannot open network namespace", s->netns_path);
			goto out;
		}
	}
	log_fd = open(vm->log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (log_fd < 0) {
		rc = fs_err(err, -errno, "cannot open", vm->log_path);
		goto out;
	}
	j->out_fd = log_fd;
	if ((r = qemu_argv_build(&a, &argv)) < 0) {
		rc = kiln_error_set(err, KILN_E_INVALID, "cannot build the qemu command line: %s", strerror(-r));
		goto out;
	}
	unlink(vm->qmp_path);
	unlink(vm->agent_path);
	unlink(vm->serial_sock);
	r = hv_proc_spawn(&vm->proc, j, argv, envp);
	if (kernel != vm->kernel)
		unlink(vm->kernel_head);	/* bound into QEMU's jail from here on */
	if (r < 0) {
		rc = fs_err(err, r, "cannot start", argv[0]);
		goto out;
	}
	spawned = mono_ms();
	log_debug("vm '%s' qemu pid %d", vm->id, (int)vm->proc.pid);
	if (incoming)
		kiln_fault("vmm-restore-spawned");
	left = QMP_CONNECT_MS - (int)(mono_ms() - spawned);
	if ((r = left > 0 ? qmp_connect(vm->qmp_path, left, &vm->qmp) : -ETIMEDOUT) < 0) {
		/*
		 * A QEMU still alive past its deadline is one the host is too busy to run: that says
		 * nothing about what it was to restore (the state is read only after this), and the
		 * caller may try again. One that exited failed.
		 */
		bool slow = mono_ms() - spawned >= QMP_CONNECT_MS && hv_proc_alive(&vm->proc);
		char why[48] = "";

		if (slow)
			snprintf(why, sizeof(why), " within %d s, qemu still starting",
				 QMP_CONNECT_MS / 1000);
		rc = kiln_error_set(err, slow ? KILN_E_UNAVAILABLE : KILN_E_SANDBOX_FAILED,
				    "vm '%s': no qmp answer%s (%s): %s", vm->id, why, strerror(-r),
				    qemu_log_tail(vm));
		hv_proc_kill(&vm->proc, -1);
		goto out;
	}
	snprintf(vm->hv_version, sizeof(vm->hv_version), "%s", qmp_version(vm->qmp));
	vm->start_ticks = proc_start_ticks(vm->proc.pid);
	console_attach(vm);
	if ((r = record_write(vm)) < 0) {
		rc = fs_err(err, r, "cannot write", vm->record_path);
		vm_kill(vm, false);
	}
out:
	qemu_argv_free(argv);
	if (j->netns_fd >= 0)
		close(j->netns_fd);
	j->netns_fd = -1;
	if (log_fd >= 0)
		close(log_fd);
	j->out_fd = -1;
	return rc;
}

/*
 * Hands the VM's own files to its uid: QEMU reopens its disk layer by name, after dropping to that
 * uid, when an incoming migration hands the images over (on `cont`).
 */
static int own_files(const struct hv_vm *vm, uid_t uid, gid_t gid)
{
	if (vm->disk_path[0] && (chown(vm->disk_path, uid, gid) < 0 || chmod(vm->disk_path, 0600) < 0))
		return -errno;
	return 0;
}

/* A frozen layer: root's, read-only for the VMs whose jails bind it (the snapshot dir is 0700). */
static int freeze_file(const char *path)
{
	return chown(path, 0, 0) < 0 || chmod(path, 0444) < 0 ? -errno : 0;
}

static enum kiln_err qmp_do(struct hv_vm *vm, const char *cmd, json_t *args, json_t **ret,
			    struct kiln_error *err)
{
	char msg[QMP_ERRMSG_MAX];
	int r;

	if (!vm->qmp)
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' has no running vmm", vm->id);
	r = qmp_execute(vm->qmp, cmd, args, -1, QMP_CMD_MS, ret, msg);
	if (r == -EREMOTEIO)
		return kiln_error_set(err, KILN_E_INTERNAL, "vm '%s': qmp %s: %s", vm->id, cmd, msg);
	if (r < 0)
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': qmp %s: %s", vm->id, cmd,
				      strerror(-r));
	return KILN_OK;
}

/* Reaps the process if it exited (and drops QMP then); returns true while it is alive. */
static bool vm_alive(struct hv_vm *vm)
{
	if (hv_proc_alive(&vm->proc))
		return true;
	qmp_close(vm->qmp);
	vm->qmp = NULL;
	return false;
}

/*
 * Ends the VMM process: QMP quit (flushes block caches), SIGKILL if it lingers, then reaps it (an
 * adopted one, not our child, is waited for through its pidfd).
 */
static void vm_kill(struct hv_vm *vm, bool graceful)
{
	if (!vm_alive(vm))
		return;
	if (graceful) {
		if (vm->qmp)
			qmp_execute(vm->qmp, "quit", NULL, -1, 1000, NULL, NULL);
		hv_proc_ended(&vm->proc, 2000);
	}
	hv_proc_kill(&vm->proc, -1);
	qmp_close(vm->qmp);
	vm->qmp = NULL;
	hv_console_finish(vm->console);	/* the process is gone: its console ends too */
	vm->console = NULL;
}

static enum kiln_err qemu_destroy(struct hv_vm *vm, struct kiln_error *err);

static enum kiln_err qemu_create(const struct vmm_spec *s, struct hv_vm **out, struct kiln_error *err)
{
	struct hv_vm *vm;
	enum kiln_err rc;
	int r;

	*out = NULL;
	if ((rc = vmm_spec_check(s, err)) != KILN_OK)
		return rc;
	vm = calloc(1, sizeof(*vm));
	if (!vm)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if ((rc = vm_init(vm, s, err)) != KILN_OK)
		goto fail;
	if ((r = fs_mkdir_p(vm->run_dir, 0711)) < 0 || (r = fs_mkdir_p(vm->state_dir, 0700)) < 0) {
		rc = fs_err(err, r, "cannot create the directories of vm", s->id);
		goto fail;
	}
	vm->mem_owned = true;
	if ((r = mem_file_create(vm->mem_path, vm->mem_mib)) < 0) {
		rc = fs_err(err, r, "cannot create memory file", vm->mem_path);
		goto fail;
	}
	if (s->rootfs && (r = disk_overlay_create(s->rootfs, 0, vm->disk_path,
						  (uint64_t)s->disk_gib << 30)) < 0) {
		rc = r == -EINVAL ? kiln_error_set(err, KILN_E_INVALID, "disk: %u GiB is smaller than the image",
						   s->disk_gib)
				  : fs_err(err, r, "cannot create disk layer", vm->disk_path);
		goto fail;
	}
	if ((r = own_files(vm, s->uid, s->gid)) < 0) {
		rc = fs_err(err, r, "cannot hand files to the uid of vm", s->id);
		goto fail;
	}
	if ((rc = hv_base_cgroup(s, QEMU_PIDS_MAX, &vm->cg, err)) != KILN_OK)
		goto fail;
	if ((rc = vm_start(vm, s, false, err)) != KILN_OK)
		goto fail;
	*out = vm;
	return KILN_OK;
fail:
	qemu_destroy(vm, NULL);
	return rc;
}

static enum kiln_err qemu_pause(struct hv_vm *vm, struct kiln_error *err)
{
	return qmp_do(vm, "stop", NULL, NULL, err);
}

static enum kiln_err qemu_resume(struct hv_vm *vm, struct kiln_error *err)
{
	return qmp_do(vm, "cont", NULL, NULL, err);
}

static enum kiln_err set_ignore_shared(struct hv_vm *vm, bool on, struct kiln_error *err)
{
	json_t *args = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
				 "state", on);
	enum kiln_err rc;

	if (!args)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = qmp_do(vm, "migrate-set-capabilities", args, NULL, err);
	json_decref(args);
	return rc;
}

/* Polls query-migrate until the migration completed (KILN_OK) or failed. */
static enum kiln_err wait_migration(struct hv_vm *vm, struct kiln_error *err)
{
	struct timespec tick = { .tv_nsec = 2 * 1000000 };

	for (int waited = 0; waited < MIGRATE_MS / 2; waited++) {
		json_t *ret = NULL;
		enum kiln_err rc = qmp_do(vm, "query-migrate", NULL, &ret, err);
		const char *st;

		if (rc != KILN_OK)
			return rc;
		st = json_string_value(json_object_get(ret, "status"));
		if (st && strcmp(st, "completed") == 0) {
			json_decref(ret);
			return KILN_OK;
		}
		if (st && (strcmp(st, "failed") == 0 || strcmp(st, "cancelled") == 0)) {
			const char *why = json_string_value(json_object_get(ret, "error-desc"));

			rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': migration %s: %s", vm->id,
					    st, why ? why : qemu_log_tail(vm));
			json_decref(ret);
			return rc;
		}
		json_decref(ret);
		nanosleep(&tick, NULL);
	}
	return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': migration did not finish", vm->id);
}

/* Passes `fd` to QEMU as "kiln-mig" and runs `cmd` ("migrate" or "migrate-incoming") on it. */
static enum kiln_err migrate_fd(struct hv_vm *vm, const char *cmd, int fd, struct kiln_error *err)
{
	char msg[QMP_ERRMSG_MAX];
	enum kiln_err rc;
	json_t *args;
	int r;

	r = qmp_getfd(vm->qmp, "kiln-mig", fd, QMP_CMD_MS, msg);
	if (r < 0)
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': getfd: %s", vm->id,
				      r == -EREMOTEIO ? msg : strerror(-r));
	args = json_pack("{s:s}", "uri", "fd:kiln-mig");
	if (!args)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = qmp_do(vm, cmd, args, NULL, err);
	json_decref(args);
	if (rc == KILN_OK && strcmp(cmd, "migrate") == 0)
		kiln_fault("snapshot-migrating");
	return rc != KILN_OK ? rc : wait_migration(vm, err);
}

/*
 * Writes manifest.json: what a restore must match (hypervisor, accelerator, shape, devices), the
 * memory mode and the disk chain `chain[0..n-1]` (host paths, base first; n = 0 for no disk).
 */
static int write_manifest(const char *snap_dir, const struct hv_vm *vm, const char *mode,
			  const char *hv_version, char (*chain)[PATH_MAX], unsigned n)
{
	char path[PATH_MAX];
	json_t *m, *arr;
	int r;

	if (!fs_path(path, "%s/manifest.json", snap_dir))
		return -ENAMETOOLONG;
	m = json_pack("{s:i, s:s, s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:i, s:b, s:b, s:b, s:s?, s:s, s:s?, s:I}",
		      "format", SNAP_FORMAT, "hypervisor", "qemu", "hypervisor_version", hv_version,
		      "machine", "microvm", "accel", accel_name(vm->accel), "cpu", vm->cpu, "memory", mode,
		      "vcpus", (int)vm->vcpus, "vcpu_milli", (int)vm->vcpu_milli, "mem_mib", (int)vm->mem_mib,
		      "disk", n > 0, "net", vm->has_net, "balloon", vm->balloon,
		      "disk_chain", NULL, "kernel", vm->kernel,
		      "initrd", vm->initrd[0] ? vm->initrd : NULL, "created", (json_int_t)time(NULL));
	arr = json_array();
	for (unsigned k = 0; arr && k < n; k++)
		json_array_append_new(arr, json_string(chain[k]));
	if (!m || !arr || json_object_set_new(m, "disk_chain", arr) < 0) {
		json_decref(m);
		return -ENOMEM;
	}
	r = hv_base_json_write(path, m, JSON_INDENT(2) | JSON_SORT_KEYS);
	json_decref(m);
	return r;
}

/*
 * Puts a copy of `src` at `dst` and keeps `src`: a hard link on the same file system, else a
 * copy written beside `dst` and renamed into place, so `dst` exists only whole.
 */
static int stage_file(const char *src, const char *dst)
{
	char part[PATH_MAX];
	int r;

	unlink(dst);
	if (link(src, dst) == 0)
		return 0;
	if (errno != EXDEV)
		return -errno;
	if (!fs_path(part, "%s.part", dst))
		return -ENAMETOOLONG;
	if ((r = disk_file_copy(src, part)) == 0 && rename(part, dst) < 0) {
		r = -errno;
		unlink(part);
	}
	return r;
}

/* `dst` takes the place of `src`: staged already (or moved by an earlier run), or moved now. */
static int take_file(const char *src, const char *dst)
{
	struct stat st;

	if (stat(dst, &st) == 0)
		return unlink(src) < 0 && errno != ENOENT ? -errno : 0;
	return disk_file_move(src, dst);
}

/*
 * The part of a snapshot after its state is saved (and, `shared`, the VMM has ended): the
 * snapshot takes the memory file and the disk layer, freezes the layer (flattened past
 * DISK_CHAIN_MAX) and writes the manifest, last. Each step can run again after a crash in it.
 */
static enum kiln_err snap_complete(struct hv_vm *vm, const char *snap_dir, bool shared,
				   struct kiln_error *err)
{
	char mem[PATH_MAX], disk[PATH_MAX];
	char(*chain)[PATH_MAX] = NULL;
	unsigned n = 0;
	int r;

	if (!fs_path(mem, "%s/mem", snap_dir) || !fs_path(disk, "%s/disk.qcow2", snap_dir))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
	if (shared) {
		if ((r = take_file(vm->mem_path, mem)) < 0)
			return fs_err(err, r, "cannot move memory image to", mem);
		vm->mem_owned = false;
		kiln_fault("snapshot-memory-moved");
		if (vm->disk_path[0] && (r = take_file(vm->disk_path, disk)) < 0)
			return fs_err(err, r, "cannot move disk layer to", disk);
	} else if (vm->disk_path[0] && (r = disk_file_copy(vm->disk_path, disk)) < 0) {
		/* the source's block devices are inactive after the migration: the layer is consistent */
		return fs_err(err, r, "cannot copy disk layer to", disk);
	}
	if (vm->disk_path[0]) {
		/* the frozen layer joins the chain; past DISK_CHAIN_MAX it is flattened onto the base */
		chain = calloc(DISK_CHAIN_MAX + 2, sizeof(*chain));
		if (!chain)
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		n = vm->depth + 1;
		memcpy(chain, vm->chain, n * sizeof(*chain));
		snprintf(chain[n++], PATH_MAX, "%s", disk);
		if ((r = freeze_file(disk)) < 0) {
			free(chain);
			return fs_err(err, r, "cannot freeze disk layer", disk);
		}
		if (n - 1 > DISK_CHAIN_MAX) {
			char tmp[PATH_MAX];
			const char *links[DISK_CHAIN_MAX + 1];

			for (unsigned k = 0; k < n - 1; k++)
				links[k] = chain[k];
			fs_path(tmp, "%s/.chain", snap_dir);
			if ((r = disk_flatten(disk, links, n - 1, tmp)) < 0) {
				free(chain);
				return fs_err(err, r, "cannot flatten disk layer", disk);
			}
			snprintf(chain[1], PATH_MAX, "%s", disk);
			n = 2;
			freeze_file(disk);
		}
		if (shared)
			vm->disk_path[0] = '\0';	/* moved: nothing of it is this VM's any more */
	}
	kiln_fault("snapshot-before-manifest");
	r = write_manifest(snap_dir, vm, shared ? "shared" : "full", vm->hv_version, chain, n);
	free(chain);
	if (r < 0 || (r = fs_fsync_path(snap_dir)) < 0)
		return fs_err(err, r, "cannot write manifest in", snap_dir);
	return KILN_OK;
}

static enum kiln_err qemu_snapshot(struct hv_vm *vm, const char *snap_dir, enum vmm_snap_mode mode,
				   struct kiln_error *err)
{
	char state[PATH_MAX], state_tmp[PATH_MAX], mem[PATH_MAX], disk[PATH_MAX];
	/* x-ignore-shared skips only shared memory: a private map goes into the stream */
	bool shared = mode == VMM_SNAP_SHARED && vm->mem_owned;
	enum kiln_err rc;
	int fd, r;

	if (!vm_alive(vm) || !vm->qmp)
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' is not running", vm->id);
	if (!fs_path(state, "%s/state", snap_dir) || !fs_path(state_tmp, "%s/state.tmp", snap_dir) ||
	    !fs_path(mem, "%s/mem", snap_dir) || !fs_path(disk, "%s/disk.qcow2", snap_dir))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
	if ((r = fs_mkdir_p(snap_dir, 0700)) < 0)
		return fs_err(err, r, "cannot create snapshot dir", snap_dir);

	if ((rc = qmp_do(vm, "stop", NULL, NULL, err)) != KILN_OK)
		return rc;
	kiln_fault("snapshot-vcpus-stopped");
	if ((rc = set_ignore_shared(vm, shared, err)) != KILN_OK)
		return rc;
	fd = open(state_tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return fs_err(err, -errno, "cannot create", state_tmp);
	rc = migrate_fd(vm, "migrate", fd, err);
	if (rc == KILN_OK && fsync(fd) < 0)
		rc = fs_err(err, -errno, "cannot write", state_tmp);
	close(fd);
	if (rc == KILN_OK && rename(state_tmp, state) < 0)
		rc = fs_err(err, -errno, "cannot rename", state_tmp);
	if (rc != KILN_OK) {
		unlink(state_tmp);
		return rc;
	}
	kiln_fault("snapshot-state-saved");
	if (shared) {
		/*
		 * Copies first, while the VMM lives: if they fail (a disk filling up), the VM is whole and
		 * can go on. The memory file then becomes the snapshot's image: the VMM must end first.
		 */
		if ((r = stage_file(vm->mem_path, mem)) < 0 ||
		    (vm->disk_path[0] && (r = stage_file(vm->disk_path, disk)) < 0)) {
			unlink(mem);
			unlink(state);
			return fs_err(err, r, "cannot write the snapshot into", snap_dir);
		}
		vm_kill(vm, true);
		kiln_fault("snapshot-vmm-ended");
	}
	return snap_complete(vm, snap_dir, shared, err);
}

static enum kiln_err qemu_snapshot_finish(struct hv_vm *vm, const char *snap_dir, struct kiln_error *err)
{
	char path[PATH_MAX];
	struct stat st;

	if (vm_alive(vm))
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' is running: take a snapshot instead", vm->id);
	if (!fs_path(path, "%s/manifest.json", snap_dir))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
	if (stat(path, &st) == 0)
		return KILN_OK;	/* written last: the snapshot is whole */
	if (!fs_path(path, "%s/state", snap_dir) || stat(path, &st) != 0)
		return kiln_error_set(err, KILN_E_NOT_FOUND, "snapshot '%s' has no complete state", snap_dir);
	if (!vm->mem_owned)
		return kiln_error_set(err, KILN_E_NOT_FOUND,
				      "vm '%s' kept its memory in the state stream: nothing to finish", vm->id);
	return snap_complete(vm, snap_dir, true, err);
}

/* Frees an adopted handle, leaving its process and files as they are. */
static void adopt_free(struct hv_vm *vm)
{
	hv_console_stop(vm->console);
	hv_proc_release(&vm->proc);
	qmp_close(vm->qmp);
	cg_free(vm->cg);
	free(vm);
}

/* Brings an adopted VMM to running: a migration it is in ends first; stopped vCPUs continue. */
static enum kiln_err adopt_run(struct hv_vm *vm, struct kiln_error *err)
{
	struct kiln_error ignore = { 0 };
	json_t *ret = NULL;
	const char *st;
	enum kiln_err rc = qmp_do(vm, "query-migrate", NULL, &ret, err);

	if (rc != KILN_OK)
		return rc;
	st = json_string_value(json_object_get(ret, "status"));
	if (st && strcmp(st, "completed") && strcmp(st, "failed") && strcmp(st, "cancelled") &&
	    strcmp(st, "none"))
		wait_migration(vm, &ignore);	/* either way the VMM keeps the VM */
	json_decref(ret);
	ret = NULL;
	if ((rc = qmp_do(vm, "query-status", NULL, &ret, err)) != KILN_OK)
		return rc;
	if (!json_is_true(json_object_get(ret, "running")))
		rc = qmp_do(vm, "cont", NULL, NULL, err);
	json_decref(ret);
	return rc;
}

/*
 * Sets vm->cpu from a manifest's or record's "cpu", the model QEMU ran the VM under (its guest
 * saw that model's CPUID and goes on with it); one written before the field existed ran under
 * accel_cpu_legacy(). False for a model this node does not run.
 */
static bool cpu_from(struct hv_vm *vm, const json_t *m)
{
	const char *cpu = json_string_value(json_object_get(m, "cpu"));

	if (!json_object_get(m, "cpu"))
		cpu = accel_cpu_legacy(vm->accel);
	if (!accel_cpu_valid(vm->accel, cpu))
		return false;
	snprintf(vm->cpu, sizeof(vm->cpu), "%s", cpu);
	return true;
}

static enum kiln_err qemu_adopt(const char *state_dir, struct hv_vm **out, struct kiln_error *err)
{
	char path[PATH_MAX];
	struct vmm_spec s = { 0 };
	struct hv_vm *vm;
	json_error_t jerr;
	json_t *m, *chain;
	enum kiln_err rc = KILN_OK;
	pid_t pid;

	*out = NULL;
	if (!fs_path(path, "%s/" RECORD_NAME, state_dir))
		return kiln_error_set(err, KILN_E_INVALID, "state_dir '%s' too long", state_dir);
	m = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!m)
		return access(path, F_OK) != 0 ? kiln_error_set(err, KILN_E_NOT_FOUND, "no vm at '%s'", state_dir)
						: kiln_error_set(err, KILN_E_INVALID, "'%s': %s", path, jerr.text);
	vm = calloc(1, sizeof(*vm));
	if (!vm) {
		json_decref(m);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	hv_proc_init(&vm->proc);
	chain = json_object_get(m, "chain");
	s.id = json_string_value(json_object_get(m, "id"));
	s.node = json_string_value(json_object_get(m, "node"));
	s.vcpu_milli = (unsigned)json_integer_value(json_object_get(m, "vcpu_milli"));
	s.mem_mib = (unsigned)json_integer_value(json_object_get(m, "mem_mib"));
	s.kernel = json_string_value(json_object_get(m, "kernel"));
	s.initrd = json_string_value(json_object_get(m, "initrd"));
	s.initrd = s.initrd && s.initrd[0] ? s.initrd : NULL;
	s.rootfs = json_array_size(chain) ? json_string_value(json_array_get(chain, 0)) : NULL;
	s.netns_path = json_is_true(json_object_get(m, "net")) ? "/" : NULL;
	s.tap = "tap";
	s.run_dir = json_string_value(json_object_get(m, "run_dir"));
	s.state_dir = state_dir;
	s.uid = s.gid = 1;	/* unused: the VMM runs already */
	s.console_max = (unsigned long long)json_integer_value(json_object_get(m, "console_max"));
	if (vmm_spec_check(&s, err) != KILN_OK || vm_init(vm, &s, err) != KILN_OK) {
		rc = err->code;
		goto out;
	}
	snprintf(vm->disk_path, sizeof(vm->disk_path), "%s", json_string_value(json_object_get(m, "disk")) ?: "");
	snprintf(vm->mem_path, sizeof(vm->mem_path), "%s", json_string_value(json_object_get(m, "mem_path")) ?: "");
	snprintf(vm->hv_version, sizeof(vm->hv_version), "%s",
		 json_string_value(json_object_get(m, "hypervisor_version")) ?: "");
	if (!cpu_from(vm, m)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "'%s': CPU model unknown", path);
		goto out;
	}
	vm->mem_owned = json_is_true(json_object_get(m, "mem_owned"));
	vm->balloon = json_is_true(json_object_get(m, "balloon"));
	vm->depth = json_array_size(chain) ? (unsigned)json_array_size(chain) - 1 : 0;
	for (size_t k = 0; k < json_array_size(chain) && k <= DISK_CHAIN_MAX; k++)
		snprintf(vm->chain[k], PATH_MAX, "%s", json_string_value(json_array_get(chain, k)) ?: "");
	if (!vm->mem_path[0] || json_array_size(chain) > DISK_CHAIN_MAX + 1 || (vm->disk_path[0] && !s.rootfs)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "'%s' does not describe a vm", path);
		goto out;
	}
	jail_layout(vm, vm->kernel);
	if (cg_open(NULL, vm->node, vm->id, &vm->cg) == 0)
		vm->jail.cg = vm->cg;

	/* the same process as recorded (a pid can be reused), pinned by its pidfd from here on */
	pid = (pid_t)json_integer_value(json_object_get(m, "pid"));
	vm->start_ticks = (unsigned long long)json_integer_value(json_object_get(m, "start_ticks"));
	if (pid > 0 && hv_proc_open(&vm->proc, pid) == 0 &&
	    (proc_start_ticks(pid) != vm->start_ticks || vm->start_ticks == 0))
		hv_proc_release(&vm->proc);
	if (vm->proc.pid) {
		int r = qmp_connect(vm->qmp_path, QMP_CONNECT_MS, &vm->qmp);

		rc = r < 0 ? kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': no qmp answer: %s", vm->id,
					    strerror(-r))
			   : adopt_run(vm, err);
		if (rc == KILN_OK)
			console_attach(vm);
	}
	if (rc == KILN_OK) {
		log_info("vm '%s' taken over (%s)", vm->id, vm->proc.pid ? "running" : "its vmm has ended");
		*out = vm;
		vm = NULL;
	}
out:
	json_decref(m);
	if (vm)
		adopt_free(vm);
	return rc;
}

/* Reads the snapshot's manifest and checks it fits `s`. *shared tells its memory mode. */
static enum kiln_err check_manifest(const char *snap_dir, struct hv_vm *vm, bool *shared,
				    struct kiln_error *err)
{
	char path[PATH_MAX];
	json_error_t jerr;
	enum kiln_err rc = KILN_OK;
	const char *mode, *hv, *accel;
	json_t *m, *chain;

	if (!fs_path(path, "%s/manifest.json", snap_dir))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
	m = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!m)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': no readable manifest (%s)", snap_dir,
				      jerr.text);
	mode = json_string_value(json_object_get(m, "memory"));
	hv = json_string_value(json_object_get(m, "hypervisor"));
	accel = json_string_value(json_object_get(m, "accel"));
	chain = json_object_get(m, "disk_chain");
	if (json_integer_value(json_object_get(m, "format")) != SNAP_FORMAT || !hv || strcmp(hv, "qemu") ||
	    !mode || (strcmp(mode, "shared") && strcmp(mode, "full")))
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': unknown format", snap_dir);
	else if (!accel || strcmp(accel, accel_name(vm->accel)))
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s' was taken under %s, this host runs %s",
				    snap_dir, accel ? accel : "?", accel_name(vm->accel));
	else if (!cpu_from(vm, m))
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s': CPU model differs", snap_dir);
	else if (json_integer_value(json_object_get(m, "vcpus")) != (json_int_t)vm->vcpus ||
		 json_integer_value(json_object_get(m, "mem_mib")) != (json_int_t)vm->mem_mib)
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s': shape differs (vcpus, memory)", snap_dir);
	else if (json_is_true(json_object_get(m, "net")) != vm->has_net)
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s': network device differs", snap_dir);
	else if (!json_is_array(chain) || json_array_size(chain) == 1 ||
		 json_array_size(chain) > DISK_CHAIN_MAX + 1)
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': bad disk chain", snap_dir);
	for (size_t k = 0; rc == KILN_OK && k < json_array_size(chain); k++) {
		const char *p = json_string_value(json_array_get(chain, k));

		if (!p || p[0] != '/' || !fs_path(vm->chain[k], "%s", p))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': bad disk chain", snap_dir);
	}
	/*
	 * The guest's kernel and initramfs are the ones it was taken with (its memory holds what they
	 * loaded), not the spec's: a node whose configured image changed restores the snapshot on the
	 * image it was taken from, as the disk chain's base already is. A snapshot whose manifest
	 * names none (older ones) takes the spec's.
	 */
	if (rc == KILN_OK) {
		const char *k = json_string_value(json_object_get(m, "kernel"));
		json_t *ird = json_object_get(m, "initrd");

		if (k && (k[0] != '/' || !fs_path(vm->kernel, "%s", k)))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': bad kernel path", snap_dir);
		else if (k && json_is_string(ird) && (json_string_value(ird)[0] != '/' ||
						     !fs_path(vm->initrd, "%s", json_string_value(ird))))
			rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': bad initrd path", snap_dir);
		else if (k && json_is_null(ird))
			vm->initrd[0] = '\0';
	}
	if (rc == KILN_OK) {
		/* the devices it was saved with: a snapshot older than the balloon has none */
		vm->balloon = json_is_true(json_object_get(m, "balloon"));
		*shared = strcmp(mode, "shared") == 0;
		vm->depth = json_array_size(chain) ? (unsigned)json_array_size(chain) - 1 : 0;
		if (!json_array_size(chain))
			vm->chain[0][0] = '\0';
	}
	json_decref(m);
	return rc;
}

/*
 * Grows the running VM's disk layer to `bytes` (QMP block_resize on the drive "root"): the guest's
 * virtio-blk device raises a config change and the guest's kernel sees the new size shortly after.
 */
static enum kiln_err disk_grow(struct hv_vm *vm, uint64_t bytes, struct kiln_error *err)
{
	json_t *args = json_pack("{s:s, s:I}", "device", "root", "size", (json_int_t)bytes);
	enum kiln_err rc;

	if (!args)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = qmp_do(vm, "block_resize", args, NULL, err);
	json_decref(args);
	return rc;
}

/* Ends what a restore begun left: its state file closed, its memory copy ended. */
static void pend_drop(struct hv_vm *vm)
{
	if (!vm->pend.on)
		return;
	if (vm->pend.fd >= 0)
		close(vm->pend.fd);
	disk_copy_drop(&vm->pend.copy);
	vm->pend.on = false;
}

/*
 * The first step of a restore: everything up to a QEMU waiting for the snapshot's state (its
 * memory prepared, its disk layer made, QEMU started in its jail and answering QMP). The state
 * is loaded by qemu_restore_end().
 */
static enum kiln_err qemu_restore_begin(const struct vmm_spec *s, const char *snap_dir,
					enum vmm_mem_from from, struct hv_vm **out,
					struct kiln_error *err)
{
	char state[PATH_MAX], *mem;
	struct disk_copy *copy;
	bool shared = false;
	struct hv_vm *vm;
	enum kiln_err rc;
	int r;

	*out = NULL;
	if ((rc = vmm_spec_check(s, err)) != KILN_OK)
		return rc;
	vm = calloc(1, sizeof(*vm));
	if (!vm)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	vm->pend.on = true;
	vm->pend.fd = -1;
	vm->pend.disk_gib = s->disk_gib;
	vm->pend.uid = s->uid;
	copy = &vm->pend.copy;
	mem = vm->pend.mem_src;
	if ((rc = vm_init(vm, s, err)) != KILN_OK)
		goto fail;
	if (!fs_path(state, "%s/state", snap_dir) || !fs_path(mem, "%s/mem", snap_dir)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
		goto fail;
	}
	if ((rc = check_manifest(snap_dir, vm, &shared, err)) != KILN_OK)
		goto fail;
	vm->pend.fd = open(state, O_RDONLY | O_CLOEXEC);
	if (vm->pend.fd < 0) {
		rc = fs_err(err, -errno, "cannot open snapshot state", state);
		goto fail;
	}
	if ((r = fs_mkdir_p(vm->run_dir, 0711)) < 0 || (r = fs_mkdir_p(vm->state_dir, 0700)) < 0) {
		rc = fs_err(err, r, "cannot create the directories of vm", s->id);
		goto fail;
	}
	/*
	 * memory: the snapshot's image mapped privately (read-only, also with the balloon:
	 * qemu_memro.c), taken over, or copied; or a fresh file.
	 */
	vm->mem_owned = true;
	if (!shared)
		r = mem_file_create(vm->mem_path, vm->mem_mib);
	else if (from == VMM_MEM_MOVE)
		r = disk_file_move(mem, vm->mem_path);
	else if (from == VMM_MEM_COPY_LATE)
		r = disk_copy_prepare(copy, mem, vm->mem_path);	/* copied before the state */
	else if (from == VMM_MEM_COPY)
		r = disk_copy_start(copy, mem, vm->mem_path);	/* waited for before the state */
	else {
		vm->mem_owned = false;
		r = fs_path(vm->mem_path, "%s", mem) ? 0 : -ENAMETOOLONG;
	}
	if (r < 0) {
		rc = fs_err(err, r, "cannot prepare memory from", mem);
		goto fail;
	}
	/*
	 * disk: a new empty layer over the snapshot's frozen one, of the snapshot's size; grown to the
	 * spec's after the VM runs again (disk_grow), so that the guest hears of the new size
	 */
	if (vm->chain[0][0]) {
		if (!fs_path(vm->disk_path, "%s/disk.qcow2", vm->state_dir)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "state_dir '%s' too long", vm->state_dir);
			goto fail;
		}
		if ((r = disk_info(vm->chain[vm->depth], &vm->pend.snap_disk)) < 0) {
			rc = fs_err(err, r, "cannot read the size of", vm->chain[vm->depth]);
			goto fail;
		}
		if (s->disk_gib && (uint64_t)s->disk_gib << 30 < vm->pend.snap_disk) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "disk: %u GiB is smaller than the snapshot's %llu GiB", s->disk_gib,
					    (unsigned long long)((vm->pend.snap_disk + (1ull << 30) - 1) >> 30));
			goto fail;
		}
		if ((r = disk_overlay_create(vm->chain[vm->depth], vm->depth, vm->disk_path, 0)) < 0) {
			vm->disk_path[0] = '\0';
			rc = fs_err(err, r, "cannot create disk layer over", vm->chain[vm->depth]);
			goto fail;
		}
	}
	if ((r = own_files(vm, s->uid, s->gid)) < 0) {
		rc = fs_err(err, r, "cannot hand files to the uid of vm", s->id);
		goto fail;
	}
	if ((rc = hv_base_cgroup(s, QEMU_PIDS_MAX, &vm->cg, err)) != KILN_OK)
		goto fail;
	if ((rc = vm_start(vm, s, true, err)) != KILN_OK)
		goto fail;
	if ((rc = set_ignore_shared(vm, shared, err)) != KILN_OK)
		goto fail;
	*out = vm;
	return KILN_OK;
fail:
	qemu_destroy(vm, NULL);
	return rc;
}

/* Puts what vm_rename() renamed back under the VM's names (a rename that failed part way). */
static void files_rename_undo(struct hv_vm *vm, const struct hv_vm *nw)
{
	rename(nw->run_dir, vm->run_dir);
	rename(nw->state_dir, vm->state_dir);
	if (vm->mem_owned)
		rename(nw->mem_path, vm->mem_path);
}

/*
 * Gives the VM of a restore begun under another name `s`'s: its id, run and state directories,
 * memory file (its own) and cgroup are renamed; vm.json is written anew and the console drained
 * into the new state directory. QEMU keeps what it opened (sockets, jail, disk, memory), all moved
 * with their directories. Its shape, node, uid and network device must be the begin's; its
 * network namespace stays the begin's (QEMU runs in it), whatever `s` names.
 */
static enum kiln_err vm_rename(struct hv_vm *vm, const struct vmm_spec *s, struct kiln_error *err)
{
	struct hv_vm *nw;
	enum kiln_err rc = KILN_OK;
	struct stat st;
	int r = 0;

	if ((rc = vmm_spec_check(s, err)) != KILN_OK)
		return rc;
	if (s->vcpu_milli != vm->vcpu_milli || s->mem_mib != vm->mem_mib ||
	    s->disk_gib != vm->pend.disk_gib || s->uid != vm->pend.uid ||
	    strcmp(s->node, vm->node) != 0 || (s->netns_path != NULL) != vm->has_net)
		return kiln_error_set(err, KILN_E_INVALID, "vm '%s' cannot become '%s': another shape",
				      vm->id, s->id);
	nw = calloc(1, sizeof(*nw));
	if (!nw)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if ((rc = vm_init(nw, s, err)) != KILN_OK)
		goto out;
	if (stat(nw->run_dir, &st) == 0 || stat(nw->state_dir, &st) == 0 ||
	    (vm->mem_owned && stat(nw->mem_path, &st) == 0)) {
		rc = kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' exists", s->id);
		goto out;
	}
	hv_console_stop(vm->console);
	vm->console = NULL;
	if (rename(vm->run_dir, nw->run_dir) < 0 || rename(vm->state_dir, nw->state_dir) < 0 ||
	    (vm->mem_owned && rename(vm->mem_path, nw->mem_path) < 0) ||
	    (vm->cg && (r = cg_rename(vm->cg, s->id)) < 0)) {
		rc = fs_err(err, r < 0 ? r : -errno, "cannot rename vm", vm->id);
		files_rename_undo(vm, nw);
		console_attach(vm);
		goto out;
	}
	snprintf(vm->id, sizeof(vm->id), "%s", nw->id);
	memcpy(vm->run_dir, nw->run_dir, sizeof(vm->run_dir));
	memcpy(vm->state_dir, nw->state_dir, sizeof(vm->state_dir));
	memcpy(vm->qmp_path, nw->qmp_path, sizeof(vm->qmp_path));
	memcpy(vm->agent_path, nw->agent_path, sizeof(vm->agent_path));
	memcpy(vm->serial_path, nw->serial_path, sizeof(vm->serial_path));
	memcpy(vm->serial_sock, nw->serial_sock, sizeof(vm->serial_sock));
	memcpy(vm->serial_old, nw->serial_old, sizeof(vm->serial_old));
	memcpy(vm->log_path, nw->log_path, sizeof(vm->log_path));
	memcpy(vm->record_path, nw->record_path, sizeof(vm->record_path));
	memcpy(vm->jail_root, nw->jail_root, sizeof(vm->jail_root));
	memcpy(vm->mp_kernel, nw->mp_kernel, sizeof(vm->mp_kernel));
	memcpy(vm->mp_initrd, nw->mp_initrd, sizeof(vm->mp_initrd));
	memcpy(vm->mp_disk, nw->mp_disk, sizeof(vm->mp_disk));
	memcpy(vm->mp_mem, nw->mp_mem, sizeof(vm->mp_mem));
	memcpy(vm->mp_chain, nw->mp_chain, sizeof(vm->mp_chain));
	memcpy(vm->kernel_head, nw->kernel_head, sizeof(vm->kernel_head));
	if (vm->mem_owned) {
		memcpy(vm->mem_path, nw->mem_path, sizeof(vm->mem_path));
		if (vm->pend.copy.started)	/* removed by its wait if the copy fails */
			memcpy(vm->pend.copy.dst, nw->mem_path, sizeof(vm->pend.copy.dst));
	}
	if (vm->disk_path[0] && !fs_path(vm->disk_path, "%s/disk.qcow2", vm->state_dir))
		rc = kiln_error_set(err, KILN_E_INVALID, "state_dir '%s' too long", vm->state_dir);
	console_attach(vm);
	if (rc == KILN_OK && (r = record_write(vm)) < 0)
		rc = fs_err(err, r, "cannot write", vm->record_path);
out:
	free(nw);
	return rc;
}

/*
 * The second step: the VM begun by qemu_restore_begin() loads its state and runs, under `s`'s
 * names when `s` is given (vm_rename). On failure the VM is destroyed.
 */
static enum kiln_err qemu_restore_end(struct hv_vm *vm, const struct vmm_spec *s, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;
	int r;

	if (!vm->pend.on) {
		rc = kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' has no restore begun", vm->id);
		goto fail;
	}
	if (s && strcmp(s->id, vm->id) != 0 && (rc = vm_rename(vm, s, err)) != KILN_OK)
		goto fail;
	/* QEMU maps the memory file at its start but reads none of it before the state is loaded
	 * (a device's state names rings in guest memory): the copy ran beside its start, or (late)
	 * runs now. */
	if (vm->pend.copy.started && (r = disk_copy_wait(&vm->pend.copy)) < 0) {
		vm->pend.copy.started = false;
		rc = fs_err(err, r, "cannot copy memory from", vm->pend.mem_src);
		goto fail;
	}
	vm->pend.copy.started = false;
	if ((rc = migrate_fd(vm, "migrate-incoming", vm->pend.fd, err)) != KILN_OK)
		goto fail;
	if ((rc = qmp_do(vm, "cont", NULL, NULL, err)) != KILN_OK)
		goto fail;
	if (vm->chain[0][0] && vm->pend.disk_gib &&
	    (uint64_t)vm->pend.disk_gib << 30 > vm->pend.snap_disk &&
	    (rc = disk_grow(vm, (uint64_t)vm->pend.disk_gib << 30, err)) != KILN_OK)
		goto fail;
	pend_drop(vm);
	return KILN_OK;
fail:
	qemu_destroy(vm, NULL);
	return rc;
}

static enum kiln_err qemu_restore(const struct vmm_spec *s, const char *snap_dir, enum vmm_mem_from from,
				  struct hv_vm **out, struct kiln_error *err)
{
	struct hv_vm *vm = NULL;
	enum kiln_err rc = qemu_restore_begin(s, snap_dir, from, &vm, err);

	*out = NULL;
	if (rc == KILN_OK && (rc = qemu_restore_end(vm, NULL, err)) == KILN_OK)
		*out = vm;
	return rc;
}

static enum kiln_err qemu_status(struct hv_vm *vm, struct vmm_status *st, struct kiln_error *err)
{
	json_t *ret = NULL;

	memset(st, 0, sizeof(*st));
	st->alive = vm_alive(vm);
	st->pid = vm->proc.pid;
	st->exit_status = vm->proc.exit_status;
	if (st->alive && vm->qmp && qmp_do(vm, "query-status", NULL, &ret, err) == KILN_OK)
		st->running = json_is_true(json_object_get(ret, "running"));
	json_decref(ret);
	return KILN_OK;
}

static enum kiln_err qemu_usage(struct hv_vm *vm, struct cg_usage *u, struct kiln_error *err)
{
	int r;

	if (!vm->cg)
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' has no cgroup", vm->id);
	r = cg_read(vm->cg, u);
	return r < 0 ? fs_err(err, r, "cannot read cgroup of vm", vm->id) : KILN_OK;
}

/* Removes a file that may be absent; records other failures in `err`. */
static enum kiln_err qemu_destroy(struct hv_vm *vm, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;
	int r;

	if (!vm)
		return KILN_OK;
	vm_kill(vm, false);
	pend_drop(vm);
	hv_console_stop(vm->console);
	vm->console = NULL;
	if (vm->cg && (r = cg_destroy(vm->cg)) < 0)
		rc = fs_err(err, r, "cannot remove cgroup of vm", vm->id);
	vm->cg = NULL;
	if (vm->jail.root)
		jail_cleanup(&vm->jail);
	fs_remove(vm->qmp_path, err, &rc);
	fs_remove(vm->agent_path, err, &rc);
	fs_remove(vm->serial_sock, err, &rc);
	fs_remove(vm->serial_path, err, &rc);
	fs_remove(vm->serial_old, err, &rc);
	fs_remove(vm->log_path, err, &rc);
	fs_remove(vm->kernel_head, err, &rc);
	fs_remove(vm->record_path, err, &rc);
	if (vm->mem_owned)
		fs_remove(vm->mem_path, err, &rc);
	fs_remove(vm->disk_path, err, &rc);
	fs_remove_dir(vm->run_dir, err, &rc);
	fs_remove_dir(vm->state_dir, err, &rc);
	free(vm);
	return rc;
}

static const char *qemu_agent_socket(const struct hv_vm *vm)
{
	return vm->agent_path;
}

static const char *qemu_serial_log(const struct hv_vm *vm)
{
	return vm->serial_path;
}

const struct hv_ops hv_qemu_ops = {
	.name = "qemu",
	.create = qemu_create,
	.restore = qemu_restore,
	.restore_begin = qemu_restore_begin,
	.restore_end = qemu_restore_end,
	.pause = qemu_pause,
	.resume = qemu_resume,
	.snapshot = qemu_snapshot,
	.adopt = qemu_adopt,
	.snapshot_finish = qemu_snapshot_finish,
	.status = qemu_status,
	.usage = qemu_usage,
	.destroy = qemu_destroy,
	.agent_socket = qemu_agent_socket,
	.serial_log = qemu_serial_log,
};
