"""The kubelet's pod-resources API (v1 ``List``) over its unix socket, with ``grpcio``.

The messages come from ``podresources.pb`` (``podresources.proto`` compiled), loaded into a pool of their own (no
other ``v1`` package can clash); any protobuf runtime from 4.21 on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool, message_factory

from smiquery.attribution import Grant, Workload

__all__ = [
    "DEFAULT_SOCKET",
    "FILE_DESCRIPTOR",
    "LIST_METHOD",
    "ContainerDevices",
    "ContainerResources",
    "ListPodResourcesRequest",
    "ListPodResourcesResponse",
    "PodResources",
    "list_devices",
]

#: Where the kubelet serves the API on every node.
DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: The gRPC method path of ``List``.
LIST_METHOD = "/v1.PodResourcesLister/List"

#: ``podresources.proto`` compiled (a serialized ``FileDescriptorProto``).
FILE_DESCRIPTOR = (Path(__file__).parent / "podresources.pb").read_bytes()

_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(FILE_DESCRIPTOR)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"v1.{name}"))


ListPodResourcesRequest: Any = _message("ListPodResourcesRequest")
ListPodResourcesResponse: Any = _message("ListPodResourcesResponse")
PodResources: Any = _message("PodResources")
ContainerResources: Any = _message("ContainerResources")
ContainerDevices: Any = _message("ContainerDevices")


def list_devices(socket_path: str, timeout: float) -> list[Grant]:
    """Call ``List`` once (``timeout``: its deadline, connecting included): one Grant per device id of any resource.

    The workloads are (namespace, pod, container), in the kubelet's order. Raises PermissionError when this user may
    not connect to the socket (the kubelet's is root's alone), grpc.RpcError when the socket is missing, nobody
    answers, the deadline passed or the kubelet refused.
    """
    try:
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            call = channel.unary_unary(
                LIST_METHOD,
                request_serializer=ListPodResourcesRequest.SerializeToString,
                response_deserializer=ListPodResourcesResponse.FromString,
            )
            answer = call(ListPodResourcesRequest(), timeout=timeout, wait_for_ready=False)
    except grpc.RpcError:
        denied = _denied(socket_path)
        if denied is not None:
            raise PermissionError(denied) from None
        raise
    return [
        Grant(Workload((pod.namespace, pod.name, ctr.name)), dev.resource_name, dev_id)
        for pod in answer.pod_resources
        for ctr in pod.containers
        for dev in ctr.devices
        for dev_id in dev.device_ids
    ]


def _denied(socket_path: str) -> str | None:
    """Why connecting to an existing socket is refused to this process, with the fix; None when it is not that.

    Connecting to a unix socket needs write permission on it, and the kubelet creates its pod-resources socket
    ``srwxr-xr-x root root``: only uid 0 can use it. gRPC says no more than "Permission denied" deep in its details.
    """
    try:
        st = os.stat(socket_path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or os.access(socket_path, os.W_OK):
        return None
    return (
        f"{socket_path} is {stat.filemode(st.st_mode)} owned by uid {st.st_uid} and this process runs as uid "
        f"{os.geteuid()}: run the exporter's container as uid {st.st_uid} (the kubelet's socket is root's alone: "
        "runAsUser: 0, as docker/k8s/exporter-kubernetes.yaml does)"
    )
