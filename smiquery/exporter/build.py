"""The source revision the exporter was built from (``revision`` in ``smiquery_build_info``).

The revision is the first of: ``smiquery/_revision.py`` (``REVISION = "<commit>"``, written by a build), the commit
pip recorded installing from a git URL, the commit checked out (read from ``.git``, no git run); else ``unknown``.
"""

from __future__ import annotations

import importlib
import json
import re
from functools import lru_cache
from pathlib import Path

__all__ = ["revision"]

_SHA = re.compile(r"[0-9a-f]{7,64}")
_PACKAGE = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def revision() -> str:
    """The source revision smiquery was built from (a commit id), or ``unknown``."""
    return _baked() or _pip_recorded() or _git_checkout() or "unknown"


def _baked() -> str | None:
    try:
        _revision = importlib.import_module("smiquery._revision")  # written by a build, absent in a checkout
    except ImportError:
        return None
    value = str(getattr(_revision, "REVISION", "")).strip()
    return value or None


def _pip_recorded() -> str | None:
    for info in sorted(_PACKAGE.parent.glob("smiquery-*.dist-info/direct_url.json")):
        try:
            commit = json.loads(info.read_text(encoding="utf-8")).get("vcs_info", {}).get("commit_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(commit, str) and _SHA.fullmatch(commit):
            return commit
    return None


def _git_checkout() -> str | None:
    git = _PACKAGE.parent / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = Path(git.read_text(encoding="utf-8").split(":", 1)[1].strip())
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref: "):
            return head if _SHA.fullmatch(head) else None
        ref = head[5:]
        common = git / "commondir"
        roots = [git, (git / common.read_text(encoding="utf-8").strip()).resolve()] if common.is_file() else [git]
        for root in roots:
            loose = root / ref
            if loose.is_file():
                value = loose.read_text(encoding="utf-8").strip()
                return value if _SHA.fullmatch(value) else None
        for root in roots:
            packed = root / "packed-refs"
            if packed.is_file():
                for line in packed.read_text(encoding="utf-8").splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1] == ref and _SHA.fullmatch(parts[0]):
                        return parts[0]
    except (OSError, IndexError):
        return None
    return None
