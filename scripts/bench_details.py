#!/usr/bin/env python3
"""Benchmark ``smiquery.sources.details.parse_xml`` against a bare ElementTree parse of the same bytes, in one process.

For each document (the corpus's ``-q -x`` captures, read in place from ../shared/nvsmi-corpus/xml, and an 8-GPU
document made by repeating the A100 MIG capture's GPU eight times, the size of a real 8-GPU server's output) it
prints the time per GPU of ``parse_xml`` (typed records) and of ``xml.etree.ElementTree.fromstring`` (an untyped
tree), and their ratio. Rounds alternate between the two sides (best of ``--rounds``), so a busy moment on a shared
machine does not count against one side only. Target: the typed parse costs at most 3x the bare parse.

Then the exporter's scrape with details on vs off, in the same run: two exporters over the in-process fake (the
A100 MIG capture as ``-q -x``), one with ``--details-interval`` and ``--kernel-log`` (a file holding Xid lines),
one without; rounds alternate between them. Timed: ``exposition()`` (what ``/metrics`` runs; the per-sweep text is
cached, so this is the per-scrape cost) and ``collect()`` (every family built anew, the cost once per sweep).
Target: details on costs at most 1.5x off for either. The ``-q -x`` poll itself runs in its own thread and never
on a scrape.

Usage: ``python scripts/bench_details.py [--rounds N]``. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smiquery.sources.details import parse_xml  # noqa: E402

CORPUS = ROOT.parent / "shared" / "nvsmi-corpus" / "xml"
FIXTURE = ROOT / "tests" / "fixtures" / "details-2gpu-mig.xml"
TARGET = 3.0
SCRAPE_TARGET = 1.5


def _eight_gpus(text: str) -> str:
    m = re.search(r"\s*<gpu id=.*?</gpu>", text, re.DOTALL)
    assert m is not None
    return text[: m.start()] + m.group(0) * 8 + text[m.end() :]


def _best(fn: Callable[[bytes], object], data: bytes, rounds: int, inner: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn(data)
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    docs: list[tuple[str, bytes]] = []
    if CORPUS.is_dir():
        docs = [(p.name, p.read_bytes()) for p in sorted(CORPUS.glob("*.xml"))]
        mig = (CORPUS / "netdata__a100-sxm4-mig.xml").read_text()
        docs.append(("8x a100-sxm4-mig (made)", _eight_gpus(mig).encode()))
    else:
        print(f"corpus not at {CORPUS}: the fixture only")
        docs = [(FIXTURE.name, FIXTURE.read_bytes()), ("8x fixture (made)", _eight_gpus(FIXTURE.read_text()).encode())]
    warnings.simplefilter("ignore", UserWarning)  # captures naming no DTD warn once; not what is timed
    worst = 0.0
    total_ours = total_base = 0.0
    print(f"{'document':44s} {'GPUs':>4s} {'KiB':>6s} {'parse_xml/GPU':>14s} {'ET/GPU':>10s} {'ratio':>6s}")
    for name, data in docs:
        ngpu = len(parse_xml(data))
        inner = max(1, int(2e6 // max(len(data), 1)))
        ours = base = float("inf")
        for _ in range(args.rounds):  # alternate sides round by round
            base = min(base, _best(ET.fromstring, data, 1, inner))
            ours = min(ours, _best(parse_xml, data, 1, inner))
        ratio = ours / base
        worst = max(worst, ratio)
        total_ours += ours
        total_base += base
        print(
            f"{name[:44]:44s} {ngpu:4d} {len(data) / 1024:6.1f} {ours / ngpu * 1e3:11.3f} ms "
            f"{base / ngpu * 1e3:7.3f} ms {ratio:5.2f}x"
        )
    overall = total_ours / total_base
    print(
        f"all documents: parse_xml {total_ours * 1e3:.1f} ms vs ElementTree {total_base * 1e3:.1f} ms: {overall:.2f}x"
    )
    print(f"worst document: {worst:.2f}x (target <= {TARGET:.1f}x)")
    scrape_ok = _bench_scrape(args.rounds)
    return 0 if worst <= TARGET and scrape_ok else 1


def _calling(fn: Callable[[], object]) -> Callable[[bytes], object]:
    def call(_data: bytes) -> object:
        out = fn()
        return out if isinstance(out, bytes) else list(cast("Iterable[object]", out))  # run collect() through

    return call


def _bench_scrape(rounds: int) -> bool:
    import tempfile

    from smiquery.exporter import serve
    from smiquery.testing import InProcessRunner, use_runner

    xml = CORPUS / "netdata__a100-sxm4-mig.xml"
    if not xml.is_file():
        xml = FIXTURE
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "kern.log"
        log.write_text(
            "".join(
                f"[ {100 + i}.000001] NVRM: Xid (PCI:0000:00:04): {code}, pid={i}, x\n"
                for i, code in enumerate((13, 31, 43, 79, 48, 94))
            )
        )
        with use_runner(InProcessRunner(env={"SMIQUERY_FAKE_XML": str(xml)})):
            # a slow interval: few new sweeps while timing, and the best round is one without
            on = serve(port=0, interval=5, details_interval=3600, kernel_log=str(log))
            off = serve(port=0, interval=5)
            try:
                deadline = time.monotonic() + 60
                while not (
                    on.collector.details is not None
                    and on.collector.details.fresh() is not None
                    and on.collector.xid is not None
                    and on.collector.xid.events == 6
                    and on.collector.health()[0]  # both up with fresh data: the same GPU series on each side
                    and off.collector.health()[0]
                ):
                    if time.monotonic() > deadline:
                        print("the exporters did not get their first samples in 60 s")
                        return False
                    time.sleep(0.05)
                assert b"smiquery_mig_memory_used_bytes" in on.collector.exposition()
                ok = True
                print(f"\n{'exporter scrape':44s} {'details on':>12s} {'off':>12s} {'ratio':>6s}")
                for what, method in (
                    ("exposition() (each scrape)", "exposition"),
                    ("collect() (each new sweep)", "collect"),
                ):
                    t_on = t_off = float("inf")
                    run_on = getattr(on.collector, method)
                    run_off = getattr(off.collector, method)
                    for _ in range(rounds):
                        t_off = min(t_off, _best(_calling(run_off), b"", 1, 200))
                        t_on = min(t_on, _best(_calling(run_on), b"", 1, 200))
                    ratio = t_on / t_off
                    ok = ok and ratio <= SCRAPE_TARGET
                    print(f"{what:44s} {t_on * 1e6:9.1f} us {t_off * 1e6:9.1f} us {ratio:5.2f}x")
                print(f"target: details on <= {SCRAPE_TARGET:.1f}x off")
                return ok
            finally:
                on.stop()
                off.stop()


if __name__ == "__main__":
    sys.exit(main())
