"""The connection log of a real sandbox, read by the operator through the public API.

Same namespaces as test_egress.py (a host with the whole stack, a fake internet on documentation
addresses; its main() builds and removes them). The node reads the logs only every 300 s here, so
every row these tests see was written by the flush of a pause or a delete, which must come before
the sandbox's pins go: its last flows are never lost. The periodic pass, the per-minute cap and
the sweep are covered by tests/integration/netpolicy (test_netpolicy.py, test_connlog_store.c).
"""
import calendar
import os
import subprocess
import sys
import time
import unittest

import kiln
import test_egress

SEND = r'''
import socket
def send(host, port, n):
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"x" * n)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        b = s.recv(100)
        if not b:
            break
        got += b
    return int(got)
def tcp(host, port, t=2):
    try:
        socket.create_connection((host, port), timeout=t).close()
        return "ok"
    except Exception:
        return "fail"
'''


def epoch(rfc3339):
    return calendar.timegm(time.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ"))


class ConnlogTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env={"KILN_DNS_UPSTREAM": "192.0.2.53",
                                         "KILN_CONNLOG_INTERVAL_S": "300"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("a")
        cls.other = cls.stack.tenant("b")

    def create(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600},
                            self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        return r.json()["id"]

    def run_py(self, sb, code):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/exec",
                            {"code": SEND + code, "timeout_s": 60}, self.key, timeout=90)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["exit_code"], 0, r.json())
        return r.json()["stdout"].split()

    def log(self, sb, query="", headers=None):
        return self.gw.request("GET", f"/v1/admin/sandboxes/{sb}/connections{query}",
                               headers=headers or self.stack.admin)

    def rows(self, sb):
        r = self.log(sb)
        self.assertEqual(r.status, 200, r)
        return r.json()["connections"]

    def test_a_paused_sandboxs_last_flows_are_logged_with_time_destination_and_bytes(self):
        sb = self.create()
        t0 = time.time()
        n = 200_000
        self.assertEqual(self.run_py(sb, f"print(send('203.0.113.10', 9000, {n}), "
                                         "tcp('169.254.169.254', 80))"), [str(n), "fail"])
        self.assertEqual([r for r in self.rows(sb) if r["dst"] == "203.0.113.10"], [],
                         "written before the pause: the test would not prove the flush")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/pause", None, self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        t1 = time.time()
        rows = self.rows(sb)
        sent = [r for r in rows if r["dst"] == "203.0.113.10" and r["dst_port"] == 9000]
        self.assertEqual(len(sent), 1, rows)
        row = sent[0]
        self.assertEqual((row["verdict"], row["proto"], row["family"]), ("allowed", "tcp", 4))
        self.assertTrue(n < row["bytes_out"] < n * 1.05 + 4000, row)
        self.assertGreater(row["bytes_in"], 0, row)
        self.assertGreater(row["packets_out"], 3, row)
        self.assertTrue(t0 - 2 <= epoch(row["opened_at"]) <= t1 + 2, (t0, t1, row))
        self.assertEqual(row["node_id"], self.stack.node.node_id)
        denied = [r for r in rows if r["dst"] == "169.254.169.254"]
        self.assertEqual([(r["verdict"], r["dst_port"], r["bytes_out"]) for r in denied],
                         [("denied", 80, 0)], rows)
        # since/until select by the opening time; paging by cursor
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0 - 3600))
        r = self.log(sb, "?until=" + until)
        self.assertEqual(r.json()["connections"], [])
        r = self.log(sb, "?limit=1")
        self.assertEqual(len(r.json()["connections"]), 1)
        self.assertIsNotNone(r.json()["next_cursor"])
        r2 = self.log(sb, "?limit=1&cursor=" + r.json()["next_cursor"])
        self.assertNotEqual(r2.json()["connections"][0]["id"], r.json()["connections"][0]["id"])
        self.assertEqual(self.log(sb, "?since=yesterday").status, 422)
        # the same through the command-line client, with the admin key; a tenant's key: 403
        kiln_cli = os.path.join(kiln.BUILD, "cli", "kiln")
        env = dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=self.gw.admin_key)
        p = subprocess.run([kiln_cli, "admin", "connections", sb], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = [l.split("\t") for l in p.stdout.splitlines()]
        # an address rule's flow: no checked name, no proxy decision, no injected requests
        self.assertIn([row["opened_at"], row["last_seen_at"], "allowed", "tcp", "203.0.113.10",
                       "9000", str(row["bytes_out"]), str(row["bytes_in"]),
                       str(row["packets_out"]), str(row["packets_in"]), "-", "-", "-"], lines)
        env["KILN_API_KEY"] = self.key["Authorization"].split()[1]
        p = subprocess.run([kiln_cli, "admin", "connections", sb], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("403", p.stderr + p.stdout)

    def test_a_deleted_sandboxs_last_flows_are_logged_and_the_log_outlives_it(self):
        sb = self.create()
        self.assertEqual(self.run_py(sb, "print(send('198.51.100.21', 9000, 5000))"), ["5000"])
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", None, self.key, timeout=300)
        self.assertIn(r.status, (200, 204), r)
        rows = [r for r in self.rows(sb) if r["dst"] == "198.51.100.21"]
        self.assertEqual(len(rows), 1, rows)
        self.assertGreater(rows[0]["bytes_out"], 5000)

    def test_only_the_operator_reads_the_log(self):
        sb = self.create()
        for who in (self.key, self.other):
            r = self.log(sb, headers=who)
            self.assertEqual(r.status, 403, r)
        self.assertEqual(self.log("sb_doesnotexist").status, 404)
        self.gw.request("DELETE", f"/v1/sandboxes/{sb}", None, self.key, timeout=300)


if __name__ == "__main__":
    sys.argv[1:] = sys.argv[1:] or ["test_connlog"]
    sys.exit(test_egress.main())
