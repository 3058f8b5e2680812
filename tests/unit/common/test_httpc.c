/*
 * Unit tests of common/httpc.h against a real HTTP peer: a thread that serves one canned answer
 * per connection on a Unix socket or a loopback TCP port.
 */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/httpc.h"
#include "test.h"

struct peer {
	int lfd;
	const char *answer;	/* written whole after the request's head */
	size_t body_len;	/* bytes of 'x' sent after `answer` (a big body) */
	unsigned delay_ms;	/* before answering */
	char request[4096];	/* the head received */
	pthread_t thread;
};

static void *serve_one(void *arg)
{
	struct peer *p = arg;
	int fd = accept(p->lfd, NULL, NULL);
	size_t got = 0;

	if (fd < 0)
		return NULL;
	while (got + 1 < sizeof(p->request) && !strstr(p->request, "\r\n\r\n")) {
		ssize_t n = read(fd, p->request + got, sizeof(p->request) - 1 - got);

		if (n <= 0)
			break;
		got += (size_t)n;
		p->request[got] = '\0';
	}
	usleep(p->delay_ms * 1000);
	if (write(fd, p->answer, strlen(p->answer)) < 0)
		goto done;
	for (size_t sent = 0; sent < p->body_len;) {
		char chunk[4096];
		size_t n = p->body_len - sent < sizeof(chunk) ? p->body_len - sent : sizeof(chunk);
		ssize_t w;

		memset(chunk, 'x', n);
		w = write(fd, chunk, n);
		if (w <= 0)
			break;
		sent += (size_t)w;
	}
done:
	close(fd);
	return NULL;
}

/* Listens on loopback TCP; the URL of the peer into `url`. */
static void peer_tcp(struct peer *p, char *url, size_t len)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof(a);

	p->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHECK(p->lfd >= 0);
	CHECK(bind(p->lfd, (struct sockaddr *)&a, sizeof(a)) == 0);
	CHECK(listen(p->lfd, 4) == 0);
	CHECK(getsockname(p->lfd, (struct sockaddr *)&a, &al) == 0);
	snprintf(url, len, "http://127.0.0.1:%u/path?q=1", (unsigned)ntohs(a.sin_port));
	pthread_create(&p->thread, NULL, serve_one, p);
}

static void peer_end(struct peer *p)
{
	shutdown(p->lfd, SHUT_RDWR);
	pthread_join(p->thread, NULL);
	close(p->lfd);
}

static const char ok_answer[] = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";

static void test_get_into_the_buffer(void)
{
	struct peer p = { .answer = ok_answer };
	struct kiln_error err = { 0 };
	struct buf b;
	char url[128];
	struct httpc_opts o = { .url = url, .timeout_ms = 5000, .connect_timeout_ms = 1000, .body = &b };
	struct httpc h;
	long status = -1;

	buf_init(&b, 1024);
	peer_tcp(&p, url, sizeof(url));
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_OK);
	CHECK_INT(status, 200);
	CHECK_STR(b.data, "hello");
	CHECK(strncmp(p.request, "GET /path?q=1 HTTP/1.1\r\n", 24) == 0);
	CHECK(!h.over);
	httpc_close(&h);
	httpc_close(&h);	/* twice is harmless */
	peer_end(&p);
	buf_release(&b);
}

static void test_status_is_not_a_failure(void)
{
	struct peer p = { .answer = "HTTP/1.1 409 Conflict\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}" };
	struct kiln_error err = { 0 };
	char url[128];
	struct httpc_opts o = { .url = url, .timeout_ms = 5000 };	/* body dropped */
	struct httpc h;
	long status = -1;

	peer_tcp(&p, url, sizeof(url));
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_OK);
	CHECK_INT(status, 409);
	httpc_close(&h);
	peer_end(&p);
}

static void test_body_over_the_cap_cuts_the_exchange(void)
{
	struct peer p = { .answer = "HTTP/1.1 200 OK\r\nContent-Length: 200000\r\nConnection: close\r\n\r\n",
			  .body_len = 200000 };
	struct kiln_error err = { 0 };
	struct buf b;
	char url[128];
	struct httpc_opts o = { .url = url, .timeout_ms = 5000, .body = &b };
	struct httpc h;
	long status = -1;

	buf_init(&b, 1000);
	peer_tcp(&p, url, sizeof(url));
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_E_TOO_LARGE);
	CHECK_INT(status, 0);
	CHECK(h.over);
	CHECK(b.len <= 1000);
	CHECK_STR(err.msg, "the answer is over 1000 bytes");
	httpc_close(&h);
	peer_end(&p);
	buf_release(&b);
}

static void test_timeout_and_refusal_are_unavailable(void)
{
	struct peer p = { .answer = ok_answer, .delay_ms = 1500 };
	struct kiln_error err = { 0 };
	char url[128];
	struct httpc_opts o = { .url = url, .timeout_ms = 300 };
	struct httpc h;
	long status = -1;

	peer_tcp(&p, url, sizeof(url));
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_E_UNAVAILABLE);
	CHECK_STR(err.msg, curl_easy_strerror(CURLE_OPERATION_TIMEDOUT));
	CHECK(h.errbuf[0] != '\0');
	peer_end(&p);

	/* the port is closed now: the same handle, set up again, is refused */
	kiln_error_clear(&err);
	httpc_setup(&h, &o);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_E_UNAVAILABLE);
	CHECK_STR(err.msg, curl_easy_strerror(CURLE_COULDNT_CONNECT));
	httpc_close(&h);
}

static void test_over_a_unix_socket(void)
{
	struct peer p = { .answer = ok_answer };
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct kiln_error err = { 0 };
	struct buf b;
	char dir[] = "/tmp/kiln-httpc-XXXXXX";
	struct httpc_opts o = { .url = "http://node/v1/x", .timeout_ms = 5000, .body = &b };
	struct httpc h;
	long status = -1;

	CHECK(mkdtemp(dir) != NULL);
	snprintf(a.sun_path, sizeof(a.sun_path), "%s/s", dir);
	o.unix_socket = a.sun_path;
	buf_init(&b, 64);
	p.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHECK(bind(p.lfd, (struct sockaddr *)&a, sizeof(a)) == 0);
	CHECK(listen(p.lfd, 4) == 0);
	pthread_create(&p.thread, NULL, serve_one, &p);
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_OK);
	CHECK_INT(status, 200);
	CHECK_STR(b.data, "hello");
	CHECK(strstr(p.request, "Host: node\r\n") != NULL);
	httpc_close(&h);
	peer_end(&p);
	unlink(a.sun_path);
	rmdir(dir);
	buf_release(&b);
}

int main(void)
{
	signal(SIGPIPE, SIG_IGN);	/* the peer may write to a client that gave up */
	TEST(test_get_into_the_buffer);
	TEST(test_status_is_not_a_failure);
	TEST(test_body_over_the_cap_cuts_the_exchange);
	TEST(test_timeout_and_refusal_are_unavailable);
	TEST(test_over_a_unix_socket);
	return test_summary();
}
