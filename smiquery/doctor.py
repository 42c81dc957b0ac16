"""Diagnosing nvidia-smi, the driver, the GPUs and the container set-up, as data the CLI renders.

:func:`run_checks` returns one :class:`CheckResult` per check; ``fail`` is kept for what stops monitoring, ``warn``
for what only degrades it. :func:`exit_code` turns results into the documented exit code.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from smiquery.errors import (
    DriverNotLoadedError,
    DriverVersionMismatchError,
    GpuLostError,
    InsufficientPermissionsError,
    InvalidArgumentError,
    NoDevicesFoundError,
    NvidiaSmiNotFoundError,
    NvidiaSmiTimeoutError,
    NvmlNotFoundError,
    ParseError,
    SmiqueryError,
    failure_from_exit,
)
from smiquery.fields import PRESETS

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    from smiquery.sample import GpuSample

__all__ = ["CHECK_NAMES", "CheckResult", "Status", "driver_fields", "exit_code", "in_container", "run_checks"]

Status = Literal["ok", "warn", "fail", "skip"]

#: The checks, in the order they are reported.
CHECK_NAMES = (
    "nvidia-smi found",
    "driver reachable",
    "driver/library match",
    "GPU count",
    "infoROM",
    "persistence mode",
    "MIG mode",
    "memory and clock health",
    "container",
    "NVIDIA_DRIVER_CAPABILITIES",
    "NVIDIA_VISIBLE_DEVICES",
    "default fields supported",
)

# the checks that a broken nvidia-smi or driver leaves undone (reported as skipped): all but the binary's, the
# infoROM warning's and the container's
_NEED_DRIVER = [n for n in CHECK_NAMES[1:] if n not in ("infoROM", "container") and not n.startswith("NVIDIA_")]
_FIX_CONTAINER = "start the container with --gpus all (or set NVIDIA_DRIVER_CAPABILITIES=compute,utility)"
_FIX_VISIBLE = "set NVIDIA_VISIBLE_DEVICES=all (or GPU indices/UUIDs), or start the container with --gpus all"
_FIX_INSTALL = (
    "install the NVIDIA driver, or pass --nvidia-smi PATH / set SMIQUERY_NVIDIA_SMI; in a container, start it with "
    "--gpus all"
)


@dataclass(frozen=True)
class CheckResult:
    """The result of one doctor check (``name``, one of :data:`CHECK_NAMES`): what was found (``diagnosis``, one line).

    ``status``: ``ok``; ``warn`` (monitoring works, but something degrades it); ``fail`` (it stops monitoring); ``skip``
    (not applicable, or impossible after an earlier failure). ``fix``: what to do, for ``warn`` and ``fail``;
    ``code``: the exit code a failure stands for: 3 nvidia-smi missing, 4 driver, 5 timeout, 1 anything else.
    """

    name: str
    status: Status
    diagnosis: str
    fix: str = ""
    code: int = 0

    @property
    def failed(self) -> bool:
        """True for a failure (what stops monitoring)."""
        return self.status == "fail"


def exit_code(results: Sequence[CheckResult], *, gate: bool = False) -> int:
    """The exit code for results: the first failure's code (3, 4, 5 or 1), else 1 for a warning (not with ``gate``)."""
    failed = [r for r in results if r.failed]
    if failed:
        return failed[0].code or 1
    if not gate and any(r.status == "warn" for r in results):
        return 1
    return 0


