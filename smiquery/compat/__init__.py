"""Drop-in replacements for other nvidia-smi wrappers, so that switching to smiquery is one changed import.

``from smiquery.compat import GPUtil`` gives GPUtil 1.4.0's public surface (see :mod:`smiquery.compat.GPUtil`).
"""

from __future__ import annotations

from smiquery.compat import GPUtil

__all__ = ["GPUtil"]
