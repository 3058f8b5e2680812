/*
 * cgroup.c - per-VM control groups: the v1 and v2 backends behind cgroup.h.
 *
 * v1 keeps one directory per controller (cpu, cpuacct, memory, pids); v2 one directory for all.
 * The handle stores those directories in `dirs`, indexed by enum ctl, so most code is shared and
 * only the file names differ.
 */
#include "vmm/cgroup.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/magic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <time.h>
#include <unistd.h>

#include "common/fsutil.h"

enum ctl { CTL_CPU, CTL_CPUACCT, CTL_MEMORY, CTL_PIDS, CTL__COUNT };

static const char *const ctl_names[CTL__COUNT] = { "cpu", "cpuacct", "memory", "pids" };

/* The files cg_read() reads. */
enum cg_file { CGF_CPU, CGF_MEM, CGF_PEAK, CGF__COUNT };

struct cg {
	enum cg_version version;
	char dirs[CTL__COUNT][PATH_MAX];	/* on v2 all four are the same directory */
	int fd[CGF__COUNT];	/* cg_read()'s files kept open from one read to the next; -1 none */
	bool plain;	/* those files are not cgroupfs's (a tree of plain files: tests, kiln-sim) */
};

#define CG_FILE_MAX 65536	/* bytes read from one cgroup file */

static int write_str(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	ssize_t n;
	int e;

	if (fd < 0)
		return -errno;
	n = write(fd, s, strlen(s));
	e = n < 0 ? errno : 0;
	close(fd);
	return n < 0 ? -e : 0;
}

static int path_join(char *out, const char *a, const char *b)
{
	int n = snprintf(out, PATH_MAX, "%s/%s", a, b);

	return n < 0 || n >= PATH_MAX ? -ENAMETOOLONG : 0;
}

/* One unsigned decimal number, the whole of `text` but a newline. */
static int parse_u64(const char *text, uint64_t *v)
{
	char *end;

	errno = 0;
	unsigned long long x = strtoull(text, &end, 10);

	if (errno || end == text || (*end && *end != '\n'))
		return -EINVAL;
	*v = x;
	return 0;
}

/* Reads one unsigned decimal number from `dir`/`file`. */
static int read_u64(const char *dir, const char *file, uint64_t *v)
{
	char path[PATH_MAX], text[64];
	int r = path_join(path, dir, file);

	if (r < 0 || (r = fs_read_small(path, text, sizeof(text))) < 0)
		return r;
	return parse_u64(text, v);
}

/* Finds `key` at the start of a line of `text` ("key value\n") and parses its value. */
static int keyed_u64(const char *text, const char *key, uint64_t *v)
{
	size_t kl = strlen(key);

	for (const char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
		if (strncmp(l, key, kl) == 0 && l[kl] == ' ') {
			char *end;

			errno = 0;
			unsigned long long x = strtoull(l + kl + 1, &end, 10);

			if (errno || end == l + kl + 1)
				return -EINVAL;
			*v = x;
			return 0;
		}
	}
	return -ENOENT;
}

/* True when the controller list in `file` names every controller in `want`. */
static bool controllers_include(const char *file, const char *const *want, size_t n)
{
	char text[512];

	if (fs_read_small(file, text, sizeof(text)) < 0)
		return false;
	for (size_t i = 0; i < n; i++) {
		bool found = false;
		size_t wl = strlen(want[i]);

		for (char *p = text; (p = strstr(p, want[i])); p += wl) {
			bool start = p == text || p[-1] == ' ';
			bool stop = p[wl] == '\0' || p[wl] == ' ' || p[wl] == '\n';

			if (start && stop) {
				found = true;
				break;
			}
		}
		if (!found)
			return false;
	}
	return true;
}

/* Finds the v2 base directory under `root` into `base`, or returns -ENOENT. */
static int find_v2(const char *root, char *base)
{
	static const char *const want[] = { "cpu", "memory" };
	char file[PATH_MAX];

	snprintf(base, PATH_MAX, "%s", root);
	if (path_join(file, base, "cgroup.controllers") == 0 && controllers_include(file, want, 2))
		return 0;
	if (snprintf(base, PATH_MAX, "%s/unified", root) >= PATH_MAX)
		return -ENAMETOOLONG;
	if (path_join(file, base, "cgroup.controllers") == 0 && controllers_include(file, want, 2))
		return 0;
	return -ENOENT;
}

