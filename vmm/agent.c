/*
 * agent.c - the host's client for kiln-agent (see agent.h).
 *
 * One reader thread per connection decodes the guest's frames (vmm/guest/agent_proto.c) and
 * appends each to the queue of the call whose request id it carries; frames for ids nobody waits
 * for are dropped. A call's queue is bounded (CALL_QUEUE_MAX): past it the reader waits for the
 * caller to catch up, which backs up the channel and, through the agent's own bounded queue, the
 * guest's command. Writers share the socket under a mutex, one whole frame at a time.
 *
 * Anything the guest sends that the protocol does not allow (a bad header, a frame type a call
 * does not expect, a malformed payload, ERROR with id 0) kills the connection: after that every
 * call returns KILN_E_SANDBOX_FAILED.
 */
#include "vmm/agent.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "vmm/guest/agent_proto.h"

#define CALL_QUEUE_MAX (4u << 20)	/* bytes of frames queued for one call before the reader waits */

struct frame {
	struct frame *next;
	uint8_t type;
	uint32_t len;		/* bytes of data */
	uint8_t data[];
};

struct call {
	struct call *next;
	uint32_t id;
	struct frame *head, *tail;
	size_t queued;		/* bytes of data in the queue */
	pthread_cond_t cond;	/* signalled when a frame arrives or the connection dies */
	/* A port stream (agent_port_open): windows instead of the queue bound. */
	bool stream;
	bool aborted;		/* agent_port_abort(): wake and fail every wait */
	bool failed;		/* the guest ended the stream with an ERROR */
	uint32_t credit;	/* bytes the host may still send */
	uint32_t inflight;	/* bytes the guest sent that the host has not acknowledged */
};

struct agent {
	int fd;
	int io_timeout_ms;
	pthread_t reader;
	bool reader_started;
	pthread_mutex_t lock;	/* guards everything below, and each call's queue */
	pthread_cond_t space;	/* the reader waits here for room in a call's queue */
	struct call *calls;
	uint32_t next_id;
	bool dead;
	bool hello_sent;	/* the first HELLO (which starts a new session in the guest) went out */
	unsigned agent_major;	/* N of the agent's "kiln-agent/N" (its last HELLO_OK), or 0 */
	char dead_msg[160];
	pthread_mutex_t wlock;	/* one writer at a time on fd */
};

/* Milliseconds on CLOCK_MONOTONIC. */
static int64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Copies guest text into `out` (cap bytes), keeping printable ASCII only. */
static void sanitize(char *out, size_t cap, const uint8_t *p, size_t len)
{
	size_t n = 0;

	for (size_t i = 0; i < len && n + 1 < cap; i++)
		out[n++] = p[i] >= 0x20 && p[i] < 0x7f ? (char)p[i] : '?';
	out[n] = '\0';
}

/* Marks the connection dead (first reason wins) and wakes everybody; caller holds a->lock. */
static void mark_dead_locked(struct agent *a, const char *why)
{
	if (!a->dead) {
		a->dead = true;
		snprintf(a->dead_msg, sizeof(a->dead_msg), "%s", why);
		shutdown(a->fd, SHUT_RDWR);
	}
	for (struct call *c = a->calls; c; c = c->next)
		pthread_cond_broadcast(&c->cond);
	pthread_cond_broadcast(&a->space);
}

static void mark_dead(struct agent *a, const char *why)
{
	pthread_mutex_lock(&a->lock);
	mark_dead_locked(a, why);
	pthread_mutex_unlock(&a->lock);
}

static enum kiln_err dead_error(struct agent *a, struct kiln_error *err)
{
	char msg[sizeof(a->dead_msg)];

	pthread_mutex_lock(&a->lock);
	memcpy(msg, a->dead_msg, sizeof(msg));
	pthread_mutex_unlock(&a->lock);
	return kiln_error_set(err, KILN_E_SANDBOX_FAILED, "guest agent: %s", msg);
}

static struct call *call_find_locked(struct agent *a, uint32_t id)
{
	for (struct call *c = a->calls; c; c = c->next)
		if (c->id == id)
			return c;
	return NULL;
}

/* Hands one decoded frame to its call; drops it when nobody waits for that id. */
static void deliver(struct agent *a, const struct agent_hdr *h, const uint8_t *payload)
{
	struct frame *f;
	struct call *c;

	pthread_mutex_lock(&a->lock);
	for (;;) {
		c = call_find_locked(a, h->id);
		if (!c || a->dead || c->stream || c->queued == 0 ||
		    c->queued + h->len <= CALL_QUEUE_MAX)
			break;
		pthread_cond_wait(&a->space, &a->lock);
	}
	if (!c || a->dead) {
		pthread_mutex_unlock(&a->lock);
		return;
	}
	if (c->stream) {
		/* The windows bound a stream's queue: a guest past them breaks the protocol. */
		uint32_t more;

		if (h->type == AGENT_T_STREAM_WINDOW) {
			if (agent_parse_u32(payload, h->len, &more) < 0 ||
			    (uint64_t)c->credit + more > AGENT_STREAM_WINDOW)
				mark_dead_locked(a, "bad stream window from the guest");
			else
				c->credit += more;
			pthread_cond_broadcast(&c->cond);
			pthread_mutex_unlock(&a->lock);
			return;
		}
		if (h->type == AGENT_T_STREAM_DATA) {
			if ((uint64_t)c->inflight + h->len > AGENT_STREAM_WINDOW) {
				mark_dead_locked(a, "guest overran a stream window");
				pthread_mutex_unlock(&a->lock);
				return;
			}
			c->inflight += h->len;
		}
		if (h->type == AGENT_T_ERROR)
			c->failed = true;
	}
	f = malloc(sizeof(*f) + h->len);
	if (!f) {
		mark_dead_locked(a, "out of memory");
		pthread_mutex_unlock(&a->lock);
		return;
	}
	f->next = NULL;
	f->type = h->type;
	f->len = h->len;
	if (h->len)
		memcpy(f->data, payload, h->len);
	if (c->tail)
		c->tail->next = f;
	else
		c->head = f;
	c->tail = f;
	c->queued += h->len;
	pthread_cond_broadcast(&c->cond);
	pthread_mutex_unlock(&a->lock);
}

/* The reader thread: decodes frames until the channel ends or the guest misbehaves. */
static void *reader_main(void *arg)
{
	struct agent *a = arg;
	struct agent_decoder dec;
	uint8_t *payload = malloc(AGENT_MAX_PAYLOAD), *buf = malloc(65536);
	const char *why = "channel closed";
	char msg[160];

	if (!payload || !buf) {
		why = "out of memory";
		goto out;
	}
	agent_decoder_init(&dec, payload);
	for (;;) {
		struct pollfd p = { a->fd, POLLIN, 0 };

		if (poll(&p, 1, -1) < 0) {
			if (errno == EINTR)
				continue;
			why = "poll failed";
			goto out;
		}
		ssize_t n = recv(a->fd, buf, 65536, 0);

		if (n == 0)
			goto out;
		if (n < 0) {
			if (errno == EAGAIN || errno == EINTR)
				continue;
			why = "channel read failed";
			goto out;
		}
		size_t off = 0;

		while (off < (size_t)n) {
			size_t used;
			int rc = agent_decoder_feed(&dec, buf + off, (size_t)n - off, &used);

			off += used;
			if (rc < 0) {
				why = rc == -EMSGSIZE ? "frame over the size cap" : "bad frame header";
				goto out;
			}
			if (rc == 0)
				continue;
			if (!agent_type_from_guest(dec.hdr.type) || dec.hdr.flags != 0) {
				why = "frame type or flags not allowed from the guest";
				goto out;
			}
			if (dec.hdr.id == 0) {
				struct agent_error_msg em;

				if (dec.hdr.type == AGENT_T_ERROR &&
				    agent_parse_error(dec.payload, dec.hdr.len, &em) == 0) {
					char text[100];

					sanitize(text, sizeof(text), em.message.p, em.message.len);
					snprintf(msg, sizeof(msg), "guest ended the session: %s", text);
					why = msg;
				} else {
					why = "frame without a request id";
				}
				goto out;
			}
			deliver(a, &dec.hdr, dec.payload);
		}
	}
out:
	mark_dead(a, why);
	free(payload);
	free(buf);
	return NULL;
}

