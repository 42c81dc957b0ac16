"""The fleet tests' engines: three hours of twelve GPUs on six nodes (each naming twice), backfilled into
Prometheus, and imported into VictoriaMetrics for the tests that compare the two."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.exporter.test_exporter import pki  # noqa: F401  (a throwaway CA and server certificate, for TLS)
from tests.exporter.test_rules import require_tool
from tests.fleet.fleetdata import (
    SimGpu,
    backfill,
    fleet_spec,
    started,
    started_vm,
    write_openmetrics,
    write_recording,
)

STEP = 15
SAMPLES = 720  # three hours


@dataclass
class Fleet:
    url: str
    gpus: list[SimGpu]  # every GPU once (the recording holds these)
    start: int
    end: int  # the last sample's time
    recording: Path
    openmetrics: Path


@pytest.fixture(scope="package")  # stopped with the last fleet test: no Prometheus outlives them
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    promtool = require_tool("promtool")
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("fleet")
    gpus = fleet_spec(6, 2)
    # node-00's GPU 0 is also exported by a dcgm-exporter on the same host: the same UUID, to be listed once
    twin = SimGpu("node-00:9400", "dcgm", 0, "busy")
    assert twin.uuid == gpus[0].uuid
    end = int(time.time()) // STEP * STEP - 5 * 60
    start = end - (SAMPLES - 1) * STEP
    om = tmp / "fleet.om"
    with om.open("w", encoding="utf-8") as fh:
        write_openmetrics(fh, [*gpus, twin], start, SAMPLES, STEP)
    recording = tmp / "fleet.csv"
    write_recording(recording, gpus, start, SAMPLES, STEP)
    backfill(promtool, om, tmp / "data")
    with started(prometheus, tmp / "data", tmp / "prom.log") as server:
        yield Fleet(server.url, gpus, start, end, recording, om)


@pytest.fixture(scope="package")
def vm_fleet(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The same fleet in VictoriaMetrics (the second engine), on 127.0.0.1, stopped with the last fleet test."""
    binary = shutil.which("victoria-metrics")
    if binary is None:
        why = "victoria-metrics is not installed (scripts/install-victoria-metrics, run by `make tools`)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("vm")
    with started_vm(binary, fleet.openmetrics, tmp / "data", tmp / "vm.log") as server:
        yield Fleet(server.url, fleet.gpus, fleet.start, fleet.end, fleet.recording, fleet.openmetrics)
