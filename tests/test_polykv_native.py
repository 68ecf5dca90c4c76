"""The native PolyKV cache against independent references.

* The positions each layer keeps equal the numpy reference (`polykv_cpp.patterns.simulate`) run on attention
  probabilities that transformers computes on the same weights (a tiny fp32 Qwen2 written by the test).
* A FullKV plan, or budgets larger than the context, change nothing; per-layer caches really are smaller.
"""

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import NativeError, PlanError
from polykv_cpp.patterns import pattern_from_phase_plan, simulate
from conftest import padded
from tiny_models import TinyConfig, write_tiny_gguf

CFG = TinyConfig(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=384)
P, N = 40, 8          # prompt tokens (one ubatch), teacher-forced decode steps
B_PREFILL, B_DECODE = 20, 16

PHASE_PARAMS = {
    "streamingllm": dict(n_sink=2),
    "h2o": dict(n_sink=1, window=4),
    "snapkv": dict(n_sink=0, window=2, obs_window=6, pool_kernel=3),
    "pyramidkv": dict(n_sink=1, window=0, obs_window=4, pool_kernel=5),
    "tova": dict(window=1),
    "knorm": dict(window=1),
}


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """(transformers model, path of its GGUF twin). Needs torch: the tests without the twin run without it."""
    pytest.importorskip("torch")
    from tiny_models import tiny_hf_qwen2, write_qwen2_gguf_from_hf

    hf = tiny_hf_qwen2(CFG, seed=3)
    path = write_qwen2_gguf_from_hf(hf, tmp_path_factory.mktemp("twin") / "twin.gguf")
    return hf, path


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(11)
    return [int(t) for t in rng.integers(3, CFG.n_vocab, size=P + N)]


@pytest.fixture(scope="module")
def hf_reference(twin, tokens):
    """Per layer: attention log-probabilities [n_head, T, T] and post-projection keys [n_head_kv, T, d]."""
    torch = pytest.importorskip("torch")
    hf, _ = twin
    hf.config._attn_implementation = "eager"
    keys = {}
    hooks = []
    for il, layer in enumerate(hf.model.layers):
        def hook(_mod, _inp, out, il=il):
            keys[il] = out[0].detach().double().numpy().reshape(len(tokens), CFG.n_head_kv, CFG.head_dim)
        hooks.append(layer.self_attn.k_proj.register_forward_hook(hook))
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_attentions=True)
    for h in hooks:
        h.remove()
    ref = {}
    for il, att in enumerate(out.attentions):
        probs = att[0].double().numpy()
        with np.errstate(divide="ignore"):
            ref[il] = (np.log(probs), keys[il].transpose(1, 0, 2))
    return ref


def one_layer_plan(il: int, pattern: str, n_layer: int = CFG.n_layer) -> plan_mod.Plan:
    """Layer `il` uses `pattern` in both phases; every other layer is FullKV (so its inputs are exact)."""
    layers = []
    for j in range(n_layer):
        if j == il:
            pre = plan_mod.PhasePlan(pattern, budget=B_PREFILL, **PHASE_PARAMS[pattern])
            dec = plan_mod.PhasePlan(pattern, budget=B_DECODE, **PHASE_PARAMS[pattern])
        else:
            pre = plan_mod.PhasePlan("fullkv")
            dec = plan_mod.PhasePlan("fullkv")
        layers.append(plan_mod.LayerPlan(j, pre, dec))
    return plan_mod.Plan(version=1, n_layer=n_layer, budget_avg=B_PREFILL, b_min=1, budget_rule="test",
                         layers=layers, exact_total=False)


def run_native(path, plan, tokens, layer, *, flash_attn="on", type_k="f32", type_v="f32", n_ubatch=512,
               prefill="chunked", prefill_slack=1.0):
    """Kept positions of `layer` after the prompt and after each teacher-forced decode step, and logits."""
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill, prefill_slack=prefill_slack)
        with model.context(n_ctx=256, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn=flash_attn, type_k=type_k,
                           type_v=type_v) as ctx:
            assert ctx.polykv_active == (plan is not None)
            ctx.decode(tokens[:P])
            # in exact mode the prompt is compressed when decoding starts: read the kept set after step 1
            kept = [ctx.kept_positions(layer) if plan is not None and prefill == "chunked" else None]
            logits = [ctx.logits()]
            for t in tokens[P:]:
                ctx.decode([t])
                kept.append(ctx.kept_positions(layer) if plan is not None else None)
                logits.append(ctx.logits())
    return kept, np.array(logits)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("pattern", sorted(PHASE_PARAMS))
