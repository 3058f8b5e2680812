/*
 * load.c - the HTTP load driver of bench/http/load.sh and test_load.py (tests/integration/foundation).
 *
 * One thread, epoll: CONNS keep-alive connections to 127.0.0.1:PORT, spread over source addresses
 * BASE, BASE+1, ... (PER_ADDR connections each, so a per-address cap is not what refuses them),
 * each sending requests back to back (the next as soon as the reply is in) for SECONDS. Connection
 * i authenticates with line i % n of the credentials file and walks the request list from line
 * i % m. A connection the server closes (or that fails, or whose reply takes over 30 s) is opened
 * again at once. Every reply's status is counted.
 *
 * Meanwhile a well-behaved client (a thread of its own, from GOOD_ADDR, one keep-alive connection,
 * connected and answered once before the load's connections open) sends GOOD_RPS requests a second
 * from its own list with its own credential and records each one's status, latency and start (JSON
 * "good_each": [seconds from the start, ms]). With -w PID, the process PID's VmRSS, threads and
 * open fds are sampled every second (and once more 3 s after the load ends).
 *
 * The result is one JSON object on stdout (see print_result()); exit 0, or 2 on bad usage.
 *
 *   bench-load -p PORT -c CONNS -d SECONDS -b BASE -P PER_ADDR -k CREDS -r REQUESTS
 *              [-g GOOD_ADDR -K GOOD_CRED -R GOOD_REQUESTS -q GOOD_RPS] [-w PID]
 *
 * CREDS: one token a line, sent as "Authorization: Bearer <token>". REQUESTS: one request a line,
 * "METHOD PATH" or "METHOD PATH BODY" (BODY: the rest of the line, sent as application/json).
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24
#endif

#define REPLY_TIMEOUT_S 30.0
#define REPLY_MAX (4u << 20)	/* a reply larger than this is an error */
#define NSTATUS 600
#define MAX_SAMPLES 4096

enum phase { PH_CONNECTING, PH_SENDING, PH_READING };

struct conn {
	int fd;
	int idx;		/* which of the CONNS */
	enum phase phase;
	size_t next_req;	/* index into the request list */
	char *out;		/* the request being sent */
	size_t out_len, out_off;
	char *in;
	size_t in_len, in_cap;
	double t_sent;		/* when the request's first byte went */
	double t_open;
};

struct list {
	char **items;
	size_t n;
};

struct lat {
	double *v;		/* milliseconds */
	size_t n, cap;
};

struct sample {
	double t;
	long rss_kib, threads, fds;
	unsigned long long done;	/* load replies so far */
};

static struct {
	int port, conns, seconds, per_addr, good_rps, watch_pid;
	struct in_addr base, good_addr;
	bool good;
	struct list creds, reqs, good_reqs;
	const char *good_cred;
} opt = { .per_addr = 25, .good_rps = 5, .watch_pid = 0 };

static struct {
	unsigned long long status[NSTATUS];
	unsigned long long replies, opened, connect_err, closed_by_server, reset, timeouts, bad_reply;
	struct lat lat;
} load;

static struct {
	unsigned long long status[NSTATUS];
	unsigned long long requests, failures;
	struct lat lat;
	atomic_bool stop;
	atomic_bool started;	/* its first request was answered */
	double *at;		/* when each request was sent, seconds from the start of the load */
	double t0;
} good;

static struct sample samples[MAX_SAMPLES];
static size_t nsamples;

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what)
{
	fprintf(stderr, "bench-load: %s: %s\n", what, strerror(errno));
	exit(1);
}

