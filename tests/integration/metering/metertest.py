"""metertest.py - what the metering integration tests share.

Real cgroups holding an idle `sleep` stand in for VMs (kiln-meter reads kiln/<node>/<sandbox>
under each v1 controller, as it does for a jailed QEMU), rows in `sandboxes` say what runs where,
and a real kiln-meter bills them against the test's own database and Redis. Prices are chosen
so each second's charge is a whole number of µcr, which keeps the expected figures exact.
"""
import os
import secrets
import signal
import subprocess
import time

import kiln

CG_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")
MiB = 1024 * 1024
UNIT = 10**9 * 1024  # fine units per µcr (metering/price.h)

# 1 µcr per MiB-second of memory (1024 per GiB-s), 1 µcr per GiB-second of disk, CPU priced at
# 1000 µcr per CPU-second, snapshots 1024 per GiB-s: a 256 MiB, 1 GiB sandbox costs 257 µcr/s.
PRICES = {"KILN_PRICE_MEM_UCR_PER_GIB_S": "1024", "KILN_PRICE_DISK_UCR_PER_GIB_S": "1",
          "KILN_PRICE_CPU_UCR_PER_CPU_S": "1000", "KILN_PRICE_SNAPSHOT_UCR_PER_GIB_S": "1024"}


def cgroups_available():
    return os.geteuid() == 0 and all(os.path.isdir(os.path.join(CG_ROOT, c)) for c in CONTROLLERS)


class FakeVM:
    """A cgroup kiln/<node>/<sandbox> on every v1 controller with one idle process in it."""

    def __init__(self, node, sandbox, busy_loops=0):
        """`busy_loops`: spin that many shell loop turns first (to use some CPU), then idle."""
        self.dirs = [os.path.join(CG_ROOT, c, "kiln", node, sandbox) for c in CONTROLLERS]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        # The process waits on its stdin until it is in the group, so all its CPU is counted.
        script = (f"read go; i=0; while [ $i -lt {busy_loops} ]; do i=$((i+1)); done; "
                  "exec sleep 3600")
        self.proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE)
        for d in self.dirs:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(self.proc.pid))
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()

    def cpu_ns(self):
        with open(os.path.join(self.dirs[1], "cpuacct.usage")) as f:
            return int(f.read())

    def destroy(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for d in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        for d in self.dirs:  # the node's directory, when empty
            try:
                os.rmdir(os.path.dirname(d))
            except OSError:
                pass


class Meter(kiln.Daemon):
    """kiln-meter for `node` on a database and Redis, with the test prices and hooks."""

    def __init__(self, database_url, redis_url, node, master_key=None, clock_file=None,
                 hold_ms=0, extra_env=None):
        env = {"KILN_DATABASE_URL": database_url, "KILN_REDIS_URL": redis_url,
               "KILN_NODE_ID": node, "KILN_LOG_LEVEL": "debug", "KILN_METER_WINDOW_S": "2",
               "KILN_METER_PIN_ROOT": "/nonexistent-pins"}
        env.update(PRICES)
        if master_key:
            env["KILN_MASTER_KEY"] = master_key
        env.update(extra_env or {})
        args = []
        if clock_file:
            args += ["--test-clock", clock_file]
        if hold_ms:
            args += ["--test-flush-hold-ms", str(hold_ms)]
        super().__init__(os.path.join(kiln.BUILD, "metering", "kiln-meter"), env, args)

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def add_node(db, node, address="unix:/nonexistent.sock"):
    db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor,"
           f" accelerator, image_hash) VALUES ('{node}', '{address}', 16000, 16384, 32, 'qemu',"
           " 'tcg', '')")


def add_tenant(db, ucr=500_000_000):
    """A tenant with one grant of `ucr` (0: none)."""
    t = "tn_" + secrets.token_hex(8)
    db.sql(f"INSERT INTO tenants (id, name) VALUES ('{t}', 'test')")
    if ucr:
        g = "tx_" + secrets.token_hex(8)
        db.sql(f"INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:{g}', '{t}', 'grant');"
               f"INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,"
               f" amount_ucr, tenant_id, reason) VALUES ('{g}', 'signup:{t}', 'grant',"
               f" 'system:issuance', 'grant:{g}', {ucr}, '{t}', 'test')")
    return t


def add_sandbox(db, tenant, node, mem_mib=256, disk_gib=1, state="running", at="now()"):
    sb = "sb_" + secrets.token_hex(8)
    db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib,"
           " disk_gib, timeout_s, expires_at, state_changed_at) VALUES"
           f" ('{sb}', '{tenant}', '{node}', '{state}', 'python', 1000, {mem_mib}, {disk_gib}, 300,"
           f" now() + interval '1 hour', {at})")
    return sb


def ledger_used(db, tenant):
    return int(db.sql(f"SELECT coalesce(sum(amount_ucr), 0) FROM ledger_transfers"
                      f" WHERE tenant_id = '{tenant}' AND kind = 'usage'"))


def ledger_balance(db, tenant):
    return int(db.sql(f"SELECT coalesce(sum(balance_ucr), 0) FROM ledger_account_balances"
                      f" WHERE tenant_id = '{tenant}'"))


def billed(db, sb):
    """(last_t_ns, cpu_ns, remainder_fine, state) of the sandbox's billed-up-to point, or None."""
    r = db.sql(f"SELECT last_t_ns, cpu_ns, remainder_fine, state FROM meter_sandboxes"
               f" WHERE sandbox_id = '{sb}'")
    if not r:
        return None
    a, b, c, d = r.split("|")
    return int(a), int(b), int(c), d


def epoch_ns(db, expr):
    """A timestamptz expression of the database as ns since the epoch (µs precision)."""
    return int(db.sql(f"SELECT (extract(epoch FROM {expr}) * 1000000)::bigint")) * 1000


def expected_fine(mem_mib, disk_gib, run_ns, cpu_ns, paused_ns=0):
    """The exact charge in fine units with PRICES (as metering/price.c computes it)."""
    return (cpu_ns * 1000 * 1024 + mem_mib * run_ns * 1024 + disk_gib * 1024 * run_ns * 1
            + mem_mib * paused_ns * 1024)


def redis_cli(redis_url, *args):
    sock = redis_url[len("unix:"):]
    out = subprocess.run(["redis-cli", "-s", sock, *args], check=True, capture_output=True,
                         text=True)
    return out.stdout.strip()


def redis_balance(redis_url, tenant):
    """ledger - sum(live) from the balance hash, or None without a ledger half."""
    out = redis_cli(redis_url, "HGETALL", "kiln:bal:" + tenant).split("\n")
    h = dict(zip(out[0::2], out[1::2])) if out != [""] else {}
    if "ledger" not in h:
        return None
    return int(h["ledger"]) - sum(int(v) for k, v in h.items() if k.startswith("live:"))


def wait_for(pred, timeout=30, step=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()
