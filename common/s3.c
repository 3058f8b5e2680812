/*
 * s3.c - the S3 client of s3.h: one request engine (s3_perform) under single PUTs, multipart
 * uploads with a resumable state file, streamed GETs, HEAD, DELETE and ListObjectsV2.
 */
#include <arpa/inet.h>
#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/httpc.h"
#include "common/log.h"
#include "common/s3.h"

#define S3_ERRBODY_MAX (16 * 1024)	/* bytes of an error body kept */
#define S3_XML_MAX (1024 * 1024)	/* bytes of a parsed answer (initiate, complete) */
#define S3_LIST_MAX (4 * 1024 * 1024)	/* bytes of one ListObjectsV2 page */
#define S3_STATE_MAX (4 * 1024 * 1024)	/* bytes of a state file */
#define S3_STATE_MAGIC "kiln-s3-upload 1"
#define S3_IO_CHUNK (1024 * 1024)	/* bytes read at once when hashing */
#define S3_EMPTY_SHA256 "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

#define S3_HOST_MAX 255		/* bytes of the endpoint's host */

struct s3_client {
	struct s3_target t;
	struct s3_opts o;
	char sigv4[sizeof("aws:amz::s3") + S3_REGION_MAX];
	struct httpc http;		/* one handle, its connection reused (common/httpc.h) */
	/* where the endpoint leads (s3_client_resolve) */
	char host[S3_HOST_MAX + 1];	/* lower case, without brackets or zone */
	long port;
	bool literal;			/* the host is an address: nothing to pin */
	bool resolved;			/* checked; `pin` holds the addresses */
	struct curl_slist *pin;		/* CURLOPT_RESOLVE: "host:port:addr,addr" */
};

/* One request: what to send, where the answer goes, what came back. */
struct s3_req {
	const char *method;		/* GET, HEAD, PUT, POST, DELETE */
	const char *key;		/* full key, or NULL for the bucket */
	const char *query;		/* canonical query, or NULL */
	bool large;			/* a body transfer: no total timeout, low-speed limit */
	/* body: a file region (fd >= 0) or memory */
	int in_fd;
	uint64_t in_off, in_len;
	const char *in_data;
	size_t in_data_len;
	char content_md5[32];		/* base64, "" for no body */
	char sha256[65];		/* hex of the body */
	const char *content_type;
	/* answer: a file (fd >= 0, GET) or a capped buffer (NULL: discarded) */
	int out_fd;
	struct buf *out;
	/* results */
	long status;
	char etag[S3_ETAG_MAX + 1];
	int64_t content_length;
	struct buf errbody;
	/* engine state */
	CURL *curl;
	uint64_t in_pos;
	uint64_t out_pos;
	int io_errno;
	bool out_overflow;
	bool blocked_addr;
	struct kiln_error blocked;	/* why, when blocked_addr */
	const struct s3_client *client;	/* for the socket check */
};

void s3_target_wipe(struct s3_target *t)
{
	if (t)
		OPENSSL_cleanse(t, sizeof(*t));
}

/* ------------------------------------------------------------------ pure helpers */

int s3_uri_encode(struct buf *out, const char *s, bool keep_slash)
{
	static const char hex[] = "0123456789ABCDEF";
	int rc = 0;

	for (const unsigned char *p = (const unsigned char *)s; *p && rc == 0; p++) {
		if (isalnum(*p) || *p == '-' || *p == '.' || *p == '_' || *p == '~' ||
		    (keep_slash && *p == '/')) {
			rc = buf_append(out, p, 1);
		} else {
			char e[3] = { '%', hex[*p >> 4], hex[*p & 15] };
			rc = buf_append(out, e, 3);
		}
	}
	return rc;
}

int s3_url_build(struct buf *out, const char *endpoint, const char *bucket, const char *key,
		 const char *query)
{
	size_t n = strlen(endpoint);
	int rc;

	while (n > 0 && endpoint[n - 1] == '/')
		n--;
	rc = buf_append(out, endpoint, n);
	if (!rc)
		rc = buf_appends(out, "/");
	if (!rc)
		rc = s3_uri_encode(out, bucket, false);
	if (!rc && key) {
		rc = buf_appends(out, "/");
		if (!rc)
			rc = s3_uri_encode(out, key, true);
	}
	if (!rc && query && *query) {
		rc = buf_appends(out, "?");
		if (!rc)
			rc = buf_appends(out, query);
	}
	return rc;
}

/* Decodes the five XML entities and numeric references of `s` (`len` bytes) into `out`. */
static void xml_unescape(const char *s, size_t len, char *out, size_t n)
{
	static const struct { const char *ent; char c; } ents[] = {
		{ "&amp;", '&' }, { "&lt;", '<' }, { "&gt;", '>' }, { "&quot;", '"' }, { "&apos;", '\'' },
	};
	size_t o = 0;

	for (size_t i = 0; i < len && o + 1 < n;) {
		bool done = false;

		if (s[i] == '&') {
			for (size_t e = 0; e < sizeof(ents) / sizeof(ents[0]); e++) {
				size_t el = strlen(ents[e].ent);
				if (len - i >= el && memcmp(s + i, ents[e].ent, el) == 0) {
					out[o++] = ents[e].c;
					i += el;
					done = true;
					break;
				}
			}
			if (!done && len - i > 3 && s[i + 1] == '#') {
				size_t j = i + 2;
				unsigned long v = 0;
				bool hx = s[j] == 'x';

				j += hx;
				while (j < len && j - i < 12 && isxdigit((unsigned char)s[j])) {
					v = v * (hx ? 16 : 10) + (unsigned long)(isdigit((unsigned char)s[j]) ?
						s[j] - '0' : (tolower((unsigned char)s[j]) - 'a' + 10));
					j++;
				}
				if (j < len && s[j] == ';' && v > 0 && v < 0x80) {
					out[o++] = (char)v;
					i = j + 1;
					done = true;
				}
			}
		}
		if (!done)
			out[o++] = s[i++];
	}
	out[o < n ? o : n - 1] = '\0';
}

/* Finds `<tag>` (or `<tag ...>`) in [p, end); returns the start of its text and its length. */
static const char *xml_find(const char *p, const char *end, const char *tag, size_t *vlen)
{
	size_t tl = strlen(tag);

	while (p < end) {
		const char *lt = memchr(p, '<', (size_t)(end - p));
		const char *gt, *close;

		if (!lt || (size_t)(end - lt) < tl + 2)
			return NULL;
		p = lt + 1;
		if (memcmp(p, tag, tl) != 0 || (p[tl] != '>' && p[tl] != ' ' && p[tl] != '/'))
			continue;
		gt = memchr(p, '>', (size_t)(end - p));
		if (!gt)
			return NULL;
		if (gt[-1] == '/') {	/* <Tag/> */
			*vlen = 0;
			return gt;
		}
		gt++;
		for (close = gt; close < end; close++) {
			const char *c = memchr(close, '<', (size_t)(end - close));
			if (!c || (size_t)(end - c) < tl + 3)
				return NULL;
			if (c[1] == '/' && memcmp(c + 2, tag, tl) == 0 && c[2 + tl] == '>') {
				*vlen = (size_t)(c - gt);
				return gt;
			}
			close = c;
		}
		return NULL;
	}
	return NULL;
}

bool s3_xml_value(const char *xml, size_t len, const char *tag, char *out, size_t n)
{
	size_t vlen = 0;
	const char *v = xml ? xml_find(xml, xml + len, tag, &vlen) : NULL;

	if (n)
		out[0] = '\0';
	if (!v)
		return false;
	if (n)
		xml_unescape(v, vlen, out, n);
	return true;
}

