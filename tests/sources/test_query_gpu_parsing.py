"""The --query-gpu CSV parser (smiquery.sources.query_gpu): lines in, typed records out; all else a ParseError."""

from __future__ import annotations

import string
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from smiquery.errors import ParseError
from smiquery.fields import CATALOGUE, Field, Kind, get_field, resolve_fields
from smiquery.kinds import MISSING_REASONS, missing_reason
from smiquery.sample import GpuSample, Value
from smiquery.sources.query_gpu import CsvParser, format_row, header_line, parse_lines

UTC = timezone.utc
PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- header, units, aliases ---------------------------------------------------------------------------------------


def test_header_with_units_and_nounits_values() -> None:
    lines = ["name, memory.used [MiB], power.draw [W], temperature.gpu", "NVIDIA L40S, 214, 39.17, 45"]
    (s,) = parse_lines(lines)
    assert s.fields == ("name", "memory.used", "power.draw", "temperature.gpu")
    assert (s.name, s.memory_used, s.power_draw, s.temperature_gpu) == ("NVIDIA L40S", 214, 39.17, 45)


def test_header_with_units_and_unit_values() -> None:
    lines = [
        "fan.speed [%], memory.used [MiB], power.draw [W], clocks.current.sm [MHz]",
        "38 %, 214 MiB, 39.17 W, 765 MHz",
    ]
    (s,) = parse_lines(lines)
    assert s.values() == (38, 214, 39.17, 765)
    assert s.raw["fan.speed"] == "38 %"


def test_noheader_needs_fields() -> None:
    with pytest.raises(ParseError, match="no header") as info:
        parse_lines(["38, 214"])
    assert info.value.lineno == 1
    (s,) = parse_lines(["38 %, 214 MiB"], ["fan.speed", "memory.used"])
    assert s.values() == (38, 214)


def test_header_names_aliases_map_to_canonical_fields() -> None:
    parser = CsvParser()
    assert parser.feed("gpu_name, clocks.gr [MHz], clocks_throttle_reasons.active") is None
    assert [f.name for f in parser.fields] == ["name", "clocks.current.graphics", "clocks_event_reasons.active"]
    s = parser.feed("NVIDIA A100, 1410, 0x0000000000000004")
    assert s is not None
    assert s.values() == ("NVIDIA A100", 1410, 4)


def test_aliases_in_fields_with_canonical_header() -> None:
    lines = ["name, clocks.current.graphics [MHz]", "NVIDIA A100, 1410"]
    (s,) = parse_lines(lines, ["gpu_name", "clocks.gr"])
    assert s["clocks.current.graphics"] == 1410


def test_header_that_does_not_match_the_fields() -> None:
    with pytest.raises(ParseError, match="header does not match"):
        parse_lines(["name, index", "x, 0"], ["index", "name"])


def test_units_come_from_the_header() -> None:
    parser = CsvParser()
    parser.feed("power_smoothing.curr_profile.ramp_up_rate [W/s], bbx.time_run [seconds]")
    assert parser.units == ("W/s", "seconds")
    s = parser.feed("1.50 W/s, 12 seconds")
    assert s is not None and s.values() == (1.5, 12)


# -- line handling -----------------------------------------------------------------------------------------------


def test_crlf_and_blank_lines() -> None:
    text = "\r\nindex, memory.used [MiB]\r\n\r\n0, 10\r\n   \r\n1, 20\r\n\r\n"
    samples = parse_lines(text)
    assert [s.values() for s in samples] == [(0, 10), (1, 20)]
    parser = CsvParser(["index"])
    assert parser.feed("7\r\n") is not None


def test_repeated_header_is_skipped() -> None:
    lines = ["index, power.draw [W]", "0, 1.00", "index, power.draw [W]", "1, 2.00"]
    assert [s.index for s in parse_lines(lines)] == [0, 1]


def test_infrom_warning_is_a_notice_not_data() -> None:
    lines = ["index, power.draw [W]", "0, 1.00", "WARNING: infoROM is corrupted at gpu 0000:01:00.0"]
    parser = CsvParser()
    samples = list(parser.parse(lines))
    assert len(samples) == 1
    assert parser.notices == ["WARNING: infoROM is corrupted at gpu 0000:01:00.0"]
    one = CsvParser(["fan.speed"])
    samples = list(one.parse(["39", "WARNING: infoROM is corrupted at gpu 0000:01:00.0"]))
    assert [s.fan_speed for s in samples] == [39]
    assert one.notices


def test_cells_split_on_comma_without_space() -> None:
    (s,) = parse_lines(["0,1.50"], ["index", "power.draw"])
    assert s.values() == (0, 1.5)


