"""The collector: metric families from the newest sweep of one sample source, plus the exporter's health."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client.metrics_core import Metric

from smiquery.exporter.naming import Naming, metric_specs, render
from smiquery.exporter.poller import ProcessPoller
from smiquery.fields import Field
from smiquery.oneshot import GpuProcess
from smiquery.source import Sweep

if TYPE_CHECKING:
    from smiquery.records import GpuSample, Value
    from smiquery.source import StreamStats

__all__ = ["SmiCollector", "SweepSource", "parse_labels"]

log = logging.getLogger("smiquery.exporter")

_LABEL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class SweepSource(Protocol):
    """What the collector reads: a started :class:`~smiquery.supervisor.Stream` (or a stand-in in tests)."""

    @property
    def interval(self) -> float:
        """Seconds between samples."""
        ...

    @property
    def stats(self) -> StreamStats:
        """The stream's counters."""
        ...

    @property
    def running(self) -> bool:
        """True while the stream's thread is alive."""
        ...

    @property
    def error(self) -> BaseException | None:
        """The error that ended the stream, if any."""
        ...

    def latest(self) -> tuple[Sweep | None, float | None]:
        """The newest sweep and its age in seconds."""
        ...


def _gauge(name: str, doc: str) -> Metric:
    return Metric(name, doc, "gauge")


def _counter(name: str, doc: str) -> Metric:
    return Metric(name, doc, "counter")


def parse_labels(items: Iterable[str] | Mapping[str, str] | None) -> dict[str, str]:
    """Check constant labels given as ``key=value`` strings (or a mapping).

    Args:
        items: ``["site=lab", "rack=3"]`` or ``{"site": "lab"}``.

    Returns:
        The labels as a dict.

    Raises:
        ValueError: a malformed item, an invalid or reserved label name, or a name given twice.
    """
    if items is None:
        return {}
    pairs: list[tuple[str, str]] = []
    if isinstance(items, Mapping):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"label {item!r} is not key=value")
            pairs.append((key.strip(), value))
    out: dict[str, str] = {}
    for key, value in pairs:
        if not _LABEL_NAME_RE.fullmatch(key) or key.startswith("__"):
            raise ValueError(
                f"label name {key!r} is invalid: letters, digits and '_', not starting with a digit or '__'"
            )
        if key in _RESERVED_LABELS:
            raise ValueError(f"label name {key!r} is set by the exporter itself; pick another name")
        if key in out:
            raise ValueError(f"label {key!r} is given twice")
        out[key] = value
    return out


# Labels the exporter sets itself (Hostname is not here: --label Hostname=... overrides the DCGM label).
_RESERVED_LABELS = frozenset(
    {"gpu", "uuid", "name", "pci_bus_id", "value", "pid", "process_name", "type", "source"}
    | {"UUID", "device", "modelName", "DCGM_FI_DRIVER_VERSION"}
)


def _pstate_number(value: Value) -> float | None:
    if isinstance(value, str) and value[:1] in "Pp" and value[1:].isdigit():
        return float(value[1:])
    return None


