"""test_clockstep.py - kiln-node's waits when the node's wall clock steps.

The heartbeat (node/main.c heartbeat_main) waits for each beat on a condition of CLOCK_MONOTONIC,
so a step of the wall clock (NTP, an operator) neither stalls it (a backward step) nor bunches
its beats (a forward one). On a wall-clock wait, a backward step of an hour stops the beats for
that hour and gets a live node marked down after node_down_after_s. A template build's bound,
template_build_max_s (node/build.c build_left_ms), is measured on CLOCK_MONOTONIC too: a backward
step does not stretch it by the step.

Only the kiln-node under test has its wall clock stepped, never the host's: it runs under
libfaketime (Debian package libfaketime, scripts/deps), which reads its offset from a file of the
test's own on every call (FAKETIME_TIMESTAMP_FILE with FAKETIME_NO_CACHE=1) and leaves
CLOCK_MONOTONIC alone (FAKETIME_DONT_FAKE_MONOTONIC=1). The programs the node starts inherit the
preload but keep the host's clock (FAKETIME_ONLY_CMDS=kiln-node). Postgres, whose now() writes
heartbeat_at, keeps the host's clock too, so the beats are timed on a clock the step does not
touch: a trigger of the test's database logs each one.
"""
import io
import os
import subprocess
import tarfile
import tempfile
import time
import unittest
from email.utils import parsedate_to_datetime

import kiln

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"  # the threaded build
DOWN_AFTER_S = 5  # a beat every node_down_after_s / 5: 1 s
PERIOD_S = DOWN_AFTER_S / 5
STEP_S = 3600
BEFORE_S = 3  # beats watched before the step
AFTER_S = 6  # and after it
BUILD_MAX_S = 10  # template_build_max_s, its least


def faketime_env(rc_file):
    """The settings that run a program under libfaketime with its offset read from `rc_file`."""
    env = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME_TIMESTAMP_FILE": rc_file, "FAKETIME_NO_CACHE": "1",
           "FAKETIME_DONT_FAKE_MONOTONIC": "1", "FAKETIME_ONLY_CMDS": "kiln-node",
           # libfaketime 0.9.10 turns its "monotonic fix" on by itself on this glibc (2.36); with it,
           # it takes every pthread_cond_timedwait deadline for one on CLOCK_REALTIME, so a wait on
           # a CLOCK_MONOTONIC condition returns at once and the heartbeat would spin.
           "FAKETIME_FORCE_MONOTONIC_FIX": "0"}
    node = os.path.join(kiln.BUILD, "node", "kiln-node")
    ldd = subprocess.run(["ldd", node], check=True, capture_output=True, text=True).stdout
    if "libasan" in ldd:
        # `make test`'s build (AddressSanitizer, its runtime a shared library): the preload comes
        # before that runtime, which it refuses unless told not to check. Preloading the runtime
        # as well is not an option: every program the node starts would then load it too, and a
        # program built without it hangs at its start.
        opts = os.environ.get("ASAN_OPTIONS", "")
        env["ASAN_OPTIONS"] = (opts + ":" if opts else "") + "verify_asan_link_order=0"
    return env


def step_to(rc_file, offset):
    """The node's wall clock `offset` ("+0", "-3600") from the host's, from its next reading on:
    written whole (renamed into place), as the library reads the file at any moment."""
    with open(rc_file + ".tmp", "w") as f:
        f.write(offset + "\n")
    os.replace(rc_file + ".tmp", rc_file)


class ClockStepTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(FAKETIME_LIB):
            raise RuntimeError(f"{FAKETIME_LIB} is missing: install the Debian package libfaketime "
                               "(scripts/deps)")
        cls.db = kiln.fresh_database()
        cls.addClassCleanup(cls.db.drop)
        cls.gw = kiln.Gateway(cls.db.url, kiln.services_env()["KILN_REDIS_URL"])
        cls.addClassCleanup(cls.gw.cleanup)
        r = cls.gw.request("POST", "/v1/tenants", {"name": "clockstep"},
                           {"Authorization": "Bearer " + cls.gw.admin_key})
        assert r.status == 201, r
        cls.key = {"Authorization": "Bearer " + r.json()["api_key"]["key"]}

    def node_under_faketime(self, extra_env=None):
        """A kiln-node (no VM: its hostagent hook) whose wall clock follows a file of its own, at +0
        for now; the path of that file."""
        fd, rc_file = tempfile.mkstemp(prefix="kiln-faketime-", suffix=".rc")
        os.close(fd)
        self.addCleanup(lambda: [os.unlink(p) for p in (rc_file, rc_file + ".tmp") if os.path.exists(p)])
        step_to(rc_file, "+0")
        env = {"KILN_NODE_DOWN_AFTER_S": str(DOWN_AFTER_S)}
        env.update(extra_env or {})
        env.update(faketime_env(rc_file))
        node = kiln.Node(self.db.url, self.gw.url, env, hostagent=True)
        self.addCleanup(self.remove_faketime_shm, node.proc.pid)
        self.addCleanup(node.cleanup)
        return node, rc_file

    @staticmethod
    def remove_faketime_shm(pid):
        """The shared memory and semaphore libfaketime made for the node, which it removes at a
        clean exit but a node killed at the end of its stop's wait leaves."""
        for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
            if os.path.exists(os.path.join("/dev/shm", name)):
                os.unlink(os.path.join("/dev/shm", name))

    def log_beats(self, node_id):
        """From here on, every heartbeat_at the node writes, in the table beats_<node>."""
        self.db.sql(f"CREATE TABLE beats_{node_id} (at timestamptz NOT NULL); "
                    f"CREATE FUNCTION log_beat_{node_id}() RETURNS trigger LANGUAGE plpgsql AS "
                    f"$$BEGIN INSERT INTO beats_{node_id} VALUES (NEW.heartbeat_at); RETURN NEW; END$$; "
                    f"CREATE TRIGGER log_beat_{node_id} AFTER UPDATE OF heartbeat_at ON nodes FOR EACH ROW "
                    f"WHEN (NEW.id = '{node_id}') EXECUTE FUNCTION log_beat_{node_id}()")

    def beats(self, node_id):
        out = self.db.sql(f"SELECT extract(epoch FROM at) FROM beats_{node_id} ORDER BY at")
        return [float(x) for x in out.split()]

    def pg_now(self):
        return float(self.db.sql("SELECT extract(epoch FROM clock_timestamp())"))

    def node_wall_clock(self, node):
        """The node's wall clock as it reads it now, to the second: the Date of its answer."""
        out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-D", "-", "--unix-socket", node.sock,
                              "http://node/healthz"], check=True, capture_output=True, text=True,
                             timeout=10).stdout
        date = [line.split(":", 1)[1] for line in out.splitlines() if line.lower().startswith("date:")]
        self.assertTrue(date, out)
        return parsedate_to_datetime(date[0].strip()).timestamp()

    def assert_beats_through_step(self, offset, offset_s):
        node, rc_file = self.node_under_faketime()
        self.log_beats(node.node_id)
        time.sleep(BEFORE_S)
        step_to(rc_file, offset)
        stepped = self.pg_now()
        # The step is the node's: its wall clock now `offset_s` from the host's.
        seen = self.node_wall_clock(node) - time.time()
        self.assertLess(abs(seen - offset_s), 5, f"the node's wall clock is {seen:+.0f} s from the host's")
        time.sleep(AFTER_S)
        end = self.pg_now()
        self.assertTrue(node.alive(), node.output())

        beats = self.beats(node.node_id)
        before = [b for b in beats if b <= stepped]
        after = [b for b in beats if stepped < b <= end]
        self.assertGreaterEqual(len(before), BEFORE_S / PERIOD_S - 1, f"beats before the step: {before}")
        # No stall: no gap of three periods from the last beat before the step to the end of the
        # watch (a wall-clock wait that a backward step stretches stalls for the whole watch; one
        # beat late on a loaded host is not a stall).
        marks = before[-1:] + after + [end]
        gaps = [round(b - a, 3) for a, b in zip(marks, marks[1:])]
        figures = f"step {offset} s at {stepped:.3f}; beats after it at {[round(b - stepped, 3) for b in after]}; gaps {gaps}"
        print(figures)
        self.assertLessEqual(max(gaps), 3 * PERIOD_S, "the heartbeat stalled: " + figures)
        # No burst: at most one beat a period, and none hard on another's heels (a wall-clock
        # wait that a forward step ends at once beats twice within milliseconds). Each beat is due
        # at a fixed schedule, so one late beat does not move the next: it may come close to it,
        # not within a twentieth of a period.
        self.assertLessEqual(len(after), (end - stepped) / PERIOD_S + 1, "the heartbeat bunched: " + figures)
        self.assertGreaterEqual(min(gaps[:-1]), PERIOD_S / 20, "the heartbeat bunched: " + figures)

    def test_a_backward_step_does_not_stall_the_heartbeat(self):
        self.assert_beats_through_step(f"-{STEP_S}", -STEP_S)

    def test_a_forward_step_does_not_bunch_the_heartbeat(self):
        self.assert_beats_through_step(f"+{STEP_S}", STEP_S)

    def test_a_backward_step_does_not_stretch_a_template_build(self):
        # The build's builder is an ordinary sandbox of the base, here the build's kiln-agent run
        # on the host (no boot); its ready check, which never passes, is tried about once a second
        # until what is left of template_build_max_s (build_left_ms) is none.
        node, rc_file = self.node_under_faketime({"KILN_TEMPLATE_BUILD_MAX_S": str(BUILD_MAX_S)})
        # the only node placement may use (the other cases' nodes are stopped)
        self.db.sql(f"UPDATE nodes SET drain_at = now() WHERE id <> '{node.node_id}'")
        r = self.gw.request("POST", "/v1/templates", {"name": "n" + node.node_id, "vcpus": 1, "memory_mib": 512,
                                                      "disk_gib": 10, "ready_cmd": "false"}, self.key)
        self.assertEqual(r.status, 201, r)
        tmpl, version = r.json()["id"], r.json()["version"]
        r = self.gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile?version={version}", "FROM base\nENV A=b\n",
                            dict(self.key, **{"Content-Type": "text/plain"}))
        self.assertEqual(r.status, 204, r)
        started = time.monotonic()
        r = self.gw.request("PUT", f"/v1/templates/{tmpl}/source?version={version}", context_tar(),
                            dict(self.key, **{"Content-Type": "application/x-tar"}))
        self.assertEqual(r.status, 202, r)

        def log():
            return self.db.sql(f"SELECT string_agg(chunk, '' ORDER BY seq) FROM template_build_log "
                               f"WHERE template_id = '{tmpl}'")

        while "# ready check" not in log():
            self.assertLess(time.monotonic() - started, BUILD_MAX_S, "no ready check:\n" + log())
            time.sleep(0.2)
        step_to(rc_file, f"-{STEP_S}")
        stepped = time.monotonic() - started
        seen = self.node_wall_clock(node) - time.time()
        self.assertLess(abs(seen + STEP_S), 5, f"the node's wall clock is {seen:+.0f} s from the host's")
        # Over at template_build_max_s of its start, not an hour later: 15 s allowed beyond it for
        # the builder's start and a loaded host (11-13 s in all measured here).
        while self.db.sql(f"SELECT status FROM template_versions WHERE template_id = '{tmpl}'") == "building":
            self.assertLess(time.monotonic() - started, BUILD_MAX_S + 15,
                            f"still building {BUILD_MAX_S + 15} s after its start, the step at {stepped:.1f} s:\n"
                            + log())
            time.sleep(0.2)
        ended = time.monotonic() - started
        print(f"step at {stepped:.1f} s, the build over at {ended:.1f} s")
        self.assertEqual(self.db.sql(f"SELECT status, reason FROM template_versions WHERE template_id = '{tmpl}'"),
                         f"failed|the ready check did not pass within template_build_max_s ({BUILD_MAX_S} s)")
        self.assertGreaterEqual(ended, BUILD_MAX_S - 1)  # nor cut short


def context_tar():
    """A build context of one file (a tar in memory)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"b"))
    return buf.getvalue()


if __name__ == "__main__":
    unittest.main()
