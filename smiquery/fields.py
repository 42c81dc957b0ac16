"""The ``--query-gpu`` field catalogue: names, aliases, units, value kinds and presets.

Every other module takes field facts from here: the argv, record attributes and metric names; what a field's
kind does with its cells (parse, format, display, dtype, metric value) lives in :mod:`smiquery.kinds`.
The catalogue covers every field listed by ``nvidia-smi --help-query-gpu`` on drivers 465 to 610.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import tzinfo
from typing import TYPE_CHECKING

from smiquery.errors import InvalidFieldError
from smiquery.kinds import Kind

if TYPE_CHECKING:
    from smiquery.sample import Value

__all__ = [
    "CATALOGUE",
    "PRESETS",
    "Field",
    "HelpEntry",
    "Kind",
    "get_field",
    "parse_help_query_gpu",
    "resolve_fields",
]


INT, FLOAT, STR = Kind.INT, Kind.FLOAT, Kind.STR
ENABLED, YES_NO, ACTIVE = Kind.ENABLED, Kind.YES_NO, Kind.ACTIVE
HEX, BITMASK, TIMESTAMP = Kind.HEX, Kind.BITMASK, Kind.TIMESTAMP
VERSION, MAJOR_MINOR = Kind.VERSION, Kind.MAJOR_MINOR


@dataclass(frozen=True)
class Field:
    """One ``--query-gpu`` property.

    Attributes:
        name: canonical name, as nvidia-smi prints it in the CSV header.
        kind: value kind; decides the parsed Python type.
        unit: physical unit of the value (``"MiB"``, ``"W"``, ``"C"``...), empty when dimensionless.
        header_unit: unit nvidia-smi prints as ``name [unit]`` in the header (temperatures print none).
        aliases: other names nvidia-smi accepts for it (``gpu_name`` for ``name``).
        since: first driver branch known to list it.
        help: one line saying what it measures.
        attr: Python attribute and DataFrame column name (dots become underscores).
        argv_name: the spelling smiquery sends in ``--query-gpu``: an older alias where every driver accepts it
            (``clocks_throttle_reasons.active``), else ``name``. Output maps columns by position, so records,
            frames and metrics keep ``name`` whichever spelling was sent.
    """

    name: str
    kind: Kind
    unit: str = ""
    header_unit: str | None = None
    aliases: tuple[str, ...] = ()
    since: int = 465
    help: str = ""
    attr: str = field(init=False)
    argv_name: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attr", self.name.replace(".", "_"))
        object.__setattr__(self, "argv_name", _portable_spelling(self.name, self.aliases))
        if self.header_unit is None:
            object.__setattr__(self, "header_unit", self.unit)

    @property
    def header(self) -> str:
        """The column title nvidia-smi prints for this field."""
        return f"{self.name} [{self.header_unit}]" if self.header_unit else self.name

    def parse(self, cell: str, *, tz: tzinfo | None = None) -> Value:
        """One CSV cell of this field -> its value (None for a status token; a header unit suffix is stripped).

        Raises:
            ValueError: the cell is no value of this field's kind.
        """
        return self.kind.ops.parse(cell, self.header_unit or "", tz=tz)

    def format(self, value: Value, reason: str | None = None, *, units: bool = False) -> str:
        """The CSV cell nvidia-smi prints for ``value`` (its status token when None; the unit with ``units``)."""
        return self.kind.ops.format(value, self.unit, reason=reason, suffix=(self.header_unit or "") if units else "")

    def display(self, value: Value, *, missing: str = "n/a", with_unit: bool = False) -> str:
        """``value`` as a table shows it, rounded to the unit's precision (``missing`` when None)."""
        return self.kind.ops.display(value, self.unit, missing=missing, with_unit=with_unit)


# Renamed families whose old spelling every driver accepts (NVIDIA-SMI.md 1.2): the 535 branch renamed
# clocks_throttle_reasons.* to clocks_event_reasons.* and keeps the old names as input aliases, while drivers
# before 535 (R470, R510, R525) reject the new ones with exit 2. Sending the old name works on R465..R610.
_PORTABLE_PREFIXES: tuple[tuple[str, str], ...] = (("clocks_event_reasons.", "clocks_throttle_reasons."),)


def _portable_spelling(name: str, aliases: tuple[str, ...]) -> str:
    for new, old in _PORTABLE_PREFIXES:
        if name.startswith(new) and old + name[len(new) :] in aliases:
            return old + name[len(new) :]
    return name


def _f(name: str, kind: Kind, **kw: object) -> Field:
    return Field(name, kind, **kw)  # type: ignore[arg-type]


