"""The HTTP(S) server: /metrics, /healthz and friends, and :func:`serve`, which wires a stream to it."""

from __future__ import annotations

import contextlib
import functools
import gzip
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from smiquery import __version__
from smiquery._log import get_logger
from smiquery.alerts import AlertEvaluator
from smiquery.errors import SmiqueryError
from smiquery.exporter.collector import DEFAULT_EXPORTER_ALERTS, SmiCollector, parse_labels
from smiquery.exporter.events import EventLog
from smiquery.exporter.families import DETAILS_TIMEOUT
from smiquery.exporter.naming import NAMINGS, Naming, exporter_fields
from smiquery.exporter.pmonwatch import TOP_PROCESSES_BY, PmonWatcher
from smiquery.fields import resolve_fields
from smiquery.httpd.server import HttpServer, Request, Response, listen, route
from smiquery.httpd.webconfig import WebConfig, load_web_config
from smiquery.retry import RetryPolicy, one_line
from smiquery.sources.apps import GpuProcess, processes
from smiquery.sources.details import GpuDetails, details
from smiquery.sources.latest import Latest
from smiquery.sources.xid import XidWatcher
from smiquery.streams.argv import normalize_gpus
from smiquery.streams.sync import stream

if TYPE_CHECKING:
    from smiquery.attribution import Attribution
    from smiquery.runner import Runner
    from smiquery.streams.argv import GpusArg

__all__ = ["CONTENT_TYPE", "Exporter", "details_poller", "process_poller", "serve"]

log = get_logger("smiquery.exporter")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


_INDEX = (
    "<!doctype html><html><head><title>smiquery exporter</title></head><body>"
    "<h1>smiquery exporter</h1><p>version {version}, naming {naming}</p>"
    '<ul><li><a href="metrics">/metrics</a></li><li><a href="livez">/livez</a> (the server runs)</li>'
    '<li><a href="readyz">/readyz</a> and <a href="healthz">/healthz</a> (fresh GPU data)</li></ul></body></html>\n'
)


@functools.lru_cache(maxsize=64)  # scrapers send the same few Accept headers; negotiation is per scrape
def _negotiate(accept: str) -> tuple[Callable[[Any], bytes], str]:
    from prometheus_client.exposition import choose_encoder

    encoder, content_type = choose_encoder(accept)
    return encoder, str(content_type)


class _Router:
    """The exporter's pages, and the ``collect()`` source (collector, then registry) of prometheus_client's encoders."""

    def __init__(self, collector: SmiCollector, registry: Any) -> None:
        self.collector = collector
        self.registry = registry
        page = _INDEX.format(version=__version__, naming=collector.naming).encode()
        index = Response(200, page, "text/html; charset=utf-8")
        self.pages = {"/metrics": self._metrics, "/livez": lambda _: Response(200, b"ok\n"), "/": lambda _: index}
        self.pages |= {"/readyz": self._health, "/healthz": self._health, "/index.html": lambda _: index}

    def collect(self) -> Iterator[Any]:
        yield from self.collector.collect()
        if self.registry is not None:
            try:
                yield from self.registry.collect()
            except Exception:  # someone else's collector must not take /metrics down
                log.exception("smiquery exporter: collecting the extra registry failed")

    def _extra(self) -> bytes:
        from prometheus_client import generate_latest

        try:
            return bytes(generate_latest(self.registry)) if self.registry is not None else b""
        except Exception:  # someone else's collector must not take /metrics down
            log.exception("smiquery exporter: collecting the extra registry failed")
            return b""

    def fast(self, req: Request) -> bool:
        """Whether answering ``req`` is cheap (the classic format, no extra registry): the selector answers it."""
        return self.registry is None and _negotiate(req.headers.get("accept", ""))[1] == CONTENT_TYPE

    def __call__(self, req: Request) -> Response:
        return route(req, self.pages, b"not found: try /metrics, /livez, /readyz or /healthz\n")

    def _metrics(self, req: Request) -> Response:
        from prometheus_client.exposition import gzip_accepted

        # Negotiated as prometheus_client does (OpenMetrics when Accept asks for it); the classic text format
        # comes from the collector's own fast renderer, which gives the same text.
        encoder, content_type = _negotiate(req.headers.get("accept", ""))
        body = self.collector.exposition() + self._extra() if content_type == CONTENT_TYPE else encoder(self)
        headers = {"Vary": "Accept, Accept-Encoding"}
        if gzip_accepted(req.headers.get("accept-encoding", "")):
            body = gzip.compress(body, compresslevel=6, mtime=0)
            headers["Content-Encoding"] = "gzip"
        return Response(200, bytes(body), content_type, headers)

    def _health(self, req: Request) -> Response:
        ok, why = self.collector.health()
        return Response(200 if ok else 503, (why + "\n").encode())


