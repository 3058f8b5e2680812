/*
 * orphan.c - finds and removes what a previous run of this kiln-node left on the host (orphan.h).
 *
 * Discovery is by name, always with this node's id as a whole path component (run dirs, cgroups) or
 * a whole owner string (uid leases), so another node's VMs on the same host never match. Processes
 * are killed through pidfds after checking, on the pinned process, that it is still in the VM's
 * cgroup and looks like its VMM: a pid recycled in between cannot be hit.
 */
#include "common/fsutil.h"
#include "vmm/orphan.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "vmm/hv.h"
#include "vmm/jail.h"

#define PROC_FILE_MAX 65536	/* bytes read from a /proc or cgroup file */
#define KILL_TRIES 200		/* rounds of 10 ms waiting for a group to empty */

static const char *const v1_ctls[] = { "cpu", "cpuacct", "memory", "pids" };

/* Where one node's things live. */
struct orphan_env {
	const char *node;
	const char *run_root;
	const char *cg_root;
	char lease_dir[PATH_MAX];
	/* kiln/<node> under each hierarchy that has it: v1 controllers, then v2 */
	char cg_bases[6][PATH_MAX];
	unsigned n_bases;
};

struct id_set {
	char (*ids)[VMM_ID_MAX + 1];
	size_t n, cap;
};

static bool id_ok(const char *s)
{
	size_t n = strlen(s);

	if (n == 0 || n > VMM_ID_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-')
			return false;
	return true;
}

static int id_set_add(struct id_set *s, const char *id)
{
	for (size_t i = 0; i < s->n; i++)
		if (strcmp(s->ids[i], id) == 0)
			return 0;
	if (s->n == VMM_ORPHANS_MAX)
		return -E2BIG;
	if (s->n == s->cap) {
		size_t cap = s->cap ? s->cap * 2 : 16;
		void *p = realloc(s->ids, cap * sizeof(*s->ids));

		if (!p)
			return -ENOMEM;
		s->ids = p;
		s->cap = cap;
	}
	snprintf(s->ids[s->n++], VMM_ID_MAX + 1, "%s", id);
	return 0;
}

/* Adds every subdirectory of `dir` named like a VM id. A missing `dir` adds nothing. */
static int add_subdirs(struct id_set *s, const char *dir)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	int r = 0;

	if (!d)
		return errno == ENOENT ? 0 : -errno;
	while (r == 0 && (e = readdir(d)) != NULL) {
		struct stat st;

		if (!id_ok(e->d_name) || fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
		    !S_ISDIR(st.st_mode))
			continue;
		r = id_set_add(s, e->d_name);
	}
	closedir(d);
	return r;
}

/* Calls fn(uid, owner) for each lease in the lease dir. */
static int for_each_lease(const struct orphan_env *env, int (*fn)(const struct orphan_env *env, uid_t uid,
								    const char *owner, void *arg),
			  void *arg)
{
	DIR *d = opendir(env->lease_dir);
	struct dirent *e;
	int r = 0;

	if (!d)
		return errno == ENOENT ? 0 : -errno;
	while (r == 0 && (e = readdir(d)) != NULL) {
		char path[PATH_MAX], owner[128], *end;
		unsigned long uid = strtoul(e->d_name, &end, 10);
		ssize_t n;

		if (!isdigit((unsigned char)e->d_name[0]) || *end || uid == 0 || uid > UINT_MAX ||
		    !fs_path(path, "%s/%s", env->lease_dir, e->d_name))
			continue;
		n = fs_read_small(path, owner, sizeof(owner));
		if (n < 0)
			continue;
		while (n > 0 && (owner[n - 1] == '\n' || owner[n - 1] == ' '))
			owner[--n] = '\0';
		r = fn(env, (uid_t)uid, owner, arg);
	}
	closedir(d);
	return r;
}

/* "<node>/<id>" of this node: the id part, or NULL. */
static const char *lease_id(const struct orphan_env *env, const char *owner)
{
	size_t n = strlen(env->node);

	if (strncmp(owner, env->node, n) != 0 || owner[n] != '/' || !id_ok(owner + n + 1))
		return NULL;
	return owner + n + 1;
}

static int lease_collect(const struct orphan_env *env, uid_t uid, const char *owner, void *arg)
{
	const char *id = lease_id(env, owner);

	return id ? id_set_add(arg, id) : 0;
}

