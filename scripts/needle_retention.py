#!/usr/bin/env python3
"""Which scoring rule keeps the needles when the question is inside the compressed prompt?

For query-aware eval prompts (the question at the end), transformers computes on the model's weights (the GGUF
dequantized) the prompt's attention and the attention of KVzip's reconstruction queries (the same sequences as the
runtime's pass: prompt, then the instruction prefix, then each chunk of the prompt after its 8 preceding tokens).
Every KV head of every layer then keeps its sinks, the prompt's last ``--tail`` tokens (the question) and its
``--budget`` best-scored other tokens under each rule, and the script reports the share of the answer's tokens
(the needles' values, where the prompt holds them) that each rule keeps, averaged over layers and heads:

  kvzip            the reconstruction maximum (`patterns.KVzip`)
  snapkv@K         SnapKV's window sum, max-pooled with kernel K (`patterns.SnapKV`, query-aware)
  kvzip+q-max      the larger of kvzip and the largest probability any of the last ``--tail`` queries of any of
                   the KV head's query heads gives the token (the question's queries join KVzip's queries)
  kvzip+q-mean     the same with the head-mean rows SnapKV reads (what the runtime's ring holds)
  rank-max         the larger of the two rules' ranks (kvzip's and snapkv@K's)

``--protocol query-agnostic`` scores the prompt without its question (the context alone, compressed before the
question exists): the tail is then the context's last tokens. A measure of what a rule can keep, not of answers: a needle must survive in the heads that retrieve it, not in
all. The prompt's attention is held whole (n_layer x n_head x P x P floats): lengths up to about 2K here.

    python scripts/needle_retention.py qwen2.5-coder-0.5b-instruct-q4_k_m --length 1024 --samples 4 \
        --out results/needle-retention-qwen-1k
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from polykv_cpp.api import Model
from polykv_cpp.evaluation import tasks as T
from polykv_cpp.evaluation.report import bootstrap_task_average, interval
from polykv_cpp.evaluation.runner import resolve_model
from polykv_cpp.patterns import KVzip, SnapKV, keep_topk

RULES = ("kvzip", "snapkv", "kvzip+q-max", "kvzip+q-mean", "rank-max")
KVZIP_CHUNK, KVZIP_OVERLAP = 512, 8  # as the eval's pass (runner.KVZIP_ROOM) and the runtime's overlap


def answer_positions(model: Model, tokens: list[int], answers: list[str]) -> list[int]:
    """Prompt positions of every occurrence of an answer's tokens (with and without a leading space)."""
    found: set[int] = set()
    for a in answers:
        for text in (a, " " + a):
            needle = model.tokenize(text, add_special=False, parse_special=False)
            for i in range(len(tokens) - len(needle) + 1):
                if tokens[i:i + len(needle)] == needle:
                    found.update(range(i, i + len(needle)))
    return sorted(found)


