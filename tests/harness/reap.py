#!/usr/bin/python3
"""reap.py - removes what the daemons of one test run left behind when a test was killed.

    reap.py REGISTRY_DIR         reap every daemon registered there, then empty the directory
    reap.py --check NODES_DIR    name, remove and fail on whatever a node of the run's list left

Every daemon tests/harness/kiln.py starts (kiln-gateway, kiln-node) records itself in the run's
registry (KILN_TEST_DIR/daemons of services.sh start; one JSON file per daemon: its pid, the
pid's start time, its binary, and for a node its id, run and data directories and the earliest
start of a node of that id in the test), and deletes its record when the test stops it cleanly. A test that ctest kills at its timeout (SIGKILL of the python
process) never stops them: kiln-node and its jailed QEMUs outlive it with their network
namespaces, TAPs, BPF pins and cgroups. services.sh stop (the "services" fixture's cleanup, which
ctest runs even after a timeout) runs this on the run's registry. For each record left:

- the daemon's pid is killed only while it is still that process: the same start time (clock
  ticks since boot, /proc/<pid>/stat field 22) and the same binary (/proc/<pid>/exe);
- for a node, its VMs (the processes in its cgroups kiln/<node>/..., and any process whose command
  line names the node's run directory or its id as a path component, started after the first node
  of that id) are
  killed; then each of its sandboxes' netns (kiln-<net id>) and host veth (kv<net id>) is removed,
  its nftables table (inet kiln_<node>), its BPF pins (/sys/fs/bpf/kiln/<node>), its cgroups (kiln/<node> under each hierarchy), its
  guest memory files (/dev/shm/kiln-<node>-*.mem), its VMs' run directories (/run/kiln/<node>/)
  and uid leases (/run/kiln/uids/<uid> holding "<node>/<id>", which only the node's own next
  start would release), its run and data directories, and the network
  namespace it ran in as a host of its own (kn<hex>, kiln.Netns) when it had one;
- every daemon's log (kiln.Daemon's kiln-log-*.log in /tmp or the run's KILN_TEST_DIR/tmp) and a
  gateway's admin key file (kiln-admin-key-*), which its killed test never removed.

--check is the end of a run, after the reaper: NODES_DIR is the run's list of every node id
kiln.py started (KILN_TEST_DIR/nodes, one JSON file each, kept after the node stopped). What any
of them still has on the host (node_leftovers) is printed, removed as above, and makes the exit
status 1: a node stopped cleanly leaves nothing, and a killed one was reaped.

Node ids are unique per test ("t" + 8 hex digits), so nothing of another run or of `make run` is
touched. Prints one line per thing removed; exit status 0, or 1 when something could not be
removed (each named). Needs root (as the tests that start nodes do).
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

CGROUP_ROOT = "/sys/fs/cgroup"
PIN_ROOT = "/sys/fs/bpf/kiln"
VM_RUN_ROOT = "/run/kiln"  # vmm/orphan.h VMM_RUN_ROOT_DEFAULT: a node's VMs under <root>/<node>/<id>/
LEASE_DIR = VM_RUN_ROOT + "/uids"  # vmm/jail.h JAIL_LEASE_DIR: <uid>, holding "<node>/<id>"
SHM = "/dev/shm"
NODE_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
# Where kiln.py's temporary files are: /tmp, or a run's own KILN_TEST_DIR/tmp (services.sh's
# /tmp/kt-XXXXXX), the only places the reaper removes them from.
HARNESS_TEMP = r"/tmp/(?:kt-[A-Za-z0-9]+/tmp/)?"


def harness_temp(path, prefix, suffix=""):
    """Whether `path` is one of kiln.py's temporary files or folders named `prefix`...`suffix`."""
    return re.match(rf"^{HARNESS_TEMP}{re.escape(prefix)}[^/]+{re.escape(suffix)}$", path) is not None


def start_time(pid):
    """The start time of `pid` in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


def exe_of(pid):
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def cmdline_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill(pid, what, log):
    try:
        os.kill(pid, signal.SIGKILL)
        log.append(f"killed {what} (pid {pid})")
    except ProcessLookupError:
        pass


def wait_gone(pids, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = [p for p in pids if os.path.exists(f"/proc/{p}") and not zombie(p)]
        if not pids:
            return []
        time.sleep(0.05)
    return pids


def zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] == "Z"
    except OSError:
        return False


def node_processes(node, run_dir, cgroups):
    """The pids in a node's cgroups, and those whose command line names its run directory or id."""
    pids = cgroup_pids(cgroups)
    marks = [m for m in (run_dir + "/", f"/{node}/", f"kiln-{node}-") if len(m) > 4]
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            cmd = cmdline_of(d)
            if cmd and any(m in cmd for m in marks):
                pids.add(int(d))
    return pids


