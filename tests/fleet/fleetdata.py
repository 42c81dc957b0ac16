"""A simulated fleet's history, written twice: as OpenMetrics for ``promtool tsdb create-blocks-from openmetrics``
(in the naming of each node's exporter) and as nvidia-smi CSV recordings of the same samples; and a real
Prometheus server over the backfilled blocks, on 127.0.0.1, stopped by whoever started it.

Profiles: ``busy``, ``hot`` (91 C at full load), ``idle`` (0 % while holding memory the whole time), ``free``
(0 %, no memory held), ``stall`` (a 10-minute stall in the middle), ``lost`` (stops reporting 10 minutes before
the end). Also used by scripts/bench_fleet.py for the big fleets.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

MiB = 1048576

CSV_HEADER = (
    "timestamp, index, uuid, name, utilization.gpu [%], utilization.memory [%], memory.used [MiB], "
    "memory.total [MiB], temperature.gpu, power.draw [W]"
)
# metric name and factor from nvidia-smi's unit, per naming (what each exporter writes)
METRICS = {
    "smiquery": {
        "utilization.gpu": ("smiquery_utilization_gpu_ratio", 0.01),
        "utilization.memory": ("smiquery_utilization_memory_ratio", 0.01),
        "memory.used": ("smiquery_memory_used_bytes", MiB),
        "memory.total": ("smiquery_memory_total_bytes", MiB),
        "temperature.gpu": ("smiquery_temperature_gpu_celsius", 1),
        "power.draw": ("smiquery_power_draw_watts", 1),
    },
    "dcgm": {
        "utilization.gpu": ("DCGM_FI_DEV_GPU_UTIL", 1),
        "utilization.memory": ("DCGM_FI_DEV_MEM_COPY_UTIL", 1),
        "memory.used": ("DCGM_FI_DEV_FB_USED", 1),
        "memory.total": ("DCGM_FI_DEV_FB_TOTAL", 1),
        "temperature.gpu": ("DCGM_FI_DEV_GPU_TEMP", 1),
        "power.draw": ("DCGM_FI_DEV_POWER_USAGE", 1),
    },
    "nvidia_smi": {
        "utilization.gpu": ("nvidia_smi_utilization_gpu_ratio", 0.01),
        "utilization.memory": ("nvidia_smi_utilization_memory_ratio", 0.01),
        "memory.used": ("nvidia_smi_memory_used_bytes", MiB),
        "memory.total": ("nvidia_smi_memory_total_bytes", MiB),
        "temperature.gpu": ("nvidia_smi_temperature_gpu", 1),
        "power.draw": ("nvidia_smi_power_draw_watts", 1),
    },
}
FIELDS = tuple(METRICS["smiquery"])


@dataclass(frozen=True)
class SimGpu:
    instance: str
    naming: str
    index: int
    profile: str = "busy"
    namespace: str = ""
    pod: str = ""

    @property
    def uuid(self) -> str:
        host = self.instance.split(":")[0]
        return f"GPU-{zlib.crc32(f'{host}/{self.index}'.encode()):08x}-{host}-{self.index}"

    @property
    def name(self) -> str:
        return "NVIDIA H100 80GB HBM3"

    def last_sample(self, n: int) -> int:
        return n - 41 if self.profile == "lost" else n - 1

    def values(self, i: int, n: int) -> tuple[int, int, int, int, int, float]:
        """utilization.gpu, utilization.memory, memory.used, memory.total, temperature.gpu, power.draw."""
        wobble = (i * 7 + self.index * 3) % 30
        total = 81559
        if self.profile == "hot":
            return 100, 80, 70000, total, 91, 690.0 + (i % 5)
        if self.profile == "idle":
            return 0, 0, 20000, total, 35, 70.5
        if self.profile == "free":
            return 0, 0, 0, total, 30, 60.0
        if self.profile == "stall" and n // 2 <= i < n // 2 + 40:
            return 2, 0, 30000, total, 40, 90.0
        return 60 + wobble, 30, 30000, total, 60 + wobble // 6, 250.5 + wobble


def fleet_spec(nodes: int, gpus: int) -> list[SimGpu]:
    """``nodes`` nodes of ``gpus`` GPUs, the namings taking turns, every profile somewhere once."""
    namings = ("smiquery", "dcgm", "nvidia_smi")
    port = {"smiquery": 9849, "dcgm": 9400, "nvidia_smi": 9835}
    out: list[SimGpu] = []
    special = ["hot", "idle", "free", "stall", "lost"]
    for k in range(nodes):
        naming = namings[k % 3]
        for g in range(gpus):
            profile = special.pop(0) if special and g == gpus - 1 else "busy"
            ns, pod = ("", "")
            if naming == "dcgm":
                ns, pod = ("research", f"notebook-{k}") if profile == "idle" else ("train", f"job-{k}-{g}")
            out.append(SimGpu(f"node-{k:02d}:{port[naming]}", naming, g, profile, ns, pod))
    return out


def _labels(g: SimGpu) -> str:
    if g.naming == "dcgm":
        pairs = [("gpu", str(g.index)), ("UUID", g.uuid), ("modelName", g.name), ("Hostname", g.instance[:7])]
        if g.pod:
            pairs += [("namespace", g.namespace), ("pod", g.pod), ("container", "main")]
    elif g.naming == "nvidia_smi":
        pairs = [("uuid", g.uuid)]
    else:
        pairs = [("gpu", str(g.index)), ("uuid", g.uuid), ("name", g.name)]
    pairs = [("instance", g.instance), ("job", g.naming), *pairs]
    return ",".join(f'{k}="{v}"' for k, v in pairs)


def _num(v: float) -> str:
    return repr(float(v)) if not float(v).is_integer() else str(int(v)) if abs(v) < 1e15 else repr(float(v))


def write_openmetrics(out: IO[str], gpus: Sequence[SimGpu], start: int, n: int, step: int) -> None:
    """Every GPU's samples at ``start + i * step`` (seconds), in its exporter's naming, and the ALERTS firing."""
    for fld in FIELDS:
        for naming in ("smiquery", "dcgm", "nvidia_smi"):
            members = [g for g in gpus if g.naming == naming]
            if not members:
                continue
            name, factor = METRICS[naming][fld]
            out.write(f"# TYPE {name} gauge\n")
            col = FIELDS.index(fld)
            for g in members:
                labels = _labels(g)
                for i in range(g.last_sample(n) + 1):
                    out.write(f"{name}{{{labels}}} {_num(g.values(i, n)[col] * factor)} {start + i * step}\n")
    info = [g for g in gpus if g.naming == "nvidia_smi"]
    if info:
        out.write("# TYPE nvidia_smi_gpu_info gauge\n")
        for g in info:
            labels = f'instance="{g.instance}",job="nvidia_smi",uuid="{g.uuid}",index="{g.index}",name="{g.name}"'
            for i in range(g.last_sample(n) + 1):
                out.write(f"nvidia_smi_gpu_info{{{labels}}} 1 {start + i * step}\n")
    hot = [g for g in gpus if g.profile == "hot"]
    if hot:
        # what the server's rules would keep firing: the hot GPUs over the last 30 minutes
        out.write("# TYPE ALERTS gauge\n")
        for g in hot:
            ident = f'gpu="{g.index}",uuid="{g.uuid}"'
            labels = f'alertname="GpuTemperatureCritical",alertstate="firing",instance="{g.instance}",{ident}'
            for i in range(max(0, n - 120), n):
                out.write(f"ALERTS{{{labels}}} 1 {start + i * step}\n")
    out.write("# EOF\n")


def fleet_order(gpus: Sequence[SimGpu]) -> list[SimGpu]:
    """The GPUs in the order the fleet frame numbers them: by instance, then GPU index."""
    return sorted(gpus, key=lambda g: (g.instance, g.index))


def write_recording(path: Path, gpus: Sequence[SimGpu], start: int, n: int, step: int) -> None:
    """The same samples as one nvidia-smi CSV (UTC times), GPUs numbered as the fleet frame numbers them."""
    ordered = fleet_order(gpus)
    with path.open("w", encoding="utf-8") as fh:
        fh.write(CSV_HEADER + "\n")
        for i in range(n):
            stamp = datetime.fromtimestamp(start + i * step, timezone.utc).strftime("%Y/%m/%d %H:%M:%S.000")
            for k, g in enumerate(ordered):
                if i > g.last_sample(n):
                    continue
                u, um, used, total, temp, power = g.values(i, n)
                fh.write(
                    f"{stamp}, {k}, {g.uuid}, {g.name}, {u} %, {um} %, {used} MiB, {total} MiB, {temp}, {power:.2f} W\n"
                )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PromServer:
    """A Prometheus over a data directory of backfilled blocks, on 127.0.0.1 and a free port."""

    def __init__(self, prometheus: str, data: Path, log: Path, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = data.parent / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n", encoding="utf-8")
        self._log = log.open("w")
        argv = [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=3650d",
            *extra,
        ]
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.popen.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def backfill(promtool: str, openmetrics: Path, data: Path, max_block: str | None = None) -> None:
    """``promtool tsdb create-blocks-from openmetrics`` into ``data`` (Prometheus' --storage.tsdb.path).

    ``max_block`` (e.g. ``24h``): blocks that long, as a server's compaction makes them; promtool reads the input
    once per block, so a week in the default 2 h blocks takes 84 passes.
    """
    data.mkdir(parents=True, exist_ok=True)
    flags = [f"--max-block-duration={max_block}"] if max_block else []
    done = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", *flags, str(openmetrics), str(data)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise AssertionError(f"promtool failed ({done.returncode}): {done.stderr[-3000:]}")


@contextlib.contextmanager
def started(prometheus: str, data: Path, log: Path) -> Iterator[PromServer]:
    """A running server over ``data``; stopped when the generator is closed."""
    server = PromServer(prometheus, data, log)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


class VmServer:
    """A single-node VictoriaMetrics on 127.0.0.1 and a free port, holding the samples of an OpenMetrics file."""

    def __init__(self, binary: str, data: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("w")
        argv = [
            binary,
            f"-storageDataPath={data}",
            f"-httpListenAddr=127.0.0.1:{self.port}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",  # what was imported is there at once, not 30 s later
        ]
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        self.log = log

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(
                    f"victoria-metrics exited {self.popen.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"victoria-metrics not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def load(self, openmetrics: Path) -> None:
        """Import the file's samples (its seconds as the text format's milliseconds) and flush them to search."""
        lines = []
        for line in openmetrics.read_text(encoding="utf-8").splitlines():
            if not line or line.startswith("#"):
                continue
            head, value, stamp = line.rsplit(" ", 2)
            lines.append(f"{head} {value} {round(float(stamp) * 1000)}")
        body = ("\n".join(lines) + "\n").encode()
        request = urllib.request.Request(self.url + "/api/v1/import/prometheus", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status in (200, 204), r.status
        with urllib.request.urlopen(self.url + "/internal/force_flush", timeout=60) as r:
            assert r.status == 200

    def stop(self) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


@contextlib.contextmanager
def started_vm(binary: str, openmetrics: Path, data: Path, log: Path) -> Iterator[VmServer]:
    """A running VictoriaMetrics holding ``openmetrics``' samples; stopped when the generator is closed."""
    server = VmServer(binary, data, log)
    try:
        server.wait_ready()
        server.load(openmetrics)
        yield server
    finally:
        server.stop()


