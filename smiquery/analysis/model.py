"""What the report of a recording holds: statistics, stretches, alerts, health counters and findings.

Plain dataclasses with ``to_dict`` for JSON; a notebook shows a :class:`Report` through its ``html_renderer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from smiquery.alerts.rules import STALL
from smiquery.clock import seconds_between

if TYPE_CHECKING:
    from collections.abc import Callable

    from smiquery.clock import ClockStep
    from smiquery.recordings import SkippedLines

__all__ = [
    "SEVERITY_ORDER",
    "AlertSpan",
    "FieldStats",
    "Finding",
    "GpuName",
    "HealthCount",
    "Periods",
    "Report",
    "Severity",
    "Stretch",
    "ThresholdTime",
]

Severity = Literal["critical", "warning", "info"]
#: Findings sort by this: the most severe first.
SEVERITY_ORDER: dict[str, int] = {"critical": 0, "warning": 1, "info": 2}


def _json(record: Any, gpu: dict[str, Any] | None = None, **digits: int) -> dict[str, Any]:
    """A record's fields JSON-ready (times in ISO 8601, ``digits`` rounded); ``gpu`` names its GPU in its place."""
    out: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if f.name == "gpu" and gpu is not None:
            out.update(gpu)
            continue
        if isinstance(value, datetime):
            value = value.isoformat()
        elif isinstance(value, tuple):
            value = list(value)
        elif f.name in digits and value is not None:
            value = round(value, digits[f.name])
        out[f.name] = value
    return out


@dataclass(frozen=True)
class GpuName:
    """Which GPU of which node a fleet report's GPU number (0..N-1) is; a recording's report has none.

    ``node``: the ``node`` or ``Hostname`` label, else the ``instance``; ``gpu``: its index there; the ``pod``
    (``namespace/pod``) or Slurm ``job`` that held it ("" where not known, as ``uuid``).
    """

    node: str
    instance: str
    gpu: str
    uuid: str = ""
    pod: str = ""
    job: str = ""

    def to_dict(self, index: int) -> dict[str, Any]:
        """JSON-ready: ``index`` (the report's number), ``instance``, ``gpu`` (on its node), ``uuid``, what is known."""
        out = {"index": index, "instance": self.instance, "gpu": self.gpu, "uuid": self.uuid}
        known = {"node": "" if self.node == self.instance else self.node, "pod": self.pod, "job": self.job}
        return out | {k: v for k, v in known.items() if v}


@dataclass(frozen=True)
class FieldStats:
    """Statistics of the ``count`` present values of one field on one GPU (-1: all GPUs); ``missing``: the rest."""

    field: str
    unit: str
    gpu: int
    mean: float
    p95: float
    max: float
    min: float
    count: int
    missing: int


@dataclass(frozen=True)
class Stretch:
    """A continuous stretch of time during which a condition held on one GPU.

    It ends at its last sample's time plus the sampling interval; ``peak`` is the most extreme value of the watched
    field (max for ``>``, min for ``<``), ``mean`` its mean; ``ongoing``: the recording ended while it still held.
    """

    gpu: int
    start: datetime
    end: datetime
    seconds: float
    samples: int
    peak: float | None = None
    mean: float | None = None
    ongoing: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return _json(self, seconds=3, mean=3)


@dataclass(frozen=True)
class ThresholdTime:
    """How long one GPU spent past one rule's threshold (ignoring its hold), and the ``peak`` value there."""

    rule: str
    gpu: int
    seconds: float
    stretches: int
    longest: float
    peak: float | None


