"""Copy nvidia-smi out of another image's root file system, following every symbolic link inside that root.

Used by the ``smi-copy`` stage of docker/Dockerfile.tensorflow, which mounts SMI_SOURCE_IMAGE's root at
``/smi-source``:

    python3 copy-nvidia-smi.py ROOT SOURCE_NAME MODE OUTDIR

ROOT is the mounted root, SOURCE_NAME the image's name (for messages and the record file), MODE ``required`` (the
default in the Dockerfile: exit 1 when the image has no nvidia-smi) or ``optional`` (copy nothing and say so), OUTDIR
the folder that becomes the image's root: OUTDIR/usr/bin/nvidia-smi when copied.
Links are resolved as the source image itself would see them:
absolute targets relative to ROOT, relative targets relative to the link's folder, and links in folder components
too (Debian's ``/usr/bin/nvidia-smi -> /etc/alternatives/nvidia--nvidia-smi -> /usr/lib/nvidia/current/nvidia-smi``,
merged-/usr ``/bin -> usr/bin``). Writes one line saying what happened to /usr/share/smiquery/nvidia-smi-source.txt
(under OUTDIR) and stdout. Standard library only: it runs in the TensorFlow base's Python.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys

WANTED = "/usr/bin/nvidia-smi"
RECORD = "/usr/share/smiquery/nvidia-smi-source.txt"
MAX_LINKS = 40  # what Linux allows in one path lookup (ELOOP beyond)
UNSET = "scratch"  # the Dockerfile's default for SMI_SOURCE_IMAGE: nothing was chosen


class CopyError(Exception):
    """The source image has no usable nvidia-smi (or none was named)."""


def resolve_in_root(root: str, path: str) -> str:
    """The real path of ``path`` inside ``root`` (an absolute path inside the root), every link followed.

    Raises:
        CopyError: on a link loop, or a path that does not exist.
    """
    pending = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, part)
        try:
            mode = os.lstat(here).st_mode
        except FileNotFoundError:
            raise CopyError(f"/{'/'.join([*done, part])} does not exist") from None
        if stat.S_ISLNK(mode):
            hops += 1
            if hops > MAX_LINKS:
                raise CopyError(f"{path}: more than {MAX_LINKS} symbolic links (a loop?)")
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            pending = [p for p in target.split("/") if p] + pending
            continue
        done.append(part)
    return "/" + "/".join(done)


def copy(root: str, source_name: str, mode: str, dest: str = WANTED) -> str:
    """Copy ``WANTED`` from ``root`` to ``dest``; returns the message. Raises CopyError when nothing can be copied."""
    if mode not in ("required", "optional"):
        raise CopyError(f"SMI_COPY={mode!r}: use 'required' (the default) or 'optional'")
    if source_name in ("", UNSET):
        raise CopyError(
            "the copied-smi target needs --build-arg SMI_SOURCE_IMAGE=<an image with your fleet's exact driver>; "
            "or build the default target, which uses the host's nvidia-smi at run time"
        )
    try:
        real = resolve_in_root(root, WANTED)
        if not os.path.isfile(os.path.join(root, real.lstrip("/"))):
            raise CopyError(f"{WANTED} resolves to {real}, which is not a file")
    except CopyError as exc:
        if mode == "optional":
            return (
                f"{source_name} has no usable {WANTED} ({exc}): nothing copied (SMI_COPY=optional); "
                "the NVIDIA Container Toolkit mounts the host's nvidia-smi at run time"
            )
        raise CopyError(
            f"{source_name} has no usable {WANTED} ({exc}); build from an image that contains your driver's "
            "nvidia-smi, pass --build-arg SMI_COPY=optional to build without it, or use the default target"
        ) from None
    shutil.copyfile(os.path.join(root, real.lstrip("/")), dest)
    os.chmod(dest, 0o755)
    via = "" if real == WANTED else f" (through links, from {real})"
    return f"copied {WANTED} from {source_name}{via}"


def main(argv: list[str]) -> int:
    """Command line: ROOT SOURCE_NAME MODE OUTDIR."""
    if len(argv) != 4:
        print(f"usage: {os.path.basename(sys.argv[0])} ROOT SOURCE_NAME MODE OUTDIR", file=sys.stderr)
        return 2
    root, source_name, mode, outdir = argv
    dest = os.path.join(outdir, WANTED.lstrip("/"))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    try:
        message = copy(root, source_name, mode, dest)
    except CopyError as exc:
        print(f"copied-smi: {exc}", file=sys.stderr)
        return 1
    record = os.path.join(outdir, RECORD.lstrip("/"))
    os.makedirs(os.path.dirname(record), exist_ok=True)
    with open(record, "w", encoding="utf-8") as out:
        out.write(message + "\n")
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
