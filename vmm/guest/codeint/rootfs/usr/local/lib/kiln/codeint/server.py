#!/usr/bin/python3
"""server.py - the code interpreter of the code-interpreter-v1 image (docs/e2b.md), guest port 49999.

E2B's code interpreter API, which `@e2b/code-interpreter`'s runCode and contexts call through the
gateway's data plane:
  POST /execute {code, context_id?, language?, env_vars?}  200, NDJSON lines as they come:
       number_of_executions, stdout/stderr chunks, result (text, html, png, ... and
       is_main_result), error (name, value, traceback), end_of_execution last
  POST /contexts {language?, cwd?} -> {id, language, cwd};  GET /contexts -> [...]
  POST /contexts/{id}/restart, DELETE /contexts/{id};  GET /health -> OK

init starts it as root (the image's inittab); it drops to the account `user` before anything
else, then imports numpy, pandas and matplotlib (Agg) once, so the template's warm snapshot holds
them. Each context is a child forked from this process when it is first used (after the restore
that made the sandbox), which reseeds `random` and numpy's generator from os.urandom: no two
sandboxes share a random state. A context runs one execution at a time; its globals live until it
is restarted or removed. One asyncio thread serves HTTP (never a thread pool: forking stays safe).
"""
import ast
import asyncio
import base64
import io
import json
import os
import pwd
import signal
import socket
import sys
import traceback
import uuid

PORT = 49999
BODY_MAX = 16 << 20          # bytes of a request body
HEAD_MAX = 65536             # bytes of a request's head
CONTEXTS_MAX = 64            # contexts of a sandbox at once
LINE_MAX = 256 << 20         # bytes of one output line of a context (a large PNG)
STREAM_FLUSH = 4096          # stdout/stderr bytes buffered before a line goes out


def drop_privileges():
    """Becomes the image's ordinary account (uid 1000) with its home as cwd and HOME."""
    if os.getuid() != 0:
        return
    try:
        pw = pwd.getpwuid(1000)
    except KeyError:
        pw = pwd.getpwnam("user")
    os.initgroups(pw.pw_name, pw.pw_gid)
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    os.environ.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name,
                      PATH="/usr/local/bin:/usr/bin:/bin:/usr/local/lib/busybox")
    os.chdir(pw.pw_dir)


drop_privileges()
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import matplotlib  # noqa: E402
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy  # noqa: E402,F401
import pandas  # noqa: E402,F401
import random  # noqa: E402

HOME = os.environ.get("HOME", "/home/user")


# ---- inside a context (a forked child) ----

class Out(io.TextIOBase):
    """sys.stdout or sys.stderr of an execution: chunks go out as `stdout`/`stderr` lines."""

    def __init__(self, emit, kind):
        self.emit, self.kind, self.buf = emit, kind, ""

    def writable(self):
        return True

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not %s" % type(s).__name__)
        self.buf += s
        if "\n" in s or len(self.buf) >= STREAM_FLUSH:
            self.flush()
        return len(s)

    def flush(self):
        if self.buf:
            text, self.buf = self.buf, ""
            self.emit({"type": self.kind, "text": text})


def figure_result(fig):
    """A matplotlib figure as E2B returns it: PNG (base64) and its text."""
    b = io.BytesIO()
    fig.savefig(b, format="png")
    return {"png": base64.b64encode(b.getvalue()).decode("ascii"), "text": repr(fig)}


