/*
 * Unit tests of the file helpers (common/fsutil.h): tree removal (no links followed, no other file
 * systems entered), fsync of files and directories, bounded reads of small files. Run as root
 * (CI and the developers' machines are): the mount case needs a mount namespace of its own.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "test.h"

static char root[PATH_MAX];

static void put(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	CHECK(f != NULL);
	if (!f)
		return;
	fputs(text, f);
	fclose(f);
}

static char *at(const char *name)
{
	static char bufs[8][PATH_MAX];
	static int next;
	char *p = bufs[next++ % 8];

	CHECK(fs_path(p, "%s/%s", root, name));
	return p;
}

static bool exists(const char *path)
{
	struct stat st;

	return lstat(path, &st) == 0;
}

static void test_remove_tree_keeps_link_targets(void)
{
	CHECK_INT(fs_mkdir_p(at("t/a/b/c"), 0755), 0);
	put(at("t/a/b/c/f"), "x");
	put(at("t/a/g"), "y");
	CHECK_INT(mkfifo(at("t/a/fifo"), 0600), 0);
	CHECK_INT(fs_mkdir_p(at("outside"), 0755), 0);
	put(at("outside/keep"), "k");
	CHECK_INT(symlink(at("outside"), at("t/dirlink")), 0);
	CHECK_INT(symlink(at("outside/keep"), at("t/a/filelink")), 0);
	CHECK_INT(symlink(at("nowhere"), at("t/dangling")), 0);

	CHECK_INT(fs_remove_tree(at("t")), 0);
	CHECK(!exists(at("t")));
	CHECK(exists(at("outside/keep")));
	/* a symbolic link given as the path is removed, not its target */
	CHECK_INT(symlink(at("outside"), at("l")), 0);
	CHECK_INT(fs_remove_tree(at("l")), 0);
	CHECK(!exists(at("l")));
	CHECK(exists(at("outside/keep")));
	/* a plain file; a missing path */
	put(at("plain"), "p");
	CHECK_INT(fs_remove_tree(at("plain")), 0);
	CHECK(!exists(at("plain")));
	CHECK_INT(fs_remove_tree(at("plain")), 0);
	/* a path through a file */
	CHECK_INT(fs_remove_tree(at("outside/keep/x")), -ENOTDIR);
	CHECK(exists(at("outside/keep")));
	CHECK_INT(fs_remove_tree(at("outside")), 0);
	CHECK(!exists(at("outside")));
}

/* A file system mounted below the tree is not entered: its files stay and the walk reports why. */
static void test_remove_tree_stays_on_its_file_system(void)
{
	int r;

	CHECK_INT(geteuid(), 0);
	CHECK_INT(unshare(CLONE_NEWNS), 0);
	CHECK_INT(mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL), 0);
	CHECK_INT(fs_mkdir_p(at("m/mnt"), 0755), 0);
	put(at("m/before"), "b");
	CHECK_INT(mount("tmpfs", at("m/mnt"), "tmpfs", 0, "size=1m"), 0);
	put(at("m/mnt/inner"), "i");

	r = fs_remove_tree(at("m"));
	CHECK(r == -EBUSY || r == -ENOTEMPTY);
	CHECK(exists(at("m/mnt/inner")));
	CHECK(!exists(at("m/before")));

	CHECK_INT(umount2(at("m/mnt"), MNT_DETACH), 0);
	CHECK_INT(fs_remove_tree(at("m")), 0);
	CHECK(!exists(at("m")));
}

static void test_fsync(void)
{
	put(at("s"), "data");
	CHECK_INT(fs_fsync_path(at("s")), 0);
	CHECK_INT(fs_fsync_path(root), 0);
	CHECK_INT(fs_fsync_path(at("missing")), -ENOENT);
	CHECK_INT(fs_fsync_dir(root), 0);
	CHECK_INT(fs_fsync_dir(at("s")), -ENOTDIR);
	CHECK_INT(fs_fsync_dir(at("missing")), -ENOENT);
	unlink(at("s"));
}

static void test_read_small_is_bounded(void)
{
	char buf[64], *big = malloc(100000), *out = malloc(65536);
	int fd;

	put(at("r"), "hello\n");
	memset(buf, 'Z', sizeof(buf));
	CHECK_INT(fs_read_small(at("r"), buf, sizeof(buf)), 6);
	CHECK_STR(buf, "hello\n");
	memset(buf, 'Z', sizeof(buf));
	CHECK_INT(fs_read_small(at("r"), buf, 4), 3);
	CHECK_STR(buf, "hel");
	CHECK_INT(buf[4], 'Z');
	CHECK_INT(fs_read_small(at("r"), buf, 1), 0);
	CHECK_STR(buf, "");
	CHECK_INT(fs_read_small(at("r"), buf, 0), -EINVAL);
	CHECK_INT(fs_read_small(at("missing"), buf, sizeof(buf)), -ENOENT);
	CHECK_INT(symlink(at("r"), at("rl")), 0);
	CHECK_INT(fs_read_small(at("rl"), buf, sizeof(buf)), -ELOOP);
	CHECK_INT(fs_read_small(root, buf, sizeof(buf)), -EISDIR);

	/* more than one read(2): a file longer than the buffer, cut at cap - 1 */
	CHECK(big && out);
	if (big && out) {
		for (int i = 0; i < 100000; i++)
			big[i] = (char)('a' + i % 26);
		fd = open(at("big"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
		CHECK(fd >= 0);
		CHECK_INT(write(fd, big, 100000), 100000);
		close(fd);
		CHECK_INT(fs_read_small(at("big"), out, 65536), 65535);
		CHECK(memcmp(out, big, 65535) == 0);
		CHECK_INT(out[65535], '\0');
	}
	free(big);
	free(out);
	unlink(at("r"));
	unlink(at("rl"));
	unlink(at("big"));
}

int main(void)
{
	const char *base = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
	int rc;

	if (!fs_path(root, "%s/kiln-fsutil-XXXXXX", base) || !mkdtemp(root)) {
		perror("mkdtemp");
		return 1;
	}
	TEST(test_remove_tree_keeps_link_targets);
	TEST(test_remove_tree_stays_on_its_file_system);
	TEST(test_fsync);
	TEST(test_read_small_is_bounded);
	rc = test_summary();
	CHECK_INT(fs_remove_tree(root), 0);
	return test_case_failed ? 1 : rc;
}
