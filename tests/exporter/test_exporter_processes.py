"""The exporter's ``--top-processes N``: per-process series from one supervised nvidia-smi pmon, bounded and fresh."""

from __future__ import annotations

import json
import logging
import os
import pwd
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from smiquery.exporter import PMON_METRICS, Exporter, SmiCollector, serve
from smiquery.exporter.pmonwatch import process_instant
from smiquery.source import StreamStats
from smiquery.sources.pmon import parse_pmon
from tests.exporter.test_exporter import ROOT, cli, flat, get
from tests.helpers import wait_for
from tests.leakcheck import no_leaks, wait_no_children

FIXTURES = Path(__file__).parents[1] / "fixtures"
SM = "smiquery_process_sm_utilization_ratio"
MEM = "smiquery_process_memory_utilization_ratio"
FB = "smiquery_process_gpu_memory_used_bytes"
MiB = 1048576.0


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in os.environ:
        if var.startswith("SMIQUERY_FAKE_") or var == "SMIQUERY_NVIDIA_SMI":
            monkeypatch.delenv(var)


@pytest.fixture
def exporter() -> Iterator[Any]:
    """A factory for serve(); every exporter is stopped at the end, and no child may be left."""
    made: list[Exporter] = []

    def make(**kw: Any) -> Exporter:
        kw.setdefault("port", 0)
        kw.setdefault("interval", 0.1)
        exp = serve(**kw)
        made.append(exp)
        return exp

    yield make
    for exp in made:
        exp.stop()
    assert not wait_no_children(10.0)


def demo_uuids() -> dict[int, str]:
    """GPU index -> UUID of the fake's bundled recording."""
    lines = resources.files("smiquery").joinpath("data/demo-8gpu.csv").read_text(encoding="utf-8").splitlines()
    names = [c.strip().split(" [")[0] for c in lines[0].split(",")]
    out: dict[int, str] = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.split(", ")]
        out.setdefault(int(cells[names.index("index")]), cells[names.index("uuid")])
    return out


