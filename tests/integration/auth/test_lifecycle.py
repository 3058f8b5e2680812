"""Credentials over time: revocation across gateways, expiry of tokens and keys, signing key
rotation with `kiln-gateway --rotate-signing-key` (reaching running gateways and kiln-meter)."""
import datetime
import os
import shutil
import subprocess
import tempfile
import time
import unittest

import kiln
from authtest import GENEROUS, GatewayCase, bearer, jwt_parts, poll

KEY_CACHE_S = 5


def wait_for_second_start():
    """Sleeps to just after a wall-clock second starts, so a 1 s token has its whole second."""
    time.sleep(1.02 - time.time() % 1)


class RevocationTests(GatewayCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # A second gateway process on the same database with the same master key.
        cls.gw2 = kiln.Gateway(cls.db.url, cls.services["KILN_REDIS_URL"], GENEROUS,
                               master_key=cls.gw.master_key)

    @classmethod
    def tearDownClass(cls):
        cls.gw2.cleanup()
        super().tearDownClass()

    def test_revoked_key_is_401_at_once_here_and_within_5_s_on_another_gateway(self):
        _, _, h = self.new_tenant()
        k = self.new_key(h, ["keys:write"])
        kh = bearer(k["key"])
        # Both gateways know (and cache) the key.
        self.expect(self.call("GET", "/v1/api-keys", headers=kh), 200)
        self.expect(self.call("GET", "/v1/api-keys", headers=kh, gw=self.gw2), 200)
        self.expect(self.call("DELETE", f"/v1/api-keys/{k['id']}", headers=h), 204)
        revoked_at = time.monotonic()
        r = self.expect(self.call("GET", "/v1/api-keys", headers=kh), 401, "unauthenticated")
        self.assertIn("revoked", r.json()["error"]["message"])
        self.expect(self.call("POST", "/v1/tokens", {}, kh), 401, "unauthenticated")

        def refused_on_gw2():
            return self.call("GET", "/v1/api-keys", headers=kh, gw=self.gw2).status == 401
        self.assertTrue(poll(refused_on_gw2, KEY_CACHE_S + 3))
        self.assertLessEqual(time.monotonic() - revoked_at, KEY_CACHE_S + 0.5)
        # And it stays refused on both.
        for gw in (self.gw, self.gw2):
            self.expect(self.call("GET", "/v1/api-keys", headers=kh, gw=gw), 401, "unauthenticated")
        # The tenant's other key is untouched.
        self.expect(self.call("GET", "/v1/api-keys", headers=h, gw=self.gw2), 200)

    def test_a_key_revoked_on_another_gateway_mints_no_token_while_cached_here(self):
        """POST /v1/tokens reads its key's row from Postgres, not the key cache: revoked through
        gw2, the key still lists on gw (its cache, up to 5 s) but mints nothing there, with an
        Idempotency-Key (the claim's statement reads the row) or without one (the route does);
        and a key that expires in a minute caps the token's exp either way."""
        _, _, h = self.new_tenant()
        k = self.new_key(h, ["keys:write"])
        kh = bearer(k["key"])
        self.expect(self.call("GET", "/v1/api-keys", headers=kh), 200)
        self.expect(self.call("DELETE", f"/v1/api-keys/{k['id']}", headers=h, gw=self.gw2), 204)
        self.expect(self.call("GET", "/v1/api-keys", headers=kh), 200)  # still cached here
        r = self.expect(self.call("POST", "/v1/tokens", {}, dict(kh, **{"Idempotency-Key": "rv-1"})),
                        401, "unauthenticated")
        self.assertIn("revoked", r.json()["error"]["message"])
        r = self.expect(self.call("POST", "/v1/tokens", {}, kh), 401, "unauthenticated")
        self.assertIn("revoked", r.json()["error"]["message"])
        # A retry of the refused request replays its refusal; no token was ever minted.
        r = self.call("POST", "/v1/tokens", {}, dict(kh, **{"Idempotency-Key": "rv-1"}))
        self.assertEqual(r.status, 401, r)
        self.assertEqual(r.headers.get("Idempotent-Replayed"), "true")

        soon = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60))
        k2 = self.new_key(h, ["keys:write"], expires_at=soon.strftime("%Y-%m-%dT%H:%M:%SZ"))
        k2h = bearer(k2["key"])
        for hdr in (dict(k2h, **{"Idempotency-Key": "exp-1"}), k2h):
            t = self.expect(self.call("POST", "/v1/tokens", {"ttl_s": 900}, hdr), 201).json()
            _, claims = jwt_parts(t["token"])
            self.assertLessEqual(claims["exp"], int(soon.timestamp()))
            self.assertGreater(claims["exp"], int(soon.timestamp()) - 10)

    def test_revocation_through_the_second_gateway_is_immediate_there(self):
        _, _, h = self.new_tenant()
        k = self.new_key(h, ["keys:write"])
        kh = bearer(k["key"])
        self.expect(self.call("GET", "/v1/api-keys", headers=kh, gw=self.gw2), 200)
        self.expect(self.call("DELETE", f"/v1/api-keys/{k['id']}", headers=bearer(self.new_token(h))
                              , gw=self.gw2), 204)
        self.expect(self.call("GET", "/v1/api-keys", headers=kh, gw=self.gw2), 401, "unauthenticated")

    def test_a_key_may_revoke_itself(self):
        _, _, h = self.new_tenant()
        k = self.new_key(h, ["keys:write"])
        kh = bearer(k["key"])
        self.expect(self.call("DELETE", f"/v1/api-keys/{k['id']}", headers=kh), 204)
        self.expect(self.call("GET", "/v1/api-keys", headers=kh), 401, "unauthenticated")

    def test_tokens_verify_on_every_gateway(self):
        _, _, h = self.new_tenant()
        t1 = bearer(self.new_token(h))
        t2 = bearer(self.new_token(h, gw=self.gw2))
        for gw in (self.gw, self.gw2):
            for t in (t1, t2):
                self.expect(self.call("GET", "/v1/api-keys", headers=t, gw=gw), 200)


