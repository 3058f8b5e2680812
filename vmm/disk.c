/*
 * disk.c - qcow2 overlays, chain depth and flattening with qemu-img.
 */
#include "vmm/disk.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fsutil.h"
#include "common/proc.h"

#define DISK_QCOW2_MAGIC 0x514649fbu	/* "QFI\xfb" */

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

/* Big-endian fields of a qcow2 header. */
static uint32_t be32(const unsigned char *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static uint64_t be64(const unsigned char *p)
{
	return (uint64_t)be32(p) << 32 | be32(p + 4);
}

/*
 * Read here rather than with `qemu-img info` (a process of some 20 ms on every restore): a qcow2
 * image (its magic "QFI\xfb", version 2 or 3) has its virtual size in its header (bytes 24-31, big
 * endian); any other file is a raw image of its own length, as qemu-img reports them.
 */
int disk_info(const char *image, uint64_t *virtual_size)
{
	unsigned char h[32];
	struct stat st;
	ssize_t n;
	int fd = open(image, O_RDONLY | O_CLOEXEC), r = 0;

	if (fd < 0)
		return -errno;
	if (fstat(fd, &st) < 0) {
		r = -errno;
		goto done;
	}
	if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
		r = -EINVAL;
		goto done;
	}
	n = pread(fd, h, sizeof(h), 0);
	if (n < 0) {
		r = -errno;
		goto done;
	}
	if (n >= 4 && be32(h) == DISK_QCOW2_MAGIC) {
		uint32_t version = n == (ssize_t)sizeof(h) ? be32(h + 4) : 0;

		if (version != 2 && version != 3) {
			r = -EPROTO;
			goto done;
		}
		*virtual_size = be64(h + 24);
	} else if (S_ISBLK(st.st_mode)) {
		r = -EINVAL;	/* a raw device's size is not its inode's */
	} else {
		*virtual_size = (uint64_t)st.st_size;
	}
done:
	close(fd);
	return r;
}

/*
 * Empty overlays as qemu-img made them, by the depth they stand on (their backing's jail name and
 * format) and their virtual size. An empty qcow2 layer holds neither a path nor a time, so the next
 * one of the same key is the same bytes: written here, a create or restore runs no qemu-img (two
 * processes of some 20 ms each before). A small ring: a node makes few shapes.
 */
#define OVL_SLOTS 16
#define OVL_BYTES_MAX (4u << 20)	/* an empty layer of 64 KiB clusters is a few clusters */
#define OVL_BLOCK 4096

static struct ovl {
	unsigned depth;
	uint64_t size;
	unsigned char *data;	/* NULL: free */
	size_t len;
} ovl_slots[OVL_SLOTS];
static unsigned ovl_next;
static pthread_mutex_t ovl_lock = PTHREAD_MUTEX_INITIALIZER;

/* Writes the kept overlay of (depth, size) to `path` (holes where it has zero blocks); 1 when
 * written, 0 when none is kept, or a negative errno. */
static int ovl_write(unsigned depth, uint64_t size, const char *path)
{
	int r = 0, fd = -1;

	pthread_mutex_lock(&ovl_lock);
	for (unsigned k = 0; k < OVL_SLOTS && r == 0; k++) {
		const struct ovl *o = &ovl_slots[k];

		if (!o->data || o->depth != depth || o->size != size)
			continue;
		unlink(path);
		fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
		if (fd < 0 || ftruncate(fd, (off_t)o->len) < 0) {
			r = -errno;
			break;
		}
		for (size_t off = 0; off < o->len && r == 0; off += OVL_BLOCK) {
			size_t len = o->len - off < OVL_BLOCK ? o->len - off : OVL_BLOCK;
			bool zero = true;

			for (size_t i = 0; i < len && zero; i++)
				zero = o->data[off + i] == 0;
			if (!zero && pwrite(fd, o->data + off, len, (off_t)off) != (ssize_t)len)
				r = errno ? -errno : -EIO;
		}
		if (r == 0)
			r = 1;
	}
	pthread_mutex_unlock(&ovl_lock);
	if (fd >= 0 && close(fd) < 0 && r >= 0)
		r = -errno;
	if (r < 0)
		unlink(path);
	return r;
}

