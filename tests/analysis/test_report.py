"""smiquery.analysis.report against the bundled demo recording (known stall and hot GPU) and hand-made recordings."""

from __future__ import annotations

import html
import json
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from smiquery.analysis import (
    DEFAULT_RULES,
    Report,
    format_duration,
    report,
    report_html,
    report_json,
    report_markdown,
    report_text,
    stalls_and_alerts,
)
from smiquery.errors import ReportError
from smiquery.fields import resolve_fields
from smiquery.recordings import open_recorder, replay

DEMO = Path(__file__).parents[2] / "smiquery" / "data" / "demo-8gpu.csv"
STALL_START = datetime(2026, 3, 14, 9, 35, 0)  # scripts/make_demo_recording.py: STALL = (300, 390) s from 09:30:00
STALL_SECONDS = 90.0
HOT_GPU = 5


@pytest.fixture(scope="module")
def demo() -> Report:
    return report(DEMO)


def _naive(ts: datetime) -> datetime:
    return ts.replace(tzinfo=None)


def test_finds_the_stall_on_every_gpu(demo):
    assert demo.gpus == tuple(range(8))
    assert {s.gpu for s in demo.stalls} == set(range(8))
    assert len(demo.stalls) == 8  # one stretch each; the warm-up (no memory held yet) is not a stall
    for s in demo.stalls:
        assert abs((_naive(s.start) - STALL_START).total_seconds()) <= 2
        assert s.seconds == pytest.approx(STALL_SECONDS, abs=3)
        assert s.mean is not None and s.mean < 20
    together = [f for f in demo.findings if f.kind == "stall_together"]
    assert len(together) == 1
    assert together[0].gpus == tuple(range(8))
    assert together[0].verdict.startswith("All 8 GPUs stalled together from 09:35:00 for 1 min 3")
    assert "check the input pipeline, e.g. prefetching and TFRecord" in together[0].verdict


def test_finds_gpu_5_hot_and_no_other(demo):
    hot = [f for f in demo.findings if f.kind == "hot"]
    assert [f.gpus for f in hot] == [(HOT_GPU,)]
    assert hot[0].severity == "critical"
    assert "GPU 5 was over 85 C" in hot[0].verdict
    over = demo.time_over("temperature.gpu > 85 for 3", HOT_GPU)
    assert 120 <= over <= 240  # "a few minutes"
    for gpu in demo.gpus:
        if gpu != HOT_GPU:
            assert demo.time_over("temperature.gpu > 85 for 3", gpu) == 0
            assert demo.time_over("temperature.gpu > 80 for 5m", gpu) == 0
    fired = {(a.rule, a.gpu) for a in demo.alerts}
    assert ("temperature.gpu > 85 for 3", HOT_GPU) in fired
    assert all(gpu == HOT_GPU for _, gpu in fired)
    # it throttled while hot, and the report says so
    assert any(f.kind == "throttle" and f.gpus == (HOT_GPU,) for f in demo.findings)
    # the sustained-heat rule (80 C for 5 minutes) did not hold long enough to fire
    assert ("temperature.gpu > 80 for 5m", HOT_GPU) not in fired


def test_statistics_per_gpu(demo):
    temp5 = next(s for s in demo.stats if s.field == "temperature.gpu" and s.gpu == HOT_GPU)
    assert temp5.max > 85 and temp5.p95 > 85 and temp5.mean < temp5.p95 <= temp5.max
    util = [s for s in demo.stats if s.field == "utilization.gpu"]
    assert len(util) == 8
    assert all(60 < s.mean < 90 and s.max <= 100 for s in util)
    pdi = next(s for s in demo.stats if s.field == "power.draw.instant" and s.gpu == 2)
    assert pdi.missing == 2  # the two [N/A] cells of the recording
    assert demo.constants["memory.total"] == dict.fromkeys(range(8), 81559)
    assert demo.sweeps == 600
    assert demo.interval == pytest.approx(1.0, abs=0.01)


