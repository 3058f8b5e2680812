"""attacks.py - the hostile-guest attacks, shared by tests/e2e/test_hostile.py (short form) and
bench/hostile/bench_hostile.py (long form).

Everything goes through the public API of a real kiln-gateway and kiln-node with jailed QEMU
microVMs, inside network namespaces of the run's own (`in_namespaces`): "the host" holds the
gateway (listening on every address), kiln-node (its API on TCP, every address), the host's
Postgres and Redis reachable over TCP on every address (forwarded to the throwaway cluster's Unix
sockets), and an uplink 192.0.2.1 to "the internet", which serves DNS, a metadata address and a
UDP sink (tests/integration/netpolicy/fakenet.py, and `sink` below).

Tenant A's attacker sandbox runs each attack as root through `POST …/exec`; tenant B's neighbour
sandbox is probed by `Prober` (an `exec echo` and a `GET /healthz` about every second). Each
attack checks its own contract and raises `Broken` naming what did not hold; it returns figures
for the report. `window_checks` then says whether the neighbour and /healthz held during it.
"""
import glob
import json
import os
import re
import secrets
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "harness"))
import kiln  # noqa: E402

FAKENET = os.path.join(ROOT, "tests", "integration", "netpolicy", "fakenet.py")
UPLINK = "192.0.2.1"		# the host's address towards the internet
UPLINK6 = "2001:db8:ffff::1"
INET = ["203.0.113.10", "192.0.2.53", "169.254.169.254"]
SINK = "203.0.113.50"		# the internet's UDP sink: what arrives there got out
SINK_PORT = 9000
GUEST_MAC = "06:00:ac:10:00:02"
GW_MAC = "06:00:ac:10:00:01"
NEIGHBOUR_PORT = 8000
NEIGHBOUR_DEADLINE_S = 30
CONSOLE_MAX = 64 << 10		# console_max_bytes's least
DISK_MIBPS = 16
MIB = 1 << 20


class Broken(AssertionError):
    """An attack got further than the platform promises (a finding)."""


def check(cond, msg):
    if not cond:
        raise Broken(msg)


# ---- namespaces ------------------------------------------------------------------------------

SINK_PY = r'''
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    d, a = s.recvfrom(2048)
    print(a[0], d[:64].decode(errors="replace"), flush=True)
'''


