#!/usr/bin/python3
"""A fake Firecracker jailer for the driver's tests. It jails nothing.

It parses the command line the real jailer documents (docs/jailer.md: --id, --exec-file, --uid,
--gid, --chroot-base-dir, --netns, --cgroup-version, --cgroup, --parent-cgroup, --new-pid-ns, and
the Firecracker arguments after "--"), refuses what the real one refuses (missing options, an id
outside [A-Za-z0-9-], an exec file whose name lacks "firecracker"), records the command line in
the stand-in's log, and then - where the real jailer would chroot, join namespaces and cgroups,
drop privileges and exec Firecracker - starts `--exec-file` (the test's wrapper around
fc_standin.py) with FC_STANDIN_ROOT set to the jail root <chroot-base>/<exec name>/<id>/root.
As the real jailer does with --new-pid-ns, it writes that process's pid to <root>/<exec name>.pid
and exits.
"""
import json
import os
import re
import subprocess
import sys

VALUED = {"--id", "--exec-file", "--uid", "--gid", "--chroot-base-dir", "--netns",
          "--cgroup-version", "--cgroup", "--parent-cgroup", "--resource-limit"}
FLAGS = {"--new-pid-ns", "--daemonize"}


def fail(msg):
    sys.stderr.write("jailer: %s\n" % msg)
    sys.exit(1)


def main():
    argv = sys.argv[1:]
    opts, extra = {}, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            extra = argv[i + 1:]
            break
        if a in FLAGS:
            opts[a] = True
            i += 1
        elif a in VALUED:
            if i + 1 >= len(argv):
                fail("option %s needs a value" % a)
            opts.setdefault(a, []).append(argv[i + 1])
            i += 2
        else:
            fail("unknown option %s" % a)
    for req in ("--id", "--exec-file", "--uid", "--gid"):
        if req not in opts:
            fail("missing required option %s" % req)
    vm_id, exe = opts["--id"][0], opts["--exec-file"][0]
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", vm_id):
        fail("invalid id '%s'" % vm_id)
    if "firecracker" not in os.path.basename(exe) or not os.access(exe, os.X_OK):
        fail("invalid exec file '%s'" % exe)
    for c in opts.get("--cgroup", []):
        if not re.fullmatch(r"[a-z_]+\.[a-z_.]+=.+", c):
            fail("invalid cgroup '%s'" % c)
    base = opts.get("--chroot-base-dir", ["/srv/jailer"])[0]
    root = os.path.join(base, os.path.basename(exe), vm_id, "root")
    os.makedirs(root, exist_ok=True)
    log = os.environ.get("FC_STANDIN_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"jailer": sys.argv[1:], "vm": vm_id}, sort_keys=True) + "\n")
    env = dict(os.environ, FC_STANDIN_ROOT=root)
    child = subprocess.Popen([exe, "--id", vm_id] + extra, env=env, stdin=subprocess.DEVNULL,
                             start_new_session=True)
    with open(os.path.join(root, os.path.basename(exe) + ".pid"), "w") as f:
        f.write("%d" % child.pid)


if __name__ == "__main__":
    main()
