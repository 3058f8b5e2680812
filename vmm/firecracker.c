/*
 * firecracker.c - the Firecracker driver: Firecracker started by its jailer, driven over its REST
 * API (fc_api.h; tests/fixtures/firecracker/firecracker-openapi.yaml). docs/firecracker.md
 * describes it.
 *
 * Files of one VM:
 *   <state_dir>/<fc>/<id>/root/          the jailer's chroot (<fc> = the Firecracker binary's
 *                                        file name); Firecracker names everything relative to it:
 *     kernel, initrd                     hard links of the image's files (copies when they cannot be)
 *     rootfs                             the VM's own raw disk: a sparse copy of the base image
 *                                        (Firecracker has no copy-on-write disk formats)
 *     api.sock                           the API socket Firecracker binds
 *     v.sock                             the vsock device's Unix socket (host-initiated connections)
 *     snap/state, snap/mem               a snapshot being written, or the one being loaded
 *   <run_dir>/api.sock, vsock.sock       symlinks to the two sockets above (a chroot path is too
 *                                        long for sun_path; connect(2) follows symlinks)
 *   <run_dir>/agent.sock                 the agent channel: a socket this driver listens on and
 *                                        relays to guest vsock port FC_AGENT_PORT (below)
 *   <state_dir>/serial.log(.old)         the guest console (ttyS0): Firecracker's stdout, a pipe
 *                                        drained into a capped log (hv_console_start)
 *   <run_dir>/firecracker.log            the jailer's and Firecracker's stderr
 * The chroot lives under state_dir (a disk, not tmpfs) so that the disk, snapshot images and the
 * memory image a restore maps are hard links on one file system, not copies.
 *
 * Memory: Firecracker backs a booted guest with anonymous memory. A snapshot writes the guest
 * memory to a file (snapshot_type Full); a restore loads it with mem_backend File, which Firecracker
 * maps MAP_PRIVATE: copy-on-write sharing of the image between every VM restored from it, i.e.
 * VMM_MEM_PRIVATE. enum vmm_mem_from only decides who owns the image (hv.h; docs/firecracker.md).
 */
#include "common/fsutil.h"
#include "vmm/hv.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "vmm/cgroup.h"
#include "vmm/disk.h"
#include "vmm/fc_api.h"
#include "vmm/hv_base.h"

#define FC_BINARY_DEFAULT "/usr/local/bin/firecracker"	/* the jailer is "jailer" beside it */
#define FC_API_MS 5000		/* one configuration call */
#define FC_SNAP_MS 120000	/* snapshot create/load: scales with guest memory */
#define FC_START_MS 10000	/* jailer start to the API answering */
#define FC_PIDS_MAX 64		/* threads of one Firecracker: API, VMM, vCPUs */
#define FC_GUEST_CID 3		/* every VM has its own vsock device: the same CID everywhere */
#define FC_AGENT_PORT 1024	/* guest vsock port kiln-agent listens on under Firecracker */
#define FC_HANDSHAKE_MS 5000	/* CONNECT <port> to OK <port> */
#define FC_SOCK_MAX 107
#define FC_SNAP_FORMAT 1
#define FC_BOOT_ARGS "console=ttyS0 reboot=k panic=1 pci=off quiet"

/* Names inside the chroot, as Firecracker sees them. */
#define IN_KERNEL "/kernel"
#define IN_INITRD "/initrd"
#define IN_ROOTFS "/rootfs"
#define IN_API "/api.sock"
#define IN_VSOCK "/v.sock"
#define IN_SNAP_STATE "/snap/state"
#define IN_SNAP_MEM "/snap/mem"

struct hv_vm {
	char id[VMM_ID_MAX + 1];
	char node[VMM_ID_MAX + 1];
	unsigned vcpus, vcpu_milli, mem_mib;
	uid_t uid;
	gid_t gid;
	char run_dir[PATH_MAX], state_dir[PATH_MAX];
	char fc_binary[PATH_MAX], jailer[PATH_MAX];
	char jail_dir[PATH_MAX];	/* <state_dir>/<fc>/<id>: removed on destroy */
	char root[PATH_MAX];		/* <jail_dir>/root, the chroot */
	char api_link[PATH_MAX], vsock_link[PATH_MAX], agent_path[PATH_MAX];
	char serial_path[PATH_MAX], serial_old[PATH_MAX], log_path[PATH_MAX];
	unsigned long long console_max;
	struct hv_console *console;	/* drains Firecracker's stdout, or NULL */
	char kernel[PATH_MAX], initrd[PATH_MAX];	/* host paths; initrd "" for none */
	bool has_disk, has_net;
	unsigned disk_iops;		/* the drive's rate limiter: ops/s and bytes/s, 0 = none */
	unsigned long long disk_bps;
	char tap[16];
	struct fc_api *api;
	struct cg *cg;
	struct hv_proc proc;	/* Firecracker (the jailer's child in its pid namespace), not ours */
	bool paused;
	/* agent relay */
	pthread_t relay;
	bool relay_on;
	int listen_fd;
	int stop_pipe[2];
};

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- names ---- */

/* Fills the handle's names and paths from the spec. The jailer allows [A-Za-z0-9-] in an id. */
static enum kiln_err vm_init(struct hv_vm *vm, const struct vmm_spec *s, struct kiln_error *err)
{
	const char *bin = s->hv_binary ? s->hv_binary : FC_BINARY_DEFAULT;
	const char *base = strrchr(bin, '/');
	bool ok = true;

