/*
 * test_cgroup.c - the cgroup readers against fixture trees (tests/fixtures/cgroup/README.md):
 * which version a layout selects, and what cg_read() and the quota reader report for v2 and v1.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"
#include "vmm/cgroup.h"

static char root_v2[PATH_MAX], root_hybrid[PATH_MAX], root_hybrid_v2[PATH_MAX];

static void test_cgroup_detects_the_version(void)
{
	CHECK_INT(cg_detect(root_v2), CG_V2);
	CHECK_INT(cg_detect(root_hybrid), CG_V1);
	CHECK_INT(cg_detect(root_hybrid_v2), CG_V2);
	CHECK_INT(cg_detect("/nonexistent"), -ENOENT);
}

static void test_cgroup_v2_reads_usage(void)
{
	struct cg *cg = NULL;
	struct cg_usage u;
	long long quota, period;

	CHECK_INT(cg_open(root_v2, "n1", "vm1", &cg), 0);
	if (!cg)
		return;
	CHECK_INT(cg_version(cg), CG_V2);
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 1234567000LL);
	CHECK_INT(u.mem_bytes, 301989888);
	CHECK(u.has_peak);
	CHECK_INT(u.mem_peak_bytes, 335544320);
	CHECK_INT(cg_read_cpu_quota(cg, &quota, &period), 0);
	CHECK_INT(quota, 25000);
	CHECK_INT(period, 100000);
	CHECK(cg_has_pid(cg, 4243));
	CHECK(!cg_has_pid(cg, 424));
	cg_free(cg);
}

static void test_cgroup_v2_without_peak(void)
{
	struct cg *cg = NULL;
	struct cg_usage u;
	long long quota, period;

	CHECK_INT(cg_open(root_v2, "n1", "oldkernel", &cg), 0);
	if (!cg)
		return;
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 77000);
	CHECK_INT(u.mem_bytes, 4096);
	CHECK(!u.has_peak);
	CHECK_INT(cg_read_cpu_quota(cg, &quota, &period), 0);
	CHECK_INT(quota, -1);
	CHECK_INT(period, 100000);
	CHECK(!cg_has_pid(cg, 1));
	cg_free(cg);
}

static void test_cgroup_v1_reads_usage(void)
{
	struct cg *cg = NULL;
	struct cg_usage u;
	long long quota, period;

	CHECK_INT(cg_open(root_hybrid, "n1", "vm1", &cg), 0);
	if (!cg)
		return;
	CHECK_INT(cg_version(cg), CG_V1);
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 987654321);
	CHECK_INT(u.mem_bytes, 268435456);
	CHECK(u.has_peak);
	CHECK_INT(u.mem_peak_bytes, 270532608);
	CHECK_INT(cg_read_cpu_quota(cg, &quota, &period), 0);
	CHECK_INT(quota, 50000);
	CHECK_INT(period, 100000);
	CHECK(cg_has_pid(cg, 99));
	cg_free(cg);
}

static void test_cgroup_rejects_bad_names(void)
{
	struct cg *cg = NULL;

	CHECK_INT(cg_open(root_v2, "n1", "../n1", &cg), -EINVAL);
	CHECK_INT(cg_open(root_v2, "..", "vm1", &cg), -EINVAL);
	CHECK_INT(cg_open(root_v2, "n1", "absent", &cg), -ENOENT);
	CHECK(cg == NULL);
}

/* Writes `text` to `dir`/`name` in place (O_TRUNC: the same file, as the kernel's are). */
static void put(const char *dir, const char *name, const char *text)
{
	char path[PATH_MAX];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "w");
	CHECK(f != NULL);
	if (f) {
		fputs(text, f);
		fclose(f);
	}
}

static void unlink_in(const char *dir, const char *name)
{
	char path[PATH_MAX];

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	CHECK_INT(unlink(path), 0);
}

static int open_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	while (d && (e = readdir(d)))
		n += e->d_name[0] != '.';
	if (d)
		closedir(d);
	return n;
}

/*
 * cg_read() keeps its files open between reads, and still reads what a read by path would: a
 * value changed in place, files removed and made again under the same name (a tree of plain
 * files keeps answering from a removed file: cg_read() must not), and an error once they are gone.
 */
