/*
 * ports.c - kiln-node's port streams (see ports.h).
 *
 * Each stream is registered (per sandbox) before it opens, so ports_drain() can end it and wait
 * for it before the sandbox's agent goes away (pause, delete, failure). Once upgraded, a stream
 * runs two loops: the upgrade's thread copies the guest's bytes to the client, a second thread
 * the client's to the guest; each side's end is passed on as a half-close, and an error on
 * either side ends both (the guest's socket is reset by a CANCEL). Every byte either way is
 * charged to the sandbox's bandwidth bucket and counters (kiln_policy_charge) before it moves on,
 * so one quota and one usage figure cover the guest's own traffic and its ports': a stream whose
 * bucket is empty waits for the refill, and its window stops the other side meanwhile.
 */
#include "node/ports.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "vmm/agent.h"
#include "node/node.h"

#define PORT_IO_CHUNK 65536
#define PORT_QUOTA_WAIT_MS 20	/* how often a stream with an empty bucket looks again */

struct port_conn {
	struct port_conn *next;
	struct node *n;
	struct sandbox *sb;		/* a reference */
	struct agent *agent;		/* sb's agent when the stream opened */
	struct agent_port *p;		/* NULL until open */
	struct kiln_policy *pol;	/* sb's policy when the stream opened (NULL: none) */
	int fd;				/* the client's socket once upgraded, else -1 */
	bool drained;			/* ports_drain() ended it */
	bool failed;			/* one side failed: the other stops waiting for quota */
	char request_id[24];
};

static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reg_cond = PTHREAD_COND_INITIALIZER;
static struct port_conn *conns;

static unsigned count_locked(const struct sandbox *sb)
{
	unsigned k = 0;

	for (struct port_conn *c = conns; c; c = c->next)
		k += c->sb == sb;
	return k;
}

static void unregister(struct port_conn *pc)
{
	pthread_mutex_lock(&reg_lock);
	for (struct port_conn **pp = &conns; *pp; pp = &(*pp)->next) {
		if (*pp == pc) {
			*pp = pc->next;
			break;
		}
	}
	pthread_cond_broadcast(&reg_cond);
	pthread_mutex_unlock(&reg_lock);
}

/* Closes the stream, unregisters it and drops its sandbox reference. */
static void conn_end(struct port_conn *pc)
{
	agent_port_close(pc->p);
	pc->p = NULL;
	unregister(pc);
	sb_put(pc->n, pc->sb);
	free(pc);
}

void ports_drain(struct node *n, struct sandbox *sb)
{
	(void)n;
	pthread_mutex_lock(&reg_lock);
	for (struct port_conn *c = conns; c; c = c->next) {
		if (c->sb != sb)
			continue;
		c->drained = true;
		if (c->p)
			agent_port_abort(c->p);
		if (c->fd >= 0)
			shutdown(c->fd, SHUT_RDWR);
	}
	while (count_locked(sb) > 0)
		pthread_cond_wait(&reg_cond, &reg_lock);
	pthread_mutex_unlock(&reg_lock);
}

static int write_all(int fd, const uint8_t *p, size_t len)
{
	while (len > 0) {
		ssize_t k = write(fd, p, len);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		p += k;
		len -= (size_t)k;
	}
	return 0;
}

/*
 * Charges up to len (> 0) bytes the stream carries (tx: from the guest) to the sandbox's
 * bandwidth bucket, waiting while it is empty. Returns how many it charged (all without a
 * policy), or 0 when the stream was drained or failed meanwhile.
 */
static size_t quota_take(struct port_conn *pc, bool tx, size_t len)
{
	const struct timespec wait = { 0, PORT_QUOTA_WAIT_MS * 1000000L };

	if (!pc->pol)
		return len;
	for (;;) {
		size_t k = (size_t)kiln_policy_charge(pc->pol, tx, len);

		if (k)
			return k;
		pthread_mutex_lock(&reg_lock);
		bool stop = pc->drained || pc->failed;

		pthread_mutex_unlock(&reg_lock);
		if (stop)
			return 0;
		nanosleep(&wait, NULL);
	}
}

/* Writes len bytes to the guest, each charged first (quota_take); 0, or -1 on an end or error. */
static int guest_write(struct port_conn *pc, const void *buf, size_t len)
{
	const uint8_t *p = buf;

	while (len > 0) {
		size_t k = quota_take(pc, false, len);

		if (!k || agent_port_write(pc->p, p, k) < 0)
			return -1;
		p += k;
		len -= k;
	}
	return 0;
}

/* Writes len bytes to the client, each charged first (quota_take); 0, or -1 on an end or error. */
static int client_write(struct port_conn *pc, int fd, const uint8_t *p, size_t len)
{
	while (len > 0) {
		size_t k = quota_take(pc, true, len);

		if (!k || write_all(fd, p, k) < 0)
			return -1;
		p += k;
		len -= k;
	}
	return 0;
}

static void mark_failed(struct port_conn *pc)
{
	pthread_mutex_lock(&reg_lock);
	pc->failed = true;
	pthread_mutex_unlock(&reg_lock);
}

