/*
 * test_qmp.c - QMP framing against a fake peer on a socketpair that replays transcripts of what
 * QEMU 7.2 sends (greeting, responses, events): split reads, events between responses, a stale
 * answer, errors, fd passing, and the bounds (oversized message, garbage, peer gone, timeout).
 * A framing test only: tests/integration/vmm/ talks to a real QEMU.
 */
#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"
#include "vmm/qmp.h"

#define GREETING                                                                                   \
	"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 22, \"minor\": 2, \"major\": 7}, \"package\": " \
	"\"Debian 1:7.2+dfsg-7+deb12u18\"}, \"capabilities\": [\"oob\"]}}\r\n"

/* The peer's script: a function run in a thread on its end of the socketpair. */
struct peer {
	int fd;
	void (*run)(struct peer *p);
	int got_fd;	/* a descriptor received with SCM_RIGHTS, or -1 */
};

static void say(struct peer *p, const char *s)
{
	if (write(p->fd, s, strlen(s)) < 0)
		perror("peer write");
}

/* Reads one request line and returns its "id" (static buffer); collects a passed fd. */
static const char *hear(struct peer *p)
{
	static char id[64];
	char line[4096];
	size_t len = 0;

	id[0] = '\0';
	while (len < sizeof(line) - 1) {
		char c;
		union {
			char buf[CMSG_SPACE(sizeof(int))];
			struct cmsghdr align;
		} ctl;
		struct iovec iov = { .iov_base = &c, .iov_len = 1 };
		struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
				      .msg_controllen = sizeof(ctl.buf) };

		if (recvmsg(p->fd, &msg, 0) != 1)
			return id;
		for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm))
			if (cm->cmsg_type == SCM_RIGHTS)
				memcpy(&p->got_fd, CMSG_DATA(cm), sizeof(int));
		if (c == '\n')
			break;
		line[len++] = c;
	}
	line[len] = '\0';
	json_t *req = json_loads(line, 0, NULL);

	snprintf(id, sizeof(id), "%s", json_string_value(json_object_get(req, "id")) ?: "");
	json_decref(req);
	return id;
}

static void answer(struct peer *p, const char *id, const char *body)
{
	char out[8192];

	snprintf(out, sizeof(out), "{%s, \"id\": \"%s\"}\r\n", body, id);
	say(p, out);
}

static void *peer_main(void *arg)
{
	struct peer *p = arg;

	p->run(p);
	close(p->fd);
	return NULL;
}

/* Starts the peer and a client on the other end; returns the client's qmp_open_fd result. */
static int start(struct peer *p, pthread_t *th, void (*run)(struct peer *), int timeout_ms, struct qmp **q)
{
	int sv[2];

	socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv);
	p->fd = sv[1];
	p->run = run;
	p->got_fd = -1;
	pthread_create(th, NULL, peer_main, p);
	return qmp_open_fd(sv[0], timeout_ms, q);
}

static void handshake(struct peer *p)
{
	say(p, GREETING);
	answer(p, hear(p), "\"return\": {}");
}

static void run_stop_with_events(struct peer *p)
{
	const char *id;

	handshake(p);
	id = hear(p);
	/* QEMU emits the STOP event before the answer; bytes arrive in pieces */
	say(p, "{\"timestamp\": {\"seconds\": 1, \"microseconds\": 2}, \"event\": \"ST");
	usleep(20000);
	say(p, "OP\"}\r\n");
	answer(p, "kiln-stale", "\"return\": {\"late\": true}");
	answer(p, id, "\"return\": {}");
	id = hear(p);
	answer(p, id, "\"return\": {\"status\": \"completed\", \"total-time\": 2}");
	say(p, "{\"event\": \"RESUME\", \"timestamp\": {\"seconds\": 1, \"microseconds\": 3}}\r\n");
}

static void test_qmp_greeting_command_and_events(void)
{
	struct peer p;
	pthread_t th;
	struct qmp *q = NULL;
	json_t *ret = NULL, *data = NULL;

	CHECK_INT(start(&p, &th, run_stop_with_events, 2000, &q), 0);
	if (!q)
		return;
	CHECK_STR(qmp_version(q), "7.2.22");
	CHECK_INT(qmp_execute(q, "stop", NULL, -1, 2000, NULL, NULL), 0);
	CHECK_INT(qmp_execute(q, "query-migrate", NULL, -1, 2000, &ret, NULL), 0);
	CHECK_STR(json_string_value(json_object_get(ret, "status")), "completed");
	json_decref(ret);
	CHECK_INT(qmp_wait_event(q, "STOP", 100, &data), 0);	/* queued during "stop" */
	CHECK(data == NULL);
	CHECK_INT(qmp_wait_event(q, "RESUME", 2000, NULL), 0);	/* arrives later */
	qmp_close(q);
	pthread_join(th, NULL);
}

