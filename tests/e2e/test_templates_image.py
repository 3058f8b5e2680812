"""Templates imported from an OCI image archive, unpacked by umoci inside the builder microVM.

Run by e2e_templates_build before its own cases, on its node and database (test_templates_build's
shared_stack(): one cold boot of the base's warm template for both) through a gateway of its own.

The test makes its own input on the host side: a tiny userland without Python (the host's static
busybox, an /etc/os-release, an account `app`) in two layers, the second deleting a file of the
first with a whiteout, written as an OCI image layout whose config sets ENV, WorkingDir and User,
and packed as an `oci-archive` tar; the same image is also turned into a `docker save` archive
(manifest.json with Config, RepoTags and Layers) by the host's skopeo, on the test's side only.
Kiln never reads either on the host: each is uploaded with
`PUT /v1/templates/{id}/source?format=oci-archive` and unpacked in the builder (the docker save
one converted there by skopeo first). The same image is also pushed by the host's skopeo to a
registry (Debian's docker-registry, with a password by htpasswd) that the test starts on the fake
internet of test_egress, and pulled with `PUT .../source?format=registry`: a puller VM of its own
pulls it with skopeo, the password never shows in the log, its sealed copy is gone
when the build ends, and neither it nor skopeo's auth form of it is in any file under the node's
data and run directories (the template's memory image and disk layers, the logs) or of a sandbox
made from the template;
a bad reference, a registry whose address the storage endpoints' check refuses and a malformed
body are refused (422, or 400 for a malformed body) and leave the version pending. The three
imports and the two failing archives below build at once, the Dockerfile FROM the import as soon as
it is ready. A sandbox created from the template runs exec in that userland (its /bin/sh, its files, the whiteout applied, the
ownership kept, no Python), whose WorkingDir and User are the defaults of an exec that names
neither; a Dockerfile `FROM` the imported template builds on it; an archive
that is neither an OCI layout nor a docker save archive fails its build naming why, and a version with a Dockerfile is 409.
"""
import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest
import urllib.request

import kiln
import test_egress
import test_templates_build

BUSYBOX = "/bin/busybox"  # the host's static busybox: the imported userland's only program
REGISTRY = "198.51.100.22:5000"  # other.test on the fake internet, the test's registry
REG_USER, REG_PASS = "kilnpull", "pw-" + os.urandom(8).hex()


