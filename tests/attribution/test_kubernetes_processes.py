"""Per-pod use of shared GPUs: /proc cgroup fixtures (v1, v2; containerd, CRI-O, docker) and a stand-in API server
answering a node's pods list over HTTPS (its own CA), read as a pod does: the service account's token and CA and
``KUBERNETES_SERVICE_HOST``/``PORT``."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from smiquery.attribution import Attribution
from smiquery.attribution.kubernetes import (
    KubernetesBackend,
    PodCgroup,
    PodDirectory,
    get_node_pods,
    parse_cgroup,
    pod_of_pid,
)
from smiquery.errors import KubernetesApiError
from smiquery.exporter.families import workload_families
from smiquery.exporter.pmonwatch import ProcessInstant
from smiquery.sources.apps import GpuProcess
from smiquery.sources.pmon import PmonRow

UID_A = "6b2a3f0e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
UID_B = "9f8e7d6c-5b4a-4321-9876-543210fedcba"
CID = {n: (c * 64) for n, c in (("a", "a"), ("b", "b"), ("c", "c"), ("d", "d"))}
GPU1 = "GPU-c1b0d0c2-7b24-505e-e600-706601380be7"

# Hand-written fixtures, one per runtime and cgroup layout.
CGROUPS = {
    "containerd-v2-systemd": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/"
        f"cri-containerd-{CID['a']}.scope\n",
        PodCgroup(UID_A, CID["a"]),
    ),
    "crio-v2-systemd": (
        f"0::/kubepods.slice/kubepods-pod{UID_B.replace('-', '_')}.slice/crio-{CID['b']}.scope\n",
        PodCgroup(UID_B, CID["b"]),
    ),
    "docker-v1-cgroupfs": (
        "12:memory:/kubepods/besteffort/pod" + UID_A + "/" + CID["c"] + "\n"
        "11:cpu,cpuacct:/kubepods/besteffort/pod" + UID_A + "/" + CID["c"] + "\n1:name=systemd:/\n",
        PodCgroup(UID_A, CID["c"]),
    ),
    "docker-v1-systemd": (
        f"4:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_B.replace('-', '_')}"
        f".slice/docker-{CID['d']}.scope\n0::/\n",
        PodCgroup(UID_B, CID["d"]),
    ),
    "containerd-v1-cgroupfs-guaranteed": (
        f"7:pids:/kubepods/pod{UID_B}/{CID['a']}\n",
        PodCgroup(UID_B, CID["a"]),
    ),
    "host-process-v2": ("0::/system.slice/sshd.service\n", None),
    "crio-conmon": (
        f"0::/kubepods.slice/kubepods-pod{UID_B.replace('-', '_')}.slice/crio-conmon-{CID['b']}.scope\n",
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CGROUPS))
def test_cgroup_paths_name_pod_and_container(case: str) -> None:
    text, want = CGROUPS[case]
    assert parse_cgroup(text) == want


def test_pod_of_pid_reads_a_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(CGROUPS["crio-v2-systemd"][0])
    assert pod_of_pid(4242, str(tmp_path)) == PodCgroup(UID_B, CID["b"])
    assert pod_of_pid(4243, str(tmp_path)) is None  # gone, or in another PID namespace


def _pod(uid: str, ns: str, name: str, node: str, containers: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "namespace": ns, "name": name},
        "spec": {"nodeName": node, "containers": [{"name": c} for c in containers]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": c,
                    "containerID": cid,
                    "image": "x",
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                }
                for c, cid in containers.items()
            ],
        },
    }


TOKEN = "eyJhbGciOiJSUzI1NiJ9.service-account-token"


def _pki(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it: (ca.crt, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key: Any, issuer_key: Any, *, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
        return b.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    srv_key = ec.generate_private_key(ec.SECP256R1())
    paths = d / "ca.crt", d / "server.pem", d / "server.key"
    paths[0].write_bytes(cert("kubernetes", ca_key, ca_key, ca=True).public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert("kube-apiserver", srv_key, ca_key, ca=False).public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        srv_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


class _ApiServer:
    """Answers GET /api/v1/pods?fieldSelector=spec.nodeName=N over HTTPS as the real API server does (a PodList),
    to the service account's bearer token only (else 401 with a Status). ``mode``: "ok", "forbidden" (RBAC's 403),
    "drip" (a byte every tenth of a second, never done), "huge" (a chunked answer without end)."""

    def __init__(self, pods: list[dict[str, Any]], cert: Path, key: Path) -> None:
        self.pods = pods
        self.selectors: list[str] = []
        self.mode = "ok"
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path != "/api/v1/pods":
                    self.send_error(404)
                    return
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self._answer(401, {"kind": "Status", "status": "Failure", "message": "Unauthorized"})
                    return
                sel = parse_qs(url.query).get("fieldSelector", [""])[0]
                outer.selectors.append(sel)
                if outer.mode == "forbidden":
                    msg = (
                        'pods is forbidden: User "system:serviceaccount:smiquery:smiquery-exporter" cannot list '
                        'resource "pods" in API group "" at the cluster scope'
                    )
                    self._answer(403, {"kind": "Status", "status": "Failure", "message": msg, "code": 403})
                    return
                if outer.mode in ("drip", "huge"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"x" * (1 if outer.mode == "drip" else 65536)
                    try:
                        while not outer.stop.wait(0.1 if outer.mode == "drip" else 0):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                    except OSError:
                        pass  # the client hung up, as it should
                    return
                node = sel.removeprefix("spec.nodeName=")
                items = [p for p in outer.pods if p["spec"]["nodeName"] == node]
                self._answer(
                    200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items}
                )

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_ApiServer]:
    ca, cert, key = _pki(tmp_path)
    server = _ApiServer(
        [
            _pod(UID_A, "team-b", "infer-1", "node-7", {"srv": f"containerd://{CID['a']}"}),
            _pod(UID_B, "team-c", "infer-2", "node-7", {"srv": f"cri-o://{CID['b']}"}),
            _pod("11111111-2222-3333-4444-555555555555", "team-x", "elsewhere", "node-8", {"x": "containerd://e"}),
        ],
        cert,
        key,
    )
    sa = tmp_path / "serviceaccount"  # what the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount
    sa.mkdir()
    (sa / "token").write_text(TOKEN + "\n")
    (sa / "ca.crt").write_bytes(ca.read_bytes())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    yield server
    server.close()


def _sa(tmp_path: Path) -> str:
    return str(tmp_path / "serviceaccount")


def test_shared_gpu_use_is_split_by_pod_and_sums_to_the_device(api: _ApiServer, tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, case in ((101, "containerd-v2-systemd"), (202, "crio-v2-systemd"), (303, "host-process-v2")):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(CGROUPS[case][0])
    pods = PodDirectory(node="node-7", service_account=_sa(tmp_path))
    assert pods.refresh()
    assert api.selectors == ["spec.nodeName=node-7"]  # only this node's pods are asked for
    rows = (
        (PmonRow(1, 101, "C", 40, 20), None),
        (PmonRow(1, 202, "C", 25, 10), None),
        (PmonRow(1, 303, "C", 5, 1), None),
        (PmonRow(1, None, None, 3, 2, command="other"), None),  # pmon's own rest row
    )
    instant = ProcessInstant(rows, {1: 4}, 0.0)
    procs = [
        GpuProcess(pid=101, process_name="python", gpu_uuid=GPU1, gpu_index=1, used_memory=1024),
        GpuProcess(pid=202, process_name="python", gpu_uuid=GPU1, gpu_index=1, used_memory=512),
    ]
    backend = KubernetesBackend(pods=pods, cgroup_of=lambda pid: pod_of_pid(pid, str(proc)))
    fams = workload_families(Attribution(backend), {GPU1: 1}, instant, procs, "uuid", {})
    got = {
        f.name: {(s.labels["namespace"], s.labels["pod"], s.labels["container"]): s.value for s in f.samples}
        for f in fams
    }
    util = got["smiquery_pod_gpu_utilization_ratio"]
    assert util[("team-b", "infer-1", "srv")] == pytest.approx(0.40)
    assert util[("team-c", "infer-2", "srv")] == pytest.approx(0.25)
    assert util[("", "other", "")] == pytest.approx(0.08)  # the host process and pmon's rest
    assert sum(util.values()) == pytest.approx(0.73)  # what pmon saw on the GPU, counted once
    mem = got["smiquery_pod_gpu_memory_used_bytes"]
    assert mem == {("team-b", "infer-1", "srv"): 1024 * 1048576.0, ("team-c", "infer-2", "srv"): 512 * 1048576.0}


def test_api_server_gone_is_said_once_and_use_goes_to_other(
    api: _ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pods = PodDirectory(node="node-7", timeout=5.0, service_account=_sa(tmp_path))
    assert pods.refresh() and pods.up
    api.close()
    assert not pods.refresh() and not pods.refresh()
    assert not pods.up and sum(pods.failures.errors.values()) == 2
    assert sum("listing the pods of node node-7 failed" in r.getMessage() for r in caplog.records) == 1


def test_the_token_is_the_service_accounts_and_the_ca_the_only_one_trusted(api: _ApiServer, tmp_path: Path) -> None:
    sa = tmp_path / "serviceaccount"
    doc = get_node_pods("node-7", service_account=str(sa))
    assert sorted(p["metadata"]["name"] for p in doc["items"]) == ["infer-1", "infer-2"]
    (sa / "token").write_text("rotated-by-the-kubelet")  # read on every call; this one the server does not know
    with pytest.raises(KubernetesApiError, match=r"401.*Unauthorized.*list on pods") as err:
        get_node_pods("node-7", service_account=str(sa))
    assert err.value.status == 401
    (sa / "token").write_text(TOKEN)
    other = tmp_path / "other"
    other.mkdir()
    _pki(other)  # a CA that did not sign the server's certificate
    (sa / "ca.crt").write_bytes((other / "ca.crt").read_bytes())
    with pytest.raises(ssl.SSLCertVerificationError):
        get_node_pods("node-7", service_account=str(sa))


def test_rbac_refusal_is_said_once_with_the_servers_message(
    api: _ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.mode = "forbidden"
    pods = PodDirectory(node="node-7", service_account=_sa(tmp_path))
    assert not pods.refresh() and not pods.refresh()
    assert pods.failures.errors == {"KubernetesApiError": 2}
    said = [r.getMessage() for r in caplog.records if "listing the pods of node node-7 failed" in r.getMessage()]
    assert len(said) == 1 and 'cannot list resource "pods"' in said[0] and "\n" not in said[0]


@pytest.mark.parametrize("mode", ["drip", "huge"])
def test_a_slow_or_endless_answer_is_cut_by_one_deadline_and_a_size_bound(
    api: _ApiServer, tmp_path: Path, mode: str
) -> None:
    """A server that sends a byte every tenth of a second never trips a per-read timeout: the whole call has one.
    An endless answer stops at the bound instead of filling the exporter's memory."""
    api.mode = mode
    pods = PodDirectory(node="node-7", timeout=1.5, service_account=_sa(tmp_path), max_bytes=1 << 20)
    started = time.monotonic()
    assert not pods.refresh()
    took = time.monotonic() - started
    assert pods.failures.errors == {"TimeoutError" if mode == "drip" else "KubernetesApiError": 1}
    assert took < 10  # the drip goes on for ever; only the deadline ends it


def test_outside_a_pod_says_what_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubernetesApiError, match=r"KUBERNETES_SERVICE_HOST is not set.*in a pod"):
        get_node_pods("node-7", service_account=str(tmp_path))
