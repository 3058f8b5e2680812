/*
 * porturl.c - host names, signatures, cookies and body framing of port URLs (see porturl.h).
 */
#include "api/porturl.h"

#include <ctype.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define LABEL_MAX 40
#define CHUNK_LINE_MAX 4096

bool porturl_host_parse(const char *host, const char *domain, long *port, char *id, size_t idlen)
{
	const char *dash, *dot, *end;
	size_t dlen = strlen(domain), hlen, i;
	long p = 0;

	if (!host || !*domain)
		return false;
	/* the port suffix (the listener's), ignored */
	end = strrchr(host, ':');
	hlen = end ? (size_t)(end - host) : strlen(host);
	if (end) {
		for (const char *c = end + 1; *c; c++)
			if (!isdigit((unsigned char)*c))
				return false;
	}
	if (hlen > 0 && host[hlen - 1] == '.')
		hlen--;
	if (dlen > 0 && domain[dlen - 1] == '.')
		dlen--;
	if (hlen < dlen + 4 || host[hlen - dlen - 1] != '.' ||
	    strncasecmp(host + hlen - dlen, domain, dlen) != 0)
		return false;
	dot = host + hlen - dlen - 1;
	dash = memchr(host, '-', (size_t)(dot - host));
	if (!dash || dash == host || dash - host > 5 || host[0] == '0')
		return false;
	for (const char *c = host; c < dash; c++) {
		if (!isdigit((unsigned char)*c))
			return false;
		p = p * 10 + (*c - '0');
	}
	if (p < 1 || p > 65535)
		return false;
	size_t llen = (size_t)(dot - dash - 1);

	if (llen < 1 || llen > LABEL_MAX || llen + 4 > idlen)
		return false;
	memcpy(id, "sb_", 3);
	for (i = 0; i < llen; i++) {
		char c = (char)tolower((unsigned char)dash[1 + i]);

		if (!isdigit((unsigned char)c) && !(c >= 'a' && c <= 'z'))
			return false;
		id[3 + i] = c;
	}
	id[3 + llen] = '\0';
	*port = p;
	return true;
}

/* The hex MAC of (id, port, expires) into `hex` (65 bytes). */
static void mac_hex(const unsigned char key[PORTURL_KEY_LEN], const char *id, long port,
		    long long expires, char hex[65])
{
	char msg[PORTURL_ID_MAX + 64];
	unsigned char mac[EVP_MAX_MD_SIZE];
	unsigned int maclen = 0;
	int n = snprintf(msg, sizeof(msg), "kiln-port-url-v1|%s|%ld|%lld", id, port, expires);

	if (n < 0 || (size_t)n >= sizeof(msg) ||
	    !HMAC(EVP_sha256(), key, PORTURL_KEY_LEN, (const unsigned char *)msg, (size_t)n, mac,
		  &maclen) || maclen != 32) {
		memset(hex, 0, 65);	/* matches nothing: a verified token has 64 hex digits */
		return;
	}
	for (unsigned i = 0; i < 32; i++)
		snprintf(hex + 2 * i, 3, "%02x", mac[i]);
}

void porturl_sign(const unsigned char key[PORTURL_KEY_LEN], const char *id, long port,
		  long long expires, char out[PORTURL_TOKEN_MAX])
{
	char hex[65];

	mac_hex(key, id, port, expires, hex);
	snprintf(out, PORTURL_TOKEN_MAX, "%lld.%s", expires, hex);
}

enum porturl_verdict porturl_verify(const unsigned char key[PORTURL_KEY_LEN], const char *id,
				    long port, const char *token, size_t len, long long now)
{
	char hex[65];
	long long expires = 0;
	size_t i = 0;

	while (i < len && isdigit((unsigned char)token[i])) {
		if (i == 18)
			return PORTURL_FORGED;	/* no expiry of ours has that many digits */
		expires = expires * 10 + (token[i++] - '0');
	}
	if (i == 0 || i >= len || token[i] != '.' || len - i - 1 != 64)
		return PORTURL_FORGED;
	mac_hex(key, id, port, expires, hex);
	if (!hex[0] || CRYPTO_memcmp(hex, token + i + 1, 64) != 0)
		return PORTURL_FORGED;
	return now >= expires ? PORTURL_EXPIRED : PORTURL_OK;
}

/* One "name=value" pair of a Cookie header, with its bounds. */
struct cookie_pair {
	const char *name, *value;
	size_t nlen, vlen;
	const char *start, *end;	/* the pair's bytes, trimmed */
};

static const char *cookie_next(const char *p, struct cookie_pair *c)
{
	while (*p == ' ' || *p == '\t' || *p == ';')
		p++;
	if (!*p)
		return NULL;
	c->start = p;
	c->name = p;
	while (*p && *p != ';' && *p != '=')
		p++;
	c->nlen = (size_t)(p - c->name);
	if (*p == '=') {
		p++;
		c->value = p;
		while (*p && *p != ';')
			p++;
		c->vlen = (size_t)(p - c->value);
	} else {
		c->value = p;
		c->vlen = 0;
	}
	c->end = p;
	while (c->end > c->start && (c->end[-1] == ' ' || c->end[-1] == '\t'))
		c->end--;
	while (c->nlen > 0 && (c->name[c->nlen - 1] == ' ' || c->name[c->nlen - 1] == '\t'))
		c->nlen--;
	return p;
}