	hv_proc_init(&vm->proc);
	vm->listen_fd = -1;
	vm->stop_pipe[0] = vm->stop_pipe[1] = -1;
	if (strchr(s->id, '_'))
		return kiln_error_set(err, KILN_E_INVALID, "id: firecracker's jailer allows [A-Za-z0-9-] only");
	if (bin[0] != '/' || !base || !strstr(base + 1, "firecracker"))
		return kiln_error_set(err, KILN_E_INVALID,
				      "hv_binary: an absolute path whose file name contains 'firecracker'");
	snprintf(vm->id, sizeof(vm->id), "%s", s->id);
	snprintf(vm->node, sizeof(vm->node), "%s", s->node);
	vm->vcpu_milli = s->vcpu_milli;
	vm->vcpus = vmm_vcpus_whole(s->vcpu_milli);
	vm->mem_mib = s->mem_mib;
	vm->disk_iops = s->disk_iops;
	vm->disk_bps = s->disk_bps;
	vm->uid = s->uid;
	vm->gid = s->gid;
	vm->has_net = s->netns_path != NULL;
	if (vm->has_net)
		snprintf(vm->tap, sizeof(vm->tap), "%s", s->tap);
	ok &= fs_path(vm->fc_binary, "%s", bin);
	ok &= fs_path(vm->jailer, "%.*s/jailer", (int)(base - bin), bin);
	ok &= fs_path(vm->run_dir, "%s", s->run_dir);
	ok &= fs_path(vm->state_dir, "%s", s->state_dir);
	ok &= fs_path(vm->jail_dir, "%s/%s/%s", s->state_dir, base + 1, s->id);
	ok &= fs_path(vm->root, "%s/root", vm->jail_dir);
	ok &= fs_path(vm->api_link, "%s/api.sock", s->run_dir);
	ok &= fs_path(vm->vsock_link, "%s/vsock.sock", s->run_dir);
	ok &= fs_path(vm->agent_path, "%s/agent.sock", s->run_dir);
	ok &= fs_path(vm->serial_path, "%s/serial.log", s->state_dir);
	ok &= fs_path(vm->serial_old, "%s/serial.log.old", s->state_dir);
	vm->console_max = s->console_max;
	ok &= fs_path(vm->log_path, "%s/firecracker.log", s->run_dir);
	ok &= fs_path(vm->kernel, "%s", s->kernel);
	ok &= fs_path(vm->initrd, "%s", s->initrd ? s->initrd : "");
	if (!ok)
		return kiln_error_set(err, KILN_E_INVALID, "a path of vm '%s' is too long", s->id);
	if (strlen(vm->agent_path) > FC_SOCK_MAX || strlen(vm->vsock_link) > FC_SOCK_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "run_dir '%s' too long for a unix socket", s->run_dir);
	return KILN_OK;
}

/* `in` (a name inside the chroot, "/x") as a host path in `out`. */
static bool host_path(const struct hv_vm *vm, const char *in, char *out)
{
	return fs_path(out, "%s%s", vm->root, in);
}

/* ---- files in the chroot ---- */

/*
 * Places the read-only file `src` at `dst`: a hard link when the file is readable by everyone (the
 * link shares its mode, which must not change), else a copy the VM's uid may read.
 */
static int place_ro(const struct hv_vm *vm, const char *src, const char *dst)
{
	struct stat st;
	int r;

	if (stat(src, &st) < 0)
		return -errno;
	unlink(dst);
	if ((st.st_mode & S_IROTH) && link(src, dst) == 0)
		return 0;
	if ((r = disk_file_copy(src, dst)) < 0)
		return r;
	return chown(dst, vm->uid, vm->gid) < 0 || chmod(dst, 0400) < 0 ? -errno : 0;
}

/* Hands a file of the VM's own (its disk, its memory image) to its uid, 0600. */
static int own_file(const struct hv_vm *vm, const char *path)
{
	return chown(path, vm->uid, vm->gid) < 0 || chmod(path, 0600) < 0 ? -errno : 0;
}

/* A frozen snapshot file: root's, read-only for everyone (a restore may hard-link it). */
static int freeze_file(const char *path)
{
	return chown(path, 0, 0) < 0 || chmod(path, 0444) < 0 ? -errno : 0;
}

/* The snapshot staging directory inside the chroot, writable by the VM's uid only. */
static int make_snap_dir(const struct hv_vm *vm)
{
	char dir[PATH_MAX];

	if (!host_path(vm, "/snap", dir))
		return -ENAMETOOLONG;
	if (mkdir(dir, 0700) < 0 && errno != EEXIST)
		return -errno;
	return chown(dir, vm->uid, vm->gid) < 0 ? -errno : 0;
}

/* Creates the chroot and the host-side symlinks to the sockets Firecracker will bind in it. */
static int prepare_root(const struct hv_vm *vm)
{
	char api[PATH_MAX], vsock[PATH_MAX];
	int r;

	if ((r = fs_mkdir_p(vm->run_dir, 0711)) < 0 || (r = fs_mkdir_p(vm->state_dir, 0700)) < 0 ||
	    (r = fs_mkdir_p(vm->root, 0755)) < 0)
		return r;
	if (!host_path(vm, IN_API, api) || !host_path(vm, IN_VSOCK, vsock))
		return -ENAMETOOLONG;
	unlink(api);
	unlink(vsock);
	unlink(vm->api_link);
	unlink(vm->vsock_link);
	if (symlink(api, vm->api_link) < 0 || symlink(vsock, vm->vsock_link) < 0)
		return -errno;
	return make_snap_dir(vm);
}

/* Places kernel and initrd in the chroot. */
static enum kiln_err place_boot_files(struct hv_vm *vm, struct kiln_error *err)
{
	char dst[PATH_MAX];
	int r;

	if (!host_path(vm, IN_KERNEL, dst))
		return kiln_error_set(err, KILN_E_INVALID, "chroot of vm '%s' too long", vm->id);
	if ((r = place_ro(vm, vm->kernel, dst)) < 0)
		return fs_err(err, r, "cannot place kernel", vm->kernel);
	if (vm->initrd[0]) {
		if (!host_path(vm, IN_INITRD, dst))
			return kiln_error_set(err, KILN_E_INVALID, "chroot of vm '%s' too long", vm->id);
		if ((r = place_ro(vm, vm->initrd, dst)) < 0)
			return fs_err(err, r, "cannot place initrd", vm->initrd);
	}
	return KILN_OK;
}

