"""The checked-in descriptor is the .proto beside it, compiled (grpc_tools.protoc, from the dev extra)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from smiquery.exporter.kubernetes import podresources

PROTO = Path(podresources.__file__).with_name("podresources.proto")


def test_descriptor_matches_the_proto(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("grpcio-tools is missing (the dev extra installs it)")
        pytest.skip("grpcio-tools is not installed (the dev extra installs it)")
    from grpc_tools import protoc

    rc = protoc.main(["protoc", f"-I{PROTO.parent}", f"--python_out={tmp_path}", str(PROTO)])
    assert rc == 0
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location("podresources_pb2", tmp_path / "podresources_pb2.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(tmp_path))
    assert mod.DESCRIPTOR.serialized_pb == podresources.FILE_DESCRIPTOR


def test_unknown_fields_of_a_newer_kubelet_are_skipped() -> None:
    # a newer kubelet adds fields (memory = 4, dynamic_resources = 5 on a container): they must not break parsing
    msg = podresources.ListPodResourcesResponse()
    ctr = msg.pod_resources.add(name="p", namespace="n").containers.add(name="c")
    ctr.devices.add(resource_name="nvidia.com/gpu").device_ids.append("GPU-1")
    raw = bytearray(msg.SerializeToString())
    extra = b"\x22\x02\x08\x01"  # field 4, length-delimited, 2 bytes
    got = podresources.ListPodResourcesResponse.FromString(bytes(raw))
    assert got.pod_resources[0].containers[0].devices[0].device_ids == ["GPU-1"]
    inner = podresources.ContainerResources.FromString(ctr.SerializeToString() + extra)
    assert inner.name == "c" and list(inner.devices[0].device_ids) == ["GPU-1"]
