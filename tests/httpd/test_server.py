"""The HTTP server of the exporter and the training metrics under hostile clients: raw sockets, real TLS, a fuzzed
request path (issue 24), and the web-config file that sets its TLS and basic auth.

These run :class:`~smiquery.httpd.server.HttpServer` directly with a small router (basic auth from a real
:class:`~smiquery.httpd.webconfig.WebConfig`), so no nvidia-smi is involved; ``serve()`` wires the same pieces.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smiquery.errors import WebConfigError
from smiquery.httpd.server import HttpServer, Request, Response, _parse
from smiquery.httpd.webconfig import WebConfig, load_web_config

BIG = b"# metrics\n" + b"x" * 262_144 + b"\n"  # big enough to fill socket buffers


def _hash(password: str, rounds: int = 4) -> bytes:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=rounds))


def _auth(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class Router:
    def __init__(self, web: WebConfig) -> None:
        self.web = web

    def fast(self, req: Request) -> bool:
        return self.web.verdict(req.headers.get("authorization")) is not None

    def __call__(self, req: Request) -> Response:
        if not self.web.authorized(req.headers.get("authorization")):
            return Response(401, b"unauthorized\n")
        if req.path == "/metrics":
            return Response(200, BIG)
        return Response(200, b"ok\n")


@contextlib.contextmanager
def running(web: WebConfig | None = None, **kw: Any) -> Iterator[HttpServer]:
    web = web if web is not None else WebConfig()
    router = Router(web)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    kw.setdefault("request_timeout", 60.0)  # long: a test that waited for a deadline would time out instead
    server = HttpServer(
        sock,
        router,
        web=web,
        inline=router.fast,
        **kw,
    )
    try:
        yield server
    finally:
        server.shutdown()


def port_of(server: HttpServer) -> int:
    return int(server.sock.getsockname()[1])


def exchange(port: int, raw: bytes, timeout: float = 10.0, ctx: ssl.SSLContext | None = None) -> bytes:
    """Send ``raw`` (then half-close, over plain TCP) and read everything the server answers until it closes."""
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=timeout))
        if ctx is not None:
            s = stack.enter_context(ctx.wrap_socket(s, server_hostname="127.0.0.1"))
        s.sendall(raw)
        if ctx is None:
            with contextlib.suppress(OSError):  # the server may have closed first (a request it refused at once)
                s.shutdown(socket.SHUT_WR)
        data = b""
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            while chunk := s.recv(65536):
                data += chunk
        return data


def statuses(data: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"(?:^|\n)HTTP/1\.1 (\d{3}) ", data)]


def livez(port: int, ctx: ssl.SSLContext | None = None) -> int:
    data = exchange(port, b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", ctx=ctx)
    return statuses(data)[0]


@pytest.fixture(scope="module")
def auth_web() -> WebConfig:
    web = WebConfig(users={"prometheus": _hash("s3cret")})
    return web


# ------------------------------------------------------------------------------------------ item 1-4: one request


@pytest.mark.parametrize("with_auth", [False, True])
def test_a_content_length_that_isdigit_accepts_is_a_400_and_the_server_goes_on(with_auth, auth_web):
    web = auth_web if with_auth else None
    with running(web) as server:
        port = port_of(server)
        auth = f"Authorization: {_auth('prometheus', 's3cret')}\r\n".encode() if with_auth else b""
        raw = b"GET /livez HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: \xb2\r\n\r\n"
        assert statuses(exchange(port, raw)) == [400]
        ok = f"GET /livez HTTP/1.1\r\nHost: x\r\n{auth.decode()}Connection: close\r\n\r\n".encode()
        assert statuses(exchange(port, ok)) == [200]
        assert server.alive and server.failures == 0


def test_800_pipelined_requests_in_one_write_are_all_answered_in_order():
    with running() as server:
        port = port_of(server)
        raw = b"".join(f"GET /livez?{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(800))
        data = exchange(port, raw, timeout=60)
        assert statuses(data) == [200] * 800
        assert livez(port) == 200
        assert server.alive and server.failures == 0


@pytest.mark.parametrize("tls", [False, True])
def test_a_non_ascii_basic_auth_header_is_a_401_without_a_traceback(tls, pki, caplog):
    web = WebConfig(users={"prometheus": _hash("s3cret")})
    ctx = None
    if tls:
        web = load_web_config(write_web(pki, ""))
        web.users["prometheus"] = _hash("s3cret")
        ctx = client_ctx(pki)
    caplog.set_level(logging.INFO, logger="smiquery")
    with running(web) as server:
        port = port_of(server)
        raw = b"GET /livez HTTP/1.1\r\nHost: x\r\nAuthorization: Basic \xe9\r\nConnection: close\r\n\r\n"
        for _ in range(20):
            assert statuses(exchange(port, raw, ctx=ctx)) == [401]
        assert livez(port, ctx) == 401  # no credentials: refused, but answered
        assert server.alive and server.failures == 0
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_two_content_lengths_are_a_400_and_the_body_is_never_a_second_request():
    with running() as server:
        smuggled = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        raw = (
            b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: "
            + str(len(smuggled)).encode()
            + b"\r\nContent-Length: 0\r\n\r\n"
            + smuggled
        )
        assert statuses(exchange(port_of(server), raw)) == [400]


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"GET /livez HTTP/1.1\nHost: x\n\n", id="bare-LF"),
        pytest.param(b"GET /livez HTTP/1.1\rHost: x\r\n\r\n", id="bare-CR"),
        pytest.param(b"GET /livez HTTP/1.1\r\nHost: x\r\nX-a: b\x00c\r\n\r\n", id="NUL-in-value"),
        pytest.param(b"GET /livez HTTP/1.1\r\nHost: x\r\nX\x00a: b\r\n\r\n", id="NUL-in-name"),
        pytest.param(b"GET /livez HTTP/1.1\r\n\r\n", id="HTTP/1.1-without-Host"),
        pytest.param(b"GET /livez HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", id="two-Hosts"),
        pytest.param(b"GET /livez HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", id="obs-fold"),
        pytest.param(b"GET /livez HTTP/1.1\r\nHost : x\r\n\r\n", id="space-before-colon"),
        pytest.param(b"GET  /livez HTTP/1.1\r\nHost: x\r\n\r\n", id="two-spaces"),
        pytest.param(b"GET livez HTTP/1.1\r\nHost: x\r\n\r\n", id="not-origin-form"),
        pytest.param(b"GET /livez HTTP/2.0\r\nHost: x\r\n\r\n", id="version"),
        pytest.param(b"GET /livez HTTP/1.1\r\nHost: x\r\nContent-Length: -0\r\n\r\n", id="signed-length"),
        pytest.param(b"G\xc3T /livez HTTP/1.1\r\nHost: x\r\n\r\n", id="non-token-method"),
    ],
)
def test_malformed_heads_are_refused_at_once(raw):
    with running() as server:
        # the server's request deadline is 60 s and this client waits 10 s: only an immediate answer passes
        data = exchange(port_of(server), raw, timeout=10)
        assert statuses(data) == [400]
        assert data.count(b"HTTP/1.1 ") == 1
        assert server.alive and server.failures == 0


def test_http_1_0_without_host_and_repeated_list_headers_are_fine():
    with running() as server:
        port = port_of(server)
        assert statuses(exchange(port, b"GET /livez HTTP/1.0\r\n\r\n")) == [200]
        raw = b"GET /livez HTTP/1.1\r\nHost: x\r\nAccept: a\r\nAccept: b\r\nConnection: close\r\n\r\n"
        assert statuses(exchange(port, raw)) == [200]


# ------------------------------------------------------------------------------ the loop cannot die


def test_a_raise_while_handling_one_connection_closes_that_one_only(monkeypatch, caplog):
    with running() as server:
        port = port_of(server)
        real = server._process
        calls = {"n": 0}

        def flaky(conn: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a bug")
            real(conn)

        monkeypatch.setattr(server, "_process", flaky)
        with caplog.at_level(logging.WARNING, logger="smiquery"):
            first = exchange(port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
            assert first == b""  # that connection was closed without an answer
            assert livez(port) == 200
        assert server.alive and server.failures == 1
        assert sum("a connection failed" in r.getMessage() for r in caplog.records) == 1


def test_a_raise_in_the_loop_itself_is_survived(monkeypatch):
    with running() as server:
        real = server._expire
        calls = {"n": 0}

        def flaky(now: float) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("a bug")
            real(now)

        monkeypatch.setattr(server, "_expire", flaky)
        deadline = time.monotonic() + 30
        while calls["n"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert calls["n"] >= 3
        assert server.alive and livez(port_of(server)) == 200


# ------------------------------------------------------------------------------ fuzzing the request path

_PIECES = [
    b"GET ",
    b"HEAD ",
    b"/metrics",
    b"/livez",
    b" HTTP/1.1",
    b" HTTP/1.0",
    b"\r\n",
    b"\r\n\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b"\xb2",
    b"\xe9",
    b"Host: x",
    b"Content-Length: ",
    b"Content-Length: 0",
    b"Content-Length: 5",
    b"Transfer-Encoding: chunked",
    b"Connection: close",
    b"Connection: keep-alive",
    b"Authorization: Basic ",
    b"cHJvbWV0aGV1czpzM2NyZXQ=",
    b"Authorization: Basic \xe9",
    b": ",
    b" ",
    b"\t",
]
_REQUEST_BYTES = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.sampled_from(_PIECES), st.binary(max_size=8)), max_size=40).map(b"".join),
)


@given(st.binary(max_size=400).map(lambda b: b + b"\r\n\r\n"))
@settings(max_examples=500, deadline=None)
def test_parse_never_raises_and_answers_4xx_or_a_request(head):
    req, status = _parse(head, "c")
    assert (req is not None and status == 0) or (req is None and status in (400, 413))


@given(_REQUEST_BYTES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_request_bytes_stop_the_server(fuzz_server, raw):
    server, port = fuzz_server
    data = exchange(port, raw, timeout=20)
    assert all(code in (200, 400, 401, 408, 413, 431) for code in statuses(data))
    assert livez(port) in (200, 401)
    assert server.alive and server.failures == 0


@pytest.fixture(scope="module")
def fuzz_server(auth_web: WebConfig) -> Iterator[tuple[HttpServer, int]]:
    with running(auth_web, request_timeout=5.0) as server:
        yield server, port_of(server)


# ------------------------------------------------------------------------------ item 5: TLS slow readers


def test_tls_slow_readers_hold_no_worker(pki):
    web = load_web_config(write_web(pki, ""))
    with running(web, workers=2, write_timeout=120.0) as server:
        port = port_of(server)
        slow = []
        try:
            for _ in range(16):
                plain = socket.socket()
                plain.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
                plain.settimeout(10)
                plain.connect(("127.0.0.1", port))
                s = client_ctx(pki).wrap_socket(plain, server_hostname="127.0.0.1")
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 4)  # and never read
                slow.append(s)
            # with the old blocking writes both workers sat in sendall for write_timeout (120 s) here
            t0 = time.monotonic()
            assert livez(port, client_ctx(pki)) == 200
            data = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 30, client_ctx(pki))
            assert data.endswith(BIG)
            assert time.monotonic() - t0 < 30
        finally:
            for s in slow:
                s.close()
        assert server.alive


# ------------------------------------------------------------------------------ item 6: web config keys, real TLS


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1, and client certificates with SAN ``prometheus`` and ``intruder``."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = tmp_path_factory.mktemp("pki")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())

    def make(cn: str, key: Any, *, ca: bool = False, usage: Any = None, san: Any = None) -> Any:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "issue24 CA")]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(ca_key, hashes.SHA256())

    out: dict[str, Path] = {}

    def save(name: str, cert: Any, key: Any) -> None:
        out[name] = d / f"{name}.pem"
        out[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            out[name + "_key"] = d / f"{name}.key"
            out[name + "_key"].write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )

    save("ca", make("issue24 CA", ca_key, ca=True), None)
    k = ec.generate_private_key(ec.SECP256R1())
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    save("server", make("127.0.0.1", k, usage=ExtendedKeyUsageOID.SERVER_AUTH, san=san), k)
    for who in ("prometheus", "intruder"):
        k = ec.generate_private_key(ec.SECP256R1())
        save(who, make(who, k, usage=ExtendedKeyUsageOID.CLIENT_AUTH, san=[x509.DNSName(who)]), k)
    return out


def write_web(pki: dict[str, Path], tls_extra: str, top_extra: str = "") -> Path:
    path = pki["ca"].parent / f"web-{abs(hash((tls_extra, top_extra)))}.yml"
    path.write_text(
        f"tls_server_config:\n  cert_file: {pki['server']}\n  key_file: {pki['server_key']}\n{tls_extra}{top_extra}",
        encoding="utf-8",
    )
    return path


def client_ctx(pki: dict[str, Path], who: str | None = None, **kw: Any) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    for k, v in kw.items():
        setattr(ctx, k, v)
    if who is not None:
        ctx.load_cert_chain(str(pki[who]), str(pki[who + "_key"]))
    return ctx


MTLS = "  client_ca_file: {ca}\n  client_auth_type: RequireAndVerifyClientCert\n"


def test_client_allowed_sans_lets_only_the_listed_names_in(pki):
    extra = MTLS.format(ca=pki["ca"]) + "  client_allowed_sans: [prometheus]\n"
    with running(load_web_config(write_web(pki, extra))) as server:
        port = port_of(server)
        assert livez(port, client_ctx(pki, "prometheus")) == 200
        with pytest.raises((ssl.SSLError, ConnectionError, IndexError)):
            livez(port, client_ctx(pki, "intruder"))  # same CA, wrong SAN: the connection is closed
        assert livez(port, client_ctx(pki, "prometheus")) == 200


def test_max_version_and_cipher_suites_are_applied(pki):
    extra = "  max_version: TLS12\n  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"
    with (
        running(load_web_config(write_web(pki, extra))) as server,
        socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as plain,
        client_ctx(pki).wrap_socket(plain, server_hostname="127.0.0.1") as s,
    ):
        assert s.version() == "TLSv1.2"
        assert s.cipher()[0] == "ECDHE-ECDSA-AES128-GCM-SHA256"
    with running(load_web_config(write_web(pki, "  max_version: TLS12\n"))) as server:
        only13 = client_ctx(pki, minimum_version=ssl.TLSVersion.TLSv1_3)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            livez(port_of(server), only13)


def test_http_server_config_headers_are_sent(pki):
    top = "http_server_config:\n  headers:\n    Strict-Transport-Security: max-age=31536000\n"
    with running(load_web_config(write_web(pki, "", top))) as server:
        raw = b"GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        data = exchange(port_of(server), raw, ctx=client_ctx(pki))
        assert b"\r\nStrict-Transport-Security: max-age=31536000\r\n" in data


def test_inline_pem_cert_and_key(pki):
    def block(name: str, path: Path) -> str:
        return f"  {name}: |\n" + "".join(f"    {line}\n" for line in path.read_text().splitlines())

    path = pki["ca"].parent / "inline.yml"
    path.write_text("tls_server_config:\n" + block("cert", pki["server"]) + block("key", pki["server_key"]))
    with running(load_web_config(path)) as server:
        assert livez(port_of(server), client_ctx(pki)) == 200


@pytest.mark.parametrize(
    ("extra", "top", "message"),
    [
        ("  client_auth_type: RequireAnyClientCert\n", "", "RequireAnyClientCert (a certificate taken without"),
        ("  client_auth_type: RequestClientCert\n", "", "RequestClientCert (a certificate taken without"),
        ("  curve_preferences: [X25519]\n", "", "curve_preferences is not supported"),
        ("  min_version: TLS14\n", "", "min_version must be one of"),
        ("  cipher_suites: [TLS_MADE_UP]\n", "", "unknown suite(s) TLS_MADE_UP"),
        ("  client_allowed_sans: [x]\n", "", "client_allowed_sans needs RequireAndVerifyClientCert"),
        ("  client_auth_type: VerifyClientCertIfGiven\n", "", "needs client_ca_file"),
        ("", "http_server_config:\n  http2: true\n", "http2: true is not supported"),
        ("", "http_server_config:\n  headers:\n    X-Powered-By: me\n", "X-Powered-By is not one of"),
    ],
)
def test_unsupported_web_config_keys_refuse_to_start_with_one_line(pki, extra, top, message):
    with pytest.raises(WebConfigError, match=re.escape(message)) as info:
        load_web_config(write_web(pki, extra, top))
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------ item 7: basic-auth timing


def _took(web: WebConfig, header: str) -> float:
    web._bad.clear()  # each try must pay its bcrypt check
    t0 = time.perf_counter()
    assert not web.authorized(header)
    return time.perf_counter() - t0


def test_an_unknown_user_takes_as_long_as_a_wrong_password():
    web = WebConfig(users={"prometheus": _hash("s3cret", rounds=10)})
    known, unknown = _auth("prometheus", "wrong"), _auth("nobody", "wrong")
    ratios = []
    for i in range(7):
        # a pair of tries next to each other, in turn order, so that a load that comes and goes on a shared machine
        # weighs on both; the median of the pairs' ratios, so that one pair caught by a burst does not decide
        first, second = (known, unknown) if i % 2 else (unknown, known)
        a, b = _took(web, first), _took(web, second)
        ratios.append(a / b if first is unknown else b / a)
    ratio = sorted(ratios)[len(ratios) // 2]
    # before: 0.2 ms against ~210 ms (ratio ~0.001); a cost-4 dummy hash would still be ~0.02
    assert 1 / 3 < ratio < 3, ratios


def test_an_unknown_user_costs_one_bcrypt_check_of_the_users_cost(monkeypatch):
    """The same work, counted rather than timed: one bcrypt check with a hash of the same cost as a real user's."""
    import bcrypt

    web = WebConfig(users={"prometheus": _hash("s3cret", rounds=6)})
    seen: list[bytes] = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        seen.append(hashed)
        return bool(real(password, hashed))

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    assert not web.authorized(_auth("prometheus", "wrong"))
    assert not web.authorized(_auth("nobody", "wrong"))
    assert not web.authorized(_auth("nobody", "s3cret"))  # the dummy hash is no one's password
    assert [h[:7] for h in seen] == [b"$2b$06$"] * 3
    assert seen[1] != web.users["prometheus"]


