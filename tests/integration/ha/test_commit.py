"""test_commit.py - a COMMIT whose answer is lost in a failover neither doubles nor loses a request.

When Postgres's primary goes away just after it committed a transaction but before its answer
reached kiln-gateway, the gateway cannot tell from the broken connection whether the work is
done. Answering 503 (and freeing the Idempotency-Key) would make the client's retry run the work
a second time: a second tenant for one signup. common/pg.c asks the primary it reaches next for
the transaction's fate (txid_status) and reports a COMMIT that did commit as done.

The test puts a small TCP proxy between the gateway and the services fixture's Postgres. Armed,
the proxy passes the next COMMIT on to Postgres and then cuts both sides of that connection
without passing the answer back: exactly a lost answer. A signup sent then must answer 201, once;
its retry with the same key replays it; the database holds one tenant of that name.

Armed with a statement's text instead, the proxy cuts after the Sync that follows that
statement's Parse: the answer of one statement is lost, committed or not. An API key's create cut
there must leave one key of its name after the client's retry with the same Idempotency-Key, never
a second one.

With `executed` set as well, the proxy cuts after the Sync that follows an Execute of that
statement (prepared on the connection before or not): the statement has run and, outside a
transaction, committed; only its answer is lost. The commit queue's group of audit rows cut there
is written again by the writer (api/commitq.c), and its request's audit row must be there once.
"""
import os
import secrets
import socket
import struct
import threading
import time
import unittest

import kiln


class CommitCutter:
    """127.0.0.1:port -> the Postgres Unix socket `target`; cut() arms the next COMMIT's cut."""

    def __init__(self, target):
        self.target = target
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.armed = threading.Event()
        self.statement = None       # armed on this statement's Parse instead of a COMMIT
        self.executed = False       # with statement: cut after its Execute's Sync instead
        self.cuts = 0
        self.closing = False
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while not self.closing:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(self.target)
            except OSError:
                c.close()
                continue
            state = {"cut": False}
            threading.Thread(target=self.upstream, args=(c, s, state), daemon=True).start()
            threading.Thread(target=self.downstream, args=(s, c, state), daemon=True).start()

    @staticmethod
    def recv_exact(sock, n):
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def upstream(self, c, s, state):
        """Client to server, message by message (the startup message has no type byte)."""
        try:
            (n,) = struct.unpack("!I", self.recv_exact(c, 4))
            s.sendall(struct.pack("!I", n) + self.recv_exact(c, n - 4))
            parsed = False
            names = set()           # statements prepared on this connection with the text
            bound = executed = False
            while True:
                head = self.recv_exact(c, 5)
                body = self.recv_exact(c, struct.unpack("!I", head[1:])[0] - 4)
                kind = head[:1]
                commit = kind == b"Q" and body.rstrip(b"\0;").strip().upper() == b"COMMIT"
                if (self.statement and self.armed.is_set() and kind == b"P"
                        and self.statement in body):
                    parsed = True
                if self.statement and kind == b"P":
                    name = body.split(b"\0", 1)[0]
                    if self.statement in body:
                        names.add(name)
                    else:
                        names.discard(name)     # the unnamed statement, replaced
                elif kind == b"B":
                    bound = body.split(b"\0", 2)[1] in names
                elif kind == b"E" and bound:
                    executed = True
                if self.statement and self.executed:
                    commit = executed and kind == b"S"
                elif self.statement:
                    commit = parsed and kind == b"S"
                if kind == b"S" and not (commit and self.armed.is_set()):
                    executed = False
                if commit and self.armed.is_set():
                    self.armed.clear()
                    state["cut"] = True     # the answer is not passed back
                    s.sendall(head + body)
                    time.sleep(0.5)         # Postgres commits meanwhile
                    self.cuts += 1
                    break
                s.sendall(head + body)
        except (EOFError, OSError):
            pass
        for x in (c, s):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()

    def downstream(self, s, c, state):
        try:
            while True:
                data = s.recv(65536)
                if not data or state["cut"]:
                    break
                c.sendall(data)
        except OSError:
            pass

    def close(self):
        self.closing = True
        self.sock.close()


