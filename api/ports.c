/*
 * ports.c - the gateway's port streams: `GET /v1/sandboxes/{id}/connect?port=N` with
 * `Upgrade: kiln-port`, for clients that carry raw bytes to a server in their sandbox (a CLI's
 * port forward). The gateway checks the caller owns the sandbox, opens the same upgrade on the
 * sandbox's node (node/ports.h) under a node token, and once the node answered 101 splices the
 * two connections; any other answer of the node (502 port_closed, 504 port_timeout, 409, 429...)
 * is passed on as it came. Without an Upgrade header the same request is a probe: 200
 * {"port", "listening"}, from a stream opened and dropped at once. Only a client that asks for `Upgrade: kiln-port` gets a stream, which
 * no browser can send, so nothing a sandbox serves is ever a page of the API's origin.
 */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "api/authn.h"
#include "api/gateway.h"
#include "api/nodeclient.h"
#include "auth/scopes.h"
#include "common/log.h"

#define NODE_CONNECT_MS 5000	/* to reach the node's listener */
#define NODE_HEAD_SLACK_MS 10000	/* beyond the node's own port_connect_timeout_ms */
#define NODE_HEAD_MAX 16384	/* bytes of the node's answer head and error body */
#define SPLICE_CHUNK 65536

/* The two connections of an upgraded stream. */
struct splice {
	int node;		/* the node's socket after its 101 */
	char *early;		/* node bytes read past its head */
	size_t early_len;
	char tenant[AUTH_CLAIM_MAX];	/* its count in `tenants` */
};

/* Streams (and probes) each tenant holds open through this gateway: port_streams_max_per_tenant. */
struct tenant_count {
	struct tenant_count *next;
	char tenant[AUTH_CLAIM_MAX];
	long long n;
};

static pthread_mutex_t tenants_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tenant_count *tenants;

/* Counts a stream in for `tenant`; false at the limit (or out of memory). */
static bool tenant_take(const char *tenant, long long max)
{
	struct tenant_count *t;
	bool ok = false;

	pthread_mutex_lock(&tenants_lock);
	for (t = tenants; t && strcmp(t->tenant, tenant) != 0; t = t->next)
		;
	if (!t && (t = calloc(1, sizeof(*t)))) {
		snprintf(t->tenant, sizeof(t->tenant), "%s", tenant);
		t->next = tenants;
		tenants = t;
	}
	if (t && t->n < max) {
		t->n++;
		ok = true;
	}
	pthread_mutex_unlock(&tenants_lock);
	return ok;
}

static void tenant_give(const char *tenant)
{
	pthread_mutex_lock(&tenants_lock);
	for (struct tenant_count **pp = &tenants; *pp; pp = &(*pp)->next) {
		struct tenant_count *t = *pp;

		if (strcmp(t->tenant, tenant) == 0) {
			if (--t->n <= 0) {
				*pp = t->next;
				free(t);
			}
			break;
		}
	}
	pthread_mutex_unlock(&tenants_lock);
}

static long long mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Connects to a node address ("unix:/path" or "http://host:port"); a socket or -1. */
static int node_connect(const char *address)
{
	int fd = -1;

	if (strncmp(address, "unix:", 5) == 0) {
		struct sockaddr_un sa = { .sun_family = AF_UNIX };

		if (strlen(address + 5) >= sizeof(sa.sun_path))
			return -1;
		strcpy(sa.sun_path, address + 5);
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
			close(fd);
			fd = -1;
		}
		return fd;
	}
	if (strncmp(address, "http://", 7) != 0)
		return -1;
	char host[256], *colon;
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *ai = NULL;

	snprintf(host, sizeof(host), "%s", address + 7);
	host[strcspn(host, "/")] = '\0';
	colon = strrchr(host, ':');
	if (!colon)
		return -1;
	*colon = '\0';
	if (getaddrinfo(host, colon + 1, &hints, &ai) != 0)
		return -1;
	fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
		struct pollfd p = { fd, POLLOUT, 0 };
		int e = 0;
		socklen_t el = sizeof(e);

		if (errno != EINPROGRESS || poll(&p, 1, NODE_CONNECT_MS) != 1 ||
		    getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el) < 0 || e != 0) {
			close(fd);
			fd = -1;
		}
	}
	freeaddrinfo(ai);
	if (fd >= 0)
		fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
	return fd;
}

static int write_all(int fd, const void *p, size_t len)
{
	const char *c = p;

	while (len > 0) {
		ssize_t k = write(fd, c, len);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		c += k;
		len -= (size_t)k;
	}
	return 0;
}

