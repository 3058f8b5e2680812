/*
 * grow.c - GROW_ROOT: the root file system grown online to fill its disk.
 *
 * The host makes the guest's disk as large as the sandbox's disk_gib (a new layer of that size,
 * QMP block_resize after a restore) and then asks the agent to grow the mounted root file system
 * into it. The agent waits until the kernel shows the root's block device at least as large as the
 * host says (a resize reaches the guest as a virtio config change, handled asynchronously), then
 * grows ext4 with EXT4_IOC_RESIZE_FS on "/" itself: no resize2fs in the image, nothing unmounted.
 * A file system that already fills its device is left as it is (the kernel returns at once).
 * OK carries the file system's size as df shows it (blocks less its own metadata), in bytes.
 *
 * It works on any ext4 layout the image is made with (1 KiB or 4 KiB blocks, any inode ratio):
 * new groups take the layout of the existing ones. The request is served synchronously: while it
 * runs (at most the wait plus the resize itself) the agent answers nothing else, which is fine at
 * the only moment the host sends it, before the sandbox is handed out.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

#ifndef EXT4_IOC_RESIZE_FS
#define EXT4_IOC_RESIZE_FS _IOW('f', 16, uint64_t)	/* linux/fs/ext4/ext4.h */
#endif
#define EXT4_MAGIC 0xEF53
#define GROW_POLL_MS 20

/* Bytes of block device `dev` as the kernel sees it now (sysfs), or a negative errno. */
static long long dev_bytes(dev_t dev)
{
	char path[64], buf[32];
	ssize_t n;
	int fd;

	snprintf(path, sizeof(path), "/sys/dev/block/%u:%u/size", major(dev), minor(dev));
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -EIO;
	buf[n] = '\0';
	return strtoll(buf, NULL, 10) * 512;	/* sysfs counts 512-byte sectors */
}

void grow_root(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct statfs sf;
	struct stat st;
	uint64_t min_bytes, blocks, done;
	uint32_t wait_ms;
	long long have = 0;
	int fd;

	agent_rd_init(&r, p, len);
	min_bytes = agent_rd_u64(&r);
	wait_ms = agent_rd_u32(&r);
	if (!agent_rd_done(&r) || wait_ms > AGENT_MAX_GROW_WAIT_MS) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed grow request");
		return;
	}
	if (stat("/", &st) < 0 || statfs("/", &sf) < 0) {
		session_error(s, id, AGENT_S_IO, errno, "cannot stat the root: %s", strerror(errno));
		return;
	}
	if (sf.f_type != EXT4_MAGIC || sf.f_bsize <= 0) {
		session_error(s, id, AGENT_S_INVALID, 0, "the root file system is not ext4");
		return;
	}
	/* the host's resize reaches the guest as an interrupt: wait until the kernel shows it */
	for (uint64_t until = now_ms() + wait_ms;;) {
		have = dev_bytes(st.st_dev);
		if (have < 0 || (uint64_t)have >= min_bytes || now_ms() >= until)
			break;
		struct timespec ts = { 0, GROW_POLL_MS * 1000000L };
		nanosleep(&ts, NULL);
	}
	if (have < 0) {
		session_error(s, id, AGENT_S_IO, (int)-have, "cannot read the root disk's size: %s",
			      strerror((int)-have));
		return;
	}
	if ((uint64_t)have < min_bytes) {
		session_error(s, id, AGENT_S_IO, 0,
			      "the root disk shows %lld bytes after %u ms, not the %llu the host made",
			      have, wait_ms, (unsigned long long)min_bytes);
		return;
	}
	blocks = (uint64_t)have / (uint64_t)sf.f_bsize;
	fd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0 || ioctl(fd, EXT4_IOC_RESIZE_FS, &blocks) < 0) {
		int e = errno;

		if (fd >= 0)
			close(fd);
		session_error(s, id, e == ENOSPC ? AGENT_S_TOO_LARGE : AGENT_S_IO, e,
			      "cannot grow the root file system to %llu blocks of %ld bytes: %s",
			      (unsigned long long)blocks, (long)sf.f_bsize, strerror(e));
		return;
	}
	close(fd);
	/* what df shows now: the file system's blocks less its own metadata */
	done = statfs("/", &sf) == 0 ? (uint64_t)sf.f_blocks * (uint64_t)sf.f_bsize : 0;
	{
		uint8_t buf[8];
		struct agent_wr w;

		agent_wr_init(&w, buf, sizeof(buf));
		agent_wr_u64(&w, done);
		session_send(s, AGENT_T_OK, 0, id, buf, w.len);
	}
}
