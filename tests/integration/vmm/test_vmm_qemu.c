/*
 * test_vmm_qemu.c - boots real QEMU microvm guests (TCG here) through the vmm API, jailed, in a
 * throwaway network namespace with a TAP device, and checks what a user of the node would rely on:
 *  - the guest boots (its marker reaches the serial log);
 *  - the VMM runs as its own unprivileged uid, as PID 1 of its own pid namespace, in its own mount
 *    namespace, in the given network namespace, chrooted, with seccomp and no_new_privs, in its
 *    cgroup with the CPU quota of its shape;
 *  - pause stops the guest and resume continues it;
 *  - a shared-memory snapshot ends the VMM, and restores from it continue the guest exactly where it
 *    stopped (its counter goes on from the next number); two children restored privately from one
 *    image share its pages; the parent gets memory of its own;
 *  - destroy leaves no process, cgroup or file;
 *  - a VM is taken over from its state dir (as a restarted node does): the handle sees it running,
 *    continues it when it was stopped, and a shared snapshot through it ends the VMM and restores;
 *    a VMM that has died gives a handle that is not alive and has no snapshot to finish;
 *  - QEMU runs under the CPU model of the snapshot's manifest; an unknown model is refused.
 * The guest is a busybox initramfs whose /init prints "KILN-GUEST-BOOTED" then "kiln-tick N" every
 * 0.2 s (mkimage.sh; run.sh passes its paths in KILN_GUEST_KERNEL/INITRD).
 * Fails when not root or QEMU is missing (never a skip: tests/skip-allowed.txt).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "test.h"
#include "vmm/accel.h"
#include "vmm/cgroup.h"
#include "vmm/disk.h"
#include "vmm/hv.h"
#include "vmm/jail.h"

#define BOOT_TIMEOUT_MS 30000

static char node[32], tap[16] = "kt0", data_dir[128], run_root[64];
static char netns[16][48], netns_paths[16][80];	/* one network namespace per VM, as in the product */
static unsigned n_netns;
static uid_t uids[16];
static unsigned n_uids;

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void sleep_ms(int ms)
{
	struct timespec ts = { .tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

static int run(const char *a0, ...)
{
	char *argv[16];
	va_list ap;
	int i = 0;

	argv[i++] = (char *)a0;
	va_start(ap, a0);
	while (i < 15 && (argv[i] = va_arg(ap, char *)))
		i++;
	va_end(ap);
	argv[i] = NULL;
	return disk_run(argv, NULL, 0);
}

/* Reads a whole small text file (up to 1 MiB) into a malloc'd string, or NULL. */
static char *slurp(const char *path)
{
	FILE *f = fopen(path, "re");
	char *s;
	size_t n;

	if (!f)
		return NULL;
	s = calloc(1, 1 << 20);
	n = s ? fread(s, 1, (1 << 20) - 1, f) : 0;
	if (s)
		s[n] = '\0';
	fclose(f);
	return s;
}

/* The first (first=1) or last tick number in a serial log, or -1. */
static long tick(const char *log, int first)
{
	char *s = slurp(log), *p;
	long t = -1;

	if (!s)
		return -1;
	for (p = s; (p = strstr(p, "kiln-tick ")); p += 10) {
		t = strtol(p + 10, NULL, 10);
		if (first)
			break;
	}
	free(s);
	return t;
}

static bool wait_text(const char *log, const char *text, int timeout_ms)
{
	double end = now_s() + timeout_ms / 1000.0;

	while (now_s() < end) {
		char *s = slurp(log);
		bool found = s && strstr(s, text);

		free(s);
		if (found)
			return true;
		sleep_ms(20);
	}
	return false;
}

static bool wait_tick_after(const char *log, long after, int timeout_ms)
{
	double end = now_s() + timeout_ms / 1000.0;

	while (now_s() < end) {
		if (tick(log, 0) > after)
			return true;
		sleep_ms(20);
	}
	return false;
}

/* The value of "Key:" in /proc/<pid>/status, or "" (static buffer). */
static const char *status_field(pid_t pid, const char *key)
{
	static char val[256];
	char path[64], *s, *p;

	val[0] = '\0';
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	s = slurp(path);
	if (s && (p = strstr(s, key)) && (p == s || p[-1] == '\n')) {
		p += strlen(key);
		while (*p == ':' || *p == ' ' || *p == '\t')
			p++;
		size_t n = strcspn(p, "\n");

		snprintf(val, sizeof(val), "%.*s", (int)n, p);
	}
	free(s);
	return val;
}

static bool same_ns(const char *a, const char *b)
{
	struct stat sa, sb;

	return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_ino == sb.st_ino && sa.st_dev == sb.st_dev;
}

/* Sets "cpu" of the snapshot's manifest.json to `cpu`. */
static void manifest_cpu(const char *snap, const char *cpu)
{
	char path[PATH_MAX];
	json_t *m;

	snprintf(path, sizeof(path), "%s/manifest.json", snap);
	m = json_load_file(path, 0, NULL);
	CHECK(m != NULL);
	if (!m)
		return;
	json_object_set_new(m, "cpu", json_string(cpu));
	CHECK(json_dump_file(m, path, 0) == 0);
	json_decref(m);
}

/* True when the process's command line holds `arg` as one argument. */
static bool cmdline_has(pid_t pid, const char *arg)
{
	char path[64], buf[8192];
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/proc/%d/cmdline", (int)pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n < 0)
		return false;
	buf[n] = '\0';
	for (ssize_t i = 0; i < n; i += (ssize_t)strlen(buf + i) + 1)
		if (strcmp(buf + i, arg) == 0)
			return true;
	return false;
}

/* kB of Shared_Clean + Shared_Dirty in the mapping of `size_kb` kB in /proc/<pid>/smaps. */
static long shared_kb_of_mapping(pid_t pid, long size_kb)
{
	char path[64], line[512];
	bool in = false;
	long shared = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/smaps", (int)pid);
	f = fopen(path, "re");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f)) {
		long v;

		if (sscanf(line, "Size: %ld kB", &v) == 1) {
			in = v == size_kb;
			if (in)
				shared = 0;
		} else if (in && (sscanf(line, "Shared_Clean: %ld kB", &v) == 1 ||
				  sscanf(line, "Shared_Dirty: %ld kB", &v) == 1)) {
			shared += v;
		} else if (in && strncmp(line, "VmFlags", 7) == 0) {
			break;
		}
	}
	fclose(f);
	return shared;
}

