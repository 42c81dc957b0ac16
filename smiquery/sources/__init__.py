"""nvidia-smi's surfaces, one module each (``query_gpu``, ``apps``, ``pmon``, ``details``, ``xid``), and ``latest``.

Each has a pure parser, a one-shot call and a stream or follower; ``Latest`` is the background poller they run under.
"""
