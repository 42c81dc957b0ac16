"""Web configuration in the Prometheus exporter-toolkit format: TLS and basic auth for the scrape endpoint.

The file every Prometheus exporter accepts with ``--web-config-file``::

    tls_server_config:
      cert_file: server.pem
      key_file: server.key
      client_ca_file: ca.pem                 # optional
      client_auth_type: RequireAndVerifyClientCert
    basic_auth_users:
      prometheus: $2b$12$...                 # bcrypt hash (htpasswd -nBC 12 "" | tr -d ':')

Relative paths are relative to the file's folder. Unknown keys are errors, as in the toolkit.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smiquery.errors import WebConfigError

__all__ = ["WebConfig", "WebConfigError", "load_web_config"]

_TLS_KEYS = frozenset(
    {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version", "cipher_suites"}
    | {"curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans", "cert", "key", "client_ca"}
)
_TOP_KEYS = frozenset({"tls_server_config", "basic_auth_users", "http_server_config"})
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}


@dataclass
class WebConfig:
    """TLS and basic-auth settings for the exporter's HTTP server.

    Attributes:
        ssl_context: the server TLS context, or None for plain HTTP.
        users: user name -> bcrypt hash; empty for no authentication.
    """

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)
    _ok: set[bytes] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def cached(self, header: str | None) -> bool:
        """Whether :meth:`authorized` answers ``header`` without a bcrypt check (no users, or seen before)."""
        if not self.users:
            return True
        key = self._key(header)
        if key is None:
            return True  # malformed or unknown: refused at once, no bcrypt either
        with self._lock:
            return key in self._ok

    def _key(self, header: str | None) -> bytes | None:
        if not header or header[:6].lower() != "basic ":
            return None
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        hashed = self.users.get(user)
        if not sep or hashed is None:
            return None
        return hashlib.sha256(hashed + b"\0" + user.encode() + b"\0" + password.encode()).digest()

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value passes basic auth (always True without users).

        A bcrypt check costs tens of milliseconds by design; a credential that passed once is remembered (as a
        salted digest, never in clear) so that scrapes stay fast.

        Args:
            header: the header value, or None when absent.

        Returns:
            True when access is allowed.
        """
        if not self.users:
            return True
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if not sep or hashed is None:
            return False
        key = hashlib.sha256(hashed + b"\0" + user.encode() + b"\0" + password.encode()).digest()
        with self._lock:
            if key in self._ok:
                return True
        import bcrypt

        try:
            good = bcrypt.checkpw(password.encode(), hashed)
        except ValueError:
            return False
        if good:
            with self._lock:
                self._ok.add(key)
        return good


def _path(base: Path, value: Any, what: str, cfg: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise WebConfigError(cfg, f"{what} must be a file path")
    p = Path(value)
    return p if p.is_absolute() else base / p


def load_web_config(path: str | os.PathLike[str]) -> WebConfig:
    """Read a web configuration file (exporter-toolkit format).

    Args:
        path: the YAML file.

    Returns:
        The settings, with the TLS context built and the certificate and key loaded.

    Raises:
        WebConfigError: the file is missing, not YAML, has unknown keys, a bad hash, or unreadable TLS files.
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
        if not text.startswith(("$2a$", "$2b$", "$2y$")) or len(text) != 60:
            raise WebConfigError(cfg, f"basic_auth_users.{user} is not a bcrypt hash (htpasswd -nBC 12 '' makes one)")
        out.users[str(user)] = text.encode()
    if out.users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            raise WebConfigError(cfg, "basic_auth_users needs bcrypt: pip install 'smiquery[export]'") from None
    tls = data.get("tls_server_config")
    if tls:
        if not isinstance(tls, dict):
            raise WebConfigError(cfg, "tls_server_config must be a mapping")
        unknown = sorted(set(tls) - _TLS_KEYS)
        if unknown:
            raise WebConfigError(cfg, f"unknown tls_server_config key(s) {', '.join(unknown)}")
        base = cfg.parent
        cert = _path(base, tls.get("cert_file"), "tls_server_config.cert_file", cfg)
        key = _path(base, tls.get("key_file"), "tls_server_config.key_file", cfg)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = _VERSIONS.get(str(tls.get("min_version", "TLS12")), ssl.TLSVersion.TLSv1_2)
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(cfg, f"cannot load the certificate and key ({exc})") from None
        auth = str(tls.get("client_auth_type") or ("RequireAndVerifyClientCert" if tls.get("client_ca_file") else ""))
        if auth:
            if auth not in _CLIENT_AUTH:
                raise WebConfigError(cfg, f"client_auth_type {auth!r} is not one of {', '.join(_CLIENT_AUTH)}")
            ctx.verify_mode = _CLIENT_AUTH[auth]
            ca = tls.get("client_ca_file")
            if ca:
                try:
                    ctx.load_verify_locations(cafile=str(_path(base, ca, "tls_server_config.client_ca_file", cfg)))
                except (OSError, ssl.SSLError) as exc:
                    raise WebConfigError(cfg, f"cannot load client_ca_file ({exc})") from None
            elif ctx.verify_mode != ssl.CERT_NONE and auth.endswith("VerifyClientCert"):
                raise WebConfigError(cfg, f"client_auth_type {auth} needs client_ca_file")
        out.ssl_context = ctx
    return out