class Exporter:
    """A running exporter, made by :func:`serve`: use it as a context manager or call :meth:`stop`.

    ``collector`` serves ``/metrics`` (``pmon`` is its pmon watcher) from ``stream`` (replaced after it stopped for
    good); ``http`` is the server, listening on ``bind`` and ``port`` (useful with ``port=0``); ``url`` its base URL.
    """

    def __init__(
        self,
        server: HttpServer,
        collector: SmiCollector,
        parts: Sequence[Any],
        make_stream: Callable[[], Any],
        revive_after: float,
    ) -> None:
        self.http = server
        self.collector = collector
        self.stream = collector.stream
        self.pmon = collector.pmon
        self.revive_after = revive_after
        host, port = server.sock.getsockname()[:2]
        self.bind, self.port = str(host), int(port)
        self.url = f"{'https' if server.ssl_context else 'http'}://{f'[{host}]' if ':' in self.bind else host}:{port}"
        self._make_stream = make_stream
        self._parts = parts
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._revive_loop, name="smiquery-revive", daemon=True).start()

    def _revive_loop(self) -> None:
        # Belt and braces: a stream whose thread ended (a core that stops on permanent errors, or a bug) is
        # replaced by a new one after revive_after seconds, so the exporter is never silently dead.
        period = min(1.0, max(0.05, self.revive_after / 4))
        while not self._stopped.wait(period):
            err = self.stream.error
            if self.stream.running or err is None:
                continue
            self.collector.revive_at = time.time() + self.revive_after
            msg = "smiquery exporter: the nvidia-smi stream stopped (%s: %s); starting a new one in %g s"
            log.warning(msg, type(err).__name__, (str(err).splitlines() or [""])[0], self.revive_after)
            if self._stopped.wait(self.revive_after):
                return
            with self._lock:
                if self._stopped.is_set():
                    return
                try:
                    new = self._make_stream()
                    new.start()
                except Exception as exc:  # e.g. nvidia-smi gone: try again after the next period
                    log.warning("smiquery exporter: starting a new nvidia-smi stream failed: %s", exc)
                    continue
                old, self.stream = self.stream, new
                self.collector.stream = new
                self.collector.revive_at = None
            old.close()

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` has run."""
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop serving, close the stream (nvidia-smi is reaped) and the other parts. Idempotent; any thread."""
        with self._lock, contextlib.ExitStack() as after:  # each step even when one before it failed
            if not self._stopped.is_set():
                after.callback(self._stopped.set)
                after.callback(_close, [self.stream, *self._parts])  # the pmon child is reaped here too
                self.http.shutdown()

    def serve_forever(self, poll: float = 0.5) -> None:
        """Block until :meth:`stop` is called, checking every ``poll`` seconds (so signal handlers run promptly)."""
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
    top_processes: int = 0,
    top_processes_by: str = "name",
    tls_cert: str | os.PathLike[str] | None = None,
    tls_key: str | os.PathLike[str] | None = None,
    client_ca: str | os.PathLike[str] | None = None,
    web_config: str | os.PathLike[str] | WebConfig | None = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    registry: Any = None,
    stale_after: float | None = None,
    stall_timeout: float | None = None,
    alerts: Sequence[str] | None = DEFAULT_EXPORTER_ALERTS,
    workers: int = 8,
    max_connections: int = 2048,
    request_timeout: float = 10.0,
    revive_after: float = 30.0,
    attribution: Attribution | None = None,
    details_interval: float | None = None,
    kernel_log: str | os.PathLike[str] | None = None,
    process_metrics: bool = True,
) -> Exporter:
    """Start exporting: one background nvidia-smi loop, and an HTTP(S) server for ``/metrics`` and the probes.

    Returns at once (the work happens in daemon threads)::

        with smiquery.exporter.serve(port=9849, interval=5) as exp:
            exp.serve_forever()

    The keywords are ``smiquery export``'s options of the same name (docs/exporter.md, Options). Besides them:
    ``port=0`` takes any free port (:attr:`Exporter.port` says which); ``web_config`` may be a loaded
    :class:`WebConfig`; ``registry``'s metrics are appended to ``/metrics``; ``workers``, ``max_connections`` and
    ``request_timeout`` are :class:`~smiquery.httpd.server.HttpServer`'s; a stream that stopped for good is replaced
    after ``revive_after`` seconds; ``attribution`` is started and closed with the exporter; ``details_interval``
    and ``kernel_log`` are off (None) by default here; ``process_metrics`` serves prometheus_client's ``process_*``
    metrics unless ``registry`` has them already.

    Raises PortInUseError or ListenError (the port is taken or the address unusable: nvidia-smi is not started),
    ValueError (a bad label, naming, interval, top_processes, details_interval or TLS option), OSError (unreadable
    TLS files), WebConfigError, InvalidFieldError, InvalidRuleError, InvalidGpuIdError, NvidiaSmiNotFoundError.
    """
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {', '.join(NAMINGS)}, not {naming!r}")
    if interval <= 0:
        raise ValueError("interval must be positive")
    if isinstance(top_processes, bool) or not isinstance(top_processes, int) or top_processes < 0:
        raise ValueError("top_processes must be a whole number >= 0 (0: off)")
    if details_interval is not None and not details_interval > 0:
        raise ValueError("details_interval must be a positive number of seconds (None: off)")
    if top_processes_by not in TOP_PROCESSES_BY:
        raise ValueError(f"top_processes_by must be one of {', '.join(TOP_PROCESSES_BY)}, not {top_processes_by!r}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range (0-65535)")
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and a key")
    if client_ca is not None and tls_cert is None:
        raise ValueError("client certificates (client_ca) need TLS (tls_cert and tls_key)")
    if web_config is not None and tls_cert is not None:
        raise ValueError("give TLS either in the web config file or as tls_cert/tls_key, not both")
    const = parse_labels(labels)
    flds = resolve_fields(exporter_fields(fields, naming, nvidia_smi=nvidia_smi))
    normalize_gpus(gpus)
    web = load_web_config(web_config) if isinstance(web_config, (str, os.PathLike)) else web_config or WebConfig()
    if tls_cert is not None and tls_key is not None:
        web.ssl_context = ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(tls_cert), str(tls_key))
        if client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=str(client_ca))
    evaluator = AlertEvaluator(list(alerts)) if alerts else None
    # the stream also queries what the alert rules read, and the driver version (for smiquery_build_info)
    wanted = [*flds, *(evaluator.fields if evaluator is not None else ()), *resolve_fields(["driver_version"])]
    stream_fields = list(dict.fromkeys(f.name for f in wanted))

    events = EventLog()
    make_stream = functools.partial(
        stream,
        stream_fields,
        interval=interval,
        gpus=gpus,
        nvidia_smi=nvidia_smi,
        stall_timeout=stall_timeout,
        # an exporter never gives up; faults that need a person are retried every 30 s
        retry=RetryPolicy(max_attempts=None, backoff_max=30.0),
        on_event=events.on_stream_event,
    )
    sock = listen(bind, port)  # fail on a taken port before nvidia-smi starts
    s = poller = watcher = details = xid = collector = None
    try:
        s = make_stream()
        poller = process_poller(processes_interval, gpus=gpus, nvidia_smi=nvidia_smi) if processes else None
        if top_processes:
            pmon_interval = min(10, max(1, round(interval)))  # pmon takes whole seconds, 1 to 10
            watcher = PmonWatcher(
                top_processes,
                by=top_processes_by,
                interval=pmon_interval,
                gpus=gpus,
                nvidia_smi=nvidia_smi,
                stall_timeout=stall_timeout,
                # the newest instant is one interval old when it is complete: never staler than two intervals
                stale_after=max(stale_after, 2.0 * pmon_interval + 1.0) if stale_after is not None else None,
            )
        details = details_poller(details_interval, gpus=gpus, nvidia_smi=nvidia_smi) if details_interval else None
        if kernel_log is not None:
            xid = XidWatcher(
                kernel_log,
                on_event=events.on_xid,
                on_error=_xid_failed,
                retry=_XID_RETRY,
                on_refused=lambda text: events.emit("xid_refused", logging.WARNING, f"smiquery exporter: {text}"),
            )
        collector = SmiCollector(
            s,
            fields=flds,
            naming=naming,
            labels=const,
            processes=poller,
            pmon=watcher,
            details=details,
            xid=xid,
            stale_after=stale_after,
            alerts=evaluator,
            on_gpu_change=events.on_gpu_change,
            on_state=events.on_state,
            nvidia_smi_path=str(s.argv[0]),
            attribution=attribution,
            process_metrics=process_metrics and not _has_process_metrics(registry),
        )
        router = _Router(collector, registry)
        http = HttpServer(
            sock,
            router,
            web=web,
            workers=workers,
            max_connections=max_connections,
            request_timeout=request_timeout,
            server_header="smiquery-exporter/" + __version__,
            inline=router.fast,
        )
        # started with the stream, closed after it (in this order)
        parts = [p for p in (poller, watcher, collector, attribution, xid, details) if p is not None]
        for part in (s, *parts):
            part.start()
        exp = Exporter(http, collector, parts, make_stream, revive_after)
    except BaseException:
        sock.close()
        _close([p for p in (s, poller, watcher, collector, attribution, xid, details) if p is not None])
        raise
    log.info("smiquery exporter: serving %s/metrics (naming %s)", exp.url, naming)
    return exp


def process_poller(
    interval: float, *, gpus: GpusArg = None, nvidia_smi: str | os.PathLike[str] | None = None
) -> Latest[tuple[GpuProcess, ...]]:
    """:func:`smiquery.processes` every ``interval`` seconds in a background :class:`Latest`; scrapes read the newest.

    A failed poll is counted and logged, never raised. Raises ValueError (``interval``) and InvalidGpuIdError.
    """
    ids = normalize_gpus(gpus) or None
    return Latest(
        lambda: tuple(processes(gpus=ids, nvidia_smi=nvidia_smi, timeout=10.0)),
        interval,
        name="listing processes",
        errors=(SmiqueryError,),
    )


def details_poller(
    interval: float,
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    runner: Runner | None = None,
) -> Latest[tuple[GpuDetails, ...]]:
    """:func:`smiquery.details` every ``interval`` seconds, in a background :class:`Latest` (scrapes read its newest).

    A poll may take :data:`~smiquery.exporter.families.DETAILS_TIMEOUT` seconds: a slow poll delays the next, it is
    not cut short. ``runner``: how to run nvidia-smi (tests inject one). Raises as :func:`process_poller`.
    """
    ids = normalize_gpus(gpus) or None
    return Latest(
        lambda: tuple(details(ids, nvidia_smi=nvidia_smi, timeout=DETAILS_TIMEOUT, runner=runner)),
        interval,
        name="nvidia-smi -q -x",
    )


def _has_process_metrics(registry: Any) -> bool:
    """Whether the user's registry serves ``process_*`` already (prometheus_client's default registry does)."""
    try:
        return registry is not None and registry.get_sample_value("process_start_time_seconds") is not None
    except Exception:  # a registry-like object without get_sample_value, or a failing collector
        return False


def _close(parts: Sequence[Any]) -> None:
    """Close each part, in order, each even when one before it failed."""
    with contextlib.ExitStack() as stack:
        for part in reversed(parts):
            stack.callback(part.close)


_XID_RETRY = 30.0  # seconds between attempts to open a kernel log that could not be opened


def _xid_failed(exc: BaseException, opened: bool) -> None:
    """The exporter's warning when reading the kernel log fails, or (once) when it cannot be opened."""
    if opened:
        log.warning("smiquery exporter: reading the kernel log failed: %s", one_line(exc))
        return
    log.warning(
        "smiquery exporter: cannot read the kernel log (%s); smiquery_xid_source_up is 0 and Xid errors are not "
        "counted until it can be read (tried again every %g s). Give the exporter CAP_SYSLOG (or run it as root), "
        "point --kernel-log at a readable file, or turn it off with --kernel-log ''",
        exc,
        _XID_RETRY,
    )