CATALOGUE: tuple[Field, ...] = (
    _f("timestamp", TIMESTAMP, help="Time the row was sampled, host local time (nvidia-smi prints no zone)."),
    _f(
        "driver_version",
        VERSION,
        help="Installed NVIDIA display driver version (deprecated from 610 on; see kmd_version).",
    ),
    _f("count", INT, help="Number of NVIDIA GPUs in the system."),
    _f("name", STR, aliases=("gpu_name",), help="Product name of the GPU."),
    _f("serial", STR, aliases=("gpu_serial",), help="Board serial number (shared by GPUs on one board)."),
    _f("uuid", STR, aliases=("gpu_uuid",), help="Globally unique GPU identifier (GPU-...)."),
    _f("pci.bus_id", STR, aliases=("gpu_bus_id",), help="PCI bus id as domain:bus:device.function in hex."),
    _f("pci.domain", HEX, help="PCI domain number (hex)."),
    _f("pci.bus", HEX, help="PCI bus number (hex)."),
    _f("pci.device", HEX, help="PCI device number (hex)."),
    _f("pci.device_id", HEX, help="PCI device id and vendor id (hex)."),
    _f("pci.sub_device_id", HEX, help="PCI sub-system id (hex)."),
    _f(
        "pcie.link.gen.current",
        INT,
        help="Current PCIe link generation (deprecated in 610; use pcie.link.gen.gpucurrent).",
    ),
    _f("pcie.link.gen.max", INT, help="Maximum PCIe link generation of GPU and system together."),
    _f("pcie.link.width.current", INT, help="Current PCIe link width (lanes)."),
    _f("pcie.link.width.max", INT, help="Maximum PCIe link width (lanes)."),
    _f("index", INT, help="Zero-based NVML enumeration index (not necessarily the CUDA order)."),
    _f("display_mode", ENABLED, help="Whether a display may be attached (deprecated on 590+)."),
    _f("display_active", ENABLED, help="Whether a display is initialised on the GPU."),
    _f(
        "persistence_mode",
        ENABLED,
        help="Persistence mode: when disabled, every nvidia-smi call re-initialises the driver and is slow.",
    ),
    _f("accounting.mode", ENABLED, help="Whether per-process accounting is enabled."),
    _f("accounting.buffer_size", INT, help="Size of the process accounting circular buffer."),
    _f("driver_model.current", STR, help="Windows driver model in use (WDDM/TCC/MCDM)."),
    _f("driver_model.pending", STR, help="Windows driver model after the next reboot."),
    _f("vbios_version", VERSION, help="Video BIOS version."),
    _f("inforom.img", VERSION, aliases=("inforom.image",), help="InfoROM image version."),
    _f("inforom.oem", VERSION, help="InfoROM OEM configuration version."),
    _f("inforom.ecc", VERSION, help="InfoROM ECC object version."),
    _f("inforom.pwr", VERSION, aliases=("inforom.power",), help="InfoROM power management object version."),
    _f("gom.current", STR, aliases=("gpu_operation_mode.current",), help="GPU operation mode in use."),
    _f("gom.pending", STR, aliases=("gpu_operation_mode.pending",), help="GPU operation mode after the next reboot."),
    _f("fan.speed", INT, unit="%", help="Fan speed requested by the driver, percent of maximum (may exceed 100)."),
    _f("pstate", STR, help="Performance state, P0 (maximum) to P12/P15 (minimum)."),
    _f("memory.total", INT, unit="MiB", help="Total GPU memory."),
    _f("memory.used", INT, unit="MiB", help="GPU memory allocated by active contexts."),
    _f("memory.free", INT, unit="MiB", help="Free GPU memory."),
    _f("compute_mode", STR, help="Compute mode (Default, Exclusive_Process, Prohibited)."),
    _f("utilization.gpu", INT, unit="%", help="Percent of the sample period during which a kernel was running."),
    _f(
        "utilization.memory",
        INT,
        unit="%",
        help="Percent of the sample period during which memory was read or written.",
    ),
    _f("encoder.stats.sessionCount", INT, help="Number of active encoder sessions."),
    _f("encoder.stats.averageFps", INT, help="Average encoder frames per second over all sessions."),
    _f("encoder.stats.averageLatency", INT, unit="us", header_unit="", help="Average encoder latency in microseconds."),
    _f("ecc.mode.current", ENABLED, help="Whether ECC is enabled."),
    _f("ecc.mode.pending", ENABLED, help="ECC mode after the next reboot."),
    _f(
        "ecc.errors.corrected.volatile.device_memory",
        INT,
        help="Corrected ECC errors in device memory since the driver loaded.",
    ),
    _f("ecc.errors.corrected.volatile.dram", INT, help="Corrected ECC errors in DRAM since the driver loaded."),
    _f(
        "ecc.errors.corrected.volatile.register_file",
        INT,
        help="Corrected ECC errors in the register file since the driver loaded.",
    ),
    _f(
        "ecc.errors.corrected.volatile.l1_cache",
        INT,
        help="Corrected ECC errors in the L1 cache since the driver loaded.",
    ),
    _f(
        "ecc.errors.corrected.volatile.l2_cache",
        INT,
        help="Corrected ECC errors in the L2 cache since the driver loaded.",
    ),
    _f(
        "ecc.errors.corrected.volatile.texture_memory",
        INT,
        help="Corrected ECC errors in texture memory since the driver loaded.",
    ),
    _f("ecc.errors.corrected.volatile.cbu", INT, help="Corrected ECC errors in the CBU since the driver loaded."),
    _f("ecc.errors.corrected.volatile.sram", INT, help="Corrected ECC errors in SRAM since the driver loaded."),
    _f(
        "ecc.errors.corrected.volatile.total",
        INT,
        help="Corrected ECC errors in all locations since the driver loaded.",
    ),
    _f(
        "ecc.errors.corrected.aggregate.device_memory",
        INT,
        help="Corrected ECC errors in device memory over the GPU lifetime.",
    ),
    _f("ecc.errors.corrected.aggregate.dram", INT, help="Corrected ECC errors in DRAM over the GPU lifetime."),
    _f(
        "ecc.errors.corrected.aggregate.register_file",
        INT,
        help="Corrected ECC errors in the register file over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.corrected.aggregate.l1_cache",
        INT,
        help="Corrected ECC errors in the L1 cache over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.corrected.aggregate.l2_cache",
        INT,
        help="Corrected ECC errors in the L2 cache over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.corrected.aggregate.texture_memory",
        INT,
        help="Corrected ECC errors in texture memory over the GPU lifetime.",
    ),
    _f("ecc.errors.corrected.aggregate.cbu", INT, help="Corrected ECC errors in the CBU over the GPU lifetime."),
    _f("ecc.errors.corrected.aggregate.sram", INT, help="Corrected ECC errors in SRAM over the GPU lifetime."),
    _f(
        "ecc.errors.corrected.aggregate.total", INT, help="Corrected ECC errors in all locations over the GPU lifetime."
    ),
    _f(
        "ecc.errors.uncorrected.volatile.device_memory",
        INT,
        help="Uncorrected ECC errors in device memory since the driver loaded.",
    ),
    _f("ecc.errors.uncorrected.volatile.dram", INT, help="Uncorrected ECC errors in DRAM since the driver loaded."),
    _f(
        "ecc.errors.uncorrected.volatile.register_file",
        INT,
        help="Uncorrected ECC errors in the register file since the driver loaded.",
    ),
    _f(
        "ecc.errors.uncorrected.volatile.l1_cache",
        INT,
        help="Uncorrected ECC errors in the L1 cache since the driver loaded.",
    ),
    _f(
        "ecc.errors.uncorrected.volatile.l2_cache",
        INT,
        help="Uncorrected ECC errors in the L2 cache since the driver loaded.",
    ),
    _f(
        "ecc.errors.uncorrected.volatile.texture_memory",
        INT,
        help="Uncorrected ECC errors in texture memory since the driver loaded.",
    ),
    _f("ecc.errors.uncorrected.volatile.cbu", INT, help="Uncorrected ECC errors in the CBU since the driver loaded."),
    _f("ecc.errors.uncorrected.volatile.sram", INT, help="Uncorrected ECC errors in SRAM since the driver loaded."),
    _f(
        "ecc.errors.uncorrected.volatile.total",
        INT,
        help="Uncorrected ECC errors in all locations since the driver loaded.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.device_memory",
        INT,
        help="Uncorrected ECC errors in device memory over the GPU lifetime.",
    ),
    _f("ecc.errors.uncorrected.aggregate.dram", INT, help="Uncorrected ECC errors in DRAM over the GPU lifetime."),
    _f(
        "ecc.errors.uncorrected.aggregate.register_file",
        INT,
        help="Uncorrected ECC errors in the register file over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.l1_cache",
        INT,
        help="Uncorrected ECC errors in the L1 cache over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.l2_cache",
        INT,
        help="Uncorrected ECC errors in the L2 cache over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.texture_memory",
        INT,
        help="Uncorrected ECC errors in texture memory over the GPU lifetime.",
    ),
    _f("ecc.errors.uncorrected.aggregate.cbu", INT, help="Uncorrected ECC errors in the CBU over the GPU lifetime."),
    _f("ecc.errors.uncorrected.aggregate.sram", INT, help="Uncorrected ECC errors in SRAM over the GPU lifetime."),
    _f(
        "ecc.errors.uncorrected.aggregate.total",
        INT,
        help="Uncorrected ECC errors in all locations over the GPU lifetime.",
    ),
    _f(
        "retired_pages.single_bit_ecc.count",
        INT,
        aliases=("retired_pages.sbe",),
        help="Pages retired for multiple single-bit ECC errors.",
    ),
    _f(
        "retired_pages.double_bit.count",
        INT,
        aliases=("retired_pages.dbe",),
        help="Pages retired for double-bit ECC errors.",
    ),
    _f("retired_pages.pending", YES_NO, help="Whether retired pages wait for a reboot to take effect."),
    _f("temperature.gpu", INT, unit="C", header_unit="", help="GPU core temperature in degrees Celsius."),
    _f("temperature.memory", INT, unit="C", header_unit="", help="HBM memory temperature in degrees Celsius."),
    _f("power.management", STR, help="Whether power management is enabled (deprecated on 590+)."),
    _f("power.draw", FLOAT, unit="W", help="Power drawn by the GPU (1 s average on Ampere and later)."),
    _f("power.limit", FLOAT, unit="W", aliases=("gpu.power.requested_limit",), help="Software power limit."),
    _f(
        "enforced.power.limit",
        FLOAT,
        unit="W",
        aliases=("gpu.power.current_limit",),
        help="Power limit actually enforced.",
    ),
    _f("power.default_limit", FLOAT, unit="W", aliases=("gpu.power.default_limit",), help="Default power limit."),
    _f("power.min_limit", FLOAT, unit="W", aliases=("gpu.power.min_limit",), help="Lowest settable power limit."),
    _f("power.max_limit", FLOAT, unit="W", aliases=("gpu.power.max_limit",), help="Highest settable power limit."),
    _f("clocks.current.graphics", INT, unit="MHz", aliases=("clocks.gr",), help="Current graphics clock."),
    _f("clocks.current.sm", INT, unit="MHz", aliases=("clocks.sm",), help="Current SM clock."),
    _f("clocks.current.memory", INT, unit="MHz", aliases=("clocks.mem",), help="Current memory clock."),
    _f("clocks.current.video", INT, unit="MHz", aliases=("clocks.video",), help="Current video clock."),
    _f(
        "clocks.applications.graphics",
        INT,
        unit="MHz",
        aliases=("clocks.applications.gr",),
        help="Application graphics clock (deprecated on 590+).",
    ),
    _f(
        "clocks.applications.memory",
        INT,
        unit="MHz",
        aliases=("clocks.applications.mem",),
        help="Application memory clock (deprecated on 590+).",
    ),
    _f(
        "clocks.default_applications.graphics",
        INT,
        unit="MHz",
        aliases=("clocks.default_applications.gr",),
        help="Default application graphics clock (deprecated on 590+).",
    ),
    _f(
        "clocks.default_applications.memory",
        INT,
        unit="MHz",
        aliases=("clocks.default_applications.mem",),
        help="Default application memory clock (deprecated on 590+).",
    ),
    _f("clocks.max.graphics", INT, unit="MHz", aliases=("clocks.max.gr",), help="Maximum graphics clock."),
    _f("clocks.max.sm", INT, unit="MHz", help="Maximum SM clock."),
    _f("clocks.max.memory", INT, unit="MHz", aliases=("clocks.max.mem",), help="Maximum memory clock."),
    _f("mig.mode.current", ENABLED, help="Whether MIG mode is enabled."),
    _f("mig.mode.pending", ENABLED, help="MIG mode after the next GPU reset."),
    _f(
        "vgpu_driver_capability.heterogenous_multivGPU",
        STR,
        since=590,
        help="vGPU driver capability: heterogenous_multivGPU.",
    ),
    _f("pci.baseClass", HEX, since=590, help="PCI base class code (hex)."),
    _f("pci.subClass", HEX, since=590, help="PCI sub-class code (hex)."),
    _f(
        "vgpu_device_capability.fractional_multiVgpu",
        STR,
        since=590,
        help="vGPU device capability: fractional_multiVgpu.",
    ),
    _f(
        "vgpu_device_capability.heterogeneous_timeSlice_profile",
        STR,
        since=590,
        help="vGPU device capability: heterogeneous_timeSlice_profile.",
    ),
    _f(
        "vgpu_device_capability.heterogeneous_timeSlice_sizes",
        STR,
        since=590,
        help="vGPU device capability: heterogeneous_timeSlice_sizes.",
    ),
    _f(
        "vgpu_device_capability.homogeneous_placements",
        STR,
        since=590,
        help="vGPU device capability: homogeneous_placements.",
    ),
    _f("vgpu_device_capability.mig_timeSlicing", STR, since=590, help="vGPU device capability: mig_timeSlicing."),
    _f(
        "vgpu_device_capability.mig_timeSlicing_mode",
        STR,
        since=590,
        help="vGPU device capability: mig_timeSlicing_mode.",
    ),
    _f("pcie.link.gen.gpucurrent", INT, since=590, help="Current PCIe link generation of the GPU."),
    _f("pcie.link.gen.gpumax", INT, since=590, help="Maximum PCIe link generation the GPU supports."),
    _f("pcie.link.gen.hostmax", INT, since=590, help="Maximum PCIe link generation the host supports."),
    _f("display_attached", YES_NO, since=590, help="Whether a display is physically attached."),
    _f("addressing_mode", STR, since=590, help="Addressing mode (HMM, ATS or None)."),
    _f("inforom.checksum_validation", STR, since=590, help="InfoROM checksum validation result (valid/invalid)."),
    _f(
        "gpu_recovery_action",
        STR,
        since=590,
        help="Action the driver asks for to recover the GPU (None, Reset, Reboot, Drain P2P, Drain and Reset).",
    ),
    _f(
        "clocks_event_reasons.supported",
        BITMASK,
        aliases=("clocks_throttle_reasons.supported",),
        help="Bitmask of the clock event reasons this GPU can report.",
    ),
    _f(
        "clocks_event_reasons.active",
        BITMASK,
        aliases=("clocks_throttle_reasons.active",),
        help="Bitmask of the clock event reasons active now.",
    ),
    _f(
        "clocks_event_reasons.gpu_idle",
        ACTIVE,
        aliases=("clocks_throttle_reasons.gpu_idle",),
        help="Whether clocks are held down now by: gpu idle.",
    ),
    _f(
        "clocks_event_reasons.applications_clocks_setting",
        ACTIVE,
        aliases=("clocks_throttle_reasons.applications_clocks_setting",),
        help="Whether clocks are held down now by: applications clocks setting.",
    ),
    _f(
        "clocks_event_reasons.sw_power_cap",
        ACTIVE,
        aliases=("clocks_throttle_reasons.sw_power_cap",),
        help="Whether clocks are held down now by: sw power cap.",
    ),
    _f(
        "clocks_event_reasons.hw_slowdown",
        ACTIVE,
        aliases=("clocks_throttle_reasons.hw_slowdown",),
        help="Whether clocks are held down now by: hw slowdown.",
    ),
    _f(
        "clocks_event_reasons.hw_thermal_slowdown",
        ACTIVE,
        aliases=("clocks_throttle_reasons.hw_thermal_slowdown",),
        help="Whether clocks are held down now by: hw thermal slowdown.",
    ),
    _f(
        "clocks_event_reasons.hw_power_brake_slowdown",
        ACTIVE,
        aliases=("clocks_throttle_reasons.hw_power_brake_slowdown",),
        help="Whether clocks are held down now by: hw power brake slowdown.",
    ),
    _f(
        "clocks_event_reasons.sw_thermal_slowdown",
        ACTIVE,
        aliases=("clocks_throttle_reasons.sw_thermal_slowdown",),
        help="Whether clocks are held down now by: sw thermal slowdown.",
    ),
    _f(
        "clocks_event_reasons.sync_boost",
        ACTIVE,
        aliases=("clocks_throttle_reasons.sync_boost",),
        help="Whether clocks are held down now by: sync boost.",
    ),
    _f(
        "clocks_event_reasons_counters.sw_power_cap",
        INT,
        unit="us",
        since=590,
        help="Total time clocks were held down by sw power cap, in microseconds.",
    ),
    _f(
        "clocks_event_reasons_counters.sync_boost",
        INT,
        unit="us",
        since=590,
        help="Total time clocks were held down by sync boost, in microseconds.",
    ),
    _f(
        "clocks_event_reasons_counters.sw_thermal_slowdown",
        INT,
        unit="us",
        since=590,
        help="Total time clocks were held down by sw thermal slowdown, in microseconds.",
    ),
    _f(
        "clocks_event_reasons_counters.hw_thermal_slowdown",
        INT,
        unit="us",
        since=590,
        help="Total time clocks were held down by hw thermal slowdown, in microseconds.",
    ),
    _f(
        "clocks_event_reasons_counters.hw_power_brake_slowdown",
        INT,
        unit="us",
        since=590,
        help="Total time clocks were held down by hw power brake slowdown, in microseconds.",
    ),
    _f("memory.reserved", INT, unit="MiB", since=590, help="GPU memory reserved by the system."),
    _f("compute_cap", MAJOR_MINOR, since=590, help="CUDA compute capability as major.minor."),
    _f("utilization.encoder", INT, unit="%", since=590, help="Video encoder utilization."),
    _f("utilization.decoder", INT, unit="%", since=590, help="Video decoder utilization."),
    _f("utilization.jpeg", INT, unit="%", since=590, help="JPEG decoder utilization."),
    _f("utilization.ofa", INT, unit="%", since=590, help="Optical flow accelerator utilization."),
    _f("dramEncryption.mode.current", ENABLED, since=590, help="Whether DRAM encryption is enabled."),
    _f("dramEncryption.mode.pending", ENABLED, since=590, help="DRAM encryption after the next reboot."),
    _f(
        "ecc.errors.uncorrected.volatile.sram.parity",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM (parity) since the driver loaded.",
    ),
    _f(
        "ecc.errors.uncorrected.volatile.sram.secded",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM (SEC-DED) since the driver loaded.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.parity",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM (parity) over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.secded",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM (SEC-DED) over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.thresholdExceeded",
        YES_NO,
        since=590,
        help="Whether uncorrected SRAM errors passed the threshold that asks for a GPU replacement.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.l2",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM in L2 over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.sm",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM in the SMs over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.mcu",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM in the MCU over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.pcie",
        INT,
        since=590,
        help="Uncorrected ECC errors in SRAM in PCIe over the GPU lifetime.",
    ),
    _f(
        "ecc.errors.uncorrected.aggregate.sram.other",
        INT,
        since=590,
        help="Uncorrected ECC errors in other SRAM over the GPU lifetime.",
    ),
    _f(
        "remapped_rows.correctable",
        INT,
        aliases=("remapped_rows.sbe",),
        since=590,
        help="Rows remapped for correctable errors.",
    ),
    _f(
        "remapped_rows.uncorrectable",
        INT,
        aliases=("remapped_rows.dbe",),
        since=590,
        help="Rows remapped for uncorrectable errors.",
    ),
    _f("remapped_rows.pending", YES_NO, since=590, help="Whether a remapping waits for a GPU reset."),
    _f("remapped_rows.failure", YES_NO, since=590, help="Whether a row remapping failed."),
    _f(
        "remapped_rows.histogram.max",
        INT,
        since=590,
        help="Remapping availability histogram: banks with max availability.",
    ),
    _f(
        "remapped_rows.histogram.high",
        INT,
        since=590,
        help="Remapping availability histogram: banks with high availability.",
    ),
    _f(
        "remapped_rows.histogram.partial",
        INT,
        since=590,
        help="Remapping availability histogram: banks with partial availability.",
    ),
    _f(
        "remapped_rows.histogram.low",
        INT,
        since=590,
        help="Remapping availability histogram: banks with low availability.",
    ),
    _f(
        "remapped_rows.histogram.none",
        INT,
        since=590,
        help="Remapping availability histogram: banks with none availability.",
    ),
    _f(
        "temperature.gpu.tlimit",
        INT,
        unit="C",
        header_unit="",
        since=590,
        help="Degrees Celsius left before the GPU slows down for temperature.",
    ),
    _f(
        "power.draw.average",
        FLOAT,
        unit="W",
        aliases=("gpu.power.draw.average",),
        since=590,
        help="Power drawn, averaged over one second.",
    ),
    _f(
        "power.draw.instant",
        FLOAT,
        unit="W",
        aliases=("gpu.power.draw.instant",),
        since=590,
        help="Instantaneous power drawn.",
    ),
    _f(
        "module.power.draw.average",
        FLOAT,
        unit="W",
        since=590,
        help="Power drawn by the whole module, one-second average.",
    ),
    _f("module.power.draw.instant", FLOAT, unit="W", since=590, help="Instantaneous power drawn by the whole module."),
    _f(
        "module.power.limit",
        FLOAT,
        unit="W",
        aliases=("module.power.requested_limit",),
        since=590,
        help="Requested module power limit.",
    ),
    _f(
        "module.enforced.power.limit",
        FLOAT,
        unit="W",
        aliases=("module.power.current_limit",),
        since=590,
        help="Enforced module power limit.",
    ),
    _f("module.power.default_limit", FLOAT, unit="W", since=590, help="Default module power limit."),
    _f("module.power.min_limit", FLOAT, unit="W", since=590, help="Lowest module power limit."),
    _f("module.power.max_limit", FLOAT, unit="W", since=590, help="Highest module power limit."),
    _f(
        "power_smoothing.delayed_power_smoothing_supported",
        YES_NO,
        since=590,
        help="Power smoothing: delayed power smoothing supported.",
    ),
    _f("power_smoothing.primary_power_floor", FLOAT, unit="W", since=590, help="Power smoothing: primary power floor."),
    _f(
        "power_smoothing.secondary_power_floor",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: secondary power floor.",
    ),
    _f(
        "power_smoothing.min_primary_floor_activation_offset",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: min primary floor activation offset.",
    ),
    _f(
        "power_smoothing.min_primary_floor_activation_point",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: min primary floor activation point.",
    ),
    _f("power_smoothing.window_multiplier", FLOAT, unit="ms", since=590, help="Power smoothing: window multiplier."),
    _f(
        "power_smoothing.curr_profile.secondary_power_floor",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: curr profile secondary power floor.",
    ),
    _f(
        "power_smoothing.curr_profile.primary_floor_act_window_multiplier",
        FLOAT,
        since=590,
        help="Power smoothing: curr profile primary floor act window multiplier.",
    ),
    _f(
        "power_smoothing.curr_profile.primary_floor_tar_window_multiplier",
        FLOAT,
        since=590,
        help="Power smoothing: curr profile primary floor tar window multiplier.",
    ),
    _f(
        "power_smoothing.curr_profile.primary_floor_act_offset",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: curr profile primary floor act offset.",
    ),
    _f(
        "power_smoothing.admin_override.secondary_power_floor",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: admin override secondary power floor.",
    ),
    _f(
        "power_smoothing.admin_override.primary_floor_act_window_multiplier",
        FLOAT,
        since=590,
        help="Power smoothing: admin override primary floor act window multiplier.",
    ),
    _f(
        "power_smoothing.admin_override.primary_floor_tar_window_multiplier",
        FLOAT,
        since=590,
        help="Power smoothing: admin override primary floor tar window multiplier.",
    ),
    _f(
        "power_smoothing.admin_override.primary_floor_act_offset",
        FLOAT,
        unit="W",
        since=590,
        help="Power smoothing: admin override primary floor act offset.",
    ),
    _f("edpp_multiplier", FLOAT, unit="%", since=590, help="EDPp multiplier in percent."),
    _f("gsp.mode.current", ENABLED, since=590, help="Whether GSP firmware is in use."),
    _f("gsp.mode.default", ENABLED, since=590, help="Default GSP firmware mode."),
    _f("c2c.mode", ENABLED, since=590, help="Whether the chip-to-chip link is enabled."),
    _f("protected_memory.total", INT, unit="MiB", since=590, help="Total protected (confidential computing) memory."),
    _f("protected_memory.used", INT, unit="MiB", since=590, help="Used protected memory."),
    _f("protected_memory.free", INT, unit="MiB", since=590, help="Free protected memory."),
    _f("fabric.state", STR, since=590, help="NVLink fabric registration state."),
    _f("fabric.status", STR, since=590, help="NVLink fabric registration status."),
    _f("fabric.cliqueId", INT, since=590, help="NVLink fabric clique id."),
    _f("fabric.clusterUuid", STR, since=590, help="NVLink fabric cluster UUID."),
    _f("fabric.health.summary", STR, since=590, help="NVLink fabric health: summary."),
    _f("fabric.health.bandwidth", STR, since=590, help="NVLink fabric health: bandwidth."),
    _f(
        "fabric.health.route_recovery_in_progress",
        STR,
        since=590,
        help="NVLink fabric health: route recovery in progress.",
    ),
    _f("fabric.health.route_unhealthy", STR, since=590, help="NVLink fabric health: route unhealthy."),
    _f("fabric.health.access_timeout_recovery", STR, since=590, help="NVLink fabric health: access timeout recovery."),
    _f("fabric.health.incorrect_configuration", STR, since=590, help="NVLink fabric health: incorrect configuration."),
    _f("platform.chassis_serial_number", STR, since=590, help="Chassis serial number."),
    _f("platform.slot_number", INT, since=590, help="Chassis slot number."),
    _f("platform.tray_index", INT, since=590, help="Compute tray index."),
    _f("platform.host_id", INT, since=590, help="Host id within the chassis."),
    _f("platform.peer_type", STR, since=590, help="Peer connection type."),
    _f("platform.module_id", INT, since=590, help="Module id."),
    _f("platform.gpu_fabric_guid", HEX, since=590, help="GPU fabric GUID (hex)."),
    _f("hostname", STR, since=590, help="Host name reported by the driver."),
    _f("kmd_version", VERSION, since=595, help="Kernel-mode driver version."),
    _f("remapped_rows.correctable_inactive", INT, since=595, help="Inactive rows remapped for correctable errors."),
    _f("remapped_rows.uncorrectable_inactive", INT, since=595, help="Inactive rows remapped for uncorrectable errors."),
    _f("fabric.health.partition_assigned", STR, since=595, help="NVLink fabric health: partition assigned."),
    _f("gpu.base.current", FLOAT, unit="W", since=610, help="Current base power."),
    _f("gpu.base.requested", FLOAT, unit="W", since=610, help="Requested base power."),
    _f("gpu.base.default", FLOAT, unit="W", since=610, help="Default base power."),
    _f("gpu.base.min", FLOAT, unit="W", since=610, help="Minimum base power."),
    _f("gpu.base.max", FLOAT, unit="W", since=610, help="Maximum base power."),
    _f("power_smoothing.tmp_floor", FLOAT, unit="W", since=610, help="Power smoothing: tmp floor."),
    _f("power_smoothing.tmp_ceil", FLOAT, unit="W", since=610, help="Power smoothing: tmp ceil."),
    _f(
        "power_smoothing.hw_lifetime_remaining_percent",
        FLOAT,
        unit="%",
        since=610,
        help="Power smoothing: hw lifetime remaining percent.",
    ),
    _f("power_smoothing.enabled", YES_NO, since=610, help="Power smoothing: enabled."),
    _f(
        "power_smoothing.soc_power_smoothing_enabled",
        ENABLED,
        since=610,
        help="Power smoothing: soc power smoothing enabled.",
    ),
    _f("power_smoothing.priv_level", FLOAT, since=610, help="Power smoothing: priv level."),
    _f("power_smoothing.imm_ramp_down", ENABLED, since=610, help="Power smoothing: imm ramp down."),
    _f(
        "power_smoothing.max_percent_tmp_floor",
        FLOAT,
        unit="%",
        since=610,
        help="Power smoothing: max percent tmp floor.",
    ),
    _f(
        "power_smoothing.min_percent_tmp_floor",
        FLOAT,
        unit="%",
        since=610,
        help="Power smoothing: min percent tmp floor.",
    ),
    _f("power_smoothing.num_preset_profiles", FLOAT, since=610, help="Power smoothing: num preset profiles."),
    _f(
        "power_smoothing.curr_profile.percent_tmp_floor",
        FLOAT,
        unit="%",
        since=610,
        help="Power smoothing: curr profile percent tmp floor.",
    ),
    _f(
        "power_smoothing.curr_profile.ramp_up_rate",
        FLOAT,
        unit="W/s",
        since=610,
        help="Power smoothing: curr profile ramp up rate.",
    ),
    _f(
        "power_smoothing.curr_profile.ramp_down_rate",
        FLOAT,
        unit="W/s",
        since=610,
        help="Power smoothing: curr profile ramp down rate.",
    ),
    _f(
        "power_smoothing.curr_profile.ramp_down_hysteresis",
        FLOAT,
        unit="ms",
        since=610,
        help="Power smoothing: curr profile ramp down hysteresis.",
    ),
    _f("power_smoothing.active_profile", FLOAT, since=610, help="Power smoothing: active profile."),
    _f(
        "power_smoothing.admin_override.percent_tmp_floor",
        FLOAT,
        unit="%",
        since=610,
        help="Power smoothing: admin override percent tmp floor.",
    ),
    _f(
        "power_smoothing.admin_override.ramp_up_rate",
        FLOAT,
        unit="W/s",
        since=610,
        help="Power smoothing: admin override ramp up rate.",
    ),
    _f(
        "power_smoothing.admin_override.ramp_down_rate",
        FLOAT,
        unit="W/s",
        since=610,
        help="Power smoothing: admin override ramp down rate.",
    ),
    _f(
        "power_smoothing.admin_override.ramp_down_hysteresis",
        FLOAT,
        unit="ms",
        since=610,
        help="Power smoothing: admin override ramp down hysteresis.",
    ),
    _f(
        "bbx.time_run",
        INT,
        unit="seconds",
        since=610,
        help="Total time the GPU has run, in seconds (black-box recorder).",
    ),
)

