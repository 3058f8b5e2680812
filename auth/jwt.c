/*
 * jwt.c - signing and verifying ES256 JWTs (see jwt.h and docs/auth.md).
 *
 * Nothing in a token decides how it is checked. The header is parsed here first and anything but
 * `alg: ES256` with a kid is refused (this is what closes `none` and HS256 keyed with the public
 * key, which libjwt 1.10.2 would accept); the key is the keyring's key for that kid; the
 * signature must be the JOSE form, 64 bytes of r||s, and is checked here with OpenSSL against the
 * key parsed once when it joined the keyring (parsing a PEM per token cost more than the ECDSA
 * check itself). The claims are read here too, from the verified payload, with strict types.
 * A token whose exact bytes a key of the keyring already accepted (its SHA-256 is in that key's
 * cache, see keyring_priv.h) is neither decoded nor checked for its signature again: the claims
 * it was accepted with come from the cache, and only the checks that depend on the caller's
 * options and `now` (audience, issuer, exp, iat/nbf with leeway, lifetime, sandbox) run again.
 * Those bytes decide everything else, and only a token that passed every check joins the cache.
 * Tokens are written here the same way: JSON by jansson, ECDSA by OpenSSL with the parsed key.
 */
#include "auth/jwt.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>
#include <openssl/bn.h>
#include <openssl/crypto.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/sha.h>

#include "auth/apikey.h"
#include "auth/encode.h"
#include "auth/keyring_priv.h"
#include "auth/scopes.h"

#define HEADER_B64_MAX 512	/* characters of the encoded header */
#define PAYLOAD_B64_MAX 3072	/* characters of the encoded payload */
#define SIG_B64_LEN 86		/* characters of a raw 64-byte r||s signature */
#define ES256_COORD_LEN 32	/* bytes of r and of s */
#define ES256_SIG_LEN 64	/* bytes of a JOSE ES256 signature: r||s */
#define ES256_DER_MAX 80	/* bytes of a DER ECDSA-Sig-Value over P-256 (72 at most) */
#define INT_CLAIM_MAX 4102444800LL /* seconds: 2100-01-01, the latest time a claim may name */

static const char *const reason_names[] = {
	[AUTH_JWT_OK] = "ok",
	[AUTH_JWT_TOO_LARGE] = "too_large",
	[AUTH_JWT_MALFORMED] = "malformed",
	[AUTH_JWT_BAD_ALG] = "bad_alg",
	[AUTH_JWT_UNKNOWN_KID] = "unknown_kid",
	[AUTH_JWT_BAD_SIGNATURE] = "bad_signature",
	[AUTH_JWT_BAD_CLAIMS] = "bad_claims",
	[AUTH_JWT_WRONG_AUD] = "wrong_aud",
	[AUTH_JWT_WRONG_ISS] = "wrong_iss",
	[AUTH_JWT_EXPIRED] = "expired",
	[AUTH_JWT_NOT_YET_VALID] = "not_yet_valid",
	[AUTH_JWT_TTL_TOO_LONG] = "ttl_too_long",
};

const char *auth_jwt_reason_name(enum auth_jwt_reason r)
{
	if ((unsigned)r >= sizeof(reason_names) / sizeof(reason_names[0]) || !reason_names[r])
		return "unknown";
	return reason_names[r];
}