def attentions(hf, torch, tokens: list[int], prefix: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer: the prompt's attention [n_head, P, P] and the reconstruction maximum per query head [n_head, P]."""
    P = len(tokens)
    with torch.no_grad():
        prompt = [a[0].double().numpy() for a in hf(torch.tensor([tokens]), output_attentions=True).attentions]
        recon = [np.zeros((a.shape[0], P)) for a in prompt]
        for c0 in range(0, P, KVZIP_CHUNK):
            seq = tokens + prefix + tokens[max(0, c0 - KVZIP_OVERLAP):c0] + tokens[c0:c0 + KVZIP_CHUNK]
            for il, a in enumerate(hf(torch.tensor([seq]), output_attentions=True).attentions):
                recon[il] = np.maximum(recon[il], a[0, :, P:, :P].double().numpy().max(axis=1))
    return prompt, recon


def rule_scores(prompt_attn: np.ndarray, recon_max: np.ndarray, tail: int, kernel: int) -> dict[str, np.ndarray]:
    """One KV head's raw scores under every rule (``prompt_attn`` [r, P, P], ``recon_max`` [r, P] of its r query heads)."""
    kvzip = KVzip(n_sink=0).scores(1, recon_max.shape[-1], attn=recon_max[:, None, :])
    snap = SnapKV(obs_window=tail, pool_kernel=kernel, window=0).scores(1, prompt_attn.shape[-1], attn=prompt_attn)
    snap[-tail:] = 0.0  # the tail is kept by every rule; its scores only rank it
    q_max = prompt_attn[:, -tail:, :].max(axis=(0, 1))
    q_mean = prompt_attn[:, -tail:, :].mean(axis=0).max(axis=0)

    def rank(x: np.ndarray) -> np.ndarray:
        return np.argsort(np.argsort(x, kind="stable"), kind="stable") / len(x)

    return {"kvzip": kvzip, "snapkv": snap, "kvzip+q-max": np.maximum(kvzip, q_max),
            "kvzip+q-mean": np.maximum(kvzip, q_mean), "rank-max": np.maximum(rank(kvzip), rank(snap))}


def kept(scores: np.ndarray, budget: int, tail: int, n_sink: int) -> set[int]:
    sc = np.array(scores, dtype=np.float64)
    sc[:n_sink] = np.inf
    sc[len(sc) - tail:] = np.inf
    return set(keep_topk(sc, budget + tail + n_sink).tolist())


def retention_table(rows: list[dict], budget: int, tail: int) -> str:
    """Markdown: each rule's share per task and its task average with the eval's paired, task-stratified 95%
    bootstrap interval (`report.bootstrap_task_average`)."""
    tasks = sorted({r["task"] for r in rows})
    scores = {k: {t: {r["index"]: float(np.mean(r["per_layer"][k])) for r in rows if r["task"] == t} for t in tasks}
              for k in RULES}
    reps = bootstrap_task_average(scores)
    lines = [f"| rule (budget {budget} + tail {tail} per KV head) | " + " | ".join(tasks) + " | all (95% CI) |",
             "|---|" + "---:|" * (len(tasks) + 1)]
    for k in RULES:
        lo, hi = interval(reps[k])
        avg = 100 * np.mean([np.mean(list(scores[k][t].values())) for t in tasks])
        cells = [f"{100 * np.mean(list(scores[k][t].values())):.1f}" for t in tasks]
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {avg:.1f} [{lo:.1f}-{hi:.1f}] |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a packaged model name or a GGUF path")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue,niah_multiquery,niah_code")
    ap.add_argument("--samples", type=int, default=4, help="samples per task (the eval's, seed 0)")
    ap.add_argument("--budget", type=int, default=128, help="tokens each KV head keeps besides sinks and tail")
    ap.add_argument("--tail", type=int, default=32, help="the prompt's last tokens: kept, and the question's queries")
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--pool-kernel", type=int, default=23, help="SnapKV's kernel")
    ap.add_argument("--protocol", choices=("query-aware", "query-agnostic"), default="query-aware")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        import torch
        from tqdm import tqdm
        from transformers import AutoModelForCausalLM

        from calibration.checkpoint import hf_from_gguf
    except ImportError as e:
        print(f"needle_retention: needs the calibrate extra (torch, transformers): {e}", file=sys.stderr)
        return 2
    path = resolve_model(args.model)
    model = Model(path)
    chat = T.detect_chat_format(model.meta("tokenizer.chat_template"))
    builder = T.PromptBuilder(lambda t, a, p: model.tokenize(t, add_special=a, parse_special=p), chat)
    samples = T.generate_ruler(args.tasks.split(","), [args.length], args.samples, 0,
                               lambda s: builder.count(s) + s.max_new_tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_from_gguf(path)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    n_kv = hf.config.num_key_value_heads
    prefix = model.kvzip_prefix()
    rows = []
    for s in tqdm(samples, desc="prompts"):
        built = builder.build(s)
        tokens = built.tokens if args.protocol == "query-aware" else built.part1
        needles = answer_positions(model, tokens, s.answers)
        if not needles:
            continue
        prompt, recon = attentions(hf, torch, tokens, prefix)
        r = prompt[0].shape[0] // n_kv
        share = {k: np.zeros(len(prompt)) for k in RULES}
        for il in range(len(prompt)):
            for g in range(n_kv):
                heads = slice(g * r, (g + 1) * r)
                for k, sc in rule_scores(prompt[il][heads], recon[il][heads], args.tail, args.pool_kernel).items():
                    keep = kept(sc, args.budget, args.tail, args.n_sink)
                    share[k][il] += np.mean([p in keep for p in needles]) / n_kv
        rows.append({"task": s.task, "index": s.index, "n_prompt": len(tokens), "n_needle_tokens": len(needles),
                     "per_layer": {k: v.tolist() for k, v in share.items()}})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "prompts": rows}, indent=1))
    table = retention_table(rows, args.budget, args.tail)
    (args.out / "results.md").write_text(f"Share of the answer's tokens kept (%), {len(rows)} {args.protocol} prompts "
                                         f"of {args.length} tokens, averaged over layers and KV heads\n\n{table}\n")
    print(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in RULES:
            ax.plot(np.mean([r["per_layer"][k] for r in rows], axis=0) * 100, label=k)
        ax.set_xlabel("layer")
        ax.set_ylabel("answer tokens kept (%)")
        ax.set_title(f"{path.name}: {len(rows)} {args.protocol} prompts, {args.length} tokens, "
                     f"{args.budget}+{args.tail} per KV head", fontsize=8)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out / "per_layer.png", dpi=120)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