/* Registers a new call with a fresh id; the caller ends it with call_end(). */
static struct call *call_begin(struct agent *a)
{
	struct call *c = calloc(1, sizeof(*c));

	if (!c)
		return NULL;
	clock_cond_init(&c->cond, CLOCK_MONOTONIC);
	pthread_mutex_lock(&a->lock);
	do {
		c->id = ++a->next_id;
	} while (c->id == 0 || call_find_locked(a, c->id));
	c->next = a->calls;
	a->calls = c;
	pthread_mutex_unlock(&a->lock);
	return c;
}

/* Unregisters and frees a call and whatever is still queued for it. Accepts NULL. */
static void call_end(struct agent *a, struct call *c)
{
	struct frame *f, *next;

	if (!c)
		return;
	pthread_mutex_lock(&a->lock);
	for (struct call **pp = &a->calls; *pp; pp = &(*pp)->next) {
		if (*pp == c) {
			*pp = c->next;
			break;
		}
	}
	pthread_cond_broadcast(&a->space);
	pthread_mutex_unlock(&a->lock);
	for (f = c->head; f; f = next) {
		next = f->next;
		free(f);
	}
	pthread_cond_destroy(&c->cond);
	free(c);
}

/*
 * Takes the next frame of call `c`, waiting until `deadline` (mono_ms; -1: forever). A zero
 * deadline only polls. Returns 0 with *out set (the caller frees it), -ETIMEDOUT, or -EPIPE when
 * the connection is dead.
 */
static int call_next(struct agent *a, struct call *c, int64_t deadline, struct frame **out)
{
	int rc = 0;

	pthread_mutex_lock(&a->lock);
	while (!c->head && !a->dead) {
		if (deadline >= 0 && mono_ms() >= deadline) {
			rc = -ETIMEDOUT;
			goto out;
		}
		if (deadline < 0) {
			pthread_cond_wait(&c->cond, &a->lock);
		} else {
			struct timespec ts = { (time_t)(deadline / 1000), (long)(deadline % 1000) * 1000000 };

			pthread_cond_timedwait(&c->cond, &a->lock, &ts);
		}
	}
	if (!c->head) {
		rc = -EPIPE;
		goto out;
	}
	*out = c->head;
	c->head = c->head->next;
	if (!c->head)
		c->tail = NULL;
	c->queued -= (*out)->len;
	pthread_cond_broadcast(&a->space);
out:
	pthread_mutex_unlock(&a->lock);
	return rc;
}

/* Writes all of `p` within the io timeout; returns 0 or a negative errno. */
static int write_all(struct agent *a, const uint8_t *p, size_t len)
{
	int64_t deadline = mono_ms() + a->io_timeout_ms;

	while (len > 0) {
		ssize_t n = send(a->fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);

		if (n > 0) {
			p += n;
			len -= (size_t)n;
			continue;
		}
		if (n < 0 && errno != EAGAIN && errno != EINTR)
			return -errno;
		int64_t left = deadline - mono_ms();

		if (left <= 0)
			return -ETIMEDOUT;
		struct pollfd pf = { a->fd, POLLOUT, 0 };

		poll(&pf, 1, (int)(left > 1000 ? 1000 : left));
		pthread_mutex_lock(&a->lock);
		bool dead = a->dead;

		pthread_mutex_unlock(&a->lock);
		if (dead)
			return -EPIPE;
	}
	return 0;
}

/*
 * Sends one frame. A frame cut short leaves the stream unusable, so any failure kills the
 * connection. Returns 0 or KILN_E_SANDBOX_FAILED (in `err`).
 */
static enum kiln_err send_frame(struct agent *a, uint8_t type, uint16_t flags, uint32_t id,
				const void *payload, size_t len, struct kiln_error *err)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, type, flags, id, (uint32_t)len };
	uint8_t hdr[AGENT_HDR_SIZE];
	int rc;

	if (len > AGENT_MAX_PAYLOAD)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "request over the frame cap");
	agent_hdr_encode(&h, hdr);
	pthread_mutex_lock(&a->wlock);
	rc = write_all(a, hdr, sizeof(hdr));
	if (rc == 0 && len)
		rc = write_all(a, payload, len);
	pthread_mutex_unlock(&a->wlock);
	if (rc < 0) {
		mark_dead(a, rc == -ETIMEDOUT ? "guest stopped reading" : "channel write failed");
		return dead_error(a, err);
	}
	return KILN_OK;
}

/* Maps a guest ERROR frame to the project's code, with its sanitised message. */
static enum kiln_err guest_error(struct agent *a, const struct frame *f, struct kiln_error *err)
{
	struct agent_error_msg m;
	char text[160];
	enum kiln_err code;

	if (agent_parse_error(f->data, f->len, &m) < 0) {
		mark_dead(a, "malformed error frame");
		return dead_error(a, err);
	}
	sanitize(text, sizeof(text), m.message.p, m.message.len);
	switch (m.status) {
	case AGENT_S_INVALID:
		code = KILN_E_INVALID;
		break;
	case AGENT_S_NOT_FOUND:
		code = KILN_E_NOT_FOUND;
		break;
	case AGENT_S_IO:
		code = KILN_E_IO;
		break;
	case AGENT_S_TOO_LARGE:
		code = KILN_E_TOO_LARGE;
		break;
	case AGENT_S_BUSY:
		code = KILN_E_RATE_LIMITED;
		break;
	case AGENT_S_DENIED:
		code = KILN_E_FORBIDDEN;
		break;
	case AGENT_S_TAKEN_OVER:
		code = KILN_E_CONFLICT;
		break;
	case AGENT_S_PROTO:
	case AGENT_S_EXISTS:
	case AGENT_S_INTERNAL:
		code = KILN_E_INTERNAL;
		break;
	default:
		code = KILN_E_SANDBOX_FAILED;
		break;
	}
	return kiln_error_set(err, code, "guest: %s", text);
}

/* A frame the current call cannot receive: the guest broke the protocol. */
static enum kiln_err protocol_violation(struct agent *a, const char *what, struct kiln_error *err)
{
	mark_dead(a, what);
	return dead_error(a, err);
}

/* Turns a call_next() failure into the call's error. */
static enum kiln_err wait_error(struct agent *a, int rc, struct kiln_error *err)
{
	if (rc == -ETIMEDOUT)
		mark_dead(a, "guest stopped answering");
	return dead_error(a, err);
}

struct agent *agent_open_fd(int fd, struct kiln_error *err)
{
	struct agent *a = calloc(1, sizeof(*a));

	if (!a) {
		close(fd);
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	a->fd = fd;
	a->io_timeout_ms = AGENT_DEFAULT_IO_TIMEOUT_MS;
	pthread_mutex_init(&a->lock, NULL);
	pthread_mutex_init(&a->wlock, NULL);
	pthread_cond_init(&a->space, NULL);
	fcntl(fd, F_SETFD, FD_CLOEXEC);
	if (pthread_create(&a->reader, NULL, reader_main, a) != 0) {
		kiln_error_set(err, KILN_E_NOMEM, "cannot start the agent reader thread");
		agent_free(a);
		return NULL;
	}
	a->reader_started = true;
	return a;
}

struct agent *agent_connect(const char *sock_path, int timeout_ms, struct kiln_error *err)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int64_t deadline = mono_ms() + timeout_ms;
	int fd;

