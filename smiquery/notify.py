"""Where alert events go: a log, a function, a webhook; and :class:`Notifier`, which evaluates rules and dispatches.

Handlers never raise into the caller (a training loop, a stream consumer): failures are logged and counted.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from smiquery.alerts import AlertEvaluator, AlertEvent, Rule

__all__ = [
    "AlertHandler",
    "CallbackHandler",
    "LogHandler",
    "Notifier",
    "WebhookHandler",
    "event_payload",
]

log = logging.getLogger("smiquery.notify")

Context = Mapping[str, Any]


@runtime_checkable
class AlertHandler(Protocol):
    """Something that takes an alert event and the context it happened in (epoch, batch, ...).

    A handler must not block for long and must not raise; :class:`Notifier` guards it anyway.
    """

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Handle one event."""


def _context_text(context: Context) -> str:
    if not context:
        return ""
    return " [" + ", ".join(f"{k}={_short(v)}" for k, v in context.items()) + "]"


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _jsonable(value: object) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    isoformat = getattr(value, "isoformat", None)
    if callable(isoformat):
        return isoformat()
    try:
        return float(value)  # type: ignore[arg-type]  # numpy scalars and 0-d tensors
    except (TypeError, ValueError):
        return str(value)


def event_payload(event: AlertEvent, context: Context | None = None) -> dict[str, Any]:
    """The JSON body :class:`WebhookHandler` posts for an event.

    Args:
        event: the alert event.
        context: where it happened (for example ``{"epoch": 3, "batch": 120, "learning_rate": 0.001}``).

    Returns:
        ``{"source": "smiquery", "host": ..., "message": ..., "event": event.to_dict(), "context": {...}}``,
        with every value JSON-serialisable (NaN becomes null, datetimes ISO 8601).
    """
    return {
        "source": "smiquery",
        "host": socket.gethostname(),
        "message": event.message(),
        "event": _jsonable(event.to_dict()),
        "context": _jsonable(dict(context or {})),
    }


