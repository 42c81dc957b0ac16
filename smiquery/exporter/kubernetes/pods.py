"""The pods of this node from the Kubernetes API (the official ``kubernetes`` client), by UID and container id.

One list call per refresh, ``fieldSelector=spec.nodeName=<node>``: the exporter's ServiceAccount needs only get and
list on pods. Configuration: in-cluster (the pod's ServiceAccount) when there, else a kubeconfig (``KUBECONFIG`` or
``~/.kube/config``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from smiquery._log import get_logger
from smiquery.exporter.kubernetes.attribution import Holder
from smiquery.retry import one_line

__all__ = ["NodePods", "PodDirectory", "node_name"]

log = get_logger("smiquery.exporter")


def node_name() -> str:
    """This node's name: ``NODE_NAME`` (set it from ``spec.nodeName`` with the downward API), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


@dataclass(frozen=True)
class NodePods:
    """One listing: pod UID -> (namespace, name); container id -> container name (the runtime prefix dropped)."""

    pods: dict[str, tuple[str, str]]
    containers: dict[str, str]

    def holder(self, pod_uid: str, container_id: str) -> Holder | None:
        """The container for a cgroup's pod UID and container id; None for a pod not (yet) listed."""
        pod = self.pods.get(pod_uid)
        if pod is None:
            return None
        return Holder(pod[0], pod[1], self.containers.get(container_id, ""))


def _load_client() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
    except config.ConfigException:
        # KUBECONFIG read now, not when the client was imported
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
    return client.CoreV1Api()


class PodDirectory:
    """Lists this node's pods on a thread of its own and keeps the newest answer.

    Args:
        interval: seconds between listings.
        node: the node's name (default :func:`node_name`).
        timeout: each call's deadline in seconds.
        api: a ``CoreV1Api`` (tests may pass one); default: built from in-cluster config or a kubeconfig.
    """

    def __init__(self, interval: float = 15.0, *, node: str | None = None, timeout: float = 10.0, api: Any = None):
        self.interval = float(interval)
        self.node = node or node_name()
        self.timeout = float(timeout)
        self.errors: Counter[str] = Counter()
        self.up = False
        self.token: object = object()
        self._api = api
        self._latest = NodePods({}, {})
        self._logged: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def latest(self) -> NodePods:
        """The newest listing (empty before the first)."""
        return self._latest

    def refresh(self) -> bool:
        """List the node's pods once now; errors are counted and logged once per change, never raised."""
        try:
            if self._api is None:
                self._api = _load_client()
            got = self._api.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self.node}", _request_timeout=self.timeout
            )
        except Exception as exc:  # the API server, RBAC or config: per-pod usage goes to "other", said once
            self.errors[type(exc).__name__] += 1
            why = one_line(exc)
            if why != self._logged:
                log.warning("smiquery exporter: listing the pods of node %s failed: %s", self.node, why)
                self._logged = why
            if self.up:
                self.up, self.token = False, object()
            return False
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
        new = NodePods(pods, containers)
        if self._logged is not None:
            log.warning("smiquery exporter: listing the pods of node %s works again", self.node)
            self._logged = None
        if new != self._latest or not self.up:
            self._latest, self.up, self.token = new, True, object()
        return True

    def start(self) -> PodDirectory:
        """Refresh on a background thread until :meth:`close`. Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="smiquery-pods", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            self.refresh()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def close(self) -> None:
        """Stop refreshing."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.timeout + 5.0)