	if (strlen(sock_path) >= sizeof(sa.sun_path)) {
		kiln_error_set(err, KILN_E_INVALID, "agent socket path too long: '%s'", sock_path);
		return NULL;
	}
	memcpy(sa.sun_path, sock_path, strlen(sock_path) + 1);
	for (;;) {
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd < 0) {
			kiln_error_set(err, KILN_E_IO, "socket: %s", strerror(errno));
			return NULL;
		}
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			return agent_open_fd(fd, err);
		int e = errno;

		close(fd);
		if ((e != ENOENT && e != ECONNREFUSED && e != EAGAIN) || mono_ms() >= deadline) {
			kiln_error_set(err, KILN_E_UNAVAILABLE, "cannot connect to '%s': %s",
				       sock_path, strerror(e));
			return NULL;
		}
		usleep(20000);
	}
}

bool agent_alive(struct agent *a)
{
	pthread_mutex_lock(&a->lock);
	bool alive = !a->dead;

	pthread_mutex_unlock(&a->lock);
	return alive;
}

void agent_free(struct agent *a)
{
	if (!a)
		return;
	mark_dead(a, "connection closed by the host");
	if (a->reader_started)
		pthread_join(a->reader, NULL);
	close(a->fd);
	while (a->calls)
		call_end(a, a->calls);
	pthread_cond_destroy(&a->space);
	pthread_mutex_destroy(&a->wlock);
	pthread_mutex_destroy(&a->lock);
	free(a);
}

enum kiln_err agent_hello(struct agent *a, int timeout_ms, struct agent_hello_info *out,
			  struct kiln_error *err)
{
	struct call *c = call_begin(a);
	struct frame *f = NULL;
	uint8_t payload[2];
	struct agent_wr w;
	enum kiln_err rc;
	int wrc;

	if (!c)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u16(&w, AGENT_PROTO_VERSION);
	pthread_mutex_lock(&a->lock);
	uint16_t flags = a->hello_sent ? 0 : AGENT_HELLO_F_NEW_SESSION;

	a->hello_sent = true;
	pthread_mutex_unlock(&a->lock);
	rc = send_frame(a, AGENT_T_HELLO, flags, c->id, payload, w.len, err);
	if (rc)
		goto cleanup;
	wrc = call_next(a, c, mono_ms() + timeout_ms, &f);
	if (wrc < 0) {
		rc = wait_error(a, wrc, err);
		goto cleanup;
	}
	if (f->type == AGENT_T_ERROR) {
		rc = guest_error(a, f, err);
		goto cleanup;
	}
	struct agent_hello_msg m;

	if (f->type != AGENT_T_HELLO_OK || agent_parse_hello_ok(f->data, f->len, &m) < 0) {
		rc = protocol_violation(a, "malformed hello reply", err);
		goto cleanup;
	}
	if (m.version != AGENT_PROTO_VERSION) {
		rc = kiln_error_set(err, KILN_E_SANDBOX_FAILED, "guest agent speaks protocol %u, not %u",
				    m.version, AGENT_PROTO_VERSION);
		goto cleanup;
	}
	char version[48];

	sanitize(version, sizeof(version), m.agent_version.p, m.agent_version.len);
	pthread_mutex_lock(&a->lock);
	a->agent_major = agent_version_major(version);
	pthread_mutex_unlock(&a->lock);
	if (out) {
		out->version = m.version;
		sanitize(out->kernel_release, sizeof(out->kernel_release), m.kernel_release.p,
			 m.kernel_release.len);
		sanitize(out->boot_id, sizeof(out->boot_id), m.boot_id.p, m.boot_id.len);
		sanitize(out->agent_version, sizeof(out->agent_version), m.agent_version.p,
			 m.agent_version.len);
		out->uptime_ms = m.uptime_ms;
	}
	rc = KILN_OK;
cleanup:
	free(f);
	call_end(a, c);
	return rc;
}

/* Encodes an EXEC payload into `w`; returns false when the request is malformed. */
static bool encode_exec(struct agent_wr *w, const struct agent_exec_req *req, size_t argc,
			size_t envc)
{
	agent_wr_u32(w, req->timeout_ms);
	agent_wr_str(w, req->cwd ? req->cwd : "");
	if (req->shell) {
		agent_wr_u32(w, 1);
		agent_wr_str(w, req->shell);
	} else {
		agent_wr_u32(w, (uint32_t)argc);
		for (size_t i = 0; i < argc; i++)
			agent_wr_str(w, req->argv[i]);
	}
	agent_wr_u32(w, (uint32_t)envc);
	for (size_t i = 0; i < envc; i++)
		agent_wr_str(w, req->env[i]);
	agent_wr_bytes(w, req->stdin_data, req->stdin_len);
	if (req->user)	/* absent means root: agents older than the field take the frame */
		agent_wr_str(w, req->user);
	return !w->overflow;
}

/* Checks an exec request's fields and counts argv and env; KILN_OK or KILN_E_INVALID. */
static enum kiln_err exec_check(const struct agent_exec_req *req, size_t *argcp, size_t *envcp,
				struct kiln_error *err)
{
	size_t argc = 0, envc = 0;

	if (!req->shell)
		while (req->argv && req->argv[argc])
			argc++;
	while (req->env && req->env[envc])
		envc++;
	if ((!req->shell && (argc == 0 || !req->argv[0][0])) || argc > AGENT_MAX_ARGS)
		return kiln_error_set(err, KILN_E_INVALID, "exec needs a program (argv[0]) or shell code");
	if (envc > AGENT_MAX_ENV)
		return kiln_error_set(err, KILN_E_INVALID, "too many env entries");
	for (size_t i = 0; i < envc; i++)
		if (!agent_env_ok(req->env[i], strlen(req->env[i])))
			return kiln_error_set(err, KILN_E_INVALID, "env entry %zu is not NAME=value", i);
	if (req->cwd && !agent_path_ok(req->cwd, strlen(req->cwd)))
		return kiln_error_set(err, KILN_E_INVALID, "cwd must be an absolute path");
	if (req->user && !agent_user_ok(req->user, strlen(req->user)))
		return kiln_error_set(err, KILN_E_INVALID, "user must be a user name");
	*argcp = argc;
	*envcp = envc;
	return KILN_OK;
}

/*
 * One frame of a process's stream, after its exec or its attach was accepted: output counted in
 * `res` and handed to on_output (a consumer that stops cancels the call), the EXIT recorded in
 * `res`. Returns true to read on; false when the call is over, with *rc KILN_OK at the EXIT or an
 * error in `err`. `who` names the consumer and `during` the call in messages.
 */
static bool stream_frame(struct agent *a, struct call *c, const struct frame *f,
			 agent_output_fn on_output, void *ctx, struct agent_exec_result *res,
			 const char *who, const char *during, enum kiln_err *rc, struct kiln_error *err)
{
	if (f->type == AGENT_T_STDOUT || f->type == AGENT_T_STDERR) {
		enum agent_stream s = f->type == AGENT_T_STDOUT ? AGENT_STDOUT : AGENT_STDERR;

		*(s == AGENT_STDOUT ? &res->stdout_bytes : &res->stderr_bytes) += f->len;
		if (on_output && f->len && on_output(ctx, s, f->data, f->len) != 0) {
			send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
			*rc = kiln_error_set(err, KILN_E_IO, "%s consumer stopped", who);
			return false;
		}
		return true;
	}
	if (f->type == AGENT_T_EXIT) {
		struct agent_exit_msg m;

		if (agent_parse_exit(f->data, f->len, &m) < 0) {
			*rc = protocol_violation(a, "malformed exit frame", err);
			return false;
		}
		res->exit_code = m.exit_code;
		res->signal = (int)m.signal;
		res->timed_out = m.timed_out;
		res->duration_ms = m.duration_ms;
		*rc = KILN_OK;
		return false;
	}
	if (f->type == AGENT_T_ERROR) {
		*rc = guest_error(a, f, err);
		return false;
	}
	char why[64];

	snprintf(why, sizeof(why), "unexpected frame during %s", during);
	*rc = protocol_violation(a, why, err);
	return false;
}

