"""smiquery.frames and read_csv: samples and recorded CSV files -> DataFrames with typed columns."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pandas as pd
import pytest

from smiquery import frames, recordings
from smiquery.errors import ParseError
from smiquery.fields import get_field, resolve_fields
from smiquery.recordings import csvfile
from smiquery.sample import GpuSample, Schema
from smiquery.sources.query_gpu import CsvParser, format_row, header_line, parse_lines
from tests.corpus import require_corpus as _corpus_dir

ROOT = Path(__file__).resolve().parents[2]
UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


# Every value kind, with a unit, a large counter and a bitmask.
KINDS = (
    "timestamp",  # TIMESTAMP
    "index",  # INT
    "name",  # STR
    "driver_version",  # VERSION
    "compute_cap",  # MAJOR_MINOR
    "pci.bus",  # HEX
    "clocks_event_reasons.active",  # BITMASK
    "power.draw",  # FLOAT, W
    "memory.used",  # INT, MiB
    "temperature.gpu",  # INT, C (no header unit)
    "persistence_mode",  # ENABLED
    "retired_pages.pending",  # YES_NO
    "clocks_event_reasons.gpu_idle",  # ACTIVE
    "clocks_event_reasons_counters.sw_power_cap",  # INT, us, needs 64 bits
)
HEADER = header_line(resolve_fields(list(KINDS)))
ROWS = (
    "2026/08/12 21:53:45.370, 0, NVIDIA H100 80GB HBM3, 590.48.01, 9.0, 0x0C, 0x0000000000000004, 69.85, 0, 33, "
    "Enabled, No, Not Active, 15814595384",
    "2026/08/12 21:53:45.372, 1, NVIDIA H100 80GB HBM3, 590.48.01, 9.0, 0x1B, 0x0000000000000000, [N/A], "
    "[Insufficient Permissions], N/A, Disabled, [N/A], Active, 0",
    "2026/08/12 21:53:45.375, 2, , 590.48.01, [Not Supported], 0x3, 0x00000000000001FF, [Unknown Error], 81559, 0, "
    "[N/A], Yes, [GPU is lost], 212553937",
)
TEXT = HEADER + "\n" + "\n".join(ROWS) + "\n"
DTYPES = {
    "timestamp": "datetime64[ns, Europe/Berlin]",
    "index": "Int64",
    "name": "string",
    "driver_version": "string",
    "compute_cap": "string",
    "pci_bus": "Int64",
    "clocks_event_reasons_active": "Int64",
    "power_draw": "Float64",
    "memory_used": "Int64",
    "temperature_gpu": "Int64",
    "persistence_mode": "boolean",
    "retired_pages_pending": "boolean",
    "clocks_event_reasons_gpu_idle": "boolean",
    "clocks_event_reasons_counters_sw_power_cap": "Int64",
}
MISSING = {
    "power_draw": {1: "not_available", 2: "unknown_error"},
    "memory_used": {1: "insufficient_permissions"},
    "temperature_gpu": {1: "not_available"},
    "retired_pages_pending": {1: "not_available"},
    "persistence_mode": {2: "not_available"},
    "name": {2: "empty"},
    "compute_cap": {2: "not_supported"},
    "clocks_event_reasons_gpu_idle": {2: "gpu_lost"},
}


def _read(text: str | bytes, *args: object, **kw: object) -> pd.DataFrame:
    data = text.encode() if isinstance(text, str) else text
    return recordings.read_csv(io.BytesIO(data), *args, tz=kw.pop("tz", BERLIN), **kw)  # type: ignore[arg-type]


def _no_pyarrow(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import pyarrow.csv` raise ImportError, as on a machine without smiquery[fast].
    monkeypatch.setitem(sys.modules, "pyarrow.csv", None)


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a, b)
    assert a.attrs == b.attrs


# -- to_dataframe ------------------------------------------------------------------------------------------------


def test_dtypes_follow_the_catalogue() -> None:
    df = frames.to_dataframe(parse_lines(TEXT, tz=BERLIN))
    assert {c: str(t) for c, t in df.dtypes.items()} == DTYPES
    assert list(df.columns) == [get_field(n).attr for n in KINDS]


def test_values_are_typed_and_missing_is_na_never_zero() -> None:
    df = frames.to_dataframe(parse_lines(TEXT, tz=BERLIN))
    first = df.iloc[0]
    assert first["timestamp"] == pd.Timestamp("2026-08-12 21:53:45.370", tz=BERLIN)
    assert first["pci_bus"] == 0x0C
    assert first["clocks_event_reasons_active"] == 4
    assert first["memory_used"] == 0  # a real zero stays 0
    assert first["clocks_event_reasons_counters_sw_power_cap"] == 15814595384  # > 2**31
    for column, rows in MISSING.items():
        for row in rows:
            cell: Any = df.at[row, column]
            assert pd.isna(cell), (column, row)
    assert df["memory_used"].tolist()[1] is pd.NA
    assert df["persistence_mode"].tolist() == [True, False, pd.NA]
    assert df["clocks_event_reasons_gpu_idle"].tolist() == [False, True, pd.NA]
    assert df["memory_used"].sum() == 81559  # NA is skipped, never counted as 0


def test_attrs_units_missing_fields() -> None:
    df = frames.to_dataframe(parse_lines(TEXT, tz=BERLIN))
    assert df.attrs["fields"] == list(KINDS)
    units = df.attrs["units"]
    assert units["memory_used"] == "MiB"
    assert units["power_draw"] == "W"
    assert units["temperature_gpu"] == "C"
    assert units["clocks_event_reasons_counters_sw_power_cap"] == "us"
    assert units["name"] == ""
    assert frames.missing_reasons(df) == MISSING


def test_alias_gives_canonical_name_and_column() -> None:
    samples = parse_lines("NVIDIA A100, 1410\n", ["gpu_name", "clocks.gr"])
    df = frames.to_dataframe(samples)
    assert list(df.columns) == ["name", "clocks_current_graphics"]
    assert df.attrs["fields"] == ["name", "clocks.current.graphics"]


def test_empty_input_gives_empty_frame() -> None:
    df = frames.to_dataframe([])
    assert df.empty
    assert len(df) == 0
    assert frames.missing_reasons(df) == {}


def test_generator_input_and_mixed_queries() -> None:
    a = parse_lines("0, 30\n", ["index", "temperature.gpu"])
    b = parse_lines("1, 200\n", ["index", "memory.used"])
    df = frames.to_dataframe(iter(a + b))
    assert list(df.columns) == ["index", "temperature_gpu", "memory_used"]
    assert df["temperature_gpu"].tolist() == [30, pd.NA]
    assert df["memory_used"].tolist() == [pd.NA, 200]
    assert frames.missing_reasons(df) == {}  # a field a sample did not query has no reason


def test_bitmask_with_top_bit_set_becomes_uint64() -> None:
    df = frames.to_dataframe(parse_lines("0xFFFFFFFFFFFFFFFF\n0x0000000000000001\n", ["clocks_event_reasons.active"]))
    assert str(df["clocks_event_reasons_active"].dtype) == "UInt64"
    assert df["clocks_event_reasons_active"].tolist() == [2**64 - 1, 1]


def test_timestamps_keep_the_samples_zone() -> None:
    samples = parse_lines("2026/01/02 03:04:05.006, 1.50\n", ["timestamp", "power.draw"], tz=UTC)
    df = frames.to_dataframe(samples)
    assert str(df["timestamp"].dtype) == "datetime64[ns, UTC]"
    assert df["timestamp"][0] == pd.Timestamp(datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=UTC))


def test_to_dataframe_does_not_mutate_samples() -> None:
    samples = parse_lines(TEXT, tz=BERLIN)
    before = [s.to_dict() for s in samples]
    frames.to_dataframe(samples)
    assert [s.to_dict() for s in samples] == before


# -- read_csv ----------------------------------------------------------------------------------------------------


def test_read_csv_matches_to_dataframe() -> None:
    _same(_read(TEXT), _with_notices(frames.to_dataframe(parse_lines(TEXT, tz=BERLIN))))


def _with_notices(df: pd.DataFrame, notices: list[str] | None = None) -> pd.DataFrame:
    df.attrs["notices"] = notices or []
    return df


def test_read_csv_path_and_text_buffer(tmp_path: Path) -> None:
    path = tmp_path / "rec.csv"
    path.write_text(TEXT)
    expected = _read(TEXT)
    _same(recordings.read_csv(path, tz=BERLIN), expected)
    _same(recordings.read_csv(str(path), tz=BERLIN), expected)
    _same(recordings.read_csv(io.StringIO(TEXT), tz=BERLIN), expected)


def test_read_csv_headerless_with_fields() -> None:
    body = "\n".join(ROWS) + "\n"
    _same(_read(body, list(KINDS)), _read(TEXT))
    _same(_read(body, ",".join(KINDS)), _read(TEXT))


def test_read_csv_headerless_preset() -> None:
    line = "2026/08/12 21:53:45.370, 0, NVIDIA H100, GPU-1, 33, 5, 1, 100, 81559, 70.10"
    df = _read(line + "\n", "default")
    assert df.attrs["fields"] == [f.name for f in resolve_fields("default")]
    assert df["memory_total"].tolist() == [81559]


def test_read_csv_without_header_or_fields_fails() -> None:
    with pytest.raises(ParseError, match="no header") as info:
        _read("\n".join(ROWS) + "\n")
    assert info.value.lineno == 1


def test_read_csv_header_must_match_fields() -> None:
    with pytest.raises(ParseError, match="header does not match"):
        _read(TEXT, ["index"])


def test_read_csv_crlf_and_blank_lines() -> None:
    crlf = "\r\n" + TEXT.replace("\n", "\r\n\r\n")
    _same(_read(crlf), _read(TEXT))


def test_read_csv_units_in_values() -> None:
    text = "fan.speed [%], memory.used [MiB], power.draw [W], clocks.sm [MHz]\n38 %, 214 MiB, 39.17 W, 765 MHz\n"
    df = _read(text)
    assert df.iloc[0].tolist() == [38, 214, 39.17, 765]
    assert list(df.columns) == ["fan_speed", "memory_used", "power_draw", "clocks_current_sm"]


def test_read_csv_skips_a_row_with_a_bad_value_and_says_where() -> None:
    text = TEXT + ROWS[0].replace(" 33,", " hot,") + "\n" + ROWS[1] + "\n"
    df = _read(text)
    assert len(df) == 4
    skipped = df.attrs["skipped"]
    assert (skipped.count, skipped.first_lineno) == (1, 5)
    assert skipped.first_line == ROWS[0].replace(" 33,", " hot,")[:80]
    assert skipped.message("run.csv") == (
        "skipped 1 unreadable line in run.csv (first: line 5: field 'temperature.gpu': 'hot' is not a valid integer)"
    )


def test_read_csv_drops_thousands_of_bad_cells_in_one_more_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CSV written by pandas from float columns: "33.0" in an integer field, on every row.
    floats = [row.replace(" 33,", " 33.0,") for row in ROWS] * 1000
    text = HEADER + "\n" + "\n".join([*floats, ROWS[1]]) + "\n"
    passes = []
    convert_block = csvfile.ArrowCsvReader._convert_block

    def counted(self: csvfile.ArrowCsvReader, columns: Any) -> Any:
        block = convert_block(self, columns)
        passes.append(len(block.bad))
        return block

    chunk = csvfile.ArrowCsvReader._python_chunk
    calls = []

    def chunk_counted(self: csvfile.ArrowCsvReader, col: Any, fld: Any) -> Any:
        calls.append(fld.name)
        return chunk(self, col, fld)

    monkeypatch.setattr(csvfile.ArrowCsvReader, "_convert_block", counted)
    monkeypatch.setattr(csvfile.ArrowCsvReader, "_python_chunk", chunk_counted)
    df = _read(text)
    bad = sum(" 33.0," in row for row in floats)
    assert len(df) == len(floats) + 1 - bad
    assert df.attrs["skipped"].count == bad
    assert df.attrs["skipped"].reason == "field 'temperature.gpu': '33.0' is not a valid integer"
    # every bad cell of a column is found at once: one retry per block, not one per bad row
    assert calls.count("temperature.gpu") <= 2 * len(passes)
    with pytest.raises(ParseError, match=r"no readable rows \(1000 line\(s\) skipped.*'33.0' is not a valid integer"):
        _read(HEADER + "\n" + "\n".join([floats[0]] * 1000) + "\n")


def test_read_csv_skips_torn_and_garbage_lines() -> None:
    torn = ROWS[0][:25]
    text = TEXT + "2026/08/12 21:53:45.380, 3, too few\n" + "\x00\x17garbage@@\n" + ROWS[0] + "\n" + torn
    df = _read(text)
    assert len(df) == 4
    assert (df.attrs["skipped"].count, df.attrs["skipped"].first_lineno) == (3, 5)
    assert df.attrs["skipped"].first_line == "2026/08/12 21:53:45.380, 3, too few"


def test_read_csv_clean_file_has_no_skipped_lines() -> None:
    assert "skipped" not in _read(TEXT).attrs


def test_read_csv_no_readable_rows_is_an_error() -> None:
    with pytest.raises(ParseError, match="no readable rows") as info:
        _read(HEADER + "\nnonsense\n1, 2\n")
    assert info.value.lineno == 2


def test_read_csv_invalid_utf8_never_raises_unicode_error() -> None:
    good = _read(b"name, index\nGeForce \xff\xfe, 0\n")
    assert good["name"][0] == "GeForce \ufffd\ufffd"
    df = _read(b"index, name\n\xff1, GeForce\n2, GeForce\n")
    assert df["index"].tolist() == [2]
    assert df.attrs["skipped"].first_lineno == 2


def test_read_csv_notice_lines_and_repeated_header() -> None:
    text = TEXT + HEADER + "\n" + ROWS[0] + "\nWARNING: infoROM is corrupted at gpu 0000:01:00.0\n"
    df = _read(text)
    assert len(df) == 4
    assert df.attrs["notices"] == ["WARNING: infoROM is corrupted at gpu 0000:01:00.0"]


def test_read_csv_single_column_notice() -> None:
    df = _read("39\nWARNING: infoROM is corrupted at gpu 0000:01:00.0\n41\n", ["fan.speed"])
    assert df["fan_speed"].tolist() == [39, 41]
    assert df.attrs["notices"] == ["WARNING: infoROM is corrupted at gpu 0000:01:00.0"]


def test_read_csv_empty_inputs() -> None:
    assert _read("").empty
    df = _read(HEADER + "\n")
    assert len(df) == 0
    assert {c: str(t) for c, t in df.dtypes.items()} == DTYPES
    assert len(_read("", ["index"]).columns) == 1


def test_read_csv_keeps_timestamps_as_recorded_without_a_zone() -> None:
    df = recordings.read_csv(io.StringIO("timestamp\n2026/01/02 03:04:05.006\n"))
    assert str(df["timestamp"].dtype) == "datetime64[ns]"  # naive: nvidia-smi names no zone, so neither do we
    assert df["timestamp"][0] == pd.Timestamp("2026-01-02 03:04:05.006")


def test_read_csv_tz_option_names_the_recording_zone() -> None:
    df = recordings.read_csv(io.StringIO("timestamp\n2026/07/02 03:04:05\n"), tz="Europe/Berlin")
    assert str(df["timestamp"].dtype) == "datetime64[ns, Europe/Berlin]"
    assert df["timestamp"][0] == pd.Timestamp("2026-07-02 01:04:05", tz=UTC)
    with pytest.raises(ValueError, match="unknown time zone"):
        recordings.read_csv(io.StringIO("timestamp\n2026/07/02 03:04:05\n"), tz="Mars/Olympus")


def test_read_csv_iso_timestamps_take_the_exact_path() -> None:
    df = _read("timestamp, index\n2026-01-02T03:04:05.006+00:00, 0\n2026-01-02 05:04:05, 1\n")
    assert df["timestamp"].tolist() == [
        pd.Timestamp("2026-01-02 03:04:05.006", tz=UTC),
        pd.Timestamp("2026-01-02 05:04:05", tz=BERLIN),
    ]


def test_read_csv_hex_in_int_column_is_rejected_like_the_parser() -> None:
    df = _read("5\n0x10\n", ["index"])
    assert df["index"].tolist() == [5]
    assert df.attrs["skipped"].first_line == "0x10"


def test_read_csv_rare_token_after_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first rows decide which numeric columns the CSV reader converts itself; a later surprise restarts.
    monkeypatch.setattr(csvfile, "_HEAD_ROWS", 1)
    text = "index, power.draw [W]\n0, 10.50\n1, [N/A]\n2, [Unknown Error]\n3, 7.25 W\n"
    df = _read(text)
    assert df["power_draw"].tolist() == [10.5, pd.NA, pd.NA, 7.25]
    assert frames.missing_reasons(df) == {"power_draw": {1: "not_available", 2: "unknown_error"}}


def _big_recording(rows: int) -> str:
    fields = resolve_fields("default")
    start = datetime(2026, 3, 29, 0, 59, 0, tzinfo=UTC)
    out = [header_line(fields)]
    schema = Schema(tuple(f.name for f in fields))
    for n in range(rows):
        gpu = n % 4
        when = (start + timedelta(milliseconds=250 * n)).astimezone(BERLIN)
        values = (
            when,
            gpu,
            "NVIDIA L40S",
            f"GPU-{gpu:08d}",
            40 + n % 7,
            n % 101,
            None if n % 13 == 0 else n % 50,
            n * 7,
            46068,
            None if n % 17 == 0 else 100 + n % 200 / 4,
        )
        missing = {}
        if n % 13 == 0:
            missing["utilization.memory"] = "not_available"
        if n % 17 == 0:
            missing["power.draw"] = "unknown_error" if n % 2 else "not_available"
        raw = ("",) * len(fields)
        sample = GpuSample(schema, values, raw, missing)
        out.append(format_row(sample, fields))
    return "\n".join(out) + "\n"


def test_read_csv_many_blocks_keep_row_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _big_recording(3000)  # crosses a DST change in Europe/Berlin
    monkeypatch.setattr(csvfile, "_BLOCK_BYTES", 8192)
    monkeypatch.setattr(csvfile, "_HEAD_ROWS", 50)
    fast = _read(text)
    expected = _with_notices(frames.to_dataframe(parse_lines(text, tz=BERLIN)))
    _same(fast, expected)
    assert len(frames.missing_reasons(fast)["power_draw"]) == len(range(0, 3000, 17))
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("2026/03/29 03:10:00.000, 0,"))
    lines[row] = lines[row].replace(", 0,", ", x,", 1)
    df = _read("\n".join(lines) + "\n")
    assert len(df) == 2999
    assert (df.attrs["skipped"].first_lineno, df.attrs["skipped"].first_line) == (row + 1, lines[row][:80])
    # row positions of the missing reasons count the rows kept
    kept = _with_notices(frames.to_dataframe(parse_lines("\n".join(lines[:row] + lines[row + 1 :]), tz=BERLIN)))
    assert dict(frames.missing_reasons(df)) == dict(frames.missing_reasons(kept))


@pytest.mark.parametrize(
    "text",
    [
        TEXT,
        HEADER + "\n" + "\n".join(ROWS) + "\n" + HEADER + "\nWARNING: infoROM is corrupted at gpu 0000:01:00.0\n",
        "fan.speed [%], memory.used [MiB], power.draw [W]\n38 %, 214 MiB, 39.17 W\n[N/A], 1 MiB, [N/A]\n",
        "",
        HEADER + "\n",
    ],
    ids=["kinds", "notices", "units", "empty", "header-only"],
)
def test_fallback_without_pyarrow_gives_equal_frames(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    fast = _read(text)
    _no_pyarrow(monkeypatch)
    with pytest.raises(ImportError):
        import pyarrow.csv  # noqa: F401
    _same(_read(text), fast)


def test_fallback_without_pyarrow_skips_the_same_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    bad_value = TEXT + ROWS[0].replace(" 33,", " hot,") + "\n"
    bad_count = TEXT + "1, 2\n"
    found = []
    for patched in (False, True):
        if patched:
            _no_pyarrow(monkeypatch)
        for text in (bad_value, bad_count):
            found.append(_read(text).attrs["skipped"])
        with pytest.raises(ParseError) as info:
            _read(b"index\n\xff1\n")
        found.append(info.value.lineno)
    assert found[:3] == found[3:]


def test_one_column_output_sets_aside_every_nvidia_smi_message(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "index\n0\nNo devices were found\nWARNING: infoROM is corrupted at gpu 0000:01:00.0\n1\n"
    fast = _read(text)
    assert fast["index"].tolist() == [0, 1]
    assert fast.attrs["notices"] == ["No devices were found", "WARNING: infoROM is corrupted at gpu 0000:01:00.0"]
    _no_pyarrow(monkeypatch)
    _same(_read(text), fast)


def test_fallback_reads_headerless_files(monkeypatch: pytest.MonkeyPatch) -> None:
    body = "\n".join(ROWS) + "\n"
    fast = _read(body, list(KINDS))
    _no_pyarrow(monkeypatch)
    _same(_read(body, list(KINDS)), fast)


def test_corpus_files_read_like_the_parser() -> None:
    corpus = _corpus_dir()
    for path in sorted((corpus / "csv").glob("*.csv")) + sorted((corpus / "csv-loop").glob("*.csv")):
        df = recordings.read_csv(path, tz=BERLIN)
        expected = frames.to_dataframe(CsvParser(tz=BERLIN).parse(path.read_text().splitlines()))
        expected.attrs["notices"] = []
        _same(df, expected)


def test_import_smiquery_does_not_import_pandas() -> None:
    code = "import smiquery, sys; assert 'pandas' not in sys.modules and 'pyarrow' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=60)


def test_many_notices_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(csvfile, "_BLOCK_BYTES", 4096)
    lines = [HEADER]
    for n in range(300):
        lines.append(ROWS[n % 3])
        if n % 50 == 49:
            lines.append(f"WARNING: infoROM is corrupted at gpu 0000:{n:02X}:00.0")
    text = "\n".join(lines) + "\n"
    fast = _read(text)
    assert fast.attrs["notices"] == [line for line in lines if line.startswith("WARNING")]
    assert len(fast) == 300
    _no_pyarrow(monkeypatch)
    _same(_read(text), fast)


@pytest.mark.parametrize("stamp", ["1500-01-02 03:04:05", "  24/01/02 03:04:05.006"])
def test_timestamps_outside_datetime64_ns_are_skipped(monkeypatch: pytest.MonkeyPatch, stamp: str) -> None:
    text = f"timestamp, index\n2026/01/02 03:04:05.006, 0\n{stamp}, 1\n"
    fast = _read(text)
    assert fast["index"].tolist() == [0]
    assert fast.attrs["skipped"].first_lineno == 3
    _no_pyarrow(monkeypatch)
    slow = _read(text)
    assert slow["index"].tolist() == [0]
    assert slow.attrs["skipped"].first_lineno == 3


def test_missing_reasons_are_shared_not_copied() -> None:
    df = _read(TEXT)
    reasons = df.attrs["missing"]
    assert isinstance(reasons, frames.MissingReasons)
    assert df.iloc[1:].attrs["missing"] is reasons  # pandas copies attrs on every operation: this one is free
    assert frames.missing_reasons(df)["power_draw"] == {1: "not_available", 2: "unknown_error"}
    assert reasons.count("power_draw") == 2
    series = reasons.series("power_draw", len(df))
    assert series.isna().tolist() == [True, False, False]
    assert series.tolist()[1:3] == ["not_available", "unknown_error"]
    assert str(series.dtype) == "category"


# --------------------------------------------------------------------------------------------------------------
# one owner for recordings, and their time zones

DEMO = Path(__file__).parents[2] / "smiquery" / "data" / "demo-8gpu.csv"
LOG = "timestamp, index, power.draw [W]\n2026/03/14 09:30:00.117, 0, 70.00 W\n2026/03/14 09:30:01.117, 0, 71.00 W\n"


def test_frames_only_converts_and_reading_has_one_home() -> None:
    assert not hasattr(frames, "read_csv")
    assert {"read_csv", "read_recording", "open_recorder", "to_dataframe"} <= set(recordings.__all__)
    assert recordings.read_csv(io.StringIO(LOG))["power_draw"].tolist() == [70.0, 71.0]


def test_read_recording_of_a_single_gpu_jsonl_log_is_gpu_0_and_skips_a_torn_line(tmp_path: Path) -> None:
    from smiquery.recordings import read_recording

    path = tmp_path / "one.jsonl"
    path.write_text(
        '{"timestamp": "2026-03-14T09:30:00.117", "power.draw": 70.0}\n'
        '{"timestamp": "2026-03-14T09:30:01.117", "power.draw": null, "_missing": {"power.draw": "not_supported"}}\n'
        '{"timestamp": "2026-03-14T09:30:02.1',
        encoding="utf-8",
    )
    df = read_recording(path)
    assert df.columns.tolist() == ["index", "timestamp", "power_draw"]
    assert df["index"].tolist() == [0, 0]
    assert frames.missing_reasons(df) == {"power_draw": {1: "not_supported"}}
    torn = '{"timestamp": "2026-03-14T09:30:02.1'
    assert df.attrs["skipped"] == recordings.SkippedLines(1, 3, torn, "not a JSON object")


def test_read_recording_keeps_naive_csv_naive_in_every_format(tmp_path: Path) -> None:
    from smiquery.recordings import JsonlWriter, read_recording, replay

    csv = tmp_path / "log.csv"
    csv.write_text(LOG, encoding="utf-8")
    jsonl = tmp_path / "log.jsonl"
    with jsonl.open("w", encoding="utf-8") as fh:
        writer = JsonlWriter(fh)
        for sample in replay(csv, speed=0):
            writer.write(sample)
    for path in (csv, jsonl):
        df = read_recording(path)
        assert str(df["timestamp"].dtype) == "datetime64[ns]", path  # no zone was recorded: none is claimed
        assert df["timestamp"][0] == pd.Timestamp("2026-03-14 09:30:00.117")
        berlin = read_recording(path, tz="Europe/Berlin")
        assert str(berlin["timestamp"].dtype) == "datetime64[ns, Europe/Berlin]"
        assert berlin["timestamp"][0] == pd.Timestamp("2026-03-14 08:30:00.117", tz=UTC)


def test_read_recording_keeps_a_recorded_zone_and_converts_it(tmp_path: Path) -> None:
    from smiquery.recordings import read_recording, replay
    from smiquery.recordings.parquet import write_frame

    pytest.importorskip("pyarrow")
    path = tmp_path / "zoned.parquet"
    write_frame(
        frames.to_dataframe(replay(DEMO, speed=0, tz="Europe/Berlin", fields="timestamp,index,power.draw")), path
    )
    kept = read_recording(path)
    assert str(kept["timestamp"].dtype) == "datetime64[ns, Europe/Berlin]"
    utc = read_recording(path, tz="UTC")
    assert str(utc["timestamp"].dtype) == "datetime64[ns, UTC]"
    assert utc["timestamp"][0] == kept["timestamp"][0] and utc["timestamp"][0].hour == 8


def test_an_unknown_zone_is_a_typed_one_line_error(tmp_path: Path) -> None:
    from smiquery.errors import InvalidTimeZoneError
    from smiquery.recordings import read_recording

    path = tmp_path / "log.csv"
    path.write_text(LOG, encoding="utf-8")
    for read in (lambda: read_recording(path, tz="Mars/Olympus"), lambda: recordings.read_csv(path, tz="Mars/Olympus")):
        with pytest.raises(InvalidTimeZoneError, match=r"unknown time zone 'Mars/Olympus'; give an IANA name") as e:
            read()
        assert e.value.zone == "Mars/Olympus" and "\n" not in str(e.value)


def test_read_recording_fields_name_headerless_columns_or_must_agree_with_the_header(tmp_path: Path) -> None:
    from smiquery.errors import RecordingError
    from smiquery.recordings import csv_header, read_recording

    with_header = tmp_path / "with.csv"
    with_header.write_text(LOG, encoding="utf-8")
    without = tmp_path / "without.csv"
    without.write_text(LOG.split("\n", 1)[1], encoding="utf-8")
    assert csv_header(with_header) == ("timestamp", "index", "power.draw")
    assert csv_header(without) is None
    with pytest.raises(RecordingError, match="--fields"):
        read_recording(without)
    a = read_recording(with_header)
    b = read_recording(without, fields="timestamp,index,power.draw")
    assert b.attrs["headerless"] is True and "headerless" not in a.attrs
    pd.testing.assert_frame_equal(a, b, check_like=False)
    assert read_recording(with_header, fields="power.draw").columns.tolist() == a.columns.tolist()
    with pytest.raises(RecordingError, match=r"does not agree with .*it has no temperature\.gpu"):
        read_recording(with_header, fields="timestamp,temperature.gpu")
    with pytest.raises(RecordingError, match=r"rows do not fit --fields timestamp,power\.draw"):
        read_recording(without, fields="timestamp,power.draw")
