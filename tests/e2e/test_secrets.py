"""Secrets bound to a sandbox's hosts, as a user sees them, with one real microVM.

The API checks (exact host rule, header names, limits, another tenant's 404) and what lands where:
the values sealed in Postgres and absent from every answer and log, the tenant's CA in the guest's
bundle with SSL_CERT_FILE, REQUESTS_CA_BUNDLE and NODE_EXTRA_CA_CERTS set for exec, and the CA's
private key nowhere in the guest. Then the wire, end to end: the guest's HTTPS requests (curl twice
on one keep-alive connection, Python's urllib and requests, Node) through the name-checking proxy
and the injector to a recording TLS server on the fake internet, whose certificate a test CA the
node trusts (inject_ca_file) signed: the header on every request, replacing the guest's own; the
value nowhere in the guest (environment, files, the answers it got, its memory read from the host
in the pause snapshot's memory file); a secret's host whose certificate an untrusted CA signed
gets nothing and the guest a 502; another tenant's sandbox with a rule for the same host sends
without it. The injecting proxy's finer points are tested on the host (tests/integration/inject),
and so is a fork's copy of the set (integ_secretsdb): a fork here would double this test's time.

Run as a script: it builds the host and internet namespaces of test_egress.py and runs the tests
inside the host one; setUpClass adds the recording servers and their DNS (tlsrecord.py) to the
internet.
"""
import json
import mmap
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import unittest

import kiln
import testca
import test_egress

KILN = os.path.join(kiln.BUILD, "cli", "kiln")
HERE = os.path.dirname(os.path.abspath(__file__))

HOST = "api.example.test"
ROGUE = "rogue.example.test"   # its server's certificate comes from a CA the node does not trust
# the random part in two halves: the guest searches its files for the first one only, so that
# the whole value is never in the guest, not even in a search's command line
HALF1, HALF2 = secrets.token_hex(8), secrets.token_hex(8)
TOKEN = HALF1 + HALF2
SECRET = "Bearer e2e-s3cret-" + TOKEN
ROGUE_SECRET = "Bearer e2e-s3cret-rogue-" + secrets.token_hex(8)
MARK = "mark-" + secrets.token_hex(8)   # in every answer: the memory search must find it
RULES = {"rules": [HOST, ROGUE, "*.wild.test", "other.example.test:8443"]}
# on the fake internet: the recording servers and the DNS the node asks (KILN_DNS_UPSTREAM)
ADDR = {HOST: "198.51.100.30", ROGUE: "198.51.100.31"}
DNS = "198.51.100.53"


def _leaf(ca_key, ca_cert, host, d):
    """Writes a certificate for `host` signed by the CA, and its key, into `d`; returns both paths."""
    key, cert = testca.make_leaf(ca_key, ca_cert, host)
    cf, kf = os.path.join(d, host + ".crt"), os.path.join(d, host + ".key")
    with open(cf, "wb") as f:
        f.write(testca.pem_cert(cert))
    with open(kf, "wb") as f:
        f.write(testca.pem_key(key))
    return cf, kf


class SecretsTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.internet()
        cls.stack = kiln.Stack(node_env={"KILN_SECRETS_MAX": "2", "KILN_DNS_UPSTREAM": DNS,
                                         "KILN_INJECT_CA_FILE": cls.trusted_ca})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("acme")
        cls.other = cls.stack.tenant("rival")
        # the other tenant's sandbox (same host rule, no secret) boots alongside
        rival = {}

        def boot_rival():
            rival["r"] = cls.gw.request("POST", "/v1/sandboxes",
                                        {"memory_mib": 256, "timeout_s": 1800,
                                         "egress": {"rules": [HOST]}}, cls.other, timeout=300)
        t = threading.Thread(target=boot_rival)
        t.start()
        r = cls.gw.request("POST", "/v1/sandboxes",
                           {"memory_mib": 256, "timeout_s": 1800, "egress": RULES,
                            "secrets": [{"host": HOST, "header": "Authorization",
                                         "value": SECRET}]},
                           cls.key, timeout=300)
        t.join(330)
        assert r.status == 201, r
        cls.sb = r.json()
        assert rival.get("r") and rival["r"].status == 201, rival
        cls.rival = rival["r"].json()

    @classmethod
    def internet(cls):
        """Test CAs, the recording servers and their DNS, on the fake internet."""
        ns = os.environ["KILN_E2E_INET_NS"]
        cls.tmp = tempfile.TemporaryDirectory(prefix="kiln-secrets-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        d = cls.tmp.name
        os.chmod(d, 0o755)
        trusted_key, trusted = testca.make_ca("kiln e2e upstream CA")
        rogue_key, rogue = testca.make_ca("kiln e2e rogue CA")
        cls.trusted_ca = os.path.join(d, "upstream-ca.pem")
        with open(cls.trusted_ca, "wb") as f:
            f.write(testca.pem_cert(trusted))
        specs = []
        for host, (ck, cc) in ((HOST, (trusted_key, trusted)), (ROGUE, (rogue_key, rogue))):
            specs.append("%s=%s,%s,%s" % ((host, ADDR[host]) + _leaf(ck, cc, host, d)))
        for a in list(ADDR.values()) + [DNS]:
            subprocess.run(["ip", "-n", ns, "addr", "add", a + "/32", "dev", "lo"], check=True)
        cls.log = os.path.join(d, "requests.jsonl")
        open(cls.log, "w").close()
        p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable,
                              os.path.join(HERE, "tlsrecord.py"), cls.log, DNS] + specs,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, TLSRECORD_MARK=MARK))

        def stop():
            p.kill()
            p.wait()
        cls.addClassCleanup(stop)
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


if __name__ == "__main__":
    sys.argv[1:] = sys.argv[1:] or ["test_secrets"]
    sys.exit(test_egress.main())
