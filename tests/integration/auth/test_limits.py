"""Rate limits: Redis token buckets per key with 429 + Retry-After, and the local limiter that
keeps reads going when Redis is down."""
import os
import subprocess
import time
import unittest

import kiln
from authtest import GatewayCase, bearer, poll

SMALL = {"KILN_RATE_LIMIT_RPS": "2", "KILN_RATE_LIMIT_BURST": "3"}


def burst(case, headers, n=12, path="/v1/api-keys"):
    """Sends n requests back to back; returns their responses."""
    return [case.call("GET", path, headers=headers) for _ in range(n)]


class RateLimitTests(GatewayCase):
    EXTRA_ENV = SMALL

    def new_tenant(self, name="acme"):
        """As GatewayCase's, waiting out the operator key's own small bucket when it runs dry."""
        for _ in range(20):
            r = self.call("POST", "/v1/tenants", {"name": name}, self.admin)
            if r.status != 429:
                break
            time.sleep(int(r.headers["Retry-After"]))
        body = self.expect(r, 201).json()
        return body["tenant"]["id"], body["api_key"], bearer(body["api_key"]["key"])

    def assert_limited(self, responses):
        statuses = [r.status for r in responses]
        self.assertIn(429, statuses, statuses)
        first_429 = statuses.index(429)
        # The burst of 3 passes (a refill during the burst may add one), then 429s.
        self.assertIn(first_429, (3, 4), statuses)
        self.assertTrue(all(s == 200 for s in statuses[:first_429]), statuses)
        for r in responses:
            if r.status == 429:
                self.expect(r, 429, "rate_limited")
                retry = r.headers["Retry-After"]
                self.assertRegex(retry, r"^[1-9][0-9]*$")
                self.assertLessEqual(int(retry), 1)     # one token every 0.5 s
        return first_429

    def test_a_burst_gets_429_with_retry_after_and_the_error_model(self):
        _, _, h = self.new_tenant()
        self.assert_limited(burst(self, h))

    def test_after_retry_after_the_key_is_served_again(self):
        _, _, h = self.new_tenant()
        rs = burst(self, h)
        self.assert_limited(rs)
        wait = int(next(r for r in rs if r.status == 429).headers["Retry-After"])
        time.sleep(wait)
        self.expect(self.call("GET", "/v1/api-keys", headers=h), 200)

    def test_buckets_are_per_key(self):
        _, _, ha = self.new_tenant("a")
        _, _, hb = self.new_tenant("b")
        self.assert_limited(burst(self, ha))
        self.expect(self.call("GET", "/v1/api-keys", headers=hb), 200)

    def test_a_keys_tokens_share_its_bucket(self):
        _, _, h = self.new_tenant()
        tok = bearer(self.new_token(h))
        statuses = [self.call("GET", "/v1/api-keys", headers=h if i % 2 else tok).status
                    for i in range(12)]
        self.assertIn(429, statuses)
        self.assertLessEqual(statuses.index(429), 4, statuses)

    def test_mutations_are_limited_too_and_a_429_changes_nothing(self):
        _, _, h = self.new_tenant()
        for _ in range(5):
            # Counted first (reads change none of them), so the POST follows the burst at once.
            before = self.counts()
            self.assertIn(429, [r.status for r in burst(self, h, 6)])
            r = self.call("POST", "/v1/api-keys", {"name": "x", "scopes": ["sandbox:read"]}, h)
            if r.status == 429:     # else a token came back just in time: try again
                break
        self.expect(r, 429, "rate_limited")
        self.assertEqual(self.counts(), before)

    def test_buckets_live_in_redis(self):
        tid, k, h = self.new_tenant()
        burst(self, h, 2)
        out = subprocess.run(["redis-cli", "-s", self.services["KILN_REDIS_URL"][len("unix:"):],
                              "--scan", "--pattern", f"*{k['id']}*"],
                             capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, f"redis-cli --scan failed: {out.stderr}")
        self.assertIn(k["id"], out.stdout)

    def test_unauthenticated_and_public_routes_are_not_throttled_by_a_keys_bucket(self):
        _, _, h = self.new_tenant()
        self.assert_limited(burst(self, h))
        for _ in range(5):
            self.assertEqual(self.call("GET", "/v1/.well-known/jwks.json").status, 200)
            self.assertNotEqual(self.call("GET", "/healthz").status, 429)


