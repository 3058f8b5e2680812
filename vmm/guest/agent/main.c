/*
 * main.c - kiln-agent: the session with the host and the poll loop.
 *
 * The agent finds the virtio-serial port named "kiln.agent" (/sys/class/virtio-ports/<p>/name),
 * opens /dev/<p> and serves frames (agent_proto.h). When the host disconnects (EOF or POLLHUP on
 * the port) every exec is killed and every transfer dropped, since ids belong to one session
 * (detached processes go on, unattached); the agent then waits for the host to connect again. A
 * NEW_SESSION HELLO does the same, and a close the port shows only after it ends nothing
 * (docs/agent-protocol.md, Connections). With --fd N it serves an inherited descriptor
 * instead (tests) and exits at EOF.
 *
 * It also answers HELLO (version, kernel release, boot id) and SET_IDENTITY (hostname, sandbox id,
 * wall clock, entropy for the kernel RNG, env defaults for later execs).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/random.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

#define PORT_NAME_DEFAULT "kiln.agent"
#define POLL_MAX (3 + 3 * AGENT_MAX_EXECS + AGENT_MAX_PORTS)
/*
 * A close the port shows this soon after a HELLO read ahead of it is the connection's before; a
 * later one is the current connection's own (a close and an open shown at once count a HELLO
 * ahead that no close follows): it ends the session.
 */
#define LATE_CLOSE_MS 5000

struct session {
	int fd;			/* the port (or --fd), non-blocking */
	bool test_mode;		/* --fd: exit at EOF instead of waiting for a reconnect */
	bool desync;		/* a bad frame came: ignore input until the host reconnects */
	bool host_away;		/* the port showed the host gone when this input was read */
	bool hello_seen;	/* a NEW_SESSION HELLO came since the port showed the host connect */
	int hellos_ahead;	/* NEW_SESSION HELLOs read before the port showed the close before them */
	uint64_t ahead_ms;	/* when the last of them was read (now_ms) */
	struct agent_decoder dec;
	uint8_t *payload;	/* AGENT_MAX_PAYLOAD bytes for the decoder */
	uint8_t *out;		/* queued output, AGENT_OUT_MAX bytes */
	size_t out_off;		/* bytes of `out` already written */
	size_t out_len;		/* bytes of `out` in use */
	char *env_defaults[AGENT_MAX_ENV_DEFAULTS + 2];	/* NULL-terminated, malloc'd strings */
};

static int session_flush(struct session *s);
static void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logmsg(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("kiln-agent: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
}

uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int session_send(struct session *s, uint8_t type, uint16_t flags, uint32_t id, const void *p,
		 size_t len)
{
	struct agent_hdr h = { AGENT_PROTO_VERSION, type, flags, id, (uint32_t)len };

	if (s->fd < 0)
		return 0;	/* no host: nothing to tell */
	if (len > AGENT_MAX_PAYLOAD)
		return -EMSGSIZE;
	if (s->out_off > 0 && s->out_len + AGENT_HDR_SIZE + len > AGENT_OUT_MAX) {
		memmove(s->out, s->out + s->out_off, s->out_len - s->out_off);
		s->out_len -= s->out_off;
		s->out_off = 0;
	}
	if (s->out_len + AGENT_HDR_SIZE + len > AGENT_OUT_MAX) {
		logmsg("output queue full, dropping a frame of type %u", type);
		return -ENOBUFS;
	}
	agent_hdr_encode(&h, s->out + s->out_len);
	if (len)
		memcpy(s->out + s->out_len + AGENT_HDR_SIZE, p, len);
	s->out_len += AGENT_HDR_SIZE + len;
	return 0;
}

void session_error(struct session *s, uint32_t id, enum agent_status st, int sys_errno,
		   const char *fmt, ...)
{
	char msg[512];
	uint8_t buf[sizeof(msg) + 16];
	struct agent_wr w;
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	agent_wr_init(&w, buf, sizeof(buf));
	agent_wr_u32(&w, st);
	agent_wr_u32(&w, (uint32_t)sys_errno);
	agent_wr_str(&w, msg);
	session_send(s, AGENT_T_ERROR, 0, id, buf, w.len);
}

bool session_has_room(const struct session *s)
{
	return s->fd >= 0 && s->out_len - s->out_off < AGENT_OUT_HIGH;
}

char *const *session_env_defaults(const struct session *s)
{
	return s->env_defaults;
}

/* Reads a small text file into `buf` (NUL-terminated, trailing newline dropped). */
static void read_line_file(const char *path, char *buf, size_t cap)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n = fd >= 0 ? read(fd, buf, cap - 1) : -1;

	if (fd >= 0)
		close(fd);
	if (n < 0)
		n = 0;
	buf[n] = '\0';
	if (n > 0 && buf[n - 1] == '\n')
		buf[n - 1] = '\0';
}

