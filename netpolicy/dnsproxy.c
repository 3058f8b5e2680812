/*
 * dnsproxy.c - the DNS proxy: one thread, every sandbox's UDP socket on 172.16.0.1:53, one
 * upstream resolver (see dns.h).
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

#define MAX_PENDING 1024
#define MAX_LEARNT 1024
#define MAX_SANDBOXES 4096
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
	int fd;
	struct kiln_policy *pol;
	bool dead;
	struct learnt learnt[MAX_LEARNT];
	size_t nlearnt;
	uint64_t seq;
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
	struct pending pend[MAX_PENDING];
	uint64_t last_gc;
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
	enum kiln_egress_mode mode;
	uint16_t ports[16];
	size_t np = kiln_policy_host_ports(sb->pol, q.name, ports, 16, &mode);
	if (mode == KILN_EGRESS_ALLOWLIST && np == 0) {
		uint8_t out[KILN_DNS_MAX_MSG];
		size_t len = kiln_dns_make_error(msg, q.end, KILN_DNS_RCODE_NXDOMAIN, out, sizeof(out));
		if (len)
			sendto(sb->fd, out, len, MSG_DONTWAIT, (struct sockaddr *)&from, flen);
		log_debug("dns: \"%s\" not allowed for \"%s\"", q.name, sb->id);
		return;
	}
	struct pending *slot = NULL;
	for (size_t i = 0; i < MAX_PENDING && !slot; i++)
		if (!px->pend[i].used)
			slot = &px->pend[i];
	if (!slot)
		return;	/* overloaded: the client retries */
	uint16_t id;
	bool clash;
	do {
		if (getrandom(&id, sizeof(id), 0) != sizeof(id))
			return;
		clash = false;
		for (size_t i = 0; i < MAX_PENDING && !clash; i++)
			clash = px->pend[i].used && px->pend[i].up_id == id;
	} while (clash);
	slot->used = true;
	slot->sb = sb;
	slot->up_id = id;
	slot->client = from;
	slot->clen = flen;
	slot->q = q;
	slot->deadline = now_ns() + (uint64_t)px->cfg.timeout_ms * 1000000ull;
	msg[0] = (uint8_t)(id >> 8);
	msg[1] = (uint8_t)id;
	if (sendto(px->up_fd, msg, (size_t)n, MSG_DONTWAIT, (struct sockaddr *)&px->up, px->uplen) <
	    0) {
		slot->used = false;
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
	struct pending *p = NULL;
	for (size_t i = 0; i < MAX_PENDING && !p; i++)
		if (px->pend[i].used && px->pend[i].up_id == id)
			p = &px->pend[i];
	if (!p)
		return;
	struct sb *sb = p->sb;
	struct kiln_dns_addr addrs[64];
	int rcode = 0;
	int na = kiln_dns_parse_answer(msg, (size_t)n, &p->q, addrs, 64, &rcode);
	if (na < 0)
		return;	/* not an answer to this question: keep waiting for the real one */
	p->used = false;
	if (sb->dead)
		return;
	enum kiln_egress_mode mode;
	uint16_t ports[16];
	size_t np = kiln_policy_host_ports(sb->pol, p->q.name, ports, 16, &mode);
	msg[0] = (uint8_t)(p->q.id >> 8);
	msg[1] = (uint8_t)p->q.id;
	if (mode == KILN_EGRESS_ALLOWLIST) {
		if (np == 0) {
			/* the rules changed while the query was out */
			uint8_t out[KILN_DNS_MAX_MSG];
			size_t len = kiln_dns_make_error(msg, p->q.end, KILN_DNS_RCODE_NXDOMAIN, out,
							 sizeof(out));
			if (len)
				sendto(sb->fd, out, len, MSG_DONTWAIT, (struct sockaddr *)&p->client,
				       p->clen);
			return;
		}
		size_t cap = px->cfg.max_addrs_per_name;
		size_t take = (size_t)na < cap ? (size_t)na : cap;
		for (size_t i = 0; i < take; i++)
			for (size_t j = 0; j < np; j++)
				learn(px, sb, p->q.name, &addrs[i], ports[j], cap * np);
	}
	/* released only now: every address is in the allow map before the guest sees it */
	sendto(sb->fd, msg, (size_t)n, MSG_DONTWAIT, (struct sockaddr *)&p->client, p->clen);
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
		for (size_t i = 0; i < MAX_PENDING; i++)
			if (px->pend[i].used && px->pend[i].sb == sb)
				px->pend[i].used = false;
		close(sb->fd);
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
	struct pollfd *pfd = calloc(MAX_SANDBOXES + 2, sizeof(*pfd));
	struct sb **who = calloc(MAX_SANDBOXES + 2, sizeof(*who));
	if (!pfd || !who) {
		log_error("dns: out of memory");
		free(pfd);
		free(who);
		return NULL;
	}
	for (;;) {
		pthread_mutex_lock(&px->mu);
		reap(px);
		if (px->stop) {
			pthread_mutex_unlock(&px->mu);
			break;
		}
		size_t n = 0;
		pfd[n++] = (struct pollfd){.fd = px->wake_fd, .events = POLLIN};
		pfd[n++] = (struct pollfd){.fd = px->up_fd, .events = POLLIN};
		for (struct sb *sb = px->sbs; sb && n < MAX_SANDBOXES + 2; sb = sb->next) {
			who[n] = sb;
			pfd[n++] = (struct pollfd){.fd = sb->fd, .events = POLLIN};
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
		for (size_t i = 2; i < n; i++)
			if ((pfd[i].revents & POLLIN) && !who[i]->dead)
				for (int k = 0; k < 64; k++)
					handle_query(px, who[i]);
		uint64_t now = now_ns();
		for (size_t i = 0; i < MAX_PENDING; i++)
			if (px->pend[i].used && px->pend[i].deadline < now)
				px->pend[i].used = false;	/* the client retries */
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
	px->cfg.upstream = NULL;
	if (parse_upstream(cfg->upstream, &px->up, &px->uplen) < 0) {
		free(px);
		return kiln_error_set(err, KILN_E_INVALID, "invalid DNS upstream \"%s\"",
				      cfg->upstream ? cfg->upstream : "");
	}
	px->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	px->up_fd = socket(px->up.ss_family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (px->wake_fd < 0 || px->up_fd < 0) {
		enum kiln_err e = kiln_error_set(err, KILN_E_IO, "dns sockets: %s", strerror(errno));
		if (px->wake_fd >= 0)
			close(px->wake_fd);
		if (px->up_fd >= 0)
			close(px->up_fd);
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
	struct sb *sb = calloc(1, sizeof(*sb));
	if (!sb) {
		close(fd);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	snprintf(sb->id, sizeof(sb->id), "%s", net->id);
	sb->fd = fd;
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
	free(px);
}