@pytest.mark.parametrize("layer", [0, 1])
def test_kept_positions_equal_reference(twin, tokens, hf_reference, pattern, layer, flash_attn):
    _, path = twin
    plan = one_layer_plan(layer, pattern)
    kept, _ = run_native(path, plan, tokens, layer, flash_attn=flash_attn)

    logp, keys = hf_reference[layer]
    pp = plan.layers[layer]
    ref = simulate(logp, P, prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
                   decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys)
    assert kept[0] == ref.prefill_kept.tolist(), "after prefill"
    for step in range(N):
        assert kept[step + 1] == ref.decode_kept[step].tolist(), f"after decode step {step + 1}"
    assert len(kept[-1]) == B_DECODE


@pytest.mark.parametrize("kernel", [7, 23, 61])
@pytest.mark.parametrize("pattern", ["snapkv", "pyramidkv"])
def test_wide_pooling_kernels_equal_reference(twin, tokens, hf_reference, pattern, kernel):
    """Max pooling as wide as the shipped plans' (23) and wider than the 40-token prompt (61), where a window
    clips at both ends of the token set."""
    _, path = twin
    layer = 1
    params = dict(PHASE_PARAMS[pattern], pool_kernel=kernel)
    plan = one_layer_plan(layer, pattern)
    pp = plan_mod.LayerPlan(layer, plan_mod.PhasePlan(pattern, budget=B_PREFILL, **params),
                            plan_mod.PhasePlan(pattern, budget=B_DECODE, **params))
    plan.layers[layer] = pp
    kept, _ = run_native(path, plan, tokens, layer)
    logp, keys = hf_reference[layer]
    ref = simulate(logp, P, prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
                   decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys)
    assert kept[0] == ref.prefill_kept.tolist(), "after prefill"
    for step in range(N):
        assert kept[step + 1] == ref.decode_kept[step].tolist(), f"after decode step {step + 1}"


@pytest.mark.parametrize("kernel,shift", [(7, 3), (7, -3), (23, 8)])
@pytest.mark.parametrize("pattern", ["snapkv", "pyramidkv"])
def test_shifted_pooling_equals_reference(twin, tokens, hf_reference, pattern, kernel, shift):
    """``pool_shift``: the pooling window moved towards the tokens after a high score, natively as in the
    reference, after the prompt and after every decode step; the kept set is not the centred kernel's."""
    _, path = twin
    layer = 1

    def plan_for(s):
        params = dict(PHASE_PARAMS[pattern], pool_kernel=kernel, pool_shift=s or None)
        plan = one_layer_plan(layer, pattern)
        plan.layers[layer] = plan_mod.LayerPlan(layer, plan_mod.PhasePlan(pattern, budget=B_PREFILL, **params),
                                                plan_mod.PhasePlan(pattern, budget=B_DECODE, **params))
        return plan.validate()

    plan = plan_for(shift)
    kept, _ = run_native(path, plan, tokens, layer)
    logp, keys = hf_reference[layer]
    refs = [simulate(logp, P, prefill=pattern_from_phase_plan(p.layers[layer].prefill), prefill_budget=B_PREFILL,
                     decode=pattern_from_phase_plan(p.layers[layer].decode), decode_budget=B_DECODE, keys=keys)
            for p in (plan, plan_for(0))]
    assert refs[0].prefill_kept.tolist() != refs[1].prefill_kept.tolist() or \
        any(a.tolist() != b.tolist() for a, b in zip(refs[0].decode_kept, refs[1].decode_kept))
    assert kept[0] == refs[0].prefill_kept.tolist(), "after prefill"
    for step in range(N):
        assert kept[step + 1] == refs[0].decode_kept[step].tolist(), f"after decode step {step + 1}"


@pytest.mark.parametrize("pattern", sorted(PHASE_PARAMS))
def test_exact_prefill_mode_equals_reference_for_a_prompt_of_several_ubatches(twin, tokens, hf_reference, pattern):
    """n_ubatch 16: the 40-token prompt is three ubatches; exact mode compresses it once, as the reference."""
    _, path = twin
    layer = 1
    plan = one_layer_plan(layer, pattern)
    kept, _ = run_native(path, plan, tokens, layer, n_ubatch=16, prefill="exact")
    logp, keys = hf_reference[layer]
    pp = plan.layers[layer]
    ref = simulate(logp, P, prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
                   decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys)
    for step in range(N):
        assert kept[step + 1] == ref.decode_kept[step].tolist(), f"after decode step {step + 1}"


