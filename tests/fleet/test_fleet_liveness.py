"""``smiquery top`` tells a node whose exporter is gone from a healthy one, when Prometheus kept its last samples.

A small fleet of its own, backfilled (so no staleness markers, as after a Prometheus restart), five nodes of two
GPUs at 15 s: one healthy with ``up`` 1, one whose samples stop 98 s before the moment looked at while its ``up``
turned 0 (down), one whose samples stop 4 minutes before it and that has no ``up`` at all (stale: a federated or
remote-written node), one healthy without ``up``, and one scraped every 60 s by a job of its own whose newest sample
is 100 s old (one scrape late: not stale, as its own interval says).
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
MINUTES = 40  # past top's 30-minute window
# instance -> (job, seconds between samples, seconds before `at` of its last sample, its `up` after that: None for
# no `up` series at all)
NODES = {
    "ok-0:9849": ("smiquery", STEP, 0, 1),
    "down-0:9849": ("smiquery", STEP, 98, 0),
    "stale-0:9849": ("smiquery", STEP, 240, None),
    "fresh-0:9849": ("smiquery", STEP, 0, None),
    "slow-0:9849": ("slow", 60, 100, None),
}


@dataclass
class Live:
    url: str
    at: int


def write(out: IO[str], at: int) -> None:
    gpus = [SimGpu(instance, "smiquery", i) for instance in NODES for i in range(2)]
    for col, fld in enumerate(FIELDS):
        name, factor = METRICS["smiquery"][fld]
        out.write(f"# TYPE {name} gauge\n")
        for g in gpus:
            job, step, gone, _ = NODES[g.instance]
            labels = f'instance="{g.instance}",job="{job}",gpu="{g.index}",uuid="{g.uuid}",name="{g.name}"'
            n = MINUTES * 60 // step
            for i in range(n):
                t = at - gone - (n - 1 - i) * step
                out.write(f"{name}{{{labels}}} {g.values(i, n)[col] * factor!r} {t}\n")
    out.write("# TYPE up gauge\n")
    for instance, (job, step, gone, up) in NODES.items():
        n = MINUTES * 60 // step
        for t in range(at - (n - 1) * step, at + 1, step) if up is not None else ():
            out.write(f'up{{instance="{instance}",job="{job}"}} {1 if t <= at - gone else up} {t}\n')
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
EXPECTED = {
    "ok-0:9849": {"ok"},
    "down-0:9849": {"down"},
    "stale-0:9849": {"stale"},
    "fresh-0:9849": {"ok"},
    "slow-0:9849": {"ok"},
}


def test_down_and_stale_gpus_show_no_values(live):
    gpus = snapshot(PrometheusClient(live.url), at=live.at)
    rows = [g.to_dict() for g in gpus]
    assert len(rows) == 10
    assert states(rows) == EXPECTED
    for r in rows:
        gone = r["state"] in ("down", "stale")
        assert all((r[v] is None) == gone for v in VALUES), r
    ok = next(g for g in gpus if g.instance == "ok-0:9849")
    assert ok.utilization is not None and 60 <= ok.utilization <= 90
    assert not any(g.lost or g.idle for g in gpus)


def test_stale_after_moves_the_line(live):
    slow = snapshot(PrometheusClient(live.url), at=live.at, node="slow-0:.*", stale_after=60)
    assert {g.state for g in slow} == {"stale"}  # 100 s old: stale at 60 s, not at its job's 3 x 60 s
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
    assert sorted(csv_states) == ["down"] * 2 + ["ok"] * 6 + ["stale"] * 2
    table = smiquery(*t).stdout.splitlines()
    assert table[-1] == "10 GPUs, 0 idle, 0 lost, 2 down, 2 stale"
    down = [line for line in table if line.startswith("down-0:9849")]
    assert len(down) == 2 and all("DOWN" in line and "n/a" in line for line in down)
    assert sum("STALE" in line for line in table) == 2
