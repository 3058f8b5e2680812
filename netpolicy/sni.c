/*
 * sni.c - the SNI of a TLS ClientHello (RFC 8446 4.1.2, RFC 6066 3), the Host of an HTTP/1.x
 * request head (RFC 9112) and the framing of its body, for the name-checking proxy (see sni.h).
 */
#include "netpolicy/sni.h"

#include <string.h>

#define TLS_HANDSHAKE 0x16
#define TLS_CLIENT_HELLO 1
#define TLS_MAX_RECORDS 64
#define TLS_RECORD_MAX 16384
#define EXT_SERVER_NAME 0x0000
#define EXT_ECH 0xfe0d
#define EXT_ESNI 0xffce
#define BODY_LINE_MAX 4096

static uint16_t rd16(const uint8_t *p)
{
	return (uint16_t)((p[0] << 8) | p[1]);
}

/* ---- TLS ---- */

/*
 * The server_name extension's body: one host_name entry (type 0). Returns a status.
 */
static enum kiln_sni_status sni_ext(const uint8_t *p, size_t n, struct kiln_sni *out)
{
	if (n < 2 || rd16(p) != n - 2)
		return KILN_SNI_BAD;
	p += 2;
	n -= 2;
	int found = 0;
	while (n > 0) {
		if (n < 3)
			return KILN_SNI_BAD;
		uint8_t type = p[0];
		size_t l = rd16(p + 1);
		if (l > n - 3)
			return KILN_SNI_BAD;
		if (type == 0) {
			if (found || l == 0 || l > KILN_HOST_MAX)
				return KILN_SNI_BAD;
			char name[KILN_HOST_MAX + 1];
			memcpy(name, p + 3, l);
			name[l] = '\0';
			if (memchr(name, '\0', l) || name[l - 1] == '.' ||
			    !kiln_host_normalize(name, out->host))
				return KILN_SNI_BAD;
			found = 1;
		}
		p += 3 + l;
		n -= 3 + l;
	}
	return found ? KILN_SNI_OK : KILN_SNI_NONAME;
}

/* A whole ClientHello message body (after its 4-byte header). */
static enum kiln_sni_status client_hello(const uint8_t *p, size_t n, struct kiln_sni *out)
{
	size_t off = 34;	/* legacy_version, random */
	if (n < off + 1)
		return KILN_SNI_BAD;
	size_t sid = p[off];
	if (sid > 32 || n < off + 1 + sid + 2)
		return KILN_SNI_BAD;
	off += 1 + sid;
	size_t cs = rd16(p + off);
	if (cs < 2 || cs % 2 || n < off + 2 + cs + 1)
		return KILN_SNI_BAD;
	off += 2 + cs;
	size_t comp = p[off];
	if (comp < 1 || n < off + 1 + comp)
		return KILN_SNI_BAD;
	off += 1 + comp;
	if (off == n)
		return KILN_SNI_NONAME;	/* no extensions at all */
	if (n - off < 2 || rd16(p + off) != n - off - 2)
		return KILN_SNI_BAD;
	off += 2;
	enum kiln_sni_status st = KILN_SNI_NONAME;
	uint16_t seen[128];
	size_t nseen = 0;
	while (off < n) {
		if (n - off < 4)
			return KILN_SNI_BAD;
		uint16_t type = rd16(p + off);
		size_t l = rd16(p + off + 2);
		if (l > n - off - 4)
			return KILN_SNI_BAD;
		for (size_t i = 0; i < nseen; i++)
			if (seen[i] == type)
				return KILN_SNI_BAD;	/* RFC 8446 4.2: each type at most once */
		if (nseen == sizeof(seen) / sizeof(seen[0]))
			return KILN_SNI_BAD;
		seen[nseen++] = type;
		if (type == EXT_ECH || type == EXT_ESNI)
			return KILN_SNI_REFUSED;
		if (type == EXT_SERVER_NAME) {
			st = sni_ext(p + off + 4, l, out);
			if (st == KILN_SNI_BAD)
				return st;
		}
		off += 4 + l;
	}
	return st;
}

