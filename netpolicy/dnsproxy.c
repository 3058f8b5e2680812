/*
 * dnsproxy.c - the DNS proxy: one thread, every sandbox's UDP and TCP sockets on 172.16.0.1:53,
 * one upstream resolver (see dns.h).
 *
 * UDP queries go upstream over one shared UDP socket, matched back by a random id (unique among
 * every sandbox's pending queries). Each sandbox has its own table of pending queries
 * (kiln_dns_config.max_pending), so a guest flooding the proxy fills only its own. A TCP
 * connection from a guest (RFC 7766: two-byte length, then the message; several queries may
 * follow one another) gets an upstream TCP connection of its own per query, so that answers too
 * large for UDP come whole. Both paths answer through the same policy: names no rule covers get
 * NXDOMAIN, covered answers are learnt before the guest sees them. Everything is non-blocking in
 * the one poll loop; each TCP step has a deadline.
 */
#include "netpolicy/dns.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define MAX_LEARNT 1024
#define MAX_SANDBOXES 4096
#define MAX_CONNS 256		/* TCP connections from guests, all sandboxes together */
#define MAX_CONNS_PER_SB 16
#define TCP_MSG_MAX KILN_DNS_MAX_TCP_MSG
#define TCP_STEP_NS (10ull * 1000000000ull)	/* a TCP connection's deadline for each step */
#define GC_EVERY_NS (2ull * 1000000000ull)

struct learnt {
	uint64_t name_hash;
	uint64_t seq;
	int family;
	uint8_t addr[16];
	uint16_t port;
};

struct sb {
	char id[KILN_NET_ID_MAX + 1];
	int fd;			/* UDP */
	int tfd;		/* TCP, listening */
	unsigned nconns;
	struct kiln_policy *pol;
	bool dead;
	struct learnt learnt[MAX_LEARNT];
	size_t nlearnt;
	uint64_t seq;
	struct pending *pend;	/* cfg.max_pending slots of UDP queries sent upstream */
	unsigned npend;		/* slots in use */
	struct sb *next;
};

struct pending {
	bool used;
	struct sb *sb;
	uint16_t up_id;
	struct sockaddr_storage client;
	socklen_t clen;
	struct kiln_dns_question q;
	uint64_t deadline;
};

/* A guest's TCP connection, and the upstream connection of the query it is waiting for. */
enum conn_state {
	C_QUERY,	/* reading a query from the guest */
	C_CONNECT,	/* connecting upstream */
	C_ANSWER,	/* reading the answer from upstream */
	C_REPLY,	/* writing the reply to the guest */
};

struct conn {
	struct sb *sb;
	int fd, up;		/* the guest's socket; upstream, or -1 */
	enum conn_state st;
	struct kiln_dns_question q;
	uint8_t buf[2 + TCP_MSG_MAX];	/* the message being read or written, length first */
	size_t have, off;
	uint64_t deadline;
	struct conn *next;
};

struct kiln_dns_proxy {
	pthread_t th;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int wake_fd;
	int up_fd;
	struct sockaddr_storage up;
	socklen_t uplen;
	struct kiln_dns_config cfg;
	struct sb *sbs;
	bool stop;
	struct pending **by_id;	/* 65536: the pending query of each upstream id, or NULL */
	struct conn *conns;
	unsigned nconns;
	uint64_t last_gc;
	uint64_t last_sweep;
};

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t fnv(const char *s)
{
	uint64_t h = 1469598103934665603ull;
	for (; *s; s++)
		h = (h ^ (uint8_t)*s) * 1099511628211ull;
	return h;
}

