"""Alert handlers: log, callback, webhook (against a real local HTTP server), and the Notifier."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from smiquery.alerts import AlertEvent, CallbackHandler, LogHandler, Notifier, Rule, WebhookHandler, event_payload
from smiquery.sources.query_gpu import CsvParser
from tests.helpers import wait_for
from tests.leakcheck import no_leaks

T0 = datetime(2026, 3, 14, 9, 30, tzinfo=timezone.utc)


def _event(state: str = "firing", gpu: int = 5, value: int = 88) -> AlertEvent:
    rule = Rule.parse("temperature.gpu > 85 for 3")
    return AlertEvent(rule, gpu, "GPU-1", value, state, T0, T0 + timedelta(seconds=2), 2.0)  # type: ignore[arg-type]


def _samples(temps: list[int], gpu: int = 0) -> list[object]:
    parser = CsvParser(["timestamp", "index", "temperature.gpu"])
    lines = [
        f"{(T0 + timedelta(seconds=i)).strftime('%Y/%m/%d %H:%M:%S.000')}, {gpu}, {t}" for i, t in enumerate(temps)
    ]
    return list(parser.parse(lines))


# ------------------------------------------------------------------------------------------- local server


class _Server:
    """A threaded HTTP server on 127.0.0.1 (a free port) whose behaviour a test sets: ok, fail or slow."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []
        self.mode = "ok"
        self.delay = 0.0
        self.times: list[float] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                outer.times.append(time.monotonic())
                if outer.delay:
                    time.sleep(outer.delay)
                outer.bodies.append(json.loads(body))
                code = 200 if outer.mode == "ok" else 500
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    try:
        yield s
    finally:
        s.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------------------------------- tests


def test_log_handler_logs_firing_as_warning_and_cleared_as_info(caplog):
    caplog.set_level(logging.INFO, logger="smiquery.alerts")
    h = LogHandler()
    h(_event("firing"), {"epoch": 2, "batch": 17, "learning_rate": 0.001})
    h(_event("cleared", value=80), {})
    firing, cleared = caplog.records
    assert firing.levelno == logging.WARNING
    assert "ALERT firing GPU 5" in firing.getMessage()
    assert "epoch=2, batch=17, learning_rate=0.001" in firing.getMessage()
    assert cleared.levelno == logging.INFO
    assert "cleared" in cleared.getMessage()


def test_callback_handler_swallows_and_logs_exceptions(caplog):
    seen = []
    ok = CallbackHandler(lambda e, ctx: seen.append((e.gpu, dict(ctx))))
    ok(_event(), {"epoch": 1})
    assert seen == [(5, {"epoch": 1})]

    def broken(event: AlertEvent, ctx: object) -> None:
        raise RuntimeError("handler bug")

    bad = CallbackHandler(broken)
    bad(_event(), {})  # must not raise
    assert bad.failures == 1
    assert "handler bug" in caplog.text


def test_event_payload_is_json_with_context():
    payload = event_payload(_event(), {"epoch": 3, "learning_rate": float("nan"), "when": T0})
    text = json.dumps(payload)  # serialisable
    back = json.loads(text)
    assert back["source"] == "smiquery"
    assert back["event"]["gpu"] == 5
    assert back["event"]["state"] == "firing"
    assert back["event"]["rule"] == "temperature.gpu > 85 for 3"
    assert back["context"] == {"epoch": 3, "learning_rate": None, "when": T0.isoformat()}
    assert "GPU 5" in back["message"]


def test_webhook_posts_json(server):
    with no_leaks():
        hook = WebhookHandler(server.url, timeout=2.0, min_interval=0.0)
        hook(_event(), {"epoch": 1, "batch": 4})
        hook(_event("cleared"), {"epoch": 1, "batch": 9})
        wait_for(lambda: len(server.bodies) == 2, what="both posts")
        hook.close()
    assert [b["event"]["state"] for b in server.bodies] == ["firing", "cleared"]
    assert server.bodies[0]["context"] == {"epoch": 1, "batch": 4}
    assert hook.sent == 2 and hook.failed == 0 and hook.dropped == 0


