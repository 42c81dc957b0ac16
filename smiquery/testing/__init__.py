"""A fake ``nvidia-smi`` for tests and demos: a real executable that replays a recorded CSV and fails on demand.

:func:`fake_nvidia_smi` writes the executable (entry point :func:`main`, also ``python -m smiquery.testing``);
:class:`InProcessRunner` runs the same engine on a thread, and :func:`use_runner` makes it the runner of everything
that runs nvidia-smi for the length of a ``with`` block. The emulator is the private ``_emulator`` package.
"""

from smiquery.testing._emulator.core import ENV_VARS, FAULT_HELP, FAULTS
from smiquery.testing._emulator.engine import InProcessLines, InProcessRunner, fake_nvidia_smi, main, use_runner

__all__ = [
    "ENV_VARS",
    "FAULTS",
    "FAULT_HELP",
    "InProcessLines",
    "InProcessRunner",
    "fake_nvidia_smi",
    "main",
    "use_runner",
]
