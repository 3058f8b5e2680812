/*
 * disk.c - qcow2 overlays, chain depth and flattening with qemu-img.
 */
#include "vmm/disk.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <poll.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define DISK_INFO_MAX (256 * 1024)	/* bytes of qemu-img info output accepted */

int disk_run(char *const argv[], char *out, size_t outlen)
{
	posix_spawn_file_actions_t fa;
	int pipefd[2], status, r;
	size_t len = 0;
	pid_t pid;

	if (pipe2(pipefd, O_CLOEXEC) < 0)
		return -errno;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, pipefd[1], 1);
	posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
	r = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
	posix_spawn_file_actions_destroy(&fa);
	close(pipefd[1]);
	if (r != 0) {
		close(pipefd[0]);
		return -r;
	}
	for (;;) {
		char chunk[4096];
		ssize_t n = read(pipefd[0], chunk, sizeof(chunk));

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		if (out && len + 1 < outlen) {
			size_t take = (size_t)n < outlen - 1 - len ? (size_t)n : outlen - 1 - len;

			memcpy(out + len, chunk, take);
			len += take;
		}
	}
	if (out && outlen)
		out[len] = '\0';
	close(pipefd[0]);
	while (waitpid(pid, &status, 0) < 0) {
		if (errno != EINTR)
			return -errno;
	}
	return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -EIO;
}

int disk_info(const char *image, uint64_t *virtual_size, unsigned *depth)
{
	char *argv[] = { "qemu-img", "info", "-U", "--backing-chain", "--output=json", (char *)image, NULL };
	char *out = malloc(DISK_INFO_MAX);
	json_t *chain = NULL, *top;
	unsigned d = 0;
	int r;

	if (!out)
		return -ENOMEM;
	r = disk_run(argv, out, DISK_INFO_MAX);
	if (r < 0)
		goto done;
	chain = json_loads(out, 0, NULL);
	/* a chain is a JSON array, top image first */
	top = json_is_array(chain) ? json_array_get(chain, 0) : NULL;
	if (!json_is_object(top)) {
		r = -EPROTO;
		goto done;
	}
	for (size_t i = 0; i < json_array_size(chain); i++) {
		const char *fmt = json_string_value(json_object_get(json_array_get(chain, i), "format"));

		if (fmt && strcmp(fmt, "qcow2") == 0)
			d++;
	}
	if (virtual_size)
		*virtual_size = (uint64_t)json_integer_value(json_object_get(top, "virtual-size"));
	if (depth)
		*depth = d;
done:
	json_decref(chain);
	free(out);
	return r;
}

int disk_overlay_create(const char *backing, const char *backing_fmt, const char *overlay,
			uint64_t size_bytes)
{
	char size[32], msg[512];
	uint64_t base_size;
	int r;

	r = disk_info(backing, &base_size, NULL);
	if (r < 0)
		return r;
	if (size_bytes == 0)
		size_bytes = base_size;
	if (size_bytes < base_size)
		return -EINVAL;
	snprintf(size, sizeof(size), "%llu", (unsigned long long)size_bytes);
	unlink(overlay);

	char *argv[] = { "qemu-img", "create", "-q", "-f", "qcow2", "-F", (char *)backing_fmt,
			 "-b", (char *)backing, (char *)overlay, size, NULL };

	return disk_run(argv, msg, sizeof(msg));
}

int disk_flatten(const char *image, const char *base)
{
	char tmp[PATH_MAX], msg[512];
	int r;

	if (snprintf(tmp, sizeof(tmp), "%s.flat", image) >= (int)sizeof(tmp))
		return -ENAMETOOLONG;

	char *argv[] = { "qemu-img", "convert", "-q", "-f", "qcow2", "-O", "qcow2", "-B", (char *)base,
			 "-o", "backing_fmt=raw", (char *)image, tmp, NULL };

	r = disk_run(argv, msg, sizeof(msg));
	if (r == 0 && rename(tmp, image) < 0)
		r = -errno;
	if (r < 0)
		unlink(tmp);
	return r;
}

int disk_file_copy(const char *src, const char *dst)
{
	int in = -1, out = -1, r = 0;
	struct stat st;
	off_t pos = 0;

	in = open(src, O_RDONLY | O_CLOEXEC);
	if (in < 0)
		return -errno;
	if (fstat(in, &st) < 0) {
		r = -errno;
		goto done;
	}
	unlink(dst);
	out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (out < 0 || ftruncate(out, st.st_size) < 0) {
		r = -errno;
		goto done;
	}
	while (pos < st.st_size) {
		off_t data = lseek(in, pos, SEEK_DATA), hole;

		if (data < 0) {
			if (errno == ENXIO)
				break;	/* only a hole is left */
			r = -errno;
			goto done;
		}
		hole = lseek(in, data, SEEK_HOLE);
		if (hole < 0) {
			r = -errno;
			goto done;
		}
		off_t ioff = data, ooff = data;

		while (ioff < hole) {
			ssize_t n = copy_file_range(in, &ioff, out, &ooff, (size_t)(hole - ioff), 0);

			if (n < 0) {
				if (errno == EINTR)
					continue;
				r = -errno;
				goto done;
			}
			if (n == 0)
				break;
		}
		pos = hole;
	}
	if (fsync(out) < 0)
		r = -errno;
done:
	if (in >= 0)
		close(in);
	if (out >= 0)
		close(out);
	if (r < 0 && out >= 0)
		unlink(dst);
	return r;
}

int disk_file_move(const char *src, const char *dst)
{
	int r;

	if (rename(src, dst) == 0)
		return 0;
	if (errno != EXDEV)
		return -errno;
	r = disk_file_copy(src, dst);
	if (r == 0 && unlink(src) < 0)
		r = -errno;
	return r;
}
