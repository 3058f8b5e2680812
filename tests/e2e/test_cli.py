"""kiln, the command-line client, against a real gateway and kiln-node with a QEMU sandbox.

Every command a user types is run as a process and judged by its stdout, stderr and exit status:
create, list, get, exec (streamed output, the program's exit status as kiln's), run, put and cat
(binary bytes intact), egress, snapshot, pause and resume, timeout, balance, api and delete; and
the failures: a bad key, a wrong state, an unknown sandbox, a bad command line."""
import json
import os
import subprocess
import tempfile
import unittest

import kiln

KILN = os.path.join(kiln.BUILD, "cli", "kiln")


class CliTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        r = cls.stack.gw.request("POST", "/v1/tenants", {"name": "cli"}, cls.stack.admin)
        assert r.status == 201, r
        cls.key = r.json()["api_key"]["key"]

    def kiln(self, *args, key=None, stdin=None, status=0):
        env = dict(os.environ, KILN_URL=self.stack.gw.url, KILN_API_KEY=key or self.key)
        p = subprocess.run([KILN, *args], env=env, input=stdin, capture_output=True, timeout=600)
        self.assertEqual(p.returncode, status, f"kiln {' '.join(args)}: {p.stderr.decode(errors='replace')}")
        return p

    def test_a_users_session(self):
        sb = self.kiln("create", "--memory", "256", "--env", "GREETING=hello").stdout.decode().strip()
        self.assertTrue(sb.startswith("sb_"), sb)
        self.addCleanup(self.stack.gw.request, "DELETE", f"/v1/sandboxes/{sb}", None,
                        {"Authorization": "Bearer " + self.key})
        listed = self.kiln("list").stdout.decode()
        self.assertIn(sb, listed)
        self.assertIn("running", listed)
        got = json.loads(self.kiln("--json", "get", sb).stdout)
        self.assertEqual((got["id"], got["state"], got["memory_mib"]), (sb, "running", 256))

        # exec: both streams, and the program's exit status is kiln's
        p = self.kiln("exec", sb, "--", "sh", "-c", "echo out; echo $GREETING >&2; exit 3", status=3)
        self.assertEqual(p.stdout, b"out\n")
        self.assertEqual(p.stderr, b"hello\n")
        p = self.kiln("exec", sb, "--env", "X=1", "--cwd", "/tmp", "sh", "-c", "echo $X $(pwd)")
        self.assertEqual(p.stdout, b"1 /tmp\n")
        self.assertEqual(self.kiln("exec", sb, "no-such-program", status=127).stdout, b"")
        self.assertEqual(self.kiln("run", sb, "print(6 * 7)").stdout, b"42\n")
        self.assertEqual(self.kiln("run", sb, "-", stdin=b"import sys\nprint(sys.version_info[0])").stdout, b"3\n")
        self.assertEqual(self.kiln("run", sb, "--lang", "bash", "echo $((2 + 3))").stdout, b"5\n")

        # files: arbitrary bytes both ways
        blob = os.urandom(300_000) + b"\0tail"
        with tempfile.NamedTemporaryFile() as f:
            f.write(blob)
            f.flush()
            self.kiln("put", sb, f.name, "/root/blob with space.bin")
        self.assertEqual(self.kiln("cat", sb, "/root/blob with space.bin").stdout, blob)
        with tempfile.TemporaryDirectory() as d:
            self.kiln("cat", sb, "/root/blob with space.bin", os.path.join(d, "copy"))
            with open(os.path.join(d, "copy"), "rb") as f:
                self.assertEqual(f.read(), blob)
        p = self.kiln("cat", sb, "/root/absent", status=1)
        self.assertIn(b"not_found", p.stderr)

        # --user: exec, run, put and cat as the ordinary user
        p = self.kiln("exec", sb, "--user", "user", "sh", "-c", "id -u; echo $HOME; pwd")
        self.assertEqual(p.stdout, b"1000\n/home/user\n/home/user\n")
        self.assertEqual(self.kiln("run", sb, "--user", "user", "import os; print(os.getuid())").stdout, b"1000\n")
        self.assertEqual(self.kiln("exec", sb, "id", "-u").stdout, b"0\n")
        with tempfile.NamedTemporaryFile() as f:
            f.write(blob)
            f.flush()
            self.kiln("put", "--user", "user", sb, f.name, "/home/user/blob.bin")
        self.assertEqual(self.kiln("exec", sb, "stat", "-c", "%u:%g", "/home/user/blob.bin").stdout, b"1000:1000\n")
        self.assertEqual(self.kiln("cat", sb, "/home/user/blob.bin", "--user", "user").stdout, blob)
        p = self.kiln("exec", sb, "--user", "nosuchuser", "true", status=1)
        self.assertIn(b"invalid", p.stderr)
        self.assertIn(b"nosuchuser", p.stderr)
        p = self.kiln("put", "--user", "user", sb, "/etc/hostname", "/etc/kiln-cli-probe", status=1)
        self.assertIn(b"forbidden", p.stderr)
        p = self.kiln("cat", "--user", status=2)
        self.assertIn(b"--user", p.stderr)

        # egress: set, show, reopen
        self.assertIn(b"mode: allowlist\nexample.com\n", self.kiln("egress", sb, "example.com").stdout)
        self.assertIn(b"example.com", self.kiln("egress", sb).stdout)
        p = self.kiln("egress", sb, "not a rule!", status=1)
        self.assertIn(b"invalid", p.stderr)
        self.assertEqual(self.kiln("egress", sb, "open").stdout, b"mode: open\n")

        # snapshot, pause, resume, timeout
        snap = self.kiln("snapshot", sb, "before").stdout.decode().strip()
        self.assertTrue(snap.startswith("snap_"), snap)
        self.assertEqual(self.kiln("pause", sb).stdout.decode(), f"{sb}\tpaused\n")
        p = self.kiln("exec", sb, "true", status=1)
        self.assertIn(b"conflict", p.stderr)
        self.assertEqual(self.kiln("resume", sb).stdout.decode(), f"{sb}\trunning\n")
        self.assertEqual(self.kiln("cat", sb, "/root/blob with space.bin").stdout, blob)
        self.assertEqual(self.kiln("timeout", sb, "600").stdout.decode(), f"{sb}\trunning\n")

        self.assertIn(b"credits", self.kiln("balance").stdout)
        health = json.loads(self.kiln("api", "GET", "/healthz").stdout)
        self.assertEqual(health["status"], "ok")
        snaps = json.loads(self.kiln("api", "GET", "/v1/snapshots").stdout)["snapshots"]
        self.assertEqual([s["id"] for s in snaps], [snap])
        self.kiln("api", "DELETE", f"/v1/snapshots/{snap}")

        self.assertEqual(self.kiln("delete", sb).stdout, b"")
        p = self.kiln("get", sb, status=1)
        self.assertIn(b"not_found", p.stderr)

    def test_failures_say_why_and_exit_1_or_2(self):
        p = self.kiln("list", key="kiln_sk_notakey", status=1)
        self.assertIn(b"unauthenticated", p.stderr)
        p = self.kiln("get", "sb_nope", status=1)
        self.assertIn(b"not_found", p.stderr)
        for args in (["frobnicate"], ["create", "--vcpus", "many"], ["exec", "sb_x"], ["get"],
                     ["get", "../etc"], ["put", "sb_x", "/nonexistent-file", "/root/x"],
                     ["cat", "sb_x", "relative/path"], ["api", "GET", "no-slash"]):
            p = self.kiln(*args, status=2)
            self.assertTrue(p.stderr.startswith(b"kiln: "), args)
        p = subprocess.run([KILN, "list"], env={"KILN_URL": "http://127.0.0.1:1", "KILN_API_KEY": "k"},
                           capture_output=True, timeout=60)
        self.assertEqual(p.returncode, 1)
        self.assertIn(b"127.0.0.1:1", p.stderr)
        p = subprocess.run([KILN, "create", "--vcpus", "99"], capture_output=True, timeout=60,
                           env={"KILN_URL": self.stack.gw.url, "KILN_API_KEY": self.key})
        self.assertEqual(p.returncode, 1)
        self.assertIn(b"vcpus", p.stderr)
        self.assertEqual(self.kiln("help").returncode, 0)


if __name__ == "__main__":
    unittest.main()