/* 1 .. AUTH_CLAIM_MAX-1 bytes of printable ASCII without spaces. */
static bool claim_str_ok(const char *s, size_t n)
{
	if (!s || n == 0 || n >= AUTH_CLAIM_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (s[i] <= 0x20 || s[i] >= 0x7f)
			return false;
	return true;
}

static bool param_ok(const char *s)
{
	return s && claim_str_ok(s, strnlen(s, AUTH_CLAIM_MAX));
}

static void copy_claim(char dst[AUTH_CLAIM_MAX], const char *src)
{
	snprintf(dst, AUTH_CLAIM_MAX, "%s", src ? src : "");
}

/* SHA-256 of the signing input `header.payload` (`n` bytes). */
static void signing_digest(const char *input, size_t n, unsigned char md[SHA256_DIGEST_LENGTH])
{
	SHA256((const unsigned char *)input, n, md);
}

/*
 * Signs the `n` bytes of `input` with `k`'s private key and writes the JOSE signature (r||s, 32
 * bytes each, big-endian) to `raw`. Returns 0 or -1.
 */
static int es256_sign(const struct auth_key *k, const char *input, size_t n,
		      unsigned char raw[ES256_SIG_LEN])
{
	unsigned char md[SHA256_DIGEST_LENGTH], der[ES256_DER_MAX];
	const unsigned char *p = der;
	size_t dlen = sizeof(der);
	const BIGNUM *r, *s;
	EVP_PKEY_CTX *ctx;
	ECDSA_SIG *sig = NULL;
	int rc = -1;

	signing_digest(input, n, md);
	ctx = EVP_PKEY_CTX_dup(k->sign_ctx);
	if (ctx && EVP_PKEY_sign(ctx, der, &dlen, md, sizeof(md)) == 1 &&
	    (sig = d2i_ECDSA_SIG(NULL, &p, (long)dlen)) != NULL) {
		ECDSA_SIG_get0(sig, &r, &s);
		if (BN_bn2binpad(r, raw, ES256_COORD_LEN) == ES256_COORD_LEN &&
		    BN_bn2binpad(s, raw + ES256_COORD_LEN, ES256_COORD_LEN) == ES256_COORD_LEN)
			rc = 0;
	}
	if (rc != 0)
		ERR_clear_error();
	ECDSA_SIG_free(sig);
	EVP_PKEY_CTX_free(ctx);
	return rc;
}

/*
 * Whether `raw` (r||s) is `k`'s signature of the `n` bytes of `input`. Returns 1 for a good
 * signature, 0 for a bad one, -1 when out of memory.
 */
static int es256_verify(const struct auth_key *k, const char *input, size_t n,
			const unsigned char raw[ES256_SIG_LEN])
{
	unsigned char md[SHA256_DIGEST_LENGTH], *der = NULL;
	BIGNUM *r = BN_bin2bn(raw, ES256_COORD_LEN, NULL);
	BIGNUM *s = BN_bin2bn(raw + ES256_COORD_LEN, ES256_COORD_LEN, NULL);
	EVP_PKEY_CTX *ctx = NULL;
	ECDSA_SIG *sig = ECDSA_SIG_new();
	int dlen, rc = -1;

	if (!r || !s || !sig || ECDSA_SIG_set0(sig, r, s) != 1) {
		BN_free(r);
		BN_free(s);
		goto out;
	}
	/* r and s now belong to sig. A zero or out-of-range value fails in EVP_PKEY_verify. */
	dlen = i2d_ECDSA_SIG(sig, &der);
	if (dlen <= 0)
		goto out;
	signing_digest(input, n, md);
	ctx = EVP_PKEY_CTX_dup(k->verify_ctx);
	if (!ctx)
		goto out;
	rc = EVP_PKEY_verify(ctx, der, (size_t)dlen, md, sizeof(md)) == 1 ? 1 : 0;
out:
	if (rc != 1)
		ERR_clear_error();	/* a refused token leaves nothing in this thread's queue */
	EVP_PKEY_CTX_free(ctx);
	OPENSSL_free(der);
	ECDSA_SIG_free(sig);
	return rc;
}

/* Appends base64url(JSON of `j`) to out[*n..outlen); returns 0, or -1 when it does not fit. */
static int append_part(json_t *j, char *out, size_t *n, size_t outlen)
{
	char *text = j ? json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
	int got = -1;

	if (text)
		got = auth_b64url_encode(text, strlen(text), out + *n, outlen - *n);
	free(text);
	if (got < 0)
		return -1;
	*n += (size_t)got;
	return 0;
}

enum kiln_err auth_jwt_sign(const struct auth_keyring *kr, const struct auth_token_params *p,
			    char **token, struct auth_claims *claims, struct kiln_error *err)
{
	char scope[AUTH_SCOPES_STR_MAX], jti[AUTH_ID_MAX];
	const char *kid = auth_keyring_active_kid(kr);
	const struct auth_key *k = keyring_find(kr, kid);
	unsigned char raw[ES256_SIG_LEN];
	enum kiln_err rc = KILN_OK;
	json_t *hdr = NULL, *pay = NULL;
	bool too_long = true;
	char *out = NULL;
	size_t n = 0;
	int64_t exp;

	*token = NULL;
	if (!k || !k->sign_ctx)
		return kiln_error_set(err, KILN_E_INTERNAL, "no active signing key");
	if (!param_ok(p->iss) || !param_ok(p->aud) || !param_ok(p->sub) || !param_ok(p->tid) ||
	    (p->sbx && !param_ok(p->sbx)))
		return kiln_error_set(err, KILN_E_INVALID, "token claims must be 1 to %d printable "
				      "characters", AUTH_CLAIM_MAX - 1);
	if (strcmp(p->aud, AUTH_AUD_NODE) == 0 && !p->sbx)
		return kiln_error_set(err, KILN_E_INVALID, "node tokens must name a sandbox");
	if (p->ttl_s < 1 || p->ttl_s > AUTH_JWT_TTL_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "token ttl must be 1 to %d seconds",
				      AUTH_JWT_TTL_MAX);
	if (p->now <= 0 || p->now > INT_CLAIM_MAX - AUTH_JWT_TTL_MAX)
		return kiln_error_set(err, KILN_E_INVALID, "token issue time out of range");
	if (auth_scopes_format(p->scopes, scope, sizeof(scope)) < 0)
		return kiln_error_set(err, KILN_E_INVALID, "unknown scope bits 0x%x", p->scopes);
	if (auth_new_id("jti_", jti, sizeof(jti)) != KILN_OK)
		return kiln_error_set(err, KILN_E_INTERNAL, "random generator failed");
	exp = p->now + p->ttl_s;

	hdr = json_pack("{s:s, s:s, s:s}", "alg", "ES256", "typ", "JWT", "kid", kid);
	pay = json_pack("{s:s, s:s, s:s, s:s, s:s, s:I, s:I, s:s}", "iss", p->iss, "aud", p->aud,
			"sub", p->sub, "tid", p->tid, "scope", scope, "iat", (json_int_t)p->now,
			"exp", (json_int_t)exp, "jti", jti);
	out = malloc(AUTH_JWT_MAX + 1);
	if (!hdr || !pay || !out || (p->sbx && json_object_set_new(pay, "sbx",
								    json_string(p->sbx)) != 0)) {
		rc = kiln_error_set(err, KILN_E_NOMEM, "out of memory making a token");
		goto cleanup;
	}
	/* header "." payload "." signature, within AUTH_JWT_MAX bytes. */
	if (append_part(hdr, out, &n, AUTH_JWT_MAX + 1) == 0) {
		out[n++] = '.';
		if (append_part(pay, out, &n, AUTH_JWT_MAX + 1) == 0 &&
		    n + 1 + SIG_B64_LEN <= AUTH_JWT_MAX)
			too_long = false;
	}
	if (too_long) {
		rc = kiln_error_set(err, KILN_E_INVALID, "token over %d bytes", AUTH_JWT_MAX);
		goto cleanup;
	}
	if (es256_sign(k, out, n, raw) != 0) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "signing the token failed");
		goto cleanup;
	}
	out[n++] = '.';
	if (auth_b64url_encode(raw, sizeof(raw), out + n, AUTH_JWT_MAX + 1 - n) != SIG_B64_LEN) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "signing the token failed");
		goto cleanup;
	}
	if (claims) {
		memset(claims, 0, sizeof(*claims));
		copy_claim(claims->iss, p->iss);
		copy_claim(claims->aud, p->aud);
		copy_claim(claims->sub, p->sub);
		copy_claim(claims->tid, p->tid);
		copy_claim(claims->jti, jti);
		copy_claim(claims->sbx, p->sbx);
		snprintf(claims->kid, sizeof(claims->kid), "%s", kid);
		claims->scopes = p->scopes;
		claims->iat = p->now;
		claims->exp = exp;
	}
	*token = out;
	out = NULL;
