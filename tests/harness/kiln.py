"""kiln.py - what the Python integration and end-to-end tests share.

The throwaway Postgres and Redis come from tests/harness/services.sh (the ctest fixture
"services"); KILN_SERVICES_ENV names the file it wrote, KILN_BUILD_DIR the build tree.
Every test makes its own database (fresh_database) and its own daemons on free ports, and
stops them by pid when it ends, so tests can run in parallel and never touch `make run`'s.
Each daemon also records itself in the run's registry (registry_dir(): KILN_TEST_DIR/daemons)
until it is stopped cleanly: when ctest kills a test at its timeout, the fixture's cleanup
(services.sh stop) reaps what that test's daemons left (tests/harness/reap.py). Every node id is
also kept in the run's list of nodes (KILN_TEST_DIR/nodes), against which that cleanup then checks
that no node of the run left anything on the host (reap.py --check).
"""
import fcntl
import glob
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import reap  # tests/harness/reap.py: the same start-time reading the reaper checks against

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("KILN_BUILD_DIR", os.path.join(ROOT, "build-test"))


def services_env():
    """The KEY=value pairs services.sh wrote, as a dict."""
    path = os.environ["KILN_SERVICES_ENV"]
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if "=" in line:
                k, v = line.split("=", 1)
                env[k] = shlex.split(v)[0] if v else ""
    return env


def _use_run_tmpdir():
    """Puts this process's temporary files (tempfile's, and through TMPDIR those of every
    program it starts) in the run's own directory, KILN_TEST_DIR/tmp, when it runs under
    services.sh's fixture: what a test leaves there is named by services.sh stop, which fails
    the run over it and removes it, instead of staying in /tmp for good."""
    try:
        run = services_env()["KILN_TEST_DIR"]
    except (KeyError, OSError):
        return
    tmp = os.path.join(run, "tmp")
    os.makedirs(tmp, exist_ok=True)
    os.chmod(tmp, 0o1777)  # as /tmp: the sandboxes' users reach what a test hands them
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp


_use_run_tmpdir()


