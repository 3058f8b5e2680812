#!/usr/bin/python3
"""Runs the Firecracker driver's test against the spec-validating stand-in, then checks its log.

No VM runs here: fc_standin.py answers Firecracker's API as its published OpenAPI document says
(see its docstring and docs/firecracker.md). This script
  1. makes a scratch directory with stand-in image files and two fake Firecracker installs (a
     `firecracker` wrapper around fc_standin.py and a `jailer` beside it, fake_jailer.py), one
     of which injects a 400 on PUT /drives/rootfs;
  2. runs test_vmm_firecracker (C, links kiln_vmm), which drives the vmm API;
  3. asserts the exact API calls each VM received, in order, with their bodies, that every one of
     them validated against the spec, and the jailer command lines;
  4. checks that the stand-in catches spec violations and Firecracker's ordering rules (negative
     tests, sent directly over its socket).
Exit 1 when not root (the driver chowns jail files and makes cgroups: a missing privilege is a
failure, never a skip) and without the spec (it is vendored in tests/fixtures/firecracker/).
"""
import argparse
import glob
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FAILURES = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        FAILURES.append(what)


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=5)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self.path)


def request(sock, method, path, body=None, raw=None):
    c = UnixHTTP(sock)
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, (json.loads(out) if out else None)


def write_exe(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)


def fake_install(d, spec, log, fail=""):
    os.makedirs(d)
    env = "FC_STANDIN_SPEC='%s' FC_STANDIN_LOG='%s' FC_STANDIN_FAIL='%s'" % (spec, log, fail)
    write_exe(os.path.join(d, "jailer"),
              "#!/bin/sh\n%s exec /usr/bin/python3 '%s/fake_jailer.py' \"$@\"\n" % (env, HERE))
    write_exe(os.path.join(d, "firecracker"),
              "#!/bin/sh\n%s exec /usr/bin/python3 '%s/fc_standin.py' \"$@\"\n" % (env, HERE))
    return os.path.join(d, "firecracker")


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def calls(log, vm):
    """The API calls and vsock handshakes of one VM, as compact strings."""
    out = []
    for r in log:
        if r.get("vm") != vm:
            continue
        if "vsock" in r:
            out.append("vsock %s %s" % (r["vsock"], "accepted" if r["accepted"] else "refused"))
        elif "method" in r:
            out.append("%s %s %d" % (r["method"], r["path"], r["status"]))
    return out


def body_of(log, vm, method, path):
    for r in log:
        if r.get("vm") == vm and r.get("method") == method and r.get("path") == path:
            return r["body"]
    return None


def drives_after(log, vm, method, path):
    """The stand-in's drives after a VM's first accepted `method path`, or {}."""
    for r in log:
        if r.get("vm") == vm and r.get("method") == method and r.get("path") == path and "drives" in r:
            return r["drives"]
    return {}


