"""`kiln template list|rm` against a real kiln-gateway and Postgres: the listing's short and JSON
forms, removal by name and by id, and the failures (unknown template, another tenant's, a bad
command line) with their exit statuses."""
import json
import os
import subprocess
import unittest

from authtest import GatewayCase

KILN = os.path.join(os.environ["KILN_BUILD_DIR"], "cli", "kiln")
SHAPE = {"vcpus": 1, "memory_mib": 512, "disk_gib": 10}


class TemplateCli(GatewayCase):
    def kiln(self, key, *args, status=0):
        env = dict(os.environ, KILN_URL=self.gw.url, KILN_API_KEY=key)
        p = subprocess.run([KILN, *args], env=env, capture_output=True, timeout=60)
        self.assertEqual(p.returncode, status, "kiln %s: %s" % (" ".join(args), p.stderr.decode()))
        return p

    def test_list_and_rm(self):
        _, k, h = self.new_tenant("cli")
        key = k["key"]
        self.assertEqual(self.kiln(key, "template", "list").stdout, b"")
        web = self.expect(self.call("POST", "/v1/templates", dict(SHAPE, name="web"), h), 201).json()
        self.expect(self.call("POST", "/v1/templates", dict(SHAPE, name="web"), h), 201)
        job = self.expect(self.call("POST", "/v1/templates", dict(SHAPE, name="job"), h), 201).json()
        lines = self.kiln(key, "template", "list").stdout.decode().splitlines()
        self.assertEqual(lines, ["%s\tjob\tv1 pending\tready: none" % job["id"],
                                 "%s\tweb\tv2 pending\tready: none" % web["id"]])
        listed = json.loads(self.kiln(key, "--json", "template", "list").stdout)
        self.assertEqual([t["name"] for t in listed["templates"]], ["job", "web"])
        # Another tenant sees none of them and cannot remove them, by name or by id.
        _, other, _ = self.new_tenant("other")
        self.assertEqual(self.kiln(other["key"], "template", "list").stdout, b"")
        p = self.kiln(other["key"], "template", "rm", "web", status=1)
        self.assertIn('no template "web"', p.stderr.decode())
        p = self.kiln(other["key"], "template", "rm", web["id"], status=1)
        self.assertIn('no template \"%s\"' % web["id"], p.stderr.decode())
        # By name, then by id.
        self.kiln(key, "template", "rm", "web")
        self.kiln(key, "template", "rm", job["id"])
        self.assertEqual(self.kiln(key, "template", "list").stdout, b"")
        self.expect(self.call("GET", "/v1/templates/" + web["id"], headers=h), 404, "not_found")
        p = self.kiln(key, "template", "rm", "web", status=1)
        self.assertIn('no template "web"', p.stderr.decode())

    def test_bad_command_lines_exit_2(self):
        _, k, _ = self.new_tenant("usage")
        for args in (["template"], ["template", "ls"], ["template", "rm"],
                     ["template", "rm", "a", "b"], ["template", "rm", "tmpl_../x"]):
            with self.subTest(args=args):
                p = self.kiln(k["key"], *args, status=2)
                self.assertTrue(p.stderr.startswith(b"kiln: "), p.stderr)


if __name__ == "__main__":
    unittest.main()
