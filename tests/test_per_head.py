"""Per-KV-head selection (plan phases with ``"selection": "head"``) against the numpy reference.

Each KV head keeps its own tokens, scored by the attention of its own query heads: the native kept set of every
head after the prompt and after each decode step equals `polykv_cpp.patterns.simulate_heads` on the attention
probabilities transformers computes on the same weights (the tiny fp32 Qwen2 of test_polykv_native, 4 query
heads over 2 KV heads). The cache keeps the per-layer size: heads share cells, each holding its own tokens.
"""

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError, PlanError
from polykv_cpp.patterns import pattern_from_phase_plan, simulate_heads
from test_polykv_native import (B_DECODE, B_PREFILL, CFG, N, P, PHASE_PARAMS, hf_reference, tokens,  # noqa: F401
                                twin)

torch = pytest.importorskip("torch")

HEAD_PATTERNS = sorted(p for p in PHASE_PARAMS if p in plan_mod.PER_HEAD_PATTERNS)


def head_plan(il: int, pattern: str, selection: str = "head") -> plan_mod.Plan:
    """Layer `il` uses `pattern` per KV head in both phases; the other layer is FullKV."""
    layers = []
    for j in range(CFG.n_layer):
        if j == il:
            pre = plan_mod.PhasePlan(pattern, budget=B_PREFILL, selection=selection, **PHASE_PARAMS[pattern])
            dec = plan_mod.PhasePlan(pattern, budget=B_DECODE, selection=selection, **PHASE_PARAMS[pattern])
        else:
            pre, dec = plan_mod.PhasePlan("fullkv"), plan_mod.PhasePlan("fullkv")
        layers.append(plan_mod.LayerPlan(j, pre, dec))
    return plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=B_PREFILL, b_min=1, budget_rule="test",
                         layers=layers, exact_total=False).validate()


def run_heads(path, plan, toks, layer, *, flash_attn="on", n_ubatch=512, prefill="chunked", prefill_slack=1.0,
              type_k="f32", type_v="f32"):
    """Per KV head: kept positions of `layer` after the prompt (chunked) and after each decode step; logits."""
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill, prefill_slack=prefill_slack)
        with model.context(n_ctx=256, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn=flash_attn,
                           type_k=type_k, type_v=type_v) as ctx:
            assert ctx.layer_per_head(layer) == plan.layers[layer].prefill.per_head
            ctx.decode(toks[:P])
            heads = range(CFG.n_head_kv)
            kept = [[ctx.kept_positions(layer, h) for h in heads] if prefill == "chunked" else None]
            logits = [ctx.logits()]
            steps = decode_recording(ctx, toks[P:], layer)
    return kept + steps[0], np.array(logits + steps[1])


def decode_recording(ctx, steps, layer):
    """Feed `steps` one token at a time: after each, every KV head's kept positions of `layer`, and the logits."""
    kept, logits = [], []
    for t in steps:
        ctx.decode([t])
        kept.append([ctx.kept_positions(layer, h) for h in range(CFG.n_head_kv)])
        logits.append(ctx.logits())
    return kept, logits


def reference(hf_ref, plan, layer):
    logp, keys = hf_ref[layer]
    pp = plan.layers[layer]
    return simulate_heads(logp, P, CFG.n_head_kv, prefill=pattern_from_phase_plan(pp.prefill),
                          prefill_budget=B_PREFILL, decode=pattern_from_phase_plan(pp.decode),
                          decode_budget=B_DECODE, keys=keys)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("pattern", HEAD_PATTERNS)
@pytest.mark.parametrize("layer", [0, 1])
def test_per_head_kept_positions_equal_reference(twin, tokens, hf_reference, pattern, layer, flash_attn):
    if (layer, pattern, flash_attn) == (1, "knorm", "on"):
        # flash attention runs layer 0 with f16 K/V, so layer 1's keys differ from transformers' fp32 ones by ~1e-3;
        # head 0's 19th and 20th smallest key norms differ by 1.1e-4 (relative) on this prompt: a tie at f16
        pytest.skip("near-tie below flash attention's f16 precision (see comment)")
    _, path = twin
    plan = head_plan(layer, pattern)
    kept, _ = run_heads(path, plan, tokens, layer, flash_attn=flash_attn)
    ref = reference(hf_reference, plan, layer)
    for h in range(CFG.n_head_kv):
        assert kept[0][h] == ref[h].prefill_kept.tolist(), f"head {h} after prefill"
        for step in range(N):
            assert kept[step + 1][h] == ref[h].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"
        assert len(kept[-1][h]) == B_DECODE