_BY_NAME: dict[str, Field] = {}
for _fld in CATALOGUE:
    _BY_NAME[_fld.name] = _fld
    for _alias in _fld.aliases:
        _BY_NAME[_alias] = _fld
# Before the 535 branch the throttle reasons were canonical under their old name.
for _fld in CATALOGUE:
    if _fld.name.startswith("clocks_event_reasons."):
        _BY_NAME.setdefault(_fld.name.replace("clocks_event_reasons.", "clocks_throttle_reasons.", 1), _fld)
del _fld, _alias

_IDENTITY = ("timestamp", "index", "uuid")

PRESETS: dict[str, tuple[str, ...]] = {
    "default": (
        "timestamp",
        "index",
        "name",
        "uuid",
        "temperature.gpu",
        "utilization.gpu",
        "utilization.memory",
        "memory.used",
        "memory.total",
        "power.draw",
    ),
    "health": (
        *_IDENTITY,
        "name",
        "pci.bus_id",
        "temperature.gpu",
        "utilization.gpu",
        "utilization.memory",
        "memory.used",
        "memory.total",
        "power.draw",
        "power.limit",
        "fan.speed",
        "pstate",
        "clocks.current.sm",
        "clocks_event_reasons.active",
        "clocks_event_reasons.hw_thermal_slowdown",
        "clocks_event_reasons.sw_thermal_slowdown",
        "clocks_event_reasons.hw_power_brake_slowdown",
        "ecc.errors.corrected.volatile.total",
        "ecc.errors.uncorrected.volatile.total",
        "retired_pages.pending",
    ),
    "memory": (*_IDENTITY, "memory.total", "memory.used", "memory.free", "utilization.memory"),
    "power": (
        *_IDENTITY,
        "power.draw",
        "power.limit",
        "enforced.power.limit",
        "power.default_limit",
        "power.min_limit",
        "power.max_limit",
        "pstate",
    ),
    "clocks": (
        *_IDENTITY,
        "clocks.current.graphics",
        "clocks.current.sm",
        "clocks.current.memory",
        "clocks.current.video",
        "clocks.max.graphics",
        "clocks.max.sm",
        "clocks.max.memory",
    ),
    "throttle": (
        *_IDENTITY,
        "clocks_event_reasons.active",
        "clocks_event_reasons.gpu_idle",
        "clocks_event_reasons.applications_clocks_setting",
        "clocks_event_reasons.sw_power_cap",
        "clocks_event_reasons.hw_slowdown",
        "clocks_event_reasons.hw_thermal_slowdown",
        "clocks_event_reasons.hw_power_brake_slowdown",
        "clocks_event_reasons.sw_thermal_slowdown",
        "clocks_event_reasons.sync_boost",
    ),
    "all": tuple(f.name for f in CATALOGUE),
}


