"""Alert rules (``temperature.gpu > 85 for 3``): parsing, evaluation per GPU, an event's JSON, what a stall is.

Pure (no IO; an injectable clock), so the CLI, the exporter and the training callbacks share it; also home of the
duration parser behind ``--interval`` and ``--duration``, and of :data:`STALL`, the one definition of a stalled GPU.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from smiquery.clock import elapsed
from smiquery.errors import InvalidFieldError, InvalidRuleError
from smiquery.fields import Field, Kind, get_field
from smiquery.sample import GpuSample, Value

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BUILTIN_RULES",
    "STALL",
    "AlertEvaluator",
    "AlertEvent",
    "Rule",
    "StallRule",
    "arrival",
    "event_payload",
    "parse_duration",
]

Op = Literal[">", ">=", "<", "<=", "==", "!="]
State = Literal["firing", "cleared"]

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
}
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|sec|min|s|m|h|d)?\s*", re.IGNORECASE)
_RULE_RE = re.compile(
    r"""^\s*(?P<field>[A-Za-z][A-Za-z0-9_.]*)\s*
        (?P<op>>=|<=|==|!=|>|<|=)\s*
        (?P<value>.+?)
        (?:\s+for(?:\s+(?P<hold>.*?))?)?\s*$""",
    re.VERBOSE | re.IGNORECASE,
)
_SAMPLES_RE = re.compile(r"(\d+)(?:\s+samples?)?", re.IGNORECASE)
_WHILE_RE = re.compile(r"\s+while\s+|\s+while\s*$", re.IGNORECASE)
_TRUE_WORDS = {"enabled", "yes", "active", "true", "on", "1"}
_FALSE_WORDS = {"disabled", "no", "not active", "not_active", "false", "off", "0"}


#: The built-in health rules, the same as the exporter's Prometheus rules (``docker/prometheus/smiquery-rules.yml``):
#: hot (critical and sustained), a stalled job (idle while holding memory), thermal and power-brake slowdown.
BUILTIN_RULES: tuple[str, ...] = (
    "temperature.gpu > 85 for 3",
    "temperature.gpu > 80 for 5m",
    "utilization.gpu < 20 for 30m while memory.used > 1024",
    "clocks_event_reasons.hw_thermal_slowdown == Active for 1m",
    "clocks_event_reasons.sw_thermal_slowdown == Active for 1m",
    "clocks_event_reasons.hw_power_brake_slowdown == Active for 1m",
)


def parse_duration(text: str | float, *, what: str = "duration") -> float:
    """Seconds (always positive) from ``"250ms"``, ``"2s"``, ``"10m"``, ``"1h"``, ``"1d"`` or a number of seconds.

    Raises ValueError, naming the text as ``what`` and showing the accepted forms, when it is not a positive duration.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION_RE.fullmatch(str(text))
        if not m:
            raise ValueError(f"invalid {what} {text!r}: use seconds (1, 0.5) or a unit: 250ms, 2s, 10m, 1h")
        seconds = float(m.group(1)) * _UNIT_SECONDS[(m.group(2) or "s").lower()]
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"invalid {what} {text!r}: must be more than 0")
    return seconds


def _parse_threshold(text: str, fld: Field, op: str, expr: str) -> Value:
    word = text.strip().strip("'\"")
    kind = fld.kind
    if kind.is_bool:
        if word.lower() not in _TRUE_WORDS | _FALSE_WORDS:
            raise InvalidRuleError(expr, f"{fld.name} is {kind.value}; compare it with one of those words")
        if op not in ("==", "!="):
            raise InvalidRuleError(expr, f"{fld.name} is {kind.value}; use == or !=")
        return word.lower() in _TRUE_WORDS
    if kind.is_numeric:
        try:
            if kind in (Kind.HEX, Kind.BITMASK) and word.lower().startswith("0x"):
                return int(word, 16)
            number = float(word)
        except ValueError:
            raise InvalidRuleError(expr, f"{word!r} is not a number ({fld.name} is {kind.value})") from None
        return int(number) if number.is_integer() and kind is not Kind.FLOAT else number
    if kind is Kind.TIMESTAMP:
        raise InvalidRuleError(expr, "timestamps cannot be compared")
    if op not in ("==", "!="):
        raise InvalidRuleError(expr, f"{fld.name} is text; use == or !=")
    return word


