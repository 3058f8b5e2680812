"""A reply the client saw survives a crash: its Idempotency-Key outcome is durable before it goes out.

Concurrent POST /v1/tokens, each with a key of its own, while the gateway is killed (-9) and then
Postgres stopped in immediate mode (what a power cut of the host does to both); then Postgres
comes back, a new gateway starts on the same database, and every key whose 201 the client had
read is sent again: each must answer the very token it answered before, replayed. The gateway
writes those outcomes in groups (api/commitq.c); a reply sent before its outcome was committed
(or one committed without waiting for the WAL flush) would come back as a new token or a 409.

Postgres here waits 100 ms before each WAL flush (commit_delay, with commit_siblings 0 so that
it always does): a synchronous commit then takes that long, so an outcome committed after its
reply went out is still uncommitted when the crash comes right after the reply was read.

It stops Postgres, so it runs a Postgres and Redis pair of its own.
"""
import os
import signal
import subprocess
import threading
import unittest
import uuid

import kiln
from authtest import GENEROUS, bearer

LIB = os.path.join(kiln.ROOT, "scripts", "lib.sh")
CLIENTS = 8
REPLIES = 40  # 201s each client reads before the crash
ROUNDS = 3


class DurableReplyTests(unittest.TestCase):
    def setUp(self):
        self.env, self.db = kiln.own_services(self)
        for sql in ("ALTER SYSTEM SET commit_delay = 100000",
                    "ALTER SYSTEM SET commit_siblings = 0", "SELECT pg_reload_conf()"):
            kiln.psql(self.env["KILN_TEST_SOCKDIR"], "postgres", sql)
        self.gw = None

    def shell(self, script):
        subprocess.run(["bash", "-c", f". {LIB}; {script}"], check=True, capture_output=True)

    def start_gateway(self, master_key=None):
        self.gw = kiln.Gateway(self.db.url, self.env["KILN_REDIS_URL"], GENEROUS,
                               master_key=master_key)
        self.addCleanup(self.gw.cleanup)
        return self.gw

    def crash(self):
        """The gateway killed, then Postgres stopped without a checkpoint or a WAL flush."""
        self.gw.stop(signal.SIGKILL)
        d = self.env["KILN_TEST_DIR"]
        self.shell(f'runuser -u "$KILN_USER" -- "$KILN_PG_BIN/pg_ctl" -D {d}/pg -m immediate -w stop')
        self.shell(f"kiln_pg_start {d}/pg {d}/s {d}/pg.log")

    def post_until_crash(self, gw, headers):
        """CLIENTS threads POST /v1/tokens with fresh keys until the crash; returns
        {key: body} of every 201 a client read in full."""
        seen, counts, lock = {}, [0] * CLIENTS, threading.Lock()
        ready = threading.Condition(lock)

        def client(i):
            while True:
                key = "durable-" + uuid.uuid4().hex
                try:
                    r = gw.request("POST", "/v1/tokens", {"ttl_s": 60},
                                   dict(headers, **{"Idempotency-Key": key}), timeout=10)
                except Exception:  # the gateway is gone
                    return
                if r.status == 201:
                    with lock:
                        seen[key] = r.data
                        counts[i] += 1
                        ready.notify()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        with lock:  # every client has read REPLIES replies and is still sending
            ok = ready.wait_for(lambda: min(counts) >= REPLIES, timeout=240)
        self.crash()
        for t in threads:
            t.join()
        self.assertTrue(ok, f"replies per client before the crash: {counts}")
        return seen

    def test_every_reply_read_before_a_crash_is_replayed_after_it(self):
        gw = self.start_gateway()
        master = gw.master_key
        r = gw.request("POST", "/v1/tenants", {"name": "durable"}, bearer(gw.admin_key))
        self.assertEqual(r.status, 201, r)
        headers = bearer(r.json()["api_key"]["key"])
        for round_ in range(ROUNDS):
            seen = self.post_until_crash(gw, headers)
            self.assertGreaterEqual(len(seen), CLIENTS * REPLIES)
            gw = self.start_gateway(master)
            lost = []
            for key, body in seen.items():
                again = gw.request("POST", "/v1/tokens", {"ttl_s": 60},
                                   dict(headers, **{"Idempotency-Key": key}))
                if again.status != 201 or again.data != body or \
                        again.headers.get("Idempotent-Replayed") != "true":
                    lost.append((key, again.status, again.headers.get("Idempotent-Replayed")))
            self.assertEqual(lost, [], f"round {round_ + 1}: {len(lost)} of {len(seen)} replies "
                                       "read before the crash came back otherwise")
            # Each key has its own outcome: as many distinct tokens as keys.
            self.assertEqual(len(set(seen.values())), len(seen))


if __name__ == "__main__":
    unittest.main()
