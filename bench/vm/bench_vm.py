"""bench_vm.py - sandbox create-to-first-exec latency, the VMM's memory per VM, and host density.

Run by bench/vm/vm.sh (which starts the throwaway Postgres and Redis and sets KILN_BUILD_DIR and
KILN_SERVICES_ENV). Everything goes through a real kiln-gateway and kiln-node (tests/harness/kiln.py
Stack) with jailed QEMU microVMs. The baseline is the same guest image booted by a bare
qemu-system-x86_64 without Kiln (no jail, no cgroup, no network namespace, no API, no database),
with the same accelerator and kernel command line as Kiln's VMs (read from their QEMU's cmdline),
timed until its agent answers a HELLO and takes the identity kiln-node gives every new guest
(SET_IDENTITY: host name, clock, entropy), then running the same first command.

usage: bench_vm.py [RUNS] [IDLE_VMS] [BARE_RUNS]
"""
import ctypes
import glob
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "harness"))
import kiln  # noqa: E402

MEM_MIB = 256
HOST_GIB = 24
HOST_RESERVE_MIB = 2048  # the host's kernel, its own services, Postgres/Redis clients, Kiln's daemons
FIRST_EXEC = {"cmd": ["python3", "-c", "print(1)"]}
IDLE_SETTLE_S = 10
MIB = 1 << 20


def on_term(sig, frame):
    raise SystemExit(128 + sig)


# ---- the agent protocol (docs/agent-protocol.md), just HELLO and EXEC, for the bare baseline ----

AGENT_MAGIC, AGENT_VERSION = 0x4B4C4E41, 1
T_HELLO, T_EXEC, T_SET_IDENTITY, T_HELLO_OK, T_OK, T_ERROR, T_STDOUT, T_STDERR, T_EXIT = (0x01, 0x02, 0x05, 0x81, 0x82, 0x83,
                                                                     0x84, 0x85, 0x86)


def _text(s):
    b = s.encode()
    return struct.pack(">I", len(b)) + b


