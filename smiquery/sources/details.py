"""``nvidia-smi -q -x``, typed: what the CSV cannot say (:func:`details`, :func:`parse_xml`); slow (0.4-6 s).

Each value is read where the XML's DTD version keeps it; a missing one is None with its reason in ``missing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from xml.parsers import expat

from smiquery.errors import NvidiaSmiTimeoutError, ParseError, failure_from_exit
from smiquery.kinds import MISSING_REASONS, missing_reason
from smiquery.runner import default_runner, find_nvidia_smi
from smiquery.sources.query_gpu import DEFAULT_TIMEOUT, judge_exit
from smiquery.streams.argv import normalize_gpus

if TYPE_CHECKING:
    import os

    from smiquery.runner import Runner
    from smiquery.streams.argv import GpusArg

__all__ = [
    "KNOWN_DTD_VERSIONS",
    "DetailsProcess",
    "GpuDetails",
    "MigDevice",
    "RemappedRows",
    "RetiredPages",
    "details",
    "parse_list",
    "parse_xml",
]

#: The DTD versions whose layout is known (seen in captures of drivers 352 to 595).
KNOWN_DTD_VERSIONS = (7, 8, 9, 10, 11, 12, 13)

_DTD_RE = re.compile(r"nvsmi_device_v(\d+)\.dtd")
_MIB_RE = re.compile(r"(-?\d+)\s*MiB")


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance of a GPU.

    ``index`` is as ``nvidia-smi -L`` numbers it, memory in MiB; ``profile`` (``3g.20gb``) and ``uuid`` come from
    ``nvidia-smi -L``. ``missing``: attribute -> why it is None.
    """

    index: int | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    profile: str | None
    uuid: str | None
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    sm_count: int | None
    missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DetailsProcess:
    """A process on a GPU as ``-q -x`` lists it.

    ``type`` is ``C``/``G``/``C+G`` (None before DTD v11), ``used_memory`` MiB, the instance ids only with MIG.
    """

    pid: int | None
    type: str | None
    name: str | None
    used_memory: int | None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RetiredPages:
    """Pages retired for ECC errors (before Ampere); ``pending``: one waits for a driver reload or GPU reset."""

    single_bit: int | None
    double_bit: int | None
    pending: bool | None
    missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RemappedRows:
    """Memory rows remapped for ECC errors (Ampere on); ``pending`` waits for a reset; ``failure`` needs service."""

    correctable: int | None
    uncorrectable: int | None
    pending: bool | None
    failure: bool | None
    missing: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuDetails:
    """One GPU from ``nvidia-smi -q -x``, in output order (``index``); memory in MiB.

    A value that is None has its reason in ``missing`` (``not_available`` for ``N/A``, ``absent: ...`` for an
    element the file lacks, ``not in DTD vN``). ``clock_event_reasons`` are the active clock event (throttle)
    reasons by short name (``sw_power_cap``); ``processes`` is None without a process section; ``mig_mode`` is
    ``Enabled``/``Disabled`` (None without MIG); ``inforom`` maps each inforom object to its version.
    """

    index: int
    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    serial: str | None
    vbios_version: str | None
    driver_version: str | None
    dtd_version: int | None
    memory_total: int | None
    memory_used: int | None
    memory_free: int | None
    clock_event_reasons: tuple[str, ...] | None
    retired_pages: RetiredPages | None
    remapped_rows: RemappedRows | None
    processes: tuple[DetailsProcess, ...] | None
    mig_mode: str | None
    mig_devices: tuple[MigDevice, ...]
    inforom: Mapping[str, str]
    bridge_chip_type: str | None
    bridge_chip_fw: str | None
    missing: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """Plain data (nested records as dicts) for JSON."""
        return dataclasses.asdict(self)  # mappings become dicts, tuples stay tuples (json writes lists)


@dataclass(frozen=True)
class _Reading:
    """Where one DTD version keeps the values that moved."""

    version: int | None
    clock_reasons: tuple[str, ...]  # container elements, tried in order; children are <prefix><reason>
    v11: bool  # remapped rows, MIG and process types (DTD v11 on)


_THROTTLE = "clocks_throttle_reasons"
_EVENT = "clocks_event_reasons"


@functools.cache
def _warn_once(what: str) -> None:
    warnings.warn(
        f"nvidia-smi -q -x: {what} (known: v7-v13); values are read by element name and any not found are "
        "None with a reason; check that smiquery is up to date",
        UserWarning,
        stacklevel=4,
    )


