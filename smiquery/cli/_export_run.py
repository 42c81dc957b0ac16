"""The serving half of ``smiquery export``: runs the exporter from options typer already parsed, without typer.

Run as its own process, ``smiquery export`` replaces its image (:func:`hand_off`, ``os.execv``: same pid, signals
and exit codes) with ``python -m smiquery.cli._export_run``, which reads the options back (:data:`HANDOFF_ENV`) and
imports only the exporter's path: what a long-running process keeps resident counts. The typer command stays the
one option table; inside another program (typer's test runner) the command calls :func:`run_export` instead.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from smiquery.cli._boundary import ExitCode, as_usage, boundary, say
from smiquery.cli._signals import Signals
from smiquery.errors import ListenError, SmiqueryError, UsageError

if TYPE_CHECKING:
    from smiquery.attribution import Attribution

__all__ = ["MODULES_ENV", "LogFormat", "Naming", "TopBy", "hand_off", "invalid", "process_entry", "run_export"]

# The exporter's own choices, spelled here: the exporter needs prometheus_client, which `smiquery --help` must not
# import (tests/cli/test_export.py checks that they are the exporter's).
Naming = Literal["smiquery", "dcgm", "nvidia_smi"]
LogFormat = Literal["text", "json"]
TopBy = Literal["name", "pid"]

#: Carries the parsed options (JSON) across ``os.execv``; removed on arrival (no child sees it).
HANDOFF_ENV = "SMIQUERY_EXPORT_OPTIONS"
#: A file the serving process writes its loaded modules' names to, once serving (the tests check what stays resident).
MODULES_ENV = "SMIQUERY_EXPORT_MODULES_FILE"
#: Set to ``0`` to keep ``smiquery export`` in the process typer parsed it in (debugging, profiling that process).
EXEC_ENV = "SMIQUERY_EXPORT_EXEC"

_ALL_INTERFACES = {"0.0.0.0", "::", "[::]"}

#: Set by :func:`smiquery.cli.main` as the process's own entry: only then may ``export`` replace the process image.
process_entry = False


def invalid(option: str, message: str) -> UsageError:
    """A usage error worded as typer words its own (``Invalid value for '--bind': ...``), exit 2."""
    return UsageError(f"Invalid value for '{option}': {message}")


def _attribution(opts: dict[str, Any]) -> Attribution | None:
    """The exporter's workload attribution (Kubernetes pods or Slurm jobs), or None.

    A missing k8s extra or a label that clashes with the backend's labels is a usage error.
    """
    if not (opts["kubernetes"] or opts["kubernetes_processes"] or opts["slurm"]):
        return None
    from smiquery.attribution import Attribution, Backend, check_labels

    backend: Backend
    interval = opts["interval"]
    if opts["slurm"]:
        from smiquery.attribution.slurm import SlurmBackend

        backend = SlurmBackend(opts["slurm_node"], bin_dir=opts["slurm_bin_dir"], nvidia_smi=opts["nvidia_smi"])
        interval = opts["slurm_interval"]
    else:
        try:
            from smiquery.attribution.kubernetes import KubernetesBackend, PodDirectory
        except ImportError as exc:
            missing = f"needs the k8s extra ({exc.name} is missing): pip install 'smiquery[k8s]'"
            raise invalid("--kubernetes", missing) from None
        pods = PodDirectory(max(opts["interval"], 15.0)) if opts["kubernetes_processes"] else None
        backend = KubernetesBackend(opts["pod_resources_socket"], pods=pods)
    with as_usage("Invalid value for '--label': {}", ValueError):
        check_labels(backend, opts["labels"])
    return Attribution(backend, interval=interval, nvidia_smi=opts["nvidia_smi"])


def run_export(opts: dict[str, Any]) -> int:
    """Serve until SIGTERM (returns 143) or SIGINT (130); errors propagate to the caller's boundary.

    ``opts``: the ``export`` command's parameters by name, checked, JSON-safe (paths as text), plus ``labels``,
    ``alerts`` and ``debug``. An address that cannot be listened on, unloadable TLS files or web config and a
    missing k8s extra are UsageErrors.
    """
    from smiquery import exporter as exporter_mod
    from smiquery.exporter.events import json_line

    attribution = _attribution(opts)
    processes, top_processes = opts["processes"] or opts["slurm"], opts["top_processes"]
    if opts["kubernetes_processes"]:
        processes, top_processes = True, max(top_processes, 16)
    configured = [h for h in logging.getLogger("smiquery").handlers if not isinstance(h, logging.NullHandler)]
    if not configured and not logging.getLogger().handlers:
        exporter_mod.configure_logging(opts["log_format"])
    web = None
    if opts["web_config_file"] is not None:
        with as_usage("Invalid value for '--web-config-file': {}", SmiqueryError):
            web = exporter_mod.load_web_config(opts["web_config_file"])
    served = inspect.signature(exporter_mod.serve).parameters  # the options of the same name go as they are
    given = {name: value for name, value in opts.items() if name in served}
    given.update(processes=processes, top_processes=top_processes, web_config=web, attribution=attribution)
    try:
        exp = exporter_mod.serve(**given)
    except ListenError as exc:
        if exc.option == "--bind":
            raise invalid("--bind", str(exc)) from None
        raise
    except OSError as exc:  # unreadable or mismatched TLS files (ssl.SSLError is an OSError)
        raise invalid("--tls-cert/--tls-key/--client-ca", f"cannot load them: {exc}") from None

    def tell(text: str, level: int, event: str, **fields: Any) -> None:
        as_json = opts["log_format"] == "json"
        say(json_line(text, level=level, event=event, **fields) if as_json else f"smiquery export: {text}")

    with Signals() as sigs:  # the stream is closed and nvidia-smi reaped however serving ends
        try:
            tell(
                f"serving {exp.url}/metrics (naming {exp.collector.naming}, every "
                f"{getattr(exp.stream, 'interval', 0):g} s); probes at /livez and /readyz; Ctrl-C or SIGTERM stops",
                logging.INFO,
                "serving",
                url=f"{exp.url}/metrics",
            )
            if modules := os.environ.get(MODULES_ENV):
                with open(modules, "w", encoding="utf-8") as out:
                    out.write("".join(f"{name}\n" for name in sorted(sys.modules)))
            if opts["bind"] in _ALL_INTERFACES and not exp.url.startswith("https"):
                tell("warning: listening on all interfaces without TLS", logging.WARNING, "no_tls_on_all_interfaces")
            while not sigs.wake.wait(0.5) and not exp.stopped:
                pass
        except KeyboardInterrupt:
            sigs.signum = sigs.signum or signal.SIGINT
        finally:
            sigs.closing = True
            exp.stop()
    return sigs.exit_code


def hand_off(opts: dict[str, Any], argv: list[str]) -> None:
    """Replace this process with the lean exporter (``os.execv``; ``ps`` shows ``argv``); returns only if it cannot."""
    if os.environ.get(EXEC_ENV, "1") == "0":
        return
    import subprocess

    # this interpreter's flags (-X importtime, -W ..., -u), by the stdlib's own helper (multiprocessing uses it)
    flags = getattr(subprocess, "_args_from_interpreter_flags", None)
    new_argv = [sys.executable, *(flags() if callable(flags) else []), "-m", "smiquery.cli._export_run", *argv]
    env = {**os.environ, HANDOFF_ENV: json.dumps(opts)}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    try:
        os.execve(sys.executable, new_argv, env)
    except OSError:
        return  # no interpreter to run (none known, not executable): serve in this process instead


def main() -> NoReturn:
    """``python -m smiquery.cli._export_run``: serve the options ``smiquery export`` handed over."""
    text = os.environ.pop(HANDOFF_ENV, None)
    if text is None:
        say("smiquery: usage error: this module is started by `smiquery export`; run that (see `smiquery export -h`)")
        sys.exit(ExitCode.USAGE)
    opts = json.loads(text)
    try:
        with boundary(opts["debug"]):
            sys.exit(run_export(opts))
    except KeyboardInterrupt:
        sys.exit(ExitCode.INTERRUPTED)


if __name__ == "__main__":
    main()
