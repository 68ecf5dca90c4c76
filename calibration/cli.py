"""``polykv-cpp calibrate``: build a PolyKV plan from a Hugging Face checkpoint and write it into a new GGUF.

Heavy imports (torch, transformers, datasets) happen inside the handler, so the rest of the CLI works
without them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from polykv_cpp.errors import CalibrationError

from calibration.core import (CALIBRATED_EVICT_EVERY, CALIBRATED_POOL_KERNEL, CALIBRATED_POOL_SHIFT, DEFAULT_CTX,
                              DEFAULT_N_CONT, DEFAULT_PATTERNS, DEFAULT_SAMPLES, DEFAULT_SPAN_CTX, RUNTIME_PATTERNS)
from calibration.runtime import DEFAULT_MIN_GAIN, DEFAULT_SAMPLES as RUNTIME_SAMPLES, OBJECTIVES, TASKS_DATASET

PROTOCOL_CHOICES = {"query-aware": ("query-aware",), "query-agnostic": ("query-agnostic",),
                    "both": ("query-aware", "query-agnostic")}


def _csv(s: str) -> list[str]:
    return [x.strip().lower() for x in s.split(",") if x.strip()]


def _params(items: list[str] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for it in items or []:
        try:
            lhs, val = it.split("=", 1)
            name, key = lhs.split(".", 1)
        except ValueError:
            raise CalibrationError(f"--param expects PATTERN.KEY=VALUE (got {it!r})") from None
        v: Any = val
        try:
            v = int(val)
        except ValueError:
            pass
        out.setdefault(name.strip().lower(), {})[key.strip()] = v
    return out


def cmd_calibrate(args: argparse.Namespace) -> int:
    if args.method == "runtime":
        return _cmd_runtime(args)
    if args.dataset == TASKS_DATASET:
        raise CalibrationError("--dataset tasks needs --method runtime (the tasks are scored on the model's own "
                               "FullKV answers, through the runtime)")
    from calibration.core import calibrate

    if args.samples is None:
        args.samples = DEFAULT_SAMPLES
    hf = args.hf
    if hf is None:
        from calibration.checkpoint import hf_from_gguf
        hf = hf_from_gguf(args.gguf, log=lambda m: print(m, file=sys.stderr))
    res = calibrate(
        hf, args.gguf, args.out, budget=args.budget, dataset=args.dataset, samples=args.samples, ctx=args.ctx,
        n_cont=args.n_cont, patterns=_csv(args.patterns or ",".join(DEFAULT_PATTERNS)), phases=_csv(args.phases),
        b_min=args.b_min,
        signal=args.signal, sensitivity=args.sensitivity, budget_rule=args.budget_rule, device=args.device,
        plan_out=args.plan_out, seed=args.seed, text_field=args.text_field, split=args.split,
        pattern_params=_params(args.param), fullkv_below=args.fullkv_below,
        reuse_signals=not args.no_reuse, progress=not args.quiet, evict_every=args.evict_every,
        span_ctx=args.span_ctx)
    plan = res.plan
    print(plan.summary())
    if res.out is not None:
        print(f"wrote {res.out}")
    if args.plan_out:
        print(f"wrote {args.plan_out}")
    print(f"signals: {res.signals_path}{' (reused)' if res.reused_signals else ''}; wall time {res.wall_s:.1f} s")
    return 0


def _cmd_runtime(args: argparse.Namespace) -> int:
    from calibration.runtime import runtime_calibrate

    if args.hf:
        raise CalibrationError("--hf is not used by --method runtime (it measures the GGUF itself)")
    if args.span_ctx != DEFAULT_SPAN_CTX:
        raise CalibrationError("--span-ctx is not used by --method runtime (it measures the split by span at --ctx "
                               "and keeps it only if the loss drops)")
    res = runtime_calibrate(
        args.gguf, args.out, budget=args.budget, samples=args.samples or RUNTIME_SAMPLES, ctx=args.ctx,
        n_cont=args.n_cont, patterns=_csv(args.patterns or ",".join(RUNTIME_PATTERNS)), b_min=args.b_min,
        dataset=args.dataset, seed=args.seed,
        text_field=args.text_field, split=args.split, tasks=_csv(args.tasks) if args.tasks else None,
        protocols=PROTOCOL_CHOICES[args.protocol], objective=args.objective,
        budget_moves=not args.no_budget_moves, budgets_from_scores=args.budgets_from_scores,
        prompt_budgets=not args.no_prompt_budgets, score_pattern=args.score_pattern, min_gain=args.min_gain,
        plan_out=args.plan_out, n_threads=args.threads, progress=not args.quiet, evict_every=args.evict_every)
    print(res.plan.summary())
    what = {"kl": "KL vs FullKV", "top1": "top-1 misses vs FullKV"}[res.objective]
    print(f"{what} on the calibration continuations: " +
          ", ".join(f"uniform {k} {v:.4f}" for k, v in res.loss_uniform.items()) + f"; plan {res.loss_plan:.4f}")
    if res.out is not None:
        print(f"wrote {res.out}")
    if args.plan_out:
        print(f"wrote {args.plan_out}")
    print(f"{res.n_measured} plans measured; wall time {res.wall_s:.1f} s")
    return 0


def register_cli(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "calibrate", help="build a PolyKV plan from a Hugging Face checkpoint (needs torch + transformers)",
        description="Run calibration texts through the Hugging Face twin of a GGUF model, measure per-layer "
                    "pattern-preference and budget-sensitivity signals, build a plan, and write a NEW GGUF = "
                    "the input + polykv.plan metadata (the input is never modified). See docs/calibration.md.")
    p.add_argument("--hf", metavar="DIR", help="Hugging Face checkpoint directory (config.json, weights, ideally "
                   "the tokenizer) of the same model as --gguf. Default: transformers converts the GGUF itself "
                   "(dequantized) into ~/.cache/polykv-cpp/hf/<name>, once")
    p.add_argument("--gguf", required=True, metavar="FILE", help="the model GGUF the plan is for")
    p.add_argument("--out", metavar="FILE",
                   help="output GGUF (input + plan); a new file. A plan calibrated with --protocol query-agnostic "
                        "goes to its polykv.plan_query_agnostic key (the input's polykv.plan stays), any other to "
                        "polykv.plan (the input's query-agnostic plan stays)")
    p.add_argument("--plan-out", metavar="FILE", help="also write the plan as JSON")
    p.add_argument("--budget", type=int, default=512, help="average KV tokens per layer (default 512)")
    p.add_argument("--dataset", default="builtin", help="builtin (offline: Python stdlib sources; default), "
                   "generated, tasks (--method runtime: the eval's synthetic tasks, another seed), a local "
                   ".txt/.json/.jsonl/.parquet file or directory, or a HF dataset name[:config]")
    p.add_argument("--text-field", default="text", help="text field of json/jsonl/parquet/HF records")
    p.add_argument("--split", default="train", help="split of a HF dataset (default train)")
    p.add_argument("--method", default="transformers", choices=("transformers", "runtime"),
                   help="transformers (default): paper-style per-layer signals on the Hugging Face twin; runtime: "
                        "search the plan on the GGUF itself through the native cache, by the KL of the "
                        "continuation against FullKV (no checkpoint, no torch; see docs/calibration.md)")
    p.add_argument("--samples", type=int, default=None, help=f"calibration samples (default {DEFAULT_SAMPLES}; "
                   f"runtime: {RUNTIME_SAMPLES})")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help=f"tokens per sample (default {DEFAULT_CTX})")
    p.add_argument("--n-cont", type=int, default=DEFAULT_N_CONT, help="continuation tokens at the end of each "
                   f"sample whose queries are scored (default {DEFAULT_N_CONT})")
    p.add_argument("--patterns", default=None, help="candidate patterns, comma-separated (default "
                   f"{','.join(DEFAULT_PATTERNS)}, runtime: {','.join(RUNTIME_PATTERNS)}; also pyramidkv, fullkv; "
                   "runtime: per-head variants such as snapkv-head and pooling windows such as snapkv@23 or "
                   "snapkv@15+4)")
    p.add_argument("--param", action="append", metavar="PATTERN.KEY=VALUE",
                   help="pattern parameter, e.g. snapkv.obs_window=16 (repeatable; snapkv and pyramidkv pool over "
                   f"{CALIBRATED_POOL_KERNEL} positions moved {CALIBRATED_POOL_SHIFT} after a score unless "
                   "snapkv.pool_kernel is given)")
    p.add_argument("--phases", default="prefill,decode", help="phases to calibrate (default prefill,decode; a "
                   "phase left out copies the other's choice)")
    p.add_argument("--b-min", type=int, default=None, help="minimum budget per layer (default max(budget/4, "
                   "largest sink+window of the candidates))")
    p.add_argument("--budget-rule", default="sensitivity", choices=("sensitivity", "uniform", "pyramid"))
    p.add_argument("--signal", default="cosine", choices=("cosine", "ppl"),
                   help="pattern preference: cosine of the layer output (default) or perplexity increase (slow)")
    p.add_argument("--sensitivity", default="entropy", choices=("entropy", "cosine", "ppl"),
                   help="budget sensitivity signal (default entropy)")
    p.add_argument("--fullkv-below", type=float, default=0.9, help="with fullkv among --patterns: layers whose "
                   "best pattern scores below this become FullKV (default 0.9)")
    p.add_argument("--evict-every", type=int, default=CALIBRATED_EVICT_EVERY, metavar="K",
                   help=f"the plan's \"evict_every\": decode evicts once per K generated tokens (default "
                        f"{CALIBRATED_EVICT_EVERY}; 1: after every token)")
    p.add_argument("--span-ctx", type=int, default=DEFAULT_SPAN_CTX, metavar="N",
                   help="on a model with sliding-window layers (Gemma 3), split the budgets by span: every layer "
                        "the same share of what it attends to, a global layer's span counted as N tokens (default "
                        f"{DEFAULT_SPAN_CTX}; 0: the plain split). The runtime method measures the split instead")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reuse", action="store_true", help="recompute signals even if a signals file matches")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("runtime method")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads of the runtime")
    g.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN,
                   help=f"keep a change when it lowers the KL by more than this fraction (default {DEFAULT_MIN_GAIN})")
    g.add_argument("--no-budget-moves", action="store_true", help="search patterns only (uniform budgets)")
    g.add_argument("--no-prompt-budgets", action="store_true",
                   help="do not try the searched plan with its budgets re-split per prompt by the prompt's own "
                        "scores (\"allocation\": \"prompt\" and \"prompt_median\"; tried last, the better kept if "
                        "the loss drops)")
    g.add_argument("--budgets-from-scores", action="store_true",
                   help="before the search, give each layer the share of the best uniform pattern's top-scored "
                        "(head, token) pairs under one model-wide threshold (KVzip's / Ada-KV's global rule), "
                        "kept if the loss does not rise")
    g.add_argument("--score-pattern", default=None, metavar="PATTERN",
                   help="with --budgets-from-scores (implied): take the shares from this pattern's scores instead "
                        "of the best uniform candidate's, e.g. kvzip-head budgets for expected_attention-head "
                        "layers (the plan then needs no reconstruction pass)")
    g.add_argument("--tasks", default=None, metavar="LIST",
                   help="with --dataset tasks: comma list of the eval's synthetic tasks (default: all)")
    g.add_argument("--objective", default=None, choices=list(OBJECTIVES),
                   help="what the search minimizes (default: kl on texts, top1 on tasks)")
    g.add_argument("--protocol", default="query-aware", choices=list(PROTOCOL_CHOICES),
                   help="with --dataset tasks: what is compressed (default query-aware: the whole prompt)")
    p.set_defaults(func=cmd_calibrate)
