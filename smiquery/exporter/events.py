"""What the exporter logs: restarts, errors, recoveries, lost GPUs and Xids, one rate-limited line each."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from smiquery._log import RateLimiter, get_logger
from smiquery.printable import printable

if TYPE_CHECKING:
    from smiquery.source import StreamEvent
    from smiquery.sources.xid import XidEvent

__all__ = ["EventLog", "JsonFormatter", "RateLimitFilter", "configure_logging", "json_line"]

log = get_logger("smiquery.exporter")

LogFormat = Literal["text", "json"]


def _held_note(held: int) -> str:
    return f" ({held} similar message{'s' if held != 1 else ''} suppressed)"


class EventLog:
    """Logs source events and GPU changes to ``logger``: ``burst`` lines per kind, then one per ``period`` s."""

    def __init__(
        self,
        logger: logging.Logger = log,
        *,
        burst: int = 5,
        period: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._limit = RateLimiter(burst, period, clock)
        self._lock = threading.Lock()
        self._fault: tuple[str | None, str] | None = None  # the failure last announced, until data flows again

    def emit(self, kind: str, level: int, message: str, **fields: Any) -> bool:
        """Log one line (``fields``: extras for JSON logs) unless ``kind`` is over its rate; whether it was logged."""
        held = self._limit.take(kind)
        if held is None:
            return False
        if held:
            message += _held_note(held)
        self.logger.log(level, message, extra={"event": kind, "fields": {**fields, "suppressed": held}})
        return True

    def on_stream_event(self, event: StreamEvent) -> None:
        """Log a :class:`~smiquery.source.StreamEvent` (restart, error, recovered, gpu_lost, gpu_back)."""
        kind, detail, err = event.kind, event.detail or "", event.error
        etype = type(err).__name__ if err is not None else None
        if kind == "error":
            # the restart line that follows names the error and when the next attempt is: one line, not two
            self.logger.debug("nvidia-smi error (%s): %s", etype, detail)
        elif kind == "restart":
            # A fault that does not change (a driver mismatch retried every 30 s) is one state: its first restart
            # is a WARNING; every retry of the same fault goes to DEBUG until data flows again or the fault changes.
            fault = (etype, str(err).splitlines()[0] if err is not None and str(err) else detail)
            with self._lock:
                same, self._fault = fault == self._fault, fault
            if same:
                self.logger.debug("nvidia-smi restart (unchanged fault): %s", detail)
            else:
                self.emit(kind, logging.WARNING, f"nvidia-smi restart: {detail}", error_type=etype)
        elif kind == "recovered":
            with self._lock:
                self._fault = None
            self.emit(kind, logging.INFO, f"nvidia-smi recovered: {detail or 'data flows again'}")
        elif kind == "short_sweep":
            self.emit(kind, logging.WARNING, f"short sweep: {detail}")
        # gpu_lost/gpu_back are logged by the collector, by UUID, once per change (on_gpu_change)

    def on_gpu_change(self, lost: bool, index: int, uuid: str | None) -> None:
        """Log a GPU that dropped out (``lost``: WARNING) or came back (INFO)."""
        who = f"GPU {index} ({uuid or 'uuid unknown'})"
        if lost:
            self.emit("gpu_lost", logging.WARNING, f"{who} is lost: no data from it", gpu=index, uuid=uuid)
        else:
            self.emit("gpu_back", logging.INFO, f"{who} is back", gpu=index, uuid=uuid)

    def on_xid(self, event: XidEvent) -> None:
        """Log a :class:`~smiquery.sources.xid.XidEvent` (WARNING), with what to do about it; all codes share a rate."""
        info = event.info
        what = f"{info.meaning}; {info.advice}" if info is not None else "see NVIDIA's Xid catalogue"
        text = f"Xid {event.xid} on the GPU at PCI {event.pci_bus_id}: {what}"
        action = info.action if info is not None else None
        self.emit("xid", logging.WARNING, text, xid=event.xid, pci_bus_id=event.pci_bus_id, action=action)

    def on_state(self, up: bool, why: str) -> None:
        """Log a change of ``smiquery_up`` (WARNING when data stops, INFO when it comes back), with one line why."""
        if up:
            with self._lock:
                self._fault = None
            self.emit("up", logging.INFO, f"collecting again: {why}")
        else:
            self.emit("down", logging.WARNING, f"not collecting: {why}")


class RateLimitFilter(logging.Filter):
    """Lets each message template through in a burst, then once per ``period`` seconds; counts what it drops.

    :func:`configure_logging` installs it, so that every smiquery log line is rate-limited, not only the events.
    """

    def __init__(self, burst: int = 5, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._limit = RateLimiter(burst, period, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` goes out (errors and worse always do)."""
        if record.levelno >= logging.ERROR:
            return True
        held = self._limit.take((record.name, str(record.msg)))
        if held is None:
            return False
        if held and getattr(record, "event", None) is None:  # EventLog lines count their own
            # format now, so the note cannot clash with the record's own %-arguments
            record.msg = record.getMessage() + _held_note(held)
            record.args = ()
        return True


class _TextFormatter(logging.Formatter):
    """Log lines as text, with control characters in any part (a process name, a label) shown escaped."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(printable(line) for line in super().format(record).split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Format one record as a JSON line."""
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if event:
            out["event"] = event
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if v is not None and k not in out})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def json_line(message: str, *, level: int = logging.INFO, event: str | None = None, **fields: Any) -> str:
    """One line as :class:`JsonFormatter` writes it, for what the CLI prints itself under ``--log-format json``."""
    record = logging.LogRecord("smiquery.exporter", level, __file__, 0, message, None, None)
    record.event = event
    record.fields = fields
    return JsonFormatter().format(record)


def configure_logging(fmt: LogFormat = "text", level: int = logging.INFO) -> logging.Handler:
    """Send smiquery's log lines (``level`` and up) to stderr as ``text`` or ``json`` lines, rate-limited.

    The stream supervisor's own warnings are left out (the events say the same). Returns the handler installed.
    """
    handler = logging.StreamHandler(sys.stderr)
    # The stream supervisor (logger "smiquery") logs its restarts and failures itself; the exporter logs the same
    # from the stream's events, once each, with the GPU and error type as fields. Its errors still go out.
    handler.addFilter(lambda record: record.name != "smiquery" or record.levelno >= logging.ERROR)
    handler.addFilter(RateLimitFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s smiquery export: %(levelname)s: %(message)s"))
    root = logging.getLogger("smiquery")
    root.addHandler(handler)
    root.setLevel(level)
    return handler
