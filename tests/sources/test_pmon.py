"""nvidia-smi pmon: the parser on own fixtures and real captures, the argv, summaries (the stream: tests/stream)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from smiquery import errors
from smiquery.sources.pmon import (
    PmonParser,
    PmonRow,
    build_pmon_argv,
    parse_pmon,
    process_share,
    process_user,
    sort_rows,
    top_processes,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------ parser


def test_um_fixture_types_every_column_and_keeps_dashes_missing() -> None:
    rows = parse_pmon(_fixture("pmon-h100x4-590-um.txt"))
    assert len(rows) == 18
    first = rows[0]
    assert first == PmonRow(gpu=0, pid=7001, type="C", sm=97, mem=31, fb=70312, command="python3")
    assert first.enc is None and first.jpg is None and first.ccpm is None
    watchdog = rows[1]
    assert watchdog.sm is None and watchdog.mem is None and watchdog.fb == 1024  # '-' is None, never 0
    assert rows[3].type == "M+C"
    idle = rows[4]
    assert idle.idle and idle.gpu == 2 and idle.command is None and idle.fb is None
    assert rows[5].command == "video_decode_wo"  # nvidia-smi truncates names to 15 characters
    assert (rows[5].enc, rows[5].dec, rows[5].jpg) == (0, 35, 2)


def test_old_driver_columns_timestamps_and_a_repeated_header() -> None:
    parser = PmonParser()
    rows = list(parser.parse(_fixture("pmon-v100x2-470-dt.txt").splitlines()))
    assert parser.columns == ("date", "time", "gpu", "pid", "type", "sm", "mem", "enc", "dec", "command")
    assert len(rows) == 6  # the header printed again mid-stream is no row
    assert rows[0].timestamp is not None and rows[0].timestamp.isoformat() == "2022-09-30T07:12:44"
    assert rows[0].jpg is None and rows[0].fb is None  # columns this driver/option set does not print
    assert rows[1].idle
    assert rows[-1] == PmonRow(
        gpu=1, pid=31402, type="C", sm=5, mem=0, enc=0, dec=0, command="python", date="20220930", time="07:12:48"
    )


def test_driver_message_is_a_notice_not_a_row() -> None:
    parser = PmonParser()
    assert list(parser.parse(_fixture("pmon-gt640-415-not-supported.txt").splitlines())) == []
    assert parser.notices == ["Not supported on the device(s)", "Failed to process command line"]


def test_row_without_header_needs_columns() -> None:
    with pytest.raises(errors.ParseError, match="before any header"):
        PmonParser().feed("    0       7001     C     97     31    python3")
    row = PmonParser(columns=["gpu", "pid", "type", "sm", "mem", "command"]).feed("    0  7001  C  97  31  my app")
    assert row == PmonRow(gpu=0, pid=7001, type="C", sm=97, mem=31, command="my app")


def test_damaged_rows_raise_in_strict_mode_and_are_counted_in_lenient_mode() -> None:
    header = _fixture("pmon-h100x4-590-um.txt").splitlines()[:2]
    bad = ["    0       7001     C     9x     31      -      -      -      -  70312    python3", "    0   7001"]
    with pytest.raises(errors.ParseError, match="line 3"):
        list(PmonParser().parse([*header, bad[0]]))
    lenient = PmonParser(strict=False)
    good = "    1       7001     C     88     29      -      -      -      -  70290    python3"
    assert [r.gpu for r in lenient.parse([*header, *bad, good])] == [1]
    assert lenient.dropped == 2 and lenient.last_error is not None


def test_unknown_future_column_is_read_past() -> None:
    text = "# gpu pid type sm newthing command\n# Idx # C/G % x name\n    0  12  C  50  7  train\n"
    assert parse_pmon(text) == [PmonRow(gpu=0, pid=12, type="C", sm=50, command="train")]


def _corpus_sections(corpus_dir: Path) -> Iterator[tuple[str, str, list[str]]]:
    for capture in sorted((corpus_dir / "captures").glob("*.txt")):
        lines = capture.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.startswith("# ") and line.endswith(":: pmon (per-process monitor)"):
                body = []
                for text in lines[i + 3 :]:
                    if not text.strip() or text.startswith("####"):
                        break
                    body.append(text)
                yield capture.stem, line.split()[1], body


def test_every_pmon_capture_in_the_corpus_parses(corpus_dir: Path) -> None:
    seen = 0
    for name, phase, body in _corpus_sections(corpus_dir):
        parser = PmonParser()
        rows = list(parser.parse(body))
        assert rows, (name, phase)
        assert parser.columns[:3] == ("gpu", "pid", "type") and parser.columns[-1] == "command"
        assert all(r.gpu == 0 for r in rows)
        assert all(r.idle == (r.pid is None) for r in rows)
        seen += 1
    assert seen >= 16


def test_corpus_values_survive(corpus_dir: Path) -> None:
    sections = {(n.split("__")[2], p): b for n, p, b in _corpus_sections(corpus_dir)}
    h100 = parse_pmon(sections[("nvidia-h100-80gb-hbm3", "load")])
    burn = [r for r in h100 if r.command == "gpu_burn"]
    assert burn and all((r.sm, r.mem, r.type) == (99, 10, "C") for r in burn)
    assert all(r.sm is None for r in h100 if r.command == "memhog")  # '-' for a process using no SM
    idle = parse_pmon(sections[("nvidia-h100-80gb-hbm3", "idle")])
    assert idle and all(r.idle and r.command is None for r in idle)
    windows = parse_pmon(sections[("nvidia-geforce-rtx-2080-super", "idle")])
    assert windows  # Linux 595 capture: graphics processes
    win = next(b for _, p, b in _corpus_sections(corpus_dir) if p == "idle" and any("NZXT CAM" in x for x in b))
    names = {r.command for r in parse_pmon(win)}
    assert {"NVIDIA Share.exe", "NZXT CAM.exe"} <= names  # names with spaces survive
    assert {r.type for r in parse_pmon(win)} == {"C+G"}


# ------------------------------------------------------------------------------------------------ argv


def test_argv_is_a_list_with_pmon_limits_checked() -> None:
    assert build_pmon_argv("/x/nvidia-smi", ("0", "1"), interval=2, count=3) == [
        "/x/nvidia-smi", "pmon", "-s", "um", "-d", "2", "-c", "3", "-o", "DT", "-i", "0,1",
    ]  # fmt: skip
    for bad in ({"interval": 0}, {"interval": 11}, {"interval": 1.5}, {"count": 0}, {"select": "x"}, {"options": "Z"}):
        with pytest.raises(ValueError, match="pmon"):
            build_pmon_argv("nvidia-smi", **bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ summaries


def test_top_processes_keeps_n_per_gpu_plus_other() -> None:
    rows = parse_pmon(_fixture("pmon-h100x4-590-um.txt"))[:6]
    top = top_processes(rows, 1)
    assert [r.pid for r in top[0]] == [7001, None]
    other = top[0][1]
    assert other.command == "other" and other.fb == 1024 and other.sm is None  # sums known values only
    assert [r.pid for r in top[1]] == [7001, None] and top[1][1].sm == 4
    assert top[2] == []  # idle GPU: no series at all
    assert [r.pid for r in top[3]] == [8800]  # nothing left over: no "other" row
    assert top_processes(rows, 5)[0] == rows[:2]
    assert [r.pid for r in top_processes(rows, 1, by="fb")[1]] == [7001, None]
    with pytest.raises(ValueError, match="by must be"):
        top_processes(rows, 1, by="bogus")


def test_process_share_says_who_else_is_on_my_gpu() -> None:
    rows = parse_pmon(_fixture("pmon-h100x4-590-um.txt"))[:6]
    shares = process_share(rows, {7001})
    assert set(shares) == {0, 1}  # only GPUs where "my" processes run
    assert shares[0].share == 1.0 and shares[0].shared and shares[0].other_pids == (7420,)
    assert shares[1].mine_sm == 88 and shares[1].others_sm == 4
    assert shares[1].share == pytest.approx(88 / 92)
    assert process_share(rows, {424242}) == {}
    every = process_share(rows, {7001}, every=True)  # also the GPUs none of mine is on
    assert every[0] == shares[0] and every[1] == shares[1]
    assert every[2].share is None and every[2].other_pids == ()  # idle
    assert every[3].share == 0.0 and every[3].others_sm == 12 and every[3].mine_sm is None


def test_sort_rows_puts_missing_values_last_in_both_directions() -> None:
    rows = parse_pmon(_fixture("pmon-h100x4-590-um.txt"))[:6]
    assert [r.sm for r in sort_rows(rows)] == [97, 88, 12, 4, None, None]
    assert [r.sm for r in sort_rows(rows, descending=False)] == [4, 12, 88, 97, None, None]
    assert [r.command for r in sort_rows(rows, "command", descending=False)][:2] == ["nccl-watchdog", "python3"]
    with pytest.raises(ValueError, match="by must be"):
        sort_rows(rows, "bogus")


def test_process_user_names_the_owner_of_a_visible_process() -> None:
    import os
    import pwd

    assert process_user(os.getpid()) == pwd.getpwuid(os.getuid()).pw_name
    assert process_user(2**22 + 12345) is None  # beyond pid_max: no such process