enum kiln_err agent_exec(struct agent *a, const struct agent_exec_req *req,
			 agent_output_fn on_output, void *ctx, struct agent_exec_result *res,
			 struct kiln_error *err)
{
	struct call *c = NULL;
	struct frame *f = NULL;
	uint8_t *payload = NULL;
	struct agent_wr w;
	size_t argc = 0, envc = 0;
	enum kiln_err rc;

	memset(res, 0, sizeof(*res));
	if ((rc = exec_check(req, &argc, &envc, err)))
		return rc;
	agent_wr_init(&w, NULL, 0);
	encode_exec(&w, req, argc, envc);
	if (w.len > AGENT_MAX_PAYLOAD)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "exec request of %zu bytes over the %u cap",
				      w.len, AGENT_MAX_PAYLOAD);
	payload = malloc(w.len);
	c = call_begin(a);
	if (!payload || !c) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto cleanup;
	}
	agent_wr_init(&w, payload, w.len);
	encode_exec(&w, req, argc, envc);
	rc = send_frame(a, AGENT_T_EXEC, req->shell ? AGENT_EXEC_F_SHELL : 0, c->id, payload, w.len,
			err);
	free(payload);
	payload = NULL;
	if (rc)
		goto cleanup;

	int64_t deadline = req->timeout_ms ? mono_ms() + req->timeout_ms + AGENT_EXEC_GRACE_MS : -1;

	for (;;) {
		int wrc = call_next(a, c, deadline, &f);

		if (wrc < 0) {
			rc = wait_error(a, wrc, err);
			goto cleanup;
		}
		if (!stream_frame(a, c, f, on_output, ctx, res, "exec output", "exec", &rc, err))
			goto cleanup;
		free(f);
		f = NULL;
	}
cleanup:
	free(f);
	free(payload);
	call_end(a, c);
	return rc;
}

/*
 * Looks, without waiting, for a frame the guest sent during a write (only ERROR is allowed).
 * Returns KILN_OK when there is none.
 */
static enum kiln_err write_check(struct agent *a, struct call *c, struct kiln_error *err)
{
	struct frame *f = NULL;
	enum kiln_err rc;
	int wrc = call_next(a, c, 0, &f);

	if (wrc == -ETIMEDOUT)
		return KILN_OK;
	if (wrc < 0)
		return dead_error(a, err);
	rc = f->type == AGENT_T_ERROR ? guest_error(a, f, err)
				      : protocol_violation(a, "unexpected frame during a write", err);
	free(f);
	return rc;
}

enum kiln_err agent_file_write(struct agent *a, const char *path, uint32_t mode,
			       agent_source_fn source, void *ctx, uint64_t max_bytes,
			       struct kiln_error *err)
{
	return agent_file_write_as(a, path, mode, NULL, source, ctx, max_bytes, err);
}

enum kiln_err agent_file_write_as(struct agent *a, const char *path, uint32_t mode,
				  const char *user, agent_source_fn source, void *ctx,
				  uint64_t max_bytes, struct kiln_error *err)
{
	struct call *c = NULL;
	struct frame *f = NULL;
	uint8_t *chunk = NULL, head[AGENT_MAX_PATH + AGENT_MAX_USER + 16];
	struct agent_wr w;
	uint64_t total = 0, acked;
	enum kiln_err rc;

	if (!path || !agent_path_ok(path, strlen(path)))
		return kiln_error_set(err, KILN_E_INVALID, "path must be absolute: '%s'",
				      path ? path : "");
	if (user && !agent_user_ok(user, strlen(user)))
		return kiln_error_set(err, KILN_E_INVALID, "user must be a user name");
	chunk = malloc(AGENT_CHUNK);
	c = call_begin(a);
	if (!chunk || !c) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto cleanup;
	}
	agent_wr_init(&w, head, sizeof(head));
	agent_wr_str(&w, path);
	agent_wr_u32(&w, mode & 07777);
	if (user)
		agent_wr_str(&w, user);
	rc = send_frame(a, AGENT_T_FILE_WRITE, 0, c->id, head, w.len, err);
	if (rc)
		goto cleanup;
	for (;;) {
		long n = source(ctx, chunk, AGENT_CHUNK);

		if (n < 0) {
			send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
			rc = kiln_error_set(err, KILN_E_IO, "reading the source: %s", strerror((int)-n));
			goto cleanup;
		}
		if (n == 0)
			break;
		total += (uint64_t)n;
		if (total > max_bytes) {
			send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
			rc = kiln_error_set(err, KILN_E_TOO_LARGE, "file over %llu bytes",
					    (unsigned long long)max_bytes);
			goto cleanup;
		}
		rc = write_check(a, c, err);
		if (rc)
			goto cleanup;
		rc = send_frame(a, AGENT_T_FILE_DATA, 0, c->id, chunk, (size_t)n, err);
		if (rc)
			goto cleanup;
	}
	rc = send_frame(a, AGENT_T_FILE_END, 0, c->id, NULL, 0, err);
	if (rc)
		goto cleanup;
	int wrc = call_next(a, c, mono_ms() + a->io_timeout_ms, &f);

	if (wrc < 0) {
		rc = wait_error(a, wrc, err);
	} else if (f->type == AGENT_T_ERROR) {
		rc = guest_error(a, f, err);
	} else if (f->type != AGENT_T_OK || agent_parse_u64(f->data, f->len, &acked) < 0 ||
		   acked != total) {
		rc = protocol_violation(a, "bad reply to a file write", err);
	} else {
		rc = KILN_OK;
	}
cleanup:
	free(f);
	free(chunk);
	call_end(a, c);
	return rc;
}

static long fd_source(void *ctx, uint8_t *buf, size_t cap)
{
	int fd = *(int *)ctx;

	for (;;) {
		ssize_t n = read(fd, buf, cap);

		if (n >= 0)
			return (long)n;
		if (errno != EINTR)
			return -errno;
	}
}

enum kiln_err agent_file_write_fd(struct agent *a, const char *path, uint32_t mode, int fd,
				  uint64_t max_bytes, struct kiln_error *err)
{
	return agent_file_write(a, path, mode, fd_source, &fd, max_bytes, err);
}

enum kiln_err agent_file_read(struct agent *a, const char *path, agent_sink_fn sink, void *ctx,
			      uint64_t max_bytes, uint64_t *size, struct kiln_error *err)
{
	return agent_file_read_as(a, path, NULL, sink, ctx, max_bytes, size, err);
}

enum kiln_err agent_file_read_as(struct agent *a, const char *path, const char *user,
				 agent_sink_fn sink, void *ctx, uint64_t max_bytes, uint64_t *size,
				 struct kiln_error *err)
{
	struct call *c = NULL;
	struct frame *f = NULL;
	uint8_t head[AGENT_MAX_PATH + AGENT_MAX_USER + 16];
	struct agent_wr w;
	uint64_t total = 0, announced;
	enum kiln_err rc;

	if (size)
		*size = 0;
	if (!path || !agent_path_ok(path, strlen(path)))
		return kiln_error_set(err, KILN_E_INVALID, "path must be absolute: '%s'",
				      path ? path : "");
	if (user && !agent_user_ok(user, strlen(user)))
		return kiln_error_set(err, KILN_E_INVALID, "user must be a user name");
	c = call_begin(a);
	if (!c)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	agent_wr_init(&w, head, sizeof(head));
	agent_wr_str(&w, path);
	if (user)
		agent_wr_str(&w, user);
	rc = send_frame(a, AGENT_T_FILE_READ, 0, c->id, head, w.len, err);
	if (rc)
		goto cleanup;
	for (;;) {
		int wrc = call_next(a, c, mono_ms() + a->io_timeout_ms, &f);

		if (wrc < 0) {
			rc = wait_error(a, wrc, err);
			goto cleanup;
		}
		if (f->type == AGENT_T_FILE_DATA) {
			total += f->len;
			if (total > max_bytes) {
				send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
				rc = kiln_error_set(err, KILN_E_TOO_LARGE, "file over %llu bytes",
						    (unsigned long long)max_bytes);
				goto cleanup;
			}
			int src = f->len ? sink(ctx, f->data, f->len) : 0;

			if (src < 0) {
				send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
				rc = kiln_error_set(err, KILN_E_IO, "writing the file: %s", strerror(-src));
				goto cleanup;
			}
		} else if (f->type == AGENT_T_FILE_END) {
			if (agent_parse_u64(f->data, f->len, &announced) < 0 || announced != total) {
				rc = protocol_violation(a, "file size does not match its data", err);
				goto cleanup;
			}
			if (size)
				*size = total;
			rc = KILN_OK;
			goto cleanup;
		} else if (f->type == AGENT_T_ERROR) {
			rc = guest_error(a, f, err);
			goto cleanup;
		} else {
			rc = protocol_violation(a, "unexpected frame during a read", err);
			goto cleanup;
		}
		free(f);
		f = NULL;
	}
cleanup:
	free(f);
	call_end(a, c);
	return rc;
}

