"""The usage dashboard in a real browser (Debian's Chromium, driven by playwright-core).

A gateway, a kiln-node with a QEMU sandbox doing some work and a kiln-meter billing it: the page
at / is opened, refuses a key that is not one and a key without billing:read with the server's
reasons, then with the tenant's key shows its balance, the sandbox in the list, the sandbox's
per-second series growing while the page is open and the daily totals from the ledger (the
failed build's cached layer among them, billed as storage); the tenant's template with its
versions, their status and reason, and the failed build's log, kept after it; a reload keeps the
session and "Forget key" ends it. The figures are checked against the API's own."""
import io
import json
import os
import subprocess
import tarfile
import time
import unittest

import kiln
import metertest as mt

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "dashboard", "check.js")


class DashboardTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        kiln.npm_modules(os.path.join(HERE, "dashboard"))
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw

    def test_the_page_shows_a_tenants_balance_sandboxes_and_live_usage(self):
        r = self.gw.request("POST", "/v1/tenants", {"name": "dash-" + os.urandom(4).hex()}, self.stack.admin)
        self.assertEqual(r.status, 201, r)
        key = r.json()["api_key"]["key"]
        auth = {"Authorization": "Bearer " + key}
        r = self.gw.request("POST", "/v1/api-keys", {"name": "narrow", "scopes": ["sandbox:read"]}, auth)
        self.assertEqual(r.status, 201, r)
        narrow = r.json()["key"]
        # a template whose build fails at its second step (the first is kept as a cached layer),
        # and a second version not built yet (built before the busy sandbox starts: a builder
        # booting beside a guest that spins in a loop may not start on a loaded 2-core host)
        spec = {"name": "dash-web", "vcpus": 1, "memory_mib": 256, "disk_gib": 10}
        r = self.gw.request("POST", "/v1/templates", spec, auth)
        self.assertEqual(r.status, 201, r)
        tmpl = r.json()["id"]
        r = self.gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile?version=1",
                            "FROM base\nRUN echo building for the dashboard > /dash.txt\nRUN echo failing now; exit 3\n",
                            dict(auth, **{"Content-Type": "text/plain"}))
        self.assertEqual(r.status, 204, r)
        tar = io.BytesIO()
        tarfile.open(fileobj=tar, mode="w").close()
        r = self.gw.request("PUT", f"/v1/templates/{tmpl}/source?version=1", tar.getvalue(),
                            dict(auth, **{"Content-Type": "application/x-tar"}), timeout=120)
        self.assertEqual(r.status, 202, r)
        deadline = time.monotonic() + 900
        while True:
            v = self.gw.request("GET", f"/v1/templates/{tmpl}", headers=auth).json()["versions"][0]
            if v["status"] != "building" or time.monotonic() > deadline:
                break
            time.sleep(2)
        self.assertEqual(v["status"], "failed", v)
        self.assertIn("exit status 3", v["reason"])
        r = self.gw.request("POST", "/v1/templates", spec, auth)
        self.assertEqual(r.status, 201, r)
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, auth, timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()["id"]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb}", None, auth)
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/exec",
                            {"cmd": ["sh", "-c", "nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &"]},
                            auth, timeout=120)
        self.assertEqual(r.status, 200, r)
        meter = mt.Meter(self.stack.db.url, kiln.services_env()["KILN_REDIS_URL"], self.stack.node.node_id,
                         master_key=self.gw.master_key, extra_env={"KILN_METER_PIN_ROOT": ""})
        self.addCleanup(meter.cleanup)

        page = self.gw.request("GET", "/")
        self.assertEqual(page.status, 200)
        self.assertIn("default-src 'none'", page.headers["Content-Security-Policy"])
        self.assertEqual(page.headers["X-Content-Type-Options"], "nosniff")
        out = subprocess.run(["node", CHECK, self.gw.url + "/", key, narrow, sb, tmpl], capture_output=True,
                             text=True, timeout=300, cwd=os.path.join(HERE, "dashboard"))
        seen = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
        self.assertEqual(out.returncode, 0, f"{seen.get('failure')}\n{out.stderr[-3000:]}")

        self.assertEqual(seen["console_errors"], [], "the page logged errors")
        self.assertEqual(seen["page_errors"], [], "the page's script failed")
        self.assertEqual(seen["csp_violations"], [], "the page broke its own content security policy")
        self.assertIn("Kiln", seen["title"])
        said = self.gw.request("GET", "/v1/billing/balance", headers={"Authorization": "Bearer kiln_sk_notakey"})
        self.assertEqual(said.status, 401)
        self.assertEqual(seen["bad_key_error"], said.json()["error"]["message"])
        self.assertIn('needs the scope "billing:read"', seen["narrow_key_error"])
        self.assertTrue(seen["board_hidden_after_errors"])

        balance = self.gw.request("GET", "/v1/billing/balance", headers=auth).json()
        shown = float(seen["balance"].replace(",", ""))
        self.assertEqual(seen["granted"], "500.0000")
        self.assertLessEqual(shown, 500)
        self.assertGreaterEqual(shown, balance["balance_ucr"] / 1e6, "the balance shown is older than the API's")
        self.assertEqual(seen["row"][0], sb)
        self.assertEqual(seen["row"][1], "running")
        self.assertEqual(seen["row"][3], "256 MiB")
        self.assertEqual(seen["detail_id"], sb)

        # Every chart drew the series the API serves; the guest's busy loop shows as CPU.
        points = self.gw.request("GET", f"/v1/sandboxes/{sb}/usage", headers=auth).json()["points"]
        self.assertGreaterEqual(len(points), seen["mem"]["points"])
        for c in ("cpu", "mem", "net", "cost"):
            self.assertGreaterEqual(seen[c]["points"], 3, c)
        self.assertEqual(seen["net"]["lines"], 2)
        self.assertEqual(seen["mem"]["lines"], 1)
        self.assertGreater(seen["cpu"]["max"], 100, "a busy guest uses over 100 ms of CPU a second")
        self.assertGreater(seen["mem"]["max"], 16, "the guest holds more than 16 MiB")
        self.assertLessEqual(seen["mem"]["max"], 256 + 128)
        self.assertGreater(seen["cost"]["max"], 0)
        self.assertGreater(seen["mem_points_later"], seen["mem"]["points"])

        self.assertEqual(seen["day_row"][1], sb)
        self.assertEqual(seen["day_row"][2], "sandbox")
        self.assertGreater(float(seen["day_row"][7].replace(",", "")), 0)
        layer = self.stack.db.sql(f"SELECT l.snapshot_id FROM template_layers l JOIN templates t "
                                  f"ON t.id = l.template_id WHERE t.id = '{tmpl}'")
        self.assertRegex(layer, r"^snap_\w+$")
        self.assertEqual(seen["storage_row"][1:3], [layer, "storage"])

        # the template, its versions (newest first) and the failed build's log, kept after it
        t = self.gw.request("GET", f"/v1/templates/{tmpl}", headers=auth).json()
        v2, v1 = t["versions"]
        self.assertEqual(seen["template_row"][:4], ["dash-web", "v2", "pending", ""])
        self.assertEqual([r[:3] for r in seen["versions"]],
                         [["v2", "pending", ""], ["v1", "failed", v1["reason"]]])
        self.assertIn("exit status 3", v1["reason"])
        self.assertEqual(seen["versions"][1][3], "1 vCPU, 256 MiB, 10 GiB")
        self.assertIn("not built yet", seen["pending_log_state"])
        self.assertEqual(seen["log_version"], "v1")
        self.assertIn("RUN echo building for the dashboard", seen["log"])
        self.assertIn("failing now\n", seen["log"])
        self.assertTrue(seen["log"].rstrip("\n").endswith(v1["reason"]), seen["log"][-500:])
        self.assertEqual(seen["log_state"], f"(failed: {v1['reason']})")
        self.assertTrue(seen["board_after_reload"])
        self.assertIsNone(seen["key_left"], "Forget key must clear the stored key")


if __name__ == "__main__":
    unittest.main()
