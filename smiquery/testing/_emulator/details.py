"""``nvidia-smi -q -x`` and ``-L`` in the fake, from ``SMIQUERY_FAKE_XML`` or an XML made from the recording.

The capture is printed as it is, less the GPUs ``-i`` leaves out; without one a small XML is made from the
recording's current sweep. ``-L`` lists its GPUs and their MIG devices (UUIDs made from the parent's, profiles
from SM count and memory the A100 way). Faults: the start-up ones, ``exit:``, ``hang`` and ``start-delay`` as in
the CSV modes; ``truncated`` prints the first half of the XML, ``garbage`` random bytes instead (exit 0 both).
"""

from __future__ import annotations

import hashlib
import pathlib
import random
import re
from collections.abc import Sequence
from typing import NoReturn
from xml.sax.saxutils import escape

from smiquery.sample import bus_key
from smiquery.testing._emulator.core import ArgReader, FakeUsageError, Output, Settings
from smiquery.testing._emulator.faults import Faults, startup
from smiquery.testing._emulator.recording import Recording, load_apps, load_recording

__all__ = ["run_details"]

_GPU_RE = re.compile(r"[ \t]*<gpu id=\"[^\"]*\">.*?</gpu>[ \t]*\n?", re.DOTALL)
_TAG = r"<{0}>\s*([^<]*?)\s*</{0}>"
_SM_PER_SLICE = 14  # A100: 7 slices of 14 SMs (H100: 16; the fake names profiles the A100 way)


def _tag(block: str, name: str) -> str:
    m = re.search(_TAG.format(name), block)
    return m.group(1) if m else ""


def _selected(blocks: Sequence[str], ids: str | None) -> list[int] | None:
    """Positions of the GPUs ``-i`` names (all without ``-i``); None when one id matches no GPU."""
    if not ids:
        return list(range(len(blocks)))

    def names(wanted: str, pos: int, block: str) -> bool:
        gpu_id = re.search(r'id="([^"]*)"', block)
        bus = _tag(block, "pci_bus_id") or (gpu_id.group(1) if gpu_id else "")
        return (
            wanted == str(pos)
            or wanted.lower() == _tag(block, "uuid").lower()
            or (":" in wanted and bool(bus) and bus_key(wanted) == bus_key(bus))
        )

    chosen: list[int] = []
    for wanted in (raw.strip() for raw in ids.split(",")):
        hits = [pos for pos, block in enumerate(blocks) if names(wanted, pos, block)]
        if not hits:
            return None
        if hits[-1] not in chosen:
            chosen.append(hits[-1])
    return chosen


def _synthesized(rec: Recording, settings: Settings) -> str:
    """A small -q -x document for the recording's current sweep (the fields a recording can carry)."""
    rows = rec.sweep(settings.sweep % len(rec.sweeps))
    apps = load_apps(settings.apps, rec)
    out = [
        '<?xml version="1.0" ?>',
        '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">',
        "<nvidia_smi_log>",
        f"\t<driver_version>{escape(rec.driver_version)}</driver_version>",
        f"\t<attached_gpus>{len(rows)}</attached_gpus>",
    ]
    for pos, row in enumerate(rows):
        ident = rec.gpus[pos] if pos < len(rec.gpus) else rec.gpus[-1]

        def cell(name: str, row: Sequence[str] = row) -> str:
            value = rec.cell(row, name)
            return "N/A" if value is None or value.startswith("[") else value

        out.append(f'\t<gpu id="{escape(ident["pci.bus_id"])}">')
        out.append(f"\t\t<product_name>{escape(ident['name'])}</product_name>")
        mig = cell("mig.mode.current")
        out.append(f"\t\t<mig_mode>\n\t\t\t<current_mig>{mig}</current_mig>\n\t\t</mig_mode>")
        out.append(f"\t\t<uuid>{escape(ident['uuid'])}</uuid>")
        # the device's /dev/nvidia<minor>: real drivers number them in probe order, as the recording's GPUs are
        out.append(f"\t\t<minor_number>{pos}</minor_number>")
        out.append(f"\t\t<pci>\n\t\t\t<pci_bus_id>{escape(ident['pci.bus_id'])}</pci_bus_id>\n\t\t</pci>")
        out.append("\t\t<fb_memory_usage>")
        for part in ("total", "used", "free"):
            value = cell(f"memory.{part}")
            out.append(f"\t\t\t<{part}>{value}{' MiB' if value != 'N/A' else ''}</{part}>")
        out.append("\t\t</fb_memory_usage>")
        out.append("\t\t<clocks_event_reasons>")
        for fld in rec.columns:
            short = fld.name.removeprefix("clocks_event_reasons.")
            if short != fld.name and short not in ("active", "supported"):
                out.append(f"\t\t\t<clocks_event_reason_{short}>{cell(fld.name)}</clocks_event_reason_{short}>")
        out.append("\t\t</clocks_event_reasons>")
        out.append("\t\t<processes>")
        for app in apps:
            if app.get("gpu_uuid", "").lower() == ident["uuid"].lower():
                out.append(
                    "\t\t\t<process_info>\n\t\t\t\t<gpu_instance_id>N/A</gpu_instance_id>\n"
                    "\t\t\t\t<compute_instance_id>N/A</compute_instance_id>\n"
                    f"\t\t\t\t<pid>{escape(app.get('pid', '0'))}</pid>\n\t\t\t\t<type>C</type>\n"
                    f"\t\t\t\t<process_name>{escape(app.get('process_name', ''))}</process_name>\n"
                    f"\t\t\t\t<used_memory>{escape(app.get('used_gpu_memory', 'N/A'))} MiB</used_memory>\n"
                    "\t\t\t</process_info>"
                )
        out.append("\t\t</processes>")
        out.append("\t</gpu>")
    out.append("</nvidia_smi_log>")
    return "\n".join(out) + "\n"