enum kiln_err s3_error_of(long status, const char *code)
{
	static const struct { const char *code; enum kiln_err e; } codes[] = {
		{ "NoSuchKey", KILN_E_NOT_FOUND },
		{ "NoSuchUpload", KILN_E_NOT_FOUND },
		{ "NoSuchBucket", KILN_E_INVALID },
		{ "InvalidAccessKeyId", KILN_E_FORBIDDEN },
		{ "SignatureDoesNotMatch", KILN_E_FORBIDDEN },
		{ "AccessDenied", KILN_E_FORBIDDEN },
		{ "InvalidToken", KILN_E_FORBIDDEN },
		{ "ExpiredToken", KILN_E_FORBIDDEN },
		{ "AccountProblem", KILN_E_FORBIDDEN },
		{ "SlowDown", KILN_E_UNAVAILABLE },
		{ "ServiceUnavailable", KILN_E_UNAVAILABLE },
		{ "InternalError", KILN_E_UNAVAILABLE },
		{ "RequestTimeout", KILN_E_UNAVAILABLE },
	};

	if (status >= 200 && status < 300)
		return KILN_OK;
	for (size_t i = 0; code && i < sizeof(codes) / sizeof(codes[0]); i++)
		if (strcmp(code, codes[i].code) == 0)
			return codes[i].e;
	if (status == 404)
		return KILN_E_NOT_FOUND;
	if (status == 401 || status == 403)
		return KILN_E_FORBIDDEN;
	if (status == 429 || status >= 500)
		return KILN_E_UNAVAILABLE;
	return KILN_E_INVALID;
}

/* ------------------------------------------------------------------ checks */

static bool has_ctl(const char *s)
{
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || *s == 0x7f)
			return true;
	return false;
}

enum kiln_err s3_check_endpoint(const char *ep, struct kiln_error *err)
{
	CURLU *u;
	char *scheme = NULL, *host = NULL, *user = NULL, *query = NULL, *frag = NULL;
	enum kiln_err rc = KILN_OK;
	size_t n = strlen(ep);

	if (n == 0 || n > S3_ENDPOINT_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "endpoint must be 1 to %d bytes",
				      S3_ENDPOINT_MAX);
	if (has_ctl(ep) || strchr(ep, ' '))
		return kiln_error_set(err, KILN_E_INVALID, "endpoint has a space or control character");
	if (strncmp(ep, "http://", 7) != 0 && strncmp(ep, "https://", 8) != 0)
		return kiln_error_set(err, KILN_E_INVALID, "endpoint must be an http:// or https:// URL");
	u = curl_url();
	if (!u)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (curl_url_set(u, CURLUPART_URL, ep, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK || !host || !*host) {
		rc = kiln_error_set(err, KILN_E_INVALID, "endpoint is not a valid URL");
		goto out;
	}
	curl_url_get(u, CURLUPART_USER, &user, 0);
	curl_url_get(u, CURLUPART_QUERY, &query, 0);
	curl_url_get(u, CURLUPART_FRAGMENT, &frag, 0);
	curl_url_get(u, CURLUPART_SCHEME, &scheme, 0);
	if (user)
		rc = kiln_error_set(err, KILN_E_INVALID, "endpoint must not hold credentials");
	else if (query || frag || strchr(ep, '?') || strchr(ep, '#'))
		rc = kiln_error_set(err, KILN_E_INVALID, "endpoint must not have a query or fragment");
out:
	curl_free(scheme);
	curl_free(host);
	curl_free(user);
	curl_free(query);
	curl_free(frag);
	curl_url_cleanup(u);
	return rc;
}

enum kiln_err s3_check_bucket(const char *b, struct kiln_error *err)
{
	size_t n = strlen(b);
	int dots = 0;
	bool digits_dots = true;

	if (n < S3_BUCKET_MIN || n > S3_BUCKET_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "bucket must be %d to %d characters",
				      S3_BUCKET_MIN, S3_BUCKET_MAX);
	for (size_t i = 0; i < n; i++) {
		unsigned char ch = (unsigned char)b[i];
		if (!(islower(ch) || isdigit(ch) || ch == '-' || ch == '.'))
			return kiln_error_set(err, KILN_E_INVALID,
					      "bucket may hold only a-z, 0-9, '-' and '.'");
		dots += ch == '.';
		if (!isdigit(ch) && ch != '.')
			digits_dots = false;
	}
	if (!isalnum((unsigned char)b[0]) || !isalnum((unsigned char)b[n - 1]))
		return kiln_error_set(err, KILN_E_INVALID,
				      "bucket must begin and end with a letter or digit");
	if (strstr(b, "..") || strstr(b, ".-") || strstr(b, "-."))
		return kiln_error_set(err, KILN_E_INVALID, "bucket has adjacent '.' or '-' and '.'");
	if (digits_dots && dots == 3)
		return kiln_error_set(err, KILN_E_INVALID, "bucket must not be an IP address");
	return KILN_OK;
}

enum kiln_err s3_check_region(const char *r, struct kiln_error *err)
{
	size_t n = strlen(r);

	if (n == 0 || n > S3_REGION_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "region must be 1 to %d characters",
				      S3_REGION_MAX);
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)r[i]) && r[i] != '-' && r[i] != '_')
			return kiln_error_set(err, KILN_E_INVALID,
					      "region may hold only letters, digits, '-' and '_'");
	return KILN_OK;
}

enum kiln_err s3_check_prefix(const char *p, struct kiln_error *err)
{
	if (strlen(p) > S3_PREFIX_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "prefix must be at most %d bytes",
				      S3_PREFIX_MAX);
	if (has_ctl(p))
		return kiln_error_set(err, KILN_E_INVALID, "prefix has a control character");
	if (p[0] == '/')
		return kiln_error_set(err, KILN_E_INVALID, "prefix must not begin with '/'");
	if (strstr(p, "//"))
		return kiln_error_set(err, KILN_E_INVALID, "prefix must not hold '//'");
	return KILN_OK;
}

static enum kiln_err check_credential(const char *field, const char *s, size_t max,
				      struct kiln_error *err)
{
	size_t n = strlen(s);

	if (n == 0 || n > max)
		return kiln_error_set(err, KILN_E_INVALID, "%s must be 1 to %zu characters", field, max);
	for (size_t i = 0; i < n; i++)
		if ((unsigned char)s[i] <= 0x20 || (unsigned char)s[i] >= 0x7f)
			return kiln_error_set(err, KILN_E_INVALID,
					      "%s may hold only printable ASCII without spaces", field);
	return KILN_OK;
}

enum kiln_err s3_check_access_key_id(const char *id, struct kiln_error *err)
{
	return check_credential("access_key_id", id, S3_KEY_ID_MAX, err);
}

enum kiln_err s3_check_secret(const char *secret, struct kiln_error *err)
{
	return check_credential("secret_access_key", secret, S3_SECRET_MAX, err);
}

enum kiln_err s3_target_check(const struct s3_target *t, struct kiln_error *err)
{
	enum kiln_err rc = s3_check_endpoint(t->endpoint, err);

	if (rc == KILN_OK)
		rc = s3_check_bucket(t->bucket, err);
	if (rc == KILN_OK)
		rc = s3_check_region(t->region, err);
	if (rc == KILN_OK)
		rc = s3_check_prefix(t->prefix, err);
	if (rc == KILN_OK)
		rc = s3_check_access_key_id(t->access_key_id, err);
	if (rc == KILN_OK)
		rc = s3_check_secret(t->secret_access_key, err);
	return rc;
}

/* ------------------------------------------------------------------ client */

/* The endpoint's host (lower case, no brackets, no zone) and port into `c`. */
static enum kiln_err endpoint_host(const char *ep, struct s3_client *c, struct kiln_error *err)
{
	CURLU *u = curl_url();
	char *host = NULL, *port = NULL;
	enum kiln_err rc = KILN_OK;
	const char *h;
	size_t n;
	unsigned char probe[16];