/* ---- the process ---- */

/* True while Firecracker runs (its pidfd is not readable yet). */
static bool vm_alive(struct hv_vm *vm)
{
	return hv_proc_alive(&vm->proc);
}

/* Kills Firecracker (it has no graceful stop for a VM we are done with) and waits for it to go. */
static void vm_kill(struct hv_vm *vm)
{
	if (!vm_alive(vm))
		return;
	hv_proc_kill(&vm->proc, 2000);
	fc_api_free(vm->api);
	vm->api = NULL;
}

/* The last line of firecracker.log, or "" (per-thread buffer). */
static const char *log_tail(const struct hv_vm *vm)
{
	return hv_base_log_tail(vm->log_path);
}

/* The jailer's --cgroup arguments that repeat the limits of our group (it joins kiln/<node>/<id>). */
static int cgroup_args(const struct hv_vm *vm, const struct vmm_spec *s, char out[4][64], int *n)
{
	unsigned long long quota = (unsigned long long)s->vcpu_milli * CG_CPU_PERIOD_US / 1000;
	unsigned long long mem = vmm_mem_limit_bytes(s);
	int v = cg_version(vm->cg);

	*n = 0;
	if (v == CG_V2) {
		snprintf(out[(*n)++], 64, "cpu.max=%llu %d", quota, CG_CPU_PERIOD_US);
		snprintf(out[(*n)++], 64, "memory.max=%llu", mem);
	} else {
		snprintf(out[(*n)++], 64, "cpu.cfs_quota_us=%llu", quota);
		snprintf(out[(*n)++], 64, "memory.limit_in_bytes=%llu", mem);
	}
	snprintf(out[(*n)++], 64, "pids.max=%d", FC_PIDS_MAX);
	return v;
}

/*
 * Starts the jailer: it chroots into <state_dir>/<fc>/<id>/root, joins the network namespace and
 * the cgroup, drops to the VM's uid/gid and execs Firecracker as PID 1 of a new pid namespace,
 * then exits after writing Firecracker's pid to <root>/<fc>.pid. Waits for the API to answer.
 */
static enum kiln_err vm_start(struct hv_vm *vm, const struct vmm_spec *s, struct kiln_error *err)
{
	char uid[16], gid[16], cgv[4], parent[VMM_ID_MAX + 8], cgs[4][64], pidfile[PATH_MAX];
	char *envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL };
	char *argv[40];
	posix_spawn_file_actions_t fa;
	enum kiln_err rc = KILN_OK;
	int n = 0, ncg = 0, r, status = 0, pid = 0, con[2];
	long long deadline;
	pid_t jpid;
	FILE *f;

	snprintf(uid, sizeof(uid), "%u", (unsigned)s->uid);
	snprintf(gid, sizeof(gid), "%u", (unsigned)s->gid);
	snprintf(cgv, sizeof(cgv), "%d", cgroup_args(vm, s, cgs, &ncg));
	snprintf(parent, sizeof(parent), "kiln/%s", vm->node);
	argv[n++] = vm->jailer;
	argv[n++] = "--id";
	argv[n++] = vm->id;
	argv[n++] = "--exec-file";
	argv[n++] = vm->fc_binary;
	argv[n++] = "--uid";
	argv[n++] = uid;
	argv[n++] = "--gid";
	argv[n++] = gid;
	argv[n++] = "--chroot-base-dir";
	argv[n++] = vm->state_dir;
	if (s->netns_path) {
		argv[n++] = "--netns";
		argv[n++] = (char *)s->netns_path;
	}
	argv[n++] = "--cgroup-version";
	argv[n++] = cgv;
	argv[n++] = "--parent-cgroup";
	argv[n++] = parent;
	for (int i = 0; i < ncg; i++) {
		argv[n++] = "--cgroup";
		argv[n++] = cgs[i];
	}
	argv[n++] = "--new-pid-ns";
	argv[n++] = "--";
	argv[n++] = "--api-sock";
	argv[n++] = IN_API;
	argv[n] = NULL;

	if (!fs_path(pidfile, "%s/%s.pid", vm->root, strrchr(vm->fc_binary, '/') + 1))
		return kiln_error_set(err, KILN_E_INVALID, "chroot of vm '%s' too long", vm->id);
	unlink(pidfile);
	/* the console: a pipe drained without end into a capped file (a file would grow unbounded) */
	if (pipe2(con, O_CLOEXEC) < 0)
		return fs_err(err, -errno, "cannot make the console pipe of vm", vm->id);
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, con[1], 1);
	posix_spawn_file_actions_addopen(&fa, 2, vm->log_path, O_WRONLY | O_CREAT | O_APPEND, 0600);
	r = posix_spawn(&jpid, vm->jailer, &fa, NULL, argv, envp);
	posix_spawn_file_actions_destroy(&fa);
	close(con[1]);
	if (r != 0) {
		close(con[0]);
		return fs_err(err, -r, "cannot start", vm->jailer);
	}
	hv_console_stop(vm->console);
	vm->console = NULL;
	if ((r = hv_console_start(con[0], vm->serial_path, vm->console_max, &vm->console)) < 0)
		log_warn("vm '%s': console not drained (%s)", vm->id, strerror(-r));

	/* with --new-pid-ns the jailer exits once Firecracker runs */
	deadline = now_ms() + FC_START_MS;
	while ((r = waitpid(jpid, &status, WNOHANG)) == 0 && now_ms() < deadline) {
		struct timespec tick = { .tv_nsec = 2 * 1000000 };

		nanosleep(&tick, NULL);
	}
	if (r == 0) {
		kill(jpid, SIGKILL);
		waitpid(jpid, NULL, 0);
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': jailer did not finish: %s",
				      vm->id, log_tail(vm));
	}
	if (r < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': jailer failed (status %d): %s",
				      vm->id, status, log_tail(vm));
	f = fopen(pidfile, "re");
	if (!f || fscanf(f, "%d", &pid) != 1 || pid <= 1) {
		if (f)
			fclose(f);
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': no firecracker pid in '%s'",
				      vm->id, pidfile);
	}
	fclose(f);
	if (hv_proc_open(&vm->proc, pid) < 0)
		return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "vm '%s': firecracker exited at start: %s",
				      vm->id, log_tail(vm));
	log_debug("vm '%s' firecracker pid %d", vm->id, (int)vm->proc.pid);
	vm->api = fc_api_new(vm->api_link);
	if (!vm->api)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if ((rc = fc_api_wait(vm->api, vm->id, FC_API_MS, NULL, err)) != KILN_OK)
		vm_kill(vm);
	return rc;
}

