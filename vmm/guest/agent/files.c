/*
 * files.c - kiln-agent's FILE_WRITE and FILE_READ: files streamed in chunks, never held whole.
 *
 * FILE_WRITE payload: str path (absolute), u32 mode (permission bits; 0 means 0644), and optionally
 * str user (absent: root). The data
 * follows in FILE_DATA frames and FILE_END commits: the bytes go to a temporary file beside the
 * target, which is synced and renamed over it, so readers see the old file or the whole new one.
 * Missing parent directories are made first (mode 0755, as `mkdir -p`). On any error the agent
 * sends one ERROR, removes the temporary file and the directories this write made (those still
 * empty), and ignores the rest of that id's frames.
 *
 * A write for a user makes its parents and creates, syncs and renames its temporary file with the
 * user's file system identity (user.c): the new file and directories are the user's, and a
 * directory the user may not write to refuses it (AGENT_S_DENIED). A read for a user opens the file with its identity in the same way. An
 * unknown user is an INVALID error.
 *
 * FILE_READ payload: str path, and optionally str user. The reply is FILE_DATA frames of at most AGENT_CHUNK bytes, produced
 * only while the output queue has room, then FILE_END with the size; or an ERROR.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"

struct xfer {
	bool used;
	bool reading;		/* FILE_READ; else FILE_WRITE */
	uint32_t id;
	int fd;
	uint32_t mode;		/* permission bits of a written file */
	struct agent_cred cred;	/* whom the transfer is for */
	uint64_t bytes;		/* moved so far */
	char path[AGENT_MAX_PATH + 1];
	char tmp[AGENT_MAX_PATH + 32];	/* the temporary file of a write */
	size_t made;		/* > 0: path[0..made) is the first directory this write made */
};

static struct xfer xfers[AGENT_MAX_FILES];

static struct xfer *xfer_find(uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_FILES; i++)
		if (xfers[i].used && xfers[i].id == id)
			return &xfers[i];
	return NULL;
}

static struct xfer *xfer_alloc(struct session *s, uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_FILES; i++) {
		if (!xfers[i].used) {
			memset(&xfers[i], 0, sizeof(xfers[i]));
			xfers[i].used = true;
			xfers[i].id = id;
			xfers[i].fd = -1;
			return &xfers[i];
		}
	}
	session_error(s, id, AGENT_S_BUSY, 0, "too many file transfers at once (%d)",
		      AGENT_MAX_FILES);
	return NULL;
}

/*
 * Removes the directories a write made, deepest first, down to path[0..made); rmdir leaves any
 * that something else filled meanwhile. Runs with the writer's file system identity.
 */
static void unmake_parents(struct xfer *x)
{
	char dir[AGENT_MAX_PATH + 1];
	size_t n = strlen(x->path);

	memcpy(dir, x->path, n + 1);
	while (n > x->made) {
		while (n > 0 && dir[n - 1] != '/')	/* drop the last component */
			n--;
		while (n > 1 && dir[n - 1] == '/')
			n--;
		dir[n] = '\0';
		if (n < x->made || rmdir(dir) < 0)
			break;
	}
}

/* Ends a transfer; a write that did not commit loses its temporary file and the parents it made. */
static void xfer_release(struct xfer *x)
{
	if (x->fd >= 0)
		close(x->fd);
	if (!x->reading && (x->tmp[0] || x->made)) {
		/* as the user: the directory is the user's to change meanwhile */
		bool as = user_fs_enter(&x->cred) == 0;

		if (x->tmp[0])
			unlink(x->tmp);
		if (x->made)
			unmake_parents(x);
		if (as)
			user_fs_leave(&x->cred);
	}
	x->used = false;
	x->fd = -1;
}

bool file_active(uint32_t id)
{
	return xfer_find(id) != NULL;
}

/* The agent_status for an errno from open/stat on a path the host named. */
static enum agent_status path_status(int e)
{
	return e == ENOENT || e == ENOTDIR ? AGENT_S_NOT_FOUND
	       : e == ENAMETOOLONG	   ? AGENT_S_INVALID
	       : e == EACCES || e == EPERM ? AGENT_S_DENIED
					   : AGENT_S_IO;
}

/*
 * Reads the optional user field that ends the payload and looks the user up into x->cred; sends
 * the ERROR and returns false when the field is malformed or names no user.
 */
