"""The template routes (docs/templates.md) through real HTTP against kiln-gateway and Postgres:
versions by name, shapes and bad input, tenant isolation, deletion and the per-tenant limits; the
build routes' checks before any node is involved (the Dockerfile parsed on upload, a source only
for a pending version with its Dockerfile, the log of a version not building), which node a build
goes to (one with room for its shape before one holding the tenant's layers) and creates naming
a template without a ready version (the builds themselves: tests/e2e/test_templates_build.py)."""
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import unittest

from authtest import GatewayCase

TIME_RE = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$"
SHAPE = {"vcpus": 1, "memory_mib": 512, "disk_gib": 10}


def spec(name, **extra):
    body = {"name": name}
    body.update(SHAPE)
    body.update(extra)
    return body


class TemplateRoutes(GatewayCase):
    def rows(self, tid):
        return self.db.sql("SELECT (SELECT count(*) FROM templates WHERE tenant_id = '%s'), "
                           "(SELECT count(*) FROM template_versions v JOIN templates t "
                           "ON t.id = v.template_id WHERE t.tenant_id = '%s')" % (tid, tid))

    def test_a_name_gets_versions_and_get_shows_them_newest_first(self):
        _, _, h = self.new_tenant("versions")
        r = self.expect(self.call("POST", "/v1/templates",
                                  spec("web", start_cmd="python3 -m http.server 8000",
                                       ready_cmd="curl -sf localhost:8000",
                                       egress={"rules": ["pypi.org"]}), h), 201)
        first = r.json()
        self.assertEqual(set(first), {"id", "name", "version"})
        self.assertRegex(first["id"], r"^tmpl_[a-z2-7]{26}$")
        self.assertEqual((first["name"], first["version"]), ("web", 1))
        r = self.expect(self.call("POST", "/v1/templates",
                                  {"name": "web", "vcpus": 2.5, "memory_mib": 1024, "disk_gib": 20}, h), 201)
        self.assertEqual(r.json(), {"id": first["id"], "name": "web", "version": 2})
        t = self.expect(self.call("GET", "/v1/templates/" + first["id"], headers=h), 200).json()
        self.assertEqual((t["id"], t["name"], t["latest_ready_version"]), (first["id"], "web", None))
        self.assertRegex(t["created_at"], TIME_RE)
        self.assertEqual([v["version"] for v in t["versions"]], [2, 1])
        v2, v1 = t["versions"]
        self.assertEqual((v2["vcpus"], v2["memory_mib"], v2["disk_gib"]), (2.5, 1024, 20))
        self.assertEqual((v2["start_cmd"], v2["ready_cmd"], v2["egress"]), (None, None, None))
        self.assertEqual((v1["vcpus"], v1["memory_mib"], v1["disk_gib"]), (1, 512, 10))
        self.assertEqual(v1["start_cmd"], "python3 -m http.server 8000")
        self.assertEqual(v1["ready_cmd"], "curl -sf localhost:8000")
        self.assertEqual(v1["egress"], {"rules": ["pypi.org"]})
        for v in (v1, v2):
            self.assertEqual((v["status"], v["reason"], v["finished_at"]), ("pending", None, None))
            self.assertRegex(v["created_at"], TIME_RE)
        # Another name is another template; the listing has both, newest first.
        other = self.expect(self.call("POST", "/v1/templates", spec("worker"), h), 201).json()
        self.assertNotEqual(other["id"], first["id"])
        self.assertEqual(other["version"], 1)
        listing = self.expect(self.call("GET", "/v1/templates", headers=h), 200).json()
        self.assertEqual([x["id"] for x in listing["templates"]], [other["id"], first["id"]])
        self.assertIsNone(listing["next_cursor"])
        # A listing carries each template's newest version only.
        item = listing["templates"][1]
        self.assertEqual(set(item), {"id", "name", "created_at", "latest_ready_version", "latest_version"})
        self.assertEqual(item["latest_version"], v2)
        self.assertIsNone(item["latest_ready_version"])
        page = self.expect(self.call("GET", "/v1/templates?limit=1", headers=h), 200).json()
        self.assertEqual([x["id"] for x in page["templates"]], [other["id"]])
        page = self.expect(self.call("GET", "/v1/templates?limit=1&cursor=" + page["next_cursor"],
                                     headers=h), 200).json()
        self.assertEqual([x["id"] for x in page["templates"]], [first["id"]])

    def test_bad_input_is_refused_naming_the_field_and_changes_nothing(self):
        tid, _, h = self.new_tenant("bad")
        cases = [
            ({"vcpus": 1, "memory_mib": 512, "disk_gib": 10}, 400, "name"),
            (spec("x", colour="red"), 400, "colour"),
            ({"name": "x", "memory_mib": 512, "disk_gib": 10}, 400, "vcpus"),
            (spec(""), 422, "name"),
            (spec("Web"), 422, "name"),
            (spec("-web"), 422, "name"),
            (spec("a/b"), 422, "name"),
            (spec("x" * 64), 422, "name"),
            (spec("base"), 422, "base"),
            (spec("python"), 422, "python"),
            (spec("tmpl_abc"), 422, "tmpl_"),
            (dict(spec("x"), vcpus=0.3), 422, "vcpus"),
            (dict(spec("x"), vcpus=9), 422, "vcpus"),
            (dict(spec("x"), memory_mib=128), 422, "memory_mib"),
            (dict(spec("x"), disk_gib=61), 422, "disk_gib"),
            (spec("x", start_cmd=""), 422, "start_cmd"),
            (spec("x", ready_cmd="a\u0000b"), 400, ""),
            (spec("x", start_cmd="x" * 4097), 413, "start_cmd"),
            (spec("x", egress=["pypi.org"]), 400, "egress"),
            (spec("x", egress={"rules": ["h%d.example.com" % i for i in range(1500)]}), 413, "egress"),
        ]
        code = {400: "bad_request", 413: "too_large", 422: "invalid"}
        for body, status, word in cases:
            with self.subTest(body=str(body)[:80]):
                r = self.expect(self.call("POST", "/v1/templates", body, h), status, code[status])
                self.assertIn(word, r.json()["error"]["message"])
        self.assertEqual(self.rows(tid), "0|0")
        self.expect(self.call("POST", "/v1/templates", spec("x" * 63), h), 201)

    def test_another_tenant_gets_404_everywhere_and_sees_nothing(self):
        _, _, ha = self.new_tenant("a")
        _, _, hb = self.new_tenant("b")
        a = self.expect(self.call("POST", "/v1/templates", spec("shared-name"), ha), 201).json()
        self.expect(self.call("GET", "/v1/templates/" + a["id"], headers=hb), 404, "not_found")
        self.expect(self.call("DELETE", "/v1/templates/" + a["id"], headers=hb), 404, "not_found")
        listing = self.expect(self.call("GET", "/v1/templates", headers=hb), 200)
        self.assertEqual(listing.json()["templates"], [])
        # The same name is B's own template, version 1, and does not touch A's.
        b = self.expect(self.call("POST", "/v1/templates", spec("shared-name"), hb), 201).json()
        self.assertNotEqual(b["id"], a["id"])
        self.assertEqual(b["version"], 1)
        t = self.expect(self.call("GET", "/v1/templates/" + a["id"], headers=ha), 200).json()
        self.assertEqual([v["version"] for v in t["versions"]], [1])

    def test_delete_is_204_then_404_and_frees_the_name(self):
        _, _, h = self.new_tenant("del")
        a = self.expect(self.call("POST", "/v1/templates", spec("gone"), h), 201).json()
        self.expect(self.call("POST", "/v1/templates", spec("gone"), h), 201)
        self.expect(self.call("DELETE", "/v1/templates/" + a["id"], headers=h), 204)
        self.expect(self.call("GET", "/v1/templates/" + a["id"], headers=h), 404, "not_found")
        self.expect(self.call("DELETE", "/v1/templates/" + a["id"], headers=h), 404, "not_found")
        self.expect(self.call("DELETE", "/v1/templates/tmpl_" + "a" * 26, headers=h), 404, "not_found")
        self.assertEqual(self.expect(self.call("GET", "/v1/templates", headers=h), 200).json()["templates"], [])
        again = self.expect(self.call("POST", "/v1/templates", spec("gone"), h), 201).json()
        self.assertNotEqual(again["id"], a["id"])
        self.assertEqual(again["version"], 1)

    def test_a_retry_with_the_same_idempotency_key_adds_no_second_version(self):
        tid, _, h = self.new_tenant("idem")
        hk = dict(h, **{"Idempotency-Key": "build-web-1"})
        first = self.expect(self.call("POST", "/v1/templates", spec("web"), hk), 201)
        again = self.expect(self.call("POST", "/v1/templates", spec("web"), hk), 201)
        self.assertEqual(again.json(), first.json())
        self.assertEqual(again.headers.get("Idempotent-Replayed"), "true")
        self.assertEqual(self.rows(tid), "1|1")
        self.expect(self.call("POST", "/v1/templates", spec("other"), hk), 422, "invalid")
        self.assertEqual(self.rows(tid), "1|1")

    def test_scopes_read_and_write(self):
        _, _, h = self.new_tenant("scopes")
        ro = {"Authorization": "Bearer " + self.new_key(h, ["sandbox:read"])["key"]}
        a = self.expect(self.call("POST", "/v1/templates", spec("s"), h), 201).json()
        self.expect(self.call("POST", "/v1/templates", spec("s"), ro), 403, "forbidden")
        self.expect(self.call("DELETE", "/v1/templates/" + a["id"], headers=ro), 403, "forbidden")
        self.expect(self.call("GET", "/v1/templates/" + a["id"], headers=ro), 200)
        self.expect(self.call("GET", "/v1/templates", headers=ro), 200)
        self.expect(self.call("GET", "/v1/templates"), 401, "unauthenticated")


