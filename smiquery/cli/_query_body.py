"""The body of ``smiquery query``, free of typer, so that the fast path of :func:`smiquery.cli.main` starts fast."""

from __future__ import annotations

import sys
import warnings

from smiquery.cli._boundary import boundary, warn_lines
from smiquery.cli._options import Format, Settings, choose_format, parse_fields, parse_gpus, unknown_gpus
from smiquery.errors import NoDevicesFoundError

__all__ = ["run_query"]


def run_query(settings: Settings, fields: str | None, gpus: str | None, fmt: Format | None) -> None:
    """Print one snapshot (``smiquery query``).

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
        from smiquery.cli.display import render, terminal_width, use_color
        from smiquery.oneshot import query

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                names = [f.name for f in flds]
                samples = query(names, gpus=ids, nvidia_smi=settings.nvidia_smi, timeout=settings.timeout)
            except NoDevicesFoundError:
                wrong = unknown_gpus(ids, settings)
                if wrong is None:
                    raise
                raise wrong from None
        warn_lines(caught)
        text = render(samples, form, fields=flds, color=use_color(sys.stdout), width=terminal_width(sys.stdout))
        sys.stdout.write(text)
        sys.stdout.flush()