class BareAgent:
    def __init__(self, path, timeout):
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.s.connect(path)
                break
            except OSError:
                self.s.close()
                if time.monotonic() > deadline:
                    raise RuntimeError("the bare VM's agent socket never listened")
                time.sleep(0.01)
        self.next_id = 1

    def _send(self, typ, flags, payload):
        rid = self.next_id
        self.next_id += 1
        self.s.sendall(struct.pack(">IBBHII", AGENT_MAGIC, AGENT_VERSION, typ, flags, rid, len(payload))
                       + payload)
        return rid

    def _read(self, n):
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            if not chunk:
                raise RuntimeError("the bare VM's agent closed the channel")
            buf += chunk
        return buf

    def _frame(self):
        magic, ver, typ, _flags, rid, length = struct.unpack(">IBBHII", self._read(16))
        if magic != AGENT_MAGIC or ver != AGENT_VERSION or length > (1 << 20):
            raise RuntimeError("bad frame from the bare VM's agent")
        return typ, rid, self._read(length)

    def hello(self, timeout):
        self.s.settimeout(timeout)
        rid = self._send(T_HELLO, 1, struct.pack(">H", AGENT_VERSION))
        typ, got, payload = self._frame()
        if typ != T_HELLO_OK or got != rid:
            raise RuntimeError(f"unexpected answer {typ:#x} to HELLO")
        off = 2
        for _ in range(3):  # kernel release, boot id, agent version
            (n,) = struct.unpack_from(">I", payload, off)
            off += 4 + n
        (uptime_ms,) = struct.unpack_from(">Q", payload, off)
        return uptime_ms

    def set_identity(self, name, timeout):
        """What kiln-node sends after every boot: host name, sandbox id, clock and 64 bytes of
        entropy (which spares the guest's first getrandom() its wait for the kernel's RNG)."""
        self.s.settimeout(timeout)
        payload = (_text(name) + _text(name) + struct.pack(">Q", time.time_ns())
                   + struct.pack(">I", 64) + os.urandom(64) + struct.pack(">I", 0))
        rid = self._send(T_SET_IDENTITY, 0, payload)
        typ, got, _ = self._frame()
        if typ != T_OK or got != rid:
            raise RuntimeError(f"unexpected answer {typ:#x} to SET_IDENTITY")

    def exec(self, argv, timeout):
        self.s.settimeout(timeout)
        payload = (struct.pack(">I", int(timeout * 1000)) + _text("") + struct.pack(">I", len(argv))
                   + b"".join(_text(a) for a in argv) + struct.pack(">I", 0) + struct.pack(">I", 0))
        rid = self._send(T_EXEC, 0, payload)
        out = b""
        while True:
            typ, got, data = self._frame()
            if got != rid:
                continue
            if typ == T_STDOUT:
                out += data
            elif typ == T_EXIT:
                return struct.unpack_from(">I", data, 0)[0], out.decode(errors="replace")
            elif typ == T_ERROR:
                raise RuntimeError("the bare VM's agent refused the exec")

    def close(self):
        self.s.close()


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class BareVM:
    """The guest image under a bare QEMU: same machine, accelerator, kernel command line, memory
    backend (a share=on file in /dev/shm) and agent channel as Kiln's VMs; the root disk is a
    throwaway copy-on-write view (snapshot=on); a restricted user-mode NIC stands in for the TAP."""

    def __init__(self, image, accel, append):
        self.dir = tempfile.mkdtemp(prefix="kiln-bench-vm-")
        self.mem = f"/dev/shm/kilnbench-{os.getpid()}-{os.path.basename(self.dir)}.mem"
        self.sock = os.path.join(self.dir, "agent.sock")
        argv = ["qemu-system-x86_64", "-M", "microvm,memory-backend=mem", "-accel", accel]
        if accel.startswith("kvm"):
            argv += ["-cpu", "host"]
        argv += ["-smp", "1", "-m", f"{MEM_MIB}M", "-object",
                 f"memory-backend-file,id=mem,size={MEM_MIB}M,mem-path={self.mem},share=on",
                 "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
                 "-chardev", f"file,id=serial,path={self.dir}/serial.log,append=on",
                 "-serial", "chardev:serial", "-kernel", image["KILN_GUEST_KERNEL"],
                 "-initrd", image["KILN_GUEST_INITRD"], "-append", append,
                 "-device", "virtio-serial-device",
                 "-chardev", f"socket,id=agent,path={self.sock},server=on,wait=off",
                 "-device", "virtserialport,chardev=agent,name=kiln.agent",
                 "-drive", f"id=root,file={image['KILN_GUEST_ROOTFS']},format=raw,if=none,snapshot=on",
                 "-device", "virtio-blk-device,drive=root",
                 "-netdev", "user,id=n0,restrict=on", "-device", "virtio-net-device,netdev=n0"]
        self.agent = None
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, env=dict(os.environ, TMPDIR=self.dir),
                                     stdout=subprocess.DEVNULL, stderr=open(f"{self.dir}/qemu.log", "w"),
                                     preexec_fn=_die_with_parent)

    def boot(self, timeout=180):
        """Boots as kiln-node does (HELLO, then SET_IDENTITY); returns the seconds since start
        until HELLO answered and until the identity was set, and the guest's uptime at HELLO."""
        self.agent = BareAgent(self.sock, 30)
        uptime_ms = self.agent.hello(timeout)
        t_hello = time.monotonic() - self.started
        self.agent.set_identity("bare-" + os.path.basename(self.dir)[-8:].replace("_", "-"), 30)
        return t_hello, time.monotonic() - self.started, uptime_ms / 1000

    def destroy(self):
        if self.agent:
            self.agent.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        if os.path.exists(self.mem):
            os.unlink(self.mem)


# ---- templates ----

