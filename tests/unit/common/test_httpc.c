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

/* What the streaming callbacks saw. */
struct stream {
	const char *src;	/* the request body, read out by on_read */
	size_t off, len;
	char got[64];		/* the answer's body, as on_write received it */
	size_t got_len;
	int headers;		/* header lines seen */
	bool saw_length;	/* one was "Content-Length: 5" */
};

static size_t stream_read(char *p, size_t size, size_t n, void *arg)
{
	struct stream *st = arg;
	size_t k = st->len - st->off < size * n ? st->len - st->off : size * n;

	memcpy(p, st->src + st->off, k);
	st->off += k;
	return k;
}

static size_t stream_write(char *p, size_t size, size_t n, void *arg)
{
	struct stream *st = arg;
	size_t k = size * n;

	if (st->got_len + k >= sizeof(st->got))
		return 0;
	memcpy(st->got + st->got_len, p, k);
	st->got_len += k;
	return k;
}

static size_t stream_header(char *p, size_t size, size_t n, void *arg)
{
	struct stream *st = arg;

	st->headers++;
	if (size * n >= 17 && strncmp(p, "Content-Length: 5", 17) == 0)
		st->saw_length = true;
	return size * n;
}

/* A streamed upload with the caller's headers, the answer streamed to the caller's callbacks. */
static void test_streamed_upload_headers_and_callbacks(void)
{
	struct peer p = { .answer = ok_answer };
	struct kiln_error err = { 0 };
	struct stream st = { .src = "abc", .len = 3 };
	struct curl_slist *hdrs = curl_slist_append(curl_slist_append(NULL, "X-Kiln-Test: 1"),
						     "Expect:");
	char url[128];
	struct httpc_opts o = {
		.url = url, .timeout_ms = 5000, .method = "PUT", .headers = hdrs,
		.on_read = stream_read, .read_arg = &st, .upload_len = 3,
		.on_write = stream_write, .write_arg = &st, .on_header = stream_header, .header_arg = &st,
	};
	struct httpc h;
	long status = -1;

	peer_tcp(&p, url, sizeof(url));
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_OK);
	CHECK_INT(status, 200);
	if (st.off != 3)
		fprintf(stderr, "request: %s\n", p.request);
	CHECK_INT((long)st.off, 3);
	CHECK_INT((long)st.got_len, 5);
	CHECK(memcmp(st.got, "hello", 5) == 0);
	CHECK(st.headers >= 3);
	CHECK(st.saw_length);
	CHECK(strncmp(p.request, "PUT /path?q=1 ", 14) == 0);
	CHECK(strstr(p.request, "X-Kiln-Test: 1\r\n") != NULL);
	CHECK(strstr(p.request, "Content-Length: 3\r\n") != NULL);
	httpc_close(&h);
	peer_end(&p);
	curl_slist_free_all(hdrs);
}

static int opened;

static curl_socket_t refuse_socket(void *arg, curlsocktype purpose, struct curl_sockaddr *a)
{
	(void)arg;
	(void)purpose;
	(void)a;
	opened++;
	return CURL_SOCKET_BAD;
}

/*
 * A name pinned to an address (CURLOPT_RESOLVE) leads there and nowhere else; a socket check
 * that refuses stops the exchange before anything connects.
 */
static void test_pinned_address_and_socket_check(void)
{
	struct peer p = { .answer = ok_answer };
	struct kiln_error err = { 0 };
	struct buf b;
	char url[128], port[16], pin[64];
	struct httpc_opts o = { .timeout_ms = 5000, .body = &b, .strict = true };
	struct httpc h;
	struct curl_slist *resolve;
	long status = -1;

	buf_init(&b, 64);
	peer_tcp(&p, url, sizeof(url));
	snprintf(port, sizeof(port), "%s", strrchr(url, ':') + 1);
	port[strcspn(port, "/")] = '\0';
	snprintf(pin, sizeof(pin), "pinned.invalid:%s:127.0.0.1", port);
	resolve = curl_slist_append(NULL, pin);
	snprintf(url, sizeof(url), "http://pinned.invalid:%s/x", port);
	o.url = url;
	o.resolve = resolve;
	CHECK_INT(httpc_open(&h, &o, &err), KILN_OK);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_OK);
	CHECK_INT(status, 200);
	CHECK_STR(b.data, "hello");
	CHECK(strstr(p.request, "Host: pinned.invalid:") != NULL);
	peer_end(&p);

	/* the same pin, every socket refused: no connection, unavailable */
	memset(&p, 0, sizeof(p));
	p.answer = ok_answer;
	peer_tcp(&p, url, sizeof(url));
	snprintf(url, sizeof(url), "http://pinned.invalid:%s/x", port);
	o.open_socket = refuse_socket;
	buf_reset(&b);
	httpc_setup(&h, &o);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_E_UNAVAILABLE);
	CHECK_INT(status, 0);
	CHECK(opened >= 1);
	CHECK_INT((long)b.len, 0);
	/* another scheme than http and https is refused (strict) */
	o.open_socket = NULL;
	o.url = "file:///etc/hostname";
	httpc_setup(&h, &o);
	CHECK_INT(httpc_perform(&h, &status, &err), KILN_E_UNAVAILABLE);
	CHECK_INT(h.result, CURLE_UNSUPPORTED_PROTOCOL);
	CHECK_INT((long)b.len, 0);
	httpc_close(&h);
	peer_end(&p);
	CHECK_STR(p.request, "");
	curl_slist_free_all(resolve);
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
	TEST(test_streamed_upload_headers_and_callbacks);
	TEST(test_pinned_address_and_socket_check);
	return test_summary();
}
