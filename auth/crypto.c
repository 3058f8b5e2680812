/*
 * crypto.c - master key loading, HKDF derivation and AES-256-GCM sealing (see crypto.h).
 */
#include "auth/crypto.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include "auth/encode.h"

#define SEAL_VERSION "k1"
#define SEAL_HEAD SEAL_VERSION "."
#define NONCE_LEN 12	/* bytes: 96-bit GCM nonce */
#define TAG_LEN 16	/* bytes */
#define AD_MAX 4096	/* bytes of associated data */

enum kiln_err auth_master_key_load(struct auth_master_key *mk, const char *text, size_t len,
				   struct kiln_error *err)
{
	char tmp[128];
	size_t n = 0;
	int got;

	memset(mk, 0, sizeof(*mk));
	if (!text)
		return kiln_error_set(err, KILN_E_INVALID, "master key missing");
	while (len > 0 && isspace((unsigned char)text[len - 1]))
		len--;
	while (len > 0 && isspace((unsigned char)*text)) {
		text++;
		len--;
	}
	if (len == 0)
		return kiln_error_set(err, KILN_E_INVALID, "master key is empty");
	if (len >= sizeof(tmp))
		return kiln_error_set(err, KILN_E_INVALID, "master key too long: want 32 bytes");
	if (len == AUTH_MASTER_KEY_HEX_LEN) {
		for (size_t i = 0; i < len; i++)
			tmp[i] = (char)tolower((unsigned char)text[i]);
		got = auth_hex_decode(tmp, len, mk->key, sizeof(mk->key));
	} else {
		/* base64 or base64url, padding optional */
		for (size_t i = 0; i < len; i++) {
			char c = text[i];

			if (c == '=' && i + 2 >= len)
				continue;
			tmp[n++] = c == '+' ? '-' : c == '/' ? '_' : c;
		}
		got = auth_b64url_decode(tmp, n, mk->key, sizeof(mk->key));
	}
	OPENSSL_cleanse(tmp, sizeof(tmp));
	if (got != AUTH_MASTER_KEY_LEN) {
		OPENSSL_cleanse(mk, sizeof(*mk));
		return kiln_error_set(err, KILN_E_INVALID,
				      "master key must be 32 bytes as 64 hex or base64 characters");
	}
	return KILN_OK;
}

enum kiln_err auth_master_key_generate(struct auth_master_key *mk, struct kiln_error *err)
{
	if (RAND_bytes(mk->key, sizeof(mk->key)) != 1) {
		OPENSSL_cleanse(mk, sizeof(*mk));
		return kiln_error_set(err, KILN_E_INTERNAL, "random generator failed");
	}
	return KILN_OK;
}

void auth_master_key_format(const struct auth_master_key *mk,
			    char out[AUTH_MASTER_KEY_HEX_LEN + 1])
{
	auth_hex_encode(mk->key, sizeof(mk->key), out, AUTH_MASTER_KEY_HEX_LEN + 1);
}

void auth_master_key_wipe(struct auth_master_key *mk)
{
	if (mk)
		OPENSSL_cleanse(mk, sizeof(*mk));
}

enum kiln_err auth_master_derive(const struct auth_master_key *mk, const char *label,
				 unsigned char *out, size_t outlen, struct kiln_error *err)
{
	static const unsigned char salt[] = "kiln-master-v1";
	EVP_PKEY_CTX *ctx;
	size_t n = outlen;
	int ok;

	if (!label || !*label || outlen == 0 || outlen > 255 * 32)
		return kiln_error_set(err, KILN_E_INTERNAL, "bad key derivation request");
	ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, NULL);
	if (!ctx)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory deriving a key");
	ok = EVP_PKEY_derive_init(ctx) > 0 && EVP_PKEY_CTX_set_hkdf_md(ctx, EVP_sha256()) > 0 &&
	     EVP_PKEY_CTX_set1_hkdf_salt(ctx, salt, sizeof(salt) - 1) > 0 &&
	     EVP_PKEY_CTX_set1_hkdf_key(ctx, mk->key, sizeof(mk->key)) > 0 &&
	     EVP_PKEY_CTX_add1_hkdf_info(ctx, (const unsigned char *)label, (int)strlen(label)) > 0 &&
	     EVP_PKEY_derive(ctx, out, &n) > 0 && n == outlen;
	EVP_PKEY_CTX_free(ctx);
	if (!ok) {
		OPENSSL_cleanse(out, outlen);
		return kiln_error_set(err, KILN_E_INTERNAL, "hkdf failed");
	}
	return KILN_OK;
}

/*
 * Runs AES-256-GCM over `in` into `out` (same length). Encrypts and writes `tag` when `enc`,
 * otherwise decrypts and checks `tag`. The version string is authenticated before the caller's
 * associated data. Returns 1 on success, 0 on any failure (including a tag mismatch).
 */
static int gcm(int enc, const struct auth_master_key *mk, const unsigned char *nonce,
	       const void *ad, size_t adlen, const unsigned char *in, size_t n,
	       unsigned char *out, unsigned char *tag)
{
	EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
	int len = 0, ok;

	if (!ctx)
		return 0;
	ok = EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), NULL, NULL, NULL, enc) == 1 &&
	     EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN, NONCE_LEN, NULL) == 1 &&
	     EVP_CipherInit_ex(ctx, NULL, NULL, mk->key, nonce, enc) == 1 &&
	     EVP_CipherUpdate(ctx, NULL, &len, (const unsigned char *)SEAL_VERSION,
			      (int)strlen(SEAL_VERSION)) == 1 &&
	     (adlen == 0 || EVP_CipherUpdate(ctx, NULL, &len, ad, (int)adlen) == 1) &&
	     (n == 0 || EVP_CipherUpdate(ctx, out, &len, in, (int)n) == 1);
	if (ok && !enc)
		ok = EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, TAG_LEN, tag) == 1;
	if (ok)
		ok = EVP_CipherFinal_ex(ctx, out + (n ? (size_t)len : 0), &len) == 1;
	if (ok && enc)
		ok = EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, TAG_LEN, tag) == 1;
	EVP_CIPHER_CTX_free(ctx);
	return ok;
}

