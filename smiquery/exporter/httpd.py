"""A small HTTP/1.1 server that bad clients cannot starve: one selector thread, a fixed pool of workers.

The selector thread accepts (listen backlog 1024), reads request heads without blocking, and enforces a
whole-request deadline (headers included) and an idle deadline per connection. Only a complete request head goes
to a worker, so slow or silent clients (slowloris) cost a socket and a few bytes, never a thread. When
``max_connections`` sockets are open, the one that has waited longest without a complete request is closed to
make room. TLS handshakes also run in the selector thread, without blocking. Threads: 1 + ``workers``, always.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from smiquery._log import get_logger

__all__ = ["HttpServer", "Request", "Response"]

log = get_logger("smiquery.exporter")

_MAX_HEAD = 16384
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class Request:
    """One parsed request head.

    Attributes:
        method: ``GET``, ``HEAD``...
        path: the path without the query string.
        version: ``HTTP/1.1`` or ``HTTP/1.0``.
        headers: header names in lower case -> value.
        client: the peer address.
    """

    method: str
    path: str
    version: str
    headers: dict[str, str]
    client: str


@dataclass
class Response:
    """What a handler answers.

    Attributes:
        status: the status code.
        body: the body bytes.
        content_type: the Content-Type header.
        headers: extra headers.
    """

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    client: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    started: float = 0.0  # when the first byte of the current request arrived (0: idle)
    handshaking: bool = False
    want_write: bool = False
    busy: bool = False  # a worker owns it
    watched: bool = False  # registered with the selector
    done: bool = False  # closed by a worker


class HttpServer:
    """Serve ``handler(request) -> Response`` on a listening socket until :meth:`shutdown`.

    Args:
        sock: a bound socket (not yet listening).
        handler: called in a worker thread for each request; must not raise (a raise answers 500).
        ssl_context: serve TLS with this server context.
        workers: worker threads (requests answered in parallel).
        max_connections: open client sockets at most.
        request_timeout: seconds from a request's first byte (or a TLS connection's start) to its complete head.
        idle_timeout: seconds a keep-alive connection may sit without starting a request.
        write_timeout: seconds a worker may spend writing one response.
        backlog: the listen backlog.
        server_header: the ``Server`` header value.
        inline: says which requests are cheap enough to answer in the selector thread itself (no thread
            hand-off); the rest, and every TLS request, go to the workers.
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Request], Response],
        *,
        ssl_context: ssl.SSLContext | None = None,
        workers: int = 8,
        max_connections: int = 2048,
        request_timeout: float = 10.0,
        idle_timeout: float = 60.0,
        write_timeout: float = 10.0,
        backlog: int = 1024,
        server_header: str = "smiquery-exporter",
        inline: Callable[[Request], bool] | None = None,
    ) -> None:
        self.sock = sock
        self.handler = handler
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.server_header = server_header
        self.inline = inline
        self.evicted = 0
        self.timed_out = 0
        sock.listen(backlog)
        sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._back: queue.SimpleQueue[_Conn] = queue.SimpleQueue()  # connections returned by workers
        self._jobs: queue.SimpleQueue[tuple[_Conn, bytes, bytes | None, bool] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="smiquery-http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"smiquery-http-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    @property
    def open_connections(self) -> int:
        """Client sockets open now (waiting in the selector)."""
        return len(self._conns)

    # ----------------------------------------------------------------------------------------- selector

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None and conn.watched:
            conn.watched = False
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _watch(self, conn: _Conn) -> None:
        events = selectors.EVENT_WRITE if conn.want_write else selectors.EVENT_READ
        if conn.watched:
            key = self._sel.get_key(conn.sock)
            if key.events != events:
                self._sel.modify(conn.sock, events, conn)
        else:
            self._sel.register(conn.sock, events, conn)
            conn.watched = True

    def _unwatch(self, conn: _Conn) -> None:
        if conn.watched:
            conn.watched = False
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)

    def _evict_one(self) -> None:
        # The connection that has waited longest for its request head is the likeliest to be a slow attacker.
        victim = min((c for c in self._conns.values() if not c.busy), key=lambda c: c.deadline, default=None)
        if victim is not None:
            self.evicted += 1
            self._close(victim)

    def _accept(self) -> None:
        for _ in range(256):
            try:
                raw, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("smiquery exporter: cannot accept connections: %s", exc.strerror)
                    if self._conns:
                        self._evict_one()
                return
            if len(self._conns) >= self.max_connections:
                self._evict_one()
            raw.setblocking(False)
            with contextlib.suppress(OSError):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            now = time.monotonic()
            client = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            sock = raw
            handshaking = False
            if self.ssl_context is not None:
                try:
                    sock = self.ssl_context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                except (OSError, ssl.SSLError):
                    raw.close()
                    continue
                handshaking = True
            conn = _Conn(sock, client, now + self.request_timeout, started=now if handshaking else 0.0)
            conn.handshaking = handshaking
            if not handshaking:
                conn.deadline = now + self.idle_timeout
            self._conns[sock] = conn
            if not handshaking:
                # Under load the request is usually there by the time the connection is accepted: read it now
                # and spare a trip through the selector.
                self._readable(conn)
            if sock in self._conns and not conn.busy and not conn.watched:
                self._sel.register(sock, selectors.EVENT_READ, conn)
                conn.watched = True

    def _readable(self, conn: _Conn) -> None:
        sock = conn.sock
        if conn.handshaking:
            assert isinstance(sock, ssl.SSLSocket)
            try:
                sock.do_handshake()
            except ssl.SSLWantReadError:
                conn.want_write = False
                self._watch(conn)
                return
            except ssl.SSLWantWriteError:
                conn.want_write = True
                self._watch(conn)
                return
            except (OSError, ssl.SSLError) as exc:
                log.debug("smiquery exporter: TLS handshake with %s failed: %s", conn.client, exc)
                self._close(conn)
                return
            conn.handshaking = False
            conn.want_write = False
            conn.started = 0.0
            conn.deadline = time.monotonic() + self.idle_timeout
            self._watch(conn)
        while True:
            try:
                chunk = sock.recv(8192)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                break
            except ssl.SSLWantWriteError:
                conn.want_write = True
                self._watch(conn)
                return
            except (OSError, ssl.SSLError):
                self._close(conn)
                return
            if not chunk:
                self._close(conn)
                return
            if not conn.buf and not conn.started:
                conn.started = time.monotonic()
                conn.deadline = conn.started + self.request_timeout
            conn.buf += chunk
            if b"\r\n\r\n" in conn.buf or len(conn.buf) > _MAX_HEAD:
                break
            if not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                break
        if conn.want_write:
            conn.want_write = False
            self._watch(conn)
        self._maybe_dispatch(conn)

    def _maybe_dispatch(self, conn: _Conn) -> None:
        end = conn.buf.find(b"\r\n\r\n", 0, _MAX_HEAD + 4)
        if end < 0 and len(conn.buf) <= _MAX_HEAD:
            return
        if end < 0:
            head = b""  # too large: the worker answers 431
            conn.buf.clear()
        else:
            head = bytes(conn.buf[: end + 4])
            del conn.buf[: end + 4]
        if self.inline is not None and not isinstance(conn.sock, ssl.SSLSocket):
            req, error = _parse(head, conn.client)
            if req is None or self.inline(req):
                self._answer_inline(conn, head, (req, error))
                return
        self._unwatch(conn)
        conn.busy = True
        self._jobs.put((conn, head, None, False))

    def _answer_inline(self, conn: _Conn, head: bytes, parsed: tuple[Request | None, int]) -> None:
        # Answered in the selector thread: no hand-off between threads for the common, cheap request. What the
        # socket buffer cannot take at once is finished by a worker (with the write deadline).
        data, close = self._respond(head, conn.client, parsed)
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        if sent < len(data):
            self._unwatch(conn)
            conn.busy = True
            self._jobs.put((conn, b"", data[sent:], close))
            return
        if close:
            self._close(conn)
            return
        self._resume(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now and not c.busy]:
            if conn.started and conn.buf:
                self.timed_out += 1
                with contextlib.suppress(OSError, ValueError):
                    conn.sock.send(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self._close(conn)

    def _loop(self) -> None:
        next_sweep = time.monotonic() + 0.25
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(timeout=0.25):
                    if key.fileobj is self.sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        conn = key.data
                        if conn.sock in self._conns:
                            self._readable(conn)
                while True:
                    try:
                        conn = self._back.get_nowait()
                    except queue.Empty:
                        break
                    self._resume(conn)
                now = time.monotonic()
                if now >= next_sweep:
                    self._expire(now)
                    next_sweep = now + 0.25
        except Exception:  # pragma: no cover - a bug; never die silently
            log.exception("smiquery exporter: the HTTP selector loop failed")
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)

    def _resume(self, conn: _Conn) -> None:
        conn.busy = False
        if conn.done or self._stop.is_set() or conn.sock not in self._conns:
            self._close(conn)
            return
        now = time.monotonic()
        conn.started = now if conn.buf else 0.0
        conn.deadline = now + (self.request_timeout if conn.buf else self.idle_timeout)
        self._watch(conn)
        if conn.buf:
            self._maybe_dispatch(conn)
        elif isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():
            self._readable(conn)

    # ----------------------------------------------------------------------------------------- workers

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, head, rest, close = job
            keep = False
            try:
                if rest is not None:
                    keep = self._send(conn, rest) and not close
                else:
                    data, close = self._respond(head, conn.client)
                    keep = self._send(conn, data) and not close
            except Exception:
                log.debug("smiquery exporter: answering %s failed", conn.client, exc_info=True)
            if keep and not self._stop.is_set():
                self._back.put(conn)
                self._wake()
            else:
                self._back.put(_closed(conn))
                self._wake()

    def _respond(
        self, head: bytes, client: str, parsed: tuple[Request | None, int] | None = None
    ) -> tuple[bytes, bool]:
        """The response bytes for one request head, and whether to close afterwards."""
        req, error = parsed if parsed is not None else _parse(head, client)
        if req is None:
            return self._encode(Response(error, f"{_REASONS.get(error, 'error')}\n".encode()), True, False), True
        close = req.headers.get("connection", "").lower() == "close" or (
            req.version == "HTTP/1.0" and req.headers.get("connection", "").lower() != "keep-alive"
        )
        length = req.headers.get("content-length", "0").strip() or "0"
        if req.headers.get("transfer-encoding") or not length.isdigit() or int(length) > 0:
            # a scrape endpoint takes no bodies; refusing them keeps the framing simple and safe
            return self._encode(Response(413, b"request bodies are not accepted\n"), True, False), True
        try:
            resp = self.handler(req)
        except Exception:
            log.exception("smiquery exporter: handling %s %s failed", req.method, req.path)
            resp = Response(500, b"internal error\n")
        return self._encode(resp, close, req.method == "HEAD"), close

    def _encode(self, resp: Response, close: bool, head: bool) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in resp.headers.items())
        top = (
            f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, '')}\r\nContent-Type: {resp.content_type}\r\n"
            f"Content-Length: {len(resp.body)}\r\nServer: {self.server_header}\r\n{extra}"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
        ).encode("latin-1")
        return top if head else top + resp.body

    def _send(self, conn: _Conn, data: bytes) -> bool:
        sock = conn.sock
        try:
            sock.settimeout(self.write_timeout)
            sock.sendall(data)
            sock.setblocking(False)
        except (OSError, ssl.SSLError, ValueError):
            return False
        return True

    # ----------------------------------------------------------------------------------------- control

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and end all threads (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        for _ in self._threads[1:]:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            self._sel.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()


def _closed(conn: _Conn) -> _Conn:
    conn.done = True
    with contextlib.suppress(OSError):
        conn.sock.close()
    return conn


def _parse(head: bytes, client: str) -> tuple[Request | None, int]:
    if not head:
        return None, 431
    try:
        text = head.decode("latin-1")
        lines = text.split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None, 400
    if version not in ("HTTP/1.1", "HTTP/1.0") or not method.isalpha():
        return None, 400
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return None, 400
        headers[name.lower()] = value.strip()
    return Request(method, target.split("?", 1)[0], version, headers, client), 0


def thread_count() -> int:
    """Threads of this process (for tests and benchmarks)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - not Linux
        return threading.active_count()
