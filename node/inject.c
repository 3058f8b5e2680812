/*
 * inject.c - the injecting proxy (see inject.h): one thread per relayed connection, blocking I/O
 * bounded by the idle timeout on both sides.
 */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <time.h>
#include <unistd.h>

#include "auth/crypto.h"
#include "common/log.h"
#include "node/inject.h"

#define SECRETS_PER_HOST_MAX 64
#define UP_SESSIONS_MAX 256	/* upstream TLS sessions kept for resumption, one per host and address */
#define UP_SESSION_LIFE_S 3600	/* the longest a kept session is offered, whatever its ticket says */
#define LINE_MAX_BYTES 8192	/* a chunk-size or trailer line */

struct entry {
	char sandbox[64];
	struct tenant_ca *ca;
	struct inject_secret *s;
	size_t n;
	struct entry *next;
};

struct conn;

/* An upstream's TLS session, offered again on the next connection to the same host and address. */
struct up_session {
	char host[TENANTCA_HOST_MAX + 1];
	struct sockaddr_storage addr;
	SSL_SESSION *s;
	time_t kept;
};

struct inject {
	pthread_mutex_t lock;	/* everything below */
	pthread_cond_t idle;
	struct entry *list;
	struct conn *conns;	/* relayed now */
	int active;
	bool stopping;
	SSL_CTX *up;		/* the client side: verifies upstreams */
	struct inject_opts o;
	struct kiln_cidr *deny;	/* o.deny copied */
	int host_ns;		/* the network namespace inject_new() ran in, or -1 */
	ino_t host_ns_ino;
	pthread_mutex_t slock;	/* sessions */
	struct up_session sessions[UP_SESSIONS_MAX];
	size_t snext;		/* the slot a new host takes when all are used */
};

/* A buffered reader over one TLS side. */
struct rbuf {
	SSL *ssl;
	char buf[16384];
	size_t off, len;
};

struct conn {
	struct inject *inj;
	char sandbox[64];
	char host[TENANTCA_HOST_MAX + 1];
	struct sockaddr_storage addr;
	int gfd, ufd;
	SSL *g, *u;
	unsigned char *pre;
	size_t pre_len, pre_off;
	struct rbuf gin, uin;
	bool up_failed;		/* the upstream could not be reached or verified */
	bool up_resumed;	/* its TLS session was a kept one resumed */
	int replied;		/* the status of the injector's own last answer */
	int noted;		/* requests noted in the connection log */
	struct kiln_conn_note nt;	/* the flow (family 0: unknown) */
	struct conn *next;
};

/* ---- the registry ---- */

void inject_secrets_wipe(struct inject_secret *s, size_t n)
{
	for (size_t i = 0; s && i < n; i++) {
		auth_secret_free(s[i].value, s[i].value_len);
		s[i].value = NULL;
		s[i].value_len = 0;
	}
}

static void entry_free(struct entry *e)
{
	if (!e)
		return;
	inject_secrets_wipe(e->s, e->n);
	free(e->s);
	tenantca_put(e->ca);
	free(e);
}

static struct entry **entry_find(struct inject *inj, const char *sandbox_id)
{
	struct entry **p = &inj->list;

	while (*p && strcmp((*p)->sandbox, sandbox_id) != 0)
		p = &(*p)->next;
	return p;
}

static bool same_addr(const struct sockaddr_storage *a, const struct sockaddr_storage *b)
{
	if (a->ss_family != b->ss_family)
		return false;
	if (a->ss_family == AF_INET)
		return memcmp(&((const struct sockaddr_in *)a)->sin_addr,
			      &((const struct sockaddr_in *)b)->sin_addr, 4) == 0 &&
		       ((const struct sockaddr_in *)a)->sin_port ==
			       ((const struct sockaddr_in *)b)->sin_port;
	return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
		      &((const struct sockaddr_in6 *)b)->sin6_addr, 16) == 0 &&
	       ((const struct sockaddr_in6 *)a)->sin6_port ==
		       ((const struct sockaddr_in6 *)b)->sin6_port;
}

/*
 * A new upstream session (OpenSSL's callback, for a verified handshake or a ticket after it): kept
 * for the connection's host and address, replacing the one before. Returns 1: the slot owns it.
 */
static int session_new(SSL *ssl, SSL_SESSION *s)
{
	struct conn *c = SSL_get_app_data(ssl);
	struct inject *inj;
	struct up_session *slot = NULL;

	if (!c || !SSL_SESSION_is_resumable(s))
		return 0;
	inj = c->inj;
	pthread_mutex_lock(&inj->slock);
	for (size_t i = 0; i < UP_SESSIONS_MAX && !slot; i++)
		if (inj->sessions[i].s && strcmp(inj->sessions[i].host, c->host) == 0 &&
		    same_addr(&inj->sessions[i].addr, &c->addr))
			slot = &inj->sessions[i];
	for (size_t i = 0; i < UP_SESSIONS_MAX && !slot; i++)
		if (!inj->sessions[i].s)
			slot = &inj->sessions[i];
	if (!slot) {
		slot = &inj->sessions[inj->snext];
		inj->snext = (inj->snext + 1) % UP_SESSIONS_MAX;
	}
	SSL_SESSION_free(slot->s);
	snprintf(slot->host, sizeof(slot->host), "%s", c->host);
	slot->addr = c->addr;
	slot->s = s;
	slot->kept = time(NULL);
	pthread_mutex_unlock(&inj->slock);
	return 1;
}

