"""A small client of the Prometheus HTTP API: instant and range queries, series and label look-ups.

Credentials and TLS are given as Prometheus' own clients take them (promtool's ``--http.config.file``):
:func:`load_http_config` reads that YAML (``authorization``/``bearer_token``, ``basic_auth``, ``tls_config``).
Every failure is one typed error with a one-line message: :class:`~smiquery.errors.PrometheusUnreachableError`
(refused, unknown host, TLS, timeout, credentials refused) or :class:`~smiquery.errors.PrometheusQueryError`
(the server rejected the query). Only the standard library is used.
"""

from __future__ import annotations

import json
import math
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from base64 import b64encode
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from smiquery.errors import PrometheusError, PrometheusQueryError, PrometheusUnreachableError, UsageError

__all__ = ["HttpConfig", "PrometheusClient", "load_http_config", "parse_time"]


@dataclass(frozen=True)
class HttpConfig:
    """How to authenticate to a Prometheus server and check its certificate.

    Attributes:
        bearer_token: sent as ``Authorization: Bearer ...``.
        username: basic-auth user (with ``password``).
        password: basic-auth password.
        ca_file: PEM file of the CA that signed the server's certificate.
        cert_file: client certificate (PEM) for mutual TLS, with ``key_file``.
        key_file: the client certificate's key.
        insecure_skip_verify: do not check the server's certificate (testing only).
    """

    bearer_token: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False


