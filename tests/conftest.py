"""Shared fixtures: factories for fake nvidia-smi executables and in-process fakes, and the output corpus."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Protocol

import pytest

from smiquery.testing import InProcessRunner, fake_nvidia_smi
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


class MakeInProcess(Protocol):
    """Returns ``{"nvidia_smi": path, "runner": InProcessRunner(**settings)}`` for ``query(**...)`` and friends."""

    def __call__(
        self,
        *,
        fault: str | None = None,
        recording: str | os.PathLike[str] | None = None,
        start_delay: float = 0.0,
        apps: str | os.PathLike[str] | None = None,
        log: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]: ...


@pytest.fixture
def fake_inproc(tmp_path: Path) -> MakeInProcess:
    """A factory of keyword arguments that point ``query()``, ``processes()``... at an in-process fake.

    The fake runs on a thread (:class:`smiquery.testing.InProcessRunner`): same faults and output as the
    executable, no process start per call. ``nvidia_smi`` is a written fake executable only because the binary's
    path is resolved before anything runs; the runner never starts it. ``result["runner"].calls`` lists the argv
    of every call.
    """
    smi = fake_nvidia_smi(tmp_path / "fake-inproc-bin")

    def make(**settings: Any) -> dict[str, Any]:
        return {"nvidia_smi": smi, "runner": InProcessRunner(**settings)}

    return make


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The recorded nvidia-smi outputs in ``../shared/nvsmi-corpus`` (third-party data, never copied here).

    Skips when the corpus is absent, except under ``CI=true``, where a missing corpus fails the test.
    """
    return require_corpus()
