"""The fake's settings: what a written script bakes in, what an in-process runner holds, and their overrides."""

from __future__ import annotations

import dataclasses
import pathlib
import threading
from collections.abc import Mapping

#: Environment variables read by the fake at run time, and what they do.
ENV_VARS: Mapping[str, str] = {
    "SMIQUERY_FAKE_RECORDING": "recording CSV to replay (overrides the baked-in one)",
    "SMIQUERY_FAKE_FAULT": "fault specs, comma separated (empty: no fault)",
    "SMIQUERY_FAKE_START_DELAY": "seconds to sleep before any output",
    "SMIQUERY_FAKE_APPS": "compute-apps CSV (empty: no processes)",
    "SMIQUERY_FAKE_LOG": "file to append one JSON line per invocation to (empty: no log)",
    "SMIQUERY_FAKE_SWEEP": "which sweep a one-shot query prints (modulo the sweep count); where a loop starts",
    "SMIQUERY_FAKE_KEEP_TIME": "1: print the recorded timestamps instead of the current time",
    "SMIQUERY_FAKE_STATE": "file holding how many `reenumerate` reloads have struck (default: the executable's "
    "path plus `.state`); delete it to start over",
    "SMIQUERY_FAKE_XML": "nvidia-smi -q -x capture that -q -x and -L answer from (empty: made from the recording)",
}


class FakeUsageError(Exception):
    """The fake was set up wrongly (not a simulated nvidia-smi failure)."""


def is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


class MemoryState:
    """How many ``reenumerate`` reloads have struck, kept by an :class:`InProcessRunner` instead of a file."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Settings:
    recording: str | None = None
    fault: str | None = None
    start_delay: float = 0.0
    apps: str | None = None
    log: str | None = None
    sweep: int = 0
    keep_time: bool = False
    state: str | MemoryState | None = None
    xml: str | None = None

    def with_env(self, env: Mapping[str, str]) -> Settings:
        """Apply the SMIQUERY_FAKE_* overrides (an empty RECORDING or START_DELAY is no override)."""
        var = {name.removeprefix("SMIQUERY_FAKE_").lower(): env[name] for name in ENV_VARS if name in env}
        changes: dict[str, object] = {k: v or None for k, v in var.items() if k in ("fault", "log", "state", "xml")}
        if var.get("recording"):
            changes["recording"] = var["recording"]
        if "apps" in var:
            changes["apps"] = var["apps"]
        if "keep_time" in var:
            changes["keep_time"] = var["keep_time"] == "1"
        try:
            if var.get("start_delay"):
                changes["start_delay"] = float(var["start_delay"])
        except ValueError:
            raise FakeUsageError("SMIQUERY_FAKE_START_DELAY must be a number of seconds") from None
        try:
            if "sweep" in var:
                changes["sweep"] = int(var["sweep"] or "0")
        except ValueError:
            raise FakeUsageError("SMIQUERY_FAKE_SWEEP must be an integer") from None
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def read_bundled(name: str) -> str:
    try:  # the package's own folder: importlib.resources would cost more than the read
        return pathlib.Path(__file__).parents[2].joinpath("data", name).read_text(encoding="utf-8")
    except OSError:  # installed where data are no plain files (a zip)
        from importlib import resources

        return (resources.files("smiquery") / "data" / name).read_text(encoding="utf-8")