static void run_error_and_getfd(struct peer *p)
{
	handshake(p);
	answer(p, hear(p), "\"error\": {\"class\": \"GenericError\", \"desc\": \"Could not open 'disk'\"}");
	answer(p, hear(p), "\"return\": {}");
}

static void test_qmp_error_response_and_getfd(void)
{
	char msg[QMP_ERRMSG_MAX];
	struct peer p;
	pthread_t th;
	struct qmp *q = NULL;
	struct stat a, b;

	CHECK_INT(start(&p, &th, run_error_and_getfd, 2000, &q), 0);
	if (!q)
		return;
	CHECK_INT(qmp_execute(q, "cont", NULL, -1, 2000, NULL, msg), -EREMOTEIO);
	CHECK_STR(msg, "GenericError: Could not open 'disk'");
	CHECK_INT(qmp_getfd(q, "kiln-mig", 1, 2000, msg), 0);
	pthread_join(th, NULL);
	/* the peer received a descriptor of the same file as our fd 1 */
	CHECK(p.got_fd >= 0);
	CHECK(p.got_fd >= 0 && fstat(p.got_fd, &a) == 0 && fstat(1, &b) == 0 && a.st_ino == b.st_ino);
	if (p.got_fd >= 0)
		close(p.got_fd);
	qmp_close(q);
}

static void run_oversized(struct peer *p)
{
	char *big = malloc(QMP_MSG_MAX + 10);

	handshake(p);
	hear(p);
	memset(big, ' ', QMP_MSG_MAX + 9);
	big[0] = '{';
	big[QMP_MSG_MAX + 9] = '\0';
	say(p, big);	/* never a newline within the cap */
	free(big);
}

static void run_garbage(struct peer *p)
{
	handshake(p);
	hear(p);
	say(p, "this is not json\r\n");
}

static void run_hangup(struct peer *p)
{
	handshake(p);
	hear(p);
}

static void run_silent(struct peer *p)
{
	handshake(p);
	hear(p);
	usleep(300000);
}

static void test_qmp_bounds(void)
{
	struct peer p;
	pthread_t th;
	struct qmp *q = NULL;

	CHECK_INT(start(&p, &th, run_oversized, 2000, &q), 0);
	CHECK_INT(qmp_execute(q, "query-status", NULL, -1, 5000, NULL, NULL), -E2BIG);
	qmp_close(q);
	pthread_join(th, NULL);

	CHECK_INT(start(&p, &th, run_garbage, 2000, &q), 0);
	CHECK_INT(qmp_execute(q, "query-status", NULL, -1, 2000, NULL, NULL), -EPROTO);
	qmp_close(q);
	pthread_join(th, NULL);

	CHECK_INT(start(&p, &th, run_hangup, 2000, &q), 0);
	CHECK_INT(qmp_execute(q, "query-status", NULL, -1, 2000, NULL, NULL), -ECONNRESET);
	qmp_close(q);
	pthread_join(th, NULL);

	CHECK_INT(start(&p, &th, run_silent, 2000, &q), 0);
	CHECK_INT(qmp_execute(q, "query-status", NULL, -1, 100, NULL, NULL), -ETIMEDOUT);
	qmp_close(q);
	pthread_join(th, NULL);
}

static void run_not_qmp(struct peer *p)
{
	say(p, "{\"hello\": 1}\r\n");
}

static void test_qmp_rejects_a_peer_without_greeting(void)
{
	struct peer p;
	pthread_t th;
	struct qmp *q = NULL;

	CHECK_INT(start(&p, &th, run_not_qmp, 2000, &q), -EPROTO);
	CHECK(q == NULL);
	pthread_join(th, NULL);
}

int main(void)
{
	TEST(test_qmp_greeting_command_and_events);
	TEST(test_qmp_error_response_and_getfd);
	TEST(test_qmp_bounds);
	TEST(test_qmp_rejects_a_peer_without_greeting);
	return test_summary();
}
