"""The test suite's own set-up: what `make test` relies on to finish in time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.mark.xdist_group("grouping-check")
def test_xdist_groups_hold(request: pytest.FixtureRequest) -> None:
    """`--dist loadgroup` keeps a group's tests on one worker, so that the image builds of tests/test_docker.py and
    the Prometheus servers run once per group. pytest-xdist does it by suffixing the node id with "@group"; when a
    pytest release stores node ids elsewhere, the suffix is lost, grouping silently stops and every worker builds
    the images again (pytest 9.2 with pytest-xdist 3.8: the pin in pyproject.toml)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under pytest-xdist with --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@grouping-check"), request.node.nodeid


def test_no_build_output_is_tracked():
    """Wheels, sdists and eggs are built, never committed (a stray wheel once sat at the root, used by nothing)."""
    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    built = [p for p in tracked.splitlines() if p.endswith((".whl", ".tar.gz", ".egg", ".zip")) or ".egg-info/" in p]
    assert built == []
