"""smiquery.compat.GPUtil against the real GPUtil 1.4.0, side by side on the same fake nvidia-smi output."""

from __future__ import annotations

import inspect
import math
import random
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

import tests.corpus
from smiquery import errors
from smiquery.compat import GPUtil as shim
from smiquery.testing import fake_nvidia_smi

FIXTURES = Path(__file__).parent / "fixtures"

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # GPUtil imports distutils
    import GPUtil as real  # the real package, installed in the dev environment


# Four GPUs built to hit GPUtil's quirks: an unknown load (NaN), an unknown free memory, equal loads (sort
# stability), a 0 MiB total, a deprecated display_mode token and a [N/A] serial.
_DEPRECATED = "[Requested functionality has been deprecated]"
_QUIRK_COLUMNS = (
    "index, uuid, utilization.gpu [%], memory.total [MiB], memory.used [MiB], memory.free [MiB], driver_version, "
    "name, serial, display_active, display_mode, temperature.gpu"
)
_QUIRK_ROWS = [
    ("0", "[N/A]", "81559 MiB", "1000 MiB", "80559 MiB", "1650823001234", "Disabled", _DEPRECATED, "41"),
    ("1", "10 %", "81559 MiB", "60000 MiB", "21559 MiB", "1650823001235", "Disabled", _DEPRECATED, "55"),
    ("2", "10 %", "81559 MiB", "500 MiB", "[N/A]", "1650823001236", "Disabled", _DEPRECATED, "[N/A]"),
    ("3", "0 %", "81559 MiB", "[Insufficient Permissions]", "81000 MiB", "[N/A]", "Enabled", "Enabled", "30"),
]
QUIRKS_CSV = "".join(
    [_QUIRK_COLUMNS + "\n"]
    + [
        f"{i}, GPU-{i * 8}-{i * 4}-{i * 4}-{i * 4}-{i * 12}, {load}, {total}, {used}, {free}, 590.48.01, "
        f"NVIDIA H100 80GB HBM3, {serial}, {active}, {mode}, {temp}\n"
        for i, load, total, used, free, serial, active, mode, temp in _QUIRK_ROWS
    ]
)


def _corpus_recordings() -> list[Path]:
    """Corpus captures the fake can replay and that carry both index and uuid (read in place)."""
    folder = tests.corpus.CORPUS / "csv"
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.csv")):
        first = path.read_text(encoding="utf-8", errors="replace").splitlines()[:1]
        cells = [c.strip().split(" [")[0] for c in first[0].split(",")] if first else []
        if "index" in cells and "uuid" in cells:
            out.append(path)
    return out


RECORDINGS: list[Path | None] = [None, *sorted(FIXTURES.glob("*.csv")), *_corpus_recordings()]


def _id(rec: Path | None) -> str:
    return "bundled-demo" if rec is None else rec.stem[:60]