struct lease_release {
	const char *id;
	int err;
};

static int lease_release_one(const struct orphan_env *env, uid_t uid, const char *owner, void *arg)
{
	struct lease_release *lr = arg;
	const char *id = lease_id(env, owner);
	int r;

	if (id && strcmp(id, lr->id) == 0 && (r = jail_uid_release(env->lease_dir, uid)) < 0 && !lr->err)
		lr->err = r;
	return 0;
}

/* ---- processes ---- */

static int pidfd_open_(pid_t pid)
{
	return (int)syscall(SYS_pidfd_open, pid, 0);
}

static int pidfd_signal(int pidfd, int sig)
{
	return (int)syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0);
}

/* True when /proc/<pid>/cgroup puts the process in kiln/<node>/<id> in some hierarchy. */
static bool pid_in_group(pid_t pid, const char *node, const char *id, char *buf)
{
	char path[64], want[PATH_MAX];

	snprintf(path, sizeof(path), "/proc/%d/cgroup", (int)pid);
	if (!fs_path(want, "/kiln/%s/%s", node, id) || fs_read_small(path, buf, PROC_FILE_MAX) < 0)
		return false;
	for (char *line = buf; *line;) {
		char *nl = strchr(line, '\n');
		char *p;

		if (nl)
			*nl = '\0';
		p = strchr(line, ':');
		p = p ? strchr(p + 1, ':') : NULL;	/* "N:controllers:/path" */
		if (p && strcmp(p + 1, want) == 0)
			return true;
		if (!nl)
			break;
		line = nl + 1;
	}
	return false;
}

