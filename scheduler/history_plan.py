"""Scheduler side of history offload: which blocks of each long request move
into the worker's history store, and when vLLM may free them.

Per step, every block of a long request that left its local window
(``KVREEL_RETRIEVAL_WINDOW``) is copied by the worker from vLLM's cache into the
request's history (``appends``), after the forward pass. Once the scheduler has
the step's output (the copy happened), ``LEDGER`` says kvreel holds those
blocks and vLLM's KV cache manager frees them in the next step. A request
admitted with a prefix kvreel holds from block 0 (a session resumed after a
restart or a preemption) gets its history loaded from kvreel's tiers while it
waits for its other loads, so vLLM never allocates those blocks at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreel.connector.retrieval.offload import LEDGER


def room_tokens(prompt_tokens: int, max_tokens: int) -> int:
    """The tokens a request's history room is reserved for when its first blocks
    arrive: the prompt and its answer, the answer counted up to a quarter of the
    prompt. A history that outgrows its room copies its keys and pages (at 16 K
    tokens of a float32 model with 2 KV heads of 64, 24 MiB a layer), so an answer
    that fits never pays it, and one that may not grows its layers' rooms one a
    step (``RequestHistory.append``); a quarter is what growing would have
    reserved anyway (``LayerHistory._reserve``), and bounds the room a request
    with a large default ``max_tokens`` is given."""
    return prompt_tokens + min(max(max_tokens, 0), prompt_tokens // 4)


@dataclass
class HistoryAppend:
    """Copy blocks ``first_block...`` of ``req_id`` (vLLM block ids) into its history,
    which is expected to reach ``room_blocks`` (the worker reserves them at once);
    ``most_blocks``: for a decoding history whose answer may outgrow them, the
    most it can reach (else 0); ``reach_blocks``: the most it can reach, its
    prompt and longest answer (0: unknown)."""
    req_id: str
    first_block: int
    block_ids: list[int]
    room_blocks: int = 0
    most_blocks: int = 0
    reach_blocks: int = 0


@dataclass
class HistoryStep:
    """The worker's history work for one step."""
    appends: list[HistoryAppend] = field(default_factory=list)
    rows: dict[int, str] = field(default_factory=dict)     # block of a long row's newest token -> request
    dropped: list[str] = field(default_factory=list)       # histories to forget (finished, preempted)


class HistoryPlanner:
    def __init__(self, block_size: int, window_tokens: int, min_tokens: int):
        self.block_size, self.window, self.min_tokens = block_size, window_tokens, min_tokens
        self.planned: dict[str, int] = {}         # blocks the worker's history will hold after this step
        self._unconfirmed: dict[str, int] = {}
        self._step = HistoryStep()

    def window_start(self, num_tokens: int) -> int:
        """Blocks of a request with ``num_tokens`` computed tokens that left its window."""
        if num_tokens < self.min_tokens:
            return 0
        return max(0, num_tokens - self.window) // self.block_size

    def held(self, req_id: str) -> int:
        """Leading blocks of the request that vLLM may have freed: kvreel holds them."""
        return LEDGER.held(req_id)

    # -- admission ---------------------------------------------------------------------
    def admission_skip(self, req_id: str, total_tokens: int, held_prefix_blocks: int) -> int:
        """Blocks of a newly admitted request that come straight into its history
        from kvreel's tiers (vLLM allocates none of them): kvreel holds them from
        block 0 and they are outside the window of the admitted prefix."""
        self.forget(req_id)
        skip = min(held_prefix_blocks, self.window_start(total_tokens))
        LEDGER.hold(req_id, skip)
        return skip

    def admitted(self, req_id: str, skip: int) -> None:
        if skip:
            self.planned[req_id] = skip

    # -- per step ----------------------------------------------------------------------------
    def plan(self, req_id: str, computed_after: int, block_ids: list[int], prompt_tokens: int = 0,
             max_tokens: int = 0) -> None:
        """A scheduled request (of ``prompt_tokens``, answering at most ``max_tokens``):
        the blocks that leave its window in this step join its history. Its history
        is expected to reach the prompt and the answer, the answer counted up to a
        quarter of the prompt (``room_tokens``); once it decodes, one whose answer
        may be longer grows its layers' rooms ahead of need, one at a time."""
        have = self.planned.get(req_id, 0)
        if have:
            newest = (computed_after - 1) // self.block_size
            if newest < len(block_ids):
                self._step.rows[block_ids[newest]] = req_id
        target = min(self.window_start(computed_after), len(block_ids))
        if target > have:
            room, most = room_tokens(prompt_tokens, max_tokens), prompt_tokens + max(max_tokens, 0)
            outgrows = computed_after > prompt_tokens and most > room
            self._step.appends.append(HistoryAppend(req_id, have, list(block_ids[have:target]),
                                                    self.window_start(room),
                                                    self.window_start(most) if outgrows else 0,
                                                    self.window_start(most)))
            self.planned[req_id] = target
            self._unconfirmed[req_id] = target

    def take_step(self) -> HistoryStep:
        step, self._step = self._step, HistoryStep()
        return step

    def confirm(self) -> None:
        """The step's output arrived: its appends happened, vLLM may free those blocks."""
        for req_id, blocks in self._unconfirmed.items():
            if req_id in self.planned:
                LEDGER.hold(req_id, blocks)
        self._unconfirmed.clear()

    def forget(self, req_id: str) -> None:
        """The request finished, or is admitted anew (after a preemption): its history goes."""
        if self.planned.pop(req_id, None) is not None:
            self._step.dropped.append(req_id)
        self._unconfirmed.pop(req_id, None)
        LEDGER.release(req_id)