def _reading_for(text: str) -> _Reading:
    m = _DTD_RE.search(text[:4096])
    version = int(m.group(1)) if m else None
    if version in KNOWN_DTD_VERSIONS:
        # v12 covers both names: driver 535 prints the old one, 550 the new
        reasons = (_EVENT,) if version == 13 else (_EVENT, _THROTTLE) if version == 12 else (_THROTTLE,)
        return _Reading(version, reasons, version >= 11)
    _warn_once(f"DTD nvsmi_device_v{version}.dtd is not one smiquery knows" if m else "the XML names no DTD version")
    return _Reading(version, (_EVENT, _THROTTLE), True)  # by name: every spelling, nothing assumed absent


class _Values:
    """Reads typed values out of one element, recording why each missing one is missing."""

    def __init__(self, elem: ET.Element, version: int | None) -> None:
        self.elem = elem
        self.version = version
        self.missing: dict[str, str] = {}

    def absent(self, attr: str, path: str) -> None:
        where = f" (DTD v{self.version})" if self.version is not None else ""
        self.missing[attr] = f"absent: no <{path}> in this output{where}"

    def not_in_version(self, attr: str) -> None:
        self.missing[attr] = f"not in DTD v{self.version}"

    def text(self, attr: str, path: str) -> str | None:
        node = self.elem.find(path)
        if node is None:
            self.absent(attr, path)
            return None
        value = (node.text or "").strip()
        reason = missing_reason(value) or _BARE.get(value.lower())
        if reason is not None:
            self.missing[attr] = reason
            return None
        return value

    def integer(self, attr: str, path: str) -> int | None:
        value = self.text(attr, path)
        if value is None:
            return None
        m = _MIB_RE.fullmatch(value)
        digits = m.group(1) if m else value
        try:
            return int(digits)
        except ValueError:
            self.missing[attr] = f"unreadable: {value!r}"
            return None

    def flag(self, attr: str, path: str) -> bool | None:
        value = self.text(attr, path)
        flag = None if value is None else _FLAGS.get(value.lower())
        if value is not None and flag is None:
            self.missing[attr] = f"unreadable: {value!r}"
        return flag


# The XML prints nvidia-smi's status tokens without brackets (``N/A``, ``Not Supported``).
_BARE = {token.strip("[]").lower(): reason for token, reason in MISSING_REASONS.items()}
_FLAGS = {
    **dict.fromkeys(("yes", "true", "active", "enabled"), True),
    **dict.fromkeys(("no", "false", "not active", "disabled"), False),
}


def _section(gpu: ET.Element, tag: str, vals: _Values) -> _Values | None:
    """The section's values; None when it is absent or a bare ``N/A`` (the reason recorded under ``tag``)."""
    node = gpu.find(tag)
    if node is None:
        vals.absent(tag, tag)
    elif len(node) == 0:
        vals.missing[tag] = _BARE.get((node.text or "").strip().lower()) or missing_reason(node.text or "") or "empty"
    else:
        return _Values(node, vals.version)
    return None


def _clock_reasons(gpu: ET.Element, reading: _Reading, vals: _Values) -> tuple[str, ...] | None:
    for tag in reading.clock_reasons:
        node = gpu.find(tag)
        if node is None:
            continue
        prefix = tag.removesuffix("s") + "_"  # clocks_event_reasons -> clocks_event_reason_
        return tuple(c.tag.removeprefix(prefix) for c in node if (c.text or "").strip().lower() == "active")
    vals.absent("clock_event_reasons", " or ".join(reading.clock_reasons))
    return None


def _retired(gpu: ET.Element, vals: _Values) -> RetiredPages | None:
    sub = _section(gpu, "retired_pages", vals)
    if sub is None:
        return None
    return RetiredPages(
        sub.integer("single_bit", "multiple_single_bit_retirement/retired_count"),
        sub.integer("double_bit", "double_bit_retirement/retired_count"),
        sub.flag("pending", "pending_retirement"),
        sub.missing,
    )


def _remapped(gpu: ET.Element, reading: _Reading, vals: _Values) -> RemappedRows | None:
    if not reading.v11:
        vals.not_in_version("remapped_rows")
        return None
    sub = _section(gpu, "remapped_rows", vals)
    if sub is None:
        return None
    return RemappedRows(
        sub.integer("correctable", "remapped_row_corr"),
        sub.integer("uncorrectable", "remapped_row_unc"),
        sub.flag("pending", "remapped_row_pending"),
        sub.flag("failure", "remapped_row_failure"),
        sub.missing,
    )