static void test_cgroup_read_keeps_its_files_and_follows_them(void)
{
	char root[] = "/tmp/kiln-test-cg-XXXXXX", vm[256], path[PATH_MAX];
	struct cg *cg = NULL;
	struct cg_usage u;
	int before;

	CHECK(mkdtemp(root) != NULL);
	put(root, "cgroup.controllers", "cpu memory pids\n");
	snprintf(vm, sizeof(vm), "%s/kiln", root);
	mkdir(vm, 0755);
	snprintf(vm, sizeof(vm), "%s/kiln/n1", root);
	mkdir(vm, 0755);
	snprintf(vm, sizeof(vm), "%s/kiln/n1/vm1", root);
	mkdir(vm, 0755);
	put(vm, "cpu.stat", "usage_usec 10\nuser_usec 10\n");
	put(vm, "memory.current", "4096\n");
	put(vm, "memory.peak", "8192\n");
	CHECK_INT(cg_open(root, "n1", "vm1", &cg), 0);
	if (!cg)
		return;
	before = open_fds();
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 10000);
	CHECK_INT(open_fds(), before + 3);	/* cpu.stat, memory.current, memory.peak */
	put(vm, "cpu.stat", "usage_usec 123456789\nuser_usec 10\n");
	put(vm, "memory.current", "1048576\n");
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 123456789000LL);
	CHECK_INT(u.mem_bytes, 1048576);
	CHECK_INT(u.mem_peak_bytes, 8192);
	CHECK_INT(open_fds(), before + 3);	/* the same three, read again */
	/* removed and made again: the new files are read */
	unlink_in(vm, "cpu.stat");
	unlink_in(vm, "memory.current");
	unlink_in(vm, "memory.peak");
	rmdir(vm);
	mkdir(vm, 0755);
	put(vm, "cpu.stat", "usage_usec 7\n");
	put(vm, "memory.current", "512\n");
	CHECK_INT(cg_read(cg, &u), 0);
	CHECK_INT(u.cpu_ns, 7000);
	CHECK_INT(u.mem_bytes, 512);
	CHECK(!u.has_peak);
	/* gone: an error, as a read by path gives */
	unlink_in(vm, "cpu.stat");
	unlink_in(vm, "memory.current");
	rmdir(vm);
	CHECK_INT(cg_read(cg, &u), -ENOENT);
	cg_free(cg);
	CHECK_INT(open_fds(), before);
	snprintf(path, sizeof(path), "rm -rf %s", root);
	CHECK_INT(system(path), 0);
}

/*
 * At or above half the descriptor limit cg_read() keeps nothing open and reads by path: in a child
 * whose soft limit is twice its lowest free descriptor, a read keeps no file and still reads.
 */
static void test_cgroup_read_keeps_nothing_past_half_the_descriptor_limit(void)
{
	pid_t pid = fork();
	int status = -1;

	if (pid == 0) {
		struct rlimit rl;
		struct cg *cg = NULL;
		struct cg_usage u;
		int lowest = dup(0), before, bad = 0;

		close(lowest);
		getrlimit(RLIMIT_NOFILE, &rl);
		rl.rlim_cur = 2 * (rlim_t)lowest;
		if (lowest < 0 || setrlimit(RLIMIT_NOFILE, &rl) < 0 ||
		    cg_open(root_v2, "n1", "vm1", &cg) != 0)
			_exit(2);
		before = open_fds();
		for (int i = 0; i < 2; i++) {
			bad |= cg_read(cg, &u) != 0 || u.cpu_ns != 1234567000LL ||
			       u.mem_bytes != 301989888 || !u.has_peak;
			bad |= open_fds() != before;
		}
		cg_free(cg);
		_exit(bad ? 1 : 0);
	}
	CHECK(pid > 0);
	if (pid > 0)
		waitpid(pid, &status, 0);
	CHECK(WIFEXITED(status));
	CHECK_INT(WEXITSTATUS(status), 0);
}

