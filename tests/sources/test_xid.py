"""Xid events from the kernel log: the line formats, the catalogue, a follower that tails, rotates and dedupes, and
the one watcher thread that counts them."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import Counter
from pathlib import Path

import pytest

from smiquery.errors import KernelLogError, UsageError
from smiquery.sample import bus_key
from smiquery.sources.details import parse_xml
from smiquery.sources.xid import (
    REJECT_REASONS,
    XID_CATALOGUE,
    XidEvent,
    XidFollower,
    XidWatcher,
    follow,
    gpu_for,
    parse_line,
    refusal,
)
from tests.helpers import wait_for

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "details-2gpu-mig.xml"
DEADLINE = 30.0  # generous: the follower polls every 0.05 s in these tests

KMSG = "4,{seq},{us},-;NVRM: Xid (PCI:0000:{bus}:00): {code}, pid={pid}, name=python, {text}"
DMESG = "[ {secs}] NVRM: Xid (PCI:0000:{bus}:00): {code}, {text}"
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def kmsg(seq: int, code: int, bus: str = "07", text: str = "GPU has fallen off the bus.") -> str:
    return KMSG.format(seq=seq, us=1_000_000 + seq, bus=bus, code=code, pid=100 + seq, text=text)


def test_kmsg_record():
    ev = parse_line(kmsg(812, 79) + "\n")
    assert ev == XidEvent(
        xid=79,
        pci_bus_id="0000:07:00",
        message="pid=912, name=python, GPU has fallen off the bus.",
        pid=912,
        process_name="python",
        seq=812,
        uptime=1.000812,
        raw=kmsg(812, 79),
    )


@pytest.mark.parametrize(
    ("line", "xid", "bus", "uptime"),
    [
        ("[ 5678.901234] NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double "
         "bit error (DBE) has been detected on GPU in the framebuffer at partition 1, subpartition 0.",
         48, "0000:3b:00", 5678.901234),
        ("Jan 12 03:04:05 node7 kernel: [  123.456789] NVRM: Xid (PCI:0000:81:00): 13, Graphics SM Warp Exception "
         "on (GPC 0, TPC 0): Out Of Range Address", 13, "0000:81:00", 123.456789),
        ("[Mon Jan 12 03:04:05 2026] NVRM: Xid (PCI:0000:c1:00): 94, pid=7, name=python, Contained: SM (0x1). "
         "RST: No, D-RST: No", 94, "0000:c1:00", None),
        ("Jan 12 03:04:05 node7 kernel: NVRM: Xid (0000:02:00): 31, Ch 00000010, engmask 00000101, intr 10000000",
         31, "0000:02:00", None),
        ("2026-12-05T10:00:00.123456+00:00 node7 kernel: [  123.456789] " + XID79, 79, "0000:3b:00", 123.456789),
        ("2026-12-05T10:00:00+0000 node7 kernel: " + XID79, 79, "0000:3b:00", None),
        ("Dec 05 10:00:00.123456 node7 kernel: " + XID79, 79, "0000:3b:00", None),
        ("Sat 2026-12-05 10:00:00 UTC node7 kernel: " + XID79, 79, "0000:3b:00", None),
        ("[ 1234.567890] node7 kernel: " + XID79, 79, "0000:3b:00", None),
        ("<6>1 2026-12-05T10:00:00.123456+00:00 node7 kernel - - - [ 1.5] " + XID79, 79, "0000:3b:00", 1.5),
        ("kern  :warn  : [  123.456789] " + XID79, 79, "0000:3b:00", 123.456789),
        ("[    5.000000] [    T1] " + XID79, 79, "0000:3b:00", 5.0),
    ],
    ids=["dmesg", "syslog", "dmesg-T", "journalctl-k", "rsyslog-iso", "short-iso", "short-precise", "short-full",
         "short-monotonic", "rfc5424-kernel", "dmesg-x", "printk-caller"],
)  # fmt: skip
def test_other_formats(line, xid, bus, uptime):
    ev = parse_line(line)
    assert ev is not None and refusal(line) is None
    assert (ev.xid, ev.pci_bus_id, ev.uptime, ev.seq) == (xid, bus, uptime, None)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("Dec  5 10:00:00 node7 user: " + XID79, "not_kernel"),  # `logger 'NVRM: Xid ...'`: logger's default tag
        ("Dec  5 10:00:00 node7 bob[4242]: " + XID79, "not_kernel"),
        ("Dec  5 10:00:00 node7 kernelx: " + XID79, "not_kernel"),
        ("Dec  5 10:00:00 node7 mallory: [ 1.0] kernel: " + XID79, "not_kernel"),
        ("2026-12-05T10:00:00.123456+00:00 node7 bob: " + XID79, "not_kernel"),
        ("<14>1 2026-12-05T10:00:00.123456+00:00 node7 bob - - - " + XID79, "not_kernel"),  # RFC 5424
        ("<14>Dec  5 10:00:00 node7 kernel: " + XID79, "not_kernel"),  # priority 14: the user facility
        ("12,813,1000900,-;" + XID79, "not_kernel"),  # written to /dev/kmsg by a program: the user facility
        ("user  :warn  : [  123.456789] " + XID79, "not_kernel"),  # dmesg -x
        ("<14>" + XID79, "unknown_format"),
        ("mallory: [ 1.0] kernel: " + XID79, "unknown_format"),
        ("  " + XID79, "unknown_format"),  # a continuation line (journalctl indents them)
        (XID79, "unknown_format"),
        ("Dec  5 10:00:00 node7 kernel: hello " + XID79, "unknown_format"),  # not where the kernel's text starts
        ("Dec  5 10:00:00 node7 kernel: NVRM: Xid (PCI:zz:00): 79, GPU has fallen off the bus.", "malformed"),
    ],
    ids=["logger", "tag-pid", "kernelx", "tag-then-kernel", "iso-bob", "rfc5424", "pri-user", "kmsg-user",
         "dmesg-x-user", "pri-only", "no-stamp", "indented", "bare", "inside-message", "malformed"],
)  # fmt: skip
def test_lines_the_kernel_did_not_write_are_refused_with_a_reason(line, reason):
    assert parse_line(line) is None
    assert refusal(line) == reason


@pytest.mark.parametrize(
    "line",
    [
        "6,1000,2000,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "[    3.1] nvidia-nvlink: Nvlink Core is being initialized",
        " SUBSYSTEM=pci",  # a kmsg continuation line
        "",
    ],
)
def test_lines_without_an_xid_are_none(line):
    assert parse_line(line) is None and refusal(line) is None


def test_the_catalogue_has_meaning_and_action_for_the_codes_people_page_on():
    for code, action in {79: "drain", 48: "drain", 95: "drain", 94: "reset", 63: "info", 64: "drain", 74: "drain",
                         13: "application", 31: "application", 43: "application"}.items():  # fmt: skip
        info = XID_CATALOGUE[code]
        assert info.action == action, code
        assert info.meaning and info.advice.endswith("."), code
    assert parse_line(kmsg(1, 79)).info is XID_CATALOGUE[79]  # type: ignore[union-attr]
    assert parse_line(kmsg(1, 1234)).info is None  # type: ignore[union-attr]


def test_bus_keys_match_the_kernel_and_nvidia_smi_spellings():
    assert bus_key("0000:3b:00") == bus_key("00000000:3B:00.0") == bus_key("3b:00.0") == (0, 0x3B, 0)
    assert bus_key("0001:3b:00") != bus_key("00000000:3B:00.0")
    assert bus_key("not a bus") is None


def test_events_are_counted_per_gpu_and_code():
    gpus = parse_xml(FIXTURE.read_text())
    lines = [kmsg(1, 79, "07"), kmsg(2, 48, "0f"), kmsg(3, 48, "0F"), DMESG.format(secs="9.5", bus="07", code=79,
             text="GPU has fallen off the bus."), DMESG.format(secs="9.6", bus="99", code=13, text="x")]  # fmt: skip
    counts: Counter[tuple[str | None, int]] = Counter()
    for line in lines:
        ev = parse_line(line)
        assert ev is not None
        gpu = gpu_for(ev, gpus)
        counts[(gpu.uuid if gpu else None, ev.xid)] += 1
    assert counts == {
        ("GPU-11111111-2222-3333-4444-555555555555", 79): 2,
        ("GPU-66666666-7777-8888-9999-000000000000", 48): 2,
        (None, 13): 1,  # a GPU not in the list: the caller decides
    }


# ------------------------------------------------------------------------------------------------ following


class Collector:
    """Runs a follower in a thread, as an exporter would; events arrive on a queue."""

    def __init__(self, follower: XidFollower) -> None:
        self.follower = follower
        self.events: queue.Queue[XidEvent] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for ev in self.follower:
            self.events.put(ev)

    def take(self, n: int) -> list[XidEvent]:
        return [self.events.get(timeout=DEADLINE) for _ in range(n)]

    def stop(self) -> None:
        self.follower.close()
        self.thread.join(DEADLINE)
        assert not self.thread.is_alive(), "close() did not end the follower"


def append(path: Path, *lines: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def test_a_plain_file_is_followed_across_appends_rotation_and_truncation(tmp_path):
    log = tmp_path / "kern.log"
    append(log, "boot noise", DMESG.format(secs="1.0", bus="07", code=79, text="off the bus"))
    c = Collector(follow(log, poll=0.05))
    try:
        assert [e.xid for e in c.take(1)] == [79]
        append(log, DMESG.format(secs="2.0", bus="07", code=48, text="DBE"))
        assert [e.xid for e in c.take(1)] == [48]
        log.rename(tmp_path / "kern.log.1")  # logrotate: a new file appears under the name
        append(log, DMESG.format(secs="3.0", bus="07", code=94, text="contained " + "x" * 80))
        assert [e.xid for e in c.take(1)] == [94]
        log.write_text("")  # copytruncate: seen as a file shorter than what was read (as tail -F sees it)
        append(log, DMESG.format(secs="4.0", bus="07", code=95, text="uncontained"))
        assert [e.xid for e in c.take(1)] == [95]
    finally:
        c.stop()
    assert c.events.empty()


def test_replayed_kmsg_records_are_counted_once(tmp_path):
    log = tmp_path / "kmsg.txt"
    append(log, kmsg(10, 79), kmsg(11, 48))
    c = Collector(follow(log, poll=0.05))
    try:
        assert [e.seq for e in c.take(2)] == [10, 11]
        log.rename(tmp_path / "old")  # a reader that re-opens gets the ring buffer again
        append(log, kmsg(10, 79), kmsg(11, 48), kmsg(12, 63))
        assert [e.seq for e in c.take(1)] == [12]
    finally:
        c.stop()
    assert c.events.empty()


def test_a_restart_resumes_after_the_last_sequence_number(tmp_path):
    log = tmp_path / "kmsg.txt"
    append(log, kmsg(10, 79), kmsg(11, 48), kmsg(12, 63))
    with follow(log, poll=0.05, after_seq=11) as f:
        assert next(f).seq == 12
        assert f.last_seq == 12


def test_close_from_another_thread_ends_a_waiting_follower(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    c = Collector(follow(log, poll=0.05))
    c.stop()
    assert c.follower.closed


def test_from_start_false_skips_what_is_already_there(tmp_path):
    log = tmp_path / "kern.log"
    append(log, kmsg(1, 79))
    c = Collector(follow(log, from_start=False, poll=0.05))
    try:
        append(log, kmsg(2, 48))
        assert [e.xid for e in c.take(1)] == [48]
    finally:
        c.stop()


def test_unreadable_logs_are_typed_errors(tmp_path):
    with pytest.raises(KernelLogError, match="no such file"):
        follow(tmp_path / "missing.log")
    with pytest.raises(KernelLogError, match="is a directory"):
        follow(tmp_path)
    with pytest.raises(UsageError, match="poll"):
        follow(tmp_path, poll=0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file without read permission")
def test_no_permission_says_how_to_get_it(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    log.chmod(0)
    with pytest.raises(KernelLogError, match="permission denied; run as root or with CAP_SYSLOG"):
        follow(log)


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg is not readable here")
def test_dev_kmsg_is_read_without_hanging():
    try:
        c = Collector(follow("/dev/kmsg", poll=0.05))
    except KernelLogError as exc:  # readable by mode, refused by the kernel (dmesg_restrict, a container)
        pytest.skip(str(exc))
    c.stop()


# ------------------------------------------------------------------------------------------------ the watcher


def test_a_restarted_watcher_gets_the_same_counts_back_from_the_replay(tmp_path):
    log = tmp_path / "kmsg.txt"
    log.write_text("".join(f"4,{900 + i},{i},-;NVRM: Xid (PCI:0000:18:00): 13, pid={i}, Graphics Exception\n"
                           for i in range(3)))  # fmt: skip
    counts = []
    for _ in range(2):  # an exporter restart: the second reader sees the same records again
        w = XidWatcher(log, poll=0.05).start()
        try:
            wait_for(lambda w=w: w.events == 3, what="three events")
            counts.append(w.counts())
        finally:
            w.close()
    assert counts[0] == counts[1] == {((0, 0x18, 0), 13): 3}
    assert w.series() == [((0, 0x18, 0), 13, "0000:18:00", 3)]


def test_with_retry_an_unreadable_log_is_one_error_however_many_attempts(tmp_path):
    errors: list[tuple[BaseException, bool]] = []
    w = XidWatcher(tmp_path / "missing", on_error=lambda e, opened: errors.append((e, opened)), retry=0.02)
    w.start()  # no raise: the thread tries again every `retry` seconds
    try:
        wait_for(lambda: w.attempts >= 5, what="five attempts")
        assert not w.up and w.last_error == "no such file"
    finally:
        w.close()
    assert len(errors) == 1 and isinstance(errors[0][0], KernelLogError) and errors[0][1] is False


def test_without_retry_start_raises_and_a_failing_listener_does_not_stop_the_following(tmp_path, caplog):
    with pytest.raises(KernelLogError, match="no such file"):
        XidWatcher(tmp_path / "missing").start()
    log = tmp_path / "kern.log"
    append(log, kmsg(1, 79))  # before the start: not news with from_start=False
    seen: queue.Queue[XidEvent] = queue.Queue()

    def listener(event: XidEvent) -> None:
        seen.put(event)
        raise RuntimeError("a listener's bug")

    w = XidWatcher(log, on_event=listener, from_start=False, poll=0.05).start()
    try:
        assert w.up
        append(log, kmsg(2, 48), kmsg(3, 94))
        assert [seen.get(timeout=DEADLINE).xid for _ in range(2)] == [48, 94]
    finally:
        w.close()
    assert w.counts() == {((0, 7, 0), 48): 1, ((0, 7, 0), 94): 1}
    assert "an Xid listener failed" in caplog.text


# ------------------------------------------------------------------------------------------------ forged lines


def test_a_rewritten_log_without_uptime_stamps_counts_each_record_once(tmp_path):
    log = tmp_path / "dmesg-T.log"
    old = "[Sat Dec  5 10:00:00 2026] " + XID79
    append(log, old, old)  # the same text twice in one reading: two events (a GPU can log the same line twice)
    c = Collector(follow(log, poll=0.05))
    try:
        assert [e.xid for e in c.take(2)] == [79, 79]
        log.write_text("")  # cut to zero, then saved again with one record more
        append(log, old, old, "[Sat Dec  5 10:05:00 2026] NVRM: Xid (PCI:0000:3b:00): 48, DBE")
        assert [e.xid for e in c.take(1)] == [48]
        log.rename(tmp_path / "old")  # or replaced by a file that starts with the same records
        append(log, old, old, "Dec  5 10:06:00 node7 kernel: NVRM: Xid (PCI:0000:3b:00): 94, pid=1, Contained")
        assert [e.xid for e in c.take(1)] == [94]
    finally:
        c.stop()
    assert c.events.empty()


def test_forged_lines_are_counted_by_reason_not_as_xids(tmp_path):
    log = tmp_path / "syslog"
    notes: list[str] = []
    w = XidWatcher(log, from_start=True, poll=0.05, retry=0.05, on_refused=notes.append).start()
    try:
        append(log, "Dec  5 10:00:00 node7 user: " + XID79, "<14>" + XID79, "Dec  5 10:00:01 node7 kernel: " + XID79)
        wait_for(lambda: w.events == 1 and sum(w.rejected().values()) == 2, what="one event and two refusals")
    finally:
        w.close()
    assert w.counts() == {((0, 0x3B, 0), 79): 1}
    assert w.rejected() == {"not_kernel": 1, "unknown_format": 1, "malformed": 0}
    assert set(w.rejected()) == set(REJECT_REASONS)
    assert len(notes) == 1 and "was not written by the kernel (not_kernel)" in notes[0] and "node7 user:" in notes[0]


def test_a_flood_of_distinct_lines_keeps_memory_bounded_and_warns_once(tmp_path, caplog):
    n = 120_000
    log = tmp_path / "syslog"
    with log.open("w", encoding="utf-8") as f:
        for i in range(n // 2):  # distinct bus ids: forged by a user, then "kernel"-tagged (as `logger -t kernel`)
            bus = f"{i >> 16:04x}:{(i >> 8) & 255:02x}:{i & 255:02x}"
            f.write(f"Dec  5 10:00:00 node7 user: NVRM: Xid (PCI:{bus}): 79, GPU has fallen off the bus.\n")
            f.write(f"Dec  5 10:00:00 node7 kernel: NVRM: Xid (PCI:{bus}): {i % 200}, pid={i}, forged\n")
    caplog.set_level(logging.WARNING, logger="smiquery")
    w = XidWatcher(log, poll=0.05).start()
    try:
        wait_for(lambda: w.events == n // 2 and w.rejected()["not_kernel"] == n // 2, what="the whole flood")
    finally:
        w.close()
    counts = w.counts()
    assert len(counts) == len(w.series()) == XidWatcher.MAX_SERIES  # the newest pairs, the rest in `other`
    assert sum(counts.values()) + w.other == n // 2
    assert ((0x0, 0xEA, 0x5F), (n // 2 - 1) % 200) in counts  # the last line's own pair is kept
    follower = w._follower
    assert follower is not None and len(follower._seen) <= 4096 and len(follower._pass) <= 4096
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "not_kernel" in warned[0].getMessage()  # one a minute


def test_the_note_about_refused_lines_is_once_a_minute_with_how_many_were_held_back(tmp_path):
    log = tmp_path / "syslog"
    now = [100.0]
    notes: list[str] = []
    w = XidWatcher(log, from_start=True, poll=0.05, retry=0.05, on_refused=notes.append, clock=lambda: now[0])
    w.start()
    try:
        append(log, *[f"Dec  5 10:00:00 node7 bob[{i}]: {XID79}" for i in range(5)])
        wait_for(lambda: w.rejected()["not_kernel"] == 5, what="five refusals")
        now[0] += 59.0
        append(log, "Dec  5 10:00:00 node7 bob[5]: " + XID79)
        wait_for(lambda: w.rejected()["not_kernel"] == 6, what="six refusals")
        assert len(notes) == 1 and "bob[0]" in notes[0]
        now[0] += 1.0
        append(log, "Dec  5 10:01:00 node7 bob[6]: \x1b[2J" + XID79)
        wait_for(lambda: len(notes) == 2, what="the second note")
    finally:
        w.close()
    assert "5 more refused since the last note" in notes[1] and "bob[6]: \\x1b[2J" in notes[1]
