"""`nvidia-smi -q -x` typed: every corpus XML, the MIG capture, the DTD versions, and details() over the fake."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

import smiquery
from smiquery.errors import DriverNotLoadedError, NoDevicesFoundError, NvidiaSmiTimeoutError, ParseError
from smiquery.sources import details as details_module
from smiquery.sources.details import GpuDetails, details, parse_list, parse_xml
from smiquery.testing import InProcessRunner
from tests.corpus import require_corpus

FIXTURE = Path(__file__).parents[1] / "fixtures" / "details-2gpu-mig.xml"
_UUID = re.compile(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}")


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    details_module._warn_once.cache_clear()


def _corpus_xml() -> list[Path]:
    return sorted((require_corpus() / "xml").glob("*.xml"))


def _parse_quietly(path: Path) -> list[GpuDetails]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the two captures that name no DTD (driver 418)
        return parse_xml(path.read_bytes())


def test_every_corpus_xml_parses_with_name_uuid_and_memory():
    files = _corpus_xml()
    assert len(files) >= 27
    for path in files:
        gpus = _parse_quietly(path)
        assert gpus, path.name
        for gpu in gpus:
            assert gpu.name, path.name
            assert _UUID.fullmatch(gpu.uuid or ""), (path.name, gpu.uuid)
            assert isinstance(gpu.memory_total, int) and gpu.memory_total > 0, path.name
            assert isinstance(gpu.memory_used, int) and isinstance(gpu.memory_free, int), path.name
            assert gpu.memory_used + gpu.memory_free <= gpu.memory_total, path.name
            assert gpu.pci_bus_id and re.fullmatch(
                r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d", gpu.pci_bus_id
            )
            for attr in ("clock_event_reasons", "remapped_rows", "processes", "mig_mode"):
                # None only ever with a reason
                assert getattr(gpu, attr) is not None or attr in gpu.missing, (path.name, attr)


def test_a_section_the_file_has_is_never_reported_absent():
    # the telegraf failure mode: an element renamed between versions read as "missing" forever
    sections = {
        "clock_event_reasons": ("<clocks_throttle_reasons>", "<clocks_event_reasons>"),
        "remapped_rows": ("<remapped_rows>",),
        "mig_mode": ("<current_mig>",),
        "processes": ("<processes>",),
        "retired_pages": ("<retired_pages>",),
    }
    for path in _corpus_xml():
        text = path.read_text()
        for gpu in _parse_quietly(path):
            for attr, tags in sections.items():
                if any(t in text for t in tags):
                    reason = gpu.missing.get(attr, "")
                    assert not reason.startswith(("absent", "not in DTD")), (path.name, attr, reason)


def test_corpus_dtd_versions_are_read_by_their_own_layout():
    seen = {}
    for path in _corpus_xml():
        for gpu in _parse_quietly(path):
            seen.setdefault(gpu.dtd_version, path.name)
    assert {7, 10, 11, 12, 13} <= set(seen)
    v7 = _parse_quietly(require_corpus() / "xml" / "rai-project__grid-k520-example2-with-dtd.xml")[0]
    assert v7.remapped_rows is None and v7.missing["remapped_rows"] == "not in DTD v7"
    assert v7.mig_mode is None and v7.missing["mig_mode"] == "not in DTD v7"
    assert v7.clock_event_reasons == ("gpu_idle",)  # read from the old clocks_throttle_reasons name


def test_renamed_clock_reasons_are_read_on_both_sides_of_the_rename():
    old = _parse_quietly(require_corpus() / "xml" / "netdata__rtx-2080-win.xml")[0]  # v11: clocks_throttle_*
    new = _parse_quietly(require_corpus() / "xml" / "telegraf__3090-v13.xml")[0]  # v13: clocks_event_*
    assert old.clock_event_reasons == ("gpu_idle",)
    assert new.clock_event_reasons == ("sw_power_cap",)


def test_the_a100_mig_capture_yields_its_instances_with_memory():
    gpu = parse_xml((require_corpus() / "xml" / "netdata__a100-sxm4-mig.xml").read_text())[0]
    assert gpu.mig_mode == "Enabled"
    assert [(d.index, d.gpu_instance_id, d.compute_instance_id) for d in gpu.mig_devices] == [(0, 1, 0), (1, 2, 0)]
    assert [(d.memory_total, d.memory_used, d.memory_free, d.sm_count) for d in gpu.mig_devices] == [
        (19968, 19, 19948, 42)
    ] * 2
    assert gpu.mig_devices[0].uuid is None and gpu.mig_devices[0].missing["uuid"] == "no nvidia-smi -L listing"


def test_fixture_health_values():
    a, b = parse_xml(FIXTURE.read_text())
    assert a.clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert a.remapped_rows is not None
    assert (a.remapped_rows.correctable, a.remapped_rows.uncorrectable, a.remapped_rows.pending) == (2, 1, True)
    assert a.retired_pages is not None and a.retired_pages.double_bit is None
    assert a.retired_pages.missing["double_bit"] == "not_available"
    (proc,) = a.processes or ()
    assert (proc.pid, proc.type, proc.name, proc.used_memory, proc.gpu_instance_id) == (
        4242, "C", "python train.py", 1150, 2,
    )  # fmt: skip
    assert a.inforom == {"img_version": "G506.0210.00.03", "oem_object": "2.0", "ecc_object": "6.16"}
    assert a.bridge_chip_type is None and a.missing["bridge_chip_type"] == "not_available"
    # N/A is None with its reason, never 0
    assert b.memory_used is None and b.missing["memory_used"] == "not_available"
    assert b.remapped_rows is None and b.missing["remapped_rows"] == "not_available"
    assert b.retired_pages is not None and (b.retired_pages.double_bit, b.retired_pages.pending) == (1, True)
    assert b.mig_mode == "Disabled" and b.mig_devices == ()
    assert b.processes == ()


def test_a_missing_element_is_none_with_a_reason():
    text = FIXTURE.read_text().replace("<used>1213 MiB</used>", "", 1)
    gpu = parse_xml(text)[0]
    assert gpu.memory_used is None
    assert gpu.missing["memory_used"] == "absent: no <fb_memory_usage/used> in this output (DTD v12)"
    assert gpu.memory_total == 81920


def test_an_unknown_dtd_warns_once_and_still_reads_by_name():
    text = FIXTURE.read_text().replace("nvsmi_device_v12.dtd", "nvsmi_device_v99.dtd")
    with pytest.warns(UserWarning, match=r"nvsmi_device_v99\.dtd is not one smiquery knows"):
        gpus = parse_xml(text)
    assert gpus[0].dtd_version == 99 and gpus[0].clock_event_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_xml(text)  # the second time: no warning


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("<nvidia_smi_log><gpu>", "not well-formed"),
        ("<html></html>", "expected <nvidia_smi_log>"),
        (
            '<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!ENTITY a "aaaa">]><nvidia_smi_log>&a;</nvidia_smi_log>',
            "declares entities",
        ),
    ],
    ids=["truncated", "not-nvidia-smi", "entities"],
)
def test_bad_xml_is_a_parse_error(text, match):
    with pytest.raises(ParseError, match=match):
        parse_xml(text)


LAUGHS = '<!ENTITY l0 "ha">' + "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 6))
GPU_NAMED = '<nvidia_smi_log><driver_version>590.48.01</driver_version><gpu id="00000000:18:00.0">'
GPU_NAMED += "<product_name>&l5;</product_name></gpu></nvidia_smi_log>"


@pytest.mark.parametrize(
    "before",
    [
        "",
        "<!--<nvidia_smi_log-->",
        "<!-- a comment -->\n\n",
        "<?xml-stylesheet href='x'?>",
        "   \n\t",
    ],
    ids=["plain", "comment-naming-the-root", "comment", "processing-instruction", "whitespace"],
)
def test_no_entity_declaration_is_accepted_whatever_precedes_it(before):
    text = f'<?xml version="1.0"?>{before}<!DOCTYPE nvidia_smi_log [{LAUGHS}]>{GPU_NAMED}'
    with pytest.raises(ParseError, match="declares entities; refused"):
        parse_xml(text)


def test_a_named_dtd_and_an_inlined_one_without_entities_are_read():
    named = '<?xml version="1.0"?><!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd"><nvidia_smi_log/>'
    inlined = '<?xml version="1.0"?><!DOCTYPE nvidia_smi_log [<!-- nvsmi_device_v7.dtd -->'
    inlined += "<!ELEMENT nvidia_smi_log ANY>]><nvidia_smi_log/>"
    assert parse_xml(named) == [] and parse_xml(inlined) == []


def test_parse_list_reads_gpus_and_mig_devices():
    text = (
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-11111111-2222-3333-4444-555555555555)\n"
        "  MIG 3g.40gb     Device  0: (UUID: MIG-00000000-0000-0000-0000-000000000000)\n"
        "  MIG 1g.10gb     Device  1: (UUID: MIG-00000001-0000-0000-0000-000000000001)\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-66666666-7777-8888-9999-000000000000)\n"
    )
    assert parse_list(text) == {
        "GPU-11111111-2222-3333-4444-555555555555": [
            (0, "3g.40gb", "MIG-00000000-0000-0000-0000-000000000000"),
            (1, "1g.10gb", "MIG-00000001-0000-0000-0000-000000000001"),
        ],
        "GPU-66666666-7777-8888-9999-000000000000": [],
    }


def _fake(**env: str) -> InProcessRunner:
    return InProcessRunner(env={"SMIQUERY_FAKE_XML": str(FIXTURE), **env})


def test_details_joins_the_mig_uuids_and_profiles_from_dash_l():
    a, b = smiquery.details(runner=_fake())
    assert [(d.profile, d.memory_total) for d in a.mig_devices] == [("3g.40gb", 40192), ("1g.10gb", 9728)]
    uuids = [d.uuid or "" for d in a.mig_devices]
    assert all(u.startswith("MIG-") for u in uuids) and len(set(uuids)) == 2
    assert b.uuid == "GPU-66666666-7777-8888-9999-000000000000"


def test_details_selects_gpus_and_reports_an_unknown_one():
    runner = _fake()
    (only,) = details("00000000:0F:00.0", runner=runner)
    assert only.uuid == "GPU-66666666-7777-8888-9999-000000000000"
    with pytest.raises(NoDevicesFoundError):
        details(5, runner=runner)


def test_details_against_the_recording_without_an_xml():
    gpus = details(runner=InProcessRunner())
    assert len(gpus) == 8
    assert gpus[0].name == "NVIDIA H100 80GB HBM3" and gpus[0].memory_total == 81559
    assert gpus[0].processes and gpus[0].processes[0].used_memory == 69126


def test_details_raises_typed_errors_for_faults():
    with pytest.raises(DriverNotLoadedError):
        details(runner=_fake(SMIQUERY_FAKE_FAULT="driver-not-loaded"))
    with pytest.raises(ParseError):
        details(runner=_fake(SMIQUERY_FAKE_FAULT="truncated"))
    with pytest.raises(NvidiaSmiTimeoutError):
        details(runner=_fake(SMIQUERY_FAKE_FAULT="hang"), timeout=1.0)