/*
 * One API call with a JSON body built from `fmt` (json_pack; an "o" argument is taken over); the
 * body is freed here.
 */
static enum kiln_err api_put(struct hv_vm *vm, const char *method, const char *path, int timeout_ms,
			     struct kiln_error *err, const char *fmt, ...)
{
	json_error_t jerr;
	enum kiln_err rc;
	va_list ap;
	json_t *body;

	va_start(ap, fmt);
	body = json_vpack_ex(&jerr, 0, fmt, ap);
	va_end(ap);
	if (!body)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (!vm->api || !vm_alive(vm)) {
		json_decref(body);
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' has no running vmm", vm->id);
	}
	rc = fc_api_call(vm->api, vm->id, method, path, body, timeout_ms, NULL, NULL, err);
	json_decref(body);
	return rc;
}

/* ---- the agent channel: a Unix socket relayed to guest vsock port FC_AGENT_PORT ---- */

static int write_all(int fd, const char *p, size_t n)
{
	while (n > 0) {
		ssize_t w = write(fd, p, n);

		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -EIO;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

/*
 * Connects to the vsock device's Unix socket `uds` and asks for guest port `port` with
 * Firecracker's handshake: the host writes "CONNECT <port>\n", Firecracker answers
 * "OK <host port>\n" once the guest accepted (or closes the connection). The answer is read one
 * byte at a time so no byte of the guest's stream is consumed. Returns the connected socket or a
 * negative errno (-ECONNREFUSED: nothing listens on that port in the guest).
 */
static int vsock_connect(const char *uds, unsigned port, int timeout_ms)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct timeval tv = { .tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000 };
	struct timeval none = { 0 };
	char line[32];
	size_t n = 0;
	int fd;

	if (strlen(uds) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	memcpy(sa.sun_path, uds, strlen(uds) + 1);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		int e = -errno;

		close(fd);
		return e;
	}
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	n = (size_t)snprintf(line, sizeof(line), "CONNECT %u\n", port);
	if (write_all(fd, line, n) < 0)
		goto refused;
	for (n = 0; n + 1 < sizeof(line);) {
		ssize_t r = read(fd, line + n, 1);

		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			goto refused;
		if (line[n++] == '\n')
			break;
	}
	line[n] = '\0';
	if (n < 5 || line[n - 1] != '\n' || strncmp(line, "OK ", 3) != 0)
		goto refused;
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
	return fd;
refused:
	close(fd);
	return -ECONNREFUSED;
}

/* Copies bytes both ways between `a` and `b` until one side closes or `stop` becomes readable. */
static void relay_pair(int a, int b, int stop)
{
	char buf[16384];

	for (;;) {
		struct pollfd p[3] = { { .fd = a, .events = POLLIN }, { .fd = b, .events = POLLIN },
				       { .fd = stop, .events = POLLIN } };

		if (poll(p, 3, -1) < 0) {
			if (errno == EINTR)
				continue;
			return;
		}
		if (p[2].revents)
			return;
		for (int i = 0; i < 2; i++) {
			ssize_t r;

			if (!p[i].revents)
				continue;
			r = read(p[i].fd, buf, sizeof(buf));
			if (r < 0 && (errno == EINTR || errno == EAGAIN))
				continue;
			if (r <= 0 || write_all(p[1 - i].fd, buf, (size_t)r) < 0)
				return;
		}
	}
}

/* The relay thread: one agent connection at a time (the agent client keeps one open). */
static void *relay_main(void *arg)
{
	struct hv_vm *vm = arg;

	for (;;) {
		struct pollfd p[2] = { { .fd = vm->listen_fd, .events = POLLIN },
				       { .fd = vm->stop_pipe[0], .events = POLLIN } };
		int c, g;

		if (poll(p, 2, -1) < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		if (p[1].revents)
			break;
		c = accept4(vm->listen_fd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0)
			continue;
		g = vsock_connect(vm->vsock_link, FC_AGENT_PORT, FC_HANDSHAKE_MS);
		if (g < 0) {
			log_debug("vm '%s' agent vsock port %d: %s", vm->id, FC_AGENT_PORT, strerror(-g));
			close(c);
			continue;
		}
		relay_pair(c, g, vm->stop_pipe[0]);
		close(c);
		close(g);
	}
	return NULL;
}

/* Listens on <run_dir>/agent.sock (root only) and starts the relay thread. */
static enum kiln_err relay_start(struct hv_vm *vm, struct kiln_error *err)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int r;

	memcpy(sa.sun_path, vm->agent_path, strlen(vm->agent_path) + 1);
	unlink(vm->agent_path);
	vm->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (vm->listen_fd < 0 || bind(vm->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
	    chmod(vm->agent_path, 0600) < 0 || listen(vm->listen_fd, 4) < 0 ||
	    pipe2(vm->stop_pipe, O_CLOEXEC) < 0)
		return fs_err(err, -errno, "cannot listen on", vm->agent_path);
	if ((r = pthread_create(&vm->relay, NULL, relay_main, vm)) != 0)
		return fs_err(err, -r, "cannot start the agent relay of vm", vm->id);
	vm->relay_on = true;
	return KILN_OK;
}

static void relay_stop(struct hv_vm *vm)
{
	if (vm->relay_on) {
		(void)!write(vm->stop_pipe[1], "x", 1);
		pthread_join(vm->relay, NULL);
		vm->relay_on = false;
	}
	for (int i = 0; i < 2; i++)
		if (vm->stop_pipe[i] >= 0)
			close(vm->stop_pipe[i]);
	vm->stop_pipe[0] = vm->stop_pipe[1] = -1;
	if (vm->listen_fd >= 0)
		close(vm->listen_fd);
	vm->listen_fd = -1;
}

/* ---- the driver ---- */

static enum kiln_err fc_destroy(struct hv_vm *vm, struct kiln_error *err);

/* Creates the handle, its directories and cgroup: the part create and restore share. */
static enum kiln_err vm_new(const struct vmm_spec *s, struct hv_vm **out, struct kiln_error *err)
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
	if ((rc = vm_init(vm, s, err)) != KILN_OK) {
		free(vm);
		return rc;
	}
	if ((r = prepare_root(vm)) < 0) {
		rc = fs_err(err, r, "cannot create the directories of vm", s->id);
		goto fail;
	}
	if ((rc = hv_base_cgroup(s, FC_PIDS_MAX, &vm->cg, err)) != KILN_OK)
		goto fail;
	*out = vm;
	return KILN_OK;
fail:
	fc_destroy(vm, NULL);
	return rc;
}

static enum kiln_err fc_create(const struct vmm_spec *s, struct hv_vm **out, struct kiln_error *err)
{
	char disk[PATH_MAX];
	struct hv_vm *vm;
	enum kiln_err rc;
	int r;

	if ((rc = vm_new(s, &vm, err)) != KILN_OK)
		return rc;
	if ((rc = place_boot_files(vm, err)) != KILN_OK)
		goto fail;
	if (s->rootfs) {
		struct stat st;

		/* the VM's own raw disk: copy_file_range shares extents where the file system can */
		vm->has_disk = true;
		if (!host_path(vm, IN_ROOTFS, disk)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "chroot of vm '%s' too long", vm->id);
			goto fail;
		}
		if ((r = disk_file_copy(s->rootfs, disk)) < 0 || (r = own_file(vm, disk)) < 0 ||
		    (r = stat(disk, &st) < 0 ? -errno : 0) < 0) {
			rc = fs_err(err, r, "cannot create disk from", s->rootfs);
			goto fail;
		}
		if (s->disk_gib && (off_t)s->disk_gib << 30 < st.st_size) {
			rc = kiln_error_set(err, KILN_E_INVALID, "disk: %u GiB is smaller than the image", s->disk_gib);
			goto fail;
		}
		if (s->disk_gib && truncate(disk, (off_t)s->disk_gib << 30) < 0) {
			rc = fs_err(err, -errno, "cannot size disk", disk);
			goto fail;
		}
	}
	if ((rc = relay_start(vm, err)) != KILN_OK)
		goto fail;
	if ((rc = vm_start(vm, s, err)) != KILN_OK)
		goto fail;

	if ((rc = api_put(vm, "PUT", "/machine-config", FC_API_MS, err, "{s:i, s:i, s:b}", "vcpu_count",
			  (int)vm->vcpus, "mem_size_mib", (int)vm->mem_mib, "smt", 0)) != KILN_OK)
		goto fail;
	{
		char args[1200];

		snprintf(args, sizeof(args), "%s%s%s", FC_BOOT_ARGS, s->cmdline_extra ? " " : "",
			 s->cmdline_extra ? s->cmdline_extra : "");
		if (vm->initrd[0])
			rc = api_put(vm, "PUT", "/boot-source", FC_API_MS, err, "{s:s, s:s, s:s}",
				     "kernel_image_path", IN_KERNEL, "initrd_path", IN_INITRD, "boot_args", args);
		else
			rc = api_put(vm, "PUT", "/boot-source", FC_API_MS, err, "{s:s, s:s}",
				     "kernel_image_path", IN_KERNEL, "boot_args", args);
		if (rc != KILN_OK)
			goto fail;
	}
	if (vm->has_disk && (vm->disk_iops || vm->disk_bps)) {
		json_t *rl = fc_api_rate_limiter(vm->disk_iops, vm->disk_bps, false);

		rc = rl ? api_put(vm, "PUT", "/drives/rootfs", FC_API_MS, err, "{s:s, s:s, s:b, s:b, s:o}",
				  "drive_id", "rootfs", "path_on_host", IN_ROOTFS, "is_root_device", 1,
				  "is_read_only", 0, "rate_limiter", rl)
			: kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		if (rc != KILN_OK)
			goto fail;
	} else if (vm->has_disk && (rc = api_put(vm, "PUT", "/drives/rootfs", FC_API_MS, err,
						 "{s:s, s:s, s:b, s:b}", "drive_id", "rootfs", "path_on_host",
						 IN_ROOTFS, "is_root_device", 1, "is_read_only", 0)) != KILN_OK) {
		goto fail;
	}
	if (vm->has_net && (rc = api_put(vm, "PUT", "/network-interfaces/eth0", FC_API_MS, err, "{s:s, s:s, s:s}",
					 "iface_id", "eth0", "host_dev_name", vm->tap, "guest_mac",
					 VMM_GUEST_MAC)) != KILN_OK)
		goto fail;
	if ((rc = api_put(vm, "PUT", "/vsock", FC_API_MS, err, "{s:i, s:s}", "guest_cid", FC_GUEST_CID,
			  "uds_path", IN_VSOCK)) != KILN_OK)
		goto fail;
	if ((rc = api_put(vm, "PUT", "/actions", FC_API_MS, err, "{s:s}", "action_type", "InstanceStart")) != KILN_OK)
		goto fail;
	*out = vm;
	return KILN_OK;
fail:
	fc_destroy(vm, NULL);
	return rc;
}