class RedisDownTests(unittest.TestCase):
    """Stops Redis, so it runs a Postgres and Redis pair of its own."""

    def setUp(self):
        self.env, self.db = kiln.own_services(self)
        self.gw = kiln.Gateway(self.db.url, self.env["KILN_REDIS_URL"], SMALL)
        self.addCleanup(self.gw.cleanup)
        self.admin = bearer(self.gw.admin_key)

    def shell(self, script):
        lib = os.path.join(kiln.ROOT, "scripts", "lib.sh")
        subprocess.run(["bash", "-c", f". {lib}; {script}"], check=True, capture_output=True)

    def test_reads_keep_working_with_a_local_limiter_and_healthz_names_redis(self):
        r = self.gw.request("POST", "/v1/tenants", {"name": "t"}, self.admin)
        self.assertEqual(r.status, 201, r)
        key = bearer(r.json()["api_key"]["key"])
        r = self.gw.request("POST", "/v1/tokens", {}, key)
        self.assertEqual(r.status, 201, r)
        tok = bearer(r.json()["token"])
        self.shell(f"kiln_stop_pid {self.env['KILN_TEST_REDIS_PIDFILE']} 10")

        def unhealthy():
            r = self.gw.request("GET", "/healthz")
            return r if r.status == 503 else None
        h = poll(unhealthy, 20)
        self.assertIsNotNone(h)
        self.assertEqual(h.json()["checks"]["redis"], "unavailable")
        self.assertEqual(h.json()["checks"]["postgres"], "ok")

        # Reads with an API key and with a token still answer.
        r = self.gw.request("GET", "/v1/api-keys", headers=key)
        self.assertEqual(r.status, 200, r)
        r = self.gw.request("GET", "/v1/api-keys", headers=tok)
        self.assertEqual(r.status, 200, r)
        # The local limiter holds the key to its burst of 3 (two used just above).
        rs = [self.gw.request("GET", "/v1/api-keys", headers=key) for _ in range(10)]
        statuses = [r.status for r in rs]
        self.assertEqual(statuses[0], 200, statuses)
        self.assertIn(429, statuses)
        limited = rs[statuses.index(429)]
        self.assertRegex(limited.headers["Retry-After"], r"^[1-9][0-9]*$")
        self.assertEqual(limited.json()["error"]["code"], "rate_limited")
        # Another key has a bucket of its own.
        r = self.gw.request("GET", "/v1/api-keys", headers=self.admin)
        self.assertEqual(r.status, 200, r)

        # Redis back: healthz says so, and the Redis buckets are used again.
        d = self.env["KILN_TEST_DIR"]
        self.shell(f"kiln_redis_start {d}/redis {d}/s/redis.sock {d}/redis.pid {d}/redis.log")
        self.assertTrue(poll(lambda: self.gw.request("GET", "/healthz").json()["checks"]["redis"] == "ok",
                             20))
        self.redis("FLUSHALL")
        self.assertEqual(self.gw.request("GET", "/v1/api-keys", headers=self.admin).status, 200)
        # A bucket the gateway knows reaches Redis with its next reconciliation (every 25 ms).
        self.assertTrue(poll(lambda: "kiln:rls:req:" in self.redis("--scan", "--pattern", "kiln:rls:*"),
                             5))

    def redis(self, *args):
        sock = self.env["KILN_REDIS_URL"][len("unix:"):]
        return subprocess.run(["redis-cli", "-s", sock, *args], check=True, capture_output=True,
                              text=True).stdout


if __name__ == "__main__":
    unittest.main()
