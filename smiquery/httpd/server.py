"""A small HTTP/1.1 server that bad clients cannot starve or stop: one selector thread, a fixed pool of workers.

The selector thread owns every socket (never blocking, each with a deadline), so a slow reader costs a buffer, never
a thread; workers only compute the responses it should not, and a verifier thread checks passwords, so guesses
never hold a worker. Heads are parsed strictly (RFC 9112) and may carry no body; a failure closes its connection.
"""

from __future__ import annotations

import contextlib
import errno
import http
import os
import queue
import re
import selectors
import socket
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from smiquery._log import RateLimiter, get_logger
from smiquery.errors import ListenError, PortInUseError

if TYPE_CHECKING:
    from smiquery.httpd.webconfig import WebConfig

__all__ = ["HttpServer", "Request", "Response", "listen", "route"]

log = get_logger("smiquery.exporter")

_MAX_HEAD = 16384
_READ = 65536
_CHUNK = 65536
_IDLE = 60.0  # seconds a keep-alive connection may sit idle
_TURN = 64  # pipelined requests answered for one connection before the others get a turn
_REASONS = {s.value: s.phrase for s in http.HTTPStatus} | {413: "Content Too Large"}  # RFC 9110's name
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters other than HTAB
_TARGET = re.compile(r"/[\x21-\x7e]*")  # origin-form: no spaces, controls or raw non-ASCII bytes
_DIGITS = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also accepts '²', which int() refuses
_BARE = re.compile(rb"\r(?!\n)|(?<!\r)\n")  # a CR or LF that is not part of a CRLF
_SINGLE = frozenset({"host", "content-length", "authorization", "transfer-encoding"})


@dataclass
class Request:
    """One parsed request head: ``path`` without the query, ``headers`` by lower-case name (repeats joined)."""

    method: str
    path: str
    version: str
    headers: dict[str, str]
    client: str