def tool(name: str) -> str | None:
    return shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)


_NAME_KEYS = ("index", "instance", "uuid", "node", "pod", "job")


def unnamed(doc: dict[str, Any]) -> dict[str, Any]:
    """A fleet report's JSON as a recording's: each GPU reference back to the report's number, verdicts left out."""

    def number(ref: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in ref.items() if k not in _NAME_KEYS}
        out["gpu"] = ref["index"]
        return dict(sorted(out.items()))

    got = {k: v for k, v in doc.items() if k != "gpu_names"}
    for key in ("stalls", "alerts", "thresholds", "stats", "health"):
        got[key] = [number(r) for r in doc[key]]
    got["findings"] = [
        {**{k: v for k, v in f.items() if k != "verdict"}, "gpus": [r["index"] for r in f["gpus"]]}
        for f in doc["findings"]
    ]
    return got


def sorted_keys(doc: dict[str, Any]) -> dict[str, Any]:
    """A recording's report JSON as :func:`unnamed` gives a fleet's: keys sorted, verdicts left out."""
    got = dict(doc)
    for key in ("stalls", "alerts", "thresholds", "stats", "health"):
        got[key] = [dict(sorted(r.items())) for r in doc[key]]
    got["findings"] = [{k: v for k, v in f.items() if k != "verdict"} for f in doc["findings"]]
    return got
