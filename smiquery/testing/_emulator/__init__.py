"""The fake nvidia-smi's emulator, behind :mod:`smiquery.testing` (private: its names may change at any time).

Imports flow one way: ``core`` (settings, output, arguments), then ``faults`` and ``recording``, then ``query``
(the CSV modes), ``pmon`` and ``details``; ``engine`` dispatches, and runs as an executable or on a thread.
"""
