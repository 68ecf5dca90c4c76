#!/usr/bin/env python3
"""Long-prompt memory check: a prompt of --prompt-len tokens through FullKV and through a plan at --kv-budget.

For each configuration, in a fresh process (so that peak RSS is its own): allocated KV bytes (per-layer
stats of the PolyKV cache, or the stock cache size), the largest per-layer capacity (no full-size buffer may
appear with a plan), peak RSS, prefill and decode speed, and the generated continuation. Prints a markdown
table; --json writes the numbers.

    python scripts/long_prompt_check.py --plan MODEL.polykv.gguf --kv-budget 512 --prompt-len 8192
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

QUESTION = "\n\n# Question: in one sentence, what does the code above do?\n# Answer:"


def prompt_text() -> str:
    """Deterministic long text: Python standard-library sources found on this machine."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "calendar.py", "difflib.py",
                 "argparse.py", "configparser.py", "inspect.py"):
        path = root / name
        if path.exists():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(parts)


def child(args) -> dict:
    from polykv_cpp.api import KV_TYPE_BYTES, Model
    from polykv_cpp.cli import kv_cache_bytes

    n_ctx = args.prompt_len + args.n_gen + 64
    with Model(args.model) as model:
        if args.config == "plan":
            if args.plan:
                model.set_plan(args.plan, kv_budget=args.kv_budget)
            else:
                model.set_plan(use_gguf=True, kv_budget=args.kv_budget)
        else:
            model.set_plan(None)
        text_tokens = model.tokenize(prompt_text())
        question = model.tokenize(QUESTION, add_special=False)
        body = text_tokens[: args.prompt_len - len(question)]
        tokens = body + question
        with model.context(n_ctx=n_ctx, n_batch=args.ubatch, n_ubatch=args.ubatch, n_threads=args.threads) as ctx:
            t0 = time.perf_counter()
            out = list(ctx.generate_tokens(tokens, max_tokens=args.n_gen))
            wall = time.perf_counter() - t0
            perf = ctx.perf()
            stats = ctx.kv_layer_stats()
            if stats:
                kv_bytes = sum(s.bytes for s in stats)
                full_bytes = sum(s.bytes_fullkv for s in stats)
                max_cap = max(s.capacity for s in stats)
            else:
                full_bytes = kv_bytes = kv_cache_bytes(model, ctx.n_ctx, KV_TYPE_BYTES["f16"], KV_TYPE_BYTES["f16"])
                max_cap = ctx.n_ctx
            text = model.detokenize(out)
    rss_kb = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            rss_kb = int(line.split()[1])
    return {
        "config": args.config, "prompt_tokens": len(tokens), "n_ctx": n_ctx, "kv_bytes": kv_bytes,
        "fullkv_bytes": full_bytes, "max_layer_capacity": max_cap, "peak_rss_mib": rss_kb / 1024,
        "prefill_tok_s": perf["prompt_tokens"] / max(perf["prompt_ms"], 1e-9) * 1000,
        "decode_tok_s": perf["eval_tokens"] / max(perf["eval_ms"], 1e-9) * 1000, "wall_s": wall,
        "generated": text,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the packaged default model; with --plan-from-gguf use the calibrated GGUF)")
    ap.add_argument("--plan", help="plan file (JSON or GGUF); default: the plan stored in --model")
    ap.add_argument("--kv-budget", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", default="fullkv,plan")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.model is None:
        from polykv_cpp import models

        args.model = str(models.fetch(models.DEFAULT_MODEL))
    if args.config:
        print(json.dumps(child(args)))
        return 0
    rows = []
    for config in args.configs.split(","):
        cmd = [sys.executable, __file__, "--config", config, "--model", args.model, "--kv-budget", str(args.kv_budget),
               "--prompt-len", str(args.prompt_len), "--n-gen", str(args.n_gen), "--ubatch", str(args.ubatch)]
        if args.plan:
            cmd += ["--plan", args.plan]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        print(f"[{config}] running ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("| config | prompt | n_ctx | KV MiB | FullKV MiB | KV / FullKV | max layer cells | peak RSS MiB | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['prompt_tokens']} | {r['n_ctx']} | {r['kv_bytes'] / 2**20:.1f} | "
              f"{r['fullkv_bytes'] / 2**20:.1f} | {r['kv_bytes'] / r['fullkv_bytes']:.3f} | {r['max_layer_capacity']} | "
              f"{r['peak_rss_mib']:.0f} | {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f} |")
    for r in rows:
        print(f"\n{r['config']} continuation: {r['generated']!r}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
