"""A time range of the fleet as the DataFrame a recording gives, for :func:`smiquery.analysis.report` and the plot.

:func:`fleet_frame` reads the raw samples as scraped (instant queries of range selectors, ``metric[Nms]``: no
lookback carries a lost GPU's last value on), in chunks of at most 11,000 scrape intervals.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from smiquery.errors import PrometheusError, UsageError
from smiquery.fleet.client import PrometheusClient
from smiquery.fleet.naming import (
    EXTRA_FIELDS,
    FLEET_FIELDS,
    FleetNaming,
    GpuKey,
    check_regex,
    detect_namings,
    gpu_series,
    held_metrics,
    info_labels,
    selector,
)

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

    from smiquery.analysis.model import GpuName

__all__ = ["MAX_POINTS", "FleetGpuInfo", "chunks", "estimate_step", "fleet_frame", "gpu_names"]

#: Prometheus refuses a range query of more than 11,000 points per series.
MAX_POINTS = 11_000
# Keep each chunk well under the server's default query.max-samples (50 million).
_MAX_SAMPLES = 20_000_000
# Answers fetched but not yet parsed, at most (estimated): 256 MiB of JSON.
_AHEAD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class FleetGpuInfo:
    """Which GPU a frame's ``index`` stands for."""

    index: int
    instance: str
    gpu: str
    uuid: str
    name: str
    naming: str
    namespace: str
    pod: str
    node: str = ""
    job: str = ""

    def gpu_name(self) -> GpuName:
        """How the report names this GPU (see :func:`smiquery.analysis.render.gpu_name`)."""
        from smiquery.analysis.model import GpuName  # not at import: `top` needs no analysis

        held = f"{self.namespace}/{self.pod}" if self.namespace and self.pod else self.pod
        return GpuName(self.node or self.instance, self.instance, self.gpu, self.uuid, held, self.job)

    def label(self) -> str:
        """``instance/gpu`` with the UUID, as the report names the GPU."""
        return f"{self.instance} GPU {self.gpu or '?'} ({self.uuid or 'no uuid'})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (all but ``index``)."""
        return {k: v for k, v in asdict(self).items() if k != "index"} | {"node": self.node or self.instance}


def chunks(start: float, end: float, step: float, max_points: int = MAX_POINTS) -> list[tuple[float, float]]:
    """``[start, end]`` on the grid of ``step`` in pieces of at most ``max_points`` points each."""
    if max_points < 2:
        raise UsageError("max_points must be at least 2")
    span = (max_points - 1) * step
    out: list[tuple[float, float]] = []
    t = start
    while t <= end:
        last = min(end, t + span)
        last = t + math.floor((last - t) / step + 1e-9) * step
        out.append((t, last))
        t = last + step
    return out


def estimate_step(
    client: PrometheusClient,
    naming: FleetNaming,
    start: float,
    end: float,
    node: str | None,
    series: Sequence[dict[str, str]] | None = None,
) -> float:
    """The scrape interval: the median time between raw samples of a few utilisation series."""
    metric = naming.metric("utilization.gpu")
    if series is None:
        series = client.series([selector(metric, node)], start, end)
    picked = [s for s in series if s.get("__name__") == metric][:3]
    window = min(3600.0, max(end - start, 60.0))
    diffs: list[float] = []
    for labels in picked:
        exact = ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
        for at in (end, min(end, start + window), (start + end) / 2):
            rows = client.query(f"{{{exact}}}[{int(window)}s]", at)
            stamps = sorted(float(p[0]) for r in rows for p in r.get("values", []))
            if len(stamps) >= 3:  # raw stamps, not counts: a window's left end counts in Prometheus 2, not 3
                diffs.append(statistics.median(b - a for a, b in itertools.pairwise(stamps)))
                break
    if not diffs:
        raise PrometheusError(
            f"too few samples of {metric} between the times to tell the scrape interval; give a longer range"
        )
    return round(float(statistics.median(diffs)), 3)


