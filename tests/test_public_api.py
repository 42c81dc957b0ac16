"""The public surface: every exported name resolves, and `import smiquery` stays light."""

from __future__ import annotations

import subprocess
import sys

import smiquery


def test_all_names_resolve_and_are_sorted():
    for name in smiquery.__all__:
        assert getattr(smiquery, name) is not None, name

    # isort-style: CONSTANTS, then Classes, then functions
    def key(name: str) -> tuple[int, str]:
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert list(smiquery.__all__) == sorted(smiquery.__all__, key=key)


def test_import_does_not_pull_optional_or_heavy_modules():
    code = (
        "import sys, smiquery\n"
        "heavy = [m for m in ('pandas', 'pyarrow', 'prometheus_client', 'keras', 'tensorflow', 'matplotlib')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_lazy_frames_exports():
    assert smiquery.read_csv.__module__ == "smiquery.frames"
    assert smiquery.to_dataframe.__module__ == "smiquery.frames"
