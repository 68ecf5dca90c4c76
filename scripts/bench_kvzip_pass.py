#!/usr/bin/env python3
"""Seconds of a prompt's prefill and of KVzip's reconstruction pass over it (the cost the query-agnostic KVzip plans
add to a prompt), on a real model and a real text.

    python scripts/bench_kvzip_pass.py [MODEL] --lengths 2048,4096 --reps 3 --out results/bench-kvzip-pass.json

MODEL: a GGUF path or a packaged model name (default: the default model). The prompt is the first LENGTH tokens of
--text (default: docs/results.md, repeated as needed). Each repetition: a portable prefill of the prompt under the
shipped per-prompt KVzip plan rescaled to LENGTH / 8, then `Context.score_prompt_kvzip` in chunks of 512 (as the
eval). Prints and writes the median seconds and the pass / prefill ratio. Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "qwen2.5-coder-0.5b-instruct-q4_k_m.kvzip-prompt-keep.b128.json"


def main(argv: list[str] | None = None) -> int:
    from polykv_cpp import __version__
    from polykv_cpp.api import Model
    from polykv_cpp.evaluation.runner import KVZIP_ROOM, resolve_model
    from polykv_cpp.plan import Plan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--lengths", default="2048,4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--plan", type=Path, default=PLAN, help="a plan with KVzip layers (default: the shipped one)")
    ap.add_argument("--text", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    model = Model(resolve_model(args.model))
    text = args.text.read_text()
    tokens = model.tokenize(text, add_special=True, parse_special=False)
    while len(tokens) < max(lengths):
        tokens += model.tokenize(text, add_special=False, parse_special=False)
    plan = Plan.from_json(args.plan.read_text())
    rows = []
    for n in lengths:
        prompt = tokens[:n]
        model.set_plan(plan.scaled(max(plan.b_min, n // 8)), prefill="portable")
        prefill, recon = [], []
        for rep in range(args.reps):
            ctx = model.context(n_ctx=n + KVZIP_ROOM + 64, n_ubatch=512, n_threads=args.threads)
            try:
                t = time.perf_counter()
                ctx.decode(prompt, phase="prefill")
                prefill.append(time.perf_counter() - t)
                t = time.perf_counter()
                ctx.score_prompt_kvzip(prompt, chunk=KVZIP_ROOM)
                recon.append(time.perf_counter() - t)
            finally:
                ctx.close()
            print(f"{n} tokens, rep {rep + 1}: prefill {prefill[-1]:.1f} s, pass {recon[-1]:.1f} s", flush=True)
        row = {"tokens": n, "prefill_s": round(statistics.median(prefill), 2),
               "pass_s": round(statistics.median(recon), 2), "all_prefill_s": [round(x, 2) for x in prefill],
               "all_pass_s": [round(x, 2) for x in recon]}
        row["pass_over_prefill"] = round(row["pass_s"] / row["prefill_s"], 2)
        rows.append(row)
    print("| tokens | prefill s | pass s | pass / prefill |\n|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['prefill_s']} | {r['pass_s']} | {r['pass_over_prefill']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(args.model), "polykv_cpp": __version__, "threads": args.threads,
                                        "reps": args.reps, "plan": str(args.plan), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
