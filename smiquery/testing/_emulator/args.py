"""nvidia-smi's command line as the fake reads it, with nvidia-smi's messages for a bad one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn

from smiquery.testing._emulator.output import HELP_HINT, FakeExit, Output
from smiquery.testing._emulator.settings import is_number

_ACTIONS = {
    "--help-query-gpu": "help-query-gpu",
    "--help-query-compute-apps": "help-query-compute-apps",
    "-L": "list",
    "--list-gpus": "list",
    "--version": "version",
    "-h": "help",
    "--help": "help",
    "--fake-help": "help",
}
_VALUES = {
    "--query-gpu": "query_gpu",
    "--query-compute-apps": "query_apps",
    "--format": "fmt",
    "-i": "ids",
    "--id": "ids",
}


@dataclasses.dataclass
class Options:
    query_gpu: str | None = None
    query_apps: str | None = None
    fmt: str | None = None
    ids: str | None = None
    interval: float | None = None
    action: str | None = None


def usage_error(out: Output, hint: str = "") -> Callable[[str], NoReturn]:
    """What nvidia-smi does with a bad command line: ``ERROR: <message> <hint>`` on stdout, exit 255."""

    def fail(message: str) -> NoReturn:
        out.line(f"ERROR: {message} {hint}".rstrip())
        raise FakeExit(255)

    return fail


class ArgReader:
    """Options one by one, as ``(argument, name, inline value or None)``: ``--opt=VALUE`` or ``--opt VALUE``."""

    def __init__(self, argv: Sequence[str], fail: Callable[[str], NoReturn]) -> None:
        self.argv = list(argv)
        self.pos = 0
        self.fail = fail

    def __iter__(self) -> Iterator[tuple[str, str, str | None]]:
        while self.pos < len(self.argv):
            arg = self.argv[self.pos]
            self.pos += 1
            name, eq, inline = arg.partition("=")
            yield arg, name, inline if eq else None

    def value(self, option: str, inline: str | None) -> str:
        if inline is None and self.pos < len(self.argv):
            self.pos += 1
            return self.argv[self.pos - 1]
        if not inline:
            self.fail(f"Option {option} is missing its value.")
        return inline

    def optional_number(self) -> str | None:
        if self.pos < len(self.argv) and is_number(self.argv[self.pos]):
            self.pos += 1
            return self.argv[self.pos - 1]
        return None


def _interval(args: ArgReader, option: str, text: str, scale: float) -> float:
    if not is_number(text) or int(text) <= 0:
        args.fail(f"Invalid value {text!r} for option {option}.")
    return int(text) * scale


def parse_args(argv: Sequence[str], out: Output) -> Options:
    opts = Options()
    args = ArgReader(argv, usage_error(out, HELP_HINT))
    for arg, name, inline in args:
        if arg in _ACTIONS:
            opts.action = opts.action or _ACTIONS[arg]
        elif name in _VALUES:
            setattr(opts, _VALUES[name], args.value(name, inline))
        elif name in ("-l", "--loop"):
            text = inline if inline is not None else args.optional_number()
            # `-l` without a value loops every 5 seconds (manual)
            opts.interval = _interval(args, name, text, 1.0) if text is not None else 5.0
        elif name in ("-lms", "--loop-ms"):
            opts.interval = _interval(args, name, args.value(name, inline), 0.001)
        else:
            args.fail(f"Option {name} is not recognized.")
    return opts
