#!/usr/bin/env python3
"""Write the docs' screens and pictures: real ``smiquery`` output against the stand-ins, never pasted by hand.

Each text screen is the command run in a real terminal (a detached tmux window of a fixed size, read back with
``tmux capture-pane``) against the fake nvidia-smi (``smiquery.testing.fake_nvidia_smi``, 8 H100s with a training
job on each) or the bundled 8-GPU demo recording (``smiquery/data/demo-8gpu.csv``); ``top`` reads a real
Prometheus over a backfilled hour of a small fleet (``tests/fleet/fleetdata.py``; skipped without prometheus and
promtool). The pictures are ``smiquery plot`` of the demo recording and a headless Chromium screenshot of
``smiquery report --html`` of it (skipped without chromium). Everything goes to ``docs/snippets/`` (text, included
by the pages with ``--8<--``; the README shows the live table too) and ``docs/`` (the pictures).

Usage: python scripts/make_docs_screens.py [--only NAME,...] [--out DIR] [--list]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO = ROOT / "smiquery" / "data" / "demo-8gpu.csv"
SNIPPETS = ROOT / "docs" / "snippets"
IMAGES = ROOT / "docs"
WIDTH, HEIGHT = 100, 30
README_BEGIN, README_END = "<!-- live-view:begin -->", "<!-- live-view:end -->"


class Context:
    """What the screens share: where to write, the fake nvidia-smi, a scratch folder."""

    def __init__(self, out: Path, images: Path, scratch: Path) -> None:
        self.out, self.images, self.scratch = out, images, scratch
        self._smi: Path | None = None

    @property
    def smi(self) -> Path:
        if self._smi is None:
            from smiquery.testing import fake_nvidia_smi

            # a fixed folder, as the screens name it (the stream's title shows the binary's path)
            self._smi = fake_nvidia_smi(Path(tempfile.gettempdir()) / "smiquery-fake")
        return self._smi

    def smiquery(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "smiquery", "--nvidia-smi", str(self.smi), *args]


def _tmux() -> str:
    tmux = shutil.which("tmux")
    if tmux is None:
        sys.exit("make_docs_screens: tmux is not installed (apt-get install tmux)")
    return tmux


def terminal(
    argv: list[str],
    *,
    width: int = WIDTH,
    height: int = HEIGHT,
    ready: Callable[[str], bool] | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """The screen of ``argv`` run in a ``width`` x ``height`` terminal: once it exits, or once ``ready(screen)``."""
    tmux = _tmux()
    socket = f"smiquery-docs-{os.getpid()}-{time.monotonic_ns()}"
    base = [tmux, "-L", socket]
    done = Path(tempfile.mkdtemp(prefix="smiquery-docs-")) / "done"
    # the command's own exit is marked by a file; the shell then waits, so that the pane keeps the screen
    script = 'cd "$1"; shift; "$@"; touch "$0"; exec sleep 600'
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", **(env or {})}
    full_env.pop("COLUMNS", None)
    full_env.pop("LINES", None)
    subprocess.run(
        [*base, "-f", "/dev/null", "new-session", "-d", "-x", str(width), "-y", str(height),
         "--", "sh", "-c", script, str(done), str(ROOT), *argv],
        check=True, timeout=30, env=full_env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            screen = subprocess.run(
                [*base, "capture-pane", "-p", "-J", "-S", "-"], capture_output=True, text=True, check=True, timeout=30
            ).stdout
            if (ready is None and done.exists()) or (ready is not None and ready(screen)):
                if ready is None:  # read once more: the last lines may land after the marker
                    screen = subprocess.run(
                        [*base, "capture-pane", "-p", "-J", "-S", "-"], capture_output=True, text=True, check=True,
                        timeout=30,
                    ).stdout  # fmt: skip
                break
            if time.monotonic() > deadline:
                sys.exit(f"make_docs_screens: {' '.join(argv[3:])} never finished; it shows:\n{screen}")
            time.sleep(0.2)
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True, timeout=30, check=False)
        shutil.rmtree(done.parent, ignore_errors=True)
    return "\n".join(line.rstrip() for line in screen.rstrip().splitlines()).strip("\n")


def write(ctx: Context, name: str, shown: str, screen: str) -> None:
    """docs/snippets/NAME.txt: the command as typed, then its screen."""
    path = ctx.out / f"{name}.txt"
    path.write_text(f"$ {shown}\n{screen}\n", encoding="utf-8")
    print(f"wrote {path}")


def _sweeps_at_least(n: int, *, processes: bool) -> Callable[[str], bool]:
    def ready(screen: str) -> bool:
        sweeps = re.search(r"sweeps (\d+)", screen)
        shown = "└" in screen or "PROCESSES" in screen  # processes under their GPU, or on its line
        return sweeps is not None and int(sweeps.group(1)) >= n and (shown or not processes)

    return ready


# --- the screens --------------------------------------------------------------------------------------------


def stream(ctx: Context) -> None:
    argv = ctx.smiquery("stream", "--interval", "500ms")
    screen = terminal(argv, width=110, height=26, ready=_sweeps_at_least(6, processes=True))
    write(ctx, "stream", "smiquery stream --interval 500ms", screen)
    if ctx.out == SNIPPETS:  # the README shows the same screen, between its live-view markers
        readme = ROOT / "README.md"
        text = readme.read_text(encoding="utf-8")
        head, rest = text.split(README_BEGIN, 1)
        _, tail = rest.split(README_END, 1)
        shown = (ctx.out / "stream.txt").read_text(encoding="utf-8").rstrip("\n")
        readme.write_text(f"{head}{README_BEGIN}\n```\n{shown}\n```\n{README_END}{tail}", encoding="utf-8")
        print(f"wrote {readme}")


def query(ctx: Context) -> None:
    write(ctx, "query", "smiquery query", terminal(ctx.smiquery("query")))


def query_json(ctx: Context) -> None:
    screen = terminal(ctx.smiquery("query", "--id", "0", "--format", "json"))
    write(ctx, "query-json", "smiquery query --id 0 --format json", screen)


def ps(ctx: Context) -> None:
    write(ctx, "ps", "smiquery ps", terminal(ctx.smiquery("ps")))


def ps_watch(ctx: Context) -> None:
    def ready(screen: str) -> bool:
        return screen.count("python") >= 8

    screen = terminal(ctx.smiquery("ps", "--watch"), ready=ready)
    write(ctx, "ps-watch", "smiquery ps --watch", screen)


def fields(ctx: Context) -> None:
    screen = terminal(ctx.smiquery("fields", "--search", "power.draw"))
    write(ctx, "fields", "smiquery fields --search power.draw", screen)


def doctor(ctx: Context) -> None:
    screen = terminal(ctx.smiquery("doctor"))
    write(ctx, "doctor", "smiquery doctor", screen)


def inspect(ctx: Context) -> None:
    screen = terminal(ctx.smiquery("inspect", "--id", "0"))
    write(ctx, "inspect", "smiquery inspect --id 0", screen)


def report(ctx: Context) -> None:
    screen = terminal([sys.executable, "-m", "smiquery", "report", str(DEMO.relative_to(ROOT))])
    write(ctx, "report", "smiquery report smiquery/data/demo-8gpu.csv", screen)


def export(ctx: Context) -> None:
    """The exporter's log and a few of its series, as a scrape sees them."""
    with socket_port() as port:
        argv = ctx.smiquery("export", "--interval", "1", "--port", str(port))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        try:
            body = ""
            deadline = time.monotonic() + 60
            while "smiquery_temperature_gpu_celsius{" not in body:
                if time.monotonic() > deadline:
                    sys.exit("make_docs_screens: the exporter never served GPU series")
                time.sleep(0.5)
                with contextlib.suppress(OSError):
                    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        finally:
            proc.terminate()
            log, _ = proc.communicate(timeout=30)
    wanted = ("smiquery_up", "smiquery_gpu_info", "smiquery_temperature_gpu_celsius", "smiquery_memory_used_bytes",
              "smiquery_power_draw_watts", "smiquery_utilization_gpu_ratio")  # fmt: skip
    shown = []
    for line in body.splitlines():
        name = line.split()[2] if line.startswith("# ") else re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in wanted and (line.startswith("#") or 'gpu="0"' in line or "{" not in line):
            shown.append(line)
    logged = "\n".join(log.splitlines()[:2]).replace(f":{port}/", ":9849/")
    write(ctx, "export-log", "smiquery export --interval 1", logged)
    curl = "curl -s 127.0.0.1:9849/metrics   # GPU 0's series of a few families"
    write(ctx, "export-metrics", curl, "\n".join(shown))


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    yield port


