/* plan.c - a tenant's plan limits (plan.h). */
#include "metering/plan.h"

#include <stdio.h>

/* What every query below starts from: the tenant, its plan's row and the default plan's. */
#define PLAN_FROM "FROM tenants t LEFT JOIN plan_limits p ON p.plan = t.plan " \
		  "LEFT JOIN plan_limits d ON d.plan = 'default' "

/* Runs `sql` (one row per tenant, $1 the tenant) into *res; KILN_E_NOT_FOUND for no such tenant. */
static enum kiln_err tenant_row(struct pg_conn *c, const char *sql, const char *tenant_id,
				struct pg_res **res, struct kiln_error *err)
{
	enum kiln_err rc = PGQ(c, res, err, sql, tenant_id);

	if (rc == KILN_OK && pg_res_rows(*res) != 1) {
		pg_res_free(*res);
		*res = NULL;
		rc = kiln_error_set(err, KILN_E_NOT_FOUND, "no tenant \"%s\"", tenant_id);
	}
	return rc;
}

enum kiln_err plan_check(struct pg_conn *c, const char *tenant_id, unsigned count, unsigned vcpu_milli,
			 unsigned mem_mib, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	long long max_n, max_v, max_m, n, v, mem;
	enum kiln_err rc;

	rc = PGQ(c, NULL, err, "SELECT pg_advisory_xact_lock(hashtextextended('kiln-plan:' || $1, 0))",
		 tenant_id);
	if (rc != KILN_OK)
		return rc;
	rc = tenant_row(c,
			"SELECT coalesce(p.max_sandboxes, d.max_sandboxes), "
			"coalesce(p.max_vcpu_milli, d.max_vcpu_milli), "
			"coalesce(p.max_memory_mib, d.max_memory_mib), "
			"count(s.id), coalesce(sum(s.vcpu_milli), 0), coalesce(sum(s.memory_mib), 0) "
			PLAN_FROM
			"LEFT JOIN sandboxes s ON s.tenant_id = t.id AND s.deleted_at IS NULL "
			"AND s.state IN ('creating', 'running') "
			"WHERE t.id = $1 GROUP BY 1, 2, 3",
			tenant_id, &res, err);
	if (rc != KILN_OK)
		return rc;
	max_n = pg_res_int(res, 0, 0, 0);
	max_v = pg_res_int(res, 0, 1, 0);
	max_m = pg_res_int(res, 0, 2, 0);
	n = pg_res_int(res, 0, 3, 0);
	v = pg_res_int(res, 0, 4, 0);
	mem = pg_res_int(res, 0, 5, 0);
	pg_res_free(res);
	if (n + count > max_n)
		return kiln_error_set(err, KILN_E_QUOTA,
				      "the plan allows %lld sandboxes running at once", max_n);
	if (v + (long long)count * vcpu_milli > max_v)
		return kiln_error_set(err, KILN_E_QUOTA,
				      "the plan allows %lld.%03lld vCPUs in running sandboxes", max_v / 1000,
				      max_v % 1000);
	if (mem + (long long)count * mem_mib > max_m)
		return kiln_error_set(err, KILN_E_QUOTA,
				      "the plan allows %lld MiB of memory in running sandboxes", max_m);
	return KILN_OK;
}

/* What the tenant keeps and has reserved: the sum below, for tenant_row's subquery. */
#define SNAP_USED "(SELECT coalesce(sum(size_bytes), 0) FROM snapshots x WHERE x.tenant_id = t.id " \
		  " AND x.purged_at IS NULL AND (x.deleted_at IS NULL OR x.kind IN ('pause', 'fork'))) + " \
		  "(SELECT coalesce(sum(bytes), 0) FROM snapshot_reservations r WHERE r.tenant_id = t.id " \
		  " AND r.created_at > now() - interval '1 hour') "

/* The bytes of the tenant's cached layers of template builds (node/build.c), part of SNAP_USED. */
#define LAYERS_USED "(SELECT coalesce(sum(x.size_bytes), 0) FROM template_layers l JOIN snapshots x " \
		    " ON x.id = l.snapshot_id AND x.deleted_at IS NULL AND x.purged_at IS NULL " \
		    " WHERE l.tenant_id = t.id) "

/*
 * The tenant's snapshot limit and what it keeps and has reserved (`layers` of it cached layers of
 * template builds), under the tenant's plan lock.
 */