/* Keeps the overlay qemu-img just wrote at `path` for (depth, size); nothing when unreadable. */
static void ovl_keep(unsigned depth, uint64_t size, const char *path)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	unsigned char *data = NULL;
	struct stat st;

	if (fd < 0)
		return;
	if (fstat(fd, &st) == 0 && st.st_size > 0 && (uint64_t)st.st_size <= OVL_BYTES_MAX &&
	    (data = malloc((size_t)st.st_size)) != NULL &&
	    pread(fd, data, (size_t)st.st_size, 0) == st.st_size) {
		pthread_mutex_lock(&ovl_lock);
		struct ovl *o = &ovl_slots[ovl_next++ % OVL_SLOTS];

		free(o->data);
		*o = (struct ovl){ .depth = depth, .size = size, .data = data,
				   .len = (size_t)st.st_size };
		data = NULL;
		pthread_mutex_unlock(&ovl_lock);
	}
	free(data);
	close(fd);
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
	if ((r = ovl_write(depth, size_bytes, overlay)) != 0)
		return r < 0 ? r : 0;
	snprintf(size, sizeof(size), "%llu", (unsigned long long)size_bytes);
	disk_layer_name(depth, name, sizeof(name));
	unlink(overlay);

	/* -u: the backing is named as the jail sees it, which need not resolve here */
	char *argv[] = { "qemu-img", "create", "-q", "-u", "-f", "qcow2", "-F", depth ? "qcow2" : "raw",
			 "-b", name, (char *)overlay, size, NULL };

	r = disk_run(argv, msg, sizeof(msg));
	if (r == 0)
		ovl_keep(depth, size_bytes, overlay);
	return r;
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

/* Opens `src` and creates `dst` (0600, replacing one there) of its length; -errno. */
static int copy_open(const char *src, const char *dst, int *in, int *out, off_t *size)
{
	struct stat st;

	*out = -1;
	*in = open(src, O_RDONLY | O_CLOEXEC);
	if (*in < 0)
		return -errno;
	if (fstat(*in, &st) < 0)
		goto fail;
	unlink(dst);
	*out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (*out < 0 || ftruncate(*out, st.st_size) < 0)
		goto fail;
	*size = st.st_size;
	return 0;
fail:;
	int r = -errno;

	close(*in);
	if (*out >= 0) {
		close(*out);
		unlink(dst);
	}
	*in = *out = -1;
	return r;
}

/* Copies the data extents of `in` (of `size` bytes) to the same offsets of `out`, then fsync()s
 * it; -errno. */
static int copy_extents(int in, int out, off_t size)
{
	off_t pos = 0;

	while (pos < size) {
		off_t data = lseek(in, pos, SEEK_DATA), hole;

		if (data < 0)
			return errno == ENXIO ? 0 : -errno;	/* ENXIO: only a hole is left */
		hole = lseek(in, data, SEEK_HOLE);
		if (hole < 0)
			return -errno;
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
				return -errno;
			}
			if (n == 0)
				break;
		}
		pos = hole;
	}
	return fsync(out) < 0 ? -errno : 0;
}

int disk_file_copy(const char *src, const char *dst)
{
	int in, out, r;
	off_t size;

	if ((r = copy_open(src, dst, &in, &out, &size)) < 0)
		return r;
	r = copy_extents(in, out, size);
	close(in);
	if (close(out) < 0 && r == 0)
		r = -errno;
	if (r < 0)
		unlink(dst);
	return r;
}

static void *copy_thread(void *arg)
{
	struct disk_copy *c = arg;

	c->result = copy_extents(c->in, c->out, c->size);
	return NULL;
}

int disk_copy_prepare(struct disk_copy *c, const char *src, const char *dst)
{
	int r;

	memset(c, 0, sizeof(*c));
	c->in = c->out = -1;
	if (!fs_path(c->dst, "%s", dst))
		return -ENAMETOOLONG;
	if ((r = copy_open(src, dst, &c->in, &c->out, &c->size)) < 0)
		return r;
	c->started = true;
	return 0;
}

int disk_copy_start(struct disk_copy *c, const char *src, const char *dst)
{
	int r = disk_copy_prepare(c, src, dst);

	if (r < 0)
		return r;
	if (pthread_create(&c->thread, NULL, copy_thread, c) == 0)
		c->threaded = true;
	else {
		/* no thread: copied here, before the caller goes on */
		c->result = copy_extents(c->in, c->out, c->size);
		c->done = true;
	}
	return 0;
}

int disk_copy_wait(struct disk_copy *c)
{
	int r;

	if (!c->started)
		return -EINVAL;
	if (c->threaded)
		pthread_join(c->thread, NULL);
	else if (!c->done)
		c->result = copy_extents(c->in, c->out, c->size);	/* prepared only */
	c->started = c->threaded = false;
	c->done = true;
	r = c->result;
	close(c->in);
	if (close(c->out) < 0 && r == 0)
		r = -errno;
	if (r < 0)
		unlink(c->dst);
	return r;
}

void disk_copy_drop(struct disk_copy *c)
{
	if (!c->started)
		return;
	if (c->threaded)
		pthread_join(c->thread, NULL);
	c->started = c->threaded = false;
	c->done = true;
	close(c->in);
	close(c->out);
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
