"""The native PolyKV cache on a GPU backend (CUDA; Metal and others untested) against the CPU and the reference.

Skipped unless our libllama was built with a GPU backend and sees a device (`scripts/gpu_check.sh` builds one
and runs this file). With every layer offloaded (`n_gpu_layers=99`), the K/V caches, the score branch and the
attention live in device memory; selection reads the scores back and eviction, repacking and compaction go
through `ggml_backend_tensor_get/set`. Checked on the tiny fp32 Qwen2 of test_polykv_native:

* f32 K/V, flash attention on: for every pattern, per layer and per KV head, the positions kept after the prompt
  and after each decode step equal the numpy reference on transformers' attention (the other layer FullKV),
  in chunked and in exact prefill;
* a plan over every layer keeps the same positions on the GPU as on the CPU (f32 and f16 K/V), with the same
  logits to the precision of the two backends;
* the offloaded caches have the plan's size (padded to the GPU's 256 cells), smaller than FullKV's;
* a compressed state saved on the GPU loads into a new context and decoding continues identically.
"""

import re

import numpy as np
import pytest

from polykv_cpp import _native
from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.patterns import pattern_from_phase_plan, simulate, simulate_heads
from test_per_head import HEAD_PATTERNS, head_plan
from test_polykv_native import (B_DECODE, B_PREFILL, CFG, N, P, PHASE_PARAMS, hf_reference, tokens,  # noqa: F401
                                twin)

torch = pytest.importorskip("torch")

NGL = 99
GPU_PAD = 256


def gpu_available() -> bool:
    try:
        return _native.has_gpu()  # not llama_supports_gpu_offload: true of any build with the RPC backend
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not gpu_available(), reason="libllama has no GPU backend (build with "
                                                            "CMAKE_ARGS=-DGGML_CUDA=ON; scripts/gpu_check.sh)")


def uniform_over_layers(pattern: str, selection: str = "layer") -> plan_mod.Plan:
    layers = [plan_mod.LayerPlan(il, plan_mod.PhasePlan(pattern, budget=B_PREFILL, selection=selection,
                                                        **PHASE_PARAMS[pattern]),
                                 plan_mod.PhasePlan(pattern, budget=B_DECODE, selection=selection,
                                                    **PHASE_PARAMS[pattern]))
              for il in range(CFG.n_layer)]
    return plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=B_PREFILL, b_min=1, budget_rule="test",
                         layers=layers, exact_total=False).validate()


def run_all_heads(path, plan, toks, *, n_gpu_layers, kv_type="f32", flash_attn="on", n_ubatch=512,
                  prefill="chunked"):
    """Kept positions [step][layer][head] after the prompt and after each decode step, and the logits."""
    with Model(path, n_gpu_layers=n_gpu_layers) as model:
        model.set_plan(plan, prefill=prefill)
        with model.context(n_ctx=256, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn=flash_attn,
                           type_k=kv_type, type_v=kv_type) as ctx:
            def snap():
                return [[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)]

            ctx.decode(toks[:P])
            kept = [snap() if prefill == "chunked" else None]
            logits = [ctx.logits()]
            for t in toks[P:]:
                ctx.decode([t])
                kept.append(snap())
                logits.append(ctx.logits())
    return kept, np.array(logits)


def test_every_layer_is_offloaded(twin):
    _, path = twin
    mark = _native.log_mark()
    with Model(path, n_gpu_layers=NGL):
        log = _native.log_since(mark, min_level=2)
    m = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log)
    assert m, log[-2000:]
    assert m.group(1) == m.group(2) == str(CFG.n_layer + 1)