def in_namespaces(argv, env=None):
    """Builds "the host" and "the internet" namespaces (veth 192.0.2.1/30 <-> .2, default route
    out, 10.200/16 routed back), starts fakenet (DNS on 192.0.2.53, servers on INET) and the UDP
    sink in the internet, runs `argv` inside the host namespace with KILN_HOSTILE_INET_NS and
    KILN_HOSTILE_SINK_LOG set, and removes everything afterwards. Returns its exit status."""
    tag = "kh" + secrets.token_hex(3)
    ns_h, ns_i = tag + "h", tag + "i"
    procs = []
    sink_log = f"/tmp/kiln-hostile-sink-{tag}.log"

    def sh(*a):
        subprocess.run(a, check=True)
    try:
        for ns in (ns_h, ns_i):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns_h, "link", "add", "up0", "type", "veth", "peer", "name", "up0", "netns", ns_i)
        sh("ip", "-n", ns_h, "addr", "add", UPLINK + "/30", "dev", "up0")
        sh("ip", "-n", ns_i, "addr", "add", "192.0.2.2/30", "dev", "up0")
        sh("ip", "-n", ns_h, "-6", "addr", "add", UPLINK6 + "/64", "dev", "up0", "nodad")
        sh("ip", "-n", ns_i, "-6", "addr", "add", "2001:db8:ffff::2/64", "dev", "up0", "nodad")
        for ns in (ns_h, ns_i):
            sh("ip", "-n", ns, "link", "set", "up0", "up")
        sh("ip", "-n", ns_h, "route", "add", "default", "via", "192.0.2.2")
        sh("ip", "netns", "exec", ns_h, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "-n", ns_i, "route", "add", "10.200.0.0/16", "via", UPLINK)
        for a in INET + [SINK]:
            sh("ip", "-n", ns_i, "addr", "add", a + "/32", "dev", "lo")
        p = subprocess.Popen(["ip", "netns", "exec", ns_i, sys.executable, FAKENET] + INET,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        with open(sink_log, "w") as log:
            p = subprocess.Popen(["ip", "netns", "exec", ns_i, sys.executable, "-c", SINK_PY, SINK,
                                  str(SINK_PORT)], stdout=log)
        procs.append(p)
        deadline = time.time() + 10
        while time.time() < deadline and "ready" not in open(sink_log).read():
            time.sleep(0.05)
        full = dict(os.environ, **(env or {}), KILN_HOSTILE_INET_NS=ns_i,
                    KILN_HOSTILE_SINK_LOG=sink_log)
        # nsenter, not `ip netns exec`: that one mounts a fresh /sys, hiding the cgroup and bpf
        # file systems the node needs.
        return subprocess.run(["nsenter", "--net=/run/netns/" + ns_h] + argv, env=full).returncode
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ns in (ns_h, ns_i):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if os.path.exists(sink_log):
            os.unlink(sink_log)


# ---- the host's services on TCP -------------------------------------------------------------

class Forwarder:
    """A TCP listener on every address of the host namespace whose connections are spliced to a
    Unix socket: the host's Postgres or Redis as a host that serves them over TCP would have."""

    def __init__(self, port, unix_path):
        self.port = port
        self.unix_path = unix_path
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind(("::", port))
        self.sock.listen(64)
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                u = socket.socket(socket.AF_UNIX)
                u.connect(self.unix_path)
            except OSError:
                c.close()
                continue
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.sock.close()


def service_answers(addr, port, hello, timeout=3):
    """What a TCP service at addr:port answers to `hello` (b"" if nothing, None if no connection)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(hello)
            return s.recv(64)
    except OSError:
        return None


# ---- the stack --------------------------------------------------------------------------------

class Stack(kiln.Stack):
    """A gateway, a TCP kiln-node, the host's Postgres and Redis on TCP, tenants A and B, and a
    sandbox of each: A's attacker, B's neighbour (listening on NEIGHBOUR_PORT, a marker file)."""

    def __init__(self, node_env=None, memory_mib=256):
        env = kiln.services_env()
        self.forwarders = []
        self.db = kiln.fresh_database()
        try:
            # the gateway on every address of the host namespace (as a public gateway is), the
            # node's API on TCP reached at UPLINK: the attacks have something to hit
            self.gw = kiln.Gateway(self.db.url, env["KILN_REDIS_URL"], {"KILN_LOG_LEVEL": "info"},
                                   listen_host="0.0.0.0")
            nenv = {"KILN_MASTER_KEY": self.gw.master_key, "KILN_DNS_UPSTREAM": "192.0.2.53",
                    "KILN_LOG_LEVEL": "info",
                    "KILN_CONSOLE_MAX_BYTES": str(CONSOLE_MAX),
                    "KILN_DISK_MIBPS_PER_VCPU": str(DISK_MIBPS)}
            nenv.update(node_env or {})
            self.node = kiln.Node(self.db.url, self.gw.url, nenv, node_id="h" + secrets.token_hex(4),
                                  tcp_address=UPLINK)
            self.forwarders = [Forwarder(5432, os.path.join(env["KILN_TEST_SOCKDIR"], ".s.PGSQL.5432")),
                               Forwarder(6379, env["KILN_REDIS_URL"][len("unix:"):])]
        except Exception:
            self.cleanup_partial()
            raise
        self.admin = {"Authorization": "Bearer " + self.gw.admin_key}
        self.memory_mib = memory_mib
        self.key_a = self.tenant("attacker")
        self.key_b = self.tenant("neighbour")
        self.b = self.create(self.key_b)
        self.a = self.create(self.key_a)
        self.marker = secrets.token_hex(16)
        out = self.exec(self.b, self.key_b, {"cmd": ["sh", "-c",
            f"echo {self.marker} > /root/marker; nohup python3 -c \"import socket\ns=socket.socket();"
            f"s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('0.0.0.0',{NEIGHBOUR_PORT}));"
            "s.listen()\nwhile 1:\n c,_=s.accept();c.sendall(b'neighbour');c.close()\" >/dev/null 2>&1 &"]})
        check(out.status == 200, f"the neighbour's setup failed: {out}")
        # its listener is up once the kernel lists it (Python starts slowly under TCG)
        deadline = time.monotonic() + 180
        while True:
            r = self.sh(f"grep -ci ':{NEIGHBOUR_PORT:04X} 00000000:0000 0A' /proc/net/tcp", sb=self.b,
                        key=self.key_b)
            if r["stdout"].strip() == "1":
                break
            check(time.monotonic() < deadline, f"B's listener never came up: {r}")
            time.sleep(1)
        self.b_before = self.neighbour_state()

    def cleanup_partial(self):
        for f in self.forwarders:
            f.close()
        for d in ("node", "gw"):
            if hasattr(self, d):
                getattr(self, d).cleanup()
        self.db.drop()

    def cleanup(self):
        self.cleanup_partial()

    def create(self, key):
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": self.memory_mib, "timeout_s": 3600},
                            key, timeout=600)
        check(r.status == 201, f"create: {r}")
        return r.json()

    def exec(self, sb, key, body, timeout=None):
        t = timeout or (body.get("timeout_s") or 60) + 60
        return self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", body, key, timeout=t)

    def sh(self, cmd, seconds=60, sb=None, key=None):
        """Runs `cmd` in A (or `sb`) and returns the exec's JSON; raises unless it answered 200."""
        r = self.exec(sb or self.a, key or self.key_a, {"cmd": ["sh", "-c", cmd], "timeout_s": seconds})
        check(r.status == 200, f"exec in the attacker answered {r}")
        return r.json()

    def py(self, code, seconds=60, sb=None, key=None):
        r = self.exec(sb or self.a, key or self.key_a, {"code": code, "timeout_s": seconds})
        check(r.status == 200, f"exec in the attacker answered {r}")
        return r.json()

    def net_index(self, sb):
        return int(self.db.sql(f"SELECT net_index FROM sandboxes WHERE id = '{sb['id']}'"))

    def nat_address(self, sb, host_side=False):
        i = self.net_index(sb)
        return "10.200.%d.%d" % ((4 * i) // 256, (4 * i) % 256 + (1 if host_side else 2))

    def state_dir(self, sb):
        dirs = glob.glob(f"{self.node.data_dir}/vms/*/{sb['id']}")
        check(len(dirs) == 1, f"state dir of {sb['id']}: {dirs}")
        return dirs[0]

    def counters(self, sb):
        """The sandbox's eBPF counters (struct np_counters), summed over CPUs."""
        path = f"/sys/fs/bpf/kiln/{self.node.node_id}/{sb['id']}/counters"
        out = subprocess.run(["bpftool", "-j", "map", "lookup", "pinned", path, "key", "0", "0", "0", "0"],
                             capture_output=True, text=True, check=True).stdout
        rec = json.loads(out)
        names = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets", "drop_policy_bytes",
                 "drop_policy_packets", "drop_quota_bytes", "drop_quota_packets", "drop_spoof_packets",
                 "drop_rate_packets")
        total = dict.fromkeys(names, 0)
        for v in rec["values"]:
            raw = bytes(int(x, 16) for x in v["value"])
            for n, x in zip(names, struct.unpack("<10Q", raw[:80])):
                total[n] += x
        return total

    def neighbour_state(self):
        """What of B an attack must not change: state, boot id, marker, rules, bandwidth."""
        sb = self.gw.request("GET", f"/v1/sandboxes/{self.b['id']}", headers=self.key_b).json()
        out = self.sh("cat /proc/sys/kernel/random/boot_id /root/marker; hostname", sb=self.b, key=self.key_b)
        eg = self.gw.request("GET", f"/v1/sandboxes/{self.b['id']}/egress", headers=self.key_b).json()
        bw = self.gw.request("GET", f"/v1/sandboxes/{self.b['id']}/bandwidth", headers=self.key_b).json()
        bw.pop("remaining_bytes", None)
        return {"state": sb["state"], "guest": out["stdout"].split(), "egress": eg, "bandwidth": bw}

    def attacker_usable(self):
        """True when A answers an exec within 60 s."""
        try:
            r = self.exec(self.a, self.key_a, {"cmd": ["echo", "up"]}, timeout=60)
        except OSError:
            return False
        return r.status == 200 and r.json()["stdout"] == "up\n"

    def fresh_attacker(self):
        """Deletes A (whatever its state) and creates another for tenant A."""
        self.gw.request("DELETE", f"/v1/sandboxes/{self.a['id']}", None, self.key_a, timeout=120)
        self.a = self.create(self.key_a)


# ---- the neighbour's prober -------------------------------------------------------------------

class Prober:
    """Every `period` s: `exec echo` on B (its latency, or None when it failed or took over
    NEIGHBOUR_DEADLINE_S) and GET /healthz (its status)."""

    def __init__(self, stack, period=1.0):
        self.stack = stack
        self.period = period
        self.samples = []	# (start, exec seconds or None, exec detail, end)
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._exec_loop, daemon=True),
                        threading.Thread(target=self._healthz_loop, daemon=True)]
        self.health = []	# (start, status, seconds)
        for t in self.threads:
            t.start()

    def _exec_loop(self):
        s = self.stack
        while not self.stopping.is_set():
            t0 = time.monotonic()
            lat, detail = None, ""
            try:
                r = s.exec(s.b, s.key_b, {"cmd": ["echo", "neighbour"]}, timeout=NEIGHBOUR_DEADLINE_S)
                if r.status == 200 and r.json()["stdout"] == "neighbour\n":
                    lat = time.monotonic() - t0
                else:
                    detail = repr(r)
            except Exception as e:
                detail = f"{type(e).__name__}: {e}"
            self.samples.append((t0, lat, detail, time.monotonic()))
            self.stopping.wait(max(0.0, self.period - (time.monotonic() - t0)))

    def _healthz_loop(self):
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                st = self.stack.gw.request("GET", "/healthz", timeout=10).status
            except Exception:
                st = None
            self.health.append((t0, st, time.monotonic() - t0))
            self.stopping.wait(max(0.0, self.period - (time.monotonic() - t0)))

    def window(self, start, end):
        """The samples that were under way at some time in [start, end]: an attack shorter than
        one probe (a disk filled in a second) is measured by the probe it overlapped. Waits for
        the probes under way at `end` to finish (each loop probes one at a time, so a sample that
        ended after `end` means every earlier one is in)."""
        limit = time.monotonic() + NEIGHBOUR_DEADLINE_S + 15
        ex_in = hz_in = False
        while time.monotonic() < limit and not self.stopping.is_set():
            ex_in = bool(self.samples) and self.samples[-1][3] >= end
            hz_in = bool(self.health) and self.health[-1][0] + self.health[-1][2] >= end
            if ex_in and hz_in:
                break
            time.sleep(0.1)
        ex = [x for x in self.samples if x[0] <= end and x[3] >= start]
        hz = [x for x in self.health if x[0] <= end and x[0] + x[2] >= start]
        # a probe still under way past the wait is one that did not answer in time
        if not ex_in:
            ex.append((end, None, "still under way", time.monotonic()))
        if not hz_in:
            hz.append((end, None, time.monotonic() - end))
        return ex, hz

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(NEIGHBOUR_DEADLINE_S + 5)


