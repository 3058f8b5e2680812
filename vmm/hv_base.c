/*
 * hv_base.c - the drivers' shared base: cgroup, VMM process by pidfd, log tail, atomic JSON
 * records (see hv_base.h).
 */
#include "vmm/hv_base.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "vmm/cgroup.h"

void hv_proc_init(struct hv_proc *p)
{
	memset(p, 0, sizeof(*p));
	p->pidfd = -1;
}

enum kiln_err hv_base_cgroup(const struct vmm_spec *s, unsigned pids_max, struct cg **out,
			     struct kiln_error *err)
{
	struct cg_limits lim = {
		.cpu_milli = s->vcpu_milli,
		.mem_bytes = vmm_mem_limit_bytes(s),
		.pids = pids_max,
	};
	int r = cg_create(s->cgroup_root, s->node, s->id, &lim, out);

	return r < 0 ? fs_err(err, r, "cannot create cgroup for vm", s->id) : KILN_OK;
}

int hv_proc_spawn(struct hv_proc *p, const struct jail *j, char *const argv[], char *const envp[])
{
	int r = jail_spawn(j, argv, envp, &p->pid, &p->pidfd);

	if (r < 0) {
		hv_proc_init(p);
		return r;
	}
	p->child = true;
	p->exit_status = 0;
	return 0;
}

int hv_proc_open(struct hv_proc *p, pid_t pid)
{
	int fd;

	if (pid <= 0)
		return -EINVAL;
	fd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (fd < 0)
		return -errno;
	p->pid = pid;
	p->pidfd = fd;
	p->child = false;
	p->exit_status = 0;
	return 0;
}

void hv_proc_release(struct hv_proc *p)
{
	if (p->pidfd >= 0)
		close(p->pidfd);
	p->pidfd = -1;
	p->pid = 0;
}

bool hv_proc_ended(const struct hv_proc *p, int ms)
{
	struct pollfd pfd = { .fd = p->pidfd, .events = POLLIN };
	int r;

	if (p->pidfd < 0)
		return true;
	while ((r = poll(&pfd, 1, ms)) < 0 && errno == EINTR)
		;
	return r > 0;
}

bool hv_proc_alive(struct hv_proc *p)
{
	int status;

	if (!p->pid)
		return false;
	if (p->child ? waitpid(p->pid, &status, WNOHANG) == p->pid : hv_proc_ended(p, 0)) {
		p->exit_status = p->child ? status : 0;
		hv_proc_release(p);
		return false;
	}
	return true;
}

void hv_proc_kill(struct hv_proc *p, int wait_ms)
{
	if (!hv_proc_alive(p))
		return;
	if (!hv_proc_ended(p, 0))
		syscall(SYS_pidfd_send_signal, p->pidfd, SIGKILL, NULL, 0);
	if (p->child)
		while (waitpid(p->pid, &p->exit_status, 0) < 0 && errno == EINTR)
			;
	else
		hv_proc_ended(p, wait_ms);
	hv_proc_release(p);
}

const char *hv_base_log_tail(const char *path)
{
	static __thread char tail[160];
	char buf[1024], *line;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n = 0;
	off_t end;

	tail[0] = '\0';
	if (fd < 0)
		return tail;
	end = lseek(fd, 0, SEEK_END);
	if (end > 0)
		n = pread(fd, buf, sizeof(buf) - 1, end > (off_t)sizeof(buf) - 1 ? end - (off_t)sizeof(buf) + 1 : 0);
	close(fd);
	if (n <= 0)
		return tail;
	buf[n] = '\0';
	while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
		buf[--n] = '\0';
	line = strrchr(buf, '\n');
	snprintf(tail, sizeof(tail), "%.150s", line ? line + 1 : buf);
	for (char *c = tail; *c; c++)
		if ((unsigned char)*c < 0x20 || *c == 0x7f)
			*c = '?';
	return tail;
}

int hv_base_json_write(const char *path, const json_t *doc, size_t flags)
{
	char tmp[PATH_MAX];
	int r = 0;

	if (!fs_path(tmp, "%s.tmp", path))
		return -ENAMETOOLONG;
	if (json_dump_file(doc, tmp, flags) < 0)
		r = -EIO;
	else if ((r = fs_fsync_path(tmp)) == 0 && rename(tmp, path) < 0)
		r = -errno;
	if (r < 0)
		unlink(tmp);
	return r;
}
