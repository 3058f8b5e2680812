/*
 * encode.h - the text encodings auth/ uses: lowercase base32 (ids and API key secrets), base64url
 * without padding (JOSE), lowercase hex (hashes, master keys). Decoders are strict: they accept
 * only the canonical form of each value, so one value has exactly one spelling.
 */
#ifndef KILN_AUTH_ENCODE_H
#define KILN_AUTH_ENCODE_H

#include <stdbool.h>
#include <stddef.h>

/* Characters needed to encode `n` bytes, terminator excluded. */
#define AUTH_B32_LEN(n) (((n) * 8 + 4) / 5)
#define AUTH_B64URL_LEN(n) (((n) * 4 + 2) / 3)
#define AUTH_HEX_LEN(n) ((n) * 2)

/*
 * Each encoder writes the text and a terminator to `out` (`outlen` bytes) and returns the text's
 * length, or -1 when `out` is too small (then `out` holds an empty string if outlen > 0).
 */
int auth_b32_encode(const void *in, size_t n, char *out, size_t outlen);
int auth_b64url_encode(const void *in, size_t n, char *out, size_t outlen);
int auth_hex_encode(const void *in, size_t n, char *out, size_t outlen);

/*
 * Each decoder reads exactly `n` characters of `in` and writes the bytes to `out` (`outlen`
 * bytes). Returns the number of bytes written, or -1 on a character outside the alphabet, a length
 * no encoding produces, non-zero padding bits, or an `out` too small.
 */
int auth_b64url_decode(const char *in, size_t n, void *out, size_t outlen);
int auth_hex_decode(const char *in, size_t n, void *out, size_t outlen);

/* Whether each of the `n` characters is in the alphabet (no length check). */
bool auth_is_b32(const char *s, size_t n);
bool auth_is_b64url(const char *s, size_t n);

#endif
