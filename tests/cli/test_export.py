"""`smiquery export`'s choices are the exporter's own, and SIGTERM/SIGINT map to the documented exit codes."""

from __future__ import annotations

import signal
from typing import get_args

import pytest

from smiquery.cli._signals import exit_code_of
from smiquery.cli.export import LogFormat, Naming


def test_naming_and_log_format_choices_are_the_exporters() -> None:
    pytest.importorskip("prometheus_client", reason="the exporter needs the export extra")
    from smiquery.exporter.events import LogFormat as ExporterLogFormat
    from smiquery.exporter.naming import Naming as ExporterNaming

    assert get_args(Naming) == get_args(ExporterNaming)
    assert get_args(LogFormat) == get_args(ExporterLogFormat)


def test_signals_exit_with_the_documented_codes() -> None:
    assert exit_code_of(signal.SIGINT) == 130
    assert exit_code_of(signal.SIGTERM) == 143


def test_details_interval_takes_off_and_refuses_a_negative() -> None:
    pytest.importorskip("prometheus_client", reason="the exporter needs the export extra")
    from typer.testing import CliRunner

    from smiquery.cli import app

    help_text = " ".join(CliRunner().invoke(app, ["export", "--help"]).output.split())
    assert "--details-interval" in help_text and "--kernel-log" in help_text and "--top-processes-by" in help_text
    bad = CliRunner().invoke(app, ["export", "--details-interval", "-1"])
    assert bad.exit_code == 2 and "--details-interval" in bad.output
    bad = CliRunner().invoke(app, ["export", "--details-interval", "soon"])
    assert bad.exit_code == 2
    # "off" and 0 parse (the next bad option is what is refused, before anything starts)
    for off in ("off", "0"):
        later = CliRunner().invoke(app, ["export", "--details-interval", off, "--port", "70000"])
        assert later.exit_code == 2 and "--port" in later.output and "--details-interval" not in later.output


def test_help_names_the_real_probe_endpoints_with_examples() -> None:
    from typer.testing import CliRunner

    from smiquery.cli import app

    out = CliRunner().invoke(app, ["export", "--help"], terminal_width=100).stdout
    assert "/livez" in out and "/readyz" in out and "Examples:" in out
    examples = [ln.strip() for ln in out.split("Examples:", 1)[1].splitlines() if ln.strip()]
    assert "curl -fsS localhost:9849/readyz" in examples