def test_webhook_failures_are_logged_once_per_streak_and_never_raised(server, caplog):
    caplog.set_level(logging.INFO, logger="smiquery.notify")
    server.mode = "fail"
    with no_leaks():
        hook = WebhookHandler(server.url, min_interval=0.0)
        for _ in range(4):
            hook(_event(), {})
        wait_for(lambda: hook.failed == 4, what="4 failed posts")
        server.mode = "ok"
        hook(_event(), {})
        wait_for(lambda: hook.sent == 1, what="the post that works")
        server.mode = "fail"
        hook(_event(), {})
        wait_for(lambda: hook.failed == 5, what="the 5th failed post")
        hook.close()
    failures = [r for r in caplog.records if "failed" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(failures) == 2, [r.getMessage() for r in caplog.records]  # one per streak
    assert "HTTP 500" in failures[0].getMessage()
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert len(server.bodies) == 6  # no retries: one POST per event


def test_webhook_connection_refused_is_a_logged_failure(caplog):
    with no_leaks():
        hook = WebhookHandler(f"http://127.0.0.1:{_free_port()}/", timeout=1.0, min_interval=0.0)
        hook(_event(), {})
        wait_for(lambda: hook.failed == 1, what="the failed post")
        hook.close()
    assert hook.sent == 0
    assert "no retry" in caplog.text


def test_webhook_slow_endpoint_times_out_and_never_blocks_the_caller(server):
    server.delay = 1.5
    with no_leaks(reap_timeout=5.0):
        hook = WebhookHandler(server.url, timeout=0.3, min_interval=0.0, queue_size=3)
        start = time.monotonic()
        for _ in range(10):
            hook(_event(), {})
        assert time.monotonic() - start < 2.0  # queued: sent inline, 10 posts would take 10 timeouts (3 s)
        wait_for(lambda: hook.failed >= 1, what="a timed-out post")
        assert hook.last_error is not None
        assert "timed out" in hook.last_error.lower()
        # the queue is bounded: what did not fit was dropped and counted
        assert hook.dropped >= 6
        hook.close(timeout=10.0)
    assert hook.sent + hook.failed + hook.dropped == 10


def test_webhook_min_interval_spaces_posts(server):
    hook = WebhookHandler(server.url, min_interval=0.3)
    try:
        for _ in range(3):
            hook(_event(), {})
        wait_for(lambda: len(server.times) == 3, what="3 posts")
    finally:
        hook.close()
    gaps = [b - a for a, b in zip(server.times, server.times[1:])]
    assert all(g >= 0.25 for g in gaps), gaps


def test_webhook_can_be_used_again_after_close(server):
    hook = WebhookHandler(server.url, min_interval=0.0)
    hook(_event(), {})
    hook.close()
    hook(_event("cleared"), {})
    wait_for(lambda: len(server.bodies) == 2, what="both posts")
    hook.close()


def test_webhook_rejects_non_http_urls():
    with pytest.raises(ValueError, match="http"):
        WebhookHandler("file:///etc/passwd")


def test_notifier_fires_once_clears_once_and_passes_context():
    got: list[tuple[str, dict[str, object]]] = []
    n = Notifier(["temperature.gpu > 85 for 3"], [lambda e, ctx: got.append((e.state, dict(ctx)))])
    temps = [80, 86, 87, 88, 89, 90, 91, 70, 71, 88]
    fired = []
    for i, s in enumerate(_samples(temps)):
        fired += n.update(s, {"step": i})
    assert [e.state for e in fired] == ["firing", "cleared"]
    assert got == [("firing", {"step": 3}), ("cleared", {"step": 7})]
    assert fired[0].gpu == 0 and fired[0].value == 88


def test_notifier_survives_a_broken_handler(caplog):
    calls = []

    def broken(event: AlertEvent, ctx: object) -> None:
        raise ValueError("nope")

    n = Notifier(["temperature.gpu > 85"], [broken, lambda e, ctx: calls.append(e)])
    for s in _samples([90]):
        n.update(s)
    assert len(calls) == 1
    assert n.handler_failures == 1
    assert "nope" in caplog.text


def test_notifier_default_handler_logs(caplog):
    n = Notifier(["temperature.gpu > 85"])
    for s in _samples([90]):
        n.update(s)
    assert "ALERT firing GPU 0" in caplog.text


# ------------------------------------------------------------------------- built-in rules and `while` (alerts.py)


def _util_mem(rows: list[tuple[str, str]]) -> list[object]:
    parser = CsvParser(["timestamp", "index", "utilization.gpu", "memory.used"])
    lines = [
        f"{(T0 + timedelta(seconds=i)).strftime('%Y/%m/%d %H:%M:%S.000')}, 0, {u}, {m}" for i, (u, m) in enumerate(rows)
    ]
    return list(parser.parse(lines))


def test_while_condition_parses_into_the_same_rule():
    rule = Rule.parse("utilization.gpu < 20 for 30m while memory.used > 1024")
    assert (rule.field.name, rule.op, rule.threshold, rule.hold_seconds) == ("utilization.gpu", "<", 20, 1800.0)
    assert [(w.field.name, w.op, w.threshold) for w in rule.when] == [("memory.used", ">", 1024)]
    assert str(rule) == "utilization.gpu < 20 for 30m while memory.used > 1024"
    assert [f.name for f in rule.fields] == ["utilization.gpu", "memory.used"]
    two = Rule.parse("temperature.gpu > 80 while utilization.gpu > 50 while power.draw > 100")
    assert len(two.when) == 2


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("utilization.gpu < 20 while", "'while' needs a condition"),
        ("utilization.gpu < 20 while memory.used > 1024 for 3", "takes no 'for' hold"),
        ("utilization.gpu < 20 while mem > 1", "in the 'while' condition: unknown field 'mem'"),
    ],
)
def test_while_errors(text, says):
    from smiquery.errors import InvalidRuleError

    with pytest.raises(InvalidRuleError, match=says):
        Rule.parse(text)