static enum kiln_err fc_pause(struct hv_vm *vm, struct kiln_error *err)
{
	enum kiln_err rc = api_put(vm, "PATCH", "/vm", FC_API_MS, err, "{s:s}", "state", "Paused");

	if (rc == KILN_OK)
		vm->paused = true;
	return rc;
}

static enum kiln_err fc_resume(struct hv_vm *vm, struct kiln_error *err)
{
	enum kiln_err rc = api_put(vm, "PATCH", "/vm", FC_API_MS, err, "{s:s}", "state", "Resumed");

	if (rc == KILN_OK)
		vm->paused = false;
	return rc;
}

/* Writes manifest.json: what a restore must match, and the tap name the snapshot's NIC used. */
static int write_manifest(const char *snap_dir, const struct hv_vm *vm, const char *hv_version)
{
	char path[PATH_MAX];
	json_t *m;
	int r;

	if (!fs_path(path, "%s/manifest.json", snap_dir))
		return -ENAMETOOLONG;
	m = json_pack("{s:i, s:s, s:s, s:s, s:i, s:i, s:i, s:s, s:b, s:b, s:s?, s:i, s:s, s:s?, s:I}",
		      "format", FC_SNAP_FORMAT, "hypervisor", "firecracker", "hypervisor_version", hv_version,
		      "snapshot_type", "Full", "vcpus", (int)vm->vcpus, "vcpu_milli", (int)vm->vcpu_milli,
		      "mem_mib", (int)vm->mem_mib, "memory", "file", "disk", vm->has_disk, "net", vm->has_net,
		      "tap", vm->has_net ? vm->tap : NULL, "vsock_port", FC_AGENT_PORT, "kernel", vm->kernel,
		      "initrd", vm->initrd[0] ? vm->initrd : NULL, "created", (json_int_t)time(NULL));
	if (!m)
		return -ENOMEM;
	r = hv_base_json_write(path, m, JSON_INDENT(2) | JSON_SORT_KEYS);
	json_decref(m);
	return r;
}

