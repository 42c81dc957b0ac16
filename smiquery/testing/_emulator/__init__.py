"""The fake nvidia-smi's emulator, behind :mod:`smiquery.testing` (private: its names may change at any time).

Imports flow one way: ``core`` (settings, faults, output, arguments), then ``recording``, then ``modes`` (the CSV
queries, ``pmon``, ``-q -x`` and ``-L``); ``engine`` dispatches, and runs as an executable or on a thread.
"""
