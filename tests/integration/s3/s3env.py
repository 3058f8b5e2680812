"""s3env.py - what the storage tests share: the npm packages, a real S3-compatible server and the
independent client.

- npm_modules(): installs package-lock.json's packages once per lock (npm ci) into
  /var/cache/kiln/npm/<hash of the lock>/ and links ./node_modules to it.
- S3Server: s3rver (npm) on a free loopback port with a temporary directory and a bucket, behind
  sigv4_proxy.js, which checks every request's SigV4 signature with the AWS SDK's own signer and
  its Content-MD5 and payload hash (s3rver checks neither) and logs each request. Both are
  stopped by pid. s3rver can be killed and restarted on the same directory and port.
- sdk(): @aws-sdk/client-s3 (verify.js) reading what Kiln wrote.
- tool(): tests/integration/s3/s3_tool (the C client) on a target.
- ALLOW_ENV: the setting that lets the daemons and tools reach these servers on 127.0.0.1, which
  they refuse by default (storage_allow, common/netaddr.h): pass it to every one that uses them.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import kiln

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("KILN_NPM_CACHE", "/var/cache/kiln/npm")
BUCKET = "kiln-test"
ACCESS_KEY_ID = "S3RVER"	# s3rver's built-in account (s3rver checks the id only)
SECRET = "kiln-test-secret/Zq7+Xw2"	# what the proxy verifies signatures with
TOOL = os.path.join(kiln.BUILD, "tests", "integration", "s3", "s3_tool")
ALLOW = "127.0.0.1"     # where S3Server listens
ALLOW_ENV = {"KILN_STORAGE_ALLOW": ALLOW}


def npm_modules():
    """Makes ./node_modules hold the lock's packages; returns its path."""
    return kiln.npm_modules(HERE, CACHE)


def _wait_port(port, proc, what, log, host="127.0.0.1"):
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            with open(log, errors="replace") as f:
                raise RuntimeError(f"{what} exited:\n{f.read()}")
        try:
            import socket
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen")


class S3Server:
    """s3rver behind the checking proxy; `endpoint` is the proxy's URL."""

    def __init__(self, host="127.0.0.1"):
        """`host`: the address the checking proxy (the endpoint) listens on; the daemons that use
        it need KILN_STORAGE_ALLOW naming it (ALLOW_ENV names 127.0.0.1)."""
        npm_modules()
        self.dir = tempfile.mkdtemp(prefix="kiln-s3rver-")
        self.s3_port = kiln.free_port()
        self.port = kiln.free_port()
        self.host = host
        self.endpoint = f"http://{host}:{self.port}"
        self.direct = f"http://127.0.0.1:{self.s3_port}"
        self.log = os.path.join(self.dir, "requests.log")
        self.s3rver = None
        self.start_s3rver()
        plog = os.path.join(self.dir, "proxy.out")
        with open(plog, "w") as out:
            self.proxy = subprocess.Popen(
                ["node", os.path.join(HERE, "sigv4_proxy.js"), str(self.port), str(self.s3_port),
                 SECRET, self.log, host], stdout=out, stderr=subprocess.STDOUT, cwd=HERE)
        _wait_port(self.port, self.proxy, "sigv4_proxy.js", plog, host)

    def start_s3rver(self):
        slog = os.path.join(self.dir, "s3rver.out")
        with open(slog, "a") as out:
            self.s3rver = subprocess.Popen(
                ["node", os.path.join(HERE, "node_modules", "s3rver", "bin", "s3rver.js"),
                 "-d", os.path.join(self.dir, "data"), "-a", "127.0.0.1", "-p", str(self.s3_port),
                 "--silent", "--configure-bucket", BUCKET], stdout=out, stderr=subprocess.STDOUT,
                cwd=HERE)
        _wait_port(self.s3_port, self.s3rver, "s3rver", slog)

    def kill_s3rver(self):
        """SIGKILL, as a crash: the proxy then answers 502 for it."""
        self.s3rver.send_signal(signal.SIGKILL)
        self.s3rver.wait()

    def requests(self):
        """The proxy's log: [(method, path?query, status)]."""
        try:
            with open(self.log) as f:
                return [tuple(line.split(" ", 2)) for line in f.read().splitlines()]
        except FileNotFoundError:
            return []

    def clear_log(self):
        open(self.log, "w").close()

    def target(self, prefix="", **over):
        t = {"endpoint": self.endpoint, "bucket": BUCKET, "region": "us-east-1",
             "prefix": prefix, "access_key_id": ACCESS_KEY_ID, "secret_access_key": SECRET}
        t.update(over)
        return t

    def stop(self):
        for p in (self.proxy, self.s3rver):
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class CannedServer:
    """An HTTP server on 127.0.0.1 (a thread of the test) that answers every request with `status`,
    `headers` and `body`: what a hostile endpoint might say. `hits` counts the requests."""

    def __init__(self, status, body=b"", headers=None):
        import http.server
        import threading
        outer = self
        self.hits = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self):
                outer.hits += 1
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = answer

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def silent_port():
    """A listening socket on 127.0.0.1 whose accept queue is full, so that a new connection is
    never answered (as a filtered port): returns (port, sockets to close)."""
    import socket
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(0)
    port = lsn.getsockname()[1]
    held = [lsn]
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        held.append(c)
    time.sleep(0.2)
    return port, held


def sdk(endpoint, *args):
    """Runs verify.js (the AWS SDK) and returns its JSON answer."""
    out = subprocess.run(["node", os.path.join(HERE, "verify.js"), endpoint, BUCKET, *args],
                         capture_output=True, text=True, timeout=120, cwd=HERE,
                         env=dict(os.environ, S3_SECRET_ACCESS_KEY=SECRET))
    return json.loads(out.stdout.strip().splitlines()[-1])


def tool(target, *args, part_size=None, stdin=None, retries=0, allow=ALLOW):
    """Runs s3_tool on `target` (a dict as S3Server.target gives) with storage_allow `allow`;
    returns (json, stderr)."""
    env = dict(os.environ, KILN_STORAGE_ALLOW=allow)
    env.update({"S3_ENDPOINT": target["endpoint"], "S3_BUCKET": target["bucket"],
                "S3_REGION": target["region"], "S3_PREFIX": target["prefix"],
                "S3_ACCESS_KEY_ID": target["access_key_id"],
                "S3_SECRET_ACCESS_KEY": target["secret_access_key"], "S3_RETRIES": str(retries)})
    if part_size:
        env["S3_PART_SIZE"] = str(part_size)
    out = subprocess.run([TOOL, *args], env=env, capture_output=True, text=True, timeout=300,
                         input=stdin)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def tool_popen(target, *args, part_size=None):
    env = dict(os.environ, **ALLOW_ENV)
    env.update({"S3_ENDPOINT": target["endpoint"], "S3_BUCKET": target["bucket"],
                "S3_REGION": target["region"], "S3_PREFIX": target["prefix"],
                "S3_ACCESS_KEY_ID": target["access_key_id"],
                "S3_SECRET_ACCESS_KEY": target["secret_access_key"], "S3_RETRIES": "0"})
    if part_size:
        env["S3_PART_SIZE"] = str(part_size)
    return subprocess.Popen([TOOL, *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


if __name__ == "__main__":
    print(npm_modules(), file=sys.stderr)
