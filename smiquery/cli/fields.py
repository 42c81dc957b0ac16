"""``smiquery fields``: the field catalogue, and what this machine's driver supports."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from smiquery.cli._boundary import boundary
from smiquery.cli._common import FormatOpt, app, settings_of
from smiquery.cli._options import choose_format
from smiquery.errors import UsageError
from smiquery.fields import PRESETS, Field, resolve_fields

__all__ = ["fields_cmd"]


@app.command(
    name="fields",
    epilog="""\b
Examples:
  smiquery fields --preset health
  smiquery fields --search power
  smiquery fields --supported          asks this machine's driver
""",
)
def fields_cmd(
    ctx: typer.Context,
    preset: Annotated[
        str | None, typer.Option("--preset", "-p", metavar="NAME", help=f"Only this preset ({', '.join(PRESETS)}).")
    ] = None,
    supported: Annotated[
        bool,
        typer.Option("--supported", help="Ask this machine's nvidia-smi (--help-query-gpu) and mark what it lacks."),
    ] = False,
    search: Annotated[
        str | None, typer.Option("--search", "-s", metavar="WORD", help="Only fields whose name or help has WORD.")
    ] = None,
    fmt: FormatOpt = None,
) -> None:
    """List the fields: names, units, kinds and help.

    `--supported` asks this machine's nvidia-smi (`--help-query-gpu`) and marks the fields its driver lacks.
    """
    settings = settings_of(ctx)
    with boundary(settings.debug):
        from smiquery.cli.display import Column, render, terminal_size, use_color
        from smiquery.fields import CATALOGUE

        form = choose_format(fmt, sys.stdout)
        if preset is not None and preset not in PRESETS:
            raise UsageError(f"--preset: unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        chosen: list[Field] = list(resolve_fields(preset) if preset is not None else CATALOGUE)
        driver: dict[str, str] | None = None
        if supported:  # names and aliases from --help-query-gpu, with their descriptions
            from smiquery.doctor import driver_fields
            from smiquery.runner import find_nvidia_smi

            driver = driver_fields(find_nvidia_smi(settings.nvidia_smi), settings.timeout)
        records: list[dict[str, Any]] = [
            {"name": f.name, "kind": f.kind.value, "unit": f.unit, "aliases": list(f.aliases), "help": f.help}
            for f in chosen
        ]
        if driver is not None:
            for r in records:
                r["supported"] = any(n in driver for n in (r["name"], *r["aliases"]))
            if preset is None:  # and the driver's fields the catalogue lacks
                known = {n for f in CATALOGUE for n in (f.name, *f.aliases)}
                records += [
                    {"name": name, "kind": "string", "unit": "", "aliases": [], "help": desc, "supported": True}
                    for name, desc in driver.items()
                    if name not in known
                ]
        if search:
            word = search.lower()
            records = [r for r in records if word in r["name"].lower() or word in r["help"].lower()]
        table = form == "table"
        if table:
            for r in records:
                r["shown"] = r["name"] + (f" ({', '.join(r['aliases'])})" if r["aliases"] else "")
        sup = [Column("supported", style=lambda v: None if v else "firing", table_text=lambda v: "yes" if v else "NO")]
        columns = [
            Column("shown" if table else "name", "name"),
            Column("kind"),
            Column("unit"),
            *([] if table else [Column("aliases")]),
            *(sup if driver is not None else []),
            Column("help"),
        ]
        text = render(records, form, columns=columns, color=use_color(sys.stdout), width=terminal_size(sys.stdout)[0])
        if table and driver is not None:
            lacking = sum(1 for r in records if not r.get("supported"))
            text += f"\n{lacking} of {len(records)} listed fields are not supported by this driver\n"
        sys.stdout.write(text)
        sys.stdout.flush()
