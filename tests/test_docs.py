"""The docs site: ``mkdocs build --strict`` passes, the API reference names every public name and module, the
screens and pictures come from scripts/make_docs_screens.py, and the README stays a newcomer's page."""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import smiquery

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
SCRIPT = ROOT / "scripts" / "make_docs_screens.py"


def _directives() -> set[str]:
    """Every ``::: name`` of the API reference, and every ``[name][path]`` cross-reference's path."""
    found: set[str] = set()
    for page in (DOCS / "api").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        found |= set(re.findall(r"^::: ([\w.]+)", text, flags=re.M))
        found |= set(re.findall(r"\]\[(smiquery[\w.]+)\]", text))
    return found


def _public_modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(smiquery.__path__, prefix="smiquery.")
        if not any(part.startswith("_") for part in m.name.split(".")[1:])
    ]


def test_the_api_reference_names_every_public_name_and_module():
    directives = _directives()
    for name in smiquery.__all__:
        if name == "__version__":
            continue
        obj = getattr(smiquery, name)
        assert f"{obj.__module__}.{obj.__qualname__}" in directives, f"docs/api never documents smiquery.{name}"
    missing = [m for m in _public_modules() if m not in directives]
    assert not missing, f"public modules without a `::: module` in docs/api/: {missing}"
    assert "smiquery" in directives


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.rglob("*.md"):
        rel = page.relative_to(DOCS).as_posix()
        assert f": {rel}" in nav, f"{rel} is not in mkdocs.yml's nav"


def test_the_docs_show_only_generated_screens_and_every_screen_is_shown():
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True,
                            timeout=60).stdout  # fmt: skip
    generated = {f for line in listed.splitlines() for f in line.split()[1:]}
    snippets = {p.name for p in (DOCS / "snippets").iterdir()}
    assert snippets == {f for f in generated if f.endswith(".txt")}, "docs/snippets holds a file no screen writes"
    pages = "".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    included = set(re.findall(r'--8<-- "([\w.-]+)"', pages)) | set(re.findall(r"\]\(([\w.-]+\.png)\)", pages))
    assert generated <= included, f"screens no page shows: {sorted(generated - included)}"
    images = {m for m in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", pages)}
    assert images <= generated, f"pictures not made by scripts/make_docs_screens.py: {sorted(images - generated)}"


@pytest.mark.slow
def test_the_screens_are_what_the_script_writes(tmp_path):
    # the report of the bundled recording and the field catalogue do not change between runs: a hand-edited or
    # stale screen differs from a fresh capture
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    subprocess.run([sys.executable, str(SCRIPT), "--only", "report,fields", "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    for name in ("report.txt", "fields.txt"):
        fresh = (tmp_path / name).read_text(encoding="utf-8")
        assert (DOCS / "snippets" / name).read_text(encoding="utf-8") == fresh, (
            f"docs/snippets/{name} is not what the script writes now: run scripts/make_docs_screens.py"
        )


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    # a broken link or anchor, a page missing from the nav, an unreadable docstring or a missing snippet fails
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[docs]' (make test installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="smiquery.sources.query_gpu.query"' in (tmp_path / "site" / "api" / "sources" / "index.html").read_text(
        encoding="utf-8"
    )
    assert "get_gpu_status" in api


def test_the_readme_is_a_newcomers_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200, "README.md is over 200 lines: move the detail into docs/"
    # the live view it shows is the one the script captured for the docs
    assert (DOCS / "snippets" / "stream.txt").read_text(encoding="utf-8").rstrip() in readme