def get_field(name: str, *, known: Iterable[str] | None = None) -> Field:
    """Look a field up by canonical name or alias.

    Args:
        name: a name nvidia-smi accepts (``"memory.used"``, ``"gpu_name"``, ``"clocks.gr"``).
        known: extra names discovered from this machine's ``--help-query-gpu`` (unknown kinds parse as strings).

    Returns:
        The catalogue entry.

    Raises:
        InvalidFieldError: the name is not a field; the message names the closest valid ones.
    """
    fld = _BY_NAME.get(name)
    if fld is not None:
        return fld
    if known is not None and name in set(known):
        return Field(name, STR, help="Listed by this driver's --help-query-gpu; not in smiquery's catalogue.")
    raise InvalidFieldError(name, difflib.get_close_matches(name, list(_BY_NAME), n=3, cutoff=0.6))


def resolve_fields(
    fields: str | Sequence[str] | None = "default", *, known: Iterable[str] | None = None
) -> tuple[Field, ...]:
    """Turn a preset name, a comma list or a sequence of names into catalogue fields.

    Duplicates are dropped (nvidia-smi would print them twice). Validation happens here, before anything runs.

    Args:
        fields: a preset (``"default"``, ``"health"``...), ``"a,b,c"``, or a sequence of names; None means default.
        known: names this machine's driver lists; also limits ``"all"`` to them.

    Returns:
        The fields in the order asked for.

    Raises:
        InvalidFieldError: a name is unknown or malformed.
    """
    if fields is None:
        fields = "default"
    if isinstance(fields, str):
        if fields in PRESETS:
            names: Sequence[str] = PRESETS[fields]
            if fields == "all" and known is not None:
                allowed = {_BY_NAME[n].name if n in _BY_NAME else n for n in known}
                names = [n for n in names if n in allowed]
        else:
            names = [n.strip() for n in fields.split(",") if n.strip()]
    else:
        names = list(fields)
    if not names:
        raise InvalidFieldError("", [], detail="no field was given")
    out: dict[str, Field] = {}
    for n in names:
        if not isinstance(n, str) or not _NAME_RE.fullmatch(n):
            raise InvalidFieldError(str(n), [], detail="field names are letters, digits, '.' and '_' only")
        fld = get_field(n, known=known)
        out.setdefault(fld.name, fld)
    return tuple(out.values())