cleanup:
	free(out);
	json_decref(hdr);
	json_decref(pay);
	return rc;
}

/*
 * SHA-256 of a whole token, which names it in the caches of verified tokens. The digest is fetched
 * once: SHA256() looks it up in the provider store on every call, which cost more than hashing a
 * token's few hundred bytes.
 */
static EVP_MD *token_md;
static pthread_once_t token_md_once = PTHREAD_ONCE_INIT;

static void token_md_fetch(void)
{
	token_md = EVP_MD_fetch(NULL, "SHA256", NULL);
	ERR_clear_error();
}

/*
 * Writes the token's SHA-256 to `id`. Returns false when neither way of hashing worked (both can
 * fail to allocate): `id` is then all zeros and names no token, and must not be looked up.
 */
static bool token_id(const char *token, size_t len, unsigned char id[SHA256_DIGEST_LENGTH])
{
	memset(id, 0, SHA256_DIGEST_LENGTH);
	pthread_once(&token_md_once, token_md_fetch);
	if (token_md && EVP_Digest(token, len, id, NULL, token_md, NULL) == 1)
		return true;
	ERR_clear_error();
	if (SHA256((const unsigned char *)token, len, id))
		return true;
	ERR_clear_error();
	memset(id, 0, SHA256_DIGEST_LENGTH);
	return false;
}

