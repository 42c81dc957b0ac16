"""The Kubernetes backend: which pod holds each GPU (the kubelet's pod-resources ``List``), and whose a process is.

For per-pod use (``--kubernetes-processes``) a process is tied to its container by ``/proc/<pid>/cgroup``
(:func:`parse_cgroup`) and this node's pods, listed from the API server (:class:`PodDirectory`): ``docs/kubernetes.md``.
"""

from __future__ import annotations

import fnmatch
import functools
import http.client
import json
import os
import re
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from smiquery.attribution import Grant, Words, Workload, cgroup_paths, failure_log, read_cgroup
from smiquery.attribution.podresources import DEFAULT_SOCKET, list_devices
from smiquery.errors import KubernetesApiError
from smiquery.retry import one_line
from smiquery.sources.latest import Latest

__all__ = [
    "DEFAULT_RESOURCES",
    "MAX_POD_LIST_BYTES",
    "OTHER",
    "POD_LABELS",
    "SERVICE_ACCOUNT",
    "KubernetesBackend",
    "NodePods",
    "PodCgroup",
    "PodDirectory",
    "get_node_pods",
    "node_name",
    "parse_cgroup",
    "pod_of_pid",
]

#: The extended resources read by default (``fnmatch`` patterns).
DEFAULT_RESOURCES: tuple[str, ...] = ("nvidia.com/gpu", "nvidia.com/mig-*")
#: The labels of a workload, in :class:`~smiquery.attribution.Workload` order (dcgm-exporter's names, so its
#: dashboards work).
POD_LABELS: tuple[str, ...] = ("namespace", "pod", "container")
#: Use of processes no container is found for.
OTHER = Workload(("", "other", ""))
#: Where the kubelet mounts a pod's service account: ``token`` (re-read on every call: the kubelet rotates it),
#: ``ca.crt`` (the cluster's CA, the only one trusted).
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The largest pod list read (bytes); a node's 110 pods are a few MB of JSON. A bigger answer is an error.
MAX_POD_LIST_BYTES = 32 * 1024 * 1024

_POD_RE = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")
_CTR_RE = re.compile(r"^(?:cri-containerd-|crio-|docker-)?([0-9a-f]{64})(?:\.scope)?$")


@dataclass(frozen=True)
class PodCgroup:
    """A process's pod (UID with dashes, as the API writes it) and container (64-hex id, no runtime prefix)."""

    pod_uid: str
    container_id: str


def parse_cgroup(text: str) -> PodCgroup | None:
    """The pod and container in the text of ``/proc/<pid>/cgroup``, or None for a process outside any pod.

    The kubelet's cgroup paths name the pod's UID and the container's id: with the systemd driver
    ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/<runtime>-<id>.scope``
    (``cri-containerd``, ``crio`` or ``docker``), with cgroupfs ``/kubepods/burstable/pod<uid>/<id>``.
    """
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


def _api_address() -> tuple[str, int]:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
    if not host:
        raise KubernetesApiError(
            "KUBERNETES_SERVICE_HOST is not set: --kubernetes-processes must run in a pod of the cluster "
            "(the kubelet sets it, with the service account's token and CA)"
        )
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise KubernetesApiError(f"KUBERNETES_SERVICE_PORT={port!r} is not a port number") from None