@pytest.mark.parametrize("flash_attn", ["on", "off"])
@pytest.mark.parametrize("pattern", sorted(PHASE_PARAMS))
def test_prefill_slack_that_holds_the_prompt_equals_exact_in_smaller_caches(twin, tokens, hf_reference, pattern,
                                                                              flash_attn):
    """Slack 2: the 40-token prompt (three ubatches of 16) streams into 2 x 20 kept tokens without eviction and
    is compressed when decoding starts, scored by its last tokens: the reference's kept sets, in caches of
    40 + 16 cells (padded: 64 on the CPU) instead of n_ctx."""
    _, path = twin
    layer = 1
    plan = one_layer_plan(layer, pattern)
    kept, _ = run_native(path, plan, tokens, layer, n_ubatch=16, prefill_slack=2.0, flash_attn=flash_attn)
    logp, keys = hf_reference[layer]
    pp = plan.layers[layer]
    ref = simulate(logp, P, prefill=pattern_from_phase_plan(pp.prefill), prefill_budget=B_PREFILL,
                   decode=pattern_from_phase_plan(pp.decode), decode_budget=B_DECODE, keys=keys)
    assert kept[0] == list(range(P)), "nothing is evicted while the prompt fits in the slack"
    for step in range(N):
        assert kept[step + 1] == ref.decode_kept[step].tolist(), f"after decode step {step + 1}"
    with Model(path) as model:
        model.set_plan(plan, prefill_slack=2.0)
        with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
            s = {s.layer: s for s in ctx.kv_layer_stats()}[layer]
            assert s.capacity == min(256, padded(2 * B_PREFILL + 16, s.cell_pad))


def test_prefill_slack_bounds_the_streaming_prompt_and_compresses_before_the_answer(twin, tokens):
    _, path = twin
    plan = one_layer_plan(1, "snapkv")
    kept, _ = run_native(path, plan, tokens, 1, n_ubatch=16, prefill_slack=1.5)
    assert len(kept[0]) == 30                       # 1.5 x 20 while streaming
    assert [len(k) for k in kept[1:]] == [B_DECODE] * N
    with Model(path) as model:
        model.set_plan(plan, prefill_slack=1.5)
        with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
            ctx.decode(tokens[:P])
            assert len(ctx.kept_positions(1)) == 30
            assert ctx.compress_prompt() == 10        # to the prefill budget, at once
            assert len(ctx.kept_positions(1)) == B_PREFILL
        with pytest.raises(PlanError, match="slack"):
            model.set_plan(plan, prefill_slack=0.5)


def test_chunked_prefill_bounds_the_cache_and_differs_from_exact(twin, tokens):
    _, path = twin
    plan = one_layer_plan(1, "h2o")
    chunked, _ = run_native(path, plan, tokens, 1, n_ubatch=16)
    exact, _ = run_native(path, plan, tokens, 1, n_ubatch=16, prefill="exact")
    assert len(chunked[0]) == B_PREFILL
    assert [len(k) for k in chunked[1:]] == [B_DECODE] * N == [len(k) for k in exact[1:]]
    with Model(path) as model:
        for mode in ("chunked", "exact"):  # budget + one ubatch, padded (64 cells on the CPU), vs n_ctx
            model.set_plan(plan, prefill=mode)
            with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
                s = {s.layer: s for s in ctx.kv_layer_stats()}[1]
                assert s.capacity == (min(256, padded(B_PREFILL + 16, s.cell_pad)) if mode == "chunked" else 256)


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_fullkv_plan_and_oversized_budgets_change_nothing(twin, tokens, flash_attn):
    _, path = twin
    _, base = run_native(path, None, tokens, 0, flash_attn=flash_attn)
    full = plan_mod.uniform_plan(CFG.n_layer, "fullkv", 64)
    _, with_full = run_native(path, full, tokens, 0, flash_attn=flash_attn)
    np.testing.assert_allclose(with_full, base, atol=1e-5, rtol=0)
    big = plan_mod.uniform_plan(CFG.n_layer, "h2o", 100000, window=4)
    kept, with_big = run_native(path, big, tokens, 1, flash_attn=flash_attn)
    np.testing.assert_allclose(with_big, base, atol=1e-5, rtol=0)
    assert kept[-1] == list(range(P + N))


def test_eviction_changes_logits_but_stays_finite(twin, tokens):
    _, path = twin
    _, base = run_native(path, None, tokens, 0)
    _, evicted = run_native(path, plan_mod.uniform_plan(CFG.n_layer, "streamingllm", 8, n_sink=2), tokens, 0)
    assert np.isfinite(evicted).all()
    assert np.abs(evicted[-1] - base[-1]).max() > 1e-3


