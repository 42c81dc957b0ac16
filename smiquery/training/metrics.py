"""The job's own Prometheus metrics: steps, samples, data wait, epoch, energy, framework memory and process share.

Computed from a monitor's counters at scrape (or push) time, so that a training step costs nothing here; served on
``metrics_port`` (by the exporter's HTTP server, with its web-config for TLS and basic auth) and/or pushed to a
Pushgateway (``pip install 'smiquery[export]'``).

The job's counters (steps, samples, data wait, epoch) are job-level, labelled ``{run, host}``: one series per run,
so that ``sum(rate(...))`` counts each step once whatever the number of GPUs. The GPUs of a run are joined through
``smiquery_training_gpu_info{run, host, uuid, gpu} 1``; the per-GPU series (energy, framework memory, process share)
carry ``{run, host, uuid}``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from smiquery.exporter.httpd import HttpServer, Request, Response
    from smiquery.exporter.webconfig import WebConfig
    from smiquery.sources.pmon import ProcessShare
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
    run_id: str
    process_share: bool
    metrics_port: int | None
    metrics_addr: str
    web_config: str | os.PathLike[str] | None
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
        self._http: HttpServer | None = None
        self._port: int | None = None
        self._web: WebConfig | None = None
        self._stop = threading.Event()
        self._pusher: threading.Thread | None = None
        if monitor.metrics_port is not None:
            self._serve(monitor.metrics_port, monitor.metrics_addr, monitor.web_config)
        if monitor.pushgateway is not None:
            self._pusher = threading.Thread(target=self._push_loop, name="smiquery-monitor-push", daemon=True)
            self._pusher.start()

    def _serve(self, port: int, addr: str, web_config: str | os.PathLike[str] | None) -> None:
        """Serve /metrics with the exporter's HTTP server (its TLS and basic auth from a web-config file)."""
        from smiquery.exporter.httpd import HttpServer
        from smiquery.exporter.webconfig import WebConfig, load_web_config

        web = load_web_config(web_config) if web_config is not None else WebConfig()
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr.strip("[]"), port))
        except OSError as exc:
            sock.close()
            raise OSError(
                exc.errno, f"cannot serve training metrics on {addr}:{port}: {exc.strerror}; pick another metrics_port"
            ) from None
        self._port = int(sock.getsockname()[1])
        self._web = web
        self._http = HttpServer(
            sock,
            self._answer,
            ssl_context=web.ssl_context,
            workers=2,
            max_connections=64,
            server_header="smiquery-training",
            headers=web.headers,
            peer_check=web.peer_allowed if web.allowed_sans else None,
        )

    def _answer(self, req: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from smiquery.exporter.httpd import Response

        web = self._web
        assert web is not None
        if req.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
        if not web.authorized(req.headers.get("authorization")):
            return Response(401, b"unauthorized\n", headers={"WWW-Authenticate": 'Basic realm="smiquery"'})
        if req.path != "/metrics":
            return Response(404, b"the training metrics are at /metrics\n")
        return Response(200, bytes(generate_latest(self.registry)), CONTENT_TYPE_LATEST)

    @property
    def port(self) -> int | None:
        """The port actually bound (for ``metrics_port=0``)."""
        return self._port

    def grouping_key(self) -> dict[str, str]:
        """The Pushgateway group of this run: one per run and host, so that two jobs on a host never share one."""
        return {"run": self.monitor.run_id, "host": self.monitor.host}

    def push(self) -> None:
        """Push the metrics to the Pushgateway now (replacing this run's group)."""
        from prometheus_client import push_to_gateway

        m = self.monitor
        assert m.pushgateway is not None
        push_to_gateway(m.pushgateway, job=m.job, registry=self.registry, grouping_key=self.grouping_key(), timeout=2.0)

    def delete(self) -> None:
        """Delete this run's group from the Pushgateway (the run ended: its series must not outlive it)."""
        from prometheus_client import delete_from_gateway

        m = self.monitor
        assert m.pushgateway is not None
        delete_from_gateway(m.pushgateway, job=m.job, grouping_key=self.grouping_key(), timeout=2.0)

    def _push_loop(self) -> None:
        while not self._stop.wait(self.monitor.push_interval):
            try:
                self.push()
            except Exception as exc:
                self.monitor.say(f"pushing training metrics failed ({type(exc).__name__})", key="push-failed")

    def close(self) -> None:
        """Stop pushing and delete the run's Pushgateway group; stop serving.

        A process killed before this (SIGKILL, the OOM killer, a lost node) leaves its group behind, with a
        ``push_time_seconds`` that stops advancing: rules that must ignore it compare that with ``time()``.
        """
        self._stop.set()
        if self._pusher is not None:
            self._pusher.join(3.0)
        if self.monitor.pushgateway is not None:
            try:
                self.delete()
            except Exception as exc:
                self.monitor.say(f"deleting the training metrics' group failed ({type(exc).__name__})", key="push-del")
        if self._http is not None:
            self._http.shutdown()
            self._http = None


class _Collector:
    """prometheus_client collector over a run's totals, one series per watched GPU (by UUID)."""

    def __init__(self, monitor: MonitoredJob) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.monitor
        t = m.totals
        uuids = m.uuids()
        job = [m.run_id, m.host]
        job_labels = ["run", "host"]
        steps = CounterMetricFamily("smiquery_training_steps", "Optimizer steps taken by the job.", labels=job_labels)
        steps.add_metric(job, float(t.steps))
        samples = CounterMetricFamily(
            "smiquery_training_samples", "Training samples processed by the job.", labels=job_labels
        )
        samples.add_metric(job, float(t.samples))
        wait = CounterMetricFamily(
            "smiquery_training_data_wait_seconds",
            "Seconds the job spent between steps (waiting for input).",
            labels=job_labels,
        )
        wait.add_metric(job, t.data_wait)
        epoch = GaugeMetricFamily("smiquery_training_epoch", "The epoch the job is in (0-based).", labels=job_labels)
        if t.epoch is not None:
            epoch.add_metric(job, float(t.epoch))
        info = GaugeMetricFamily(
            "smiquery_training_gpu_info",
            "1 for each GPU the job trains on: joins the job's series (by run) to the GPU's (by uuid).",
            labels=["run", "host", "uuid", "gpu"],
        )
        labels = ["run", "host", "uuid"]
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
            info.add_metric([m.run_id, m.host, uuid, str(idx)], 1.0)
            lv = [m.run_id, m.host, uuid]
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
        yield from (steps, samples, wait, epoch, info, energy, used, peak, reserved)
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
                share.add_metric([m.run_id, m.host, uuid], got.share)
            others.add_metric([m.run_id, m.host, uuid], float(len(got.other_pids)))
        yield from (share, others)
