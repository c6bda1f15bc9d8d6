"""GPU-machine checks and benchmarks (plain torch, no vLLM):

1. NVDEC decode of kvreel containers is bit-identical to the KV they were
   encoded from (which PyAV's decode also reproduced at encode time), and its
   throughput per resolution, alone and with concurrent decoders.
2. The connector's host<->device copy path (PagedRegions) vs a raw pinned
   ``copy_`` of the same bytes, for a contiguous chunk and for scattered blocks.
3. The GPU-marked tests (``pytest -m gpu tests``), each test's outcome recorded
   (``gpu_tests``), so README can say when they last ran and how.

The KV comes from a trained model, captured on any machine with the model
(``--capture MODEL``); the containers are encoded from it with libx265 where
they are missing (on the GPU machine: the same encode the connector does):

    python bench/gpu_checks.py --capture ../shared/models/tinycode-16m-4k --data .gpu_data
    python bench/gpu_checks.py --data .gpu_data --out results_dir
    python bench/gpu_checks.py --out results_dir --replot     # the PNG again, from the JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import commit, machine, save_figure  # noqa: E402

MEASURES = ("codec", "connector")  # the package paths its figures measure (bench/report.py)


def nvdec_checks(data_dir: Path) -> dict:
    """Per resolution: exactness, one decoder's rate, and a DecoderPool's rate with
    1..8 workers on 16 chunks, NVDEC vs PyAV (when carried) on the same streams."""
    from kvreel.codec import decode_chunk, read_header
    from kvreel.connector.worker_side.fetch.decoder_pool import DecoderPool
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


RESOLUTIONS = (256, 512)


def capture_kv(model: str, data_dir: Path) -> None:
    from kv_capture import capture
    kv, _ = capture(model, 2048)
    data_dir.mkdir(parents=True, exist_ok=True)
    torch.save(kv, data_dir / "kv_2048.pt")
    (data_dir / "kv_2048.json").write_text(json.dumps({"model": Path(model).name, "tokens": 2048}))


def kv_source(data_dir: Path) -> dict | None:
    """Which model and how many tokens kv_2048.pt holds (written by --capture)."""
    path = data_dir / "kv_2048.json"
    return json.loads(path.read_text()) if path.exists() else None


def encode_missing(data_dir: Path) -> dict:
    """Encode kv_2048.pt at each resolution with libx265 (bit-exact quantizer),
    where the container is not there yet; returns the encode times."""
    from kvreel.codec import encode_chunk
    kv = torch.load(data_dir / "kv_2048.pt")
    times = {}
    for r in RESOLUTIONS:
        path = data_dir / f"kv_2048_r{r}.kvrc"
        if not path.exists():
            t0 = time.perf_counter()
            path.write_bytes(encode_chunk(kv, quant="none", resolutions=(r,), encoder="cpu"))
            times[path.name] = round(time.perf_counter() - t0, 2)
    return times


def copy_bench() -> dict:
    from kvreel.connector.worker_side.block_copy import PagedRegions
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
    # each case reads blocks ``ids`` and writes them back to ``back_ids``, which are disjoint from ``ids``:
    # the scatter overwrites none of the blocks it is compared with
    scattered = torch.randperm(num_blocks)[:128].tolist()
    for label, ids, back_ids in (("chunk (64 consecutive blocks)", list(range(100, 164)), list(range(2100, 2164))),
                                 ("scattered (64 random blocks)", scattered[:64], scattered[64:])):
        nbytes = len(ids) * layers * page
        host = pr.gather((ids,))
        pr.scatter(host, (back_ids,))
        torch.cuda.synchronize()
        ok = torch.equal(cache[:, back_ids], cache[:, ids])
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


def selection_bench() -> dict:
    """kvreel's per-step token choice (``select_tokens``, 1/8 of the history,
    alpha 0.9) on the GPU, against the baseline it replaces: full attention of
    the same queries over the whole history (SDPA). One layer shaped like a
    Llama-3-8B (8 KV heads, 4 query heads each, head_dim 128), bf16, random
    keys (the cost depends on sizes, not contents); a decode step (1 query
    row), a prefill chunk (512 rows) as one group, and the same chunk in the
    served default's groups (``KVREEL_RETRIEVAL_ROWS_PER_SET``). Median of 20
    after 3 warm-ups."""
    from kvreel.connector.config import SETTINGS_BY_NAME
    from kvreel.connector.retrieval.selection import select_in_groups, select_tokens
    group_rows = SETTINGS_BY_NAME["RETRIEVAL_ROWS_PER_SET"].default
    H, G, D = 8, 4, 128
    out = {}

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        t = []
        for _ in range(20):
            torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
            t.append(time.perf_counter() - t0)
        return sorted(t)[len(t) // 2] * 1e3

    for tokens in (8192, 32768, 131072):
        keys = torch.randn(H, tokens, D, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        for rows in (1, 512):
            q = torch.randn(H, G * rows, D, device="cuda", dtype=torch.bfloat16)
            sel = timed(lambda: select_tokens(q, keys, 0.9, tokens // 8, 128))
            full = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                q.view(H, G, rows, D).transpose(0, 1), keys.unsqueeze(0).expand(G, -1, -1, -1),
                values.unsqueeze(0).expand(G, -1, -1, -1)))
            out[f"{tokens}_tokens_{rows}_rows"] = {"select_ms": round(sel, 3), "full_attention_ms": round(full, 3)}
            if rows > group_rows:
                # a group is ``group_rows`` query tokens, so G rows per token per KV head
                grouped = timed(lambda: select_in_groups(q, keys, 0.9, tokens // 8, 128, G * group_rows))
                out[f"{tokens}_tokens_{rows}_rows"][f"select_in_groups_of_{group_rows}_tokens_ms"] = round(grouped, 3)
    return out


def one_run(data_dir: Path) -> dict:
    """Every check once; a broken check is reported and the others still run."""
    out = {}
    for name, check in (("copy_path", copy_bench), ("selection", selection_bench),
                        ("nvdec", lambda: nvdec_checks(data_dir))):
        try:
            out[name] = check()
        except Exception:
            import traceback
            out[f"{name}_error"] = traceback.format_exc()
    return out


def gpu_test_outcomes(*pytest_args: str) -> dict:
    """Run pytest (``-m gpu tests`` by default) in a subprocess and return each
    test's outcome, read from its JUnit XML (pytest's own report, not its
    console): ``{"tests": {id: "passed" | "failed" | "skipped"}, "messages":
    {id: why}, "exit_code": n}``."""
    import subprocess
    import tempfile
    import xml.etree.ElementTree as ET
    root = Path(__file__).parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "gpu_tests.xml"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                               *(pytest_args or ("-m", "gpu", "tests"))], cwd=root, capture_output=True, text=True)
        cases = ET.parse(xml).getroot().iter("testcase") if xml.exists() else []
        tests, messages = {}, {}
        for case in cases:
            test = f"{case.get('classname')}::{case.get('name')}"
            problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            tests[test] = "passed" if problem is None else "skipped" if problem.tag == "skipped" else "failed"
            if problem is not None:
                messages[test] = (problem.get("message") or "")[:300]
    return {"tests": tests, "messages": messages, "exit_code": done.returncode}


def median_of(runs: list):
    """The runs' median per number, and whether every run held a flag."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs if k in r]) for k in first}
    if isinstance(first, bool):
        return all(runs)
    if isinstance(first, (int, float)):
        return statistics.median(runs)
    return first


