"""Expected Attention (`expected_attention` prefill pattern) against two independent references.

1. The numpy reference (`polykv_cpp.patterns.ExpectedAttention`) scores exactly as kvpress's
   `ExpectedAttentionPress.score` on the same transformers layer (kvpress computes its own pre-RoPE queries and
   average rotation).
2. The native runtime, on the GGUF twin of the same weights, keeps per layer and per KV head the tokens the
   numpy reference keeps, with the reference's scores, from the pre-RoPE queries, keys and values transformers
   computes: exact prefill (one ubatch or several: the statistics accumulate), portable prefill and a state
   round trip, FA on and off.
"""

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import PlanError
from polykv_cpp.patterns import ExpectedAttention, QueryStatistics, average_rotation, query_statistics, select_adaptive
from test_polykv_native import CFG, P, tokens, twin  # noqa: F401

torch = pytest.importorskip("torch")

N_SINK = 4
BUDGET = 20


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


@pytest.fixture(scope="module")
def hf_layers(twin, tokens):
    """Per layer of the prompt's forward pass: (self_attn module, its hidden states, pre-RoPE queries [n_head, P, d],
    keys [n_head_kv, P, d] after RoPE, values [n_head_kv, P, d])."""
    from kvpress.utils import get_prerope_query_states
    from transformers import DynamicCache

    hf, _ = twin
    hf.config._attn_implementation = "sdpa"
    seen = {}
    hooks = []
    for il, layer in enumerate(hf.model.layers):
        layer.self_attn.rotary_emb = hf.model.rotary_emb  # as kvpress's presses do

        def hook(mod, args, kwargs, out, il=il):
            seen[il] = (mod, kwargs["hidden_states"].detach(), kwargs)
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    cache = DynamicCache()
    try:
        with torch.no_grad():
            hf(torch.tensor([tokens[:P]]), past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for il, (mod, hs, kwargs) in seen.items():
        with torch.no_grad():
            q = get_prerope_query_states(mod, hs)[0]
        layer = cache.layers[il]
        out[il] = (mod, hs, kwargs, q.double().numpy(), layer.keys[0].double().numpy(),
                   layer.values[0].double().numpy(), layer.keys, layer.values)
    return out


def reference_stats(twin, hf_layers, il) -> QueryStatistics:
    hf, _ = twin
    _, _, _, q, _, v, _, _ = hf_layers[il]
    mean, cov = query_statistics(q, np.arange(P), N_SINK)
    R = average_rotation(CFG.head_dim, P, n_future=512, freq_base=_rope_theta(hf.config), neox=True)
    return QueryStatistics(mean=mean, cov=cov, rotation=R, values=v, scale=CFG.head_dim ** -0.5)


@pytest.mark.parametrize("il", [0, 1])
def test_reference_scores_equal_kvpress(twin, hf_layers, il):
    from kvpress import ExpectedAttentionPress

    mod, hs, kwargs, _, keys, _, k_t, v_t = hf_layers[il]
    press = ExpectedAttentionPress(compression_ratio=0.5, n_sink=N_SINK)
    with torch.no_grad():
        theirs = press.score(mod, hs, k_t, v_t, None, kwargs)[0].double().numpy()  # [n_head_kv, P]
    ours = ExpectedAttention(n_sink=N_SINK).head_scores(keys, reference_stats(twin, hf_layers, il))
    np.testing.assert_allclose(ours[:, N_SINK:], theirs[:, N_SINK:], rtol=1e-5, atol=1e-9)
    # kvpress keeps its sinks by giving them the largest score; ours protects them in the selection
    assert (theirs[:, :N_SINK] > theirs[:, N_SINK:].max()).all()


def ea_plan(il: int, selection: str = "layer", budget: int = BUDGET, pool_kernel: int | None = None) -> plan_mod.Plan:
    """Layer il: expected_attention prefill (SnapKV decode); the other layer FullKV."""
    layers = []
    for j in range(CFG.n_layer):
        if j == il:
            pre = plan_mod.PhasePlan("expected_attention", budget=budget, n_sink=N_SINK, window=0, selection=selection,
                                     pool_kernel=pool_kernel)
            dec = plan_mod.PhasePlan("snapkv", budget=budget, selection=selection, n_sink=0, window=2, obs_window=6,
                                     pool_kernel=3)
        else:
            pre, dec = plan_mod.PhasePlan("fullkv"), plan_mod.PhasePlan("fullkv")
        layers.append(plan_mod.LayerPlan(j, pre, dec))
    return plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=budget, b_min=1, budget_rule="test",
                         layers=layers, exact_total=False).validate()


def run_native(path, plan, toks, il, *, prefill="exact", flash_attn="on", n_ubatch=512, round_trip=False):
    """Per KV head: (kept positions, their scores) of layer il after the prompt's compression."""
    with Model(path) as model:
        model.set_plan(plan, prefill=prefill)
        with model.context(n_ctx=128, n_batch=512, n_ubatch=n_ubatch, flash_attn=flash_attn, type_k="f32",
                           type_v="f32") as ctx:
            ctx.decode(toks[:P])
            if round_trip:
                state = ctx.state_bytes()
                ctx.clear()
                ctx.load_state_bytes(state)
            ctx.compress_prompt()
            return [(ctx.kept_positions(il, h), ctx.kept_scores(il, h) if plan.layers[il].prefill.per_head
                     else ctx.kept_scores(il)) for h in range(CFG.n_head_kv)]


