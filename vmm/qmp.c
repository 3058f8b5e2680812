/*
 * qmp.c - QMP client: framing, command/response matching, event queue, fd passing.
 *
 * Messages are read into one bounded buffer and split at '\n'. Each command carries an "id"; a
 * response with another id (the late answer to a command that timed out) is discarded. Events are
 * queued in a ring of QMP_EVENTS_MAX entries until qmp_wait_event() asks for them.
 */
#include "vmm/qmp.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/buf.h"

struct qmp {
	int fd;
	struct buf in;			/* bytes received, not yet consumed */
	unsigned long next_id;
	json_t *events[QMP_EVENTS_MAX];	/* ring of event objects */
	unsigned ev_head, ev_count;
	char version[32];
};

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int remaining_ms(long long deadline)
{
	long long left = deadline - now_ms();

	return left < 0 ? 0 : (int)left;
}

/* Writes "a: b" (or "a b" when sep is " ") into errmsg, which may be NULL. */
static void set_errmsg(char *errmsg, const char *a, const char *sep, const char *b)
{
	if (errmsg)
		snprintf(errmsg, QMP_ERRMSG_MAX, "%s%s%s", a, sep, b);
}

/* Drops `n` bytes from the front of the input buffer. */
static void in_consume(struct qmp *q, size_t n)
{
	memmove(q->in.data, q->in.data + n, q->in.len - n);
	q->in.len -= n;
	q->in.data[q->in.len] = '\0';
}

/*
 * Reads the next message before `deadline`. Returns 0 with *out a new object, or a negative errno.
 * Blank lines are skipped; anything that is not a JSON object is -EPROTO.
 */
static int read_message(struct qmp *q, long long deadline, json_t **out)
{
	for (;;) {
		char *nl = q->in.len ? memchr(q->in.data, '\n', q->in.len) : NULL;

		if (nl) {
			size_t linelen = (size_t)(nl - q->in.data);
			json_error_t jerr;
			json_t *msg;

			if (linelen == 0 || (linelen == 1 && q->in.data[0] == '\r')) {
				in_consume(q, linelen + 1);
				continue;
			}
			msg = json_loadb(q->in.data, linelen, JSON_REJECT_DUPLICATES, &jerr);
			in_consume(q, linelen + 1);
			if (!msg)
				return -EPROTO;
			if (!json_is_object(msg)) {
				json_decref(msg);
				return -EPROTO;
			}
			*out = msg;
			return 0;
		}
		if (q->in.len >= q->in.max)
			return -E2BIG;

		struct pollfd pfd = { .fd = q->fd, .events = POLLIN };
		int left = remaining_ms(deadline);
		int r = poll(&pfd, 1, left);

		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		if (r == 0)
			return -ETIMEDOUT;

		char chunk[4096];
		size_t want = q->in.max - q->in.len;
		ssize_t n = read(q->fd, chunk, want < sizeof(chunk) ? want : sizeof(chunk));

		if (n < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			return -errno;
		}
		if (n == 0)
			return -ECONNRESET;
		r = buf_append(&q->in, chunk, (size_t)n);
		if (r < 0)
			return r;
	}
}

static void queue_event(struct qmp *q, json_t *ev)
{
	if (q->ev_count == QMP_EVENTS_MAX) {
		json_decref(q->events[q->ev_head]);
		q->ev_head = (q->ev_head + 1) % QMP_EVENTS_MAX;
		q->ev_count--;
	}
	q->events[(q->ev_head + q->ev_count) % QMP_EVENTS_MAX] = ev;
	q->ev_count++;
}

