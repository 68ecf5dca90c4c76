"""Does a prompt fed in pieces (no logits until its end, as a server slot under load is fed) compute what the same
prompt fed at once computes? Prints, for stock llama.cpp (no plan) and for a plan, the largest logit difference at
the prompt's end and, with the plan, the layers whose kept positions differ.

    python scripts/pieces_check.py gemma-3-270m-q4_k_m --plan plans/gemma-3-270m-q4_k_m.search.b512.json

On the quantized models the stock logits already depend on the ubatch sizes (llama.cpp's CPU matrix kernels
accumulate a row differently in a ubatch of another size), so a plan's scores, and near ties among them, move with
them; on the tiny fp32 test models the kept sets are equal (`tests/test_chunk_align.py`).

``--last-sizes 1-16`` asks which ubatch sizes change stock llama.cpp's logits: the prompt is fed at once, then as
all but its last k tokens followed by those k, for each k, and the largest logit difference is printed per k (no
plan). Run it with ``--flash-attn off`` and ``LLAMA_ARG_REPACK=0`` to see what llama.cpp's kernels do with
neither (docs/results.md, "Which kernels make an answer depend on its ubatch").
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
    ap.add_argument("--plan", help="plan JSON (required unless --last-sizes)")
    ap.add_argument("--text", default=argparse.__file__, help="the prompt's text (default: argparse's source)")
    ap.add_argument("--n-ubatch", type=int, default=128)
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--last-sizes", metavar="A-B", help="stock only: the logit difference per size k of a last piece")
    args = ap.parse_args(argv)
    sizes = None
    if args.last_sizes:
        try:
            lo, hi = (int(x) for x in args.last_sizes.split("-"))
        except ValueError:
            ap.error("--last-sizes takes A-B, e.g. 1-16")
        if not 1 <= lo <= hi < sum(DEFAULT_PIECES[0]):
            ap.error(f"--last-sizes: need 1 <= A <= B < {sum(DEFAULT_PIECES[0])}")
        sizes = range(lo, hi + 1)
    elif not args.plan:
        ap.error("--plan is required unless --last-sizes is given")
    path = models.fetch(args.model, progress=False) if not args.model.endswith(".gguf") else args.model
    n = sum(DEFAULT_PIECES[0])
    with Model(path) as model:
        toks = model.tokenize(open(args.text, encoding="utf-8").read()[:40000])[:n]
        if sizes is not None:
            model.set_plan(None)
            _, whole_logits = run(model, toks, [n], args.n_ubatch, args.flash_attn)
            for k in sizes:
                _, logits = run(model, toks, [n - k, k], args.n_ubatch, args.flash_attn)
                print(f"stock (no plan): last piece of {k} tokens: max |logit difference| "
                      f"{float(np.abs(logits - whole_logits).max()):.4f}")
            return 0
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