enum kiln_err auth_seal(const struct auth_master_key *mk, const void *pt, size_t ptlen,
			const void *ad, size_t adlen, char **out, struct kiln_error *err)
{
	size_t rawlen = NONCE_LEN + ptlen + TAG_LEN, textlen;
	unsigned char *raw = NULL;
	enum kiln_err rc = KILN_OK;
	char *text = NULL;

	*out = NULL;
	if (ptlen > AUTH_SEAL_PLAINTEXT_MAX || adlen > AD_MAX || (ptlen && !pt) || (adlen && !ad))
		return kiln_error_set(err, KILN_E_TOO_LARGE, "value to seal is too large");
	raw = malloc(rawlen);
	textlen = strlen(SEAL_HEAD) + AUTH_B64URL_LEN(rawlen) + 1;
	text = malloc(textlen);
	if (!raw || !text) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory sealing a value");
		goto cleanup;
	}
	if (RAND_bytes(raw, NONCE_LEN) != 1 ||
	    !gcm(1, mk, raw, ad, adlen, pt, ptlen, raw + NONCE_LEN, raw + NONCE_LEN + ptlen)) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "aes-256-gcm sealing failed");
		goto cleanup;
	}
	memcpy(text, SEAL_HEAD, strlen(SEAL_HEAD));
	auth_b64url_encode(raw, rawlen, text + strlen(SEAL_HEAD), textlen - strlen(SEAL_HEAD));
	*out = text;
	text = NULL;
cleanup:
	free(raw);
	free(text);
	return rc;
}

enum kiln_err auth_open(const struct auth_master_key *mk, const char *sealed, size_t len,
			const void *ad, size_t adlen, unsigned char **pt, size_t *ptlen,
			struct kiln_error *err)
{
	const size_t hl = strlen(SEAL_HEAD);
	unsigned char *raw = NULL, *plain = NULL;
	enum kiln_err rc = KILN_OK;
	size_t rawmax, n;
	int got;

	*pt = NULL;
	*ptlen = 0;
	if (!sealed || len > AUTH_SEALED_MAX || len < hl || memcmp(sealed, SEAL_HEAD, hl) != 0)
		return kiln_error_set(err, KILN_E_INVALID, "sealed value: unknown format");
	if (adlen > AD_MAX || (adlen && !ad))
		return kiln_error_set(err, KILN_E_INVALID, "sealed value: associated data too long");
	rawmax = (len - hl) / 4 * 3 + 3;
	raw = malloc(rawmax);
	if (!raw)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory opening a value");
	got = auth_b64url_decode(sealed + hl, len - hl, raw, rawmax);
	if (got < NONCE_LEN + TAG_LEN) {
		rc = kiln_error_set(err, KILN_E_INVALID, "sealed value: malformed");
		goto cleanup;
	}
	n = (size_t)got - NONCE_LEN - TAG_LEN;
	plain = malloc(n + 1);
	if (!plain) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory opening a value");
		goto cleanup;
	}
	if (!gcm(0, mk, raw, ad, adlen, raw + NONCE_LEN, n, plain, raw + NONCE_LEN + n)) {
		rc = kiln_error_set(err, KILN_E_INVALID,
				    "sealed value: authentication failed (wrong key, data or tampered)");
		goto cleanup;
	}
	plain[n] = '\0';
	*pt = plain;
	*ptlen = n;
	plain = NULL;
cleanup:
	if (plain) {
		OPENSSL_cleanse(plain, n + 1);
		free(plain);
	}
	free(raw);
	return rc;
}

void auth_secret_free(void *p, size_t len)
{
	if (!p)
		return;
	OPENSSL_cleanse(p, len);
	free(p);
}

enum kiln_err auth_data_key_new(const struct auth_master_key *mk, const void *ad, size_t adlen,
				unsigned char key[AUTH_DATA_KEY_LEN], char **wrapped,
				struct kiln_error *err)
{
	enum kiln_err rc;

	*wrapped = NULL;
	if (RAND_bytes(key, AUTH_DATA_KEY_LEN) != 1)
		return kiln_error_set(err, KILN_E_INTERNAL, "random generator failed");
	rc = auth_seal(mk, key, AUTH_DATA_KEY_LEN, ad, adlen, wrapped, err);
	if (rc != KILN_OK)
		OPENSSL_cleanse(key, AUTH_DATA_KEY_LEN);
	return rc;
}

enum kiln_err auth_data_key_unwrap(const struct auth_master_key *mk, const char *wrapped,
				   size_t len, const void *ad, size_t adlen,
				   unsigned char key[AUTH_DATA_KEY_LEN], struct kiln_error *err)
{
	unsigned char *pt = NULL;
	size_t n = 0;
	enum kiln_err rc;

	rc = auth_open(mk, wrapped, len, ad, adlen, &pt, &n, err);
	if (rc != KILN_OK)
		return rc;
	if (n != AUTH_DATA_KEY_LEN) {
		auth_secret_free(pt, n);
		return kiln_error_set(err, KILN_E_INVALID, "wrapped data key has the wrong length");
	}
	memcpy(key, pt, AUTH_DATA_KEY_LEN);
	auth_secret_free(pt, n);
	return KILN_OK;
}