static void lat_add(struct lat *l, double ms)
{
	if (l->n == l->cap) {
		l->cap = l->cap ? 2 * l->cap : 4096;
		l->v = realloc(l->v, l->cap * sizeof(*l->v));
		if (!l->v)
			die("realloc");
	}
	l->v[l->n++] = ms;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/* The p-quantile (0..1) of the sorted `l`, or 0 when empty. */
static double lat_pct(const struct lat *l, double p)
{
	size_t i;

	if (!l->n)
		return 0;
	i = (size_t)(p * (double)l->n);
	return l->v[i >= l->n ? l->n - 1 : i];
}

/* Reads the non-empty lines of `path` into `out`; exits on failure. */
static void list_read(const char *path, struct list *out)
{
	FILE *f = fopen(path, "r");
	char *line = NULL;
	size_t cap = 0;
	ssize_t n;

	if (!f)
		die(path);
	while ((n = getline(&line, &cap, f)) >= 0) {
		while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
			line[--n] = '\0';
		if (!n || line[0] == '#')
			continue;
		out->items = realloc(out->items, (out->n + 1) * sizeof(*out->items));
		if (!out->items || !(out->items[out->n] = strdup(line)))
			die("memory");
		out->n++;
	}
	free(line);
	fclose(f);
	if (!out->n) {
		fprintf(stderr, "bench-load: %s has no lines\n", path);
		exit(2);
	}
}

/*
 * Formats the request `spec` ("METHOD PATH [BODY]") with the credential line `cred` ("TOKEN
 * [SANDBOX]": "{sb}" in PATH becomes SANDBOX) into a new string.
 */
static char *request_make(const char *spec, const char *cred_line, size_t *len)
{
	char method[16], path[1024], cred[4096], sb[128] = "", *out = NULL, *at;
	const char *body = NULL;
	int off = 0, n;

	if (sscanf(spec, "%15s %1023s%n", method, path, &off) != 2 ||
	    sscanf(cred_line, "%4095s %127s", cred, sb) < 1) {
		fprintf(stderr, "bench-load: bad request \"%s\" or credential line\n", spec);
		exit(2);
	}
	if (spec[off] == ' ')
		body = spec + off + 1;
	at = strstr(path, "{sb}");
	if (at) {
		char rest[1024];

		snprintf(rest, sizeof(rest), "%s", at + 4);
		snprintf(at, sizeof(path) - (size_t)(at - path), "%s%s", sb, rest);
	}
	if (body)
		n = asprintf(&out,
			     "%s %s HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer %s\r\n"
			     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
			     method, path, cred, strlen(body), body);
	else
		n = asprintf(&out, "%s %s HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer %s\r\n\r\n",
			     method, path, cred);
	if (n < 0)
		die("asprintf");
	*len = (size_t)n;
	return out;
}

/*
 * Whether `buf` holds a whole reply: returns its length (0: not yet, -1: malformed) and sets
 * *status and *close (the server will close the connection after it).
 */
static long reply_parse(const char *buf, size_t len, int *status, bool *close)
{
	const char *end = memmem(buf, len, "\r\n\r\n", 4), *p, *eol;
	size_t head, clen = 0;
	bool chunked = false, have_len = false;

	if (!end)
		return len > 65536 ? -1 : 0;
	head = (size_t)(end - buf) + 4;
	if (len < 12 || memcmp(buf, "HTTP/1.", 7) != 0)
		return -1;
	*status = atoi(buf + 9);
	*close = buf[7] == '0';
	for (p = (const char *)memchr(buf, '\n', head) + 1; p < end; p = eol + 1) {
		eol = memchr(p, '\n', (size_t)(end + 2 - p));
		if (!eol)
			break;
		if (!strncasecmp(p, "Content-Length:", 15)) {
			clen = strtoull(p + 15, NULL, 10);
			have_len = true;
		} else if (!strncasecmp(p, "Transfer-Encoding:", 18) &&
			   memmem(p, (size_t)(eol - p), "chunked", 7)) {
			chunked = true;
		} else if (!strncasecmp(p, "Connection:", 11) &&
			   memmem(p, (size_t)(eol - p), "close", 5)) {
			*close = true;
		}
	}
	if (chunked) {
		/* The last chunk: "0\r\n\r\n" right after the headers or after a chunk's CRLF. */
		if (len >= head + 5 && !memcmp(buf + len - 5, "0\r\n\r\n", 5) &&
		    (len == head + 5 || !memcmp(buf + len - 7, "\r\n", 2)))
			return (long)len;
		return 0;
	}
	if (!have_len) {
		if (*status == 204 || *status == 304)
			return (long)head;
		*close = true;	/* read to EOF: counted when the server closes */
		return 0;
	}
	return len >= head + clen ? (long)(head + clen) : 0;
}

/* A non-blocking socket from `src` connecting to 127.0.0.1:port, or -1. */
static int sock_open(struct in_addr src, bool blocking)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr = src };
	int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | (blocking ? 0 : SOCK_NONBLOCK), 0);
	int one = 1;

	if (fd < 0)
		return -1;
	setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
		close(fd);
		return -1;
	}
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	a.sin_port = htons((uint16_t)opt.port);
	if (connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0 && errno != EINPROGRESS) {
		close(fd);
		return -1;
	}
	return fd;
}

