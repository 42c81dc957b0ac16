"""A small client of the Prometheus HTTP API (standard library only), credentials as promtool's config file gives.

Every failure is one typed error: :class:`~smiquery.errors.PrometheusUnreachableError` (refused, unknown host, TLS,
timeout, credentials refused) or :class:`~smiquery.errors.PrometheusQueryError` (query rejected, answer too big).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from base64 import b64encode
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from smiquery.errors import PrometheusError, PrometheusQueryError, PrometheusUnreachableError, UsageError
from smiquery.printable import printable

__all__ = ["DEFAULT_MAX_ANSWER_BYTES", "HttpConfig", "PrometheusClient", "load_http_config", "parse_time"]

#: The largest answer read by default: 512 MiB. The largest smiquery asks for is one chunk of
#: :func:`~smiquery.fleet.history.fleet_frame`: at most 20 million samples of 18 to 24 bytes of JSON.
DEFAULT_MAX_ANSWER_BYTES = 512 * 2**20


@dataclass(frozen=True)
class HttpConfig:
    """How to authenticate to a Prometheus server and check its certificate (``insecure_skip_verify``: tests only)."""

    bearer_token: str | None = None
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False


def _read(path: Any, source: str, what: str = "") -> str:
    try:
        with open(os.fspath(path), encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise UsageError(f"{source}: cannot read {what}{path}: {exc.strerror or exc}") from None


def load_http_config(path: str | os.PathLike[str]) -> HttpConfig:
    """Read an HTTP client configuration in the format of promtool's ``--http.config.file`` (JSON without PyYAML).

    Understood keys: ``authorization: {type: Bearer, credentials | credentials_file}``, ``bearer_token``,
    ``bearer_token_file``, ``basic_auth: {username, password | password_file}`` and
    ``tls_config: {ca_file, cert_file, key_file, insecure_skip_verify}``. UsageError for a file that is unreadable,
    not YAML/JSON, or holds an unknown key or a wrong type.
    """
    where = os.fspath(path)
    text = _read(where, "--http-config")
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

    def secret(where: dict[str, Any], key: str, default: str | None = None) -> str | None:
        # ``key``, or read from the file ``key_file`` names
        if f"{key}_file" in where:
            return _read(where[f"{key}_file"], source, f"{key}_file ").strip()
        return str(where[key]) if key in where else default

    auth = section("authorization")
    kind = str(auth.get("type", "Bearer"))
    if auth and kind.lower() != "bearer":
        raise UsageError(f"{source}: authorization type {kind!r} is not supported; use Bearer or basic_auth")
    token = secret(doc, "bearer_token", secret(auth, "credentials"))
    basic = section("basic_auth")
    user = str(basic.get("username", "")) if basic else None
    password = secret(basic, "password", "") if basic else None
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
    """Unix seconds of a time as the Prometheus HTTP API takes it: Unix seconds or RFC 3339; also ``now-2h``.

    UsageError for anything else, or an RFC 3339 time without a zone.
    """
    if isinstance(text, (int, float)):
        return float(text)
    raw = text.strip()
    if raw.startswith("now"):
        base = time.time() if now is None else now
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
        timeout: seconds for each whole answer: connecting, TLS, headers, body and redirects together (a server
            that trickles its answer is cut too); also sent as the query's ``timeout``.
        max_answer_bytes: the largest answer read; one over it (announced or seen while reading, in chunks) is a
            :class:`~smiquery.errors.PrometheusQueryError` naming the limit.

    Redirects are followed (at most 5) only within the URL's origin, so the credentials never leave the server
    given; one to another origin is a :class:`~smiquery.errors.PrometheusError`.

    Raises:
        UsageError: a URL that is not http(s), a timeout or size limit that is not positive.
    """

    def __init__(
        self,
        url: str,
        *,
        config: HttpConfig | None = None,
        timeout: float = 30.0,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    ) -> None:
        parsed = urllib.parse.urlsplit(url.strip())
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise UsageError(f"--prometheus: {url!r} is not an http(s) URL; give e.g. http://prometheus:9090")
        if not timeout > 0:
            raise UsageError("--timeout: must be more than 0 seconds")
        if not max_answer_bytes > 0:
            raise UsageError("--max-answer: must be more than 0")
        self.url = url.strip().rstrip("/")
        self.config = config or HttpConfig()
        self.timeout = float(timeout)
        self.max_answer_bytes = int(max_answer_bytes)
        self._headers = {"Accept": "application/json", "User-Agent": "smiquery-fleet"}
        cfg = self.config
        if cfg.bearer_token:
            self._headers["Authorization"] = f"Bearer {cfg.bearer_token}"
        elif cfg.username is not None:
            pair = f"{cfg.username}:{cfg.password or ''}".encode()
            self._headers["Authorization"] = "Basic " + b64encode(pair).decode("ascii")
        self._proxies = urllib.request.getproxies()  # the environment's, read once
        self._context: ssl.SSLContext | None = None
        if parsed.scheme == "https":
            ctx = ssl.create_default_context(cafile=cfg.ca_file)
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            if cfg.insecure_skip_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._context = ctx

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query: the vector's elements (``{"metric": labels, "value": [t, "v"]}``).

        A range-vector expression gives ``{"metric", "values"}`` elements instead.
        """
        data = self._call("/api/v1/query", self._instant(expr, at), expr)
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list) or data.get("resultType") == "scalar":
            kind = printable(data.get("resultType")) if isinstance(data, dict) else "malformed answer"
            raise PrometheusError(f"the query {expr!r} gave a {kind}, not series")
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query: one element per series, ``{"metric": labels, "values": [[t, "v"], ...]}``."""
        params = {**self._instant(expr, None), "start": _fmt(start), "end": _fmt(end), "step": _fmt(step)}
        data = self._call("/api/v1/query_range", params, expr)
        result = data.get("result") if isinstance(data, dict) else None
        return result if isinstance(result, list) else []

    def series(self, matchers: Sequence[str], start: float, end: float) -> list[dict[str, str]]:
        """The label sets of the series that match any of ``matchers`` between ``start`` and ``end``."""
        data = self._call("/api/v1/series", _matching(matchers, start, end), " or ".join(matchers))
        return data if isinstance(data, list) else []

    def metric_names(self, matchers: Sequence[str], start: float, end: float) -> list[str]:
        """The metric names among the series matching ``matchers`` between ``start`` and ``end``."""
        params = _matching(matchers, start, end)
        data = self._call("/api/v1/label/__name__/values", params, " or ".join(matchers), post=False)
        return [str(n) for n in data] if isinstance(data, list) else []

    def query_raw(self, expr: str, at: float | None = None) -> bytes:
        """An instant query's successful answer as the server sent it, for :meth:`samples` to parse later."""
        got = self._call("/api/v1/query", self._instant(expr, at), expr, decoded=False)
        if not isinstance(got, (bytes, bytearray)):
            raise PrometheusError(f"the query {expr!r} gave a {type(got).__name__}, not series")
        return bytes(got)

    def samples(self, raw: bytes, expr: str) -> list[tuple[dict[str, str], Any, Any]]:
        """The series of a :meth:`query_raw` answer of a range selector (``metric[7d]``): labels, times, values.

        The times and values are arrays, parsed without a Python object per sample; an answer of another shape is
        read as :meth:`query` reads it.
        """
        import numpy as np

        fast = _matrix(raw)
        if fast is not None:
            return fast
        data = self._decode(raw, "/api/v1/query", 200, expr)
        result = data.get("result") if isinstance(data, dict) else None
        try:
            return [
                (r.get("metric", {}), *np.array(r.get("values") or np.empty((0, 2)), dtype=np.float64).T)
                for r in (result if isinstance(result, list) else [])
            ]
        except (AttributeError, TypeError, ValueError):
            raise PrometheusError(f"the answer to {expr!r} holds a sample that is not [time, value]") from None

    def _instant(self, expr: str, at: float | None) -> dict[str, str]:
        params = {"query": expr, "timeout": f"{self.timeout:g}s"}
        return params if at is None else {**params, "time": _fmt(at)}

    def _call(
        self,
        path: str,
        params: Mapping[str, str] | Sequence[tuple[str, str]],
        what: str,
        *,
        post: bool = True,
        decoded: bool = True,
    ) -> Any:
        # POST where the API takes it: a long selector list does not run into a proxy's URL limit
        encoded = urllib.parse.urlencode(params)
        if post:
            headers = {**self._headers, "Content-Type": "application/x-www-form-urlencoded"}
            request = urllib.request.Request(self.url + path, data=encoded.encode("ascii"), headers=headers)
        else:
            request = urllib.request.Request(f"{self.url}{path}?{encoded}", headers=self._headers)
        deadline = _Deadline(self.timeout)
        opener = urllib.request.OpenerDirector()  # build_opener's handlers for http(s), without its per-call cost
        for handler in (
            urllib.request.ProxyHandler(self._proxies),
            _DeadlineHandler(deadline, self._context),
            urllib.request.HTTPDefaultErrorHandler(),
            _SameOriginRedirects(self.url),
            urllib.request.HTTPErrorProcessor(),
        ):
            opener.add_handler(handler)
        try:
            try:
                with opener.open(request, timeout=self.timeout) as resp:
                    status = resp.status
                    raw = self._read_capped(resp, resp.headers)
            except urllib.error.HTTPError as exc:
                with exc:
                    status = exc.code
                    raw = self._read_capped(exc.fp, exc.headers) if exc.fp is not None else bytearray()
        except PrometheusError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            if deadline.expired:
                raise self._timed_out() from None
            raise self._unreachable(exc) from None
        finally:
            deadline.cancel()
        if deadline.expired:  # the answer was cut short at the deadline
            raise self._timed_out()
        if status in (401, 403):
            raise PrometheusUnreachableError(
                f"Prometheus at {self.url} refused the credentials (HTTP {status}); check the bearer token or "
                "basic_auth in --http-config"
            )
        if not decoded and status == 200:
            return raw
        return self._decode(bytes(raw), path, status, what)

    def _decode(self, raw: bytes, path: str, status: int, what: str) -> Any:
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
            error = printable(" ".join(str(doc.get("error", "unknown error")).split()))
            kind = printable(doc.get("errorType", "error"))
            raise PrometheusQueryError(f"Prometheus rejected the query {what!r} ({kind}): {error}")
        return doc.get("data")

    def _read_capped(self, body: Any, headers: Any) -> bytearray:
        """The body, read a chunk at a time and given up as soon as it passes ``max_answer_bytes``."""
        limit = self.max_answer_bytes
        declared = str(headers.get("Content-Length") or "").strip() if headers is not None else ""
        how = f"announces {int(declared):,} bytes" if declared.isdigit() and int(declared) > limit else ""
        got = bytearray()
        while not how:
            # read1: at most one read of the socket, so the deadline's cut is seen at once
            piece = body.read1(_CHUNK)
            if not piece:
                return got
            got += piece
            how = f"sent more than {limit:,} bytes" if len(got) > limit else ""
        raise PrometheusQueryError(
            f"the answer of Prometheus at {self.url} {how}, over the limit of {limit / 2**20:g} MiB; raise "
            "--max-answer (max_answer_bytes=) or narrow the query (--node, a shorter range)"
        )

    def _timed_out(self) -> PrometheusUnreachableError:
        return PrometheusUnreachableError(
            f"Prometheus at {self.url} did not give its whole answer within {self.timeout:g} s; raise --timeout or "
            "narrow the query (--node, a shorter range)"
        )

    def _unreachable(self, exc: OSError | http.client.HTTPException) -> PrometheusUnreachableError:
        reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return self._timed_out()
        if isinstance(reason, ssl.SSLError):
            return PrometheusUnreachableError(
                f"TLS with Prometheus at {self.url} failed: {reason}; give the server's CA in --http-config "
                "(tls_config: ca_file)"
            )
        if isinstance(reason, http.client.HTTPException):
            text = f"the answer broke off ({type(reason).__name__})"
        else:
            text = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
        return PrometheusUnreachableError(
            f"cannot reach Prometheus at {self.url}: {text}; check --prometheus and that the server is up"
        )


