/* plan.c - plan limits on live sandboxes (plan.h). */
#include "metering/plan.h"

#include <stdio.h>

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
	rc = PGQ(c, &res, err,
		 "SELECT coalesce(p.max_sandboxes, d.max_sandboxes), "
		 "coalesce(p.max_vcpu_milli, d.max_vcpu_milli), "
		 "coalesce(p.max_memory_mib, d.max_memory_mib), "
		 "count(s.id), coalesce(sum(s.vcpu_milli), 0), coalesce(sum(s.memory_mib), 0) "
		 "FROM tenants t LEFT JOIN plan_limits p ON p.plan = t.plan "
		 "LEFT JOIN plan_limits d ON d.plan = 'default' "
		 "LEFT JOIN sandboxes s ON s.tenant_id = t.id AND s.deleted_at IS NULL "
		 "AND s.state IN ('creating', 'running') "
		 "WHERE t.id = $1 GROUP BY 1, 2, 3",
		 tenant_id);
	if (rc != KILN_OK)
		return rc;
	if (pg_res_rows(res) != 1) {
		pg_res_free(res);
		return kiln_error_set(err, KILN_E_NOT_FOUND, "no tenant \"%s\"", tenant_id);
	}
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