/* A header's value in a head (lines "Name: value\r\n"), copied into `out`; false when absent. */
static bool head_value(const char *head, const char *name, char *out, size_t cap)
{
	size_t nl = strlen(name);

	for (const char *l = strstr(head, "\r\n"); l; l = strstr(l + 2, "\r\n")) {
		const char *v = l + 2;

		if (strncasecmp(v, name, nl) == 0 && v[nl] == ':') {
			v += nl + 1;
			while (*v == ' ')
				v++;
			size_t n = strcspn(v, "\r\n");

			if (n >= cap)
				n = cap - 1;
			memcpy(out, v, n);
			out[n] = '\0';
			return true;
		}
	}
	return false;
}

/* Copies `from` to `to` until EOF, then half-closes `to`; on an error shuts both down. */
static void copy_until_end(int from, int to)
{
	char *buf = malloc(SPLICE_CHUNK);
	ssize_t k = -1;

	while (buf) {
		k = read(from, buf, SPLICE_CHUNK);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0 || write_all(to, buf, (size_t)k) < 0)
			break;
	}
	free(buf);
	if (k == 0) {
		shutdown(to, SHUT_WR);
	} else {
		shutdown(from, SHUT_RDWR);
		shutdown(to, SHUT_RDWR);
	}
}

struct half {
	int from, to;
};

static void *half_main(void *arg)
{
	struct half *h = arg;

	copy_until_end(h->from, h->to);
	return NULL;
}

/* After the client's 101: splices client and node until both directions ended. */
static void splice_run(void *cls, int fd, const char *extra, size_t extra_len)
{
	struct splice *sp = cls;
	struct half h;
	pthread_t t;

	if (fd >= 0) {
		fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
		h = (struct half){ sp->node, fd };
		if ((!sp->early_len || write_all(fd, sp->early, sp->early_len) == 0) &&
		    (!extra_len || write_all(sp->node, extra, extra_len) == 0) &&
		    pthread_create(&t, NULL, half_main, &h) == 0) {
			copy_until_end(fd, sp->node);
			pthread_join(t, NULL);
		}
	}
	close(sp->node);
	tenant_give(sp->tenant);
	free(sp->early);
	free(sp);
}

/* The node address of the caller's sandbox `id`: KILN_OK, KILN_E_NOT_FOUND or KILN_E_UNAVAILABLE. */
static enum kiln_err sandbox_node(struct http_req *req, const char *id, char *state, size_t slen,
				  char *address, size_t alen)
{
	struct gateway *gw = http_req_app(req);
	const struct principal *who = gw_principal(req);
	struct kiln_error err = { 0 };
	struct pg_conn *c;
	struct pg_res *res = NULL;
	enum kiln_err rc;

	if (pg_acquire(gw->pg, &c, &err) != KILN_OK)
		return KILN_E_UNAVAILABLE;
	rc = PGQ(c, &res, &err,
		 "SELECT s.state, coalesce(n.address, '') FROM sandboxes s "
		 "LEFT JOIN nodes n ON n.id = s.node_id "
		 "WHERE s.id = $1 AND s.tenant_id = $2 AND s.deleted_at IS NULL",
		 id, who->tenant_id);
	pg_release(gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1)
		rc = KILN_E_NOT_FOUND;
	if (rc == KILN_OK) {
		snprintf(state, slen, "%s", pg_res_str(res, 0, 0));
		snprintf(address, alen, "%s", pg_res_str(res, 0, 1));
	}
	pg_res_free(res);
	return rc == KILN_OK || rc == KILN_E_NOT_FOUND ? rc : KILN_E_UNAVAILABLE;
}