def node_cgroups(node):
    """The kiln/<node> cgroup directories of every hierarchy (v1 controllers or v2)."""
    out = []
    for pattern in (f"{CGROUP_ROOT}/kiln/{node}", f"{CGROUP_ROOT}/*/kiln/{node}",
                    f"{CGROUP_ROOT}/*/*/kiln/{node}"):
        out.extend(d for d in glob.glob(pattern) if os.path.isdir(d))
    return sorted(set(out))


def cgroup_pids(dirs):
    pids = set()
    for top in dirs:
        for d, _, files in os.walk(top):
            if "cgroup.procs" in files:
                try:
                    with open(os.path.join(d, "cgroup.procs")) as f:
                        pids.update(int(p) for p in f.read().split())
                except OSError:
                    pass
    return pids


def node_sandboxes(rec, cgroups):
    """The ids of the sandboxes a node made, from what it left: cgroups, pins, run and data dirs."""
    ids = set()
    node = rec["node_id"]
    for top in cgroups:
        ids.update(x for x in os.listdir(top) if os.path.isdir(os.path.join(top, x)))
    for pattern in (f"{PIN_ROOT}/{node}/*", os.path.join(rec.get("run_dir") or "/nonexistent", "*"),
                    os.path.join(rec.get("data_dir") or "/nonexistent", "vms", node, "*"),
                    f"{VM_RUN_ROOT}/{node}/*"):
        ids.update(os.path.basename(p) for p in glob.glob(pattern) if os.path.isdir(p))
    for p in glob.glob(f"{SHM}/kiln-{node}-*.mem"):
        ids.add(os.path.basename(p)[len(f"kiln-{node}-"):-len(".mem")])
    ids.update(owner.split("/", 1)[1] for _, owner in node_leases(node))
    # a sandbox's or a template's id; or a warm VM's (node/warm.c), its own net id
    return {i for i in ids if re.match(r"^[a-z]+_[a-z0-9]+$", i) or re.match(r"^0[a-z2-7]{12}$", i)}


def node_leases(node):
    """The uid leases (vmm/jail.c) of `node`'s VMs: [(path, owner)], the owner "<node>/<id>"
    (vmm_lease_owner), so another node's never match."""
    out = []
    for p in glob.glob(f"{LEASE_DIR}/*"):
        if not os.path.basename(p).isdigit():
            continue
        try:
            with open(p) as f:
                owner = f.read().strip()
        except OSError:
            continue
        if owner.startswith(node + "/") and len(owner) > len(node) + 1:
            out.append((p, owner))
    return sorted(out)


