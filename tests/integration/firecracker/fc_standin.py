#!/usr/bin/python3
"""A spec-validating stand-in for Firecracker's API socket. It does not run a VM.

This machine has no usable KVM and no Firecracker binary, so Kiln's Firecracker driver
(vmm/firecracker.c) is tested against this program instead. It is honest about what it is:

  * It LOADS Firecracker's published OpenAPI (Swagger 2.0) document at start and validates every
    request against it: the path exists, the method is allowed on it, the JSON body matches the
    operation's schema (required fields, types, enums, minimum/maximum, nested objects and arrays).
    Fields not in a schema are refused unless the schema allows additionalProperties, as
    Firecracker's own request parsing does (its request types deny unknown fields).
  * It enforces the ordering rules Firecracker documents: operations whose summary says
    "Pre-boot only." are refused once the microVM started; "Post-boot only." ones before; PATCH /vm
    needs a started microVM; /snapshot/create needs it Paused; /snapshot/load only on a fresh
    process (nothing configured but logger and metrics); InstanceStart needs a boot source; the
    path's drive_id/iface_id must equal the body's; PATCH /drives/{id} (post-boot) needs that drive
    and updates its rate limiter as Firecracker does (a bucket of size or refill_time 0 disables
    that bucket, a bucket left out stays). Each accepted request's log line carries the machine's
    drives as they are after it ("drives"), rate limiters included.
  * It checks the files a request names exist inside the jail root (kernel, initrd, drives, memory
    backend, snapshot state), writes a snapshot as two files (its own JSON state, and a sparse
    memory file of mem_size_mib MiB), binds the vsock Unix socket and answers Firecracker's
    host-initiated handshake ("CONNECT <port>\\n" -> "OK <n>\\n") for the guest ports given with
    --guest-port, after which the "guest" simply echoes bytes back.
  * Answers are the spec's: 204 with no body, 200 with the documented body (GET /), or 400 with
    {"fault_message": ...}.
  * Every request is appended to the --log file as one JSON line: method, path, body, status,
    whether it validated against the spec, and the errors found.

Nothing here boots a kernel, emulates a CPU, maps guest memory or moves packets.
Environment (set by the fake jailer): FC_STANDIN_ROOT (jail root), FC_STANDIN_LOG, FC_STANDIN_SPEC,
FC_STANDIN_FAIL ("METHOD /path" answered with an injected 400), FC_STANDIN_GUEST_PORTS.
"""
import argparse
import json
import os
import re
import socket
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler

import yaml

VERSION = "standin"  # never a real Firecracker version


