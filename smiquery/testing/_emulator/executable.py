"""The fake as a real executable: the script :func:`fake_nvidia_smi` writes, and its entry points."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

from smiquery.testing._emulator.core import Output, Settings
from smiquery.testing._emulator.engine import execute
from smiquery.testing._emulator.faults import check_settings


def _run(argv: Sequence[str], settings: Settings) -> int:
    """Run the fake with signal handling like a C program: quiet on SIGINT, SIGTERM and a closed pipe."""
    saved: dict[int, object] = {}
    for name in ("SIGINT", "SIGPIPE", "SIGTERM"):
        signum = getattr(signal, name, None)
        if signum is not None:
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                saved[signum] = signal.signal(signum, signal.SIG_DFL)
    stream: BinaryIO = getattr(sys.stdout, "buffer", None) or sys.stdout  # type: ignore[assignment]
    try:
        return execute(argv, settings, os.environ, Output(stream))
    except BrokenPipeError:
        # the reader went away: end quietly, and keep Python from complaining when it flushes at exit
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        for signum, handler in saved.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, handler)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    """Run the fake ``nvidia-smi`` with nvidia-smi's own arguments (``argv``; None: ``sys.argv[1:]``).

    Settings come from the ``SMIQUERY_FAKE_*`` environment variables (see :data:`ENV_VARS`); without them it
    replays the bundled 8-GPU demo recording and fails in no way. Returns the exit status nvidia-smi would return
    (70 when the fake itself is misconfigured).
    """
    return _run(sys.argv[1:] if argv is None else argv, Settings())


def main_with_settings(settings: Mapping[str, Any], argv: list[str] | None = None) -> int:
    """Entry point of the scripts written by :func:`fake_nvidia_smi` (settings baked in)."""
    return _run(sys.argv[1:] if argv is None else argv, Settings(**settings))


def _abs(path: str | os.PathLike[str] | None) -> str | None:
    return None if path is None else str(pathlib.Path(path).absolute())


def _shebang(python: str) -> str:
    # The kernel splits a #! line at whitespace and truncates it (127 bytes on older kernels): such interpreters
    # are started through /bin/sh, with a first line that sh runs and Python reads as a string literal.
    import shlex

    if python.isascii() and not re.search(r"\s", python) and len(python) < 120:
        return f"#!{python}\n"
    return f"#!/bin/sh\n\"true\" '''\\'\nexec {shlex.quote(python)} \"$0\" \"$@\"\n'''\n"


def fake_nvidia_smi(
    directory: str | os.PathLike[str],
    *,
    recording: str | os.PathLike[str] | None = None,
    fault: str | None = None,
    start_delay: float = 0.0,
    apps: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    name: str = "nvidia-smi",
) -> pathlib.Path:
    """Write an executable fake ``nvidia-smi`` (file ``name``) into ``directory`` (created if missing); its path.

    The script runs this Python interpreter and replays ``recording`` (a ``--format=csv`` file with header; None:
    the bundled 8-GPU demo) in nvidia-smi's exact CSV format, failing as ``fault`` says (comma-separated specs,
    e.g. ``"hang-after:8,ignore-term"``; :data:`FAULT_HELP` has every one). ``start_delay``: seconds before any
    output; ``apps``: the compute-apps CSV (None: the bundled one, ``""``: no processes); ``log``: a file each
    invocation appends one JSON line to (``pid``, ``argv``, ``time``). The ``SMIQUERY_FAKE_*`` environment
    variables (:data:`ENV_VARS`) override these settings when it runs.

    Raises:
        ValueError: ``fault`` names an unknown fault or ``start_delay`` is negative.
    """
    check_settings(fault, start_delay)
    folder = pathlib.Path(directory)
    path = folder / name
    settings = {
        "recording": _abs(recording),
        "fault": fault,
        "start_delay": float(start_delay),
        "apps": "" if apps == "" else _abs(apps),
        "log": _abs(log),
        "state": _abs(f"{path}.state"),
    }
    package_parent = str(pathlib.Path(__file__).resolve().parents[3])
    script = (
        _shebang(sys.executable)
        + '"""Fake nvidia-smi written by smiquery.testing.fake_nvidia_smi(): replays a recorded CSV."""\n'
        + f"import sys\n\nsys.path.append({package_parent!r})  # used where this interpreter has no smiquery\n"
        + "from smiquery.testing._emulator.executable import main_with_settings\n\n"
        + f"sys.exit(main_with_settings({settings!r}))\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(script, encoding="utf-8")
    path.chmod(0o755)
    return path
