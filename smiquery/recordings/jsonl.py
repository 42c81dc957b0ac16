"""JSONL recordings: one JSON object per sample and line, field names as keys; written and read."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from datetime import datetime, tzinfo
from typing import IO, TYPE_CHECKING, Any

from smiquery.clock import Localizer
from smiquery.errors import ParseError, RecordingError
from smiquery.frames import field_for, to_dataframe
from smiquery.recordings.base import RECORDED_WITHOUT_ZONE, Drops, LineWriter, in_zone, resolve_zone, with_gpu0
from smiquery.sample import GpuSample, Schema, Value

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["JsonlWriter", "json_value", "read_jsonl", "read_jsonl_samples", "sample_from_json", "sample_to_json"]


def json_value(value: Value) -> object:
    """A value as JSON wants it: timestamps in ISO 8601, NaN/inf as null, the rest unchanged."""
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def sample_to_json(sample: GpuSample) -> dict[str, object]:
    """One sample as a JSON-ready dict keyed by field name, plus ``"_missing": {field: reason}`` when any."""
    out: dict[str, object] = {n: json_value(sample[n]) for n in sample.fields}
    missing = sample.missing
    if missing:
        out["_missing"] = dict(missing)
    return out


class JsonlWriter(LineWriter):
    """Writes one JSON object per sample and line (:func:`sample_to_json`) to ``out``; see :class:`LineWriter`."""

    def write(self, sample: GpuSample) -> None:
        """Write one sample as one complete line."""
        self._line(json.dumps(sample_to_json(sample), separators=(", ", ": ")) + "\n")


def sample_from_json(
    obj: dict[str, Any],
    *,
    lineno: int = 0,
    line: str = "",
    tz: tzinfo | str | None = None,
    localizer: Localizer | None = None,
) -> GpuSample:
    """A sample from one decoded JSONL object as ``smiquery stream --format jsonl`` writes it.

    Keys are field names (nvidia-smi or attribute names); ``null`` is a missing value, its reason in the optional
    ``"_missing"`` object (default ``not_available``); other keys starting with ``_`` are skipped. ``lineno`` and
    ``line`` go into errors. ``tz``: the zone of a timestamp without an offset (one with is converted to it; None:
    as recorded); ``localizer``, a :class:`~smiquery.clock.Localizer` for ``tz`` shared by a recording's objects
    read in order, resolves the hour a DST fall-back repeats by that order. Raises ParseError for a value that does
    not fit its field, InvalidTimeZoneError for an unknown zone name.
    """
    zone = resolve_zone(tz)
    reasons = obj.get("_missing") or {}
    names = [k for k in obj if not k.startswith("_")]
    fields = [field_for(n) for n in names]
    values: list[Value] = []
    missing: dict[str, str] = {}
    for key, fld in zip(names, fields, strict=True):
        raw = obj[key]
        if raw is None:
            values.append(None)
            missing[fld.name] = str(reasons.get(key) or reasons.get(fld.name) or "not_available")
            continue
        ops = fld.kind.ops
        try:
            if ops.storage != "timestamp":
                values.append(ops.from_python(raw))
                continue
            # text through the parser's own converter, so that it reads as the same cell in a CSV would
            stamp: Any = ops.converter(RECORDED_WITHOUT_ZONE)(raw.strip()) if isinstance(raw, str) else raw
            values.append(in_zone(ops.from_python(stamp), zone, localizer))  # type: ignore[arg-type]
        except (ValueError, TypeError):
            raise ParseError(
                f"{raw!r} is not a valid {fld.kind.value}", lineno=lineno, line=line, field=fld.name
            ) from None
    text = tuple(f.format(v, missing.get(f.name)) for f, v in zip(fields, values, strict=True))
    lost = any(r == "gpu_lost" for r in missing.values())
    return GpuSample(Schema(tuple(f.name for f in fields)), tuple(values), text, missing or None, lost)


def read_jsonl_samples(fh: IO[str], on_drop: Callable[[ParseError], None], tz: tzinfo | None) -> Iterator[GpuSample]:
    """The samples of an open JSONL recording, line by line, timestamps as :func:`sample_from_json` gives them.

    An unreadable line (a torn last line, garbage, a value that does not fit) is skipped and its error given to
    ``on_drop``.
    """
    localizer = Localizer(tz) if tz is not None else None
    for lineno, line in enumerate(fh, 1):
        text = line.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
            yield sample_from_json(obj, lineno=lineno, line=text, tz=tz, localizer=localizer)
        except ParseError as exc:
            on_drop(exc)
        except ValueError:  # includes a truncated last line (json.JSONDecodeError)
            on_drop(ParseError("not a JSON object", lineno=lineno, line=text))


def read_jsonl(path: str, tz: tzinfo | None) -> pd.DataFrame:
    """A JSONL recording as a DataFrame (``tz`` as in :func:`sample_from_json`), a row per readable line.

    Unreadable lines are described in ``attrs["skipped"]``; a single-GPU log gets an ``index`` column of 0 first.
    Raises RecordingError when the file cannot be read or holds no readable line.
    """
    drops = Drops()
    try:
        fh = open(path, encoding="utf-8", errors="replace", newline="")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise RecordingError(f"cannot read recording {path}: {exc.strerror or exc}") from exc
    with fh:
        samples = list(with_gpu0(read_jsonl_samples(fh, drops, tz)))
    if not samples:
        raise RecordingError(
            f"recording {path} holds no readable rows; is it a recording from `smiquery stream --output` "
            "or `nvidia-smi --query-gpu=... --format=csv`?"
        )
    df = to_dataframe(samples)
    if drops.first is not None:
        df.attrs["skipped"] = drops.skipped()
    return df