	if (!u)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	if (curl_url_set(u, CURLUPART_URL, ep, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK ||
	    curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) != CURLUE_OK) {
		rc = kiln_error_set(err, KILN_E_INVALID, "endpoint is not a valid URL");
		goto out;
	}
	h = host;
	n = strlen(h);
	if (n >= 2 && h[0] == '[') {	/* [v6] or [v6%zone] */
		h++;
		n = strcspn(h, "%]");
	}
	if (n == 0 || n > S3_HOST_MAX) {
		rc = kiln_error_set(err, KILN_E_INVALID, "endpoint's host must be 1 to %d bytes",
				    S3_HOST_MAX);
		goto out;
	}
	for (size_t i = 0; i < n; i++)
		c->host[i] = (char)tolower((unsigned char)h[i]);
	c->host[n] = '\0';
	c->port = strtol(port, NULL, 10);
	c->literal = inet_pton(AF_INET, c->host, probe) == 1 ||
		     inet_pton(AF_INET6, c->host, probe) == 1;
out:
	curl_free(host);
	curl_free(port);
	curl_url_cleanup(u);
	return rc;
}

enum kiln_err s3_client_resolve(struct s3_client *c, struct kiln_error *err)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM };
	struct addrinfo *res = NULL;
	struct buf pin;
	enum kiln_err rc = KILN_OK;
	int e, nad = 0;

	c->resolved = false;
	curl_slist_free_all(c->pin);
	c->pin = NULL;
	e = getaddrinfo(c->host, NULL, &hints, &res);
	if (e != 0) {
		log_debug("s3: cannot resolve \"%s\": %s", c->host, gai_strerror(e));
		return kiln_error_set(err, e == EAI_MEMORY ? KILN_E_NOMEM : KILN_E_UNAVAILABLE,
				      "the bucket could not be reached");
	}
	buf_init(&pin, 8192);
	if (buf_appendf(&pin, "%s:%ld:", c->host, c->port) != 0)
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	for (struct addrinfo *ai = res; ai && rc == KILN_OK; ai = ai->ai_next) {
		char text[INET6_ADDRSTRLEN];
		const void *a;

		if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6)
			continue;
		rc = netaddr_check(c->o.allow, c->host, ai->ai_addr, err);
		if (rc != KILN_OK)
			break;
		a = ai->ai_family == AF_INET ?
			(const void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr :
			(const void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr;
		inet_ntop(ai->ai_family, a, text, sizeof(text));
		if (buf_appendf(&pin, ai->ai_family == AF_INET ? "%s%s" : "%s[%s]", nad ? "," : "",
				text) != 0) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			break;
		}
		nad++;
	}
	freeaddrinfo(res);
	if (rc == KILN_OK && nad == 0)
		rc = kiln_error_set(err, KILN_E_UNAVAILABLE, "the bucket could not be reached");
	if (rc == KILN_OK && !c->literal) {
		c->pin = curl_slist_append(NULL, pin.data);
		if (!c->pin)
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	buf_release(&pin);
	c->resolved = rc == KILN_OK;
	return rc;
}

struct s3_client *s3_client_new(const struct s3_target *t, const struct s3_opts *opts,
				struct kiln_error *err)
{
	struct s3_client *c;

	if (s3_target_check(t, err) != KILN_OK)
		return NULL;
	c = calloc(1, sizeof(*c));
	if (!c) {
		kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		return NULL;
	}
	c->t = *t;
	if (opts)
		c->o = *opts;
	else
		c->o.retries = 2;
	if (!c->o.connect_timeout_ms)
		c->o.connect_timeout_ms = 5000;
	if (!c->o.request_timeout_s)
		c->o.request_timeout_s = 60;
	if (!c->o.low_speed_s)
		c->o.low_speed_s = 30;
	if (!c->o.retry_delay_ms)
		c->o.retry_delay_ms = 200;
	if (!c->o.part_size)
		c->o.part_size = S3_PART_DEFAULT;
	if (c->o.part_size < S3_PART_MIN)
		c->o.part_size = S3_PART_MIN;
	snprintf(c->sigv4, sizeof(c->sigv4), "aws:amz:%s:s3", t->region);
	if (endpoint_host(t->endpoint, c, err) != KILN_OK) {
		s3_client_free(c);
		return NULL;
	}
	if (httpc_init(&c->http, err) != KILN_OK) {
		s3_client_free(c);
		return NULL;
	}
	return c;
}

void s3_client_free(struct s3_client *c)
{
	if (!c)
		return;
	httpc_close(&c->http);
	curl_slist_free_all(c->pin);
	s3_target_wipe(&c->t);
	free(c);
}

/* The full key of `key` under the target's prefix, in `out` (S3_KEY_MAX + 1 bytes). */
static enum kiln_err full_key(const struct s3_client *c, const char *key, char *out,
			      struct kiln_error *err)
{
	int n = snprintf(out, S3_KEY_MAX + 1, "%s%s", c->t.prefix, key);

	if (!*key || has_ctl(key))
		return kiln_error_set(err, KILN_E_INVALID, "bad object key");
	if (n < 0 || n > S3_KEY_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "object key over %d bytes", S3_KEY_MAX);
	return KILN_OK;
}

/* ------------------------------------------------------------------ request engine */

static size_t on_read(char *p, size_t size, size_t nmemb, void *arg)
{
	struct s3_req *r = arg;
	uint64_t left = r->in_len - r->in_pos;
	size_t want = size * nmemb;
	ssize_t got;

	if (want > left)
		want = (size_t)left;
	if (want == 0)
		return 0;
	if (r->in_fd < 0) {
		memcpy(p, r->in_data + r->in_pos, want);
		r->in_pos += want;
		return want;
	}
	got = pread(r->in_fd, p, want, (off_t)(r->in_off + r->in_pos));
	if (got <= 0) {
		r->io_errno = got < 0 ? errno : EIO;	/* a file that shrank under us */
		return CURL_READFUNC_ABORT;
	}
	r->in_pos += (uint64_t)got;
	return (size_t)got;
}

static int on_seek(void *arg, curl_off_t off, int origin)
{
	struct s3_req *r = arg;

	if (origin != SEEK_SET || off < 0 || (uint64_t)off > r->in_len)
		return CURL_SEEKFUNC_CANTSEEK;
	r->in_pos = (uint64_t)off;
	return CURL_SEEKFUNC_OK;
}

static size_t on_write(char *p, size_t size, size_t nmemb, void *arg)
{
	struct s3_req *r = arg;
	size_t n = size * nmemb;
	long code = 0;

	curl_easy_getinfo(r->curl, CURLINFO_RESPONSE_CODE, &code);
	if (code < 200 || code >= 300) {
		/* An error body: keep its beginning, drop the rest. */
		size_t room = r->errbody.max - r->errbody.len;
		if (room)
			buf_append(&r->errbody, p, n < room ? n : room);
		return n;
	}
	if (r->out_fd >= 0) {
		size_t done = 0;
		while (done < n) {
			ssize_t w = pwrite(r->out_fd, p + done, n - done, (off_t)r->out_pos);
			if (w < 0 && errno == EINTR)
				continue;
			if (w <= 0) {
				r->io_errno = w < 0 ? errno : EIO;
				return 0;
			}
			done += (size_t)w;
			r->out_pos += (uint64_t)w;
		}
		return n;
	}
	if (r->out && buf_append(r->out, p, n) != 0) {
		r->out_overflow = true;
		return 0;
	}
	return n;
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *arg)
{
	struct s3_req *r = arg;
	size_t n = size * nmemb, vlen;
	const char *v;

	if (n >= 5 && memcmp(p, "HTTP/", 5) == 0) {	/* a new answer (after 100 Continue) */
		r->etag[0] = '\0';
		r->content_length = -1;
		return n;
	}
	v = memchr(p, ':', n);
	if (!v)
		return n;
	vlen = n - (size_t)(v + 1 - p);
	for (v++; vlen && (*v == ' ' || *v == '\t'); v++, vlen--)
		;
	while (vlen && (v[vlen - 1] == '\r' || v[vlen - 1] == '\n' || v[vlen - 1] == ' '))
		vlen--;
	if (strncasecmp(p, "etag:", 5) == 0 && vlen <= S3_ETAG_MAX) {
		memcpy(r->etag, v, vlen);
		r->etag[vlen] = '\0';
	} else if (strncasecmp(p, "content-length:", 15) == 0 && vlen < 21) {
		char tmp[21];
		memcpy(tmp, v, vlen);
		tmp[vlen] = '\0';
		r->content_length = strtoll(tmp, NULL, 10);
	}
	return n;
}

