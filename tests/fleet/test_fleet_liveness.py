"""``smiquery top`` tells a node whose exporter is gone from a healthy one, when Prometheus kept its last samples.

A small fleet of its own, backfilled (so no staleness markers, as after a Prometheus restart), four nodes of two
GPUs at 15 s: one healthy with ``up`` 1, one whose samples stop 98 s before the moment looked at while its ``up``
turned 0 (down), one whose samples stop 4 minutes before it and that has no ``up`` at all (stale: a federated or
remote-written node), and one healthy without ``up``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import pytest

from smiquery.fleet import PrometheusClient, snapshot
from tests.exporter.test_rules import require_tool
from tests.fleet.fleetdata import FIELDS, METRICS, SimGpu, backfill, started
from tests.fleet.test_fleet import smiquery

pytestmark = pytest.mark.xdist_group("liveness")

STEP = 15
SAMPLES = 160  # 40 minutes: past top's 30-minute window
# instance -> (seconds before `at` of its last sample, its `up` after that: None for no `up` series at all)
NODES = {
    "ok-0:9849": (0, 1),
    "down-0:9849": (98, 0),
    "stale-0:9849": (240, None),
    "fresh-0:9849": (0, None),
}


@dataclass
class Live:
    url: str
    at: int


def write(out: IO[str], at: int) -> None:
    start = at - (SAMPLES - 1) * STEP
    gpus = [SimGpu(instance, "smiquery", i) for instance in NODES for i in range(2)]
    for col, fld in enumerate(FIELDS):
        name, factor = METRICS["smiquery"][fld]
        out.write(f"# TYPE {name} gauge\n")
        for g in gpus:
            gone = NODES[g.instance][0]
            labels = f'instance="{g.instance}",job="smiquery",gpu="{g.index}",uuid="{g.uuid}",name="{g.name}"'
            for i in range(SAMPLES):
                out.write(f"{name}{{{labels}}} {g.values(i, SAMPLES)[col] * factor!r} {start + i * STEP - gone}\n")
    out.write("# TYPE up gauge\n")
    for instance, (gone, up) in NODES.items():
        if up is None:
            continue
        for i in range(SAMPLES):
            t = start + i * STEP
            out.write(f'up{{instance="{instance}",job="smiquery"}} {1 if t <= at - gone else up} {t}\n')
    out.write("# EOF\n")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    promtool = require_tool("promtool")
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("liveness")
    at = int(time.time()) // STEP * STEP - 5 * 60
    om = tmp / "live.om"
    with om.open("w", encoding="utf-8") as fh:
        write(fh, at)
    backfill(promtool, om, tmp / "data")
    with started(prometheus, tmp / "data", tmp / "prom.log") as server:
        yield Live(server.url, at)


def states(rows: list[dict[str, Any]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in rows:
        out.setdefault(r["instance"], set()).add(r["state"])
    return out


VALUES = ("utilization.gpu", "memory.used", "memory.total", "temperature.gpu", "power.draw")
EXPECTED = {"ok-0:9849": {"ok"}, "down-0:9849": {"down"}, "stale-0:9849": {"stale"}, "fresh-0:9849": {"ok"}}


def test_down_and_stale_gpus_show_no_values(live):
    gpus = snapshot(PrometheusClient(live.url), at=live.at)
    rows = [g.to_dict() for g in gpus]
    assert len(rows) == 8
    assert states(rows) == EXPECTED
    for r in rows:
        gone = r["state"] in ("down", "stale")
        assert all((r[v] is None) == gone for v in VALUES), r
    ok = next(g for g in gpus if g.instance == "ok-0:9849")
    assert ok.utilization is not None and 60 <= ok.utilization <= 90
    assert not any(g.lost or g.idle for g in gpus)


def test_stale_after_moves_the_line(live):
    lenient = snapshot(PrometheusClient(live.url), at=live.at, stale_after=300)
    assert states([g.to_dict() for g in lenient])["stale-0:9849"] == {"ok"}  # 240 s old, under 300
    strict = snapshot(PrometheusClient(live.url), at=live.at, node="fresh-0:.*", stale_after=1)
    assert {g.state for g in strict} == {"ok"}  # its newest sample is at `at` itself


def test_node_regex_is_honoured_for_up(live):
    gpus = snapshot(PrometheusClient(live.url), at=live.at, node="down-0:.*")
    assert [g.state for g in gpus] == ["down", "down"]


def test_top_command_counts_and_marks_them(live):
    t = ["top", "-p", live.url, "--once", "--at", str(live.at)]
    rows = json.loads(smiquery(*t, "--format", "json").stdout)
    assert states(rows) == EXPECTED
    assert all(r["utilization.gpu"] is None for r in rows if r["instance"] in ("down-0:9849", "stale-0:9849"))
    csv_states = [line.rsplit(",", 1)[1] for line in smiquery(*t, "--format", "csv").stdout.splitlines()[1:]]
    assert sorted(csv_states) == ["down"] * 2 + ["ok"] * 4 + ["stale"] * 2
    table = smiquery(*t).stdout.splitlines()
    assert table[-1] == "8 GPUs, 0 idle, 0 lost, 2 down, 2 stale"
    down = [line for line in table if line.startswith("down-0:9849")]
    assert len(down) == 2 and all("DOWN" in line and "n/a" in line for line in down)
    assert sum("STALE" in line for line in table) == 2
