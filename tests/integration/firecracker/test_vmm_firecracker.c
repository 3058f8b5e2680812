/*
 * test_vmm_firecracker.c - drives the Firecracker driver through the vmm API against the
 * spec-validating stand-in (fc_standin.py; no VM runs) started by a fake jailer, and checks what a
 * caller of the node would rely on:
 *  - create, pause, a shared snapshot (the VMM ends), destroy (no file left behind);
 *  - restore of a fork child (memory image hard-linked, not copied: the File backend maps it
 *    privately) with another TAP name, a full snapshot that leaves it paused, resume, destroy;
 *  - restore that takes the image over (MOVE): the snapshot loses it;
 *  - the agent socket reaches the guest's vsock port through Firecracker's CONNECT/OK handshake;
 *  - a restore of a snapshot of another shape is refused before anything starts;
 *  - a restore with a larger disk_gib grows the disk and names it again (PATCH path_on_host), one
 *    with a smaller disk_gib than the snapshot's is refused before anything starts;
 *  - a request Firecracker refuses (an injected 400) fails vmm_create with its fault message, and
 *    the half-made VM is cleaned up;
 *  - the drive's rate limiter carries the spec's disk_iops and disk_bps (kiln-node's figures per
 *    whole vCPU), a 0 figure none, and a restore sets the restoring spec's (run_test.py checks the
 *    bodies and the drives the stand-in ends up with).
 * run_test.py runs it and then checks the exact API calls in the stand-in's log, each validated
 * against tests/fixtures/firecracker/firecracker-openapi.yaml.
 * Environment: FC_BIN, FC_BIN_FAIL (fake firecracker binaries; a "jailer" sits beside each),
 * FC_WORK (a scratch directory holding img/vmlinux, img/initrd, img/rootfs.raw).
 */
#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "test.h"
#include "vmm/hv.h"

static const char *bin, *bin_fail, *work;
static char kernel[PATH_MAX], initrd[PATH_MAX], rootfs[PATH_MAX];
static char snap1[PATH_MAX], snap2[PATH_MAX];

/* kiln-node's defaults (disk_iops_per_vcpu, disk_mibps_per_vcpu), times the whole vCPUs */
#define IOPS_PER_VCPU 2000u
#define MIBPS_PER_VCPU 64ull

/* snprintf into an array, checking it fits */
#define FMT(buf, ...) CHECK(snprintf((buf), sizeof(buf), __VA_ARGS__) < (int)sizeof(buf))

struct names {
	char run[PATH_MAX], state[PATH_MAX];
};

static struct vmm_spec spec_for(const char *id, const char *tap, struct names *n)
{
	snprintf(n->run, sizeof(n->run), "%s/run/%s", work, id);
	snprintf(n->state, sizeof(n->state), "%s/state/%s", work, id);
	return (struct vmm_spec){
		.id = id, .node = "fctest", .vcpu_milli = 1500, .mem_mib = 128, .kernel = kernel,
		.initrd = initrd, .rootfs = rootfs, .cmdline_extra = "kiln.test=1",
		.netns_path = "/run/netns/kiln-fc-test", .tap = tap, .run_dir = n->run, .state_dir = n->state,
		.uid = 64001, .gid = 64001, .hv_binary = bin,
		.disk_iops = IOPS_PER_VCPU * vmm_vcpus_whole(1500),
		.disk_bps = (MIBPS_PER_VCPU << 20) * vmm_vcpus_whole(1500),
	};
}

static bool exists(const char *p)
{
	struct stat st;

	return lstat(p, &st) == 0;
}

/* Sends a line through the agent socket and expects the stand-in's echo. */
static bool agent_echo(struct vmm_vm *vm)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	const char *path = vmm_agent_socket(vm);
	char buf[32] = { 0 };
	size_t got = 0;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	bool ok = false;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || write(fd, "kiln-ping\n", 10) != 10)
		goto out;
	while (got < 10) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		ssize_t r;

		if (poll(&p, 1, 5000) <= 0)
			goto out;
		r = read(fd, buf + got, sizeof(buf) - 1 - got);
		if (r <= 0)
			goto out;
		got += (size_t)r;
	}
	ok = memcmp(buf, "kiln-ping\n", 10) == 0;
out:
	if (fd >= 0)
		close(fd);
	return ok;
}

