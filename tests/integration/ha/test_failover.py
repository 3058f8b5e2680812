"""test_failover.py - kiln-gateway across a Postgres promotion and a Redis Sentinel failover.

Its own services, in a temporary directory, on free loopback ports (never the "services"
fixture's): a Postgres 15 primary and a streaming standby made with pg_basebackup, a Redis primary,
its replica and one sentinel (quorum 1). kiln-gateway connects with a multi-host libpq string
(target_session_attrs=read-write) and finds Redis through the sentinel. Workers drive a stream of
mutating requests, each with its own Idempotency-Key (tenant signups, credit grants, API keys),
retrying a request with the same key while it gets 503 (which must carry Retry-After), a dropped
connection, or 409 "in progress". Meanwhile the Postgres primary is stopped and the standby
promoted, and then Sentinel fails Redis over to the replica.

Before the Redis switch the replica is made to lag on purpose: the balance hashes of tenants whose
requests are over are overwritten on it with an invented ledger balance and an old sequence
number, as a replica that missed the primary's last writes would hold them. After the switch the
gateway must rebuild them from the ledger (api/failover.h).

Then: every request succeeded, once (no tenant, grant or key twice, none lost); a replay of a
request answers what the first did; the ledger is exact; and every tenant's balance in Redis (the
new primary) equals its ledger balance in Postgres. Every process the test starts is stopped by
its pid.
"""
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.error

import kiln

PG_BIN = "/usr/lib/postgresql/15/bin"
USER = "kiln"       # the services' owner (scripts/lib.sh KILN_USER): Postgres refuses root
MASTER = "kiln"     # the name Sentinel monitors the Redis primary under
GRANT_UCR = 7_000_000
LAG_UCR = 999_000_000_000   # the invented balance the lagging replica holds
OP_DEADLINE_S = 90          # how long one request may keep being retried


def run(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, user=USER, **kw)


def redis(port, *args):
    """One redis-cli command against 127.0.0.1:`port`; its output, stripped."""
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *map(str, args)],
                         check=True, capture_output=True, text=True, timeout=10)
    return out.stdout.strip()


T0 = time.time()


def note(what):
    print(f"[{time.time() - T0:6.1f} s] {what}", flush=True)


