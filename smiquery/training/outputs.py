"""What a run feeds besides its logs (a recording, the job's metrics, Xid alerts), and :func:`run_monitor`."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import uuid4

from smiquery._log import get_logger
from smiquery.alerts import AlertEvent, Rule
from smiquery.errors import KernelLogError
from smiquery.fields import get_field, resolve_fields
from smiquery.sources.xid import XidEvent, XidInfo, XidWatcher, describe, gpu_for
from smiquery.training.monitor import Output, RunMonitor

if TYPE_CHECKING:
    from smiquery.httpd.server import HttpServer, Request
    from smiquery.recordings import SampleWriter
    from smiquery.sample import GpuSample

__all__ = ["METRICS_KEYWORDS", "JobMetrics", "KernelLog", "Recording", "XidAlert", "run_monitor"]

log = get_logger("smiquery.training.outputs")


class Recording(Output):
    """Every sample of the watched GPUs written to ``path`` (``.csv``, ``.jsonl``, ``.parquet``) for each run.

    ``smiquery report`` and ``smiquery plot`` read it. A failure is said once and the run goes on unrecorded.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._writer: SampleWriter | None = None
        self._monitor: RunMonitor | None = None

    def open(self, monitor: RunMonitor) -> None:
        """Open the file with the fields the run streams."""
        self._monitor = monitor
        try:
            from smiquery.recordings import open_recorder

            self._writer = open_recorder(self.path, resolve_fields(monitor.stream_fields))
        except Exception as exc:
            monitor.say(f"cannot record to {os.fspath(self.path)!r} ({exc}): the run is not recorded")

    def take(self, samples: Sequence[GpuSample]) -> None:
        """Append one sweep's samples."""
        writer = self._writer
        if writer is None:
            return
        try:
            for s in samples:
                writer.write(s)
        except Exception as exc:
            self._writer = None
            if self._monitor is not None:
                self._monitor.say(f"recording stopped: {exc}")

    def close(self, timeout: float = 5.0) -> None:
        """Close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                log.exception("smiquery: closing the recording failed")


class JobMetrics(Output):
    """The job's own metrics, served on ``metrics_port`` and/or pushed to ``pushgateway`` for each run (an output).

    Computed from the monitor's :class:`~smiquery.training.monitor.Totals` at scrape (or push) time, so that a step
    costs nothing here; the series are listed on the Training page of the docs. ``metrics_port`` 0 binds any free
    port (:attr:`port`); ``web_config``: as ``smiquery export --web-config``. Pushes go every ``push_interval``
    seconds to this run's group (``run_id``, default ``SMIQUERY_RUN_ID`` else random; the host), deleted when the
    run closes. A failure to serve or push is said once and training goes on. Raises ValueError for an invalid
    ``metrics_port`` or ``pushgateway``, WebConfigError for an invalid web-config file.
    """

    def __init__(
        self,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        web_config: str | os.PathLike[str] | None = None,
        pushgateway: str | None = None,
        push_interval: float = 15.0,
        job: str = "training",
        run_id: str | None = None,
    ) -> None:
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0-65535, not {metrics_port}")
        if pushgateway is not None and not pushgateway.lower().startswith(("http://", "https://")):
            raise ValueError("pushgateway must be an http:// or https:// URL")
        if web_config is not None:  # a bad file is a mistake to fix before training, not a warning after it
            from smiquery.httpd.webconfig import load_web_config

            load_web_config(web_config)
        self.metrics_port = metrics_port
        self.metrics_addr = metrics_addr
        self.web_config = web_config
        self.pushgateway = pushgateway
        self.push_interval = float(push_interval)
        self.job = job
        self.run_id = run_id or os.environ.get("SMIQUERY_RUN_ID") or uuid4().hex[:12]
        self.host = socket.gethostname()
        #: the Pushgateway group of this run: one per run and host, so that two jobs on a host never share one
        self.grouping_key = {"run": self.run_id, "host": self.host}
        self.monitor: RunMonitor | None = None
        self.registry: Any = None
        self._http: HttpServer | None = None
        #: the port actually bound while a run is served (for ``metrics_port=0``), else None
        self.port: int | None = None
        self._stop = threading.Event()
        self._pusher: threading.Thread | None = None

    def open(self, monitor: RunMonitor) -> None:
        """Serve and/or push ``monitor``'s run; a failure is said once (``the training metrics are off``)."""
        self.monitor = monitor
        try:
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(self)
            self._stop = threading.Event()
            if self.metrics_port is not None:
                self._serve(self.metrics_port)
        except Exception as exc:
            self.monitor = None
            monitor.say(f"the training metrics are off: {exc}")
            return
        if self.pushgateway is not None:
            self._pusher = threading.Thread(
                target=self._push_loop, args=(monitor, self.pushgateway), name="smiquery-monitor-push", daemon=True
            )
            self._pusher.start()

    def _serve(self, port: int) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from smiquery.httpd.server import HttpServer, Response, listen, route
        from smiquery.httpd.webconfig import load_web_config

        def metrics(req: Request) -> Response:
            return Response(200, bytes(generate_latest(self.registry)), CONTENT_TYPE_LATEST)

        web = load_web_config(self.web_config) if self.web_config is not None else None
        sock = listen(self.metrics_addr, port, port_option="metrics_port", bind_option="metrics_addr")
        self.port = int(sock.getsockname()[1])
        self._http = HttpServer(
            sock,
            functools.partial(route, pages={"/metrics": metrics}, missing=b"the training metrics are at /metrics\n"),
            web=web,  # basic auth is checked by the server before a request is routed
            workers=2,
            max_connections=64,
            server_header="smiquery-training",
        )

    def _push_loop(self, monitor: RunMonitor, gateway: str) -> None:
        from prometheus_client import push_to_gateway

        while not self._stop.wait(self.push_interval):
            try:  # replaces this run's group
                push_to_gateway(
                    gateway, job=self.job, registry=self.registry, grouping_key=self.grouping_key, timeout=2.0
                )
            except Exception as exc:
                monitor.say(f"pushing training metrics failed ({type(exc).__name__})", key="push-failed")

    def close(self, timeout: float = 5.0) -> None:
        """Stop pushing (within 3 s) and delete the run's group (within 2 s); stop serving. Idempotent.

        A killed process (SIGKILL, the OOM killer, a lost node) leaves its group behind, with a
        ``push_time_seconds`` that stops advancing: rules that must ignore it compare that with ``time()``.
        """
        monitor, self.monitor = self.monitor, None
        if monitor is None:
            return  # not serving a run
        self._stop.set()
        if self._pusher is not None:
            self._pusher.join(3.0)
            self._pusher = None
        if self.pushgateway is not None:  # the run ended: its series must not outlive it
            from prometheus_client import delete_from_gateway

            try:
                delete_from_gateway(self.pushgateway, job=self.job, grouping_key=self.grouping_key, timeout=2.0)
            except Exception as exc:
                monitor.say(f"deleting the training metrics' group failed ({type(exc).__name__})", key="push-del")
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        self.port = None

    def collect(self) -> Iterator[Any]:
        """The job's families over its run's totals, one series per watched GPU (by UUID): prometheus_client's."""
        from prometheus_client.core import CounterMetricFamily as Counter
        from prometheus_client.core import GaugeMetricFamily as Gauge

        m = self.monitor
        if m is None:
            return
        t = m.totals
        job = [self.run_id, self.host]
        for family, name, text, value in (
            (Counter, "steps", "Optimizer steps taken by the job.", t.steps),
            (Counter, "samples", "Training samples processed by the job.", t.samples),
            (Counter, "data_wait_seconds", "Seconds the job spent between steps (waiting for input).", t.data_wait),
            (Gauge, "epoch", "The epoch the job is in (0-based).", t.epoch),
        ):
            metric = family(f"smiquery_training_{name}", text, labels=["run", "host"])
            if value is not None:
                metric.add_metric(job, float(value))
            yield metric
        uuids = sorted(m.uuids().items())
        info = Gauge(
            "smiquery_training_gpu_info",
            "1 for each GPU the job trains on: joins the job's series (by run) to the GPU's (by uuid).",
            labels=["run", "host", "uuid", "gpu"],
        )
        for idx, uuid in uuids:
            info.add_metric([*job, uuid, str(idx)], 1.0)
        yield info
        # per GPU: (family, name, help, its value by nvidia-smi index: None for no series rather than a made-up 0)
        per_gpu: list[tuple[Any, str, str, Callable[[int], Any]]] = [
            (Counter, "energy_joules", "Energy drawn by the GPU during training (power.draw).", t.joules.get),
            *(
                (Gauge, f"memory_{name}_bytes", text, lambda i, attr=attr: getattr(t.memory.get(i), attr, None))
                for name, attr, text in (
                    ("used", "current", "GPU memory held by the framework's live tensors."),
                    ("peak", "peak", "The framework's peak tensor memory on the GPU."),
                    ("reserved", "reserved", "GPU memory reserved by the framework's allocator."),
                )
            ),
        ]
        if m.process_share:
            shares = m.process_shares()
            pmon = "in the newest nvidia-smi pmon sample"
            per_gpu += [
                (
                    Gauge,
                    "gpu_process_share",
                    f"The job's part of the GPU's SM use {pmon} (0..1).",
                    lambda i: getattr(shares.get(i), "share", None),
                ),
                (
                    Gauge,
                    "gpu_other_processes",
                    f"Processes other than the job's on the GPU {pmon}.",
                    lambda i: float(len(shares[i].other_pids)) if i in shares else None,
                ),
            ]
        for family, name, text, value_of in per_gpu:
            metric = family(f"smiquery_training_{name}", text, labels=["run", "host", "uuid"])
            for idx, uuid in uuids:
                value = value_of(idx)
                if value is not None:
                    metric.add_metric([*job, uuid], value)
            yield metric


