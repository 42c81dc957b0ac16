"""One-shot calls: ``query()``, ``processes()`` and ``get_gpu_status()``.

Validates fields and GPU ids before anything runs (:mod:`smiquery.streams.argv`), runs nvidia-smi once through a
:class:`~smiquery.runner.Runner` and parses its output. Long-running streams live in :mod:`smiquery.streams`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from typing import TYPE_CHECKING, Any, cast

from smiquery._log import get_logger
from smiquery.errors import InfoRomWarning, NvidiaSmiFailedError, ParseError, failure_from_exit
from smiquery.fields import Field, resolve_fields
from smiquery.parsing import CsvParser, is_message, missing_reason
from smiquery.runner import Completed, Runner, default_runner, find_nvidia_smi
from smiquery.sample import GpuSample
from smiquery.streams.argv import GpusArg, build_argv, normalize_gpus

if TYPE_CHECKING:
    import os

    import pandas as pd

__all__ = [
    "GpuProcess",
    "check_and_parse",
    "get_gpu_status",
    "processes",
    "processes_df",
    "query",
    "query_df",
]

log = get_logger("smiquery")

#: Seconds a one-shot call waits by default: enough for a cold start without persistence mode, which takes 15-30 s
#: on large hosts and in containers with a huge open-file limit (NVIDIA-SMI.md section 6).
DEFAULT_TIMEOUT = 45.0


def _messages_only(done: Completed, fields: Sequence[Field]) -> str:
    """What nvidia-smi said, without the data rows it printed first (a one-column row is data, not a message)."""
    probe = CsvParser(fields, strict=False)
    said = [ln for ln in done.stdout.splitlines() if ln.strip() and (is_message(ln) or probe.feed(ln) is None)]
    return "\n".join(said) + (("\n" + done.stderr) if done.stderr else "")


def check_and_parse(
    argv: Sequence[str], done: Completed, parser: CsvParser, fields: Sequence[Field]
) -> list[GpuSample]:
    """Judge a finished one-shot call: its typed error, or its rows (exit 14 keeps them and warns)."""
    returncode = done.returncode
    if returncode not in (0, 14):
        raise failure_from_exit(argv, returncode, _messages_only(done, fields))
    try:
        samples = list(parser.parse(done.stdout.splitlines()))
    except ParseError:
        if returncode == 14:
            raise failure_from_exit(argv, returncode, _messages_only(done, fields)) from None
        raise
    if not samples:
        if returncode == 14:
            raise failure_from_exit(argv, returncode, _messages_only(done, fields))
        raise NvidiaSmiFailedError(
            argv,
            returncode,
            done.output,
            "nvidia-smi exited 0 but printed no GPU rows; run plain `nvidia-smi` to see what it prints, "
            "or `smiquery doctor`",
        )
    if returncode == 14:
        notice = parser.notices[0] if parser.notices else "infoROM warning"
        warnings.warn(f"nvidia-smi exited 14 ({notice}); rows returned", InfoRomWarning, stacklevel=3)
    return samples


def query(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
    tz: tzinfo | None = None,
) -> list[GpuSample]:
    """Take one snapshot: one record per GPU.

    Args:
        fields: a preset (``"default"``, ``"health"``, ``"memory"``...), ``"a,b,c"``, or a sequence of names.
        gpus: indices, UUIDs or PCI bus ids; None for all.
        nvidia_smi: path of the binary (default: ``$SMIQUERY_NVIDIA_SMI``, PATH, the usual places).
        timeout: seconds before the child is killed (the default fits a cold start without persistence mode).
        runner: how to run it (tests inject one).
        tz: time zone of the timestamps (default: the host's).

    Returns:
        One record per GPU, in nvidia-smi's order.

    Raises:
        InvalidFieldError: an unknown field (raised before anything runs).
        InvalidGpuIdError: a malformed GPU id (raised before anything runs).
        NvidiaSmiNotFoundError: no usable binary.
        NvidiaSmiTimeoutError: no answer within ``timeout``.
        NvidiaSmiFailedError: a non-zero exit, as its typed subclass.
        ParseError: output that does not fit the fields.
    """
    flds = resolve_fields(fields)
    ids = normalize_gpus(gpus)
    run = runner or default_runner()
    argv = build_argv(find_nvidia_smi(nvidia_smi, runner=run), flds, ids)
    done = run.run(argv, timeout)
    return check_and_parse(argv, done, CsvParser(flds, tz=tz), flds)


def query_df(
    fields: FieldsArg = "default",
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> pd.DataFrame:
    """Like :func:`query`, as a pandas DataFrame (nullable dtypes, units in ``df.attrs["units"]``)."""
    from smiquery.recordings.frames import to_dataframe

    return to_dataframe(query(fields, gpus=gpus, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner))


# ------------------------------------------------------------------------------------------------ processes


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding memory on a GPU.

    Attributes:
        pid: process id (in nvidia-smi's PID namespace).
        process_name: the name or path the driver recorded.
        gpu_uuid: the GPU's UUID (the parent GPU's for a MIG instance).
        gpu_index: the GPU's index, joined from ``--query-gpu``; None if that GPU was not listed.
        used_memory: GPU memory used in MiB; None when nvidia-smi cannot tell (``[N/A]`` on Windows WDDM).
        missing: field -> reason for missing values.
    """

    pid: int
    process_name: str
    gpu_uuid: str
    gpu_index: int | None
    used_memory: int | None
    missing: dict[str, str] = field(default_factory=dict)


_APPS_FIELDS = "pid,process_name,gpu_uuid,used_memory"


def _parse_apps(argv: Sequence[str], stdout: str) -> list[tuple[int, str, str, int | None, dict[str, str]]]:
    rows = []
    for lineno, line in enumerate(stdout.splitlines(), 1):
        line = line.rstrip("\r\n\t ")
        if not line or line.startswith(("WARNING:", "ERROR:")):
            continue  # exit 14 adds "WARNING: infoROM is corrupted at gpu ..." after the rows
        cells = line.split(", ")
        if len(cells) < 4:
            raise ParseError("expected 4 columns (pid, process_name, gpu_uuid, used_memory)", lineno=lineno, line=line)
        # process_name is the only free-text column; nvidia-smi does not quote, so rejoin surplus cells into it.
        pid_s, name, uuid, mem_s = cells[0], ", ".join(cells[1:-2]), cells[-2], cells[-1]
        missing: dict[str, str] = {}
        try:
            pid = int(pid_s)
        except ValueError:
            raise ParseError(f"{pid_s!r} is not a pid", lineno=lineno, line=line, field="pid") from None
        mem: int | None
        reason = missing_reason(mem_s)
        if reason is not None:
            mem = None
            missing["used_memory"] = reason
        else:
            try:
                mem = int(mem_s.removesuffix(" MiB"))
            except ValueError:
                raise ParseError(f"{mem_s!r} is not MiB", lineno=lineno, line=line, field="used_memory") from None
        rows.append((pid, name, uuid.strip(), mem, missing))
    return rows


def processes(
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> list[GpuProcess]:
    """The compute processes on each GPU with their memory: the answer to "which job holds this memory?".

    Runs ``--query-compute-apps`` and joins each row to its GPU's index. An idle machine has no rows, which
    is not an error. Exit 14 (infoROM corrupted) keeps the rows and warns with :class:`InfoRomWarning`.

    Args:
        gpus: only these GPUs (indices, UUIDs or PCI bus ids).
        nvidia_smi: path of the binary.
        timeout: seconds per nvidia-smi call.
        runner: how to run nvidia-smi.

    Returns:
        The processes sorted by GPU index, then pid.

    Raises:
        InvalidGpuIdError, NvidiaSmiNotFoundError, NvidiaSmiTimeoutError, NvidiaSmiFailedError, ParseError.
    """
    ids = normalize_gpus(gpus)
    runner = runner or default_runner()
    binary = find_nvidia_smi(nvidia_smi, runner=runner)
    run = runner.run
    gpu_rows = query(["index", "uuid"], gpus=ids or None, nvidia_smi=binary, timeout=timeout, runner=runner)
    by_uuid = {s.uuid: s.index for s in gpu_rows}
    argv = [binary, "--query-compute-apps=" + _APPS_FIELDS, "--format=csv,noheader,nounits"]
    done = run(argv, timeout)
    if done.returncode not in (0, 14):
        raise failure_from_exit(argv, done.returncode, done.output)
    if done.returncode == 14:
        notice = next((ln for ln in done.stdout.splitlines() if ln.startswith("WARNING:")), "infoROM warning")
        warnings.warn(f"nvidia-smi exited 14 ({notice}); rows returned", InfoRomWarning, stacklevel=2)
    out = []
    for pid, name, uuid, mem, missing in _parse_apps(argv, done.stdout):
        if ids and uuid not in by_uuid:
            continue
        out.append(GpuProcess(pid, name, uuid, by_uuid.get(uuid), mem, missing))
    out.sort(key=lambda p: (p.gpu_index if p.gpu_index is not None else 1 << 30, p.pid))
    return out


def processes_df(
    *,
    gpus: GpusArg = None,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> pd.DataFrame:
    """Like :func:`processes`, as a DataFrame with columns gpu_index, gpu_uuid, pid, process_name, used_memory."""
    import pandas as pd

    rows = processes(gpus=gpus, nvidia_smi=nvidia_smi, timeout=timeout, runner=runner)
    df = pd.DataFrame(
        {
            "gpu_index": pd.array([p.gpu_index for p in rows], dtype="Int64"),
            "gpu_uuid": pd.array([p.gpu_uuid for p in rows], dtype="string"),
            "pid": pd.array([p.pid for p in rows], dtype="Int64"),
            "process_name": pd.array([p.process_name for p in rows], dtype="string"),
            "used_memory": pd.array([p.used_memory for p in rows], dtype="Int64"),
        }
    )
    df.attrs["units"] = {"used_memory": "MiB"}
    return cast("pd.DataFrame", df)


# ------------------------------------------------------------------------------------------- get_gpu_status

_STATUS_FIELDS = ("timestamp", "index", "name", "temperature.gpu", "utilization.gpu", "utilization.memory")
_STATUS_KEYS = {
    "index": "index",
    "name": "name",
    "temperature.gpu": "temperature_c",
    "utilization.gpu": "gpu_util_percent",
    "utilization.memory": "memory_util_percent",
}


def get_gpu_status(
    fields: Sequence[str] | str | None = None,
    *,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> dict[str, Any]:
    """One call for scripts and training loops; never raises for anything nvidia-smi does.

    Success: ``{"success": True, "data": [{"index", "name", "temperature_c", "gpu_util_percent",
    "memory_util_percent", "timestamp"}, ...]}`` (missing values are None; ``timestamp`` is ISO 8601; extra
    ``fields`` add snake_case keys such as ``power_draw``). Failure: ``{"success": False, "error": "<one line>",
    "error_type": "<exception class name>"}``. It returns within ``timeout`` seconds even when nvidia-smi hangs.

    Args:
        fields: extra fields to include (names or a comma list).
        nvidia_smi: path of the binary.
        timeout: the most seconds this call may take.
        runner: how to run nvidia-smi.

    Returns:
        The status dict described above.
    """
    try:
        extra: list[str] = []
        if fields:
            extra = [f.name for f in resolve_fields(fields) if f.name not in _STATUS_FIELDS]
        samples = query([*_STATUS_FIELDS, *extra], nvidia_smi=nvidia_smi, timeout=timeout, runner=runner)
        extra_attrs = [(n, n.replace(".", "_")) for n in extra]
        data = []
        for s in samples:
            ts = s.timestamp
            item: dict[str, Any] = {key: s[name] for name, key in _STATUS_KEYS.items()}
            item["timestamp"] = ts.isoformat(timespec="milliseconds") if ts is not None else None
            for name, attr in extra_attrs:
                value = s[name]
                item[attr] = value.isoformat() if isinstance(value, datetime) else value
            data.append(item)
        return {"success": True, "data": data}
    except Exception as exc:  # the contract: a dict, never an exception
        message = " ".join(str(exc).split()) or type(exc).__name__
        return {"success": False, "error": message, "error_type": type(exc).__name__}
