/*
 * jail.c - clone3 into new mount + pid namespaces, set the jail up, exec the VMM.
 *
 * The child is created with clone3(CLONE_NEWNS | CLONE_NEWPID | CLONE_PIDFD) and no new stack, so it
 * runs like a fork() child: in a copy of a possibly multi-threaded parent it makes only system
 * calls (no malloc, no stdio) until execve. It waits on a pipe until the parent has put it into
 * its cgroup, so no instruction of the VMM runs outside the group. Setup failures travel back as an
 * errno over a close-on-exec pipe: EOF there means execve succeeded.
 */
#include "vmm/jail.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "vmm/cgroup.h"

int jail_prepare(const struct jail *j)
{
	if (mkdir(j->root, 0755) < 0 && errno != EEXIST)
		return -errno;
	if (chmod(j->root, 0755) < 0)
		return -errno;
	for (unsigned i = 0; i < j->n_mounts; i++) {
		int fd = open(j->mounts[i].dst, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0444);

		if (fd < 0)
			return -errno;
		close(fd);
	}
	return 0;
}

int jail_cleanup(const struct jail *j)
{
	int r = 0;

	for (unsigned i = 0; i < j->n_mounts; i++)
		if (unlink(j->mounts[i].dst) < 0 && errno != ENOENT && r == 0)
			r = -errno;
	if (rmdir(j->root) < 0 && errno != ENOENT && r == 0)
		r = -errno;
	return r;
}

/* Child side: reports -err (a negative errno) to the parent and exits. */
static void __attribute__((noreturn)) child_fail(int errfd, int err)
{
	int e = -err;

	if (write(errfd, &e, sizeof(e)) < 0) {
		/* nothing more to do: the parent sees a short read */
	}
	_exit(127);
}

/* Child side, after the namespaces exist: joins the netns, mounts, then execs. */
static void __attribute__((noreturn)) child_run(const struct jail *j, char *const argv[],
						char *const envp[], int syncfd, int errfd)
{
	char go;
	int devnull;

	/* wait for the parent to place us in the cgroup */
	if (read(syncfd, &go, 1) != 1)
		_exit(127);
	if (j->netns_fd >= 0 && setns(j->netns_fd, CLONE_NEWNET) < 0)
		child_fail(errfd, -errno);
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
		child_fail(errfd, -errno);
	if (mount(j->root, j->root, NULL, MS_BIND, NULL) < 0 ||
	    mount(NULL, j->root, NULL, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
		child_fail(errfd, -errno);
	for (unsigned i = 0; i < j->n_mounts; i++) {
		const struct jail_mount *m = &j->mounts[i];
		unsigned long fl = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC;

		if (mount(m->src, m->dst, NULL, MS_BIND, NULL) < 0)
			child_fail(errfd, -errno);
		if (mount(NULL, m->dst, NULL, fl | (m->ro ? MS_RDONLY : 0), NULL) < 0)
			child_fail(errfd, -errno);
	}
	/* the VMM names its files relative to the jail root: valid before and after its chroot */
	if (chdir(j->root) < 0)
		child_fail(errfd, -errno);
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		child_fail(errfd, -errno);
	devnull = open("/dev/null", O_RDWR);
	if (devnull < 0)
		child_fail(errfd, -errno);
	if (dup2(devnull, 0) < 0 || dup2(j->out_fd >= 0 ? j->out_fd : devnull, 1) < 0 ||
	    dup2(j->out_fd >= 0 ? j->out_fd : devnull, 2) < 0)
		child_fail(errfd, -errno);
	/*
	 * nothing of the caller's leaks into the VMM but stdio and keep_fd (errfd is close-on-exec
	 * already)
	 */
	if (j->keep_fd > 2) {
		if (fcntl(j->keep_fd, F_SETFD, 0) < 0 ||
		    (j->keep_fd > 3 &&
		     syscall(SYS_close_range, 3U, (unsigned)j->keep_fd - 1, CLOSE_RANGE_CLOEXEC) < 0) ||
		    syscall(SYS_close_range, (unsigned)j->keep_fd + 1, ~0U, CLOSE_RANGE_CLOEXEC) < 0)
			child_fail(errfd, -errno);
	} else if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) < 0) {
		child_fail(errfd, -errno);
	}
	execve(argv[0], argv, envp);
	child_fail(errfd, -errno);
}

