/*
 * fsutil.c - path formatting, recursive mkdir and errno reporting (see fsutil.h).
 */
#include "fsutil.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
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
