"""The ``--query-gpu`` field catalogue (names, aliases, units, value kinds, presets) and the one field resolver.

The catalogue is data: ``fields.csv`` beside this module, one row per field ``nvidia-smi --help-query-gpu`` lists on
drivers 465 to 610, read when this module is imported (``import smiquery`` alone does not). What a field's kind does
with its cells lives in :mod:`smiquery.kinds`.
"""

from __future__ import annotations

import csv
import difflib
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import TYPE_CHECKING, Any

from smiquery.errors import InvalidFieldError, NvidiaSmiFailedError, failure_from_exit
from smiquery.kinds import Kind

if TYPE_CHECKING:
    from smiquery.sample import Value

__all__ = [
    "CATALOGUE",
    "PRESETS",
    "Field",
    "FieldsArg",
    "HelpEntry",
    "Kind",
    "get_field",
    "help_query_gpu",
    "parse_help_query_gpu",
    "resolve_fields",
]


@dataclass(frozen=True)
class Field:
    """One ``--query-gpu`` property: its canonical ``name`` (as the CSV header prints it), ``aliases`` and ``unit``.

    ``header_unit`` is the unit the header prints as ``name [unit]`` (temperatures print none), ``since`` the first
    driver branch known to list it, ``attr`` the Python attribute and DataFrame column name (dots become
    underscores), ``argv_name`` the spelling sent in ``--query-gpu`` (an older alias every driver accepts, such as
    ``clocks_throttle_reasons.active``, else ``name``).
    """

    name: str
    kind: Kind
    unit: str = ""
    header_unit: str | None = None
    aliases: tuple[str, ...] = ()
    since: int = 465
    help: str = ""
    attr: str = field(init=False)
    argv_name: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attr", self.name.replace(".", "_"))
        # the 535 branch renamed clocks_throttle_reasons.* to clocks_event_reasons.* and keeps the old names as
        # input aliases, while drivers before 535 reject the new ones (exit 2): the old name works on R465..R610
        old = _throttle_name(self.name)
        object.__setattr__(self, "argv_name", old if old in self.aliases else self.name)
        if self.header_unit is None:
            object.__setattr__(self, "header_unit", self.unit)

    @property
    def header(self) -> str:
        """The column title nvidia-smi prints for this field."""
        return f"{self.name} [{self.header_unit}]" if self.header_unit else self.name

    def parse(self, cell: str, *, tz: tzinfo | None = None) -> Value:
        """One CSV cell of this field -> its value (None for a status token); ValueError when it does not fit."""
        return self.kind.ops.parse(cell, self.header_unit or "", tz=tz)

    def format(self, value: Value, reason: str | None = None, *, units: bool = False) -> str:
        """The CSV cell nvidia-smi prints for ``value`` (its status token when None; the unit with ``units``)."""
        return self.kind.ops.format(value, self.unit, reason=reason, suffix=(self.header_unit or "") if units else "")

    def display(self, value: Value, *, missing: str = "n/a", with_unit: bool = False) -> str:
        """``value`` as a table shows it, rounded to the unit's precision (``missing`` when None)."""
        return self.kind.ops.display(value, self.unit, missing=missing, with_unit=with_unit)


def _throttle_name(name: str) -> str:
    """The name before the 535 branch (NVIDIA-SMI.md 1.2) of a ``clocks_event_reasons.*`` field, else ``name``."""
    return name.replace("clocks_event_reasons.", "clocks_throttle_reasons.", 1)


#: What every call that takes fields accepts: a preset, ``"a,b,c"``, names, or fields already resolved.
FieldsArg = str | Sequence[str | Field] | None

_IDENTITY = "timestamp index uuid "
_PRESETS = {
    "default": "timestamp index name uuid temperature.gpu utilization.gpu utilization.memory memory.used memory.total "
    "power.draw",
    "health": _IDENTITY + "name pci.bus_id temperature.gpu utilization.gpu utilization.memory memory.used "
    "memory.total power.draw power.limit fan.speed pstate clocks.current.sm clocks_event_reasons.active "
    "clocks_event_reasons.hw_thermal_slowdown clocks_event_reasons.sw_thermal_slowdown "
    "clocks_event_reasons.hw_power_brake_slowdown ecc.errors.corrected.volatile.total "
    "ecc.errors.uncorrected.volatile.total retired_pages.pending",
    "memory": _IDENTITY + "memory.total memory.used memory.free utilization.memory",
    "power": _IDENTITY + "power.draw power.limit enforced.power.limit power.default_limit power.min_limit "
    "power.max_limit pstate",
    "clocks": _IDENTITY + "clocks.current.graphics clocks.current.sm clocks.current.memory clocks.current.video "
    "clocks.max.graphics clocks.max.sm clocks.max.memory",
    "throttle": _IDENTITY + "clocks_event_reasons.active clocks_event_reasons.gpu_idle "
    "clocks_event_reasons.applications_clocks_setting clocks_event_reasons.sw_power_cap "
    "clocks_event_reasons.hw_slowdown clocks_event_reasons.hw_thermal_slowdown "
    "clocks_event_reasons.hw_power_brake_slowdown clocks_event_reasons.sw_thermal_slowdown "
    "clocks_event_reasons.sync_boost",
}
# fields.csv's header_unit: empty when nvidia-smi prints the unit in the header, "-" when it prints none
_HEADER_UNIT = {"": None, "-": ""}