static bool read_user(struct session *s, uint32_t id, struct agent_rd *r, struct xfer *x)
{
	struct agent_bytes b;
	struct agent_user u;
	int rc;

	if (!agent_rd_user(r, &b) || !agent_rd_done(r)) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed file request");
		return false;
	}
	rc = user_lookup(&b, &u);
	if (rc < 0) {
		session_error(s, id, rc == -ENOENT ? AGENT_S_INVALID : AGENT_S_IO, -rc,
			      rc == -ENOENT ? "no user \"%s\" in the sandbox" : "cannot look up user \"%s\"",
			      u.name);
		return false;
	}
	x->cred = u.cred;
	return true;
}

/* Takes the transfer's user's identity for a file system call; false after sending the ERROR. */
static bool as_user(struct session *s, struct xfer *x)
{
	int rc = user_fs_enter(&x->cred);

	if (rc < 0)
		session_error(s, x->id, AGENT_S_INTERNAL, -rc, "cannot act as the user: %s",
			      strerror(-rc));
	return rc == 0;
}

/* Reads the path field into `out`; sends the ERROR and returns false when it is not acceptable. */
static bool read_path(struct session *s, uint32_t id, struct agent_rd *r, char *out)
{
	struct agent_bytes b = agent_rd_text(r, AGENT_MAX_PATH);

	if (r->bad) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed path");
		return false;
	}
	if (!agent_path_ok((const char *)b.p, b.len)) {
		session_error(s, id, AGENT_S_INVALID, 0, "path must be absolute");
		return false;
	}
	memcpy(out, b.p, b.len);
	out[b.len] = '\0';
	return true;
}

/*
 * Makes the missing directories above x->path, each 0755 (less the umask) with the caller's file
 * system identity, recording in x->made where the first one it made ends. 0, or -errno of the
 * first mkdir that failed for another reason than the directory being there.
 */
static int make_parents(struct xfer *x)
{
	char dir[AGENT_MAX_PATH + 1];
	size_t n = strlen(x->path);

	memcpy(dir, x->path, n + 1);
	for (size_t i = 1; i < n; i++) {
		if (dir[i] != '/' || dir[i - 1] == '/')
			continue;
		dir[i] = '\0';
		int rc = mkdir(dir, 0755);

		dir[i] = '/';
		if (rc == 0 && !x->made)
			x->made = i;
		else if (rc < 0 && errno != EEXIST)
			return -errno;
	}
	return 0;
}

void file_write_open(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct xfer *x;
	struct stat st;
	char dir[AGENT_MAX_PATH + 1], base[AGENT_MAX_PATH + 1];

	x = xfer_alloc(s, id);
	if (!x)
		return;
	agent_rd_init(&r, p, len);
	if (!read_path(s, id, &r, x->path))
		goto fail;
	x->mode = agent_rd_u32(&r) & 07777;
	if (!read_user(s, id, &r, x))
		goto fail;
	if (!x->mode)
		x->mode = 0644;
	if (!as_user(s, x))
		goto fail;
	if (stat(x->path, &st) == 0 && S_ISDIR(st.st_mode)) {
		user_fs_leave(&x->cred);
		session_error(s, id, AGENT_S_INVALID, EISDIR, "path is a directory");
		goto fail;
	}
	int mrc = make_parents(x);

	if (mrc < 0) {
		user_fs_leave(&x->cred);
		session_error(s, id, mrc == -ENOSPC || mrc == -EDQUOT ? AGENT_S_TOO_LARGE : path_status(-mrc),
			      -mrc, "cannot make the parent directories: %s", strerror(-mrc));
		goto fail;
	}
	snprintf(dir, sizeof(dir), "%s", x->path);
	snprintf(base, sizeof(base), "%s", x->path);
	snprintf(x->tmp, sizeof(x->tmp), "%s/.%.200s.kiln-XXXXXX", dirname(dir), basename(base));
	x->fd = mkostemp(x->tmp, O_CLOEXEC);
	int e = errno;

	user_fs_leave(&x->cred);
	if (x->fd < 0) {
		x->tmp[0] = '\0';
		session_error(s, id, path_status(e), e, "cannot create the file: %s", strerror(e));
		goto fail;
	}
	return;
fail:
	xfer_release(x);
}