def window_checks(prober, start, end):
    """Raises Broken unless B answered every exec within the deadline and /healthz was 200
    throughout [start, end] (with at least one sample of each)."""
    ex, hz = prober.window(start, end)
    check(ex, "no neighbour exec was measured during the attack")
    check(hz, "no /healthz was measured during the attack")
    bad = [x for x in ex if x[1] is None or x[1] > NEIGHBOUR_DEADLINE_S]
    check(not bad, f"the neighbour's exec failed or took over {NEIGHBOUR_DEADLINE_S} s: {bad[:3]}")
    badh = [x for x in hz if x[1] != 200]
    check(not badh, f"/healthz was not 200: {badh[:3]}")
    return ex, hz


def pcts(xs):
    """p50, p95, max of a list of seconds."""
    xs = sorted(xs)
    if not xs:
        return (float("nan"),) * 3
    p95 = xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]
    return statistics.median(xs), p95, xs[-1]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# ---- the attacks --------------------------------------------------------------------------------
# Each takes the stack and a duration in seconds, raises Broken when the platform did not hold,
# and returns a short dict of what it saw.

PROBE_PY = r'''
import socket, threading
def tcp(host, port, t=3):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(t)
    try:
        s.connect((host, port))
        s.settimeout(t)
        try:
            d = s.recv(16)
        except socket.timeout:
            d = b"(connected)"
        return "open:" + d.decode(errors="replace")
    except Exception as e:
        return "fail"
    finally:
        s.close()
def many(targets):
    res = {}
    def one(h, p):
        res["%s,%d" % (h, p)] = tcp(h, p)
    ts = [threading.Thread(target=one, args=t) for t in targets]
    for t in ts: t.start()
    for t in ts: t.join()
    return res
'''


