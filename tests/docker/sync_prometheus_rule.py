"""Write the PrometheusRules in docker/k8s/monitoring/ from the rule files in docker/prometheus/ (their one source).

- ``prometheusrule.yaml`` (PrometheusRule ``smiquery``) from ``smiquery-rules.yml``;
- ``prometheusrule-xid.yaml`` (PrometheusRule ``smiquery-xid``) from ``smiquery-xid-rules.yml``;
- ``prometheusrule-fleet.yaml`` (PrometheusRule ``smiquery-fleet``) from ``smiquery-fleet-rules.yml``.

Each PrometheusRule (Prometheus Operator) carries its rule file's groups, comments included, under ``spec``.
tests/test_docker.py fails when they differ; run ``python tests/docker/sync_prometheus_rule.py`` after editing a
rule file.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "docker" / "prometheus" / "smiquery-rules.yml"
MANIFEST = ROOT / "docker" / "k8s" / "monitoring" / "prometheusrule.yaml"
XID_RULES = ROOT / "docker" / "prometheus" / "smiquery-xid-rules.yml"
XID_MANIFEST = ROOT / "docker" / "k8s" / "monitoring" / "prometheusrule-xid.yaml"
FLEET_RULES = ROOT / "docker" / "prometheus" / "smiquery-fleet-rules.yml"
FLEET_MANIFEST = ROOT / "docker" / "k8s" / "monitoring" / "prometheusrule-fleet.yaml"

HEADER = """\
# GENERATED from docker/prometheus/smiquery-rules.yml by tests/docker/sync_prometheus_rule.py: edit the rule file,
# then run `python tests/docker/sync_prometheus_rule.py` (tests/test_docker.py checks that the two agree).
#
# smiquery's alert rules for the Prometheus Operator. They match the series of the `smiquery-exporter` job, which is
# the job name servicemonitor.yaml gives (the Service's name) and prometheus-scrape-config.yaml sets. The `release`
# label that kube-prometheus-stack's default ruleSelector matches comes from kustomization.yaml here (one place for
# the three monitoring objects; `kubectl apply -k docker/k8s/monitoring`). Alertmanager routes the alerts
# (docker/alertmanager/alertmanager.yml: an example).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: smiquery
  namespace: gpu-monitoring
  labels:
    app.kubernetes.io/name: smiquery-exporter
    app.kubernetes.io/part-of: smiquery
spec:
"""


XID_HEADER = """\
# GENERATED from docker/prometheus/smiquery-xid-rules.yml by tests/docker/sync_prometheus_rule.py: edit the rule
# file, then run `python tests/docker/sync_prometheus_rule.py` (tests/test_docker.py checks that the two agree).
#
# smiquery's Xid rules for the Prometheus Operator: one alert per critical Xid code and SmiqueryXidSourceDown, on the
# series the exporter exports with --kernel-log /dev/kmsg (docker/k8s/components/xid-kmsg). Without that component
# the series are absent and these rules stay silent. The `release` label kube-prometheus-stack's default ruleSelector
# matches comes from kustomization.yaml here.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: smiquery-xid
  namespace: gpu-monitoring
  labels:
    app.kubernetes.io/name: smiquery-exporter
    app.kubernetes.io/part-of: smiquery
spec:
"""


FLEET_HEADER = """\
# GENERATED from docker/prometheus/smiquery-fleet-rules.yml by tests/docker/sync_prometheus_rule.py: edit the rule
# file, then run `python tests/docker/sync_prometheus_rule.py` (tests/test_docker.py checks that the two agree).
#
# smiquery's fleet recording rules for the Prometheus Operator (docs/fleet.md): GPUs allocated and idle, power,
# GPU-hours and Wh per Kubernetes namespace/pod (from smiquery_gpu_allocation_info: the exporter with pod attribution,
# docker/k8s/components/pod-attribution) and per Slurm job (dcgm-exporter's hpc_job label). Without either they record
# nothing. The `release` label kube-prometheus-stack's default ruleSelector matches comes from kustomization.yaml here.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: smiquery-fleet
  namespace: gpu-monitoring
  labels:
    app.kubernetes.io/name: smiquery-exporter
    app.kubernetes.io/part-of: smiquery
spec:
"""


def _spec(rules_text: str) -> str:
    lines = rules_text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    return "".join(("  " + line) if line.strip() else "\n" for line in lines[start:])


def generated(rules_text: str) -> str:
    """prometheusrule.yaml for ``rules_text``: its lines from ``groups:`` on, indented under ``spec``."""
    return HEADER + _spec(rules_text)


def generated_xid(rules_text: str) -> str:
    """prometheusrule-xid.yaml for the Xid rule file's ``rules_text``."""
    return XID_HEADER + _spec(rules_text)


def generated_fleet(rules_text: str) -> str:
    """prometheusrule-fleet.yaml for the fleet rule file's ``rules_text``."""
    return FLEET_HEADER + _spec(rules_text)


# each rule file, its PrometheusRule and the function that writes the one from the other
PAIRS = (
    (RULES, MANIFEST, generated),
    (XID_RULES, XID_MANIFEST, generated_xid),
    (FLEET_RULES, FLEET_MANIFEST, generated_fleet),
)


def main() -> int:
    for rules, manifest, make in PAIRS:
        new = make(rules.read_text(encoding="utf-8"))
        old = manifest.read_text(encoding="utf-8") if manifest.exists() else ""
        if new != old:
            manifest.write_text(new, encoding="utf-8")
            print(f"updated {manifest.relative_to(ROOT)}")
        else:
            print(f"{manifest.relative_to(ROOT)} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
