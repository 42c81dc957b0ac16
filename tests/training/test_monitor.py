"""The framework-neutral run monitor: aggregation as plain functions, position stamping, late data, rejected rule
fields, recording, energy and the job's metrics; a hand-driven source for timing-free tests, the in-process fake
nvidia-smi for the monitor's own loop, and the fake executable for the real process path."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from smiquery.alerts import AlertEvaluator, CallbackHandler, Rule
from smiquery.runner import Completed, LineSource
from smiquery.source import StreamStats, Sweep
from smiquery.sources.query_gpu import CsvParser
from smiquery.testing import InProcessRunner, use_runner
from smiquery.training.devices import visible_devices
from smiquery.training.epochs import EpochAccumulator, summary_spec, throughput_values
from smiquery.training.memory import GROWTH_RULE_TEXT, MemoryView
from smiquery.training.monitor import TRAINING_RULES, TRAINING_STALL_SECONDS, RunMonitor, stall_rule
from smiquery.training.outputs import run_monitor
from smiquery.training.watch import watch
from tests.conftest import FIXTURES, MakeFake
from tests.helpers import wait_for
from tests.leakcheck import no_leaks

UUIDS = ("GPU-00000000-1111-2222-3333-444444444444", "GPU-00000001-1111-2222-3333-444444444444")
PARSER = CsvParser(["index", "uuid", "utilization.gpu", "temperature.gpu", "memory.used", "power.draw"])


def sweep(util: float = 90, temp: float = 60, mem: float = 2000, power: float = 300, gpus: int = 2) -> Sweep:
    return Sweep(PARSER.parse([f"{g}, {UUIDS[g]}, {util}, {temp}, {mem}, {power}" for g in range(gpus)]))


class HandSource:
    """A SampleSource driven by the test: each :meth:`push` delivers one sweep to the monitor's reading thread."""

    def __init__(self) -> None:
        self.fields = ()
        self.stats = StreamStats()
        self._q: queue.Queue[Sweep | None] = queue.Queue()
        self.closed = threading.Event()

    def push(self, s: Sweep) -> None:
        self._q.put(s)

    def sweeps(self, count: int | None = None) -> Iterator[Sweep]:
        while not self.closed.is_set():
            item = self._q.get()
            if item is None:
                return
            yield item

    def close(self, timeout: float = 5.0) -> None:
        self.closed.set()
        self._q.put(None)


def hand_monitor(**options: Any) -> tuple[RunMonitor, HandSource]:
    src = HandSource()
    options.setdefault("alerts", ())
    options.setdefault("first_sample_timeout", 0.0)
    options.setdefault("env", {})
    monitor = RunMonitor(source=lambda *a, **k: src, **options)
    monitor.start()
    return monitor, src


def deliver(monitor: RunMonitor, src: HandSource, s: Sweep) -> None:
    """Push one sweep and wait until the reading thread has taken it."""
    marker = s[0]
    src.push(s)
    assert wait_for(lambda: monitor.latest().get(0) is marker)


# -------------------------------------------------------------------------------- visible devices (no Keras)


@pytest.mark.parametrize(
    ("value", "ids", "stream"),
    [
        (None, None, None),
        ("1,3", ("1", "3"), ("1", "3")),
        ("3,1", ("3", "1"), ("3", "1")),
        (" 2 ", ("2",), ("2",)),
        ("", (), None),
        ("-1", (), None),
        ("0,2,-1,3", ("0", "2"), ("0", "2")),
        ("0,x,1", ("0",), ("0",)),
        (UUIDS[1], (UUIDS[1],), (UUIDS[1],)),
        ("GPU-00000001", ("GPU-00000001",), None),  # a prefix: nvidia-smi needs whole UUIDs, rows are filtered
    ],
)
def test_visible_devices_follow_cuda_rules(value, ids, stream):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    vis = visible_devices(env)
    assert vis.ids == ids
    assert vis.stream_gpus() == stream
    assert vis.none == (ids == ())


