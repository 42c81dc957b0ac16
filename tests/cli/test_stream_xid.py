"""``smiquery stream --kernel-log``: an Xid logged while the stream runs becomes one line naming the GPU and the cause.

A real ``python -m smiquery stream`` against the fake nvidia-smi executable; a plain file stands in for the
kernel log, and the test appends the driver's line to it while the stream runs.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO

import smiquery
from smiquery.sources.xid import XID_CATALOGUE
from tests.cli.test_cli import argv, cli_env
from tests.conftest import MakeFake

DEADLINE = 60.0
#: the driver's line in dmesg's format
FELL_OFF = "[ 5678.901234] NVRM: Xid (PCI:0000:5d:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n"


def _lines(stream: IO[bytes]) -> queue.Queue[str | None]:
    got: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for raw in iter(stream.readline, b""):
            got.put(raw.decode())
        got.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return got


def _until(got: queue.Queue[str | None], wanted: str) -> str:
    while True:
        line = got.get(timeout=DEADLINE)
        assert line is not None, f"the output ended before a line with {wanted!r}"
        if wanted in line:
            return line


def test_an_xid_appended_while_streaming_names_the_gpu_and_the_cause(fake_smi: MakeFake, tmp_path: Path) -> None:
    smi = fake_smi()
    by_bus = {str(s["pci.bus_id"]): s for s in smiquery.query(["index", "uuid", "pci.bus_id"], nvidia_smi=str(smi))}
    gpu = by_bus["00000000:5D:00.0"]  # the kernel prints it as 0000:5d:00
    log = tmp_path / "kern.log"
    # an Xid from before the stream started is history, not news
    log.write_text("[  10.000000] NVRM: Xid (PCI:0000:18:00): 48, pid=7, name=old, An uncorrectable ECC error\n")
    with subprocess.Popen(
        argv("stream", "-l", "200ms", "--format", "csv", "--kernel-log", log, smi=smi),
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as p:
        assert p.stdout is not None and p.stderr is not None
        out, err = _lines(p.stdout), _lines(p.stderr)
        try:
            header = _until(out, "timestamp")
            assert "pci.bus_id" in header  # queried to name the GPU of an Xid
            _until(out, "GPU-")  # a sweep came: the stream knows the bus ids
            with log.open("a") as f:
                f.write(FELL_OFF)
            line = _until(err, "Xid 79")
            p.send_signal(signal.SIGINT)
            p.wait(DEADLINE)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 130
    assert f"GPU {gpu.index} ({gpu.uuid}, PCI 0000:5d:00)" in line
    assert XID_CATALOGUE[79].meaning in line and "action drain" in line and "pid 4242 python" in line
    rest = []
    while (more := err.get(timeout=DEADLINE)) is not None:
        rest.append(more)
    assert not any("Xid 48" in x for x in rest)  # the old line was not shown, before or after


def test_xid_lines_the_kernel_did_not_write_are_one_note_not_an_xid(fake_smi: MakeFake, tmp_path: Path) -> None:
    smi = fake_smi()
    log = tmp_path / "syslog"
    log.write_text("")
    forged = "NVRM: Xid (PCI:0000:5d:00): 79, pid=4242, name=python, GPU has fallen off the bus."
    with subprocess.Popen(
        argv("stream", "-l", "200ms", "--format", "csv", "--kernel-log", log, smi=smi),
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as p:
        assert p.stdout is not None and p.stderr is not None
        out, err = _lines(p.stdout), _lines(p.stderr)
        try:
            _until(out, "GPU-")
            with log.open("a") as f:  # `logger`'s default tag, a program's tag, RFC 5424, a bare priority
                f.write(f"Dec  5 10:00:00 node7 user: {forged}\nDec  5 10:00:00 node7 bob[4242]: {forged}\n")
                f.write(f"<14>1 2026-12-05T10:00:00.123456+00:00 node7 bob - - - {forged}\n<14>{forged}\n")
            note = _until(err, "looks like an Xid")
            with log.open("a") as f:  # the kernel's own line marks the end of what the forged ones could do
                f.write("Dec  5 10:00:01 node7 kernel: NVRM: Xid (PCI:0000:5d:00): 48, pid=7, name=python, DBE\n")
            between = []
            while "Xid 48" not in (xid := err.get(timeout=DEADLINE) or "the end"):
                assert xid != "the end", "the output ended before the kernel's Xid 48"
                between.append(xid)
            p.send_signal(signal.SIGINT)
            p.wait(DEADLINE)
        finally:
            if p.poll() is None:
                p.kill()
    assert "was not written by the kernel (not_kernel)" in note and "node7 user:" in note
    assert "Xid 79" not in note and XID_CATALOGUE[48].meaning in xid
    rest = between
    while (more := err.get(timeout=DEADLINE)) is not None:
        rest.append(more)
    assert not any("Xid 79" in x or "looks like an Xid" in x for x in rest)  # one note, and no Xid 79


def test_an_unreadable_kernel_log_is_one_warning_and_the_stream_goes_on(fake_smi: MakeFake, tmp_path: Path) -> None:
    proc = subprocess.run(
        argv(
            "stream",
            "--count",
            "2",
            "-l",
            "100ms",
            "--format",
            "csv",
            "--kernel-log",
            tmp_path / "missing",
            smi=fake_smi(),
        ),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "kernel log" in line]
    assert len(warnings) == 1 and "no such file" in warnings[0] and "goes on without Xid errors" in warnings[0]
    assert len(proc.stdout.splitlines()) == 1 + 2 * 8  # the header and two sweeps of the fake's eight GPUs


def test_kernel_log_refuses_replay(tmp_path: Path) -> None:
    from importlib import resources

    demo = Path(str(resources.files("smiquery") / "data" / "demo-8gpu.csv"))
    proc = subprocess.run(
        argv("stream", "--replay", demo, "--speed", "0", "--kernel-log", tmp_path / "kern.log"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert proc.returncode == 2 and "--kernel-log goes with a live stream" in proc.stderr