def wait_template(stack, timeout=900):
    """Waits for the node of `stack` to build its template and take it into use: (its id, seconds
    from now until its snapshots row appeared, seconds until the node said it is ready). The row
    is written before the build's VM is torn down and the template marked ready in the node: a
    create in that window still cold-boots, so the node's own word is the end of the wait.
    RuntimeError when no template appears within `timeout` seconds."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    node_id = stack.node.node_id
    template = None
    while time.monotonic() < deadline and not template:
        template = stack.db.sql("SELECT id FROM snapshots WHERE kind = 'template' AND deleted_at IS NULL "
                                f"AND node_id = '{node_id}'")
        if not template:
            time.sleep(0.5)
    if not template:
        raise RuntimeError("no template was built")
    t_row = time.monotonic() - t0
    while time.monotonic() < deadline and f'template "{template}"' not in stack.node.output():
        time.sleep(0.1)
    return template, t_row, time.monotonic() - t0


# ---- memory of one VMM process ----

def warm_vm_pids(node_id):
    """{id: pids} of the node's QEMUs started ahead that wait now (node/warm.c): their cgroups
    kiln/<node>/0… (a taken one's is renamed to its sandbox's)."""
    out = {}
    for f in glob.glob(f"/sys/fs/cgroup/*/kiln/{node_id}/0*/cgroup.procs") + \
            glob.glob(f"/sys/fs/cgroup/kiln/{node_id}/0*/cgroup.procs"):
        with open(f) as fh:
            pids = [int(p) for p in fh.read().split()]
        if pids:
            out.setdefault(os.path.basename(os.path.dirname(f)), set()).update(pids)
    return {w: sorted(p) for w, p in out.items()}


def vm_pids(node_id, sandbox_id):
    pids = set()
    for f in glob.glob(f"/sys/fs/cgroup/*/kiln/{node_id}/{sandbox_id}/cgroup.procs") + \
            glob.glob(f"/sys/fs/cgroup/kiln/{node_id}/{sandbox_id}/cgroup.procs"):
        with open(f) as fh:
            pids.update(int(p) for p in fh.read().split())
    return sorted(pids)


def cgroup_charge(node_id, sandbox_id):
    """Bytes the sandbox's memory cgroup is charged (v1 usage_in_bytes, v2 memory.current)."""
    for f in (f"/sys/fs/cgroup/memory/kiln/{node_id}/{sandbox_id}/memory.usage_in_bytes",
              f"/sys/fs/cgroup/kiln/{node_id}/{sandbox_id}/memory.current"):
        if os.path.exists(f):
            with open(f) as fh:
                return int(fh.read())
    return None


