"""``smiquery report --html``: one self-contained page, opened in a real headless Chromium (Debian's ``chromium``).

The browser loads the page from a file, with nothing else on disk or on the network to help it; its console
must stay silent (the page's content security policy makes any outside request a console message) and its
screenshot must show the plot's lines. Under CI=true a missing chromium fails the test (``make tools`` installs it).
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from smiquery.analysis import report, report_html
from tests.analysis.test_report import DEMO, _app

try:
    import matplotlib.image
    import numpy as np
except ImportError:  # pragma: no cover - the plot extra is installed by `make test`
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("matplotlib is not installed: pip install 'smiquery[plot]'", allow_module_level=True)

# the first two GPUs' line colours in the plot (smiquery.analysis.plot's palette), as 0-255 RGB
GPU_BLUE = (0x1F, 0x77, 0xB4)
GPU_ORANGE = (0xFF, 0x7F, 0x0E)


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing: run scripts/install-chromium (make tools)")
        pytest.skip("chromium is not installed (scripts/install-chromium, Debian's 'chromium' package)")
    return found


def open_in_chromium(page: Path, tmp_path: Path) -> tuple[list[str], np.ndarray]:
    """Load ``page`` in headless Chromium: (its console messages, a 1280x1800 screenshot as RGB 0-255)."""
    shot = tmp_path / f"{page.stem}-screenshot.png"
    proc = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",  # tests run as root in containers
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--hide-scrollbars",
            "--virtual-time-budget=5000",  # the page is laid out and its images decoded before the screenshot
            "--window-size=1280,1800",
            f"--screenshot={shot}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert shot.is_file(), proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    image = matplotlib.image.imread(str(shot))[..., :3]
    return console, np.rint(image * 255).astype(np.int16)


def colour_count(image: np.ndarray, rgb: tuple[int, int, int], tol: int = 40) -> int:
    return int((np.abs(image - np.array(rgb)).max(axis=2) <= tol).sum())


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    page = tmp_path_factory.mktemp("html") / "demo.html"
    result = CliRunner().invoke(_app(), ["report", str(DEMO), "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert "GPU 5 was over 85 C" in result.stdout  # the text report still goes to stdout
    return page


def test_the_page_holds_the_findings_tables_and_the_plot_and_needs_nothing_else(demo_page):
    text = demo_page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    for verdict in ("GPU 5 was over 85 C", "All 8 GPUs stalled together from 09:35:00"):
        assert verdict in text
    assert "<th>mean util</th>" in text and "Statistics per GPU" in text
    # every source the page names is inline: one PNG data URI, no other src, no href, no script
    sources = re.findall(r'(?:src|href)="([^"]*)"', text)
    assert len(sources) == 1 and sources[0].startswith("data:image/png;base64,")
    png = base64.b64decode(sources[0].split(",", 1)[1])
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
    assert "<script" not in text and "@import" not in text and "url(" not in text
    assert "Content-Security-Policy" in text and "default-src 'none'" in text


def test_text_from_the_recording_is_escaped(tmp_path):
    page = report_html(report(DEMO, name="<b>run</b> & co"), None, "no plot here")
    assert "&lt;b&gt;run&lt;/b&gt; &amp; co" in page and "<b>run</b>" not in page
    assert "No plot here." in page


def test_chromium_loads_the_page_without_a_console_message_and_shows_the_plot(demo_page, tmp_path):
    console, shot = open_in_chromium(demo_page, tmp_path)
    assert console == []
    # the plot's lines are on screen: GPU 0's blue and GPU 1's orange, over thousands of pixels
    assert colour_count(shot, GPU_BLUE) > 1000
    assert colour_count(shot, GPU_ORANGE) > 1000
    # and not blank: the plot area (below the findings) is far from all white
    rows = np.flatnonzero((np.abs(shot - np.array(GPU_BLUE)).max(axis=2) <= 40).any(axis=1))
    plot_area = shot[rows.min() : rows.max() + 1]
    assert (plot_area.min(axis=2) < 200).mean() > 0.05


def test_the_checks_fail_on_a_page_without_the_plot_or_one_that_loads_from_outside(tmp_path):
    """The same checks see a page with no plot, and an outside image the page's policy blocks."""
    bare = tmp_path / "bare.html"
    bare.write_text(report_html(report(DEMO), None, "no plot"), encoding="utf-8")
    console, shot = open_in_chromium(bare, tmp_path)
    assert console == []
    assert colour_count(shot, GPU_BLUE) < 100
    leaky = tmp_path / "leaky.html"
    page = report_html(report(DEMO), None, "no plot")
    text = page.replace("<h2>Plot</h2>", '<h2>Plot</h2><img src="http://127.0.0.1:9/x.png">')
    leaky.write_text(text, encoding="utf-8")
    console, _ = open_in_chromium(leaky, tmp_path)
    assert len(console) == 1 and "Content Security Policy" in console[0]


def test_without_matplotlib_the_page_says_how_to_get_the_plot(tmp_path, monkeypatch):
    import smiquery.analysis

    def no_matplotlib(*args: object, **kwargs: object) -> bytes:
        raise ImportError("plotting needs matplotlib: pip install 'smiquery[plot]'")

    monkeypatch.setattr(smiquery.analysis, "plot_png", no_matplotlib)
    page = tmp_path / "noplot.html"
    result = CliRunner().invoke(_app(), ["report", str(DEMO), "--html", str(page)])
    assert result.exit_code == 0, result.output
    assert "the page has no plot" in result.stderr
    text = page.read_text(encoding="utf-8")
    assert "pip install &#x27;smiquery[plot]&#x27;" in text and "data:image/png" not in text
