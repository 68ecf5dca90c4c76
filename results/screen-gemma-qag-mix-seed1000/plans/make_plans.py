"""Gemma-3-270M query-agnostic screen at small budgets: the span-split KVzip plan with H2O in some layers.

At 128 and 256 of 4K, query-agnostic, uniform H2O scores `cwe` (word counts) where the span-split KVzip plan
scores nothing; these plans give H2O's prefill selection to the global layers (5, 11, 17) or to the
sliding-window layers, KVzip keeping the rest, budgets split by span as the KVzip span plan.
"""
import copy, json
from polykv_cpp.plan import uniform_plan

GLOBAL = (5, 11, 17)
O = "results/screen-gemma-qag-mix-seed1000/plans/"
SRC = "results/screen-gemma-span-seed1000/plans/kvzip-prompt-keep-span.json"
h2o = uniform_plan(18, "h2o", 128, selection="head").to_dict()["layers"][0]


def mix(out, h2o_layers, note):
    p = copy.deepcopy(json.load(open(SRC)))
    p["provenance"]["extra"] = {"note": note}
    for lp in p["layers"]:
        if lp["layer"] in h2o_layers:
            for ph in ("prefill", "decode"):
                d = copy.deepcopy(h2o[ph])
                d.pop("budget", None)
                d["share"] = lp[ph]["share"]
                lp[ph] = d
    json.dump(p, open(out, "w"), indent=1)


mix(O + "kvzip-span-h2o-global.json", GLOBAL,
    "kvzip-prompt-keep-span with per-head h2o in the global layers 5, 11, 17 (both phases)")
mix(O + "kvzip-span-h2o-swa.json", [i for i in range(18) if i not in GLOBAL],
    "kvzip-prompt-keep-span with per-head h2o in the 15 sliding-window layers (both phases)")
for g in GLOBAL:
    mix(O + f"kvzip-span-h2o-l{g}.json", (g,), f"kvzip-prompt-keep-span with per-head h2o in global layer {g} only")