def plot(result: dict, out_dir: Path) -> Path:
    """Copy path (kvreel vs a raw pinned copy) and decode rate by workers (NVDEC vs
    PyAV), medians with every run's min-max, titled with the machine and the KV."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [r for r in result["runs"] if "copy_path" in r and "nvdec" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))

    def spread(values):
        """The median and its distances down to the smallest and up to the largest run."""
        m = statistics.median(values)
        return m, m - min(values), max(values) - m

    cases = list(runs[0]["copy_path"])
    labels, x = [], 0
    for case in cases:
        for direction in ("d2h", "h2d"):
            for who, color in (("kvreel", "tab:blue"), ("raw_pinned", "tab:grey")):
                m, down, up = spread([r["copy_path"][case][f"{who}_{direction}_GBps"] for r in runs])
                ax1.bar(x, m, yerr=[[down], [up]], color=color, capsize=3, label=who.replace("_", " ") if x < 2 else None)
                x += 1
            labels.append(f"{case.split(' ')[0]}\n{direction}")
            x += 0.6
    ax1.set_xticks([i * 2.6 + 0.5 for i in range(len(labels))], labels, fontsize=8)
    ax1.set_ylabel("GB/s (64 blocks, 64 MiB)")
    ax1.set_title("connector copy path", fontsize=9)
    ax1.legend(fontsize=8)
    workers = (1, 2, 4, 8)
    for name in sorted(k for k in runs[0]["nvdec"] if k.endswith(".kvrc")):
        res = runs[0]["nvdec"][name]["resolution"]
        for backend, style in (("nvdec", "-"), ("cpu", "--")):
            key = f"{backend}_{{}}w_GB_kv_per_s"
            if key.format(1) not in runs[0]["nvdec"][name]:
                continue
            meds, downs, ups = zip(*(spread([r["nvdec"][name][key.format(w)] for r in runs]) for w in workers))
            ax2.errorbar(workers, meds, yerr=[downs, ups], ls=style, marker="o",
                         capsize=3, label=f"{'NVDEC' if backend == 'nvdec' else 'PyAV (CPU)'}, {res}x{res} frames")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(workers, [str(w) for w in workers])
    ax2.set_xlabel("DecoderPool workers (16 chunks)")
    ax2.set_ylabel("GB of KV decoded per s")
    ax2.set_title("bit-exact decode of kvreel containers", fontsize=9)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    m = result["machine"]
    kv = result.get("kv_source")
    what = f"KV of {kv['model']} ({kv['tokens']} tokens)" if kv else "KV of a trained model"
    fig.suptitle(f"GPU checks — {m.get('gpu')}, torch {m.get('torch')}, {what}, commit {result['commit'][:7]}; "
                 f"median of {len(runs)} runs, bars = min-max", fontsize=9)
    return save_figure(fig, "gpu_checks", folder=out_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".gpu_data")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--commit", help="the commit the copied tree is at, where it has no git history")
    ap.add_argument("--runs", type=int, default=3, help="whole runs; the JSON holds each and their median")
    ap.add_argument("--capture", metavar="MODEL", help="only capture kv_2048.pt from MODEL into --data")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from --out's gpu_checks.json")
    a = ap.parse_args()
    if a.capture:
        capture_kv(a.capture, Path(a.data))
        return
    if a.replot:
        print(plot(json.loads((Path(a.out) / "gpu_checks.json").read_text()), Path(a.out)))
        return
    result = {"benchmark": "gpu_checks", "commit": a.commit or commit(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "kv_source": kv_source(Path(a.data)), "libx265_encode_s": encode_missing(Path(a.data)),
              "runs": [one_run(Path(a.data)) for _ in range(a.runs)], "gpu_tests": gpu_test_outcomes()}
    result["median"] = median_of(result["runs"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_checks.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(plot(result, Path(a.out)))


if __name__ == "__main__":
    main()
