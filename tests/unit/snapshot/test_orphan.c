/*
 * test_orphan.c - a restarted node cleans up the VMs its previous run left, and nothing else.
 *
 * Fakes leftover VMs with real pieces: a process (sleep, named like QEMU) in a real cgroup
 * kiln/<node>/<id>, a run dir with a socket, logs and a bind mount on a jail mount point, a uid
 * lease, a /dev/shm memory file. Beside them: a VM the node keeps, a VM of another node id (whose
 * memory file name collides with one of ours), and a process in one of our VM's cgroups that is not
 * a VMM. Needs root (cgroups, mounts); fails without it (never a skip: tests/skip-allowed.txt).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"
#include "vmm/cgroup.h"
#include "vmm/jail.h"
#include "vmm/orphan.h"

static char run_root[PATH_MAX], lease_dir[PATH_MAX];
static char node[32], other[40];

struct fake {
	const char *node, *id;
	pid_t pid;		/* 0: no process */
	struct cg *cg;
	uid_t uid;
	char run_dir[PATH_MAX], mem[PATH_MAX], jail_kernel[PATH_MAX];
	bool mounted;
};

/* snprintf that aborts the test on truncation (paths here are short). */
static void pathf(char *out, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void pathf(char *out, size_t len, const char *fmt, ...)
{
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(out, len, fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= len)
		abort();
}

static bool exists(const char *path)
{
	struct stat st;

	return lstat(path, &st) == 0;
}

static void write_text(const char *path, const char *s)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);

	CHECK(fd >= 0);
	CHECK(write(fd, s, strlen(s)) == (ssize_t)strlen(s));
	close(fd);
}

/* Reaps one process when it dies, as init does for a dead node's orphans. */
static void *reaper(void *arg)
{
	waitpid((pid_t)(long)arg, NULL, 0);
	return NULL;
}

/* Starts `sleep 1000` with argv[0] `name` inside `cg`. */
static pid_t start_in_group(struct cg *cg, const char *name)
{
	int gate[2];
	pid_t pid;
	pthread_t t;
	char c;

	CHECK(pipe(gate) == 0);
	pid = fork();
	if (pid == 0) {
		close(gate[1]);
		if (read(gate[0], &c, 1) != 1)
			_exit(1);
		execl("/bin/sleep", name, "1000", (char *)NULL);
		_exit(127);
	}
	close(gate[0]);
	CHECK(pid > 0);
	CHECK(cg_attach(cg, pid) == 0);
	CHECK(write(gate[1], "go", 1) == 1);
	close(gate[1]);
	usleep(100 * 1000);	/* exec done */
	CHECK(cg_has_pid(cg, pid));
	pthread_create(&t, NULL, reaper, (void *)(long)pid);
	pthread_detach(t);
	return pid;
}