static bool pid_is_zombie(pid_t pid)
{
	char path[64], buf[512];
	char *rp;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	if (fs_read_small(path, buf, sizeof(buf)) < 0)
		return true;	/* gone */
	rp = strrchr(buf, ')');
	return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

/*
 * Whether a command line (NUL-separated, `len` bytes) is VM `run_dir`'s VMM: its program is
 * qemu-system-* or firecracker, or one of its arguments names the run dir. `what` receives the
 * program name for messages.
 */
static bool cmdline_is_vmm(const char *cmd, size_t len, const char *run_dir, char *what, size_t wlen)
{
	const char *base = strrchr(cmd, '/');
	size_t rlen = strlen(run_dir);

	base = base ? base + 1 : cmd;
	snprintf(what, wlen, "%s", base);
	if (strncmp(base, "qemu-system-", 12) == 0 || strcmp(base, "firecracker") == 0)
		return true;
	for (size_t i = 0; i < len; i += strlen(cmd + i) + 1) {
		const char *hit = strstr(cmd + i, run_dir);

		if (hit && (hit[rlen] == '/' || hit[rlen] == '\0'))
			return true;
	}
	return false;
}

/*
 * Kills `pid` if it still is VM `id`'s VMM. Returns 0 (killed, or gone, or no longer in the group),
 * or -EPERM for a process in the group that is not a VMM (`what` names it).
 */
static int kill_verified(pid_t pid, const struct orphan_env *env, const char *id, const char *run_dir,
			 char *buf, char *what, size_t wlen)
{
	char path[64];
	ssize_t n;
	int pidfd = pidfd_open_(pid), r = 0;

	if (pidfd < 0)
		return errno == ESRCH ? 0 : -errno;
	/* pinned: from here on `pid` cannot name another process while pidfd_signal(0) succeeds */
	if (!pid_in_group(pid, env->node, id, buf))
		goto out;
	snprintf(path, sizeof(path), "/proc/%d/cmdline", (int)pid);
	n = fs_read_small(path, buf, PROC_FILE_MAX);
	if (n <= 0) {
		if (!pid_is_zombie(pid)) {
			snprintf(what, wlen, "(no command line)");
			r = -EPERM;
		}
		goto out;
	}
	if (!cmdline_is_vmm(buf, (size_t)n, run_dir, what, wlen)) {
		r = -EPERM;
		goto out;
	}
	/* still the process whose /proc files were read: then kill it */
	if (pidfd_signal(pidfd, 0) == 0 && pidfd_signal(pidfd, SIGKILL) < 0 && errno != ESRCH)
		r = -errno;
	if (r == 0)
		log_info("orphan vm '%s' of node '%s': killed pid %d (%s)", id, env->node, (int)pid, what);
out:
	close(pidfd);
	return r;
}

/* Pids listed in `dir`/cgroup.procs, into `pids` (at most `max`); returns the count or -errno. */
static int group_pids(const char *dir, pid_t *pids, int max, char *buf)
{
	char path[PATH_MAX];
	ssize_t r;
	int n = 0;

	if (!fs_path(path, "%s/cgroup.procs", dir))
		return -ENAMETOOLONG;
	if ((r = fs_read_small(path, buf, PROC_FILE_MAX)) < 0)
		return (int)r;
	for (char *p = buf; *p && n < max;) {
		char *end;
		long v = strtol(p, &end, 10);

		if (end == p)
			break;
		if (v > 0)
			pids[n++] = (pid_t)v;
		p = end;
		while (*p == '\n')
			p++;
	}
	return n;
}

/*
 * Empties VM `id`'s cgroup directories (`dirs`, `n`) of its VMM processes and removes them.
 * Returns 0 or a negative errno; -EPERM when a process that is not a VMM is in the group.
 */
static int groups_clean(const struct orphan_env *env, const char *id, const char *run_dir,
			char (*dirs)[PATH_MAX], unsigned n, struct kiln_error *err)
{
	struct timespec pause = { .tv_nsec = 10 * 1000000 };
	char *buf = malloc(PROC_FILE_MAX);
	pid_t pids[512];
	int r = 0;

	if (!buf)
		return -ENOMEM;
	for (int round = 0; round < KILL_TRIES; round++) {
		int seen = 0;

		for (unsigned i = 0; i < n && r == 0; i++) {
			int k = group_pids(dirs[i], pids, (int)(sizeof(pids) / sizeof(pids[0])), buf);

			if (k == -ENOENT)
				continue;
			if (k < 0) {
				r = k;
				break;
			}
			seen += k;
			for (int j = 0; j < k && r == 0; j++) {
				char what[64];

				r = kill_verified(pids[j], env, id, run_dir, buf, what, sizeof(what));
				if (r == -EPERM) {
					log_warn("orphan vm '%s' of node '%s': pid %d in its cgroup is not its vmm (%s), left alone",
						 id, env->node, (int)pids[j], what);
					kiln_error_set(err, KILN_E_CONFLICT,
						       "vm '%s': pid %d in its cgroup is not its vmm (%s): left alone",
						       id, (int)pids[j], what);
				}
			}
		}
		if (r < 0 || seen == 0)
			break;
		nanosleep(&pause, NULL);
	}
	for (unsigned i = 0; i < n && r == 0; i++) {
		int tries = 0;

		while (rmdir(dirs[i]) < 0 && errno != ENOENT) {
			if (errno != EBUSY || ++tries == 100) {
				r = -errno;
				break;
			}
			nanosleep(&pause, NULL);	/* exiting tasks still hold the group */
		}
	}
	free(buf);
	return r;
}

/* ---- run dir ---- */

/* Undoes mountinfo's octal escapes (\040 for a space) in place. */
static void unescape(char *s)
{
	char *o = s;

	for (; *s; s++) {
		if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' && s[3] >= '0' &&
		    s[3] <= '7') {
			*o++ = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
			s += 3;
		} else {
			*o++ = *s;
		}
	}
	*o = '\0';
}

/* Lazily unmounts every mount at or below `dir` in this mount namespace, deepest (latest) first. */
static int unmount_under(const char *dir)
{
	FILE *f = fopen("/proc/self/mountinfo", "re");
	char line[4096], (*pts)[PATH_MAX] = NULL;
	size_t n = 0, cap = 0, dlen = strlen(dir);
	int r = 0;

	if (!f)
		return -errno;
	while (fgets(line, sizeof(line), f)) {
		char *save = NULL, *mp = NULL, *tok = strtok_r(line, " ", &save);

		for (int field = 0; tok && field < 4; field++)
			tok = strtok_r(NULL, " ", &save);
		mp = tok;	/* the 5th field: mount point */
		if (!mp)
			continue;
		unescape(mp);
		if (strncmp(mp, dir, dlen) != 0 || (mp[dlen] != '/' && mp[dlen] != '\0'))
			continue;
		if (n == cap) {
			size_t c = cap ? cap * 2 : 8;
			void *p = realloc(pts, c * sizeof(*pts));

			if (!p) {
				r = -ENOMEM;
				break;
			}
			pts = p;
			cap = c;
		}
		snprintf(pts[n++], PATH_MAX, "%s", mp);
	}
	fclose(f);
	while (r == 0 && n > 0) {
		n--;
		if (umount2(pts[n], MNT_DETACH) < 0 && errno != EINVAL && errno != ENOENT)
			r = -errno;
	}
	free(pts);
	return r;
}