int cg_detect(const char *root)
{
	char base[PATH_MAX], dir[PATH_MAX];
	struct stat st;

	if (!root)
		root = CG_ROOT_DEFAULT;
	if (find_v2(root, base) == 0)
		return CG_V2;
	for (int c = 0; c < CTL__COUNT; c++) {
		if (path_join(dir, root, ctl_names[c]) < 0 || stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
			return -ENOENT;
	}
	return CG_V1;
}

/* Fills the handle's directories for kiln/<node>/<name> without touching the file system. */
static int cg_paths(const char *root, const char *node, const char *name, struct cg **out)
{
	char base[PATH_MAX];
	struct cg *cg;
	int v;

	*out = NULL;
	if (!node || !name || !*node || !*name || strchr(node, '/') || strchr(name, '/') ||
	    strcmp(node, "..") == 0 || strcmp(name, "..") == 0)
		return -EINVAL;
	if (!root)
		root = CG_ROOT_DEFAULT;
	v = cg_detect(root);
	if (v < 0)
		return v;
	cg = calloc(1, sizeof(*cg));
	if (!cg)
		return -ENOMEM;
	cg->version = (enum cg_version)v;
	for (int f = 0; f < CGF__COUNT; f++)
		cg->fd[f] = -1;
	if (v == CG_V2)
		find_v2(root, base);
	for (int c = 0; c < CTL__COUNT; c++) {
		int n = v == CG_V2 ? snprintf(cg->dirs[c], PATH_MAX, "%s/kiln/%s/%s", base, node, name)
				   : snprintf(cg->dirs[c], PATH_MAX, "%s/%s/kiln/%s/%s", root,
					      ctl_names[c], node, name);

		if (n < 0 || n >= PATH_MAX) {
			free(cg);
			return -ENAMETOOLONG;
		}
	}
	*out = cg;
	return 0;
}

/* mkdir -p of `dir`, making each level's controllers available to its children on v2. */
static int make_dirs(const char *dir, size_t base_len, bool v2)
{
	char path[PATH_MAX];
	size_t len = strlen(dir);

	if (len >= PATH_MAX)
		return -ENAMETOOLONG;
	memcpy(path, dir, len + 1);
	for (size_t i = base_len + 1; i <= len; i++) {
		if (path[i] != '/' && path[i] != '\0')
			continue;
		char saved = path[i];

		path[i] = '\0';
		if (v2) {
			/* the parent must delegate the controllers before the child can use them */
			char *slash = strrchr(path, '/');
			char sub[PATH_MAX];

			*slash = '\0';
			if (path_join(sub, path, "cgroup.subtree_control") == 0) {
				write_str(sub, "+cpu");
				write_str(sub, "+memory");
				write_str(sub, "+pids");
			}
			*slash = '/';
		}
		if (mkdir(path, 0755) < 0 && errno != EEXIST)
			return -errno;
		path[i] = saved;
	}
	return 0;
}

static int set_limits(struct cg *cg, const struct cg_limits *lim)
{
	char path[PATH_MAX], val[64];
	int r = 0;

	if (cg->version == CG_V2) {
		if (lim->cpu_milli)
			snprintf(val, sizeof(val), "%llu %d",
				 (unsigned long long)lim->cpu_milli * CG_CPU_PERIOD_US / 1000,
				 CG_CPU_PERIOD_US);
		else
			snprintf(val, sizeof(val), "max %d", CG_CPU_PERIOD_US);
		if ((r = path_join(path, cg->dirs[CTL_CPU], "cpu.max")) < 0 || (r = write_str(path, val)) < 0)
			return r;
		if (lim->mem_bytes) {
			snprintf(val, sizeof(val), "%" PRIu64, lim->mem_bytes);
			if ((r = path_join(path, cg->dirs[CTL_MEMORY], "memory.max")) < 0 ||
			    (r = write_str(path, val)) < 0)
				return r;
		}
	} else {
		snprintf(val, sizeof(val), "%d", CG_CPU_PERIOD_US);
		if ((r = path_join(path, cg->dirs[CTL_CPU], "cpu.cfs_period_us")) < 0 ||
		    (r = write_str(path, val)) < 0)
			return r;
		if (lim->cpu_milli)
			snprintf(val, sizeof(val), "%llu",
				 (unsigned long long)lim->cpu_milli * CG_CPU_PERIOD_US / 1000);
		else
			snprintf(val, sizeof(val), "-1");
		if ((r = path_join(path, cg->dirs[CTL_CPU], "cpu.cfs_quota_us")) < 0 ||
		    (r = write_str(path, val)) < 0)
			return r;
		if (lim->mem_bytes) {
			snprintf(val, sizeof(val), "%" PRIu64, lim->mem_bytes);
			if ((r = path_join(path, cg->dirs[CTL_MEMORY], "memory.limit_in_bytes")) < 0 ||
			    (r = write_str(path, val)) < 0)
				return r;
		}
	}
	if (lim->pids) {
		snprintf(val, sizeof(val), "%u", lim->pids);
		if ((r = path_join(path, cg->dirs[CTL_PIDS], "pids.max")) < 0 || (r = write_str(path, val)) < 0)
			return r;
	}
	return 0;
}

int cg_create(const char *root, const char *node, const char *name, const struct cg_limits *lim,
	      struct cg **out)
{
	struct cg *cg;
	int r = cg_paths(root, node, name, &cg);

	if (r < 0)
		return r;
	for (int c = 0; c < CTL__COUNT; c++) {
		if (c > 0 && strcmp(cg->dirs[c], cg->dirs[c - 1]) == 0)
			continue;
		/* the part before "/kiln/" already exists (the hierarchy's mount) */
		const char *k = strstr(cg->dirs[c], "/kiln/");

		r = make_dirs(cg->dirs[c], (size_t)(k - cg->dirs[c]), cg->version == CG_V2);
		if (r < 0)
			goto fail;
	}
	if (lim && (r = set_limits(cg, lim)) < 0)
		goto fail;
	*out = cg;
	return 0;
fail:
	cg_destroy(cg);
	return r;
}

int cg_open(const char *root, const char *node, const char *name, struct cg **out)
{
	struct stat st;
	int r = cg_paths(root, node, name, out);

	if (r < 0)
		return r;
	if (stat((*out)->dirs[CTL_CPU], &st) < 0) {
		r = -errno;
		cg_free(*out);
		*out = NULL;
	}
	return r;
}

int cg_attach(struct cg *cg, pid_t pid)
{
	char path[PATH_MAX], val[32];

	snprintf(val, sizeof(val), "%d", (int)pid);
	for (int c = 0; c < CTL__COUNT; c++) {
		int r;

		if (c > 0 && strcmp(cg->dirs[c], cg->dirs[c - 1]) == 0)
			continue;
		if ((r = path_join(path, cg->dirs[c], "cgroup.procs")) < 0 || (r = write_str(path, val)) < 0)
			return r;
	}
	return 0;
}

/* The directory and name of file `f` of cg_read() for the group's version. */
static void file_of(const struct cg *cg, enum cg_file f, const char **dir, const char **name)
{
	static const char *const v1[CGF__COUNT] = { "cpuacct.usage", "memory.usage_in_bytes",
						    "memory.max_usage_in_bytes" };
	static const char *const v2[CGF__COUNT] = { "cpu.stat", "memory.current", "memory.peak" };

	*dir = cg->dirs[f == CGF_CPU ? (cg->version == CG_V2 ? CTL_CPU : CTL_CPUACCT) : CTL_MEMORY];
	*name = cg->version == CG_V2 ? v2[f] : v1[f];
}

static void close_files(struct cg *cg)
{
	for (int f = 0; f < CGF__COUNT; f++) {
		if (cg->fd[f] >= 0)
			close(cg->fd[f]);
		cg->fd[f] = -1;
	}
}

/* Half the process's descriptor limit (asked at each open, which is rare): cg_read() keeps no
 * file open at or above it, so a meter of many VMs leaves the rest to its sockets and falls back
 * to a read by path. */
static int keep_below(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY ||
	    rl.rlim_cur >= 2 * (rlim_t)INT_MAX)
		return INT_MAX;
	return (int)(rl.rlim_cur / 2);
}

