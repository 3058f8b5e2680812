"""Secrets bound to a sandbox's hosts, as a user sees them, with one real microVM.

The API checks (exact host rule, header names, limits, another tenant's 404) and what lands where:
the values sealed in Postgres and absent from every answer and log, the tenant's CA in the guest's
bundle with SSL_CERT_FILE, REQUESTS_CA_BUNDLE and NODE_EXTRA_CA_CERTS set for exec, and the CA's
private key nowhere in the guest. The injecting proxy itself is tested on the host
(tests/integration/inject), and so is a fork's copy of the set (integ_secretsdb): a fork here
would double this test's time.
"""
import os
import subprocess
import unittest

import kiln

KILN = os.path.join(kiln.BUILD, "cli", "kiln")

HOST = "api.example.test"
SECRET = "Bearer e2e-s3cret-7d1f0a"
RULES = {"rules": [HOST, "*.wild.test", "other.example.test:8443"]}


class SecretsTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env={"KILN_SECRETS_MAX": "2"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("acme")
        cls.other = cls.stack.tenant("rival")
        r = cls.gw.request("POST", "/v1/sandboxes",
                           {"memory_mib": 256, "timeout_s": 1800, "egress": RULES,
                            "secrets": [{"host": HOST, "header": "Authorization",
                                         "value": SECRET}]},
                           cls.key, timeout=300)
        assert r.status == 201, r
        cls.sb = r.json()

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


if __name__ == "__main__":
    unittest.main()