def reach_host_services(s, seconds):
    """From A: the gateway's, kiln-node's, Postgres's and Redis's ports on every host address
    (uplink v4 and v6, A's veth host side, the TAP's host side), the metadata address, and B's
    listener on its NAT address. Each must be closed to A, while the same ports answer from the
    host itself (so the test proves something) and B's listener answers inside B."""
    ports = [s.gw.port, s.node.port, 5432, 6379]
    veth = s.nat_address(s.a, host_side=True)
    # the controls: each of these answers from the host itself
    controlled = [(a, p) for a in (UPLINK, veth) for p in ports] + [(UPLINK6, 5432), (UPLINK6, 6379)]
    hello = {s.gw.port: b"GET /healthz HTTP/1.0\r\n\r\n", s.node.port: b"GET / HTTP/1.0\r\n\r\n",
             5432: b"\x00\x00\x00\x08\x04\xd2\x16\x2f", 6379: b"PING\r\n"}
    for addr, p in controlled:
        got = service_answers(addr, p, hello[p])
        check(got, f"control: {addr}:{p} does not answer from the host ({got!r}): the attack "
                   "would prove nothing")
    check(service_answers(UPLINK, 6379, b"PING\r\n").startswith(b"+PONG"), "control: Redis over TCP")
    check(service_answers(UPLINK, 5432, hello[5432]) in (b"N", b"S"), "control: Postgres over TCP")
    check(service_answers("169.254.169.254", 80, b"") is not None, "control: the metadata address")
    r = s.sh(f"grep -ci ':{NEIGHBOUR_PORT:04X} 00000000:0000 0A' /proc/net/tcp", sb=s.b, key=s.key_b)
    check(r["stdout"].strip() == "1", f"control: B does not listen on {NEIGHBOUR_PORT}: {r}")
    targets = controlled + [("172.16.0.1", p) for p in ports] + [(UPLINK6, p) for p in ports[:2]]
    targets += [("169.254.169.254", 80), (s.nat_address(s.b), NEIGHBOUR_PORT),
                (s.nat_address(s.b, host_side=True), s.gw.port), ("10.200.0.1", s.node.port)]
    before = s.counters(s.a)
    deadline = time.monotonic() + seconds
    rounds = 0
    while True:
        out = s.py(PROBE_PY + f"import json\nprint(json.dumps(many({targets!r})))", seconds=180)
        check(out["exit_code"] == 0, f"the probing program failed: {out}")
        res = json.loads(out["stdout"])
        opened = {k: v for k, v in res.items() if v != "fail"}
        check(not opened, f"the attacker reached {opened}")
        rounds += 1
        if time.monotonic() >= deadline:
            break
    after = s.counters(s.a)
    check(after["drop_policy_packets"] > before["drop_policy_packets"],
          "A's policy drop counter did not move: the probes never met the policy")
    return {"targets": len(targets), "rounds": rounds,
            "dropped": after["drop_policy_packets"] - before["drop_policy_packets"]}


SPOOF_PY = r'''
import socket, struct, time, json, sys
def csum(b):
    if len(b) % 2: b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16: s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff
def mac(m): return bytes(int(x, 16) for x in m.split(":"))
def frame(src_mac, src_ip, dst_ip, dport, payload):
    pseudo = socket.inet_aton(src_ip) + socket.inet_aton(dst_ip) + struct.pack("!BBH", 0, 17, 8 + len(payload))
    udp = struct.pack("!HHHH", 40000, dport, 8 + len(payload), 0) + payload
    udp = udp[:6] + struct.pack("!H", csum(pseudo + udp) or 0xffff) + udp[8:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    ip = ip[:10] + struct.pack("!H", csum(ip)) + ip[12:]
    return mac(GW) + mac(src_mac) + b"\x08\x00" + ip + udp
def arp(src_mac, src_ip, target_ip):
    body = struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 2, mac(src_mac), socket.inet_aton(src_ip),
                       mac(GW), socket.inet_aton(target_ip))
    return mac(GW) + mac(src_mac) + b"\x08\x06" + body
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind(("eth0", 0))
kinds = {"honest": (MAC, "172.16.0.2"), "ip": (MAC, "172.16.9.9"), "mac": (FAKE_MAC, "172.16.0.2"),
         "both": (FAKE_MAC, "172.16.9.9"), "as_b": (MAC, B_NAT)}
sent = dict.fromkeys(kinds, 0)
end = time.time() + SECONDS
n = 0
while True:
    for k, (m, ip) in kinds.items():
        if k == "honest" and sent[k] >= 5:
            continue
        for dst, port in ((SINK, SINK_PORT), (B_NAT, B_PORT)):
            s.send(frame(m, ip, dst, port, ("kiln-spoof-%s-%d" % (k, n)).encode()))
            sent[k] += 1
    s.send(arp(FAKE_MAC, "172.16.0.1", "172.16.0.1"))
    n += 1
    if time.time() >= end and n >= 5:
        break
    time.sleep(0.01)
# a real MAC change, then a flow through the kernel's own stack
import subprocess
ok = subprocess.run(["ip", "link", "set", "dev", "eth0", "address", FAKE_MAC]).returncode == 0
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(5):
    u.sendto(b"kiln-spoof-linkmac-%d" % i, (SINK, SINK_PORT))
    time.sleep(0.05)
subprocess.run(["ip", "link", "set", "dev", "eth0", "address", MAC])
subprocess.run(["ip", "neigh", "flush", "dev", "eth0"])
print(json.dumps({"sent": sent, "link_mac_changed": ok}))
'''


