"""A hostile guest against the node's resources: a console written without end stays capped on disk
and off /run, an exec of 50 MiB of control bytes is cut in bounded node memory, execs at once are
bounded per sandbox and per tenant (429 naming the limit), the node's exec output memory is bounded
in all (node_exec_memory_max: the exec over it cut, the next one 429, all of it back afterwards),
disk I/O is held to its throttle while a neighbour still answers, and memory the guest frees goes
back to the host (free page reporting), from a sandbox of the template too, whose shared memory
image stays whole."""
import glob
import os
import re
import subprocess
import sys
import threading
import time
import unittest

import kiln
from test_sandboxes import sse_events

CONSOLE_MAX = 256 << 10
DISK_MIBPS = 4
OUTPUT_MAX = 10 << 20	# exec_output_max's default
# node_exec_memory_max: above what the 50 MiB exec needs (twice its 10 MiB and 1 MiB buffers, the
# reply's copy), below two 9 MiB execs (twice a 10 MiB buffer each)
EXEC_MEMORY_MAX = 32 << 20


tree_bytes = kiln.tree_bytes


def qemu_pid(sb_id):
    """The pid of the QEMU running sandbox `sb_id`."""
    out = subprocess.run(["pgrep", "-f", sb_id], capture_output=True, text=True).stdout
    for p in out.split():
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].endswith(b"qemu-system-x86_64"):
                    return int(p)
        except FileNotFoundError:
            pass
    raise AssertionError(f"no qemu for {sb_id}")


def guest_ram_rss_kib(pid, mem_mib):
    """Rss of the QEMU's mapping of its guest memory file (the one of the guest's size)."""
    size, found = None, None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            k = line.split()
            if len(k) >= 6 and "-" in k[0] and k[5].endswith("mem"):
                size = "mem"
            elif k and k[0] == "Size:" and size == "mem":
                size = int(k[1])
            elif k and k[0] == "Rss:" and size == mem_mib << 10:
                found = int(k[1])
                size = None
            elif len(k) >= 1 and "-" in k[0]:
                size = None
    assert found is not None, f"no guest memory mapping in /proc/{pid}/smaps"
    return found


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# 160 MiB written page by page, held 8 s, freed as Python exits
BURST = {"cmd": ["python3", "-c", "import time; b = b'x' * (160 << 20); time.sleep(8); print(len(b) >> 20)"],
         "timeout_s": 120}


