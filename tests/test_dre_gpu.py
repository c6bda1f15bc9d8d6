"""The DRE's torch path on a GPU (GPU machine): tables and scoring on CUDA
answer as the CPU service does, for a clustered and then extended table."""

import pytest
import torch

from kvreel.connector.retrieval.dre_service import DREService

pytestmark = pytest.mark.gpu


def _ask(service: DREService, keys: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    service.handle({"op": "cluster", "handle": "a", "keys": keys[:, :448]})
    labels = service.handle({"op": "extend", "handle": "a", "keys": keys[:, 448:]})["labels"]
    mass = service.handle({"op": "mass", "handle": "a", "queries": queries, "alpha": 0.9})["mass"]
    return labels.cpu(), mass.cpu()


def test_cuda_service_predicts_what_the_cpu_service_predicts():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(2, 16, 64, generator=g) * 2
    keys = torch.gather(centres, 1, torch.randint(0, 16, (2, 640, 1), generator=g).expand(2, 640, 64))
    keys = keys + 0.5 * torch.randn(2, 640, 64, generator=g)
    queries = keys[:, :96] + 0.3 * torch.randn(2, 96, 64, generator=g)
    cpu_labels, cpu_mass = _ask(DREService(device="cpu"), keys, queries)
    gpu_labels, gpu_mass = _ask(DREService(device="cuda"), keys, queries)
    assert torch.equal(cpu_labels, gpu_labels)
    assert cpu_mass.shape == (2, 640) and torch.allclose(cpu_mass, gpu_mass, rtol=1e-4, atol=1e-6)
