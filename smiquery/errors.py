"""The exception tree: every failure smiquery reports is one of these, with a message that says what to do.

Every exception class of the package is defined here; :func:`failure_from_exit` maps nvidia-smi's exit codes
(``exit N`` below) and messages to classes.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (and re) at run time
if TYPE_CHECKING:
    import os
    from collections.abc import Sequence

_CONTAINER_HINT = (
    "in a container, start it with `--gpus all` (or set NVIDIA_DRIVER_CAPABILITIES=compute,utility "
    "with the NVIDIA runtime)"
)


class SmiqueryError(Exception):
    """Base of every error smiquery raises.

    ``retryable``: a long-lived source retries it soon (else it waits for a person to fix the cause); ``exit_status``:
    the command line's exit code for it: 2 usage, 3 nvidia-smi missing, 4 driver, 5 timeout, else 1.
    """

    retryable = False
    exit_status = 1


class InvalidFieldError(SmiqueryError, ValueError):
    """A field name is not in the catalogue (or is malformed); ``field`` is the name, ``suggestions`` the closest."""

    exit_status = 2

    def __init__(self, field: str, suggestions: Sequence[str] = (), *, detail: str | None = None) -> None:
        self.field = field
        self.suggestions = tuple(suggestions)
        if detail:
            msg = f"invalid field {field!r}: {detail}" if field else f"invalid fields: {detail}"
        elif self.suggestions:
            msg = f"unknown field {field!r}; did you mean " + ", ".join(map(repr, self.suggestions)) + "?"
        else:
            msg = f"unknown field {field!r}; run `smiquery fields` to list valid names"
        super().__init__(msg)


class InvalidGpuIdError(SmiqueryError, ValueError):
    """A GPU id is neither an index, a GPU UUID, nor a PCI bus id."""

    exit_status = 2

    def __init__(self, gpu_id: object) -> None:
        self.gpu_id = gpu_id
        super().__init__(
            f"invalid GPU id {gpu_id!r}: use an index (0), a UUID (GPU-...) or a PCI bus id (00000000:0C:00.0)"
        )


class WebConfigError(SmiqueryError, ValueError):
    """The web configuration file (``path``) is unreadable or wrong."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        super().__init__(f"web config {self.path}: {reason}; see docs/exporter.md (web configuration)")


class InvalidTimeZoneError(SmiqueryError, ValueError):
    """A time zone name (``zone``) that is not an IANA zone (``tz="Mars/Olympus"``, ``--tz``)."""

    exit_status = 2

    def __init__(self, zone: str) -> None:
        self.zone = zone
        super().__init__(f"unknown time zone {zone!r}; give an IANA name such as 'Europe/Berlin' or 'UTC'")


class UsageError(SmiqueryError, ValueError):
    """A command-line option value that does not fit, found by a command."""

    exit_status = 2


class ParseError(SmiqueryError, ValueError):
    """A line of nvidia-smi output (``line``, number ``lineno`` from 1) does not fit the requested fields.

    ``field`` is the field whose value did not fit (None: a wrong column count); ``reason`` says what is wrong,
    without the place (``'7.5' is not a valid integer``).
    """

    def __init__(self, message: str, *, lineno: int, line: str, field: str | None = None) -> None:
        self.reason = message
        self.lineno = lineno
        self.line = line
        self.field = field
        from smiquery.printable import printable

        # a short excerpt, control bytes (a binary file) as escapes never cut in two: one readable line
        shown = ""
        for piece in map(printable, line):
            if len(shown) + len(piece) > 77:
                shown += "..."
                break
            shown += piece
        where = f"line {lineno}" + (f", field {field!r}" if field else "")
        super().__init__(f"{where}: {message}: '{shown}'")


class InvalidRuleError(SmiqueryError, ValueError):
    """An alert expression (``text``) that cannot be parsed, or that names an unknown field; ``reason`` says why."""

    exit_status = 2

    def __init__(self, text: str, reason: str) -> None:
        self.text = text
        self.reason = reason
        super().__init__(
            f"invalid alert {text!r}: {reason}; write FIELD OP VALUE [for N | for 30s], "
            "e.g. 'temperature.gpu > 85 for 3'"
        )


class RecordingError(SmiqueryError):
    """A recording cannot be read: the file is missing, empty, not a recording, or holds no readable row."""


class ReplayError(RecordingError):
    """A recording cannot be played: missing, empty or random bytes, no header, or fields it does not hold."""


class ReportError(RecordingError, ValueError):
    """A recording cannot be analysed: unreadable, empty, or without a ``timestamp`` column."""


class PrometheusError(SmiqueryError):
    """A Prometheus server (``--prometheus``) answered in a way smiquery cannot use: not its HTTP API, no data."""