static enum kiln_sni_status parse_tls(const uint8_t *buf, size_t len, struct kiln_sni *out)
{
	uint8_t hs[KILN_SNI_MAX_HELLO];
	size_t have = 0, need = 0, off = 0;
	for (int rec = 0;; rec++) {
		if (rec == TLS_MAX_RECORDS)
			return KILN_SNI_TOOBIG;
		if (len - off < 5)
			return len > KILN_SNI_MAX_TLS_IN ? KILN_SNI_TOOBIG : KILN_SNI_MORE;
		const uint8_t *r = buf + off;
		size_t rl = rd16(r + 3);
		if (r[0] != TLS_HANDSHAKE || r[1] != 3 || r[2] > 4 || rl == 0 ||
		    rl > TLS_RECORD_MAX)
			return KILN_SNI_BAD;
		/* The record's bytes that are in, and that belong to the ClientHello. */
		size_t in = len - off - 5 < rl ? len - off - 5 : rl;
		size_t take = in;
		if (need && take > need - have)
			take = need - have;
		if (!need && take > sizeof(hs) - have)
			take = sizeof(hs) - have;	/* the header is in: need is known next */
		if (have + take > sizeof(hs))
			return KILN_SNI_TOOBIG;
		memcpy(hs + have, r + 5, take);
		have += take;
		if (!need && have >= 4) {
			if (hs[0] != TLS_CLIENT_HELLO)
				return KILN_SNI_BAD;
			need = 4 + (((size_t)hs[1] << 16) | ((size_t)hs[2] << 8) | hs[3]);
			if (need > KILN_SNI_MAX_HELLO)
				return KILN_SNI_TOOBIG;
			if (have > need)
				have = need;
		}
		if (need && have == need) {
			enum kiln_sni_status st = client_hello(hs + 4, need - 4, out);
			if (st == KILN_SNI_OK) {
				out->kind = KILN_SNI_TLS;
				out->port = 0;
				out->head_len = off + 5 + in;	/* of the records in */
				out->body = KILN_BODY_NONE;
				out->content_length = 0;
				out->upgrade = 0;
			}
			return st;
		}
		if (in < rl)
			return KILN_SNI_MORE;
		off += 5 + rl;
	}
}

/* ---- HTTP/1.x ---- */

static int is_tchar(unsigned char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
	       (c && strchr("!#$%&'*+-.^_`|~", c));
}

