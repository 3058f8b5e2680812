"""/healthz with Postgres or Redis stopped: 503 naming which, and back to 200 when it returns.

This test stops servers, so it runs its own pair rather than the shared fixture's."""
import os
import subprocess
import tempfile
import time
import unittest

import kiln

SERVICES = os.path.join(kiln.ROOT, "tests", "harness", "services.sh")


def wait_status(gw, want, timeout=20):
    deadline = time.time() + timeout
    r = None
    while time.time() < deadline:
        r = gw.request("GET", "/healthz", timeout=10)
        if r.status == want:
            return r
        time.sleep(0.2)
    return r


class HealthzTests(unittest.TestCase):
    def setUp(self):
        fd, self.envfile = tempfile.mkstemp(prefix="kiln-own-services-")
        os.close(fd)
        subprocess.run([SERVICES, "start", self.envfile], check=True, capture_output=True)
        self.addCleanup(subprocess.run, [SERVICES, "stop", self.envfile], capture_output=True)
        os.environ["KILN_SERVICES_ENV"], saved = self.envfile, os.environ["KILN_SERVICES_ENV"]
        self.env = kiln.services_env()
        os.environ["KILN_SERVICES_ENV"] = saved
        self.gw = kiln.Gateway(self.env["KILN_DATABASE_URL"], self.env["KILN_REDIS_URL"])
        self.addCleanup(self.gw.cleanup)
        # A registered node, its heartbeat fresh for the whole test (this test is about
        # Postgres and Redis; nodes are covered in test_gateway and the e2e tests).
        kiln.psql(self.env["KILN_TEST_SOCKDIR"], "kiln",
                  "INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor,"
                  " accelerator, image_hash, heartbeat_at) VALUES ('n1', 'unix:/x', 1000, 1024, 1,"
                  " 'qemu', 'tcg', '', now() + interval '1 hour')")

    def shell(self, script):
        lib = os.path.join(kiln.ROOT, "scripts", "lib.sh")
        subprocess.run(["bash", "-c", f". {lib}; {script}"], check=True, capture_output=True)

    def test_redis_down_is_503_naming_redis_then_recovers(self):
        self.assertEqual(wait_status(self.gw, 200).status, 200)
        self.shell(f"kiln_stop_pid {self.env['KILN_TEST_REDIS_PIDFILE']} 10")
        r = wait_status(self.gw, 503)
        self.assertEqual(r.status, 503)
        self.assertEqual(r.json()["checks"], {"postgres": "ok", "redis": "unavailable", "nodes": "ok"})
        d = self.env["KILN_TEST_DIR"]
        self.shell(f"kiln_redis_start {d}/redis {d}/s/redis.sock {d}/redis.pid {d}/redis.log")
        self.assertEqual(wait_status(self.gw, 200).status, 200)

    def test_postgres_down_is_503_naming_postgres_then_recovers(self):
        self.assertEqual(wait_status(self.gw, 200).status, 200)
        d = self.env["KILN_TEST_DIR"]
        self.shell(f"kiln_pg_stop {d}/pg")
        r = wait_status(self.gw, 503)
        self.assertEqual(r.status, 503)
        self.assertEqual(r.json()["checks"], {"postgres": "unavailable", "redis": "ok", "nodes": "unavailable"})
        self.assertEqual(r.json()["status"], "unavailable")
        self.shell(f"kiln_pg_start {d}/pg {d}/s {d}/pg.log")
        self.assertEqual(wait_status(self.gw, 200).status, 200)


if __name__ == "__main__":
    unittest.main()