static int parse_upstream(const char *s, struct sockaddr_storage *ss, socklen_t *len)
{
	char host[INET6_ADDRSTRLEN + 1];
	unsigned port = 53;
	memset(ss, 0, sizeof(*ss));
	if (!s)
		return -1;
	if (s[0] == '[') {
		const char *close = strchr(s, ']');
		if (!close || (size_t)(close - s - 1) >= sizeof(host))
			return -1;
		memcpy(host, s + 1, (size_t)(close - s - 1));
		host[close - s - 1] = '\0';
		if (close[1] == ':')
			port = (unsigned)atoi(close + 2);
		else if (close[1])
			return -1;
	} else {
		const char *colon = strchr(s, ':');
		size_t n = colon ? (size_t)(colon - s) : strlen(s);
		if (n >= sizeof(host))
			return -1;
		memcpy(host, s, n);
		host[n] = '\0';
		if (colon)
			port = (unsigned)atoi(colon + 1);
	}
	if (port == 0 || port > 65535)
		return -1;
	struct sockaddr_in *a4 = (struct sockaddr_in *)ss;
	struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)ss;
	if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
		a4->sin_family = AF_INET;
		a4->sin_port = htons((uint16_t)port);
		*len = sizeof(*a4);
		return 0;
	}
	if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
		a6->sin6_family = AF_INET6;
		a6->sin6_port = htons((uint16_t)port);
		*len = sizeof(*a6);
		return 0;
	}
	return -1;
}

static bool same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
	if (a->ss_family != b->ss_family)
		return false;
	if (a->ss_family == AF_INET) {
		const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
		return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
	}
	const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
	return x->sin6_port == y->sin6_port &&
	       memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(x->sin6_addr)) == 0;
}

/* Learns one address for `name` on `port`, keeping at most `cap` entries per name. */
static void learn(struct kiln_dns_proxy *px, struct sb *sb, const char *name,
		  const struct kiln_dns_addr *a, uint16_t port, size_t cap)
{
	uint64_t h = fnv(name);
	size_t count = 0, oldest = MAX_LEARNT, same = MAX_LEARNT;
	for (size_t i = 0; i < sb->nlearnt; i++) {
		struct learnt *l = &sb->learnt[i];
		if (l->name_hash != h)
			continue;
		if (l->family == a->family && l->port == port && memcmp(l->addr, a->addr, 16) == 0)
			same = i;
		count++;
		if (oldest == MAX_LEARNT || l->seq < sb->learnt[oldest].seq)
			oldest = i;
	}
	uint32_t ttl = a->ttl < px->cfg.min_ttl_s ? px->cfg.min_ttl_s : a->ttl;
	if (ttl > px->cfg.max_ttl_s)
		ttl = px->cfg.max_ttl_s;
	struct kiln_error err = {0};
	if (kiln_policy_dns_learn(sb->pol, name, a->family, a->addr, port, ttl, &err) != KILN_OK) {
		char txt[INET6_ADDRSTRLEN];
		inet_ntop(a->family == 4 ? AF_INET : AF_INET6, a->addr, txt, sizeof(txt));
		log_info("dns: not allowing %s for \"%s\": %s", txt, name, err.msg);
		return;
	}
	if (same != MAX_LEARNT) {
		sb->learnt[same].seq = ++sb->seq;
		return;
	}
	size_t slot;
	if (count >= cap && oldest != MAX_LEARNT) {
		struct learnt *o = &sb->learnt[oldest];
		kiln_policy_dns_forget(sb->pol, name, o->family, o->addr, o->port);
		slot = oldest;
	} else if (sb->nlearnt < MAX_LEARNT) {
		slot = sb->nlearnt++;
	} else {
		slot = 0;	/* table full: reuse the globally oldest slot (its map entry ages out) */
		for (size_t i = 1; i < MAX_LEARNT; i++)
			if (sb->learnt[i].seq < sb->learnt[slot].seq)
				slot = i;
	}
	struct learnt *l = &sb->learnt[slot];
	l->name_hash = h;
	l->seq = ++sb->seq;
	l->family = a->family;
	memcpy(l->addr, a->addr, 16);
	l->port = port;
}

