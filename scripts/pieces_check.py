"""Does a prompt fed in pieces (no logits until its end, as a server slot under load is fed) compute what the same
prompt fed at once computes? Prints, for stock llama.cpp (no plan) and for a plan, the largest logit difference at
the prompt's end and, with the plan, the layers whose kept positions differ.

    python scripts/pieces_check.py gemma-3-270m-q4_k_m --plan plans/gemma-3-270m-q4_k_m.search.b512.json

On the quantized models the stock logits already depend on the ubatch sizes (llama.cpp's CPU matrix kernels
accumulate a row differently in a ubatch of another size), so a plan's scores, and near ties among them, move with
them; on the tiny fp32 test models the kept sets are equal (`tests/test_chunk_align.py`).
"""

from __future__ import annotations

import argparse

import numpy as np

from polykv_cpp import models
from polykv_cpp.api import Model
from polykv_cpp.plan import Plan

DEFAULT_PIECES = ([256, 212, 128, 300, 204], [100, 77, 333, 1, 200, 389])


def run(model: Model, toks: list[int], pieces: list[int], n_ubatch: int, flash_attn: str):
    with model.context(n_ctx=4096, n_batch=512, n_ubatch=n_ubatch, flash_attn=flash_attn) as ctx:
        start = 0
        for k, n in enumerate(pieces):
            ctx.decode(toks[start:start + n], last_logits=k == len(pieces) - 1)
            start += n
        kept = [ctx.kept_positions(il) for il in range(model.n_layer)] if ctx.polykv_active else []
        return kept, ctx.logits()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a packaged model name (models.fetch) or a GGUF path")
    ap.add_argument("--plan", required=True, help="plan JSON")
    ap.add_argument("--text", default=argparse.__file__, help="the prompt's text (default: argparse's source)")
    ap.add_argument("--n-ubatch", type=int, default=128)
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args(argv)
    path = models.fetch(args.model, progress=False) if not args.model.endswith(".gguf") else args.model
    n = sum(DEFAULT_PIECES[0])
    with Model(path) as model:
        toks = model.tokenize(open(args.text, encoding="utf-8").read()[:40000])[:n]
        for label, plan in (("stock (no plan)", None), ("plan", Plan.from_json(open(args.plan).read()))):
            model.set_plan(plan)
            whole_kept, whole_logits = run(model, toks, [n], args.n_ubatch, args.flash_attn)
            for pieces in DEFAULT_PIECES:
                kept, logits = run(model, toks, pieces, args.n_ubatch, args.flash_attn)
                differ = [il for il in range(len(kept)) if kept[il] != whole_kept[il]]
                moved = sum(len(set(kept[il]) - set(whole_kept[il])) for il in range(len(kept)))
                total = sum(len(k) for k in whole_kept)
                print(f"{label}: pieces {pieces}: max |logit difference| {float(np.abs(logits - whole_logits).max()):.4f}"
                      + (f", layers whose kept positions differ: {len(differ)} of {model.n_layer}, kept positions "
                         f"not kept fed at once: {moved} of {total} ({100 * moved / max(total, 1):.1f}%)"
                         if plan is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