/* The whole of a small file from its start into `text`, NUL-terminated: its length, or -errno. */
static ssize_t pread_text(int fd, char *text, size_t cap)
{
	ssize_t n;

	do
		n = pread(fd, text, cap - 1, 0);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return -errno;
	text[n] = '\0';
	return n;
}

/*
 * Reads file `f` of the group into `text` (`cap` bytes with the NUL; one read of a cgroup file
 * returns it whole, a shorter one is its end). Through the descriptor kept from the last read:
 * a path lookup in cgroupfs costs several times the read, once a second for each VM of a node.
 * It is opened anew by path when there is none, when reading it fails (the files of a removed
 * group answer ENODEV: one made again under the same name is read, as a read by path would) or,
 * in a tree of plain files (the tests', kiln-sim's), when it was unlinked: such a file keeps
 * answering after its removal. 0 or a negative errno.
 */
static int read_kept(struct cg *cg, enum cg_file f, char *text, size_t cap)
{
	const char *dir, *name;
	char path[PATH_MAX];
	struct statfs sfs;
	struct stat st;
	ssize_t n;
	int fd = cg->fd[f], r;

	if (fd >= 0 && cg->plain && (fstat(fd, &st) < 0 || st.st_nlink == 0)) {
		close(fd);
		fd = cg->fd[f] = -1;
	}
	if (fd >= 0) {
		if (pread_text(fd, text, cap) >= 0)
			return 0;
		close(fd);
		fd = cg->fd[f] = -1;
	}
	file_of(cg, f, &dir, &name);
	if ((r = path_join(path, dir, name)) < 0)
		return r;
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return -errno;
	n = pread_text(fd, text, cap);
	r = n < 0 ? (int)n : 0;
	if (f == CGF_CPU)
		cg->plain = fstatfs(fd, &sfs) < 0 || ((unsigned long)sfs.f_type != CGROUP_SUPER_MAGIC &&
						      (unsigned long)sfs.f_type != CGROUP2_SUPER_MAGIC);
	if (r == 0 && fd < keep_below())
		cg->fd[f] = fd;
	else
		close(fd);
	return r;
}

