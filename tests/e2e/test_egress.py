"""Egress and ingress of a real sandbox, enforced in the host kernel, through the public API.

The whole stack (gateway, kiln-node, its sandboxes' networks) runs inside a network namespace of
the test's own ("the host"), wired to another ("the internet") that serves DNS, TCP and UDP on
documentation addresses (tests/integration/netpolicy/fakenet.py). Run as a script: it builds the
two namespaces, runs the tests inside the host one, and removes everything afterwards.
"""
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import unittest

import kiln
import testca

HERE = os.path.dirname(os.path.abspath(__file__))
# a real HTTPS server (tlsrecord.py) whose certificate a test CA signed, on an address fakenet's DNS
# gives two names (tls.example.test, tlstwin.example.test) and does not serve itself
TLS_ADDR, TLS_NAME, TLS_TWIN, TLS_DNS = "203.0.113.20", "tls.example.test", "tlstwin.example.test", "198.51.100.59"
FAKENET = os.path.join(kiln.ROOT, "tests", "integration", "netpolicy", "fakenet.py")
INET = ["203.0.113.%d" % i for i in range(10, 18)] + ["198.51.100.21", "198.51.100.22", "192.0.2.53",
                                                      "169.254.169.254", "2001:db8:1::10",
                                                      "2001:db8:2::20"]
PROBE = r'''
import socket, sys
# Ports 80 and 443 to an address only a host rule allows are name-checked (kiln-node's
# name-checking proxy): a probe there names the host its address was learnt from.
NAMES = {"203.0.113.10": "sub.example.com", "203.0.113.11": "example.com",
         "203.0.113.12": "a.wild.test", "203.0.113.13": "x.y.wild.test",
         "203.0.113.15": "rebind.test", "203.0.113.16": "wild.test", "198.51.100.21": "api.test",
         "198.51.100.22": "other.test", "2001:db8:1::10": "v6.test"}
def tcp(host, port, t=3, name=None):
    try:
        s = socket.create_connection((host, port), timeout=t)
        s.settimeout(t)
        if port in (80, 443):
            s.sendall(b"GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % (name or NAMES.get(host, host)).encode())
        d = s.recv(64)
        s.close()
        return "ok" if d else "empty"
    except Exception as e:
        return "fail"
def tls(host, sni, t=5):
    # a real ClientHello (Python's ssl) naming sni; "ok" when the server's greeting comes back
    import ssl
    o = ssl.MemoryBIO()
    c = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), o, server_hostname=sni)
    try:
        c.do_handshake()
    except ssl.SSLWantReadError:
        pass
    try:
        s = socket.create_connection((host, 443), timeout=t)
        s.settimeout(t)
        s.sendall(o.read())
        d = s.recv(64)
        return "ok" if d.startswith(b"hello") else "empty"
    except Exception:
        return "fail"
def dns(name, family=socket.AF_INET):
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(name, 80, family)})[0]
    except Exception:
        return "nx"
def udp_dns(server):
    q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x03sub\x07example\x03com\x00\x00\x01\x00\x01"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    try:
        s.sendto(q, (server, 53))
        s.recv(512)
        return "answered"
    except Exception:
        return "silent"
'''


class EgressTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env={"KILN_DNS_UPSTREAM": "192.0.2.53"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()
        cls.a = cls.create()
        cls.b = cls.create()


    @classmethod
    def create(cls, **body):
        body.setdefault("memory_mib", 256)
        body.setdefault("timeout_s", 3600)  # slow machines: no auto-pause mid-test
        r = cls.gw.request("POST", "/v1/sandboxes", body, cls.key, timeout=300)
        assert r.status == 201, r
        return r.json()

    def run_py(self, code, sb=None, timeout=60):
        r = self.gw.request("POST", f"/v1/sandboxes/{(sb or self.a)['id']}/exec",
                            {"code": PROBE + code, "timeout_s": timeout}, self.key, timeout=timeout + 30)
        self.assertEqual(r.status, 200, r)
        out = r.json()
        self.assertEqual(out["exit_code"], 0, out)
        return out["stdout"].split()

