/*
 * masterkey.c - reads the master key from the settings or its file (see masterkey.h).
 */
#include "masterkey.h"

#include <stdio.h>
#include <string.h>

enum kiln_err masterkey_load(const struct kiln_config *cfg, struct auth_master_key *mk,
			     struct kiln_error *err)
{
	char text[256];
	size_t n = 0;
	enum kiln_err rc;
	FILE *f;

	if (cfg->master_key) {
		n = (size_t)snprintf(text, sizeof(text), "%s", cfg->master_key);
	} else if (cfg->master_key_file) {
		f = fopen(cfg->master_key_file, "r");
		if (!f)
			return kiln_error_set(err, KILN_E_INVALID,
					      "setting \"master_key_file\": cannot read \"%s\"",
					      cfg->master_key_file);
		n = fread(text, 1, sizeof(text) - 1, f);
		fclose(f);
		text[n] = '\0';
	} else {
		return kiln_error_set(err, KILN_E_INVALID,
				      "no master key: set \"master_key_file\" or KILN_MASTER_KEY");
	}
	if (n >= sizeof(text) - 1)
		n = sizeof(text) - 1;
	while (n && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' '))
		text[--n] = '\0';
	rc = auth_master_key_load(mk, text, n, err);
	memset(text, 0, sizeof(text));
	if (rc != KILN_OK) {
		kiln_error_clear(err);
		return kiln_error_set(err, KILN_E_INVALID,
				      "the master key is not 64 hex digits (or 32 bytes in base64)");
	}
	return KILN_OK;
}

bool masterkey_configured(const struct kiln_config *cfg)
{
	return cfg->master_key || cfg->master_key_file;
}
