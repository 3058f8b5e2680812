"""The gateway skeleton: error model, request ids, metrics, body caps, graceful stop."""
import re
import signal
import threading
import time
import unittest

import kiln


class GatewayTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        env = kiln.services_env()
        cls.db = kiln.fresh_database()
        cls.gw = kiln.Gateway(cls.db.url, env["KILN_REDIS_URL"], {"KILN_HTTP_BODY_MAX": "2048"})

    @classmethod
    def tearDownClass(cls):
        cls.gw.cleanup()
        cls.db.drop()

    def test_healthz_needs_postgres_redis_and_a_live_node(self):
        # No node has registered in this database: 503 naming the nodes.
        r = self.gw.request("GET", "/healthz")
        self.assertEqual(r.status, 503, r)
        self.assertEqual(r.json(), {"status": "unavailable",
                                    "checks": {"postgres": "ok", "redis": "ok", "nodes": "unavailable"}})
        # A node's heartbeat (the row kiln-node keeps fresh) makes it whole; a stale one does not.
        self.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor,"
                    " accelerator, image_hash, heartbeat_at) VALUES ('n-stale', 'unix:/x', 1000, 1024, 1,"
                    " 'qemu', 'tcg', '', now() - interval '1 minute')")
        self.assertEqual(self.gw.request("GET", "/healthz").status, 503)
        self.db.sql("UPDATE nodes SET heartbeat_at = now() + interval '1 hour'")
        r = self.gw.request("GET", "/healthz")
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"status": "ok", "checks": {"postgres": "ok", "redis": "ok", "nodes": "ok"}})
        self.db.sql("DELETE FROM nodes")

    def test_every_response_has_a_distinct_request_id(self):
        ids = set()
        for path in ("/healthz", "/metrics", "/nope"):
            r = self.gw.request("GET", path)
            self.assertRegex(r.headers["X-Request-Id"], r"^req_[0-9a-f]{16}$")
            ids.add(r.headers["X-Request-Id"])
        self.assertEqual(len(ids), 3)

    def test_unknown_route_is_a_json_404(self):
        r = self.gw.request("GET", "/v1/nothing-here")
        self.assertEqual(r.status, 404)
        err = r.json()["error"]
        self.assertEqual(err["code"], "not_found")
        self.assertEqual(err["request_id"], r.headers["X-Request-Id"])
        self.assertTrue(err["message"])

    def test_metrics_count_requests_by_route_and_status(self):
        for _ in range(3):
            self.gw.request("GET", "/healthz")
        self.gw.request("GET", "/nope")
        text = self.gw.request("GET", "/metrics").data.decode()
        counts = re.findall(r'kiln_http_requests_total\{method="GET",route="/healthz",status="(\d+)"\} (\d+)', text)
        self.assertTrue(counts, text)
        self.assertGreaterEqual(sum(int(n) for _, n in counts), 3)
        self.assertIn('route="unmatched",status="404"', text)
        self.assertIn('kiln_http_request_seconds_bucket{method="GET",route="/healthz",le="+Inf"}', text)
        self.assertIn("# TYPE kiln_http_request_seconds histogram", text)

    def test_oversized_body_is_413_and_a_body_within_the_cap_is_read(self):
        r = self.gw.request("GET", "/healthz", body=b"x" * 5000)
        self.assertEqual(r.status, 413, r)
        self.assertEqual(r.json()["error"]["code"], "too_large")
        self.assertIn(self.gw.request("GET", "/healthz", body=b"x" * 2000).status, (200, 503))

    def test_wrong_method_on_a_known_path_is_refused(self):
        r = self.gw.request("DELETE", "/healthz")
        self.assertEqual(r.status, 404)
        self.assertIn("DELETE", r.json()["error"]["message"])

    def test_sigterm_lets_a_request_in_flight_finish(self):
        gw = kiln.Gateway(self.db.url, kiln.services_env()["KILN_REDIS_URL"],
                          master_key=self.gw.master_key)
        self.addCleanup(gw.cleanup)
        results = []
        # A slow client: its request is in flight (headers in, body still coming) when the
        # signal arrives.
        import socket
        s = socket.create_connection(("127.0.0.1", gw.port))
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhe")
        time.sleep(0.3)

        def finish():
            time.sleep(0.5)
            s.sendall(b"llo")
            results.append(s.recv(4096))
        t = threading.Thread(target=finish)
        t.start()
        time.sleep(0.1)
        gw.proc.send_signal(signal.SIGTERM)
        t.join(10)
        self.assertTrue(results and results[0].startswith(b"HTTP/1.1 "), results)
        self.assertIn(b'"status":', results[0])
        self.assertEqual(gw.proc.wait(30), 0)
        s.close()
        # And it no longer accepts connections.
        with self.assertRaises(OSError):
            socket.create_connection(("127.0.0.1", gw.port), timeout=1)


if __name__ == "__main__":
    unittest.main()
