/*
 * migrate.h - applies the embedded migrations to a database.
 *
 * Each migrations/NNNN_name.sql runs once, in order, in its own transaction, and is recorded in
 * schema_migrations with its SHA-256. A database whose recorded checksum differs from the file, or
 * which has migrations this code does not know (newer than the code), is refused. A session
 * advisory lock makes concurrent starts apply each file exactly once.
 */
#ifndef KILN_MIGRATE_H
#define KILN_MIGRATE_H

#include <stddef.h>

#include "common/err.h"
#include "common/pg.h"

struct migration {
	const char *name;	/* file name, e.g. 0001_init.sql */
	const char *sql;
	size_t len;
};

extern const struct migration migrations[];
extern const size_t migrations_count;

/*
 * Brings the database up to date with `list` (normally `migrations`). Returns KILN_OK with
 * *applied set to how many files ran now; KILN_E_CONFLICT when the database was changed (checksum)
 * or is newer than the code, KILN_E_UNAVAILABLE when Postgres is down; `err` says which file.
 */
enum kiln_err migrate_apply(struct pg *pool, const struct migration *list, size_t count,
			    int *applied, struct kiln_error *err);

#endif
