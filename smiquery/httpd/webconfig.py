"""Web configuration in the Prometheus exporter-toolkit format (``--web-config-file``): TLS, basic auth, headers.

Relative paths are the file's folder's; a key does what exporter-toolkit documents or fails loading with one line.
"""

from __future__ import annotations

import base64
import hashlib
import os
import ssl
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smiquery.errors import WebConfigError

__all__ = ["WebConfig", "load_web_config"]

_TLS_KEYS = frozenset(
    {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version", "cipher_suites"}
    | {"curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans", "cert", "key", "client_ca"}
)
_TOP_KEYS = frozenset({"tls_server_config", "basic_auth_users", "http_server_config"})
_HTTP_KEYS = frozenset({"http2", "headers"})
# exporter-toolkit accepts only these response headers in http_server_config.headers
_HEADERS = (
    "Strict-Transport-Security",
    "X-Content-Type-Options",
    "X-Frame-Options",
    "X-XSS-Protection",
    "Content-Security-Policy",
)
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
# Asking for a certificate without verifying it has no equivalent in Python's ssl module (no verify callback):
# refused rather than silently verifying (which rejects every client without a CA) or not asking at all.
_UNVERIFIED_AUTH = ("RequestClientCert", "RequireAnyClientCert")
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's TLS 1.0-1.2 cipher suite names (what exporter-toolkit takes) -> OpenSSL's. As in Go, they do not apply to
# TLS 1.3, whose suites are fixed.
_CIPHERS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
}
_FAILURES_KEPT = 4096  # recent wrong credentials remembered (rejected again without a bcrypt check)
_FAILURE_TTL = 300.0
_BCRYPT = threading.Lock()  # one bcrypt check at a time, process-wide: a flood of guesses costs one core at most


def _credentials(header: str | None) -> tuple[str, str] | None:
    """(user, password) from an ``Authorization: Basic`` value, or None when it is absent or malformed."""
    if not header or header[:6].lower() != "basic ":
        return None
    try:
        # a str with non-ASCII characters raises a plain ValueError, bad base64 binascii.Error, bad UTF-8
        # UnicodeDecodeError: all ValueErrors
        user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
    except ValueError:
        return None
    return (user, password) if sep else None


@dataclass
class WebConfig:
    """TLS, basic-auth and response-header settings for the exporter's HTTP server.

    ``ssl_context`` is None for plain HTTP; ``users``: user name -> bcrypt hash (empty: no authentication); client
    certificates must carry one of ``allowed_sans`` (empty: any); ``headers`` are added to every response.
    """

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    allowed_sans: frozenset[str] = frozenset()
    headers: dict[str, str] = field(default_factory=dict)
    _ok: set[bytes] = field(default_factory=set, repr=False)
    _bad: OrderedDict[bytes, float] = field(default_factory=OrderedDict, repr=False)
    _dummy: bytes | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _dummy_hash(self) -> bytes:
        if self._dummy is None:
            import bcrypt

            cost = max(int(h[4:6]) for h in self.users.values())
            self._dummy = bcrypt.hashpw(os.urandom(16).hex().encode(), bcrypt.gensalt(rounds=cost))
        return self._dummy

    def _key(self, user: str, password: str) -> bytes:
        hashed = self.users.get(user, b"")
        return hashlib.sha256(hashed + b"\0" + user.encode() + b"\0" + password.encode()).digest()

    def verdict(self, header: str | None) -> bool | None:
        """The answer to ``header`` that needs no bcrypt check, or None when only :meth:`authorized` can tell.

        True without users or for a credential that passed before; False for no or a malformed header (no user
        name is involved, so answering at once says nothing) and for a credential that failed recently.
        """
        if not self.users:
            return True
        cred = _credentials(header)
        if cred is None:
            return False
        key = self._key(*cred)
        with self._lock:
            if key in self._ok:
                return True
            failed = self._bad.get(key)
            if failed is not None and time.monotonic() - failed < _FAILURE_TTL:
                return False
            self._bad.pop(key, None)
        return None

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value (None: absent) passes basic auth (always True without users).

        Blocks for a bcrypt check (tens of ms, one at a time in the process) unless :meth:`verdict` can answer: a
        credential that passed is remembered (as a salted digest), one that failed is refused for five minutes, and
        an unknown user is checked against a dummy hash of the same cost (the time does not tell who exists).
        """
        known = self.verdict(header)
        cred = _credentials(header)
        if known is not None or cred is None:  # verdict() answered False for no credentials
            return bool(known)
        user, password = cred
        import bcrypt

        with _BCRYPT:
            try:
                good = (
                    bcrypt.checkpw(password.encode(), self.users.get(user) or self._dummy_hash()) and user in self.users
                )
            except ValueError:
                good = False
        key = self._key(user, password)
        with self._lock:
            if good:
                self._ok.add(key)
            else:
                self._bad[key] = time.monotonic()
                while len(self._bad) > _FAILURES_KEPT:
                    self._bad.popitem(last=False)
        return good

    def peer_allowed(self, sock: ssl.SSLSocket) -> bool:
        """Whether a TLS client's (verified) certificate carries one of :attr:`allowed_sans` (always, if empty)."""
        if not self.allowed_sans:
            return True
        cert = sock.getpeercert()
        sans: Any = cert.get("subjectAltName", ()) if cert else ()
        return any(str(entry[1]) in self.allowed_sans for entry in sans)


