"""The dashboard's by-pod row, evaluated by promtool on series as ``smiquery export --kubernetes`` writes them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.exporter.test_rules import DASHBOARD, U, _sel, _series, promtool

POD_TITLES = ("GPU utilisation by pod", "GPU memory by pod", "Allocated but idle")


def _pod_case(exprs: dict[str, str], pod: str) -> dict[str, Any]:
    """At 30 min, a sample a minute: pod train-0 got GPU 0 at minute 10 (its device series carry the pod's labels
    from then on, and had none before), pod eval-0 holds GPU 1 throughout and leaves it idle, Slurm job 4242 holds
    GPU 2 (no pod labels), GPU 3 is nobody's."""
    node = {"instance": "gpu07:9849", "job": "smiquery-exporter"}
    train = {"namespace": "ml", "pod": "train-0"}
    evaluate = {"namespace": "ml", "pod": "eval-0"}
    slurm = {"slurm_job_id": "4242", "slurm_user": "alice"}

    def alloc(gpu: int, owner: dict[str, str]) -> dict[str, str]:
        return {**node, "uuid": U[gpu], "gpu": str(gpu), **owner, "resource": "nvidia.com/gpu"}

    def dev(gpu: int, **extra: str) -> dict[str, str]:
        return {**node, "uuid": U[gpu], "gpu": str(gpu), "name": "NVIDIA H100", **extra}

    a_train, a_eval = alloc(0, train), alloc(1, evaluate)
    series = [
        _series("smiquery_gpu_allocation_info", a_train, "_x9 1x20"),
        _series("smiquery_gpu_allocation_info", a_eval, "1x30"),
        _series("smiquery_gpu_allocation_info", alloc(2, slurm), "1x30"),
        _series("smiquery_utilization_gpu_ratio", dev(0), "0x9"),
        _series("smiquery_utilization_gpu_ratio", dev(0, **train), "_x9 0.9x20"),
        _series("smiquery_utilization_gpu_ratio", dev(1, **evaluate), "0.01x30"),
        _series("smiquery_utilization_gpu_ratio", dev(2, **slurm), "0.5x30"),
        _series("smiquery_utilization_gpu_ratio", dev(3), "0.3x30"),
        _series("smiquery_memory_used_bytes", dev(0), "1e9x9"),
        _series("smiquery_memory_used_bytes", dev(0, **train), "_x9 2e9x20"),
        _series("smiquery_memory_used_bytes", dev(1, **evaluate), "5e8x30"),
        _series("smiquery_memory_used_bytes", dev(2, **slurm), "7e9x30"),
    ]
    want = {
        "GPU utilisation by pod": {"train-0": 0.9, "eval-0": 0.01},
        "GPU memory by pod": {"train-0": 2e9, "eval-0": 5e8},
        "Allocated but idle": {"train-0": 0.9, "eval-0": 0.01},
    }
    owners = {"train-0": a_train, "eval-0": a_eval}
    tests = []
    for title, expr in exprs.items():
        got = {p: v for p, v in want[title].items() if pod in (".*", p)}
        samples = [{"labels": _sel("", owners[p]), "value": v} for p, v in got.items()]
        expr = expr.replace("$instance", ".*").replace("$namespace", ".*").replace("$pod", pod)
        tests.append({"expr": expr, "eval_time": "30m", "exp_samples": samples})
    return {"interval": "1m", "input_series": series, "promql_expr_test": tests}


@pytest.mark.parametrize("pod", [".*", "eval-0"])
def test_by_pod_queries_return_one_series_per_pod_and_gpu(tmp_path, pod):
    """One series per pod on each GPU it holds, with the pod's own figures; a Slurm job's GPU is not listed under
    All pods, and a pod that got its GPU inside the idle table's 30 minutes is no duplicate-series error."""
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = {p["title"]: p["targets"][0]["expr"] for p in dash["panels"] if p["title"] in POD_TITLES}
    assert set(exprs) == set(POD_TITLES)
    (tmp_path / "none.yml").write_text("groups: []\n", encoding="utf-8")
    spec = {"rule_files": ["none.yml"], "evaluation_interval": "1m", "tests": [_pod_case(exprs, pod)]}
    test_file = tmp_path / "pods.test.yml"
    test_file.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    done = promtool("test", "rules", str(test_file))
    assert done.returncode == 0, done.stdout + done.stderr
