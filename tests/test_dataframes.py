"""Every DataFrame smiquery gives names and types its columns one way: ``memory.used`` is ``memory_used``, ``Int64``.

A notebook that joins a snapshot (``query_df``) to a recording (``read_csv``) or a live stream's history must not
have to rename or cast a column first.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from smiquery.fields import resolve_fields
from smiquery.frames import to_dataframe
from smiquery.recordings import open_recorder, read_csv, read_recording, replay
from smiquery.sources.apps import processes_df
from smiquery.sources.query_gpu import query, query_df
from smiquery.streams.sync import stream

SNAKE = re.compile(r"[a-z][a-z0-9_]*")
FIELDS = "default"


def _record(path: Path, **runner: Any) -> Path:
    rows = query(FIELDS, **runner)
    writer = open_recorder(path, resolve_fields(FIELDS))
    for sample in rows:
        writer.write(sample)
    writer.close()
    return path


def _frames(tmp_path: Path, fake_inproc: Any) -> dict[str, pd.DataFrame]:
    csv = _record(tmp_path / "run.csv", **fake_inproc())
    with stream(FIELDS, interval=0.05, **fake_inproc()) as s:
        list(s.sweeps(count=2))
        history = s.history()
    with replay(csv, speed=0) as source:
        replayed = to_dataframe(source)
    return {
        "query_df": query_df(FIELDS, **fake_inproc()),
        "Stream.history": history,
        "read_csv": read_csv(csv),
        "read_recording(.jsonl)": read_recording(_record(tmp_path / "run.jsonl", **fake_inproc())),
        "read_recording(.parquet)": read_recording(_record(tmp_path / "run.parquet", **fake_inproc())),
        "to_dataframe": replayed,
    }


def _nullable(dtype: Any) -> bool:
    """A column that holds a missing value as ``<NA>``/``NaT`` without changing type (not int64 or object)."""
    return isinstance(dtype, pd.api.extensions.ExtensionDtype) or dtype.kind == "M"


def test_every_dataframe_names_and_types_its_columns_as_query_df_does(tmp_path, fake_inproc):
    frames = _frames(tmp_path, fake_inproc)
    reference = frames["query_df"]
    assert "memory_used" in reference.columns and str(reference["memory_used"].dtype) == "Int64"
    for api, df in frames.items():
        assert len(df) > 0, api
        assert list(df.columns) == list(reference.columns), api
        for column in df.columns:
            assert SNAKE.fullmatch(column), f"{api}: column {column!r} is not snake_case"
            assert _nullable(df[column].dtype), f"{api}: column {column!r} is {df[column].dtype}"
            if column != "timestamp":  # recorded without a zone, a CSV's timestamps stay naive
                assert df[column].dtype == reference[column].dtype, f"{api}: {column}"
        assert df.attrs["units"]["memory_used"] == "MiB", api


def test_processes_df_follows_the_same_convention(fake_inproc):
    df = processes_df(**fake_inproc())
    snapshot = query_df(["index", "uuid", "name"], **fake_inproc())
    assert len(df) > 0
    for column in df.columns:
        assert SNAKE.fullmatch(column), column
        assert _nullable(df[column].dtype), f"{column} is {df[column].dtype}"
    assert df["gpu_index"].dtype == snapshot["index"].dtype
    assert df["gpu_uuid"].dtype == df["process_name"].dtype == snapshot["uuid"].dtype == snapshot["name"].dtype
    assert df.attrs["units"] == {"used_memory": "MiB"}
    assert dict(df.attrs["missing"]) == {}  # the bundled fake reports every process's memory


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_docs_build_dataframes_with_the_api(page):
    text = (Path(__file__).parents[1] / page).read_text(encoding="utf-8")
    assert "pd.DataFrame(rows)" not in text  # dotted names and int64: not what smiquery's frames look like
