#!/usr/bin/env python3
"""Greedy tokens and kept positions of a long decode with eviction, to compare two builds of the library.

Run it once per build (``POLYKV_CPP_LIB_DIR`` pointing at each build's lib directory) and compare the two JSON
files: a change to how scores are computed that should not change any decision (e.g. the observation window's
running sum) must give the same tokens and the same kept positions.

    POLYKV_CPP_LIB_DIR=/tmp/lib-a python scripts/long_decode_trace.py --out a.json
    POLYKV_CPP_LIB_DIR=/tmp/lib-b python scripts/long_decode_trace.py --out b.json
    python scripts/long_decode_trace.py --compare a.json b.json
"""

import argparse
import json
import sys

import numpy as np

PROMPT = "Write a long tutorial about Python's itertools module, with many examples.\n"


def trace(args) -> dict:
    from polykv_cpp import models
    from polykv_cpp.api import Model
    from polykv_cpp.plan import uniform_plan

    path = args.model or models.model_path(models.DEFAULT_MODEL) or models.fetch(models.DEFAULT_MODEL)
    with Model(path) as model:
        model.set_plan(uniform_plan(model.n_layer, args.pattern, args.budget, selection=args.selection))
        with model.context(n_ctx=args.tokens + 512, n_threads=args.threads) as ctx:
            ctx.decode(model.tokenize(PROMPT))
            toks = []
            for _ in range(args.tokens):
                tok = int(np.argmax(ctx.logits()))
                toks.append(tok)
                ctx.decode([tok])
            kept = {str(il): [[int(p) for p in ctx.kept_positions(il, h)] for h in range(model.n_head_kv)]
                    for il in range(model.n_layer)}
    return {"pattern": args.pattern, "selection": args.selection, "budget": args.budget, "tokens": toks,
            "kept": kept}


def compare(a_path: str, b_path: str) -> int:
    a, b = json.load(open(a_path)), json.load(open(b_path))
    first = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    same_kept = a["kept"] == b["kept"]
    print(f"tokens: {'equal' if first is None and len(a['tokens']) == len(b['tokens']) else f'differ from {first}'}; "
          f"kept positions after the last token: {'equal' if same_kept else 'differ'}")
    return 0 if first is None and same_kept else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the packaged default model)")
    p.add_argument("--pattern", default="snapkv")
    p.add_argument("--selection", default="layer", choices=("layer", "head"))
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the trace here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two traces; exit 1 if they differ")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("--out or --compare")
    json.dump(trace(args), open(args.out, "w"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
