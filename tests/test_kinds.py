"""smiquery.kinds: each value kind parses, writes, shows, types and scales its cells, and units own precision."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone

import pytest

import smiquery
from smiquery.cli.display import display_value
from smiquery.fields import CATALOGUE, Field, get_field
from smiquery.kinds import FIELD_KINDS, MISSING_REASONS, UNITS, FieldKind, Kind, to_number, unit_info
from smiquery.recordings import to_dataframe
from smiquery.sample import Value
from smiquery.sources.query_gpu import parse_lines

UTC = timezone.utc

# One typical value per kind, and the field it is tried on.
SAMPLES: dict[Kind, tuple[str, Value]] = {
    Kind.INT: ("memory.used", 70743),
    Kind.FLOAT: ("power.draw", 69.85),
    Kind.STR: ("name", "NVIDIA H100 80GB HBM3"),
    Kind.ENABLED: ("persistence_mode", True),
    Kind.YES_NO: ("clocks_event_reasons.hw_slowdown", False),
    Kind.ACTIVE: ("clocks_event_reasons.hw_slowdown", False),
    Kind.HEX: ("pci.device_id", 0x233010DE),
    Kind.BITMASK: ("clocks_event_reasons.active", 0x8000000000000001),
    Kind.TIMESTAMP: ("timestamp", datetime(2026, 3, 14, 9, 26, 53, 123000, tzinfo=UTC)),
    Kind.VERSION: ("driver_version", "590.48.01"),
    Kind.MAJOR_MINOR: ("compute_cap", "9.0"),
}


def _field_of_kind(kind: Kind) -> Field:
    """A catalogue field of ``kind`` (the sample's field when it has that kind)."""
    name = SAMPLES[kind][0]
    fld = get_field(name)
    if fld.kind is kind:
        return fld
    return next(f for f in CATALOGUE if f.kind is kind)


def test_every_kind_has_one_field_kind_and_the_old_homes_give_the_same_enum() -> None:
    assert set(FIELD_KINDS) == set(Kind)
    assert all(isinstance(k.ops, FieldKind) and k.ops.kind is k for k in Kind)
    assert smiquery.fields.Kind is Kind
    assert Kind("integer") is Kind.INT


def test_quantities_are_integers_and_decimals_not_ids_or_masks() -> None:
    assert {k for k in Kind if k.is_quantity} == {Kind.INT, Kind.FLOAT}
    assert {k for k in Kind if k.is_numeric} == {Kind.INT, Kind.FLOAT, Kind.HEX, Kind.BITMASK}
    assert {k for k in Kind if k.is_bool} == {Kind.ENABLED, Kind.YES_NO, Kind.ACTIVE}


def test_every_catalogue_kind_is_sampled() -> None:
    assert {f.kind for f in CATALOGUE} <= set(SAMPLES)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@pytest.mark.parametrize("units", [False, True], ids=["nounits", "units"])
def test_every_kind_round_trips_format_then_parse(kind: Kind, units: bool) -> None:
    fld = _field_of_kind(kind)
    value = SAMPLES[kind][1]
    cell = fld.format(value, units=units)
    parsed = fld.parse(cell, tz=UTC)
    assert parsed == value
    assert type(parsed) is type(value)
    # and through the row parser, with a header as nvidia-smi prints it
    (sample,) = parse_lines([fld.header, cell], tz=UTC)
    assert sample[fld.name] == value


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
@pytest.mark.parametrize("token", [t for t in MISSING_REASONS if t], ids=str)
def test_status_tokens_stay_missing_for_every_kind(kind: Kind, token: str) -> None:
    fld = _field_of_kind(kind)
    assert fld.parse(token) is None
    assert fld.parse(f" {token} ") is None
    (sample,) = parse_lines([fld.header, token])
    assert sample[fld.name] is None
    assert sample.missing[fld.name] == MISSING_REASONS[token]


@pytest.mark.parametrize("reason", ["not_supported", "gpu_lost", "insufficient_permissions"])
def test_a_missing_value_is_written_as_its_token_even_with_units(reason: str) -> None:
    fld = get_field("memory.used")
    cell = fld.format(None, reason, units=True)
    assert cell.startswith("[") and "MiB" not in cell
    (sample,) = parse_lines([fld.header, cell])
    assert sample.missing["memory.used"] == reason


def test_a_cell_that_is_no_value_of_the_kind_is_rejected_with_its_kind() -> None:
    with pytest.raises(ValueError, match="'lots' is not a valid integer"):
        get_field("memory.used").parse("lots")
    with pytest.raises(ValueError, match="is not a valid enabled/disabled"):
        get_field("persistence_mode").parse("On")


def test_units_are_stripped_only_when_they_are_the_fields_own() -> None:
    assert get_field("memory.used").parse("214 MiB") == 214
    assert get_field("power.draw").parse("69.85 W") == 69.85
    with pytest.raises(ValueError, match="'214 W' is not a valid integer"):
        get_field("memory.used").parse("214 W")


def test_display_rounds_to_the_units_precision() -> None:
    power = get_field("power.draw")
    assert power.display(69.853) == "69.85"
    assert power.display(700.0) == "700.00"
    assert power.display(69.853, with_unit=True) == "69.85 W"
    assert get_field("memory.used").display(70743) == "70743"
    assert get_field("utilization.gpu").display(38, with_unit=True) == "38 %"
    assert power.display(None) == "n/a"
    assert display_value(power, None, "not_supported") == "n/s"
    stamp = datetime(2026, 3, 14, 9, 26, 53, 123456)
    assert get_field("timestamp").display(stamp) == "2026-03-14 09:26:53.123"
    assert get_field("persistence_mode").display(True) == "Enabled"
    # the CSV cell keeps every digit, so that parsing it gives the value back
    assert power.format(69.853) == "69.853"


def test_summary_precision_follows_the_unit() -> None:
    ops = Kind.FLOAT.ops
    assert ops.summary_digits("MiB") == 0  # a p95 of memory.used is whole MiB, never 70743.1
    assert ops.summary_digits("%") == 0
    assert ops.summary_digits("W") == 1
    assert Kind.INT.ops.summary_digits("") == 0
    assert ops.summary_digits("") == 1


@pytest.mark.parametrize(
    ("name", "value", "base"),
    [
        ("memory.used", 2, 2 * 1048576.0),
        ("clocks.current.sm", 1980, 1980e6),
        ("utilization.gpu", 38, 0.38),
        ("power.draw", 69.85, 69.85),
        ("persistence_mode", True, 1.0),
        ("name", "NVIDIA H100", None),
    ],
)
def test_values_scale_to_prometheus_base_units(name: str, value: Value, base: float | None) -> None:
    # what the exporter computes: the number (bools as 1/0) times the unit's scale
    number = to_number(value)
    got = None if number is None else number * unit_info(get_field(name).unit).scale
    assert got == (pytest.approx(base) if base is not None else None)


def test_units_name_their_base_unit() -> None:
    assert unit_info("MiB").base == "bytes"
    assert unit_info("MHz").base == "hertz"
    assert unit_info("%").base == "ratio"
    assert unit_info("furlongs").scale == 1.0 and unit_info("furlongs").base == ""
    assert {f.unit for f in CATALOGUE if f.unit} <= set(UNITS)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name)
