"""smiquery's loggers: quiet (a NullHandler, set when the first module that logs is imported) unless configured."""

from __future__ import annotations

import logging

logging.getLogger("smiquery").addHandler(logging.NullHandler())


def get_logger(name: str = "smiquery") -> logging.Logger:
    """The logger ``name`` (``smiquery`` or a child of it), with the package logger's NullHandler in place."""
    return logging.getLogger(name)
