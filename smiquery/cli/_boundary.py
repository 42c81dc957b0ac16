"""The one error boundary of the command line: exit codes, and errors turned into one line on stderr."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator
from enum import IntEnum

from smiquery.errors import ParseError, SmiqueryError, UsageError
from smiquery.printable import printable

__all__ = ["ExitCode", "as_usage", "boundary", "cli_text", "exit_code_for", "quiet_stdout", "say", "warnings_as_lines"]


class ExitCode(IntEnum):
    """The documented exit codes of ``smiquery`` (the table in :mod:`smiquery.cli`, and ``smiquery --help``)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_FOUND = 3
    DRIVER = 4
    TIMEOUT = 5
    ALERT = 6
    INTERRUPTED = 130
    TERMINATED = 143


def exit_code_for(exc: BaseException) -> ExitCode:
    """The documented exit code for the error that ended a command (an error's own ``exit_status``)."""
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, SmiqueryError):
        return ExitCode(exc.exit_status)
    return ExitCode.ERROR


# Library messages name Python arguments (`nvidia_smi=PATH`); a CLI user knows the options (compiled on first use).
_PY_ARGS = (
    (r"\bnvidia_smi=PATH\s*/\s*", ""),
    (r"\bnvidia_smi argument\b", "--nvidia-smi"),
    (r"\bnvidia_smi=", "--nvidia-smi "),
    (r"\bfields=", "--fields "),
    (r"\bgpus=", "--gpus "),
    (r"\binterval=", "--interval "),
    (r"\btimeout=", "--timeout "),
)
_QUOTED = r"(?<=[\s:(])(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"
_ESCAPE = r"\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}"
_MAX_MESSAGE = 400


def _binary_quote(match: re.Match[str]) -> str:
    """A quoted line of a binary file (escapes, control and non-ASCII characters) becomes a short note."""
    text = match.group(0)[1:-1]
    if len(text) < 8:
        return match.group(0)
    odd = len(re.findall(_ESCAPE, text)) + sum(1 for c in re.sub(_ESCAPE, "", text) if not " " <= c <= "~")
    return "(binary data, not text)" if odd > len(text) / 20 else match.group(0)


def cli_text(message: str) -> str:
    r"""A library message as a CLI user should read it: one line, options not Python arguments, printable only.

    A quoted line of a binary file becomes ``(binary data, not text)``; a stray control character is shown as
    a ``\xNN`` escape; a very long message is cut short.
    """
    text = re.sub(_QUOTED, _binary_quote, str(message))
    for pattern, repl in _PY_ARGS:
        text = re.sub(pattern, repl, text)
    text = " ".join(text.split())
    text = printable(text.replace("\ufffd", "?"))
    if len(text) > _MAX_MESSAGE:
        text = text[: _MAX_MESSAGE - 3] + "..."
    return text


def say(message: str) -> None:
    """Print one line on stderr (never fails: a closed stderr is ignored)."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Warnings raised inside are printed once it ends (not on an error), one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if not issubclass(w.category, ResourceWarning):
            say(f"smiquery: warning: {cli_text(str(w.message))}")


@contextlib.contextmanager
def as_usage(message: str, *errors: type[Exception]) -> Iterator[None]:
    """An error of these types raised inside becomes a UsageError (exit 2): ``message`` with its text for ``{}``."""
    try:
        yield
    except errors as exc:
        raise UsageError(message.format(exc)) from None


def quiet_stdout() -> None:
    """Point stdout at /dev/null after the reader went away (``| head``), so the flush at exit cannot fail."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


@contextlib.contextmanager
def boundary(debug: bool = False) -> Iterator[None]:
    """The one place where errors raised inside become a line on stderr and an exit code (``debug``: traceback too)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            yield
    except KeyboardInterrupt:
        raise SystemExit(int(ExitCode.INTERRUPTED)) from None
    except BrokenPipeError:
        quiet_stdout()
        raise SystemExit(0) from None
    except Exception as exc:
        typer = sys.modules.get("typer")  # not imported here: the fast path of `query` runs without it
        if typer is not None and isinstance(exc, typer.Exit):
            raise
        if debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        code = exit_code_for(exc)
        message = cli_text(str(exc)) or type(exc).__name__
        if isinstance(exc, ParseError):
            message += "; nvidia-smi printed output that does not fit the fields: run `smiquery doctor`"
        if not isinstance(exc, (SmiqueryError, ImportError, OSError)):
            message = f"unexpected {type(exc).__name__}: {message} (run with --debug for the traceback)"
        say(f"smiquery: {'usage error' if code == ExitCode.USAGE else 'error'}: {message}")
        raise SystemExit(int(code)) from None