# -- status tokens -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("token", "reason"), sorted(MISSING_REASONS.items()))
def test_every_status_token_is_none_with_its_reason(token: str, reason: str) -> None:
    (s,) = parse_lines([f"0, {token}, GPU-1"], ["index", "power.draw", "uuid"])
    assert s.power_draw is None
    assert s.missing == {"power.draw": reason}
    assert missing_reason(token) == reason
    (t,) = parse_lines([f"0, {token}, GPU-1"], ["index", "name", "uuid"])
    assert t.name is None and t.missing == {"name": reason}


def test_unknown_bracket_token_keeps_its_text() -> None:
    (s,) = parse_lines(["[Some New Error], 0"], ["power.draw", "index"])
    assert s.power_draw is None
    assert s.missing["power.draw"] == "[Some New Error]"


def test_tokens_never_carry_units_and_are_never_zero() -> None:
    (s,) = parse_lines(["fan.speed [%], memory.used [MiB]", "[N/A], 0 MiB"])
    assert s.fan_speed is None and s.memory_used == 0
    assert "memory.used" not in s.missing


def test_gpu_is_lost_sets_gpu_lost() -> None:
    lines = ["timestamp, pci.bus_id, temperature.gpu", "2026/01/02 03:04:05.006, 00000000:01:00.0, [GPU is lost]"]
    (s,) = parse_lines(lines, tz=UTC)
    assert s.gpu_lost
    assert s.missing == {"temperature.gpu": "gpu_lost"}
    (ok,) = parse_lines([lines[1].replace("[GPU is lost]", "40")], ["timestamp", "pci.bus_id", "temperature.gpu"])
    assert not ok.gpu_lost


# -- errors ------------------------------------------------------------------------------------------------------


def test_wrong_column_count_raises_with_lineno_and_line() -> None:
    lines = ["index, power.draw [W]", "0, 1.00", "1, 2.00, 3"]
    with pytest.raises(ParseError) as info:
        parse_lines(lines)
    err = info.value
    assert err.lineno == 3
    assert err.line == "1, 2.00, 3"
    assert err.field is None
    assert "expected 2 columns" in str(err)


def test_bad_value_names_the_field() -> None:
    with pytest.raises(ParseError) as info:
        parse_lines(["index, power.draw [W]", "0, lots"])
    err = info.value
    assert (err.lineno, err.field, err.line) == (2, "power.draw", "0, lots")
    assert "power.draw" in str(err)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    ("field", "cell"),
    [
        ("index", "1.5"),
        ("index", "0x10"),
        ("pci.bus", "0xZZ"),
        ("persistence_mode", "Maybe"),
        ("retired_pages.pending", "Enabled"),
        ("clocks_event_reasons.gpu_idle", "Yes"),
        ("compute_cap", "9"),
        ("timestamp", "yesterday"),
        ("power.draw", "39.17 MHz"),
    ],
)
def test_values_that_do_not_fit_their_kind(field: str, cell: str) -> None:
    with pytest.raises(ParseError) as info:
        parse_lines([f"0, {cell}"], ["count", field])
    assert info.value.field == get_field(field).name


def test_lenient_mode_drops_and_counts() -> None:
    parser = CsvParser(["index", "power.draw"], strict=False)
    lines = ["0, 1.00", "1, 2.00, 3", "2, lots", "3, 4.00"]
    samples = list(parser.parse(lines))
    assert [s.index for s in samples] == [0, 3]
    assert parser.dropped == 2
    assert parser.last_error is not None and parser.last_error.lineno == 3
    assert parser.last_error.field == "power.draw"


# -- timestamps --------------------------------------------------------------------------------------------------


def test_timestamps_are_timezone_aware() -> None:
    (local,) = parse_lines(["2026/08/12 21:53:45.370"], ["timestamp"])
    assert local.timestamp is not None and local.timestamp.tzinfo is not None
    assert local.timestamp == datetime(2026, 8, 12, 21, 53, 45, 370000).astimezone()
    plus2 = timezone(timedelta(hours=2))
    (s,) = parse_lines(["2026/08/12 21:53:45.370"], ["timestamp"], tz=plus2)
    assert s.timestamp == datetime(2026, 8, 12, 19, 53, 45, 370000, tzinfo=UTC)


def test_timestamp_identity_attributes() -> None:
    (s,) = parse_lines(["2026/08/12 21:53:45.370, 3, GPU-abc"], ["timestamp", "index", "uuid"], tz=UTC)
    assert (s.index, s.uuid) == (3, "GPU-abc")
    assert s.timestamp == datetime(2026, 8, 12, 21, 53, 45, 370000, tzinfo=UTC)


# -- properties --------------------------------------------------------------------------------------------------

_TEXT = st.text(
    alphabet=st.sampled_from(string.ascii_letters + string.digits + " ./-_:()#+@éüß漢"), min_size=1, max_size=24
).filter(lambda v: v == v.strip() and missing_reason(v) is None and not v.startswith(("WARNING:", "ERROR:")))
_BRACKET_TOKENS = st.from_regex(r"\[[A-Za-z/ ]{1,16}\]", fullmatch=True)
_REASONS = st.sampled_from(sorted(set(MISSING_REASONS.values())))


