"""E2B's own JavaScript SDK (npm `e2b`, pinned by package-lock.json) against a real Kiln: a real
gateway with its E2B listener, a real kiln-node with QEMU microVMs, Postgres and Redis. The SDK is
configured by E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY alone; check.mjs says what it asserts. The packages are
installed once per lock from the npm registry into the cache (kiln.npm_modules), never into the
clone or the build directory.

The sandbox the SDK makes is a Kiln sandbox made by the gateway's own create route (so metered,
plan-limited and audited like any other): the test checks its record, its audit trail, that a real
kiln-meter billed the tenant for it, and the eBPF policy's verdicts on the connections it tried
under the egress rules the SDK set (the connection log).
"""
import json
import os
import re
import subprocess
import time
import unittest

import kiln
import metertest as mt

HERE = os.path.dirname(os.path.abspath(__file__))


class E2bSdk(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        kiln.npm_modules(HERE)
        cls.stack = kiln.Stack(e2b=True)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.meter = mt.Meter(cls.stack.db.url, kiln.services_env()["KILN_REDIS_URL"],
                             cls.stack.node.node_id, master_key=cls.stack.gw.master_key)
        cls.addClassCleanup(cls.meter.cleanup)

    def tenant(self, name):
        r = self.stack.gw.request("POST", "/v1/tenants", {"name": name}, self.stack.admin)
        self.assertEqual(r.status, 201, r)
        return r.json()["tenant"]["id"], r.json()["api_key"]["key"]

    def test_sdk_drives_a_sandbox(self):
        tenant, key = self.tenant("e2b-user")
        _, other = self.tenant("e2b-other")
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
               "E2B_API_URL": self.stack.gw.e2b_url, "E2B_API_KEY": key,
               "E2B_SANDBOX_URL": self.stack.gw.e2b_sandbox_url,
               "E2B_OTHER_API_KEY": other}
        t0 = time.monotonic()
        out = subprocess.run(["node", "check.mjs"], cwd=HERE, env=env, capture_output=True,
                             text=True, timeout=600)
        took = time.monotonic() - t0
        lines = out.stdout.strip().splitlines()
        seen = json.loads(lines[-1]) if lines else {}
        self.assertEqual(out.returncode, 0, f"{seen.get('failure')}\nsteps: {seen.get('steps')}\n"
                                            f"{out.stderr[-3000:]}")
        self.assertTrue(seen["ok"])
        self.assertEqual([s if isinstance(s, str) else next(iter(s)) for s in seen["steps"]],
                         ["create", "getInfo", "list", "setTimeout", "updateNetwork", "files", "commands",
                          "watchDir", "dataPlane", "otherTenant", "getMetrics", "pause", "connect",
                          "snapshots", "kill"])
        sandbox = seen["steps"][0]["create"]
        # The Kiln record is the same sandbox: made, and deleted by the SDK's kill.
        r = self.stack.gw.request("GET", f"/v1/sandboxes/{sandbox}", None,
                                  {"Authorization": "Bearer " + key})
        self.assertEqual(r.status, 404, r)
        rows = self.stack.db.sql(f"SELECT count(*) FROM sandboxes WHERE id = '{sandbox}' "
                                 f"AND tenant_id = '{tenant}' AND deleted_at IS NOT NULL")
        self.assertIn("1", rows)
        # Audited as the API's own requests: the create, pause, resume and delete by this tenant.
        rows = self.stack.db.sql(f"SELECT method || ' ' || route || ' ' || status FROM audit_log "
                                 f"WHERE tenant_id = '{tenant}' AND object_id = '{sandbox}' "
                                 f"ORDER BY seq")
        for want in (r"POST /v1/sandboxes 201", r"POST /v1/sandboxes/\{id\}/pause 2\d\d",
                     r"POST /v1/sandboxes/\{id\}/resume 2\d\d", r"DELETE /v1/sandboxes/\{id\} 204"):
            self.assertRegex(rows, want)
        # Three egress updates the API took (deny all; two rules; open again), the bad one never
        # reached it.
        self.assertEqual(len(re.findall(r"PUT /v1/sandboxes/\{id\}/egress 200", rows)), 3, rows)
        # network.rules' header as a secret of the exact host, then cleared by the update
        # without rules; the wildcard's refused update reached neither
        self.assertEqual(len(re.findall(r"PUT /v1/sandboxes/\{id\}/secrets 200", rows)), 2, rows)
        # ... and the eBPF policy enforced them: under deny-all 203.0.113.7 was refused, under
        # allowOut [203.0.113.7, pypi.org] it was let through and 198.51.100.7 refused (the node
        # writes a deleted sandbox's last flows before the delete ends).
        rows = self.stack.db.sql(f"SELECT DISTINCT host(dst) || ':' || dst_port || ' ' || verdict "
                                 f"FROM sandbox_connections WHERE sandbox_id = '{sandbox}' "
                                 f"AND dst_port IN (7001, 7002, 7003) ORDER BY 1")
        self.assertEqual(rows.split(), ["198.51.100.7:7003", "denied", "203.0.113.7:7001", "denied",
                                        "203.0.113.7:7002", "allowed"], rows)
        # Metered like any sandbox: kiln-meter billed its run to the tenant's ledger.
        self.assertIsNotNone(mt.billed(self.stack.db, sandbox))
        self.assertGreater(mt.ledger_used(self.stack.db, tenant), 0)
        steps = {k: v for s in seen["steps"] if isinstance(s, dict) for k, v in s.items()}
        print(f"e2b SDK run: {took:.1f} s (files {steps['files'] / 1000:.1f} s, commands "
              f"{steps['commands'] / 1000:.1f} s, watchDir {steps['watchDir'] / 1000:.1f} s, data plane checks {steps['dataPlane'] / 1000:.1f} s)", flush=True)


if __name__ == "__main__":
    unittest.main()