def test_visible_devices_map_positions_by_index_and_uuid():
    vis = visible_devices({"CUDA_VISIBLE_DEVICES": "3,1"})
    assert vis.position(3, None) == 0  # TensorFlow's GPU:0 is nvidia-smi's GPU 3
    assert vis.position(1, None) == 1
    assert vis.position(0, None) is None
    assert not vis.selects(0, UUIDS[0])
    prefix = visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-00000001"})
    assert prefix.selects(1, UUIDS[1])
    assert not prefix.selects(0, UUIDS[0])
    assert visible_devices({}).selects(5, None)


def test_mig_devices_watch_every_gpu_and_say_why():
    vis = visible_devices({"CUDA_VISIBLE_DEVICES": "MIG-4f6bd3a2-1d0e-5a1d-9e3b-0d3c1d0e5a1d"})
    assert vis.ids is None
    assert "MIG" in vis.note


# ------------------------------------------------------------------------------------------ plain functions


def test_epoch_accumulator_means_maxima_and_energy():
    acc = EpochAccumulator(summary_spec(()))
    for util, power in ((50, 100.0), (100, 300.0)):
        for s in sweep(util=util, power=power):
            acc.add(s.index, s)
            acc.add_joules(s.index, power * 1.0)  # one second since that GPU's previous sample
    v = acc.values([0, 1])
    assert v["gpu0_util_mean"] == 75.0 and v["gpu0_util_max"] == 100.0
    assert v["gpu0_power_mean_w"] == 200.0
    assert v["gpu1_energy_wh"] == pytest.approx(400.0 / 3600.0)  # 100 W * 1 s + 300 W * 1 s
    empty = EpochAccumulator(summary_spec(())).values([0])
    assert math.isnan(empty["gpu0_util_mean"]) and math.isnan(empty["gpu0_energy_wh"])


def test_throughput_per_joule_and_data_wait_share():
    v = throughput_values(1.0, steps=360, samples=3600, seconds=100.0, data_wait=25.0)
    assert v["steps_per_joule"] == pytest.approx(0.1)  # 1 Wh = 3600 J
    assert v["samples_per_joule"] == pytest.approx(1.0)
    assert v["data_wait_frac"] == 0.25
    unknown = throughput_values(math.nan, steps=10, samples=None, seconds=1.0, data_wait=None)
    assert math.isnan(unknown["steps_per_joule"]) and "samples_per_joule" not in unknown
    assert "data_wait_s" not in unknown


def test_training_stall_is_the_reports_stall_held_for_a_minute():
    from smiquery.analysis import report as analyze
    from smiquery.recordings import to_dataframe

    assert TRAINING_STALL_SECONDS == 60.0
    assert stall_rule() in TRAINING_RULES
    assert not any("for 30m" in r for r in TRAINING_RULES)
    # one GPU idle at 5% for 70 s while holding memory: the report calls it a stall, the monitor's rule fires
    parser = CsvParser(["timestamp", "index", "utilization.gpu", "memory.used"])
    t0 = datetime(2026, 3, 14, 9, 30)
    lines = [
        f"{(t0 + timedelta(seconds=t)).strftime('%Y/%m/%d %H:%M:%S.000')}, 0, {95 if t < 10 else 5}, 4000"
        for t in range(90)
    ]
    samples = list(parser.parse(lines))
    report = analyze(to_dataframe(samples))
    assert report.stalls and report.stalls[0].seconds >= 60
    evaluator = AlertEvaluator([stall_rule()])
    fired = [e for s in samples for e in evaluator.update(s)]
    assert [e.state for e in fired] == ["firing"]
    assert fired[0].duration >= 60


# --------------------------------------------------------------------------------- stamping, off-thread handlers


