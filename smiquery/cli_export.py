"""``smiquery export``: serve Prometheus metrics from one background nvidia-smi loop.

:func:`register` adds the command to a typer app; ``python -m smiquery.cli_export export ...`` runs it alone.
Exit codes: 0 stopped by SIGTERM, 130 by SIGINT (Ctrl-C), 1 the port is taken (or needs root) or the exporter
cannot run, 2 a bad option (usage error, including a --bind address that is not on this machine), 3 nvidia-smi
not found.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from smiquery.errors import InvalidFieldError, InvalidGpuIdError, NvidiaSmiNotFoundError, SmiqueryError
from smiquery.fields import resolve_fields
from smiquery.oneshot import normalize_gpus

__all__ = ["LogFormat", "Naming", "app", "export", "register"]

_ALL_INTERFACES = {"0.0.0.0", "::", "[::]"}


class LogFormat(str, Enum):
    """How log lines look: text with a time stamp, or one JSON object per line."""

    text = "text"
    json = "json"


class Naming(str, Enum):
    """Metric naming: smiquery's own (base units), the DCGM exporter's, or nvidia_gpu_exporter's."""

    smiquery = "smiquery"
    dcgm = "dcgm"
    nvidia_smi = "nvidia_smi"


def _say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)


def _fail(message: str, code: int) -> typer.Exit:
    _say(f"smiquery: error: {message}")
    return typer.Exit(code)


