/*
 * sniproxy.c - the name-checking transparent proxy for TCP 80 and 443 (see sniproxy.h): one
 * accepting thread for every sandbox's listeners, one thread per connection; once checked, bytes
 * no one needs to see move socket to socket through a pipe (splice), never through user space.
 */
#include "netpolicy/sniproxy.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <stddef.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "netpolicy/rtnl.h"
#include "netpolicy/sni.h"

#define CONNECT_TIMEOUT_MS 10000
#define WRITE_TIMEOUT_S 30
#define RECHECK_MS 1000
#define COPY_BUF 65536
#define PIPE_BYTES (1 << 20)	/* each direction's splice pipe, if the system allows it */

struct bucket {
	uint64_t milli;		/* tokens x 1000 */
	uint64_t last_ms;
	uint32_t rate;		/* per second, also the burst */
};

struct psb {
	char id[KILN_NET_ID_MAX + 1];
	int l4, l6;
	struct kiln_policy *pol;
	bool dead;
	struct bucket hs;
	struct kiln_sniproxy_stats st;
	struct psb *next;
};

struct kiln_sniproxy {
	struct kiln_sniproxy_config cfg;
	pthread_mutex_t mu;
	pthread_cond_t gone;	/* a connection thread ended */
	struct psb *sbs;
	struct bucket hs;
	struct kiln_sniproxy_stats st;
	pthread_t thread;
	int wake_fd;
	bool stop;
	uint64_t epoch;		/* the accepting thread's rounds (broadcast on `gone`) */
};

struct conn {
	struct kiln_sniproxy *px;
	struct psb *sb;
	int g, u;
	int family;
	struct sockaddr_storage dst;	/* what the guest dialled (the accepted socket's own) */
	uint8_t addr[16];
	uint16_t dport;
	char host[KILN_HOST_MAX + 1];	/* the name last checked */
	struct kiln_conn_note note;	/* the flow, for the connection log */
	bool noted_allowed;
};

static uint64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static bool bucket_take(struct bucket *b, uint64_t now)
{
	uint64_t cap = (uint64_t)b->rate * 1000;
	uint64_t ms = now - b->last_ms;
	if (ms > 3600000)
		ms = 3600000;
	b->milli += ms * b->rate;
	if (b->milli > cap)
		b->milli = cap;
	b->last_ms = now;
	if (b->milli < 1000)
		return false;
	b->milli -= 1000;
	return true;
}

static void bucket_init(struct bucket *b, uint32_t rate)
{
	b->rate = rate;
	b->milli = (uint64_t)rate * 1000;
	b->last_ms = now_ms();
}

/* Closes with a reset (no FIN): what a refused or cut connection gets. */
static void rst_close(int fd)
{
	if (fd < 0)
		return;
	struct linger l = {.l_onoff = 1, .l_linger = 0};
	setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
	close(fd);
}

