"""plot: PNGs of the bundled demo recording checked as images, plus the Figure's lines, thresholds and gaps."""

from __future__ import annotations

import itertools
import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

try:
    import matplotlib
    import matplotlib.dates
    import matplotlib.image
    import numpy as np
    from matplotlib.colors import to_rgb
except ImportError:  # pragma: no cover - the plot extra is installed by `make test`
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("matplotlib is not installed: pip install 'smiquery[plot]'", allow_module_level=True)

from smiquery.analysis import DEFAULT_PLOT_FIELDS, plot_recording, save_plot
from smiquery.errors import ReportError

DEMO = Path(__file__).parents[2] / "smiquery" / "data" / "demo-8gpu.csv"


def gpu_lines(ax: Any) -> list[Any]:
    return [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("gpu-")]


def threshold_values(ax: Any) -> list[float]:
    return sorted(float(ln.get_ydata()[0]) for ln in ax.get_lines() if ln.get_gid() == "threshold")


def layout_of(fig: Any) -> str:
    """Which layout a figure was drawn in: small multiples name their panels, heatmaps hold images."""
    axes = fig.get_axes()
    if any((ax.get_gid() or "").startswith("multiples-") for ax in axes):
        return "multiples"
    return "heatmap" if any(ax.get_images() for ax in axes) else "overlay"


def cells(ax: Any, gid: str | None = None) -> dict[int, list[Any]]:
    """A small-multiples panel's artists (those with ``gid`` if given) by the GPU whose cell they are in."""
    from smiquery.analysis.multiples import cell_of

    out: dict[int, list[Any]] = {}
    for artist in ax.get_children():
        gpu = cell_of(artist)
        if gpu is not None and (gid is None or artist.get_gid() == gid):
            out.setdefault(gpu, []).append(artist)
    return out


def cell_boxes(ax: Any) -> list[tuple[float, float, float, float]]:
    """Each cell's frame (x0, y0, x1, y1) in display pixels, in the order of the GPUs."""
    (frames,) = [c for c in ax.collections if c.get_gid() == "frame"]
    out = []
    for seg in frames.get_segments():
        pts = ax.transData.transform(seg)
        out.append((pts[:, 0].min(), pts[:, 1].min(), pts[:, 0].max(), pts[:, 1].max()))
    return out


def inside(line: Any, box: tuple[float, float, float, float]) -> bool:
    """Every drawn point of a cell's line lies inside the cell's frame."""
    xy = np.column_stack([np.asarray(line.get_xdata(), dtype=float), np.asarray(line.get_ydata(), dtype=float)])
    pts = line.get_transform().transform(xy[np.isfinite(xy).all(axis=1)])
    x0, y0, x1, y1 = box
    eps = 1e-3  # of a pixel: date numbers carry microseconds
    return bool(len(pts)) and bool(
        ((pts[:, 0] >= x0 - eps) & (pts[:, 0] <= x1 + eps) & (pts[:, 1] >= y0 - eps) & (pts[:, 1] <= y1 + eps)).all()
    )


def panel_pixels(fig: Any, ax: Any, image: np.ndarray) -> np.ndarray:
    """The PNG pixels inside one axes (inset by 2 px to skip the frame)."""
    box = ax.get_window_extent()
    height = image.shape[0]
    x0, x1 = round(box.x0) + 2, round(box.x1) - 2
    top, bottom = height - round(box.y1) + 2, height - round(box.y0) - 2
    return image[top:bottom, x0:x1, :3]


def x_pixel(ax: Any, when: datetime) -> float:
    """The PNG column of a time on an axes."""
    return float(ax.transData.transform((matplotlib.dates.date2num(when), 0))[0])  # type: ignore[no-untyped-call]


def colour_pixels(region: np.ndarray, colour: str, min_alpha: float = 0.35, tol: float = 0.08) -> int:
    """Pixels of ``colour`` drawn over white at some opacity (anti-aliased lines blend with the background)."""
    away = 1.0 - np.array(to_rgb(colour))  # the colour's distance from white, per channel
    ink = 1.0 - region
    alpha = (ink @ away) / float(away @ away)
    off = np.abs(ink - alpha[..., None] * away).max(axis=2)
    return int(((alpha > min_alpha) & (off < tol)).sum())


