"""The checked-in descriptor is the .proto beside it, compiled (grpc_tools.protoc, from the dev extra)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smiquery.attribution import podresources

PROTO = Path(podresources.__file__).with_name("podresources.proto")


def test_descriptor_matches_the_proto(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("grpcio-tools is missing (the dev extra installs it)")
        pytest.skip("grpcio-tools is not installed (the dev extra installs it)")
    # In a child: the generated module registers the same file in protobuf's default pool, which the process
    # that already imported smiquery's descriptor must not see twice (upb crashes on it instead of raising).
    code = (
        "import importlib.util, sys\n"
        "from grpc_tools import protoc\n"
        "proto, out = sys.argv[1], sys.argv[2]\n"
        "assert protoc.main(['protoc', '-I' + proto.rsplit('/', 1)[0], '--python_out=' + out, proto]) == 0\n"
        "spec = importlib.util.spec_from_file_location('podresources_pb2', out + '/podresources_pb2.py')\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "sys.stdout.write(mod.DESCRIPTOR.serialized_pb.hex())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(PROTO), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert bytes.fromhex(done.stdout) == podresources.FILE_DESCRIPTOR


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
