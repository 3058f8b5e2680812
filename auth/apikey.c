/*
 * apikey.c - making, parsing and checking API keys, and opaque random ids (see apikey.h).
 */
/*
 * SHA256_Init and its kin are deprecated in OpenSSL 3 in favour of EVP, whose per-call set-up is
 * what a prepared pepper avoids (auth_apikey_pepper_new): they are used for that alone.
 */
#define OPENSSL_SUPPRESS_DEPRECATED

#include "auth/apikey.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

#include "auth/encode.h"

#define ID_RANDOM_BYTES 16	/* 128 bits -> 26 base32 characters */
#define SECRET_BYTES 32		/* 256 bits -> 52 base32 characters */
#define PEPPER_MIN 16		/* bytes */
#define HASH_DOMAIN "kiln-apikey-v1"

static bool prefix_ok(const char *prefix)
{
	size_t n = prefix ? strlen(prefix) : 0;

	if (n < 2 || n > 8 || prefix[n - 1] != '_')
		return false;
	for (size_t i = 0; i + 1 < n; i++)
		if (prefix[i] < 'a' || prefix[i] > 'z')
			return false;
	return true;
}

enum kiln_err auth_new_id(const char *prefix, char *out, size_t outlen)
{
	unsigned char rnd[ID_RANDOM_BYTES];
	size_t n;

	if (outlen > 0)
		out[0] = '\0';
	if (!prefix_ok(prefix))
		return KILN_E_INVALID;
	n = strlen(prefix);
	if (n + AUTH_ID_RANDOM_LEN + 1 > outlen)
		return KILN_E_INVALID;
	if (RAND_bytes(rnd, sizeof(rnd)) != 1)
		return KILN_E_INTERNAL;
	memcpy(out, prefix, n);
	auth_b32_encode(rnd, sizeof(rnd), out + n, outlen - n);
	return KILN_OK;
}

#define HASH_MSG_MAX (sizeof(HASH_DOMAIN) + AUTH_KEY_ID_LEN + 1 + AUTH_APIKEY_SECRET_LEN)

/* The message the hash is over, into `msg` (HASH_MSG_MAX bytes); returns its length. */
static size_t hash_msg(const struct auth_apikey *key, unsigned char *msg)
{
	size_t idl = strnlen(key->key_id, sizeof(key->key_id));
	size_t sl = strnlen(key->secret, sizeof(key->secret));
	size_t n = 0;

	/* The domain and the key id are NUL-separated so no two inputs run together. */
	memcpy(msg, HASH_DOMAIN, sizeof(HASH_DOMAIN));
	n += sizeof(HASH_DOMAIN);
	memcpy(msg + n, key->key_id, idl);
	n += idl;
	msg[n++] = '\0';
	memcpy(msg + n, key->secret, sl);
	n += sl;
	return n;
}

enum kiln_err auth_apikey_hash(const struct auth_apikey *key, const unsigned char *pepper,
			       size_t pepper_len, char hash[AUTH_APIKEY_HASH_LEN + 1],
			       struct kiln_error *err)
{
	unsigned char msg[HASH_MSG_MAX];
	unsigned char mac[EVP_MAX_MD_SIZE];
	unsigned int maclen = 0;
	size_t n;

	hash[0] = '\0';
	if (!pepper || pepper_len < PEPPER_MIN || pepper_len > 1024)
		return kiln_error_set(err, KILN_E_INTERNAL, "api key pepper must be 16 to 1024 bytes");
	n = hash_msg(key, msg);
	if (!HMAC(EVP_sha256(), pepper, (int)pepper_len, msg, n, mac, &maclen) || maclen != 32) {
		OPENSSL_cleanse(msg, sizeof(msg));
		return kiln_error_set(err, KILN_E_INTERNAL, "hmac-sha-256 failed");
	}
	OPENSSL_cleanse(msg, sizeof(msg));
	auth_hex_encode(mac, maclen, hash, AUTH_APIKEY_HASH_LEN + 1);
	OPENSSL_cleanse(mac, sizeof(mac));
	return KILN_OK;
}

enum kiln_err auth_apikey_generate(const unsigned char *pepper, size_t pepper_len,
				   struct auth_apikey_new *out, struct kiln_error *err)
{
	unsigned char rnd[SECRET_BYTES];
	struct auth_apikey k;
	enum kiln_err rc;

	memset(out, 0, sizeof(*out));
	if (auth_new_id("key_", k.key_id, sizeof(k.key_id)) != KILN_OK)
		return kiln_error_set(err, KILN_E_INTERNAL, "random generator failed");
	if (RAND_bytes(rnd, sizeof(rnd)) != 1)
		return kiln_error_set(err, KILN_E_INTERNAL, "random generator failed");
	auth_b32_encode(rnd, sizeof(rnd), k.secret, sizeof(k.secret));
	OPENSSL_cleanse(rnd, sizeof(rnd));