@dataclass(frozen=True)
class Rule:
    """One alert condition: ``FIELD OP VALUE [for HOLD] [while FIELD OP VALUE]...``.

    ``for 3`` (or ``for 3 samples``) holds for three consecutive samples of a GPU; ``for 30s``, ``for 5m`` and
    ``for 1h`` hold for that long; without ``for`` one sample is enough. ``while`` adds conditions, without a hold,
    that the same sample must meet (``when``). ``threshold`` is typed for the field; ``hold_samples`` is None when
    the hold is ``hold_seconds``.
    """

    field: Field
    op: Op
    threshold: Value
    hold_samples: int | None = 1
    hold_seconds: float | None = None
    text: str = ""
    when: tuple[Rule, ...] = ()

    @classmethod
    def of(cls, rule: Rule | str) -> Rule:
        """``rule`` itself, or parsed (see :meth:`parse`) when it is text."""
        return rule if isinstance(rule, Rule) else cls.parse(rule)

    @classmethod
    def parse(cls, text: str) -> Rule:
        """Parse an expression such as ``"temperature.gpu > 85 for 3"``; operators ``> >= < <= == !=`` (``=``: ``==``).

        Raises InvalidRuleError for a malformed expression, an unknown field, or a value that does not fit the field.
        """
        main, *extra = _WHILE_RE.split(text)
        if extra:
            when: list[Rule] = []
            for part in extra:
                if not part.strip():
                    raise InvalidRuleError(text, "'while' needs a condition, e.g. 'while memory.used > 1024'")
                try:
                    cond = cls.parse(part)
                except InvalidRuleError as exc:
                    raise InvalidRuleError(text, f"in the 'while' condition: {exc.reason}") from None
                if cond.hold_seconds is not None or cond.hold_samples != 1 or cond.when:
                    raise InvalidRuleError(text, "a 'while' condition takes no 'for' hold of its own")
                when.append(cond)
            rule = cls.parse(main)
            return dataclasses.replace(rule, text=" ".join(text.split()), when=tuple(when))
        m = _RULE_RE.match(text)
        if not m:
            raise InvalidRuleError(text, "cannot read it")
        try:
            fld = get_field(m.group("field"))
        except InvalidFieldError as exc:
            raise InvalidRuleError(text, str(exc)) from None
        op = "==" if m.group("op") == "=" else m.group("op")
        threshold = _parse_threshold(m.group("value"), fld, op, text)
        hold_samples: int | None = 1
        hold_seconds: float | None = None
        hold = (m.group("hold") or "").strip()
        count = _SAMPLES_RE.fullmatch(hold)
        if count is not None:
            hold_samples = int(count.group(1))
            if hold_samples < 1:
                raise InvalidRuleError(text, "the hold must be at least 1 sample")
        elif len(hold.split()) == 1:
            try:
                hold_seconds, hold_samples = parse_duration(hold, what="hold"), None
            except ValueError as exc:
                raise InvalidRuleError(text, str(exc)) from None
        elif hold or re.search(r"\sfor\s*$", text, re.IGNORECASE):
            why = f"cannot read the hold {hold!r}" if hold else "'for' needs a hold: a number of samples or a duration"
            raise InvalidRuleError(text, why)
        return cls(fld, op, threshold, hold_samples, hold_seconds, " ".join(text.split()))  # type: ignore[arg-type]

    def holds(self, value: Value) -> bool | None:
        """Whether ``value`` meets the condition; None for a missing value (which decides nothing)."""
        if value is None:
            return None
        try:
            return bool(_OPS[self.op](value, self.threshold))
        except TypeError:
            return None

    def matches(self, sample: GpuSample) -> bool | None:
        """Whether this sample meets the condition and its ``while`` conditions (ignoring the hold); None: unknown."""
        verdict = self.holds(sample.get(self.field.name))
        for cond in self.when:
            if not verdict:
                break
            verdict = cond.holds(sample.get(cond.field.name))
        return verdict

    @property
    def fields(self) -> tuple[Field, ...]:
        """The fields the rule reads: its own, then those of its ``while`` conditions."""
        return tuple({f.name: f for f in (self.field, *(c.field for c in self.when))}.values())

    def __str__(self) -> str:
        return self.text or f"{self.field.name} {self.op} {self.threshold}"


