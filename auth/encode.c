/*
 * encode.c - base32, base64url and hex for auth/ (see encode.h).
 */
#include "auth/encode.h"

#include <stdint.h>

static const char b32_alpha[] = "abcdefghijklmnopqrstuvwxyz234567";
static const char b64_alpha[] =
	"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
static const char hex_alpha[] = "0123456789abcdef";

static int too_small(char *out, size_t outlen)
{
	if (outlen > 0)
		out[0] = '\0';
	return -1;
}

/* Packs `n` bytes into characters of `width` bits from `alpha`, unpadded; `need` < outlen. */
static int pack_bits(const unsigned char *p, size_t n, int width, const char *alpha, size_t need,
		     char *out, size_t outlen)
{
	unsigned mask = (1u << width) - 1;
	size_t o = 0;
	uint32_t acc = 0;
	int bits = 0;

	if (need + 1 > outlen)
		return too_small(out, outlen);
	for (size_t i = 0; i < n; i++) {
		acc = (acc << 8) | p[i];
		bits += 8;
		while (bits >= width) {
			out[o++] = alpha[(acc >> (bits - width)) & mask];
			bits -= width;
		}
	}
	if (bits > 0)
		out[o++] = alpha[(acc << (width - bits)) & mask];
	out[o] = '\0';
	return (int)o;
}

int auth_b32_encode(const void *in, size_t n, char *out, size_t outlen)
{
	return pack_bits(in, n, 5, b32_alpha, AUTH_B32_LEN(n), out, outlen);
}

int auth_b64url_encode(const void *in, size_t n, char *out, size_t outlen)
{
	return pack_bits(in, n, 6, b64_alpha, AUTH_B64URL_LEN(n), out, outlen);
}

int auth_hex_encode(const void *in, size_t n, char *out, size_t outlen)
{
	const unsigned char *p = in;

	if (AUTH_HEX_LEN(n) + 1 > outlen)
		return too_small(out, outlen);
	for (size_t i = 0; i < n; i++) {
		out[2 * i] = hex_alpha[p[i] >> 4];
		out[2 * i + 1] = hex_alpha[p[i] & 15];
	}
	out[2 * n] = '\0';
	return (int)(2 * n);
}

/*
 * Each byte's value in base64url, or -1: a table rather than a chain of ranges, since a request
 * with a JWT checks and decodes its some 400 characters on every request (bearer.c, jwt.c).
 */
#define B64_ROW(c) ((signed char)((c) >= 'A' && (c) <= 'Z' ? (c) - 'A'			   \
				 : (c) >= 'a' && (c) <= 'z' ? (c) - 'a' + 26		   \
				 : (c) >= '0' && (c) <= '9' ? (c) - '0' + 52		   \
				 : (c) == '-' ? 62 : (c) == '_' ? 63 : -1))
#define B64_ROW4(c) B64_ROW(c), B64_ROW((c) + 1), B64_ROW((c) + 2), B64_ROW((c) + 3)
#define B64_ROW16(c) B64_ROW4(c), B64_ROW4((c) + 4), B64_ROW4((c) + 8), B64_ROW4((c) + 12)
static const signed char b64_table[256] = {
	B64_ROW16(0), B64_ROW16(16), B64_ROW16(32), B64_ROW16(48),
	B64_ROW16(64), B64_ROW16(80), B64_ROW16(96), B64_ROW16(112),
	B64_ROW16(128), B64_ROW16(144), B64_ROW16(160), B64_ROW16(176),
	B64_ROW16(192), B64_ROW16(208), B64_ROW16(224), B64_ROW16(240),
};

static int b64_val(char c)
{
	return b64_table[(unsigned char)c];
}

int auth_b64url_decode(const char *in, size_t n, void *out, size_t outlen)
{
	unsigned char *p = out;
	size_t o = 0;
	uint32_t acc = 0;
	int bits = 0;

	if (n % 4 == 1)
		return -1;
	if (n / 4 * 3 + (n % 4 ? n % 4 - 1 : 0) > outlen)
		return -1;
	for (size_t i = 0; i < n; i++) {
		int v = b64_val(in[i]);

		if (v < 0)
			return -1;
		acc = ((acc << 6) | (uint32_t)v) & 0xffffff;
		bits += 6;
		if (bits >= 8) {
			p[o++] = (unsigned char)(acc >> (bits - 8));
			bits -= 8;
		}
	}
	/* Leftover bits must be zero: otherwise two texts would decode to the same bytes. */
	if (bits > 0 && (acc & ((1u << bits) - 1)) != 0)
		return -1;
	return (int)o;
}

static int hex_val(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

int auth_hex_decode(const char *in, size_t n, void *out, size_t outlen)
{
	unsigned char *p = out;

	if (n % 2 != 0 || n / 2 > outlen)
		return -1;
	for (size_t i = 0; i < n; i += 2) {
		int hi = hex_val(in[i]), lo = hex_val(in[i + 1]);

		if (hi < 0 || lo < 0)
			return -1;
		p[i / 2] = (unsigned char)(hi << 4 | lo);
	}
	return (int)(n / 2);
}

bool auth_is_b32(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '2' && s[i] <= '7')))
			return false;
	return true;
}

bool auth_is_b64url(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (b64_val(s[i]) < 0)
			return false;
	return true;
}