/*
 * Checks every socket before it connects (netaddr_check with the client's allow list), whatever
 * the name resolved to: the pinned addresses make this the second check, not the only one.
 */
static curl_socket_t on_open_socket(void *arg, curlsocktype purpose, struct curl_sockaddr *a)
{
	struct s3_req *r = arg;

	if (netaddr_check(r->client->o.allow, r->client->host, &a->addr, &r->blocked) != KILN_OK) {
		r->blocked_addr = true;
		return CURL_SOCKET_BAD;
	}
	(void)purpose;
	return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

static void printable(char *s)
{
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || (unsigned char)*s >= 0x7f)
			*s = '?';
}

/*
 * Sets `err` for an S3 error answer: HTTP `status` and the <Code> of its body (may be ""). The
 * message is one of a fixed set; the code is named only when it is in the table below (and then
 * from the table, not from the body). Returns the kiln_err (s3_error_of).
 */
static enum kiln_err answer_error(const char *method, const char *key, long status,
				  const char *code, struct kiln_error *err)
{
	static const struct { const char *code; const char *text; } known[] = {
		{ "NoSuchKey", "no such object" },
		{ "NoSuchUpload", "no such multipart upload" },
		{ "NoSuchBucket", "the bucket does not exist" },
		{ "InvalidAccessKeyId", "the bucket refused the credentials" },
		{ "SignatureDoesNotMatch", "the bucket refused the credentials" },
		{ "AccessDenied", "the bucket refused the credentials" },
		{ "InvalidToken", "the bucket refused the credentials" },
		{ "ExpiredToken", "the bucket refused the credentials" },
		{ "AccountProblem", "the bucket refused the credentials" },
		{ "AuthorizationHeaderMalformed", "the bucket is in another region" },
		{ "PermanentRedirect", "the bucket is in another region" },
		{ "IllegalLocationConstraintException", "the bucket is in another region" },
		{ "BadDigest", "the bucket refused the request" },
		{ "InvalidDigest", "the bucket refused the request" },
		{ "XAmzContentSHA256Mismatch", "the bucket refused the request" },
		{ "EntityTooSmall", "the bucket refused the request" },
		{ "EntityTooLarge", "the bucket refused the request" },
		{ "InvalidPart", "the bucket refused the request" },
		{ "InvalidPartOrder", "the bucket refused the request" },
		{ "SlowDown", "the bucket could not be reached" },
		{ "ServiceUnavailable", "the bucket could not be reached" },
		{ "InternalError", "the bucket could not be reached" },
		{ "RequestTimeout", "the bucket could not be reached" },
	};
	enum kiln_err rc = s3_error_of(status, code);
	const char *text, *shown = NULL;
	char logged[64];

	snprintf(logged, sizeof(logged), "%s", code);
	printable(logged);
	log_debug("s3 %s \"%s\": HTTP %ld, code \"%s\"", method, key ? key : "", status, logged);
	for (size_t i = 0; i < sizeof(known) / sizeof(known[0]) && !shown; i++)
		if (strcmp(code, known[i].code) == 0) {
			shown = known[i].code;
			text = known[i].text;
		}
	if (!shown) {
		switch (rc) {
		case KILN_E_FORBIDDEN:
			text = "the bucket refused the credentials";
			break;
		case KILN_E_NOT_FOUND:
			text = "no such object";
			break;
		case KILN_E_UNAVAILABLE:
			text = "the bucket could not be reached";
			break;
		default:
			text = "the bucket refused the request";
		}
	}
	if (shown)
		return kiln_error_set(err, rc, "s3 %s \"%s\": %s (%s)", method, key ? key : "", text,
				      shown);
	return kiln_error_set(err, rc, "s3 %s \"%s\": %s", method, key ? key : "", text);
}

/* Runs `r` once. Returns the kiln_err of the outcome with `err` set. */
static enum kiln_err perform_once(struct s3_client *c, struct s3_req *r, struct kiln_error *err)
{
	struct curl_slist *hdrs = NULL;
	struct httpc_opts o = { .upload_len = -1 };
	struct kiln_error perr = { 0 };
	struct buf url;
	char hdr[160], s3code[64];
	enum kiln_err rc;
	CURLcode cc;

	if (!c->resolved && (rc = s3_client_resolve(c, err)) != KILN_OK)
		return rc;
	buf_init(&url, S3_ENDPOINT_MAX + 4 * S3_KEY_MAX + 4 * S3_UPLOAD_ID_MAX + 256);
	if (s3_url_build(&url, c->t.endpoint, c->t.bucket, r->key, r->query) != 0) {
		buf_release(&url);
		return kiln_error_set(err, KILN_E_INVALID, "object URL too long");
	}
	r->curl = c->http.curl;
	r->client = c;
	r->status = 0;
	r->etag[0] = '\0';
	r->content_length = -1;
	r->in_pos = 0;
	r->io_errno = 0;
	r->out_overflow = false;
	r->blocked_addr = false;
	kiln_error_clear(&r->blocked);
	buf_reset(&r->errbody);

	o.url = url.data;
	o.method = r->method;
	o.strict = true;
	o.resolve = c->pin;
	o.open_socket = on_open_socket;
	o.open_socket_arg = r;
	o.aws_sigv4 = c->sigv4;
	o.username = c->t.access_key_id;
	o.password = c->t.secret_access_key;
	o.connect_timeout_ms = (long)c->o.connect_timeout_ms;
	if (r->large) {
		o.low_speed_bytes = 1024L;
		o.low_speed_s = (long)c->o.low_speed_s;
	} else {
		o.timeout_ms = (long)c->o.request_timeout_s * 1000L;
	}
	o.on_write = on_write;
	o.write_arg = r;
	o.on_header = on_header;
	o.header_arg = r;

	snprintf(hdr, sizeof(hdr), "x-amz-content-sha256: %s",
		 r->sha256[0] ? r->sha256 : S3_EMPTY_SHA256);
	hdrs = curl_slist_append(hdrs, hdr);
	if (r->content_md5[0]) {
		snprintf(hdr, sizeof(hdr), "Content-MD5: %s", r->content_md5);
		hdrs = curl_slist_append(hdrs, hdr);
	}
	if (r->content_type) {
		snprintf(hdr, sizeof(hdr), "Content-Type: %s", r->content_type);
		hdrs = curl_slist_append(hdrs, hdr);
	}
	if (strcmp(r->method, "PUT") == 0) {
		o.on_read = on_read;
		o.read_arg = r;
		o.on_seek = on_seek;
		o.upload_len = (long long)r->in_len;
	} else if (strcmp(r->method, "POST") == 0) {
		o.post_data = r->in_data ? r->in_data : "";
		o.post_len = r->in_data_len;
	}
	if (!hdrs) {
		buf_release(&url);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	o.headers = hdrs;
	httpc_setup(&c->http, &o);

	httpc_perform(&c->http, &r->status, &perr);
	cc = c->http.result;
	curl_easy_getinfo(c->http.curl, CURLINFO_RESPONSE_CODE, &r->status);
	curl_slist_free_all(hdrs);
	curl_easy_reset(c->http.curl);	/* drops the pointers to the credentials and to `r` */
	buf_release(&url);

	if (r->io_errno)
		return kiln_error_set(err, KILN_E_IO, "s3 %s \"%s\": local file: %s", r->method,
				      r->key ? r->key : "", strerror(r->io_errno));
	if (r->blocked_addr)
		return kiln_error_set(err, KILN_E_INVALID, "%s", r->blocked.msg);
	if (r->out_overflow)
		return kiln_error_set(err, KILN_E_INVALID, "s3 %s: the bucket's answer is too large",
				      r->method);
	if (cc != CURLE_OK) {
		log_debug("s3 %s \"%s\" to \"%s\": %s", r->method, r->key ? r->key : "", c->host,
			  curl_easy_strerror(cc));
		rc = cc == CURLE_URL_MALFORMAT || cc == CURLE_UNSUPPORTED_PROTOCOL ? KILN_E_INVALID :
										  KILN_E_UNAVAILABLE;
		return kiln_error_set(err, rc, "s3 %s \"%s\": the bucket could not be reached",
				      r->method, r->key ? r->key : "");
	}
	if (r->status >= 200 && r->status < 300)
		return KILN_OK;
	s3_xml_value(r->errbody.data, r->errbody.len, "Code", s3code, sizeof(s3code));
	return answer_error(r->method, r->key, r->status, s3code, err);
}

/* Runs `r`, retrying on KILN_E_UNAVAILABLE as the options say. */
static enum kiln_err perform(struct s3_client *c, struct s3_req *r, struct kiln_error *err)
{
	unsigned delay = c->o.retry_delay_ms;
	enum kiln_err rc;

