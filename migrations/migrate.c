/*
 * migrate.c - the migration runner (see migrate.h).
 */
#include "migrate.h"

#include <openssl/evp.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"

/* Any constant works as long as every Kiln process uses the same one. */
#define MIGRATE_LOCK_KEY "7310245601"

static void sha256_hex(const char *data, size_t len, char out[65])
{
	unsigned char md[32];
	unsigned int mdlen = 0;

	EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL);
	for (unsigned i = 0; i < 32; i++)
		snprintf(out + 2 * i, 3, "%02x", md[i]);
}

/* Checks what is recorded against `list`; sets *done[i] for files already applied. */
static enum kiln_err migrate_check(struct pg_conn *c, const struct migration *list, size_t count,
				   unsigned char *done, struct kiln_error *err)
{
	struct pg_res *res;
	enum kiln_err rc = PGQ0(c, &res, err, "SELECT name, sha256 FROM schema_migrations ORDER BY name");

	if (rc != KILN_OK)
		return rc;
	for (int r = 0; rc == KILN_OK && r < pg_res_rows(res); r++) {
		const char *name = pg_res_str(res, r, 0), *sum = pg_res_str(res, r, 1);
		size_t i;
		char want[65];

		for (i = 0; i < count && strcmp(list[i].name, name) != 0; i++)
			;
		if (i == count) {
			rc = kiln_error_set(err, KILN_E_CONFLICT,
					    "database has migration \"%s\" that this code does not "
					    "know: the database is newer than the code",
					    name);
			break;
		}
		sha256_hex(list[i].sql, list[i].len, want);
		if (strcmp(want, sum) != 0)
			rc = kiln_error_set(err, KILN_E_CONFLICT,
					    "migration \"%s\" was changed after it was applied "
					    "(checksum %.12s… recorded, %.12s… in the code)",
					    name, sum, want);
		done[i] = 1;
	}
	pg_res_free(res);
	return rc;
}

enum kiln_err migrate_apply(struct pg *pool, const struct migration *list, size_t count,
			    int *applied, struct kiln_error *err)
{
	struct pg_conn *c;
	unsigned char done[1024] = { 0 };
	enum kiln_err rc;

	*applied = 0;
	if (count > sizeof(done))
		return kiln_error_set(err, KILN_E_INTERNAL, "too many migrations");
	rc = pg_acquire(pool, &c, err);
	if (rc != KILN_OK)
		return rc;
	rc = PGQ0(c, NULL, err, "SELECT pg_advisory_lock(" MIGRATE_LOCK_KEY ")");
	if (rc != KILN_OK)
		goto release;
	rc = pg_exec(c,
		     "CREATE TABLE IF NOT EXISTS schema_migrations ("
		     " name text PRIMARY KEY, sha256 text NOT NULL,"
		     " applied_at timestamptz NOT NULL DEFAULT now())",
		     err);
	if (rc == KILN_OK)
		rc = migrate_check(c, list, count, done, err);
	for (size_t i = 0; rc == KILN_OK && i < count; i++) {
		char sum[65];

		if (done[i])
			continue;
		sha256_hex(list[i].sql, list[i].len, sum);
		log_info("applying migration \"%s\"", list[i].name);
		rc = pg_exec(c, "BEGIN", err);
		if (rc == KILN_OK)
			rc = pg_exec(c, list[i].sql, err);
		if (rc == KILN_OK)
			rc = PGQ(c, NULL, err,
				 "INSERT INTO schema_migrations (name, sha256) VALUES ($1, $2)",
				 list[i].name, sum);
		if (rc == KILN_OK)
			rc = pg_exec(c, "COMMIT", err);
		if (rc != KILN_OK) {
			struct kiln_error ignore = { 0 };
			pg_exec(c, "ROLLBACK", &ignore);
			kiln_error_clear(err);
			rc = kiln_error_set(err, rc, "migration \"%s\" failed", list[i].name);
			break;
		}
		(*applied)++;
	}
	{
		struct kiln_error ignore = { 0 };
		PGQ0(c, NULL, &ignore, "SELECT pg_advisory_unlock(" MIGRATE_LOCK_KEY ")");
	}
release:
	pg_release(pool, c);
	return rc;
}