# one deadline per answer, a capped body, redirects kept within the origin

_CHUNK = 1 << 16
_DEFAULT_PORTS = {"http": 80, "https": 443}
_MAX_REDIRECTS = 5


def _origin(url: str) -> tuple[str, str, int | None]:  # what a redirect may not leave: scheme, host and port
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:  # not a number: no origin of ours
        return (scheme, "", -1)
    return (scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme))


class _Deadline:
    """One deadline for a whole answer: connect, TLS, headers, body and any redirects together.

    A socket timeout bounds each read, not the answer (one byte a second never trips it): at the deadline a timer
    shuts down the socket of every connection made for the answer, ending any blocked read; then :attr:`expired`.
    """

    def __init__(self, seconds: float) -> None:
        self._at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._connections: list[http.client.HTTPConnection | socket.socket] = []
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        """Seconds left; TimeoutError when none."""
        left = self._at - time.monotonic()
        if left <= 0 or self.expired:
            raise TimeoutError("deadline passed")
        return left

    def watch(self, connection: http.client.HTTPConnection | socket.socket) -> None:
        """Cut ``connection`` (while it connects) or its socket (urllib takes ``.sock`` off it) at the deadline."""
        with self._lock:
            self._connections.append(connection)
            if self.expired:
                _cut(connection)

    def cancel(self) -> None:
        """The answer is in: no cut."""
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for connection in self._connections:
                _cut(connection)


