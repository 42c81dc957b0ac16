"""nvidia-smi's command line as the fake reads it, with nvidia-smi's messages for a bad one."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NoReturn

from smiquery.testing._emulator.output import HELP_HINT, FakeExit, Output
from smiquery.testing._emulator.settings import is_number


@dataclasses.dataclass
class Options:
    query_gpu: str | None = None
    query_apps: str | None = None
    fmt: str | None = None
    ids: str | None = None
    interval: float | None = None
    action: str | None = None


class _Args:
    def __init__(self, argv: Sequence[str], out: Output) -> None:
        self.argv = list(argv)
        self.pos = 0
        self.out = out

    def fail(self, message: str) -> NoReturn:
        self.out.line(f"ERROR: {message} {HELP_HINT}")
        raise FakeExit(255)

    def value(self, option: str, inline: str | None) -> str:
        if inline is not None:
            if not inline:
                self.fail(f"Option {option} is missing its value.")
            return inline
        if self.pos >= len(self.argv):
            self.fail(f"Option {option} is missing its value.")
        text = self.argv[self.pos]
        self.pos += 1
        return text

    def optional_number(self) -> str | None:
        if self.pos < len(self.argv) and is_number(self.argv[self.pos]):
            self.pos += 1
            return self.argv[self.pos - 1]
        return None


def _parse_interval(args: _Args, option: str, text: str, scale: float) -> float:
    if not is_number(text) or int(text) <= 0:
        args.fail(f"Invalid value {text!r} for option {option}.")
    return int(text) * scale


def parse_args(argv: Sequence[str], out: Output) -> Options:
    opts = Options()
    args = _Args(argv, out)
    actions = {
        "--help-query-gpu": "help-query-gpu",
        "--help-query-compute-apps": "help-query-compute-apps",
        "-L": "list",
        "--list-gpus": "list",
        "--version": "version",
        "-h": "help",
        "--help": "help",
        "--fake-help": "help",
    }
    while args.pos < len(args.argv):
        arg = args.argv[args.pos]
        args.pos += 1
        name, eq, inline_text = arg.partition("=")
        inline = inline_text if eq else None
        if arg in actions:
            opts.action = opts.action or actions[arg]
        elif name == "--query-gpu":
            opts.query_gpu = args.value(name, inline)
        elif name == "--query-compute-apps":
            opts.query_apps = args.value(name, inline)
        elif name == "--format":
            opts.fmt = args.value(name, inline)
        elif name in ("-i", "--id"):
            opts.ids = args.value(name, inline)
        elif name in ("-l", "--loop"):
            text = inline if inline is not None else args.optional_number()
            # `-l` without a value loops every 5 seconds (manual)
            opts.interval = _parse_interval(args, name, text, 1.0) if text is not None else 5.0
        elif name in ("-lms", "--loop-ms"):
            opts.interval = _parse_interval(args, name, args.value(name, inline), 0.001)
        else:
            args.fail(f"Option {name} is not recognized.")
    return opts