static int write_all(int fd, const uint8_t *p, size_t n)
{
	while (n > 0) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return -1;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

/*
 * Whether `name` may be reached at the connection's address and port: a host rule for that port
 * covers it, the sandbox's DNS proxy answered it with that address (expired answers count for a
 * connection already open), and the address is in no always-denied range.
 */
static enum kiln_proxy_decision name_check(struct conn *c, const char *name, bool live)
{
	uint16_t ports[16];
	enum kiln_egress_mode mode;
	size_t n = kiln_policy_host_ports(c->sb->pol, name, ports, 16, &mode);
	bool port = false;
	for (size_t i = 0; i < n; i++)
		port |= ports[i] == 0 || ports[i] == c->dport;
	if (mode != KILN_EGRESS_ALLOWLIST || !port)
		return KILN_PROXY_NO_RULE;
	if (!kiln_policy_name_pinned(c->sb->pol, name, c->family, c->addr, live))
		return KILN_PROXY_NOT_ANSWERED;
	if (kiln_policy_addr_denied(c->sb->pol, c->family, c->addr))
		return KILN_PROXY_DENIED_RANGE;
	return KILN_PROXY_ALLOWED;
}

static bool name_ok(struct conn *c, const char *name, bool live)
{
	return name_check(c, name, live) == KILN_PROXY_ALLOWED;
}

/* Hands the connection log a decision about this connection (name may be NULL). */
static void note(struct kiln_sniproxy *px, const char *sandbox, struct kiln_conn_note *nt,
		 enum kiln_proxy_decision d, const char *name, const char *detail)
{
	if (!px->cfg.note)
		return;
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	nt->kind = KILN_NOTE_DECISION;
	nt->at_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	nt->decision = d;
	snprintf(nt->name, sizeof(nt->name), "%s", name ? name : "");
	snprintf(nt->detail, sizeof(nt->detail), "%s", detail ? detail : "");
	px->cfg.note(px->cfg.note_arg, sandbox, nt);
}

static void note_allowed(struct conn *c)
{
	if (c->noted_allowed)
		return;
	c->noted_allowed = true;
	note(c->px, c->sb->id, &c->note, KILN_PROXY_ALLOWED, c->host, NULL);
}

/* Counts one event of the connection's sandbox and of the node; returns the sandbox's count. */
static uint64_t count(struct conn *c, size_t off)
{
	pthread_mutex_lock(&c->px->mu);
	uint64_t n = ++(*(uint64_t *)((char *)&c->sb->st + off));
	(*(uint64_t *)((char *)&c->px->st + off))++;
	pthread_mutex_unlock(&c->px->mu);
	return n;
}

/* A guest can make refusals as fast as its caps let it: the log gets the first 16 of a sandbox,
 * then the 32nd, 64th... (each naming how many so far). */
static bool worth_logging(uint64_t n)
{
	return n <= 16 || (n & (n - 1)) == 0;
}

static bool dead(struct conn *c)
{
	pthread_mutex_lock(&c->px->mu);
	bool d = c->sb->dead || c->px->stop;
	pthread_mutex_unlock(&c->px->mu);
	return d;
}

static void refuse(struct conn *c, enum kiln_proxy_decision d, const char *why, const char *name)
{
	kiln_policy_count_drop(c->sb->pol);
	note(c->px, c->sb->id, &c->note, d, name, NULL);
	uint64_t n = count(c, offsetof(struct kiln_sniproxy_stats, refused));
	if (!worth_logging(n))
		return;
	char a[INET6_ADDRSTRLEN];
	inet_ntop(c->family == 4 ? AF_INET : AF_INET6, c->addr, a, sizeof(a));
	log_info("sniproxy: %s: refused %s:%u \"%s\": %s (%llu refused)", c->sb->id, a, c->dport,
		 name ? name : "", why, (unsigned long long)n);
}

/* Connects to the checked address from the host's netns. 0 or -1. */
static int dial(struct conn *c)
{
	c->u = socket(c->dst.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (c->u < 0)
		return -1;
	socklen_t len = c->dst.ss_family == AF_INET ? sizeof(struct sockaddr_in)
						    : sizeof(struct sockaddr_in6);
	if (connect(c->u, (struct sockaddr *)&c->dst, len) < 0 && errno != EINPROGRESS)
		return -1;
	struct pollfd p = {.fd = c->u, .events = POLLOUT};
	uint64_t end = now_ms() + CONNECT_TIMEOUT_MS;
	for (;;) {
		uint64_t t = now_ms();
		if (t >= end || dead(c))
			return -1;
		int r = poll(&p, 1, (int)(end - t < RECHECK_MS ? end - t : RECHECK_MS));
		if (r < 0 && errno != EINTR)
			return -1;
		if (r > 0)
			break;
	}
	int soerr = 0;
	socklen_t sl = sizeof(soerr);
	if (getsockopt(c->u, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0 || soerr)
		return -1;
	return 0;
}

/*
 * Moves what `from` has ready to `to` through the pipe `pp` without copying it to user space
 * (splice(2): socket to pipe, then pipe to socket). Called when poll says `from` is readable; the
 * pipe is empty on entry and on a successful return. Writes to `to` block as write_all's do
 * (SO_SNDTIMEO). Returns the bytes moved, 0 at the end of `from`, -EAGAIN when it had nothing
 * after all, or another -errno.
 */
static ssize_t splice_once(int from, int to, const int pp[2], size_t max)
{
	ssize_t k = splice(from, NULL, pp[1], NULL, max, SPLICE_F_NONBLOCK | SPLICE_F_MOVE);
	if (k < 0)
		return errno == EINTR ? -EAGAIN : -errno;
	for (ssize_t left = k; left > 0;) {
		ssize_t w = splice(pp[0], NULL, to, NULL, (size_t)left, SPLICE_F_MOVE);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return w < 0 ? -errno : -EPIPE;
		left -= w;
	}
	return k;
}

/* A pipe for splice_once, as large as the system lets it be up to PIPE_BYTES; 0 or -errno. */
static int pipe_open(int pp[2], size_t *size)
{
	if (pipe2(pp, O_CLOEXEC | O_NONBLOCK) < 0) {
		pp[0] = pp[1] = -1;
		return -errno;
	}
	int got = fcntl(pp[1], F_SETPIPE_SZ, PIPE_BYTES);
	if (got < 0)
		got = fcntl(pp[1], F_GETPIPE_SZ);
	*size = got > 0 ? (size_t)got : 65536;
	return 0;
}

static void pipe_close(int pp[2])
{
	if (pp[0] >= 0)
		close(pp[0]);
	if (pp[1] >= 0)
		close(pp[1]);
	pp[0] = pp[1] = -1;
}

/* HTTP/1.x: the guest's bytes, each request head checked before it goes upstream. */
struct http {
	struct kiln_body body;
	bool in_body;
	bool upgrade_after_body;	/* the request asked for an Upgrade: hold after its body */
	bool hold;		/* wait for the response: 101 splices, anything else goes on */
	bool spliced;		/* switched protocols (or TLS): bytes go through unchecked */
};

/*
 * Sends what of pb[0..*pn) may go upstream, keeping the rest (an incomplete head) at its start.
 * Returns 0, or -1 when the connection must be reset (a refused request, bad framing).
 */
static int pump_guest(struct conn *c, struct http *h, uint8_t *pb, size_t *pn)
{
	size_t off = 0;
	int rc = 0;
	while (off < *pn && !h->hold) {
		const uint8_t *d = pb + off;
		size_t n = *pn - off;
		if (h->spliced) {
			rc = write_all(c->u, d, n);
			off = *pn;
			break;
		}
		if (h->in_body) {
			int done;
			long k = kiln_body_feed(&h->body, d, n, &done);
			if (k < 0) {
				refuse(c, KILN_PROXY_UNSUPPORTED, "bad request body framing", c->host);
				return -1;
			}
			if (k > 0 && write_all(c->u, d, (size_t)k) < 0)
				return -1;
			off += (size_t)k;
			if (done) {
				h->in_body = false;
				if (h->upgrade_after_body)
					h->hold = true;
				h->upgrade_after_body = false;
			}
			continue;
		}
		struct kiln_sni s;
		enum kiln_sni_status st = kiln_sni_parse_http(d, n, &s);
		if (st == KILN_SNI_MORE) {
			if (n >= KILN_SNI_MAX_HEAD) {
				refuse(c, KILN_PROXY_UNSUPPORTED, "request head too large", NULL);
				return -1;
			}
			break;
		}
		if (st != KILN_SNI_OK) {
			refuse(c, st == KILN_SNI_NONAME ? KILN_PROXY_NO_NAME : KILN_PROXY_UNSUPPORTED,
			       st == KILN_SNI_REFUSED ? "CONNECT, HTTP/2 or h2c" :
				  st == KILN_SNI_TOOBIG ? "request head too large" :
				  "not a well-formed HTTP/1.x request with a Host", NULL);
			return -1;
		}
		enum kiln_proxy_decision dec = name_check(c, s.host, false);
		if (dec != KILN_PROXY_ALLOWED) {
			refuse(c, dec, kiln_proxy_decision_name(dec), s.host);
			return -1;
		}
		snprintf(c->host, sizeof(c->host), "%s", s.host);
		if (write_all(c->u, d, s.head_len) < 0)
			return -1;
		off += s.head_len;
		kiln_body_start(&h->body, &s);
		h->in_body = s.body != KILN_BODY_NONE;
		if (s.upgrade) {
			if (h->in_body)
				h->upgrade_after_body = true;
			else
				h->hold = true;
		}
	}
	memmove(pb, pb + off, *pn - off);
	*pn -= off;
	return rc;
}

static void conn_run(struct conn *c)
{
	uint8_t *pb = malloc(KILN_SNI_MAX_IN);
	uint8_t *ub = malloc(COPY_BUF);
	size_t pn = 0;
	struct kiln_sni s;
	enum kiln_sni_status st = KILN_SNI_MORE;
	uint32_t tmo = c->px->cfg.name_timeout_ms;
	uint64_t end = now_ms() + tmo;
	/* splice pipes: guest to upstream, upstream to guest (-1: copy through user space) */
	int gpp[2] = {-1, -1}, upp[2] = {-1, -1};
	size_t gps = 0, ups = 0;
	if (!pb || !ub)
		goto reset;

	/* The name, within the timeout. */
	while ((st = kiln_sni_parse(pb, pn, &s)) == KILN_SNI_MORE) {
		uint64_t t = now_ms();
		if (pn >= KILN_SNI_MAX_IN) {
			st = KILN_SNI_TOOBIG;
			break;
		}
		if (t >= end || dead(c))
			break;
		struct pollfd p = {.fd = c->g, .events = POLLIN};
		int r = poll(&p, 1, (int)(end - t < RECHECK_MS ? end - t : RECHECK_MS));
		if (r <= 0)
			continue;
		ssize_t k = read(c->g, pb + pn, KILN_SNI_MAX_IN - pn);
		if (k <= 0)
			break;
		pn += (size_t)k;
	}
	if (st != KILN_SNI_OK) {
		refuse(c, st == KILN_SNI_MORE || st == KILN_SNI_NONAME ? KILN_PROXY_NO_NAME
								       : KILN_PROXY_UNSUPPORTED,
		       st == KILN_SNI_MORE ? "no name within the time allowed" :
			  st == KILN_SNI_REFUSED ? "CONNECT, HTTP/2, h2c or encrypted ClientHello" :
			  st == KILN_SNI_NONAME ? "no name (no SNI, no Host)" :
			  st == KILN_SNI_TOOBIG ? "ClientHello or request head too large" :
			  "neither TLS nor HTTP/1.x", NULL);
		goto reset;
	}
	enum kiln_proxy_decision d = name_check(c, s.host, false);
	if (d != KILN_PROXY_ALLOWED) {
		refuse(c, d, kiln_proxy_decision_name(d), s.host);
		goto reset;
	}
	snprintf(c->host, sizeof(c->host), "%s", s.host);
	note_allowed(c);
	if (c->px->cfg.handoff &&
	    c->px->cfg.handoff(c->px->cfg.handoff_arg, c->sb->id, c->g, pb, pn, s.host, &c->dst) == 1) {
		c->g = -1;	/* it is the hand-off's now */
		goto out;
	}
	if (dial(c) < 0) {
		log_info("sniproxy: %s: upstream of \"%s\" port %u unreachable", c->sb->id, c->host,
			 c->dport);
		goto reset;
	}
	count(c, offsetof(struct kiln_sniproxy_stats, spliced));
	/* both sockets block on writes, for at most WRITE_TIMEOUT_S each */
	struct timeval wt = {.tv_sec = WRITE_TIMEOUT_S};
	int fl = fcntl(c->u, F_GETFL);
	if (fl < 0 || fcntl(c->u, F_SETFL, fl & ~O_NONBLOCK) < 0 ||
	    setsockopt(c->g, SOL_SOCKET, SO_SNDTIMEO, &wt, sizeof(wt)) < 0 ||
	    setsockopt(c->u, SOL_SOCKET, SO_SNDTIMEO, &wt, sizeof(wt)) < 0)
		goto reset;
	struct http h = {.spliced = s.kind == KILN_SNI_TLS};
	if (pump_guest(c, &h, pb, &pn) < 0)
		goto reset;

	/* bytes go through the kernel (splice) whenever no one needs to see them: from the
	 * upstream unless a 101 is awaited, from the guest once the connection is opaque (TLS,
	 * or switched protocols) and nothing of it waits in pb */
	if (pipe_open(gpp, &gps) < 0 || pipe_open(upp, &ups) < 0) {
		pipe_close(gpp);
		pipe_close(upp);
	}
	bool g_eof = false, u_eof = false;
	uint64_t last_check = now_ms();
	while (!(g_eof && u_eof)) {
		struct pollfd p[2] = {
			{.fd = c->g, .events = (g_eof || h.hold || pn == KILN_SNI_MAX_IN) ? 0 : POLLIN},
			{.fd = c->u, .events = u_eof ? 0 : POLLIN},
		};
		int r = poll(p, 2, RECHECK_MS);
		if (r < 0 && errno != EINTR)
			goto reset;
		if (dead(c))
			goto cut;
		if (now_ms() - last_check >= RECHECK_MS) {
			last_check = now_ms();
			if (!name_ok(c, c->host, true)) {
				log_info("sniproxy: %s: cut \"%s\": the rules no longer allow it",
					 c->sb->id, c->host);
				count(c, offsetof(struct kiln_sniproxy_stats, cut));
				note(c->px, c->sb->id, &c->note, KILN_PROXY_CUT, c->host, NULL);
				goto cut;
			}
		}
		if (r <= 0)
			continue;
		if (!g_eof && (p[0].revents & (POLLIN | POLLHUP | POLLERR)) && h.spliced && !pn &&
		    gpp[0] >= 0) {
			ssize_t k = splice_once(c->g, c->u, gpp, gps);
			if (k < 0 && k != -EAGAIN)
				goto reset;
			if (k == 0) {
				g_eof = true;
				shutdown(c->u, SHUT_WR);
			}
		} else if (!g_eof && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
			ssize_t k = read(c->g, pb + pn, KILN_SNI_MAX_IN - pn);
			if (k < 0 && errno != EAGAIN && errno != EINTR)
				goto reset;
			if (k == 0) {
				g_eof = true;
				shutdown(c->u, SHUT_WR);
			} else if (k > 0) {
				pn += (size_t)k;
				if (pump_guest(c, &h, pb, &pn) < 0)
					goto reset;
			}
		}
		if (!u_eof && (p[1].revents & (POLLIN | POLLHUP | POLLERR)) && !h.hold &&
		    upp[0] >= 0) {
			ssize_t k = splice_once(c->u, c->g, upp, ups);
			if (k < 0 && k != -EAGAIN)
				goto reset;
			if (k == 0) {
				u_eof = true;
				shutdown(c->g, SHUT_WR);
			} else if (k > 0 && pn && pump_guest(c, &h, pb, &pn) < 0) {
				goto reset;
			}
		} else if (!u_eof && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
			ssize_t k = read(c->u, ub, COPY_BUF);
			if (k < 0 && errno != EAGAIN && errno != EINTR)
				goto reset;
			if (k == 0) {
				u_eof = true;
				shutdown(c->g, SHUT_WR);
			} else if (k > 0) {
				if (h.hold) {
					/* only a 101 answer switches the connection to opaque bytes */
					h.hold = false;
					h.spliced = k >= 12 && (memcmp(ub, "HTTP/1.1 101", 12) == 0 ||
								memcmp(ub, "HTTP/1.0 101", 12) == 0);
				}
				if (write_all(c->g, ub, (size_t)k) < 0)
					goto reset;
				if (pn && pump_guest(c, &h, pb, &pn) < 0)
					goto reset;
			}
		}
	}
	goto out;
cut:
reset:
	rst_close(c->u);
	c->u = -1;
	rst_close(c->g);
	c->g = -1;
out:
	if (c->u >= 0)
		close(c->u);
	if (c->g >= 0)
		close(c->g);
	pipe_close(gpp);
	pipe_close(upp);
	free(pb);
	free(ub);
}

static void *conn_main(void *arg)
{
	struct conn *c = arg;
	conn_run(c);
	struct kiln_sniproxy *px = c->px;
	pthread_mutex_lock(&px->mu);
	c->sb->st.live--;
	px->st.live--;
	pthread_cond_broadcast(&px->gone);
	pthread_mutex_unlock(&px->mu);
	free(c);
	return NULL;
}

/* Takes a new connection from a listener of sb: caps first, then its thread. */
static void accept_one(struct kiln_sniproxy *px, struct psb *sb, int lfd)
{
	struct sockaddr_storage peer;
	socklen_t pl = sizeof(peer);
	int g = accept4(lfd, (struct sockaddr *)&peer, &pl, SOCK_CLOEXEC);
	if (g < 0)
		return;
	struct conn *c = calloc(1, sizeof(*c));
	socklen_t dl = sizeof(c ? c->dst : peer);
	if (!c || getsockname(g, (struct sockaddr *)&c->dst, &dl) < 0) {
		free(c);
		rst_close(g);
		return;
	}
	c->px = px;
	c->sb = sb;
	c->g = g;
	c->u = -1;
	if (px->cfg.note && kiln_conn_note_flow(&c->note, g) < 0)
		c->note.family = 0;	/* noted without its flow: the log cannot match it */
	if (c->dst.ss_family == AF_INET) {
		struct sockaddr_in *a = (struct sockaddr_in *)&c->dst;
		c->family = 4;
		memcpy(c->addr, &a->sin_addr, 4);
		c->dport = ntohs(a->sin_port);
	} else {
		struct sockaddr_in6 *a = (struct sockaddr_in6 *)&c->dst;
		c->family = 6;
		memcpy(c->addr, &a->sin6_addr, 16);
		c->dport = ntohs(a->sin6_port);
	}
	uint64_t t = now_ms();
	pthread_mutex_lock(&px->mu);
	const char *over = NULL;
	if (sb->dead)
		over = "removal of the sandbox";
	else if (sb->st.live >= px->cfg.max_conns_per_sandbox)
		over = "sniproxy_conns_per_sandbox";
	else if (px->st.live >= px->cfg.max_conns)
		over = "sniproxy_conns";
	else if (!bucket_take(&sb->hs, t))
		over = "sniproxy_handshakes_per_sandbox";
	else if (!bucket_take(&px->hs, t))
		over = "sniproxy_handshakes";
	uint64_t n_over = 0;
	if (over) {
		n_over = ++sb->st.over_cap;
		px->st.over_cap++;
	} else {
		sb->st.accepted++;
		px->st.accepted++;
		sb->st.live++;
		px->st.live++;
	}
	pthread_mutex_unlock(&px->mu);
	if (over) {
		if (worth_logging(n_over))
			log_info("sniproxy: %s: connection reset: over %s (%llu so far)", sb->id, over,
				 (unsigned long long)n_over);
		kiln_policy_count_drop(sb->pol);
		if (strncmp(over, "sniproxy_", 9) == 0)
			note(px, sb->id, &c->note, KILN_PROXY_OVER_CAP, NULL, over);
		rst_close(g);
		free(c);
		return;
	}
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&at, 256 * 1024);
	pthread_t th;
	int rc = pthread_create(&th, &at, conn_main, c);
	pthread_attr_destroy(&at);
	if (rc != 0) {
		pthread_mutex_lock(&px->mu);
		sb->st.live--;
		px->st.live--;
		pthread_mutex_unlock(&px->mu);
		rst_close(g);
		free(c);
	}
}

static void *accept_main(void *arg)
{
	struct kiln_sniproxy *px = arg;
	size_t cap = 0;
	struct pollfd *pfd = NULL;
	struct psb **who = NULL;
	for (;;) {
		pthread_mutex_lock(&px->mu);
		px->epoch++;	/* every sandbox removed before now is out of this round's set */
		pthread_cond_broadcast(&px->gone);
		if (px->stop) {
			pthread_mutex_unlock(&px->mu);
			break;
		}
		size_t n = 1;
		for (struct psb *sb = px->sbs; sb; sb = sb->next)
			n += 2;
		if (n > cap) {
			struct pollfd *p2 = realloc(pfd, n * sizeof(*pfd));
			struct psb **w2 = p2 ? realloc(who, n * sizeof(*who)) : NULL;
			if (p2)
				pfd = p2;
			if (w2)
				who = w2;
			if (!p2 || !w2) {
				pthread_mutex_unlock(&px->mu);
				usleep(100000);
				continue;
			}
			cap = n;
		}
		n = 0;
		pfd[n] = (struct pollfd){.fd = px->wake_fd, .events = POLLIN};
		who[n++] = NULL;
		for (struct psb *sb = px->sbs; sb; sb = sb->next) {
			if (sb->dead)
				continue;
			pfd[n] = (struct pollfd){.fd = sb->l4, .events = POLLIN};
			who[n++] = sb;
			pfd[n] = (struct pollfd){.fd = sb->l6, .events = POLLIN};
			who[n++] = sb;
		}
		pthread_mutex_unlock(&px->mu);
		int r = poll(pfd, n, 1000);
		if (r <= 0)
			continue;
		if (pfd[0].revents & POLLIN) {
			uint64_t v;
			if (read(px->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
				log_warn("sniproxy: wake: %s", strerror(errno));
			continue;	/* the set changed: the descriptors may be gone */
		}
		for (size_t i = 1; i < n; i++)
			if (pfd[i].revents & POLLIN)
				accept_one(px, who[i], pfd[i].fd);
	}
	free(pfd);
	free(who);
	return NULL;
}

static void wake(struct kiln_sniproxy *px)
{
	uint64_t one = 1;
	if (write(px->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
		log_warn("sniproxy: wake: %s", strerror(errno));
}

enum kiln_err kiln_sniproxy_start(const struct kiln_sniproxy_config *cfg,
				  struct kiln_sniproxy **out, struct kiln_error *err)
{
	struct kiln_sniproxy *px = calloc(1, sizeof(*px));
	if (!px)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	px->cfg = *cfg;
	if (!px->cfg.max_conns_per_sandbox)
		px->cfg.max_conns_per_sandbox = KILN_SNIPROXY_CONNS_PER_SANDBOX_DEFAULT;
	if (!px->cfg.max_conns)
		px->cfg.max_conns = KILN_SNIPROXY_CONNS_DEFAULT;
	if (!px->cfg.handshakes_per_sandbox)
		px->cfg.handshakes_per_sandbox = KILN_SNIPROXY_HANDSHAKES_PER_SANDBOX_DEFAULT;
	if (!px->cfg.handshakes)
		px->cfg.handshakes = KILN_SNIPROXY_HANDSHAKES_DEFAULT;
	if (!px->cfg.name_timeout_ms)
		px->cfg.name_timeout_ms = KILN_SNIPROXY_NAME_TIMEOUT_MS;
	bucket_init(&px->hs, px->cfg.handshakes);
	pthread_mutex_init(&px->mu, NULL);
	pthread_cond_init(&px->gone, NULL);
	px->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (px->wake_fd < 0 || pthread_create(&px->thread, NULL, accept_main, px) != 0) {
		enum kiln_err e = kiln_error_set(err, KILN_E_IO, "start the name-checking proxy: %s",
						 strerror(errno));
		if (px->wake_fd >= 0)
			close(px->wake_fd);
		free(px);
		return e;
	}
	*out = px;
	return KILN_OK;
}

/* A listener in the sandbox's netns on the gateway's address, NP_PROXY_PORT, transparent. */
static int listener(const struct kiln_sbnet *net, int family)
{
	int fd = kiln_sbnet_socket(net, family == 4 ? AF_INET : AF_INET6,
				   SOCK_STREAM | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return fd;
	int one = 1;
	int rc = setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (family == 4) {
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(NP_PROXY_PORT)};
		inet_pton(AF_INET, KILN_GATEWAY_IP4, &a.sin_addr);
		if (rc == 0)
			rc = setsockopt(fd, SOL_IP, IP_TRANSPARENT, &one, sizeof(one));
		if (rc == 0)
			rc = bind(fd, (struct sockaddr *)&a, sizeof(a));
	} else {
		struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(NP_PROXY_PORT)};
		inet_pton(AF_INET6, KILN_GATEWAY_IP6, &a.sin6_addr);
		if (rc == 0)
			rc = setsockopt(fd, SOL_IPV6, IPV6_V6ONLY, &one, sizeof(one));
		if (rc == 0)
			rc = setsockopt(fd, SOL_IPV6, IPV6_TRANSPARENT, &one, sizeof(one));
		if (rc == 0)
			rc = bind(fd, (struct sockaddr *)&a, sizeof(a));
	}
	if (rc == 0)
		rc = listen(fd, 128);
	if (rc < 0) {
		rc = -errno;
		close(fd);
		return rc;
	}
	return fd;
}

/*
 * The policy route: packets marked NP_PROXY_MARK are for a local socket, whatever address. Set
 * by netlink from inside the netns (netpolicy/rtnl.h: an `ip` process per step cost most of a
 * sandbox's network setup on a loaded host).
 */
static int proxy_route_here(void)
{
	struct rtnl r;
	int rc = rtnl_open(&r), lo = (int)if_nametoindex("lo");

	if (rc < 0)
		return rc;
	if (lo <= 0)
		rc = -ENODEV;
	for (int v6 = 0; v6 < 2 && rc == 0; v6++) {
		int fam = v6 ? AF_INET6 : AF_INET;

		/* one rule: a restarted node deletes the one it made before adding it again */
		rtnl_rule_fwmark(&r, fam, NP_PROXY_MARK, NP_PROXY_TABLE, false);
		rc = rtnl_rule_fwmark(&r, fam, NP_PROXY_MARK, NP_PROXY_TABLE, true);
		if (rc == 0)
			rc = rtnl_route_local_all(&r, fam, NP_PROXY_TABLE, lo);
	}
	rtnl_close(&r);
	return rc;
}

static enum kiln_err proxy_route(const struct kiln_sbnet *net, struct kiln_error *err)
{
	int saved, rc = kiln_sbnet_enter(net, &saved);

	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "enter \"%s\": %s", net->netns, strerror(-rc));
	rc = proxy_route_here();
	if (kiln_sbnet_leave(saved) < 0) {
		log_error("cannot return from netns \"%s\"", net->netns);
		abort();
	}
	if (rc < 0)
		return kiln_error_set(err, KILN_E_IO, "policy route of the name-checking proxy in "
				      "\"%s\": %s", net->netns, strerror(-rc));
	return KILN_OK;
}

enum kiln_err kiln_sniproxy_add(struct kiln_sniproxy *px, const struct kiln_sbnet *net,
				struct kiln_policy *pol, struct kiln_error *err)
{
	enum kiln_err e = proxy_route(net, err);
	if (e != KILN_OK)
		return e;
	int l4 = listener(net, 4), l6 = l4 >= 0 ? listener(net, 6) : -1;
	if (l4 < 0 || l6 < 0) {
		e = kiln_error_set(err, KILN_E_IO, "name-checking proxy listener in \"%s\": %s",
				   net->netns, strerror(-(l4 < 0 ? l4 : l6)));
		if (l4 >= 0)
			close(l4);
		return e;
	}
	struct psb *sb = calloc(1, sizeof(*sb));
	if (!sb) {
		close(l4);
		close(l6);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	snprintf(sb->id, sizeof(sb->id), "%s", net->id);
	sb->l4 = l4;
	sb->l6 = l6;
	sb->pol = pol;
	bucket_init(&sb->hs, px->cfg.handshakes_per_sandbox);
	pthread_mutex_lock(&px->mu);
	sb->next = px->sbs;
	px->sbs = sb;
	pthread_mutex_unlock(&px->mu);
	wake(px);
	if ((e = kiln_policy_set_namecheck(pol, true, err)) != KILN_OK) {
		kiln_sniproxy_remove(px, net->id);
		return e;
	}
	return KILN_OK;
}

void kiln_sniproxy_remove(struct kiln_sniproxy *px, const char *sandbox_net_id)
{
	pthread_mutex_lock(&px->mu);
	struct psb **pp = &px->sbs, *sb = NULL;
	for (; *pp; pp = &(*pp)->next)
		if (strcmp((*pp)->id, sandbox_net_id) == 0 && !(*pp)->dead) {
			sb = *pp;
			break;
		}
	if (!sb) {
		pthread_mutex_unlock(&px->mu);
		return;
	}
	sb->dead = true;
	uint64_t epoch = px->epoch;
	pthread_mutex_unlock(&px->mu);
	/* NP_CFG_NAMECHECK stays on: while no proxy listens (a node restarting with its VMs up)
	 * such SYNs are dropped, never let through unchecked */
	wake(px);
	pthread_mutex_lock(&px->mu);
	/* the accepting thread's next round no longer has its listeners; then its connections end
	 * (each sees `dead` within RECHECK_MS) */
	while (px->epoch == epoch && !px->stop)
		pthread_cond_wait(&px->gone, &px->mu);
	while (sb->st.live > 0)
		pthread_cond_wait(&px->gone, &px->mu);
	for (pp = &px->sbs; *pp; pp = &(*pp)->next)
		if (*pp == sb) {
			*pp = sb->next;
			break;
		}
	pthread_mutex_unlock(&px->mu);
	close(sb->l4);
	close(sb->l6);
	free(sb);
}

int kiln_sniproxy_stats(struct kiln_sniproxy *px, const char *sandbox_net_id,
			struct kiln_sniproxy_stats *out)
{
	int rc = -1;
	pthread_mutex_lock(&px->mu);
	if (!sandbox_net_id) {
		*out = px->st;
		rc = 0;
	} else {
		for (struct psb *sb = px->sbs; sb; sb = sb->next)
			if (strcmp(sb->id, sandbox_net_id) == 0 && !sb->dead) {
				*out = sb->st;
				rc = 0;
			}
	}
	pthread_mutex_unlock(&px->mu);
	return rc;
}

void kiln_sniproxy_stop(struct kiln_sniproxy *px)
{
	if (!px)
		return;
	for (;;) {
		pthread_mutex_lock(&px->mu);
		struct psb *sb = px->sbs;
		while (sb && sb->dead)
			sb = sb->next;
		char id[KILN_NET_ID_MAX + 1] = "";
		if (sb)
			snprintf(id, sizeof(id), "%s", sb->id);
		pthread_mutex_unlock(&px->mu);
		if (!id[0])
			break;
		kiln_sniproxy_remove(px, id);
	}
	pthread_mutex_lock(&px->mu);
	px->stop = true;
	while (px->st.live > 0)
		pthread_cond_wait(&px->gone, &px->mu);
	pthread_mutex_unlock(&px->mu);
	wake(px);
	pthread_join(px->thread, NULL);
	close(px->wake_fd);
	pthread_mutex_destroy(&px->mu);
	pthread_cond_destroy(&px->gone);
	free(px);
}
