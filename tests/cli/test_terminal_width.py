"""``query`` and ``fields`` on a terminal fit its width, as a person sees them (tmux of a fixed size)."""

from __future__ import annotations

from tests.cli.screen import Screen
from tests.cli.test_live_view import cli, env


def test_query_fits_80_columns_and_names_what_it_left_out(fake_smi):
    with Screen(cli("--nvidia-smi", fake_smi(), "query"), columns=80, rows=30, env=env()) as screen:
        assert screen.exit_status() == 0
        lines = screen.final_text().rstrip().splitlines()
    assert all(len(line) <= 80 for line in lines) and not any(line.endswith("…") for line in lines)
    assert lines[0].split()[:3] == ["timestamp", "gpu", "temp"]
    assert len([line for line in lines if "81559" in line]) == 8  # one row per GPU, none wrapped
    assert lines[-1].startswith("hidden (terminal too narrow): uuid, name")


def test_query_on_a_wide_terminal_shows_every_column(fake_smi):
    with Screen(cli("--nvidia-smi", fake_smi(), "query"), columns=250, rows=30, env=env()) as screen:
        assert screen.exit_status() == 0
        text = screen.final_text()
    assert "uuid" in text.splitlines()[0] and "hidden" not in text


def test_fields_fit_80_columns_with_the_help_under_each_name():
    with Screen(cli("fields", "--search", "power.draw"), columns=80, rows=40, env=env()) as screen:
        assert screen.exit_status() == 0
        lines = screen.final_text().rstrip().splitlines()
    assert all(len(line) <= 80 for line in lines) and not any(line.endswith("…") for line in lines)
    at = next(i for i, line in enumerate(lines) if line.split()[:3] == ["power.draw", "float", "W"])
    assert lines[at + 1].startswith("    Power drawn by the GPU")  # the help, whole, on the next line