def _cut(connection: http.client.HTTPConnection | socket.socket) -> None:
    sock = connection if isinstance(connection, socket.socket) else connection.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            # the plain socket's shutdown, also under TLS: it ends a read blocked in another thread at once
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _deadline_connection(base: type[http.client.HTTPConnection], deadline: _Deadline) -> Any:
    """A connection class of ``base`` whose every socket operation gets at most what is left of ``deadline``."""

    class Connection(base):  # type: ignore[valid-type,misc]
        def connect(self) -> None:
            self.timeout = deadline.remaining()
            deadline.watch(self)  # the plain socket is on .sock while it connects, during a TLS handshake too
            super().connect()
            deadline.watch(self.sock)

    return Connection


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    """Opens http and https connections that are cut at the answer's deadline."""

    def __init__(self, deadline: _Deadline, context: ssl.SSLContext | None) -> None:
        super().__init__(context=context)
        self._http = _deadline_connection(http.client.HTTPConnection, deadline)
        self._https = _deadline_connection(http.client.HTTPSConnection, deadline)
        self._tls = context

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._http, req)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._https, req, context=self._tls)


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only within the server's origin (credentials go with every request), as the same request."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self._base = base

    def http_error_302(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any) -> Any:
        location = headers.get("Location")
        if location is None:
            return None  # the 3xx itself becomes the answer (not the API's JSON)
        fp.close()
        target = urllib.parse.urljoin(req.full_url, location.strip())
        shown = printable(target)
        if _origin(target) != _origin(req.full_url):
            raise PrometheusError(
                f"Prometheus at {self._base} redirected (HTTP {code}) to {shown}, another origin; not followed, so "
                "the credentials stay with the server given; give that server as --prometheus if it is the one"
            )
        hops = getattr(req, "smiquery_redirects", 0) + 1
        if hops > _MAX_REDIRECTS:
            raise PrometheusError(
                f"Prometheus at {self._base} redirected more than {_MAX_REDIRECTS} times (last to {shown}); give "
                "--prometheus the URL it ends at"
            )
        new = urllib.request.Request(target, data=req.data, headers=dict(req.headers), method=req.get_method())
        new.smiquery_redirects = hops  # type: ignore[attr-defined]
        return self.parent.open(new, timeout=req.timeout)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


