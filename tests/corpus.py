"""Where the recorded nvidia-smi corpus lives (``../shared/nvsmi-corpus``, read in place, never copied)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "nvsmi-corpus"


def require_corpus() -> Path:
    """The corpus folder; skips the test when it is absent, except under ``CI=true``, where that fails."""
    if not CORPUS.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"the nvsmi corpus is missing at {CORPUS}; CI must run with shared/ beside the checkout")
        pytest.skip(f"the nvsmi corpus is not at {CORPUS} (it lives in shared/ beside the checkout)")
    return CORPUS