def write_apps(path: Path, procs: list[tuple[int, str, int, int]]) -> Path:
    """A compute-apps CSV for the fake: (pid, name, GPU index, MiB) per process."""
    uuids = demo_uuids()
    rows = [f"{pid}, /usr/bin/{name}, {uuids[gpu]}, {mib} MiB" for pid, name, gpu, mib in procs]
    path.write_text("pid, process_name, gpu_uuid, used_gpu_memory [MiB]\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return path


def samples(body: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called ``name`` in an exposition."""
    return [
        (dict(s.labels), s.value) for fam in text_string_to_metric_families(body) for s in fam.samples if s.name == name
    ]


def scrape(exp: Exporter) -> str:
    code, body = get(exp.url + "/metrics")
    assert code == 200
    return body


def pmon_pids(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [c["pid"] for c in map(json.loads, log.read_text().splitlines()) if c["argv"][:1] == ["pmon"]]


def next_instant(exp: Exporter, after: float) -> str:
    """The first scrape whose pmon instant is newer than ``after`` (a Unix time)."""
    body = ""

    def newer() -> bool:
        nonlocal body
        body = scrape(exp)
        got = samples(body, "smiquery_process_last_sample_timestamp_seconds")
        return bool(got) and got[0][1] > after

    wait_for(newer, 30, "a new pmon instant")
    return body


def stamp(body: str) -> float:
    return samples(body, "smiquery_process_last_sample_timestamp_seconds")[0][1]


# --------------------------------------------------------------------------------------- a running exporter


def test_top_n_plus_other_and_the_bound_holds_with_many_processes(exporter, fake_smi, tmp_path):
    me = os.getpid()
    # SM % in the fake is (pid * 7 + sample * 13) % 100: these pids spread it over 0..99, so the top changes
    procs = [(50000 + 30 * i, f"worker{i}", 0, 100 + i) for i in range(10)]
    procs += [(me, "trainer", 1, 2048), (60001, "sidecar", 1, 64)]
    apps = write_apps(tmp_path / "apps.csv", procs)
    exp = exporter(nvidia_smi=fake_smi(apps=apps), top_processes=3, top_processes_by="pid")
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, 30, "GPU samples (the uuid labels come from them)")
    body = next_instant(exp, 0.0)
    seen_pids: set[str] = set()
    for _ in range(3):  # three instants: the busiest change every sample, the bound never does
        for name in (SM, MEM, FB):
            gpu0 = [labels for labels, _ in samples(body, name) if labels["gpu"] == "0"]
            assert len(gpu0) == 4, (name, gpu0)  # 3 + other, out of 10 processes
            assert len({lb["pid"] for lb in gpu0}) == 4
            other = [lb for lb in gpu0 if lb["pid"] == "other"]
            assert other == [{"gpu": "0", "uuid": demo_uuids()[0], "pid": "other", "command": "other", "user": ""}]
            seen_pids |= {lb["pid"] for lb in gpu0}
        assert samples(body, "smiquery_gpu_processes")[0] == ({"gpu": "0", "uuid": demo_uuids()[0]}, 10.0)
        body = next_instant(exp, stamp(body))
    assert len(seen_pids) > 4  # the busiest changed between instants: still never more than 4 at once
    gpu0_sm = {lb["pid"]: v for lb, v in samples(body, SM) if lb["gpu"] == "0"}
    kept = sorted((v for pid, v in gpu0_sm.items() if pid != "other"), reverse=True)
    # The fake's SM % of a process in sample n is (pid * 7 + n * 13) % 100: some n explains the served values, the
    # three busiest kept and the other seven summed.
    explained = []
    for n in range(100):
        busy = sorted((((pid * 7 + n * 13) % 100) / 100 for pid, _, gpu, _ in procs if gpu == 0), reverse=True)
        if kept == pytest.approx(busy[:3]) and gpu0_sm["other"] == pytest.approx(sum(busy[3:])):
            explained.append(n)
    assert explained, gpu0_sm
    gpu1 = {lb["pid"]: lb for lb, _ in samples(body, SM) if lb["gpu"] == "1"}
    assert set(gpu1) == {str(me), "60001"}  # not more than N: no other series
    assert gpu1[str(me)]["user"] == pwd.getpwuid(os.getuid()).pw_name and gpu1[str(me)]["command"] == "trainer"
    fb = {lb["pid"]: v for lb, v in samples(body, FB) if lb["gpu"] == "1"}
    assert fb == {str(me): 2048 * MiB, "60001": 64 * MiB}
    counts = dict((lb["gpu"], v) for lb, v in samples(body, "smiquery_gpu_processes"))
    assert counts == {"0": 10.0, "1": 2.0, "2": 0.0, "3": 0.0}  # pmon watches at most 4 GPUs
    assert not [lb for lb, _ in samples(body, SM) if lb["gpu"] in ("2", "3")]  # idle GPUs: no process series
    assert samples(body, "smiquery_process_up") == [({}, 1.0)]
    assert "smiquery_temperature_gpu_celsius{" in body  # the GPU metrics are there too


def test_a_process_that_ends_disappears_at_the_next_instant(exporter, fake_smi, tmp_path, monkeypatch):
    apps = write_apps(tmp_path / "apps.csv", [(41000, "stays", 0, 512), (41001, "leaves", 0, 256)])
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_ENDS", "41001:3")
    exp = exporter(nvidia_smi=fake_smi(apps=apps), top_processes=5, top_processes_by="pid")
    body = next_instant(exp, 0.0)
    assert {lb["pid"] for lb, _ in samples(body, FB)} == {"41000", "41001"}

    def pids(text: str) -> set[str]:
        return {lb["pid"] for lb, _ in samples(text, FB)}

    while "41001" in pids(body):
        body = next_instant(exp, stamp(body))
    assert pids(body) == {"41000"}
    assert samples(body, "smiquery_gpu_processes")[0][1] == 1.0
    assert not any("41001" in lb.values() for name in PMON_METRICS for lb, _ in samples(body, name))
    body = next_instant(exp, stamp(body))
    assert pids(body) == {"41000"}  # and it stays gone


def test_values_pmon_printed_as_dash_have_no_sample(exporter, fake_smi, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON", str(FIXTURES / "pmon-h100x4-590-um.txt"))
    exp = exporter(nvidia_smi=fake_smi(), top_processes=5, top_processes_by="pid")
    body = next_instant(exp, 0.0)
    sm = {(lb["gpu"], lb["pid"]): v for lb, v in samples(body, SM)}
    fb = {(lb["gpu"], lb["pid"]): v for lb, v in samples(body, FB)}
    assert ("0", "7420") not in sm  # nccl-watchdog: sm '-'
    assert ("0", "7420") not in {(lb["gpu"], lb["pid"]) for lb, _ in samples(body, MEM)}
    assert fb[("0", "7420")] == 1024 * MiB  # its memory is known
    assert sm[("0", "7001")] in (0.95, 0.96, 0.97)
    enc = {(lb["gpu"], lb["pid"]): v for lb, v in samples(body, "smiquery_process_encoder_utilization_ratio")}
    assert enc == {("3", "8800"): 0.0}  # a real 0 stays; every other process printed '-'
    dec = samples(body, "smiquery_process_decoder_utilization_ratio")
    assert [(lb["command"], v) for lb, v in dec] == [("video_decode_wo", 0.35)]
    assert not [lb for lb, _ in samples(body, SM) if lb["gpu"] == "2"]  # idle GPU
    assert samples(body, "smiquery_process_ofa_utilization_ratio") == []


def test_a_stalled_pmon_exports_nothing_and_says_so_while_gpu_metrics_go_on(exporter, fake_smi, monkeypatch):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_HANG_AFTER", "2")
    exp = exporter(nvidia_smi=fake_smi(), top_processes=2, stale_after=3.0, stall_timeout=120, top_processes_by="pid")
    wait_for(lambda: samples(scrape(exp), SM), 30, "process series")
    wait_for(lambda: not samples(scrape(exp), SM), 30, "the stale instant to go")
    body = scrape(exp)
    assert samples(body, "smiquery_process_up") == [({}, 0.0)]
    assert samples(body, "smiquery_gpu_processes") == [] and samples(body, FB) == []
    assert samples(body, "smiquery_process_last_sample_timestamp_seconds")  # when pmon last said something
    assert samples(body, "smiquery_up") == [({}, 1.0)] and "smiquery_power_draw_watts{" in body
    assert get(exp.url + "/healthz")[0] == 200  # a stalled pmon does not make the exporter unready


def test_unsupported_pmon_logs_one_line_and_gpu_metrics_keep_working(exporter, fake_smi, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", "1")
    caplog.set_level(logging.INFO, logger="smiquery")
    log = tmp_path / "calls.jsonl"
    exp = exporter(nvidia_smi=fake_smi(log=log), top_processes=3, top_processes_by="pid")
    assert exp.pmon is not None
    wait_for(lambda: exp.pmon is not None and exp.pmon.state == "failed", 30, "pmon to give up")
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, 30, "healthy")
    body = scrape(exp)
    assert samples(body, "smiquery_process_up") == [({}, 0.0)]
    info = samples(body, "smiquery_process_stream_info")
    assert info == [({"state": "failed", "last_error_type": "NotSupportedError"}, 1.0)]
    errors = samples(body, "smiquery_nvidia_smi_errors_total")
    assert ({"source": "pmon", "type": "NotSupportedError"}, 1.0) in errors
    assert samples(body, SM) == [] and "smiquery_temperature_gpu_celsius{" in body
    lines = [r.getMessage() for r in caplog.records if "pmon" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "Not supported on the device(s)" in lines[0], lines
    for pid in pmon_pids(log):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the failed child was reaped at once


def test_an_unsupported_pmon_is_tried_again_logged_once_and_comes_back(fake_smi, monkeypatch, caplog, tmp_path):
    from smiquery.exporter import PmonWatcher

    monkeypatch.setenv("SMIQUERY_FAKE_PMON_UNSUPPORTED", "1")
    caplog.set_level(logging.INFO, logger="smiquery")
    log = tmp_path / "calls.jsonl"
    with no_leaks(reap_timeout=10.0):
        watcher = PmonWatcher(2, nvidia_smi=fake_smi(log=log), retry_after=0.2).start()
        try:
            wait_for(lambda: watcher.errors["NotSupportedError"] >= 4, 30, "four failed attempts")
            assert watcher.fresh() is None and watcher.state == "failed" and len(pmon_pids(log)) >= 4
            warned = [r for r in caplog.records if r.levelno >= logging.WARNING and "pmon" in r.getMessage()]
            assert len(warned) == 1, [r.getMessage() for r in warned]  # the same error again is not logged again
            monkeypatch.delenv("SMIQUERY_FAKE_PMON_UNSUPPORTED")  # e.g. the driver was upgraded
            wait_for(lambda: watcher.fresh() is not None, 30, "pmon to work again")
            assert watcher.state == "running"
            assert any("works again" in r.getMessage() for r in caplog.records)
        finally:
            watcher.close()
    assert watcher.state == "closed"


def test_off_by_default_no_pmon_child_at_all(exporter, fake_smi, tmp_path):
    log = tmp_path / "calls.jsonl"
    exp = exporter(nvidia_smi=fake_smi(log=log))
    wait_for(lambda: exp.stream.stats.sweeps >= 5, 30, "five sweeps")
    body = scrape(exp)
    assert exp.pmon is None and pmon_pids(log) == []
    assert not [name for name in PMON_METRICS if name + " " in body or name + "{" in body]


def test_stop_reaps_the_pmon_child(fake_smi, tmp_path):
    log = tmp_path / "calls.jsonl"
    with no_leaks(reap_timeout=10.0):
        exp = serve(port=0, interval=0.1, nvidia_smi=fake_smi(log=log), top_processes=2)
        next_instant(exp, 0.0)
        (child,) = pmon_pids(log)
        os.kill(child, 0)  # running
        exp.stop()
        exp.stop()  # idempotent
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_cli_top_processes_serves_and_reaps_on_sigterm(fake_smi, tmp_path):
    import signal
    import subprocess
    import sys

    log = tmp_path / "calls.jsonl"
    argv = [sys.executable, "-m", "smiquery", "export", "--port", "0", "--interval", "0.1"]
    proc = subprocess.Popen(
        [*argv, "--top-processes", "2", "--nvidia-smi", str(fake_smi(log=log))],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        url = line.split("serving ", 1)[1].split("/metrics", 1)[0]
        wait_for(lambda: f"{SM}{{" in get(url + "/metrics")[1], 30, "process series")
        (child,) = pmon_pids(log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-processes", "-1"], "--top-processes"),
        (["--top-processes", "two"], "--top-processes"),
        (["--top-processes", "2", "--label", "user=me"], "'user' is set by the exporter itself"),
        (["--top-processes", "2", "--top-processes-by", "user"], "--top-processes-by"),
    ],
)
def test_cli_top_processes_usage_errors(args, message):
    done = cli(*args, "--nvidia-smi", "/bin/true")
    assert done.returncode == 2, done.stderr
    assert message in flat(done.stderr), done.stderr


def test_help_names_the_option():
    from smiquery.cli import app

    result = CliRunner().invoke(app, ["export", "--help"])
    assert result.exit_code == 0 and "--top-processes" in flat(result.output)


# ------------------------------------------------------------------------------------ the families themselves


class _Idle:
    """A GPU source that has seen nothing: only the pmon families are under test."""

    interval = 1.0
    stats = StreamStats()
    running = True
    error = None

    def latest(self) -> tuple[None, None]:
        return None, None


def test_families_of_one_instant_in_base_units_with_other_summed():
    rows = parse_pmon((FIXTURES / "pmon-h100x4-590-um.txt").read_text(encoding="utf-8"))[:6]
    instant = process_instant(rows, 1, user_of=lambda pid: "alice" if pid == 7001 else None)
    col = SmiCollector(_Idle(), fields=[], labels=["site=lab"])
    fams = {f.name: f for f in col.pmon_families(instant)}
    sm = {(s.labels["gpu"], s.labels["pid"]): s.value for s in fams[SM].samples}
    assert sm == {("0", "7001"): 0.97, ("1", "7001"): 0.88, ("1", "other"): 0.04, ("3", "8800"): 0.12}
    fb = {(s.labels["gpu"], s.labels["pid"]): s.value for s in fams[FB].samples}
    assert fb[("0", "other")] == 1024 * MiB  # the watchdog: memory known, SM not
    assert ("0", "other") not in sm  # the other row's SM sums no known value: no sample, never 0
    first = fams[SM].samples[0].labels
    assert first == {"gpu": "0", "uuid": "", "pid": "7001", "command": "python3", "user": "alice", "site": "lab"}
    counts = {s.labels["gpu"]: s.value for s in fams["smiquery_gpu_processes"].samples}
    assert counts == {"0": 2.0, "1": 2.0, "2": 0.0, "3": 1.0}


def test_process_labels_may_not_be_constant_labels() -> None:
    from smiquery.exporter import PmonWatcher

    watcher = PmonWatcher(1, make_stream=lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="'command' is set by the exporter itself"):
        SmiCollector(_Idle(), fields=[], labels=["command=x"], pmon=watcher)
    with pytest.raises(ValueError, match=">= 1"):
        PmonWatcher(0)


def test_docs_list_every_process_metric() -> None:
    doc = (ROOT / "docs" / "exporter.md").read_text(encoding="utf-8")
    for name in PMON_METRICS:
        assert f"`{name}" in doc, name


@pytest.mark.parametrize("naming", ["smiquery", "dcgm", "nvidia_smi"])
def test_promtool_finds_nothing_wrong_with_the_process_series(exporter, fake_smi, naming):
    import subprocess

    from tests.exporter.test_rules import require_tool

    promtool = require_tool("promtool")
    exp = exporter(nvidia_smi=fake_smi(), top_processes=2, naming=naming)
    bare = {u.removeprefix("GPU-") for u in list(demo_uuids().values())[:4]}
    want = bare if naming == "nvidia_smi" else {"GPU-" + u for u in bare}  # what the GPU series carry: they join
    body = ""

    def joined() -> bool:
        nonlocal body
        body = scrape(exp)
        return {lb["uuid"] for lb, _ in samples(body, SM)} == want

    wait_for(joined, 30, "process series labelled with the GPU series' uuid")
    done = subprocess.run([promtool, "check", "metrics"], input=body.encode(), capture_output=True, timeout=60)
    findings = [ln for ln in (done.stdout + done.stderr).decode().splitlines() if ln.strip()]
    if naming == "smiquery":
        assert (done.returncode, findings) == (0, [])
    # the other namings keep their peers' own findings; none is about the process series
    assert not [ln for ln in findings if ln.startswith(PMON_METRICS)], findings


def test_the_fakes_pmon_help_lists_its_variables(fake_smi):
    import subprocess

    from smiquery.testing._emulator.modes import PMON_ENV_VARS

    done = subprocess.run([str(fake_smi()), "pmon", "-h"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    names = ("SMIQUERY_FAKE_PMON_ENDS", "SMIQUERY_FAKE_PMON_HANG_AFTER", "SMIQUERY_FAKE_PMON_UNSUPPORTED")
    for name in (*names, "SMIQUERY_FAKE_PMON_PROCS"):
        assert name in PMON_ENV_VARS and name in done.stdout


# ------------------------------------------------------------------------------- by name: bounded by default


def test_by_default_series_are_per_process_name_and_short_lived_pids_add_none(exporter, fake_smi, tmp_path):
    # three data-loader workers of one name and a trainer on GPU 0: by name they are two series, not four
    procs = [(50000 + i, "loader", 0, 100) for i in range(3)] + [(50100, "trainer", 0, 4096)]
    apps = write_apps(tmp_path / "apps.csv", procs)
    exp = exporter(nvidia_smi=fake_smi(apps=apps), top_processes=3)
    wait_for(lambda: get(exp.url + "/healthz")[0] == 200, 30, "GPU samples")
    body = next_instant(exp, 0.0)
    fb = {lb["command"]: (lb, v) for lb, v in samples(body, FB) if lb["gpu"] == "0"}
    assert set(fb) == {"loader", "trainer"}
    labels, loaders = fb["loader"]
    assert labels == {"gpu": "0", "uuid": demo_uuids()[0], "command": "loader"}  # no pid, no user
    assert loaders == 300 * MiB  # the three workers summed
    assert fb["trainer"][1] == 4096 * MiB
    assert samples(body, "smiquery_gpu_processes")[0][1] == 4.0  # the count is still of processes


def test_by_name_the_series_stay_bounded_whatever_pids_come_and_go():
    from smiquery.sources.pmon import PmonRow

    col = SmiCollector(_Idle(), fields=[])
    series: dict[str, set[tuple[tuple[str, str], ...]]] = {"name": set(), "pid": set()}
    for instant_no in range(200):  # 200 instants, each with 8 short-lived workers under fresh pids
        rows = [PmonRow(gpu=0, pid=10000 + 8 * instant_no + k, command=f"worker{k % 3}", sm=k, fb=10) for k in range(8)]
        rows.append(PmonRow(gpu=0, pid=1, command="other", sm=50, fb=5))  # a process really named "other"
        for by in ("name", "pid"):
            for fam in col.pmon_families(process_instant(rows, 2, user_of=lambda pid: None, by=by)):
                series[by] |= {tuple(sorted(s.labels.items())) for s in fam.samples if s.name == SM}
    names = {dict(lb)["command"] for lb in series["name"]}
    # top 2 names + the rest: never more than 3 series, and the real "other" is not the bucket
    assert len(series["name"]) <= 3 and "other (process)" in names and "other" in names
    assert len(series["pid"]) > 200  # what per-pid series cost: opt-in


def test_a_bad_top_processes_by_is_refused():
    from smiquery.exporter import PmonWatcher

    with pytest.raises(ValueError, match="name or pid"):
        PmonWatcher(2, by="user", make_stream=lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="top_processes_by"):
        serve(port=0, top_processes=2, top_processes_by="user")
