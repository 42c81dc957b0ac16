"""``smiquery query``: one snapshot, one row per GPU."""

from __future__ import annotations

import typer

from smiquery.cli._common import FieldsOpt, FormatOpt, GpusOpt, app, settings_of
from smiquery.cli._query_body import run_query

__all__ = ["query"]


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
