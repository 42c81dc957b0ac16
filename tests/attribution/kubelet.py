"""A stand-in kubelet: a real gRPC server on a unix socket answering pod-resources v1 ``List``."""

from __future__ import annotations

import os
import threading
from concurrent import futures
from typing import Any

import grpc

from smiquery.attribution import podresources as pr

#: (namespace, pod, container, resource, device ids)
Grant = tuple[str, str, str, str, tuple[str, ...]]


class StandInKubelet:
    """Serves ``List`` from :attr:`grants` (change it while running); :meth:`stop` and :meth:`start` again."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.grants: list[Grant] = []
        self.calls = 0
        self.called = threading.Event()
        self._server: Any = None

    def _list(self, request: Any, context: Any) -> Any:
        self.calls += 1
        self.called.set()
        out = pr.ListPodResourcesResponse()
        pods: dict[tuple[str, str], Any] = {}
        for ns, pod, ctr, resource, ids in self.grants:
            p = pods.get((ns, pod))
            if p is None:
                p = pods[(ns, pod)] = out.pod_resources.add(name=pod, namespace=ns)
            c = next((c for c in p.containers if c.name == ctr), None) or p.containers.add(name=ctr)
            dev = c.devices.add(resource_name=resource)
            dev.device_ids.extend(ids)
        return out

    def start(self) -> StandInKubelet:
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list,
                    request_deserializer=pr.ListPodResourcesRequest.FromString,
                    response_serializer=pr.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self._server.add_generic_rpc_handlers((handler,))
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait(10)
            self._server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