@dataclass(frozen=True)
class AlertSpan:
    """An alert that would have fired: the rule held for its hold on one GPU.

    The condition held from ``since`` to ``end`` (``seconds``), the hold was reached (a live alert fired) at
    ``fired``; ``peak`` is the most extreme value of the rule's field, ``cleared`` False when the recording ended
    while it still fired.
    """

    rule: str
    gpu: int
    since: datetime
    fired: datetime
    end: datetime
    seconds: float
    peak: float | None
    cleared: bool

    @property
    def ongoing(self) -> bool:
        """Whether it was still firing when the recording ended (its end is the recording's end)."""
        return not self.cleared

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, and ``ongoing``."""
        return {**_json(self, seconds=3), "ongoing": self.ongoing}


@dataclass(frozen=True)
class HealthCount:
    """A memory-health counter or flag of one GPU that was not clean: ECC errors, retired pages, remapped rows.

    ``first``, ``last`` and ``max`` are its values at the start, at the end and at most (flags: 1 for yes).
    """

    field: str
    gpu: int
    first: float
    last: float
    max: float

    @property
    def grew(self) -> bool:
        """Whether the count rose during the run."""
        return self.max > self.first

    @property
    def severity(self) -> Severity:
        """critical for uncorrectable errors, retired double-bit pages and remapping failures; else warning."""
        name = self.field
        if "uncorrected" in name or "double_bit" in name or "uncorrectable" in name or name.endswith(".failure"):
            return "critical"
        return "warning" if self.grew or name.endswith(".pending") else "info"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return _json(self)


@dataclass(frozen=True)
class Finding:
    """Something worth acting on, with a one-line verdict for people: what happened and what to check.

    ``kind``: ``stall``, ``stall_together``, ``hot``, ``warm``, ``throttle``, ``memory_full``, ``imbalance``,
    ``ecc``, ``retired_pages``, ``remapped_rows``, ``alert`` or ``clock``; ``seconds``: how long it lasted (per GPU
    where it concerns one), from ``start``.
    """

    kind: str
    severity: Severity
    gpus: tuple[int, ...]
    verdict: str
    seconds: float = 0.0
    start: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return _json(self, seconds=3)


@dataclass
class Report:
    """The analysis of one recording; the ``report_*`` functions of :mod:`smiquery.analysis` render it.

    ``sweeps``: samples per GPU (the most any GPU has); ``interval``: the median seconds between two samples of one
    GPU; ``stats``: per field and GPU statistics of the fields that vary, ``overall`` the same over all GPUs;
    ``constants``: the fields that never changed, with their value per GPU. ``thresholds``: the time past each
    rule's threshold per GPU that got past it, fired or not (:attr:`alerts` are the firings); ``stalls``: stretches
    of at least ``min_stall`` seconds under ``stall_utilization`` while memory was held; ``health``: the non-zero
    memory-health counters (ECC, retired pages, remapped rows) per GPU; ``findings``: what to act on, most severe
    first; ``skipped_files``: the files of a set skipped, one line each with why.

    ``clock_steps``: where the recorded clock stepped back (every duration skips such a step); ``zone_changes``:
    (time, offset before, offset after) where the UTC offset changed in a recording read in its zone; ``elapsed``:
    seconds along the timeline (None: ``end - start``). ``not_recorded``: the fields the stall check or a rule needs
    that the recording lacks (what they decide is reported as not known), ``unchecked_rules`` the rules watching
    them. ``names``: per GPU number its :class:`GpuName` in a fleet's report (empty for a recording); in JSON every
    GPU reference then carries ``instance``, ``gpu`` (its index on its node), ``uuid`` and ``index`` (the report's
    number, which ``energy_wh`` and ``gpus`` use).
    """

    source: str
    gpus: tuple[int, ...]
    start: datetime
    end: datetime
    sweeps: int
    interval: float
    stats: list[FieldStats] = field(default_factory=list)
    constants: dict[str, dict[int, Any]] = field(default_factory=dict)
    thresholds: list[ThresholdTime] = field(default_factory=list)
    stalls: list[Stretch] = field(default_factory=list)
    alerts: list[AlertSpan] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    rules: tuple[str, ...] = ()
    stall_utilization: float = STALL.utilization
    min_stall: float = STALL.min_seconds
    skipped: SkippedLines | None = None
    skipped_files: tuple[str, ...] = ()
    health: list[HealthCount] = field(default_factory=list)
    overall: list[FieldStats] = field(default_factory=list)
    energy_wh: dict[int, float] = field(default_factory=dict)
    clock_steps: list[ClockStep] = field(default_factory=list)
    zone_changes: list[tuple[datetime, str, str]] = field(default_factory=list)
    elapsed: float | None = None
    not_recorded: tuple[str, ...] = ()
    unchecked_rules: tuple[str, ...] = ()
    names: dict[int, GpuName] = field(default_factory=dict)
    #: What a notebook shows a report with: :func:`~smiquery.analysis.report_html`, which lives above this module
    #: (:mod:`smiquery.analysis` sets it).
    html_renderer: ClassVar[Callable[[Report], str] | None] = None

    @property
    def duration(self) -> float:
        """Seconds from the first sample to the last, never negative: a step back of the clock is skipped."""
        if self.elapsed is not None:
            return self.elapsed
        return max(0.0, seconds_between(self.start, self.end))

    def time_over(self, rule: str, gpu: int) -> float:
        """Seconds GPU ``gpu`` spent past the threshold of ``rule`` (its text as given); 0 when never."""
        norm = " ".join(rule.split())
        return sum(t.seconds for t in self.thresholds if t.gpu == gpu and t.rule == norm)

    def alerts_fired(self, rule: str, gpu: int) -> int:
        """How many times ``rule`` (its text as given) would have fired on GPU ``gpu``."""
        norm = " ".join(rule.split())
        return sum(1 for a in self.alerts if a.gpu == gpu and a.rule == norm)

    def _repr_html_(self) -> str | None:
        """The report as :func:`~smiquery.analysis.report_html` draws it (no plot): how a notebook shows it."""
        render = type(self).html_renderer
        return None if render is None else render(self)

    def ref(self, gpu: int) -> dict[str, Any]:
        """How JSON names GPU ``gpu``: ``{"gpu": 3}`` in a recording's report; in a fleet's, its node and UUID too."""
        name = self.names.get(gpu)
        return {"gpu": gpu} if name is None else name.to_dict(gpu)

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready dicts and lists."""
        ref = self.ref
        named = bool(self.names)
        return {
            "source": self.source,
            "gpus": list(self.gpus),
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "duration_seconds": round(self.duration, 3),
            "samples_per_gpu": self.sweeps,
            "interval_seconds": round(self.interval, 3),
            "energy_wh": {str(g): round(wh, 3) for g, wh in self.energy_wh.items()},
            "not_recorded": list(self.not_recorded),
            "rules": list(self.rules),
            "stall_utilization": self.stall_utilization,
            "min_stall_seconds": self.min_stall,
            "findings": [
                {**f.to_dict(), "gpus": [ref(g) for g in f.gpus]} if named else f.to_dict() for f in self.findings
            ],
            "stalls": [{**s.to_dict(), **ref(s.gpu)} for s in self.stalls],
            "thresholds": [
                {
                    "rule": t.rule,
                    **ref(t.gpu),
                    "seconds_past_threshold": round(t.seconds, 3),
                    "stretches": t.stretches,
                    "longest_seconds": round(t.longest, 3),
                    "peak": t.peak,
                    "alerts_fired": self.alerts_fired(t.rule, t.gpu),
                }
                for t in self.thresholds
            ],
            "alerts": [{**a.to_dict(), **ref(a.gpu)} for a in self.alerts],
            "stats": [_json(s, ref(s.gpu), mean=4, p95=4) for s in self.stats],
            "constants": {name: {str(g): v for g, v in per.items()} for name, per in self.constants.items()},
            "health": [{**h.to_dict(), **ref(h.gpu)} for h in self.health],
            "skipped_lines": None
            if self.skipped is None
            else {"count": self.skipped.count, "first_line": self.skipped.first_lineno},
            "skipped_files": list(self.skipped_files),
        }


@dataclass(frozen=True)
class Periods:
    """The stalls and alerts of a recording as :func:`~smiquery.analysis.report` finds them, without the rest."""

    stalls: list[Stretch]
    alerts: list[AlertSpan]