class SmiCollector:
    """A ``prometheus_client`` collector over the newest sweep of one background stream.

    :meth:`collect` reads :meth:`Stream.latest` and never runs nvidia-smi. Per-GPU series are served only while
    the newest sweep is fresher than ``stale_after``; a missing value (any status token) leaves its series out
    for that GPU, never 0. The health metrics (``smiquery_up``, sample age, restarts, errors by type, dropped
    rows, lost GPUs) are always there. :meth:`exposition` is the fast path the HTTP server uses: the per-sweep
    text is rendered once per sweep; only the health metrics are rendered for every scrape.

    Args:
        stream: a started stream (anything with ``latest()``, ``stats``, ``running``, ``error``, ``interval``).
        fields: the fields the stream queries (default: ``stream.fields``).
        naming: ``smiquery`` or ``dcgm``.
        labels: constant labels added to every series.
        processes: a :class:`ProcessPoller` to add per-process GPU memory; None for none.
        stale_after: seconds after which the newest sweep counts as stale (default ``max(3 * interval, 15)``).
        hostname: the DCGM ``Hostname`` label (default: this host's name).
    """

    def __init__(
        self,
        stream: SweepSource,
        *,
        fields: Sequence[Field] | None = None,
        naming: Naming = "smiquery",
        labels: Mapping[str, str] | Iterable[str] | None = None,
        processes: ProcessPoller | None = None,
        stale_after: float | None = None,
        hostname: str | None = None,
    ) -> None:
        self.stream = stream
        flds: Sequence[Field] | None = fields if fields is not None else getattr(stream, "fields", None)
        if flds is None:
            raise ValueError("pass fields= for a stream without a .fields attribute")
        self.naming: Naming = naming
        self.specs = metric_specs(list(flds), naming)
        self.labels = parse_labels(labels)
        self.processes = processes
        self.stale_after = float(stale_after) if stale_after is not None else max(3 * stream.interval, 15.0)
        self.hostname = self.labels.get("Hostname") or hostname or socket.gethostname()
        self.render_errors = 0
        self._lock = threading.Lock()
        self._cache_key: tuple[object, object] = (object(), object())
        self._cache: bytes = b""

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not collect (and so not touch the stream)."""
        return []

    # ----------------------------------------------------------------------------------------- per sweep

    def _dcgm_labels(self, s: GpuSample) -> dict[str, str]:
        gpu = "" if s.index is None else str(s.index)
        out = {
            "gpu": gpu,
            "UUID": s.uuid or "",
            "device": f"nvidia{gpu}",
            "modelName": str(s.get("name") or ""),
            "Hostname": self.hostname,
            "pci_bus_id": str(s.get("pci.bus_id") or ""),
        }
        drv = s.get("driver_version")
        if drv is not None:
            out["DCGM_FI_DRIVER_VERSION"] = str(drv)
        out.update(self.labels)
        return out

    def _native_labels(self, s: GpuSample) -> dict[str, str]:
        idx = s.index
        out = {
            "gpu": "" if idx is None else str(idx),
            "uuid": s.uuid or "",
            "name": str(s.get("name") or ""),
            "pci_bus_id": str(s.get("pci.bus_id") or ""),
        }
        out.update(self.labels)
        return out

    def sweep_families(self, sweep: Sweep) -> list[Metric]:
        """The per-GPU metric families of one sweep (without health metrics).

        Args:
            sweep: the samples of one instant.

        Returns:
            The non-empty families, in spec order.
        """
        if not sweep:
            return []
        per_gpu = []
        for s in sweep:
            pos = {n: i for i, n in enumerate(s.fields)}
            native = self._native_labels(s)
            dcgm = self._dcgm_labels(s) if self.naming == "dcgm" else native
            per_gpu.append((s.values, pos, dcgm, native, s.raw))
        out: list[Metric] = []
        for spec in self.specs:
            fam = Metric(spec.name, spec.help, spec.type)
            for values, pos, dcgm_labels, native_labels, raw in per_gpu:
                i = pos.get(spec.field)
                if i is None:
                    continue
                value = values[i]
                if value is None:
                    continue  # a status token: the series is absent for this GPU, never 0
                labels = dcgm_labels if spec.naming == "dcgm" else native_labels
                if spec.style == "info":
                    text = raw.get(spec.field, str(value)) if isinstance(value, int) else str(value)
                    fam.add_sample(spec.sample, {**labels, "value": text.strip()}, 1.0)
                    continue
                if spec.style == "pstate":
                    number = _pstate_number(value)
                    if number is not None:
                        fam.add_sample(spec.sample, labels, number)
                    continue
                if isinstance(value, bool):
                    fam.add_sample(spec.sample, labels, 1.0 if value else 0.0)
                elif isinstance(value, (int, float)):
                    fam.add_sample(spec.sample, labels, float(value) * spec.scale)
            if fam.samples:
                out.append(fam)
        return out

    def process_families(self, procs: Sequence[GpuProcess]) -> list[Metric]:
        """Per-process GPU memory (``smiquery_process_used_memory_bytes``), labelled pid, process_name, gpu, uuid.

        Args:
            procs: the processes of one poll.

        Returns:
            One family (empty list when no process reports its memory).
        """
        fam = _gauge(
            "smiquery_process_used_memory_bytes",
            "GPU memory used by a compute process, in bytes (nvidia-smi --query-compute-apps used_memory).",
        )
        # One series per (pid, GPU): a process listed twice on one GPU (one row per MIG instance) is summed, as
        # Prometheus rejects a whole scrape that repeats a series.
        total: dict[tuple[int, str, str, str], float] = {}
        for p in procs:
            if p.used_memory is None:
                continue
            key = (p.pid, p.process_name, "" if p.gpu_index is None else str(p.gpu_index), p.gpu_uuid)
            total[key] = total.get(key, 0.0) + float(p.used_memory) * 1048576.0
        for (pid, pname, gpu, uuid), used in total.items():
            labels = {"pid": str(pid), "process_name": pname, "gpu": gpu, "uuid": uuid, **self.labels}
            fam.add_sample(fam.name, labels, used)
        return [fam] if fam.samples else []

    # ------------------------------------------------------------------------------------------- health

    def _fresh(self, sweep: Sweep | None, age: float | None) -> bool:
        return sweep is not None and age is not None and age <= self.stale_after

    def health_families(self, sweep: Sweep | None, age: float | None, duration: float) -> list[Metric]:
        """The exporter's own health metrics for this scrape.

        Args:
            sweep: the newest sweep (or None).
            age: its age in seconds.
            duration: seconds spent building this scrape so far.

        Returns:
            The families.
        """
        st = self.stream.stats
        const = self.labels
        out: list[Metric] = []

        def one(fam: Metric, value: float, labels: Mapping[str, str] | None = None) -> None:
            sample = fam.name + "_total" if fam.type == "counter" else fam.name
            fam.add_sample(sample, {**const, **labels} if labels else const, value)
            out.append(fam)

        up = 1.0 if self.stream.running and self._fresh(sweep, age) else 0.0
        one(
            _gauge(
                "smiquery_up",
                f"1 when nvidia-smi delivers fresh samples (newest younger than {self.stale_after:g} s), else 0.",
            ),
            up,
        )
        if sweep is not None and age is not None:
            one(
                _gauge(
                    "smiquery_last_sample_timestamp_seconds",
                    "Unix time at which the newest sweep of nvidia-smi rows was received.",
                ),
                time.time() - age,
            )
            one(_gauge("smiquery_last_sample_age_seconds", "Age of the newest sweep of nvidia-smi rows."), age)
        one(_counter("smiquery_nvidia_smi_starts", "nvidia-smi loop processes started."), float(st.starts))
        one(
            _counter("smiquery_nvidia_smi_restarts", "nvidia-smi loop processes restarted after a failure."),
            float(st.restarts),
        )
        one(_counter("smiquery_sweeps", "Complete sweeps (one row per GPU) received."), float(st.sweeps))
        one(
            _counter("smiquery_dropped_rows", "Rows of nvidia-smi output rejected by the parser."),
            float(st.dropped_rows),
        )
        errors = _counter("smiquery_nvidia_smi_errors", "nvidia-smi failures, by error type and source.")
        for typ, n in sorted(dict(st.errors).items()):
            errors.add_sample(errors.name + "_total", {**const, "type": typ, "source": "stream"}, float(n))
        if self.processes is not None:
            for typ, n in sorted(dict(self.processes.errors).items()):
                errors.add_sample(errors.name + "_total", {**const, "type": typ, "source": "processes"}, float(n))
        if errors.samples:
            out.append(errors)
        lost = set(st.lost_gpus)
        lost_fam = _gauge("smiquery_gpu_lost", "1 while nvidia-smi reports the GPU as lost ([GPU is lost]), else 0.")
        seen: set[int] = set()
        if sweep is not None:
            for s in sweep:
                if s.index is None:
                    continue
                seen.add(s.index)
                lost_fam.add_sample(lost_fam.name, self._native_labels(s), 1.0 if s.index in lost else 0.0)
        for idx in sorted(lost - seen):
            lost_fam.add_sample(lost_fam.name, {**const, "gpu": str(idx)}, 1.0)
        if lost_fam.samples:
            out.append(lost_fam)
        if self.processes is not None:
            _, _, when = self.processes.latest()
            if when is not None:
                one(
                    _gauge(
                        "smiquery_processes_last_success_timestamp_seconds",
                        "Unix time of the newest successful listing of compute processes.",
                    ),
                    when,
                )
        if self.render_errors:
            one(
                _counter("smiquery_collection_errors", "Scrapes whose GPU metrics could not be built (a bug)."),
                float(self.render_errors),
            )
        one(
            _gauge("smiquery_collection_duration_seconds", "Time spent building this scrape's metrics."),
            duration,
        )
        return out

    # ------------------------------------------------------------------------------------------- output

    def _data_families(self, sweep: Sweep | None, fresh: bool, procs: tuple[GpuProcess, ...] | None) -> list[Metric]:
        fams: list[Metric] = []
        try:
            if fresh and sweep is not None:
                fams.extend(self.sweep_families(sweep))
            if procs is not None:
                fams.extend(self.process_families(procs))
        except Exception:  # a bug must not take /metrics down: the health metrics still go out
            self.render_errors += 1
            log.exception("smiquery exporter: building the GPU metrics failed")
            return []
        return fams

    def _fresh_processes(self) -> tuple[GpuProcess, ...] | None:
        if self.processes is None:
            return None
        procs, age, _ = self.processes.latest()
        if procs is None or age is None or age > max(3 * self.processes.interval, self.stale_after):
            return None
        return procs

    def collect(self) -> Iterator[Metric]:
        """Yield the GPU, process and health metric families (the ``prometheus_client`` collector protocol)."""
        t0 = time.perf_counter()
        sweep, age = self.stream.latest()
        fams = self._data_families(sweep, self._fresh(sweep, age), self._fresh_processes())
        yield from fams
        yield from self.health_families(sweep, age, time.perf_counter() - t0)

    def exposition(self) -> bytes:
        """The whole ``/metrics`` body; the per-sweep part is rendered once per sweep and reused.

        Returns:
            UTF-8 text in the Prometheus text format.
        """
        t0 = time.perf_counter()
        sweep, age = self.stream.latest()
        fresh = self._fresh(sweep, age)
        procs = self._fresh_processes()
        key = (sweep if fresh else None, procs)
        with self._lock:
            if key[0] is not self._cache_key[0] or key[1] is not self._cache_key[1]:
                self._cache = render(self._data_families(sweep, fresh, procs)).encode()
                self._cache_key = key
            body = self._cache
        health = render(self.health_families(sweep, age, time.perf_counter() - t0))
        return body + health.encode()

    def health(self) -> tuple[bool, str]:
        """Whether the data is fresh, with one line saying why not (what ``/healthz`` answers).

        Returns:
            ``(True, "ok")`` or ``(False, reason)``.
        """
        sweep, age = self.stream.latest()
        st = self.stream.stats
        if not self.stream.running:
            err = self.stream.error
            why = f"{type(err).__name__}: {err}".splitlines()[0] if err is not None else "not started or closed"
            return False, f"nvidia-smi stream stopped: {why}"
        if sweep is None or age is None:
            extra = f"; last error: {st.last_error}" if st.last_error else ""
            return False, f"no sample yet (waiting for nvidia-smi){extra}"
        if age > self.stale_after:
            extra = f"; last error: {st.last_error}" if st.last_error else ""
            return False, f"stale: newest sample is {age:.1f} s old (limit {self.stale_after:g} s){extra}"
        return True, "ok"
