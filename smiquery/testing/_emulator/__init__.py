"""The fake nvidia-smi's emulator, behind :mod:`smiquery.testing` (private: its names may change at any time).

Imports flow one way: settings and output at the bottom; faults, recording, reload, apps and args over them; rows,
query, info, pmon and details write the modes; engine dispatches; executable and inprocess run the engine.
"""
