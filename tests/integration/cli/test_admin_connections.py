"""`kiln admin connections` against a real kiln-gateway and Postgres: each connection's line
carries what kiln-node's proxies log (migration 0022): the name the name-checking proxy checked,
its decision, and the injecting proxy's requests (never a secret's value); a name or path the
guest chose cannot break the line; the JSON form is the API's; a tenant's key gets 403."""
import json
import os
import subprocess
import unittest

from authtest import GatewayCase

KILN = os.path.join(os.environ["KILN_BUILD_DIR"], "cli", "kiln")
SB = "sb_clilog0000000000000000000"


class AdminConnections(GatewayCase):
    def kiln(self, key, *args, status=0):
        env = dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=key)
        p = subprocess.run([KILN, *args], env=env, capture_output=True, timeout=60)
        self.assertEqual(p.returncode, status, "kiln %s: %s" % (" ".join(args), p.stderr.decode()))
        return p

    def row(self, n, opened, dns, decision, requests, verdict="allowed"):
        self.db.sql(
            "INSERT INTO sandbox_connections (sandbox_id, tenant_id, node_id, flow_key, "
            "opened_at, last_seen_at, verdict, family, proto, dst, dst_port, src_port, dns_name, "
            "bytes_out, bytes_in, packets_out, packets_in, proxy_decision, requests) VALUES "
            f"('{SB}', 'tn_x', 'node1', 'k{n}', '{opened}', '{opened}', '{verdict}', 4, 'tcp', "
            f"'192.0.2.{n}', 443, {40000 + n}, {dns}, {n * 100}, {n * 1000}, {n}, {n * 2}, "
            f"{decision}, {requests})")

    def test_lines_carry_name_decision_and_requests(self):
        reqs = [{"method": "GET", "host": "api.example.com", "path": "/v1/a", "status": 200,
                 "secret": True},
                {"method": "POST", "host": "api.example.com", "path": "/v1/b\t\nX", "status": 404,
                 "secret": False}]
        # an address rule's flow: no name, no decision, no requests
        self.row(1, "2026-01-02T03:04:05Z", "NULL", "NULL", "NULL")
        self.row(2, "2026-01-02T03:04:06Z", "'deb.debian.org'", "'no_rule'", "NULL",
                 verdict="denied")
        self.row(3, "2026-01-02T03:04:07Z", "'api.example.com'", "'allowed'",
                 "'%s'::jsonb" % json.dumps(reqs).replace("'", "''"))
        out = self.kiln(self.gw.admin_key, "admin", "connections", SB).stdout.decode()
        lines = [l.split("\t") for l in out.splitlines()]
        self.assertEqual(len(lines), 3, out)  # newest first; the path's LF made no line
        self.assertEqual(lines[0], [
            "2026-01-02T03:04:07Z", "2026-01-02T03:04:07Z", "allowed", "tcp", "192.0.2.3", "443",
            "300", "3000", "3", "6", "api.example.com", "allowed",
            "GET api.example.com /v1/a 200 +secret; POST api.example.com /v1/b??X 404"])
        self.assertEqual(lines[1][2:5] + lines[1][10:], ["denied", "tcp", "192.0.2.2",
                                                         "deb.debian.org", "no_rule", "-"])
        self.assertEqual(lines[2][10:], ["-", "-", "-"])
        # --json is the API's answer as it is
        got = json.loads(self.kiln(self.gw.admin_key, "--json", "admin", "connections",
                                   SB).stdout)
        self.assertEqual([c["proxy_decision"] for c in got["connections"]],
                         ["allowed", "no_rule", None])
        self.assertEqual(got["connections"][0]["requests"], reqs)
        # a tenant's own key is not the operator's
        _, k, _ = self.new_tenant("cli")
        p = self.kiln(k["key"], "admin", "connections", SB, status=1)
        self.assertIn("403", (p.stderr + p.stdout).decode())


if __name__ == "__main__":
    unittest.main()
