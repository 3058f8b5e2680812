/*
 * pump.c - a producer thread and a pipe behind a streamed reply (see pump.h).
 */
#include "pump.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct pump {
	int rfd, wfd;
	pump_fn produce;
	void *ctx;
	void (*free_ctx)(void *);
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool ready;
	int status;
	char type[128];
	char retry_after[16];	/* a Retry-After the producer passes on, or "" */
	int refs;		/* the producer thread and the handler side */
};

static void pump_unref(struct pump *p)
{
	int left;

	pthread_mutex_lock(&p->lock);
	left = --p->refs;
	pthread_mutex_unlock(&p->lock);
	if (left)
		return;
	if (p->free_ctx)
		p->free_ctx(p->ctx);
	pthread_mutex_destroy(&p->lock);
	pthread_cond_destroy(&p->cond);
	free(p);
}

static void *pump_thread(void *arg)
{
	struct pump *p = arg;

	p->produce(p, p->ctx);
	pthread_mutex_lock(&p->lock);
	if (!p->ready) {
		p->ready = true;	/* status 0: ended without a reply */
		pthread_cond_broadcast(&p->cond);
	}
	pthread_mutex_unlock(&p->lock);
	close(p->wfd);
	pump_unref(p);
	return NULL;
}

struct pump *pump_start(pump_fn produce, void *ctx, void (*free_ctx)(void *))
{
	struct pump *p = calloc(1, sizeof(*p));
	int fds[2];
	pthread_t t;
	pthread_attr_t attr;

	if (!p || pipe2(fds, O_CLOEXEC) != 0) {
		free(p);
		if (free_ctx)
			free_ctx(ctx);
		return NULL;
	}
	p->rfd = fds[0];
	p->wfd = fds[1];
	p->produce = produce;
	p->ctx = ctx;
	p->free_ctx = free_ctx;
	p->refs = 2;
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->cond, NULL);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&t, &attr, pump_thread, p) != 0) {
		pthread_attr_destroy(&attr);
		close(fds[0]);
		close(fds[1]);
		p->refs = 1;
		pump_unref(p);
		return NULL;
	}
	pthread_attr_destroy(&attr);
	return p;
}

void pump_ready(struct pump *p, int status, const char *content_type)
{
	pthread_mutex_lock(&p->lock);
	if (!p->ready) {
		p->status = status;
		snprintf(p->type, sizeof(p->type), "%s", content_type ? content_type : "");
		p->ready = true;
		pthread_cond_broadcast(&p->cond);
	}
	pthread_mutex_unlock(&p->lock);
}

int pump_write(struct pump *p, const void *data, size_t len)
{
	const char *d = data;

	while (len) {
		ssize_t n = write(p->wfd, d, len);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -1;	/* EPIPE: the reader is gone */
		}
		d += n;
		len -= (size_t)n;
	}
	return 0;
}

void pump_set_retry_after(struct pump *p, const char *value)
{
	pthread_mutex_lock(&p->lock);
	if (!p->ready)
		snprintf(p->retry_after, sizeof(p->retry_after), "%s", value ? value : "");
	pthread_mutex_unlock(&p->lock);
}

const char *pump_retry_after(struct pump *p)
{
	return p->retry_after;
}

int pump_wait_ready(struct pump *p, char *type, size_t type_len)
{
	int status;

	pthread_mutex_lock(&p->lock);
	while (!p->ready)
		pthread_cond_wait(&p->cond, &p->lock);
	status = p->status;
	if (type)
		snprintf(type, type_len, "%s", p->type);
	pthread_mutex_unlock(&p->lock);
	return status;
}

ssize_t pump_read(void *cls, char *buf, size_t max)
{
	struct pump *p = cls;
	ssize_t n;

	do
		n = read(p->rfd, buf, max);
	while (n < 0 && errno == EINTR);
	if (n == 0)
		return -1;
	return n < 0 ? -2 : n;
}

void pump_release(void *cls)
{
	struct pump *p = cls;

	/* Closing the read end makes the producer's next write fail with EPIPE. */
	close(p->rfd);
	pump_unref(p);
}