class PrometheusUnreachableError(PrometheusError):
    """A Prometheus server cannot be reached: refused, unknown host, TLS failure, timeout, or credentials refused."""

    retryable = True


class PrometheusQueryError(PrometheusError, ValueError):
    """A Prometheus server rejected a query (bad PromQL, too many points or samples, a timed-out evaluation)."""


class KernelLogError(SmiqueryError):
    """The kernel log (``path``) cannot be read: no permission, missing, not a log (``reason``, a few words)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        hint = (
            "run as root or with CAP_SYSLOG (sysctl kernel.dmesg_restrict=0 also allows it), or pass a copy of "
            "the log such as /var/log/kern.log"
            if "permission" in reason
            else "pass /dev/kmsg or a kernel log file such as /var/log/kern.log"
        )
        super().__init__(f"cannot read the kernel log {path}: {reason}; {hint}")


class KubernetesApiError(SmiqueryError):
    """The Kubernetes API server answered this node's pod list with an error (HTTP ``status``), too much, or junk."""

    def __init__(self, message: str, status: int = 0) -> None:
        self.status = status
        super().__init__(message)


class SlurmError(SmiqueryError):
    """Slurm's client commands could not say which job holds which GPU (missing, slurmctld down, munge...).

    ``kind``: ``not_found``, ``controller_unreachable``, ``auth``, ``timeout``, ``minors`` or ``failed``.
    """

    def __init__(self, message: str, kind: str = "failed") -> None:
        self.kind = kind
        super().__init__(message)


class ListenError(SmiqueryError):
    """The HTTP server cannot listen on ``bind``:``port``; ``option`` (``--port``, ``--bind``) is the one to change."""

    def __init__(self, message: str, *, port: int, bind: str, option: str = "--port") -> None:
        self.port = port
        self.bind = bind
        self.option = option
        super().__init__(message)


class PortInUseError(ListenError):
    """Another program listens on the port already."""


class InfoRomWarning(UserWarning):
    """nvidia-smi exited 14 (infoROM corrupted) but printed valid rows; the rows were returned."""


class NvidiaSmiNotFoundError(SmiqueryError):
    """The nvidia-smi binary is missing or cannot be executed."""

    exit_status = 3

    def __init__(self, message: str | None = None, *, searched: Sequence[str] = ()) -> None:
        self.searched = tuple(searched)
        super().__init__(
            message
            or "nvidia-smi not found: install the NVIDIA driver, pass nvidia_smi=PATH / --nvidia-smi PATH or set "
            f"SMIQUERY_NVIDIA_SMI; {_CONTAINER_HINT}"
        )


class ResourceLimitError(SmiqueryError):
    """nvidia-smi could not be started: this process is at a resource limit (open files, processes, memory); retried."""

    retryable = True


class NvidiaSmiTimeoutError(SmiqueryError):
    """nvidia-smi gave no answer (or no complete row) in time; the child was killed."""

    retryable = True
    exit_status = 5

    def __init__(self, message: str, *, argv: Sequence[str] = (), timeout: float | None = None) -> None:
        self.argv = tuple(argv)
        self.timeout = timeout
        super().__init__(message)


class OutputTooLargeError(SmiqueryError):
    """A one-shot nvidia-smi printed more than ``limit`` bytes (a wrong binary?); it was killed, its output dropped."""

    def __init__(self, argv: Sequence[str], limit: int) -> None:
        self.argv = tuple(argv)
        self.limit = limit
        name = self.argv[0] if self.argv else "nvidia-smi"
        super().__init__(
            f"{name} printed more than {limit // (1024 * 1024)} MiB without finishing and was killed: is it really "
            "nvidia-smi? check `nvidia-smi --version`, or pass --nvidia-smi PATH / SMIQUERY_NVIDIA_SMI"
        )


class NvidiaSmiFailedError(SmiqueryError):
    """nvidia-smi (``argv``) exited non-zero: ``returncode`` (negative for a signal), ``output`` all it printed."""

    retryable = True
    hint = "run `smiquery doctor` for a diagnosis"

    def __init__(self, argv: Sequence[str], returncode: int, output: str, message: str | None = None) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.output = output
        first = self.first_line
        said = f": {first if len(first) <= 160 else first[:157] + '...'}" if first else ""
        super().__init__(message or f"nvidia-smi exited with code {returncode}{said}; {self.hint}")

    @property
    def first_line(self) -> str:
        """The first line of nvidia-smi's message (CSV data rows it printed before failing are skipped)."""
        return next(iter(_message_lines(self.output)), "")


