"""KV -> frame layouts.

``naive``: each (layer, K/V, byte plane) matrix [tokens, heads*head_dim] is cut
into frames of ``resolution`` token rows; three layers share a frame as its
three 4:4:4 planes. The baseline.

``tiled`` (KVFetcher's codec-friendly layout): slice along tokens. One token's
[heads, head_dim] matrix becomes a tile; a frame is a grid of tiles, and tile
position p of frame f holds token p*F + f, so consecutive tokens sit at the same
place in consecutive frames (inter-frame prediction sees them). Three layers are
the three planes. The tile shape is searched under the paper's rules (never mix
heads, keep element order inside a head, keep head order): heads on an
``head_rows x H/head_rows`` grid, each head folded row-major into
``fold x D/fold`` — O(log H x log D) candidates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Tiling:
    head_rows: int     # heads arranged head_rows x (H / head_rows), in order
    fold: int          # each head folded to fold x (D / fold), element order kept

    def tile_shape(self, H: int, D: int) -> tuple[int, int]:
        return self.head_rows * self.fold, (H // self.head_rows) * (D // self.fold)

    def to_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H, D] -> [..., th, tw]"""
        *lead, H, D = x.shape
        hc = H // self.head_rows
        y = x.reshape(*lead, self.head_rows, hc, self.fold, D // self.fold)
        y = y.transpose(-3, -2)
        return y.reshape(*lead, self.head_rows * self.fold, hc * (D // self.fold))

    def from_tiles(self, t: torch.Tensor, H: int, D: int) -> torch.Tensor:
        """[..., th, tw] -> [..., H, D]"""
        *lead, _, _ = t.shape
        hc = H // self.head_rows
        y = t.reshape(*lead, self.head_rows, self.fold, hc, D // self.fold).transpose(-3, -2)
        return y.reshape(*lead, H, D)

    def as_dict(self) -> dict:
        return asdict(self)


def _pow2_divisors(n: int) -> list[int]:
    return [d for d in (1 << i for i in range(int(math.log2(n)) + 1)) if n % d == 0]


def candidate_tilings(H: int, D: int) -> list[Tiling]:
    """O(log H x log D) tilings that obey the rules; squarish tiles first."""
    cands = [Tiling(r, f) for r in _pow2_divisors(H) for f in _pow2_divisors(D)]
    return sorted(cands, key=lambda t: abs(math.log2(t.tile_shape(H, D)[0] / t.tile_shape(H, D)[1])))


@dataclass(frozen=True)
class FrameGeometry:
    """Where the tokens of one (layer triplet, K/V, byte plane) stream land."""
    layout: str
    width: int
    height: int
    frames: int                 # frames per stream
    tiles_per_row: int = 0
    tile_rows: int = 0
    tile_h: int = 0
    tile_w: int = 0

    @property
    def tiles_per_frame(self) -> int:
        return self.tiles_per_row * self.tile_rows


NVDEC_MIN_SIDE = 144   # smallest frame NVDEC decodes; smaller frames are padded (zeros cost ~nothing)


def _align(n: int, a: int = 8) -> int:
    return max(NVDEC_MIN_SIDE, -(-n // a) * a)


def geometry(layout: str, resolution: int, T: int, H: int, D: int, tiling: Tiling | None) -> FrameGeometry:
    """Frames of about ``resolution`` x ``resolution`` samples (multiples of 8,
    shrunk when the chunk cannot fill one)."""
    if layout == "naive":
        rows = min(resolution, T)
        return FrameGeometry("naive", _align(H * D), _align(rows), -(-T // rows), tile_rows=rows)
    th, tw = tiling.tile_shape(H, D)
    per_row = max(1, resolution // tw)
    rows = max(1, resolution // th)
    per_row = min(per_row, T)
    rows = min(rows, -(-T // per_row))
    frames = -(-T // (per_row * rows))
    return FrameGeometry("tiled", _align(per_row * tw), _align(rows * th), frames, per_row, rows, th, tw)


def stream_frames(samples: torch.Tensor, geo: FrameGeometry, tiling: Tiling | None) -> torch.Tensor:
    """One stream's samples [T, H, D] (uint8) -> frames [F, height, width]."""
    T, H, D = samples.shape
    out = torch.zeros((geo.frames, geo.height, geo.width), dtype=torch.uint8)
    if geo.layout == "naive":
        rows = geo.tile_rows
        padded = torch.zeros((geo.frames * rows, H * D), dtype=torch.uint8)
        padded[:T] = samples.reshape(T, H * D)
        out[:, :rows, : H * D] = padded.view(geo.frames, rows, H * D)
        return out
    P, F = geo.tiles_per_frame, geo.frames
    padded = torch.zeros((P * F, H, D), dtype=torch.uint8)
    padded[:T] = samples
    tiles = tiling.to_tiles(padded)                                 # [P*F, th, tw], token = p*F + f
    tiles = tiles.view(P, F, geo.tile_h, geo.tile_w).transpose(0, 1)  # [F, P, th, tw]
    grid = tiles.reshape(F, geo.tile_rows, geo.tiles_per_row, geo.tile_h, geo.tile_w).transpose(2, 3)
    out[:, : geo.tile_rows * geo.tile_h, : geo.tiles_per_row * geo.tile_w] = \
        grid.reshape(F, geo.tile_rows * geo.tile_h, geo.tiles_per_row * geo.tile_w)
    return out


def frame_tokens(plane: torch.Tensor, f: int, geo: FrameGeometry, tiling: Tiling | None, T: int, H: int,
                 D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Frame ``f`` of a stream (one plane, [height, width]) -> (token indices, values [n, H, D])."""
    if geo.layout == "naive":
        tokens = torch.arange(f * geo.tile_rows, min(T, (f + 1) * geo.tile_rows))
        return tokens, plane[: len(tokens), : H * D].reshape(len(tokens), H, D)
    P, F = geo.tiles_per_frame, geo.frames
    grid = plane[: geo.tile_rows * geo.tile_h, : geo.tiles_per_row * geo.tile_w]
    tiles = grid.reshape(geo.tile_rows, geo.tile_h, geo.tiles_per_row, geo.tile_w).transpose(1, 2)
    tiles = tiles.reshape(P, geo.tile_h, geo.tile_w)
    tokens = torch.arange(P) * F + f
    keep = tokens < T
    return tokens[keep], tiling.from_tiles(tiles[keep], H, D)