@dataclass(frozen=True)
class AlertEvent:
    """A rule that started firing or stopped firing on one GPU.

    ``value`` decided the change; ``since`` is the first matching sample's time, ``at`` the event's sample's;
    ``duration``: seconds the condition held as the evaluator measured them (not always ``at - since``).
    """

    rule: Rule
    gpu: int | None
    uuid: str | None
    value: Value
    state: State
    since: datetime | float
    at: datetime | float
    duration: float

    def message(self) -> str:
        """One line for people, e.g. ``ALERT firing GPU 5: temperature.gpu > 85 for 3 (value 87 C, for 2.0 s)``."""
        unit = self.rule.field.unit
        shown = "n/a" if self.value is None else f"{self.value}{' ' + unit if unit else ''}"
        gpu = f"GPU {self.gpu}" if self.gpu is not None else f"GPU {self.uuid or '?'}"
        at = f" at {self.at:%Y-%m-%d %H:%M:%S}" if isinstance(self.at, datetime) else ""
        return f"ALERT {self.state} {gpu}: {self.rule} (value {shown}, held {self.duration:.1f} s{at})"

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict."""
        return {
            "rule": str(self.rule),
            "field": self.rule.field.name,
            "gpu": self.gpu,
            "uuid": self.uuid,
            "value": self.value,
            "state": self.state,
            "since": _jsonable(self.since),
            "at": _jsonable(self.at),
            "duration": self.duration,
        }


def _jsonable(value: object) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    isoformat = getattr(value, "isoformat", None)
    if callable(isoformat):
        return isoformat()
    try:
        return float(value)  # type: ignore[arg-type]  # numpy scalars and 0-d tensors
    except (TypeError, ValueError):
        return str(value)


def event_payload(event: AlertEvent, context: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of an event (what a webhook posts, a snapshot's ``alert.json``), ``context`` where it happened.

    Every value is JSON-serialisable (NaN becomes null, datetimes ISO 8601).
    """
    return {
        "source": "smiquery",
        "host": socket.gethostname(),
        "message": event.message(),
        "event": _jsonable(event.to_dict()),
        "context": _jsonable(dict(context or {})),
    }


@dataclass
class _Track:
    count: int = 0
    since: datetime | float | None = None
    firing: bool = False
    held: float = 0.0  # seconds the condition has held, summed step by step
    last: datetime | float | None = None  # the hold clock at the previous matching sample


