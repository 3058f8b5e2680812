/*
 * hostagent.c - the "hostagent" driver: a bench and test hook, not a hypervisor. A "VM" is the
 * guest agent binary (spec->hv_binary: the build's static kiln-agent) running as a process on the
 * host, on the agent channel's Unix socket where QEMU would put the guest's virtio-serial port,
 * so the node's whole path to a guest (agent client, port streams, exec, files) runs for real
 * against a guest that costs no boot. It exists to measure the gateway's and the node's own part
 * of a path (bench/ports/stub.sh) and to test that path without a VM; nothing a tenant sends can
 * select it: only the node's own setting `hypervisor = hostagent` does, which a production node
 * never sets (docs/vmm.md, "The hostagent hook").
 *
 * The agent believes it is a guest's root; on the host it must change nothing. So it runs as the
 * sandbox's own unprivileged uid (spec->uid), with no new privileges, and a seccomp filter answers
 * the calls it makes to take a guest over as if they had worked, without making them: the wall
 * clock (clock_settime), the host name (sethostname), the entropy pool (RNDADDENTROPY,
 * RNDRESEEDCRNG) and the root file system's growth (EXT4_IOC_RESIZE_FS). Files it would write as
 * a guest's root (/etc/hosts, /etc/hostname) it cannot write as that uid, and a guest's agent
 * ignores that. Its port streams connect to the host's 127.0.0.1, its execs run as that uid.
 * Its network namespace is the node's: spec->netns_path and the TAP are left to the node, unused.
 *
 * The process accepts the node's one connection on <run_dir>/agent.sock, then execs
 * `kiln-agent --fd 3` on it (the agent's own test mode: it exits at the connection's end).
 * Pause and resume stop and continue it (SIGSTOP, SIGCONT); snapshots are not implemented.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/random.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "vmm/hv_base.h"

#define EXT4_IOC_RESIZE_FS_NR _IOW('f', 16, unsigned long long)	/* linux/fs/ext4/ext4.h */

struct hv_vm {
	char id[VMM_ID_MAX + 1];
	char run_dir[PATH_MAX], state_dir[PATH_MAX];
	char agent_path[PATH_MAX], log_path[PATH_MAX];
	struct hv_proc proc;
	struct cg *cg;
	bool stopped;		/* SIGSTOP sent (vmm_pause) */
};

/* The seccomp program: the calls above return 0 without being made; everything else runs. */
#define FAKE_OK (SECCOMP_RET_ERRNO | 0)
static struct sock_filter filter[] = {
	BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
	BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
	BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clock_settime, 0, 1),
	BPF_STMT(BPF_RET | BPF_K, FAKE_OK),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_settimeofday, 0, 1),
	BPF_STMT(BPF_RET | BPF_K, FAKE_OK),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_sethostname, 0, 1),
	BPF_STMT(BPF_RET | BPF_K, FAKE_OK),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_ioctl, 1, 0),
	BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[1])),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)RNDADDENTROPY, 3, 0),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)RNDRESEEDCRNG, 2, 0),
	BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)EXT4_IOC_RESIZE_FS_NR, 1, 0),
	BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	BPF_STMT(BPF_RET | BPF_K, FAKE_OK),
};

/* The child: async-signal-safe calls only (the node has threads). Never returns. */
static void agent_child(int lfd, int logfd, uid_t uid, gid_t gid, char *const argv[])
{
	static char *const envp[] = { "PATH=/usr/bin:/bin", "HOME=/", NULL };
	struct sock_fprog prog = { .len = sizeof(filter) / sizeof(filter[0]), .filter = filter };
	int c;

	/* The log's descriptor out of the way of the channel's (3). */
	if (logfd <= 3 && (logfd = fcntl(logfd, F_DUPFD, 10)) < 0)
		_exit(126);
	c = accept4(lfd, NULL, NULL, 0);
	if (c < 0 || dup2(c, 3) < 0 || dup2(logfd, 1) < 0 || dup2(logfd, 2) < 0)
		_exit(126);
	int nul = open("/dev/null", O_RDONLY);

	if (nul < 0 || dup2(nul, 0) < 0)
		_exit(126);
	if (syscall(SYS_close_range, 4u, ~0u, 0u) < 0 || setgroups(0, NULL) < 0 || setgid(gid) < 0 ||
	    setuid(uid) < 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 ||
	    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) < 0)
		_exit(126);
	execve(argv[0], argv, envp);
	_exit(127);
}

static enum kiln_err ha_destroy(struct hv_vm *vm, struct kiln_error *err)
{
	enum kiln_err rc = KILN_OK;
	int r;

	if (!vm)
		return KILN_OK;
	hv_proc_kill(&vm->proc, -1);
	if (vm->cg && (r = cg_destroy(vm->cg)) < 0)	/* frees the handle */
		rc = fs_err(err, r, "cannot remove cgroup of vm", vm->id);
	vm->cg = NULL;
	fs_remove(vm->agent_path, err, &rc);
	fs_remove(vm->log_path, err, &rc);
	fs_remove_dir(vm->run_dir, err, &rc);
	fs_remove_dir(vm->state_dir, err, &rc);
	free(vm);
	return rc;
}