/* One unsigned decimal number, the whole of file `f` (v1's files, v2's memory ones). */
static int read_kept_u64(struct cg *cg, enum cg_file f, uint64_t *v)
{
	char text[64];
	int r = read_kept(cg, f, text, sizeof(text));

	return r < 0 ? r : parse_u64(text, v);
}

int cg_read(struct cg *cg, struct cg_usage *u)
{
	char text[4096];
	uint64_t v;
	int r;

	memset(u, 0, sizeof(*u));
	if (cg->version == CG_V2) {
		if ((r = read_kept(cg, CGF_CPU, text, sizeof(text))) < 0 ||
		    (r = keyed_u64(text, "usage_usec", &v)) < 0)
			return r;
		u->cpu_ns = v * 1000;
	} else if ((r = read_kept_u64(cg, CGF_CPU, &u->cpu_ns)) < 0) {
		return r;
	}
	if ((r = read_kept_u64(cg, CGF_MEM, &u->mem_bytes)) < 0)
		return r;
	u->has_peak = read_kept_u64(cg, CGF_PEAK, &u->mem_peak_bytes) == 0;
	return 0;
}

int cg_read_cpu_quota(const struct cg *cg, long long *quota_us, long long *period_us)
{
	char path[PATH_MAX], text[128];
	uint64_t v;
	int r;

	if (cg->version == CG_V2) {
		if ((r = path_join(path, cg->dirs[CTL_CPU], "cpu.max")) < 0 ||
		    (r = fs_read_small(path, text, sizeof(text))) < 0)
			return r;
		if (strncmp(text, "max ", 4) == 0) {
			*quota_us = -1;
			*period_us = atoll(text + 4);
		} else if (sscanf(text, "%lld %lld", quota_us, period_us) != 2) {
			return -EINVAL;
		}
		return 0;
	}
	if ((r = path_join(path, cg->dirs[CTL_CPU], "cpu.cfs_quota_us")) < 0 ||
	    (r = fs_read_small(path, text, sizeof(text))) < 0)
		return r;
	*quota_us = atoll(text);
	if ((r = read_u64(cg->dirs[CTL_CPU], "cpu.cfs_period_us", &v)) < 0)
		return r;
	*period_us = (long long)v;
	return 0;
}

/*
 * Calls `fn` for each pid in `dir`/cgroup.procs; stops early when it returns nonzero. Returns the
 * number of pids seen, or a negative errno.
 */
