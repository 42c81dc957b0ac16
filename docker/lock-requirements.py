"""Turn pip's installation report into a hash-pinned requirements file (``name==version --hash=sha256:...``).

Run inside an image build, after the build's own resolver decided what to install:

    pip install --dry-run --quiet --report report.json [constraints and requirements...]
    python3 lock-requirements.py report.json [--exclude NAME ...] > lock.txt

so that the versions come from the Python, platform and preinstalled packages of the image itself, and the hashes
from the exact files pip chose (from the index's URL, or the file itself for a local wheel). Installing with
``pip install --require-hashes --no-deps -r lock.txt`` then takes exactly those files. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import urllib.parse
import urllib.request


def _sha256(item: dict[str, object]) -> str:
    info = item.get("download_info")
    if not isinstance(info, dict):
        raise SystemExit(f"lock-requirements: no download_info for {item.get('metadata')}")
    archive = info.get("archive_info")
    if isinstance(archive, dict):
        hashes = archive.get("hashes")
        if isinstance(hashes, dict) and isinstance(hashes.get("sha256"), str):
            return str(hashes["sha256"])
        legacy = archive.get("hash")
        if isinstance(legacy, str) and legacy.startswith("sha256="):
            return legacy.split("=", 1)[1]
    url = str(info.get("url", ""))
    if url.startswith("file:"):  # older pips leave local files unhashed: hash the file pip would install
        path = urllib.request.url2pathname(urllib.parse.urlparse(url).path)
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    raise SystemExit(f"lock-requirements: pip reported no sha256 for {url} (a source tree or VCS checkout?)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock(report: dict[str, object], exclude: set[str]) -> str:
    """The requirements text for every distribution the report installs, sorted by name."""
    lines = []
    items = report.get("install")
    if not isinstance(items, list):
        raise SystemExit("lock-requirements: not a pip installation report (no 'install' list)")
    for item in items:
        meta = item["metadata"]
        name = _canonical(meta["name"])
        if name in exclude:
            continue
        lines.append(f"{name}=={meta['version']} \\\n    --hash=sha256:{_sha256(item)}")
    return "".join(line + "\n" for line in sorted(lines))


def main(argv: list[str]) -> int:
    """Command line: REPORT [--exclude NAME ...]; writes the lock to stdout."""
    if not argv:
        print("usage: lock-requirements.py REPORT [--exclude NAME ...]", file=sys.stderr)
        return 2
    exclude = {_canonical(n) for i, n in enumerate(argv) if i and argv[i - 1] == "--exclude"}
    with open(argv[0], encoding="utf-8") as f:
        report = json.load(f)
    sys.stdout.write(lock(report, exclude))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