def check_driver_log(log):
    boot = "console=ttyS0 reboot=k panic=1 pci=off quiet kiln.test=1"
    create = ["GET / 200", "PUT /machine-config 204", "PUT /boot-source 204", "PUT /drives/rootfs 204",
              "PUT /network-interfaces/eth0 204", "PUT /vsock 204", "PUT /actions 204"]
    check(calls(log, "fc-a") == create + [
        "GET / 200", "vsock CONNECT 1024 accepted", "PATCH /vm 204", "GET / 200", "GET / 200",
        "PUT /snapshot/create 204"], "fc-a: create, status, agent, pause, status, snapshot: exact calls")
    check(body_of(log, "fc-a", "PUT", "/machine-config") ==
          {"vcpu_count": 2, "mem_size_mib": 128, "smt": False}, "fc-a: machine-config body")
    check(body_of(log, "fc-a", "PUT", "/boot-source") ==
          {"kernel_image_path": "/kernel", "initrd_path": "/initrd", "boot_args": boot},
          "fc-a: boot-source body")
    # 1.5 vCPU is 2 whole ones: 2 x 2000 ops/s and 2 x 64 MiB/s, one second's tokens a bucket
    limited = {"bandwidth": {"size": 2 * (64 << 20), "refill_time": 1000, "one_time_burst": 0},
               "ops": {"size": 2 * 2000, "refill_time": 1000, "one_time_burst": 0}}
    check(body_of(log, "fc-a", "PUT", "/drives/rootfs") ==
          {"drive_id": "rootfs", "path_on_host": "/rootfs", "is_root_device": True, "is_read_only": False,
           "rate_limiter": limited},
          "fc-a: drive body with its rate limiter (iops and MiB/s per whole vCPU)")
    check(body_of(log, "fc-d", "PUT", "/drives/rootfs") ==
          {"drive_id": "rootfs", "path_on_host": "/rootfs", "is_root_device": True, "is_read_only": False},
          "fc-d: no limits (0 = none): no rate limiter")
    check(body_of(log, "fc-e", "PUT", "/drives/rootfs") ==
          {"drive_id": "rootfs", "path_on_host": "/rootfs", "is_root_device": True, "is_read_only": False,
           "rate_limiter": {"ops": limited["ops"]}},
          "fc-e: ops limit only: an ops bucket, no bandwidth bucket")
    check(calls(log, "fc-d") == create and calls(log, "fc-e") == create, "fc-d, fc-e: exact create calls")
    check(body_of(log, "fc-a", "PUT", "/network-interfaces/eth0") ==
          {"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "06:00:ac:10:00:02"},
          "fc-a: network interface body (the TAP, the fixed guest MAC)")
    check(body_of(log, "fc-a", "PUT", "/vsock") == {"guest_cid": 3, "uds_path": "/v.sock"}, "fc-a: vsock body")
    check(body_of(log, "fc-a", "PUT", "/actions") == {"action_type": "InstanceStart"}, "fc-a: InstanceStart")
    check(body_of(log, "fc-a", "PATCH", "/vm") == {"state": "Paused"}, "fc-a: pause body")
    check(body_of(log, "fc-a", "PUT", "/snapshot/create") ==
          {"snapshot_type": "Full", "snapshot_path": "/snap/state", "mem_file_path": "/snap/mem"},
          "fc-a: snapshot/create body")

    check(calls(log, "fc-b") == [
        "GET / 200", "PUT /snapshot/load 204", "PATCH /drives/rootfs 204", "GET / 200",
        "vsock CONNECT 1024 accepted", "GET / 200", "PATCH /vm 204", "PUT /snapshot/create 204", "GET / 200",
        "PATCH /vm 204", "GET / 200"],
        "fc-b: restore (and its drive's limits), status, agent, full snapshot (pause first), status, "
        "resume, status: exact calls")
    check(body_of(log, "fc-b", "PATCH", "/drives/rootfs") ==
          {"drive_id": "rootfs", "rate_limiter": {
              "bandwidth": {"size": 32 << 20, "refill_time": 1000, "one_time_burst": 0},
              "ops": {"size": 0, "refill_time": 0}}},
          "fc-b: restore patches the drive's limiter to its own spec (no ops limit: bucket disabled)")
    check(drives_after(log, "fc-b", "PUT", "/snapshot/load").get("rootfs", {}).get("rate_limiter") == limited and
          drives_after(log, "fc-b", "PATCH", "/drives/rootfs").get("rootfs", {}).get("rate_limiter") ==
          {"bandwidth": {"size": 32 << 20, "refill_time": 1000, "one_time_burst": 0}},
          "fc-b: the snapshot brought fc-a's limiter back; the patch left the new bandwidth bucket only")
    check(body_of(log, "fc-c", "PATCH", "/drives/rootfs") ==
          {"drive_id": "rootfs", "rate_limiter": {"bandwidth": {"size": 0, "refill_time": 0},
                                                  "ops": {"size": 0, "refill_time": 0}}} and
          "rate_limiter" not in drives_after(log, "fc-c", "PATCH", "/drives/rootfs").get("rootfs", {"rate_limiter": 1}),
          "fc-c: restore without limits disables both buckets: the drive has no limiter")
    check(body_of(log, "fc-b", "PUT", "/snapshot/load") ==
          {"snapshot_path": "/snap/state", "mem_backend": {"backend_type": "File", "backend_path": "/snap/mem"},
           "enable_diff_snapshots": False, "resume_vm": True,
           "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap1"}]},
          "fc-b: snapshot/load body: File backend, resumed, TAP override (tap0 -> tap1)")
    pauses = [r["body"] for r in log if r.get("vm") == "fc-b" and r.get("path") == "/vm"]
    check(pauses == [{"state": "Paused"}, {"state": "Resumed"}], "fc-b: pause then resume bodies")
    check(calls(log, "fc-c") == ["GET / 200", "PUT /snapshot/load 204", "PATCH /drives/rootfs 204", "GET / 200"],
          "fc-c: restore (MOVE), status: exact calls")
    check(calls(log, "fc-g")[:4] == ["GET / 200", "PUT /snapshot/load 204", "PATCH /drives/rootfs 204", "GET / 200"]
          and body_of(log, "fc-g", "PATCH", "/drives/rootfs").get("path_on_host") == "/rootfs",
          "fc-g: a restore onto a larger disk names the grown file again in its drive PATCH")
    check(body_of(log, "fc-c", "PATCH", "/drives/rootfs").get("path_on_host") is None,
          "fc-c: a restore at the snapshot's size leaves the drive's file as it is")
    check(calls(log, "fc-fail") == create[:3] + ["PUT /drives/rootfs 400"],
          "fc-fail: the refused drive stops create")
    check(not any(r.get("vm") in ("fc-shape", "fc_underscore", "fc-nobin", "fc-small") for r in log),
          "specs refused by the driver start no process")

    api = [r for r in log if "method" in r]
    check(len(api) > 0 and all(r["valid"] and not r["errors"] for r in api),
          "every request the driver sent validated against the OpenAPI spec (%d requests)" % len(api))
    check(all(r["status"] in (200, 204) for r in api if not r.get("injected")),
          "every request the driver sent was accepted, the injected fault aside")

    jailers = {r["vm"]: r["jailer"] for r in log if "jailer" in r}
    ja = jailers.get("fc-a", [])
    check(ja[:10] == ["--id", "fc-a", "--exec-file", ja[3] if len(ja) > 3 else "", "--uid", "64001",
                      "--gid", "64001", "--chroot-base-dir", ja[9] if len(ja) > 9 else ""]
          and ja[3].endswith("/firecracker") and ja[9].endswith("/state/fc-a"),
          "jailer: id, exec file, uid, gid, chroot base")
    check("--netns" in ja and ja[ja.index("--netns") + 1] == "/run/netns/kiln-fc-test", "jailer: netns")
    check("--parent-cgroup" in ja and ja[ja.index("--parent-cgroup") + 1] == "kiln/fctest",
          "jailer: parent cgroup kiln/<node>")
    cg = [ja[i + 1] for i, a in enumerate(ja) if a == "--cgroup"]
    check(any(c.startswith("pids.max=") for c in cg) and
          (any(c == "cpu.max=150000 100000" for c in cg) or any(c == "cpu.cfs_quota_us=150000" for c in cg)),
          "jailer: cgroup caps, 1.5 vCPU as a CPU quota (%s)" % cg)
    check("--new-pid-ns" in ja and ja[-3:] == ["--", "--api-sock", "/api.sock"],
          "jailer: new pid namespace; firecracker --api-sock /api.sock")