def _processes(gpu: ET.Element, reading: _Reading, vals: _Values) -> tuple[DetailsProcess, ...] | None:
    node = gpu.find("processes")
    if node is None:
        vals.absent("processes", "processes")
        return None
    out = []
    for info in node.findall("process_info"):
        sub = _Values(info, vals.version)
        pid = sub.integer("pid", "pid")
        if reading.v11 or info.find("type") is not None:
            ptype = sub.text("type", "type")
        else:
            ptype = None
            sub.not_in_version("type")
        name = sub.text("name", "process_name")
        mem = sub.integer("used_memory", "used_memory")
        gi = ci = None
        if info.find("gpu_instance_id") is not None:
            gi = sub.integer("gpu_instance_id", "gpu_instance_id")
            ci = sub.integer("compute_instance_id", "compute_instance_id")
        out.append(DetailsProcess(pid, ptype, name, mem, gi, ci, sub.missing))
    return tuple(out)


def _mig(gpu: ET.Element, reading: _Reading, vals: _Values) -> tuple[str | None, tuple[MigDevice, ...]]:
    if not reading.v11:
        vals.not_in_version("mig_mode")
        return None, ()
    mode = vals.text("mig_mode", "mig_mode/current_mig")
    devices = []
    for dev in gpu.findall("mig_devices/mig_device"):
        sub = _Values(dev, vals.version)
        devices.append(
            MigDevice(
                index=sub.integer("index", "index"),
                gpu_instance_id=sub.integer("gpu_instance_id", "gpu_instance_id"),
                compute_instance_id=sub.integer("compute_instance_id", "compute_instance_id"),
                profile=None,
                uuid=None,
                memory_total=sub.integer("memory_total", "fb_memory_usage/total"),
                memory_used=sub.integer("memory_used", "fb_memory_usage/used"),
                memory_free=sub.integer("memory_free", "fb_memory_usage/free"),
                sm_count=sub.integer("sm_count", "device_attributes/shared/multiprocessor_count"),
                missing={**sub.missing, "profile": "no nvidia-smi -L listing", "uuid": "no nvidia-smi -L listing"},
            )
        )
    return mode, tuple(devices)


def _gpu(index: int, gpu: ET.Element, reading: _Reading, driver: str | None) -> GpuDetails:
    vals = _Values(gpu, reading.version)
    bus = vals.text("pci_bus_id", "pci/pci_bus_id")
    if bus is None and gpu.get("id"):
        bus = gpu.get("id")  # the <gpu id="..."> attribute is the bus id in every version
        vals.missing.pop("pci_bus_id", None)
    versions = ((c.tag, (c.text or "").strip()) for c in gpu.find("inforom_version") or ())
    inforom = {tag: value for tag, value in versions if value.lower() not in _BARE}
    mig_mode, mig_devices = _mig(gpu, reading, vals)
    return GpuDetails(
        index=index,
        name=vals.text("name", "product_name"),
        uuid=vals.text("uuid", "uuid"),
        pci_bus_id=bus,
        serial=vals.text("serial", "serial"),
        vbios_version=vals.text("vbios_version", "vbios_version"),
        driver_version=driver,
        dtd_version=reading.version,
        memory_total=vals.integer("memory_total", "fb_memory_usage/total"),
        memory_used=vals.integer("memory_used", "fb_memory_usage/used"),
        memory_free=vals.integer("memory_free", "fb_memory_usage/free"),
        clock_event_reasons=_clock_reasons(gpu, reading, vals),
        retired_pages=_retired(gpu, vals),
        remapped_rows=_remapped(gpu, reading, vals),
        processes=_processes(gpu, reading, vals),
        mig_mode=mig_mode,
        mig_devices=mig_devices,
        inforom=inforom,
        bridge_chip_type=vals.text("bridge_chip_type", "pci/pci_bridge_chip/bridge_chip_type"),
        bridge_chip_fw=vals.text("bridge_chip_fw", "pci/pci_bridge_chip/bridge_chip_fw"),
        missing=vals.missing,
    )


def _parse_root(text: str) -> ET.Element:
    # An expat pass stops at the first entity declaration (nvidia-smi never writes one), before anything is expanded;
    # element and attribute declarations (older drivers inline their whole DTD) pass.
    def entity(*_args: object) -> None:
        raise ParseError("the XML declares entities; refused (nvidia-smi never does)", lineno=1, line=text[:200])

    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.EntityDeclHandler = entity
    parser.UnparsedEntityDeclHandler = entity
    with contextlib.suppress(expat.ExpatError):  # not well-formed: ElementTree says where
        parser.Parse(text, True)
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        lineno, _col = exc.position
        lines = text.splitlines()
        line = lines[lineno - 1] if 0 < lineno <= len(lines) else ""
        raise ParseError(f"not well-formed nvidia-smi -q -x output ({exc})", lineno=lineno, line=line) from None
    if root.tag != "nvidia_smi_log":
        raise ParseError(f"expected <nvidia_smi_log>, found <{root.tag}>", lineno=1, line=text[:200])
    return root


