"""GET /v1/audit: the tenant's mutating requests, newest first, with cursor paging, and no other
tenant's entries."""
import re
import subprocess
import threading
import time
import unittest
import urllib.parse

from authtest import GatewayCase, bearer, jwt_parts, poll

# How many statements wait on a lock of audit_log.
WAITING = "SELECT count(*) FROM pg_locks WHERE relation = 'audit_log'::regclass AND NOT granted"


class AuditTests(GatewayCase):
    def setUp(self):
        super().setUp()
        self.tid, self.key, self.h = self.new_tenant("audited")
        _, other, self.other = self.new_tenant("neighbour")
        self.other_key = other["id"]

    def test_mutations_appear_newest_first_with_key_route_object_and_status(self):
        _, k, h = self.new_tenant("fresh")
        sent = []

        def mutate(method, path, body, headers, status):
            """One mutating request, whose entry is there as soon as its reply is."""
            r = self.expect(self.call(method, path, body, headers), status)
            sent.append(r)
            self.audit(h, len(sent))
            return r

        # Reads are not audited.
        self.expect(self.call("GET", "/v1/api-keys", headers=h), 200)
        made = mutate("POST", "/v1/api-keys", {"name": "second", "scopes": ["sandbox:read", "keys:write"]},
                      h, 201).json()
        second = bearer(made["key"])
        tok = mutate("POST", "/v1/tokens", {"ttl_s": 60}, h, 201).json()["token"]
        jti = jwt_parts(tok)[1]["jti"]
        mutate("POST", "/v1/api-keys", {"name": "x", "scopes": ["nope"]}, h, 422)
        mutate("DELETE", "/v1/api-keys/key_missing", None, second, 404)
        # A request through a JWT is recorded under the key the token came from.
        third = mutate("POST", "/v1/api-keys", {"name": "by-jwt", "scopes": ["sandbox:read"]},
                       bearer(tok), 201).json()
        mutate("DELETE", f"/v1/api-keys/{made['id']}", None, h, 204)
        # A refused scope is recorded as well: the key was known.
        mutate("POST", "/v1/tokens", {"scopes": ["admin"]}, h, 403)
        want = [
            (k["id"], "POST", "/v1/tokens", None, 403),
            (k["id"], "DELETE", "/v1/api-keys/{id}", made["id"], 204),
            (k["id"], "POST", "/v1/api-keys", third["id"], 201),
            (made["id"], "DELETE", "/v1/api-keys/{id}", "key_missing", 404),
            (k["id"], "POST", "/v1/api-keys", None, 422),
            (k["id"], "POST", "/v1/tokens", jti, 201),
            (k["id"], "POST", "/v1/api-keys", made["id"], 201),
        ]
        entries = self.audit(h, len(want))
        got = [(e["key_id"], e["method"], e["route"], e["object_id"], e["status"]) for e in entries]
        self.assertEqual(got, want)
        self.assertEqual([e["request_id"] for e in entries],
                         [r.headers["X-Request-Id"] for r in reversed(sent)])
        ids = [int(e["id"]) for e in entries]
        self.assertEqual(ids, sorted(ids, reverse=True))
        times = [e["created_at"] for e in entries]
        self.assertEqual(times, sorted(times, reverse=True))

    def test_object_ids_are_recorded_byte_for_byte(self):
        """Audit rows are written in groups as array literals (api/commitq.c): quotes,
        backslashes, commas, braces and the word NULL in an id stay what they were."""
        _, _, h = self.new_tenant("quoted")
        ids = ['a"b', "c\\d", "e,f", "{g}", "NULL", "h i"]
        for i in ids:
            self.expect(self.call("DELETE", "/v1/api-keys/" + urllib.parse.quote(i, safe=""),
                                  None, h), 404)
        got = [e["object_id"] for e in self.audit(h, len(ids))]
        self.assertEqual(got, list(reversed(ids)))

    def test_object_ids_that_are_not_utf8_are_recorded_escaped(self):
        """A path's %FF is decoded into the object id; Postgres refuses text that is not UTF-8,
        so each byte that starts no valid sequence is recorded as \\xNN, and valid characters
        (here an e with an acute accent) stay as they are."""
        _, _, h = self.new_tenant("bytes")
        statuses = [self.call("DELETE", "/v1/api-keys/" + path, None, h).status
                    for path in ("%FF", "a%C3%A9%C3b%ED%A0%80")]
        got = [(e["object_id"], e["status"]) for e in self.audit(h, 2)]
        self.assertEqual(got, [("a\u00e9\\xC3b\\xED\\xA0\\x80", statuses[1]),
                               ("\\xFF", statuses[0])])

    def lock_audit_log(self):
        """A psql session holding a lock of audit_log that blocks inserts; its caller writes
        COMMIT to its stdin (and closes it) to release it."""
        locker = subprocess.Popen(["psql", "-h", self.db.sockdir, "-U", "kiln", "-d",
                                   self.db.name, "-tAq", "-v", "ON_ERROR_STOP=1"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.addCleanup(locker.wait)
        self.addCleanup(lambda: locker.stdin.closed or locker.stdin.close())
        locker.stdin.write("BEGIN; LOCK TABLE audit_log IN SHARE MODE; SELECT 'locked';\n")
        locker.stdin.flush()
        self.assertEqual(locker.stdout.readline().strip(), "locked")
        return locker

    def deletes_behind_the_lock(self, ids, h):
        """Starts a DELETE of each of `ids` on its own thread: the first until its audit insert
        waits on the lock, then the rest. Returns the threads and the statuses they fill in."""
        statuses = {}

        def delete(i):
            statuses[i] = self.call("DELETE", "/v1/api-keys/" + i, None, h).status

        threads = [threading.Thread(target=delete, args=(i,)) for i in ids]
        threads[0].start()
        self.assertTrue(poll(lambda: self.db.sql(WAITING) == "1", 30))
        for t in threads[1:]:
            t.start()
        return threads, statuses

    def test_a_group_whose_connection_is_lost_is_retried_by_the_writer(self):
        """The writer's connection is lost while its group waits (its backend is terminated):
        the writer writes the group again on a new connection, and the requests queued behind it
        wait for it instead of each writing its row alone on a connection of the audit pool, so
        no more than one insert ever waits on the lock."""
        _, _, h = self.new_tenant("retried")
        locker = self.lock_audit_log()
        ids = ["lost-%d" % i for i in range(4)]
        threads, statuses = self.deletes_behind_the_lock(ids, h)
        time.sleep(1)   # the others queue behind the first row's group
        self.db.sql("SELECT pg_terminate_backend(pid) FROM pg_locks "
                    "WHERE relation = 'audit_log'::regclass AND NOT granted")
        seen = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            seen.append(int(self.db.sql(WAITING)))
            time.sleep(0.05)
        locker.stdin.write("COMMIT;\n")
        locker.stdin.close()
        for t in threads:
            t.join()
        self.assertLessEqual(max(seen), 1, seen)
        self.assertIn(1, seen)      # the group waits again, on the writer's new connection
        self.assertEqual(set(statuses.values()), {404}, statuses)
        got = sorted(e["object_id"] for e in self.audit(h, len(ids)))
        self.assertEqual(got, ids)

    def test_an_outcome_whose_group_stays_unwritten_is_stored_after_the_reply(self):
        """Postgres unavailable to the writer for longer than its 2 s of retries (its insert's
        backend terminated again and again while a lock of audit_log holds it): the reply goes
        out while the lock is still held, without its audit row, and its outcome is stored after
        it, so a retry of the key replays the same token. Before, the reply waited the whole
        outage (up to idempotency_finish_s)."""
        _, _, h = self.new_tenant("outage")
        locker = self.lock_audit_log()
        hdrs = dict(h, **{"Idempotency-Key": "outage-1"})
        got = {}

        def post():
            got["r"] = self.call("POST", "/v1/tokens", {"ttl_s": 60}, hdrs)

        t = threading.Thread(target=post)
        t.start()
        self.assertTrue(poll(lambda: self.db.sql(WAITING) == "1", 30))
        stop = time.monotonic() + 20
        while t.is_alive() and time.monotonic() < stop:
            self.db.sql("SELECT pg_terminate_backend(pid) FROM pg_locks "
                        "WHERE relation = 'audit_log'::regclass AND NOT granted")
            time.sleep(0.2)
        replied_in_outage = not t.is_alive()
        locker.stdin.write("COMMIT;\n")
        locker.stdin.close()
        t.join()
        self.assertTrue(replied_in_outage, "the reply waited for the audit table's lock")
        self.assertEqual(got["r"].status, 201, got["r"])
        token = got["r"].json()["token"]
        again = None
        for _ in range(50):     # the done hook stores it just after the reply
            again = self.call("POST", "/v1/tokens", {"ttl_s": 60}, hdrs)
            if again.status != 409:
                break
            time.sleep(0.2)
        self.assertEqual(again.status, 201, again)
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true", again)
        self.assertEqual(again.json()["token"], token)

    def test_a_row_refused_in_a_group_fails_alone(self):
        """A group whose statement Postgres refuses for one row's data is split down to that
        row: the others commit in the group's halves, and only the bad row is written alone (and
        refused again). A check constraint refuses one object id; a lock on audit_log holds the
        writer on a first row while the others queue behind it as one group."""
        _, _, h = self.new_tenant("split")
        logged = len(self.gw.output())     # the gateway's log is the class's: this test's part
        self.db.sql("ALTER TABLE audit_log ADD CONSTRAINT t_refuse_one "
                    "CHECK (object_id IS DISTINCT FROM 'refused-row') NOT VALID")
        self.addCleanup(self.db.sql, "ALTER TABLE audit_log DROP CONSTRAINT t_refuse_one")
        locker = self.lock_audit_log()
        ids = ["first"] + ["good-%d" % i for i in range(4)] + ["refused-row"] + \
              ["good-%d" % i for i in range(4, 8)]
        threads, statuses = self.deletes_behind_the_lock(ids, h)
        # The rest reach the queue while the writer waits on the lock (their handlers take no
        # lock of audit_log); one that came later would only make a group of its own.
        time.sleep(2)
        locker.stdin.write("COMMIT;\n")
        locker.stdin.close()
        for t in threads:
            t.join()
        self.assertEqual(set(statuses.values()), {404}, statuses)
        got = sorted(e["object_id"] for e in self.audit(h, len(ids) - 1))
        self.assertEqual(got, sorted(i for i in ids if i != "refused-row"))
        failed = lambda: re.findall(r"(\d+) audit rows and outcomes (?:was )?not written",
                                    self.gw.output()[logged:])
        self.assertTrue(poll(failed, 10))
        self.assertEqual(failed(), ["1"])

    def test_unauthenticated_requests_leave_no_entry(self):
        _, _, h = self.new_tenant("quiet")
        self.expect(self.call("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]},
                              bearer("kiln_sk_key_" + "a" * 26 + "_" + "b" * 52)), 401)
        self.new_key(h, ["sandbox:read"])
        self.assertEqual([e["route"] for e in self.audit(h, 1)], ["/v1/api-keys"])

    def test_paging_with_limit_1_walks_every_entry_once(self):
        made = []
        for i in range(5):
            made.append(self.new_key(self.h, ["sandbox:read"], name=f"page-{i}")["id"])
            # The neighbour is busy at the same time.
            self.new_key(self.other, ["sandbox:read"], name=f"other-{i}")
        everything = self.audit(self.h, 5)
        self.assertEqual({e["object_id"] for e in everything}, set(made))
        walked, cursor, pages = [], None, 0
        while True:
            q = "/v1/audit?limit=1" + (f"&cursor={cursor}" if cursor else "")
            page = self.expect(self.call("GET", q, headers=self.h), 200).json()
            pages += 1
            self.assertLessEqual(len(page["entries"]), 1)
            walked += page["entries"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
            self.assertIsInstance(cursor, str)
            self.assertLess(pages, 100)
        self.assertEqual(walked, everything)
        self.assertEqual(pages, 5)
        # A bigger page joins up the same way.
        p1 = self.expect(self.call("GET", "/v1/audit?limit=2", headers=self.h), 200).json()
        p2 = self.expect(self.call("GET", f"/v1/audit?limit=2&cursor={p1['next_cursor']}",
                                   headers=self.h), 200).json()
        self.assertEqual(p1["entries"] + p2["entries"], everything[:4])

    def test_another_tenants_entries_never_appear(self):
        theirs = self.new_key(self.other, ["sandbox:read"], name="theirs")
        self.expect(self.call("DELETE", f"/v1/api-keys/{theirs['id']}", headers=self.other), 204)
        mine = self.new_key(self.h, ["sandbox:read"], name="mine")
        entries = self.audit(self.h, 1)
        self.assertIn(mine["id"], [e["object_id"] for e in entries])
        self.assertNotIn(theirs["id"], [e["object_id"] for e in entries])
        self.assertNotIn(self.other_key, [e["key_id"] for e in entries])
        self.assertEqual({e["key_id"] for e in entries}, {self.key["id"]})
        # A cursor from the other tenant's trail shows nothing of theirs either.
        top = self.db.sql("SELECT max(seq) + 1 FROM audit_log")
        r = self.expect(self.call("GET", f"/v1/audit?cursor={top}&limit=500", headers=self.h), 200)
        self.assertEqual({e["key_id"] for e in r.json()["entries"]}, {self.key["id"]})
        # The operator's tenant creations are the operator's, not the tenant's.
        self.assertNotIn("/v1/tenants", [e["route"] for e in entries])


if __name__ == "__main__":
    unittest.main()
