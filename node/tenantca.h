/*
 * tenantca.h - a tenant's own certificate authority, which signs the short-lived certificates the
 * injecting proxy (inject.h) shows a sandbox for the hosts it holds secrets for (docs/network-policy.md,
 * "Secrets").
 *
 * One CA per tenant, made on first use: an EC P-256 key and a self-signed certificate
 * (basicConstraints CA:TRUE, pathlen:0; keyUsage keyCertSign, cRLSign). Postgres keeps its
 * certificate in clear and its private key sealed with the master key (auth_seal, associated data
 * TENANTCA_AD_PREFIX + tenant id: a sealed key copied to another tenant's row does not open), in
 * table tenant_ca (migrations/0017_secrets.sql). Only kiln-node opens it, into its own memory; the
 * guest gets the certificate alone.
 *
 * Leaf certificates are minted per host, valid TENANTCA_LEAF_HOURS, and kept in the CA's memory
 * cache (re-minted once half their life has gone).
 */
#ifndef KILN_TENANTCA_H
#define KILN_TENANTCA_H

#include <openssl/ssl.h>

#include "auth/crypto.h"
#include "common/err.h"
#include "common/pg.h"

#define TENANTCA_AD_PREFIX "tenant-ca:"
#define TENANTCA_LEAF_HOURS 24		/* life of a leaf certificate */
#define TENANTCA_LEAF_CACHE 64		/* leaves kept per CA; the oldest goes first */
#define TENANTCA_HOST_MAX 253

struct tenant_ca;

/*
 * Makes a new CA for `tenant_id`: `*cert_pem` (the certificate) and `*key_pem` (its private key,
 * PKCS#8), both NUL-terminated, which the caller frees (the key with auth_secret_free(p, strlen(p))).
 */
enum kiln_err tenantca_generate(const char *tenant_id, char **cert_pem, char **key_pem,
				struct kiln_error *err);

/* A CA from its PEM texts (one reference, released with tenantca_put). KILN_E_INVALID if malformed. */
enum kiln_err tenantca_from_pem(const char *tenant_id, const char *cert_pem, const char *key_pem,
				struct tenant_ca **out, struct kiln_error *err);

/*
 * The tenant's CA from Postgres, made and stored first when the tenant has none (two nodes making
 * one at once keep the first stored). KILN_E_UNAVAILABLE when Postgres is down; KILN_E_INTERNAL
 * when the sealed key does not open with `mk`.
 */
enum kiln_err tenantca_load(struct pg_conn *c, const struct auth_master_key *mk,
			    const char *tenant_id, struct tenant_ca **out, struct kiln_error *err);

void tenantca_get(struct tenant_ca *ca);
/* Drops a reference; the last one wipes the key and the leaves. Accepts NULL. */
void tenantca_put(struct tenant_ca *ca);

const char *tenantca_tenant(const struct tenant_ca *ca);
/* The CA's certificate, PEM, as the guest's bundle gets it; valid while the reference is held. */
const char *tenantca_cert_pem(const struct tenant_ca *ca);

/*
 * A server SSL_CTX presenting a leaf certificate for `host` (DNS name, lowercase) signed by the
 * CA, with the CA's certificate as its chain, TLS 1.2 or later; from the cache when one has more
 * than half its life left. The caller owns one reference (SSL_CTX_free).
 */
SSL_CTX *tenantca_leaf_ctx(struct tenant_ca *ca, const char *host, struct kiln_error *err);

#endif
