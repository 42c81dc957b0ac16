"""Plots that hide nothing (issue 22, item 7): a band around each overlaid mean, heatmaps past 16 GPUs."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

import pytest

try:
    import matplotlib.image
    import numpy as np
except ImportError:  # pragma: no cover - the plot extra is installed by `make test`
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("matplotlib is not installed: pip install 'smiquery[plot]'", allow_module_level=True)

from smiquery.analysis import MULTIPLES_MAX_GPUS, plot_recording
from smiquery.analysis.plot import cell_means
from tests.analysis.test_plot import colour_pixels, panel_pixels


def memory_drops(tmp_path: Path, sweeps: int = 36_000) -> Path:
    """Two GPUs for 10 h at 1 Hz holding ~70 GB; GPU 1's memory drops to 1 MiB for one sample every 10 minutes."""
    t0 = datetime(2026, 5, 1)
    lines = ["timestamp, index, memory.used [MiB]"]
    for k in range(sweeps):
        stamp = f"{t0 + timedelta(seconds=k):%Y/%m/%d %H:%M:%S}.000"
        lines.append(f"{stamp}, 0, {70000 + k % 50} MiB")
        lines.append(f"{stamp}, 1, {1 if k % 600 == 300 else 70000 + k % 50} MiB")
    path = tmp_path / "drops.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_an_overlaid_line_keeps_a_one_sample_drop_in_its_band(tmp_path):
    path = memory_drops(tmp_path)
    fig = plot_recording(path, "memory.used", rules=[], layout="overlay")
    (ax,) = fig.get_axes()
    bands = {c.get_gid(): c for c in ax.collections if (c.get_gid() or "").startswith("band-")}
    assert set(bands) == {"band-0", "band-1"}
    low = {gid: min(p.vertices[:, 1].min() for p in band.get_paths()) for gid, band in bands.items()}
    assert low["band-1"] <= 1 and low["band-0"] >= 70000  # the drop is in GPU 1's band, not in GPU 0's
    # the mean line alone would hide it: no point of GPU 1's line comes near 1 MiB
    line = next(ln for ln in ax.get_lines() if ln.get_gid() == "gpu-1")
    assert np.nanmin(np.asarray(line.get_ydata(), dtype=float)) > 60000
    # on the image: GPU 1's orange reaches the bottom half of the panel, at many places across the run
    out = tmp_path / "drops.png"
    fig.savefig(out, dpi=fig.dpi)
    pixels = panel_pixels(fig, ax, matplotlib.image.imread(str(out)))
    lower = pixels[pixels.shape[0] // 2 :]
    # the band is pale: any opacity of the colour counts, but only of its very hue (the grid's grey does not)
    columns = [colour_pixels(lower[:, i : i + 1], "#ff7f0e", min_alpha=0.05, tol=0.03) for i in range(lower.shape[1])]
    assert sum(1 for c in columns if c > 0) >= 40  # 60 drops over the run
    assert colour_pixels(lower, "#1f77b4", min_alpha=0.05, tol=0.03) == 0  # GPU 0 never drops


def many_gpus(tmp_path: Path, gpus: int, seconds: int = 120) -> Path:
    """``gpus`` GPUs at 1 Hz: utilization 90 %, GPU 7 stalls (5 %) from 40 s to 100 s, GPU 11 runs at 95 C."""
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB], temperature.gpu"]
    for s in range(seconds):
        for g in range(gpus):
            util = 5 if g == 7 and 40 <= s < 100 else 90
            temp = 95 if g == 11 else 60 + g % 5
            lines.append(f"2026/01/01 00:{s // 60:02d}:{s % 60:02d}.000, {g}, {util} %, 40000 MiB, {temp}")
    path = tmp_path / f"gpus{gpus}.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_past_sixteen_gpus_each_field_is_one_heatmap_with_stalls_and_alerts_outlined(tmp_path):
    assert MULTIPLES_MAX_GPUS == 16
    fig = plot_recording(many_gpus(tmp_path, 64), "utilization.gpu,temperature.gpu", rules=["temperature.gpu > 90"])
    images = {im.get_gid(): im for ax in fig.get_axes() for im in ax.get_images()}
    assert set(images) == {"heatmap-utilization.gpu", "heatmap-temperature.gpu"}  # 2 panels, not 128
    util = images["heatmap-utilization.gpu"].get_array()
    assert util.shape[0] == 64
    assert np.nanmin(util[7]) < 10 and np.nanmin(np.delete(util, 7, axis=0)) == 90  # GPU 7's stall is in its row
    util_ax, temp_ax = (im.axes for im in images.values())

    def boxes(ax: object, gid: str) -> list[tuple[float, float]]:
        """(top, bottom) rows of each outline of that kind."""
        (marks,) = [c for c in ax.collections if c.get_gid() == gid]  # type: ignore[attr-defined]
        return [(p.vertices[:, 1].min(), p.vertices[:, 1].max()) for p in marks.get_paths()]

    assert boxes(util_ax, "stall") == [(6.5, 7.5)]  # outlined on GPU 7's row only
    assert boxes(temp_ax, "stall") == [(6.5, 7.5)]  # on every field's panel
    assert boxes(temp_ax, "alert") == [(10.5, 11.5)]
    assert not [c for c in util_ax.collections if c.get_gid() == "alert"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["stall", "alert firing"]
    labels = [t.get_text() for t in util_ax.get_yticklabels()]
    assert labels[:3] == ["0", "4", "8"] and len(labels) == 16


def test_auto_layout_by_gpu_count_and_heatmap_on_request(tmp_path):
    from tests.analysis.test_plot import layout_of as kind

    assert kind(plot_recording(many_gpus(tmp_path, 16, 20), "utilization.gpu", rules=[])) == "multiples"
    assert kind(plot_recording(many_gpus(tmp_path, 17, 20), "utilization.gpu", rules=[])) == "heatmap"
    eight = plot_recording(many_gpus(tmp_path, 8, 20), "utilization.gpu", rules=[], layout="heatmap")
    assert kind(eight) == "heatmap"


def test_gpus_that_stall_together_share_one_outline(tmp_path):
    lines = ["timestamp, index, utilization.gpu [%], memory.used [MiB]"]
    for s in range(120):
        for g in range(20):
            util = 5 if g in range(4, 12) and 30 <= s < 90 else 90
            lines.append(f"2026/01/01 00:{s // 60:02d}:{s % 60:02d}.000, {g}, {util} %, 40000 MiB")
    path = tmp_path / "together.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (ax,) = plot_recording(path, "utilization.gpu", rules=[]).get_axes()[:1]
    (marks,) = [c for c in ax.collections if c.get_gid() == "stall"]
    (box,) = marks.get_paths()
    assert (box.vertices[:, 1].min(), box.vertices[:, 1].max()) == (3.5, 11.5)  # GPUs 4-11 in one box


def test_cli_plot_layout_heatmap(tmp_path):
    from typer.testing import CliRunner

    from tests.analysis.test_report import _app

    out = tmp_path / "h.png"
    got = CliRunner().invoke(_app(), ["plot", str(many_gpus(tmp_path, 20, 30)), "-o", str(out), "--layout", "heatmap"])
    assert got.exit_code == 0, got.output
    image = matplotlib.image.imread(str(out))
    assert image.shape[1] == 1200 and (image[..., :3].min(axis=2) < 0.5).mean() > 0.2  # painted, not blank


def test_cell_means_average_each_gpus_samples_per_span_of_time():
    x = np.array(["2026-01-01T00:00:00", "2026-01-01T00:00:01", "2026-01-01T00:00:02", "2026-01-01T00:00:03"],
                 dtype="datetime64[ns]")  # fmt: skip
    lo, hi = x[0], x[-1]
    got = cell_means([x, x], [np.array([1.0, 3.0, np.nan, 10.0]), np.full(4, np.nan)], (lo, hi), 2)
    assert got[0].tolist() == [2.0, 10.0]
    assert np.isnan(got[1]).all()  # a GPU without values is missing, not 0


def test_the_docs_show_the_plot_the_script_draws_of_the_demo_recording(tmp_path):
    root = Path(__file__).parents[2]
    page = (root / "docs" / "recording.md").read_text(encoding="utf-8")
    assert "![smiquery plot of the bundled 8-GPU demo recording" in page
    assert "(plot-demo.png)" in page
    import subprocess
    import sys

    fresh = tmp_path / "plot-demo.png"
    subprocess.run([sys.executable, str(root / "scripts" / "make_docs_plot.py"), "--out", str(fresh)], check=True,
                   timeout=300, capture_output=True)  # fmt: skip
    shown = matplotlib.image.imread(str(root / "docs" / "plot-demo.png"))
    drawn = matplotlib.image.imread(str(fresh))
    # the same picture (font rendering may differ by a pixel's shade): run the script again after a plot change
    assert shown.shape == drawn.shape
    assert float(np.abs(shown - drawn).mean()) < 0.01


def _as_fleet(path: Path, per_node: int) -> object:
    """The recording as a fleet's frame: GPUs named by node (``node-K`` holding ``per_node`` each), as the report."""
    from smiquery.analysis import load_recording
    from smiquery.analysis.model import GpuName

    df = load_recording(path)
    count = int(df["index"].max()) + 1
    df.attrs["gpu_names"] = {
        g: GpuName(f"node-{g // per_node}", f"node-{g // per_node}:9849", str(g % per_node)) for g in range(count)
    }
    return df


def test_a_fleets_plot_names_gpus_by_node_and_its_heatmap_marks_the_nodes(tmp_path):
    # overlay: the legend's lines; the stall's label
    fig = plot_recording(_as_fleet(many_gpus(tmp_path, 8), 4), "utilization.gpu", rules=[], layout="overlay")
    (ax,) = fig.get_axes()
    lines = [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("gpu-")]
    assert [ln.get_label() for ln in lines] == [f"node-{g // 4} GPU {g % 4}" for g in range(8)]
    assert "stall: node-1 GPU 3" in [t.get_text() for t in ax.texts]
    # small multiples: each cell titled by node and index (its artists still labelled by the report's number)
    fig = plot_recording(_as_fleet(many_gpus(tmp_path, 12, 20), 4), "utilization.gpu", rules=[], layout="multiples")
    (ax,) = fig.get_axes()
    titles = [t for t in ax.texts if t.get_gid() == "title"]
    assert [t.get_text() for t in titles] == [f"node-{g // 4} GPU {g % 4}" for g in range(12)]
    assert [t.get_label() for t in titles] == [f"GPU {g}" for g in range(12)]
    # heatmap: rows labelled by node at its first row, a line between nodes
    fig = plot_recording(_as_fleet(many_gpus(tmp_path, 24), 8), "utilization.gpu", rules=[], layout="heatmap")
    ax = next(a for a in fig.get_axes() if a.get_images())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["node-0", "node-1", "node-2"]
    assert list(ax.get_yticks()) == [0, 8, 16] and ax.get_ylabel() == "node"
    (bounds,) = [c for c in ax.collections if c.get_gid() == "node-boundary"]
    assert sorted(float(seg[0][1]) for seg in bounds.get_segments()) == [7.5, 15.5]
    # a recording's heatmap: rows by GPU number, no node lines
    fig = plot_recording(many_gpus(tmp_path, 24), "utilization.gpu", rules=[], layout="heatmap")
    ax = next(a for a in fig.get_axes() if a.get_images())
    assert ax.get_ylabel() == "GPU" and [t.get_text() for t in ax.get_yticklabels()][:2] == ["0", "1"]
    assert not [c for c in ax.collections if c.get_gid() == "node-boundary"]