def value_result(v):
    """The rich forms of a value, as Jupyter's display would give them."""
    if isinstance(v, matplotlib.figure.Figure):
        return figure_result(v)
    r = {}
    text = repr(v)
    if isinstance(v, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    r["text"] = text
    for attr, key in (("_repr_html_", "html"), ("_repr_markdown_", "markdown"),
                      ("_repr_svg_", "svg"), ("_repr_png_", "png"), ("_repr_jpeg_", "jpeg"),
                      ("_repr_latex_", "latex"), ("_repr_json_", "json"),
                      ("_repr_javascript_", "javascript")):
        f = getattr(v, attr, None)
        if not callable(f):
            continue
        try:
            out = f()
        except Exception:
            continue
        if out is None:
            continue
        if isinstance(out, tuple):
            out = out[0]
        if isinstance(out, bytes):
            out = base64.b64encode(out).decode("ascii")
        r[key] = out
    return r


def context_main(sock, cwd):
    """A context's loop: one JSON request a line in, its output lines out, until EOF."""
    random.seed(os.urandom(32))
    numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    try:
        os.chdir(cwd)
    except OSError:
        pass
    rf = sock.makefile("rb")
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    count = 0

    def emit(obj):
        sock.sendall(json.dumps(obj).encode() + b"\n")

    def flush_figures():
        for num in plt.get_fignums():
            fig = plt.figure(num)
            r = figure_result(fig)
            r.update(type="result", is_main_result=False)
            emit(r)
        plt.close("all")

    plt.show = lambda *a, **k: flush_figures()
    for line in rf:
        req = json.loads(line)
        count += 1
        emit({"type": "number_of_executions", "execution_count": count})
        saved_env = {}
        for k, v in (req.get("env_vars") or {}).items():
            saved_env[k] = os.environ.get(k)
            os.environ[k] = str(v)
        out, err = Out(emit, "stdout"), Out(emit, "stderr")
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            tree = ast.parse(req["code"], "<cell>", "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<cell>", "exec"), g)
            value = eval(compile(last, "<cell>", "eval"), g) if last is not None else None
            out.flush()
            err.flush()
            flush_figures()
            if value is not None:
                r = value_result(value)
                r.update(type="result", is_main_result=True)
                emit(r)
        except BaseException as e:  # the user's code may raise anything, SystemExit included
            out.flush()
            err.flush()
            tb = traceback.TracebackException.from_exception(e)
            # The worker's own frame (the exec call) is not the user's.
            if tb.stack and tb.stack[0].filename == __file__:
                tb.stack = traceback.StackSummary.from_list(tb.stack[1:])
            emit({"type": "error", "name": type(e).__name__, "value": str(e),
                  "traceback": "".join(tb.format())})
        finally:
            sys.stdout, sys.stderr = old
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        emit({"type": "end_of_execution"})


# ---- the server (the parent) ----

class Context:
    """A context's record; its process is forked on first use."""

    def __init__(self, cid, language, cwd):
        self.id, self.language, self.cwd = cid, language, cwd
        self.pid, self.sock, self.reader, self.writer = None, None, None, None
        self.lock = asyncio.Lock()

    def json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self):
        parent, child = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            try:
                parent.close()
                listener.close()
                signal.signal(signal.SIGINT, signal.default_int_handler)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                devnull = os.open("/dev/null", os.O_RDONLY)
                os.dup2(devnull, 0)
                # No client's connection stays open here: one held by a context would never
                # see its end. Closed through their objects, so no descriptor is closed twice.
                for cw in list(conns):
                    s = cw.transport.get_extra_info("socket")
                    getattr(s, "_sock", s).close()
                context_main(child, self.cwd)
            finally:
                os._exit(0)
        child.close()
        self.pid = pid
        self.reader, self.writer = await asyncio.open_connection(sock=parent, limit=LINE_MAX)

    def stop(self):
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:
                pass
        if self.writer:
            self.writer.close()
        self.pid, self.reader, self.writer = None, None, None


contexts = {"default": Context("default", "python", HOME)}
listener = None
conns = set()      # the writers of the clients' open connections


ended = {}         # pid -> how a context's process ended (its wait status, decoded)


def reap(*_):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if os.WIFSIGNALED(status):
            ended[pid] = "killed by signal %d" % os.WTERMSIG(status)
        else:
            ended[pid] = "exit status %d" % os.waitstatus_to_exitcode(status)
        while len(ended) > 256:
            ended.pop(next(iter(ended)))


async def reply(w, status, body=b"", ctype="application/json"):
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
              413: "Payload Too Large", 429: "Too Many Requests", 500: "Internal Server Error"}
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    w.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (status, reason.get(status, "Error").encode(), ctype.encode(), len(body)) + body)
    await w.drain()