def sink_lines():
    with open(os.environ["KILN_HOSTILE_SINK_LOG"], errors="replace") as f:
        return [line.split() for line in f.read().splitlines() if line != "ready"]


def spoof(s, seconds):
    """From A, raw Ethernet frames with a foreign source MAC, a foreign source IP, both, and B's
    NAT address as source, to the internet's sink and to B; a gratuitous ARP claiming the
    gateway; a real MAC change on eth0. Honest frames built the same way must arrive at the sink
    (the control); no spoofed one may, and A's spoof counter must count them."""
    before_sink = len(sink_lines())
    before = s.counters(s.a)
    b_nat = s.nat_address(s.b)
    code = (f"GW = {GW_MAC!r}; MAC = {GUEST_MAC!r}; FAKE_MAC = '06:00:de:ad:be:ef'\n"
            f"SINK = {SINK!r}; SINK_PORT = {SINK_PORT}; B_NAT = {b_nat!r}; B_PORT = {NEIGHBOUR_PORT}\n"
            f"SECONDS = {seconds}\n" + SPOOF_PY)
    out = s.py(code, seconds=seconds + 180)
    check(out["exit_code"] == 0, f"the spoofing program failed: {out}")
    res = json.loads(out["stdout"].splitlines()[-1])
    time.sleep(1)
    got = sink_lines()[before_sink:]
    after = s.counters(s.a)
    honest = [g for g in got if len(g) > 1 and g[1].startswith("kiln-spoof-honest")]
    spoofed = [g for g in got if len(g) > 1 and not g[1].startswith("kiln-spoof-honest")]
    check(honest, "control: no honest raw frame reached the sink: the attack would prove nothing")
    # kiln-node's own table masquerades the sandbox ranges to the uplink (docs/network-policy.md,
    # "Host setup"): every frame that gets out carries the host's address, the tag tells them apart
    check(all(g[0] == UPLINK for g in honest), f"honest frames came from {honest}")
    check(not spoofed, f"spoofed frames got out: {spoofed[:5]}")
    n_spoofed = sum(v for k, v in res["sent"].items() if k != "honest")
    counted = after["drop_spoof_packets"] - before["drop_spoof_packets"]
    check(counted >= n_spoofed, f"{n_spoofed} spoofed frames sent, {counted} counted as spoofed")
    check(s.attacker_usable(), "A no longer answers after restoring its MAC")
    return {"spoofed_sent": n_spoofed, "spoof_counted": counted, "honest_arrived": len(honest),
            "link_mac_changed": res["link_mac_changed"]}


DNS_FLOOD_PY = r'''
import socket, os, random, time, json
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
end = time.time() + SECONDS
sent = answered = 0
def q(name):
    return os.urandom(2) + b"\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(
        bytes([len(l)]) + l.encode() for l in name.split(".")) + b"\x00\x00\x01\x00\x01"
while time.time() < end or sent < LEAST:
    name = ("%x.hole.test" % random.getrandbits(48)) if sent % 2 else "example.com"
    try:
        s.sendto(q(name), ("172.16.0.1", 53))
        sent += 1
    except BlockingIOError:
        pass
    try:
        while True:
            s.recv(512)
            answered += 1
    except BlockingIOError:
        pass
print(json.dumps({"sent": sent, "answered": answered}))
'''

RESOLVE_PY = r'''
import socket, time
ok = 0
for i in range(N):
    try:
        if socket.getaddrinfo("sub.example.com", 80, socket.AF_INET)[0][4][0] == "203.0.113.10":
            ok += 1
    except Exception:
        pass
    time.sleep(0.5)
print(ok)
'''


FLOOD_LEAST = 1000	# queries at least: five times conn_burst, however slow the guest runs


def dns_flood(s, seconds):
    """A floods the DNS proxy (random never-answered names and real ones, as fast as it can) while
    B resolves a name every half second: B gets every answer, A's queries die in its own rate
    bucket and pending table."""
    before = s.counters(s.a)
    res = {}

    def flood():
        res["a"] = s.py(f"SECONDS = {seconds}\nLEAST = {FLOOD_LEAST}\n" + DNS_FLOOD_PY, seconds=seconds + 180)

    t = threading.Thread(target=flood)
    t.start()
    time.sleep(min(2, seconds / 3))
    n = max(3, int(seconds))
    b = s.py(f"N = {n}\n" + RESOLVE_PY, seconds=n + 60, sb=s.b, key=s.key_b)
    t.join()
    check("a" in res, "the flood's exec did not answer")
    after = s.counters(s.a)
    check(b["stdout"].strip() == str(n), f"B resolved {b['stdout'].strip()} of {n} names during the flood")
    a = json.loads(res["a"]["stdout"])
    rate = after["drop_rate_packets"] - before["drop_rate_packets"]
    check(a["sent"] >= FLOOD_LEAST, f"the flood sent only {a['sent']} queries: not a flood")
    check(rate > 0, "none of A's queries met its connection-rate bucket")
    return {"queries": a["sent"], "answered": a["answered"], "rate_dropped": rate,
            "neighbour_resolved": n}