/* Whether the sandbox's rules let `q` be asked upstream (no rules, or one covers the name). */
static bool query_allowed(struct sb *sb, const struct kiln_dns_question *q)
{
	enum kiln_egress_mode mode;
	uint16_t ports[16];
	size_t np = kiln_policy_host_ports(sb->pol, q->name, ports, 16, &mode);

	if (mode == KILN_EGRESS_ALLOWLIST && np == 0) {
		log_debug("dns: \"%s\" not allowed for \"%s\"", q->name, sb->id);
		return false;
	}
	return true;
}

/*
 * An upstream answer `msg` to `q` on its way to the guest, with the addresses it holds
 * (addrs[0..na)): its id set back to the guest's and, under rules, the addresses learnt first.
 * False when the rules no longer cover the name (they changed while the query was out): the
 * guest gets NXDOMAIN instead.
 */
static bool answer_release(struct kiln_dns_proxy *px, struct sb *sb, const struct kiln_dns_question *q,
			   uint8_t *msg, const struct kiln_dns_addr *addrs, int na)
{
	enum kiln_egress_mode mode;
	uint16_t ports[16];
	size_t np = kiln_policy_host_ports(sb->pol, q->name, ports, 16, &mode);

	msg[0] = (uint8_t)(q->id >> 8);
	msg[1] = (uint8_t)q->id;
	if (mode != KILN_EGRESS_ALLOWLIST)
		return true;
	if (np == 0)
		return false;
	size_t cap = px->cfg.max_addrs_per_name;
	size_t take = (size_t)na < cap ? (size_t)na : cap;
	for (size_t i = 0; i < take; i++)
		for (size_t j = 0; j < np; j++)
			learn(px, sb, q->name, &addrs[i], ports[j], cap * np);
	return true;
}

/* Frees a pending slot and its upstream id. */
static void pend_free(struct kiln_dns_proxy *px, struct pending *p)
{
	if (!p->used)
		return;
	if (px->by_id[p->up_id] == p)
		px->by_id[p->up_id] = NULL;
	p->used = false;
	p->sb->npend--;
}

/* Answers the query msg[0..q->end) with an error rcode. */
static void reply_error(struct sb *sb, const uint8_t *msg, const struct kiln_dns_question *q,
			int rcode, const struct sockaddr_storage *to, socklen_t tolen)
{
	uint8_t out[KILN_DNS_MAX_MSG];
	size_t len = kiln_dns_make_error(msg, q->end, rcode, out, sizeof(out));
	if (len)
		sendto(sb->fd, out, len, MSG_DONTWAIT, (const struct sockaddr *)to, tolen);
}

static void handle_query(struct kiln_dns_proxy *px, struct sb *sb)
{
	uint8_t msg[KILN_DNS_MAX_MSG];
	struct sockaddr_storage from;
	socklen_t flen = sizeof(from);
	ssize_t n = recvfrom(sb->fd, msg, sizeof(msg), MSG_DONTWAIT, (struct sockaddr *)&from,
			     &flen);
	if (n <= 0)
		return;
	struct kiln_dns_question q;
	if (kiln_dns_parse_query(msg, (size_t)n, &q) < 0)
		return;	/* not a query we answer */
	if (!query_allowed(sb, &q)) {
		reply_error(sb, msg, &q, KILN_DNS_RCODE_NXDOMAIN, &from, flen);
		return;
	}
	if (sb->npend >= px->cfg.max_pending) {
		/* this sandbox's share is full: it alone is refused, nobody else's slots move */
		reply_error(sb, msg, &q, KILN_DNS_RCODE_REFUSED, &from, flen);
		return;
	}
	struct pending *slot = NULL;
	for (size_t i = 0; i < px->cfg.max_pending && !slot; i++)
		if (!sb->pend[i].used)
			slot = &sb->pend[i];
	uint16_t id = 0;
	bool found = false;
	for (int tries = 0; tries < 32 && !found; tries++) {
		if (getrandom(&id, sizeof(id), 0) != sizeof(id))
			break;
		found = px->by_id[id] == NULL;
	}
	if (!slot || !found) {
		reply_error(sb, msg, &q, KILN_DNS_RCODE_REFUSED, &from, flen);
		return;
	}
	slot->used = true;
	slot->sb = sb;
	slot->up_id = id;
	slot->client = from;
	slot->clen = flen;
	slot->q = q;
	slot->deadline = now_ns() + (uint64_t)px->cfg.timeout_ms * 1000000ull;
	px->by_id[id] = slot;
	sb->npend++;
	msg[0] = (uint8_t)(id >> 8);
	msg[1] = (uint8_t)id;
	if (sendto(px->up_fd, msg, (size_t)n, MSG_DONTWAIT, (struct sockaddr *)&px->up, px->uplen) <
	    0) {
		pend_free(px, slot);
		log_warn("dns: upstream send: %s", strerror(errno));
	}
}

