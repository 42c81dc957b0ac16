"""Shared fixtures: factories for fake nvidia-smi executables and in-process fakes, and the output corpus."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest

from smiquery.testing import InProcessRunner, fake_nvidia_smi, use_runner
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
    """Returns ``{"runner": InProcessRunner(**settings)}`` for ``query(**...)`` and friends."""

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
def fake_inproc() -> Iterator[MakeInProcess]:
    """A factory of keyword arguments that point ``query()``, ``processes()``... at an in-process fake.

    The fake runs on a thread (:class:`smiquery.testing.InProcessRunner`): same faults and output as the
    executable, no process start per call, and no binary looked up. ``result["runner"].calls`` lists the argv of
    every call. Every engine thread must have ended by the end of the test.
    """
    made: list[InProcessRunner] = []

    def make(**settings: Any) -> dict[str, Any]:
        made.append(InProcessRunner(**settings))
        return {"runner": made[-1]}

    yield make
    for runner in made:
        assert_stopped(runner)


@pytest.fixture
def inproc() -> Iterator[InProcessRunner]:
    """An in-process fake nvidia-smi installed as the default runner for the test (:func:`use_runner`).

    Everything that runs nvidia-smi without a ``runner=`` argument (the CLI's ``main``, the exporter, GpuMonitor,
    the Keras and Lightning callbacks) runs this fake on a thread instead of a child process. Change its settings
    (``inproc.fault = "hang"``, ``inproc.apps = ""``...) before the call they should affect. At the end of the test
    every engine thread must have ended (what reaping every child means in-process).
    """
    with use_runner(InProcessRunner()) as runner:
        yield runner
    assert_stopped(runner)


def assert_stopped(runner: InProcessRunner, timeout: float = 30.0) -> None:
    """Fail unless every engine thread of ``runner`` ends within ``timeout`` s (any left are stopped first)."""
    deadline = time.monotonic() + timeout
    while runner.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = runner.running()
    runner.close()
    assert left == 0, f"{left} in-process nvidia-smi run(s) left running: a line source was not closed"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The recorded nvidia-smi outputs in ``../shared/nvsmi-corpus`` (third-party data, never copied here).

    Skips when the corpus is absent, except under ``CI=true``, where a missing corpus fails the test.
    """
    return require_corpus()
