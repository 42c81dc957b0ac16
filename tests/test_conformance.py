"""Conformance with real nvidia-smi output: every recorded file of the shared corpus, read in place."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from smiquery import recordings
from smiquery.fields import CATALOGUE, Field, Kind, get_field, parse_help_query_gpu
from smiquery.kinds import missing_reason
from smiquery.sample import GpuSample
from smiquery.sources.query_gpu import CsvParser
from tests.corpus import require_corpus as _corpus_dir

ROOT = Path(__file__).resolve().parents[1]
CSV_DIRS = ("csv", "csv-loop", "issue-snippets")


def _corpus_files(*dirs: str, pattern: str = "*.csv") -> list[Path]:
    """The files to parametrise over, found at collection time (empty when the corpus is absent)."""
    base = ROOT.parent / "shared" / "nvsmi-corpus"
    return sorted(p for d in dirs for p in (base / d).glob(pattern))


def _params(files: list[Path]) -> list[object]:
    if not files:
        # Keeps the test visible: it skips (or, under CI=true, fails) instead of vanishing from the run.
        return [pytest.param(None, id="corpus-missing")]
    return [pytest.param(p, id=p.stem) for p in files]


@cache
def _commands() -> dict[str, str]:
    """Corpus-relative file name -> the command that produced it (sources.jsonl)."""
    out: dict[str, str] = {}
    for line in (_corpus_dir() / "sources.jsonl").read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            out[entry["file"]] = entry["command"]
    return out


_QUERY_RE = re.compile(r"--query-gpu=\"?([A-Za-z0-9_.,]+)")
_LIST_RE = re.compile(r"(?<![\w.=-])([A-Za-z][A-Za-z0-9_.]*(?:,[A-Za-z][A-Za-z0-9_.]*)+)")
_SAME_AS_RE = re.compile(r"same as the (\S+) file")


def _command_for(path: Path) -> str:
    commands = _commands()
    key = f"{path.parent.name}/{path.name}"
    command = commands[key]
    same = _SAME_AS_RE.search(command)
    if same:
        # "same as the new-driver file": the sibling whose name carries that tag
        prefix = path.name.split("__", 1)[0]
        siblings = [k for k in commands if k.startswith(f"{path.parent.name}/{prefix}__") and same.group(1) in k]
        assert len(siblings) == 1, (key, siblings)
        command = commands[siblings[0]]
    return command


def _queried_fields(path: Path) -> list[str] | None:
    """The --query-gpu list of a headerless file, or None when the file has a header."""
    command = _command_for(path)
    if "noheader" not in command:
        return None
    found = _QUERY_RE.search(command) or _LIST_RE.search(command)
    assert found, f"no field list in the command of {path.name}: {command}"
    return found.group(1).split(",")


def _check_types(sample: GpuSample, fields: tuple[Field, ...]) -> None:
    raw = sample.raw
    for fld, value in zip(fields, sample.values(), strict=True):
        cell = raw[fld.name]
        token = missing_reason(cell)
        if token is not None:
            assert value is None, (fld.name, cell)
            assert sample.missing[fld.name] == token, (fld.name, cell)
            continue
        assert fld.name not in sample.missing, (fld.name, cell)
        assert value is not None, (fld.name, cell)
        kind = fld.kind
        if kind in (Kind.INT, Kind.HEX, Kind.BITMASK):
            assert type(value) is int, (fld.name, cell, value)
        elif kind is Kind.FLOAT:
            assert type(value) is float, (fld.name, cell, value)
        elif kind.is_bool:
            assert type(value) is bool, (fld.name, cell, value)
        elif kind is Kind.TIMESTAMP:
            assert isinstance(value, datetime), (fld.name, cell, value)
            assert value.tzinfo is not None and value.utcoffset() is not None, (fld.name, cell)
        else:
            assert type(value) is str, (fld.name, cell, value)
    assert sample.gpu_lost == ("gpu_lost" in sample.missing.values())


def _parse(path: Path) -> tuple[CsvParser, list[GpuSample]]:
    parser = CsvParser(_queried_fields(path), strict=True)
    samples = list(parser.parse(path.read_text(encoding="utf-8").splitlines()))
    return parser, samples


@pytest.mark.parametrize("path", _params(_corpus_files(*CSV_DIRS)))
def test_corpus_file_parses_with_typed_values(path: Path | None) -> None:
    _corpus_dir()
    assert path is not None
    parser, samples = _parse(path)
    assert samples, "no rows"
    assert parser.dropped == 0
    assert not parser.notices
    for sample in samples:
        assert sample.fields == tuple(f.name for f in parser.fields)
        _check_types(sample, parser.fields)


@pytest.mark.parametrize("path", _params(_corpus_files("csv")))
def test_corpus_header_names_are_in_the_catalogue(path: Path | None) -> None:
    _corpus_dir()
    assert path is not None
    parser, _ = _parse(path)
    for fld in parser.fields:
        assert get_field(fld.name) is fld


@pytest.mark.parametrize("path", _params(_corpus_files("csv")))
def test_read_csv_gives_the_parsers_values(path: Path | None) -> None:
    _corpus_dir()
    assert path is not None
    parser, samples = _parse(path)
    df = recordings.read_csv(path)
    assert list(df.columns) == [f.attr for f in parser.fields]
    assert len(df) == len(samples)
    missing: dict[str, dict[int, str]] = {}
    for row, sample in enumerate(samples):
        for fld, value in zip(parser.fields, sample.values(), strict=True):
            got: Any = df.at[row, fld.attr]
            if value is None:
                assert pd.isna(got), (fld.name, got)
                missing.setdefault(fld.attr, {})[row] = sample.missing[fld.name]
            elif isinstance(value, datetime):
                # a recording's wall-clock time stays naive in frames (no zone is claimed)
                assert got == pd.Timestamp(value.replace(tzinfo=None)), fld.name
            else:
                assert got == value, (fld.name, got, value)
    assert recordings.missing_reasons(df) == missing


def test_headerless_files_use_their_commands_field_list() -> None:
    corpus = _corpus_dir()
    expected = {
        "gpu-utils-83__rtx-2080__440.64__noheader-nounits": 19,
        "i3pystatus-776__new-driver__noheader-nounits": 7,
        "i3pystatus-776__old-driver__noheader-nounits": 7,
        "megaminer-235__gtx-770__windows__csv-noheader": 12,
        "megaminer-376__7x-gtx-1080-ti-1x-gtx-1080__csv-noheader": 12,
        "nvsmi-2__gtx-1050-ti__fan.speed__noheader-nounits": 1,
        "nvsmi-2__laptop__fan.speed__noheader-nounits": 1,
    }
    found = {}
    for path in _corpus_files("issue-snippets"):
        fields = _queried_fields(path)
        if fields is not None:
            found[path.stem] = len(fields)
    assert found == expected
    assert (corpus / "issue-snippets").is_dir()


@pytest.mark.parametrize("path", _params(_corpus_files("help-query-gpu", pattern="*.txt")))
def test_help_query_gpu_is_covered_by_the_catalogue(path: Path | None) -> None:
    _corpus_dir()
    assert path is not None
    entries = parse_help_query_gpu(path.read_text(encoding="utf-8"))
    assert len(entries) > 100
    names = [entry.name for entry in entries]
    assert "timestamp" in names and "memory.used" in names
    for entry in entries:
        for name in (entry.name, *entry.aliases):
            fld = get_field(name)
            assert fld in CATALOGUE, name
        assert entry.description, entry.name