static void handle_answer(struct kiln_dns_proxy *px)
{
	uint8_t msg[KILN_DNS_MAX_MSG];
	struct sockaddr_storage from;
	socklen_t flen = sizeof(from);
	ssize_t n = recvfrom(px->up_fd, msg, sizeof(msg), MSG_DONTWAIT, (struct sockaddr *)&from,
			     &flen);
	if (n < 12 || !same_addr(&from, &px->up))
		return;
	uint16_t id = (uint16_t)((msg[0] << 8) | msg[1]);
	struct pending *p = px->by_id[id];
	if (!p || !p->used)
		return;
	struct sb *sb = p->sb;
	struct kiln_dns_addr addrs[64];
	int rcode = 0;
	int na = kiln_dns_parse_answer(msg, (size_t)n, &p->q, addrs, 64, &rcode);
	if (na < 0)
		return;	/* not an answer to this question: keep waiting for the real one */
	struct pending done = *p;
	pend_free(px, p);
	if (sb->dead)
		return;
	if (!answer_release(px, sb, &done.q, msg, addrs, na)) {
		reply_error(sb, msg, &done.q, KILN_DNS_RCODE_NXDOMAIN, &done.client, done.clen);
		return;
	}
	/* released only now: every address is in the allow map before the guest sees it */
	sendto(sb->fd, msg, (size_t)n, MSG_DONTWAIT, (struct sockaddr *)&done.client, done.clen);
}

/* ---- TCP ---- */

static void conn_close(struct kiln_dns_proxy *px, struct conn *c)
{
	struct conn **pp = &px->conns;

	while (*pp && *pp != c)
		pp = &(*pp)->next;
	if (*pp)
		*pp = c->next;
	close(c->fd);
	if (c->up >= 0)
		close(c->up);
	c->sb->nconns--;
	px->nconns--;
	free(c);
}

static void conn_step(struct conn *c, enum conn_state st)
{
	c->st = st;
	c->have = c->off = 0;
	c->deadline = now_ns() + TCP_STEP_NS;
}

/* Puts the reply msg[0..n) in the connection's buffer, length first, to be written to the guest. */
static void conn_reply(struct conn *c, const uint8_t *msg, size_t n)
{
	conn_step(c, C_REPLY);
	c->buf[0] = (uint8_t)(n >> 8);
	c->buf[1] = (uint8_t)n;
	memmove(c->buf + 2, msg, n);
	c->have = n + 2;
}

/*
 * Reads a length-prefixed message from `fd` into c->buf (c->have bytes so far). Returns 1 when it
 * is whole, 0 for more to come, -1 when the peer closed or failed.
 */
static int read_framed(struct conn *c, int fd)
{
	for (;;) {
		size_t want = c->have < 2 ? 2 : 2 + (((size_t)c->buf[0] << 8) | c->buf[1]);

		if (c->have >= 2 && want == 2)
			return -1;	/* an empty message */
		if (c->have == want)
			return 1;
		ssize_t r = recv(fd, c->buf + c->have, want - c->have, MSG_DONTWAIT);
		if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
			return -1;
		if (r < 0)
			return 0;
		c->have += (size_t)r;
	}
}

