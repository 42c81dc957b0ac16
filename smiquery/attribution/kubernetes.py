"""The Kubernetes backend: which pod holds each GPU (the kubelet's pod-resources ``List``), and whose a process is.

:class:`KubernetesBackend` lists the kubelet's device allocations over its unix socket (:mod:`.podresources`, with a
deadline). With per-pod use of shared GPUs (``--kubernetes-processes``) it ties a process to its container through
``/proc/<pid>/cgroup`` (:mod:`.cgroups`) and this node's pods from the Kubernetes API (:class:`PodDirectory`: the
official ``kubernetes`` client, one list call per refresh, ``fieldSelector=spec.nodeName=<node>``, so the exporter's
ServiceAccount needs only get and list on pods; in-cluster config when there, else a kubeconfig: ``KUBECONFIG`` or
``~/.kube/config``). Needs the ``k8s`` extra (grpcio, protobuf; kubernetes for per-pod use).
"""

from __future__ import annotations

import fnmatch
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from smiquery.attribution import FailureLog, Grant, Words, Workload
from smiquery.attribution.cgroups import PodCgroup, pod_of_pid
from smiquery.attribution.podresources import DEFAULT_SOCKET, list_devices
from smiquery.retry import one_line
from smiquery.sources.latest import Latest

__all__ = [
    "DEFAULT_RESOURCES",
    "OTHER",
    "POD_LABELS",
    "KubernetesBackend",
    "NodePods",
    "PodDirectory",
    "node_name",
]

#: The extended resources read by default (``fnmatch`` patterns).
DEFAULT_RESOURCES: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/mig-*")
#: The labels of a workload, in :class:`~smiquery.attribution.Workload` order (dcgm-exporter's names, so its
#: dashboards work).
POD_LABELS: tuple[str, ...] = ("namespace", "pod", "container")
#: Use of processes no container is found for.
OTHER = Workload(("", "other", ""))


def _words(socket_path: str) -> Words:
    return Words(
        failed=f"kubelet pod-resources at {socket_path}: {{why}}; GPU series go out without pod labels",
        again=f"kubelet pod-resources answers again at {socket_path}",
        unknown="the kubelet lists {resource} device {device!r}, which is no GPU of this node "
        "(not a GPU UUID, a MIG UUID from nvidia-smi -L nor UUID::N)",
        allocated="A device the kubelet allocated to a container (1); join with * on(uuid) group_left(pod, "
        "namespace, container).",
        unknown_help="A device id the kubelet allocated that names no GPU of this node (1).",
        up="1 when the last kubelet pod-resources List worked; 0: GPU series carry no pod labels.",
        took="Seconds the last List call took.",
        errors="Failed List calls by error type.",
        holder="container",
        other='pod="other": what no container of this node could be found for.',
    )


def node_name() -> str:
    """This node's name: ``NODE_NAME`` (set it from ``spec.nodeName`` with the downward API), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


@dataclass(frozen=True)
class NodePods:
    """One listing: pod UID -> (namespace, name); container id -> container name (the runtime prefix dropped)."""

    pods: dict[str, tuple[str, str]]
    containers: dict[str, str]

    def holder(self, pod_uid: str, container_id: str) -> Workload | None:
        """The container for a cgroup's pod UID and container id; None for a pod not (yet) listed."""
        pod = self.pods.get(pod_uid)
        if pod is None:
            return None
        return Workload((pod[0], pod[1], self.containers.get(container_id, "")))


def _load_client() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        # KUBECONFIG read now, not when the client was imported
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
    return client.CoreV1Api()


