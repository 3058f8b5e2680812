"""portserver.py - what the port URL tests and bench/ports share: an HTTP server for the host's
loopback (the guest's server when the node's hostagent hook stands in for the guest), and the
client side of HTTP heads and WebSocket frames on a raw socket.

The server (serve()) answers
  GET /      13 bytes, "hello, ports\\n", with Content-Length (the bench's request);
  GET /drip  a chunked reply of three parts written DRIP_S apart ("0\\n", "1\\n", "2\\n");
  GET /ws    a WebSocket (the handshake by hand) that says "hello" first, then echoes each frame.
"""
import base64
import hashlib
import http.server
import os
import socket
import struct
import threading
import time

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
DRIP_S = 0.5
HELLO = b"hello, ports\n"


def ws_accept(key):
    """The Sec-WebSocket-Accept answering Sec-WebSocket-Key `key` (bytes)."""
    return base64.b64encode(hashlib.sha1(key + WS_GUID).digest())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):
        if self.path == "/drip":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(3):
                self.wfile.write(b"2\r\n%d\n\r\n" % i)
                self.wfile.flush()
                time.sleep(DRIP_S)
            self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/ws":
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept",
                             ws_accept(self.headers["Sec-WebSocket-Key"].encode()).decode())
            self.end_headers()
            self.wfile.write(b"\x81\x05hello")
            self.wfile.flush()
            while True:
                h = self.rfile.read(2)
                if len(h) < 2 or h[0] & 0x0f == 8:
                    break
                n = h[1] & 0x7f
                if n == 126:
                    n = struct.unpack(">H", self.rfile.read(2))[0]
                mask = self.rfile.read(4)
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
                self.wfile.write(ws_frame(data))
                self.wfile.flush()
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(HELLO)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(HELLO)
        self.close_connection = True


def serve():
    """Starts the server on a free port of 127.0.0.1 in a thread of its own; returns it (its
    port: server_address[1]; stop it with shutdown() and server_close())."""
    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 128  # not the default 5: a burst must not wait out a SYN's retry

    srv = Server(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def ws_frame(data, masked=False):
    """One text frame carrying `data` (bytes), masked as a client sends it when `masked`."""
    n = len(data)
    size = bytes([n | (0x80 if masked else 0)]) if n < 126 else \
        bytes([126 | (0x80 if masked else 0)]) + struct.pack(">H", n)
    if not masked:
        return b"\x81" + size + data
    mask = os.urandom(4)
    return b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


class WsReader:
    """Reads a server's (unmasked) frames from socket `s`, starting with `rest`, the bytes that
    came with the 101's head."""

    def __init__(self, s, rest=b""):
        self.s, self.buf = s, rest

    def _take(self, n):
        while len(self.buf) < n:
            d = self.s.recv(65536)
            if not d:
                raise EOFError
            self.buf += d
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def frame(self):
        h = self._take(2)
        n = h[1] & 0x7f
        if n == 126:
            n = struct.unpack(">H", self._take(2))[0]
        return self._take(n)


def read_head(s):
    """Reads an HTTP head from socket `s`; returns (status, head text, bytes after it), the
    bytes after it holding an error's whole body (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        d = s.recv(4096)
        if not d:
            break
        data += d
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    text = head.decode("latin-1")
    if status != 101:  # an error's whole body
        length = [int(l.split(":", 1)[1]) for l in text.split("\r\n")
                  if l.lower().startswith("content-length:")]
        while length and len(rest) < length[0]:
            d = s.recv(4096)
            if not d:
                break
            rest += d
    return status, text, rest


def recv_all(s, rest=b""):
    """What `s` carries until its end, after `rest`."""
    data = rest
    while True:
        d = s.recv(65536)
        if not d:
            return data
        data += d


def arrivals(s, parts=3, rest=b""):
    """Reads `s` to its end after `rest`; returns (the bytes, the moments the parts "0\n",
    "1\n", ... of a dripped reply were first seen, in order)."""
    seen, data = [], rest
    while True:
        d = s.recv(65536)
        if not d:
            return data, seen
        data += d
        while len(seen) < parts and b"%d\n" % len(seen) in data:
            seen.append(time.monotonic())


def get(addr, head, timeout=60):
    """One request `head` (bytes) on a new connection to `addr`; returns the whole answer."""
    s = socket.create_connection(addr, timeout=timeout)
    try:
        s.sendall(head)
        return recv_all(s)
    finally:
        s.close()
