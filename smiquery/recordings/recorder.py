"""``smiquery stream --output``: recorders that can be left running for weeks (their behaviour: docs/recording.md).

:class:`TextRecorder` writes CSV and JSONL (:class:`~smiquery.recordings.parquet.ParquetDataset`, Parquet), each row
with one ``write``; beside it, what both share: metadata files, target checks, rotated names.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any, Literal

from smiquery.errors import InvalidTimeZoneError, RecordingError, UsageError
from smiquery.fields import Field
from smiquery.recordings.base import META_SUFFIX, resolve_zone
from smiquery.recordings.jsonl import read_jsonl_samples, sample_to_json
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import format_row, header_line

__all__ = [
    "FULL_DISK",
    "META",
    "META_SUFFIX",
    "Policy",
    "TextRecorder",
    "check_columns",
    "check_target",
    "prune_rotated",
    "read_meta",
    "recorded_rules",
    "recorded_zone",
    "rotated_name",
    "rotated_siblings",
    "write_meta",
    "zone_name",
]

Policy = Literal["new", "force", "append"]

#: Errors of a write that mean "no room" (rows are dropped until there is some), not "cannot write here".
FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

#: The metadata file inside a Parquet dataset folder.
META = "_smiquery.json"

_STAMP = "%Y%m%dT%H%M%S"


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A metadata file (``run.csv.meta.json``, a dataset's ``_smiquery.json``) as a dict; empty when unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def write_meta(path: Path, new: dict[str, Any], rules: Sequence[str] = ()) -> None:
    """Add the keys of ``new`` a metadata file lacks, and ``rules`` to its rules, atomically. Raises OSError.

    Written aside and renamed into place, and only when that changes it.
    """
    old = read_meta(path)
    meta = {**new, **old}
    merged = list(dict.fromkeys([*(meta.get("rules") or ()), *rules]))
    if merged:
        meta["rules"] = merged
    if meta == old:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(meta) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _meta_of(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of a recording: ``_smiquery.json`` in a dataset folder, ``run.csv.meta.json`` beside a file."""
    return read_meta(os.path.join(path, META) if os.path.isdir(path) else os.fspath(path) + META_SUFFIX)


def recorded_zone(path: str | os.PathLike[str]) -> tzinfo | None:
    """The time zone a recording (file or dataset folder) was made in, or None when its metadata names none."""
    name = _meta_of(path).get("tz")
    try:
        return resolve_zone(name) if isinstance(name, str) and name else None
    except InvalidTimeZoneError:
        return None