def test_events_are_stamped_when_the_sample_arrived_although_a_handler_is_slow():
    release = threading.Event()
    seen: list[tuple[str, Any]] = []

    def slow(event: Any, ctx: Any) -> None:
        seen.append((event.state, ctx["batch"]))
        release.wait(30)  # a webhook that takes its time

    monitor, src = hand_monitor(alerts=["temperature.gpu > 85"], handlers=[CallbackHandler(slow)])
    with no_leaks(reap_timeout=5.0):
        monitor.begin_epoch(0)
        for b in range(10):
            monitor.step(batch=b)
        deliver(monitor, src, sweep(temp=90, gpus=1))  # fires at batch 10
        for b in range(10, 25):
            monitor.step(batch=b)
        deliver(monitor, src, sweep(temp=60, gpus=1))  # clears at batch 25, while the handler still sleeps
        assert [(a.event.state, a.batch, a.epoch) for a in monitor.alerts] == [("firing", 10, 0), ("cleared", 25, 0)]
        assert wait_for(lambda: len(seen) == 1)
        release.set()
        assert wait_for(lambda: len(seen) == 2)
        monitor.close()
    assert seen == [("firing", 10), ("cleared", 25)]


def test_samples_land_in_the_epoch_they_arrived_in_and_late_ones_are_folded_back():
    monitor, src = hand_monitor()
    with no_leaks(reap_timeout=5.0):
        monitor.begin_epoch(0)
        deliver(monitor, src, sweep(util=50))
        e0 = monitor.end_epoch(0)
        deliver(monitor, src, sweep(util=100))  # arrives after epoch 0 was summarised, still stamped epoch 0
        monitor.begin_epoch(1)
        deliver(monitor, src, sweep(util=10))
        e1 = monitor.end_epoch(1)
        monitor.close()
    assert e0["gpu0_util_max"] == 50.0
    assert e1["gpu0_util_max"] == 10.0  # epoch 1 is not polluted by epoch 0's late sweep
    assert e1["gpu_late_sweeps"] == 1.0  # ... which is flagged in the next epoch's logs
    assert monitor.epochs[0]["gpu0_util_max"] == 100.0  # and folded into epoch 0's own record


def test_first_data_after_the_first_epoch_still_fills_the_later_epochs():
    monitor, src = hand_monitor()
    with no_leaks(reap_timeout=5.0):
        monitor.begin_epoch(0)
        assert monitor.end_epoch(0) == {}  # nvidia-smi has not started yet: nothing to say, nothing fixed
        monitor.begin_epoch(1)
        deliver(monitor, src, sweep(util=77))
        e1 = monitor.end_epoch(1)
        monitor.close()
    assert e1["gpu0_util_mean"] == 77.0 and e1["gpu1_util_mean"] == 77.0
    assert any("first sample came" in n for n in monitor.notes)


def test_steps_samples_data_wait_and_energy_per_epoch():
    monitor, src = hand_monitor(interval=0.5)
    with no_leaks(reap_timeout=5.0):
        monitor.begin_epoch(0)
        deliver(monitor, src, sweep(power=100))
        for b in range(4):
            monitor.step_begin()
            monitor.step(batch=b, samples=32)
        deliver(monitor, src, sweep(power=100))
        values = monitor.end_epoch(0)
        monitor.close()
    assert monitor.totals.steps == 4 and monitor.totals.samples == 128
    assert values["gpu0_energy_wh"] > 0
    assert values["energy_wh"] == pytest.approx(values["gpu0_energy_wh"] + values["gpu1_energy_wh"])
    assert values["samples_per_joule"] == pytest.approx(128 / (values["energy_wh"] * 3600))
    assert values["data_wait_s"] >= 0 and 0 <= values["data_wait_frac"] <= 1


def test_framework_memory_maps_cuda_ordinals_and_words_the_gap():
    class Fake:
        name = "PyTorch"
        used = 1000.0

        def available(self) -> str | None:
            return None

        def read(self) -> list[MemoryView]:
            mib = 2**20
            return [MemoryView(0, 500 * mib, 800 * mib, Fake.used * mib)]

    monitor, src = hand_monitor(framework=Fake(), env={"CUDA_VISIBLE_DEVICES": "1"}, gpus=[0, 1])
    with no_leaks(reap_timeout=5.0):
        for epoch, mem in enumerate((2000, 2300, 2700, 3200)):
            monitor.begin_epoch(epoch)
            deliver(monitor, src, sweep(mem=mem))
            values = monitor.end_epoch(epoch)
        monitor.close()
    # cuda:0 is nvidia-smi's GPU 1 under CUDA_VISIBLE_DEVICES=1
    assert values["gpu1_mem_framework_mib"] == 500.0
    assert values["gpu1_mem_framework_reserved_mib"] == 1000.0
    assert values["gpu1_mem_gap_mib"] == 3200.0 - 1000.0  # driver-used minus the allocator's reserved pool
    assert "gpu0_mem_gap_mib" not in values
    said = [n for n in monitor.notes if "outside PyTorch's pool" in n]
    assert len(said) == 1 and "GPU 1" in said[0]


