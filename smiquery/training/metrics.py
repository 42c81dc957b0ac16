"""The job's own Prometheus metrics: steps, samples, data wait, epoch, energy, framework memory and process share.

Computed from a monitor's counters at scrape (or push) time, so that a training step costs nothing here; served on
``metrics_port`` and/or pushed to a Pushgateway (``pip install 'smiquery[export]'``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from smiquery.pmon import ProcessShare
    from smiquery.training.memory import MemoryView

__all__ = ["JobMetrics", "MonitoredJob", "Totals"]


@dataclass
class Totals:
    """Counters of a run, read by the metrics collector at scrape time (no per-step Prometheus cost).

    Attributes:
        steps: steps taken.
        samples: training samples processed (when the adapter knows batch sizes).
        data_wait: seconds spent between steps.
        epoch: the current epoch (0-based) or None.
        joules: energy per nvidia-smi index since the run began.
        memory: the newest framework memory view per nvidia-smi index.
    """

    steps: int = 0
    samples: int = 0
    data_wait: float = 0.0
    epoch: int | None = None
    joules: dict[int, float] = field(default_factory=dict)
    memory: dict[int, MemoryView] = field(default_factory=dict)


class MonitoredJob(Protocol):
    """What the metrics read of a run (a :class:`~smiquery.training.monitor.RunMonitor`)."""

    totals: Totals
    host: str
    job: str
    process_share: bool
    metrics_port: int | None
    metrics_addr: str
    pushgateway: str | None
    push_interval: float

    def uuids(self) -> dict[int, str]:
        """The UUID of each watched GPU (nvidia-smi index -> UUID)."""
        ...

    def process_shares(self) -> dict[int, ProcessShare]:
        """The newest pmon instant's share per watched GPU."""
        ...

    def say(self, message: str, level: int = logging.WARNING, *, key: str | None = None) -> None:
        """Log a message once per run."""
        ...


class JobMetrics:
    """The job's own metrics, computed from the monitor's counters at scrape (or push) time."""

    def __init__(self, monitor: MonitoredJob) -> None:
        from prometheus_client import CollectorRegistry

        self.monitor = monitor
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(monitor))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._pusher: threading.Thread | None = None
        if monitor.metrics_port is not None:
            from prometheus_client import start_http_server

            got = start_http_server(monitor.metrics_port, monitor.metrics_addr, self.registry)
            if isinstance(got, tuple):
                self._server, self._thread = got
        if monitor.pushgateway is not None:
            self._pusher = threading.Thread(target=self._push_loop, name="smiquery-monitor-push", daemon=True)
            self._pusher.start()

    @property
    def port(self) -> int | None:
        """The port actually bound (for ``metrics_port=0``)."""
        if self._server is None:
            return None
        return int(self._server.server_address[1])

    def push(self) -> None:
        """Push the metrics to the Pushgateway now."""
        from prometheus_client import push_to_gateway

        m = self.monitor
        assert m.pushgateway is not None
        push_to_gateway(m.pushgateway, job=m.job, registry=self.registry, grouping_key={"host": m.host}, timeout=2.0)

    def _push_loop(self) -> None:
        while not self._stop.wait(self.monitor.push_interval):
            try:
                self.push()
            except Exception as exc:
                self.monitor.say(f"pushing training metrics failed ({type(exc).__name__})", key="push-failed")

    def close(self) -> None:
        """Stop pushing (after one last push) and serving."""
        self._stop.set()
        if self.monitor.pushgateway is not None:
            try:
                self.push()  # the final figures
            except Exception as exc:
                self.monitor.say(f"pushing training metrics failed ({type(exc).__name__})", key="push-failed")
        if self._pusher is not None:
            self._pusher.join(3.0)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(2.0)


class _Collector:
    """prometheus_client collector over a run's totals, one series per watched GPU (by UUID)."""

    def __init__(self, monitor: MonitoredJob) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.monitor
        t = m.totals
        uuids = m.uuids()
        labels = ["uuid", "host"]
        steps = CounterMetricFamily("smiquery_training_steps", "Optimizer steps taken by the job.", labels=labels)
        samples = CounterMetricFamily(
            "smiquery_training_samples", "Training samples processed by the job.", labels=labels
        )
        wait = CounterMetricFamily(
            "smiquery_training_data_wait_seconds",
            "Seconds the job spent between steps (waiting for input).",
            labels=labels,
        )
        epoch = GaugeMetricFamily("smiquery_training_epoch", "The epoch the job is in (0-based).", labels=labels)
        energy = CounterMetricFamily(
            "smiquery_training_energy_joules", "Energy drawn by the GPU during training (power.draw).", labels=labels
        )
        used = GaugeMetricFamily(
            "smiquery_training_memory_used_bytes", "GPU memory held by the framework's live tensors.", labels=labels
        )
        peak = GaugeMetricFamily(
            "smiquery_training_memory_peak_bytes", "The framework's peak tensor memory on the GPU.", labels=labels
        )
        reserved = GaugeMetricFamily(
            "smiquery_training_memory_reserved_bytes",
            "GPU memory reserved by the framework's allocator.",
            labels=labels,
        )
        for idx, uuid in sorted(uuids.items()):
            lv = [uuid, m.host]
            steps.add_metric(lv, float(t.steps))
            samples.add_metric(lv, float(t.samples))
            wait.add_metric(lv, t.data_wait)
            if t.epoch is not None:
                epoch.add_metric(lv, float(t.epoch))
            joules = t.joules.get(idx)
            if joules is not None:  # no power.draw (N/A on this GPU): no series rather than a made-up 0
                energy.add_metric(lv, joules)
            view = t.memory.get(idx)
            if view is not None:
                if view.current is not None:
                    used.add_metric(lv, view.current)
                if view.peak is not None:
                    peak.add_metric(lv, view.peak)
                if view.reserved is not None:
                    reserved.add_metric(lv, view.reserved)
        yield from (steps, samples, wait, epoch, energy, used, peak, reserved)
        if m.process_share:
            yield from self._share_families(m, uuids, labels)

    @staticmethod
    def _share_families(m: MonitoredJob, uuids: Mapping[int, str], labels: list[str]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        share = GaugeMetricFamily(
            "smiquery_training_gpu_process_share",
            "The job's part of the GPU's SM use in the newest nvidia-smi pmon sample (0..1).",
            labels=labels,
        )
        others = GaugeMetricFamily(
            "smiquery_training_gpu_other_processes",
            "Processes other than the job's on the GPU in the newest nvidia-smi pmon sample.",
            labels=labels,
        )
        shares = m.process_shares()
        for idx, uuid in sorted(uuids.items()):
            got = shares.get(idx)
            if got is None:
                continue  # no pmon sample of this GPU: no series rather than a made-up 0
            if got.share is not None:
                share.add_metric([uuid, m.host], got.share)
            others.add_metric([uuid, m.host], float(len(got.other_pids)))
        yield from (share, others)
