/*
 * masterkey.h - the master key (docs/storage.md), read the same way by every
 * process that needs it (kiln-gateway, kiln-node, kiln-meter): the `master_key` setting
 * (KILN_MASTER_KEY) or the file named by `master_key_file`.
 */
#ifndef KILN_MASTERKEY_H
#define KILN_MASTERKEY_H

#include <stdbool.h>

#include "auth/crypto.h"
#include "common/config.h"
#include "common/err.h"

/* Loads the master key; KILN_E_INVALID naming the setting when it is missing or malformed. */
enum kiln_err masterkey_load(const struct kiln_config *cfg, struct auth_master_key *mk,
			     struct kiln_error *err);

/*
 * Whether the settings name a master key at all (`master_key` or `master_key_file`), for the
 * processes that can run without one (kiln-node keeps snapshots local, kiln-meter pauses nothing).
 */
bool masterkey_configured(const struct kiln_config *cfg);

#endif
