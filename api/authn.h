/*
 * authn.h - who is calling: API keys and user JWTs, scopes, rate limits, idempotency, audit.
 *
 * gw_before() is the HTTP engine's before hook, gw_audit() its reply hook and gw_done() its done
 * hook. A suspended tenant's credentials get 403 `suspended`; rate limits hold per key and per
 * tenant (authn.c). A route's `scope`
 * field holds the AUTH_SCOPE_* bits it needs plus the ROUTE_* flags below; 0 means public.
 */
#ifndef KILN_AUTHN_H
#define KILN_AUTHN_H

#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "common/http.h"
#include "auth/apikey.h"
#include "auth/jwt.h"

#define ROUTE_AUTH (1u << 31)		/* needs a credential, even without a scope */
#define ROUTE_API_KEY_ONLY (1u << 30)	/* a JWT is not enough (POST /v1/tokens); gw_key_row() */
#define ROUTE_CREATES (1u << 29)	/* counts against the creation bucket; 503 without Redis */
#define ROUTE_SCOPE_MASK 0xffffu

struct principal {
	char tenant_id[AUTH_CLAIM_MAX];
	char key_id[AUTH_CLAIM_MAX];
	uint32_t scopes;
	bool via_jwt;
};

/* The authenticated caller of a request that passed gw_before(); NULL on public routes. */
const struct principal *gw_principal(const struct http_req *req);

/* The caller's API key's row in Postgres, as the Idempotency-Key claim read it. */
struct gw_key_row {
	bool read;		/* the claim read it */
	bool exists;		/* the key is the tenant's */
	bool live;		/* exists and not revoked */
	bool expires;		/* it has an expires_at */
	long long expires_s;	/* its expires_at, seconds since the epoch, rounded down */
};

/*
 * The row of the caller's API key as the claim of its Idempotency-Key read it in the same
 * statement (on a ROUTE_API_KEY_ONLY route, called with an Idempotency-Key), or NULL: the route
 * then reads the row itself. Fresh from Postgres, never from the key cache.
 */
const struct gw_key_row *gw_key_row(const struct http_req *req);

bool gw_before(struct http_req *req, const struct http_route *route);
#ifdef KILN_BENCH_NO_AUTH
/*
 * A bench-only build (CMake -DKILN_BENCH_NO_AUTH=ON): every request of a route that needs a
 * credential is taken as tenant KILN_BENCH_TENANT's, with every tenant scope (an admin route is
 * 403), without looking at any credential and without the suspension check, in-flight bound and
 * rate limits; the rest (the Idempotency-Key, the audit trail, the route itself) is as usual.
 * Whether the gateway may start: only with KILN_BENCH_NO_AUTH=accept-anyone and KILN_BENCH_TENANT
 * set (else false, err says why).
 */
bool gw_bench_no_auth_allowed(struct kiln_error *err);
#endif
/* The audit trail: every mutating request of a known caller, written before its reply goes out. */
void gw_audit(struct http_req *req, const struct http_route *route, int status);
void gw_done(struct http_req *req, const struct http_route *route, int status);

struct gateway;

/*
 * Checks a credential outside the API's routes (the ports listener, api/portproxy.c): `header`
 * is an Authorization value ("Bearer <key or token>"). Fills `who`; KILN_E_UNAUTHENTICATED,
 * KILN_E_SUSPENDED or KILN_E_UNAVAILABLE with `err` set otherwise. No rate limit is taken.
 */
enum kiln_err gw_authenticate(struct gateway *gw, const char *header, struct principal *who,
			      struct kiln_error *err);

struct credcache_stats;

/*
 * Entries of the API key and tenant caches (api/credcache.h: sets of CREDCACHE_WAYS, a lock per
 * set), so that thousands of keys and tenants in use stay cached together instead of evicting
 * each other, and a request waits only for another of the same set.
 */
#define GW_KEY_CACHE_ENTRIES 8192
#define GW_TENANT_CACHE_ENTRIES 8192

/* Makes the key and tenant caches (at the gateway's start); KILN_E_NOMEM with `err` set. */
enum kiln_err gw_authn_init(struct kiln_error *err);
/* Frees them (at its stop, after the HTTP server). */
void gw_authn_exit(void);
/* The counters of the key cache and of the tenant cache (api/credcache.h), for /metrics. */
void gw_authn_cache_stats(struct credcache_stats *keys, struct credcache_stats *tenants);

/* Forgets a key at once on this gateway (after revocation). */
void gw_key_cache_forget(const char *key_id);

/* Forgets the cached suspended state of a tenant at once on this gateway (after (un)suspending). */
void gw_tenant_cache_forget(const char *tenant_id);

/*
 * Tests only: authn.c reads these clocks through `ms_of(clock, ctx)` in place of
 * clock_ms_of(clock) (common/clock.h): CLOCK_MONOTONIC for the ages of the key and tenant caches'
 * entries and the cadence of last_used_at, CLOCK_REALTIME for API keys' expiry and the `now`
 * passed to the rate limits. So a test can step the wall clock or move the monotonic one. The
 * host's clocks stay in use for a JWT's times (time()), the Idempotency-Key wait's deadline and
 * ratelimit.c's own sync with Redis. Set before any request; NULL restores the host's clocks.
 */
void gw_authn_set_clock_for_test(long long (*ms_of)(clockid_t clock, void *ctx), void *ctx);

struct gateway;

/*
 * Deletes the Idempotency-Key records older than idempotency_ttl_s, SWEEP_BATCH rows per
 * statement and at most SWEEP_BATCHES_MAX statements (the next sweep deletes the rest); sets
 * *deleted to how many went.
 */
enum kiln_err gw_idempotency_sweep(struct gateway *gw, long long *deleted, struct kiln_error *err);

/* The API key pepper, derived from the master key at start, and it prepared for checks. */
extern unsigned char gw_pepper[32];
extern struct auth_apikey_pepper *gw_pepper_prepared;

#endif