def test_per_layer_caches_are_really_smaller(tmp_path):
    cfg = TinyConfig(n_layer=4)
    path = write_tiny_gguf(tmp_path / "m.gguf", cfg)
    plan = plan_mod.Plan.from_dict({
        "version": 1, "n_layer": 4, "budget_avg": 64, "b_min": 1, "budget_rule": "test", "exact_total": False,
        "layers": [
            {"layer": 0, "prefill": {"pattern": "fullkv", "budget": "full"}, "decode": {"pattern": "fullkv", "budget": "full"}},
            {"layer": 1, "prefill": {"pattern": "streamingllm", "budget": 64, "n_sink": 4},
             "decode": {"pattern": "streamingllm", "budget": 64, "n_sink": 4}},
            {"layer": 2, "prefill": {"pattern": "streamingllm", "budget": 64, "n_sink": 4},
             "decode": {"pattern": "streamingllm", "budget": 64, "n_sink": 4}},
            {"layer": 3, "prefill": {"pattern": "h2o", "budget": 300, "window": 8},
             "decode": {"pattern": "tova", "budget": 100, "window": 1}},
        ]})
    with Model(path) as model:
        model.set_plan(plan)
        with model.context(n_ctx=4096, n_ubatch=256, n_batch=256) as ctx:
            stats = {s.layer: s for s in ctx.kv_layer_stats()}
            assert stats[0].capacity == 4096 and stats[0].pattern_prefill == "fullkv"
            # budget + one ubatch of headroom, padded (320 and 576 cells on the CPU, 512 and 768 on a GPU)
            pad = stats[1].cell_pad
            assert pad == stats[3].cell_pad and pad in (32, 256)
            assert stats[1].capacity == stats[2].capacity == padded(64 + 256, pad) and stats[1].group == stats[2].group
            assert stats[3].capacity == padded(300 + 256, pad) and stats[3].group not in (stats[0].group, stats[1].group)
            for s in stats.values():
                assert s.bytes * 4096 == s.bytes_fullkv * s.capacity
            assert stats[1].bytes < stats[0].bytes / 7
            toks = [5 + (i % 300) for i in range(700)]
            ctx.decode(toks)  # three ubatches through 320-cell caches
            after = {s.layer: s for s in ctx.kv_layer_stats()}
            assert after[0].used == 700
            assert after[1].used == 64 and after[2].used == 64
            assert ctx.kept_positions(1) == [0, 1, 2, 3] + list(range(700 - 60, 700))
            assert after[3].used == 300
            for _ in range(3):
                ctx.decode([7])
            assert {s.layer: s.used for s in ctx.kv_layer_stats()} == {0: 703, 1: 64, 2: 64, 3: 100}
            assert ctx.pos_max() == 702


def test_kv_budget_rescales_like_python(tmp_path):
    cfg = TinyConfig(n_layer=4)
    path = write_tiny_gguf(tmp_path / "m.gguf", cfg)
    plan = plan_mod.pyramid_plan(4, 128)
    with Model(path) as model:
        model.set_plan(plan, kv_budget=48)
        with model.context(n_ctx=1024) as ctx:
            native = [s.budget_prefill for s in ctx.kv_layer_stats()]
    assert native == plan.scaled(48, full_charge=1024).token_budgets("prefill")
    assert sum(native) == 4 * 48


@pytest.mark.parametrize("plan_text,match", [
    ('{"version": 1, "n_layer": 3', "JSON"),
    ('{"version": 1, "n_layer": 5, "budget_avg": 8, "b_min": 1, "budget_rule": "x", "layers": []}', "layer"),
])
def test_bad_plans_are_refused_with_a_message(tiny_gguf, plan_text, match):
    with Model(tiny_gguf) as model:
        with pytest.raises(PlanError, match=match):
            model.set_plan(plan_text)


def test_native_rejects_what_python_would_not_see(tiny_gguf):
    """The native parser checks on its own (stock tools read plans without Python)."""
    with Model(tiny_gguf) as model:
        bad = plan_mod.uniform_plan(2, "h2o", 16, window=4).to_dict()
        bad["layers"][1]["decode"]["pattern"] = "nosuchpattern"
        import json
        with pytest.raises(PlanError, match="unknown pattern"):
            model._set_native_plan(json.dumps(bad), 0)
        bad["layers"][1]["decode"]["pattern"] = "h2o"
        bad["n_layer"] = 3
        with pytest.raises(PlanError, match="layers"):
            model._set_native_plan(json.dumps(bad), 0)


def test_budget_that_cannot_fit_fails_at_context_creation(tiny_gguf):
    plan = plan_mod.Plan.from_dict({
        "version": 1, "n_layer": 2, "budget_avg": 64, "b_min": 32, "budget_rule": "test", "exact_total": False,
        "layers": [{"layer": i, "prefill": {"pattern": "h2o", "budget": 64, "window": 4},
                    "decode": {"pattern": "h2o", "budget": 64, "window": 4}} for i in range(2)]})
    with Model(tiny_gguf) as model:
        model.set_plan(plan, kv_budget=16)
        with pytest.raises(NativeError, match="cannot fit"):
            model.context(n_ctx=256)


def _sink_window_plan(n_sink: int, window: int, budget: int, **extra) -> plan_mod.Plan:
    phase = {"pattern": "h2o", "budget": budget, "n_sink": n_sink, "window": window}
    return plan_mod.Plan.from_dict({
        "version": 1, "n_layer": 2, "budget_avg": budget, "b_min": 1, "budget_rule": "test", "exact_total": False,
        **extra, "layers": [{"layer": i, "prefill": dict(phase), "decode": dict(phase)} for i in range(2)]})