/* ---- the well-behaved client ---- */

/* One request on *fd (opened when -1); returns its status, 0 on failure (*fd then closed). */
static int good_one(int *fd, const char *req, size_t len)
{
	char buf[65536];
	size_t got = 0;
	double deadline = now_s() + REPLY_TIMEOUT_S;
	int status = 0;
	bool close_after = false;
	long whole;

	for (int attempt = 0; attempt < 2; attempt++) {
		if (*fd < 0 && (*fd = sock_open(opt.good_addr, true)) < 0)
			return 0;
		if (send(*fd, req, len, MSG_NOSIGNAL) == (ssize_t)len)
			break;
		close(*fd);	/* a kept-alive connection the server had closed: once more */
		*fd = -1;
		if (attempt)
			return 0;
	}
	for (;;) {
		struct pollfd p = { .fd = *fd, .events = POLLIN };
		ssize_t n;
		int left = (int)((deadline - now_s()) * 1000);

		if (left <= 0 || poll(&p, 1, left) <= 0)
			break;
		n = recv(*fd, buf + got, sizeof(buf) - got, 0);
		if (n <= 0)
			break;
		got += (size_t)n;
		whole = reply_parse(buf, got, &status, &close_after);
		if (whole < 0)
			break;
		if (whole > 0) {
			if (close_after) {
				close(*fd);
				*fd = -1;
			}
			return status;
		}
		if (got == sizeof(buf))
			break;
	}
	close(*fd);
	*fd = -1;
	return 0;
}

static void *good_main(void *arg)
{
	int fd = -1;
	double period = 1.0 / opt.good_rps, next = now_s();
	size_t i = 0;

	(void)arg;
	while (!atomic_load(&good.stop)) {
		size_t len;
		char *req = request_make(opt.good_reqs.items[i++ % opt.good_reqs.n], opt.good_cred, &len);
		double t0 = now_s(), ms;
		int status = good_one(&fd, req, len);

		ms = (now_s() - t0) * 1000;
		free(req);
		atomic_store(&good.started, true);
		if (good.lat.n % 4096 == 0) {
			good.at = realloc(good.at, (good.lat.n + 4096) * sizeof(*good.at));
			if (!good.at)
				die("realloc");
		}
		good.at[good.lat.n] = t0 - good.t0;
		lat_add(&good.lat, ms);
		good.requests++;
		if (status >= 0 && status < NSTATUS)
			good.status[status]++;
		if (status < 200 || status > 299)
			good.failures++;
		next += period;
		if (next > now_s())
			usleep((useconds_t)((next - now_s()) * 1e6));
		else
			next = now_s();
	}
	if (fd >= 0)
		close(fd);
	return NULL;
}

/* ---- the load ---- */

static int ep;

static void conn_prepare(struct conn *c)
{
	const char *spec = opt.reqs.items[c->next_req++ % opt.reqs.n];

	free(c->out);
	c->out = request_make(spec, opt.creds.items[(size_t)c->idx % opt.creds.n], &c->out_len);
	c->out_off = 0;
	c->in_len = 0;
}