/* ---- one VM ---- */

/* True when VM `id` of node `node` has a run dir or a cgroup (for the memory file name check). */
static bool vm_exists(const struct orphan_env *env, const char *node, const char *id)
{
	char path[PATH_MAX];
	struct stat st;

	if (fs_path(path, "%s/%s/%s", env->run_root, node, id) && stat(path, &st) == 0)
		return true;
	for (size_t c = 0; c < sizeof(v1_ctls) / sizeof(v1_ctls[0]); c++)
		if (fs_path(path, "%s/%s/kiln/%s/%s", env->cg_root, v1_ctls[c], node, id) && stat(path, &st) == 0)
			return true;
	return (fs_path(path, "%s/kiln/%s/%s", env->cg_root, node, id) && stat(path, &st) == 0) ||
	       (fs_path(path, "%s/unified/kiln/%s/%s", env->cg_root, node, id) && stat(path, &st) == 0);
}

/*
 * The memory file kiln-<node>-<id>.mem could also be node N2's VM I2 when "<node>-<id>" splits
 * differently at another '-'. True when such another VM exists.
 */
static bool mem_name_shared(const struct orphan_env *env, const char *id)
{
	char joined[2 * VMM_ID_MAX + 2];
	size_t nlen = strlen(env->node);

	snprintf(joined, sizeof(joined), "%s-%s", env->node, id);
	for (char *p = joined; (p = strchr(p, '-')) != NULL; p++) {
		if ((size_t)(p - joined) == nlen)
			continue;
		*p = '\0';
		bool other = id_ok(joined) && id_ok(p + 1) && vm_exists(env, joined, p + 1);

		*p = '-';
		if (other)
			return true;
	}
	return false;
}

/* Removes everything of VM `id`. Returns true when all of it is gone. */
static bool vm_clean(const struct orphan_env *env, const char *id, struct kiln_error *err)
{
	char run_dir[PATH_MAX], mem[PATH_MAX];
	char (*dirs)[PATH_MAX] = calloc(6, PATH_MAX);
	struct lease_release lr = { .id = id };
	struct stat st;
	unsigned n = 0;
	bool ok = true;
	int r;

	if (!dirs || !fs_path(run_dir, "%s/%s/%s", env->run_root, env->node, id) ||
	    !fs_path(mem, "%s/kiln-%s-%s.mem", VMM_MEM_DIR_DEFAULT, env->node, id)) {
		free(dirs);
		kiln_error_set(err, KILN_E_NOMEM, "vm '%s': cannot clean up", id);
		return false;
	}
	for (unsigned b = 0; b < env->n_bases; b++)
		if (fs_path(dirs[n], "%s/%s", env->cg_bases[b], id) && stat(dirs[n], &st) == 0)
			n++;
	/* processes first: nothing may hold the files below once they go */
	if ((r = groups_clean(env, id, run_dir, dirs, n, err)) < 0) {
		if (r != -EPERM) {
			log_warn("orphan vm '%s' of node '%s': cannot remove its cgroup: %s", id, env->node,
				 strerror(-r));
			kiln_error_set(err, KILN_E_IO, "vm '%s': cannot remove its cgroup: %s", id, strerror(-r));
		}
		free(dirs);
		return false;	/* a live process may still use the files: leave them */
	}
	free(dirs);
	if ((r = unmount_under(run_dir)) < 0 || (r = fs_remove_tree(run_dir)) < 0) {
		log_warn("orphan vm '%s' of node '%s': cannot remove '%s': %s", id, env->node, run_dir,
			 strerror(-r));
		kiln_error_set(err, KILN_E_IO, "vm '%s': cannot remove '%s': %s", id, run_dir, strerror(-r));
		ok = false;
	}
	if (lstat(mem, &st) == 0) {
		if (mem_name_shared(env, id)) {
			log_warn("orphan vm '%s' of node '%s': '%s' may be another node's vm, kept", id, env->node, mem);
		} else if (unlink(mem) < 0 && errno != ENOENT) {
			kiln_error_set(err, KILN_E_IO, "vm '%s': cannot remove '%s': %s", id, mem, strerror(errno));
			ok = false;
		}
	}
	if ((r = for_each_lease(env, lease_release_one, &lr)) < 0 || lr.err < 0) {
		r = r < 0 ? r : lr.err;
		kiln_error_set(err, KILN_E_IO, "vm '%s': cannot release its uid lease: %s", id, strerror(-r));
		ok = false;
	}
	if (ok)
		log_info("orphan vm '%s' of node '%s' cleaned up", id, env->node);
	return ok;
}

