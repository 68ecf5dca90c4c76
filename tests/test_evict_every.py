"""The plan key ``evict_every`` (batched decode eviction) against the numpy reference.

With ``evict_every`` k a layer is brought back to its decode budget only once it holds k tokens more than the
budget (per KV head; an adaptive layer in all its heads together): the kept positions after the prompt and after
each decode step equal `polykv_cpp.patterns.simulate` / `simulate_heads` with the same k, on the attention
transformers computes on the same weights (the tiny fp32 twin of test_polykv_native), per layer, per head and
adaptive. Between evictions the cache holds up to budget + k - 1 tokens, and its capacity has room for them.
"""

import dataclasses

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.patterns import pattern_from_phase_plan, simulate, simulate_heads
from test_per_head import HEAD_PATTERNS, head_plan, run_heads
from conftest import padded
from test_polykv_native import (B_DECODE, B_PREFILL, CFG, N, P, PHASE_PARAMS, hf_reference, one_layer_plan,  # noqa: F401
                                run_native, tokens, twin)

torch = pytest.importorskip("torch")

K = 3  # with B_DECODE 16 after a prefill of 20: evictions at decode steps 1, 4 and 7 of 8


def every(plan: plan_mod.Plan, k: int = K) -> plan_mod.Plan:
    return dataclasses.replace(plan, evict_every=k).validate()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("pattern", sorted(PHASE_PARAMS))
def test_per_layer_kept_positions_equal_reference(twin, tokens, hf_reference, pattern, flash_attn):
    _, path = twin
    layer = 1
    plan = every(one_layer_plan(layer, pattern))
    kept, _ = run_native(path, plan, tokens, layer, flash_attn=flash_attn)
    logp, keys = hf_reference[layer]
    pp = plan.layers[layer]
    ref = simulate(logp, P, prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
                   decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys, evict_every=K)
    assert kept[0] == ref.prefill_kept.tolist(), "after prefill"
    for step in range(N):
        assert kept[step + 1] == ref.decode_kept[step].tolist(), f"after decode step {step + 1}"
    # the cache grows between evictions, up to budget + K - 1, and comes back to the budget
    assert [len(k) for k in kept[1:]] == [16, 17, 18, 16, 17, 18, 16, 17]


@pytest.mark.parametrize("pattern", HEAD_PATTERNS)
@pytest.mark.parametrize("selection", ["head", "adaptive"])
def test_per_head_and_adaptive_kept_positions_equal_reference(twin, tokens, hf_reference, pattern, selection):
    if selection == "adaptive" and pattern == "knorm":
        pytest.skip("flash attention's f16 keys tie K-norm scores at this precision (test_adaptive_heads)")
    _, path = twin
    layer = 0
    plan = every(head_plan(layer, pattern, selection=selection))
    kept, _ = run_heads(path, plan, tokens, layer)
    logp, keys = hf_reference[layer]
    pp = plan.layers[layer]
    ref = simulate_heads(logp, P, CFG.n_head_kv, prefill=pattern_from_phase_plan(pp.prefill),
                         prefill_budget=B_PREFILL, decode=pattern_from_phase_plan(pp.decode),
                         decode_budget=B_DECODE, keys=keys, adaptive=selection == "adaptive", evict_every=K)
    for h in range(CFG.n_head_kv):
        assert kept[0][h] == ref[h].prefill_kept.tolist(), f"head {h} after prefill"
        for step in range(N):
            assert kept[step + 1][h] == ref[h].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"
    held = [sum(len(kept[s][h]) for h in range(CFG.n_head_kv)) for s in range(1, N + 1)]
    assert held == [CFG.n_head_kv * b for b in (16, 17, 18, 16, 17, 18, 16, 17)]


def test_capacity_has_room_for_the_tokens_between_evictions(twin, tokens):
    _, path = twin
    plan = plan_mod.uniform_plan(CFG.n_layer, "tova", B_DECODE)
    for k in (1, 300):
        with Model(path) as model:
            model.set_plan(every(plan, k))
            with model.context(n_ctx=2048, n_batch=32, n_ubatch=32) as ctx:
                ctx.decode(tokens[:P], phase="prefill")
                for t in tokens[P:]:
                    ctx.decode([t], phase="decode")
                caps = {s.capacity for s in ctx.kv_layer_stats()}
                pad = ctx.kv_layer_stats()[0].cell_pad
                used = {s.used for s in ctx.kv_layer_stats()}
                ms, steps = ctx.decode_timing()
            # the host time of the decode steps' evictions, step by step; with k = 300 no step evicts, and the
            # steps' bookkeeping alone can add up to less than a microsecond
            assert steps == N and (ms > 0.0 if k == 1 else ms >= 0.0)
        # one ubatch of room with k = 1; budget + k (padded: 64 and 320 cells on the CPU) with k = 300; the prompt was compressed
        # to the budget as it streamed, and with k = 300 no decode step evicted since
        assert caps == {padded(B_DECODE + 32, pad) if k == 1 else padded(B_DECODE + 300, pad)}
        assert used == ({B_DECODE} if k == 1 else {B_DECODE + N})
    with Model(path) as model, model.context(n_ctx=256) as ctx:
        ctx.decode(tokens[:P])
        assert ctx.decode_timing() == (0.0, 0)  # no plan