def assert_burst_given_back(case, pid, mem_mib, run):
    """Runs BURST through `run(body)` (an exec's Response) while reading the guest RAM QEMU `pid`
    holds on the host: it must grow by more than 120 MiB and fall back to within a quarter of that
    growth within 30 s of the exec's end."""
    base = peak = guest_ram_rss_kib(pid, mem_mib)
    res = []
    t = threading.Thread(target=lambda: res.append(run(BURST)))
    t.start()
    while t.is_alive():
        peak = max(peak, guest_ram_rss_kib(pid, mem_mib))
        time.sleep(0.5)
    t.join()
    case.assertEqual(len(res), 1, "the burst's exec raised")
    case.assertEqual((res[0].status, res[0].json()["stdout"]), (200, "160\n"), res[0].data[:500])
    case.assertGreater(peak - base, 120 << 10, f"the guest's RAM never grew: {base} -> {peak} KiB")
    deadline = time.monotonic() + 30
    now = peak
    while time.monotonic() < deadline and now - base >= (peak - base) // 4:
        time.sleep(1)
        now = guest_ram_rss_kib(pid, mem_mib)
    case.assertLess(now - base, (peak - base) // 4, f"base {base}, peak {peak}, 30 s later {now} KiB")


class VmResourceTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        asan = os.environ.get("ASAN_OPTIONS", "")
        cls.stack = kiln.Stack(node_env={
            "KILN_CONSOLE_MAX_BYTES": str(CONSOLE_MAX),
            "KILN_EXEC_MAX_PER_SANDBOX": "2",
            "KILN_EXEC_MAX_PER_TENANT": "3",
            "KILN_NODE_EXEC_MEMORY_MAX": str(EXEC_MEMORY_MAX),
            "KILN_DISK_MIBPS_PER_VCPU": str(DISK_MIBPS),
            "KILN_DISK_IOPS_PER_VCPU": "0",
            # a loaded host can take minutes to boot three guests under TCG
            "KILN_BOOT_TIMEOUT_S": "600",
            "KILN_FREE_PAGE_REPORTING": "1",
            # freed memory goes back at once: the node's RSS then shows what it holds
            "ASAN_OPTIONS": (asan + ":" if asan else "") + "quarantine_size_mb=1",
        })
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("acme")
        cls.other = cls.stack.tenant("beta")
        cls.a = cls.create(cls.key)
        cls.b = cls.create(cls.key)
        cls.c = cls.create(cls.other)

    @classmethod
    def create(cls, key):
        r = cls.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "timeout_s": 3600}, key,
                           timeout=300)
        assert r.status == 201, r
        return r.json()

    def exec(self, sb, key, body, timeout=300):
        return self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", body, key, timeout=timeout)

    def ok_exec(self, sb, key, body, timeout=300):
        r = self.exec(sb, key, body, timeout)
        self.assertEqual(r.status, 200, r.data[:500])
        return r.json()

    def state_dir(self, sb):
        dirs = glob.glob(f"{self.stack.node.data_dir}/vms/*/{sb['id']}")
        self.assertEqual(len(dirs), 1, dirs)
        return dirs[0]

    def put_file(self, sb, key, path, data=b""):
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/files?path={path}", data, key)
        self.assertEqual(r.status, 204, r.data[:300])

    def in_thread(self, fn, *args):
        """Runs fn(*args) in a thread, started; returns the thread."""
        t = threading.Thread(target=fn, args=args)
        t.start()
        return t

    def test_console_flood_stays_capped_on_disk_and_off_run(self):
        sb = self.a
        log = os.path.join(self.state_dir(sb), "serial.log")
        run_before = tree_bytes(self.stack.node.run_dir)
        out = self.ok_exec(sb, self.key, {"cmd": ["sh", "-c", "timeout 20 sh -c 'yes kiln-console-flood > /dev/ttyS0'; echo done"],
                                          "timeout_s": 120})
        self.assertEqual(out["stdout"], "done\n", out)
        size = os.path.getsize(log)
        old = os.path.getsize(log + ".old") if os.path.exists(log + ".old") else 0
        # the flood wrote far more than the cap: it rotated, and the two files hold at most the cap
        self.assertGreater(old, 0, "the console never reached its cap: the test proves nothing")
        self.assertLessEqual(size + old, CONSOLE_MAX)
        with open(log, "rb") as f:
            self.assertIn(b"kiln-console-flood\r\n", f.read())	# the tty's ONLCR
        # nothing of it landed under /run (the node's run dir holds sockets and jails only)
        self.assertLessEqual(tree_bytes(self.stack.node.run_dir), run_before + (64 << 10))
        t0 = time.monotonic()
        out = self.ok_exec(sb, self.key, {"cmd": ["echo", "still here"]}, timeout=60)
        self.assertEqual(out["stdout"], "still here\n")
        self.assertLess(time.monotonic() - t0, 30)

    def test_fifty_mib_of_control_bytes_are_cut_in_bounded_memory(self):
        pid = self.stack.node.proc.pid
        base = rss_kib(pid)
        peak = [base]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(pid))
                time.sleep(0.02)

        t = threading.Thread(target=sample)
        t.start()
        try:
            r = self.exec(self.b, self.key, {"cmd": ["sh", "-c", "head -c 50M /dev/zero; printf '\\001%.0s' $(seq 1 100000) >&2"],
                                             "timeout_s": 600}, timeout=900)
        finally:
            done.set()
            t.join()
        self.assertEqual(r.status, 200, r.data[:300])
        body = r.json()
        self.assertEqual(body["exit_code"], 0)
        self.assertTrue(body["stdout_truncated"])
        # NUL becomes U+FFFD; the cap is on the JSON text: 3 bytes a character
        self.assertEqual(set(body["stdout"]), {"\ufffd"})
        self.assertLessEqual(len(body["stdout"].encode()), OUTPUT_MAX)
        self.assertGreater(len(body["stdout"].encode()), OUTPUT_MAX - 16)
        # \u0001 is six bytes of JSON text: 100000 of them fit whole
        self.assertEqual(body["stderr"], "\x01" * 100000)
        self.assertFalse(body["stderr_truncated"])
        self.assertLessEqual(len(r.data), 2 * OUTPUT_MAX + 512)
        # documented bound: 4 x exec_output_max, plus the agent client's queue (4 MiB + a frame)
        grew = (peak[0] - base) << 10
        self.assertLess(grew, 4 * OUTPUT_MAX + (8 << 20), f"node RSS grew {grew >> 20} MiB")

    def test_output_is_encoded_exactly_in_json_and_across_streamed_chunks(self):
        script = "printf 'a\"b\\\\c\\t\\001\\303\\251\\377\\000z'"
        out = self.ok_exec(self.b, self.key, {"cmd": ["sh", "-c", script]})
        self.assertEqual(out["stdout"], 'a"b\\c\t\x01\u00e9\ufffd\ufffdz')
        self.assertFalse(out["stdout_truncated"])
        # a UTF-8 sequence split across two writes (two chunks) comes out whole
        events = list(sse_events(self.gw, f"/v1/sandboxes/{self.b['id']}/exec",
                                 {"cmd": ["sh", "-c", "printf '\\342\\202'; sleep 1; printf '\\254 euro\\n'"]},
                                 self.key))
        self.assertEqual(events[-1][1], "exit")
        self.assertEqual("".join(d["data"] for _, e, d in events if e == "stdout"), "\u20ac euro\n")

    def wait_file(self, sb, key, path, thread, what):
        """Until `path` exists in `sb` (its exec in `thread` made it); fails if the exec ended."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and thread.is_alive():
            if self.file_exists(sb, key, path):
                return
            time.sleep(0.3)
        self.fail(f"{what} never made {path}")

    def test_too_many_execs_at_once_get_429_naming_the_limit(self):
        results = []
        # each exec says it runs, then runs on until the test lets it end (at most 120 s)
        hold = ("touch /tmp/slot-{n}; i=0; while [ ! -e /tmp/go ] && [ $i -lt 600 ]; do sleep 0.2; "
                "i=$((i+1)); done")

        def run(sb, key, n):
            results.append(self.exec(sb, key, {"cmd": ["sh", "-c", hold.format(n=n)]}, timeout=200).status)

        threads = []
        for n, sb in enumerate((self.a, self.a, self.b)):
            threads.append(self.in_thread(run, sb, self.key, n))
            self.wait_file(sb, self.key, f"/tmp/slot-{n}", threads[-1], f"exec {n}")
        try:
            r = self.exec(self.a, self.key, {"cmd": ["true"]})
            self.assertEqual(r.status, 429, r.data)
            self.assertEqual(r.json()["error"]["code"], "rate_limited")
            self.assertIn("exec_max_per_sandbox", r.json()["error"]["message"])
            self.assertEqual(r.headers.get("Retry-After"), "1", r.headers)   # the node's, passed on
            r = self.exec(self.b, self.key, {"cmd": ["true"]})
            self.assertEqual(r.status, 429, r.data)
            self.assertIn("exec_max_per_tenant", r.json()["error"]["message"])
            # another tenant is not held back
            out = self.ok_exec(self.c, self.other, {"cmd": ["echo", "neighbour"]}, timeout=60)
            self.assertEqual(out["stdout"], "neighbour\n")
        finally:
            for sb in (self.a, self.b):
                self.put_file(sb, self.key, "/tmp/go")
            for t in threads:
                t.join()
        self.assertEqual(results, [200, 200, 200])
        # the slots come back once those ended
        self.assertEqual(self.ok_exec(self.a, self.key, {"cmd": ["true"]})["exit_code"], 0)

    def file_exists(self, sb, key, path):
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/files?path={path}", None, key)
        self.assertIn(r.status, (200, 404), r.data[:300])
        return r.status == 200

    def test_node_exec_memory_is_bounded_in_all_and_comes_back(self):
        """Execs that each keep 9 MiB of output: the first is held whole (20 MiB of the 32 MiB budget:
        twice its 10 MiB buffer), the second is cut where the budget ends (its output marked
        truncated), the third is refused 429 naming node_exec_memory_max; the node's RSS stays
        within the budget; when they end all of it comes back."""
        pid = self.stack.node.proc.pid
        big = 9 << 20
        base = rss_kib(pid)
        peak = [base]
        done = threading.Event()
        results = {}

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(pid))
                time.sleep(0.02)

        def held(name, sb):
            # print, let the node take it all in, say so, then keep it held until the test has
            # seen what it holds (at most 120 s)
            cmd = (f"head -c {big} /dev/zero | tr '\\0' x; sleep 5; touch /tmp/held-{name}; i=0; "
                   f"while [ ! -e /tmp/release ] && [ $i -lt 600 ]; do sleep 0.2; i=$((i+1)); done; "
                   f"rm -f /tmp/held-{name}")
            results[name] = self.exec(sb, self.key, {"cmd": ["sh", "-c", cmd], "timeout_s": 300}, timeout=400)

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = []
        try:
            for name, sb in (("first", self.a), ("second", self.b)):
                threads.append(self.in_thread(held, name, sb))
                self.wait_file(sb, self.key, f"/tmp/held-{name}", threads[-1], f"exec {name}")
            # two execs of the tenant run (under its limit of 3): the budget, not the count, refuses
            r = self.exec(self.a, self.key, {"cmd": ["echo", "third"]}, timeout=60)
            self.assertEqual(r.status, 429, r.data[:300])
            self.assertEqual(r.json()["error"]["code"], "rate_limited")
            self.assertIn("node_exec_memory_max", r.json()["error"]["message"])
            # a streamed exec's window counts in the same budget: refused too, before it streams
            r = self.gw.request("POST", f"/v1/sandboxes/{self.a['id']}/exec", {"cmd": ["echo", "third"]},
                                dict(self.key, Accept="text/event-stream"), timeout=60)
            self.assertEqual(r.status, 429, r.data[:300])
            self.assertIn("node_exec_memory_max", r.json()["error"]["message"])
        finally:
            for sb in (self.a, self.b):
                self.put_file(sb, self.key, "/tmp/release")
            for t in threads:
                t.join()
            done.set()
            sampler.join()
        first, second = results["first"], results["second"]
        self.assertEqual(first.status, 200, first.data[:300])
        self.assertEqual(second.status, 200, second.data[:300])
        first, second = first.json(), second.json()
        self.assertEqual((first["exit_code"], second["exit_code"]), (0, 0))
        self.assertFalse(first["stdout_truncated"])
        self.assertEqual(first["stdout"], "x" * big)
        # cut where the budget ended: the first bytes kept, marked as exec_output_max marks a cut
        self.assertTrue(second["stdout_truncated"])
        self.assertGreater(len(second["stdout"]), 1 << 20)
        self.assertLess(len(second["stdout"]), big)
        self.assertEqual(set(second["stdout"]), {"x"})
        # the node held no more than the budget, plus the agent client's queues (4 MiB and a
        # 1 MiB frame per exec) and some slack for its threads
        grew = (peak[0] - base) << 10
        print(f"node RSS grew {grew / (1 << 20):.1f} MiB at most; the cut exec kept "
              f"{len(second['stdout']) / (1 << 20):.2f} MiB", file=sys.stderr)
        self.assertLess(grew, EXEC_MEMORY_MAX + 2 * (5 << 20) + (8 << 20), f"node RSS grew {grew >> 20} MiB")

        # all of it came back: two execs that need 30 MiB of the 32 MiB at once both run whole
        def whole(name, sb, n):
            results[name] = self.exec(sb, self.key, {"cmd": ["sh", "-c", f"head -c {n} /dev/zero | tr '\\0' y"],
                                                     "timeout_s": 300}, timeout=400)

        again = [threading.Thread(target=whole, args=("again9", self.a, big)),
                 threading.Thread(target=whole, args=("again4", self.b, 4 << 20))]
        for t in again:
            t.start()
        for t in again:
            t.join()
        for name, n in (("again9", big), ("again4", 4 << 20)):
            r = results[name]
            self.assertEqual(r.status, 200, r.data[:300])
            self.assertFalse(r.json()["stdout_truncated"], name)
            self.assertEqual(len(r.json()["stdout"]), n)

    def test_the_guest_reports_free_blocks_of_64_kib(self):
        # page_reporting_order 4 (vmm/guest/initramfs-init), not the pageblock's 9 the kernel
        # resets it to when virtio_balloon registers: the memory below 16 MiB and smaller free
        # blocks go back too
        out = self.ok_exec(self.b, self.key, {"cmd": ["cat", "/sys/module/page_reporting/parameters/page_reporting_order"]})
        self.assertEqual(out["stdout"], "4\n", out)

    def test_memory_the_guest_frees_goes_back_to_the_host(self):
        # the guest has 256 MiB
        assert_burst_given_back(self, qemu_pid(self.b["id"]), 256,
                                lambda body: self.exec(self.b, self.key, body, timeout=180))

    def test_disk_io_is_held_to_its_throttle_while_a_neighbour_answers(self):
        qemu = subprocess.run(["pgrep", "-f", f"{self.c['id']}"], capture_output=True, text=True)
        cmdlines = []
        for p in qemu.stdout.split():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmdlines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except FileNotFoundError:
                pass
        self.assertTrue(any(f"x-bps-total={DISK_MIBPS << 20}" in c for c in cmdlines), cmdlines)
        limit = DISK_MIBPS << 20
        for mode in (["oflag=direct"], ["conv=fsync"]):
            with self.subTest(mode=mode[0]):
                lat = []

                def neighbour():
                    time.sleep(2)
                    t0 = time.monotonic()
                    out = self.ok_exec(self.a, self.key, {"cmd": ["echo", "ok"]}, timeout=60)
                    lat.append((time.monotonic() - t0, out["stdout"]))

                t = threading.Thread(target=neighbour)
                t.start()
                cmd = f"dd if=/dev/zero of=/root/dd.bin bs=1M count=32 {mode[0]} 2>/dev/null; rm -f /root/dd.bin; sync"
                t0 = time.monotonic()
                out = self.ok_exec(self.c, self.other, {"cmd": ["sh", "-c", cmd], "timeout_s": 300}, timeout=400)
                took = time.monotonic() - t0
                t.join()
                self.assertEqual(out["exit_code"], 0, out)
                rate = (32 << 20) / took
                self.assertLessEqual(rate, limit * 1.5, f"{rate / (1 << 20):.1f} MiB/s over {took:.1f} s")
                self.assertGreater(took, 4)
                self.assertEqual(lat[0][1], "ok\n")
                self.assertLess(lat[0][0], 30)


def image_fd_flags(pid, path):
    """The open flags of QEMU `pid`'s descriptors of the file at `path` (by device and inode)."""
    want = os.stat(path)
    flags = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags += [int(line.split()[1], 8) for line in f if line.startswith("flags:")]
    return flags


