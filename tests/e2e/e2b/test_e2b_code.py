"""E2B's code interpreter SDK (npm `@e2b/code-interpreter`, pinned by package-lock.json) against a
real Kiln: a gateway with its E2B listeners, a kiln-node with QEMU microVMs of the
code-interpreter-v1 image (vmm/guest/codeint/), Postgres and Redis. The SDK is configured by
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY alone; check_code.mjs says what it asserts. The node
builds its warm templates first, so both sandboxes are restores of the code interpreter's
snapshot, whose worker has numpy, pandas and matplotlib imported already.
"""
import json
import os
import subprocess
import time
import unittest

import kiln

HERE = os.path.dirname(os.path.abspath(__file__))
READY = "(code interpreter) of"


class E2bCode(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        kiln.npm_modules(HERE)
        cls.stack = kiln.Stack(e2b=True, node_env={"KILN_TEMPLATES": "true",
                                                   "KILN_TEMPLATE_DEFAULT": "true"})
        cls.addClassCleanup(cls.stack.cleanup)

    def test_run_code(self):
        self.assertTrue(kiln.guest_image().get("KILN_GUEST_CODEINT_ROOTFS"),
                        "build-image.sh --print-env gave no code interpreter image")
        r = self.stack.gw.request("POST", "/v1/tenants", {"name": "e2b-code"}, self.stack.admin)
        self.assertEqual(r.status, 201, r)
        key = r.json()["api_key"]["key"]
        # The code interpreter's warm template (booted, its worker answering, snapshotted).
        t0 = time.monotonic()
        while READY not in self.stack.node.output():
            self.assertLess(time.monotonic() - t0, 900, self.stack.node.output()[-3000:])
            self.assertTrue(self.stack.node.alive(), self.stack.node.output()[-3000:])
            time.sleep(1)
        print(f"code interpreter template ready after {time.monotonic() - t0:.1f} s", flush=True)
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
               "E2B_API_URL": self.stack.gw.e2b_url, "E2B_API_KEY": key,
               "E2B_SANDBOX_URL": self.stack.gw.e2b_sandbox_url}
        t0 = time.monotonic()
        out = subprocess.run(["node", "check_code.mjs"], cwd=HERE, env=env, capture_output=True,
                             text=True, timeout=600)
        took = time.monotonic() - t0
        lines = out.stdout.strip().splitlines()
        seen = json.loads(lines[-1]) if lines else {}
        self.assertEqual(out.returncode, 0, f"{seen.get('failure')}\nsteps: {seen.get('steps')}\n"
                                            f"{out.stderr[-3000:]}")
        self.assertTrue(seen["ok"])
        self.assertEqual([s if isinstance(s, str) else next(iter(s)) for s in seen["steps"]],
                         ["create", "state", "stdout", "error", "dataframe", "chart", "contexts",
                          "token", "getHost", "reseeded", "kill"])
        sandbox = seen["steps"][0]["create"]
        # A Kiln sandbox of the built-in template, made from its warm snapshot.
        rows = self.stack.db.sql(f"SELECT template FROM sandboxes WHERE id = '{sandbox}'")
        self.assertIn("code-interpreter-v1", rows)
        print(f"code interpreter SDK run: {took:.1f} s", flush=True)


if __name__ == "__main__":
    unittest.main()
