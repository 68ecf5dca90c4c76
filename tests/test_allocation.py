"""Per-prompt budgets (`"allocation": "prompt"`): the scored layers' budgets re-split for each prompt by their
scores across the model (KVzip's non-uniform allocation), natively as in `polykv_cpp.patterns.allocate_prompt`.

The reference scores each layer's tokens (or each KV head's) on transformers' attention of the same weights, as the
pattern ranks them at the plan's budget; the allocation gives each layer its budget for this prompt; the kept
positions after the compression and after each decode step equal `simulate` at that budget, every KV head."""

import numpy as np
import pytest

from polykv_cpp import plan as plan_mod
from polykv_cpp.api import Model
from polykv_cpp.errors import PlanError
from polykv_cpp.patterns import (_protect, allocate_prompt, allocated_decode_budget, keep_topk,
                                 pattern_from_phase_plan, relative_scores, simulate, softmax_causal)
from test_kvzip import CHUNK, PREFIX, recon_attn  # noqa: F401
from test_per_head import decode_recording
from test_polykv_native import CFG, N, P, PHASE_PARAMS, hf_reference, tokens, twin  # noqa: F401

torch = pytest.importorskip("torch")

B = 16      # the plan's budget of every layer (of the 40-token prompt)
B_MIN = 4
R = CFG.n_head // CFG.n_head_kv


# ------------------------------------------------------------------------------------------ the reference rule

def test_floors_first_then_the_best_scores_of_every_layer():
    # layer 0 holds the pool's best tokens, layer 1 only its floor of 2
    s0 = np.array([9.0, 8.0, 7.0, 6.0, 0.1])
    s1 = np.array([0.05, 0.04, 0.03, 0.02, 0.0])
    assert allocate_prompt([[s0], [s1]], [3, 3], [1, 1], b_min=2) == [4, 2]
    # b_min 0: nothing is reserved, the six best go where they are
    assert allocate_prompt([[s0], [s1]], [3, 3], [1, 1], b_min=0) == [5, 1]
    # protected tokens (+inf) rank first wherever they are
    s1p = s1.copy()
    s1p[-2:] = np.inf
    assert allocate_prompt([[s0], [s1p]], [3, 3], [1, 1], b_min=0) == [4, 2]
    # the total is kept, and no layer gets more than its tokens
    assert allocate_prompt([[s0], [s1]], [5, 3], [1, 1], b_min=0) == [5, 3]


def test_a_layer_set_counts_every_head_and_head_sets_count_one_pair_each():
    # two KV heads: layer 0 keeps one set (each token = 2 pairs), layer 1 one set per head
    l0 = [np.array([1.0, 0.9, 0.8, 0.7])]
    l1 = [np.array([5.0, 0.0, 0.0, 0.0]), np.array([4.0, 3.0, 0.0, 0.0])]
    # pool 2 x (2 + 2) = 8 pairs: floors 1 token = 2 pairs (layer 0), 1 per head (layer 1); the rest by score:
    # 3.0 (layer 1, head 1), then 0.9 (2 pairs, layer 0); the last pair cannot take layer 0's 0.8 (2 pairs) and goes
    # to layer 1's best remaining 0.0: 4 pairs each, 2 tokens per head each
    assert allocate_prompt([l0, l1], [2, 2], [2, 2], b_min=1) == [2, 2]
    # without the 3.0 layer 0 takes 0.9 and 0.8: 6 pairs, 3 tokens; layer 1 keeps its floors, 1 per head
    l1 = [np.array([5.0, 0.0, 0.0, 0.0]), np.array([4.0, 0.0, 0.0, 0.0])]
    assert allocate_prompt([l0, l1], [2, 2], [2, 2], b_min=1) == [3, 1]
    with pytest.raises(ValueError, match="one token set or one per KV head"):
        allocate_prompt([l0, [l1[0]] * 3], [2, 2], [2, 2], b_min=1)


def test_ties_go_to_the_later_layer_and_the_more_recent_token():
    s = np.ones(4)
    assert allocate_prompt([[s], [s]], [2, 2], [1, 1], b_min=0) == [0, 4]


