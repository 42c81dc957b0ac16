"""nvidia-smi's surfaces, one module each: a pure parser, a one-shot call and a stream or follower.

``query_gpu`` (``--query-gpu``), ``apps`` (``--query-compute-apps``), ``pmon``, ``details`` (``-q -x``) and ``xid``
(the kernel log), plus :class:`~smiquery.sources.latest.Latest`, the one background poller any of them runs under.
"""
