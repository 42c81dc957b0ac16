"""smiquery.fields: the --query-gpu catalogue, aliases, presets, validation and --help-query-gpu parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from smiquery.errors import InvalidFieldError
from smiquery.fields import CATALOGUE, PRESETS, Field, Kind, get_field, parse_help_query_gpu, resolve_fields


def test_catalogue_names_are_unique_and_attrs_have_no_dots() -> None:
    names = [f.name for f in CATALOGUE]
    assert len(names) == len(set(names))
    aliases = [a for f in CATALOGUE for a in f.aliases]
    assert not set(aliases) & set(names)
    for f in CATALOGUE:
        assert f.attr == f.name.replace(".", "_")
        assert "." not in f.attr
        assert f.help


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_resolve(preset: str) -> None:
    fields = resolve_fields(preset)
    assert fields
    assert all(isinstance(f, Field) for f in fields)
    assert [f.name for f in fields] == list(dict.fromkeys(PRESETS[preset]))


def test_default_preset_and_none() -> None:
    assert [f.name for f in resolve_fields(None)] == [
        "timestamp", "index", "name", "uuid", "temperature.gpu", "utilization.gpu", "utilization.memory",
        "memory.used", "memory.total", "power.draw",
    ]  # fmt: skip
    assert resolve_fields(None) == resolve_fields("default")
    assert len(resolve_fields("all")) == len(CATALOGUE)


def test_all_limited_to_known_names() -> None:
    fields = resolve_fields("all", known=["index", "gpu_name", "memory.used"])
    assert [f.name for f in fields] == ["name", "index", "memory.used"]


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("gpu_name", "name"),
        ("gpu_uuid", "uuid"),
        ("gpu_bus_id", "pci.bus_id"),
        ("clocks.gr", "clocks.current.graphics"),
        ("clocks.sm", "clocks.current.sm"),
        ("clocks.mem", "clocks.current.memory"),
        ("clocks_throttle_reasons.active", "clocks_event_reasons.active"),
        ("clocks_throttle_reasons.hw_slowdown", "clocks_event_reasons.hw_slowdown"),
        ("gpu.power.draw.average", "power.draw.average"),
        ("retired_pages.sbe", "retired_pages.single_bit_ecc.count"),
    ],
)
def test_aliases(alias: str, canonical: str) -> None:
    assert get_field(alias) is get_field(canonical)
    assert get_field(alias).name == canonical


def test_throttle_and_event_reasons_are_one_field_both_ways() -> None:
    new = get_field("clocks_event_reasons.active")
    old = get_field("clocks_throttle_reasons.active")
    assert new is old
    assert "clocks_throttle_reasons.active" in new.aliases
    assert [f.name for f in resolve_fields("clocks_throttle_reasons.active,clocks_event_reasons.active")] == [
        "clocks_event_reasons.active"
    ]


def test_argv_spelling_is_the_old_throttle_name_that_every_driver_accepts() -> None:
    assert get_field("clocks_event_reasons.active").argv_name == "clocks_throttle_reasons.active"
    assert get_field("clocks_throttle_reasons.sync_boost").argv_name == "clocks_throttle_reasons.sync_boost"
    # new in 590 under the new name only: there is no old spelling to send
    counters = get_field("clocks_event_reasons_counters.sw_power_cap")
    assert counters.argv_name == counters.name
    assert get_field("gpu_name").argv_name == "name"
    for f in CATALOGUE:
        assert f.argv_name == f.name or f.argv_name in f.aliases, f.name


def test_argv_spellings_are_listed_by_every_recorded_driver(corpus_dir: Path) -> None:
    helps = sorted((corpus_dir / "help-query-gpu").glob("*.txt"))
    assert any("465" in p.name for p in helps), "the corpus should hold a pre-535 --help-query-gpu"
    for path in helps:
        listed = {n for e in parse_help_query_gpu(path.read_text(encoding="utf-8")) for n in (e.name, *e.aliases)}
        for f in CATALOGUE:
            if listed & {f.name, *f.aliases}:
                assert f.argv_name in listed, f"{path.name} lists {f.name} but not {f.argv_name}"


def test_comma_list_and_sequences_drop_duplicates_keep_order() -> None:
    assert [f.name for f in resolve_fields("memory.used, index,gpu_name,name")] == ["memory.used", "index", "name"]
    assert [f.name for f in resolve_fields(["uuid", "gpu_uuid", "index"])] == ["uuid", "index"]


def test_unknown_name_names_close_matches() -> None:
    with pytest.raises(InvalidFieldError) as info:
        get_field("memory.usd")
    err = info.value
    assert err.field == "memory.usd"
    assert "memory.used" in err.suggestions
    assert "memory.used" in str(err)
    assert isinstance(err, ValueError)
    with pytest.raises(InvalidFieldError, match=r"temperature\.gpu"):
        resolve_fields("index,temprature.gpu")


def test_unknown_name_without_close_match_points_to_the_list() -> None:
    with pytest.raises(InvalidFieldError, match="smiquery fields"):
        get_field("zzzzzzzzzzzzzz")


@pytest.mark.parametrize(
    "bad",
    ["memory.used; rm -rf /", "a b", "", " ", "memory.used,$(reboot)", "-l", "memory.used --format=csv", "'index'"],
)
def test_malformed_names_are_rejected_before_anything_runs(bad: str) -> None:
    with pytest.raises(InvalidFieldError):
        resolve_fields([bad])


@pytest.mark.parametrize("bad", ["memory.used; rm -rf /", "a b,index", "", " , ", "index,--help"])
def test_malformed_comma_lists_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidFieldError):
        resolve_fields(bad)


def test_names_discovered_on_this_driver_parse_as_text() -> None:
    fld = get_field("brand.new_field", known=["brand.new_field"])
    assert fld.kind is Kind.STR
    assert fld.attr == "brand_new_field"
    with pytest.raises(InvalidFieldError):
        get_field("brand.new_field")


@pytest.mark.parametrize(
    ("name", "kind", "unit", "header_unit"),
    [
        ("memory.used", Kind.INT, "MiB", "MiB"),
        ("power.draw", Kind.FLOAT, "W", "W"),
        ("temperature.gpu", Kind.INT, "C", ""),
        ("utilization.gpu", Kind.INT, "%", "%"),
        ("clocks.current.sm", Kind.INT, "MHz", "MHz"),
        ("clocks_event_reasons_counters.sw_power_cap", Kind.INT, "us", "us"),
        ("encoder.stats.averageLatency", Kind.INT, "us", ""),
        ("timestamp", Kind.TIMESTAMP, "", ""),
        ("pci.device_id", Kind.HEX, "", ""),
        ("clocks_event_reasons.supported", Kind.BITMASK, "", ""),
        ("persistence_mode", Kind.ENABLED, "", ""),
        ("retired_pages.pending", Kind.YES_NO, "", ""),
        ("clocks_event_reasons.gpu_idle", Kind.ACTIVE, "", ""),
        ("compute_cap", Kind.MAJOR_MINOR, "", ""),
        ("driver_version", Kind.VERSION, "", ""),
        ("name", Kind.STR, "", ""),
    ],
)
def test_units_and_kinds(name: str, kind: Kind, unit: str, header_unit: str) -> None:
    fld = get_field(name)
    assert fld.kind is kind
    assert fld.unit == unit
    assert fld.header_unit == header_unit
    assert fld.header == (f"{name} [{header_unit}]" if header_unit else name)


def test_kind_properties() -> None:
    assert Kind.INT.is_numeric and Kind.HEX.is_numeric and Kind.FLOAT.is_numeric and Kind.BITMASK.is_numeric
    assert not Kind.STR.is_numeric and not Kind.TIMESTAMP.is_numeric
    assert Kind.ENABLED.is_bool and Kind.YES_NO.is_bool and Kind.ACTIVE.is_bool
    assert not Kind.INT.is_bool


def test_field_is_frozen() -> None:
    fld = get_field("index")
    with pytest.raises(AttributeError):
        fld.name = "other"  # type: ignore[misc]


# The layout of the real help text: an entry is a quoted line right after a blank line; section headings and
# their prose sit between entries.
HELP_465 = """List of valid properties to query for the switch "--query-gpu=":

"timestamp"
The timestamp of when the query was made in format "YYYY/MM/DD HH:MM:SS.msec".

"name" or "gpu_name"
The official product name of the GPU. This is an alphanumeric string. For all products.

Section about clocks_throttle_reasons properties
Retrieves information about factors that are reducing the frequency of clocks.
"not an entry: no blank line before it"

"clocks_throttle_reasons.active"
Bitmask of active clock throttle reasons.
See nvml.h for more details.
"""

HELP_590 = HELP_465.replace('"--query-gpu=":', '"--query-gpu":').replace("\n", "\r\n")


@pytest.mark.parametrize("text", [HELP_465, HELP_590], ids=["465", "590-crlf"])
def test_parse_help_query_gpu(text: str) -> None:
    entries = parse_help_query_gpu(text)
    assert [e.name for e in entries] == ["timestamp", "name", "clocks_throttle_reasons.active"]
    assert entries[1].aliases == ("gpu_name",)
    assert entries[2].description == "Bitmask of active clock throttle reasons. See nvml.h for more details."
    for entry in entries:
        get_field(entry.name)


def test_parse_help_query_gpu_of_nothing() -> None:
    assert parse_help_query_gpu("") == []
    assert parse_help_query_gpu("no properties here\n") == []
