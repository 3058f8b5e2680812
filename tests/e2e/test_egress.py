"""Egress and ingress of a real sandbox, enforced in the host kernel, through the public API,
and secrets bound to a sandbox's hosts (SecretsTests), on one stack.

The whole stack (gateway, kiln-node, its sandboxes' networks) runs inside a network namespace of
the test's own ("the host"), wired to another ("the internet") that serves DNS, TCP and UDP on
documentation addresses (tests/integration/netpolicy/fakenet.py). Run as a script: it builds the
two namespaces, runs the tests inside the host one, and removes everything afterwards
(`test_egress.py test_egress.SecretsTests` runs one class). Each test prints its time to stderr.

SecretsTests: the API checks (exact host rule, header names, limits, another tenant's 404) and
what lands where: the values sealed in Postgres and absent from every answer and log, the tenant's
CA in the guest's bundle with SSL_CERT_FILE, REQUESTS_CA_BUNDLE and NODE_EXTRA_CA_CERTS set for
exec, and the CA's private key nowhere in the guest. Then the wire, end to end: the guest's HTTPS
requests (curl twice on one keep-alive connection, Python's urllib and requests, Node) through the
name-checking proxy and the injector to a recording TLS server on the fake internet (tlsrecord.py),
whose certificate a test CA the node trusts (inject_ca_file) signed: the header on every request,
replacing the guest's own; the value nowhere in the guest (environment, files, the answers it got,
its memory read from the host in the pause snapshot's memory file); a secret's host whose
certificate an untrusted CA signed gets nothing and the guest a 502; another tenant's sandbox with
a rule for the same host sends without it. The injecting proxy's finer points are tested on the
host (tests/integration/inject), and so is a fork's copy of the set (integ_secretsdb): a fork here
would double the secrets' share of this test.
"""
import concurrent.futures
import json
import mmap
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
def par(*calls):
    # independent probes at once, results in order: a refused one waits out its timeout
    # alongside the others, not after them; each call is (function, arguments...)
    import threading
    out = [None] * len(calls)
    def one(i, c):
        out[i] = c[0](*c[1:])
    ts = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(calls)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out
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


KILN = os.path.join(kiln.BUILD, "cli", "kiln")

HOST = "api.example.test"
ROGUE = "rogue.example.test"   # its server's certificate comes from a CA the node does not trust
# the random part in two halves: the guest searches its files for the first one only, so that
# the whole value is never in the guest, not even in a search's command line
HALF1, HALF2 = secrets.token_hex(8), secrets.token_hex(8)
TOKEN = HALF1 + HALF2
SECRET = "Bearer e2e-s3cret-" + TOKEN
ROGUE_SECRET = "Bearer e2e-s3cret-rogue-" + secrets.token_hex(8)
MARK = "mark-" + secrets.token_hex(8)   # in every answer: the memory search must find it
SECRETS_RULES = {"rules": [HOST, ROGUE, "*.wild.test", "other.example.test:8443"]}
# on the fake internet: the recording servers (fakenet.py's DNS names them) and tlsrecord.py's own DNS
ADDR = {HOST: "198.51.100.30", ROGUE: "198.51.100.31"}
SECRETS_DNS = "198.51.100.53"


WORLD = {}   # what setUpModule made: the stack, tenants' keys, sandboxes, the trusted CA


class Timed(unittest.TestCase):
    """Prints each test's time to stderr, so that the slow steps show in the test's output."""

    def setUp(self):
        self.t0 = time.monotonic()

    def tearDown(self):
        print("time %6.1fs %s" % (time.monotonic() - self.t0, self.id()), file=sys.stderr, flush=True)


def create(key, body):
    body = dict(body)
    body.setdefault("memory_mib", 256)
    body.setdefault("timeout_s", 3600)  # slow machines: no auto-pause mid-test
    return WORLD["stack"].gw.request("POST", "/v1/sandboxes", body, key, timeout=300)


