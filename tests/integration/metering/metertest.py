"""metertest.py - what the metering integration tests share.

Cgroups holding an idle `sleep` stand in for VMs (kiln-meter reads kiln/<node>/<sandbox> as it
does for a jailed QEMU), rows in `sandboxes` say what runs where, and a real kiln-meter bills them
against the test's own database and Redis. Prices are chosen so each second's charge is a whole
number of µcr, which keeps the expected figures exact.

Where the cgroups are comes from KILN_TEST_CGROUPS (docs/testing.md):
- `host` (the default): the real cgroups of this host under /sys/fs/cgroup, v1 (the cpu, cpuacct,
  memory and pids hierarchies) or v2 (a unified hierarchy offering cpu and memory), whichever the
  host has, as vmm/cgroup.c decides. Needs root. A host with neither is a failure, not a skip.
- `fixture-v2`, `fixture-hybrid`: a copy of tests/fixtures/cgroup/v2 or .../hybrid in a temporary
  directory that kiln-meter is pointed at (KILN_METER_CGROUP_ROOT). Each fake VM's group is a
  directory of the files the kernel would show (cpu.stat and memory.current on v2, cpuacct.usage
  and memory.usage_in_bytes on v1), written whole (a new file renamed over the old) and advanced as
  a real group's would be: a little CPU at start, then `busy_loops` worth, then none.
"""
import atexit
import datetime
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time

import kiln

CG_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids")
FIXTURES = os.path.join(kiln.ROOT, "tests", "fixtures", "cgroup")
LAYOUTS = ("host", "fixture-v2", "fixture-hybrid")
MiB = 1024 * 1024
UNIT = 10**9 * 1024  # fine units per µcr (metering/price.h)

# 1 µcr per MiB-second of memory (1024 per GiB-s), 1 µcr per GiB-second of disk, CPU priced at
# 1000 µcr per CPU-second, snapshots 1024 per GiB-s: a 256 MiB, 1 GiB sandbox costs 257 µcr/s.
PRICES = {"KILN_PRICE_MEM_UCR_PER_GIB_S": "1024", "KILN_PRICE_DISK_UCR_PER_GIB_S": "1",
          "KILN_PRICE_CPU_UCR_PER_CPU_S": "1000", "KILN_PRICE_SNAPSHOT_UCR_PER_GIB_S": "1024"}


def layout():
    """The cgroup layout these tests use (KILN_TEST_CGROUPS), checked."""
    name = os.environ.get("KILN_TEST_CGROUPS", "host")
    if name not in LAYOUTS:
        raise RuntimeError(f"KILN_TEST_CGROUPS={name!r}: expected one of {', '.join(LAYOUTS)}")
    return name


_fixture_root = None


def cgroup_root():
    """The cgroup root kiln-meter reads: None (its default, /sys/fs/cgroup) on the host, else a
    temporary copy of the fixture tree, made on first use and removed at exit."""
    global _fixture_root
    name = layout()
    if name == "host":
        return None
    if _fixture_root is None:
        top = tempfile.mkdtemp(prefix="kiln-cgroup-")
        atexit.register(shutil.rmtree, top, True)
        _fixture_root = os.path.join(top, name)
        shutil.copytree(os.path.join(FIXTURES, name[len("fixture-"):]), _fixture_root)
    return _fixture_root


def _controllers_of(path):
    try:
        with open(path) as f:
            return set(f.read().split())
    except OSError:
        return set()


def host_cgroups():
    """("v2", base) or ("v1", CG_ROOT) for this host's cgroups, chosen as vmm/cgroup.c's
    cg_detect() does; raises when neither is usable or the tests do not run as root."""
    if os.geteuid() != 0:
        raise RuntimeError("the metering integration tests make cgroups: they need root")
    for base in (CG_ROOT, os.path.join(CG_ROOT, "unified")):
        if {"cpu", "memory"} <= _controllers_of(os.path.join(base, "cgroup.controllers")):
            return "v2", base
    if all(os.path.isdir(os.path.join(CG_ROOT, c)) for c in CONTROLLERS):
        return "v1", CG_ROOT
    raise RuntimeError(f"no usable cgroups under {CG_ROOT}: neither v1 cpu, cpuacct, memory and"
                       " pids hierarchies nor a v2 hierarchy offering cpu and memory")


