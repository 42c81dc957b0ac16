"""A series that held one value over a chunk is read as its count and value, never as a guess.

A fleet of its own, backfilled, one node of four GPUs and a second exporter, an hour at 15 s:
- GPU 0 is plain: its memory size, memory use and memory utilisation never change (read without their samples);
- GPU 1's memory size is missing from every tenth scrape (same value otherwise: its own samples are read, and the
  missing ones stay missing);
- GPU 2's memory utilisation is NaN once in the middle (not steady);
- GPU 3 is exported twice, by this node's exporter and by ``twin-0:9849`` (the same UUID): its memory use is steady
  on one and changes on the other, so neither is taken for the other.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import pytest

import smiquery.fleet.history
from smiquery.fleet import PrometheusClient, fleet_frame
from smiquery.fleet.naming import EXTRA_FIELDS, FLEET_FIELDS
from tests.exporter.test_rules import require_tool
from tests.fleet.fleetdata import FIELDS, METRICS, SimGpu, backfill, started

pytestmark = pytest.mark.xdist_group("steady")

STEP = 15
N = 240


@dataclass
class Steady:
    url: str
    start: int
    end: int


def value(fld: str, gpu: int, i: int) -> float | None:
    if fld == "utilization.gpu":
        return float(40 + (i * 7 + gpu) % 50)
    if fld == "temperature.gpu":
        return float(50 + i % 9)
    if fld == "power.draw":
        return 200.5 + i % 13
    if fld == "memory.total":
        return None if gpu == 1 and i % 10 == 5 else 81559.0
    if fld == "utilization.memory":
        return float("nan") if gpu == 2 and i == N // 2 else 30.0
    return 30000.0  # memory.used


def write(out: IO[str], start: int) -> None:
    gpus = [SimGpu("node-0:9849", "smiquery", g) for g in range(4)]
    for fld in FIELDS:
        name, factor = METRICS["smiquery"][fld]
        out.write(f"# TYPE {name} gauge\n")
        for g in gpus:
            labels = f'gpu="{g.index}",instance="{g.instance}",job="smiquery",name="{g.name}",uuid="{g.uuid}"'
            for i in range(N):
                v = value(fld, g.index, i)
                if v is not None:
                    out.write(f"{name}{{{labels}}} {v * factor!r} {start + i * STEP}\n")
            if g.index == 3 and fld in ("utilization.gpu", "memory.used"):  # the same GPU from a second exporter
                twin = labels.replace('instance="node-0:9849"', 'instance="twin-0:9849"')
                for i in range(N):
                    v = value(fld, 3, i) if fld == "utilization.gpu" else 30000.0 + i % 4
                    out.write(f"{name}{{{twin}}} {v * factor!r} {start + i * STEP}\n")
    out.write("# EOF\n")


@pytest.fixture(scope="module")
def steady(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Steady]:
    promtool = require_tool("promtool")
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("steady")
    end = int(time.time()) // STEP * STEP - 5 * 60
    start = end - (N - 1) * STEP
    om = tmp / "steady.om"
    with om.open("w", encoding="utf-8") as fh:
        write(fh, start)
    backfill(promtool, om, tmp / "data")
    with started(prometheus, tmp / "data", tmp / "prom.log") as server:
        yield Steady(server.url, start, end)


class Recording(PrometheusClient):
    """Remembers which series' samples the server sent."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent: list[tuple[str, str]] = []  # (metric, uuid) of each series sent sample by sample

    def samples(self, raw: bytes, expr: str) -> list[tuple[dict[str, str], Any, Any]]:
        got = super().samples(raw, expr)
        metric = re.match(r"[a-z_]+", expr).group(0)  # type: ignore[union-attr]
        self.sent += [(metric, labels.get("uuid", "")) for labels, _, _ in got]
        return got


def frames(url: str, start: int, end: int, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[Any, Any, Recording]:
    client = Recording(url)
    fast = fleet_frame(client, start, end, **kw)
    with monkeypatch.context() as m:  # every series sample by sample
        m.setattr(smiquery.fleet.history, "_VARYING", ("utilization.gpu", *FLEET_FIELDS, *EXTRA_FIELDS))
        raw = fleet_frame(PrometheusClient(url), start, end, **kw)
    return fast, raw, client


def test_steady_series_give_the_frame_their_samples_give(steady, monkeypatch):
    import pandas as pd

    fast, raw, client = frames(steady.url, steady.start, steady.end, monkeypatch)
    pd.testing.assert_frame_equal(fast, raw)
    uuids = [SimGpu("node-0:9849", "smiquery", g).uuid for g in range(4)]
    sent = set(client.sent)
    # GPU 0's steady series came as a count and a value; the changing ones sample by sample
    for fld in ("memory.total", "memory.used", "utilization.memory"):
        assert (METRICS["smiquery"][fld][0], uuids[0]) not in sent, fld
    for fld in ("utilization.gpu", "temperature.gpu", "power.draw"):
        assert (METRICS["smiquery"][fld][0], uuids[0]) in sent, fld
    assert ("smiquery_memory_total_bytes", uuids[1]) in sent  # not in every scrape
    assert ("smiquery_utilization_memory_ratio", uuids[2]) in sent  # a NaN
    assert ("smiquery_memory_used_bytes", uuids[3]) in sent  # two series of one UUID


def test_a_value_missing_from_some_scrapes_stays_missing(steady, monkeypatch):
    fast, _, _ = frames(steady.url, steady.start, steady.end, monkeypatch)
    gpu1 = fast[fast["index"] == 1].reset_index(drop=True)
    assert len(gpu1) == N
    missing = gpu1["memory_total"].isna()
    assert list(missing[missing].index) == [i for i in range(N) if i % 10 == 5]
    assert set(gpu1["memory_total"].dropna()) == {81559}
    gpu2 = fast[fast["index"] == 2].reset_index(drop=True)
    assert gpu2["utilization_memory"].isna().sum() == 1
    gpu0 = fast[fast["index"] == 0]
    assert gpu0["memory_total"].notna().all() and set(gpu0["memory_total"]) == {81559}


def test_chunks_and_a_node_filter_keep_the_same_frame(steady, monkeypatch):
    import pandas as pd

    fast, raw, _ = frames(steady.url, steady.start, steady.end, monkeypatch, max_points=37, node="node-0:.*")
    pd.testing.assert_frame_equal(fast, raw)
    assert set(fast["instance"]) == {"node-0:9849"}
