"""``KernelLog`` (``kernel_log=``): an Xid on a watched GPU reaches the run's handlers as an alert with its cause.

The fake nvidia-smi executable is the monitor's real child; a plain file in ``/dev/kmsg``'s record format stands
in for the kernel log, and the test appends the driver's record while the run goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import smiquery
from smiquery.alerts import AlertEvent, event_payload
from smiquery.sources.xid import XID_CATALOGUE
from smiquery.training.monitor import RunMonitor
from smiquery.training.outputs import KernelLog, XidAlert
from tests.conftest import MakeFake
from tests.helpers import wait_for
from tests.leakcheck import no_leaks

#: the driver's record as /dev/kmsg gives it (priority, sequence number, microseconds since boot)
FELL_OFF = "3,4712,5678901300,-;NVRM: Xid (PCI:0000:5d:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"
OTHER = "3,4711,5678901234,-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=x, An uncorrectable double bit error\n"


def test_an_xid_on_a_watched_gpu_is_an_alert_that_says_the_cause(fake_smi: MakeFake, tmp_path: Path) -> None:
    smi = str(fake_smi())
    gpus = {str(s["pci.bus_id"]): s for s in smiquery.query(["index", "uuid", "pci.bus_id"], nvidia_smi=smi)}
    fell = gpus["00000000:5D:00.0"]
    log = tmp_path / "kmsg"
    log.write_text("")
    got: list[tuple[AlertEvent, dict[str, Any]]] = []
    monitor = RunMonitor(
        interval=0.05,
        alerts=(),
        handlers=[lambda e, c: got.append((e, dict(c)))],
        nvidia_smi=smi,
        gpus=[str(fell.uuid)],  # only the GPU that falls off is this run's
        outputs=[KernelLog(log)],
    )
    with no_leaks(reap_timeout=5.0), monitor:
        monitor.begin_epoch(2)
        monitor.step(batch=6)
        wait_for(lambda: monitor.latest(), what="a first sample")
        with log.open("a") as f:
            f.write(OTHER + FELL_OFF)
        wait_for(lambda: got, what="the Xid alert")
    assert len(got) == 1  # the Xid on the GPU another job holds is not this run's
    event, context = got[0]
    assert isinstance(event, XidAlert)
    assert (event.gpu, event.uuid, event.xid, event.state) == (fell.index, fell.uuid, 79, "firing")
    assert context["epoch"] == 2 and context["batch"] == 7
    assert XID_CATALOGUE[79].meaning in event.message() and "action drain" in event.message()
    payload = json.loads(json.dumps(event_payload(event, context)))  # what a webhook posts
    assert payload["event"]["xid"] == 79 and payload["event"]["action"] == "drain"
    assert payload["event"]["advice"] == XID_CATALOGUE[79].advice
    assert [a.event for a in monitor.alerts] == [event]
    assert any("PCI 0000:18:00" in n and "not a GPU this run watches" in n for n in monitor.notes)


def test_an_unreadable_kernel_log_is_one_note_and_the_run_goes_on(fake_smi: MakeFake, tmp_path: Path) -> None:
    missing = KernelLog(tmp_path / "missing")
    monitor = RunMonitor(interval=0.05, alerts=(), nvidia_smi=str(fake_smi()), outputs=[missing])
    with no_leaks(reap_timeout=5.0), monitor:
        wait_for(lambda: monitor.latest(), what="samples although the kernel log is missing")
    notes = [n for n in monitor.notes if "kernel log" in n]
    assert len(notes) == 1 and "no such file" in notes[0] and "Xid errors are not reported" in notes[0]
