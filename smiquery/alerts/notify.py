"""Where alert events go (a log, a function, a webhook, a snapshot folder) and :class:`Notifier`, which dispatches them.

Handlers never raise into the caller (a training loop, a stream consumer): failures are logged and counted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from smiquery._log import get_logger
from smiquery.alerts.rules import AlertEvaluator, AlertEvent, Rule, event_payload

if TYPE_CHECKING:
    from smiquery.runner import Runner
    from smiquery.sample import GpuSample

__all__ = [
    "HANDLER_SPECS",
    "AlertHandler",
    "CallbackHandler",
    "LogHandler",
    "Notifier",
    "SnapshotHandler",
    "WebhookHandler",
    "handler_from_spec",
    "take_snapshot",
]

log = get_logger("smiquery.notify")

Context = Mapping[str, Any]


@runtime_checkable
class AlertHandler(Protocol):
    """Something that takes an alert event and its context (epoch, batch...); it should neither block nor raise."""

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Handle one event."""


class LogHandler:
    """Logs each event as one line to ``logger`` (default ``smiquery.alerts``): firing at WARNING, cleared at INFO."""

    def __init__(self, logger: logging.Logger | str | None = None) -> None:
        self.logger = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger or "smiquery.alerts")

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Log the event with its context."""
        shown = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in context.items())
        level = logging.WARNING if event.state == "firing" else logging.INFO
        self.logger.log(level, "%s%s", event.message(), f" [{shown}]" if shown else "")


class CallbackHandler:
    """Calls ``fn(event, context)`` for each event (on the caller's thread); what it raises is logged and counted."""

    def __init__(self, fn: Callable[[AlertEvent, Context], object]) -> None:
        self.fn = fn
        self.failures = 0

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Call the function, logging (not raising) what it raises."""
        try:
            self.fn(event, context)
        except Exception:
            self.failures += 1
            log.exception("smiquery alert callback %r failed on %s", self.fn, event.message())


def redact_url(url: str) -> str:
    """A URL safe to log: ``"https://hooks.slack.com/..."`` (a webhook's path is often its secret), or ``<webhook>``."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<webhook>"
    if not host:
        return "<webhook>"
    host = f"[{host}]" if ":" in host else host
    hidden = "/..." if (parts.path not in ("", "/") or parts.query or parts.fragment) else ""
    return f"{parts.scheme}://{host}{port}{hidden}"


class _Outbox:
    """One sending thread's queue; a handler replaces it when a close gives up on a dead endpoint."""

    def __init__(self) -> None:
        self.queue: collections.deque[bytes] = collections.deque()
        self.closing = False
        self.thread: threading.Thread | None = None


class WebhookHandler:
    """POSTs each event as JSON (:func:`~smiquery.alerts.rules.event_payload`) from a background thread.

    The caller only appends to a bounded queue (``queue_size``; more are dropped and counted in :attr:`dropped`). No
    retries: a failed POST is counted and logged once per failure streak. At most one POST per ``min_interval``
    seconds, each within ``timeout``; ``headers``: extra HTTP headers (a token). Logs and ``repr`` show the URL's
    scheme and host only (the URL is often the secret). Raises ValueError for a URL that is not http(s) or a number
    out of range.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 2.0,
        min_interval: float = 1.0,
        queue_size: int = 100,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not url.lower().startswith(("http://", "https://")):
            raise ValueError(f"webhook URL must start with http:// or https://, not {redact_url(url)!r}")
        if timeout <= 0 or min_interval < 0 or queue_size < 1:
            raise ValueError("timeout must be > 0, min_interval >= 0 and queue_size >= 1")
        self.url = url
        self.shown = redact_url(url)
        self.timeout = float(timeout)
        self.min_interval = float(min_interval)
        self.queue_size = int(queue_size)
        self.headers = {"Content-Type": "application/json", "User-Agent": "smiquery-webhook", **(headers or {})}
        self.sent = 0
        self.failed = 0
        #: events dropped: queue full, or still waiting when :meth:`close` gave up on the endpoint
        self.dropped = 0
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._box = _Outbox()
        self._failing = False
        self._dropping = False
        self._last_post = float("-inf")

    def __repr__(self) -> str:
        return f"WebhookHandler({self.shown!r})"

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Queue the event for posting; never blocks on the network and never raises."""
        try:
            body = json.dumps(event_payload(event, context)).encode("utf-8")
        except Exception:
            log.exception("smiquery webhook: cannot serialise %s", event.message())
            return
        with self._cond:
            box = self._box
            if box.closing:
                return
            if len(box.queue) >= self.queue_size:
                self.dropped += 1
                if not self._dropping:
                    self._dropping = True
                    msg = "smiquery webhook %s: %d events already waiting; dropping new ones until it catches up"
                    log.warning(msg, self.shown, self.queue_size)
                return
            self._dropping = False
            box.queue.append(body)
            if box.thread is None:
                box.thread = threading.Thread(target=self._run, args=(box,), name="smiquery-webhook", daemon=True)
                box.thread.start()
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Events waiting to be sent."""
        with self._cond:
            return len(self._box.queue)

    def _run(self, box: _Outbox) -> None:
        while True:
            with self._cond:
                while not box.queue and not box.closing:
                    self._cond.wait()
                if not box.queue:
                    return
                # rate limit; closing cuts the wait short so close() is never held up by min_interval
                wait = self._last_post + self.min_interval - time.monotonic()
                if wait > 0 and not box.closing:
                    self._cond.wait(wait)
                    continue
                body = box.queue.popleft()
            self._last_post = time.monotonic()
            self._post(body)

    def _post(self, body: bytes) -> None:
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read(65536)
        except urllib.error.HTTPError as exc:
            self._failure(f"HTTP {exc.code} {exc.reason}")
        except Exception as exc:  # URLError, timeouts, resets: a webhook must never take the caller down
            reason = getattr(exc, "reason", None) or exc
            self._failure(f"{type(exc).__name__}: {reason}")
        else:
            self.sent += 1
            if self._failing:
                self._failing = False
                log.info("smiquery webhook %s works again (%d failed in all)", self.shown, self.failed)

    def _failure(self, reason: str) -> None:
        self.failed += 1
        parts = urllib.parse.urlsplit(self.url)
        for secret in (self.url, parts.path, parts.query, *self.headers.values()):  # never logged, never kept
            if secret and len(secret) > 1 and secret != "/":
                reason = reason.replace(secret, "...")
        self.last_error = reason
        if not self._failing:
            self._failing = True
            msg = "smiquery webhook %s failed: %s (no retry; further failures are not logged until one succeeds)"
            log.warning(msg, self.shown, reason)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued within ``timeout`` (default 2 s), then stop; what still waits is dropped and counted.

        A later event starts a new thread, so a handler can serve one training run after another.
        """
        limit = 2.0 if timeout is None else max(0.0, timeout)
        with self._cond:
            box = self._box
            box.closing = True
            self._cond.notify_all()
            thread = box.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(limit)
        with self._cond:
            left = len(box.queue)
            box.queue.clear()
            self.dropped += left
            if thread is not None and thread.is_alive():
                msg = "smiquery webhook %s did not answer within %.1f s at close: %d event(s) dropped"
                log.warning(msg, self.shown, limit, left)
            # a fresh outbox for the next run; the old thread ends after its POST times out
            self._box = _Outbox()

    def __enter__(self) -> WebhookHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Notifier:
    """Evaluates alert rules (or ``--alert`` expressions) over samples and hands each event to ``handlers``.

    ``handlers`` default to a :class:`LogHandler`; one that raises is logged and skipped. :meth:`update` does both
    steps; :meth:`evaluate` and :meth:`dispatch` split them when the context is only known later.
    """

    def __init__(
        self,
        rules: Iterable[Rule | str] | AlertEvaluator,
        handlers: Sequence[AlertHandler | Callable[[AlertEvent, Context], object]] | None = None,
    ) -> None:
        self.evaluator = rules if isinstance(rules, AlertEvaluator) else AlertEvaluator(rules)
        self.handlers: tuple[Callable[[AlertEvent, Context], object], ...] = (
            tuple(handlers) if handlers is not None else (LogHandler(),)
        )
        self.handler_failures = 0
        observers = (getattr(h, "observe", None) for h in self.handlers)
        self._observers: tuple[Callable[[Any], object], ...] = tuple(o for o in observers if callable(o))

    def evaluate(self, sample: Any, now: float | None = None) -> list[AlertEvent]:
        """Feed one sample (arrived at monotonic ``now``, see :meth:`update`); the events it caused, not dispatched."""
        try:
            return self.evaluator.update(sample, now)
        except Exception:
            log.exception("smiquery: evaluating alert rules failed")
            return []

    def dispatch(self, event: AlertEvent, context: Context | None = None) -> None:
        """Hand one event to every handler, logging (not raising) what a handler raises."""
        ctx = dict(context or {})
        for handler in self.handlers:
            try:
                handler(event, ctx)
            except Exception:
                self.handler_failures += 1
                log.exception("smiquery alert handler %r failed", handler)

    def update(
        self, sample: Any, context: Context | Callable[[], Context] | None = None, *, now: float | None = None
    ) -> list[AlertEvent]:
        """Evaluate one sample and dispatch (and return) the events it causes.

        ``context``: facts for the handlers, or a function computing them (called only when an event happens);
        ``now``: a live sample's arrival, ``time.monotonic()``, None for a recording.
        """
        self.observe(sample)
        events = self.evaluate(sample, now)
        if events:
            ctx: Context | None
            try:
                ctx = context() if callable(context) else context
            except Exception:
                log.exception("smiquery: computing the alert context failed")
                ctx = None
            for event in events:
                self.dispatch(event, ctx)
        return events

    def observe(self, sample: Any) -> None:
        """Show one sample to the handlers that keep recent history (a :class:`SnapshotHandler`)."""
        for handler in self._observers:
            try:
                handler(sample)
            except Exception:
                self.handler_failures += 1
                log.exception("smiquery: alert handler failed to take a sample")

    def close(self, timeout: float = 2.0) -> None:
        """Close the handlers that have a ``close()`` within about ``timeout`` seconds in all (what is unsent drops)."""
        deadline = time.monotonic() + timeout
        for handler in self.handlers:
            close = getattr(handler, "close", None)
            if callable(close):
                left = max(0.0, deadline - time.monotonic())
                try:
                    try:
                        close(timeout=left)
                    except TypeError:
                        close()
                except Exception:
                    log.exception("smiquery: closing alert handler %r failed", handler)

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SnapshotHandler:
    """Saves the evidence when an alert fires: one folder per firing (:func:`take_snapshot`), on a background thread.

    One asked for while another is being written is skipped (:attr:`skipped`). ``minutes`` of sample history are
    kept (at most ``max_rows``) and saved; ``timeout`` bounds each nvidia-smi call, ``max_bytes`` each file,
    ``max_snapshots`` the folders this handler writes in all.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        minutes: float = 5.0,
        nvidia_smi: str | os.PathLike[str] | None = None,
        timeout: float = 10.0,
        max_bytes: int = 8 * 2**20,
        max_snapshots: int = 50,
        max_rows: int = 100_000,
    ) -> None:
        if minutes <= 0 or timeout <= 0 or max_bytes < 1024 or max_snapshots < 1 or max_rows < 1:
            raise ValueError("minutes and timeout must be > 0, max_bytes >= 1024, max_snapshots and max_rows >= 1")
        self.directory = os.fspath(directory)
        self.minutes = float(minutes)
        self.nvidia_smi = nvidia_smi
        self.timeout = float(timeout)
        self.max_bytes = int(max_bytes)
        self.max_snapshots = int(max_snapshots)
        #: folders written
        self.taken: list[str] = []
        #: snapshots not taken (one already in progress, or the limit reached)
        self.skipped = 0
        #: snapshots that failed (a full disk...): they count toward ``max_snapshots``
        self.failed = 0
        self._history: collections.deque[tuple[float, Any]] = collections.deque(maxlen=max_rows)
        self._lock = threading.Lock()
        self._firing: set[tuple[str, object]] = set()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"SnapshotHandler({self.directory!r})"

    def observe(self, sample: Any) -> None:
        """Keep one sample in the recent history (cheap; called for every sample)."""
        now = time.monotonic()
        history = self._history
        history.append((now, sample))
        horizon = now - self.minutes * 60.0
        while history and history[0][0] < horizon:
            history.popleft()

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Start a snapshot for a firing event (once per firing); never blocks and never raises."""
        key = (str(event.rule), event.gpu if event.gpu is not None else event.uuid)
        with self._lock:
            if event.state != "firing":
                self._firing.discard(key)
                return
            if key in self._firing:
                return
            self._firing.add(key)
            busy = self._thread is not None and self._thread.is_alive()
            if busy or len(self.taken) + self.failed >= self.max_snapshots:
                self.skipped += 1
                why = "another snapshot is being written" if busy else f"the limit of {self.max_snapshots} is reached"
                log.warning("smiquery: no snapshot for %s: %s", event.message(), why)
                return
            samples = [s for _, s in self._history]
            self._thread = threading.Thread(
                target=self._take, args=(event, dict(context), samples), name="smiquery-snapshot", daemon=True
            )
            self._thread.start()

    def _take(self, event: AlertEvent, context: dict[str, Any], samples: list[Any]) -> None:
        try:
            folder = take_snapshot(
                self.directory,
                event,
                context,
                samples,
                nvidia_smi=self.nvidia_smi,
                timeout=self.timeout,
                max_bytes=self.max_bytes,
            )
        except Exception as exc:
            with self._lock:
                self.failed += 1
            # one line per firing, no traceback: a full disk is an operator's matter, not a bug
            log.warning("smiquery: no snapshot for %s: %s", event.message(), exc)
            return
        with self._lock:
            self.taken.append(folder)
        log.warning("smiquery: snapshot for %s saved in %s", event.message(), folder)

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait at most ``timeout`` seconds for the snapshot in progress, if any; True when none is left running."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Give a snapshot in progress up to ``timeout`` seconds (default 2); it finishes on its own thread after."""
        self.wait(2.0 if timeout is None else timeout)


_APPS_FIELDS = "gpu_uuid,pid,process_name,used_gpu_memory"
_SLUG_RE = re.compile(r"[^A-Za-z0-9]+")


def _write_capped(path: Path, text: str, max_bytes: int) -> None:
    data = text.encode("utf-8", "replace")
    if len(data) > max_bytes:
        note = f"\n[smiquery: cut at {max_bytes} bytes of {len(data)}]\n".encode()
        data = data[: max_bytes - len(note)] + note
    path.write_bytes(data)


def _folder(directory: str | os.PathLike[str], event: AlertEvent) -> Path:
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    slug = _SLUG_RE.sub("-", f"{event.rule.field.attr}-gpu{event.gpu if event.gpu is not None else 'x'}").strip("-")
    for n in range(1000):
        folder = root / f"{stamp}-{slug}" if n == 0 else root / f"{stamp}-{slug}-{n}"
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            return folder
    raise FileExistsError(f"cannot create a new snapshot folder under {root}")


def _run(runner: Runner, argv: Sequence[str], timeout: float, out: Path, max_bytes: int) -> None:
    error = out.with_name(out.name + ".error.txt")
    try:
        done = runner.run(argv, timeout)
    except Exception as exc:
        _write_capped(error, f"{' '.join(argv)}\n{exc}\n", max_bytes)
        return
    if done.returncode != 0:
        _write_capped(error, f"{' '.join(argv)}\nexit {done.returncode}\n{done.stderr}\n{done.stdout}", max_bytes)
        return
    _write_capped(out, done.stdout, max_bytes)


def _samples_csv(samples: Sequence[GpuSample], max_bytes: int) -> str:
    """The samples as a CSV recording, newest rows kept within ``max_bytes``."""
    from smiquery.fields import resolve_fields
    from smiquery.sources.query_gpu import format_row, header_line

    if not samples:
        return ""
    names = samples[-1].fields
    same = [s for s in samples if s.fields == names]  # one schema per file: the newest
    fields = resolve_fields(list(names))
    head = header_line(fields)
    rows: list[str] = []
    size = len(head) + 1
    for s in reversed(same):
        line = format_row(s, fields, units=True)
        size += len(line) + 1
        if size > max_bytes:
            break
        rows.append(line)
    rows.reverse()
    return "\n".join([head, *rows]) + "\n"


def _details_json(folder: Path, max_bytes: int) -> None:
    import warnings

    from smiquery.errors import SmiqueryError
    from smiquery.sources.details import parse_xml

    xml = folder / "nvidia-smi-q.xml"
    if not xml.is_file():
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # an unknown DTD: still read by name
            gpus = parse_xml(xml.read_bytes())
    except SmiqueryError as exc:  # e.g. the XML was cut at max_bytes
        _write_capped(folder / "details.json.error.txt", f"parsing nvidia-smi-q.xml failed: {exc}\n", max_bytes)
        return
    doc = {"gpus": [g.to_dict() for g in gpus]}
    _write_capped(folder / "details.json", json.dumps(doc, indent=2, default=str) + "\n", max_bytes)


def take_snapshot(
    directory: str | os.PathLike[str],
    event: AlertEvent,
    context: Mapping[str, Any] | None = None,
    samples: Sequence[GpuSample] = (),
    *,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    max_bytes: int = 8 * 2**20,
    runner: Runner | None = None,
) -> str:
    """Write one snapshot folder (``DIR/<time>-<field>-gpu<N>``) and return its path.

    It holds ``alert.json`` (the event and its ``context``), ``nvidia-smi-q.xml``, ``details.json`` (that XML
    parsed), ``processes.csv`` (the compute processes) and ``samples.csv`` (the recent ``samples`` as a recording).
    Each nvidia-smi call is bounded by ``timeout`` and each file by ``max_bytes``; a call that fails leaves
    ``<file>.error.txt`` saying why. Raises OSError when the folder cannot be written (a full disk), leaving nothing
    behind.
    """
    import shutil

    from smiquery.runner import default_runner, find_nvidia_smi  # subprocess, only once a snapshot is taken

    folder = _folder(directory, event)
    try:
        payload = event_payload(event, context)
        payload["samples"] = len(samples)
        _write_capped(folder / "alert.json", json.dumps(payload, indent=2) + "\n", max_bytes)
        csv = _samples_csv(samples, max_bytes)
        if csv:
            _write_capped(folder / "samples.csv", csv, max_bytes)
        try:
            binary = find_nvidia_smi(nvidia_smi, runner=runner)
        except Exception as exc:
            for name in ("nvidia-smi-q.xml", "processes.csv"):
                _write_capped(folder / f"{name}.error.txt", f"{exc}\n", max_bytes)
            return str(folder)
        run = runner or default_runner()
        _run(run, [binary, "-q", "-x"], timeout, folder / "nvidia-smi-q.xml", max_bytes)
        _details_json(folder, max_bytes)
        argv = [binary, f"--query-compute-apps={_APPS_FIELDS}", "--format=csv"]
        _run(run, argv, timeout, folder / "processes.csv", max_bytes)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return str(folder)


#: The handler kinds :func:`handler_from_spec` knows (its error message lists them).
HANDLER_SPECS: tuple[str, ...] = ("log", "webhook:URL", "snapshot:DIR")


def handler_from_spec(spec: str, *, nvidia_smi: str | os.PathLike[str] | None = None) -> AlertHandler:
    """An alert handler from an ``--on-alert`` spec: ``log``, ``webhook:URL`` or ``snapshot:DIR``.

    Raises ValueError (listing the kinds) for an unknown kind or a missing argument.
    """
    kind, _, arg = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "log" and not arg:
        return LogHandler()
    if kind == "webhook" and arg:
        return WebhookHandler(arg)
    if kind == "snapshot" and arg:
        return SnapshotHandler(arg, nvidia_smi=nvidia_smi)
    shown = redact_url(spec) if kind == "webhook" else spec
    raise ValueError(f"invalid alert handler {shown!r}: use one of {', '.join(HANDLER_SPECS)}")
