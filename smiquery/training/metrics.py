"""The job's own Prometheus metrics: steps, samples, data wait, epoch, energy, framework memory and process share.

Computed from a monitor's counters at scrape (or push) time, so that a training step costs nothing here. The job's
counters are labelled ``{run, host}`` (one series per run, whatever the number of GPUs); the per-GPU series carry
``{run, host, uuid}`` and join the GPUs through ``smiquery_training_gpu_info{run, host, uuid, gpu} 1``.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from uuid import uuid4

if TYPE_CHECKING:
    from smiquery.httpd.server import HttpServer, Request, Response
    from smiquery.sample import GpuSample
    from smiquery.training.monitor import RunMonitor

__all__ = ["JobMetrics"]


class JobMetrics:
    """The job's own metrics, served on ``metrics_port`` and/or pushed to ``pushgateway`` for each run (an output).

    ``metrics_port`` 0 binds any free port (:attr:`port`); ``metrics_addr`` defaults to 127.0.0.1 like the exporter,
    ``web_config`` is an exporter-toolkit web-config file (TLS, basic auth) as ``smiquery export --web-config``.
    Pushes go every ``push_interval`` seconds, with the ``job`` label, to this run's group (``run_id``: default
    ``SMIQUERY_RUN_ID``, else a new random id; and the host), deleted when the run closes. A failure to serve or push
    (the port taken, no ``prometheus_client``) is said once and training goes on. Raises ValueError for an invalid
    ``metrics_port`` or ``pushgateway``, WebConfigError for an invalid web-config file.
    """

    fields: tuple[str, ...] = ()

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
        self._port: int | None = None
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
                self._serve(self.metrics_port, self.metrics_addr)
        except Exception as exc:
            self.monitor = None
            monitor.say(f"the training metrics are off: {exc}")
            return
        if self.pushgateway is not None:
            self._pusher = threading.Thread(
                target=self._push_loop, args=(monitor, self.pushgateway), name="smiquery-monitor-push", daemon=True
            )
            self._pusher.start()

    def take(self, samples: Sequence[GpuSample]) -> None:
        """Nothing: the metrics read the run's counters when scraped or pushed."""

    def _serve(self, port: int, addr: str) -> None:
        """Serve /metrics with the shared HTTP server (TLS and basic auth from the web config)."""
        from smiquery.httpd.server import HttpServer, listen
        from smiquery.httpd.webconfig import load_web_config

        web = load_web_config(self.web_config) if self.web_config is not None else None
        sock = listen(addr, port, port_option="metrics_port", bind_option="metrics_addr")
        self._port = int(sock.getsockname()[1])
        self._http = HttpServer(
            sock,
            self._answer,
            web=web,  # basic auth is checked by the server before _answer sees a request
            workers=2,
            max_connections=64,
            server_header="smiquery-training",
        )

    def _answer(self, req: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from smiquery.httpd.server import Response

        if req.method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
        if req.path != "/metrics":
            return Response(404, b"the training metrics are at /metrics\n")
        return Response(200, bytes(generate_latest(self.registry)), CONTENT_TYPE_LATEST)

    @property
    def port(self) -> int | None:
        """The port actually bound while a run is served (for ``port=0``), else None."""
        return self._port

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
        self._port = None

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
