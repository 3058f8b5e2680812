/*
 * porturl.h - the pure parts of port URLs (docs/ports.md): the host names `{port}-{id}.{domain}`
 * the ports listener routes on, the signature a signed URL and its cookie carry, the Cookie header
 * without Kiln's cookies, and the framing of a request body (Content-Length or chunked) the
 * listener forwards to a guest and no further. Nothing here does I/O.
 */
#ifndef KILN_PORTURL_H
#define KILN_PORTURL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define PORTURL_ID_MAX 64		/* bytes of a sandbox id, "sb_" and terminator included */
#define PORTURL_KEY_LEN 32		/* bytes of the signing key */
#define PORTURL_TOKEN_MAX 96		/* bytes of a signature token, terminator included */
#define PORTURL_QUERY "kiln_sig"	/* the signed URL's query parameter */
#define PORTURL_COOKIE "kiln_port"	/* the cookie a signed URL sets for its origin */

/*
 * Parses a Host header `{port}-{label}.{domain}[:listenport]` (case-insensitive, a trailing dot
 * of the domain allowed): on success *port is 1..65535 (digits, no leading zero) and `id` the
 * sandbox id "sb_{label}" (label: 1..40 of [a-z0-9], lowercased). False for any other host.
 */
bool porturl_host_parse(const char *host, const char *domain, long *port, char *id, size_t idlen);

/*
 * The signature token of (sandbox `id`, `port`) valid until `expires` (Unix seconds):
 * "{expires}.{64 hex digits of HMAC-SHA256}" into `out` (PORTURL_TOKEN_MAX bytes). The MAC binds
 * the id, the port and the expiry, so a token of one origin is worthless on any other.
 */
void porturl_sign(const unsigned char key[PORTURL_KEY_LEN], const char *id, long port,
		  long long expires, char out[PORTURL_TOKEN_MAX]);

enum porturl_verdict {
	PORTURL_OK = 0,
	PORTURL_FORGED,		/* malformed, or not made with this key for this origin */
	PORTURL_EXPIRED,	/* genuine, but its expiry passed (`now` >= expires) */
	PORTURL_NONE,		/* porturl_cookie_verify: no cookie of the signed URL's */
};

/* Checks `token` (`len` bytes) for (id, port) at Unix time `now`, in constant time for the MAC. */
enum porturl_verdict porturl_verify(const unsigned char key[PORTURL_KEY_LEN], const char *id,
				    long port, const char *token, size_t len, long long now);

/*
 * The signed URL's cookies (PORTURL_COOKIE) in a Cookie header (`a=1; b=2`), each checked for
 * (id, port) at `now` as porturl_verify does, their verdicts folded into `*v` (PORTURL_OK over
 * PORTURL_EXPIRED over PORTURL_FORGED), which the caller starts at PORTURL_NONE and may carry over
 * several Cookie headers. Every cookie of the name counts, not the first: a page of another
 * sandbox under the same parent domain can set one for all of them (`Domain=`, "cookie
 * tossing"), and its forged cookie must not shadow the genuine one of this origin.
 */
void porturl_cookie_verify(const char *header, const unsigned char key[PORTURL_KEY_LEN],
			   const char *id, long port, long long now, enum porturl_verdict *v);

/*
 * The Cookie header without the cookies whose names begin with "kiln_" (Kiln's own), the others
 * joined by "; ", into `out` of `cap` bytes; "" when none is left. The result may be longer than
 * the header ("a;b" gives "a; b"): 2 * strlen(header) + 1 bytes always hold it. False when it did
 * not fit (`out` then holds the pairs that did, and is never written past `cap`).
 */
bool porturl_cookie_strip(const char *header, char *out, size_t cap);

/*
 * A request target without the query parameter `name` (all its occurrences) into `out` (at least
 * strlen(target) + 1 bytes); the value of its first occurrence into `val` (cap bytes, "" when
 * absent). True when it was there.
 */
bool porturl_query_take(const char *target, const char *name, char *out, char *val, size_t cap);

/*
 * A chunked body's framing, followed byte by byte: porturl_chunked_scan() is given what arrives
 * and says how much of it belongs to the body, so nothing past its end (a pipelined request) is
 * forwarded.
 */
struct porturl_chunked {
	int state;		/* internal */
	unsigned long long left;	/* bytes of the current chunk's data still to come */
	size_t line;		/* bytes of the current size or trailer line */
	bool hex_seen;
	bool done;		/* the last chunk and the trailers were seen */
};

/*
 * Scans `len` bytes of a chunked body: returns how many of them are the body's (all of them
 * unless it ended inside them; then c->done), or -1 when the framing is malformed (a size that
 * is not hex or overflows, a line over 4096 bytes, data not followed by CRLF).
 */
ssize_t porturl_chunked_scan(struct porturl_chunked *c, const char *data, size_t len);

#endif