def test_relative_scores_compare_layers_by_how_far_a_token_stands_above_its_own_typical_token():
    # layer 0 is peaked (two tokens far above its typical 0.01); layer 1 is flat, every score higher in absolute terms
    s0 = np.array([np.inf, 0.05, 0.04, 0.01, 0.01, 0.01])
    s1 = np.array([np.inf, 0.22, 0.21, 0.2, 0.2, 0.2])
    assert allocate_prompt([[s0], [s1]], [3, 3], [1, 1], b_min=1) == [1, 5]
    rel = relative_scores(s0)
    assert np.isinf(rel[0]) and np.allclose(rel[1:], [5.0, 4.0, 1.0, 1.0, 1.0])
    assert allocate_prompt([[s0], [s1]], [3, 3], [1, 1], b_min=1, relative=True) == [3, 3]
    # an even count: the mean of the two middle scores
    assert relative_scores(np.array([1.0, 2.0, 3.0, 5.0])).tolist() == [0.4, 0.8, 1.2, 2.0]
    # key norms (-norm: the median is negative) stay as they are; so does a set of zeros
    kn = np.array([-1.0, -2.0, np.inf])
    assert relative_scores(kn).tolist() == kn.tolist() and relative_scores(np.zeros(3)).tolist() == [0.0] * 3


def test_decode_budgets_follow():
    assert allocated_decode_budget(64, 64, 100) == 100
    assert allocated_decode_budget(64, 32, 100) == 50
    assert allocated_decode_budget(64, 32, 1) == 1
    assert allocated_decode_budget(64, None, 100) is None


def test_the_plan_key():
    p = plan_mod.uniform_plan(4, "kvzip", 64, selection="head", allocation="prompt")
    assert p.allocation == "prompt" and p.to_dict()["allocation"] == "prompt"
    assert "re-split per prompt" in p.summary()
    assert plan_mod.Plan.from_json(p.to_json()).allocation == "prompt"
    assert p.scaled(32).allocation == "prompt"
    assert "allocation" not in plan_mod.uniform_plan(4, "kvzip", 64).to_dict()
    d = p.to_dict()
    d["allocation"] = "layer"
    with pytest.raises(PlanError, match="'allocation' must be one of plan, prompt, prompt_median"):
        plan_mod.Plan.from_dict(d)
    d["allocation"] = "prompt_median"
    q = plan_mod.Plan.from_dict(d)
    assert q.allocation == "prompt_median" and "median" in q.summary() and plan_mod.needs_whole_prompt(q)


# ------------------------------------------------------------------------------------------ native = reference

def alloc_plan(pattern: str, selections: tuple[str, str], allocation: str = "prompt",
               cap: float | None = None) -> plan_mod.Plan:
    """Every layer: `pattern` prefill at B (selection per layer), SnapKV decode at B; budgets per prompt (each
    layer's at most `cap` x B)."""
    layers = []
    for il, sel in enumerate(selections):
        if pattern == "kvzip":
            pre = plan_mod.PhasePlan("kvzip", budget=B, n_sink=1, window=2, selection=sel)
        else:
            pre = plan_mod.PhasePlan(pattern, budget=B, selection=sel, **PHASE_PARAMS[pattern])
        dec = plan_mod.PhasePlan("snapkv", budget=B, selection=sel, **PHASE_PARAMS["snapkv"])
        layers.append(plan_mod.LayerPlan(il, pre, dec))
    return plan_mod.Plan(version=1, n_layer=CFG.n_layer, budget_avg=B, b_min=B_MIN, budget_rule="test",
                         layers=layers, allocation=allocation, allocation_cap=cap).validate()


def reference(hf_ref, recon, plan):
    """Per layer: its budget for this prompt and one SimResult per KV head."""
    sets, patterns = [], []
    for il, lp in enumerate(plan.layers):
        pre = pattern_from_phase_plan(lp.prefill)
        logp = hf_ref[il][0]
        rows = recon[il] if pre.name == "kvzip" else softmax_causal(logp[:, :P, :P])
        per_head = lp.prefill.selection == "head"
        groups = [rows[h * R:(h + 1) * R] for h in range(CFG.n_head_kv)] if per_head else [rows]
        sets.append([pre.scores(B, P, attn=g) for g in groups])
        patterns.append(pre)
    caps = None if plan.allocation_cap is None else [int(np.ceil(plan.allocation_cap * B))] * CFG.n_layer
    budgets = allocate_prompt(sets, [B] * CFG.n_layer, [CFG.n_head_kv] * CFG.n_layer, B_MIN, caps=caps,
                              relative=plan.allocation == "prompt_median")
    out = []
    for il, lp in enumerate(plan.layers):
        logp, keys = hf_ref[il]
        dec = pattern_from_phase_plan(lp.decode)
        kw = dict(prefill=patterns[il], prefill_budget=budgets[il], decode=dec,
                  decode_budget=allocated_decode_budget(B, B, budgets[il]))
        if lp.prefill.selection == "head":
            sims = [simulate(logp[h * R:(h + 1) * R], P, recon_attn=recon[il][h * R:(h + 1) * R], **kw)
                    for h in range(CFG.n_head_kv)]
        else:
            sims = [simulate(logp, P, recon_attn=recon[il], **kw)] * CFG.n_head_kv
        out.append(sims)
    return budgets, out