	buf_init(&r->errbody, S3_ERRBODY_MAX);
	for (unsigned attempt = 0;; attempt++) {
		struct kiln_error e = { 0 };

		if (r->out)
			buf_reset(r->out);
		if (r->out_fd >= 0) {
			r->out_pos = 0;
			if (ftruncate(r->out_fd, 0) != 0) {
				rc = kiln_error_set(err, KILN_E_IO, "cannot truncate: %s",
						    strerror(errno));
				break;
			}
		}
		rc = perform_once(c, r, &e);
		if (rc == KILN_OK || rc != KILN_E_UNAVAILABLE || attempt >= c->o.retries) {
			if (rc != KILN_OK)
				kiln_error_set(err, rc, "%s", e.msg);
			break;
		}
		log_debug("s3 %s \"%s\": %s; retrying in %u ms", r->method, r->key ? r->key : "",
			  e.msg, delay);
		c->resolved = false;	/* resolved (and checked) again */
		struct timespec ts = { delay / 1000, (long)(delay % 1000) * 1000000L };
		nanosleep(&ts, NULL);
		delay *= 2;
	}
	buf_release(&r->errbody);
	return rc;
}

static void req_init(struct s3_req *r, const char *method, const char *key, const char *query)
{
	memset(r, 0, sizeof(*r));
	r->method = method;
	r->key = key;
	r->query = query;
	r->in_fd = -1;
	r->out_fd = -1;
}

/* ------------------------------------------------------------------ digests */

static void hex(const unsigned char *d, size_t n, char *out)
{
	static const char x[] = "0123456789abcdef";

	for (size_t i = 0; i < n; i++) {
		out[2 * i] = x[d[i] >> 4];
		out[2 * i + 1] = x[d[i] & 15];
	}
	out[2 * n] = '\0';
}

/* Sets r->content_md5 and r->sha256 from the body `r` will send (memory or file region). */
static enum kiln_err digest_body(struct s3_req *r, struct kiln_error *err)
{
	EVP_MD_CTX *md5 = EVP_MD_CTX_new(), *sha = EVP_MD_CTX_new();
	unsigned char dm[EVP_MAX_MD_SIZE], ds[EVP_MAX_MD_SIZE];
	unsigned lm = 0, ls = 0;
	enum kiln_err rc = KILN_OK;
	char *chunk = NULL;

	if (!md5 || !sha || !EVP_DigestInit_ex(md5, EVP_md5(), NULL) ||
	    !EVP_DigestInit_ex(sha, EVP_sha256(), NULL)) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "cannot start digests");
		goto out;
	}
	if (r->in_fd < 0) {
		EVP_DigestUpdate(md5, r->in_data, r->in_data_len);
		EVP_DigestUpdate(sha, r->in_data, r->in_data_len);
		r->in_len = r->in_data_len;
	} else {
		chunk = malloc(S3_IO_CHUNK);
		if (!chunk) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			goto out;
		}
		for (uint64_t done = 0; done < r->in_len;) {
			size_t want = r->in_len - done < S3_IO_CHUNK ? (size_t)(r->in_len - done) :
									 S3_IO_CHUNK;
			ssize_t got = pread(r->in_fd, chunk, want, (off_t)(r->in_off + done));
			if (got < 0 && errno == EINTR)
				continue;
			if (got <= 0) {
				rc = kiln_error_set(err, KILN_E_IO, "cannot read the file: %s",
						    got < 0 ? strerror(errno) : "it shrank");
				goto out;
			}
			EVP_DigestUpdate(md5, chunk, (size_t)got);
			EVP_DigestUpdate(sha, chunk, (size_t)got);
			done += (uint64_t)got;
		}
	}
	EVP_DigestFinal_ex(md5, dm, &lm);
	EVP_DigestFinal_ex(sha, ds, &ls);
	EVP_EncodeBlock((unsigned char *)r->content_md5, dm, (int)lm);
	hex(ds, ls, r->sha256);
out:
	free(chunk);
	EVP_MD_CTX_free(md5);
	EVP_MD_CTX_free(sha);
	return rc;
}

/* ------------------------------------------------------------------ simple calls */

enum kiln_err s3_put_data(struct s3_client *c, const char *key, const void *data, size_t len,
			  struct kiln_error *err)
{
	char fk[S3_KEY_MAX + 1];
	struct s3_req r;
	enum kiln_err rc = full_key(c, key, fk, err);

	if (rc != KILN_OK)
		return rc;
	req_init(&r, "PUT", fk, NULL);
	r.in_data = data;
	r.in_data_len = len;
	rc = digest_body(&r, err);
	return rc == KILN_OK ? perform(c, &r, err) : rc;
}

enum kiln_err s3_head(struct s3_client *c, const char *key, struct s3_object_info *info,
		      struct kiln_error *err)
{
	char fk[S3_KEY_MAX + 1];
	struct s3_req r;
	enum kiln_err rc = full_key(c, key, fk, err);

	if (rc != KILN_OK)
		return rc;
	req_init(&r, "HEAD", fk, NULL);
	rc = perform(c, &r, err);
	if (rc == KILN_OK && info) {
		info->size = r.content_length >= 0 ? (uint64_t)r.content_length : 0;
		snprintf(info->etag, sizeof(info->etag), "%s", r.etag);
	}
	return rc;
}

enum kiln_err s3_delete(struct s3_client *c, const char *key, struct kiln_error *err)
{
	char fk[S3_KEY_MAX + 1];
	struct s3_req r;
	struct kiln_error e = { 0 };
	enum kiln_err rc = full_key(c, key, fk, err);

	if (rc != KILN_OK)
		return rc;
	req_init(&r, "DELETE", fk, NULL);
	rc = perform(c, &r, &e);
	if (rc == KILN_E_NOT_FOUND)	/* NoSuchBucket maps to KILN_E_INVALID, not here */
		return KILN_OK;
	if (rc != KILN_OK)
		kiln_error_set(err, rc, "%s", e.msg);
	return rc;
}

enum kiln_err s3_get_file(struct s3_client *c, const char *key, const char *path,
			  struct kiln_error *err)
{
	char fk[S3_KEY_MAX + 1], *tmp = NULL;
	struct s3_req r;
	enum kiln_err rc = full_key(c, key, fk, err);
	int fd = -1;