static int lower(int c)
{
	return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

static int ieq(const uint8_t *a, size_t n, const char *b)
{
	if (strlen(b) != n)
		return 0;
	for (size_t i = 0; i < n; i++)
		if (lower(a[i]) != lower((unsigned char)b[i]))
			return 0;
	return 1;
}

/* Whether the comma-separated list v[0..n) has the token `tok` (case-insensitive). */
static int has_token(const uint8_t *v, size_t n, const char *tok)
{
	size_t i = 0;
	while (i < n) {
		while (i < n && (v[i] == ' ' || v[i] == '\t' || v[i] == ','))
			i++;
		size_t s = i;
		while (i < n && v[i] != ',')
			i++;
		size_t e = i;
		while (e > s && (v[e - 1] == ' ' || v[e - 1] == '\t'))
			e--;
		/* "h2c/1.0" names h2c too. */
		size_t t = s;
		while (t < e && v[t] != '/')
			t++;
		if (ieq(v + s, t - s, tok))
			return 1;
	}
	return 0;
}

/*
 * An authority "host[:port]" (no userinfo, no IPv6 literal) into out->host and *port.
 */
static int authority(const uint8_t *v, size_t n, char *host, uint16_t *port)
{
	size_t h = 0;
	while (h < n && v[h] != ':')
		h++;
	if (h == 0 || h > KILN_HOST_MAX || memchr(v, '@', n) || v[0] == '[')
		return -1;
	char name[KILN_HOST_MAX + 1];
	memcpy(name, v, h);
	name[h] = '\0';
	if (memchr(name, '\0', h) || !kiln_host_normalize(name, host))
		return -1;
	*port = 0;
	if (h < n) {
		unsigned long p = 0;
		if (h + 1 == n || n - h - 1 > 5)
			return -1;
		for (size_t i = h + 1; i < n; i++) {
			if (v[i] < '0' || v[i] > '9')
				return -1;
			p = p * 10 + (unsigned long)(v[i] - '0');
		}
		if (p == 0 || p > 65535)
			return -1;
		*port = (uint16_t)p;
	}
	return 0;
}

enum kiln_sni_status kiln_sni_parse_http(const uint8_t *buf, size_t len, struct kiln_sni *out)
{
	static const char h2_preface[] = "PRI * HTTP/2.0\r\n";
	size_t pl = len < sizeof(h2_preface) - 1 ? len : sizeof(h2_preface) - 1;
	if (len > 0 && memcmp(buf, h2_preface, pl) == 0)
		return pl == sizeof(h2_preface) - 1 ? KILN_SNI_REFUSED : KILN_SNI_MORE;

	/* The head's end: the first CRLFCRLF; a bare LF or CR anywhere is refused. */
	size_t end = 0;
	size_t lim = len < KILN_SNI_MAX_HEAD ? len : KILN_SNI_MAX_HEAD;
	for (size_t i = 0; i < lim; i++) {
		if (buf[i] == '\n' && (i == 0 || buf[i - 1] != '\r'))
			return KILN_SNI_BAD;
		if (buf[i] == '\r' && i + 1 < len && buf[i + 1] != '\n')
			return KILN_SNI_BAD;
		if (i >= 3 && buf[i] == '\n' && buf[i - 2] == '\n') {
			end = i + 1;
			break;
		}
	}
	/* The method must look like one before all of the head is in. */
	for (size_t i = 0; i < len && buf[i] != ' '; i++)
		if (!is_tchar(buf[i]) || i >= 32)
			return KILN_SNI_BAD;
	if (!end)
		return len >= KILN_SNI_MAX_HEAD ? KILN_SNI_TOOBIG : KILN_SNI_MORE;

	/* Request line: method SP target SP HTTP/1.x CRLF */
	size_t i = 0;
	while (buf[i] != ' ')
		i++;
	size_t mlen = i;
	if (mlen == 0)
		return KILN_SNI_BAD;
	if (ieq(buf, mlen, "CONNECT") || ieq(buf, mlen, "PRI"))
		return KILN_SNI_REFUSED;
	size_t ts = ++i;
	while (i < end && buf[i] > ' ' && buf[i] < 0x7f)
		i++;
	size_t te = i;
	if (te == ts || buf[i] != ' ')
		return KILN_SNI_BAD;
	i++;
	if (end - i < 10 || memcmp(buf + i, "HTTP/1.", 7) != 0 ||
	    (buf[i + 7] != '0' && buf[i + 7] != '1') || buf[i + 8] != '\r')
		return KILN_SNI_BAD;
	int http11 = buf[i + 7] == '1';
	i += 10;

	/* An absolute-form target ("http://name[:port]/..."): its authority, checked against Host. */
	char abs_host[KILN_HOST_MAX + 1] = "";
	uint16_t abs_port = 0;
	if (buf[ts] != '/' && !(te - ts == 1 && buf[ts] == '*')) {
		size_t s = ts;
		if (te - ts > 7 && ieq(buf + ts, 7, "http://"))
			s += 7;
		else if (te - ts > 8 && ieq(buf + ts, 8, "https://"))
			s += 8;
		else
			return KILN_SNI_BAD;
		size_t e = s;
		while (e < te && buf[e] != '/' && buf[e] != '?' && buf[e] != '#')
			e++;
		if (authority(buf + s, e - s, abs_host, &abs_port) != 0)
			return KILN_SNI_BAD;
	}

	int nhost = 0, ncl = 0, nte = 0;
	memset(out, 0, sizeof(*out));
	while (i < end - 2) {
		size_t ls = i, le = i;
		while (buf[le] != '\r')
			le++;
		/* name ":" OWS value OWS */
		size_t c = ls;
		while (c < le && is_tchar(buf[c]))
			c++;
		if (c == ls || c == le || buf[c] != ':')
			return KILN_SNI_BAD;	/* folded line, space before ':', no ':' */
		size_t vs = c + 1, ve = le;
		while (vs < ve && (buf[vs] == ' ' || buf[vs] == '\t'))
			vs++;
		while (ve > vs && (buf[ve - 1] == ' ' || buf[ve - 1] == '\t'))
			ve--;
		for (size_t k = vs; k < ve; k++)
			if ((buf[k] < 0x20 && buf[k] != '\t') || buf[k] == 0x7f)
				return KILN_SNI_BAD;
		const uint8_t *name = buf + ls, *v = buf + vs;
		size_t nl = c - ls, vl = ve - vs;
		if (ieq(name, nl, "host")) {
			if (nhost++ || authority(v, vl, out->host, &out->port) != 0)
				return KILN_SNI_BAD;
		} else if (ieq(name, nl, "content-length")) {
			if (ncl++ || vl == 0 || vl > 18)
				return KILN_SNI_BAD;
			uint64_t n = 0;
			for (size_t k = 0; k < vl; k++) {
				if (v[k] < '0' || v[k] > '9')
					return KILN_SNI_BAD;
				n = n * 10 + (uint64_t)(v[k] - '0');
			}
			out->content_length = n;
		} else if (ieq(name, nl, "transfer-encoding")) {
			if (nte++ || !ieq(v, vl, "chunked"))
				return KILN_SNI_BAD;
		} else if (ieq(name, nl, "upgrade")) {
			if (has_token(v, vl, "h2c"))
				return KILN_SNI_REFUSED;
			out->upgrade = 1;
		} else if (ieq(name, nl, "http2-settings")) {
			return KILN_SNI_REFUSED;
		}
		i = le + 2;
	}
	if (ncl && nte)
		return KILN_SNI_BAD;
	if (!nhost) {
		if (http11)
			return KILN_SNI_BAD;	/* RFC 9112 3.2: a 1.1 request must have one */
		if (!abs_host[0])
			return KILN_SNI_NONAME;
		strcpy(out->host, abs_host);
		out->port = abs_port;
	} else if (abs_host[0] && (strcmp(abs_host, out->host) != 0 || abs_port != out->port)) {
		return KILN_SNI_BAD;
	}
	out->kind = KILN_SNI_HTTP;
	out->head_len = end;
	out->body = nte ? KILN_BODY_CHUNKED : ncl && out->content_length ? KILN_BODY_LENGTH
								    : KILN_BODY_NONE;
	return KILN_SNI_OK;
}

enum kiln_sni_status kiln_sni_parse(const uint8_t *buf, size_t len, struct kiln_sni *out)
{
	if (len == 0)
		return KILN_SNI_MORE;
	if (buf[0] == TLS_HANDSHAKE)
		return parse_tls(buf, len, out);
	if ((buf[0] >= 'A' && buf[0] <= 'Z') || (buf[0] >= 'a' && buf[0] <= 'z'))
		return kiln_sni_parse_http(buf, len, out);
	return KILN_SNI_BAD;
}

/* ---- request bodies ---- */

enum {
	CH_SIZE,	/* hex digits of a chunk size */
	CH_EXT,		/* after the size: extensions up to CR */
	CH_SIZE_LF,
	CH_DATA,
	CH_DATA_CR,
	CH_DATA_LF,
	CH_TRAILER,	/* at the start of a trailer line (or the final CRLF) */
	CH_TRAILER_LINE,
	CH_TRAILER_LF,
	CH_END_LF,
	CH_DONE,
};

void kiln_body_start(struct kiln_body *b, const struct kiln_sni *s)
{
	memset(b, 0, sizeof(*b));
	b->kind = s->kind == KILN_SNI_HTTP ? s->body : KILN_BODY_NONE;
	b->left = s->content_length;
	b->state = CH_SIZE;
}

static int hexval(uint8_t c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	c = (uint8_t)lower(c);
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

long kiln_body_feed(struct kiln_body *b, const uint8_t *buf, size_t len, int *done)
{
	*done = 0;
	if (b->kind == KILN_BODY_NONE) {
		*done = 1;
		return 0;
	}
	if (len > (size_t)1 << 30)
		len = (size_t)1 << 30;
	if (b->kind == KILN_BODY_LENGTH) {
		size_t n = b->left < len ? (size_t)b->left : len;
		b->left -= n;
		*done = b->left == 0;
		return (long)n;
	}
	size_t i = 0;
	while (i < len && b->state != CH_DONE) {
		uint8_t c = buf[i];
		switch (b->state) {
		case CH_SIZE: {
			int h = hexval(c);
			if (h >= 0) {
				if (b->left >> 56)
					return -1;
				b->left = b->left * 16 + (uint64_t)h;
				b->line++;
				i++;
			} else if (b->line == 0) {
				return -1;
			} else if (c == ';' || c == ' ' || c == '\t') {
				b->state = CH_EXT;
			} else if (c == '\r') {
				b->state = CH_SIZE_LF;
				i++;
			} else {
				return -1;
			}
			break;
		}
		case CH_EXT:
			if (c == '\r') {
				b->state = CH_SIZE_LF;
			} else if (c == '\n' || ++b->line > BODY_LINE_MAX) {
				return -1;
			}
			i++;
			break;
		case CH_SIZE_LF:
			if (c != '\n')
				return -1;
			i++;
			b->line = 0;
			b->state = b->left ? CH_DATA : CH_TRAILER;
			break;
		case CH_DATA: {
			size_t n = b->left < len - i ? (size_t)b->left : len - i;
			b->left -= n;
			i += n;
			if (!b->left)
				b->state = CH_DATA_CR;
			break;
		}
		case CH_DATA_CR:
			if (c != '\r')
				return -1;
			b->state = CH_DATA_LF;
			i++;
			break;
		case CH_DATA_LF:
			if (c != '\n')
				return -1;
			b->state = CH_SIZE;
			b->line = 0;
			i++;
			break;
		case CH_TRAILER:
			if (c == '\r') {
				b->state = CH_END_LF;
			} else if (c == '\n') {
				return -1;
			} else {
				b->state = CH_TRAILER_LINE;
				b->line = 1;
			}
			i++;
			break;
		case CH_TRAILER_LINE:
			if (c == '\r')
				b->state = CH_TRAILER_LF;
			else if (c == '\n' || ++b->line > BODY_LINE_MAX)
				return -1;
			i++;
			break;
		case CH_TRAILER_LF:
			if (c != '\n')
				return -1;
			b->state = CH_TRAILER;
			b->line = 0;
			i++;
			break;
		case CH_END_LF:
			if (c != '\n')
				return -1;
			b->state = CH_DONE;
			i++;
			break;
		}
	}
	*done = b->state == CH_DONE;
	return (long)i;
}
