/*
 * test_console.c - the guest console's drain (hv_console_start): a writer that never stops is
 * drained without blocking, the files on disk never pass the cap, the newest output is kept, and
 * hv_console_finish leaves nothing of the ended stream unwritten; a reader never finds the
 * current file missing while it rotates.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "test.h"
#include "vmm/hv.h"

#define CAP (64ull << 10)

static long long file_size(const char *path)
{
	struct stat st;

	return stat(path, &st) == 0 ? (long long)st.st_size : -1;
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct watcher {
	const char *path;
	volatile int stop;
	long long looks, missing;
};

/* Stats the console's current file without pause until told to stop. */
static void *watch_file(void *arg)
{
	struct watcher *w = arg;

	while (!__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) {
		w->looks++;
		if (file_size(w->path) < 0)
			w->missing++;
	}
	return NULL;
}

/*
 * 20 MiB through a console capped at 64 KiB: never more than 64 KiB on disk, the newest kept, and
 * the current file is there at every look of a reader during the 600-odd rotations.
 */
static void test_console_flood_stays_capped(void)
{
	char dir[] = "/tmp/kiln-test-console-XXXXXX", path[256], old[256], tail[64], got[64];
	struct hv_console *c = NULL;
	char *chunk = malloc(65536);
	long long t0, max_seen = 0;
	struct watcher look = { .path = path };
	pthread_t watcher;
	int sv[2], fd;

	CHECK(chunk != NULL);
	CHECK(mkdtemp(dir) != NULL);
	snprintf(path, sizeof(path), "%s/serial.log", dir);
	snprintf(old, sizeof(old), "%s/serial.log.old", dir);
	CHECK_INT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	CHECK_INT(hv_console_start(sv[0], path, CAP, &c), 0);
	CHECK_INT(pthread_create(&watcher, NULL, watch_file, &look), 0);
	t0 = now_ms();
	for (int i = 0; chunk && i < 320; i++) {
		size_t off = 0;

		memset(chunk, 'a' + i % 26, 65536);
		/* the writer (a guest's ttyS0 through QEMU) is never held back for long */
		while (off < 65536) {
			ssize_t w = write(sv[1], chunk + off, 65536 - off);

			if (w < 0 && errno == EINTR)
				continue;
			CHECK(w > 0);
			if (w <= 0)
				break;
			off += (size_t)w;
		}
		if (file_size(path) + (file_size(old) > 0 ? file_size(old) : 0) > max_seen)
			max_seen = file_size(path) + (file_size(old) > 0 ? file_size(old) : 0);
	}
	snprintf(tail, sizeof(tail), "the end of the console\n");
	CHECK_INT(write(sv[1], tail, strlen(tail)), (long long)strlen(tail));
	close(sv[1]);	/* the VMM ends: the drain sees EOF */
	CHECK(now_ms() - t0 < 30000);
	/* finish: everything written before the EOF is in the file when it returns */
	hv_console_finish(c);
	c = NULL;
	__atomic_store_n(&look.stop, 1, __ATOMIC_RELEASE);
	pthread_join(watcher, NULL);
	fprintf(stderr, "  a reader looked %lld times, found the file missing %lld times\n", look.looks, look.missing);
	CHECK(look.looks > 0);
	CHECK_INT(look.missing, 0);
	fd = open(path, O_RDONLY);
	memset(got, 0, sizeof(got));
	CHECK(fd >= 0);
	if (fd >= 0) {
		long long sz = file_size(path);

		CHECK(sz >= (long long)strlen(tail));
		CHECK_INT(pread(fd, got, strlen(tail), sz - (long long)strlen(tail)), (long long)strlen(tail));
		close(fd);
	}
	CHECK_STR(got, tail);
	CHECK(file_size(path) <= (long long)(CAP / 2));
	CHECK(file_size(old) == (long long)(CAP / 2));
	CHECK(max_seen <= (long long)CAP);
	unlink(path);
	unlink(old);
	rmdir(dir);
	free(chunk);
}

/* A file left by an earlier VMM of the VM is continued, its size counted against the cap. */
static void test_console_continues_and_stops(void)
{
	char dir[] = "/tmp/kiln-test-console-XXXXXX", path[256], old[256], buf[4096];
	struct hv_console *c = NULL;
	int sv[2], fd;

	CHECK(mkdtemp(dir) != NULL);
	snprintf(path, sizeof(path), "%s/serial.log", dir);
	snprintf(old, sizeof(old), "%s/serial.log.old", dir);
	fd = open(path, O_WRONLY | O_CREAT, 0600);
	memset(buf, 'x', sizeof(buf));
	for (int i = 0; i < 8; i++)
		CHECK_INT(write(fd, buf, sizeof(buf)), (long long)sizeof(buf));
	close(fd);
	CHECK_INT(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	CHECK_INT(hv_console_start(sv[0], path, CAP, &c), 0);
	CHECK_INT(write(sv[1], "boot\n", 5), 5);
	for (int i = 0; i < 200 && file_size(old) < 0; i++)
		usleep(10000);
	/* 32 KiB were there: the new line starts a new file */
	CHECK(file_size(old) == (long long)(CAP / 2));
	CHECK(file_size(path) == 5);
	/* stopping while the VMM still runs (destroy): the thread ends and closes its end */
	hv_console_stop(c);
	CHECK_INT(read(sv[1], buf, 1), 0);
	close(sv[1]);
	CHECK_INT(hv_console_start(-1, "/nonexistent-dir/serial.log", CAP, &c), -ENOENT);
	CHECK(c == NULL);
	unlink(path);
	unlink(old);
	rmdir(dir);
}

int main(void)
{
	TEST(test_console_flood_stays_capped);
	TEST(test_console_continues_and_stops);
	return test_summary();
}
