/*
 * keyring_priv.h - the keyring's insides, shared by keyring.c, jwt.c and jwks.c only. Nothing
 * outside auth/ includes this file.
 */
#ifndef KILN_AUTH_KEYRING_PRIV_H
#define KILN_AUTH_KEYRING_PRIV_H

#include <openssl/evp.h>

#include "auth/keyring.h"

#define AUTH_EC_COORD_LEN 32	/* bytes of a P-256 coordinate */

struct auth_key {
	char kid[AUTH_KID_MAX];
	EVP_PKEY *pkey;
	char *public_pem;	/* as libjwt wants it for verifying */
	size_t public_len;
	char *private_pem;	/* NULL for a verify-only key; wiped on free */
	size_t private_len;
};

struct auth_keyring {
	struct auth_key keys[AUTH_KEYRING_MAX];
	size_t n;
	int active;		/* index of the signer, -1 when none */
};

/* The key named `kid`, or NULL. */
const struct auth_key *keyring_find(const struct auth_keyring *kr, const char *kid);

/* Writes a P-256 key's affine coordinates. Returns 0, or -1 when `pkey` is not a P-256 key. */
int keyring_ec_xy(EVP_PKEY *pkey, unsigned char x[AUTH_EC_COORD_LEN],
		  unsigned char y[AUTH_EC_COORD_LEN]);

/* Writes the RFC 7638 thumbprint of a P-256 key to `kid`. Returns 0 or -1. */
int keyring_thumbprint(EVP_PKEY *pkey, char kid[AUTH_KID_MAX]);

/*
 * Adds `pkey` to the keyring, taking ownership of it whatever the outcome. `has_private` says
 * whether it holds the private half. Returns as auth_keyring_add_private_pem.
 */
enum kiln_err keyring_add_pkey(struct auth_keyring *kr, EVP_PKEY *pkey, bool has_private,
			       char kid[AUTH_KID_MAX], struct kiln_error *err);

#endif