/*
 * The claims a key of `kr` accepted the token named `id` with, if one did and its exp is after
 * `now`. Each key looks in its own cache (the token's kid is not known without decoding it), so a
 * key removed from the keyring takes its tokens with it.
 */
static bool cached_claims(const struct auth_keyring *kr,
			  const unsigned char id[SHA256_DIGEST_LENGTH], int64_t now,
			  struct auth_claims *out)
{
	for (size_t i = 0; i < kr->n; i++)
		if (keyring_cache_get(&kr->keys[i], id, now, out))
			return true;
	return false;
}

/* Records a refusal: sets *why, and the error message (first wins). */
static enum kiln_err refuse(enum auth_jwt_reason *why, enum auth_jwt_reason r,
			    struct kiln_error *err, const char *detail)
{
	if (why)
		*why = r;
	return kiln_error_set(err, KILN_E_UNAUTHENTICATED, "token refused: %s (%s)", detail,
			      auth_jwt_reason_name(r));
}

/* Decodes one base64url part into a JSON object, or NULL. */
static json_t *decode_part(const char *s, size_t n)
{
	char buf[PAYLOAD_B64_MAX];
	json_error_t jerr;
	json_t *j;
	int got;

	got = auth_b64url_decode(s, n, buf, sizeof(buf));
	if (got <= 0)
		return NULL;
	j = json_loadb(buf, (size_t)got, JSON_REJECT_DUPLICATES, &jerr);
	if (j && !json_is_object(j)) {
		json_decref(j);
		return NULL;
	}
	return j;
}

/*
 * Checks the header: exactly `alg: ES256`, a kid, and optionally `typ: JWT`; any other member
 * (crit, jku, jwk, x5u, ...) is refused. Copies the kid out.
 */
static enum auth_jwt_reason check_header(json_t *h, char kid[AUTH_KID_MAX], const char **detail)
{
	const char *name;
	json_t *v;

	v = json_object_get(h, "alg");
	if (!json_is_string(v) || strcmp(json_string_value(v), "ES256") != 0 ||
	    json_string_length(v) != 5) {
		*detail = "alg is not ES256";
		return AUTH_JWT_BAD_ALG;
	}
	json_object_foreach(h, name, v) {
		if (strcmp(name, "alg") == 0 || strcmp(name, "kid") == 0)
			continue;
		if (strcmp(name, "typ") == 0 && json_is_string(v) &&
		    strcmp(json_string_value(v), "JWT") == 0)
			continue;
		*detail = "header member not allowed";
		return AUTH_JWT_BAD_ALG;
	}
	v = json_object_get(h, "kid");
	if (!json_is_string(v) || json_string_length(v) == 0 ||
	    json_string_length(v) >= AUTH_KID_MAX || strlen(json_string_value(v)) != json_string_length(v)) {
		*detail = "header has no usable kid";
		return AUTH_JWT_MALFORMED;
	}
	memcpy(kid, json_string_value(v), json_string_length(v) + 1);
	return AUTH_JWT_OK;
}

