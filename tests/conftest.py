"""Shared fixtures: a factory for fake nvidia-smi executables, and the nvidia-smi output corpus."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Protocol

import pytest

from smiquery.testing import fake_nvidia_smi
from tests.corpus import require_corpus

FIXTURES = Path(__file__).parent / "fixtures"


class MakeFake(Protocol):
    """Writes a fake nvidia-smi (see :func:`smiquery.testing.fake_nvidia_smi`) and returns its path."""

    def __call__(
        self,
        fault: str | None = None,
        recording: str | os.PathLike[str] | None = None,
        start_delay: float = 0.0,
        apps: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
    ) -> Path: ...


@pytest.fixture
def fake_smi(tmp_path: Path) -> MakeFake:
    """A factory for fake ``nvidia-smi`` executables, each in its own folder under ``tmp_path``."""
    counter = itertools.count()

    def make(
        fault: str | None = None,
        recording: str | os.PathLike[str] | None = None,
        start_delay: float = 0.0,
        apps: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
    ) -> Path:
        return fake_nvidia_smi(
            tmp_path / f"fake-bin-{next(counter)}",
            recording=recording,
            fault=fault,
            start_delay=start_delay,
            apps=apps,
            log=log,
        )

    return make


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The recorded nvidia-smi outputs in ``../shared/nvsmi-corpus`` (third-party data, never copied here).

    Skips when the corpus is absent, except under ``CI=true``, where a missing corpus fails the test.
    """
    return require_corpus()
