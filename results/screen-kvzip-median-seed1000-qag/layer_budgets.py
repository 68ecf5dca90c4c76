"""Per-layer budgets that per-prompt allocation gives three calibration prompts (seed 1000, 1K, query-agnostic),
by the raw per-head KVzip scores and by the scores relative to each set's median, at 128 tokens per layer;
with ``4096`` as argument, one prompt at 4K (niah_multiquery) at 128, 256 and 512, raw scores only.

    python results/screen-kvzip-median-seed1000-qag/layer_budgets.py > .../layer_budgets.txt
    python results/screen-kvzip-median-seed1000-qag/layer_budgets.py 4096 > .../layer_budgets_4k.txt

The scores are those the runtime ranks (`kept_scores` after KVzip's reconstruction pass in a portable context,
the shipped plan's sinks protected); the split is `polykv_cpp.patterns.allocate_prompt` (floor 4 per KV head)."""
import sys

import numpy as np

from polykv_cpp import plan as plan_mod
from polykv_cpp.evaluation.runner import KVZIP_ROOM, EvalConfig, Evaluator
from polykv_cpp.patterns import _protect, allocate_prompt

LENGTH = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
TASKS = ["niah_multikey", "niah_multiquery", "qa"] if LENGTH == 1024 else ["niah_multiquery"]
BUDGETS = [128] if LENGTH == 1024 else [128, 256, 512]
ev = Evaluator(EvalConfig(model="qwen2.5-coder-0.5b-instruct-q4_k_m", out_dir="/tmp/layer-budgets-kvzip", tasks=TASKS,
                          lengths=[LENGTH], n_samples=1, seed=1000, ppl=False, methods=["fullkv"], progress=False,
                          protocols=["query-agnostic"]))
ev.build_samples()
plan = plan_mod.load("plans/qwen2.5-coder-0.5b-instruct-q4_k_m.kvzip-prompt-keep.b128.json")
n_sink = plan.layers[0].prefill.n_sink
for s in ev.samples:
    ctx_tokens = ev.prompts[s.key].part1
    ev.model.set_plan(plan, prefill="portable")
    with ev.model.context(n_ctx=LENGTH + 1024, n_batch=2048, n_ubatch=512) as ctx:
        ctx.decode(ctx_tokens)
        ctx.score_prompt_kvzip(ctx_tokens, prefix=ev.model.kvzip_prefix(), chunk=KVZIP_ROOM)
        sets = [[ctx.kept_scores(il, h).astype(np.float64) for h in range(2)] for il in range(24)]
    print(f"== {s.task} (sample 0, seed 1000, {len(ctx_tokens)} context tokens)")
    meds = [np.median(sc[np.isfinite(sc)]) for layer in sets for sc in layer]
    print("median score per (layer, head): " + " ".join(f"{m:.1e}" for m in meds))
    for b in BUDGETS:
        for relative in ((False, True) if LENGTH == 1024 else (False,)):
            ranked = [[_protect(sc.copy(), b, n_sink, 0) for sc in layer] for layer in sets]
            got = allocate_prompt(ranked, [b] * 24, [2] * 24, plan.b_min, relative=relative)
            print(f"{b:4d} {'median' if relative else 'raw':6s} {got}")
