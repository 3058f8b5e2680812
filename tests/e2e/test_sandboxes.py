"""Sandboxes as a user sees them: create, exec, files, streaming, delete, and the errors of docs/errors.md."""
import datetime
import glob
import http.client
import json
import os
import platform
import re
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.parse

import kiln


def sse_events(gw, path, body, headers):
    """POSTs with Accept: text/event-stream; yields (arrival time, event, data) as they come."""
    u = urllib.parse.urlparse(gw.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", path, json.dumps(body),
                 dict(headers, **{"Accept": "text/event-stream", "Content-Type": "application/json"}))
    r = conn.getresponse()
    assert r.status == 200, (r.status, r.read())
    assert r.getheader("Content-Type").startswith("text/event-stream")
    event, data = None, None
    while True:
        line = r.readline()
        if not line:
            break
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
        elif line == "" and event:
            yield time.monotonic(), event, data
            event, data = None, None
    conn.close()


def uid_leases():
    """{owner: uid} of every uid lease (vmm/jail.h)."""
    out = {}
    for p in glob.glob("/run/kiln/uids/*"):
        if os.path.basename(p).isdigit():
            with open(p) as f:
                out[f.read().strip()] = int(os.path.basename(p))
    return out


def netns_list():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def running(pid):
    """Whether `pid` is a live process (a zombie waiting for its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


vm_pids = kiln.vm_pids  # test_doubt and test_snapshots import it from here


class SandboxTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack()
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("acme")
        r = cls.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256, "metadata": {"run": "e2e"},
                                                     "timeout_s": 3600},
                           cls.key, timeout=300)
        assert r.status == 201, r
        cls.sb = r.json()


    def exec(self, body, sb=None, timeout=120):
        r = self.gw.request("POST", f"/v1/sandboxes/{(sb or self.sb)['id']}/exec", body, self.key,
                            timeout=timeout)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def test_create_answers_a_running_sandbox_of_the_asked_shape(self):
        sb = self.sb
        self.assertTrue(sb["id"].startswith("sb_"))
        self.assertEqual(sb["state"], "running")
        self.assertEqual((sb["vcpus"], sb["memory_mib"], sb["disk_gib"]), (1, 256, 10))
        self.assertEqual(sb["template"], "python")
        self.assertEqual(sb["metadata"], {"run": "e2e"})
        self.assertEqual(sb["node"], self.stack.node.node_id)
        got = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()
        self.assertEqual(got["state"], "running")
        self.assertEqual(got["expires_at"], sb["expires_at"])

    def test_python_prints_computes_and_writes_a_file_read_back_exactly(self):
        out = self.exec({"code": "import hashlib\nprint(sum(range(101)))\n"
                                 "open('/root/out.txt','w').write(hashlib.sha256(b'kiln').hexdigest())"})
        self.assertEqual((out["exit_code"], out["stdout"], out["timed_out"]), (0, "5050\n", False))
        r = self.gw.request("GET", f"/v1/sandboxes/{self.sb['id']}/files?path=/root/out.txt",
                            headers=self.key)
        self.assertEqual(r.status, 200)
        import hashlib
        self.assertEqual(r.data, hashlib.sha256(b"kiln").hexdigest().encode())

    def test_ten_mib_binary_round_trips_byte_exact(self):
        data = os.urandom(10 << 20)
        path = f"/v1/sandboxes/{self.sb['id']}/files?path=/root/blob.bin"
        r = self.gw.request("PUT", path, data, dict(self.key, **{"Content-Type": "application/octet-stream"}))
        self.assertEqual(r.status, 204, r)
        r = self.gw.request("GET", path, headers=self.key)
        self.assertEqual(r.status, 200)
        self.assertEqual(len(r.data), len(data))
        self.assertTrue(r.data == data)
        out = self.exec({"cmd": ["sha256sum", "/root/blob.bin"]})
        import hashlib
        self.assertEqual(out["stdout"].split()[0], hashlib.sha256(data).hexdigest())

    def test_streamed_output_arrives_as_it_is_produced(self):
        events = list(sse_events(self.gw, f"/v1/sandboxes/{self.sb['id']}/exec",
                                 {"cmd": ["sh", "-c", "echo one; sleep 2; echo two >&2; sleep 1; echo three"]},
                                 self.key))
        names = [e for _, e, _ in events]
        self.assertEqual(names[-1], "exit")
        self.assertEqual(events[-1][2]["exit_code"], 0)
        text = "".join(d["data"] for _, e, d in events if e == "stdout")
        self.assertEqual(text, "one\nthree\n")
        self.assertIn("two\n", "".join(d["data"] for _, e, d in events if e == "stderr"))
        first = next(t for t, e, _ in events if e == "stdout")
        self.assertGreater(events[-1][0] - first, 2.0, "the first chunk came only at the end")

    def test_the_guest_runs_its_own_kernel_and_sees_nothing_of_the_host(self):
        marker = f"/tmp/kiln-host-marker-{secrets.token_hex(4)}"
        open(marker, "w").close()
        self.addCleanup(os.unlink, marker)
        out = self.exec({"code": f"import os,platform\nprint(platform.release())\n"
                                 f"print(os.path.exists('{marker}'))\n"
                                 f"print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
                                 f"print(os.path.exists('/proc/{self.gw.proc.pid}/cmdline') and "
                                 f"b'kiln-gateway' in open('/proc/{self.gw.proc.pid}/cmdline','rb').read())"})
        release, exists, nprocs, sees_gateway = out["stdout"].split()
        self.assertNotEqual(release, platform.release())
        self.assertTrue(release.endswith("-cloud-amd64"), release)
        self.assertEqual(exists, "False")
        self.assertEqual(sees_gateway, "False")
        self.assertLess(int(nprocs), 100)

    def test_a_missing_program_exits_127_with_a_message(self):
        out = self.exec({"cmd": ["no-such-program-xyz"]})
        self.assertEqual(out["exit_code"], 127)
        self.assertIn("not found", out["stderr"])

    def test_a_command_past_its_timeout_is_killed_and_marked(self):
        t0 = time.monotonic()
        out = self.exec({"cmd": ["sleep", "30"], "timeout_s": 1})
        self.assertTrue(out["timed_out"])
        self.assertLess(time.monotonic() - t0, 15)

    def test_stdin_env_and_cwd_reach_the_command(self):
        out = self.exec({"code": "import os,sys\nprint(sys.stdin.read().upper(), os.environ['GREETING'], os.getcwd())",
                         "stdin": "abc", "env": {"GREETING": "hi"}, "cwd": "/tmp"})
        self.assertEqual(out["stdout"], "ABC hi /tmp\n")

    def test_file_paths_outside_the_guest_filesystem_are_422_and_absent_files_404(self):
        base = f"/v1/sandboxes/{self.sb['id']}/files"
        for q in ("?path=relative/x", "?path=", ""):
            r = self.gw.request("GET", base + q, headers=self.key)
            self.assertEqual(r.status, 422, (q, r))
            self.assertEqual(r.json()["error"]["code"], "invalid")
        r = self.gw.request("PUT", base + "?path=rel", b"x", self.key)
        self.assertEqual(r.status, 422)
        r = self.gw.request("GET", base + "?path=/no/such/file", headers=self.key)
        self.assertEqual(r.status, 404)
        self.assertEqual(r.json()["error"]["code"], "not_found")

    def test_bad_exec_bodies_change_nothing_and_name_the_problem(self):
        p = f"/v1/sandboxes/{self.sb['id']}/exec"
        cases = [({"cmd": "ls"}, 400), ({"cmd": []}, 422), ({}, 422), ({"cmd": ["ls"], "code": "x"}, 422),
                 ({"code": "x", "language": "ruby"}, 422), ({"cmd": ["ls"], "timeout_s": 0}, 422),
                 ({"cmd": ["ls"], "cwd": "tmp"}, 422), ({"cmd": ["ls"], "bogus": 1}, 400),
                 ({"cmd": ["ls"], "env": {"1BAD": "x"}}, 422)]
        for body, status in cases:
            r = self.gw.request("POST", p, body, self.key)
            self.assertEqual(r.status, status, (body, r))

    def ensure_user(self):
        """The base image carries the ordinary account `user` (uid 1000)."""
        out = self.exec({"cmd": ["id", "-u", "user"]})
        self.assertEqual((out["exit_code"], out["stdout"]), (0, "1000\n"), out)

    def test_exec_as_user_has_its_uid_groups_home_and_working_directory(self):
        self.ensure_user()
        show = ["sh", "-c", "id -u; id -g; echo $HOME $USER $LOGNAME; pwd"]
        out = self.exec({"cmd": show, "user": "user"})
        self.assertEqual((out["exit_code"], out["stdout"]),
                         (0, "1000\n1000\n/home/user user user\n/home/user\n"), out)
        out = self.exec({"cmd": show, "user": "user", "cwd": "/tmp", "env": {"HOME": "/tmp/h"}})
        self.assertEqual(out["stdout"], "1000\n1000\n/tmp/h user user\n/tmp\n")
        # its supplementary groups: those of /etc/group that list it, for exec and for files
        self.exec({"cmd": ["sh", "-c", "grep -q '^kilnteam:' /etc/group || echo 'kilnteam:x:4321:user' >> /etc/group; "
                                       "echo team > /root/team.txt; chgrp 4321 /root/team.txt; chmod 0640 /root/team.txt; "
                                       "chmod 0711 /root"]})
        out = self.exec({"cmd": ["id", "-G"], "user": "user"})
        self.assertIn("4321", out["stdout"].split(), out)
        self.assertEqual(self.exec({"cmd": ["cat", "/root/team.txt"], "user": "user"})["stdout"], "team\n")
        r = self.gw.request("GET", f"/v1/sandboxes/{self.sb['id']}/files?path=/root/team.txt&user=user",
                            headers=self.key)
        self.assertEqual((r.status, r.data), (200, b"team\n"))
        # root stays the default, and can be named
        for body in ({"cmd": show}, {"cmd": show, "user": "root"}):
            self.assertEqual(self.exec(body)["stdout"], "0\n0\n/root root root\n/root\n")
        # the user cannot do what root can: the agent keeps nothing of root for it
        out = self.exec({"cmd": ["sh", "-c", "echo x > /etc/kiln-user-probe"], "user": "user"})
        self.assertNotEqual(out["exit_code"], 0, out)
        self.assertIn("denied", out["stderr"])
        self.assertEqual(self.exec({"cmd": ["sh", "-c", "ls /etc | grep -c kiln-user-probe"]})["stdout"], "0\n")
        # streamed too
        events = list(sse_events(self.gw, f"/v1/sandboxes/{self.sb['id']}/exec",
                                 {"cmd": ["id", "-u"], "user": "user"}, self.key))
        self.assertEqual("".join(d["data"] for _, e, d in events if e == "stdout"), "1000\n")
        self.assertEqual(events[-1][1], "exit")

    def test_a_file_written_as_user_belongs_to_it_and_reads_obey_its_permissions(self):
        self.ensure_user()
        base = f"/v1/sandboxes/{self.sb['id']}/files"
        octet = dict(self.key, **{"Content-Type": "application/octet-stream"})
        r = self.gw.request("PUT", base + "?path=/home/user/notes.txt&user=user", b"mine\n", octet)
        self.assertEqual(r.status, 204, r)
        out = self.exec({"cmd": ["stat", "-c", "%u:%g %a", "/home/user/notes.txt"]})
        self.assertEqual(out["stdout"], "1000:1000 644\n")
        r = self.gw.request("GET", base + "?user=user&path=/home/user/notes.txt", headers=self.key)
        self.assertEqual((r.status, r.data), (200, b"mine\n"))
        # root's private file: the user may neither read nor replace it, and it stays as it was
        self.exec({"cmd": ["sh", "-c", "echo secret > /root/private && chmod 600 /root/private"]})
        r = self.gw.request("GET", base + "?path=/root/private&user=user", headers=self.key)
        self.assertEqual(r.status, 403, r)
        self.assertEqual(r.json()["error"]["code"], "forbidden")
        r = self.gw.request("PUT", base + "?path=/etc/kiln-user-test&user=user", b"x", octet)
        self.assertEqual(r.status, 403, r)
        out = self.exec({"cmd": ["sh", "-c", "test ! -e /etc/kiln-user-test && cat /root/private && "
                                 "ls -a /etc | grep -c kiln-user-test"]})
        self.assertEqual(out["stdout"], "secret\n0\n")
        # root still reads and writes anywhere, by default and by name
        r = self.gw.request("GET", base + "?path=/root/private", headers=self.key)
        self.assertEqual((r.status, r.data), (200, b"secret\n"))
        r = self.gw.request("PUT", base + "?path=/root/by-root&user=root", b"r", octet)
        self.assertEqual(r.status, 204, r)
        out = self.exec({"cmd": ["stat", "-c", "%u:%g", "/root/by-root"]})
        self.assertEqual(out["stdout"], "0:0\n")

    def test_an_unknown_or_malformed_user_is_422_and_changes_nothing(self):
        base = f"/v1/sandboxes/{self.sb['id']}"
        octet = dict(self.key, **{"Content-Type": "application/octet-stream"})
        r = self.gw.request("POST", base + "/exec", {"cmd": ["touch", "/tmp/nosuchuser-ran"],
                                                     "user": "nosuchuser"}, self.key)
        self.assertEqual(r.status, 422, r)
        self.assertEqual(r.json()["error"]["code"], "invalid")
        self.assertIn("nosuchuser", r.json()["error"]["message"])
        r = self.gw.request("PUT", base + "/files?path=/tmp/nosuchuser-file&user=nosuchuser", b"x", octet)
        self.assertEqual(r.status, 422, r)
        self.assertIn("nosuchuser", r.json()["error"]["message"])
        r = self.gw.request("GET", base + "/files?path=/etc/hostname&user=nosuchuser", headers=self.key)
        self.assertEqual(r.status, 422, r)
        # streamed: the stream has begun, so the refusal is its one event, an Error body
        events = list(sse_events(self.gw, base + "/exec",
                                 {"cmd": ["touch", "/tmp/nosuchuser-ran"], "user": "nosuchuser"}, self.key))
        self.assertEqual([e for _, e, _ in events], ["error"])
        self.assertEqual(events[0][2]["error"]["code"], "invalid")
        self.assertIn("nosuchuser", events[0][2]["error"]["message"])
        out = self.exec({"cmd": ["sh", "-c", "ls /tmp | grep -c nosuchuser"]})
        self.assertEqual(out["stdout"], "0\n")
        # names no system has are refused by the gateway, before any guest sees them
        for bad in ("", "a b", "-x", "x" * 33, "../etc", "r\u00f6ot", "root\n"):
            r = self.gw.request("POST", base + "/exec", {"cmd": ["true"], "user": bad}, self.key)
            self.assertEqual(r.status, 422, (bad, r))
            self.assertIn("user", r.json()["error"]["message"])
            q = urllib.parse.urlencode({"path": "/tmp/x", "user": bad})
            r = self.gw.request("GET", base + "/files?" + q, headers=self.key)
            self.assertEqual(r.status, 422, (bad, r))
            r = self.gw.request("PUT", base + "/files?" + q, b"x", octet)
            self.assertEqual(r.status, 422, (bad, r))
        r = self.gw.request("POST", base + "/exec", {"cmd": ["true"], "user": 0}, self.key)
        self.assertEqual(r.status, 400, r)

    def test_another_tenant_sees_404_for_everything(self):
        other = self.stack.tenant("other")
        sid = self.sb["id"]
        for method, path, body in (("GET", f"/v1/sandboxes/{sid}", None),
                                   ("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["true"]}),
                                   ("GET", f"/v1/sandboxes/{sid}/files?path=/etc/hostname", None),
                                   ("DELETE", f"/v1/sandboxes/{sid}", None)):
            r = self.gw.request(method, path, body, other)
            self.assertEqual(r.status, 404, (method, path, r))
        self.assertEqual(self.gw.request("GET", "/v1/sandboxes", headers=other).json()["sandboxes"], [])

    def test_timeout_update_moves_expires_at(self):
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.sb['id']}/timeout", {"timeout_s": 7200}, self.key)
        self.assertEqual(r.status, 200, r)
        self.assertGreater(r.json()["expires_at"], self.sb["expires_at"])
        self.assertEqual(self.gw.request("PUT", f"/v1/sandboxes/{self.sb['id']}/timeout",
                                         {"timeout_s": 0}, self.key).status, 422)

    def test_metrics_count_sandboxes_by_state_and_node_capacity(self):
        import re
        text = self.gw.request("GET", "/metrics").data.decode()
        m = re.search(r'kiln_sandboxes\{state="running"\} (\d+)', text)
        self.assertIsNotNone(m, text[-2000:])
        self.assertGreaterEqual(int(m.group(1)), 1)
        node = self.stack.node.node_id
        self.assertRegex(text, r'kiln_node_capacity\{node="%s",resource="memory_mib"\} \d+' % node)
        self.assertRegex(text, r'kiln_node_used\{node="%s",resource="sandboxes"\} [1-9]' % node)
        self.assertIn('kiln_node_up{node="%s"} 1' % node, text)

    def test_shape_validation_names_the_field(self):
        for body, field in (({"vcpus": 9}, "vcpus"), ({"vcpus": 0.3}, "vcpus"), ({"memory_mib": 128}, "memory_mib"),
                            ({"disk_gib": 61}, "disk_gib"), ({"timeout_s": 90000}, "timeout_s"),
                            ({"template": "Ruby!"}, "template")):
            r = self.gw.request("POST", "/v1/sandboxes", body, self.key)
            self.assertEqual(r.status, 422, (body, r))
            self.assertIn(field, r.json()["error"]["message"])
        # A template name the tenant has not (or another tenant has) is one answer: 404, naming it.
        r = self.gw.request("POST", "/v1/sandboxes", {"template": "ruby"}, self.key)
        self.assertEqual((r.status, r.json()["error"]["code"]), (404, "not_found"), r)
        self.assertIn('"ruby"', r.json()["error"]["message"])
        r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": "lots"}, self.key)
        self.assertEqual(r.status, 400)
        r = self.gw.request("POST", "/v1/sandboxes", {"colour": "red"}, self.key)
        self.assertEqual(r.status, 400)
        self.assertEqual(len(self.gw.request("GET", "/v1/sandboxes", headers=self.key).json()["sandboxes"]), 1)


class LifecycleTests(unittest.TestCase):
    """Sandboxes of their own: deletion, a VM that dies, expiry, listing, capacity."""

    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env={"KILN_NODE_MAX_SANDBOXES": "2"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()


    def create(self, **body):
        body.setdefault("memory_mib", 256)
        body.setdefault("timeout_s", 3600)
        r = self.gw.request("POST", "/v1/sandboxes", body, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sb = r.json()
        # Whatever a test leaves (a failed assertion included) must not fill this small node.
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        return sb

    def test_delete_leaves_no_process_tap_netns_cgroup_or_disk_and_then_404(self):
        sb = self.create()
        node = self.stack.node
        pids = vm_pids(node.node_id, sb["id"])
        self.assertTrue(pids, "the VM's cgroup holds its VMM")
        net_id = sb["id"].split("_", 1)[1][:13]  # netns and veth names are capped at 15 bytes
        netns = "kiln-" + net_id
        self.assertIn(netns, subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout)
        self.assertEqual(self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key).status, 204)
        for pid in pids:
            self.assertFalse(running(pid), f"VMM pid {pid} still runs")
        self.assertNotIn(netns, subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout)
        self.assertNotIn("kv" + net_id, subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout)
        self.assertEqual(glob.glob(f"/sys/fs/cgroup/*/kiln/{node.node_id}/{sb['id']}"), [])
        self.assertEqual(glob.glob(f"{node.data_dir}/vms/{node.node_id}/{sb['id']}*"), [])
        self.assertEqual(glob.glob(f"/run/kiln/{node.node_id}/{sb['id']}"), [])
        self.assertEqual(glob.glob(f"/dev/shm/*{sb['id']}*"), [])
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["true"]}, self.key)
        self.assertEqual(r.status, 404)
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).status, 404)
        self.assertEqual(self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key).status, 404)

    def test_a_vm_that_dies_mid_exec_is_502_then_state_error_and_the_node_stays_healthy(self):
        sb = self.create()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        import threading
        result = {}

        def run():
            result["r"] = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec",
                                          {"cmd": ["sleep", "60"]}, self.key, timeout=120)
        t = threading.Thread(target=run)
        t.start()
        time.sleep(2)
        for pid in vm_pids(self.stack.node.node_id, sb["id"]):
            os.kill(pid, signal.SIGKILL)
        t.join(90)
        r = result["r"]
        self.assertEqual(r.status, 502, r)
        self.assertEqual(r.json()["error"]["code"], "sandbox_failed")
        self.assertEqual(self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()["state"], "error")
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["true"]}, self.key)
        self.assertEqual(r.status, 409)
        self.assertTrue(self.stack.node.alive())
        self.assertEqual(self.gw.request("GET", "/healthz").status, 200)

    def test_a_sandbox_past_its_timeout_is_paused_not_destroyed(self):
        sb = self.create()
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/files?path=/root/keep.txt", b"kept", self.key)
        self.assertEqual(r.status, 204, r)
        r = self.gw.request("PUT", f"/v1/sandboxes/{sb['id']}/timeout", {"timeout_s": 2}, self.key)
        self.assertEqual(r.status, 200, r)
        deadline = time.time() + 30
        state = None
        while time.time() < deadline:
            state = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()["state"]
            if state == "paused":
                break
            time.sleep(0.5)
        self.assertEqual(state, "paused")
        self.assertEqual(vm_pids(self.stack.node.node_id, sb["id"]), set())
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["true"]}, self.key)
        self.assertEqual(r.status, 409)
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/resume", headers=self.key, timeout=120)
        self.assertEqual(r.status, 200, r)
        r = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}/files?path=/root/keep.txt", headers=self.key)
        self.assertEqual(r.data, b"kept")
        self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key)

    def test_a_node_killed_and_restarted_leaves_no_orphan_and_pauses_its_running_sandboxes(self):
        sb = self.create()
        node = self.stack.node
        pids = vm_pids(node.node_id, sb["id"])
        self.assertTrue(pids)
        node.stop(signal.SIGKILL)
        for pid in pids:
            self.assertTrue(running(pid), "the VM should outlive a killed node")
        self.stack.restart_node()
        for pid in pids:
            self.assertFalse(running(pid), f"orphan VMM {pid} left running")
        net_id = sb["id"].split("_", 1)[1][:13]
        self.assertNotIn("kiln-" + net_id, subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout)
        self.assertEqual(glob.glob(f"/sys/fs/cgroup/*/kiln/{node.node_id}/{sb['id']}"), [])
        self.assertEqual(glob.glob(f"/sys/fs/bpf/kiln/{node.node_id}/{sb['id']}"), [])
        self.assertEqual(glob.glob(f"/dev/shm/*{sb['id']}*"), [])
        got = self.gw.request("GET", f"/v1/sandboxes/{sb['id']}", headers=self.key).json()
        self.assertEqual(got["state"], "paused", "its VM was taken over and paused")
        self.assertEqual(self.gw.request("DELETE", f"/v1/sandboxes/{sb['id']}", headers=self.key).status, 204)

    def tenant_of_one(self):
        """A new tenant whose plan allows one sandbox at a time: (tenant id, key header)."""
        r = self.gw.request("POST", "/v1/tenants", {"name": "one-at-a-time"}, self.stack.admin)
        self.assertEqual(r.status, 201, r)
        tenant, key = r.json()["tenant"]["id"], {"Authorization": "Bearer " + r.json()["api_key"]["key"]}
        self.stack.db.sql("INSERT INTO plan_limits VALUES ('one', 1, 16000, 32768, 53687091200) "
                          "ON CONFLICT (plan) DO NOTHING")
        self.stack.db.sql(f"UPDATE tenants SET plan = 'one' WHERE id = '{tenant}'")
        return tenant, key

    def at_once(self, n, method, path, body, key):
        """`n` requests sent together; their answers."""
        results = [None] * n

        def call(i):
            results[i] = self.gw.request(method, path(i), body, key, timeout=300)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        return results

    def live(self, tenant):
        return self.stack.db.sql(f"SELECT count(*) FROM sandboxes WHERE tenant_id = '{tenant}' "
                                 "AND deleted_at IS NULL AND state IN ('creating', 'running')")

    def test_concurrent_creates_cannot_pass_a_plan_limit_together(self):
        # A plan of one sandbox at a time; three creates at once, on a node with room for two.
        tenant, key = self.tenant_of_one()
        results = self.at_once(3, "POST", lambda i: "/v1/sandboxes", {"memory_mib": 256}, key)
        made = [r.json()["id"] for r in results if r.status == 201]
        for sb in made:
            self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb}", None, key)
        statuses = sorted(r.status for r in results)
        self.assertEqual(len(made), 1, statuses)
        self.assertTrue(set(statuses) <= {201, 403, 503} and 403 in statuses, statuses)
        for r in results:
            if r.status == 403:
                self.assertEqual(r.json()["error"]["code"], "quota_exceeded")
                self.assertIn("1 sandboxes", r.json()["error"]["message"])
        self.assertEqual(self.live(tenant), "1")

    def test_concurrent_resumes_cannot_pass_a_plan_limit_together(self):
        # Two paused sandboxes of a plan of one, resumed at once: one runs, the other stays paused.
        tenant, key = self.tenant_of_one()
        ids = []
        for _ in range(2):
            r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, key, timeout=300)
            self.assertEqual(r.status, 201, r)
            ids.append(r.json()["id"])
            self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{ids[-1]}", None, key)
            r = self.gw.request("POST", f"/v1/sandboxes/{ids[-1]}/pause", None, key, timeout=120)
            self.assertEqual(r.status, 200, r)
        results = self.at_once(2, "POST", lambda i: f"/v1/sandboxes/{ids[i]}/resume", None, key)
        statuses = sorted(r.status for r in results)
        self.assertEqual(statuses, [200, 403], [r.json() for r in results])
        refused = next(r for r in results if r.status == 403)
        self.assertEqual(refused.json()["error"]["code"], "quota_exceeded")
        self.assertEqual(self.live(tenant), "1")
        states = sorted(self.gw.request("GET", f"/v1/sandboxes/{i}", headers=key).json()["state"] for i in ids)
        self.assertEqual(states, ["paused", "running"])

    def test_a_full_node_answers_503_no_capacity(self):
        a = self.create()
        b = self.create()
        try:
            r = self.gw.request("POST", "/v1/sandboxes", {"memory_mib": 256}, self.key)
            self.assertEqual(r.status, 503, r)
            self.assertEqual(r.json()["error"]["code"], "no_capacity")
            listed = self.gw.request("GET", "/v1/sandboxes?limit=1", headers=self.key).json()
            self.assertEqual(len(listed["sandboxes"]), 1)
            self.assertIsNotNone(listed["next_cursor"])
            second = self.gw.request("GET", "/v1/sandboxes?limit=1&cursor=" + listed["next_cursor"],
                                     headers=self.key).json()
            self.assertEqual(len(second["sandboxes"]), 1)
            self.assertNotEqual(second["sandboxes"][0]["id"], listed["sandboxes"][0]["id"])
            running = self.gw.request("GET", "/v1/sandboxes?state=running", headers=self.key).json()
            self.assertEqual({s["id"] for s in running["sandboxes"]} & {a["id"], b["id"]}, {a["id"], b["id"]})
            self.assertEqual(self.gw.request("GET", "/v1/sandboxes?state=bogus", headers=self.key).status, 422)
            self.assertEqual(self.gw.request("GET", "/v1/sandboxes?cursor=zzz", headers=self.key).status, 422)
        finally:
            for s in (a, b):
                self.gw.request("DELETE", f"/v1/sandboxes/{s['id']}", headers=self.key)


class TemplateRestoreTests(unittest.TestCase):
    """A restore from the node's template that a busy host keeps past QEMU's start-up deadline."""

    @classmethod
    def setUpClass(cls):
        cls.hold = os.path.join(tempfile.gettempdir(), f"kiln-hold-{os.getpid()}-{time.time_ns()}")
        # after the stack's cleanup: until its node stops, a restore may hold (make it) again
        cls.addClassCleanup(lambda: os.path.exists(cls.hold) and os.unlink(cls.hold))
        # Held just after QEMU of a restore starts, before the node waits for its QMP greeting.
        # no VMM started ahead (WarmVmTests): each would be held there too
        cls.stack = kiln.Stack(node_env={"KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
                                         "KILN_TEMPLATE_WARM_VMS": "0",
                                         "KILN_FAULT_HOLD": "vmm-restore-spawned",
                                         "KILN_FAULT_HOLD_FILE": cls.hold})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def template(self, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = self.stack.db.sql("SELECT id FROM snapshots WHERE kind = 'template' AND deleted_at IS NULL "
                                    f"AND node_id = '{self.stack.node.node_id}'")
            if got:
                return got.split()[0]
            time.sleep(1)
        raise AssertionError("no template was built:\n" + self.stack.node.output()[-3000:])

    def wait_held(self, timeout):
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.hold) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(os.path.exists(self.hold), "no restore reached QEMU's start:\n" +
                        self.stack.node.output()[-3000:])

    def test_a_restore_past_qemus_start_up_deadline_is_tried_again_and_the_template_stays(self):
        tpl = self.template()
        result = {}
        create = threading.Thread(target=lambda: result.update(r=self.gw.request(
            "POST", "/v1/sandboxes", {"timeout_s": 600}, self.key, timeout=300)))
        create.start()
        self.wait_held(120)
        time.sleep(10.5)  # QEMU's 10 s to answer QMP (vmm/qemu.c, QMP_CONNECT_MS) run out
        os.unlink(self.hold)
        self.wait_held(60)  # the one more try: let through at once
        os.unlink(self.hold)
        create.join(300)
        r = result["r"]
        self.assertEqual(r.status, 201, r)
        sb = r.json()
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sb['id']}", None, self.key)
        log = self.stack.node.output()
        self.assertIn("no qmp answer within 10 s, qemu still starting", log)
        self.assertIn("trying again", log)
        # A restore of the template, not a cold boot; the template kept for the next creates.
        self.assertEqual(self.stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes "
                                           f"WHERE id = '{sb['id']}'"), tpl)
        self.assertEqual(self.stack.db.sql(f"SELECT deleted_at IS NULL FROM snapshots WHERE id = '{tpl}'"), "t")
        self.assertNotIn("booting cold", log)
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["echo", "up"]}, self.key,
                            timeout=120)
        self.assertEqual((r.status, r.json()["stdout"]), (200, "up\n"), r)


# A DNS query for a name no rule allows, sent to the guest's resolver (its sandbox's DNS proxy, on
# the other side of its TAP): prints the answer's rcode (3: NXDOMAIN, the proxy's own answer).
DNS_PROBE = r"""
import socket
ns = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07blocked\x04test\x00\x00\x01\x00\x01"
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(5)
s.sendto(q, (ns, 53))
print(s.recv(512)[3] & 15)
"""


class WarmVmTests(unittest.TestCase):
    """Creates from the template on a VMM started ahead (node/warm.c): the create takes its QEMU,
    namespace and uid, and another is started after; one that died meanwhile leaves the create to
    restore anew; a node killed with one leaves nothing of it at its restart."""

    # the refill's wait long enough to tell a refill put off by a later create from one that was not
    REFILL_S = 6
    ENV = {"KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true", "KILN_TEMPLATE_WARM_VMS": "1",
           "KILN_TEMPLATE_WARM_REFILL_MS": str(REFILL_S * 1000)}

    @classmethod
    def setUpClass(cls):
        cls.stack = kiln.Stack(node_env=cls.ENV)
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()

    def warm_ids(self):
        return re.findall(r'VMM "(0[a-z2-7]{12})" started ahead', self.stack.node.output())

    def wait_warm(self, after=(), timeout=300):
        """The id of a VMM started ahead that is not in `after`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            new = [w for w in self.warm_ids() if w not in after]
            if new:
                return new[0]
            time.sleep(0.5)
        raise AssertionError("no VMM was started ahead:\n" + self.stack.node.output()[-3000:])

    def test_a_create_takes_the_vmm_started_ahead_and_another_is_started(self):
        node = self.stack.node
        w = self.live_warm()
        tpl = self.stack.db.sql("SELECT id FROM snapshots WHERE kind = 'template' AND deleted_at IS NULL "
                                f"AND node_id = '{node.node_id}'").split()[0]
        pids = vm_pids(node.node_id, w)
        self.assertTrue(pids, "the VMM started ahead runs in a cgroup of its own")
        self.assertIn("kiln-" + w, netns_list())
        uid = uid_leases()[f"{node.node_id}/{w}"]
        r = self.gw.request("POST", "/v1/sandboxes", {"timeout_s": 600, "egress": {"rules": ["example.com"]}},
                            self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sid = r.json()["id"]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sid}", None, self.key)
        self.assertRegex(node.output(), rf'sandbox "{sid}" restored from \S+/{tpl} in \d+ ms: .*'
                                        r"its VMM started ahead")
        self.assertEqual(self.stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes "
                                           f"WHERE id = '{sid}'"), tpl)
        # the same QEMU, now the sandbox's: its cgroup, its uid's lease; nothing of the warm VM's name
        self.assertEqual(vm_pids(node.node_id, sid), pids)
        self.assertEqual({os.stat(f"/proc/{p}").st_uid for p in pids}, {uid})
        leases = uid_leases()
        self.assertEqual(leases.get(f"{node.node_id}/{sid}"), uid)
        self.assertNotIn(f"{node.node_id}/{w}", leases)
        self.assertNotIn("kiln-" + w, netns_list())
        self.assertEqual(glob.glob(f"/sys/fs/cgroup/*/kiln/{node.node_id}/{w}"), [])
        self.assertEqual(glob.glob(f"/run/kiln/{node.node_id}/{w}") +
                         glob.glob(f"{node.data_dir}/vms/{node.node_id}/{w}"), [])
        # a new sandbox's identity, and its network: the proxy behind its TAP answers by its rules
        r = self.gw.request("POST", f"/v1/sandboxes/{sid}/exec",
                            {"cmd": ["sh", "-c", "hostname; cat /run/kiln/sandbox-id"]}, self.key,
                            timeout=120)
        self.assertEqual((r.status, r.json()["stdout"]), (200, f"{sid.replace('_', '-')}\n{sid}\n"), r)
        r = self.gw.request("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["python3", "-c", DNS_PROBE]},
                            self.key, timeout=120)
        self.assertEqual((r.status, r.json()["stdout"]), (200, "3\n"), r)
        # another started ahead for the next create
        w2 = self.wait_warm(after=(w,), timeout=120)
        self.assertTrue(vm_pids(node.node_id, w2))
        self.assertEqual(self.gw.request("DELETE", f"/v1/sandboxes/{sid}", headers=self.key).status, 204)
        for pid in pids:
            self.assertFalse(running(pid), f"VMM pid {pid} still runs")

    def started_ahead_at(self, w):
        """The wall time VMM `w`'s begin started: its log line's time less the time it took."""
        for line in self.stack.node.output().splitlines():
            m = re.match(rf'(\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{{3}})Z .*VMM "{w}" started ahead in (\d+) ms',
                         line)
            if m:
                at = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f")
                return at.replace(tzinfo=datetime.timezone.utc).timestamp() - int(m.group(2)) / 1000
        self.fail(f"no log line of VMM {w}")

    def create_timed(self):
        """A create from the template: (wall time sent, the template, whether it took a VMM
        started ahead)."""
        sent = time.time()
        r = self.gw.request("POST", "/v1/sandboxes", {"timeout_s": 600}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sid = r.json()["id"]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sid}", None, self.key)
        restored = [line for line in self.stack.node.output().splitlines()
                    if f'sandbox "{sid}" restored from' in line]
        self.assertEqual(len(restored), 1, self.stack.node.output()[-3000:])
        tpl = re.search(r"restored from \S+/(\S+) in", restored[0]).group(1)
        return sent, tpl, "its VMM started ahead" in restored[0]

    def test_a_create_while_the_refill_waits_does_not_put_it_off(self):
        """The next VMM is begun template_warm_refill_ms after the take; a create that finds none
        meanwhile leaves that time as it is (before, each such create put the refill off again, so
        creates closer together than the wait never found one)."""
        self.live_warm()
        t0, tpl, took = self.create_timed()
        self.assertTrue(took, "the first create takes the VMM started ahead")
        before = self.warm_ids()
        time.sleep(max(0.0, t0 + 2.5 - time.time()))
        t1, _, took = self.create_timed()
        self.assertFalse(took, "the second create comes while the refill waits")
        self.assertLess(t1 - t0, self.REFILL_S - 1, "the second create came too late to tell")
        deadline = time.time() + 120
        while not (w2 := [w for w in re.findall(rf'template "{tpl}": VMM "(0[a-z2-7]{{12}})" started ahead',
                                                 self.stack.node.output()) if w not in before]):
            self.assertLess(time.time(), deadline, "no VMM started ahead again")
            time.sleep(0.5)
        begun = self.started_ahead_at(w2[0])
        # not before its wait from the take; not put off by the second create's miss
        self.assertGreaterEqual(begun, t0 + self.REFILL_S - 0.05)
        self.assertLess(begun, t1 + self.REFILL_S,
                        f"the refill was put off by the create at {t1:.3f} (take at or after {t0:.3f})")

    def live_warm(self, timeout=300):
        """A VMM started ahead that waits now: its cgroup still under its own name."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            live = [w for w in self.warm_ids() if vm_pids(self.stack.node.node_id, w)]
            if live:
                return live[0]
            time.sleep(0.5)
        self.fail("no VMM waits started ahead:\n" + self.stack.node.output()[-3000:])

    def test_a_create_whose_vmm_started_ahead_died_restores_anew(self):
        node = self.stack.node
        w = self.live_warm()
        pids = vm_pids(node.node_id, w)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        r = self.gw.request("POST", "/v1/sandboxes", {"timeout_s": 600}, self.key, timeout=300)
        self.assertEqual(r.status, 201, r)
        sid = r.json()["id"]
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{sid}", None, self.key)
        log = node.output()
        self.assertIn("on a VMM started ahead failed", log)
        restored = [line for line in log.splitlines() if f'sandbox "{sid}" restored from' in line]
        self.assertEqual(len(restored), 1, log[-3000:])
        self.assertNotIn("its VMM started ahead", restored[0])
        self.assertNotIn("booting cold", log)
        # nothing of the dead one left; the sandbox runs
        self.assertNotIn(f"{node.node_id}/{w}", uid_leases())
        self.assertNotIn("kiln-" + w, netns_list())
        self.assertEqual(glob.glob(f"/sys/fs/cgroup/*/kiln/{node.node_id}/{w}") +
                         glob.glob(f"/run/kiln/{node.node_id}/{w}") +
                         glob.glob(f"{node.data_dir}/vms/{node.node_id}/{w}"), [])
        r = self.gw.request("POST", f"/v1/sandboxes/{sid}/exec", {"cmd": ["cat", "/run/kiln/sandbox-id"]},
                            self.key, timeout=120)
        self.assertEqual((r.status, r.json()["stdout"]), (200, f"{sid}\n"), r)

    def test_a_node_killed_with_a_vmm_started_ahead_leaves_none_at_its_restart(self):
        node = self.stack.node
        w = self.live_warm()
        pids = vm_pids(node.node_id, w)
        node.stop(signal.SIGKILL)
        for pid in pids:
            self.assertTrue(running(pid), "the VMM should outlive a killed node")
        self.stack.restart_node(self.ENV)
        for pid in pids:
            self.assertFalse(running(pid), f"orphan VMM {pid} left running")
        self.assertNotIn("kiln-" + w, netns_list())
        self.assertNotIn(f"{node.node_id}/{w}", uid_leases())
        self.assertEqual(glob.glob(f"/sys/fs/cgroup/*/kiln/{node.node_id}/{w}"), [])
        self.assertEqual(glob.glob(f"/run/kiln/{node.node_id}/{w}") +
                         glob.glob(f"{node.data_dir}/vms/{node.node_id}/{w}"), [])


if __name__ == "__main__":
    unittest.main()
