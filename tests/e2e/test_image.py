"""The base image as a developer meets it: pip, npm, apt, git, curl and the ordinary account `user`.

One real sandbox on the fake internet of test_egress (its main() builds the host and internet
namespaces). On the internet side this test serves, over plain HTTP, a PEP 503 simple index with a
pure-python wheel it builds itself and a signed apt repository (api.test:8000), and a minimal npm
registry, a package document and its tarball (other.test:8000). `pip install` (outside a venv, as
root and as `user`) and `npm install` work when the sandbox's egress names the index and fail with
the tool's own error when its rules leave it out; `apt-get update && apt-get install` of a package
of the test repository (its Release signed with a key made for the run) works through the node's
network, and the package's command wins over busybox's applet of the same name.
"""
import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
import zipfile

import kiln
import test_egress

PIP_HOST, NPM_HOST, PORT = "198.51.100.21", "198.51.100.22", 8000  # api.test, other.test

SERVER = r'''
import http.server, os, sys
root = sys.argv[3]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        p = os.path.normpath(os.path.join(root, self.path.split("?")[0].lstrip("/")))
        if p != root and not p.startswith(root + "/"):
            p = "/nonexistent"
        if os.path.isdir(p):
            p = os.path.join(p, "_index")
        try:
            body = open(p, "rb").read()
        except OSError:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream" if not p.endswith("_index") else
                         "application/json" if body[:1] == b"{" else "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H)
print("ready", flush=True)
s.serve_forever()
'''


def sha256_b64(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel():
    """A pure-python wheel of `kilnpkg` 1.0: its file name and bytes."""
    files = {
        "kilnpkg/__init__.py": b"ANSWER = 42\n",
        "kilnpkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: kilnpkg\nVersion: 1.0\n",
        "kilnpkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: kiln-test\n"
                                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
        "kilnpkg-1.0.dist-info/top_level.txt": b"kilnpkg\n",
    }
    record = "".join(f"{n},sha256={sha256_b64(d)},{len(d)}\n" for n, d in files.items())
    record += "kilnpkg-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr("kilnpkg-1.0.dist-info/RECORD", record)
    return "kilnpkg-1.0-py3-none-any.whl", buf.getvalue()


def make_npm_tarball():
    """The npm tarball of `kiln-pkg` 1.0.0 (package/package.json, package/index.js)."""
    files = {
        "package/package.json": json.dumps({"name": "kiln-pkg", "version": "1.0.0",
                                            "main": "index.js"}).encode(),
        "package/index.js": b"module.exports = 42;\n",
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for n, d in files.items():
            ti = tarfile.TarInfo(n)
            ti.size, ti.mode, ti.mtime = len(d), 0o644, 1700000000
            t.addfile(ti, io.BytesIO(d))
    return buf.getvalue()


# The test repository's package: `wget`, whose command busybox also has (build-image.sh links the
# applet in /usr/local/lib/busybox, last on PATH), so the installed one must win.
APT_SCRIPT = b"#!/bin/sh\necho kiln-wget 99\n"


def make_apt_repo(folder):
    """A flat apt repository in `folder` (the .deb, Packages, Release and its clearsigned
    InRelease) signed with a throwaway ed25519 key; returns the key's public keyring (bytes)."""
    work = tempfile.mkdtemp(prefix="kiln-image-apt-")
    try:
        pkg = os.path.join(work, "pkg")
        os.makedirs(os.path.join(pkg, "DEBIAN"))
        os.makedirs(os.path.join(pkg, "usr", "bin"))
        with open(os.path.join(pkg, "DEBIAN", "control"), "w") as f:
            f.write("Package: wget\nVersion: 99.0-1\nArchitecture: all\n"
                    "Maintainer: Kiln tests <tests@kiln.invalid>\nDescription: a test package\n")
        with open(os.path.join(pkg, "usr", "bin", "wget"), "wb") as f:
            f.write(APT_SCRIPT)
        os.chmod(os.path.join(pkg, "usr", "bin", "wget"), 0o755)
        os.makedirs(folder)
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", pkg,
                        os.path.join(folder, "wget_99.0-1_all.deb")], check=True, capture_output=True)
        packages = subprocess.run(["dpkg-scanpackages", "-m", "."], cwd=folder, check=True,
                                  capture_output=True).stdout
        with open(os.path.join(folder, "Packages"), "wb") as f:
            f.write(packages)
        release = ("Origin: kiln-test\nLabel: kiln-test\nSuite: kiln\nCodename: kiln\n"
                   "Date: Sat, 01 Jan 2000 00:00:00 UTC\nArchitectures: all amd64\nSHA256:\n"
                   f" {hashlib.sha256(packages).hexdigest()} {len(packages)} Packages\n")
        with open(os.path.join(folder, "Release"), "w") as f:
            f.write(release)
        home = os.path.join(work, "gpg")
        os.mkdir(home, 0o700)
        gpg = ["gpg", "--homedir", home, "--batch", "--quiet", "--pinentry-mode", "loopback",
               "--passphrase", ""]
        try:
            subprocess.run(gpg + ["--quick-gen-key", "Kiln test repository <tests@kiln.invalid>",
                                  "ed25519", "sign", "1d"], check=True, capture_output=True)
            subprocess.run(gpg + ["--yes", "--clearsign", "-o", os.path.join(folder, "InRelease"),
                                  os.path.join(folder, "Release")], check=True, capture_output=True)
            return subprocess.run(gpg + ["--export"], check=True, capture_output=True).stdout
        finally:
            subprocess.run(["gpgconf", "--homedir", home, "--kill", "all"], capture_output=True)
    finally:
        shutil.rmtree(work, True)


class ImageTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.www = tempfile.mkdtemp(prefix="kiln-image-www-")
        cls.addClassCleanup(shutil.rmtree, cls.www, True)
        # PEP 503: /simple/ lists projects, /simple/<project>/ links its files with their hash.
        whl, data = make_wheel()
        os.makedirs(os.path.join(cls.www, "pip", "simple", "kilnpkg"))
        os.makedirs(os.path.join(cls.www, "pip", "files"))
        with open(os.path.join(cls.www, "pip", "files", whl), "wb") as f:
            f.write(data)
        with open(os.path.join(cls.www, "pip", "simple", "_index"), "w") as f:
            f.write('<html><body><a href="kilnpkg/">kilnpkg</a></body></html>\n')
        with open(os.path.join(cls.www, "pip", "simple", "kilnpkg", "_index"), "w") as f:
            f.write(f'<html><body><a href="../../files/{whl}#sha256='
                    f'{hashlib.sha256(data).hexdigest()}">{whl}</a></body></html>\n')
        # npm: GET /<name> is the package document, its dist.tarball the .tgz.
        tgz = make_npm_tarball()
        os.makedirs(os.path.join(cls.www, "npm", "kiln-pkg", "-"))
        with open(os.path.join(cls.www, "npm", "kiln-pkg", "-", "kiln-pkg-1.0.0.tgz"), "wb") as f:
            f.write(tgz)
        doc = {"name": "kiln-pkg", "dist-tags": {"latest": "1.0.0"},
               "versions": {"1.0.0": {"name": "kiln-pkg", "version": "1.0.0", "main": "index.js",
                                      "dist": {"tarball": f"http://other.test:{PORT}/kiln-pkg/-/kiln-pkg-1.0.0.tgz",
                                               "shasum": hashlib.sha1(tgz).hexdigest(),
                                               "integrity": "sha512-" + base64.b64encode(
                                                   hashlib.sha512(tgz).digest()).decode()}}}}
        with open(os.path.join(cls.www, "npm", "kiln-pkg", "_index"), "w") as f:
            json.dump(doc, f)
        cls.apt_key = make_apt_repo(os.path.join(cls.www, "pip", "apt"))
        cls.servers = []
        for addr, sub in ((PIP_HOST, "pip"), (NPM_HOST, "npm")):
            p = subprocess.Popen(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], sys.executable,
                                  "-c", SERVER, addr, str(PORT), os.path.join(cls.www, sub)],
                                 stdout=subprocess.PIPE, text=True)
            cls.servers.append(p)
            cls.addClassCleanup(p.wait)
            cls.addClassCleanup(p.kill)
            assert p.stdout.readline().strip() == "ready"

        cls.stack = kiln.Stack(node_env={"KILN_DNS_UPSTREAM": "192.0.2.53"})
        cls.addClassCleanup(cls.stack.cleanup)
        cls.gw = cls.stack.gw
        cls.key = cls.stack.tenant()
        r = cls.gw.request("POST", "/v1/sandboxes", {"memory_mib": 512, "timeout_s": 3600},
                           cls.key, timeout=300)
        assert r.status == 201, r
        cls.sb = r.json()

    def sh(self, script, timeout=600):
        """Runs `sh -c script` in the sandbox as root: (exit code, stdout, stderr)."""
        r = self.gw.request("POST", f"/v1/sandboxes/{self.sb['id']}/exec",
                            {"cmd": ["sh", "-c", script], "timeout_s": timeout}, self.key,
                            timeout=timeout + 30)
        self.assertEqual(r.status, 200, r)
        out = r.json()
        return out["exit_code"], out["stdout"], out["stderr"]

    def egress(self, rules):
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.sb['id']}/egress", {"rules": rules}, self.key)
        self.assertEqual(r.status, 200, r)

    def test_the_base_tools_are_there(self):
        code, out, err = self.sh("git --version && python3 -m venv --help >/dev/null && pip --version"
                                 " && node --version && npm --version && apt-get --version | head -n1"
                                 " && curl --version | head -n1 && sudo --version | head -n1"
                                 " && ls /usr/lib/python3*/EXTERNALLY-MANAGED 2>/dev/null; "
                                 "cat /etc/apt/sources.list")
        self.assertEqual(code, 0, (out, err))
        self.assertIn("git version", out)
        self.assertIn("pip ", out)
        self.assertIn("apt ", out)
        self.assertIn("curl ", out)
        self.assertNotIn("EXTERNALLY-MANAGED", out)
        self.assertIn("deb http://deb.debian.org/debian bookworm main", out)

    def test_user_exists_with_its_home_and_passwordless_sudo(self):
        code, out, err = self.sh("getent passwd user; stat -c '%u:%g %n' /home/user; "
                                 "id -nG user; su user -c 'id -u; id -g; echo $HOME; sudo -n id -u'")
        self.assertEqual(code, 0, (out, err))
        lines = out.split("\n")
        self.assertRegex(lines[0], r"^user:x:1000:1000::/home/user:/bin/bash$")
        self.assertEqual(lines[1], "1000:1000 /home/user")
        self.assertIn("sudo", lines[2].split())
        self.assertEqual(lines[3:7], ["1000", "1000", "/home/user", "0"])

    def test_pip_install_from_an_allowed_index_and_a_clean_error_without(self):
        pip = (f"pip install --no-cache-dir --disable-pip-version-check --retries 0 --timeout 15"
               f" --index-url http://api.test:{PORT}/simple/ --trusted-host api.test kilnpkg")
        # Rules that leave the index out: its name does not resolve; pip says it found nothing.
        self.egress(["other.test"])
        code, out, err = self.sh(pip)
        self.assertNotEqual(code, 0, (out, err))
        self.assertIn("No matching distribution found for kilnpkg", err)
        code, out, _ = self.sh("python3 -c 'import kilnpkg'")
        self.assertNotEqual(code, 0)
        self.egress(["api.test"])
        # As `user` (no venv: a user install under ~/.local), then as root (system-wide).
        code, out, err = self.sh(f"su user -c '{pip}' && su user -c 'python3 -c \"import kilnpkg; "
                                 f"print(kilnpkg.__file__)\"'")
        self.assertEqual(code, 0, (out, err))
        self.assertIn("/home/user/.local/lib/python3", out)
        code, out, err = self.sh(f"{pip} && cd / && python3 -c 'import kilnpkg; print(kilnpkg.ANSWER, kilnpkg.__file__)'")
        self.assertEqual(code, 0, (out, err))
        self.assertIn("42 /usr/local/lib/python3", out)

    def test_npm_install_from_an_allowed_registry_and_a_clean_error_without(self):
        npm = (f"mkdir -p /tmp/np && cd /tmp/np && npm install --no-audit --no-fund"
               f" --no-update-notifier --fetch-retries=0 --fetch-timeout=30000"
               f" --registry http://other.test:{PORT}/ kiln-pkg")
        self.egress(["api.test"])
        code, out, err = self.sh(npm)
        self.assertNotEqual(code, 0, (out, err))
        self.assertIn("ENOTFOUND", err)
        self.egress(["other.test"])
        code, out, err = self.sh(npm + " && node -e 'console.log(require(\"kiln-pkg\"))'")
        self.assertEqual(code, 0, (out, err))
        self.assertEqual(out.split("\n")[-2], "42")

    def test_apt_installs_from_a_signed_repository_and_the_package_shadows_busybox(self):
        # busybox's wget until a package brings its own; its applets are on every PATH
        code, out, err = self.sh("command -v wget; su user -c 'command -v ip'; sudo -n sh -c 'command -v ps';"
                                 " su - user -c 'command -v ping'; ls /usr/local/bin")
        self.assertEqual(code, 0, (out, err))
        self.assertEqual(out.split("\n")[:4], ["/usr/local/lib/busybox/wget", "/usr/local/lib/busybox/ip",
                                                "/usr/local/lib/busybox/ps", "/usr/local/lib/busybox/ping"])
        self.assertNotIn("wget", out.split("\n")[4:], "a busybox link in /usr/local/bin")
        # the repository's key through the files API (its parent folder made on the way)
        r = self.gw.request("PUT", f"/v1/sandboxes/{self.sb['id']}/files?path=/etc/apt/keyrings/kiln/test.gpg",
                            self.apt_key, dict(self.key, **{"Content-Type": "application/octet-stream"}))
        self.assertEqual(r.status, 204, r)
        self.egress(["api.test"])
        code, out, err = self.sh(
            f"echo 'deb [signed-by=/etc/apt/keyrings/kiln/test.gpg] http://api.test:{PORT}/apt/ ./' "
            "> /etc/apt/sources.list.d/kiln-test.list && mv /etc/apt/sources.list /root/sources.list.debian"
            " && apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget;"
            " rc=$?; mv /root/sources.list.debian /etc/apt/sources.list; exit $rc")
        self.assertEqual(code, 0, (out, err))
        self.assertIn(f"http://api.test:{PORT}/apt ./ InRelease", out)
        self.assertNotIn("NO_PUBKEY", out + err)
        code, out, err = self.sh("command -v wget; wget; dpkg-query -W wget; su - user -c wget")
        self.assertEqual((code, out), (0, "/usr/bin/wget\nkiln-wget 99\nwget\t99.0-1\nkiln-wget 99\n"),
                         err)

    def test_a_file_written_as_user_makes_its_parents_its_own(self):
        base = f"/v1/sandboxes/{self.sb['id']}/files"
        octet = dict(self.key, **{"Content-Type": "application/octet-stream"})
        r = self.gw.request("PUT", base + "?path=/home/user/a/b/c.txt&user=user", b"deep\n", octet)
        self.assertEqual(r.status, 204, r)
        code, out, err = self.sh("cd /home/user && stat -c '%u:%g %a %n' a a/b a/b/c.txt && cat a/b/c.txt")
        self.assertEqual((code, out), (0, "1000:1000 755 a\n1000:1000 755 a/b\n1000:1000 644 a/b/c.txt\ndeep\n"),
                         err)
        # where the user may not make the folder: 403, and nothing made
        r = self.gw.request("PUT", base + "?path=/etc/kiln-probe-dir/x&user=user", b"x", octet)
        self.assertEqual(r.status, 403, r)
        # under a file: 404
        r = self.gw.request("PUT", base + "?path=/home/user/a/b/c.txt/d", b"x", octet)
        self.assertEqual(r.status, 404, r)
        code, out, err = self.sh("ls -d /etc/kiln-probe-dir 2>&1; ls /home/user/a/b")
        self.assertEqual(out, "ls: cannot access '/etc/kiln-probe-dir': No such file or directory\nc.txt\n")

    def test_curl_reaches_an_allowed_server_only(self):
        self.egress(["api.test"])
        code, out, err = self.sh(f"curl -fsS --max-time 20 http://api.test:{PORT}/simple/")
        self.assertEqual(code, 0, (out, err))
        self.assertIn('href="kilnpkg/"', out)
        code, out, err = self.sh(f"curl -fsS --max-time 10 http://{NPM_HOST}:{PORT}/kiln-pkg")
        self.assertNotEqual(code, 0, (out, err))


if __name__ == "__main__":
    sys.argv[1:] = sys.argv[1:] or ["test_image"]
    sys.exit(test_egress.main())
