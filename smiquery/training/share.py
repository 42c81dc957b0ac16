"""The run's own share of each GPU (``process_share=True``): one ``nvidia-smi pmon`` beside it, summed per epoch."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from smiquery._log import get_logger
from smiquery.sources.pmon import pmon_unsupported, proc_stat, process_share

if TYPE_CHECKING:
    from smiquery.source import StreamEvent
    from smiquery.sources.pmon import PmonRow, ProcessShare
    from smiquery.streams.pmon import PmonStream

__all__ = ["ShareTracker", "own_pids"]

log = get_logger("smiquery.training.share")


def own_pids(pids: Iterable[int] | None = None, *, root: str = "/proc") -> frozenset[int]:
    """The run's own processes among ``pids`` (default every process): this process and its descendants.

    Parent chains are read from ``ROOT/PID/stat``; without ``/proc`` (macOS, Windows) only this process counts.
    """
    me = os.getpid()
    if not os.path.isdir(root):
        return frozenset({me} if pids is None or me in set(pids) else ())
    if pids is None:
        pids = [int(name) for name in os.listdir(root) if name.isdigit()]
    known: dict[int, bool] = {me: True, 0: False, 1: me == 1}
    out = set()
    for pid in pids:
        chain: list[int] = []
        cur: int | None = pid
        while cur is not None and cur not in known and len(chain) < 4096:
            chain.append(cur)
            stat = proc_stat(cur, root)
            cur = int(stat[1]) if len(stat) > 1 and stat[1].isdigit() else None
        verdict = known.get(cur, False) if cur is not None else False
        for p in chain:
            known[p] = verdict
        if known.get(pid, False):
            out.add(pid)
    return frozenset(out)


class _ShareAcc:
    """One GPU's SM use over an epoch: the run's part, the total, the pmon instants seen, the other pids."""

    __slots__ = ("instants", "mine", "others", "total")

    def __init__(self) -> None:
        self.mine = self.total = 0.0
        self.instants = 0
        self.others: set[int] = set()

    def add(self, share: ProcessShare) -> None:
        self.instants += 1
        if share.mine_sm is not None or share.others_sm is not None:
            self.mine += share.mine_sm or 0
            self.total += (share.mine_sm or 0) + (share.others_sm or 0)
        self.others.update(share.other_pids)

    def merge(self, other: _ShareAcc) -> None:
        self.instants += other.instants
        self.mine += other.mine
        self.total += other.total
        self.others |= other.others


class ShareTracker:
    """One pmon child and its reading thread: each instant summed into the epoch ``epoch_now()`` says it arrived in.

    Failures are said once through ``say``, never raised; an unsupported pmon turns the share off (the keys stay
    NaN). ``watched(idx)``: whether the run watches a GPU (None: every GPU).
    """

    def __init__(
        self,
        say: Callable[..., None],
        epoch_now: Callable[[], int | None],
        watched: Callable[[int], bool] | None = None,
    ) -> None:
        self._say = say
        self._epoch_now = epoch_now
        self._watched = watched
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._accs: dict[int | None, dict[int, _ShareAcc]] = {}
        self._shares: dict[int, ProcessShare] = {}
        self._pmon: PmonStream | None = None
        self._reader: threading.Thread | None = None
        #: True once the share is given up (pmon unsupported or not startable)
        self.off = False
        #: CPU seconds of the reading thread, once it ended
        self.cpu = 0.0

    def start(self, *, interval: float, gpus: Sequence[str] | None, nvidia_smi: str | os.PathLike[str] | None) -> None:
        """Start pmon (SM use only, 1..10 s apart, four GPUs at most) and its reading thread."""
        from smiquery.streams import pmon

        seconds = max(1, min(10, round(interval)))
        ids = list(gpus)[:4] if gpus else None
        try:
            self._pmon = pmon.stream(
                gpus=ids, interval=seconds, select="u", nvidia_smi=nvidia_smi, on_event=self._event
            )
        except Exception as exc:
            self.off = True
            self._say(f"the process share is off: {exc}", key="share-off")
            return
        self._reader = threading.Thread(target=self._read, name="smiquery-monitor-pmon", daemon=True)
        self._reader.start()

    @property
    def open(self) -> bool:
        """True while pmon or its reading thread is not closed."""
        return self._pmon is not None or self._reader is not None

    def latest(self) -> dict[int, ProcessShare]:
        """The newest pmon instant's share per watched GPU (empty before the first)."""
        with self._lock:
            return dict(self._shares)

    def _event(self, event: StreamEvent) -> None:
        err = event.error
        if event.kind != "error" or err is None or self.off:
            return
        if pmon_unsupported(err):
            self.off = True
            self._say(
                "per-process monitoring (nvidia-smi pmon) is not supported on this GPU or driver: the process share "
                "is off and gpuN_share / gpuN_other_processes stay NaN",
                key="share-unsupported",
            )
            pmon = self._pmon
            if pmon is not None:
                pmon.close()  # ends its retries; the pmon thread then ends
            return
        self._say(
            f"nvidia-smi pmon failed ({type(err).__name__}: {event.detail or err}); it is retried, and the process "
            "share has a gap until it recovers",
            key=f"share-error-{type(err).__name__}",
        )

    def _read(self) -> None:
        pmon = self._pmon
        try:
            for instant in pmon.samples() if pmon is not None else ():
                if self._stop.is_set() or self.off:
                    return
                self.take(instant)
        except Exception as exc:
            if not self._stop.is_set() and not self.off:
                self._say(f"the process share stopped: {exc}", key="share-stopped")
        finally:
            self.cpu = time.thread_time()

    def take(self, rows: Sequence[PmonRow]) -> None:
        """Sum one pmon instant into the epoch it arrived in; say once per GPU when another process is on it."""
        epoch = self._epoch_now()
        shares = process_share(rows, own_pids({r.pid for r in rows if r.pid is not None}), every=True)
        if self._watched is not None:
            shares = {g: v for g, v in shares.items() if self._watched(g)}
        with self._lock:
            accs = self._accs.setdefault(epoch, {})
            for gpu, share in shares.items():
                accs.setdefault(gpu, _ShareAcc()).add(share)
            self._shares = shares
        for gpu, share in shares.items():
            if not share.other_pids:
                continue
            first = next((r for r in rows if r.gpu == gpu and r.pid == share.other_pids[0]), None)
            who = f"pid {share.other_pids[0]}" + (f" ({first.command})" if first and first.command else "")
            more = f" and {len(share.other_pids) - 1} more" if len(share.other_pids) > 1 else ""
            use = "no SM use reported" if share.others_sm is None else f"{share.others_sm}% SM"
            self._say(
                f"another process uses GPU {gpu} beside this run: {who}{more}, {use}; gpu{gpu}_share tells this "
                "run's part of the GPU's SM use (see `smiquery ps`)",
                key=f"share-other-{gpu}",
            )

    def epoch_values(self, epoch: int | None, order: Sequence[int], *, first: bool) -> dict[str, float]:
        """``gpuN_share`` and ``gpuN_other_processes`` of ``epoch`` for the GPUs in ``order`` (NaN without data).

        ``first``: the run's first summarised epoch, which also takes the instants before it.
        """
        with self._lock:
            accs = self._accs.pop(epoch, None) or {}
            setup = self._accs.pop(None, None)
            if setup is not None and first:
                for gpu, extra in setup.items():
                    accs.setdefault(gpu, _ShareAcc()).merge(extra)
            for k in [k for k in self._accs if k is not None and epoch is not None and k < epoch]:
                del self._accs[k]  # instants of epochs already summarised: the share is not corrected
        out: dict[str, float] = {}
        for idx in order:
            acc = accs.get(idx, _ShareAcc())
            out[f"gpu{idx}_share"] = acc.mine / acc.total if acc.total > 0 else math.nan
            out[f"gpu{idx}_other_processes"] = float(len(acc.others)) if acc.instants else math.nan
        return out

    def close(self, timeout: float) -> None:
        """Stop pmon (terminated and reaped) and its reading thread."""
        self._stop.set()
        pmon, self._pmon = self._pmon, None
        if pmon is not None:
            try:
                pmon.close()
            except Exception:
                log.exception("smiquery: stopping nvidia-smi pmon failed")
        reader, self._reader = self._reader, None
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout)
