"""The exporter's scrape encodings: gzip when the scraper asks, OpenMetrics when its Accept header does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.httpd.test_server import livez


@pytest.fixture
def exporter_url(inproc: Any) -> Iterator[str]:
    from smiquery.exporter import serve

    exp = serve(port=0, interval=0.1)
    try:
        deadline = time.monotonic() + 30
        while livez(exp.port) != 200 or b"smiquery_up 1.0" not in scrape(exp.url)[2]:
            assert time.monotonic() < deadline, "the exporter never served fresh data"
            time.sleep(0.05)
        yield exp.url
    finally:
        exp.stop()


def scrape(url: str, **headers: str) -> tuple[str, dict[str, str], bytes]:
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.headers.get("Content-Type", ""), {k.lower(): v for k, v in r.headers.items()}, r.read()


def test_gzip_when_the_scraper_asks(exporter_url):
    import gzip

    _, plain_headers, plain = scrape(exporter_url)
    assert "content-encoding" not in plain_headers
    _, headers, packed = scrape(exporter_url, **{"Accept-Encoding": "gzip"})
    assert headers["content-encoding"] == "gzip"
    text = gzip.decompress(packed)
    assert b"smiquery_up 1.0" in text and text.startswith(plain[:200])
    assert len(packed) * 4 < len(text)


def test_openmetrics_when_accept_asks_for_it(exporter_url):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    ctype, _, body = scrape(exporter_url, Accept="application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert ctype.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "smiquery_up" in names
    ctype, _, body = scrape(exporter_url, Accept="text/plain")
    assert ctype.startswith("text/plain; version=0.0.4") and not body.endswith(b"# EOF\n")
