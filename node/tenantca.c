/*
 * tenantca.c - a tenant's certificate authority and its leaf certificates (see tenantca.h).
 */
#include <ctype.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509v3.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "auth/crypto.h"
#include "node/tenantca.h"

#define CA_YEARS 10

struct leaf {
	char host[TENANTCA_HOST_MAX + 1];
	SSL_CTX *ctx;
	time_t minted;
};

struct tenant_ca {
	pthread_mutex_t lock;	/* the leaves and refs */
	int refs;
	char tenant[128];
	char *cert_pem;
	X509 *cert;
	EVP_PKEY *key;
	struct leaf leaves[TENANTCA_LEAF_CACHE];
	size_t nleaves;
};

/* A random positive 127-bit serial number. */
static int set_serial(X509 *x)
{
	unsigned char b[16];
	BIGNUM *bn;
	int ok;

	if (RAND_bytes(b, sizeof(b)) != 1)
		return 0;
	b[0] &= 0x7f;
	bn = BN_bin2bn(b, sizeof(b), NULL);
	ok = bn && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) != NULL;
	BN_free(bn);
	return ok;
}

static int add_ext(X509 *x, X509 *issuer, int nid, const char *value)
{
	X509V3_CTX v3;
	X509_EXTENSION *ext;
	int ok;

	X509V3_set_ctx_nodb(&v3);
	X509V3_set_ctx(&v3, issuer, x, NULL, NULL, 0);
	ext = X509V3_EXT_conf_nid(NULL, &v3, nid, value);
	if (!ext)
		return 0;
	ok = X509_add_ext(x, ext, -1);
	X509_EXTENSION_free(ext);
	return ok;
}

/* A PEM text of `x` or `key` (exactly one non-NULL), NUL-terminated, malloc'd. */
static char *to_pem(X509 *x, EVP_PKEY *key)
{
	BIO *b = BIO_new(BIO_s_secmem());
	char *data, *out = NULL;
	long len;

	if (!b)
		return NULL;
	if (x ? PEM_write_bio_X509(b, x) : PEM_write_bio_PrivateKey(b, key, NULL, NULL, 0, NULL,
								      NULL)) {
		len = BIO_get_mem_data(b, &data);
		out = len > 0 ? malloc((size_t)len + 1) : NULL;
		if (out) {
			memcpy(out, data, (size_t)len);
			out[len] = '\0';
		}
	}
	BIO_free(b);
	return out;
}

enum kiln_err tenantca_generate(const char *tenant_id, char **cert_pem, char **key_pem,
				struct kiln_error *err)
{
	EVP_PKEY *key = EVP_EC_gen("P-256");
	X509 *x = X509_new();
	X509_NAME *name;
	char cn[160];
	enum kiln_err rc = KILN_E_INTERNAL;

	*cert_pem = *key_pem = NULL;
	snprintf(cn, sizeof(cn), "Kiln sandbox CA %.100s", tenant_id);
	if (!key || !x || !X509_set_version(x, 2) || !set_serial(x))
		goto out;
	name = X509_get_subject_name(x);
	if (!X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8, (const unsigned char *)"Kiln", -1,
					-1, 0) ||
	    !X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8, (const unsigned char *)cn, -1,
					-1, 0) ||
	    !X509_set_issuer_name(x, name) || !X509_gmtime_adj(X509_getm_notBefore(x), -3600) ||
	    !X509_gmtime_adj(X509_getm_notAfter(x), (long)CA_YEARS * 365 * 86400) ||
	    !X509_set_pubkey(x, key) ||
	    !add_ext(x, x, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") ||
	    !add_ext(x, x, NID_key_usage, "critical,keyCertSign,cRLSign") ||
	    !add_ext(x, x, NID_subject_key_identifier, "hash") ||
	    !X509_sign(x, key, EVP_sha256()))
		goto out;
	*cert_pem = to_pem(x, NULL);
	*key_pem = to_pem(NULL, key);
	if (*cert_pem && *key_pem)
		rc = KILN_OK;
out:
	if (rc != KILN_OK) {
		free(*cert_pem);
		if (*key_pem)
			auth_secret_free(*key_pem, strlen(*key_pem));
		*cert_pem = *key_pem = NULL;
		kiln_error_set(err, rc, "cannot make the CA of tenant \"%s\"", tenant_id);
	}
	X509_free(x);
	EVP_PKEY_free(key);
	return rc;
}

enum kiln_err tenantca_from_pem(const char *tenant_id, const char *cert_pem, const char *key_pem,
				struct tenant_ca **out, struct kiln_error *err)
{
	struct tenant_ca *ca = calloc(1, sizeof(*ca));
	BIO *cb = BIO_new_mem_buf(cert_pem, -1), *kb = BIO_new_mem_buf(key_pem, -1);