def top(ctx: Context) -> None:
    from tests.fleet.fleetdata import SimGpu, backfill, started, tool, write_openmetrics

    prometheus, promtool = tool("prometheus"), tool("promtool")
    if prometheus is None or promtool is None:
        print("skipped top: prometheus and promtool are not installed (scripts/install-prometheus)")
        return
    gpus = [
        *(SimGpu("gpu-a01:9849", "smiquery", i, "busy", "team-nlp", "llm-train-0") for i in range(4)),
        *(SimGpu("gpu-a02:9849", "smiquery", i, p) for i, p in enumerate(("hot", "stall", "idle", "free"))),
        *(SimGpu("gpu-b01:9400", "dcgm", i, "busy", "team-vision", f"resnet-{i}") for i in range(2)),
        SimGpu("gpu-c01:9835", "nvidia_smi", 0, "lost"),
    ]
    step, samples = 15, 240
    end = int(time.time()) // step * step - 60
    start = end - (samples - 1) * step
    om = ctx.scratch / "fleet.om"
    with om.open("w", encoding="utf-8") as fh:
        write_openmetrics(fh, gpus, start, samples, step)
    backfill(promtool, om, ctx.scratch / "prom-data")
    with started(prometheus, ctx.scratch / "prom-data", ctx.scratch / "prom.log") as server:
        screen = terminal([sys.executable, "-m", "smiquery", "top", "-p", server.url, "--once"])
    write(
        ctx,
        "top",
        "smiquery top -p http://prometheus:9090 --once",
        screen.replace(server.url, "http://prometheus:9090"),
    )


