"""Write docker/k8s/monitoring/prometheusrule.yaml from docker/prometheus/smiquery-rules.yml (the rules' one source).

The PrometheusRule (Prometheus Operator) carries the plain rule file's groups, comments included, under ``spec``.
tests/test_docker.py fails when the two differ; run ``python tests/docker/sync_prometheus_rule.py`` after editing the
rule file.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "docker" / "prometheus" / "smiquery-rules.yml"
MANIFEST = ROOT / "docker" / "k8s" / "monitoring" / "prometheusrule.yaml"

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


def generated(rules_text: str) -> str:
    """The manifest for ``rules_text``: its lines from ``groups:`` on, indented under ``spec``."""
    lines = rules_text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("groups:"))
    body = "".join(("  " + line) if line.strip() else "\n" for line in lines[start:])
    return HEADER + body


def main() -> int:
    new = generated(RULES.read_text(encoding="utf-8"))
    old = MANIFEST.read_text(encoding="utf-8") if MANIFEST.exists() else ""
    if new != old:
        MANIFEST.write_text(new, encoding="utf-8")
        print(f"updated {MANIFEST.relative_to(ROOT)}")
    else:
        print(f"{MANIFEST.relative_to(ROOT)} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
