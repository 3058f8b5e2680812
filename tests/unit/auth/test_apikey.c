/*
 * test_apikey.c - API keys, ids and the encodings under them.
 */
#include <string.h>

#include "auth/apikey.h"
#include "auth/encode.h"
#include "test.h"

static const unsigned char pepper[32] = "0123456789abcdef0123456789abcde";
static const unsigned char pepper2[32] = "fedcba9876543210fedcba987654321";

static void b64url_known_vectors_round_trip(void)
{
	char out[16];
	unsigned char bin[16];

	CHECK_INT(auth_b64url_encode("f", 1, out, sizeof(out)), 2);
	CHECK_STR(out, "Zg");
	CHECK_INT(auth_b64url_encode("foo", 3, out, sizeof(out)), 4);
	CHECK_STR(out, "Zm9v");
	CHECK_INT(auth_b64url_encode("\xfb\xff", 2, out, sizeof(out)), 3);
	CHECK_STR(out, "-_8");
	CHECK_INT(auth_b64url_decode("Zm9vYg", 6, bin, sizeof(bin)), 4);
	CHECK(memcmp(bin, "foob", 4) == 0);
	CHECK_INT(auth_b64url_decode("Zh", 2, bin, sizeof(bin)), -1);	/* non-zero pad bits */
	CHECK_INT(auth_b64url_decode("Zm9vY", 5, bin, sizeof(bin)), -1);	/* impossible length */
	CHECK_INT(auth_b64url_decode("Zm9v+g", 6, bin, sizeof(bin)), -1);	/* not url alphabet */
	CHECK_INT(auth_b64url_decode("Zm9v", 4, bin, 2), -1);		/* out too small */
	CHECK_INT(auth_b64url_encode("foo", 3, out, 4), -1);
	CHECK_INT(auth_b32_encode("f", 1, out, sizeof(out)), 2);
	CHECK_STR(out, "my");
	CHECK_INT(auth_hex_encode("\x01\xab", 2, out, sizeof(out)), 4);
	CHECK_STR(out, "01ab");
	CHECK_INT(auth_hex_decode("01AB", 4, bin, sizeof(bin)), -1);
	CHECK_INT(auth_hex_decode("01ab", 4, bin, sizeof(bin)), 2);
}