@dataclass(frozen=True)
class XidAlert(AlertEvent):
    """An Xid error on a GPU, as an alert event (always ``firing``: an Xid never clears).

    Its ``rule`` reads ``Xid 79``; ``value`` is the GPU's PCI address as the kernel printed it; ``info`` the code's
    catalogue entry (None for a code it lacks); ``xid_event`` the kernel log's event (driver text, pid, process).
    """

    xid: int = 0
    info: XidInfo | None = None
    xid_event: XidEvent | None = None

    def message(self) -> str:
        """One line for people: ``ALERT firing GPU 1: Xid 79 on GPU 1 (...): GPU has fallen off the bus; ...``."""
        gpu = f"GPU {self.gpu}" if self.gpu is not None else f"GPU {self.uuid or '?'}"
        text = describe(self.xid_event, self.gpu, self.uuid) if self.xid_event is not None else f"Xid {self.xid}"
        return f"ALERT {self.state} {gpu}: {text}"

    def to_dict(self) -> dict[str, object]:
        """The event's dict with ``xid``, ``meaning``, ``action``, ``advice`` and the driver's ``driver_message``."""
        ev = self.xid_event
        return {
            **super().to_dict(),
            "xid": self.xid,
            **{key: getattr(self.info, key, None) for key in ("meaning", "action", "advice")},
            "driver_message": ev.message if ev is not None else None,
            "pid": ev.pid if ev is not None else None,
        }