@pytest.mark.parametrize("prefill", ["chunked", "exact"])
@pytest.mark.parametrize("selection", ["layer", "head"])
@pytest.mark.parametrize("pattern", HEAD_PATTERNS + ["streamingllm"])
def test_gpu_kept_positions_equal_reference(twin, tokens, hf_reference, pattern, selection, prefill):
    """Layer 0 compresses (its inputs are exact whatever the backend), layer 1 is FullKV."""
    if selection == "head" and pattern not in HEAD_PATTERNS:
        pytest.skip(f"{pattern} has no per-head variant")
    _, path = twin
    layer = 0
    plan = head_plan(layer, pattern, selection=selection)
    kept, _ = run_all_heads(path, plan, tokens, n_gpu_layers=NGL, n_ubatch=512 if prefill == "chunked" else 16,
                            prefill=prefill)
    logp, keys = hf_reference[layer]
    pp = plan.layers[layer]
    kw = dict(prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
              decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys)
    if selection == "head":
        ref = simulate_heads(logp, P, CFG.n_head_kv, **kw)
    else:
        ref = [simulate(logp, P, **kw)] * CFG.n_head_kv
    for h in range(CFG.n_head_kv):
        if prefill == "chunked":
            assert kept[0][layer][h] == ref[h].prefill_kept.tolist(), f"head {h} after prefill"
        for step in range(N):
            assert kept[step + 1][layer][h] == ref[h].decode_kept[step].tolist(), \
                f"head {h} after decode step {step + 1}"


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("selection", ["layer", "head"])
@pytest.mark.parametrize("pattern", HEAD_PATTERNS + ["streamingllm"])
def test_gpu_keeps_what_the_cpu_keeps(twin, tokens, pattern, selection, kv_type):
    if selection == "head" and pattern not in HEAD_PATTERNS:
        pytest.skip(f"{pattern} has no per-head variant")
    _, path = twin
    plan = uniform_over_layers(pattern, selection)
    cpu_kept, cpu_logits = run_all_heads(path, plan, tokens, n_gpu_layers=0, kv_type=kv_type)
    gpu_kept, gpu_logits = run_all_heads(path, plan, tokens, n_gpu_layers=NGL, kv_type=kv_type)
    for step, (c, g) in enumerate(zip(cpu_kept, gpu_kept)):
        assert g == c, f"kept positions differ after step {step} (0: the prompt)"
    tol = 2e-3 if kv_type == "f32" else 3e-2
    np.testing.assert_allclose(gpu_logits, cpu_logits, atol=tol * max(1.0, float(np.abs(cpu_logits).max())))


def test_gpu_caches_have_the_plan_size(twin, tokens):
    _, path = twin
    plan = uniform_over_layers("snapkv", "head")
    with Model(path, n_gpu_layers=NGL) as model:
        model.set_plan(plan)
        with model.context(n_ctx=2048, n_batch=64, n_ubatch=64, type_k="f16", type_v="f16") as ctx:
            ctx.decode(tokens)
            stats = ctx.kv_layer_stats()
    assert len(stats) == CFG.n_layer
    for s in stats:
        assert s.capacity == s.cell_pad == GPU_PAD  # B_PREFILL + n_ubatch = 84 cells, padded to 256 on a GPU
        assert s.used == B_PREFILL  # the 48 tokens are one prompt ubatch
        assert s.bytes * (2048 // GPU_PAD) == s.bytes_fullkv


def test_gpu_state_round_trip_continues_identically(twin, tokens):
    _, path = twin
    plan = uniform_over_layers("snapkv", "head")
    with Model(path, n_gpu_layers=NGL) as model:
        model.set_plan(plan)
        with model.context(n_ctx=256, type_k="f16", type_v="f16") as ctx:
            ctx.decode(tokens[:P])
            ctx.decode([tokens[P]])
            state = ctx.state_bytes()
            kept = [[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)]
            ctx.decode([tokens[P + 1]])
            expected = ctx.logits()
        with model.context(n_ctx=256, type_k="f16", type_v="f16") as ctx2:
            ctx2.load_state_bytes(state)
            assert [[ctx2.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)] == kept
            ctx2.decode([tokens[P + 1]])
            np.testing.assert_allclose(ctx2.logits(), expected, atol=1e-4)
