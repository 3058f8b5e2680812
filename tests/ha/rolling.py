"""rolling.py - `make test-ha` (scripts/test-ha.sh; not part of `make test`, docs/testing.md): a
rolling upgrade of three kiln-node + kiln-meter pairs, each pair in a network namespace of its
own (kiln.Netns, as on a host of its own), to a new guest image under a steady stream of exec, with
Postgres's streaming standby and Redis Sentinel in place and two gateways behind HAProxy
(docs/operations.md, "Rolling upgrades").

Services of its own (tests/integration/ha/test_failover.py's Services: a Postgres 15 primary and a
streaming standby, a Redis primary, its replica and a sentinel); every Kiln process connects with
the multi-host libpq string and finds Redis through the sentinel. A real S3-compatible server
holds the tenant's bucket (tests/integration/s3). Every service listens on this host's address
facing the first namespace. Three nodes start on image A (the test image); each sandbox gets a
file, a process and an egress rule of its own, then a worker per sandbox runs exec after exec,
each with its own Idempotency-Key, retrying one on 502-504 or a lost connection with the same key
and on 409 (its sandbox paused for its move: it did not run) as a new request, until it succeeds. Each node in turn is drained (its sandboxes paused and moved
through the bucket to the others), stopped cleanly, started again on image B (the test image's
files under another directory and hash, as a new release's image would be) and undrained.

Then: no request failed after its retries; every sandbox runs, with its file, its process (its
memory), its egress rules (in force on the node that holds it now) and every acknowledged exec's
line; each sandbox restores on the image it was taken from
(A) while a new one boots on B. It prints its figures (times, execs, retries, the slowest exec).
`KILN_TEST_HA_SANDBOXES` (default 3) sets how many sandboxes."""
import os
import shutil
import signal
import sys
import threading
import time
import unittest
import urllib.error

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "tests", "harness"), os.path.join(ROOT, "tests", "integration", "ha"),
                os.path.join(ROOT, "tests", "integration", "s3")]
import kiln  # noqa: E402
import s3env  # noqa: E402
from test_failover import MASTER, USER, Services, http_client_errors, note, wait_for  # noqa: E402

SANDBOXES = int(os.environ.get("KILN_TEST_HA_SANDBOXES", "3"))
RETRY_FOR_S = 600   # how long one exec may keep being retried (a move under TCG takes a while)


class Execs:
    """One worker per sandbox: `echo N >> /root/log`, N counting up, each retried until done."""

    def __init__(self, gw, key, sandboxes):
        self.gw, self.key = gw, key
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked = {sb: [] for sb in sandboxes}
        self.failures = []
        self.retries = {}
        self.slowest = 0.0
        self.threads = [threading.Thread(target=self.worker, args=(sb,)) for sb in sandboxes]

    def count(self, what):
        with self.lock:
            self.retries[what] = self.retries.get(what, 0) + 1

    def exec_once(self, sb, n):
        """Retries with the same Idempotency-Key while the answer says nothing of the outcome
        (503, 502, 504, a lost connection); a 409 (the sandbox is paused or moving: the exec did
        not run, and that answer is stored under its key) is retried as a new request."""
        body = {"cmd": ["sh", "-c", f"echo {n} >> /root/log"]}
        t0 = time.time()
        attempt = 0
        while time.time() < t0 + RETRY_FOR_S:
            headers = dict(self.key, **{"Idempotency-Key": f"ha-exec-{sb}-{n}-{attempt}"})
            try:
                r = kiln.http("POST", f"{self.gw.url}/v1/sandboxes/{sb}/exec", body, headers, timeout=120)
            except (urllib.error.URLError, ConnectionError, OSError, http_client_errors()) as e:
                self.count("connection " + type(e).__name__)
                time.sleep(0.5)
                continue
            if r.status == 200 and r.json().get("exit_code") == 0:
                with self.lock:
                    self.slowest = max(self.slowest, time.time() - t0)
                return True
            if r.status in (409, 502, 503, 504):
                self.count(str(r.status))
                attempt += r.status == 409
                time.sleep(0.5)
                continue
            with self.lock:
                self.failures.append((sb, n, r.status, r.data[:300]))
            return False
        with self.lock:
            self.failures.append((sb, n, "gave up", b""))
        return False

    def worker(self, sb):
        n = 0
        while not self.stop.is_set():
            n += 1
            if not self.exec_once(sb, n):
                return
            with self.lock:
                self.acked[sb].append(n)
            time.sleep(0.2)

    def start(self):
        for t in self.threads:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join()


