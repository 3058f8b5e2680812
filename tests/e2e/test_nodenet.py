"""kiln-node's own host network setup (node/netsetup.c): a real sandbox reaches the internet
through the host's own routing and masquerade, and nothing the test sets up in the host.

The whole stack runs inside a network namespace of the test's own ("the host", as a fresh
machine: forwarding off, no firewall), wired by a veth to another ("the uplink") that holds an
HTTP server answering with the address it saw the request come from. The host has only the
veth's connected routes (no route or NAT made by the test), and the uplink has no route at all
back to the sandboxes' ranges: a reply reaches a sandbox only if the host masqueraded its
request. Run as a script: it builds the two namespaces, runs the tests inside the host one, and
removes everything afterwards (the node's nftables tables live and die with the host namespace).
"""
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest

import kiln

HERE = os.path.dirname(os.path.abspath(__file__))
HOST4, SERVER4 = "203.0.113.1", "203.0.113.80"
HOST6, SERVER6 = "2001:db8:5::1", "2001:db8:5::80"
LATE4 = "203.0.113.7"  # a host address added after the sandbox's policy was attached
PORT = 8080
SERVER = r'''
import http.server, socket, socketserver, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("from " + self.client_address[0]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
class S4(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
class S6(S4):
    address_family = socket.AF_INET6
servers = [S4((sys.argv[1], int(sys.argv[3])), H), S6((sys.argv[2], int(sys.argv[3])), H)]
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
'''
# Opens 20 connections to the uplink's server and holds them: prints its pid, how many it got
# and how many were refused (a TCP reset, at once).
HOLDER = f'''
import os, socket, time
socks, res = [], []
for i in range(20):
    try:
        socks.append(socket.create_connection(("{SERVER4}", {PORT}), timeout=10))
        res.append("ok")
    except ConnectionRefusedError:
        res.append("refused")
    except Exception:
        res.append("fail")
print(os.getpid(), res.count("ok"), res.count("refused"), flush=True)
time.sleep(600)
'''
PROBE = r'''
import socket, urllib.request
def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode().replace(" ", "=")
    except Exception as e:
        return "fail"
def tcp(host, port):
    try:
        s = socket.create_connection((host, port), timeout=4)
        s.settimeout(4)
        d = s.recv(64)
        s.close()
        return "ok" if d else "empty"
    except Exception:
        return "fail"
'''


def table_name(node_id):
    return "kiln_" + node_id.replace("-", "_")