/* Every byte: in the base64url alphabet exactly when the alphabet lists it, with its index. */
static void b64url_alphabet_every_byte(void)
{
	static const char alpha[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
	int in = 0;

	for (int b = 0; b < 256; b++) {
		char c = (char)b, four[4] = { c, 'A', 'A', 'A' };
		const char *at = b ? memchr(alpha, b, 64) : NULL;
		unsigned char bin[3];

		CHECK(auth_is_b64url(&c, 1) == (at != NULL));
		if (at) {	/* "cAAA": the first 6 bits are c's index */
			CHECK_INT(auth_b64url_decode(four, 4, bin, sizeof(bin)), 3);
			CHECK_INT(bin[0] >> 2, at - alpha);
		} else {
			CHECK_INT(auth_b64url_decode(four, 4, bin, sizeof(bin)), -1);
		}
		in += at != NULL;
	}
	CHECK_INT(in, 64);
}

static void new_id_has_prefix_and_random_part(void)
{
	static const char *const prefixes[] = { "tn_", "key_", "sb_", "snap_", "tx_", "req_" };
	char a[AUTH_ID_MAX], b[AUTH_ID_MAX];

	for (size_t i = 0; i < sizeof(prefixes) / sizeof(prefixes[0]); i++) {
		size_t pl = strlen(prefixes[i]);

		CHECK_INT(auth_new_id(prefixes[i], a, sizeof(a)), KILN_OK);
		CHECK_INT(auth_new_id(prefixes[i], b, sizeof(b)), KILN_OK);
		CHECK(strncmp(a, prefixes[i], pl) == 0);
		CHECK_INT(strlen(a), pl + AUTH_ID_RANDOM_LEN);
		CHECK(auth_is_b32(a + pl, AUTH_ID_RANDOM_LEN));
		CHECK(strcmp(a, b) != 0);
	}
}

static void new_id_refuses_bad_prefixes(void)
{
	char a[AUTH_ID_MAX];

	CHECK_INT(auth_new_id("TN_", a, sizeof(a)), KILN_E_INVALID);
	CHECK_INT(auth_new_id("tn", a, sizeof(a)), KILN_E_INVALID);
	CHECK_INT(auth_new_id("", a, sizeof(a)), KILN_E_INVALID);
	CHECK_INT(auth_new_id(NULL, a, sizeof(a)), KILN_E_INVALID);
	CHECK_INT(auth_new_id("toolongpx_", a, sizeof(a)), KILN_E_INVALID);
	CHECK_INT(auth_new_id("t1_", a, sizeof(a)), KILN_E_INVALID);
	CHECK_INT(auth_new_id("tn_", a, 10), KILN_E_INVALID);
	CHECK_STR(a, "");
}

static void generated_key_parses_and_verifies(void)
{
	struct auth_apikey_new k;
	struct auth_apikey p;
	struct kiln_error err = { 0 };

	CHECK_INT(auth_apikey_generate(pepper, sizeof(pepper), &k, &err), KILN_OK);
	CHECK_INT(strlen(k.key), AUTH_APIKEY_LEN);
	CHECK_INT(strlen(k.key), 91);
	CHECK(strncmp(k.key, "kiln_sk_key_", 12) == 0);
	CHECK_INT(strlen(k.key_id), AUTH_KEY_ID_LEN);
	CHECK(strncmp(k.key, "kiln_sk_", 8) == 0 && strncmp(k.key + 8, k.key_id, AUTH_KEY_ID_LEN) == 0);
	CHECK_INT(strlen(k.prefix), AUTH_APIKEY_DISPLAY_LEN);
	CHECK(strncmp(k.key, k.prefix, AUTH_APIKEY_DISPLAY_LEN) == 0);
	CHECK_INT(strlen(k.hash), 64);

	CHECK_INT(auth_apikey_parse(k.key, strlen(k.key), &p, &err), KILN_OK);
	CHECK_STR(p.key_id, k.key_id);
	CHECK_INT(strlen(p.secret), AUTH_APIKEY_SECRET_LEN);
	CHECK(auth_apikey_verify(&p, pepper, sizeof(pepper), k.hash));
	/* The secret is not in the hash, the prefix or the id. */
	CHECK(strstr(k.hash, p.secret) == NULL && strstr(k.prefix, p.secret) == NULL);
}

static void verify_refuses_wrong_secret_pepper_or_key_id(void)
{
	struct auth_apikey_new k, k2;
	struct auth_apikey p;
	char hash[AUTH_APIKEY_HASH_LEN + 1];

	CHECK_INT(auth_apikey_generate(pepper, sizeof(pepper), &k, NULL), KILN_OK);
	CHECK_INT(auth_apikey_generate(pepper, sizeof(pepper), &k2, NULL), KILN_OK);
	CHECK_INT(auth_apikey_parse(k.key, strlen(k.key), &p, NULL), KILN_OK);
	CHECK(!auth_apikey_verify(&p, pepper2, sizeof(pepper2), k.hash));
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), k2.hash));
	p.secret[0] = p.secret[0] == 'a' ? 'b' : 'a';
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), k.hash));
	CHECK_INT(auth_apikey_parse(k.key, strlen(k.key), &p, NULL), KILN_OK);
	/* The hash binds the key id: the right secret under another id fails. */
	memcpy(p.key_id, k2.key_id, sizeof(p.key_id));
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), k.hash));
	CHECK_INT(auth_apikey_parse(k.key, strlen(k.key), &p, NULL), KILN_OK);
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), NULL));
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), ""));
	memcpy(hash, k.hash, sizeof(hash));
	hash[63] = '\0';
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), hash));
	for (int i = 0; i < 64; i++)
		hash[i] = (char)(k.hash[i] >= 'a' ? k.hash[i] - 32 : k.hash[i]);
	hash[64] = '\0';
	CHECK(!auth_apikey_verify(&p, pepper, sizeof(pepper), hash));	/* uppercase hex */
	CHECK(!auth_apikey_verify(&p, pepper, 8, k.hash));		/* short pepper */
}

static void generate_refuses_short_pepper(void)
{
	struct auth_apikey_new k;
	struct kiln_error err = { 0 };

	CHECK_INT(auth_apikey_generate(pepper, 8, &k, &err), KILN_E_INTERNAL);
	CHECK_STR(k.key, "");
	CHECK_INT(auth_apikey_generate(NULL, 0, &k, NULL), KILN_E_INTERNAL);
}

static enum kiln_err parse_str(const char *s)
{
	struct auth_apikey p;

	return auth_apikey_parse(s, s ? strlen(s) : 0, &p, NULL);
}

