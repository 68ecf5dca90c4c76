"""Per-layer budgets that per-prompt allocation gives four calibration prompts (seed 1000, 4K, query-aware), by the
raw per-head SnapKV scores (kernel 15, shift 4, window 32) and by the scores relative to each set's median.

    python results/screen-head-prompt-median-seed1000-qa/layer_budgets.py > .../layer_budgets.txt

The scores are those the runtime ranks (a portable context's `kept_scores` after the prompt); the split is
`polykv_cpp.patterns.allocate_prompt` (floor 32 per KV head), as the runtime computes it."""
import numpy as np

from polykv_cpp import plan as plan_mod
from polykv_cpp.evaluation.runner import EvalConfig, Evaluator
from polykv_cpp.patterns import _protect, allocate_prompt

TASKS = ["niah_multivalue", "niah_multiquery", "qa", "cwe"]
ev = Evaluator(EvalConfig(model="qwen2.5-coder-0.5b-instruct-q4_k_m", out_dir="/tmp/layer-budgets", tasks=TASKS,
                          lengths=[4096], n_samples=1, seed=1000, ppl=False, methods=["fullkv"], progress=False))
ev.build_samples()
plan = plan_mod.uniform_plan(24, "snapkv", 256, pool_kernel=15, pool_shift=4, selection="head")
for s in ev.samples:
    ev.model.set_plan(plan, prefill="portable")
    with ev.model.context(n_ctx=4352, n_batch=2048, n_ubatch=512) as ctx:
        ctx.decode(ev.prompts[s.key].tokens)
        sets = [[ctx.kept_scores(il, h).astype(np.float64) for h in range(2)] for il in range(24)]
    print(f"== {s.task} (sample 0, seed 1000)")
    for b in (128, 256):
        for relative in (False, True):
            ranked = [[_protect(sc.copy(), b, 0, 32) for sc in layer] for layer in sets]
            got = allocate_prompt(ranked, [b] * 24, [2] * 24, 32, relative=relative)
            print(f"{b:4d} {'median' if relative else 'raw':6s} layers 0-3: {sum(got[:4]) / 4:5.0f}  "
                  f"4-12: {sum(got[4:13]) / 9:5.0f}  13-19: {sum(got[13:20]) / 7:5.0f}  20-23: {sum(got[20:]) / 4:5.0f}  {got}")
