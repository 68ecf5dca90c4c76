"""Share plans for Gemma-3-270M: each layer's budget in proportion to what it can attend to (its span)."""
import copy, json, sys
SWA = [i not in (5, 11, 17) for i in range(18)]
N_CTX = 4352
def share_plan(src, out, swa_factor, note, b_min=32):
    p = json.load(open(src))
    spans = [512 * swa_factor if s else N_CTX for s in SWA]
    tot = sum(spans)
    p = copy.deepcopy(p)
    p["budget_rule"] = "manual"
    p["b_min"] = b_min
    p["exact_total"] = False
    p["provenance"]["extra"] = {"note": note}
    for lp, sp in zip(p["layers"], spans):
        for ph in ("prefill", "decode"):
            d = lp[ph]
            d.pop("budget", None)
            d["share"] = sp / tot
    json.dump(p, open(out, "w"), indent=1)
O = "results/screen-gemma-span-seed1000/plans/"
share_plan("plans/gemma-3-270m-q4_k_m.snapkv15s4.b512.json", O + "snapkv15s4-span.json", 1,
           "uniform snapkv@15+4, budgets in proportion to each layer's span (window 512 or n_ctx 4352), b_min 32")
share_plan("plans/gemma-3-270m-q4_k_m.snapkv15s4.b512.json", O + "snapkv15s4-span4.json", 0.25,
           "uniform snapkv@15+4, budgets in proportion to span, sliding-window layers' span counted a quarter, b_min 32")
share_plan("results/eval-gemma-4k-qag-kvzip-prompt/plans/kvzip-prompt-keep.b128.json", O + "kvzip-prompt-keep-span.json", 1,
           "the Gemma kvzip-prompt-keep plan with budgets in proportion to span (b_min 4 as the plan)", b_min=4)
