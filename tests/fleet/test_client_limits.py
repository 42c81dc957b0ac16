"""The fleet client does not trust its server: answer size, answer time and redirects, against real local sockets.

Each server here is a real HTTP server on 127.0.0.1 (http.server in a thread) that misbehaves on purpose: a body
bigger than the limit (streamed, never held), a trickle of one byte every half second, a redirect to another port
that records the headers it is sent, same-origin redirects of a POST query.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from smiquery.errors import PrometheusError, PrometheusQueryError, PrometheusUnreachableError
from smiquery.fleet import HttpConfig, PrometheusClient

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
VECTOR = {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, "7"]}]}}


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Server:
    url: str
    seen: list[Seen] = field(default_factory=list)
    sent: int = 0  # body bytes a streaming answer got out before the client hung up
    stop: threading.Event = field(default_factory=threading.Event)


Respond = Callable[[BaseHTTPRequestHandler, Server], None]


@contextmanager
def serving(respond: Respond) -> Iterator[Server]:
    """An HTTP server on 127.0.0.1 and a free port that records each request and answers with ``respond``."""
    state = Server("")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            state.seen.append(Seen(self.command, self.path, dict(self.headers), body))
            try:
                respond(self, state)
            except OSError:  # the client hung up, as it should on a huge or slow answer
                pass
            self.close_connection = True

        do_GET = do_POST

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.stop.set()  # ends a trickle still going
        server.shutdown()
        server.server_close()
        thread.join(10)


def send_json(h: BaseHTTPRequestHandler, doc: Any = VECTOR, status: int = 200) -> None:
    body = json.dumps(doc).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def stream_body(h: BaseHTTPRequestHandler, state: Server, total: int, *, chunked: bool) -> None:
    """``total`` bytes of one long JSON string, made on the fly a MiB at a time (never held whole)."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    if chunked:
        h.send_header("Transfer-Encoding", "chunked")
    h.send_header("Connection", "close")  # without a length: the body ends when the connection does
    h.end_headers()

    def emit(data: bytes) -> None:
        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)

    block = b"x" * MiB
    emit(b'{"status":"success","data":"')
    while state.sent < total and not state.stop.is_set():
        emit(block)
        state.sent += len(block)
    emit(b'"}')
    if chunked:
        h.wfile.write(b"0\r\n\r\n")


# ---------------------------------------------------------------------------------------------------------------
# size


CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from smiquery.errors import PrometheusQueryError
    from smiquery.fleet import PrometheusClient

    client = PrometheusClient(sys.argv[1], timeout=60, max_answer_bytes=int(sys.argv[2]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        client.query("up")
        error = None
    except PrometheusQueryError as exc:
        error = str(exc)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"error": error, "growth_kib": peak - before}))
    """
)


def test_a_huge_answer_is_cut_at_the_limit_and_memory_stays_bounded():
    # 400 MiB streamed without a Content-Length; the client, in its own process so that its peak RSS is its own
    # (ru_maxrss: the high-water mark, which a sampler could miss), gives up at the 16 MiB limit
    total = 400 * MiB
    with serving(lambda h, s: stream_body(h, s, total, chunked=False)) as server:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, server.url, str(16 * MiB)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert got["error"] is not None, "the whole answer was read"
        assert "over the limit of 16 MiB" in got["error"]
        assert "raise --max-answer" in got["error"]
        assert "\n" not in got["error"]
        assert got["growth_kib"] < 100 * 1024, f"peak RSS grew {got['growth_kib'] / 1024:.0f} MiB"
    assert server.sent < total  # the client hung up instead of taking it all


def test_a_chunked_answer_over_the_limit_is_a_query_error():
    over = r"sent more than 1,048,576 bytes, over the limit of 1 MiB"
    with (
        serving(lambda h, s: stream_body(h, s, 64 * MiB, chunked=True)) as server,
        pytest.raises(PrometheusQueryError, match=over),
    ):
        PrometheusClient(server.url, max_answer_bytes=MiB).query("up")
    assert server.sent < 64 * MiB


def test_a_content_length_over_the_limit_fails_before_reading():
    def announce(h: BaseHTTPRequestHandler, state: Server) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(2**40))  # a TiB, of which nothing comes
        h.end_headers()
        h.wfile.flush()
        state.stop.wait(60)

    with serving(announce) as server:
        began = time.monotonic()
        with pytest.raises(PrometheusQueryError, match=r"announces 1,099,511,627,776 bytes, over the limit of 512 MiB"):
            PrometheusClient(server.url, timeout=60).query("up")
        assert time.monotonic() - began < 10  # not the 60 s timeout: the header alone decided


def test_an_answer_within_the_limit_is_read():
    with serving(lambda h, s: send_json(h)) as server:
        assert PrometheusClient(server.url, max_answer_bytes=200).query("up")[0]["value"] == [1, "7"]


# ---------------------------------------------------------------------------------------------------------------
# time


def trickle_body(h: BaseHTTPRequestHandler, state: Server) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", "60")
    h.end_headers()
    h.wfile.flush()
    for _ in range(60):  # 30 s, a byte at a time: each socket read gets a byte well within the timeout
        h.wfile.write(b" ")
        h.wfile.flush()
        if state.stop.wait(0.5):
            return


def trickle_headers(h: BaseHTTPRequestHandler, state: Server) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nX-Padding: " + b"x" * 58:
        h.wfile.write(bytes([byte]))
        h.wfile.flush()
        if state.stop.wait(0.5):
            return


@pytest.mark.parametrize("respond", [trickle_body, trickle_headers], ids=["body", "headers"])
def test_a_trickled_answer_is_cut_at_the_timeout(respond):
    with serving(respond) as server:
        began = time.monotonic()
        with pytest.raises(PrometheusUnreachableError, match=r"did not give its whole answer within 2 s"):
            PrometheusClient(server.url, timeout=2).query("up")
        elapsed = time.monotonic() - began
    assert 1.5 < elapsed < 10, f"{elapsed:.1f} s"


# ---------------------------------------------------------------------------------------------------------------
# redirects


@pytest.mark.parametrize(
    "config",
    [HttpConfig(bearer_token="s3cret"), HttpConfig(username="ops", password="pw")],
    ids=["bearer", "basic"],
)
def test_a_redirect_to_another_port_is_not_followed_and_gets_no_credentials(config):
    with serving(lambda h, s: send_json(h)) as elsewhere:
        target = f"{elsewhere.url}/api/v1/query"

        def away(h: BaseHTTPRequestHandler, state: Server) -> None:
            h.send_response(302)
            h.send_header("Location", target)
            h.send_header("Content-Length", "0")
            h.end_headers()

        with serving(away) as server:
            with pytest.raises(PrometheusError, match="another origin") as info:
                PrometheusClient(server.url, config=config).query("up")
            assert server.seen[0].headers.get("Authorization")  # the server given gets them
    assert target in str(info.value)
    assert "\n" not in str(info.value)
    assert not any("Authorization" in s.headers for s in elsewhere.seen)
    assert elsewhere.seen == []  # not even asked


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_same_origin_redirect_keeps_the_post_and_its_body(code):
    def moved(h: BaseHTTPRequestHandler, state: Server) -> None:
        if h.path.startswith("/new/"):
            send_json(h)
            return
        h.send_response(code)
        h.send_header("Location", "/new" + h.path)  # relative: the same origin
        h.send_header("Content-Length", "5")
        h.end_headers()
        h.wfile.write(b"moved")

    with serving(moved) as server:
        got = PrometheusClient(server.url, config=HttpConfig(bearer_token="s3cret")).query("up")
    assert got[0]["value"] == [1, "7"]
    first, second = server.seen
    assert (first.path, second.path) == ("/api/v1/query", "/new/api/v1/query")
    assert second.method == "POST"
    assert second.body == first.body
    assert b"query=up" in second.body
    assert second.headers["Authorization"] == "Bearer s3cret"


def test_a_redirect_loop_stops_after_five():
    def loop(h: BaseHTTPRequestHandler, state: Server) -> None:
        h.send_response(307)
        h.send_header("Location", f"/hop{len(state.seen)}")
        h.send_header("Content-Length", "0")
        h.end_headers()

    too_many = r"redirected more than 5 times \(last to http://127.0.0.1:\d+/hop6\)"
    with serving(loop) as server, pytest.raises(PrometheusError, match=too_many):
        PrometheusClient(server.url).query("up")
    assert len(server.seen) == 6  # the query and five redirects followed


# ---------------------------------------------------------------------------------------------------------------
# the command line


def big_answer(h: BaseHTTPRequestHandler, state: Server) -> None:
    send_json(h, {"status": "success", "data": {"resultType": "vector", "result": [], "pad": "x" * (2 * MiB)}})


@pytest.mark.parametrize(
    "args",
    [["top", "--once", "--prometheus"], ["report", "--start", "now-1h", "--prometheus"]],
    ids=["top", "report"],
)
def test_max_answer_option_is_one_line_and_exit_1(args):
    with serving(big_answer) as server:
        done = subprocess.run(
            [sys.executable, "-m", "smiquery", *args, server.url, "--max-answer", "1"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "over the limit of 1 MiB; raise --max-answer" in lines[0]


@pytest.mark.parametrize("pyarrow", [True, False])
def test_range_answers_parse_alike_with_or_without_pyarrow(monkeypatch, pyarrow):
    import numpy as np

    from smiquery.fleet.client import _matrix

    if not pyarrow:
        monkeypatch.setitem(sys.modules, "pyarrow.csv", None)  # import fails: numpy's parser
    head = b'{"status":"success","data":{"resultType":"matrix","result":['
    series = b'{"metric":{"a":"x,\\"values\\":[["},"values":[[1,"2"],[3.5,"NaN"]]},{"metric":{},"values":[[4,"+Inf"]]}'
    ((labels, t1, v1), (empty, t2, v2)) = _matrix(head + series + b"]}}")  # type: ignore[misc]
    assert labels == {"a": 'x,"values":[['} and empty == {}
    assert t1.tolist() == [1.0, 3.5] and v1[0] == 2.0 and np.isnan(v1[1])
    assert t2.tolist() == [4.0] and v2.tolist() == [float("inf")]
    # another shape, or a sample that is not a number: None, and the caller reads the answer as JSON
    assert _matrix(head + series.replace(b'"2"', b'"x"') + b"]}}") is None
    assert _matrix(b'{"status":"success","data":{"resultType":"vector","result":[]}}') is None
