"""Evidence when an alert fires: one folder with ``nvidia-smi -q -x``, the process list, recent samples, the alert.

:class:`smiquery.alerts.notify.SnapshotHandler` calls :func:`take_snapshot` on its own thread; the CLI reaches it with
``smiquery stream --on-alert snapshot:DIR``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smiquery.alerts.rules import AlertEvent, event_payload
from smiquery.fields import resolve_fields
from smiquery.sources.query_gpu import format_row, header_line

if TYPE_CHECKING:
    from smiquery.runner import Runner
    from smiquery.sample import GpuSample

__all__ = ["take_snapshot"]

_APPS_FIELDS = "gpu_uuid,pid,process_name,used_gpu_memory"
_SLUG_RE = re.compile(r"[^A-Za-z0-9]+")


def _write_capped(path: Path, text: str, max_bytes: int) -> None:
    data = text.encode("utf-8", "replace")
    if len(data) > max_bytes:
        note = f"\n[smiquery: cut at {max_bytes} bytes of {len(data)}]\n".encode()
        data = data[: max_bytes - len(note)] + note
    path.write_bytes(data)


def _folder(directory: str | os.PathLike[str], event: AlertEvent) -> Path:
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%dT%H%M%S")
    slug = _SLUG_RE.sub("-", f"{event.rule.field.attr}-gpu{event.gpu if event.gpu is not None else 'x'}").strip("-")
    for n in range(1000):
        folder = root / f"{stamp}-{slug}" if n == 0 else root / f"{stamp}-{slug}-{n}"
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"cannot create a new snapshot folder under {root}")


def _run(runner: Runner, argv: Sequence[str], timeout: float, out: Path, max_bytes: int) -> None:
    """Save one nvidia-smi call's output; its failure (with stderr) goes to ``<name>.error.txt``."""
    error = out.with_name(out.name + ".error.txt")
    try:
        done = runner.run(argv, timeout)
    except Exception as exc:
        _write_capped(error, f"{' '.join(argv)}\n{exc}\n", max_bytes)
        return
    if done.returncode != 0:
        _write_capped(error, f"{' '.join(argv)}\nexit {done.returncode}\n{done.stderr}\n{done.stdout}", max_bytes)
        return
    _write_capped(out, done.stdout, max_bytes)


def _samples_csv(samples: Sequence[GpuSample], max_bytes: int) -> str:
    """The samples as an nvidia-smi CSV recording, newest rows kept when it would exceed ``max_bytes``."""
    if not samples:
        return ""
    names = samples[-1].fields
    same = [s for s in samples if s.fields == names]  # one schema per file: the newest
    fields = resolve_fields(list(names))
    head = header_line(fields)
    rows: list[str] = []
    size = len(head) + 1
    for s in reversed(same):
        line = format_row(s, fields, units=True)
        size += len(line) + 1
        if size > max_bytes:
            break
        rows.append(line)
    rows.reverse()
    return "\n".join([head, *rows]) + "\n"


def _details_json(folder: Path, max_bytes: int) -> None:
    """``details.json``: the saved ``-q -x`` parsed (:func:`~smiquery.sources.details.parse_xml`), or why not."""
    import warnings

    from smiquery.errors import SmiqueryError
    from smiquery.sources.details import parse_xml

    xml = folder / "nvidia-smi-q.xml"
    if not xml.is_file():
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # an unknown DTD: still read by name
            gpus = parse_xml(xml.read_bytes())
    except SmiqueryError as exc:  # e.g. the XML was cut at max_bytes
        _write_capped(folder / "details.json.error.txt", f"parsing nvidia-smi-q.xml failed: {exc}\n", max_bytes)
        return
    doc = {"gpus": [g.to_dict() for g in gpus]}
    _write_capped(folder / "details.json", json.dumps(doc, indent=2, default=str) + "\n", max_bytes)


def take_snapshot(
    directory: str | os.PathLike[str],
    event: AlertEvent,
    context: Mapping[str, Any] | None = None,
    samples: Sequence[GpuSample] = (),
    *,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = 10.0,
    max_bytes: int = 8 * 2**20,
    runner: Runner | None = None,
) -> str:
    """Write one snapshot folder (``DIR/<time>-<field>-gpu<N>``) and return its path.

    It holds ``alert.json`` (the event and its ``context``), ``nvidia-smi-q.xml`` (``nvidia-smi -q -x``),
    ``details.json`` (that XML parsed by :func:`smiquery.sources.details.parse_xml`), ``processes.csv`` (the compute
    processes) and ``samples.csv`` (the recent ``samples``, oldest first, as a recording ``smiquery report`` reads).
    Each nvidia-smi call is bounded by ``timeout`` and each file by ``max_bytes``; a call that fails leaves
    ``<file>.error.txt`` saying why. ``runner`` runs nvidia-smi (default a real subprocess).

    Raises:
        OSError: the folder cannot be created or written (a full disk): nothing is left behind, no empty folder
            and no truncated ``alert.json``.
    """
    from smiquery.runner import default_runner, find_nvidia_smi  # subprocess, only once a snapshot is taken

    folder = _folder(directory, event)
    try:
        payload = event_payload(event, context)
        payload["samples"] = len(samples)
        _write_capped(folder / "alert.json", json.dumps(payload, indent=2) + "\n", max_bytes)
        csv = _samples_csv(samples, max_bytes)
        if csv:
            _write_capped(folder / "samples.csv", csv, max_bytes)
        try:
            binary = find_nvidia_smi(nvidia_smi, runner=runner)
        except Exception as exc:
            for name in ("nvidia-smi-q.xml", "processes.csv"):
                _write_capped(folder / f"{name}.error.txt", f"{exc}\n", max_bytes)
            return str(folder)
        run = runner or default_runner()
        _run(run, [binary, "-q", "-x"], timeout, folder / "nvidia-smi-q.xml", max_bytes)
        _details_json(folder, max_bytes)
        argv = [binary, f"--query-compute-apps={_APPS_FIELDS}", "--format=csv"]
        _run(run, argv, timeout, folder / "processes.csv", max_bytes)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return str(folder)
