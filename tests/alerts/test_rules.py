"""Alert rules: parsing, and evaluation per GPU (fire once, clear once, missing values keep the state)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from smiquery.alerts import AlertEvaluator, Rule, parse_duration
from smiquery.errors import InvalidRuleError
from smiquery.fields import get_field
from smiquery.sample import GpuSample, Schema, Value

T0 = datetime(2026, 3, 14, 9, 30, tzinfo=timezone.utc)
SCHEMA = Schema(("timestamp", "index", "temperature.gpu", "utilization.gpu", "persistence_mode", "pstate"))


def sample(
    second: float,
    index: int = 0,
    temp: int | None = 50,
    util: int | None = 50,
    persistence: bool | None = True,
    pstate: str | None = "P0",
) -> GpuSample:
    values: tuple[Value, ...] = (T0 + timedelta(seconds=second), index, temp, util, persistence, pstate)
    missing = {n: "not_available" for n, v in zip(SCHEMA.names, values) if v is None}
    raw = tuple(get_field(n).format(v, missing.get(n)) for n, v in zip(SCHEMA.names, values))
    return GpuSample(SCHEMA, values, raw, missing)


# ------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "op", "threshold", "samples", "seconds"),
    [
        ("temperature.gpu > 85 for 3", ">", 85, 3, None),
        ("temperature.gpu>85", ">", 85, 1, None),
        ("utilization.gpu < 20 for 5m", "<", 20, None, 300.0),
        ("utilization.gpu <= 20.5 for 30s", "<=", 20.5, None, 30.0),
        ("power.draw >= 300 for 2 samples", ">=", 300.0, 2, None),
        ("fan.speed != 0", "!=", 0, 1, None),
        ("memory.used = 0 for 1h", "==", 0, None, 3600.0),
        ("persistence_mode == Disabled", "==", False, 1, None),
        ("pstate == P8 for 10", "==", "P8", 10, None),
        ("utilization.gpu < 20 for 250ms", "<", 20, None, 0.25),
    ],
)
def test_parse(text, op, threshold, samples, seconds):
    rule = Rule.parse(text)
    assert rule.op == op
    assert rule.threshold == threshold
    assert type(rule.threshold) is type(threshold)
    assert rule.hold_samples == samples
    assert rule.hold_seconds == seconds
    assert str(rule) == " ".join(text.split())


def test_parse_resolves_aliases():
    assert Rule.parse("gpu_name == foo").field.name == "name"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("temp > 85", "unknown field 'temp'"),
        ("temperature.gpu >> 85", "not a number"),
        ("temperature.gpu > hot", "not a number"),
        ("temperature.gpu > 85 for", "'for' needs a hold"),
        ("temperature.gpu > 85 for 0", "at least 1"),
        ("temperature.gpu > 85 for 5 parsecs", "cannot read the hold"),
        ("temperature.gpu > 85 for 3x", "invalid hold"),
        ("persistence_mode > Enabled", "use == or !="),
        ("persistence_mode == maybe", "compare it with"),
        ("pstate > P0", "text; use == or !="),
        ("timestamp > 3", "cannot be compared"),
        ("", "cannot read"),
    ],
)
def test_parse_errors_say_what_is_wrong(text, says):
    with pytest.raises(InvalidRuleError, match=says) as info:
        Rule.parse(text)
    assert "e.g. 'temperature.gpu > 85 for 3'" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1", 1.0), ("0.5", 0.5), ("250ms", 0.25), ("2s", 2.0), ("10m", 600.0), ("1h", 3600.0), ("1d", 86400.0), (3, 3.0)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1", "5x", "ms", "1 2", "inf", "nan"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


# ---------------------------------------------------------------------------------------------- evaluation


def test_fires_once_after_the_hold_and_clears_once():
    ev = AlertEvaluator(["temperature.gpu > 85 for 3"])
    temps = [80, 86, 87, 88, 90, 91, 84, 83, 86]
    events = [(i, e) for i, t in enumerate(temps) for e in ev.update(sample(i, temp=t))]
    assert [(i, e.state) for i, e in events] == [(3, "firing"), (6, "cleared")]
    fired, cleared = events[0][1], events[1][1]
    assert fired.gpu == 0 and fired.value == 88
    assert fired.since == T0 + timedelta(seconds=1)
    assert fired.duration == 2.0
    assert cleared.value == 84 and cleared.duration == 5.0
    assert "ALERT firing GPU 0: temperature.gpu > 85 for 3 (value 88 C" in fired.message()


def test_each_gpu_has_its_own_state():
    ev = AlertEvaluator(["temperature.gpu > 85 for 2"])
    out = []
    for second in range(3):
        out += ev.update(sample(second, index=0, temp=90))
        out += ev.update(sample(second, index=5, temp=70 if second == 0 else 90))
    assert [(e.gpu, e.state) for e in out] == [(0, "firing"), (5, "firing")]
    assert [g for _, g in ev.firing()] == [0, 5]  # in the order they started being tracked


def test_a_missing_value_neither_fires_nor_clears():
    ev = AlertEvaluator(["temperature.gpu > 85 for 2"])
    assert ev.update(sample(0, temp=90)) == []
    assert ev.update(sample(1, temp=None)) == []  # not counted, streak kept
    assert [e.state for e in ev.update(sample(2, temp=91))] == ["firing"]
    assert ev.update(sample(3, temp=None)) == []  # does not clear
    assert ev.cell_state(sample(3), "temperature.gpu") == "firing"
    assert [e.state for e in ev.update(sample(4, temp=70))] == ["cleared"]


def test_time_hold_uses_the_sample_timestamps():
    ev = AlertEvaluator(["utilization.gpu < 20 for 30s"])
    states = []
    for second in range(0, 45, 5):
        states += [(second, e.state) for e in ev.update(sample(second, util=5))]
    assert states == [(30, "firing")]
    assert ev.update(sample(45, util=90))[0].duration == 45.0


def test_time_hold_without_timestamps_uses_the_clock():
    now = [100.0]
    ev = AlertEvaluator(["utilization.gpu < 20 for 10s"], clock=lambda: now[0])
    schema = Schema(("index", "utilization.gpu"))
    s = GpuSample(schema, (0, 5), ("0", "5"))
    assert ev.update(s) == []
    now[0] = 111.0
    (event,) = ev.update(s)
    assert event.state == "firing" and event.since == 100.0 and event.duration == 11.0


def test_pending_and_cell_state():
    ev = AlertEvaluator(["temperature.gpu > 85 for 3", "utilization.gpu < 20"])
    ev.update(sample(0, temp=90, util=10))
    s = sample(0)
    assert ev.cell_state(s, "temperature.gpu") == "pending"
    assert ev.cell_state(s, "utilization.gpu") == "firing"
    assert ev.cell_state(s, "power.draw") == "ok"
    assert ev.state(0, 0) == "pending"
    assert [f.name for f in ev.fields] == ["temperature.gpu", "utilization.gpu"]


def test_bool_and_text_rules():
    ev = AlertEvaluator(["persistence_mode == Disabled", "pstate != P0 for 2"])
    assert [e.rule.field.name for e in ev.update(sample(0, persistence=False, pstate="P2"))] == ["persistence_mode"]
    assert [e.rule.field.name for e in ev.update(sample(1, persistence=False, pstate="P2"))] == ["pstate"]


def test_rules_on_fields_the_sample_lacks_are_ignored():
    ev = AlertEvaluator(["power.draw > 100"])
    assert ev.update(sample(0)) == []
    assert AlertEvaluator([]).update(sample(0)) == []


def test_event_to_dict_is_json_ready():
    import json

    ev = AlertEvaluator(["temperature.gpu > 85"])
    (event,) = ev.update(sample(0, index=5, temp=87))
    doc = json.loads(json.dumps(event.to_dict()))
    assert doc["gpu"] == 5 and doc["state"] == "firing" and doc["value"] == 87
    assert doc["since"].startswith("2026-03-14T09:30:00")
