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
#include "api/portcount.h"
#include "api/ports.h"
#include "auth/scopes.h"
#include "common/clock.h"
#include "common/log.h"

#define NODE_CONNECT_MS 5000	/* to reach the node's listener */
#define NODE_HEAD_SLACK_MS 10000	/* beyond the node's own port_connect_timeout_ms */
#define NODE_HEAD_MAX 16384	/* bytes of the node's answer head and error body */
#define SPLICE_CHUNK 65536
#define PORT_STREAM_LEASE_MS 30000	/* a stream counted in Redis, renewed by its gateway */

/* The two connections of an upgraded stream. */
struct splice {
	int node;		/* the node's socket after its 101 */
	char *early;		/* node bytes read past its head */
	size_t early_len;
	char tenant[AUTH_CLAIM_MAX];	/* its count of port_streams_max_per_tenant */
	unsigned long long ticket;
};

/*
 * Streams (and probes) each tenant holds open: port_streams_max_per_tenant, counted across the
 * gateways sharing a Redis, with this gateway's own count while Redis is down (portcount.h).
 */
static struct portcount counts = PORTCOUNT_INIT;

bool port_tenant_take(const char *tenant, long long max, unsigned long long *ticket)
{
	return portcount_take(&counts, tenant, max, ticket, NULL);
}

void port_tenant_give(const char *tenant, unsigned long long ticket)
{
	portcount_give(&counts, tenant, ticket);
}

int port_counts_attach(struct rds *rds)
{
	return portcount_attach(&counts, rds, PORT_STREAM_LEASE_MS);
}

