"""The stream engine and its drivers.

:mod:`smiquery.streams.engine` is the whole logic of a supervised nvidia-smi source, without any I/O: it takes
lines and the current (monotonic) time and gives back samples, sweeps and events, says when the next deadline is
(a hung child, the end of ``duration``) and decides, under the :class:`~smiquery.retry.RetryPolicy`, how long to
wait before the next start. The drivers only move bytes and sleep: the thread-based CSV stream
(:class:`smiquery.streams.sync.Stream`), the pmon stream (:class:`smiquery.streams.pmon.PmonStream`) and the
asyncio stream (:class:`smiquery.aio.AsyncStream`).

The package is called ``streams`` because ``smiquery.stream`` is the public function that opens a stream.
"""