static void handle_hello(struct session *s, uint32_t id)
{
	struct utsname u;
	char boot_id[64];
	uint8_t buf[512];
	struct agent_wr w;
	struct timespec up;

	uname(&u);
	read_line_file("/proc/sys/kernel/random/boot_id", boot_id, sizeof(boot_id));
	clock_gettime(CLOCK_BOOTTIME, &up);
	agent_wr_init(&w, buf, sizeof(buf));
	agent_wr_u16(&w, AGENT_PROTO_VERSION);
	agent_wr_str(&w, u.release);
	agent_wr_str(&w, boot_id);
	agent_wr_str(&w, AGENT_VERSION_STRING);
	agent_wr_u64(&w, (uint64_t)up.tv_sec * 1000 + (uint64_t)up.tv_nsec / 1000000);
	session_send(s, AGENT_T_HELLO_OK, 0, id, buf, w.len);
}

/* Writes `data` to `path` through a temporary file and a rename; returns 0 or -errno. */
static int write_small_file(const char *path, const char *data)
{
	char tmp[256];
	size_t len = strlen(data);
	int fd, rc = 0;

	snprintf(tmp, sizeof(tmp), "%s.kiln-tmp", path);
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -errno;
	if (write(fd, data, len) != (ssize_t)len)
		rc = -EIO;
	if (close(fd) < 0 && rc == 0)
		rc = -errno;
	if (rc == 0 && rename(tmp, path) < 0)
		rc = -errno;
	if (rc < 0)
		unlink(tmp);
	return rc;
}

/* The host name's files, /etc/hostname and /etc/hosts (sethostname() set the name itself). */
static void write_hostname_files(const char *name)
{
	char hosts[512];

	snprintf(hosts, sizeof(hosts), "%s\n", name);
	write_small_file("/etc/hostname", hosts);
	snprintf(hosts, sizeof(hosts),
		 "127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n",
		 name);
	write_small_file("/etc/hosts", hosts);
}

/*
 * Mixes `len` bytes into the kernel's entropy pool, credits them and reseeds the CRNG from it;
 * returns 0 or -errno.
 */
static int add_entropy(const uint8_t *p, size_t len)
{
	struct {
		struct rand_pool_info info;
		uint8_t data[AGENT_MAX_ENTROPY];
	} req;
	int fd, rc = 0;

	req.info.entropy_count = (int)(len * 8);
	req.info.buf_size = (int)len;
	memcpy(req.data, p, len);
	fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	if (ioctl(fd, RNDADDENTROPY, &req.info) < 0)
		rc = -errno;
	/*
	 * Adding entropy does not rekey the CRNG at once: two VMs restored from one snapshot would
	 * go on drawing the same stream until the next scheduled reseed. Force it now.
	 */
	if (rc == 0 && ioctl(fd, RNDRESEEDCRNG) < 0)
		rc = -errno;
	close(fd);
	return rc;
}

/*
 * SET_IDENTITY payload: str hostname (empty: unchanged), str sandbox id (empty: unchanged),
 * u64 wall clock in ns since the epoch (0: unchanged), bytes entropy (empty, or
 * AGENT_MIN_ENTROPY..AGENT_MAX_ENTROPY), u32 envc, envc x str "NAME=value" (replace the defaults).
 */