def test_while_fires_only_when_both_hold_and_missing_keeps_the_state():
    n = Notifier(["utilization.gpu < 20 for 3 while memory.used > 1024"], [])
    rows = [
        ("5", "10"),  # idle, but no job holds the GPU: not a stall
        ("5", "10"),
        ("5", "10"),
        ("5", "9000"),
        ("5", "9000"),
        ("5", "[N/A]"),  # a missing value decides nothing
        ("5", "9000"),  # third matching sample: fires
        ("5", "9000"),
        ("5", "100"),  # the job let go of its memory: clears
    ]
    states = [[e.state for e in n.update(s)] for s in _util_mem(rows)]
    assert states == [[], [], [], [], [], [], ["firing"], [], ["cleared"]]


def test_builtin_rules_match_the_exporter_rules():
    from smiquery.alerts import BUILTIN_RULES, AlertEvaluator

    rules = [Rule.parse(t) for t in BUILTIN_RULES]
    assert [(r.field.name, r.op, r.threshold, r.hold_samples, r.hold_seconds) for r in rules] == [
        ("temperature.gpu", ">", 85, 3, None),
        ("temperature.gpu", ">", 80, None, 300.0),
        ("utilization.gpu", "<", 20, None, 1800.0),
        ("clocks_event_reasons.hw_thermal_slowdown", "==", True, None, 60.0),
        ("clocks_event_reasons.sw_thermal_slowdown", "==", True, None, 60.0),
        ("clocks_event_reasons.hw_power_brake_slowdown", "==", True, None, 60.0),
    ]
    assert "memory.used" in {f.name for f in AlertEvaluator(BUILTIN_RULES).fields}
    exporter_rules = Path(__file__).parents[1] / "docker" / "prometheus" / "smiquery-rules.yml"
    if exporter_rules.is_file():
        text = exporter_rules.read_text(encoding="utf-8")
        for fragment in (
            "smiquery_temperature_gpu_celsius > 80",
            "for: 5m",
            "> 85",
            "< 0.2",
            "rate(smiquery_training_steps_total[5m])) > 0",  # low utilisation counts only while training
            "hw_thermal_slowdown_active == 1",
            "sw_thermal_slowdown_active == 1",
            "hw_power_brake_slowdown_active == 1",
        ):
            assert fragment in text, fragment