class PodDirectory:
    """Lists this node's pods in the background (a :class:`~smiquery.sources.latest.Latest`); keeps the newest.

    A failed listing keeps the last one (``up`` turns False); errors are counted and logged once per change.

    Args:
        interval: seconds between listings.
        node: the node's name (default :func:`node_name`).
        timeout: each call's deadline in seconds.
        api: a ``CoreV1Api`` (tests may pass one); default: built from in-cluster config or a kubeconfig.
    """

    def __init__(self, interval: float = 15.0, *, node: str | None = None, timeout: float = 10.0, api: Any = None):
        self.node = node or node_name()
        self.timeout = float(timeout)
        self.up = False
        self.failures = FailureLog(
            f"listing the pods of node {self.node} failed: {{why}}", f"listing the pods of node {self.node} works again"
        )
        self.poll = Latest(self._list, interval, name="kubernetes-pods")
        self._api = api

    @property
    def latest(self) -> NodePods:
        """The newest listing (empty before the first)."""
        return self.poll.get().value or NodePods({}, {})

    def refresh(self) -> bool:
        """List the node's pods once now, in the caller's thread; errors are counted and logged, never raised."""
        self.poll.poll()
        return self.up

    def _list(self) -> NodePods:
        try:
            if self._api is None:
                self._api = _load_client()
            got = self._api.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node}", _request_timeout=self.timeout
            )
        except Exception as exc:  # the API server, RBAC or config: per-pod usage goes to "other", said once
            self.failures.failed(type(exc).__name__, one_line(exc))
            self.up = False
            return self.latest
        pods: dict[str, tuple[str, str]] = {}
        containers: dict[str, str] = {}
        for pod in got.items or ():
            meta = pod.metadata
            pods[str(meta.uid)] = (str(meta.namespace), str(meta.name))
            status = pod.status
            for st in [
                *(getattr(status, "container_statuses", None) or ()),
                *(getattr(status, "init_container_statuses", None) or ()),
            ]:
                cid = st.container_id or ""
                containers[cid.split("://", 1)[-1]] = str(st.name)
        self.failures.worked()
        self.up = True
        new, old = NodePods(pods, containers), self.poll.get().value
        return old if new == old else new  # the same object while nothing changed: the exporter's cache key


class KubernetesBackend:
    """Kubernetes for :class:`~smiquery.attribution.Attribution`: the kubelet's allocations, and pods by process.

    Args:
        socket_path: the kubelet's pod-resources socket.
        resources: extended-resource patterns read (``fnmatch``; others are ignored).
        timeout: each ``List`` call's deadline in seconds.
        pods: this node's pods, for :meth:`owner` (per-pod use of shared GPUs); None: no process is tied to a pod.
        lister: ``(socket, timeout) -> grants`` (tests inject one); default: the gRPC call.
        cgroup_of: pid -> its pod cgroup (tests pass a fixture reader).
    """

    name = "kubernetes"
    workload = "pod"
    labels = POD_LABELS
    other = OTHER

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        *,
        resources: Sequence[str] = DEFAULT_RESOURCES,
        timeout: float = 5.0,
        pods: PodDirectory | None = None,
        lister: Callable[[str, float], list[Grant]] = list_devices,
        cgroup_of: Callable[[int], PodCgroup | None] = pod_of_pid,
    ) -> None:
        if timeout <= 0:
            raise ValueError("the attribution timeout must be positive")
        self.socket_path = socket_path
        self.resources = tuple(resources)
        self.timeout = float(timeout)
        self.pods = pods
        self.words = _words(socket_path)
        self.processes = pods is not None
        self.polls: tuple[Latest[Any], ...] = (pods.poll,) if pods is not None else ()
        self._lister = lister
        self._cgroup_of = cgroup_of

    def refresh(self) -> list[Grant]:
        """Call ``List`` once; the grants of the resources read."""
        grants = self._lister(self.socket_path, self.timeout)
        return [g for g in grants if any(fnmatch.fnmatchcase(g.resource, p) for p in self.resources)]

    def failure(self, exc: Exception) -> tuple[str, str]:
        """A failed ``List``: the gRPC status (``unavailable``...) or ``permission_denied``, and its details."""
        return _error_kind(exc), _rpc_detail(exc)

    def owner(self, pid: int) -> Workload | None:
        """The container of a process (its cgroup names the pod and container; the pod listing names them)."""
        if self.pods is None:
            return None
        cg = self._cgroup_of(pid)
        return None if cg is None else self.pods.latest.holder(cg.pod_uid, cg.container_id)


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, PermissionError):
        return "permission_denied"
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            name = getattr(code(), "name", None)
        except Exception:  # a half-built RpcError: its class name will do
            name = None
        if isinstance(name, str):
            return name.lower()
    return type(exc).__name__


def _rpc_detail(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            text = details()
        except Exception:  # a half-built RpcError: fall back to its message
            text = None
        if isinstance(text, str) and text:
            return text.splitlines()[0]
    return one_line(exc)