/* Burns about `ms` of CPU in a child moved into `cg`, and reaps it. */
static void burn_in(struct cg *cg, int ms)
{
	pid_t pid = fork();

	if (pid == 0) {
		struct timespec a, b;

		clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
		do
			clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
		while ((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000 < ms);
		_exit(0);
	}
	CHECK(pid > 0);
	if (pid <= 0)
		return;
	/* the child may have run a little before the move: only its time after it counts */
	CHECK_INT(cg_attach(cg, pid), 0);
	waitpid(pid, NULL, 0);
}

/* The node's directory above `cg`'s under each v1 controller (all one on v2), for the cleanup. */
static void node_dirs_of(struct cg *cg, char dirs[4][PATH_MAX])
{
	static const char *const ctl[] = { "cpu", "cpuacct", "memory", "pids" };

	for (int k = 0; k < 4; k++) {
		const char *d = cg_dir(cg, ctl[k]);
		char *slash;

		snprintf(dirs[k], PATH_MAX, "%s", d ? d : "");
		if ((slash = strrchr(dirs[k], '/')))
			*slash = '\0';
	}
}

static void node_dirs_remove(char dirs[4][PATH_MAX])
{
	for (int k = 0; k < 4; k++)
		if (dirs[k][0])
			rmdir(dirs[k]);
}

/*
 * On this host's real cgroups: a group removed and made again under the same name while a
 * handle keeps its files open (the kernel answers ENODEV on them) is read anew, the new group's
 * CPU time; removed for good, the read fails.
 */
static void test_cgroup_read_follows_a_remade_group(void)
{
	struct cg_limits lim = { 0 };
	struct cg *reader = NULL, *made = NULL;
	struct cg_usage u;
	char node[64], node_dirs[4][PATH_MAX] = { "" };

	snprintf(node, sizeof(node), "ut-cg-%d", (int)getpid());
	CHECK_INT(cg_create(NULL, node, "vm", &lim, &made), 0);
	if (!made)
		return;
	node_dirs_of(made, node_dirs);
	CHECK_INT(cg_open(NULL, node, "vm", &reader), 0);
	burn_in(made, 30);
	CHECK_INT(reader ? cg_read(reader, &u) : -1, 0);
	CHECK(u.cpu_ns > 0);
	CHECK_INT(cg_destroy(made), 0);
	made = NULL;
	CHECK_INT(cg_create(NULL, node, "vm", &lim, &made), 0);
	/* the new group, which ran nothing yet: its time, not the old one's */
	CHECK_INT(reader ? cg_read(reader, &u) : -1, 0);
	CHECK_INT(u.cpu_ns, 0);
	if (made)
		burn_in(made, 30);
	CHECK_INT(reader ? cg_read(reader, &u) : -1, 0);
	CHECK(u.cpu_ns > 0);
	CHECK_INT(cg_destroy(made), 0);
	CHECK(reader && cg_read(reader, &u) < 0);
	cg_free(reader);
	node_dirs_remove(node_dirs);
}

/*
 * On this host's real cgroups: a group renamed keeps its processes, its CPU time and its caps,
 * its handle's kept files read on; its old name is gone. A name taken, or not a name, is refused
 * and the group keeps the one it had.
 */
static void test_cgroup_rename_keeps_processes_time_and_caps(void)
{
	struct cg_limits lim = { .cpu_milli = 500 };
	struct cg *g = NULL, *b = NULL, *other = NULL, *gone = NULL;
	struct cg_usage u0 = { 0 }, u = { 0 };
	long long quota = 0, period = 0;
	char node[64], node_dirs[4][PATH_MAX] = { "" };
	pid_t child;

	snprintf(node, sizeof(node), "ut-cgr-%d", (int)getpid());
	CHECK_INT(cg_create(NULL, node, "a", &lim, &g), 0);
	if (!g)
		return;
	node_dirs_of(g, node_dirs);
	burn_in(g, 30);
	CHECK_INT(cg_read(g, &u0), 0);
	child = fork();
	if (child == 0) {
		pause();
		_exit(0);
	}
	CHECK_INT(cg_attach(g, child), 0);
	CHECK_INT(cg_rename(g, "b"), 0);
	CHECK_INT(cg_open(NULL, node, "a", &gone), -ENOENT);
	cg_free(gone);
	CHECK_INT(cg_open(NULL, node, "b", &b), 0);
	CHECK(b && cg_has_pid(b, child));
	CHECK(cg_has_pid(g, child));
	CHECK_INT(b ? cg_read(b, &u) : -1, 0);
	CHECK(u.cpu_ns >= u0.cpu_ns && u0.cpu_ns > 0);
	CHECK_INT(cg_read(g, &u), 0);	/* the renamed handle's files, kept or reopened */
	CHECK(u.cpu_ns >= u0.cpu_ns);
	CHECK_INT(b ? cg_read_cpu_quota(b, &quota, &period) : -1, 0);
	CHECK_INT(quota, 50000);
	/* a name taken, and no name: refused, still "b" */
	CHECK_INT(cg_create(NULL, node, "c", &lim, &other), 0);
	CHECK(cg_rename(g, "c") < 0);
	CHECK_INT(cg_rename(g, "x/y"), -EINVAL);
	CHECK_INT(cg_rename(g, ".."), -EINVAL);
	CHECK(cg_has_pid(b, child));
	CHECK_STR(strrchr(cg_dir(g, "cpu"), '/') + 1, "b");
	kill(child, SIGKILL);
	waitpid(child, NULL, 0);
	cg_free(b);
	CHECK_INT(cg_destroy(other), 0);
	CHECK_INT(cg_destroy(g), 0);
	node_dirs_remove(node_dirs);
}

int main(void)
{
	const char *fx = getenv("KILN_FIXTURES");

	if (!fx) {
		fprintf(stderr, "KILN_FIXTURES must name tests/fixtures\n");
		return 1;
	}
	snprintf(root_v2, sizeof(root_v2), "%s/cgroup/v2", fx);
	snprintf(root_hybrid, sizeof(root_hybrid), "%s/cgroup/hybrid", fx);
	snprintf(root_hybrid_v2, sizeof(root_hybrid_v2), "%s/cgroup/hybrid-v2", fx);
	TEST(test_cgroup_detects_the_version);
	TEST(test_cgroup_v2_reads_usage);
	TEST(test_cgroup_v2_without_peak);
	TEST(test_cgroup_v1_reads_usage);
	TEST(test_cgroup_rejects_bad_names);
	TEST(test_cgroup_read_keeps_its_files_and_follows_them);
	TEST(test_cgroup_read_keeps_nothing_past_half_the_descriptor_limit);
	TEST(test_cgroup_read_follows_a_remade_group);
	TEST(test_cgroup_rename_keeps_processes_time_and_caps);
	return test_summary();
}