static enum kiln_err ha_create(const struct vmm_spec *s, struct hv_vm **out, struct kiln_error *err)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct hv_vm *vm;
	enum kiln_err rc;
	int lfd = -1, logfd = -1, r;
	pid_t pid;

	*out = NULL;
	rc = vmm_spec_check(s, err);
	if (rc != KILN_OK)
		return rc;
	if (!s->hv_binary || s->hv_binary[0] != '/' || access(s->hv_binary, X_OK) < 0)
		return kiln_error_set(err, KILN_E_INVALID,
				      "hv_binary: the hostagent driver needs the agent binary's absolute path");
	vm = calloc(1, sizeof(*vm));
	if (!vm)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	hv_proc_init(&vm->proc);
	snprintf(vm->id, sizeof(vm->id), "%s", s->id);
	if (!fs_path(vm->run_dir, "%s", s->run_dir) || !fs_path(vm->state_dir, "%s", s->state_dir) ||
	    !fs_path(vm->agent_path, "%s/agent.sock", s->run_dir) ||
	    !fs_path(vm->log_path, "%s/agent.log", s->state_dir) ||
	    strlen(vm->agent_path) >= sizeof(sa.sun_path)) {
		free(vm);
		return kiln_error_set(err, KILN_E_INVALID, "run_dir/state_dir: paths too long");
	}
	if ((r = fs_mkdir_p(s->run_dir, 0700)) < 0 || (r = fs_mkdir_p(s->state_dir, 0700)) < 0) {
		free(vm);
		return fs_err(err, r, "cannot make the directories of vm", s->id);
	}
	rc = hv_base_cgroup(s, 256, &vm->cg, err);
	if (rc != KILN_OK) {
		free(vm);
		return rc;
	}
	memcpy(sa.sun_path, vm->agent_path, strlen(vm->agent_path) + 1);
	unlink(vm->agent_path);
	lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	logfd = open(vm->log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
	if (lfd < 0 || logfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 1) < 0) {
		rc = fs_err(err, -errno, "cannot open the agent socket of vm", s->id);
		goto fail;
	}
	char *argv[] = { (char *)s->hv_binary, "--fd", "3", NULL };

	pid = fork();
	if (pid < 0) {
		rc = fs_err(err, -errno, "cannot start the agent of vm", s->id);
		goto fail;
	}
	if (pid == 0)
		agent_child(lfd, logfd, s->uid, s->gid, argv);
	close(lfd);
	close(logfd);
	lfd = logfd = -1;
	vm->proc.pid = pid;
	vm->proc.pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	vm->proc.child = true;
	if (vm->proc.pidfd < 0 || (r = cg_attach(vm->cg, pid)) < 0) {
		rc = fs_err(err, vm->proc.pidfd < 0 ? -errno : r, "cannot hold the agent of vm", s->id);
		if (vm->proc.pidfd < 0)
			kill(pid, SIGKILL);	/* ha_destroy() signals through the pidfd */
		goto fail;
	}
	*out = vm;
	return KILN_OK;
fail:
	if (lfd >= 0)
		close(lfd);
	if (logfd >= 0)
		close(logfd);
	ha_destroy(vm, NULL);
	return rc;
}

static enum kiln_err ha_restore(const struct vmm_spec *s, const char *snap_dir, enum vmm_mem_from from,
				struct hv_vm **out, struct kiln_error *err)
{
	(void)s, (void)snap_dir, (void)from;
	*out = NULL;
	return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED, "the hostagent driver keeps no snapshots");
}

static enum kiln_err ha_snapshot(struct hv_vm *vm, const char *snap_dir, enum vmm_snap_mode mode,
				 struct kiln_error *err)
{
	(void)vm, (void)snap_dir, (void)mode;
	return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED, "the hostagent driver keeps no snapshots");
}

static enum kiln_err ha_signal(struct hv_vm *vm, int sig, struct kiln_error *err)
{
	if (!hv_proc_alive(&vm->proc))
		return kiln_error_set(err, KILN_E_CONFLICT, "vm '%s' is not running", vm->id);
	if (syscall(SYS_pidfd_send_signal, vm->proc.pidfd, sig, NULL, 0) < 0)
		return fs_err(err, -errno, "cannot signal the agent of vm", vm->id);
	vm->stopped = sig == SIGSTOP;
	return KILN_OK;
}

static enum kiln_err ha_pause(struct hv_vm *vm, struct kiln_error *err)
{
	return ha_signal(vm, SIGSTOP, err);
}

static enum kiln_err ha_resume(struct hv_vm *vm, struct kiln_error *err)
{
	return ha_signal(vm, SIGCONT, err);
}

static enum kiln_err ha_status(struct hv_vm *vm, struct vmm_status *st, struct kiln_error *err)
{
	(void)err;
	memset(st, 0, sizeof(*st));
	st->alive = hv_proc_alive(&vm->proc);
	st->running = st->alive && !vm->stopped;
	st->pid = vm->proc.pid;
	st->exit_status = vm->proc.exit_status;
	return KILN_OK;
}

static enum kiln_err ha_usage(struct hv_vm *vm, struct cg_usage *u, struct kiln_error *err)
{
	int r = cg_read(vm->cg, u);

	return r < 0 ? fs_err(err, r, "cannot read cgroup of vm", vm->id) : KILN_OK;
}

static const char *ha_agent_socket(const struct hv_vm *vm)
{
	return vm->agent_path;
}

static const char *ha_serial_log(const struct hv_vm *vm)
{
	return vm->log_path;
}

const struct hv_ops hv_hostagent_ops = {
	.name = "hostagent",
	.create = ha_create,
	.restore = ha_restore,
	.pause = ha_pause,
	.resume = ha_resume,
	.snapshot = ha_snapshot,
	.status = ha_status,
	.usage = ha_usage,
	.destroy = ha_destroy,
	.agent_socket = ha_agent_socket,
	.serial_log = ha_serial_log,
};
