/*
 * signing.h - the gateway's JWT signing keys, shared through Postgres by every gateway.
 *
 * Private keys are stored sealed with the master key (signing_keys table). At start a gateway
 * makes the first key if there is none; the newest key that is not retired signs, older ones
 * verify until their tokens have expired. Every gateway reloads the keys periodically and when a
 * token names a kid it does not know, so a rotation on one reaches all without downtime.
 */
#ifndef KILN_SIGNING_H
#define KILN_SIGNING_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "auth/crypto.h"
#include "auth/jwt.h"
#include "common/err.h"
#include "common/pg.h"

/* Seconds a retired key keeps verifying: longer than any token the gateway issues. */
#define SIGNING_RETIRED_KEEP_S 3600
/*
 * Seconds between periodic reloads of the keys, so a rotation reaches every gateway; on the
 * monotonic clock (signing_start_refresh).
 */
#define SIGNING_REFRESH_S 5

struct signing;

/* Loads the keys (creating the first one if the database has none). NULL with `err` set. */
struct signing *signing_new(struct pg *pg, const struct auth_master_key *mk, struct kiln_error *err);
void signing_free(struct signing *s);

/*
 * Starts a thread that reloads the keys every SIGNING_REFRESH_S; until then, and in a
 * process that never calls it, the first request past that period reloads them inline. Stopped
 * by signing_free(). The period, like the once-a-second bound below, is measured on the
 * monotonic clock: a step of the wall clock neither stops the reloads nor brings one early.
 */
enum kiln_err signing_start_refresh(struct signing *s, struct kiln_error *err);

/*
 * Re-reads the keys from Postgres; at most once a second when `on_unknown_kid`. The keys are
 * opened and parsed into a new keyring only when their rows changed since the keyring in use was
 * built (a hash of the rows read in the one query compares them).
 */
enum kiln_err signing_reload(struct signing *s, bool on_unknown_kid, struct kiln_error *err);

/*
 * How many keyrings were built of the stored keys (each opened and parsed): at signing_new(),
 * then by each reload that found their rows changed; a build that failed is not counted. For
 * tests and metrics.
 */
uint64_t signing_keyrings_built(struct signing *s);

/*
 * Tests only: `s` reads its clocks through `ms_of(clock, ctx)` in place of clock_ms_of(clock)
 * (common/clock.h), so a test can step the wall clock or move the monotonic one. Set before
 * signing_start_refresh(); NULL restores the host's clocks. The period and the bound of unknown
 * kids' reloads start again at the new clocks' now (the times kept were read on the old ones).
 */
void signing_set_clock_for_test(struct signing *s, long long (*ms_of)(clockid_t clock, void *ctx),
				void *ctx);

/* Signs a token with the active key; *token is the caller's to free(). */
enum kiln_err signing_sign(struct signing *s, const struct auth_token_params *p, char **token,
			   struct auth_claims *claims, struct kiln_error *err);

/* Verifies a token (reloading once on an unknown kid). */
enum kiln_err signing_verify(struct signing *s, const char *token, size_t len,
			     const struct auth_verify_opts *opts, struct auth_claims *out,
			     enum auth_jwt_reason *why, struct kiln_error *err);

/* The JWKS document of every key that verifies; the caller frees it. */
char *signing_jwks(struct signing *s, struct kiln_error *err);

/*
 * Makes a new signing key and retires every older one (they keep verifying for
 * SIGNING_RETIRED_KEEP_S). Used by `kiln-gateway --rotate-signing-key`.
 */
enum kiln_err signing_rotate(struct pg *pg, const struct auth_master_key *mk, char *new_kid,
			     struct kiln_error *err);

#endif