class Spec:
    """The operations of the OpenAPI document: path regex -> method -> (body schema, summary)."""

    def __init__(self, path):
        with open(path) as f:
            self.doc = yaml.safe_load(f)
        if self.doc.get("swagger") != "2.0":
            raise SystemExit("not a Swagger 2.0 document: %s" % path)
        self.defs = self.doc.get("definitions", {})
        self.routes = []
        for tmpl, ops in self.doc["paths"].items():
            rx = "^" + re.sub(r"\{([^}]+)\}", r"(?P<\1>[^/]+)", tmpl) + "$"
            methods = {}
            for m, op in ops.items():
                body = None
                for p in op.get("parameters", []):
                    if p.get("in") == "body":
                        body = (p.get("schema"), bool(p.get("required")))
                methods[m.upper()] = {"body": body, "summary": op.get("summary", ""),
                                      "responses": op.get("responses", {})}
            self.routes.append((re.compile(rx), tmpl, methods))

    def route(self, path):
        for rx, tmpl, methods in self.routes:
            m = rx.match(path)
            if m:
                return tmpl, methods, m.groupdict()
        return None, None, None

    def resolve(self, schema):
        while isinstance(schema, dict) and "$ref" in schema:
            schema = self.defs[schema["$ref"].split("/")[-1]]
        return schema

    def validate(self, schema, value, where="body"):
        """Errors of `value` against `schema`, as a list of strings."""
        s = self.resolve(schema)
        if s is None:
            return []
        errs = []
        t = s.get("type")
        if t is None and "properties" in s:
            t = "object"
        checks = {"object": lambda v: isinstance(v, dict),
                  "array": lambda v: isinstance(v, list),
                  "string": lambda v: isinstance(v, str),
                  "boolean": lambda v: isinstance(v, bool),
                  "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
        if t in checks and not checks[t](value):
            return ["%s: expected %s, got %s" % (where, t, type(value).__name__)]
        if "enum" in s and value not in s["enum"]:
            errs.append("%s: %r is not one of %s" % (where, value, s["enum"]))
        if "minimum" in s and isinstance(value, (int, float)) and value < s["minimum"]:
            errs.append("%s: %r below minimum %s" % (where, value, s["minimum"]))
        if "maximum" in s and isinstance(value, (int, float)) and value > s["maximum"]:
            errs.append("%s: %r above maximum %s" % (where, value, s["maximum"]))
        if t == "object":
            props = s.get("properties", {})
            for r in s.get("required", []):
                if r not in value:
                    errs.append("%s: missing required field '%s'" % (where, r))
            extra = s.get("additionalProperties", False)
            for k, v in value.items():
                if k in props:
                    errs += self.validate(props[k], v, "%s.%s" % (where, k))
                elif isinstance(extra, dict):
                    errs += self.validate(extra, v, "%s.%s" % (where, k))
                elif not extra:
                    errs.append("%s: unknown field '%s'" % (where, k))
        if t == "array" and "items" in s:
            for i, v in enumerate(value):
                errs += self.validate(s["items"], v, "%s[%d]" % (where, i))
        return errs


class Refused(Exception):
    pass


class Machine:
    """The microVM state the ordering rules need. No VM is run."""

    def __init__(self, vm_id, root, guest_ports):
        self.id = vm_id
        self.root = root
        self.state = "Not started"
        self.config = {}          # resource name -> body (drives/ifaces keyed by id)
        self.guest_ports = guest_ports
        self.vsock_srv = None
        self.lock = threading.Lock()

    def host(self, p):
        """A path Firecracker would see in its chroot, as a path on this host."""
        if not isinstance(p, str) or not p:
            raise Refused("empty path")
        return os.path.join(self.root, p.lstrip("/")) if self.root else p

    def need_file(self, p, what):
        if not os.path.isfile(self.host(p)):
            raise Refused("%s '%s' cannot be opened: No such file or directory" % (what, p))

    def bind_vsock(self, uds):
        path = self.host(uds)
        if os.path.exists(path):
            raise Refused("vsock: address in use: '%s'" % uds)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(8)
        self.vsock_srv = s
        threading.Thread(target=self.vsock_loop, args=(s,), daemon=True).start()

    def vsock_loop(self, s):
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=self.vsock_conn, args=(c,), daemon=True).start()

    def vsock_conn(self, c):
        line = b""
        while not line.endswith(b"\n") and len(line) < 64:
            b = c.recv(1)
            if not b:
                c.close()
                return
            line += b
        m = re.match(rb"^CONNECT (\d+)\n$", line)
        ok = bool(m) and self.state != "Not started" and int(m.group(1)) in self.guest_ports
        log_event({"vsock": line.decode(errors="replace").rstrip("\n"), "accepted": ok})
        if not ok:
            c.close()
            return
        c.sendall(b"OK 1073741824\n")
        while True:   # the stand-in's "guest service" echoes; there is no guest
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
        c.close()

    def apply(self, method, tmpl, params, summary, body):
        """Enforces ordering and applies a valid request; returns (status, body) or raises Refused."""
        started = self.state != "Not started"
        if "Pre-boot only" in summary and started:
            raise Refused("The requested operation is not supported after starting the microVM.")
        if "Post-boot only" in summary and not started:
            raise Refused("The requested operation is not supported before starting the microVM.")
        key = (method, tmpl)
        if key == ("GET", "/"):
            return 200, {"app_name": "Firecracker", "id": self.id, "state": self.state,
                         "vmm_version": VERSION}
        if key == ("PUT", "/machine-config"):
            self.config["machine-config"] = body
        elif key == ("PUT", "/boot-source"):
            self.need_file(body["kernel_image_path"], "kernel")
            if "initrd_path" in body:
                self.need_file(body["initrd_path"], "initrd")
            self.config["boot-source"] = body
        elif key == ("PUT", "/drives/{drive_id}"):
            if body["drive_id"] != params["drive_id"]:
                raise Refused("The id from the path does not match the id from the body!")
            if "path_on_host" in body:
                self.need_file(body["path_on_host"], "drive")
            self.config.setdefault("drives", {})[body["drive_id"]] = body
        elif key == ("PATCH", "/drives/{drive_id}"):
            if body["drive_id"] != params["drive_id"]:
                raise Refused("The id from the path does not match the id from the body!")
            drive = self.config.get("drives", {}).get(body["drive_id"])
            if drive is None:
                raise Refused("Invalid block device ID: '%s'" % body["drive_id"])
            if "path_on_host" in body:
                self.need_file(body["path_on_host"], "drive")
                drive["path_on_host"] = body["path_on_host"]
            if "rate_limiter" in body:
                # a bucket given replaces the drive's; size or refill_time 0 disables it; a bucket
                # left out stays as it was (Firecracker's BucketUpdate)
                rl = dict(drive.get("rate_limiter", {}))
                for name, tb in body["rate_limiter"].items():
                    if tb["size"] == 0 or tb["refill_time"] == 0:
                        rl.pop(name, None)
                    else:
                        rl[name] = tb
                if rl:
                    drive["rate_limiter"] = rl
                else:
                    drive.pop("rate_limiter", None)
        elif key == ("PUT", "/network-interfaces/{iface_id}"):
            if body["iface_id"] != params["iface_id"]:
                raise Refused("The id from the path does not match the id from the body!")
            self.config.setdefault("network-interfaces", {})[body["iface_id"]] = body
        elif key == ("PUT", "/vsock"):
            if self.vsock_srv is None:
                self.bind_vsock(body["uds_path"])
            self.config["vsock"] = body
        elif key in (("PUT", "/logger"), ("PUT", "/metrics")):
            self.config[tmpl.strip("/")] = body
        elif key == ("PUT", "/actions"):
            if body["action_type"] == "InstanceStart":
                if started:
                    raise Refused("The requested operation is not supported after starting the microVM.")
                if "boot-source" not in self.config:
                    raise Refused("Cannot start microvm without kernel configuration.")
                self.state = "Running"
            elif not started:
                raise Refused("The requested operation is not supported before starting the microVM.")
        elif key == ("PATCH", "/vm"):
            if not started:
                raise Refused("The requested operation is not supported before starting the microVM.")
            self.state = "Paused" if body["state"] == "Paused" else "Running"
        elif key == ("PUT", "/snapshot/create"):
            if self.state != "Paused":
                raise Refused("Cannot save the microVM state: the microVM must be paused.")
            if body.get("snapshot_type", "Full") != "Full":
                raise Refused("Diff snapshots need track_dirty_pages (not modelled by the stand-in).")
            for k in ("snapshot_path", "mem_file_path"):
                if not os.path.isdir(os.path.dirname(self.host(body[k]))):
                    raise Refused("Cannot create %s '%s': No such file or directory" % (k, body[k]))
            with open(self.host(body["snapshot_path"]), "w") as f:
                json.dump({"kiln_standin_state": 1, "config": self.config}, f)
            mib = self.config.get("machine-config", {}).get("mem_size_mib", 128)
            with open(self.host(body["mem_file_path"]), "wb") as f:
                f.truncate(mib << 20)
        elif key == ("PUT", "/snapshot/load"):
            if started or set(self.config) - {"logger", "metrics"}:
                raise Refused("Loading a microVM snapshot not allowed after configuring boot-specific "
                              "resources.")
            has_be, has_file = "mem_backend" in body, "mem_file_path" in body
            if has_be == has_file:
                raise Refused("Exactly one of mem_backend and mem_file_path must be present.")
            mem = body["mem_backend"]["backend_path"] if has_be else body["mem_file_path"]
            if has_be and body["mem_backend"]["backend_type"] != "File":
                raise Refused("Uffd backend not modelled by the stand-in.")
            self.need_file(body["snapshot_path"], "snapshot state")
            self.need_file(mem, "memory file")
            with open(self.host(body["snapshot_path"])) as f:
                st = json.load(f)
            if st.get("kiln_standin_state") != 1:
                raise Refused("Cannot deserialize the microVM state.")
            cfg = st["config"]
            mib = cfg.get("machine-config", {}).get("mem_size_mib", 128)
            if os.path.getsize(self.host(mem)) != mib << 20:
                raise Refused("memory file size does not match the snapshot")
            for d in cfg.get("drives", {}).values():
                if "path_on_host" in d:
                    self.need_file(d["path_on_host"], "drive")
            ifaces = cfg.get("network-interfaces", {})
            for o in body.get("network_overrides", []):
                if o["iface_id"] not in ifaces:
                    raise Refused("Invalid network override: no interface '%s'" % o["iface_id"])
                ifaces[o["iface_id"]]["host_dev_name"] = o["host_dev_name"]
            self.config = cfg
            if "vsock" in cfg:
                uds = body.get("vsock_override", {}).get("uds_path", cfg["vsock"]["uds_path"])
                self.bind_vsock(uds)
            self.state = "Running" if body.get("resume_vm") else "Paused"
        else:
            raise Refused("stand-in: %s %s is in the spec but not modelled here" % (method, tmpl))
        return 204, None