def _read(path: str) -> tuple[Field, ...]:
    with open(path, encoding="utf-8", newline="") as fh:
        return tuple(
            Field(
                r["name"],
                Kind(r["kind"]),
                r["unit"],
                _HEADER_UNIT.get(r["header_unit"], r["header_unit"]),
                tuple(r["aliases"].split()),
                int(r["since"]),
                r["help"],
            )
            for r in csv.DictReader(fh)
        )


#: Every field, in ``--help-query-gpu`` order (the rows of ``fields.csv`` beside this module).
CATALOGUE = _read(os.path.join(os.path.dirname(__file__), "fields.csv"))
#: Preset name -> its fields, in column order; ``all`` is the whole catalogue.
PRESETS = {name: tuple(names.split()) for name, names in _PRESETS.items()} | {"all": tuple(f.name for f in CATALOGUE)}
# name or alias -> field; before the 535 branch the throttle reasons were canonical under their old name
_BY_NAME = {name: f for f in CATALOGUE for name in (f.name, *f.aliases)}
_BY_NAME |= {_throttle_name(f.name): f for f in CATALOGUE if _throttle_name(f.name) not in _BY_NAME}


def get_field(name: str, *, known: Iterable[str] | None = None) -> Field:
    """A field by name or alias (``known``: names this driver lists beyond the catalogue); else InvalidFieldError."""
    fld = _BY_NAME.get(name)
    if fld is not None:
        return fld
    if known is not None and name in set(known):
        return Field(name, Kind.STR, help="Listed by this driver's --help-query-gpu; not in smiquery's catalogue.")
    raise InvalidFieldError(name, difflib.get_close_matches(name, list(_BY_NAME), n=3, cutoff=0.6))


def resolve_fields(fields: FieldsArg = "default", *, known: Iterable[str] | None = None) -> tuple[Field, ...]:
    """Turn what a caller asked for into catalogue fields, in order, without duplicates: THE field resolver.

    ``fields``: a preset (``"default"``, ``"health"``...; None: default), ``"a,b,c"``, or a sequence of names or
    fields (resolved ones pass through). ``known``: names this driver lists; also limits ``"all"`` to them.
    Raises InvalidFieldError for a name that is unknown or malformed.
    """
    fields = "default" if fields is None else fields
    names: Sequence[str | Field]
    if isinstance(fields, str):
        if fields in PRESETS:
            names = PRESETS[fields]
            if fields == "all" and known is not None:
                allowed = {_BY_NAME[n].name if n in _BY_NAME else n for n in known}
                names = [n for n in names if n in allowed]
        else:
            names = [n.strip() for n in fields.split(",") if n.strip()]
    else:
        names = list(fields)
    if not names:
        raise InvalidFieldError("", [], detail="no field was given")
    out: dict[str, Field] = {}
    for n in names:
        if isinstance(n, Field):
            fld = n
        elif isinstance(n, str) and _NAME_RE.fullmatch(n):
            fld = get_field(n, known=known)
        else:
            raise InvalidFieldError(str(n), [], detail="field names are letters, digits, '.' and '_' only")
        out.setdefault(fld.name, fld)
    return tuple(out.values())


_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.]*")


@dataclass(frozen=True)
class HelpEntry:
    """One property listed by ``nvidia-smi --help-query-gpu``: its names and NVIDIA's description."""

    name: str
    aliases: tuple[str, ...]
    description: str


_HELP_NAME_RE = re.compile(r'"([^"]+)"')


def parse_help_query_gpu(text: str) -> list[HelpEntry]:
    """The entries of ``nvidia-smi --help-query-gpu`` output, in printed order.

    An entry is a line starting with a double quote right after a blank line (``"name" or "alias"``); the lines
    below it, up to the next blank line, describe it. Headings and prose in between are skipped.
    """
    entries: list[HelpEntry] = []
    for block in re.split(r"\n\s*\n", text.replace("\r", "")):
        first, _, rest = block.strip("\n").partition("\n")
        names = _HELP_NAME_RE.findall(first) if first.startswith('"') else []
        if names:
            desc = " ".join(line.strip() for line in rest.splitlines() if line.strip())
            entries.append(HelpEntry(names[0], tuple(names[1:]), desc))
    return entries


def help_query_gpu(run: Callable[[list[str], float], Any], binary: str, timeout: float) -> list[HelpEntry]:
    """What ``binary --help-query-gpu`` lists (run by a runner's ``run``); NvidiaSmiFailedError on failure or none."""
    argv = [binary, "--help-query-gpu"]
    done = run(argv, timeout)
    if done.returncode != 0:
        raise failure_from_exit(argv, done.returncode, done.output)
    entries = parse_help_query_gpu(done.stdout)
    if not entries:
        raise NvidiaSmiFailedError(argv, 0, done.output, "nvidia-smi --help-query-gpu listed no fields")
    return entries
