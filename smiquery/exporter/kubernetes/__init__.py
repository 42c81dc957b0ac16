"""Kubernetes pod attribution for the exporter (``smiquery export --kubernetes``).

- :mod:`.podresources`: the kubelet's pod-resources v1 ``List`` over its unix socket (gRPC).
- :mod:`.attribution`: which container holds each GPU, refreshed every interval; ``smiquery_gpu_allocation_info``,
  the per-GPU attribution state, ``smiquery_kubernetes_attribution_up``, and pod labels on GPUs one container holds.
- :mod:`.cgroups`, :mod:`.pods`, :mod:`.usage`: per-pod use of shared GPUs (``--kubernetes-processes``): process ->
  cgroup -> pod through the Kubernetes API.

:class:`KubernetesHook` is the one object the collector talks to. Needs the ``k8s`` extra (grpcio, protobuf;
kubernetes for per-pod use).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from smiquery.exporter.kubernetes.attribution import Attribution
from smiquery.exporter.kubernetes.pods import PodDirectory
from smiquery.exporter.kubernetes.usage import pod_usage_families

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from smiquery.exporter.pmonwatch import ProcessInstant
    from smiquery.source import Sweep
    from smiquery.sources.apps import GpuProcess

__all__ = ["Attribution", "KubernetesHook", "PodDirectory"]


class KubernetesHook:
    """Attribution (always) and per-pod use (with a :class:`PodDirectory`) as the collector sees them.

    Args:
        attribution: the kubelet allocations.
        pods: the node's pods, for per-pod use of shared GPUs; None for none.
    """

    def __init__(self, attribution: Attribution, pods: PodDirectory | None = None) -> None:
        self.attribution = attribution
        self.pods = pods
        self._gpus: dict[str, int | None] = {}
        self._parts: tuple[object, object] = (object(), object())
        self._token = object()

    @property
    def token(self) -> object:
        """Changes (by identity) whenever what is served may have changed; part of the collector's cache key."""
        parts = (self.attribution.token, self.pods.token if self.pods is not None else None)
        if parts[0] is not self._parts[0] or parts[1] is not self._parts[1]:
            self._parts, self._token = parts, object()
        return self._token

    def _gpus_of(self, sweep: Sweep | None) -> dict[str, int | None]:
        if sweep:
            self._gpus = {s.uuid: s.index for s in sweep if s.uuid}
        return self._gpus  # stale data: the last GPUs seen keep their state

    def gpu_labels(self, uuid: str | None, sweep: Sweep) -> dict[str, str]:
        """Pod labels for a device series (empty unless one container holds the GPU whole)."""
        return self.attribution.gpu_labels(uuid, self._gpus_of(sweep))

    def families(
        self, sweep: Sweep | None, procs: Sequence[GpuProcess] | None, instant: ProcessInstant | None
    ) -> list[Metric]:
        """Every Kubernetes series for this scrape."""
        gpus: Mapping[str, int | None] = self._gpus_of(sweep)
        out = self.attribution.families(gpus)
        if self.pods is not None and (instant is not None or procs is not None):
            out.extend(
                pod_usage_families(
                    gpus,
                    instant,
                    procs,
                    self.pods.latest,
                    uuid_label=self.attribution.uuid_label,
                    labels=self.attribution.labels,
                )
            )
        return out

    def start(self) -> KubernetesHook:
        """Start the background refreshes. Returns self."""
        self.attribution.start()
        if self.pods is not None:
            self.pods.start()
        return self

    def close(self) -> None:
        """Stop the background refreshes."""
        self.attribution.close()
        if self.pods is not None:
            self.pods.close()
