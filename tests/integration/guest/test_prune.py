"""vmm/guest/build-image.sh --prune keeps what a kiln-node pinned (node/images.h): in a cache of
its own (KILN_IMAGE_CACHE, a temporary directory; nothing is built), an image directory of another
recipe with a `.kiln-pin-<node>` file stays, with the base tarball its `base-key` names, while an
unpinned one and an unused tarball go; the pin's removal lets the next prune remove it too."""
import os
import shutil
import subprocess
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "vmm", "guest",
                      "build-image.sh")


class PruneTests(unittest.TestCase):
    def prune(self, cache):
        out = subprocess.run(["bash", SCRIPT, "--prune"], env=dict(os.environ, KILN_IMAGE_CACHE=cache),
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stderr

    def test_a_pinned_image_and_its_base_stay_an_unpinned_one_goes(self):
        cache = tempfile.mkdtemp(prefix="kiln-prune-")
        self.addCleanup(shutil.rmtree, cache, True)
        for h, key in (("a" * 64, "k1"), ("b" * 64, "k2")):
            os.makedirs(os.path.join(cache, h))
            with open(os.path.join(cache, h, "base-key"), "w") as f:
                f.write(key + "\n")
            open(os.path.join(cache, h, ".complete"), "w").close()
            open(os.path.join(cache, f"base-{key}.tar"), "w").close()
        pin = os.path.join(cache, "a" * 64, ".kiln-pin-node1")
        open(pin, "w").close()
        err = self.prune(cache)
        self.assertTrue(os.path.isdir(os.path.join(cache, "a" * 64)), err)
        self.assertTrue(os.path.exists(os.path.join(cache, "base-k1.tar")), err)
        self.assertIn(".kiln-pin-node1", err)
        self.assertFalse(os.path.exists(os.path.join(cache, "b" * 64)), err)
        self.assertFalse(os.path.exists(os.path.join(cache, "base-k2.tar")), err)
        os.unlink(pin)
        self.prune(cache)
        self.assertFalse(os.path.exists(os.path.join(cache, "a" * 64)))
        self.assertFalse(os.path.exists(os.path.join(cache, "base-k1.tar")))


if __name__ == "__main__":
    unittest.main()
