/*
 * sni.h - the name a connection to port 80 or 443 asks for: the SNI of a TLS ClientHello, or the
 * Host of an HTTP/1.x request head, and the framing of an HTTP/1.x request body.
 *
 * Pure and bounded (no I/O, no allocation; a 16 KiB scratch on the stack at most), for the
 * name-checking proxy of kiln-node (docs/network-policy.md, "Names on the wire"). Every input is
 * hostile. The parser is strict where a lenient server and a lenient parser could disagree about
 * the name or about where a request ends (request smuggling): bare LF, folded header lines,
 * whitespace before a colon, two Host headers, two Content-Length headers, Content-Length with
 * Transfer-Encoding, a Transfer-Encoding other than "chunked", an absolute-form target naming
 * another host than Host: all refused. Refused outright, as ways around a per-request check:
 * CONNECT, the HTTP/2 preface, an Upgrade to h2c (or an HTTP2-Settings header), and an encrypted
 * ClientHello (ECH or the older ESNI), whose real name the proxy cannot see.
 */
#ifndef KILN_NETPOLICY_SNI_H
#define KILN_NETPOLICY_SNI_H

#include <stddef.h>
#include <stdint.h>

#include "netpolicy/rules.h"

#define KILN_SNI_MAX_HELLO 16384	/* ClientHello message, its 4-byte header included */
#define KILN_SNI_MAX_TLS_IN (KILN_SNI_MAX_HELLO + 5 * 64) /* its records: at most 64 of them */
#define KILN_SNI_MAX_HEAD 16384	/* HTTP request head, final CRLFCRLF included */
#define KILN_SNI_MAX_IN KILN_SNI_MAX_TLS_IN	/* what a caller needs to buffer at most */

enum kiln_sni_status {
	KILN_SNI_MORE = 0,	/* incomplete: read more (unless KILN_SNI_MAX_IN bytes are in) */
	KILN_SNI_OK = 1,	/* a name was found: out is filled */
	KILN_SNI_BAD = -1,	/* neither a well-formed ClientHello nor an HTTP/1.x request head */
	KILN_SNI_NONAME = -2,	/* well-formed but names no host (no SNI, no Host) */
	KILN_SNI_REFUSED = -3,	/* CONNECT, HTTP/2, h2c, ECH/ESNI */
	KILN_SNI_TOOBIG = -4,	/* over KILN_SNI_MAX_HELLO / KILN_SNI_MAX_HEAD */
};

enum kiln_sni_kind {
	KILN_SNI_TLS = 1,
	KILN_SNI_HTTP = 2,
};

enum kiln_body_kind {
	KILN_BODY_NONE = 0,	/* no body: the next request head follows */
	KILN_BODY_LENGTH = 1,	/* content_length bytes */
	KILN_BODY_CHUNKED = 2,	/* chunked transfer coding, trailers included */
};

struct kiln_sni {
	enum kiln_sni_kind kind;
	char host[KILN_HOST_MAX + 1];	/* lowercase, no final dot, no port */
	uint16_t port;			/* HTTP: the Host header's port, 0 when it has none */
	size_t head_len;		/* HTTP: bytes of the request head (through CRLFCRLF);
					 * TLS: bytes of the records that carry the ClientHello
					 * (as far as they are in) */
	enum kiln_body_kind body;	/* HTTP only */
	uint64_t content_length;	/* HTTP, KILN_BODY_LENGTH */
	int upgrade;			/* HTTP: the request asks for an Upgrade (not h2c) */
};

/*
 * Looks at the first bytes a guest sent on a connection: buf[0..len). A first byte 0x16 is read
 * as TLS records carrying a ClientHello (split across any number of records up to 64, each a
 * handshake record; its SNI must be one host_name that kiln_host_normalize accepts); an ASCII
 * letter as an HTTP/1.0 or 1.1 request head, whose Host names the host (an HTTP/1.1 request
 * without Host is KILN_SNI_BAD; an HTTP/1.0 one KILN_SNI_NONAME). Returns a kiln_sni_status;
 * `out` is meaningful only for KILN_SNI_OK. Never reads past len.
 */
enum kiln_sni_status kiln_sni_parse(const uint8_t *buf, size_t len, struct kiln_sni *out);

/* Same as kiln_sni_parse but only as an HTTP request head (every request of a connection after
 * the first). */
enum kiln_sni_status kiln_sni_parse_http(const uint8_t *buf, size_t len, struct kiln_sni *out);

/* The framing state of one request body (kiln_body_start, then kiln_body_feed). */
struct kiln_body {
	enum kiln_body_kind kind;
	int state;		/* chunked: where in the coding */
	uint64_t left;		/* LENGTH: bytes to go; chunked: of the current chunk */
	unsigned line;		/* chunked: length of the current size/trailer line */
};

/* Starts tracking the body of the request `s` describes. */
void kiln_body_start(struct kiln_body *b, const struct kiln_sni *s);

/*
 * Feeds body bytes buf[0..len). Returns how many belong to the body (the rest is the next request
 * head) and sets *done when the body ended within them; -1 on a malformed chunked coding (sizes
 * over 2^60, no hex digits, a line over 4 KiB, a missing CRLF). A body of kind NONE is done at
 * once (returns 0, *done = 1).
 */
long kiln_body_feed(struct kiln_body *b, const uint8_t *buf, size_t len, int *done);

#endif
