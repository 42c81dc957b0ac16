"""Every layout fits its canvas and no text covers another (issue 33), for 1 to 64 GPUs; heatmap colour scales."""

from __future__ import annotations

import io
import itertools
import os
from pathlib import Path
from typing import Any

import pytest

try:
    import matplotlib.image
    from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg
except ImportError:  # pragma: no cover - the plot extra is installed by `make test`
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("matplotlib is not installed: pip install 'smiquery[plot]'", allow_module_level=True)

from smiquery.analysis import plot_png, plot_recording
from smiquery.analysis.series import stack_labels
from tests.analysis.test_plot import DEMO, cell_boxes

# the rules the demo (scripts/demo.py) draws with: a stall and an alert start half a minute apart
DEMO_RULES = ("temperature.gpu > 85 for 3", "utilization.gpu < 20 for 30s")


def many_gpus(path: Path, gpus: int, sweeps: int = 30) -> Path:
    """A recording of ``gpus`` GPUs made from the demo's 8 (new index, UUID and bus id for each)."""
    head, *rows = DEMO.read_text(encoding="utf-8").splitlines()
    out = [head]
    for s in range(sweeps):
        for g in range(gpus):
            cells = rows[s * 8 + g % 8].split(", ")
            cells[1], cells[3], cells[10] = str(g), f"{cells[3][:-4]}{g:04x}", f"00000000:{g + 16:02X}:00.0"
            out.append(", ".join(cells))
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def drawn_texts(fig: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Draw the figure; every text it drew (visible, not empty) with its box in pixels.

    Texts as the renderer drew them: an axis keeps labels for ticks outside its view that it does not draw.
    """
    drawn: list[Any] = []
    original = RendererAgg.draw_text

    def record(self: Any, gc: Any, x: float, y: float, s: str, prop: Any, angle: float, ismath: Any = False,
               mtext: Any = None) -> Any:  # fmt: skip
        if mtext is not None and mtext not in drawn:
            drawn.append(mtext)
        return original(self, gc, x, y, s, prop, angle, ismath, mtext)

    FigureCanvasAgg(fig)
    with monkeypatch.context() as m:
        m.setattr(RendererAgg, "draw_text", record)
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for text in drawn:
        box = text.get_window_extent(renderer)
        if text.get_visible() and text.get_text().strip() and box.width > 0 and box.height > 0:
            out.append((text, box))
    return out


def problems(fig: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What leaves the canvas (panels with their ticks and labels, texts, legends) and which texts overlap."""
    texts = drawn_texts(fig, monkeypatch)
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    slack = 0.5  # of a pixel

    def outside(box: Any) -> bool:
        return bool(box.x0 < canvas.x0 - slack or box.y0 < canvas.y0 - slack or box.x1 > canvas.x1 + slack
                    or box.y1 > canvas.y1 + slack)  # fmt: skip

    found = []
    for ax in fig.get_axes():
        for box in (ax.get_window_extent(renderer), ax.get_tightbbox(renderer)):
            if outside(box):
                found.append(f"panel {ax.get_gid() or ax.get_label()} leaves the canvas: {box.bounds}")
    for legend in fig.legends:
        if outside(legend.get_window_extent(renderer)):
            found.append("the legend leaves the canvas")
    for text, box in texts:
        if outside(box):
            found.append(f"{text.get_text()!r} leaves the canvas: {box.bounds}")
    for (a, box_a), (b, box_b) in itertools.combinations(texts, 2):
        wide = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
        high = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
        if wide > 1 and high > 1:
            found.append(f"{a.get_text()!r} over {b.get_text()!r}")
    return found


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    where = tmp_path_factory.mktemp("fit")
    return {n: many_gpus(where / f"g{n}.csv", n) for n in (1, 2, 3, 5, 8, 12, 16, 33, 64)}


@pytest.mark.parametrize("gpus", [1, 2, 3, 5, 8, 12, 16, 33, 64])
@pytest.mark.parametrize("layout", ["overlay", "multiples", "heatmap"])
def test_every_layout_fits_its_canvas_with_no_text_over_another(recordings, gpus, layout, monkeypatch):
    fig = plot_recording(recordings[gpus], layout=layout)
    assert problems(fig, monkeypatch) == []


@pytest.mark.parametrize("layout", ["overlay", "multiples", "heatmap"])
def test_the_demo_with_its_stall_and_alerts_has_no_text_over_another(layout, monkeypatch):
    fig = plot_recording(DEMO, rules=DEMO_RULES, layout=layout)
    assert problems(fig, monkeypatch) == []
    if layout == "overlay":  # both span labels are drawn, one under the other
        util = fig.get_axes()[0]
        spans = {t.get_text(): t for t in util.texts if t.get_text().startswith(("stall:", "alert:"))}
        assert set(spans) == {"stall: all GPUs", "alert: all GPUs"}


def test_twelve_gpus_in_small_multiples_keep_the_last_columns_frame_and_line(tmp_path):
    """The PNG the HTML report inlines: GPU 7's cell (the last column) whole, its right border drawn."""
    path = many_gpus(tmp_path / "g12.csv", 12)
    fig = plot_recording(path)  # auto: small multiples
    image = matplotlib.image.imread(io.BytesIO(plot_png(path)))
    assert image.shape[1] == 1200
    FigureCanvasAgg(fig).draw()
    height = image.shape[0]
    for ax in fig.get_axes():
        boxes = cell_boxes(ax)
        assert len(boxes) == 12
        _, y0, x1, y1 = boxes[7]  # GPU 7: the right end of the first row
        assert x1 < 1200 - 5
        rows = image[height - round(y1) + 3 : height - round(y0) - 3, round(x1) - 1 : round(x1) + 2, :3]
        dark = rows.min(axis=2).min(axis=1) < 0.35  # the frame's black in the pixel columns about its edge
        assert dark.mean() > 0.95, f"{ax.get_gid()}: the right border of GPU 7's cell is missing"
        # and its line reaches the end of the time axis inside the panel's clip
        line = next(ln for ln in ax.get_lines() if ln.get_gid() == "gpu-7")
        clip = line.get_clip_box()
        assert clip is None or clip.x1 >= x1 + 2


def _colour_bars(fig: Any) -> dict[str, Any]:
    """Each heatmap's image by field name, with its colour bar's axes."""
    return {im.get_gid().removeprefix("heatmap-"): im for ax in fig.get_axes() for im in ax.get_images()}


def test_heatmap_colours_span_each_fields_physical_range_with_plain_numbers(tmp_path, monkeypatch):
    fig = plot_recording(many_gpus(tmp_path / "g64.csv", 64), rules=[])
    images = _colour_bars(fig)
    scales = {name: (im.norm.vmin, im.norm.vmax) for name, im in images.items()}
    assert scales == {
        "utilization.gpu": (0, 100),
        "temperature.gpu": (0, 100),  # fixed
        "memory.used": (0, 81559),  # memory.total
        "power.draw": (0, 700),  # power.limit
    }
    drawn_texts(fig, monkeypatch)
    for im in images.values():
        bar = im.colorbar
        labels = [t.get_text() for t in bar.ax.get_yticklabels()]
        assert labels and not any("e+" in t or "+" in t for t in labels), labels
        assert bar.ax.yaxis.get_offset_text().get_text() == ""  # never "+4.032e4"
    assert images["memory.used"].colorbar.ax.get_ylabel() == "0 to 81,559 MiB"
    titles = {ax.get_title(loc="left") for ax in fig.get_axes()}
    assert {"memory.used [MiB], colour: 0 to memory.total", "power.draw [W], colour: 0 to power.limit",
            "temperature.gpu [C], colour: fixed 0 to 100", "utilization.gpu [%]"} <= titles  # fmt: skip


def test_a_flat_value_without_a_limit_is_not_drawn_as_the_lowest_colour(tmp_path):
    lines = ["timestamp, index, memory.used [MiB]"]
    lines += [f"2026/01/01 00:00:{s:02d}.000, {g}, 40000 MiB" for s in range(30) for g in range(20)]
    path = tmp_path / "flat.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (im,) = _colour_bars(plot_recording(path, rules=[])).values()
    assert 0.3 < im.norm(40000) < 0.7  # in the middle of its scale, not "low"
    assert im.norm.vmin < 40000 < im.norm.vmax


def test_stack_labels_keeps_labels_apart_inside_their_area():
    area = (0.0, 0.0, 200.0, 100.0)
    # two labels wanting the same place: the second goes under the first; one past the top comes down into it
    got = stack_labels([(10, 50, 10, [95]), (30, 50, 10, [95]), (150, 80, 10, [130])], area)
    assert got == [(10, 95), (30, 85), (120, 100)]  # the third moved in from the right edge too
    # under its line, else over it; none fits: left off
    assert stack_labels([(0, 50, 10, [50]), (0, 50, 10, [48, 62])], area) == [(0, 50), (0, 62)]
    assert stack_labels([(0, 50, 60, [100]), (0, 50, 60, [100])], area) == [(0, 100), None]
