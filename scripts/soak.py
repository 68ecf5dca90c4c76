#!/usr/bin/env python3
"""Long-run soak: generate many tokens with decode eviction and watch memory, speed and the text stay sane.

For every configuration of ``--configs`` (``plan``: a PolyKV plan rescaled to ``--kv-budget``; a pattern name:
that pattern uniform at the same budget; ``fullkv``: no plan) a fresh subprocess loads the default model, feeds one chat prompt that asks for
a very long text, and samples ``--tokens`` tokens (llama.cpp's default temperature/top-k/top-p with a fixed seed; end-of-generation
tokens are masked so that the run does not stop). Every ``--every`` tokens it records:

* the process RSS (``VmRSS``) and the KV bytes the library allocated (sum of the per-layer buffers; FullKV: the
  stock cache of n_ctx cells), the cells in use and the tokens evicted so far;
* tokens/s over the block (wall clock, sampling included);
* repetition: the share of distinct 4-grams among the block's tokens, and the longest run of one repeated
  n-gram (n <= 32) at the block's end: a generation stuck in a loop has few distinct 4-grams.

Pass criteria, written next to the numbers (``--out`` JSON, and .md/.png beside it): RSS after warm-up (the first
``--warmup`` tokens) stays within 2% of its first value, tokens/s of the last block is >= 0.9x the first block
after warm-up, and no loop that FullKV does not show: every block's distinct-4-gram share is at least half of
FullKV's in the same block (without a FullKV run: at least 0.3). ``--resume`` keeps the configurations an
earlier run of the same settings already wrote to ``--out``. ``--repeat-penalty`` adds llama.cpp's repetition
penalty to every configuration's sampling, FullKV's included, and ``--dry-multiplier`` llama.cpp's DRY sampler
(``polykv_cpp.api.LogitPenalties``, fed the prompt and every generated token). ``--fullkv-from`` takes FullKV's run from another
soak's JSON made with the same settings but another budget (FullKV does not depend on it).

    python scripts/soak.py                                   # 20K tokens, budget 256, plan + SnapKV + FullKV
    python scripts/soak.py --configs plan,snapkv,streamingllm,fullkv --resume    # adds StreamingLLM
    python scripts/soak.py --tokens 2000 --every 500 --configs plan,snapkv --out /tmp/soak.json
    python scripts/soak.py --kv-budget 1024 --configs plan,fullkv --fullkv-from results/soak-qwen/soak.json \
        --out results/soak-qwen-b1024/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = ROOT / "plans" / "qwen2.5-coder-0.5b-instruct-q4_k_m.b512.json"
EVENT_PREFIX = "@@SOAK "
MIB = 1024 * 1024
PROMPT = ("Write a very long, complete tutorial on the Python standard library. Go through the modules one by one "
          "(os, sys, pathlib, re, json, csv, datetime, collections, itertools, functools, typing, dataclasses, "
          "asyncio, threading, subprocess, sqlite3, unittest, logging, argparse, and every other one you know). "
          "For each module explain what it is for, show several complete code examples with their output, and list "
          "common mistakes. Do not stop early and do not summarise: keep writing.")
RSS_TOLERANCE = 0.02
SPEED_RATIO = 0.9
MIN_DISTINCT_4GRAMS = 0.3  # without a FullKV run
#: sampling settings older result files do not name (their runs used these)
SAMPLING_DEFAULTS = {"repeat_penalty": 1.0, "repeat_last_n": 64, "dry_multiplier": 0.0, "dry_base": 1.75,
                     "dry_allowed_length": 2, "dry_penalty_last_n": -1}
LOOP_RATIO = 0.5  # a block with less than half of FullKV's distinct 4-grams (same block) repeats more than FullKV


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def distinct_ngram_share(tokens: list[int], n: int = 4) -> float:
    """Distinct n-grams / all n-grams of `tokens` (1.0: no n-gram repeats)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def tail_loop_length(tokens: list[int], max_period: int = 32) -> int:
    """Length of the longest suffix of `tokens` that repeats one period of at most `max_period` tokens."""
    best = 0
    for period in range(1, min(max_period, len(tokens) // 2) + 1):
        k = len(tokens) - 1
        while k - period >= 0 and tokens[k] == tokens[k - period]:
            k -= 1
        best = max(best, len(tokens) - 1 - k + period if k < len(tokens) - 1 else 0)
    return best


def sample_token(logits: np.ndarray, rng: np.random.Generator, banned: np.ndarray, temperature: float,
                 top_k: int, top_p: float, *, recent: list[int] = (), repeat_penalty: float = 1.0) -> int:
    """Repetition penalty, temperature, top-k, then top-p (nucleus) sampling with the end-of-generation tokens
    masked out. The penalty is llama.cpp's (``--repeat-penalty``): the logit of every token among ``recent`` is
    divided by it when positive and multiplied by it when not."""
    logits = logits.astype(np.float64)
    if repeat_penalty != 1.0 and len(recent):
        seen = np.unique(np.asarray(recent, dtype=np.int64))
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / repeat_penalty, logits[seen] * repeat_penalty)
    logits[banned] = -np.inf
    top = np.argpartition(-logits, top_k)[:top_k]
    top = top[np.argsort(-logits[top])]
    z = logits[top] / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
    p = p[:keep] / p[:keep].sum()
    return int(top[rng.choice(keep, p=p)])


def _emit(event: dict) -> None:
    print(EVENT_PREFIX + json.dumps(event), flush=True)


def worker(spec: dict) -> None:
    from polykv_cpp.api import LogitPenalties, Model, SamplerSettings
    from polykv_cpp.errors import PolyKVError

    model = Model(spec["model"])
    if spec["name"] == "fullkv":
        model.set_plan(None)
    elif spec["name"] == "plan":
        model.set_plan(spec["plan"], kv_budget=spec["kv_budget"])
    else:
        from polykv_cpp.plan import uniform_plan

        model.set_plan(uniform_plan(model.n_layer, spec["name"], spec["kv_budget"]))
    try:
        text = model.chat_prompt([("user", PROMPT)])
    except PolyKVError:  # a base model without a chat template: the request as plain text
        text = PROMPT + "\n\n"
    prompt = model.tokenize(text, parse_special=True)
    n_ctx = len(prompt) + spec["tokens"] + 8
    ctx = model.context(n_ctx=n_ctx, n_batch=512, n_ubatch=spec["n_ubatch"], n_threads=spec["threads"])
    banned = np.array([t for t in range(model.n_vocab) if model.is_eog(t)], dtype=np.int64)
    rng = np.random.default_rng(spec["seed"])
    per_cell = 2 * model.n_layer * model.n_head_kv * (model.n_embd // model.n_head) * 2  # K+V, f16
    dry = None
    if spec.get("dry_multiplier", 0.0) > 0:
        dry = LogitPenalties(model, SamplerSettings(**{k: spec[k] for k in ("dry_multiplier", "dry_base",
                                                                                "dry_allowed_length",
                                                                                "dry_penalty_last_n")}), n_ctx)
        dry.accept(prompt)
    ctx.decode(prompt)
    out: list[int] = []
    t_block = time.perf_counter()
    for i in range(spec["tokens"]):
        logits = ctx.logits() if dry is None else dry.apply(ctx.logits())
        tok = sample_token(logits, rng, banned, spec["temperature"], spec["top_k"], spec["top_p"],
                           recent=out[-spec["repeat_last_n"]:] if spec["repeat_last_n"] else [],
                           repeat_penalty=spec["repeat_penalty"])
        out.append(tok)
        if dry is not None:
            dry.accept([tok])
        ctx.decode([tok])
        if (i + 1) % spec["every"] == 0 or i + 1 == spec["tokens"]:
            now = time.perf_counter()
            block = out[-spec["every"]:]
            stats = ctx.kv_layer_stats()
            kv_bytes = sum(s.bytes for s in stats) if stats else per_cell * ctx.n_ctx
            _emit({"event": "block", "tokens": i + 1, "rss_bytes": _rss(), "kv_bytes": kv_bytes,
                   "cells_used": sum(s.used for s in stats) if stats else ctx.n_past,
                   "evicted": sum(s.n_evicted for s in stats) if stats else 0,
                   "tok_per_s": len(block) / (now - t_block), "distinct_4grams": distinct_ngram_share(block),
                   "tail_loop": tail_loop_length(out), "text_tail": model.detokenize(out[-60:])})
            t_block = now
    _emit({"event": "done", "text_head": model.detokenize(out[:200])})


def run_config(spec: dict, bar) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    blocks, head = [], ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if not line.startswith(EVENT_PREFIX):
            continue
        ev = json.loads(line[len(EVENT_PREFIX):])
        if ev["event"] == "block":
            blocks.append(ev)
            bar.update(ev["tokens"] - bar.n)
            bar.set_postfix_str(f"{spec['name']}: {ev['tok_per_s']:.1f} tok/s, RSS {ev['rss_bytes'] / MIB:.0f} MiB")
        else:
            head = ev["text_head"]
    err = proc.stderr.read() if proc.stderr else ""
    if proc.wait() != 0 or not blocks:
        raise SystemExit(f"soak: configuration {spec['name']!r} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return {"name": spec["name"], "blocks": blocks, "text_head": head}


def fullkv_from(path: Path, base: dict) -> dict:
    """FullKV's configuration from another soak's JSON, checked to share every setting but the budget."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"soak: --fullkv-from {path}: cannot read it ({e})") from None
    differ = [k for k, v in base.items()
              if k not in ("model", "kv_budget") and old.get(k, SAMPLING_DEFAULTS.get(k)) != v]
    if Path(str(old.get("model", ""))).name != Path(base["model"]).name:
        differ.append("model")
    full = next((c for c in old.get("configs", []) if c.get("name") == "fullkv"), None)
    if differ or full is None:
        why = f"its settings differ in {', '.join(differ)}" if differ else "it has no fullkv run"
        raise SystemExit(f"soak: --fullkv-from {path}: {why}")
    return full


def verdict(cfg: dict, warmup: int, fullkv: dict | None) -> dict:
    """The pass criteria of the module docstring for one configuration (`fullkv`: FullKV's run, if any)."""
    after = [b for b in cfg["blocks"] if b["tokens"] > warmup] or cfg["blocks"][-1:]
    rss0 = after[0]["rss_bytes"]
    rss_drift = max(abs(b["rss_bytes"] - rss0) for b in after) / rss0
    speed_ratio = after[-1]["tok_per_s"] / after[0]["tok_per_s"]
    min_distinct = min(b["distinct_4grams"] for b in cfg["blocks"])
    if fullkv is not None:
        loop_ok = all(b["distinct_4grams"] >= LOOP_RATIO * f["distinct_4grams"]
                      for b, f in zip(cfg["blocks"], fullkv["blocks"]))
    else:
        loop_ok = min_distinct >= MIN_DISTINCT_4GRAMS
    return {"rss_drift": rss_drift, "rss_ok": rss_drift <= RSS_TOLERANCE, "speed_ratio": speed_ratio,
            "speed_ok": speed_ratio >= SPEED_RATIO, "min_distinct_4grams": min_distinct, "no_loop": loop_ok}


def penalty_text(report: dict) -> str:
    """", repeat penalty P over the last N tokens" when the run used one."""
    p = report.get("repeat_penalty", SAMPLING_DEFAULTS["repeat_penalty"])
    text = "" if p == 1.0 else f", repeat penalty {p} over the last {report['repeat_last_n']} tokens"
    dry = report.get("dry_multiplier", SAMPLING_DEFAULTS["dry_multiplier"])
    if dry > 0:
        last_n = report["dry_penalty_last_n"]
        text += (f", DRY multiplier {dry} base {report['dry_base']} allowed length {report['dry_allowed_length']} "
                 f"over {'the whole context' if last_n == -1 else f'the last {last_n} tokens'}")
    return text


def write_report(report: dict, md_path: Path | None, png_path: Path | None) -> str:
    lines = [f"{report['tokens']} tokens per configuration, budget {report['kv_budget']}, sampling T="
             f"{report['temperature']} top-k {report['top_k']} top-p {report['top_p']} seed {report['seed']}"
             f"{penalty_text(report)}, "
             f"{report['threads']} threads, warm-up {report['warmup']} tokens", "",
             "| config | KV MiB (first -> last) | RSS MiB after warm-up (first -> last, drift) | tok/s (first -> last "
             "after warm-up) | min distinct 4-grams | evicted | pass |", "|---|---|---|---|---|---|---|"]
    for c in report["configs"]:
        b, v = c["blocks"], c["verdict"]
        after = [x for x in b if x["tokens"] > report["warmup"]] or b[-1:]
        ok = "reference" if c["name"] == "fullkv" else "yes" if v["rss_ok"] and v["speed_ok"] and v["no_loop"] else "NO"
        lines.append(f"| {c['name']} | {b[0]['kv_bytes'] / MIB:.2f} -> {b[-1]['kv_bytes'] / MIB:.2f} | "
                     f"{after[0]['rss_bytes'] / MIB:.1f} -> {after[-1]['rss_bytes'] / MIB:.1f} "
                     f"({100 * v['rss_drift']:.2f}%) | {after[0]['tok_per_s']:.1f} -> {after[-1]['tok_per_s']:.1f} "
                     f"({v['speed_ratio']:.2f}x) | {v['min_distinct_4grams']:.2f} | {b[-1]['evicted']} | "
                     f"{ok} |")
    text = "\n".join(lines) + "\n"
    if md_path:
        md_path.write_text(text)
    if png_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for c in report["configs"]:
            x = [b["tokens"] for b in c["blocks"]]
            axes[0].plot(x, [b["rss_bytes"] / MIB for b in c["blocks"]], marker=".", label=c["name"])
            axes[1].plot(x, [b["tok_per_s"] for b in c["blocks"]], marker=".", label=c["name"])
            axes[2].plot(x, [b["distinct_4grams"] for b in c["blocks"]], marker=".", label=c["name"])
        for ax, title in zip(axes, ("RSS (MiB)", "tokens/s per block", "distinct 4-grams per block")):
            ax.set_title(title)
            ax.set_xlabel("tokens generated")
            ax.grid(alpha=0.3)
        axes[2].axhline(MIN_DISTINCT_4GRAMS, color="grey", ls="--", lw=1)
        axes[0].legend()
        fig.suptitle(f"soak: budget {report['kv_budget']}, {report['tokens']} tokens")
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
        plt.close(fig)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m", help="GGUF path or packaged name")
    ap.add_argument("--plan", default=str(DEFAULT_PLAN), help="plan rescaled to --kv-budget")
    ap.add_argument("--kv-budget", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--n-ubatch", type=int, default=512, help="a plan's caches hold budget + one ubatch cells")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--temperature", type=float, default=0.8, help="0.8, top-k 40, top-p 0.95: llama.cpp's defaults")
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat-penalty", type=float, default=1.0,
                    help="llama.cpp's repetition penalty over the last --repeat-last-n tokens (1.0: off, its default)")
    ap.add_argument("--repeat-last-n", type=int, default=64)
    ap.add_argument("--dry-multiplier", type=float, default=0.0,
                    help="llama.cpp's DRY sampler in every configuration (0: off; 0.8 is DRY's suggestion)")
    ap.add_argument("--dry-base", type=float, default=1.75)
    ap.add_argument("--dry-allowed-length", type=int, default=2)
    ap.add_argument("--dry-penalty-last-n", type=int, default=-1, help="-1: the whole context")
    ap.add_argument("--configs", default="plan,snapkv,fullkv",
                    help="plan, fullkv, or pattern names (uniform at --kv-budget), comma-separated")
    ap.add_argument("--resume", action="store_true", help="keep the configurations --out already holds")
    ap.add_argument("--fullkv-from", type=Path,
                    help="take FullKV's run from this soak JSON (same settings, any budget) instead of running it")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "soak-qwen" / "soak.json")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        worker(json.loads(args._worker))
        return 0

    from tqdm import tqdm

    from polykv_cpp import models

    model_path = Path(args.model) if Path(args.model).exists() else models.fetch(args.model)
    from polykv_cpp.patterns import PATTERN_NAMES

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in ("plan", "fullkv") and n not in PATTERN_NAMES]
    if unknown or not names:
        ap.error(f"--configs: unknown {', '.join(unknown) or 'empty list'} (plan, fullkv or {', '.join(PATTERN_NAMES)})")
    base = {"model": str(model_path), "kv_budget": args.kv_budget, "tokens": args.tokens, "every": args.every,
            "n_ubatch": args.n_ubatch, "threads": args.threads, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "seed": args.seed, "repeat_penalty": args.repeat_penalty, "repeat_last_n": args.repeat_last_n,
            "dry_multiplier": args.dry_multiplier, "dry_base": args.dry_base,
            "dry_allowed_length": args.dry_allowed_length, "dry_penalty_last_n": args.dry_penalty_last_n}
    done: dict[str, dict] = {}
    if args.resume and args.out.exists():
        old = json.loads(args.out.read_text())
        if any(old.get(k, SAMPLING_DEFAULTS.get(k)) != v for k, v in base.items() if k != "model") or old.get("plan") != args.plan:
            raise SystemExit(f"soak: {args.out} holds a run of other settings; use another --out or drop --resume")
        done = {c["name"]: c for c in old["configs"]}
    if args.fullkv_from is not None and "fullkv" in names and "fullkv" not in done:
        done["fullkv"] = fullkv_from(args.fullkv_from, base)
    configs = []
    for name in names:
        if name in done:
            configs.append(done[name])
            continue
        spec = {**base, "name": name, "plan": args.plan}
        with tqdm(total=args.tokens, desc=f"soak {name}", unit="tok") as bar:
            configs.append(run_config(spec, bar))
    full = next((c for c in configs if c["name"] == "fullkv"), None)
    for c in configs:
        c["verdict"] = verdict(c, args.warmup, full)
    report = {**{k: v for k, v in base.items() if k != "model"}, "model": model_path.name, "plan": args.plan,
              "warmup": args.warmup, "configs": configs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(write_report(report, args.out.with_suffix(".md"), args.out.with_suffix(".png")))
    ok = all(c["verdict"]["rss_ok"] and c["verdict"]["speed_ok"] and c["verdict"]["no_loop"]
             for c in configs if c["name"] != "fullkv")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
