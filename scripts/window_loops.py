#!/usr/bin/env python3
"""Bounded caches and long generation: does llama.cpp's own bounded cache (context shift) avoid the loops the soak
finds with eviction plans?

The soak (``scripts/soak.py``) asks for a very long text with end-of-generation masked, and at 256 tokens per layer
every eviction method falls into a loop that FullKV does not show. This runs the same chat prompt, sampler and seed
through the stock ``llama-completion`` built from our tree (``--ignore-eos``: end-of-generation masked), so every
configuration shares one tool and one sampler:

* ``fullkv``: the whole context (n_ctx 4096), the reference;
* ``shift-keep4``: llama.cpp's context shift (StreamingLLM with positions shifted: when the 512-cell context is full,
  half of it after the first 4 tokens is dropped and the rest moves down), n_ctx 512, ``--keep 4``;
* ``shift-keep-prompt``: the same keeping the whole prompt (the instruction never leaves the window), ``--keep -1``;
* ``plan``: our shipped plan rescaled to ``--kv-budget`` (``LLAMA_POLYKV_PLAN``, ``LLAMA_POLYKV_KV_BUDGET``);
* ``streamingllm``: uniform StreamingLLM at ``--kv-budget`` (4 sinks, original positions kept).

The generated text is cut into pieces (words, punctuation marks, newlines) and blocks of 400 pieces; for each block
it reports the share of distinct 4-grams (as the soak does per 1,000 tokens), and the first block under 0.3 (the
soak's bar without FullKV; FullKV's blocks stay at 0.47-0.85 here) with the words before it. One prompt and one seed
per configuration: a case, not a rate.

    python scripts/window_loops.py --out results/soak-window-loops     # 5 x 3000 tokens, about 20 min alone (-t 1)
    python scripts/window_loops.py --out results/soak-window-loops --score-only      # the report from the texts
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import soak  # noqa: E402  (the soak's prompt and default plan)

CONFIGS = ("fullkv", "shift-keep4", "shift-keep-prompt", "plan", "streamingllm")
BLOCK = 400
LOOP_SHARE = 0.3


def pieces(text: str) -> list[str]:
    return re.findall(r"\w+|\n|[^\w\s]", text)


def distinct_share(ws: list[str], n: int = 4) -> float:
    grams = [tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def block_shares(ws: list[str]) -> list[float]:
    return [distinct_share(ws[i:i + BLOCK]) for i in range(0, len(ws) - BLOCK + 1, BLOCK)]


def generated(stdout: str) -> str:
    """What llama-completion wrote after the echoed prompt (special tokens are not printed, so the prompt ends
    with the request and the assistant's role name)."""
    rest = stdout.split(soak.PROMPT, 1)[-1]
    return rest.split("assistant\n", 1)[-1] if "assistant\n" in rest[:40] else rest


def score(out: Path, names: list[str], report: dict) -> None:
    for name in names:
        text = generated((out / f"{name}.txt").read_text())
        ws = pieces(text)
        shares = block_shares(ws)
        first = next((k for k, v in enumerate(shares) if v < LOOP_SHARE), None)
        cut = len(ws) if first is None else first * BLOCK
        words = sum(1 for w in ws[:cut] if re.match(r"\w", w))
        report["configs"][name] = {"pieces": len(ws), "block_shares": [round(v, 3) for v in shares],
                                   "first_loop_block": first, "words_before": words, "tail": text[-200:]}
        print(f"  {name}: {len(ws)} pieces, distinct 4-grams per block " + " ".join(f"{v:.2f}" for v in shares) +
              f"; {'no loop' if first is None else f'loop from block {first + 1}, {words} words before it'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--plan", default=str(soak.DEFAULT_PLAN))
    ap.add_argument("--kv-budget", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--score-only", action="store_true", help="report on the texts --out already holds")
    args = ap.parse_args()

    from polykv_cpp import models
    from polykv_cpp._native import bin_dir
    from polykv_cpp.api import Model
    from polykv_cpp.plan import uniform_plan

    model_path = Path(args.model) if Path(args.model).exists() else models.fetch(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    prompt_file = args.out / "prompt.txt"
    model = Model(str(model_path))
    prompt_file.write_text(model.chat_prompt([("user", soak.PROMPT)]))
    stream_plan = args.out / f"streamingllm.b{args.kv_budget}.json"
    stream_plan.write_text(uniform_plan(model.n_layer, "streamingllm", args.kv_budget).to_json())

    sampler = ["--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0", "--seed", str(args.seed),
               "--ignore-eos", "-n", str(args.tokens), "-t", str(args.threads), "--no-warmup", "-no-cnv"]
    base = [str(bin_dir() / "llama-completion"), "-m", str(model_path), "-f", str(prompt_file)] + sampler
    runs = {
        "fullkv": (["-c", "4096"], {}),
        "shift-keep4": (["-c", "512", "--keep", "4", "--context-shift"], {}),
        "shift-keep-prompt": (["-c", "512", "--keep", "-1", "--context-shift"], {}),
        "plan": (["-c", "4096"], {"LLAMA_POLYKV_PLAN": args.plan, "LLAMA_POLYKV_KV_BUDGET": str(args.kv_budget)}),
        "streamingllm": (["-c", "4096"], {"LLAMA_POLYKV_PLAN": str(stream_plan)}),
    }
    names = args.configs.split(",")
    report = {"prompt": soak.PROMPT, "tokens": args.tokens, "seed": args.seed, "kv_budget": args.kv_budget,
              "plan": args.plan, "block_pieces": BLOCK, "loop_share": LOOP_SHARE, "configs": {}}
    for name in names if not args.score_only else []:
        extra, env = runs[name]
        print(f"[window_loops] {name}", flush=True)
        done = subprocess.run(base + extra, env={**os.environ, **env}, capture_output=True, text=True, errors="replace")
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        (args.out / f"{name}.txt").write_text(done.stdout)
    score(args.out, names, report)
    (args.out / "window_loops.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