def parse_xml(text: str | bytes, *, listing: str | None = None) -> list[GpuDetails]:
    """Parse ``nvidia-smi -q -x`` output into one record per GPU, in the order printed.

    ``listing`` (``nvidia-smi -L`` output) gives the MIG devices their UUIDs and profiles. Raises
    ParseError for XML that is not well-formed, not nvidia-smi's, or declares entities.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    root = _parse_root(text)
    reading = _reading_for(text)
    driver_node = root.find("driver_version")
    driver = (driver_node.text or "").strip() or None if driver_node is not None else None
    gpus = [_gpu(i, g, reading, driver) for i, g in enumerate(root.findall("gpu"))]
    return _join_listing(gpus, parse_list(listing)) if listing else gpus


_L_GPU_RE = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[0-9a-fA-F-]+)\)\s*$")
_L_MIG_RE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9A-Za-z/-]+)\)\s*$")


def parse_list(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """Parse ``nvidia-smi -L``: GPU UUID -> its MIG devices as (index, profile, MIG UUID).

    Lines that are neither a GPU nor a MIG device (notices) are skipped.
    """
    out: dict[str, list[tuple[int, str, str]]] = {}
    current: list[tuple[int, str, str]] | None = None
    for line in text.splitlines():
        if m := _L_GPU_RE.match(line):
            current = out.setdefault(m.group(3), [])
        elif (m := _L_MIG_RE.match(line)) and current is not None:
            current.append((int(m.group(2)), m.group(1), m.group(3)))
    return out


def _join_listing(gpus: list[GpuDetails], listing: Mapping[str, list[tuple[int, str, str]]]) -> list[GpuDetails]:
    out = []
    for gpu in gpus:
        found: dict[int | None, tuple[str | None, str | None]] = {
            i: (p, u) for i, p, u in listing.get(gpu.uuid or "", [])
        }
        devices = []
        for dev in gpu.mig_devices:
            profile, uuid = found.get(dev.index, (None, None))
            why = {} if uuid else {"profile": "not in nvidia-smi -L", "uuid": "not in nvidia-smi -L"}
            missing = {k: v for k, v in dev.missing.items() if k not in ("profile", "uuid")} | why
            devices.append(dataclasses.replace(dev, profile=profile, uuid=uuid, missing=missing))
        out.append(dataclasses.replace(gpu, mig_devices=tuple(devices)))
    return out


def details(
    gpus: GpusArg = None,
    *,
    nvidia_smi: str | os.PathLike[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    runner: Runner | None = None,
) -> list[GpuDetails]:
    """Run ``nvidia-smi -q -x`` once and return typed details per GPU, in nvidia-smi's order (slow: 0.4-6 s).

    With MIG enabled, ``nvidia-smi -L`` runs too, within the same ``timeout``, for the MIG UUIDs and profiles. Never
    retries. The arguments and errors are :func:`smiquery.query`'s (``timeout`` bounds the whole call; ParseError:
    XML that does not fit).
    """
    deadline = time.monotonic() + timeout
    ids = normalize_gpus(gpus)
    run = runner or default_runner()
    binary = find_nvidia_smi(nvidia_smi, runner=run)
    argv = [binary, "-q", "-x"] + (["-i", ",".join(ids)] if ids else [])
    done = judge_exit(argv, run.run(argv, timeout), "details")
    start = re.search(r"<\?xml|<nvidia_smi_log", done.stdout)
    if start is None:
        raise failure_from_exit(argv, done.returncode or 1, done.output)
    found = parse_xml(done.stdout[start.start() :])
    if any(g.mig_devices for g in found):
        left = deadline - time.monotonic()
        if left <= 0:
            msg = f"nvidia-smi -q -x used the whole {timeout:g} s; raise the timeout"
            raise NvidiaSmiTimeoutError(msg, argv=argv, timeout=timeout)
        largv = [binary, "-L"]
        listed = run.run(largv, left)
        if listed.returncode != 0:
            raise failure_from_exit(largv, listed.returncode, listed.output)
        found = _join_listing(found, parse_list(listed.stdout))
    return found
