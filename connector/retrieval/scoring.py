"""What every retrieval choice scores with: the dtype keys are scored in, row
gathers, reused scratch memory, and how many query rows are scored together."""

from __future__ import annotations

import functools

import torch

ROWS_AT_ONCE = 32            # query rows scored together (a block of scores stays in the CPU's cache)


@functools.cache
def _native_half_products() -> bool:
    """Whether this CPU multiplies 16-bit floats in hardware (AVX512-BF16 or AMX);
    torch's probes are private, so a torch without them counts as without."""
    probes = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(probe() for probe in probes if probe is not None)


def scoring_dtype(dtype: torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """The dtype keys of ``dtype`` are scored in: float32 for 16-bit keys on a CPU
    without 16-bit products, where torch's bf16 products run 10-20x slower than
    converting the keys and multiplying in float32 (a 512-row chunk over 16 K
    keys on an AVX2 core: 0.12 s a head pair in bf16, 9 ms converting first);
    a float32 score is no worse."""
    if dtype in (torch.bfloat16, torch.float16) and device_type == "cpu" and not _native_half_products():
        return torch.float32
    return dtype


def rows_of(x: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x[h, index[h]]`` for every head: ``[H, n, D]`` from ``x`` ``[H, T, D]`` and
    ``index`` ``[H, n]`` (into ``out`` where given). Row copies (``index_select``)
    rather than ``torch.gather`` with an expanded index, which on CPU copies
    element by element: 25x slower for 16 K keys of 64 channels on this
    machine, and most of a decode step."""
    if out is None:
        out = torch.empty(*index.shape, x.shape[2], dtype=x.dtype, device=x.device)
    for h in range(x.shape[0]):
        torch.index_select(x[h], 0, index[h], out=out[h])          # in place: no second copy to stack them
    return out


def block_tokens(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The token ids ``[H, n bs]`` of blocks ``[H, n]``, each block's in order."""
    return (blocks.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(1)


class Scratch:
    """Memory reused by every layer and step for a step's temporaries, by name:
    a large allocation per call can be fresh memory to fault in, wherever the
    allocator hands it back to the system (glibc past its mmap threshold): there
    a decoding step's choice at 16 K tokens took twice as long, and a prefill
    chunk's passes three times. A region grows to exactly what is asked (so a
    caller's bound on what it asks bounds the memory)."""

    def __init__(self):
        self._flat: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` (flat) for ``name``, overwriting what it
        was last given."""
        flat = self._flat.get(name)
        if flat is None or flat.numel() < numel or flat.dtype != dtype:
            flat = self._flat[name] = torch.empty(numel, dtype=dtype)
        return flat[:numel]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._flat.values())