_MATRIX_HEAD = b'{"status":"success","data":{"resultType":"matrix","result":['
_SERIES_HEAD = b'{"metric":'
_VALUES_HEAD = b',"values":[['
_NEXT_SERIES = b']]},{"metric":'
_SPACES = bytes.maketrans(b'[],"', b"    ")
_ROWS = bytes.maketrans(b"[", b"\n")


def _matrix(raw: bytes) -> list[tuple[dict[str, str], Any, Any]] | None:
    """A successful matrix answer's series as (labels, times, values); None for anything unexpected.

    The labels are read by the JSON decoder (a quote inside a label is escaped, so neither ``,"values":[[`` nor
    ``]]},{"metric":`` can occur in one); the samples of all series are parsed in one call.
    """
    if not raw.startswith(_MATRIX_HEAD):
        return None
    labels: list[dict[str, str]] = []
    bodies: list[bytes] = []
    pos = len(_MATRIX_HEAD)
    while raw.startswith(_SERIES_HEAD, pos):
        cut = raw.find(_VALUES_HEAD, pos)
        following = raw.find(_NEXT_SERIES, cut)
        stop = following if following >= 0 else raw.find(b"]]}]", cut)
        try:
            got = json.loads(raw[pos + len(_SERIES_HEAD) : cut]) if cut > 0 and stop > 0 else None
        except ValueError:
            return None
        if not isinstance(got, dict):
            return None
        labels.append({str(k): str(v) for k, v in got.items()})
        bodies.append(raw[cut + len(_VALUES_HEAD) : stop])
        pos = stop + (4 if following >= 0 else 3)
    if not raw.startswith(b"]", pos):
        return None
    counts = [b.count(b"[") + 1 for b in bodies]
    pairs = _pairs(b"],[".join(bodies), sum(counts))
    if pairs is None:
        return None
    out: list[tuple[dict[str, str], Any, Any]] = []
    at = 0
    for got, n in zip(labels, counts, strict=True):
        out.append((got, pairs[at : at + n, 0], pairs[at : at + n, 1]))
        at += n
    return out


