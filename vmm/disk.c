/*
 * disk.c - qcow2 overlays, chain depth and flattening with qemu-img.
 */
#include "vmm/disk.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/proc.h"

#define DISK_INFO_MAX (256 * 1024)	/* bytes of qemu-img info output accepted */

int disk_run(char *const argv[], char *out, size_t outlen)
{
	int status, r = proc_run((const char *const *)argv, PROC_STDOUT | PROC_STDERR, out, outlen,
				 &status);

	if (r < 0)
		return r;
	return status == 0 ? 0 : -EIO;
}

void disk_layer_name(unsigned depth, char *out, size_t outlen)
{
	if (depth == 0)
		snprintf(out, outlen, "base");
	else
		snprintf(out, outlen, "layer%u", depth);
}

int disk_info(const char *image, uint64_t *virtual_size)
{
	char *argv[] = { "qemu-img", "info", "-U", "--output=json", (char *)image, NULL };
	char *out = malloc(DISK_INFO_MAX);
	json_t *info = NULL;
	int r;

	if (!out)
		return -ENOMEM;
	r = disk_run(argv, out, DISK_INFO_MAX);
	if (r < 0)
		goto done;
	info = json_loads(out, 0, NULL);
	if (!json_is_integer(json_object_get(info, "virtual-size"))) {
		r = -EPROTO;
		goto done;
	}
	*virtual_size = (uint64_t)json_integer_value(json_object_get(info, "virtual-size"));
done:
	json_decref(info);
	free(out);
	return r;
}

int disk_overlay_create(const char *backing_host, unsigned depth, const char *overlay,
			uint64_t size_bytes)
{
	char size[32], msg[512], name[16];
	uint64_t base_size;
	int r;

	r = disk_info(backing_host, &base_size);
	if (r < 0)
		return r;
	if (size_bytes == 0)
		size_bytes = base_size;
	if (size_bytes < base_size)
		return -EINVAL;
	snprintf(size, sizeof(size), "%llu", (unsigned long long)size_bytes);
	disk_layer_name(depth, name, sizeof(name));
	unlink(overlay);

	/* -u: the backing is named as the jail sees it, which need not resolve here */
	char *argv[] = { "qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", depth ? "qcow2" : "raw",
			 "-b", name, (char *)overlay, size, NULL };

	return disk_run(argv, msg, sizeof(msg));
}

int disk_flatten(const char *top, const char *const *chain, unsigned n, const char *tmp_dir)
{
	char link[PATH_MAX], top_link[PATH_MAX], flat[PATH_MAX], name[16], msg[512];
	int r = 0;

	if (n == 0 || n > 64)
		return -EINVAL;
	if (mkdir(tmp_dir, 0700) < 0 && errno != EEXIST)
		return -errno;
	for (unsigned k = 0; k < n && r == 0; k++) {
		disk_layer_name(k, name, sizeof(name));
		snprintf(link, sizeof(link), "%s/%s", tmp_dir, name);
		unlink(link);
		if (symlink(chain[k], link) < 0)
			r = -errno;
	}
	snprintf(top_link, sizeof(top_link), "%s/top", tmp_dir);
	snprintf(flat, sizeof(flat), "%s/flat", tmp_dir);
	unlink(top_link);
	(void)top_link;
	/*
	 * A copy of the top layer, rebased onto the base in safe mode: qemu-img copies into it every
	 * cluster that the layers in between changed. (`convert -B base` would copy only the top
	 * layer's own clusters and lose what the middle layers hold.) The copy names its backing
	 * file "layer1"... like the original, so the symlinks above resolve the old chain.
	 */
	if (r == 0)
		r = disk_file_copy(top, flat);
	if (r == 0) {
		char *argv[] = { "qemu-img", "rebase", "-q", "-f", "qcow2", "-b", "base", "-F", "raw",
				 flat, NULL };

		r = disk_run(argv, msg, sizeof(msg));
	}
	if (r == 0 && rename(flat, top) < 0)
		r = -errno;
	/* tidy up: the symlinks, a partial output, the directory */
	for (unsigned k = 0; k < n; k++) {
		disk_layer_name(k, name, sizeof(name));
		snprintf(link, sizeof(link), "%s/%s", tmp_dir, name);
		unlink(link);
	}
	unlink(top_link);
	unlink(flat);
	rmdir(tmp_dir);
	return r;
}

/* Copies up to `len` bytes at offset `off` from `in` to `out` with pread/pwrite; -1 + errno. */
static ssize_t copy_plain(int in, int out, off_t off, size_t len)
{
	static __thread char chunk[1 << 16];
	size_t want = len < sizeof(chunk) ? len : sizeof(chunk);
	ssize_t n = pread(in, chunk, want, off);

	for (ssize_t done = 0; n > 0 && done < n;) {
		ssize_t w = pwrite(out, chunk + done, (size_t)(n - done), off + done);

		if (w < 0)
			return -1;
		done += w;
	}
	return n;
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

			if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == EOPNOTSUPP)) {
				/* across file systems (tmpfs to disk): copy through a buffer */
				n = copy_plain(in, out, ioff, (size_t)(hole - ioff));
				if (n > 0) {
					ioff += n;
					ooff += n;
				}
			}
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