def fleet_frame(
    client: PrometheusClient,
    start: float,
    end: float,
    *,
    namings: Sequence[str] | None = None,
    node: str | None = None,
    namespace: str | None = None,
    pod: str | None = None,
    uuids: Collection[str] | None = None,
    step: float | None = None,
    max_points: int = MAX_POINTS,
    fields: Sequence[str] = FLEET_FIELDS,
) -> pd.DataFrame:
    """The GPUs of the fleet between ``start`` and ``end`` (Unix seconds) as a recording's DataFrame.

    It has a recording's columns (``timestamp``, ``index``, ``uuid``, ``name``, the fields) plus ``instance``,
    ``namespace`` and ``pod``; ``index`` numbers the GPUs 0..N-1 in (instance, GPU index) order, and
    ``attrs["gpus"]`` (:func:`gpu_names`) and ``attrs["gpu_names"]`` (what the report names them by) say which GPU
    each number is.

    Args:
        client: the server.
        start: Unix seconds.
        end: Unix seconds.
        namings: only these namings (default: every one holding series in the range).
        node: only instances matching this regex (anchored, as in PromQL).
        namespace: only GPUs attributed to a namespace matching this regex (any time in the range).
        pod: only GPUs attributed to a pod matching this regex.
        uuids: only GPUs with these UUIDs (a Slurm job's: :func:`smiquery.fleet.slurm.job_range`).
        step: the scrape interval, which sizes the chunks (default: estimated from the data).
        max_points: scrape intervals per chunk (at most 11,000, as a range query could hold).
        fields: nvidia-smi fields to read (each naming's metric for it; missing ones are left out); the
            :data:`~smiquery.fleet.naming.EXTRA_FIELDS` the server holds are read too.

    Raises:
        UsageError: ``end`` not after ``start``; a regex that does not compile.
        PrometheusError: no GPU series in the range (or none left after the filters).
        PrometheusUnreachableError, PrometheusQueryError: see :class:`PrometheusClient`.
    """
    if not end > start:
        raise UsageError("--end must be after --start")
    for pattern, what in ((node, "--node"), (namespace, "--namespace"), (pod, "--pod")):
        check_regex(pattern, what)
    found = detect_namings(client, start, end, namings, node)
    series = client.series([selector(n.metric("utilization.gpu"), node) for n in found], start, end)
    if step is None:
        step = min(estimate_step(client, n, start, end, node, series) for n in found)
    if not step > 0:
        raise UsageError("step must be more than 0 seconds")
    grid0 = math.floor(start / step) * step  # on the grid of the step, as the samples of a fixed scrape are
    per_query = max(2, min(max_points, _MAX_SAMPLES // max(1, len(series))))
    pieces = chunks(grid0, end, step, per_query)

    held = held_metrics(client, [n.metric(f) for n in found for f in EXTRA_FIELDS], start, end, node)
    fields = [*fields, *(f for f in EXTRA_FIELDS if f not in fields and any(n.metric(f) in held for n in found))]
    reads: dict[str, tuple[FleetNaming, str]] = {}  # metric -> its first naming and field: each metric read once
    for n in found:
        for fld in fields:
            if fld in n.metrics and (fld in FLEET_FIELDS or n.metric(fld) in held):
                reads.setdefault(n.metric(fld), (n, fld))
    jobs = [(n, fld, a, b) for n, fld in reads.values() for a, b in pieces]

    def expr(job: tuple[FleetNaming, str, float, float]) -> str:
        # the raw samples: a range selector over the chunk, one millisecond more than the span (the window is open on
        # the left in Prometheus 3); a sample on a boundary that a server gives twice is read once
        n, fld, a, b = job
        return f"{selector(n.metric(fld), node)}[{max(1, round((b - a + step) * 1000) - 1)}ms]"

    # The answers are fetched ahead of their parsing, as many at once as fit _AHEAD_BYTES (a sample is about 22
    # bytes of JSON): the server writes them while pandas and pyarrow are imported and the earlier ones parsed.
    per_answer = 22 * max(1, len(series) // max(1, len(found))) * (min(per_query, (end - grid0) / step) + 1)
    ahead = max(4, int(_AHEAD_BYTES // per_answer))
    with ThreadPoolExecutor(max_workers=4) as pool:
        span = f"{int(end - start) + 1}s"
        info_futures = {n.name: pool.submit(info_labels, client, n, node, end, span) for n in found}
        fetched = deque(pool.submit(client.query_raw, expr(job), job[3]) for job in jobs[:ahead])
        # imported while the server answers (pandas takes a third of a second)
        import numpy as np
        import pandas as pd

        from smiquery.fields import resolve_fields
        from smiquery.frames import make_frame, string_dtype

        results: list[list[dict[str, Any]]] = []
        for i, job in enumerate(jobs):
            series_of = client.samples(fetched.popleft().result(), expr(job))  # the answer's bytes go once parsed
            if i + ahead < len(jobs):
                nxt = jobs[i + ahead]
                fetched.append(pool.submit(client.query_raw, expr(nxt), nxt[3]))
            results.append([{"metric": labels, "times": t, "nums": v} for labels, t, v in series_of])
        infos = {name: fut.result() for name, fut in info_futures.items()}

    # GPU -> field -> list of (times, values); identity labels per GPU
    data: dict[GpuKey, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = {}
    ident: dict[GpuKey, dict[str, str]] = {}
    read = ((n, fld, result) for (n, fld, _, _), result in zip(jobs, results, strict=True))
    for n, fld, key, s in gpu_series(read, infos, ident):
        nums = s["nums"] * n.factor(fld)
        nums[~np.isfinite(nums)] = np.nan
        data.setdefault(key, {}).setdefault(fld, []).append((s["times"], nums))
    keys = sorted(data, key=GpuKey.sort_key)
    for pattern, what in ((namespace, "namespace"), (pod, "pod")):
        if pattern is not None:
            rx = re.compile(pattern)
            keys = [k for k in keys if rx.fullmatch(ident[k][what]) is not None]
    if uuids is not None:
        keys = [k for k in keys if k.uuid in uuids]
    if not keys:
        raise PrometheusError(
            "no GPU series in Prometheus for that range and those filters; check --start/--end, --node, "
            "--namespace and --pod"
        )
    present = [f for f in fields if any(f in data[k] for k in keys)]
    cat = resolve_fields(["timestamp", "index", "uuid", "name", *present])
    stamp_parts: list[np.ndarray] = []
    value_parts: dict[str, list[np.ndarray]] = {f: [] for f in present}
    per_gpu: list[FleetGpuInfo] = []
    lengths: list[int] = []
    for i, key in enumerate(keys):
        by_field = data[key]
        parts = [p for got in by_field.values() for p in got]
        # one chunk whose fields were all scraped together (the usual case): their times are the rows
        same = len(parts) == len(by_field) and all(np.array_equal(t, parts[0][0]) for t, _ in parts)
        times = parts[0][0] if same else np.unique(np.concatenate([t for t, _ in parts]))
        inside = (times >= grid0 - step) & (times <= end)
        times = times[inside]
        stamp_parts.append(times)
        lengths.append(len(times))
        for f in present:
            got = by_field.get(f, [])
            if same and got:
                value_parts[f].append(got[0][1][inside])
                continue
            col = np.full(len(times), np.nan)
            for t, v in got:
                keep = (t >= grid0 - step) & (t <= end)
                col[np.searchsorted(times, t[keep])] = v[keep]
            value_parts[f].append(col)
        per_gpu.append(FleetGpuInfo(i, key.instance, key.gpu, key.uuid, **ident[key]))
    seconds = np.concatenate(stamp_parts)
    stamps = pd.to_datetime(np.round(seconds * 1000).astype(np.int64), unit="ms", utc=True).as_unit("ns")
    text = string_dtype()
    rows_of = np.repeat(np.arange(len(keys)), lengths)

    def per_row(per_gpu_values: list[Any]) -> Any:
        # one string per GPU, taken for each of its rows (not a Python string per row to convert)
        return pd.array(per_gpu_values, dtype=text).take(rows_of)

    columns: list[Any] = [
        stamps.array,
        pd.array(rows_of, dtype="Int64"),
        per_row([k.uuid or pd.NA for k in keys]),
        per_row([g.name or pd.NA for g in per_gpu]),
    ]
    for spec in cat[4:]:
        values = np.concatenate(value_parts[spec.name])
        if spec.kind.name == "FLOAT":
            columns.append(pd.array(values, dtype="Float64"))
        elif spec.kind.is_bool:  # a flag written as 1/0
            columns.append(pd.array(values, dtype="Float64").astype("boolean"))
        else:
            columns.append(pd.array(np.round(values), dtype="Float64").astype("Int64"))
    df = make_frame(cat, columns, {}, None)
    df["instance"] = per_row([k.instance for k in keys])
    df["namespace"] = per_row([g.namespace for g in per_gpu])
    df["pod"] = per_row([g.pod for g in per_gpu])
    df.attrs["gpus"] = _Fixed({g.index: g for g in per_gpu})
    df.attrs["gpu_names"] = _Fixed({g.index: g.gpu_name() for g in per_gpu})  # the report names GPUs by these
    df.attrs["step"] = step
    return df


class _Fixed(dict):  # type: ignore[type-arg]
    """A mapping never changed once made: pandas deep-copies a frame's attrs at every operation, this one is shared."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Fixed:
        return self


def gpu_names(df: pd.DataFrame) -> dict[int, FleetGpuInfo]:
    """Which GPU each ``index`` of a :func:`fleet_frame` is (empty for a recording)."""
    got = df.attrs.get("gpus")
    return dict(got) if isinstance(got, dict) else {}