def setUpModule():
    """One stack for the egress and the secrets tests (each stack and boot costs tens of seconds
    under TCG), and their sandboxes booted two at a time: A and B, and the secrets tests' two
    (SecretsTests), the other tenant's with rules and a bandwidth setting given at create."""
    t0 = time.monotonic()
    SecretsTests.internet()
    stack = kiln.Stack(node_env={"KILN_DNS_UPSTREAM": "192.0.2.53", "KILN_SECRETS_MAX": "2",
                                 "KILN_INJECT_CA_FILE": WORLD["trusted_ca"],
                                 # the connection log's rows a second after the flow, not five
                                 "KILN_CONNLOG_INTERVAL_S": "1",
                                 # two boots at once beside other work under TCG (as e2e_nodenet)
                                 "KILN_BOOT_TIMEOUT_S": "600"})
    unittest.addModuleCleanup(stack.cleanup)
    WORLD["stack"] = stack
    t1 = time.monotonic()
    WORLD["key"], WORLD["key_acme"], WORLD["key_rival"] = (
        stack.tenant("egress"), stack.tenant("acme"), stack.tenant("rival"))
    boots = {"a": (WORLD["key"], {}), "b": (WORLD["key"], {}),
             "secrets": (WORLD["key_acme"], {"timeout_s": 1800, "egress": SECRETS_RULES,
                                             "secrets": [{"host": HOST, "header": "Authorization",
                                                          "value": SECRET}]}),
             # the other tenant's: a rule for the secret's host, no secret; and what
             # test_rules_given_at_create_… checks (a rule and a bandwidth setting at create)
             "rival": (WORLD["key_rival"], {"timeout_s": 1800,
                                            "egress": {"rules": [HOST, "api.test:443"]},
                                            "bandwidth": {"quota_bytes": 1 << 20, "refill_bytes": 0,
                                                          "refill_interval_s": 60}})}
    # two at a time: a TCG boot is CPU-bound, and more at once on a loaded machine only makes
    # each of them longer (up to the node's boot timeout)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        got = dict(zip(boots, ex.map(lambda n: create(*boots[n]), boots)))
    for name, r in got.items():
        assert r.status == 201, (name, r, stack.node.output()[-3000:])
        WORLD[name] = r.json()
    print("time %6.1fs setUpModule (stack %.1fs, %d boots two at a time %.1fs)" % (
        time.monotonic() - t0, t1 - t0, len(boots), time.monotonic() - t1), file=sys.stderr,
        flush=True)