	*out = NULL;
	if (!ca || !cb || !kb) {
		free(ca);
		BIO_free(cb);
		BIO_free(kb);
		return kiln_error_set(err, KILN_E_NOMEM, "out of memory");
	}
	pthread_mutex_init(&ca->lock, NULL);
	ca->refs = 1;
	snprintf(ca->tenant, sizeof(ca->tenant), "%s", tenant_id);
	ca->cert = PEM_read_bio_X509(cb, NULL, NULL, NULL);
	ca->key = PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL);
	ca->cert_pem = strdup(cert_pem);
	BIO_free(cb);
	BIO_free(kb);
	if (!ca->cert || !ca->key || !ca->cert_pem || X509_check_private_key(ca->cert, ca->key) != 1) {
		ERR_clear_error();
		tenantca_put(ca);
		return kiln_error_set(err, KILN_E_INVALID, "the CA of tenant \"%s\" is malformed",
				      tenant_id);
	}
	*out = ca;
	return KILN_OK;
}

/* Reads the tenant's row: KILN_E_NOT_FOUND when it has none. */
static enum kiln_err ca_read(struct pg_conn *c, const struct auth_master_key *mk,
			     const char *tenant_id, const char *ad, struct tenant_ca **out,
			     struct kiln_error *err)
{
	struct pg_res *res = NULL;
	unsigned char *key = NULL;
	size_t klen = 0;
	const char *sealed;
	struct kiln_error e = { 0 };
	enum kiln_err rc = PGQ(c, &res, err,
			       "SELECT cert_pem, key_sealed FROM tenant_ca WHERE tenant_id = $1",
			       tenant_id);

	if (rc != KILN_OK)
		return rc;
	if (pg_res_rows(res) != 1) {
		pg_res_free(res);
		return KILN_E_NOT_FOUND;
	}
	sealed = pg_res_str(res, 0, 1);
	if (auth_open(mk, sealed, strlen(sealed), ad, strlen(ad), &key, &klen, &e) != KILN_OK)
		rc = kiln_error_set(err, KILN_E_INTERNAL,
				    "the CA key of tenant \"%s\" does not open with this master key",
				    tenant_id);
	else
		rc = tenantca_from_pem(tenant_id, pg_res_str(res, 0, 0), (const char *)key, out, err);
	auth_secret_free(key, klen);
	pg_res_free(res);
	return rc;
}

enum kiln_err tenantca_load(struct pg_conn *c, const struct auth_master_key *mk,
			    const char *tenant_id, struct tenant_ca **out, struct kiln_error *err)
{
	char ad[200], *cert = NULL, *key = NULL, *sealed = NULL;
	enum kiln_err rc;

	*out = NULL;
	if (snprintf(ad, sizeof(ad), "%s%s", TENANTCA_AD_PREFIX, tenant_id) >= (int)sizeof(ad))
		return kiln_error_set(err, KILN_E_INVALID, "tenant id too long");
	rc = ca_read(c, mk, tenant_id, ad, out, err);
	if (rc != KILN_E_NOT_FOUND)
		return rc;
	rc = tenantca_generate(tenant_id, &cert, &key, err);
	if (rc == KILN_OK)
		rc = auth_seal(mk, key, strlen(key), ad, strlen(ad), &sealed, err);
	if (rc == KILN_OK)
		rc = PGQ(c, NULL, err,
			 "INSERT INTO tenant_ca (tenant_id, cert_pem, key_sealed) VALUES ($1, $2, $3) "
			 "ON CONFLICT (tenant_id) DO NOTHING",
			 tenant_id, cert, sealed);
	free(cert);
	free(sealed);
	if (key)
		auth_secret_free(key, strlen(key));
	if (rc != KILN_OK)
		return rc;
	/* the stored one, ours or another node's made at the same time */
	rc = ca_read(c, mk, tenant_id, ad, out, err);
	return rc == KILN_E_NOT_FOUND
		       ? kiln_error_set(err, KILN_E_INTERNAL, "the CA of \"%s\" vanished", tenant_id)
		       : rc;
}

void tenantca_get(struct tenant_ca *ca)
{
	pthread_mutex_lock(&ca->lock);
	ca->refs++;
	pthread_mutex_unlock(&ca->lock);
}

void tenantca_put(struct tenant_ca *ca)
{
	int left;

	if (!ca)
		return;
	pthread_mutex_lock(&ca->lock);
	left = --ca->refs;
	pthread_mutex_unlock(&ca->lock);
	if (left > 0)
		return;
	for (size_t i = 0; i < ca->nleaves; i++)
		SSL_CTX_free(ca->leaves[i].ctx);
	X509_free(ca->cert);
	EVP_PKEY_free(ca->key);	/* OpenSSL clears the key's memory as it frees it */
	free(ca->cert_pem);
	pthread_mutex_destroy(&ca->lock);
	free(ca);
}

const char *tenantca_tenant(const struct tenant_ca *ca)
{
	return ca->tenant;
}

const char *tenantca_cert_pem(const struct tenant_ca *ca)
{
	return ca->cert_pem;
}

