#!/usr/bin/env python3
"""Write a random-weight fp32 GGUF with the shape of a real model, for speed and memory measurements where the
real file cannot go (a GPU machine with no network, say). Quantize it with llama-quantize to the real file's type.

Speed and KV memory depend on the shapes and the tensor types, not on the weights' values, so a benchmark on it
measures what the real model would cost; quality (the text, which tokens a pattern keeps) means nothing on it.
The vocabulary is the tests' byte-fallback SentencePiece one, padded to the real vocabulary size.

    python scripts/random_model.py --like qwen2.5-coder-0.5b --out /tmp/qwen-shape-f32.gguf
    llama-quantize /tmp/qwen-shape-f32.gguf /tmp/qwen-shape-q4_k_m.gguf Q4_K_M
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_models import TinyConfig, random_qwen2_weights, write_qwen2_gguf  # noqa: E402

SHAPES = {
    # Qwen2.5-Coder-0.5B-Instruct, the default model (config.json of the HF checkpoint)
    "qwen2.5-coder-0.5b": TinyConfig(n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864, n_vocab=151936,
                                     n_ctx_train=32768, rope_theta=1000000.0, rms_eps=1e-6),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", choices=sorted(SHAPES), default="qwen2.5-coder-0.5b")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"random_model: {args.out} exists; not overwriting it")
    cfg = SHAPES[args.like]
    write_qwen2_gguf(args.out, random_qwen2_weights(cfg, args.seed), cfg, name=f"random-{args.like}")
    print(f"random_model: wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB, shape of {args.like})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