static void handle_identity(struct session *s, uint32_t id, const uint8_t *p, size_t len)
{
	struct agent_rd r;
	char name[AGENT_MAX_HOSTNAME + 1], sid[AGENT_MAX_SANDBOX_ID + 1];
	char *env[AGENT_MAX_ENV_DEFAULTS + 2] = { 0 };
	uint32_t envc, i;
	int rc;

	agent_rd_init(&r, p, len);
	struct agent_bytes bn = agent_rd_text(&r, AGENT_MAX_HOSTNAME);
	struct agent_bytes bs = agent_rd_text(&r, AGENT_MAX_SANDBOX_ID);
	uint64_t wall_ns = agent_rd_u64(&r);
	struct agent_bytes be = agent_rd_bytes(&r, AGENT_MAX_ENTROPY);

	envc = agent_rd_u32(&r);
	if (r.bad || envc > AGENT_MAX_ENV_DEFAULTS) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed identity");
		return;
	}
	memcpy(name, bn.p ? (const char *)bn.p : "", bn.len);
	name[bn.len] = '\0';
	memcpy(sid, bs.p ? (const char *)bs.p : "", bs.len);
	sid[bs.len] = '\0';
	for (i = 0; i < bs.len; i++) {
		if (sid[i] <= ' ' || sid[i] > '~') {
			session_error(s, id, AGENT_S_INVALID, 0, "invalid sandbox id");
			return;
		}
	}
	if (bn.len && !agent_hostname_ok(name, bn.len)) {
		session_error(s, id, AGENT_S_INVALID, 0, "invalid hostname");
		return;
	}
	if (be.len && be.len < AGENT_MIN_ENTROPY) {
		session_error(s, id, AGENT_S_INVALID, 0, "entropy needs %d bytes at least",
			      AGENT_MIN_ENTROPY);
		return;
	}
	for (i = 0; i < envc; i++) {
		struct agent_bytes kv = agent_rd_text(&r, AGENT_MAX_TEXT);

		if (r.bad || !agent_env_ok((const char *)kv.p, kv.len))
			break;
		env[i] = strndup((const char *)kv.p, kv.len);
		if (!env[i])
			break;
	}
	if (i < envc || !agent_rd_done(&r)) {
		session_error(s, id, AGENT_S_INVALID, 0, "malformed identity env");
		goto cleanup;
	}
	if (wall_ns) {
		struct timespec ts = { (time_t)(wall_ns / 1000000000u), (long)(wall_ns % 1000000000u) };

		if (clock_settime(CLOCK_REALTIME, &ts) < 0) {
			session_error(s, id, AGENT_S_IO, errno, "cannot set the clock: %s",
				      strerror(errno));
			goto cleanup;
		}
	}
	if (be.len && (rc = add_entropy(be.p, be.len)) < 0) {
		session_error(s, id, AGENT_S_IO, -rc, "cannot add entropy: %s", strerror(-rc));
		goto cleanup;
	}
	if (bn.len && sethostname(name, bn.len) < 0) {
		rc = -errno;
		session_error(s, id, AGENT_S_IO, -rc, "cannot set the hostname: %s", strerror(-rc));
		goto cleanup;
	}
	if (bs.len && i < AGENT_MAX_ENV_DEFAULTS + 1 &&
	    asprintf(&env[i], "KILN_SANDBOX_ID=%s", sid) > 0)
		i++;
	/* The new defaults replace the old ones. */
	for (size_t k = 0; s->env_defaults[k]; k++)
		free(s->env_defaults[k]);
	memcpy(s->env_defaults, env, sizeof(env));
	memset(env, 0, sizeof(env));
	/*
	 * Answered before the files that name the sandbox are written: the agent reads no frame
	 * before they are, so nothing the host asks for afterwards runs without them, and the host
	 * goes on meanwhile. Their first write after a restore runs guest code the emulator has not
	 * translated yet: some 45 ms under TCG for the host name's two files on the root file
	 * system, 20 ms for the id's (bench/snapshots/resume.sh). Their errors were never the
	 * answer's.
	 */
	session_send(s, AGENT_T_OK, 0, id, "\0\0\0\0\0\0\0\0", 8);
	session_flush(s);
	if (bn.len)
		write_hostname_files(name);
	if (bs.len) {
		char line[AGENT_MAX_SANDBOX_ID + 2];

		snprintf(line, sizeof(line), "%s\n", sid);
		write_small_file("/run/kiln/sandbox-id", line);
	}
cleanup:
	for (i = 0; env[i]; i++)
		free(env[i]);
}