def console_flood(s, seconds):
    """A writes its serial console (and every hvc) without end: the host's file stays at
    console_max_bytes, nothing grows under the node's /run, and A still answers."""
    log = os.path.join(s.state_dir(s.a), "serial.log")
    run_before = tree_bytes(s.node.run_dir)
    seconds = max(seconds, 8)
    out = s.sh(f"for d in /dev/ttyS0 /dev/hvc0 /dev/console; do [ -e $d ] && "
               f"(timeout {seconds} sh -c \"yes kiln-console-flood-$d > $d\" &); done; sleep {seconds}; "
               "wait; echo done", seconds=seconds + 120)
    check(out["stdout"].endswith("done\n"), f"the flood did not run: {out}")
    size = os.path.getsize(log)
    old = os.path.getsize(log + ".old") if os.path.exists(log + ".old") else 0
    check(old > 0, "the console never reached its cap: the flood proves nothing")
    check(size + old <= CONSOLE_MAX, f"console on the host {size + old} bytes > {CONSOLE_MAX}")
    grew = tree_bytes(s.node.run_dir) - run_before
    check(grew <= 64 << 10, f"the node's run dir grew {grew} bytes")
    check(s.attacker_usable(), "A no longer answers after its console flood")
    return {"console_bytes": size + old, "cap": CONSOLE_MAX}


tree_bytes = kiln.tree_bytes


def qcow2_bound(virtual_size):
    """The most a qcow2 layer may take on the host (as tests/e2e/test_disk.py)."""
    clusters = virtual_size // (64 * 1024)
    return virtual_size + clusters * 10 + 4 * MIB


def confined_exec(s, body, seconds):
    """Runs an exec that may take A's own agent down with it. The contract: 200, or, when the
    agent fell silent past the exec's timeout + 10 s (docs/agent-protocol.md), 502
    `sandbox_failed` with A in state `error`. Returns (the 200 body or None, outcome)."""
    r = s.exec(s.a, s.key_a, dict(body, timeout_s=seconds), timeout=seconds + 180)
    if r.status == 200:
        return r.json(), "answered"
    check(r.status == 502 and r.json()["error"]["code"] == "sandbox_failed",
          f"the exec answered {r} (the contract: 200, or 502 sandbox_failed)")
    st = s.gw.request("GET", f"/v1/sandboxes/{s.a['id']}", headers=s.key_a).json()["state"]
    check(st == "error", f"A answered 502 sandbox_failed but its state is {st}")
    return None, "A failed (its agent fell silent)"


def fork_bomb(s, seconds):
    """A fork bomb in A for `seconds` (the exec's own timeout kills its process group): the VM
    stays inside its cgroup's pids and memory caps on the host; A answers or fails alone."""
    cg = vm_cgroup(s, s.a)
    out, outcome = confined_exec(s, {"code": "import os\nwhile True:\n    try:\n        os.fork()\n"
                                             "    except OSError:\n        pass\n"}, seconds)
    check(out is None or out["timed_out"], f"the fork bomb ended by itself: {out}")
    limits = cgroup_limits(cg)
    check_caps(s, limits)
    return {"outcome": outcome, "usable_after": out is not None and s.attacker_usable(), **limits}


def memory_fill(s, seconds):
    """A allocates and touches twice its RAM for up to `seconds`: the guest's OOM killer acts
    inside it, the host's use stays within the VM's cgroup cap."""
    cg = vm_cgroup(s, s.a)
    code = ("import time\nend = time.time() + SECONDS\nheld = []\n"
            "while time.time() < end and len(held) < MAX:\n"
            "    held.append(bytearray(b'\\x01') * (16 << 20))\n"
            "print(len(held))\ntime.sleep(max(0, end - time.time()))\n")
    body, outcome = confined_exec(s, {"code": f"SECONDS = {seconds}\nMAX = {2 * s.memory_mib // 16}\n"
                                              + code}, seconds + 30)
    # 137: the guest's OOM killer ended it; 0 only if it held less than twice the guest's RAM
    check(body is None or body["exit_code"] != 0 or int(body["stdout"] or 0) * 16 < 2 * s.memory_mib,
          f"the guest held twice its RAM: {body}")
    limits = cgroup_limits(cg)
    check_caps(s, limits)
    return {"outcome": outcome, "exit_code": body and body["exit_code"],
            "usable_after": body is not None and s.attacker_usable(), **limits}


def vm_cgroup(s, sb):
    """The VM's cgroup directories {controller: path} (v1) or {"v2": path}."""
    node = s.node.node_id
    v2 = f"/sys/fs/cgroup/kiln/{node}/{sb['id']}"
    if os.path.isdir(v2) and os.path.exists(v2 + "/memory.max"):
        return {"v2": v2}
    got = {c: f"/sys/fs/cgroup/{c}/kiln/{node}/{sb['id']}" for c in ("memory", "pids")}
    for c, p in got.items():
        check(os.path.isdir(p), f"no {c} cgroup at {p}")
    return got