class TemplateLimits(GatewayCase):
    EXTRA_ENV = {"KILN_TEMPLATE_MAX_PER_TENANT": "3", "KILN_TEMPLATE_MAX_VERSIONS": "2"}

    def test_templates_per_tenant_is_403_naming_the_limit_even_when_raced(self):
        tid, _, h = self.new_tenant("many")
        _, _, other = self.new_tenant("other")
        results = []

        def post(i):
            results.append(self.call("POST", "/v1/templates", spec("t%d" % i), h))
        threads = [threading.Thread(target=post, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.assertEqual(sorted(r.status for r in results), [201] * 3 + [403] * 5)
        for r in results:
            if r.status == 403:
                self.expect(r, 403, "quota_exceeded")
                self.assertIn("template_max_per_tenant", r.json()["error"]["message"])
        self.assertEqual(self.db.sql("SELECT count(*) FROM templates WHERE tenant_id = '%s'" % tid), "3")
        # A new version of an existing name is no new template; another tenant is not affected.
        made = [r.json() for r in results if r.status == 201]
        r = self.expect(self.call("POST", "/v1/templates", spec(made[0]["name"]), h), 201)
        self.assertEqual(r.json()["version"], 2)
        self.expect(self.call("POST", "/v1/templates", spec("fine"), other), 201)
        # Deleting one frees a place.
        self.expect(self.call("DELETE", "/v1/templates/" + made[1]["id"], headers=h), 204)
        self.expect(self.call("POST", "/v1/templates", spec("later"), h), 201)

    def test_versions_per_template_is_403_naming_the_limit(self):
        _, _, h = self.new_tenant("versions")
        for v in (1, 2):
            self.assertEqual(self.expect(self.call("POST", "/v1/templates", spec("v"), h), 201).json()["version"], v)
        r = self.expect(self.call("POST", "/v1/templates", spec("v"), h), 403, "quota_exceeded")
        self.assertIn("template_max_versions", r.json()["error"]["message"])
        t = self.expect(self.call("GET", "/v1/templates", headers=h), 200).json()["templates"]
        self.assertEqual([x["latest_version"]["version"] for x in t], [2])

    def test_the_dockerfile_is_parsed_on_upload_and_a_build_needs_it_and_a_pending_version(self):
        tid, _, h = self.new_tenant("builds")
        _, _, other = self.new_tenant("other")
        t = self.expect(self.call("POST", "/v1/templates", spec("web"), h), 201).json()
        base = "/v1/templates/" + t["id"]
        stored = "SELECT coalesce(dockerfile, '<none>') || '|' || status FROM template_versions WHERE template_id = '%s'"
        r = self.expect(self.call("PUT", base + "/dockerfile", "FROM base\nRUN true\nEXPOSE 80\n", h), 422, "invalid")
        self.assertIn("Dockerfile line 3: EXPOSE is not supported", r.json()["error"]["message"])
        self.assertEqual(self.db.sql(stored % t["id"]), "<none>|pending")
        # no Dockerfile yet: no build
        r = self.expect(self.call("PUT", base + "/source", b"tar", h), 409, "conflict")
        self.assertIn("no Dockerfile yet", r.json()["error"]["message"])
        self.expect(self.call("PUT", base + "/dockerfile?version=1", "FROM base\nRUN true\n", h), 204)
        self.assertEqual(self.db.sql(stored % t["id"]), "FROM base\nRUN true\n|pending")
        # the version named: another is 404, a malformed one 422; another tenant's template 404
        self.expect(self.call("PUT", base + "/dockerfile?version=2", "FROM base\n", h), 404, "not_found")
        self.expect(self.call("PUT", base + "/dockerfile?version=x", "FROM base\n", h), 422, "invalid")
        for method, path, body in (("PUT", "/dockerfile", "FROM base\n"), ("PUT", "/source", b"tar"),
                                   ("GET", "/log", None),
                                   # whose template is decided before the body is read: no 422
                                   ("PUT", "/dockerfile", "not a Dockerfile\n")):
            self.expect(self.call(method, base + path, body, other), 404, "not_found")
        # no node to build on: the version stays pending
        r = self.call("PUT", base + "/source", b"tar", h)
        self.assertEqual(r.status, 503, r)
        self.assertIn("no node can build now", r.json()["error"]["message"])
        self.assertEqual(self.db.sql(stored % t["id"]), "FROM base\nRUN true\n|pending")
        # the log of a version that is not building ends at once, with its status
        r = self.expect(self.call("GET", base + "/log", headers=h), 200)
        self.assertTrue(r.headers["Content-Type"].startswith("text/event-stream"), r.headers)
        self.assertIn('event: end\ndata: {"status":"pending","reason":null}', r.data.decode())
        # a version that is no longer pending takes no Dockerfile and no source
        self.db.sql("UPDATE template_versions SET status = 'failed' WHERE template_id = '%s'" % t["id"])
        r = self.expect(self.call("PUT", base + "/dockerfile", "FROM base\n", h), 409, "conflict")
        self.assertIn("is failed", r.json()["error"]["message"])
        self.expect(self.call("PUT", base + "/source", b"tar", h), 409, "conflict")

    def test_a_build_goes_to_a_node_with_room_before_one_holding_the_tenants_layers(self):
        tid, _, h = self.new_tenant("placement")
        t = self.expect(self.call("POST", "/v1/templates", spec("web"), h), 201).json()  # 512 MiB
        base = "/v1/templates/" + t["id"]
        self.expect(self.call("PUT", base + "/dockerfile", "FROM base\nRUN true\n", h), 204)
        # two live nodes that only listen: one without room for 512 MiB holding the tenant's
        # layers, one with room and none
        tmp = tempfile.mkdtemp(prefix="kiln-place-")
        self.addCleanup(shutil.rmtree, tmp, True)
        called = []

        def serve(ls, node):
            # the node's side: the call comes in and is closed unanswered
            try:
                conn, _ = ls.accept()
                called.append(node)
                conn.close()
            except OSError:
                pass

        for node, mib in (("node-place-full", 256), ("node-place-room", 4096)):
            path = os.path.join(tmp, node + ".sock")
            ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ls.bind(path)
            ls.listen(4)
            ls.settimeout(30)
            th = threading.Thread(target=serve, args=(ls, node), daemon=True)
            th.start()
            self.addCleanup(th.join)
            self.addCleanup(ls.close)
            self.addCleanup(ls.shutdown, socket.SHUT_RDWR)
            self.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
                        f"accelerator, image_hash) VALUES ('{node}', 'unix:{path}', 4000, {mib}, 10, 'qemu', "
                        "'kvm', 'x')")
            self.addCleanup(self.db.sql, f"UPDATE nodes SET down_at = now() WHERE id = '{node}'")
        self.db.sql("INSERT INTO template_layers (tenant_id, node_id, key, snapshot_id, template_id) VALUES "
                    f"('{tid}', 'node-place-full', '{'0' * 64}', 'snap_place', '{t['id']}')")
        self.addCleanup(self.db.sql, "DELETE FROM template_layers WHERE snapshot_id = 'snap_place'")
        r = self.call("PUT", base + "/source", b"tar", h)
        self.assertNotEqual(r.status, 202, r)  # the node never answered
        self.assertEqual(called, ["node-place-room"])

    def test_create_from_a_template_needs_a_ready_version_of_the_callers(self):
        _, _, h = self.new_tenant("creates")
        self.expect(self.call("POST", "/v1/templates", spec("web"), h), 201)
        r = self.expect(self.call("POST", "/v1/sandboxes", {"template": "web"}, h), 404, "not_found")
        self.assertIn('no template "web" with a ready version', r.json()["error"]["message"])
        self.expect(self.call("POST", "/v1/sandboxes", {"template": "nope"}, h), 404, "not_found")
        r = self.expect(self.call("POST", "/v1/sandboxes", {"template": "Not A Name"}, h), 422, "invalid")
        self.assertIn("template must be", r.json()["error"]["message"])
        r = self.expect(self.call("POST", "/v1/sandboxes", {"template": "web", "snapshot_id": "snap_x"}, h),
                        422, "invalid")
        self.assertIn("exclude each other", r.json()["error"]["message"])


class TemplateBuildsStuck(GatewayCase):
    """A version `building` whose node goes down, or whose build never ends, is failed naming the
    cause, with what the build held released (migrations/0034). The builds are rows as a node
    writes them while it builds (no VM): the node is a row whose heartbeat lapses."""

    EXTRA_ENV = {"KILN_IDEMPOTENCY_SWEEP_S": "1"}

    def building(self, h, name):
        """A template whose version 1 builds on a new live node in builder sandbox `sb`, with a
        line of log: (template id, node, builder)."""
        tid = self.expect(self.call("POST", "/v1/templates", spec(name), h), 201).json()["id"]
        self.expect(self.call("PUT", f"/v1/templates/{tid}/dockerfile", "FROM base\nRUN sleep 1d\n", h), 204)
        node, builder = "node-stuck-" + os.urandom(4).hex(), "sb_stuck" + os.urandom(4).hex()
        self.db.sql("INSERT INTO nodes (id, address, vcpu_milli, memory_mib, max_sandboxes, hypervisor, "
                    f"accelerator, image_hash) VALUES ('{node}', 'unix:/nonexistent', 4000, 4096, 10, 'qemu', "
                    "'kvm', 'x')")
        self.addCleanup(self.db.sql, f"UPDATE nodes SET down_at = now() WHERE id = '{node}'")
        self.db.sql("INSERT INTO sandboxes (id, tenant_id, node_id, state, template, vcpu_milli, memory_mib, "
                    "disk_gib, timeout_s, expires_at, metadata) SELECT '%s', tenant_id, '%s', 'running', "
                    "'base', 1000, 512, 10, 3600, now() + interval '1 hour', "
                    "jsonb_build_object('kiln.template_build', id || '/1') FROM templates WHERE id = '%s'"
                    % (builder, node, tid))
        self.db.sql(f"UPDATE template_versions SET status = 'building', node_id = '{node}', started_at = now(), "
                    f"builder_id = '{builder}' WHERE template_id = '{tid}' AND version = 1;"
                    "INSERT INTO template_build_log (template_id, version, chunk) "
                    f"VALUES ('{tid}', 1, '# step 1/1 (line 2): RUN sleep 1d\n')")
        return tid, node, builder

    def slot_free(self, tenant, tid):
        """Whether a pending version 2 of `tid` may start building under template_max_builds = 1
        (it is left building when it may)."""
        self.expect(self.call("POST", "/v1/templates", spec(self.name_of(tid)), self.h), 201)
        self.db.sql(f"UPDATE template_versions SET dockerfile = 'FROM base' WHERE template_id = '{tid}' "
                    "AND version = 2")
        quota = self.db.sql(f"SELECT quota FROM template_build_start('{tenant}', '{tid}', 2, 'nd', 1)")
        return quota == ""

    def name_of(self, tid):
        return self.db.sql(f"SELECT name FROM templates WHERE id = '{tid}'")

    def log_of(self, tid, version):
        """The build log's events: [(event, data)]."""
        r = self.expect(self.call("GET", f"/v1/templates/{tid}/log?version={version}", headers=self.h), 200)
        events, ev = [], None
        for line in r.data.decode().splitlines():
            if line.startswith("event: "):
                ev = line[7:]
            elif line.startswith("data: "):
                events.append((ev, json.loads(line[6:])))
        return events

    def test_a_build_whose_node_goes_down_fails_naming_it_and_releases_what_it_held(self):
        tenant, _, self.h = self.new_tenant("stuck")
        tid, node, builder = self.building(self.h, "web")
        self.assertFalse(self.slot_free(tenant, tid), "the running build holds the only slot")
        # the node's heartbeat lapses; a gateway marks it down (GET /v1/admin/nodes looks)
        self.db.sql(f"UPDATE nodes SET heartbeat_at = now() - interval '1 hour' WHERE id = '{node}'")
        self.expect(self.call("GET", "/v1/admin/nodes", headers=self.admin), 200)
        v1 = self.expect(self.call("GET", f"/v1/templates/{tid}", headers=self.h), 200).json()["versions"][-1]
        self.assertEqual(v1["status"], "failed")
        self.assertIn(f"the build node {node} went down during the build (its heartbeat lapsed",
                      v1["reason"])
        self.assertIsNotNone(v1["finished_at"])
        log = self.log_of(tid, 1)  # kept, the reason its last line
        self.assertEqual(log, [("log", {"text": "# step 1/1 (line 2): RUN sleep 1d\n"}),
                               ("log", {"text": v1["reason"] + "\n"}),
                               ("end", {"status": "failed", "reason": v1["reason"]})])
        # released: the builder's deletion asked for (its node carries it out when back), the
        # tenant's build slot; nothing is left building on the node
        self.assertEqual(self.db.sql(f"SELECT state, delete_requested_at IS NOT NULL FROM sandboxes "
                                     f"WHERE id = '{builder}'"), "lost|t")
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM template_versions WHERE node_id = '{node}' "
                                     "AND (status = 'building' OR builder_id IS NOT NULL)"), "0")
        self.assertTrue(self.slot_free(tenant, tid))
        # marked down again (another gateway that saw the lapse too) changes nothing more
        self.db.sql(f"UPDATE nodes SET down_at = NULL WHERE id = '{node}'")
        self.expect(self.call("GET", "/v1/admin/nodes", headers=self.admin), 200)
        self.assertEqual(self.db.sql(f"SELECT count(*) FROM template_build_log WHERE template_id = '{tid}' "
                                     "AND version = 1"), "2")

    def test_a_build_that_never_ends_on_a_live_node_is_failed_as_hung(self):
        tenant, _, self.h = self.new_tenant("hung")
        tid, node, builder = self.building(self.h, "web")
        # started longer ago than template_build_max_s (1800 s) and the grace (300 s)
        self.db.sql(f"UPDATE template_versions SET started_at = now() - interval '2101 seconds' "
                    f"WHERE template_id = '{tid}'")
        deadline = time.time() + 30
        while time.time() < deadline:
            v1 = self.expect(self.call("GET", f"/v1/templates/{tid}", headers=self.h), 200).json()["versions"][-1]
            if v1["status"] != "building":
                break
            time.sleep(0.5)
        self.assertEqual(v1["status"], "failed")
        self.assertEqual(v1["reason"], f"the build on node {node} did not end within template_build_max_s "
                         "(1800 s) and 300 s more: taken as hung")
        self.assertEqual(self.log_of(tid, 1)[-2:], [("log", {"text": v1["reason"] + "\n"}),
                                                    ("end", {"status": "failed", "reason": v1["reason"]})])
        self.assertEqual(self.db.sql(f"SELECT delete_requested_at IS NOT NULL FROM sandboxes "
                                     f"WHERE id = '{builder}'"), "t")
        self.assertTrue(self.slot_free(tenant, tid))


if __name__ == "__main__":
    unittest.main()