void port_counts_detach(void)
{
	portcount_detach(&counts);
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

bool port_head_value(const char *head, const char *name, char *out, size_t cap)
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
	port_tenant_give(sp->tenant, sp->ticket);
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

enum kiln_err port_node_open(struct gateway *gw, const struct principal *who, const char *id,
			     const char *address, long port, const char *request_id,
			     struct port_node *pn)
{
	char *token = NULL, *head;
	size_t have = 0;
	int fd = -1;
	enum kiln_err rc = KILN_E_UNAVAILABLE;

	memset(pn, 0, sizeof(*pn));
	pn->fd = -1;
	head = pn->buf = malloc(NODE_HEAD_MAX + 1);
	token = node_token_for(gw, who, id);
	if (!token || !head) {
		rc = head ? KILN_E_INTERNAL : KILN_E_NOMEM;
		goto out;
	}
	fd = address[0] ? node_connect(address) : -1;
	if (fd < 0)
		goto out;
	snprintf(head, NODE_HEAD_MAX,
		 "GET /v1/sandboxes/%s/ports/%ld/stream HTTP/1.1\r\nHost: node\r\n"
		 "Connection: Upgrade\r\nUpgrade: kiln-port\r\nAuthorization: Bearer %s\r\n"
		 "X-Request-Id: %s\r\n\r\n",
		 id, port, token, request_id);
	if (write_all(fd, head, strlen(head)) < 0)
		goto out;
	/* The node's answer: its head, and for anything but 101 a short JSON body. */
	long long deadline = clock_mono_ms() + gw->cfg.port_connect_timeout_ms + NODE_HEAD_SLACK_MS;
	char *end = NULL;

	head[0] = '\0';
	while (!end && have < NODE_HEAD_MAX) {
		struct pollfd p = { fd, POLLIN, 0 };
		long long left = deadline - clock_mono_ms();
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
	if (!end || sscanf(head, "HTTP/1.%*d %d", &pn->status) != 1)
		goto out;
	pn->head_len = (size_t)(end + 4 - head);
	if (pn->status != 101) {
		char clen[24] = "0";
		size_t want;

		port_head_value(head, "Content-Length", clen, sizeof(clen));
		want = (size_t)strtoul(clen, NULL, 10);
		if (want > NODE_HEAD_MAX - pn->head_len)
			want = NODE_HEAD_MAX - pn->head_len;
		while (have - pn->head_len < want) {
			struct pollfd p = { fd, POLLIN, 0 };
			ssize_t k;

			if (poll(&p, 1, 5000) != 1)
				break;
			k = read(fd, head + have, pn->head_len + want - have);
			if (k <= 0)
				break;
			have += (size_t)k;
		}
		head[have] = '\0';
	} else {
		pn->fd = fd;
		fd = -1;
	}
	pn->have = have;
	rc = KILN_OK;
out:
	if (fd >= 0)
		close(fd);
	free(token);
	return rc;
}

void port_node_free(struct port_node *pn)
{
	if (pn->fd >= 0)
		close(pn->fd);
	pn->fd = -1;
	free(pn->buf);
	pn->buf = NULL;
}

static void port_stream(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	const char *up = http_req_header(req, "Upgrade");
	long port = http_port_value(http_req_query(req, "port"));
	char state[16], address[256];
	struct port_node pn = { .fd = -1 };
	struct splice *sp = NULL;
	bool taken = false;	/* a count of the tenant's, given back at the end unless spliced */
	unsigned long long ticket = 0;
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
	if (!port_tenant_take(gw_principal(req)->tenant_id, gw->cfg.port_streams_max_per_tenant,
			      &ticket)) {
		http_reply_header(req, "Retry-After", "1");
		http_reply_error(req, KILN_E_RATE_LIMITED,
				 "too many port streams at once: port_streams_max_per_tenant is %lld",
				 gw->cfg.port_streams_max_per_tenant);
		return;
	}
	taken = true;
	rc = port_node_open(gw, gw_principal(req), id, address, port, http_req_id(req), &pn);
	if (rc != KILN_OK) {
		if (rc == KILN_E_UNAVAILABLE)
			http_reply_error(req, rc, "the sandbox's node cannot be reached");
		else
			http_reply_error(req, rc, "cannot open the stream");
		goto out;
	}
	if (pn.status != 101) {
		char retry[24];
		const char *body = pn.buf + pn.head_len;

		if (probe && pn.status == 502 && strstr(body, "\"port_closed\"")) {
			http_reply_json(req, 200, json_pack("{s:I, s:b}", "port", (json_int_t)port,
							    "listening", 0));
			goto out;
		}
		if (port_head_value(pn.buf, "Retry-After", retry, sizeof(retry)))
			http_reply_header(req, "Retry-After", retry);
		http_reply_data(req, pn.status, "application/json", body, pn.have - pn.head_len);
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
	snprintf(sp->tenant, sizeof(sp->tenant), "%s", gw_principal(req)->tenant_id);
	sp->ticket = ticket;
	if (pn.have > pn.head_len) {
		sp->early = malloc(pn.have - pn.head_len);
		if (!sp->early) {
			free(sp);
			http_reply_error(req, KILN_E_NOMEM, "out of memory");
			goto out;
		}
		memcpy(sp->early, pn.buf + pn.head_len, pn.have - pn.head_len);
		sp->early_len = pn.have - pn.head_len;
	}
	sp->node = pn.fd;
	pn.fd = -1;
	taken = false;	/* the splice gives it back */
	http_reply_upgrade(req, "kiln-port", splice_run, sp);
out:
	if (taken)
		port_tenant_give(gw_principal(req)->tenant_id, ticket);
	port_node_free(&pn);
}

/*
 * The caller's sandbox `id` (404 otherwise) and the route's {port} (422 otherwise): true, or false
 * after replying.
 */
static bool port_route_args(struct http_req *req, struct pg_conn *c, long *port)
{
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	enum kiln_err rc;

	http_req_set_object(req, id);
	rc = PGQ(c, &res, &err,
		 "SELECT 1 FROM sandboxes WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
		 id, gw_principal(req)->tenant_id);
	if (rc == KILN_OK && pg_res_rows(res) != 1) {
		pg_res_free(res);
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		return false;
	}
	pg_res_free(res);
	if (rc != KILN_OK) {
		gw_fail(req, rc, &err);
		return false;
	}
	*port = http_port_value(http_req_param(req, "port"));
	if (*port < 0) {
		http_reply_error(req, KILN_E_INVALID, "the port must be 1..65535");
		return false;
	}
	return true;
}

/* {"port", "public", "url"} of a port of sandbox `id`. */
static json_t *port_json(const char *id, long port, bool public)
{
	char url[512];

	portproxy_url(id, port, url, sizeof(url));
	return json_pack("{s:I, s:b, s:s}", "port", (json_int_t)port, "public", public, "url", url);
}

/* GET /v1/sandboxes/{id}/ports/{port}: the port's URL and whether it is public. */
static void port_get(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = gw_db(req);
	char ptext[8];
	long port;
	enum kiln_err rc;

	if (!c)
		return;
	if (!port_route_args(req, c, &port))
		goto out;
	snprintf(ptext, sizeof(ptext), "%ld", port);
	rc = PGQ(c, &res, &err,
		 "SELECT public FROM sandbox_ports WHERE sandbox_id = $1 AND port = $2::int", id,
		 ptext);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else
		http_reply_json(req, 200, port_json(id, port, pg_res_rows(res) == 1 &&
							      pg_res_bool(res, 0, 0)));
	pg_res_free(res);
out:
	pg_release(gw->pg, c);
}

/* GET /v1/sandboxes/{id}/ports: the sandbox's public ports, and its auto_resume. */
static void ports_list(struct http_req *req)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = gw_db(req);
	json_t *ports, *items, *p;
	size_t i;
	enum kiln_err rc;

	if (!c)
		return;
	http_req_set_object(req, id);
	rc = PGQ(c, &res, &err,
		 "SELECT coalesce((SELECT auto_resume FROM sandbox_settings WHERE sandbox_id = s.id), "
		 "false), array_to_json(ARRAY(SELECT port FROM sandbox_ports p WHERE p.sandbox_id = "
		 "s.id AND p.public ORDER BY port))::text "
		 "FROM sandboxes s WHERE s.id = $1 AND s.tenant_id = $2 AND s.deleted_at IS NULL",
		 id, gw_principal(req)->tenant_id);
	pg_release(gw->pg, c);
	if (rc == KILN_OK && pg_res_rows(res) != 1) {
		pg_res_free(res);
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
		return;
	}
	if (rc != KILN_OK) {
		pg_res_free(res);
		gw_fail(req, rc, &err);
		return;
	}
	ports = json_loads(pg_res_str(res, 0, 1), 0, NULL);
	items = json_array();
	json_array_foreach(ports, i, p)
		json_array_append_new(items, port_json(id, (long)json_integer_value(p), true));
	json_decref(ports);
	http_reply_json(req, 200, json_pack("{s:o, s:b}", "ports", items, "auto_resume",
					    pg_res_bool(res, 0, 0)));
	pg_res_free(res);
}

bool port_settings_create(struct http_req *req, const char *id)
{
	struct gateway *gw = http_req_app(req);
	struct kiln_error err = { 0 };
	struct pg_conn *c = gw_db(req);
	enum kiln_err rc;

	if (!c)
		return false;
	rc = PGQ(c, NULL, &err,
		 "INSERT INTO sandbox_settings (sandbox_id, auto_resume) VALUES ($1, true) "
		 "ON CONFLICT (sandbox_id) DO UPDATE SET auto_resume = true, updated_at = now()",
		 id);
	pg_release(gw->pg, c);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	return rc == KILN_OK;
}

/* PATCH /v1/sandboxes/{id} {"auto_resume"}: the sandbox's settings of the gateway's own. */
static void sandbox_patch(struct http_req *req)
{
	static const struct json_field fields[] = { { "auto_resume", JF_BOOL, true, 0 } };
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c;
	json_t *body = gw_body(req, fields, 1);
	bool on;
	enum kiln_err rc;

	if (!body)
		return;
	on = json_is_true(json_object_get(body, "auto_resume"));
	json_decref(body);
	if (!(c = gw_db(req)))
		return;
	http_req_set_object(req, id);
	rc = PGQ(c, &res, &err,
		 "INSERT INTO sandbox_settings (sandbox_id, auto_resume) "
		 "SELECT id, $3::boolean FROM sandboxes WHERE id = $1 AND tenant_id = $2 AND "
		 "deleted_at IS NULL "
		 "ON CONFLICT (sandbox_id) DO UPDATE SET auto_resume = $3::boolean, updated_at = now() "
		 "RETURNING 1",
		 id, gw_principal(req)->tenant_id, on ? "true" : "false");
	pg_release(gw->pg, c);
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else if (pg_res_rows(res) != 1)
		http_reply_error(req, KILN_E_NOT_FOUND, "no sandbox \"%s\"", id);
	else
		http_reply_json(req, 200, json_pack("{s:s, s:b}", "id", id, "auto_resume", on));
	pg_res_free(res);
}

/* PUT and DELETE /v1/sandboxes/{id}/ports/{port}/public: opt a port in or out of public access. */
static void port_public_set(struct http_req *req, bool public)
{
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct kiln_error err = { 0 };
	struct pg_res *res = NULL;
	struct pg_conn *c = gw_db(req);
	char ptext[8], max[24];
	long port;
	enum kiln_err rc;

	if (!c)
		return;
	if (!port_route_args(req, c, &port))
		goto out;
	snprintf(ptext, sizeof(ptext), "%ld", port);
	snprintf(max, sizeof(max), "%lld", gw->cfg.port_public_max_per_sandbox);
	if (public) {
		/*
		 * Under the sandbox's row lock, so two calls at once cannot both pass the count: the
		 * INSERT's own snapshot is taken after the lock was granted.
		 */
		rc = PGQ0(c, NULL, &err, "BEGIN");
		if (rc == KILN_OK)
			rc = PGQ(c, NULL, &err, "SELECT 1 FROM sandboxes WHERE id = $1 FOR UPDATE", id);
		if (rc == KILN_OK)
			rc = PGQ(c, &res, &err,
				 "INSERT INTO sandbox_ports (sandbox_id, port, public) "
				 "SELECT $1, $2::int, true WHERE "
				 "EXISTS (SELECT 1 FROM sandbox_ports WHERE sandbox_id = $1 AND "
				 "port = $2::int AND public) OR "
				 "(SELECT count(*) FROM sandbox_ports WHERE sandbox_id = $1 AND public) "
				 "< $3::int "
				 "ON CONFLICT (sandbox_id, port) DO UPDATE SET public = true, "
				 "updated_at = now() RETURNING 1",
				 id, ptext, max);
		if (rc == KILN_OK)
			rc = PGQ0(c, NULL, &err, "COMMIT");
		else
			PGQ0(c, NULL, &(struct kiln_error){ 0 }, "ROLLBACK");
		if (rc == KILN_OK && pg_res_rows(res) != 1) {
			http_reply_error(req, KILN_E_QUOTA,
					 "the sandbox has %lld public ports: port_public_max_per_sandbox "
					 "is %lld",
					 gw->cfg.port_public_max_per_sandbox,
					 gw->cfg.port_public_max_per_sandbox);
			goto out;
		}
	} else {
		rc = PGQ(c, &res, &err,
			 "DELETE FROM sandbox_ports WHERE sandbox_id = $1 AND port = $2::int", id,
			 ptext);
	}
	if (rc != KILN_OK)
		gw_fail(req, rc, &err);
	else
		http_reply_json(req, 200, port_json(id, port, public));
out:
	pg_res_free(res);
	pg_release(gw->pg, c);
}

static void port_public_put(struct http_req *req)
{
	port_public_set(req, true);
}

static void port_public_delete(struct http_req *req)
{
	port_public_set(req, false);
}

/* POST /v1/sandboxes/{id}/ports/{port}/url {"expires_in_s"}: a signed URL of the port. */
static void port_url_sign(struct http_req *req)
{
	static const struct json_field fields[] = { { "expires_in_s", JF_INT, false, 0 } };
	struct gateway *gw = http_req_app(req);
	const char *id = http_req_param(req, "id");
	struct pg_conn *c;
	json_t *body = gw_body(req, fields, 1);
	char url[512], tok[PORTURL_TOKEN_MAX], at[32];
	long long ttl, expires;
	long port;
	bool ok;

	if (!body)
		return;
	ttl = json_int(body, "expires_in_s", 3600);
	json_decref(body);
	if (!(c = gw_db(req)))
		return;
	ok = port_route_args(req, c, &port);
	pg_release(gw->pg, c);
	if (!ok)
		return;
	if (ttl < 1 || ttl > gw->cfg.port_url_ttl_max_s) {
		http_reply_error(req, KILN_E_INVALID,
				 "expires_in_s must be 1..%lld (port_url_ttl_max_s)",
				 gw->cfg.port_url_ttl_max_s);
		return;
	}
	expires = (long long)time(NULL) + ttl;
	porturl_sign(portproxy_key(), id, port, expires, tok);
	portproxy_url(id, port, url, sizeof(url));
	size_t n = strlen(url);

	snprintf(url + n, sizeof(url) - n, "/?%s=%s", PORTURL_QUERY, tok);
	time_t e = (time_t)expires;
	struct tm tm;

	gmtime_r(&e, &tm);
	strftime(at, sizeof(at), "%Y-%m-%dT%H:%M:%SZ", &tm);
	http_reply_json(req, 200, json_pack("{s:I, s:s, s:s}", "port", (json_int_t)port, "url", url,
					    "expires_at", at));
}

static const struct http_route routes[] = {
	{ "GET", "/v1/sandboxes/{id}/connect", port_stream,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
	{ "PATCH", "/v1/sandboxes/{id}", sandbox_patch, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/ports", ports_list, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "GET", "/v1/sandboxes/{id}/ports/{port}", port_get, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_READ, 0, NULL, 0 },
	{ "POST", "/v1/sandboxes/{id}/ports/{port}/url", port_url_sign, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0,
	  NULL, 0 },
	{ "PUT", "/v1/sandboxes/{id}/ports/{port}/public", port_public_put, ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE,
	  0, NULL, 0 },
	{ "DELETE", "/v1/sandboxes/{id}/ports/{port}/public", port_public_delete,
	  ROUTE_AUTH | AUTH_SCOPE_SANDBOX_WRITE, 0, NULL, 0 },
};

const struct route_group routes_ports = { routes, sizeof(routes) / sizeof(routes[0]) };
