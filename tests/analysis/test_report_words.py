"""What a report says, as a user reads it: what was recorded, time past a threshold vs. a firing, ongoing stretches."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from smiquery.analysis import report, report_html, report_json, report_markdown, report_text
from tests.cli.test_cli import FAKE_PATH, run


def test_the_default_recording_holds_every_field_the_default_report_needs(inproc, tmp_path):
    rec = tmp_path / "run.csv"
    proc = run("stream", "-l", "50ms", "--count", "3", "-F", "csv", "-o", rec, smi=FAKE_PATH)
    assert proc.returncode == 0, proc.stderr
    shown = run("report", rec)
    assert shown.returncode == 0, shown.stderr
    assert "Not recorded" not in shown.stdout and "not checked" not in shown.stdout
    assert "clocks_event_reasons.hw_thermal_slowdown" in rec.read_text().splitlines()[0]


def _idle(path: Path, gpu1_idle_from: int = 30) -> Path:
    """60 s of two GPUs holding memory: GPU 0 idle for 9 s mid-run, GPU 1 idle from ``gpu1_idle_from`` to the end."""
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB]"]
    for s in range(60):
        stamp = (t0 + timedelta(seconds=s)).strftime("%Y/%m/%d %H:%M:%S.000")
        lines.append(f"{stamp}, 0, {5 if 20 <= s < 29 else 90} %, 5000 MiB")
        lines.append(f"{stamp}, 1, {5 if s >= gpu1_idle_from else 90} %, 5000 MiB")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


RULES = ["utilization.gpu < 20 for 30m while memory.used > 1024", "utilization.gpu < 20 for 10"]


def test_time_past_a_threshold_does_not_read_as_a_firing(tmp_path):
    r = report(_idle(tmp_path / "idle.csv"), rules=RULES, min_stall=20)
    text = report_text(r)
    section = text[text.index("Time past thresholds") : text.index("Alerts the rules")]
    assert "long enough to fire or not" in section.splitlines()[0]
    head, gpu0, gpu1 = section.splitlines()[1:4]
    assert "for 30m" not in head and "utilization.gpu < 20 while memory.used > 1024" in head
    assert "(1x)" not in section
    assert " ".join(gpu0.split()) == "GPU 0 9 s in 1 stretch, not fired 9 s in 1 stretch, not fired"
    assert gpu1.endswith("30 s in 1 stretch, not fired  30 s in 1 stretch, fired 1x")
    md = report_markdown(r)
    assert "| GPU 1 | 30 s in 1 stretch, not fired | 30 s in 1 stretch, fired 1x |" in md
    assert "long enough to fire or not" in md
    html = report_html(r)
    assert "long enough to fire or not" in html and "30 s in 1 stretch, fired 1x" in html
    doc = json.loads(report_json(r))
    past = {(t["rule"], t["gpu"]): t for t in doc["thresholds"]}
    assert past[(RULES[0], 1)]["seconds_past_threshold"] == 30 and past[(RULES[0], 1)]["alerts_fired"] == 0
    assert past[(RULES[1], 1)]["alerts_fired"] == 1
    assert "seconds" not in past[(RULES[0], 1)]


def test_a_stall_or_alert_still_going_at_the_end_says_so(tmp_path):
    r = report(_idle(tmp_path / "idle.csv"), rules=RULES[1:], min_stall=20)
    text = report_text(r)
    stall = text[text.index("Stalls (") : text.index("Time past")]
    assert "30 s (ongoing at the end)" in stall
    alerts = text[text.index("Alerts the rules") :]
    assert "30 s (ongoing at the end)" in alerts.splitlines()[2]
    doc = json.loads(report_json(r))
    assert [s["ongoing"] for s in doc["stalls"]] == [True]
    assert [a["ongoing"] for a in doc["alerts"]] == [True]
    # one that ended before the recording did is not ongoing
    ended = report(_idle(tmp_path / "ended.csv", gpu1_idle_from=70), rules=["utilization.gpu < 20 for 3"])
    assert [a.ongoing for a in ended.alerts] == [False]
    assert "ongoing" not in report_text(ended)


def test_a_report_of_a_recording_made_with_alert_rules_checks_those_rules(inproc, tmp_path):
    rule = "utilization.gpu >= 0 for 2"  # holds on every sample of the fake: fires, and is still firing at the end
    for name in ("run.csv", "run.jsonl", "run.parquet"):
        rec = tmp_path / name
        proc = run("stream", "-l", "50ms", "--count", "4", "-F", "csv", "-a", rule, "-o", rec, smi=FAKE_PATH)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(run("report", rec, "--format", "json").stdout)
        assert rule in doc["rules"] and "temperature.gpu > 85 for 3" in doc["rules"]
        mine = [a for a in doc["alerts"] if a["rule"] == rule]
        assert mine and all(a["ongoing"] for a in mine)
        text = run("report", rec).stdout
        assert f"{rule}" in text and "(ongoing at the end)" in text
        # the rules given on the command line replace them
        only = json.loads(run("report", rec, "--format", "json", "-a", "temperature.gpu > 99").stdout)
        assert only["rules"] == ["temperature.gpu > 99"]


def test_smiquery_record_points_at_stream_output():
    bare = run("record")
    assert bare.returncode == 2
    assert "there is no `smiquery record`: record with `smiquery stream --output run.csv`" in bare.stderr
    given = run("record", "-o", "x.csv", "-l", "1s")
    assert "record with `smiquery stream -o x.csv -l 1s`, then `smiquery report`" in given.stderr
    assert len(given.stderr.splitlines()) == 1
    assert " record " not in run("--help").stdout  # not a command of its own


def test_a_parse_error_on_a_binary_line_quotes_a_short_escaped_excerpt():
    from smiquery.errors import ParseError

    garbage = bytes(range(256)).decode("latin-1") * 3
    text = str(ParseError("expected 3 columns, got 1", lineno=2, line=garbage))
    excerpt = text.split(": ", 2)[2]
    assert len(excerpt) <= 82 and excerpt.endswith("...'")
    assert excerpt.startswith("'\\x00\\x01") and "\\\\" not in excerpt  # escaped once, not repr'd twice
    assert all(c.isprintable() for c in text)