/* Forgets what the session started and what is queued for the host. */
static void session_drop(struct session *s)
{
	exec_reset();
	file_reset();
	port_reset();
	watch_reset();
	s->out_off = s->out_len = 0;
}

/* Dispatches one whole frame from the host. */
static void handle_frame(struct session *s, const struct agent_hdr *h, const uint8_t *p)
{
	if (!agent_type_from_host(h->type) || h->id == 0) {
		session_error(s, h->id, AGENT_S_PROTO, 0, "unexpected frame type %u", h->type);
		return;
	}
	bool busy = exec_active(h->id) || file_active(h->id) || port_active(h->id) ||
		    watch_active(h->id);

	switch (h->type) {
	case AGENT_T_HELLO:
		if (h->flags & AGENT_HELLO_F_NEW_SESSION) {
			/*
			 * A new host connection: whatever the last one started is orphaned, and what
			 * is still queued for it (a frame cut short included) would only confuse the
			 * new host, whose HELLO_OK must come first.
			 */
			if (s->hello_seen || s->host_away) {
				s->hellos_ahead++;
				s->ahead_ms = now_ms();
			}
			s->hello_seen = true;
			session_drop(s);
		}
		handle_hello(s, h->id);
		break;
	case AGENT_T_SET_IDENTITY:
		handle_identity(s, h->id, p, h->len);
		break;
	case AGENT_T_EXEC:
		if (busy)
			session_error(s, h->id, AGENT_S_EXISTS, 0, "request id in use");
		else
			exec_start(s, h->id, h->flags, p, h->len);
		break;
	case AGENT_T_FILE_WRITE:
		if (busy)
			session_error(s, h->id, AGENT_S_EXISTS, 0, "request id in use");
		else
			file_write_open(s, h->id, p, h->len);
		break;
	case AGENT_T_FILE_READ:
		if (busy)
			session_error(s, h->id, AGENT_S_EXISTS, 0, "request id in use");
		else
			file_read_open(s, h->id, p, h->len);
		break;
	case AGENT_T_FILE_DATA:
		file_write_data(s, h->id, p, h->len);
		break;
	case AGENT_T_FILE_END:
		file_write_end(s, h->id);
		break;
	case AGENT_T_GROW_ROOT:
		grow_root(s, h->id, p, h->len);
		break;
	case AGENT_T_PORT_OPEN:
		if (busy)
			session_error(s, h->id, AGENT_S_EXISTS, 0, "request id in use");
		else
			port_open(s, h->id, p, h->len);
		break;
	case AGENT_T_PROC_ATTACH:
		if (busy)
			session_error(s, h->id, AGENT_S_EXISTS, 0, "request id in use");
		else
			proc_attach(s, h->id, p, h->len);
		break;
	case AGENT_T_PROC_LIST:
		proc_list(s, h->id, p, h->len);
		break;
	case AGENT_T_PROC_SIGNAL:
		proc_signal(s, h->id, p, h->len);
		break;
	case AGENT_T_PROC_STDIN:
		proc_stdin(s, h->id, p, h->len);
		break;
	case AGENT_T_PROC_RESIZE:
		proc_resize(s, h->id, p, h->len);
		break;
	case AGENT_T_WATCH_ADD:
		watch_add(s, h->id, p, h->len);
		break;
	case AGENT_T_WATCH_READ:
		if (busy)
			session_error(s, h->id, AGENT_S_EXISTS, 0, "request id in use");
		else
			watch_read(s, h->id, p, h->len);
		break;
	case AGENT_T_WATCH_REMOVE:
		watch_remove(s, h->id, p, h->len);
		break;
	case AGENT_T_STREAM_DATA:
		port_data(s, h->id, p, h->len);
		break;
	case AGENT_T_STREAM_WINDOW:
		port_window(s, h->id, p, h->len);
		break;
	case AGENT_T_STREAM_END:
		port_end(s, h->id);
		break;
	case AGENT_T_CANCEL:
		exec_cancel(h->id);
		file_cancel(h->id);
		port_cancel(h->id);
		watch_cancel(h->id);
		break;
	}
}