def mounts_under(path):
    """The mount points at or below `path` in this mount namespace, deepest first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path + "/"):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def remove_tree(path, problems):
    """Removes `path` (a VM run directory: sockets, logs, jail mount points) after detaching what
    is mounted below it (a VM's jail mounts live in its own mount namespace: normally nothing)."""
    for mp in mounts_under(path):
        r = subprocess.run(["umount", "-l", mp], capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"{mp}: cannot unmount: {r.stderr.strip()}")
            return False
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        problems.append(f"{path}: could not be removed")
        return False
    return True


def net_id(sandbox_id):
    """The sandbox's network id (node/sandbox.c): after the prefix, at most 13 characters."""
    return (sandbox_id.split("_", 1)[1] if "_" in sandbox_id else sandbox_id)[:13]


def remove_pins(node):
    """Removes the guest-image pins (node/images.h) of test node `node`: in the image cache and in
    the test images beside it (kiln.image_copy). Returns the files removed."""
    cache = os.environ.get("KILN_IMAGE_CACHE", "/var/cache/kiln/images")
    gone = []
    for p in (glob.glob(os.path.join(cache, "*", ".kiln-pin-" + node)) +
              glob.glob(os.path.join(os.path.dirname(cache), "test-image-*", ".kiln-pin-" + node))):
        try:
            os.unlink(p)
            gone.append(p)
        except FileNotFoundError:
            pass
    return gone


def reap_node(rec, log, problems):
    node = rec["node_id"]
    if not NODE_ID.match(node):
        problems.append(f"bad node id {node!r} in the registry")
        return
    cgroups = node_cgroups(node)
    sandboxes = node_sandboxes(rec, cgroups)
    born = rec.get("born") or rec.get("start_time") or 0
    # Its VMs: in its cgroups, or naming its run directory or id; started after the node.
    run_dir = rec.get("run_dir") or ""
    vms = node_processes(node, run_dir, cgroups)
    left = []
    for pid in sorted(vms):
        st = start_time(pid)
        if st is None or st < born:
            continue
        kill(pid, f"process of node {node}: {cmdline_of(pid)[:80]!r}", log)
        left.append(pid)
    for pid in wait_gone(left):
        problems.append(f"pid {pid} of node {node} did not end")
    # Networks: the netns (its tap0 and uplink go with it) and the host veth.
    for sb in sorted(sandboxes):
        nid = net_id(sb)
        if os.path.exists(f"/run/netns/kiln-{nid}"):
            r = subprocess.run(["ip", "netns", "del", f"kiln-{nid}"], capture_output=True, text=True)
            (log if r.returncode == 0 else problems).append(f"netns kiln-{nid}: removed"
                                                            if r.returncode == 0 else
                                                            f"netns kiln-{nid}: {r.stderr.strip()}")
        # The veth's peer was in that netns: the kernel removes the pair as it tears the netns
        # down, which may be under way, so a link gone by the time it is deleted is gone.
        if os.path.exists(f"/sys/class/net/kv{nid}"):
            r = subprocess.run(["ip", "link", "del", f"kv{nid}"], capture_output=True, text=True)
            if r.returncode == 0 or not os.path.exists(f"/sys/class/net/kv{nid}"):
                log.append(f"link kv{nid}: removed")
            else:
                problems.append(f"link kv{nid}: {r.stderr.strip()}")
    # Its nftables table (node/netsetup.c), in the netns the reaper runs in; forwarding stays.
    table = "kiln_" + node.replace("-", "_")
    if shutil.which("nft") and subprocess.run(["nft", "list", "table", "inet", table],
                                              capture_output=True).returncode == 0:
        r = subprocess.run(["nft", f"delete table inet {table}"], capture_output=True, text=True)
        (log if r.returncode == 0 else problems).append(f"nftables table inet {table}: removed"
                                                        if r.returncode == 0 else
                                                        f"nftables table inet {table}: {r.stderr.strip()}")
    # BPF pins: files are unlinked, directories removed bottom up.
    pins = f"{PIN_ROOT}/{node}"
    if os.path.isdir(pins):
        for d, dirs, files in os.walk(pins, topdown=False):
            for f in files:
                try:
                    os.unlink(os.path.join(d, f))
                except OSError as e:
                    problems.append(f"pin {os.path.join(d, f)}: {e.strerror}")
            try:
                os.rmdir(d)
            except OSError as e:
                problems.append(f"pin dir {d}: {e.strerror}")
        log.append(f"pins {pins}: removed")
    # Cgroups: empty now, removed bottom up (their files are not files to unlink).
    for top in cgroups:
        for d, _, _ in os.walk(top, topdown=False):
            for attempt in range(50):
                try:
                    os.rmdir(d)
                    break
                except OSError as e:
                    if attempt == 49:
                        problems.append(f"cgroup {d}: {e.strerror}")
                    time.sleep(0.1)
        log.append(f"cgroups {top}: removed")
    for p in glob.glob(f"{SHM}/kiln-{node}-*.mem"):
        os.unlink(p)
        log.append(f"{p}: removed")
    # Its VMs' run directories and uid leases, as the node's own orphan cleanup at its next start
    # would remove them (vmm/orphan.c): a node that never starts again leaves them otherwise.
    vm_root = f"{VM_RUN_ROOT}/{node}"
    if os.path.lexists(vm_root) and remove_tree(vm_root, problems):
        log.append(f"{vm_root}: removed")
    for p, owner in node_leases(node):
        try:
            os.unlink(p)
            log.append(f"uid lease {p} ({owner}): released")
        except FileNotFoundError:
            pass
        except OSError as e:
            problems.append(f"uid lease {p} ({owner}): {e.strerror}")
    for p in remove_pins(node):
        log.append(f"{p}: removed")
    for d in (rec.get("run_dir"), rec.get("data_dir")):
        if d and os.path.isdir(d) and (d.startswith("/run/kt-") or harness_temp(d, "kiln-node-")):
            shutil.rmtree(d, ignore_errors=True)
            log.append(f"{d}: removed")
    # The namespace it ran in as a host of its own (kiln.Netns), with its veth and nftables table.
    ns = rec.get("netns") or ""
    if re.match(r"^kn[0-9a-f]{8}$", ns) and os.path.exists(f"/run/netns/{ns}"):
        r = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
        (log if r.returncode == 0 else problems).append(f"netns {ns}: removed" if r.returncode == 0
                                                        else f"netns {ns}: {r.stderr.strip()}")


def node_leftovers(rec):
    """What of node `rec` (a record of the run's node list) is still on this host: its processes
    (in its cgroups, or naming its run directory or id, started after it), its VMs' run directory
    and uid leases, its run directory, cgroups, BPF pins, guest memory files, nftables table and
    its sandboxes' netns and host veths. One line each."""
    node = rec["node_id"]
    born = rec.get("born") or 0
    run_dir = rec.get("run_dir") or f"/run/kt-{node}"
    cgroups = node_cgroups(node)
    left = []
    procs = node_processes(node, run_dir, cgroups)
    for pid in sorted(procs):
        st = start_time(pid)
        if st is not None and st >= born and not zombie(pid):
            left.append(f"process {pid}: {cmdline_of(pid)[:80]!r}")
    for d in (f"{VM_RUN_ROOT}/{node}", run_dir, f"{PIN_ROOT}/{node}"):
        if os.path.lexists(d):
            left.append(d + (": " + " ".join(sorted(os.listdir(d))) if os.path.isdir(d) else ""))
    left.extend(f"uid lease {p}: {owner}" for p, owner in node_leases(node))
    left.extend(f"cgroup {d}" for d in cgroups)
    left.extend(glob.glob(f"{SHM}/kiln-{node}-*.mem"))
    table = "kiln_" + node.replace("-", "_")
    if shutil.which("nft") and subprocess.run(["nft", "list", "table", "inet", table],
                                              capture_output=True).returncode == 0:
        left.append(f"nftables table inet {table}")
    for sb in sorted(node_sandboxes(rec, cgroups)):
        nid = net_id(sb)
        if os.path.exists(f"/run/netns/kiln-{nid}"):
            left.append(f"netns kiln-{nid} (sandbox {sb})")
        if os.path.exists(f"/sys/class/net/kv{nid}"):
            left.append(f"link kv{nid} (sandbox {sb})")
    return left


def check(nodes_dir):
    """The check at the end of a test run, after the reaper: every node the run started (its list,
    `nodes_dir`: one JSON file per node id, kept after the node stopped) must have left nothing on
    the host. What one left is printed, then removed as the reaper removes a killed node's; the
    exit status is 1 when anything was left. Only the run's own node ids are looked at, so another
    run's nodes (or `make run`'s) are never touched."""
    leaks = False
    problems = []
    for path in sorted(glob.glob(os.path.join(nodes_dir, "*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            print(f"check: FAILED {path}: unreadable: {e}")
            leaks = True
            continue
        if not NODE_ID.match(rec.get("node_id", "")):
            print(f"check: FAILED bad node id {rec.get('node_id')!r} in {path}")
            leaks = True
            continue
        left = node_leftovers(rec)
        if not left:
            continue
        leaks = True
        for line in left:
            print(f"check: FAILED node {rec['node_id']} left {line}")
        log = []
        # Only what a node makes: its data directory, not in the list, is its test's to remove.
        reap_node(rec, log, problems)
        for line in log:
            print("check: " + line)
    for line in problems:
        print("check: FAILED " + line)
    return 1 if leaks or problems else 0


def reap(registry):
    log, problems = [], []
    records = []
    for path in sorted(glob.glob(os.path.join(registry, "*.json"))):
        try:
            with open(path) as f:
                records.append((path, json.load(f)))
        except (OSError, ValueError) as e:
            problems.append(f"{path}: unreadable: {e}")
    # The daemons first (a node that lives would make more), then what the nodes left.
    for _, rec in records:
        pid = int(rec.get("pid", 0))
        exe = exe_of(pid)
        if exe.endswith(" (deleted)"):  # the binary was rebuilt since it started
            exe = exe[:-len(" (deleted)")]
        if pid > 1 and start_time(pid) == rec.get("start_time") and exe == rec.get("exe"):
            kill(pid, f"{rec.get('kind', 'daemon')} {rec.get('node_id', '')}".strip(), log)
            for p in wait_gone([pid]):
                problems.append(f"pid {p} did not end")
    for path, rec in records:
        if rec.get("kind") == "node":
            reap_node(rec, log, problems)
        # its output (kiln.Daemon's temporary log) and a gateway's admin key file, which its
        # killed test never removed
        for out, prefix, suffix in ((rec.get("log") or "", "kiln-log-", ".log"),
                                    (rec.get("admin_key_file") or "", "kiln-admin-key-", "")):
            if harness_temp(out, prefix, suffix) and os.path.exists(out):
                os.unlink(out)
                log.append(f"{out}: removed")
        os.unlink(path)
    for line in log:
        print("reap: " + line)
    for line in problems:
        print("reap: FAILED " + line)
    return 1 if problems else 0


def main(argv):
    if len(argv) == 3 and argv[1] == "--check":
        return check(argv[2]) if os.path.isdir(argv[2]) else 0
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    if not os.path.isdir(argv[1]):
        return 0
    return reap(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