/* The kept session for c's host and address (a reference the caller frees), or NULL. */
static SSL_SESSION *session_find(struct inject *inj, const struct conn *c)
{
	SSL_SESSION *s = NULL;
	time_t now = time(NULL);

	pthread_mutex_lock(&inj->slock);
	for (size_t i = 0; i < UP_SESSIONS_MAX; i++) {
		struct up_session *u = &inj->sessions[i];

		if (!u->s || strcmp(u->host, c->host) != 0 || !same_addr(&u->addr, &c->addr))
			continue;
		if (now - u->kept < UP_SESSION_LIFE_S &&
		    now < (time_t)(SSL_SESSION_get_time(u->s) + SSL_SESSION_get_timeout(u->s)) &&
		    SSL_SESSION_is_resumable(u->s) && SSL_SESSION_up_ref(u->s) == 1) {
			s = u->s;
		} else {
			SSL_SESSION_free(u->s);
			u->s = NULL;
		}
		break;
	}
	pthread_mutex_unlock(&inj->slock);
	return s;
}

enum kiln_err inject_new(const struct inject_opts *o, struct inject **out, struct kiln_error *err)
{
	struct inject *inj = calloc(1, sizeof(*inj));
	static const unsigned char h1[] = "\x08http/1.1";

	*out = NULL;
	if (!inj)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	inj->host_ns = -1;
	inj->o = *o;
	if (inj->o.connections_max <= 0)
		inj->o.connections_max = 256;
	if (inj->o.per_sandbox_max <= 0)
		inj->o.per_sandbox_max = 32;
	if (inj->o.idle_timeout_s <= 0)
		inj->o.idle_timeout_s = 60;
	if (inj->o.connect_timeout_s <= 0)
		inj->o.connect_timeout_s = 10;
	if (inj->o.requests_per_conn <= 0)
		inj->o.requests_per_conn = 100;
	if (!inj->o.port)
		inj->o.port = 443;
	pthread_mutex_init(&inj->lock, NULL);
	pthread_mutex_init(&inj->slock, NULL);
	pthread_cond_init(&inj->idle, NULL);
	inj->host_ns = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
	{
		struct stat st;

		if (inj->host_ns < 0 || fstat(inj->host_ns, &st) != 0) {
			inject_free(inj);
			return kiln_error_set(err, KILN_E_INTERNAL,
					      "cannot open this thread's network namespace");
		}
		inj->host_ns_ino = st.st_ino;
	}
	if (o->ndeny) {
		inj->deny = malloc(o->ndeny * sizeof(*inj->deny));
		if (!inj->deny) {
			inject_free(inj);
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		}
		memcpy(inj->deny, o->deny, o->ndeny * sizeof(*inj->deny));
	}
	inj->o.deny = inj->deny;
	inj->up = SSL_CTX_new(TLS_client_method());
	if (!inj->up || !SSL_CTX_set_min_proto_version(inj->up, TLS1_2_VERSION) ||
	    (o->ca_file && o->ca_file[0]
		     ? SSL_CTX_load_verify_locations(inj->up, o->ca_file, NULL) != 1
		     : SSL_CTX_set_default_verify_paths(inj->up) != 1) ||
	    SSL_CTX_set_alpn_protos(inj->up, h1, sizeof(h1) - 1) != 0) {
		ERR_clear_error();
		inject_free(inj);
		return kiln_error_set(err, KILN_E_INVALID, "cannot load the upstream trust store%s%s",
				      o->ca_file ? " " : "", o->ca_file ? o->ca_file : "");
	}
	SSL_CTX_set_verify(inj->up, SSL_VERIFY_PEER, NULL);
	SSL_CTX_set_options(inj->up, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
	/* upstream sessions resumed: a kept one spares the next connection a full handshake */
	SSL_CTX_set_session_cache_mode(inj->up,
				       SSL_SESS_CACHE_CLIENT | SSL_SESS_CACHE_NO_INTERNAL_STORE);
	SSL_CTX_sess_set_new_cb(inj->up, session_new);
	*out = inj;
	return KILN_OK;
}

void inject_free(struct inject *inj)
{
	if (!inj)
		return;
	pthread_mutex_lock(&inj->lock);
	inj->stopping = true;
	for (struct conn *c = inj->conns; c; c = c->next) {
		shutdown(c->gfd, SHUT_RDWR);
		if (c->ufd >= 0)
			shutdown(c->ufd, SHUT_RDWR);
	}
	while (inj->active > 0)
		pthread_cond_wait(&inj->idle, &inj->lock);
	while (inj->list) {
		struct entry *e = inj->list;
		inj->list = e->next;
		entry_free(e);
	}
	pthread_mutex_unlock(&inj->lock);
	SSL_CTX_free(inj->up);
	for (size_t i = 0; i < UP_SESSIONS_MAX; i++)
		SSL_SESSION_free(inj->sessions[i].s);
	pthread_mutex_destroy(&inj->slock);
	free(inj->deny);
	if (inj->host_ns >= 0)
		close(inj->host_ns);
	pthread_cond_destroy(&inj->idle);
	pthread_mutex_destroy(&inj->lock);
	free(inj);
}

enum kiln_err inject_set(struct inject *inj, const char *sandbox_id, struct tenant_ca *ca,
			 struct inject_secret *s, size_t n, struct kiln_error *err)
{
	struct entry *e = NULL, *old, **p;

