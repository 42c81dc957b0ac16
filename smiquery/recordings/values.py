"""What the sample readers share: timestamps in the zone asked for, a single-GPU log as GPU 0."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta, timezone, tzinfo

from smiquery.clock import Localizer, to_zone
from smiquery.fields import get_field
from smiquery.sample import GpuSample, Schema

__all__ = [
    "RECORDED_WITHOUT_ZONE",
    "in_zone",
    "with_gpu0",
    "with_timestamp",
]

#: The parser needs a zone for a timestamp written without one; this one marks "none was recorded", so that such
#: a timestamp can be given back naive (or put in the zone named by ``tz=``). A named UTC: never ``timezone.utc``.
RECORDED_WITHOUT_ZONE = timezone(timedelta(0), "no zone recorded")


def in_zone(dt: datetime, tz: tzinfo | None, localize: Localizer | None = None) -> datetime:
    """A parsed timestamp as the caller asked: naive as recorded, localized to ``tz``, or converted to ``tz``.

    ``localize`` (a :class:`~smiquery.clock.Localizer` for ``tz`` over the recording's rows in order) resolves the
    hour a DST fall-back repeats by that order; without one such a time is the first of its two instants.
    """
    if dt.tzinfo is RECORDED_WITHOUT_ZONE or dt.tzinfo is None:
        if tz is None:
            return dt.replace(tzinfo=None)  # the wall-clock time, naive, exactly as recorded
        return localize(dt) if localize is not None else dt.replace(tzinfo=tz)
    return dt if tz is None else to_zone(dt, tz)


def with_timestamp(sample: GpuSample, ts: datetime, *, keep_raw: bool = False) -> GpuSample:
    """The sample with another timestamp; its raw text too unless ``keep_raw`` (the same instant, as recorded)."""
    schema = sample.schema
    pos = schema.pos_timestamp
    if pos is None:
        return sample
    values = list(sample.values())
    values[pos] = ts
    raw = tuple(sample.raw.values())
    if not keep_raw:
        raw = (*raw[:pos], get_field("timestamp").format(ts), *raw[pos + 1 :])
    return GpuSample(schema, tuple(values), raw, dict(sample.missing) or None, sample.gpu_lost)


def with_gpu0(samples: Iterable[GpuSample]) -> Iterator[GpuSample]:
    """The samples, each with an ``index`` column: a single-GPU log (``timestamp, power.draw``) is GPU 0."""
    gpu0: dict[tuple[str, ...], Schema] = {}
    for sample in samples:
        if "index" in sample:
            yield sample
            continue
        schema = gpu0.get(sample.fields)
        if schema is None:
            schema = gpu0[sample.fields] = Schema(("index", *sample.fields))
        yield GpuSample(
            schema,
            (0, *(sample[n] for n in sample.fields)),
            ("0", *sample.raw.values()),
            dict(sample.missing) or None,
            sample.gpu_lost,
        )