def plot(ctx: Context) -> None:
    from smiquery.analysis import plot_recording

    fig = plot_recording(DEMO)
    path = ctx.images / "plot-demo.png"
    fig.savefig(path, dpi=fig.dpi, metadata={"Software": None})  # no version in the file: same plot, same bytes
    print(f"wrote {path}")


def report_html(ctx: Context) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("skipped report-html: chromium is not installed (scripts/install-chromium)")
        return
    page = ctx.scratch / "report.html"
    subprocess.run([sys.executable, "-m", "smiquery", "report", str(DEMO), "--html", str(page)], check=True,
                   capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    shot = ctx.images / "report-html.png"
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         f"--user-data-dir={ctx.scratch / 'chromium-profile'}", "--virtual-time-budget=5000",
         "--window-size=1200,1500", f"--screenshot={shot}", page.resolve().as_uri()],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    print(f"wrote {shot}")


SCREENS: dict[str, Callable[[Context], None]] = {
    "stream": stream,
    "query": query,
    "query-json": query_json,
    "ps": ps,
    "ps-watch": ps_watch,
    "fields": fields,
    "doctor": doctor,
    "inspect": inspect,
    "report": report,
    "export": export,
    "top": top,
    "plot": plot,
    "report-html": report_html,
}
#: the files each screen writes (the docs include nothing else from docs/snippets and docs/images)
WRITES = {
    "export": ("export-log.txt", "export-metrics.txt"),
    "plot": ("plot-demo.png",),
    "report-html": ("report-html.png",),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated screens (default: all)")
    ap.add_argument("--out", type=Path, help="write here instead of docs/snippets and docs/images")
    ap.add_argument("--list", action="store_true", help="list the screens and the files each writes")
    args = ap.parse_args()
    if args.list:
        for name in SCREENS:
            print(name, *WRITES.get(name, (f"{name}.txt",)))
        return 0
    names = args.only.split(",") if args.only else list(SCREENS)
    unknown = set(names) - set(SCREENS)
    if unknown:
        ap.error(f"no screen {', '.join(sorted(unknown))}; choose from {', '.join(SCREENS)}")
    out = args.out or SNIPPETS
    images = args.out or IMAGES
    out.mkdir(parents=True, exist_ok=True)
    images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smiquery-docs-") as scratch:
        ctx = Context(out, images, Path(scratch))
        for name in names:
            SCREENS[name](ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