/*
 * The access modes (O_ACCMODE) process `pid` holds the file at `path` open with, ORed over its
 * descriptors of it (by device and inode); -1 when it holds none.
 */
static int accmode_of_file(pid_t pid, const char *path)
{
	char dir[64], p[PATH_MAX], line[128];
	struct stat want, st;
	struct dirent *d;
	int mode = -1;
	DIR *dh;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)pid);
	if (stat(path, &want) < 0 || !(dh = opendir(dir)))
		return -1;
	while ((d = readdir(dh))) {
		FILE *f;

		snprintf(p, sizeof(p), "%s/%s", dir, d->d_name);
		if (d->d_name[0] == '.' || stat(p, &st) < 0 || st.st_dev != want.st_dev ||
		    st.st_ino != want.st_ino)
			continue;
		snprintf(p, sizeof(p), "/proc/%d/fdinfo/%s", (int)pid, d->d_name);
		if (!(f = fopen(p, "re")))
			continue;
		while (fgets(line, sizeof(line), f)) {
			unsigned flags;

			if (sscanf(line, "flags: %o", &flags) == 1)
				mode = (mode < 0 ? 0 : mode) | (int)(flags & O_ACCMODE);
		}
		fclose(f);
	}
	closedir(dh);
	return mode;
}

/* Creates a throwaway network namespace with a TAP device for VM `id`; returns its path or NULL. */
static const char *make_netns(const char *id)
{
	char *name = netns[n_netns], *path = netns_paths[n_netns];

	snprintf(name, 48, "kiln-%s-%s", node, id);
	snprintf(path, 80, "/run/netns/%s", name);
	if (run("ip", "netns", "add", name, NULL) < 0)
		return NULL;
	n_netns++;
	if (run("ip", "-n", name, "tuntap", "add", tap, "mode", "tap", NULL) < 0 ||
	    run("ip", "-n", name, "link", "set", tap, "up", NULL) < 0)
		return NULL;
	return path;
}