static int for_each_pid(const char *dir, int (*fn)(pid_t pid, void *arg), void *arg)
{
	char path[PATH_MAX];
	char *text = malloc(CG_FILE_MAX);
	int r, n = 0;

	if (!text)
		return -ENOMEM;
	if ((r = path_join(path, dir, "cgroup.procs")) < 0 || (r = fs_read_small(path, text, CG_FILE_MAX)) < 0) {
		free(text);
		return r;
	}
	for (char *p = text; *p;) {
		char *end;
		long pid = strtol(p, &end, 10);

		if (end == p)
			break;
		n++;
		if (fn && fn((pid_t)pid, arg))
			break;
		p = end;
		while (*p == '\n')
			p++;
	}
	free(text);
	return n;
}

static int match_pid(pid_t pid, void *arg)
{
	if (pid == *(pid_t *)arg) {
		*(pid_t *)arg = -1;
		return 1;
	}
	return 0;
}

bool cg_has_pid(const struct cg *cg, pid_t pid)
{
	pid_t want = pid;

	for_each_pid(cg->dirs[CTL_CPU], match_pid, &want);
	return want == -1;
}

static int kill_pid(pid_t pid, void *arg)
{
	kill(pid, SIGKILL);
	return 0;
}

/* Empties and removes one directory of the group; the parents (kiln/<node>) stay. */
static int drain_and_remove(const char *dir)
{
	struct timespec pause = { .tv_nsec = 10 * 1000000 };
	int r = 0;

	for (int i = 0; i < 200; i++) {
		int n = for_each_pid(dir, kill_pid, NULL);

		if (n == -ENOENT)
			return 0;
		if (n <= 0)
			break;
		nanosleep(&pause, NULL);
	}
	for (int i = 0; i < 100; i++) {
		if (rmdir(dir) == 0 || errno == ENOENT)
			return 0;
		r = -errno;
		if (errno != EBUSY)
			break;
		nanosleep(&pause, NULL);	/* exiting tasks still hold the group */
	}
	return r;
}

int cg_destroy(struct cg *cg)
{
	int r = 0;

	if (!cg)
		return 0;
	for (int c = 0; c < CTL__COUNT; c++) {
		if (c > 0 && strcmp(cg->dirs[c], cg->dirs[c - 1]) == 0)
			continue;
		if (cg->version == CG_V2) {
			char path[PATH_MAX];

			if (path_join(path, cg->dirs[c], "cgroup.kill") == 0)
				write_str(path, "1");
		}
		int e;

		if (c == 0)
			close_files(cg);
		e = drain_and_remove(cg->dirs[c]);

		if (e < 0 && r == 0)
			r = e;
	}
	free(cg);
	return r;
}

int cg_rename(struct cg *cg, const char *name)
{
	char to[CTL__COUNT][PATH_MAX];
	int done = 0, r = 0;

	if (!name || !*name || strchr(name, '/') || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
		return -EINVAL;
	for (int c = 0; c < CTL__COUNT; c++) {
		const char *slash = strrchr(cg->dirs[c], '/');
		int n = slash ? snprintf(to[c], PATH_MAX, "%.*s/%s", (int)(slash - cg->dirs[c]),
					 cg->dirs[c], name) : -1;

		if (n < 0 || n >= PATH_MAX)
			return -ENAMETOOLONG;
	}
	for (; done < CTL__COUNT; done++) {
		struct stat st;

		if (done > 0 && strcmp(cg->dirs[done], cg->dirs[done - 1]) == 0)
			continue;	/* v2: one directory */
		/* v1 with controllers mounted together (cpu,cpuacct): renamed through the first */
		if (rename(cg->dirs[done], to[done]) < 0 &&
		    !(errno == ENOENT && stat(to[done], &st) == 0 && stat(cg->dirs[done], &st) < 0)) {
			r = -errno;
			break;
		}
	}
	if (r < 0) {	/* back to the old name: the group stays whole under one name */
		while (done-- > 0)
			rename(to[done], cg->dirs[done]);
		return r;
	}
	for (int c = 0; c < CTL__COUNT; c++)
		memcpy(cg->dirs[c], to[c], PATH_MAX);
	return 0;
}

void cg_free(struct cg *cg)
{
	if (cg)
		close_files(cg);
	free(cg);
}

enum cg_version cg_version(const struct cg *cg)
{
	return cg->version;
}

const char *cg_dir(const struct cg *cg, const char *controller)
{
	for (int c = 0; c < CTL__COUNT; c++)
		if (strcmp(controller, ctl_names[c]) == 0)
			return cg->dirs[c];
	return NULL;
}
