/*
 * fsutil.c - path formatting, recursive mkdir and removal, fsync, small reads and errno reporting
 * (see fsutil.h).
 */
#include "common/fsutil.h"
#include "common/log.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

bool fs_path(char *out, const char *fmt, ...)
{
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(out, PATH_MAX, fmt, ap);
	va_end(ap);
	return n >= 0 && n < PATH_MAX;
}

int fs_mkdir_p(const char *dir, mode_t mode)
{
	char p[PATH_MAX];
	size_t len = strlen(dir);

	if (len >= sizeof(p))
		return -ENAMETOOLONG;
	memcpy(p, dir, len + 1);
	for (size_t i = 1; i <= len; i++) {
		char c;

		if (p[i] != '/' && p[i] != '\0')
			continue;
		c = p[i];
		p[i] = '\0';
		if (mkdir(p, i == len ? mode : 0755) < 0 && errno != EEXIST)
			return -errno;
		p[i] = c;
	}
	return 0;
}

enum kiln_err fs_err(struct kiln_error *err, int neg, const char *what, const char *subject)
{
	return kiln_error_set(err, neg == -ENOMEM ? KILN_E_NOMEM : KILN_E_IO, "%s '%s': %s", what,
			      subject, strerror(-neg));
}

void fs_remove(const char *path, struct kiln_error *err, enum kiln_err *rc)
{
	if (path[0] && unlink(path) < 0 && errno != ENOENT && *rc == KILN_OK)
		*rc = fs_err(err, -errno, "cannot remove", path);
}

void fs_remove_dir(const char *path, struct kiln_error *err, enum kiln_err *rc)
{
	if (path[0] && rmdir(path) < 0 && errno != ENOENT && *rc == KILN_OK)
		*rc = fs_err(err, -errno, "cannot remove", path);
}

/* The errno of the entry fs_remove_tree's walk stopped at (nftw passes the callback no context). */
static __thread int tree_errno;

static int tree_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	if ((flag == FTW_DP ? rmdir(path) : unlink(path)) < 0 && errno != ENOENT) {
		tree_errno = errno;
		return 1;
	}
	return 0;
}

int fs_remove_tree(const char *path)
{
	struct stat st;
	int r;

	if (lstat(path, &st) < 0)
		return errno == ENOENT ? 0 : -errno;
	if (!S_ISDIR(st.st_mode))
		return unlink(path) < 0 && errno != ENOENT ? -errno : 0;
	tree_errno = 0;
	r = nftw(path, tree_entry, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
	if (r == 1)
		return -tree_errno;
	if (r < 0)
		return errno == ENOENT ? 0 : errno ? -errno : -EIO;
	return 0;
}

/* fsync of `path` opened with `flags` (O_RDONLY and more). */
static int fsync_open(const char *path, int flags)
{
	int fd = open(path, flags | O_CLOEXEC), r = 0;

	if (fd < 0)
		return -errno;
	if (fsync(fd) < 0)
		r = -errno;
	close(fd);
	return r;
}

int fs_fsync_path(const char *path)
{
	return fsync_open(path, O_RDONLY);
}

int fs_fsync_dir(const char *dir)
{
	return fsync_open(dir, O_RDONLY | O_DIRECTORY);
}

ssize_t fs_read_small(const char *path, char *out, size_t cap)
{
	size_t len = 0;
	int fd;

	if (cap == 0)
		return -EINVAL;
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
	if (fd < 0)
		return -errno;
	while (len + 1 < cap) {
		ssize_t n = read(fd, out + len, cap - 1 - len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			int e = errno;

			close(fd);
			return -e;
		}
		if (n == 0)
			break;
		len += (size_t)n;
	}
	close(fd);
	out[len] = '\0';
	return (ssize_t)len;
}

void fs_remove_tree_or_warn(const char *path)
{
	int r = fs_remove_tree(path);

	if (r < 0)
		log_warn("cannot remove \"%s\": %s", path, strerror(-r));
}

static void *unlink_thread(void *arg)
{
	char *path = arg;

	if (unlink(path) < 0 && errno != ENOENT)
		log_warn("cannot remove \"%s\": %s", path, strerror(errno));
	free(path);
	return NULL;
}

void fs_unlink_behind(const char *path)
{
	pthread_attr_t attr;
	pthread_t t;
	char *p = strdup(path);
	int r = -1;

	if (p && pthread_attr_init(&attr) == 0) {
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
		r = pthread_create(&t, &attr, unlink_thread, p);
		pthread_attr_destroy(&attr);
	}
	if (r != 0) {
		free(p);
		if (unlink(path) < 0 && errno != ENOENT)
			log_warn("cannot remove \"%s\": %s", path, strerror(errno));
	}
}