/*
 * Both modes write a Full snapshot (state + memory file) while the VM is paused. VMM_SNAP_SHARED
 * then ends Firecracker and moves the VM's disk into the snapshot; VMM_SNAP_FULL leaves the VM
 * paused (vmm_resume continues it) and copies the disk.
 */
static enum kiln_err fc_snapshot(struct hv_vm *vm, const char *snap_dir, enum vmm_snap_mode mode,
				 struct kiln_error *err)
{
	char in_state[PATH_MAX], in_mem[PATH_MAX], in_disk[PATH_MAX];
	char state[PATH_MAX], mem[PATH_MAX], disk[PATH_MAX], ver[64] = "unknown";
	json_t *info = NULL;
	enum kiln_err rc;
	int r;

	if (!vm_alive(vm) || !vm->api)
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' is not running", vm->id);
	if (!host_path(vm, IN_SNAP_STATE, in_state) || !host_path(vm, IN_SNAP_MEM, in_mem) ||
	    !host_path(vm, IN_ROOTFS, in_disk) || !fs_path(state, "%s/state", snap_dir) ||
	    !fs_path(mem, "%s/mem", snap_dir) || !fs_path(disk, "%s/disk.raw", snap_dir))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
	if ((r = fs_mkdir_p(snap_dir, 0700)) < 0)
		return fs_err(err, r, "cannot create snapshot dir", snap_dir);
	if ((rc = fc_api_call(vm->api, vm->id, "GET", "/", NULL, FC_API_MS, NULL, &info, err)) != KILN_OK)
		return rc;
	if (json_string_value(json_object_get(info, "vmm_version")))
		snprintf(ver, sizeof(ver), "%s", json_string_value(json_object_get(info, "vmm_version")));
	json_decref(info);

	if (!vm->paused && (rc = fc_pause(vm, err)) != KILN_OK)
		return rc;
	if ((r = make_snap_dir(vm)) < 0)
		return fs_err(err, r, "cannot create the snapshot staging dir of vm", vm->id);
	unlink(in_state);
	unlink(in_mem);
	if ((rc = api_put(vm, "PUT", "/snapshot/create", FC_SNAP_MS, err, "{s:s, s:s, s:s}", "snapshot_type",
			  "Full", "snapshot_path", IN_SNAP_STATE, "mem_file_path", IN_SNAP_MEM)) != KILN_OK)
		return rc;
	if (mode == VMM_SNAP_SHARED)
		vm_kill(vm);	/* the memory is in the image now; RAM and CPU are released */
	if ((r = disk_file_move(in_state, state)) < 0 || (r = freeze_file(state)) < 0)
		return fs_err(err, r, "cannot move snapshot state to", state);
	if ((r = disk_file_move(in_mem, mem)) < 0 || (r = freeze_file(mem)) < 0)
		return fs_err(err, r, "cannot move memory image to", mem);
	if (vm->has_disk) {
		/* paused vCPUs and a synchronous block device: the file is consistent now */
		r = mode == VMM_SNAP_SHARED ? disk_file_move(in_disk, disk) : disk_file_copy(in_disk, disk);
		if (r < 0 || (r = freeze_file(disk)) < 0)
			return fs_err(err, r, "cannot keep disk in", disk);
	}
	if ((r = write_manifest(snap_dir, vm, ver)) < 0 || (r = fs_fsync_path(snap_dir)) < 0)
		return fs_err(err, r, "cannot write manifest in", snap_dir);
	return KILN_OK;
}