def psql(sockdir, db, sql):
    """Runs SQL as the cluster's owner and returns stdout (tuples only, unaligned)."""
    out = subprocess.run(["psql", "-h", sockdir, "-U", "kiln", "-d", db, "-tAqc", sql],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip()


class Database:
    """A database of its own in the shared test cluster, dropped by drop()."""

    def __init__(self, sockdir):
        self.sockdir = sockdir
        self.name = "t_" + secrets.token_hex(6)
        psql(sockdir, "postgres", f"CREATE DATABASE {self.name}")
        self.url = f"host={sockdir} user=kiln dbname={self.name}"

    def sql(self, sql):
        return psql(self.sockdir, self.name, sql)

    def drop(self):
        psql(self.sockdir, "postgres", f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


def npm_modules(folder, cache=None):
    """Makes `folder`/node_modules hold the packages of its package-lock.json, installed once per
    lock (npm ci) into `cache`/<hash of the lock>/ (default /var/cache/kiln/npm); returns its path."""
    cache = cache or os.environ.get("KILN_NPM_CACHE", "/var/cache/kiln/npm")
    link = os.path.join(folder, "node_modules")
    with open(os.path.join(folder, "package-lock.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    target = os.path.join(cache, digest)
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(os.path.join(target, "node_modules")):
            tmp = tempfile.mkdtemp(prefix=digest + ".", dir=cache)
            for name in ("package.json", "package-lock.json"):
                shutil.copy(os.path.join(folder, name), tmp)
            subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                           cwd=tmp, check=True, timeout=600)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        if os.path.islink(link) and os.readlink(link) != os.path.join(target, "node_modules"):
            os.unlink(link)
        if not os.path.lexists(link):
            os.symlink(os.path.join(target, "node_modules"), link)
    return link


def fresh_database():
    return Database(services_env()["KILN_TEST_SOCKDIR"])


def own_services(case):
    """A Postgres and Redis pair of the test's own (tests/harness/services.sh), for a test that
    stops or reconfigures them, stopped at `case`'s cleanup: its env (services_env()) and a fresh
    database on it."""
    fd, envfile = tempfile.mkstemp(prefix="kiln-own-services-")
    os.close(fd)
    services = os.path.join(ROOT, "tests", "harness", "services.sh")
    subprocess.run([services, "start", envfile], check=True, capture_output=True)
    case.addCleanup(subprocess.run, [services, "stop", envfile], capture_output=True)
    saved = os.environ["KILN_SERVICES_ENV"]
    os.environ["KILN_SERVICES_ENV"] = envfile
    try:
        return services_env(), fresh_database()
    finally:
        os.environ["KILN_SERVICES_ENV"] = saved


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n):
    """`n` distinct ports free now: each socket stays bound until all are chosen (two free_port()
    calls in a row can return one port twice, and a daemon given both fails to listen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def registry_dir():
    """The run's registry of daemons: KILN_TEST_REGISTRY, else KILN_TEST_DIR/daemons of the
    services fixture; None outside a ctest run with the fixture."""
    path = os.environ.get("KILN_TEST_REGISTRY")
    if not path:
        try:
            path = os.path.join(services_env()["KILN_TEST_DIR"], "daemons")
        except (KeyError, OSError):
            return None
    os.makedirs(path, exist_ok=True)
    return path


def list_node(rec):
    """Adds a node to the run's list of nodes, KILN_TEST_DIR/nodes/<node id>.json (kept when the
    node stops: services.sh stop checks that none of them left anything on the host,
    reap.py --check). The first record of an id stays: it has the earliest start."""
    try:
        path = os.path.join(services_env()["KILN_TEST_DIR"], "nodes")
    except (KeyError, OSError):
        return
    os.makedirs(path, exist_ok=True)
    final = os.path.join(path, rec["node_id"] + ".json")
    if os.path.exists(final):
        return
    with open(final + f".{os.getpid()}.tmp", "w") as f:
        json.dump({k: rec[k] for k in ("node_id", "run_dir", "born") if rec.get(k)}, f)
    os.rename(final + f".{os.getpid()}.tmp", final)


# The earliest start of each node id in this process: a node started again with the same id
# (Stack.restart_node) adopts the VMs of the one before, and the reaper must see them as its own.
_NODE_BORN = {}


class Daemon:
    """A Kiln daemon started from the build tree with KILN_* settings; stop() ends it by pid."""

    def __init__(self, binary, env, args=(), netns=None):
        """`netns`: a Netns the daemon runs in (its network only: nsenter keeps the mounts)."""
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-log-", suffix=".log", delete=False)
        full_env = dict(os.environ)
        full_env.update(env)
        self.netns = netns
        self.proc = subprocess.Popen([*(netns.enter() if netns else []), binary, *args], env=full_env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.record = None
        self.register(binary)

    def register(self, binary):
        """Records the daemon in the run's registry (see tests/harness/reap.py)."""
        reg = registry_dir()
        started = reap.start_time(self.proc.pid)
        if not reg or started is None:
            return
        rec = {"kind": os.path.basename(binary), "pid": self.proc.pid, "start_time": started,
               "exe": os.path.realpath(binary), "log": self.log.name}
        if getattr(self, "admin_key_file", None):
            rec["admin_key_file"] = self.admin_key_file
        node_id = getattr(self, "node_id", None)
        if os.path.basename(binary) == "kiln-node" and node_id:
            born = _NODE_BORN.setdefault(node_id, started)
            rec.update(kind="node", node_id=node_id, run_dir=getattr(self, "run_dir", None),
                       data_dir=getattr(self, "data_dir", None), born=min(born, started))
            if self.netns:
                rec["netns"] = self.netns.name
            list_node(rec)
        self.record = os.path.join(reg, f"{rec['kind']}-{self.proc.pid}-{started}.json")
        with open(self.record + ".tmp", "w") as f:
            json.dump(rec, f)
        os.rename(self.record + ".tmp", self.record)

    def unregister(self):
        if self.record and os.path.exists(self.record):
            os.unlink(self.record)
        self.record = None

    def alive(self):
        return self.proc.poll() is None

    def output(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def wait_tcp(self, port, seconds=30, host="127.0.0.1"):
        """Waits until the daemon accepts on `host`:`port`; raises with its log if it ends first."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.proc.args[0]} exited:\n" + self.output())
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{self.proc.args[0]} did not listen:\n" + self.output())

    def cleanup(self):
        rc = self.stop()
        # A daemon that ended on its own terms made nothing that outlives it; one killed (a
        # crash test) may have: the reaper looks after it at the end of the run.
        if rc == 0 or not (self.record and os.path.basename(self.record).startswith("node-")):
            self.unregister()
        if os.environ.get("KILN_TEST_SHOW_LOGS"):
            sys.stderr.write(f"--- {self.proc.args[0]} ---\n{self.output()}\n")
        if os.path.exists(self.log.name):  # not when cleaned up before
            os.unlink(self.log.name)


class Gateway(Daemon):
    """kiln-gateway on a free loopback port; waits until it answers.

    Each gateway of a test shares `master_key` (pass the same one to gateways of one database);
    the first one makes the operator's admin key, readable as `admin_key`."""

    def __init__(self, database_url, redis_url, extra_env=None, master_key=None,
                 listen_host="127.0.0.1", e2b=False):
        ports = free_ports(3 if e2b else 1)
        self.port = ports[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.master_key = master_key or secrets.token_hex(32)
        self.admin_key_file = tempfile.mktemp(prefix="kiln-admin-key-")
        env = {"KILN_LISTEN": f"{listen_host}:{self.port}", "KILN_DATABASE_URL": database_url,
               "KILN_REDIS_URL": redis_url, "KILN_LOG_LEVEL": "debug",
               "KILN_MASTER_KEY": self.master_key, "KILN_ADMIN_KEY_FILE": self.admin_key_file,
               "KILN_E2B_LISTEN": "",  # off unless asked for (e2b_port): its default is fixed
               "KILN_E2B_SANDBOX_LISTEN": "",
               # the port URL listener on a port of the kernel's choice (the API tells its URLs)
               "KILN_PORTS_LISTEN": f"{listen_host}:0"}
        self.e2b_port = None
        if e2b:
            self.e2b_port = ports[1]
            env["KILN_E2B_LISTEN"] = f"{listen_host}:{self.e2b_port}"
            self.e2b_url = f"http://127.0.0.1:{self.e2b_port}"
            self.e2b_sandbox_port = ports[2]
            env["KILN_E2B_SANDBOX_LISTEN"] = f"{listen_host}:{self.e2b_sandbox_port}"
            self.e2b_sandbox_url = f"http://127.0.0.1:{self.e2b_sandbox_port}"
        env.update(extra_env or {})
        super().__init__(os.path.join(BUILD, "api", "kiln-gateway"), env)
        try:
            if self.e2b_port:
                self.wait_tcp(self.e2b_port)
                self.wait_tcp(self.e2b_sandbox_port)
            self.wait_tcp(self.port)
        except BaseException:
            self.cleanup()  # its process, log and admin key file: the caller never gets it
            raise

    @property
    def admin_key(self):
        """The operator's admin key this gateway made (None when another gateway made it)."""
        try:
            with open(self.admin_key_file) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def cleanup(self):
        super().cleanup()
        if os.path.exists(self.admin_key_file):
            os.unlink(self.admin_key_file)

    def request(self, method, path, body=None, headers=None, raw=False, timeout=60):
        return http(method, self.url + path, body, headers, raw, timeout)


class Response:
    def __init__(self, status, headers, data):
        self.status = status
        self.headers = headers
        self.data = data

    def json(self):
        return json.loads(self.data)

    def __repr__(self):
        return f"<{self.status} {self.data[:300]!r}>"


def http(method, url, body=None, headers=None, raw=False, timeout=60):
    """One HTTP request; a dict/list body is sent as JSON, bytes as they are."""
    data = None
    hdrs = dict(headers or {})
    if isinstance(body, (dict, list)):
        data = json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    elif isinstance(body, (bytes, str)):
        data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Response(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.headers, e.read())


def vm_pids(node_id, sandbox_id):
    """Host pids in the sandbox's cgroup (its jailed QEMU)."""
    pids = set()
    for f in glob.glob(f"/sys/fs/cgroup/*/kiln/{node_id}/{sandbox_id}/cgroup.procs"):
        with open(f) as fh:
            pids.update(int(p) for p in fh.read().split())
    return pids


def tree_bytes(path):
    """Bytes of the regular files under `path` (sockets and the like count nothing)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


_IMAGE = None


def guest_image():
    """The guest image's KEY=value settings (vmm/guest/build-image.sh --print-env), built once."""
    global _IMAGE
    if _IMAGE is None:
        r = subprocess.run(["bash", os.path.join(ROOT, "vmm", "guest", "build-image.sh"),
                            "--print-env"], capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError("vmm/guest/build-image.sh --print-env exited %d:\n%s"
                               % (r.returncode, r.stderr[-6000:]))
        out = r.stdout
        _IMAGE = {}
        for line in out.splitlines():
            if "=" in line:
                k, v = line.split("=", 1)
                _IMAGE[k] = shlex.split(v)[0] if v else ""
    return _IMAGE


# The hostagent hook's "guest": the agent binary itself stands in for the image's files, which
# the node checks exist but its driver never opens.
HOSTAGENT = os.path.join(BUILD, "vmm", "guest", "kiln-agent")
HOSTAGENT_IMAGE = {"KILN_GUEST_KERNEL": HOSTAGENT, "KILN_GUEST_INITRD": HOSTAGENT,
                   "KILN_GUEST_ROOTFS": HOSTAGENT, "KILN_GUEST_IMAGE_HASH": "hostagent"}


def image_copy(suffix):
    """Another guest image for an upgrade test: the test image's kernel, initramfs and root file
    system under a new directory beside the image cache (hard links where they can be) and the
    hash `<its hash>-<suffix>`. Returns (the directory, which the caller removes; the node
    settings that name it)."""
    img = guest_image()
    d = tempfile.mkdtemp(prefix=f"test-image-{suffix}-",
                         dir=os.path.dirname(os.path.dirname(img["KILN_GUEST_ROOTFS"])))
    os.chmod(d, 0o755)
    env = {"KILN_GUEST_IMAGE_HASH": img["KILN_GUEST_IMAGE_HASH"] + "-" + suffix}
    for key in ("KILN_GUEST_KERNEL", "KILN_GUEST_INITRD", "KILN_GUEST_ROOTFS"):
        env[key] = os.path.join(d, os.path.basename(img[key]))
        try:
            os.link(img[key], env[key])
        except OSError:
            shutil.copyfile(img[key], env[key])
    return d, env


def vm_files(node, sandbox_id):
    """The kernel and disk base a sandbox's VM runs on (its VM record, vmm/qemu.c)."""
    with open(os.path.join(node.data_dir, "vms", node.node_id, sandbox_id, "vm.json")) as f:
        rec = json.load(f)
    return rec["kernel"], rec["chain"][0]


class Node(Daemon):
    """kiln-node with a unique id, its own run and data directories; stop() tears its VMs down."""

    def __init__(self, database_url, gateway_url, extra_env=None, node_id=None, data_dir=None,
                 tcp_address=None, hostagent=False, netns=None):
        """`tcp_address`: serve the node's API on TCP on every address, gateways reaching it at
        that host (as a node on a private network), instead of on its Unix socket.
        `netns`: a Netns the node runs in, as on a host of its own: it serves on TCP at the
        namespace's address (tcp_address), its sandboxes' networks and nftables table inside it.
        `hostagent`: the node's bench and test hook (hypervisor "hostagent", docs/vmm.md): each
        sandbox's guest is the build's kiln-agent run on the host, no VM and no guest image."""
        img = HOSTAGENT_IMAGE if hostagent else guest_image()
        self.node_id = node_id or "t" + secrets.token_hex(4)
        self.run_dir = f"/run/kt-{self.node_id}"
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kiln-node-")
        os.chmod(self.data_dir, 0o755)
        env = {"KILN_NODE_ID": self.node_id, "KILN_RUN_DIR": self.run_dir,
               "KILN_DATA_DIR": self.data_dir, "KILN_DATABASE_URL": database_url,
               "KILN_GATEWAY_URL": gateway_url, "KILN_LOG_LEVEL": "debug",
               "KILN_GUEST_KERNEL": img["KILN_GUEST_KERNEL"],
               "KILN_GUEST_INITRD": img["KILN_GUEST_INITRD"],
               "KILN_GUEST_ROOTFS": img["KILN_GUEST_ROOTFS"],
               "KILN_GUEST_CODEINT_ROOTFS": img.get("KILN_GUEST_CODEINT_ROOTFS", ""),
               "KILN_GUEST_IMAGE_HASH": img["KILN_GUEST_IMAGE_HASH"],
               "KILN_GUEST_CMDLINE": "root=/dev/vda rootfstype=ext4 rw",
               # Templates cost a VM boot of their own: tests that want them say so.
               "KILN_TEMPLATES": "false", "KILN_TEMPLATE_DEFAULT": "false"}
        if netns:
            tcp_address = netns.addr
        if tcp_address:
            self.port = free_port()
            env.update({"KILN_NODE_LISTEN": f"0.0.0.0:{self.port}",
                        "KILN_NODE_ADDRESS": f"http://{tcp_address}:{self.port}"})
        if hostagent:
            env.update({"KILN_HYPERVISOR": "hostagent", "KILN_HYPERVISOR_BINARY": HOSTAGENT})
        env.update(extra_env or {})
        self.log_level = env["KILN_LOG_LEVEL"]
        super().__init__(os.path.join(BUILD, "node", "kiln-node"), env, netns=netns)
        try:
            self.wait_started(tcp_address, netns)
        except BaseException:
            # the caller never gets it: its process and what it made go now (its data directory
            # only when this made it)
            self.cleanup(keep_data=data_dir is not None)
            raise

    def wait_started(self, tcp_address, netns):
        """Until the node serves on TCP (`tcp_address`) or on its Unix socket."""
        if tcp_address:
            self.sock = None
            self.wait_tcp(self.port, 60, host=netns.addr if netns else "127.0.0.1")
            self.wait_serving()
            return
        self.sock = os.path.join(self.run_dir, "node.sock")
        deadline = time.time() + 30
        while time.time() < deadline:
            if not self.alive():
                raise RuntimeError("kiln-node exited:\n" + self.output())
            if os.path.exists(self.sock):
                self.wait_serving()
                return
            time.sleep(0.05)
        raise RuntimeError("kiln-node did not listen:\n" + self.output())

    def wait_serving(self):
        """Until the node logs that it serves: its first heartbeat is in (node/main.c), so it
        is placed on (a restart after a clean stop clears the stop's mark with it). Not with a
        log level that hides the line (warn, error)."""
        if self.log_level not in ("debug", "info"):
            return
        deadline = time.time() + 30
        while "serving at" not in self.output():
            if not self.alive() or time.time() > deadline:
                raise RuntimeError("kiln-node did not start serving:\n" + self.output())
            time.sleep(0.05)

    def cleanup(self, keep_data=False):
        """Stops the node; its data directory (and its pins of guest images) stay when
        `keep_data` (a restart follows). A node that did not stop cleanly (killed by its test, or
        at the end of stop()'s wait) and is not started again is reaped here (reap.py), not at
        the end of the run: its VMs would run on until then, holding their uid leases, run
        directories, networks and cgroups."""
        if self.stop() != 0 and not keep_data:
            self.reap()
        super().cleanup()
        subprocess.run(["rm", "-rf", self.run_dir] + ([] if keep_data else [self.data_dir]))
        if not keep_data:
            reap.remove_pins(self.node_id)


    def reap(self):
        """Removes what this stopped node left, as the reaper would, and drops its record (kept
        when something could not be removed: the end of the run tries again). Its namespace
        (kiln.Netns) is its test's."""
        if not self.record or not os.path.exists(self.record):
            return
        with open(self.record) as f:
            rec = json.load(f)
        rec.pop("netns", None)
        log, problems = [], []
        reap.reap_node(rec, log, problems)
        sys.stderr.write(f"kiln-node {self.node_id} ended with {self.proc.returncode}: reaped\n" +
                         "".join(f"  {line}\n" for line in log + problems))
        if not problems:
            self.unregister()


class Netns:
    """A network namespace standing for a host of its own: `kn<hex>`, wired to this one by a veth
    pair on a /30 of 172.31.0.0/16 (`addr` inside, `host_addr` on this side, the namespace's
    default route), loopback up. Daemons started in it (Daemon's `netns`) reach every address of
    this host (Postgres and Redis over their Unix sockets, a server listening on `host_addr`), and
    this host reaches them at `addr`. remove() deletes it with everything in it (its veth, its
    sandboxes' veths and a node's nftables table); the reaper does too (the node's record)."""

    def __init__(self):
        self.name = "kn" + secrets.token_hex(4)
        self.link = "kh" + self.name[2:]
        base = secrets.randbelow(1 << 14) * 4  # a random /30 of 172.31.0.0/16
        self.host_addr = f"172.31.{base >> 8}.{(base & 255) + 1}"
        self.addr = f"172.31.{base >> 8}.{(base & 255) + 2}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        try:
            for cmd in (["link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.name],
                        ["addr", "add", self.host_addr + "/30", "dev", self.link],
                        ["link", "set", self.link, "up"],
                        ["-n", self.name, "link", "set", "lo", "up"],
                        ["-n", self.name, "addr", "add", self.addr + "/30", "dev", "eth0"],
                        ["-n", self.name, "link", "set", "eth0", "up"],
                        ["-n", self.name, "route", "add", "default", "via", self.host_addr]):
                subprocess.run(["ip", *cmd], check=True, capture_output=True)
        except Exception:
            self.remove()
            raise

    def enter(self):
        """The command prefix that runs a program in it. nsenter, not `ip netns exec`, which mounts
        a /sys of its own, hiding the cgroups and BPF pins a node and a meter use."""
        return ["nsenter", "--net=/run/netns/" + self.name]

    def remove(self):
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)


class Meter(Daemon):
    """kiln-meter for `node_id` (each node's host runs one), in the node's Netns when given."""

    def __init__(self, database_url, redis_url, node_id, extra_env=None, netns=None):
        env = {"KILN_DATABASE_URL": database_url, "KILN_REDIS_URL": redis_url,
               "KILN_NODE_ID": node_id, "KILN_LOG_LEVEL": "info"}
        env.update(extra_env or {})
        self.node_id = node_id
        super().__init__(os.path.join(BUILD, "metering", "kiln-meter"), env, netns=netns)


class Haproxy:
    """HAProxy (Debian's package) balancing TCP connections over gateways at `ports` on
    127.0.0.1, each sent a PROXY v2 header (the gateways trust 127.0.0.1: http_trusted_proxies),
    health-checked every 300 ms; it listens at `host`:`port` (`url`). Stopped by its pid."""

    def __init__(self, ports, host="127.0.0.1"):
        self.port = free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.cfg = tempfile.NamedTemporaryFile("w", prefix="kiln-haproxy-", suffix=".cfg", delete=False)
        servers = "".join(f"    server g{i} 127.0.0.1:{p} send-proxy-v2 check inter 300 fall 1 rise 2\n"
                          for i, p in enumerate(ports))
        self.cfg.write(
            "global\n    maxconn 256\n"
            "defaults\n    mode tcp\n    timeout connect 2s\n    timeout client 600s\n"
            "    timeout server 600s\n    retries 2\n    option redispatch\n"
            f"frontend api\n    bind {host}:{self.port}\n    default_backend gateways\n"
            "backend gateways\n    balance roundrobin\n" + servers)
        self.cfg.close()
        self.proc = subprocess.Popen(["haproxy", "-db", "-f", self.cfg.name],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def request(self, method, path, body=None, headers=None, raw=False, timeout=60):
        return http(method, self.url + path, body, headers, raw, timeout)

    def wait_serving(self, up=None, seconds=20):
        """Until a request through it is answered 200 and every server is up in its checks
        (`up`: a function that makes one such request and says whether it passed)."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("haproxy exited:\n" + self.proc.stdout.read().decode(errors="replace"))
            try:
                if up():
                    time.sleep(1)  # the other servers' checks: rise 2 of inter 300 ms
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("haproxy does not pass requests on")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.environ.get("KILN_TEST_SHOW_LOGS"):
            print(self.proc.stdout.read().decode(errors="replace"))
        self.proc.stdout.close()
        os.unlink(self.cfg.name)


class Stack:
    """A gateway and a node on a database of their own, an admin key and a tenant's key."""

    def __init__(self, node_env=None, gateway_env=None, e2b=False, hostagent=False):
        env = services_env()
        self.db = fresh_database()
        self.gw = None
        try:
            self.gw = Gateway(self.db.url, env["KILN_REDIS_URL"], gateway_env, e2b=e2b)
            self.node = self.add_node(node_env, hostagent=hostagent)
        except Exception:
            if self.gw:
                self.gw.cleanup()
            self.db.drop()
            raise
        self.admin = {"Authorization": "Bearer " + self.gw.admin_key}

    def add_node(self, extra_env=None, node_id=None, data_dir=None, hostagent=False):
        """Another kiln-node of this stack (same database, gateway and master key)."""
        env = {"KILN_MASTER_KEY": self.gw.master_key}
        env.update(extra_env or {})
        return Node(self.db.url, self.gw.url, env, node_id=node_id, data_dir=data_dir,
                    hostagent=hostagent)

    def restart_node(self, extra_env=None):
        """The same node (id and data) started again, as after a crash or an upgrade."""
        old = self.node
        old.cleanup(keep_data=True)
        self.node = self.add_node(extra_env, node_id=old.node_id, data_dir=old.data_dir)
        return self.node

    def tenant(self, name="acme"):
        """A new tenant's API key header."""
        r = self.gw.request("POST", "/v1/tenants", {"name": name}, self.admin)
        assert r.status == 201, r
        return {"Authorization": "Bearer " + r.json()["api_key"]["key"]}

    def cleanup(self):
        self.node.cleanup()
        self.gw.cleanup()
        self.db.drop()