@pytest.fixture(scope="module")
def demo_png(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, np.ndarray, Path]:
    out = tmp_path_factory.mktemp("plot") / "trace.png"
    fig = plot_recording(DEMO)
    fig.savefig(out, dpi=fig.dpi)
    return fig, matplotlib.image.imread(str(out)), out


def test_png_size_and_one_panel_per_field(demo_png):
    fig, image, path = demo_png
    assert path.stat().st_size > 50_000
    width, height = fig.get_size_inches() * fig.dpi
    assert image.shape[:2] == (round(height), round(width))
    axes = fig.get_axes()
    assert len(axes) == len(DEFAULT_PLOT_FIELDS) == 4
    titles = [ax.get_title(loc="left") for ax in axes]
    assert titles == ["utilization.gpu [%]", "temperature.gpu [C]", "memory.used [MiB]", "power.draw [W]"]


def test_panels_are_not_blank(demo_png):
    fig, image, _ = demo_png
    for ax in fig.get_axes():
        region = panel_pixels(fig, ax, image)
        assert region.size > 10_000
        assert region.std() > 0.05, ax.get_title(loc="left")
        # a good share of the panel is drawn on (not only the white background)
        assert (region.min(axis=2) < 0.9).mean() > 0.01


def test_one_line_per_gpu_in_every_panel_with_distinct_colours(demo_png):
    fig, image, _ = demo_png
    seen: dict[str, int] = {}
    for ax in fig.get_axes():
        lines = gpu_lines(ax)
        assert [ln.get_label() for ln in lines] == [f"GPU {i}" for i in range(8)]
        colours = [ln.get_color() for ln in lines]
        assert len(set(colours)) == 8
        region = panel_pixels(fig, ax, image)
        visible = [c for c in colours if colour_pixels(region, c) > 30]
        for c in visible:
            seen[c] = seen.get(c, 0) + 1
        if ax.get_title(loc="left") != "memory.used [MiB]":  # there the 8 lines lie within a few pixels
            assert visible == colours, ax.get_title(loc="left")
    assert len(seen) == 8 and min(seen.values()) >= 3  # every GPU's line shows in the PNG


def test_alert_thresholds_are_drawn(demo_png):
    fig, _, _ = demo_png
    util, temp, mem, power = fig.get_axes()
    assert threshold_values(util) == [20.0]
    assert threshold_values(temp) == [80.0, 85.0]
    assert threshold_values(mem) == []
    assert threshold_values(power) == []
    labels = [t.get_text() for t in temp.texts]
    assert "> 85 for 3" in labels and "> 80 for 5m" in labels


def test_the_hot_gpu_is_visible_over_the_threshold(demo_png):
    fig, _, _ = demo_png
    temp = fig.get_axes()[1]
    peaks = {ln.get_label(): np.nanmax(ln.get_ydata()) for ln in gpu_lines(temp)}
    assert peaks.pop("GPU 5") > 85
    assert max(peaks.values()) < 80


def _gappy(path: Path) -> Path:
    """Two GPUs; GPU 0 reads [N/A] for seconds 20-39, and nothing is recorded between seconds 60 and 120."""
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    lines = ["timestamp, index, utilization.gpu [%], temperature.gpu, memory.used [MiB], power.draw [W]"]
    for sec in [*range(60), *range(120, 180)]:
        for gpu in (0, 1):
            stamp = (t0 + timedelta(seconds=sec)).strftime("%Y/%m/%d %H:%M:%S.000")
            util = "[N/A]" if gpu == 0 and 20 <= sec < 40 else f"{50 + 10 * gpu} %"
            lines.append(f"{stamp}, {gpu}, {util}, {60 + gpu}, 1000 MiB, 200.00 W")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_missing_values_and_time_gaps_break_the_lines(tmp_path):
    rec = _gappy(tmp_path / "gappy.csv")
    out = tmp_path / "gappy.png"
    fig = plot_recording(rec, "utilization.gpu,temperature.gpu", rules=[])
    fig.savefig(out, dpi=fig.dpi)
    image = matplotlib.image.imread(str(out))
    util, temp = fig.get_axes()
    gpu0, gpu1 = gpu_lines(util)
    y0 = np.asarray(gpu0.get_ydata(), dtype=float)
    assert np.isnan(y0).sum() == 20 + 1  # the [N/A] stretch, and one break inside the time gap
    assert np.isnan(np.asarray(gpu1.get_ydata(), dtype=float)).sum() == 1
    # in the picture: no GPU line pixels in the middle of the time gap
    fig.canvas.draw()
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    xs = [x_pixel(util, t0 + timedelta(seconds=s)) for s in (75, 105)]
    height = image.shape[0]
    for ax in (util, temp):
        box = ax.get_window_extent()
        band = image[height - round(box.y1) + 2 : height - round(box.y0) - 2, round(xs[0]) : round(xs[1]), :3]
        for line in gpu_lines(ax):
            assert colour_pixels(band, line.get_color()) == 0
    # and GPU 0's missing stretch is a gap in the utilization panel only
    xs = [x_pixel(util, t0 + timedelta(seconds=s)) for s in (25, 35)]
    box = util.get_window_extent()
    band = image[height - round(box.y1) + 2 : height - round(box.y0) - 2, round(xs[0]) : round(xs[1]), :3]
    assert colour_pixels(band, gpu0.get_color()) == 0
    assert colour_pixels(band, gpu1.get_color()) > 0