class LostCommitTest(unittest.TestCase):
    def setUp(self):
        self.db = kiln.fresh_database()
        self.addCleanup(self.db.drop)
        sockdir = kiln.services_env()["KILN_TEST_SOCKDIR"]
        self.proxy = CommitCutter(os.path.join(sockdir, ".s.PGSQL.5432"))
        self.addCleanup(self.proxy.close)
        self.gw = kiln.Gateway(
            f"host=127.0.0.1 port={self.proxy.port} user=kiln dbname={self.db.name} "
            "sslmode=disable", kiln.services_env()["KILN_REDIS_URL"])
        self.addCleanup(self.gw.cleanup)
        deadline = time.time() + 30
        while not self.gw.admin_key and time.time() < deadline:
            time.sleep(0.1)
        self.assertTrue(self.gw.admin_key)

    def test_a_signup_whose_commit_answer_is_lost_is_done_once(self):
        name = "lost-" + secrets.token_hex(4)
        headers = {"Authorization": "Bearer " + self.gw.admin_key,
                   "Idempotency-Key": "signup-" + name}
        self.proxy.armed.set()
        first = self.gw.request("POST", "/v1/tenants", {"name": name}, headers)
        self.assertEqual(self.proxy.cuts, 1, "the proxy cut no COMMIT")
        # The work committed: the gateway must say so, not 503.
        self.assertEqual(first.status, 201, first)
        tid = first.json()["tenant"]["id"]
        again = self.gw.request("POST", "/v1/tenants", {"name": name}, headers)
        self.assertEqual(again.status, 201, again)
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
        self.assertEqual(again.json()["tenant"]["id"], tid)
        self.assertEqual(self.db.sql(f"SELECT id FROM tenants WHERE name = '{name}'"), tid)
        # The signup's free tier is in the ledger once.
        self.assertEqual(self.db.sql(
            f"SELECT count(*) FROM ledger_transfers WHERE tenant_id = '{tid}'"), "1")
        self.assertEqual(self.gw.stop(), 0, self.gw.output()[-4000:])

    def test_a_key_create_whose_answer_is_lost_leaves_one_key(self):
        name = "lostkey-" + secrets.token_hex(4)
        headers = {"Authorization": "Bearer " + self.gw.admin_key,
                   "Idempotency-Key": "key-" + name}
        self.proxy.statement = b"INSERT INTO api_keys"
        self.proxy.armed.set()
        first = self.gw.request("POST", "/v1/api-keys", {"name": name, "scopes": ["sandbox:read"]}, headers)
        self.assertEqual(self.proxy.cuts, 1, f"the proxy cut no statement: {first!r}")
        self.assertIn(first.status, (201, 503), first)
        again = self.gw.request("POST", "/v1/api-keys", {"name": name, "scopes": ["sandbox:read"]}, headers)
        self.assertEqual(again.status, 201, again)
        if first.status == 201:
            self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
            self.assertEqual(again.json()["id"], first.json()["id"])
        self.assertEqual(self.db.sql(
            f"SELECT count(*) FROM api_keys WHERE name = '{name}'"), "1")
        self.assertEqual(self.gw.stop(), 0, self.gw.output()[-4000:])

    def test_an_audit_group_whose_answer_is_lost_is_written_once(self):
        """The commit queue's insert commits, its answer is lost, and the writer writes the group
        again on a new connection: the requests' audit rows are there once each, with and
        without an outcome in the group (an Idempotency-Key's stored reply)."""
        auth = {"Authorization": "Bearer " + self.gw.admin_key}
        # Only the commit queue's statement names row_id (the debt sweep's audit insert does not).
        self.proxy.statement = b"request_id, row_id) SELECT * FROM unnest"
        self.proxy.executed = True
        for keyed in (False, True):
            with self.subTest(keyed=keyed):
                self.audit_cut_once(auth, keyed)
        self.assertIn("retrying", self.gw.output())
        self.assertEqual(self.gw.stop(), 0, self.gw.output()[-4000:])

    def audit_cut_once(self, auth, keyed):
        """One POST whose audit insert is cut after it ran; its audit row is there once."""
        name = "auditcut-" + secrets.token_hex(4)
        headers = dict(auth, **({"Idempotency-Key": "k-" + name} if keyed else {}))
        cuts = self.proxy.cuts
        self.proxy.armed.set()
        first = self.gw.request("POST", "/v1/api-keys",
                                {"name": name, "scopes": ["sandbox:read"]}, headers)
        self.assertEqual(self.proxy.cuts, cuts + 1, f"the proxy cut no insert: {first!r}")
        self.assertEqual(first.status, 201, first)
        rid = first.headers["X-Request-Id"]
        self.assertEqual(self.db.sql(
            f"SELECT count(*) FROM audit_log WHERE request_id = '{rid}'"), "1",
            f"keyed={keyed}: the audit row of {rid} is not there once")
        self.assertEqual(self.db.sql(
            f"SELECT count(*) FROM api_keys WHERE name = '{name}'"), "1")
        if keyed:
            again = self.gw.request("POST", "/v1/api-keys",
                                    {"name": name, "scopes": ["sandbox:read"]}, headers)
            self.assertEqual(again.status, 201, again)
            self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
            self.assertEqual(again.json()["id"], first.json()["id"])


if __name__ == "__main__":
    unittest.main()
