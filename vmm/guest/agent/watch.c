/*
 * watch.c - directory watches (version 4): WATCH_ADD, WATCH_READ, WATCH_REMOVE.
 *
 * One inotify instance serves every watch. A watch is a directory (and, recursive, each directory
 * below it, added as they appear) watched as the user who asked: the kernel checks that user's
 * read permission on each. Events queue in the agent until the host reads them: WATCH_READ answers
 * at once when some are queued, else when the first comes or its wait is over (an empty answer).
 * Bounds: AGENT_MAX_WATCHES watches, AGENT_WATCH_DIRS watched directories and AGENT_WATCH_QUEUE
 * queued events in all; an event that finds the queue full is dropped and the watch's next answer
 * says so. A watch nobody reads for AGENT_WATCH_IDLE_MS ends by itself, as does every watch when
 * the host goes away, so a host that lost track of one does not keep it. The agent's own temporary
 * files (".NAME.kiln-XXXXXX", files.c) are not reported: a file write is its file's creation.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"

#define WATCH_MASK (IN_CREATE | IN_MOVED_TO | IN_MODIFY | IN_DELETE | IN_MOVED_FROM | IN_ATTRIB | \
		    IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
#define REPLY_BYTES (256u << 10)	/* payload bytes of one WATCH_EVENTS, at most (about) */

struct wevent {
	uint8_t type;
	char *name;
};

struct watch {
	uint32_t wid;		/* 0: the slot is free */
	bool recursive;
	bool dropped;		/* an event was dropped since the last answer */
	bool ended;		/* the watched directory went away */
	struct agent_cred cred;
	struct wevent *q;	/* queued events, oldest first */
	size_t qn, qcap;
	uint32_t read_id;	/* the pending WATCH_READ, 0: none */
	uint64_t read_deadline;
	uint64_t idle_since;	/* when it was last answered (or added) */
};

struct wdir {
	int wd;			/* -1: the slot is free */
	int watch;		/* index in watches[] */
	char *rel;		/* relative to the watch's directory; "" for the directory itself */
};

static struct watch watches[AGENT_MAX_WATCHES];
static struct wdir dirs[AGENT_WATCH_DIRS];
static size_t ndirs;		/* slots of dirs[] in use, at most */
static size_t queued;		/* events queued in all watches */
static uint32_t next_wid = 1;
static int ifd = -1;

static struct watch *watch_of(uint32_t wid)
{
	for (int i = 0; wid && i < AGENT_MAX_WATCHES; i++)
		if (watches[i].wid == wid)
			return &watches[i];
	return NULL;
}

/* True when another slot than `skip` watches `wd`. */
static bool wd_shared(int wd, size_t skip)
{
	for (size_t i = 0; i < ndirs; i++)
		if (i != skip && dirs[i].wd == wd)
			return true;
	return false;
}

static void dir_drop(size_t i)
{
	if (!wd_shared(dirs[i].wd, i))
		inotify_rm_watch(ifd, dirs[i].wd);
	free(dirs[i].rel);
	dirs[i] = (struct wdir){ .wd = -1 };
}

static void watch_free(struct watch *w)
{
	int idx = (int)(w - watches);

	for (size_t i = 0; i < ndirs; i++)
		if (dirs[i].wd >= 0 && dirs[i].watch == idx)
			dir_drop(i);
	for (size_t i = 0; i < w->qn; i++)
		free(w->q[i].name);
	queued -= w->qn;
	free(w->q);
	memset(w, 0, sizeof(*w));
}

/* Watches `path` (whose name relative to the watch is `rel`) for watch `idx`: 0 or -errno. */
static int dir_add(int idx, const char *path, const char *rel, bool top)
{
	size_t slot = ndirs;
	int wd;

	for (size_t i = 0; i < ndirs; i++)
		if (dirs[i].wd < 0) {
			slot = i;
			break;
		}
	if (slot == AGENT_WATCH_DIRS)
		return -ENOSPC;
	wd = inotify_add_watch(ifd, path, WATCH_MASK | (top ? 0 : IN_DONT_FOLLOW));
	if (wd < 0)
		return -errno;
	if (!(dirs[slot].rel = strdup(rel))) {
		if (!wd_shared(wd, (size_t)-1))
			inotify_rm_watch(ifd, wd);
		return -ENOMEM;
	}
	dirs[slot].wd = wd;
	dirs[slot].watch = idx;
	if (slot == ndirs)
		ndirs++;
	return 0;
}