def wait_for(what, pred, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if pred():
                return
        except (subprocess.CalledProcessError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError("timed out waiting for " + what)


class Services:
    """Postgres primary + standby, Redis primary + replica + sentinel; stop() ends them by pid."""

    def __init__(self, host="127.0.0.1", clients=None):
        """`host`: an address of this host every service listens on besides 127.0.0.1, and the
        one the sentinel knows the Redis primary by (so daemons in other network namespaces reach
        them: tests/ha/rolling.py); `clients`: a CIDR Postgres trusts connections from besides."""
        self.host, self.clients = host, clients
        self.dir = tempfile.mkdtemp(prefix="kiln-ha-")
        shutil.chown(self.dir, USER, USER)
        os.chmod(self.dir, 0o755)
        self.procs = {}
        self.logs = {}

    def path(self, *p):
        return os.path.join(self.dir, *p)

    def spawn(self, name, args):
        log = open(self.path(name + ".log"), "w")
        shutil.chown(log.name, USER, USER)
        self.logs[name] = log
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, user=USER,
                                            group=USER, cwd=self.dir)

    def postgres(self, name, port):
        sock = self.path("sock-" + name)
        os.makedirs(sock, exist_ok=True)
        shutil.chown(sock, USER, USER)
        self.spawn(name, [PG_BIN + "/postgres", "-D", self.path(name), "-c", f"port={port}",
                          "-c", f"listen_addresses={','.join(sorted({'127.0.0.1', self.host}))}", "-c", f"unix_socket_directories={sock}",
                          "-c", "wal_level=replica", "-c", "max_wal_senders=4",
                          "-c", "hot_standby=on", "-c", "wal_sender_timeout=10s"])
        wait_for(f"postgres {name}", lambda: subprocess.run(
            [PG_BIN + "/pg_isready", "-q", "-h", "127.0.0.1", "-p", str(port)]).returncode == 0, 60)

    def start(self):
        """Redis, its replica and the sentinel start first and settle while Postgres is made
        (initdb and pg_basebackup without their fsyncs: nothing here outlives a crash of the
        machine, and the promotion test stops the primary cleanly)."""
        self.pg1, self.pg2 = kiln.free_port(), kiln.free_port()
        self.r1, self.r2, self.sent = kiln.free_port(), kiln.free_port(), kiln.free_port()
        for name, port, extra in (("redis1", self.r1, []),
                                  ("redis2", self.r2, ["--replicaof", self.host, str(self.r1)])):
            os.makedirs(self.path(name), exist_ok=True)
            shutil.chown(self.path(name), USER, USER)
            self.spawn(name, ["redis-server", "--port", str(port), "--bind", *sorted({"127.0.0.1", self.host}),
                              "--dir", self.path(name), "--save", "", "--appendonly", "no",
                              # `host` is this machine's own (the namespaces' side of their veths)
                              "--protected-mode", "no" if self.host != "127.0.0.1" else "yes",
                              *extra])
        conf = self.path("sentinel.conf")
        with open(conf, "w") as f:
            f.write(f"port {self.sent}\nbind {' '.join(sorted({'127.0.0.1', self.host}))}\ndir {self.dir}\n"
                    f"protected-mode {'no' if self.host != '127.0.0.1' else 'yes'}\n"
                    f"sentinel monitor {MASTER} {self.host} {self.r1} 1\n"
                    f"sentinel down-after-milliseconds {MASTER} 3000\n"
                    f"sentinel failover-timeout {MASTER} 20000\n")
        shutil.chown(conf, USER, USER)
        self.spawn("sentinel", ["redis-server", conf, "--sentinel"])

        run([PG_BIN + "/initdb", "-D", self.path("pg1"), "-U", USER, "--auth=trust", "--no-sync",
             "--encoding=UTF8", "--locale=C.UTF-8"])
        with open(self.path("pg1", "pg_hba.conf"), "a") as f:
            f.write("host replication all 127.0.0.1/32 trust\n")
            if self.clients:
                f.write(f"host all all {self.clients} trust\n")
        self.postgres("pg1", self.pg1)
        self.psql(self.pg1, "postgres", "CREATE DATABASE kiln")
        run([PG_BIN + "/pg_basebackup", "-h", "127.0.0.1", "-p", str(self.pg1), "-U", USER,
             "-D", self.path("pg2"), "-R", "-X", "stream", "-c", "fast", "--no-sync"])
        self.postgres("pg2", self.pg2)
        wait_for("the standby streaming", lambda: self.psql(
            self.pg1, "postgres", "SELECT count(*) FROM pg_stat_replication") == "1", 60)

        for name, port in (("redis1", self.r1), ("redis2", self.r2)):
            wait_for(name, lambda p=port: redis(p, "PING") == "PONG", 30)
        wait_for("the redis replica in sync", lambda: "master_link_status:up" in redis(
            self.r2, "INFO", "replication"), 30)
        wait_for("the sentinel to know the replica", lambda: str(self.r2) in redis(
            self.sent, "SENTINEL", "replicas", MASTER), 60)

    def psql(self, port, db, sql):
        return subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(port), "-U", USER, "-d", db,
                               "-tAqc", sql], check=True, capture_output=True, text=True,
                              timeout=30).stdout.strip()

    def stop_one(self, name, sig=signal.SIGTERM):
        p = self.procs.get(name)
        if p and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop(self):
        for name in list(self.procs):
            # SIGINT is Postgres's fast shutdown; Redis and Sentinel end on SIGTERM.
            self.stop_one(name, signal.SIGINT if name.startswith("pg") else signal.SIGTERM)
        for log in self.logs.values():
            log.close()
        if os.environ.get("KILN_TEST_SHOW_LOGS"):
            for name in self.logs:
                with open(self.path(name + ".log"), errors="replace") as f:
                    print(f"--- {name} ---\n{f.read()}")
        shutil.rmtree(self.dir, ignore_errors=True)