/* Reads the snapshot's manifest and checks it fits the VM; *tap_was gets the snapshot's TAP. */
static enum kiln_err check_manifest(const char *snap_dir, struct hv_vm *vm, char *tap_was, size_t taplen,
				    struct kiln_error *err)
{
	char path[PATH_MAX];
	json_error_t jerr;
	enum kiln_err rc = KILN_OK;
	const char *hv, *mem, *tap;
	json_t *m;

	if (!fs_path(path, "%s/manifest.json", snap_dir))
		return kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
	m = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!m)
		return kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': no readable manifest (%s)", snap_dir,
				      jerr.text);
	hv = json_string_value(json_object_get(m, "hypervisor"));
	mem = json_string_value(json_object_get(m, "memory"));
	tap = json_string_value(json_object_get(m, "tap"));
	if (json_integer_value(json_object_get(m, "format")) != FC_SNAP_FORMAT || !hv || !mem ||
	    strcmp(mem, "file"))
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot '%s': unknown format", snap_dir);
	else if (strcmp(hv, "firecracker"))
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s' was taken under %s, not firecracker",
				    snap_dir, hv);
	else if (json_integer_value(json_object_get(m, "vcpus")) != (json_int_t)vm->vcpus ||
		 json_integer_value(json_object_get(m, "mem_mib")) != (json_int_t)vm->mem_mib)
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s': shape differs (vcpus, memory)", snap_dir);
	else if (json_is_true(json_object_get(m, "net")) != vm->has_net || (vm->has_net && !tap))
		rc = kiln_error_set(err, KILN_E_CONFLICT, "snapshot '%s': network device differs", snap_dir);
	if (rc == KILN_OK) {
		vm->has_disk = json_is_true(json_object_get(m, "disk"));
		snprintf(tap_was, taplen, "%s", tap ? tap : "");
	}
	json_decref(m);
	return rc;
}

/*
 * Places the snapshot's memory image at `dst` in the chroot. Firecracker maps it MAP_PRIVATE in
 * every case; `from` decides whose file it is: PRIVATE hard-links the frozen image (shared page
 * cache, copy-on-write per VM), MOVE takes it from the snapshot, COPY makes a file of the VM's own.
 */
static int place_mem(const struct hv_vm *vm, const char *src, const char *dst, enum vmm_mem_from from)
{
	int r;

	unlink(dst);
	if (from == VMM_MEM_MOVE)
		return (r = disk_file_move(src, dst)) < 0 ? r : own_file(vm, dst);
	if (from == VMM_MEM_PRIVATE) {
		if (link(src, dst) == 0)
			return 0;
		if (errno != EXDEV)
			return -errno;
		log_warn("vm '%s' snapshot '%s' is on another file system than the jail: copying", vm->id, src);
	}
	return (r = disk_file_copy(src, dst)) < 0 ? r : own_file(vm, dst);
}

static enum kiln_err fc_restore(const struct vmm_spec *s, const char *snap_dir, enum vmm_mem_from from,
				struct hv_vm **out, struct kiln_error *err)
{
	char state[PATH_MAX], mem[PATH_MAX], disk[PATH_MAX], tap_was[16];
	char in_state[PATH_MAX], in_mem[PATH_MAX], in_disk[PATH_MAX];
	struct hv_vm *vm;
	bool grown = false;
	enum kiln_err rc;
	int r;