class LogHandler:
    """Logs each event as one line: firing at WARNING, cleared at INFO (by default).

    Args:
        logger: a logger or its name (default ``smiquery.alerts``).
        firing_level: level for a rule that starts firing.
        cleared_level: level for a rule that clears.
    """

    def __init__(
        self,
        logger: logging.Logger | str | None = None,
        *,
        firing_level: int = logging.WARNING,
        cleared_level: int = logging.INFO,
    ) -> None:
        self.logger = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger or "smiquery.alerts")
        self.firing_level = firing_level
        self.cleared_level = cleared_level

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Log the event with its context."""
        level = self.firing_level if event.state == "firing" else self.cleared_level
        self.logger.log(level, "%s%s", event.message(), _context_text(context))


class CallbackHandler:
    """Calls ``fn(event, context)`` for each event; an exception from ``fn`` is logged, never raised.

    Args:
        fn: the function; it runs in the thread that evaluated the sample, so it should return quickly.
    """

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


class WebhookHandler:
    """POSTs each event as JSON (see :func:`event_payload`) from a background thread.

    The caller only appends to a bounded queue, so a slow or dead endpoint never slows it down. There are no
    retries: a failed POST is counted and logged once per failure streak (the next success logs the recovery).
    At most one POST is made per ``min_interval`` seconds; events that arrive while ``queue_size`` are waiting are
    dropped and counted in :attr:`dropped`. The thread starts with the first event; :meth:`close` stops it.

    Args:
        url: the endpoint (``http://`` or ``https://``).
        timeout: seconds for one POST (connect and read).
        min_interval: least seconds between two POSTs.
        queue_size: most events waiting to be sent.
        headers: extra HTTP headers (for example an authorization token).

    Raises:
        ValueError: the URL is not http(s), or a number is out of range.
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
            raise ValueError(f"webhook URL must start with http:// or https://, not {url!r}")
        if timeout <= 0 or min_interval < 0 or queue_size < 1:
            raise ValueError("timeout must be > 0, min_interval >= 0 and queue_size >= 1")
        self.url = url
        self.timeout = float(timeout)
        self.min_interval = float(min_interval)
        self.queue_size = int(queue_size)
        self.headers = {"Content-Type": "application/json", "User-Agent": "smiquery-webhook", **(headers or {})}
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.last_error: str | None = None
        self._queue: collections.deque[bytes] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._failing = False
        self._dropping = False
        self._last_post = float("-inf")

    def __call__(self, event: AlertEvent, context: Context) -> None:
        """Queue the event for posting; never blocks on the network and never raises."""
        try:
            body = json.dumps(event_payload(event, context)).encode("utf-8")
        except Exception:
            log.exception("smiquery webhook: cannot serialise %s", event.message())
            return
        with self._cond:
            if self._closing:
                return
            if len(self._queue) >= self.queue_size:
                self.dropped += 1
                if not self._dropping:
                    self._dropping = True
                    log.warning(
                        "smiquery webhook %s: %d events already waiting; dropping new ones until it catches up",
                        self.url,
                        self.queue_size,
                    )
                return
            self._dropping = False
            self._queue.append(body)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="smiquery-webhook", daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def pending(self) -> int:
        """Events waiting to be sent."""
        with self._cond:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                # rate limit; closing cuts the wait short so close() is never held up by min_interval
                wait = self._last_post + self.min_interval - time.monotonic()
                if wait > 0 and not self._closing:
                    self._cond.wait(wait)
                    continue
                body = self._queue.popleft()
            self._last_post = time.monotonic()
            self._post(body)

    def _post(self, body: bytes) -> None:
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
                log.info("smiquery webhook %s works again (%d failed in all)", self.url, self.failed)

    def _failure(self, reason: str) -> None:
        self.failed += 1
        self.last_error = reason
        if not self._failing:
            self._failing = True
            log.warning(
                "smiquery webhook %s failed: %s (no retry; further failures are not logged until one succeeds)",
                self.url,
                reason,
            )

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued (each POST bounded by the handler's ``timeout``), then stop the thread.

        A later event starts a new thread, so a handler can serve one training run after another.

        Args:
            timeout: most seconds to wait for the thread; default enough for the queued POSTs, at most 30.
        """
        with self._cond:
            self._closing = True
            pending = len(self._queue)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout if timeout is not None else min(30.0, (pending + 1) * (self.timeout + 0.5)))
        with self._cond:
            if thread is None or not thread.is_alive():
                # closed for good only until the next event, which starts a new thread (a monitor used for
                # several fits keeps its handlers)
                self._thread = None
                self._closing = False

    def __enter__(self) -> WebhookHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Notifier:
    """Evaluates alert rules over samples and hands each event to handlers.

    A handler that raises is logged and skipped; nothing reaches the caller. Use :meth:`update` for one call
    that does both, or :meth:`evaluate` and :meth:`dispatch` when the context is only known later.

    Example::

        notifier = Notifier(["temperature.gpu > 85 for 3"], [LogHandler(), WebhookHandler(url)])
        for sample in smiquery.stream("health"):
            notifier.update(sample)

    Args:
        rules: rules or expressions in the CLI's ``--alert`` syntax.
        handlers: where events go (default: a :class:`LogHandler`).
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
        self.events: collections.deque[tuple[AlertEvent, dict[str, Any]]] = collections.deque(maxlen=1000)
        self.handler_failures = 0

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules evaluated."""
        return self.evaluator.rules

    def evaluate(self, sample: Any) -> list[AlertEvent]:
        """Feed one sample to the rules; returns the events it caused without dispatching them."""
        try:
            return self.evaluator.update(sample)
        except Exception:
            log.exception("smiquery: evaluating alert rules failed")
            return []

    def dispatch(self, event: AlertEvent, context: Context | None = None) -> None:
        """Hand one event to every handler, logging (not raising) what a handler raises."""
        ctx = dict(context or {})
        self.events.append((event, ctx))
        for handler in self.handlers:
            try:
                handler(event, ctx)
            except Exception:
                self.handler_failures += 1
                log.exception("smiquery alert handler %r failed", handler)

    def update(self, sample: Any, context: Context | Callable[[], Context] | None = None) -> list[AlertEvent]:
        """Evaluate one sample and dispatch what it causes.

        Args:
            sample: one :class:`~smiquery.GpuSample`.
            context: extra facts for the handlers, or a function computing them (called only when an event
                happens).

        Returns:
            The events dispatched.
        """
        events = self.evaluate(sample)
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

    def close(self) -> None:
        """Close the handlers that have a ``close()`` (webhook threads)."""
        for handler in self.handlers:
            close = getattr(handler, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.exception("smiquery: closing alert handler %r failed", handler)

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
