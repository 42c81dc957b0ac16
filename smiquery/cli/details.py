"""``smiquery inspect``: what ``nvidia-smi -q -x`` says about each GPU, typed (MIG, ECC health, processes)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from smiquery.cli._boundary import boundary, warnings_as_lines
from smiquery.cli._common import GpusOpt, app, settings_of
from smiquery.cli._options import parse_gpus
from smiquery.errors import RecordingError
from smiquery.printable import printable

if TYPE_CHECKING:
    from smiquery.sources.details import GpuDetails

__all__ = ["inspect_cmd", "render_details"]


def _mib(value: int | None) -> str:
    return f"{value:,} MiB" if value is not None else "?"


def _why(missing: Mapping[str, str], attr: str) -> str:
    reason = missing.get(attr)
    return f"n/a ({reason})" if reason else "n/a"


def _yes(flag: bool | None) -> str:
    return "?" if flag is None else "yes" if flag else "no"


def render_details(gpus: list[GpuDetails]) -> str:
    """The human summary: a few lines per GPU, then one per MIG instance and process."""
    lines: list[str] = []
    for g in gpus:
        lines.append(f"GPU {g.index}  {g.name or '?'}  {g.uuid or '?'}  {g.pci_bus_id or '?'}")
        free = f" ({_mib(g.memory_free)} free)" if g.memory_free is not None else ""
        lines.append(f"  memory     {_mib(g.memory_used)} used of {_mib(g.memory_total)}{free}")
        if g.clock_event_reasons is None:
            lines.append(f"  clocks     {_why(g.missing, 'clock_event_reasons')}")
        else:
            lines.append(f"  clocks     event reasons: {', '.join(g.clock_event_reasons) or 'none active'}")
        rp, rr = g.retired_pages, g.remapped_rows
        retired = (
            f"{rp.single_bit if rp.single_bit is not None else '-'} single-bit, "
            f"{rp.double_bit if rp.double_bit is not None else '-'} double-bit, pending {_yes(rp.pending)}"
            if rp is not None and (rp.single_bit is not None or rp.double_bit is not None)
            else _why(g.missing, "retired_pages")
            if rp is None
            else "n/a"
        )
        remapped = (
            f"{rr.correctable} correctable, {rr.uncorrectable} uncorrectable, pending {_yes(rr.pending)}, "
            f"failed {_yes(rr.failure)}"
            if rr is not None
            else _why(g.missing, "remapped_rows")
        )
        lines += [f"  retired    {retired}", f"  remapped   {remapped}"]
        if g.mig_mode is not None:
            lines.append(f"  MIG        {g.mig_mode}, {len(g.mig_devices)} instance(s)")
        for d in g.mig_devices:
            lines.append(
                f"    MIG {d.index}  {d.profile or '?'}  {d.uuid or '?'}  GI {d.gpu_instance_id} CI "
                f"{d.compute_instance_id}  {d.sm_count if d.sm_count is not None else '?'} SMs  "
                f"{_mib(d.memory_used)} used of {_mib(d.memory_total)}"
            )
        if g.processes is None:
            lines.append(f"  processes  {_why(g.missing, 'processes')}")
        else:
            lines.append(f"  processes  {len(g.processes)}")
            lines += [f"    pid {p.pid}  {p.type or '?'}  {_mib(p.used_memory)}  {p.name or '?'}" for p in g.processes]
        extra = []
        if g.inforom:
            extra.append("inforom " + ", ".join(f"{k}={v}" for k, v in g.inforom.items()))
        if g.bridge_chip_type or g.bridge_chip_fw:
            extra.append(f"bridge chip {g.bridge_chip_type or '?'} {g.bridge_chip_fw or ''}".rstrip())
        if extra:
            lines.append("  versions   " + "; ".join(extra))
    return "\n".join(lines) + ("\n" if lines else "")


@app.command(
    name="inspect",
    epilog="""\b
Examples:
  smiquery inspect
  smiquery inspect --gpus 0 --format json
  smiquery inspect --xml saved-q-x.xml     a saved `nvidia-smi -q -x` file
""",
)
def inspect_cmd(
    ctx: typer.Context,
    gpus: GpusOpt = None,
    fmt: Annotated[
        Literal["text", "json"], typer.Option("--format", "-o", help="text (a summary per GPU) or json (every value).")
    ] = "text",
    xml: Annotated[
        Path | None, typer.Option(metavar="FILE", help="Read a saved `nvidia-smi -q -x` file instead of running it.")
    ] = None,
) -> None:
    """Details `--query-gpu` cannot give (runs `nvidia-smi -q -x`: 0.4-6 s on big servers).

    MIG instances (with their MIG UUIDs from `nvidia-smi -L`), clock event reasons, retired pages, remapped rows,
    processes with their type, inforom and bridge chip versions.

    Values nvidia-smi does not report are shown as n/a with the reason (null in JSON, reason under "missing").
    """
    settings = settings_of(ctx)
    with boundary(settings.debug):
        from smiquery.sources.details import details, parse_xml

        with warnings_as_lines():
            if xml is not None:
                try:
                    found = parse_xml(xml.read_bytes())
                except OSError as exc:
                    raise RecordingError(f"cannot read {xml}: {exc.strerror or exc}; give a saved -q -x file") from None
            else:
                found = details(parse_gpus(gpus), nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
        if fmt == "json":
            sys.stdout.write(json.dumps([g.to_dict() for g in found], indent=2) + "\n")
        else:
            sys.stdout.write("\n".join(printable(line) for line in render_details(found).split("\n")))
        sys.stdout.flush()
