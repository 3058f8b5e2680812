/*
 * storage.c - load and save a tenant's snapshot bucket (see storage.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth/storage.h"

/* The associated data of a tenant's sealed secret. */
static int storage_ad(const char *tenant_id, char *out, size_t n)
{
	int len = snprintf(out, n, "%s%s", STORAGE_AD_PREFIX, tenant_id);

	return len < 0 || (size_t)len >= n ? -1 : len;
}

static bool copy_field(char *dst, size_t n, const char *src)
{
	size_t len = src ? strlen(src) : 0;

	if (!src || len >= n)
		return false;
	memcpy(dst, src, len + 1);
	return true;
}

enum kiln_err storage_load(struct pg_conn *c, const struct auth_master_key *mk,
			   const char *tenant_id, struct s3_target *out, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	unsigned char *secret = NULL;
	size_t slen = 0;
	char ad[320];
	int adlen = storage_ad(tenant_id, ad, sizeof(ad));
	struct kiln_error e = { 0 };
	enum kiln_err rc;
	const char *sealed;

	memset(out, 0, sizeof(*out));
	if (adlen < 0)
		return kiln_error_set(err, KILN_E_INVALID, "tenant id too long");
	rc = PGQ(c, &res, err,
		 "SELECT kind, endpoint, bucket, region, prefix, access_key_id, secret_sealed "
		 "FROM tenant_storage WHERE tenant_id = $1",
		 tenant_id);
	if (rc != KILN_OK)
		return rc;
	if (pg_res_rows(res) == 0) {
		pg_res_free(res);
		return kiln_error_set(err, KILN_E_NOT_FOUND, "tenant \"%s\" has no storage bucket",
				      tenant_id);
	}
	if (strcmp(pg_res_str(res, 0, 0), "s3") != 0 ||
	    !copy_field(out->endpoint, sizeof(out->endpoint), pg_res_get(res, 0, 1)) ||
	    !copy_field(out->bucket, sizeof(out->bucket), pg_res_get(res, 0, 2)) ||
	    !copy_field(out->region, sizeof(out->region), pg_res_get(res, 0, 3)) ||
	    !copy_field(out->prefix, sizeof(out->prefix), pg_res_get(res, 0, 4)) ||
	    !copy_field(out->access_key_id, sizeof(out->access_key_id), pg_res_get(res, 0, 5))) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "storage setting of \"%s\" is malformed",
				    tenant_id);
		goto out;
	}
	sealed = pg_res_str(res, 0, 6);
	if (auth_open(mk, sealed, strlen(sealed), ad, (size_t)adlen, &secret, &slen, &e) !=
	    KILN_OK) {
		rc = kiln_error_set(err, KILN_E_INTERNAL,
				    "storage secret of \"%s\" does not open with this master key",
				    tenant_id);
		goto out;
	}
	if (slen >= sizeof(out->secret_access_key)) {
		rc = kiln_error_set(err, KILN_E_INTERNAL, "storage secret of \"%s\" is too long",
				    tenant_id);
		goto out;
	}
	memcpy(out->secret_access_key, secret, slen);
	out->secret_access_key[slen] = '\0';
out:
	auth_secret_free(secret, slen);
	pg_res_free(res);
	if (rc != KILN_OK)
		s3_target_wipe(out);
	return rc;
}

enum kiln_err storage_save(struct pg_conn *c, const struct auth_master_key *mk,
			   const char *tenant_id, const struct s3_target *t,
			   struct kiln_error *err)
{
	char ad[320], *sealed = NULL;
	int adlen = storage_ad(tenant_id, ad, sizeof(ad));
	enum kiln_err rc;

	if (adlen < 0)
		return kiln_error_set(err, KILN_E_INVALID, "tenant id too long");
	rc = auth_seal(mk, t->secret_access_key, strlen(t->secret_access_key), ad, (size_t)adlen,
		       &sealed, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ(c, NULL, err,
		 "INSERT INTO tenant_storage (tenant_id, kind, endpoint, bucket, region, prefix, "
		 "access_key_id, secret_sealed) VALUES ($1, 's3', $2, $3, $4, $5, $6, $7) "
		 "ON CONFLICT (tenant_id) DO UPDATE SET kind = EXCLUDED.kind, "
		 "endpoint = EXCLUDED.endpoint, bucket = EXCLUDED.bucket, region = EXCLUDED.region, "
		 "prefix = EXCLUDED.prefix, access_key_id = EXCLUDED.access_key_id, "
		 "secret_sealed = EXCLUDED.secret_sealed, updated_at = now()",
		 tenant_id, t->endpoint, t->bucket, t->region, t->prefix, t->access_key_id, sealed);
	free(sealed);
	return rc;
}