@pytest.mark.parametrize("pattern", ["snapkv", "h2o", "tova"])
def test_heads_really_keep_different_tokens(hf_reference, pattern):
    """The reference itself: on this model the two KV heads choose different tokens, so the equality above tests
    per-head selection, not a layer set copied into every head."""
    ref = reference(hf_reference, head_plan(1, pattern), 1)
    assert ref[0].prefill_kept.tolist() != ref[1].prefill_kept.tolist()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("pattern", HEAD_PATTERNS)
def test_per_head_exact_prefill_of_several_ubatches_equals_reference(twin, tokens, hf_reference, pattern,
                                                                     flash_attn):
    _, path = twin
    plan = head_plan(1, pattern)
    kept, _ = run_heads(path, plan, tokens, 1, n_ubatch=16, prefill="exact", flash_attn=flash_attn)
    ref = reference(hf_reference, plan, 1)
    for h in range(CFG.n_head_kv):
        for step in range(N):
            assert kept[step + 1][h] == ref[h].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"


@pytest.mark.parametrize("pattern", ["snapkv", "knorm"])
def test_per_head_prefill_slack_equals_reference(twin, tokens, hf_reference, pattern):
    """Slack 2 holds the 40-token prompt (three ubatches of 16) and compresses it per head when decoding starts."""
    _, path = twin
    plan = head_plan(1, pattern)
    kept, _ = run_heads(path, plan, tokens, 1, n_ubatch=16, prefill_slack=2.0)
    ref = reference(hf_reference, plan, 1)
    for h in range(CFG.n_head_kv):
        assert kept[0][h] == list(range(P))
        for step in range(N):
            assert kept[step + 1][h] == ref[h].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"


def test_chunked_per_head_streams_several_ubatches_within_the_budget(twin, tokens):
    """Chunked prefill in ubatches of 16: every head holds at most its budget after each ubatch (the cells are
    repacked after each eviction), and the cache is as small as the per-layer one."""
    _, path = twin
    plan = head_plan(1, "snapkv")
    kept, _ = run_heads(path, plan, tokens, 1, n_ubatch=16)
    assert [len(k) for k in kept[0]] == [B_PREFILL] * CFG.n_head_kv
    assert all(len(k) == B_DECODE for step in kept[1:] for k in step)
    with Model(path) as model:
        caps = {}
        for sel in ("layer", "head"):
            model.set_plan(head_plan(1, "snapkv", selection=sel))
            with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
                st = {s.layer: s for s in ctx.kv_layer_stats()}[1]
                caps[sel] = (st.capacity, st.bytes)
        assert caps["head"] == caps["layer"]


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_per_head_plan_with_room_for_everything_changes_nothing(twin, tokens, flash_attn):
    _, path = twin
    from test_polykv_native import run_native

    _, base = run_native(path, None, tokens, 0, flash_attn=flash_attn)
    big = plan_mod.uniform_plan(CFG.n_layer, "snapkv", 100000, window=4, obs_window=4, selection="head")
    kept, with_big = run_heads(path, big, tokens, 1, flash_attn=flash_attn)
    np.testing.assert_allclose(with_big, base, atol=1e-5, rtol=0)
    assert kept[-1] == [list(range(P + N))] * CFG.n_head_kv


def test_per_head_state_roundtrip(twin, tokens):
    _, path = twin
    with Model(path) as model:
        model.set_plan(head_plan(1, "h2o"))
        with model.context(n_ctx=256) as ctx:
            ctx.decode(tokens[:P])
            state = ctx.state_bytes()
            kept = [ctx.kept_positions(1, h) for h in range(CFG.n_head_kv)]
            ctx.decode(tokens[P:P + 3])
            after_a = ([ctx.kept_positions(1, h) for h in range(CFG.n_head_kv)], ctx.logits())
            ctx.clear()
            ctx.load_state_bytes(state)
            assert [ctx.kept_positions(1, h) for h in range(CFG.n_head_kv)] == kept
            ctx.decode(tokens[P:P + 3])
            after_b = ([ctx.kept_positions(1, h) for h in range(CFG.n_head_kv)], ctx.logits())
        model.set_plan(head_plan(1, "h2o", selection="layer"))
        with model.context(n_ctx=256) as ctx:
            with pytest.raises(NativeError, match="selects per head where this plan selects per layer"):
                ctx.load_state_bytes(state)
    assert after_a[0] == after_b[0]
    np.testing.assert_allclose(after_a[1], after_b[1], atol=1e-3)


