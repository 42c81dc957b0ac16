"""``--query-compute-apps``: which compute process holds memory on which GPU (``processes()``, ``processes_df()``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from smiquery.errors import ParseError
from smiquery.kinds import missing_reason
from smiquery.runner import default_runner, find_nvidia_smi
from smiquery.sources.query_gpu import DEFAULT_TIMEOUT, judge_exit, query
from smiquery.streams.argv import GpusArg, normalize_gpus

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping

    import pandas as pd

    from smiquery.runner import Runner

__all__ = ["GpuProcess", "processes", "processes_df"]


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory (``used_memory``, MiB) on a GPU.

    ``gpu_index`` is joined from ``--query-gpu`` (None if that GPU was not listed); ``missing``: field -> reason.
    """

    pid: int
    process_name: str
    gpu_uuid: str
    gpu_index: int | None
    used_memory: int | None
    missing: dict[str, str] = field(default_factory=dict)


_APPS_FIELDS = "pid,process_name,gpu_uuid,used_memory"


def _parse_apps(stdout: str, index_of: Mapping[str | None, int | None]) -> list[GpuProcess]:
    rows = []
    for lineno, line in enumerate(stdout.splitlines(), 1):
        line = line.rstrip("\r\n\t ")
        if not line or line.startswith(("WARNING:", "ERROR:")):
            continue  # exit 14 adds "WARNING: infoROM is corrupted at gpu ..." after the rows
        cells = line.split(", ")
        if len(cells) < 4:
            raise ParseError("expected 4 columns (pid, process_name, gpu_uuid, used_memory)", lineno=lineno, line=line)
        # process_name is the only free-text column; nvidia-smi does not quote, so rejoin surplus cells into it.
        pid_s, name, uuid, mem_s = cells[0], ", ".join(cells[1:-2]), cells[-2].strip(), cells[-1]
        try:
            pid = int(pid_s)
        except ValueError:
            raise ParseError(f"{pid_s!r} is not a pid", lineno=lineno, line=line, field="pid") from None
        reason = missing_reason(mem_s)
        try:
            mem = None if reason is not None else int(mem_s.removesuffix(" MiB"))
        except ValueError:
            raise ParseError(f"{mem_s!r} is not MiB", lineno=lineno, line=line, field="used_memory") from None
        missing = {"used_memory": reason} if reason is not None else {}
        rows.append(GpuProcess(pid, name, uuid, index_of.get(uuid), mem, missing))
    return rows


def processes(
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> list[GpuProcess]:
    """The compute processes on each GPU with their memory: the answer to "which job holds this memory?".

    Runs ``--query-compute-apps`` and joins each row to its GPU's index, sorted by index, then pid (an idle machine
    has none). Exit 14 keeps the rows and warns. ``gpus`` keeps only those GPUs; ``timeout`` bounds each call. The
    arguments and errors are :func:`smiquery.query`'s.
    """
    ids = normalize_gpus(gpus)
    runner = runner or default_runner()
    binary = find_nvidia_smi(nvidia_smi, runner=runner)
    gpu_rows = query(["index", "uuid"], gpus=ids or None, nvidia_smi=binary, timeout=timeout, runner=runner)
    by_uuid = {s.uuid: s.index for s in gpu_rows}
    argv = [binary, "--query-compute-apps=" + _APPS_FIELDS, "--format=csv,noheader,nounits"]
    done = judge_exit(argv, runner.run(argv, timeout), "rows")
    out = [p for p in _parse_apps(done.stdout, by_uuid) if not ids or p.gpu_uuid in by_uuid]
    out.sort(key=lambda p: (p.gpu_index if p.gpu_index is not None else 1 << 30, p.pid))
    return out


def processes_df(
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> pd.DataFrame:
    """Like :func:`processes`, as a DataFrame with columns gpu_index, gpu_uuid, pid, process_name, used_memory.

    Named and typed as every smiquery DataFrame (:func:`smiquery.query_df`): snake_case columns, nullable dtypes
    (``Int64``, ``string``), units in ``df.attrs["units"]``, why a cell is missing in ``df.attrs["missing"]``.
    """
    import pandas as pd

    from smiquery.frames import MissingReasons, int_array, string_dtype

    rows = processes(gpus=gpus, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner)
    text = string_dtype()
    df = pd.DataFrame(
        {
            "gpu_index": int_array([p.gpu_index for p in rows]),
            "gpu_uuid": pd.array([p.gpu_uuid for p in rows], dtype=text),
            "pid": int_array([p.pid for p in rows]),
            "process_name": pd.array([p.process_name for p in rows], dtype=text),
            "used_memory": int_array([p.used_memory for p in rows]),
        }
    )
    df.attrs["units"] = {"used_memory": "MiB"}
    # used_memory is the one value that can be missing
    missing = {i: p.missing["used_memory"] for i, p in enumerate(rows) if "used_memory" in p.missing}
    df.attrs["missing"] = MissingReasons.from_dicts({"used_memory": missing})
    return cast("pd.DataFrame", df)