class ExpiryTests(GatewayCase):
    def test_token_with_ttl_1_is_401_once_it_expires(self):
        _, _, h = self.new_tenant()
        wait_for_second_start()
        tok = self.new_token(h, ttl_s=1)
        _, claims = jwt_parts(tok)
        self.assertEqual(claims["exp"] - claims["iat"], 1)
        self.expect(self.call("GET", "/v1/api-keys", headers=bearer(tok)), 200)

        def refused():
            return self.call("GET", "/v1/api-keys", headers=bearer(tok)).status == 401
        self.assertTrue(poll(refused, 3))
        self.assertGreaterEqual(time.time(), claims["exp"])
        r = self.expect(self.call("GET", "/v1/api-keys", headers=bearer(tok)), 401, "unauthenticated")
        self.assertIn("expired", r.json()["error"]["message"])

    def test_api_key_stops_working_once_expires_at_passes(self):
        _, _, h = self.new_tenant()
        ends = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=3)
        k = self.new_key(h, ["keys:write"], expires_at=ends.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        kh = bearer(k["key"])
        listed = self.expect(self.call("GET", "/v1/api-keys", headers=kh), 200).json()["api_keys"]
        self.assertIsNotNone(next(x for x in listed if x["id"] == k["id"])["expires_at"])
        # Until then it works for everything it may do.
        self.new_token(kh, ttl_s=60)

        def refused():
            return self.call("GET", "/v1/api-keys", headers=kh).status == 401
        self.assertTrue(poll(refused, 6))
        self.assertGreaterEqual(datetime.datetime.now(datetime.timezone.utc), ends)
        r = self.expect(self.call("GET", "/v1/api-keys", headers=kh), 401, "unauthenticated")
        self.assertIn("expired", r.json()["error"]["message"])
        self.expect(self.call("POST", "/v1/tokens", {}, kh), 401, "unauthenticated")

    def test_expires_at_with_an_offset_is_accepted(self):
        _, _, h = self.new_tenant()
        k = self.new_key(h, ["sandbox:read"], expires_at="2099-06-01T12:00:00+02:00")
        self.assertEqual(self.db.sql(f"SELECT rfc3339(expires_at) FROM api_keys WHERE id = '{k['id']}'"),
                         "2099-06-01T10:00:00Z")


class RotationTests(GatewayCase):
    """Each test rotates, so each has a database and a gateway of its own."""

    PER_TEST = True

    def rotate(self):
        env = dict(os.environ)
        env.update({"KILN_DATABASE_URL": self.db.url, "KILN_MASTER_KEY": self.gw.master_key,
                    "KILN_REDIS_URL": self.services["KILN_REDIS_URL"], "KILN_LOG_LEVEL": "warn"})
        out = subprocess.run([os.path.join(kiln.BUILD, "api", "kiln-gateway"), "--rotate-signing-key"],
                             env=env, capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        words = out.stdout.split()
        self.assertEqual(words[:3], ["new", "signing", "key"], out.stdout)
        return words[3]

    def kids(self, gw=None):
        return {k["kid"] for k in self.call("GET", "/v1/.well-known/jwks.json", gw=gw).json()["keys"]}

    def test_rotation_keeps_old_tokens_valid_and_new_tokens_use_the_new_key(self):
        _, _, h = self.new_tenant()
        old_tok = self.new_token(h)
        old_kid = jwt_parts(old_tok)[0]["kid"]
        self.assertEqual(self.kids(), {old_kid})

        new_kid = self.rotate()
        self.assertNotEqual(new_kid, old_kid)
        self.assertEqual(self.db.sql("SELECT kid FROM signing_keys WHERE retired_at IS NULL"), new_kid)

        # The running gateway picks the new key up without a restart: its new tokens carry the
        # new kid and its JWKS lists both keys.
        def signs_with_new_key():
            return jwt_parts(self.new_token(h))[0]["kid"] == new_kid
        self.assertTrue(poll(signs_with_new_key, 15, interval=0.5))
        self.assertEqual(self.kids(), {old_kid, new_kid})
        # The token of before the rotation still verifies.
        self.expect(self.call("GET", "/v1/api-keys", headers=bearer(old_tok)), 200)

        # A gateway started after the rotation signs with the new key at once and verifies both.
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"], GENEROUS,
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        new_tok = self.new_token(h, gw=gw2)
        self.assertEqual(jwt_parts(new_tok)[0]["kid"], new_kid)
        self.assertEqual(self.kids(gw2), {old_kid, new_kid})
        for gw in (self.gw, gw2):
            for tok in (old_tok, new_tok):
                self.expect(self.call("GET", "/v1/api-keys", headers=bearer(tok), gw=gw), 200)

    def test_a_token_of_a_key_made_elsewhere_is_learnt_on_first_sight(self):
        _, _, h = self.new_tenant()
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"], GENEROUS,
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        new_kid = self.rotate()
        gw3 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"], GENEROUS,
                           master_key=self.gw.master_key)
        self.addCleanup(gw3.cleanup)
        tok = self.new_token(h, gw=gw3)
        self.assertEqual(jwt_parts(tok)[0]["kid"], new_kid)
        # gw2 has not reloaded yet, but an unknown kid makes it reload at once.
        self.expect(self.call("GET", "/v1/api-keys", headers=bearer(tok), gw=gw2), 200)
        self.assertIn(new_kid, self.kids(gw2))

    def test_a_key_retired_over_an_hour_ago_no_longer_verifies(self):
        _, _, h = self.new_tenant()
        old_tok = self.new_token(h)
        old_kid = jwt_parts(old_tok)[0]["kid"]
        self.rotate()
        self.db.sql(f"UPDATE signing_keys SET retired_at = now() - interval '2 hours' "
                    f"WHERE kid = '{old_kid}'")
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"], GENEROUS,
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        self.assertNotIn(old_kid, self.kids(gw2))
        r = self.expect(self.call("GET", "/v1/api-keys", headers=bearer(old_tok), gw=gw2), 401,
                        "unauthenticated")
        self.assertIn("unknown_kid", r.json()["error"]["message"])

    def test_rotation_with_a_wrong_master_key_fails_and_changes_nothing(self):
        keys = "SELECT string_agg(kid || coalesce(retired_at::text, '-'), ',' ORDER BY kid) FROM signing_keys"
        before = self.db.sql(keys)
        env = dict(os.environ)
        env.update({"KILN_DATABASE_URL": self.db.url, "KILN_MASTER_KEY": "00" * 32,
                    "KILN_LOG_LEVEL": "warn"})
        out = subprocess.run([os.path.join(kiln.BUILD, "api", "kiln-gateway"), "--rotate-signing-key"],
                             env=env, capture_output=True, text=True, timeout=60)
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn("master key", out.stderr)
        self.assertEqual(self.db.sql(keys), before)
        # Gateways still start and sign.
        gw2 = kiln.Gateway(self.db.url, self.services["KILN_REDIS_URL"], GENEROUS,
                           master_key=self.gw.master_key)
        self.addCleanup(gw2.cleanup)
        self.new_token(self.admin, gw=gw2)

    def test_kiln_meter_loads_a_rotation_within_the_period_with_no_pause_asked(self):
        # kiln-meter signs the node tokens of its pauses. Its keys reload on a thread of their own,
        # so a rotation reaches it with no pause asked (none is here), not inline on a pause's path.
        cgroups = tempfile.mkdtemp(prefix="kiln-cgroup-")
        self.addCleanup(shutil.rmtree, cgroups, True)
        meter = kiln.Daemon(os.path.join(kiln.BUILD, "metering", "kiln-meter"),
                            {"KILN_DATABASE_URL": self.db.url,
                             "KILN_REDIS_URL": self.services["KILN_REDIS_URL"],
                             "KILN_NODE_ID": "tn" + os.urandom(4).hex(),
                             "KILN_MASTER_KEY": self.gw.master_key,
                             "KILN_METER_CGROUP_ROOT": cgroups,
                             "KILN_METER_PIN_ROOT": "/nonexistent-pins", "KILN_LOG_LEVEL": "info"})
        self.addCleanup(meter.cleanup)
        old_kid = self.db.sql("SELECT kid FROM signing_keys WHERE retired_at IS NULL")
        self.assertTrue(poll(lambda: f"signing key {old_kid} signs" in meter.output(), 15, 0.1),
                        meter.output())
        new_kid = self.rotate()
        t0 = time.monotonic()
        self.assertTrue(poll(lambda: f"signing key {new_kid} signs" in meter.output(), 15, 0.1),
                        meter.output())
        # the period, 5 s, and the thread's 1 s tick, with a margin for a sanitized build under
        # load; with no reloading thread it is never logged (the poll above fails after 15 s)
        self.assertLess(time.monotonic() - t0, 12)
        self.assertTrue(meter.alive(), meter.output())


if __name__ == "__main__":
    unittest.main()