static bool get_str(json_t *p, const char *name, bool required, char dst[AUTH_CLAIM_MAX])
{
	json_t *v = json_object_get(p, name);

	dst[0] = '\0';
	if (!v)
		return !required;
	if (!json_is_string(v) || !claim_str_ok(json_string_value(v), json_string_length(v)))
		return false;
	memcpy(dst, json_string_value(v), json_string_length(v) + 1);
	return true;
}

static bool get_time(json_t *p, const char *name, bool required, int64_t *dst)
{
	json_t *v = json_object_get(p, name);

	*dst = 0;
	if (!v)
		return !required;
	if (!json_is_integer(v) || json_integer_value(v) <= 0 ||
	    json_integer_value(v) > INT_CLAIM_MAX)
		return false;
	*dst = (int64_t)json_integer_value(v);
	return true;
}

/* Reads and type-checks the claims of a verified payload into `c`. */
static enum auth_jwt_reason read_claims(json_t *p, struct auth_claims *c, const char **detail)
{
	json_t *scope = json_object_get(p, "scope");

	*detail = "missing or malformed claim";
	if (!get_str(p, "iss", true, c->iss) || !get_str(p, "aud", true, c->aud) ||
	    !get_str(p, "sub", true, c->sub) || !get_str(p, "tid", true, c->tid) ||
	    !get_str(p, "jti", true, c->jti) || !get_str(p, "sbx", false, c->sbx) ||
	    !get_time(p, "iat", true, &c->iat) || !get_time(p, "exp", true, &c->exp) ||
	    !get_time(p, "nbf", false, &c->nbf))
		return AUTH_JWT_BAD_CLAIMS;
	if (!json_is_string(scope) ||
	    auth_scopes_parse(json_string_value(scope), json_string_length(scope), &c->scopes,
			      NULL) != KILN_OK) {
		*detail = "missing or malformed scope";
		return AUTH_JWT_BAD_CLAIMS;
	}
	if (c->exp <= c->iat) {
		*detail = "exp not after iat";
		return AUTH_JWT_BAD_CLAIMS;
	}
	return AUTH_JWT_OK;
}

static enum auth_jwt_reason check_claims(const struct auth_claims *c,
					 const struct auth_verify_opts *o, const char **detail)
{
	int64_t leeway = o->leeway_s > 0 ? o->leeway_s : 0;

	if (strcmp(c->aud, o->aud) != 0) {
		*detail = "wrong audience";
		return AUTH_JWT_WRONG_AUD;
	}
	if (o->iss && strcmp(c->iss, o->iss) != 0) {
		*detail = "wrong issuer";
		return AUTH_JWT_WRONG_ISS;
	}
	if (o->now >= c->exp) {
		*detail = "expired";
		return AUTH_JWT_EXPIRED;
	}
	if (c->iat > o->now + leeway || (c->nbf && c->nbf > o->now + leeway)) {
		*detail = "not valid yet";
		return AUTH_JWT_NOT_YET_VALID;
	}
	if (o->max_ttl_s > 0 && c->exp - c->iat > o->max_ttl_s) {
		*detail = "lifetime too long";
		return AUTH_JWT_TTL_TOO_LONG;
	}
	if (o->require_sbx && !c->sbx[0]) {
		*detail = "no sandbox claim";
		return AUTH_JWT_BAD_CLAIMS;
	}
	return AUTH_JWT_OK;
}

enum kiln_err auth_jwt_verify(const struct auth_keyring *kr, const char *token, size_t len,
			      const struct auth_verify_opts *opts, struct auth_claims *out,
			      enum auth_jwt_reason *why, struct kiln_error *err)
{
	unsigned char sig[ES256_SIG_LEN], id[SHA256_DIGEST_LENGTH];
	char kid[AUTH_KID_MAX] = {0};	/* copied whole into the claims */
	const char *dot1, *dot2, *detail = "";
	struct auth_claims c;
	size_t hl, pl, sl;
	const struct auth_key *k;
	json_t *hdr = NULL, *pay = NULL;
	enum auth_jwt_reason r;
	bool have_id;
	int ret;

