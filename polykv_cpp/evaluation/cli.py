"""`polykv-cpp eval`: compare FullKV, the single-pattern baselines, PyramidKV and calibrated PolyKV plans.

    polykv-cpp eval MODEL.gguf                                  # full default sweep (long on a CPU)
    polykv-cpp eval MODEL.polykv.gguf --quick                   # smoke run: 1K tokens, 2 budgets, 3 tasks
    polykv-cpp eval MODEL.gguf --plan plan.json --budgets 256,512 --lengths 4096 --protocol query-agnostic
    polykv-cpp eval --report-only polykv-eval/                  # re-render markdown + PNGs from results.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from polykv_cpp.errors import PolyKVError


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def _names(text: str) -> list[str]:
    return [x for x in text.replace(" ", "").split(",") if x]


def _size(text: str) -> int:
    t = text.strip().lower()
    mult = 1024 if t.endswith("k") else 1
    try:
        return int(float(t.rstrip("k")) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad length {text!r} (e.g. 4096 or 4k)") from None


def _sizes(text: str) -> list[int]:
    return [_size(x) for x in text.split(",") if x.strip()]


QUICK = {"lengths": [1024], "budgets": [128, 256], "tasks": ["niah_single", "vt", "qa"], "n_samples": 1,
         "ppl_tokens": 64, "n_ppl_texts": 1}


def build_config(args: argparse.Namespace) -> Any:
    from polykv_cpp.evaluation import tasks as T
    from polykv_cpp.evaluation.runner import PROTOCOLS, EvalConfig

    if not args.model:
        raise PolyKVError("no model: give MODEL (a GGUF path or a packaged model name)")
    cfg = EvalConfig(model=args.model, out_dir=args.out)
    if args.quick:
        for k, v in QUICK.items():
            setattr(cfg, k, list(v) if isinstance(v, list) else v)
    if args.methods:
        cfg.methods = _names(args.methods)
    if args.budgets:
        cfg.budgets = args.budgets
    if args.lengths:
        cfg.lengths = args.lengths
    if args.tasks is not None:
        cfg.tasks = [] if args.tasks in ("", "none") else (list(T.RULER_TASKS) if args.tasks == "all"
                                                           else _names(args.tasks))
    if args.samples is not None:
        cfg.n_samples = args.samples
    cfg.protocols = list(PROTOCOLS) if args.protocol == "both" else [args.protocol]
    cfg.plans = args.plan or []
    cfg.plan_from_gguf = "no" if args.no_plan_from_gguf else "auto"
    cfg.haystack = args.haystack
    cfg.ppl = not args.no_ppl
    cfg.ppl_texts = args.ppl_text or []
    if args.ppl_tokens:
        cfg.ppl_tokens = args.ppl_tokens
    if args.ppl_texts:
        cfg.n_ppl_texts = args.ppl_texts
    if args.longbench is not None:
        cfg.longbench = list(T.LONGBENCH_TASKS) if args.longbench in ("all", "") else _names(args.longbench)
    cfg.longbench_dir = args.longbench_dir
    cfg.longbench_samples = args.longbench_samples
    cfg.seed = args.seed
    cfg.n_gpu_layers = args.n_gpu_layers
    cfg.n_threads = args.threads
    cfg.n_ctx = args.ctx_size
    cfg.n_batch = args.batch_size
    cfg.n_ubatch = args.ubatch_size
    cfg.prefill = args.prefill
    cfg.prefill_slack = args.prefill_slack
    cfg.prompt_probe = args.prompt_probe
    cfg.flash_attn = args.flash_attn
    cfg.type_k = args.cache_type_k
    cfg.type_v = args.cache_type_v
    cfg.chat_template = args.chat_template
    cfg.max_new_tokens = args.max_new_tokens
    cfg.reuse = not args.no_reuse
    cfg.resume = args.resume
    cfg.state_cache = args.state_cache
    cfg.png = not args.no_png
    cfg.progress = not args.no_progress
    return cfg


def cmd_eval(args: argparse.Namespace) -> int:
    from polykv_cpp import _native
    from polykv_cpp.evaluation import report

    _native.set_verbose(args.verbose)
    if args.report_only:
        try:
            data = report.load_results(args.report_only)
        except (FileNotFoundError, ValueError) as e:
            raise PolyKVError(f"--report-only: {e}") from None
        where = Path(args.report_only)
        paths = report.write_report(data, where.parent if where.suffix == ".json" else where, png=not args.no_png)
        for k, p in paths.items():
            print(f"{k}\t{p}")
        return 0
    from polykv_cpp.evaluation.runner import run_eval

    cfg = build_config(args)
    results = run_eval(cfg)
    print(report.to_markdown(results).split("\n## Runs")[0] if args.print_tables else "", end="")
    for k, p in results.get("files", {}).items():
        print(f"{k}\t{p}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from polykv_cpp.evaluation import tasks as T
    from polykv_cpp.evaluation.runner import DEFAULT_METHODS

    p = sub.add_parser(
        "eval", help="evaluate KV compression: FullKV vs baselines vs PolyKV plans over budgets",
        description=("Compare FullKV, the single-pattern baselines (streamingllm, h2o, snapkv, tova, knorm), "
                     "pyramidkv and the calibrated PolyKV plan at several average KV budgets, on RULER-style "
                     "synthetic tasks (generated offline from --seed), perplexity/KL against FullKV on long "
                     "natural text, and LongBench when its data is available locally. Both protocols "
                     "(query-aware, query-agnostic) by default. Writes results.json, results.md and PNG plots "
                     "into --out. See docs/evaluation.md."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="GGUF model (a plan in its polykv.plan key is evaluated as 'polykv'), or a packaged "
                        "model name (polykv-cpp models list)")
    p.add_argument("-o", "--out", default="polykv-eval", help="output directory")
    g = p.add_argument_group("what to compare")
    g.add_argument("--plan", action="append", metavar="[NAME=]FILE",
                   help="calibrated plan (JSON or GGUF) evaluated as method NAME (default 'polykv'); repeatable")
    g.add_argument("--no-plan-from-gguf", action="store_true", help="ignore a plan stored in MODEL")
    g.add_argument("--methods", default=None,
                   help=f"comma-separated methods (default: {','.join(DEFAULT_METHODS)}); a baseline may take "
                        "'@K' (pooling kernel, snapkv@23), '@K+S' (moved window) and '~span' (budgets split by what "
                        "each layer attends to, on models with sliding-window layers: snapkv@15+4~span)")
    g.add_argument("--budgets", type=_ints, default=None,
                   help="average KV budgets, tokens per layer (default: 128,256,512,1024)")
    g.add_argument("--protocol", choices=["both", "query-aware", "query-agnostic"], default="both")
    g = p.add_argument_group("tasks")
    g.add_argument("--lengths", type=_sizes, default=None,
                   help="prompt lengths in tokens of MODEL, answer budget included; 4k = 4096 (default: 4k,8k)")
    g.add_argument("--tasks", default=None,
                   help=f"comma-separated RULER-style tasks, 'all' or 'none' (default: all = {','.join(T.RULER_TASKS)})")
    g.add_argument("--samples", type=int, default=None, help="samples per task and length (default: 2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the synthetic tasks")
    g.add_argument("--haystack", choices=["text", "noise"], default=None,
                   help="filler of the needle tasks (default: text for niah_*, noise for vt)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="answer budget for every task")
    g.add_argument("--chat-template", default="auto", choices=["auto", *T.CHAT_FORMATS],
                   help="wrap prompts in the model's chat format (auto: from tokenizer.chat_template)")
    g = p.add_argument_group("perplexity / KL")
    g.add_argument("--no-ppl", action="store_true", help="skip perplexity and KL")
    g.add_argument("--ppl-text", action="append", metavar="FILE|DIR",
                   help="long natural text(s) (default: Python docs and IDLE sources found on this machine)")
    g.add_argument("--ppl-texts", type=int, default=None, help="how many builtin texts (default: 2)")
    g.add_argument("--ppl-tokens", type=int, default=None,
                   help="tokens scored at the end of each length, fed one at a time (default: 256)")
    g = p.add_argument_group("LongBench")
    g.add_argument("--longbench", nargs="?", const="all", default=None, metavar="TASKS",
                   help=f"also run LongBench tasks (comma-separated or all: {','.join(T.LONGBENCH_TASKS)}); "
                        "needs the data locally")
    g.add_argument("--longbench-dir", default=None, metavar="DIR",
                   help="folder with LongBench's <task>.jsonl files (else the local Hugging Face cache)")
    g.add_argument("--longbench-samples", type=int, default=5, help="samples per LongBench task")
    g = p.add_argument_group("runtime (llama.cpp spelling)")
    g.add_argument("-ngl", "--n-gpu-layers", type=int, default=-1,
                   help="layers on the GPU; -1 = all when the build has a GPU backend, else CPU")
    g.add_argument("-t", "--threads", type=int, default=None)
    g.add_argument("-c", "--ctx-size", type=int, default=None, help="default: longest sample, rounded up")
    g.add_argument("-b", "--batch-size", type=int, default=2048)
    g.add_argument("-ub", "--ubatch-size", type=int, default=512,
                   help="ubatch; with --prefill chunked the prompt is compressed after every ubatch")
    g.add_argument("--prefill", choices=["exact", "chunked"], default="exact",
                   help="exact (default): compress the prompt once, as the papers and kvpress do; one prefill per "
                        "sample is shared by every method and budget. chunked: the runtime's streaming prefill, "
                        "compressed after every ubatch; every method prefills every sample (slower)")
    g.add_argument("--prefill-slack", type=float, default=None, metavar="S",
                   help="with --prefill chunked: while the prompt streams each layer keeps up to S x its budget and "
                        "the prompt is compressed to the budget when it ends (run's --prefill-slack); default: each "
                        "plan's own prefill_slack, else 1")
    g.add_argument("--prompt-probe", type=int, default=0, metavar="N",
                   help="with --prefill chunked, query-aware: the prompt's last N tokens (the question) probe each "
                        "chunk before it is compressed (FINCH, run's --prompt-probe); 0 (default): off")
    g.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto")
    g.add_argument("-ctk", "--cache-type-k", default="f16")
    g.add_argument("-ctv", "--cache-type-v", default="f16")
    g = p.add_argument_group("run control")
    g.add_argument("--quick", action="store_true",
                   help="smoke run: lengths 1k, budgets 128,256, tasks niah_single,vt,qa, 1 sample, 64 ppl tokens")
    g.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    g.add_argument("--state-cache", metavar="DIR", default=None,
                   help="keep each prompt's prefilled state in DIR (~130 MB per 4K prompt of a 0.5B model) and load "
                        "it in later evaluations of the same samples instead of prefilling again (exact prefill); KVzip's "
                        "scored states too, so later KVzip plans run no reconstruction pass")
    g.add_argument("--no-reuse", action="store_true",
                   help="recompute everything (no FullKV copies, no shared prefill state)")
    g.add_argument("--report-only", metavar="DIR", default=None,
                   help="re-render results.md and the plots from DIR/results.json; runs nothing")
    g.add_argument("--no-png", action="store_true", help="no plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--print-tables", action="store_true", help="print the markdown tables at the end")
    g.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    p.set_defaults(func=cmd_eval)
    return p


def register_cli(subparsers: Any) -> None:
    add_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    """`python -m polykv_cpp.evaluation.cli ...` (same as `polykv-cpp eval ...`)."""
    from polykv_cpp.cli import main as cli_main

    return cli_main(["eval", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
