#!/usr/bin/env python3
"""Host time of an exact-mode prompt compression (`Context.compress_prompt`) as the context grows.

Exact prefill keeps the whole prompt in n_ctx-cell caches and drops all but the budget when it compresses: the
eviction's own host work (selecting, freeing cells, moving the kept ones into smaller caches) grows with n_ctx.
A tiny random model (4 layers, written here) makes the model's compute negligible, so what is timed is that work.
Writes a JSON report and prints a markdown table.

    python scripts/bench_compress.py --lengths 4096,16384,32768 --out results/bench-compress.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from polykv_cpp.api import Model  # noqa: E402
from polykv_cpp.plan import uniform_plan  # noqa: E402
from tiny_models import TinyConfig, write_tiny_gguf  # noqa: E402

CFG = TinyConfig(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)


def time_compress(path: Path, pattern: str, n: int, budget: int, reps: int, threads: int) -> dict:
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(3, CFG.n_vocab, size=n)]
    times = []
    freed = 0
    with Model(path) as model:
        model.set_plan(uniform_plan(CFG.n_layer, pattern, budget), prefill="exact")
        for _ in range(reps):
            with model.context(n_ctx=n + 64, n_batch=2048, n_ubatch=512, n_threads=threads) as ctx:
                ctx.decode(tokens)
                t0 = time.perf_counter()
                freed = ctx.compress_prompt()
                times.append(time.perf_counter() - t0)
    return {"pattern": pattern, "n_tokens": n, "budget": budget, "compress_ms": 1000 * statistics.median(times),
            "cells_freed": freed, "reps": reps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,16384,32768", help="prompt lengths (n_ctx = length + 64)")
    ap.add_argument("--patterns", default="snapkv,streamingllm")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", "-t", type=int, default=1)
    ap.add_argument("--out", type=Path, help="JSON report")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_gguf(Path(tmp) / "tiny.gguf", CFG, seed=1)
        for n in (int(x) for x in args.lengths.split(",")):
            for pattern in args.patterns.split(","):
                rows.append(time_compress(path, pattern, n, args.budget, args.reps, args.threads))
                print(f"{pattern} {n}: {rows[-1]['compress_ms']:.1f} ms", file=sys.stderr)
    print(f"| pattern | prompt tokens | compress_prompt ms (median of {args.reps}) | cells freed |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['pattern']} | {r['n_tokens']} | {r['compress_ms']:.1f} | {r['cells_freed']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": f"tiny random, {CFG.n_layer} layers", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