@dataclass
class Response:
    """What a handler answers: status, body, Content-Type and extra headers."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


def route(req: Request, pages: Mapping[str, Callable[[Request], Response]], missing: bytes) -> Response:
    """``pages[req.path](req)`` (``/metrics`` and friends) for GET and HEAD; else 405, or 404 saying ``missing``."""
    if req.method not in ("GET", "HEAD"):
        return Response(405, b"only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
    page = pages.get(req.path)
    return page(req) if page is not None else Response(404, missing)


_UNAUTHORIZED = Response(401, b"unauthorized\n", headers={"WWW-Authenticate": 'Basic realm="smiquery"'})
_TOO_MANY = Response(429, b"too many password checks waiting: retry later\n", headers={"Retry-After": "1"})


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    client: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    out: bytearray = field(default_factory=bytearray)  # response bytes not yet written
    chunk: bytes | None = None  # the slice being written: TLS wants the same bytes again after WANT_WRITE
    close_after: bool = False  # close once ``out`` is written
    started: float = 0.0  # when the first byte of the current request arrived (0: idle)
    handshaking: bool = False
    busy: bool = False  # a worker computes its response
    watched: bool = False  # registered with the selector
    closed: bool = False
    eof: bool = False  # the client sent FIN: answer what is complete, then close
    read_wants_write: bool = False  # TLS: reading needs the socket writable first
    held: bytes | None = None  # a response to send once ``deadline`` passes (a shed request's 429)


class HttpServer:
    """Serve ``handler(request) -> Response`` on a listening socket until :meth:`shutdown`.

    ``sock`` is bound, not listening yet; a raise in ``handler`` answers 500 (logged at most once a minute);
    ``inline`` says which requests are cheap enough to answer in the selector thread itself; ``web`` gives TLS,
    allowed client certificates, response headers and basic auth (401 for a refusal). ``max_connections`` sockets
    stay open at most (past it the one that has waited longest makes room); ``request_timeout`` is the seconds from
    a request's first byte (or a TLS connection's start) to its complete head (an idle keep-alive connection closes
    after 60 s), ``write_timeout`` those a client has to take one response. Past ``auth_queue`` password
    checks waiting or running, a request is answered 429 (``Retry-After: 1``) a second later and closed.
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Request], Response],
        *,
        web: WebConfig | None = None,
        workers: int = 8,
        max_connections: int = 2048,
        request_timeout: float = 10.0,
        write_timeout: float = 10.0,
        server_header: str = "smiquery-exporter",
        inline: Callable[[Request], bool] | None = None,
        auth_queue: int = 16,
    ) -> None:
        self.sock = sock
        self.handler = handler
        self.ssl_context = web.ssl_context if web is not None else None
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self.write_timeout = write_timeout
        self.server_header = server_header
        self.inline = inline
        self.peer_check = web.peer_allowed if web is not None and web.allowed_sans else None
        self.auth = web if web is not None and web.users else None
        self.auth_queue = auth_queue
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (web.headers if web is not None else {}).items())
        self.failures = 0  # connections closed because handling them raised (each one contained)
        self.shed = 0  # requests answered 429: the verifier's queue was full
        self.pending_checks = 0  # password checks handed to the verifier, not answered yet (the selector's count)
        self._limit = RateLimiter()  # one WARNING per message a minute
        _raise_fd_limit(max_connections + 256)
        sock.listen(1024)
        sock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._ready: deque[_Conn] = deque()  # complete requests still buffered after a connection's turn
        # answers from the workers and the verifier: (connection, the selector's next step, its arguments)
        self._back: queue.SimpleQueue[tuple[_Conn, Callable[..., bool | None], tuple[object, ...]]] = (
            queue.SimpleQueue()
        )
        self._jobs: queue.SimpleQueue[tuple[_Conn, Request] | None] = queue.SimpleQueue()
        self._checks: queue.SimpleQueue[tuple[_Conn, Request] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="smiquery-http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"smiquery-http-{i}", daemon=True) for i in range(workers)
        ]
        if self.auth is not None:
            self._threads.append(threading.Thread(target=self._verify, name="smiquery-http-auth", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def open_connections(self) -> int:
        """Client sockets open now."""
        return len(self._conns)

    @property
    def alive(self) -> bool:
        """Whether the selector thread runs (it ends only at :meth:`shutdown`)."""
        return self._threads[0].is_alive()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _close(self, conn: _Conn) -> None:
        conn.closed = True
        self._conns.pop(conn.sock, None)
        self._unwatch(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.watched:
            if self._sel.get_key(conn.sock).events != events:
                self._sel.modify(conn.sock, events, conn)
        else:
            self._sel.register(conn.sock, events, conn)
            conn.watched = True

    def _unwatch(self, conn: _Conn) -> None:
        if conn.watched:
            conn.watched = False
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)

    def _warn(self, msg: str, *args: object) -> None:
        """A repeating failure: one WARNING a minute saying how many were held back, every one at DEBUG."""
        held = self._limit.take(msg)
        if held is not None:
            tail = f" ({held} more like it held back in the last {self._limit.period:g} s)" if held else ""
            log.warning(msg + "%s; details at DEBUG", *args, tail)
        log.debug(msg, *args, exc_info=True)

    def _guard(self, conn: _Conn | None, step: Callable[..., object], *args: object) -> None:
        """Run one step; a raise closes ``conn`` (only it) and is logged, throttled."""
        try:
            step(*args)
        except Exception:
            self.failures += 1
            client = conn.client if conn is not None else "the listening socket"
            self._warn("smiquery exporter: a connection failed and was closed (%s)", client)
            if conn is not None:
                with contextlib.suppress(Exception):
                    self._close(conn)

    def _evict_one(self) -> None:
        # The connection that has waited longest is the likeliest to be a slow attacker.
        victim = min((c for c in self._conns.values() if not c.busy), key=lambda c: c.deadline, default=None)
        if victim is not None:
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
                    self._evict_one()
                return
            if len(self._conns) >= self.max_connections:
                self._evict_one()
            raw.setblocking(False)
            with contextlib.suppress(OSError):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            now = time.monotonic()
            client = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if self.ssl_context is not None:
                try:
                    tls = self.ssl_context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                except (OSError, ssl.SSLError):
                    raw.close()
                    continue
                conn = _Conn(tls, client, now + self.request_timeout, started=now, handshaking=True)
            else:
                conn = _Conn(raw, client, now + _IDLE)
            self._conns[conn.sock] = conn
            # Under load the request is usually there by the time the connection is accepted: read it (or start the
            # handshake) now and spare a trip through the selector.
            self._guard(conn, self._event, conn)

    def _handshake(self, conn: _Conn) -> None:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError) as want:
            self._watch(conn, selectors.EVENT_READ if isinstance(want, ssl.SSLWantReadError) else selectors.EVENT_WRITE)
            return
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.debug("smiquery exporter: TLS handshake with %s failed: %s", conn.client, exc)
            self._close(conn)
            return
        if self.peer_check is not None and not self.peer_check(sock):
            log.debug("smiquery exporter: client certificate of %s is not allowed", conn.client)
            self._close(conn)
            return
        conn.handshaking = False
        conn.started = 0.0
        conn.deadline = time.monotonic() + _IDLE
        if self._read(conn):
            self._process(conn)

    def _event(self, conn: _Conn) -> None:
        if conn.handshaking:
            self._handshake(conn)
        elif self._flush(conn) if conn.out else self._read(conn):  # a response under way, or a request
            self._process(conn)

    def _read(self, conn: _Conn) -> bool:
        """Read what is there (up to a bound) into ``conn.buf``; False when the connection was closed."""
        sock = conn.sock
        conn.read_wants_write = False
        got = 0
        while got < _READ:
            try:
                chunk = sock.recv(_READ)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return True
            except ssl.SSLWantWriteError:
                conn.read_wants_write = True
                return True
            except (OSError, ssl.SSLError, ValueError):
                self._close(conn)
                return False
            if not chunk:
                conn.eof = True
                return True
            conn.buf += chunk
            got += len(chunk)
            if not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                return True
        return True

    def _take(self, conn: _Conn) -> tuple[bytes | None, int]:
        """The next complete request head in the buffer: (head, 0), (None, 0) for "not yet", or (None, code)."""
        buf = conn.buf
        end = buf.find(b"\r\n\r\n", 0, _MAX_HEAD + 4)
        region = memoryview(buf)[: end + 2] if end >= 0 else memoryview(buf)[: len(buf) - buf.endswith(b"\r")]
        with region:
            if _BARE.search(region):
                return None, 400  # a lone CR or LF: refused at once rather than left to the deadline
        if end < 0:
            return (None, 431) if len(buf) > _MAX_HEAD else (None, 0)
        head = bytes(buf[: end + 4])
        del buf[: end + 4]
        conn.started = 0.0
        return head, 0

    def _process(self, conn: _Conn) -> None:
        """Answer the complete requests in the buffer, in order, then wait for what comes next."""
        for _ in range(_TURN):
            if conn.closed or conn.busy or conn.out or conn.held is not None:
                return
            head, error = self._take(conn)
            if head is None and not error:
                if conn.buf and isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():
                    if not self._read(conn):
                        return
                    continue
                if conn.eof:
                    self._close(conn)
                    return
                if conn.buf and not conn.started:  # a request's first bytes: its head is due within request_timeout
                    conn.started = time.monotonic()
                    conn.deadline = conn.started + self.request_timeout
                self._watch(conn, selectors.EVENT_WRITE if conn.read_wants_write else selectors.EVENT_READ)
                return
            req, error = (None, error) if head is None else _parse(head, conn.client)
            if req is None:
                conn.buf.clear()  # the connection closes after the error
                self._start(conn, self._error(error), True)
                continue
            known = True if self.auth is None else self.auth.verdict(req.headers.get("authorization"))
            if known is None:
                if self.pending_checks >= self.auth_queue:
                    self.shed += 1
                    conn.held = self._encode(_TOO_MANY, True, req.method == "HEAD")
                    conn.buf.clear()
                    conn.deadline = time.monotonic() + 1.0  # retrying at once cannot flood the server
                    self._unwatch(conn)
                    return
                self.pending_checks += 1
                self._park(conn, req, self._checks)
                return
            if not self._dispatch(conn, req, known):
                return
        if not conn.closed and not conn.busy and not conn.out:
            self._ready.append(conn)  # more pipelined requests: after the other connections' turn

    def _park(self, conn: _Conn, req: Request, jobs: queue.SimpleQueue[tuple[_Conn, Request] | None]) -> None:
        """Hand ``req`` to a thread; ``conn`` is not read meanwhile (no deadline, no eviction)."""
        conn.busy = True
        self._unwatch(conn)
        jobs.put((conn, req))

    def _dispatch(self, conn: _Conn, req: Request, allowed: bool) -> bool:
        """Answer ``req`` now (a refusal, or what ``inline`` calls cheap) or hand it to a worker (then False)."""
        if not allowed:
            self._start(conn, *self._reply(req, _UNAUTHORIZED))
            return True
        try:
            fast = self.inline is not None and self.inline(req)
        except Exception:
            fast = False
        if fast:
            self._start(conn, *self._respond(req))
            return True
        self._park(conn, req, self._jobs)
        return False

    def _checked(self, conn: _Conn, req: Request, allowed: bool) -> bool:
        self.pending_checks -= 1
        return self._dispatch(conn, req, allowed)

    def _resume(self, conn: _Conn, step: Callable[..., bool | None], *args: object) -> None:
        """A thread's answer for ``conn``: take the next step with it, then go on with what the client sent after."""
        conn.busy = False
        if conn.closed or self._stop.is_set():
            self._close(conn)
        elif step(conn, *args) is not False and not conn.closed and not conn.out:
            self._process(conn)

    def _start(self, conn: _Conn, data: bytes, close: bool) -> None:
        """Begin writing one response (within ``write_timeout``)."""
        conn.out += data
        conn.close_after = close
        conn.deadline = time.monotonic() + self.write_timeout
        self._flush(conn)

    def _flush(self, conn: _Conn) -> bool:
        """Write what the socket takes now; True when the response is done and the connection stays open."""
        sock = conn.sock
        while conn.out:
            if conn.chunk is None:
                conn.chunk = bytes(conn.out[:_CHUNK])
            try:
                sent = sock.send(conn.chunk)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError) as want:
                read = isinstance(want, ssl.SSLWantReadError)  # TLS: writing needs the socket readable first
                self._watch(conn, selectors.EVENT_READ if read else selectors.EVENT_WRITE)
                return False
            except (OSError, ssl.SSLError, ValueError):
                self._close(conn)
                return False
            del conn.out[:sent]
            conn.chunk = None
        if conn.close_after or self._stop.is_set():
            self._close(conn)
            return False
        conn.deadline = time.monotonic() + _IDLE
        return True

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now and not c.busy]:
            if conn.held is not None:
                data, conn.held = conn.held, None
                self._guard(conn, self._start, conn, data, True)
                continue
            if conn.started and conn.buf and not conn.out and not conn.handshaking:
                with contextlib.suppress(Exception):
                    conn.sock.send(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self._close(conn)

    def _turn(self, next_sweep: float) -> float:
        ready = list(self._ready)
        self._ready.clear()
        for key, _ in self._sel.select(timeout=0 if ready else 0.25):
            if key.fileobj is self.sock:
                self._guard(None, self._accept)
            elif key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                conn = key.data
                if not conn.closed:
                    self._guard(conn, self._event, conn)
        for conn in ready:
            if not conn.closed:
                self._guard(conn, self._process, conn)
        while not self._back.empty():  # this thread is its only reader
            conn, step, args = self._back.get_nowait()
            self._guard(conn, self._resume, conn, step, *args)
        now = time.monotonic()
        if now >= next_sweep:
            self._expire(now)
            next_sweep = now + 0.25
        return next_sweep

    def _loop(self) -> None:
        next_sweep = time.monotonic() + 0.25
        try:
            while not self._stop.is_set():
                try:
                    next_sweep = self._turn(next_sweep)
                except Exception:
                    # Not tied to one connection (a bug): say so, and keep serving the others.
                    self.failures += 1
                    self._warn("smiquery exporter: the HTTP selector loop hit an error and goes on")
                    self._stop.wait(0.01)
        finally:
            for conn in list(self._conns.values()):
                with contextlib.suppress(Exception):
                    self._close(conn)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            conn, req = job
            try:
                data, close = self._respond(req)
            except Exception:
                self._warn("smiquery exporter: answering %s failed", conn.client)
                data, close = self._error(500), True
            self._back.put((conn, self._start, (data, close)))
            self._wake()

    def _verify(self) -> None:
        """The verifier thread: one slow password check after another, at a lower CPU priority than the rest."""
        if sys.platform == "linux":  # a thread's own nice value (elsewhere the id could name another process)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        assert self.auth is not None
        while (job := self._checks.get()) is not None:
            conn, req = job
            try:
                allowed = self.auth.authorized(req.headers.get("authorization"))
            except Exception:
                self._warn("smiquery exporter: checking the password of %s failed", conn.client)
                allowed = False
            self._back.put((conn, self._checked, (req, allowed)))
            self._wake()

    def _error(self, status: int) -> bytes:
        return self._encode(Response(status, f"{_REASONS.get(status, 'error')}\n".encode()), True, False)

    def _respond(self, req: Request) -> tuple[bytes, bool]:
        """The handler's response bytes for one request, and whether to close afterwards."""
        try:
            resp = self.handler(req)
        except Exception:
            self._warn("smiquery exporter: handling %s %s failed", req.method, req.path)
            resp = Response(500, b"internal error\n")
        return self._reply(req, resp)

    def _reply(self, req: Request, resp: Response) -> tuple[bytes, bool]:
        """``resp`` encoded for ``req`` (no body for HEAD), and whether to close afterwards."""
        conn_hdr = req.headers.get("connection", "").lower()
        close = "close" in conn_hdr or (req.version == "HTTP/1.0" and "keep-alive" not in conn_hdr)
        return self._encode(resp, close, req.method == "HEAD"), close

    def _encode(self, resp: Response, close: bool, head: bool) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in resp.headers.items())
        top = (
            f"HTTP/1.1 {resp.status} {_REASONS.get(resp.status, '')}\r\nContent-Type: {resp.content_type}\r\n"
            f"Content-Length: {len(resp.body)}\r\nServer: {self.server_header}\r\n{self._extra}{extra}"
            f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
        ).encode("latin-1")
        return top if head else top + resp.body

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and end all threads (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        for _ in self._threads[1:]:
            self._jobs.put(None)
        self._checks.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            self._sel.close()
        for s in (self.sock, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                s.close()


def _parse(head: bytes, client: str) -> tuple[Request | None, int]:
    """A strictly parsed request head (ending in CRLF CRLF), or (None, status) saying why not."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None, 400
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0") or not _TOKEN.fullmatch(method) or not _TARGET.fullmatch(target):
        return None, 400
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            return None, 400  # also a folded line (leading space) and a space before the colon
        value = value.strip(" \t")
        if _CTL.search(value):
            return None, 400
        key = name.lower()
        if key in headers:
            if key in _SINGLE:
                return None, 400  # two Content-Length (or Host...) values: a smuggling attempt, or a broken client
            headers[key] += ", " + value
        else:
            headers[key] = value
    if version == "HTTP/1.1" and "host" not in headers:
        return None, 400
    length = headers.get("content-length")
    if length is not None and not _DIGITS.fullmatch(length):
        return None, 400
    if "transfer-encoding" in headers or (length is not None and int(length) > 0):
        # a scrape endpoint takes no bodies; refusing them (and closing) keeps the framing simple and safe
        return None, 413
    return Request(method, target.split("?", 1)[0], version, headers, client), 0


def listen(bind: str, port: int, *, port_option: str = "--port", bind_option: str = "--bind") -> socket.socket:
    """A socket bound to ``bind`` (a name or an address, IPv6 in brackets or not) and ``port``, not listening yet.

    Raises PortInUseError for a taken port, else ListenError; the message names the option to change.
    """
    try:
        infos = socket.getaddrinfo(bind.strip("[]"), None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        msg = f"cannot listen on {bind!r}: {exc.strerror}"
        raise ListenError(msg, port=0, bind=bind, option=bind_option) from None
    family = infos[0][0] if infos else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((bind.strip("[]"), port))
    except OSError as exc:
        sock.close()
        why, option = {
            errno.EADDRINUSE: (f"port {port} on {bind} is in use", port_option),
            errno.EACCES: (f"no permission to listen on port {port} on {bind} (below 1024 needs root)", port_option),
            errno.EADDRNOTAVAIL: (f"cannot listen on {bind}: the address is not on this machine", bind_option),
        }.get(exc.errno or 0, (f"cannot listen on {bind}:{port}: {exc.strerror or exc}", ""))
        error = PortInUseError if exc.errno == errno.EADDRINUSE else ListenError
        msg = f"{why}; pick another with {option}" if option else why
        raise error(msg, port=port, bind=bind, option=option or port_option) from None
    return sock


def _raise_fd_limit(wanted: int) -> None:
    # Many distributions start services with a soft limit of 1024 open files; a server that holds up to
    # max_connections sockets needs more. Raise the soft limit towards the hard one (never lower it).
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, OSError, ValueError):  # pragma: no cover - not Linux, or not allowed
        log.debug("smiquery: could not raise the open-file limit", exc_info=True)
