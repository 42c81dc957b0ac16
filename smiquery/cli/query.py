"""``smiquery query``: one snapshot, one row per GPU."""

from __future__ import annotations

import sys
import warnings

import typer

from smiquery.cli._boundary import boundary, warn_lines
from smiquery.cli._common import (
    FieldsOpt,
    Format,
    FormatOpt,
    GpusOpt,
    Settings,
    app,
    choose_format,
    parse_fields,
    parse_gpus,
    settings_of,
    unknown_gpus,
)
from smiquery.errors import NoDevicesFoundError

__all__ = ["query", "run_query"]


@app.command(
    epilog="""\b
Examples:
  smiquery query
  smiquery query --fields memory --gpus 0,1 --format json
  smiquery query --fields temperature.gpu,power.draw --format csv
"""
)
def query(
    ctx: typer.Context,
    fields: FieldsOpt = None,
    gpus: GpusOpt = None,
    fmt: FormatOpt = None,
) -> None:
    """Print one snapshot: one row per GPU.

    CSV is nvidia-smi's own format (header with units), so `smiquery.read_csv` reads it back. JSON and JSONL
    use field names as keys, ISO 8601 times, and null for missing values (reasons under "_missing").
    """
    run_query(settings_of(ctx), fields, gpus, fmt)


def run_query(settings: Settings, fields: str | None, gpus: str | None, fmt: Format | None) -> None:
    """The body of ``smiquery query`` (also reached by the fast path of :func:`smiquery.cli.main`).

    Args:
        settings: the global options.
        fields: ``--fields``.
        gpus: ``--gpus``.
        fmt: ``--format``.

    Raises:
        typer.Exit: on any error, after one line on stderr.
    """
    with boundary(settings.debug):
        flds = parse_fields(fields)
        ids = parse_gpus(gpus)
        form = choose_format(fmt, sys.stdout)
        from smiquery.display import render, use_color
        from smiquery.oneshot import query as run

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                samples = run(
                    [f.name for f in flds], gpus=ids, nvidia_smi=settings.nvidia_smi, timeout=settings.timeout
                )
            except NoDevicesFoundError:
                wrong = unknown_gpus(ids, settings)
                if wrong is None:
                    raise
                raise wrong from None
        warn_lines(caught)
        sys.stdout.write(render(samples, form, fields=flds, color=use_color(sys.stdout)))
        sys.stdout.flush()
