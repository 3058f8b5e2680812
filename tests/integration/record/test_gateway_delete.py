"""The gateway's deletes of a sandbox, written through record/ (record_delete_unheld,
record_delete_requested): a sandbox no node holds goes (204) unless it changed since the gateway
read it (a stale generation: 409 and nothing changed); a sandbox whose node is down is recorded as
requested. The node is a stand-in on a Unix socket that answers every delete 404, as a node does
that no longer holds the sandbox, and can change the record meanwhile (a resume elsewhere)."""
import http.server
import os
import secrets
import shutil
import socketserver
import tempfile
import threading
import unittest

import kiln


class StandInNode(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def handler_for(test):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_DELETE(self):
            test.deletes += 1
            if test.meanwhile:
                test.meanwhile()
            body = b'{"error":{"code":"not_found","message":"no such sandbox"}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    return Handler


class GatewayDeleteTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        env = kiln.services_env()
        cls.db = kiln.fresh_database()
        cls.addClassCleanup(cls.db.drop)
        cls.gw = kiln.Gateway(cls.db.url, env["KILN_REDIS_URL"])
        cls.addClassCleanup(cls.gw.cleanup)
        admin = {"Authorization": "Bearer " + cls.gw.admin_key}
        r = cls.gw.request("POST", "/v1/tenants", {"name": "deleter"}, admin)
        assert r.status == 201, r
        cls.tenant = r.json()["tenant"]["id"]
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        cls.dir = tempfile.mkdtemp(prefix="kiln-standin-")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)

    def setUp(self):
        self.deletes = 0
        self.meanwhile = None
        self.sock = os.path.join(self.dir, secrets.token_hex(4) + ".sock")
        self.server = StandInNode(self.sock, handler_for(self))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.addCleanup(self.server.server_close)
        self.addCleanup(self.server.shutdown)
        self.node = "n" + secrets.token_hex(4)
        self.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, "
                    "hypervisor, accelerator, image_hash, heartbeat_at) VALUES "
                    f"('{self.node}', 'unix:{self.sock}', 8000, 8192, 10, 'qemu', 'tcg', '', now())")

    def sandbox(self, node=None, state="paused"):
        sb = "sb_" + secrets.token_hex(8)
        node_sql = f"'{node}'" if node else "NULL"
        self.db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, "
                    "memory_mib, disk_gib, timeout_s, expires_at) VALUES "
                    f"('{sb}', '{self.tenant}', {node_sql}, '{state}', 'python', 1000, 256, 1, 300, "
                    "now() + interval '1 hour')")
        return sb

    def row(self, sb):
        return self.db.sql("SELECT state || '|' || generation || '|' || (deleted_at IS NOT NULL) "
                           "|| '|' || (delete_requested_at IS NOT NULL) "
                           f"FROM sandboxes WHERE id = '{sb}'")

    def test_a_sandbox_its_node_no_longer_holds_is_deleted(self):
        sb = self.sandbox(self.node)
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.deletes, 1)
        self.assertEqual(self.row(sb), "stopped|1|true|false")
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 404, r)

    def test_a_sandbox_never_placed_is_deleted(self):
        sb = self.sandbox(None, state="creating")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.deletes, 0)
        self.assertEqual(self.row(sb), "stopped|1|true|false")

    def test_a_sandbox_resumed_meanwhile_is_left_as_it_is(self):
        sb = self.sandbox(self.node)
        other = "n" + secrets.token_hex(4)
        self.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, "
                    "hypervisor, accelerator, image_hash, heartbeat_at) VALUES "
                    f"('{other}', 'unix:/nonexistent', 8000, 8192, 10, 'qemu', 'tcg', '', now())")

        def resumed_elsewhere():
            # after the gateway read generation 1: resumed on another node, generation 2
            self.db.sql(f"UPDATE sandboxes SET state = 'running', generation = 2, node_id = '{other}' "
                        f"WHERE id = '{sb}'")
        self.meanwhile = resumed_elsewhere
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual((r.status, r.json()["error"]["code"]), (409, "conflict"), r)
        self.assertEqual(self.deletes, 1)
        self.assertEqual(self.row(sb), "running|2|false|false", "the stale delete changed it")

    def test_a_sandbox_whose_node_is_down_is_recorded_as_requested(self):
        sb = self.sandbox(self.node)
        self.db.sql(f"UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id = '{self.node}'")
        self.server.shutdown()
        self.server.server_close()
        os.unlink(self.sock)
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.row(sb), "paused|1|false|true")
        first = self.db.sql(f"SELECT delete_requested_at FROM sandboxes WHERE id = '{sb}'")
        r = self.gw.request("DELETE", f"/v1/sandboxes/{sb}", headers=self.key)
        self.assertEqual(r.status, 204, r)
        self.assertEqual(self.db.sql(f"SELECT delete_requested_at FROM sandboxes WHERE id = '{sb}'"),
                         first, "the first request's time is kept")


if __name__ == "__main__":
    unittest.main()