def test_frame_columns_take_the_kinds_dtype(kind: Kind) -> None:
    fld = _field_of_kind(kind)
    value = SAMPLES[kind][1]
    df = to_dataframe(parse_lines([fld.header, fld.format(value), fld.format(None)], tz=UTC))
    dtype = str(df[fld.attr].dtype)
    expected = kind.ops.dtype
    if kind is Kind.BITMASK:
        expected = "UInt64"  # the sample has the top bit set, which Int64 cannot hold
    if kind is Kind.TIMESTAMP:
        assert dtype.startswith("datetime64[ns")
    elif expected == "string":
        assert dtype.startswith("string")
    else:
        assert dtype == expected
    assert df[fld.attr].isna().tolist() == [False, True]  # missing stays missing, never 0


def test_importing_fields_imports_neither_pandas_nor_pyarrow() -> None:
    code = "import sys, smiquery.fields, smiquery.kinds; print(sorted({'pandas', 'pyarrow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_a_table_rounds_watts_while_csv_keeps_every_digit() -> None:
    from smiquery.cli.display import render

    fields = [get_field("index"), get_field("power.draw"), get_field("memory.used")]
    samples = parse_lines(["index, power.draw [W], memory.used [MiB]", "0, 69.853, 70743", "1, [N/A], 214"])
    rows = [line.split() for line in render(samples, "table", fields=fields).splitlines()[1:]]
    assert rows == [["0", "69.85", "70743"], ["1", "n/a", "214"]]
    csv = render(samples, "csv", fields=fields)
    assert "69.853 W" in csv and "[N/A]" in csv