# ------------------------------------------------------------------------------------- secrets and bounds

SECRETS = ("T000SECRET", "B000SECRET", "QUERYSECRET", "KEYSECRET", "HEADERSECRET")


def _secret_url(base: str) -> str:
    return f"{base}/T000SECRET/B000SECRET?token=QUERYSECRET&api_key=KEYSECRET"


@pytest.mark.parametrize("where", ["http-error", "refused"])
def test_webhook_never_logs_the_urls_path_query_or_headers(server, caplog, where):
    caplog.set_level(logging.DEBUG)
    base = server.url if where == "http-error" else f"http://127.0.0.1:{_free_port()}/hook"
    server.mode = "fail"
    with no_leaks():
        hook = WebhookHandler(_secret_url(base), min_interval=0.0, headers={"Authorization": "Bearer HEADERSECRET"})
        notifier = Notifier(["temperature.gpu > 85"], [hook])
        hook(_event(), {})
        wait_for(lambda: hook.failed == 1, what="the failed post")
        notifier.close()
    shown = caplog.text + repr(hook) + repr(notifier.handlers) + (hook.last_error or "")
    assert "failed" in caplog.text and "127.0.0.1" in caplog.text  # the host still says which endpoint
    for secret in SECRETS:
        assert secret not in shown
    with pytest.raises(ValueError, match="webhook URL") as bad:
        WebhookHandler("ftp://files.example.com/T000SECRET?token=QUERYSECRET")
    assert not any(s in str(bad.value) for s in SECRETS)


def test_webhook_close_is_bounded_on_a_dead_endpoint_then_drops_and_counts(caplog):
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead.listen(16)  # accepts connections in the kernel, never answers
    try:
        hook = WebhookHandler(f"http://127.0.0.1:{dead.getsockname()[1]}/hook", timeout=60.0, min_interval=0.0)
        for _ in range(3):
            hook(_event(), {})
        wait_for(lambda: hook.pending <= 2, what="the first post in flight")
        started = time.monotonic()
        hook.close()
        took = time.monotonic() - started
        assert took < 15.0  # about two seconds by default; far less than the 60 s POST timeout
        assert hook.dropped == 2  # the two still waiting; the one in flight ends on its own
        assert "did not answer" in caplog.text
        hook(_event(), {})  # usable again after close
        assert hook.pending <= 1
        hook.close(timeout=0.1)
    finally:
        dead.close()


def test_handler_specs_for_the_cli(tmp_path):
    from smiquery.alerts import SnapshotHandler, handler_from_spec

    assert isinstance(handler_from_spec("log"), LogHandler)
    hook = handler_from_spec("webhook:https://hooks.example.com/T000SECRET")
    assert isinstance(hook, WebhookHandler) and hook.url == "https://hooks.example.com/T000SECRET"
    snap = handler_from_spec(f"snapshot:{tmp_path}")
    assert isinstance(snap, SnapshotHandler) and snap.directory == str(tmp_path)
    for bad in ("email:me", "webhook:", "snapshot"):
        with pytest.raises(ValueError, match="log, webhook:URL, snapshot:DIR"):
            handler_from_spec(bad)