_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.]*")


@dataclass(frozen=True)
class HelpEntry:
    """One property listed by ``nvidia-smi --help-query-gpu``: its names and NVIDIA's description."""

    name: str
    aliases: tuple[str, ...]
    description: str


_HELP_NAME_RE = re.compile(r'"([^"]+)"')


def parse_help_query_gpu(text: str) -> list[HelpEntry]:
    """Read the output of ``nvidia-smi --help-query-gpu``.

    A property entry is a line that starts with a double quote right after a blank line
    (``"name" or "alias"``); the lines below it, up to the next blank line, describe it. Section headings and
    prose in between are skipped. Works for the ``--query-gpu=`` (465-era) and ``--query-gpu`` (590+) titles.

    Args:
        text: the help output.

    Returns:
        The entries in printed order.
    """
    lines = text.replace("\r", "").split("\n")
    entries: list[HelpEntry] = []
    for i, line in enumerate(lines):
        if not line.startswith('"') or (i > 0 and lines[i - 1].strip()):
            continue
        names = _HELP_NAME_RE.findall(line)
        if not names:
            continue
        desc: list[str] = []
        for follow in lines[i + 1 :]:
            if not follow.strip():
                break
            desc.append(follow.strip())
        entries.append(HelpEntry(names[0], tuple(names[1:]), " ".join(desc)))
    return entries