def smaps_rollup(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def scan_smaps(pid, st):
    """Rss and Pss (bytes) of the mappings of the file with stat `st` in the process, and the Rss
    of its executable anonymous mappings (TCG's translation cache; none under KVM)."""
    rss = pss = code = 0
    cur = None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                if parts[4] == str(st.st_ino) and parts[3] == dev:
                    cur = "guest"
                elif parts[4] == "0" and "x" in parts[1] and len(parts) == 5:
                    cur = "code"
                else:
                    cur = None
            elif cur == "guest" and parts[0] == "Rss:":
                rss += int(parts[1]) * 1024
            elif cur == "guest" and parts[0] == "Pss:":
                pss += int(parts[1]) * 1024
            elif cur == "code" and parts[0] == "Rss:":
                code += int(parts[1]) * 1024
    return rss, pss, code


PROT_READ, MAP_SHARED = 1, 1
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident_bytes(path):
    """Bytes of the file resident in memory (mincore over a read-only shared mapping of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        page = os.sysconf("SC_PAGE_SIZE")
        addr = _libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap " + path)
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore " + path)
            return sum(b & 1 for b in vec.raw) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def measure_vmm(pids, mem_path):
    """Memory of the VMM process(es) of one VM, in bytes."""
    st = os.stat(mem_path)
    m = {"rss": 0, "anon": 0, "pss": 0, "guest_rss": 0, "guest_pss": 0, "tcg": 0}
    for pid in pids:
        r = smaps_rollup(pid)
        g_rss, g_pss, code = scan_smaps(pid, st)
        m["tcg"] += code
        m["pte"] = m.get("pte", 0) + status_kib(pid, "VmPTE")
        m["rss"] += r["Rss"]
        m["anon"] += r["Anonymous"]
        m["pss"] += r["Pss"]
        m["guest_rss"] += g_rss
        m["guest_pss"] += g_pss
    m["file_shmem"] = m["rss"] - m["anon"]
    m["guest_resident"] = resident_bytes(mem_path)
    m["overhead"] = m["rss"] - m["guest_rss"]
    m["overhead_pss"] = m["pss"] - m["guest_pss"]
    return m


def fmt_mib(b):
    return "-" if b is None else f"{b / MIB:.1f}"


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def started_boottime(pid):
    """When the process was forked, in seconds of CLOCK_BOOTTIME (10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def qemu_cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().rstrip(b"\0").split(b"\0")
    return [a.decode() for a in argv]


def arg_after(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    idle_vms = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    bare_runs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    t_start = time.monotonic()
    load0 = os.getloadavg()
    image = kiln.guest_image()
    quiet = {"KILN_LOG_LEVEL": "info"}
    stack = kiln.Stack(node_env=quiet, gateway_env=quiet)
    bare = []
    live = []  # sandbox ids to delete on the way out
    key = None
    ok = False
    try:
        gw, node = stack.gw, stack.node
        key = stack.tenant("bench")
        accel = None
        for _ in range(100):
            accel = stack.db.sql(f"SELECT accelerator FROM nodes WHERE id = '{node.node_id}'")
            if accel:
                break
            time.sleep(0.1)
        accel = accel or "tcg (assumed: no nodes row)"

        def create():
            r = gw.request("POST", "/v1/sandboxes", {"memory_mib": MEM_MIB, "vcpus": 1}, key, timeout=300)
            if r.status != 201:
                raise RuntimeError(f"create: {r}")
            sb = r.json()
            live.append(sb["id"])
            return sb

        def first_exec(sid):
            r = gw.request("POST", f"/v1/sandboxes/{sid}/exec", FIRST_EXEC, key, timeout=300)
            if r.status != 200 or r.json().get("stdout") != "1\n" or r.json().get("exit_code") != 0:
                raise RuntimeError(f"first exec in {sid}: {r}")

        def delete(sid):
            r = gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=120)
            if r.status != 204:
                raise RuntimeError(f"delete {sid}: {r}")
            live.remove(sid)

        # 1. create-to-first-exec, one sandbox after another, with bare boots interleaved so both
        #    see the same load on the shared machine.
        kiln_rows, bare_rows = [], []
        bare_accel = bare_append = None
        bare_every = max(1, runs // bare_runs) if bare_runs else 0
        print(f"create-to-first-exec: {runs} sandboxes of {MEM_MIB} MiB, 1 vCPU, one after another; "
              f"{bare_runs} bare boots interleaved", flush=True)
        for i in range(runs):
            t0 = time.monotonic()
            t0_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
            sb = create()
            t1 = time.monotonic()
            pids = vm_pids(node.node_id, sb["id"])
            if not pids:
                raise RuntimeError(f"no VMM process in the cgroup of {sb['id']}")
            pre = min(started_boottime(p) for p in pids) - t0_boot
            first_exec(sb["id"])
            t2 = time.monotonic()
            if bare_accel is None:
                argv = qemu_cmdline(pids[0])
                bare_accel, bare_append = arg_after(argv, "-accel"), arg_after(argv, "-append")
            delete(sb["id"])
            t3 = time.monotonic()
            kiln_rows.append((t1 - t0, t2 - t1, t2 - t0, t3 - t2, pre, t1 - t0 - pre))
            print(f"  kiln {i + 1:2d}: create {t1 - t0:6.2f} s (VMM forked after {pre:4.2f} s)  "
                  f"first exec {t2 - t1:5.2f} s  delete {t3 - t2:5.2f} s", flush=True)
            if bare_every and len(bare_rows) < bare_runs and (i + 1) % bare_every == 0:
                vm = BareVM(image, bare_accel, bare_append)
                bare.append(vm)
                t_hello, t_ready, uptime = vm.boot()
                b1 = time.monotonic()
                code, out = vm.agent.exec(["python3", "-c", "print(1)"], 120)
                b2 = time.monotonic()
                if code != 0 or out != "1\n":
                    raise RuntimeError(f"bare VM: python3 gave {code} {out!r}")
                vm.destroy()
                bare.remove(vm)
                bare_rows.append((t_ready, b2 - b1, t_ready + (b2 - b1), uptime, t_hello))
                print(f"  bare {len(bare_rows):2d}: boot to HELLO {t_hello:5.2f} s (guest uptime "
                      f"{uptime:5.2f} s), identity set {t_ready:5.2f} s  first exec {b2 - b1:5.2f} s",
                      flush=True)

        # 2. memory of idle, python-ready VMs (and one bare VM beside them, measured at the same time)
        print(f"\nmemory: {idle_vms} idle sandboxes of {MEM_MIB} MiB, each after one python3 run, "
              f"+ 1 bare VM; measured after {IDLE_SETTLE_S} s idle", flush=True)
        node_rss0 = status_kib(node.proc.pid, "VmRSS")
        sbs = []
        for _ in range(idle_vms):
            sb = create()
            first_exec(sb["id"])
            sbs.append(sb)
        vm = BareVM(image, bare_accel, bare_append)
        bare.append(vm)
        vm.boot()
        code, out = vm.agent.exec(["python3", "-c", "print(1)"], 120)
        if code != 0:
            raise RuntimeError("bare VM: python3 failed")
        time.sleep(IDLE_SETTLE_S)
        mem_rows = []
        for sb in sbs:
            pids = vm_pids(node.node_id, sb["id"])
            if not pids:
                raise RuntimeError(f"no VMM process in the cgroup of {sb['id']}")
            m = measure_vmm(pids, f"/dev/shm/kiln-{node.node_id}-{sb['id']}.mem")
            m["cgroup"] = cgroup_charge(node.node_id, sb["id"])
            m["name"] = sb["id"][:14]
            m["npids"] = len(pids)
            mem_rows.append(m)
        node_rss1 = status_kib(node.proc.pid, "VmRSS")
        r = gw.request("POST", f"/v1/sandboxes/{sbs[0]['id']}/exec",
                       {"cmd": ["grep", "-E", "^(MemTotal|MemFree):", "/proc/meminfo"]}, key, timeout=120)
        guest_meminfo = {ln.split()[0].rstrip(":"): int(ln.split()[1]) * 1024
                         for ln in r.json().get("stdout", "").splitlines()} if r.status == 200 else {}
        bm = measure_vmm([vm.proc.pid], vm.mem)
        bm["cgroup"] = None
        bm["name"] = "bare QEMU"
        bm["npids"] = 1

        # ---- figures ----
        print()
        print(f"accelerator (nodes.accelerator): {accel}; QEMU -accel {bare_accel}")
        print(f"host: {os.cpu_count()} CPUs, load average (1/5/15 min) "
              f"{' '.join(f'{x:.2f}' for x in load0)} at the start, "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
        print()
        print(f"| create-to-first-exec, {runs} runs | median s | min s | max s |")
        print("|---|---|---|---|")
        for label, idx in (("create (POST /v1/sandboxes → 201)", 0),
                           ("  of which Kiln before the VMM process exists (API, Postgres, uid lease, "
                            "netns + TAP, disk layer, cgroup, jail)", 4),
                           ("  of which VMM fork to 201 (boot, HELLO, SET_IDENTITY, reply)", 5),
                           ("first exec (`python3 -c 'print(1)'` → 200)", 1),
                           ("**create + first exec**", 2), ("delete (→ 204)", 3)):
            med, lo, hi = stats([r[idx] for r in kiln_rows])
            print(f"| {label} | {med:.2f} | {lo:.2f} | {hi:.2f} |")
        if bare_rows:
            print(f"| bare QEMU, {len(bare_rows)} boots (baseline): start to agent HELLO | "
                  + " | ".join(f"{x:.2f}" for x in stats([r[4] for r in bare_rows])) + " |")
            print("| bare QEMU: guest uptime at HELLO (kernel + init + agent) | "
                  + " | ".join(f"{x:.2f}" for x in stats([r[3] for r in bare_rows])) + " |")
            print("| bare QEMU: start to HELLO + SET_IDENTITY (what a create waits for) | "
                  + " | ".join(f"{x:.2f}" for x in stats([r[0] for r in bare_rows])) + " |")
            print("| bare QEMU: first exec | "
                  + " | ".join(f"{x:.2f}" for x in stats([r[1] for r in bare_rows])) + " |")
            print("| **bare QEMU: boot + first exec** | "
                  + " | ".join(f"{x:.2f}" for x in stats([r[2] for r in bare_rows])) + " |")
            k_create = statistics.median(r[0] for r in kiln_rows)
            k_total = statistics.median(r[2] for r in kiln_rows)
            b_boot = statistics.median(r[0] for r in bare_rows)
            b_total = statistics.median(r[2] for r in bare_rows)
            print(f"\nratio kiln create / bare boot (to HELLO + SET_IDENTITY): {k_create / b_boot:.2f} "
                  f"(Kiln's own cost ≈ {k_create - b_boot:+.2f} s of the median create)")
            print(f"ratio kiln create+first exec / bare boot+first exec: {k_total / b_total:.2f}")

        print()
        print("| VMM process | Rss | Anonymous | of which TCG code cache | file+shmem | "
              "guest mem resident (mincore) | guest mapping Rss | **overhead = Rss − guest** | Pss | "
              "Pss − guest | cgroup charge |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for m in mem_rows + [bm]:
            print(f"| {m['name']}{' (' + str(m['npids']) + ' pids)' if m['npids'] > 1 else ''} | "
                  f"{fmt_mib(m['rss'])} | {fmt_mib(m['anon'])} | {fmt_mib(m['tcg'])} | {fmt_mib(m['file_shmem'])} | "
                  f"{fmt_mib(m['guest_resident'])} | {fmt_mib(m['guest_rss'])} | "
                  f"**{fmt_mib(m['overhead'])}** | {fmt_mib(m['pss'])} | {fmt_mib(m['overhead_pss'])} | "
                  f"{fmt_mib(m['cgroup'])} |")
        if {"MemTotal", "MemFree"} <= guest_meminfo.keys():
            print(f"inside {mem_rows[0]['name']} (measured just after): MemTotal "
                  f"{fmt_mib(guest_meminfo['MemTotal'])}, MemFree {fmt_mib(guest_meminfo['MemFree'])} MiB "
                  f"(MemTotal − MemFree = {fmt_mib(guest_meminfo['MemTotal'] - guest_meminfo['MemFree'])} "
                  f"MiB; {MEM_MIB} MiB − MemTotal is the guest kernel's own reserved memory)")
        print("(MiB; file+shmem = Rss − Anonymous, the guest's memory file being its shmem part; the TCG "
              "code cache is the executable anonymous mapping)")

        # 3. density from the measured per-VM cost
        guest = statistics.mean(m["guest_resident"] for m in mem_rows)
        over_rss = statistics.mean(m["overhead"] for m in mem_rows)
        over_pss = statistics.mean(m["overhead_pss"] for m in mem_rows)
        usable = HOST_GIB * 1024 * MIB - HOST_RESERVE_MIB * MIB
        per_rss, per_pss = guest + over_rss, guest + over_pss
        full = MEM_MIB * MIB + over_rss
        tcg = statistics.mean(m["tcg"] for m in mem_rows)
        print()
        print(f"sandboxes of {MEM_MIB} MiB on one {HOST_GIB} GiB host, reserving "
              f"{HOST_RESERVE_MIB} MiB for the host and Kiln's daemons:")
        print(f"  N = floor(({HOST_GIB * 1024} MiB - {HOST_RESERVE_MIB} MiB) / (guest memory touched + VMM overhead))")
        print(f"  idle, python-ready, overhead by Rss: floor({usable / MIB:.0f} / ({guest / MIB:.1f} + "
              f"{over_rss / MIB:.1f})) = {int(usable // per_rss)}")
        print(f"  idle, python-ready, overhead by Pss: floor({usable / MIB:.0f} / ({guest / MIB:.1f} + "
              f"{over_pss / MIB:.1f})) = {int(usable // per_pss)}")
        print(f"  every guest touching all its memory:  floor({usable / MIB:.0f} / ({MEM_MIB} + "
              f"{over_rss / MIB:.1f})) = {int(usable // full)}")
        if tcg:
            print(f"  (without the TCG code cache, {tcg / MIB:.1f} MiB, which KVM does not have: "
                  f"floor({usable / MIB:.0f} / ({guest / MIB:.1f} + {(over_rss - tcg) / MIB:.1f})) = "
                  f"{int(usable // (per_rss - tcg))}; a KVM guest's own memory use was not measured here)")
        pte = statistics.mean(m["pte"] for m in mem_rows)
        print(f"  outside these figures, per sandbox: QEMU's page tables {pte / MIB:.1f} MiB; kiln-node "
              f"Rss {node_rss0 / MIB:.1f} MiB before the {idle_vms} idle sandboxes, "
              f"{node_rss1 / MIB:.1f} MiB with them ({(node_rss1 - node_rss0) / idle_vms / MIB:+.2f} MiB each)")
        print(f"\ntotal bench time: {time.monotonic() - t_start:.0f} s")
        ok = True
    finally:
        for vm in bare:
            vm.destroy()
        teardown(stack, key, live, ok, [f"/dev/shm/kilnbench-{os.getpid()}-*"])


def teardown(stack, key, live, ok, extra=()):
    """The end of a bench: its sandboxes `live` deleted (with `key`), the node's log tail when it
    failed (`ok` false), the stack stopped, and what the node left behind reported (with the
    paths of the glob patterns `extra`)."""
    for sid in list(live) if key else []:
        try:
            stack.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=key, timeout=60)
        except Exception:
            pass
    if not ok:
        sys.stderr.write("--- kiln-node log (tail) ---\n" + "\n".join(
            stack.node.output().splitlines()[-30:]) + "\n")
    node_id = stack.node.node_id
    stack.cleanup()
    left = glob.glob(f"/dev/shm/kiln-{node_id}-*") + glob.glob(f"/sys/fs/cgroup/*/kiln/{node_id}") + \
        glob.glob(f"/run/kiln/{node_id}/*")
    for pattern in extra:
        left += glob.glob(pattern)
    if left:
        sys.stderr.write(f"left behind after cleanup: {left}\n")


if __name__ == "__main__":
    main()
