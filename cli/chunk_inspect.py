"""``kvreel inspect``: what a stored chunk holds (model, tokens, dtype, form),
or which models a disk tier holds, read from headers only."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _identity_description(root: Path, identity: str) -> dict:
    from kvreel.codec.formats import identity_description_path
    try:
        return json.loads(identity_description_path(root, identity).read_text())
    except (OSError, ValueError):
        return {}


def _describe_chunk_file(path: Path) -> dict:
    """A disk-tier chunk file (``<root>/<identity>/rank<r>/xx/<key>.kvr``) or a
    remote raw form saved to a file: its header, and the model it belongs to
    where the directory's identity.json says."""
    from kvreel.codec.formats import read_chunk_header
    with open(path, "rb") as f:
        header = read_chunk_header(f, None)
    about = _identity_description(path.parents[3], header.identity) if len(path.parents) > 3 else {}
    block = about.get("block_size")
    return {"container": "chunk file", "form": "raw (exact, as the engine laid it out)",
            "model": about.get("model", "unknown (no identity.json beside the chunk)"),
            "dtype": about.get("dtype"), "kv_cache_dtype": about.get("kv_cache_dtype"),
            "tokens": len(header.block_hashes) * block if block else None,
            "blocks": len(header.block_hashes), "identity": header.identity, "bytes": path.stat().st_size,
            "first_block": header.block_hashes[0].hex(), "last_block": header.block_hashes[-1].hex(),
            "payload_shape": header.shape, "payload_crc32": header.payload_crc}


def _describe_video_chunk(data: bytes) -> dict:
    from kvreel.codec.container import unpack_header
    header, _ = unpack_header(data)
    return {"container": "codec", "form": "video (lossless HEVC)" if header.quant == "none" else
            f"video ({header.quant}-quantized, lossy)",
            "model": header.model, "tokens": header.shape[1], "dtype": header.dtype,
            "shape[L,T,H,D]": header.shape, "quant": header.quant, "layout": header.layout,
            "tiling": header.tiling, "token_start": header.token_start, "block_size": header.block_size,
            "resolutions": [{"resolution": s.resolution, "bytes": s.bitstream.length, "frames": len(s.frame_sums),
                             "frame": [s.geometry["width"], s.geometry["height"]]} for s in header.streams]}


def _describe_disk_dir(root: Path) -> dict:
    """Every model identity under a KVREEL_DISK_DIR: model, chunks, tokens and bytes."""
    from kvreel.connector.config import format_bytes
    out = {}
    for ident in sorted(p for p in root.iterdir() if p.is_dir()):
        files = list(ident.glob("rank*/*/*.kvr"))
        if not files:
            continue
        about = _identity_description(root, ident.name)
        size = sum(f.stat().st_size for f in files)
        out[ident.name] = {"model": about.get("model", "unknown (no identity.json)"), "dtype": about.get("dtype"),
                           "chunks": len(files), "bytes": size, "size": format_bytes(size)}
    return {"disk tier": str(root), "identities": out}


def cmd_inspect(args) -> int:
    """``kvreel inspect PATH``: a chunk's or a disk tier's description as JSON."""
    from kvreel.codec.formats import CHUNK_FILE, VIDEO, ChunkError, sniff
    path = Path(args.path)
    try:
        if path.is_dir():
            print(json.dumps(_describe_disk_dir(path), indent=2))
            return 0
        with open(path, "rb") as f:
            fmt = sniff(f.read(4))
        if fmt is CHUNK_FILE:
            info = _describe_chunk_file(path)
        elif fmt is VIDEO:
            info = _describe_video_chunk(path.read_bytes())
        elif fmt is not None:
            raise ChunkError(f"a kvreel {fmt.what}, not a chunk")
        else:
            raise ChunkError("not a kvreel chunk file (no kvreel format starts this way)")
    except (ChunkError, OSError) as e:
        print(f"{args.chunk}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2))
    return 0
