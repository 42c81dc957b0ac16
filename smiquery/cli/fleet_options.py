"""The ``--prometheus`` options of ``smiquery report`` and ``smiquery plot``: the fleet instead of a recording.

The work is in :mod:`smiquery.fleet`; this module only names the options and picks the source.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "MAX_ANSWER_HELP",
    "EndOpt",
    "HttpConfigOpt",
    "MaxAnswerOpt",
    "NamespaceOpt",
    "NodeOpt",
    "PodOpt",
    "PrometheusOpt",
    "SlurmJobOpt",
    "StartOpt",
    "read_source",
]

_PANEL = "Fleet (instead of REC)"

PrometheusOpt = Annotated[
    str | None,
    typer.Option(
        "--prometheus",
        "-p",
        metavar="URL",
        rich_help_panel=_PANEL,
        help="Read a time range of the fleet from this Prometheus server instead of a recording (with --start).",
    ),
]
StartOpt = Annotated[
    str | None,
    typer.Option("--start", metavar="TIME", rich_help_panel=_PANEL, help="Start: Unix seconds, RFC 3339 or now-6h."),
]
EndOpt = Annotated[str | None, typer.Option("--end", metavar="TIME", rich_help_panel=_PANEL, help="End (default now).")]
NodeOpt = Annotated[
    str | None,
    typer.Option("--node", metavar="REGEX", rich_help_panel=_PANEL, help="Only instances matching (anchored)."),
]
NamespaceOpt = Annotated[
    str | None,
    typer.Option("--namespace", metavar="REGEX", rich_help_panel=_PANEL, help="Only GPUs of pods in these namespaces."),
]
PodOpt = Annotated[
    str | None, typer.Option("--pod", metavar="REGEX", rich_help_panel=_PANEL, help="Only GPUs of these pods (a job).")
]
SlurmJobOpt = Annotated[
    str | None,
    typer.Option(
        "--slurm-job",
        metavar="ID",
        rich_help_panel=_PANEL,
        help="Only the GPUs this Slurm job held, over the job's own time range (from `export --slurm`'s series; "
        "--start then only bounds the search, default 30 days back).",
    ),
]
HttpConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--http-config",
        metavar="FILE",
        dir_okay=False,
        rich_help_panel=_PANEL,
        help="Credentials and TLS for --prometheus, as promtool's --http.config.file.",
    ),
]

#: Also the help of ``smiquery top --max-answer``.
MAX_ANSWER_HELP = (
    "Largest answer to read from --prometheus, in MiB (default 512, room for a range of thousands of GPUs); a "
    "larger one is an error, read no further."
)
MaxAnswerOpt = Annotated[
    int | None,
    typer.Option("--max-answer", metavar="MIB", min=1, rich_help_panel=_PANEL, help=MAX_ANSWER_HELP),
]


def read_source(
    recording: list[Path],
    load: Callable[[list[Path]], pd.DataFrame],
    label: Callable[[list[Path]], str],
    prometheus: str | None,
    start: str | None,
    end: str | None,
    node: str | None,
    namespace: str | None,
    pod: str | None,
    http_config: Path | None,
    tz: str | None,
    max_answer: int | None = None,
    slurm_job: str | None = None,
) -> tuple[pd.DataFrame, str]:
    """The frame to analyse and its name: the recording (through ``load``) or the range from Prometheus.

    ``max_answer`` is ``--max-answer`` in MiB (None: the client's default); ``slurm_job`` is ``--slurm-job``.

    Raises:
        UsageError: neither or both of REC and --prometheus; fleet options without --prometheus.
    """
    from smiquery.errors import UsageError

    if prometheus is None:
        fleet = {
            "--start": start,
            "--end": end,
            "--node": node,
            "--namespace": namespace,
            "--pod": pod,
            "--slurm-job": slurm_job,
            "--http-config": http_config,
            "--max-answer": max_answer,
        }
        if not recording:
            raise UsageError("give a recording (REC) or --prometheus URL with --start")
        given = [flag for flag, value in fleet.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} goes with --prometheus; a recording is read whole")
        return load(recording), label(recording)
    if recording:
        raise UsageError("give a recording (REC) or --prometheus, not both")
    from smiquery.fleet.report import load_range, range_name

    # the analysis (and pandas) is imported after the queries are sent: the import overlaps the server's answers
    df = load_range(
        prometheus,
        start,
        end,
        node=node,
        namespace=namespace,
        pod=pod,
        slurm_job=slurm_job,
        http_config=http_config,
        max_answer_bytes=None if max_answer is None else max_answer * 2**20,
    )
    from smiquery.analysis import load_recording

    return load_recording(df, tz=tz), range_name(prometheus, df)