def nft_tables():
    out = subprocess.run(["nft", "list", "tables"], check=True, capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def sysctl(name):
    with open("/proc/sys/" + name.replace(".", "/")) as f:
        return f.read().strip()


class Listener:
    """A TCP server in the host's own namespace that says hi to whoever connects."""

    def __init__(self, addr):
        self.sock = socket.create_server((addr, 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            c.sendall(b"hi")
            c.close()

    def close(self):
        self.sock.close()


class NodeNetworkTests(unittest.TestCase):
    def setUp(self):
        # The host as the test found it: connected routes only, nothing masqueraded by hand.
        for fam in ("-4", "-6"):
            routes = subprocess.run(["ip", fam, "route", "show", "table", "all"], check=True,
                                    capture_output=True, text=True).stdout.splitlines()
            made = [r for r in routes if "proto kernel" not in r
                    and not r.startswith(("local ", "broadcast ", "multicast ", "anycast "))]
            self.assertEqual(made, [], "the test made a route in the host")
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [])

    def stack(self, **node_env):
        # boots are slow on a loaded machine without KVM
        stack = kiln.Stack(node_env=dict({"KILN_DNS_UPSTREAM": SERVER4, "KILN_BOOT_TIMEOUT_S": "600"},
                                         **node_env))
        self.addCleanup(stack.cleanup)
        return stack

    def create(self, stack, key):
        r = stack.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, key,
                             timeout=700)
        self.assertEqual(r.status, 201, r)
        return r.json()

    def run_py(self, stack, key, sb, code, timeout=240):
        r = stack.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec",
                             {"code": PROBE + code, "timeout_s": timeout}, key, timeout=timeout + 30)
        self.assertEqual(r.status, 200, r)
        out = r.json()
        self.assertEqual(out["exit_code"], 0, out)
        return out["stdout"].split()

    def late_listener(self):
        """A host port on an address the host gains after the sandbox started, and one on the
        uplink's own address; both reachable from the host itself (so a refusal means something)."""
        subprocess.run(["ip", "addr", "add", LATE4 + "/32", "dev", "up0"], check=True)
        self.addCleanup(subprocess.run, ["ip", "addr", "del", LATE4 + "/32", "dev", "up0"],
                        capture_output=True)
        late, uplink = Listener(LATE4), Listener(HOST4)
        self.addCleanup(late.close)
        self.addCleanup(uplink.close)
        for lst, addr in ((late, LATE4), (uplink, HOST4)):
            with socket.create_connection((addr, lst.port), timeout=3) as s:
                self.assertEqual(s.recv(2), b"hi")
        return late, uplink

    def test_the_nodes_table_forwards_and_masquerades_and_keeps_the_host_closed(self):
        stack = self.stack(KILN_CONNTRACK_MAX_PER_SANDBOX="16")
        table = "table inet " + table_name(stack.node.node_id)
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [table])
        self.assertEqual((sysctl("net.ipv4.ip_forward"), sysctl("net.ipv6.conf.all.forwarding")), ("1", "1"))
        key = stack.tenant()
        sb, made = self.create(stack, key), {}
        late, uplink = self.late_listener()
        got = self.run_py(stack, key, sb,
                          f"print(get('http://{SERVER4}:{PORT}/'), get('http://[{SERVER6}]:{PORT}/'),"
                          f" tcp('{LATE4}', {late.port}), tcp('{HOST4}', {uplink.port}))")
        # the server saw the host's uplink address: masqueraded, both families
        self.assertEqual(got, [f"from={HOST4}", f"from={HOST6}", "fail", "fail"])
        self.assertEqual((late.accepted, uplink.accepted), (1, 1))  # the host's own checks only

        # The host tracks each masqueraded connection: a sandbox holds at most
        # conntrack_max_per_sandbox at once, the next is refused at once, and others are not.
        made["other"] = self.create(stack, key)
        self.run_py(stack, key, sb, "import subprocess\nopen('/tmp/holder.py', 'w').write(%r)\n"
                    "subprocess.Popen(['python3', '/tmp/holder.py'], start_new_session=True,"
                    " stdout=open('/tmp/held', 'w'))" % HOLDER)
        held = self.run_py(stack, key, sb, "import time\nfor _ in range(200):\n"
                           "    d = open('/tmp/held').read()\n    if d: break\n    time.sleep(1)\nprint(d)")
        self.assertEqual(held[1:], ["16", "4"])
        self.assertEqual(self.run_py(stack, key, made["other"], f"print(get('http://{SERVER4}:{PORT}/'))"),
                         [f"from={HOST4}"])
        got = self.run_py(stack, key, sb, f"import os, signal, time\nos.kill({held[0]}, signal.SIGKILL)\n"
                          "for _ in range(30):\n"
                          f"    r = get('http://{SERVER4}:{PORT}/')\n    if r != 'fail': break\n"
                          "    time.sleep(1)\nprint(r)")
        self.assertEqual(got, [f"from={HOST4}"])  # a cap on connections at once, not a ban

        # A node started again over a table already there (a killed node's) leaves one table.
        stack.node.stop(signal.SIGKILL)
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [table])
        stack.restart_node()
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [table])

        # What `make stop` does after a node it had to kill (scripts/lib.sh): the table goes.
        stack.node.stop(signal.SIGKILL)
        remove = ["bash", "-c", '. "$0/scripts/lib.sh" && kiln_node_table_remove "$1"', kiln.ROOT,
                  stack.node.node_id]
        out = subprocess.run(remove, check=True, capture_output=True, text=True).stdout
        self.assertEqual(out.strip(), "removed nftables " + table)
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [])
        out = subprocess.run(remove, check=True, capture_output=True, text=True).stdout
        self.assertEqual(out, "")  # nothing there: nothing done, no failure
        stack.restart_node()
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [table])

        # A clean stop removes the node's table; forwarding stays on (others share it).
        self.assertEqual(stack.node.stop(), 0)
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [])
        self.assertEqual((sysctl("net.ipv4.ip_forward"), sysctl("net.ipv6.conf.all.forwarding")), ("1", "1"))

    def test_with_node_network_setup_off_the_host_is_left_alone(self):
        stack = self.stack(KILN_NODE_NETWORK_SETUP="false")
        self.assertEqual([t for t in nft_tables() if "kiln_" in t], [])
        key = stack.tenant()
        sb = self.create(stack, key)
        late, _ = self.late_listener()
        got = self.run_py(stack, key, sb,
                          f"print(get('http://{SERVER4}:{PORT}/'), get('http://[{SERVER6}]:{PORT}/'),"
                          f" tcp('{LATE4}', {late.port}))")
        # no masquerade: the uplink cannot answer; and nothing closes the late host address
        self.assertEqual(got, ["fail", "fail", "ok"])
        self.assertTrue("node_network_setup is off" in stack.node.output(), "the node did not say so")


def main():
    """Builds the host and uplink namespaces, runs the tests inside the host one, cleans up."""
    tag = "kn" + secrets.token_hex(3)
    ns_h, ns_u = tag + "h", tag + "u"
    procs = []

    def sh(*a):
        subprocess.run(a, check=True)
    try:
        for ns in (ns_h, ns_u):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns_h, "link", "add", "up0", "type", "veth", "peer", "name", "up0", "netns", ns_u)
        sh("ip", "-n", ns_h, "addr", "add", HOST4 + "/24", "dev", "up0")
        sh("ip", "-n", ns_u, "addr", "add", SERVER4 + "/24", "dev", "up0")
        sh("ip", "-n", ns_h, "-6", "addr", "add", HOST6 + "/64", "dev", "up0", "nodad")
        sh("ip", "-n", ns_u, "-6", "addr", "add", SERVER6 + "/64", "dev", "up0", "nodad")
        for ns in (ns_h, ns_u):
            sh("ip", "-n", ns, "link", "set", "up0", "up")
        p = subprocess.Popen(["ip", "netns", "exec", ns_u, sys.executable, "-c", SERVER, SERVER4, SERVER6,
                              str(PORT)], stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        # nsenter, not `ip netns exec`: that one mounts a fresh /sys, hiding the cgroup and
        # bpf file systems the node needs; through the harness's runner: a skip is not a pass
        runner = os.path.join(HERE, "..", "harness", "unittest_run.py")
        r = subprocess.run(["nsenter", "--net=/run/netns/" + ns_h, sys.executable, runner]
                           + (sys.argv[1:] or ["test_nodenet"]), cwd=HERE)
        return r.returncode
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ns in (ns_h, ns_u):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