class KernelLog(Output):
    """The kernel log at ``path`` (``/dev/kmsg``, ``/var/log/kern.log``) followed from its end while a run goes on.

    Each Xid on a watched GPU becomes an :class:`XidAlert` that the run keeps and hands to the handlers like a fired
    rule (:meth:`RunMonitor.alert`). An Xid on another GPU is said once at INFO; an unreadable log is said once and
    the run goes on.
    """

    #: the PCI address names the GPU of an Xid
    fields: tuple[str, ...] = ("pci.bus_id",)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._watcher: XidWatcher | None = None

    def open(self, monitor: RunMonitor) -> None:
        """Follow the log from its end."""

        def failed(exc: BaseException, _opened: bool) -> None:
            monitor.say(f"reading the kernel log stopped ({exc}): Xid errors are no longer reported to this run")

        def on_event(event: XidEvent) -> None:  # an Xid on another GPU is said once per address
            found = gpu_for(event, monitor.latest().values())
            if found is None:
                monitor.say(
                    f"{describe(event)} (not a GPU this run watches)", logging.INFO, key=f"xid-other-{event.pci_bus_id}"
                )
                return
            rule = Rule(get_field("pci.bus_id"), "==", event.pci_bus_id, text=f"Xid {event.xid}")
            at = datetime.now().astimezone()
            alert = XidAlert(
                rule, found.index, found.uuid, event.pci_bus_id, "firing", at, at, 0.0, event.xid, event.info, event
            )
            monitor.alert(alert)

        try:
            self._watcher = XidWatcher(self.path, on_event=on_event, on_error=failed, from_start=False).start()
        except KernelLogError as exc:
            monitor.say(f"{exc}: Xid errors are not reported to this run")

    def close(self, timeout: float = 5.0) -> None:
        """Stop following."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.close(timeout)


#: The keywords of :func:`run_monitor` that go to the job's :class:`JobMetrics`.
METRICS_KEYWORDS = ("metrics_port", "metrics_addr", "web_config", "pushgateway", "push_interval", "job", "run_id")


def run_monitor(
    fields: str | Sequence[str] | None = None,
    interval: float = 1.0,
    *,
    record: str | os.PathLike[str] | None = None,
    kernel_log: str | os.PathLike[str] | None = None,
    **options: Any,
) -> RunMonitor:
    """A :class:`~smiquery.training.monitor.RunMonitor` with the outputs these keywords ask for (not started).

    ``record``: a :class:`Recording` of every sample to this file; ``kernel_log``: follow this kernel log
    (``/dev/kmsg``...) for Xids on the watched GPUs (a :class:`KernelLog`); ``**options``: :data:`METRICS_KEYWORDS`
    (the job's :class:`JobMetrics`, served and/or pushed) and the other arguments of
    :class:`~smiquery.training.monitor.RunMonitor`. Raises ValueError, WebConfigError, InvalidFieldError or
    InvalidRuleError for an invalid argument, web-config file, field name or alert expression.
    """
    outputs: list[Output] = [] if record is None else [Recording(record)]
    # made even when unused: a bad web-config file is a mistake to fix before training, not a warning after it
    metrics = JobMetrics(**{k: options.pop(k) for k in METRICS_KEYWORDS if k in options})
    if metrics.metrics_port is not None or metrics.pushgateway is not None:
        outputs.append(metrics)
    if kernel_log:
        outputs.append(KernelLog(kernel_log))
    return RunMonitor(fields, interval, outputs=outputs, **options)