class _Blocked:
    """bcrypt.checkpw that waits for :attr:`release`, counting the checks that began."""

    def __init__(self) -> None:
        import bcrypt

        self.real = bcrypt.checkpw
        self.release = threading.Event()
        self.began = 0
        self.lock = threading.Lock()

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        with self.lock:
            self.began += 1
        assert self.release.wait(120)
        return bool(self.real(password, hashed))


def _get(port: int, header: str, timeout: float = 30.0) -> int:
    raw = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {header}\r\nConnection: close\r\n\r\n".encode()
    got = statuses(exchange(port, raw, timeout=timeout))
    return got[0] if got else 0


def _wait(check: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_password_guesses_never_hold_the_workers_that_serve_a_known_credential(monkeypatch):
    import bcrypt

    web = WebConfig(users={"prometheus": _hash("s3cret")})
    good = _auth("prometheus", "s3cret")
    assert web.authorized(good)  # scraped before: remembered
    blocked = _Blocked()
    monkeypatch.setattr(bcrypt, "checkpw", blocked)
    router = Router(web)
    monkeypatch.setattr(router, "fast", lambda req: False)  # like OpenMetrics: every answer is a worker's
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = HttpServer(sock, router, inline=router.fast, workers=2, web=web, auth_queue=4)
    port = port_of(server)
    answers: list[int] = []
    try:
        attackers = [
            threading.Thread(target=lambda i=i: answers.append(_get(port, _auth("prometheus", f"guess{i}"), 120)))
            for i in range(20)
        ]
        for t in attackers:
            t.start()
        # one guess is in bcrypt (blocked), 3 wait behind it, the other 16 were answered 429 (a second later)
        _wait(lambda: blocked.began == 1 and server.pending_checks == 4 and len(answers) == 16, "attackers queued")
        assert answers == [429] * 16
        for _ in range(20):  # before: each waited behind the guesses holding both workers (here: forever)
            t0 = time.monotonic()
            assert _get(port, good) == 200
            assert time.monotonic() - t0 < 10
        assert blocked.began == 1 and server.pending_checks == 4  # the guesses still wait: nobody waited on them
        assert _get(port, _auth("prometheus", "another guess")) == 429
        blocked.release.set()
        for t in attackers:
            t.join(60)
        assert sorted(answers) == [401] * 4 + [429] * 16
        assert server.shed == 17 and server.pending_checks == 0 and server.alive
    finally:
        blocked.release.set()
        server.shutdown()


def _server_threads() -> list[int]:
    return sorted(t.ident or 0 for t in threading.enumerate() if t.name.startswith("smiquery-http"))


def test_a_shed_guess_waits_for_its_429_without_a_thread(auth_web, monkeypatch):
    """Past the queue a guesser is answered 429 a second later: retrying at once cannot flood the server."""
    import bcrypt

    blocked = _Blocked()
    monkeypatch.setattr(bcrypt, "checkpw", blocked)
    with running(auth_web, auth_queue=1) as server:
        port = port_of(server)
        first = threading.Thread(target=_get, args=(port, _auth("prometheus", "first guess"), 120))
        first.start()
        try:
            _wait(lambda: blocked.began == 1, "the first guess in bcrypt")
            threads = _server_threads()  # earlier tests' server threads may end meanwhile, never start
            t0 = time.monotonic()
            assert _get(port, _auth("prometheus", "second guess")) == 429
            assert time.monotonic() - t0 >= 0.9  # held, not answered at once
            assert set(_server_threads()) <= set(threads) and server.shed == 1  # no thread started for it
        finally:
            blocked.release.set()
            first.join(60)


def test_a_credential_checked_by_the_verifier_is_answered_like_any_other_and_pipelining_goes_on(auth_web):
    with running(auth_web) as server:
        port = port_of(server)
        good, bad = _auth("prometheus", "s3cret"), _auth("prometheus", "pipelined-wrong")
        auth_web._ok.clear()
        raw = b"".join(
            f"GET /livez HTTP/1.1\r\nHost: x\r\nAuthorization: {h}\r\n\r\n".encode() for h in (bad, good, bad, good)
        )
        data = exchange(port, raw + b"HEAD /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert statuses(data) == [401, 200, 401, 200, 401]
        assert data.count(b'WWW-Authenticate: Basic realm="smiquery"') == 3
        assert server.pending_checks == 0 and server.failures == 0


def test_a_recent_failure_is_refused_without_another_bcrypt_check():
    web = WebConfig(users={"prometheus": _hash("s3cret", rounds=10)})
    header = _auth("prometheus", "wrong")
    t0 = time.perf_counter()
    assert not web.authorized(header)
    first = time.perf_counter() - t0
    assert web.verdict(header) is not None  # so the selector thread answers it inline
    t0 = time.perf_counter()
    assert not web.authorized(header)
    again = time.perf_counter() - t0
    assert again < first / 10, (again, first)
    assert web.authorized(_auth("prometheus", "s3cret"))  # a failure cached does not lock the user out


def test_only_one_bcrypt_check_runs_at_a_time(monkeypatch):
    import bcrypt

    web = WebConfig(users={"prometheus": _hash("s3cret")})
    active = {"now": 0, "most": 0}
    lock = threading.Lock()
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        with lock:
            active["now"] += 1
            active["most"] = max(active["most"], active["now"])
        time.sleep(0.02)
        try:
            return bool(real(password, hashed))
        finally:
            with lock:
                active["now"] -= 1

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    threads = [threading.Thread(target=web.authorized, args=(_auth("prometheus", f"guess{i}"),)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert active["most"] == 1
    assert len(web._bad) == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("basic_auth_users:\n  u: plain\n", "not a bcrypt hash"),
        ("tls_server_config:\n  cert_file: /nonexistent.pem\n  key_file: /nonexistent.key\n", "cannot load"),
        ("nonsense: 1\n", "unknown key(s) nonsense"),
        ("tls_server_config:\n  cert_file: a\n  bogus: 1\n", "unknown tls_server_config key(s) bogus"),
        ("[1, 2", "not valid YAML"),
    ],
)
def test_web_config_errors_say_what_is_wrong(tmp_path, text, message):
    cfg = tmp_path / "web.yml"
    cfg.write_text(text, encoding="utf-8")
    with pytest.raises(WebConfigError, match=re.escape(message)):
        load_web_config(cfg)