def _read_secret(path: Any, what: str, source: str) -> str:
    try:
        with open(os.fspath(path), encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise UsageError(f"{source}: cannot read {what} {path}: {exc.strerror or exc}") from None


def load_http_config(path: str | os.PathLike[str]) -> HttpConfig:
    """Read an HTTP client configuration in the format of promtool's ``--http.config.file``.

    Understood keys: ``authorization: {type: Bearer, credentials | credentials_file}``, ``bearer_token``,
    ``bearer_token_file``, ``basic_auth: {username, password | password_file}`` and
    ``tls_config: {ca_file, cert_file, key_file, insecure_skip_verify}``. JSON is read without PyYAML.

    Raises:
        UsageError: the file is unreadable, not YAML/JSON, or holds an unknown key or a wrong type.
    """
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise UsageError(f"--http-config: cannot read {where}: {exc.strerror or exc}") from None
    doc: Any
    try:
        import yaml
    except ImportError:
        try:
            doc = json.loads(text) if text.strip() else {}
        except ValueError:
            raise UsageError(f"--http-config: {where} is YAML; install PyYAML (pip install pyyaml)") from None
    else:
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise UsageError(f"--http-config: {where} is not YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--http-config: {where} must hold a mapping (authorization, basic_auth, tls_config)")
    known = {"authorization", "bearer_token", "bearer_token_file", "basic_auth", "tls_config"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise UsageError(f"--http-config: unknown key {unknown[0]!r} in {where}; known: {', '.join(sorted(known))}")
    source = f"--http-config {where}"

    def section(name: str) -> dict[str, Any]:
        got = doc.get(name) or {}
        if not isinstance(got, dict):
            raise UsageError(f"{source}: {name} must be a mapping")
        return got

    token: str | None = None
    auth = section("authorization")
    if auth:
        kind = str(auth.get("type", "Bearer"))
        if kind.lower() != "bearer":
            raise UsageError(f"{source}: authorization type {kind!r} is not supported; use Bearer or basic_auth")
        if "credentials_file" in auth:
            token = _read_secret(auth["credentials_file"], "credentials_file", source)
        elif "credentials" in auth:
            token = str(auth["credentials"])
    if "bearer_token_file" in doc:
        token = _read_secret(doc["bearer_token_file"], "bearer_token_file", source)
    elif "bearer_token" in doc:
        token = str(doc["bearer_token"])
    basic = section("basic_auth")
    user = password = None
    if basic:
        user = str(basic.get("username", ""))
        if "password_file" in basic:
            password = _read_secret(basic["password_file"], "password_file", source)
        else:
            password = str(basic.get("password", ""))
    if token is not None and user is not None:
        raise UsageError(f"{source}: give a bearer token or basic_auth, not both")
    tls = section("tls_config")
    return HttpConfig(
        bearer_token=token,
        username=user,
        password=password,
        ca_file=tls.get("ca_file"),
        cert_file=tls.get("cert_file"),
        key_file=tls.get("key_file"),
        insecure_skip_verify=bool(tls.get("insecure_skip_verify", False)),
    )


def parse_time(text: str | float, *, now: float | None = None, what: str = "time") -> float:
    """A time as the Prometheus HTTP API takes it: Unix seconds or RFC 3339; also ``now`` and ``now-2h``.

    Returns:
        Unix seconds.

    Raises:
        UsageError: anything else, or an RFC 3339 time without a zone.
    """
    import time as _time

    if isinstance(text, (int, float)):
        return float(text)
    raw = text.strip()
    if raw.startswith("now"):
        base = _time.time() if now is None else now
        rest = raw[3:].strip()
        if not rest:
            return base
        if rest[0] in "+-":
            from smiquery.alerts import parse_duration

            try:
                span = parse_duration(rest[1:].strip(), what=what)
            except ValueError as exc:
                raise UsageError(f"{what}: {exc}") from None
            return base - span if rest[0] == "-" else base + span
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
    try:
        # Python 3.10's fromisoformat does not read the Z of RFC 3339
        stamp = datetime.fromisoformat(raw[:-1] + "+00:00" if raw[-1:] in "zZ" else raw)
    except ValueError:
        raise UsageError(
            f"{what}: {text!r} is not a time; give Unix seconds, RFC 3339 (2026-12-04T06:00:00Z) or now-2h"
        ) from None
    if stamp.tzinfo is None:
        raise UsageError(f"{what}: {text!r} has no zone; add Z or an offset (2026-12-04T06:00:00+01:00)")
    return stamp.astimezone(timezone.utc).timestamp()


class PrometheusClient:
    """Queries one Prometheus server (or anything that serves its HTTP API: Thanos, Mimir, VictoriaMetrics).

    Args:
        url: the server's base URL, e.g. ``http://prometheus:9090`` (a path prefix is kept).
        config: credentials and TLS (see :func:`load_http_config`).
        timeout: seconds to wait for each answer; also sent as the query's ``timeout``.

    Raises:
        UsageError: a URL that is not http(s).
    """

    def __init__(self, url: str, *, config: HttpConfig | None = None, timeout: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(url.strip())
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"--prometheus: {url!r} is not an http(s) URL; give e.g. http://prometheus:9090")
        if not timeout > 0:
            raise UsageError("--timeout: must be more than 0 seconds")
        self.url = url.strip().rstrip("/")
        self.config = config or HttpConfig()
        self.timeout = float(timeout)
        self._headers = {"Accept": "application/json", "User-Agent": "smiquery-fleet"}
        cfg = self.config
        if cfg.bearer_token:
            self._headers["Authorization"] = f"Bearer {cfg.bearer_token}"
        elif cfg.username is not None:
            pair = f"{cfg.username}:{cfg.password or ''}".encode()
            self._headers["Authorization"] = "Basic " + b64encode(pair).decode("ascii")
        self._context: ssl.SSLContext | None = None
        if parsed.scheme == "https":
            ctx = ssl.create_default_context(cafile=cfg.ca_file)
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            if cfg.insecure_skip_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._context = ctx

    # ----------------------------------------------------------------------------------------------------------

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query: the vector's elements (``{"metric": labels, "value": [t, "v"]}``).

        A range-vector expression gives ``{"metric", "values"}`` elements instead.
        """
        params = {"query": expr, "timeout": f"{self.timeout:g}s"}
        if at is not None:
            params["time"] = _fmt(at)
        data = self._call("/api/v1/query", params, expr)
        result = data.get("result")
        if data.get("resultType") == "scalar" or not isinstance(result, list):
            raise PrometheusError(f"the query {expr!r} gave a {data.get('resultType')}, not series")
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query: one element per series, ``{"metric": labels, "values": [[t, "v"], ...]}``."""
        params = {
            "query": expr,
            "start": _fmt(start),
            "end": _fmt(end),
            "step": _fmt(step),
            "timeout": f"{self.timeout:g}s",
        }
        data = self._call("/api/v1/query_range", params, expr)
        result = data.get("result")
        return result if isinstance(result, list) else []

    def series(self, matchers: Sequence[str], start: float, end: float) -> list[dict[str, str]]:
        """The label sets of the series that match any of ``matchers`` between ``start`` and ``end``."""
        params: list[tuple[str, str]] = [("match[]", m) for m in matchers]
        params += [("start", _fmt(start)), ("end", _fmt(end))]
        data = self._call("/api/v1/series", params, " or ".join(matchers))
        return data if isinstance(data, list) else []

    def metric_names(self, matchers: Sequence[str], start: float, end: float) -> list[str]:
        """The metric names among the series matching ``matchers`` between ``start`` and ``end``."""
        params: list[tuple[str, str]] = [("match[]", m) for m in matchers]
        params += [("start", _fmt(start)), ("end", _fmt(end))]
        data = self._call("/api/v1/label/__name__/values", params, " or ".join(matchers), post=False)
        return [str(n) for n in data] if isinstance(data, list) else []

    # ----------------------------------------------------------------------------------------------------------

    def _call(
        self, path: str, params: Mapping[str, str] | Sequence[tuple[str, str]], what: str, *, post: bool = True
    ) -> Any:
        # POST where the API takes it: a long selector list does not run into a proxy's URL limit
        encoded = urllib.parse.urlencode(params)
        if post:
            headers = {**self._headers, "Content-Type": "application/x-www-form-urlencoded"}
            request = urllib.request.Request(self.url + path, data=encoded.encode("ascii"), headers=headers)
        else:
            request = urllib.request.Request(f"{self.url}{path}?{encoded}", headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._context) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
            exc.close()
        except TimeoutError:
            raise PrometheusUnreachableError(
                f"Prometheus at {self.url} did not answer within {self.timeout:g} s; raise --timeout or narrow the "
                "query (--node, a shorter range)"
            ) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                raise PrometheusUnreachableError(
                    f"Prometheus at {self.url} did not answer within {self.timeout:g} s; raise --timeout"
                ) from None
            if isinstance(reason, ssl.SSLError):
                raise PrometheusUnreachableError(
                    f"TLS with Prometheus at {self.url} failed: {reason}; give the server's CA in --http-config "
                    "(tls_config: ca_file)"
                ) from None
            text = getattr(reason, "strerror", None) or str(reason)
            raise PrometheusUnreachableError(
                f"cannot reach Prometheus at {self.url}: {text}; check --prometheus and that the server is up"
            ) from None
        except OSError as exc:
            raise PrometheusUnreachableError(
                f"cannot reach Prometheus at {self.url}: {exc.strerror or exc}; check --prometheus"
            ) from None
        if status in (401, 403):
            raise PrometheusUnreachableError(
                f"Prometheus at {self.url} refused the credentials (HTTP {status}); check the bearer token or "
                "basic_auth in --http-config"
            )
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or "status" not in doc:
            raise PrometheusError(
                f"{self.url}{path} answered HTTP {status} without the Prometheus API's JSON; give the server's base "
                "URL, e.g. http://prometheus:9090"
            )
        if doc.get("status") != "success":
            error = " ".join(str(doc.get("error", "unknown error")).split())
            kind = doc.get("errorType", "error")
            raise PrometheusQueryError(f"Prometheus rejected the query {what!r} ({kind}): {error}")
        return doc.get("data")


def _fmt(t: float) -> str:
    """Seconds as the API takes them (no exponent, millisecond precision)."""
    return f"{t:.3f}".rstrip("0").rstrip(".")