def test_per_head_errors_are_clear(twin):
    _, path = twin
    plan = head_plan(1, "snapkv")
    with Model(path) as model:
        model.set_plan(plan)
        # the tiny model's head size (16) is not a multiple of q8_0's block (32)
        with pytest.raises(NativeError, match="block size"):
            model.context(n_ctx=256, type_k="q8_0", type_v="q8_0", flash_attn="on")
        with model.context(n_ctx=256) as ctx:
            with pytest.raises(NativeError, match="KV head"):
                ctx.kept_positions(1, CFG.n_head_kv)
    mixed = head_plan(1, "snapkv")
    mixed.layers[1].decode.selection = "layer"
    with pytest.raises(PlanError, match="one way in both phases"):
        mixed.validate()
    with pytest.raises(PlanError, match="selection"):
        plan_mod.Plan.from_json(plan.to_json().replace('"head"', '"token"'))


def test_plans_without_selection_are_unchanged_and_head_roundtrips():
    layer_plan = plan_mod.uniform_plan(4, "snapkv", 64)
    assert "selection" not in layer_plan.to_json()
    head = plan_mod.pyramid_plan(4, 64, selection="head")
    back = plan_mod.Plan.from_json(head.to_json())
    assert all(lp.prefill.per_head and lp.decode.per_head for lp in back.layers)
    assert plan_mod.uniform_plan(4, "streamingllm", 64, selection="head").layers[0].prefill.selection == "layer"


def test_runtime_search_and_eval_name_per_head_variants():
    from calibration import runtime

    plan = runtime.build(4, ["snapkv", "snapkv-head", "h2o", "tova-head"], [64] * 4, 64, 16)
    assert [lp.prefill.per_head for lp in plan.layers] == [False, True, False, True]
    assert [lp.decode.per_head for lp in plan.layers] == [False, True, False, True]
    assert plan_mod.split_selection("pyramidkv-head") == ("pyramidkv", "head")
    for bad in ("streamingllm-head", "snapkv-token"):
        with pytest.raises(PlanError):
            plan_mod.split_selection(bad)
    scaled = plan_mod.pyramid_plan(24, 512, selection="head").scaled(256, full_charge=4096)
    assert all(lp.prefill.per_head for lp in scaled.layers)


def compute_buffer_mib(model_path, plan, *, n_ctx: int, n_ubatch: int) -> float:
    """The CPU compute buffer llama.cpp reserves for a context under `plan` (its own log line, in MiB)."""
    from polykv_cpp import _native

    with Model(model_path) as model:
        model.set_plan(plan)
        mark = _native.log_mark()
        with model.context(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn="on"):
            lines = [text for seq, _, text in list(_native._log_lines) if seq > mark and "compute buffer size" in text]
    assert lines, "llama.cpp logged no compute buffer size"
    return sum(float(line.split("=")[1].split("MiB")[0]) for line in lines)


def test_per_head_masks_are_inputs_of_one_slice_per_kv_head(tmp_path):
    """A per-head layer's mask input holds one slice per KV head; the graph widens it to the query heads for its
    layer only. With one input per query head (as before) every layer's widened mask lived for the whole graph:
    the compute buffer grew by n_layer such masks; now by at most two (the widened mask of the layer being computed
    and of the next)."""
    from tiny_models import TinyConfig, write_tiny_gguf

    cfg = TinyConfig(n_layer=8, n_embd=128, n_head=8, n_head_kv=2)
    path = write_tiny_gguf(tmp_path / "heads8.gguf", cfg)
    n_ctx, n_ubatch, budget = 1024, 512, 256
    per_layer = compute_buffer_mib(path, plan_mod.uniform_plan(cfg.n_layer, "snapkv", budget), n_ctx=n_ctx,
                                   n_ubatch=n_ubatch)
    per_head = compute_buffer_mib(path, plan_mod.uniform_plan(cfg.n_layer, "snapkv", budget, selection="head"),
                                  n_ctx=n_ctx, n_ubatch=n_ubatch)
    n_kv = budget + n_ubatch  # a layer's cells: its budget plus one ubatch of room (a multiple of 256 here)
    widened_mib = n_kv * n_ubatch * cfg.n_head * 2 / 2**20  # f16 (flash attention), one slice per query head
    assert per_head - per_layer < 2.5 * widened_mib + cfg.n_layer * widened_mib * cfg.n_head_kv / cfg.n_head
    assert per_head - per_layer < (cfg.n_layer - 1) * widened_mib  # what one input per query head cost