/* Writes all of `data`, attaching `fd` (if >= 0) to the first byte sent. */
static int send_all(struct qmp *q, const char *data, size_t len, int fd, long long deadline)
{
	size_t off = 0;

	while (off < len) {
		struct iovec iov = { .iov_base = (char *)data + off, .iov_len = len - off };
		union {
			char buf[CMSG_SPACE(sizeof(int))];
			struct cmsghdr align;
		} ctl;
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
		ssize_t n;

		if (fd >= 0 && off == 0) {
			struct cmsghdr *c;

			memset(&ctl, 0, sizeof(ctl));
			msg.msg_control = ctl.buf;
			msg.msg_controllen = sizeof(ctl.buf);
			c = CMSG_FIRSTHDR(&msg);
			c->cmsg_level = SOL_SOCKET;
			c->cmsg_type = SCM_RIGHTS;
			c->cmsg_len = CMSG_LEN(sizeof(int));
			memcpy(CMSG_DATA(c), &fd, sizeof(int));
		}
		n = sendmsg(q->fd, &msg, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN) {
				struct pollfd pfd = { .fd = q->fd, .events = POLLOUT };
				int r = poll(&pfd, 1, remaining_ms(deadline));

				if (r == 0)
					return -ETIMEDOUT;
				if (r < 0 && errno != EINTR)
					return -errno;
				continue;
			}
			return errno == EPIPE ? -ECONNRESET : -errno;
		}
		off += (size_t)n;
	}
	return 0;
}

/* Reads the greeting and sends qmp_capabilities. */
static int handshake(struct qmp *q, int timeout_ms)
{
	long long deadline = now_ms() + timeout_ms;
	json_t *msg = NULL, *qmp, *ver;
	int r;

	r = read_message(q, deadline, &msg);
	if (r < 0)
		return r;
	qmp = json_object_get(msg, "QMP");
	if (!json_is_object(qmp)) {
		json_decref(msg);
		return -EPROTO;
	}
	ver = json_object_get(json_object_get(qmp, "version"), "qemu");
	if (json_is_object(ver))
		snprintf(q->version, sizeof(q->version), "%lld.%lld.%lld",
			 json_integer_value(json_object_get(ver, "major")),
			 json_integer_value(json_object_get(ver, "minor")),
			 json_integer_value(json_object_get(ver, "micro")));
	json_decref(msg);
	return qmp_execute(q, "qmp_capabilities", NULL, -1, remaining_ms(deadline), NULL, NULL);
}

int qmp_open_fd(int fd, int timeout_ms, struct qmp **out)
{
	struct qmp *q;
	int flags, r;

	*out = NULL;
	q = calloc(1, sizeof(*q));
	if (!q) {
		close(fd);
		return -ENOMEM;
	}
	q->fd = fd;
	buf_init(&q->in, QMP_MSG_MAX);
	flags = fcntl(fd, F_GETFL);
	if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
		r = -errno;
		goto fail;
	}
	r = handshake(q, timeout_ms);
	if (r < 0)
		goto fail;
	*out = q;
	return 0;
fail:
	qmp_close(q);
	return r;
}

int qmp_connect(const char *path, int timeout_ms, struct qmp **out)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	long long deadline = now_ms() + timeout_ms;
	int fd;

	*out = NULL;
	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	strcpy(sa.sun_path, path);
	for (;;) {
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0)
			return -errno;
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			break;
		int e = errno;

		close(fd);
		if ((e != ENOENT && e != ECONNREFUSED) || now_ms() >= deadline)
			return -e;
		usleep(5000);
	}
	return qmp_open_fd(fd, remaining_ms(deadline), out);
}

void qmp_close(struct qmp *q)
{
	if (!q)
		return;
	if (q->fd >= 0)
		close(q->fd);
	for (unsigned i = 0; i < q->ev_count; i++)
		json_decref(q->events[(q->ev_head + i) % QMP_EVENTS_MAX]);
	buf_release(&q->in);
	free(q);
}