static int fd_sink(void *ctx, const uint8_t *data, size_t len)
{
	int fd = *(int *)ctx;

	while (len > 0) {
		ssize_t n = write(fd, data, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : -EIO;
		data += n;
		len -= (size_t)n;
	}
	return 0;
}

enum kiln_err agent_file_read_fd(struct agent *a, const char *path, int fd, uint64_t max_bytes,
				 uint64_t *size, struct kiln_error *err)
{
	return agent_file_read(a, path, fd_sink, &fd, max_bytes, size, err);
}

enum kiln_err agent_set_identity(struct agent *a, const struct agent_identity *id,
				 struct kiln_error *err)
{
	struct call *c = NULL;
	struct frame *f = NULL;
	uint8_t *payload = NULL;
	struct agent_wr w;
	size_t envc = 0;
	enum kiln_err rc;
	uint64_t ignored;

	if (id->hostname && !agent_hostname_ok(id->hostname, strlen(id->hostname)))
		return kiln_error_set(err, KILN_E_INVALID, "invalid hostname");
	if (id->sandbox_id && strlen(id->sandbox_id) > AGENT_MAX_SANDBOX_ID)
		return kiln_error_set(err, KILN_E_INVALID, "sandbox id too long");
	if (id->entropy_len &&
	    (id->entropy_len < AGENT_MIN_ENTROPY || id->entropy_len > AGENT_MAX_ENTROPY))
		return kiln_error_set(err, KILN_E_INVALID, "entropy must be %d..%d bytes",
				      AGENT_MIN_ENTROPY, AGENT_MAX_ENTROPY);
	while (id->env && id->env[envc]) {
		if (!agent_env_ok(id->env[envc], strlen(id->env[envc])))
			return kiln_error_set(err, KILN_E_INVALID, "env entry %zu is not NAME=value",
					      envc);
		envc++;
	}
	if (envc > 256)
		return kiln_error_set(err, KILN_E_INVALID, "too many env defaults");
	agent_wr_init(&w, NULL, 0);
	for (int pass = 0; pass < 2; pass++) {
		if (pass == 1) {
			payload = malloc(w.len);
			if (!payload)
				return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			agent_wr_init(&w, payload, w.len);
		}
		agent_wr_str(&w, id->hostname);
		agent_wr_str(&w, id->sandbox_id);
		agent_wr_u64(&w, id->wall_clock_ns);
		agent_wr_bytes(&w, id->entropy, id->entropy_len);
		agent_wr_u32(&w, (uint32_t)envc);
		for (size_t i = 0; i < envc; i++)
			agent_wr_str(&w, id->env[i]);
	}
	if (w.overflow || w.len > AGENT_MAX_PAYLOAD) {
		rc = kiln_error_set(err, KILN_E_TOO_LARGE, "identity over the frame cap");
		goto cleanup;
	}
	c = call_begin(a);
	if (!c) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto cleanup;
	}
	rc = send_frame(a, AGENT_T_SET_IDENTITY, 0, c->id, payload, w.len, err);
	if (rc)
		goto cleanup;
	int wrc = call_next(a, c, mono_ms() + a->io_timeout_ms, &f);

	if (wrc < 0)
		rc = wait_error(a, wrc, err);
	else if (f->type == AGENT_T_ERROR)
		rc = guest_error(a, f, err);
	else if (f->type != AGENT_T_OK || agent_parse_u64(f->data, f->len, &ignored) < 0)
		rc = protocol_violation(a, "bad reply to set identity", err);
	else
		rc = KILN_OK;
cleanup:
	free(f);
	free(payload);
	call_end(a, c);
	return rc;
}

enum kiln_err agent_grow_root(struct agent *a, uint64_t min_bytes, uint32_t wait_ms,
			      uint64_t *fs_bytes, struct kiln_error *err)
{
	uint8_t payload[12];
	struct frame *f = NULL;
	struct call *c;
	struct agent_wr w;
	enum kiln_err rc;
	uint64_t size;

	if (wait_ms > AGENT_MAX_GROW_WAIT_MS)
		return kiln_error_set(err, KILN_E_INVALID, "wait over %d ms", AGENT_MAX_GROW_WAIT_MS);
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u64(&w, min_bytes);
	agent_wr_u32(&w, wait_ms);
	c = call_begin(a);
	if (!c)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = send_frame(a, AGENT_T_GROW_ROOT, 0, c->id, payload, w.len, err);
	if (rc == KILN_OK) {
		int wrc = call_next(a, c, mono_ms() + wait_ms + AGENT_GROW_GRACE_MS, &f);

		if (wrc < 0)
			rc = wait_error(a, wrc, err);
		else if (f->type == AGENT_T_ERROR)
			rc = guest_error(a, f, err);
		else if (f->type != AGENT_T_OK || agent_parse_u64(f->data, f->len, &size) < 0)
			rc = protocol_violation(a, "bad reply to grow root", err);
		else if (fs_bytes)
			*fs_bytes = size;
	}
	free(f);
	call_end(a, c);
	return rc;
}

/* --- port streams --- */

struct agent_port {
	struct agent *a;
	struct call *c;
	struct frame *cur;	/* the data frame being read */
	size_t cur_off;
	bool rd_end;		/* the guest's side ended (STREAM_END or ERROR) */
	bool wr_end;		/* STREAM_END sent */
	bool broken;		/* a failure: close() cancels */
};

enum kiln_err agent_port_open(struct agent *a, uint16_t port, int timeout_ms,
			      struct agent_port **out, struct kiln_error *err)
{
	struct agent_port *p = NULL;
	struct frame *f = NULL;
	struct call *c = NULL;
	uint8_t payload[2];
	struct agent_wr w;
	enum kiln_err rc;
	unsigned major;
	int wrc;

	*out = NULL;
	if (port == 0)
		return kiln_error_set(err, KILN_E_INVALID, "port 0");
	pthread_mutex_lock(&a->lock);
	major = a->agent_major;
	pthread_mutex_unlock(&a->lock);
	if (major < AGENT_PORT_STREAMS_MIN_VERSION)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED,
				      "the sandbox's agent predates port streams");
	p = calloc(1, sizeof(*p));
	c = p ? call_begin(a) : NULL;
	if (!c) {
		free(p);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	pthread_mutex_lock(&a->lock);
	c->stream = true;
	c->credit = AGENT_STREAM_WINDOW;
	pthread_mutex_unlock(&a->lock);
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u16(&w, port);
	rc = send_frame(a, AGENT_T_PORT_OPEN, 0, c->id, payload, w.len, err);
	if (rc)
		goto fail;
	wrc = call_next(a, c, mono_ms() + timeout_ms, &f);
	if (wrc == -ETIMEDOUT) {
		send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
		rc = kiln_error_set(err, KILN_E_PORT_TIMEOUT, "port %u did not accept in %d ms",
				    port, timeout_ms);
		goto fail;
	}
	if (wrc < 0) {
		rc = wait_error(a, wrc, err);
		goto fail;
	}
	if (f->type == AGENT_T_ERROR) {
		struct agent_error_msg m;

		if (agent_parse_error(f->data, f->len, &m) == 0 && m.status == AGENT_S_REFUSED)
			rc = kiln_error_set(err, KILN_E_PORT_CLOSED, "nothing listens on port %u",
					    port);
		else
			rc = guest_error(a, f, err);
		goto fail;
	}
	uint64_t zero;

	if (f->type != AGENT_T_OK || agent_parse_u64(f->data, f->len, &zero) < 0) {
		rc = protocol_violation(a, "bad reply to a port open", err);
		goto fail;
	}
	free(f);
	p->a = a;
	p->c = c;
	*out = p;
	return KILN_OK;
fail:
	free(f);
	call_end(a, c);
	free(p);
	return rc;
}