def test_text_report(demo):
    text = report_text(demo)
    assert text.startswith("demo-8gpu.csv: 8 GPUs, 600 samples each, 2026-03-14 09:30:00")
    assert "[critical] GPU 5 was over 85 C" in text
    assert "check the input pipeline, e.g. prefetching and TFRecord" in text
    assert "utilization.gpu [%]" in text
    # findings come most severe first
    lines = [ln for ln in text.splitlines() if ln.startswith("  [")]
    assert lines[0].startswith("  [critical]")


def test_json_report(demo):
    doc = json.loads(report_json(demo))
    assert doc["gpus"] == list(range(8))
    assert len(doc["stalls"]) == 8
    assert doc["stalls"][0]["start"].startswith("2026-03-14T09:35:00")
    assert {f["kind"] for f in doc["findings"]} >= {"hot", "stall_together"}
    assert doc["rules"] == list(DEFAULT_RULES)
    stat = next(s for s in doc["stats"] if s["field"] == "temperature.gpu" and s["gpu"] == 5)
    assert set(stat) >= {"mean", "p95", "max"}


def test_markdown_report(demo):
    md = report_markdown(demo)
    assert md.startswith("# GPU report: demo-8gpu.csv")
    assert "| GPU | start | length | mean util |" in md
    assert "| temperature.gpu [C] |" in md
    assert "- **critical**: GPU 5 was over 85 C" in md


def test_a_report_shows_itself_in_a_notebook_as_the_html_page(demo):
    shown = demo._repr_html_()  # what Jupyter calls to display the value of a cell
    assert shown == report_html(demo)
    assert "<h2>Findings</h2>" in shown
    assert demo.findings
    for finding in demo.findings:
        assert html.escape(finding.verdict) in shown
    assert "<img" not in shown  # no plot: drawing one would make every display of a report slow


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_jsonl_and_parquet_recordings_give_the_same_findings(tmp_path, suffix, demo):
    pytest.importorskip("pyarrow")
    path = tmp_path / f"demo{suffix}"
    with replay(DEMO, speed=0) as source:
        first = next(iter(source))
        writer = open_recorder(path, [resolve_fields([n])[0] for n in first.fields])
        writer.write(first)
        for s in source:
            writer.write(s)
        writer.close()
    other = report(path)
    assert [(f.kind, f.gpus) for f in other.findings] == [(f.kind, f.gpus) for f in demo.findings]
    assert [(s.gpu, round(s.seconds)) for s in other.stalls] == [(s.gpu, round(s.seconds)) for s in demo.stalls]


def test_dataframe_input(demo):
    from smiquery.recordings import read_csv

    other = report(read_csv(DEMO), name="frame")
    assert other.source == "frame"
    assert len(other.stalls) == len(demo.stalls)


# ------------------------------------------------------------------------------------------- small cases


def _write(path: Path, rows: list[tuple[int, int, str, str]], start: datetime | None = None) -> Path:
    """rows: (second, gpu, utilization cell, memory.used cell)."""
    t0 = start or datetime(2026, 1, 1, 12, 0, 0)
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB], temperature.gpu"]
    for sec, gpu, util, mem in rows:
        stamp = (t0 + timedelta(seconds=sec)).strftime("%Y/%m/%d %H:%M:%S.000")
        lines.append(f"{stamp}, {gpu}, {util}, {mem}, 60")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_missing_values_do_not_split_a_stall(tmp_path):
    rows = [
        (s, 0, "90 %" if s < 10 or s >= 80 else ("[N/A]" if 40 <= s < 45 else "5 %"), "5000 MiB") for s in range(90)
    ]
    r = report(_write(tmp_path / "na.csv", rows))
    assert len(r.stalls) == 1
    assert r.stalls[0].seconds == pytest.approx(70)
    assert r.findings[0].kind == "stall"
    assert r.findings[0].verdict.startswith("GPU 0 spent 1 min 10 s under 20% utilization in 1 stretch")


