#!/usr/bin/env python3
"""Write docs/plot-demo.png, the plot the README shows: ``smiquery plot`` of the bundled demo recording.

The recording (smiquery/data/demo-8gpu.csv, from scripts/make_demo_recording.py) is an 8-GPU training run with
a warm-up, a stall of every GPU and GPU 5 running hot; the image is what ``smiquery plot`` draws of it with the
default fields and rules. Run again after a change to the plot: ``python scripts/make_docs_plot.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.analysis import plot_recording  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "plot-demo.png", help="the image to write")
    args = ap.parse_args()
    fig = plot_recording(ROOT / "smiquery" / "data" / "demo-8gpu.csv")
    # no software version in the file, so that the same plot writes the same bytes
    fig.savefig(args.out, dpi=fig.dpi, metadata={"Software": None})
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