	if (rc != KILN_OK)
		return rc;
	if (asprintf(&tmp, "%s.part", path) < 0)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0) {
		rc = kiln_error_set(err, KILN_E_IO, "cannot create \"%s\": %s", tmp, strerror(errno));
		goto out;
	}
	req_init(&r, "GET", fk, NULL);
	r.large = true;
	r.out_fd = fd;
	rc = perform(c, &r, err);
	if (rc == KILN_OK && r.content_length >= 0 && (uint64_t)r.content_length != r.out_pos)
		rc = kiln_error_set(err, KILN_E_UNAVAILABLE, "s3 GET \"%s\": the answer was cut short",
				    fk);
	if (rc == KILN_OK && fsync(fd) != 0)
		rc = kiln_error_set(err, KILN_E_IO, "cannot sync \"%s\": %s", tmp, strerror(errno));
	if (close(fd) != 0 && rc == KILN_OK)
		rc = kiln_error_set(err, KILN_E_IO, "cannot write \"%s\": %s", tmp, strerror(errno));
	fd = -1;
	if (rc == KILN_OK && rename(tmp, path) != 0)
		rc = kiln_error_set(err, KILN_E_IO, "cannot rename to \"%s\": %s", path,
				    strerror(errno));
out:
	if (fd >= 0)
		close(fd);
	if (rc != KILN_OK && tmp)
		unlink(tmp);
	free(tmp);
	return rc;
}

/* A <Size>: decimal digits only, at most INT64_MAX (sizes go to off_t and int64 columns). */
static bool list_size(const char *s, uint64_t *v)
{
	char *end;

	if (!isdigit((unsigned char)*s))
		return false;
	errno = 0;
	*v = strtoull(s, &end, 10);
	return !*end && errno == 0 && *v <= INT64_MAX;
}

enum kiln_err s3_list_parse(const char *xml, size_t len, const char *prefix, s3_list_cb cb,
			    void *arg, char *next, size_t nnext, struct kiln_error *err)
{
	const char *p = xml ? xml : "", *end = p + (xml ? len : 0);
	size_t plen = strlen(prefix), vlen;
	/* one byte more than a key may have, so that a longer one shows and is refused */
	char *key = malloc(S3_KEY_MAX + 2), size[32], trunc[8];
	enum kiln_err rc = KILN_OK;
	uint64_t n;
	const char *v;

	if (!key)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	while (rc == KILN_OK && (v = xml_find(p, end, "Contents", &vlen)) != NULL) {
		if (!s3_xml_value(v, vlen, "Key", key, S3_KEY_MAX + 2) || strlen(key) > S3_KEY_MAX ||
		    !s3_xml_value(v, vlen, "Size", size, sizeof(size)) || !list_size(size, &n) ||
		    strncmp(key, prefix, plen)) {
			rc = kiln_error_set(err, KILN_E_INVALID, "s3 list: a malformed entry");
			break;
		}
		rc = cb(arg, key + plen, n);
		p = v + vlen;
	}
	next[0] = '\0';
	if (rc == KILN_OK && s3_xml_value(xml, len, "IsTruncated", trunc, sizeof(trunc)) &&
	    strcmp(trunc, "true") == 0 &&
	    (!s3_xml_value(xml, len, "NextContinuationToken", next, nnext) || !next[0]))
		rc = kiln_error_set(err, KILN_E_INVALID, "s3 list: truncated without a token");
	free(key);
	return rc;
}

enum kiln_err s3_list(struct s3_client *c, const char *prefix, s3_list_cb cb, void *arg,
		      struct kiln_error *err)
{
	char fk[S3_KEY_MAX + 1], token[1024] = "";
	struct buf q, page;
	enum kiln_err rc = KILN_OK;

	if (snprintf(fk, sizeof(fk), "%s%s", c->t.prefix, prefix) > S3_KEY_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "list prefix too long");
	buf_init(&page, S3_LIST_MAX);
	buf_init(&q, 4 * (S3_KEY_MAX + sizeof(token)) + 64);
	do {
		struct s3_req r;

		buf_reset(&q);
		if (token[0]) {	/* parameters in canonical (sorted) order */
			buf_appends(&q, "continuation-token=");
			s3_uri_encode(&q, token, false);
			buf_appends(&q, "&");
		}
		buf_appends(&q, "list-type=2&prefix=");
		s3_uri_encode(&q, fk, false);
		req_init(&r, "GET", NULL, q.data);
		r.out = &page;
		rc = perform(c, &r, err);
		if (rc == KILN_OK)
			rc = s3_list_parse(page.data, page.len, c->t.prefix, cb, arg, token,
					   sizeof(token), err);
	} while (rc == KILN_OK && token[0]);
	buf_release(&q);
	buf_release(&page);
	return rc;
}

/* ------------------------------------------------------------------ state file */

struct s3_upload_state *s3_state_new(unsigned nparts)
{
	struct s3_upload_state *st;

	if (nparts < 1 || nparts > S3_PARTS_MAX)
		return NULL;
	st = calloc(1, sizeof(*st));
	if (!st)
		return NULL;
	st->etags = calloc(nparts, sizeof(*st->etags));
	if (!st->etags) {
		free(st);
		return NULL;
	}
	st->nparts = nparts;
	return st;
}

void s3_state_free(struct s3_upload_state *st)
{
	if (!st)
		return;
	free(st->etags);
	free(st);
}

static int hexval(int ch)
{
	return isdigit(ch) ? ch - '0' : tolower(ch) - 'a' + 10;
}

/* Decodes %XX escapes of `s` into `out` (`n` bytes); false when malformed or too long. */
static bool uri_decode(const char *s, char *out, size_t n)
{
	size_t o = 0;

	for (; *s; s++) {
		char ch = *s;
		if (ch == '%') {
			if (!isxdigit((unsigned char)s[1]) || !isxdigit((unsigned char)s[2]))
				return false;
			ch = (char)(hexval((unsigned char)s[1]) * 16 + hexval((unsigned char)s[2]));
			s += 2;
		}
		if (o + 1 >= n || ch == '\0')
			return false;
		out[o++] = ch;
	}
	out[o] = '\0';
	return true;
}

/* The header of a state file, one `name value` line each, in this order after the magic line. */
enum { H_ENDPOINT, H_BUCKET, H_KEY, H_SIZE, H_MTIME, H_PART_SIZE, H_NPARTS, H_UPLOAD_ID, H__COUNT };
static const char *const state_names[H__COUNT] = {
	"endpoint", "bucket", "key", "size", "mtime_ns", "part_size", "nparts", "upload_id",
};

static bool parse_u64(const char *s, uint64_t *v)
{
	char *end;

	if (!isdigit((unsigned char)*s))
		return false;
	errno = 0;
	*v = strtoull(s, &end, 10);
	return !*end && errno == 0;
}

enum kiln_err s3_state_load(const char *path, struct s3_upload_state **out, struct kiln_error *err)
{
	struct s3_upload_state *st = NULL;
	char *hv[H__COUNT] = { 0 };
	struct buf text;
	char chunk[4096], *line, *save = NULL;
	uint64_t size, part_size, nparts;
	int64_t mtime;
	int fd, h = -1;
	ssize_t got;