static void conn_open(struct conn *c)
{
	struct in_addr src = opt.base;
	struct epoll_event ev = { .events = EPOLLOUT | EPOLLIN, .data.ptr = c };

	src.s_addr = htonl(ntohl(opt.base.s_addr) + (uint32_t)(c->idx / opt.per_addr));
	c->fd = sock_open(src, false);
	c->t_open = now_s();
	if (c->fd < 0) {
		load.connect_err++;
		return;	/* retried by the sweep */
	}
	load.opened++;
	c->phase = PH_CONNECTING;
	conn_prepare(c);
	if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) < 0)
		die("epoll_ctl");
}

static void conn_close(struct conn *c)
{
	if (c->fd >= 0) {
		epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
		close(c->fd);
	}
	c->fd = -1;
}

static void conn_want(struct conn *c, uint32_t events)
{
	struct epoll_event ev = { .events = events, .data.ptr = c };

	epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Sends what is left of the request; false when the connection failed. */
static bool conn_send(struct conn *c)
{
	if (c->out_off == 0)
		c->t_sent = now_s();
	while (c->out_off < c->out_len) {
		ssize_t n = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);

		if (n < 0) {
			if (errno == EAGAIN)
				return true;
			load.reset++;
			return false;
		}
		c->out_off += (size_t)n;
	}
	c->phase = PH_READING;
	conn_want(c, EPOLLIN);
	return true;
}

/* Reads what came; false when the connection is done with (closed or failed). */
static bool conn_read(struct conn *c)
{
	for (;;) {
		ssize_t n;
		long whole;
		int status = 0;
		bool close_after = false;

		if (c->in_cap - c->in_len < 16384) {
			c->in_cap = c->in_cap ? 2 * c->in_cap : 32768;
			if (c->in_cap > REPLY_MAX) {
				load.bad_reply++;
				return false;
			}
			c->in = realloc(c->in, c->in_cap);
			if (!c->in)
				die("realloc");
		}
		n = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
		if (n < 0 && errno == EAGAIN)
			return true;
		if (n <= 0) {
			/* A reply read to EOF (no length) ends here. */
			if (n == 0 && c->phase == PH_READING && c->in_len &&
			    reply_parse(c->in, c->in_len, &status, &close_after) == 0 && close_after) {
				load.replies++;
				load.status[status > 0 && status < NSTATUS ? status : 0]++;
				lat_add(&load.lat, (now_s() - c->t_sent) * 1000);
			} else if (n == 0) {
				load.closed_by_server++;
			} else {
				load.reset++;
			}
			return false;
		}
		c->in_len += (size_t)n;
		whole = reply_parse(c->in, c->in_len, &status, &close_after);
		if (whole < 0) {
			load.bad_reply++;
			return false;
		}
		if (whole == 0)
			continue;
		load.replies++;
		load.status[status > 0 && status < NSTATUS ? status : 0]++;
		lat_add(&load.lat, (now_s() - c->t_sent) * 1000);
		if (close_after)
			return false;
		conn_prepare(c);
		c->phase = PH_SENDING;
		if (!conn_send(c))
			return false;
		if (c->phase == PH_SENDING)
			conn_want(c, EPOLLOUT);
		return true;
	}
}

