"""The HTTP(S) server: /metrics, /healthz and friends, and :func:`serve`, which wires a stream to it."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from smiquery import __version__
from smiquery.errors import SmiqueryError
from smiquery.exporter.collector import SmiCollector, parse_labels
from smiquery.exporter.naming import _DCGM_DEFAULT_EXTRAS, _DCGM_EXTRA_IDENTITY, IDENTITY_FIELDS, Naming
from smiquery.exporter.poller import ProcessPoller
from smiquery.fields import resolve_fields
from smiquery.oneshot import normalize_gpus
from smiquery.supervisor import stream

if TYPE_CHECKING:
    import os

    from smiquery.oneshot import GpusArg

__all__ = ["CONTENT_TYPE", "Exporter", "ListenError", "PortInUseError", "serve"]

log = logging.getLogger("smiquery.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ListenError(SmiqueryError):
    """The HTTP server cannot listen where asked.

    Attributes:
        port: the port asked for.
        bind: the address asked for.
        option: the option to change, ``--port`` or ``--bind``.
    """

    def __init__(self, message: str, *, port: int, bind: str, option: str = "--port") -> None:
        self.port = port
        self.bind = bind
        self.option = option
        super().__init__(message)


class PortInUseError(ListenError):
    """Another program listens on the port already."""


# ---------------------------------------------------------------------------------------------------- server


_INDEX = (
    "<!doctype html><html><head><title>smiquery exporter</title></head><body>"
    "<h1>smiquery exporter</h1><p>version {version}, naming {naming}</p>"
    '<ul><li><a href="metrics">/metrics</a></li><li><a href="healthz">/healthz</a></li></ul></body></html>\n'
)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "smiquery-exporter/" + __version__
    sys_version = ""
    timeout = 60  # an idle keep-alive connection is closed after this many seconds
    server: _Server

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, *, head: bool) -> None:
        collector = self.server.collector
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, CONTENT_TYPE, collector.exposition() + self.server.extra(), head)
        elif path == "/healthz":
            ok, why = collector.health()
            self._send(200 if ok else 503, "text/plain; charset=utf-8", (why + "\n").encode(), head)
        elif path in ("/", "/index.html"):
            page = _INDEX.format(version=__version__, naming=collector.naming).encode()
            self._send(200, "text/html; charset=utf-8", page, head)
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics or /healthz\n", head)

    def _send(self, code: int, ctype: str, body: bytes, head: bool) -> None:
        # One write for status, headers and body: no small-segment delays, one syscall.
        reason = self.responses.get(code, ("",))[0]
        conn = "Connection: close\r\n" if self.close_connection else ""
        top = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Server: {self.server_version}\r\n{conn}\r\n"
        ).encode("latin-1")
        self.wfile.write(top if head else top + body)
        if code >= 400 or log.isEnabledFor(logging.DEBUG):
            self.log_request(code, len(body))

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    collector: SmiCollector
    ssl_context: ssl.SSLContext | None = None
    extra: Callable[[], bytes]

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the FQDN of the address, which can stall on hosts without DNS.
        super(ThreadingHTTPServer, self).server_bind()  # TCPServer.server_bind: bind only
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        super().__init__(address, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        ctx = self.ssl_context
        conn = request
        if ctx is not None:
            # The TLS handshake runs here, in the connection's own thread, so a slow client cannot block accept().
            request.settimeout(10.0)
            try:
                conn = ctx.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.debug("smiquery exporter: TLS handshake with %s failed: %s", client_address, exc)
                return
        with self._conns_lock:
            self._conns[conn] = threading.current_thread()
        try:
            _Handler(conn, client_address, self)
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)
            if conn is not request:
                with contextlib.suppress(OSError):
                    conn.close()

    def close_connections(self, timeout: float = 2.0) -> None:
        """End open keep-alive connections (their threads are blocked reading the next request) and wait."""
        with self._conns_lock:
            conns = dict(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for thread in conns.values():
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-response is routine; never print tracebacks from the server threads.
        log.debug("smiquery exporter: request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


def _tls_context(
    cert: str | os.PathLike[str], key: str | os.PathLike[str], client_ca: str | os.PathLike[str] | None
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(client_ca))
    return ctx


def _family_of(bind: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(bind.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bind, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {bind!r}: {exc.strerror}", port=0, bind=bind, option="--bind") from None
    return infos[0][0] if infos else socket.AF_INET


def _make_server(bind: str, port: int) -> _Server:
    cls = _Server6 if _family_of(bind) == socket.AF_INET6 else _Server
    try:
        return cls((bind.strip("[]"), port), _Handler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {bind} is in use; pick another with --port", port=port, bind=bind
            ) from None
        if exc.errno == errno.EACCES:
            msg = f"no permission to listen on port {port} on {bind} (below 1024 needs root); pick another with --port"
            raise ListenError(msg, port=port, bind=bind) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            msg = f"cannot listen on {bind}: the address is not on this machine; pick another with --bind"
            raise ListenError(msg, port=port, bind=bind, option="--bind") from None
        raise ListenError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}", port=port, bind=bind) from None


class Exporter:
    """A running exporter: one background stream, optionally a process poller, and an HTTP(S) server thread.

    Made by :func:`serve`. Use it as a context manager or call :meth:`stop`.

    Attributes:
        collector: the :class:`SmiCollector` behind ``/metrics``.
        stream: the background :class:`~smiquery.supervisor.Stream`.
        poller: the :class:`ProcessPoller`, when ``processes=True``.
    """

    def __init__(self, server: _Server, collector: SmiCollector, poller: ProcessPoller | None, tls: bool) -> None:
        self._server = server
        self.collector = collector
        self.stream = collector.stream
        self.poller = poller
        self._tls = tls
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.25}, name="smiquery-http", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The port actually listened on (useful with ``port=0``)."""
        return self._server.server_port

    @property
    def bind(self) -> str:
        """The address listened on."""
        return self._server.server_name

    @property
    def url(self) -> str:
        """The base URL (``http://127.0.0.1:9849``); metrics are at ``url + "/metrics"``."""
        host = self.bind
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self._tls else 'http'}://{host}:{self.port}"

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` has run."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop serving, close the stream (nvidia-smi is reaped) and the poller. Idempotent; any thread."""
        with self._lock:
            if self._stopped.is_set():
                return
            try:
                self._server.shutdown()
                self._server.server_close()
                self._server.close_connections()
                self._thread.join(2.0)
            finally:
                try:
                    close = getattr(self.stream, "close", None)
                    if close is not None:
                        close()
                finally:
                    if self.poller is not None:
                        self.poller.close()
                    self._stopped.set()

    def serve_forever(self, poll: float = 0.5) -> None:
        """Block until :meth:`stop` is called (from a signal handler or another thread).

        Args:
            poll: seconds between checks, so that signal handlers run promptly in the main thread.
        """
        while not self._stopped.wait(poll):
            pass

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    *,
    port: int = 9849,
    bind: str = "127.0.0.1",
    interval: float = 5.0,
    fields: str | Sequence[str] | None = "health",
    gpus: GpusArg = None,
    labels: Mapping[str, str] | Iterable[str] | None = None,
    naming: Naming = "smiquery",
    processes: bool = False,
    processes_interval: float = 15.0,
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    client_ca: str | os.PathLike[str] | None = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    registry: Any = None,
    stale_after: float | None = None,
    stall_timeout: float | None = None,
) -> Exporter:
    """Start exporting: one background nvidia-smi loop, and an HTTP(S) server for ``/metrics`` and ``/healthz``.

    Returns at once; the work happens in daemon threads. Listens on 127.0.0.1 unless ``bind`` says otherwise.

    Example::

        with smiquery.exporter.serve(port=9849, interval=5) as exp:
            exp.serve_forever()

    Args:
        port: TCP port (0: any free port; see :attr:`Exporter.port`).
        bind: address to listen on; ``0.0.0.0`` or ``::`` listen on all interfaces.
        interval: seconds between nvidia-smi samples.
        fields: a preset or field list; the identity fields (index, uuid, name, pci.bus_id) are always added.
            With DCGM naming the default ``health`` also gets memory.free, temperature.memory and
            clocks.current.memory (DCGM default counters).
        gpus: only these GPUs.
        labels: constant labels for every series (``["site=lab"]`` or a mapping).
        naming: ``smiquery`` (native, base units) or ``dcgm`` (the DCGM exporter's names, units and labels).
        processes: also export per-process GPU memory, polled every ``processes_interval`` seconds.
        processes_interval: seconds between process polls.
        tls_cert: PEM certificate: serve HTTPS.
        tls_key: PEM private key for ``tls_cert``.
        client_ca: PEM CA bundle: require client certificates signed by it.
        nvidia_smi: path of the binary.
        registry: a ``prometheus_client`` registry whose metrics are appended to ``/metrics`` (e.g. your own).
        stale_after: seconds after which data counts as stale (default ``max(3 * interval, 15)``).
        stall_timeout: seconds without output before nvidia-smi counts as hung (default ``max(3 * interval, 10)``).

    Returns:
        The running :class:`Exporter`.

    Raises:
        PortInUseError: the port is taken (nvidia-smi is not started).
        ListenError: the address cannot be listened on (not on this machine, unknown name, no permission).
        InvalidFieldError: an unknown field.
        InvalidGpuIdError: a malformed GPU id.
        NvidiaSmiNotFoundError: no usable nvidia-smi.
        ValueError: a bad label, naming, interval, or TLS option.
        OSError, ssl.SSLError: unreadable TLS files.
    """
    if naming not in ("smiquery", "dcgm"):
        raise ValueError(f"naming must be 'smiquery' or 'dcgm', not {naming!r}")
    if interval <= 0:
        raise ValueError("interval must be positive")
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range (0-65535)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and a key")
    if client_ca is not None and tls_cert is None:
        raise ValueError("client certificates (client_ca) need TLS (tls_cert and tls_key)")
    const = parse_labels(labels)
    wanted = list(resolve_fields(fields if fields is not None else "health"))
    extras: tuple[str, ...] = IDENTITY_FIELDS
    if naming == "dcgm":
        extras += _DCGM_EXTRA_IDENTITY
        if fields in (None, "health"):
            extras += _DCGM_DEFAULT_EXTRAS
    names = [*IDENTITY_FIELDS, *(f.name for f in wanted)]
    names += [n for n in extras if n not in names]
    flds = resolve_fields(names)
    normalize_gpus(gpus)
    ctx = _tls_context(tls_cert, tls_key, client_ca) if tls_cert is not None and tls_key is not None else None

    server = _make_server(bind, port)  # fail on a taken port before nvidia-smi starts
    s = None
    poller = None
    try:
        s = stream(
            [f.name for f in flds],
            interval=interval,
            gpus=gpus,
            nvidia_smi=nvidia_smi,
            stall_timeout=stall_timeout,
            max_attempts=1 << 62,  # an exporter never gives up on a retryable failure; backoff caps at 30 s
            backoff_max=30.0,
        )
        if processes:
            poller = ProcessPoller(processes_interval, gpus=gpus, nvidia_smi=nvidia_smi)
        collector = SmiCollector(
            s, fields=s.fields, naming=naming, labels=const, processes=poller, stale_after=stale_after
        )
        server.collector = collector
        server.ssl_context = ctx
        if registry is not None:
            from prometheus_client import generate_latest

            def extra() -> bytes:
                try:
                    return bytes(generate_latest(registry))
                except Exception:  # someone else's collector must not take /metrics down
                    log.exception("smiquery exporter: collecting the extra registry failed")
                    return b""

            server.extra = extra
        else:
            server.extra = bytes
        s.start()
        if poller is not None:
            poller.start()
        exp = Exporter(server, collector, poller, ctx is not None)
    except BaseException:
        server.server_close()
        if s is not None:
            s.close()
        if poller is not None:
            poller.close()
        raise
    log.info("smiquery exporter: serving %s/metrics (naming %s)", exp.url, naming)
    return exp