def _pairs(body: bytes, n: int) -> Any:
    """``n`` samples ``t,"v"],[t,"v"...`` as an (n, 2) float array (NaN for ``"NaN"``), or None if they are not."""
    import numpy as np

    try:
        import pyarrow as pa
        import pyarrow.csv as pacsv
    except ImportError:  # numpy's parser: about half as fast
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy warns (and stops short) at what is not a number
            try:
                nums = np.fromstring(body.translate(_SPACES), dtype=np.float64, sep=" ")
            except (ValueError, DeprecationWarning):
                return None
        return nums.reshape(n, 2) if len(nums) == 2 * n else None
    try:  # one row a sample: t,v, (the values' quotes dropped: unquoted CSV parses faster)
        table = pacsv.read_csv(
            pa.BufferReader(body.translate(_ROWS, b']"') + b","),
            read_options=pacsv.ReadOptions(column_names=["t", "v", "_"], use_threads=False),
            parse_options=pacsv.ParseOptions(quote_char=False),
            convert_options=pacsv.ConvertOptions(
                column_types={"t": pa.float64(), "v": pa.float64()}, include_columns=["t", "v"]
            ),
        )
    except (pa.ArrowInvalid, ValueError):
        return None
    if table.num_rows != n or table.column("t").null_count:
        return None
    return np.column_stack([table.column("t").to_numpy(), table.column("v").to_numpy()])


def _matching(matchers: Sequence[str], start: float, end: float) -> list[tuple[str, str]]:
    return [*(("match[]", m) for m in matchers), ("start", _fmt(start)), ("end", _fmt(end))]


def _fmt(t: float) -> str:
    """Seconds as the API takes them (no exponent, millisecond precision)."""
    return f"{t:.3f}".rstrip("0").rstrip(".")