static void test_create_pause_snapshot_destroy(void)
{
	struct kiln_error err = { 0 };
	struct vmm_status st;
	struct names n;
	struct vmm_spec s = spec_for("fc-a", "tap0", &n);
	struct vmm_vm *vm = NULL;
	char path[PATH_MAX];

	CHECK_INT(vmm_create("firecracker", &s, &vm, &err), KILN_OK);
	if (!vm) {
		fprintf(stderr, "create: %s\n", err.msg);
		return;
	}
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(st.alive && st.running && st.pid > 1);
	CHECK(agent_echo(vm));
	FMT(path, "%s/serial.log", n.state);
	CHECK_STR(vmm_serial_log(vm), path);
	CHECK_INT(vmm_pause(vm, &err), KILN_OK);
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(st.alive && !st.running);
	CHECK_INT(vmm_snapshot(vm, snap1, VMM_SNAP_SHARED, &err), KILN_OK);
	if (err.msg[0])
		fprintf(stderr, "snapshot: %s\n", err.msg);
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(!st.alive && !st.running && st.pid == 0);
	for (const char *f = "manifest.json\0state\0mem\0disk.raw\0"; *f; f += strlen(f) + 1) {
		FMT(path, "%s/%s", snap1, f);
		if (!exists(path))
			fprintf(stderr, "missing %s\n", path);
		CHECK(exists(path));
	}
	CHECK_INT(vmm_destroy(vm, &err), KILN_OK);
	CHECK(!exists(n.run));
	CHECK(!exists(n.state));
}

static void test_restore_refuses_other_shape(void)
{
	struct kiln_error err = { 0 };
	struct names n;
	struct vmm_spec s = spec_for("fc-shape", "tap0", &n);
	struct vmm_vm *vm = NULL;

	s.mem_mib = 256;
	CHECK_INT(vmm_restore("firecracker", &s, snap1, VMM_MEM_PRIVATE, &vm, &err), KILN_E_CONFLICT);
	CHECK(vm == NULL);
	CHECK(strstr(err.msg, "shape differs") != NULL);
	CHECK(!exists(n.run));
}

static void test_restore_private_child_then_full_snapshot(void)
{
	struct kiln_error err = { 0 };
	struct vmm_status st;
	struct names n;
	struct vmm_spec s = spec_for("fc-b", "tap1", &n);
	struct vmm_vm *vm = NULL;
	char mem[PATH_MAX];
	struct stat sb;

	s.disk_iops = 0;	/* the snapshot's ops bucket goes, its bandwidth bucket changes */
	s.disk_bps = 32ull << 20;

	CHECK_INT(vmm_restore("firecracker", &s, snap1, VMM_MEM_PRIVATE, &vm, &err), KILN_OK);
	if (!vm) {
		fprintf(stderr, "restore: %s\n", err.msg);
		return;
	}
	/* the image is shared by a hard link, not copied; the snapshot keeps it */
	FMT(mem, "%s/mem", snap1);
	CHECK(stat(mem, &sb) == 0 && sb.st_nlink == 2);
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(st.alive && st.running);
	CHECK(agent_echo(vm));
	CHECK_INT(vmm_snapshot(vm, snap2, VMM_SNAP_FULL, &err), KILN_OK);
	if (err.msg[0])
		fprintf(stderr, "snapshot: %s\n", err.msg);
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(st.alive && !st.running);
	CHECK_INT(vmm_resume(vm, &err), KILN_OK);
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(st.alive && st.running);
	CHECK_INT(vmm_destroy(vm, &err), KILN_OK);
	CHECK(stat(mem, &sb) == 0 && sb.st_nlink == 1);
	CHECK(!exists(n.run) && !exists(n.state));
}

static void test_restore_move_takes_image(void)
{
	struct kiln_error err = { 0 };
	struct vmm_status st;
	struct names n;
	struct vmm_spec s = spec_for("fc-c", "tap0", &n);
	struct vmm_vm *vm = NULL;
	char mem[PATH_MAX];

	s.disk_iops = 0;	/* no limit: both buckets of the snapshot's limiter go */
	s.disk_bps = 0;

	CHECK_INT(vmm_restore("firecracker", &s, snap2, VMM_MEM_MOVE, &vm, &err), KILN_OK);
	if (!vm) {
		fprintf(stderr, "restore: %s\n", err.msg);
		return;
	}
	FMT(mem, "%s/mem", snap2);
	CHECK(!exists(mem));
	CHECK_INT(vmm_status(vm, &st, &err), KILN_OK);
	CHECK(st.alive && st.running);
	CHECK_INT(vmm_destroy(vm, &err), KILN_OK);
	CHECK(!exists(n.run) && !exists(n.state));
}

/* The file size of the VM's disk inside its chroot (wherever the jailer put the root), or -1. */
static long long jailed_disk_size(const char *state)
{
	char pattern[PATH_MAX];
	glob_t g;
	long long size = -1;
	struct stat st;

	FMT(pattern, "%s/*/*/root/rootfs", state);
	if (glob(pattern, 0, NULL, &g) == 0 && g.gl_pathc == 1 && stat(g.gl_pathv[0], &st) == 0)
		size = (long long)st.st_size;
	globfree(&g);
	return size;
}

/*
 * A restore with a larger disk_gib grows the disk file and names it again in its PATCH, so that
 * Firecracker rereads its size and tells the guest; a smaller one is refused before anything runs.
 */