def test_a_gap_in_time_ends_a_stall_and_short_stretches_are_not_stalls(tmp_path):
    # 25 s idle, a 10-minute hole (the recorder was stopped), 25 s idle: two stretches under the 30 s minimum
    rows = [(s, 0, "5 %", "5000 MiB") for s in range(25)] + [(s, 0, "5 %", "5000 MiB") for s in range(625, 650)]
    r = report(_write(tmp_path / "gap.csv", rows))
    assert r.stalls == []
    assert report(tmp_path / "gap.csv", min_stall=20).stalls[1].start.minute == 10


def test_an_idle_gpu_without_memory_is_not_stalled(tmp_path):
    rows = [(s, 0, "0 %", "1 MiB") for s in range(120)] + [(s, 1, "3 %", "9000 MiB") for s in range(120)]
    r = report(_write(tmp_path / "idle.csv", rows))
    assert [s.gpu for s in r.stalls] == [1]
    assert [f.gpus for f in r.findings if f.kind == "stall"] == [(1,)]


def test_stalls_and_alerts_are_the_reports_periods(demo):
    found = stalls_and_alerts(DEMO)
    assert found.stalls == demo.stalls
    assert found.alerts == demo.alerts
    assert len(found.stalls) == 8 and any(a.gpu == HOT_GPU for a in found.alerts)
    # the same options as report: stricter stall settings and other rules change both alike
    rules = ["temperature.gpu > 70 for 10s", "utilization.gpu < 50 for 3"]
    strict = {"stall_utilization": 5.0, "min_stall": 30.0, "busy_memory": 1000.0}
    mine = stalls_and_alerts(DEMO, rules=rules, **strict)
    theirs = report(DEMO, rules=rules, **strict)
    assert (mine.stalls, mine.alerts) == (theirs.stalls, theirs.alerts)
    assert mine.alerts and mine.alerts != found.alerts


def test_custom_rules(tmp_path):
    rows = [(s, 0, "95 %", f"{1000 + 100 * s} MiB") for s in range(60)]
    r = report(_write(tmp_path / "mem.csv", rows), rules=["memory.used > 5000 for 10"])
    assert r.rules == ("memory.used > 5000 for 10",)
    assert r.time_over("memory.used > 5000 for 10", 0) == pytest.approx(19)  # seconds 41 to 59
    assert [a.gpu for a in r.alerts] == [0]
    assert not r.alerts[0].cleared  # still over at the end of the recording


def test_nothing_to_report(tmp_path):
    rows = [(s, g, "95 %", "5000 MiB") for s in range(60) for g in (0, 1)]
    r = report(_write(tmp_path / "fine.csv", rows))
    assert r.findings == []
    assert "nothing to report" in report_text(r)


def test_unreadable_recordings(tmp_path):
    with pytest.raises(ReportError, match="not found"):
        report(tmp_path / "missing.csv")
    empty = tmp_path / "empty.csv"
    empty.write_bytes(b"")
    with pytest.raises(ReportError, match="is empty"):
        report(empty)
    noise = tmp_path / "noise.csv"
    noise.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(ReportError, match="no nvidia-smi CSV header"):
        report(noise)
    garbage_only = tmp_path / "garbage.csv"
    garbage_only.write_text("timestamp, index, utilization.gpu [%]\nxx\n1, 2\n", encoding="utf-8")
    with pytest.raises(ReportError, match="no readable rows"):
        report(garbage_only)


def test_a_log_without_index_is_gpu_0(tmp_path):
    log = tmp_path / "power.csv"
    rows = "".join(f"2026/01/01 00:00:{s:02d}.000, {100 + s} W\n" for s in range(30))
    log.write_text("timestamp, power.draw [W]\n" + rows, encoding="utf-8")
    r = report(log)
    assert r.gpus == (0,)
    assert [s.field for s in r.stats] == ["power.draw"]
    assert r.stats[0].max == 129