static enum kiln_err snap_usage(struct pg_conn *c, const char *tenant_id, long long *max_b,
				long long *used, long long *layers, struct kiln_error *err)
{
	struct pg_res *res = NULL;
	enum kiln_err rc;

	/*
	 * What the tenant keeps: named snapshots and cached layers not deleted, and pause and fork
	 * snapshots whose files are still on a node (internal ones are marked deleted but kept while
	 * used); and what pauses in progress have reserved.
	 */
	rc = tenant_row(c,
			"SELECT coalesce(p.max_snapshot_bytes, d.max_snapshot_bytes), " SNAP_USED ", "
			LAYERS_USED PLAN_FROM "WHERE t.id = $1",
			tenant_id, &res, err);
	if (rc != KILN_OK)
		return rc;
	*max_b = pg_res_int(res, 0, 0, 0);
	*used = pg_res_int(res, 0, 1, 0);
	*layers = pg_res_int(res, 0, 2, 0);
	pg_res_free(res);
	return KILN_OK;
}

/* What the tenant's cached layers take of `used`, for the errors at the limit: "" when none. */
static const char *layers_part(long long layers, char *buf, size_t len)
{
	if (layers <= 0)
		return "";
	snprintf(buf, len,
		 " (%lld MiB of them cached layers of template builds, which go with their "
		 "templates or are evicted by builds)",
		 layers >> 20);
	return buf;
}

enum kiln_err plan_snapshot_limit(struct pg_conn *c, const char *tenant_id, long long *max_b,
				  struct kiln_error *err)
{
	struct pg_res *res = NULL;
	enum kiln_err rc = tenant_row(c,
				      "SELECT coalesce(p.max_snapshot_bytes, d.max_snapshot_bytes) "
				      PLAN_FROM "WHERE t.id = $1",
				      tenant_id, &res, err);

	if (rc == KILN_OK)
		*max_b = pg_res_int(res, 0, 0, 0);
	pg_res_free(res);
	return rc;
}

enum kiln_err plan_snapshot_check(struct pg_conn *c, const char *tenant_id, struct kiln_error *err)
{
	long long max_b, used, layers;
	char part[256];
	enum kiln_err rc = snap_usage(c, tenant_id, &max_b, &used, &layers, err);

	if (rc != KILN_OK)
		return rc;
	if (used >= max_b)
		return kiln_error_set(err, KILN_E_QUOTA,
				      "the plan allows %lld MiB of snapshots and %lld MiB are kept%s: "
				      "delete snapshots, sandboxes or templates to go on",
				      max_b >> 20, used >> 20, layers_part(layers, part, sizeof(part)));
	return KILN_OK;
}

enum kiln_err plan_snapshot_reserve(struct pg_conn *c, const char *tenant_id, const char *snap_id,
				    long long bytes, bool forced, struct kiln_error *err)
{
	long long max_b, used, layers;
	char b[24], part[256];
	enum kiln_err rc;

	if (bytes < 0)
		bytes = 0;
	rc = PGQ(c, NULL, err, "SELECT pg_advisory_xact_lock(hashtextextended('kiln-plan:' || $1, 0))",
		 tenant_id);
	if (rc == KILN_OK)
		rc = snap_usage(c, tenant_id, &max_b, &used, &layers, err);
	if (rc != KILN_OK)
		return rc;
	if (!forced && used + bytes > max_b)
		return kiln_error_set(err, KILN_E_QUOTA,
				      "the plan allows %lld MiB of snapshots (max_snapshot_bytes): "
				      "%lld MiB are kept or being written%s and this snapshot needs %lld MiB",
				      max_b >> 20, used >> 20, layers_part(layers, part, sizeof(part)),
				      (bytes + (1 << 20) - 1) >> 20);
	snprintf(b, sizeof(b), "%lld", bytes);
	return PGQ(c, NULL, err,
		   "INSERT INTO snapshot_reservations (snapshot_id, tenant_id, bytes) "
		   "VALUES ($1, $2, $3::bigint)",
		   snap_id, tenant_id, b);
}

enum kiln_err plan_snapshot_unreserve(struct pg_conn *c, const char *snap_id, struct kiln_error *err)
{
	return PGQ(c, NULL, err, "DELETE FROM snapshot_reservations WHERE snapshot_id = $1", snap_id);
}