/* Reads what the host sent and handles each whole frame. Returns -1 at EOF or on error. */
static int session_read(struct session *s)
{
	uint8_t buf[65536];
	ssize_t n = read(s->fd, buf, sizeof(buf));
	size_t off = 0;

	if (n == 0)
		return -1;
	if (n < 0)
		return errno == EAGAIN || errno == EINTR ? 0 : -1;
	if (s->desync)
		return 0;
	while (off < (size_t)n) {
		size_t used;
		int rc = agent_decoder_feed(&s->dec, buf + off, (size_t)n - off, &used);

		off += used;
		if (rc < 0) {
			logmsg("bad frame from the host (%s), ignoring input until it reconnects",
			       strerror(-rc));
			session_error(s, 0, AGENT_S_PROTO, -rc, "bad frame header");
			s->desync = true;
			return 0;
		}
		if (rc == 1)
			handle_frame(s, &s->dec.hdr, s->dec.payload);
	}
	return 0;
}

/* Writes queued output; returns -1 when the host is gone. */
static int session_flush(struct session *s)
{
	while (s->out_off < s->out_len) {
		ssize_t n = write(s->fd, s->out + s->out_off, s->out_len - s->out_off);

		if (n < 0)
			return errno == EAGAIN || errno == EINTR ? 0 : -1;
		s->out_off += (size_t)n;
	}
	s->out_off = s->out_len = 0;
	return 0;
}

/* Finds /dev/<p> for the virtio port named `name`; returns 0 or -ENOENT. */
static int find_port(const char *name, char *dev, size_t cap)
{
	DIR *d = opendir("/sys/class/virtio-ports");
	struct dirent *e;
	int rc = -ENOENT;

	if (!d)
		return rc;
	while ((e = readdir(d))) {
		char path[512], buf[128];

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/sys/class/virtio-ports/%s/name", e->d_name);
		read_line_file(path, buf, sizeof(buf));
		if (strcmp(buf, name) == 0) {
			snprintf(dev, cap, "/dev/%s", e->d_name);
			rc = 0;
			break;
		}
	}
	closedir(d);
	return rc;
}

/* Forgets the session: kills execs, drops transfers, queued bytes and a partial frame. */
static void session_reset(struct session *s)
{
	session_drop(s);
	s->desync = false;
	s->hello_seen = false;
	s->hellos_ahead = 0;
	agent_decoder_init(&s->dec, s->payload);
}

/* Drains the SIGCHLD signalfd and reaps; used while no host is connected. */
static void idle_wait(int sigfd, int ms)
{
	struct pollfd sp = { sigfd, POLLIN, 0 };

	if (poll(&sp, 1, ms) > 0) {
		struct signalfd_siginfo si;

		while (read(sigfd, &si, sizeof(si)) > 0)
			;
	}
	exec_tick(NULL);
}

/*
 * Waits until the host is connected to the port (a port without a host polls POLLHUP) and
 * returns it. `fd` is the port when it is open already, else -1: the port stays open while the
 * host is away, since closing it would discard what a reconnecting host already sent.
 */
