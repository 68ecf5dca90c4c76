"""Per-layer budgets that per-prompt allocation gives three calibration prompts (seed 1000, 1K, query-agnostic),
by the raw per-head KVzip scores and by the scores relative to each set's median, at 128 tokens per layer.

    python results/screen-kvzip-median-seed1000-qag/layer_budgets.py > .../layer_budgets.txt

The scores are those the runtime ranks (`kept_scores` after KVzip's reconstruction pass in a portable context,
the shipped plan's sinks protected); the split is `polykv_cpp.patterns.allocate_prompt` (floor 4 per KV head)."""
import numpy as np

from polykv_cpp import plan as plan_mod
from polykv_cpp.evaluation.runner import KVZIP_ROOM, EvalConfig, Evaluator
from polykv_cpp.patterns import _protect, allocate_prompt

TASKS = ["niah_multikey", "niah_multiquery", "qa"]
B = 128
ev = Evaluator(EvalConfig(model="qwen2.5-coder-0.5b-instruct-q4_k_m", out_dir="/tmp/layer-budgets-kvzip", tasks=TASKS,
                          lengths=[1024], n_samples=1, seed=1000, ppl=False, methods=["fullkv"], progress=False,
                          protocols=["query-agnostic"]))
ev.build_samples()
plan = plan_mod.load("plans/qwen2.5-coder-0.5b-instruct-q4_k_m.kvzip-prompt-keep.b128.json")
n_sink = plan.layers[0].prefill.n_sink
for s in ev.samples:
    ctx_tokens = ev.prompts[s.key].part1
    ev.model.set_plan(plan, prefill="portable")
    with ev.model.context(n_ctx=2048, n_batch=2048, n_ubatch=512) as ctx:
        ctx.decode(ctx_tokens)
        ctx.score_prompt_kvzip(ctx_tokens, prefix=ev.model.kvzip_prefix(), chunk=KVZIP_ROOM)
        sets = [[ctx.kept_scores(il, h).astype(np.float64) for h in range(2)] for il in range(24)]
    print(f"== {s.task} (sample 0, seed 1000, {len(ctx_tokens)} context tokens)")
    meds = [np.median(sc[np.isfinite(sc)]) for layer in sets for sc in layer]
    print("median score per (layer, head): " + " ".join(f"{m:.1e}" for m in meds))
    for relative in (False, True):
        ranked = [[_protect(sc.copy(), B, n_sink, 0) for sc in layer] for layer in sets]
        got = allocate_prompt(ranked, [B] * 24, [2] * 24, plan.b_min, relative=relative)
        print(f"{B:4d} {'median' if relative else 'raw':6s} {got}")
