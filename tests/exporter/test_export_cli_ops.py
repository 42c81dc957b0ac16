"""`smiquery export` as an operator runs it: the default alert rule that the shipped rules match, JSON log lines,
--version. A real process with the fake nvidia-smi, scraped over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docker" / "prometheus" / "smiquery-rules.yml"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


@contextmanager
def _exporter(smi: Path, *args: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """The exporter on a free port; yields (base URL, process). The first stderr line says where it serves."""
    argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--interval", "0.1", "--nvidia-smi", str(smi)]
    proc = subprocess.Popen([*argv, "--kernel-log", "", *args], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        text = json.loads(line)["msg"] if line.startswith("{") else line
        assert "serving http://" in text, line
        yield text.split("serving ", 1)[1].split("/metrics", 1)[0], proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(15)
        if proc.stderr is not None:
            proc.stderr.close()


def _alerts(url: str) -> set[str]:
    wait_for(lambda: "smiquery_alert_fired_total{" in _get(url + "/metrics"), what="the alert series")
    body = _get(url + "/metrics")
    return {
        line.split('alert="', 1)[1].split('"', 1)[0]
        for line in body.splitlines()
        if line.startswith("smiquery_alert_fired_total{")
    }


def _rule_matches() -> set[str]:
    """The alert="..." values the shipped GpuTemperatureCritical asks for."""
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"] for r in g["rules"]}
    expr = rules["GpuTemperatureCritical"]["expr"]
    return {part.split('"', 1)[0] for part in expr.split('alert="')[1:]}


def test_an_extra_alert_keeps_the_rule_the_shipped_rules_match(fake_smi) -> None:
    wanted = _rule_matches()
    assert wanted == {"temperature.gpu > 85 for 3"}
    with _exporter(fake_smi(), "--alert", "utilization.gpu < 20 for 5m") as (url, _):
        assert _alerts(url) == wanted | {"utilization.gpu < 20 for 5m"}
    with _exporter(fake_smi(), "--alert", "none") as (url, _):
        assert _alerts(url) == wanted


def test_no_default_alerts_turns_it_off_and_the_guard_rule_exists(fake_smi) -> None:
    with _exporter(fake_smi(), "--no-default-alerts", "--alert", "utilization.gpu < 20 for 5m") as (url, _):
        assert _alerts(url) == {"utilization.gpu < 20 for 5m"}
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"] for r in g["rules"]}
    assert (
        'smiquery_alert_fired_total{alert="temperature.gpu > 85 for 3"}' in rules["SmiqueryDefaultAlertMissing"]["expr"]
    )


def test_json_log_format_makes_every_line_json(fake_smi) -> None:
    """Log collectors parse each stderr line: the serving line and the all-interfaces warning were plain text."""
    with _exporter(fake_smi(), "--log-format", "json", "--bind", "0.0.0.0") as (url, proc):
        wait_for(lambda: "smiquery_up 1.0" in _get(url.replace("0.0.0.0", "127.0.0.1") + "/metrics"), what="data")
        proc.terminate()
        assert proc.wait(15) == 143
        assert proc.stderr is not None
        rest = proc.stderr.read().splitlines()
    lines = [json.loads(line) for line in rest]  # every one parses
    assert any(d.get("event") == "no_tls_on_all_interfaces" and d["level"] == "warning" for d in lines), rest