static int wait_for_host(int fd, const char *port_name, const char *device, int sigfd)
{
	char dev[300];
	bool told = false;

	while (fd < 0) {
		if (device)
			snprintf(dev, sizeof(dev), "%s", device);
		if (device || find_port(port_name, dev, sizeof(dev)) == 0)
			fd = open(dev, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
		if (fd >= 0)
			break;
		if (!told) {
			logmsg("waiting for port '%s'", device ? device : port_name);
			told = true;
		}
		idle_wait(sigfd, 100);
	}
	for (;;) {
		struct pollfd p = { fd, POLLIN, 0 };

		if (poll(&p, 1, 0) >= 0 && !(p.revents & (POLLHUP | POLLERR | POLLNVAL)))
			return fd;
		idle_wait(sigfd, 50);
	}
}

static void usage(void)
{
	fprintf(stderr, "usage: kiln-agent [--port NAME | --device PATH | --fd N]\n"
			"  --port NAME    virtio-serial port name (default %s)\n"
			"  --device PATH  a character device to serve instead\n"
			"  --fd N         serve an inherited descriptor; exit at its end\n",
		PORT_NAME_DEFAULT);
}

int main(int argc, char **argv)
{
	const char *port_name = PORT_NAME_DEFAULT, *device = NULL;
	struct session s = { .fd = -1 };
	sigset_t mask;
	int sigfd, inherited = -1;

	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--port") == 0 && i + 1 < argc) {
			port_name = argv[++i];
		} else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
			device = argv[++i];
		} else if (strcmp(argv[i], "--fd") == 0 && i + 1 < argc) {
			inherited = atoi(argv[++i]);
		} else {
			usage();
			return 2;
		}
	}
	signal(SIGPIPE, SIG_IGN);
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	sigfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
	s.payload = malloc(AGENT_MAX_PAYLOAD);
	s.out = malloc(AGENT_OUT_MAX);
	if (sigfd < 0 || !s.payload || !s.out) {
		logmsg("cannot start: %s", strerror(errno));
		return 1;
	}
	if (!getenv("PATH"))
		setenv("PATH", AGENT_BASE_PATH, 1);
	agent_decoder_init(&s.dec, s.payload);
	if (inherited >= 0) {
		s.test_mode = true;
		s.fd = inherited;
		fcntl(s.fd, F_SETFD, FD_CLOEXEC);
		fcntl(s.fd, F_SETFL, fcntl(s.fd, F_GETFL) | O_NONBLOCK);
	}

	int port = -1;	/* the port, kept open across host connections */

	for (;;) {
		if (s.fd < 0) {
			port = s.fd = wait_for_host(port, port_name, device, sigfd);
			logmsg("host connected");
		}
		struct pollfd pfd[POLL_MAX];
		int n = 0, nexec, nport, nwatch, timeout, wt;

		pfd[n++] = (struct pollfd){ s.fd, (short)(POLLIN | (s.out_len > s.out_off ? POLLOUT : 0)), 0 };
		pfd[n++] = (struct pollfd){ sigfd, POLLIN, 0 };
		nexec = exec_poll_fill(&s, pfd + n, POLL_MAX - n);
		nport = port_poll_fill(&s, pfd + n + nexec, POLL_MAX - n - nexec);
		nwatch = watch_poll_fill(&s, pfd + n + nexec + nport, POLL_MAX - n - nexec - nport);
		timeout = exec_next_timeout();
		wt = watch_next_timeout();
		if (wt >= 0 && (timeout < 0 || wt < timeout))
			timeout = wt;
		if (file_pending() && session_has_room(&s))
			timeout = 0;
		if (poll(pfd, (nfds_t)(n + nexec + nport + nwatch), timeout) < 0 && errno != EINTR) {
			logmsg("poll: %s", strerror(errno));
			return 1;
		}
		if (pfd[1].revents & POLLIN) {
			struct signalfd_siginfo si;

			while (read(sigfd, &si, sizeof(si)) > 0)
				;
		}
		bool gone = false;

		s.host_away = pfd[0].revents & POLLHUP;
		if (pfd[0].revents & POLLIN)
			gone = session_read(&s) < 0;
		else if (pfd[0].revents & (POLLHUP | POLLERR | POLLNVAL))
			gone = true;
		if (!gone) {
			exec_poll_done(&s, pfd + 2, nexec);
			port_poll_done(&s, pfd + 2 + nexec, nport);
			watch_poll_done(&s, pfd + 2 + nexec + nport, nwatch);
			exec_tick(&s);
			watch_tick(&s);
			file_pump(&s);
			gone = session_flush(&s) < 0;
		}
		if (gone) {
			s.fd = -1;
			/*
			 * The port's close and open events come apart from its data: the next
			 * connection's NEW_SESSION HELLO may have been read (and answered into the
			 * queue) before the close of the one before showed, or while it showed. Such
			 * a close, shown within LATE_CLOSE_MS of that HELLO, ends nothing: the HELLO
			 * did. (After it the next NEW_SESSION HELLO counts as a connection's first,
			 * and a later close ends the session, so a close the port never showed, as
			 * when it reports a close and an open at once, cannot leave closes unheeded.)
			 */
			if (s.hellos_ahead > 0 && !s.test_mode && now_ms() - s.ahead_ms < LATE_CLOSE_MS) {
				s.hellos_ahead--;
				s.hello_seen = false;
				logmsg("host disconnected, connected again already");
				continue;
			}
			logmsg("host disconnected");
			session_reset(&s);
			if (s.test_mode) {
				exec_shutdown();
				return 0;
			}
		}
	}
}
