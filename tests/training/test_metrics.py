"""The job's own metrics (an output of the run monitor): job-level counters joined to the GPUs by an info series,
served on localhost behind the exporter's web config, and pushed to a Pushgateway grouped by run."""

from __future__ import annotations

import base64
import http.server
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from smiquery.training.monitor import RunMonitor
from smiquery.training.outputs import JobMetrics, run_monitor
from smiquery.training.watch import watch
from tests.helpers import wait_for
from tests.leakcheck import no_leaks


def metrics_of(monitor: RunMonitor) -> JobMetrics:
    """The job's metrics among a monitor's outputs."""
    return next(out for out in monitor.outputs if isinstance(out, JobMetrics))


def _scrape(port: int, auth: str | None = None) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    with urllib.request.urlopen(req, timeout=10) as got:
        return str(got.read().decode())


def test_job_counters_are_job_level_and_gpus_join_through_an_info_series(inproc):
    with (
        no_leaks(reap_timeout=5.0),
        watch(interval=0.05, alerts=(), metrics_port=0, gpus=[0, 1], run_id="r-42") as w,
    ):
        assert wait_for(lambda: len(w.monitor.totals.joules) == 2)  # two sweeps of both GPUs: energy known
        w.step(epoch=0, batch=0, samples=16)
        w.step(epoch=0, batch=1, samples=16)
        port = metrics_of(w.monitor).port
        assert port
        text = _scrape(port)
    uuids = w.monitor.uuids()
    host = metrics_of(w.monitor).host
    # one series per run, whatever the number of GPUs: sum(rate(steps)) counts each step once
    steps = [line for line in text.splitlines() if line.startswith("smiquery_training_steps_total")]
    assert steps == [f'smiquery_training_steps_total{{host="{host}",run="r-42"}} 2.0']
    assert f'smiquery_training_samples_total{{host="{host}",run="r-42"}} 32.0' in text
    for idx, uuid in uuids.items():
        assert f'smiquery_training_gpu_info{{gpu="{idx}",host="{host}",run="r-42",uuid="{uuid}"}} 1.0' in text
        assert f'smiquery_training_energy_joules_total{{host="{host}",run="r-42",uuid="{uuid}"}}' in text
    for name in ("smiquery_training_data_wait_seconds_total", "smiquery_training_epoch"):
        assert f'{name}{{host="{host}",run="r-42"}}' in text


def test_metrics_listen_on_localhost_by_default_and_take_the_exporters_web_config(inproc, tmp_path):
    import bcrypt

    assert JobMetrics().metrics_addr == "127.0.0.1"
    cfg = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    cfg.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n", encoding="utf-8")
    with no_leaks(reap_timeout=5.0), watch(interval=0.05, alerts=(), metrics_port=0, web_config=cfg) as w:
        port = metrics_of(w.monitor).port
        assert port
        with pytest.raises(urllib.error.HTTPError) as refused:
            _scrape(port)
        refused.value.close()
        assert refused.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as wrong:
            _scrape(port, "prometheus:guess")
        wrong.value.close()
        assert wrong.value.code == 401
        assert "smiquery_training_steps_total" in _scrape(port, "prometheus:s3cret")


def test_a_bad_web_config_fails_with_a_typed_error(inproc, tmp_path):
    from smiquery.errors import WebConfigError

    cfg = tmp_path / "web.yml"
    cfg.write_text("basic_auth_users:\n  u: plain\n", encoding="utf-8")
    with pytest.raises(WebConfigError, match="bcrypt"):
        run_monitor(metrics_port=0, web_config=cfg, alerts=())


class _Gateway:
    """A stand-in Pushgateway recording (method, path, body) of every request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        calls = self.calls

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                calls.append((self.command, self.path, self.rfile.read(n).decode()))
                self.send_response(202 if self.command == "DELETE" else 200)
                self.end_headers()

            do_PUT = do_POST = do_DELETE = _record

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> _Gateway:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_pushes_are_grouped_by_run_and_the_group_is_deleted_on_a_clean_exit(inproc):
    with _Gateway() as gw:
        # two jobs on one host: each its own group, so neither overwrites the other
        with (
            watch(interval=0.05, alerts=(), pushgateway=gw.url, push_interval=0.1, job="train-x", run_id="a") as one,
            watch(interval=0.05, alerts=(), pushgateway=gw.url, push_interval=0.1, job="train-x", run_id="b") as two,
        ):
            assert wait_for(lambda: bool(one.monitor.uuids()) and bool(two.monitor.uuids()))
            one.step(epoch=0, batch=0)
            host = metrics_of(one.monitor).host
            group_a = f"/metrics/job/train-x/host/{host}/run/a"
            group_b = f"/metrics/job/train-x/host/{host}/run/b"
            assert wait_for(lambda: {c[1] for c in gw.calls if c[0] == "PUT"} >= {group_a, group_b})
        pushed = [body for method, path, body in gw.calls if method == "PUT" and path == group_a]
        assert 'smiquery_training_steps_total{host="' + host + '",run="a"} 1.0' in pushed[-1]
        # a clean exit deletes each run's group: its series do not outlive the job
        deletes = [path for method, path, _ in gw.calls if method == "DELETE"]
        assert sorted(deletes) == sorted([group_a, group_b])
        assert [m for m, p, _ in gw.calls if p == group_a][-1] == "DELETE"