/* Adds the directories below `path` (`rel` to the watch) to watch `idx`, depth first. */
static int tree_add(int idx, const char *path, const char *rel, int depth)
{
	DIR *d;
	struct dirent *e;
	int rc = 0;

	if (depth > 64 || !(d = opendir(path)))
		return depth > 64 ? -ELOOP : -errno;
	while (!rc && (e = readdir(d))) {
		char sub[AGENT_MAX_PATH + 1], srel[AGENT_MAX_PATH + 1];
		struct stat st;

		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if (snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name) >= (int)sizeof(sub) ||
		    snprintf(srel, sizeof(srel), "%s%s%s", rel, rel[0] ? "/" : "", e->d_name) >=
			    (int)sizeof(srel))
			continue;
		if (e->d_type == DT_DIR || (e->d_type == DT_UNKNOWN && !lstat(sub, &st) &&
					    S_ISDIR(st.st_mode))) {
			rc = dir_add(idx, sub, srel, false);
			if (!rc)
				rc = tree_add(idx, sub, srel, depth + 1);
			else if (rc != -ENOSPC)
				rc = 0;	/* gone or not readable meanwhile: not watched */
		}
	}
	closedir(d);
	return rc == -ENOSPC ? rc : 0;
}

/*
 * Sends the pending read of `w` what is queued (at most REPLY_BYTES of it), once the output queue
 * has room for it (below AGENT_OUT_HIGH, a whole reply always fits).
 */
static void watch_answer(struct session *s, struct watch *w)
{
	static uint8_t buf[REPLY_BYTES + AGENT_MAX_PATH + 16];
	struct agent_wr wr;
	size_t n = 0, count_at;
	bool last;

	if (!session_has_room(s)) {
		/* The output queue is past its high mark: a reply now could be dropped, and its
		 * events with it. The read stays pending and is tried again shortly. */
		w->read_deadline = now_ms() + 10;
		return;
	}
	agent_wr_init(&wr, buf, sizeof(buf));
	agent_wr_u8(&wr, 0);
	count_at = wr.len;
	agent_wr_u32(&wr, 0);
	while (n < w->qn && n < AGENT_WATCH_MAX_EVENTS && wr.len < REPLY_BYTES) {
		agent_wr_u8(&wr, w->q[n].type);
		agent_wr_str(&wr, w->q[n].name);
		free(w->q[n].name);
		n++;
	}
	memmove(w->q, w->q + n, (w->qn - n) * sizeof(*w->q));
	w->qn -= n;
	queued -= n;
	last = w->ended && w->qn == 0;
	buf[0] = (uint8_t)((w->dropped ? AGENT_WATCH_F_DROPPED : 0) | (last ? AGENT_WATCH_F_ENDED : 0));
	buf[count_at] = (uint8_t)(n >> 24);
	buf[count_at + 1] = (uint8_t)(n >> 16);
	buf[count_at + 2] = (uint8_t)(n >> 8);
	buf[count_at + 3] = (uint8_t)n;
	session_send(s, AGENT_T_WATCH_EVENTS, 0, w->read_id, buf, wr.len);
	w->dropped = false;
	w->read_id = 0;
	w->idle_since = now_ms();
	if (last)
		watch_free(w);	/* told: it is over */
}

static bool agent_temp(const char *name)
{
	const char *base = strrchr(name, '/'), *k;

	base = base ? base + 1 : name;
	k = strstr(base, ".kiln-");
	return base[0] == '.' && k && strlen(k) == 12 && !strchr(k + 6, '.');
}