def check_caps(s, limits):
    """The VM's cgroup caps are there and as docs/vmm.md says (guest memory + 128 MiB + the TCG
    translation cache; 256 pids), and its use stayed within them."""
    check(limits["mem_max"] <= (s.memory_mib + 128 + 64) * MIB, f"QEMU's memory cap {limits}")
    check(limits["pids_max"] <= 256, f"QEMU's pids cap {limits}")
    check(limits["mem_peak"] <= limits["mem_max"], f"QEMU's memory {limits}")
    check(limits["pids"] <= limits["pids_max"], f"QEMU's pids {limits}")


def cgroup_limits(cg):
    def rd(p):
        with open(p) as f:
            v = f.read().split()[0]
        return 1 << 62 if v == "max" else int(v)
    if "v2" in cg:
        d = cg["v2"]
        peak = d + "/memory.peak"
        return {"mem_max": rd(d + "/memory.max"),
                "mem_peak": rd(peak) if os.path.exists(peak) else rd(d + "/memory.current"),
                "pids_max": rd(d + "/pids.max"), "pids": rd(d + "/pids.current")}
    return {"mem_max": rd(cg["memory"] + "/memory.limit_in_bytes"),
            "mem_peak": rd(cg["memory"] + "/memory.max_usage_in_bytes"),
            "pids_max": rd(cg["pids"] + "/pids.max"), "pids": rd(cg["pids"] + "/pids.current")}


def disk_fill(s, seconds):
    """A writes until its file system is full (ENOSPC inside the guest): its disk layer on the
    host stays within the qcow2 bound of its disk_gib; then A frees it and answers."""
    # a short run reserves all but 8 MiB first (fallocate writes nothing), so dd meets ENOSPC
    # within seconds under the I/O throttle; a long one writes every byte
    pre = ("fallocate -l $(( $(df -k --output=avail / | tail -n 1) * 1024 - (8 << 20) )) /root/fill0; "
           if seconds < 30 else "")
    try:
        out = s.sh(pre + "dd if=/dev/zero of=/root/fill bs=1M 2>&1 | grep -c 'No space left'; "
                   "df -k / | tail -n 1", seconds=max(seconds, 300))
        check(out["stdout"].split("\n")[0] == "1", f"dd did not fill the disk: {out}")
        layer = os.path.join(s.state_dir(s.a), "disk.qcow2")
        size = os.stat(layer).st_blocks * 512
        gib = s.gw.request("GET", f"/v1/sandboxes/{s.a['id']}", headers=s.key_a).json().get("disk_gib", 10)
        check(size <= qcow2_bound(gib << 30), f"A's layer takes {size} bytes on the host")
    finally:
        s.sh("rm -f /root/fill /root/fill0; sync")
    check(s.attacker_usable(), "A no longer answers after its disk filled")
    return {"layer_bytes": size, "df": out["stdout"].splitlines()[-1]}


def disk_io(s, seconds):
    """A writes with O_DIRECT (what the throttle lets through in `seconds`) while it reads its
    disk as fast as it can: both together stay within the throttle (disk_mibps_per_vcpu) and B
    keeps answering. The writer is not interrupted: a signal that reached dd before its handler
    (a slow start on a loaded host) would leave no report to read."""
    out = s.sh(f"(timeout -s INT {seconds} dd if=/dev/vda of=/dev/null bs=1M iflag=direct 2>/dev/null &); "
               f"dd if=/dev/zero of=/root/io bs=1M count={DISK_MIBPS * seconds} oflag=direct 2>&1 "
               "| tail -n 1; rm -f /root/io; sync", seconds=seconds + 120)
    line = out["stdout"].strip()
    # busybox or coreutils: "N bytes ... copied, S s, R MB/s"
    try:
        nbytes = int(line.split()[0])
        took = float(line.split("copied, ")[1].split()[0])
    except (ValueError, IndexError):
        raise Broken(f"cannot read dd's report: {out}")
    rate = nbytes / took / MIB
    check(rate <= DISK_MIBPS * 1.5, f"A wrote {rate:.1f} MiB/s past the {DISK_MIBPS} MiB/s throttle")
    check(nbytes > 0, "A wrote nothing: the attack proves nothing")
    return {"write_mibps": round(rate, 1), "throttle_mibps": DISK_MIBPS}