def test_kv_budget_shrinks_windows_like_python(tiny_gguf):
    """Found by reading the code (session 59): the native rescale (--kv-budget) kept a window that no longer fit the
    new budget, so the recent window took the whole budget and the sinks were dropped, where Plan.scaled shrinks the
    window to budget - n_sink. H2O with sinks 4 and window 32 at 16 keeps exactly its sinks and the last 12."""
    plan = _sink_window_plan(4, 32, 40)
    scaled = plan.scaled(16)
    assert (scaled.layers[0].prefill.n_sink, scaled.layers[0].prefill.window) == (4, 12)
    n = 40
    with Model(tiny_gguf) as model:
        model.set_plan(plan, kv_budget=16)
        with model.context(n_ctx=256) as ctx:
            ctx.decode(list(range(1, n + 1)))
            for layer in range(2):
                assert ctx.kept_positions(layer) == list(range(4)) + list(range(n - 12, n))


def test_kv_budget_below_the_sinks_is_refused_like_python(tiny_gguf):
    """Found by reading the code (session 59): a rescaled budget below a layer's sinks was accepted natively, and with
    a protected tail the prefill window came out negative: the selection then marked sinks past the end of its score
    buffer (a heap overflow). Plan.scaled refuses it, and so does the native library now, at context creation."""
    plan = _sink_window_plan(16, 16, 64, protect_tail=2)
    with pytest.raises(PlanError, match="n_sink 16 does not fit the scaled budget"):
        plan.scaled(8)
    with Model(tiny_gguf) as model:
        model.set_plan(plan, kv_budget=8)
        with pytest.raises(NativeError, match="n_sink 16 does not fit the scaled budget"):
            model.context(n_ctx=256)


def test_kv_budget_that_leaves_a_layer_no_token_is_refused_like_native(tiny_gguf):
    """Found by a review of docs/plan-format.md (session 60): with b_min 0 a rescaled budget can round a layer to 0
    tokens; the native rescaling refused it, Plan.scaled returned the plan with a budget of 0."""
    plan = plan_mod.Plan.from_dict({
        "version": 1, "n_layer": 2, "budget_avg": 64, "b_min": 0, "budget_rule": "test", "exact_total": True,
        "layers": [{"layer": i, "prefill": {"pattern": "h2o", "budget": b}, "decode": {"pattern": "h2o", "budget": b}}
                   for i, b in enumerate((1, 127))]})
    assert plan.scaled(96).token_budgets("prefill") == [2, 190]
    message = "layer 0 prefill: a KV budget of 1 tokens per layer leaves it 0 tokens; a budget must be positive"
    with pytest.raises(PlanError, match=message):
        plan.scaled(1)
    with Model(tiny_gguf) as model:
        model.set_plan(plan, kv_budget=1)
        with pytest.raises(NativeError, match=message):
            model.context(n_ctx=256)


def test_a_share_that_resolves_to_no_token_is_refused_by_both_parsers(tiny_gguf):
    """Found by reading the code (session 59): with b_min 0 a share of 0 resolves to a budget of 0 tokens; Python
    refused it, the native parser accepted it (and a per-prompt split then divided by that budget)."""
    import json
    shares = {
        "version": 1, "n_layer": 2, "budget_avg": 64, "b_min": 0, "budget_rule": "test", "exact_total": False,
        "layers": [{"layer": i, "prefill": {"pattern": "h2o", "share": float(i)},
                    "decode": {"pattern": "h2o", "budget": 64}} for i in range(2)]}
    with pytest.raises(PlanError, match="budget 0 must be positive"):
        plan_mod.Plan.from_dict(shares).validate()
    with Model(tiny_gguf) as model:
        with pytest.raises(PlanError, match="budget 0 must be positive"):
            model._set_native_plan(json.dumps(shares), 0)
        shares["layers"][0]["prefill"]["share"] = 0.5
        shares["layers"][1]["prefill"]["share"] = 0.5
        model._set_native_plan(json.dumps(shares), 0)  # the same plan with both layers given tokens loads


def test_kv_budget_beyond_a_layers_index_range_is_refused(tiny_gguf):
    """Found by the libFuzzer harness (native/fuzz/regressions/budget-beyond-int32): a KV budget near 2^31 gave the
    layer with the larger share more than 2^31 - 1 tokens, cut to a negative int32 budget."""
    plan = plan_mod.pyramid_plan(2, 64)
    assert len(set(plan.token_budgets("prefill"))) == 2
    with Model(tiny_gguf) as model:
        model.set_plan(plan, kv_budget=2**31 - 1)
        with pytest.raises(NativeError, match=r"more than a cache can index \(2\^31 - 1\)"):
            model.context(n_ctx=256)


