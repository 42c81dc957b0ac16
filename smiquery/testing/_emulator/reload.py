"""``reenumerate``: driver reloads counted across starts, and the GPU set each reload leaves behind."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import pathlib
import re
from collections.abc import Sequence

from smiquery.testing._emulator.recording import MappedSweeps, Recording
from smiquery.testing._emulator.settings import FakeUsageError, MemoryState, is_number


def reloads_struck(state: str | MemoryState | None) -> int:
    if isinstance(state, MemoryState):
        with state.lock:
            return state.value
    if state is None:
        raise FakeUsageError("fault 'reenumerate' needs a state file: set SMIQUERY_FAKE_STATE")
    try:
        text = pathlib.Path(state).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise FakeUsageError(f"cannot read state file {state}: {exc}") from exc
    if not is_number(text):
        raise FakeUsageError(f"state file {state} holds {text[:40]!r}, not a count of reloads: delete it")
    return int(text)


def record_reload(state: str | MemoryState | None, struck: int) -> None:
    if isinstance(state, MemoryState):
        with state.lock:
            state.value = struck
        return
    assert state is not None
    tmp = f"{state}.{os.getpid()}.tmp"
    pathlib.Path(tmp).write_text(f"{struck}\n", encoding="utf-8")
    os.replace(tmp, state)  # a start that reads it at the same moment sees the old count or the new one


def relayout(rec: Recording, modes: Sequence[str]) -> Recording:
    """``rec`` with the GPU set that the ``reenumerate`` reloads in ``modes`` left behind, in order."""
    if not modes:
        return rec
    changed = copy.copy(rec)  # the parsed recording is shared read-only: only attributes are replaced
    changed.sweeps = MappedSweeps(rec.sweeps, functools.partial(_reenumerated, rec, tuple(modes)))
    changed.gpus = [changed.identity(pos, row) for pos, row in enumerate(changed.sweeps[0])]
    return changed


def _reenumerated(rec: Recording, modes: tuple[str, ...], sweep: list[list[str]]) -> list[list[str]]:
    rows = [list(row) for row in sweep]
    for mode in modes:
        if mode == "swap" and len(rows) >= 2:
            rows[0], rows[1] = rows[1], rows[0]
        elif mode == "remove" and rows:
            del rows[1 if len(rows) > 1 else 0]
        elif mode == "add" and rows:
            rows.append(_added_gpu(rec, rows))
        # the driver numbers GPUs afresh at each load: positions are the new indices
        at = rec.col.get("index")
        if at is not None:
            for pos, row in enumerate(rows):
                row[at] = str(pos)
    return rows


def _added_gpu(rec: Recording, rows: list[list[str]]) -> list[str]:
    """A new GPU's row: the first GPU's values under a uuid, bus id and serial no other GPU has."""
    import uuid

    row = list(rows[0])
    if (at := rec.col.get("uuid")) is not None:
        row[at] = f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'smiquery-fake:{rows[0][at]}:{len(rows)}')}"
    if (at := rec.col.get("pci.bus_id")) is not None:
        buses = [int(m.group(1), 16) for r in rows if (m := re.search(r":([0-9A-Fa-f]{2}):", r[at]))]
        row[at] = f"00000000:{(max(buses, default=0) + 1) % 256:02X}:00.0"
    if (at := rec.col.get("serial")) is not None:
        serials = [int(r[at]) for r in rows if is_number(r[at])]
        if serials:
            row[at] = str(max(serials) + 1)
    return row


@dataclasses.dataclass(frozen=True)
class Reload:
    """The ``reenumerate`` reload due in this start: after ``after`` rows, the count in ``state`` goes up."""

    state: str | MemoryState | None
    struck: int
    after: int