def test_a_growing_memory_gap_reaches_the_handlers_like_an_alert_once_per_gpu():
    class Fake:
        name = "PyTorch"

        def available(self) -> str | None:
            return None

        def read(self) -> list[MemoryView]:
            mib = 2**20
            return [MemoryView(0, 500 * mib, 800 * mib, 1000 * mib)]

    got: list[tuple[Any, dict[str, Any]]] = []
    handler = CallbackHandler(lambda event, context: got.append((event, dict(context))))
    # no alert rules at all: the memory event still goes to the handlers (snapshot:DIR, webhooks)
    monitor, src = hand_monitor(framework=Fake(), gpus=[0], handlers=[handler], env={"CUDA_VISIBLE_DEVICES": "0"})
    with no_leaks(reap_timeout=5.0):
        for epoch, mem in enumerate((2000, 2300, 2700, 3200, 3800, 4500)):
            monitor.begin_epoch(epoch)
            deliver(monitor, src, sweep(mem=mem, gpus=1))
            monitor.end_epoch(epoch)
        assert wait_for(lambda: len(got) >= 1)
        monitor.close()
    assert len(got) == 1  # once per GPU, though it kept growing
    event, context = got[0]
    assert event.state == "firing" and event.gpu == 0 and event.uuid == UUIDS[0]
    assert event.rule.text == GROWTH_RULE_TEXT and event.value == 3200.0 - 1000.0
    assert context["epoch"] == 3 and "outside PyTorch's pool" in context["message"]
    assert [a.event for a in monitor.alerts] == [event]


# ----------------------------------------------------------------------------------- real nvidia-smi (fake)


class Rejecting:
    """The in-process fake as a driver without ``reject``: a call naming it exits 2 with nvidia-smi's message."""

    def __init__(self, fake: InProcessRunner, reject: str) -> None:
        self.fake = fake
        self.reject = reject
        self.refusal = InProcessRunner(fault=f'exit:2:Field "{reject}" is not a valid field to query.')

    def _serving(self, argv: Any) -> InProcessRunner:
        return self.refusal if any(self.reject in a for a in argv) else self.fake

    def locate(self, nvidia_smi: Any) -> str:
        return self.fake.locate(nvidia_smi)

    def run(self, argv: Any, timeout: float) -> Completed:
        return self._serving(argv).run(argv, timeout)

    def lines(self, argv: Any) -> LineSource:
        return self._serving(argv).lines(argv)


def test_a_rule_field_the_driver_rejects_drops_that_rule_only(caplog):
    caplog.set_level(logging.WARNING, logger="smiquery.training.monitor")
    driver = Rejecting(InProcessRunner(), "clocks_throttle_reasons.hw_power_brake_slowdown")
    with no_leaks(reap_timeout=5.0), use_runner(driver), watch(interval=0.05, first_sample_timeout=20) as w:
        w.step(epoch=0, batch=0)
        assert wait_for(lambda: bool(w.monitor.latest()))
    values = w.epochs[0]
    assert any(k.endswith("_util_mean") and not math.isnan(v) for k, v in values.items())
    dropped = [str(r) for r in w.monitor.dropped_rules]
    assert dropped == ["clocks_event_reasons.hw_power_brake_slowdown == Active for 1m"]
    assert any("temperature.gpu" in str(r) for r in w.monitor.rules)  # the other rules stay
    warnings = [r for r in caplog.records if "rejects" in r.getMessage()]
    assert len(warnings) == 1