	rc = auth_apikey_hash(&k, pepper, pepper_len, out->hash, err);
	if (rc == KILN_OK) {
		memcpy(out->key_id, k.key_id, sizeof(out->key_id));
		snprintf(out->key, sizeof(out->key), AUTH_APIKEY_PREFIX "%s_%s", k.key_id, k.secret);
		memcpy(out->prefix, out->key, AUTH_APIKEY_DISPLAY_LEN);
		out->prefix[AUTH_APIKEY_DISPLAY_LEN] = '\0';
	}
	OPENSSL_cleanse(&k, sizeof(k));
	return rc;
}

enum kiln_err auth_apikey_parse(const char *s, size_t len, struct auth_apikey *out,
				struct kiln_error *err)
{
	static const char head[] = AUTH_APIKEY_PREFIX "key_";
	const size_t hl = sizeof(head) - 1;
	const char *id_rand, *secret;

	memset(out, 0, sizeof(*out));
	if (!s || len != AUTH_APIKEY_LEN)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "malformed api key: wrong length");
	id_rand = s + hl;
	secret = s + 8 + AUTH_KEY_ID_LEN + 1;
	if (memcmp(s, head, hl) != 0)
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "malformed api key: bad prefix");
	if (!auth_is_b32(id_rand, AUTH_ID_RANDOM_LEN) || s[8 + AUTH_KEY_ID_LEN] != '_' ||
	    !auth_is_b32(secret, AUTH_APIKEY_SECRET_LEN))
		return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "malformed api key");
	memcpy(out->key_id, s + 8, AUTH_KEY_ID_LEN);
	memcpy(out->secret, secret, AUTH_APIKEY_SECRET_LEN);
	return KILN_OK;
}

bool auth_apikey_verify(const struct auth_apikey *key, const unsigned char *pepper,
			size_t pepper_len, const char *stored_hash)
{
	char hash[AUTH_APIKEY_HASH_LEN + 1];
	bool ok;

	if (!stored_hash || strnlen(stored_hash, AUTH_APIKEY_HASH_LEN + 1) != AUTH_APIKEY_HASH_LEN)
		return false;
	if (auth_apikey_hash(key, pepper, pepper_len, hash, NULL) != KILN_OK)
		return false;
	ok = CRYPTO_memcmp(hash, stored_hash, AUTH_APIKEY_HASH_LEN) == 0;
	OPENSSL_cleanse(hash, sizeof(hash));
	return ok;
}

/* HMAC-SHA-256 (RFC 2104) with its key's inner and outer pads already hashed. */
struct auth_apikey_pepper {
	SHA256_CTX inner, outer;
};

struct auth_apikey_pepper *auth_apikey_pepper_new(const unsigned char *pepper, size_t pepper_len)
{
	unsigned char k[SHA256_CBLOCK] = { 0 }, pad[SHA256_CBLOCK];
	struct auth_apikey_pepper *p;

	if (!pepper || pepper_len < PEPPER_MIN || pepper_len > 1024 || !(p = malloc(sizeof(*p))))
		return NULL;
	if (pepper_len > sizeof(k))	/* a key longer than a block is hashed first */
		SHA256(pepper, pepper_len, k);
	else
		memcpy(k, pepper, pepper_len);
	for (size_t i = 0; i < sizeof(pad); i++)
		pad[i] = k[i] ^ 0x36;
	SHA256_Init(&p->inner);
	SHA256_Update(&p->inner, pad, sizeof(pad));
	for (size_t i = 0; i < sizeof(pad); i++)
		pad[i] = k[i] ^ 0x5c;
	SHA256_Init(&p->outer);
	SHA256_Update(&p->outer, pad, sizeof(pad));
	OPENSSL_cleanse(k, sizeof(k));
	OPENSSL_cleanse(pad, sizeof(pad));
	return p;
}

void auth_apikey_pepper_free(struct auth_apikey_pepper *p)
{
	if (!p)
		return;
	OPENSSL_cleanse(p, sizeof(*p));
	free(p);
}

bool auth_apikey_verify_prepared(const struct auth_apikey *key,
				 const struct auth_apikey_pepper *pepper, const char *stored_hash)
{
	unsigned char msg[HASH_MSG_MAX], mac[SHA256_DIGEST_LENGTH];
	char hash[AUTH_APIKEY_HASH_LEN + 1];
	SHA256_CTX c;
	bool ok;

	if (!pepper || !stored_hash ||
	    strnlen(stored_hash, AUTH_APIKEY_HASH_LEN + 1) != AUTH_APIKEY_HASH_LEN)
		return false;
	c = pepper->inner;
	SHA256_Update(&c, msg, hash_msg(key, msg));
	SHA256_Final(mac, &c);
	c = pepper->outer;
	SHA256_Update(&c, mac, sizeof(mac));
	SHA256_Final(mac, &c);
	auth_hex_encode(mac, sizeof(mac), hash, sizeof(hash));
	ok = CRYPTO_memcmp(hash, stored_hash, AUTH_APIKEY_HASH_LEN) == 0;
	OPENSSL_cleanse(&c, sizeof(c));
	OPENSSL_cleanse(msg, sizeof(msg));
	OPENSSL_cleanse(mac, sizeof(mac));
	OPENSSL_cleanse(hash, sizeof(hash));
	return ok;
}