int vmm_lease_owner(const char *node, const char *id, char *out, size_t len)
{
	int n = snprintf(out, len, "%s/%s", node, id);

	return n < 0 || (size_t)n >= len ? -ENAMETOOLONG : 0;
}

static int id_cmp(const void *a, const void *b)
{
	return strcmp((const char *)a, (const char *)b);
}

int vmm_orphans_cleanup(const char *node_id, const char *run_root, const char *cgroup_root,
			bool (*keep_cb)(void *ctx, const char *id), void *ctx, struct kiln_error *err)
{
	struct orphan_env *env;
	struct id_set ids = { 0 };
	char path[PATH_MAX];
	struct stat st;
	int r, cleaned = 0;

	if (!node_id || !id_ok(node_id) || strcmp(node_id, "uids") == 0) {
		kiln_error_set(err, KILN_E_INVALID, "node id '%s' is not valid", node_id ? node_id : "");
		return -1;
	}
	env = calloc(1, sizeof(*env));
	if (!env) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return -1;
	}
	env->node = node_id;
	env->run_root = run_root ? run_root : VMM_RUN_ROOT_DEFAULT;
	env->cg_root = cgroup_root ? cgroup_root : CG_ROOT_DEFAULT;
	if (!fs_path(env->lease_dir, "%s/uids", env->run_root)) {
		kiln_error_set(err, KILN_E_INVALID, "run root '%s' too long", env->run_root);
		free(env);
		return -1;
	}
	/* kiln/<node> under every hierarchy that has it: v1 controllers, a v2 root, a hybrid's unified */
	for (size_t c = 0; c < sizeof(v1_ctls) / sizeof(v1_ctls[0]); c++)
		if (fs_path(env->cg_bases[env->n_bases], "%s/%s/kiln/%s", env->cg_root, v1_ctls[c], node_id) &&
		    stat(env->cg_bases[env->n_bases], &st) == 0)
			env->n_bases++;
	if (fs_path(env->cg_bases[env->n_bases], "%s/kiln/%s", env->cg_root, node_id) &&
	    stat(env->cg_bases[env->n_bases], &st) == 0)
		env->n_bases++;
	if (fs_path(env->cg_bases[env->n_bases], "%s/unified/kiln/%s", env->cg_root, node_id) &&
	    stat(env->cg_bases[env->n_bases], &st) == 0)
		env->n_bases++;

	r = fs_path(path, "%s/%s", env->run_root, node_id) ? add_subdirs(&ids, path) : -ENAMETOOLONG;
	for (unsigned b = 0; r == 0 && b < env->n_bases; b++)
		r = add_subdirs(&ids, env->cg_bases[b]);
	if (r == 0)
		r = for_each_lease(env, lease_collect, &ids);
	if (r < 0) {
		/* clean what was found; the rest is for the next start */
		log_warn("node '%s': looking for leftover vms: %s", node_id, strerror(-r));
		kiln_error_set(err, KILN_E_IO, "node '%s': looking for leftover vms: %s", node_id, strerror(-r));
	}
	if (ids.n)
		qsort(ids.ids, ids.n, sizeof(*ids.ids), id_cmp);
	for (size_t i = 0; i < ids.n; i++) {
		if (keep_cb && keep_cb(ctx, ids.ids[i]))
			continue;
		if (vm_clean(env, ids.ids[i], err))
			cleaned++;
	}
	free(ids.ids);
	free(env);
	return cleaned;
}