/* The client's bytes to the guest, until the client's end (passed on) or an error. */
static void *client_to_guest(void *arg)
{
	struct port_conn *pc = arg;
	uint8_t *buf = malloc(PORT_IO_CHUNK);
	ssize_t k;

	if (!buf) {
		agent_port_abort(pc->p);
		return NULL;
	}
	for (;;) {
		k = read(pc->fd, buf, PORT_IO_CHUNK);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0 || guest_write(pc, buf, (size_t)k) < 0)
			break;
	}
	if (k == 0) {
		agent_port_shutdown(pc->p);
	} else {
		mark_failed(pc);
		agent_port_abort(pc->p);
	}
	free(buf);
	return NULL;
}

/* After the 101: carries the stream until both sides ended or one failed. */
static void stream_run(void *cls, int fd, const char *extra, size_t extra_len)
{
	struct port_conn *pc = cls;
	uint8_t *buf = NULL;
	pthread_t t;
	bool started = false;
	ssize_t k = -1;

	if (fd < 0)
		goto out;
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
	pthread_mutex_lock(&reg_lock);
	pc->fd = fd;
	bool drained = pc->drained;

	pthread_mutex_unlock(&reg_lock);
	buf = malloc(PORT_IO_CHUNK);
	if (drained || !buf)
		goto out;
	if (extra_len && guest_write(pc, extra, extra_len) < 0)
		goto out;
	if (pthread_create(&t, NULL, client_to_guest, pc) != 0)
		goto out;
	started = true;
	while ((k = agent_port_read(pc->p, buf, PORT_IO_CHUNK, -1)) > 0)
		if (client_write(pc, fd, buf, (size_t)k) < 0)
			break;
	if (k == 0) {
		shutdown(fd, SHUT_WR);	/* the server ended: the client reads EOF */
	} else {
		mark_failed(pc);
		agent_port_abort(pc->p);
		shutdown(fd, SHUT_RDWR);
	}
out:
	if (started)
		pthread_join(t, NULL);
	pthread_mutex_lock(&reg_lock);
	pc->fd = -1;
	pthread_mutex_unlock(&reg_lock);
	free(buf);
	conn_end(pc);
}

void ports_stream(struct http_req *req)
{
	struct node *n = http_req_app(req);
	const char *up = http_req_header(req, "Upgrade");
	long port = http_port_value(http_req_param(req, "port"));
	struct kiln_error err = { 0 };
	struct port_conn *pc;
	struct sandbox *sb;
	enum kiln_err rc;

	if (port < 0) {
		http_reply_error(req, KILN_E_INVALID, "port must be 1..65535");
		return;
	}
	if (!up || strcasecmp(up, "kiln-port") != 0) {
		http_reply_error(req, KILN_E_BAD_REQUEST,
				 "a port stream is a request with Upgrade: kiln-port");
		return;
	}
	sb = node_request_sandbox(req);
	if (!sb)
		return;
	pc = calloc(1, sizeof(*pc));
	if (!pc) {
		sb_put(n, sb);
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		return;
	}
	pc->n = n;
	pc->sb = sb;
	pc->fd = -1;
	snprintf(pc->request_id, sizeof(pc->request_id), "%s", http_req_id(req));
	pthread_mutex_lock(&reg_lock);
	if (count_locked(sb) >= (unsigned)n->cfg.port_streams_max_per_sandbox) {
		pthread_mutex_unlock(&reg_lock);
		sb_put(n, sb);
		free(pc);
		http_reply_header(req, "Retry-After", "1");
		http_reply_error(req, KILN_E_RATE_LIMITED,
				 "too many port streams at once: port_streams_max_per_sandbox is %lld",
				 n->cfg.port_streams_max_per_sandbox);
		return;
	}
	pc->next = conns;
	conns = pc;
	pthread_mutex_unlock(&reg_lock);
	/* Registered first: a pause or delete from now on waits for this stream to end. */
	if (sb->state != SB_RUNNING || !sb->agent) {
		enum sb_state st = sb->state;

		unregister(pc);
		sb_put(n, sb);
		free(pc);
		if (st == SB_ERROR)
			http_reply_error(req, KILN_E_SANDBOX_FAILED, "the sandbox has failed");
		else
			http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", sb_state_name(st));
		return;
	}
	pc->agent = sb->agent;
	pc->pol = sb->pol;
	if (pc->pol) {
		/* an empty bucket refuses new streams as it drops the guest's new flows */
		struct kiln_bandwidth bw;

		if (kiln_policy_get_bandwidth(pc->pol, &bw, &err) == KILN_OK && !bw.unmetered &&
		    bw.remaining_bytes == 0) {
			conn_end(pc);
			http_reply_header(req, "Retry-After", "1");
			http_reply_error(req, KILN_E_RATE_LIMITED,
					 "the sandbox's bandwidth quota is spent (quota_bytes %llu, "
					 "refilled by %llu bytes every %u s): try again once it refills",
					 (unsigned long long)bw.quota_bytes,
					 (unsigned long long)bw.refill_bytes, bw.refill_interval_s);
			return;
		}
	}
	rc = agent_port_open(pc->agent, (uint16_t)port, (int)n->cfg.port_connect_timeout_ms, &pc->p,
			     &err);
	if (rc != KILN_OK) {
		conn_end(pc);
		http_reply_error(req, rc, "%s", err.msg);
		return;
	}
	pthread_mutex_lock(&reg_lock);
	bool drained = pc->drained;

	pthread_mutex_unlock(&reg_lock);
	if (drained) {
		conn_end(pc);
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is stopping");
		return;
	}
	log_info("port stream to port %ld of \"%s\"", port, sb->id);
	http_reply_upgrade(req, "kiln-port", stream_run, pc);
}