def sha256_of(path):
    out = subprocess.run(["sha256sum", path], capture_output=True, text=True, check=True).stdout
    return out.split()[0]


class TemplateReportingTests(unittest.TestCase):
    """Free page reporting in sandboxes made from the template: each maps the template's memory
    image privately, read-only (vmm/qemu_memro.c), gives back what its guest frees, and never
    touches the image every other sandbox of the template maps (QEMU 7.2 punched the pages it
    discarded out of the file, a private map or not)."""

    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env={"KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
                                         "KILN_TEMPLATE_WARM_VMS": "1",
                                         "KILN_FREE_PAGE_REPORTING": "1",
                                         "KILN_BOOT_TIMEOUT_S": "600"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def template_image(self, timeout=600):
        """The default template's id and memory image, once the node says it is ready (its row is
        written before that, when a create still boots cold; the code interpreter's template is
        another)."""
        node = self.stack.node
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(r'template "(snap_[a-z0-9]+)" of \d+ mvCPU, \d+ MiB ready', node.output())
            if m:
                return m.group(1), f"{node.data_dir}/snaps/{node.node_id}/{m.group(1)}/mem"
            time.sleep(1)
        raise AssertionError("no template was built:\n" + node.output()[-3000:])

    def create(self):
        r = self.gw.request("POST", "/v1/sandboxes", {"timeout_s": 900}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sid = r.json()["id"]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sid}", None, self.key)
        return sid

    def exec(self, sid, cmd, timeout=300):
        r = self.gw.request("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": cmd, "timeout_s": timeout - 60},
                            self.key, timeout=timeout)
        self.assertEqual(r.status, 200, r.data[:500])
        return r.json()

    def test_a_sandbox_of_the_template_gives_freed_memory_back_and_leaves_the_image_whole(self):
        node = self.stack.node
        tpl, image = self.template_image()
        before = (sha256_of(image), os.stat(image).st_blocks)
        sid = self.create()
        self.assertEqual(self.stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes "
                                           f"WHERE id = '{sid}'"), tpl)
        pids = [p for p in kiln.vm_pids(node.node_id, sid) if os.path.exists(f"/proc/{p}")]
        self.assertEqual(len(pids), 1, pids)
        pid = pids[0]
        # the template's own image, mapped: opened read-only, never for writing
        flags = image_fd_flags(pid, image)
        self.assertTrue(flags, f"QEMU {pid} has no descriptor of the template's image {image}")
        self.assertEqual([f & os.O_ACCMODE for f in flags], [os.O_RDONLY] * len(flags), flags)
        mem_mib = int(self.stack.db.sql(f"SELECT memory_mib FROM sandboxes WHERE id = '{sid}'"))
        # a discarded page reads back as the image's, not as zeros: the guest kernel must not
        # take a freed page as zeroed (init_on_free off, as Debian's kernel has it)
        self.assertIn("heap free:off", self.exec(sid, ["sh", "-c", "dmesg | grep 'mem auto-init'"])["stdout"])
        assert_burst_given_back(self, pid, mem_mib, lambda body: self.gw.request(
            "POST", f"/v1/sandboxes/{sid}/exec", body, self.key, timeout=180))
        # the pages went from this VM's private copy only: the image is as it was
        self.assertEqual((sha256_of(image), os.stat(image).st_blocks), before)
        # and another sandbox of the template runs from it
        other = self.create()
        self.assertEqual(self.exec(other, ["python3", "-c", "print(6 * 7)"])["stdout"], "42\n")
        self.assertEqual(self.exec(sid, ["python3", "-c", "print(6 * 7)"])["stdout"], "42\n")
        # VMMs are started ahead with the balloon too
        self.assertRegex(node.output(), r'VMM "0[a-z2-7]{12}" started ahead')

    def test_a_node_refuses_init_on_free_with_the_balloon(self):
        img = kiln.guest_image()
        env = {"PATH": os.environ["PATH"], "KILN_FREE_PAGE_REPORTING": "1",
               "KILN_GUEST_CMDLINE": "root=/dev/vda rootfstype=ext4 rw init_on_free=1"}
        env.update({k: img[k] for k in ("KILN_GUEST_KERNEL", "KILN_GUEST_INITRD", "KILN_GUEST_ROOTFS")})
        r = subprocess.run([os.path.join(kiln.BUILD, "node", "kiln-node")], env=env, capture_output=True,
                           text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn('setting "guest_cmdline": init_on_free with free_page_reporting', r.stderr)


if __name__ == "__main__":
    unittest.main()