def test_default_rules_on_a_470_driver_keep_gpu_data_and_every_rule():
    """A pre-535 driver (old clocks_throttle_reasons names only): the core's spelling makes every rule usable."""
    # R470 rejects the clocks_event_reasons.* spelling with exit 2, as the real driver does
    driver = Rejecting(InProcessRunner(recording=FIXTURES / "t4-470-old-tokens.csv"), "clocks_event_reasons")
    with no_leaks(reap_timeout=5.0), use_runner(driver), watch(interval=0.05, first_sample_timeout=20) as w:
        w.step(epoch=0, batch=0)
        assert wait_for(lambda: bool(w.monitor.latest()))
    assert not w.monitor.dropped_rules
    assert not math.isnan(w.epochs[0]["gpu0_temp_max"])


def test_watch_records_the_run_for_smiquery_report_and_times_data_wait(fake_smi: MakeFake, tmp_path):
    # end to end: the fake executable as a real child, reaped when the block ends
    from smiquery.analysis import report as analyze

    record = tmp_path / "run.csv"
    seen: list[int] = []
    with (
        no_leaks(reap_timeout=5.0),
        watch(
            interval=0.05,
            nvidia_smi=str(fake_smi()),
            record=record,
            alerts=(),
            first_sample_timeout=20,
            on_epoch=lambda e, v: seen.append(e),
        ) as w,
    ):
        for epoch in range(2):
            for i, _batch in enumerate(w.batches(range(3))):
                w.step(epoch=epoch, batch=i, samples=8)
            assert wait_for(lambda: w.monitor.source is not None and len(w.monitor.latest()) > 0)
    assert seen == [0, 1]
    assert w.monitor.totals.steps == 6 and w.monitor.totals.samples == 48
    assert "data_wait_s" in w.epochs[1]
    report = analyze(record)
    assert report.gpus == tuple(range(8))  # the same nvidia-smi's samples, readable by `smiquery report`


def test_no_visible_gpu_and_missing_nvidia_smi_are_said_once(tmp_path):
    hidden = RunMonitor(env={"CUDA_VISIBLE_DEVICES": ""}, nvidia_smi=str(tmp_path / "none"))
    hidden.start()
    assert hidden.end_epoch(0) == {} and "hides every GPU" in hidden.notes[0]
    hidden.close()
    missing = RunMonitor(env={}, nvidia_smi=str(tmp_path / "no-such-nvidia-smi"))
    with no_leaks():
        missing.start()
        missing.close()
    assert len(missing.notes) == 1 and "GPU monitoring is off" in missing.notes[0]


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="log_every"):
        RunMonitor(log_every="step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pushgateway"):
        run_monitor(pushgateway="gateway:9091")
    with pytest.raises(ValueError, match="invalid alert"):
        RunMonitor(alerts=["temperature.gpu >"])
    assert isinstance(Rule.parse(stall_rule()), Rule)


