"""``smiquery report`` and ``smiquery plot`` over a time range of the fleet: the command line's hook."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from smiquery.errors import UsageError
from smiquery.fleet.client import DEFAULT_MAX_ANSWER_BYTES, PrometheusClient, load_http_config, parse_time
from smiquery.fleet.history import fleet_frame, gpu_names
from smiquery.fleet.slurm import JOB_LOOKBACK, SlurmJob, host_pattern, job_range

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["load_range", "name_gpus", "range_name"]


def load_range(
    url: str,
    start: str | None,
    end: str | None,
    *,
    node: str | None = None,
    namespace: str | None = None,
    pod: str | None = None,
    slurm_job: str | None = None,
    http_config: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
    max_answer_bytes: int | None = None,
) -> pd.DataFrame:
    """The fleet between ``start`` and ``end`` (Unix seconds, RFC 3339, ``now-2h``; end default now).

    ``slurm_job``: only the GPUs that Slurm job held, over the job's own time range (the first and the last
    sample of its ``smiquery_gpu_allocation_info``; ``start`` then only bounds the search and defaults to 30 days
    back). ``timeout`` bounds each whole answer; ``max_answer_bytes`` caps each (None: the client's default).

    Raises:
        UsageError: no ``--start``, a time that is not one, ``--end`` before ``--start``.
        PrometheusError: see :func:`smiquery.fleet.history.fleet_frame`.
    """
    if start is None and slurm_job is None:
        raise UsageError("--prometheus needs --start (Unix seconds, RFC 3339 or now-2h)")
    config = load_http_config(http_config) if http_config is not None else None
    limit = DEFAULT_MAX_ANSWER_BYTES if max_answer_bytes is None else max_answer_bytes
    client = PrometheusClient(url, config=config, timeout=timeout, max_answer_bytes=limit)
    t1 = parse_time(end if end is not None else "now", what="--end")
    if slurm_job is None:
        return fleet_frame(client, parse_time(start or "", what="--start"), t1, node=node, namespace=namespace, pod=pod)
    t0 = parse_time(start, what="--start") if start is not None else t1 - JOB_LOOKBACK
    job = job_range(client, slurm_job, t0, t1)
    last = job.end if job.end > job.start else job.start + (job.step or 1.0)
    node = node if node is not None else host_pattern(job.gpus)
    uuids = {g.uuid for g in job.gpus}
    df = fleet_frame(client, job.start, last, node=node, namespace=namespace, pod=pod, uuids=uuids, step=job.step)
    df.attrs["slurm_job"] = job
    return df


def range_name(url: str, df: pd.DataFrame) -> str:
    """What to call the range in the report: the server and the GPUs' nodes."""
    nodes = sorted({g.instance for g in gpu_names(df).values()})
    shown = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
    job = df.attrs.get("slurm_job")
    what = f"{job.title()}: " if isinstance(job, SlurmJob) else ""
    return f"{url} ({what}{len(gpu_names(df))} GPUs on {shown})"


def name_gpus(text: str, fmt: str, df: pd.DataFrame) -> str:
    """The rendered report with which instance and UUID each GPU number is (JSON: ``gpu_names``).

    A recording's frame (no fleet identities) gives ``text`` back unchanged, and so does an unknown format.
    """
    names = gpu_names(df)
    if not names:
        return text
    if fmt == "json":
        doc = json.loads(text)
        doc["gpu_names"] = {str(i): g.to_dict() for i, g in names.items()}
        return json.dumps(doc, indent=2) + "\n"
    rows = [(i, g, f"{g.namespace}/{g.pod}" if g.pod else "") for i, g in names.items()]
    if fmt == "markdown":
        lines = ["", "## GPUs", "", "| GPU | instance | index | UUID | model | namespace/pod |", "|---" * 6 + "|"]
        lines += [f"| {i} | {g.instance} | {g.gpu} | {g.uuid} | {g.name} | {pod} |" for i, g, pod in rows]
    elif fmt == "text":
        lines = ["", "GPUs:"]
        for i, g, pod in rows:
            gpu = f"{g.instance} GPU {g.gpu or '?'} ({g.uuid or 'no uuid'})"
            lines.append(f"  {i:>3}  {gpu}  {g.name}{'  ' + pod if pod else ''}")
    else:
        return text
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