def export(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port).")] = 9849,
    bind: Annotated[
        str,
        typer.Option(help="Address to listen on. 0.0.0.0 or :: (all interfaces) only when you say so."),
    ] = "127.0.0.1",
    interval: Annotated[float, typer.Option(help="Seconds between nvidia-smi samples.")] = 5.0,
    fields: Annotated[
        str,
        typer.Option(
            help="A preset (health, default, memory, power, clocks, throttle, all), a comma list, or 'supported' "
            "(every field this driver supplies, asked once at start)."
        ),
    ] = "health",
    gpus: Annotated[
        str | None, typer.Option(help="Only these GPUs: indices, UUIDs or PCI bus ids, comma list.")
    ] = None,
    label: Annotated[
        list[str] | None,
        typer.Option("--label", help="Constant label key=value on every series (repeat for more)."),
    ] = None,
    naming: Annotated[
        Naming,
        typer.Option(
            case_sensitive=False,
            help="smiquery: base units; dcgm: the DCGM exporter's names and labels; nvidia_smi: nvidia_gpu_exporter's.",
        ),
    ] = Naming.smiquery,
    processes: Annotated[
        bool, typer.Option("--processes/--no-processes", help="Also export per-process GPU memory.")
    ] = False,
    processes_interval: Annotated[float, typer.Option(help="Seconds between process listings.")] = 15.0,
    top_processes: Annotated[
        int,
        typer.Option(
            "--top-processes",
            min=0,
            help="Also run nvidia-smi pmon and export the N busiest processes per GPU (SM and memory use, GPU "
            "memory; one 'other' series sums the rest). 0: off, no pmon at all.",
        ),
    ] = 0,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate: serve HTTPS.", exists=True, dir_okay=False, readable=True)
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(help="PEM private key of --tls-cert.", exists=True, dir_okay=False, readable=True)
    ] = None,
    client_ca: Annotated[
        Path | None,
        typer.Option(
            help="PEM CA bundle: require client certificates signed by it.", exists=True, dir_okay=False, readable=True
        ),
    ] = None,
    web_config_file: Annotated[
        Path | None,
        typer.Option(
            "--web-config-file",
            help="Prometheus exporter-toolkit web config: tls_server_config and basic_auth_users (bcrypt).",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    alert: Annotated[
        list[str] | None,
        typer.Option(
            "--alert",
            help="smiquery alert rule evaluated on every sample, exported as smiquery_alert_firing (repeat; "
            "'none' for none). Default: 'temperature.gpu > 85 for 3'.",
        ),
    ] = None,
    log_format: Annotated[
        LogFormat, typer.Option(case_sensitive=False, help="Log lines on stderr: text or json.")
    ] = LogFormat.text,
    stale_after: Annotated[
        float | None,
        typer.Option(help="Seconds after which data counts as stale (default: max(3 x interval, 15))."),
    ] = None,
    nvidia_smi: Annotated[
        str | None, typer.Option("--nvidia-smi", help="Path of nvidia-smi (default: the global option, PATH).")
    ] = None,
) -> None:
    """Serve Prometheus metrics on /metrics (and /healthz) from ONE background nvidia-smi loop.

    Scrapes read the newest sample; they never start nvidia-smi.
    """
    # --- validation: every bad option is a usage error (exit 2) before anything runs
    if interval <= 0:
        raise typer.BadParameter("must be a positive number of seconds", param_hint="'--interval'")
    if processes_interval <= 0:
        raise typer.BadParameter("must be a positive number of seconds", param_hint="'--processes-interval'")
    if stale_after is not None and stale_after <= 0:
        raise typer.BadParameter("must be a positive number of seconds", param_hint="'--stale-after'")
    if not bind.strip():
        raise typer.BadParameter("must be an address such as 127.0.0.1", param_hint="'--bind'")
    try:
        if fields != "supported":
            resolve_fields(fields)
    except InvalidFieldError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--fields'") from None
    try:
        normalize_gpus(gpus)
    except InvalidGpuIdError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--gpus'") from None
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("HTTPS needs both --tls-cert and --tls-key", param_hint="'--tls-cert/--tls-key'")
    if client_ca is not None and tls_cert is None:
        raise typer.BadParameter(
            "client certificates need HTTPS: add --tls-cert and --tls-key", param_hint="'--client-ca'"
        )
    try:
        from smiquery import exporter as exporter_mod
    except ImportError as exc:
        raise _fail(str(exc), 1) from None
    try:
        labels = exporter_mod.parse_labels(label)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--label'") from None
    taken = sorted({"command", "user"} & set(labels)) if top_processes else []
    if taken:
        raise typer.BadParameter(
            f"label name {taken[0]!r} is set by the exporter itself with --top-processes; pick another name",
            param_hint="'--label'",
        )
    if nvidia_smi is None:
        nvidia_smi = getattr(ctx.obj, "nvidia_smi", None)
    if web_config_file is not None and tls_cert is not None:
        raise typer.BadParameter(
            "give TLS either in --web-config-file or as --tls-cert/--tls-key", param_hint="'--web-config-file'"
        )
    rules: list[str] | None = None
    if alert:
        rules = [] if [a.strip().lower() for a in alert] == ["none"] else list(alert)
        try:
            from smiquery.alerts import Rule

            for text in rules:
                Rule.parse(text)
        except SmiqueryError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--alert'") from None
    web = None
    if web_config_file is not None:
        try:
            web = exporter_mod.load_web_config(web_config_file)
        except exporter_mod.WebConfigError as exc:
            raise typer.BadParameter(str(exc), param_hint="'--web-config-file'") from None
    configured = [h for h in logging.getLogger("smiquery").handlers if not isinstance(h, logging.NullHandler)]
    if not configured and not logging.getLogger().handlers:
        exporter_mod.configure_logging("json" if log_format is LogFormat.json else "text")

    try:
        exp = exporter_mod.serve(
            port=port,
            bind=bind,
            interval=interval,
            fields=fields,
            gpus=gpus,
            labels=labels,
            naming=naming.value,
            processes=processes,
            processes_interval=processes_interval,
            top_processes=top_processes,
            tls_cert=tls_cert,
            tls_key=tls_key,
            client_ca=client_ca,
            nvidia_smi=nvidia_smi,
            stale_after=stale_after,
            web_config=web,
            alerts=rules if rules is not None else exporter_mod.DEFAULT_EXPORTER_ALERTS,
        )
    except exporter_mod.PortInUseError as exc:
        raise _fail(str(exc), 1) from None
    except exporter_mod.ListenError as exc:
        if exc.option == "--bind":
            raise typer.BadParameter(str(exc), param_hint="'--bind'") from None
        raise _fail(str(exc), 1) from None
    except NvidiaSmiNotFoundError as exc:
        raise _fail(str(exc), 3) from None
    except OSError as exc:  # unreadable or mismatched TLS files (ssl.SSLError is an OSError)
        raise typer.BadParameter(f"cannot load them: {exc}", param_hint="'--tls-cert/--tls-key/--client-ca'") from None
    except SmiqueryError as exc:
        raise _fail(str(exc), 1) from None

    code = _run_until_signal(exp, bind)
    raise typer.Exit(code)


def _run_until_signal(exp: Any, bind: str) -> int:
    """Serve until SIGTERM (exit 0) or SIGINT (exit 130); the stream is closed and nvidia-smi reaped either way."""
    got: list[int] = []
    wake = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        wake.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        naming = exp.collector.naming
        _say(
            f"smiquery export: serving {exp.url}/metrics (naming {naming}, every {exp.stream.interval:g} s); "
            "probes at /livez and /readyz; Ctrl-C or SIGTERM stops"
        )
        if bind in _ALL_INTERFACES and not exp.url.startswith("https"):
            _say("smiquery export: warning: listening on all interfaces without TLS")
        while not wake.wait(0.5):
            if exp.stopped:
                break
    except KeyboardInterrupt:
        got.append(signal.SIGINT)
    finally:
        exp.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got and got[0] == signal.SIGINT:
        return 130
    return 0


def register(app: typer.Typer) -> None:
    """Add the ``export`` command to a typer app.

    Args:
        app: the app (``smiquery.cli.app``, or a fresh ``typer.Typer()`` in tests).
    """
    app.command("export", context_settings={"help_option_names": ["-h", "--help"]})(export)


app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False, no_args_is_help=True)


@app.callback()
def _root() -> None:
    """smiquery export, runnable alone: python -m smiquery.cli_export export [OPTIONS]."""


register(app)


if __name__ == "__main__":
    app()