def test_evict_every_round_trips_and_is_written_only_when_set():
    plan = plan_mod.uniform_plan(2, "snapkv", 40)
    assert plan_mod.Plan.from_json(every(plan, 8).to_json()).evict_every == 8
    assert "evict_every" not in plan.to_dict()  # the default is not written: older builds read the plan
    assert "decode evicts every 8 tokens" in every(plan, 8).summary()
    # both parsers' verdicts on bad values: tests/test_plan_parsers_agree.py


K_IDLE = 5  # above the observation window of 2: after the eviction at step 1, steps 2-4 and 7-8 compute no rows
IDLE_PARAMS = {"snapkv": dict(n_sink=0, window=2, obs_window=2, pool_kernel=3),
               "pyramidkv": dict(n_sink=1, window=0, obs_window=2, pool_kernel=3), "tova": dict(window=1)}


def idle_plan(layer: int, pattern: str, selection: str) -> plan_mod.Plan:
    plan = one_layer_plan(layer, pattern)
    lp = plan.layers[layer]
    for phase in ("prefill", "decode"):
        setattr(lp, phase, dataclasses.replace(getattr(lp, phase), selection=selection, **IDLE_PARAMS[pattern]))
    return every(plan, K_IDLE)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("selection", ["layer", "head", "adaptive"])
@pytest.mark.parametrize("pattern", sorted(IDLE_PARAMS))
def test_steps_far_from_an_eviction_compute_no_rows_and_keep_the_same_sets(twin, tokens, hf_reference, pattern,
                                                                           selection, flash_attn):
    """A decode step more than the window's length before its layer's eviction computes no attention rows (its
    scores would leave the window before any eviction reads them): the kept sets still equal the reference's, which
    scores every step, and the window's scores are empty on the idle steps (the ring restarts)."""
    _, path = twin
    layer = 1
    plan = idle_plan(layer, pattern, selection)
    pp = plan.layers[layer]
    logp, keys = hf_reference[layer]
    heads = [None] if selection == "layer" else list(range(CFG.n_head_kv))
    scores = []
    with Model(path) as model:
        model.set_plan(plan)
        with model.context(n_ctx=256, n_batch=512, n_ubatch=512, flash_attn=flash_attn, type_k="f32",
                           type_v="f32") as ctx:
            ctx.decode(tokens[:P])
            kept = [[ctx.kept_positions(layer, h) for h in heads]]
            for t in tokens[P:]:
                ctx.decode([t])
                kept.append([ctx.kept_positions(layer, h) for h in heads])
                scores.append(ctx.kept_scores(layer, heads[0]))
    kw = dict(prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
              decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys, evict_every=K_IDLE)
    if selection == "layer":
        ref = [simulate(logp, P, **kw)]
    else:
        ref = simulate_heads(logp, P, CFG.n_head_kv, adaptive=selection == "adaptive", **kw)
    for i, h in enumerate(heads):
        assert kept[0][i] == ref[i].prefill_kept.tolist(), f"head {h} after prefill"
        for step in range(N):
            assert kept[step + 1][i] == ref[i].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"
    held = [len(kept[s][0]) for s in range(1, N + 1)]
    if selection != "adaptive":
        assert held == [16, 17, 18, 19, 20, 16, 17, 18]  # evictions at steps 1 and 6
    if pattern != "tova":  # SnapKV's window: nothing on the idle steps 2-4 and 7-8, rows on 5 and 6
        idle = [not np.any(s) for s in scores]
        assert idle == [False, True, True, True, False, False, True, True]


def test_env_var_sets_evict_every_for_any_plan(twin, tokens, monkeypatch):
    """LLAMA_POLYKV_EVICT_EVERY (the stock tools' --evict-every) overrides the plan's k; a bad value is refused."""
    from polykv_cpp.errors import NativeError

    _, path = twin
    plan = plan_mod.uniform_plan(CFG.n_layer, "streamingllm", B_DECODE, n_sink=2)
    used = {}
    for k in (None, "8"):
        if k:
            monkeypatch.setenv("LLAMA_POLYKV_EVICT_EVERY", k)
        with Model(path) as model:
            model.set_plan(plan)
            with model.context(n_ctx=256) as ctx:
                ctx.decode(tokens[:P], phase="prefill")
                for t in tokens[P:P + 5]:
                    ctx.decode([t], phase="decode")
                used[k] = {s.used for s in ctx.kv_layer_stats()}
    assert used == {None: {B_DECODE}, "8": {B_DECODE + 5}}
    monkeypatch.setenv("LLAMA_POLYKV_EVICT_EVERY", "0")
    with Model(path) as model:
        model.set_plan(plan)
        with pytest.raises(NativeError, match="LLAMA_POLYKV_EVICT_EVERY must be an integer from 1 to 65536"):
            model.context(n_ctx=256)
