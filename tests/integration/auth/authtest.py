"""What the auth integration tests share: a gateway on a fresh database, tenants, keys, tokens.

Every test class gets its own database and gateway (started in setUpClass) so the test files
run in parallel under ctest. Rate limits are generous unless a test sets its own, so a class
that sends many requests with one key is never throttled by accident.
"""
import base64
import json
import time
import unittest

import kiln

GENEROUS = {"KILN_RATE_LIMIT_RPS": "100000", "KILN_RATE_LIMIT_BURST": "100000",
            "KILN_TENANT_RATE_LIMIT_RPS": "100000", "KILN_TENANT_RATE_LIMIT_BURST": "100000"}
TENANT_SCOPES = ["sandbox:read", "sandbox:write", "billing:read", "keys:write"]


def bearer(credential):
    return {"Authorization": "Bearer " + credential}


def b64url_decode(text):
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jwt_parts(token):
    """(header, claims) of a compact JWT, not verified."""
    h, p, _ = token.split(".")
    return json.loads(b64url_decode(h)), json.loads(b64url_decode(p))


def poll(fn, timeout, interval=0.05):
    """Calls fn() until it returns a true value or `timeout` seconds pass; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


class GatewayCase(unittest.TestCase):
    """A test class with one database and one gateway; subclasses may set EXTRA_ENV, or
    PER_TEST = True to give each test a database and gateway of its own."""

    EXTRA_ENV = {}
    PER_TEST = False

    @classmethod
    def start(cls):
        cls.services = kiln.services_env()
        cls.db = kiln.fresh_database()
        try:
            env = dict(GENEROUS)
            env.update(cls.EXTRA_ENV)
            cls.gw = kiln.Gateway(cls.db.url, cls.services["KILN_REDIS_URL"], env)
        except Exception:
            cls.db.drop()
            raise
        cls.admin = bearer(cls.gw.admin_key)

    @classmethod
    def stop(cls):
        cls.gw.cleanup()
        cls.db.drop()

    @classmethod
    def setUpClass(cls):
        if not cls.PER_TEST:
            cls.start()

    @classmethod
    def tearDownClass(cls):
        if not cls.PER_TEST:
            cls.stop()

    def setUp(self):
        if self.PER_TEST:
            type(self).start()
            self.addCleanup(type(self).stop)

    # --- helpers -------------------------------------------------------------------------

    def call(self, method, path, body=None, headers=None, gw=None):
        return (gw or self.gw).request(method, path, body, headers)

    def expect(self, r, status, code=None):
        """Asserts the status (and for errors the error model and its code); returns r."""
        self.assertEqual(r.status, status, r)
        self.assertRegex(r.headers.get("X-Request-Id", ""), r"^req_")
        if code is not None:
            err = r.json()["error"]
            self.assertEqual(err["code"], code, r)
            self.assertTrue(err["message"], r)
            self.assertEqual(err["request_id"], r.headers["X-Request-Id"])
        return r

    def new_tenant(self, name="acme"):
        """Creates a tenant with the operator's key: (tenant id, its first key, headers)."""
        r = self.expect(self.call("POST", "/v1/tenants", {"name": name}, self.admin), 201)
        body = r.json()
        return body["tenant"]["id"], body["api_key"], bearer(body["api_key"]["key"])

    def new_key(self, headers, scopes, name="k", **extra):
        body = {"name": name, "scopes": scopes}
        body.update(extra)
        r = self.expect(self.call("POST", "/v1/api-keys", body, headers), 201)
        return r.json()

    def new_token(self, headers, gw=None, **body):
        r = self.expect(self.call("POST", "/v1/tokens", body, headers, gw=gw), 201)
        return r.json()["token"]

    def audit(self, headers, want, query=""):
        """The tenant's audit entries, which must be exactly `want` already: the gateway writes a
        request's entry before its reply goes out, so a read right after sees it."""
        r = self.expect(self.call("GET", "/v1/audit?limit=500" + query, headers=headers), 200)
        entries = r.json()["entries"]
        self.assertEqual(len(entries), want, entries)
        return entries

    def counts(self):
        """Row counts of every table a request could change (the audit trail aside)."""
        return self.db.sql(
            "SELECT (SELECT count(*) FROM tenants), (SELECT count(*) FROM api_keys), "
            "(SELECT count(*) FROM api_keys WHERE revoked_at IS NOT NULL), "
            "(SELECT count(*) FROM ledger_transfers), (SELECT count(*) FROM ledger_accounts), "
            "(SELECT count(*) FROM signing_keys), (SELECT count(*) FROM idempotency)")