static void conn_event(struct conn *c, uint32_t events)
{
	bool ok = true;

	if (c->phase == PH_CONNECTING) {
		int err = 0;
		socklen_t el = sizeof(err);

		if (!(events & (EPOLLOUT | EPOLLERR | EPOLLHUP)))
			return;
		getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &el);
		if (err) {
			load.connect_err++;
			conn_close(c);
			return;
		}
		c->phase = PH_SENDING;
		conn_want(c, EPOLLOUT);
	}
	if (c->phase == PH_SENDING && (events & (EPOLLOUT | EPOLLERR | EPOLLHUP)))
		ok = conn_send(c);
	if (ok && c->phase == PH_READING && (events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
		ok = conn_read(c);
	if (!ok)
		conn_close(c);
}

/* Reads VmRSS and Threads of `pid` and counts its fds; false when it is gone. */
static bool sample_take(int pid, struct sample *s)
{
	char path[64], line[256];
	FILE *f;
	DIR *d;
	struct dirent *de;

	snprintf(path, sizeof(path), "/proc/%d/status", pid);
	f = fopen(path, "r");
	if (!f)
		return false;
	while (fgets(line, sizeof(line), f)) {
		if (!strncmp(line, "VmRSS:", 6))
			s->rss_kib = atol(line + 6);
		else if (!strncmp(line, "Threads:", 8))
			s->threads = atol(line + 8);
	}
	fclose(f);
	snprintf(path, sizeof(path), "/proc/%d/fd", pid);
	d = opendir(path);
	s->fds = 0;
	if (d) {
		while ((de = readdir(d)))
			if (de->d_name[0] != '.')
				s->fds++;
		closedir(d);
	}
	return true;
}

static void sample_now(double t0)
{
	struct sample *s;

	if (!opt.watch_pid || nsamples == MAX_SAMPLES)
		return;
	s = &samples[nsamples];
	s->t = now_s() - t0;
	s->done = load.replies;
	if (sample_take(opt.watch_pid, s))
		nsamples++;
}

static void print_statuses(const unsigned long long *st)
{
	bool first = true;

	printf("{");
	for (int i = 0; i < NSTATUS; i++)
		if (st[i]) {
			printf("%s\"%d\": %llu", first ? "" : ", ", i, st[i]);
			first = false;
		}
	printf("}");
}

static void print_result(double secs)
{
	printf("{\"good_each\": [");
	for (size_t i = 0; i < good.lat.n; i++)
		printf("%s[%.3f, %.3f]", i ? ", " : "", good.at[i], good.lat.v[i]);
	printf("], ");
	qsort(load.lat.v, load.lat.n, sizeof(double), cmp_double);
	qsort(good.lat.v, good.lat.n, sizeof(double), cmp_double);
	printf("\"seconds\": %.3f, \"conns\": %d, \"replies\": %llu, \"rps\": %.1f, \"statuses\": ",
	       secs, opt.conns, load.replies, (double)load.replies / secs);
	print_statuses(load.status);
	printf(", \"opened\": %llu, \"connect_errors\": %llu, \"closed_by_server\": %llu, "
	       "\"resets\": %llu, \"timeouts\": %llu, \"bad_replies\": %llu, "
	       "\"p50_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f",
	       load.opened, load.connect_err, load.closed_by_server, load.reset, load.timeouts,
	       load.bad_reply, lat_pct(&load.lat, 0.5), lat_pct(&load.lat, 0.99),
	       load.lat.n ? load.lat.v[load.lat.n - 1] : 0.0);
	printf(", \"good\": {\"requests\": %llu, \"failures\": %llu, \"statuses\": ", good.requests,
	       good.failures);
	print_statuses(good.status);
	printf(", \"p50_ms\": %.3f, \"p95_ms\": %.3f, \"p99_ms\": %.3f, \"max_ms\": %.3f}",
	       lat_pct(&good.lat, 0.5), lat_pct(&good.lat, 0.95), lat_pct(&good.lat, 0.99),
	       good.lat.n ? good.lat.v[good.lat.n - 1] : 0.0);
	printf(", \"samples\": [");
	for (size_t i = 0; i < nsamples; i++)
		printf("%s{\"t\": %.2f, \"rss_kib\": %ld, \"threads\": %ld, \"fds\": %ld, "
		       "\"replies\": %llu}",
		       i ? ", " : "", samples[i].t, samples[i].rss_kib, samples[i].threads,
		       samples[i].fds, samples[i].done);
	printf("]}\n");
}

static void usage(void)
{
	fprintf(stderr, "usage: bench-load -p PORT -c CONNS -d SECONDS -b BASE_ADDR -P PER_ADDR "
			"-k CREDS -r REQUESTS [-g GOOD_ADDR -K GOOD_CRED -R GOOD_REQUESTS "
			"-q GOOD_RPS] [-w PID]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	struct epoll_event evs[256];
	struct conn *conns;
	struct rlimit rl;
	pthread_t good_thread;
	double t0, t_end, next_sample, last_sweep = 0;
	int c;

	while ((c = getopt(argc, argv, "p:c:d:b:P:k:r:g:K:R:q:w:")) != -1) {
		switch (c) {
		case 'p': opt.port = atoi(optarg); break;
		case 'c': opt.conns = atoi(optarg); break;
		case 'd': opt.seconds = atoi(optarg); break;
		case 'P': opt.per_addr = atoi(optarg); break;
		case 'q': opt.good_rps = atoi(optarg); break;
		case 'w': opt.watch_pid = atoi(optarg); break;
		case 'k': list_read(optarg, &opt.creds); break;
		case 'r': list_read(optarg, &opt.reqs); break;
		case 'R': list_read(optarg, &opt.good_reqs); break;
		case 'K': opt.good_cred = optarg; break;
		case 'b':
			if (inet_pton(AF_INET, optarg, &opt.base) != 1)
				usage();
			break;
		case 'g':
			if (inet_pton(AF_INET, optarg, &opt.good_addr) != 1)
				usage();
			opt.good = true;
			break;
		default: usage();
		}
	}
	if (opt.port <= 0 || opt.conns <= 0 || opt.seconds <= 0 || opt.per_addr <= 0 ||
	    !opt.base.s_addr || !opt.creds.n || !opt.reqs.n || opt.good_rps <= 0 ||
	    (opt.good && (!opt.good_cred || !opt.good_reqs.n)))
		usage();
	getrlimit(RLIMIT_NOFILE, &rl);
	if (rl.rlim_cur < (rlim_t)opt.conns + 256) {
		rl.rlim_cur = rl.rlim_max < (rlim_t)opt.conns + 1024 ? rl.rlim_max
								     : (rlim_t)opt.conns + 1024;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			die("setrlimit");
	}
	conns = calloc((size_t)opt.conns, sizeof(*conns));
	ep = epoll_create1(EPOLL_CLOEXEC);
	if (!conns || ep < 0)
		die("setup");

	t0 = good.t0 = now_s();
	t_end = t0 + opt.seconds;
	next_sample = t0;
	sample_now(t0);
	next_sample += 1;
	/* The well-behaved client is already connected and served when the load begins. */
	if (opt.good && pthread_create(&good_thread, NULL, good_main, NULL) != 0)
		die("pthread_create");
	for (int i = 0; i < 500 && opt.good && !atomic_load(&good.started); i++)
		usleep(10000);
	for (int i = 0; i < opt.conns; i++) {
		conns[i].idx = i;
		conns[i].next_req = (size_t)i % opt.reqs.n;
		conn_open(&conns[i]);
	}
	for (;;) {
		double now = now_s();
		int n;

		if (now >= t_end)
			break;
		n = epoll_wait(ep, evs, 256, 100);
		for (int i = 0; i < n; i++)
			conn_event(evs[i].data.ptr, evs[i].events);
		now = now_s();
		if (now >= next_sample) {
			sample_now(t0);
			next_sample += 1;
		}
		if (now - last_sweep < 0.1)
			continue;
		last_sweep = now;
		/* Reopen what closed; give up on replies that took too long. */
		for (int i = 0; i < opt.conns; i++) {
			struct conn *cc = &conns[i];

			if (cc->fd >= 0 && cc->phase != PH_CONNECTING && cc->out_off &&
			    now - cc->t_sent > REPLY_TIMEOUT_S) {
				load.timeouts++;
				conn_close(cc);
			} else if (cc->fd >= 0 && cc->phase == PH_CONNECTING &&
				   now - cc->t_open > REPLY_TIMEOUT_S) {
				load.connect_err++;
				conn_close(cc);
			}
			if (cc->fd < 0)
				conn_open(cc);
		}
	}
	atomic_store(&good.stop, true);
	if (opt.good)
		pthread_join(good_thread, NULL);
	for (int i = 0; i < opt.conns; i++) {
		conn_close(&conns[i]);
		free(conns[i].out);
		free(conns[i].in);
	}
	sample_now(t0);
	if (opt.watch_pid) {
		sleep(3);	/* the server notices the closes */
		sample_now(t0);
	}
	print_result(t_end - t0);
	free(conns);
	close(ep);
	return 0;
}