def reference_kept(twin, hf_layers, il, selection, pool_kernel=1):
    _, _, _, _, keys, _, _, _ = hf_layers[il]
    pat = ExpectedAttention(n_sink=N_SINK, pool_kernel=pool_kernel)
    stats = reference_stats(twin, hf_layers, il)
    heads = pat.head_scores(keys, stats)

    def head_stats(g):
        return QueryStatistics(stats.mean[g * 2:(g + 1) * 2], stats.cov[g * 2:(g + 1) * 2], stats.rotation,
                               stats.values[g:g + 1], stats.scale)

    if selection == "head":
        return [(pat.select(BUDGET, keys=keys[g:g + 1], stats=head_stats(g)), heads[g]) for g in range(CFG.n_head_kv)]
    if selection == "adaptive":
        protected = [pat.scores(BUDGET, keys.shape[1], keys=keys[g:g + 1], stats=head_stats(g))
                     for g in range(CFG.n_head_kv)]
        return [(kept, heads[g]) for g, kept in enumerate(select_adaptive(protected, BUDGET))]
    kept = pat.select(BUDGET, keys=keys, stats=stats)
    return [(kept, heads.mean(axis=0))] * CFG.n_head_kv


@pytest.mark.parametrize("il", [0, 1])
@pytest.mark.parametrize("selection", ["layer", "head", "adaptive"])
@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_native_keeps_what_the_reference_keeps(twin, tokens, hf_layers, il, selection, flash_attn):
    _, path = twin
    assert CFG.n_head // CFG.n_head_kv == 2
    got = run_native(path, ea_plan(il, selection), tokens, il, flash_attn=flash_attn)
    for g, ((kept, scores), (ref_kept, ref_scores)) in enumerate(zip(got, reference_kept(twin, hf_layers, il, selection))):
        assert list(kept) == [int(x) for x in ref_kept], (il, selection, g)
        beyond = np.asarray(kept) >= N_SINK
        np.testing.assert_allclose(np.asarray(scores)[beyond], ref_scores[np.asarray(kept)[beyond]], rtol=1e-2)


@pytest.mark.parametrize("selection", ["layer", "head"])
def test_pooled_scores_keep_what_the_pooled_reference_keeps(twin, tokens, hf_layers, selection):
    """`pool_kernel` 5: a token ranks by the best score within 2 places, natively as in the reference; the kept set
    is not the unpooled one."""
    _, path = twin
    il = 1
    got = run_native(path, ea_plan(il, selection, pool_kernel=5), tokens, il)
    ref = reference_kept(twin, hf_layers, il, selection, pool_kernel=5)
    unpooled = reference_kept(twin, hf_layers, il, selection)
    for g, ((kept, _), (ref_kept, _), (plain, _)) in enumerate(zip(got, ref, unpooled)):
        assert list(kept) == [int(x) for x in ref_kept], (selection, g)
    assert any(list(r) != list(u) for (r, _), (u, _) in zip(ref, unpooled))


@pytest.mark.parametrize("mode", ["ubatches", "portable", "state"])
def test_statistics_accumulate_and_travel(twin, tokens, hf_layers, mode):
    """The statistics of several ubatches add up to one ubatch's; a portable context and a saved state carry them."""
    _, path = twin
    plan = ea_plan(1, "head")
    want = run_native(path, plan, tokens, 1)
    kw = {"ubatches": dict(n_ubatch=16), "portable": dict(prefill="portable"),
          "state": dict(prefill="portable", round_trip=True)}[mode]
    got = run_native(path, plan, tokens, 1, **kw)
    for (k0, s0), (k1, s1) in zip(want, got):
        assert list(k0) == list(k1)
        np.testing.assert_allclose(s1, s0, rtol=1e-4)


def test_chunked_prefill_scores_each_ubatch_from_the_queries_so_far(twin, tokens):
    """Chunked prefill evicts after every ubatch: the kept set has the budget and keeps the sinks."""
    _, path = twin
    with Model(path) as model:
        model.set_plan(ea_plan(0), prefill="chunked")
        with model.context(n_ctx=128, n_batch=512, n_ubatch=16) as ctx:
            ctx.decode(tokens[:P])
            kept = ctx.kept_positions(0)
    assert len(kept) <= BUDGET + 16 and list(kept[:N_SINK]) == list(range(N_SINK))


def test_expected_attention_is_a_prefill_pattern_only():
    p = plan_mod.uniform_plan(2, "expected_attention", 64)
    assert p.layers[0].prefill.pattern == "expected_attention" and p.layers[0].decode.pattern == "snapkv"
    p.layers[0] = plan_mod.LayerPlan(0, p.layers[0].prefill, plan_mod.PhasePlan("expected_attention", budget=64))
    with pytest.raises(PlanError, match="prefill pattern only"):
        p.validate()