    def egress(self, rules, sb=None):
        return self.gw.request("PUT", f"/v1/sandboxes/{(sb or self.a)['id']}/egress", {"rules": rules}, self.key)

    def nat_address(self, sb):
        idx = int(self.stack.db.sql(f"SELECT net_index FROM sandboxes WHERE id = '{sb['id']}'"))
        return "10.200.%d.%d" % ((4 * idx) // 256, (4 * idx) % 256 + 2)

    def setUp(self):
        self.assertEqual(self.egress([]).status, 200)

    def test_open_until_the_first_rule_then_allowlist_only(self):
        r = self.gw.request("GET", f"/v1/sandboxes/{self.a['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": [], "mode": "open"})
        self.assertEqual(self.run_py("print(tcp('203.0.113.10', 80), tcp('198.51.100.22', 80), dns('example.com'))"),
                         ["ok", "ok", "203.0.113.11"])
        r = self.egress(["sub.example.com", "198.51.100.21:443"])
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["mode"], "allowlist")
        self.assertEqual(self.run_py(
            "print(dns('sub.example.com'), tcp('203.0.113.10', 80), dns('example.com'),"
            " tcp('203.0.113.11', 80), tcp('198.51.100.21', 443), tcp('198.51.100.21', 80),"
            " tcp('198.51.100.22', 80))"),
            ["203.0.113.10", "ok", "nx", "fail", "ok", "fail", "fail"])

    def test_wildcards_match_any_depth_below_but_not_the_apex(self):
        self.assertEqual(self.egress(["*.wild.test"]).status, 200)
        self.assertEqual(self.run_py(
            "print(dns('a.wild.test'), tcp('203.0.113.12', 80), dns('x.y.wild.test'), tcp('203.0.113.13', 80),"
            " dns('wild.test'), tcp('203.0.113.16', 80))"),
            ["203.0.113.12", "ok", "203.0.113.13", "ok", "nx", "fail"])

    def test_dns_rebinding_answers_are_not_let_through(self):
        self.assertEqual(self.egress(["rebind.test"]).status, 200)
        self.assertEqual(self.run_py("print(tcp('169.254.169.254', 80), tcp('203.0.113.15', 80))"),
                         ["fail", "fail"])
        self.run_py("dns('rebind.test')")
        self.assertEqual(self.run_py("print(tcp('169.254.169.254', 80), tcp('203.0.113.15', 80))"),
                         ["fail", "ok"])

    def test_an_answer_too_large_for_udp_comes_over_tcp_and_is_learnt(self):
        # 300 addresses: the resolver's UDP answer is truncated, the guest's libc asks again over
        # TCP, and the proxy answers that too, learning the addresses as over UDP.
        self.assertEqual(self.egress(["many.test"]).status, 200)
        self.assertEqual(self.run_py(
            "print(tcp('203.0.113.10', 80),"
            " len({a[4][0] for a in socket.getaddrinfo('many.test', 80, socket.AF_INET)}),"
            " tcp('203.0.113.10', 80, name='many.test'))"), ["fail", "300", "ok"])

    def test_dns_to_a_foreign_resolver_is_dropped_once_rules_exist(self):
        self.assertEqual(self.run_py("print(udp_dns('192.0.2.53'))"), ["answered"])
        self.assertEqual(self.egress(["sub.example.com"]).status, 200)
        self.assertEqual(self.run_py("print(udp_dns('192.0.2.53'), udp_dns('172.16.0.1'))"),
                         ["silent", "answered"])

    def test_host_metadata_private_and_other_sandboxes_stay_closed_even_while_open(self):
        other = self.nat_address(self.b)
        # The other sandbox listens; the host's own addresses have servers on them (fakenet).
        self.gw.request("POST", f"/v1/sandboxes/{self.b['id']}/exec",
                        {"cmd": ["sh", "-c", "nohup python3 -c \"import socket\ns=socket.socket();"
                                 "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',8000));"
                                 "s.listen()\nwhile 1:\n c,_=s.accept();c.sendall(b'hi');c.close()\" "
                                 ">/dev/null 2>&1 &"]}, self.key)
        time.sleep(2)
        # The host's services (a database port on its address), metadata, the other sandbox.
        got = self.run_py(f"print(tcp('169.254.169.254', 80), tcp('192.0.2.1', 80), tcp('10.200.0.1', 80),"
                          f" tcp('{other}', 8000), tcp('127.0.0.1', 9), tcp('192.0.2.1', 5432),"
                          f" tcp('203.0.113.10', 80))")
        self.assertEqual(got, ["fail", "fail", "fail", "fail", "fail", "fail", "ok"])

    def test_inbound_is_closed_but_replies_to_the_guests_own_flows_pass(self):
        self.gw.request("POST", f"/v1/sandboxes/{self.a['id']}/exec",
                        {"cmd": ["sh", "-c", "nohup python3 -c \"import socket\ns=socket.socket();"
                                 "s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',8001));"
                                 "s.listen()\nwhile 1:\n c,_=s.accept();c.sendall(b'hi');c.close()\" "
                                 ">/dev/null 2>&1 &"]}, self.key)
        time.sleep(2)
        nat = self.nat_address(self.a)
        probe = subprocess.run(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], sys.executable, "-c",
                                PROBE + f"print(tcp('{nat}', 8001))"], capture_output=True, text=True)
        self.assertEqual(probe.stdout.split(), ["fail"], probe.stderr)
        self.assertEqual(self.run_py("print(tcp('203.0.113.10', 80))"), ["ok"])

    def test_ipv6_open_then_allowlisted_by_cidr_and_by_name(self):
        self.assertEqual(self.run_py("print(tcp('2001:db8:1::10', 80), tcp('2001:db8:2::20', 80))"),
                         ["ok", "ok"])
        self.assertEqual(self.egress(["2001:db8:1::/48"]).status, 200)
        self.assertEqual(self.run_py("print(tcp('2001:db8:1::10', 80), tcp('2001:db8:2::20', 80))"),
                         ["ok", "fail"])
        self.assertEqual(self.egress(["v6.test", "[2001:db8:2::20]:443"]).status, 200)
        self.assertEqual(self.run_py(
            "print(dns('v6.test', socket.AF_INET6), tcp('2001:db8:1::10', 80), tcp('2001:db8:2::20', 443),"
            " tcp('2001:db8:2::20', 80))"),
            ["2001:db8:1::10", "ok", "ok", "fail"])

    def test_smtp_is_closed_unless_a_rule_names_it(self):
        self.assertEqual(self.run_py("print(tcp('203.0.113.10', 25), tcp('203.0.113.10', 80))"), ["fail", "ok"])
        self.assertEqual(self.egress(["203.0.113.10:25"]).status, 200)
        self.assertEqual(self.run_py("print(tcp('203.0.113.10', 25))"), ["ok"])

    def test_removing_a_rule_cuts_the_flow_it_allowed_live(self):
        self.assertEqual(self.egress(["203.0.113.10", "203.0.113.11"]).status, 200)
        import threading
        res = {}

        def stream():
            res["out"] = self.run_py(
                "import time\ns = socket.create_connection(('203.0.113.10', 7000), timeout=3)\n"
                "s.settimeout(2)\nt0 = time.time(); n = 0\n"
                "while time.time() - t0 < 12:\n"
                "    try:\n        d = s.recv(4096)\n    except Exception:\n        break\n"
                "    if not d:\n        break\n    n += len(d)\n"
                "print(n > 0, round(time.time() - t0))", timeout=40)
        t = threading.Thread(target=stream)
        t.start()
        # The rule goes only once the stream is up (seen from the internet's side): a guest slow
        # to start its program must not find the rule gone before it connects.
        deadline = time.time() + 40
        while time.time() < deadline:
            ss = subprocess.run(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], "ss", "-Htn",
                                 "state", "established", "( sport = :7000 )"],
                                capture_output=True, text=True)
            if ss.stdout.strip():
                break
            time.sleep(0.2)
        else:
            self.fail("the guest's stream to 203.0.113.10:7000 never came up")
        time.sleep(1)
        self.assertEqual(self.egress(["203.0.113.11"]).status, 200)
        t.join(60)
        got_data, seconds = res["out"]
        self.assertEqual(got_data, "True")
        self.assertLess(int(seconds), 11, "the stream went on after its rule was removed")

    def test_names_on_a_shared_address_are_checked_on_the_wire(self):
        # sub.example.com and twin.example.com are both 203.0.113.10 (fakenet.py)
        self.assertEqual(self.egress(["sub.example.com"]).status, 200)
        self.assertEqual(self.run_py(
            "print(dns('sub.example.com'), tcp('203.0.113.10', 80), tls('203.0.113.10', 'sub.example.com'),"
            " tcp('203.0.113.10', 80, name='twin.example.com'), tls('203.0.113.10', 'twin.example.com'),"
            " tcp('203.0.113.10', 443, name='twin.example.com'))"),
            ["203.0.113.10", "ok", "ok", "fail", "fail", "fail"])
        # a changed rule cuts a live connection that no longer matches
        self.assertEqual(self.egress(["sub.example.com", "twin.example.com"]).status, 200)
        import threading
        res = {}

        def hold():
            # one keep-alive connection asking sub.example.com again every 0.5 s, for at most
            # 30 s: it ends at the first request left unanswered (cut: reset, or dropped)
            res["out"] = self.run_py(
                "import time\nprint(dns('sub.example.com'))\n"
                "s = socket.create_connection(('203.0.113.10', 80), timeout=3)\n"
                "s.settimeout(3)\nt0 = time.time(); n = 0; end = 'timeout'\n"
                "while time.time() - t0 < 30:\n"
                "    try:\n"
                "        s.sendall(b'GET / HTTP/1.1\\r\\nHost: sub.example.com\\r\\n\\r\\n')\n"
                "        d = s.recv(4096)\n"
                "    except Exception as e:\n        end = type(e).__name__; break\n"
                "    if not d:\n        end = 'eof'; break\n"
                "    n += 1\n    time.sleep(0.5)\n"
                "print(n > 0, end, round(time.time() - t0))", timeout=60)
        t = threading.Thread(target=hold)
        t.start()
        deadline = time.time() + 40
        while time.time() < deadline:
            ss = subprocess.run(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], "ss", "-Htn",
                                 "state", "established", "( sport = :80 )"],
                                capture_output=True, text=True)
            if ss.stdout.strip():
                break
            time.sleep(0.2)
        else:
            self.fail("the guest's connection to sub.example.com:80 never came up")
        time.sleep(1)
        self.assertEqual(self.egress(["twin.example.com"]).status, 200)
        t.join(90)
        addr, answered, end, seconds = res["out"]
        self.assertEqual((addr, answered), ("203.0.113.10", "True"), res)
        self.assertLess(int(seconds), 25, "the connection went on after its rule was removed")
        # and the proxy closed its side upstream
        deadline = time.time() + 10
        while time.time() < deadline:
            ss = subprocess.run(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], "ss", "-Htn",
                                 "state", "established", "( sport = :80 )"],
                                capture_output=True, text=True)
            if not ss.stdout.strip():
                break
            time.sleep(0.5)
        else:
            self.fail("the upstream connection stayed open: " + ss.stdout)

    def test_real_clients_reach_an_allowed_name_not_its_twin_and_the_log_says_why(self):
        # curl, Python (urllib) and Node in the guest, with the test CA (the guest's bundle
        # untouched: --cacert, cafile, NODE_EXTRA_CA_CERTS); the server's certificate names both
        # names, so only the name-checking proxy can refuse the twin
        ns = os.environ["KILN_E2E_INET_NS"]
        d = tempfile.mkdtemp(prefix="kiln-egress-tls-")
        self.addCleanup(subprocess.run, ["rm", "-rf", d])
        os.chmod(d, 0o755)
        ca_key, ca = testca.make_ca("kiln e2e egress CA")
        key, cert = testca.make_leaf(ca_key, ca, TLS_NAME, also=[TLS_TWIN])
        for name, data in (("ca.pem", testca.pem_cert(ca)), ("leaf.crt", testca.pem_cert(cert)),
                           ("leaf.key", testca.pem_key(key))):
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        log = os.path.join(d, "requests.jsonl")
        open(log, "w").close()
        for a in (TLS_ADDR, TLS_DNS):
            subprocess.run(["ip", "-n", ns, "addr", "replace", a + "/32", "dev", "lo"], check=True)
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(HERE, "tlsrecord.py"),
                              log, TLS_DNS, "%s=%s,%s,%s" % (TLS_NAME, TLS_ADDR, os.path.join(d, "leaf.crt"),
                                                              os.path.join(d, "leaf.key"))],
                             stdout=subprocess.PIPE, text=True)
        self.addCleanup(p.wait)
        self.addCleanup(p.kill)
        self.assertEqual(p.stdout.readline().strip(), "ready")
        self.assertEqual(self.egress([TLS_NAME]).status, 200)
        ca_pem = testca.pem_cert(ca).decode()
        node_js = (
            "const https = require('https'), tls = require('tls');"
            "https.get('https://%s/node', r => { let b = ''; r.on('data', c => b += c);"
            " r.on('end', () => { console.log('node-ok', r.statusCode, b.split(' ')[1]);"
            "  const s = tls.connect({host: '%s', port: 443, servername: '%s', rejectUnauthorized: false},"
            "   () => { console.log('node-twin', 'connected'); s.destroy(); });"
            "  s.on('error', e => console.log('node-twin', e.code)); }); })"
            ".on('error', e => console.log('node-ok', e.code));" % (TLS_NAME, TLS_ADDR, TLS_TWIN))
        script = (
            "cat > /tmp/e2e-ca.pem <<'EOF'\n%sEOF\n"
            "getent hosts %s | cut -d' ' -f1\n"
            "curl -sS -m 20 --cacert /tmp/e2e-ca.pem https://%s/curl; echo curl-rc=$?\n"
            "curl -sS -k -m 20 --resolve %s:443:%s https://%s/twin-curl 2>/dev/null; echo twin-rc=$?\n"
            "python3 -c \"$PY_HTTPS\"\n"
            "NODE_EXTRA_CA_CERTS=/tmp/e2e-ca.pem node -e \"$NODE_JS\"\n"
            % (ca_pem, TLS_NAME, TLS_NAME, TLS_TWIN, TLS_ADDR, TLS_TWIN))
        py_https = ("import ssl, urllib.request\n"
                    "c = ssl.create_default_context(cafile='/tmp/e2e-ca.pem')\n"
                    "r = urllib.request.urlopen('https://%s/python', context=c, timeout=20)\n"
                    "print('python-ok', r.status, r.read().split()[1].decode())\n" % TLS_NAME)
        r = self.gw.request("POST", f"/v1/sandboxes/{self.a['id']}/exec",
                            {"cmd": ["sh", "-c", script], "env": {"NODE_JS": node_js, "PY_HTTPS": py_https},
                             "timeout_s": 120},
                            self.key, timeout=150)
        self.assertEqual(r.status, 200, r)
        out = r.json()["stdout"].split()
        # the twin fails at the reset: curl 35 (TLS connect) or 56 (receive), Node ECONNRESET
        self.assertEqual(out[:4], [TLS_ADDR, "ok", "/curl", "curl-rc=0"], r.json())
        self.assertIn(out[4], ("twin-rc=35", "twin-rc=56"), r.json())
        self.assertEqual(out[5:], ["python-ok", "200", "/python", "node-ok", "200", "/node", "node-twin",
                                   "ECONNRESET"], r.json())
        with open(log) as f:
            paths = [json.loads(line)["path"] for line in f if line.strip()]
        self.assertEqual(sorted(paths), ["/curl", "/node", "/python"])
        # the connection log: each flow's checked name and the proxy's decision
        want = "%s,allowed,allowed;%s,no_rule,denied" % (TLS_NAME, TLS_TWIN)
        deadline = time.time() + 60
        while time.time() < deadline:
            rows = self.stack.db.sql(
                "SELECT string_agg(DISTINCT concat_ws(',', dns_name, proxy_decision, verdict), ';') "
                f"FROM sandbox_connections WHERE sandbox_id = '{self.a['id']}' AND host(dst) = '{TLS_ADDR}' "
                "AND dst_port = 443").strip()
            if rows == want:
                break
            time.sleep(1)
        self.assertEqual(rows, want)

    def test_a_bad_rule_is_422_naming_it_and_nothing_changes(self):
        self.assertEqual(self.egress(["sub.example.com"]).status, 200)
        r = self.egress(["198.51.100.21", "not a host!", "api.test"])
        self.assertEqual(r.status, 422, r)
        self.assertIn("not a host!", r.json()["error"]["message"])
        r = self.gw.request("GET", f"/v1/sandboxes/{self.a['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": ["sub.example.com"], "mode": "allowlist"})
        self.assertEqual(self.run_py("print(tcp('198.51.100.21', 443))"), ["fail"])

    def test_a_rule_inside_a_denied_range_is_422_naming_the_range(self):
        # metadata, loopback, the node's own address, a sandbox's host side, NAT64
        self.assertEqual(self.egress(["sub.example.com"]).status, 200)
        for rule, rng in (("169.254.169.254:80", "169.254.0.0/16"), ("127.0.0.1", "127.0.0.0/8"),
                          ("192.0.2.1", "192.0.2.1/32"), ("10.200.0.1", "10.200.0.0/16"),
                          ("[64:ff9b::a9fe:a9fe]:80", "64:ff9b::/96")):
            r = self.egress(["203.0.113.10", rule])
            self.assertEqual(r.status, 422, (rule, r))
            self.assertIn(rng, r.json()["error"]["message"])
        r = self.gw.request("GET", f"/v1/sandboxes/{self.a['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": ["sub.example.com"], "mode": "allowlist"})
        r = self.gw.request("POST", "/v1/sandboxes", {"egress": {"rules": ["169.254.169.254"]}}, self.key)
        self.assertEqual(r.status, 422, r)
        self.assertIn("169.254.0.0/16", r.json()["error"]["message"])
        self.assertEqual(self.run_py("print(tcp('169.254.169.254', 80), tcp('203.0.113.10', 80))"),
                         ["fail", "fail"])

    def test_spoofed_source_addresses_from_the_guest_are_dropped(self):
        # The guest's own address first: once a foreign one is on eth0, the guest may also
        # ARP from it, and those frames are dropped as spoofed too.
        got = self.run_py(
            "import subprocess\n"
            "def from_addr(src):\n"
            "    s = socket.socket(); s.settimeout(3)\n"
            "    try:\n        s.bind((src, 0)); s.connect(('203.0.113.10', 80)); return 'ok'\n"
            "    except Exception:\n        return 'fail'\n"
            "print(from_addr('172.16.0.2'))\n"
            "subprocess.run(['ip', 'addr', 'add', '172.16.9.9/32', 'dev', 'eth0'], check=True)\n"
            "print(from_addr('172.16.9.9'))\n"
            "subprocess.run(['ip', 'addr', 'del', '172.16.9.9/32', 'dev', 'eth0'])", sb=self.b)
        self.assertEqual(got, ["ok", "fail"])

    def test_rules_given_at_create_are_in_force_from_the_first_packet(self):
        sb = self.create(egress={"rules": ["api.test:443"]},
                         bandwidth={"quota_bytes": 1 << 20, "refill_bytes": 0, "refill_interval_s": 60})
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": ["api.test:443"], "mode": "allowlist"})
        bw = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/bandwidth", headers=self.key).json()
        self.assertEqual((bw["quota_bytes"], bw["unmetered"]), (1 << 20, False))
        self.assertEqual(self.run_py("print(dns('api.test'), tcp('198.51.100.21', 443), tcp('203.0.113.10', 80))", sb=sb),
                         ["198.51.100.21", "ok", "fail"])
        r = self.gw.request("POST", "/v1/sandboxes", {"egress": {"rules": ["bad rule"]}}, self.key)
        self.assertEqual(r.status, 422)

    def test_a_bandwidth_quota_stops_egress_when_spent_and_a_new_setting_applies_live(self):
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.b['id']}/bandwidth",
                            {"quota_bytes": 200000, "refill_bytes": 0, "refill_interval_s": 3600}, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertFalse(r.json()["unmetered"])
        code = ("s = socket.create_connection(('203.0.113.10', 8081), timeout=3)\ns.settimeout(3)\nn = 0\n"
                "try:\n    while n < 50_000_000:\n        d = s.recv(65536)\n        if not d: break\n        n += len(d)\n"
                "except Exception:\n    pass\nprint(n)")
        got = int(self.run_py(code, sb=self.b)[0])
        self.assertLess(got, 50_000_000, "the quota did not stop the download")
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.b['id']}/bandwidth", {"unmetered": True}, self.key)
        self.assertEqual(r.status, 200)
        self.assertTrue(r.json()["unmetered"])
        self.assertIsNone(r.json()["remaining_bytes"])
        self.assertGreaterEqual(int(self.run_py(code, sb=self.b)[0]), 50_000_000)


