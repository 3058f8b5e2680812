/*
 * fuzz_sni.c - libFuzzer target for the name-checking proxy's parser (netpolicy/sni.c): the input
 * is tried as the first bytes of a connection (ClientHello or request head), as a later request
 * head, and, after a request head that parses, its remaining bytes as the request's body, fed
 * whole and then one byte at a time (both must agree).
 */
#include <stdint.h>
#include <string.h>

#include "netpolicy/sni.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct kiln_sni s;
	enum kiln_sni_status st = kiln_sni_parse(data, size, &s);
	if (st == KILN_SNI_OK && (s.head_len == 0 || s.head_len > size))
		__builtin_trap();
	st = kiln_sni_parse_http(data, size, &s);
	if (st != KILN_SNI_OK)
		return 0;
	if (s.head_len == 0 || s.head_len > size || strlen(s.host) == 0)
		__builtin_trap();
	struct kiln_body whole, bytes;
	int done_w = 0, done_b = 0;
	kiln_body_start(&whole, &s);
	kiln_body_start(&bytes, &s);
	const uint8_t *body = data + s.head_len;
	size_t n = size - s.head_len;
	long w = kiln_body_feed(&whole, body, n, &done_w);
	if (w > (long)n)
		__builtin_trap();
	long total = 0;
	for (size_t i = 0; i < n && !done_b; i++) {
		long r = kiln_body_feed(&bytes, body + i, 1, &done_b);
		if (r < 0) {
			total = -1;
			break;
		}
		total += r;
		if (r == 0)
			break;
	}
	if (s.body == KILN_BODY_NONE)
		return 0;
	/* Same verdict whole or byte by byte: bad in both, or the same length and end. */
	if ((w < 0) != (total < 0) || (w >= 0 && (w != total || done_w != done_b)))
		__builtin_trap();
	return 0;
}