def test_save_plot_formats_and_field_choice(tmp_path):
    path = save_plot(DEMO, tmp_path / "t.svg", fields=["temperature.gpu"], gpus=[5, 6])
    assert path.read_text().startswith("<?xml")
    fig = plot_recording(DEMO, ["clocks.current.sm", "clocks_event_reasons.hw_thermal_slowdown"], gpus=[5])
    assert [len(gpu_lines(ax)) for ax in fig.get_axes()] == [1, 1]


def test_jsonl_recordings_plot_too(tmp_path):
    from smiquery.fields import resolve_fields
    from smiquery.recordings import open_recorder, replay

    path = tmp_path / "demo.jsonl"
    with replay(DEMO, speed=0, fields="default") as source:
        samples = list(source)
    writer = open_recorder(path, resolve_fields(list(samples[0].fields)))
    for s in samples:
        writer.write(s)
    writer.close()
    fig = plot_recording(path)
    assert [len(gpu_lines(ax)) for ax in fig.get_axes()] == [8, 8, 8, 8]


def test_bad_fields(tmp_path):
    with pytest.raises(ReportError, match=r"no fan\.speed"):
        plot_recording(_gappy(tmp_path / "g.csv"), ["fan.speed"])
    with pytest.raises(ReportError, match="not a number"):
        plot_recording(DEMO, ["name"])


