"""smiquery.sample: GpuSample, one GPU at one instant, immutable, holding exactly the queried fields."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import pytest

from smiquery.sample import GpuSample, Schema
from smiquery.sources.query_gpu import parse_lines

UTC = timezone.utc
FIELDS = ["timestamp", "index", "uuid", "temperature.gpu", "power.draw", "fan.speed"]
LINE = "2026/08/12 21:53:45.370, 0, GPU-00000000-0000-0000-0000-000000000000, 45, 69.85, [N/A]"


@pytest.fixture
def sample() -> GpuSample:
    (s,) = parse_lines([LINE], FIELDS, tz=UTC)
    return s


def test_attribute_and_item_access(sample: GpuSample) -> None:
    assert sample.temperature_gpu == 45
    assert sample["temperature.gpu"] == 45
    assert sample.power_draw == sample["power.draw"] == 69.85
    assert sample.get("power.draw") == 69.85
    assert sample.get("memory.used", "absent") == "absent"
    assert sample.get("fan.speed", "absent") is None  # queried but missing: None, not the default


def test_identity_attributes(sample: GpuSample) -> None:
    assert sample.index == 0
    assert sample.uuid == "GPU-00000000-0000-0000-0000-000000000000"
    assert sample.timestamp == datetime(2026, 8, 12, 21, 53, 45, 370000, tzinfo=UTC)
    (bare,) = parse_lines(["45"], ["temperature.gpu"])
    assert bare.index is None and bare.uuid is None and bare.timestamp is None


def test_unqueried_fields_raise(sample: GpuSample) -> None:
    with pytest.raises(KeyError, match="not queried"):
        sample["memory.used"]
    with pytest.raises(AttributeError, match="memory_used"):
        _ = sample.memory_used


def test_mapping_like(sample: GpuSample) -> None:
    assert list(sample) == FIELDS
    assert len(sample) == len(FIELDS)
    assert "power.draw" in sample and "memory.used" not in sample
    assert sample.fields == tuple(FIELDS)
    assert sample.values()[3] == 45


def test_immutable(sample: GpuSample) -> None:
    with pytest.raises(AttributeError, match="immutable"):
        sample.temperature_gpu = 0
    with pytest.raises(AttributeError):
        sample.index = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        sample.missing["fan.speed"] = "x"  # type: ignore[index]
    raw: Any = sample.raw  # a fresh dict each time
    raw["fan.speed"] = "changed"
    assert sample.raw["fan.speed"] == "[N/A]"


def test_missing_mapping(sample: GpuSample) -> None:
    assert sample.fan_speed is None
    assert dict(sample.missing) == {"fan.speed": "not_available"}
    (full,) = parse_lines(["45"], ["temperature.gpu"])
    assert dict(full.missing) == {}
    assert not full.gpu_lost


def test_raw_keeps_the_cells(sample: GpuSample) -> None:
    assert sample.raw == dict(zip(FIELDS, [c for c in LINE.split(", ")], strict=True))


def test_to_dict(sample: GpuSample) -> None:
    d = sample.to_dict()
    assert list(d) == FIELDS
    assert d["power.draw"] == 69.85 and d["fan.speed"] is None
    a = sample.to_dict(attrs=True)
    assert list(a) == [f.replace(".", "_") for f in FIELDS]
    a["power_draw"] = 0.0
    assert sample.power_draw == 69.85


def test_pickling_and_copy(sample: GpuSample) -> None:
    for clone in (pickle.loads(pickle.dumps(sample)), copy.copy(sample), copy.deepcopy(sample)):
        assert clone == sample
        assert clone.temperature_gpu == 45
        assert dict(clone.missing) == dict(sample.missing)
        assert clone.gpu_lost == sample.gpu_lost
        assert clone.timestamp == sample.timestamp
    lost = parse_lines(["[GPU is lost]"], ["temperature.gpu"])[0]
    assert pickle.loads(pickle.dumps(lost)).gpu_lost


def test_equality_and_hash(sample: GpuSample) -> None:
    (same,) = parse_lines([LINE], FIELDS, tz=UTC)
    (other,) = parse_lines([LINE.replace(" 45,", " 46,")], FIELDS, tz=UTC)
    assert same == sample and hash(same) == hash(sample)
    assert other != sample
    assert sample != ("not", "a", "sample")
    assert len({sample, same, other}) == 2


def test_repr_names_values(sample: GpuSample) -> None:
    text = repr(sample)
    assert text.startswith("GpuSample(")
    assert "temperature.gpu=45" in text and "fan.speed=None" in text
    lost = parse_lines(["[GPU is lost]"], ["temperature.gpu"])[0]
    assert "gpu_lost=True" in repr(lost)


def test_direct_construction_checks_lengths() -> None:
    schema = Schema(("index", "power.draw"))
    s = GpuSample(schema, (1, None), ("1", "[N/A]"), {"power.draw": "not_available"})
    assert s.index == 1 and s.missing == {"power.draw": "not_available"}
    with pytest.raises(ValueError, match="one value"):
        GpuSample(schema, (1,), ("1", "2"))
    with pytest.raises(ValueError, match="one value"):
        GpuSample(schema, (1, 2), ("1",))


def test_schema_is_shared_and_compares_by_names() -> None:
    a, b = parse_lines(["0, 1.00", "1, 2.00"], ["index", "power.draw"])
    assert a.schema is b.schema
    assert Schema(("index",)) == Schema(("index",))
    assert hash(Schema(("index",))) == hash(Schema(("index",)))
    assert Schema(("index",)) != Schema(("uuid",))
    assert a.schema.attrs == ("index", "power_draw")


def test_count_field_is_an_ordinary_field() -> None:
    (s,) = parse_lines(["2, 0"], ["count", "index"])
    assert s.count == 2
    assert s["count"] == 2
    (bare,) = parse_lines(["0"], ["index"])
    assert bare.get("count") is None
    with pytest.raises(AttributeError, match="count"):
        _ = bare.count


def test_is_a_read_only_mapping_of_name_to_value(sample: GpuSample) -> None:
    assert isinstance(sample, Mapping)
    assert not isinstance(sample, tuple)
    assert dict(sample) == {**sample} == sample.to_dict()
    assert list(sample.keys()) == FIELDS
    assert list(sample.items())[3] == ("temperature.gpu", 45)
    assert sample.values() == tuple(sample[n] for n in FIELDS)
    assert sample == sample.to_dict()
    assert sample != {**sample.to_dict(), "temperature.gpu": 46}
    with pytest.raises(TypeError):
        sample["temperature.gpu"] = 0  # type: ignore[index]


def test_json_carries_the_values(sample: GpuSample) -> None:
    # what a user writes: the timestamp is a datetime, which json needs a default= for
    doc = json.loads(json.dumps(dict(sample), default=str))
    assert doc == {
        "timestamp": "2026-08-12 21:53:45.370000+00:00",
        "index": 0,
        "uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "temperature.gpu": 45,
        "power.draw": 69.85,
        "fan.speed": None,
    }
    # a bare sample is refused loudly, never written as something else
    with pytest.raises(TypeError, match="GpuSample"):
        json.dumps(sample, default=None)


def test_pandas_dataframe_from_samples_has_one_column_per_field() -> None:
    pd = pytest.importorskip("pandas")
    rows = parse_lines([LINE, LINE.replace(" 0, GPU-0", " 1, GPU-1").replace(" 45,", " 50,")], FIELDS, tz=UTC)
    df = pd.DataFrame(rows)
    assert list(df.columns) == FIELDS
    assert df["temperature.gpu"].tolist() == [45, 50]
    assert df["index"].tolist() == [0, 1]
    assert df["power.draw"].tolist() == [69.85, 69.85]
    assert df["fan.speed"].isna().all()
    assert pd.Series(rows[0])["power.draw"] == 69.85
