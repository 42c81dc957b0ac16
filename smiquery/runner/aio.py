"""Children on an asyncio event loop: one-shot runs and loop-mode lines, without blocking the loop.

The children are :mod:`smiquery.runner.children`'s, with its guarantees (reaped on cancellation too). stdout is read
only while a read waits, so a slow consumer holds the child back; past a read's deadline the child is killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Sequence

from smiquery.errors import SmiqueryError
from smiquery.runner import Completed, LineSplitter, decode, no_answer
from smiquery.runner.children import (
    MAX_ERR_BYTES,
    exit_pauses,
    exited,
    live_children,
    popen,
    read_some,
    signal_group,
    spawn_loop_child,
    terminate_and_reap,
)

__all__ = ["AsyncLines", "live_children", "run", "start_loop_child"]

Popen = subprocess.Popen[bytes]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _wait_exit(proc: Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s for the leader to exit, without reaping it."""
    for pause in exit_pauses(proc, timeout):
        await asyncio.sleep(pause)
    return exited(proc)


async def _reap(proc: Popen) -> None:
    """``terminate_and_reap`` on a worker thread, shielded: a cancelled caller leaves no process."""
    await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, terminate_and_reap, proc))


async def start_loop_child(argv: Sequence[str]) -> Popen:
    """:func:`~smiquery.runner.children.spawn_loop_child` on a worker thread, without blocking the event loop.

    Cancelled during the fork, it waits for the child and reaps it before passing the cancellation on; cancelled
    again meanwhile, the child is killed as soon as it exists.
    """
    started = asyncio.get_running_loop().run_in_executor(None, spawn_loop_child, argv)
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        try:
            await _reap(await asyncio.shield(started))
        except asyncio.CancelledError:
            started.add_done_callback(_kill_started)
            raise
        except SmiqueryError:
            pass  # it never started
        raise


def _kill_started(started: asyncio.Future[Popen]) -> None:
    if not started.cancelled() and started.exception() is None:
        terminate_and_reap(started.result(), 0.0)


class AsyncLines:
    """One running child's stdout lines, read on the event loop until a deadline; its exit judged at the end.

    The asyncio counterpart of :class:`~smiquery.runner.LineStream`; stderr is drained meanwhile.
    """

    def __init__(self, proc: Popen, argv: Sequence[str]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.argv = tuple(argv)
        self.idle = 0.0  #: seconds the last :meth:`readlines` waited
        self.timed_out = False
        self._split = LineSplitter()
        self.err = bytearray()  #: stderr so far (up to 64 KiB)
        self._eof = False
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._out, self._errfd = proc.stdout.fileno(), proc.stderr.fileno()
        os.set_blocking(self._out, False)
        os.set_blocking(self._errfd, False)
        self._loop.add_reader(self._errfd, self._drain_err)
        self._reading_err = True

    def _drain_err(self, chunks: int = 1) -> None:
        """Read up to ``chunks`` chunks of stderr (kept up to 64 KiB); stop reading it at its end."""
        for _ in range(chunks):
            data = read_some(self._errfd)
            if data is None:
                return
            if not data:
                self._stop_err()
                return
            if len(self.err) < MAX_ERR_BYTES:
                self.err += data

    def _stop_err(self) -> None:
        if self._reading_err:
            self._reading_err = False
            self._loop.remove_reader(self._errfd)

    def _read(self) -> bool:
        """Take what stdout holds now, without waiting; False when it holds nothing."""
        data = read_some(self._out)
        if data is None:
            return False
        if data:
            self._split.feed(data)
        else:
            self._eof = True
            self._split.end()
        return True

    async def readlines(self, deadline: float) -> list[str] | None:
        """Every complete line there is now (at least one), without newlines; None at the end of the output.

        ``deadline`` (monotonic, the loop's clock) bounds the wait: past it, with nothing to read even after one
        more look at the pipe (after a pause of this process the child's rows wait there), the child is killed,
        :attr:`timed_out` is set and None returned.
        """
        loop = self._loop
        lines = self._split.lines
        waited = 0.0
        while not lines and not self._eof:
            if self._read():
                continue
            now = loop.time()
            if now >= deadline:
                self.timed_out = self._eof = True
                signal_group(self.proc, signal.SIGKILL)
                break
            waiter = self._waiter = loop.create_future()
            loop.add_reader(self._out, _wake, waiter)
            timer = loop.call_at(deadline, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                if self._waiter is waiter:  # else close() stopped the reading
                    self._waiter = None
                    loop.remove_reader(self._out)
            waited += loop.time() - now
        self.idle = waited
        if not lines:
            return None
        got = list(lines)
        lines.clear()
        return got

    async def finish(self, timeout: float, *, check: bool = True) -> int:
        """After the end of output: wait up to ``timeout`` s for the exit (then kill), reap; the exit status.

        With ``check``, a non-zero exit raises its typed NvidiaSmiFailedError.
        """
        await _wait_exit(self.proc, timeout)
        await self.close()
        rc = self.proc.returncode if self.proc.returncode is not None else -signal.SIGKILL
        if rc and check:
            raise self._split.ended(self.argv, rc, bytes(self.err))
        return rc

    async def close(self) -> None:
        """Stop reading (a waiting :meth:`readlines` returns), terminate, kill if needed and reap. Idempotent."""
        self._eof = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.remove_reader(self._out)
            _wake(waiter)
        if self._reading_err:
            self._stop_err()
            self._drain_err(16)
        await _reap(self.proc)


async def run(argv: Sequence[str], timeout: float) -> Completed:
    """Run a one-shot child to completion within ``timeout`` seconds, without blocking the event loop.

    Raises NvidiaSmiNotFoundError (it cannot be executed) or NvidiaSmiTimeoutError (no answer in time; reaped).
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    child = AsyncLines(popen(argv), argv)
    lines: list[str] = []
    try:
        while (got := await child.readlines(start + timeout)) is not None:
            lines += got
        if child.timed_out or not await _wait_exit(child.proc, start + timeout - loop.time()):
            raise no_answer(argv, timeout)
        rc = await child.finish(0.0, check=False)
    finally:
        await child.close()
    stdout = "".join(f"{line}\n" for line in lines)
    return Completed(tuple(argv), rc, stdout, decode(bytes(child.err)), loop.time() - start)