def _values(fld: Field) -> st.SearchStrategy[Value]:
    kind = fld.kind
    if kind is Kind.INT:
        return st.integers(min_value=-(2**63), max_value=2**63 - 1)
    if kind in (Kind.HEX, Kind.BITMASK):
        return st.integers(min_value=0, max_value=2**64 - 1)
    if kind is Kind.FLOAT:
        return st.floats(allow_nan=False, width=64)
    if kind.is_bool:
        return st.booleans()
    if kind is Kind.TIMESTAMP:
        return st.datetimes(min_value=datetime(1000, 1, 1), max_value=datetime(9999, 12, 31)).map(
            lambda d: d.replace(microsecond=d.microsecond // 1000 * 1000, tzinfo=UTC)
        )
    if kind is Kind.MAJOR_MINOR:
        return st.from_regex(r"[0-9]{1,3}\.[0-9]{1,3}", fullmatch=True)
    return _TEXT


@st.composite
def _rows(draw: st.DrawFn) -> tuple[tuple[Field, ...], list[tuple[Value, str | None]], bool]:
    fields = tuple(draw(st.lists(st.sampled_from(CATALOGUE), min_size=1, max_size=8, unique_by=lambda f: f.name)))
    cells: list[tuple[Value, str | None]] = []
    for fld in fields:
        if draw(st.integers(0, 4)) == 0:
            reason = draw(st.one_of(_REASONS, _BRACKET_TOKENS.map(lambda t: missing_reason(t) or t)))
            cells.append((None, reason))
        else:
            cells.append((draw(_values(fld)), None))
    return fields, cells, draw(st.booleans())


@PROPERTY
@given(_rows())
def test_round_trip_format_then_parse(row: tuple[tuple[Field, ...], list[tuple[Value, str | None]], bool]) -> None:
    fields, cells, units = row
    header = header_line(fields)
    line = ", ".join(f.format(v, r, units=units) for f, (v, r) in zip(fields, cells, strict=True))
    assume(line.rstrip("\r\n\t ") and line != header)
    parser = CsvParser(fields, tz=UTC)
    assert parser.feed(header) is None
    sample = parser.feed(line)
    assert sample is not None
    assert sample.values() == tuple(v for v, _ in cells)
    assert dict(sample.missing) == {f.name: r for f, (v, r) in zip(fields, cells, strict=True) if v is None}
    assert format_row(sample, fields, units=units) == line
    assert format_row(sample, units=units) == line


_FIELD_SETS = st.lists(st.sampled_from(CATALOGUE), min_size=1, max_size=6, unique_by=lambda f: f.name).map(tuple)
_LINES = st.one_of(
    st.text(max_size=80),
    st.binary(max_size=80).map(lambda b: b.decode("utf-8", "replace")),
    st.lists(st.one_of(st.text(max_size=12), st.sampled_from(sorted(MISSING_REASONS))), max_size=7).map(", ".join),
)


def _check_sample(sample: GpuSample, fields: tuple[Field, ...]) -> None:
    for fld, value in zip(fields, sample.values(), strict=True):
        if value is None:
            assert fld.name in sample.missing
            continue
        assert fld.name not in sample.missing
        kind = fld.kind
        if kind in (Kind.INT, Kind.HEX, Kind.BITMASK):
            assert type(value) is int
        elif kind is Kind.FLOAT:
            assert type(value) is float
        elif kind.is_bool:
            assert type(value) is bool
        elif kind is Kind.TIMESTAMP:
            assert isinstance(value, datetime) and value.utcoffset() is not None
        else:
            assert type(value) is str


@PROPERTY
@given(_FIELD_SETS, st.lists(_LINES, min_size=1, max_size=5), st.booleans())
def test_any_input_gives_records_or_parse_error(fields: tuple[Field, ...], lines: list[str], with_fields: bool) -> None:
    parser = CsvParser(fields if with_fields else None, tz=UTC)
    for line in lines:
        errors: list[ParseError] = []
        try:
            sample = parser.feed(line)
        except ParseError as err:  # the only exception allowed; any other fails the test
            errors.append(err)
            sample = None
        assert all(err.lineno == parser.lineno for err in errors)
        if sample is not None:
            _check_sample(sample, parser.fields)


@PROPERTY
@given(_FIELD_SETS, st.binary(max_size=200))
def test_random_bytes_give_records_or_parse_error(fields: tuple[Field, ...], data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        samples = parse_lines(text, fields, tz=UTC)
    except ParseError:
        return
    for sample in samples:
        _check_sample(sample, fields)


def test_resolve_fields_feeds_the_parser() -> None:
    fields = resolve_fields("default")
    parser = CsvParser(fields)
    assert parser.fields == fields