def test_state_roundtrip_of_an_evicted_cache(twin, tokens):
    _, path = twin
    with Model(path) as model:
        model.set_plan(one_layer_plan(1, "h2o"))
        with model.context(n_ctx=256) as ctx:
            ctx.decode(tokens[:P])
            state = ctx.state_bytes()
            kept = ctx.kept_positions(1)
            ctx.decode(tokens[P:P + 3])
            after_a = (ctx.kept_positions(1), ctx.logits())
            ctx.clear()
            ctx.load_state_bytes(state)
            assert ctx.kept_positions(1) == kept
            ctx.decode(tokens[P:P + 3])
            after_b = (ctx.kept_positions(1), ctx.logits())
    assert after_a[0] == after_b[0]
    # a whole-cache restore packs the kept tokens into the first cells: same tokens, other summation order
    np.testing.assert_allclose(after_a[1], after_b[1], atol=1e-3)


def test_plan_roundtrip_through_gguf_and_llama_meta(tiny_gguf, tmp_path):
    """Plan -> GGUF copy -> read back by Python and by llama_model_meta_val_str through the bindings."""
    plan = plan_mod.pyramid_plan(2, 64)
    out = plan_mod.write_gguf(tiny_gguf, tmp_path / "with-plan.gguf", plan)
    assert plan_mod.read_gguf(out).to_dict() == plan.to_dict()
    with Model(out) as model:
        assert model.meta("polykv.version") == "1"
        assert plan_mod.Plan.from_json(model.meta("polykv.plan")).to_dict() == plan.to_dict()
        model.set_plan(use_gguf=True)
        with model.context(n_ctx=256) as ctx:
            stats = ctx.kv_layer_stats()
    assert [s.budget_prefill for s in stats] == plan.token_budgets("prefill")


@pytest.mark.parametrize("pattern", ["h2o", "snapkv", "knorm"])
def test_quantized_kv_cache_combines_with_eviction(tmp_path, tokens, pattern):
    """q8_0 K/V (Hadamard-rotated in this llama.cpp) with eviction: budgets hold and the kept set stays close
    to the fp32 one (scores come from the quantized keys, so a few near-ties may flip)."""
    path = write_tiny_gguf(tmp_path / "hd32.gguf", TinyConfig(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256),
                           seed=5)
    plan = one_layer_plan(1, pattern)
    kept_q, logits_q = run_native(path, plan, tokens, 1, flash_attn="on", type_k="q8_0", type_v="q8_0")
    kept_f, _ = run_native(path, plan, tokens, 1, flash_attn="on")
    assert [len(k) for k in kept_q] == [B_PREFILL] + [B_DECODE] * N
    assert np.isfinite(logits_q).all()
    overlap = len(set(kept_q[-1]) & set(kept_f[-1])) / B_DECODE
    assert overlap >= 0.75, (kept_q[-1], kept_f[-1])


def test_plan_settings_die_with_their_model(tmp_path):
    """A plan set on a freed model never applies to the next model (which may get the same address)."""
    four = write_tiny_gguf(tmp_path / "four.gguf", TinyConfig(n_layer=4))
    two = write_tiny_gguf(tmp_path / "two.gguf", TinyConfig(n_layer=2))
    for _ in range(10):
        with Model(four) as m4:
            m4.set_plan(plan_mod.uniform_plan(4, "streamingllm", 16, n_sink=2), prefill="exact")
        with Model(two) as m2, m2.context(n_ctx=256) as ctx:
            assert not ctx.polykv_active


def mixed_plan() -> plan_mod.Plan:
    """Layer 0 SnapKV, layer 1 H2O prefill then TOVA decode: score state of three kinds in one context."""
    pre0 = plan_mod.PhasePlan("snapkv", budget=B_PREFILL, **PHASE_PARAMS["snapkv"])
    dec0 = plan_mod.PhasePlan("streamingllm", budget=B_DECODE, **PHASE_PARAMS["streamingllm"])
    pre1 = plan_mod.PhasePlan("h2o", budget=B_PREFILL, **PHASE_PARAMS["h2o"])
    dec1 = plan_mod.PhasePlan("tova", budget=B_DECODE, **PHASE_PARAMS["tova"])
    return plan_mod.Plan(version=1, n_layer=2, budget_avg=B_PREFILL, b_min=1, budget_rule="test",
                         layers=[plan_mod.LayerPlan(0, pre0, dec0), plan_mod.LayerPlan(1, pre1, dec1)],
                         exact_total=False)


PORTABLE_PLANS = {
    **{p: lambda p=p: plan_mod.uniform_plan(CFG.n_layer, p, B_PREFILL, **PHASE_PARAMS[p]) for p in PHASE_PARAMS},
    **{f"{p}-head": lambda p=p: plan_mod.uniform_plan(CFG.n_layer, p, B_PREFILL, selection="head", **PHASE_PARAMS[p])
       for p in ("h2o", "snapkv", "tova", "knorm")},
    "mixed": mixed_plan,
}