/* Fails a write: one ERROR, then the id is forgotten. */
static void write_fail(struct session *s, struct xfer *x, int e, const char *what)
{
	session_error(s, x->id, e == ENOSPC || e == EFBIG || e == EDQUOT ? AGENT_S_TOO_LARGE
				: e == EACCES || e == EPERM			  ? AGENT_S_DENIED
									  : AGENT_S_IO,
		      e, "%s: %s", what, strerror(e));
	xfer_release(x);
}

void file_write_data(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct xfer *x = xfer_find(id);
	size_t off = 0;

	if (!x || x->reading)
		return;	/* a write that failed already, or a cancelled one */
	while (off < len) {
		ssize_t n = write(x->fd, p + off, len - off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			write_fail(s, x, n < 0 ? errno : EIO, "cannot write the file");
			return;
		}
		off += (size_t)n;
	}
	x->bytes += len;
}

void file_write_end(struct session *s, uint32_t id)
{
	struct xfer *x = xfer_find(id);
	uint8_t buf[8];
	struct agent_wr w;

	if (!x || x->reading)
		return;
	if (fchmod(x->fd, x->mode) < 0 || fsync(x->fd) < 0) {
		write_fail(s, x, errno, "cannot sync the file");
		return;
	}
	close(x->fd);
	x->fd = -1;
	if (!as_user(s, x)) {
		xfer_release(x);
		return;
	}
	int rc = rename(x->tmp, x->path), e = errno;

	user_fs_leave(&x->cred);
	if (rc < 0) {
		write_fail(s, x, e, "cannot rename the file into place");
		return;
	}
	x->tmp[0] = '\0';
	x->made = 0;	/* committed: the directories stay */
	agent_wr_init(&w, buf, sizeof(buf));
	agent_wr_u64(&w, x->bytes);
	session_send(s, AGENT_T_OK, 0, id, buf, w.len);
	xfer_release(x);
}

void file_read_open(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct xfer *x;
	struct stat st = { 0 };

	x = xfer_alloc(s, id);
	if (!x)
		return;
	x->reading = true;
	agent_rd_init(&r, p, len);
	if (!read_path(s, id, &r, x->path) || !read_user(s, id, &r, x) || !as_user(s, x))
		goto fail;
	/* O_NONBLOCK: a FIFO must not hang the agent in open(). */
	x->fd = open(x->path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	int e = errno;

	user_fs_leave(&x->cred);
	if (x->fd < 0) {
		session_error(s, id, path_status(e), e, "cannot open the file: %s", strerror(e));
		goto fail;
	}
	if (fstat(x->fd, &st) < 0 || !S_ISREG(st.st_mode)) {
		session_error(s, id, AGENT_S_INVALID, EISDIR,
			      S_ISDIR(st.st_mode) ? "path is a directory" : "not a regular file");
		goto fail;
	}
	return;
fail:
	xfer_release(x);
}

bool file_pending(void)
{
	for (int i = 0; i < AGENT_MAX_FILES; i++)
		if (xfers[i].used && xfers[i].reading)
			return true;
	return false;
}

void file_pump(struct session *s)
{
	static uint8_t buf[AGENT_CHUNK];

	for (int i = 0; i < AGENT_MAX_FILES && session_has_room(s); i++) {
		struct xfer *x = &xfers[i];

		if (!x->used || !x->reading)
			continue;
		ssize_t n = read(x->fd, buf, sizeof(buf));

		if (n < 0 && (errno == EINTR || errno == EAGAIN))
			continue;
		if (n < 0) {
			session_error(s, x->id, AGENT_S_IO, errno, "cannot read the file: %s",
				      strerror(errno));
			xfer_release(x);
		} else if (n > 0) {
			session_send(s, AGENT_T_FILE_DATA, 0, x->id, buf, (size_t)n);
			x->bytes += (uint64_t)n;
		} else {
			struct agent_wr w;
			uint8_t end[8];

			agent_wr_init(&w, end, sizeof(end));
			agent_wr_u64(&w, x->bytes);
			session_send(s, AGENT_T_FILE_END, 0, x->id, end, w.len);
			xfer_release(x);
		}
	}
}

void file_cancel(uint32_t id)
{
	struct xfer *x = xfer_find(id);

	if (x)
		xfer_release(x);
}

void file_reset(void)
{
	for (int i = 0; i < AGENT_MAX_FILES; i++)
		if (xfers[i].used)
			xfer_release(&xfers[i]);
}