def _listing(blocks: Sequence[str], chosen: Sequence[int], out: Output) -> None:
    for pos in chosen:
        uuid = _tag(blocks[pos], "uuid")
        out.line(f"GPU {pos}: {_tag(blocks[pos], 'product_name')} (UUID: {uuid})")
        for dev in re.findall(r"<mig_device>.*?</mig_device>", blocks[pos], re.DOTALL):
            fb = re.search(r"<fb_memory_usage>(.*?)</fb_memory_usage>", dev, re.DOTALL)
            mib = int(_tag(fb.group(1), "total").removesuffix(" MiB") or 0) if fb else 0
            sms = int(_tag(dev, "multiprocessor_count") or 0)
            profile = f"{max(1, sms // _SM_PER_SLICE)}g.{round(mib / 1024 / 5) * 5 or 5}gb"
            instance = f"{uuid}/{_tag(dev, 'gpu_instance_id')}/{_tag(dev, 'compute_instance_id')}"
            h = hashlib.sha256(instance.encode()).hexdigest()
            mig = f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            out.line(f"  MIG {profile:<12s}Device {_tag(dev, 'index'):>2s}: (UUID: {mig})")


def _parse(argv: Sequence[str]) -> tuple[set[str], str | None]:
    def fail(message: str) -> NoReturn:
        raise FakeUsageError(f"the -q -x / -L emulation: {message}")

    flags = {"-q": "q", "--query": "q", "-x": "x", "--xml-format": "x", "-L": "L", "--list-gpus": "L"}
    found: set[str] = set()
    ids: str | None = None
    args = ArgReader(argv, fail)
    for arg, name, inline in args:
        if name in ("-i", "--id"):
            ids = args.value(name, inline)
        elif arg in flags:
            found.add(flags[arg])
        else:
            fail(f"option {arg!r} is not emulated")
    if "q" in found and "x" not in found:
        fail("only `-q -x` is emulated, not the text form of -q")
    return found, ids


def run_details(argv: Sequence[str], settings: Settings, faults: Faults, out: Output) -> int:
    """Answer ``-q -x [-i IDS]`` or (with an XML set) ``-L``; returns the exit status."""
    flags, ids = _parse(argv)
    rec = load_recording(settings.recording)
    startup(faults, rec, out)
    if settings.xml:
        try:
            text = pathlib.Path(settings.xml).read_text(encoding="utf-8")
        except OSError as exc:
            raise FakeUsageError(f"cannot read SMIQUERY_FAKE_XML {settings.xml}: {exc}") from exc
    else:
        text = _synthesized(rec, settings)
    blocks = _GPU_RE.findall(text)
    chosen = _selected(blocks, ids)
    if chosen is None or not blocks:
        out.line("No devices were found")
        return 6
    if "L" in flags:
        _listing(blocks, chosen, out)
        return 0
    if faults.garbage:
        rng = random.Random(len(text))
        out.raw(bytes(rng.randrange(256) for _ in range(512)) + b"\n")
        return 0
    first = _GPU_RE.search(text)
    head = text[: first.start()] if first else text
    tail = text[text.rfind("</gpu>") + len("</gpu>") :].lstrip(" \t").removeprefix("\n") if first else ""
    doc = head + "".join(blocks[i] for i in chosen) + tail
    if faults.truncated:
        doc = doc[: len(doc) // 2]
    out.raw(doc.encode("utf-8"))
    return 0