def test_torn_last_line_and_garbage_are_skipped_and_reported(tmp_path):
    path = tmp_path / "killed.csv"
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    lines.insert(316, "\x00\x01 garbage from a full disk")
    text = "\n".join(lines) + "\n" + lines[-1][:40]  # the recorder was killed mid-line
    path.write_text(text, encoding="utf-8")
    r = report(path)
    assert r.skipped is not None
    assert (r.skipped.count, r.skipped.first_lineno) == (2, 317)
    assert r.gpus == tuple(range(8))
    assert "skipped 2 unreadable lines in killed.csv (first: line 317: expected 30 columns, got 1)" in report_text(r)


def test_headerless_log_with_fields(tmp_path):
    path = tmp_path / "noheader.csv"
    rows = "".join(f"2026/01/01 00:00:{s:02d}.000, {s % 2}, {10 * (s % 2)}\n" for s in range(40))
    path.write_text(rows, encoding="utf-8")
    with pytest.raises(ReportError, match="--fields"):
        report(path)
    r = report(path, fields="timestamp,index,utilization.gpu")
    assert r.gpus == (0, 1)


def test_timestamps_are_kept_as_recorded_or_in_the_given_zone(demo):
    assert demo.start.tzinfo is None  # nvidia-smi names no zone; the report claims none
    assert demo.start == datetime(2026, 3, 14, 9, 30, 0, 117000)
    berlin = report(DEMO, tz="Europe/Berlin")
    assert str(berlin.start.tzinfo) == "Europe/Berlin"
    assert berlin.start.hour == 9


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0 s"), (45.4, "45 s"), (60, "1 min"), (90, "1 min 30 s"), (14 * 60, "14 min"), (7500, "2 h 5 min")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# ------------------------------------------------------------------------------------------------------ CLI


def _app() -> Any:
    """The smiquery app when it has the analysis commands wired in; else a bare app with them."""
    import typer

    from smiquery import cli
    from smiquery.cli.analysis import register

    names = {c.name for c in cli.app.registered_commands}
    if "report" in names:
        return cli.app
    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """Test root."""

    register(app)
    return app


def test_cli_report_formats(tmp_path):
    from typer.testing import CliRunner

    app = _app()
    text = CliRunner().invoke(app, ["report", str(DEMO)])
    assert text.exit_code == 0, text.output
    assert "GPU 5 was over 85 C" in text.stdout
    md = CliRunner().invoke(app, ["report", str(DEMO), "--format", "markdown", "-o", str(tmp_path / "r.md")])
    assert md.exit_code == 0
    assert (tmp_path / "r.md").read_text().startswith("# GPU report")
    js = CliRunner().invoke(app, ["report", str(DEMO), "-F", "json", "--min-stall", "2m"])
    assert js.exit_code == 0
    doc = json.loads(js.stdout)
    assert doc["stalls"] == []  # the 90 s stall is under a 2 minute minimum
    assert doc["min_stall_seconds"] == 120


def test_cli_report_fail_on_and_errors(tmp_path):
    from typer.testing import CliRunner

    app = _app()
    assert CliRunner().invoke(app, ["report", str(DEMO), "--fail-on", "critical"]).exit_code == 6
    fine = tmp_path / "fine.csv"
    _write(fine, [(s, 0, "95 %", "5000 MiB") for s in range(60)])
    assert CliRunner().invoke(app, ["report", str(fine), "--fail-on", "warning"]).exit_code == 0
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nope.csv")])
    assert missing.exit_code == 1
    assert "not found" in missing.stderr
    bad = CliRunner().invoke(app, ["report", str(DEMO), "--alert", "temperature.gpu >> 3"])
    assert bad.exit_code == 2
    assert "usage error" in bad.stderr
    bad_stall = CliRunner().invoke(app, ["report", str(DEMO), "--min-stall", "soon"])
    assert bad_stall.exit_code == 2