def follow(ctx, rest):
    """Teacher-force `rest`; kept positions of every KV head of both layers and logits after each token."""
    out = []
    for t in rest:
        ctx.decode([t])
        out.append(([[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)],
                    ctx.logits()))
    return out


@pytest.mark.parametrize("name", sorted(PORTABLE_PLANS))
def test_portable_state_of_one_prefill_serves_every_plan(twin, tokens, name):
    """A prompt prefilled once in a portable FullKV context, loaded into a portable context with a plan, gives
    the kept sets and logits of that plan's own exact prefill (query-aware and query-agnostic)."""
    _, path = twin
    plan = PORTABLE_PLANS[name]()
    full = plan_mod.uniform_plan(CFG.n_layer, "fullkv", 256)
    q = 6  # the last q prompt tokens play the question of the query-agnostic protocol
    with Model(path) as model:
        kw = dict(n_ctx=256, n_batch=16, n_ubatch=16)
        model.set_plan(plan, prefill="exact")
        with model.context(**kw) as ctx:
            ctx.decode(tokens[:P])
            aware_ref = follow(ctx, tokens[P:])
            ctx.clear()
            ctx.decode(tokens[:P - q])
            assert ctx.compress_prompt() > 0
            agnostic_kept = [ctx.kept_positions(il) for il in range(CFG.n_layer)]
            ctx.decode(tokens[P - q:P])
            agnostic_ref = follow(ctx, tokens[P:])
        model.set_plan(full, prefill="portable")
        with model.context(**kw) as src:
            src.decode(tokens[:P - q])
            s1 = src.state_bytes()
            src.decode(tokens[P - q:P])
            s2 = src.state_bytes()
        model.set_plan(plan, prefill="portable")
        with model.context(**kw) as ctx:
            ctx.load_state_bytes(s2)
            aware = follow(ctx, tokens[P:])
            ctx.clear()
            ctx.load_state_bytes(s1)
            ctx.compress_prompt()
            assert [ctx.kept_positions(il) for il in range(CFG.n_layer)] == agnostic_kept
            ctx.decode(tokens[P - q:P])
            agnostic = follow(ctx, tokens[P:])
    for got, ref in ((aware, aware_ref), (agnostic, agnostic_ref)):
        for step, ((k, lg), (k_ref, lg_ref)) in enumerate(zip(got, ref)):
            assert k == k_ref, f"step {step}"
            np.testing.assert_allclose(lg, lg_ref, atol=1e-5, rtol=0)
    assert [len(k[0]) for k in aware[-1][0]] == [plan.layers[il].decode.budget for il in range(CFG.n_layer)]


def test_portable_state_is_refused_by_a_non_portable_context(twin, tokens):
    _, path = twin
    with Model(path) as model:
        model.set_plan(plan_mod.uniform_plan(CFG.n_layer, "fullkv", 256), prefill="portable")
        with model.context(n_ctx=256) as src:
            src.decode(tokens[:P])
            state = src.state_bytes()
        model.set_plan(plan_mod.uniform_plan(CFG.n_layer, "streamingllm", 16, n_sink=2), prefill="exact")
        with model.context(n_ctx=256) as ctx:
            with pytest.raises(NativeError, match="does not come from a context with the same plan"):
                ctx.load_state_bytes(state)


def test_compress_prompt_needs_a_plan(twin):
    _, path = twin
    with Model(path) as model, model.context(n_ctx=64) as ctx:
        with pytest.raises(NativeError, match="no PolyKV plan"):
            ctx.compress_prompt()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_snapshot_restores_the_logits_and_generation_goes_on(twin, tokens, temperature):
    """llama.cpp's state holds no logits: a snapshot keeps them, and sampling from them after `restore` (in
    Python) picks what llama_sampler_sample picks in the original context."""
    from polykv_cpp.api import SamplerSettings

    _, path = twin
    settings = SamplerSettings(temperature=temperature, seed=7)
    with Model(path) as model:
        with model.context(n_ctx=256) as ctx:
            ctx.decode(tokens[:P])
            snap = ctx.snapshot()
            ref = list(ctx.generate_tokens([], max_tokens=6, sampler=settings))
        with model.context(n_ctx=256) as ctx2:
            ctx2.restore(snap)
            np.testing.assert_array_equal(ctx2.logits(), snap.logits)
            assert list(ctx2.generate_tokens([], max_tokens=6, sampler=settings)) == ref
            with pytest.raises(ValueError):
                ctx2.clear()
                next(ctx2.generate_tokens([], max_tokens=1))