static void spec_for(struct vmm_spec *s, const char *id, char *run_dir, char *state_dir, uid_t uid)
{
	snprintf(run_dir, 96, "%s/%s", run_root, id);
	snprintf(state_dir, PATH_MAX, "%s/%s", data_dir, id);
	*s = (struct vmm_spec){
		.id = id,
		.node = node,
		.vcpu_milli = 1000,
		.mem_mib = 256,
		.disk_gib = 1,
		.kernel = getenv("KILN_GUEST_KERNEL"),
		.initrd = getenv("KILN_GUEST_INITRD"),
		.netns_path = make_netns(id),
		.tap = tap,
		.run_dir = run_dir,
		.state_dir = state_dir,
		.uid = uid,
		.gid = uid,
	};
}

static uid_t lease_uid(void)
{
	uid_t u = 0;

	if (jail_uid_alloc(JAIL_LEASE_DIR, JAIL_UID_MIN, JAIL_UID_MAX, node, &u) == 0)
		uids[n_uids++] = u;
	return u;
}

/* What a jailed VMM must look like from the host. */
static void check_jailed(struct vmm_vm *vm, const char *id, uid_t uid, const char *run_dir,
			 const char *netns_path)
{
	struct vmm_status st;
	char path[PATH_MAX], link[PATH_MAX], want[PATH_MAX], uidline[64];
	struct cg *cg = NULL;
	long long quota = 0, period = 0;
	ssize_t n;

	CHECK(vmm_status(vm, &st, NULL) == KILN_OK && st.alive && st.running);
	snprintf(uidline, sizeof(uidline), "%u\t%u\t%u\t%u", uid, uid, uid, uid);
	CHECK_STR(status_field(st.pid, "Uid"), uidline);
	CHECK_STR(status_field(st.pid, "Gid"), uidline);
	CHECK_STR(status_field(st.pid, "Seccomp"), "2");
	CHECK_STR(status_field(st.pid, "NoNewPrivs"), "1");
	CHECK_STR(status_field(st.pid, "CapEff"), "0000000000000000");
	/* PID 1 of its own pid namespace */
	snprintf(want, sizeof(want), "%d\t1", (int)st.pid);
	CHECK_STR(status_field(st.pid, "NSpid"), want);
	snprintf(path, sizeof(path), "/proc/%d/ns/mnt", (int)st.pid);
	CHECK(!same_ns(path, "/proc/self/ns/mnt"));
	snprintf(path, sizeof(path), "/proc/%d/ns/net", (int)st.pid);
	CHECK(same_ns(path, netns_path));
	snprintf(path, sizeof(path), "/proc/%d/root", (int)st.pid);
	n = readlink(path, link, sizeof(link) - 1);
	link[n > 0 ? n : 0] = '\0';
	snprintf(want, sizeof(want), "%s/jail", run_dir);
	CHECK_STR(link, want);
	CHECK(cg_open(NULL, node, id, &cg) == 0);
	if (cg) {
		CHECK(cg_has_pid(cg, st.pid));
		CHECK(cg_read_cpu_quota(cg, &quota, &period) == 0);
		CHECK_INT(quota, 100000);	/* 1000 milli-vCPUs */
		CHECK_INT(period, 100000);
		cg_free(cg);
	}
}

static void check_gone(pid_t pid, const char *id, const char *run_dir, const char *state_dir)
{
	char path[PATH_MAX];
	struct stat st;

	CHECK(kill(pid, 0) < 0 && errno == ESRCH);
	snprintf(path, sizeof(path), "/sys/fs/cgroup/cpu/kiln/%s/%s", node, id);
	CHECK(stat(path, &st) < 0);
	snprintf(path, sizeof(path), "/sys/fs/cgroup/unified/kiln/%s/%s", node, id);
	CHECK(stat(path, &st) < 0);
	CHECK(stat(run_dir, &st) < 0);
	CHECK(stat(state_dir, &st) < 0);
	snprintf(path, sizeof(path), "/dev/shm/kiln-%s-%s.mem", node, id);
	CHECK(stat(path, &st) < 0);
}

#define TRACKED 16
static struct vmm_vm *vms[TRACKED];

static void track(struct vmm_vm *vm)
{
	for (int i = 0; i < TRACKED; i++)
		if (!vms[i]) {
			vms[i] = vm;
			return;
		}
}

static void untrack(struct vmm_vm *vm)
{
	for (int i = 0; i < TRACKED; i++)
		if (vms[i] == vm)
			vms[i] = NULL;
}

