/*
 * ports.c - kiln-agent's port streams: PORT_OPEN connects to 127.0.0.1:PORT inside the guest and
 * carries bytes both ways as STREAM_DATA frames, so servers in the sandbox are reached through the
 * agent's channel and never over the guest's network.
 *
 * Flow control is by window (AGENT_STREAM_WINDOW bytes each way): the agent sends at most `credit`
 * bytes the host has not acknowledged with STREAM_WINDOW, and reads the socket only while it has
 * credit and room in the output queue; the host sends at most a window of bytes the agent has not
 * acknowledged, which the agent buffers until the socket takes them and then acknowledges. So a
 * stream holds at most one window of the agent's memory, and a slow server or a slow client slows
 * its own stream only. STREAM_END is a half-close either way; the stream is forgotten once both
 * sides ended and the buffered bytes were written, or at once on an error (ERROR frame) or CANCEL.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent.h"

struct pstream {
	uint32_t id;		/* 0: the slot is free */
	int fd;			/* non-blocking TCP socket to 127.0.0.1:port */
	bool connecting;	/* connect() in progress: OK not sent yet */
	bool rd_eof;		/* the server ended its side: STREAM_END sent */
	bool host_end;		/* the host ended its side */
	bool wr_shut;		/* shutdown(SHUT_WR) done */
	uint32_t credit;	/* bytes the agent may still send to the host */
	uint8_t *in;		/* the host's bytes waiting for the socket (AGENT_STREAM_WINDOW) */
	size_t in_off, in_len;
	int pfd_index;		/* its entry in the last poll set, or -1 */
};

static struct pstream streams[AGENT_MAX_PORTS];

static struct pstream *find(uint32_t id)
{
	for (int i = 0; i < AGENT_MAX_PORTS; i++)
		if (streams[i].id == id && id != 0)
			return &streams[i];
	return NULL;
}

