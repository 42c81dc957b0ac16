"""Write the Kubernetes variants of docker/k8s/exporter.yaml (the one source of the DaemonSet).

- ``exporter-kubernetes.yaml``: ``--kubernetes`` (which pod holds each GPU). Adds the kubelet's pod-resources
  socket, mounted read-only, NODE_NAME from the downward API, and the container as uid 0 without capabilities (the
  socket is root's alone); no RBAC.
- ``exporter-kubernetes-processes.yaml``: ``--kubernetes-processes`` (per-pod use of shared GPUs). The above plus
  ``hostPID: true`` and a ServiceAccount token with get/list on pods (ClusterRole + ClusterRoleBinding).

Each variant replaces exporter.yaml (same object names): apply one of the three. tests/test_docker.py fails when a
variant differs from what this script makes; run ``python tests/docker/sync_k8s_variants.py`` after editing
exporter.yaml.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
BASE = K8S / "exporter.yaml"
ATTRIBUTION = K8S / "exporter-kubernetes.yaml"
PROCESSES = K8S / "exporter-kubernetes-processes.yaml"

_NAMESPACE = """\
---
# {what} beyond the `baseline` and `restricted` Pod Security levels, so the namespace enforces `privileged`;
# `audit: restricted` still records every pod that goes beyond restricted in the API server's audit log. Everything
# else in the pod stays at the restricted level (non-root, no capabilities, no privilege escalation, read-only root).
apiVersion: v1
kind: Namespace
metadata:
  name: gpu-monitoring
  labels:
    app.kubernetes.io/part-of: smiquery
    pod-security.kubernetes.io/enforce: privileged
    pod-security.kubernetes.io/audit: restricted
"""

_HEADER_ATTRIBUTION = """\
# GENERATED from exporter.yaml by tests/docker/sync_k8s_variants.py: edit exporter.yaml, then run
# `python tests/docker/sync_k8s_variants.py`.
#
# The smiquery exporter with pod attribution (`smiquery export --kubernetes`): every GPU series says which pod holds
# the GPU (smiquery_gpu_allocation_info, pod/namespace/container labels). Apply INSTEAD of exporter.yaml (same
# names). Differences from exporter.yaml: the kubelet's pod-resources socket directory is mounted read-only (a
# hostPath, so the namespace is relabelled `privileged`, below), NODE_NAME comes from the downward API, and
# `--kubernetes` is passed; the container runs as uid 0 with no capability (the kubelet's socket is root's alone). No
# Kubernetes API access and no RBAC: the kubelet's socket says everything.
# docker/Dockerfile.exporter's image has what this needs (smiquery's k8s extra: grpcio, protobuf, kubernetes).
"""

_HEADER_PROCESSES = """\
# GENERATED from exporter.yaml by tests/docker/sync_k8s_variants.py: edit exporter.yaml, then run
# `python tests/docker/sync_k8s_variants.py`.
#
# The smiquery exporter with per-pod use of shared GPUs (`smiquery export --kubernetes-processes`): on a GPU that
# several pods share (time-slicing, MPS), smiquery_pod_gpu_utilization_ratio and smiquery_pod_gpu_memory_used_bytes
# per pod. Apply INSTEAD of exporter.yaml (same names). Everything exporter-kubernetes.yaml adds, plus:
# - hostPID: true, to see the processes of other pods and read their /proc/<pid>/cgroup (which pod a process is in);
# - a ServiceAccount token and a ClusterRole with get/list on pods: the exporter lists the pods of its own node
#   (field selector spec.nodeName=$NODE_NAME) to name the pod of a cgroup.
# hostPID shows the exporter every process of the node: opt in only where per-pod use of shared GPUs is wanted.
# docker/Dockerfile.exporter's image has what this needs (smiquery's k8s extra: grpcio, protobuf, kubernetes).
"""

_RBAC = """\
---
# Pods of every namespace (a GPU's pods can be anywhere), read-only; the exporter asks for its own node's only.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: smiquery-exporter-pods
  labels:
    app.kubernetes.io/name: smiquery-exporter
    app.kubernetes.io/part-of: smiquery