static void queue(struct watch *w, uint8_t type, const char *name)
{
	struct wevent *q = w->q;

	if (agent_temp(name))
		return;
	if (queued >= AGENT_WATCH_QUEUE) {
		w->dropped = true;
		return;
	}
	if (w->qn == w->qcap) {
		size_t cap = w->qcap ? w->qcap * 2 : 16;

		if (!(q = realloc(w->q, cap * sizeof(*q)))) {
			w->dropped = true;
			return;
		}
		w->q = q;
		w->qcap = cap;
	}
	if (!(w->q[w->qn].name = strdup(name))) {
		w->dropped = true;
		return;
	}
	w->q[w->qn++].type = type;
	queued++;
}

/* Stops watching the directories at or below `rel` of watch `idx` (moved away). */
static void subtree_drop(int idx, const char *rel)
{
	size_t n = strlen(rel);

	for (size_t i = 0; i < ndirs; i++)
		if (dirs[i].wd >= 0 && dirs[i].watch == idx && !strncmp(dirs[i].rel, rel, n) &&
		    (dirs[i].rel[n] == '\0' || dirs[i].rel[n] == '/'))
			dir_drop(i);
}

/* One inotify event, for each watch that watches its directory. */
static void event(const struct inotify_event *ev)
{
	static const struct {
		uint32_t mask;
		uint8_t type;
	} map[] = { { IN_CREATE | IN_MOVED_TO, AGENT_WATCH_CREATE }, { IN_MODIFY, AGENT_WATCH_WRITE },
		    { IN_DELETE, AGENT_WATCH_REMOVE }, { IN_MOVED_FROM, AGENT_WATCH_RENAME },
		    { IN_ATTRIB, AGENT_WATCH_CHMOD } };

	if (ev->mask & IN_Q_OVERFLOW) {
		for (int i = 0; i < AGENT_MAX_WATCHES; i++)
			if (watches[i].wid)
				watches[i].dropped = true;
		return;
	}
	for (size_t i = 0; i < ndirs; i++) {
		struct wdir *d = &dirs[i];
		struct watch *w;
		char name[AGENT_MAX_PATH + 1];

		if (d->wd != ev->wd)
			continue;
		w = &watches[d->watch];
		if (ev->mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT)) {
			if (!d->rel[0])
				w->ended = true;
			if (ev->mask & IN_IGNORED) {
				free(d->rel);
				*d = (struct wdir){ .wd = -1 };	/* the kernel dropped it */
			}
			continue;
		}
		if (!ev->len || snprintf(name, sizeof(name), "%s%s%s", d->rel, d->rel[0] ? "/" : "",
					 ev->name) >= (int)sizeof(name))
			continue;
		for (size_t k = 0; k < sizeof(map) / sizeof(map[0]); k++)
			if (ev->mask & map[k].mask)
				queue(w, map[k].type, name);
		/* a directory moved away is no longer below the watch */
		if ((ev->mask & IN_ISDIR) && (ev->mask & IN_MOVED_FROM) && w->recursive)
			subtree_drop(d->watch, name);
	}
}

/* The directory of each watch, as asked (new directories below it are found from it). */
static char roots[AGENT_MAX_WATCHES][AGENT_MAX_PATH + 1];

/* Adds a new directory `name` (relative) below watch `idx`, and what it already holds. */
static void new_dir(int idx, const char *name)
{
	struct watch *w = &watches[idx];
	char path[AGENT_MAX_PATH + 1];
	bool as;
	int rc;

	if (snprintf(path, sizeof(path), "%s/%s", roots[idx], name) >= (int)sizeof(path))
		return;
	as = user_fs_enter(&w->cred) == 0;
	rc = as ? dir_add(idx, path, name, false) : -EPERM;
	if (!rc)
		rc = tree_add(idx, path, name, 1);
	if (as)
		user_fs_leave(&w->cred);
	if (rc == -ENOSPC)
		w->dropped = true;
}