static void cleanup(void)
{
	char path[PATH_MAX];
	const char *ctl[] = { "cpu", "cpuacct", "memory", "pids", "unified" };

	for (int i = 0; i < TRACKED; i++)
		if (vms[i])
			vmm_destroy(vms[i], NULL);
	for (unsigned i = 0; i < n_netns; i++)
		run("ip", "netns", "del", netns[i], NULL);
	for (unsigned i = 0; i < n_uids; i++)
		jail_uid_release(JAIL_LEASE_DIR, uids[i]);
	for (size_t i = 0; i < sizeof(ctl) / sizeof(ctl[0]); i++) {
		snprintf(path, sizeof(path), "/sys/fs/cgroup/%s/kiln/%s", ctl[i], node);
		rmdir(path);
	}
	run("rm", "-rf", data_dir, run_root, NULL);
}

static struct {
	double boot, snapshot, restore_private, restore_copy;
} t;

static void test_lifecycle(void)
{
	char run_a[96], state_a[PATH_MAX], run_b[96], state_b[PATH_MAX], run_c[96], state_c[PATH_MAX];
	char run_p[96], state_p[PATH_MAX], snap[PATH_MAX], base[PATH_MAX];
	struct vmm_vm *a = NULL, *b = NULL, *c = NULL, *p = NULL;
	struct kiln_error err = { 0 };
	struct vmm_spec sa, sb, sc, sp;
	struct vmm_status st;
	struct cg_usage u;
	pid_t pid_a;
	long last;
	double t0;
	int fd;

	/* a small sparse base image: the guest boots from its initramfs, the disk layer is exercised */
	snprintf(base, sizeof(base), "%s/base.raw", data_dir);
	fd = open(base, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	CHECK(fd >= 0 && ftruncate(fd, 64 << 20) == 0);
	close(fd);

	spec_for(&sa, "a", run_a, state_a, lease_uid());
	sa.rootfs = base;
	t0 = now_s();
	CHECK(vmm_create("qemu", &sa, &a, &err) == KILN_OK);
	if (!a) {
		fprintf(stderr, "create: %s\n", err.msg);
		return;
	}
	track(a);
	CHECK(wait_text(vmm_serial_log(a), "KILN-GUEST-BOOTED", BOOT_TIMEOUT_MS));
	t.boot = now_s() - t0;
	check_jailed(a, "a", sa.uid, run_a, sa.netns_path);
	CHECK(vmm_usage(a, &u, NULL) == KILN_OK && u.cpu_ns > 0 && u.mem_bytes > 0);
	CHECK(strncmp(vmm_agent_socket(a), run_a, strlen(run_a)) == 0);

	/* pause stops the guest's counter; resume continues it */
	CHECK(wait_tick_after(vmm_serial_log(a), 2, 10000));
	CHECK(vmm_pause(a, NULL) == KILN_OK);
	CHECK(vmm_status(a, &st, NULL) == KILN_OK && st.alive && !st.running);
	last = tick(vmm_serial_log(a), 0);
	sleep_ms(600);
	CHECK_INT(tick(vmm_serial_log(a), 0), last);
	CHECK(vmm_resume(a, NULL) == KILN_OK);
	CHECK(wait_tick_after(vmm_serial_log(a), last, 5000));

	/* snapshot: the VMM ends, memory and disk layer move into the snapshot */
	snprintf(snap, sizeof(snap), "%s/snap1", data_dir);
	CHECK(vmm_status(a, &st, NULL) == KILN_OK);
	pid_a = st.pid;
	t0 = now_s();
	CHECK(vmm_snapshot(a, snap, VMM_SNAP_SHARED, &err) == KILN_OK);
	t.snapshot = now_s() - t0;
	if (err.code)
		fprintf(stderr, "snapshot: %s\n", err.msg);
	last = tick(vmm_serial_log(a), 0);
	CHECK(vmm_status(a, &st, NULL) == KILN_OK && !st.alive);
	CHECK(kill(pid_a, 0) < 0);
	untrack(a);
	CHECK(vmm_destroy(a, NULL) == KILN_OK);
	check_gone(pid_a, "a", run_a, state_a);

	/* two children share the frozen image; each continues from the next tick */
	spec_for(&sb, "b", run_b, state_b, lease_uid());
	spec_for(&sc, "c", run_c, state_c, lease_uid());
	t0 = now_s();
	CHECK(vmm_restore("qemu", &sb, snap, VMM_MEM_PRIVATE, &b, &err) == KILN_OK);
	t.restore_private = now_s() - t0;
	if (err.code)
		fprintf(stderr, "restore: %s\n", err.msg);
	track(b);
	CHECK(vmm_restore("qemu", &sc, snap, VMM_MEM_PRIVATE, &c, &err) == KILN_OK);
	if (err.code)
		fprintf(stderr, "restore c: %s\n", err.msg);
	track(c);
	/* the parent: memory of its own, copied from the image */
	spec_for(&sp, "p", run_p, state_p, lease_uid());
	t0 = now_s();
	CHECK(vmm_restore("qemu", &sp, snap, VMM_MEM_COPY, &p, NULL) == KILN_OK);
	t.restore_copy = now_s() - t0;
	track(p);
	if (!b || !c || !p)
		return;
	for (int i = 0; i < 3; i++) {
		struct vmm_vm *vm = i == 0 ? b : i == 1 ? c : p;

		CHECK(wait_tick_after(vmm_serial_log(vm), last + 2, 10000));
		CHECK_INT(tick(vmm_serial_log(vm), 1), last + 1);
	}
	check_jailed(b, "b", sb.uid, run_b, sb.netns_path);
	check_jailed(p, "p", sp.uid, run_p, sp.netns_path);
	{
		struct vmm_status sb_st, sc_st;
		long kb_b, kb_c;

		vmm_status(b, &sb_st, NULL);
		vmm_status(c, &sc_st, NULL);
		/* the model it was taken under */
		CHECK(cmdline_has(sb_st.pid, accel_detect() == ACCEL_TCG ? ACCEL_CPU_TCG ",enforce" : "host"));
		/* a restore loads the kernel's head only, bound into its jail and gone from the run dir */
		{
			char kp[64];
			struct stat ks, full;

			snprintf(kp, sizeof(kp), "/proc/%d/root/kernel", (int)sb_st.pid);
			CHECK(stat(kp, &ks) == 0 && stat(getenv("KILN_GUEST_KERNEL"), &full) == 0);
			CHECK(ks.st_size >= 8192 && ks.st_size < 256 * 1024 && ks.st_size < full.st_size);
			CHECK_INT((int)ks.st_nlink, 0);
		}
		/*
		 * the frozen image both children map: bound into their jails read-only and opened
		 * read-only (vmm/qemu_memro.c); the parent's copy, its own, read and written
		 */
		{
			char img[PATH_MAX + 8], own[PATH_MAX], bound[64];
			struct vmm_status sp_st;
			struct statvfs vfs;

			snprintf(img, sizeof(img), "%s/mem", snap);
			snprintf(own, sizeof(own), "/dev/shm/kiln-%s-p.mem", node);
			CHECK(vmm_status(p, &sp_st, NULL) == KILN_OK && sp_st.alive);
			CHECK_INT(accmode_of_file(sb_st.pid, img), O_RDONLY);
			CHECK_INT(accmode_of_file(sc_st.pid, img), O_RDONLY);
			CHECK_INT(accmode_of_file(sp_st.pid, img), -1);
			CHECK_INT(accmode_of_file(sp_st.pid, own), O_RDWR);
			snprintf(bound, sizeof(bound), "/proc/%d/root/mem", (int)sb_st.pid);
			CHECK(statvfs(bound, &vfs) == 0 && (vfs.f_flag & ST_RDONLY));
			snprintf(bound, sizeof(bound), "/proc/%d/root/mem", (int)sp_st.pid);
			CHECK(statvfs(bound, &vfs) == 0 && !(vfs.f_flag & ST_RDONLY));
		}
		kb_b = shared_kb_of_mapping(sb_st.pid, 256 * 1024);
		kb_c = shared_kb_of_mapping(sc_st.pid, 256 * 1024);
		fprintf(stderr, "guest memory shared between the children: %ld kB and %ld kB\n", kb_b, kb_c);
		CHECK(kb_b >= 4096 && kb_c >= 4096);
	}

	/*
	 * A restore begun ahead under one name and ended under another (a VMM started before the
	 * request it serves): the VM continues as the second, jailed as any, nothing left of the
	 * first; one begun and never ended goes whole.
	 */
	{
		struct vmm_spec sw, se, sx;
		char run_w[96], state_w[PATH_MAX], run_e[96], state_e[PATH_MAX], run_x[96];
		char state_x[PATH_MAX], path[PATH_MAX + 16];
		struct vmm_vm *e = NULL, *x = NULL;
		struct vmm_status est, xst;
		uid_t wu = lease_uid();
		json_t *rec;
		struct stat sst;

		spec_for(&sw, "aw", run_w, state_w, wu);
		spec_for(&se, "ae", run_e, state_e, wu);
		se.netns_path = sw.netns_path;
		CHECK(vmm_restore_begin("qemu", &sw, snap, VMM_MEM_COPY, &e, &err) == KILN_OK);
		track(e);
		CHECK(e && vmm_status(e, &est, NULL) == KILN_OK && est.alive && !est.running);
		/* another shape is refused, and the VM goes */
		se.mem_mib = 512;
		if (e)
			CHECK(vmm_restore_end(e, &se, &err) == KILN_E_INVALID);
		untrack(e);
		if (e)
			check_gone(est.pid, "aw", run_w, state_w);
		kiln_error_clear(&err);
		se.mem_mib = 256;
		CHECK(vmm_restore_begin("qemu", &sw, snap, VMM_MEM_COPY, &e, &err) == KILN_OK);
		track(e);
		CHECK(e && vmm_status(e, &est, NULL) == KILN_OK && est.alive && !est.running);
		if (e && vmm_restore_end(e, &se, &err) != KILN_OK) {
			fprintf(stderr, "restore end: %s\n", err.msg);
			untrack(e);
			e = NULL;
		}
		CHECK(e != NULL);
		if (e) {
			CHECK(wait_tick_after(vmm_serial_log(e), last + 2, 10000));
			CHECK_INT(tick(vmm_serial_log(e), 1), last + 1);
			check_jailed(e, "ae", wu, run_e, sw.netns_path);
			vmm_status(e, &est, NULL);
			CHECK(strncmp(vmm_serial_log(e), state_e, strlen(state_e)) == 0);
			CHECK(strncmp(vmm_agent_socket(e), run_e, strlen(run_e)) == 0);
			/* the first name is gone: directories, memory file, cgroup */
			CHECK(stat(run_w, &sst) < 0 && stat(state_w, &sst) < 0);
			snprintf(path, sizeof(path), "/dev/shm/kiln-%s-aw.mem", node);
			CHECK(stat(path, &sst) < 0);
			snprintf(path, sizeof(path), "/dev/shm/kiln-%s-ae.mem", node);
			CHECK(stat(path, &sst) == 0);
			snprintf(path, sizeof(path), "/sys/fs/cgroup/cpu/kiln/%s/aw", node);
			CHECK(stat(path, &sst) < 0);
			/* vm.json names the VM as it now is: a restart of the node takes it over so */
			snprintf(path, sizeof(path), "%s/vm.json", state_e);
			rec = json_load_file(path, 0, NULL);
			CHECK(rec && strcmp(json_string_value(json_object_get(rec, "id")) ?: "", "ae") == 0);
			CHECK(rec && strcmp(json_string_value(json_object_get(rec, "run_dir")) ?: "", run_e) == 0);
			json_decref(rec);
			untrack(e);
			CHECK(vmm_destroy(e, NULL) == KILN_OK);
			check_gone(est.pid, "ae", run_e, state_e);
		}
		spec_for(&sx, "ax", run_x, state_x, wu);
		CHECK(vmm_restore_begin("qemu", &sx, snap, VMM_MEM_COPY, &x, &err) == KILN_OK);
		if (x) {
			CHECK(vmm_status(x, &xst, NULL) == KILN_OK && xst.alive);
			CHECK(vmm_destroy(x, NULL) == KILN_OK);
			check_gone(xst.pid, "ax", run_x, state_x);
		}
	}

	/* a full snapshot keeps the VM; a restore from it continues too */
	{
		char snap2[PATH_MAX], run_d[96], state_d[PATH_MAX];
		struct vmm_spec sd;
		struct vmm_vm *d = NULL;

		snprintf(snap2, sizeof(snap2), "%s/snap2", data_dir);
		CHECK(vmm_snapshot(p, snap2, VMM_SNAP_FULL, &err) == KILN_OK);
		last = tick(vmm_serial_log(p), 0);
		CHECK(vmm_status(p, &st, NULL) == KILN_OK && st.alive && !st.running);
		CHECK(vmm_resume(p, NULL) == KILN_OK);
		CHECK(wait_tick_after(vmm_serial_log(p), last, 5000));
		spec_for(&sd, "d", run_d, state_d, lease_uid());
		/* a model this node does not run is refused, before anything of the snapshot is used */
		manifest_cpu(snap2, "Opteron_G1");
		CHECK(vmm_restore("qemu", &sd, snap2, VMM_MEM_MOVE, &d, &err) == KILN_E_CONFLICT);
		CHECK(d == NULL);
		memset(&err, 0, sizeof(err));
		manifest_cpu(snap2, accel_detect() == ACCEL_TCG ? ACCEL_CPU_TCG : "host");
		CHECK(vmm_restore("qemu", &sd, snap2, VMM_MEM_MOVE, &d, &err) == KILN_OK);
		if (err.code)
			fprintf(stderr, "full restore: %s\n", err.msg);
		track(d);
		if (d) {
			CHECK(wait_tick_after(vmm_serial_log(d), last + 1, 10000));
			CHECK_INT(tick(vmm_serial_log(d), 1), last + 1);
			vmm_status(d, &st, NULL);
			untrack(d);
			CHECK(vmm_destroy(d, NULL) == KILN_OK);
			check_gone(st.pid, "d", run_d, state_d);
		}
	}

	/* destroy leaves nothing */
	struct vmm_vm *all[] = { b, c, p };
	const char *ids[] = { "b", "c", "p" };
	char *runs[] = { run_b, run_c, run_p }, *states[] = { state_b, state_c, state_p };

	for (int i = 0; i < 3; i++) {
		vmm_status(all[i], &st, NULL);
		untrack(all[i]);
		CHECK(vmm_destroy(all[i], NULL) == KILN_OK);
		check_gone(st.pid, ids[i], runs[i], states[i]);
	}
}

/*
 * Starts VM `s` in a child process that then exits without destroying it, as a killed node leaves
 * its VMs (the VMM outlives it; this process, a subreaper, inherits it). `stopped`: its vCPUs are
 * stopped first, as a pause cut short leaves them. Returns the VMM's pid, or 0.
 */
static pid_t orphan_vm(const struct vmm_spec *s, bool stopped)
{
	int fds[2], status;
	pid_t child, vmm = 0;

	if (pipe(fds) < 0)
		return 0;
	child = fork();
	if (child == 0) {
		struct vmm_vm *vm = NULL;
		struct vmm_status st = { 0 };

		close(fds[0]);
		if (vmm_create("qemu", s, &vm, NULL) == KILN_OK &&
		    wait_tick_after(vmm_serial_log(vm), 2, BOOT_TIMEOUT_MS) &&
		    (!stopped || vmm_pause(vm, NULL) == KILN_OK) && vmm_status(vm, &st, NULL) == KILN_OK &&
		    write(fds[1], &st.pid, sizeof(st.pid)) != sizeof(st.pid))
			st.pid = 0;
		_exit(0);
	}
	close(fds[1]);
	if (child > 0 && read(fds[0], &vmm, sizeof(vmm)) != sizeof(vmm))
		vmm = 0;
	close(fds[0]);
	if (child > 0)
		waitpid(child, &status, 0);
	return vmm;
}

static void test_adopt(void)
{
	char run_e[96], state_e[PATH_MAX], run_f[96], state_f[PATH_MAX], run_h[96], state_h[PATH_MAX];
	char snap[PATH_MAX], base[PATH_MAX], serial[PATH_MAX + 16];
	struct vmm_vm *e = NULL, *f = NULL, *h = NULL;
	struct kiln_error err = { 0 };
	struct vmm_spec se, sf, sh;
	struct vmm_status st;
	pid_t pid;
	long last;

	snprintf(base, sizeof(base), "%s/base.raw", data_dir);
	spec_for(&se, "e", run_e, state_e, lease_uid());
	se.rootfs = base;
	snprintf(serial, sizeof(serial), "%s/serial.log", state_e);	/* the console lives on disk */
	pid = orphan_vm(&se, true);
	CHECK(pid > 0);
	if (pid <= 0)
		return;

	/* nothing recorded there: not found */
	CHECK(vmm_adopt("qemu", data_dir, &e, NULL) == KILN_E_NOT_FOUND && !e);
	/* the VM left stopped: taken over (the same process), continued */
	last = tick(serial, 0);
	CHECK(vmm_adopt("qemu", state_e, &e, &err) == KILN_OK);
	if (!e) {
		fprintf(stderr, "adopt: %s\n", err.msg);
		return;
	}
	track(e);
	CHECK(vmm_status(e, &st, NULL) == KILN_OK && st.alive && st.running && st.pid == pid);
	CHECK(wait_tick_after(serial, last, 5000));
	/* a shared snapshot through the adopted handle ends the VMM; a restore goes on from it */
	snprintf(snap, sizeof(snap), "%s/snap-adopted", data_dir);
	CHECK(vmm_snapshot(e, snap, VMM_SNAP_SHARED, &err) == KILN_OK);
	if (err.code)
		fprintf(stderr, "snapshot: %s\n", err.msg);
	last = tick(serial, 0);
	CHECK(vmm_status(e, &st, NULL) == KILN_OK && !st.alive);
	CHECK(vmm_snapshot_finish(e, snap, NULL) == KILN_OK);	/* whole already: nothing to do */
	untrack(e);
	CHECK(vmm_destroy(e, NULL) == KILN_OK);
	while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
		;
	check_gone(pid, "e", run_e, state_e);
	spec_for(&sf, "f", run_f, state_f, lease_uid());
	CHECK(vmm_restore("qemu", &sf, snap, VMM_MEM_MOVE, &f, &err) == KILN_OK);
	if (err.code)
		fprintf(stderr, "restore: %s\n", err.msg);
	if (f) {
		track(f);
		CHECK(wait_tick_after(vmm_serial_log(f), last + 1, 10000));
		CHECK_INT(tick(vmm_serial_log(f), 1), last + 1);
		untrack(f);
		CHECK(vmm_destroy(f, NULL) == KILN_OK);
	}

	/* a VMM that died: a handle that is not alive, with no snapshot begun to finish */
	spec_for(&sh, "h", run_h, state_h, lease_uid());
	pid = orphan_vm(&sh, false);
	CHECK(pid > 0 && kill(pid, SIGKILL) == 0);
	while (pid > 0 && waitpid(pid, NULL, 0) < 0 && errno == EINTR)
		;
	CHECK(vmm_adopt("qemu", state_h, &h, &err) == KILN_OK);
	if (h) {
		track(h);
		CHECK(vmm_status(h, &st, NULL) == KILN_OK && !st.alive);
		snprintf(snap, sizeof(snap), "%s/snap-none", data_dir);
		CHECK(vmm_snapshot_finish(h, snap, NULL) == KILN_E_NOT_FOUND);
		untrack(h);
		CHECK(vmm_destroy(h, NULL) == KILN_OK);
		check_gone(pid, "h", run_h, state_h);
	}
}

int main(void)
{
	if (geteuid() != 0) {
		fprintf(stderr, "FAIL: needs root (namespaces, cgroups, TAP)\n");
		return 1;
	}
	if (access("/usr/bin/qemu-system-x86_64", X_OK) != 0 || !getenv("KILN_GUEST_KERNEL")) {
		fprintf(stderr, "FAIL: needs qemu-system-x86_64 and KILN_GUEST_KERNEL (run via run.sh)\n");
		return 1;
	}
	snprintf(node, sizeof(node), "test%d", (int)getpid());
	snprintf(data_dir, sizeof(data_dir), "/var/tmp/kiln-test-%d", (int)getpid());
	snprintf(run_root, sizeof(run_root), "/run/kiln/%s", node);
	mkdir(data_dir, 0755);
	prctl(PR_SET_CHILD_SUBREAPER, 1);	/* test_adopt's VMs outlive the process that started them */
	TEST(test_lifecycle);
	TEST(test_adopt);
	cleanup();
	fprintf(stderr, "boot to marker %.2f s, snapshot %.3f s, restore (private) %.3f s, restore (copy) %.3f s\n",
		t.boot, t.snapshot, t.restore_private, t.restore_copy);
	return test_summary();
}
