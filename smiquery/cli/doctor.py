"""``smiquery doctor``: renders the checks of :mod:`smiquery.doctor`."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from smiquery.cli._boundary import boundary, cli_text
from smiquery.cli._common import app, settings_of

__all__ = ["doctor"]

_MARKS = {"ok": ("ok", "ok"), "warn": ("WARN", "pending"), "fail": ("FAIL", "firing"), "skip": ("skip", "dim")}


@app.command(
    epilog="""\b
Statuses: FAIL stops monitoring (nvidia-smi missing, the driver not
reachable, a hang, unreadable output); WARN degrades it (persistence mode
off, infoROM, a default field the driver lacks, a container variable that
may explain a failure); each fix is printed once.

\b
Exit status: the code of the first FAIL (3 nvidia-smi missing, 4 driver
problem, 5 timeout, 1 other); else 1 when something WARNs; else 0.
With --gate (for init containers and health checks) warnings exit 0:
only what stops monitoring fails.

\b
Examples:
  smiquery doctor
  smiquery --timeout 3 doctor --gate
  smiquery doctor --json
"""
)
def doctor(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object for machines.")] = False,
    gate: Annotated[
        bool, typer.Option("--gate", help="Exit non-zero only on what stops monitoring (warnings exit 0).")
    ] = False,
) -> None:
    """Diagnose nvidia-smi, the driver and the GPUs, with one fix for each problem.

    Checks: nvidia-smi found (where, which version), driver reachable, driver/library match, GPU count,
    infoROM, persistence mode, MIG mode, container set-up (NVIDIA_DRIVER_CAPABILITIES, NVIDIA_VISIBLE_DEVICES),
    and whether the driver supports the default fields.
    """
    settings = settings_of(ctx)
    with boundary(settings.debug):
        from smiquery.cli.display import paint, use_color
        from smiquery.doctor import exit_code, run_checks

        results = run_checks(settings.nvidia_smi, settings.timeout)
        code = exit_code(results, gate=gate)
        out = sys.stdout
        if as_json:
            doc = {
                "ok": not any(r.failed for r in results),
                "exit_code": code,
                "checks": [
                    {
                        "name": r.name,
                        "status": r.status,
                        "diagnosis": cli_text(r.diagnosis),
                        "fix": cli_text(r.fix) or None,
                    }
                    for r in results
                ],
            }
            out.write(json.dumps(doc, indent=2) + "\n")
        else:
            color = use_color(out)
            lines = []
            printed: set[str] = set()
            for r in results:
                word, style = _MARKS[r.status]
                mark = paint(f"{word:<4}", style, color)
                fix = ""
                if r.fix and r.status in ("warn", "fail"):
                    fix = " -> fix: " + (cli_text(r.fix) if r.fix not in printed else "as above")
                    printed.add(r.fix)
                lines.append(f"{mark}  {r.name}: {cli_text(r.diagnosis)}{fix}")
            failed = sum(1 for r in results if r.failed)
            warned = sum(1 for r in results if r.status == "warn")
            counts = [f"{failed} check{'s' if failed != 1 else ''} failed"] if failed else []
            counts += [f"{warned} warning{'s' if warned != 1 else ''}"] if warned else []
            lines.append(", ".join(counts) or "all checks passed")
            out.write("".join(line + "\n" for line in lines))
        out.flush()
        raise typer.Exit(code)
