/*
 * disk_info reads a virtual size as qemu-img does, from a qcow2 header or a raw file's length;
 * disk_overlay_create writes the second overlay of a depth and size from the first one's bytes
 * (no qemu-img on PATH then), and that layer is a valid qcow2 over the right backing that reads
 * and writes through the chain; disk_copy_start() has the whole-length file there when it returns and
 * disk_copy_wait() the same bytes and holes as a synchronous copy; disk_copy_prepare() leaves that
 * file empty until disk_copy_wait() copies into it (the same inode, so a map made before sees the
 * data), and disk_copy_drop() of a prepared copy copies nothing.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "vmm/disk.h"

static char dir[64];

/* Runs `cmd` with the shell in the test's directory; returns its exit status. */
static int sh(const char *cmd)
{
	char line[1024];

	snprintf(line, sizeof(line), "cd %s && %s", dir, cmd);
	return system(line);
}

static const char *at(const char *name)
{
	static char p[4][128];
	static unsigned k;

	snprintf(p[k % 4], sizeof(p[0]), "%s/%s", dir, name);
	return p[k++ % 4];
}

static void info_reads_qcow2_headers_and_raw_lengths(void)
{
	uint64_t v = 0;
	int fd;

	CHECK_INT(sh("qemu-img create -q -f raw base 8M && "
		     "qemu-img create -q -f qcow2 v3.qcow2 3G && "
		     "qemu-img create -q -f qcow2 -o compat=0.10 v2.qcow2 12345678848 && "
		     "qemu-img create -q -f qcow2 -F raw -b base over.qcow2 10G"), 0);
	CHECK_INT(disk_info(at("base"), &v), 0);
	CHECK(v == 8ull << 20);
	CHECK_INT(disk_info(at("v3.qcow2"), &v), 0);
	CHECK(v == 3ull << 30);
	CHECK_INT(disk_info(at("v2.qcow2"), &v), 0);
	CHECK(v == 12345678848ull);
	CHECK_INT(disk_info(at("over.qcow2"), &v), 0);
	CHECK(v == 10ull << 30);
	/* each as qemu-img itself reports it */
	CHECK_INT(sh("qemu-img info --output=json v2.qcow2 | grep -q '\"virtual-size\": 12345678848'"),
		  0);
	/* a qcow2 magic with a version qemu-img does not make; no file; a directory */
	fd = open(at("bad"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
	CHECK(fd >= 0);
	CHECK(write(fd, "QFI\xfb\0\0\0\x09", 8) == 8);
	close(fd);
	CHECK_INT(disk_info(at("bad"), &v), -EPROTO);
	CHECK_INT(disk_info(at("none"), &v), -ENOENT);
	CHECK_INT(disk_info(dir, &v), -EINVAL);
}

static void second_overlay_is_written_from_the_first(void)
{
	const char *path = getenv("PATH");
	char *saved = strdup(path ? path : "/usr/bin:/bin");
	uint64_t v = 0;

	/* the first of (depth 0, 2 GiB) and of (depth 1, its backing's size) by qemu-img */
	CHECK_INT(sh("qemu-img create -q -f qcow2 -F raw -b base layer1 1G"), 0);
	CHECK_INT(disk_overlay_create(at("base"), 0, at("a.qcow2"), 2ull << 30), 0);
	CHECK_INT(disk_overlay_create(at("layer1"), 1, at("l1a.qcow2"), 0), 0);
	/* the next ones with no qemu-img to run: kept bytes, an existing file replaced */
	CHECK_INT(sh("echo stale > b.qcow2"), 0);
	setenv("PATH", "/nonexistent-kiln-test", 1);
	CHECK_INT(disk_overlay_create(at("base"), 0, at("b.qcow2"), 2ull << 30), 0);
	CHECK_INT(disk_overlay_create(at("layer1"), 1, at("l1b.qcow2"), 0), 0);
	/* a size not made yet needs qemu-img; one below the backing's is refused before */
	CHECK(disk_overlay_create(at("base"), 0, at("c.qcow2"), 3ull << 30) < 0);
	CHECK_INT(disk_overlay_create(at("layer1"), 1, at("d.qcow2"), 1ull << 20), -EINVAL);
	setenv("PATH", saved, 1);
	free(saved);

	CHECK_INT(sh("cmp -s a.qcow2 b.qcow2 && cmp -s l1a.qcow2 l1b.qcow2"), 0);
	CHECK_INT(disk_info(at("b.qcow2"), &v), 0);
	CHECK(v == 2ull << 30);
	CHECK_INT(disk_info(at("l1b.qcow2"), &v), 0);
	CHECK(v == 1ull << 30);
	/* valid layers over the jail names, their backing's format recorded */
	CHECK_INT(sh("qemu-img check -q b.qcow2 && qemu-img check -q l1b.qcow2"), 0);
	CHECK_INT(sh("qemu-img info --output=json b.qcow2 | grep -q '\"backing-filename\": \"base\"' && "
		     "qemu-img info --output=json b.qcow2 | "
		     "grep -q '\"backing-filename-format\": \"raw\"' && "
		     "qemu-img info --output=json l1b.qcow2 | "
		     "grep -q '\"backing-filename\": \"layer1\"' && "
		     "qemu-img info --output=json l1b.qcow2 | "
		     "grep -q '\"backing-filename-format\": \"qcow2\"'"), 0);
	/* reads through to the base, writes stay in the layer */
	CHECK_INT(sh("qemu-io -f raw -c 'write -P 0x5a 0 64k' base >/dev/null && "
		     "qemu-io -c 'read -P 0x5a 0 64k' b.qcow2 | grep -q 'read 65536' && "
		     "qemu-io -c 'write -P 0x33 1M 64k' b.qcow2 >/dev/null && "
		     "qemu-io -c 'read -P 0x33 1M 64k' b.qcow2 | grep -q 'read 65536' && "
		     "qemu-io -f raw -c 'read -P 0 1M 64k' base | grep -q 'read 65536' && "
		     "qemu-img check -q b.qcow2"), 0);
}

static void copy_on_a_thread_keeps_data_and_holes(void)
{
	struct disk_copy c;
	struct stat st;

	/* 64 MiB with three data extents, one across a 1 MiB boundary */
	CHECK_INT(sh("truncate -s 64M src && "
		     "dd if=/dev/urandom of=src bs=64k count=3 conv=notrunc status=none && "
		     "dd if=/dev/urandom of=src bs=4k seek=255 count=2 conv=notrunc status=none && "
		     "dd if=/dev/urandom of=src bs=1M seek=63 count=1 conv=notrunc status=none && "
		     "echo old > dst"), 0);
	CHECK_INT(disk_copy_start(&c, at("src"), at("dst")), 0);
	CHECK(stat(at("dst"), &st) == 0 && st.st_size == 64 << 20);
	CHECK_INT(disk_copy_wait(&c), 0);
	CHECK_INT(sh("cmp -s src dst"), 0);
	CHECK(stat(at("dst"), &st) == 0 && st.st_blocks * 512 < 8 << 20);
	/* the same as disk_file_copy's */
	CHECK_INT(disk_file_copy(at("src"), at("dst2")), 0);
	CHECK_INT(sh("cmp -s dst dst2"), 0);
	/* no source: nothing made, nothing to wait for */
	CHECK_INT(disk_copy_start(&c, at("none"), at("dst3")), -ENOENT);
	CHECK(access(at("dst3"), F_OK) != 0);
	CHECK_INT(disk_copy_wait(&c), -EINVAL);
}

static void copy_prepared_runs_at_the_wait_into_the_same_file(void)
{
	struct disk_copy c;
	struct stat before, st;
	char probe[64], want[64];
	int fd, src;

	CHECK_INT(sh("truncate -s 16M psrc && "
		     "dd if=/dev/urandom of=psrc bs=64k count=3 conv=notrunc status=none && "
		     "dd if=/dev/urandom of=psrc bs=1M seek=15 count=1 conv=notrunc status=none"), 0);
	CHECK_INT(disk_copy_prepare(&c, at("psrc"), at("pdst")), 0);
	/* the whole length and no data yet; opened now, as a VMM maps it before the copy */
	CHECK(stat(at("pdst"), &before) == 0 && before.st_size == 16 << 20 && before.st_blocks == 0);
	fd = open(at("pdst"), O_RDONLY);
	CHECK(fd >= 0);
	CHECK(sh("cmp -s psrc pdst") != 0);
	CHECK_INT(disk_copy_wait(&c), 0);
	CHECK_INT(sh("cmp -s psrc pdst"), 0);
	CHECK(stat(at("pdst"), &st) == 0 && st.st_ino == before.st_ino && st.st_blocks * 512 < 4 << 20);
	/* what the descriptor opened before the copy reads is the data */
	src = open(at("psrc"), O_RDONLY);
	CHECK(fd >= 0 && pread(fd, probe, sizeof(probe), 15 << 20) == (ssize_t)sizeof(probe));
	CHECK(src >= 0 && pread(src, want, sizeof(want), 15 << 20) == (ssize_t)sizeof(want));
	CHECK(memcmp(probe, want, sizeof(probe)) == 0);
	if (fd >= 0)
		close(fd);
	if (src >= 0)
		close(src);
	/* dropped before its wait: nothing copied, nothing left to wait for */
	CHECK_INT(disk_copy_prepare(&c, at("psrc"), at("pdst2")), 0);
	disk_copy_drop(&c);
	CHECK(stat(at("pdst2"), &st) == 0 && st.st_size == 16 << 20 && st.st_blocks == 0);
	CHECK_INT(disk_copy_wait(&c), -EINVAL);
	/* a started copy dropped is joined, not left running */
	CHECK_INT(disk_copy_start(&c, at("psrc"), at("pdst3")), 0);
	disk_copy_drop(&c);
	CHECK_INT(disk_copy_wait(&c), -EINVAL);
}

int main(void)
{
	char cmd[128];
	int rc;

	snprintf(dir, sizeof(dir), "/tmp/kiln-images-XXXXXX");
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return 1;
	}
	TEST(info_reads_qcow2_headers_and_raw_lengths);
	TEST(second_overlay_is_written_from_the_first);
	TEST(copy_on_a_thread_keeps_data_and_holes);
	TEST(copy_prepared_runs_at_the_wait_into_the_same_file);
	rc = test_summary();
	snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
	if (system(cmd) != 0)
		rc = 1;
	return rc;
}