def _status_message(body: bytes) -> str:
    """The ``message`` of a ``Status`` answer (what RBAC or the server says), else the first line of the body."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    text = doc.get("message") if isinstance(doc, dict) else None
    if not isinstance(text, str):
        text = body.decode("utf-8", "replace")
    return " ".join(text.split())[:300]


def get_node_pods(
    node: str, *, timeout: float = 10.0, service_account: str = SERVICE_ACCOUNT, max_bytes: int = MAX_POD_LIST_BYTES
) -> dict[str, Any]:
    """``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>`` from in the cluster: the decoded ``PodList``.

    HTTPS to ``KUBERNETES_SERVICE_HOST``:``KUBERNETES_SERVICE_PORT``, verified against the service account's
    ``ca.crt`` only, its ``token`` the bearer; ``timeout`` bounds the whole call. Raises KubernetesApiError when not
    in a pod, for a refused request (401, 403...: the server's message) and an answer over ``max_bytes`` or not a
    PodList; OSError (``TimeoutError`` included) when the server, the service account or TLS fails.
    """
    deadline = time.monotonic() + timeout
    host, port = _api_address()
    with open(os.path.join(service_account, "token"), encoding="utf-8") as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=os.path.join(service_account, "ca.crt"))
    query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
    conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the API server did not answer within {timeout:g} s")
        return remaining

    try:
        conn.connect()
        sock = conn.sock  # kept: getresponse() may hand the socket to the response and forget it
        assert sock is not None
        sock.settimeout(left())
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json", "User-Agent": "smiquery"}
        conn.request("GET", f"/api/v1/pods?{query}", headers=headers)
        resp = conn.getresponse()
        size = resp.getheader("Content-Length")
        if resp.status == 200 and size is not None and size.isdigit() and int(size) > max_bytes:
            raise KubernetesApiError(f"the pod list is {size} bytes, over the {max_bytes} read", resp.status)
        limit = max_bytes if resp.status == 200 else 4096
        body = bytearray()
        while True:
            sock.settimeout(left())
            chunk = resp.read1(65536)
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                if resp.status == 200:
                    raise KubernetesApiError(f"the pod list is over the {max_bytes} bytes read", resp.status)
                break
    finally:
        conn.close()
    if resp.status != 200:
        hint = "; the exporter's ServiceAccount needs list on pods" if resp.status in (401, 403) else ""
        why = f"the API server answered {resp.status} {resp.reason}: {_status_message(bytes(body))}{hint}"
        raise KubernetesApiError(why, resp.status)
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise KubernetesApiError(f"the pod list is not JSON ({exc})", resp.status) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise KubernetesApiError("the answer is not a PodList (no items)", resp.status)
    return doc


def _node_pods(doc: dict[str, Any]) -> NodePods:
    pods: dict[str, tuple[str, str]] = {}
    containers: dict[str, str] = {}
    for pod in doc["items"]:
        if not isinstance(pod, dict):
            continue
        meta = pod.get("metadata") or {}
        pods[str(meta.get("uid", ""))] = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        status = pod.get("status") or {}
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for st in status.get(key) or ():
                cid = str(st.get("containerID") or "")
                if cid:
                    containers[cid.split("://", 1)[-1]] = str(st.get("name", ""))
    return NodePods(pods, containers)


class PodDirectory:
    """Lists this node's pods (:func:`get_node_pods`) every ``interval`` seconds in the background; keeps the newest.

    A failed listing keeps the last one (``up`` turns False); errors are counted and logged once per change.
    """

    def __init__(
        self,
        interval: float = 15.0,
        *,
        node: str | None = None,
        timeout: float = 10.0,
        service_account: str = SERVICE_ACCOUNT,
        max_bytes: int = MAX_POD_LIST_BYTES,
    ) -> None:
        self.node = node or node_name()
        self._get = functools.partial(
            get_node_pods, self.node, timeout=timeout, service_account=service_account, max_bytes=max_bytes
        )
        failed = f"listing the pods of node {self.node} failed: {{why}}"
        self.failures = failure_log(failed, f"listing the pods of node {self.node} works again")
        self.poll = Latest(self._list, interval, name="kubernetes-pods", failures=self.failures)

    @property
    def up(self) -> bool:
        """Whether the newest listing worked."""
        return self.poll.get().value is not None and self.failures.error is None

    @property
    def latest(self) -> NodePods:
        """The newest listing (empty before the first)."""
        return self.poll.get().value or NodePods({}, {})

    def refresh(self) -> bool:
        """List the node's pods once now, in the caller's thread; errors are counted and logged, never raised."""
        self.poll.poll()
        return self.up

    def _list(self) -> NodePods:
        # a failure (the API server, RBAC or TLS) keeps the last listing; per-pod use goes to "other", said once
        new = _node_pods(self._get())
        old = self.poll.get().value
        return old if new == old else new  # the same object while nothing changed: the exporter's cache key


class KubernetesBackend:
    """Kubernetes for :class:`~smiquery.attribution.Attribution`: the kubelet's allocations, and pods by process.

    ``socket_path``: the kubelet's pod-resources socket, asked with a ``timeout`` per ``List`` (``lister``: the
    gRPC call by default); ``resources``: the extended-resource patterns read (``fnmatch``); ``pods``: this node's
    pods, for :meth:`owner` (None: no process is tied to a pod), found by ``cgroup_of`` (pid -> its pod cgroup).
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
        self.words = Words(
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
        code = getattr(_ask(exc, "code"), "name", None)
        kind = code.lower() if isinstance(code, str) else type(exc).__name__
        text = _ask(exc, "details")
        why = text.splitlines()[0] if isinstance(text, str) and text else one_line(exc)
        return "permission_denied" if isinstance(exc, PermissionError) else kind, why

    def owner(self, pid: int) -> Workload | None:
        """The container of a process (its cgroup names the pod and container; the pod listing names them)."""
        if self.pods is None:
            return None
        cg = self._cgroup_of(pid)
        return None if cg is None else self.pods.latest.holder(cg.pod_uid, cg.container_id)


def _ask(exc: BaseException, method: str) -> object:
    """What an RpcError's ``code()`` or ``details()`` says; None when it has none (or is half-built)."""
    fn = getattr(exc, method, None)
    try:
        return fn() if callable(fn) else None
    except Exception:
        return None