def in_container() -> str | None:
    """Why this looks like a container (``/.dockerenv exists``), or None outside one."""
    for marker in ("/.dockerenv", "/run/.containerenv"):
        if os.path.exists(marker):
            return f"{marker} exists"
    try:
        text = Path("/proc/1/cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = [w for w in ("docker", "kubepods", "containerd", "libpod") if w in text]
    return f"/proc/1/cgroup mentions {found[0]}" if found else None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _parse_version(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower().removesuffix(" version")
        name = {"kmd": "driver", "cuda umd": "cuda"}.get(key, key)  # 610 on: the KMD and UMD versions count
        if sep and name in ("nvidia-smi", "driver", "nvml", "cuda") and "deprecated" not in value.lower():
            out.setdefault(name, value.strip())
    return out


def _message(exc: BaseException) -> str:
    """nvidia-smi's own message (the first line that is no CSV row), else the error's text."""
    output = getattr(exc, "output", None)
    if isinstance(output, str) and output.strip() and not isinstance(exc, ParseError):
        lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
        return next((ln for ln in lines if ", " not in ln or ln.endswith(".")), lines[0])
    return _one_line(str(exc))


# Errors whose hint is the fix for their cause wherever they happen (a field error's hint is not: at NVML start-up,
# "Not Supported" means NVML could not start, and the text decides).
_CAUSE_ERRORS = (DriverVersionMismatchError, InsufficientPermissionsError, GpuLostError, NoDevicesFoundError)


def _failure(name: str, exc: BaseException, *, in_ctr: bool) -> CheckResult:
    """A failed check for an error, with the one fix that matches its cause."""
    message = _message(exc)
    if isinstance(exc, NvidiaSmiTimeoutError):
        fix = "check `dmesg` for Xid errors and try `nvidia-smi` by hand; enable persistence mode if it is slow"
        return CheckResult(name, "fail", _one_line(str(exc)), fix, 5)
    if isinstance(exc, ParseError):
        fix = "nvidia-smi printed output that does not fit the fields; look at plain `nvidia-smi` output"
    elif isinstance(exc, NvmlNotFoundError):
        fix = _FIX_CONTAINER if in_ctr else "reinstall the driver's utility libraries (libnvidia-ml.so)"
    elif isinstance(exc, DriverNotLoadedError):
        fix = "check the driver with `lsmod | grep nvidia` and `dmesg`, or reinstall it"
    elif isinstance(exc, _CAUSE_ERRORS):
        # the typed error knows its cause whatever the text around it ("Failed to initialize NVML: Driver/library
        # version mismatch" wants a reboot, not NVML start-up advice)
        fix = exc.hint
    elif "Failed to initialize NVML" in message:
        fix = (
            "NVML could not start: check that the driver is loaded (`lsmod | grep nvidia`), that /dev/nvidia* are "
            "readable by this user, and `dmesg` for Xid errors"
        )
    else:
        fix = getattr(exc, "hint", "")
        if not fix or "smiquery doctor" in fix:
            fix = "run plain `nvidia-smi` to see the whole message, and check `dmesg` for Xid errors"
    return CheckResult(name, "fail", message, fix, exc.exit_status if isinstance(exc, SmiqueryError) else 1)


def driver_fields(binary: str, timeout: float) -> dict[str, str]:
    """Field name (or alias) -> description as ``binary --help-query-gpu`` lists them; raises as help_query_gpu does."""
    from smiquery.fields import help_query_gpu
    from smiquery.runner import default_runner

    names: dict[str, str] = {}
    for entry in help_query_gpu(default_runner().run, binary, timeout):
        for n in (entry.name, *entry.aliases):
            names.setdefault(n, entry.description)
    return names


@dataclass
class _Progress:
    """What the checks found so far: their results, and why later nvidia-smi checks are skipped."""

    ctr: str | None
    results: list[CheckResult] = field(default_factory=list)
    binary: str | None = None
    version: dict[str, str] = field(default_factory=dict)
    broken: str | None = None
    failure: BaseException | None = None

    def fail(self, name: str, exc: BaseException) -> None:
        self.results.append(_failure(name, exc, in_ctr=self.ctr is not None))


def run_checks(nvidia_smi: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> list[CheckResult]:
    """One result per check (:data:`CHECK_NAMES`' order) for an nvidia-smi (None: the one found); never raises.

    ``timeout``: seconds per nvidia-smi call.
    """
    done = _Progress(in_container())
    _check_binary(done, nvidia_smi, timeout)
    samples, caught = _query_driver(done, timeout)
    if samples is not None and done.binary is not None:
        done.results += _gpu_checks(samples, done.version, caught)
        done.results.append(_details_check(done.binary, timeout))
        done.results.append(_default_fields_check(done, done.binary, timeout))
    done.results += _container_checks(done.ctr, found=done.binary is not None, failure=done.failure)
    present = {r.name for r in done.results}
    skipped = done.broken or "nvidia-smi is not working"
    done.results += [CheckResult(name, "skip", skipped) for name in _NEED_DRIVER if name not in present]
    return sorted(done.results, key=lambda r: CHECK_NAMES.index(r.name))


def _check_binary(done: _Progress, nvidia_smi: str | os.PathLike[str] | None, timeout: float) -> None:
    """1. the binary, and its version."""
    from smiquery.runner import default_runner, find_nvidia_smi

    try:
        done.binary = binary = find_nvidia_smi(nvidia_smi)
    except NvidiaSmiNotFoundError as exc:
        done.failure = exc
        fix = _FIX_CONTAINER if done.ctr else _FIX_INSTALL
        done.results.append(CheckResult("nvidia-smi found", "fail", _one_line(str(exc).split(";")[0]), fix, 3))
        done.broken = "nvidia-smi not found"
        return
    argv = [binary, "--version"]
    try:
        ran = default_runner().run(argv, timeout)
        if ran.returncode == 0:
            done.version = _parse_version(ran.stdout)
        else:
            done.failure = failure_from_exit(argv, ran.returncode, ran.output)
    except SmiqueryError as exc:
        done.failure = exc
    parts = [f"{k.replace('cuda', 'CUDA')} {v}" for k, v in done.version.items() if k != "nvml"]
    detail = binary + (f" ({', '.join(parts)})" if parts else " (`nvidia-smi --version` reported no version)")
    done.results.append(CheckResult("nvidia-smi found", "ok", detail))
    if isinstance(done.failure, (NvidiaSmiTimeoutError, NvidiaSmiNotFoundError)):
        done.fail("driver reachable", done.failure)
        done.broken = "nvidia-smi did not answer" if isinstance(done.failure, NvidiaSmiTimeoutError) else "no binary"


def _query_driver(done: _Progress, timeout: float) -> tuple[list[GpuSample] | None, list[warnings.WarningMessage]]:
    """2-6. driver, library match, GPUs, infoROM, persistence, MIG: one query (None when it failed)."""
    from smiquery.sources.query_gpu import query

    if done.broken is not None or done.binary is None:
        return None, []
    names = ["index", "name", "driver_version", "persistence_mode", "mig.mode.current"]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                samples = query(names, nvidia_smi=done.binary, timeout=timeout)
            except InvalidArgumentError:
                samples = query(names[:3], nvidia_smi=done.binary, timeout=timeout)
        done.failure = None
        return samples, caught
    except SmiqueryError as exc:
        done.failure = exc
        if isinstance(exc, DriverVersionMismatchError):
            done.results.append(CheckResult("driver reachable", "ok", "the kernel module answers"))
            done.fail("driver/library match", exc)
            done.broken = "driver/library mismatch"
        elif isinstance(exc, NoDevicesFoundError):
            done.results.append(CheckResult("driver reachable", "ok", "the driver answers"))
            done.results.append(CheckResult("driver/library match", "ok", "nvidia-smi talks to the driver"))
            done.fail("GPU count", exc)
            done.broken = "no GPU"
        else:
            done.fail("driver reachable", exc)
            done.broken = "the driver is not reachable"
    return None, []


#: Clock event reasons that mean the hardware itself slows the GPU down (not an application's or the user's cap).
_HW_SLOWDOWN = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")


def _details_check(binary: str, timeout: float) -> CheckResult:
    """9. memory and clock health from ``nvidia-smi -q -x``: row remaps and page retirements, hardware slowdowns."""
    from smiquery.sources.details import details

    name = "memory and clock health"
    try:
        gpus = details(nvidia_smi=binary, timeout=max(timeout, 10.0))  # -q -x is slow on big servers
    except SmiqueryError as exc:
        fix = "run `nvidia-smi -q` by hand; the health details (ECC rows, slowdowns) cannot be read"
        return CheckResult(name, "warn", f"nvidia-smi -q -x failed: {_message(exc)}", fix)
    failed = [g.index for g in gpus if g.remapped_rows is not None and g.remapped_rows.failure]
    if failed:
        why = f"row remapping failed on GPU {_listed(failed)}: its memory cannot be repaired"
        fix = "drain the GPU's jobs and have the GPU serviced (RMA); check `dmesg` for Xid 64"
        return CheckResult(name, "fail", why, fix)
    pending = [g.index for g in gpus if any(r is not None and r.pending for r in (g.remapped_rows, g.retired_pages))]
    slow = {g.index: [r for r in g.clock_event_reasons or () if r in _HW_SLOWDOWN] for g in gpus}
    slow = {i: r for i, r in slow.items() if r}
    said, fixes = [], []
    if pending:
        said.append(f"a row remap or page retirement waits for a reset on GPU {_listed(pending)}")
        fixes.append("reset the GPU when idle (`nvidia-smi -r -i N`) or reboot so the repair takes effect")
    if slow:
        said.append("; ".join(f"GPU {i} slowed by {', '.join(r)}" for i, r in slow.items()))
        fixes.append("check cooling and power (fans, inlet temperature, power supply)")
    if said:
        return CheckResult(name, "warn", "; ".join(said), "; ".join(fixes))
    mig = sum(len(g.mig_devices) for g in gpus)
    extra = f"; {mig} MIG instance{'s' if mig != 1 else ''}" if mig else ""
    return CheckResult(name, "ok", f"no pending or failed memory repairs, no hardware slowdown{extra}")


def _listed(items: Iterable[object]) -> str:
    return ", ".join(map(str, items))


def _default_fields_check(done: _Progress, binary: str, timeout: float) -> CheckResult:
    """8. the default preset's fields, against what the driver lists."""
    name = "default fields supported"
    try:
        have = driver_fields(binary, timeout)
    except SmiqueryError as exc:
        return _failure(name, exc, in_ctr=done.ctr is not None)
    lacking = [n for n in PRESETS["default"] if n not in have]
    if lacking:
        fix = "pass --fields without them (see `smiquery fields --supported`) or upgrade the driver"
        return CheckResult(name, "warn", f"this driver lacks {_listed(lacking)}", fix)
    return CheckResult(name, "ok", f"all {len(PRESETS['default'])} supported")


def _gpu_checks(
    samples: Sequence[GpuSample], version: dict[str, str], caught: Sequence[warnings.WarningMessage]
) -> Iterator[CheckResult]:
    drivers = sorted({str(s.get("driver_version")) for s in samples if s.get("driver_version") is not None})
    drv = version.get("driver") or (drivers[0] if drivers else "")
    yield CheckResult("driver reachable", "ok", f"driver {', '.join(drivers) or drv or '(version unknown)'}")
    nvml = version.get("nvml", "")
    name = "driver/library match"
    if nvml and drv and nvml.split(".")[0] != drv.split(".")[0]:
        fix = "reboot (or reload the nvidia kernel modules) so the driver matches the library"
        yield CheckResult(name, "fail", f"NVML {nvml} but driver {drv}", fix, 4)
    elif nvml and drv:
        yield CheckResult(name, "ok", f"NVML {nvml} matches driver {drv}")
    else:
        # A mismatch makes every query fail; this one worked, so the two agree even without version numbers.
        yield CheckResult(name, "ok", "nvidia-smi queries the driver (NVML version not shown)")
    lost = [s.index for s in samples if s.gpu_lost]
    gpu_names = sorted({str(s.get("name")) for s in samples if s.get("name")})
    if not samples:
        yield CheckResult("GPU count", "fail", "0 GPUs", "check `nvidia-smi -L` and NVIDIA_VISIBLE_DEVICES", 4)
    elif lost:
        said = f"{len(samples)} GPUs; GPU {_listed(lost)} is lost (fell off the bus)"
        yield CheckResult("GPU count", "fail", said, GpuLostError.hint, 4)
    else:
        plural = "s" if len(samples) != 1 else ""
        yield CheckResult("GPU count", "ok", f"{len(samples)} GPU{plural}: {', '.join(gpu_names)}")
    rom = [str(w.message) for w in caught if "infoROM" in str(w.message) or "exited 14" in str(w.message)]
    if rom:
        fix = "the GPU's infoROM is corrupted; values still read, but report it to the vendor (RMA)"
        yield CheckResult("infoROM", "warn", _one_line(rom[0]), fix)
    pm = [(s.index, s.get("persistence_mode")) for s in samples]
    off = [i for i, v in pm if v is False]
    if all(v is None for _, v in pm):
        yield CheckResult("persistence mode", "skip", "not reported by this driver (n/a)")
    elif off:
        said = f"disabled on GPU {_listed(off)}: every nvidia-smi call re-initialises the driver (slow)"
        fix = "run `sudo nvidia-smi -pm 1` or enable the nvidia-persistenced service"
        yield CheckResult("persistence mode", "warn", said, fix)
    else:
        yield CheckResult("persistence mode", "ok", "enabled")
    mig = [(s.index, s.get("mig.mode.current")) for s in samples]
    on = [i for i, v in mig if v is True]
    said = f"enabled on GPU {_listed(on)}: GPU utilization is n/a there; use MIG devices" if on else "disabled"
    reported = any(v is not None for _, v in mig)
    yield CheckResult("MIG mode", "ok", said if reported else "not supported or not reported (n/a)")


def _container_checks(ctr: str | None, *, found: bool, failure: BaseException | None) -> Iterator[CheckResult]:
    """The container set-up: a variable is a warning only when it may explain a failure seen above."""
    if ctr is None:
        yield CheckResult("container", "ok", "not in a container")
        return
    yield CheckResult("container", "ok", f"in a container ({ctr})")
    working = found and failure is None
    # nvidia-smi and libnvidia-ml come from the host only with the `utility` capability (NVIDIA-SMI.md section 7)
    missing_tool = "nvidia-smi" if not found else "libnvidia-ml.so" if isinstance(failure, NvmlNotFoundError) else ""
    caps = os.environ.get("NVIDIA_DRIVER_CAPABILITIES")
    name = "NVIDIA_DRIVER_CAPABILITIES"
    if caps is None and missing_tool:
        yield CheckResult(name, "warn", f"unset: {missing_tool} is not mounted without it", _FIX_CONTAINER)
    elif caps is None:
        yield CheckResult(name, "ok", "unset (nvidia-smi is mounted anyway)")
    elif {w.strip().lower() for w in caps.split(",")} & {"utility", "all"}:
        yield CheckResult(name, "ok", f"{caps} (includes utility)")
    elif working or not missing_tool:
        yield CheckResult(name, "ok", f"{caps} (lacks utility, but nvidia-smi and NVML are there)")
    else:
        yield CheckResult(name, "warn", f"{caps!r} lacks utility: {missing_tool} is not mounted", _FIX_CONTAINER)
    visible = os.environ.get("NVIDIA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    name = "NVIDIA_VISIBLE_DEVICES"
    if (visible or "").strip().lower() not in ("", "void", "none"):
        yield CheckResult(name, "ok", visible or "")
    elif isinstance(failure, (NoDevicesFoundError, DriverNotLoadedError)):
        yield CheckResult(name, "warn", f"{shown}: no GPU is passed in", _FIX_VISIBLE)
    else:
        yield CheckResult(name, "ok", f"{shown} (GPUs are reachable anyway)" if working else shown)