class RollingUpgradeTest(unittest.TestCase):
    def sh(self, sb, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb}/exec", {"cmd": ["sh", "-c", cmd]}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 200, r)
        return r.json()["stdout"]

    def egress(self, sb):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb}/egress", headers=self.key)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def test_a_rolling_upgrade_to_a_new_guest_image_loses_nothing(self):
        t_start = time.time()
        # Each node with its meter on a host of its own (a network namespace); Postgres, Redis,
        # the sentinel, the bucket and HAProxy in front of two gateways on this host's address
        # facing the first, which every namespace reaches through its default route.
        nets = []
        for _ in range(3):
            nets.append(kiln.Netns())
            self.addCleanup(nets[-1].remove)
        host = nets[0].host_addr
        svc = Services(host, "172.31.0.0/16")
        self.addCleanup(svc.stop)
        svc.start()
        s3 = s3env.S3Server(host)
        self.addCleanup(s3.stop)
        db_url = (f"host={host},{host} port={svc.pg1},{svc.pg2} user={USER} dbname=kiln "
                  "target_session_attrs=read-write")
        common = dict(KILN_STORAGE_ALLOW=host, KILN_REDIS_SENTINELS=f"{host}:{svc.sent}",
                      KILN_REDIS_MASTER_NAME=MASTER, KILN_LOG_LEVEL="info")
        gws = []
        for _ in range(2):
            gws.append(kiln.Gateway(db_url, "127.0.0.1:1", master_key=gws[0].master_key if gws else None,
                                    extra_env=dict(common, KILN_HTTP_TRUSTED_PROXIES="127.0.0.1")))
            self.addCleanup(gws[-1].cleanup)
            wait_for("the gateway's admin key", lambda: gws[0].admin_key, 30)
        admin = {"Authorization": "Bearer " + gws[0].admin_key}
        self.gw = gw = kiln.Haproxy([g.port for g in gws], host)
        self.addCleanup(gw.stop)
        gw.wait_serving(lambda: gw.request("GET", "/v1/.well-known/jwks.json").status == 200)

        # Image A is the test image; image B its files under another directory and hash.
        img = kiln.guest_image()
        b_dir, image_b = kiln.image_copy("b")
        self.addCleanup(shutil.rmtree, b_dir, True)

        node_env = dict(common, KILN_MASTER_KEY=gws[0].master_key)
        nodes = [kiln.Node(db_url, gw.url, node_env, netns=ns) for ns in nets]
        self.addCleanup(lambda: [n.cleanup() for n in nodes])
        meters = [kiln.Meter(db_url, "127.0.0.1:1", n.node_id, node_env, netns=ns) for n, ns in zip(nodes, nets)]
        self.addCleanup(lambda: [m.cleanup() for m in meters])
        r = gw.request("POST", "/v1/tenants", {"name": "ha-rolling"}, admin)
        self.assertEqual(r.status, 201, r)
        self.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        r = gw.request("PUT", "/v1/storage", dict(s3.target(prefix="kiln/"), kind="s3"), self.key)
        self.assertEqual(r.status, 200, r)
        note(f"services, 2 gateways behind HAProxy and 3 nodes with their meters up in "
             f"{time.time() - t_start:.0f} s")

        sandboxes = []
        for i in range(SANDBOXES):
            r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 7200}, self.key,
                           timeout=300)
            self.assertEqual(r.status, 201, r)
            sb = r.json()["id"]
            sandboxes.append(sb)
            self.sh(sb, f"echo data-{i} > /root/data; setsid sleep 100000 </dev/null >/dev/null 2>&1 & "
                        "echo $! > /root/pid")
            r = gw.request("PUT", f"/v1/sandboxes/{sb}/egress", {"rules": [f"s{i}.example.com"]}, self.key)
            self.assertEqual(r.status, 200, r)
        egress = {sb: self.egress(sb) for sb in sandboxes}
        self.assertTrue(all(e["mode"] == "allowlist" for e in egress.values()), egress)
        placed = {sb: gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key).json()["node"]
                  for sb in sandboxes}
        note(f"{SANDBOXES} sandboxes on {len(set(placed.values()))} nodes")

        execs = Execs(gw, self.key, sandboxes)
        execs.start()
        steps = []
        try:
            time.sleep(5)
            for i, node in enumerate(list(nodes)):
                t0 = time.time()
                r = gw.request("POST", f"/v1/admin/nodes/{node.node_id}/drain", headers=admin, timeout=1800)
                self.assertEqual(r.status, 200, r)
                self.assertFalse(r.json().get("kept"), r.json())
                t1 = time.time()
                meters[i].cleanup()
                node.cleanup(keep_data=True)
                nodes[i] = kiln.Node(db_url, gw.url, dict(node_env, **image_b), node_id=node.node_id,
                                     data_dir=node.data_dir, netns=nets[i])
                meters[i] = kiln.Meter(db_url, "127.0.0.1:1", node.node_id, node_env, netns=nets[i])
                t2 = time.time()
                r = gw.request("POST", f"/v1/admin/nodes/{node.node_id}/undrain", headers=admin)
                self.assertEqual(r.status, 200, r)
                steps.append((node.node_id, t1 - t0, t2 - t1))
                note(f"node {node.node_id}: drained in {t1 - t0:.1f} s, restarted on image B in "
                     f"{t2 - t1:.1f} s; {sum(map(len, execs.acked.values()))} execs so far")
            time.sleep(5)
        finally:
            execs.finish()

        self.assertEqual(execs.failures, [], "requests failed after their retries")
        states = {n["id"]: n for n in gw.request("GET", "/v1/admin/nodes", headers=admin).json()["nodes"]}
        for node in nodes:
            self.assertEqual(states[node.node_id]["image_hash"], image_b["KILN_GUEST_IMAGE_HASH"])
        by_id = {n.node_id: n for n in nodes}
        for i, sb in enumerate(sandboxes):
            got = gw.request("GET", f"/v1/sandboxes/{sb}", headers=self.key).json()
            self.assertEqual(got["state"], "running", got)
            out = self.sh(sb, "cat /root/data; kill -0 $(cat /root/pid) && echo alive; cat /root/log")
            lines = out.splitlines()
            self.assertEqual(lines[:2], [f"data-{i}", "alive"], out[:200])
            logged = [int(x) for x in lines[2:]]
            missing = set(execs.acked[sb]) - set(logged)
            self.assertFalse(missing, f"{sb}: acknowledged execs not in its log: {sorted(missing)[:10]}")
            # its egress rules in force on the node it runs on now (the route asks that node)
            self.assertEqual(self.egress(sb), egress[sb])
            # restored on the image it was taken from: A, whatever node it runs on now
            self.assertEqual(kiln.vm_files(by_id[got["node"]], sb),
                             (img["KILN_GUEST_KERNEL"], img["KILN_GUEST_ROOTFS"]))
        r = gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        new = r.json()
        self.assertEqual(kiln.vm_files(by_id[new["node"]], new["id"]),
                         (image_b["KILN_GUEST_KERNEL"], image_b["KILN_GUEST_ROOTFS"]))

        total = sum(map(len, execs.acked.values()))
        print("test-ha figures:")
        print(f"  sandboxes {SANDBOXES}, nodes 3, whole run {time.time() - t_start:.0f} s")
        for nid, drain_s, restart_s in steps:
            print(f"  node {nid}: drain {drain_s:.1f} s, restart on the new image {restart_s:.1f} s")
        print(f"  execs acknowledged {total}, failed after retries {len(execs.failures)}")
        print(f"  retries by answer {dict(sorted(execs.retries.items()))}")
        print(f"  slowest exec (retries included) {execs.slowest:.1f} s")
        dup = 0
        for sb in sandboxes:
            out = self.sh(sb, "sort /root/log | uniq -d | wc -l")
            dup += int(out.strip() or 0)
        print(f"  exec lines written twice (a retry of an exec cut short by its move) {dup}")


if __name__ == "__main__":
    # scripts/test-ha.sh ends it with SIGTERM when interrupted: the cleanups still stop everything
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    unittest.main(verbosity=2)
