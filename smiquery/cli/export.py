"""``smiquery export``: serve Prometheus metrics from one background nvidia-smi loop.

Every bad option is a usage error (exit 2) before anything runs; run as its own process, the command hands its
parsed options to :mod:`smiquery.cli._export_run` with ``os.execv``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

import smiquery.cli._export_run as export_run
from smiquery.cli._boundary import as_usage, boundary
from smiquery.cli._common import app, seconds_option, settings_of, version_callback
from smiquery.cli._export_run import LogFormat, Naming, TopBy, hand_off, invalid, run_export
from smiquery.errors import InvalidFieldError, InvalidGpuIdError, SmiqueryError
from smiquery.fields import resolve_fields
from smiquery.streams.argv import normalize_gpus

__all__ = ["LogFormat", "Naming", "TopBy", "export"]


def _file(help_text: str) -> Any:
    """A typer option naming a readable file."""
    return typer.Option(help=help_text, exists=True, dir_okay=False, readable=True)


_EPILOG = """\b
Endpoints: /metrics (Prometheus text), /livez (200 while the server runs:
a liveness probe), /readyz (200 while the GPU data is fresh and every GPU
seen is there, else 503 with the reason: a readiness probe; /healthz is the
same).

\b
Examples:
  smiquery export
  smiquery export --interval 15s --fields health --label cluster=a100-pod3
  smiquery export --bind 0.0.0.0 --port 9400 --naming dcgm
  smiquery export --processes --top-processes 5
  smiquery export --slurm --bind 0.0.0.0
  smiquery export --web-config-file web.yml
  curl -s localhost:9849/metrics | grep smiquery_temperature_gpu_celsius
  curl -fsS localhost:9849/readyz