	*out = NULL;
	if ((rc = vm_new(s, &vm, err)) != KILN_OK)
		return rc;
	if (!fs_path(state, "%s/state", snap_dir) || !fs_path(mem, "%s/mem", snap_dir) ||
	    !fs_path(disk, "%s/disk.raw", snap_dir) || !host_path(vm, IN_SNAP_STATE, in_state) ||
	    !host_path(vm, IN_SNAP_MEM, in_mem) || !host_path(vm, IN_ROOTFS, in_disk)) {
		rc = kiln_error_set(err, KILN_E_INVALID, "snapshot dir '%s' too long", snap_dir);
		goto fail;
	}
	if ((rc = check_manifest(snap_dir, vm, tap_was, sizeof(tap_was), err)) != KILN_OK)
		goto fail;
	/* the snapshot's device state names files by their chroot names: put them there */
	if ((r = disk_file_copy(state, in_state)) < 0 || (r = own_file(vm, in_state)) < 0) {
		rc = fs_err(err, r, "cannot place snapshot state", state);
		goto fail;
	}
	if ((r = place_mem(vm, mem, in_mem, from)) < 0) {
		rc = fs_err(err, r, "cannot prepare memory from", mem);
		goto fail;
	}
	if (vm->has_disk) {
		struct stat st;

		r = from == VMM_MEM_MOVE ? disk_file_move(disk, in_disk) : disk_file_copy(disk, in_disk);
		if (r < 0 || (r = own_file(vm, in_disk)) < 0 || (r = stat(in_disk, &st) < 0 ? -errno : 0) < 0) {
			rc = fs_err(err, r, "cannot create disk from", disk);
			goto fail;
		}
		if (s->disk_gib && (off_t)s->disk_gib << 30 < st.st_size) {
			rc = kiln_error_set(err, KILN_E_INVALID,
					    "disk: %u GiB is smaller than the snapshot's %lld GiB", s->disk_gib,
					    (long long)((st.st_size + (1ll << 30) - 1) >> 30));
			goto fail;
		}
		/* a larger disk: the file grows here, and the guest hears of it at the PATCH below */
		grown = s->disk_gib && (off_t)s->disk_gib << 30 > st.st_size;
		if (grown && truncate(in_disk, (off_t)s->disk_gib << 30) < 0) {
			rc = fs_err(err, -errno, "cannot size disk", in_disk);
			goto fail;
		}
	}
	if ((rc = relay_start(vm, err)) != KILN_OK)
		goto fail;
	if ((rc = vm_start(vm, s, err)) != KILN_OK)
		goto fail;
	/* network for clones: the same TAP name in every netns needs no override */
	if (vm->has_net && strcmp(tap_was, vm->tap) != 0)
		rc = api_put(vm, "PUT", "/snapshot/load", FC_SNAP_MS, err,
			     "{s:s, s:{s:s, s:s}, s:b, s:b, s:[{s:s, s:s}]}", "snapshot_path", IN_SNAP_STATE,
			     "mem_backend", "backend_type", "File", "backend_path", IN_SNAP_MEM,
			     "enable_diff_snapshots", 0, "resume_vm", 1, "network_overrides", "iface_id", "eth0",
			     "host_dev_name", vm->tap);
	else
		rc = api_put(vm, "PUT", "/snapshot/load", FC_SNAP_MS, err, "{s:s, s:{s:s, s:s}, s:b, s:b}",
			     "snapshot_path", IN_SNAP_STATE, "mem_backend", "backend_type", "File",
			     "backend_path", IN_SNAP_MEM, "enable_diff_snapshots", 0, "resume_vm", 1);
	if (rc != KILN_OK)
		goto fail;
	/*
	 * The snapshot brought back the drive's rate limiter as it was when taken: set this spec's
	 * (the node's limits may differ now), disabling a bucket whose figure is 0. A grown disk
	 * names its file again: Firecracker then reads the file's new size and raises the virtio
	 * config change that tells the guest (the only resize its API offers).
	 */
	if (vm->has_disk) {
		json_t *rl = fc_api_rate_limiter(vm->disk_iops, vm->disk_bps, true);

		rc = !rl ? kiln_error_set(err, KILN_E_NOMEM, "out of memory")
		     : grown ? api_put(vm, "PATCH", "/drives/rootfs", FC_API_MS, err, "{s:s, s:s, s:o}",
				       "drive_id", "rootfs", "path_on_host", IN_ROOTFS, "rate_limiter", rl)
			     : api_put(vm, "PATCH", "/drives/rootfs", FC_API_MS, err, "{s:s, s:o}",
				       "drive_id", "rootfs", "rate_limiter", rl);
		if (rc != KILN_OK)
			goto fail;
	}
	unlink(in_state);	/* loaded; the memory image stays mapped */
	*out = vm;
	return KILN_OK;
fail:
	fc_destroy(vm, NULL);
	return rc;
}

static enum kiln_err fc_status(struct hv_vm *vm, struct vmm_status *st, struct kiln_error *err)
{
	json_t *info = NULL;

	memset(st, 0, sizeof(*st));
	st->alive = vm_alive(vm);
	st->pid = vm->proc.pid;
	/* Firecracker is the jailer's child, not ours: its exit status is not ours to read */
	if (st->alive && vm->api &&
	    fc_api_call(vm->api, vm->id, "GET", "/", NULL, FC_API_MS, NULL, &info, err) == KILN_OK) {
		const char *state = json_string_value(json_object_get(info, "state"));

		st->running = state && strcmp(state, "Running") == 0;
	}
	json_decref(info);
	return KILN_OK;
}

static enum kiln_err fc_usage(struct hv_vm *vm, struct cg_usage *u, struct kiln_error *err)
{
	int r;

	if (!vm->cg)
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' has no cgroup", vm->id);
	r = cg_read(vm->cg, u);
	return r < 0 ? fs_err(err, r, "cannot read cgroup of vm", vm->id) : KILN_OK;
}

static enum kiln_err fc_destroy(struct hv_vm *vm, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;
	int r;

	if (!vm)
		return KILN_OK;
	relay_stop(vm);
	vm_kill(vm);
	hv_console_stop(vm->console);
	vm->console = NULL;
	fc_api_free(vm->api);
	vm->api = NULL;
	if (vm->cg && (r = cg_destroy(vm->cg)) < 0)
		rc = fs_err(err, r, "cannot remove cgroup of vm", vm->id);
	vm->cg = NULL;
	/* the chroot: our links and copies, the jailer's device nodes and binary copy, the sockets */
	if (vm->jail_dir[0] && (r = fs_remove_tree(vm->jail_dir)) < 0 && rc == KILN_OK)
		rc = fs_err(err, r, "cannot remove", vm->jail_dir);
	if (vm->jail_dir[0]) {
		char *slash = strrchr(vm->jail_dir, '/');

		*slash = '\0';	/* <state_dir>/<fc>: shared by nothing else of this VM */
		rmdir(vm->jail_dir);
	}
	fs_remove(vm->api_link, err, &rc);
	fs_remove(vm->vsock_link, err, &rc);
	fs_remove(vm->agent_path, err, &rc);
	fs_remove(vm->serial_path, err, &rc);
	fs_remove(vm->serial_old, err, &rc);
	fs_remove(vm->log_path, err, &rc);
	fs_remove_dir(vm->run_dir, err, &rc);
	fs_remove_dir(vm->state_dir, err, &rc);
	free(vm);
	return rc;
}

static const char *fc_agent_socket(const struct hv_vm *vm)
{
	return vm->agent_path;
}

static const char *fc_serial_log(const struct hv_vm *vm)
{
	return vm->serial_path;
}

const struct hv_ops hv_firecracker_ops = {
	.name = "firecracker",
	.create = fc_create,
	.restore = fc_restore,
	.pause = fc_pause,
	.resume = fc_resume,
	.snapshot = fc_snapshot,
	.status = fc_status,
	.usage = fc_usage,
	.destroy = fc_destroy,
	.agent_socket = fc_agent_socket,
	.serial_log = fc_serial_log,
};
