"""How much a sliding-window model's logits move with the cache layout, and with rounding alone.

Gemma-3's sliding-window layers can be cached two ways in stock llama.cpp: a full-size cache of n_ctx cells with the
window as a mask (`swa_full`, the C API's default and llama-cpp-python's), or the window + one ubatch of cells,
reused as a ring (llama.cpp's tools by default; what a PolyKV plan's FullKV sliding-window layers hold). Both attend
to the same keys. This script compares the first logits of one prompt (Python sources of this package) across:

- the two stock layouts at several prompt lengths (the ring wraps past window + ubatch tokens), one-call and
  two-call prefill, and a FullKV plan;
- perturbations that touch no layout: the K/V type (f16 or f32) and flash attention on or off.

It runs the CPU kernels that do not depend on the ubatch (no weight repacking, no tiled product, flash attention
off unless stated), so a difference is the layout's or the rounding's, not the ubatch's.

    LLAMA_ARG_REPACK=0 GGML_CPU_TILED_MM=0 python scripts/swa_layout_check.py --out results/gemma-swa-layout
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m-q4_k_m", help="a packaged model name or a GGUF file")
    ap.add_argument("--lengths", default="300,900,1100,2000,3900", help="prompt lengths in tokens")
    ap.add_argument("--n-ctx", type=int, default=4160)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="directory for results.json and results.md")
    args = ap.parse_args(argv)

    from polykv_cpp import models
    from polykv_cpp import plan as plan_mod
    from polykv_cpp.api import Model

    if os.environ.get("LLAMA_ARG_REPACK") != "0" or os.environ.get("GGML_CPU_TILED_MM") != "0":
        print("note: run with LLAMA_ARG_REPACK=0 GGML_CPU_TILED_MM=0 for kernels that do not depend on the ubatch",
              file=sys.stderr)
    path = args.model if Path(args.model).is_file() else models.fetch(args.model, progress=False)
    model = Model(path)
    text = Path(inspect.getfile(plan_mod)).read_text(encoding="utf-8") * 8
    tokens = model.tokenize(text)
    question = model.tokenize("\n\nQuestion: which function builds a uniform plan? Answer:", add_special=False)

    def logits(n: int, *, swa_full: bool = True, plan: bool = False, split: bool = False, kv: str = "f16",
               fa: str = "off") -> np.ndarray:
        prompt = tokens[:n - len(question)] + question
        p = plan_mod.uniform_plan(model.n_layer, plan_mod.FULLKV, args.n_ctx) if plan else None
        model.set_plan(p, prefill="chunked")
        with model.context(n_ctx=args.n_ctx, n_batch=2048, n_ubatch=args.ubatch, n_threads=args.threads,
                           flash_attn=fa, type_k=kv, type_v=kv, swa_full=swa_full) as ctx:
            if split:
                ctx.decode(prompt[:-len(question)], phase="prefill")
                ctx.decode(question, phase="prefill")
            else:
                ctx.decode(prompt, phase="prefill")
            return ctx.logits().copy()

    def diff(a: np.ndarray, b: np.ndarray) -> dict:
        return {"max_abs": float(np.abs(a - b).max()), "mean_abs": float(np.abs(a - b).mean()),
                "same_argmax": bool(a.argmax() == b.argmax())}

    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        full = logits(n)
        row = {"n_prompt": n, "logit_std": float(full.std()),
               "ring_vs_full_size": diff(logits(n, swa_full=False), full),
               "full_size_two_calls_vs_one": diff(logits(n, split=True), full),
               "ring_two_calls_vs_one": diff(logits(n, swa_full=False, split=True), logits(n, swa_full=False)),
               "fullkv_plan_vs_ring": diff(logits(n, plan=True), logits(n, swa_full=False)),
               "f32_kv_vs_f16": diff(logits(n, kv="f32"), full),
               "flash_attn_on_vs_off": diff(logits(n, fa="on"), full)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    model.close()

    cols = [("ring_vs_full_size", "ring (window + ubatch) vs full-size"),
            ("full_size_two_calls_vs_one", "full-size: two calls vs one"),
            ("ring_two_calls_vs_one", "ring: two calls vs one"),
            ("fullkv_plan_vs_ring", "FullKV plan vs ring"),
            ("f32_kv_vs_f16", "full-size: f32 K/V vs f16"),
            ("flash_attn_on_vs_off", "full-size: flash attention on vs off")]
    md = ["| prompt tokens | " + " | ".join(label for _, label in cols) + " |",
          "|---:|" + "---:|" * len(cols)]
    for r in rows:
        md.append(f"| {r['n_prompt']} | " + " | ".join(
            f"{r[k]['max_abs']:.2f} / {r[k]['mean_abs']:.3f}" + ("" if r[k]["same_argmax"] else " (argmax moves)")
            for k, _ in cols) + " |")
    md.append("")
    md.append(f"max / mean absolute difference of the first logits (their standard deviation "
              f"{np.mean([r['logit_std'] for r in rows]):.2f}); n_ctx {args.n_ctx}, ubatch {args.ubatch}")
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        settings = {"model": Path(path).name, "n_ctx": args.n_ctx, "ubatch": args.ubatch, "threads": args.threads,
                    "env": {k: os.environ.get(k) for k in ("LLAMA_ARG_REPACK", "GGML_CPU_TILED_MM")}}
        (out / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
        (out / "results.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