def test_sequence_end_survives_evicting_the_newest_token_everywhere(twin, tokens):
    """H2O without a recent window can drop the token just fed from every layer; the sequence still ends there:
    pos_max stays at the last position fed, and the next token is accepted at the next position."""
    _, path = twin
    plan = plan_mod.uniform_plan(CFG.n_layer, "h2o", 8, window=0, n_sink=0, b_min=1)
    dropped_everywhere = 0
    with Model(path) as model:
        model.set_plan(plan)
        with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
            ctx.decode(tokens[:16])
            for i, t in enumerate(tokens[16:], start=16):
                ctx.decode([t])
                assert ctx.pos_max() == i
                dropped_everywhere += all(i not in ctx.kept_positions(il) for il in range(CFG.n_layer))
    assert dropped_everywhere > 0  # the case this test is about happened


def test_cells_are_padded_to_32_on_the_cpu(twin):
    _, path = twin
    with Model(path, n_gpu_layers=0) as model:
        model.set_plan(one_layer_plan(1, "h2o"))
        with model.context(n_ctx=256, n_batch=16, n_ubatch=16) as ctx:
            stats = ctx.kv_layer_stats()
            assert [s.cell_pad for s in stats] == [32] * CFG.n_layer
            assert stats[1].capacity == padded(B_PREFILL + 16, 32) == 64
            assert ctx._lib.llama_polykv_layer_cell_pad(ctx.ptr, CFG.n_layer) == -1


def test_state_of_another_plan_with_more_score_rows_is_refused(twin, tokens):
    """Same cache sizes, but the saved plan's SnapKV window kept 6 query rows and this plan's keeps 3: loading it
    is an error that says so (before, it loaded silently; a crafted row count could size any allocation)."""
    _, path = twin
    plans = []
    for w in (6, 3):
        params = dict(PHASE_PARAMS["snapkv"], obs_window=w)
        layers = [plan_mod.LayerPlan(il, plan_mod.PhasePlan("snapkv", budget=B_PREFILL, **params),
                                     plan_mod.PhasePlan("snapkv", budget=B_DECODE, **params))
                  for il in range(CFG.n_layer)]
        plans.append(plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=B_PREFILL, b_min=1,
                                   budget_rule="test", layers=layers, exact_total=False))
    with Model(path) as model:
        model.set_plan(plans[0])
        with model.context(n_ctx=256) as ctx:
            ctx.decode(tokens[:P])
            state = ctx.state_bytes()
            cap = ctx.kv_layer_stats()[0].capacity
        model.set_plan(plans[1])
        with model.context(n_ctx=256) as ctx:
            assert ctx.kv_layer_stats()[0].capacity == cap
            with pytest.raises(NativeError, match="score rows"):
                ctx.load_state_bytes(state)


def test_env_plan_applies_only_to_models_of_its_layer_count(twin, tmp_path, monkeypatch):
    """LLAMA_POLYKV_PLAN reaches every model a process loads: a draft or embedding model of another depth runs
    without it (with a log line) instead of failing its context; an explicit plan of the wrong depth is still an
    error."""
    from tiny_models import write_tiny_gguf

    _, path = twin
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(one_layer_plan(1, "snapkv").to_json())
    monkeypatch.setenv("LLAMA_POLYKV_PLAN", str(plan_file))
    other = write_tiny_gguf(tmp_path / "three.gguf", TinyConfig(n_layer=3), seed=1)
    with Model(path) as model, model.context(n_ctx=256) as ctx:
        assert ctx.polykv_active
    with Model(other) as model:
        with model.context(n_ctx=256) as ctx:
            assert not ctx.polykv_active
            ctx.decode(list(range(3, 20)))
        with pytest.raises(PlanError, match="layers"):
            model.set_plan(one_layer_plan(1, "snapkv"))


def test_compression_keeps_each_kv_heads_scores_in_a_portable_context(tiny_gguf):
    """Found by reading the code (session 59): the compaction after a portable prompt's compression moved the
    layer's score of every kept token but zeroed each KV head's (a portable context scores both, so that a state
    serves per-head plans too): each kept token keeps the scores it had before, for the layer and for every head."""
    plan = plan_mod.uniform_plan(2, "h2o", 24, window=4)
    n = 64
    with Model(tiny_gguf) as model:
        model.set_plan(plan, prefill="portable")
        with model.context(n_ctx=256) as ctx:
            ctx.decode([(7 * i) % 300 + 1 for i in range(n)])
            before = {}
            for layer in range(2):
                assert ctx.kept_positions(layer) == list(range(n))
                for head in (None, 0, 1):
                    before[layer, head] = dict(zip(range(n), ctx.kept_scores(layer, head).tolist()))
                    assert any(before[layer, head].values())
            assert ctx.compress_prompt() > 0
            for layer in range(2):
                kept = ctx.kept_positions(layer)
                assert len(kept) == 24 and kept != list(range(24))  # scored, and moved by the compaction
                for head in (None, 0, 1):
                    assert ctx.kept_scores(layer, head).tolist() == [before[layer, head][p] for p in kept], (layer, head)