def _on_path(monkeypatch: pytest.MonkeyPatch, fake: Path) -> None:
    """GPUtil runs plain `nvidia-smi` from PATH: put the fake first for both implementations."""
    import os

    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("SMIQUERY_NVIDIA_SMI", raising=False)
    for var in ("SMIQUERY_FAKE_RECORDING", "SMIQUERY_FAKE_FAULT", "SMIQUERY_FAKE_SWEEP"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def use_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Returns a function that installs a fake nvidia-smi (recording, fault) first on PATH."""

    def install(recording: Path | str | None = None, fault: str | None = None) -> Path:
        fake = fake_nvidia_smi(tmp_path / f"bin-{time.monotonic_ns()}", recording=recording, fault=fault)
        _on_path(monkeypatch, fake)
        return fake

    return install


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _assert_same_gpus(mine: list[Any], theirs: list[Any]) -> None:
    assert len(mine) == len(theirs)
    for m, t in zip(mine, theirs):
        assert vars(m).keys() == vars(t).keys()
        for key in vars(t):
            assert _same(getattr(m, key), getattr(t, key)), (key, getattr(m, key), getattr(t, key))


@pytest.fixture
def quirks(tmp_path: Path) -> Path:
    path = tmp_path / "quirks.csv"
    path.write_text(QUIRKS_CSV, encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ surface


@pytest.mark.parametrize(
    "name", ["GPU", "getGPUs", "getAvailable", "getAvailability", "getFirstAvailable", "showUtilization"]
)
def test_same_signature(name: str) -> None:
    assert (
        inspect.signature(getattr(shim, name)).parameters.keys()
        == inspect.signature(getattr(real, name)).parameters.keys()
    )
    mine = {k: p.default for k, p in inspect.signature(getattr(shim, name)).parameters.items()}
    theirs = {k: p.default for k, p in inspect.signature(getattr(real, name)).parameters.items()}
    assert mine == theirs


def test_version_matches_the_reproduced_release() -> None:
    assert shim.__version__ == real.__version__ == "1.4.0"


# ------------------------------------------------------------------------------------------------ getGPUs


@pytest.mark.parametrize("recording", RECORDINGS, ids=_id)
def test_getgpus_same_as_gputil(use_fake: Any, recording: Path | None) -> None:
    use_fake(recording)
    theirs = real.getGPUs()
    assert theirs, "the recording must give GPUtil at least one GPU, or the comparison proves nothing"
    _assert_same_gpus(shim.getGPUs(), theirs)


def test_load_is_a_fraction_and_tokens_are_nan_or_kept_as_text(use_fake: Any, quirks: Path) -> None:
    use_fake(quirks)
    gpus = shim.getGPUs()
    _assert_same_gpus(gpus, real.getGPUs())
    assert math.isnan(gpus[0].load)
    assert gpus[1].load == pytest.approx(0.10)
    assert gpus[1].memoryUtil == pytest.approx(60000 / 81559)
    assert math.isnan(gpus[2].memoryFree) and math.isnan(gpus[2].temperature)
    assert math.isnan(gpus[3].memoryUtil)
    assert gpus[3].serial == "[N/A]"
    assert gpus[0].display_mode == "[Requested functionality has been deprecated]"


# ------------------------------------------------------------------------------------------- getAvailable

ORDERS = ["first", "last", "load", "memory", "unknown-order"]
GRID = [
    {},
    {"maxLoad": 1.0, "maxMemory": 1.0},
    {"maxLoad": 1.0, "maxMemory": 1.0, "includeNan": True},
    {"maxLoad": 0.05, "includeNan": True},
    {"memoryFree": 30000, "maxLoad": 1.0, "maxMemory": 1.0, "includeNan": True},
    {"excludeID": [1], "maxLoad": 1.0, "maxMemory": 1.0, "includeNan": True},
    {
        "excludeUUID": ["GPU-" + "-".join(["3" * 8, "3" * 4, "3" * 4, "3" * 4, "3" * 12])],
        "maxLoad": 1.0,
        "maxMemory": 1.0,
    },
]


@pytest.mark.parametrize("kwargs", GRID, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_getavailable_same_as_gputil(use_fake: Any, quirks: Path, kwargs: dict[str, Any]) -> None:
    use_fake(quirks)
    for order in ORDERS:
        for limit in (1, 3, 100):
            mine = shim.getAvailable(order=order, limit=limit, **kwargs)
            assert mine == real.getAvailable(order=order, limit=limit, **kwargs), (order, limit)


def test_nan_sorts_last_and_free_memory_nan_is_never_available(use_fake: Any, quirks: Path) -> None:
    use_fake(quirks)
    # GPU 2 has no free-memory reading: `nan >= 0` is False, so even includeNan never offers it
    ids = shim.getAvailable(order="load", limit=10, maxLoad=1.0, maxMemory=1.0, includeNan=True)
    assert ids == real.getAvailable(order="load", limit=10, maxLoad=1.0, maxMemory=1.0, includeNan=True)
    assert 2 not in ids
    assert ids[-1] == 0  # unknown load sorts after every known one
    # "memory" orders by memory utilisation, not by free memory
    assert shim.getAvailable(order="memory", limit=10, maxLoad=1.0, maxMemory=1.0, includeNan=True)[0] == 0


def test_random_order_matches_gputil_under_the_same_seed(use_fake: Any, quirks: Path) -> None:
    use_fake(quirks)
    kwargs: dict[str, Any] = {"order": "random", "limit": 10, "maxLoad": 1.0, "maxMemory": 1.0, "includeNan": True}
    for seed in range(5):
        random.seed(seed)
        theirs = real.getAvailable(**kwargs)
        random.seed(seed)
        assert shim.getAvailable(**kwargs) == theirs


@pytest.mark.parametrize("recording", RECORDINGS, ids=_id)
def test_getavailable_on_every_recording(use_fake: Any, recording: Path | None) -> None:
    use_fake(recording)
    for order in ("last", "load"):
        for kwargs in (GRID[2], GRID[3]):
            assert shim.getAvailable(order=order, limit=8, **kwargs) == real.getAvailable(
                order=order, limit=8, **kwargs
            )


# -------------------------------------------------------------------------------------- getFirstAvailable


def test_getfirstavailable_returns_a_list_like_gputil(
    use_fake: Any, quirks: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    use_fake(quirks)
    theirs = real.getFirstAvailable(verbose=True, includeNan=True)
    their_out = capsys.readouterr().out
    assert shim.getFirstAvailable(verbose=True, includeNan=True) == theirs == [0]
    assert capsys.readouterr().out == their_out


def test_getfirstavailable_gives_up_with_gputils_error(
    use_fake: Any, quirks: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    use_fake(quirks)
    naps: list[float] = []
    nap = SimpleNamespace(sleep=naps.append)
    monkeypatch.setattr(shim, "time", nap)
    monkeypatch.setattr(sys.modules["GPUtil.GPUtil"], "time", nap)
    kwargs: dict[str, Any] = {"maxLoad": 0.0, "attempts": 3, "interval": 7, "verbose": True}
    with pytest.raises(RuntimeError) as theirs:
        real.getFirstAvailable(**kwargs)
    their_out = capsys.readouterr().out
    with pytest.raises(RuntimeError) as mine:
        shim.getFirstAvailable(**kwargs)
    assert str(mine.value) == str(theirs.value)
    assert capsys.readouterr().out == their_out
    assert naps == [7, 7, 7, 7]  # two naps each


# ---------------------------------------------------------------------------------------- showUtilization


@pytest.mark.parametrize("recording", [None, *sorted(FIXTURES.glob("*.csv"))], ids=_id)
@pytest.mark.parametrize("all_", [False, True])
@pytest.mark.parametrize("old", [False, True])
def test_showutilization_prints_the_same(
    use_fake: Any, recording: Path | None, all_: bool, old: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    use_fake(recording)
    real.showUtilization(all=all_, useOldCode=old)
    theirs = capsys.readouterr().out
    shim.showUtilization(all=all_, useOldCode=old)
    assert capsys.readouterr().out == theirs
    assert theirs.count("\n") >= 3


def test_showutilization_ignores_attrlist_like_gputil(use_fake: Any, capsys: pytest.CaptureFixture[str]) -> None:
    use_fake()
    cols = [[{"attr": "name", "name": "Only the name"}]]
    real.showUtilization(attrList=cols)
    theirs = capsys.readouterr().out
    shim.showUtilization(attrList=cols)
    assert capsys.readouterr().out == theirs
    assert "Only the name" not in theirs


# ------------------------------------------------------------------------- where the shim differs on purpose


def test_missing_nvidia_smi_raises_instead_of_an_empty_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere on PATH
    monkeypatch.delenv("SMIQUERY_NVIDIA_SMI", raising=False)
    monkeypatch.setattr("smiquery.runner.usual_places", lambda: [str(tmp_path / "nope")])
    assert real.getGPUs() == []
    with pytest.raises(errors.NvidiaSmiNotFoundError):
        shim.getGPUs()


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ("driver-not-loaded", errors.DriverNotLoadedError),
        ("version-mismatch", errors.DriverVersionMismatchError),
        ("no-devices", errors.NoDevicesFoundError),
        ("nvml-not-found", errors.NvmlNotFoundError),
    ],
)
def test_driver_errors_are_named_instead_of_valueerror(use_fake: Any, fault: str, error: type[Exception]) -> None:
    use_fake(fault=fault)
    with pytest.raises(ValueError, match="invalid literal for int"):
        real.getGPUs()
    with pytest.raises(error) as mine:
        shim.getGPUs()
    assert "nvidia-smi" in str(mine.value) or "NVML" in str(mine.value) or "devices" in str(mine.value)


def test_hung_driver_times_out_where_gputil_waits_forever(use_fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake(fault="hang")
    monkeypatch.setattr(shim, "TIMEOUT", 1.0)
    # real.getGPUs() is not called: it would never return
    with pytest.raises(errors.NvidiaSmiTimeoutError, match="did not answer"):
        shim.getGPUs()


def test_zero_total_memory_gives_nan_where_gputil_divides_by_zero() -> None:
    args = (0, "GPU-x", 0.5, 0.0, 0.0, 0.0, "590.48.01", "GPU", "[N/A]", "Disabled", "Disabled", 40.0)
    with pytest.raises(ZeroDivisionError):
        real.GPU(*args)
    assert math.isnan(shim.GPU(*args).memoryUtil)


def test_module_is_importable_as_documented() -> None:
    import smiquery.compat

    assert isinstance(smiquery.compat.GPUtil, ModuleType)
    assert smiquery.compat.GPUtil is shim


def test_garbage_output_is_a_parse_error(use_fake: Any) -> None:
    use_fake(fault="garbage")
    with pytest.raises(errors.ParseError, match="expected 12 cells"):
        shim.getGPUs()


def test_inforom_warning_keeps_the_rows_where_gputil_crashes(use_fake: Any) -> None:
    use_fake()
    clean = real.getGPUs()
    use_fake(fault="inforom")
    with pytest.raises(ValueError, match="invalid literal for int"):
        real.getGPUs()  # it reads the warning line as a GPU
    _assert_same_gpus(shim.getGPUs(), clean)
