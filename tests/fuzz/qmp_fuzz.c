/*
 * qmp_fuzz.c - libFuzzer target for the QMP client (vmm/qmp.c): arbitrary bytes from "QEMU" on a
 * socketpair, read by the same reader the QEMU driver uses (qmp_open_fd, qmp_execute,
 * qmp_getfd, qmp_wait_event): greeting, answers, errors, events interleaved, partial and huge
 * lines.
 *
 * Input: one flags byte, then the bytes the peer sends (a thread writes them and then closes its
 * end, so every read ends). Flags: bits 0-1 how many commands run after the handshake, bit 2 a
 * wait for an event, bit 3 one fd passed with getfd, bit 4 a huge line (length from the next
 * three bytes, up to 4 MiB, so past QMP_MSG_MAX) sent after the peer's first line.
 *
 * Oracle: no crash, leak or UB; every result is one of the errors qmp.h documents; an error
 * answer (-EREMOTEIO) carries a message; a success carries its return value; -E2BIG only when
 * a line really was longer than QMP_MSG_MAX; the version is a bounded string. Memory is bounded
 * by libFuzzer's -rss_limit_mb.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "vmm/qmp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CMD_MS 5000	/* every read ends at the peer's close well before this */

struct peer {
	int fd;
	const uint8_t *data;
	size_t size, split;	/* the huge line goes after data[0, split) */
	size_t huge;		/* bytes of the huge line, 0 for none */
	size_t longest;		/* longest line the peer sends, newline included */
};

static void send_all(int fd, const void *p, size_t n)
{
	while (n) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		if (w <= 0)
			return;	/* the client hung up (an error it reported) */
		p = (const char *)p + w;
		n -= (size_t)w;
	}
}

static void *peer_main(void *arg)
{
	struct peer *p = arg;

	send_all(p->fd, p->data, p->split);
	if (p->huge) {
		static const char head[] = "{\"event\": \"BIG\", \"data\": \"";
		char *line = malloc(p->huge);
		if (line) {
			memset(line, 'x', p->huge);
			memcpy(line, head, sizeof(head) - 1);
			memcpy(line + p->huge - 4, "\"}\r\n", 4);
			send_all(p->fd, line, p->huge);
			free(line);
		}
	}
	send_all(p->fd, p->data + p->split, p->size - p->split);
	shutdown(p->fd, SHUT_WR);
	return NULL;
}

/* The longest line of data[0, n), counting an unterminated tail. */
static size_t longest_line(const uint8_t *d, size_t n)
{
	size_t best = 0, cur = 0;

	for (size_t i = 0; i < n; i++) {
		cur++;
		if (d[i] == '\n') {
			best = cur > best ? cur : best;
			cur = 0;
		}
	}
	return cur > best ? cur : best;
}

/* Every result qmp.h documents (and -ENOMEM). */
static void check_rc(const struct peer *p, int r)
{
	switch (r) {
	case 0:
	case -ETIMEDOUT:
	case -ECONNRESET:
	case -EPROTO:
	case -EREMOTEIO:
	case -ENOMEM:
		return;
	case -E2BIG:
		if (p->longest < QMP_MSG_MAX) {
			fprintf(stderr, "qmp: -E2BIG with no line of %d bytes\n", QMP_MSG_MAX);
			abort();
		}
		return;
	default:
		fprintf(stderr, "qmp: undocumented result %d\n", r);
		abort();
	}
}

static void check_errmsg(int r, const char *msg)
{
	if (strnlen(msg, QMP_ERRMSG_MAX) == QMP_ERRMSG_MAX)
		abort();	/* not terminated */
	if (r == -EREMOTEIO && !strstr(msg, ": "))
		abort();	/* an error answer names its class and description */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static const char *const cmds[] = { "query-status", "stop", "cont", "migrate" };
	struct peer p = { 0 };
	struct qmp *q = NULL;
	pthread_t th;
	int sv[2], r;
	uint8_t flags;

	if (size < 1)
		return 0;
	flags = data[0];
	data++;
	size--;
	if ((flags & 0x10) && size >= 3) {
		p.huge = 64 + (((size_t)data[0] << 16 | (size_t)data[1] << 8 | data[2]) & 0x3fffff);
		data += 3;
		size -= 3;
	}
	p.data = data;
	p.size = size;
	{
		const uint8_t *nl = memchr(data, '\n', size);
		p.split = nl ? (size_t)(nl - data) + 1 : size;
	}
	p.longest = longest_line(data, size);
	if (p.huge > p.longest)
		p.longest = p.huge;
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		abort();
	p.fd = sv[1];
	if (pthread_create(&th, NULL, peer_main, &p) != 0)
		abort();

	r = qmp_open_fd(sv[0], CMD_MS, &q);	/* takes sv[0] */
	check_rc(&p, r);
	if (r == 0) {
		const char *v = qmp_version(q);
		if (strnlen(v, 32) == 32)
			abort();
		for (unsigned i = 0; i < (flags & 3u); i++) {
			char msg[QMP_ERRMSG_MAX];
			json_t *ret = NULL;

			memset(msg, 'z', sizeof(msg));
			r = qmp_execute(q, cmds[i], NULL, -1, CMD_MS, &ret, msg);
			check_rc(&p, r);
			check_errmsg(r, msg);
			if (r == 0 && !ret)
				abort();	/* a success carries its "return" */
			if (r != 0 && ret)
				abort();
			json_decref(ret);
		}
		if (flags & 8) {
			char msg[QMP_ERRMSG_MAX];
			int fd = dup(STDERR_FILENO);

			memset(msg, 'z', sizeof(msg));
			r = qmp_getfd(q, "kiln-mig", fd, CMD_MS, msg);
			check_rc(&p, r);
			check_errmsg(r, msg);
			close(fd);
		}
		if (flags & 4) {
			json_t *d = NULL;

			r = qmp_wait_event(q, "STOP", CMD_MS, &d);
			check_rc(&p, r);
			if (r == -EREMOTEIO)
				abort();	/* waiting for an event sends no command */
			if (r != 0 && d)
				abort();
			json_decref(d);
		}
		qmp_close(q);
	}
	pthread_join(th, NULL);
	close(sv[1]);
	return 0;
}