def test_monitor_module_does_not_import_a_framework():
    code = (
        "import sys, smiquery.training.monitor, smiquery.training.watch; "
        "bad = [m for m in ('keras', 'tensorflow', 'torch', 'lightning', 'prometheus_client') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr


def test_closing_with_a_dead_webhook_is_bounded_and_counts_the_dropped_events():
    import socket

    from smiquery.alerts import WebhookHandler

    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen(16)  # accepts in the kernel, never answers
    try:
        hook = WebhookHandler(f"http://127.0.0.1:{dead.getsockname()[1]}/T0/B1/secret", timeout=60, min_interval=0)
        monitor, src = hand_monitor(alerts=["temperature.gpu > 85"], handlers=[hook])
        monitor.begin_epoch(0)
        for temp in (90, 60, 90, 60):  # four events: one in flight, three waiting
            deliver(monitor, src, sweep(temp=temp, gpus=1))
        assert wait_for(lambda: hook.pending == 3)
        started = time.monotonic()
        monitor.close()
        assert time.monotonic() - started < 15.0  # about 2 s, not the 60 s POST timeout
        assert hook.dropped == 3
        assert not monitor.running
    finally:
        dead.close()


def test_a_snapshot_handler_on_the_monitor_saves_the_recent_samples(tmp_path):
    from smiquery.alerts import SnapshotHandler

    snap = SnapshotHandler(tmp_path / "snaps", nvidia_smi=str(tmp_path / "no-nvidia-smi"))
    monitor, src = hand_monitor(alerts=["temperature.gpu > 85 for 2"], handlers=[snap])
    with no_leaks(reap_timeout=10.0):
        monitor.begin_epoch(0)
        for temp in (60, 90, 91, 92):
            deliver(monitor, src, sweep(temp=temp, gpus=1))
        assert wait_for(lambda: len(snap.taken) == 1)
        monitor.close()
    folder = Path(snap.taken[0])
    alert = json.loads((folder / "alert.json").read_text())
    assert alert["context"]["epoch"] == 0 and alert["event"]["gpu"] == 0
    lines = (folder / "samples.csv").read_text().splitlines()
    assert lines[0].startswith("index, uuid") and len(lines) == 1 + 3  # the history up to the firing sample


# ------------------------------------------------------------------------------------ forked children


@pytest.mark.parametrize("how", ["exit", "close", "os._exit", "pool"])
def test_a_forked_child_leaves_its_parents_run_alone(fake_smi, tmp_path, how):
    # DataLoader workers are forked from the training process: when one exits, the parent's run goes on, its
    # recording whole (rows after the fork in the final file) and its Pushgateway group in place until it ends
    from smiquery.recordings import read_recording
    from tests.training.test_metrics import _Gateway

    out = tmp_path / "run.parquet"
    result = tmp_path / "result.json"
    script = Path(__file__).with_name("fork_run.py")
    with _Gateway() as gw:
        done = subprocess.run(
            [sys.executable, str(script), how, str(out), gw.url, str(fake_smi()), str(result)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        calls = list(gw.calls)
    doc = json.loads(result.read_text(encoding="utf-8"))
    assert doc["journal_kept"] and doc["running"], doc
    # the parent's recording went on after the fork, into parts of its own
    stamps = [t.to_pydatetime().timestamp() for t in read_recording(out)["timestamp"]]
    assert min(stamps) < doc["forked"] < doc["forked"] + 0.5 < max(stamps)
    assert sorted(p.name for p in out.iterdir()) == ["_smiquery.json", "part-000001.parquet"]
    # one DELETE: the parent's, when its run ended (a child's would come before the parent's last pushes)
    deletes = [path for method, path, _ in calls if method == "DELETE"]
    assert len(deletes) == 1 and deletes[0].endswith("/run/fork"), calls
    assert calls[-1][0] == "DELETE"
    assert any(method == "PUT" for method, _, _ in calls)


# ---------------------------------------------------------------------------- CUDA's order against nvidia-smi's

_RTX = "GPU-40800000-1111-2222-3333-444444444444"
_H100 = "GPU-10000000-1111-2222-3333-444444444444"


def _two_gpus(path: Path, names: tuple[str, str]) -> Path:
    """nvidia-smi's GPU 0 and GPU 1 (by PCI bus), drawing 120 W and 650 W."""
    head = "timestamp, index, uuid, name, temperature.gpu, utilization.gpu [%], memory.used [MiB], power.draw [W]"
    rows = [f"2026/03/14 09:30:00.000, {i}, {u}, {n}, 60, 90 %, 1000 MiB, {w} W" for i, (u, n, w) in
            enumerate(zip((_RTX, _H100), names, (120, 650), strict=True))]  # fmt: skip
    path.write_text("\n".join([head, *rows]) + "\n", encoding="utf-8")
    return path


def _apps(path: Path, rows: list[tuple[int, str]]) -> Path:
    lines = ["pid, process_name, gpu_uuid, used_gpu_memory [MiB]"]
    lines += [f"{pid}, python, {uuid}, 2048 MiB" for pid, uuid in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _run_one_epoch(smi: Path, env: dict[str, str], wait: Any = None) -> RunMonitor:
    monitor = RunMonitor(interval=0.05, alerts=(), nvidia_smi=smi, env=env).start()
    try:
        assert wait_for(lambda: monitor.latest() and (wait is None or wait(monitor)), 30, "the watched GPU")
        monitor.begin_epoch(0)
        monitor.end_epoch(0)
    finally:
        monitor.close()
    return monitor


def test_on_a_mixed_host_the_monitor_watches_the_gpu_the_job_runs_on(fake_smi, tmp_path, caplog):
    # CUDA_VISIBLE_DEVICES=0 is the fastest GPU to CUDA (the H100, nvidia-smi's GPU 1), not nvidia-smi's GPU 0
    rec = _two_gpus(tmp_path / "mixed.csv", ("NVIDIA GeForce RTX 4080", "NVIDIA H100 80GB HBM3"))
    smi = fake_smi(recording=rec, apps=_apps(tmp_path / "apps.csv", [(4242, _RTX), (os.getpid(), _H100)]))
    with caplog.at_level(logging.INFO, logger="smiquery"):
        monitor = _run_one_epoch(smi, {"CUDA_VISIBLE_DEVICES": "0"}, lambda m: 1 in m.latest())
    assert set(monitor.latest()) == {1}
    values = monitor.epochs[0]
    assert values["gpu1_power_mean_w"] == 650 and "gpu0_power_mean_w" not in values
    assert [n for n in monitor.notes if "CUDA_DEVICE_ORDER" in n] == [
        "CUDA_VISIBLE_DEVICES=0 counts GPUs fastest first (CUDA_DEVICE_ORDER is not PCI_BUS_ID) and nvidia-smi by "
        "PCI bus, and this host mixes NVIDIA GeForce RTX 4080 and NVIDIA H100 80GB HBM3: watching GPU 1 "
        "(NVIDIA H100 80GB HBM3), where this job runs"
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "CUDA" in r.getMessage()]


def test_on_a_mixed_host_without_the_jobs_process_the_monitor_says_the_mapping_needs_pci_bus_order(
    fake_smi, tmp_path, caplog
):
    rec = _two_gpus(tmp_path / "mixed.csv", ("NVIDIA GeForce RTX 4080", "NVIDIA H100 80GB HBM3"))
    smi = fake_smi(recording=rec, apps=_apps(tmp_path / "apps.csv", [(4242, _RTX)]))
    with caplog.at_level(logging.WARNING, logger="smiquery"):
        monitor = _run_one_epoch(smi, {"CUDA_VISIBLE_DEVICES": "0"}, lambda m: m.notes)
    said = [n for n in monitor.notes if "CUDA_DEVICE_ORDER=PCI_BUS_ID" in n]
    assert len(said) == 1 and "may not be the job's" in said[0]
    assert len([r for r in caplog.records if "CUDA_DEVICE_ORDER=PCI_BUS_ID" in r.getMessage()]) == 1
    assert set(monitor.latest()) == {0}  # nvidia-smi's GPU 0, as the warning says


@pytest.mark.parametrize(
    ("names", "env"),
    [
        (("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), {"CUDA_VISIBLE_DEVICES": "0"}),
        (
            ("NVIDIA GeForce RTX 4080", "NVIDIA H100 80GB HBM3"),
            {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
        ),
        (("NVIDIA GeForce RTX 4080", "NVIDIA H100 80GB HBM3"), {"CUDA_VISIBLE_DEVICES": _RTX}),
    ],
    ids=["one-model", "pci-bus-order", "uuid"],
)
def test_where_indices_are_nvidia_smis_nothing_is_said(fake_smi, tmp_path, names, env):
    rec = _two_gpus(tmp_path / "gpus.csv", names)
    smi = fake_smi(recording=rec, apps=_apps(tmp_path / "apps.csv", [(os.getpid(), _H100)]))
    monitor = _run_one_epoch(smi, env)
    assert set(monitor.latest()) == {0}
    assert not [n for n in monitor.notes if "CUDA" in n]
