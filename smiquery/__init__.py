"""smiquery: typed, trustworthy NVIDIA GPU monitoring through nvidia-smi.

The names here are the tasks: a snapshot (:func:`query`, :func:`query_df`), a stream (:func:`stream`,
:class:`Stream`), recordings (:func:`read_csv`, :func:`replay`), :func:`processes`, :func:`details` and
:func:`get_gpu_status`. Every error is a :class:`SmiqueryError` (the tree: :mod:`smiquery.errors`); everything
else has one home in its module (``smiquery.fields``, ``smiquery.recordings``, ``smiquery.testing``...).
"""

from __future__ import annotations

from smiquery.errors import SmiqueryError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (and re) at run time

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from smiquery import aio, compat, fields, runner, sample, source, sources, streams  # noqa: F401
    from smiquery.recordings.csvfile import read_csv
    from smiquery.recordings.playback import replay
    from smiquery.retry import RetryPolicy
    from smiquery.sample import GpuSample
    from smiquery.sources.apps import processes
    from smiquery.sources.details import details
    from smiquery.sources.query_gpu import get_gpu_status, query, query_df
    from smiquery.streams.sync import Stream, stream
del TYPE_CHECKING  # not a public name

__version__ = "0.1.0"

# Only the errors are imported eagerly: every other public name is imported from its module on first use, so that
# `import smiquery` stays a fraction of the interpreter's own start-up (tests/test_startup.py checks).
_LAZY = {
    "GpuSample": "smiquery.sample",
    "RetryPolicy": "smiquery.retry",
    "Stream": "smiquery.streams.sync",
    "details": "smiquery.sources.details",
    "get_gpu_status": "smiquery.sources.query_gpu",
    "processes": "smiquery.sources.apps",
    "query": "smiquery.sources.query_gpu",
    "query_df": "smiquery.sources.query_gpu",
    "stream": "smiquery.streams.sync",
    # these import pandas on first use
    "read_csv": "smiquery.recordings.csvfile",
    "replay": "smiquery.recordings.playback",
}
# Submodules reachable after a plain `import smiquery` (`smiquery.fields.CATALOGUE`), imported on first use.
_LAZY_MODULES = frozenset({"aio", "compat", "fields", "runner", "sample", "source", "sources", "streams"})


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY_MODULES:
        return importlib.import_module(f"smiquery.{name}")  # the import binds it on the package
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'smiquery' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _LAZY_MODULES)


__all__ = [
    "GpuSample",
    "RetryPolicy",
    "SmiqueryError",
    "Stream",
    "__version__",
    "details",
    "get_gpu_status",
    "processes",
    "query",
    "query_df",
    "read_csv",
    "replay",
    "stream",
]