def test_memory_health_counters_are_findings(demo):
    ecc = [f for f in demo.findings if f.kind == "ecc"]
    assert [(f.gpus, f.severity) for f in ecc] == [((6,), "critical"), ((3,), "warning")]
    assert "ecc.errors.uncorrected.aggregate.total = 1" in ecc[0].verdict
    assert "grew from 0 to 2" in ecc[1].verdict
    assert {(h.field, h.gpu) for h in demo.health} == {
        ("ecc.errors.uncorrected.aggregate.total", 6),
        ("ecc.errors.corrected.volatile.total", 3),
    }


def test_statistics_are_short_and_rounded_to_the_unit(demo):
    text = report_text(demo)
    stats = text[text.index("Statistics over all GPUs") :].splitlines()
    assert len(stats) < 20  # one line per field, not one block per field and GPU
    mem = next(line for line in stats if line.lstrip().startswith("memory.used [MiB]"))
    assert "." not in mem.split("]", 1)[1]  # MiB are whole numbers
    power = next(line for line in stats if line.lstrip().startswith("power.draw [W]"))
    assert all(len(cell.split(".")[-1]) <= 1 for cell in power.split() if "." in cell and cell[0].isdigit())


def test_cli_warns_once_about_skipped_lines_and_reads_headerless_logs(tmp_path):
    from typer.testing import CliRunner

    app = _app()
    killed = tmp_path / "killed.csv"
    killed.write_text(DEMO.read_text(encoding="utf-8") + DEMO.read_text(encoding="utf-8").splitlines()[5][:33])
    result = CliRunner().invoke(app, ["report", str(killed)])
    assert result.exit_code == 0, result.output
    warnings = [ln for ln in result.stderr.splitlines() if ln.startswith("smiquery: warning:")]
    assert warnings == [
        f"smiquery: warning: skipped 1 unreadable line in {killed} (first: line 4802: expected 30 columns, got 3)"
    ]
    noheader = tmp_path / "noheader.csv"
    noheader.write_text("".join(f"2026/01/01 00:00:{s:02d}.000, 0, 7\n" for s in range(40)), encoding="utf-8")
    refused = CliRunner().invoke(app, ["report", str(noheader)])
    assert refused.exit_code == 1
    assert "--fields" in refused.stderr
    ok = CliRunner().invoke(app, ["report", str(noheader), "--fields", "timestamp,index,utilization.gpu"])
    assert ok.exit_code == 0, ok.output
    assert "GPU 0 spent 40 s under 20% utilization" in ok.stdout
    zoned = CliRunner().invoke(app, ["report", str(DEMO), "--tz", "Europe/Berlin", "-F", "json"])
    assert json.loads(zoned.stdout)["start"].endswith("+01:00")
    for bad in (b"", bytes(range(256)) * 4):
        junk = tmp_path / "junk.csv"
        junk.write_bytes(bad)
        failed = CliRunner().invoke(app, ["report", str(junk)])
        assert failed.exit_code == 1
        assert failed.stderr.startswith("smiquery: error: ") and failed.stderr.count("\n") == 1


def test_gpus_that_stalled_together_share_one_row(demo):
    text = report_text(demo)
    section = text[text.index("Stalls (") : text.index("Time past thresholds")].splitlines()
    rows = [line for line in section[2:] if line.strip()]
    assert len(rows) == 1
    assert rows[0].split()[:3] == ["0-7", "2026-03-14", "09:35:00"]
    assert len(demo.stalls) == 8  # the data keeps one stall per GPU