FLOOD_SH = r'''
port=
for p in /sys/class/virtio-ports/*; do
  [ "$(cat $p/name 2>/dev/null)" = kiln.agent ] && port=/dev/${p##*/}
done
[ -n "$port" ] || { echo "no agent port"; exit 1; }
echo "$port" > /root/agent-port
cat > /root/flood.py <<'EOF'
import os, struct, sys, time, errno, subprocess
port, seconds = sys.argv[1], float(sys.argv[2])
time.sleep(1)
def run(*a):
    try:
        return subprocess.run(a).returncode
    except FileNotFoundError:
        return subprocess.run(("busybox",) + a).returncode
def kill_agents():
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open("/proc/%s/comm" % p).read().strip() == "kiln-agent":
                os.kill(int(p), 9)
        except OSError:
            pass
# the agent goes and stays gone: init's respawns run true
run("mount", "--bind", "/bin/true", "/usr/local/bin/kiln-agent")
fd = -1
for i in range(400):
    kill_agents()
    try:
        fd = os.open(port, os.O_RDWR | os.O_NONBLOCK)
        break
    except OSError as e:
        time.sleep(0.02)
def say(msg):
    with open("/dev/ttyS0", "w") as c:
        c.write("\nkiln-flood-%s\n" % msg)
if fd < 0:
    say("noport")
    sys.exit(1)
say("start")
def put(b, until):
    off = 0
    while off < len(b) and time.time() < until:
        try:
            off += os.write(fd, b[off:])
        except BlockingIOError:
            time.sleep(0.001)
        except OSError:
            return off
    return off
MAGIC = 0x4B4C4E41
def hdr(typ, rid, n, magic=MAGIC, ver=1, flags=0):
    return struct.pack(">IBBHII", magic, ver, typ, flags, rid, n)
half = time.time() + seconds / 2
end = time.time() + seconds
n = [0, 0, 0]
# 1: well-formed 1 MiB STDOUT frames for an id nobody waits for: read and dropped by the host
chunk = hdr(0x84, 0x7ffffff0, 1 << 20) + os.urandom(1 << 20)
while time.time() < half:
    n[0] += put(chunk, half)
# 2: oversized (4 GiB), then malformed (bad magic, version, a host-only type), then garbage
for b in (hdr(0x84, 0x7ffffff1, 0xffffffff), hdr(0x84, 1, 16, magic=0xdeadbeef), hdr(0x84, 1, 16, ver=9),
          hdr(0x02, 1, 0), hdr(0x86, 0, 1 << 21)):
    n[1] += put(b, end)
junk = os.urandom(1 << 16)
while time.time() < end:
    w = put(junk, end)
    n[2] += w
    if w == 0:
        time.sleep(0.01)
say("done %d %d %d" % tuple(n))
EOF
setsid nohup python3 /root/flood.py "$port" SECONDS >/dev/null 2>&1 < /dev/null &
echo launched
'''


def agent_flood(s, seconds):
    """A's root kills the guest agent, keeps it from respawning, takes its channel and writes
    well-formed frames for nobody, a 4 GiB length, bad magic, a bad version, host-only types and
    random bytes into it. The node drops or refuses every frame in bounded memory and stays up;
    by the contract (docs/agent-protocol.md) A's connection ends, its next exec answers 502
    `sandbox_failed` and it shows state `error`; it can still be deleted. B is untouched."""
    pid = s.node.proc.pid
    base = rss_kib(pid)
    peak = [base]
    console = os.path.join(s.state_dir(s.a), "serial.log")
    out = s.sh(FLOOD_SH.replace("SECONDS", str(seconds)))
    check(out["stdout"].strip().endswith("launched"), f"the flood did not start: {out}")
    # the flooder says on the console when it holds the channel and when it is done
    end = time.monotonic() + seconds + 180
    said, done = "", None
    while time.monotonic() < end and not done and "kiln-flood-noport" not in said:
        peak[0] = max(peak[0], rss_kib(pid))
        time.sleep(0.1)
        said = ""
        for f in (console + ".old", console):
            if os.path.exists(f):
                with open(f, errors="replace") as fh:
                    said += fh.read()
        # whole lines only: the console may be read in the middle of one
        done = re.search(r"kiln-flood-done (\d+) (\d+) (\d+)\r?\n", said)
    check("kiln-flood-start" in said, "the flooder never held the agent channel")
    check(done, "the flooder did not finish")
    sent = done.groups()
    check(s.node.alive(), "kiln-node died during the agent-channel flood:\n" + s.node.output()[-3000:])
    grew = (peak[0] - base) << 10
    check(grew < 64 * MIB, f"kiln-node's RSS grew {grew >> 20} MiB during the flood")
    r = s.exec(s.a, s.key_a, {"cmd": ["echo", "up"]}, timeout=120)
    check(r.status == 502 and r.json()["error"]["code"] == "sandbox_failed",
          f"A's exec after the flood answered {r} (the contract: 502 sandbox_failed)")
    st = s.gw.request("GET", f"/v1/sandboxes/{s.a['id']}", headers=s.key_a).json()["state"]
    check(st == "error", f"A's state after the flood is {st}, not error")
    r = s.gw.request("DELETE", f"/v1/sandboxes/{s.a['id']}", None, s.key_a, timeout=120)
    check(r.status == 204, f"deleting the failed A answered {r}")
    check(s.node.alive(), "kiln-node died deleting the flooded sandbox")
    return {"node_rss_growth_mib": round(grew / MIB, 1), "a_state": st,
            "bytes_dropped_frames": int(sent[0]), "bytes_bad_frames": int(sent[1]),
            "bytes_garbage": int(sent[2])}


# in the order they run: the destructive ones last
ATTACKS = [
    ("reach_host_services", reach_host_services),
    ("spoof_mac_ip", spoof),
    ("dns_flood", dns_flood),
    ("console_flood", console_flood),
    ("disk_fill", disk_fill),
    ("disk_io", disk_io),
    ("memory_fill", memory_fill),
    ("fork_bomb", fork_bomb),
    ("agent_flood", agent_flood),
]


def run_attack(s, prober, name, fn, seconds):
    """Runs one attack, then checks the neighbour's window and that B is unchanged. Returns
    (start, end, figures); raises Broken on any finding."""
    if not s.attacker_usable():
        s.fresh_attacker()
    start = time.monotonic()
    figures = fn(s, seconds)
    end = time.monotonic()
    time.sleep(0.5)
    window_checks(prober, start, end)
    after = s.neighbour_state()
    check(after == s.b_before, f"the neighbour changed: {s.b_before} -> {after}")
    check(s.gw.request("GET", "/healthz").status == 200, "/healthz after the attack")
    return start, end, figures
