"""Processes that outlive their request: start, re-attach, list, stdin, signals and a PTY, through the public API."""
import http.client
import json
import time
import unittest
import urllib.parse

import kiln


def ndjson(gw, path, headers, until=None, timeout=120):
    """GETs an NDJSON stream; returns its lines as objects, leaving early once `until(line)` holds."""
    u = urllib.parse.urlparse(gw.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("GET", path, headers=headers)
    r = conn.getresponse()
    assert r.status == 200, (r.status, r.read())
    assert r.getheader("Content-Type").startswith("application/x-ndjson")
    lines = []
    while True:
        raw = r.readline()
        if not raw:
            break
        assert raw.strip(), "a blank line in NDJSON"
        lines.append(json.loads(raw))
        if until and until(lines[-1]):
            break
    conn.close()  # a client that leaves early only detaches
    return lines


def text(lines, kind="stdout"):
    return "".join(l["data"] for l in lines if l["type"] == kind)


class ProcessTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("acme")
        cls.other = cls.stack.tenant("globex")
        r = cls.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600},
                           cls.key, timeout=300)
        assert r.status == 201, r
        cls.sb = r.json()
        cls.base = f"/v1/sandboxes/{cls.sb['id']}/processes"

    def start(self, body):
        r = self.gw.request("POST", self.base, body, self.key, timeout=60)
        self.assertEqual(r.status, 201, r)
        return r.json()["pid"]

    def test_a_process_outlives_its_stream_takes_stdin_is_listed_and_killed(self):
        pid = self.start({"cmd": ["sh", "-c", "echo start $A; read x; echo got:$x; exec sleep 600"],
                          "env": {"A": "1"}, "cwd": "/tmp", "tag": "worker"})
        first = ndjson(self.gw, f"{self.base}/{pid}/stream", self.key,
                       until=lambda l: "start 1" in l.get("data", ""))
        self.assertEqual(first[0], {"type": "start", "pid": pid})
        self.assertIn("start 1\n", text(first))
        # the stream dropped; the process runs on
        r = self.gw.request("GET", self.base, None, self.key)
        self.assertEqual(r.status, 200, r)
        me = [p for p in r.json()["processes"] if p["pid"] == pid]
        self.assertEqual(len(me), 1, r)
        self.assertEqual((me[0]["tag"], me[0]["cwd"], me[0]["env"], me[0]["running"], me[0]["exit_code"]),
                         ("worker", "/tmp", ["A"], True, None))
        self.assertEqual(me[0]["argv"][0], "sh")
        r = self.gw.request("POST", f"{self.base}/{pid}/stdin", b"hello\n", self.key)
        self.assertEqual(r.status, 204, r)
        again = ndjson(self.gw, f"{self.base}/{pid}/stream", self.key,
                       until=lambda l: "got:hello" in l.get("data", ""))
        self.assertIn("start 1\ngot:hello\n", text(again))
        r = self.gw.request("POST", f"{self.base}/{pid}/signal", {"signal": "SIGKILL"}, self.key)
        self.assertEqual(r.status, 204, r)
        end = ndjson(self.gw, f"{self.base}/{pid}/stream?replay=0", self.key)
        self.assertEqual(end[-1]["type"], "exit", end)
        self.assertEqual((end[-1]["exit_code"], end[-1]["signal"]), (137, 9))
        self.assertEqual(text(end), "")
        r = self.gw.request("POST", f"{self.base}/{pid}/signal", {"signal": "SIGTERM"}, self.key)
        self.assertEqual(r.status, 409, r)  # ended: kept and listed, but past signals
        r = self.gw.request("POST", f"{self.base}/{pid}/stdin", b"late", self.key)
        self.assertEqual(r.status, 409, r)

    def test_a_pty_shell_sees_its_size_and_a_resize(self):
        pid = self.start({"cmd": ["/bin/sh"], "pty": {"rows": 24, "cols": 80}})
        r = self.gw.request("POST", f"{self.base}/{pid}/stdin", b"stty size\n", self.key)
        self.assertEqual(r.status, 204, r)
        first = ndjson(self.gw, f"{self.base}/{pid}/stream", self.key,
                       until=lambda l: "24 80" in l.get("data", ""))
        self.assertIn("24 80", text(first))
        r = self.gw.request("POST", f"{self.base}/{pid}/resize", {"rows": 40, "cols": 100}, self.key)
        self.assertEqual(r.status, 204, r)
        r = self.gw.request("POST", f"{self.base}/{pid}/stdin", b"stty size; exit 5\n", self.key)
        self.assertEqual(r.status, 204, r)
        # With the output from the start: the shell may answer before a stream without replay
        # is attached, and that answer would be missed.
        end = ndjson(self.gw, f"{self.base}/{pid}/stream", self.key)
        self.assertIn("40 100", text(end).split("24 80", 1)[1])
        self.assertEqual(end[-1]["exit_code"], 5, end)

    def test_bad_requests_and_other_tenants_change_nothing(self):
        pid = self.start({"cmd": ["sleep", "600"]})
        for path, body in ((f"{self.base}/{pid}/signal", {"signal": "SIGNOPE"}),
                           (f"{self.base}/{pid}/resize", {"rows": 0, "cols": 10}),
                           (f"{self.base}/{pid}/resize", {"rows": 10, "cols": 10}),
                           (self.base, {"cmd": ["true"], "pty": {"rows": 5000, "cols": 1}}),
                           (self.base, {"cmd": ["true"], "tag": "x" * 65})):
            r = self.gw.request("POST", path, body, self.key)
            self.assertEqual(r.status, 422, (path, body, r))
        self.assertEqual(self.gw.request("POST", f"{self.base}/999999/signal", {"signal": 9},
                                         self.key).status, 404)
        self.assertEqual(self.gw.request("GET", f"{self.base}/abc/stream", None, self.key).status, 404)
        for method, path, body in (("GET", self.base, None),
                                   ("POST", self.base, {"cmd": ["true"]}),
                                   ("GET", f"{self.base}/{pid}/stream", None),
                                   ("POST", f"{self.base}/{pid}/signal", {"signal": "SIGKILL"}),
                                   ("POST", f"{self.base}/{pid}/stdin", b"x")):
            r = self.gw.request(method, path, body, self.other)
            self.assertEqual(r.status, 404, (method, path, r))
        r = self.gw.request("GET", self.base, None, self.key)
        me = [p for p in r.json()["processes"] if p["pid"] == pid]
        self.assertTrue(me and me[0]["running"], r)


if __name__ == "__main__":
    unittest.main()
