"""Port URLs through the real kiln-gateway and kiln-node without a VM: the node's hostagent hook
(docs/vmm.md) runs each sandbox's guest agent, the build's own kiln-agent, as a process on the
host, so the port stream ends at an HTTP server on the host's loopback (portserver.py). This is
the setup bench/ports/stub.sh measures; the test keeps it working: a request, a streamed reply,
a WebSocket echo both ways, a port nothing listens on, a signed URL's cookie that a forged one
for the parent domain does not shadow, and the hook's agent changing nothing of the host's (its
uid is the sandbox's, the host name stays).
"""
import base64
import os
import re
import socket
import unittest
import urllib.parse

import kiln
import portserver as ps


class PortsStubTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.hostname = socket.gethostname()
        cls.stack = kiln.Stack(hostagent=True, node_env={"KILN_LOG_LEVEL": "info"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.srv = ps.serve()
        cls.addClassCleanup(cls.srv.server_close)
        cls.addClassCleanup(cls.srv.shutdown)
        cls.port = cls.srv.server_address[1]
        cls.key = cls.stack.tenant("ports-stub")
        r = cls.stack.gw.request("POST", "/v1/sandboxes", {}, cls.key, timeout=60)
        assert r.status == 201, r
        cls.sb = r.json()["id"]
        r = cls.stack.gw.request("GET", f"/v1/sandboxes/{cls.sb}/ports/{cls.port}", headers=cls.key)
        assert r.status == 200, r
        u = urllib.parse.urlparse(r.json()["url"])
        cls.addr, cls.host = ("127.0.0.1", u.port), u.netloc

    def head(self, path, extra=""):
        return (f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Authorization: {self.key['Authorization']}\r\n{extra}\r\n").encode()

    def test_a_request_through_the_port_url_reaches_the_hosts_server(self):
        data = ps.get(self.addr, self.head("/"))
        self.assertTrue(data.startswith(b"HTTP/1.1 200"), data[:200])
        self.assertTrue(data.endswith(b"\r\n\r\n" + ps.HELLO), data[-200:])
        # without a credential 401; nothing listening on a port: the node's 502 port_closed
        data = ps.get(self.addr, f"GET / HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
        self.assertTrue(data.startswith(b"HTTP/1.1 401"), data[:200])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        host = self.host.replace(f"{self.port}-", f"{closed}-", 1)
        data = ps.get(self.addr, self.head("/").replace(self.host.encode(), host.encode()))
        self.assertTrue(data.startswith(b"HTTP/1.1 502"), data[:200])
        self.assertIn(b"port_closed", data)

    def test_a_streamed_reply_arrives_as_it_is_written(self):
        s = socket.create_connection(self.addr, timeout=60)
        self.addCleanup(s.close)
        s.sendall(self.head("/drip"))
        data, arrivals = ps.arrivals(s)
        self.assertTrue(data.startswith(b"HTTP/1.1 200"), data[:200])
        self.assertEqual(len(arrivals), 3, data)
        self.assertGreater(arrivals[2] - arrivals[0], 1.5 * ps.DRIP_S, arrivals)
        self.assertTrue(data.endswith(b"0\r\n\r\n"), data[-50:])

    def test_a_websocket_echoes_both_ways(self):
        s = socket.create_connection(self.addr, timeout=60)
        self.addCleanup(s.close)
        key = base64.b64encode(os.urandom(16))
        s.sendall(self.head("/ws", "Connection: Upgrade\r\nUpgrade: websocket\r\n"
                                   f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key.decode()}\r\n"))
        status, head, rest = ps.read_head(s)
        self.assertEqual(status, 101, head)
        self.assertIn("Sec-WebSocket-Accept: " + ps.ws_accept(key).decode(), head)
        ws = ps.WsReader(s, rest)
        self.assertEqual(ws.frame(), b"hello")
        for msg in (b"one", b"y" * 3000):
            s.sendall(ps.ws_frame(msg, masked=True))
            self.assertEqual(ws.frame(), msg)

    def test_a_cookie_tossed_for_the_parent_domain_does_not_shadow_the_origins_own(self):
        r = self.stack.gw.request("POST", f"/v1/sandboxes/{self.sb}/ports/{self.port}/url",
                                  {"expires_in_s": 120}, self.key)
        self.assertEqual(r.status, 200, r)
        u = urllib.parse.urlparse(r.json()["url"])
        data = ps.get(self.addr, f"GET {u.path}?{u.query} HTTP/1.1\r\nHost: {self.host}\r\n\r\n"
                      .encode())
        self.assertTrue(data.startswith(b"HTTP/1.1 302"), data[:300])
        mine = re.search(rb"Set-Cookie: (kiln_port=[^;]+);", data).group(1).decode()
        # another sandbox's page set kiln_port for the parent domain; the browser sends both
        forged = "kiln_port=" + mine.split("=", 1)[1][:-1] + ("0" if mine[-1] != "0" else "1")
        for cookie, want in ((f"{forged}; {mine}", b"HTTP/1.1 200"),
                             (f"{mine}; {forged}", b"HTTP/1.1 200"),
                             (forged, b"HTTP/1.1 403")):
            data = ps.get(self.addr, f"GET / HTTP/1.1\r\nHost: {self.host}\r\nCookie: {cookie}\r\n\r\n"
                          .encode())
            self.assertTrue(data.startswith(want), (cookie, data[:300]))

    def agents(self):
        """/proc/PID/status of the node's hook agents (the build's kiln-agent in its cgroups)."""
        agents = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
                with open(f"/proc/{pid}/status") as f, open(f"/proc/{pid}/cgroup") as g:
                    st, cg = f.read(), g.read()
            except OSError:
                continue
            if exe == kiln.HOSTAGENT and f"/{self.stack.node.node_id}/" in cg:
                agents.append(st)
        return agents

    def test_the_hooks_agent_changes_nothing_of_the_hosts(self):
        # the agent took the sandbox's identity (its host name and clock) without touching the host's
        self.assertEqual(socket.gethostname(), self.hostname)
        agents = self.agents()
        self.assertEqual(len(agents), 1, agents)
        uids = [line.split()[1:] for line in agents[0].splitlines() if line.startswith("Uid:")][0]
        self.assertNotIn("0", uids)
        self.assertIn("NoNewPrivs:\t1", agents[0])
        self.assertIn("Seccomp:\t2", agents[0])


    def test_zz_a_deleted_sandbox_leaves_no_agent_nor_socket(self):
        r = self.stack.gw.request("DELETE", f"/v1/sandboxes/{self.sb}", None, self.key, timeout=60)
        self.assertIn(r.status, (200, 204), r)
        self.assertEqual(self.agents(), [])
        socks = [os.path.join(d, f) for d, _, fs in os.walk(self.stack.node.run_dir)
                 for f in fs if f == "agent.sock"]
        self.assertEqual(socks, [])
        data = ps.get(self.addr, self.head("/"))
        self.assertTrue(data.startswith(b"HTTP/1.1 404"), data[:200])


if __name__ == "__main__":
    unittest.main()
