"""Templates built from a Dockerfile in a builder microVM, and sandboxes created from them.

On the fake internet of test_egress (its main() builds the host and internet namespaces) this test
serves one file over plain HTTP (api.test:8000). One template is built with `kiln template build`
(the CLI: tar of the context without what .dockerignore excludes, upload, the log followed) and
shared by the cases: its Dockerfile COPYs a small Python package from the build context (whose
.dockerignore leaves a file out), RUNs a step that fetches the file from the test server (the
template's egress allows api.test only), sets ENV and WORKDIR, and starts a long-running HTTP server
(CMD) that the template's ready check waits for. A sandbox created from it sees the files, the
environment and the running server; another shape is 422 naming the template's. A failing RUN
fails its build with its log and leaves nothing to create from (its RUN steps reach the fake
internet but not the host's services, as a sandbox; while it runs, the tenant's next build is past
template_max_builds); a second template whose Dockerfile differs in its last line only reuses
the first build's cached layers (the log marks those steps cached; a sandbox from it has all of
them), another tenant's build of the same first lines as the failing one reuses none of its
layers (a RUN above the first COPY finds no build context in the builder); with that tenant's
snapshot limit at twice its layers' bytes its next build evicts its least recently used layer, and
a layer whose files are gone is dropped by a rebuild that goes on uncached; deleting the template
deletes its layers; an unsupported instruction is 422 naming its line and a
context past template_source_max_bytes is 413, both leaving the version pending; the node
restarted with another guest image (a changed recipe) and small limits retires its pre-booted
template of the base and boots a new one, which the next create restores, and there a build past
template_build_max_s and one past template_image_max_bytes, run side by side, fail naming them; another
tenant gets 404 on every template route and cannot create from it; deleting the template leaves its
sandboxes running. Two sandboxes created back to back from the base's pre-booted template are
distinct (host name, id, random streams, files), their clocks set at the create.
"""
import atexit
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import shutil
import time
import unittest
import urllib.request

import kiln
import test_egress

HOST, PORT = "198.51.100.21", 8000  # api.test
KILN = os.path.join(kiln.BUILD, "cli", "kiln")
FETCHED = "fetched from the fake internet\n"
LAYER_KEPT = re.compile(r"^# layer [0-9a-f]{12} kept: \d+ bytes", re.M)

SERVER = r'''
import http.server, os, sys
os.chdir(sys.argv[3])
class H(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H)
print("ready", flush=True)
s.serve_forever()
'''

DOCKERFILE = f"""# syntax=docker/dockerfile:1
FROM base
ARG GREETING_WORD=hello
ENV GREETING="$GREETING_WORD from kiln" APP_HOME=/srv/app
WORKDIR /srv/app
COPY pkg/ ./pkg/
RUN curl -fsS --max-time 30 http://api.test:{PORT}/data.txt -o fetched.txt
RUN python3 -c "import pkg; print(pkg.NAME)" > name.txt && echo "built $GREETING"
CMD ["python3", "-m", "http.server", "8080", "--bind", "127.0.0.1"]
"""

# Its egress is open, yet the host's services (its address, its database port, the sandboxes'
# gateway, the metadata address) stay closed to a RUN exactly as to a sandbox (test_egress). The
# probes run at once: a blocked one waits out its 5 s; the one allowed gets 60 s, which a loaded
# TCG guest may need for its connection, and ends as soon as it connects.
FAILING = """FROM base
RUN echo about to fail; if [ -e /var/tmp/kiln-build ]; then echo context seen; else echo context unseen; fi
RUN for a in 192.0.2.1:80 192.0.2.1:5432 10.200.0.1:80 169.254.169.254:80 203.0.113.10:80; do t=5; [ $a = 203.0.113.10:80 ] && t=60; \\
      (if timeout $t bash -c "exec 3<>/dev/tcp/${a%:*}/${a#*:}" 2>/dev/null; \\
      then echo "reached $a"; else echo "blocked $a"; fi) & done; wait
RUN echo this step fails >&2 && exit 3
RUN echo never reached
"""


