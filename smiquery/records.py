"""``GpuSample``: one GPU at one instant, holding exactly the fields that were queried."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Any

__all__ = ["GpuSample", "Schema", "Value"]

Value = int | float | bool | str | datetime | None

_EMPTY: Mapping[str, str] = MappingProxyType({})


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


class GpuSample(tuple):  # type: ignore[type-arg]
    """An immutable record of one GPU at one instant.

    Values are typed per the field catalogue. A status token (``[N/A]``, ``[Not Supported]``...) is ``None``,
    never 0, and its reason is kept in :attr:`missing`.

    Fields are reachable by nvidia-smi name or attribute name::

        s["temperature.gpu"] == s.temperature_gpu

    Iterating a sample yields its field names, like a mapping. (It is stored as a tuple internally so that
    creating one costs next to nothing on a 1,000-rows-a-second stream.)

    Attributes:
        index: the GPU's nvidia-smi index, when queried.
        uuid: the GPU's UUID, when queried.
        timestamp: when nvidia-smi sampled the row (timezone-aware), when queried.
        gpu_lost: True when nvidia-smi reported ``[GPU is lost]`` in this row.
    """

    __slots__ = ()

    def __new__(
        cls,
        schema: Schema,
        values: tuple[Value, ...],
        raw: tuple[str, ...],
        missing: Mapping[str, str] | None = None,
        gpu_lost: bool = False,
    ) -> GpuSample:
        """Build a sample; ``values`` and ``raw`` hold one entry per field of ``schema``."""
        if len(values) != len(schema.names) or len(raw) != len(schema.names):
            raise ValueError("a GpuSample needs one value and one raw cell per field")
        return tuple.__new__(cls, (schema, values, raw, missing or None, gpu_lost))

    @property
    def _schema(self) -> Schema:
        return _get(self, 0)  # type: ignore[no-any-return]

    @property
    def _values(self) -> tuple[Value, ...]:
        return _get(self, 1)

    @property
    def _raw(self) -> tuple[str, ...]:
        return _get(self, 2)

    @property
    def gpu_lost(self) -> bool:
        """True when nvidia-smi reported ``[GPU is lost]`` in this row."""
        return _get(self, 4)  # type: ignore[no-any-return]

    @property
    def index(self) -> int | None:  # type: ignore[override]
        """The GPU index, or None when ``index`` was not queried (or was missing)."""
        p = self._schema.pos_index
        return None if p is None else self._values[p]  # type: ignore[return-value]

    @property
    def count(self) -> int | None:  # type: ignore[override]
        """The ``count`` field (number of GPUs), or None when not queried; shadows ``tuple.count``."""
        return self.get("count")  # type: ignore[return-value]

    @property
    def uuid(self) -> str | None:
        """The GPU UUID, or None when not queried."""
        p = self._schema.pos_uuid
        return None if p is None else self._values[p]  # type: ignore[return-value]

    @property
    def timestamp(self) -> datetime | None:
        """The sample time (timezone-aware), or None when not queried."""
        p = self._schema.pos_timestamp
        return None if p is None else self._values[p]  # type: ignore[return-value]

    @property
    def fields(self) -> tuple[str, ...]:
        """The canonical names of the fields this sample holds, in query order."""
        return self._schema.names

    @property
    def values(self) -> tuple[Value, ...]:
        """The typed values, in the order of :attr:`fields`."""
        return self._values

    @property
    def schema(self) -> Schema:
        """The column layout shared with the other samples of the same query."""
        return self._schema

    @property
    def missing(self) -> Mapping[str, str]:
        """Field name -> reason (``"not_available"``, ``"not_supported"``, ``"gpu_lost"``...) for missing values."""
        m = _get(self, 3)
        return MappingProxyType(m) if m else _EMPTY

    @property
    def raw(self) -> Mapping[str, str]:
        """Field name -> the cell exactly as nvidia-smi printed it."""
        return dict(zip(self._schema.names, self._raw, strict=True))

    def __getitem__(self, name: str) -> Value:  # type: ignore[override]
        try:
            return self._values[self._schema._by_name[name]]
        except (KeyError, TypeError):
            raise KeyError(f"{name!r} was not queried; this sample holds {', '.join(self._schema.names)}") from None

    def __getattr__(self, attr: str) -> Value:
        # Only reached when normal lookup fails: the queried fields by attribute name.
        if attr.startswith("__"):
            raise AttributeError(attr)
        try:
            return self._values[self._schema._by_attr[attr]]
        except KeyError:
            raise AttributeError(f"GpuSample has no field {attr!r} (not queried)") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"GpuSample is immutable; cannot set {name!r}")

    def __contains__(self, name: object) -> bool:
        return name in self._schema._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._schema.names)

    def __len__(self) -> int:
        return len(self._schema.names)

    def get(self, name: str, default: Any = None) -> Value:
        """The value of ``name``, or ``default`` when it was not queried (a missing value is still None)."""
        i = self._schema._by_name.get(name)
        return default if i is None else self._values[i]

    def to_dict(self, *, attrs: bool = False) -> dict[str, Value]:
        """The values as a plain dict keyed by nvidia-smi name (or attribute name with ``attrs=True``)."""
        keys = self._schema.attrs if attrs else self._schema.names
        return dict(zip(keys, self._values, strict=True))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GpuSample):
            return NotImplemented
        return (self._schema.names, self._values, self._raw) == (other._schema.names, other._values, other._raw)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((self._schema.names, self._raw))

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip(self._schema.names, self._values, strict=True))
        lost = ", gpu_lost=True" if self.gpu_lost else ""
        return f"GpuSample({shown}{lost})"

    def __getnewargs__(self) -> tuple[Any, ...]:
        return (self._schema, self._values, self._raw, _get(self, 3), self.gpu_lost)


_get = tuple.__getitem__
