"""A time range of the fleet as the DataFrame a recording gives, for :func:`smiquery.analysis.report` and the plot.

:func:`fleet_frame` reads the raw samples as scraped (range selectors, ``metric[Nms]``: no lookback carries a lost
GPU's last value on), in chunks; a series that held one value over a chunk comes as its count and value.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections import Counter, defaultdict, deque
from collections.abc import Collection, Iterable, Sequence
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
# Read raw without asking first whether they held still: they change on a working GPU. The first one's samples
# give the times of a GPU's steady series.
_VARYING = ("utilization.gpu", "temperature.gpu", "power.draw")


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
        PrometheusError: no GPU series in the range (or none left after the filters); the client's errors.
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

    def window(job: tuple[FleetNaming, str, float, float]) -> str:
        # the chunk, one millisecond more than the span (the window is open on the left in Prometheus 3); a sample on
        # a boundary that a server gives twice is read once
        return f"[{max(1, round((job[3] - job[2] + step) * 1000) - 1)}ms]"

    def expr(job: tuple[FleetNaming, str, float, float], skip: str = "") -> str:  # the raw samples
        return f"{selector(job[0].metric(job[1]), node, skip)}{window(job)}"

    def fetch(job: tuple[FleetNaming, str, float, float]) -> tuple[bytes | None, list[dict[str, Any]]]:
        # the steady series (one value over the chunk) as their count and value; the others' raw samples
        n, fld, a, b = job
        if fld in _VARYING:
            return client.query_raw(expr(job), b), []
        steady, skip = _steady(client, n.metric(fld), n, node, window(job), min(b - a + step, 4 * step), b)
        return (None if skip is None else client.query_raw(expr(job, skip), b)), steady

    # The answers are fetched ahead of their parsing, as many at once as fit _AHEAD_BYTES (a sample is about 22
    # bytes of JSON): the server writes them while pandas and pyarrow are imported and the earlier ones parsed.
    per_answer = 22 * max(1, len(series) // max(1, len(found))) * (min(per_query, (end - grid0) / step) + 1)
    ahead = max(4, int(_AHEAD_BYTES // per_answer))
    with ThreadPoolExecutor(max_workers=4) as pool:
        span = f"{int(end - start) + 1}s"
        info_futures = {n.name: pool.submit(info_labels, client, n, node, end, span) for n in found}
        fetched = deque(pool.submit(fetch, job) for job in jobs[:ahead])
        # imported while the server answers (pandas takes a third of a second)
        import numpy as np
        import pandas as pd

        from smiquery.fields import resolve_fields
        from smiquery.frames import make_frame, string_dtype

        results: list[list[dict[str, Any]]] = []
        for i, job in enumerate(jobs):
            raw, steady = fetched.popleft().result()
            series_of = [] if raw is None else client.samples(raw, expr(job))  # the answer's bytes go once parsed
            del raw
            if i + ahead < len(jobs):
                fetched.append(pool.submit(fetch, jobs[i + ahead]))
            parsed = [{"metric": labels, "times": t, "nums": v} for labels, t, v in series_of]
            results.append([*parsed, *steady])
        infos = {name: fut.result() for name, fut in info_futures.items()}

    # GPU -> field -> list of (chunk, times, values); identity labels per GPU
    data: dict[GpuKey, dict[str, list[tuple[float, np.ndarray, np.ndarray]]]] = defaultdict(lambda: defaultdict(list))
    ident: dict[GpuKey, dict[str, str]] = {}
    held_still: list[tuple[FleetNaming, str, GpuKey, dict[str, Any]]] = []
    read = ((n, fld, [s | {"at": a, "to": b} for s in result]) for (n, fld, a, b), result in zip(jobs, results))
    for n, fld, key, s in gpu_series(read, infos, ident):
        if "count" in s:
            held_still.append((n, fld, key, s))
        else:
            data[key][fld].append((s["at"], s["times"], _values(s["nums"], n.factor(fld))))
    for n, fld, key, s in held_still:
        ref = next((t for at, t, _ in data.get(key, {}).get(_VARYING[0], []) if at == s["at"]), None)
        if ref is not None and len(ref) == s["count"]:  # scraped with the utilisation: the same times
            data[key][fld].append((s["at"], ref, np.full(len(ref), s["value"] * n.factor(fld))))
            continue
        # not scraped with every utilisation sample (rare): its own raw samples
        name, uuid = n.uuid_of(s["metric"])
        own = expr((n, fld, s["at"], s["to"]), f"{name}={json.dumps(uuid)}")
        for labels, t, v in client.samples(client.query_raw(own, s["to"]), own):
            if labels.get("instance", "") == key.instance:
                data[key][fld].append((s["at"], t, _values(v, n.factor(fld))))
    checks = [(re.compile(p), what) for p, what in ((namespace, "namespace"), (pod, "pod")) if p is not None]
    keys = [
        k
        for k in sorted(data, key=GpuKey.sort_key)
        if (uuids is None or k.uuid in uuids) and all(rx.fullmatch(ident[k][what]) for rx, what in checks)
    ]
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
    for i, key in enumerate(keys):
        by_field = {f: [(t, v) for _, t, v in sorted(got, key=lambda p: p[0])] for f, got in data[key].items()}
        parts = [p for got in by_field.values() for p in got]
        # one chunk whose fields were all scraped together (the usual case): their times are the rows
        same = len(parts) == len(by_field) and all(np.array_equal(t, parts[0][0]) for t, _ in parts)
        times = parts[0][0] if same else np.unique(np.concatenate([t for t, _ in parts]))
        inside = (times >= grid0 - step) & (times <= end)
        times = times[inside]
        stamp_parts.append(times)
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
    millis = np.round(np.concatenate(stamp_parts) * 1000).astype(np.int64)
    stamps = pd.to_datetime(millis, unit="ms", utc=True).as_unit("ns")
    text = string_dtype()
    rows_of = np.repeat(np.arange(len(keys)), [len(t) for t in stamp_parts])

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
        else:  # whole numbers, or flags written as 1/0
            columns.append(
                pd.array(np.round(values), dtype="Float64").astype("boolean" if spec.kind.is_bool else "Int64")
            )
    df = make_frame(cat, columns, {}, None)
    for what in ("instance", "namespace", "pod"):
        df[what] = per_row([getattr(g, what) for g in per_gpu])
    df.attrs["gpus"] = _Fixed({g.index: g for g in per_gpu})
    df.attrs["gpu_names"] = _Fixed({g.index: g.gpu_name() for g in per_gpu})  # the report names GPUs by these
    df.attrs["step"] = step
    return df


def _values(nums: np.ndarray, factor: float) -> np.ndarray:
    import numpy as np

    out = nums * factor
    out[~np.isfinite(out)] = np.nan
    return out


def _steady(
    client: PrometheusClient, metric: str, naming: FleetNaming, node: str | None, window: str, last: float, at: float
) -> tuple[list[dict[str, Any]], str | None]:
    """The series of ``metric`` that held one value over ``window`` (``[Nms]``) up to ``at``; a matcher for the rest.

    Each steady series comes as ``{"metric": labels, "count": samples, "value": v}``; only a series that its UUID
    label names alone counts. The matcher (``uuid!~"..."``, or "" for all) selects the other series, to be read
    raw; it is None when there are none. ``last``: seconds before ``at`` where the series' value is looked for.
    """
    raw = f"{selector(metric, node)}{window}"
    value = f"max_over_time({selector(metric, node)}[{max(1, round(last * 1000))}ms])"
    changes: dict[tuple[tuple[str, str], ...], float] = {}
    values: dict[tuple[tuple[str, str], ...], float] = {}
    for row in client.query(f'changes({raw}) or label_replace({value}, "smiquery_of", "value", "", "")', at):
        labels = dict(row.get("metric", {}))
        into = values if labels.pop("smiquery_of", "") else changes
        into[tuple(sorted(labels.items()))] = float(row["value"][1])
    owners = Counter(naming.uuid_of(dict(series)) for series in changes)
    held: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {}  # UUID label -> its value -> the series
    for series, changed in changes.items():
        name, uuid = naming.uuid_of(dict(series))
        if changed == 0 and series in values and name and owners[name, uuid] == 1:
            held.setdefault(name, {})[uuid] = series
    steady: list[dict[str, Any]] = []
    skipped: dict[str, list[str]] = {}  # UUID label -> the values of the steady series, left out of the raw read
    for name, of in held.items():
        only = f"{name}=~{_alternatives(of)}"
        for row in client.query(f"count_over_time({selector(metric, node, only)}{window})", at):
            uuid = row.get("metric", {}).get(name, "")
            got = of.get(uuid)
            if got is not None and tuple(sorted(row["metric"].items())) == got:
                steady.append({"metric": dict(got), "count": int(float(row["value"][1])), "value": values[got]})
                skipped.setdefault(name, []).append(uuid)
    if len(steady) == len(changes):
        return steady, None
    return steady, ",".join(f"{name}!~{_alternatives(of)}" for name, of in skipped.items())


def _alternatives(values: Iterable[str]) -> str:
    """A PromQL string of a regex that matches exactly ``values``."""
    return json.dumps("|".join(re.escape(v) for v in sorted(values)))


class _Fixed(dict):  # type: ignore[type-arg]
    """A mapping never changed once made: pandas deep-copies a frame's attrs at every operation, this one is shared."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Fixed:
        return self


def gpu_names(df: pd.DataFrame) -> dict[int, FleetGpuInfo]:
    """Which GPU each ``index`` of a :func:`fleet_frame` is (empty for a recording)."""
    got = df.attrs.get("gpus")
    return dict(got) if isinstance(got, dict) else {}