class EgressTests(Timed):
    @classmethod
    def setUpClass(cls):
        cls.stack = WORLD["stack"]
        cls.gw = cls.stack.gw
        cls.key = WORLD["key"]
        cls.a, cls.b = WORLD["a"], WORLD["b"]

    def run_py(self, code, sb=None, timeout=60, key=None):
        r = self.gw.request("POST", f"/v1/sandboxes/{(sb or self.a)['id']}/exec",
                            {"code": PROBE + code, "timeout_s": timeout}, key or self.key,
                            timeout=timeout + 30)
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
        super().setUp()
        self.assertEqual(self.egress([]).status, 200)

    def test_open_until_the_first_rule_then_allowlist_only(self):
        r = self.gw.request("GET", f"/v1/sandboxes/{self.a['id']}/egress", headers=self.key)
        self.assertEqual(r.json(), {"rules": [], "mode": "open"})
        self.assertEqual(self.run_py("print(*par((tcp, '203.0.113.10', 80), (tcp, '198.51.100.22', 80),"
                                     " (dns, 'example.com')))"),
                         ["ok", "ok", "203.0.113.11"])
        r = self.egress(["sub.example.com", "198.51.100.21:443"])
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json()["mode"], "allowlist")
        self.assertEqual(self.run_py(
            "print(dns('sub.example.com'), *par((tcp, '203.0.113.10', 80), (dns, 'example.com'),"
            " (tcp, '203.0.113.11', 80), (tcp, '198.51.100.21', 443), (tcp, '198.51.100.21', 80),"
            " (tcp, '198.51.100.22', 80)))"),
            ["203.0.113.10", "ok", "nx", "fail", "ok", "fail", "fail"])

    def test_wildcards_match_any_depth_below_but_not_the_apex(self):
        self.assertEqual(self.egress(["*.wild.test"]).status, 200)
        self.assertEqual(self.run_py(
            "print(dns('a.wild.test'), dns('x.y.wild.test'), dns('wild.test'),"
            " *par((tcp, '203.0.113.12', 80), (tcp, '203.0.113.13', 80), (tcp, '203.0.113.16', 80)))"),
            ["203.0.113.12", "203.0.113.13", "nx", "ok", "ok", "fail"])

    def test_dns_rebinding_answers_are_not_let_through(self):
        self.assertEqual(self.egress(["rebind.test"]).status, 200)
        self.assertEqual(self.run_py("print(*par((tcp, '169.254.169.254', 80), (tcp, '203.0.113.15', 80)))"),
                         ["fail", "fail"])
        self.assertEqual(self.run_py("dns('rebind.test')\nprint(*par((tcp, '169.254.169.254', 80),"
                                     " (tcp, '203.0.113.15', 80)))"),
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
        self.assertEqual(self.run_py("print(*par((udp_dns, '192.0.2.53'), (udp_dns, '172.16.0.1')))"),
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
        got = self.run_py(f"print(*par((tcp, '169.254.169.254', 80), (tcp, '192.0.2.1', 80), (tcp, '10.200.0.1', 80),"
                          f" (tcp, '{other}', 8000), (tcp, '127.0.0.1', 9), (tcp, '192.0.2.1', 5432),"
                          f" (tcp, '203.0.113.10', 80)))")
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
        self.assertEqual(self.run_py("print(*par((tcp, '2001:db8:1::10', 80), (tcp, '2001:db8:2::20', 80)))"),
                         ["ok", "fail"])
        self.assertEqual(self.egress(["v6.test", "[2001:db8:2::20]:443"]).status, 200)
        self.assertEqual(self.run_py(
            "print(dns('v6.test', socket.AF_INET6), *par((tcp, '2001:db8:1::10', 80), (tcp, '2001:db8:2::20', 443),"
            " (tcp, '2001:db8:2::20', 80)))"),
            ["2001:db8:1::10", "ok", "ok", "fail"])

    def test_smtp_is_closed_unless_a_rule_names_it(self):
        self.assertEqual(self.run_py("print(*par((tcp, '203.0.113.10', 25), (tcp, '203.0.113.10', 80)))"),
                         ["fail", "ok"])
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
            "print(dns('sub.example.com'), *par((tcp, '203.0.113.10', 80), (tls, '203.0.113.10', 'sub.example.com'),"
            " (tcp, '203.0.113.10', 80, 3, 'twin.example.com'), (tls, '203.0.113.10', 'twin.example.com'),"
            " (tcp, '203.0.113.10', 443, 3, 'twin.example.com')))"),
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
        self.assertEqual(self.run_py("print(*par((tcp, '169.254.169.254', 80), (tcp, '203.0.113.10', 80)))"),
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
        # the secrets tests' other tenant's sandbox, booted with rules and a bandwidth setting
        # (setUpModule) and first used here: one boot fewer than a sandbox of this test's own
        sb, key = WORLD["rival"], WORLD["key_rival"]
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/egress", headers=key)
        self.assertEqual(r.json(), {"rules": [HOST, "api.test:443"], "mode": "allowlist"})
        bw = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/bandwidth", headers=key).json()
        self.assertEqual((bw["quota_bytes"], bw["unmetered"]), (1 << 20, False))
        self.assertEqual(self.run_py("print(dns('api.test'), *par((tcp, '198.51.100.21', 443), (tcp, '203.0.113.10', 80)))",
                                     sb=sb, key=key),
                         ["198.51.100.21", "ok", "fail"])
        r = self.gw.request("POST", "/v1/sandboxes", {"egress": {"rules": ["bad rule"]}}, self.key)
        self.assertEqual(r.status, 422)

    def test_a_bandwidth_quota_stops_egress_when_spent_and_a_new_setting_applies_live(self):
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.b['id']}/bandwidth",
                            {"quota_bytes": 200000, "refill_bytes": 0, "refill_interval_s": 3600}, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertFalse(r.json()["unmetered"])
        code = ("s = socket.create_connection(('203.0.113.10', 8081), timeout=3)\ns.settimeout(3)\nn = 0\n"
                "try:\n    while n < 4_000_000:\n        d = s.recv(65536)\n        if not d: break\n        n += len(d)\n"
                "except Exception:\n    pass\nprint(n)")
        got = int(self.run_py(code, sb=self.b)[0])
        self.assertLess(got, 4_000_000, "the quota did not stop the download")
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.b['id']}/bandwidth", {"unmetered": True}, self.key)
        self.assertEqual(r.status, 200)
        self.assertTrue(r.json()["unmetered"])
        self.assertIsNone(r.json()["remaining_bytes"])
        self.assertGreaterEqual(int(self.run_py(code, sb=self.b)[0]), 4_000_000)