/* Lays out what a VM of `f->node` leaves behind; `proc_name` NULL: no process, no cgroup. */
static void fake_vm(struct fake *f, const char *proc_name, bool with_mem, bool with_mount)
{
	char path[PATH_MAX], owner[128];
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int s;

	pathf(f->run_dir, sizeof(f->run_dir), "%s/%s/%s", run_root, f->node, f->id);
	pathf(path, sizeof(path), "%s/%s", run_root, f->node);
	mkdir(path, 0711);
	CHECK(mkdir(f->run_dir, 0711) == 0);
	pathf(path, sizeof(path), "%s/serial.log", f->run_dir);
	write_text(path, "guest console\n");
	pathf(sa.sun_path, sizeof(sa.sun_path), "%s/qmp.sock", f->run_dir);
	s = socket(AF_UNIX, SOCK_STREAM, 0);
	CHECK(bind(s, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	close(s);
	pathf(path, sizeof(path), "%s/jail", f->run_dir);
	CHECK(mkdir(path, 0755) == 0);
	pathf(f->jail_kernel, sizeof(f->jail_kernel), "%s/jail/kernel", f->run_dir);
	write_text(f->jail_kernel, "");
	if (with_mount) {
		/* a bind left on the host (normally they live in the VM's mount namespace only) */
		pathf(path, sizeof(path), "%s/serial.log", f->run_dir);
		f->mounted = mount(path, f->jail_kernel, NULL, MS_BIND, NULL) == 0;
		CHECK(f->mounted);
	}
	CHECK(vmm_lease_owner(f->node, f->id, owner, sizeof(owner)) == 0);
	CHECK(jail_uid_alloc(lease_dir, JAIL_UID_MIN, JAIL_UID_MAX, owner, &f->uid) == 0);
	pathf(f->mem, sizeof(f->mem), "/dev/shm/kiln-%s-%s.mem", f->node, f->id);
	if (with_mem)
		write_text(f->mem, "guest ram");
	if (proc_name) {
		CHECK(cg_create(NULL, f->node, f->id, NULL, &f->cg) == 0);
		f->pid = start_in_group(f->cg, proc_name);
	}
}

static bool lease_held(uid_t uid)
{
	char path[PATH_MAX];

	pathf(path, sizeof(path), "%s/%u", lease_dir, (unsigned)uid);
	return exists(path);
}

static bool alive(pid_t pid)
{
	char path[64], st[256];
	FILE *f;
	bool live = false;

	pathf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return false;
	if (fgets(st, sizeof(st), f)) {
		char *rp = strrchr(st, ')');

		live = rp && rp[2] != 'Z' && rp[2] != 'X';
	}
	fclose(f);
	return live;
}

static bool keep(void *ctx, const char *id)
{
	(*(int *)ctx)++;
	return strcmp(id, "keep1") == 0;
}

static void test_cleanup_removes_own_leftovers_only(void)
{
	struct fake vm1 = { .node = node, .id = "vm1" };
	struct fake vm2 = { .node = node, .id = "vm2" };
	struct fake keep1 = { .node = node, .id = "keep1" };
	struct fake bv1 = { .node = node, .id = "b-v1" };	/* kiln-<node>-b-v1.mem ... */
	struct fake theirs = { .node = other, .id = "v1" };	/* ... is also kiln-<node>-b-v1.mem */
	struct fake impostor = { .node = node, .id = "odd" };
	struct kiln_error err = { 0 };
	char cg_path[PATH_MAX];
	int asked = 0, n;

	fake_vm(&vm1, "qemu-system-x86_64", true, true);
	fake_vm(&vm2, NULL, true, false);
	fake_vm(&keep1, NULL, true, false);
	fake_vm(&theirs, "qemu-system-x86_64", true, false);
	fake_vm(&bv1, NULL, false, false);
	fake_vm(&impostor, "sleep", false, false);

	n = vmm_orphans_cleanup(node, run_root, NULL, keep, &asked, &err);
	CHECK_INT(n, 3);	/* vm1, vm2, b-v1 */
	CHECK_INT(asked, 5);	/* every VM of this node was offered to keep_cb */
	CHECK_INT(err.code, KILN_E_CONFLICT);	/* the impostor */
	CHECK(strstr(err.msg, "vm 'odd'") != NULL);
	fprintf(stderr, "  reported: %s\n", err.msg);

	/* vm1: process, cgroup, mount, run dir, lease and memory file gone */
	for (int i = 0; i < 100 && alive(vm1.pid); i++)
		usleep(10 * 1000);
	CHECK(!alive(vm1.pid));
	CHECK(!exists(cg_dir(vm1.cg, "cpu")));
	CHECK(!exists(cg_dir(vm1.cg, "memory")));
	CHECK(!exists(cg_dir(vm1.cg, "pids")));
	CHECK(!exists(vm1.run_dir));
	CHECK(!lease_held(vm1.uid));
	CHECK(!exists(vm1.mem));
	/* vm2 had no process: its files and lease still go */
	CHECK(!exists(vm2.run_dir));
	CHECK(!lease_held(vm2.uid));
	CHECK(!exists(vm2.mem));
	/* b-v1's files go, but the memory file name is also the other node's VM's: kept */
	CHECK(!exists(bv1.run_dir));
	CHECK(!lease_held(bv1.uid));
	CHECK(exists(theirs.mem));
	/* the kept VM is untouched */
	CHECK(exists(keep1.run_dir));
	CHECK(lease_held(keep1.uid));
	CHECK(exists(keep1.mem));
	/* the other node's VM is untouched */
	CHECK(alive(theirs.pid));
	CHECK(exists(cg_dir(theirs.cg, "cpu")));
	CHECK(exists(theirs.run_dir));
	CHECK(lease_held(theirs.uid));
	/* a process that is not a VMM is left alone, with its group */
	CHECK(alive(impostor.pid));
	CHECK(exists(cg_dir(impostor.cg, "cpu")));
	CHECK(exists(impostor.run_dir));

	/* the impostor gone, a second run cleans that VM and leaves the rest */
	kill(impostor.pid, SIGKILL);
	for (int i = 0; i < 100 && alive(impostor.pid); i++)
		usleep(10 * 1000);
	kiln_error_clear(&err);
	asked = 0;
	CHECK_INT(vmm_orphans_cleanup(node, run_root, NULL, keep, &asked, &err), 1);
	CHECK_INT(err.code, KILN_OK);
	CHECK_INT(asked, 2);	/* keep1 and odd */
	CHECK(!exists(cg_dir(impostor.cg, "cpu")));
	CHECK(!exists(impostor.run_dir));
	CHECK(alive(theirs.pid));

	/* the other node's own restart cleans its VM */
	kiln_error_clear(&err);
	CHECK_INT(vmm_orphans_cleanup(other, run_root, NULL, NULL, NULL, &err), 1);
	CHECK(!alive(theirs.pid) || (usleep(200 * 1000), !alive(theirs.pid)));
	CHECK(!exists(theirs.mem));
	CHECK(!lease_held(theirs.uid));
	CHECK(exists(keep1.run_dir));

	/* leftovers of the test itself */
	kiln_error_clear(&err);
	CHECK_INT(vmm_orphans_cleanup(node, run_root, NULL, NULL, NULL, &err), 1);	/* keep1 */
	CHECK(!exists(keep1.mem));
	cg_free(vm1.cg);
	cg_free(theirs.cg);
	cg_free(impostor.cg);
	for (const char *n2 = node;; n2 = other) {
		static const char *const ctls[] = { "cpu", "cpuacct", "memory", "pids" };

		for (size_t c = 0; c < 4; c++) {
			pathf(cg_path, sizeof(cg_path), "/sys/fs/cgroup/%s/kiln/%s", ctls[c], n2);
			rmdir(cg_path);
		}
		pathf(cg_path, sizeof(cg_path), "/sys/fs/cgroup/kiln/%s", n2);
		rmdir(cg_path);
		if (n2 == other)
			break;
	}
}

static bool keep_relabelled(void *ctx, const char *id)
{
	return strcmp(id, "sb_relabelled") == 0;
}

/*
 * A lease relabelled (a VM started under one name, taken over under another: node/warm.c) names
 * its new owner whole, leaves no file of its own beside it, and is the new owner's to clean up.
 */
static void test_a_relabelled_lease_names_its_new_owner(void)
{
	char owner[128], path[PATH_MAX], got[128] = "";
	struct kiln_error err = { 0 };
	uid_t uid, unleased;
	FILE *f;
	int n;

	CHECK(vmm_lease_owner(node, "0warmvmabcdef", owner, sizeof(owner)) == 0);
	CHECK(jail_uid_alloc(lease_dir, JAIL_UID_MIN, JAIL_UID_MAX, owner, &uid) == 0);
	CHECK(vmm_lease_owner(node, "sb_relabelled", owner, sizeof(owner)) == 0);
	CHECK_INT(jail_uid_relabel(lease_dir, uid, owner), 0);
	pathf(path, sizeof(path), "%s/%u", lease_dir, (unsigned)uid);
	f = fopen(path, "r");
	CHECK(f != NULL);
	if (f) {
		CHECK(fgets(got, sizeof(got), f) != NULL);
		fclose(f);
	}
	CHECK_STR(got, owner);
	pathf(path, sizeof(path), "%s/.%u.relabel", lease_dir, (unsigned)uid);
	CHECK(!exists(path));
	/* a uid not leased stays so */
	CHECK(jail_uid_alloc(lease_dir, JAIL_UID_MIN, JAIL_UID_MAX, "probe", &unleased) == 0);
	CHECK(jail_uid_release(lease_dir, unleased) == 0);
	CHECK_INT(jail_uid_relabel(lease_dir, unleased, owner), -ENOENT);
	CHECK(!lease_held(unleased));
	/* the node's cleanup knows it by the new owner's id only: kept with it, released with it */
	n = vmm_orphans_cleanup(node, run_root, NULL, keep_relabelled, NULL, &err);
	CHECK(lease_held(uid));
	n = vmm_orphans_cleanup(node, run_root, NULL, NULL, NULL, &err);
	CHECK(n >= 1);
	CHECK(!lease_held(uid));
}

static void test_cleanup_refuses_bad_node_id(void)
{
	struct kiln_error err = { 0 };

	CHECK_INT(vmm_orphans_cleanup("../etc", run_root, NULL, NULL, NULL, &err), -1);
	CHECK_INT(err.code, KILN_E_INVALID);
	kiln_error_clear(&err);
	CHECK_INT(vmm_orphans_cleanup("uids", run_root, NULL, NULL, NULL, &err), -1);
}

int main(void)
{
	char cmd[PATH_MAX + 16];
	int rc;

	if (geteuid() != 0) {
		fprintf(stderr, "test_orphan: needs root (cgroups, bind mounts)\n");
		return 1;
	}
	if (cg_detect(NULL) < 0) {
		fprintf(stderr, "test_orphan: no usable cgroup hierarchy under /sys/fs/cgroup\n");
		return 1;
	}
	pathf(node, sizeof(node), "orph%d", (int)getpid());
	pathf(other, sizeof(other), "%s-b", node);
	pathf(run_root, sizeof(run_root), "/tmp/kiln-orphan-XXXXXX");
	if (!mkdtemp(run_root)) {
		perror("mkdtemp");
		return 1;
	}
	pathf(lease_dir, sizeof(lease_dir), "%s/uids", run_root);
	TEST(test_cleanup_removes_own_leftovers_only);
	TEST(test_cleanup_refuses_bad_node_id);
	TEST(test_a_relabelled_lease_names_its_new_owner);
	rc = test_summary();
	pathf(cmd, sizeof(cmd), "rm -rf '%s'", run_root);
	if (system(cmd) != 0)
		fprintf(stderr, "cannot remove %s\n", run_root);
	return rc;
}