/* Offers HTTP/1.1 alone: a client that offers only h2 gets no ALPN answer. */
static int alpn_select(SSL *ssl, const unsigned char **out, unsigned char *outlen,
		       const unsigned char *in, unsigned int inlen, void *arg)
{
	static const unsigned char h1[] = "\x08http/1.1";
	unsigned char *sel = NULL;

	(void)ssl;
	(void)arg;
	if (SSL_select_next_proto(&sel, outlen, h1, sizeof(h1) - 1, in, inlen) !=
	    OPENSSL_NPN_NEGOTIATED)
		return SSL_TLSEXT_ERR_NOACK;
	*out = sel;
	return SSL_TLSEXT_ERR_OK;
}

/* A new server context with a fresh leaf for `host`. */
static SSL_CTX *leaf_mint(struct tenant_ca *ca, const char *host)
{
	EVP_PKEY *key = EVP_EC_gen("P-256");
	X509 *x = X509_new();
	SSL_CTX *ctx = NULL;
	char san[TENANTCA_HOST_MAX + 8];
	bool ok;

	snprintf(san, sizeof(san), "DNS:%s", host);
	ok = key && x && X509_set_version(x, 2) && set_serial(x) &&
	     X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_UTF8,
					(const unsigned char *)host, -1, -1, 0) &&
	     X509_set_issuer_name(x, X509_get_subject_name(ca->cert)) &&
	     X509_gmtime_adj(X509_getm_notBefore(x), -3600) &&
	     X509_gmtime_adj(X509_getm_notAfter(x), (long)TENANTCA_LEAF_HOURS * 3600) &&
	     X509_set_pubkey(x, key) && add_ext(x, ca->cert, NID_basic_constraints, "critical,CA:FALSE") &&
	     add_ext(x, ca->cert, NID_key_usage, "critical,digitalSignature") &&
	     add_ext(x, ca->cert, NID_ext_key_usage, "serverAuth") &&
	     add_ext(x, ca->cert, NID_subject_alt_name, san) &&
	     add_ext(x, ca->cert, NID_authority_key_identifier, "keyid:always") &&
	     X509_sign(x, ca->key, EVP_sha256());
	if (ok)
		ctx = SSL_CTX_new(TLS_server_method());
	ok = ctx && SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) &&
	     SSL_CTX_use_certificate(ctx, x) == 1 && SSL_CTX_use_PrivateKey(ctx, key) == 1 &&
	     SSL_CTX_add1_chain_cert(ctx, ca->cert) == 1;
	if (ok) {
		SSL_CTX_set_alpn_select_cb(ctx, alpn_select, NULL);
		SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_NO_COMPRESSION);
		SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
		SSL_CTX_set_num_tickets(ctx, 0);
	} else {
		SSL_CTX_free(ctx);
		ctx = NULL;
		ERR_clear_error();
	}
	X509_free(x);
	EVP_PKEY_free(key);
	return ctx;
}

SSL_CTX *tenantca_leaf_ctx(struct tenant_ca *ca, const char *host, struct kiln_error *err)
{
	time_t now = time(NULL);
	SSL_CTX *ctx = NULL;
	size_t i, oldest = 0;

	if (!host[0] || strlen(host) > TENANTCA_HOST_MAX) {
		kiln_error_set(err, KILN_E_INVALID, "host name empty or too long");
		return NULL;
	}
	for (const char *p = host; *p; p++)
		if (!islower((unsigned char)*p) && !isdigit((unsigned char)*p) && *p != '-' &&
		    *p != '.') {
			/* a DNS name only: nothing the extension syntax (commas, colons) would read */
			kiln_error_set(err, KILN_E_INVALID, "not a host name");
			return NULL;
		}
	pthread_mutex_lock(&ca->lock);
	for (i = 0; i < ca->nleaves; i++) {
		if (strcmp(ca->leaves[i].host, host) == 0)
			break;
		if (ca->leaves[i].minted < ca->leaves[oldest].minted)
			oldest = i;
	}
	if (i < ca->nleaves && now - ca->leaves[i].minted < TENANTCA_LEAF_HOURS * 3600 / 2) {
		ctx = ca->leaves[i].ctx;
		SSL_CTX_up_ref(ctx);
		goto out;
	}
	ctx = leaf_mint(ca, host);
	if (!ctx) {
		kiln_error_set(err, KILN_E_INTERNAL, "cannot mint a certificate for \"%s\"", host);
		goto out;
	}
	if (i == ca->nleaves && ca->nleaves < TENANTCA_LEAF_CACHE)
		ca->nleaves++;
	else if (i == ca->nleaves)
		i = oldest;
	if (i < ca->nleaves && ca->leaves[i].ctx)
		SSL_CTX_free(ca->leaves[i].ctx);
	snprintf(ca->leaves[i].host, sizeof(ca->leaves[i].host), "%s", host);
	ca->leaves[i].ctx = ctx;
	ca->leaves[i].minted = now;
	SSL_CTX_up_ref(ctx);
out:
	pthread_mutex_unlock(&ca->lock);
	return ctx;
}