int jail_spawn(const struct jail *j, char *const argv[], char *const envp[], pid_t *pid, int *pidfd)
{
	int sync[2], errp[2], pfd = -1, r, e = 0;
	struct clone_args ca;
	ssize_t n;
	long child;

	if (pipe2(sync, O_CLOEXEC) < 0)
		return -errno;
	if (pipe2(errp, O_CLOEXEC) < 0) {
		r = -errno;
		close(sync[0]);
		close(sync[1]);
		return r;
	}
	memset(&ca, 0, sizeof(ca));
	ca.flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_PIDFD;
	ca.pidfd = (uint64_t)(uintptr_t)&pfd;
	ca.exit_signal = SIGCHLD;
	child = syscall(SYS_clone3, &ca, sizeof(ca));
	if (child < 0) {
		r = -errno;
		goto out_pipes;
	}
	if (child == 0) {
		close(sync[1]);
		close(errp[0]);
		child_run(j, argv, envp, sync[0], errp[1]);
	}
	close(sync[0]);
	close(errp[1]);
	sync[0] = errp[1] = -1;

	r = j->cg ? cg_attach(j->cg, (pid_t)child) : 0;
	if (r == 0 && write(sync[1], "g", 1) != 1)
		r = -EPIPE;
	close(sync[1]);
	sync[1] = -1;
	if (r == 0) {
		do
			n = read(errp[0], &e, sizeof(e));
		while (n < 0 && errno == EINTR);
		if (n == sizeof(e))
			r = e ? -e : -EIO;
		else if (n != 0)
			r = -EIO;
	}
	close(errp[0]);
	if (r < 0) {
		kill((pid_t)child, SIGKILL);
		waitpid((pid_t)child, NULL, 0);
		close(pfd);
		return r;
	}
	*pid = (pid_t)child;
	if (pidfd)
		*pidfd = pfd;
	else
		close(pfd);
	return 0;

out_pipes:
	close(sync[0]);
	close(sync[1]);
	close(errp[0]);
	close(errp[1]);
	return r;
}

int jail_uid_alloc(const char *lease_dir, uid_t lo, uid_t hi, const char *owner, uid_t *uid)
{
	char path[PATH_MAX];

	if (lo > hi || lo == 0)
		return -EINVAL;
	if (snprintf(path, sizeof(path), "%s", lease_dir) >= (int)sizeof(path))
		return -ENAMETOOLONG;
	for (char *p = path + 1;; p++) {	/* mkdir -p */
		char c = *p;

		if (c != '/' && c != '\0')
			continue;
		*p = '\0';
		if (mkdir(path, c ? 0755 : 0700) < 0 && errno != EEXIST)
			return -errno;
		*p = c;
		if (!c)
			break;
	}
	for (uid_t u = lo; u <= hi; u++) {
		if (snprintf(path, sizeof(path), "%s/%u", lease_dir, (unsigned)u) >= (int)sizeof(path))
			return -ENAMETOOLONG;
		int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);

		if (fd < 0) {
			if (errno == EEXIST)
				continue;
			return -errno;
		}
		if (owner && write(fd, owner, strlen(owner)) < 0) {
			/* the lease holds without its label */
		}
		close(fd);
		*uid = u;
		return 0;
	}
	return -EAGAIN;
}

int jail_uid_relabel(const char *lease_dir, uid_t uid, const char *owner)
{
	char path[PATH_MAX], tmp[PATH_MAX];
	size_t len = strlen(owner);
	struct stat st;
	int fd, r = 0;

	if (snprintf(path, sizeof(path), "%s/%u", lease_dir, (unsigned)uid) >= (int)sizeof(path) ||
	    snprintf(tmp, sizeof(tmp), "%s/.%u.relabel", lease_dir, (unsigned)uid) >= (int)sizeof(tmp))
		return -ENAMETOOLONG;
	if (stat(path, &st) < 0)
		return -errno;
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return -errno;
	if (write(fd, owner, len) != (ssize_t)len)
		r = -EIO;
	close(fd);
	if (r == 0 && rename(tmp, path) < 0)
		r = -errno;
	if (r < 0)
		unlink(tmp);
	return r;
}

int jail_uid_release(const char *lease_dir, uid_t uid)
{
	char path[PATH_MAX];

	if (snprintf(path, sizeof(path), "%s/%u", lease_dir, (unsigned)uid) >= (int)sizeof(path))
		return -ENAMETOOLONG;
	return unlink(path) < 0 && errno != ENOENT ? -errno : 0;
}