	memset(&c, 0, sizeof(c));
	if (out)
		memset(out, 0, sizeof(*out));
	if (why)
		*why = AUTH_JWT_MALFORMED;
	if (!kr || !opts || !opts->aud)
		return kiln_error_set(err, KILN_E_INTERNAL, "token verification misconfigured");
	if (!token || len == 0)
		return refuse(why, AUTH_JWT_MALFORMED, err, "empty token");
	if (len > AUTH_JWT_MAX)
		return refuse(why, AUTH_JWT_TOO_LARGE, err, "token too long");

	/*
	 * These very bytes accepted before: what they say was checked then, what depends on the
	 * options and the time is checked now. A token that could not be hashed has no name to
	 * look up or to be remembered by: it is verified in full, and nothing else needs its hash.
	 */
	have_id = token_id(token, len, id);
	if (have_id && cached_claims(kr, id, opts->now, &c)) {
		r = check_claims(&c, opts, &detail);
		if (r != AUTH_JWT_OK)
			return refuse(why, r, err, detail);
		goto accepted;
	}
	/* A counter only (auth_jwt_cache_stats); the keyring is otherwise read-only here. */
	__atomic_fetch_add(&((struct auth_keyring *)kr)->decoded, 1, __ATOMIC_RELAXED);

	/* Three base64url parts separated by dots, each within its cap. */
	dot1 = memchr(token, '.', len);
	dot2 = dot1 ? memchr(dot1 + 1, '.', len - (size_t)(dot1 + 1 - token)) : NULL;
	if (!dot1 || !dot2 || memchr(dot2 + 1, '.', len - (size_t)(dot2 + 1 - token)))
		return refuse(why, AUTH_JWT_MALFORMED, err, "not three parts");
	hl = (size_t)(dot1 - token);
	pl = (size_t)(dot2 - dot1 - 1);
	sl = len - (size_t)(dot2 + 1 - token);
	if (hl > HEADER_B64_MAX || pl > PAYLOAD_B64_MAX)
		return refuse(why, AUTH_JWT_TOO_LARGE, err, "token part too long");
	if (hl == 0 || pl == 0 || !auth_is_b64url(token, hl) || !auth_is_b64url(dot1 + 1, pl) ||
	    !auth_is_b64url(dot2 + 1, sl))
		return refuse(why, AUTH_JWT_MALFORMED, err, "not base64url");

	/* The header decides nothing: anything but ES256 with a kid stops here. */
	hdr = decode_part(token, hl);
	if (!hdr)
		return refuse(why, AUTH_JWT_MALFORMED, err, "header is not a JSON object");
	r = check_header(hdr, kid, &detail);
	json_decref(hdr);
	if (r != AUTH_JWT_OK)
		return refuse(why, r, err, detail);
	if (sl != SIG_B64_LEN)
		return refuse(why, AUTH_JWT_BAD_SIGNATURE, err, "signature has the wrong length");
	k = keyring_find(kr, kid);
	if (!k)
		return refuse(why, AUTH_JWT_UNKNOWN_KID, err, "unknown kid");

	/* The signature, checked with the key parsed when it joined the keyring. */
	if (have_id)
		keyring_cache_miss(k, id);
	if (auth_b64url_decode(dot2 + 1, sl, sig, sizeof(sig)) != ES256_SIG_LEN)
		return refuse(why, AUTH_JWT_BAD_SIGNATURE, err, "signature is not base64url r||s");
	ret = es256_verify(k, token, hl + 1 + pl, sig);
	if (ret < 0)
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory verifying a token");
	if (ret != 1)
		return refuse(why, AUTH_JWT_BAD_SIGNATURE, err, "bad signature");

	/* The payload just verified, read with our own types. */
	pay = decode_part(dot1 + 1, pl);
	if (!pay)
		return refuse(why, AUTH_JWT_MALFORMED, err, "payload is not a JSON object");
	r = read_claims(pay, &c, &detail);
	json_decref(pay);
	if (r == AUTH_JWT_OK)
		r = check_claims(&c, opts, &detail);
	if (r != AUTH_JWT_OK)
		return refuse(why, r, err, detail);
	memcpy(c.kid, kid, sizeof(c.kid));
	if (have_id)
		keyring_cache_put(k, id, &c, opts->now);
accepted:
	if (out)
		*out = c;
	if (why)
		*why = AUTH_JWT_OK;
	return KILN_OK;
}