void watch_poll_done(struct session *s, struct pollfd *pfd, int n)
{
	static char buf[65536] __attribute__((aligned(__alignof__(struct inotify_event))));
	ssize_t len;

	if (n < 1 || !(pfd->revents & POLLIN))
		return;
	while ((len = read(ifd, buf, sizeof(buf))) > 0) {
		for (char *p = buf; p < buf + len;) {
			const struct inotify_event *ev = (const struct inotify_event *)p;

			event(ev);
			/* a recursive watch takes in a directory that appeared, for each watch */
			if ((ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)) && ev->len) {
				int seen[AGENT_MAX_WATCHES] = { 0 };

				for (size_t i = 0; i < ndirs; i++) {
					char name[AGENT_MAX_PATH + 1];
					int idx = dirs[i].watch;

					if (dirs[i].wd != ev->wd || !watches[idx].recursive || seen[idx] ||
					    snprintf(name, sizeof(name), "%s%s%s", dirs[i].rel,
						     dirs[i].rel[0] ? "/" : "", ev->name) >= (int)sizeof(name))
						continue;
					seen[idx] = 1;
					new_dir(idx, name);
				}
			}
			p += sizeof(*ev) + ev->len;
		}
	}
	for (int i = 0; i < AGENT_MAX_WATCHES; i++)
		if (watches[i].wid && watches[i].read_id && (watches[i].qn || watches[i].ended))
			watch_answer(s, &watches[i]);
}

int watch_poll_fill(struct session *s, struct pollfd *pfd, int max)
{
	(void)s;
	for (int i = 0; i < AGENT_MAX_WATCHES; i++)
		if (watches[i].wid && ifd >= 0 && max > 0) {
			*pfd = (struct pollfd){ ifd, POLLIN, 0 };
			return 1;
		}
	return 0;
}

void watch_add(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct agent_bytes path, name;
	struct agent_user u;
	struct watch *w = NULL;
	uint8_t recursive;
	int idx = -1, rc;
	bool as;
	struct stat st;
	struct agent_wr wr;
	uint8_t ok[8];

	agent_rd_init(&r, p, len);
	recursive = agent_rd_u8(&r);
	path = agent_rd_text(&r, AGENT_MAX_PATH);
	if (r.bad || recursive > 1 || !agent_path_ok((const char *)path.p, path.len) ||
	    !agent_rd_user(&r, &name) || !agent_rd_done(&r)) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed watch request");
		return;
	}
	if ((rc = user_lookup(&name, &u)) < 0) {
		session_error(s, id, rc == -ENOENT ? AGENT_S_INVALID : AGENT_S_IO, -rc,
			      rc == -ENOENT ? "no user \"%s\" in the sandbox" : "cannot look up user \"%s\"",
			      u.name);
		return;
	}
	for (int i = 0; i < AGENT_MAX_WATCHES && idx < 0; i++)
		if (!watches[i].wid)
			idx = i;
	if (idx < 0) {
		session_error(s, id, AGENT_S_BUSY, 0, "at most %d watches at once", AGENT_MAX_WATCHES);
		return;
	}
	if (ifd < 0 && (ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC)) < 0) {
		session_error(s, id, AGENT_S_IO, errno, "inotify: %s", strerror(errno));
		return;
	}
	w = &watches[idx];
	memcpy(roots[idx], path.p, path.len);
	roots[idx][path.len] = '\0';
	w->cred = u.cred;
	w->recursive = recursive;
	if (!(as = user_fs_enter(&w->cred) == 0)) {
		session_error(s, id, AGENT_S_INTERNAL, 0, "cannot act as the user");
		return;
	}
	rc = stat(roots[idx], &st) < 0 ? -errno : !S_ISDIR(st.st_mode) ? -ENOTDIR : 0;
	w->wid = next_wid;	/* watch_free() of a failed add needs it set */
	if (!rc)
		rc = dir_add(idx, roots[idx], "", true);
	if (!rc && recursive)
		rc = tree_add(idx, roots[idx], "", 1);
	user_fs_leave(&w->cred);
	if (rc) {
		watch_free(w);
		if (rc == -ENOSPC)
			session_error(s, id, AGENT_S_TOO_LARGE, ENOSPC,
				      "more than %d directories watched", AGENT_WATCH_DIRS);
		else
			session_error(s, id, rc == -ENOENT ? AGENT_S_NOT_FOUND :
					     rc == -EACCES || rc == -EPERM ? AGENT_S_DENIED :
					     rc == -ENOTDIR ? AGENT_S_INVALID : AGENT_S_IO, -rc,
				      "cannot watch %s: %s", roots[idx],
				      rc == -ENOTDIR ? "not a directory" : strerror(-rc));
		return;
	}
	next_wid = next_wid == UINT32_MAX ? 1 : next_wid + 1;
	w->idle_since = now_ms();
	agent_wr_init(&wr, ok, sizeof(ok));
	agent_wr_u64(&wr, w->wid);
	session_send(s, AGENT_T_OK, 0, id, ok, wr.len);
}

