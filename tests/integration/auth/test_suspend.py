"""Suspension of a tenant by the operator: POST /v1/tenants/{id}/suspend and .../unsuspend. A
suspended tenant's API keys and tokens get 403 `suspended` on every route of docs/openapi.yaml,
nothing of it is deleted, another tenant is untouched, a tenant cannot suspend, and unsuspending
lets the same keys and tokens in again. (Pausing its running sandboxes needs a VM: e2e_suspend.)"""
import os
import shutil
import tempfile
import threading
import time
import unittest

import kiln
from authtest import GatewayCase, bearer, poll
from openapi_ops import credentialed_operations


class SuspendTests(GatewayCase):
    PER_TEST = True

    def setUp(self):
        super().setUp()
        self.tid, self.key, self.h = self.new_tenant("suspect")
        self.jwt = bearer(self.new_token(self.h))
        self.other_tid, _, self.other = self.new_tenant("bystander")

    def suspend(self, tid, headers=None):
        return self.call("POST", f"/v1/tenants/{tid}/suspend", None, headers or self.admin)

    def unsuspend(self, tid, headers=None):
        return self.call("POST", f"/v1/tenants/{tid}/unsuspend", None, headers or self.admin)

    def snapshot_rows(self):
        return self.db.sql(
            "SELECT (SELECT count(*) FROM tenants), "
            f"(SELECT count(*) FROM api_keys WHERE tenant_id = '{self.tid}' AND revoked_at IS NULL), "
            f"(SELECT count(*) FROM ledger_transfers WHERE tenant_id = '{self.tid}'), "
            f"(SELECT count(*) FROM sandboxes WHERE tenant_id = '{self.tid}')")

    def test_every_route_refuses_the_suspended_tenants_key_and_token(self):
        ops = credentialed_operations()
        self.assertGreater(len(ops), 30, ops)     # the parser found the document's operations
        self.assertIn(("POST", "/v1/sandboxes"), ops)
        for h in (self.h, self.jwt):
            self.expect(self.call("GET", "/v1/sandboxes", headers=h), 200)
        r = self.expect(self.suspend(self.tid), 200).json()
        self.assertEqual(r["tenant"]["id"], self.tid)
        self.assertRegex(r["tenant"]["suspended_at"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        self.assertEqual((r["paused"], r["not_paused"]), ([], []))
        for method, path in ops:
            for name, h in (("key", self.h), ("token", self.jwt)):
                body = {} if method in ("POST", "PUT", "PATCH") else None
                r = self.call(method, path, body, h)
                with self.subTest(method=method, path=path, credential=name):
                    self.expect(r, 403, "suspended")
        # The other tenant is not affected.
        self.expect(self.call("GET", "/v1/sandboxes", headers=self.other), 200)
        self.expect(self.call("GET", "/v1/api-keys", headers=self.other), 200)

    def test_nothing_is_deleted_and_unsuspend_lets_the_same_credentials_in(self):
        before = self.snapshot_rows()
        self.expect(self.suspend(self.tid), 200)
        self.expect(self.call("GET", "/v1/api-keys", headers=self.h), 403, "suspended")
        self.assertEqual(self.snapshot_rows(), before)
        r = self.expect(self.unsuspend(self.tid), 200).json()
        self.assertIsNone(r["tenant"]["suspended_at"])
        self.assertEqual(self.snapshot_rows(), before)
        self.expect(self.call("GET", "/v1/api-keys", headers=self.h), 200)
        self.expect(self.call("GET", "/v1/sandboxes", headers=self.jwt), 200)
        self.expect(self.call("GET", "/v1/billing/balance", headers=self.h), 200)

    def test_suspending_again_keeps_the_first_time(self):
        first = self.expect(self.suspend(self.tid), 200).json()["tenant"]["suspended_at"]
        time.sleep(1.1)
        again = self.expect(self.suspend(self.tid), 200).json()["tenant"]["suspended_at"]
        self.assertEqual(first, again)
        self.expect(self.unsuspend(self.tid), 200)
        self.expect(self.unsuspend(self.tid), 200)

    def test_a_tenant_cannot_suspend_or_unsuspend(self):
        for h in (self.h, self.jwt, self.other):
            self.expect(self.suspend(self.other_tid, h), 403, "forbidden")
            self.expect(self.suspend(self.tid, h), 403, "forbidden")
            self.expect(self.unsuspend(self.tid, h), 403, "forbidden")
        self.assertEqual(self.db.sql("SELECT count(*) FROM tenants WHERE suspended_at IS NOT NULL"),
                         "0")
        self.expect(self.suspend(self.tid), 200)
        # A suspended tenant cannot lift its own suspension either.
        self.expect(self.unsuspend(self.tid, self.h), 403, "suspended")
        self.expect(self.suspend(self.tid, self.h), 403, "suspended")

    def test_unknown_tenant_is_404_and_the_operator_cannot_be_suspended(self):
        self.expect(self.suspend("tn_nosuchtenant"), 404, "not_found")
        self.expect(self.unsuspend("tn_nosuchtenant"), 404, "not_found")
        self.expect(self.suspend("tn_operator"), 409, "conflict")
        self.expect(self.call("GET", "/v1/api-keys", headers=self.admin), 200)

    def test_the_suspension_is_audited(self):
        self.expect(self.suspend(self.tid), 200)
        self.expect(self.unsuspend(self.tid), 200)
        rows = self.db.sql(f"SELECT route || ' ' || status FROM audit_log WHERE object_id = "
                           f"'{self.tid}' AND route LIKE '/v1/tenants/{{id}}/%' ORDER BY seq").split("\n")
        self.assertEqual(rows, ["/v1/tenants/{id}/suspend 200", "/v1/tenants/{id}/unsuspend 200"])

    def test_another_gateway_refuses_within_the_cache_bound(self):
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"],
                           {"KILN_RATE_LIMIT_RPS": "100000", "KILN_RATE_LIMIT_BURST": "100000"},
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        self.expect(self.call("GET", "/v1/api-keys", headers=self.h, gw=gw2), 200)   # cached
        self.expect(self.suspend(self.tid), 200)
        t0 = time.monotonic()
        self.assertTrue(poll(lambda: self.call("GET", "/v1/api-keys", headers=self.h,
                                               gw=gw2).status == 403, 8, 0.2))
        self.assertLessEqual(time.monotonic() - t0, 6.5)
        self.expect(self.call("GET", "/v1/sandboxes", headers=self.jwt, gw=gw2), 403, "suspended")
        self.expect(self.unsuspend(self.tid), 200)
        self.assertTrue(poll(lambda: self.call("GET", "/v1/api-keys", headers=self.h,
                                               gw=gw2).status == 200, 8, 0.2))

    def test_a_key_read_across_the_suspension_does_not_let_the_tenant_in(self):
        """On the gateway that suspends: a read of the tenant's key row (which reads its
        suspension too) begun before the suspension and ended after its forgetting of the tenant
        must not cache the tenant as not suspended for key_cache_s."""
        folder = os.path.join(tempfile.gettempdir(), f"kiln-hold-{os.getpid()}-{time.time_ns()}")
        hold = os.path.join(folder, "held")  # the point passes while its folder is missing
        self.addCleanup(shutil.rmtree, folder, True)
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"],
                           {"KILN_FAULT_HOLD": "gw-key-read", "KILN_FAULT_HOLD_FILE": hold},
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        admin = bearer(self.new_token(self.admin, scopes=["admin"]))  # reads no key row on gw2
        os.mkdir(folder)
        held = threading.Thread(target=self.call, args=("GET", "/v1/api-keys"),
                                kwargs={"headers": self.h, "gw": gw2})
        held.start()
        self.assertTrue(poll(lambda: os.path.exists(hold), 30, 0.05), gw2.output()[-2000:])
        self.expect(self.call("POST", f"/v1/tenants/{self.tid}/suspend", None, admin, gw=gw2),
                    200)
        shutil.rmtree(folder)
        held.join(60)
        self.expect(self.call("GET", "/v1/api-keys", headers=self.h, gw=gw2), 403, "suspended")


if __name__ == "__main__":
    unittest.main()