class Stream:
    """Workers sending mutating requests with Idempotency-Keys and retrying them until done."""

    def __init__(self, gw, admin):
        self.gw, self.admin = gw, admin
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = []          # one dict per finished sequence of a worker
        self.failures = []      # requests answered something no retry may hide
        self.retries = {}       # status or error -> count
        self.missing_retry_after = 0

    def call(self, method, path, body, key, token):
        """Sends until a 2xx; returns the response, or None after recording a failure."""
        headers = {"Authorization": "Bearer " + token, "Idempotency-Key": key}
        deadline = time.time() + OP_DEADLINE_S
        while time.time() < deadline:
            try:
                r = kiln.http(method, self.gw.url + path, body, headers, timeout=30)
            except (urllib.error.URLError, ConnectionError, OSError, http_client_errors()) as e:
                self.count("connection " + type(e).__name__)
                time.sleep(0.2)
                continue
            if 200 <= r.status < 300:
                return r
            code = ""
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                pass
            if r.status == 503:
                self.count(f"503 {code}")
                if not r.headers.get("Retry-After"):
                    with self.lock:
                        self.missing_retry_after += 1
                time.sleep(min(float(r.headers.get("Retry-After") or 1), 2) / 4)
                continue
            if r.status == 409 and b"in progress" in r.data:
                self.count("409 in progress")
                time.sleep(0.3)
                continue
            with self.lock:
                self.failures.append((method, path, key, r.status, r.data[:300]))
            return None
        with self.lock:
            self.failures.append((method, path, key, "gave up", b""))
        return None

    def count(self, what):
        with self.lock:
            self.retries[what] = self.retries.get(what, 0) + 1

    def worker(self, w):
        i = 0
        while not self.stop.is_set():
            tag = f"{w}-{i}-{secrets.token_hex(3)}"
            rec = {"tag": tag, "keys": {}}
            k = rec["keys"]["tenant"] = "ha-tenant-" + tag
            r = self.call("POST", "/v1/tenants", {"name": "ha-" + tag}, k, self.admin)
            if not r:
                return
            rec["tenant"] = r.json()["tenant"]["id"]
            rec["tenant_body"] = r.json()
            tkey = r.json()["api_key"]["key"]
            k = rec["keys"]["grant"] = "ha-grant-" + tag
            r = self.call("POST", "/v1/billing/grants",
                          {"tenant_id": rec["tenant"], "amount_ucr": GRANT_UCR, "reason": "ha " + tag},
                          k, self.admin)
            if not r:
                return
            rec["grant"] = r.json()["id"]
            k = rec["keys"]["key"] = "ha-key-" + tag
            r = self.call("POST", "/v1/api-keys", {"name": "k-" + tag, "scopes": ["sandbox:read"]},
                          k, tkey)
            if not r:
                return
            rec["key"] = r.json()["id"]
            rec["token"] = tkey
            with self.lock:
                self.done.append(rec)
            i += 1


def http_client_errors():
    import http.client
    return http.client.HTTPException


