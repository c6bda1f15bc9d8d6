"""Per-chunk choice of what to fetch (KVFetcher Alg. 1, plus format adaptation).

Before each chunk: the bandwidth is estimated from the chunks already fetched
(a slower transfer at once, a faster one through an EWMA), each candidate form of the chunk (a video resolution,
or the raw/zstd bytes) gets a transmission time (size / bandwidth) and a decode
time (measured profile x current decoder load), switching resolution costs a
penalty (a new decoder configuration), and the candidate with the smallest
pipelined time max(transmit, decode) + penalty wins. A raw form has a decode
time of a memcpy, so when the link outruns the decoders kvreel fetches raw and
is never slower than a raw fetch.
"""

from __future__ import annotations

from dataclasses import dataclass


class BandwidthEstimator:
    """Transfer rate (bytes/second) from observed transfers: a slower one is
    believed at once, a faster one approached through an EWMA. Overestimating
    the link sends a large form over a slow link (the whole fetch waits for
    it), underestimating only picks a smaller form whose decode the pipeline
    mostly hides; so, as throughput-based video players do, the estimate
    falls fast and rises slowly. Before this, an EWMA alone kept raw chunks
    flowing for a dozen transfers after the link slowed down."""

    def __init__(self, initial_Bps: float, alpha: float = 0.5):
        if initial_Bps <= 0 or not 0 < alpha <= 1:
            raise ValueError("initial_Bps must be > 0 and 0 < alpha <= 1")
        self.Bps = float(initial_Bps)
        self.alpha = alpha

    def observe(self, nbytes: int, seconds: float) -> float:
        if nbytes > 0 and seconds > 0:
            rate = nbytes / seconds
            self.Bps = rate if rate < self.Bps else (1 - self.alpha) * self.Bps + self.alpha * rate
        return self.Bps


@dataclass(frozen=True)
class Candidate:
    name: str            # e.g. "video@512" or "raw"
    nbytes: int          # bytes on the wire
    decode_s: float      # measured decode time with an idle decoder


def choose(candidates: list[Candidate], bandwidth_Bps: float, *, decoder_load: float = 0.0,
           previous: str | None = None, switch_penalty_s: float = 0.0) -> tuple[Candidate, dict[str, float]]:
    """The candidate with the smallest pipelined time; also every candidate's cost.

    ``decoder_load``: chunks already queued per decoder (DecoderPool.load); a
    busy decoder makes decoding proportionally slower."""
    if not candidates:
        raise ValueError("no candidates")
    costs = {}
    for c in candidates:
        transmit = c.nbytes / bandwidth_Bps
        decode = c.decode_s * (1.0 + decoder_load)
        penalty = switch_penalty_s if previous is not None and c.name != previous else 0.0
        costs[c.name] = max(transmit, decode) + penalty
    best = min(candidates, key=lambda c: (costs[c.name], c.nbytes))
    return best, costs