@pytest.mark.parametrize("allocation", ["prompt", "prompt_median"])
@pytest.mark.parametrize("pattern", ["kvzip", "snapkv"])
@pytest.mark.parametrize("selections", [("layer", "layer"), ("head", "head"), ("layer", "head")])
def test_kept_positions_equal_the_reference_at_the_allocated_budgets(twin, tokens, hf_reference, recon_attn,
                                                                      pattern, selections, allocation):
    _, path = twin
    plan = alloc_plan(pattern, selections, allocation)
    budgets, ref = reference(hf_reference, recon_attn, plan)
    # this prompt moves tokens; a per-head layer's odd pair is lost in pairs // n_head_kv
    assert B * CFG.n_layer - CFG.n_layer < sum(budgets) <= B * CFG.n_layer
    raw = budgets if allocation == "prompt" else reference(hf_reference, recon_attn, alloc_plan(pattern, selections))[0]
    assert raw != [B] * CFG.n_layer
    if allocation == "prompt_median":  # relative scores split this prompt otherwise than raw ones
        assert budgets != raw
    assert_native_equals_reference(path, tokens, plan, pattern, budgets, ref)


@pytest.mark.parametrize("pattern", ["kvzip", "snapkv"])
@pytest.mark.parametrize("selections", [("layer", "layer"), ("head", "head")])
def test_a_cap_bounds_what_one_layer_takes_and_the_rest_goes_to_the_others(twin, tokens, hf_reference, recon_attn,
                                                                           pattern, selections):
    """`"allocation_cap"`: no layer keeps more than ceil(cap x its budget); the pool stays whole."""
    _, path = twin
    raw = reference(hf_reference, recon_attn, alloc_plan(pattern, selections))[0]
    most = max(raw)
    assert most > B  # this prompt moves tokens, so a cap from 1 up to below the raw split binds
    cap = (B + (most - B) // 2) / B
    plan = alloc_plan(pattern, selections, cap=cap)
    budgets, ref = reference(hf_reference, recon_attn, plan)
    assert max(budgets) == int(np.ceil(cap * B)) < most
    assert B * CFG.n_layer - CFG.n_layer < sum(budgets) <= B * CFG.n_layer  # the pool stays whole (pairs // heads)
    assert "capped at" in plan.summary() and plan_mod.Plan.from_json(plan.to_json()).allocation_cap == cap
    assert plan.scaled(2 * B).allocation_cap == cap
    assert_native_equals_reference(path, tokens, plan, pattern, budgets, ref)


def assert_native_equals_reference(path, tokens, plan, pattern, budgets, ref):
    """The plan's budgets for this prompt and the kept positions of every KV head after the compression (and layer
    0's after each decode step) equal the reference's."""
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=256, type_k="f32", type_v="f32", flash_attn="off") as ctx:
            ctx.decode(tokens[:P])
            if pattern == "kvzip":
                ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            else:
                ctx.compress_prompt()
            stats = ctx.kv_layer_stats()
            kept = [[[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)]]
            for t in tokens[P:]:
                ctx.decode([t])
                kept.append([[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)]
                             for il in range(CFG.n_layer)])
    for il in range(CFG.n_layer):
        assert stats[il].budget_prefill == stats[il].budget_decode == budgets[il]
        for h in range(CFG.n_head_kv):
            assert kept[0][il][h] == ref[il][h].prefill_kept.tolist(), f"layer {il} head {h} after the compression"
    # decode: layer 0 only; a later layer's queries come from hidden states that layer 0's eviction changed, which
    # transformers' full-attention reference does not see
    for h in range(CFG.n_head_kv):
        for step in range(N):
            assert kept[step + 1][0][h] == ref[0][h].decode_kept[step].tolist(), f"head {h} after decode step {step + 1}"


def held_sets(ctx, per_head: bool):
    """Per layer, per token set (one, or one per KV head): the positions it holds and their scores (float64)."""
    heads = range(CFG.n_head_kv) if per_head else [None]
    return [[(np.array(ctx.kept_positions(il, h)), ctx.kept_scores(il, h).astype(np.float64)) for h in heads]
            for il in range(CFG.n_layer)]