/* Acknowledges `len` bytes the caller consumed, so the guest may send as many more. */
static int port_ack(struct agent_port *p, uint32_t len)
{
	uint8_t b[4];
	struct agent_wr w;

	pthread_mutex_lock(&p->a->lock);
	p->c->inflight -= len;
	pthread_mutex_unlock(&p->a->lock);
	agent_wr_init(&w, b, sizeof(b));
	agent_wr_u32(&w, len);
	return send_frame(p->a, AGENT_T_STREAM_WINDOW, 0, p->c->id, b, w.len, NULL) ? -EPIPE : 0;
}

ssize_t agent_port_read(struct agent_port *p, void *buf, size_t cap, int timeout_ms)
{
	struct agent *a = p->a;
	struct call *c = p->c;
	int64_t deadline = timeout_ms < 0 ? -1 : mono_ms() + timeout_ms;
	struct frame *f;

	for (;;) {
		if (p->cur) {
			size_t n = p->cur->len - p->cur_off;

			if (n > cap)
				n = cap;
			memcpy(buf, p->cur->data + p->cur_off, n);
			p->cur_off += n;
			if (p->cur_off == p->cur->len) {
				uint32_t len = p->cur->len;

				free(p->cur);
				p->cur = NULL;
				if (len && port_ack(p, len) < 0) {
					p->broken = true;
					return -EPIPE;
				}
			}
			if (n > 0)
				return (ssize_t)n;
			continue;
		}
		if (p->rd_end)
			return 0;
		pthread_mutex_lock(&a->lock);
		while (!c->head && !a->dead && !c->aborted) {
			if (deadline >= 0 && mono_ms() >= deadline) {
				pthread_mutex_unlock(&a->lock);
				return -ETIMEDOUT;
			}
			if (deadline < 0) {
				pthread_cond_wait(&c->cond, &a->lock);
			} else {
				struct timespec ts = { (time_t)(deadline / 1000),
						       (long)(deadline % 1000) * 1000000 };

				pthread_cond_timedwait(&c->cond, &a->lock, &ts);
			}
		}
		if (c->aborted || !c->head) {
			bool aborted = c->aborted;

			pthread_mutex_unlock(&a->lock);
			p->broken = true;
			return aborted ? -ECANCELED : -EPIPE;
		}
		f = c->head;
		c->head = f->next;
		if (!c->head)
			c->tail = NULL;
		c->queued -= f->len;
		pthread_mutex_unlock(&a->lock);
		switch (f->type) {
		case AGENT_T_STREAM_DATA:
			p->cur = f;
			p->cur_off = 0;
			continue;
		case AGENT_T_STREAM_END: {
			uint32_t flen = f->len;

			free(f);
			if (flen != 0) {
				mark_dead(a, "malformed stream end");
				p->broken = true;
				return -EPIPE;
			}
			p->rd_end = true;
			return 0;
		}
		case AGENT_T_ERROR:
			free(f);
			p->rd_end = true;
			p->broken = true;
			return -ECONNRESET;
		default:
			free(f);
			mark_dead(a, "unexpected frame in a port stream");
			p->broken = true;
			return -EPIPE;
		}
	}
}

int agent_port_write(struct agent_port *p, const void *data, size_t len)
{
	struct agent *a = p->a;
	struct call *c = p->c;
	const uint8_t *d = data;

	if (p->wr_end)
		return -EPIPE;
	while (len > 0) {
		uint32_t chunk;
		int rc = 0;

		pthread_mutex_lock(&a->lock);
		while (c->credit == 0 && !a->dead && !c->aborted && !c->failed)
			pthread_cond_wait(&c->cond, &a->lock);
		if (a->dead)
			rc = -EPIPE;
		else if (c->aborted)
			rc = -ECANCELED;
		else if (c->failed)
			rc = -ECONNRESET;
		chunk = len < AGENT_CHUNK ? (uint32_t)len : AGENT_CHUNK;
		if (chunk > c->credit)
			chunk = c->credit;
		if (rc == 0)
			c->credit -= chunk;
		pthread_mutex_unlock(&a->lock);
		if (rc == 0 && send_frame(a, AGENT_T_STREAM_DATA, 0, c->id, d, chunk, NULL))
			rc = -EPIPE;
		if (rc < 0)
			return rc;
		d += chunk;
		len -= chunk;
	}
	return 0;
}

int agent_port_shutdown(struct agent_port *p)
{
	if (p->wr_end)
		return 0;
	p->wr_end = true;
	return send_frame(p->a, AGENT_T_STREAM_END, 0, p->c->id, NULL, 0, NULL) ? -EPIPE : 0;
}

void agent_port_abort(struct agent_port *p)
{
	pthread_mutex_lock(&p->a->lock);
	p->c->aborted = true;
	pthread_cond_broadcast(&p->c->cond);
	pthread_mutex_unlock(&p->a->lock);
}

void agent_port_close(struct agent_port *p)
{
	bool cancel;

	if (!p)
		return;
	pthread_mutex_lock(&p->a->lock);
	cancel = p->c->aborted || p->c->failed || !p->rd_end || !p->wr_end || p->broken;
	cancel = cancel && !p->a->dead;
	pthread_mutex_unlock(&p->a->lock);
	if (cancel)
		send_frame(p->a, AGENT_T_CANCEL, 0, p->c->id, NULL, 0, NULL);
	free(p->cur);
	call_end(p->a, p->c);
	free(p);
}

/* --- detached processes (version 3) --- */

/* KILN_OK when the agent is of version `min` or later (it serves `what`); refuses before anything
 * is sent otherwise, since an older agent's decoder would end the session. */
static enum kiln_err version_at_least(struct agent *a, unsigned min, const char *what,
				      struct kiln_error *err)
{
	unsigned major;

	pthread_mutex_lock(&a->lock);
	major = a->agent_major;
	pthread_mutex_unlock(&a->lock);
	if (major < min)
		return kiln_error_set(err, KILN_E_NOT_IMPLEMENTED,
				      "the sandbox's agent (version %u) predates %s (version %u): "
				      "recreate the sandbox from a current image", major, what, min);
	return KILN_OK;
}

/* KILN_OK when the agent serves the PROC_* frames. */
static enum kiln_err procs_supported(struct agent *a, struct kiln_error *err)
{
	return version_at_least(a, AGENT_PROCS_MIN_VERSION, "processes", err);
}

/*
 * Waits until `deadline` for call c's next frame: KILN_OK with *f (the caller frees it) when it is
 * not an ERROR, the ERROR's code, or the wait's failure (*f NULL then).
 */
static enum kiln_err next_reply(struct agent *a, struct call *c, int64_t deadline,
				struct frame **f, struct kiln_error *err)
{
	int wrc = call_next(a, c, deadline, f);
	enum kiln_err rc;

	if (wrc < 0) {
		*f = NULL;
		return wait_error(a, wrc, err);
	}
	if ((*f)->type != AGENT_T_ERROR)
		return KILN_OK;
	rc = guest_error(a, *f, err);
	free(*f);
	*f = NULL;
	return rc;
}