def _demo_script() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_script", Path(__file__).parents[2] / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_demo_ends_with_the_report_and_the_plot(tmp_path, capsys, monkeypatch):
    demo_script = _demo_script()
    assert demo_script._afterwards(DEMO, tmp_path) == 0
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'report.txt'}" in out
    assert "[critical] GPU 5 was over 85 C" in out
    assert (tmp_path / "report.txt").read_text().startswith("demo-8gpu.csv: 8 GPUs")
    if (tmp_path / "plot.png").exists():
        assert f"plot:   {tmp_path / 'plot.png'}" in out
    # `make demo` installs the plot extra; without matplotlib the demo prints the venv's commands that draw it
    real = demo_script.importlib.util.find_spec
    monkeypatch.setattr(
        demo_script.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    assert demo_script._afterwards(DEMO, tmp_path / "bare") == 0
    out = capsys.readouterr().out
    venv_bin = demo_script._here(Path(sys.executable).parent)
    assert f"{venv_bin}/pip install -e '.[plot]' && {venv_bin}/smiquery plot" in out
    assert "--alert 'temperature.gpu > 85 for 3'" in out


def test_energy_per_gpu_integrates_power_over_the_run(tmp_path):
    rec = tmp_path / "power.csv"
    lines = ["timestamp, index, power.draw [W]"]
    for i in range(60):  # one minute at 1 Hz: GPU 0 at 100 W, GPU 1 at 300 W (one reading missing)
        t = f"2026/01/01 10:00:{i:02d}.000"
        lines.append(f"{t}, 0, 100.00 W")
        lines.append(f"{t}, 1, {'[N/A]' if i == 30 else '300.00 W'}")
    rec.write_text("\n".join(lines) + "\n")
    result = report(rec)
    assert result.energy_wh[0] == pytest.approx(100 * 60 / 3600)  # 1.67 Wh
    assert result.energy_wh[1] == pytest.approx(300 * 59 / 3600)  # the missing second is not guessed
    assert "Energy (power.draw over the run): 6.6 Wh in all" in report_text(result)
    assert json.loads(report_json(result))["energy_wh"] == {"0": 1.667, "1": 4.917}


# ------------------------------------------------------------------------------------- --tz and --fields (CLI)


def _headerless_copy(tmp_path: Path, rows: int = 800) -> tuple[Path, Path, str]:
    """The demo's first rows with its header, and the same rows without it, under the same file name."""
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    names = ",".join(cell.split(" [")[0].strip() for cell in lines[0].split(","))
    with_header = tmp_path / "with" / "log.csv"
    without = tmp_path / "without" / "log.csv"
    for path, text in ((with_header, lines[: rows + 1]), (without, lines[1 : rows + 1])):
        path.parent.mkdir()
        path.write_text("\n".join(text) + "\n", encoding="utf-8")
    return with_header, without, names


def test_cli_report_tz_labels_times_in_that_zone_and_naive_stays_naive():
    from typer.testing import CliRunner

    app = _app()
    plain = CliRunner().invoke(app, ["report", str(DEMO)])
    assert plain.exit_code == 0, plain.output
    headline = plain.stdout.splitlines()[0]
    assert "2026-03-14 09:30:00 to 09:40:00" in headline and "recorder's local time" in headline
    assert "UTC" not in plain.stdout
    berlin = CliRunner().invoke(app, ["report", "--tz", "Europe/Berlin", str(DEMO)])
    assert berlin.exit_code == 0, berlin.output
    zoned = berlin.stdout.splitlines()[0]
    assert "2026-03-14 09:30:00 to 09:40:00" in zoned and "Europe/Berlin" in zoned  # same wall clock, now named
    doc = json.loads(CliRunner().invoke(app, ["report", str(DEMO), "-F", "json"]).stdout)
    assert doc["start"] == "2026-03-14T09:30:00.117000"  # no offset: none was recorded


def test_cli_report_and_plot_reject_an_unknown_zone_as_a_usage_error(tmp_path):
    from typer.testing import CliRunner

    app = _app()
    for command in (["report", str(DEMO)], ["plot", str(DEMO), "-o", str(tmp_path / "p.png")]):
        bad = CliRunner().invoke(app, [*command, "--tz", "Mars/Olympus"])
        assert bad.exit_code == 2, bad.output
        assert bad.stderr.count("\n") == 1 and "--tz: unknown time zone 'Mars/Olympus'" in bad.stderr
    assert not (tmp_path / "p.png").exists()


def test_cli_report_headerless_log_with_fields_equals_the_report_with_header(tmp_path):
    from typer.testing import CliRunner

    app = _app()
    with_header, without, names = _headerless_copy(tmp_path)
    refused = CliRunner().invoke(app, ["report", str(without)])
    assert refused.exit_code == 1 and refused.stderr.count("\n") == 1
    assert "give its columns with --fields" in refused.stderr
    a = CliRunner().invoke(app, ["report", str(with_header), "-F", "json"])
    b = CliRunner().invoke(app, ["report", str(without), "-F", "json", "--fields", names])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert json.loads(b.stdout)["gpus"] == list(range(8))
    also = CliRunner().invoke(app, ["report", str(with_header), "-F", "json", "--fields", names])
    assert json.loads(also.stdout) == json.loads(a.stdout)  # --fields that agree with the header change nothing


def test_cli_report_fields_that_disagree_or_are_unknown_fail_clearly(tmp_path):
    from typer.testing import CliRunner

    app = _app()
    with_header, without, _ = _headerless_copy(tmp_path, rows=16)
    disagree = CliRunner().invoke(app, ["report", str(with_header), "--fields", "timestamp,clocks.max.sm"])
    assert disagree.exit_code == 1 and disagree.stderr.count("\n") == 1
    assert "--fields does not agree with" in disagree.stderr and "no clocks.max.sm" in disagree.stderr
    short = CliRunner().invoke(app, ["report", str(without), "--fields", "timestamp,index,utilization.gpu"])
    assert short.exit_code == 1 and "rows do not fit --fields" in short.stderr
    unknown = CliRunner().invoke(app, ["report", str(without), "--fields", "timestamp,index,temprature.gpu"])
    assert unknown.exit_code == 2 and "temprature.gpu" in unknown.stderr


def test_cli_plot_headerless_log_takes_its_columns_from_fields(tmp_path):
    from typer.testing import CliRunner

    pytest.importorskip("matplotlib")
    app = _app()
    _, without, names = _headerless_copy(tmp_path, rows=80)
    out = tmp_path / "trace.png"
    refused = CliRunner().invoke(app, ["plot", str(without), "-o", str(out)])
    assert refused.exit_code == 1 and "--fields" in refused.stderr and not out.exists()
    drawn = CliRunner().invoke(app, ["plot", str(without), "-o", str(out), "--fields", names, "--tz", "UTC"])
    assert drawn.exit_code == 0, drawn.output
    assert out.read_bytes().startswith(b"\x89PNG")  # text columns (name, uuid, pstate) are named, not drawn


def test_statistics_of_a_column_outside_the_catalogue_are_rounded_to_its_unit(tmp_path):
    from smiquery.recordings import read_csv

    rows = [(s, 0, "95 %", f"{70000 + s} MiB") for s in range(60)]
    df = read_csv(_write(tmp_path / "mem.csv", rows))
    df["fb_estimate"] = df["memory_used"] / 3  # a derived column in MiB, with fractions
    df["board_watts"] = df["memory_used"] / 1000  # a derived column in W
    df.attrs["units"] = {**df.attrs["units"], "fb_estimate": "MiB", "board_watts": "W"}
    text = report_text(report(df))
    stats = text[text.index("Statistics over all GPUs") :].splitlines()
    mib = next(line for line in stats if line.lstrip().startswith("fb_estimate [MiB]"))
    assert "23343" in mib and "." not in mib.split("]", 1)[1]  # whole MiB: never "23343.1"
    watts = next(line for line in stats if line.lstrip().startswith("board_watts [W]"))
    assert "70.1" in watts  # watts keep a decimal