/* The watch a READ or REMOVE names; NULL after sending the ERROR. */
static struct watch *named(struct session *s, uint32_t id, struct agent_rd *r, uint32_t *wait)
{
	uint32_t wid = agent_rd_u32(r);
	struct watch *w;

	if (wait)
		*wait = agent_rd_u32(r);
	if (!agent_rd_done(r) || (wait && *wait > AGENT_WATCH_WAIT_MAX_MS)) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed watch request");
		return NULL;
	}
	if (!(w = watch_of(wid)))
		session_error(s, id, AGENT_S_NOT_FOUND, 0, "no watch %u", wid);
	return w;
}

void watch_read(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct watch *w;
	uint32_t wait;

	agent_rd_init(&r, p, len);
	if (!(w = named(s, id, &r, &wait)))
		return;
	if (w->read_id) {
		session_error(s, id, AGENT_S_BUSY, 0, "watch %u is being read", w->wid);
		return;
	}
	w->read_id = id;
	w->read_deadline = now_ms() + wait;
	if (w->qn || w->ended || !wait)
		watch_answer(s, w);
}

void watch_remove(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	struct watch *w;

	agent_rd_init(&r, p, len);
	if (!(w = named(s, id, &r, NULL)))
		return;
	if (w->read_id)
		session_error(s, w->read_id, AGENT_S_NOT_FOUND, 0, "watch %u was removed", w->wid);
	watch_free(w);
	session_send(s, AGENT_T_OK, 0, id, "\0\0\0\0\0\0\0\0", 8);
}

void watch_cancel(uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_WATCHES; i++)
		if (watches[i].wid && watches[i].read_id == id) {
			watches[i].read_id = 0;
			watches[i].idle_since = now_ms();
		}
}

bool watch_active(uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_WATCHES; i++)
		if (watches[i].wid && watches[i].read_id == id)
			return true;
	return false;
}

void watch_tick(struct session *s)
{
	uint64_t now = now_ms();

	for (int i = 0; i < AGENT_MAX_WATCHES; i++) {
		struct watch *w = &watches[i];

		if (!w->wid)
			continue;
		if (w->read_id && now >= w->read_deadline)
			watch_answer(s, w);
		else if (!w->read_id && now - w->idle_since >= AGENT_WATCH_IDLE_MS)
			watch_free(w);	/* nobody reads it */
	}
}

int watch_next_timeout(void)
{
	uint64_t now = now_ms(), next = UINT64_MAX;

	for (int i = 0; i < AGENT_MAX_WATCHES; i++) {
		const struct watch *w = &watches[i];
		uint64_t t;

		if (!w->wid)
			continue;
		t = w->read_id ? w->read_deadline : w->idle_since + AGENT_WATCH_IDLE_MS;
		if (t < next)
			next = t;
	}
	if (next == UINT64_MAX)
		return -1;
	return next <= now ? 0 : next - now > 60000 ? 60000 : (int)(next - now);
}

void watch_reset(void)
{
	for (int i = 0; i < AGENT_MAX_WATCHES; i++)
		if (watches[i].wid)
			watch_free(&watches[i]);
}
