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