/* A whole query from the guest: refused, or sent on its way upstream over a new connection. */
static void conn_query(struct kiln_dns_proxy *px, struct conn *c)
{
	size_t n = c->have - 2;
	uint8_t *msg = c->buf + 2;

	if (kiln_dns_parse_query(msg, n, &c->q) < 0) {
		conn_close(px, c);	/* not a query we answer */
		return;
	}
	if (!query_allowed(c->sb, &c->q)) {
		uint8_t out[KILN_DNS_MAX_MSG];
		size_t len = kiln_dns_make_error(msg, c->q.end, KILN_DNS_RCODE_NXDOMAIN, out, sizeof(out));

		if (!len) {
			conn_close(px, c);
			return;
		}
		conn_reply(c, out, len);
		return;
	}
	c->up = socket(px->up.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (c->up < 0 || (connect(c->up, (struct sockaddr *)&px->up, px->uplen) < 0 && errno != EINPROGRESS)) {
		log_warn("dns: upstream tcp: %s", strerror(errno));
		conn_close(px, c);
		return;
	}
	/* the query stays in the buffer, as it came (length first), until the connection is up */
	c->st = C_CONNECT;
	c->off = 0;
	c->deadline = now_ns() + (uint64_t)px->cfg.timeout_ms * 1000000ull;
}

/* Writes c->buf[c->off..c->have) to `fd`. Returns 1 when all of it is out, 0 for later, -1. */
static int write_rest(struct conn *c, int fd)
{
	while (c->off < c->have) {
		ssize_t w = send(fd, c->buf + c->off, c->have - c->off, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (w < 0)
			return errno == EAGAIN || errno == EINTR ? 0 : -1;
		c->off += (size_t)w;
	}
	return 1;
}

/* The connection's socket `fd` is ready: moves it on as far as it can go. */
static void conn_ready(struct kiln_dns_proxy *px, struct conn *c, int fd)
{
	int r;

	if (c->sb->dead) {
		conn_close(px, c);
		return;
	}
	switch (c->st) {
	case C_QUERY:
		r = read_framed(c, c->fd);
		if (r < 0)
			conn_close(px, c);
		else if (r > 0)
			conn_query(px, c);
		return;
	case C_CONNECT: {
		int soerr = 0;
		socklen_t sl = sizeof(soerr);

		if (fd != c->up || getsockopt(c->up, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0 || soerr) {
			log_warn("dns: upstream tcp: %s", strerror(soerr ? soerr : errno));
			conn_close(px, c);
			return;
		}
		r = write_rest(c, c->up);
		if (r < 0) {
			conn_close(px, c);
		} else if (r > 0) {
			c->st = C_ANSWER;
			c->have = c->off = 0;
		}
		return;
	}
	case C_ANSWER: {
		struct kiln_dns_addr addrs[64];
		int rcode = 0, na;

		r = read_framed(c, c->up);
		if (r < 0) {
			conn_close(px, c);
			return;
		}
		if (r == 0)
			return;
		close(c->up);
		c->up = -1;
		na = kiln_dns_parse_answer(c->buf + 2, c->have - 2, &c->q, addrs, 64, &rcode);
		if (na < 0) {
			conn_close(px, c);	/* not an answer to this question */
			return;
		}
		if (!answer_release(px, c->sb, &c->q, c->buf + 2, addrs, na)) {
			uint8_t out[KILN_DNS_MAX_MSG];
			size_t len = kiln_dns_make_error(c->buf + 2, c->q.end, KILN_DNS_RCODE_NXDOMAIN, out,
							 sizeof(out));
			if (!len) {
				conn_close(px, c);
				return;
			}
			conn_reply(c, out, len);
		} else {
			/* released only now, as over UDP */
			c->st = C_REPLY;
			c->off = 0;
			c->deadline = now_ns() + TCP_STEP_NS;
		}
		conn_ready(px, c, c->fd);
		return;
	}
	case C_REPLY:
		r = write_rest(c, c->fd);
		if (r < 0)
			conn_close(px, c);
		else if (r > 0)
			conn_step(c, C_QUERY);	/* the guest may ask again on the same connection */
		return;
	}
}

static void handle_accept(struct kiln_dns_proxy *px, struct sb *sb)
{
	for (int k = 0; k < 16; k++) {
		int fd = accept4(sb->tfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		struct conn *c;

		if (fd < 0)
			return;
		if (px->nconns >= MAX_CONNS || sb->nconns >= MAX_CONNS_PER_SB || !(c = calloc(1, sizeof(*c)))) {
			close(fd);	/* overloaded: the guest retries */
			continue;
		}
		c->sb = sb;
		c->fd = fd;
		c->up = -1;
		conn_step(c, C_QUERY);
		c->next = px->conns;
		px->conns = c;
		sb->nconns++;
		px->nconns++;
	}
}

static void reap(struct kiln_dns_proxy *px)
{
	struct sb **pp = &px->sbs;
	bool any = false;
	while (*pp) {
		struct sb *sb = *pp;
		if (!sb->dead) {
			pp = &sb->next;
			continue;
		}
		for (size_t i = 0; i < px->cfg.max_pending; i++)
			pend_free(px, &sb->pend[i]);
		free(sb->pend);
		for (struct conn *c = px->conns, *next; c; c = next) {
			next = c->next;
			if (c->sb == sb)
				conn_close(px, c);
		}
		close(sb->fd);
		close(sb->tfd);
		*pp = sb->next;
		free(sb);
		any = true;
	}
	if (any)
		pthread_cond_broadcast(&px->cv);
}

static void *proxy_main(void *arg)
{
	struct kiln_dns_proxy *px = arg;
	size_t max_fds = 2 + 2 * MAX_SANDBOXES + MAX_CONNS;
	struct pollfd *pfd = calloc(max_fds, sizeof(*pfd));
	struct sb **who = calloc(max_fds, sizeof(*who));
	struct conn **whoc = calloc(max_fds, sizeof(*whoc));
	if (!pfd || !who || !whoc) {
		log_error("dns: out of memory");
		free(pfd);
		free(who);
		free(whoc);
		return NULL;
	}
	for (;;) {
		pthread_mutex_lock(&px->mu);
		reap(px);
		if (px->stop) {
			pthread_mutex_unlock(&px->mu);
			break;
		}
		size_t n = 0, nsb;
		pfd[n++] = (struct pollfd){.fd = px->wake_fd, .events = POLLIN};
		pfd[n++] = (struct pollfd){.fd = px->up_fd, .events = POLLIN};
		for (struct sb *sb = px->sbs; sb && n + 2 <= 2 + 2 * MAX_SANDBOXES; sb = sb->next) {
			who[n] = sb;
			whoc[n] = NULL;
			pfd[n++] = (struct pollfd){.fd = sb->fd, .events = POLLIN};
			who[n] = sb;
			whoc[n] = NULL;
			pfd[n++] = (struct pollfd){.fd = sb->tfd, .events = POLLIN};
		}
		nsb = n;
		for (struct conn *c = px->conns; c && n < max_fds; c = c->next) {
			bool up = c->st == C_CONNECT || c->st == C_ANSWER;
			who[n] = c->sb;
			whoc[n] = c;
			pfd[n++] = (struct pollfd){.fd = up ? c->up : c->fd,
						   .events = c->st == C_CONNECT || c->st == C_REPLY ? POLLOUT
												     : POLLIN};
		}
		pthread_mutex_unlock(&px->mu);

		int r = poll(pfd, n, 500);
		if (r < 0 && errno != EINTR) {
			log_error("dns: poll: %s", strerror(errno));
			break;
		}
		if (pfd[0].revents & POLLIN) {
			uint64_t v;
			if (read(px->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
				log_warn("dns: wake: %s", strerror(errno));
		}
		if (pfd[1].revents & POLLIN)
			for (int k = 0; k < 64; k++)
				handle_answer(px);
		for (size_t i = 2; i < nsb; i++) {
			if (!(pfd[i].revents & POLLIN) || who[i]->dead)
				continue;
			if (pfd[i].fd == who[i]->tfd)
				handle_accept(px, who[i]);
			else
				for (int k = 0; k < 64; k++)
					handle_query(px, who[i]);
		}
		/* connections: each polled once; one may close (and free) itself here */
		for (size_t i = nsb; i < n; i++)
			if (pfd[i].revents)
				conn_ready(px, whoc[i], pfd[i].fd);
		uint64_t now = now_ns();
		for (struct conn *c = px->conns, *next; c; c = next) {
			next = c->next;
			if (c->deadline < now)
				conn_close(px, c);	/* too slow: the guest retries */
		}
		if (now - px->last_sweep > 100000000ull) {
			px->last_sweep = now;
			pthread_mutex_lock(&px->mu);
			for (struct sb *sb = px->sbs; sb; sb = sb->next)
				for (size_t i = 0; sb->npend && i < px->cfg.max_pending; i++)
					if (sb->pend[i].used && sb->pend[i].deadline < now)
						pend_free(px, &sb->pend[i]);	/* it retries */
			pthread_mutex_unlock(&px->mu);
		}
		if (now - px->last_gc > GC_EVERY_NS) {
			px->last_gc = now;
			pthread_mutex_lock(&px->mu);
			for (struct sb *sb = px->sbs; sb; sb = sb->next)
				if (!sb->dead)
					kiln_policy_dns_gc(sb->pol);
			pthread_mutex_unlock(&px->mu);
		}
	}
	free(pfd);
	free(who);
	free(whoc);
	return NULL;
}

enum kiln_err kiln_dns_proxy_start(const struct kiln_dns_config *cfg, struct kiln_dns_proxy **out,
				   struct kiln_error *err)
{
	struct kiln_dns_proxy *px = calloc(1, sizeof(*px));
	if (!px)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	px->cfg = *cfg;
	if (!px->cfg.min_ttl_s)
		px->cfg.min_ttl_s = 30;
	if (!px->cfg.max_ttl_s)
		px->cfg.max_ttl_s = 3600;
	if (px->cfg.max_ttl_s < px->cfg.min_ttl_s)
		px->cfg.max_ttl_s = px->cfg.min_ttl_s;
	if (!px->cfg.max_addrs_per_name)
		px->cfg.max_addrs_per_name = 16;
	if (!px->cfg.timeout_ms)
		px->cfg.timeout_ms = 3000;
	if (!px->cfg.max_pending)
		px->cfg.max_pending = KILN_DNS_PENDING_DEFAULT;
	if (px->cfg.max_pending > KILN_DNS_PENDING_MAX)
		px->cfg.max_pending = KILN_DNS_PENDING_MAX;
	px->cfg.upstream = NULL;
	if (parse_upstream(cfg->upstream, &px->up, &px->uplen) < 0) {
		free(px);
		return kiln_error_set(err, KILN_E_INVALID, "invalid DNS upstream \"%s\"",
				      cfg->upstream ? cfg->upstream : "");
	}
	px->by_id = calloc(65536, sizeof(*px->by_id));
	if (!px->by_id) {
		free(px);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	px->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	px->up_fd = socket(px->up.ss_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (px->wake_fd < 0 || px->up_fd < 0) {
		enum kiln_err e = kiln_error_set(err, KILN_E_IO, "dns sockets: %s", strerror(errno));
		if (px->wake_fd >= 0)
			close(px->wake_fd);
		if (px->up_fd >= 0)
			close(px->up_fd);
		free(px->by_id);
		free(px);
		return e;
	}
	pthread_mutex_init(&px->mu, NULL);
	pthread_cond_init(&px->cv, NULL);
	px->last_gc = now_ns();
	int rc = pthread_create(&px->th, NULL, proxy_main, px);
	if (rc != 0) {
		close(px->wake_fd);
		close(px->up_fd);
		free(px->by_id);
		free(px);
		return kiln_error_set(err, KILN_E_IO, "dns thread: %s", strerror(rc));
	}
	*out = px;
	return KILN_OK;
}

static void wake(struct kiln_dns_proxy *px)
{
	uint64_t one = 1;
	if (write(px->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
		log_warn("dns: wake: %s", strerror(errno));
}

enum kiln_err kiln_dns_proxy_add(struct kiln_dns_proxy *px, const struct kiln_sbnet *net,
				 struct kiln_policy *pol, struct kiln_error *err)
{
	int fd = kiln_sbnet_socket(net, AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return kiln_error_set(err, KILN_E_IO, "dns socket in \"%s\": %s", net->netns,
				      strerror(-fd));
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(53)};
	inet_pton(AF_INET, KILN_GATEWAY_IP4, &a.sin_addr);
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
		enum kiln_err e = kiln_error_set(err, KILN_E_IO, "bind %s:53 in \"%s\": %s",
						 KILN_GATEWAY_IP4, net->netns, strerror(errno));
		close(fd);
		return e;
	}
	int tfd = kiln_sbnet_socket(net, AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
	int one = 1;
	if (tfd < 0 || setsockopt(tfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
	    bind(tfd, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(tfd, 64) < 0) {
		enum kiln_err e = kiln_error_set(err, KILN_E_IO, "tcp %s:53 in \"%s\": %s", KILN_GATEWAY_IP4,
						 net->netns, strerror(tfd < 0 ? -tfd : errno));
		if (tfd >= 0)
			close(tfd);
		close(fd);
		return e;
	}
	struct sb *sb = calloc(1, sizeof(*sb));
	if (sb) {
		sb->pend = calloc(px->cfg.max_pending, sizeof(*sb->pend));
		if (!sb->pend) {
			free(sb);
			sb = NULL;
		}
	}
	if (!sb) {
		close(fd);
		close(tfd);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	snprintf(sb->id, sizeof(sb->id), "%s", net->id);
	sb->fd = fd;
	sb->tfd = tfd;
	sb->pol = pol;
	pthread_mutex_lock(&px->mu);
	sb->next = px->sbs;
	px->sbs = sb;
	pthread_mutex_unlock(&px->mu);
	wake(px);
	return KILN_OK;
}

void kiln_dns_proxy_remove(struct kiln_dns_proxy *px, const char *id)
{
	pthread_mutex_lock(&px->mu);
	for (;;) {
		struct sb *sb = px->sbs;
		while (sb && strcmp(sb->id, id) != 0)
			sb = sb->next;
		if (!sb)
			break;
		sb->dead = true;
		wake(px);
		pthread_cond_wait(&px->cv, &px->mu);
	}
	pthread_mutex_unlock(&px->mu);
}

void kiln_dns_proxy_stop(struct kiln_dns_proxy *px)
{
	if (!px)
		return;
	pthread_mutex_lock(&px->mu);
	px->stop = true;
	for (struct sb *sb = px->sbs; sb; sb = sb->next)
		sb->dead = true;
	pthread_mutex_unlock(&px->mu);
	wake(px);
	pthread_join(px->th, NULL);
	reap(px);
	close(px->wake_fd);
	close(px->up_fd);
	pthread_mutex_destroy(&px->mu);
	pthread_cond_destroy(&px->cv);
	free(px->by_id);
	free(px);
}
