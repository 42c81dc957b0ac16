"""``GpuSample``: one GPU at one instant, holding exactly the fields that were queried."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Any

__all__ = ["BusKey", "GpuSample", "Schema", "Value", "bus_key"]

Value = int | float | bool | str | datetime | None

_EMPTY: Mapping[str, str] = MappingProxyType({})

#: (domain, bus, device) of a PCI address, as :func:`bus_key` gives it.
BusKey = tuple[int, int, int]


def bus_key(pci_bus_id: str) -> BusKey | None:
    """(domain, bus, device) of a PCI bus id in any spelling (``00000000:3B:00.0``, ``0000:3b:00``); None if none.

    The kernel log and nvidia-smi spell the same address differently: compare keys, not strings.
    """
    try:  # [domain:]bus:device[.function]
        *domain, bus, device = (int(part, 16) for part in pci_bus_id.strip().split(".")[0].split(":"))
    except ValueError:
        return None
    return (domain[0] if domain else 0, bus, device) if len(domain) <= 1 else None


class Schema:
    """The column layout shared by every sample of one query: names, attribute names and positions."""

    __slots__ = ("_by_attr", "_by_name", "attrs", "names", "pos_index", "pos_timestamp", "pos_uuid")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.attrs = tuple(n.replace(".", "_") for n in names)
        self._by_name = {n: i for i, n in enumerate(names)}
        self._by_attr = {a: i for i, a in enumerate(self.attrs)}
        self.pos_index = self._by_name.get("index")
        self.pos_uuid = self._by_name.get("uuid")
        self.pos_timestamp = self._by_name.get("timestamp")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __repr__(self) -> str:
        return f"Schema({self.names!r})"


class GpuSample(Mapping[str, Value]):
    """An immutable record of one GPU at one instant: a read-only mapping of field name to value.

    Values are typed per the field catalogue. A status token (``[N/A]``, ``[Not Supported]``...) is ``None``,
    never 0, and its reason is kept in :attr:`missing`.

    Fields are reachable by nvidia-smi name or attribute name (``s["temperature.gpu"] == s.temperature_gpu``), and as
    a :class:`~collections.abc.Mapping` it works wherever a dict does (``dict(s)``, ``pd.DataFrame([s, ...])``).
    """

    # One slot holding (schema, values, raw, missing or None, gpu_lost): a sample is built for every row of a
    # stream, and setting one slot is about as cheap as building a tuple.
    __slots__ = ("_s",)
    _s: tuple[Schema, tuple[Value, ...], tuple[str, ...], Mapping[str, str] | None, bool]

    def __init__(
        self,
        schema: Schema,
        values: tuple[Value, ...],
        raw: tuple[str, ...],
        missing: Mapping[str, str] | None = None,
        gpu_lost: bool = False,
    ) -> None:
        """Build a sample; ``values`` and ``raw`` hold one entry per field of ``schema`` (else ValueError)."""
        if len(values) != len(schema.names) or len(raw) != len(schema.names):
            raise ValueError("a GpuSample needs one value and one raw cell per field")
        _store(self, (schema, tuple(values), tuple(raw), missing or None, bool(gpu_lost)))

    @property
    def gpu_lost(self) -> bool:
        """True when nvidia-smi reported ``[GPU is lost]`` in this row."""
        return self._s[4]

    @property
    def index(self) -> int | None:
        """The GPU index, or None when ``index`` was not queried (or was missing)."""
        p = self._s[0].pos_index
        return None if p is None else self._s[1][p]  # type: ignore[return-value]

    @property
    def uuid(self) -> str | None:
        """The GPU UUID, or None when not queried."""
        p = self._s[0].pos_uuid
        return None if p is None else self._s[1][p]  # type: ignore[return-value]

    @property
    def timestamp(self) -> datetime | None:
        """The sample time (timezone-aware), or None when not queried."""
        p = self._s[0].pos_timestamp
        return None if p is None else self._s[1][p]  # type: ignore[return-value]

    @property
    def fields(self) -> tuple[str, ...]:
        """The canonical names of the fields this sample holds, in query order."""
        return self._s[0].names

    def values(self) -> tuple[Value, ...]:  # type: ignore[override]
        """The typed values, in the order of :attr:`fields` (a tuple, which serves as a values view)."""
        return self._s[1]

    @property
    def schema(self) -> Schema:
        """The column layout shared with the other samples of the same query."""
        return self._s[0]

    @property
    def missing(self) -> Mapping[str, str]:
        """Field name -> reason (``"not_available"``, ``"not_supported"``, ``"gpu_lost"``...) for missing values."""
        m = self._s[3]
        return MappingProxyType(m) if m else _EMPTY

    @property
    def raw(self) -> Mapping[str, str]:
        """Field name -> the cell exactly as nvidia-smi printed it."""
        return dict(zip(self._s[0].names, self._s[2], strict=True))

    def __getitem__(self, name: str) -> Value:
        try:
            return self._s[1][self._s[0]._by_name[name]]
        except (KeyError, TypeError):
            raise KeyError(f"{name!r} was not queried; this sample holds {', '.join(self._s[0].names)}") from None

    def __getattr__(self, attr: str) -> Value:
        # Only reached when normal lookup fails: the queried fields by attribute name. Field attributes start
        # with a letter; anything else (dunders, the slot while unpickling) is a plain AttributeError.
        if attr.startswith("_"):
            raise AttributeError(attr)
        try:
            return self._s[1][self._s[0]._by_attr[attr]]
        except KeyError:
            raise AttributeError(f"GpuSample has no field {attr!r} (not queried)") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"GpuSample is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"GpuSample is immutable; cannot delete {name!r}")

    def __contains__(self, name: object) -> bool:
        return name in self._s[0]._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._s[0].names)

    def __len__(self) -> int:
        return len(self._s[0].names)

    def get(self, name: str, default: Any = None) -> Value:
        """The value of ``name``, or ``default`` when it was not queried (a missing value is still None)."""
        i = self._s[0]._by_name.get(name)
        return default if i is None else self._s[1][i]

    def to_dict(self, *, attrs: bool = False) -> dict[str, Value]:
        """The values as a plain dict keyed by nvidia-smi name (or attribute name with ``attrs=True``)."""
        schema = self._s[0]
        return dict(zip(schema.attrs if attrs else schema.names, self._s[1], strict=True))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GpuSample):
            mine, theirs = self._s, other._s
            return (mine[0].names, mine[1], mine[2]) == (theirs[0].names, theirs[1], theirs[2])
        if isinstance(other, Mapping):
            # like any mapping: equal to a dict holding the same names and values
            return dict(zip(self._s[0].names, self._s[1], strict=True)) == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._s[0].names, self._s[2]))

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(self._s[0].names, self._s[1], strict=True))
        lost = ", gpu_lost=True" if self._s[4] else ""
        return f"GpuSample({shown}{lost})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (GpuSample, self._s)


_store = GpuSample._s.__set__  # type: ignore[attr-defined]