/*
 * Sends one request and waits (the io timeout) for its OK, whose value goes to *v (may be NULL),
 * or its ERROR. Any other frame breaks the protocol.
 */
static enum kiln_err simple_call(struct agent *a, uint8_t type, uint16_t flags, const void *payload,
				 size_t len, uint64_t *v, struct kiln_error *err)
{
	struct call *c = call_begin(a);
	struct frame *f = NULL;
	enum kiln_err rc;
	uint64_t val;

	if (!c)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = send_frame(a, type, flags, c->id, payload, len, err);
	if (rc || (rc = next_reply(a, c, mono_ms() + a->io_timeout_ms, &f, err)))
		goto cleanup;
	if (f->type != AGENT_T_OK || agent_parse_u64(f->data, f->len, &val) < 0) {
		rc = protocol_violation(a, "bad reply to a request", err);
	} else {
		if (v)
			*v = val;
		rc = KILN_OK;
	}
cleanup:
	free(f);
	call_end(a, c);
	return rc;
}

enum kiln_err agent_proc_start(struct agent *a, const struct agent_proc_req *req, uint32_t *pid,
			       struct kiln_error *err)
{
	const struct agent_exec_req *x = &req->exec;
	size_t argc = 0, envc = 0;
	uint8_t *payload = NULL;
	struct agent_wr w;
	enum kiln_err rc;
	uint64_t v = 0;
	bool pty = req->rows || req->cols;
	uint16_t flags = AGENT_EXEC_F_DETACHED | (x->shell ? AGENT_EXEC_F_SHELL : 0) |
			 (pty ? AGENT_EXEC_F_PTY : 0);

	*pid = 0;
	if ((rc = procs_supported(a, err)) || (rc = exec_check(x, &argc, &envc, err)))
		return rc;
	if (req->tag && (strlen(req->tag) > AGENT_MAX_TAG))
		return kiln_error_set(err, KILN_E_INVALID, "a tag is at most %d bytes", AGENT_MAX_TAG);
	if (pty && (req->rows < 1 || req->rows > AGENT_PROC_PTY_MAX || req->cols < 1 ||
		    req->cols > AGENT_PROC_PTY_MAX))
		return kiln_error_set(err, KILN_E_INVALID, "a PTY's rows and cols are 1..%d",
				      AGENT_PROC_PTY_MAX);
	for (int pass = 0; pass < 2; pass++) {
		agent_wr_init(&w, payload, payload ? w.len : 0);
		agent_wr_u32(&w, x->timeout_ms);
		agent_wr_str(&w, x->cwd ? x->cwd : "");
		if (x->shell) {
			agent_wr_u32(&w, 1);
			agent_wr_str(&w, x->shell);
		} else {
			agent_wr_u32(&w, (uint32_t)argc);
			for (size_t i = 0; i < argc; i++)
				agent_wr_str(&w, x->argv[i]);
		}
		agent_wr_u32(&w, (uint32_t)envc);
		for (size_t i = 0; i < envc; i++)
			agent_wr_str(&w, x->env[i]);
		agent_wr_bytes(&w, x->stdin_data, x->stdin_len);
		agent_wr_str(&w, x->user ? x->user : "");
		agent_wr_str(&w, req->tag ? req->tag : "");
		agent_wr_u16(&w, req->rows);
		agent_wr_u16(&w, req->cols);
		if (pass == 0) {
			if (w.len > AGENT_MAX_PAYLOAD)
				return kiln_error_set(err, KILN_E_TOO_LARGE,
						      "process request of %zu bytes over the %u cap",
						      w.len, AGENT_MAX_PAYLOAD);
			if (!(payload = malloc(w.len)))
				return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		}
	}
	rc = simple_call(a, AGENT_T_EXEC, flags, payload, w.len, &v, err);
	free(payload);
	if (rc == KILN_OK && (v == 0 || v > 0x7fffffff))
		rc = protocol_violation(a, "bad pid from the guest", err);
	if (rc == KILN_OK)
		*pid = (uint32_t)v;
	return rc;
}

enum kiln_err agent_proc_attach(struct agent *a, uint32_t pid, bool replay,
				agent_output_fn on_output, void *ctx, uint64_t *dropped,
				struct agent_exec_result *res, struct kiln_error *err)
{
	struct call *c = NULL;
	struct frame *f = NULL;
	uint8_t payload[5];
	struct agent_wr w;
	enum kiln_err rc;
	bool acked = false;
	int64_t deadline;

	memset(res, 0, sizeof(*res));
	if (dropped)
		*dropped = 0;
	if ((rc = procs_supported(a, err)))
		return rc;
	if (!(c = call_begin(a)))
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u32(&w, pid);
	agent_wr_u8(&w, replay ? 1 : 0);
	rc = send_frame(a, AGENT_T_PROC_ATTACH, 0, c->id, payload, w.len, err);
	if (rc)
		goto cleanup;
	deadline = mono_ms() + a->io_timeout_ms;
	for (;;) {
		int wrc = call_next(a, c, acked ? mono_ms() + 1000 : deadline, &f);

		if (wrc == -ETIMEDOUT && acked) {
			/* a second of silence: the caller may have lost its client */
			if (on_output && on_output(ctx, AGENT_STDOUT, NULL, 0) != 0) {
				send_frame(a, AGENT_T_CANCEL, 0, c->id, NULL, 0, NULL);
				rc = kiln_error_set(err, KILN_E_IO, "attach consumer stopped");
				goto cleanup;
			}
			continue;
		}
		if (wrc < 0) {
			rc = wait_error(a, wrc, err);
			goto cleanup;
		}
		if (!acked) {
			uint64_t d;

			if (f->type == AGENT_T_ERROR) {
				rc = guest_error(a, f, err);
				goto cleanup;
			}
			if (f->type != AGENT_T_OK || agent_parse_u64(f->data, f->len, &d) < 0) {
				rc = protocol_violation(a, "bad reply to an attach", err);
				goto cleanup;
			}
			if (dropped)
				*dropped = d;
			acked = true;
		} else if (!stream_frame(a, c, f, on_output, ctx, res, "attach", "an attach", &rc, err)) {
			goto cleanup;
		}
		free(f);
		f = NULL;
	}
cleanup:
	free(f);
	call_end(a, c);
	return rc;
}

/* Copies `n` strings of a list the parser checked into a NULL-terminated vector; NULL: no memory. */
static char **list_dup(const struct agent_bytes *raw, uint32_t n)
{
	char **v = calloc((size_t)n + 1, sizeof(*v));
	struct agent_rd r;

	if (!v)
		return NULL;
	agent_rd_init(&r, raw->p, raw->len);
	for (uint32_t i = 0; i < n; i++) {
		struct agent_bytes b = agent_list_next(&r);

		if (!(v[i] = strndup(b.p ? (const char *)b.p : "", b.len))) {
			for (uint32_t k = 0; k < i; k++)
				free(v[k]);
			free(v);
			return NULL;
		}
	}
	return v;
}

static void strv_free(char **v)
{
	for (size_t i = 0; v && v[i]; i++)
		free(v[i]);
	free(v);
}

enum kiln_err agent_proc_list(struct agent *a, agent_proc_fn fn, void *ctx, struct kiln_error *err)
{
	struct call *c = NULL;
	struct frame *f = NULL;
	enum kiln_err rc, nomem = KILN_OK;
	bool stop = false;
	unsigned count = 0;