def _pem(tls: dict[str, Any], cfg: Path, tmp: Path, file_key: str, inline_key: str) -> Path | None:
    """The PEM file for ``file_key`` (a path) or ``inline_key`` (the PEM text itself, written to ``tmp``)."""
    if file_key in tls and inline_key in tls:
        raise WebConfigError(cfg, f"give tls_server_config.{file_key} or .{inline_key}, not both")
    if inline_key in tls:
        text = tls[inline_key]
        if not isinstance(text, str) or "-----BEGIN" not in text:
            raise WebConfigError(cfg, f"tls_server_config.{inline_key} must be PEM text")
        out = tmp / inline_key
        out.write_text(text, encoding="utf-8")
        return out
    if file_key in tls:
        if not isinstance(tls[file_key], str) or not tls[file_key]:
            raise WebConfigError(cfg, f"tls_server_config.{file_key} must be a file path")
        return cfg.parent / str(tls[file_key])  # an absolute path stays itself
    return None


def _tls(tls: dict[str, Any], cfg: Path) -> tuple[ssl.SSLContext, frozenset[str]]:
    unknown = sorted(set(tls) - _TLS_KEYS)
    if unknown:
        raise WebConfigError(cfg, f"unknown tls_server_config key(s) {', '.join(unknown)}")
    if tls.get("curve_preferences"):
        raise WebConfigError(cfg, "tls_server_config.curve_preferences is not supported (Python's ssl); remove it")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    for name, attr in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        if name in tls:
            version = _VERSIONS.get(str(tls[name]))
            if version is None:
                raise WebConfigError(cfg, f"tls_server_config.{name} must be one of {', '.join(_VERSIONS)}")
            setattr(ctx, attr, version)
    if ctx.maximum_version != ssl.TLSVersion.MAXIMUM_SUPPORTED and ctx.maximum_version < ctx.minimum_version:
        raise WebConfigError(cfg, "tls_server_config.max_version is below min_version")
    suites = tls.get("cipher_suites")
    if suites:
        if not isinstance(suites, list) or any(str(s) not in _CIPHERS for s in suites):
            bad = [str(s) for s in (suites if isinstance(suites, list) else [suites]) if str(s) not in _CIPHERS]
            raise WebConfigError(cfg, f"tls_server_config.cipher_suites: unknown suite(s) {', '.join(bad)}")
        try:
            ctx.set_ciphers(":".join(_CIPHERS[str(s)] for s in suites))
        except ssl.SSLError:
            raise WebConfigError(cfg, "tls_server_config.cipher_suites: this OpenSSL offers none of them") from None
    if not tls.get("prefer_server_cipher_suites", True):  # Python's default and Go's: the server's order
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    with tempfile.TemporaryDirectory(prefix="smiquery-web-") as d:
        tmp = Path(d)
        cert = _pem(tls, cfg, tmp, "cert_file", "cert")
        key = _pem(tls, cfg, tmp, "key_file", "key")
        ca = _pem(tls, cfg, tmp, "client_ca_file", "client_ca")
        if cert is None or key is None:
            raise WebConfigError(cfg, "tls_server_config needs cert_file and key_file (or cert and key)")
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(cfg, f"cannot load the certificate and key ({exc})") from None
        auth = str(tls.get("client_auth_type") or ("RequireAndVerifyClientCert" if ca is not None else "NoClientCert"))
        if auth in _UNVERIFIED_AUTH:
            why = f"client_auth_type {auth} (a certificate taken without verifying it) is not supported"
            raise WebConfigError(cfg, f"{why}; use RequireAndVerifyClientCert with client_ca_file")
        if auth not in _CLIENT_AUTH:
            raise WebConfigError(cfg, f"client_auth_type {auth!r} is not one of {', '.join(_CLIENT_AUTH)}")
        ctx.verify_mode = _CLIENT_AUTH[auth]
        if ctx.verify_mode != ssl.CERT_NONE:
            if ca is None:
                raise WebConfigError(cfg, f"client_auth_type {auth} needs client_ca_file")
            try:
                ctx.load_verify_locations(cafile=str(ca))
            except (OSError, ssl.SSLError) as exc:
                raise WebConfigError(cfg, f"cannot load client_ca_file ({exc})") from None
    sans = tls.get("client_allowed_sans") or []
    if not isinstance(sans, list):
        raise WebConfigError(cfg, "tls_server_config.client_allowed_sans must be a list of names")
    if sans and auth != "RequireAndVerifyClientCert":
        raise WebConfigError(cfg, "tls_server_config.client_allowed_sans needs RequireAndVerifyClientCert")
    return ctx, frozenset(str(s) for s in sans)


