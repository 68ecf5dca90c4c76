"""A plan's `stream` pattern: in chunked prefill, the layers with a scored prefill pattern evict by it while the
prompt streams (before each new prompt ubatch), and the prefill pattern compresses the prompt, its last ubatch
whole, when decoding starts.

The kept sets are checked against the numpy reference composed from the registry's patterns: the tiny fp32 Qwen2
twin of test_polykv_native (layer 0 FullKV, so layer 1 sees transformers' inputs), a 40-token prompt in ubatches
of 16, K-norm streaming (its scores depend on the keys only) and SnapKV compressing at the end, its observation
window over the candidates the stream left.
"""

import json
from dataclasses import replace

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import PlanError
from polykv_cpp.patterns import get_pattern, softmax_causal
from test_per_head import head_plan
from test_polykv_native import B_PREFILL, CFG, P, PHASE_PARAMS, hf_reference, tokens, twin  # noqa: F401

UBATCH = 16
LAYER = 1


def stream_plan(stream: str | None, selection: str = "layer") -> plan_mod.Plan:
    return replace(head_plan(LAYER, "snapkv", selection=selection), stream=stream)


def kept_when_decoding_starts(path, plan, toks, *, prefill="chunked", prefill_slack=1.0, heads=(None,)):
    """Kept positions of LAYER after the prompt (before its compression) and once it is compressed."""
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill, prefill_slack=prefill_slack)
        with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH) as ctx:
            ctx.decode(toks[:P])
            before = [ctx.kept_positions(LAYER, h) for h in heads]
            ctx.compress_prompt()
            after = [ctx.kept_positions(LAYER, h) for h in heads]
    return before, after


def reference_knorm_then_snapkv(hf_ref, budget: int, heads: list[int] | None = None):
    """K-norm makes room before each ubatch after the first; SnapKV compresses the last ubatch's candidates."""
    logp, keys = hf_ref[LAYER]
    if heads is not None:  # one KV head: its query heads' rows, its own keys
        r = CFG.n_head // CFG.n_head_kv
        logp = logp[heads[0] * r:(heads[0] + 1) * r]
        keys = keys[heads[0]:heads[0] + 1]
    snap = PHASE_PARAMS["snapkv"]
    knorm = get_pattern("knorm", n_sink=snap["n_sink"], window=snap["window"])
    cand = np.arange(0, 0)
    starts = list(range(0, P, UBATCH))
    for start in starts:
        if len(cand) > budget:
            cand = cand[knorm.select(budget, keys=keys[:, cand])]
        cand = np.concatenate([cand, np.arange(start, min(start + UBATCH, P))])
    last = np.arange(starts[-1], P)
    rows = softmax_causal(logp[:, last][:, :, cand], q_pos=last, k_pos=cand)
    final = get_pattern("snapkv", **snap).select(budget, attn=rows)
    return cand, cand[final]


def test_stream_key_round_trips_and_both_parsers_check_it(twin):
    _, path = twin
    p = stream_plan("expected_attention")
    assert json.loads(p.to_json())["stream"] == "expected_attention"
    assert plan_mod.Plan.from_json(p.to_json()).stream == "expected_attention"
    assert "stream" not in json.loads(stream_plan(None).to_json())  # plans without it are unchanged
    assert "streams by expected_attention" in p.summary() and "streams" not in stream_plan(None).summary()
    for bad in ("kvzip", "fullkv", "question", 3):
        d = json.loads(p.to_json())
        d["stream"] = bad
        with pytest.raises(PlanError, match="stream"):
            plan_mod.Plan.from_dict(d)
        with Model(path) as model:
            with pytest.raises(PlanError, match="stream"):
                model._set_native_plan(json.dumps(d), 0)


def test_the_last_ubatch_reaches_the_prefill_pattern_whole(twin, tokens, hf_reference):
    _, path = twin
    cand, final = reference_knorm_then_snapkv(hf_reference, B_PREFILL)
    before, after = kept_when_decoding_starts(path, stream_plan("knorm"), tokens)
    assert before[0] == cand.tolist()
    assert set(range(32, P)) <= set(before[0]) and len(before[0]) == B_PREFILL + P - 32
    assert after[0] == final.tolist()


def test_per_head_streaming_equals_reference(twin, tokens, hf_reference):
    _, path = twin
    heads = list(range(CFG.n_head_kv))
    before, after = kept_when_decoding_starts(path, stream_plan("knorm", "head"), tokens, heads=heads)
    for h in heads:
        cand, final = reference_knorm_then_snapkv(hf_reference, B_PREFILL, heads=[h])
        assert before[h] == cand.tolist(), f"head {h}"
        assert after[h] == final.tolist(), f"head {h}"


def test_without_a_stream_the_prompt_evicts_after_every_ubatch(twin, tokens):
    """The default is unchanged: the last ubatch is evicted with the rest, by the prefill pattern."""
    _, path = twin
    before, after = kept_when_decoding_starts(path, stream_plan(None), tokens)
    assert len(before[0]) == B_PREFILL and before == after


def test_exact_prefill_ignores_the_stream(twin, tokens):
    _, path = twin
    with_stream = kept_when_decoding_starts(path, stream_plan("knorm"), tokens, prefill="exact")
    without = kept_when_decoding_starts(path, stream_plan(None), tokens, prefill="exact")
    assert with_stream == without and len(with_stream[1][0]) == B_PREFILL


@pytest.mark.parametrize("selection", ["layer", "head"])
def test_expected_attention_streams_within_slack_times_the_budget(twin, tokens, selection):
    """Expected Attention as the stream (its statistics gathered although the prefill pattern is SnapKV): with
    slack 2 a 120-token prompt holds 2 x budget + its last ubatch while it streams, then the budget."""
    _, path = twin
    heads = list(range(CFG.n_head_kv)) if selection == "head" else [None]
    n = 3 * P
    last_start = (n - 1) // UBATCH * UBATCH
    with Model(path) as model:
        model.set_plan(stream_plan("expected_attention", selection), prefill="chunked", prefill_slack=2.0)
        with model.context(n_ctx=256, n_batch=UBATCH, n_ubatch=UBATCH) as ctx:
            ctx.decode((tokens * 3)[:n])
            for h in heads:
                kept = ctx.kept_positions(LAYER, h)
                assert len(kept) == 2 * B_PREFILL + n - last_start
                assert set(range(last_start, n)) <= set(kept)
            ctx.compress_prompt()
            assert all(len(ctx.kept_positions(LAYER, h)) == B_PREFILL for h in heads)