	if ((rc = procs_supported(a, err)))
		return rc;
	if (!(c = call_begin(a)))
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	rc = send_frame(a, AGENT_T_PROC_LIST, 0, c->id, NULL, 0, err);
	if (rc)
		goto cleanup;
	for (;;) {
		int wrc = call_next(a, c, mono_ms() + a->io_timeout_ms, &f);
		uint64_t n;

		if (wrc < 0) {
			rc = wait_error(a, wrc, err);
			goto cleanup;
		}
		if (f->type == AGENT_T_ERROR) {
			rc = guest_error(a, f, err);
			goto cleanup;
		}
		if (f->type == AGENT_T_OK) {
			rc = agent_parse_u64(f->data, f->len, &n) < 0 || n != count
				     ? protocol_violation(a, "bad end of a process list", err)
				     : KILN_OK;
			goto cleanup;
		}
		struct agent_proc_entry_msg m;

		if (f->type != AGENT_T_PROC_ENTRY || agent_parse_proc_entry(f->data, f->len, &m) < 0 ||
		    ++count > AGENT_PROC_MAX) {
			rc = protocol_violation(a, "bad process list entry", err);
			goto cleanup;
		}
		if (!stop && fn) {
			char *tag = strndup(m.tag.p ? (const char *)m.tag.p : "", m.tag.len);
			char *cwd = strndup(m.cwd.p ? (const char *)m.cwd.p : "", m.cwd.len);
			char **argv = list_dup(&m.argv_raw, m.argc);
			char **envn = list_dup(&m.env_raw, m.envc);

			if (!tag || !cwd || !argv || !envn) {
				stop = true;
				nomem = KILN_E_NOMEM;
			} else {
				struct agent_proc_info pi = { m.pid, m.running, m.pty, m.exit_code,
							      tag, cwd, argv, envn };

				stop = fn(ctx, &pi) != 0;
			}
			free(tag);
			free(cwd);
			strv_free(argv);
			strv_free(envn);
		}
		free(f);
		f = NULL;
	}
cleanup:
	free(f);
	call_end(a, c);
	if (rc == KILN_OK && nomem)
		rc = kiln_error_set(err, nomem, "out of memory");
	return rc;
}

enum kiln_err agent_proc_signal(struct agent *a, uint32_t pid, int signo, struct kiln_error *err)
{
	uint8_t payload[8];
	struct agent_wr w;
	enum kiln_err rc;

	if ((rc = procs_supported(a, err)))
		return rc;
	if (signo < 1 || signo > 64)
		return kiln_error_set(err, KILN_E_INVALID, "signal %d is not 1..64", signo);
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u32(&w, pid);
	agent_wr_u32(&w, (uint32_t)signo);
	return simple_call(a, AGENT_T_PROC_SIGNAL, 0, payload, w.len, NULL, err);
}

enum kiln_err agent_proc_stdin(struct agent *a, uint32_t pid, const void *data, size_t len,
			       bool eof, struct kiln_error *err)
{
	uint8_t payload[9 + AGENT_PROC_STDIN_CHUNK];
	struct agent_wr w;
	enum kiln_err rc;

	if ((rc = procs_supported(a, err)))
		return rc;
	if (len > AGENT_PROC_STDIN_CHUNK)
		return kiln_error_set(err, KILN_E_TOO_LARGE, "stdin of %zu bytes at once over the %u cap",
				      len, AGENT_PROC_STDIN_CHUNK);
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u32(&w, pid);
	agent_wr_u8(&w, eof ? 1 : 0);
	agent_wr_bytes(&w, data, len);
	return simple_call(a, AGENT_T_PROC_STDIN, 0, payload, w.len, NULL, err);
}

enum kiln_err agent_proc_resize(struct agent *a, uint32_t pid, uint16_t rows, uint16_t cols,
				struct kiln_error *err)
{
	uint8_t payload[8];
	struct agent_wr w;
	enum kiln_err rc;

	if ((rc = procs_supported(a, err)))
		return rc;
	if (rows < 1 || rows > AGENT_PROC_PTY_MAX || cols < 1 || cols > AGENT_PROC_PTY_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "a PTY's rows and cols are 1..%d",
				      AGENT_PROC_PTY_MAX);
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u32(&w, pid);
	agent_wr_u16(&w, rows);
	agent_wr_u16(&w, cols);
	return simple_call(a, AGENT_T_PROC_RESIZE, 0, payload, w.len, NULL, err);
}

/* --- directory watches (version 4) --- */

enum kiln_err agent_watch_add(struct agent *a, const char *path, bool recursive, const char *user,
			      uint32_t *wid, struct kiln_error *err)
{
	uint8_t payload[1 + 4 + AGENT_MAX_PATH + 4 + AGENT_MAX_USER];
	struct agent_wr w;
	enum kiln_err rc;
	uint64_t v = 0;

	*wid = 0;
	if ((rc = version_at_least(a, AGENT_WATCH_MIN_VERSION, "directory watches", err)))
		return rc;
	if (!path || !agent_path_ok(path, strlen(path)))
		return kiln_error_set(err, KILN_E_INVALID, "a watch's path must be absolute");
	if (user && !agent_user_ok(user, strlen(user)))
		return kiln_error_set(err, KILN_E_INVALID, "bad user name");
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u8(&w, recursive ? 1 : 0);
	agent_wr_str(&w, path);
	if (user)
		agent_wr_str(&w, user);	/* none: root */
	rc = simple_call(a, AGENT_T_WATCH_ADD, 0, payload, w.len, &v, err);
	if (rc == KILN_OK && (v == 0 || v > UINT32_MAX))
		rc = protocol_violation(a, "bad watch id from the guest", err);
	if (rc == KILN_OK)
		*wid = (uint32_t)v;
	return rc;
}

_Static_assert(AGENT_WATCH_WAIT_MS_MAX == AGENT_WATCH_WAIT_MAX_MS, "the guest's wait cap");

enum kiln_err agent_watch_read(struct agent *a, uint32_t wid, uint32_t wait_ms, agent_watch_fn fn,
			       void *ctx, bool *dropped, bool *ended, struct kiln_error *err)
{
	struct agent_watch_events_msg m;
	struct call *c = NULL;
	struct frame *f = NULL;
	uint8_t payload[8];
	struct agent_wr w;
	struct agent_rd r;
	enum kiln_err rc;
	int wrc;

	*dropped = *ended = false;
	if ((rc = version_at_least(a, AGENT_WATCH_MIN_VERSION, "directory watches", err)))
		return rc;
	if (wait_ms > AGENT_WATCH_WAIT_MAX_MS)
		return kiln_error_set(err, KILN_E_INVALID, "a watch's wait is at most %d ms",
				      AGENT_WATCH_WAIT_MAX_MS);
	if (!(c = call_begin(a)))
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u32(&w, wid);
	agent_wr_u32(&w, wait_ms);
	rc = send_frame(a, AGENT_T_WATCH_READ, 0, c->id, payload, w.len, err);
	if (rc || (rc = next_reply(a, c, mono_ms() + wait_ms + a->io_timeout_ms, &f, err)))
		goto cleanup;
	if (f->type != AGENT_T_WATCH_EVENTS || agent_parse_watch_events(f->data, f->len, &m) < 0) {
		rc = protocol_violation(a, "bad reply to a watch read", err);
		goto cleanup;
	}
	*dropped = (m.flags & AGENT_WATCH_F_DROPPED) != 0;
	*ended = (m.flags & AGENT_WATCH_F_ENDED) != 0;
	agent_rd_init(&r, m.events_raw.p, m.events_raw.len);
	for (uint32_t i = 0; i < m.count; i++) {
		struct agent_bytes name;
		int type = agent_watch_next(&r, &name);
		char *text = strndup((const char *)name.p, name.len);

		if (!text) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			goto cleanup;
		}
		wrc = fn ? fn(ctx, type, text) : 0;
		free(text);
		if (wrc)
			break;
	}
cleanup:
	free(f);
	call_end(a, c);
	return rc;
}

enum kiln_err agent_watch_remove(struct agent *a, uint32_t wid, struct kiln_error *err)
{
	uint8_t payload[4];
	struct agent_wr w;
	enum kiln_err rc;

	if ((rc = version_at_least(a, AGENT_WATCH_MIN_VERSION, "directory watches", err)))
		return rc;
	agent_wr_init(&w, payload, sizeof(payload));
	agent_wr_u32(&w, wid);
	return simple_call(a, AGENT_T_WATCH_REMOVE, 0, payload, w.len, NULL, err);
}