def check_cgroups():
    """Raises unless the cgroups of KILN_TEST_CGROUPS can be used (a test class's first step)."""
    if cgroup_root() is None:
        host_cgroups()


def _rmdir_retrying(d):
    for _ in range(50):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


class _HostVM:
    """A real cgroup kiln/<node>/<sandbox> (each v1 controller, or v2) with one idle process."""

    def __init__(self, node, sandbox, busy_loops):
        version, base = host_cgroups()
        self.v2 = version == "v2"
        if self.v2:
            self.dirs = [os.path.join(base, "kiln", node, sandbox)]
            # As cg_create() does: each parent hands cpu, memory and pids down to its children.
            for parent in (base, os.path.join(base, "kiln"), os.path.join(base, "kiln", node)):
                os.makedirs(parent, exist_ok=True)
                for c in ("+cpu", "+memory", "+pids"):
                    try:
                        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                            f.write(c)
                    except OSError:
                        pass
        else:
            self.dirs = [os.path.join(base, c, "kiln", node, sandbox) for c in CONTROLLERS]
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
        if self.v2:
            with open(os.path.join(self.dirs[0], "cpu.stat")) as f:
                stat = dict(line.split() for line in f if line.strip())
            return int(stat["usage_usec"]) * 1000
        with open(os.path.join(self.dirs[1], "cpuacct.usage")) as f:
            return int(f.read())

    def destroy(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for d in self.dirs:
            _rmdir_retrying(d)
        for d in self.dirs:  # the node's directory, when empty
            try:
                os.rmdir(os.path.dirname(d))
            except OSError:
                pass


class _FixtureVM:
    """The group kiln/<node>/<sandbox> in a fixture tree: the files the kernel would show, with
    CPU time that grows by 1 ms at start and by 2 µs per `busy_loops` turn over the next second,
    then stays; 64 MiB of memory charged. An idle process stands in for the VM (cgroup.procs)."""

    STARTUP_US = 1000
    US_PER_LOOP = 2
    MEM = 64 * MiB

    def __init__(self, root, hybrid, node, sandbox, busy_loops):
        self.hybrid = hybrid
        self.proc = subprocess.Popen(["sleep", "3600"])
        self.cpu_us = self.STARTUP_US
        self.lock = threading.Lock()
        if hybrid:  # v1: one directory per controller; kiln-meter opens a group by its cpu one
            self.dirs = {c: os.path.join(root, c, "kiln", node, sandbox)
                         for c in ("cpuacct", "memory", "pids", "cpu")}
            files = {"cpuacct": {"cpuacct.usage": self._cpu_text()},
                     "memory": {"memory.usage_in_bytes": f"{self.MEM}\n",
                                "memory.max_usage_in_bytes": f"{self.MEM}\n"},
                     "pids": {"pids.max": "max\n"},
                     "cpu": {"cpu.cfs_quota_us": "100000\n", "cpu.cfs_period_us": "100000\n"}}
        else:
            self.dirs = {"cpu": os.path.join(root, "kiln", node, sandbox)}
            files = {"cpu": {"cpu.stat": self._cpu_text(), "memory.current": f"{self.MEM}\n",
                             "memory.peak": f"{self.MEM}\n", "cpu.max": "100000 100000\n"}}
        # Each directory appears whole (made aside, then renamed into place), the cpu one last.
        for c, d in self.dirs.items():
            parent = os.path.dirname(d)
            os.makedirs(parent, exist_ok=True)
            aside = tempfile.mkdtemp(prefix=".new-", dir=parent)
            for name, text in dict(files[c], **{"cgroup.procs": f"{self.proc.pid}\n"}).items():
                with open(os.path.join(aside, name), "w") as f:
                    f.write(text)
            os.rename(aside, d)
        self.to_burn = busy_loops * self.US_PER_LOOP
        self.stopped = threading.Event()
        self.burner = threading.Thread(target=self._burn, daemon=True)
        self.burner.start()

    def _cpu_text(self):
        if self.hybrid:
            return f"{self.cpu_us * 1000}\n"
        return (f"usage_usec {self.cpu_us}\nuser_usec {self.cpu_us}\nsystem_usec 0\n"
                "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")

    def _burn(self):
        step = max(1, self.to_burn // 20)
        while self.to_burn > 0 and not self.stopped.wait(0.05):
            with self.lock:
                n = min(step, self.to_burn)
                self.cpu_us += n
                self.to_burn -= n
                name = "cpuacct.usage" if self.hybrid else "cpu.stat"
                d = self.dirs["cpuacct" if self.hybrid else "cpu"]
                with open(os.path.join(d, "." + name), "w") as f:
                    f.write(self._cpu_text())
                os.rename(os.path.join(d, "." + name), os.path.join(d, name))

    def cpu_ns(self):
        with self.lock:
            return self.cpu_us * 1000

    def destroy(self):
        self.stopped.set()
        self.burner.join()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for d in self.dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def FakeVM(node, sandbox, busy_loops=0):
    """A group kiln/<node>/<sandbox> with an idle process, in the layout of KILN_TEST_CGROUPS.
    `busy_loops`: that much CPU used first (shell loop turns), then idle. The result has cpu_ns()
    (the group's CPU time so far) and destroy()."""
    root = cgroup_root()
    if root is None:
        return _HostVM(node, sandbox, busy_loops)
    return _FixtureVM(root, layout() == "fixture-hybrid", node, sandbox, busy_loops)


class Meter(kiln.Daemon):
    """kiln-meter for `node` on a database and Redis, with the test prices and hooks."""

    def __init__(self, database_url, redis_url, node, master_key=None, clock_file=None,
                 hold_ms=0, extra_env=None):
        env = {"KILN_DATABASE_URL": database_url, "KILN_REDIS_URL": redis_url,
               "KILN_NODE_ID": node, "KILN_LOG_LEVEL": "debug", "KILN_METER_WINDOW_S": "2",
               "KILN_METER_PIN_ROOT": "/nonexistent-pins"}
        if cgroup_root():
            env["KILN_METER_CGROUP_ROOT"] = cgroup_root()
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
    """(last_t_ns, cpu_ns, remainder_fine, state) of the billed-up-to point of the sandbox's newest
    billed generation, or None."""
    r = db.sql(f"SELECT last_t_ns, cpu_ns, remainder_fine, state FROM meter_sandboxes"
               f" WHERE sandbox_id = '{sb}' ORDER BY generation DESC LIMIT 1")
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


def log_time(line):
    """The time (epoch seconds) a daemon's log line carries."""
    stamp = line.split(" ", 1)[0]
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def leave_credits(db, redis_url, tenant, sandboxes, ucr):
    """The tenant keeps `ucr` of its 500 free credits (the rest expires), its live balance is
    rebuilt from the ledger, and its running `sandboxes` are billed up to now, as if a meter had
    run all along (so a meter's first tick bills one second)."""
    grant = db.sql(f"SELECT id FROM ledger_accounts WHERE tenant_id = '{tenant}' AND kind = 'grant'")
    db.sql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account,"
           f" amount_ucr, tenant_id, reason) VALUES ('tx_test_{tenant}', 'test-expiry:{tenant}',"
           f" 'expiry', '{grant}', 'system:expired', {500_000_000 - ucr}, '{tenant}', 'test')")
    redis_cli(redis_url, "DEL", "kiln:bal:" + tenant)
    ids = ", ".join(f"'{sb}'" for sb in sandboxes)
    db.sql("INSERT INTO meter_sandboxes (sandbox_id, tenant_id, node_id, generation, state,"
           " last_t_ns, cpu_ns, rx_bytes, tx_bytes, remainder_fine) SELECT id, tenant_id,"
           " node_id, generation, 'running', (extract(epoch FROM now()) * 1e9)::bigint, 0, 0,"
           f" 0, 0 FROM sandboxes WHERE id IN ({ids})")


# Memory alone priced: a 256 MiB sandbox costs 200,000 µcr a second.
MEMORY_ONLY_PRICES = {"KILN_PRICE_MEM_UCR_PER_GIB_S": "800000", "KILN_PRICE_DISK_UCR_PER_GIB_S": "0",
                      "KILN_PRICE_CPU_UCR_PER_CPU_S": "0", "KILN_PRICE_SNAPSHOT_UCR_PER_GIB_S": "0",
                      "KILN_METER_PIN_ROOT": ""}