	if (strlen(sandbox_id) >= sizeof(e->sandbox))
		return kiln_error_set(err, KILN_E_INVALID, "sandbox id too long");
	if (n) {
		e = calloc(1, sizeof(*e));
		if (e)
			e->s = calloc(n, sizeof(*s));
		if (!e || !e->s) {
			free(e);
			return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		}
		snprintf(e->sandbox, sizeof(e->sandbox), "%s", sandbox_id);
		memcpy(e->s, s, n * sizeof(*s));
		e->n = n;
		for (size_t i = 0; i < n; i++) {
			s[i].value = NULL;
			s[i].value_len = 0;
		}
		e->ca = ca;
		tenantca_get(ca);
	}
	pthread_mutex_lock(&inj->lock);
	p = entry_find(inj, sandbox_id);
	old = *p;
	if (old)
		*p = old->next;
	if (e) {
		e->next = inj->list;
		inj->list = e;
	}
	pthread_mutex_unlock(&inj->lock);
	entry_free(old);
	return KILN_OK;
}

void inject_drop(struct inject *inj, const char *sandbox_id)
{
	struct entry *old, **p;

	if (!inj)
		return;
	pthread_mutex_lock(&inj->lock);
	p = entry_find(inj, sandbox_id);
	old = *p;
	if (old)
		*p = old->next;
	pthread_mutex_unlock(&inj->lock);
	entry_free(old);
}

bool inject_has(struct inject *inj, const char *sandbox_id)
{
	bool has;

	if (!inj)
		return false;
	pthread_mutex_lock(&inj->lock);
	has = *entry_find(inj, sandbox_id) != NULL;
	pthread_mutex_unlock(&inj->lock);
	return has;
}

bool inject_header_ok(const char *name)
{
	static const char *const refused[] = { "host", "content-length", "transfer-encoding",
					       "connection", "upgrade", "te", "trailer", "keep-alive",
					       "proxy-connection", "expect", NULL };
	size_t len = strlen(name);

	if (len == 0 || len > INJECT_HEADER_MAX)
		return false;
	for (size_t i = 0; i < len; i++)
		if (!isalnum((unsigned char)name[i]) && !strchr("!#$%&'*+-.^_`|~", name[i]))
			return false;
	for (int i = 0; refused[i]; i++)
		if (strcasecmp(name, refused[i]) == 0)
			return false;
	return true;
}

/*
 * The headers to add for a request to `host` and their names to drop: `*block` (malloc'd
 * "Name: value\r\n"..., wiped by the caller) and `names`. Returns -1 when the sandbox has no set
 * any more (the connection ends), else the number of headers.
 */
static int secrets_for(struct inject *inj, const char *sandbox, const char *host, char **block,
		       size_t *blen, char names[][INJECT_HEADER_MAX + 1])
{
	struct entry *e;
	size_t len = 0;
	int k = 0;

	*block = NULL;
	*blen = 0;
	pthread_mutex_lock(&inj->lock);
	e = *entry_find(inj, sandbox);
	if (!e) {
		pthread_mutex_unlock(&inj->lock);
		return -1;
	}
	for (size_t i = 0; i < e->n; i++)
		if (host && strcmp(e->s[i].host, host) == 0)
			len += strlen(e->s[i].header) + e->s[i].value_len + 4;
	*block = len ? malloc(len + 1) : NULL;
	for (size_t i = 0; *block && i < e->n && k < SECRETS_PER_HOST_MAX; i++) {
		if (!host || strcmp(e->s[i].host, host) != 0)
			continue;
		snprintf(names[k++], INJECT_HEADER_MAX + 1, "%s", e->s[i].header);
		memcpy(*block + *blen, e->s[i].header, strlen(e->s[i].header));
		*blen += strlen(e->s[i].header);
		memcpy(*block + *blen, ": ", 2);
		*blen += 2;
		memcpy(*block + *blen, e->s[i].value, e->s[i].value_len);
		*blen += e->s[i].value_len;
		memcpy(*block + *blen, "\r\n", 2);
		*blen += 2;
	}
	pthread_mutex_unlock(&inj->lock);
	return k;
}

/* Whether the sandbox has a secret for `host`, and its CA (a reference) when it has. */
static struct tenant_ca *ca_for(struct inject *inj, const char *sandbox, const char *host)
{
	struct tenant_ca *ca = NULL;
	struct entry *e;

