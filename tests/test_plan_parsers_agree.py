"""The native plan parser and Python's `Plan.from_json(...).validate()` accept and refuse the same texts (#16 items
1 and 5). Each case below is a kind of input the differential fuzz (`scripts/fuzz_plans.py`) found the two parsers
disagreeing on before they were aligned; the fuzz itself runs for 30 s at the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polykv_cpp import _native
from polykv_cpp import plan as P
from polykv_cpp.api import Model

GOOD = json.loads(P.uniform_plan(2, "snapkv", 48).to_json())
MIXED = json.loads(P.Plan.from_dict({**GOOD, "full_charge": 32, "layers": [  # layer 1 gets 2 x 48 - 32 tokens
    {"layer": 0, "prefill": {"pattern": "fullkv", "budget": "full"}, "decode": {"pattern": "fullkv", "budget": "full"}},
    {"layer": 1, "prefill": {**GOOD["layers"][1]["prefill"], "budget": 64},
     "decode": {**GOOD["layers"][1]["decode"], "budget": 64}}]}).validate().to_json())

PROMPT = {**GOOD, "allocation": "prompt"}


def edit(base, path, value=None, delete=False):
    d = json.loads(base if isinstance(base, str) else json.dumps(base))
    node = d
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return json.dumps(d, allow_nan=True)


CASES = {
    "good": (json.dumps(GOOD), True),
    "unknown top-level key": (edit(GOOD, ["colour"], "red"), False),
    "unknown phase key": (edit(GOOD, ["layers", 0, "decode", "b_min"], 3), False),
    "empty key": (edit(GOOD, ["layers", 1, "prefill", ""], 0), False),
    "budgets do not sum to n_layer x budget_avg": (edit(GOOD, ["layers", 0, "prefill", "budget"], 40), False),
    "budgets do not sum, exact_total false": (edit(edit(GOOD, ["exact_total"], False), ["layers", 0, "prefill",
                                                                                        "budget"], 40), True),
    "exact_total not a bool": (edit(GOOD, ["exact_total"], 1), False),
    "budget_rule not a string": (edit(GOOD, ["budget_rule"], 3), False),
    "missing budget_avg": (edit(GOOD, ["budget_avg"], delete=True), False),
    "b_min above budget_avg": (edit(GOOD, ["b_min"], 49), False),
    "budget below b_min": (edit(edit(GOOD, ["b_min"], 48), ["layers", 0, "prefill", "budget"], 47), False),
    "snapkv without obs_window": (edit(GOOD, ["layers", 1, "decode", "obs_window"], delete=True), False),
    "window larger than the budget": (edit(GOOD, ["layers", 1, "decode", "window"], 60), False),
    "format of another tool": (edit(GOOD, ["format"], "other"), False),
    "full_charge beyond int32": (edit(GOOD, ["full_charge"], 2**31), False),
    "budget_avg beyond int32": (edit(GOOD, ["budget_avg"], 2**63), False),
    "provenance not an object": (edit(GOOD, ["provenance"], 3), False),
    "provenance.signals not a list": (edit(GOOD, ["provenance", "signals"], 0), False),
    "provenance.extra a list": (edit(GOOD, ["provenance", "extra"], []), False),
    "provenance.model for 3 layers": (edit(GOOD, ["provenance", "model"], {"n_layer": 3}), False),
    "provenance.extra holds a huge integer": (edit(GOOD, ["provenance", "extra"], {"n": 2**70}), True),
    "fullkv with pool_kernel -1": (edit(MIXED, ["layers", 0, "prefill", "pool_kernel"], -1), True),
    "fullkv with a budget": (edit(MIXED, ["layers", 0, "prefill", "budget"], 64), False),
    "fullkv layers without full_charge": (edit(MIXED, ["full_charge"], None), False),
    "NaN literal": (json.dumps(GOOD)[:-1] + ', "provenance": {"extra": {"x": NaN}}}', False),
    "number too large for a double": (edit(GOOD, ["provenance", "extra"], {"x": 1}).replace('"x": 1', '"x": 1e400'),
                                      False),
    "layers out of order": (json.dumps({**GOOD, "layers": GOOD["layers"][::-1]}), False),
    "per head in prefill, per layer in decode": (edit(GOOD, ["layers", 0, "prefill", "selection"], "head"), False),
    "stream by expected_attention": (edit(GOOD, ["stream"], "expected_attention"), True),
    "stream by kvzip (needs the whole prompt)": (edit(GOOD, ["stream"], "kvzip"), False),
    "stream null": (edit(GOOD, ["stream"], None), False),
    "prefill_slack 2": (edit(GOOD, ["prefill_slack"], 2), True),
    "prefill_slack 1.5": (edit(GOOD, ["prefill_slack"], 1.5), True),
    "prefill_slack below 1": (edit(GOOD, ["prefill_slack"], 0.5), False),
    "prefill_slack huge": (edit(GOOD, ["prefill_slack"], 1e7), False),
    "prefill_slack a bool": (edit(GOOD, ["prefill_slack"], True), False),
    "prefill_slack a string": (edit(GOOD, ["prefill_slack"], "2"), False),
    "prefill_slack null": (edit(GOOD, ["prefill_slack"], None), False),
    "protect_tail 32": (edit(GOOD, ["protect_tail"], 32), True),
    "protect_tail null (absent)": (edit(GOOD, ["protect_tail"], None), True),
    "protect_tail negative": (edit(GOOD, ["protect_tail"], -1), False),
    "protect_tail a float": (edit(GOOD, ["protect_tail"], 2.5), False),
    "protect_tail a bool": (edit(GOOD, ["protect_tail"], True), False),
    "protect_tail beyond int32": (edit(GOOD, ["protect_tail"], 2**31), False),
    "pool_shift 3 of kernel 7": (edit(GOOD, ["layers", 1, "decode", "pool_shift"], 3), True),
    "pool_shift -3 of kernel 7": (edit(GOOD, ["layers", 1, "decode", "pool_shift"], -3), True),
    "pool_shift 4 of kernel 7": (edit(GOOD, ["layers", 1, "decode", "pool_shift"], 4), False),
    "pool_shift without pool_kernel": (edit(edit(GOOD, ["layers", 0, "prefill", "pool_kernel"], delete=True),
                                            ["layers", 0, "prefill", "pool_shift"], 1), False),
    "pool_shift a float": (edit(GOOD, ["layers", 0, "prefill", "pool_shift"], 1.5), False),
    "pool_shift below int32": (edit(GOOD, ["layers", 0, "prefill", "pool_shift"], -2**31), False),
    "evict_every 16": (edit(GOOD, ["evict_every"], 16), True),
    "evict_every 65536": (edit(GOOD, ["evict_every"], 65536), True),
    "evict_every null (absent)": (edit(GOOD, ["evict_every"], None), True),
    "evict_every 0": (edit(GOOD, ["evict_every"], 0), False),
    "evict_every 65537": (edit(GOOD, ["evict_every"], 65537), False),
    "evict_every a float": (edit(GOOD, ["evict_every"], 1.5), False),
    "evict_every a string": (edit(GOOD, ["evict_every"], "8"), False),
    "allocation_cap 4, per-prompt budgets": (edit(PROMPT, ["allocation_cap"], 4), True),
    "allocation_cap 1.5, relative budgets": (edit(edit(PROMPT, ["allocation"], "prompt_median"), ["allocation_cap"],
                                                  1.5), True),
    "allocation_cap null (absent)": (edit(PROMPT, ["allocation_cap"], None), True),
    "allocation_cap below 1": (edit(PROMPT, ["allocation_cap"], 0.5), False),
    "allocation_cap huge": (edit(PROMPT, ["allocation_cap"], 1e7), False),
    "allocation_cap a bool": (edit(PROMPT, ["allocation_cap"], True), False),
    "allocation_cap a string": (edit(PROMPT, ["allocation_cap"], "2"), False),
    "allocation_cap without per-prompt budgets": (edit(GOOD, ["allocation_cap"], 2), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_both_parsers_give_the_same_verdict(tiny_gguf, name):
    text, want = CASES[name]
    try:
        P.Plan.from_json(text).validate(n_layer=2)
        python = True
    except P.PlanError:
        python = False
    lib = _native.load()
    with Model(tiny_gguf) as model:
        native = lib.llama_polykv_set_model_plan(model.ptr, text.encode(), 0) == 0
        message = _native.ffi.string(lib.llama_polykv_last_error()).decode()
        lib.llama_polykv_set_model_plan(model.ptr, _native.ffi.NULL, 0)
    assert (python, native) == (want, want), message


def test_differential_fuzz_finds_nothing(tmp_path):
    script = Path(__file__).parents[1] / "scripts" / "fuzz_plans.py"
    proc = subprocess.run([sys.executable, str(script), "--seconds", "30", "--seed", "1", "--corpus",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert proc.returncode == 0 and report["findings"] == [], proc.stdout[-3000:] + proc.stderr[-2000:]
    assert report["execs"] >= 10_000 and report["python_accept"] > 100 and report["ran"] > 0
