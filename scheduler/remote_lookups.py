"""The remote tier's scheduler half: which leading blocks of a request the
store holds, looked up on a thread so the scheduler never waits on the network
(vLLM is told "ask again next step" meanwhile). The worker half, which writes
and reads the chunks, is ``kvreel.connector.tiers.remote``."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvreel.codec.formats import BLOCK_POINTER, StoreKeys
from kvreel.connector.tiers.store import RemoteError, ThrottledWarning, open_store

logger = logging.getLogger(__name__)


class RemoteLookups:
    """Which leading blocks of a request the store holds.

    A lookup runs on a thread; the scheduler waits for answers at most
    ``wait_s`` per step (all requests together), so a store that answers in
    time costs a new request no scheduler step, and a slow or dead one costs a
    step at most that. After a wait that ran out, nothing is waited for until a
    lookup answers within ``wait_s`` again."""

    def __init__(self, url: str, identity: str, timeout_s: float, wait_s: float = 0.0):
        self.keys = StoreKeys(identity)
        self.store = open_store(url, timeout_s=timeout_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvreel-remote-lookup")
        self._pending: dict[str, tuple[tuple[bytes, ...], Future]] = {}
        self._log = ThrottledWarning(logger)
        self.errors = 0
        self.wait_s = wait_s
        self._step_left = wait_s
        self._in_time = True           # the last lookup answered within wait_s

    def new_step(self) -> None:
        """A scheduler step begins: its waiting budget is whole again."""
        self._step_left = self.wait_s

    def poll(self, req_id: str, hashes: list[bytes]) -> list[tuple[bytes, int]] | None:
        """Pointers (chunk key, row) of the longest run of ``hashes`` held remotely,
        or None while the lookup is in flight. A failed lookup is an empty run.

        The answer always belongs to exactly these ``hashes``: when the request
        asks about other blocks than the lookup in flight (its local hit grew,
        it was preempted and resumed), the stale lookup is dropped and a new one
        starts, so pointers can never be applied to the wrong blocks."""
        wanted = tuple(hashes)
        pending = self._pending.get(req_id)
        if pending is None or pending[0] != wanted:
            pending = self._pending[req_id] = (wanted, self._pool.submit(self._timed_lookup, list(wanted)))
        fut = pending[1]
        if not fut.done() and self._in_time and self._step_left > 0:
            budget = self._step_left
            t0 = time.monotonic()
            wait([fut], timeout=budget)
            self._step_left -= time.monotonic() - t0
            if not fut.done() and budget >= self.wait_s:
                self._in_time = False            # a whole wait ran out: the store is slow
        if not fut.done():
            return None
        del self._pending[req_id]
        try:
            return fut.result()
        except (RemoteError, ValueError) as e:
            self.errors += 1
            self._log.warn("kvreel: remote lookup failed (%s); serving from local tiers / recompute", e)
            return []

    def _timed_lookup(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        t0 = time.monotonic()
        try:
            return self._lookup(hashes)
        finally:
            if time.monotonic() - t0 <= self.wait_s:
                self._in_time = True

    def _lookup(self, hashes: list[bytes]) -> list[tuple[bytes, int]]:
        if not hashes:
            return []
        values = self.store.get_many([self.keys.block(h) for h in hashes])
        out = []
        for v in values:
            if v is None or len(v) != BLOCK_POINTER.size:
                break
            out.append(BLOCK_POINTER.unpack(v))
        # pointers can outlive their chunk (store eviction, a deleted damaged chunk):
        # the run ends at the first block whose chunk is gone
        chunks = list(dict.fromkeys(k for k, _ in out))
        present = dict(zip(chunks, self.store.exists([self.keys.chunk(k) for k in chunks])))
        for i, (k, _) in enumerate(out):
            if not present[k]:
                return out[:i]
        return out

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