static void port_stream(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	const char *up = http_req_header(req, "Upgrade");
	long port = http_port_value(http_req_query(req, "port"));
	char state[16], address[256], *token = NULL, *head = NULL;
	struct splice *sp = NULL;
	size_t have = 0;
	int fd = -1, status;
	bool taken = false;	/* a count of the tenant's, given back at the end unless spliced */
	enum kiln_err rc;

	http_req_set_object(req, id);
	rc = sandbox_node(req, id, state, sizeof(state), address, sizeof(address));
	if (rc != KILN_OK) {
		if (rc == KILN_E_NOT_FOUND)
			http_reply_error(req, rc, "no sandbox \"%s\"", id);
		else
			http_reply_error(req, rc, "the database is unavailable");
		return;
	}
	if (port < 0) {
		http_reply_error(req, KILN_E_INVALID, "query parameter port must be 1..65535");
		return;
	}
	/* Without the upgrade the request is a probe: does anything listen on the port? */
	bool probe = !up;

	if (up && strcasecmp(up, "kiln-port") != 0) {
		http_reply_error(req, KILN_E_BAD_REQUEST,
				 "a port stream is a request with Upgrade: kiln-port");
		return;
	}
	if (strcmp(state, "running") != 0) {
		http_reply_error(req, KILN_E_CONFLICT, "the sandbox is %s", state);
		return;
	}
	if (!tenant_take(gw_principal(req)->tenant_id, gw->cfg.port_streams_max_per_tenant)) {
		http_reply_header(req, "Retry-After", "1");
		http_reply_error(req, KILN_E_RATE_LIMITED,
				 "too many port streams at once: port_streams_max_per_tenant is %lld",
				 gw->cfg.port_streams_max_per_tenant);
		return;
	}
	taken = true;
	token = node_token(req, id);
	head = malloc(NODE_HEAD_MAX + 1);
	if (!token || !head) {
		http_reply_error(req, KILN_E_INTERNAL, "cannot sign the node's token");
		goto out;
	}
	fd = address[0] ? node_connect(address) : -1;
	if (fd < 0) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "the sandbox's node cannot be reached");
		goto out;
	}
	snprintf(head, NODE_HEAD_MAX,
		 "GET /v1/sandboxes/%s/ports/%ld/stream HTTP/1.1\r\nHost: node\r\n"
		 "Connection: Upgrade\r\nUpgrade: kiln-port\r\nAuthorization: Bearer %s\r\n"
		 "X-Request-Id: %s\r\n\r\n",
		 id, port, token, http_req_id(req));
	if (write_all(fd, head, strlen(head)) < 0) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "the sandbox's node cannot be reached");
		goto out;
	}
	/* The node's answer: its head, and for anything but 101 a short JSON body. */
	long long deadline = mono_ms() + gw->cfg.port_connect_timeout_ms + NODE_HEAD_SLACK_MS;
	char *end = NULL;

	while (!end && have < NODE_HEAD_MAX) {
		struct pollfd p = { fd, POLLIN, 0 };
		long long left = deadline - mono_ms();
		ssize_t k;

		if (left <= 0 || poll(&p, 1, (int)left) != 1)
			break;
		k = read(fd, head + have, NODE_HEAD_MAX - have);
		if (k <= 0)
			break;
		have += (size_t)k;
		head[have] = '\0';
		end = strstr(head, "\r\n\r\n");
	}
	if (!end || sscanf(head, "HTTP/1.%*d %d", &status) != 1) {
		http_reply_error(req, KILN_E_UNAVAILABLE, "the sandbox's node did not answer");
		goto out;
	}
	size_t head_len = (size_t)(end + 4 - head);

	if (status != 101) {
		char clen[24] = "0", retry[24];
		size_t want;

		head_value(head, "Content-Length", clen, sizeof(clen));
		want = (size_t)strtoul(clen, NULL, 10);
		if (want > NODE_HEAD_MAX - head_len)
			want = NODE_HEAD_MAX - head_len;
		while (have - head_len < want) {
			struct pollfd p = { fd, POLLIN, 0 };
			ssize_t k;

			if (poll(&p, 1, 5000) != 1)
				break;
			k = read(fd, head + have, head_len + want - have);
			if (k <= 0)
				break;
			have += (size_t)k;
		}
		head[have] = '\0';
		if (probe && status == 502 && strstr(head + head_len, "\"port_closed\"")) {
			http_reply_json(req, 200, json_pack("{s:I, s:b}", "port", (json_int_t)port,
							    "listening", 0));
			goto out;
		}
		if (head_value(head, "Retry-After", retry, sizeof(retry)))
			http_reply_header(req, "Retry-After", retry);
		http_reply_data(req, status, "application/json", head + head_len, have - head_len);
		goto out;
	}
	if (probe) {	/* it listens; closing our end ends the node's stream */
		http_reply_json(req, 200, json_pack("{s:I, s:b}", "port", (json_int_t)port, "listening",
						    1));
		goto out;
	}
	sp = calloc(1, sizeof(*sp));
	if (!sp) {
		http_reply_error(req, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	sp->node = fd;
	fd = -1;
	snprintf(sp->tenant, sizeof(sp->tenant), "%s", gw_principal(req)->tenant_id);
	if (have > head_len) {
		sp->early = malloc(have - head_len);
		if (!sp->early) {
			close(sp->node);
			free(sp);
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
			goto out;
		}
		memcpy(sp->early, head + head_len, have - head_len);
		sp->early_len = have - head_len;
	}
	taken = false;	/* the splice gives it back */
	http_reply_upgrade(req, "kiln-port", splice_run, sp);
out:
	if (taken)
		tenant_give(gw_principal(req)->tenant_id);
	if (fd >= 0)
		close(fd);
	free(token);
	free(head);
}

static const struct http_route routes[] = {
	{ "GET", "/v1/sandboxes/{id}/connect", port_stream,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
};

const struct route_group routes_ports = { routes, sizeof(routes) / sizeof(routes[0]) };