def recorded_rules(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The ``--alert`` rules a recording (file or dataset folder) was made with; empty when it names none."""
    rules = _meta_of(path).get("rules")
    return tuple(r for r in rules if isinstance(r, str)) if isinstance(rules, list) else ()


def zone_name(sample: GpuSample) -> str | None:
    """The IANA zone a sample's timestamp is in (what a CSV's wall-clock times mean), or None when unknown.

    A live sample carries this host's zone; a replayed one the zone ``--tz`` gave it, or none (naive times from a
    plain log: recording a zone for them would be a guess).
    """
    ts = sample.timestamp
    if not isinstance(ts, datetime) or ts.tzinfo is None:
        return None
    key = getattr(ts.tzinfo, "key", None)
    if isinstance(key, str):
        return key
    from smiquery.frames import local_zone

    local = local_zone()
    key = getattr(local, "key", None)
    return key if isinstance(key, str) and local.utcoffset(ts.replace(tzinfo=None)) == ts.utcoffset() else None


def check_target(path: Path, policy: Policy) -> bool:
    """True when ``path`` exists; raises UsageError when it does and ``policy`` is ``"new"``."""
    exists = path.exists()
    if exists and policy == "new":
        raise UsageError(
            f"{path} already exists; pass --append to go on writing it, --force to replace it, or another --output"
        )
    return exists


def check_columns(path: Path, have: Sequence[str] | None, fields: Sequence[Field]) -> None:
    """Raise UsageError when a recording to append to records other columns (``have``; None: unknown)."""
    want = [f.name for f in fields]
    if isinstance(have, (list, tuple)) and list(have) != want:
        raise UsageError(
            f"--append: {path} records {','.join(map(str, have))}, not {','.join(want)}; "
            "pass the same --fields or record to another --output"
        )


def rotated_name(path: Path, started: float) -> Path:
    """The free name a rotated file takes: ``run.csv`` started at 06:50:00 becomes ``run.20261204T065000.csv``.

    ``-2``, ``-3`` ... are appended to a name taken within the same second.
    """
    stamp = datetime.fromtimestamp(started).strftime(_STAMP)
    target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    n = 2
    while target.exists():
        target = path.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
        n += 1
    return target


def rotated_siblings(path: Path) -> list[Path]:
    """The rotated files of ``path`` (``run.<stamp>.csv`` beside ``run.csv``), oldest first."""
    pattern = re.compile(re.escape(path.stem) + r"\.(\d{8}T\d{6})(?:-(\d+))?" + re.escape(path.suffix) + "$")
    try:
        found = [(m.group(1), int(m.group(2) or 1), p) for p in path.parent.iterdir() if (m := pattern.match(p.name))]
    except OSError:
        return []
    return [p for *_, p in sorted(found)]


def prune_rotated(files: Sequence[Path], keep: int | None, say: Callable[[str], None]) -> None:
    """Delete all but the newest ``keep`` of ``files`` (oldest first; None keeps all); a failure is told to ``say``."""
    if keep is None or len(files) <= keep:
        return
    for old in files[: len(files) - keep]:
        try:
            old.with_name(old.name + META_SUFFIX).unlink(missing_ok=True)
            old.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            say(f"smiquery: cannot delete the old recording {old} (--keep): {exc.strerror or exc}")


class TextRecorder:
    """Records samples as nvidia-smi CSV (``kind="csv"``) or JSONL, one whole line per ``write`` call.

    ``policy``: ``"new"`` refuses an existing file, ``"force"`` replaces it, ``"append"`` goes on writing it (with
    the same ``fields``). A new file is started at ``rotate_bytes`` bytes or after ``rotate_seconds``, keeping
    ``keep`` rotated ones (None: all). ``flush_every``: seconds between ``fsync`` calls (0: every row). ``say``
    gets the one-line notices (full disk, truncation, recovery); ``clock`` gives monotonic seconds; ``rules`` (the
    ``--alert`` rules) are recorded beside the file so that a report of it checks them too. Raises UsageError (the
    file exists and ``policy`` is ``"new"``, or an appended file has other columns) or RecordingError (it cannot be
    created or opened there).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fields: Sequence[Field],
        *,
        kind: Literal["csv", "jsonl"],
        policy: Policy = "new",
        rotate_bytes: int | None = None,
        rotate_seconds: float | None = None,
        keep: int | None = None,
        flush_every: float = 10.0,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rules: Sequence[str] = (),
    ) -> None:
        self.path = Path(path)
        self.fields = tuple(fields)
        self.kind = kind
        self.rules = tuple(rules)
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds
        self.keep = keep
        self.flush_every = flush_every
        self.say = say or (lambda line: None)
        self.clock = clock
        #: rows written and rows dropped because the disk was full (``size``: bytes in the file being written)
        self.rows = 0
        self.dropped = 0
        self._dropping = 0
        self._reopen = False
        self._fd = -1
        self._dirty = False
        if check_target(self.path, policy) and policy == "append":
            from smiquery.recordings.csvfile import csv_header

            check_columns(self.path, csv_header(self.path) if kind == "csv" else _jsonl_keys(self.path), self.fields)
        self._open(truncate=policy == "force")

    def _open(self, *, truncate: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
        try:
            self._fd = os.open(self.path, flags, 0o644)
            self.size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise RecordingError(_cannot(self.path, exc, "choose another --output")) from None
        self._opened = self.clock()
        self._synced = self._opened
        self._started = time.time()
        if self.size == 0:
            self._header()
        # an appended file keeps its zone (and adds this run's rules); a new one learns it from its first row
        self._meta_due = self.kind == "csv" or bool(self.rules)

    def _header(self) -> None:
        if self.kind == "csv":
            self._put((header_line(self.fields) + "\n").encode("utf-8"))

    @property
    def age(self) -> float:
        """Seconds since the file being written was opened."""
        return self.clock() - self._opened

    def reopen(self) -> None:
        """Open the path again before the next row (SIGHUP: logrotate moved the file away). Signal-safe."""
        self._reopen = True

    def write(self, sample: GpuSample) -> None:
        """Write one sample as one whole line; rotate, reopen or notice a truncation first.

        Raises RecordingError when the file cannot be written for another reason than a full disk.
        """
        if self._fd < 0:
            raise RecordingError(f"the recording {self.path} is closed")
        if self._reopen:
            self._reopen = False
            self._close_fd()
            self._open()
        elif (self.rotate_bytes is not None and self.size >= self.rotate_bytes) or (
            self.rotate_seconds is not None and self.clock() - self._opened >= self.rotate_seconds
        ):
            self._rotate()
        else:
            self._check_truncated()
        if self.kind == "csv":
            line = format_row(sample, self.fields, units=True) + "\n"
        else:
            line = json.dumps(sample_to_json(sample), separators=(", ", ": ")) + "\n"
        if self._put(line.encode("utf-8")):
            self.rows += 1
            if self._meta_due:  # run.csv.meta.json: the zone of the rows' wall-clock times (JSONL's carry offsets)
                self._meta_due = False
                target = self.path.with_name(self.path.name + META_SUFFIX)
                zone = zone_name(sample) if self.kind == "csv" else None
                meta = {
                    "format": "smiquery-csv-meta",
                    "version": 1,
                    "tz": zone,
                    "fields": [f.name for f in self.fields],
                }
                try:
                    write_meta(target, meta, self.rules)
                except OSError as exc:
                    self.say(
                        f"smiquery: cannot write {target}: {_why(exc)}; the recording's zone and rules are not recorded"
                    )
        else:
            self.dropped += 1
            self._dropping += 1
        if self._dirty and self.clock() - self._synced >= self.flush_every:
            self._sync()

    def _rotate(self) -> None:
        self._sync()
        self._close_fd()
        target = rotated_name(self.path, self._started)
        try:
            os.rename(self.path, target)
            meta = self.path.with_name(self.path.name + META_SUFFIX)
            if meta.exists():  # the zone and rules go with their rows
                os.replace(meta, target.with_name(target.name + META_SUFFIX))
        except FileNotFoundError:
            pass  # moved away already (by logrotate): start the new file all the same
        except OSError as exc:
            raise RecordingError(_cannot(self.path, exc, "rotate it: check the folder's permissions")) from None
        self._open()
        prune_rotated(rotated_siblings(self.path), self.keep, self.say)

    def _check_truncated(self) -> None:
        try:
            now = os.fstat(self._fd).st_size
        except OSError:
            return
        if now < self.size:
            self.say(f"smiquery: {self.path} shrank under the recorder (copytruncate?); writing on at its new end")
            self.size = now
            if now == 0:
                self._header()
        elif now > self.size:
            self.size = now  # someone else appended: our next line still goes to the end

    def _put(self, data: bytes) -> bool:
        """Write ``data`` whole, or cut the file back to where it was and return False when the disk is full."""
        start = self.size
        done = 0
        try:
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            if exc.errno not in FULL_DISK:
                raise RecordingError(_cannot(self.path, exc, "check the disk and the file")) from None
            if done:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)  # no half line: the file stays readable
            if self._dropping == 0:
                self.say(
                    f"smiquery: cannot write {self.path}: {_why(exc)}; rows are dropped until there is space again"
                )
            return False
        self.size = start + done
        self._dirty = True
        if self._dropping:
            lost = self._dropping
            self._dropping = 0
            self.say(f"smiquery: recording to {self.path} again; {lost} row(s) were lost while the disk was full")
        return True

    def _sync(self) -> None:
        self._synced = self.clock()
        if self._dirty and self._fd >= 0:
            self._dirty = False
            try:
                os.fsync(self._fd)
            except OSError as exc:
                if exc.errno not in FULL_DISK | {errno.EINVAL}:
                    raise RecordingError(_cannot(self.path, exc, "check the disk")) from None

    def _close_fd(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def close(self) -> None:
        """Sync and close. Idempotent."""
        if self._fd < 0:
            return
        try:
            self._sync()
        finally:
            self._close_fd()


def _jsonl_keys(path: Path) -> tuple[str, ...] | None:
    """The field names of a JSONL recording's first readable line, or None when it has none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            first = next(read_jsonl_samples(fh, lambda err: None, None), None)
    except OSError as exc:
        raise RecordingError(_cannot(path, exc, "check the file")) from None
    return None if first is None else first.fields


_WHY = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file is as large as this system lets it grow",
}


def _why(exc: OSError) -> str:
    return _WHY.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()


def _cannot(path: Path, exc: OSError, todo: str) -> str:
    """``cannot write run.csv: permission denied; choose another --output`` (no ``[Errno 13]``)."""
    return f"cannot write {path}: {_why(exc)}; {todo}"