	*out = NULL;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT ? kiln_error_set(err, KILN_E_NOT_FOUND, "no upload state") :
					 kiln_error_set(err, KILN_E_IO, "cannot open \"%s\": %s", path,
							strerror(errno));
	buf_init(&text, S3_STATE_MAX);
	while ((got = read(fd, chunk, sizeof(chunk))) > 0)
		if (buf_append(&text, chunk, (size_t)got) != 0) {
			got = -1;
			break;
		}
	close(fd);
	if (got < 0 || !text.data || memchr(text.data, '\0', text.len))
		goto bad;
	for (line = strtok_r(text.data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *sp = strchr(line, ' ');

		if (h < 0) {	/* the magic line */
			if (strcmp(line, S3_STATE_MAGIC) != 0)
				goto bad;
			h = 0;
			continue;
		}
		if (!sp)
			goto bad;
		*sp++ = '\0';
		if (h < H__COUNT) {
			if (strcmp(line, state_names[h]) != 0)
				goto bad;
			hv[h++] = sp;
			if (h < H__COUNT)
				continue;
			/* The whole header is read: make the state. */
			if (!parse_u64(hv[H_SIZE], &size) || !parse_u64(hv[H_PART_SIZE], &part_size) ||
			    !parse_u64(hv[H_NPARTS], &nparts) || part_size == 0 || nparts < 1 ||
			    nparts > S3_PARTS_MAX)
				goto bad;
			errno = 0;
			mtime = strtoll(hv[H_MTIME], NULL, 10);
			st = s3_state_new((unsigned)nparts);
			if (!st) {
				buf_release(&text);
				return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			}
			st->size = size;
			st->mtime_ns = mtime;
			st->part_size = part_size;
			if (!uri_decode(hv[H_ENDPOINT], st->endpoint, sizeof(st->endpoint)) ||
			    !uri_decode(hv[H_BUCKET], st->bucket, sizeof(st->bucket)) ||
			    !uri_decode(hv[H_KEY], st->key, sizeof(st->key)) ||
			    !uri_decode(hv[H_UPLOAD_ID], st->upload_id, sizeof(st->upload_id)) ||
			    !st->upload_id[0])
				goto bad;
			continue;
		}
		/* part <n> <etag> */
		{
			char *sp2 = strchr(sp, ' ');
			uint64_t part;

			if (strcmp(line, "part") != 0 || !sp2)
				goto bad;
			*sp2++ = '\0';
			if (!parse_u64(sp, &part) || part < 1 || part > st->nparts ||
			    !uri_decode(sp2, st->etags[part - 1], S3_ETAG_MAX + 1) ||
			    !st->etags[part - 1][0])
				goto bad;
		}
	}
	if (!st)
		goto bad;
	buf_release(&text);
	*out = st;
	return KILN_OK;
bad:
	buf_release(&text);
	s3_state_free(st);
	return kiln_error_set(err, KILN_E_INVALID, "upload state \"%s\" is malformed", path);
}

enum kiln_err s3_state_save(const char *path, const struct s3_upload_state *st,
			    struct kiln_error *err)
{
	struct buf b;
	char *tmp = NULL;
	enum kiln_err rc = KILN_OK;
	int fd = -1, e = 0;

	buf_init(&b, S3_STATE_MAX);
	e |= buf_appends(&b, S3_STATE_MAGIC "\nendpoint ");
	e |= s3_uri_encode(&b, st->endpoint, true);
	e |= buf_appends(&b, "\nbucket ");
	e |= s3_uri_encode(&b, st->bucket, true);
	e |= buf_appends(&b, "\nkey ");
	e |= s3_uri_encode(&b, st->key, true);
	e |= buf_appendf(&b, "\nsize %" PRIu64 "\nmtime_ns %" PRId64 "\npart_size %" PRIu64
			 "\nnparts %u\nupload_id ", st->size, st->mtime_ns, st->part_size, st->nparts);
	e |= s3_uri_encode(&b, st->upload_id, true);
	e |= buf_appends(&b, "\n");
	for (unsigned i = 0; i < st->nparts && !e; i++) {
		if (!st->etags[i][0])
			continue;
		e |= buf_appendf(&b, "part %u ", i + 1);
		e |= s3_uri_encode(&b, st->etags[i], true);
		e |= buf_appends(&b, "\n");
	}
	if (e) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "upload state too large");
		goto out;
	}
	if (asprintf(&tmp, "%s.tmp", path) < 0) {
		tmp = NULL;
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0) {
		rc = kiln_error_set(err, KILN_E_IO, "cannot create \"%s\": %s", tmp, strerror(errno));
		goto out;
	}
	for (size_t done = 0; done < b.len;) {
		ssize_t w = write(fd, b.data + done, b.len - done);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			rc = kiln_error_set(err, KILN_E_IO, "cannot write \"%s\": %s", tmp,
					    strerror(errno));
			goto out;
		}
		done += (size_t)w;
	}
	if (fsync(fd) != 0) {
		rc = kiln_error_set(err, KILN_E_IO, "cannot sync \"%s\": %s", tmp, strerror(errno));
		goto out;
	}
	close(fd);
	fd = -1;
	if (rename(tmp, path) != 0)
		rc = kiln_error_set(err, KILN_E_IO, "cannot rename \"%s\": %s", tmp, strerror(errno));
out:
	if (fd >= 0)
		close(fd);
	if (rc != KILN_OK && tmp)
		unlink(tmp);
	free(tmp);
	buf_release(&b);
	return rc;
}

/* ------------------------------------------------------------------ multipart */

/* POST ?uploads: a new upload id into st->upload_id. */
static enum kiln_err mp_create(struct s3_client *c, struct s3_upload_state *st,
			       struct kiln_error *err)
{
	struct s3_req r;
	struct buf body;
	enum kiln_err rc;

	buf_init(&body, S3_XML_MAX);
	req_init(&r, "POST", st->key, "uploads=");
	r.out = &body;
	rc = perform(c, &r, err);
	if (rc == KILN_OK && (!s3_xml_value(body.data, body.len, "UploadId", st->upload_id,
					    sizeof(st->upload_id)) || !st->upload_id[0]))
		rc = kiln_error_set(err, KILN_E_INVALID, "s3 create upload: no UploadId in the answer");
	buf_release(&body);
	return rc;
}

static int upload_query(struct buf *q, const char *upload_id, unsigned part)
{
	int e = 0;

	buf_reset(q);
	if (part)	/* canonical order: partNumber < uploadId */
		e |= buf_appendf(q, "partNumber=%u&", part);
	e |= buf_appends(q, "uploadId=");
	e |= s3_uri_encode(q, upload_id, false);
	return e;
}

/* PUT one part from `fd`; its ETag into st->etags[part - 1]. */
static enum kiln_err mp_part(struct s3_client *c, struct s3_upload_state *st, int fd,
			     unsigned part, struct kiln_error *err)
{
	struct s3_req r;
	struct buf q;
	enum kiln_err rc;
	uint64_t off = (uint64_t)(part - 1) * st->part_size;

	buf_init(&q, 4 * S3_UPLOAD_ID_MAX + 64);
	if (upload_query(&q, st->upload_id, part) != 0) {
		buf_release(&q);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	req_init(&r, "PUT", st->key, q.data);
	r.large = true;
	r.in_fd = fd;
	r.in_off = off;
	r.in_len = st->size - off < st->part_size ? st->size - off : st->part_size;
	rc = digest_body(&r, err);
	if (rc == KILN_OK)
		rc = perform(c, &r, err);
	if (rc == KILN_OK && !r.etag[0])
		rc = kiln_error_set(err, KILN_E_INVALID, "s3 upload part %u: no ETag in the answer",
				    part);
	if (rc == KILN_OK)
		snprintf(st->etags[part - 1], S3_ETAG_MAX + 1, "%s", r.etag);
	buf_release(&q);
	return rc;
}

/* POST ?uploadId: assembles the parts. An <Error> in a 200 answer is an error too. */
static enum kiln_err mp_complete(struct s3_client *c, const struct s3_upload_state *st,
				 struct kiln_error *err)
{
	struct s3_req r;
	struct buf q, xml, body;
	enum kiln_err rc = KILN_OK;
	char code[64], msg[200];
	int e = 0;

	buf_init(&q, 4 * S3_UPLOAD_ID_MAX + 64);
	buf_init(&xml, (size_t)st->nparts * (S3_ETAG_MAX * 6 + 80) + 128);
	buf_init(&body, S3_XML_MAX);
	e |= upload_query(&q, st->upload_id, 0);
	e |= buf_appends(&xml, "<CompleteMultipartUpload>");
	for (unsigned i = 0; i < st->nparts && !e; i++) {
		e |= buf_appendf(&xml, "<Part><PartNumber>%u</PartNumber><ETag>", i + 1);
		for (const char *p = st->etags[i]; *p && !e; p++)
			e |= *p == '"' ? buf_appends(&xml, "&quot;") :
			     *p == '&' ? buf_appends(&xml, "&amp;") :
			     *p == '<' ? buf_appends(&xml, "&lt;") : buf_append(&xml, p, 1);
		e |= buf_appends(&xml, "</ETag></Part>");
	}
	e |= buf_appends(&xml, "</CompleteMultipartUpload>");
	if (e) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
		goto out;
	}
	req_init(&r, "POST", st->key, q.data);
	r.in_data = xml.data;
	r.in_data_len = xml.len;
	r.content_type = "application/xml";
	r.out = &body;
	r.large = true;	/* S3 may take long to assemble a large object */
	rc = digest_body(&r, err);
	if (rc == KILN_OK)
		rc = perform(c, &r, err);
	if (rc == KILN_OK && s3_xml_value(body.data, body.len, "Code", code, sizeof(code)) &&
	    !s3_xml_value(body.data, body.len, "ETag", msg, sizeof(msg)))
		rc = answer_error("POST", st->key, 500, code, err);
out:
	buf_release(&q);
	buf_release(&xml);
	buf_release(&body);
	return rc;
}