async def read_body(r, headers):
    """The request's body: Content-Length or chunked, at most BODY_MAX bytes."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await r.readuntil(b"\r\n")
                return body
            if len(body) + size > BODY_MAX:
                raise ValueError("body too large")
            body += await r.readexactly(size)
            await r.readexactly(2)
    n = int(headers.get("content-length", "0") or 0)
    if n > BODY_MAX:
        raise ValueError("body too large")
    return await r.readexactly(n) if n else b""


async def execute(w, req):
    code = req.get("code")
    if not isinstance(code, str):
        return await reply(w, 400, {"error": "code must be a string"})
    cid, lang = req.get("context_id"), req.get("language")
    if cid and lang:
        return await reply(w, 400, {"error": "context_id and language exclude each other"})
    if lang not in (None, "python", "python3"):
        return await reply(w, 400, {"error": "language %r is not served: only python" % lang})
    env = req.get("env_vars") or {}
    if not isinstance(env, dict):
        return await reply(w, 400, {"error": "env_vars must be an object"})
    ctx = contexts.get(cid or "default")
    if ctx is None:
        return await reply(w, 404, "context %s not found" % cid, "text/plain")
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n")
    await w.drain()
    client_gone = False
    async with ctx.lock:
        if ctx.pid is None:
            await ctx.start()
        pid, reader = ctx.pid, ctx.reader
        try:
            ctx.writer.write(json.dumps({"code": code, "env_vars": env}).encode() + b"\n")
            await ctx.writer.drain()
        except (ConnectionError, OSError):
            pass    # a dead context: its reader ends at once
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError, ConnectionError, OSError):
                line = b""
            if not line:    # the context died (os._exit, a kill, a restart, out of memory)
                await asyncio.sleep(0.2)    # its SIGCHLD, for how it ended
                how = ended.get(pid, "")
                if ctx.pid == pid:
                    ctx.stop()
                line = (json.dumps({"type": "error", "name": "ContextDied",
                                    "value": "the context's process ended (%s); it starts afresh"
                                             % (how or "unknown"),
                                    "traceback": ""}) + "\n" +
                        json.dumps({"type": "end_of_execution"}) + "\n").encode()
            if not client_gone:
                try:
                    w.write(line)
                    await w.drain()
                except (ConnectionError, OSError):
                    client_gone = True  # the execution goes on; its output is read and dropped
            if b'"end_of_execution"' in line:
                break


async def handle(r, w):
    conns.add(w)
    try:
        head = await r.readuntil(b"\r\n\r\n")
        if len(head) > HEAD_MAX:
            return await reply(w, 400, {"error": "head too large"})
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for h in lines[1:]:
            if ":" in h:
                k, v = h.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        path = target.split("?", 1)[0].rstrip("/") or "/"
        try:
            body = await read_body(r, headers)
        except ValueError:
            return await reply(w, 413, {"error": "the body is over %d bytes" % BODY_MAX})
        try:
            req = json.loads(body) if body.strip() else {}
        except ValueError:
            return await reply(w, 400, {"error": "the body is not JSON"})
        if not isinstance(req, dict):
            return await reply(w, 400, {"error": "the body is not a JSON object"})
        parts = path.strip("/").split("/")
        if path == "/health" and method == "GET":
            return await reply(w, 200, "OK", "text/plain")
        if path == "/execute" and method == "POST":
            return await execute(w, req)
        if path == "/contexts" and method == "GET":
            return await reply(w, 200, [c.json() for c in contexts.values()])
        if path == "/contexts" and method == "POST":
            lang = req.get("language") or "python"
            cwd = req.get("cwd") or HOME
            if lang not in ("python", "python3"):
                return await reply(w, 400, {"error": "language %r is not served: only python" % lang})
            if not isinstance(cwd, str) or not os.path.isdir(cwd):
                return await reply(w, 400, {"error": "cwd %r is not a directory" % (cwd,)})
            if len(contexts) >= CONTEXTS_MAX:
                return await reply(w, 429, {"error": "at most %d contexts" % CONTEXTS_MAX})
            ctx = Context(uuid.uuid4().hex, "python", cwd)
            contexts[ctx.id] = ctx
            return await reply(w, 200, ctx.json())
        if len(parts) in (2, 3) and parts[0] == "contexts":
            ctx = contexts.get(parts[1])
            if ctx is None:
                return await reply(w, 404, "context %s not found" % parts[1], "text/plain")
            if len(parts) == 3 and parts[2] == "restart" and method == "POST":
                ctx.stop()
                ctx.lock = asyncio.Lock()
                return await reply(w, 200, {})
            if len(parts) == 2 and method == "DELETE":
                ctx.stop()
                if ctx.id != "default":
                    del contexts[ctx.id]
                return await reply(w, 200, {})
            return await reply(w, 405, {"error": "method not allowed"})
        return await reply(w, 404, {"error": "no route %s %s" % (method, path)})
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        pass
    finally:
        conns.discard(w)
        try:
            w.close()
        except Exception:
            pass


async def main():
    global listener
    signal.signal(signal.SIGCHLD, reap)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen(128)
    server = await asyncio.start_server(handle, sock=listener, limit=HEAD_MAX)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