void porturl_cookie_verify(const char *header, const unsigned char key[PORTURL_KEY_LEN],
			   const char *id, long port, long long now, enum porturl_verdict *v)
{
	static const int rank[] = { [PORTURL_NONE] = 0, [PORTURL_FORGED] = 1,
						      [PORTURL_EXPIRED] = 2, [PORTURL_OK] = 3 };
	size_t nl = strlen(PORTURL_COOKIE);
	struct cookie_pair c;

	for (const char *p = header; p && (p = cookie_next(p, &c));) {
		if (c.nlen != nl || memcmp(c.name, PORTURL_COOKIE, nl) != 0)
			continue;
		size_t vl = c.end > c.value ? (size_t)(c.end - c.value) : 0;
		enum porturl_verdict one = porturl_verify(key, id, port, c.value, vl, now);

		if (rank[one] > rank[*v])
			*v = one;
	}
}

bool porturl_cookie_strip(const char *header, char *out, size_t cap)
{
	struct cookie_pair c;
	size_t n = 0;
	bool fits = true;

	if (!cap)
		return false;
	for (const char *p = header; p && (p = cookie_next(p, &c));) {
		size_t len = (size_t)(c.end - c.start);

		if (c.nlen >= 5 && strncasecmp(c.name, "kiln_", 5) == 0)
			continue;
		if (n + (n ? 2 : 0) + len >= cap) {
			fits = false;
			break;
		}
		if (n) {
			memcpy(out + n, "; ", 2);
			n += 2;
		}
		memcpy(out + n, c.start, len);
		n += len;
	}
	out[n] = '\0';
	return fits;
}

bool porturl_query_take(const char *target, const char *name, char *out, char *val, size_t cap)
{
	const char *q = strchr(target, '?');
	size_t nl = strlen(name), n;
	bool found = false, first = true;

	if (cap)
		val[0] = '\0';
	if (!q) {
		strcpy(out, target);
		return false;
	}
	n = (size_t)(q - target);
	memcpy(out, target, n);
	for (const char *p = q + 1; *p;) {
		const char *amp = strchr(p, '&'), *e = amp ? amp : p + strlen(p);

		if ((size_t)(e - p) >= nl && strncmp(p, name, nl) == 0 &&
		    (p[nl] == '=' || p + nl == e)) {
			if (!found && p[nl] == '=' && cap) {
				size_t vl = (size_t)(e - p - (ptrdiff_t)nl - 1);

				if (vl >= cap)
					vl = cap - 1;
				memcpy(val, p + nl + 1, vl);
				val[vl] = '\0';
			}
			found = true;
		} else if (e > p) {
			out[n++] = first ? '?' : '&';
			first = false;
			memcpy(out + n, p, (size_t)(e - p));
			n += (size_t)(e - p);
		}
		p = amp ? amp + 1 : e;
	}
	out[n] = '\0';
	return found;
}

enum { CH_SIZE, CH_EXT, CH_SIZE_LF, CH_DATA, CH_DATA_CR, CH_DATA_LF, CH_TRAILER_START,
       CH_TRAILER, CH_END_LF };

ssize_t porturl_chunked_scan(struct porturl_chunked *c, const char *data, size_t len)
{
	size_t i = 0;

	while (i < len && !c->done) {
		char ch = data[i];

		switch (c->state) {
		case CH_SIZE:
			if (isxdigit((unsigned char)ch)) {
				int d = isdigit((unsigned char)ch) ? ch - '0'
								   : tolower((unsigned char)ch) - 'a' + 10;

				if (c->left >> 59)
					return -1;
				c->left = c->left * 16 + (unsigned)d;
				c->hex_seen = true;
			} else if (!c->hex_seen) {
				return -1;
			} else if (ch == ';' || ch == ' ' || ch == '\t') {
				c->state = CH_EXT;
			} else if (ch == '\r') {
				c->state = CH_SIZE_LF;
			} else if (ch == '\n') {
				goto size_done;
			} else {
				return -1;
			}
			break;
		case CH_EXT:
			if (ch == '\r')
				c->state = CH_SIZE_LF;
			else if (ch == '\n')
				goto size_done;
			break;
		case CH_SIZE_LF:
			if (ch != '\n')
				return -1;
size_done:
			c->hex_seen = false;
			c->line = 0;
			c->state = c->left ? CH_DATA : CH_TRAILER_START;
			i++;
			continue;
		case CH_DATA: {
			size_t take = len - i < c->left ? len - i : (size_t)c->left;

			c->left -= take;
			i += take;
			if (!c->left)
				c->state = CH_DATA_CR;
			continue;
		}
		case CH_DATA_CR:
			if (ch == '\n') {
				c->state = CH_SIZE;
				c->line = 0;
			} else if (ch == '\r') {
				c->state = CH_DATA_LF;
			} else {
				return -1;
			}
			break;
		case CH_DATA_LF:
			if (ch != '\n')
				return -1;
			c->state = CH_SIZE;
			c->line = 0;
			break;
		case CH_TRAILER_START:
			if (ch == '\r') {
				c->state = CH_END_LF;
			} else if (ch == '\n') {
				c->done = true;
			} else {
				c->state = CH_TRAILER;
			}
			break;
		case CH_TRAILER:
			if (ch == '\n') {
				c->state = CH_TRAILER_START;
				c->line = 0;
			}
			break;
		case CH_END_LF:
			if (ch != '\n')
				return -1;
			c->done = true;
			break;
		}
		if (++c->line > CHUNK_LINE_MAX)
			return -1;
		i++;
	}
	return (ssize_t)i;
}
