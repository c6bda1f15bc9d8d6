"""The DRE's torch path on a GPU (GPU machine): tables and WiCSum scoring on
CUDA answer as the CPU service does, for a clustered and an extended table."""

import pytest
import torch

from kvreel.connector.retrieval.dre_service import DREService, put_tensor, take_tensor

pytestmark = pytest.mark.gpu


def _ask(service: DREService, keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    service.handle({"op": "cluster", "handle": "a", "keys": put_tensor(keys[:, :448])})
    service.handle({"op": "extend", "handle": "b", "base": "a", "keys": put_tensor(keys[:, 448:])})
    tokens = take_tensor(service.handle({"op": "select", "handle": "b", "queries": put_tensor(queries),
                                         "alpha": 0.9, "per_frame": True})["tokens"])
    pages = take_tensor(service.handle({"op": "select", "handle": "b", "queries": put_tensor(queries),
                                        "alpha": 0.9, "per_frame": True, "block": 32})["tokens"])
    return tokens, pages


def test_cuda_service_selects_what_the_cpu_service_selects():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 16, 64, generator=g) * 2
    keys = torch.gather(centres, 1, torch.randint(0, 16, (2, 640, 1), generator=g).expand(2, 640, 64))
    keys = keys + 0.5 * torch.randn(2, 640, 64, generator=g)
    queries = keys[:, :96] + 0.3 * torch.randn(2, 96, 64, generator=g)
    on_cpu = _ask(DREService(device="cpu"), keys, queries)
    on_gpu = _ask(DREService(device="cuda"), keys, queries)
    for cpu, gpu in zip(on_cpu, on_gpu):
        assert 0 < len(cpu) < 640
        assert torch.equal(cpu, gpu)