LOG = {"path": None, "lock": threading.Lock(), "seq": 0}


def log_event(rec):
    with LOG["lock"]:
        LOG["seq"] += 1
        rec = dict(rec, seq=LOG["seq"], vm=MACHINE.id)
        if LOG["path"]:
            with open(LOG["path"], "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kiln-fc-standin"

    def log_message(self, fmt, *args):  # the JSON log is the record
        pass

    def answer(self, status, body):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def handle_any(self):
        method, path = self.command, self.path.split("?")[0]
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        rec = {"method": method, "path": path, "body": None, "valid": True, "errors": []}
        status, out = 400, None
        try:
            tmpl, methods, params = SPEC.route(path)
            if tmpl is None:
                raise Refused("Invalid request method and/or path: %s %s" % (method, path))
            op = methods.get(method)
            if op is None:
                raise Refused("Invalid request method and/or path: %s %s" % (method, path))
            body = None
            if raw:
                try:
                    body = json.loads(raw)
                except ValueError as e:
                    raise Refused("Syntax error in the body: %s" % e)
                rec["body"] = body
            if op["body"] is not None:
                schema, required = op["body"]
                if body is None and required:
                    raise Refused("Missing body")
                if body is not None:
                    errs = SPEC.validate(schema, body)
                    if errs:
                        rec["errors"] = errs
                        raise Refused("; ".join(errs))
            elif body is not None:
                raise Refused("This operation takes no body")
            if FAIL and FAIL == "%s %s" % (method, path):
                rec["injected"] = True
                raise Refused("injected fault for %s %s" % (method, path))
            with MACHINE.lock:
                try:
                    status, out = MACHINE.apply(method, tmpl, params, op["summary"], body)
                except Refused:
                    rec["rule"] = "order"   # valid against the spec, refused by Firecracker's rules
                    raise
                rec["drives"] = json.loads(json.dumps(MACHINE.config.get("drives", {})))
            codes = {str(c) for c in op["responses"]}
            if str(status) not in codes:
                raise SystemExit("stand-in bug: %d not among the spec's responses %s" % (status, codes))
            if out is not None:
                schema = op["responses"][status].get("schema")
                bad = SPEC.validate(schema, out, "response")
                if bad:
                    raise SystemExit("stand-in bug: response off spec: %s" % bad)
        except Refused as e:
            status, out = 400, {"fault_message": str(e)}
            if rec["errors"] or "Invalid request" in str(e) or "Syntax" in str(e) or \
                    "Missing body" in str(e) or "takes no body" in str(e):
                rec["valid"] = False
            rec["fault"] = str(e)
        rec["status"] = status
        log_event(rec)
        self.answer(status, out)

    do_GET = do_PUT = do_PATCH = do_POST = do_DELETE = handle_any


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):
        conn, _ = self.socket.accept()
        return conn, ("standin", 0)   # BaseHTTPRequestHandler wants a (host, port) pair