def negative(spec, work):
    """The stand-in refuses what Firecracker refuses: off-spec requests and out-of-order ones."""
    root = os.path.join(work, "neg")
    os.makedirs(root)
    for f in ("kernel", "rootfs"):
        open(os.path.join(root, f), "wb").close()
    log = os.path.join(work, "neg.jsonl")
    env = dict(os.environ, FC_STANDIN_SPEC=spec, FC_STANDIN_LOG=log, FC_STANDIN_ROOT=root)
    p = subprocess.Popen(["/usr/bin/python3", os.path.join(HERE, "fc_standin.py"), "--id", "neg",
                          "--api-sock", "/api.sock"], env=env, stderr=subprocess.DEVNULL)
    sock = os.path.join(root, "api.sock")
    try:
        for _ in range(500):
            if os.path.exists(sock):
                break
            time.sleep(0.01)
        drive = {"drive_id": "rootfs", "is_root_device": True, "path_on_host": "/rootfs", "is_read_only": False}
        spec_cases = [
            ("wrong field name", "PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128, "smtt": False},
             "unknown field 'smtt'"),
            ("wrong type", "PUT", "/machine-config", {"vcpu_count": "2", "mem_size_mib": 128}, "expected integer"),
            ("missing required field", "PUT", "/machine-config", {"vcpu_count": 2}, "missing required field 'mem_size_mib'"),
            ("below minimum", "PUT", "/machine-config", {"vcpu_count": 0, "mem_size_mib": 128}, "below minimum"),
            ("value outside enum", "PATCH", "/vm", {"state": "Stopped"}, "is not one of"),
            ("nested object field", "PUT", "/snapshot/load",
             {"snapshot_path": "/s", "mem_backend": {"backend_type": "Memfd", "backend_path": "/m"}}, "mem_backend.backend_type"),
            ("unknown path", "PUT", "/machine", {"vcpu_count": 1}, "Invalid request method and/or path"),
            ("method not allowed", "DELETE", "/vm", None, "Invalid request method and/or path"),
            ("missing body", "PUT", "/boot-source", None, "Missing body"),
            ("a rate limiter bucket without refill_time", "PUT", "/drives/rootfs",
             dict(drive, rate_limiter={"bandwidth": {"size": 1 << 20}}), "missing required field 'refill_time'"),
            ("a rate limiter bucket of negative size", "PUT", "/drives/rootfs",
             dict(drive, rate_limiter={"ops": {"size": -1, "refill_time": 1000}}), "rate_limiter.ops.size: -1 below minimum"),
            ("a rate limiter bucket of size given as text", "PUT", "/drives/rootfs",
             dict(drive, rate_limiter={"ops": {"size": "4000", "refill_time": 1000}}), "expected integer"),
            ("a rate limiter with an unknown bucket", "PUT", "/drives/rootfs",
             dict(drive, rate_limiter={"iops": {"size": 4000, "refill_time": 1000}}), "unknown field 'iops'"),
            ("a token bucket with an unknown field", "PUT", "/drives/rootfs",
             dict(drive, rate_limiter={"bandwidth": {"size": 1, "refill_time": 1000, "burst": 5}}),
             "unknown field 'burst'"),
            ("a rate limiter that is not an object", "PATCH", "/drives/rootfs",
             {"drive_id": "rootfs", "rate_limiter": 4000}, "expected object"),
        ]
        for what, m, path, body, needle in spec_cases:
            st, out = request(sock, m, path, body)
            fault = (out or {}).get("fault_message", "")
            check(st == 400 and needle in fault, "stand-in refuses %s: 400 %r" % (what, fault))
        st, out = request(sock, "PUT", "/machine-config", raw="{not json")
        check(st == 400 and "Syntax" in out["fault_message"], "stand-in refuses a body that is not JSON")

        order_cases = [
            ("PATCH /vm before boot", "PATCH", "/vm", {"state": "Paused"}, 400),
            ("snapshot/create before boot", "PUT", "/snapshot/create",
             {"snapshot_path": "/s", "mem_file_path": "/m"}, 400),
            ("InstanceStart without a boot source", "PUT", "/actions", {"action_type": "InstanceStart"}, 400),
            ("a drive's rate limiter patched before boot", "PATCH", "/drives/rootfs",
             {"drive_id": "rootfs", "rate_limiter": {"ops": {"size": 10, "refill_time": 1000}}}, 400),
            ("a drive whose body id differs from the path", "PUT", "/drives/a",
             {"drive_id": "b", "is_root_device": True, "path_on_host": "/rootfs", "is_read_only": False}, 400),
            ("a kernel that is not in the jail", "PUT", "/boot-source", {"kernel_image_path": "/nope"}, 400),
            ("boot source", "PUT", "/boot-source", {"kernel_image_path": "/kernel"}, 204),
            ("snapshot/load after configuring", "PUT", "/snapshot/load",
             {"snapshot_path": "/s", "mem_backend": {"backend_type": "File", "backend_path": "/m"}}, 400),
            ("InstanceStart", "PUT", "/actions", {"action_type": "InstanceStart"}, 204),
            ("machine-config after boot", "PUT", "/machine-config", {"vcpu_count": 1, "mem_size_mib": 128}, 400),
            ("a drive after boot", "PUT", "/drives/rootfs",
             {"drive_id": "rootfs", "is_root_device": True, "path_on_host": "/rootfs", "is_read_only": False}, 400),
            ("snapshot/create while running", "PUT", "/snapshot/create",
             {"snapshot_path": "/s", "mem_file_path": "/m"}, 400),
            ("a drive's rate limiter patched when the drive does not exist", "PATCH", "/drives/data",
             {"drive_id": "data", "rate_limiter": {"ops": {"size": 10, "refill_time": 1000}}}, 400),
            ("pause", "PATCH", "/vm", {"state": "Paused"}, 204),
            ("snapshot/create while paused", "PUT", "/snapshot/create",
             {"snapshot_type": "Full", "snapshot_path": "/s", "mem_file_path": "/m"}, 204),
        ]
        for what, m, path, body, want in order_cases:
            st, out = request(sock, m, path, body)
            ok = st == want and (want != 400 or (out or {}).get("fault_message"))
            check(ok, "stand-in ordering: %s -> %d%s" % (what, st, " %r" % out["fault_message"] if out else ""))
        st, out = request(sock, "GET", "/")
        check(st == 200 and out == {"app_name": "Firecracker", "id": "neg", "state": "Paused",
                                    "vmm_version": "standin"}, "stand-in GET / answers InstanceInfo")
    finally:
        p.kill()
        p.wait()
    recs = [r for r in read_log(log) if "method" in r]
    n_spec = len(spec_cases) + 1
    check(all(not r["valid"] for r in recs[:n_spec]), "the log marks every off-spec request invalid")
    check(all(r["valid"] for r in recs[n_spec:]), "the log marks out-of-order requests valid but refused")
    check(all(r.get("rule") == "order" for r in recs[n_spec:] if r["status"] == 400),
          "out-of-order refusals are attributed to Firecracker's rules")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--spec", required=True)
    args = ap.parse_args()
    spec = os.environ.get("FC_OPENAPI_SPEC", args.spec)
    if os.geteuid() != 0:
        print("FAIL: needs root (the driver chowns jail files to the VM's uid and makes cgroups)")
        return 1
    if not os.path.isfile(spec):
        print("FAIL: the Firecracker OpenAPI document is not at %s (set FC_OPENAPI_SPEC)" % spec)
        return 1
    work = tempfile.mkdtemp(prefix="kfc-", dir="/tmp")
    try:
        img = os.path.join(work, "img")
        os.makedirs(img)
        for name, size in (("vmlinux", 1 << 20), ("initrd", 64 << 10)):
            with open(os.path.join(img, name), "wb") as f:
                f.write(os.urandom(size))
            os.chmod(os.path.join(img, name), 0o644)
        with open(os.path.join(img, "rootfs.raw"), "wb") as f:
            f.write(b"kiln-rootfs" * 100)
            f.truncate(64 << 20)
        log = os.path.join(work, "calls.jsonl")
        env = dict(os.environ, FC_WORK=work,
                   FC_BIN=fake_install(os.path.join(work, "bin"), spec, log),
                   FC_BIN_FAIL=fake_install(os.path.join(work, "bin-fail"), spec, log, "PUT /drives/rootfs"))
        r = subprocess.run([args.tool], env=env)
        check(r.returncode == 0, "test_vmm_firecracker: driver-level checks")
        check_driver_log(read_log(log))
        negative(spec, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for d in glob.glob("/sys/fs/cgroup/*/kiln/fctest") + ["/sys/fs/cgroup/kiln/fctest"]:
            try:
                os.rmdir(d)   # the test node's group; the VMs' groups are gone already
            except OSError:
                pass
    print("%d failed" % len(FAILURES))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