	pthread_mutex_lock(&inj->lock);
	e = *entry_find(inj, sandbox);
	for (size_t i = 0; e && i < e->n && !ca; i++)
		if (strcmp(e->s[i].host, host) == 0) {
			ca = e->ca;
			tenantca_get(ca);
		}
	pthread_mutex_unlock(&inj->lock);
	return ca;
}

/* ---- the guest's side: a BIO that first gives back what the caller already read ---- */

static int pre_read(BIO *b, char *out, int len)
{
	struct conn *c = BIO_get_data(b);
	ssize_t r;

	if (len <= 0)
		return 0;
	if (c->pre_off < c->pre_len) {
		size_t k = c->pre_len - c->pre_off;
		if (k > (size_t)len)
			k = (size_t)len;
		memcpy(out, c->pre + c->pre_off, k);
		c->pre_off += k;
		return (int)k;
	}
	do
		r = recv(c->gfd, out, (size_t)len, 0);
	while (r < 0 && errno == EINTR);
	return r < 0 ? -1 : (int)r;
}

static int pre_write(BIO *b, const char *in, int len)
{
	struct conn *c = BIO_get_data(b);
	ssize_t w;

	do
		w = send(c->gfd, in, (size_t)len, MSG_NOSIGNAL);
	while (w < 0 && errno == EINTR);
	return w < 0 ? -1 : (int)w;
}

static long pre_ctrl(BIO *b, int cmd, long num, void *ptr)
{
	(void)b;
	(void)num;
	(void)ptr;
	return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

static BIO_METHOD *pre_method;
static pthread_once_t pre_once = PTHREAD_ONCE_INIT;

static void pre_init(void)
{
	pre_method = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "kiln-inject");
	if (pre_method) {
		BIO_meth_set_read(pre_method, pre_read);
		BIO_meth_set_write(pre_method, pre_write);
		BIO_meth_set_ctrl(pre_method, pre_ctrl);
	}
}

/* ---- reading and writing ---- */

static int rb_fill(struct rbuf *r)
{
	int n;

	if (r->off == r->len)
		r->off = r->len = 0;
	if (r->len == sizeof(r->buf))
		return -1;
	n = SSL_read(r->ssl, r->buf + r->len, (int)(sizeof(r->buf) - r->len));
	if (n <= 0)
		return 0;	/* closed, reset, timed out: all end the connection */
	r->len += (size_t)n;
	return n;
}

/*
 * Reads one line (up to LF, terminator included) into out (at most max - 1 bytes, NUL-ended).
 * Returns its length, 0 at end of stream before any byte, -1 when too long or cut.
 */
static long rb_line(struct rbuf *r, char *out, size_t max)
{
	size_t have = 0;

	for (;;) {
		char *lf = memchr(r->buf + r->off, '\n', r->len - r->off);
		size_t k = lf ? (size_t)(lf - (r->buf + r->off)) + 1 : r->len - r->off;

		if (have + k >= max)
			return -1;
		memcpy(out + have, r->buf + r->off, k);
		have += k;
		r->off += k;
		if (lf) {
			out[have] = '\0';
			return (long)have;
		}
		if (rb_fill(r) <= 0)
			return have ? -1 : 0;
	}
}

static bool ssl_write_all(SSL *s, const void *p, size_t len)
{
	const char *b = p;

	while (len) {
		int w = SSL_write(s, b, len > (1 << 30) ? (1 << 30) : (int)len);
		if (w <= 0)
			return false;
		b += w;
		len -= (size_t)w;
	}
	return true;
}

/* Copies `n` bytes of body from `r` to `to`. */
static bool copy_n(struct rbuf *r, SSL *to, unsigned long long n)
{
	while (n) {
		size_t k;

		if (r->off == r->len && rb_fill(r) <= 0)
			return false;
		k = r->len - r->off;
		if (k > n)
			k = (size_t)n;
		if (!ssl_write_all(to, r->buf + r->off, k))
			return false;
		r->off += k;
		n -= k;
	}
	return true;
}

/* Copies until the end of `r`'s stream. */
static bool copy_eof(struct rbuf *r, SSL *to)
{
	for (;;) {
		if (r->off < r->len && !ssl_write_all(to, r->buf + r->off, r->len - r->off))
			return false;
		r->off = r->len;
		if (rb_fill(r) <= 0)
			return true;
	}
}

/* Copies a chunked body, its last chunk and trailers included, checking its framing. */
static bool copy_chunked(struct rbuf *r, SSL *to)
{
	char line[LINE_MAX_BYTES];

	for (;;) {
		unsigned long long size = 0;
		long len = rb_line(r, line, sizeof(line));
		const char *p = line;

		if (len <= 0 || !isxdigit((unsigned char)*p))
			return false;
		for (; isxdigit((unsigned char)*p); p++) {
			if (size >> 59)
				return false;
			size = size * 16 + (unsigned long long)(isdigit((unsigned char)*p)
									? *p - '0'
									: (tolower((unsigned char)*p) - 'a' + 10));
		}
		if (*p != ';' && *p != '\r' && *p != '\n' && *p != ' ' && *p != '\t')
			return false;
		if (!ssl_write_all(to, line, (size_t)len))
			return false;
		if (size == 0)
			break;
		if (!copy_n(r, to, size))
			return false;
		len = rb_line(r, line, sizeof(line));
		if (len <= 0 || (strcmp(line, "\r\n") != 0 && strcmp(line, "\n") != 0) ||
		    !ssl_write_all(to, line, (size_t)len))
			return false;
	}
	for (;;) {	/* trailers, up to the empty line */
		long len = rb_line(r, line, sizeof(line));

		if (len <= 0 || !ssl_write_all(to, line, (size_t)len))
			return false;
		if (strcmp(line, "\r\n") == 0 || strcmp(line, "\n") == 0)
			return true;
	}
}

/* ---- heads ---- */

struct head {
	char *text;		/* the lines as read, NUL-ended */
	size_t len;
	char *lines[256];	/* into a copy: each line without its CR LF */
	size_t nlines;
	char *copy;
};

static void head_free(struct head *h)
{
	free(h->text);
	free(h->copy);
	memset(h, 0, sizeof(*h));
}

/* Reads a head up to its empty line. 1: read; 0: the stream ended before it; -1: malformed. */
static int head_read(struct rbuf *r, struct head *h)
{
	char line[LINE_MAX_BYTES];

	memset(h, 0, sizeof(*h));
	h->text = malloc(INJECT_HEAD_MAX + 1);
	if (!h->text)
		return -1;
	for (;;) {
		long len = rb_line(r, line, sizeof(line));

		if (len == 0 && h->len == 0)
			return 0;
		if (len <= 0 || h->len + (size_t)len > INJECT_HEAD_MAX)
			return -1;
		if (h->len == 0 && (strcmp(line, "\r\n") == 0 || strcmp(line, "\n") == 0))
			continue;	/* an empty line before a request is ignored (RFC 9112 2.2) */
		memcpy(h->text + h->len, line, (size_t)len);
		h->len += (size_t)len;
		if (strcmp(line, "\r\n") == 0 || strcmp(line, "\n") == 0)
			break;
		if (h->nlines == sizeof(h->lines) / sizeof(h->lines[0]))
			return -1;
		h->nlines++;
	}
	h->text[h->len] = '\0';
	h->copy = strdup(h->text);
	if (!h->copy)
		return -1;
	{
		char *p = h->copy;
		for (size_t i = 0; i < h->nlines; i++) {
			char *lf = strchr(p, '\n');
			h->lines[i] = p;
			*lf = '\0';
			if (lf > p && lf[-1] == '\r')
				lf[-1] = '\0';
			p = lf + 1;
		}
	}
	return 1;
}

static bool is_tchar(char ch)
{
	return isalnum((unsigned char)ch) || (ch && strchr("!#$%&'*+-.^_`|~", ch));
}

/* Splits header line `l` into its name and trimmed value; false when malformed. */
static bool header_split(char *l, char **name, char **value)
{
	char *colon = strchr(l, ':'), *end;

	if (!colon || colon == l)
		return false;
	for (char *p = l; p < colon; p++)
		if (!is_tchar(*p))
			return false;	/* also a space before the colon, and obs-fold lines */
	*colon = '\0';
	*name = l;
	for (*value = colon + 1; **value == ' ' || **value == '\t'; (*value)++)
		;
	end = *value + strlen(*value);
	while (end > *value && (end[-1] == ' ' || end[-1] == '\t'))
		*--end = '\0';
	for (char *p = *value; *p; p++)
		if ((unsigned char)*p < 0x20 && *p != '\t')
			return false;
	return true;
}

/* Whether comma-separated `list` holds `token` (case-insensitive). */
static bool has_token(const char *list, const char *token)
{
	size_t tl = strlen(token);

	for (const char *p = list; *p;) {
		while (*p == ' ' || *p == '\t' || *p == ',')
			p++;
		if (strncasecmp(p, token, tl) == 0 &&
		    (p[tl] == '\0' || p[tl] == ',' || p[tl] == ' ' || p[tl] == '\t'))
			return true;
		while (*p && *p != ',')
			p++;
	}
	return false;
}

/* What a head says of its body and connection. */
struct framing {
	bool chunked;
	bool has_length;
	unsigned long long length;
	bool close;
	bool upgrade;
	bool expect_continue;
	int hosts;
	char host[TENANTCA_HOST_MAX + 8];
};

/* Reads the framing headers of h->lines[1..]; false when malformed (conflicting lengths...). */
static bool framing_read(struct head *h, struct framing *f, bool http10)
{
	memset(f, 0, sizeof(*f));
	f->close = http10;
	for (size_t i = 1; i < h->nlines; i++) {
		char *name, *value, line[LINE_MAX_BYTES];

		snprintf(line, sizeof(line), "%s", h->lines[i]);
		if (!header_split(line, &name, &value))
			return false;
		if (strcasecmp(name, "content-length") == 0) {
			unsigned long long v = 0;
			if (!*value)
				return false;
			for (const char *p = value; *p; p++) {
				if (!isdigit((unsigned char)*p) || v > (1ULL << 60))
					return false;
				v = v * 10 + (unsigned long long)(*p - '0');
			}
			if (f->has_length && f->length != v)
				return false;
			f->has_length = true;
			f->length = v;
		} else if (strcasecmp(name, "transfer-encoding") == 0) {
			if (f->chunked || strcasecmp(value, "chunked") != 0)
				return false;	/* only "chunked", once */
			f->chunked = true;
		} else if (strcasecmp(name, "connection") == 0) {
			if (has_token(value, "close"))
				f->close = true;
			if (has_token(value, "keep-alive"))
				f->close = false;
			if (has_token(value, "upgrade"))
				f->upgrade = true;
		} else if (strcasecmp(name, "upgrade") == 0 ||
			   strcasecmp(name, "http2-settings") == 0) {
			f->upgrade = true;
		} else if (strcasecmp(name, "expect") == 0) {
			if (strcasecmp(value, "100-continue") != 0)
				return false;
			f->expect_continue = true;
		} else if (strcasecmp(name, "host") == 0) {
			f->hosts++;
			snprintf(f->host, sizeof(f->host), "%s", value);
		}
	}
	return !(f->chunked && f->has_length);
}

/* ---- one connection ---- */

static void reply(struct conn *c, int status, const char *reason, const char *msg)
{
	char out[512];
	int n = snprintf(out, sizeof(out),
			 "HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %zu\r\n"
			 "Connection: close\r\n\r\n%s\n",
			 status, reason, strlen(msg) + 1, msg);

	c->replied = status;
	if (n > 0 && (size_t)n < sizeof(out))
		ssl_write_all(c->g, out, (size_t)n);
}

/*
 * Hands the connection log one relayed (or refused) request: its method, Host, the target's path
 * without query or fragment, the status the guest got and whether a secret was added.
 */
static void note_request(struct conn *c, const char *method, const char *host, const char *target,
			 size_t target_len, int status, bool secret)
{
	struct inject *inj = c->inj;
	size_t plen = 0;

	if (!inj->o.note || !c->nt.family || c->noted >= inj->o.requests_per_conn)
		return;
	c->noted++;
	{
		struct timespec ts;

		clock_gettime(CLOCK_MONOTONIC, &ts);
		c->nt.at_ns = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	}
	c->nt.kind = KILN_NOTE_REQUEST;
	snprintf(c->nt.method, sizeof(c->nt.method), "%s", method);
	snprintf(c->nt.name, sizeof(c->nt.name), "%s", host);
	while (plen < target_len && target[plen] != '?' && target[plen] != '#' &&
	       plen < KILN_NOTE_PATH_MAX)
		plen++;
	memcpy(c->nt.path, target, plen);
	c->nt.path[plen] = '\0';
	c->nt.status = status;
	c->nt.secret = secret;
	inj->o.note(inj->o.note_arg, c->sandbox, &c->nt);
}

static void set_timeouts(int fd, int seconds)
{
	struct timeval tv = { .tv_sec = seconds };

	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/* Opens and verifies the upstream TLS connection; false (and logs why) when it cannot. */
static bool upstream_open(struct conn *c)
{
	struct inject *inj = c->inj;
	socklen_t alen = c->addr.ss_family == AF_INET6 ? sizeof(struct sockaddr_in6)
						       : sizeof(struct sockaddr_in);
	struct pollfd pfd;
	int fl, soerr = 0;
	socklen_t sl = sizeof(soerr);
	long verify;
	struct stat ns;

	/*
	 * From the host's network namespace, whatever namespace the thread that handed the
	 * connection over was in (a proxy listening inside the sandbox's): this thread is ours.
	 */
	if (stat("/proc/thread-self/ns/net", &ns) != 0 ||
	    (ns.st_ino != inj->host_ns_ino && setns(inj->host_ns, CLONE_NEWNET) != 0)) {
		log_warn("inject: sandbox \"%s\": cannot dial from the host's network namespace",
			 c->sandbox);
		c->up_failed = true;
		return false;
	}
	c->ufd = socket(c->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (c->ufd < 0)
		return false;
	if (connect(c->ufd, (struct sockaddr *)&c->addr, alen) != 0) {
		if (errno != EINPROGRESS)
			goto fail;
		pfd = (struct pollfd){ .fd = c->ufd, .events = POLLOUT };
		if (poll(&pfd, 1, inj->o.connect_timeout_s * 1000) != 1 ||
		    getsockopt(c->ufd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0 || soerr)
			goto fail;
	}
	fl = fcntl(c->ufd, F_GETFL);
	fcntl(c->ufd, F_SETFL, fl & ~O_NONBLOCK);
	set_timeouts(c->ufd, inj->o.connect_timeout_s);
	/* whole records are written: none waits for the peer's ACK of the one before */
	setsockopt(c->ufd, IPPROTO_TCP, TCP_NODELAY, &(int){ 1 }, sizeof(int));
	c->u = SSL_new(inj->up);
	if (!c->u || !SSL_set_tlsext_host_name(c->u, c->host) || !SSL_set1_host(c->u, c->host) ||
	    !SSL_set_fd(c->u, c->ufd) || !SSL_set_app_data(c->u, c))
		goto fail;
	{
		SSL_SESSION *s = session_find(inj, c);

		if (s) {	/* verified for this host when it was made */
			SSL_set_session(c->u, s);
			SSL_SESSION_free(s);
		}
	}
	if (SSL_connect(c->u) != 1) {
		verify = SSL_get_verify_result(c->u);
		log_warn("inject: sandbox \"%s\": upstream \"%s\" refused: %s", c->sandbox, c->host,
			 verify != X509_V_OK ? X509_verify_cert_error_string(verify)
					     : "TLS handshake failed");
		goto fail;
	}
	set_timeouts(c->ufd, inj->o.idle_timeout_s);
	c->uin.ssl = c->u;
	c->up_resumed = SSL_session_reused(c->u) == 1;
	return true;
fail:
	ERR_clear_error();
	if (c->u) {
		SSL_free(c->u);
		c->u = NULL;
	}
	close(c->ufd);
	c->ufd = -1;
	c->up_failed = true;
	return false;
}

/* The upstream's connection and handshake, made while the guest's handshake goes on. */
static void *upstream_main(void *arg)
{
	upstream_open(arg);
	ERR_clear_error();
	return NULL;
}

/* The Host header's name when it names c->host on port 443 (or none), else "". */
static void host_of(const struct framing *f, char *out, size_t n)
{
	char h[TENANTCA_HOST_MAX + 8];
	char *colon;

	snprintf(h, sizeof(h), "%s", f->hosts == 1 ? f->host : "");
	colon = strrchr(h, ':');
	if (colon && strcmp(colon, ":443") == 0)
		*colon = '\0';
	else if (colon)
		h[0] = '\0';	/* another port: not the bound host */
	for (char *p = h; *p; p++)
		*p = (char)tolower((unsigned char)*p);
	if (strlen(h) && h[strlen(h) - 1] == '.')
		h[strlen(h) - 1] = '\0';
	snprintf(out, n, "%s", h);
}

/*
 * Relays one request and its response. Returns true when the connection may carry another.
 */
static bool relay_one(struct conn *c)
{
	struct head req = { 0 }, resp = { 0 };
	struct framing rf, pf;
	char method[32] = "", target_first = 0, host[TENANTCA_HOST_MAX + 8], *block = NULL;
	char names[SECRETS_PER_HOST_MAX][INJECT_HEADER_MAX + 1];
	char *sp1, *sp2;
	size_t blen = 0, mlen;
	int k, r, status = 0;
	bool http10, more = false, head_req, sent = false;
	char *out = NULL;
	size_t olen = 0;

	c->replied = 0;
	host[0] = '\0';
	sp1 = sp2 = NULL;

	r = head_read(&c->gin, &req);
	if (r <= 0) {
		if (r < 0)
			reply(c, 400, "Bad Request", "kiln: malformed request head");
		goto out;
	}
	sp1 = strchr(req.lines[0], ' ');
	sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
	mlen = sp1 ? (size_t)(sp1 - req.lines[0]) : 0;
	if (!sp1 || !sp2 || mlen == 0 || mlen >= sizeof(method) || strchr(sp2 + 1, ' ') ||
	    (strcmp(sp2 + 1, "HTTP/1.1") != 0 && strcmp(sp2 + 1, "HTTP/1.0") != 0)) {
		reply(c, 400, "Bad Request", "kiln: only HTTP/1.1 requests are relayed here");
		goto out;
	}
	memcpy(method, req.lines[0], mlen);
	for (size_t i = 0; i < mlen; i++)
		if (!is_tchar(method[i])) {
			reply(c, 400, "Bad Request", "kiln: malformed method");
			goto out;
		}
	http10 = strcmp(sp2 + 1, "HTTP/1.0") == 0;
	target_first = sp1[1];
	if (strcmp(method, "TRACE") == 0 || strcmp(method, "CONNECT") == 0) {
		log_info("inject: sandbox \"%s\": %s to \"%s\" refused", c->sandbox, method, c->host);
		reply(c, 403, "Forbidden", "kiln: TRACE and CONNECT are refused");
		goto out;
	}
	if (target_first != '/' && !(strcmp(method, "OPTIONS") == 0 && target_first == '*' &&
				     sp1 + 2 == sp2)) {
		reply(c, 400, "Bad Request", "kiln: the request target must be a path");
		goto out;
	}
	if (!framing_read(&req, &rf, http10)) {
		reply(c, 400, "Bad Request", "kiln: malformed or conflicting headers");
		goto out;
	}
	if (rf.upgrade) {
		log_info("inject: sandbox \"%s\": upgrade to \"%s\" refused", c->sandbox, c->host);
		reply(c, 403, "Forbidden", "kiln: protocol upgrades are refused");
		goto out;
	}
	host_of(&rf, host, sizeof(host));
	k = secrets_for(c->inj, c->sandbox, strcmp(host, c->host) == 0 ? c->host : NULL, &block,
			&blen, names);
	if (k < 0) {
		reply(c, 403, "Forbidden", "kiln: the sandbox's secrets are gone");
		goto out;
	}
	/* the head as sent upstream: the guest's, less the secrets' names and Expect, plus them */
	out = malloc(req.len + req.nlines + blen + 3);	/* a bare LF line gains its CR */
	if (!out)
		goto out;
	{
		size_t l0 = strlen(req.lines[0]);
		memcpy(out, req.lines[0], l0);
		memcpy(out + l0, "\r\n", 2);
		olen = l0 + 2;
	}
	for (size_t i = 1; i < req.nlines; i++) {
		char line[LINE_MAX_BYTES], *name, *value;
		bool drop = false;

		snprintf(line, sizeof(line), "%s", req.lines[i]);
		header_split(line, &name, &value);
		drop = strcasecmp(name, "expect") == 0;
		for (int j = 0; j < k && !drop; j++)
			drop = strcasecmp(name, names[j]) == 0;
		if (drop)
			continue;
		memcpy(out + olen, req.lines[i], strlen(req.lines[i]));
		olen += strlen(req.lines[i]);
		memcpy(out + olen, "\r\n", 2);
		olen += 2;
	}
	if (blen) {
		memcpy(out + olen, block, blen);
		olen += blen;
	}
	memcpy(out + olen, "\r\n", 2);	/* one record: the head's end never waits on its start */
	olen += 2;
	if (!c->u && (c->up_failed || !upstream_open(c))) {
		reply(c, 502, "Bad Gateway", "kiln: the upstream could not be reached or its "
					     "certificate did not verify; nothing was sent");
		goto out;
	}
	if (!ssl_write_all(c->u, out, olen)) {
		/* an upstream that closed while idle: once more on a new connection */
		ERR_clear_error();
		SSL_free(c->u);
		c->u = NULL;
		close(c->ufd);
		c->ufd = -1;
		c->uin.off = c->uin.len = 0;
		if (!upstream_open(c) || !ssl_write_all(c->u, out, olen))
			goto out;
	}
	sent = true;
	if (rf.expect_continue && !ssl_write_all(c->g, "HTTP/1.1 100 Continue\r\n\r\n", 25))
		goto out;
	if (rf.chunked ? !copy_chunked(&c->gin, c->u)
		       : rf.has_length && !copy_n(&c->gin, c->u, rf.length))
		goto out;
	head_req = strcmp(method, "HEAD") == 0;
	for (;;) {	/* interim responses, then the final one */
		head_free(&resp);
		if (head_read(&c->uin, &resp) <= 0 || sscanf(resp.lines[0], "HTTP/1.%*1d %3d", &status) != 1 ||
		    status < 100 || status > 999) {
			reply(c, 502, "Bad Gateway", "kiln: the upstream's answer was malformed");
			goto out;
		}
		if (status == 101)
			goto out;	/* never asked for */
		if (!ssl_write_all(c->g, resp.text, resp.len))
			goto out;
		if (status >= 200)
			break;
	}
	if (!framing_read(&resp, &pf, strncmp(resp.lines[0], "HTTP/1.0", 8) == 0))
		goto out;
	if (head_req || status == 204 || status == 304)
		more = true;
	else if (pf.chunked)
		more = copy_chunked(&c->uin, c->g);
	else if (pf.has_length)
		more = copy_n(&c->uin, c->g, pf.length);
	else
		copy_eof(&c->uin, c->g);	/* delimited by the close: the connection ends */
	more = more && !rf.close && !pf.close;
out:
	if (method[0] && sp1 && sp2)
		note_request(c, method, host[0] ? host : c->host, sp1 + 1, (size_t)(sp2 - sp1 - 1),
			     c->replied ? c->replied : status, blen > 0 && sent);
	if (block)
		auth_secret_free(block, blen);
	if (out)
		auth_secret_free(out, olen);
	head_free(&req);
	head_free(&resp);
	return more;
}

static void *conn_main(void *arg)
{
	struct conn *c = arg;
	struct inject *inj = c->inj;
	struct tenant_ca *ca = ca_for(inj, c->sandbox, c->host);
	struct kiln_error err = { 0 };
	SSL_CTX *ctx = ca ? tenantca_leaf_ctx(ca, c->host, &err) : NULL;
	BIO *bio = NULL;

	set_timeouts(c->gfd, inj->o.idle_timeout_s);
	setsockopt(c->gfd, IPPROTO_TCP, TCP_NODELAY, &(int){ 1 }, sizeof(int));
	pthread_once(&pre_once, pre_init);
	if (!ctx || !pre_method) {
		log_warn("inject: sandbox \"%s\": no certificate for \"%s\": %s", c->sandbox, c->host,
			 err.msg);
		goto out;
	}
	c->g = SSL_new(ctx);
	bio = c->g ? BIO_new(pre_method) : NULL;
	if (!bio)
		goto out;
	BIO_set_data(bio, c);
	BIO_set_init(bio, 1);
	SSL_set_bio(c->g, bio, bio);
	c->gin.ssl = c->g;
	{
		/*
		 * Both handshakes at once: the first byte waits for the slower, not for both in
		 * turn. Nothing is sent upstream before a request is read (and then only to a
		 * verified upstream).
		 */
		pthread_attr_t attr;
		pthread_t ut;
		bool started;
		int ok;

		pthread_attr_init(&attr);
		pthread_attr_setstacksize(&attr, 256 * 1024);
		started = pthread_create(&ut, &attr, upstream_main, c) == 0;
		pthread_attr_destroy(&attr);
		ok = SSL_accept(c->g);
		if (started)
			pthread_join(ut, NULL);
		if (ok != 1)
			goto out;
	}
	while (relay_one(c))
		;
	SSL_shutdown(c->g);
	if (c->u)	/* a clean end keeps its session resumable (session_new) */
		SSL_shutdown(c->u);
out:
	ERR_clear_error();
	SSL_free(c->g);
	SSL_free(c->u);
	SSL_CTX_free(ctx);
	tenantca_put(ca);
	if (c->ufd >= 0)
		close(c->ufd);
	pthread_mutex_lock(&inj->lock);
	for (struct conn **p = &inj->conns; *p; p = &(*p)->next)
		if (*p == c) {
			*p = c->next;
			break;
		}
	close(c->gfd);
	if (--inj->active == 0)
		pthread_cond_broadcast(&inj->idle);
	pthread_mutex_unlock(&inj->lock);
	free(c->pre);
	free(c);
	return NULL;
}

/* Whether `a` lies in one of the denied ranges (an IPv4-mapped IPv6 address as IPv4). */
static bool addr_denied(const struct inject *inj, const struct sockaddr_storage *a)
{
	uint8_t b[16];
	int fam;

	if (a->ss_family == AF_INET) {
		fam = 4;
		memcpy(b, &((const struct sockaddr_in *)a)->sin_addr, 4);
	} else if (a->ss_family == AF_INET6) {
		const uint8_t *s = ((const struct sockaddr_in6 *)a)->sin6_addr.s6_addr;
		static const uint8_t mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };

		fam = memcmp(s, mapped, 12) == 0 ? 4 : 6;
		memcpy(b, fam == 4 ? s + 12 : s, fam == 4 ? 4 : 16);
	} else {
		return true;
	}
	for (size_t i = 0; i < inj->o.ndeny; i++) {
		const struct kiln_cidr *d = &inj->o.deny[i];
		unsigned full = d->plen / 8, rest = d->plen % 8;

		if (d->family != fam || d->plen > (fam == 4 ? 32 : 128))
			continue;
		if (memcmp(b, d->addr, full) != 0)
			continue;
		if (rest && ((b[full] ^ d->addr[full]) & (uint8_t)(0xff << (8 - rest))))
			continue;
		return true;
	}
	return false;
}

int inject_connection(struct inject *inj, const char *sandbox_id, int guest_fd, const void *pre,
		      size_t pre_len, const char *host, const struct sockaddr_storage *upstream)
{
	struct tenant_ca *ca;
	struct conn *c;
	char lower[TENANTCA_HOST_MAX + 1];
	pthread_attr_t attr;
	pthread_t t;
	unsigned short port;

	if (!inj || !host || strlen(host) > TENANTCA_HOST_MAX || strlen(sandbox_id) >= sizeof(c->sandbox))
		return 0;
	port = upstream->ss_family == AF_INET ? ntohs(((const struct sockaddr_in *)upstream)->sin_port)
	       : upstream->ss_family == AF_INET6
		       ? ntohs(((const struct sockaddr_in6 *)upstream)->sin6_port)
		       : 0;
	for (size_t i = 0; i <= strlen(host); i++)
		lower[i] = (char)tolower((unsigned char)host[i]);
	ca = port == inj->o.port ? ca_for(inj, sandbox_id, lower) : NULL;
	if (!ca)
		return 0;
	tenantca_put(ca);
	if (addr_denied(inj, upstream)) {
		log_warn("inject: sandbox \"%s\": connection to \"%s\" refused: the upstream address is "
			 "in a denied range (egress_deny)", sandbox_id, lower);
		close(guest_fd);
		return 1;
	}
	c = calloc(1, sizeof(*c));
	if (!c || (pre_len && !(c->pre = malloc(pre_len)))) {
		free(c);
		close(guest_fd);
		return 1;
	}
	c->inj = inj;
	snprintf(c->sandbox, sizeof(c->sandbox), "%s", sandbox_id);
	snprintf(c->host, sizeof(c->host), "%s", lower);
	c->addr = *upstream;
	c->gfd = guest_fd;
	c->ufd = -1;
	if (inj->o.note && kiln_conn_note_flow(&c->nt, guest_fd) < 0)
		c->nt.family = 0;
	if (pre_len)
		memcpy(c->pre, pre, pre_len);
	c->pre_len = pre_len;
	pthread_mutex_lock(&inj->lock);
	{
		int mine = 0;

		for (struct conn *o = inj->conns; o; o = o->next)
			mine += strcmp(o->sandbox, sandbox_id) == 0;
		if (mine >= inj->o.per_sandbox_max) {
			pthread_mutex_unlock(&inj->lock);
			log_warn("inject: sandbox \"%s\": connection to \"%s\" refused: "
				 "inject_connections_per_sandbox (%d) reached", sandbox_id, lower,
				 inj->o.per_sandbox_max);
			free(c->pre);
			free(c);
			close(guest_fd);
			return 1;
		}
	}
	if (inj->stopping || inj->active >= inj->o.connections_max) {
		pthread_mutex_unlock(&inj->lock);
		log_warn("inject: sandbox \"%s\": connection to \"%s\" refused: inject_connections_max "
			 "(%d) reached", sandbox_id, lower, inj->o.connections_max);
		free(c->pre);
		free(c);
		close(guest_fd);
		return 1;
	}
	inj->active++;
	c->next = inj->conns;
	inj->conns = c;
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_attr_setstacksize(&attr, 256 * 1024);
	if (pthread_create(&t, &attr, conn_main, c) != 0) {
		inj->conns = c->next;
		inj->active--;
		pthread_mutex_unlock(&inj->lock);
		pthread_attr_destroy(&attr);
		free(c->pre);
		free(c);
		close(guest_fd);
		return 1;
	}
	pthread_mutex_unlock(&inj->lock);
	pthread_attr_destroy(&attr);
	return 1;
}