class FailoverTest(unittest.TestCase):
    def setUp(self):
        self.svc = Services()
        self.addCleanup(self.svc.stop)
        self.svc.start()
        note("postgres primary and standby, redis, its replica and the sentinel up")
        s = self.svc
        self.gw = kiln.Gateway(
            f"host=127.0.0.1,127.0.0.1 port={s.pg1},{s.pg2} user={USER} dbname=kiln "
            "target_session_attrs=read-write", "127.0.0.1:1",
            extra_env={"KILN_REDIS_SENTINELS": f"127.0.0.1:{s.sent}",
                       "KILN_REDIS_MASTER_NAME": MASTER,
                       "KILN_LOG_LEVEL": "info",
                       "KILN_RATE_LIMIT_RPS": "100000", "KILN_RATE_LIMIT_BURST": "100000",
                       "KILN_TENANT_RATE_LIMIT_RPS": "100000",
                       "KILN_TENANT_RATE_LIMIT_BURST": "100000",
                       "KILN_TENANT_MAX_IN_FLIGHT": "1000"})
        self.addCleanup(self.gw.cleanup)
        wait_for("the admin key", lambda: self.gw.admin_key, 30)
        note("gateway up")

    def test_promotion_and_sentinel_failover_lose_nothing(self):
        s, gw = self.svc, self.gw
        stream = Stream(gw, gw.admin_key)
        workers = [threading.Thread(target=stream.worker, args=(w,)) for w in range(4)]
        for t in workers:
            t.start()
        try:
            wait_for("requests done before the switches", lambda: len(stream.done) >= 8, 60)
            note(f"{len(stream.done)} sequences done; stopping the Postgres primary")
            # Postgres: the primary stops (fast shutdown), the standby is promoted.
            before_pg = len(stream.done)
            s.stop_one("pg1", signal.SIGINT)
            s.psql(s.pg2, "postgres", "SELECT pg_promote(true, 60)")
            wait_for("requests done on the new primary",
                     lambda: len(stream.done) >= before_pg + 8, 60)

            note(f"{len(stream.done)} done; the Redis replica lags, then Sentinel fails over")
            # Redis: the replica lags (see the top comment), then Sentinel fails over to it.
            with stream.lock:
                settled = [rec["tenant"] for rec in stream.done]
            redis(s.r2, "CONFIG", "SET", "replica-read-only", "no")
            for t in settled:
                redis(s.r2, "HSET", "kiln:bal:" + t, "ledger", LAG_UCR, "lseq", 0)
            self.assertEqual(redis(s.r2, "HGET", "kiln:bal:" + settled[0], "ledger"),
                             str(LAG_UCR))
            before_redis = len(stream.done)
            self.assertEqual(redis(s.sent, "SENTINEL", "FAILOVER", MASTER), "OK")
            wait_for("sentinel to name the replica the primary", lambda: redis(
                s.sent, "SENTINEL", "get-master-addr-by-name", MASTER).split()[-1] == str(s.r2),
                60)
            wait_for("requests done after the redis switch",
                     lambda: len(stream.done) >= before_redis + 8, 60)
            note(f"{len(stream.done)} done; stopping the stream")
        finally:
            stream.stop.set()
            for t in workers:
                t.join(OP_DEADLINE_S + 30)

        note("stream stopped")
        self.assertEqual(stream.failures, [], "requests that failed for good")
        self.assertEqual(stream.missing_retry_after, 0, "503 replies without Retry-After")
        retried = sum(stream.retries.values())
        self.assertGreater(retried, 0, f"no request met the switches: {stream.retries}")
        print(f"{len(stream.done)} request sequences; retried: {stream.retries}")

        db = lambda sql: s.psql(s.pg2, "kiln", sql)
        rows = lambda sql: [line.split("|") for line in db(sql).splitlines() if line]
        done = stream.done
        # Nothing lost, nothing twice: one tenant per signup, one grant per grant, one key per key.
        tenants = {}
        for tid, name in rows("SELECT id, name FROM tenants WHERE name LIKE 'ha-%'"):
            tenants.setdefault(name, []).append(tid)
        keys = dict(rows("SELECT name, count(*) FROM api_keys WHERE name LIKE 'k-%' GROUP BY name"))
        grants = {t: (int(n), int(a)) for t, n, a in rows(
            "SELECT tenant_id, count(*), sum(amount_ucr) FROM ledger_transfers "
            "WHERE kind = 'grant' AND reason LIKE 'ha %' GROUP BY tenant_id")}
        self.assertEqual(len(tenants), len(done), "a tenant of a request never answered")
        for rec in done:
            self.assertEqual(tenants.get("ha-" + rec["tag"]), [rec["tenant"]], rec)
            self.assertEqual(keys.get("k-" + rec["tag"]), "1", rec)
            self.assertEqual(grants.get(rec["tenant"]), (1, GRANT_UCR), rec)

        # A replay answers what the first answered.
        for rec in done[:3] + done[-3:]:
            r = gw.request("POST", "/v1/tenants", {"name": "ha-" + rec["tag"]},
                           {"Authorization": "Bearer " + gw.admin_key,
                            "Idempotency-Key": rec["keys"]["tenant"]})
            self.assertEqual(r.status, 201, r)
            self.assertEqual(r.headers.get("Idempotent-Replayed"), "true")
            self.assertEqual(r.json()["tenant"]["id"], rec["tenant"])

        # The ledger is exact, and Redis's balances (the new primary's) equal it.
        bal = {t: int(b) for t, b in rows(
            "SELECT tenant_id, sum(balance_ucr) FROM ledger_account_balances GROUP BY tenant_id")}
        granted = {t: int(a) for t, a in rows(
            "SELECT tenant_id, sum(amount_ucr) FROM ledger_transfers WHERE kind = 'grant' "
            "GROUP BY tenant_id")}
        expect = {rec["tenant"]: bal.get(rec["tenant"], 0) for rec in done}
        for t in expect:
            self.assertEqual(expect[t], granted.get(t), t)

        def redis_wrong():
            cmds = "".join(f"HGET kiln:bal:{t} ledger\n" for t in expect)
            out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(s.r2)], input=cmds,
                                 check=True, capture_output=True, text=True, timeout=30)
            got = out.stdout.splitlines()
            return {t: (g, expect[t]) for t, g in zip(expect, got) if g != str(expect[t])}
        try:
            wait_for("every live balance to equal the ledger", lambda: not redis_wrong(), 30)
        except AssertionError:
            self.fail("live balances (redis, ledger) that differ: " +
                      json.dumps(redis_wrong())[:2000])
        for rec in done[:5]:
            r = gw.request("GET", "/v1/billing/balance", None,
                           {"Authorization": "Bearer " + rec["token"]})
            self.assertEqual(r.status, 200, r)
            self.assertEqual(r.json()["balance_ucr"], expect[rec["tenant"]], r)

        # The gateway went through both switches without a fault of its own (sanitizers, leaks):
        # it ends cleanly.
        self.assertEqual(gw.stop(), 0, gw.output()[-4000:])


if __name__ == "__main__":
    unittest.main()