def _leaf(ca_key, ca_cert, host, d):
    """Writes a certificate for `host` signed by the CA, and its key, into `d`; returns both paths."""
    key, cert = testca.make_leaf(ca_key, ca_cert, host)
    cf, kf = os.path.join(d, host + ".crt"), os.path.join(d, host + ".key")
    with open(cf, "wb") as f:
        f.write(testca.pem_cert(cert))
    with open(kf, "wb") as f:
        f.write(testca.pem_key(key))
    return cf, kf


class SecretsTests(Timed):
    """Secrets bound to a sandbox's hosts (docstring at the top). Its sandbox, created with its
    rules and a secret, and the other tenant's (same host rule, no secret) boot with the egress
    tests' (setUpModule)."""

    @classmethod
    def setUpClass(cls):
        cls.stack = WORLD["stack"]
        cls.gw = cls.stack.gw
        cls.key, cls.other = WORLD["key_acme"], WORLD["key_rival"]
        cls.sb, cls.rival = WORLD["secrets"], WORLD["rival"]

    @staticmethod
    def internet():
        """Test CAs and the recording servers on the fake internet (their names are in its DNS,
        fakenet.py); the CA the node trusts goes to WORLD["trusted_ca"]."""
        ns = os.environ["KILN_E2E_INET_NS"]
        tmp = tempfile.TemporaryDirectory(prefix="kiln-secrets-e2e-")
        unittest.addModuleCleanup(tmp.cleanup)
        d = tmp.name
        os.chmod(d, 0o755)
        trusted_key, trusted = testca.make_ca("kiln e2e upstream CA")
        rogue_key, rogue = testca.make_ca("kiln e2e rogue CA")
        WORLD["trusted_ca"] = os.path.join(d, "upstream-ca.pem")
        with open(WORLD["trusted_ca"], "wb") as f:
            f.write(testca.pem_cert(trusted))
        specs = []
        for host, (ck, cc) in ((HOST, (trusted_key, trusted)), (ROGUE, (rogue_key, rogue))):
            specs.append("%s=%s,%s,%s" % ((host, ADDR[host]) + _leaf(ck, cc, host, d)))
        for a in list(ADDR.values()) + [SECRETS_DNS]:
            subprocess.run(["ip", "-n", ns, "addr", "add", a + "/32", "dev", "lo"], check=True)
        SecretsTests.log = os.path.join(d, "requests.jsonl")
        open(SecretsTests.log, "w").close()
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable,
                              os.path.join(HERE, "tlsrecord.py"), SecretsTests.log, SECRETS_DNS] + specs,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, TLSRECORD_MARK=MARK))

        def stop():
            p.kill()
            p.wait()
        unittest.addModuleCleanup(stop)
        assert p.stdout.readline().strip() == "ready"

    @classmethod
    def seen(cls):
        """The requests the recording servers got so far."""
        with open(cls.log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def path(self):
        return f"/v1/sandboxes/{self.sb['id']}/secrets"

    def exec(self, cmd):
        r = self.gw.request("POST", f"/v1/sandboxes/{self.sb['id']}/exec", {"cmd": cmd}, self.key,
                            timeout=120)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def test_1_listed_by_host_and_header_only_sealed_at_rest(self):
        r = self.gw.request("GET", self.path(), None, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"secrets": [{"host": HOST, "header": "Authorization"}]})
        self.assertNotIn(b"e2e-s3cret", r.data)
        sealed = self.stack.db.sql("SELECT value_sealed FROM sandbox_secrets")
        self.assertTrue(sealed.startswith("k1."), sealed)
        self.assertNotIn("e2e-s3cret", sealed)
        key = self.stack.db.sql("SELECT key_sealed FROM tenant_ca")
        self.assertTrue(key.startswith("k1."))
        self.assertNotIn("PRIVATE", key)

    def test_2_bad_sets_are_refused_and_change_nothing(self):
        for body, words in (
                ([{"host": "nope.test", "header": "X-K", "value": "v"}], "nope.test"),
                ([{"host": "a.wild.test", "header": "X-K", "value": "v"}], "a.wild.test"),
                ([{"host": "other.example.test", "header": "X-K", "value": "v"}],
                 "other.example.test"),
                ([{"host": HOST, "header": "Host", "value": "v"}], "Host"),
                ([{"host": HOST, "header": "X-K", "value": "a\r\nX-Evil: 1"}], "CR"),
                ([{"host": HOST, "header": "X Y", "value": "v"}], "X Y"),
                ([{"host": HOST, "header": "A%d" % i, "value": "v"} for i in range(3)],
                 "secrets_max")):
            r = self.gw.request("PUT", self.path(), {"secrets": body}, self.key)
            self.assertEqual(r.status, 422, (body, r))
            self.assertIn(words, r.json()["error"]["message"])
        r = self.gw.request("PUT", self.path(), {"secrets": "x"}, self.key)
        self.assertEqual(r.status, 400, r)
        r = self.gw.request("GET", self.path(), None, self.key)
        self.assertEqual(r.json(), {"secrets": [{"host": HOST, "header": "Authorization"}]})
        r = self.gw.request("POST", "/v1/sandboxes",
                            {"memory_mib": 256, "egress": {"rules": ["x.test"]},
                             "secrets": [{"host": "y.test", "header": "A", "value": "v"}]},
                            self.key, timeout=120)
        self.assertEqual(r.status, 422, r)
        self.assertIn("y.test", r.json()["error"]["message"])

    def test_3_another_tenants_sandbox_is_not_found(self):
        r = self.gw.request("GET", self.path(), None, self.other)
        self.assertEqual(r.status, 404, r)
        r = self.gw.request("PUT", self.path(), {"secrets": []}, self.other)
        self.assertEqual(r.status, 404, r)
        r = self.gw.request("GET", self.path(), None, self.key)
        self.assertEqual(len(r.json()["secrets"]), 1)

    def test_4_guest_trusts_the_tenant_ca_and_holds_no_key(self):
        ca = self.stack.db.sql("SELECT cert_pem FROM tenant_ca").strip()
        self.assertIn("BEGIN CERTIFICATE", ca)
        # one exec for all of it (each costs seconds under TCG); the request's own env wins
        r = self.gw.request(
            "POST", f"/v1/sandboxes/{self.sb['id']}/exec",
            {"cmd": ["sh", "-c", "cat /etc/ssl/certs/ca-certificates.crt; echo ===; "
                     "cat /usr/local/share/ca-certificates/kiln-tenant-ca.crt; echo ===; env; "
                     "echo ===; grep -rlsE 'PRIVATE KEY|e2e-s3cret' /etc /usr/local /root /home "
                     "/run /tmp /var/tmp; true"],
             "env": {"REQUESTS_CA_BUNDLE": "/mine"}}, self.key, timeout=120)
        self.assertEqual(r.status, 200, r)
        bundle, own, env, found = r.json()["stdout"].split("===\n")
        self.assertIn(ca.splitlines()[1], bundle)
        self.assertEqual(own.strip(), ca)
        env = env.splitlines()
        self.assertIn("SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt", env)
        self.assertIn("REQUESTS_CA_BUNDLE=/mine", env)
        self.assertIn("NODE_EXTRA_CA_CERTS=/usr/local/share/ca-certificates/kiln-tenant-ca.crt",
                      env)
        self.assertFalse([e for e in env if "e2e-s3cret" in e])
        self.assertEqual(found, "")
        # a second activation (PUT) does not append the CA twice
        r = self.gw.request("PUT", self.path(),
                            {"secrets": [{"host": HOST, "header": "X-Api-Key", "value": "k"}]},
                            self.key)
        self.assertEqual(r.status, 200, r)
        self.assertEqual(r.json(), {"secrets": [{"host": HOST, "header": "X-Api-Key"}]})
        bundle = self.exec(["cat", "/etc/ssl/certs/ca-certificates.crt"])["stdout"]
        self.assertEqual(bundle.count(ca.splitlines()[1]), 1)

    def kiln(self, *args, stdin=None):
        env = dict(os.environ, KILN_URL=self.gw.url,
                   KILN_API_KEY=self.key["Authorization"].split(" ", 1)[1])
        return subprocess.run([KILN] + list(args), input=stdin, env=env, capture_output=True,
                              text=True, timeout=120)

    def test_5_cli(self):
        sb = self.sb["id"]
        p = self.kiln("secret", sb, HOST, "Authorization", stdin="Bearer cli-e2e-s3cret\n")
        self.assertEqual((p.returncode, p.stdout), (0, f"{HOST}\tAuthorization\n"), p.stderr)
        p = self.kiln("secret", "ls", sb)
        self.assertEqual((p.returncode, p.stdout), (0, f"{HOST}\tAuthorization\n"), p.stderr)
        sealed = self.stack.db.sql("SELECT value_sealed FROM sandbox_secrets")
        self.assertNotIn("cli-e2e", sealed)
        p = self.kiln("secret", sb, "nope.test", "X-K", "--value", "v")
        self.assertEqual(p.returncode, 1, p)
        self.assertIn("nope.test", p.stderr)
        p = self.kiln("secret", sb, HOST, "X-K", stdin="")
        self.assertEqual(p.returncode, 2, p)
        p = self.kiln("secret", sb, "--clear")
        self.assertEqual((p.returncode, p.stdout), (0, ""), p.stderr)
        env = self.exec(["env"])["stdout"]
        self.assertNotIn("SSL_CERT_FILE", env)  # no secrets: exec as before
        p = self.kiln("secret", sb, HOST, "Authorization", "--value", SECRET)
        self.assertEqual(p.returncode, 0, p.stderr)

    def test_6_values_never_logged(self):
        for d in (self.stack.node, self.gw):
            self.assertNotIn("e2e-s3cret", d.output())

    def test_7_the_header_reaches_the_server_on_every_request_and_the_guest_never_sees_it(self):
        r = self.gw.request("PUT", self.path(), {"secrets": [
            {"host": HOST, "header": "Authorization", "value": SECRET},
            {"host": ROGUE, "header": "Authorization", "value": ROGUE_SECRET}]}, self.key)
        self.assertEqual(r.status, 200, r)
        start = len(self.seen())
        # One exec (each costs seconds under TCG): curl twice on one connection, urllib,
        # requests and Node, each sending an Authorization of its own; the untrusted host; then
        # the environment of every process, and the files searched for the value's first half
        # (reversed on the command line, so that no log of commands could hold it either).
        py = ("import urllib.request\n"
              "q = urllib.request.Request('https://%s/urllib',"
              " headers={'Authorization': 'Bearer guest-forged'})\n"
              "print(urllib.request.urlopen(q, timeout=30).read().decode().strip())\n"
              "try:\n    import requests\n"
              "except ImportError:\n    from pip._vendor import requests\n"
              "r = requests.get('https://%s/requests', headers={'Authorization': 'Bearer guest-forged'},"
              " timeout=30)\nprint(r.status_code, r.text.strip())\n") % (HOST, HOST)
        js = ("require('https').get('https://%s/node', {headers: {Authorization: 'Bearer guest-forged'}},"
              " r => { let b = ''; r.on('data', d => b += d);"
              " r.on('end', () => console.log(r.statusCode, b.trim())); })"
              ".on('error', e => { console.log('node error', e.message); });") % HOST
        script = (
            "cd /root; "
            "curl -sS -v -H 'Authorization: Bearer guest-forged' -w '%%{num_connects} %%{http_code}\n'"
            " https://%s/curl1 https://%s/curl2 >wire.txt 2>wire.err; "
            "python3 -c \"$PY\" >>wire.txt 2>&1; node -e \"$JS\" >>wire.txt 2>&1; "
            "curl -sS -o /dev/null -w 'rogue %%{http_code}\n' https://%s/steal >>wire.txt 2>&1; "
            "cat wire.txt; echo ===; cat wire.err; echo ===; env; "
            "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; echo ===; "
            "P=$(python3 -c 'import sys; print(sys.argv[1][::-1])' %s); "
            "grep -rlsF \"$P\" /etc /home /root /tmp /var /usr/local /run; echo ===; "
            "grep -rlsF %s /root; true") % (HOST, HOST, ROGUE, HALF1[::-1], MARK)
        r = self.gw.request("POST", f"/v1/sandboxes/{self.sb['id']}/exec",
                            {"cmd": ["sh", "-c", script], "env": {"PY": py, "JS": js},
                             "timeout_s": 240}, self.key, timeout=300)
        self.assertEqual(r.status, 200, r)
        out = r.json()["stdout"]
        self.assertNotIn(TOKEN, out)
        self.assertNotIn(HALF1, out)
        self.assertNotIn(ROGUE_SECRET.split("-")[-1], out)
        answers, sent, env, found, control = out.split("===\n")
        lines = answers.splitlines()
        # the guest got the server's answers (never an echo of a header), curl on one connection
        self.assertEqual(lines[:4], ["ok /curl1 " + MARK, "1 200", "ok /curl2 " + MARK, "0 200"],
                         (answers, sent))
        self.assertEqual(lines[4:], ["ok /urllib " + MARK, "200 ok /requests " + MARK,
                                     "200 ok /node " + MARK, "rogue 502"], answers)
        # what the guest sent: its own header, never the value
        self.assertIn("> Authorization: Bearer guest-forged", sent)
        self.assertIn("Re-using existing connection", sent)
        self.assertNotIn("e2e-s3cret", env)
        self.assertEqual(found, "")
        self.assertEqual(control.split(), ["/root/wire.txt"])  # the search finds what is there
        # the server got the value on every request, in place of the guest's own
        got = self.seen()[start:]
        self.assertEqual([(g["name"], g["path"]) for g in got],
                         [(HOST, p) for p in ("/curl1", "/curl2", "/urllib", "/requests", "/node")],
                         got)
        for g in got:
            self.assertEqual([v for k, v in g["headers"] if k.lower() == "authorization"],
                             [SECRET], g)
        self.assertEqual(got[0]["peer"], got[1]["peer"], "curl's two requests on two connections")
        # the connection log: each request on its flow's row, whether a secret was added, never
        # the value (nor the guest's own header)
        want = ";".join("GET,%s,%s,%s" % (h, p, st) for h, p, st in (
            (HOST, "/curl1", "200,true"), (HOST, "/curl2", "200,true"), (HOST, "/node", "200,true"),
            (HOST, "/requests", "200,true"), (ROGUE, "/steal", "502,false"),
            (HOST, "/urllib", "200,true")))
        deadline = time.time() + 60
        while time.time() < deadline:
            rows = self.stack.db.sql(
                "SELECT string_agg(concat_ws(',', e->>'method', e->>'host', e->>'path', e->>'status', "
                "e->>'secret'), ';' ORDER BY e->>'path') FROM sandbox_connections c, "
                f"jsonb_array_elements(c.requests) e WHERE c.sandbox_id = '{self.sb['id']}' AND "
                "e->>'path' IN ('/curl1', '/curl2', '/node', '/requests', '/steal', '/urllib')").strip()
            if rows == want:
                break
            time.sleep(1)
        self.assertEqual(rows, want)
        logged = self.stack.db.sql("SELECT string_agg(requests::text || coalesce(dns_name, ''), '') "
                                   "FROM sandbox_connections")
        self.assertNotIn("e2e-s3cret", logged)
        self.assertNotIn("guest-forged", logged)

    def test_8_another_tenants_sandbox_with_a_rule_for_the_host_gets_no_header(self):
        start = len(self.seen())
        r = self.gw.request("POST", f"/v1/sandboxes/{self.rival['id']}/exec",
                            {"cmd": ["sh", "-c", "curl -sS -k https://%s/rival; env" % HOST],
                             "timeout_s": 60}, self.other, timeout=120)
        self.assertEqual(r.status, 200, r)
        out = r.json()["stdout"]
        self.assertTrue(out.startswith("ok /rival " + MARK), r.json())
        self.assertNotIn("e2e-s3cret", out)
        self.assertNotIn("SSL_CERT_FILE", out)
        got = self.seen()[start:]
        self.assertEqual([(g["name"], g["path"]) for g in got], [(HOST, "/rival")], got)
        self.assertEqual([v for k, v in got[0]["headers"] if k.lower() == "authorization"], [])
        # and the untrusted host never got a request of anyone
        self.assertEqual([g for g in self.seen() if g["name"] == ROGUE], [])

    def test_9_the_guests_memory_holds_no_value(self):
        # the guest's memory as it was: the pause snapshot's memory file, read from the host
        r = self.gw.request("POST", f"/v1/sandboxes/{self.sb['id']}/pause", None, self.key,
                            timeout=300)
        self.assertEqual(r.status, 200, r)
        snap = self.stack.db.sql(f"SELECT pause_snapshot FROM sandboxes WHERE id = '{self.sb['id']}'")
        mem = os.path.join(self.stack.node.data_dir, "snaps", self.stack.node.node_id, snap, "mem")
        self.assertGreaterEqual(os.path.getsize(mem), 256 << 20)
        with open(mem, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            self.assertNotEqual(m.find(MARK.encode()), -1, "the search finds what the guest got")
            for needle in (HALF2, ROGUE_SECRET.split("-")[-1]):
                self.assertEqual(m.find(needle.encode()), -1, needle)
                self.assertEqual(m.find(needle.encode("utf-16-le")), -1, needle)
        # nor did the wire put a value in a log
        for d in (self.stack.node, self.gw):
            self.assertNotIn("e2e-s3cret", d.output())


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
