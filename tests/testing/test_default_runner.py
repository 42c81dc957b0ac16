"""The one seam between smiquery and the process that runs nvidia-smi: `default_runner()` and `use_runner()`.

Outside a `use_runner` block every consumer runs the real binary; inside one, every consumer that is given no
runner (in any thread) runs the installed one, and an in-process runner needs no binary on disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from smiquery import errors, query
from smiquery.runner import SubprocessRunner, default_runner, find_nvidia_smi
from smiquery.streams.sync import Stream
from smiquery.testing import ENV_VARS, InProcessRunner, use_runner
from tests.conftest import assert_stopped


def test_the_default_is_a_real_subprocess_runner_and_use_runner_puts_it_back():
    assert isinstance(default_runner(), SubprocessRunner)
    outer, inner = InProcessRunner(), InProcessRunner()
    with use_runner(outer):
        assert default_runner() is outer
        with use_runner(inner):
            assert default_runner() is inner
        assert default_runner() is outer
        with pytest.raises(RuntimeError), use_runner(inner):
            raise RuntimeError("a failing test")
        assert default_runner() is outer
    assert isinstance(default_runner(), SubprocessRunner)


def test_an_in_process_runner_needs_no_binary_and_a_real_one_still_looks(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    monkeypatch.setenv("SMIQUERY_NVIDIA_SMI", str(tmp_path / "gone"))
    fake = InProcessRunner()
    assert find_nvidia_smi(runner=fake) == "nvidia-smi"
    assert find_nvidia_smi(tmp_path / "any" / "nvidia-smi", runner=fake) == str(tmp_path / "any" / "nvidia-smi")
    assert [s.index for s in query(["index"], runner=fake)] == list(range(8))
    assert fake.calls[0][0] == "nvidia-smi"
    with use_runner(fake):
        assert find_nvidia_smi() == "nvidia-smi"
        # a caller that brings its own real runner keeps the real lookup
        with pytest.raises(errors.NvidiaSmiNotFoundError, match="SMIQUERY_NVIDIA_SMI"):
            find_nvidia_smi(runner=SubprocessRunner())
    with pytest.raises(errors.NvidiaSmiNotFoundError, match="SMIQUERY_NVIDIA_SMI"):
        find_nvidia_smi()  # the block is over: the real lookup again
    assert_stopped(fake)


def test_every_thread_sees_the_installed_runner(inproc):
    inproc.fault = "driver-not-loaded"
    failures: list[BaseException] = []

    def work() -> None:
        try:
            query(["index"])
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(30)
    assert len(failures) == 1 and isinstance(failures[0], errors.DriverNotLoadedError)
    inproc.fault = None
    with Stream(["index", "temperature.gpu"], interval=0.05, max_samples=16) as stream:
        sweeps = list(stream.sweeps())
    assert [len(s) for s in sweeps] == [8, 8]
    assert len(inproc.calls) == 2 and "-lms" in inproc.calls[1]


def test_no_environment_variable_installs_a_fake():
    # a fresh process with every setting the fake reads: the default runner is still the real one
    env = {**os.environ, **dict.fromkeys(ENV_VARS, "1"), "SMIQUERY_FAKE_FAULT": "hang", "SMIQUERY_RUNNER": "fake"}
    probe = "from smiquery.runner import default_runner; print(type(default_runner()).__name__)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "SubprocessRunner"