static void test_restore_grows_disk_and_refuses_a_smaller_one(void)
{
	struct kiln_error err = { 0 };
	struct names n, m;
	struct vmm_spec s = spec_for("fc-g", "tap0", &n), t = spec_for("fc-small", "tap0", &m);
	struct vmm_vm *vm = NULL;
	char snap3[PATH_MAX], disk[PATH_MAX];
	struct stat st;

	FMT(snap3, "%s/state/snap3", work);
	s.disk_gib = 2;		/* snap1's disk is the 64 MiB image */
	CHECK_INT(vmm_restore("firecracker", &s, snap1, VMM_MEM_COPY, &vm, &err), KILN_OK);
	if (!vm) {
		fprintf(stderr, "restore: %s\n", err.msg);
		return;
	}
	CHECK(jailed_disk_size(n.state) == 2ll << 30);
	CHECK_INT(vmm_snapshot(vm, snap3, VMM_SNAP_FULL, &err), KILN_OK);
	FMT(disk, "%s/disk.raw", snap3);
	CHECK(stat(disk, &st) == 0 && st.st_size == 2ll << 30);
	CHECK_INT(vmm_destroy(vm, &err), KILN_OK);
	vm = NULL;
	t.disk_gib = 1;
	CHECK_INT(vmm_restore("firecracker", &t, snap3, VMM_MEM_COPY, &vm, &err), KILN_E_INVALID);
	CHECK(vm == NULL);
	CHECK(strstr(err.msg, "smaller than the snapshot's 2 GiB") != NULL);
	CHECK(!exists(m.run) && !exists(m.state));
}

static void test_refused_request_fails_create_and_cleans_up(void)
{
	struct kiln_error err = { 0 };
	struct names n;
	struct vmm_spec s = spec_for("fc-fail", "tap0", &n);
	struct vmm_vm *vm = NULL;

	s.hv_binary = bin_fail;
	CHECK_INT(vmm_create("firecracker", &s, &vm, &err), KILN_E_INTERNAL);
	CHECK(vm == NULL);
	fprintf(stderr, "expected error: %s\n", err.msg);
	CHECK(strstr(err.msg, "PUT /drives/rootfs: 400 injected fault") != NULL);
	CHECK(!exists(n.run) && !exists(n.state));
}

/* No limits: the drive has no rate limiter; ops only: no bandwidth bucket. */
static void test_drive_without_or_with_partial_limits(void)
{
	struct kiln_error err = { 0 };
	struct names n;
	struct vmm_spec s = spec_for("fc-d", "tap0", &n);
	struct vmm_vm *vm = NULL;

	s.disk_iops = 0;
	s.disk_bps = 0;
	CHECK_INT(vmm_create("firecracker", &s, &vm, &err), KILN_OK);
	if (vm)
		CHECK_INT(vmm_destroy(vm, &err), KILN_OK);
	vm = NULL;
	s = spec_for("fc-e", "tap0", &n);
	s.disk_bps = 0;
	CHECK_INT(vmm_create("firecracker", &s, &vm, &err), KILN_OK);
	if (vm)
		CHECK_INT(vmm_destroy(vm, &err), KILN_OK);
	CHECK(!exists(n.run) && !exists(n.state));
}

static void test_spec_errors_before_start(void)
{
	struct kiln_error err = { 0 };
	struct names n;
	struct vmm_spec s = spec_for("fc_underscore", "tap0", &n);
	struct vmm_vm *vm = NULL;

	CHECK_INT(vmm_create("firecracker", &s, &vm, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "jailer") != NULL);
	kiln_error_clear(&err);
	s = spec_for("fc-nobin", "tap0", &n);
	s.hv_binary = "/usr/bin/true";
	CHECK_INT(vmm_create("firecracker", &s, &vm, &err), KILN_E_INVALID);
	CHECK(strstr(err.msg, "hv_binary") != NULL);
	CHECK(!exists(n.run));
}

int main(void)
{
	bin = getenv("FC_BIN");
	bin_fail = getenv("FC_BIN_FAIL");
	work = getenv("FC_WORK");
	if (!bin || !bin_fail || !work) {
		fprintf(stderr, "FC_BIN, FC_BIN_FAIL and FC_WORK are required (run_test.py sets them)\n");
		return 2;
	}
	snprintf(kernel, sizeof(kernel), "%s/img/vmlinux", work);
	snprintf(initrd, sizeof(initrd), "%s/img/initrd", work);
	snprintf(rootfs, sizeof(rootfs), "%s/img/rootfs.raw", work);
	snprintf(snap1, sizeof(snap1), "%s/state/snap1", work);
	snprintf(snap2, sizeof(snap2), "%s/state/snap2", work);
	TEST(test_spec_errors_before_start);
	TEST(test_create_pause_snapshot_destroy);
	TEST(test_restore_refuses_other_shape);
	TEST(test_restore_private_child_then_full_snapshot);
	TEST(test_restore_move_takes_image);
	TEST(test_restore_grows_disk_and_refuses_a_smaller_one);
	TEST(test_refused_request_fails_create_and_cleans_up);
	TEST(test_drive_without_or_with_partial_limits);
	return test_summary();
}