"""


@app.command("export", epilog=_EPILOG)
def export(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port).")] = 9849,
    bind: Annotated[
        str, typer.Option(help="Address to listen on. 0.0.0.0 or :: (all interfaces) only when you say so.")
    ] = "127.0.0.1",
    interval: Annotated[float, seconds_option("--interval", "Seconds between nvidia-smi samples.")] = 5.0,
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
        list[str] | None, typer.Option(help="Constant label key=value on every series (repeat for more).")
    ] = None,
    naming: Annotated[
        Naming,
        typer.Option(
            case_sensitive=False,
            help="smiquery: base units; dcgm: the DCGM exporter's names and labels; nvidia_smi: nvidia_gpu_exporter's.",
        ),
    ] = "smiquery",
    processes: Annotated[bool, typer.Option(help="Also export per-process GPU memory.")] = False,
    processes_interval: Annotated[
        float, seconds_option("--processes-interval", "Seconds between process listings.")
    ] = 15.0,
    top_processes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also run nvidia-smi pmon and export the N busiest processes per GPU (SM and memory use, GPU "
            "memory; one 'other' series sums the rest). 0: off, no pmon at all.",
        ),
    ] = 0,
    top_processes_by: Annotated[
        TopBy,
        typer.Option(
            case_sensitive=False,
            help="Label --top-processes series by process name (bounded: the processes of one name are summed) or "
            "by pid (one series per process, with pid and user labels: every new pid is a new series).",
        ),
    ] = "name",
    tls_cert: Annotated[Path | None, _file("PEM certificate: serve HTTPS.")] = None,
    tls_key: Annotated[Path | None, _file("PEM private key of --tls-cert.")] = None,
    client_ca: Annotated[Path | None, _file("PEM CA bundle: require client certificates signed by it.")] = None,
    web_config_file: Annotated[
        Path | None, _file("Prometheus exporter-toolkit web config: tls_server_config and basic_auth_users (bcrypt).")
    ] = None,
    alert: Annotated[
        list[str] | None,
        typer.Option(
            help="smiquery alert rule evaluated on every sample, exported as smiquery_alert_firing{alert=RULE} "
            "(repeat; 'none' for none), beside the default rule 'temperature.gpu > 85 for 3' that the shipped "
            "GpuTemperatureCritical matches."
        ),
    ] = None,
    default_alerts: Annotated[
        bool,
        typer.Option(
            help="Evaluate the default rule 'temperature.gpu > 85 for 3' whatever --alert says. Turning it off "
            "silences GpuTemperatureCritical (SmiqueryDefaultAlertMissing says so)."
        ),
    ] = True,
    log_format: Annotated[
        LogFormat, typer.Option(case_sensitive=False, help="Log lines on stderr: text or json.")
    ] = "text",
    stale_after: Annotated[
        float | None,
        seconds_option("--stale-after", "Seconds after which data counts as stale (default: max(3 x interval, 15))."),
    ] = None,
    nvidia_smi: Annotated[
        str | None, typer.Option(help="Path of nvidia-smi (default: the global option, PATH).")
    ] = None,
    kubernetes: Annotated[
        bool,
        typer.Option(
            help="Say which pod holds each GPU (kubelet pod-resources API): smiquery_gpu_allocation_info, pod "
            "labels on GPUs one container holds. Needs the k8s extra."
        ),
    ] = False,
    pod_resources_socket: Annotated[
        str, typer.Option(help="The kubelet's pod-resources socket (with --kubernetes).")
    ] = "/var/lib/kubelet/pod-resources/kubelet.sock",
    kubernetes_processes: Annotated[
        bool,
        typer.Option(
            help="Also per-pod use of shared GPUs (process cgroups + the pods of this node from the Kubernetes API; "
            "implies --kubernetes, --processes and --top-processes 16 or more; needs hostPID and RBAC list pods)."
        ),
    ] = False,
    slurm: Annotated[
        bool,
        typer.Option(
            help="Say which Slurm job holds each GPU (squeue and scontrol, on their own thread): "
            "smiquery_gpu_allocation_info, slurm_* labels on GPUs one job holds, per-job use and "
            "smiquery_gpu_unallocated_use from process cgroups (implies --processes)."
        ),
    ] = False,
    slurm_node: Annotated[
        str | None, typer.Option(help="This node's Slurm name (default: SLURMD_NODENAME, else the short host name).")
    ] = None,
    slurm_interval: Annotated[
        float,
        seconds_option(
            "--slurm-interval",
            "Seconds between Slurm listings (one squeue per listing, plus squeue and scontrol per new job; "
            "slurmctld answers every node).",
        ),
    ] = 10.0,
    slurm_bin_dir: Annotated[str | None, typer.Option(help="Where squeue and scontrol are (default: PATH).")] = None,
    details_interval: Annotated[
        float,
        seconds_option(
            "--details-interval",
            "Seconds between nvidia-smi -q -x runs (per-MIG-instance memory), in their own thread, never on a "
            "scrape. 0 or off: none.",
            off=True,
        ),
    ] = 60.0,
    kernel_log: Annotated[
        str,
        typer.Option(
            help="Kernel log to count Xid errors from (smiquery_xid_errors_total): /dev/kmsg (needs CAP_SYSLOG or "
            "root) or a plain file followed like tail -F. '': off."
        ),
    ] = "/dev/kmsg",
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=version_callback, is_eager=True, help="Print smiquery's version and exit."
        ),
    ] = False,
) -> None:
    """Serve Prometheus metrics on /metrics (probes at /livez and /readyz) from ONE background nvidia-smi loop.

    Scrapes read the newest sample; they never start nvidia-smi.
    """
    settings = settings_of(ctx)
    with boundary(settings.debug):
        labels, rules = _checked(ctx.params)
        from smiquery.exporter import DEFAULT_EXPORTER_ALERTS

        defaults = DEFAULT_EXPORTER_ALERTS if default_alerts else ()
        paths = ("tls_cert", "tls_key", "client_ca", "web_config_file")
        opts = {
            **ctx.params,  # every option by name, as parsed (JSON-safe)
            **{name: str(ctx.params[name]) if ctx.params[name] else None for name in paths},
            "labels": labels,
            # the default rules first (the shipped Prometheus rules match their text), each rule once
            "alerts": list(dict.fromkeys([*defaults, *(rules or [])])),
            "nvidia_smi": nvidia_smi if nvidia_smi is not None else settings.nvidia_smi,
            "details_interval": details_interval or None,
            "kernel_log": kernel_log or None,
            "debug": settings.debug,
        }
        if export_run.process_entry:
            hand_off(opts, sys.argv[1:])  # returns only when the process image cannot be replaced
        raise typer.Exit(run_export(opts))


def _checked(p: dict[str, Any]) -> tuple[dict[str, str], list[str] | None]:
    """Every bad option is a usage error (exit 2) before anything runs; returns the labels and the alert rules.

    The durations are checked by their parser (seconds_option), the labels and rules by the exporter's own
    parsers, the web config where it is loaded (run_export).
    """
    if not p["bind"].strip():
        raise invalid("--bind", "must be an address such as 127.0.0.1")
    with as_usage("Invalid value for '--fields': {}", InvalidFieldError):
        if p["fields"] != "supported":
            resolve_fields(p["fields"])
    with as_usage("Invalid value for '--gpus': {}", InvalidGpuIdError):
        normalize_gpus(p["gpus"])
    if (p["tls_cert"] is None) != (p["tls_key"] is None):
        raise invalid("--tls-cert/--tls-key", "HTTPS needs both --tls-cert and --tls-key")
    if p["client_ca"] is not None and p["tls_cert"] is None:
        raise invalid("--client-ca", "client certificates need HTTPS: add --tls-cert and --tls-key")
    if p["web_config_file"] is not None and p["tls_cert"] is not None:
        raise invalid("--web-config-file", "give TLS either in --web-config-file or as --tls-cert/--tls-key")
    from smiquery import exporter as exporter_mod  # needs prometheus_client: after the checks that do not
    from smiquery.alerts import Rule

    if p["slurm"] and (p["kubernetes"] or p["kubernetes_processes"]):
        raise invalid("--slurm", "give either --kubernetes or --slurm, not both")
    with as_usage("Invalid value for '--label': {}", ValueError):
        labels = exporter_mod.parse_labels(p["label"])
    taken = sorted({"command", "user"} & set(labels)) if p["top_processes"] else []
    if taken:
        message = f"label name {taken[0]!r} is set by the exporter itself with --top-processes; pick another name"
        raise invalid("--label", message)
    rules: list[str] | None = None
    if p["alert"]:
        rules = [] if [a.strip().lower() for a in p["alert"]] == ["none"] else list(p["alert"])
        with as_usage("Invalid value for '--alert': {}", SmiqueryError):
            for text in rules:
                Rule.parse(text)
    return labels, rules
