"""Time rules for nvidia-smi's timestamps: wall-clock stamps put in a zone by row order, and steps that never go back.

nvidia-smi's local wall time repeats an hour when daylight saving ends, skips one when it starts, and steps with NTP
or a VM resume: a repeated wall time is resolved by the *order* of the rows, a skipped one shifted forward; a duration
is the time that really passed (through UTC); without a zone a step back counts 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

__all__ = [
    "ClockStep",
    "Localizer",
    "elapsed",
    "later",
    "localize_by_order",
    "seconds_between",
    "timeline",
    "to_zone",
]

_UTC = timezone.utc
_EPOCH = datetime(1970, 1, 1, tzinfo=_UTC)

#: A step back shorter than this is jitter between rows, not worth a word (it still counts as 0 elapsed).
REPORTED_STEP_BACK = 1.0


class Localizer:
    """Puts wall-clock times, row after row of one timeline (one file or stream), into ``tz`` (None: the host's).

    An ambiguous time (the hour a fall-back repeats) takes its first instant unless that would put it before the
    previous row while the second would not and is the nearer of the two to it (so jitter stays in the first pass).
    """

    __slots__ = ("_fixed", "last", "tz")

    def __init__(self, tz: tzinfo | None) -> None:
        self.tz = tz
        #: the instant of the previous row, which decides the next ambiguous one
        self.last: datetime | None = None
        # a fixed offset has no ambiguous or skipped times
        self._fixed = isinstance(tz, timezone)

    def _aware(self, naive: datetime, fold: int) -> datetime:
        if self.tz is None:
            return naive.replace(fold=fold).astimezone()
        return naive.replace(tzinfo=self.tz, fold=fold)

    def __call__(self, naive: datetime) -> datetime:
        """The instant of ``naive`` (a wall time, tzinfo ignored) for this row; remembers it for the next row."""
        naive = naive.replace(tzinfo=None, fold=0)
        first = self._aware(naive, 0)
        second = first if self._fixed else self._aware(naive, 1)
        if first.utcoffset() == second.utcoffset():
            out = first
        else:
            # back into the zone from the instant: the wall time that really existed then; a wall time the
            # spring-forward skips does not come back from its instant: shifted forward
            real = first.astimezone(_UTC).astimezone(self.tz)
            out = real if real.replace(tzinfo=None, fold=0) != naive else self._pick(first, second)
        self.last = out
        return out

    def plain_hour(self, naive: datetime) -> bool:
        """True when the hour of ``naive`` holds no zone change, so a parser may reuse one offset for all its rows."""
        if self._fixed:
            return True
        start = naive.replace(minute=0, second=0, microsecond=0, tzinfo=None, fold=0)
        end = start.replace(minute=59, second=59, microsecond=999999)
        offsets = {self._aware(t, fold).utcoffset() for t in (start, end) for fold in (0, 1)}
        return len(offsets) == 1

    def _pick(self, first: datetime, second: datetime) -> datetime:
        """The fall-back's repeated hour: the first pass unless the order of the rows says the second."""
        # in UTC: aware datetimes of one zone compare by wall time, blind to the fold
        a, b = first.astimezone(_UTC), second.astimezone(_UTC)
        if b < a:  # a zone whose fold=1 is the earlier instant (none known, but cheap to honour)
            first, second, a, b = second, first, b, a
        if self.last is None:
            return first
        last = self.last.astimezone(_UTC)
        if a >= last or b < last:
            return first
        return _stable(second) if (b - last) <= (last - a) else first


def _stable(dt: datetime) -> datetime:
    """A time of a fall-back's second pass with its offset fixed (``02:30+01:00`` named ``CET``).

    Python keeps the second pass apart from the first only by ``fold=1``, which adding a timedelta resets and which
    comparing two times of one zone ignores; a fixed offset keeps the instant through both.
    """
    off = dt.utcoffset()
    if not dt.fold or off is None or isinstance(dt.tzinfo, timezone):
        return dt
    return dt.astimezone(timezone(off, dt.tzname() or str(off)))


def to_zone(dt: datetime, tz: tzinfo) -> datetime:
    """An aware time converted to ``tz``; one in the hour a fall-back repeats keeps its instant (see _stable)."""
    return _stable(dt.astimezone(tz))


def seconds_between(start: datetime, end: datetime) -> float:
    """Seconds from ``start`` to ``end`` as they really passed (negative when ``end`` is earlier).

    Aware times are taken by their instants, across any DST change between them; naive ones by their wall times;
    TypeError when one is naive and the other aware.
    """
    if start.tzinfo is not None and end.tzinfo is not None:
        start, end = start.astimezone(_UTC), end.astimezone(_UTC)
    return (end - start).total_seconds()


def later(dt: datetime, delta: timedelta) -> datetime:
    """``dt`` moved ``delta`` of real time on, shown in its own zone (a naive time: its wall time moved)."""
    tz = dt.tzinfo
    if tz is None or isinstance(tz, timezone):
        return dt + delta
    return to_zone(dt.astimezone(_UTC) + delta, tz)


def localize_by_order(naive: Any, tz: tzinfo) -> pd.DatetimeIndex:
    """Vectorised :class:`Localizer`: ``datetime64[ns]`` wall times in file order as an aware ``DatetimeIndex``.

    NaT stays NaT; only the rows of a repeated or skipped hour are resolved one by one.
    """
    import numpy as np
    import pandas as pd

    index = pd.DatetimeIndex(naive).as_unit("ns")
    plain = index.tz_localize(tz, ambiguous="NaT", nonexistent="NaT")
    special = np.flatnonzero(plain.isna() & ~index.isna())
    if not len(special):
        return cast("pd.DatetimeIndex", plain)
    utc = plain.asi8.copy()  # UTC ns, NaT as the minimum int64
    last_valid = np.maximum.accumulate(np.where(~plain.isna(), np.arange(len(utc)), -1))  # a row's last good row
    walls = index.asi8
    localizer = Localizer(tz)
    done = -1  # position of the last special row resolved
    for i in special.tolist():
        before = int(last_valid[i - 1]) if i > 0 else -1
        prev = done if done > before else before
        localizer.last = None if prev < 0 else _EPOCH + timedelta(microseconds=int(utc[prev]) // 1000)
        wall_ns = int(walls[i])
        wall = datetime(1970, 1, 1) + timedelta(microseconds=wall_ns // 1000)
        utc[i] = (localizer(wall) - _EPOCH) // timedelta(microseconds=1) * 1000 + wall_ns % 1000
        done = i
    return cast("pd.DatetimeIndex", pd.DatetimeIndex(pd.to_datetime(utc, unit="ns", utc=True)).tz_convert(tz))


@dataclass(frozen=True)
class ClockStep:
    """The recorded clock stepped back (DST read without a zone, NTP, a VM resume) ``seconds`` from ``at`` to ``to``."""

    at: datetime
    to: datetime
    seconds: float


def timeline(stamps: np.ndarray, cap: float | None = None, interval: float | None = None) -> np.ndarray:
    """Seconds from the first of ``datetime64[ns]`` ``stamps``, each step between rows clamped: never negative.

    A step back (or from a missing time) counts 0; a forward step longer than ``cap`` (the clock jumped, the stream
    stopped) counts ``interval`` (default ``cap``'s third, the usual spacing); ``cap`` None: none is a gap.
    """
    import numpy as np

    ns = np.asarray(stamps, dtype="datetime64[ns]").astype("int64")
    if not len(ns):
        return np.zeros(0, dtype="float64")
    steps = np.diff((ns - ns[0]) / 1e9)
    steps = np.where(steps > 0, steps, 0.0)  # NaN (a missing time) counts nothing either
    if cap is not None:
        steps = np.where(steps > cap, interval if interval is not None else cap / 3.0, steps)
    return np.concatenate(([0.0], np.cumsum(steps)))


def elapsed(since: datetime | float | None, now: datetime | float) -> float:
    """Seconds from ``since`` to ``now`` (datetimes or clock seconds); 0, never negative, when time went back.

    Aware datetimes count the time that really passed (see :func:`seconds_between`), across a DST change too.
    """
    if isinstance(since, datetime) and isinstance(now, datetime):
        if (since.tzinfo is None) == (now.tzinfo is None):
            return max(0.0, seconds_between(since, now))
    elif isinstance(since, (int, float)) and isinstance(now, (int, float)):
        return max(0.0, float(now) - float(since))
    return 0.0