def _http(http: Any, cfg: Path) -> dict[str, str]:
    if not isinstance(http, dict):
        raise WebConfigError(cfg, "http_server_config must be a mapping")
    unknown = sorted(set(http) - _HTTP_KEYS)
    if unknown:
        raise WebConfigError(cfg, f"unknown http_server_config key(s) {', '.join(unknown)}")
    if http.get("http2"):
        raise WebConfigError(cfg, "http_server_config.http2: true is not supported (HTTP/1.1 only); remove it")
    headers = http.get("headers") or {}
    if not isinstance(headers, dict):
        raise WebConfigError(cfg, "http_server_config.headers must map header names to values")
    out: dict[str, str] = {}
    allowed = {h.lower(): h for h in _HEADERS}
    for name, value in headers.items():
        canon = allowed.get(str(name).lower())
        if canon is None:
            raise WebConfigError(cfg, f"http_server_config.headers: {name} is not one of {', '.join(_HEADERS)}")
        text = str(value)
        if any(c in text for c in "\r\n\0"):
            raise WebConfigError(cfg, f"http_server_config.headers.{name} has a line break")
        out[canon] = text
    return out


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read a web configuration file (exporter-toolkit YAML): the settings, the TLS context built.

    Raises WebConfigError for a missing file, bad YAML, unknown or unsupported keys, a bad hash or unreadable TLS files.
    """
    import yaml

    cfg = Path(path)
    try:
        data = yaml.safe_load(cfg.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WebConfigError(cfg, f"cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise WebConfigError(cfg, f"not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise WebConfigError(cfg, "the top level must be a mapping")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise WebConfigError(cfg, f"unknown key(s) {', '.join(unknown)}")
    out = WebConfig()
    users = data.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise WebConfigError(cfg, "basic_auth_users must map user names to bcrypt hashes")
    for user, hashed in users.items():
        text = str(hashed or "")
        if not text.startswith(("$2a$", "$2b$", "$2y$")) or len(text) != 60 or not text[4:6].isdecimal():
            raise WebConfigError(cfg, f"basic_auth_users.{user} is not a bcrypt hash (htpasswd -nBC 12 '' makes one)")
        out.users[str(user)] = text.encode()
    if out.users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            raise WebConfigError(cfg, "basic_auth_users needs bcrypt: pip install 'smiquery[export]'") from None
        out._dummy_hash()  # the dummy hash for unknown users, made now rather than on the first guess
    tls = data.get("tls_server_config")
    if tls:
        if not isinstance(tls, dict):
            raise WebConfigError(cfg, "tls_server_config must be a mapping")
        out.ssl_context, out.allowed_sans = _tls(tls, cfg)
    if data.get("http_server_config"):
        out.headers = _http(data["http_server_config"], cfg)
    return out