int qmp_execute(struct qmp *q, const char *cmd, json_t *args, int fd, int timeout_ms, json_t **ret,
		char errmsg[QMP_ERRMSG_MAX])
{
	long long deadline = now_ms() + timeout_ms;
	char id[32];
	json_t *req;
	char *text;
	int r;

	if (ret)
		*ret = NULL;
	if (errmsg)
		errmsg[0] = '\0';
	snprintf(id, sizeof(id), "kiln-%lu", ++q->next_id);
	req = json_pack("{s:s, s:s}", "execute", cmd, "id", id);
	if (!req)
		return -ENOMEM;
	if (args && json_object_set(req, "arguments", args) < 0) {
		json_decref(req);
		return -ENOMEM;
	}
	text = json_dumps(req, JSON_COMPACT);
	json_decref(req);
	if (!text)
		return -ENOMEM;
	/* json_dumps leaves no newline; QMP's parser needs none, but one keeps transcripts readable */
	r = send_all(q, text, strlen(text), fd, deadline);
	free(text);
	if (r == 0)
		r = send_all(q, "\n", 1, -1, deadline);
	if (r < 0)
		return r;

	for (;;) {
		json_t *msg = NULL, *err;
		const char *got_id;

		r = read_message(q, deadline, &msg);
		if (r < 0) {
			if (r == -EPROTO)
				set_errmsg(errmsg, "not a QMP message in answer to", " ", cmd);
			return r;
		}
		if (json_object_get(msg, "event")) {
			queue_event(q, msg);
			continue;
		}
		got_id = json_string_value(json_object_get(msg, "id"));
		if (!got_id || strcmp(got_id, id) != 0) {
			json_decref(msg);	/* a late answer to an abandoned command */
			continue;
		}
		err = json_object_get(msg, "error");
		if (err) {
			set_errmsg(errmsg,
				   json_string_value(json_object_get(err, "class")) ?: "Error", ": ",
				   json_string_value(json_object_get(err, "desc")) ?: "(no description)");
			json_decref(msg);
			return -EREMOTEIO;
		}
		if (!json_object_get(msg, "return")) {
			json_decref(msg);
			set_errmsg(errmsg, "no return value in answer to", " ", cmd);
			return -EPROTO;
		}
		if (ret)
			*ret = json_incref(json_object_get(msg, "return"));
		json_decref(msg);
		return 0;
	}
}

int qmp_getfd(struct qmp *q, const char *name, int fd, int timeout_ms, char errmsg[QMP_ERRMSG_MAX])
{
	json_t *args = json_pack("{s:s}", "fdname", name);
	int r;

	if (!args)
		return -ENOMEM;
	r = qmp_execute(q, "getfd", args, fd, timeout_ms, NULL, errmsg);
	json_decref(args);
	return r;
}

/* Removes and returns the first queued event named `name` and drops the ones before it. */
static json_t *take_event(struct qmp *q, const char *name)
{
	while (q->ev_count) {
		json_t *ev = q->events[q->ev_head];
		const char *ename = json_string_value(json_object_get(ev, "event"));

		q->ev_head = (q->ev_head + 1) % QMP_EVENTS_MAX;
		q->ev_count--;
		if (ename && strcmp(ename, name) == 0)
			return ev;
		json_decref(ev);
	}
	return NULL;
}

int qmp_wait_event(struct qmp *q, const char *name, int timeout_ms, json_t **data)
{
	long long deadline = now_ms() + timeout_ms;
	json_t *ev = take_event(q, name);

	while (!ev) {
		json_t *msg = NULL;
		int r = read_message(q, deadline, &msg);

		if (r < 0)
			return r;
		if (json_object_get(msg, "event")) {
			queue_event(q, msg);
			ev = take_event(q, name);
		} else {
			json_decref(msg);	/* an answer nobody waits for any more */
		}
	}
	if (data) {
		json_t *d = json_object_get(ev, "data");

		*data = d ? json_incref(d) : NULL;
	}
	json_decref(ev);
	return 0;
}

const char *qmp_version(const struct qmp *q)
{
	return q->version;
}