@pytest.mark.parametrize("allocation,cap", [("prompt", None), ("prompt_median", None), ("prompt", 1.0)])
@pytest.mark.parametrize("selection", ["layer", "head"])
@pytest.mark.parametrize("slack,budgets", [(2.0, (B, B)), (1.25, (B // 2, 3 * B // 2))])
def test_chunked_prefill_re_splits_what_each_layer_holds_up_to_its_slack(twin, tokens, selection, slack, budgets,
                                                                          allocation, cap):
    """Chunked prefill with a slack: when the prompt ends, each layer holds up to budget x slack tokens; the
    allocation re-splits the pool over what they hold (a layer never gets more than budget x slack: its cache has
    room for that and one ubatch), nor, with an `"allocation_cap"`, more than ceil(cap x budget). Reference: the same
    prompt under the same plan with fixed budgets, read before its compression (what each set holds, its scores),
    allocated by `allocate_prompt` with those caps, each set then keeping its best."""
    _, path = twin
    d = alloc_plan("snapkv", (selection, selection), allocation, cap).to_dict()
    for lp, b in zip(d["layers"], budgets):
        lp["prefill"]["budget"] = lp["decode"]["budget"] = b
    plan = plan_mod.Plan.from_dict(d)
    pat = pattern_from_phase_plan(plan.layers[0].prefill)
    w = max(pat.window or 0, pat.obs_window)
    caps = [int(np.ceil(b * slack)) for b in budgets]
    per_head = selection == "head"

    def prompt_in(ctx_plan, compress: bool):
        model.set_plan(ctx_plan, prefill="chunked", prefill_slack=slack)
        with model.context(n_ctx=256, n_ubatch=16, n_batch=16, type_k="f32", type_v="f32") as ctx:
            ctx.decode(tokens[:P])
            if not compress:
                return held_sets(ctx, per_head)
            ctx.compress_prompt()
            return [s.budget_prefill for s in ctx.kv_layer_stats()], held_sets(ctx, per_head)

    with Model(path) as model:
        held = prompt_in(plan_mod.Plan.from_dict({**d, "allocation": "plan", "allocation_cap": None}), compress=False)
        got_budgets, kept = prompt_in(plan, compress=True)
    # the slack held more than the budget, and no more than budget x slack: the streaming evicted the last chunk too
    assert all(b < len(pos) <= c for sets, b, c in zip(held, budgets, caps) for pos, _ in sets)
    ranked = [[_protect(sc.copy(), b, pat.n_sink, w) for _, sc in sets] for sets, b in zip(held, budgets)]
    nh = [CFG.n_head_kv] * CFG.n_layer
    want = allocate_prompt(ranked, list(budgets), nh, B_MIN, caps=caps, relative=allocation == "prompt_median")
    if cap is not None:  # cap 1: a layer keeps no more than its budget, what the slack alone would not stop
        uncapped = want
        caps = [min(c, int(np.ceil(b * cap))) for b, c in zip(budgets, caps)]
        want = allocate_prompt(ranked, list(budgets), nh, B_MIN, caps=caps)
        assert uncapped != list(budgets) and want == list(budgets)
    assert got_budgets == want and (want != list(budgets) or cap is not None) and all(b <= c for b, c in zip(want, caps))
    for il in range(CFG.n_layer):
        for (pos, sc), (got, _) in zip(held[il], kept[il]):
            best = keep_topk(_protect(sc.copy(), want[il], pat.n_sink, w), want[il])
            assert got.tolist() == pos[best].tolist(), f"layer {il}"


def test_budgets_return_to_the_plan_for_the_next_prompt_and_chunked_without_slack_keeps_them(twin, tokens):
    _, path = twin
    plan = alloc_plan("kvzip", ("head", "head"))
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=256, type_k="f32", type_v="f32") as ctx:
            ctx.decode(tokens[:P])
            ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            moved = [s.budget_prefill for s in ctx.kv_layer_stats()]
            assert moved != [B, B] and sum(moved) == 2 * B
            ctx.clear()
            assert [s.budget_prefill for s in ctx.kv_layer_stats()] == [B, B]
            ctx.decode(tokens[:P])
            ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            assert [s.budget_prefill for s in ctx.kv_layer_stats()] == moved
        with pytest.warns(UserWarning, match="with a slack of 1 it keeps the plan's budgets"):
            model.set_plan(plan_mod.Plan.from_dict({**plan.to_dict(), "layers": [
                {**lp, "prefill": {**lp["prefill"], "pattern": "snapkv", "obs_window": 6, "pool_kernel": 3}}
                for lp in plan.to_dict()["layers"]]}), prefill="chunked")
        with model.context(n_ctx=256, n_ubatch=16, n_batch=16) as ctx:
            ctx.decode(tokens[:P])
            assert [s.budget_prefill for s in ctx.kv_layer_stats()] == [B, B]


@pytest.mark.parametrize("selections", [("layer", "layer"), ("head", "head")])
@pytest.mark.parametrize("prefill,slack", [("exact", None), ("chunked", 2.0)])
def test_a_state_saved_after_the_allocation_loads_at_its_budgets_and_goes_on_identically(twin, tokens, selections,
                                                                                          prefill, slack):
    """The allocated budgets travel in the state: a fresh context of the same plan and prefill continues as the
    saved one would have (kept sets and logits); a plan that does not allocate per prompt refuses the state."""
    _, path = twin
    plan = alloc_plan("snapkv", selections)
    kw = dict(n_ctx=256, type_k="f32", type_v="f32", **({"n_ubatch": 16, "n_batch": 16} if slack else {}))

    def steps(ctx):
        out = []
        for t in tokens[P:]:
            ctx.decode([t])
            out.append(([[ctx.kept_positions(il, h) for h in range(CFG.n_head_kv)] for il in range(CFG.n_layer)],
                        ctx.logits().copy()))
        return out

    with Model(path) as model:
        model.set_plan(plan, prefill=prefill, prefill_slack=slack)
        with model.context(**kw) as ctx:
            ctx.decode(tokens[:P])
            ctx.compress_prompt()
            stats = ctx.kv_layer_stats()
            state = ctx.state_bytes()
            want = steps(ctx)
        budgets = [s.budget_prefill for s in stats]
        assert budgets != [B] * CFG.n_layer  # this prompt moved tokens between the layers
        with model.context(**kw) as ctx:
            ctx.load_state_bytes(state)
            loaded = ctx.kv_layer_stats()
            assert [s.budget_prefill for s in loaded] == budgets
            assert [s.capacity for s in loaded] == [s.capacity for s in stats]
            got = steps(ctx)
        # chunked caches keep holes where tokens left; a restore packs the kept tokens into the first cells: the
        # same tokens in another summation order (test_polykv_native's state round trip)
        atol = 1e-6 if prefill == "exact" else 1e-3
        for (k_want, l_want), (k_got, l_got) in zip(want, got):
            assert k_got == k_want
            np.testing.assert_allclose(l_got, l_want, rtol=0, atol=atol)
        ctx_plan = plan_mod.Plan.from_dict({**plan.to_dict(), "allocation": "plan"})
        model.set_plan(ctx_plan, prefill=prefill, prefill_slack=slack)
        with model.context(**kw) as ctx:
            with pytest.raises(Exception, match="allocation"):
                ctx.load_state_bytes(state)


def test_layers_of_different_patterns_keep_their_own_pools(twin, tokens, hf_reference, recon_attn):
    """A plan mixing a SnapKV layer and a KVzip layer re-splits each pattern's budgets among its own layers only:
    each pool here is one layer, so both keep the plan's budget and the sets the reference keeps at it, where one
    pool across both patterns would have moved tokens (KVzip's probabilities and SnapKV's window sums are not on
    one scale)."""
    _, path = twin
    kv = alloc_plan("kvzip", ("layer", "layer")).to_dict()
    sn = alloc_plan("snapkv", ("layer", "layer")).to_dict()
    plan = plan_mod.Plan.from_dict({**kv, "layers": [sn["layers"][0], kv["layers"][1]]})
    scores = []
    for il, pre in enumerate((pattern_from_phase_plan(plan.layers[0].prefill),
                              pattern_from_phase_plan(plan.layers[1].prefill))):
        logp, _ = hf_reference[il]
        if il == 0:
            scores.append([pre.scores(B, P, attn=softmax_causal(logp[:, :P, :P]))])
        else:
            scores.append([pre.scores(B, P, attn=recon_attn[il])])
    assert allocate_prompt(scores, [B, B], [CFG.n_head_kv] * 2, B_MIN) != [B, B]  # one pool would move tokens
    with Model(path) as model:
        model.set_plan(plan, prefill="exact")
        with model.context(n_ctx=256, type_k="f32", type_v="f32") as ctx:
            ctx.decode(tokens[:P])
            ctx.compress_prompt_kvzip(tokens[:P], prefix=PREFIX, chunk=CHUNK)
            assert [s.budget_prefill for s in ctx.kv_layer_stats()] == [B, B]
            got = [ctx.kept_positions(il) for il in range(CFG.n_layer)]
    for il in range(CFG.n_layer):
        assert got[il] == sorted(np.argsort(scores[il][0], kind="stable")[-B:].tolist()), f"layer {il}"