class AlertEvaluator:
    """Tracks each rule on each GPU: :meth:`update` returns an event when a rule starts firing and when it clears.

    A missing value neither fires nor clears. How long a condition has held is summed between its samples on the
    first of: ``now`` (a live sample's monotonic arrival, which DST, NTP steps and VM resumes do not move, unlike
    nvidia-smi's timestamps); the samples' timestamps (a recording; a step back counts 0); ``clock()``. Event times
    (``since``, ``at``) are the samples' timestamps when they have one, else the hold clock.
    """

    def __init__(self, rules: Iterable[Rule | str], clock: Callable[[], float] = time.monotonic) -> None:
        self.rules: tuple[Rule, ...] = tuple(map(Rule.of, rules))
        self.clock = clock
        self._tracks: dict[tuple[int, object], _Track] = {}

    @property
    def fields(self) -> tuple[Field, ...]:
        """The fields the rules need (``while`` conditions included), without repeats."""
        return tuple({f.name: f for r in self.rules for f in r.fields}.values())

    def update(self, sample: GpuSample, now: float | None = None) -> list[AlertEvent]:
        """Take one sample of one GPU that arrived at ``now`` (monotonic; None for a recording): its events."""
        if not self.rules:
            return []
        gpu, uuid, key = _ids(sample)
        ts = sample.timestamp if "timestamp" in sample else None
        tick: datetime | float = now if now is not None else ts if ts is not None else self.clock()
        shown: datetime | float = ts if ts is not None else tick
        events: list[AlertEvent] = []
        for i, rule in enumerate(self.rules):
            value = sample.get(rule.field.name)
            verdict = rule.matches(sample)
            if verdict is None:
                continue  # missing (or not queried): keeps the state
            track = self._tracks.setdefault((i, key), _Track())
            if verdict:
                if track.since is None:
                    track.since, track.held = shown, 0.0
                else:
                    track.held += elapsed(track.last, tick)
                track.last = tick
                track.count += 1
                if not track.firing and self._held(rule, track):
                    track.firing = True
                    events.append(AlertEvent(rule, gpu, uuid, value, "firing", track.since, shown, track.held))
            else:
                if track.firing:
                    assert track.since is not None
                    held = track.held + elapsed(track.last, tick)
                    events.append(AlertEvent(rule, gpu, uuid, value, "cleared", track.since, shown, held))
                track.count, track.since, track.firing, track.held, track.last = 0, None, False, 0.0, None
        return events

    @staticmethod
    def _held(rule: Rule, track: _Track) -> bool:
        if rule.hold_seconds is not None:
            return track.held >= rule.hold_seconds
        return track.count >= (rule.hold_samples or 1)

    def firing(self) -> list[tuple[Rule, int | None]]:
        """The (rule, GPU) pairs firing now."""
        return [
            (self.rules[i], key if isinstance(key, int) else None) for (i, key), t in self._tracks.items() if t.firing
        ]

    def state(self, rule_index: int, gpu: object) -> Literal["firing", "pending", "ok"]:
        """The state of one rule on one GPU: firing, pending (condition true, hold not reached yet) or ok."""
        t = self._tracks.get((rule_index, gpu))
        if t is None or t.since is None:
            return "ok"
        return "firing" if t.firing else "pending"

    def cell_state(self, sample: GpuSample, field_name: str) -> Literal["firing", "pending", "ok"]:
        """The worst state of the rules on ``field_name`` for this sample's GPU (for colouring a table cell)."""
        key = _ids(sample)[2]
        found = {self.state(i, key) for i, rule in enumerate(self.rules) if rule.field.name == field_name}
        return "firing" if "firing" in found else "pending" if "pending" in found else "ok"


def _ids(sample: GpuSample) -> tuple[int | None, str | None, object]:
    """A sample's GPU index, UUID and key in the evaluator's state (the index, else the UUID)."""
    gpu = sample.index if "index" in sample else None
    uuid = sample.uuid if "uuid" in sample else None
    return gpu, uuid, gpu if gpu is not None else uuid


def arrival(batch: object) -> float:
    """When a sweep (or sample) arrived, in monotonic seconds (its ``arrived``, else now): ``update``'s ``now``."""
    stamp = getattr(batch, "arrived", None)
    return float(stamp) if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) else time.monotonic()


@dataclass(frozen=True)
class StallRule:
    """The stall definition: a GPU held (``busy_memory_mib`` used) but under ``utilization`` %, for ``min_seconds``."""

    utilization: float = 20.0
    busy_memory_mib: float = 1024.0
    min_seconds: float = 30.0

    def mask(self, utilization: np.ndarray, memory_used: np.ndarray | None = None) -> np.ndarray:
        """Which samples (float64 arrays, NaN where missing) show a stalled GPU: 1.0 stalled, 0.0 not, NaN unknown.

        Without ``memory_used``, utilization alone decides.
        """
        import numpy as np

        with np.errstate(invalid="ignore"):
            out = np.where(np.isnan(utilization), np.nan, (utilization < self.utilization).astype("float64"))
            if memory_used is not None:
                held = np.where(np.isnan(memory_used), np.nan, (memory_used >= self.busy_memory_mib).astype("float64"))
                out = np.where((out == 0) | (held == 0), 0.0, np.where(np.isnan(out) | np.isnan(held), np.nan, 1.0))
        return np.asarray(out, dtype="float64")


#: The default stall definition (20% utilization, 1 GiB held, 30 s).
STALL = StallRule()