static void parse_refuses_garbled_keys(void)
{
	struct auth_apikey_new k;
	struct auth_apikey p;
	struct kiln_error err = { 0 };
	char buf[200];

	CHECK_INT(auth_apikey_generate(pepper, sizeof(pepper), &k, NULL), KILN_OK);
	CHECK_INT(parse_str(""), KILN_E_UNAUTHENTICATED);
	CHECK_INT(parse_str(NULL), KILN_E_UNAUTHENTICATED);
	CHECK_INT(auth_apikey_parse(k.key, strlen(k.key) - 1, &p, &err), KILN_E_UNAUTHENTICATED);
	CHECK(strstr(err.msg, k.key + 8) == NULL);
	snprintf(buf, sizeof(buf), "%sa", k.key);
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);	/* oversized */
	memcpy(buf, k.key, sizeof(k.key));
	memcpy(buf, "kiln_pk_", 8);
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);	/* wrong prefix */
	memcpy(buf, k.key, sizeof(k.key));
	memcpy(buf + 8, "sb__", 4);
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);	/* not a key id */
	memcpy(buf, k.key, sizeof(k.key));
	buf[8 + AUTH_KEY_ID_LEN] = '-';
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);	/* no separator */
	memcpy(buf, k.key, sizeof(k.key));
	buf[60] = 'A';
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);	/* uppercase */
	buf[60] = '1';
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);	/* outside base32 */
	buf[60] = '_';
	CHECK_INT(parse_str(buf), KILN_E_UNAUTHENTICATED);
	memcpy(buf, k.key, sizeof(k.key));
	buf[20] = '\0';
	CHECK_INT(auth_apikey_parse(buf, AUTH_APIKEY_LEN, &p, NULL), KILN_E_UNAUTHENTICATED);
	memcpy(buf, k.key, sizeof(k.key));
	CHECK_INT(parse_str(buf), KILN_OK);
}

/*
 * A prepared pepper gives auth_apikey_verify()'s answer: for peppers of 16, 32, 64 (one block),
 * 65 and 1024 bytes (longer than a block: hashed first, as HMAC does), the right key passes and a
 * wrong secret, key id or pepper fails; a pepper out of bounds is not prepared.
 */
static void prepared_pepper_verifies_as_hmac_does(void)
{
	static unsigned char big[1025];
	const size_t lens[] = { 16, 32, 64, 65, 1024 };
	struct auth_apikey_pepper *pp, *other;
	struct auth_apikey_new k, k2;
	struct auth_apikey p;

	for (size_t i = 0; i < sizeof(big); i++)
		big[i] = (unsigned char)(i * 7 + 3);
	other = auth_apikey_pepper_new(pepper2, sizeof(pepper2));
	CHECK(other != NULL);
	for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++) {
		pp = auth_apikey_pepper_new(big, lens[l]);
		CHECK(pp != NULL);
		for (int round = 0; round < 20; round++) {
			CHECK_INT(auth_apikey_generate(big, lens[l], &k, NULL), KILN_OK);
			CHECK_INT(auth_apikey_generate(big, lens[l], &k2, NULL), KILN_OK);
			CHECK_INT(auth_apikey_parse(k.key, strlen(k.key), &p, NULL), KILN_OK);
			CHECK(auth_apikey_verify(&p, big, lens[l], k.hash));
			CHECK(auth_apikey_verify_prepared(&p, pp, k.hash));
			CHECK(!auth_apikey_verify_prepared(&p, pp, k2.hash));
			CHECK(!auth_apikey_verify_prepared(&p, other, k.hash));
			CHECK(!auth_apikey_verify_prepared(&p, NULL, k.hash));
			CHECK(!auth_apikey_verify_prepared(&p, pp, NULL));
			CHECK(!auth_apikey_verify_prepared(&p, pp, ""));
			memcpy(p.key_id, k2.key_id, sizeof(p.key_id));
			CHECK(!auth_apikey_verify_prepared(&p, pp, k.hash));
			CHECK_INT(auth_apikey_parse(k.key, strlen(k.key), &p, NULL), KILN_OK);
			p.secret[round % AUTH_APIKEY_SECRET_LEN] ^= 1;
			CHECK(!auth_apikey_verify_prepared(&p, pp, k.hash));
			CHECK(!auth_apikey_verify(&p, big, lens[l], k.hash));
		}
		auth_apikey_pepper_free(pp);
	}
	auth_apikey_pepper_free(other);
	auth_apikey_pepper_free(NULL);
	CHECK(auth_apikey_pepper_new(big, 15) == NULL);
	CHECK(auth_apikey_pepper_new(big, 1025) == NULL);
	CHECK(auth_apikey_pepper_new(NULL, 32) == NULL);
}

int main(void)
{
	TEST(b64url_known_vectors_round_trip);
	TEST(b64url_alphabet_every_byte);
	TEST(new_id_has_prefix_and_random_part);
	TEST(new_id_refuses_bad_prefixes);
	TEST(generated_key_parses_and_verifies);
	TEST(verify_refuses_wrong_secret_pepper_or_key_id);
	TEST(prepared_pepper_verifies_as_hmac_does);
	TEST(generate_refuses_short_pepper);
	TEST(parse_refuses_garbled_keys);
	return test_summary();
}
