/*
 * meterdb.h - the metering unit tests' fixtures on the scratch database (testdb.h) and Redis:
 * tenants, grants, sandboxes of the fake node and what the ledger and Redis say of them.
 *
 * Include after declaring `pg`, `rds`, `node` and the fake wall clock `fake_now` (ns), defining
 * S and WINDOW, and sql() and sql_int() as testdb_sql(pg, ...) and testdb_sql_int(pg, ...).
 */
#ifndef KILN_TESTS_UNIT_METERING_METERDB_H
#define KILN_TESTS_UNIT_METERING_METERDB_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/redis.h"
#include "metering/billing.h"
#include "metering/meter.h"

static inline void new_tenant(char *t, size_t n)
{
	snprintf(t, n, "tn_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	sql("INSERT INTO tenants (id, name) VALUES ('%s', 'test')", t);
}

/* A grant of `ucr` to `t` expiring at the fake second `exp_s` (0: never); returns nothing. */
static inline void grant(const char *t, long long ucr, int64_t exp_s, const char *tag)
{
	char exp[64] = "NULL";

	if (exp_s)
		snprintf(exp, sizeof(exp), "to_timestamp(%lld)", (long long)exp_s);
	sql("INSERT INTO ledger_accounts (id, tenant_id, kind, expires_at) VALUES "
	    "('grant:tx_%s_%s', '%s', 'grant', %s);"
	    "INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, "
	    "amount_ucr, tenant_id, reason) VALUES ('tx_%s_%s', 'g:%s:%s', 'grant', "
	    "'system:issuance', 'grant:tx_%s_%s', %lld, '%s', 'test')",
	    t, tag, t, exp, t, tag, t, tag, t, tag, ucr, t);
}

/*
 * A sandbox of 256 MiB and 1 GiB (257 µcr/s running) in `state` on node `on` since the fake time
 * `since_ns`, its first change witnessed by the boot `wboot` and the monotonic time `mono`
 * (migrations/0051; NULL: not witnessed).
 */
static inline void new_sandbox_at(const char *t, char *sb, size_t n, const char *on,
				  const char *state, int64_t since_ns, const char *wboot, int64_t mono)
{
	char wit[96] = "NULL, NULL";

	snprintf(sb, n, "sb_%08x%04x", (unsigned)rand(), (unsigned)rand() & 0xffff);
	if (wboot)
		snprintf(wit, sizeof(wit), "'%s', %lld", wboot, (long long)mono);
	sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
	    "disk_gib, timeout_s, expires_at, state_changed_at, created_at, log_boot_id, "
	    "log_mono_ns) VALUES ('%s', '%s', '%s', '%s', 'python', 1000, 256, 1, 300, "
	    "now() + interval '1 hour', to_timestamp(%lld / 1e6), to_timestamp(%lld / 1e6), %s)",
	    sb, t, on, state, (long long)(since_ns / 1000), (long long)(since_ns / 1000), wit);
}

/* A running sandbox of the fake node since `since_ns`, not witnessed. */
static inline void new_sandbox(const char *t, char *sb, size_t n, int64_t since_ns)
{
	new_sandbox_at(t, sb, n, node, "running", since_ns, NULL, 0);
}

static inline void stop_sandbox(const char *sb, int64_t at_ns)
{
	sql("UPDATE sandboxes SET state = 'stopped', state_changed_at = to_timestamp(%lld / 1e6) "
	    "WHERE id = '%s'",
	    (long long)(at_ns / 1000), sb);
}

static inline long long used(const char *t)
{
	return sql_int("SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers "
		       "WHERE tenant_id = '%s' AND kind = 'usage'", t);
}

static inline long long ledger_bal(const char *t)
{
	return sql_int("SELECT coalesce(sum(balance_ucr), 0) FROM ledger_account_balances "
		       "WHERE tenant_id = '%s'", t);
}

/* What Redis holds as the balance of `t`: ledger - sum(live); *ok false when no ledger half. */
static inline long long redis_bal(const char *t, bool *ok)
{
	struct rds_reply rep = { 0 };
	struct kiln_error err = { 0 };
	char key[128];
	long long ledger = 0, live = 0;

	*ok = false;
	snprintf(key, sizeof(key), BILLING_BAL_PREFIX "%s", t);
	if (RDS(rds, &rep, &err, "HGETALL", key) == KILN_OK && rep.type == RDS_ARRAY) {
		for (size_t i = 0; i + 1 < rep.n; i += 2) {
			if (!strcmp(rep.elem[i].str, "ledger")) {
				ledger = atoll(rep.elem[i + 1].str);
				*ok = true;
			} else if (!strncmp(rep.elem[i].str, "live:", 5)) {
				live += atoll(rep.elem[i + 1].str);
			}
		}
	}
	rds_reply_release(&rep);
	return ledger - live;
}

static inline int64_t fake_clock(void *ctx)
{
	(void)ctx;
	return fake_now;
}

/* Ticks once a (fake) second from the current time up to and including `until_ns`. */
static inline void tick_until(struct meter *m, int64_t until_ns)
{
	struct kiln_error err = { 0 };

	while (fake_now + S <= until_ns) {
		fake_now += S;
		if (meter_tick(m, &err) != KILN_OK)
			fprintf(stderr, "tick failed: %s\n", err.msg);
	}
}

/*
 * Starts a case on a node of its own (so no meter sees another case's sandboxes) and returns a
 * window-aligned fake time a little before the host's now.
 */
static inline int64_t aligned_now(void)
{
	int64_t t = (int64_t)time(NULL) - 3 * WINDOW;

	snprintf(node, sizeof(node), "um%08x", (unsigned)rand());
	sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
	    "accelerator, image_hash) VALUES ('%s', 'unix:/nonexistent', 16000, 16384, 32, 'qemu', "
	    "'tcg', '')",
	    node);

	return (t - t % WINDOW) * S;
}

#endif
