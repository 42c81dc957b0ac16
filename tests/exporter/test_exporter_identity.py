"""A GPU's series keep their identity: lost and stale GPUs, renumbering after a driver reload, honest recovery.

Issue 24 items 10, 11 and 13, and the UUID-keyed identity of issue 20: the scripted source drives the collector
sweep by sweep; the renumbering tests run the exporter on the in-process fake's ``reenumerate`` faults.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prometheus_client import CollectorRegistry

from smiquery.alerts import AlertEvaluator
from smiquery.errors import DriverVersionMismatchError
from smiquery.exporter import EventLog
from smiquery.fields import resolve_fields
from smiquery.sample import GpuSample, Schema
from smiquery.source import StreamEvent
from tests.exporter.test_exporter import (
    UUIDS,
    ScriptedSource,
    _sample,
    _scripted,
    collected,
    get,
    recorded,
    wait_for,
)

HOT = "temperature.gpu > 85 for 3"


def _native(i: int, uuid: str, **extra: str) -> dict[str, str]:
    return {"gpu": str(i), "uuid": uuid, "name": "NVIDIA H100", "pci_bus_id": f"00000000:{i:02X}:00.0", **extra}


def _hot_until_firing(src: ScriptedSource, col: Any, temps: tuple[float, float]) -> None:
    for _ in range(3):
        src.publish(_sample(0, UUIDS[0], temps[0]), _sample(1, UUIDS[1], temps[1]))
        col.refresh()


def test_a_lost_gpus_alert_state_ends_and_gpu_lost_carries_the_news():
    src, col, reg = _scripted(alerts=AlertEvaluator([HOT]))
    _hot_until_firing(src, col, (60, 95))
    hot = _native(1, UUIDS[1], alert=HOT)
    assert reg.get_sample_value("smiquery_alert_firing", hot) == 1.0
    # GPU 1 falls off the bus while hot: nvidia-smi prints [GPU is lost] in its row
    src.publish(_sample(0, UUIDS[0]), _sample(1, UUIDS[1], lost=True))
    col.refresh()
    assert reg.get_sample_value("smiquery_gpu_lost", _native(1, UUIDS[1])) == 1.0
    assert reg.get_sample_value("smiquery_alert_firing", hot) is None  # unknown, not firing forever
    assert reg.get_sample_value("smiquery_alert_fired_total", hot) == 1.0  # the counter keeps its history
    assert reg.get_sample_value("smiquery_alert_firing", _native(0, UUIDS[0], alert=HOT)) == 0.0
    # back, and still hot: the hold starts over from its first sample back
    src.publish(_sample(0, UUIDS[0]), _sample(1, UUIDS[1], 95))
    col.refresh()
    assert reg.get_sample_value("smiquery_gpu_lost", _native(1, UUIDS[1])) == 0.0
    assert reg.get_sample_value("smiquery_alert_firing", hot) == 0.0
    _hot_until_firing(src, col, (60, 95))
    assert reg.get_sample_value("smiquery_alert_firing", hot) == 1.0


def test_stale_data_ends_every_alert_state_and_up_says_why():
    src, col, reg = _scripted(alerts=AlertEvaluator([HOT]))
    _hot_until_firing(src, col, (95, 60))
    hot = _native(0, UUIDS[0], alert=HOT)
    assert reg.get_sample_value("smiquery_alert_firing", hot) == 1.0
    src._latest = (src._latest[0], 1e6)  # no new sample for a long time: the same sweep ages
    assert reg.get_sample_value("smiquery_up", {}) == 0.0
    assert reg.get_sample_value("smiquery_alert_firing", hot) is None
    assert reg.get_sample_value("smiquery_alert_firing", _native(1, UUIDS[1], alert=HOT)) is None
    # fresh data again: one hot sample is not three in a row across the gap
    src.publish(_sample(0, UUIDS[0], 95), _sample(1, UUIDS[1]))
    assert reg.get_sample_value("smiquery_up", {}) == 1.0
    assert reg.get_sample_value("smiquery_alert_firing", hot) == 0.0


def _dsample(index: int, uuid: str, lost: bool = False, temp: float = 60.0) -> GpuSample:
    schema = Schema(("index", "uuid", "name", "pci.bus_id", "driver_version", "temperature.gpu"))
    bus = f"00000000:{index:02X}:00.0"
    if lost:
        cells = (str(index), uuid, "[GPU is lost]", "[GPU is lost]", "[GPU is lost]", "[GPU is lost]")
        return GpuSample(schema, (index, uuid, None, None, None, None), cells, gpu_lost=True)
    values = (index, uuid, "NVIDIA H100", bus, "575.57.08", temp)
    return GpuSample(schema, values, tuple(str(v) for v in values), gpu_lost=False)


def test_dcgm_labels_of_a_gpu_do_not_change_when_it_is_lost():
    src = ScriptedSource()
    src.fields = resolve_fields(["index", "uuid", "name", "pci.bus_id", "driver_version", "temperature.gpu"])
    from smiquery.exporter import SmiCollector

    col = SmiCollector(src, fields=src.fields, naming="dcgm", hostname="node-1", alerts=AlertEvaluator([HOT]))
    reg: CollectorRegistry = collected(col)
    src.publish(_dsample(0, UUIDS[0]), _dsample(1, UUIDS[1]))
    col.refresh()
    lab = {
        "gpu": "1",
        "UUID": UUIDS[1],
        "device": "nvidia1",
        "modelName": "NVIDIA H100",
        "Hostname": "node-1",
        "pci_bus_id": "00000000:01:00.0",
        "DCGM_FI_DRIVER_VERSION": "575.57.08",
    }
    assert reg.get_sample_value("smiquery_gpu_lost", lab) == 0.0
    assert reg.get_sample_value("smiquery_alert_fired_total", {**lab, "alert": HOT}) == 0.0
    src.publish(_dsample(0, UUIDS[0]), _dsample(1, UUIDS[1], lost=True))
    col.refresh()
    # the same series, now 1: every label, the driver version included, is the one it had
    assert reg.get_sample_value("smiquery_gpu_lost", lab) == 1.0
    assert reg.get_sample_value("smiquery_alert_fired_total", {**lab, "alert": HOT}) == 0.0
    lost_series = [s for m in reg.collect() if m.name == "smiquery_gpu_lost" for s in m.samples]
    assert len(lost_series) == 2


def test_a_gpu_the_source_names_lost_by_uuid_is_lost_not_the_one_renumbered_into_its_index():
    src, col, reg = _scripted()
    src.publish(*(_sample(i, UUIDS[i]) for i in range(3)))
    col.refresh()
    # driver reload: GPU 1 is gone and the GPU that was 2 now delivers as 1; the stream names the lost one by UUID
    src.stats.lost_uuids = {UUIDS[1]: 1}
    src.stats.lost_gpus = {1}  # a stream that still lists the index must not make the renumbered GPU lost
    src.publish(_sample(0, UUIDS[0]), _sample(1, UUIDS[2]))
    col.refresh()
    assert reg.get_sample_value("smiquery_gpu_lost", _native(1, UUIDS[1])) == 1.0
    renumbered = {**_native(1, UUIDS[2]), "pci_bus_id": "00000000:01:00.0"}
    assert reg.get_sample_value("smiquery_gpu_lost", renumbered) == 0.0
    assert reg.get_sample_value("smiquery_temperature_gpu_celsius", renumbered) == 60.0
    assert col.lost_gpus() == [(1, UUIDS[1])]


def test_a_retry_within_stale_after_is_no_recovery_until_a_new_sample(caplog):
    changes: list[tuple[bool, str]] = []
    src, col, reg = _scripted(on_state=lambda up, why: changes.append((up, why)))
    src.publish(_sample(0, UUIDS[0]))
    assert reg.get_sample_value("smiquery_up", {}) == 1.0
    src.stats.state, src.stats.last_error_type = "retrying", "NvidiaSmiTimeoutError"
    assert reg.get_sample_value("smiquery_up", {}) == 0.0
    # the next start begins while the newest sample is still young: not data yet
    src.stats.state = "starting"
    assert reg.get_sample_value("smiquery_up", {}) == 0.0
    src.stats.state = "retrying"  # ...and it fails 60 ms later
    col.refresh()
    assert [up for up, _ in changes] == [False]
    src.stats.state = "running"
    src.publish(_sample(0, UUIDS[0]))
    assert reg.get_sample_value("smiquery_up", {}) == 1.0
    assert changes[-1] == (True, "ok") and len(changes) == 2


def test_an_unchanged_permanent_fault_is_logged_once_and_each_change_once(caplog):
    ev = EventLog(burst=100)
    err = DriverVersionMismatchError(["nvidia-smi"], 18, "Failed to initialize NVML: Driver/library version mismatch")
    with caplog.at_level(logging.DEBUG, logger="smiquery.exporter"):
        for _ in range(5):  # what the stream says on every retry of the same fault
            ev.on_stream_event(StreamEvent("error", err, str(err)))
            ev.on_stream_event(StreamEvent("restart", err, f"restarting nvidia-smi in 30.0 s after: {err}"))
        ev.on_stream_event(StreamEvent("recovered", None, "nvidia-smi delivers rows again"))
        ev.on_stream_event(StreamEvent("error", err, str(err)))
        ev.on_stream_event(StreamEvent("restart", err, f"restarting nvidia-smi in 2.0 s after: {err}"))
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(loud) == 3, loud
    assert "restarting nvidia-smi in 30.0 s" in loud[0] and "version mismatch" in loud[0]
    assert "delivers rows again" in loud[1] and "in 2.0 s" in loud[2]


def test_renumbered_gpus_keep_their_series_by_uuid(exporter, inproc, recording):
    rec = recorded(recording)
    # a driver reload after two sweeps; every later start serves GPU 1 gone and the rest renumbered down
    inproc.recording, inproc.fault = recording, "reenumerate:16:remove"
    exp = exporter(interval=0.1)
    gone, moved = rec[1]["uuid"], rec[2]["uuid"]

    def lost_line() -> str | None:
        body = get(exp.url + "/metrics")[1]
        m = re.search(rf'smiquery_gpu_lost\{{([^}}]*uuid="{gone}"[^}}]*)\}} 1\.0', body)
        return m.group(1) if m else None

    wait_for(lambda: lost_line() is not None, 30, "GPU 1 lost by its UUID")
    labels = lost_line()
    assert labels is not None and 'gpu="1"' in labels and f'pci_bus_id="{rec[1]["pci.bus_id"]}"' in labels
    body = get(exp.url + "/metrics")[1]
    # the GPU that took index 1 is not lost, and its series say so under its own UUID
    assert re.search(rf'smiquery_gpu_lost\{{gpu="1",[^}}]*uuid="{moved}"\}} 0\.0', body), body
    assert re.search(rf'smiquery_temperature_gpu_celsius\{{gpu="1",[^}}]*uuid="{moved}"\}}', body)
    assert len(re.findall(r"^smiquery_gpu_lost\{.* 1\.0$", body, re.M)) == 1
