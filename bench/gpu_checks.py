"""GPU-machine checks and benchmarks (plain torch, no vLLM):

1. NVDEC decode of kvreel containers is bit-identical to the KV they were
   encoded from (which PyAV's decode also reproduced at encode time), and its
   throughput per resolution, alone and with concurrent decoders.
2. The connector's host<->device copy path (PagedRegions) vs a raw pinned
   ``copy_`` of the same bytes, for a contiguous chunk and for scattered blocks.

    python bench/gpu_checks.py --data .gpu_data --out results_dir
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import commit, machine  # noqa: E402


def nvdec_checks(data_dir: Path) -> dict:
    """Per resolution: exactness, one decoder's rate, and a DecoderPool's rate with
    1..8 workers on 16 chunks, NVDEC vs PyAV (when carried) on the same streams."""
    from kvreel.codec import decode_chunk, read_header
    from kvreel.scheduler.decoder_pool import DecoderPool
    import PyNvVideoCodec as nvc
    ref = torch.load(data_dir / "kv_2048.pt")
    out = {}
    t0 = time.perf_counter()
    nvc.CreateDecoder(gpuid=0, codec=nvc.cudaVideoCodec.HEVC, usedevicememory=True,
                      outputColorType=nvc.OutputColorType.NATIVE)
    out["decoder_create_s"] = round(time.perf_counter() - t0, 4)
    try:
        import av  # noqa: F401
        backends = ("nvdec", "cpu")
    except ImportError:
        backends = ("nvdec",)
    for path in sorted(data_dir.glob("*.kvrc")):
        blob = path.read_bytes()
        header = read_header(blob)
        geo = header.streams[0].geometry
        frames = len(header.streams[0].frame_sums)
        samples = frames * 3 * geo["width"] * geo["height"]
        kv = decode_chunk(blob, device="cuda", decoder="nvdec")
        torch.cuda.synchronize()
        row = {"resolution": header.streams[0].resolution, "frame": [geo["width"], geo["height"]],
               "frames": frames, "bit_exact_vs_source": torch.equal(kv.cpu().view(torch.uint8), ref.view(torch.uint8)),
               "kv_bytes": ref.numel() * 2, "container_bytes": len(blob)}
        for backend in backends:
            device = "cuda" if backend == "nvdec" else "cpu"
            for workers in (1, 2, 4, 8):
                with DecoderPool(workers, device=device, decoder=backend) as pool:
                    pool.submit(blob).result()
                    torch.cuda.synchronize(); t0 = time.perf_counter()
                    futs = [pool.submit(blob) for _ in range(16)]
                    for f in futs:
                        f.result()
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                row[f"{backend}_{workers}w_GB_kv_per_s"] = round(16 * ref.numel() * 2 / dt / 1e9, 4)
                row[f"{backend}_{workers}w_Gsamples_per_s"] = round(16 * samples / dt / 1e9, 4)
        out[path.name] = row
    return out


def copy_bench() -> dict:
    from kvreel.connector.block_copy import PagedRegions
    num_blocks, page = 4096, 64 * 1024           # 16 layers x 256 MiB
    layers = 16
    cache = torch.empty((layers, num_blocks, page), dtype=torch.uint8, device="cuda")
    cache.random_(0, 255)
    placement = SimpleNamespace(layers=[f"l{i}" for i in range(layers)], layer_stride=num_blocks * page,
                                block_stride=page, offset=0)
    cfg = SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[placement],
                          kv_cache_groups=[SimpleNamespace(layer_names=placement.layers)])
    kv_caches = {f"l{i}": cache[i] for i in range(layers)}
    pr = PagedRegions(kv_caches, cfg)
    res = {}
    for label, ids in (("chunk (64 consecutive blocks)", list(range(100, 164))),
                       ("scattered (64 random blocks)", torch.randperm(num_blocks)[:64].tolist())):
        nbytes = len(ids) * layers * page
        host = pr.gather((ids,))
        back_ids = [i + 2000 if i + 2000 < num_blocks else i - 2000 for i in ids]
        pr.scatter(host, (back_ids,))
        ok = all(torch.equal(cache[:, b], cache[:, a]) for a, b in zip(ids[:8], back_ids[:8]))
        t = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); pr.gather((ids,)); t.append(time.perf_counter() - t0)
        d2h = nbytes / min(t) / 1e9
        t = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); pr.scatter(host, (back_ids,)); torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        h2d = nbytes / min(t) / 1e9
        # raw baseline: one pinned copy_ of the same number of bytes, contiguous on both sides
        src = cache[0, : len(ids) * layers].clone()
        pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
        t = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); pinned.copy_(src, non_blocking=True)
            torch.cuda.synchronize(); t.append(time.perf_counter() - t0)
        raw_d2h = nbytes / min(t) / 1e9
        t = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); src.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize(); t.append(time.perf_counter() - t0)
        raw_h2d = nbytes / min(t) / 1e9
        res[label] = {"bytes": nbytes, "round_trip_exact": ok, "kvreel_d2h_GBps": round(d2h, 2),
                      "raw_pinned_d2h_GBps": round(raw_d2h, 2), "kvreel_h2d_GBps": round(h2d, 2),
                      "raw_pinned_h2d_GBps": round(raw_h2d, 2),
                      "d2h_fraction_of_raw": round(d2h / raw_d2h, 3), "h2d_fraction_of_raw": round(h2d / raw_h2d, 3)}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".gpu_data")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--commit", help="the commit the copied tree is at, where it has no git history")
    a = ap.parse_args()
    result = {"benchmark": "gpu_checks", "commit": a.commit or commit(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}
    try:
        result["copy_path"] = copy_bench()
    except Exception as e:  # report and keep going: one broken check must not hide the others
        result["copy_path_error"] = repr(e)
    try:
        result["nvdec"] = nvdec_checks(Path(a.data))
    except Exception:
        import traceback
        result["nvdec_error"] = traceback.format_exc()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_checks.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