def with_fake_internet(cmd):
    """Builds the host and internet namespaces, runs `cmd` inside the host one (with
    KILN_E2E_INET_NS naming the internet's), cleans up; returns its exit status. bench/egress
    runs its real-VM bench this way too."""
    tag = "ke" + secrets.token_hex(3)
    ns_h, ns_i = tag + "h", tag + "i"
    procs = []

    def sh(*a):
        subprocess.run(a, check=True)
    try:
        for ns in (ns_h, ns_i):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns_h, "link", "add", "up0", "type", "veth", "peer", "name", "up0", "netns", ns_i)
        sh("ip", "-n", ns_h, "addr", "add", "192.0.2.1/30", "dev", "up0")
        sh("ip", "-n", ns_i, "addr", "add", "192.0.2.2/30", "dev", "up0")
        sh("ip", "-n", ns_h, "-6", "addr", "add", "2001:db8:ffff::1/64", "dev", "up0", "nodad")
        sh("ip", "-n", ns_i, "-6", "addr", "add", "2001:db8:ffff::2/64", "dev", "up0", "nodad")
        for ns in (ns_h, ns_i):
            sh("ip", "-n", ns, "link", "set", "up0", "up")
        sh("ip", "-n", ns_h, "route", "add", "default", "via", "192.0.2.2")
        sh("ip", "-n", ns_h, "-6", "route", "add", "default", "via", "2001:db8:ffff::2")
        sh("ip", "netns", "exec", ns_h, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", ns_h, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
        sh("ip", "-n", ns_i, "route", "add", "10.200.0.0/16", "via", "192.0.2.1")
        sh("ip", "-n", ns_i, "-6", "route", "add", "fd6b:696c:6e00::/48", "via", "2001:db8:ffff::1")
        for a in INET:
            if ":" in a:
                sh("ip", "-n", ns_i, "-6", "addr", "add", a + "/128", "dev", "lo", "nodad")
            else:
                sh("ip", "-n", ns_i, "addr", "add", a + "/32", "dev", "lo")
        for ns, addrs in ((ns_i, INET), (ns_h, ["192.0.2.1"])):
            p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, FAKENET] + addrs,
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            assert p.stdout.readline().strip() == "ready"
        env = dict(os.environ, KILN_E2E_INET_NS=ns_i)
        # nsenter, not `ip netns exec`: that one mounts a fresh /sys, hiding the cgroup and
        # bpf file systems the node needs.
        r = subprocess.run(["nsenter", "--net=/run/netns/" + ns_h] + cmd, cwd=HERE, env=env)
        return r.returncode
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ns in (ns_h, ns_i):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main():
    """The tests inside the host namespace, through the harness's runner as every Python test (a
    skip is not a pass)."""
    runner = os.path.join(HERE, "..", "harness", "unittest_run.py")
    return with_fake_internet([sys.executable, runner] + (sys.argv[1:] or ["test_egress"]))


if __name__ == "__main__":
    sys.exit(main())