/* Forgets a stream, closing its socket (with a reset when `abort` and bytes are unsent). */
static void drop(struct pstream *ps, bool abort)
{
	if (ps->fd >= 0) {
		if (abort) {
			struct linger l = { 1, 0 };

			setsockopt(ps->fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
		}
		close(ps->fd);
	}
	free(ps->in);
	memset(ps, 0, sizeof(*ps));
	ps->fd = -1;
}

/* Reports a failed stream to the host and forgets it. */
static void fail(struct session *s, struct pstream *ps, enum agent_status st, int err,
		 const char *what)
{
	session_error(s, ps->id, st, err, "%s: %s", what, strerror(err));
	drop(ps, true);
}

bool port_active(uint32_t id)
{
	return find(id) != NULL;
}

void port_open(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct pstream *ps = NULL;
	uint16_t port;
	int one = 1;

	if (agent_parse_u16(p, len, &port) < 0 || port == 0) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed port request");
		return;
	}
	for (int i = 0; i < AGENT_MAX_PORTS && !ps; i++)
		if (streams[i].id == 0)
			ps = &streams[i];
	if (!ps) {
		session_error(s, id, AGENT_S_BUSY, 0, "too many port streams (%d)", AGENT_MAX_PORTS);
		return;
	}
	memset(ps, 0, sizeof(*ps));
	ps->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (ps->fd < 0) {
		session_error(s, id, AGENT_S_INTERNAL, errno, "socket: %s", strerror(errno));
		ps->fd = -1;
		return;
	}
	ps->id = id;
	ps->credit = AGENT_STREAM_WINDOW;
	ps->pfd_index = -1;
	setsockopt(ps->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	sa.sin_port = htons(port);
	if (connect(ps->fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
		session_send(s, AGENT_T_OK, 0, id, "\0\0\0\0\0\0\0\0", 8);
		return;
	}
	if (errno == EINPROGRESS) {
		ps->connecting = true;
		return;
	}
	if (errno == ECONNREFUSED)
		fail(s, ps, AGENT_S_REFUSED, errno, "nothing listens on the port");
	else
		fail(s, ps, AGENT_S_IO, errno, "connect");
}

/* Half-closes the socket once the host ended and every byte it sent was written. */
static void maybe_shut(struct pstream *ps)
{
	if (ps->host_end && !ps->wr_shut && ps->in_off == ps->in_len && !ps->connecting) {
		shutdown(ps->fd, SHUT_WR);
		ps->wr_shut = true;
	}
}

/* Forgets a stream both sides ended. */
static void maybe_done(struct pstream *ps)
{
	if (ps->rd_eof && ps->wr_shut)
		drop(ps, false);
}

void port_data(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct pstream *ps = find(id);

	if (!ps)
		return;	/* after an ERROR or a CANCEL: ignored */
	if (ps->host_end || ps->in_len - ps->in_off + len > AGENT_STREAM_WINDOW) {
		fail(s, ps, AGENT_S_PROTO, EPROTO, "data past the stream's end or window");
		return;
	}
	if (!ps->in) {
		ps->in = malloc(AGENT_STREAM_WINDOW);
		if (!ps->in) {
			fail(s, ps, AGENT_S_INTERNAL, ENOMEM, "stream buffer");
			return;
		}
	}
	if (ps->in_len + len > AGENT_STREAM_WINDOW) {
		memmove(ps->in, ps->in + ps->in_off, ps->in_len - ps->in_off);
		ps->in_len -= ps->in_off;
		ps->in_off = 0;
	}
	memcpy(ps->in + ps->in_len, p, len);
	ps->in_len += len;
}

void port_window(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct pstream *ps = find(id);
	uint32_t more;

	if (!ps)
		return;
	if (agent_parse_u32(p, len, &more) < 0 ||
	    (uint64_t)ps->credit + more > AGENT_STREAM_WINDOW) {
		fail(s, ps, AGENT_S_PROTO, EPROTO, "bad stream window");
		return;
	}
	ps->credit += more;
}

void port_end(struct session *s, uint32_t id)
{
	struct pstream *ps = find(id);

	(void)s;
	if (!ps)
		return;
	ps->host_end = true;
	maybe_shut(ps);
	maybe_done(ps);
}

void port_cancel(uint32_t id)
{
	struct pstream *ps = find(id);

	if (ps)
		drop(ps, true);
}

int port_poll_fill(struct session *s, struct pollfd *pfd, int max)
{
	int n = 0;

	for (int i = 0; i < AGENT_MAX_PORTS; i++) {
		struct pstream *ps = &streams[i];
		short ev = 0;

		ps->pfd_index = -1;
		if (!ps->id)
			continue;
		if (ps->connecting) {
			ev = POLLOUT;
		} else {
			if (!ps->rd_eof && ps->credit > 0 && session_has_room(s))
				ev |= POLLIN;
			if (ps->in_off < ps->in_len)
				ev |= POLLOUT;
		}
		if (!ev || n >= max)
			continue;
		pfd[n] = (struct pollfd){ ps->fd, ev, 0 };
		ps->pfd_index = n++;
	}
	return n;
}

/* Writes what the host sent; acknowledges what the socket took. */
static void pump_in(struct session *s, struct pstream *ps)
{
	ssize_t n = write(ps->fd, ps->in + ps->in_off, ps->in_len - ps->in_off);
	uint8_t ack[4];

	if (n < 0) {
		if (errno != EAGAIN && errno != EINTR)
			fail(s, ps, AGENT_S_IO, errno, "write to the port");
		return;
	}
	ps->in_off += (size_t)n;
	if (ps->in_off == ps->in_len)
		ps->in_off = ps->in_len = 0;
	ack[0] = (uint8_t)(n >> 24);
	ack[1] = (uint8_t)(n >> 16);
	ack[2] = (uint8_t)(n >> 8);
	ack[3] = (uint8_t)n;
	session_send(s, AGENT_T_STREAM_WINDOW, 0, ps->id, ack, sizeof(ack));
	maybe_shut(ps);
}

/* Reads what the server sent, within the host's window. */
static void pump_out(struct session *s, struct pstream *ps)
{
	uint8_t buf[AGENT_CHUNK];
	size_t want = ps->credit < sizeof(buf) ? ps->credit : sizeof(buf);
	ssize_t n = read(ps->fd, buf, want);

	if (n < 0) {
		if (errno != EAGAIN && errno != EINTR)
			fail(s, ps, AGENT_S_IO, errno, "read from the port");
		return;
	}
	if (n == 0) {
		ps->rd_eof = true;
		session_send(s, AGENT_T_STREAM_END, 0, ps->id, NULL, 0);
		return;
	}
	ps->credit -= (uint32_t)n;
	session_send(s, AGENT_T_STREAM_DATA, 0, ps->id, buf, (size_t)n);
}

void port_poll_done(struct session *s, struct pollfd *pfd, int n)
{
	for (int i = 0; i < AGENT_MAX_PORTS; i++) {
		struct pstream *ps = &streams[i];
		short re;

		if (!ps->id || ps->pfd_index < 0 || ps->pfd_index >= n)
			continue;
		re = pfd[ps->pfd_index].revents;
		ps->pfd_index = -1;
		if (!re)
			continue;
		if (ps->connecting) {
			int e = 0;
			socklen_t el = sizeof(e);

			if (getsockopt(ps->fd, SOL_SOCKET, SO_ERROR, &e, &el) < 0)
				e = errno;
			if (e == 0 && !(re & (POLLERR | POLLHUP))) {
				ps->connecting = false;
				session_send(s, AGENT_T_OK, 0, ps->id, "\0\0\0\0\0\0\0\0", 8);
			} else if (e == ECONNREFUSED || e == 0) {
				fail(s, ps, AGENT_S_REFUSED, ECONNREFUSED, "nothing listens on the port");
			} else {
				fail(s, ps, AGENT_S_IO, e, "connect");
			}
			continue;
		}
		if ((re & (POLLOUT | POLLERR | POLLHUP)) && ps->in_off < ps->in_len) {
			pump_in(s, ps);
			if (!ps->id)
				continue;
		}
		if ((re & (POLLIN | POLLERR | POLLHUP)) && !ps->rd_eof && ps->credit > 0 &&
		    session_has_room(s)) {
			pump_out(s, ps);
			if (!ps->id)
				continue;
		}
		maybe_done(ps);
	}
}

void port_reset(void)
{
	for (int i = 0; i < AGENT_MAX_PORTS; i++)
		if (streams[i].id)
			drop(&streams[i], true);
}