/* DELETE ?uploadId, best effort: the bucket's lifecycle rules clean up what this misses. */
static void mp_abort(struct s3_client *c, const struct s3_upload_state *st)
{
	struct kiln_error e = { 0 };
	struct s3_req r;
	struct buf q;

	buf_init(&q, 4 * S3_UPLOAD_ID_MAX + 64);
	if (upload_query(&q, st->upload_id, 0) == 0) {
		req_init(&r, "DELETE", st->key, q.data);
		if (perform(c, &r, &e) != KILN_OK)
			log_debug("s3 abort upload of \"%s\": %s", st->key, e.msg);
	}
	buf_release(&q);
}

static bool state_matches(const struct s3_client *c, const struct s3_upload_state *st,
			  const char *fk, const struct stat *sb, uint64_t part_size, unsigned nparts)
{
	return strcmp(st->endpoint, c->t.endpoint) == 0 && strcmp(st->bucket, c->t.bucket) == 0 &&
	       strcmp(st->key, fk) == 0 && st->size == (uint64_t)sb->st_size &&
	       st->mtime_ns == (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec &&
	       st->part_size == part_size && st->nparts == nparts;
}

static enum kiln_err put_multipart(struct s3_client *c, const char *fk, const char *path, int fd,
				   const struct stat *sb, s3_part_cb cb, void *cb_arg,
				   struct s3_put_stats *stats, struct kiln_error *err)
{
	uint64_t size = (uint64_t)sb->st_size, part_size = c->o.part_size;
	struct s3_upload_state *st = NULL, *old = NULL;
	struct kiln_error e = { 0 };
	char *spath = NULL;
	enum kiln_err rc;
	unsigned nparts;
	bool resumed = false;

	if ((size + part_size - 1) / part_size > S3_PARTS_MAX)	/* grow parts to fit 10000 */
		part_size = (size + S3_PARTS_MAX - 1) / S3_PARTS_MAX;
	nparts = (unsigned)((size + part_size - 1) / part_size);
	if (asprintf(&spath, "%s.s3upload", path) < 0)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");

	rc = s3_state_load(spath, &old, &e);
	if (rc == KILN_OK && state_matches(c, old, fk, sb, part_size, nparts)) {
		st = old;
		old = NULL;
		resumed = true;
	} else if (rc == KILN_OK) {
		/* The file, the target or the key changed: that upload is of no use. */
		if (strcmp(old->endpoint, c->t.endpoint) == 0 && strcmp(old->bucket, c->t.bucket) == 0)
			mp_abort(c, old);
		unlink(spath);
	} else if (rc == KILN_E_INVALID) {
		log_warn("ignoring a malformed upload state \"%s\"", spath);
		unlink(spath);
	} else if (rc != KILN_E_NOT_FOUND) {
		kiln_error_set(err, rc, "%s", e.msg);
		goto out;
	}
	s3_state_free(old);
	old = NULL;

restart:
	if (stats) {
		stats->multipart = true;
		stats->resumed = resumed;
		stats->parts = nparts;
	}
	if (!st) {
		st = s3_state_new(nparts);
		if (!st) {
			rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory");
			goto out;
		}
		snprintf(st->endpoint, sizeof(st->endpoint), "%s", c->t.endpoint);
		snprintf(st->bucket, sizeof(st->bucket), "%s", c->t.bucket);
		snprintf(st->key, sizeof(st->key), "%s", fk);
		st->size = size;
		st->mtime_ns = (int64_t)sb->st_mtim.tv_sec * 1000000000 + sb->st_mtim.tv_nsec;
		st->part_size = part_size;
		rc = mp_create(c, st, err);
		if (rc == KILN_OK)
			rc = s3_state_save(spath, st, err);
		if (rc != KILN_OK)
			goto out;
	}
	for (unsigned i = 1; i <= nparts; i++) {
		bool sent = false;

		if (!st->etags[i - 1][0]) {
			kiln_error_clear(&e);
			rc = mp_part(c, st, fd, i, &e);
			if (rc == KILN_E_NOT_FOUND && resumed) {
				/* The service forgot the upload (expired, aborted): start afresh. */
				log_info("upload of \"%s\" is gone from the service; starting afresh", fk);
				s3_state_free(st);
				st = NULL;
				unlink(spath);
				resumed = false;
				if (stats)
					stats->parts_sent = stats->parts_skipped = 0;
				goto restart;
			}
			if (rc != KILN_OK) {
				kiln_error_set(err, rc, "%s", e.msg);
				goto failed;
			}
			rc = s3_state_save(spath, st, err);
			if (rc != KILN_OK)
				goto failed;
			sent = true;
		}
		if (stats) {
			stats->parts_sent += sent;
			stats->parts_skipped += !sent;
		}
		if (cb && (rc = cb(cb_arg, i, nparts, sent)) != KILN_OK) {
			kiln_error_set(err, rc, "upload of \"%s\" stopped after part %u", fk, i);
			goto out;	/* state kept: a later call resumes */
		}
	}
	kiln_error_clear(&e);
	rc = mp_complete(c, st, &e);
	if (rc == KILN_E_NOT_FOUND && resumed) {
		/* A crash between the complete and the removal of the state: is the object there? */
		struct s3_object_info info;
		struct kiln_error e2 = { 0 };
		const char *rel = fk + strlen(c->t.prefix);

		if (s3_head(c, rel, &info, &e2) == KILN_OK && info.size == size)
			rc = KILN_OK;
	}
	if (rc != KILN_OK) {
		kiln_error_set(err, rc, "%s", e.msg);
		goto failed;
	}
	unlink(spath);
	goto out;
failed:
	if (rc != KILN_E_UNAVAILABLE && rc != KILN_E_IO && rc != KILN_E_NOMEM) {
		/* The service will not take this upload: abort it and forget it. */
		mp_abort(c, st);
		unlink(spath);
	}
out:
	s3_state_free(st);
	s3_state_free(old);
	free(spath);
	return rc;
}

enum kiln_err s3_put_file(struct s3_client *c, const char *key, const char *path,
			  s3_part_cb cb, void *cb_arg, struct s3_put_stats *stats,
			  struct kiln_error *err)
{
	char fk[S3_KEY_MAX + 1];
	struct stat sb;
	enum kiln_err rc = full_key(c, key, fk, err);
	int fd;

	if (stats)
		memset(stats, 0, sizeof(*stats));
	if (rc != KILN_OK)
		return rc;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return kiln_error_set(err, KILN_E_IO, "cannot open \"%s\": %s", path, strerror(errno));
	if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
		close(fd);
		return kiln_error_set(err, KILN_E_IO, "\"%s\" is not a regular file", path);
	}
	if ((uint64_t)sb.st_size > c->o.part_size) {
		rc = put_multipart(c, fk, path, fd, &sb, cb, cb_arg, stats, err);
	} else {
		struct s3_req r;

		req_init(&r, "PUT", fk, NULL);
		r.large = true;
		r.in_fd = fd;
		r.in_len = (uint64_t)sb.st_size;
		rc = digest_body(&r, err);
		if (rc == KILN_OK)
			rc = perform(c, &r, err);
		if (stats) {
			stats->parts = 1;
			stats->parts_sent = rc == KILN_OK;
		}
	}
	close(fd);
	return rc;
}