def test_cli_plot(tmp_path):
    import typer
    from typer.testing import CliRunner

    from smiquery import cli
    from smiquery.cli.analysis import register

    app = cli.app
    if "plot" not in {c.name for c in cli.app.registered_commands}:
        app = typer.Typer()

        @app.callback()
        def root() -> None:
            """Test root."""

        register(app)
    out = tmp_path / "trace.png"
    result = CliRunner().invoke(app, ["plot", str(DEMO), "-o", str(out), "--fields", "temperature.gpu", "--gpus", "5"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    image = matplotlib.image.imread(str(out))
    assert image.shape[1] == 1200
    rec = tmp_path / "copy.csv"
    rec.write_bytes(DEMO.read_bytes())
    default = CliRunner().invoke(app, ["plot", str(rec)])
    assert default.exit_code == 0
    assert (tmp_path / "copy.png").stat().st_size > 10_000
    bad = CliRunner().invoke(app, ["plot", str(DEMO), "--fields", "temp"])
    assert bad.exit_code == 2
    assert "unknown field 'temp'" in bad.stderr


def test_cli_plot_layout(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import smiquery.analysis.plot
    from smiquery import cli

    drawn: list[Any] = []
    real = smiquery.analysis.plot.plot_recording

    def spy(*args: Any, **kwargs: Any) -> Any:
        drawn.append(real(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(smiquery.analysis.plot, "plot_recording", spy)
    out = str(tmp_path / "p.png")
    for layout, drawn_as in (("multiples", "multiples"), ("OVERLAY", "overlay"), ("auto", "overlay")):
        ok = CliRunner().invoke(cli.app, ["plot", str(DEMO), "-o", out, "-f", "temperature.gpu", "--layout", layout])
        assert ok.exit_code == 0, ok.output
        assert layout_of(drawn[-1]) == drawn_as
        assert len(drawn[-1].get_axes()) == 1
    assert sorted(cells(drawn[0].get_axes()[0])) == list(range(8))
    bad = CliRunner().invoke(cli.app, ["plot", str(DEMO), "-o", out, "--layout", "grid"])
    assert bad.exit_code == 2
    assert "grid" in bad.stderr


def test_stalls_and_alerts_are_shaded_where_they_happened(demo_png):
    fig, image, _ = demo_png
    util, temp = fig.get_axes()[0], fig.get_axes()[1]
    stall = [p for p in util.patches if p.get_gid() == "stall"]
    assert len(stall) == 1  # the 8 GPUs' stalls overlap: one band
    left = stall[0].get_x()
    x0, x1 = (matplotlib.dates.num2date(v).replace(tzinfo=None) for v in (left, left + stall[0].get_width()))
    assert abs((x0 - datetime(2026, 3, 14, 9, 35)).total_seconds()) <= 2
    assert 80 <= (x1 - x0).total_seconds() <= 100
    alert = [p for p in temp.patches if p.get_gid() == "alert"]
    assert len(alert) == 1  # GPU 5 over 85 C
    assert not [p for p in fig.get_axes()[2].patches if p.get_gid() == "alert"]  # memory.used had none
    texts = [t.get_text() for ax in fig.get_axes() for t in ax.texts]
    assert "stall: all GPUs" in texts and "alert: GPU 5" in texts
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[-2:] == ["stall", "alert firing"]
    # and in the picture: the stall band is grey behind the lines
    fig.canvas.draw()
    mid = x_pixel(util, datetime(2026, 3, 14, 9, 35, 40))
    box = util.get_window_extent()
    column = image[image.shape[0] - round(box.y1) + 5 : image.shape[0] - round(box.y0) - 60, round(mid), :3]
    assert colour_pixels(column[:, None, :], "#9e9e9e", min_alpha=0.1) > 20


def test_x_axis_names_the_time_zone(tmp_path):
    fig = plot_recording(DEMO, "temperature.gpu", rules=[])
    assert "no zone recorded" in fig.get_axes()[-1].get_xlabel()
    fig = plot_recording(DEMO, "temperature.gpu", rules=[], tz="Asia/Tokyo")
    assert fig.get_axes()[-1].get_xlabel() == "time (Asia/Tokyo)"
    # the axis runs on instants (UTC), its ticks name Tokyo's wall-clock times as recorded
    first = min(gpu_lines(fig.get_axes()[0])[0].get_xdata())
    assert str(first).startswith("2026-03-14T00:30")
    fig.canvas.draw()
    labels = [t.get_text() for t in fig.get_axes()[-1].get_xticklabels() if t.get_text()]
    assert "09:32" in labels and "00:32" not in labels


def test_a_field_with_no_values_says_so(tmp_path):
    path = tmp_path / "na.csv"
    rows = "".join(f"2026/01/01 00:00:{s:02d}.000, 0, [N/A], {40 + s % 3}\n" for s in range(30))
    path.write_text("timestamp, index, fan.speed [%], temperature.gpu\n" + rows, encoding="utf-8")
    fig = plot_recording(path, "fan.speed,temperature.gpu", rules=[])
    fan, temp = fig.get_axes()
    assert [t.get_gid() for t in fan.texts] == ["no-data"]
    assert "no values" in fan.texts[0].get_text()
    lo, _ = fan.get_xlim()
    assert matplotlib.dates.num2date(lo).year == 2026  # not an empty 1970 axis
    assert not [t for t in temp.texts if t.get_gid() == "no-data"]


def sixteen_gpus(tmp_path: Path) -> Path:
    """16 GPUs, 20 s: temperature 5 C apart per GPU; GPU 3 reads 90 % utilisation after 10 s, the others 40 %."""
    path = tmp_path / "sixteen.csv"
    rows = "".join(
        f"2026/01/01 00:00:{s:02d}.000, {g}, {g * 5 + s % 4}, {90 if g == 3 and s >= 10 else 40} %\n"
        for s in range(20)
        for g in range(16)
    )
    path.write_text("timestamp, index, temperature.gpu, utilization.gpu [%]\n" + rows, encoding="utf-8")
    return path


def test_many_gpus_overlaid_get_distinct_styles(tmp_path):
    fig = plot_recording(sixteen_gpus(tmp_path), "temperature.gpu", rules=[], layout="overlay")
    assert len(fig.get_axes()) == 1
    styles = [(ln.get_color(), ln.get_linestyle()) for ln in gpu_lines(fig.get_axes()[0])]
    assert len(styles) == 16 and len(set(styles)) == 16


def test_more_than_eight_gpus_get_one_small_panel_each_per_field(tmp_path):
    from smiquery.analysis import OVERLAY_MAX_GPUS

    assert OVERLAY_MAX_GPUS == 8
    fig = plot_recording(sixteen_gpus(tmp_path), "utilization.gpu,temperature.gpu", rules=["utilization.gpu < 20"])
    util, temp = fig.get_axes()
    assert [ax.get_gid() for ax in (util, temp)] == ["multiples-utilization.gpu", "multiples-temperature.gpu"]
    fig.canvas.draw()
    for ax in (util, temp):
        assert [t.get_text() for t in ax.texts if t.get_gid() == "title"] == [f"GPU {g}" for g in range(16)]
        lines = gpu_lines(ax)
        assert [ln.get_label() for ln in lines] == [f"GPU {g}" for g in range(16)]
        # a GPU keeps its palette colour
        assert [ln.get_color() for ln in lines[:8]] == [ln.get_color() for ln in lines[8:]]
        assert len({ln.get_color() for ln in lines}) == 8
        # one scale per field: every GPU's line, the hottest included, inside its own cell; cells of one size
        boxes = cell_boxes(ax)
        assert all(inside(ln, box) for ln, box in zip(lines, boxes, strict=True))
        assert len({(round(x1 - x0, 6), round(y1 - y0, 6)) for x0, y0, x1, y1 in boxes}) == 1
        # values beside the first column, the same on every row
        ticks = [(t.get_position()[1], t.get_text()) for t in ax.texts if t.get_gid() == "ytick"]
        assert len(ticks) == 2 * len({text for _, text in ticks})  # 16 GPUs at 12 inches: two rows of 8
    assert [t.get_text() for t in util.texts if t.get_gid() == "ytick"] == ["0", "50", "100"] * 2
    assert {(cell_of_text, value) for cell_of_text, value in _thresholds_by_cell(util)} == {
        (g, 20.0) for g in range(16)
    }
    assert not _thresholds_by_cell(temp)
    assert {t.get_text() for t in fig.texts} >= {"utilization.gpu [%]", "temperature.gpu [C]"}
    # the time shows under the figure's bottom row only
    assert not [t for t in util.texts if t.get_gid() == "xtick"]
    times = [t for t in temp.texts if t.get_gid() == "xtick"]
    assert times and all(t.get_text() for t in times)
    lowest = min(y0 for _, y0, _, _ in cell_boxes(temp))
    assert all(t.get_window_extent().y1 <= lowest for t in times)


def _thresholds_by_cell(ax: Any) -> list[tuple[int, float]]:
    return [(gpu, float(a.get_ydata()[0])) for gpu, found in cells(ax, "threshold").items() for a in found]


def test_layout_is_chosen_either_way_and_checked(tmp_path):
    multiples = plot_recording(DEMO, "temperature.gpu", rules=[], layout="multiples")
    assert layout_of(multiples) == "multiples"
    assert sorted(cells(multiples.get_axes()[0])) == list(range(8))
    assert layout_of(plot_recording(DEMO, "temperature.gpu", rules=[])) == "overlay"  # auto: 8 GPUs overlay
    with pytest.raises(ValueError, match="layout must be one of auto, overlay, multiples, heatmap"):
        plot_recording(DEMO, "temperature.gpu", layout="grid")  # type: ignore[arg-type]


def test_small_multiples_shade_each_gpus_own_stalls_and_alerts(tmp_path):
    fig = plot_recording(DEMO, "utilization.gpu,temperature.gpu", layout="multiples")
    util, temp = fig.get_axes()
    assert sorted(cells(util, "stall")) == list(range(8))  # every GPU stalled
    assert sorted(cells(temp, "stall")) == list(range(8))  # on every field's cells
    assert sorted(cells(temp, "alert")) == [5]
    assert not cells(util, "alert")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["stall", "alert firing"]  # the cells name the GPUs


def test_a_gpu_without_values_says_so_in_its_own_small_panel(tmp_path):
    fig = plot_recording(DEMO, "power.draw", rules=[], layout="multiples")
    assert not cells(fig.get_axes()[0], "no-data")  # the demo has power for every GPU
    path = tmp_path / "na.csv"
    rows = "".join(
        f"2026/01/01 00:00:{s:02d}.000, {g}, {'[N/A]' if g == 1 else 100 + g}\n" for s in range(10) for g in range(3)
    )
    path.write_text("timestamp, index, power.draw [W]\n" + rows, encoding="utf-8")
    fig = plot_recording(path, "power.draw", rules=[], layout="multiples")
    (ax,) = fig.get_axes()
    assert sorted(cells(ax, "no-data")) == [1]
    first, empty, last = gpu_lines(ax)
    assert np.isnan(np.asarray(empty.get_ydata(), dtype=float)).all()
    boxes = cell_boxes(ax)
    assert inside(first, boxes[0]) and inside(last, boxes[2])  # the field's scale holds 100 to 102
    values = [float(t.get_text()) for t in ax.texts if t.get_gid() == "ytick"]
    assert len(values) > 1 and min(values) <= 100 <= max(values)  # values beside the first column


def test_headerless_log_plots_with_fields(tmp_path):
    path = tmp_path / "noheader.csv"
    path.write_text("".join(f"2026/01/01 00:00:{s:02d}.000, {50 + s} W\n" for s in range(30)), encoding="utf-8")
    with pytest.raises(ReportError, match="--fields"):
        plot_recording(path)
    fig = plot_recording(path, "timestamp,power.draw", rules=[])
    assert [ax.get_title(loc="left") for ax in fig.get_axes()] == ["power.draw [W]"]
    assert [ln.get_label() for ln in gpu_lines(fig.get_axes()[0])] == ["GPU 0"]


def test_gpus_chosen_by_uuid_or_bus_id_as_stream_takes_them(tmp_path):
    from typer.testing import CliRunner

    from smiquery.cli.analysis import register

    uuid5 = "GPU-d98134f2-4986-55a4-31e4-e203d4cccb68"  # GPU 5 in the demo recording
    fig = plot_recording(DEMO, "temperature.gpu", gpus=[uuid5, "00000000:18:00.0"], rules=[])
    assert sorted(ln.get_label() for ln in gpu_lines(fig.get_axes()[0])) == ["GPU 0", "GPU 5"]
    import typer

    app = typer.Typer()

    @app.callback()
    def root() -> None:
        """Test root."""

    register(app)
    ok = CliRunner().invoke(app, ["plot", str(DEMO), "-o", str(tmp_path / "p.png"), "-i", uuid5])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(app, ["plot", str(DEMO), "-o", str(tmp_path / "p.png"), "-i", "GPU-nonsense!"])
    assert bad.exit_code == 2
    assert bad.stderr.startswith("smiquery: usage error:")


def _span_x(patch: Any) -> tuple[float, float]:
    """A shaded span's start and end, in matplotlib's date numbers."""
    x0, x1 = (float(v) for v in patch.get_path().vertices[:, 0][[0, 2]])
    box = patch.get_patch_transform().transform([(x0, 0), (x1, 0)])[:, 0]
    return float(min(box)), float(max(box))


def test_small_multiples_shade_the_periods_the_report_finds():
    from smiquery.analysis import report

    found = report(DEMO)
    fig = plot_recording(DEMO, "utilization.gpu,temperature.gpu", layout="multiples")
    util, temp = fig.get_axes()
    date = matplotlib.dates.date2num  # type: ignore[attr-defined]
    for kind, panels, periods in (
        ("stall", util, [(s.gpu, s.start, s.end) for s in found.stalls]),
        ("alert", temp, [(a.gpu, a.fired, a.end) for a in found.alerts if a.rule.startswith("temperature.gpu")]),
    ):
        assert periods
        for gpu in range(8):
            spans = [_span_x(p) for p in cells(panels, kind).get(gpu, [])]
            mine = [(float(date(s.replace(tzinfo=None))), float(date(e.replace(tzinfo=None)))) for g, s, e in periods
                    if g == gpu]  # fmt: skip
            # every period the report lists is shaded on its GPU's panel, and every shading starts and ends at one
            assert bool(spans) == bool(mine)
            for s, e in mine:
                assert any(a <= s + 1e-9 and e <= b + 1e-9 for a, b in spans)
            for a, b in spans:
                assert any(abs(a - s) < 1e-9 for s, _ in mine) and any(abs(b - e) < 1e-9 for _, e in mine)


def test_small_multiples_keep_a_one_sample_spike_and_dip(tmp_path):
    path = tmp_path / "long.csv"
    start = datetime(2026, 1, 1)
    n = 20_000  # 1 Hz: many samples per pixel of a small panel
    spike, dip = 12_345, 4_321
    pause = 15_000  # the recording was stopped for ten minutes before this sample

    def at(sample: int) -> int:
        return sample + (600 if sample >= pause else 0)

    rows = []
    for s in range(n):
        stamp = (start + timedelta(seconds=at(s))).strftime("%Y/%m/%d %H:%M:%S.000")
        for g in range(2):
            value = 99 if (g == 1 and s == spike) else 1 if (g == 0 and s == dip) else 50 + s % 3
            rows.append(f"{stamp}, {g}, {value} %\n")
    path.write_text("timestamp, index, utilization.gpu [%]\n" + "".join(rows), encoding="utf-8")
    fig = plot_recording(path, "utilization.gpu", rules=[], layout="multiples")
    (ax,) = fig.get_axes()
    gpu0, gpu1 = gpu_lines(ax)
    x0, _, x1, _ = cell_boxes(ax)[0]
    pixels = x1 - x0
    date = matplotlib.dates.date2num  # type: ignore[attr-defined]
    for line, value, when in ((gpu1, 99.0, spike), (gpu0, 1.0, dip)):
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata(), dtype=float)
        assert len(x) <= 2 * pixels + 2 < n / 10  # drawn at about two points (lowest, highest) per pixel of the panel
        where = int(np.flatnonzero(y == value)[0])  # the one sample survives, at its own time
        assert x[where] == date(np.datetime64(start + timedelta(seconds=at(when))))
        assert np.nanmin(y) >= 1.0 and np.nanmax(y) <= 99.0
        # the pause breaks the line, no straight join across it
        before, after = (
            date(np.datetime64(start + timedelta(seconds=pause - 1))),
            date(np.datetime64(start + timedelta(seconds=at(pause)))),
        )
        paused = (x > before) & (x < after)
        assert paused.any() and np.isnan(y[paused]).all()
    # the same recording overlaid is averaged per pixel: the spike is smoothed into its neighbours
    overlaid = gpu_lines(plot_recording(path, "utilization.gpu", rules=[], layout="overlay").get_axes()[0])
    assert max(float(v) for v in overlaid[1].get_ydata()) < 99.0


def test_plotting_leaves_the_garbage_collector_as_it_found_it(tmp_path):
    # The collector is paused while a figure is built and drawn; a paused one left behind would leak every cycle.
    import gc

    assert gc.isenabled()
    save_plot(DEMO, tmp_path / "run.png", "temperature.gpu", layout="multiples")
    assert gc.isenabled()
    with pytest.raises(ReportError, match="not a number"):
        plot_recording(DEMO, ["name"])  # fails inside the paused stretch
    assert gc.isenabled()
    gc.disable()  # a caller that runs without it keeps it off
    try:
        plot_recording(DEMO, "temperature.gpu", rules=[])
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("layout", ["overlay", "multiples", "heatmap"])
def test_a_small_panel_height_still_gives_panels_that_do_not_overlap(tmp_path, layout):
    fig = plot_recording(DEMO, "utilization.gpu,temperature.gpu", rules=[], panel_height=0.3, layout=layout)
    fig.savefig(tmp_path / "small.png")
    panels = sorted((ax.get_position() for ax in fig.get_axes() if ax.get_label() != "<colorbar>"),
                    key=lambda p: -p.y1)  # fmt: skip
    assert all(p.height > 0 for p in panels)
    assert all(upper.y0 >= lower.y1 for upper, lower in itertools.pairwise(panels) if upper.x0 == lower.x0)