def main():
    global SPEC, MACHINE, FAIL
    ap = argparse.ArgumentParser(description="spec-validating Firecracker API stand-in (runs no VM)")
    ap.add_argument("--api-sock", required=True, help="path inside the jail root")
    ap.add_argument("--id", default="anonymous-instance")
    ap.add_argument("--root", default=os.environ.get("FC_STANDIN_ROOT", ""))
    ap.add_argument("--spec", default=os.environ.get("FC_STANDIN_SPEC"))
    ap.add_argument("--log", default=os.environ.get("FC_STANDIN_LOG"))
    ap.add_argument("--guest-port", type=int, action="append",
                    default=[int(p) for p in os.environ.get("FC_STANDIN_GUEST_PORTS", "1024").split(",")])
    args, unknown = ap.parse_known_args()
    if unknown:
        sys.stderr.write("fc-standin: ignoring firecracker options %s\n" % unknown)
    if not args.spec:
        raise SystemExit("fc-standin: --spec or FC_STANDIN_SPEC is required")
    SPEC = Spec(args.spec)
    FAIL = os.environ.get("FC_STANDIN_FAIL", "")
    LOG["path"] = args.log
    MACHINE = Machine(args.id, args.root, set(args.guest_port))
    sock = MACHINE.host(args.api_sock) if args.root else args.api_sock
    if os.path.exists(sock):
        os.unlink(sock)
    srv = Server(sock, Handler)
    sys.stderr.write("fc-standin: %s listening on %s (no VM is run)\n" % (args.id, sock))
    sys.stderr.flush()
    srv.serve_forever()


SPEC = MACHINE = None
FAIL = ""

if __name__ == "__main__":
    main()