class StreamEndedError(NvidiaSmiFailedError):
    """A loop-mode nvidia-smi ended its output, which it never does by itself (exit 0, or stopped on request)."""

    hint = "the stream restarts it"

    def __init__(self, argv: Sequence[str], returncode: int, output: str, message: str | None = None) -> None:
        super().__init__(argv, returncode, output, message or "nvidia-smi ended its loop")


class InvalidArgumentError(NvidiaSmiFailedError, ValueError):
    """nvidia-smi rejected an argument (exit 2), typically a field this driver does not know."""

    retryable = False
    hint = "check the field names with `smiquery fields --supported`"


class NotSupportedError(NvidiaSmiFailedError):
    """The operation is not available on this GPU (exit 3)."""

    retryable = False
    hint = "choose fields this GPU supports (`smiquery fields --supported`)"


class InsufficientPermissionsError(NvidiaSmiFailedError):
    """nvidia-smi lacks permission (exit 4)."""

    retryable = False
    exit_status = 4
    hint = "run as a user with access to /dev/nvidia*; on MIG in containers set NVIDIA_MIG_MONITOR_DEVICES=all"


class NoDevicesFoundError(NvidiaSmiFailedError):
    """No GPU was found, or none matches the requested id (exit 6)."""

    retryable = False
    exit_status = 4
    hint = f"check the GPU ids with `nvidia-smi -L`; {_CONTAINER_HINT} and NVIDIA_VISIBLE_DEVICES=all"


class DriverNotLoadedError(NvidiaSmiFailedError):
    """The NVIDIA driver is not loaded or cannot be reached (exit 9)."""

    exit_status = 4
    hint = f"check the driver with `lsmod | grep nvidia` and `dmesg`, or reinstall it; {_CONTAINER_HINT}"


class NvmlNotFoundError(NvidiaSmiFailedError):
    """libnvidia-ml.so cannot be found or loaded (exit 12)."""

    retryable = False
    exit_status = 4
    hint = f"{_CONTAINER_HINT}; on a host, reinstall the driver's utility libraries"


class GpuLostError(NvidiaSmiFailedError):
    """A GPU fell off the bus or is inaccessible (exit 15)."""

    exit_status = 4
    hint = "check `dmesg` for Xid 79; the GPU needs a reset or the machine a reboot"


class DriverVersionMismatchError(NvidiaSmiFailedError):
    """The loaded kernel module and the NVML library differ (exit 18), usually after a driver upgrade."""

    retryable = False
    exit_status = 4
    hint = "reboot (or reload the nvidia kernel modules) so the loaded driver matches the installed library"


_BY_CODE: dict[int, type[NvidiaSmiFailedError]] = {
    2: InvalidArgumentError,
    3: NotSupportedError,
    4: InsufficientPermissionsError,
    6: NoDevicesFoundError,
    9: DriverNotLoadedError,
    12: NvmlNotFoundError,
    15: GpuLostError,
    18: DriverVersionMismatchError,
}

# Message fragments seen in real output (NVIDIA-SMI.md section 5); they win over the exit code, which some
# drivers report as 255 for the same situation.
_BY_MESSAGE: tuple[tuple[str, type[NvidiaSmiFailedError]], ...] = (
    ("is not a valid field to query", InvalidArgumentError),
    ("driver/library version mismatch", DriverVersionMismatchError),
    ("couldn't find libnvidia-ml.so", NvmlNotFoundError),
    ("couldn't communicate with the nvidia driver", DriverNotLoadedError),
    ("driver not loaded", DriverNotLoadedError),
    ("gpu is lost", GpuLostError),
    ("fallen off the bus", GpuLostError),
    ("no devices were found", NoDevicesFoundError),
    ("no supported gpus were found", NoDevicesFoundError),
    ("insufficient permissions", InsufficientPermissionsError),
)


def _message_lines(output: str) -> list[str]:
    # A child that failed mid-stream printed CSV rows before its message; a row (cells joined by ", ") must
    # neither be quoted as the message nor matched: a "[GPU is lost]" cell is data, not the reason it exited.
    return [ln.strip() for ln in output.splitlines() if ln.strip() and ", " not in ln]


def failure_from_exit(argv: Sequence[str], returncode: int, output: str) -> NvidiaSmiFailedError:
    """The typed error for nvidia-smi's exit status and output (stdout and stderr); NvidiaSmiFailedError if none fit."""
    low = "\n".join(_message_lines(output)).lower()
    for fragment, cls in _BY_MESSAGE:
        if fragment in low:
            return cls(argv, returncode, output)
    return _BY_CODE.get(returncode, NvidiaSmiFailedError)(argv, returncode, output)


#: Every exception class above, and failure_from_exit.
__all__ = [n for n, v in list(globals().items()) if isinstance(v, type) and issubclass(v, (SmiqueryError, Warning))]
__all__ += ["failure_from_exit"]
