"""smiquery's loggers: quiet unless the application configures logging (the CLI and the exporter do).

The package logger gets its NullHandler here, when the first module that logs is imported, rather than in
``import smiquery``, which imports no logging at all (it would cost as much as the interpreter's own start-up).
"""

from __future__ import annotations

import logging

logging.getLogger("smiquery").addHandler(logging.NullHandler())


def get_logger(name: str = "smiquery") -> logging.Logger:
    """The logger ``name`` (``smiquery`` or a child of it), with the package logger's NullHandler in place."""
    return logging.getLogger(name)