_STACK = []
# The node of shared_stack(): the longer boot timeout test_nodenet gives its node under load (the
# base's warm template boots cold); no code interpreter's template, a cold boot of its own no case
# uses.
NODE_ENV = {"KILN_DNS_UPSTREAM": "192.0.2.53", "KILN_TEMPLATES": "true", "KILN_TEMPLATE_DEFAULT": "true",
            "KILN_BOOT_TIMEOUT_S": "600", "KILN_GUEST_CODEINT_ROOTFS": ""}


def shared_stack():
    """The stack of the template tests of this process (e2e_templates_build runs the cases of
    test_templates_image too): one gateway, one node and one cold boot of the base's warm template
    for all of them, stopped when the process ends. Once that template is ready: each builder
    restores it, rather than boot cold."""
    if not _STACK:
        stack = kiln.Stack(node_env=NODE_ENV, gateway_env={"KILN_TEMPLATE_SOURCE_MAX_BYTES": str(1 << 20),
                                        "KILN_TEMPLATE_MAX_BUILDS": "1"})
        atexit.register(stack.cleanup)
        _STACK.append(stack)
        t0 = time.monotonic()
        while "ready in" not in stack.node.output() and time.monotonic() - t0 < 600:
            time.sleep(1)
        print(f"\nthe base's warm template ready after {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return _STACK[0]


def context_tar(files):
    """A tar of {path: text} in memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class TemplateBuildTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.www = tempfile.mkdtemp(prefix="kiln-tbuild-www-")
        cls.addClassCleanup(shutil.rmtree, cls.www, True)
        with open(os.path.join(cls.www, "data.txt"), "w") as f:
            f.write(FETCHED)
        p = subprocess.Popen(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], sys.executable,
                              "-c", SERVER, HOST, str(PORT), cls.www], stdout=subprocess.PIPE, text=True)
        cls.addClassCleanup(p.wait)
        cls.addClassCleanup(p.kill)
        assert p.stdout.readline().strip() == "ready"

        cls.stack = shared_stack()
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant("tbuild-a")
        cls.other = cls.stack.tenant("tbuild-b")
        # The shared build goes through the CLI, as a user types it: kiln template build DIR.
        ctx = os.path.join(cls.www, "web")
        for name, text in {
                "Dockerfile.web": DOCKERFILE,
                ".dockerignore": "# not for the image\npkg/secret.txt\nnotes/\n",
                "pkg/__init__.py": "NAME = 'kilnpkg'\n",
                "pkg/util.py": "def twice(x):\n    return 2 * x\n",
                "pkg/secret.txt": "left out\n",
                "notes/todo.txt": "not sent\n"}.items():
            os.makedirs(os.path.dirname(os.path.join(ctx, name)), exist_ok=True)
            with open(os.path.join(ctx, name), "w") as f:
                f.write(text)
        cls.ctx = ctx
        t0 = time.monotonic()
        cls.cli = cls.cli_build(cls.key, os.path.join(ctx, "Dockerfile.web"), "web", 8080)
        cls.build_seconds = time.monotonic() - t0
        cls.tmpl, name, version = cls.cli.stdout.strip().split("\t")
        assert name == "web" and version == "v1", cls.cli.stdout
        cls.version = 1
        cls.log, cls.end = cls.follow(cls.tmpl, cls.version)  # kept after the build: replayed
        print(f"\ntemplate build: {cls.build_seconds:.1f} s", file=sys.stderr)

    # ---------------------------------------------------------------- helpers

    @classmethod
    def cli_build(cls, key, dockerfile, name, port):
        """`kiln template build` of the shared context with `dockerfile`, its server on `port`."""
        env = dict(os.environ, KILN_URL=cls.gw.url, KILN_API_KEY=key["Authorization"][7:])
        p = subprocess.run([KILN, "template", "build", "-f", dockerfile, "--name", name, "--ready",
                            f"curl -sf http://127.0.0.1:{port}/name.txt", "--allow", "api.test", cls.ctx],
                           env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr
        return p

    @classmethod
    def template(cls, name, extra=None, key=None):
        body = {"name": name, "vcpus": 1, "memory_mib": 512, "disk_gib": 10}
        body.update(extra or {})
        r = cls.gw.request("POST", "/v1/templates", body, key or cls.key)
        assert r.status == 201, r
        return r.json()["id"], r.json()["version"]

    @classmethod
    def put_dockerfile(cls, tmpl, version, text, expect=204, key=None):
        r = cls.gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile?version={version}", text,
                           dict(key or cls.key, **{"Content-Type": "text/plain"}))
        assert r.status == expect, r
        return r

    @classmethod
    def put_source(cls, tmpl, version, data, expect=202, key=None):
        r = cls.gw.request("PUT", f"/v1/templates/{tmpl}/source?version={version}", data,
                           dict(key or cls.key, **{"Content-Type": "application/x-tar"}), timeout=120)
        assert r.status == expect, r
        return r

    @classmethod
    def follow(cls, tmpl, version, timeout=900, key=None):
        """The build's log followed to its end: (text, the end event's data)."""
        req = urllib.request.Request(f"{cls.gw.url}/v1/templates/{tmpl}/log?version={version}",
                                     headers=dict(key or cls.key, Accept="text/event-stream"))
        text, event, end = [], None, None
        with urllib.request.urlopen(req, timeout=timeout) as r:
            assert r.status == 200, r.status
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for raw in r:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if event == "log":
                        text.append(data["text"])
                    elif event == "end":
                        end = data
                        break
                    elif event == "error":
                        raise AssertionError(data)
        return "".join(text), end

    def base_template(self, node, image_hash=None, timeout=600):
        """The id of `node`'s pre-booted template of the base (of `image_hash`), once it is ready."""
        deadline = time.monotonic() + timeout
        cond = f" AND image_hash = '{image_hash}'" if image_hash else ""
        while True:
            got = self.stack.db.sql("SELECT id FROM snapshots WHERE kind = 'template' AND deleted_at IS NULL"
                                    f" AND node_id = '{node.node_id}'{cond}")
            if got:
                return got.split()[0]
            self.assertLess(time.monotonic(), deadline, "no template was built:\n" + node.output()[-3000:])
            time.sleep(1)

    def lineage(self, sb):
        return self.stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes WHERE id = '{sb['id']}'")

    def create(self, body, key=None, expect=201):
        r = self.gw.request("POST", "/v1/sandboxes", dict({"timeout_s": 3600}, **body), key or self.key,
                            timeout=300)
        self.assertEqual(r.status, expect, r)
        if expect == 201:
            self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{r.json()['id']}", None,
                            key or self.key)
        return r

    def sh(self, sb, cmd, key=None):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", {"cmd": ["sh", "-c", cmd]}, key or self.key,
                            timeout=120)
        self.assertEqual(r.status, 200, r)
        return r.json()

    # ---------------------------------------------------------------- cases

    def test_a_failing_run_fails_the_build_with_its_log_and_nothing_to_create_from(self):
        tmpl, version = self.template("broken")
        self.put_dockerfile(tmpl, version, FAILING)
        # sent through the API with what its .dockerignore excludes: the builder leaves it out
        self.put_source(tmpl, version, context_tar({"Dockerfile": FAILING, ".dockerignore": "junk\n",
                                                    "junk/a.txt": "x", "kept.txt": "y"}))
        # while it builds, the tenant's next build is past template_max_builds (1 here)
        other, v2 = self.template("waiting")
        self.put_dockerfile(other, v2, "FROM base\nRUN true\n")
        r = self.put_source(other, v2, context_tar({"a": "b"}), expect=429)
        self.assertIn("template_max_builds", r.json()["error"]["message"])
        got = self.gw.request("GET", f"/v1/templates/{other}", None, self.key).json()
        self.assertEqual(got["versions"][0]["status"], "pending", got)
        log, end = self.follow(tmpl, version)
        self.assertEqual(end["status"], "failed", (end, log))
        self.assertIn("Dockerfile line 6: RUN failed (exit status 3)", end["reason"])
        for a in ("192.0.2.1:80", "192.0.2.1:5432", "10.200.0.1:80", "169.254.169.254:80"):
            self.assertIn(f"blocked {a}\n", log)
        self.assertIn("reached 203.0.113.10:80\n", log)
        # no COPY/ADD: the context is never copied into the builder, so no RUN reads it
        self.assertNotIn("# .dockerignore", log)
        self.assertIn("context unseen\n", log)
        self.assertNotIn("context seen\n", log)
        self.assertIn("about to fail", log)
        self.assertIn("this step fails", log)
        self.assertNotIn("never reached", log)
        got = self.gw.request("GET", f"/v1/templates/{tmpl}", None, self.key).json()
        self.assertEqual(got["versions"][0]["status"], "failed")
        self.assertIsNone(got["latest_ready_version"])
        r = self.create({"template": "broken"}, expect=404)
        self.assertIn("broken", r.json()["error"]["message"])
        # its builder is gone, and no image of it was kept
        builders = self.stack.db.sql("SELECT count(*) FROM sandboxes WHERE deleted_at IS NULL AND "
                                     f"metadata->>'kiln.template_build' = '{tmpl}/{version}'")
        self.assertEqual(builders, "0")
        snaps = self.stack.db.sql(f"SELECT count(*) FROM snapshots WHERE kind = 'build' AND deleted_at IS NULL "
                                  f"AND id IN (SELECT snapshot_id FROM template_versions WHERE template_id = '{tmpl}')")
        self.assertEqual(snaps, "0")
        # the steps that passed were kept as layers: the same lines again start from them, but
        # not for another tenant, whose build of the same first lines reuses none of them
        self.assertEqual(len(LAYER_KEPT.findall(log)), 2, log)
        # (its COPY brings the context in, sent through the API with what its .dockerignore
        # excludes: the builder leaves it out)
        prefix = "\n".join(FAILING.splitlines()[:2]) + "\nCOPY . /tmp/ctx/\nRUN exit 7\n"
        r = self.gw.request("POST", "/v1/templates", {"name": "broken", "vcpus": 1, "memory_mib": 512,
                                                      "disk_gib": 10}, self.other)
        self.assertEqual(r.status, 201, r)
        theirs = r.json()["id"]
        r = self.gw.request("PUT", f"/v1/templates/{theirs}/dockerfile?version=1", prefix,
                            dict(self.other, **{"Content-Type": "text/plain"}))
        self.assertEqual(r.status, 204, r)
        self.put_source(theirs, 1, context_tar({"Dockerfile": prefix, ".dockerignore": "junk\n",
                                                "junk/a.txt": "x", "kept.txt": "y"}), key=self.other)
        log, end = self.follow(theirs, 1, key=self.other)
        self.assertEqual(end["status"], "failed", (end, log))
        self.assertIn("Dockerfile line 4: RUN failed (exit status 7)", end["reason"])
        self.assertNotIn("(cached)", log)
        self.assertIn("about to fail", log)
        self.assertIn("# .dockerignore: 2 paths of the context left out", log)  # junk/ and junk/a.txt
        self.assertEqual(len(LAYER_KEPT.findall(log)), 2, log)
        self.layers_are_evicted_and_a_broken_one_dropped(theirs)
        r = self.gw.request("DELETE", f"/v1/templates/{theirs}", None, self.other)
        self.assertEqual(r.status, 204, r)

    def layers_are_evicted_and_a_broken_one_dropped(self, theirs):
        """The other tenant's two layers, then its snapshot limit at twice their bytes: a build's
        new layer evicts the least recently used, keeping the layers within half the limit; then
        that new layer's files removed, a rebuild drops it and goes on uncached."""
        db = self.stack.db.sql
        tenant = db(f"SELECT tenant_id FROM templates WHERE id = '{theirs}'")
        layers = ("SELECT l.snapshot_id, s.size_bytes FROM template_layers l JOIN snapshots s ON "
                  f"s.id = l.snapshot_id AND s.deleted_at IS NULL WHERE l.tenant_id = '{tenant}' "
                  "ORDER BY l.used_at, l.created_at")
        before = [r.split("|") for r in db(layers).splitlines()]
        self.assertEqual(len(before), 2, before)
        cap = sum(int(b) for _, b in before)
        plan = db(f"SELECT plan FROM tenants WHERE id = '{tenant}'")
        db("INSERT INTO plan_limits SELECT 'tbuild-small', max_sandboxes, max_vcpu_milli, max_memory_mib, "
           f"{2 * cap} FROM plan_limits WHERE plan = 'default'")
        db(f"UPDATE tenants SET plan = 'tbuild-small' WHERE id = '{tenant}'")
        self.addCleanup(db, "DELETE FROM plan_limits WHERE plan = 'tbuild-small'")
        self.addCleanup(db, f"UPDATE tenants SET plan = '{plan}' WHERE id = '{tenant}'")
        small = "FROM base\nRUN echo evicting > /evict.txt\n"

        def build():
            r = self.gw.request("POST", "/v1/templates", {"name": "evict", "vcpus": 1, "memory_mib": 512,
                                                          "disk_gib": 10}, self.other)
            self.assertEqual(r.status, 201, r)
            tmpl, version = r.json()["id"], r.json()["version"]
            self.addCleanup(self.gw.request, "DELETE", f"/v1/templates/{tmpl}", None, self.other)
            r = self.gw.request("PUT", f"/v1/templates/{tmpl}/dockerfile?version={version}", small,
                                dict(self.other, **{"Content-Type": "text/plain"}))
            self.assertEqual(r.status, 204, r)
            self.put_source(tmpl, version, context_tar({"a": "b"}), key=self.other)
            log, end = self.follow(tmpl, version, key=self.other)
            self.assertEqual(end["status"], "ready", (end, log))
            return log

        log = build()
        self.assertEqual(len(LAYER_KEPT.findall(log)), 1, log)
        self.assertRegex(log, r"# layer cache: [12] least recently used layers evicted")
        after = [r.split("|") for r in db(layers).splitlines()]
        self.assertNotIn(before[0][0], [i for i, _ in after])  # the least recently used went first
        self.assertLessEqual(sum(int(b) for _, b in after), cap)
        self.assertEqual(db(f"SELECT deleted_at IS NOT NULL FROM snapshots WHERE id = '{before[0][0]}'"), "t")
        new = after[-1][0]
        # A layer whose files are gone: the rebuild drops it and builds uncached, keeping a new one.
        shutil.rmtree(os.path.join(self.stack.node.data_dir, "snaps", self.stack.node.node_id, new))
        log = build()
        self.assertIn(f"# cached layer {new} does not restore", log)
        self.assertEqual(len(LAYER_KEPT.findall(log)), 1, log)
        self.assertEqual(db(f"SELECT count(*) FROM template_layers WHERE snapshot_id = '{new}'"), "0")
        self.assertEqual(db(f"SELECT deleted_at IS NOT NULL FROM snapshots WHERE id = '{new}'"), "t")

    def test_with_the_node_restarted_with_small_limits_builds_fail_naming_the_time_or_size_limit(self):
        # The node restarted with small limits and another guest image (a changed recipe): its
        # base template is retired and a new one boots, the one cold boot of this case (a node of
        # its own would boot two: its first template, then the one of the changed recipe). The
        # limit of concurrent builds is hit in test_a_failing_run_... above. Named to run last:
        # the restart drops the layers of the old image (docs/templates.md, "Dead layers go"),
        # which the cases before it count.
        old = self.base_template(self.stack.node)
        node = self.stack.restart_node(dict(NODE_ENV, KILN_GUEST_IMAGE_HASH="changed-recipe",
                                            KILN_TEMPLATE_BUILD_MAX_S="30",
                                            KILN_TEMPLATE_IMAGE_MAX_BYTES=str(1 << 20)))
        self.a_recipe_change_rebuilds_the_base_template(node, old)
        # The slow build first: once its RUN sleeps (its builder restored, the 30 s mostly
        # idle), the big one runs beside it, each of a tenant of its own.
        builds = {}
        for name, dockerfile in (("slow", "FROM base\nRUN sleep 600\n"), ("big", "FROM base\nENV A=b\n")):
            key = self.stack.tenant("tlimit-" + name)
            tmpl, version = self.template(name, key=key)
            self.put_dockerfile(tmpl, version, dockerfile, key=key)
            self.put_source(tmpl, version, context_tar({"a": "b"}), key=key)
            builds[name] = (tmpl, version, key)
            deadline = time.monotonic() + 300
            while name == "slow" and "RUN sleep 600" not in self.stack.db.sql(
                    f"SELECT string_agg(chunk, '') FROM template_build_log WHERE template_id = '{tmpl}'"):
                self.assertLess(time.monotonic(), deadline, "the slow build's RUN did not start")
                time.sleep(0.2)
        ends = {}
        for name, (tmpl, version, key) in builds.items():
            log, end = self.follow(tmpl, version, key=key)
            self.assertEqual(end["status"], "failed", (end, log))
            self.assertEqual(self.stack.db.sql(f"SELECT node_id FROM template_versions WHERE template_id = "
                                               f"'{tmpl}'"), node.node_id)
            self.assertIn(end["reason"], log)  # the log's last line
            ends[name] = end["reason"]
        self.assertIn("took longer than template_build_max_s (30 s)", ends["slow"])
        self.assertRegex(ends["big"], r"the image's file system uses \d+ bytes, more than "
                         r"template_image_max_bytes \(1048576\)")

    def a_recipe_change_rebuilds_the_base_template(self, node, old):
        """`node` restarted with another guest image (a changed recipe): its template `old` of
        the old image is retired, a new one is pre-booted, and the next create restores the new
        one."""
        fresh = self.base_template(node, image_hash="changed-recipe")
        self.assertNotEqual(fresh, old)
        old = self.stack.db.sql(f"SELECT deleted_at IS NOT NULL FROM snapshots WHERE id = '{old}'")
        self.assertEqual(old, "t", "the old template was not retired")
        sb = self.create({}, key=self.other).json()
        self.assertEqual(self.lineage(sb), fresh)

    def test_a_rebuild_with_its_last_line_changed_reuses_the_cached_layers(self):
        # The first build kept a layer for each step that wrote the disk (WORKDIR, COPY, RUN, RUN).
        self.assertEqual(len(LAYER_KEPT.findall(self.log)), 4, self.log)
        rebuilt = DOCKERFILE.replace('"8080"', '"8081"')
        self.assertEqual(rebuilt.splitlines()[:-1], DOCKERFILE.splitlines()[:-1])
        path = os.path.join(self.www, "Dockerfile.rebuilt")
        with open(path, "w") as f:
            f.write(rebuilt)
        t0 = time.monotonic()
        p = self.cli_build(self.key, path, "web-rebuilt", 8081)
        seconds = time.monotonic() - t0
        tmpl = p.stdout.split("\t")[0]
        log, end = self.follow(tmpl, 1)
        print(f"rebuild with the last line changed: {seconds:.1f} s", file=sys.stderr)
        self.assertEqual(end["status"], "ready", (end, log))
        # every step above the changed line came from the cache: none of them ran again
        for step in ("WORKDIR /srv/app", "COPY pkg", "RUN curl", "RUN python3"):
            self.assertRegex(log, rf"# step \d/6 \(line \d\): {step}[^\n]* \(cached\)\n")
        self.assertIn("# layer cache: 4 steps cached", log)
        self.assertNotIn("built hello from kiln", log)
        self.assertEqual(LAYER_KEPT.findall(log), [])  # no new layer
        # the cached layers are snapshots the tenant keeps (they count against its snapshot limit)
        tenant = self.stack.db.sql(f"SELECT tenant_id FROM templates WHERE id = '{self.tmpl}'")
        kept = self.stack.db.sql(
            "SELECT count(*), min(s.size_bytes) > 0 FROM template_layers l JOIN snapshots s ON "
            f"s.id = l.snapshot_id WHERE l.tenant_id = '{tenant}' AND s.deleted_at IS NULL "
            f"AND s.kind = 'build' AND l.template_id = '{self.tmpl}'")
        self.assertEqual(kept, "4|t")
        sb = self.create({"template": "web-rebuilt"}).json()
        out = self.sh(sb, "cat /srv/app/fetched.txt /srv/app/name.txt; echo \"$GREETING\"; "
                          "curl -sf http://127.0.0.1:8081/name.txt")
        self.assertEqual(out["stdout"], FETCHED + "kilnpkg\nhello from kiln\nkilnpkg\n", out)

    def test_an_unsupported_instruction_or_a_too_large_context_changes_nothing(self):
        tmpl, version = self.template("refused")
        r = self.put_dockerfile(tmpl, version, "FROM base\nRUN true\nEXPOSE 80\n", expect=422)
        self.assertIn("Dockerfile line 3: EXPOSE is not supported", r.json()["error"]["message"])
        # no Dockerfile yet: the source is refused
        r = self.put_source(tmpl, version, context_tar({"a": "b"}), expect=409)
        self.assertIn("no Dockerfile", r.json()["error"]["message"])
        self.put_dockerfile(tmpl, version, "FROM base\nRUN true\n")
        r = self.put_source(tmpl, version, b"\0" * ((1 << 20) + 4096), expect=413)
        self.assertIn("template_source_max_bytes", r.json()["error"]["message"])
        got = self.gw.request("GET", f"/v1/templates/{tmpl}", None, self.key).json()
        self.assertEqual(got["versions"][0]["status"], "pending", got)

    def test_another_tenant_gets_404_on_every_template_route_and_cannot_create_from_it(self):
        o = self.other
        for method, path, body in (
                ("GET", f"/v1/templates/{self.tmpl}", None),
                ("GET", f"/v1/templates/{self.tmpl}/log?version={self.version}", None),
                ("PUT", f"/v1/templates/{self.tmpl}/dockerfile?version={self.version}", "FROM base\n"),
                ("PUT", f"/v1/templates/{self.tmpl}/source?version={self.version}", b"x" * 512),
                ("DELETE", f"/v1/templates/{self.tmpl}", None)):
            r = self.gw.request(method, path, body, o)
            self.assertEqual(r.status, 404, (method, path, r))
        self.create({"template": "web"}, key=o, expect=404)
        r = self.gw.request("GET", "/v1/templates", None, o)
        self.assertEqual(r.json()["templates"], [])
        self.assertEqual(self.gw.request("GET", f"/v1/templates/{self.tmpl}", None, self.key).status, 200)

    def test_the_sandbox_from_the_template_has_its_files_env_and_server_and_outlives_its_deletion(self):
        self.assertEqual(self.end["status"], "ready", (self.end, self.log))
        self.assertIn("built hello from kiln", self.log)
        self.assertIn("# step", self.log)
        # the CLI printed the same log as it came, and sent no path .dockerignore leaves out
        self.assertIn("built hello from kiln", self.cli.stderr)
        self.assertIn("3 left out by .dockerignore", self.cli.stderr)  # notes/ and what is in it
        self.assertIn("# .dockerignore: 0 paths of the context left out", self.log)
        got = self.gw.request("GET", f"/v1/templates/{self.tmpl}", None, self.key).json()
        self.assertEqual(got["latest_ready_version"], self.version)
        # the build ran in a sandbox of the tenant (billed as sandbox time), deleted once saved
        # (one builder, then one restored from each layer kept)
        builder = self.stack.db.sql(
            "SELECT count(*), bool_and(s.tenant_id = t.tenant_id), bool_and(s.deleted_at IS NOT NULL) "
            f"FROM sandboxes s, templates t WHERE t.id = '{self.tmpl}' "
            f"AND s.metadata->>'kiln.template_build' = '{self.tmpl}/{self.version}'")
        self.assertEqual(builder.split("|"), ["5", "t", "t"], builder)
        self.assertEqual(got["versions"][0]["env"], {"GREETING": "hello from kiln", "APP_HOME": "/srv/app"})
        # another shape is 422 naming the template's
        r = self.create({"template": "web", "memory_mib": 1024}, expect=422)
        self.assertIn("512 MiB", r.json()["error"]["message"])
        t0 = time.monotonic()
        sb = self.create({"template": "web"}).json()
        print(f"create from the built template: {time.monotonic() - t0:.2f} s", file=sys.stderr)
        env = dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=self.key["Authorization"][7:])
        p = subprocess.run([KILN, "create", "--template", "web"], env=env, capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{p.stdout.strip()}", None, self.key)
        self.assertEqual(self.sh({"id": p.stdout.strip()}, "cat /srv/app/name.txt")["stdout"], "kilnpkg\n")
        self.assertEqual(sb["memory_mib"], 512)
        snap = self.stack.db.sql(f"SELECT snapshot_id FROM template_versions WHERE template_id = '{self.tmpl}'"
                                 f" AND version = {self.version}")
        lineage = self.stack.db.sql(f"SELECT array_to_string(lineage, ',') FROM sandboxes WHERE id = '{sb['id']}'")
        self.assertIn(snap, lineage.split(","))
        out = self.sh(sb, "cat /srv/app/fetched.txt; cat /srv/app/name.txt; echo \"$GREETING|$APP_HOME\";"
                          " ls /srv/app/pkg | grep -v __pycache__; curl -sf http://127.0.0.1:8080/name.txt")
        self.assertEqual(out["exit_code"], 0, out)
        self.assertEqual(out["stdout"], FETCHED + "kilnpkg\nhello from kiln|/srv/app\n"
                         "__init__.py\nutil.py\nkilnpkg\n")
        out = self.sh(sb, "cd /srv/app && python3 -c 'import pkg.util; print(pkg.util.twice(21))'")
        self.assertEqual(out["stdout"], "42\n", out)
        # the build context is not left in the image
        out = self.sh(sb, "ls /var/tmp/kiln-build 2>&1 || true")
        self.assertIn("No such file", out["stdout"])
        # deleting the template leaves the sandbox running; no new sandbox comes from it
        layers = self.stack.db.sql(
            f"SELECT string_agg(quote_literal(snapshot_id), ',') FROM template_layers WHERE template_id = '{self.tmpl}'")
        self.assertEqual(layers.count(","), 3, layers)
        r = self.gw.request("DELETE", f"/v1/templates/{self.tmpl}", None, self.key)
        self.assertEqual(r.status, 204, r)
        # the layers its build kept go with it (their files once no image stands on them)
        self.assertEqual(self.stack.db.sql(
            f"SELECT count(*) FROM template_layers WHERE template_id = '{self.tmpl}'"), "0")
        self.assertEqual(self.stack.db.sql(
            f"SELECT count(*) FROM snapshots WHERE id IN ({layers}) AND deleted_at IS NULL"), "0")
        out = self.sh(sb, "curl -sf http://127.0.0.1:8080/name.txt && cat /srv/app/fetched.txt")
        self.assertEqual(out["stdout"], "kilnpkg\n" + FETCHED, out)
        self.create({"template": "web"}, expect=404)


    def test_two_sandboxes_made_back_to_back_from_one_template_are_distinct(self):
        # the base's pre-booted template: each create restores it copy-on-write with an identity
        # of its own
        template = self.base_template(self.stack.node)
        a = self.create({}, key=self.other).json()
        b = self.create({}, key=self.other).json()
        self.assertEqual(self.lineage(a), template, "the create did not restore the template")
        self.assertEqual(self.lineage(b), template)
        self.assertNotEqual(a["id"], b["id"])
        self.assertEqual(a["state"], "running")
        probe = ("hostname; echo $KILN_SANDBOX_ID; "
                 "python3 -c 'import os,random; print(os.urandom(16).hex()); print(random.random())'")
        pa = self.sh(a, probe, key=self.other)["stdout"].split()
        pb = self.sh(b, probe, key=self.other)["stdout"].split()
        self.assertEqual(pa[0], a["id"].replace("_", "-"))
        self.assertEqual(pb[0], b["id"].replace("_", "-"))
        self.assertEqual((pa[1], pb[1]), (a["id"], b["id"]))
        self.assertNotEqual(pa[2], pb[2], "os.urandom streams are shared")
        self.assertNotEqual(pa[3], pb[3], "random.random() is shared")
        self.sh(a, "echo mine > /root/only-a", key=self.other)
        out = self.sh(b, "ls /root/only-a 2>/dev/null || echo absent", key=self.other)["stdout"]
        self.assertEqual(out.strip(), "absent")
        before = time.time()
        guest = float(self.sh(a, "date +%s.%N", key=self.other)["stdout"])
        after = time.time()
        # set at the create, not the template's frozen time (which would read behind), and
        # keeping the host's time since (the guest booted with the host's TSC rate: told 2 GHz on
        # a 2.6 GHz host, its clock ran 30 % fast)
        self.assertGreaterEqual(guest, before - 1.0)
        self.assertLessEqual(guest, after + 1.0)


if __name__ == "__main__":
    sys.argv[1:] = sys.argv[1:] or ["test_templates_image", "test_templates_build"]
    sys.exit(test_egress.main())