rules:
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["get", "list"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: smiquery-exporter-pods
  labels:
    app.kubernetes.io/name: smiquery-exporter
    app.kubernetes.io/part-of: smiquery
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: smiquery-exporter-pods
subjects:
  - kind: ServiceAccount
    name: smiquery-exporter
    namespace: gpu-monitoring
"""

_ARGS = '          args: ["--bind", "0.0.0.0", "--port", "9849", "--kernel-log", ""]\n'
_ENV_END = "            - name: NVIDIA_DRIVER_CAPABILITIES\n              value: utility\n"
_NODE_NAME = """\
            # the node's name: the pods of this node (--kubernetes-processes) and the exporter's log
            - name: NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
"""
_MOUNTS = "          volumeMounts:\n            - name: tmp\n              mountPath: /tmp\n"
_SOCKET_MOUNT = """\
            # the kubelet's pod-resources API (kubelet.sock): read-only, List only
            - name: pod-resources
              mountPath: /var/lib/kubelet/pod-resources
              readOnly: true
"""
_VOLUMES_END = "            medium: Memory\n            sizeLimit: 16Mi\n"
_SOCKET_VOLUME = """\
        - name: pod-resources
          hostPath:
            path: /var/lib/kubelet/pod-resources
            type: Directory
"""
_CONTAINER_SC = "          securityContext:\n            privileged: false\n"
_AS_ROOT = """\
          securityContext:
            # The kubelet creates its pod-resources socket srwxr-xr-x root root: connecting to a unix socket needs
            # write permission, so only uid 0 can. Root without a single capability (drop ALL, below), no privilege
            # escalation, read-only root file system; the pod keeps runAsNonRoot for any other container.
            runAsUser: 0
            runAsNonRoot: false
            privileged: false
"""
_SA_TOKEN = "# The exporter never talks to the Kubernetes API.\nautomountServiceAccountToken: false\n"
_POD_TOKEN = "      automountServiceAccountToken: false\n"
_SPEC = "    spec:\n      serviceAccountName: smiquery-exporter\n"


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(
            f"exporter.yaml changed: expected exactly one {old!r}; update tests/docker/sync_k8s_variants.py"
        )
    return text.replace(old, new)


def _body(base_text: str) -> str:
    """exporter.yaml from its first document on (its header comment is the variant's own)."""
    return base_text[base_text.index("---\n") :]


def attribution(base_text: str) -> str:
    """exporter-kubernetes.yaml for this exporter.yaml."""
    text = _body(base_text)
    text = _replace_once(text, _ARGS, _ARGS.replace('""]', '"", "--kubernetes"]'))
    text = _replace_once(text, _ENV_END, _ENV_END + _NODE_NAME)
    text = _replace_once(text, _MOUNTS, _MOUNTS + _SOCKET_MOUNT)
    text = _replace_once(text, _VOLUMES_END, _VOLUMES_END + _SOCKET_VOLUME)
    text = _replace_once(text, _CONTAINER_SC, _AS_ROOT)
    return _HEADER_ATTRIBUTION + _NAMESPACE.format(what="A hostPath volume is") + text


def processes(base_text: str) -> str:
    """exporter-kubernetes-processes.yaml for this exporter.yaml."""
    text = _body(base_text)
    text = _replace_once(text, _ARGS, _ARGS.replace('""]', '"", "--kubernetes-processes"]'))
    text = _replace_once(text, _ENV_END, _ENV_END + _NODE_NAME)
    text = _replace_once(text, _MOUNTS, _MOUNTS + _SOCKET_MOUNT)
    text = _replace_once(text, _VOLUMES_END, _VOLUMES_END + _SOCKET_VOLUME)
    text = _replace_once(text, _CONTAINER_SC, _AS_ROOT)
    text = _replace_once(
        text,
        _SA_TOKEN,
        "# Its token lists this node's pods (ClusterRole smiquery-exporter-pods, below).\n"
        "automountServiceAccountToken: true\n",
    )
    text = _replace_once(text, _POD_TOKEN, "      automountServiceAccountToken: true\n")
    text = _replace_once(
        text,
        _SPEC,
        _SPEC + "      # every process of the node, to tell which pod uses a GPU how much (see the top of this file)\n"
        "      hostPID: true\n",
    )
    return _HEADER_PROCESSES + _NAMESPACE.format(what="hostPID and a hostPath volume are") + text + _RBAC


def main() -> int:
    base = BASE.read_text(encoding="utf-8")
    for path, make in ((ATTRIBUTION, attribution), (PROCESSES, processes)):
        new = make(base)
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if new != old:
            path.write_text(new, encoding="utf-8")
            print(f"updated {path.relative_to(ROOT)}")
        else:
            print(f"{path.relative_to(ROOT)} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
