"""Which pod and container a process belongs to, from ``/proc/<pid>/cgroup`` (cgroup v1 and v2).

The kubelet's cgroup paths name the pod's UID and the container's id: with the systemd driver
``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/<runtime>-<id>.scope``
(``cri-containerd``, ``crio`` or ``docker``), with cgroupfs ``/kubepods/burstable/pod<uid>/<id>``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["PodCgroup", "cgroup_paths", "parse_cgroup", "pod_of_pid", "read_cgroup"]

_POD_RE = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")
_CTR_RE = re.compile(r"^(?:cri-containerd-|crio-|docker-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class PodCgroup:
    """A process's pod (UID with dashes, as the API writes it) and container (64-hex id, no runtime prefix)."""

    pod_uid: str
    container_id: str


def cgroup_paths(text: str) -> list[str]:
    """The paths in the text of ``/proc/<pid>/cgroup`` (v1: one line per controller; v2: ``0::<path>``)."""
    return [parts[2] for parts in (line.split(":", 2) for line in text.splitlines()) if len(parts) == 3]


def read_cgroup(pid: int, proc: str = "/proc") -> str | None:
    """The text of ``/proc/<pid>/cgroup`` (``proc``: the mount to read), or None for a process gone or not visible."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup"), encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def parse_cgroup(text: str) -> PodCgroup | None:
    """The pod and container in the text of ``/proc/<pid>/cgroup``, or None for a process outside any pod."""
    for path in cgroup_paths(text):
        pod = _POD_RE.search(path)
        if pod is None:
            continue
        segments = [s for s in path.split("/") if s]
        ctr = _CTR_RE.match(segments[-1]) if segments else None
        if ctr is None:
            continue  # a pod's own cgroup (no container in it) or a runtime helper such as crio-conmon-<id>
        return PodCgroup(pod.group(1).replace("_", "-").lower(), ctr.group(1))
    return None


def pod_of_pid(pid: int, proc: str = "/proc") -> PodCgroup | None:
    """The pod and container of a host pid (the exporter needs ``hostPID``), or None (not in a pod, gone, not seen)."""
    text = read_cgroup(pid, proc)
    return None if text is None else parse_cgroup(text)
