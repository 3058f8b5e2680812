/*
 * sockproxy.h - a Unix-socket proxy a test can cut: it listens on a socket of its own and forwards
 * every connection to a real server's socket (the fixture's Postgres or Redis), byte for byte,
 * from one thread. sockproxy_cut() closes every connection and refuses new ones (each is accepted
 * and closed at once: the client sees the server gone); sockproxy_mend() lets them through again.
 * Header-only, for the metering tests that take a service away from one client while the test
 * itself keeps its own direct connections.
 */
#ifndef KILN_TEST_SOCKPROXY_H
#define KILN_TEST_SOCKPROXY_H

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define SOCKPROXY_MAX 32

struct sockproxy {
	char listen_path[108], target_path[108];
	int lfd;
	int a[SOCKPROXY_MAX], b[SOCKPROXY_MAX];	/* client side, server side; -1 free */
	atomic_bool cut, stop, cut_done;
	pthread_t thr;
};

static int sockproxy_connect(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -1;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

static void sockproxy_drop(struct sockproxy *p, int i)
{
	close(p->a[i]);
	close(p->b[i]);
	p->a[i] = p->b[i] = -1;
}

/* Moves what is readable on `from` to `to`; false when the connection is over. */
static bool sockproxy_pipe(int from, int to)
{
	char buf[65536];
	ssize_t n = read(from, buf, sizeof(buf));

	if (n <= 0)
		return false;
	for (ssize_t off = 0; off < n;) {
		ssize_t w = send(to, buf + off, (size_t)(n - off), MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return false;
		off += w;
	}
	return true;
}

static void *sockproxy_run(void *arg)
{
	struct sockproxy *p = arg;

	while (!atomic_load(&p->stop)) {
		struct pollfd fds[1 + 2 * SOCKPROXY_MAX];
		int idx[1 + 2 * SOCKPROXY_MAX], nf = 1;

		if (atomic_load(&p->cut)) {
			for (int i = 0; i < SOCKPROXY_MAX; i++)
				if (p->a[i] >= 0)
					sockproxy_drop(p, i);
			atomic_store(&p->cut_done, true);
		}
		fds[0] = (struct pollfd){ .fd = p->lfd, .events = POLLIN };
		for (int i = 0; i < SOCKPROXY_MAX; i++) {
			if (p->a[i] < 0)
				continue;
			idx[nf] = i;
			fds[nf++] = (struct pollfd){ .fd = p->a[i], .events = POLLIN };
			idx[nf] = i;
			fds[nf++] = (struct pollfd){ .fd = p->b[i], .events = POLLIN };
		}
		if (poll(fds, (nfds_t)nf, 20) <= 0)
			continue;
		if (fds[0].revents & POLLIN) {
			int c = accept4(p->lfd, NULL, NULL, SOCK_CLOEXEC), s = -1, i;
			if (c >= 0 && !atomic_load(&p->cut))
				s = sockproxy_connect(p->target_path);
			for (i = 0; s >= 0 && i < SOCKPROXY_MAX && p->a[i] >= 0; i++)
				;
			if (s >= 0 && i < SOCKPROXY_MAX) {
				p->a[i] = c;
				p->b[i] = s;
			} else {
				if (c >= 0)
					close(c);
				if (s >= 0)
					close(s);
			}
		}
		for (int k = 1; k < nf; k++) {
			int i = idx[k];
			bool client = k % 2 == 1;
			if (p->a[i] < 0 || !(fds[k].revents & (POLLIN | POLLHUP | POLLERR)))
				continue;
			if (!sockproxy_pipe(client ? p->a[i] : p->b[i], client ? p->b[i] : p->a[i]))
				sockproxy_drop(p, i);
		}
	}
	return NULL;
}

/* Starts a proxy listening on `listen_path` for the server at `target_path`; 0 or -1. */
static __attribute__((unused)) int sockproxy_start(struct sockproxy *p, const char *listen_path,
						   const char *target_path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	memset(p, 0, sizeof(*p));
	for (int i = 0; i < SOCKPROXY_MAX; i++)
		p->a[i] = p->b[i] = -1;
	snprintf(p->listen_path, sizeof(p->listen_path), "%s", listen_path);
	snprintf(p->target_path, sizeof(p->target_path), "%s", target_path);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", listen_path);
	unlink(listen_path);
	p->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (p->lfd < 0 || bind(p->lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
	    listen(p->lfd, 64) < 0) {
		perror("sockproxy");
		return -1;
	}
	if (pthread_create(&p->thr, NULL, sockproxy_run, p) != 0)
		return -1;
	return 0;
}

/* Closes every connection through the proxy and refuses new ones; returns once they are closed. */
static __attribute__((unused)) void sockproxy_cut(struct sockproxy *p)
{
	atomic_store(&p->cut_done, false);
	atomic_store(&p->cut, true);
	while (!atomic_load(&p->cut_done))
		usleep(1000);
}

/* Lets connections through again. */
static __attribute__((unused)) void sockproxy_mend(struct sockproxy *p)
{
	atomic_store(&p->cut, false);
}

static __attribute__((unused)) void sockproxy_stop(struct sockproxy *p)
{
	atomic_store(&p->stop, true);
	pthread_join(p->thr, NULL);
	for (int i = 0; i < SOCKPROXY_MAX; i++)
		if (p->a[i] >= 0)
			sockproxy_drop(p, i);
	close(p->lfd);
	unlink(p->listen_path);
}

#endif