def _tar(entries):
    """A tar (bytes) of entries (name, kind, data-or-target, uid, mode)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, data, uid, mode in entries:
            info = tarfile.TarInfo(name)
            info.uid = info.gid = uid
            info.mode = mode
            info.mtime = 1700000000
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "link":
                info.type = tarfile.SYMTYPE
                info.linkname = data
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def oci_archive():
    """An oci-archive (a tar of an OCI image layout) of a two-layer busybox userland."""
    with open(BUSYBOX, "rb") as f:
        bb = f.read()
    base = [("bin", "dir", None, 0, 0o755), ("bin/busybox", "file", bb, 0, 0o755)]
    for applet in ("sh", "cat", "echo", "ls", "id", "pwd", "stat", "tar", "rm", "mkdir", "cp",
                   "chown", "setsid", "sleep", "touch", "dirname", "env", "xargs", "rmdir", "sync",
                   "df", "tail", "head", "wc", "grep", "find", "mv", "ln", "chmod"):
        base.append((f"bin/{applet}", "link", "busybox", 0, 0o777))
    base += [("etc", "dir", None, 0, 0o755),
             ("etc/os-release", "file", b'NAME="Kiln mini"\nID=kilnmini\n', 0, 0o644),
             ("etc/passwd", "file", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n",
              0, 0o644),
             ("etc/group", "file", b"root:x:0:\napp:x:1000:\n", 0, 0o644),
             ("etc/gone.txt", "file", b"deleted by the next layer\n", 0, 0o644),
             ("home", "dir", None, 0, 0o755), ("home/app", "dir", None, 1000, 0o755),
             ("root", "dir", None, 0, 0o700)]
    top = [("etc", "dir", None, 0, 0o755), ("etc/.wh.gone.txt", "file", b"", 0, 0o644),
           ("srv", "dir", None, 0, 0o755), ("srv/app", "dir", None, 1000, 0o755),
           ("srv/app/hello.txt", "file", b"hello from the image\n", 1000, 0o644)]
    blobs, layers, diff_ids = {}, [], []

    def blob(data):
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d
    for entries in (base, top):
        raw = _tar(entries)
        gz = gzip.compress(raw, mtime=0)
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                       "digest": blob(gz), "size": len(gz)})
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Env": ["PATH=/bin", "GREETING=from the image"],
                                    "WorkingDir": "/srv/app", "User": "app"},
                         "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": blob(config), "size": len(config)},
                           "layers": layers}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": blob(manifest),
         "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}).encode()
    entries = [("oci-layout", "file", b'{"imageLayoutVersion": "1.0.0"}', 0, 0o644),
               ("index.json", "file", index, 0, 0o644), ("blobs", "dir", None, 0, 0o755),
               ("blobs/sha256", "dir", None, 0, 0o755)]
    entries += [(f"blobs/sha256/{d[7:]}", "file", data, 0, 0o644) for d, data in blobs.items()]
    return _tar(entries)


# archives that are no image: a bad manifest.json and no manifest at all, with what their builds
# fail naming
BAD = {"notoci": (_tar([("manifest.json", "file", b"[]", 0, 0o644)]), "not a docker save archive skopeo can read"),
       "notany": (_tar([("hello.txt", "file", b"hi\n", 0, 0o644)]),
                  "neither an oci-layout file nor a docker save manifest.json")}
# a Dockerfile FROM the imported template, and its context
ONMINI = "FROM mini\nRUN echo built on the import > /srv/built.txt\nCOPY note.txt /srv/\n"
ONMINI_CTX = _tar([("note.txt", "file", b"from the context\n", 0, 0o644)])


def docker_save_archive(oci):
    """The oci-archive `oci` as a `docker save` archive, made by the host's skopeo."""
    with tempfile.TemporaryDirectory(prefix="kiln-timage-") as d:
        with open(f"{d}/oci.tar", "wb") as f:
            f.write(oci)
        subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", f"oci-archive:{d}/oci.tar:latest",
                        f"docker-archive:{d}/docker.tar:kiln/mini:latest"], check=True)
        with open(f"{d}/docker.tar", "rb") as f:
            return f.read()


def start_registry(oci):
    """Debian's docker-registry on the fake internet (REGISTRY), with REG_USER's password in an
    htpasswd file, holding `oci` pushed as kiln/mini:v1 by the host's skopeo. Returns (the
    process, its directory)."""
    d = tempfile.mkdtemp(prefix="kiln-timage-reg-")
    htpasswd = subprocess.run(["htpasswd", "-Bbn", REG_USER, REG_PASS], check=True, capture_output=True,
                              text=True).stdout
    with open(f"{d}/htpasswd", "w") as f:
        f.write(htpasswd)
    with open(f"{d}/config.yml", "w") as f:
        f.write(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {d}/data\n"
                f"http:\n  addr: {REGISTRY}\nauth:\n  htpasswd:\n    realm: kiln-test\n"
                f"    path: {d}/htpasswd\n")
    p = subprocess.Popen(["ip", "netns", "exec", os.environ["KILN_E2E_INET_NS"], "docker-registry", "serve",
                          f"{d}/config.yml"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        host, port = REGISTRY.split(":")
        for _ in range(300):
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        with open(f"{d}/oci.tar", "wb") as f:
            f.write(oci)
        subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", "--dest-tls-verify=false",
                        f"--dest-creds={REG_USER}:{REG_PASS}", f"oci-archive:{d}/oci.tar:latest",
                        f"docker://{REGISTRY}/kiln/mini:v1"], check=True)
    except BaseException:
        p.kill()
        p.wait()
        shutil.rmtree(d, True)
        raise
    return p, d


class TemplateImageTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        oci = oci_archive()
        reg, regdir = start_registry(oci)
        cls.addClassCleanup(shutil.rmtree, regdir, True)
        cls.addClassCleanup(reg.wait)
        cls.addClassCleanup(reg.kill)
        # The node and database of test_templates_build's stack (one cold boot of the base's warm
        # template for both), through a gateway of their own: the registry's address is a
        # documentation one, refused unless storage_allow names it, and five builds run at once.
        cls.stack = test_templates_build.shared_stack()
        cls.gw = kiln.Gateway(cls.stack.db.url, kiln.services_env()["KILN_REDIS_URL"],
                              {"KILN_STORAGE_ALLOW": REGISTRY.split(":")[0], "KILN_TEMPLATE_MAX_BUILDS": "5"},
                              master_key=cls.stack.gw.master_key)
        cls.addClassCleanup(cls.gw.cleanup)
        cls.key = cls.stack.tenant("timage-a")
        cls.tmpl, v = cls.template("mini")
        cls.dtmpl, dv = cls.template("minidocker")
        cls.rtmpl, rv = cls.template("minipulled")
        t0 = time.monotonic()
        cls.put_source(cls.tmpl, v, oci, fmt="oci-archive")
        cls.put_source(cls.dtmpl, dv, docker_save_archive(oci), fmt="oci-archive")
        cls.put_source(cls.rtmpl, rv, json.dumps({"image": f"{REGISTRY}/kiln/mini:v1", "username": REG_USER,
                                                  "password": REG_PASS, "tls_verify": False}).encode(),
                       fmt="registry")
        # the two archives that fail (test_an_archive_that_is_not_...) build beside them
        cls.bad = {}
        for name, (data, _) in BAD.items():
            cls.bad[name] = cls.template(name)
            cls.put_source(*cls.bad[name], data, fmt="oci-archive")
        cls.log, cls.end = cls.follow(cls.tmpl, v)
        # a Dockerfile FROM the import (test_a_dockerfile_builds_...) as soon as it is ready
        if cls.end["status"] == "ready":
            cls.otmpl, ov = cls.template("onmini")
            r = cls.gw.request("PUT", f"/v1/templates/{cls.otmpl}/dockerfile?version={ov}", ONMINI,
                               dict(cls.key, **{"Content-Type": "text/plain"}))
            assert r.status == 204, r
            # a version holding a Dockerfile takes no image
            cls.onmini_image = cls.put_source(cls.otmpl, ov, ONMINI_CTX, fmt="oci-archive", expect=409)
            cls.put_source(cls.otmpl, ov, ONMINI_CTX)
        cls.dlog, cls.dend = cls.follow(cls.dtmpl, dv)
        cls.rlog, cls.rend = cls.follow(cls.rtmpl, rv)
        print(f"\nimage imports (oci-archive, docker save and registry pull, and two failing, at once): "
              f"{time.monotonic() - t0:.1f} s", file=sys.stderr)

    @classmethod
    def template(cls, name):
        r = cls.gw.request("POST", "/v1/templates", {"name": name, "vcpus": 1, "memory_mib": 512, "disk_gib": 10},
                           cls.key)
        assert r.status == 201, r
        return r.json()["id"], r.json()["version"]

    @classmethod
    def put_source(cls, tmpl, version, data, fmt=None, expect=202):
        q = f"&format={fmt}" if fmt else ""
        r = cls.gw.request("PUT", f"/v1/templates/{tmpl}/source?version={version}{q}", data,
                           dict(cls.key, **{"Content-Type": "application/x-tar"}), timeout=120)
        assert r.status == expect, r
        return r

    @classmethod
    def follow(cls, tmpl, version, timeout=900):
        """The build's log followed to its end: (text, the end event's data)."""
        req = urllib.request.Request(f"{cls.gw.url}/v1/templates/{tmpl}/log?version={version}",
                                     headers=dict(cls.key, Accept="text/event-stream"))
        text, event, end = [], None, None
        with urllib.request.urlopen(req, timeout=timeout) as r:
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
        return "".join(text), end

    def create(self, template):
        r = self.gw.request("POST", "/v1/sandboxes", {"template": template, "timeout_s": 3600}, self.key,
                            timeout=300)
        self.assertEqual(r.status, 201, r)
        self.addCleanup(self.gw.request, "DELETE", f"/v1/sandboxes/{r.json()['id']}", None, self.key)
        return r.json()

    def exec(self, sb, argv, **kw):
        r = self.gw.request("POST", f"/v1/sandboxes/{sb['id']}/exec", dict({"cmd": argv}, **kw), self.key,
                            timeout=120)
        self.assertEqual(r.status, 200, r)
        return r.json()

    def test_a_sandbox_from_the_imported_image_runs_exec_in_its_userland(self):
        self.assertEqual(self.end["status"], "ready", (self.end, self.log))
        self.assertIn("# unpacking oci:latest", self.log)
        got = self.gw.request("GET", f"/v1/templates/{self.tmpl}", None, self.key).json()["versions"][0]
        self.assertEqual((got["workdir"], got["user"]), ("/srv/app", "app"), got)
        # the image's Env (umoci may add HOME for the user)
        self.assertEqual({k: got["env"].get(k) for k in ("PATH", "GREETING")},
                         {"PATH": "/bin", "GREETING": "from the image"}, got)
        sb = self.create("mini")
        out = self.exec(sb, ["/bin/sh", "-c", "echo ok; cat /etc/os-release"], user="root")
        self.assertEqual((out["exit_code"], out["stdout"]), (0, 'ok\nNAME="Kiln mini"\nID=kilnmini\n'), out)
        # the whiteout of the second layer applied, its ownership kept, no Python, the image's ENV
        out = self.exec(sb, ["/bin/sh", "-c", "ls /etc/gone.txt; stat -c %u:%g /srv/app/hello.txt; "
                             "cat /srv/app/hello.txt; ls /usr/bin/python3 /usr/lib/python3 2>&1 | wc -l; "
                             "ls /usr; echo \"$GREETING\""], user="root")
        self.assertEqual(out["stdout"], "1000:1000\nhello from the image\n2\nlocal\nfrom the image\n", out)
        self.assertIn("gone.txt", out["stderr"])
        # the image's WorkingDir and User are the defaults of an exec that names neither
        out = self.exec(sb, ["/bin/sh", "-c", "pwd; id -u; echo mine > own.txt; stat -c %u own.txt"])
        self.assertEqual((out["exit_code"], out["stdout"]), (0, "/srv/app\n1000\n1000\n"), out)
        out = self.exec(sb, ["/bin/sh", "-c", "pwd; id -u"], cwd="/home", user="root")
        self.assertEqual(out["stdout"], "/home\n0\n", out)

    def test_a_docker_save_archive_is_converted_by_skopeo_in_the_builder(self):
        self.assertEqual(self.dend["status"], "ready", (self.dend, self.dlog))
        self.assertIn("# a docker save archive: converting its first image with skopeo", self.dlog)
        self.assertIn("# unpacking oci:latest", self.dlog)
        # the image's config came through the conversion
        got = self.gw.request("GET", f"/v1/templates/{self.dtmpl}", None, self.key).json()["versions"][0]
        self.assertEqual((got["workdir"], got["user"], got["env"].get("GREETING")),
                         ("/srv/app", "app", "from the image"), got)

    def test_an_image_pulled_from_a_registry_with_a_password(self):
        self.assertEqual(self.rend["status"], "ready", (self.rend, self.rlog))
        self.assertIn(f"# pulling {REGISTRY}/kiln/mini:v1", self.rlog)
        got = self.gw.request("GET", f"/v1/templates/{self.rtmpl}", None, self.key).json()["versions"][0]
        self.assertEqual((got["workdir"], got["user"], got["env"].get("GREETING")),
                         ("/srv/app", "app", "from the image"), got)
        # the password is in no log, and its sealed copy went with the build's end
        for text in (self.rlog, self.gw.output(), self.stack.gw.output(), self.stack.node.output()):
            self.assertNotIn(REG_PASS, text)
        self.assertEqual(self.stack.db.sql(
            "SELECT source_format, image_ref, registry_auth IS NULL FROM template_versions "
            f"WHERE template_id = '{self.rtmpl}'"), f"registry|{REGISTRY}/kiln/mini:v1|t")
        sb = self.create("minipulled")
        out = self.exec(sb, ["/bin/sh", "-c", "cat /srv/app/hello.txt; ls /etc/gone.txt"])
        self.assertEqual((out["stdout"], out["exit_code"]), ("hello from the image\n", 1), out)
        # The password, as typed and as the auth file skopeo read carries it, is in no file of the
        # node: the template's memory image (what every sandbox from it maps as its RAM), its disk
        # layers, the builders' files, the logs; nor in any file of the sandbox made from it.
        secret = (REG_PASS, base64.b64encode(f"{REG_USER}:{REG_PASS}".encode()).decode())
        t0 = time.monotonic()
        found = subprocess.run(["grep", "-r", "-l", "-a", "-F", "-D", "skip", "-e", secret[0], "-e", secret[1],
                                self.stack.node.data_dir, self.stack.node.run_dir],
                               capture_output=True, text=True)
        du = subprocess.run(["du", "-sb", "--apparent-size", self.stack.node.data_dir], capture_output=True,
                            text=True).stdout.split()[0]
        print(f"\nthe password searched for in {du} bytes of the node's files: "
              f"{time.monotonic() - t0:.1f} s", file=sys.stderr)
        self.assertEqual((found.returncode, found.stdout), (1, ""), found)
        out = self.exec(sb, ["/bin/sh", "-c", "find / /run /tmp -xdev -type f -print0 | "
                             "xargs -0 grep -l -F -e \"$0$1\" -e \"$2$3\"; echo end",
                             secret[0][:4], secret[0][4:], secret[1][:4], secret[1][4:]], user="root")
        self.assertEqual((out["stdout"], out["exit_code"]), ("end\n", 0), out)

    def test_a_pull_of_a_bad_reference_or_a_refused_registry_is_refused_and_changes_nothing(self):
        tmpl, v = self.template("badpull")
        for body, status, why in (({"image": "alpine:3.20"}, 422, "image: "),
                                  ({"image": f"{REGISTRY}/Kiln/Mini"}, 422, "image: "),
                                  ({"image": "127.0.0.1:5000/kiln/mini:v1"}, 422, "loopback address"),
                                  ({"image": "169.254.169.254/kiln/mini"}, 422, "link-local address"),
                                  ({"image": "10.1.2.3:5000/kiln/mini"}, 422, "private address"),
                                  ({"image": f"{REGISTRY}/kiln/mini:v1", "username": REG_USER}, 422, "both"),
                                  ({"image": f"{REGISTRY}/kiln/mini:v1", "tls_verify": "no"}, 400, "tls_verify"),
                                  ({"image": f"{REGISTRY}/kiln/mini:v1", "insecure": True}, 400, "unknown field"),
                                  (None, 400, "JSON object")):
            data = json.dumps(body).encode() if body is not None else b"not json"
            r = self.put_source(tmpl, v, data, fmt="registry", expect=status)
            self.assertIn(why, r.json()["error"]["message"], body)
            if "address" in why:
                self.assertIn("storage_allow", r.json()["error"]["message"])
        got = self.gw.request("GET", f"/v1/templates/{tmpl}", None, self.key).json()["versions"][0]
        self.assertEqual(got["status"], "pending", got)

    def test_a_dockerfile_builds_from_the_imported_template(self):
        self.assertEqual(self.end["status"], "ready", (self.end, self.log))
        # its Dockerfile and context were given in setUpClass, the image refused with 409
        self.assertIn("has a Dockerfile", self.onmini_image.json()["error"]["message"])
        log, end = self.follow(self.otmpl, 1)
        self.assertEqual(end["status"], "ready", (end, log))
        sb = self.create("onmini")
        out = self.exec(sb, ["/bin/sh", "-c", "cat /srv/built.txt /srv/note.txt /etc/os-release"], user="root")
        self.assertEqual(out["stdout"], 'built on the import\nfrom the context\nNAME="Kiln mini"\nID=kilnmini\n',
                         out)

    def test_an_archive_that_is_not_an_oci_layout_fails_its_build_naming_why(self):
        # a bad manifest.json and no manifest at all, built with the imports in setUpClass
        for name, (_, why) in BAD.items():
            log, end = self.follow(*self.bad[name])
            self.assertEqual(end["status"], "failed", (end, log))
            self.assertIn("unpacking the image failed", end["reason"])
            self.assertIn(why, log)
        r = self.put_source(*self.bad["notoci"], b"x", fmt="squashfs", expect=422)
        self.assertIn("format", r.json()["error"]["message"])


if __name__ == "__main__":
    sys.argv[1:] = sys.argv[1:] or ["test_templates_image"]
    sys.exit(test_egress.main())
