"""Which pod and container a process belongs to, from ``/proc/<pid>/cgroup``.

The kubelet puts every container in a cgroup whose path names the pod's UID and the container's id. The forms
read here (cgroup v1 and v2, systemd and cgroupfs drivers):

- systemd: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/<runtime>-<id>.scope``
  with ``<runtime>`` ``cri-containerd``, ``crio`` or ``docker``;
- cgroupfs: ``/kubepods/burstable/pod<uid>/<id>`` (the QoS level is left out for guaranteed pods).

On cgroup v1 every controller line carries the path; the v2 line is ``0::<path>``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["PodCgroup", "parse_cgroup", "pod_of_pid"]

_POD_RE = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")
_CTR_RE = re.compile(r"^(?:cri-containerd-|crio-|docker-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class PodCgroup:
    """A process's pod and container, as its cgroup names them.

    Attributes:
        pod_uid: the pod's UID (with dashes, as the API writes it).
        container_id: the container's 64-hex id (without the runtime prefix).
    """

    pod_uid: str
    container_id: str


def parse_cgroup(text: str) -> PodCgroup | None:
    """Read the pod and container from the text of ``/proc/<pid>/cgroup``.

    Args:
        text: the file's text (v1: one line per controller; v2: ``0::<path>``).

    Returns:
        The pod and container, or None for a process outside any pod (a host process, the pod's pause container
        is included as it is a container of the pod).
    """
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2]
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
    """The pod and container of a process, or None (not in a pod, gone, or not visible from here).

    Args:
        pid: the process id as this host's PID namespace numbers it (the exporter needs ``hostPID``).
        proc: the ``/proc`` mount to read (tests pass a fixture tree).
    """
    try:
        with open(os.path.join(proc, str(pid), "cgroup"), encoding="utf-8", errors="replace") as fh:
            return parse_cgroup(fh.read())
    except OSError:
        return None
